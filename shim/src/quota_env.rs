//! The quota readable by the application (issue 41, ADR 0058): engines that size a KV
//! cache from their GPU's memory (vLLM's `--kv-cache-memory`, SGLang's
//! `--mem-fraction-static`, a launch script's arithmetic) can read the container's quota
//! in bytes from [`QUOTA_ENV`] before touching CUDA.
//!
//! The shim sets it as it is loaded (an `.init_array` constructor: before `main`, so a
//! shell or Python started under the preload finds it in its own environment), from the
//! same configuration and quota-file rule the enforcement uses
//! (`process::environment_and_quota_file`, [`crate::config::Config::apply_quota_file`]):
//! one figure per GPU the process's CUDA ordinals will name, in that order (the
//! container's GPUs narrowed and ordered by the process's own `CUDA_VISIBLE_DEVICES`),
//! each the GPU's quota lowered by any `VGPU_MEMORY_LIMIT(_<i>)`. A value inherited from
//! a parent with another `CUDA_VISIBLE_DEVICES` is replaced. Nothing is set without a
//! quota file (the environment's own `VGPU_MEMORY_LIMIT` is then the quota), nor when
//! the process already runs threads (the environment cannot be written safely then), nor
//! when anything fails: the enforcement reports the error later, where it has a
//! `CUresult` to return. No driver call; one `stat`, one small file read.

use crate::config::MAX_DEVICES;

/// The variable: the quota of each GPU this process sees, in bytes, comma-separated in
/// CUDA ordinal order (`3145728000,1048576000`).
pub const QUOTA_ENV: &str = "VGPU_MEMORY_QUOTA_BYTES";

/// The value for the quotas `limits` of the visible ordinals (None: a device without a
/// quota, which makes the whole value unknown).
pub fn value(limits: &[Option<u64>]) -> Option<String> {
    let figures: Option<Vec<String>> = limits.iter().map(|l| l.map(|b| b.to_string())).collect();
    figures.map(|f| f.join(","))
}

/// What [`QUOTA_ENV`] should say in this process, from its environment and the
/// container's quota file (None: nothing to say).
fn wanted() -> Option<String> {
    let (mut cfg, text) = crate::process::environment_and_quota_file(true).ok()?;
    let text = text?;
    let granted = crate::devices::granted_of(&text)?;
    let tenant = std::env::var(vgpu_core::visible::CUDA_VISIBLE_DEVICES).ok();
    let chosen = crate::devices::selected(tenant.as_deref(), &granted);
    let ordinals = crate::devices::with_left_out(&chosen, &granted, &chosen);
    let path = cfg.quota_file();
    cfg.apply_quota_file(&path, &text, &ordinals).ok()?;
    value(cfg.limits.get(..chosen.len().min(MAX_DEVICES))?)
}

/// Whether this process runs one thread only (`/proc/self/task` has 2 + threads links).
fn single_threaded() -> bool {
    std::fs::metadata("/proc/self/task").is_ok_and(|m| {
        use std::os::unix::fs::MetadataExt;
        m.nlink() == 3
    })
}

/// Sets [`QUOTA_ENV`] (see the module's documentation).
fn publish() {
    if !single_threaded() {
        return;
    }
    let Some(v) = wanted() else { return };
    if std::env::var(QUOTA_ENV).ok().as_deref() == Some(v.as_str()) {
        return;
    }
    // SAFETY: `setenv` races only with another thread reading or writing the
    // environment; this process has one thread (checked just above, from the kernel's
    // count), the one running this constructor.
    unsafe { std::env::set_var(QUOTA_ENV, &v) };
}

extern "C" fn at_load() {
    // Never unwinds into the dynamic loader; a failure only leaves the variable unset.
    let _ = std::panic::catch_unwind(publish);
}

/// Runs [`at_load`] as the shim is loaded (the dynamic loader calls every function of
/// `.init_array`; for a preloaded library, before the program's `main`).
#[used]
#[unsafe(link_section = ".init_array")]
static AT_LOAD: extern "C" fn() = at_load;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_figure_per_visible_gpu_in_ordinal_order() {
        assert_eq!(
            value(&[Some(3000 << 20), Some(1000 << 20)]).as_deref(),
            Some("3145728000,1048576000")
        );
        assert_eq!(value(&[]).as_deref(), Some(""), "no GPU selected");
        assert_eq!(value(&[Some(1), None]), None, "a device without a quota");
    }
}
