//! The node's GPUs and their health, from NVML.
//!
//! A GPU is unhealthy while NVML does not answer for it (fallen off the bus: `GPU_IS_LOST`)
//! or, after an XID critical error (other than the ignored ones) or a double-bit ECC
//! error, until `health_recovery` has passed without another such event. It then becomes
//! healthy again by itself (NVIDIA's plugin cannot). Single-bit (corrected) ECC errors
//! are logged only. Every change is published as the full list of GPUs on a
//! `tokio::sync::watch` channel that `ListAndWatch` streams from.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use tokio::sync::watch;
use tracing::{debug, info, warn};
use vgpu_core::inventory::GpuInfo;

use crate::config::Config;

/// Why the GPUs could not be discovered.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// NVML could not be loaded or initialised.
    #[error("load NVML from {lib}")]
    Init {
        /// The library tried.
        lib: String,
        /// NVML's error.
        #[source]
        source: NvmlError,
    },
    /// A query of one GPU failed during discovery.
    #[error("query GPU {index}: {what}")]
    Query {
        /// NVML index.
        index: u32,
        /// The query.
        what: &'static str,
        /// NVML's error.
        #[source]
        source: NvmlError,
    },
    /// A GPU UUID does not fit in a device ID.
    #[error("GPU {index}")]
    Id {
        /// NVML index.
        index: u32,
        /// The problem.
        #[source]
        source: crate::ids::IdError,
    },
    /// The monitor thread ended before reporting the inventory.
    #[error("the NVML monitor thread ended during discovery")]
    Thread,
}

/// What made a GPU unhealthy, as the monitor sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// An XID critical error with this code.
    Xid(u64),
    /// A double-bit (uncorrected) ECC error.
    DoubleBitEcc,
}

#[derive(Debug, Clone, Default)]
struct DevState {
    last_fault: Option<Instant>,
    unresponsive: bool,
}

/// The health policy, separate from NVML so that it can be tested alone.
#[derive(Debug, Clone)]
pub struct HealthTracker {
    ignored_xids: BTreeSet<u64>,
    recovery: Option<Duration>,
    devs: Vec<DevState>,
}

impl HealthTracker {
    /// A tracker for `n` GPUs, all healthy.
    pub fn new(n: usize, ignored_xids: BTreeSet<u64>, recovery: Option<Duration>) -> Self {
        HealthTracker {
            ignored_xids,
            recovery,
            devs: vec![DevState::default(); n],
        }
    }

    /// Records a fault event on GPU `idx`; returns whether it counts (not ignored).
    pub fn on_fault(&mut self, idx: usize, fault: Fault, now: Instant) -> bool {
        if let Fault::Xid(x) = fault
            && self.ignored_xids.contains(&x)
        {
            return false;
        }
        if let Some(d) = self.devs.get_mut(idx) {
            d.last_fault = Some(now);
            return true;
        }
        false
    }

    /// Records whether GPU `idx` answered NVML.
    pub fn on_poll(&mut self, idx: usize, responsive: bool) {
        if let Some(d) = self.devs.get_mut(idx) {
            d.unresponsive = !responsive;
        }
    }

    /// Whether GPU `idx` is healthy at `now`.
    pub fn healthy(&self, idx: usize, now: Instant) -> bool {
        let Some(d) = self.devs.get(idx) else {
            return false;
        };
        if d.unresponsive {
            return false;
        }
        match (d.last_fault, self.recovery) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(t), Some(r)) => now.duration_since(t) >= r,
        }
    }
}

/// Loads NVML (`lib`, or the system's `libnvidia-ml.so.1`), lists the GPUs and starts a
/// thread that keeps their health current. The channel holds the full list; the thread
/// ends when every receiver is gone.
pub fn spawn_nvml_monitor(
    cfg: &Config,
    lib: Option<PathBuf>,
) -> Result<watch::Receiver<Vec<GpuInfo>>, HealthError> {
    let ignored = cfg.ignored_xids.clone();
    let recovery = cfg.health_recovery;
    let poll = cfg.health_poll;
    let (init_tx, init_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("vgpu-nvml-health".into())
        .spawn(move || monitor(lib, ignored, recovery, poll, init_tx))
        .map_err(|_| HealthError::Thread)?;
    init_rx.recv().map_err(|_| HealthError::Thread)?
}

type InitResult = Result<watch::Receiver<Vec<GpuInfo>>, HealthError>;

fn discover(nvml: &Nvml) -> Result<Vec<GpuInfo>, HealthError> {
    let n = nvml.device_count().map_err(|source| HealthError::Query {
        index: 0,
        what: "device count",
        source,
    })?;
    let mut gpus = Vec::new();
    for index in 0..n {
        let q = |what| {
            move |source| HealthError::Query {
                index,
                what,
                source,
            }
        };
        let d = nvml.device_by_index(index).map_err(q("handle"))?;
        let uuid = d.uuid().map_err(q("uuid"))?;
        crate::ids::check_uuid(&uuid).map_err(|source| HealthError::Id { index, source })?;
        let model = d.name().map_err(q("name"))?;
        let mem = d.memory_info().map_err(q("memory"))?;
        gpus.push(GpuInfo {
            index,
            uuid,
            model,
            memory_mib: mem.total >> 20,
            healthy: true,
            topology: None,
        });
    }
    for (g, t) in gpus.iter_mut().zip(crate::topology::discover(nvml, n)) {
        g.topology = t;
    }
    Ok(gpus)
}

fn monitor(
    lib: Option<PathBuf>,
    ignored: BTreeSet<u64>,
    recovery: Option<Duration>,
    poll: Duration,
    init_tx: mpsc::Sender<InitResult>,
) {
    let builder_lib = lib
        .clone()
        .unwrap_or_else(|| PathBuf::from("libnvidia-ml.so.1"));
    let nvml = match Nvml::builder().lib_path(builder_lib.as_os_str()).init() {
        Ok(n) => n,
        Err(source) => {
            let _ = init_tx.send(Err(HealthError::Init {
                lib: builder_lib.display().to_string(),
                source,
            }));
            return;
        }
    };
    let mut gpus = match discover(&nvml) {
        Ok(g) => g,
        Err(e) => {
            let _ = init_tx.send(Err(e));
            return;
        }
    };
    info!(gpus = gpus.len(), "NVML: GPUs discovered");
    let (tx, rx) = watch::channel(gpus.clone());
    if init_tx.send(Ok(rx)).is_err() {
        return;
    }
    let mut set = match nvml.create_event_set() {
        Ok(s) => Some(s),
        Err(e) => {
            warn!(error = %e, "NVML: no event set; health from polling only");
            None
        }
    };
    for g in &gpus {
        let Ok(d) = nvml.device_by_index(g.index) else {
            continue;
        };
        if let Some(s) = set.take() {
            let types = EventTypes::CRITICAL_XID_ERROR
                | EventTypes::DOUBLE_BIT_ECC_ERROR
                | EventTypes::SINGLE_BIT_ECC_ERROR;
            match d.register_events(types, s) {
                Ok(s) => set = Some(s),
                Err(e) => {
                    warn!(gpu = %g.uuid, error = %e.error, "NVML: cannot register health events");
                    set = nvml.create_event_set().ok();
                }
            }
        }
    }
    let mut tracker = HealthTracker::new(gpus.len(), ignored, recovery);
    let poll_ms = u32::try_from(poll.as_millis()).unwrap_or(u32::MAX).max(1);
    let mut last_poll = Instant::now();
    while !tx.is_closed() {
        match &set {
            Some(s) => match s.wait(poll_ms) {
                Ok(ev) => {
                    let idx = ev.device.index().ok().map(|i| i as usize);
                    let fault = if ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                        Some(Fault::Xid(match ev.event_data {
                            Some(XidError::Value(v)) => v,
                            _ => 999,
                        }))
                    } else if ev.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                        Some(Fault::DoubleBitEcc)
                    } else {
                        debug!(?idx, "NVML: corrected (single-bit) ECC error");
                        None
                    };
                    if let (Some(idx), Some(fault)) = (idx, fault) {
                        let counts = tracker.on_fault(idx, fault, Instant::now());
                        let uuid = gpus.get(idx).map(|g| g.uuid.as_str()).unwrap_or("?");
                        if counts {
                            warn!(gpu = %uuid, ?fault, "GPU fault: unhealthy");
                        } else {
                            info!(gpu = %uuid, ?fault, "ignored XID (application error)");
                        }
                    }
                }
                Err(NvmlError::Timeout) => {}
                Err(e) => {
                    debug!(error = %e, "NVML: event wait failed");
                    std::thread::sleep(poll);
                }
            },
            None => std::thread::sleep(poll),
        }
        let now = Instant::now();
        if now.duration_since(last_poll) >= poll || set.is_none() {
            last_poll = now;
            for (i, g) in gpus.iter().enumerate() {
                let ok = nvml
                    .device_by_index(g.index)
                    .and_then(|d| d.memory_info())
                    .is_ok();
                tracker.on_poll(i, ok);
            }
        }
        let mut changed = false;
        for (i, g) in gpus.iter_mut().enumerate() {
            let h = tracker.healthy(i, now);
            if h != g.healthy {
                g.healthy = h;
                changed = true;
                info!(gpu = %g.uuid, healthy = h, "GPU health changed");
            }
        }
        if changed {
            tx.send_replace(gpus.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_recover_and_ignored_xids_do_nothing() {
        let ignored = crate::config::DEFAULT_IGNORED_XIDS.into_iter().collect();
        let mut t = HealthTracker::new(2, ignored, Some(Duration::from_secs(10)));
        let t0 = Instant::now();
        assert!(!t.on_fault(0, Fault::Xid(13), t0));
        assert!(t.healthy(0, t0));
        assert!(t.on_fault(0, Fault::Xid(48), t0));
        assert!(!t.healthy(0, t0 + Duration::from_secs(9)));
        assert!(t.healthy(0, t0 + Duration::from_secs(10)));
        assert!(t.healthy(1, t0));
        t.on_poll(1, false);
        assert!(!t.healthy(1, t0));
        t.on_poll(1, true);
        assert!(t.healthy(1, t0));
        let mut never = HealthTracker::new(1, BTreeSet::new(), None);
        never.on_fault(0, Fault::DoubleBitEcc, t0);
        assert!(!never.healthy(0, t0 + Duration::from_secs(3600)));
    }
}
