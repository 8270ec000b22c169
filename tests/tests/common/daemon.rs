//! A node daemon as its binary runs it (library, timer thread, socket server), for the
//! tests whose containers register with one.

use std::path::Path;
use std::sync::Arc;

use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};
use vgpu_daemon::daemon::{Config, Daemon};

/// A daemon serving on a socket until dropped.
pub struct Served {
    /// The daemon (its snapshot shows the tenants).
    pub daemon: Arc<Daemon>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    _timer: std::thread::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Starts a daemon on `socket` (default share 10 %, burst, best-effort); call inside a
/// tokio runtime.
pub fn serve(socket: &Path) -> Served {
    let daemon = Daemon::new(Config {
        socket: socket.to_owned(),
        params: vgpu_daemon::scheduler::Params::default(),
        queue_ahead_us: 2000,
        trusted_quota_file: None,
        default_settings: ComputeSettings {
            share_pct: 10,
            policy: ComputePolicy::Burst,
            priority: Priority::BestEffort,
        },
        state_file: None,
    });
    let timer = daemon.spawn_timer().expect("timer");
    let listener = vgpu_daemon::server::bind(socket).expect("bind the daemon socket");
    let server = tokio::spawn(vgpu_daemon::server::serve(daemon.clone(), listener));
    Served {
        daemon,
        server,
        _timer: timer,
    }
}
