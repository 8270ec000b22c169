//! Registration: what each GPU of a `Hello` gets (the quota file's one rule in trusted
//! mode), whether the node has it, the bounds on what a client can make the daemon keep
//! (every check before the first change), and the per-container health record of
//! refusals and reported fallbacks.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use tracing::{debug, info, warn};
use vgpu_core::container_quota::{ContainerQuota, GpuGrant, same_gpu};
use vgpu_core::sched_proto::{
    ContainerIdent, DaemonMsg, GpuRegistration, MAX_GPUS, MAX_OVERRIDDEN, MAX_OVERRIDDEN_LEN,
    MAX_REASON, NEVER_HELD_WORD, PROTO_VERSION,
};
use vgpu_sys::mono_ns;

use super::{
    Conn, Daemon, DaemonError, GpuRec, Inner, MAX_CONNECTIONS, MAX_CONNS_PER_TENANT,
    MAX_CONTAINER_DIR, MAX_HEALTH_RECORDS, MAX_NAME, MAX_UNVERIFIED_GPUS, Outbox, Registered,
    Resolved, TenantGpuRec, TenantRec, execute, valid_uuid,
};
use crate::arbiter::{Arbiter, Event};
use crate::board::Board;
use crate::model::{ContainerHealth, SettingsSource};

impl Daemon {
    /// What each registered GPU gets, and the memory quota the daemon shows and meters
    /// for it: in trusted mode by the container's quota file (read once, through
    /// `/proc/PID/root`, by [`ContainerQuota::grant`]; the fixed file of ADR 0042 first,
    /// then the configured path for containers started before it), never the shim's
    /// proposal nor its quota, which the tenant's environment wrote (no file: the
    /// default settings and no quota); else the shim's proposal and quota. A process
    /// granted none of its GPUs is refused, naming them.
    fn resolve(
        &self,
        pid: u32,
        gpus: &[GpuRegistration],
    ) -> Result<(Vec<Resolved>, Vec<Option<u64>>), DaemonError> {
        let Some(inner_path) = &self.cfg.trusted_quota_file else {
            let resolved = gpus
                .iter()
                .map(|reg| {
                    reg.settings
                        .validate()
                        .map(|()| Resolved::Scheduled(reg.settings, SettingsSource::Shim))
                        .map_err(|e| DaemonError::Invalid(format!("GPU {}: {e}", reg.uuid)))
                })
                .collect::<Result<Vec<_>, _>>()?;
            return Ok((resolved, gpus.iter().map(|r| r.memory_quota).collect()));
        };
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        let inside = |p: &std::path::Path| root.join(p.strip_prefix("/").unwrap_or(p));
        let fixed = inside(std::path::Path::new(
            vgpu_core::container_quota::FIXED_QUOTA_FILE,
        ));
        let (path, read) = match std::fs::read_to_string(&fixed) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let p = inside(inner_path);
                let r = std::fs::read_to_string(&p);
                (p, r)
            }
            r => (fixed, r),
        };
        let Ok(text) = read else {
            let d = Resolved::Scheduled(self.cfg.default_settings, SettingsSource::Default);
            return Ok((vec![d; gpus.len()], vec![None; gpus.len()]));
        };
        let q = ContainerQuota::from_json(&text)
            .map_err(|e| DaemonError::Invalid(format!("{}: {e}", path.display())))?;
        let (out, quotas): (Vec<Resolved>, Vec<Option<u64>>) = gpus
            .iter()
            .map(|reg| match q.grant(&reg.uuid) {
                GpuGrant::Granted(g) => (
                    Resolved::Scheduled(g.compute_settings(), SettingsSource::QuotaFile),
                    Some(g.memory_bytes()),
                ),
                GpuGrant::NotGranted => (Resolved::NotGranted, None),
            })
            .unzip();
        if out.iter().all(|r| matches!(r, Resolved::NotGranted)) {
            let names: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
            return Err(DaemonError::Invalid(format!(
                "{}: none of the GPUs this process registers is granted to the container ({})",
                path.display(),
                names.join(", ")
            )));
        }
        Ok((out, quotas))
    }

    /// The daemon's name for GPU `uuid`, if the node has it: its own spelling of a GPU it
    /// knows (`--gpu`, NVML), else (it knows none) the UUID trimmed, at most
    /// [`MAX_UNVERIFIED_GPUS`] distinct ones with `adding` new ones counted.
    fn node_gpu(&self, g: &Inner, uuid: &str) -> Result<String, DaemonError> {
        let known: Vec<&str> = self
            .cfg
            .gpus
            .iter()
            .map(String::as_str)
            .chain(g.observations.iter().map(|o| o.uuid.as_str()))
            .collect();
        if !known.is_empty() {
            return known
                .iter()
                .find(|k| same_gpu(k, uuid))
                .map(|k| (*k).to_owned())
                .ok_or_else(|| {
                    DaemonError::Invalid(format!(
                        "GPU {uuid:?} is not a GPU of this node (it has {})",
                        known.join(", ")
                    ))
                });
        }
        Ok(g.gpus
            .keys()
            .find(|k| same_gpu(k, uuid))
            .cloned()
            .unwrap_or_else(|| uuid.trim().to_owned()))
    }

    /// Registers a process (host `pid` from the socket's credentials). A refusal keeps
    /// nothing but a count in the container's [`ContainerHealth`].
    pub fn register(
        &self,
        pid: u32,
        proto: u32,
        ident: ContainerIdent,
        gpus: Vec<GpuRegistration>,
        out: Outbox,
    ) -> Result<Registered, DaemonError> {
        let r = self.try_register(pid, proto, &ident, &gpus, out);
        if let Err(e) = &r {
            self.note_refusal(pid, &ident, e);
        }
        r
    }

    fn try_register(
        &self,
        pid: u32,
        proto: u32,
        ident: &ContainerIdent,
        gpus: &[GpuRegistration],
        out: Outbox,
    ) -> Result<Registered, DaemonError> {
        if proto != PROTO_VERSION {
            return Err(DaemonError::Version(proto));
        }
        if gpus.is_empty() || gpus.len() > MAX_GPUS {
            return Err(DaemonError::Invalid(format!(
                "{} GPUs registered (1–{MAX_GPUS} allowed)",
                gpus.len()
            )));
        }
        check_ident(ident)?;
        for (i, g) in gpus.iter().enumerate() {
            if !valid_uuid(&g.uuid) {
                return Err(DaemonError::Invalid(format!("bad GPU UUID {:?}", g.uuid)));
            }
            if gpus[..i].iter().any(|o| same_gpu(&o.uuid, &g.uuid)) {
                return Err(DaemonError::Invalid(format!(
                    "GPU {:?} registered twice",
                    g.uuid
                )));
            }
        }
        let (resolved, quotas) = self.resolve(pid, gpus)?;
        if !ident.overridden.is_empty() && crate::log_budget::client_warning() {
            warn!(
                tenant = %ident.key,
                pid,
                overridden = ?ident.overridden,
                "the process's environment disagreed with its container's quota file: held to the file"
            );
        }
        let now = mono_ns();
        let mut g = self.lock();
        let inner = &mut *g;
        // Every check before the first change: a refusal keeps nothing.
        if inner.conns.len() >= MAX_CONNECTIONS {
            return Err(DaemonError::Invalid(format!(
                "{MAX_CONNECTIONS} processes are registered already (the most this daemon keeps)"
            )));
        }
        let existing = inner.tenants.get(&ident.key);
        if let Some(t) = existing
            && t.conns.len() >= MAX_CONNS_PER_TENANT
        {
            return Err(DaemonError::Invalid(format!(
                "tenant {} has {MAX_CONNS_PER_TENANT} processes registered already (the most per container)",
                ident.key
            )));
        }
        let mut names: Vec<Option<String>> = Vec::with_capacity(gpus.len());
        for (reg, r) in gpus.iter().zip(&resolved) {
            names.push(match r {
                Resolved::NotGranted => None,
                Resolved::Scheduled(..) => Some(self.node_gpu(inner, &reg.uuid)?),
            });
        }
        if self.cfg.gpus.is_empty() && inner.observations.is_empty() {
            let mut new: Vec<&str> = names
                .iter()
                .flatten()
                .map(String::as_str)
                .filter(|u| !inner.gpus.contains_key(*u))
                .collect();
            new.dedup();
            if inner.gpus.len() + new.len() > MAX_UNVERIFIED_GPUS {
                return Err(DaemonError::Invalid(format!(
                    "GPU {}: this daemon keeps at most {MAX_UNVERIFIED_GPUS} GPUs it cannot verify \
                     (no --gpu, no NVML reading) and has {}",
                    new.first().copied().unwrap_or_default(),
                    inner.gpus.len()
                )));
            }
        }
        let tenant_gpus = existing.map_or(0, |t| t.gpus.len());
        let added = names
            .iter()
            .flatten()
            .filter(|u| existing.is_none_or(|t| !t.gpus.contains_key(*u)))
            .count();
        if tenant_gpus + added > MAX_GPUS {
            return Err(DaemonError::Invalid(format!(
                "tenant {} uses more than {MAX_GPUS} GPUs",
                ident.key
            )));
        }
        inner.next_id += 1;
        let conn_id = inner.next_id;
        if !inner.tenants.contains_key(&ident.key) {
            let id = inner.next_id + 1;
            let board = Board::new(&id.to_string())
                .map_err(|e| DaemonError::Invalid(format!("cannot create a board: {e}")))?;
            inner.next_id = id;
            inner.by_id.insert(id, ident.key.clone());
            inner.tenants.insert(
                ident.key.clone(),
                TenantRec {
                    id,
                    ident: ident.clone(),
                    board: Arc::new(board),
                    gpus: BTreeMap::new(),
                    conns: HashSet::new(),
                },
            );
            info!(tenant = %ident.key, pid, "new tenant");
        }
        let saved = inner.overrides.get(&ident.key).cloned().unwrap_or_default();
        let t = inner.tenants.get_mut(&ident.key).expect("inserted above");
        let mut settings_out = Vec::new();
        let mut words = Vec::new();
        let mut not_granted = Vec::new();
        let mut registered = Vec::new();
        for (i, ((reg, quota), (name, r))) in gpus
            .iter()
            .zip(quotas)
            .zip(names.iter().zip(resolved))
            .enumerate()
        {
            let (Some(uuid), Resolved::Scheduled(settings, source)) = (name, r) else {
                // Not granted: a word nobody writes, the shim's own settings echoed.
                not_granted.push(u32::try_from(i).unwrap_or(u32::MAX));
                words.push(NEVER_HELD_WORD);
                settings_out.push(reg.settings);
                continue;
            };
            let next_word = t.gpus.len();
            let rec = t.gpus.entry(uuid.clone()).or_insert(TenantGpuRec {
                word: next_word,
                settings,
                source,
                memory_quota: quota,
                memory: HashMap::new(),
                refused: HashMap::new(),
            });
            // An operator's setting stays (also across daemon restarts); otherwise the
            // newest trusted answer wins.
            if let Some(op) = saved.get(uuid) {
                rec.settings = *op;
                rec.source = SettingsSource::Api;
            } else if rec.source != SettingsSource::Api {
                rec.settings = settings;
                rec.source = source;
            }
            rec.memory_quota = quota.or(rec.memory_quota);
            settings_out.push(rec.settings);
            words.push(u32::try_from(rec.word).unwrap_or(0));
            inner.gpus.entry(uuid.clone()).or_insert_with(|| GpuRec {
                arbiter: Arbiter::new(self.cfg.params),
                wake_at: None,
            });
            registered.push((uuid.clone(), rec.settings));
        }
        if !not_granted.is_empty() {
            debug!(tenant = %ident.key, pid, ?not_granted, "GPUs not granted to the container: not scheduled");
        }
        t.conns.insert(conn_id);
        let board = Arc::clone(&t.board);
        let tenant = t.ident.key.clone();
        let tenant_id = t.id;
        inner.conns.insert(
            conn_id,
            Conn {
                pid,
                tenant: tenant.clone(),
                gpus: names,
                out,
                input: None,
            },
        );
        for (uuid, settings) in registered {
            let event = Event::Registered {
                tenant: tenant_id,
                settings,
            };
            execute(inner, &uuid, event, now);
        }
        debug!(tenant = %tenant, pid, conn = conn_id, "process registered");
        if inner.detached.remove(&pid).is_some() {
            info!(tenant = %tenant, pid, "the process left its local fallback: registered again");
        }
        // If the tenant holds a GPU right now, this process may launch too.
        Ok(Registered {
            conn: conn_id,
            board,
            welcome: DaemonMsg::Welcome {
                proto: PROTO_VERSION,
                tenant,
                settings: settings_out,
                words,
                quantum_us: self.cfg.params.quantum_ns / 1000,
                queue_ahead_us: self.cfg.deepest_queue_ahead_us(),
                host_pid: Some(pid),
                not_granted,
                peer_checks: true,
            },
        })
    }

    /// Counts a refused registration against the container; logs the first of a kind.
    fn note_refusal(&self, pid: u32, ident: &ContainerIdent, e: &DaemonError) {
        let reason = e.to_string();
        let mut g = self.lock();
        let Some(h) = health_rec(&mut g, ident) else {
            debug!(pid, "registration refused: {reason}");
            return;
        };
        let first = h.refused_registrations == 0 || h.last_refusal != reason;
        h.refused_registrations += 1;
        h.last_refusal = cut(&reason, MAX_REASON);
        let n = h.refused_registrations;
        drop(g);
        if first && crate::log_budget::client_warning() {
            warn!(tenant = %ident.key, pid, "registration refused: {reason}");
        } else {
            debug!(tenant = %ident.key, pid, refused = n, "registration refused again: {reason}");
        }
    }

    /// A process reports that it ran its local fallback `periods` times, `total_ms` in
    /// all, since it last reported; the container's record keeps the sums.
    pub fn fallback_report(
        &self,
        conn: u64,
        periods: u32,
        total_ms: u64,
        reason: &str,
    ) -> Result<(), DaemonError> {
        let mut g = self.lock();
        let key = g
            .conns
            .get(&conn)
            .map(|c| c.tenant.clone())
            .ok_or_else(|| DaemonError::Invalid(format!("connection {conn} not registered")))?;
        let Some(ident) = g.tenants.get(&key).map(|t| t.ident.clone()) else {
            return Ok(());
        };
        let Some(h) = health_rec(&mut g, &ident) else {
            return Ok(());
        };
        h.fallback_periods = h.fallback_periods.saturating_add(u64::from(periods));
        h.fallback_ms = h.fallback_ms.saturating_add(total_ms);
        h.last_fallback_reason = cut(reason, MAX_REASON);
        drop(g);
        if crate::log_budget::client_warning() {
            warn!(
                tenant = %key,
                periods,
                total_ms,
                "a process of this container enforced its share locally: {reason}"
            );
        } else {
            debug!(tenant = %key, periods, total_ms, "local enforcement reported: {reason}");
        }
        Ok(())
    }
}

/// Checks the identity's fields against their bounds, naming the field.
fn check_ident(ident: &ContainerIdent) -> Result<(), DaemonError> {
    if ident.key.is_empty() || ident.key.len() > 512 {
        return Err(DaemonError::Invalid(format!(
            "tenant key of {} bytes (1–512 allowed)",
            ident.key.len()
        )));
    }
    for (field, v, max) in [
        ("namespace", &ident.namespace, MAX_NAME),
        ("pod", &ident.pod, MAX_NAME),
        ("container", &ident.container, MAX_NAME),
        ("container_dir", &ident.container_dir, MAX_CONTAINER_DIR),
    ] {
        if v.len() > max {
            return Err(DaemonError::Invalid(format!(
                "{field} of {} bytes (at most {max} allowed)",
                v.len()
            )));
        }
    }
    if ident.overridden.len() > MAX_OVERRIDDEN
        || ident
            .overridden
            .iter()
            .any(|l| l.len() > MAX_OVERRIDDEN_LEN)
    {
        return Err(DaemonError::Invalid(format!(
            "{} overridden lines (at most {MAX_OVERRIDDEN} of {MAX_OVERRIDDEN_LEN} bytes allowed)",
            ident.overridden.len()
        )));
    }
    Ok(())
}

/// `s` cut to at most `max` bytes (at a character boundary).
fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The container's health record, made if needed; at [`MAX_HEALTH_RECORDS`] the record of
/// a container with no registered process makes room (None: none could).
pub(super) fn health_rec<'a>(
    g: &'a mut Inner,
    ident: &ContainerIdent,
) -> Option<&'a mut ContainerHealth> {
    if ident.key.is_empty() || ident.key.len() > 512 {
        return None;
    }
    if !g.health.contains_key(&ident.key) && g.health.len() >= MAX_HEALTH_RECORDS {
        let gone = g
            .health
            .keys()
            .find(|k| !g.tenants.contains_key(*k))
            .cloned()?;
        g.health.remove(&gone);
    }
    Some(
        g.health
            .entry(ident.key.clone())
            .or_insert_with(|| ContainerHealth {
                key: ident.key.clone(),
                namespace: cut(&ident.namespace, MAX_NAME),
                pod: cut(&ident.pod, MAX_NAME),
                container: cut(&ident.container, MAX_NAME),
                ..ContainerHealth::default()
            }),
    )
}
