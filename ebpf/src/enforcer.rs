//! Loads the programs, attaches the gate to a cgroup2 directory and the exit watcher to
//! `sched/sched_process_exit`, fills the maps, and detaches on drop — or, with a pin
//! directory, leaves both attached for the next daemon (ADR 0018). The gate does not need
//! tracefs; without it only the exit watcher is missing ([`Enforcer::exit_watch`]).

use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap, MapData, RingBuf};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{CgroupDevice, TracePoint};
use aya::{Ebpf, EbpfLoader};

use crate::abi::{
    ABI_VERSION, CONFIG_ABI, CONFIG_MODE, COUNTER_AUDITED, COUNTER_EXIT_LOST, COUNTER_EXITS,
    COUNTER_LOST, COUNTER_REFUSED, DevKey, MAJORS, MODE_AUDIT, MODE_ENFORCE,
};
use crate::config::{EbpfConfig, GpuDevice, Mode};
use crate::error::EbpfError;
use crate::event::EventReader;
use crate::{preflight, sys};

/// The compiled programs (bpf/vgpu.bpf.c), aligned as aya's ELF parser needs.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vgpu.bpf.o"));

const GATE: &str = "vgpu_gate";
const EXIT: &str = "vgpu_exit";
const GATE_LINK: &str = "gate_link";
const EXIT_LINK: &str = "exit_link";
const EXEC: &str = "vgpu_exec";
const EXEC_LINK: &str = "exec_link";
/// Every map of the object; all are pinned when a pin directory is configured.
const MAPS: [&str; 9] = [
    "vgpu_gpu_devices",
    "vgpu_gpu_majors",
    "vgpu_allowed_tgids",
    "vgpu_trusted_cgroups",
    "vgpu_watched_tgids",
    "vgpu_config",
    "vgpu_counters",
    "vgpu_events",
    "vgpu_exit_events",
];

/// Counters kept by the programs since the maps were created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Gate events dropped because their ring buffer was full.
    pub lost: u64,
    /// GPU opens refused.
    pub refused: u64,
    /// GPU opens allowed only because the mode is audit.
    pub audited: u64,
    /// Exit events emitted.
    pub exits: u64,
    /// Exit events dropped because their ring buffer was full.
    pub exit_lost: u64,
}

/// The attached programs and their maps.
pub struct Enforcer {
    devices: HashMap<MapData, DevKey, u8>,
    majors: Array<MapData, u8>,
    allowed: HashMap<MapData, u32, u8>,
    trusted: HashMap<MapData, u64, u8>,
    watched: HashMap<MapData, u32, u8>,
    config: Array<MapData, u32>,
    counters: Array<MapData, u64>,
    events: Option<RingBuf<MapData>>,
    exit_events: Option<RingBuf<MapData>>,
    /// Closing it detaches the gate unless it is pinned.
    gate_link: Option<OwnedFd>,
    /// Why the exit and exec tracepoints are not attached (no tracefs, or the attach
    /// failed); `None` when they are.
    exit_watch_missing: Option<String>,
    /// Pinned tracepoint links (unpinned links live in `ebpf` and detach with it).
    tracepoint_pins: Vec<PinnedLink>,
    /// `<pin_dir>/v<ABI_VERSION>` when pinning.
    pins: Option<PathBuf>,
    mode: Mode,
    /// Owns the programs (and unpinned links): dropped last.
    ebpf: Ebpf,
}

impl std::fmt::Debug for Enforcer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Enforcer")
            .field("mode", &self.mode)
            .field("pins", &self.pins)
            .field("gate_attached", &self.gate_link.is_some())
            .finish_non_exhaustive()
    }
}

fn map_error(
    map: &'static str,
    operation: String,
) -> impl FnOnce(aya::maps::MapError) -> EbpfError {
    move |source| EbpfError::Map {
        map,
        operation,
        source,
    }
}

fn program_error(
    program: &'static str,
    operation: &'static str,
) -> impl FnOnce(aya::programs::ProgramError) -> EbpfError {
    move |source| EbpfError::Program {
        program,
        operation,
        source,
    }
}

fn take_map<V>(ebpf: &mut Ebpf, name: &'static str) -> Result<V, EbpfError>
where
    V: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(EbpfError::Missing(name))?;
    V::try_from(map).map_err(map_error(name, "open".to_owned()))
}

fn io_error(operation: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> EbpfError {
    let path = path.to_owned();
    move |source| EbpfError::Io {
        operation,
        path,
        source,
    }
}

impl Enforcer {
    /// Checks the node, loads the programs, fills the device map and attaches both programs.
    /// With `config.pin_dir`, maps already pinned there (by an earlier daemon) are reused and
    /// the new links replace the pinned ones without a gap.
    pub fn attach(config: &EbpfConfig, gpu_devices: &[GpuDevice]) -> Result<Self, EbpfError> {
        if config.mode == Mode::Off {
            return Err(EbpfError::ModeOff);
        }
        preflight::check_capabilities()?;
        preflight::check_btf()?;
        preflight::check_cgroup2(&config.cgroup_root)?;
        // tracefs is needed by the exit and exec tracepoints only: without it the gate
        // still attaches (issue 39: enforcement requested is enforcement delivered), and
        // the exit watcher is reported missing (`Enforcer::exit_watch`).
        let tracefs = preflight::check_tracefs();
        let pins = match &config.pin_dir {
            Some(dir) => Some(prepare_pin_dir(dir)?),
            None => None,
        };

        let map_pins: Vec<(&str, PathBuf)> = match &pins {
            Some(dir) => MAPS.iter().map(|name| (*name, dir.join(name))).collect(),
            None => Vec::new(),
        };
        let mut loader = EbpfLoader::new();
        for (name, path) in &map_pins {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader.load(OBJECT).map_err(EbpfError::Load)?;
        let mut enforcer = Self {
            devices: take_map(&mut ebpf, "vgpu_gpu_devices")?,
            majors: take_map(&mut ebpf, "vgpu_gpu_majors")?,
            allowed: take_map(&mut ebpf, "vgpu_allowed_tgids")?,
            trusted: take_map(&mut ebpf, "vgpu_trusted_cgroups")?,
            watched: take_map(&mut ebpf, "vgpu_watched_tgids")?,
            config: take_map(&mut ebpf, "vgpu_config")?,
            counters: take_map(&mut ebpf, "vgpu_counters")?,
            events: Some(take_map(&mut ebpf, "vgpu_events")?),
            exit_events: Some(take_map(&mut ebpf, "vgpu_exit_events")?),
            gate_link: None,
            exit_watch_missing: None,
            tracepoint_pins: Vec::new(),
            pins,
            mode: config.mode,
            ebpf,
        };
        enforcer
            .config
            .set(CONFIG_ABI, ABI_VERSION, 0)
            .map_err(map_error(
                "vgpu_config",
                format!("set abi version {ABI_VERSION}"),
            ))?;
        enforcer.set_mode(config.mode)?;
        enforcer.set_gpu_devices(gpu_devices)?;

        // The tracepoints first: if the gate then fails to attach, nothing that refuses
        // opens is left behind (pinned tracepoints only forget dead processes). Without
        // them the gate still runs: the exit watcher is reported missing, not fatal.
        match tracefs {
            Ok(()) => {
                for (program, event, link_name) in [
                    (EXIT, "sched_process_exit", EXIT_LINK),
                    (EXEC, "sched_process_exec", EXEC_LINK),
                ] {
                    if let Err(error) = enforcer.attach_tracepoint(program, event, link_name) {
                        enforcer.exit_watch_missing = Some(error.to_string());
                        break;
                    }
                }
            }
            Err(error) => enforcer.exit_watch_missing = Some(error.to_string()),
        }
        match &enforcer.exit_watch_missing {
            None => tracing::info!(
                "ebpf: process-exit watcher attached (tracepoints sched/sched_process_exit, \
                 sched/sched_process_exec)"
            ),
            Some(why) => tracing::warn!(
                "ebpf: process-exit watcher not attached ({why}): the gate runs without exit \
                 and exec events"
            ),
        }
        // The gate last, now that the maps say what to guard and how.
        let gate: &mut CgroupDevice = enforcer
            .ebpf
            .program_mut(GATE)
            .ok_or(EbpfError::Missing(GATE))?
            .try_into()
            .map_err(program_error(GATE, "look up"))?;
        gate.load().map_err(program_error(GATE, "load"))?;
        let gate_fd = gate.fd().map_err(program_error(GATE, "get fd"))?;
        let link = sys::cgroup_device_link(gate_fd, &config.cgroup_root)?;
        if let Some(dir) = &enforcer.pins {
            replace_pin(&link, &dir.join(GATE_LINK))?;
        }
        enforcer.gate_link = Some(link);
        tracing::info!(
            mode = ?config.mode,
            cgroup = %config.cgroup_root.display(),
            pinned = enforcer.pins.is_some(),
            "ebpf: GPU device gate attached (cgroup/dev)"
        );

        Ok(enforcer)
    }

    /// Loads `program` and attaches it to `sched/<event>`, pinning the link as `link_name`
    /// when pinning.
    fn attach_tracepoint(
        &mut self,
        program: &'static str,
        event: &'static str,
        link_name: &str,
    ) -> Result<(), EbpfError> {
        let tracepoint: &mut TracePoint = self
            .ebpf
            .program_mut(program)
            .ok_or(EbpfError::Missing(program))?
            .try_into()
            .map_err(program_error(program, "look up"))?;
        tracepoint.load().map_err(program_error(program, "load"))?;
        let link_id = tracepoint
            .attach("sched", event)
            .map_err(program_error(program, "attach to its sched tracepoint"))?;
        let Some(dir) = &self.pins else { return Ok(()) };
        let link = tracepoint
            .take_link(link_id)
            .map_err(program_error(program, "take link"))?;
        let link = FdLink::try_from(link).map_err(|source| EbpfError::Syscall {
            command: "BPF_LINK_CREATE",
            what: format!("{program} link to pin (not a bpf link on this kernel)"),
            source: std::io::Error::other(source),
        })?;
        let path = dir.join(link_name);
        let temporary = with_new_suffix(&path);
        let _ = std::fs::remove_file(&temporary);
        let pinned = link.pin(&temporary).map_err(|source| EbpfError::Syscall {
            command: "BPF_OBJ_PIN",
            what: temporary.display().to_string(),
            source: std::io::Error::other(source),
        })?;
        std::fs::rename(&temporary, &path).map_err(io_error("replace pinned link", &path))?;
        self.tracepoint_pins.push(pinned);
        Ok(())
    }

    /// The mode the gate runs in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether the exit watcher (the exit and exec tracepoints) is attached: `Err` says
    /// why not (the gate runs without it: admitted PIDs are not forgotten at exit or exec
    /// by the kernel, so the daemon must forget them itself).
    pub fn exit_watch(&self) -> Result<(), &str> {
        match &self.exit_watch_missing {
            None => Ok(()),
            Some(why) => Err(why),
        }
    }

    /// Switches between audit and enforce without detaching.
    pub fn set_mode(&mut self, mode: Mode) -> Result<(), EbpfError> {
        let value = match mode {
            Mode::Off => return Err(EbpfError::ModeOff),
            Mode::Audit => MODE_AUDIT,
            Mode::Enforce => MODE_ENFORCE,
        };
        self.config
            .set(CONFIG_MODE, value, 0)
            .map_err(map_error("vgpu_config", format!("set mode {mode:?}")))?;
        self.mode = mode;
        Ok(())
    }

    /// Makes `devices` exactly the set the gate guards. A major of 4096 or more (not a
    /// Linux device number) is refused naming it.
    pub fn set_gpu_devices(&mut self, devices: &[GpuDevice]) -> Result<(), EbpfError> {
        if let Some(device) = devices.iter().find(|device| device.major >= MAJORS) {
            return Err(EbpfError::BadMajor(device.major));
        }
        let wanted: Vec<DevKey> = devices
            .iter()
            .map(|device| DevKey {
                major: device.major,
                minor: device.key_minor(),
            })
            .collect();
        let old_majors: Vec<u32> = self
            .devices
            .keys()
            .filter_map(Result::ok)
            .map(|key| key.major)
            .collect();
        // Majors on first, so that the new keys are consulted as soon as they are in.
        for key in &wanted {
            self.majors.set(key.major, 1, 0).map_err(map_error(
                "vgpu_gpu_majors",
                format!("set major {}", key.major),
            ))?;
        }
        for key in &wanted {
            self.devices.insert(key, 1, 0).map_err(map_error(
                "vgpu_gpu_devices",
                format!("insert {}:{:#x}", key.major, key.minor),
            ))?;
        }
        let stale: Vec<DevKey> = self
            .devices
            .keys()
            .filter_map(Result::ok)
            .filter(|key| !wanted.contains(key))
            .collect();
        for key in stale {
            self.devices.remove(&key).map_err(map_error(
                "vgpu_gpu_devices",
                format!("remove {}:{:#x}", key.major, key.minor),
            ))?;
        }
        for major in old_majors {
            if !wanted.iter().any(|key| key.major == major) {
                self.majors
                    .set(major, 0, 0)
                    .map_err(map_error("vgpu_gpu_majors", format!("clear major {major}")))?;
            }
        }
        Ok(())
    }

    /// Lets process `tgid` (initial pid namespace) open GPU nodes, and watches its exit; the
    /// exit program forgets it when its last thread exits.
    pub fn allow_tgid(&mut self, tgid: u32) -> Result<(), EbpfError> {
        self.allowed.insert(tgid, 1, 0).map_err(map_error(
            "vgpu_allowed_tgids",
            format!("insert pid {tgid}"),
        ))
    }

    /// Withdraws what [`Enforcer::allow_tgid`] gave; a pid that is not there is no error.
    pub fn forget_tgid(&mut self, tgid: u32) -> Result<(), EbpfError> {
        remove_if_present(&mut self.allowed, "vgpu_allowed_tgids", tgid)?;
        remove_if_present(&mut self.watched, "vgpu_watched_tgids", tgid)
    }

    /// Reports the exit of process `tgid` without granting it anything.
    pub fn watch_tgid(&mut self, tgid: u32) -> Result<(), EbpfError> {
        self.watched.insert(tgid, 1, 0).map_err(map_error(
            "vgpu_watched_tgids",
            format!("insert pid {tgid}"),
        ))
    }

    /// Whether `tgid` is registered (it is removed by the kernel when the process exits).
    pub fn is_allowed(&self, tgid: u32) -> bool {
        self.allowed.get(&tgid, 0).is_ok()
    }

    /// Lets every process of the cgroup with id `cgroup_id` open GPU nodes (node agents).
    pub fn trust_cgroup(&mut self, cgroup_id: u64) -> Result<(), EbpfError> {
        self.trusted.insert(cgroup_id, 1, 0).map_err(map_error(
            "vgpu_trusted_cgroups",
            format!("insert cgroup id {cgroup_id}"),
        ))
    }

    /// Withdraws the trust given by [`Enforcer::trust_cgroup`].
    pub fn distrust_cgroup(&mut self, cgroup_id: u64) -> Result<(), EbpfError> {
        remove_if_present(&mut self.trusted, "vgpu_trusted_cgroups", cgroup_id)
    }

    /// The counters the programs keep.
    pub fn counters(&self) -> Result<Counters, EbpfError> {
        let read = |index: u32| {
            self.counters
                .get(&index, 0)
                .map_err(map_error("vgpu_counters", format!("read index {index}")))
        };
        Ok(Counters {
            lost: read(COUNTER_LOST)?,
            refused: read(COUNTER_REFUSED)?,
            audited: read(COUNTER_AUDITED)?,
            exits: read(COUNTER_EXITS)?,
            exit_lost: read(COUNTER_EXIT_LOST)?,
        })
    }

    /// The reader of gate events, refused and audited opens (once; `None` after).
    pub fn take_gate_events(&mut self) -> Option<EventReader> {
        self.events.take().map(EventReader::new)
    }

    /// The reader of exit events (once; `None` after). A ring buffer of its own, so that a
    /// tenant flooding the gate with refused opens cannot make an exit event be lost.
    pub fn take_exit_events(&mut self) -> Option<EventReader> {
        self.exit_events.take().map(EventReader::new)
    }

    /// Detaches both programs now and removes every pin, so nothing outlives this call.
    pub fn detach(mut self) -> Result<(), EbpfError> {
        if let Some(link) = &self.gate_link {
            sys::detach_link(link)?;
        }
        // The tracepoint links (perf links) cannot be force-detached; they go with their last
        // reference below, which only costs a few more tracepoint hits.
        let pins = self.pins.take();
        drop(self);
        match pins {
            Some(dir) => remove_pin_dir(&dir),
            None => Ok(()),
        }
    }
}

/// Detaches what a pinning daemon left under `pin_dir` (every ABI version) and removes the
/// pins: for `--ebpf off` after a pinned run, and for tests.
pub fn remove_pins(pin_dir: &Path) -> Result<(), EbpfError> {
    let entries = match std::fs::read_dir(pin_dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(io_error("list pin directory", pin_dir)(source)),
    };
    for entry in entries {
        let entry = entry.map_err(io_error("list pin directory", pin_dir))?;
        let path = entry.path();
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with('v') || name.to_string_lossy().contains('.') {
            continue;
        }
        let gate = path.join(GATE_LINK);
        if gate.exists() {
            sys::detach_link(sys::pinned(&gate)?)?;
        }
        remove_pin_dir(&path)?;
    }
    Ok(())
}

/// The cgroup v2 id of a cgroup2 directory (its inode number), as the programs report it.
pub fn cgroup_id(dir: &Path) -> Result<u64, EbpfError> {
    preflight::check_cgroup2(dir)?;
    Ok(std::fs::metadata(dir)
        .map_err(io_error("stat cgroup directory", dir))?
        .ino())
}

/// The cgroup2 directory under `root` whose id is `id` (an event's `cgroup_id`), walking the
/// tree; `None` when no directory has it (the cgroup was removed since).
pub fn find_cgroup(root: &Path, id: u64) -> Result<Option<PathBuf>, EbpfError> {
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        match std::fs::metadata(&dir) {
            Ok(metadata) if metadata.ino() == id => return Ok(Some(dir)),
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(io_error("stat cgroup directory", &dir)(source)),
        }
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(io_error("list cgroup directory", &dir)(source)),
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                pending.push(entry.path());
            }
        }
    }
    Ok(None)
}

fn remove_if_present<K: aya::Pod + std::fmt::Display>(
    map: &mut HashMap<MapData, K, u8>,
    name: &'static str,
    key: K,
) -> Result<(), EbpfError> {
    match map.remove(&key) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(error))
            if error.io_error.kind() == std::io::ErrorKind::NotFound =>
        {
            Ok(())
        }
        Err(source) => Err(EbpfError::Map {
            map: name,
            operation: format!("remove {key}"),
            source,
        }),
    }
}

/// Creates `<pin_dir>/v<ABI_VERSION>` after checking that it lies on a bpf file system.
fn prepare_pin_dir(pin_dir: &Path) -> Result<PathBuf, EbpfError> {
    let mounts_path = Path::new("/proc/self/mounts");
    let mounts =
        std::fs::read_to_string(mounts_path).map_err(io_error("read mount table", mounts_path))?;
    let absolute =
        std::path::absolute(pin_dir).map_err(io_error("resolve pin directory", pin_dir))?;
    if !preflight::on_bpffs(&mounts, &absolute) {
        return Err(EbpfError::NotBpffs(pin_dir.to_owned()));
    }
    let dir = absolute.join(format!("v{ABI_VERSION}"));
    std::fs::create_dir_all(&dir).map_err(io_error("create pin directory", &dir))?;
    Ok(dir)
}

/// Pins `fd` at `path`, replacing an earlier pin atomically (rename on the bpf file system),
/// so the link it replaces detaches only once the new one is in place.
/// The gate link it replaces is then detached at once (not after an RCU period), so no
/// open is judged twice.
fn replace_pin(fd: &OwnedFd, path: &Path) -> Result<(), EbpfError> {
    let previous = if path.exists() {
        Some(sys::pinned(path)?)
    } else {
        None
    };
    let temporary = with_new_suffix(path);
    let _ = std::fs::remove_file(&temporary);
    sys::pin(fd, &temporary)?;
    std::fs::rename(&temporary, path).map_err(io_error("replace pinned link", path))?;
    match previous {
        Some(previous) => sys::detach_link(previous),
        None => Ok(()),
    }
}

/// `<path>_new`: bpffs refuses names with a dot (reserved for its own files).
fn with_new_suffix(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push("_new");
    PathBuf::from(name)
}

fn remove_pin_dir(dir: &Path) -> Result<(), EbpfError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(io_error("remove pin directory", dir)(source)),
    }
}
