//! The NVML watcher: a blocking thread that reads every GPU through NVML (the
//! `nvml-wrapper` crate) at start and then every interval, and hands the readings to
//! [`Daemon::record_observations`]. [`Daemon::snapshot`] reconciles them with the shims'
//! registrations: a process using GPU memory whose host PID no shim registered is a
//! bypass. The watcher logs each new bypass PID once.
//!
//! NVML is optional: if it cannot be loaded or initialised the watcher says so once and
//! retries every [`WatcherConfig::retry`]; the daemon schedules without it (the shims
//! report memory themselves). If NVML stops answering, the watcher drops it and
//! re-initialises; the last readings stay, with their timestamp.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use tracing::{debug, info, warn};

use crate::daemon::Daemon;
use crate::model::GpuObservation;

/// NVML's soname: what the watcher loads unless told otherwise.
pub const DEFAULT_LIB: &str = "libnvidia-ml.so.1";

/// The watcher's settings.
#[derive(Debug, Clone)]
pub struct WatcherConfig {
    /// The NVML library: a soname (searched like `dlopen` does) or a path.
    pub lib: OsString,
    /// Time between two readings.
    pub interval: Duration,
    /// Time between two attempts to initialise NVML.
    pub retry: Duration,
    /// The second line's policy (ADR 0039), run on every reading.
    pub second_line: crate::second_line::Policy,
}

impl Default for WatcherConfig {
    fn default() -> Self {
        WatcherConfig {
            lib: DEFAULT_LIB.into(),
            interval: Duration::from_millis(1000),
            retry: Duration::from_secs(10),
            second_line: crate::second_line::Policy::default(),
        }
    }
}

/// The running watcher; dropping it (or [`Watcher::stop`]) ends the thread within one
/// interval.
#[derive(Debug)]
pub struct Watcher {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts the watcher thread.
pub fn spawn(daemon: Arc<Daemon>, cfg: WatcherConfig) -> std::io::Result<Watcher> {
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("vgpu-nvml".into())
        .spawn(move || run(&daemon, &cfg, &rx))?;
    Ok(Watcher {
        stop: Some(tx),
        thread: Some(thread),
    })
}

/// Waits `d`; false if the watcher was told to stop.
fn pause(stop: &mpsc::Receiver<()>, d: Duration) -> bool {
    matches!(stop.recv_timeout(d), Err(RecvTimeoutError::Timeout))
}

fn run(daemon: &Daemon, cfg: &WatcherConfig, stop: &mpsc::Receiver<()>) {
    let lib = cfg.lib.to_string_lossy().into_owned();
    let mut init_failed_before = false;
    let mut bypass = BypassTracker::default();
    let mut second_line = crate::second_line::Enforcer::default();
    let grace = cfg.second_line.grace_for(cfg.interval);
    loop {
        let nvml = match Nvml::builder().lib_path(&cfg.lib).init() {
            Ok(n) => n,
            Err(e) => {
                if init_failed_before {
                    debug!(lib, "NVML still unavailable: {e}");
                } else {
                    warn!(
                        lib,
                        retry_s = cfg.retry.as_secs_f64(),
                        "NVML unavailable ({e}): scheduling continues without GPU \
                         observations; retrying"
                    );
                    init_failed_before = true;
                }
                if !pause(stop, cfg.retry) {
                    return;
                }
                continue;
            }
        };
        init_failed_before = false;
        match nvml.device_count() {
            Ok(n) => info!(lib, gpus = n, "NVML watcher started"),
            Err(e) => warn!(lib, "NVML device count: {e}"),
        }
        let mut errors = ErrorLog::default();
        loop {
            let before = daemon.registered_pids();
            match observe(&nvml, &mut errors) {
                Ok(obs) => {
                    // Registered before the reading or after it: a process that exits
                    // meanwhile is in the reading, and is not a bypass.
                    let mut registered = before;
                    registered.extend(daemon.registered_pids());
                    for (pid, uuid, bytes) in bypass.update(&obs, &registered) {
                        warn!(
                            pid,
                            gpu = %uuid,
                            used_bytes = bytes,
                            "bypass: a process uses GPU memory but no shim registered it"
                        );
                    }
                    second_line.check(daemon, &obs, &cfg.second_line, grace);
                    daemon.record_observations(obs, registered);
                }
                Err(e) => {
                    warn!(lib, "NVML stopped answering ({e}): re-initialising");
                    break;
                }
            }
            if !pause(stop, cfg.interval) {
                return;
            }
        }
        drop(nvml);
        if !pause(stop, cfg.retry) {
            return;
        }
    }
}

/// Logs a per-device query failure once until that query succeeds again.
#[derive(Debug, Default)]
struct ErrorLog {
    failing: HashSet<(u32, &'static str)>,
}

impl ErrorLog {
    fn check<T>(&mut self, index: u32, what: &'static str, r: Result<T, NvmlError>) -> Option<T> {
        match r {
            Ok(v) => {
                self.failing.remove(&(index, what));
                Some(v)
            }
            Err(NvmlError::NotSupported) if what == "utilization" => None,
            Err(e) => {
                if self.failing.insert((index, what)) {
                    warn!(index, "NVML {what} of GPU {index}: {e}");
                }
                None
            }
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Reads every GPU. Fails only if NVML cannot even count them; a GPU whose handle or
/// UUID cannot be read is left out, a field that cannot be read is empty (logged once).
fn observe(nvml: &Nvml, errors: &mut ErrorLog) -> Result<Vec<GpuObservation>, NvmlError> {
    let n = nvml.device_count()?;
    let now = unix_ms();
    let mut out = Vec::with_capacity(n as usize);
    for index in 0..n {
        let Some(d) = errors.check(index, "handle", nvml.device_by_index(index)) else {
            continue;
        };
        let Some(uuid) = errors.check(index, "UUID", d.uuid()) else {
            continue;
        };
        let name = errors.check(index, "name", d.name()).unwrap_or_default();
        let (memory_total, memory_used) = errors
            .check(index, "memory", d.memory_info())
            .map_or((0, 0), |m| (m.total, m.used));
        let utilization_pct = errors
            .check(index, "utilization", d.utilization_rates())
            .map(|u| u.gpu);
        let processes = errors
            .check(index, "processes", d.running_compute_processes())
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => b,
                    UsedGpuMemory::Unavailable => 0,
                };
                (p.pid, used)
            })
            .collect();
        out.push(GpuObservation {
            uuid,
            index,
            name,
            memory_total,
            memory_used,
            utilization_pct,
            processes,
            observed_unix_ms: now,
        });
    }
    Ok(out)
}

/// Which bypass PIDs have been logged. A PID is logged when it has been a bypass in two
/// consecutive readings (a process that registers with the daemon just after creating
/// its context is not one), once; it may be logged again after it has stopped being one.
#[derive(Debug, Default)]
pub struct BypassTracker {
    /// Bypasses of the previous reading.
    candidates: HashSet<u32>,
    /// Already logged.
    logged: HashSet<u32>,
}

impl BypassTracker {
    /// Takes a reading and the registered PIDs; returns the bypasses to log now:
    /// (PID, GPU UUID, bytes used on that GPU).
    pub fn update(
        &mut self,
        obs: &[GpuObservation],
        registered: &HashMap<u32, String>,
    ) -> Vec<(u32, String, u64)> {
        let mut now: HashSet<u32> = HashSet::new();
        let mut fresh = Vec::new();
        for o in obs {
            for &(pid, bytes) in &o.processes {
                if registered.contains_key(&pid) {
                    continue;
                }
                now.insert(pid);
                if self.candidates.contains(&pid) && !self.logged.contains(&pid) {
                    fresh.push((pid, o.uuid.clone(), bytes));
                }
            }
        }
        for (pid, _, _) in &fresh {
            self.logged.insert(*pid);
        }
        self.logged.retain(|p| now.contains(p));
        self.candidates = now;
        fresh
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(procs: &[(u32, u64)]) -> Vec<GpuObservation> {
        vec![GpuObservation {
            uuid: "GPU-a".into(),
            processes: procs.to_vec(),
            ..GpuObservation::default()
        }]
    }

    #[test]
    fn bypass_logged_once_after_two_readings() {
        let mut t = BypassTracker::default();
        let mut reg = HashMap::new();
        reg.insert(10, "t".to_owned());
        assert!(t.update(&obs(&[(10, 1), (20, 5)]), &reg).is_empty());
        assert_eq!(
            t.update(&obs(&[(10, 1), (20, 5)]), &reg),
            vec![(20, "GPU-a".to_owned(), 5)]
        );
        assert!(t.update(&obs(&[(10, 1), (20, 5)]), &reg).is_empty());
        // Gone, then back: logged again.
        assert!(t.update(&obs(&[(10, 1)]), &reg).is_empty());
        assert!(t.update(&obs(&[(20, 5)]), &reg).is_empty());
        assert_eq!(t.update(&obs(&[(20, 5)]), &reg).len(), 1);
    }

    #[test]
    fn late_registration_is_not_a_bypass() {
        let mut t = BypassTracker::default();
        let mut reg = HashMap::new();
        assert!(t.update(&obs(&[(30, 1)]), &reg).is_empty());
        reg.insert(30, "t".to_owned());
        assert!(t.update(&obs(&[(30, 1)]), &reg).is_empty());
        assert!(t.update(&obs(&[(30, 1)]), &reg).is_empty());
    }
}
