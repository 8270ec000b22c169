//! Stream-ordered memory pools under libvgpu.so: what a pool keeps cached after
//! `cuMemFreeAsync` stays charged to the container until the driver releases it, so
//! the container's physical use never exceeds its quota (ADR 0008, "Memory pools").
//! Real processes with `LD_PRELOAD` over cuda-sim; the physical side is read by a probe
//! without the shim on the same simulated node.

use std::time::Duration;

use vgpu_tests::{Container, SimNode, num};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const CTX: u64 = 300 * MIB;
const OOM: &str = "alloc=err code=2";

/// One 8 GiB device whose contexts cost 300 MiB, in 2 MiB granules.
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

/// The `alloc=` lines of a probe's output, in order.
fn allocs(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.starts_with("alloc=")).collect()
}

/// The device memory really in use on the node (all processes, contexts included), as
/// a process without the shim sees it, minus that process's own context.
fn physical_used(node: &SimNode) -> u64 {
    let out = node.probe(&["init", "meminfo"]);
    num(&out, "total") - num(&out, "free") - CTX
}

/// Runs `before` in a shimmed probe of `c`, measures the node's physical use while the
/// probe holds what `before` left, then lets it run `after`. Returns (output, physical
/// use at the checkpoint).
fn with_checkpoint(
    node: &SimNode,
    c: &Container,
    before: &[&str],
    after: &[&str],
) -> (String, u64) {
    let mut args: Vec<&str> = before.to_vec();
    args.extend(["ready", "wait"]);
    args.extend(after);
    let p = node.spawn_probe_in(Some(c), &args, Duration::from_secs(30));
    let used = physical_used(node);
    let out = p.finish(Duration::from_secs(30)).join("\n");
    (out, used)
}

/// (1) With a release threshold of u64::MAX, memory freed into the pool stays charged:
/// a plain allocation of one granule fails, the pool reuses its cache up to the quota,
/// and the node never holds more than quota + context for the container. (2) After
/// `cuMemPoolTrimTo(pool, 0)` the plain allocation succeeds. Through every route
/// (`dlsym`, exported symbols, `cuGetProcAddress` with and without per-thread default
/// streams, which resolves the `_ptsz` variants of the allocation, free and
/// synchronisation hooks).
#[test]
fn memory_a_pool_keeps_cached_stays_charged_until_trimmed() {
    let routes = ["dlsym", "global", "procaddr", "procaddr-ptds"];
    for (api, route) in ["async", "pool"]
        .into_iter()
        .flat_map(|a| routes.map(|r| (a, r)))
    {
        let node = node();
        let c = Container::new("1Gi");
        let (out, used) = with_checkpoint(
            &node,
            &c,
            &[
                "route",
                route,
                "init",
                "pool-threshold",
                "max",
                "alloc-api",
                api,
                "1Gi",
                "free-async-all",
                "sync",
                "pool-info",
                "alloc",
                "2Mi",
                "meminfo",
                "alloc-api",
                api,
                "1Gi",
            ],
            &[
                "free-async-all",
                "sync",
                "alloc",
                "2Mi",
                "pool-trim",
                "0",
                "meminfo",
                "alloc",
                "2Mi",
                "meminfo",
            ],
        );
        let a = allocs(&out);
        assert_eq!(a.len(), 5, "{api}/{route}: {out}");
        assert!(a[0].starts_with("alloc=ok"), "{api}/{route}: {out}");
        assert_eq!(
            a[1], OOM,
            "{api}/{route}: the cached GiB is still charged: {out}"
        );
        assert!(
            a[2].starts_with("alloc=ok"),
            "{api}/{route}: the pool reuses its cache up to the quota: {out}"
        );
        assert_eq!(
            a[3], OOM,
            "{api}/{route}: cached again after the second free: {out}"
        );
        assert!(
            a[4].starts_with("alloc=ok"),
            "{api}/{route}: after the trim the plain allocation fits: {out}"
        );
        assert!(
            out.contains("pool_reserved=1073741824 pool_used=0"),
            "{api}/{route}: the driver keeps the freed GiB: {out}"
        );
        let infos: Vec<&str> = out.lines().filter(|l| l.starts_with("free=")).collect();
        assert_eq!(
            infos,
            [
                "free=0 total=1073741824",
                "free=1073741824 total=1073741824",
                "free=1071644672 total=1073741824"
            ],
            "{api}/{route}: {out}"
        );
        // (4) Physically: one GiB (reused, not doubled) and one context.
        assert!(
            used <= GIB + CTX,
            "{api}/{route}: the node holds {used} bytes for a 1 GiB container (+ {CTX} context)"
        );
        assert_eq!(used, GIB + CTX, "{api}/{route}: {out}");
    }
}

/// A created pool with a threshold: reuse of its cache, and `cuMemPoolDestroy` gives
/// the cache back.
#[test]
fn a_destroyed_pool_gives_its_cache_back() {
    let node = node();
    let c = Container::new("1Gi");
    let out = node.probe_in(
        Some(&c),
        &[
            "init",
            "pool-create",
            "pool-threshold",
            "max",
            "alloc-api",
            "pool",
            "512Mi",
            "alloc-api",
            "pool",
            "512Mi",
            "free-async-all",
            "sync",
            "alloc",
            "2Mi",
            "alloc-api",
            "pool",
            "1Gi",
            "alloc-api",
            "pool",
            "2Mi",
            "free-async-all",
            "sync",
            "pool-destroy",
            "alloc",
            "1Gi",
            "meminfo",
        ],
    );
    let a = allocs(&out);
    assert_eq!(a.len(), 6, "{out}");
    assert!(
        a[0].starts_with("alloc=ok") && a[1].starts_with("alloc=ok"),
        "{out}"
    );
    assert_eq!(a[2], OOM, "{out}");
    assert!(
        a[3].starts_with("alloc=ok"),
        "1 GiB from the cached 2 × 512 MiB: {out}"
    );
    assert_eq!(a[4], OOM, "{out}");
    assert!(
        a[5].starts_with("alloc=ok"),
        "the destroyed pool's cache is back: {out}"
    );
    assert!(out.contains("free=0 total=1073741824"), "{out}");
}

/// (3) With the default release threshold (0), nothing changes: after a free-async and
/// a synchronisation, the memory is back for any API; the node agrees.
#[test]
fn with_the_default_threshold_freed_pool_memory_comes_back_at_synchronisation() {
    for sync in ["sync", "ctx-sync"] {
        let node = node();
        let c = Container::new("1Gi");
        let (out, used) = with_checkpoint(
            &node,
            &c,
            &[
                "init",
                "alloc-api",
                "async",
                "1Gi",
                "free-async-all",
                sync,
                "meminfo",
                "alloc",
                "1Gi",
            ],
            &[
                "alloc",
                "2Mi",
                "free-all",
                "alloc-api",
                "pool",
                "1Gi",
                "meminfo",
            ],
        );
        let a = allocs(&out);
        assert_eq!(a.len(), 4, "{sync}: {out}");
        assert!(a[0].starts_with("alloc=ok"), "{sync}: {out}");
        assert!(a[1].starts_with("alloc=ok"), "{sync}: freed at sync: {out}");
        assert_eq!(a[2], OOM, "{sync}: {out}");
        assert!(a[3].starts_with("alloc=ok"), "{sync}: {out}");
        let infos: Vec<&str> = out.lines().filter(|l| l.starts_with("free=")).collect();
        assert_eq!(
            infos,
            [
                "free=1073741824 total=1073741824",
                "free=0 total=1073741824"
            ],
            "{sync}: {out}"
        );
        assert_eq!(used, GIB + CTX, "{sync}: {out}");
    }
}

/// Lowering the release threshold releases the cache, and the charge follows.
#[test]
fn lowering_the_release_threshold_gives_the_cache_back() {
    let node = node();
    let c = Container::new("1Gi");
    let out = node.probe_in(
        Some(&c),
        &[
            "init",
            "pool-threshold",
            "max",
            "alloc-api",
            "async",
            "1Gi",
            "free-async-all",
            "sync",
            "alloc",
            "2Mi",
            "pool-threshold",
            "256Mi",
            "alloc",
            "768Mi",
            "alloc",
            "2Mi",
            "alloc-api",
            "async",
            "256Mi",
            "meminfo",
        ],
    );
    let a = allocs(&out);
    assert_eq!(a.len(), 5, "{out}");
    assert_eq!(a[1], OOM, "{out}");
    assert!(a[2].starts_with("alloc=ok"), "768 MiB released: {out}");
    assert_eq!(a[3], OOM, "256 MiB still cached: {out}");
    assert!(
        a[4].starts_with("alloc=ok"),
        "the cache serves the pool: {out}"
    );
    assert!(out.contains("free=0 total=1073741824"), "{out}");
}

/// The cache of one process's pool is the container's: another process of the same
/// container cannot allocate it.
#[test]
fn a_pool_cache_of_one_process_is_charged_to_the_whole_container() {
    let node = node();
    let c = Container::new("1Gi");
    let holder = node.spawn_probe_in(
        Some(&c),
        &[
            "init",
            "pool-threshold",
            "max",
            "alloc-api",
            "async",
            "1Gi",
            "free-async-all",
            "sync",
            "ready",
            "wait",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(physical_used(&node), GIB + CTX);
    let out = node.probe_in(Some(&c), &["init", "alloc", "2Mi", "meminfo"]);
    assert_eq!(allocs(&out), [OOM], "{out}");
    assert!(out.contains("free=0 total=1073741824"), "{out}");
    holder.finish(Duration::from_secs(30));
    let out = node.probe_in(Some(&c), &["init", "alloc", "1Gi"]);
    assert!(allocs(&out)[0].starts_with("alloc=ok"), "{out}");
}

/// A stream-ordered free followed at once by an allocation from the same pool: the
/// freed block is credit but, until the free executes, no cache (the simulator reserves
/// the request anew). Whichever way the race between the free and the allocation goes,
/// the node never holds more than the quota + the context for the container.
#[test]
fn reuse_before_the_free_executes_never_exceeds_the_quota() {
    let mut served = 0;
    for _ in 0..10 {
        let node = node();
        let c = Container::new("1Gi");
        let (out, used) = with_checkpoint(
            &node,
            &c,
            &[
                "init",
                "pool-threshold",
                "max",
                "alloc-api",
                "async",
                "1Gi",
                "free-async-all",
                "alloc-api",
                "async",
                "1Gi",
            ],
            &["sync", "meminfo"],
        );
        let a = allocs(&out);
        assert_eq!(a.len(), 2, "{out}");
        assert!(a[0].starts_with("alloc=ok"), "{out}");
        assert!(
            a[1].starts_with("alloc=ok") || a[1] == OOM,
            "either served from the executed free or refused: {out}"
        );
        served += usize::from(a[1].starts_with("alloc=ok"));
        assert!(
            used <= GIB + CTX,
            "the node holds {used} bytes for a 1 GiB container: {out}"
        );
        assert!(out.contains("total=1073741824"), "{out}");
    }
    eprintln!("served from the cache in {served} of 10 runs");
}

/// Pool allocations of a destroyed context go back to their pool, which keeps them
/// charged as long as it keeps them cached.
#[test]
fn pool_memory_of_a_destroyed_context_stays_charged_while_cached() {
    for (threshold, plain_fits) in [("0", true), ("max", false)] {
        let node = node();
        let c = Container::new("1Gi");
        let out = node.probe_in(
            Some(&c),
            &[
                "init",
                "pool-threshold",
                threshold,
                "ctx-create",
                "alloc-api",
                "async",
                "1Gi",
                "ctx-destroy",
                "alloc",
                "2Mi",
                "pool-trim",
                "0",
                "alloc",
                "1Gi",
            ],
        );
        let a = allocs(&out);
        assert_eq!(a.len(), 3, "{threshold}: {out}");
        assert!(a[0].starts_with("alloc=ok"), "{threshold}: {out}");
        assert_eq!(
            a[1].starts_with("alloc=ok"),
            plain_fits,
            "{threshold}: {out}"
        );
        if plain_fits {
            assert_eq!(a[2], OOM, "{threshold}: 2 MiB are allocated: {out}");
        } else {
            assert!(a[2].starts_with("alloc=ok"), "{threshold}: trimmed: {out}");
        }
    }
}
