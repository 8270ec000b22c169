//! Serve first, then register; re-serve and re-register whenever kubelet restarts.
//!
//! Kubelet deletes every plugin socket when it restarts and re-creates `kubelet.sock`.
//! The loop watches both files (by inode): when `kubelet.sock` is a new file or our socket
//! is gone, it stops the old server, binds a fresh socket, and registers again. Measured
//! re-registration time is logged (`took_ms`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tracing::{info, warn};

use crate::config::Config;
use crate::error::error_chain;
use crate::kubelet::v1beta1::device_plugin_server::DevicePluginServer;
use crate::kubelet::v1beta1::registration_client::RegistrationClient;
use crate::kubelet::v1beta1::{DevicePluginOptions, RegisterRequest};
use crate::kubelet::{API_VERSION, KUBELET_SOCKET, unix_channel_connected};
use crate::plugin::Plugin;

/// Why serving or registering failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Our socket could not be bound.
    #[error("bind plugin socket {path}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Kubelet refused or did not take the registration.
    #[error("register with kubelet at {path}: {message}")]
    Register {
        /// Kubelet's socket.
        path: PathBuf,
        /// What happened.
        message: String,
    },
}

fn identity(p: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

/// A running plugin server on one socket.
#[derive(Debug)]
pub struct Served {
    task: JoinHandle<()>,
    socket: PathBuf,
    id: Option<(u64, u64)>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds a fresh socket (removing a stale file) and serves the plugin on it.
pub fn serve(cfg: &Config, plugin: Plugin) -> Result<Served, ServeError> {
    let socket = cfg.device_plugin_dir.join(&cfg.socket_name);
    match std::fs::remove_file(&socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(ServeError::Bind {
                path: socket,
                source,
            });
        }
    }
    let listener = UnixListener::bind(&socket).map_err(|source| ServeError::Bind {
        path: socket.clone(),
        source,
    })?;
    let id = identity(&socket);
    let incoming = UnixListenerStream::new(listener);
    let task = tokio::spawn(async move {
        let r = tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(plugin))
            .serve_with_incoming(incoming)
            .await;
        if let Err(e) = r {
            warn!(error = %error_chain(&e), "plugin server ended");
        }
    });
    Ok(Served { task, socket, id })
}

/// Registers with kubelet (one attempt, bounded by `timeout`).
pub async fn register(cfg: &Config, timeout: Duration) -> Result<(), ServeError> {
    let path = cfg.device_plugin_dir.join(KUBELET_SOCKET);
    let err = |message: String| ServeError::Register {
        path: path.clone(),
        message,
    };
    let attempt = async {
        let ch = unix_channel_connected(&path)
            .await
            .map_err(|e| err(error_chain(&e)))?;
        RegistrationClient::new(ch)
            .register(RegisterRequest {
                version: API_VERSION.to_owned(),
                endpoint: cfg.socket_name.clone(),
                resource_name: cfg.resource_name.clone(),
                options: Some(DevicePluginOptions {
                    pre_start_required: true,
                    get_preferred_allocation_available: true,
                }),
            })
            .await
            .map_err(|s| err(format!("{:?}: {}", s.code(), s.message())))?;
        Ok(())
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .unwrap_or_else(|_| Err(err(format!("no answer within {timeout:?}"))))
}

/// Serves and registers, forever: re-serves on a fresh socket and re-registers each time
/// kubelet restarts. Returns only when `shutdown` completes.
pub async fn run(cfg: Arc<Config>, plugin: Plugin, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    let kubelet = cfg.device_plugin_dir.join(KUBELET_SOCKET);
    let mut started: Option<Instant> = None;
    loop {
        // Wait for kubelet's socket.
        let kubelet_id = loop {
            if let Some(id) = identity(&kubelet) {
                break id;
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(cfg.kubelet_poll) => {}
            }
        };
        let t0 = *started.get_or_insert_with(Instant::now);
        let served = match serve(&cfg, plugin.clone()) {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %error_chain(&e), "cannot serve; retrying");
                tokio::select! {
                    () = &mut shutdown => return,
                    () = tokio::time::sleep(cfg.kubelet_poll * 10) => {}
                }
                continue;
            }
        };
        match register(&cfg, cfg.call_timeout).await {
            Ok(()) => {
                info!(
                    socket = %served.socket.display(),
                    resource = %cfg.resource_name,
                    took_ms = t0.elapsed().as_secs_f64() * 1e3,
                    "registered with kubelet"
                );
                started = None;
            }
            Err(e) => {
                warn!(error = %error_chain(&e), "registration failed; retrying");
                drop(served);
                tokio::select! {
                    () = &mut shutdown => return,
                    () = tokio::time::sleep(cfg.kubelet_poll * 4) => {}
                }
                continue;
            }
        }
        // Watch for a kubelet restart: a new kubelet.sock, or our socket deleted.
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(cfg.kubelet_poll) => {}
            }
            let k = identity(&kubelet);
            if k.is_some() && k != Some(kubelet_id) || identity(&served.socket) != served.id {
                info!("kubelet restarted (socket re-created or ours deleted): re-serving");
                started = Some(Instant::now());
                break;
            }
            if served.task.is_finished() {
                warn!("plugin server stopped: re-serving");
                break;
            }
        }
        drop(served);
    }
}
