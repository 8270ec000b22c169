//! A scripted fake Kubernetes API server speaking real HTTP JSON, for the device plugin's
//! and the extender's tests alike.
//!
//! It serves what their kube-rs sides use: list and watch of Nodes and Pods
//! (newline-delimited watch events with resource versions), `GET` of one pod or node,
//! merge patches of a pod or a node, the `pods/binding` subresource and event creation;
//! and the extender's `VgpuQuotaPolicy` custom resource (list, watch, merge patch of its
//! `status` subresource, which leaves the spec and the generation alone); and `GET` of a
//! `resource.k8s.io/v1` ResourceClaim and server-side apply of a ResourceSlice (the DRA
//! driver's tests).
//! Every request is recorded; tests wait for calls with a deadline
//! ([`FakeApi::wait_for_calls`]), so a call that never comes fails the test fast instead
//! of hanging it. Failures and delays can be scripted.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::broadcast;

/// One recorded request.
#[derive(Debug, Clone)]
pub struct Call {
    /// HTTP method.
    pub method: String,
    /// Path without the query (`?watch` appended for a watch).
    pub path: String,
    /// Request body as JSON (`Null` when empty).
    pub body: Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Node,
    Pod,
    QuotaPolicy,
}

/// The path of `VgpuQuotaPolicy` objects (group `vgpu.io`, version `v1alpha1`).
const QUOTA_POLICIES: &str = "/apis/vgpu.io/v1alpha1/vgpuquotapolicies";

#[derive(Debug, Clone)]
struct WatchEvent {
    rv: u64,
    kind: Kind,
    kind_event: &'static str,
    object: Value,
}

#[derive(Debug, Default)]
struct Inner {
    rv: u64,
    nodes: BTreeMap<String, Value>,
    pods: BTreeMap<(String, String), Value>,
    quota_policies: BTreeMap<(String, String), Value>,
    resource_claims: BTreeMap<(String, String), Value>,
    resource_slices: BTreeMap<String, Value>,
    log: Vec<WatchEvent>,
    calls: Vec<Call>,
    events: Vec<Value>,
    /// Status codes to answer the next binding POSTs with, instead of binding.
    binding_failures: Vec<u16>,
    /// Status codes to answer the next pod PATCHes with, instead of patching.
    patch_failures: Vec<u16>,
    /// Delay before answering a binding POST.
    binding_delay: Duration,
    /// Binding POSTs to answer 201 without binding (a write the watch never shows).
    lost_bindings: usize,
}

/// Handle to a running fake API server.
#[derive(Debug, Clone)]
pub struct FakeApi {
    inner: Arc<Mutex<Inner>>,
    changed: broadcast::Sender<()>,
    /// Where it listens.
    pub addr: SocketAddr,
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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
            addr,
        };
        let app = Router::new()
            .route("/api/v1/nodes", get(list_or_watch_nodes))
            .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
            .route("/api/v1/pods", get(list_or_watch_pods))
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}",
                get(get_pod).patch(patch_pod),
            )
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}/binding",
                post(create_binding),
            )
            .route("/api/v1/namespaces/{ns}/events", post(create_event))
            .route(QUOTA_POLICIES, get(list_or_watch_quota_policies))
            .route(
                "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}",
                get(get_resource_claim),
            )
            .route(
                "/apis/resource.k8s.io/v1/resourceslices/{name}",
                axum::routing::patch(apply_resource_slice),
            )
            .route(
                "/apis/vgpu.io/v1alpha1/namespaces/{ns}/vgpuquotapolicies/{name}/status",
                axum::routing::patch(patch_quota_policy_status),
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

    fn record(&self, method: &str, path: String, body: Value) {
        lock(&self.inner).calls.push(Call {
            method: method.to_owned(),
            path,
            body,
        });
    }

    fn emit(&self, inner: &mut Inner, kind: Kind, kind_event: &'static str, object: Value) {
        inner.log.push(WatchEvent {
            rv: inner.rv,
            kind,
            kind_event,
            object,
        });
        let _ = self.changed.send(());
    }

    /// Adds or replaces a node, named by its `metadata.name` (a watch event follows);
    /// later merge patches apply to it.
    pub fn put_node(&self, mut node: Value) {
        let mut inner = lock(&self.inner);
        inner.rv += 1;
        let rv = inner.rv;
        node["apiVersion"] = json!("v1");
        node["kind"] = json!("Node");
        node["metadata"]["resourceVersion"] = json!(rv.to_string());
        let name = node["metadata"]["name"].as_str().unwrap_or("").to_owned();
        let event = if inner.nodes.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        inner.nodes.insert(name, node.clone());
        self.emit(&mut inner, Kind::Node, event, node);
    }

    /// Adds or replaces a `resource.k8s.io/v1` ResourceClaim, keyed by its namespace and
    /// name (served by `GET` only: no watch).
    pub fn put_resource_claim(&self, mut claim: Value) {
        let mut inner = lock(&self.inner);
        inner.rv += 1;
        claim["apiVersion"] = json!("resource.k8s.io/v1");
        claim["kind"] = json!("ResourceClaim");
        claim["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        let key = pod_key(&claim);
        inner.resource_claims.insert(key, claim);
    }

    /// Deletes a ResourceClaim. Returns whether it existed.
    pub fn delete_resource_claim(&self, namespace: &str, name: &str) -> bool {
        lock(&self.inner)
            .resource_claims
            .remove(&(namespace.to_owned(), name.to_owned()))
            .is_some()
    }

    /// The ResourceSlice last applied under `name`, if any.
    pub fn resource_slice(&self, name: &str) -> Option<Value> {
        lock(&self.inner).resource_slices.get(name).cloned()
    }

    /// The stored node (as put, with the merge patches applied since).
    pub fn node(&self, name: &str) -> Option<Value> {
        lock(&self.inner).nodes.get(name).cloned()
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
        let event = if inner.pods.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        inner.pods.insert(key, pod.clone());
        self.emit(&mut inner, Kind::Pod, event, pod);
    }

    /// Deletes a pod (a watch event follows). Returns whether it existed.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> bool {
        let mut inner = lock(&self.inner);
        let Some(mut pod) = inner.pods.remove(&(namespace.to_owned(), name.to_owned())) else {
            return false;
        };
        inner.rv += 1;
        pod["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        self.emit(&mut inner, Kind::Pod, "DELETED", pod);
        true
    }

    /// The current stored pod.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.inner)
            .pods
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// All stored pods.
    pub fn pods(&self) -> Vec<Value> {
        lock(&self.inner).pods.values().cloned().collect()
    }

    /// Sets a pod's phase (a watch event follows).
    pub fn set_pod_phase(&self, namespace: &str, name: &str, phase: &str) {
        let mut pod = self.pod(namespace, name).expect("pod exists");
        pod["status"]["phase"] = json!(phase);
        self.put_pod(pod);
    }

    /// Adds or replaces a `VgpuQuotaPolicy` (a watch event follows); its
    /// `metadata.generation` goes up by one when its spec changes, as the API server's.
    pub fn put_quota_policy(&self, mut policy: Value) {
        let mut inner = lock(&self.inner);
        inner.rv += 1;
        let rv = inner.rv;
        policy["apiVersion"] = json!("vgpu.io/v1alpha1");
        policy["kind"] = json!("VgpuQuotaPolicy");
        policy["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = pod_key(&policy);
        let old = inner.quota_policies.get(&key);
        let generation = match old {
            Some(o) if o["spec"] == policy["spec"] => {
                o["metadata"]["generation"].as_i64().unwrap_or(1)
            }
            Some(o) => o["metadata"]["generation"].as_i64().unwrap_or(1) + 1,
            None => 1,
        };
        if let Some(o) = old
            && policy.get("status").is_none()
        {
            policy["status"] = o["status"].clone();
        }
        policy["metadata"]["generation"] = json!(generation);
        let event = if old.is_some() { "MODIFIED" } else { "ADDED" };
        inner.quota_policies.insert(key, policy.clone());
        self.emit(&mut inner, Kind::QuotaPolicy, event, policy);
    }

    /// The stored `VgpuQuotaPolicy` (with the status written to it).
    pub fn quota_policy(&self, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.inner)
            .quota_policies
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The events created so far.
    pub fn events(&self) -> Vec<Value> {
        lock(&self.inner).events.clone()
    }

    /// How many single-pod GETs were served.
    pub fn gets(&self) -> u64 {
        let n = lock(&self.inner)
            .calls
            .iter()
            .filter(|c| c.method == "GET" && c.path.contains("/namespaces/"))
            .count();
        n as u64
    }

    /// Every request so far.
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.inner).calls.clone()
    }

    /// Requests so far with this method whose path ends with `suffix`.
    pub fn calls_matching(&self, method: &str, suffix: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.method == method && c.path.ends_with(suffix))
            .collect()
    }

    /// Answers the next binding POSTs with these status codes.
    pub fn fail_next_bindings(&self, codes: &[u16]) {
        lock(&self.inner).binding_failures.extend_from_slice(codes);
    }

    /// Answers the next pod PATCHes with these status codes.
    pub fn fail_next_patches(&self, codes: &[u16]) {
        lock(&self.inner).patch_failures.extend_from_slice(codes);
    }

    /// Answers the next `n` binding POSTs 201 Created without binding the pod.
    pub fn lose_next_bindings(&self, n: usize) {
        lock(&self.inner).lost_bindings += n;
    }

    /// Delays every binding POST by this much.
    pub fn set_binding_delay(&self, delay: Duration) {
        lock(&self.inner).binding_delay = delay;
    }

    /// Waits until `pred` holds over the recorded calls, or panics after `deadline`.
    pub async fn wait_for_calls(
        &self,
        what: &str,
        deadline: Duration,
        pred: impl Fn(&[Call]) -> bool,
    ) {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            if pred(&lock(&self.inner).calls) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "fake API server: timed out after {deadline:?} waiting for {what}; calls: {:#?}",
                self.calls()
                    .iter()
                    .map(|c| format!("{} {}", c.method, c.path))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn list(&self, kind: Kind) -> Value {
        let inner = lock(&self.inner);
        let (items, list_kind): (Vec<Value>, &str) = match kind {
            Kind::Node => (inner.nodes.values().cloned().collect(), "NodeList"),
            Kind::Pod => (inner.pods.values().cloned().collect(), "PodList"),
            Kind::QuotaPolicy => (
                inner.quota_policies.values().cloned().collect(),
                "VgpuQuotaPolicyList",
            ),
        };
        json!({
            "apiVersion": if kind == Kind::QuotaPolicy { "vgpu.io/v1alpha1" } else { "v1" },
            "kind": list_kind,
            "metadata": {"resourceVersion": inner.rv.to_string()},
            "items": items,
        })
    }

    fn watch(&self, kind: Kind, from_rv: u64, timeout: Duration) -> Response {
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
                    .filter(|e| e.kind == kind && e.rv > sent)
                    .map(|e| {
                        let line = json!({"type": e.kind_event, "object": e.object});
                        (e.rv, format!("{line}\n"))
                    })
                    .collect();
                for (rv, line) in lines {
                    sent = rv;
                    if tx.send(Ok(Bytes::from(line))).await.is_err() {
                        return;
                    }
                }
                match tokio::time::timeout_at(deadline, changes.recv()).await {
                    Err(_) | Ok(Err(broadcast::error::RecvError::Closed)) => return,
                    Ok(Ok(())) | Ok(Err(broadcast::error::RecvError::Lagged(_))) => {}
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

fn not_found(what: &str, name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{what} \"{name}\" not found"),
    )
}

fn scripted(code: u16) -> Response {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    status(code, "Scripted", format!("scripted failure {code}"))
}

fn created() -> Response {
    (
        StatusCode::CREATED,
        axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})),
    )
        .into_response()
}

async fn list_or_watch(
    fake: FakeApi,
    kind: Kind,
    path: &str,
    q: BTreeMap<String, String>,
) -> Response {
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    fake.record(
        "GET",
        format!("{path}{}", if watching { "?watch" } else { "" }),
        Value::Null,
    );
    if watching {
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let secs: u64 = q
            .get("timeoutSeconds")
            .and_then(|v| v.parse().ok())
            .unwrap_or(300);
        fake.watch(kind, from, Duration::from_secs(secs))
    } else {
        axum::Json(fake.list(kind)).into_response()
    }
}

async fn list_or_watch_nodes(
    State(fake): State<FakeApi>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    list_or_watch(fake, Kind::Node, "/api/v1/nodes", q).await
}

async fn list_or_watch_pods(
    State(fake): State<FakeApi>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    list_or_watch(fake, Kind::Pod, "/api/v1/pods", q).await
}

async fn list_or_watch_quota_policies(
    State(fake): State<FakeApi>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    list_or_watch(fake, Kind::QuotaPolicy, QUOTA_POLICIES, q).await
}

/// `PATCH …/vgpuquotapolicies/{name}/status`: only `status` of the patch applies.
async fn patch_quota_policy_status(
    State(fake): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/apis/vgpu.io/v1alpha1/namespaces/{ns}/vgpuquotapolicies/{name}/status");
    let patch = match recorded_merge_patch(&fake, path, &headers, &body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let mut inner = lock(&fake.inner);
    let key = (ns, name.clone());
    let Some(mut policy) = inner.quota_policies.get(&key).cloned() else {
        return not_found("vgpuquotapolicies.vgpu.io", &name);
    };
    if let Some(st) = patch.get("status") {
        if !policy["status"].is_object() {
            policy["status"] = json!({});
        }
        merge(&mut policy["status"], st);
    }
    inner.rv += 1;
    policy["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
    inner.quota_policies.insert(key, policy.clone());
    fake.emit(&mut inner, Kind::QuotaPolicy, "MODIFIED", policy.clone());
    axum::Json(policy).into_response()
}

async fn get_pod(
    State(fake): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    fake.record(
        "GET",
        format!("/api/v1/namespaces/{ns}/pods/{name}"),
        Value::Null,
    );
    match fake.pod(&ns, &name) {
        Some(pod) => axum::Json(pod).into_response(),
        None => not_found("pods", &name),
    }
}

async fn get_resource_claim(
    State(fake): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let path = format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}");
    fake.record("GET", path, Value::Null);
    let claim = lock(&fake.inner)
        .resource_claims
        .get(&(ns, name.clone()))
        .cloned();
    match claim {
        Some(c) => axum::Json(c).into_response(),
        None => not_found("resourceclaims.resource.k8s.io", &name),
    }
}

/// Server-side apply of a ResourceSlice (`application/apply-patch+yaml` with a JSON
/// body, `fieldManager` given): the applied object replaces the stored one (one field
/// manager in these tests, so no field ownership is modelled).
async fn apply_resource_slice(
    State(fake): State<FakeApi>,
    Path(name): Path<String>,
    Query(query): Query<BTreeMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/apis/resource.k8s.io/v1/resourceslices/{name}");
    let parsed: Result<Value, _> = serde_json::from_slice(&body);
    fake.record(
        "PATCH",
        path,
        parsed.as_ref().cloned().unwrap_or(Value::Null),
    );
    let apply = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/apply-patch"));
    if !apply || !query.contains_key("fieldManager") {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            "only server-side apply with a fieldManager is served for resourceslices".to_owned(),
        );
    }
    let Ok(mut slice) = parsed else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "the apply body is not JSON".to_owned(),
        );
    };
    if slice["metadata"]["name"] != json!(name) {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!("the body's metadata.name is not {name:?}"),
        );
    }
    let mut inner = lock(&fake.inner);
    inner.rv += 1;
    slice["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
    inner.resource_slices.insert(name, slice.clone());
    axum::Json(slice).into_response()
}

async fn get_node(State(fake): State<FakeApi>, Path(name): Path<String>) -> Response {
    fake.record("GET", format!("/api/v1/nodes/{name}"), Value::Null);
    match fake.node(&name) {
        Some(node) => axum::Json(node).into_response(),
        None => not_found("nodes", &name),
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

/// A `PATCH` of `path`: recorded (its body as JSON, or null), then read as a merge patch.
fn recorded_merge_patch(
    fake: &FakeApi,
    path: String,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Value, Box<Response>> {
    let value = serde_json::from_slice(body).unwrap_or(Value::Null);
    fake.record("PATCH", path, value);
    merge_patch(headers, body)
}

/// A merge patch body, or the answer that refuses it.
fn merge_patch(headers: &HeaderMap, body: &Bytes) -> Result<Value, Box<Response>> {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if content_type != "application/merge-patch+json" {
        return Err(Box::new(status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the fake supports merge patches only, got {content_type}"),
        )));
    }
    serde_json::from_slice(body).map_err(|_| {
        Box::new(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "not JSON".into(),
        ))
    })
}

async fn patch_node(
    State(fake): State<FakeApi>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/api/v1/nodes/{name}");
    let patch = match recorded_merge_patch(&fake, path, &headers, &body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let mut inner = lock(&fake.inner);
    inner.rv += 1;
    let rv = inner.rv;
    let node = inner
        .nodes
        .entry(name.clone())
        .or_insert_with(|| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}));
    if !node.is_object() {
        *node = json!({});
    }
    merge(node, &patch);
    node["metadata"]["resourceVersion"] = json!(rv.to_string());
    let node = node.clone();
    fake.emit(&mut inner, Kind::Node, "MODIFIED", node.clone());
    axum::Json(node).into_response()
}

async fn patch_pod(
    State(fake): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/api/v1/namespaces/{ns}/pods/{name}");
    let patch = match recorded_merge_patch(&fake, path, &headers, &body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let mut inner = lock(&fake.inner);
    if !inner.patch_failures.is_empty() {
        return scripted(inner.patch_failures.remove(0));
    }
    let key = (ns, name.clone());
    let Some(mut pod) = inner.pods.get(&key).cloned() else {
        return not_found("pods", &name);
    };
    if let Some(uid) = patch["metadata"]["uid"].as_str()
        && pod["metadata"]["uid"].as_str() != Some(uid)
    {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!("Precondition failed: UID in precondition: {uid}"),
        );
    }
    if let Some(rv) = patch["metadata"]["resourceVersion"].as_str()
        && pod["metadata"]["resourceVersion"].as_str() != Some(rv)
    {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            "the object has been modified; please apply your changes to the latest version".into(),
        );
    }
    merge(&mut pod, &patch);
    inner.rv += 1;
    pod["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
    inner.pods.insert(key, pod.clone());
    fake.emit(&mut inner, Kind::Pod, "MODIFIED", pod.clone());
    axum::Json(pod).into_response()
}

async fn create_binding(
    State(fake): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let binding: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    fake.record(
        "POST",
        format!("/api/v1/namespaces/{ns}/pods/{name}/binding"),
        binding.clone(),
    );
    let delay = lock(&fake.inner).binding_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut inner = lock(&fake.inner);
    if !inner.binding_failures.is_empty() {
        return scripted(inner.binding_failures.remove(0));
    }
    if inner.lost_bindings > 0 {
        inner.lost_bindings -= 1;
        return created();
    }
    let key = (ns, name.clone());
    let Some(mut pod) = inner.pods.get(&key).cloned() else {
        return not_found("pods", &name);
    };
    if let Some(uid) = binding["metadata"]["uid"].as_str()
        && pod["metadata"]["uid"].as_str() != Some(uid)
    {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!("pod uid mismatch: {uid}"),
        );
    }
    if let Some(node) = pod["spec"]["nodeName"].as_str() {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!("pod {name} is already assigned to node \"{node}\""),
        );
    }
    let Some(target) = binding["target"]["name"].as_str() else {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "binding has no target".into(),
        );
    };
    pod["spec"]["nodeName"] = json!(target);
    inner.rv += 1;
    pod["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
    inner.pods.insert(key, pod.clone());
    fake.emit(&mut inner, Kind::Pod, "MODIFIED", pod);
    created()
}

async fn create_event(
    State(fake): State<FakeApi>,
    Path(ns): Path<String>,
    body: Bytes,
) -> Response {
    let value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    fake.record("POST", format!("/api/v1/namespaces/{ns}/events"), value);
    let Ok(mut ev) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON".into());
    };
    // A cluster-scoped object's events (a node's) go to `default`, as the API server
    // allows.
    let involved_ns = ev["involvedObject"]["namespace"].as_str().unwrap_or("");
    if involved_ns != ns && !(involved_ns.is_empty() && ns == "default") {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("involvedObject.namespace does not match the namespace {ns:?}"),
        );
    }
    let mut inner = lock(&fake.inner);
    // A named event that exists already: 409, as the API server answers.
    if let Some(name) = ev["metadata"]["name"].as_str()
        && inner
            .events
            .iter()
            .any(|e| e["metadata"]["name"] == name && e["metadata"]["namespace"] == ns.as_str())
    {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("events {name:?} already exists"),
        );
    }
    inner.rv += 1;
    let n = inner.events.len();
    if let Some(g) = ev["metadata"]["generateName"].as_str() {
        ev["metadata"]["name"] = json!(format!("{g}{n}"));
    }
    ev["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
    inner.events.push(ev.clone());
    (StatusCode::CREATED, axum::Json(ev)).into_response()
}
