//! The DRA service kubelet calls (`NodePrepareResources`, `NodeUnprepareResources`): the
//! thin I/O driver around [`claim::plan`] and [`cdi::spec`]. It reads each claim from the
//! API server, writes each request's quota file and the claim's CDI spec, and
//! checkpoints what it answered; a claim already in the checkpoint (whose spec is still
//! there) is answered from it, without the API server: a restarted driver answers
//! kubelet's repeated calls idempotently.
//!
//! Kubelet's rule: a failed claim is reported in its entry's `error` (kubelet retries the
//! call), never as a failed call; every claim of the request gets an entry.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use kube::api::{Api, ApiResource, DynamicObject};
use tokio::sync::{Mutex, watch};
use tonic::{Request, Response, Status};
use tracing::{info, warn};
use vgpu_core::container_quota::QUOTA_FILE;
use vgpu_core::inventory::GpuInfo;
use vgpu_core::sched_proto::Priority;

use crate::cdi;
use crate::checkpoint::{
    CHECKPOINT_FILE, Checkpoint, CheckpointError, PreparedClaim, PreparedDevice, write_atomic,
};
use crate::claim::{self, ClaimError, ClaimRef, Problem, ResourceClaim};
use crate::config::{Config, DeviceMode};
use crate::kubelet::dra_v1::dra_plugin_server::DraPlugin;
use crate::kubelet::dra_v1::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest,
    NodePrepareResourcesResponse, NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest,
    NodeUnprepareResourcesResponse,
};

/// Why a claim could not be prepared or unprepared.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// Reading the claim from the API server failed.
    #[error("read claim {claim} from the API server")]
    Api {
        /// The claim.
        claim: ClaimRef,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The API server has no such claim.
    #[error("claim {claim}: not found in the API server")]
    NotFound {
        /// The claim.
        claim: ClaimRef,
    },
    /// The API server did not answer in time.
    #[error("claim {claim}: the API server did not answer within {after:?}")]
    Timeout {
        /// The claim.
        claim: ClaimRef,
        /// The deadline.
        after: std::time::Duration,
    },
    /// The claim's allocation cannot be honoured.
    #[error(transparent)]
    Claim(#[from] ClaimError),
    /// The claim asks for latency-sensitive in a namespace not allowed to.
    #[error(
        "claim {claim}: priority latency-sensitive is not allowed in namespace {namespace:?} (allowed: {allowed}; --latency-sensitive-namespaces)"
    )]
    LatencySensitive {
        /// The claim.
        claim: ClaimRef,
        /// Its namespace.
        namespace: String,
        /// The namespaces allowed.
        allowed: String,
    },
    /// A file could not be written or removed.
    #[error("claim {claim}: write {path}")]
    Write {
        /// The claim.
        claim: String,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint could not be written.
    #[error("claim {claim}: checkpoint")]
    Checkpoint {
        /// The claim.
        claim: String,
        /// The checkpoint's error.
        #[source]
        source: CheckpointError,
    },
}

/// An error and its causes, `: `-separated (what kubelet shows in the pod's events).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The `resource.k8s.io/v1` ResourceClaim resource (read as a dynamic object: the
/// workspace's `k8s-openapi` predates `v1`, ADR 0073).
pub fn claim_resource() -> ApiResource {
    ApiResource {
        group: "resource.k8s.io".into(),
        version: "v1".into(),
        api_version: "resource.k8s.io/v1".into(),
        kind: "ResourceClaim".into(),
        plural: "resourceclaims".into(),
    }
}

/// The DRA service.
#[derive(Clone)]
pub struct Driver {
    cfg: Arc<Config>,
    client: kube::Client,
    gpus: watch::Receiver<Vec<GpuInfo>>,
    /// The checkpoint; held across a whole prepare or unprepare so that they never
    /// interleave.
    state: Arc<Mutex<Checkpoint>>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("driver", &self.cfg.driver_name)
            .field("node", &self.cfg.node_name)
            .finish_non_exhaustive()
    }
}

impl Driver {
    /// A driver over these GPUs, resuming from the checkpoint in the state directory;
    /// writes `ld.so.preload` there.
    pub fn new(
        cfg: Arc<Config>,
        client: kube::Client,
        gpus: watch::Receiver<Vec<GpuInfo>>,
    ) -> Result<Driver, CheckpointError> {
        let checkpoint = Checkpoint::load(&cfg.state_dir.join(CHECKPOINT_FILE))?;
        let preload = cfg.state_dir.join(cdi::PRELOAD_FILE);
        let line = format!("{}\n", cfg.shim_container_path.display());
        write_atomic(&preload, line.as_bytes()).map_err(|source| CheckpointError::Io {
            path: preload.clone(),
            source,
        })?;
        info!(claims = checkpoint.claims.len(), "checkpoint loaded");
        Ok(Driver {
            cfg,
            client,
            gpus,
            state: Arc::new(Mutex::new(checkpoint)),
        })
    }

    /// The claims prepared now, by UID.
    pub async fn prepared(&self) -> Vec<String> {
        self.state.lock().await.claims.keys().cloned().collect()
    }

    async fn read_claim(&self, c: &ClaimRef) -> Result<ResourceClaim, PrepareError> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &c.namespace, &claim_resource());
        let got = tokio::time::timeout(self.cfg.call_timeout, api.get_opt(&c.name))
            .await
            .map_err(|_| PrepareError::Timeout {
                claim: c.clone(),
                after: self.cfg.call_timeout,
            })?
            .map_err(|source| PrepareError::Api {
                claim: c.clone(),
                source,
            })?
            .ok_or_else(|| PrepareError::NotFound { claim: c.clone() })?;
        let value = serde_json::to_value(&got).expect("a dynamic object serializes");
        // Fields the driver reads that do not have the expected shape make the claim
        // unusable: name the claim.
        serde_json::from_value(value).map_err(|e| {
            PrepareError::Claim(ClaimError::new(
                c,
                Problem::Config {
                    driver: self.cfg.driver_name.clone(),
                    reason: format!("claim object: {e}"),
                },
            ))
        })
    }

    /// Prepares one claim: its devices as kubelet is told them.
    pub async fn prepare_claim(&self, c: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        let mut state = self.state.lock().await;
        let spec_path = cdi::spec_path(&self.cfg, &c.uid);
        if let Some(p) = state.claims.get(&c.uid)
            && spec_path.exists()
        {
            info!(claim = %c, "already prepared: answered from the checkpoint");
            return Ok(p.devices.clone());
        }
        let object = self.read_claim(c).await?;
        let gpus = self.gpus.borrow().clone();
        let plan = claim::plan(
            c,
            &object,
            claim::Context {
                driver: &self.cfg.driver_name,
                node: &self.cfg.node_name,
                gpus: &gpus,
            },
        )?;
        if let Some(allowed) = &self.cfg.latency_sensitive_namespaces
            && !allowed.contains(&c.namespace)
            && plan
                .requests
                .iter()
                .any(|r| r.priority == Priority::LatencySensitive)
        {
            return Err(PrepareError::LatencySensitive {
                claim: c.clone(),
                namespace: c.namespace.clone(),
                allowed: allowed.iter().cloned().collect::<Vec<_>>().join(", "),
            });
        }
        let write_err = |path: &std::path::Path| {
            let claim = c.to_string();
            let path = path.to_owned();
            move |source| PrepareError::Write {
                claim,
                path,
                source,
            }
        };
        let mut devices = Vec::new();
        for req in &plan.requests {
            let id = format!(
                "{}={}",
                self.cfg.cdi_kind,
                cdi::device_name(&c.uid, &req.request)
            );
            let dir = cdi::request_dir(&self.cfg.state_dir, &c.uid, &req.request);
            let file = dir.join(QUOTA_FILE);
            let quota = cdi::quota(c, &plan, req, &id);
            write_atomic(&file, quota.to_json().as_bytes()).map_err(write_err(&file))?;
            for (i, d) in req.devices.iter().enumerate() {
                let mut ids = Vec::new();
                // The request's one CDI device carries all its GPUs: named once.
                if i == 0 {
                    ids.push(id.clone());
                }
                if self.cfg.device_mode == DeviceMode::Cdi {
                    ids.push(format!("{}={}", self.cfg.nvidia_cdi_kind, d.uuid));
                }
                devices.push(PreparedDevice {
                    request_names: vec![req.request.clone()],
                    pool_name: d.pool.clone(),
                    device_name: d.device.clone(),
                    cdi_device_ids: ids,
                });
            }
        }
        let control: Vec<&str> = cdi::CONTROL_NODES
            .into_iter()
            .filter(|n| self.cfg.dev_dir.join(n).exists())
            .collect();
        let daemon = self.daemon_dir();
        let spec = cdi::spec(
            &self.cfg,
            c,
            &plan,
            &control,
            daemon.as_ref().map(|(d, f)| (d.as_path(), f.as_str())),
        );
        let text = serde_json::to_vec_pretty(&spec).expect("JSON values serialize");
        write_atomic(&spec_path, &text).map_err(write_err(&spec_path))?;
        state.claims.insert(
            c.uid.clone(),
            PreparedClaim {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                devices: devices.clone(),
            },
        );
        state
            .save(&self.cfg.state_dir.join(CHECKPOINT_FILE))
            .map_err(|source| PrepareError::Checkpoint {
                claim: c.to_string(),
                source,
            })?;
        info!(claim = %c, requests = plan.requests.len(), devices = devices.len(), "prepared");
        Ok(devices)
    }

    /// Unprepares one claim (a claim not prepared is already done): removes its CDI
    /// spec and directories and its checkpoint entry.
    pub async fn unprepare_claim(&self, c: &ClaimRef) -> Result<(), PrepareError> {
        let mut state = self.state.lock().await;
        let write_err = |path: PathBuf| {
            let claim = c.to_string();
            move |source| PrepareError::Write {
                claim,
                path,
                source,
            }
        };
        let spec = cdi::spec_path(&self.cfg, &c.uid);
        ignore_missing(std::fs::remove_file(&spec)).map_err(write_err(spec))?;
        let dir = self.cfg.state_dir.join("claims").join(&c.uid);
        ignore_missing(std::fs::remove_dir_all(&dir)).map_err(write_err(dir))?;
        if state.claims.remove(&c.uid).is_some() {
            state
                .save(&self.cfg.state_dir.join(CHECKPOINT_FILE))
                .map_err(|source| PrepareError::Checkpoint {
                    claim: c.to_string(),
                    source,
                })?;
            info!(claim = %c, "unprepared");
        }
        Ok(())
    }

    /// The daemon socket's directory and file name, if a daemon is configured and its
    /// directory exists (a runtime fails a container whose mount source is missing).
    fn daemon_dir(&self) -> Option<(PathBuf, String)> {
        let sock = self.cfg.daemon_socket.as_ref()?;
        let dir = sock.parent()?;
        let file = sock.file_name()?.to_string_lossy().into_owned();
        dir.is_dir().then(|| (dir.to_owned(), file))
    }
}

fn ignore_missing(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

fn claim_ref(c: Claim) -> ClaimRef {
    ClaimRef {
        namespace: c.namespace,
        name: c.name,
        uid: c.uid,
    }
}

#[tonic::async_trait]
impl DraPlugin for Driver {
    async fn node_prepare_resources(
        &self,
        req: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for c in req.into_inner().claims {
            let c = claim_ref(c);
            let entry = match self.prepare_claim(&c).await {
                Ok(devices) => NodePrepareResourceResponse {
                    devices: devices
                        .into_iter()
                        .map(|d| Device {
                            request_names: d.request_names,
                            pool_name: d.pool_name,
                            device_name: d.device_name,
                            cdi_device_ids: d.cdi_device_ids,
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(e) => {
                    let error = error_chain(&e);
                    warn!(claim = %c, %error, "NodePrepareResources refused");
                    NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    }
                }
            };
            claims.insert(c.uid, entry);
        }
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for c in req.into_inner().claims {
            let c = claim_ref(c);
            let error = match self.unprepare_claim(&c).await {
                Ok(()) => String::new(),
                Err(e) => {
                    let error = error_chain(&e);
                    warn!(claim = %c, %error, "NodeUnprepareResources failed");
                    error
                }
            };
            claims.insert(c.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}
