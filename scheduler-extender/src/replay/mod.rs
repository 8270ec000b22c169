//! The packing benchmark: replays a production trace through a placement policy.
//!
//! The method follows `benchmarks.md` (FGD, ATC'23): per seed, shuffle the task list,
//! tune it to a multiple of the cluster's GPU capacity, schedule one task at a time
//! with no departures, and record the GPU allocation ratio against arrived demand.

use clap::Args;

/// Command-line arguments of `vgpu-scheduler-extender replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Node list CSV (`sn,cpu_milli,memory_mib,gpu,model`).
    #[arg(long)]
    pub nodes: std::path::PathBuf,
    /// Task list CSV (`name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,...`).
    #[arg(long)]
    pub pods: std::path::PathBuf,
    /// Placement policy, or `all` to run every policy side by side.
    #[arg(long, default_value = "vgpu")]
    pub policy: String,
    /// Tune the task list to this multiple of the cluster's GPU capacity.
    #[arg(long, default_value_t = 1.3)]
    pub tune_ratio: f64,
    /// Seeds: `42-51`, `42,43` or `42`.
    #[arg(long, default_value = "42-51")]
    pub seeds: String,
}

/// Runs the replay (not implemented yet in this skeleton).
pub fn run(args: &ReplayArgs) -> anyhow::Result<()> {
    anyhow::bail!("replay not implemented yet: {args:?}")
}
