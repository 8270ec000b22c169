//! The shim's configuration: read from the environment once, validated, no I/O here;
//! then held to the container (ADR 0042) when the device plugin mounted its quota file at
//! the fixed path `/etc/vgpu/vgpu.conf` ([`Config::hold_to_container`]), and narrowed by
//! the quota file (the fixed one, else `$VGPU_CONTAINER_DIR/vgpu.conf`) when there is one:
//! see [`Config::apply_quota_file`].
//!
//! Trust model: in Kubernetes the container's environment is the tenant's to edit, the
//! quota file (mounted read-only) is not, and neither is where the shim looks for it:
//! with the fixed file, `VGPU_CONTAINER_DIR` no longer chooses the quota file nor the
//! accounting region (both are the fixed directory's), `VGPU_ON_ERROR=unenforced` and
//! `VGPU_TENANT` are not honoured, and each such disagreement is said on stderr and to
//! the daemon. With a quota file, the file sets each device's quota, a device it does not
//! list gets none (quota 0: nothing can be allocated on it), and `VGPU_MEMORY_LIMIT(_<i>)`
//! can only lower a quota, never raise it. Without the fixed file (a bare machine, a
//! developer's run) the environment is all there is, and is followed.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `VGPU_MEMORY_LIMIT` | quota of every visible device (bytes, or `Ki/Mi/Gi/Ti` with or without `B`) | none (unlimited) |
//! | `VGPU_MEMORY_LIMIT_<i>` | quota of device `i` (CUDA ordinal), overrides the above | none |
//! | `VGPU_CONTAINER_DIR` | directory shared by all processes of one container: one budget (ignored where `/etc/vgpu/vgpu.conf` exists) | `/tmp/vgpu` |
//! | `VGPU_ON_ERROR` | `fail` or `unenforced`: what happens when the shim cannot enforce (`unenforced` ignored where `/etc/vgpu/vgpu.conf` exists) | `fail` |
//! | `VGPU_LOG` | `1`/`true`/`debug`: log to stderr (rate-limited) | off |
//! | `VGPU_REAL_LIBCUDA` | path or name of the real driver | `libcuda.so.1` |
//! | `VGPU_REAL_LIBNVML` | path or name of the real NVML | `libnvidia-ml.so.1` |
//! | `VGPU_DEVICE_GATE` | gate on the device too: a stream wait on a word the gate thread closes at a revocation, before every N launches of a thread on a stream (1–4096; `off`/0: none; ADR 0034, not measured on a GPU yet) | off |

use std::fmt;
use std::path::{Path, PathBuf};

use vgpu_core::container_quota::{ContainerQuota, GpuGrant};
use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};

/// Devices the shim keeps accounts for (CUDA ordinals `0..MAX_DEVICES`).
pub const MAX_DEVICES: usize = 16;

/// Default `VGPU_CONTAINER_DIR`: inside a container `/tmp` belongs to the container, so
/// all its processes share it.
pub const DEFAULT_CONTAINER_DIR: &str = "/tmp/vgpu";

/// Default daemon socket.
pub const DEFAULT_DAEMON_SOCKET: &str = "/run/vgpu/daemon.sock";

/// What the shim does when it cannot enforce the quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// `cuInit` fails (the default): no CUDA without isolation.
    Fail,
    /// Every call passes through unenforced, after a loud warning on stderr.
    Unenforced,
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Quota per device in bytes; `None` is unlimited, `Some(0)` (only from a quota
    /// file) is nothing.
    pub limits: [Option<u64>; MAX_DEVICES],
    /// The container's accounting directory.
    pub container_dir: PathBuf,
    /// Failure policy.
    pub on_error: OnError,
    /// Log to stderr.
    pub log: bool,
    /// Real driver to load.
    pub real_libcuda: String,
    /// Real NVML to load.
    pub real_libnvml: String,
    /// The daemon's socket (`VGPU_DAEMON_SOCKET`; None: `off`, local fallback only).
    pub daemon_socket: Option<PathBuf>,
    /// Compute share from the environment, percent (`VGPU_COMPUTE_SHARE`).
    pub compute_share: Option<u32>,
    /// Compute policy from the environment (`VGPU_COMPUTE_POLICY`).
    pub compute_policy: Option<ComputePolicy>,
    /// Priority class from the environment (`VGPU_PRIORITY`).
    pub priority: Option<Priority>,
    /// Tenant key from the environment (`VGPU_TENANT`; default: the quota file's
    /// namespace/pod/container, else the container directory).
    pub tenant: Option<String>,
    /// The container's quota file as read at start (the only read in this process; see
    /// [`Config::apply_quota_file`]), None without one.
    pub quota: Option<ContainerQuota>,
    /// Launches of a thread on a stream per device-side wait (`VGPU_DEVICE_GATE`; 0: no
    /// device-side gating).
    pub device_gate_every: u32,
    /// Whether `VGPU_CONTAINER_DIR` was set (rather than defaulted).
    pub container_dir_from_env: bool,
    /// Held to the container's fixed quota file ([`Config::hold_to_container`]).
    pub held: bool,
    /// What the environment asked that the container's quota overrode, one line each
    /// (said on stderr and in the daemon's `Hello`).
    pub overridden: Vec<String>,
    /// The container's device of each CUDA ordinal of this process: where its quota and
    /// usage live in the container's shared accounting ([`region_indices`]). The
    /// identity without a quota file.
    pub region_index: [usize; MAX_DEVICES],
}

/// What this process may do on one visible device, by the quota file's one rule
/// ([`ContainerQuota::grant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceGrant {
    /// Scheduled with these compute settings (the file's, lowered by the environment;
    /// without a quota file, the environment's).
    Granted(ComputeSettings),
    /// The quota file does not list this GPU: no memory, no compute share; a launch on
    /// it is refused (`CUDA_ERROR_NOT_PERMITTED`).
    NotGranted,
}

/// A configuration value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The environment variable.
    pub var: String,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {}={:?}: {}", self.var, self.value, self.reason)
    }
}

impl std::error::Error for ConfigError {}

fn bad(var: &str, value: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        var: var.to_owned(),
        value: value.to_owned(),
        reason: reason.into(),
    }
}

fn parse_limit(var: &str, value: &str) -> Result<u64, ConfigError> {
    let v =
        vgpu_core::bytes::parse_bytes(value.trim()).map_err(|e| bad(var, value, e.to_string()))?;
    if v == 0 {
        return Err(bad(var, value, "a memory quota must be greater than zero"));
    }
    Ok(v)
}

impl Config {
    /// Builds the configuration from `(name, value)` pairs (the environment).
    pub fn from_vars<I, K, V>(vars: I) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut cfg = Config {
            limits: [None; MAX_DEVICES],
            container_dir: PathBuf::from(DEFAULT_CONTAINER_DIR),
            on_error: OnError::Fail,
            log: false,
            real_libcuda: "libcuda.so.1".to_owned(),
            real_libnvml: "libnvidia-ml.so.1".to_owned(),
            daemon_socket: Some(PathBuf::from(DEFAULT_DAEMON_SOCKET)),
            compute_share: None,
            compute_policy: None,
            priority: None,
            tenant: None,
            quota: None,
            device_gate_every: 0,
            container_dir_from_env: false,
            held: false,
            overridden: Vec::new(),
            region_index: std::array::from_fn(|d| d),
        };
        let mut all = None;
        let mut per_device = Vec::new();
        for (k, v) in vars {
            let (k, v) = (k.as_ref(), v.as_ref());
            match k {
                "VGPU_MEMORY_LIMIT" => all = Some(parse_limit(k, v)?),
                "VGPU_CONTAINER_DIR" => {
                    if v.is_empty() || !v.starts_with('/') {
                        return Err(bad(k, v, "must be an absolute path"));
                    }
                    cfg.container_dir = PathBuf::from(v);
                    cfg.container_dir_from_env = true;
                }
                "VGPU_ON_ERROR" => {
                    cfg.on_error = match v.trim() {
                        "fail" => OnError::Fail,
                        "unenforced" => OnError::Unenforced,
                        _ => return Err(bad(k, v, "expected `fail` or `unenforced`")),
                    }
                }
                "VGPU_LOG" => {
                    cfg.log = match v.trim() {
                        "" | "0" | "false" | "off" => false,
                        "1" | "true" | "on" | "debug" | "info" => true,
                        _ => return Err(bad(k, v, "expected 0/1, true/false or on/off")),
                    }
                }
                "VGPU_DAEMON_SOCKET" => {
                    cfg.daemon_socket = match v.trim() {
                        "off" | "none" => None,
                        p if p.starts_with('/') => Some(PathBuf::from(p)),
                        _ => return Err(bad(k, v, "must be an absolute path or `off`")),
                    }
                }
                "VGPU_COMPUTE_SHARE" => {
                    let t = v.trim().trim_end_matches('%');
                    let n: u32 = t
                        .parse()
                        .map_err(|_| bad(k, v, "expected a percentage 1–100"))?;
                    if !(1..=100).contains(&n) {
                        return Err(bad(k, v, "out of range (1–100)"));
                    }
                    cfg.compute_share = Some(n);
                }
                "VGPU_COMPUTE_POLICY" => {
                    cfg.compute_policy = Some(v.trim().parse().map_err(|e: String| bad(k, v, e))?)
                }
                "VGPU_PRIORITY" => {
                    cfg.priority = Some(v.trim().parse().map_err(|e: String| bad(k, v, e))?)
                }
                "VGPU_TENANT" if !v.is_empty() => {
                    if v.len() > 256 {
                        return Err(bad(k, v, "longer than 256 bytes"));
                    }
                    cfg.tenant = Some(v.to_owned());
                }
                "VGPU_DEVICE_GATE" => {
                    cfg.device_gate_every = match v.trim() {
                        "" | "off" | "0" => 0,
                        t => match t.parse::<u32>() {
                            Ok(n) if (1..=4096).contains(&n) => n,
                            _ => {
                                return Err(bad(
                                    k,
                                    v,
                                    "expected launches per device-side wait, 1–4096, or `off`",
                                ));
                            }
                        },
                    }
                }
                "VGPU_REAL_LIBCUDA" if !v.is_empty() => cfg.real_libcuda = v.to_owned(),
                "VGPU_REAL_LIBNVML" if !v.is_empty() => cfg.real_libnvml = v.to_owned(),
                _ => {
                    if let Some(idx) = k.strip_prefix("VGPU_MEMORY_LIMIT_") {
                        let i: usize = idx.parse().map_err(|_| {
                            bad(
                                k,
                                v,
                                "the suffix must be a device index (VGPU_MEMORY_LIMIT_0, _1, ...)",
                            )
                        })?;
                        if i >= MAX_DEVICES {
                            return Err(bad(
                                k,
                                v,
                                format!(
                                    "device index {i} is out of range (at most {})",
                                    MAX_DEVICES - 1
                                ),
                            ));
                        }
                        per_device.push((i, parse_limit(k, v)?));
                    }
                }
            }
        }
        if let Some(all) = all {
            cfg.limits = [Some(all); MAX_DEVICES];
        }
        for (i, l) in per_device {
            cfg.limits[i] = Some(l);
        }
        Ok(cfg)
    }

    /// Builds the configuration from the process environment (non-UTF-8 `VGPU_*`
    /// values are errors; other variables are ignored).
    pub fn from_env() -> Result<Config, ConfigError> {
        let mut vars = Vec::new();
        for (k, v) in std::env::vars_os() {
            let Some(k) = k.to_str() else { continue };
            if !k.starts_with("VGPU_") {
                continue;
            }
            let v = v
                .into_string()
                .map_err(|v| bad(k, &v.to_string_lossy(), "not valid UTF-8"))?;
            vars.push((k.to_owned(), v));
        }
        Config::from_vars(vars)
    }

    /// The quota of device `dev`, if any (`Some(0)`: nothing may be allocated on it).
    pub fn limit(&self, dev: usize) -> Option<u64> {
        self.limits.get(dev).copied().flatten()
    }

    /// The container's device that CUDA ordinal `dev` of this process is, for its
    /// shared accounting (an ordinal beyond the accounts is returned as is: the region
    /// has no record of it).
    pub fn region_dev(&self, dev: usize) -> usize {
        self.region_index.get(dev).copied().unwrap_or(dev)
    }

    /// The compute settings to propose for a GPU, given the quota file's (trusted)
    /// settings for it if there is one: the environment may only lower the share, turn
    /// `burst` into `cap` and latency-sensitive into best-effort, never the reverse.
    pub fn compute_settings(&self, from_file: Option<ComputeSettings>) -> ComputeSettings {
        let base = from_file.unwrap_or(ComputeSettings {
            share_pct: 100,
            policy: ComputePolicy::Burst,
            priority: Priority::BestEffort,
        });
        let share_pct = match self.compute_share {
            Some(e) => e.min(base.share_pct),
            None => base.share_pct,
        };
        let policy = match (from_file, self.compute_policy) {
            (None, Some(p)) => p,
            (Some(_), Some(ComputePolicy::Cap)) => ComputePolicy::Cap,
            _ => base.policy,
        };
        let priority = match (from_file, self.priority) {
            (None, Some(p)) => p,
            (Some(_), Some(Priority::BestEffort)) => Priority::BestEffort,
            _ => base.priority,
        };
        ComputeSettings {
            share_pct,
            policy,
            priority,
        }
    }

    /// What this process may do on the device with `uuid`: without a quota file every
    /// device is granted with the environment's settings; with one, a GPU the file
    /// lists gets its settings (the environment may only lower them), any other none.
    pub fn device_grant(&self, uuid: &str) -> DeviceGrant {
        match &self.quota {
            None => DeviceGrant::Granted(self.compute_settings(None)),
            Some(q) => match q.grant(uuid) {
                GpuGrant::Granted(g) => {
                    DeviceGrant::Granted(self.compute_settings(Some(g.compute_settings())))
                }
                GpuGrant::NotGranted => DeviceGrant::NotGranted,
            },
        }
    }

    /// Holds the configuration to the container whose fixed quota file exists in
    /// `fixed_dir` (ADR 0042): the quota file and the accounting region are that
    /// directory's, whatever `VGPU_CONTAINER_DIR` says; `VGPU_ON_ERROR=unenforced` (which
    /// would let a process that cannot be enforced run unlimited) and `VGPU_TENANT` (which
    /// would make it a tenant of its own) are not honoured. `env_dir_is_fixed` says
    /// whether the environment's directory is the fixed one (the same directory: the
    /// device plugin mounts one directory at both). Returns what the environment asked
    /// that is overridden, one line each, also kept in [`Config::overridden`].
    pub fn hold_to_container(&mut self, fixed_dir: &Path, env_dir_is_fixed: bool) -> Vec<String> {
        let mut notes = Vec::new();
        if self.container_dir_from_env && !env_dir_is_fixed {
            notes.push(format!(
                "VGPU_CONTAINER_DIR={} is not this container's directory: its quota and accounting region are {}'s (mounted read-only by the device plugin)",
                self.container_dir.display(),
                fixed_dir.display()
            ));
        }
        self.container_dir = fixed_dir.to_owned();
        if self.on_error == OnError::Unenforced {
            notes.push(
                "VGPU_ON_ERROR=unenforced is not honoured in a container with a quota file: a process the shim cannot enforce fails".to_owned(),
            );
            self.on_error = OnError::Fail;
        }
        if let Some(t) = self.tenant.take() {
            notes.push(format!(
                "VGPU_TENANT={t:?} is not honoured in a container with a quota file: the tenant is the file's container"
            ));
        }
        self.held = true;
        self.overridden.extend(notes.iter().cloned());
        notes
    }

    /// The quota file of this configuration: `$VGPU_CONTAINER_DIR/vgpu.conf` (the fixed
    /// one once held to the container).
    pub fn quota_file(&self) -> PathBuf {
        self.container_dir
            .join(vgpu_core::container_quota::QUOTA_FILE)
    }

    /// Applies the quota file `path` with contents `text` to the limits, given the
    /// UUIDs of the visible devices in CUDA ordinal order (from the real driver).
    ///
    /// Per device, by the file's one rule ([`ContainerQuota::grant`]: UUIDs matched
    /// ignoring case and white space): the file's `memory_mib` of the GPU, lowered by an
    /// environment limit if that one is smaller (never raised); a device the file does
    /// not list gets `Some(0)` (nothing may be allocated on it). The parsed file is kept
    /// in [`Config::quota`]: nothing else in the process reads it again. A malformed record, an
    /// unknown version, a zero or duplicated GPU, or a UUID no visible device has is an
    /// error naming the file and the value. Returns notes about environment limits the
    /// file overrode (for the log).
    pub fn apply_quota_file(
        &mut self,
        path: &Path,
        text: &str,
        device_uuids: &[String],
    ) -> Result<Vec<String>, String> {
        use vgpu_core::container_quota::QuotaFileError;
        let file = path.display();
        let q = ContainerQuota::from_json(text).map_err(|e| match e {
            QuotaFileError::Malformed(err) => {
                let shown: String = text.chars().take(200).collect();
                format!("quota file {file}: malformed record ({err}): {shown:?}")
            }
            QuotaFileError::Version(v) => format!(
                "quota file {file}: unsupported version {v} (this shim reads version {})",
                vgpu_core::container_quota::QUOTA_VERSION
            ),
            other => {
                let what = other.to_string();
                format!(
                    "quota file {file}: {}",
                    what.strip_prefix("quota file: ").unwrap_or(&what)
                )
            }
        })?;
        // A listed GPU no visible device has cannot be honoured: a loud error.
        for g in &q.gpus {
            if !device_uuids
                .iter()
                .any(|u| vgpu_core::container_quota::same_gpu(u, &g.uuid))
            {
                return Err(format!(
                    "quota file {file}: GPU {:?} is not a visible device (visible: {})",
                    g.uuid,
                    if device_uuids.is_empty() {
                        "none".to_owned()
                    } else {
                        device_uuids.join(", ")
                    }
                ));
            }
        }
        if let Some(g) = q.gpus.iter().find(|g| {
            device_uuids
                .iter()
                .position(|u| vgpu_core::container_quota::same_gpu(u, &g.uuid))
                .is_some_and(|d| d >= MAX_DEVICES)
        }) {
            return Err(format!(
                "quota file {file}: GPU {:?} is beyond the {MAX_DEVICES} devices libvgpu accounts for",
                g.uuid
            ));
        }
        self.region_index = region_indices(device_uuids, &q);
        let mut file_limits: [Option<u64>; MAX_DEVICES] = [None; MAX_DEVICES];
        for (slot, uuid) in file_limits.iter_mut().zip(device_uuids) {
            if let GpuGrant::Granted(g) = q.grant(uuid) {
                *slot = Some(g.memory_bytes());
            }
        }
        let mut notes = Vec::new();
        for (d, (limit, from_file)) in self.limits.iter_mut().zip(file_limits).enumerate() {
            let from_file = from_file.unwrap_or(0);
            match *limit {
                Some(env) if env <= from_file => {}
                Some(env) => {
                    if d < device_uuids.len() {
                        notes.push(format!(
                        "device {d}: the environment asks for {env} bytes, the quota file {file} allows {from_file}: using {from_file}"
                        ));
                    }
                    *limit = Some(from_file);
                }
                None => *limit = Some(from_file),
            }
        }
        self.quota = Some(q);
        if self.held {
            self.overridden.extend(notes.iter().cloned());
        }
        Ok(notes)
    }
}

/// The container's device of each CUDA ordinal, given the UUIDs by ordinal
/// `device_uuids` and the container's quota file `q`: a GPU the file grants is the
/// file's position of it, the same in every process of the container whatever its own
/// `CUDA_VISIBLE_DEVICES` (which renumbers the ordinals: with `2,0` ordinal 0 is the
/// file's third GPU); the other ordinals take the positions left, in order. A
/// permutation of `0..MAX_DEVICES`, so that no two ordinals share an account.
pub fn region_indices(device_uuids: &[String], q: &ContainerQuota) -> [usize; MAX_DEVICES] {
    let mut out = [usize::MAX; MAX_DEVICES];
    let mut taken = [false; MAX_DEVICES];
    for (slot, uuid) in out.iter_mut().zip(device_uuids) {
        if let Some(i) = q
            .gpus
            .iter()
            .position(|g| vgpu_core::container_quota::same_gpu(uuid, &g.uuid))
            .filter(|&i| i < MAX_DEVICES && !taken[i])
        {
            *slot = i;
            taken[i] = true;
        }
    }
    let mut free = (0..MAX_DEVICES).filter(|&i| !taken[i]);
    for slot in out.iter_mut().filter(|s| **s == usize::MAX) {
        *slot = free.next().unwrap_or(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-51570000-0000-4000-8000-000000000000";
    const B: &str = "GPU-51570000-0000-4000-8000-000000000001";

    fn file(gpus: &[(&str, u64)]) -> String {
        let g: Vec<String> = gpus
            .iter()
            .map(|(u, m)| {
                format!(r#"{{"uuid":"{u}","memory_mib":{m},"compute_milli":100,"slices":1}}"#)
            })
            .collect();
        format!(
            r#"{{"version":1,"namespace":"ns","pod":"p","uid":"u","container":"c","init":false,"gpus":[{}],"device_ids":[]}}"#,
            g.join(",")
        )
    }

    #[test]
    fn quota_file_sets_denies_and_env_only_lowers() {
        let p = Path::new("/c/vgpu.conf");
        let devs = [A.to_owned(), B.to_owned()];
        let mut c = cfg(&[]).unwrap();
        c.apply_quota_file(p, &file(&[(A, 1000)]), &devs).unwrap();
        assert_eq!(c.limit(0), Some(1000 << 20));
        assert_eq!(c.limit(1), Some(0), "unlisted device gets nothing");
        let mut c = cfg(&[("VGPU_MEMORY_LIMIT", "8Gi"), ("VGPU_MEMORY_LIMIT_1", "1Gi")]).unwrap();
        let notes = c
            .apply_quota_file(p, &file(&[(B, 100), (A, 2000)]), &devs)
            .unwrap();
        assert_eq!(c.limit(0), Some(2000 << 20), "env cannot raise");
        assert_eq!(c.limit(1), Some(100 << 20));
        assert_eq!(notes.len(), 2);
        let mut c = cfg(&[("VGPU_MEMORY_LIMIT_0", "500Mi")]).unwrap();
        c.apply_quota_file(p, &file(&[(A, 2000)]), &devs).unwrap();
        assert_eq!(c.limit(0), Some(500 << 20), "env can lower");
    }

    #[test]
    fn every_process_keeps_a_gpus_accounts_at_its_place_in_the_file() {
        const C: &str = "GPU-51570000-0000-4000-8000-000000000002";
        let q = ContainerQuota::from_json(&file(&[(C, 1000), (A, 2000), (B, 3000)])).unwrap();
        let own = |uuids: &[&str]| {
            let u: Vec<String> = uuids.iter().map(|s| (*s).to_owned()).collect();
            region_indices(&u, &q)
        };
        // No CUDA_VISIBLE_DEVICES of its own: the driver shows the file's order.
        assert_eq!(own(&[C, A, B])[..3], [0, 1, 2]);
        // `2,0`: ordinal 0 is B (the file's third), 1 is C; A, left out, at ordinal 2.
        assert_eq!(own(&[B, C, A])[..3], [2, 0, 1]);
        // A GPU the file does not grant (a driver that ignored the variable) takes a
        // place no granted GPU has; every ordinal has a place of its own.
        let m = own(&[
            "GPU-51570000-0000-4000-8000-00000000000f",
            A,
            "gpu-51570000-0000-4000-8000-000000000002 ",
        ]);
        assert_eq!(m[..3], [2, 1, 0]);
        let mut sorted = m;
        sorted.sort_unstable();
        assert_eq!(sorted, std::array::from_fn::<usize, MAX_DEVICES, _>(|i| i));
        // Applied with the file; the identity without one.
        let mut c = cfg(&[]).unwrap();
        assert_eq!(c.region_dev(1), 1);
        let devs = [B.to_owned(), C.to_owned(), A.to_owned()];
        c.apply_quota_file(
            Path::new("/c/vgpu.conf"),
            &file(&[(C, 1000), (A, 2000), (B, 3000)]),
            &devs,
        )
        .unwrap();
        assert_eq!(
            (c.region_dev(0), c.region_dev(1), c.region_dev(2)),
            (2, 0, 1)
        );
        assert_eq!(c.limit(0), Some(3000 << 20));
        assert_eq!(c.region_dev(MAX_DEVICES + 3), MAX_DEVICES + 3);
    }

    #[test]
    fn memory_and_compute_follow_the_one_rule_of_the_file() {
        let p = Path::new("/c/vgpu.conf");
        let devs = [A.to_owned(), B.to_owned()];
        // JSON-escaped tab: the UUID in the file has white space on both sides.
        let spelled = format!("  {}\\t", A.replace("GPU-", "gpu-"));
        let mut c = cfg(&[("VGPU_COMPUTE_SHARE", "5")]).unwrap();
        assert_eq!(
            c.device_grant(B),
            DeviceGrant::Granted(c.compute_settings(None)),
            "no file: every device, the environment's settings"
        );
        c.apply_quota_file(p, &file(&[(&spelled, 1000)]), &devs)
            .unwrap();
        assert_eq!(c.limit(0), Some(1000 << 20));
        assert_eq!(c.limit(1), Some(0));
        let DeviceGrant::Granted(st) = c.device_grant(A) else {
            panic!("A is listed");
        };
        assert_eq!(
            st.share_pct, 5,
            "the file's 10 %, lowered by the environment"
        );
        assert_eq!(c.device_grant(&A.to_lowercase()), DeviceGrant::Granted(st));
        assert_eq!(c.device_grant(B), DeviceGrant::NotGranted);
        assert_eq!(c.quota.as_ref().map(|q| q.pod.as_str()), Some("p"));
    }

    #[test]
    fn held_to_the_container_the_environment_chooses_no_file_region_tenant_or_policy() {
        let fixed = Path::new("/etc/vgpu");
        let devs = [A.to_owned()];
        // The environment the plugin gives: the same directory, nothing to say.
        let mut c = cfg(&[("VGPU_CONTAINER_DIR", "/var/run/vgpu")]).unwrap();
        assert!(c.hold_to_container(fixed, true).is_empty());
        assert_eq!(c.quota_file(), Path::new("/etc/vgpu/vgpu.conf"));
        // No VGPU_CONTAINER_DIR at all: held too, nothing said about it.
        let mut c = cfg(&[]).unwrap();
        assert!(c.hold_to_container(fixed, false).is_empty());
        assert_eq!(c.container_dir, fixed);
        // A tenant's environment: every disagreement held and said.
        let mut c = cfg(&[
            ("VGPU_CONTAINER_DIR", "/tmp/empty"),
            ("VGPU_ON_ERROR", "unenforced"),
            ("VGPU_TENANT", "someone-else"),
            ("VGPU_MEMORY_LIMIT", "79Gi"),
        ])
        .unwrap();
        let notes = c.hold_to_container(fixed, false);
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(notes[0].contains("/tmp/empty") && notes[0].contains("/etc/vgpu"));
        assert_eq!(c.container_dir, fixed);
        assert_eq!(c.quota_file(), Path::new("/etc/vgpu/vgpu.conf"));
        assert_eq!(c.on_error, OnError::Fail);
        assert_eq!(c.tenant, None);
        c.apply_quota_file(&c.quota_file(), &file(&[(A, 256)]), &devs)
            .unwrap();
        assert_eq!(c.limit(0), Some(256 << 20), "the environment cannot raise");
        assert_eq!(c.overridden.len(), 4, "{:?}", c.overridden);
        assert!(c.overridden[3].contains(&(79u64 << 30).to_string()));
        // Not held (a bare machine): the environment is followed, nothing overridden.
        let mut c = cfg(&[("VGPU_MEMORY_LIMIT", "79Gi")]).unwrap();
        c.apply_quota_file(Path::new("/c/vgpu.conf"), &file(&[(A, 256)]), &devs)
            .unwrap();
        assert!(c.overridden.is_empty());
    }

    #[test]
    fn device_side_gating_is_off_unless_asked_and_bad_values_are_named() {
        assert_eq!(cfg(&[]).unwrap().device_gate_every, 0);
        assert_eq!(
            cfg(&[("VGPU_DEVICE_GATE", "off")])
                .unwrap()
                .device_gate_every,
            0
        );
        assert_eq!(
            cfg(&[("VGPU_DEVICE_GATE", " 8 ")])
                .unwrap()
                .device_gate_every,
            8
        );
        for bad in ["-1", "4097", "eight", "1.5"] {
            let e = cfg(&[("VGPU_DEVICE_GATE", bad)]).unwrap_err().to_string();
            assert!(e.contains("VGPU_DEVICE_GATE") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn quota_file_errors_name_file_and_value() {
        let p = Path::new("/c/vgpu.conf");
        let devs = [A.to_owned()];
        let mut c = cfg(&[]).unwrap();
        let e = c.apply_quota_file(p, "{not json", &devs).unwrap_err();
        assert!(e.contains("/c/vgpu.conf") && e.contains("{not json"), "{e}");
        let e = c
            .apply_quota_file(
                p,
                &file(&[(A, 1)]).replace("\"version\":1", "\"version\":7"),
                &devs,
            )
            .unwrap_err();
        assert!(e.contains("/c/vgpu.conf") && e.contains("version 7"), "{e}");
        let e = c.apply_quota_file(p, &file(&[(B, 1)]), &devs).unwrap_err();
        assert!(e.contains("/c/vgpu.conf") && e.contains(B), "{e}");
        let e = c.apply_quota_file(p, &file(&[(A, 0)]), &devs).unwrap_err();
        assert!(e.contains("memory_mib 0"), "{e}");
        let e = c
            .apply_quota_file(p, &file(&[(A, 1), (A, 2)]), &devs)
            .unwrap_err();
        assert!(e.contains("twice"), "{e}");
        assert_eq!(c.limit(0), None, "a refused file changes nothing");
    }

    fn cfg(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_vars(vars.iter().copied())
    }

    #[test]
    fn compute_settings_env_only_lowers_a_file() {
        let c = cfg(&[
            ("VGPU_COMPUTE_SHARE", "40"),
            ("VGPU_COMPUTE_POLICY", "burst"),
            ("VGPU_PRIORITY", "latency-sensitive"),
        ])
        .unwrap();
        let alone = c.compute_settings(None);
        assert_eq!(alone.share_pct, 40);
        assert_eq!(alone.priority, Priority::LatencySensitive);
        let file = ComputeSettings {
            share_pct: 30,
            policy: ComputePolicy::Cap,
            priority: Priority::BestEffort,
        };
        assert_eq!(c.compute_settings(Some(file)), file, "env cannot raise");
        let c = cfg(&[
            ("VGPU_COMPUTE_SHARE", "20%"),
            ("VGPU_COMPUTE_POLICY", "cap"),
        ])
        .unwrap();
        let got = c.compute_settings(Some(ComputeSettings {
            policy: ComputePolicy::Burst,
            ..file
        }));
        assert_eq!((got.share_pct, got.policy), (20, ComputePolicy::Cap));
        for (k, v) in [
            ("VGPU_COMPUTE_SHARE", "0"),
            ("VGPU_COMPUTE_SHARE", "101"),
            ("VGPU_COMPUTE_SHARE", "half"),
            ("VGPU_COMPUTE_POLICY", "max"),
            ("VGPU_PRIORITY", "urgent"),
            ("VGPU_DAEMON_SOCKET", "relative.sock"),
        ] {
            let e = cfg(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(v), "{e}");
        }
        assert_eq!(
            cfg(&[("VGPU_DAEMON_SOCKET", "off")]).unwrap().daemon_socket,
            None
        );
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.limit(0), None);
        assert_eq!(c.container_dir, PathBuf::from("/tmp/vgpu"));
        assert_eq!(c.on_error, OnError::Fail);
        assert!(!c.log);
    }

    #[test]
    fn limits_all_and_per_device() {
        let c = cfg(&[
            ("VGPU_MEMORY_LIMIT_1", "1Gi"),
            ("VGPU_MEMORY_LIMIT", "256MiB"),
            ("VGPU_MEMORY_LIMIT_3", "1048576"),
        ])
        .unwrap();
        assert_eq!(c.limit(0), Some(256 << 20));
        assert_eq!(c.limit(1), Some(1 << 30));
        assert_eq!(c.limit(3), Some(1 << 20));
        let c = cfg(&[("VGPU_MEMORY_LIMIT_2", "2Gi")]).unwrap();
        assert_eq!(c.limit(0), None);
        assert_eq!(c.limit(2), Some(2 << 30));
    }

    #[test]
    fn bad_values_name_the_variable_and_value() {
        let e = cfg(&[("VGPU_MEMORY_LIMIT", "8G")]).unwrap_err();
        assert_eq!(e.var, "VGPU_MEMORY_LIMIT");
        let msg = e.to_string();
        assert!(msg.contains("VGPU_MEMORY_LIMIT=\"8G\""), "{msg}");
        let e = cfg(&[("VGPU_MEMORY_LIMIT_x", "1Gi")]).unwrap_err();
        assert!(e.to_string().contains("VGPU_MEMORY_LIMIT_x"), "{e}");
        let e = cfg(&[("VGPU_MEMORY_LIMIT_99", "1Gi")]).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
        assert!(cfg(&[("VGPU_MEMORY_LIMIT", "0")]).is_err());
        assert!(cfg(&[("VGPU_ON_ERROR", "ignore")]).is_err());
        assert!(cfg(&[("VGPU_CONTAINER_DIR", "relative/dir")]).is_err());
        assert!(cfg(&[("VGPU_LOG", "maybe")]).is_err());
        assert_eq!(
            cfg(&[("VGPU_ON_ERROR", "unenforced")]).unwrap().on_error,
            OnError::Unenforced
        );
    }
}
