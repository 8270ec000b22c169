//! The HTTP side: kube-scheduler POSTs JSON to `urlPrefix/<verb>`.
//!
//! Each verb has a byte-level handler ([`Extender::filter`],
//! [`Extender::prioritize`], [`Extender::bind`]) that takes the request body and
//! returns the status and body to send; the axum router only moves bytes. This
//! keeps the protocol testable and measurable without sockets.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State as AxumState};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tracing::{debug, info, warn};

use super::binder::{Binder, outcome_uncertain};
use super::cluster::{Candidates, State};
use super::error::{ExtenderError, Verb, error_response};
use super::limits::{BodyBudget, HeldBody, HttpLimits, describe_json_error};
use super::types::{
    ExtenderArgs, ExtenderArgsRef, ExtenderBindingArgs, ExtenderBindingResult,
    ExtenderFilterAnswer, ExtenderPreemptionArgs, ExtenderPreemptionResult, NodeListRef,
    ReasonsRef,
};

/// The extender: decisions over [`State`], writes through a [`Binder`].
#[derive(Debug, Clone)]
pub struct Extender {
    state: Arc<State>,
    binder: Arc<dyn Binder>,
}

/// A status and a JSON (or, for some errors, plain text) body.
pub type Answer = (StatusCode, Vec<u8>);

fn json_answer<T: serde::Serialize>(verb: Verb, value: &T) -> Answer {
    match serde_json::to_vec(value) {
        Ok(body) => (StatusCode::OK, body),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("serialise {verb} answer: {e}").into_bytes(),
        ),
    }
}

/// Parses filter/prioritize arguments, borrowing the node names from the body;
/// falls back to an owned parse (returned second) when that is not possible.
fn parse_args(
    verb: Verb,
    body: &[u8],
) -> Result<(ExtenderArgsRef<'_>, Option<ExtenderArgs>), ExtenderError> {
    match serde_json::from_slice::<ExtenderArgsRef<'_>>(body) {
        Ok(args) => Ok((args, None)),
        Err(_) => {
            let owned: ExtenderArgs = parse(verb, body)?;
            Ok((ExtenderArgsRef::default(), Some(owned)))
        }
    }
}

/// The candidates of a request parsed by [`parse_args`].
fn candidates_of<'a>(
    args: &'a ExtenderArgsRef<'a>,
    owned: Option<&'a ExtenderArgs>,
) -> Candidates<'a> {
    if let Some(owned) = owned {
        return Candidates::from_args(owned);
    }
    let names = match (&args.node_names, &args.nodes) {
        (Some(names), _) => names.clone(),
        (None, Some(list)) => list
            .items
            .iter()
            .map(|n| n.metadata.name.as_deref().unwrap_or(""))
            .collect(),
        (None, None) => Vec::new(),
    };
    Candidates { names }
}

fn parse<T: serde::de::DeserializeOwned>(verb: Verb, body: &[u8]) -> Result<T, ExtenderError> {
    serde_json::from_slice(body).map_err(|e| ExtenderError::BadRequest {
        verb,
        reason: describe_json_error(&e),
    })
}

impl Extender {
    /// An extender over `state` that binds through `binder`.
    pub fn new(state: Arc<State>, binder: Arc<dyn Binder>) -> Self {
        Self { state, binder }
    }

    /// The state it decides on.
    #[must_use]
    pub fn state(&self) -> &Arc<State> {
        &self.state
    }

    /// Answers a filter request body.
    #[must_use]
    pub fn filter(&self, body: &[u8]) -> Answer {
        match self.try_filter(body) {
            Ok(bytes) => (StatusCode::OK, bytes),
            Err(e) => {
                warn!(error = %super::error::error_chain(&e), "filter failed");
                error_response(Verb::Filter, &e)
            }
        }
    }

    fn try_filter(&self, body: &[u8]) -> Result<Vec<u8>, ExtenderError> {
        let (args, owned) = parse_args(Verb::Filter, body)?;
        let pod = args
            .pod
            .as_ref()
            .or(owned.as_ref().and_then(|o| o.pod.as_ref()))
            .ok_or(ExtenderError::MissingPod { verb: Verb::Filter })?;
        let candidates = candidates_of(&args, owned.as_ref());
        let outcome = self.state.filter(pod, &candidates)?;
        debug!(
            feasible = outcome.feasible.len(),
            failed = outcome.failed.len() + outcome.unresolvable.len(),
            "filter"
        );
        // Answer in the form of the request: names for names, objects for objects.
        let asked_names =
            args.node_names.is_some() || owned.as_ref().is_some_and(|o| o.node_names.is_some());
        let list = args
            .nodes
            .as_ref()
            .or(owned.as_ref().and_then(|o| o.nodes.as_ref()));
        let (nodes, node_names) = match list {
            Some(list) if !asked_names => {
                let items = outcome.feasible.iter().map(|&i| &list.items[i]).collect();
                (
                    Some(NodeListRef {
                        metadata: &list.metadata,
                        items,
                    }),
                    None,
                )
            }
            _ => (
                None,
                Some(
                    outcome
                        .feasible
                        .iter()
                        .map(|&i| candidates.names[i])
                        .collect(),
                ),
            ),
        };
        let answer = ExtenderFilterAnswer {
            nodes,
            node_names,
            failed_nodes: ReasonsRef {
                names: &candidates.names,
                reasons: &outcome.failed,
            },
            failed_and_unresolvable_nodes: ReasonsRef {
                names: &candidates.names,
                reasons: &outcome.unresolvable,
            },
            error: String::new(),
        };
        serde_json::to_vec(&answer).map_err(|e| ExtenderError::BadRequest {
            verb: Verb::Filter,
            reason: format!("serialise the answer: {e}"),
        })
    }

    /// Answers a prioritize request body.
    #[must_use]
    pub fn prioritize(&self, body: &[u8]) -> Answer {
        let result = parse_args(Verb::Prioritize, body).and_then(|(args, owned)| {
            let pod = args
                .pod
                .as_ref()
                .or(owned.as_ref().and_then(|o| o.pod.as_ref()))
                .ok_or(ExtenderError::MissingPod {
                    verb: Verb::Prioritize,
                })?;
            let candidates = candidates_of(&args, owned.as_ref());
            let list = self.state.prioritize(pod, &candidates)?;
            Ok(json_answer(Verb::Prioritize, &list))
        });
        match result {
            Ok(answer) => answer,
            Err(e) => {
                warn!(error = %super::error::error_chain(&e), "prioritize failed");
                error_response(Verb::Prioritize, &e)
            }
        }
    }

    /// Answers a bind request body: decide the GPUs against the live ledger
    /// (atomically, as an assumption), write the assignment and the Binding,
    /// then confirm or release the assumption.
    pub async fn bind(&self, body: &[u8]) -> Answer {
        match self.try_bind(body).await {
            Ok(()) => json_answer(Verb::Bind, &ExtenderBindingResult::default()),
            Err(e) => {
                warn!(error = %super::error::error_chain(&e), "bind failed");
                error_response(Verb::Bind, &e)
            }
        }
    }

    async fn try_bind(&self, body: &[u8]) -> Result<(), ExtenderError> {
        let args: ExtenderBindingArgs = parse(Verb::Bind, body)?;
        let plan = self.state.begin_bind(&args)?;
        if plan.already_bound {
            debug!(pod = %plan.pod_key(), node = %plan.node, "already bound with its record");
            return Ok(());
        }
        match self.binder.bind(&plan).await {
            Ok(()) => {
                self.state.finish_bind(&plan.uid);
                info!(pod = %plan.pod_key(), node = %plan.node, assignment = %plan.assignment_json, "bound");
                Ok(())
            }
            Err(e) => {
                let uncertain = outcome_uncertain(&e);
                self.state.abort_bind(&plan.uid, uncertain);
                Err(e)
            }
        }
    }

    /// Answers a preempt request body: of the nodes and victims kube-scheduler
    /// proposes, keeps the nodes where evicting the victims frees enough GPU.
    #[must_use]
    pub fn preempt(&self, body: &[u8]) -> Answer {
        let result = parse::<ExtenderPreemptionArgs>(Verb::Preempt, body).and_then(|args| {
            let pod = args.pod.as_ref().ok_or(ExtenderError::MissingPod {
                verb: Verb::Preempt,
            })?;
            let map = self.state.preempt(pod, &args)?;
            Ok(ExtenderPreemptionResult {
                node_name_to_meta_victims: map,
            })
        });
        match result {
            Ok(r) => json_answer(Verb::Preempt, &r),
            Err(e) => {
                warn!(error = %super::error::error_chain(&e), "preempt failed");
                error_response(Verb::Preempt, &e)
            }
        }
    }
}

fn to_response((status, body): Answer) -> Response {
    let content_type = if status == StatusCode::OK || body.first() == Some(&b'{') {
        "application/json"
    } else {
        "text/plain; charset=utf-8"
    };
    (status, [(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// The router's state: the extender and the budget its request bodies share.
#[derive(Debug, Clone)]
struct Http {
    ext: Extender,
    budget: BodyBudget,
}

/// Reads a verb's body within the limits, or the answer that refuses it.
async fn read_body(http: &Http, verb: Verb, req: Request) -> Result<HeldBody, Response> {
    let (parts, body) = req.into_parts();
    http.budget
        .read(&parts.headers, body)
        .await
        .map_err(|source| {
            let e = ExtenderError::Body { verb, source };
            warn!(error = %super::error::error_chain(&e), "request refused");
            to_response(error_response(verb, &e))
        })
}

async fn filter_route(AxumState(http): AxumState<Http>, req: Request) -> Response {
    let body = match read_body(&http, Verb::Filter, req).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let ext = http.ext;
    // Decisions are CPU work under a lock; keep them off the I/O threads' fast path.
    // The body (and its share of the budget) lives until the answer is built.
    let answer = tokio::task::spawn_blocking(move || ext.filter(&body.bytes))
        .await
        .unwrap_or_else(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("filter task: {e}").into_bytes(),
            )
        });
    to_response(answer)
}

async fn prioritize_route(AxumState(http): AxumState<Http>, req: Request) -> Response {
    let body = match read_body(&http, Verb::Prioritize, req).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let ext = http.ext;
    let answer = tokio::task::spawn_blocking(move || ext.prioritize(&body.bytes))
        .await
        .unwrap_or_else(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("prioritize task: {e}").into_bytes(),
            )
        });
    to_response(answer)
}

async fn bind_route(AxumState(http): AxumState<Http>, req: Request) -> Response {
    match read_body(&http, Verb::Bind, req).await {
        Ok(body) => to_response(http.ext.bind(&body.bytes).await),
        Err(refused) => refused,
    }
}

async fn preempt_route(AxumState(http): AxumState<Http>, req: Request) -> Response {
    match read_body(&http, Verb::Preempt, req).await {
        Ok(body) => to_response(http.ext.preempt(&body.bytes)),
        Err(refused) => refused,
    }
}

/// `GET /metrics`: namespaces' use and quota policies' totals (`quota::metrics`).
async fn metrics(AxumState(http): AxumState<Http>) -> Response {
    let text = super::quota::metrics::render(&http.ext.state);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(AxumState(http): AxumState<Http>) -> Response {
    if http.ext.state.is_synced() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not synced").into_response()
    }
}

/// The router with the default [`HttpLimits`] (see [`router_with`]).
pub fn router(extender: Extender, url_prefix: &str) -> Router {
    router_with(extender, url_prefix, HttpLimits::default())
}

/// The router: `POST {url_prefix}/{filter,prioritize,bind,preempt}`, plus
/// `GET /healthz` (alive), `GET /readyz` (state synced) and `GET /metrics`.
///
/// Request bodies are read within `limits` (size, deadline, shared memory budget):
/// with `nodeCacheCapable: false` kube-scheduler sends every candidate Node in full
/// (several KiB each), so the default size limit is far above axum's 2 MiB.
pub fn router_with(extender: Extender, url_prefix: &str, limits: HttpLimits) -> Router {
    let prefix = url_prefix.trim_end_matches('/');
    Router::new()
        .route(&format!("{prefix}/filter"), post(filter_route))
        .route(&format!("{prefix}/prioritize"), post(prioritize_route))
        .route(&format!("{prefix}/bind"), post(bind_route))
        .route(&format!("{prefix}/preempt"), post(preempt_route))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::disable())
        .with_state(Http {
            ext: extender,
            budget: BodyBudget::new(limits),
        })
}

/// Serves `router` on `listener` in plain HTTP until `shutdown` resolves: HTTP/1.1,
/// keep-alive, each request's headers due within `header_timeout` (a client that stalls
/// mid-request is disconnected); open connections are drained on shutdown.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    router: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_tls_on(listener, router, header_timeout, None, shutdown).await
}

/// [`serve_on`] with TLS when `tls` is given: the handshake is due within
/// `header_timeout`; a client without a verified certificate reaches only
/// [`super::tls::ANONYMOUS_PATHS`] when the configuration verifies clients (403 otherwise).
pub async fn serve_tls_on(
    listener: tokio::net::TcpListener,
    router: Router,
    header_timeout: Duration,
    tls: Option<super::tls::ServerTls>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    info!(?addr, tls = tls.is_some(), "extender listening");
    let verifying = tls.as_ref().is_some_and(|t| t.verifies_clients);
    let acceptor = tls.map(|t| tokio_rustls::TlsAcceptor::from(t.config));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: keep serving.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let watcher = graceful.watcher();
        let router = router.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let Some(acceptor) = acceptor else {
                serve_connection(stream, router, header_timeout, true, watcher, peer).await;
                return;
            };
            let tls = match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    debug!(%peer, "TLS handshake not done within the header deadline");
                    return;
                }
            };
            // With a client verifier, a certificate here has been verified; without
            // one (no --client-ca-file), every client may call the verbs.
            let authenticated = !verifying || tls.get_ref().1.peer_certificates().is_some();
            serve_connection(tls, router, header_timeout, authenticated, watcher, peer).await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Serves one connection; an unauthenticated one reaches only the anonymous paths.
async fn serve_connection<I>(
    io: I,
    router: Router,
    header_timeout: Duration,
    authenticated: bool,
    watcher: hyper_util::server::graceful::Watcher,
    peer: SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let mut router = router.clone();
        async move {
            if !authenticated && !super::tls::anonymous_allowed(req.method(), req.uri().path()) {
                debug!(%peer, path = req.uri().path(), "refused: no verified client certificate");
                return Ok::<_, std::convert::Infallible>(
                    (
                        StatusCode::FORBIDDEN,
                        "a client certificate signed by --client-ca-file is required\n",
                    )
                        .into_response(),
                );
            }
            tower::Service::call(&mut router, req).await
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true)
        .serve_connection(hyper_util::rt::TokioIo::new(io), service);
    if let Err(e) = watcher.watch(conn).await {
        debug!(%peer, error = %e, "connection closed");
    }
}
