//! A hostile tenant against where its quota comes from (issue 39, items 1 and 2; ADR
//! 0042), each attack a real process on the simulated GPU:
//!
//! - **A container directory of its own choosing.** The device plugin mounts the
//!   container's directory read-only at the fixed `/etc/vgpu` (here: a private mount
//!   namespace that bind-mounts the test's container directory there, over an overlay of
//!   `/etc`, so the real `/etc` is never touched). A process that points
//!   `VGPU_CONTAINER_DIR` at an empty directory, or at one with a forged `vgpu.conf`, and
//!   asks for more (`VGPU_MEMORY_LIMIT`, `VGPU_ON_ERROR=unenforced`, `VGPU_TENANT`) is
//!   held to the container's quota and its one budget, and says so on stderr. Before, it
//!   allocated the whole GPU beside a holder of the real budget.
//! - **The region's mode changed under the container.** A tenant's `shmctl(IPC_SET)` mode
//!   0000 on the live region made the next process (without `CAP_IPC_OWNER`, as in a
//!   default container) take it for another's and make a fresh, empty region: 448 MiB
//!   held on a 256 MiB quota. Now the process gives the region its mode back and joins
//!   it (it may: same uid), or, when it may not, fails loudly.
//!
//! The tests run as root (CI does): the namespaces and the capability drop need it.

#![allow(unsafe_code)] // the tenant's own shmget/shmctl, in `change_region_mode`

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use vgpu_tests::plugin_mount::PluginMount;
use vgpu_tests::{Container, Probe, SimNode, num, probe_bin};

const MIB: u64 = 1 << 20;
/// cuda-sim's first device.
const GPU: &str = "GPU-51570000-0000-4000-8000-000000000000";

fn node() -> SimNode {
    SimNode::new(
        r#"
        [[device]]
        memory = "8Gi"
        context_overhead = "300Mi"
        alloc_granularity = "2Mi"
        "#,
    )
}

/// The quota record the device plugin writes: `mib` MiB of [`GPU`].
fn quota_record(mib: u64) -> String {
    format!(
        r#"{{"version":1,"namespace":"ns","pod":"p","uid":"u","container":"main","init":false,"gpus":[{{"uuid":"{GPU}","memory_mib":{mib},"compute_milli":100,"slices":1}}],"device_ids":[]}}"#
    )
}

/// A container as the device plugin makes one: its directory (the plugin's writable
/// `VGPU_CONTAINER_DIR`) holding the quota file, mounted read-only at `/etc/vgpu` in the
/// namespace of each of its processes.
struct PluginContainer {
    _root: tempfile::TempDir,
    dir: PathBuf,
    mount: PluginMount,
}

impl PluginContainer {
    fn new(quota_mib: u64) -> PluginContainer {
        let root = tempfile::tempdir().expect("temporary directory");
        let dir = root.path().join("vgpu");
        std::fs::create_dir(&dir).expect("container directory");
        std::fs::write(dir.join("vgpu.conf"), quota_record(quota_mib)).expect("vgpu.conf");
        PluginContainer {
            _root: root,
            dir,
            mount: PluginMount::new(),
        }
    }

    /// A `cuda-probe` command in the container, with the environment `env` (the
    /// device plugin's is `VGPU_CONTAINER_DIR` = its directory).
    fn command(&self, node: &SimNode, env: &[(&str, &str)]) -> Command {
        self.running(node, env, &probe_bin())
    }

    /// `program` in the container, with the environment `env`.
    fn running(&self, node: &SimNode, env: &[(&str, &str)], program: &Path) -> Command {
        let mut c = node.command("unshare");
        c.args(["--mount", "--propagation", "private"])
            .args(
                self.mount
                    .args(&self.dir, Some(&vgpu_tests::shim_lib()), program),
            );
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }
}

/// Whether this machine lets the test make the container's mount namespace (root,
/// overlayfs); says why not, as a skip (a failure under CI), when it does not.
fn namespaces_allowed(node: &SimNode) -> bool {
    let c = PluginContainer::new(1);
    match c.running(node, &[], Path::new("/bin/true")).output() {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            let why = format!(
                "cannot mount /etc/vgpu in a private mount namespace ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            );
            vgpu_test_needs::skip(vgpu_test_needs::Need::Mount, &why);
            false
        }
        Err(e) => {
            let why = format!("cannot run unshare: {e}");
            vgpu_test_needs::skip(vgpu_test_needs::Need::Tool("unshare"), &why);
            false
        }
    }
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Attack 1: a process of a 256 MiB container, one of whose processes holds 128 MiB,
/// points `VGPU_CONTAINER_DIR` at an empty directory, then at a directory with a forged
/// 8 GiB `vgpu.conf` (and asks for 79 GiB, `unenforced` and a tenant of its own): each
/// time it gets the 128 MiB left, not the GPU, and says what it was held to.
#[test]
fn a_container_directory_the_tenant_chooses_neither_sets_the_quota_nor_makes_a_budget() {
    let node = node();
    if !namespaces_allowed(&node) {
        return;
    }
    let c = PluginContainer::new(256);
    let dir = c.dir.display().to_string();
    let holder_env = [("VGPU_CONTAINER_DIR", dir.as_str())];
    let holder = Probe::start(
        c.command(&node, &holder_env),
        &["init", "alloc", "128Mi", "ready", "wait", "meminfo"],
        Duration::from_secs(30),
    );
    assert!(
        holder.seen.iter().any(|l| l.starts_with("alloc=ok")),
        "{:?}",
        holder.seen
    );
    let empty = tempfile::tempdir().expect("the tenant's directory");
    let forged = tempfile::tempdir().expect("the tenant's forged directory");
    std::fs::write(forged.path().join("vgpu.conf"), quota_record(8192)).expect("forge");
    let empty_dir = empty.path().display().to_string();
    let forged_dir = forged.path().display().to_string();
    let attacks: [(&str, Vec<(&str, &str)>); 2] = [
        (
            "an empty directory",
            vec![("VGPU_CONTAINER_DIR", empty_dir.as_str())],
        ),
        (
            "a forged quota file",
            vec![
                ("VGPU_CONTAINER_DIR", forged_dir.as_str()),
                ("VGPU_MEMORY_LIMIT", "79Gi"),
                ("VGPU_ON_ERROR", "unenforced"),
                ("VGPU_TENANT", "someone-else"),
            ],
        ),
    ];
    let mut results = Vec::new();
    for (what, env) in &attacks {
        let out = c
            .command(&node, env)
            .args(["init", "alloc-until-oom", "2Mi"])
            .output()
            .expect("run cuda-probe in the container");
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{what}: {stdout}{stderr}");
        let got = num(&stdout, "allocated");
        eprintln!(
            "{what}: allocated {got} bytes beside the holder's 128 MiB: the container holds {} MiB of 256 MiB",
            (128 * MIB + got) / MIB
        );
        results.push((what, env, got, stdout, stderr));
    }
    for (what, env, got, stdout, stderr) in results {
        assert_eq!(
            got,
            128 * MIB,
            "{what}: the process must get the 128 MiB left of the container's 256 MiB, not {} MiB\n{stdout}\n{stderr}",
            got / MIB
        );
        let tenant_dir = env[0].1;
        assert!(
            stderr.contains(&format!("VGPU_CONTAINER_DIR={tenant_dir}"))
                && stderr.contains("/etc/vgpu"),
            "{what}: the process must say its directory was not used: {stderr}"
        );
        if env.len() > 1 {
            for said in ["VGPU_ON_ERROR=unenforced", "VGPU_TENANT", "84825604096"] {
                assert!(stderr.contains(said), "{what}: {said} not said: {stderr}");
            }
        }
    }
    // The holder's account is intact: it sees the 128 MiB it holds, of 256 MiB.
    let seen = holder.finish(Duration::from_secs(20)).join("\n");
    assert!(
        seen.contains(&format!("free={} total={}", 128 * MIB, 256 * MIB)),
        "{seen}"
    );
}

/// The keyed segments of the region of the container directory `dir` (at least one:
/// its processes run).
fn segment_ids(dir: &Path) -> Vec<i32> {
    let ids: Vec<i32> = vgpu_tests::region_keys(dir)
        .into_iter()
        .filter_map(|k| {
            // SAFETY: shmget with flags 0 only looks a key up.
            let id = unsafe { libc::shmget(k, 0, 0) };
            (id >= 0).then_some(id)
        })
        .collect();
    assert!(!ids.is_empty(), "no region segment for {}", dir.display());
    ids
}

/// What a tenant of the container's uid may do to the live region: `shmctl(IPC_SET)`
/// with `mode`.
fn change_region_mode(dir: &Path, mode: u16) {
    for id in segment_ids(dir) {
        // SAFETY: shmid_ds is plain old data; all-zero is valid.
        let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
        // SAFETY: a valid out-pointer for IPC_STAT.
        assert_eq!(unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) }, 0);
        ds.shm_perm.mode = mode;
        // SAFETY: IPC_SET reads uid, gid and mode from a valid shmid_ds.
        let rc = unsafe { libc::shmctl(id, libc::IPC_SET, &mut ds) };
        assert_eq!(rc, 0, "IPC_SET mode {mode:o} on segment {id}");
    }
}

fn holder(node: &SimNode, c: &Container, size: &str) -> Probe {
    let p = node.spawn_probe_in(
        Some(c),
        &["init", "alloc", size, "ready", "wait", "meminfo"],
        Duration::from_secs(30),
    );
    assert!(
        p.seen.iter().any(|l| l.starts_with("alloc=ok")),
        "{:?}",
        p.seen
    );
    p
}

/// `cuda-probe` in container `c` without the capabilities `caps` (`-ipc_owner,…`; a
/// default container's processes run without `CAP_IPC_OWNER` and `CAP_SYS_ADMIN`).
fn without_caps(node: &SimNode, c: &Container, caps: &str, args: &[&str]) -> Output {
    let mut cmd = node.command("setpriv");
    c.apply(&mut cmd);
    cmd.arg(format!("--inh-caps={caps}"))
        .arg(format!("--bounding-set={caps}"))
        .arg(probe_bin())
        .args(args)
        .output()
        .expect("run cuda-probe under setpriv")
}

/// Attack 2: two processes hold 128 + 64 MiB of 256 MiB; a tenant sets the live
/// region's mode to 0000; a third process without `CAP_IPC_OWNER` gets the 64 MiB left
/// (before: a fresh region, 256 MiB, 448 MiB held), says that it restored the mode, and
/// the holders' accounts are intact.
#[test]
fn a_region_whose_mode_the_tenant_changed_is_joined_not_replaced() {
    let node = node();
    let c = Container::new("256Mi");
    let a = holder(&node, &c, "128Mi");
    let b = holder(&node, &c, "64Mi");
    change_region_mode(&c.dir(), 0);
    let out = without_caps(&node, &c, "-ipc_owner", &["init", "alloc-until-oom", "2Mi"]);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "setpriv not usable here? {stdout}{stderr}"
    );
    let got = num(&stdout, "allocated");
    eprintln!(
        "mode 0000: a third process allocated {got} bytes: the container holds {} MiB of 256 MiB",
        (192 * MIB + got) / MIB
    );
    assert_eq!(
        got,
        64 * MIB,
        "the third process must get the 64 MiB left, not {} MiB (the container would hold {} MiB of 256)\n{stdout}\n{stderr}",
        got / MIB,
        (192 * MIB + got) / MIB
    );
    assert!(
        stderr.contains("mode was 000") && stderr.contains("restored"),
        "the process must say what it found and did: {stderr}"
    );
    for (p, free) in [(a, 64 * MIB), (b, 192 * MIB)] {
        let seen = p.finish(Duration::from_secs(20)).join("\n");
        assert!(
            seen.contains(&format!("free={free} total={}", 256 * MIB)),
            "{seen}"
        );
    }
}

/// Attack 2, where the process may not give the region its mode back: the region was
/// made by a process of another uid (4242) of the container, and the process that finds
/// it mode 0000 is root without `CAP_IPC_OWNER` and `CAP_SYS_ADMIN` (which may change
/// any segment's mode), as in a default container: a loud error, and `cuInit` fails
/// (`VGPU_ON_ERROR=fail`, the default), never a fresh region beside the container's.
#[test]
fn a_region_the_process_may_not_use_is_a_loud_error_not_a_fresh_budget() {
    use std::os::unix::fs::PermissionsExt;
    let node = node();
    let c = Container::new("256Mi");
    // The other uid reaches the node's and the container's directories.
    for d in [node.state_dir(), c.dir()] {
        let parent = d.parent().expect("a temporary directory").to_owned();
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the temporary directory");
    }
    for d in [node.state_dir(), c.dir()] {
        std::fs::create_dir(&d).expect("the node's or the container's directory");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777))
            .expect("chmod the node's or the container's directory");
    }
    let mut cmd = node.command("setpriv");
    c.apply(&mut cmd);
    cmd.args(["--reuid=4242", "--regid=4242", "--clear-groups"])
        .arg(probe_bin());
    let a = Probe::start(
        cmd,
        &["init", "alloc", "128Mi", "ready", "wait", "meminfo"],
        Duration::from_secs(30),
    );
    assert!(
        a.seen.iter().any(|l| l.starts_with("alloc=ok")),
        "{:?}",
        a.seen
    );
    change_region_mode(&c.dir(), 0);
    let out = without_caps(
        &node,
        &c,
        "-ipc_owner,-sys_admin",
        &["init", "alloc-until-oom", "2Mi"],
    );
    let (stdout, stderr) = text(&out);
    let allocated = vgpu_tests::field(&stdout, "allocated")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    eprintln!(
        "mode 0000, made by uid 4242: a root process without CAP_IPC_OWNER allocated {allocated} bytes beside the holder's 128 MiB"
    );
    assert_eq!(
        allocated,
        0,
        "a process that may not use the region must allocate nothing, not {} MiB\n{stdout}\n{stderr}",
        allocated / MIB
    );
    assert!(
        stderr.contains("may not use it") && stderr.contains("mode 000"),
        "the error must name the segment's mode and owner: {stderr}"
    );
    // The tenant's change undone, so that the holder's exit is clean.
    change_region_mode(&c.dir(), 0o666);
    let seen = a.finish(Duration::from_secs(20)).join("\n");
    assert!(
        seen.contains(&format!("free={} total={}", 128 * MIB, 256 * MIB)),
        "{seen}"
    );
}
