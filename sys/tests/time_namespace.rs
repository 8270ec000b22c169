//! The node's clock from a process in a time namespace with a monotonic offset
//! (`unshare --time --monotonic`, ADR 0038): it reads the host's clock, as every other
//! process of the node does, not its namespace's shifted one.

use std::process::Command;

use vgpu_sys::mono_ns;

const CHILD: &str = "VGPU_SYS_TIME_NS_CHILD";
const NAME: &str = "a_process_in_a_time_namespace_reads_the_nodes_clock";

#[test]
fn a_process_in_a_time_namespace_reads_the_nodes_clock() {
    if std::env::var_os(CHILD).is_some() {
        // In the namespace: say what the kernel says of it, and the clock read.
        let offsets = std::fs::read_to_string("/proc/self/timens_offsets").unwrap_or_default();
        println!("offsets: {}", offsets.replace('\n', ";"));
        println!("clock: {}", mono_ns());
        return;
    }
    let probe = Command::new("unshare")
        .args(["--time", "--monotonic", "1000", "true"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        let why = format!("`unshare --time` failed: {probe:?}");
        return vgpu_test_needs::skip(vgpu_test_needs::Need::TimeNamespaces, &why);
    }
    let exe = std::env::current_exe().expect("the test binary");
    let before = mono_ns();
    let out = Command::new("unshare")
        .args(["--time", "--monotonic", "1000"])
        .arg(&exe)
        .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .expect("run the test binary in a time namespace");
    let after = mono_ns();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}");
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|l| l.split_once(name).map(|(_, v)| v))
            .unwrap_or_else(|| panic!("no {name:?} in the child's output: {stdout}"))
            .trim()
            .to_owned()
    };
    // The namespace is real: its offset is the 1000 s asked for...
    let offsets = field("offsets:");
    assert!(
        offsets
            .split(';')
            .any(|l| { l.split_whitespace().collect::<Vec<_>>() == ["monotonic", "1000", "0"] }),
        "{offsets}"
    );
    // ... and the child's clock is the node's, taken between the parent's two readings.
    let clock: u64 = field("clock:").parse().expect("a number");
    assert!(
        (before..=after).contains(&clock),
        "the child read {clock}, the parent {before} and {after} around it \
         (the namespace's own clock is 1000 s ahead)"
    );
}
