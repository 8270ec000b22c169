//! `vgpuctl top` against the real daemon binary on cuda-sim with a registered tenant,
//! driven in a terminal multiplexer (tmux) as an operator would over ssh: it draws the
//! GPU and the container in the alternate screen, redraws in place, and Ctrl-C gives the
//! shell its screen back. `--once` prints one frame without escapes. And the daemon's
//! `/metrics` in that state (NVML figures included) passes `promtool check metrics`.
//!
//! tmux and promtool (Debian's `tmux`, `prometheus`): a recorded skip without them
//! (`vgpu-test-needs`), a failure under `CI=true`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::{Container, Probe, SimNode};

const UUID: &str = "GPU-51570000-0000-4000-8000-0000000070b0";
const KEY: &str = "research/notebook-7/lab";

struct Daemon {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    fn api(&self) -> PathBuf {
        self.dir.path().join("api.sock")
    }

    fn metrics_addr(&self) -> String {
        let log = self.log();
        let at = log
            .find("metrics on http://")
            .expect("the metrics address is logged");
        let rest = &log[at + "metrics on http://".len()..];
        rest.split('/').next().expect("host:port").to_owned()
    }
}

/// The daemon binary on `node` (NVML every 100 ms, metrics on a free port), and a tenant
/// of 30 % and 1 GiB holding 256 MiB after a second of kernels.
fn daemon_with_tenant(node: &SimNode) -> (Daemon, Probe) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let log = std::fs::File::create(dir.path().join("daemon.log")).expect("log file");
    let child = node
        .command(crate::daemon_bin())
        .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
        .arg("--socket")
        .arg(dir.path().join("daemon.sock"))
        .arg("--api-socket")
        .arg(dir.path().join("api.sock"))
        .args(["--nvml-interval-ms", "100", "--metrics-addr", "127.0.0.1:0"])
        .env("VGPU_DAEMON_LOG", "info")
        .env("NO_COLOR", "1")
        .env("NODE_NAME", "node-top")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn vgpu-daemon");
    let d = Daemon { child, dir };
    let end = Instant::now() + Duration::from_secs(30);
    while !d.log().contains("vgpu-daemon serving") {
        assert!(
            Instant::now() < end,
            "the daemon did not start:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = Container::new("1Gi")
        .with(
            "VGPU_DAEMON_SOCKET",
            &d.dir.path().join("daemon.sock").display().to_string(),
        )
        .with("VGPU_TENANT", KEY)
        .with("VGPU_COMPUTE_SHARE", "30");
    let tenant = node.spawn_probe_in(
        Some(&c),
        &[
            "init", "alloc", "256Mi", "saturate", "1", "1000000", "0", "ready", "wait",
        ],
        Duration::from_secs(120),
    );
    (d, tenant)
}

fn vgpuctl(api: &Path) -> Command {
    let mut c = Command::new(crate::vgpuctl_bin());
    c.arg("--api-socket").arg(api);
    c
}

/// Whether `tool` runs here; a recorded skip (a failure under `CI=true`) when not.
fn have(tool: &'static str, probe: &[&str]) -> bool {
    match Command::new(tool).args(probe).output() {
        Ok(_) => true,
        Err(e) => {
            vgpu_test_needs::skip(vgpu_test_needs::Need::Tool(tool), &e.to_string());
            false
        }
    }
}

/// A tmux server of this test's own (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn cmd(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket]);
        c
    }

    fn run(&self, args: &[&str]) -> String {
        let out = self.cmd().args(args).output().expect("run tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn pane(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "top"])
    }

    /// Waits (bounded) until the pane satisfies `ok`; returns it.
    fn wait_pane(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let p = self.pane();
            if ok(&p) {
                return p;
            }
            assert!(Instant::now() < end, "{what}: the pane shows\n{p}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").output();
    }
}

#[test]
fn top_redraws_in_place_in_tmux_and_gives_the_screen_back_on_ctrl_c() {
    if !have("tmux", &["-V"]) {
        return;
    }
    let node = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nname = \"NVIDIA A100-SXM4-40GB\"\nmemory = \"40Gi\"\n"
    ));
    let (d, tenant) = daemon_with_tenant(&node);
    let api = d.api();

    // One frame, plain.
    let end = Instant::now() + Duration::from_secs(30);
    let once = loop {
        let out = vgpuctl(&api)
            .args(["top", "--once"])
            .output()
            .expect("vgpuctl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        if s.contains("NVIDIA A100")
            && s.lines()
                .any(|l| l.starts_with("  ") && l.contains(KEY) && l.contains("256Mi/1Gi"))
        {
            break s;
        }
        assert!(
            Instant::now() < end,
            "no tenant in the frame:\n{s}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!once.contains('\x1b'), "--once writes no escapes: {once:?}");
    // The container's row (indented; the GPU's line names it too, as the holder).
    let row = once
        .lines()
        .find(|l| l.starts_with("  ") && l.contains(KEY))
        .expect("the tenant's row");
    assert!(
        row.contains("30%/") && row.contains("256Mi/1Gi"),
        "{row}\n{once}"
    );

    // Live, in a shell in tmux, as over ssh.
    let t = Tmux {
        socket: format!("vgpu-top-{}", std::process::id()),
    };
    t.run(&[
        "-f",
        "/dev/null",
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "150",
        "-y",
        "30",
        "sh",
    ]);
    t.run(&["send-keys", "-t", "top", "echo before-top", "Enter"]);
    t.wait_pane("the shell", |p| p.contains("before-top"));
    let cmdline = format!(
        "{} --api-socket {} top --interval 0.2",
        crate::vgpuctl_bin().display(),
        api.display()
    );
    t.run(&["send-keys", "-t", "top", &cmdline, "Enter"]);
    let p = t.wait_pane("the live view", |p| {
        p.contains("vgpuctl top") && p.contains(KEY) && !p.contains("before-top")
    });
    assert!(p.contains("SHARE(CFG/ACH)") && p.contains(UUID), "{p}");
    assert_eq!(
        t.run(&["display", "-p", "-t", "top", "#{alternate_on}"])
            .trim(),
        "1"
    );
    // Redrawn in place: the uptime changes, the frame stays at the top, one copy of it.
    let up = |p: &str| {
        p.lines()
            .next()
            .and_then(|l| l.rsplit("up ").next())
            .map(str::to_owned)
    };
    let first = up(&p);
    let p2 = t.wait_pane("a new frame", |q| {
        up(q) != first && q.starts_with("vgpuctl top")
    });
    assert_eq!(p2.matches("vgpuctl top").count(), 1, "{p2}");

    // Ctrl-C: the shell's screen is back, the cursor shown, the alternate screen left.
    t.run(&["send-keys", "-t", "top", "C-c"]);
    let p3 = t.wait_pane("the shell after Ctrl-C", |q| q.contains("before-top"));
    assert!(!p3.contains("SHARE(CFG/ACH)"), "{p3}");
    assert_eq!(
        t.run(&["display", "-p", "-t", "top", "#{alternate_on}"])
            .trim(),
        "0"
    );
    assert_eq!(
        t.run(&["display", "-p", "-t", "top", "#{cursor_flag}"])
            .trim(),
        "1"
    );
    tenant.kill9();
}

#[test]
fn the_daemon_binarys_metrics_with_a_tenant_and_nvml_pass_promtool() {
    if !have("promtool", &["--version"]) {
        return;
    }
    let node = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nname = \"NVIDIA A100-SXM4-40GB\"\nmemory = \"40Gi\"\n"
    ));
    let (d, tenant) = daemon_with_tenant(&node);
    let addr = d.metrics_addr();
    let end = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect to /metrics");
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").expect("request");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("answer");
        let body = out
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        if body.contains("vgpu_tenant_memory_used_bytes{")
            && body.contains("vgpu_gpu_memory_total_bytes{")
        {
            break body;
        }
        assert!(
            Instant::now() < end,
            "no tenant and NVML series yet:\n{body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // DCGM exporter's labels on the container's series, and on the GPU's info.
    let line = text
        .lines()
        .find(|l| l.starts_with("vgpu_tenant_memory_used_bytes{"))
        .expect("a memory series");
    for want in [
        format!("UUID=\"{UUID}\""),
        "modelName=\"NVIDIA A100-SXM4-40GB\"".to_owned(),
        "Hostname=\"node-top\"".to_owned(),
        format!("gpu=\"{UUID}\""),
    ] {
        assert!(line.contains(&want), "{want} missing: {line}");
    }
    assert!(
        text.contains("vgpu_gpu_granted_compute_ratio{") && text.contains(" 0.3\n"),
        "{text}"
    );
    let problems = vgpu_tests::promtool::check_metrics(&text).expect("run promtool");
    assert!(problems.is_empty(), "promtool: {problems:#?}\n{text}");
    tenant.kill9();
}
