//! `vgpu-scheduler-extender serve`: configuration and the entry point.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use vgpu_core::packing::{ContextReserve, PolicyName};

use super::binder::KubeBinder;
use super::cluster::{State, StateConfig};
use super::http::{Extender, router_with, serve_tls_on};
use super::limits::{HttpLimits, LimitsError};
use super::policy::ExtenderPolicy;
use super::sync::{self, SyncConfig};
use super::tls::{ServerTls, TlsError, TlsFiles};

/// Why `serve` could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// No Kubernetes client configuration (in-cluster or kubeconfig) was found.
    #[error("load kubernetes client configuration (in-cluster service account or KUBECONFIG)")]
    KubeConfig(#[source] kube::config::InferConfigError),
    /// The client could not be built from the configuration.
    #[error("build kubernetes client")]
    KubeClient(#[source] kube::Error),
    /// The listen address could not be bound.
    #[error("listen on {addr}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP limits are inconsistent.
    #[error("HTTP limits")]
    Limits(#[from] LimitsError),
    /// The TLS flags are incomplete, or their files unusable.
    #[error("TLS")]
    Tls(#[from] TlsError),
    /// A TLS flag was given without the others it needs.
    #[error("{0}")]
    TlsFlags(&'static str),
    /// The HTTP server failed.
    #[error("serve HTTP on {addr}")]
    Serve {
        /// The address.
        addr: SocketAddr,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
}

/// A bad duration in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {0:?} (use a whole number with ms, s, m or h, e.g. 300s)")]
pub struct BadDuration(pub String);

/// Parses `250ms`, `30s`, `5m`, `1h`.
pub fn parse_duration(text: &str) -> Result<Duration, BadDuration> {
    let t = text.trim();
    let bad = || BadDuration(text.to_string());
    let split = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.checked_mul(60).ok_or_else(bad)?),
        "h" => Duration::from_secs(n.checked_mul(3600).ok_or_else(bad)?),
        _ => return Err(bad()),
    };
    Ok(d)
}

/// Configuration of `serve` (every knob is documented in `docs/scheduler-extender.md`).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on for kube-scheduler's requests.
    #[arg(long, default_value = "0.0.0.0:8888")]
    pub listen: SocketAddr,
    /// Path prefix of the verbs (the `urlPrefix` path in the scheduler configuration).
    #[arg(long, default_value = "/scheduler")]
    pub url_prefix: String,
    /// Placement policy: vgpu (default), fgd, bestfit, gpupacking, spread, random.
    #[arg(long, default_value = "vgpu")]
    pub policy: PolicyName,
    /// How long a bound pod's assumption is kept waiting for the watch to show it.
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    pub assume_ttl: Duration,
    /// How long a pod's request seen by filter is remembered for its bind.
    #[arg(long, default_value = "600s", value_parser = parse_duration)]
    pub pending_ttl: Duration,
    /// Page size of the initial lists of nodes and pods.
    #[arg(long, default_value_t = 500)]
    pub page_size: u32,
    /// GPU memory reserved per CUDA context, MiB, one per slice (10 per GPU): quotas
    /// are packed into the rest of each GPU (ADR 0012). 0 reserves nothing.
    #[arg(long, default_value_t = ContextReserve::default(), value_parser = parse_context_mib)]
    pub context_reserve_mib: ContextReserve,
    /// Largest request body accepted, MiB (answered 413 above it).
    #[arg(long, default_value_t = 64)]
    pub max_body_mib: u64,
    /// MiB of request bodies held at once over all requests; a request waits for
    /// room until its body deadline (then 503).
    #[arg(long, default_value_t = 256)]
    pub body_memory_mib: u64,
    /// Deadline to receive a request's headers (the connection is closed after it).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub header_timeout: Duration,
    /// Deadline to receive a request's body after its headers (then 408).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub body_timeout: Duration,
    /// Serve TLS with this certificate chain (PEM); with `--tls-key-file`. Without it the
    /// port is plain HTTP and anyone who reaches it may call the verbs.
    #[arg(long)]
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// The private key (PEM) of `--tls-cert-file`.
    #[arg(long)]
    pub tls_key_file: Option<std::path::PathBuf>,
    /// CA bundle (PEM): only a client whose certificate chains to it (kube-scheduler's
    /// `tlsConfig.certFile`) may call the verbs; others get 403, and may only GET
    /// /healthz, /readyz and /metrics. Needs `--tls-cert-file`.
    #[arg(long)]
    pub client_ca_file: Option<std::path::PathBuf>,
}

/// Parses `--context-reserve-mib`, refusing a value no context takes.
pub fn parse_context_mib(text: &str) -> Result<ContextReserve, String> {
    let mib: u64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a whole number of MiB"))?;
    ContextReserve::new(mib).map_err(|e| e.to_string())
}

impl ServeArgs {
    /// The HTTP limits these arguments give, checked.
    pub fn http_limits(&self) -> Result<HttpLimits, LimitsError> {
        let bytes = |mib: u64| usize::try_from(mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
        let limits = HttpLimits {
            max_body_bytes: bytes(self.max_body_mib),
            body_memory_bytes: bytes(self.body_memory_mib),
            header_timeout: self.header_timeout,
            body_timeout: self.body_timeout,
        };
        limits.check()?;
        Ok(limits)
    }

    /// The TLS these arguments ask for (`None`: plain HTTP), its files read and checked.
    pub fn tls(&self) -> Result<Option<ServerTls>, ServeError> {
        let files = match (
            &self.tls_cert_file,
            &self.tls_key_file,
            &self.client_ca_file,
        ) {
            (None, None, None) => return Ok(None),
            (Some(cert), Some(key), ca) => TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: ca.clone(),
            },
            (Some(_), None, _) => {
                return Err(ServeError::TlsFlags("--tls-cert-file needs --tls-key-file"));
            }
            (None, Some(_), _) => {
                return Err(ServeError::TlsFlags("--tls-key-file needs --tls-cert-file"));
            }
            (None, None, Some(_)) => {
                return Err(ServeError::TlsFlags(
                    "--client-ca-file needs --tls-cert-file and --tls-key-file",
                ));
            }
        };
        Ok(Some(super::tls::server_config(&files)?))
    }

    /// The state configuration these arguments give.
    #[must_use]
    pub fn state_config(&self) -> StateConfig {
        StateConfig {
            assume_ttl: self.assume_ttl,
            pending_ttl: self.pending_ttl,
            contexts: self.context_reserve_mib,
        }
    }
}

/// Starts the watches and the HTTP server with this client; runs until
/// `shutdown` resolves. Returns the state (for tests).
pub async fn run_with_client(
    client: kube::Client,
    args: ServeArgs,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let addr = listener.local_addr().unwrap_or(args.listen);
    let limits = args.http_limits()?;
    let tls = args.tls()?;
    match &tls {
        None => tracing::warn!(
            "serving plain HTTP: anyone who reaches this port may call filter and bind (give --tls-cert-file, --tls-key-file and --client-ca-file; docs/install.md)"
        ),
        Some(t) if !t.verifies_clients => tracing::warn!(
            "serving TLS without --client-ca-file: any client may call filter and bind"
        ),
        Some(_) => {}
    }
    let state = Arc::new(State::new(
        args.state_config(),
        ExtenderPolicy::new(args.policy),
    ));
    let sync_task = tokio::spawn(sync::run(
        client.clone(),
        state.clone(),
        SyncConfig {
            page_size: args.page_size,
            ..SyncConfig::default()
        },
    ));
    let quota_task = tokio::spawn(super::quota::watch::run(
        client.clone(),
        state.clone(),
        super::quota::watch::QuotaSyncConfig::default(),
    ));
    let extender = Extender::new(state, Arc::new(KubeBinder::new(client)));
    let result = serve_tls_on(
        listener,
        router_with(extender, &args.url_prefix, limits),
        limits.header_timeout,
        tls,
        shutdown,
    )
    .await
    .map_err(|source| ServeError::Serve { addr, source });
    sync_task.abort();
    quota_task.abort();
    result
}

/// `serve`: in-cluster (or KUBECONFIG) client, listen, run until SIGINT/SIGTERM.
pub async fn run(args: ServeArgs) -> Result<(), ServeError> {
    let config = kube::Config::infer()
        .await
        .map_err(ServeError::KubeConfig)?;
    let client = kube::Client::try_from(config).map_err(ServeError::KubeClient)?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| ServeError::Listen {
            addr: args.listen,
            source,
        })?;
    run_with_client(client, args, listener, shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_bad_ones_name_the_input() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        for bad in ["", "s", "5", "5 s", "-1s", "1d"] {
            let e = parse_duration(bad).expect_err(bad);
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn context_reservations_parse_and_bad_ones_name_the_input() {
        assert_eq!(parse_context_mib("0"), Ok(ContextReserve::NONE));
        assert_eq!(parse_context_mib("512").map(ContextReserve::mib), Ok(512));
        for bad in ["", "-1", "300Mi", "100000"] {
            let e = parse_context_mib(bad).expect_err(bad);
            assert!(e.contains(bad.trim_start_matches('-')), "{e}");
        }
    }
}
