//! `vgpuctl`: lists the daemon's tenants and GPUs with their usage, changes a tenant's
//! compute settings live (see `vgpu_daemon::ctl`).

use std::io::Write;

use clap::Parser;
use vgpu_daemon::ctl::{Cli, run};

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
    match rt.block_on(run(&cli)) {
        Ok(out) => {
            let _ = std::io::stdout().write_all(out.as_bytes());
        }
        Err(e) => {
            eprintln!("vgpuctl: {e:#}");
            std::process::exit(1);
        }
    }
}
