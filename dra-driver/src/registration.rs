//! Kubelet's plugin registration (the `Registration` service on a socket in
//! `plugins_registry`): kubelet's plugin watcher finds the socket, asks [`GetInfo`]
//! (type `DRAPlugin`, the driver name, the DRA socket, the services it serves) and
//! reports the outcome with `NotifyRegistrationStatus`, which the driver logs and
//! publishes ([`Registrar::status`]).
//!
//! [`GetInfo`]: crate::kubelet::registration::registration_server::Registration::get_info

use std::sync::Arc;

use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info};

use crate::config::Config;
use crate::kubelet::registration::registration_server::Registration;
use crate::kubelet::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use crate::kubelet::{DRA_V1_SERVICE, PLUGIN_TYPE};

/// What kubelet last said about the registration: `None` before it said anything,
/// `Some(Ok(()))` registered, `Some(Err(message))` refused.
pub type RegistrationOutcome = Option<Result<(), String>>;

/// The registration service.
#[derive(Debug, Clone)]
pub struct Registrar {
    cfg: Arc<Config>,
    status: Arc<watch::Sender<RegistrationOutcome>>,
}

impl Registrar {
    /// A registrar for this driver.
    pub fn new(cfg: Arc<Config>) -> Registrar {
        Registrar {
            cfg,
            status: Arc::new(watch::channel(None).0),
        }
    }

    /// What kubelet said, as it changes.
    pub fn status(&self) -> watch::Receiver<RegistrationOutcome> {
        self.status.subscribe()
    }

    /// The plugin information kubelet asks for.
    pub fn info(&self) -> PluginInfo {
        PluginInfo {
            r#type: PLUGIN_TYPE.to_owned(),
            name: self.cfg.driver_name.clone(),
            endpoint: self.cfg.dra_socket().display().to_string(),
            supported_versions: vec![DRA_V1_SERVICE.to_owned()],
        }
    }
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(self.info()))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        let outcome = if s.plugin_registered {
            info!(driver = %self.cfg.driver_name, "registered with kubelet");
            Ok(())
        } else {
            error!(driver = %self.cfg.driver_name, error = %s.error, "kubelet refused the registration");
            Err(s.error)
        };
        self.status.send_replace(Some(outcome));
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
