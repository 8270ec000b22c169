//! The composition root: the driver's two sockets served until shutdown. The DRA socket
//! is bound first, then the registration socket (kubelet dials the DRA socket as soon
//! as it has read the registration). Stale sockets of a previous run are replaced. The
//! node's `ResourceSlice` is published in the background (retried with back-off while
//! the API server refuses it, republished with the next pool generation when the GPU
//! list changes).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tracing::{info, warn};
use vgpu_core::inventory::GpuInfo;

use crate::checkpoint::CheckpointError;
use crate::config::{Config, ConfigError};
use crate::driver::{Driver, error_chain};
use crate::kubelet::dra_v1::dra_plugin_server::DraPluginServer;
use crate::kubelet::registration::registration_server::RegistrationServer;
use crate::registration::{Registrar, RegistrationOutcome};

/// Why the driver could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The configuration is invalid.
    #[error("configuration")]
    Config(#[from] ConfigError),
    /// The checkpoint or state directory is unusable.
    #[error("state")]
    State(#[from] CheckpointError),
    /// A socket could not be bound.
    #[error("bind {path}")]
    Bind {
        /// The socket.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A running driver.
#[derive(Debug)]
pub struct Started {
    /// The DRA service (for inspection by tests and metrics).
    pub driver: Driver,
    registration: watch::Receiver<RegistrationOutcome>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    sockets: Vec<PathBuf>,
}

impl Started {
    /// What kubelet said about the registration, as it changes.
    pub fn registration(&self) -> watch::Receiver<RegistrationOutcome> {
        self.registration.clone()
    }

    /// Stops both servers and removes their sockets.
    pub async fn stop(self) {
        self.shutdown.send_replace(true);
        for t in self.tasks {
            let _ = t.await;
        }
        for s in &self.sockets {
            let _ = std::fs::remove_file(s);
        }
    }
}

fn bind(path: &Path) -> Result<UnixListener, RunError> {
    let err = |source| RunError::Bind {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
        _ => {}
    }
    UnixListener::bind(path).map_err(err)
}

/// Validates the configuration, loads the checkpoint and serves the DRA service and the
/// registration service on their sockets.
pub async fn start(
    cfg: Config,
    client: kube::Client,
    gpus: watch::Receiver<Vec<GpuInfo>>,
) -> Result<Started, RunError> {
    cfg.validate()?;
    let cfg = Arc::new(cfg);
    let driver = Driver::new(cfg.clone(), client.clone(), gpus.clone())?;
    let registrar = Registrar::new(cfg.clone());
    let (shutdown, _) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let dra_path = cfg.dra_socket();
    let dra = bind(&dra_path)?;
    let server = Server::builder()
        .add_service(DraPluginServer::new(driver.clone()))
        .serve_with_incoming_shutdown(UnixListenerStream::new(dra), stopped(shutdown.subscribe()));
    let mut tasks = vec![tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(error = %e, "DRA server stopped");
        }
    })];
    let reg_path = cfg.registration_socket();
    let reg = bind(&reg_path)?;
    let registration = registrar.status();
    let server = Server::builder()
        .add_service(RegistrationServer::new(registrar))
        .serve_with_incoming_shutdown(UnixListenerStream::new(reg), stopped(shutdown.subscribe()));
    tasks.push(tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(error = %e, "registration server stopped");
        }
    }));
    tasks.push(tokio::spawn(publish_slices(
        cfg.clone(),
        client,
        gpus,
        shutdown.subscribe(),
    )));
    info!(
        driver = %cfg.driver_name,
        dra = %dra_path.display(),
        registration = %reg_path.display(),
        "serving"
    );
    Ok(Started {
        driver,
        registration,
        shutdown,
        tasks,
        sockets: vec![reg_path, dra_path],
    })
}

/// Resolves when `stop` turns true (or its sender is gone).
async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Publishes the node's ResourceSlice, retrying failures (0.5 s doubling to 30 s), and
/// again with the next pool generation whenever the GPU list changes, until `stop`.
async fn publish_slices(
    cfg: Arc<Config>,
    client: kube::Client,
    mut gpus: watch::Receiver<Vec<GpuInfo>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut generation = 1u64;
    loop {
        let list = gpus.borrow_and_update().clone();
        let mut delay = Duration::from_millis(500);
        loop {
            match crate::slice::publish(
                &client,
                &cfg.node_name,
                &cfg.driver_name,
                &list,
                generation,
            )
            .await
            {
                Ok(()) => {
                    info!(generation, gpus = list.len(), "ResourceSlice published");
                    break;
                }
                Err(e) => {
                    warn!(error = %error_chain(&e), retry_in = ?delay, "publish the ResourceSlice");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = until_stopped(&mut stop) => return,
            }
            delay = (delay * 2).min(Duration::from_secs(30));
        }
        tokio::select! {
            r = gpus.changed() => if r.is_err() { return },
            () = until_stopped(&mut stop) => return,
        }
        generation += 1;
    }
}
