//! NVML's process lists as the container sees them: only its own processes, each under
//! its PID in the container's namespace (NVML reports host PIDs) and with its memory as
//! the container counts it (what its quota covers). The hooks hand over the buffer the
//! real NVML filled, as bytes; entries are packed to the front and their count returned.

use crate::process::Shim;

/// `nvmlProcessInfo_v1_t`: pid, usedGpuMemory.
pub const PROC_V1: usize = 16;
/// `nvmlProcessInfo_t` (v2/v3): pid, usedGpuMemory, gpuInstanceId, computeInstanceId.
pub const PROC_V2: usize = 24;

/// Keeps the container's processes of a process list (`buf`: entries of `stride` bytes
/// whose pid is the `u32` at offset 0 and usedGpuMemory the `u64` at offset 8, in every
/// entry version) on CUDA device `dev`; returns how many are kept.
pub fn container_processes(
    shim: &Shim,
    dev: Option<usize>,
    buf: &mut [u8],
    stride: usize,
) -> usize {
    shim.region.reap(Some(shim.slot));
    keep_processes(buf, stride, |pid| {
        let used = shim
            .region
            .pid_used(pid, shim.rdev(dev.unwrap_or(usize::MAX)))?;
        Some((shim.region.container_pid(pid).unwrap_or(pid), used))
    })
}

/// Keeps the container's processes of a utilization sample list (`buf`: samples of
/// `stride` bytes whose pid is the `u32` at offset 0); returns how many are kept.
pub fn container_samples(shim: &Shim, buf: &mut [u8], stride: usize) -> usize {
    keep_samples(buf, stride, |pid| shim.region.container_pid(pid))
}

/// Keeps the entries for which `own(pid)` names `(pid as the container knows it, bytes
/// it uses)`, rewritten to those, packed to the front of `buf`; returns how many.
fn keep_processes(
    buf: &mut [u8],
    stride: usize,
    mut own: impl FnMut(u32) -> Option<(u32, u64)>,
) -> usize {
    keep(buf, stride, |entry| {
        let (pid, used) = own(read_u32(entry))?;
        Some(move |dst: &mut [u8]| {
            dst[..4].copy_from_slice(&pid.to_ne_bytes());
            dst[8..16].copy_from_slice(&used.to_ne_bytes());
        })
    })
}

/// Keeps the samples for which `own(pid)` names the pid as the container knows it,
/// rewritten to it, packed to the front of `buf`; returns how many.
fn keep_samples(buf: &mut [u8], stride: usize, mut own: impl FnMut(u32) -> Option<u32>) -> usize {
    keep(buf, stride, |entry| {
        let pid = own(read_u32(entry))?;
        Some(move |dst: &mut [u8]| dst[..4].copy_from_slice(&pid.to_ne_bytes()))
    })
}

/// Packs to the front of `buf` the `stride`-byte entries `decide` keeps, each then
/// rewritten by what `decide` returned for it; returns how many.
fn keep<W: FnOnce(&mut [u8])>(
    buf: &mut [u8],
    stride: usize,
    mut decide: impl FnMut(&[u8]) -> Option<W>,
) -> usize {
    if stride == 0 {
        return 0;
    }
    let n = buf.len() / stride;
    let mut kept = 0;
    for i in 0..n {
        let Some(rewrite) = decide(&buf[i * stride..(i + 1) * stride]) else {
            continue;
        };
        if kept != i {
            buf.copy_within(i * stride..(i + 1) * stride, kept * stride);
        }
        rewrite(&mut buf[kept * stride..(kept + 1) * stride]);
        kept += 1;
    }
    kept
}

fn read_u32(entry: &[u8]) -> u32 {
    u32::from_ne_bytes(entry[..4].try_into().expect("an entry holds a 4-byte pid"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pid: u32, used: u64, tail: u8) -> Vec<u8> {
        let mut e = vec![tail; PROC_V2];
        e[..4].copy_from_slice(&pid.to_ne_bytes());
        e[8..16].copy_from_slice(&used.to_ne_bytes());
        e
    }

    #[test]
    fn only_the_containers_processes_are_kept_under_its_pids() {
        let mut buf: Vec<u8> =
            [entry(100, 1, 0xa), entry(200, 2, 0xb), entry(300, 3, 0xc)].concat();
        // Host pid 200 is not the container's; 100 and 300 are its pids 1 and 7.
        let kept = keep_processes(&mut buf, PROC_V2, |pid| match pid {
            100 => Some((1, 10)),
            300 => Some((7, 30)),
            _ => None,
        });
        assert_eq!(kept, 2);
        assert_eq!(&buf[..PROC_V2], &entry(1, 10, 0xa)[..]);
        assert_eq!(&buf[PROC_V2..2 * PROC_V2], &entry(7, 30, 0xc)[..]);
    }

    #[test]
    fn samples_keep_everything_but_the_pid() {
        let mut buf: Vec<u8> = [entry(5, 55, 1), entry(6, 66, 2)].concat();
        let kept = keep_samples(&mut buf, PROC_V2, |pid| (pid == 6).then_some(2));
        assert_eq!(kept, 1);
        assert_eq!(&buf[..PROC_V2], &entry(2, 66, 2)[..]);
    }
}
