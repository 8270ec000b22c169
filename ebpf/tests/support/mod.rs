//! Fixtures of the real-kernel tests: the skip (a failure under `CI=true`), a cgroup2
//! child directory, device nodes made with mknod, a bpf file system, and a scripted child
//! process (the ebpf-probe binary) placed in a cgroup.

#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vgpu_ebpf::{Event, EventKind, EventReader, preflight};

/// Why this machine cannot run the real-kernel tests, if it cannot.
fn missing_privilege() -> Option<String> {
    if let Err(error) = preflight::check_capabilities() {
        return Some(error.to_string());
    }
    if let Err(error) = preflight::check_btf() {
        return Some(error.to_string());
    }
    if cgroup2_mount().is_none() {
        return Some("no cgroup2 mount in /proc/self/mounts".to_owned());
    }
    if let Err(error) = preflight::check_tracefs() {
        return Some(error.to_string());
    }
    if !Path::new("/usr/bin/mknod").exists() && !Path::new("/bin/mknod").exists() {
        return Some("mknod not found".to_owned());
    }
    None
}

/// `true` when the test may run; a recorded skip otherwise (a failure under `CI=true`).
pub fn privileged() -> bool {
    let Some(reason) = missing_privilege() else {
        return true;
    };
    vgpu_test_needs::skip(vgpu_test_needs::Need::Ebpf, &reason);
    false
}

pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    preflight::cgroup2_mount(&mounts).map(PathBuf::from)
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A unique name for this process and call.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A cgroup2 child directory, removed on drop (its processes must be gone by then).
pub struct TestCgroup {
    pub path: PathBuf,
}

impl TestCgroup {
    pub fn new() -> Self {
        let path = cgroup2_mount().unwrap().join(unique("vgpu-ebpf-test"));
        std::fs::create_dir(&path).unwrap();
        Self { path }
    }

    pub fn id(&self) -> u64 {
        vgpu_ebpf::cgroup_id(&self.path).unwrap()
    }

    pub fn add(&self, pid: u32) {
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("warning: could not remove {}", self.path.display());
    }
}

/// A temp dir with `nvidia0` (195:0), `nvidiactl` (195:255) and `null` (1:3) nodes.
pub struct Nodes {
    pub dir: tempfile::TempDir,
}

impl Nodes {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        for (name, major, minor) in [("nvidia0", 195, 0), ("nvidiactl", 195, 255), ("null", 1, 3)] {
            let status = Command::new("mknod")
                .arg(dir.path().join(name))
                .args(["c", &major.to_string(), &minor.to_string()])
                .status()
                .unwrap();
            assert!(status.success(), "mknod {name}");
        }
        Self { dir }
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

/// errno of an open of a GPU node with no driver behind it: the gate let it through.
pub const ENXIO: &str = "err 6";
/// errno of an open the gate refused.
pub const EPERM: &str = "err 1";

/// The ebpf-probe binary, scripted over its stdin/stdout.
pub struct Probe {
    pub child: Child,
    pub pid: u32,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Probe {
    /// Starts a probe and moves it into `cgroup` before it does anything.
    pub fn spawn_in(cgroup: &TestCgroup) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ebpf-probe"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let pid: u32 = line.trim().strip_prefix("ready ").unwrap().parse().unwrap();
        assert_eq!(pid, child.id());
        cgroup.add(pid);
        Self {
            child,
            pid,
            stdin,
            stdout,
        }
    }

    pub fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    pub fn open(&mut self, path: &str) -> String {
        self.ask(&format!("open {path}"))
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The next event matching `kind` and `tgid` within 5 s (others are returned in `skipped`).
pub fn wait_event(reader: &mut EventReader, kind: EventKind, tgid: u32) -> Option<Event> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match reader.next_timeout(left).unwrap() {
            Some(event) if event.kind == kind && event.tgid == tgid => return Some(event),
            Some(_) => {}
            None => return None,
        }
    }
    None
}

/// Every event already queued.
pub fn drain(reader: &mut EventReader) -> Vec<Event> {
    let mut events = Vec::new();
    while let Some(event) = reader.next_timeout(Duration::from_millis(50)).unwrap() {
        events.push(event);
    }
    events
}

/// A bpf file system mounted on a temp dir, unmounted on drop.
pub struct Bpffs {
    pub dir: tempfile::TempDir,
}

impl Bpffs {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let status = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "mount -t bpf");
        Self { dir }
    }

    /// Entries left under the mount (recursively), for the no-leftovers check; the kernel's
    /// own files (names with a dot, like `progs.debug`) do not count.
    pub fn leftovers(&self) -> Vec<PathBuf> {
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if entry.file_name().to_string_lossy().contains('.') {
                    continue;
                }
                if path.is_dir() {
                    walk(&path, out);
                }
                out.push(path);
            }
        }
        let mut out = Vec::new();
        walk(self.dir.path(), &mut out);
        out
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}
