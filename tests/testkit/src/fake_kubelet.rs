//! A fake kubelet speaking the real protocols over unix sockets.
//!
//! - Registration server on `<dir>/kubelet.sock`; records every `Register`.
//! - DevicePlugin client to the registered endpoint: `ListAndWatch` kept open and its
//!   latest list stored; admission as kubelet 1.28 does it: one pod at a time, init
//!   containers first, `GetPreferredAllocation` then `Allocate` per container, devices
//!   of init containers reused by later containers, taken from the pod's reuse pool in
//!   an arbitrary (seeded, shuffled) order as kubelet's Go set iteration takes them.
//! - PodResources server: `List` reports pods added to it and the devices of their
//!   regular containers (not init containers, as 1.28), with kubelet's limit of 10
//!   concurrent calls (the rest get `ResourceExhausted`).
//! - `restart()`: deletes every plugin socket and re-creates `kubelet.sock`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::UnixListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use vgpu_device_plugin::kubelet::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use vgpu_device_plugin::kubelet::podresources::{
    ContainerDevices, ContainerResources, ListPodResourcesRequest, ListPodResourcesResponse,
    PodResources,
};
use vgpu_device_plugin::kubelet::v1beta1::device_plugin_client::DevicePluginClient;
use vgpu_device_plugin::kubelet::v1beta1::registration_server::{Registration, RegistrationServer};
use vgpu_device_plugin::kubelet::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, Device, Empty, PreStartContainerRequest,
    PreferredAllocationRequest, RegisterRequest,
};
use vgpu_device_plugin::kubelet::{HEALTHY, KUBELET_SOCKET, unix_channel_connected};

/// The limit kubelet puts on concurrent PodResources calls.
pub const PODRESOURCES_MAX_CONCURRENT: usize = 10;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A pod's regular containers and their device IDs, as `List` reports them.
type ListedContainers = Vec<(String, Vec<String>)>;

#[derive(Debug, Default)]
struct Shared {
    registrations: Vec<(Instant, RegisterRequest)>,
    /// (namespace, pod) → container → device IDs (regular containers only are listed).
    pods: BTreeMap<(String, String), ListedContainers>,
    /// Every device ID held by some container (kubelet's ledger).
    allocated: BTreeMap<String, (String, String, String)>,
    devices: Vec<Device>,
}

#[derive(Debug, Clone)]
struct Reg {
    shared: Arc<Mutex<Shared>>,
    notify: Arc<Notify>,
}

#[tonic::async_trait]
impl Registration for Reg {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let r = req.into_inner();
        if r.version != vgpu_device_plugin::kubelet::API_VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported version {}",
                r.version
            )));
        }
        lock(&self.shared).registrations.push((Instant::now(), r));
        self.notify.notify_waiters();
        Ok(Response::new(Empty {}))
    }
}

#[derive(Debug, Clone)]
struct Lister {
    shared: Arc<Mutex<Shared>>,
    in_flight: Arc<AtomicUsize>,
    max_seen: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
    delay: Arc<Mutex<Duration>>,
}

#[tonic::async_trait]
impl PodResourcesLister for Lister {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.max_seen.fetch_max(n, Ordering::SeqCst);
        let _guard = Decrement(self.in_flight.clone());
        if n > PODRESOURCES_MAX_CONCURRENT {
            return Err(Status::resource_exhausted("rejected request: rate limit"));
        }
        let delay = *lock(&self.delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let sh = lock(&self.shared);
        let pod_resources = sh
            .pods
            .iter()
            .map(|((ns, name), cs)| PodResources {
                name: name.clone(),
                namespace: ns.clone(),
                containers: cs
                    .iter()
                    .map(|(c, ids)| ContainerResources {
                        name: c.clone(),
                        devices: ids
                            .iter()
                            .map(|id| ContainerDevices {
                                resource_name: vgpu_core::resources::RESOURCE_GPU.to_owned(),
                                device_ids: vec![id.clone()],
                                topology: None,
                            })
                            .collect(),
                    })
                    .collect(),
            })
            .collect();
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }
}

struct Decrement(Arc<AtomicUsize>);
impl Drop for Decrement {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One container as the fake kubelet admits it.
#[derive(Debug, Clone)]
pub struct FakeContainer {
    /// Name.
    pub name: String,
    /// `vgpu.io/gpu` slices requested (0: none).
    pub slices: usize,
    /// Init container.
    pub init: bool,
    /// A sidecar: an init container with `restartPolicy: Always` (kubelet 1.29+ lists it
    /// in PodResources and never lets a later container reuse its devices).
    pub sidecar: bool,
}

/// What admitting a pod produced: each container's device IDs, in admission order.
#[derive(Debug, Clone)]
pub struct Admitted {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// (container, init, device IDs, `Allocate` answer).
    pub containers: Vec<(String, bool, Vec<String>, ContainerAllocateResponse)>,
    /// Per container: `GetPreferredAllocation` round trip (when called), `Allocate` round trip.
    pub timings: Vec<(Option<Duration>, Duration)>,
}

impl Admitted {
    /// Each container's device IDs, by container name.
    pub fn ids(&self) -> BTreeMap<String, Vec<String>> {
        self.containers
            .iter()
            .map(|(n, _, i, _)| (n.clone(), i.clone()))
            .collect()
    }
}

/// A failure of the fake kubelet's side (a test fails with it).
#[derive(Debug, thiserror::Error)]
pub enum FakeKubeletError {
    /// Socket or I/O trouble.
    #[error("fake kubelet: {0}")]
    Io(String),
    /// A call to the plugin failed.
    #[error("fake kubelet: {call} failed: {status}")]
    Call {
        /// The call.
        call: &'static str,
        /// The status.
        status: Status,
    },
    /// Something did not happen in time.
    #[error("fake kubelet: timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
}

/// The fake kubelet.
#[derive(Debug)]
pub struct FakeKubelet {
    dir: PathBuf,
    pod_resources_socket: PathBuf,
    shared: Arc<Mutex<Shared>>,
    notify: Arc<Notify>,
    reg_server: Option<JoinHandle<()>>,
    pr_server: JoinHandle<()>,
    lister: Lister,
    watch: Option<JoinHandle<()>>,
    admission: tokio::sync::Mutex<()>,
    /// State of the generator that orders the reuse pool (xorshift; never 0).
    reuse_order: AtomicU64,
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        if let Some(t) = self.reg_server.take() {
            t.abort();
        }
        if let Some(t) = self.watch.take() {
            t.abort();
        }
        self.pr_server.abort();
    }
}

fn io(e: impl std::fmt::Display) -> FakeKubeletError {
    FakeKubeletError::Io(e.to_string())
}

fn serve_registration(
    dir: &Path,
    shared: Arc<Mutex<Shared>>,
    notify: Arc<Notify>,
) -> Result<JoinHandle<()>, FakeKubeletError> {
    let sock = dir.join(KUBELET_SOCKET);
    let _ = std::fs::remove_file(&sock);
    let l = UnixListener::bind(&sock).map_err(io)?;
    Ok(tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Reg { shared, notify }))
            .serve_with_incoming(UnixListenerStream::new(l))
            .await;
    }))
}

impl FakeKubelet {
    /// Starts kubelet's sockets: `<dir>/kubelet.sock` and `pod_resources_socket`.
    pub async fn start(
        dir: &Path,
        pod_resources_socket: &Path,
    ) -> Result<FakeKubelet, FakeKubeletError> {
        std::fs::create_dir_all(dir).map_err(io)?;
        let shared: Arc<Mutex<Shared>> = Arc::default();
        let notify = Arc::new(Notify::new());
        let reg_server = serve_registration(dir, shared.clone(), notify.clone())?;
        let lister = Lister {
            shared: shared.clone(),
            in_flight: Arc::default(),
            max_seen: Arc::default(),
            calls: Arc::default(),
            delay: Arc::default(),
        };
        if let Some(p) = pod_resources_socket.parent() {
            std::fs::create_dir_all(p).map_err(io)?;
        }
        let _ = std::fs::remove_file(pod_resources_socket);
        let l = UnixListener::bind(pod_resources_socket).map_err(io)?;
        let svc = lister.clone();
        let pr_server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(svc))
                .serve_with_incoming(UnixListenerStream::new(l))
                .await;
        });
        Ok(FakeKubelet {
            dir: dir.to_owned(),
            pod_resources_socket: pod_resources_socket.to_owned(),
            shared,
            notify,
            reg_server: Some(reg_server),
            pr_server,
            lister,
            watch: None,
            admission: tokio::sync::Mutex::new(()),
            reuse_order: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
        })
    }

    /// Seeds the order in which admission takes devices from a pod's reuse pool
    /// (kubelet takes them in Go set iteration order: arbitrary).
    pub fn seed_reuse_order(&self, seed: u64) {
        self.reuse_order.store(seed | 1, Ordering::SeqCst);
    }

    /// The reuse pool in the next arbitrary order.
    fn shuffled(&self, pool: &[String]) -> Vec<String> {
        let mut v = pool.to_vec();
        for i in (1..v.len()).rev() {
            let mut x = self.reuse_order.load(Ordering::SeqCst);
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.reuse_order.store(x, Ordering::SeqCst);
            let j = usize::try_from(x % (i as u64 + 1)).unwrap_or(0);
            v.swap(i, j);
        }
        v
    }

    /// The PodResources socket.
    pub fn pod_resources_socket(&self) -> &Path {
        &self.pod_resources_socket
    }

    /// Waits until at least `n` registrations arrived; returns the `n`-th and its time.
    pub async fn wait_registered(
        &self,
        n: usize,
        timeout: Duration,
    ) -> Result<(Instant, RegisterRequest), FakeKubeletError> {
        let end = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.notify.notified();
            if let Some(r) = lock(&self.shared).registrations.get(n - 1) {
                return Ok(r.clone());
            }
            if tokio::time::timeout_at(end, notified).await.is_err() {
                return Err(FakeKubeletError::Timeout(
                    timeout,
                    format!("registration #{n}"),
                ));
            }
        }
    }

    /// Connects to the plugin's endpoint (a file name in the device-plugins directory),
    /// checks its options and keeps its `ListAndWatch` stream open.
    pub async fn connect(
        &mut self,
        endpoint: &str,
    ) -> Result<DevicePluginClient<Channel>, FakeKubeletError> {
        let ch = unix_channel_connected(&self.dir.join(endpoint))
            .await
            .map_err(io)?;
        let mut c = DevicePluginClient::new(ch);
        let opts = c
            .get_device_plugin_options(Empty {})
            .await
            .map_err(|status| FakeKubeletError::Call {
                call: "GetDevicePluginOptions",
                status,
            })?
            .into_inner();
        if !opts.pre_start_required || !opts.get_preferred_allocation_available {
            return Err(FakeKubeletError::Io(format!("unexpected options {opts:?}")));
        }
        let mut stream = c
            .list_and_watch(Empty {})
            .await
            .map_err(|status| FakeKubeletError::Call {
                call: "ListAndWatch",
                status,
            })?
            .into_inner();
        let shared = self.shared.clone();
        let notify = self.notify.clone();
        if let Some(t) = self.watch.take() {
            t.abort();
        }
        self.watch = Some(tokio::spawn(async move {
            while let Ok(Some(r)) = stream.message().await {
                lock(&shared).devices = r.devices;
                notify.notify_waiters();
            }
        }));
        Ok(c)
    }

    /// The latest device list from `ListAndWatch`.
    pub fn devices(&self) -> Vec<Device> {
        lock(&self.shared).devices.clone()
    }

    /// Waits until the device list satisfies `pred`.
    pub async fn wait_devices(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[Device]) -> bool,
    ) -> Result<Vec<Device>, FakeKubeletError> {
        let end = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.notify.notified();
            let d = self.devices();
            if pred(&d) {
                return Ok(d);
            }
            if tokio::time::timeout_at(end, notified).await.is_err() {
                return Err(FakeKubeletError::Timeout(timeout, what.to_owned()));
            }
        }
    }

    /// Simulates a kubelet restart: stops the registration server, deletes every
    /// socket in the directory, and serves a new `kubelet.sock`. Returns when it is back.
    pub fn restart(&mut self) -> Result<Instant, FakeKubeletError> {
        if let Some(t) = self.reg_server.take() {
            t.abort();
        }
        if let Some(t) = self.watch.take() {
            t.abort();
        }
        for e in std::fs::read_dir(&self.dir).map_err(io)?.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "sock") {
                let _ = std::fs::remove_file(&p);
            }
        }
        lock(&self.shared).devices.clear();
        self.reg_server = Some(serve_registration(
            &self.dir,
            self.shared.clone(),
            self.notify.clone(),
        )?);
        Ok(Instant::now())
    }

    /// Most concurrent PodResources calls seen, and the total number of calls.
    pub fn list_stats(&self) -> (usize, usize) {
        (
            self.lister.max_seen.load(Ordering::SeqCst),
            self.lister.calls.load(Ordering::Relaxed),
        )
    }

    /// Makes every `List` take this long (kubelet's worst case was 68 ms).
    pub fn set_list_delay(&self, d: Duration) {
        *lock(&self.lister.delay) = d;
    }

    /// Records devices for a regular container directly, as kubelet does after an
    /// `Allocate` (for tests that drive `Allocate` themselves).
    pub fn record(&self, namespace: &str, pod: &str, container: &str, ids: &[String]) {
        let mut sh = lock(&self.shared);
        for id in ids {
            sh.allocated.insert(
                id.clone(),
                (namespace.to_owned(), pod.to_owned(), container.to_owned()),
            );
        }
        let cs = sh
            .pods
            .entry((namespace.to_owned(), pod.to_owned()))
            .or_default();
        cs.retain(|(n, _)| n != container);
        cs.push((container.to_owned(), ids.to_vec()));
    }

    /// Removes a pod (its devices become free again).
    pub fn remove_pod(&self, namespace: &str, pod: &str) {
        let mut sh = lock(&self.shared);
        sh.pods.remove(&(namespace.to_owned(), pod.to_owned()));
        sh.allocated
            .retain(|_, (n, p, _)| !(n == namespace && p == pod));
    }

    /// Admits a pod as kubelet does: adds it to `List` (no devices yet), then for each
    /// container in order (init first) asks the plugin for a preferred allocation,
    /// allocates, and records the IDs (regular containers become visible in `List`).
    /// Pods are admitted one at a time, as kubelet's admission loop does.
    pub async fn admit(
        &self,
        client: &mut DevicePluginClient<Channel>,
        namespace: &str,
        pod: &str,
        containers: &[FakeContainer],
    ) -> Result<Admitted, FakeKubeletError> {
        let _one_at_a_time = self.admission.lock().await;
        let key = (namespace.to_owned(), pod.to_owned());
        lock(&self.shared).pods.insert(
            key.clone(),
            containers
                .iter()
                .filter(|c| !c.init || c.sidecar)
                .map(|c| (c.name.clone(), Vec::new()))
                .collect(),
        );
        let mut reusable: Vec<String> = Vec::new();
        let mut out = Admitted {
            namespace: namespace.to_owned(),
            pod: pod.to_owned(),
            containers: Vec::new(),
            timings: Vec::new(),
        };
        let mut order: Vec<&FakeContainer> = containers.iter().filter(|c| c.init).collect();
        order.extend(containers.iter().filter(|c| !c.init));
        for c in order {
            if c.slices == 0 {
                continue;
            }
            let mut pref_time = None;
            let ids = if reusable.len() >= c.slices {
                // Kubelet's `allocateRemainingFrom(reusableDevices)`: in set order.
                self.shuffled(&reusable)
                    .into_iter()
                    .take(c.slices)
                    .collect::<Vec<_>>()
            } else {
                let available: Vec<String> = {
                    let sh = lock(&self.shared);
                    sh.devices
                        .iter()
                        .filter(|d| d.health == HEALTHY && !sh.allocated.contains_key(&d.id))
                        .map(|d| d.id.clone())
                        .chain(reusable.iter().cloned())
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect()
                };
                if available.len() < c.slices {
                    self.remove_pod(namespace, pod);
                    return Err(FakeKubeletError::Io(format!(
                        "UnexpectedAdmissionError: {namespace}/{pod}: {} of vgpu.io/gpu available, {} requested",
                        available.len(),
                        c.slices
                    )));
                }
                let size = i32::try_from(c.slices).map_err(io)?;
                let t_pref = Instant::now();
                let pref = client
                    .get_preferred_allocation(PreferredAllocationRequest {
                        container_requests: vec![ContainerPreferredAllocationRequest {
                            available_device_i_ds: available.clone(),
                            must_include_device_i_ds: reusable.clone(),
                            allocation_size: size,
                        }],
                    })
                    .await
                    .map_err(|status| FakeKubeletError::Call {
                        call: "GetPreferredAllocation",
                        status,
                    })?
                    .into_inner();
                pref_time = Some(t_pref.elapsed());
                let mut ids = pref
                    .container_responses
                    .into_iter()
                    .next()
                    .map(|r| r.device_i_ds)
                    .unwrap_or_default();
                // Kubelet ignores an invalid preference and picks by itself.
                let valid = ids.len() == c.slices
                    && ids.iter().all(|i| available.contains(i))
                    && reusable.iter().all(|r| ids.contains(r));
                if !valid {
                    ids = reusable.clone();
                    for a in &available {
                        if ids.len() >= c.slices {
                            break;
                        }
                        if !ids.contains(a) {
                            ids.push(a.clone());
                        }
                    }
                }
                ids
            };
            let t_alloc = Instant::now();
            let resp = client
                .allocate(AllocateRequest {
                    container_requests: vec![ContainerAllocateRequest {
                        devices_ids: ids.clone(),
                    }],
                })
                .await
                .map_err(|status| FakeKubeletError::Call {
                    call: "Allocate",
                    status,
                })?
                .into_inner();
            let r = resp
                .container_responses
                .into_iter()
                .next()
                .ok_or_else(|| FakeKubeletError::Io("Allocate answered no container".into()))?;
            {
                let mut sh = lock(&self.shared);
                for id in &ids {
                    sh.allocated.insert(
                        id.clone(),
                        (namespace.to_owned(), pod.to_owned(), c.name.clone()),
                    );
                }
                if (!c.init || c.sidecar)
                    && let Some(cs) = sh.pods.get_mut(&key)
                    && let Some(e) = cs.iter_mut().find(|(n, _)| *n == c.name)
                {
                    e.1 = ids.clone();
                }
            }
            for id in &ids {
                if !reusable.contains(id) {
                    reusable.push(id.clone());
                }
            }
            if !c.init || c.sidecar {
                // Devices of app containers and sidecars are not reused by later containers.
                reusable.retain(|r| !ids.contains(r));
            }
            out.timings.push((pref_time, t_alloc.elapsed()));
            out.containers.push((c.name.clone(), c.init, ids, r));
        }
        Ok(out)
    }

    /// `PreStartContainer` for a container's devices.
    pub async fn prestart(
        client: &mut DevicePluginClient<Channel>,
        ids: &[String],
    ) -> Result<(), Status> {
        client
            .pre_start_container(PreStartContainerRequest {
                devices_ids: ids.to_vec(),
            })
            .await
            .map(|_| ())
    }
}
