//! A container whose shim did not load is reported, not silently left unlimited: three
//! "containers" get their quota from the device plugin (fake kubelet, fake API server);
//! one runs a real CUDA process under `libvgpu.so`, one the same program without it (as
//! a static binary or a musl image would), and one runs two processes under the shim but
//! rewrites the shim's shared usage counters between them (what a tenant can do to its
//! writable accounting region), so that together they hold twice its quota. The plugin's
//! audit, reading cuda-sim's NVML and `/proc`, flags exactly the second as unenforced and
//! the third as over quota, attributes each to its pod and container, posts one event on
//! each pod, and shows them in the metrics; once the unenforced process exits it is no
//! longer reported.
//!
//! Each process runs in a mount namespace with its container's directory at `/etc/vgpu`,
//! as the plugin mounts it: the audit attributes a process by that file (read through
//! `/proc/PID/root`, ADR 0042), never by its environment. The test points this process's
//! NVML at its own simulated node through the environment (`VGPU_SIM_DIR`) before any
//! thread of its own starts (nextest: a process per test).

// `std::env::set_var` is unsafe (edition 2024); see the SAFETY comment below.
#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_core::inventory::GpuInfo;
use vgpu_device_plugin::audit::{self, EVENT_REASON};
use vgpu_device_plugin::metrics::Metrics;
use vgpu_testkit::fake_kubelet::FakeKubelet;
use vgpu_testkit::node::{PodContainer, TestNode, fake_containers, pod_json};
use vgpu_tests::plugin_mount::PluginMount;
use vgpu_tests::{Probe, SimNode, probe_bin, shim_lib, sim_lib_dir};

const UUID: &str = "GPU-51570000-0000-4000-8000-0000000a0d17";

#[test]
fn a_gpu_process_without_the_shim_is_reported_on_its_pod() {
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory = \"8Gi\"\n"
    ));
    let mount = PluginMount::new();
    let mut enter = std::process::Command::new("unshare");
    enter.args(["--mount", "--propagation", "private"]);
    if let Err(why) = mount.check(enter) {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::Mount, &why);
    }
    // SAFETY: nextest runs each test in a process of its own (ADR 0045), and no thread
    // of ours runs yet (the runtime and the probes' readers start below).
    unsafe { std::env::set_var("VGPU_SIM_DIR", sim.state_dir()) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run(&sim, &mount));
}

async fn run(sim: &SimNode, mount: &PluginMount) {
    let gpus = vec![GpuInfo {
        index: 0,
        uuid: UUID.into(),
        model: "NVIDIA H100 80GB HBM3".into(),
        memory_mib: 8192,
        healthy: true,
        topology: None,
    }];
    let mut node = TestNode::start(gpus).await.expect("node");
    let mut dirs = Vec::new();
    for (i, name) in ["enforced", "escaped", "forged"].into_iter().enumerate() {
        let cs: Vec<PodContainer<'_>> =
            vec![("main", false, vec![(UUID.to_owned(), 2048, 300, 3)])];
        node.put_pod(pod_json("ns", name, &format!("uid-{name}"), i as u32, &cs))
            .await
            .expect("pod");
        let mut c = node.client.clone();
        let adm = node
            .kubelet
            .admit(&mut c, "ns", name, &fake_containers(&cs))
            .await
            .expect("admit");
        let ids = adm.containers[0].2.clone();
        FakeKubelet::prestart(&mut node.client, &ids)
            .await
            .expect("PreStartContainer");
        dirs.push(
            node.handshake
                .allocation_dir(ids.iter().map(String::as_str)),
        );
    }
    let hold = ["init", "alloc", "256Mi", "ready", "wait"];
    let timeout = Duration::from_secs(30);
    // Each process in a container as the plugin makes one: its directory at /etc/vgpu
    // (where the audit reads whose it is, ADR 0042), under the shim or not.
    let shim = shim_lib();
    let in_container = |dir: &std::path::Path, shim: Option<&std::path::Path>| {
        let mut c = sim.command("unshare");
        c.args(["--mount", "--propagation", "private"])
            .args(mount.args(dir, shim, &probe_bin()))
            .env("VGPU_CONTAINER_DIR", dir)
            .env("VGPU_DAEMON_SOCKET", "off")
            .env_remove("VGPU_MEMORY_LIMIT");
        c
    };
    let enforced = Probe::start(in_container(&dirs[0], Some(&shim)), &hold, timeout);
    let escaped = Probe::start(in_container(&dirs[1], None), &hold, timeout);
    // "forged": the first process fills the quota; the tenant then zeroes the shared
    // usage counter of its accounting region; the second process fills it again.
    let fill = ["init", "alloc-until-oom", "2097152", "ready", "wait"];
    let forged_1 = Probe::start(in_container(&dirs[2], Some(&shim)), &fill, timeout);
    assert_eq!(
        forge_region(&dirs[2], 2048 << 20),
        3,
        "quota, usage and the slot's usage"
    );
    let forged_2 = Probe::start(in_container(&dirs[2], Some(&shim)), &fill, timeout);

    let metrics = Metrics::new(tokio::sync::watch::channel(Vec::new()).1);
    let rx = audit::spawn(
        node.cfg.clone(),
        Some(sim_lib_dir().join("libnvidia-ml.so.1")),
        Duration::from_millis(50),
    )
    .expect("audit thread");
    let reporter = tokio::spawn(audit::report(
        node.handshake.clone(),
        rx,
        Arc::clone(&metrics.audit),
    ));

    // Every process is on the GPU; only the one without the shim is unenforced.
    let state = wait(&metrics, "the escaped process reported", |s| {
        s.checked >= 4 && !s.latest.is_empty() && !s.over_quota.is_empty()
    })
    .await;
    let pids: Vec<u32> = state.latest.iter().map(|(u, _)| u.pid).collect();
    assert_eq!(
        pids,
        [escaped.pid()],
        "only the process without the shim: {state:#?}"
    );
    let (u, owner) = &state.latest[0];
    let owner = owner.as_ref().expect("attributed");
    assert_eq!(
        (
            owner.namespace.as_str(),
            owner.pod.as_str(),
            owner.container.as_str()
        ),
        ("ns", "escaped", "main")
    );
    assert_eq!(u.gpu, UUID);
    assert!(u.used_bytes >= 256 << 20, "{u:?}");

    // Only the forged container is over its quota, by NVML's count.
    assert_eq!(state.over_quota.len(), 1, "{state:#?}");
    let o = &state.over_quota[0];
    assert_eq!(
        (o.owner.pod.as_str(), o.owner.container.as_str()),
        ("forged", "main")
    );
    assert_eq!(
        (o.gpu.as_str(), o.processes, o.quota_bytes),
        (UUID, 2, 2048 << 20)
    );
    assert!(o.used_bytes >= 2 * (2048 << 20), "{o:?}");

    // One event on each pod, naming the process (or the memory) and the GPU.
    let events = wait_events(&node, 2).await;
    assert_eq!(events.len(), 2, "{events:#?}");
    let over = events
        .iter()
        .find(|e| e["reason"] == audit::EVENT_OVER_QUOTA)
        .expect("an over-quota event");
    assert_eq!(over["involvedObject"]["name"], "forged");
    let msg = over["message"].as_str().unwrap_or("");
    assert!(msg.contains("2048 MiB") && msg.contains(UUID), "{msg}");
    let ev = events
        .iter()
        .find(|e| e["reason"] == EVENT_REASON)
        .expect("a shim-not-loaded event");
    assert_eq!(ev["reason"], EVENT_REASON);
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["involvedObject"]["name"], "escaped");
    assert_eq!(ev["involvedObject"]["uid"], "uid-escaped");
    assert_eq!(ev["involvedObject"]["fieldPath"], "spec.containers{main}");
    let msg = ev["message"].as_str().unwrap_or("");
    assert!(
        msg.contains(&escaped.pid().to_string()) && msg.contains(UUID),
        "{msg}"
    );

    let text = metrics.render();
    let line = format!(
        "vgpu_plugin_unenforced_processes{{namespace=\"ns\",pod=\"escaped\",container=\"main\",gpu=\"{UUID}\"}} 1"
    );
    assert!(text.contains(&line), "{text}");
    assert!(!text.contains("pod=\"enforced\""), "{text}");
    assert!(
        text.contains(&format!(
            "vgpu_plugin_over_quota_limit_bytes{{namespace=\"ns\",pod=\"forged\",container=\"main\",gpu=\"{UUID}\"}} {}",
            2048u64 << 20
        )),
        "{text}"
    );

    // Later audits do not post it again; once it exits it is no longer reported.
    let audits = metrics.audit.lock().expect("lock").audits;
    wait(&metrics, "two more audits", |s| s.audits >= audits + 2).await;
    assert_eq!(node.api.events().len(), 2, "each reported once");
    escaped.kill9();
    wait(&metrics, "the exited process dropped", |s| {
        s.latest.is_empty()
    })
    .await;
    enforced.kill9();
    forged_1.kill9();
    forged_2.kill9();
    reporter.abort();
}

/// What a tenant can do to its container's accounting region (shared memory it can
/// attach) without knowing its layout: zero every aligned 64-bit word equal to `value`
/// (the quota it filled). Returns how many.
fn forge_region(dir: &std::path::Path, value: u64) -> usize {
    let mut n = 0;
    for key in vgpu_tests::region_keys(dir) {
        // SAFETY: flags 0 only looks the key up.
        let id = unsafe { libc::shmget(key, 0, 0) };
        if id < 0 {
            continue;
        }
        // SAFETY: shmid_ds is plain old data; a valid out-pointer for IPC_STAT.
        let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) }, 0);
        // SAFETY: attaching the segment read-write where the kernel chooses.
        let p = unsafe { libc::shmat(id, std::ptr::null(), 0) };
        assert_ne!(p as isize, -1, "shmat");
        for i in 0..ds.shm_segsz / 8 {
            // SAFETY: word i lies within the attached segment.
            let w = unsafe { p.cast::<u64>().add(i) };
            // SAFETY: as above; volatile: other processes use the words.
            if unsafe { w.read_volatile() } == value {
                // SAFETY: as above.
                unsafe { w.write_volatile(0) };
                n += 1;
            }
        }
        // SAFETY: detaching what was attached above.
        unsafe { libc::shmdt(p) };
    }
    n
}

async fn wait(
    m: &Metrics,
    what: &str,
    pred: impl Fn(&audit::AuditState) -> bool,
) -> audit::AuditState {
    // A bound so that a broken audit fails the test instead of hanging it.
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let s = m.audit.lock().expect("lock").clone();
        if pred(&s) {
            return s;
        }
        assert!(Instant::now() < end, "{what}: not within 30 s; last {s:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_events(node: &TestNode, n: usize) -> Vec<serde_json::Value> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let e = node.api.events();
        if e.len() >= n || Instant::now() > end {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
