//! A hostile tenant against its container's accounting (issue 16): whatever it does
//! to the files of `VGPU_CONTAINER_DIR` — truncate, grow, rewrite, replace (new
//! inode, symlink), delete or pre-create the region or `slots.lock` — or to the
//! region's shared memory itself (garbage, removal), while two processes hold 128 +
//! 64 MiB of a 256 MiB quota, no process of the container crashes or hangs, and a
//! third process can take at most the 64 MiB left. A container directory on a full
//! filesystem works too.

#![allow(unsafe_code)] // the tenant's own shmget/shmctl/shmat, in `segment_attack`

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use vgpu_tests::{Container, Probe, SimNode, num, probe_bin};

const MIB: u64 = 1 << 20;

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

/// The names a tenant attacks: whatever the container directory holds, and the region
/// and lock file names of every layout the shim ever used.
fn targets(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = ["shim-v2.bin", "shim-v3.bin", "slots.lock"]
        .iter()
        .map(|n| dir.join(n))
        .collect();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if !v.contains(&e.path()) {
            v.push(e.path());
        }
    }
    v
}

#[derive(Debug, Clone, Copy)]
enum Attack {
    Truncate,
    Grow,
    Rewrite,
    NewInode,
    Symlink,
    Delete,
}

fn attack(dir: &Path, how: Attack) {
    for p in targets(dir) {
        let exists = p.symlink_metadata().is_ok();
        match how {
            Attack::Truncate if exists => {
                let _ = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .and_then(|f| f.set_len(4096));
            }
            Attack::Grow if exists => {
                let _ = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .and_then(|f| f.set_len(64 << 20));
            }
            Attack::Rewrite => {
                let _ = std::fs::write(&p, vec![0xa5u8; 1 << 20]);
            }
            Attack::NewInode => {
                let tmp = dir.join(".evil");
                let _ = std::fs::write(&tmp, vec![0u8; 128 << 10]);
                let _ = std::fs::rename(&tmp, &p);
            }
            Attack::Symlink => {
                let _ = std::fs::remove_file(&p);
                let _ = std::os::unix::fs::symlink("/dev/zero", &p);
            }
            Attack::Delete if exists => {
                let _ = std::fs::remove_file(&p);
            }
            _ => {}
        }
    }
}

fn holder(node: &SimNode, c: &Container, size: &str) -> Probe {
    let p = node.spawn_probe_in(
        Some(c),
        &[
            "init", "alloc", size, "ready", "wait", "meminfo", "alloc", "2Mi",
        ],
        Duration::from_secs(30),
    );
    assert!(
        p.seen.iter().any(|l| l.starts_with("alloc=ok")),
        "{:?}",
        p.seen
    );
    p
}

/// Two processes hold 128 + 64 MiB of 256 MiB; `tamper` runs; a third process then
/// gets at most the 64 MiB left, and the first two carry on with their accounts intact,
/// none crashing.
fn quota_holds_through(what: &str, tamper: impl FnOnce(&Container)) {
    let node = node();
    let c = Container::new("256Mi");
    let a = holder(&node, &c, "128Mi");
    let b = holder(&node, &c, "64Mi");
    tamper(&c);
    let out = node.probe_in(Some(&c), &["init", "alloc-until-oom", "2Mi", "meminfo"]);
    let got = num(&out, "allocated");
    assert!(
        got <= 64 * MIB,
        "{what}: a third process took {} MiB: the container holds {} MiB of 256 MiB\n{out}",
        got / MIB,
        (192 * MIB + got) / MIB
    );
    assert_eq!(
        got,
        64 * MIB,
        "{what}: the 64 MiB left must stay usable\n{out}"
    );
    // The third process has exited: the first holder sees exactly the 64 MiB left (both
    // holders' charges intact); once it has exited too, the second sees 256 − 64 MiB.
    for (p, free) in [(a, 64 * MIB), (b, 192 * MIB)] {
        let seen = p.finish(Duration::from_secs(20)).join("\n");
        assert!(
            seen.contains(&format!("free={free} total=268435456")),
            "{what}: {seen}"
        );
        assert_eq!(seen.matches("alloc=ok").count(), 2, "{what}: {seen}");
    }
}

#[test]
fn truncating_growing_or_rewriting_the_files_harms_nobody() {
    for how in [Attack::Truncate, Attack::Grow, Attack::Rewrite] {
        quota_holds_through(&format!("{how:?}"), |c| attack(&c.dir(), how));
    }
}

#[test]
fn replacing_or_deleting_the_files_does_not_let_the_container_exceed_its_quota() {
    for how in [Attack::NewInode, Attack::Symlink, Attack::Delete] {
        quota_holds_through(&format!("{how:?}"), |c| attack(&c.dir(), how));
    }
}

#[test]
fn pre_created_garbage_files_do_not_stop_the_container() {
    for how in [Attack::Rewrite, Attack::Symlink, Attack::NewInode] {
        let node = node();
        let c = Container::new("256Mi");
        std::fs::create_dir_all(c.dir()).expect("container directory");
        std::fs::set_permissions(c.dir(), std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        attack(&c.dir(), how);
        // A directory and a FIFO where files are expected, too.
        let _ = std::fs::remove_file(c.dir().join("shim-v3.bin"));
        std::fs::create_dir(c.dir().join("shim-v3.bin")).expect("a directory");
        let _ = std::fs::remove_file(c.dir().join("slots.lock"));
        let fifo = Command::new("mkfifo")
            .arg(c.dir().join("slots.lock"))
            .status();
        assert!(fifo.is_ok_and(|s| s.success()), "mkfifo");
        let out = node.probe_in(Some(&c), &["init", "alloc-until-oom", "2Mi"]);
        assert_eq!(num(&out, "allocated"), 256 * MIB, "{how:?}: {out}");
    }
}

/// The tenant's view of the region's shared memory: the segments under the keys the
/// shim derives for the container directory (at least one: its processes run).
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

/// The tenant removes the region's shared memory (`IPC_RMID`) under the two holders,
/// and in a second round also puts a blank segment of its own under the region's key:
/// new processes join the removed region the holders still use (ADR 0015), so the
/// container keeps one budget. Before, a new process made a fresh region and the
/// container could hold its quota twice.
#[test]
fn removing_the_shared_region_does_not_let_the_container_exceed_its_quota() {
    let remove = |c: &Container, blank_under_key: bool| {
        for id in segment_ids(&c.dir()) {
            // SAFETY: shmid_ds is plain old data; all-zero is valid.
            let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
            // SAFETY: a valid out-pointer for IPC_STAT.
            assert_eq!(unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) }, 0);
            // SAFETY: IPC_RMID takes no buffer.
            let rc = unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
            assert_eq!(rc, 0, "IPC_RMID of segment {id}");
            if blank_under_key {
                let key = vgpu_tests::region_keys(&c.dir())[0];
                // SAFETY: shmget only allocates a segment.
                let blank = unsafe { libc::shmget(key, ds.shm_segsz, libc::IPC_CREAT | 0o666) };
                assert!(blank >= 0, "a blank segment under key {key:#x}");
            }
        }
    };
    quota_holds_through("IPC_RMID", |c| remove(c, false));
    quota_holds_through("IPC_RMID and a blank segment under the key", |c| {
        remove(c, true)
    });
}

#[test]
fn garbage_written_into_the_shared_region_crashes_no_process() {
    quota_holds_or_refuses_through_garbage();
}

/// A tenant that attaches the region and fills it with garbage can forge the container's
/// counters (ADR 0008: caught by the plugin's audit, not preventable in the container),
/// but no process of the container crashes or hangs, then or later.
fn quota_holds_or_refuses_through_garbage() {
    let node = node();
    let c = Container::new("256Mi");
    let a = holder(&node, &c, "128Mi");
    for id in segment_ids(&c.dir()) {
        // SAFETY: attaching a segment read-write at an address the kernel picks.
        let p = unsafe { libc::shmat(id, std::ptr::null(), 0) };
        assert_ne!(p as isize, -1, "shmat");
        // SAFETY: shmid_ds is plain old data; all-zero is valid.
        let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
        // SAFETY: a valid out-pointer for IPC_STAT.
        assert_eq!(unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) }, 0);
        let len = ds.shm_segsz;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for i in 0..len / 8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // SAFETY: word i lies within the attached segment of `len` bytes.
            unsafe { p.cast::<u64>().add(i).write_volatile(x) };
        }
        // SAFETY: detaching what was attached above.
        unsafe { libc::shmdt(p) };
    }
    // New processes start and run; the first one's next allocation either fits or is
    // refused, never a crash.
    for _ in 0..3 {
        let out = node.probe_in(Some(&c), &["init", "alloc", "2Mi", "meminfo", "free-all"]);
        assert!(out.contains("alloc="), "{out}");
    }
    let seen = a.finish(Duration::from_secs(20)).join("\n");
    assert!(seen.contains("alloc="), "{seen}");
}

#[test]
fn a_container_directory_on_a_full_filesystem_works_or_fails_clearly() {
    let mnt = tempfile::tempdir().expect("mount point");
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(mnt.path())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let why = "`mount -t tmpfs -o size=64k` failed";
        return vgpu_test_needs::skip(vgpu_test_needs::Need::Mount, why);
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _guard = Unmount(mnt.path());
    let dir = mnt.path().join("vgpu");
    std::fs::create_dir(&dir).expect("container directory");
    // Fill the filesystem.
    let _ = std::fs::write(mnt.path().join("fill"), vec![1u8; 1 << 20]);
    let node = node();
    for run in 0..3 {
        let mut cmd = node.command(probe_bin());
        cmd.env("LD_PRELOAD", vgpu_tests::shim_lib())
            .env("VGPU_CONTAINER_DIR", &dir)
            .env("VGPU_MEMORY_LIMIT", "256Mi")
            .args(["init", "alloc-until-oom", "2Mi"]);
        let out = cmd.output().expect("run cuda-probe");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            None,
            "run {run}: killed by a signal: {stdout}{stderr}"
        );
        if out.status.success() {
            assert_eq!(num(&stdout, "allocated"), 256 * MIB, "run {run}: {stdout}");
        } else {
            assert!(
                stderr.contains(&dir.display().to_string()),
                "run {run}: the error must name the directory: {stderr}"
            );
        }
    }
}
