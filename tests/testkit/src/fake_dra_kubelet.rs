//! A fake kubelet for DRA drivers, over real unix sockets: kubelet's plugin watcher
//! (a socket appears in `plugins_registry`: `GetInfo`, the checks kubelet 1.34–1.36 make,
//! `NotifyRegistrationStatus`) and its DRA manager (dials the plugin's endpoint and calls
//! `NodePrepareResources`/`NodeUnprepareResources` of `k8s.io/kubelet/pkg/apis/dra/v1`).
//! Every wait has a deadline: a socket that never appears or a call that never returns
//! fails the test fast.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use vgpu_dra_driver::kubelet::dra_v1::dra_plugin_client::DraPluginClient;
use vgpu_dra_driver::kubelet::dra_v1::{
    Claim, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use vgpu_dra_driver::kubelet::registration::registration_client::RegistrationClient;
use vgpu_dra_driver::kubelet::registration::{InfoRequest, PluginInfo, RegistrationStatus};
use vgpu_dra_driver::kubelet::unix_channel;

/// The DRA services kubelet 1.34–1.36 speaks, most recent first (it takes the first the
/// plugin lists). This fake speaks only the first.
pub const KUBELET_SERVICES: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// How long one gRPC call may take.
const CALL_DEADLINE: Duration = Duration::from_secs(10);

/// What went wrong, as kubelet would see it.
#[derive(Debug, thiserror::Error)]
pub enum FakeKubeletError {
    /// Nothing happened in time.
    #[error("{what}: nothing within {after:?}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The deadline.
        after: Duration,
    },
    /// Kubelet would refuse the registration (and told the plugin so).
    #[error("registration refused: {0}")]
    Refused(String),
    /// A socket could not be dialled.
    #[error("dial {path}")]
    Dial {
        /// The socket.
        path: PathBuf,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
    /// A call failed.
    #[error("{call}")]
    Call {
        /// The call.
        call: &'static str,
        /// Its status.
        #[source]
        source: tonic::Status,
    },
}

/// kubelet's plugin watcher on one `plugins_registry` directory.
#[derive(Debug, Clone)]
pub struct FakeDraKubelet {
    registry_dir: PathBuf,
}

/// A plugin kubelet registered: what it said and the DRA client on its endpoint.
#[derive(Debug, Clone)]
pub struct Registered {
    /// The registration socket it came through.
    pub socket: PathBuf,
    /// Its `GetInfo` answer.
    pub info: PluginInfo,
    /// The DRA service chosen (one of [`KUBELET_SERVICES`]).
    pub service: String,
    client: DraPluginClient<Channel>,
}

fn is_socket(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

impl FakeDraKubelet {
    /// A watcher of `registry_dir`.
    pub fn new(registry_dir: impl Into<PathBuf>) -> FakeDraKubelet {
        FakeDraKubelet {
            registry_dir: registry_dir.into(),
        }
    }

    /// Waits up to `timeout` for a socket in the registry directory that answers, then
    /// registers it as kubelet does: `GetInfo`; type `DRAPlugin`, a name, an endpoint
    /// and a supported service, else `NotifyRegistrationStatus(false, why)` and
    /// [`FakeKubeletError::Refused`]; else it dials the endpoint and reports success.
    pub async fn register(&self, timeout: Duration) -> Result<Registered, FakeKubeletError> {
        let start = Instant::now();
        loop {
            let sockets: Vec<PathBuf> = std::fs::read_dir(&self.registry_dir)
                .map(|d| {
                    d.filter_map(Result::ok)
                        .map(|e| e.path())
                        .filter(|p| is_socket(p))
                        .collect()
                })
                .unwrap_or_default();
            for socket in sockets {
                // A stale socket nobody listens on is skipped, as kubelet retries it.
                if let Ok(ch) = unix_channel(&socket).await {
                    return self.register_one(socket, ch).await;
                }
            }
            if start.elapsed() >= timeout {
                return Err(FakeKubeletError::Timeout {
                    what: format!("a plugin socket in {}", self.registry_dir.display()),
                    after: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn register_one(
        &self,
        socket: PathBuf,
        ch: Channel,
    ) -> Result<Registered, FakeKubeletError> {
        let mut reg = RegistrationClient::new(ch);
        let info = deadline("GetInfo", reg.get_info(InfoRequest {}))
            .await?
            .into_inner();
        let service = KUBELET_SERVICES
            .iter()
            .find(|s| info.supported_versions.iter().any(|v| v == *s))
            .map(|s| (*s).to_owned());
        let problem = if info.r#type != "DRAPlugin" {
            Some(format!("plugin type {:?} is not DRAPlugin", info.r#type))
        } else if info.name.is_empty() {
            Some("empty plugin name".to_owned())
        } else if info.endpoint.is_empty() {
            Some("empty endpoint".to_owned())
        } else if service.is_none() {
            Some(format!(
                "none of the versions supported by the plugin {:?} are supported by kubelet {KUBELET_SERVICES:?}",
                info.supported_versions
            ))
        } else {
            None
        };
        let endpoint = PathBuf::from(&info.endpoint);
        let client = match (&problem, &service) {
            (None, Some(s)) if s == KUBELET_SERVICES[0] => unix_channel(&endpoint)
                .await
                .map(DraPluginClient::new)
                .map_err(|source| FakeKubeletError::Dial {
                    path: endpoint.clone(),
                    source,
                }),
            (None, _) => Err(FakeKubeletError::Refused(
                "this fake speaks v1.DRAPlugin only".to_owned(),
            )),
            (Some(p), _) => Err(FakeKubeletError::Refused(p.clone())),
        };
        let status = match &client {
            Ok(_) => RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            },
            Err(e) => RegistrationStatus {
                plugin_registered: false,
                error: e.to_string(),
            },
        };
        deadline(
            "NotifyRegistrationStatus",
            reg.notify_registration_status(status),
        )
        .await?;
        Ok(Registered {
            socket,
            info,
            service: service.unwrap_or_default(),
            client: client?,
        })
    }
}

/// `(namespace, name, uid)` as kubelet's `Claim`.
fn claims(list: &[(&str, &str, &str)]) -> Vec<Claim> {
    list.iter()
        .map(|(namespace, name, uid)| Claim {
            namespace: (*namespace).to_owned(),
            name: (*name).to_owned(),
            uid: (*uid).to_owned(),
        })
        .collect()
}

async fn deadline<T>(
    call: &'static str,
    f: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<tonic::Response<T>, FakeKubeletError> {
    match tokio::time::timeout(CALL_DEADLINE, f).await {
        Ok(r) => r.map_err(|source| FakeKubeletError::Call { call, source }),
        Err(_) => Err(FakeKubeletError::Timeout {
            what: call.to_owned(),
            after: CALL_DEADLINE,
        }),
    }
}

impl Registered {
    /// `NodePrepareResources` for claims `(namespace, name, uid)`.
    pub async fn prepare(
        &mut self,
        list: &[(&str, &str, &str)],
    ) -> Result<NodePrepareResourcesResponse, FakeKubeletError> {
        let req = NodePrepareResourcesRequest {
            claims: claims(list),
        };
        Ok(deadline(
            "NodePrepareResources",
            self.client.node_prepare_resources(req),
        )
        .await?
        .into_inner())
    }

    /// `NodeUnprepareResources` for claims `(namespace, name, uid)`.
    pub async fn unprepare(
        &mut self,
        list: &[(&str, &str, &str)],
    ) -> Result<NodeUnprepareResourcesResponse, FakeKubeletError> {
        let req = NodeUnprepareResourcesRequest {
            claims: claims(list),
        };
        Ok(deadline(
            "NodeUnprepareResources",
            self.client.node_unprepare_resources(req),
        )
        .await?
        .into_inner())
    }
}
