//! Shared helpers of the extender's integration tests.

#![allow(dead_code)] // each test binary uses a different part

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::{Value, json};
use vgpu_core::inventory::{ANNOTATION_GPU_INVENTORY, GpuInfo, INVENTORY_VERSION, NodeInventory};
use vgpu_core::packing::PolicyName;
use vgpu_scheduler_extender::extender::binder::{BindPlan, Binder, BoxFuture};
use vgpu_scheduler_extender::extender::limits::HttpLimits;
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::sync::WatchKind;
use vgpu_scheduler_extender::extender::{Extender, ExtenderError, State, StateConfig};

/// Deadline of every single HTTP exchange in tests: a missing answer fails fast.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The recorded kube-scheduler v1.28 requests (shared/fixtures), if present.
pub fn fixtures_dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for base in [
        manifest.join("../../shared"),
        manifest.join("../../../shared"),
    ] {
        let dir = base.join("fixtures/kubernetes-v1.28");
        if dir.is_dir() {
            return dir;
        }
    }
    panic!(
        "fixtures not found: expected shared/fixtures/kubernetes-v1.28 beside the repository or inside it"
    );
}

/// Reads one fixture as JSON.
pub fn fixture(rel: &str) -> Value {
    let path = fixtures_dir().join(rel);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// Rewrites the fixtures' plain extended resource `example.com/gpu` (whole GPUs)
/// into vgpu's `vgpu.io/gpu` (0.1-GPU slices, so N GPUs become N×10) everywhere
/// in a request body: pods' requests and limits, and nodes' capacity/allocatable.
pub fn rewrite_resource(v: &mut Value) {
    match v {
        Value::Object(map) => {
            if let Some(q) = map.remove("example.com/gpu") {
                let n: u64 = match &q {
                    Value::String(s) => s.parse().expect("whole GPUs in the fixtures"),
                    Value::Number(n) => n.as_u64().expect("whole GPUs"),
                    other => panic!("unexpected quantity {other}"),
                };
                map.insert("vgpu.io/gpu".into(), json!((n * 10).to_string()));
            }
            for (_, child) in map.iter_mut() {
                rewrite_resource(child);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(rewrite_resource),
        _ => {}
    }
}

/// The inventory annotation of a node with `gpus` GPUs of `model`.
pub fn inventory_json(node: &str, gpus: usize, model: &str, memory_mib: u64) -> String {
    NodeInventory {
        version: INVENTORY_VERSION,
        gpus: (0..gpus)
            .map(|i| GpuInfo {
                index: i as u32,
                uuid: format!("GPU-{node}-{i}"),
                model: model.into(),
                memory_mib,
                healthy: true,
                topology: None,
            })
            .collect(),
        slices_per_gpu: vgpu_core::resources::SLICES_PER_GPU,
    }
    .to_json()
}

/// A GPU node as the device plugin leaves it (inventory annotation, slices advertised).
pub fn gpu_node(name: &str, gpus: usize, model: &str, memory_mib: u64) -> Value {
    json!({
        "metadata": {
            "name": name,
            "uid": format!("uid-{name}"),
            "labels": {"kubernetes.io/hostname": name},
            "annotations": {ANNOTATION_GPU_INVENTORY: inventory_json(name, gpus, model, memory_mib)},
        },
        "spec": {},
        "status": {
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110", "vgpu.io/gpu": (gpus * 10).to_string()},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "vgpu.io/gpu": (gpus * 10).to_string()},
        }
    })
}

/// A pending pod with one container asking `requests`.
pub fn gpu_pod(name: &str, uid: &str, requests: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {
            "schedulerName": "default-scheduler",
            "containers": [{
                "name": "main",
                "image": "registry.invalid/none:0",
                "resources": {"requests": requests.clone(), "limits": requests},
            }],
        },
        "status": {"phase": "Pending"},
    })
}

/// A binder that records every plan and succeeds (or fails when told).
#[derive(Debug, Default)]
pub struct RecordingBinder {
    pub plans: Mutex<Vec<BindPlan>>,
}

impl Binder for RecordingBinder {
    fn bind<'a>(&'a self, plan: &'a BindPlan) -> BoxFuture<'a, Result<(), ExtenderError>> {
        self.plans.lock().expect("not poisoned").push(plan.clone());
        Box::pin(async { Ok(()) })
    }
}

/// An HTTP client for an extender listening at `addr`.
pub struct ServedClient {
    pub addr: SocketAddr,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<axum::body::Bytes>,
    >,
}

impl ServedClient {
    pub fn new(addr: SocketAddr) -> Self {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http();
        ServedClient { addr, client }
    }

    /// POSTs a body; returns the status and the body. Fails the test after [`CALL_TIMEOUT`].
    pub async fn post(&self, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        let req = hyper::Request::post(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
            .header("accept-encoding", "gzip")
            .body(http_body_util::Full::new(axum::body::Bytes::from(body)))
            .expect("request");
        let fut = async {
            let resp = self.client.request(req).await.expect("extender answers");
            let status = resp.status().as_u16();
            let bytes = resp.into_body().collect().await.expect("body").to_bytes();
            (status, bytes.to_vec())
        };
        tokio::time::timeout(CALL_TIMEOUT, fut)
            .await
            .unwrap_or_else(|_| panic!("no answer to POST {path} within {CALL_TIMEOUT:?}"))
    }

    /// POSTs JSON and parses the JSON answer.
    pub async fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, bytes) = self
            .post(path, serde_json::to_vec(body).expect("json"))
            .await;
        let v = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "answer of {path} is not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        (status, v)
    }

    pub async fn get(&self, path: &str) -> u16 {
        let req = hyper::Request::get(format!("http://{}{path}", self.addr))
            .body(http_body_util::Full::new(axum::body::Bytes::new()))
            .expect("request");
        tokio::time::timeout(CALL_TIMEOUT, self.client.request(req))
            .await
            .expect("answer in time")
            .expect("answer")
            .status()
            .as_u16()
    }
}

/// The extender served on a loopback port, with a client.
pub struct Served {
    pub addr: SocketAddr,
    pub extender: Extender,
    client: ServedClient,
}

impl Served {
    /// Served as `serve` serves it, with the default HTTP limits.
    pub async fn start(extender: Extender) -> Self {
        Self::start_with(extender, HttpLimits::default()).await
    }

    /// Served as `serve` serves it (`serve_on`: header deadline, body limits).
    pub async fn start_with(extender: Extender, limits: HttpLimits) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let app = vgpu_scheduler_extender::extender::http::router_with(
            extender.clone(),
            "/scheduler",
            limits,
        );
        tokio::spawn(vgpu_scheduler_extender::extender::http::serve_on(
            listener,
            app,
            limits.header_timeout,
            std::future::pending(),
        ));
        Served {
            addr,
            extender,
            client: ServedClient::new(addr),
        }
    }

    /// POSTs a body; returns the status and the body.
    pub async fn post(&self, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        self.client.post(path, body).await
    }

    /// POSTs JSON and parses the JSON answer.
    pub async fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        self.client.post_json(path, body).await
    }

    pub async fn get(&self, path: &str) -> u16 {
        self.client.get(path).await
    }
}

/// The extender's state as after its first lists: `nodes` (Node objects as JSON), no
/// pods, both watches synced.
pub fn synced_state(config: StateConfig, policy: PolicyName, nodes: Vec<Value>) -> Arc<State> {
    let state = Arc::new(State::new(config, ExtenderPolicy::new(policy)));
    let nodes: Vec<_> = nodes
        .into_iter()
        .map(|n| serde_json::from_value(n).expect("node"))
        .collect();
    state.replace_nodes(&nodes);
    state.replace_pods(&[]);
    state.mark_synced(WatchKind::Nodes);
    state.mark_synced(WatchKind::Pods);
    state
}

/// Shared handle to a recording binder.
pub fn recording_binder() -> Arc<RecordingBinder> {
    Arc::new(RecordingBinder::default())
}
