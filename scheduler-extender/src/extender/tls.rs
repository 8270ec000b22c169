//! TLS for the extender's port and who may call its verbs (ADR 0053).
//!
//! The verbs write Bindings with the extender's RBAC, so only kube-scheduler may call
//! them: with `--client-ca-file` a client must present a certificate that chains to that
//! CA (kube-scheduler's `tlsConfig.certFile`/`keyFile`) or its verb requests are refused
//! with 403. A connection without a certificate is still accepted, for the kubelet's
//! probes and Prometheus: it may `GET` [`ANONYMOUS_PATHS`] and nothing else. A certificate
//! that does not chain to the CA fails the handshake.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Paths a client without a verified certificate may `GET`: probes and metrics.
pub const ANONYMOUS_PATHS: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

/// Whether a request may be served to a client that presented no verified certificate.
#[must_use]
pub fn anonymous_allowed(method: &axum::http::Method, path: &str) -> bool {
    (method == axum::http::Method::GET || method == axum::http::Method::HEAD)
        && ANONYMOUS_PATHS.contains(&path)
}

/// The files `serve` takes for TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain (PEM).
    pub cert: PathBuf,
    /// The server's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA bundle (PEM) that clients' certificates must chain to; `None`: no client is
    /// verified (every client may call the verbs).
    pub client_ca: Option<PathBuf>,
}

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("read {what} {path}")]
    Pem {
        /// Which file (`--tls-cert-file`, …).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A PEM file holds no certificate.
    #[error("{what} {path} holds no certificate")]
    NoCertificate {
        /// Which file.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// rustls refused the certificates or key (mismatched key, bad CA certificate).
    #[error("TLS configuration from {cert} and {key}")]
    Config {
        /// The server certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why.
        #[source]
        source: rustls::Error,
    },
    /// The client CA bundle cannot verify clients.
    #[error("--client-ca-file {path}")]
    ClientVerifier {
        /// The CA file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|source| TlsError::Pem {
            what,
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The server side of TLS, as [`super::http::serve_tls_on`] takes it.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// rustls' configuration.
    pub config: Arc<rustls::ServerConfig>,
    /// Whether clients are verified (`--client-ca-file`): then only a client with a
    /// verified certificate may call the verbs.
    pub verifies_clients: bool,
}

/// Builds the server configuration (TLS 1.2 and 1.3, ring; HTTP/1.1 by ALPN).
pub fn server_config(files: &TlsFiles) -> Result<ServerTls, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certs("--tls-cert-file", &files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|source| TlsError::Pem {
        what: "--tls-key-file",
        path: files.key.clone(),
        source,
    })?;
    let config_err = |source| TlsError::Config {
        cert: files.cert.clone(),
        key: files.key.clone(),
        source,
    };
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(config_err)?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs("--client-ca-file", ca)? {
                roots.add(c).map_err(config_err)?;
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    // Probes and metrics come without a certificate: the HTTP layer lets
                    // them reach ANONYMOUS_PATHS only.
                    .allow_unauthenticated()
                    .build()
                    .map_err(|source| TlsError::ClientVerifier {
                        path: ca.clone(),
                        source,
                    })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(config_err)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(ServerTls {
        config: Arc::new(config),
        verifies_clients: files.client_ca.is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_probes_and_metrics_are_anonymous() {
        use axum::http::Method;
        for p in ANONYMOUS_PATHS {
            assert!(anonymous_allowed(&Method::GET, p), "{p}");
            assert!(!anonymous_allowed(&Method::POST, p), "{p}");
        }
        for p in [
            "/scheduler/filter",
            "/scheduler/bind",
            "/scheduler/prioritize",
            "/scheduler/preempt",
            "/healthz/",
            "/metrics/../scheduler/bind",
            "/",
        ] {
            assert!(!anonymous_allowed(&Method::POST, p), "{p}");
            assert!(!anonymous_allowed(&Method::GET, p), "{p}");
        }
    }

    #[test]
    fn a_missing_file_is_named() {
        let files = TlsFiles {
            cert: "/nonexistent/tls.crt".into(),
            key: "/nonexistent/tls.key".into(),
            client_ca: None,
        };
        let e = server_config(&files).expect_err("missing files");
        assert!(e.to_string().contains("/nonexistent/tls.crt"), "{e}");
    }
}
