//! `vgpu-scheduler-extender`: thin binary over the library.

use clap::{Parser, Subcommand};
use vgpu_scheduler_extender::{extender, replay};

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
    /// Serve kube-scheduler's extender verbs (filter, prioritize, bind, preempt).
    Serve(extender::run::ServeArgs),
    /// Measure the extender's filter/prioritize/bind latency at scale (in memory).
    BenchExtender(extender::bench::BenchArgs),
    /// Print the VgpuQuotaPolicy CustomResourceDefinition (JSON) generated from its type.
    Crd,
}

/// Installs the tracing subscriber (RUST_LOG, default info) for the long-running service.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
}

fn serve(args: extender::run::ServeArgs) -> anyhow::Result<()> {
    init_tracing();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(extender::run::run(args))?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {
        Command::Replay(args) => replay::run(&args).map_err(Into::into),
        Command::Serve(args) => serve(args),
        Command::BenchExtender(args) => extender::bench::run(&args).map_err(Into::into),
        Command::Crd => {
            print!("{}", extender::quota::crd::crd_json());
            Ok(())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
