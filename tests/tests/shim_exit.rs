//! A process never sees the memory of a process that has exited (issue 11 item 4): the
//! next process of the container, started the instant the previous one is gone (it
//! exited, or was SIGKILLed), sees the whole quota free in `cuMemGetInfo` and NVML; and
//! the simulated driver itself reports a dead process's memory as free at once.

use std::time::Duration;

use vgpu_tests::{Container, SimNode, num};

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

/// What the next process of `c` sees, started right after the previous one is gone.
fn next_process_view(node: &SimNode, c: &Container) -> String {
    node.probe_in(Some(c), &["init", "meminfo", "nvml"])
}

fn assert_whole_quota_free(out: &str, quota: u64, what: &str) {
    assert!(
        out.contains(&format!("free={quota} total={quota}")),
        "{what}: cuMemGetInfo still shows the dead process's memory: {out}"
    );
    assert_eq!(num(out, "nvml_used"), 0, "{what}: {out}");
    assert_eq!(num(out, "nvml_free"), quota, "{what}: {out}");
}

#[test]
fn the_next_process_sees_the_whole_quota_right_after_one_exits() {
    let node = node();
    let c = Container::new("256Mi");
    // Six times in a row, as in the report: no delay between the two processes.
    for round in 0..6 {
        let a = node.probe_in(Some(&c), &["init", "alloc-until-oom", "2Mi"]);
        assert_eq!(num(&a, "allocated"), 256 * MIB, "round {round}: {a}");
        let b = next_process_view(&node, &c);
        assert_whole_quota_free(&b, 256 * MIB, &format!("exit, round {round}"));
    }
}

#[test]
fn the_next_process_sees_the_whole_quota_right_after_one_is_killed() {
    let node = node();
    let c = Container::new("256Mi");
    for round in 0..3 {
        let a = node.spawn_probe_in(
            Some(&c),
            &["init", "alloc-until-oom", "2Mi", "ready", "wait"],
            Duration::from_secs(30),
        );
        assert!(
            a.seen.iter().any(|l| l.contains("allocated=268435456")),
            "round {round}: {:?}",
            a.seen
        );
        a.kill9();
        let b = next_process_view(&node, &c);
        assert_whole_quota_free(&b, 256 * MIB, &format!("SIGKILL, round {round}"));
    }
}

#[test]
fn the_driver_reports_a_dead_process_memory_free_at_once() {
    // Without a quota the view is the (simulated) driver's own: a process that filled
    // the GPU and exited must not be seen by the next one.
    let node = node();
    let total = 8u64 << 30;
    for round in 0..3 {
        let a = node.probe(&["init", "alloc-until-oom", "64Mi"]);
        assert!(num(&a, "allocated") > total / 2, "round {round}: {a}");
        let b = node.probe(&["init", "meminfo"]);
        // Only its own context (300 MiB) is in use.
        assert!(
            b.contains(&format!("free={} total={total}", total - 300 * MIB)),
            "round {round}: the driver still counts the dead process: {b}"
        );
    }
}
