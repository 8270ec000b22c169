//! The Prometheus endpoint: the text format (escaping, HELP/TYPE, one sample per label
//! set) checked by parsing it back, and `/metrics` + `/healthz` over real HTTP against a
//! populated daemon.

use super::common;

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};

use common::{GPU0, GPU1, daemon, register};
use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};
use vgpu_daemon::metrics::{CONTENT_TYPE, escape_label_value, render};
use vgpu_daemon::model::{
    ContainerHealth, Gpu, GpuObservation, GpuProcess, NodeSnapshot, SettingsSource, SliceState,
    Tenant, TenantGpu,
};

/// One parsed sample.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Sample {
    fn label(&self, k: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
}

fn valid_name(s: &str, colon: bool) -> bool {
    let mut cs = s.chars();
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
    let ok_rest = |c: char| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':');
    cs.next().is_some_and(ok_first) && cs.all(ok_rest)
}

/// Parses `{k="v",...} value` after the metric name; panics on anything the text format
/// does not allow.
fn parse_labels_and_value(rest: &str, line: &str) -> (Vec<(String, String)>, f64) {
    let mut labels = Vec::new();
    let mut chars = rest.chars().peekable();
    if chars.peek() == Some(&'{') {
        chars.next();
        loop {
            if chars.peek() == Some(&'}') {
                chars.next();
                break;
            }
            let mut name = String::new();
            for c in chars.by_ref() {
                if c == '=' {
                    break;
                }
                name.push(c);
            }
            assert!(
                valid_name(&name, false),
                "bad label name {name:?} in {line:?}"
            );
            assert_eq!(
                chars.next(),
                Some('"'),
                "label value not quoted in {line:?}"
            );
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some('\\') => match chars.next() {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => panic!("bad escape {other:?} in {line:?}"),
                    },
                    Some('"') => break,
                    Some('\n') => panic!("raw line feed in a label value: {line:?}"),
                    Some(c) => value.push(c),
                    None => panic!("unterminated label value in {line:?}"),
                }
            }
            labels.push((name, value));
            match chars.next() {
                Some(',') => {}
                Some('}') => break,
                other => panic!("expected , or }} after a label, got {other:?} in {line:?}"),
            }
        }
    }
    let tail: String = chars.collect();
    let v = tail
        .strip_prefix(' ')
        .unwrap_or_else(|| panic!("no space before the value in {line:?}"));
    let value = match v {
        "NaN" => f64::NAN,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("bad value {v:?} in {line:?}")),
    };
    (labels, value)
}

/// Parses the exposition text, checking its rules: HELP and TYPE once per family, before
/// its samples, which are contiguous; valid names; counters named `_total`; at most one
/// sample per label set. Returns the samples and each family's type.
fn parse(text: &str) -> (Vec<Sample>, HashMap<String, String>) {
    assert!(text.ends_with('\n'), "the text ends with a line feed");
    let mut types: HashMap<String, String> = HashMap::new();
    let mut helps: HashSet<String> = HashSet::new();
    let mut samples = Vec::new();
    let mut seen: HashSet<(String, Vec<(String, String)>)> = HashSet::new();
    let mut closed: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        assert!(!line.is_empty(), "empty line in the exposition");
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, _help) = rest.split_once(' ').expect("HELP has a text");
            assert!(valid_name(name, true), "bad metric name {name:?}");
            assert!(helps.insert(name.to_owned()), "second HELP for {name}");
            assert!(!types.contains_key(name), "HELP after TYPE for {name}");
            if let Some(c) = current.replace(name.to_owned()) {
                closed.insert(c);
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE has a kind");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "bad type {kind:?}"
            );
            assert!(
                types.insert(name.to_owned(), kind.to_owned()).is_none(),
                "second TYPE for {name}"
            );
            assert_eq!(current.as_deref(), Some(name), "TYPE of another family");
            if kind == "counter" {
                assert!(
                    name.ends_with("_total"),
                    "counter {name} is not named _total"
                );
            }
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment {line:?}");
        let end = line
            .find(['{', ' '])
            .unwrap_or_else(|| panic!("no value in {line:?}"));
        let name = &line[..end];
        assert!(valid_name(name, true), "bad metric name {name:?}");
        assert!(types.contains_key(name), "sample before TYPE: {line:?}");
        assert_eq!(
            current.as_deref(),
            Some(name),
            "samples of {name} are not contiguous"
        );
        assert!(!closed.contains(name));
        let (labels, value) = parse_labels_and_value(&line[end..], line);
        let mut key_labels = labels.clone();
        key_labels.sort();
        assert!(
            seen.insert((name.to_owned(), key_labels)),
            "two samples with the same labels: {line:?}"
        );
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    (samples, types)
}

fn find<'a>(s: &'a [Sample], name: &str, labels: &[(&str, &str)]) -> Option<&'a Sample> {
    s.iter()
        .find(|x| x.name == name && labels.iter().all(|(k, v)| x.label(k) == Some(*v)))
}

fn evil_snapshot() -> NodeSnapshot {
    let tg = |uuid: &str, share| TenantGpu {
        uuid: uuid.to_owned(),
        settings: ComputeSettings {
            share_pct: share,
            policy: ComputePolicy::Cap,
            priority: Priority::LatencySensitive,
        },
        source: SettingsSource::Api,
        memory_used: 3 << 30,
        memory_quota: Some(4 << 30),
        gpu_time_ns: 1_500_000_000,
        throttled_ns: 250_000_000,
        grants: 42,
        recent_share_pct: 29.5,
        state: SliceState::Waiting,
        co_held: true,
        fill_pct: Some(40.0),
        cpu_stopped_pct: 72.5,
        unclaimed_grants: 5,
        expired_grants: 3,
        slice_ns: 40_000_000,
        queue_ahead_ns: 12_000_000,
        suspended_bytes: 5 << 20,
        suspensions: 2,
    };
    let obs = GpuObservation {
        uuid: GPU0.into(),
        index: 0,
        name: "NVIDIA \"H100\" 80GB\\HBM3".into(),
        memory_total: 80 << 30,
        memory_used: 5 << 30,
        utilization_pct: Some(73),
        processes: vec![(100, 3 << 30), (200, 1 << 30)],
        observed_unix_ms: 1_700_000_000_123,
    };
    let gpu = Gpu {
        observed: obs,
        processes: vec![
            GpuProcess {
                pid: 100,
                used_bytes: 3 << 30,
                tenant: Some("ns/pod\"x\"/c\\1\nline2".into()),
            },
            GpuProcess {
                pid: 200,
                used_bytes: 1 << 30,
                tenant: None,
            },
        ],
        bypass_pids: vec![200],
        scheduled_ns: 9_000_000_000,
        holder: None,
    };
    NodeSnapshot {
        uptime_s: 12.5,
        tenants: vec![
            Tenant {
                key: "ns/pod\"x\"/c\\1\nline2".into(),
                namespace: "ns".into(),
                pod: "pod\"x\"".into(),
                container: "c\\1".into(),
                pids: vec![100, 101],
                gpus: vec![tg(GPU0, 30), tg(GPU1, 60)],
            },
            Tenant {
                key: "plain".into(),
                namespace: String::new(),
                pod: String::new(),
                container: String::new(),
                pids: vec![],
                gpus: vec![TenantGpu {
                    memory_quota: None,
                    ..tg(GPU0, 10)
                }],
            },
        ],
        // The same GPU twice (e.g. two observations of one UUID): still one sample each.
        gpus: vec![gpu.clone(), gpu],
        health: vec![ContainerHealth {
            key: "ns/pod\"x\"/c\\1\nline2".into(),
            namespace: "ns".into(),
            pod: "pod\"x\"".into(),
            container: "c\\1".into(),
            fallback_periods: 3,
            fallback_ms: 2500,
            last_fallback_reason: "the daemon did not answer".into(),
            refused_registrations: 7,
            last_refusal: "GPU \"GPU-x\" is not a GPU of this node".into(),
            memory_refusals: vec![vgpu_daemon::model::MemoryRefusals {
                uuid: GPU0.into(),
                count: 2,
                last_asked: 1 << 30,
                last_used: 3 << 30,
                last_quota: 4 << 30,
                last_unix_ms: 1_700_000_000_000,
            }],
            processes_in_fallback: 2,
        }],
    }
}

#[test]
fn label_values_are_escaped() {
    assert_eq!(escape_label_value(r#"a"b\c"#), r#"a\"b\\c"#);
    assert_eq!(escape_label_value("x\ny"), r"x\ny");
    assert_eq!(escape_label_value("ünï ✓"), "ünï ✓");
}

#[test]
fn text_format_parses_back() {
    let snap = evil_snapshot();
    let text = render(&snap);
    let (samples, types) = parse(&text);

    assert_eq!(types["vgpu_tenant_gpu_time_seconds_total"], "counter");
    assert_eq!(types["vgpu_tenant_memory_used_bytes"], "gauge");
    assert_eq!(types["vgpu_gpu_scheduled_seconds_total"], "counter");
    assert_eq!(
        find(&samples, "vgpu_daemon_up", &[]).map(|s| s.value),
        Some(1.0)
    );
    assert_eq!(
        find(&samples, "vgpu_daemon_uptime_seconds", &[]).map(|s| s.value),
        Some(12.5)
    );

    // The evil tenant's labels come back exactly.
    let key = "ns/pod\"x\"/c\\1\nline2";
    // Its fallbacks and refusals are counted.
    assert_eq!(types["vgpu_container_fallback_periods_total"], "counter");
    let h = [("tenant", key), ("pod", "pod\"x\"")];
    let hv = |name: &str| find(&samples, name, &h).map(|s| s.value);
    assert_eq!(hv("vgpu_container_fallback_periods_total"), Some(3.0));
    assert_eq!(hv("vgpu_container_fallback_seconds_total"), Some(2.5));
    assert_eq!(hv("vgpu_container_registrations_refused_total"), Some(7.0));
    // Processes in fallback now are a gauge, never silent (ADR 0013).
    assert_eq!(types["vgpu_container_processes_in_fallback"], "gauge");
    assert_eq!(hv("vgpu_container_processes_in_fallback"), Some(2.0));
    let l = [("tenant", key), ("gpu", GPU1)];
    let s = find(&samples, "vgpu_tenant_compute_share_ratio", &l).expect("share sample");
    assert_eq!(s.value, 0.6);
    assert_eq!(s.label("pod"), Some("pod\"x\""));
    assert_eq!(s.label("container"), Some("c\\1"));
    assert_eq!(s.label("namespace"), Some("ns"));
    let v = |name: &str| find(&samples, name, &l).map(|s| s.value);
    assert_eq!(v("vgpu_tenant_compute_share_achieved_ratio"), Some(0.295));
    assert_eq!(v("vgpu_tenant_gpu_time_seconds_total"), Some(1.5));
    assert_eq!(v("vgpu_tenant_throttled_seconds_total"), Some(0.25));
    assert_eq!(v("vgpu_tenant_grants_total"), Some(42.0));
    assert_eq!(v("vgpu_tenant_unclaimed_grants_total"), Some(5.0));
    assert_eq!(v("vgpu_tenant_expired_grants_total"), Some(3.0));
    // Co-holding and the container's CPU throttling, as the scheduler sees them.
    assert_eq!(types["vgpu_tenant_co_held"], "gauge");
    assert_eq!(v("vgpu_tenant_co_held"), Some(1.0));
    assert_eq!(v("vgpu_tenant_cpu_stopped_ratio"), Some(0.725));
    assert_eq!(v("vgpu_tenant_slice_seconds"), Some(0.04));
    assert_eq!(v("vgpu_tenant_queue_ahead_seconds"), Some(0.012));
    assert_eq!(v("vgpu_tenant_suspended_bytes"), Some((5u64 << 20) as f64));
    assert_eq!(v("vgpu_tenant_suspensions_total"), Some(2.0));
    assert_eq!(
        v("vgpu_tenant_memory_used_bytes"),
        Some((3u64 << 30) as f64)
    );
    assert_eq!(
        v("vgpu_tenant_memory_quota_bytes"),
        Some((4u64 << 30) as f64)
    );
    let info = find(&samples, "vgpu_tenant_settings_info", &l).expect("settings info");
    assert_eq!(info.label("policy"), Some("cap"));
    assert_eq!(info.label("priority"), Some("latency-sensitive"));
    assert_eq!(info.label("source"), Some("api"));
    let state = |st: &str| {
        find(
            &samples,
            "vgpu_tenant_slice_state",
            &[("tenant", key), ("gpu", GPU1), ("state", st)],
        )
        .map(|s| s.value)
    };
    assert_eq!(state("waiting"), Some(1.0));
    assert_eq!(state("holding"), Some(0.0));
    assert_eq!(
        find(&samples, "vgpu_tenant_processes", &[("tenant", key)]).map(|s| s.value),
        Some(2.0)
    );
    // An unlimited quota has no sample.
    assert!(
        find(
            &samples,
            "vgpu_tenant_memory_quota_bytes",
            &[("tenant", "plain")]
        )
        .is_none()
    );

    // Per GPU, one sample despite the duplicate observation.
    let g = [("gpu", GPU0)];
    let gv = |name: &str| {
        let n = samples
            .iter()
            .filter(|s| s.name == name && s.label("gpu") == Some(GPU0))
            .count();
        assert_eq!(n, 1, "{name}: one sample per GPU");
        find(&samples, name, &g).map(|s| s.value)
    };
    assert_eq!(
        gv("vgpu_gpu_memory_total_bytes"),
        Some((80u64 << 30) as f64)
    );
    assert_eq!(gv("vgpu_gpu_memory_used_bytes"), Some((5u64 << 30) as f64));
    assert_eq!(gv("vgpu_gpu_utilization_ratio"), Some(0.73));
    assert_eq!(gv("vgpu_gpu_processes"), Some(2.0));
    assert_eq!(gv("vgpu_gpu_bypass_processes"), Some(1.0));
    assert_eq!(
        gv("vgpu_gpu_bypass_memory_bytes"),
        Some((1u64 << 30) as f64)
    );
    assert_eq!(gv("vgpu_gpu_scheduled_seconds_total"), Some(9.0));
    assert_eq!(
        gv("vgpu_gpu_last_observation_timestamp_seconds"),
        Some(1_700_000_000.123)
    );
    let info = find(&samples, "vgpu_gpu_info", &g).expect("GPU info");
    assert_eq!(info.label("name"), Some("NVIDIA \"H100\" 80GB\\HBM3"));
    assert_eq!(info.label("index"), Some("0"));
}

#[test]
fn empty_daemon_renders_valid_text() {
    let d = daemon();
    let (samples, types) = parse(&render(&d.snapshot()));
    assert_eq!(
        find(&samples, "vgpu_daemon_tenants", &[]).map(|s| s.value),
        Some(0.0)
    );
    assert!(types.contains_key("vgpu_tenant_compute_share_ratio"));
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics server");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read the response");
    let (head, body) = resp.split_once("\r\n\r\n").expect("HTTP head and body");
    (head.to_owned(), body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_over_http() {
    let d = daemon();
    let _a = register(
        &d,
        4001,
        "default/web-0/app",
        "default",
        "web-0",
        "app",
        &[(GPU0, 50, ComputePolicy::Burst, Some(2 << 30))],
    );
    let _b = register(
        &d,
        4002,
        "default/batch-0/train",
        "default",
        "batch-0",
        "train",
        &[(GPU0, 25, ComputePolicy::Cap, None)],
    );
    d.record_observations(
        vec![GpuObservation {
            uuid: GPU0.into(),
            index: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_total: 80 << 30,
            memory_used: 3 << 30,
            utilization_pct: None,
            processes: vec![(4001, 1 << 30), (4999, 2 << 30)],
            observed_unix_ms: 1_700_000_000_000,
        }],
        d.registered_pids(),
    );
    let cfg = vgpu_daemon::reporting::ReportingConfig {
        nvml: None,
        metrics_addr: Some("127.0.0.1:0".into()),
        api_socket: None,
        api_addr: None,
    };
    let rep = vgpu_daemon::reporting::start(d.clone(), &cfg)
        .await
        .expect("start the metrics server");
    let addr = rep.metrics_addr.expect("bound address");
    let (head, body) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
        .await
        .expect("request task");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("content-type: {CONTENT_TYPE}")),
        "{head}"
    );
    let (samples, _) = parse(&body);
    let web = [("tenant", "default/web-0/app"), ("gpu", GPU0)];
    let s = find(&samples, "vgpu_tenant_compute_share_ratio", &web).expect("web's share");
    assert_eq!(s.value, 0.5);
    assert_eq!(s.label("pod"), Some("web-0"));
    assert_eq!(s.label("container"), Some("app"));
    assert_eq!(
        find(&samples, "vgpu_tenant_memory_quota_bytes", &web).map(|s| s.value),
        Some((2u64 << 30) as f64)
    );
    let g = [("gpu", GPU0)];
    assert_eq!(
        find(&samples, "vgpu_gpu_bypass_processes", &g).map(|s| s.value),
        Some(1.0)
    );
    assert_eq!(
        find(&samples, "vgpu_daemon_tenants", &[]).map(|s| s.value),
        Some(2.0)
    );
    // Utilization not supported: no sample rather than a made-up one.
    assert!(find(&samples, "vgpu_gpu_utilization_ratio", &g).is_none());

    let (head, body) = tokio::task::spawn_blocking(move || http_get(addr, "/healthz"))
        .await
        .expect("request task");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, "ok\n");
    let (head, _) = tokio::task::spawn_blocking(move || http_get(addr, "/nope"))
        .await
        .expect("request task");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
}
