//! `vgpuctl`: lists the daemon's tenants and GPUs with their usage, changes a tenant's
//! compute settings live, shows the eBPF gate's events (see `vgpu_daemon::ctl`).

use clap::Parser;
use vgpu_daemon::ctl::{Cli, run_to};

fn main() {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vgpuctl: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let mut stdout = std::io::stdout();
    match rt.block_on(run_to(&cli, &mut stdout)) {
        Ok(()) => {}
        Err(e) => {
            eprintln!("vgpuctl: {e:#}");
            std::process::exit(1);
        }
    }
}
