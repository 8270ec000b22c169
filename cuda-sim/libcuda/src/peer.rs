//! Peer-to-peer between the simulated GPUs: whether two devices can map each other's
//! memory (`cuDeviceCanAccessPeer`, `cuDeviceGetP2PAttribute`), peer access between
//! contexts (`cuCtxEnablePeerAccess` / `cuCtxDisablePeerAccess`), and peer copies
//! (`cuMemcpyPeer(Async)`) that take device time by the class of the link between the two
//! GPUs, on the device's virtual clock (`crate::exec`). Everything comes from the node's topology (`vgpu_cuda_sim::topology`), read once
//! per process from the state directory. Device arguments are the process's CUDA ordinals
//! (`CUDA_VISIBLE_DEVICES` renumbers), mapped to the node's devices by [`Driver::device`].

use std::collections::BTreeSet;
use std::sync::{Mutex, OnceLock};

use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_sim::topology::{self, LinkClass, Topology};

use crate::exec::{Stream, Work};
use crate::rt::{CuResult, Driver, Kind, from_ptr};

/// The node's topology, read on first use.
fn topo(d: &Driver) -> CuResult<&'static Topology> {
    static TOPO: OnceLock<Result<Topology, CUresult>> = OnceLock::new();
    TOPO.get_or_init(|| {
        topology::load(d.state.dir(), d.state.device_count()).map_err(|e| {
            eprintln!(
                "libcuda (vgpu cuda-sim): {}",
                vgpu_cuda_sim::node_state::error_chain(&e)
            );
            CUDA_ERROR_UNKNOWN
        })
    })
    .as_ref()
    .map_err(|e| *e)
}

/// NUMA nodes of the node's topology (0 where it cannot be read).
pub fn numa_nodes(d: &Driver) -> usize {
    topo(d).map_or(0, |t| t.numa.len())
}

/// Peer access enabled, as (context, peer context) handle pairs.
fn enabled() -> std::sync::MutexGuard<'static, BTreeSet<(u64, u64)>> {
    static ENABLED: Mutex<BTreeSet<(u64, u64)>> = Mutex::new(BTreeSet::new());
    // A panic while holding it leaves a plain set.
    ENABLED.lock().unwrap_or_else(|p| p.into_inner())
}

/// `cuDeviceCanAccessPeer`: 1 over NVLink or PCIe within a socket, 0 across sockets and
/// for a device and itself.
pub fn can_access(d: &Driver, dev: CUdevice, peer: CUdevice) -> CuResult<bool> {
    let (a, b) = (d.device(dev)?, d.device(peer)?);
    Ok(topo(d)?.p2p_supported(a, b))
}

/// `cuDeviceGetP2PAttribute`.
pub fn attribute(d: &Driver, attr: i32, src: CUdevice, dst: CUdevice) -> CuResult<i32> {
    let (a, b) = (d.device(src)?, d.device(dst)?);
    if a == b {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    let t = topo(d)?;
    let access = t.p2p_supported(a, b);
    let nvlink = t.nvlinks_between(a, b) > 0;
    Ok(match attr {
        p2p_attr::PERFORMANCE_RANK => performance_rank(t.link_class(a, b), access),
        p2p_attr::ACCESS_SUPPORTED => i32::from(access),
        p2p_attr::NATIVE_ATOMIC_SUPPORTED => i32::from(nvlink),
        p2p_attr::CUDA_ARRAY_ACCESS_SUPPORTED => i32::from(access),
        p2p_attr::ONLY_PARTIAL_NATIVE_ATOMIC_SUPPORTED => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

/// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`: 0 is the best link; NVLink ranks above
/// every PCIe path, nearer PCIe paths above farther ones. Without access, 0.
fn performance_rank(class: LinkClass, access: bool) -> i32 {
    if !access {
        return 0;
    }
    match class {
        LinkClass::SelfLink | LinkClass::NvLink(_) => 0,
        LinkClass::Pcie(l) => (l as i32) / 10,
    }
}

/// The context behind a `CUcontext` argument.
fn ctx_of(d: &Driver, c: CUcontext) -> CuResult<std::sync::Arc<crate::rt::Ctx>> {
    d.ctx(from_ptr(c.cast(), Kind::Ctx).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?)
}

/// `cuCtxEnablePeerAccess`: the current context may map `peer`'s memory.
pub fn enable(d: &Driver, peer: CUcontext, flags: u32) -> CuResult<()> {
    let cur = d.current()?;
    let p = ctx_of(d, peer)?;
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if p.dev == cur.dev {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    if !topo(d)?.p2p_supported(cur.dev, p.dev) {
        return Err(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    }
    if !enabled().insert((cur.id, p.id)) {
        return Err(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    }
    Ok(())
}

/// `cuCtxDisablePeerAccess`.
pub fn disable(d: &Driver, peer: CUcontext) -> CuResult<()> {
    let cur = d.current()?;
    let p = ctx_of(d, peer)?;
    if !enabled().remove(&(cur.id, p.id)) {
        return Err(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    }
    Ok(())
}

/// Whether the current context has enabled peer access to `peer` (for tests and tools).
pub fn is_enabled(cur: u64, peer: u64) -> bool {
    enabled().contains(&(cur, peer))
}

/// A checked peer copy: the node's devices of both sides and the link's bandwidth.
struct PeerCopy {
    src_dev: usize,
    dst_dev: usize,
    gbps: u64,
}

fn check(
    d: &Driver,
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    n: u64,
) -> CuResult<PeerCopy> {
    let (dc, sc) = (ctx_of(d, dst_ctx)?, ctx_of(d, src_ctx)?);
    {
        let o = d.objects();
        let on_dst = crate::mem::check_device_range(&o, dst, n)?;
        let on_src = crate::mem::check_device_range(&o, src, n)?;
        if on_dst != dc.dev || on_src != sc.dev {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    d.check_alive(dc.dev)?;
    d.check_alive(sc.dev)?;
    let t = topo(d)?;
    let gbps = if sc.dev == dc.dev {
        u64::from(d.state.info(sc.dev).bandwidth_gbps)
    } else {
        t.copy_gbps(sc.dev, dc.dev)
    };
    Ok(PeerCopy {
        src_dev: sc.dev,
        dst_dev: dc.dev,
        gbps: gbps.max(1),
    })
}

/// `cuMemcpyPeer`: waits for the destination's queued work, then copies on the source
/// device's worker after its queued work, as `cuMemcpyPeerAsync` does, taking
/// `bytes / link bandwidth` of device time on that device's clock, and returns when it
/// completed. Peer access need not be enabled: without it the real driver stages through
/// host memory; the simulator charges the same link class.
pub fn copy_sync(
    d: &'static Driver,
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    n: usize,
) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    let c = check(d, dst, dst_ctx, src, src_ctx, n as u64)?;
    d.worker(c.dst_dev).drain();
    let w = d.worker(c.src_dev);
    let seq = w.submit(Work::PeerCopy {
        dst: dst as usize,
        src: src as usize,
        len: n,
        gbps: c.gbps,
    });
    w.wait_for(seq);
    Ok(())
}

/// `cuMemcpyPeerAsync`: queued on `stream`, taking `bytes / link bandwidth` of device
/// time there.
pub fn copy_async(
    d: &'static Driver,
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    n: usize,
    stream: &Stream,
) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    let c = check(d, dst, dst_ctx, src, src_ctx, n as u64)?;
    stream.enqueue(
        d,
        Work::PeerCopy {
            dst: dst as usize,
            src: src as usize,
            len: n,
            gbps: c.gbps,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_cuda_sim::topology::PcieLevel;

    #[test]
    fn nvlink_ranks_first_and_no_access_ranks_zero() {
        assert_eq!(performance_rank(LinkClass::NvLink(12), true), 0);
        assert!(
            performance_rank(LinkClass::Pcie(PcieLevel::Single), true)
                < performance_rank(LinkClass::Pcie(PcieLevel::Node), true)
        );
        assert_eq!(
            performance_rank(LinkClass::Pcie(PcieLevel::System), false),
            0
        );
    }
}
