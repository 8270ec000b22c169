//! Checks made before loading anything, each answering with the exact reason eBPF cannot
//! run here: capabilities, BTF, a cgroup2 attach point, tracefs, a bpf file system.

use std::path::Path;

use crate::error::EbpfError;

/// CAP_SYS_ADMIN's bit.
const CAP_SYS_ADMIN: u32 = caps::Capability::CAP_SYS_ADMIN as u32;
/// CAP_PERFMON's bit (tracepoints).
const CAP_PERFMON: u32 = caps::Capability::CAP_PERFMON as u32;
/// CAP_BPF's bit (loading programs, creating maps).
const CAP_BPF: u32 = caps::Capability::CAP_BPF as u32;

/// The capabilities missing from `effective` for loading and attaching the programs:
/// CAP_SYS_ADMIN alone suffices, else CAP_BPF and CAP_PERFMON are both needed.
pub fn missing_capabilities(effective: u64) -> Vec<&'static str> {
    let has = |bit: u32| effective & (1u64 << bit) != 0;
    if has(CAP_SYS_ADMIN) {
        return Vec::new();
    }
    let mut missing = Vec::new();
    if !has(CAP_BPF) {
        missing.push("CAP_BPF");
    }
    if !has(CAP_PERFMON) {
        missing.push("CAP_PERFMON");
    }
    if !missing.is_empty() {
        missing.insert(0, "CAP_SYS_ADMIN or");
    }
    missing
}

/// Checks this process's effective capabilities (read with the `caps` crate, `capget(2)`).
pub fn check_capabilities() -> Result<(), EbpfError> {
    let set = caps::read(None, caps::CapSet::Effective).map_err(EbpfError::Capabilities)?;
    let effective = set.iter().fold(0u64, |mask, cap| mask | cap.bitmask());
    let missing = missing_capabilities(effective);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(EbpfError::MissingCapabilities {
            missing: missing.join(" "),
            effective,
        })
    }
}

/// Checks that the kernel exposes its BTF.
pub fn check_btf() -> Result<(), EbpfError> {
    let path = Path::new("/sys/kernel/btf/vmlinux");
    if path.exists() {
        Ok(())
    } else {
        Err(EbpfError::NoBtf(path.to_owned()))
    }
}

/// Checks that `dir` is a cgroup2 directory (only cgroup2 has `cgroup.controllers`).
pub fn check_cgroup2(dir: &Path) -> Result<(), EbpfError> {
    if dir.join("cgroup.controllers").exists() {
        Ok(())
    } else {
        Err(EbpfError::NotCgroup2(dir.to_owned()))
    }
}

/// Checks that tracefs is mounted where aya looks for it.
pub fn check_tracefs() -> Result<(), EbpfError> {
    let mounted = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .any(|dir| {
            Path::new(dir)
                .join("events/sched/sched_process_exit")
                .exists()
        });
    if mounted {
        Ok(())
    } else {
        Err(EbpfError::NoTracefs)
    }
}

/// The first cgroup2 mount point listed in a `/proc/self/mounts` text (pure cgroup2 nodes:
/// /sys/fs/cgroup; hybrid ones: /sys/fs/cgroup/unified).
pub fn cgroup2_mount(mounts: &str) -> Option<&str> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_, dir, kind) = (fields.next()?, fields.next()?, fields.next()?);
        (kind == "cgroup2").then_some(dir)
    })
}

/// Whether `dir` lies on a bpf file system, per a `/proc/self/mounts` text.
pub fn on_bpffs(mounts: &str, dir: &Path) -> bool {
    mounts.lines().any(|line| {
        let mut fields = line.split_whitespace();
        match (fields.next(), fields.next(), fields.next()) {
            (Some(_), Some(mount), Some("bpf")) => dir.starts_with(mount),
            _ => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_parse_and_name_what_is_missing() {
        assert!(missing_capabilities(0x0000_01ff_feff_ffff).is_empty());
        assert_eq!(
            missing_capabilities(0),
            vec!["CAP_SYS_ADMIN or", "CAP_BPF", "CAP_PERFMON"]
        );
        let bpf_only = 1u64 << CAP_BPF;
        assert_eq!(
            missing_capabilities(bpf_only),
            vec!["CAP_SYS_ADMIN or", "CAP_PERFMON"]
        );
        assert!(missing_capabilities(bpf_only | 1 << CAP_PERFMON).is_empty());
        assert_eq!((CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF), (21, 38, 39));
    }

    #[test]
    fn the_caps_crate_reads_the_same_effective_set_as_proc_status() {
        let set = caps::read(None, caps::CapSet::Effective).unwrap();
        let mask = set.iter().fold(0u64, |m, c| m | c.bitmask());
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let proc_mask = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .map(|m| u64::from_str_radix(m.trim(), 16).unwrap())
            .unwrap();
        assert_eq!(mask, proc_mask);
    }

    #[test]
    fn cgroup2_mount_is_found_in_pure_and_hybrid_layouts() {
        let hybrid = "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(cgroup2_mount(hybrid), Some("/sys/fs/cgroup/unified"));
        assert_eq!(
            cgroup2_mount("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n"),
            Some("/sys/fs/cgroup")
        );
        assert_eq!(
            cgroup2_mount("cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n"),
            None
        );
    }

    #[test]
    fn bpffs_membership_follows_the_mount_table() {
        let mounts = "bpf /sys/fs/bpf bpf rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n";
        assert!(on_bpffs(mounts, Path::new("/sys/fs/bpf/vgpu")));
        assert!(!on_bpffs(mounts, Path::new("/tmp/vgpu")));
    }
}
