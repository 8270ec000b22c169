//! What operators see, checked on real components (issue 15):
//!
//! - An allocation refused over a container's memory quota reaches `kubectl describe pod`:
//!   a real CUDA process under `libvgpu.so`, in a container the device plugin set up (its
//!   quota file and daemon socket), asks for more than its quota twice; the shim refuses
//!   both (`CUDA_ERROR_OUT_OF_MEMORY`) and tells the node daemon, which counts them
//!   (`/metrics`, its API); the device plugin reads them from the daemon's API and posts
//!   exactly one `Warning` event `VgpuMemoryQuotaExceeded` on the pod for the burst, with
//!   the quota, the memory in use and the size asked. The API server is the scripted fake.
//! - The `/metrics` both serve in that state pass `promtool check metrics` (Debian's
//!   `prometheus` package; a recorded skip without it, a failure under `CI=true`).
//! - Every PromQL query of the Grafana dashboard (`deploy/60-grafana-dashboard.yaml`)
//!   names only metrics that the daemon, the plugin and the scheduler extender render.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde_json::Value;
use vgpu_core::inventory::GpuInfo;
use vgpu_testkit::fake_kubelet::FakeKubelet;
use vgpu_testkit::node::{PodContainer, TestNode, fake_containers, pod_json};
use vgpu_tests::{Probe, SimNode, probe_bin, shim_lib};

use super::common;

const UUID: &str = "GPU-51570000-0000-4000-8000-00000000e0e1";
const REASON: &str = vgpu_device_plugin::refusal_events::EVENT_REASON;

fn refusal_events(node: &TestNode) -> Vec<Value> {
    node.api
        .events()
        .into_iter()
        .filter(|e| e["reason"] == REASON)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocations_refused_over_quota_become_one_warning_event_on_the_pod() {
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory = \"8Gi\"\n"
    ));
    let host = tempfile::tempdir().expect("temporary directory");
    let daemon_dir = host.path().join("daemon");
    std::fs::create_dir_all(&daemon_dir).expect("daemon directory");
    let socket = daemon_dir.join("daemon.sock");
    let api_socket = host.path().join("api.sock");

    let api = api_socket.clone();
    let daemon_metrics = free_port();
    let served = common::daemon::serve_with(&socket, |c| {
        c.reporting.api_socket = Some(api);
        c.reporting.metrics_addr = Some(daemon_metrics.to_string());
    })
    .await;
    let plugin_metrics = free_port();

    let gpus = vec![GpuInfo {
        index: 0,
        uuid: UUID.into(),
        model: "NVIDIA H100 80GB HBM3".into(),
        memory_mib: 8192,
        healthy: true,
        topology: None,
    }];
    let (sock, cdir, api) = (socket.clone(), daemon_dir.clone(), api_socket.clone());
    let mut node = TestNode::start_with(gpus, move |c| {
        c.daemon_socket = Some(sock);
        c.daemon_container_dir = cdir;
        c.daemon_api_socket = Some(api);
        c.metrics_addr = Some(plugin_metrics);
    })
    .await
    .expect("node");

    let cs: Vec<PodContainer<'_>> = vec![("main", false, vec![(UUID.to_owned(), 2048, 400, 4)])];
    node.put_pod(pod_json("training", "greedy", "uid-greedy", 0, &cs))
        .await
        .expect("pod");
    let mut c = node.client.clone();
    let adm = node
        .kubelet
        .admit(&mut c, "training", "greedy", &fake_containers(&cs))
        .await
        .expect("admit");
    let (_, _, ids, answer) = &adm.containers[0];
    FakeKubelet::prestart(&mut node.client, ids)
        .await
        .expect("PreStartContainer");
    let dir = node
        .handshake
        .allocation_dir(ids.iter().map(String::as_str));

    let mut cmd = sim.command(probe_bin());
    cmd.env("LD_PRELOAD", shim_lib())
        .env_remove("VGPU_MEMORY_LIMIT")
        .env_remove("VGPU_COMPUTE_SHARE");
    for (k, v) in &answer.envs {
        cmd.env(k, v);
    }
    cmd.env("VGPU_CONTAINER_DIR", &dir);
    // 1.5 GiB fits the 2 GiB quota; each 1 GiB after it does not.
    let probe = Probe::start(
        cmd,
        &[
            "init", "alloc", "1536Mi", "alloc", "1Gi", "alloc", "1Gi", "ready", "wait",
        ],
        Duration::from_secs(60),
    );
    // Probe::start returns once it printed `ready`, its lines so far in `seen`.
    let lines = probe.seen.clone();
    let allocs: Vec<&String> = lines.iter().filter(|l| l.starts_with("alloc=")).collect();
    assert_eq!(allocs.len(), 3, "{lines:?}");
    assert!(allocs[0].starts_with("alloc=ok"), "{lines:?}");
    assert!(
        allocs[1].starts_with("alloc=err") && allocs[2].starts_with("alloc=err"),
        "{lines:?}"
    );

    // The daemon counts both (the shim reports a refusal at once); bounded so that a
    // lost report fails the test instead of hanging it.
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let snap = served.daemon.snapshot();
        let n = snap
            .health
            .iter()
            .flat_map(|h| &h.memory_refusals)
            .map(|m| m.count)
            .sum::<u64>();
        if n == 2 {
            let text = vgpu_daemon::metrics::render_on(&snap, "node-a");
            let line = text
                .lines()
                .find(|l| l.starts_with("vgpu_container_memory_refused_allocations_total{"))
                .unwrap_or_else(|| panic!("no refusal series: {text}"));
            for want in [
                "namespace=\"training\"",
                "pod=\"greedy\"",
                "container=\"main\"",
                &format!("UUID=\"{UUID}\""),
                "Hostname=\"node-a\"",
            ] {
                assert!(line.contains(want), "{want} missing: {line}");
            }
            assert!(line.ends_with(" 2"), "{line}");
            break;
        }
        assert!(
            Instant::now() < end,
            "the daemon never counted 2 refusals: {:#?}",
            snap.health
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // One event for the burst, on the pod (its UID from the plugin's pod watch).
    let end = Instant::now() + Duration::from_secs(30);
    while refusal_events(&node).is_empty() {
        assert!(
            Instant::now() < end,
            "no {REASON} event: {:#?}",
            node.api.events()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Two more polls of the daemon: still one event.
    tokio::time::sleep(vgpu_device_plugin::refusal_events::POLL * 2 + Duration::from_millis(500))
        .await;
    let evs = refusal_events(&node);
    assert_eq!(evs.len(), 1, "{evs:#?}");
    let e = &evs[0];
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["involvedObject"]["kind"], "Pod");
    assert_eq!(e["involvedObject"]["name"], "greedy");
    assert_eq!(e["involvedObject"]["namespace"], "training");
    assert_eq!(e["involvedObject"]["uid"], "uid-greedy");
    assert_eq!(e["involvedObject"]["fieldPath"], "spec.containers{main}");
    let msg = e["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("asked for 1Gi with 1536Mi in use of its 2Gi quota"),
        "{msg}"
    );
    assert!(
        msg.contains("2 refused so far") && msg.contains(UUID),
        "{msg}"
    );

    // What both serve now passes promtool.
    let plugin_text = http_get(plugin_metrics, "/metrics");
    assert!(
        plugin_text.contains("vgpu_plugin_memory_refusal_events_total 1\n"),
        "{plugin_text}"
    );
    let daemon_text = http_get(daemon_metrics, "/metrics");
    assert!(
        daemon_text.contains("vgpu_container_memory_refused_allocations_total{"),
        "{daemon_text}"
    );
    promtool_check("daemon", &daemon_text);
    promtool_check("device plugin", &plugin_text);
    probe.kill9();
}

/// A port free now on 127.0.0.1 (bound and released).
fn free_port() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("its address")
}

/// GET `path` over HTTP/1.0; the body.
fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics server");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").expect("send the request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read the answer");
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    body.to_owned()
}

/// `promtool check metrics` over `text` (what `who` serves): no error, no lint problem.
fn promtool_check(who: &str, text: &str) {
    let problems = match vgpu_tests::promtool::check_metrics(text) {
        Ok(p) => p,
        Err(e) => {
            let why =
                format!("the {who}'s metrics were not checked: {e} (apt-get install prometheus)");
            return vgpu_test_needs::skip(vgpu_test_needs::Need::Tool("promtool"), &why);
        }
    };
    assert!(
        problems.is_empty(),
        "promtool check metrics on the {who}'s /metrics: {problems:#?}\n{text}"
    );
}

/// The metric names a text exposition declares (`# TYPE` lines: empty families too).
fn declared(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// Every metric name the daemon and the device plugin export, from their own renderers.
fn exported() -> BTreeSet<String> {
    let snap = vgpu_daemon::model::NodeSnapshot {
        uptime_s: 0.0,
        tenants: Vec::new(),
        gpus: Vec::new(),
        health: Vec::new(),
    };
    let mut names = declared(&vgpu_daemon::metrics::render_on(&snap, "h"));
    let (_tx, rx) = tokio::sync::watch::channel(Vec::new());
    names.extend(declared(
        &vgpu_device_plugin::metrics::Metrics::new(rx).render(),
    ));
    // The scheduler extender's: namespaces' use and quota policies' totals.
    let state = vgpu_scheduler_extender::extender::State::new(
        vgpu_scheduler_extender::extender::StateConfig::default(),
        vgpu_scheduler_extender::extender::policy::ExtenderPolicy::new(
            vgpu_core::packing::PolicyName::Vgpu,
        ),
    );
    names.extend(declared(
        &vgpu_scheduler_extender::extender::quota::metrics::render(&state),
    ));
    names
}

/// The metric names a PromQL expression uses: identifiers left once strings, label
/// matchers, ranges, label lists (`by`, `without`, `on`, `ignoring`, `group_*`),
/// function calls and keywords are taken out.
fn promql_metrics(expr: &str) -> Vec<String> {
    // Keywords, and the aggregation operators (which may take `by (…)` before their
    // parenthesis).
    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    let b: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut after_label_kw = false;
    while i < b.len() {
        let c = b[i];
        if c == '"' || c == '\'' {
            i += 1;
            while i < b.len() && b[i] != c {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == '{' || c == '[' || (c == '(' && after_label_kw) {
            let close = match c {
                '{' => '}',
                '[' => ']',
                _ => ')',
            };
            // Up to the closing bracket, quoted values skipped whole.
            while i < b.len() && b[i] != close {
                if b[i] == '"' {
                    i += 1;
                    while i < b.len() && b[i] != '"' {
                        i += if b[i] == '\\' { 2 } else { 1 };
                    }
                }
                i += 1;
            }
            i += 1;
            after_label_kw = false;
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '_' || b[i] == ':') {
                i += 1;
            }
            let word: String = b[start..i].iter().collect();
            let mut j = i;
            while j < b.len() && b[j].is_whitespace() {
                j += 1;
            }
            let call = j < b.len() && b[j] == '(';
            let kw = KEYWORDS.contains(&word.as_str());
            after_label_kw = kw
                && matches!(
                    word.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                );
            if !call && !kw {
                out.push(word);
            }
        } else if c.is_ascii_digit() || c == '$' {
            // A number, a duration or a Grafana variable.
            i += 1;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '_' || b[i] == '.') {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Every PromQL text in the dashboard: panel targets and variable queries (the metric
/// of `label_values(metric, label)`).
fn dashboard_queries(d: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            out.push(t["expr"].as_str().expect("a PromQL expr").to_owned());
        }
    }
    for v in d["templating"]["list"].as_array().expect("variables") {
        let q = v["query"]["query"].as_str().or(v["query"].as_str());
        if v["type"] == "query"
            && let Some(q) = q
        {
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|r| r.strip_suffix(')'))
                .expect("label_values(metric, label)");
            let metric = inner.rsplit_once(',').map_or(inner, |(m, _)| m);
            out.push(metric.trim().to_owned());
        }
    }
    out
}

#[test]
fn the_promql_scanner_finds_metrics_and_nothing_else() {
    assert_eq!(
        promql_metrics(
            r#"1 - max by (Hostname) (a_total{x="a{b}"}[5m] * on(gpu) group_left(Hostname, modelName) b_info) / sum without (gpu) (rate(c:d[$__rate_interval])) > bool 0.5"#
        ),
        vec!["a_total", "b_info", "c:d"]
    );
    assert_eq!(promql_metrics("topk(10, x)"), vec!["x"]);
}

#[test]
fn every_dashboard_query_names_only_exported_metrics() {
    // The dashboard is the JSON in the ConfigMap Grafana's sidecar loads.
    let path = vgpu_tests::repo_root().join("deploy/60-grafana-dashboard.yaml");
    let yaml = std::fs::read_to_string(&path).expect("the dashboard's ConfigMap");
    let docs = vgpu_testkit::deploy::parse_yaml(&yaml).expect("the ConfigMap is YAML");
    let text = docs
        .iter()
        .find(|o| o["kind"] == "ConfigMap")
        .and_then(|o| o["data"]["vgpu-dashboard.json"].as_str())
        .expect("the ConfigMap holds vgpu-dashboard.json");
    let d: Value = serde_json::from_str(text).expect("the dashboard is JSON");
    let exported = exported();
    assert!(
        exported.contains("vgpu_tenant_gpu_time_seconds_total")
            && exported.contains("vgpu_plugin_unenforced_processes")
            && exported.contains("vgpu_namespace_gpu_memory_used_bytes")
            && exported.contains("vgpu_quota_policy_memory_total_bytes"),
        "{exported:?}"
    );
    let queries = dashboard_queries(&d);
    assert!(queries.len() >= 10, "{queries:?}");
    let mut used = BTreeSet::new();
    for q in &queries {
        let names = promql_metrics(q);
        assert!(!names.is_empty(), "no metric in {q:?}");
        for n in names {
            assert!(
                exported.contains(&n),
                "the dashboard's query {q:?} names {n}, which none of the daemon, the plugin and the extender exports"
            );
            used.insert(n);
        }
    }
    // Panel ids are unique (Grafana keys its state on them).
    let ids: Vec<u64> = d["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .map(|p| p["id"].as_u64().expect("a panel id"))
        .collect();
    assert_eq!(
        ids.iter().collect::<BTreeSet<_>>().len(),
        ids.len(),
        "{ids:?}"
    );
    eprintln!(
        "the dashboard uses {} exported metrics: {used:?}",
        used.len()
    );
}

#[test]
fn the_extenders_quota_metrics_pass_promtool() {
    use vgpu_scheduler_extender::extender::quota::Notice;
    let state = vgpu_scheduler_extender::extender::State::new(
        vgpu_scheduler_extender::extender::StateConfig::default(),
        vgpu_scheduler_extender::extender::policy::ExtenderPolicy::new(
            vgpu_core::packing::PolicyName::Vgpu,
        ),
    );
    for (name, spec) in [
        (
            "gpu",
            serde_json::json!({"totals": {"memory": "64Gi", "computePercent": 150, "gpus": 2}}),
        ),
        ("broken", serde_json::json!({"totals": {"gpus": -1}})),
    ] {
        let obj = serde_json::from_value(serde_json::json!({
            "apiVersion": "vgpu.io/v1alpha1", "kind": "VgpuQuotaPolicy",
            "metadata": {"name": name, "namespace": "team"}, "spec": spec,
        }))
        .expect("a policy object");
        state.quota().apply(&obj);
    }
    state.quota().refused(
        Notice {
            namespace: "team".into(),
            pod: "p".into(),
            uid: "u".into(),
            policy: "team/gpu".into(),
            message: "m".into(),
        },
        Instant::now(),
    );
    let text = vgpu_scheduler_extender::extender::quota::metrics::render(&state);
    assert!(
        text.contains("vgpu_quota_policy_valid{namespace=\"team\",policy=\"broken\"} 0")
            && text
                .contains("vgpu_quota_policy_refusals_total{namespace=\"team\",policy=\"gpu\"} 1"),
        "{text}"
    );
    promtool_check("scheduler extender", &text);
}
