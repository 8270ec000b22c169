//! `vgpu-smi`: show the node's GPUs and compute processes through NVML.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use vgpu_smi::{Config, DEFAULT_NVML_LIB, run};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "An nvidia-smi-like view of the node's GPUs and their compute processes, read through NVML",
    after_help = "On the simulated node: LD_LIBRARY_PATH=target/cuda-sim VGPU_SIM_DIR=... vgpu-smi"
)]
struct Cli {
    /// NVML library to load (a path, or a name searched on LD_LIBRARY_PATH)
    #[arg(long, value_name = "PATH", default_value = DEFAULT_NVML_LIB)]
    nvml_lib: PathBuf,
    /// Refresh every SECS seconds (until interrupted, or --count views)
    #[arg(long, value_name = "SECS")]
    watch: Option<f64>,
    /// Number of views to show with --watch
    #[arg(long, value_name = "N", requires = "watch")]
    count: Option<u64>,
    /// Print each view as one line of JSON
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the GPU connection matrix, as `nvidia-smi topo -m` does
    Topo {
        /// The matrix (the only view; accepted as nvidia-smi spells it)
        #[arg(short = 'm', long = "matrix")]
        matrix: bool,
    },
}

fn config(cli: Cli) -> anyhow::Result<Config> {
    let watch = match cli.watch {
        None => None,
        Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Some(Duration::from_secs_f64(s)),
        Some(s) => anyhow::bail!("--watch {s}: expected seconds between 0 and 86400"),
    };
    if cli.count == Some(0) {
        anyhow::bail!("--count 0: expected at least one view");
    }
    let topo = matches!(cli.command, Some(Command::Topo { .. }));
    if topo && cli.watch.is_some() {
        anyhow::bail!("topo: --watch applies to the GPU table only");
    }
    Ok(Config {
        nvml_lib: cli.nvml_lib,
        watch,
        count: cli.count,
        json: cli.json,
        topo,
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = config(cli).and_then(|c| Ok(run(&c, &mut std::io::stdout().lock())?));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Some causes repeat their own cause in their message: print each text once.
            let mut msg = String::new();
            for cause in e.chain().map(ToString::to_string) {
                if !msg.contains(&cause) {
                    if !msg.is_empty() {
                        msg.push_str(": ");
                    }
                    msg.push_str(&cause);
                }
            }
            eprintln!("vgpu-smi: {msg}");
            ExitCode::FAILURE
        }
    }
}
