//! A scripted fake Kubernetes API server for pods: `GET` one pod, list and watch all
//! (newline-delimited watch events with resource versions). Requests are counted.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::broadcast;

#[derive(Debug, Default)]
struct Inner {
    rv: u64,
    pods: BTreeMap<(String, String), Value>,
    nodes: BTreeMap<String, Value>,
    log: Vec<(u64, &'static str, Value)>,
    events: Vec<Value>,
}

/// Handle to a running fake API server.
#[derive(Debug, Clone)]
pub struct FakeApi {
    inner: Arc<Mutex<Inner>>,
    changed: broadcast::Sender<()>,
    gets: Arc<AtomicU64>,
    /// Where it listens.
    pub addr: SocketAddr,
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    (
        code,
        axum::Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
        })),
    )
        .into_response()
}

impl FakeApi {
    /// Starts a fake on an ephemeral loopback port.
    pub async fn start() -> std::io::Result<FakeApi> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (changed, _) = broadcast::channel(4096);
        let fake = FakeApi {
            inner: Arc::default(),
            changed,
            gets: Arc::default(),
            addr,
        };
        let app = Router::new()
            .route("/api/v1/pods", get(list_or_watch))
            .route("/api/v1/namespaces/{ns}/pods/{name}", get(get_pod))
            .route(
                "/api/v1/nodes/{name}",
                axum::routing::patch(patch_node).get(get_node),
            )
            .route(
                "/api/v1/namespaces/{ns}/events",
                axum::routing::post(create_event),
            )
            .with_state(fake.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(fake)
    }

    /// A kube client pointed at this fake.
    pub fn client(&self) -> Result<kube::Client, kube::Error> {
        let url: http::Uri = format!("http://{}", self.addr)
            .parse()
            .expect("a socket address makes a valid URI");
        let mut config = kube::Config::new(url);
        config.read_timeout = Some(Duration::from_secs(30));
        config.connect_timeout = Some(Duration::from_secs(2));
        kube::Client::try_from(config)
    }

    /// Adds or replaces a pod (a watch event follows).
    pub fn put_pod(&self, mut pod: Value) {
        let mut inner = lock(&self.inner);
        inner.rv += 1;
        let rv = inner.rv;
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = pod_key(&pod);
        let ev = if inner.pods.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        inner.pods.insert(key, pod.clone());
        inner.log.push((rv, ev, pod));
        let _ = self.changed.send(());
    }

    /// Deletes a pod (a watch event follows); whether it existed.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> bool {
        let mut inner = lock(&self.inner);
        let Some(mut pod) = inner.pods.remove(&(namespace.to_owned(), name.to_owned())) else {
            return false;
        };
        inner.rv += 1;
        let rv = inner.rv;
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        inner.log.push((rv, "DELETED", pod));
        let _ = self.changed.send(());
        true
    }

    /// The stored pod.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.inner)
            .pods
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Puts a node (its `metadata.name` names it); later merge patches apply to it.
    pub fn put_node(&self, mut node: Value) {
        node["apiVersion"] = json!("v1");
        node["kind"] = json!("Node");
        let name = node["metadata"]["name"].as_str().unwrap_or("").to_owned();
        lock(&self.inner).nodes.insert(name, node);
    }

    /// The node as patched so far (merge patches applied to an empty object).
    pub fn node(&self, name: &str) -> Option<Value> {
        lock(&self.inner).nodes.get(name).cloned()
    }

    /// The events created so far.
    pub fn events(&self) -> Vec<Value> {
        lock(&self.inner).events.clone()
    }

    /// How many single-pod GETs were served.
    pub fn gets(&self) -> u64 {
        self.gets.load(Ordering::Relaxed)
    }

    fn list(&self) -> Value {
        let inner = lock(&self.inner);
        json!({
            "apiVersion": "v1", "kind": "PodList",
            "metadata": {"resourceVersion": inner.rv.to_string()},
            "items": inner.pods.values().cloned().collect::<Vec<_>>(),
        })
    }

    fn watch(&self, from_rv: u64, timeout: Duration) -> Response {
        let mut changes = self.changed.subscribe();
        let inner = self.inner.clone();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let mut sent = from_rv;
            loop {
                let lines: Vec<(u64, String)> = lock(&inner)
                    .log
                    .iter()
                    .filter(|(rv, _, _)| *rv > sent)
                    .map(|(rv, ev, obj)| (*rv, format!("{}\n", json!({"type": ev, "object": obj}))))
                    .collect();
                for (rv, line) in lines {
                    sent = rv;
                    if tx.send(Ok(Bytes::from(line))).await.is_err() {
                        return;
                    }
                }
                match tokio::time::timeout_at(deadline, changes.recv()).await {
                    Err(_) | Ok(Err(broadcast::error::RecvError::Closed)) => return,
                    Ok(_) => {}
                }
            }
        });
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap_or_else(|_| {
                status(StatusCode::INTERNAL_SERVER_ERROR, "Internal", "body".into())
            })
    }
}

fn pod_key(pod: &Value) -> (String, String) {
    (
        pod["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_owned(),
        pod["metadata"]["name"].as_str().unwrap_or("").to_owned(),
    )
}

async fn list_or_watch(
    State(fake): State<FakeApi>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let from = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let secs = q
            .get("timeoutSeconds")
            .and_then(|v| v.parse().ok())
            .unwrap_or(300);
        fake.watch(from, Duration::from_secs(secs))
    } else {
        axum::Json(fake.list()).into_response()
    }
}

async fn get_pod(
    State(fake): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    fake.gets.fetch_add(1, Ordering::Relaxed);
    match fake.pod(&ns, &name) {
        Some(pod) => axum::Json(pod).into_response(),
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("pods \"{name}\" not found"),
        ),
    }
}

async fn get_node(State(fake): State<FakeApi>, Path(name): Path<String>) -> Response {
    match fake.node(&name) {
        Some(node) => axum::Json(node).into_response(),
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("nodes \"{name}\" not found"),
        ),
    }
}

/// JSON merge patch (RFC 7386).
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

async fn create_event(
    State(fake): State<FakeApi>,
    Path(ns): Path<String>,
    body: Bytes,
) -> Response {
    let Ok(mut ev) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON".into());
    };
    if ev["involvedObject"]["namespace"].as_str() != Some(ns.as_str()) {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("involvedObject.namespace does not match the namespace {ns:?}"),
        );
    }
    let mut inner = lock(&fake.inner);
    inner.rv += 1;
    let n = inner.events.len();
    if let Some(g) = ev["metadata"]["generateName"].as_str() {
        ev["metadata"]["name"] = json!(format!("{g}{n}"));
    }
    ev["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
    inner.events.push(ev.clone());
    (StatusCode::CREATED, axum::Json(ev)).into_response()
}

async fn patch_node(
    State(fake): State<FakeApi>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON".into());
    };
    let mut inner = lock(&fake.inner);
    let node = inner
        .nodes
        .entry(name.clone())
        .or_insert_with(|| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}));
    if !node.is_object() {
        *node = json!({});
    }
    merge(node, &patch);
    if let Value::Object(o) = node {
        o.entry("metadata").or_insert_with(|| json!({}));
    }
    axum::Json(node.clone()).into_response()
}
