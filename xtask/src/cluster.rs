//! `cargo xtask cluster`: the one-node Kubernetes run of issue 40 (docs/cluster.md).
//!
//! Real Kubernetes binaries come from the directory `VGPU_K8S_BIN` names (the project
//! ships none and no recipe to build them); without it the task says so and skips,
//! visibly, having run nothing. With them it builds the project's images
//! (`cargo xtask images`), the simulated driver (`cargo xtask sim`), `cuda-probe`, and two
//! images only this run needs (a test image with busybox and `cuda-probe`, also the pod
//! sandbox image; and `kube-scheduler` from `VGPU_K8S_BIN` for the second scheduler), then
//! hands over to `tests/cluster/run.sh`, which brings the node up, installs from
//! `deploy/`, checks, and tears everything down. Needs root; not a CI step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::images;

/// The Kubernetes binaries the run needs from `VGPU_K8S_BIN` (`helm` is optional: with it
/// the chart is rendered and compared with `deploy/`).
pub const K8S_BINARIES: [&str; 5] = [
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kubectl",
];

/// The host programs the run needs (Debian: etcd-server, containerd, runc,
/// containernetworking-plugins, busybox-static, openssl, curl, iproute2).
const HOST_PROGRAMS: [&str; 8] = [
    "etcd",
    "containerd",
    "containerd-shim-runc-v2",
    "runc",
    "ctr",
    "openssl",
    "curl",
    "ip",
];

/// Why the run cannot start here, or `None` when everything is present.
pub fn missing(bin_dir: Option<&Path>) -> Option<String> {
    let Some(dir) = bin_dir else {
        return Some(
            "VGPU_K8S_BIN is not set: name a directory holding kube-apiserver, \
             kube-controller-manager, kube-scheduler, kubelet and kubectl (docs/cluster.md)"
                .into(),
        );
    };
    let absent: Vec<&str> = K8S_BINARIES
        .iter()
        .copied()
        .filter(|b| !dir.join(b).is_file())
        .collect();
    if !absent.is_empty() {
        return Some(format!(
            "VGPU_K8S_BIN={} lacks {}",
            dir.display(),
            absent.join(", ")
        ));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let absent: Vec<&str> = HOST_PROGRAMS
        .iter()
        .copied()
        .filter(|p| !std::env::split_paths(&path).any(|d| d.join(p).is_file()))
        .collect();
    if !absent.is_empty() {
        return Some(format!(
            "host programs missing: {} (apt-get install etcd-server containerd runc \
             containernetworking-plugins busybox-static openssl curl iproute2)",
            absent.join(", ")
        ));
    }
    for f in ["/usr/lib/cni/loopback", "/bin/busybox"] {
        if !Path::new(f).exists() {
            return Some(format!(
                "{f} is missing (containernetworking-plugins, busybox-static)"
            ));
        }
    }
    None
}

fn run(cmd: &mut Command) -> Result<()> {
    let st = cmd.status().with_context(|| format!("run {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed ({st})");
    }
    Ok(())
}

/// `kube-scheduler --version`'s `vX.Y.Z`.
fn k8s_version(bin: &Path) -> Result<String> {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .with_context(|| format!("run {} --version", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find(|w| w.starts_with('v'))
        .map(str::to_owned)
        .with_context(|| format!("{} --version printed {text:?}", bin.display()))
}

/// `cargo xtask cluster`.
pub fn cluster(root: &Path, sim: fn() -> Result<PathBuf>) -> Result<()> {
    let bin_dir = std::env::var_os("VGPU_K8S_BIN").map(PathBuf::from);
    if let Some(why) = missing(bin_dir.as_deref()) {
        println!("cluster: SKIPPED, nothing was run: {why}");
        return Ok(());
    }
    let bin_dir = bin_dir.context("checked above")?;
    // containerd and kubelet need root: the effective user from `id -u`.
    let uid = Command::new("id").arg("-u").output().context("run id -u")?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        bail!("cargo xtask cluster needs root (it runs containerd and kubelet)");
    }
    let libs = sim()?;
    images::images(root)?;
    run(Command::new(env!("CARGO"))
        .args([
            "build",
            "--release",
            "-p",
            "vgpu-tests",
            "--bin",
            "cuda-probe",
        ])
        .current_dir(root))?;
    let dir = root.join("target/images/cluster");
    std::fs::create_dir_all(&dir)?;

    // The test image: busybox (static) and cuda-probe with what it links, and what the shim
    // links (the device plugin preloads the floor-built libvgpu.so into every tenant: it
    // needs libpthread.so.0 and libdl.so.2, which glibc >= 2.34 images keep as stubs). Its
    // Cmd makes it the pod sandbox image too (busybox sleep; containerd kills sandboxes
    // with SIGKILL).
    let probe = root.join("target/release/cuda-probe");
    let shim = root.join("target/zig/x86_64-unknown-linux-gnu/release/libvgpu.so");
    let mut files = BTreeMap::new();
    files.insert(
        "/bin/busybox".to_owned(),
        (PathBuf::from("/bin/busybox"), 0o755),
    );
    let mut linked = images::linked_libraries(&probe)?;
    linked.extend(images::linked_libraries(&shim)?);
    for lib in linked {
        let real = std::fs::canonicalize(&lib)?;
        files.insert(lib.display().to_string(), (real, 0o755));
    }
    files.insert("/usr/bin/cuda-probe".to_owned(), (probe, 0o755));
    let test_ref = format!("docker.io/vgpu/cluster-test:{}", images::TAG);
    let size = images::oci_archive(
        &dir.join("cluster-test.oci.tar"),
        &test_ref,
        &files,
        &["PATH=/usr/bin:/bin"],
        &["/bin/busybox", "sleep", "2147483647"],
    )?;
    println!("{test_ref}: {:.1} MiB", size as f64 / f64::from(1 << 20));

    // The second scheduler's image: the kube-scheduler binary of VGPU_K8S_BIN (static).
    let sched = bin_dir.join("kube-scheduler");
    let version = k8s_version(&sched)?;
    let sched_ref = format!("registry.k8s.io/kube-scheduler:{version}");
    let mut files = BTreeMap::new();
    files.insert(
        "/usr/local/bin/kube-scheduler".to_owned(),
        (sched.clone(), 0o755),
    );
    let size = images::oci_archive(
        &dir.join("kube-scheduler.oci.tar"),
        &sched_ref,
        &files,
        &["PATH=/usr/local/bin:/usr/bin:/bin"],
        &[],
    )?;
    println!("{sched_ref}: {:.1} MiB", size as f64 / f64::from(1 << 20));

    let st = Command::new("bash")
        .arg(root.join("tests/cluster/run.sh"))
        .env("VGPU_K8S_BIN", &bin_dir)
        .env("VGPU_K8S_VERSION", &version)
        .env("VGPU_SIM_LIBS", &libs)
        .env("VGPU_ROOT", root)
        .current_dir(root)
        .status()
        .context("run tests/cluster/run.sh")?;
    if !st.success() {
        bail!("the cluster run failed ({st}); its log is above");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_binaries_the_run_says_what_is_missing() {
        let why = missing(None).expect("no directory: a reason");
        assert!(why.contains("VGPU_K8S_BIN is not set"), "{why}");
        let empty = std::env::temp_dir().join(format!("vgpu-k8s-bin-{}", std::process::id()));
        std::fs::create_dir_all(&empty).expect("mkdir");
        let why = missing(Some(&empty)).expect("empty directory: a reason");
        std::fs::remove_dir(&empty).expect("rmdir");
        for b in K8S_BINARIES {
            assert!(why.contains(b), "{why} does not name {b}");
        }
    }
}
