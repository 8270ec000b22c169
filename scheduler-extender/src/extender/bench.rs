//! `vgpu-scheduler-extender bench-extender`: latency of the extender's verbs at scale.
//!
//! Builds a cluster in memory (default 5,000 nodes of 8 GPUs), fills it with
//! 50,000 GPU pods placed by the extender's own bind (a mix of 0.1–0.5 GPU
//! shares, some with a memory override, and 1, 2 and 4 whole GPUs), then for
//! each sample pod times, in process and on the real request bytes:
//!
//! - `filter`: parse the `ExtenderArgs` JSON (the pod and every node's name, as
//!   kube-scheduler sends it with `nodeCacheCapable: true`), decide every node,
//!   serialise the answer;
//! - `prioritize`: the same over the nodes filter kept;
//! - `bind`: decide the GPUs on the best node against the live ledger, build the
//!   assignment record, with a binder that makes no API call (the API round trip
//!   is the API server's, not ours).
//!
//! Optionally (`--http`) the same requests go through the real HTTP server on a
//! loopback socket, which adds the HTTP stack. Figures are printed, never
//! asserted; the last line is JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use vgpu_core::inventory::{ANNOTATION_GPU_INVENTORY, GpuInfo, INVENTORY_VERSION, NodeInventory};
use vgpu_core::packing::PolicyName;
use vgpu_core::resources::ANNOTATION_ASSIGNMENT;

use super::binder::NoopBinder;
use super::cluster::{State, StateConfig};
use super::http::Extender;
use super::policy::ExtenderPolicy;
use super::sync::WatchKind;
use super::types::{ExtenderArgs, ExtenderBindingArgs, ExtenderFilterResult, HostPriorityList};

/// Arguments of `bench-extender`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 5000)]
    pub nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// GPU pods placed before measuring.
    #[arg(long, default_value_t = 50_000)]
    pub pods: usize,
    /// Sample pods measured (each: filter, prioritize, bind, then deleted).
    #[arg(long, default_value_t = 400)]
    pub samples: usize,
    /// Placement policy.
    #[arg(long, default_value = "vgpu")]
    pub policy: PolicyName,
    /// Random seed of the workload.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Also measure through the HTTP server on a loopback socket.
    #[arg(long)]
    pub http: bool,
    /// Candidate nodes per filter request, drawn at random (0: every node). With its
    /// default `percentageOfNodesToScore`, kube-scheduler stops searching after
    /// max(100, N·max(5, 50 − N/125) %) feasible nodes: 500 at 5,000 nodes.
    #[arg(long, default_value_t = 0)]
    pub candidates: usize,
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A generated object did not deserialise (a bug in the generator).
    #[error("generate {what}")]
    Generate {
        /// What was generated.
        what: &'static str,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// An answer could not be read back.
    #[error("read {verb} answer: {detail}")]
    Answer {
        /// The verb.
        verb: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The loopback HTTP measurement failed.
    #[error("loopback http: {0}")]
    Http(String),
}

/// Latency summary of one verb, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest.
    pub max_us: f64,
    /// Mean.
    pub mean_us: f64,
}

/// On-CPU time of the calling thread. The machines this runs on are shared, so
/// wall time includes time the OS gave to other processes; CPU time is our own
/// work only. Both are reported.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// Wall and CPU time of one call.
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration, Duration) {
    let (w, c) = (Instant::now(), thread_cpu());
    let out = f();
    let cpu = thread_cpu().saturating_sub(c);
    (out, w.elapsed(), cpu)
}

/// Summarises durations (nearest-rank percentiles).
#[must_use]
pub fn summarise(samples: &[Duration]) -> Summary {
    if samples.is_empty() {
        return Summary::default();
    }
    let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    let rank = |p: f64| {
        let k = ((p / 100.0) * us.len() as f64).ceil() as usize;
        us[k.clamp(1, us.len()) - 1]
    };
    Summary {
        n: us.len(),
        p50_us: rank(50.0),
        p90_us: rank(90.0),
        p99_us: rank(99.0),
        max_us: us[us.len() - 1],
        mean_us: us.iter().sum::<f64>() / us.len() as f64,
    }
}

const MODELS: [(&str, u64); 2] = [("A100-SXM4-80GB", 81_920), ("L4", 23_034)];

/// A Node object as the device plugin and kubelet leave it.
fn make_node(i: usize, gpus: usize) -> Result<Node, BenchError> {
    let (model, mem) = MODELS[usize::from(i % 5 == 4)];
    let name = format!("gpu-node-{i:05}");
    let inventory = NodeInventory {
        version: INVENTORY_VERSION,
        gpus: (0..gpus)
            .map(|g| GpuInfo {
                index: u32::try_from(g).unwrap_or(u32::MAX),
                uuid: format!("GPU-{i:08x}-{g:04x}-4000-8000-000000000000"),
                model: model.to_string(),
                memory_mib: mem,
                healthy: true,
                topology: None,
            })
            .collect(),
        slices_per_gpu: vgpu_core::resources::SLICES_PER_GPU,
    };
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "vgpu.io/gpu-model": model},
            "annotations": {ANNOTATION_GPU_INVENTORY: inventory.to_json()},
        },
        "status": {
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", "vgpu.io/gpu": (gpus * 10).to_string()},
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", "vgpu.io/gpu": (gpus * 10).to_string()},
        }
    }))
    .map_err(|source| BenchError::Generate { what: "node", source })
}

/// A pending GPU pod of a random shape.
fn make_pod(uid: &str, rng: &mut StdRng) -> Result<Pod, BenchError> {
    let roll: f64 = rng.random();
    let requests = if roll < 0.55 {
        json!({"cpu": "1", "memory": "4Gi", "vgpu.io/gpu": rng.random_range(1..=5).to_string()})
    } else if roll < 0.70 {
        json!({"cpu": "1", "vgpu.io/gpu": "2", "vgpu.io/gpu-memory": rng.random_range(2048..=16384).to_string()})
    } else if roll < 0.90 {
        json!({"cpu": "4", "vgpu.io/gpu": "10"})
    } else if roll < 0.98 {
        json!({"cpu": "8", "vgpu.io/gpu": "20"})
    } else {
        json!({"cpu": "16", "vgpu.io/gpu": "40"})
    };
    serde_json::from_value(json!({
        "metadata": {"name": format!("pod-{uid}"), "namespace": "bench", "uid": uid},
        "spec": {
            "schedulerName": "default-scheduler",
            "containers": [{
                "name": "main",
                "image": "registry.invalid/train:1",
                "resources": {"requests": requests, "limits": requests},
            }],
        },
        "status": {"phase": "Pending"},
    }))
    .map_err(|source| BenchError::Generate {
        what: "pod",
        source,
    })
}

fn binding_args(pod: &Pod, node: &str) -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: pod.metadata.name.clone().unwrap_or_default(),
        pod_namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod_uid: pod.metadata.uid.clone().unwrap_or_default(),
        node: node.to_string(),
    }
}

/// The pod as the watch shows it after a successful bind.
fn bound(mut pod: Pod, node: &str, assignment_json: String) -> Pod {
    pod.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ANNOTATION_ASSIGNMENT.to_string(), assignment_json);
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some(node.to_string());
    }
    if let Some(status) = pod.status.as_mut() {
        status.phase = Some("Running".into());
    }
    pod
}

/// The populated cluster.
#[derive(Debug)]
pub struct Cluster {
    /// The extender over it (no-op binder).
    pub extender: Extender,
    /// Node names, in order.
    pub node_names: Vec<String>,
    /// Pods placed.
    pub placed: usize,
    /// Pods that fit nowhere and were left out.
    pub unplaced: usize,
    /// Time of one full ledger rebuild over the filled cluster.
    pub rebuild: Duration,
    /// Time of one recomputation of the policy's typical tasks over the workload.
    pub refresh: Duration,
    /// Time of one GPU health change (a node's inventory marks a GPU unhealthy).
    pub health: Duration,
}

/// Builds and fills a cluster through the state's own bind path.
pub fn populate(args: &BenchArgs, rng: &mut StdRng) -> Result<Cluster, BenchError> {
    let state = Arc::new(State::new(
        StateConfig::default(),
        ExtenderPolicy::new(args.policy),
    ));
    let nodes: Vec<Node> = (0..args.nodes)
        .map(|i| make_node(i, args.gpus_per_node))
        .collect::<Result<_, _>>()?;
    let node_names: Vec<String> = nodes
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    state.replace_nodes(&nodes);
    state.replace_pods(&[]);
    state.mark_synced(WatchKind::Nodes);
    state.mark_synced(WatchKind::Pods);
    let mut cursor = 0usize;
    let (mut placed, mut unplaced) = (0, 0);
    for k in 0..args.pods {
        let pod = make_pod(&format!("fill-{k:06}"), rng)?;
        state.apply_pod(&pod);
        let mut done = false;
        // First fit from a rotating cursor: cheap, and leaves a realistic mix of
        // partially used GPUs everywhere.
        for step in 0..node_names.len() {
            let node = &node_names[(cursor + step) % node_names.len()];
            if let Ok(plan) = state.begin_bind(&binding_args(&pod, node)) {
                state.finish_bind(&plan.uid);
                state.apply_pod(&bound(pod.clone(), node, plan.assignment_json));
                cursor = (cursor + step + 1) % node_names.len();
                done = true;
                break;
            }
        }
        if done {
            placed += 1;
        } else {
            state.delete_pod(&pod);
            unplaced += 1;
        }
    }
    // Recompute the policy's typical tasks from the full workload (what the sweep
    // does whenever the pod count moved by more than 1 %).
    let t = Instant::now();
    state.expire_now();
    let refresh = t.elapsed();
    // What a node inventory change costs at this scale: a full ledger rebuild.
    let t = Instant::now();
    state.replace_nodes(&nodes);
    let rebuild = t.elapsed();
    // What a GPU health change costs: node 0's first GPU turns unhealthy, then
    // healthy again (the second change is not timed).
    let health = match nodes.first() {
        Some(first) => {
            let sick = with_gpu_health(first, false)?;
            let t = Instant::now();
            state.apply_node(&sick);
            let health = t.elapsed();
            state.apply_node(first);
            health
        }
        None => Duration::ZERO,
    };
    Ok(Cluster {
        extender: Extender::new(state, Arc::new(NoopBinder)),
        node_names,
        placed,
        unplaced,
        rebuild,
        refresh,
        health,
    })
}

/// `node` with its first GPU's health set to `healthy` in the inventory annotation.
fn with_gpu_health(node: &Node, healthy: bool) -> Result<Node, BenchError> {
    let mut node = node.clone();
    if let Some(text) = node
        .metadata
        .annotations
        .as_mut()
        .and_then(|a| a.get_mut(ANNOTATION_GPU_INVENTORY))
    {
        let mut inventory = NodeInventory::from_json(text).map_err(|e| BenchError::Answer {
            verb: "inventory",
            detail: e.to_string(),
        })?;
        if let Some(g) = inventory.gpus.first_mut() {
            g.healthy = healthy;
        }
        *text = inventory.to_json();
    }
    Ok(node)
}

/// Figures of one run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Figures {
    /// Filter alone.
    pub filter: Summary,
    /// Prioritize alone.
    pub prioritize: Summary,
    /// Filter + prioritize of the same pod.
    pub filter_prioritize: Summary,
    /// Bind without the API round trip.
    pub bind: Summary,
    /// Filter, on-CPU time of the handling thread.
    pub cpu_filter: Summary,
    /// Prioritize, on-CPU time.
    pub cpu_prioritize: Summary,
    /// Filter + prioritize, on-CPU time.
    pub cpu_filter_prioritize: Summary,
    /// Bind, on-CPU time.
    pub cpu_bind: Summary,
    /// Filter + prioritize through loopback HTTP (with `--http`).
    pub http_filter_prioritize: Option<Summary>,
    /// Bind through loopback HTTP, no-op binder (with `--http`).
    pub http_bind: Option<Summary>,
    /// Mean number of nodes filter kept.
    pub mean_feasible: f64,
}

/// Runs the benchmark and returns its figures.
pub async fn measure(args: &BenchArgs) -> Result<(Cluster, Figures), BenchError> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let cluster = populate(args, &mut rng)?;
    let ext = cluster.extender.clone();
    let (mut f, mut p, mut fp, mut b) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut cf, mut cp, mut cfp, mut cb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut feasible_total = 0usize;
    let http = if args.http {
        Some(LoopbackClient::start(ext.clone()).await?)
    } else {
        None
    };
    let (mut hfp, mut hb) = (Vec::new(), Vec::new());
    for s in 0..args.samples {
        let pod = make_pod(&format!("sample-{s:06}"), &mut rng)?;
        let names = if args.candidates == 0 || args.candidates >= cluster.node_names.len() {
            cluster.node_names.clone()
        } else {
            rand::seq::index::sample(&mut rng, cluster.node_names.len(), args.candidates)
                .into_iter()
                .map(|i| cluster.node_names[i].clone())
                .collect()
        };
        let filter_body = serde_json::to_vec(&ExtenderArgs {
            pod: Some(pod.clone()),
            nodes: None,
            node_names: Some(names),
        })
        .map_err(|source| BenchError::Generate {
            what: "filter body",
            source,
        })?;
        let ((status, answer), t_filter, c_filter) = timed(|| ext.filter(&filter_body));
        let result: ExtenderFilterResult =
            serde_json::from_slice(&answer).map_err(|e| BenchError::Answer {
                verb: "filter",
                detail: format!("status {status}: {e}"),
            })?;
        let feasible = result.node_names.unwrap_or_default();
        feasible_total += feasible.len();
        if feasible.is_empty() {
            f.push(t_filter);
            cf.push(c_filter);
            continue;
        }
        let prio_body = serde_json::to_vec(&ExtenderArgs {
            pod: Some(pod.clone()),
            nodes: None,
            node_names: Some(feasible.clone()),
        })
        .map_err(|source| BenchError::Generate {
            what: "prioritize body",
            source,
        })?;
        let ((status, answer), t_prio, c_prio) = timed(|| ext.prioritize(&prio_body));
        let scores: HostPriorityList =
            serde_json::from_slice(&answer).map_err(|e| BenchError::Answer {
                verb: "prioritize",
                detail: format!("status {status}: {e}"),
            })?;
        let best = scores
            .iter()
            .max_by_key(|h| h.score)
            .map(|h| h.host.clone())
            .unwrap_or_else(|| feasible[0].clone());
        let bind_body = serde_json::to_vec(&binding_args(&pod, &best)).map_err(|source| {
            BenchError::Generate {
                what: "bind body",
                source,
            }
        })?;
        let (w2, c2) = (Instant::now(), thread_cpu());
        let (status, answer) = ext.bind(&bind_body).await;
        let (t_bind, c_bind) = (w2.elapsed(), thread_cpu().saturating_sub(c2));
        if status != axum::http::StatusCode::OK || answer != br#"{"Error":""}"# {
            return Err(BenchError::Answer {
                verb: "bind",
                detail: String::from_utf8_lossy(&answer).into_owned(),
            });
        }
        f.push(t_filter);
        p.push(t_prio);
        fp.push(t_filter + t_prio);
        b.push(t_bind);
        cf.push(c_filter);
        cp.push(c_prio);
        cfp.push(c_filter + c_prio);
        cb.push(c_bind);
        // Keep the load constant: the sample pod leaves again.
        ext.state().delete_pod(&pod);
        if let Some(client) = &http {
            let t3 = Instant::now();
            client.post("/scheduler/filter", filter_body).await?;
            client.post("/scheduler/prioritize", prio_body).await?;
            hfp.push(t3.elapsed());
            let t4 = Instant::now();
            client.post("/scheduler/bind", bind_body).await?;
            hb.push(t4.elapsed());
            ext.state().delete_pod(&pod);
        }
    }
    let figures = Figures {
        filter: summarise(&f),
        prioritize: summarise(&p),
        filter_prioritize: summarise(&fp),
        bind: summarise(&b),
        cpu_filter: summarise(&cf),
        cpu_prioritize: summarise(&cp),
        cpu_filter_prioritize: summarise(&cfp),
        cpu_bind: summarise(&cb),
        http_filter_prioritize: http.as_ref().map(|_| summarise(&hfp)),
        http_bind: http.as_ref().map(|_| summarise(&hb)),
        mean_feasible: feasible_total as f64 / args.samples.max(1) as f64,
    };
    Ok((cluster, figures))
}

/// A minimal HTTP/1 client to the extender on a loopback socket.
#[derive(Debug)]
struct LoopbackClient {
    addr: std::net::SocketAddr,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<axum::body::Bytes>,
    >,
}

impl LoopbackClient {
    async fn start(ext: Extender) -> Result<Self, BenchError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| BenchError::Http(format!("bind 127.0.0.1:0: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| BenchError::Http(format!("local address: {e}")))?;
        let limits = super::limits::HttpLimits::default();
        let app = super::http::router_with(ext, "/scheduler", limits);
        tokio::spawn(super::http::serve_on(
            listener,
            app,
            limits.header_timeout,
            std::future::pending(),
        ));
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http();
        Ok(Self { addr, client })
    }

    async fn post(&self, path: &str, body: Vec<u8>) -> Result<Vec<u8>, BenchError> {
        use http_body_util::BodyExt;
        let req = hyper::Request::post(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(axum::body::Bytes::from(body)))
            .map_err(|e| BenchError::Http(format!("build request {path}: {e}")))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| BenchError::Http(format!("POST {path}: {e}")))?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| BenchError::Http(format!("read {path}: {e}")))?
            .to_bytes();
        if status != hyper::StatusCode::OK {
            return Err(BenchError::Http(format!("POST {path}: status {status}")));
        }
        Ok(bytes.to_vec())
    }
}

fn line(name: &str, s: &Summary) -> String {
    format!(
        "{name:<28} n={:<5} p50={:>9.1} µs  p90={:>9.1} µs  p99={:>9.1} µs  max={:>9.1} µs  mean={:>9.1} µs",
        s.n, s.p50_us, s.p90_us, s.p99_us, s.max_us, s.mean_us
    )
}

/// `bench-extender`: prints the figures; the last line is JSON.
pub fn run(args: &BenchArgs) -> Result<(), BenchError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| BenchError::Http(format!("tokio runtime: {e}")))?;
    let started = Instant::now();
    let (cluster, fig) = runtime.block_on(measure(args))?;
    let stats = cluster.extender.state().stats();
    println!(
        "cluster: {} nodes x {} GPUs, {} pods placed ({} did not fit), policy {}, built in {:.1} s",
        args.nodes,
        args.gpus_per_node,
        cluster.placed,
        cluster.unplaced,
        args.policy,
        started.elapsed().as_secs_f64()
    );
    println!(
        "ledger: {} pods placed, {} assumptions, {} conflicts",
        stats.placed, stats.assumptions, stats.conflicts
    );
    println!(
        "candidates per filter: {}; mean feasible: {:.0}",
        if args.candidates == 0 {
            args.nodes
        } else {
            args.candidates.min(args.nodes)
        },
        fig.mean_feasible
    );
    println!(
        "full ledger rebuild (node inventory change, restart): {:.1} ms",
        cluster.rebuild.as_secs_f64() * 1e3
    );
    println!(
        "typical-task refresh over the workload (sweep, pod count moved > 1 %): {:.1} ms",
        cluster.refresh.as_secs_f64() * 1e3
    );
    println!(
        "GPU health change (one node relabelled in place): {:.1} µs",
        cluster.health.as_secs_f64() * 1e6
    );
    println!("wall-clock time:");
    println!("{}", line("filter", &fig.filter));
    println!("{}", line("prioritize", &fig.prioritize));
    println!("{}", line("filter+prioritize", &fig.filter_prioritize));
    println!("{}", line("bind (no API round trip)", &fig.bind));
    println!("on-CPU time of the handling thread (excludes time given to other processes):");
    println!("{}", line("  filter", &fig.cpu_filter));
    println!("{}", line("  prioritize", &fig.cpu_prioritize));
    println!(
        "{}",
        line("  filter+prioritize", &fig.cpu_filter_prioritize)
    );
    println!("{}", line("  bind", &fig.cpu_bind));
    if let Some(s) = &fig.http_filter_prioritize {
        println!("{}", line("http filter+prioritize", s));
    }
    if let Some(s) = &fig.http_bind {
        println!("{}", line("http bind (no-op binder)", s));
    }
    let json = json!({
        "bench": "extender",
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "pods": cluster.placed,
        "policy": args.policy.as_str(),
        "samples": args.samples,
        "candidates": if args.candidates == 0 { args.nodes } else { args.candidates.min(args.nodes) },
        "rebuild_ms": cluster.rebuild.as_secs_f64() * 1e3,
        "refresh_ms": cluster.refresh.as_secs_f64() * 1e3,
        "health_change_us": cluster.health.as_secs_f64() * 1e6,
        "figures": fig,
    });
    println!("{json}");
    Ok(())
}
