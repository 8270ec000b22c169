//! Runs the workload-shape scripts of `tests/python/workloads` (cuda-python clients of
//! the driver API, as LLM servers and NCCL-shaped trainers call it) as real processes on
//! a simulated node, inside a container under the shim or without one. Used by the
//! `shim_vmm`, `shim_ipc`, `shim_graph_cap` and `shim_workloads` tests.

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use vgpu_tests::{Container, SimNode, repo_root};

/// The scripts' directory.
pub fn dir() -> PathBuf {
    repo_root().join("tests/python/workloads")
}

/// Whether cuda-python is importable; records a skip (failing under CI) when not.
pub fn have_cuda_python() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import cuda.bindings.driver"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        vgpu_test_needs::skip(
            vgpu_test_needs::Need::Python("cuda.bindings.driver"),
            "`python3 -c 'import cuda.bindings.driver'` failed",
        );
    }
    ok
}

/// The command running `script` with `args` on `node`, inside `c` when given.
pub fn command(node: &SimNode, c: Option<&Container>, script: &str, args: &[&str]) -> Command {
    let mut cmd = node.command("python3");
    if let Some(c) = c {
        c.apply(&mut cmd);
    }
    cmd.current_dir(dir()).arg(dir().join(script)).args(args);
    cmd
}

/// Starts `script` (see [`spawn`]) and waits for its line starting with `ready`.
pub fn spawn_ready(node: &SimNode, c: Option<&Container>, script: &str, args: &[&str]) -> Child {
    use std::io::{BufRead, BufReader};
    let mut child = spawn(node, c, script, args);
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let ready = lines.find(|l| l.as_ref().is_ok_and(|l| l.starts_with("ready")));
    if ready.is_none() {
        let _ = child.kill();
        let out = child
            .wait_with_output()
            .expect("collect the script's output");
        panic!(
            "{script} {args:?} did not become ready: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    child
}

/// Ends a script started by [`spawn`]: closes its stdin, then kills and reaps it.
pub fn stop(mut child: Child) {
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `script` to completion; returns its stdout, or panics with its output when it
/// fails.
pub fn run(node: &SimNode, c: Option<&Container>, script: &str, args: &[&str]) -> String {
    let out = command(node, c, script, args)
        .output()
        .expect("run python3");
    check(script, &out)
}

/// Its stdout if `out` is a success, else a panic with both streams.
pub fn check(script: &str, out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Starts `script` in the background, its input and output piped (the scripts that
/// hold memory wait for their stdin to close).
pub fn spawn(node: &SimNode, c: Option<&Container>, script: &str, args: &[&str]) -> Child {
    command(node, c, script, args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python3")
}
