//! A scripted process for the gate's tests and benchmark: prints `ready <pid>`, then for each
//! stdin line `open PATH` answers `ok` or `err <errno>` (opening read-write, as CUDA does),
//! `bench PATH N` answers `ns <mean open+close nanoseconds>`, `attach CGROUP` tries to attach
//! the gate in audit mode there and answers `attached` or the error, and `exit` (or EOF) ends
//! it; `exec` replaces the process with a fresh probe (same pid), which prints `ready` again.

use std::io::{BufRead, Write};
use std::time::Instant;

fn open(path: &str) -> String {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(_) => "ok".to_owned(),
        Err(error) => format!("err {}", error.raw_os_error().unwrap_or(0)),
    }
}

fn bench(path: &str, count: &str) -> String {
    let Ok(count) = count.parse::<u32>() else {
        return format!("bad count {count:?}");
    };
    let start = Instant::now();
    for _ in 0..count {
        // The result (ENXIO for a node without a driver) does not matter: the cost does.
        let _ = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path);
    }
    format!(
        "ns {}",
        start.elapsed().as_nanos() / u128::from(count.max(1))
    )
}

fn attach(cgroup: &str) -> String {
    let config = vgpu_ebpf::EbpfConfig {
        mode: vgpu_ebpf::Mode::Audit,
        cgroup_root: cgroup.into(),
        pin_dir: None,
    };
    let devices = [vgpu_ebpf::GpuDevice {
        major: vgpu_ebpf::config::NVIDIA_MAJOR,
        minor: None,
    }];
    match vgpu_ebpf::Enforcer::attach(&config, &devices) {
        Ok(enforcer) => match enforcer.detach() {
            Ok(()) => "attached".to_owned(),
            Err(error) => format!("error {error}"),
        },
        Err(error) => format!("error {error}"),
    }
}

fn main() {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready {}", std::process::id());
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["open", path] => open(path),
            ["bench", path, count] => bench(path, count),
            ["attach", cgroup] => attach(cgroup),
            ["exec"] => {
                use std::os::unix::process::CommandExt;
                let error = std::process::Command::new("/proc/self/exe").exec();
                format!("error exec {error}")
            }
            ["exit"] => break,
            _ => format!("unknown command {line:?}"),
        };
        let _ = writeln!(out, "{answer}");
        let _ = out.flush();
    }
}
