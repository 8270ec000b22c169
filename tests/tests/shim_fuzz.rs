//! Arbitrary bytes where the shim reads its inputs crash nothing (issue 16): the quota
//! file and the accounting region under real processes. (The in-process property tests
//! are the shim's own: `shim/tests/quota_file_fuzz.rs` for the quota file,
//! `region::tests::arbitrary_region_contents_crash_nothing` for the region. This binary
//! must not link the shim: its `dlsym` hook would stand in front of libc's for every
//! test here, see `integration.rs`.)

#![allow(unsafe_code)] // the tenant's shmat in `garbage_region_under_real_processes`

use std::os::unix::process::ExitStatusExt;

use vgpu_tests::{Container, SimNode, probe_bin, shim_lib};

/// A valid quota file granting one GPU `mib` MiB.
fn valid(mib: u64) -> String {
    let gpu = "GPU-00000000-0000-0000-0000-000000000001";
    format!(
        r#"{{"version":1,"namespace":"ns","pod":"p","uid":"u","container":"c","init":false,"gpus":[{{"uuid":"{gpu}","memory_mib":{mib},"compute_milli":100,"slices":1}}],"device_ids":[]}}"#
    )
}

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

/// Runs a probe in `c`: it exits by itself (never by a signal), and a failure names
/// what it could not use.
fn runs_or_fails_clearly(node: &SimNode, c: &Container, what: &str) -> String {
    let mut cmd = node.command(probe_bin());
    c.apply(&mut cmd);
    let out = cmd
        .args(["init", "meminfo", "alloc", "2Mi", "free-all"])
        .output()
        .expect("run cuda-probe");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.signal(),
        None,
        "{what}: killed: {stdout}{stderr}"
    );
    if !out.status.success() {
        assert!(stderr.contains("vgpu: ERROR"), "{what}: {stderr}");
    }
    stdout
}

#[test]
fn garbage_quota_files_under_real_processes() {
    let node = node();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for round in 0..12 {
        let c = Container::new("256Mi");
        std::fs::create_dir_all(c.dir()).expect("container directory");
        let mut bytes = Vec::new();
        for _ in 0..(round * 37) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bytes.push(x as u8);
        }
        if round % 3 == 1 {
            bytes = valid(x % 100_000).into_bytes();
            let n = bytes.len();
            bytes[(x as usize) % n] ^= 0x20;
        }
        std::fs::write(c.dir().join("vgpu.conf"), &bytes).expect("write vgpu.conf");
        let out = runs_or_fails_clearly(&node, &c, &format!("vgpu.conf round {round}"));
        // A garbage quota file is never an unlimited run.
        assert!(!out.contains("free=8"), "round {round}: {out}");
    }
}

#[test]
fn garbage_region_under_real_processes() {
    let node = node();
    for round in 0..6u64 {
        let c = Container::new("256Mi");
        // A first process creates the region; the tenant then fills it with garbage.
        runs_or_fails_clearly(&node, &c, "first");
        for key in vgpu_tests::region_keys(&c.dir()) {
            // SAFETY: flags 0 only looks the key up.
            let id = unsafe { libc::shmget(key, 0, 0) };
            if id < 0 {
                continue;
            }
            // SAFETY: attaching read-write where the kernel chooses.
            let p = unsafe { libc::shmat(id, std::ptr::null(), 0) };
            assert_ne!(p as isize, -1);
            let mut x = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(round + 1);
            for i in 0..(70_000 / 8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Rounds alternate between every word and sparse words.
                if round.is_multiple_of(2) || x.is_multiple_of(7) {
                    // SAFETY: within the segment (the region is larger than 70,000
                    // bytes).
                    unsafe { p.cast::<u64>().add(i).write_volatile(x >> (round * 8)) };
                }
            }
            // SAFETY: detaching what was attached above.
            unsafe { libc::shmdt(p) };
        }
        for _ in 0..2 {
            runs_or_fails_clearly(&node, &c, &format!("garbage region round {round}"));
        }
    }
    let _ = shim_lib();
}
