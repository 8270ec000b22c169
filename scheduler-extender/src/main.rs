//! `vgpu-scheduler-extender`: thin binary over the library.

use clap::{Parser, Subcommand};
use vgpu_scheduler_extender::replay;

/// vgpu's kube-scheduler extender and packing-benchmark replay.
#[derive(Debug, Parser)]
#[command(name = "vgpu-scheduler-extender", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a trace through a placement policy (the packing benchmark).
    Replay(replay::ReplayArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => replay::run(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
