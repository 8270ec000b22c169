//! Shared by the reporting tests: a daemon populated through its own registration path.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use vgpu_core::sched_proto::{
    ComputePolicy, ComputeSettings, ContainerIdent, DaemonMsg, GpuRegistration, PROTO_VERSION,
    Priority,
};
use vgpu_daemon::arbiter::Params;
use vgpu_daemon::daemon::{Config, Daemon, Registered};

pub const GPU0: &str = "GPU-00000000-0000-4000-8000-000000000000";
pub const GPU1: &str = "GPU-11111111-0000-4000-8000-000000000000";

/// A daemon with nothing registered (no timer thread: nothing here needs slices).
pub fn daemon() -> Arc<Daemon> {
    Daemon::new(config())
}

/// The configuration of [`daemon`]: default share 10 %, untrusted, no state file.
pub fn config() -> Config {
    Config {
        socket: PathBuf::from("/nonexistent/daemon.sock"),
        params: Params::default(),
        trusted_quota_file: None,
        default_settings: ComputeSettings {
            share_pct: 10,
            policy: ComputePolicy::Burst,
            priority: Priority::BestEffort,
        },
        state_file: None,
        gpus: Vec::new(),
    }
}

/// A registered process; keep it alive as long as the process should stay registered.
pub struct Proc {
    pub reg: Registered,
    pub rx: UnboundedReceiver<DaemonMsg>,
}

/// Registers process `pid` of tenant `key` (pod `ns/pod`, container `c`) on `gpus`
/// (UUID, share %, policy, memory quota), as the shims' server does.
pub fn register(
    d: &Daemon,
    pid: u32,
    key: &str,
    ns: &str,
    pod: &str,
    c: &str,
    gpus: &[(&str, u32, ComputePolicy, Option<u64>)],
) -> Proc {
    let (tx, rx) = unbounded_channel();
    let ident = ContainerIdent {
        key: key.to_owned(),
        namespace: ns.to_owned(),
        pod: pod.to_owned(),
        container: c.to_owned(),
        container_dir: String::new(),
        overridden: Vec::new(),
    };
    let regs = gpus
        .iter()
        .enumerate()
        .map(|(i, (uuid, share, policy, quota))| GpuRegistration {
            uuid: (*uuid).to_owned(),
            ordinal: u32::try_from(i).expect("few GPUs"),
            settings: ComputeSettings {
                share_pct: *share,
                policy: *policy,
                priority: Priority::BestEffort,
            },
            memory_quota: *quota,
        })
        .collect();
    let reg = d
        .register(pid, PROTO_VERSION, ident, regs, tx)
        .expect("registration accepted");
    Proc { reg, rx }
}

/// The registration of `uuid` with share `share` % (burst, no memory quota).
pub fn gpu(uuid: &str, ordinal: u32, share: u32) -> GpuRegistration {
    GpuRegistration {
        uuid: uuid.to_owned(),
        ordinal,
        settings: ComputeSettings {
            share_pct: share,
            policy: ComputePolicy::Burst,
            priority: Priority::BestEffort,
        },
        memory_quota: None,
    }
}

/// The container identity of tenant `key` (no pod).
pub fn ident(key: &str) -> ContainerIdent {
    ContainerIdent {
        key: key.to_owned(),
        ..ContainerIdent::default()
    }
}

/// The next grant or revoke `p` receives within `limit` (generation, whether a grant).
pub fn next_slice_msg(p: &mut Proc, limit: Duration) -> Option<(u32, bool)> {
    next_slice_msg_queue(p, limit).map(|(g, grant, _)| (g, grant))
}

/// [`next_slice_msg`], with a grant's queue-ahead bound (µs; None: the `Welcome`'s).
pub fn next_slice_msg_queue(p: &mut Proc, limit: Duration) -> Option<(u32, bool, Option<u64>)> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        match p.rx.try_recv() {
            Ok(DaemonMsg::Grant {
                generation,
                queue_ahead_us,
                ..
            }) => return Some((generation, true, queue_ahead_us)),
            Ok(DaemonMsg::Revoke { generation, .. }) => return Some((generation, false, None)),
            Ok(_) => {}
            Err(_) => std::thread::sleep(Duration::from_micros(200)),
        }
    }
    None
}

/// The generation of the next grant (`grant`) or revoke `p` receives within `within`;
/// anything else fails, naming `what`.
pub fn expect_slice(p: &mut Proc, grant: bool, within: Duration, what: &str) -> u32 {
    match next_slice_msg(p, within) {
        Some((g, is_grant)) if is_grant == grant => g,
        other => panic!("{what}: got {other:?} within {within:?}"),
    }
}
