//! Device memory: allocations charged against the node's shared capacity and backed by
//! lazily committed host memory (device pointers are addresses of `MAP_NORESERVE`
//! mappings, so data really round-trips and 80 GiB cost nothing until touched), copies,
//! memsets, host memory, stream-ordered pools, the virtual memory management API and
//! arrays.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use vgpu_cuda_abi::cuda::*;

use crate::exec::{CopySrc, Stream, Work, memset_rows};
use crate::rt::{CuResult, Driver, Kind, Objects, new_handle};

/// What a memory range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocKind {
    /// `cuMemAlloc`, `cuMemAllocPitch`.
    Device,
    /// `cuMemAllocManaged` (resident on the device for accounting).
    Managed,
    /// Pinned host memory from `cuMemAllocHost`/`cuMemHostAlloc`.
    Host,
    /// Application memory registered with `cuMemHostRegister` (not ours to unmap).
    Registered,
    /// A stream-ordered allocation from pool `.0`.
    Pool(u64),
    /// A VMM address reservation.
    VmmRange,
    /// Another process's allocation opened with `cuIpcOpenMemHandle` (charged there).
    IpcImport,
}

/// A VMM mapping inside a reservation: (address, length, handle, accessible).
pub type VmmMapping = (u64, u64, u64, bool);

/// One memory range known to the driver.
#[derive(Debug, Clone)]
pub struct Alloc {
    /// First byte.
    pub base: u64,
    /// Requested size.
    pub size: u64,
    /// Length of our mapping (0 for registered memory).
    pub map_len: usize,
    /// Device bytes charged for it.
    pub charged: u64,
    /// Device (for device kinds).
    pub dev: usize,
    /// Owning context.
    pub ctx: u64,
    /// Kind.
    pub kind: AllocKind,
    /// VMM mappings inside a reservation.
    pub maps: Vec<VmmMapping>,
}

impl Alloc {
    fn is_device(&self) -> bool {
        matches!(
            self.kind,
            AllocKind::Device
                | AllocKind::Managed
                | AllocKind::Pool(_)
                | AllocKind::VmmRange
                | AllocKind::IpcImport
        )
    }
}

/// A physical allocation of the VMM API (`cuMemCreate`, or imported from a shareable
/// handle).
#[derive(Debug)]
pub struct VmmHandle {
    /// Device, None for host memory (`CU_MEM_LOCATION_TYPE_HOST*`).
    pub dev: Option<usize>,
    /// The location it was created at, as the application named it.
    pub location: CUmemLocation,
    /// `requestedHandleTypes` (what it may be exported as).
    pub handle_types: u32,
    /// Size.
    pub size: u64,
    /// Charged device bytes (0 for host memory and imported handles: the exporter's
    /// process holds the charge).
    pub charged: u64,
    /// Backing memfd.
    pub fd: i32,
    /// Live mappings.
    pub maps: u32,
    /// References (create + retains − releases).
    pub refs: u32,
}

/// The allocation granularity of host-located VMM memory (2 MiB, as for the devices).
pub const HOST_GRANULARITY: u64 = 2 << 20;

/// A stream-ordered memory pool.
#[derive(Debug)]
pub struct Pool {
    /// Handle.
    pub id: u64,
    /// Device.
    pub dev: usize,
    /// Bytes kept reserved when freed (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`).
    pub threshold: AtomicU64,
    /// Charged bytes not currently allocated.
    pub cached: AtomicU64,
    /// Charged bytes allocated.
    pub used: AtomicU64,
    /// High-water mark of `used`.
    pub used_high: AtomicU64,
    /// High-water mark of `used + cached`.
    pub reserved_high: AtomicU64,
}

impl Pool {
    /// A new pool on device `dev`.
    pub fn new(dev: usize) -> Arc<Pool> {
        Arc::new(Pool {
            id: new_handle(Kind::Pool),
            dev,
            threshold: AtomicU64::new(0),
            cached: AtomicU64::new(0),
            used: AtomicU64::new(0),
            used_high: AtomicU64::new(0),
            reserved_high: AtomicU64::new(0),
        })
    }

    /// Returns cached bytes above `keep` to the device.
    pub fn trim(&self, drv: &Driver, keep: u64) {
        let mut cur = self.cached.load(Ordering::Acquire);
        while cur > keep {
            match self
                .cached
                .compare_exchange(cur, keep, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    drv.uncharge(self.dev, cur - keep);
                    return;
                }
                Err(c) => cur = c,
            }
        }
    }
}

/// A CUDA array (or a level of a mipmapped array).
#[derive(Debug)]
pub struct ArrayObj {
    /// Handle.
    pub id: u64,
    /// Device.
    pub dev: usize,
    /// Descriptor.
    pub desc: CUDA_ARRAY3D_DESCRIPTOR,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Total bytes.
    pub bytes: u64,
    /// Backing address.
    pub base: usize,
    /// Our mapping's length (0 for levels, which live in their parent's mapping).
    pub map_len: usize,
    /// Charged bytes (0 for levels).
    pub charged: u64,
    /// Level arrays of a mipmapped array.
    pub levels: Vec<u64>,
}

fn page_round(n: u64) -> CuResult<usize> {
    let r = n.checked_add(4095).ok_or(CUDA_ERROR_OUT_OF_MEMORY)? & !4095;
    usize::try_from(r).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)
}

/// Maps `len` bytes of lazily committed, zero-filled memory.
fn map_anon(len: usize, noreserve: bool) -> CuResult<usize> {
    let flags =
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if noreserve { libc::MAP_NORESERVE } else { 0 };
    // SAFETY: an anonymous mapping at a kernel-chosen address; the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    } else {
        Ok(p as usize)
    }
}

fn unmap(base: usize, len: usize) {
    if len > 0 {
        // SAFETY: `base`/`len` describe a mapping this driver created and still owns.
        unsafe { libc::munmap(base as *mut libc::c_void, len) };
    }
}

/// Allocates `size` bytes of device memory of `kind` in context `ctx` on `dev`.
pub fn alloc_device(
    drv: &'static Driver,
    ctx: u64,
    dev: usize,
    size: u64,
    kind: AllocKind,
) -> CuResult<u64> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    drv.check_alive(dev)?;
    let charged = drv.charge(dev, size, true)?;
    let len = match page_round(size) {
        Ok(l) => l,
        Err(e) => {
            drv.uncharge(dev, charged);
            return Err(e);
        }
    };
    let base = match map_anon(len, true) {
        Ok(b) => b as u64,
        Err(e) => {
            drv.uncharge(dev, charged);
            return Err(e);
        }
    };
    drv.objects().allocs.insert(
        base,
        Alloc {
            base,
            size,
            map_len: len,
            charged,
            dev,
            ctx,
            kind,
            maps: Vec::new(),
        },
    );
    Ok(base)
}

/// `cuMemFree`: frees a device or managed allocation (after the device's queued work).
pub fn free(drv: &'static Driver, ptr: u64) -> CuResult<()> {
    let a = {
        let o = drv.objects();
        let a = o.allocs.get(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !matches!(
            a.kind,
            AllocKind::Device | AllocKind::Managed | AllocKind::Pool(_)
        ) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        a.dev
    };
    drv.worker(a).drain();
    free_now(drv, ptr);
    Ok(())
}

/// Frees `ptr` at once (the caller has ordered it after the work that uses it).
pub fn free_now(drv: &Driver, ptr: u64) {
    let (a, exported) = {
        let mut o = drv.objects();
        let Some(a) = o.allocs.remove(&ptr) else {
            return;
        };
        (a, o.ipc.remove(&ptr))
    };
    if let Some((fd, _)) = exported {
        // SAFETY: closing the memfd that backed this exported allocation (ours).
        unsafe { libc::close(fd) };
    }
    unmap(a.base as usize, a.map_len);
    match a.kind {
        AllocKind::Pool(pid) => {
            let pool = drv.objects().pools.get(&pid).cloned().or_else(|| {
                drv.default_pools
                    .get(a.dev)
                    .and_then(|p| p.get())
                    .filter(|p| p.id == pid)
                    .cloned()
            });
            match pool {
                Some(p) => {
                    sub(&p.used, a.charged);
                    p.cached.fetch_add(a.charged, Ordering::AcqRel);
                    p.trim(drv, p.threshold.load(Ordering::Acquire));
                }
                None => drv.uncharge(a.dev, a.charged),
            }
        }
        _ => {
            if a.charged > 0 {
                drv.uncharge(a.dev, a.charged);
            }
        }
    }
}

fn sub(a: &AtomicU64, v: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
        Some(x.saturating_sub(v))
    });
}

/// Frees everything a destroyed context allocated; returns the bytes released.
pub fn free_ctx_memory(drv: &Driver, ctx: u64) -> u64 {
    let ptrs: Vec<(u64, AllocKind)> = drv
        .objects()
        .allocs
        .values()
        .filter(|a| a.ctx == ctx && a.kind != AllocKind::Registered)
        .map(|a| (a.base, a.kind))
        .collect();
    let mut n = 0;
    for (p, k) in ptrs {
        if k == AllocKind::VmmRange {
            continue; // address reservations are process-wide
        }
        if let Some(a) = drv.objects().allocs.get(&p) {
            n += a.charged;
        }
        free_now(drv, p);
    }
    n
}

/// `cuMemAllocHost` / `cuMemHostAlloc`: pinned host memory (no device memory).
pub fn alloc_host(drv: &Driver, ctx: u64, size: u64) -> CuResult<u64> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let len = page_round(size)?;
    let base = map_anon(len, false)? as u64;
    drv.objects().allocs.insert(
        base,
        Alloc {
            base,
            size,
            map_len: len,
            charged: 0,
            dev: 0,
            ctx,
            kind: AllocKind::Host,
            maps: Vec::new(),
        },
    );
    Ok(base)
}

/// `cuMemFreeHost`.
pub fn free_host(drv: &Driver, ptr: u64) -> CuResult<()> {
    let mut o = drv.objects();
    match o.allocs.get(&ptr) {
        Some(a) if a.kind == AllocKind::Host => {
            let a = o
                .allocs
                .remove(&ptr)
                .expect("present: just looked up under the same lock");
            drop(o);
            unmap(a.base as usize, a.map_len);
            Ok(())
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// `cuMemHostRegister`.
pub fn host_register(drv: &Driver, ctx: u64, ptr: u64, size: u64) -> CuResult<()> {
    if ptr == 0 || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let end = ptr.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut o = drv.objects();
    if o.allocs
        .range(..end)
        .next_back()
        .is_some_and(|(_, a)| a.base + a.size.max(1) > ptr)
    {
        return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    }
    o.allocs.insert(
        ptr,
        Alloc {
            base: ptr,
            size,
            map_len: 0,
            charged: 0,
            dev: 0,
            ctx,
            kind: AllocKind::Registered,
            maps: Vec::new(),
        },
    );
    Ok(())
}

/// `cuMemHostUnregister`.
pub fn host_unregister(drv: &Driver, ptr: u64) -> CuResult<()> {
    let mut o = drv.objects();
    match o.allocs.get(&ptr) {
        Some(a) if a.kind == AllocKind::Registered => {
            o.allocs.remove(&ptr);
            Ok(())
        }
        _ => Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
    }
}

/// The allocation that contains `[p, p+len)`, if any.
pub fn find(o: &Objects, p: u64, len: u64) -> Option<&Alloc> {
    let (_, a) = o.allocs.range(..=p).next_back()?;
    let end = p.checked_add(len)?;
    (end <= a.base + a.size.max(1) && p >= a.base).then_some(a)
}

/// Checks that `[p, p+len)` is accessible device memory; returns its device.
pub fn check_device_range(o: &Objects, p: u64, len: u64) -> CuResult<usize> {
    let a = find(o, p, len)
        .filter(|a| a.is_device())
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if a.kind == AllocKind::VmmRange {
        let end = p + len;
        let ok = a
            .maps
            .iter()
            .any(|&(m, l, _, rw)| rw && p >= m && end <= m + l);
        if !ok {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = a
            .maps
            .iter()
            .find(|&&(m, l, _, _)| p >= m && p < m + l)
            .map(|m| m.2);
        // Host-located memory mapped for the devices: device 0's queue does the work.
        return Ok(h
            .and_then(|h| o.vmm.get(&h))
            .and_then(|v| v.dev)
            .unwrap_or(0));
    }
    Ok(a.dev)
}

/// Checks the word of `len` bytes (4 or 8) at `p` that a stream memory operation waits
/// on or writes: aligned to its size, in device memory or in memory the device can map
/// (pinned, registered or managed host memory).
pub fn check_memop_word(o: &Objects, p: u64, len: u64) -> CuResult<()> {
    if p == 0 || !p.is_multiple_of(len) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if is_pinned(o, p, len) {
        return Ok(());
    }
    check_device_range(o, p, len).map(|_| ())
}

/// Whether `[p, p+len)` is pinned host memory (or device-accessible managed memory).
fn is_pinned(o: &Objects, p: u64, len: u64) -> bool {
    find(o, p, len).is_some_and(|a| {
        matches!(
            a.kind,
            AllocKind::Host | AllocKind::Registered | AllocKind::Managed
        )
    })
}

/// Whether `p` lies in device memory (unified addressing).
pub fn is_device_ptr(o: &Objects, p: u64) -> bool {
    find(o, p, 1).is_some_and(|a| a.is_device() && a.kind != AllocKind::Managed)
}

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Host to device.
    HtoD,
    /// Device to host.
    DtoH,
    /// Device to device.
    DtoD,
    /// Host to host (through `cuMemcpy` with unified addressing).
    HtoH,
}

/// Classifies a unified-addressing copy.
pub fn classify(drv: &Driver, dst: u64, src: u64) -> Dir {
    let o = drv.objects();
    match (is_device_ptr(&o, dst), is_device_ptr(&o, src)) {
        (true, true) => Dir::DtoD,
        (true, false) => Dir::HtoD,
        (false, true) => Dir::DtoH,
        (false, false) => Dir::HtoH,
    }
}

fn validate(drv: &Driver, dir: Dir, dst: u64, src: u64, n: u64) -> CuResult<usize> {
    let o = drv.objects();
    let d = match dir {
        Dir::HtoD => check_device_range(&o, dst, n)?,
        Dir::DtoH => check_device_range(&o, src, n)?,
        Dir::DtoD => {
            check_device_range(&o, src, n)?;
            check_device_range(&o, dst, n)?
        }
        Dir::HtoH => 0,
    };
    if (dir == Dir::HtoD && src == 0) || (dir == Dir::DtoH && dst == 0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(d)
}

/// A synchronous copy: waits for the device's queued work, then copies.
pub fn copy_sync(drv: &'static Driver, dir: Dir, dst: u64, src: u64, n: u64) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    let d = validate(drv, dir, dst, src, n)?;
    if dir != Dir::HtoH {
        drv.worker(d).drain();
    }
    // SAFETY: device ranges were validated above and cannot be freed while the copy
    // runs without a data race in the application itself; host pointers are the
    // application's, valid for `n` bytes per the API contract.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n as usize) };
    Ok(())
}

/// An asynchronous copy on `stream`, with CUDA's rules for pageable host memory
/// (host-to-device reads it before returning; device-to-host into pageable memory is
/// synchronous).
pub fn copy_async(
    drv: &'static Driver,
    dir: Dir,
    dst: u64,
    src: u64,
    n: u64,
    stream: &Stream,
) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    validate(drv, dir, dst, src, n)?;
    let len = n as usize;
    match dir {
        Dir::HtoD | Dir::HtoH => {
            let pinned = is_pinned(&drv.objects(), src, n);
            let srcv = if pinned {
                CopySrc::Ptr(src as usize)
            } else {
                // SAFETY: the application's host buffer, valid for `n` bytes.
                let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) }.to_vec();
                CopySrc::Bytes(Arc::new(bytes))
            };
            stream.enqueue(
                drv,
                Work::Copy {
                    dst: dst as usize,
                    src: srcv,
                    len,
                },
            )
        }
        Dir::DtoH => {
            if is_pinned(&drv.objects(), dst, n) || stream.is_capturing() {
                stream.enqueue(
                    drv,
                    Work::Copy {
                        dst: dst as usize,
                        src: CopySrc::Ptr(src as usize),
                        len,
                    },
                )
            } else {
                stream.synchronize(drv)?;
                // SAFETY: validated device source; the application's host destination.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                Ok(())
            }
        }
        Dir::DtoD => stream.enqueue(
            drv,
            Work::Copy {
                dst: dst as usize,
                src: CopySrc::Ptr(src as usize),
                len,
            },
        ),
    }
}

/// A memset of `height` rows (`pitch` apart) of `width` elements of `elem` bytes.
pub fn memset(
    drv: &'static Driver,
    dst: u64,
    pitch: u64,
    elem: u8,
    value: u32,
    width: u64,
    height: u64,
    stream: Option<&Stream>,
) -> CuResult<()> {
    if width == 0 || height == 0 {
        return Ok(());
    }
    let span = (height - 1)
        .checked_mul(pitch)
        .and_then(|r| r.checked_add(width.checked_mul(u64::from(elem))?))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let d = check_device_range(&drv.objects(), dst, span)?;
    let w = Work::Memset {
        dst: dst as usize,
        pitch: pitch as usize,
        elem,
        value,
        width: width as usize,
        height: height as usize,
    };
    match stream {
        Some(s) => s.enqueue(drv, w),
        None => {
            drv.worker(d).drain();
            // SAFETY: the rows were validated against a live device allocation above.
            unsafe {
                memset_rows(
                    dst as usize,
                    pitch as usize,
                    elem,
                    value,
                    width as usize,
                    height as usize,
                )
            };
            Ok(())
        }
    }
}

/// `cuMemGetAddressRange`.
pub fn address_range(drv: &Driver, p: u64) -> CuResult<(u64, u64)> {
    let o = drv.objects();
    let a = find(&o, p, 1)
        .filter(|a| a.is_device())
        .ok_or(CUDA_ERROR_NOT_FOUND)?;
    Ok((a.base, a.size))
}

// ---- stream-ordered allocation -----------------------------------------------------------

/// The device's default pool.
pub fn default_pool(drv: &Driver, dev: usize) -> Arc<Pool> {
    drv.default_pools[dev]
        .get_or_init(|| Pool::new(dev))
        .clone()
}

/// Looks a pool up by handle (default pools included).
pub fn pool(drv: &Driver, id: u64) -> CuResult<Arc<Pool>> {
    if let Some(p) = drv.objects().pools.get(&id) {
        return Ok(p.clone());
    }
    drv.default_pools
        .iter()
        .filter_map(|p| p.get())
        .find(|p| p.id == id)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// `cuMemAllocFromPoolAsync` / `cuMemAllocAsync`.
pub fn alloc_async(
    drv: &'static Driver,
    pool: &Pool,
    size: u64,
    stream: &Stream,
    ctx: u64,
) -> CuResult<u64> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if stream.is_capturing() {
        // Graph memory nodes are not simulated: say so rather than mis-account.
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    drv.check_alive(pool.dev)?;
    let charged = drv
        .state
        .granular(pool.dev, size)
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    // Reuse the pool's cached reservation when it can cover the request.
    let from_cache = pool
        .cached
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
            c.checked_sub(charged)
        })
        .is_ok();
    if !from_cache {
        drv.state
            .reserve(drv.slot, pool.dev, charged, true)
            .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    }
    let len = page_round(size)?;
    let base = match map_anon(len, true) {
        Ok(b) => b as u64,
        Err(e) => {
            pool.cached.fetch_add(charged, Ordering::AcqRel);
            pool.trim(drv, pool.threshold.load(Ordering::Acquire));
            return Err(e);
        }
    };
    let used = pool.used.fetch_add(charged, Ordering::AcqRel) + charged;
    pool.used_high.fetch_max(used, Ordering::AcqRel);
    pool.reserved_high
        .fetch_max(used + pool.cached.load(Ordering::Acquire), Ordering::AcqRel);
    drv.objects().allocs.insert(
        base,
        Alloc {
            base,
            size,
            map_len: len,
            charged,
            dev: pool.dev,
            ctx,
            kind: AllocKind::Pool(pool.id),
            maps: Vec::new(),
        },
    );
    Ok(base)
}

/// `cuMemFreeAsync`: frees in stream order.
pub fn free_async(drv: &'static Driver, ptr: u64, stream: &Stream) -> CuResult<()> {
    if !drv
        .objects()
        .allocs
        .get(&ptr)
        .is_some_and(|a| a.is_device() && a.kind != AllocKind::VmmRange)
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    stream.enqueue(drv, Work::Free { ptr })
}

// ---- virtual memory management -----------------------------------------------------------

/// `cuMemAddressReserve`.
pub fn address_reserve(drv: &Driver, size: u64, align: u64, hint: u64) -> CuResult<u64> {
    let gran = drv.state.info(0).alloc_granularity;
    if size == 0 || !size.is_multiple_of(gran) || (align != 0 && !align.is_power_of_two()) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let align = align.max(gran);
    let len = usize::try_from(size + align).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    // SAFETY: an inaccessible anonymous reservation at a kernel-chosen address (the
    // hint is only a hint); checked for failure.
    let p = unsafe {
        libc::mmap(
            hint as usize as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let raw = p as u64;
    let base = (raw + align - 1) & !(align - 1);
    // Give back the slack before and after the aligned range.
    if base > raw {
        unmap(raw as usize, (base - raw) as usize);
    }
    let tail = raw + len as u64 - (base + size);
    if tail > 0 {
        unmap((base + size) as usize, tail as usize);
    }
    drv.objects().allocs.insert(
        base,
        Alloc {
            base,
            size,
            map_len: size as usize,
            charged: 0,
            dev: 0,
            ctx: 0,
            kind: AllocKind::VmmRange,
            maps: Vec::new(),
        },
    );
    Ok(base)
}

/// `cuMemAddressFree`.
pub fn address_free(drv: &Driver, ptr: u64, size: u64) -> CuResult<()> {
    let mut o = drv.objects();
    match o.allocs.get(&ptr) {
        Some(a) if a.kind == AllocKind::VmmRange && a.size == size => {
            if !a.maps.is_empty() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let a = o
                .allocs
                .remove(&ptr)
                .expect("present: checked under the same lock");
            drop(o);
            unmap(a.base as usize, a.map_len);
            Ok(())
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Where a VMM allocation lives: device `Some(internal index)` or the host (`None`), as
/// `cuMemCreate` and `cuMemGetAllocationGranularity` read `CUmemLocation`:
/// `CU_MEM_LOCATION_TYPE_HOST` ignores `id`; `CU_MEM_LOCATION_TYPE_HOST_NUMA` names a
/// NUMA node of the node's topology (0 where it has one node);
/// `CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT` and anything else is `CUDA_ERROR_INVALID_VALUE`.
pub fn vmm_location(drv: &Driver, loc: &CUmemLocation) -> CuResult<Option<usize>> {
    match loc.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => drv.device(loc.id).map(Some),
        CU_MEM_LOCATION_TYPE_HOST => Ok(None),
        CU_MEM_LOCATION_TYPE_HOST_NUMA => {
            let nodes = crate::peer::numa_nodes(drv).max(1);
            match usize::try_from(loc.id) {
                Ok(id) if id < nodes => Ok(None),
                _ => Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// The minimum granularity of VMM allocations at `loc`.
pub fn vmm_granularity(drv: &Driver, loc: &CUmemLocation) -> CuResult<u64> {
    Ok(match vmm_location(drv, loc)? {
        Some(dev) => drv.state.info(dev).alloc_granularity,
        None => HOST_GRANULARITY,
    })
}

/// `cuMemCreate`: device memory is charged to its device; host memory
/// (`CU_MEM_LOCATION_TYPE_HOST`, `_HOST_NUMA`) to no device, and is not exportable
/// (`requestedHandleTypes` must be 0 there, as the driver API documents).
pub fn vmm_create(drv: &Driver, size: u64, prop: &CUmemAllocationProp) -> CuResult<u64> {
    if prop.type_ != CU_MEM_ALLOCATION_TYPE_PINNED {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = vmm_location(drv, &prop.location)?;
    let known = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC;
    if prop.requestedHandleTypes & !known != 0 || (dev.is_none() && prop.requestedHandleTypes != 0)
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let gran = vmm_granularity(drv, &prop.location)?;
    if size == 0 || !size.is_multiple_of(gran) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let charged = match dev {
        Some(d) => {
            drv.check_alive(d)?;
            drv.charge(d, size, true)?
        }
        None => 0,
    };
    let name = crate::ipc::vmm_memfd_name(dev);
    let memfd = usize::try_from(size)
        .ok()
        .and_then(|len| vgpu_sys::shm::memfd(&name, len, false).ok());
    let Some(fd) = memfd.map(std::os::fd::IntoRawFd::into_raw_fd) else {
        if let Some(d) = dev {
            drv.uncharge(d, charged);
        }
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    };
    let h = new_handle(Kind::Vmm);
    drv.objects().vmm.insert(
        h,
        VmmHandle {
            dev,
            location: prop.location,
            handle_types: prop.requestedHandleTypes,
            size,
            charged,
            fd,
            maps: 0,
            refs: 1,
        },
    );
    Ok(h)
}

fn vmm_maybe_destroy(drv: &Driver, o: &mut Objects, h: u64) {
    if o.vmm.get(&h).is_some_and(|v| v.refs == 0 && v.maps == 0) {
        let v = o.vmm.remove(&h).expect("present: checked just above");
        // SAFETY: closing the memfd this handle owned; nothing maps it any more.
        unsafe { libc::close(v.fd) };
        if let Some(d) = v.dev {
            drv.uncharge(d, v.charged);
        }
    }
}

/// `cuMemRelease`.
pub fn vmm_release(drv: &Driver, h: u64) -> CuResult<()> {
    let mut o = drv.objects();
    let v = o.vmm.get_mut(&h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if v.refs == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    v.refs -= 1;
    vmm_maybe_destroy(drv, &mut o, h);
    Ok(())
}

/// `cuMemRetainAllocationHandle`.
pub fn vmm_retain(drv: &Driver, addr: u64) -> CuResult<u64> {
    let mut o = drv.objects();
    let h = find(&o, addr, 1)
        .filter(|a| a.kind == AllocKind::VmmRange)
        .and_then(|a| {
            a.maps
                .iter()
                .find(|&&(m, l, _, _)| addr >= m && addr < m + l)
                .map(|m| m.2)
        })
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    o.vmm.get_mut(&h).ok_or(CUDA_ERROR_INVALID_VALUE)?.refs += 1;
    Ok(h)
}

/// (location, requested handle types, size) of a VMM handle.
pub fn vmm_props(drv: &Driver, h: u64) -> CuResult<(CUmemLocation, u32, u64)> {
    drv.objects()
        .vmm
        .get(&h)
        .map(|v| (v.location, v.handle_types, v.size))
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// `cuMemMap`.
pub fn vmm_map(drv: &Driver, ptr: u64, size: u64, offset: u64, h: u64) -> CuResult<()> {
    let mut o = drv.objects();
    let (fd, hsize) = o
        .vmm
        .get(&h)
        .map(|v| (v.fd, v.size))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if size == 0 || offset.checked_add(size).is_none_or(|e| e > hsize) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let base = {
        let a = find(&o, ptr, size)
            .filter(|a| a.kind == AllocKind::VmmRange)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if a.maps
            .iter()
            .any(|&(m, l, _, _)| ptr < m + l && m < ptr + size)
        {
            return Err(CUDA_ERROR_ALREADY_MAPPED);
        }
        a.base
    };
    // SAFETY: [ptr, ptr+size) lies inside our own PROT_NONE reservation (checked
    // above), so MAP_FIXED replaces only memory this driver owns.
    let p = unsafe {
        libc::mmap(
            ptr as usize as *mut libc::c_void,
            size as usize,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    o.allocs
        .get_mut(&base)
        .expect("reservation found above")
        .maps
        .push((ptr, size, h, false));
    o.vmm.get_mut(&h).expect("handle found above").maps += 1;
    Ok(())
}

/// `cuMemSetAccess`: `rw` makes the mappings in the range readable and writable.
pub fn vmm_set_access(drv: &Driver, ptr: u64, size: u64, prot: i32) -> CuResult<()> {
    let mut o = drv.objects();
    let base = find(&o, ptr, size)
        .filter(|a| a.kind == AllocKind::VmmRange)
        .map(|a| a.base)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let a = o.allocs.get_mut(&base).expect("found above");
    let end = ptr + size;
    let mut covered = 0;
    for m in a.maps.iter_mut().filter(|m| m.0 >= ptr && m.0 + m.1 <= end) {
        // SAFETY: the mapping is ours (created by vmm_map) and page aligned.
        if unsafe { libc::mprotect(m.0 as usize as *mut libc::c_void, m.1 as usize, prot) } != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        m.3 = prot & libc::PROT_WRITE != 0;
        covered += m.1;
    }
    if covered != size {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// Access flags (`CUmemAccess_flags`) of the mapping containing `ptr`.
pub fn vmm_get_access(drv: &Driver, ptr: u64) -> CuResult<u32> {
    let o = drv.objects();
    let a = find(&o, ptr, 1)
        .filter(|a| a.kind == AllocKind::VmmRange)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let m = a
        .maps
        .iter()
        .find(|&&(m, l, _, _)| ptr >= m && ptr < m + l)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    Ok(if m.3 { 3 } else { 0 })
}

/// `cuMemUnmap`.
pub fn vmm_unmap(drv: &'static Driver, ptr: u64, size: u64) -> CuResult<()> {
    for d in 0..drv.device_count() {
        drv.worker(d).drain();
    }
    let mut o = drv.objects();
    let base = find(&o, ptr, size)
        .filter(|a| a.kind == AllocKind::VmmRange)
        .map(|a| a.base)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let end = ptr + size;
    let a = o.allocs.get_mut(&base).expect("found above");
    let (gone, keep): (Vec<VmmMapping>, Vec<VmmMapping>) =
        a.maps.iter().partition(|m| m.0 >= ptr && m.0 + m.1 <= end);
    if gone.iter().map(|m| m.1).sum::<u64>() != size {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    a.maps = keep;
    for &(m, l, h, _) in &gone {
        // SAFETY: turning our own mapping back into a PROT_NONE reservation.
        unsafe {
            libc::mmap(
                m as usize as *mut libc::c_void,
                l as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if let Some(v) = o.vmm.get_mut(&h) {
            v.maps = v.maps.saturating_sub(1);
        }
        vmm_maybe_destroy(drv, &mut o, h);
    }
    Ok(())
}

// ---- arrays ------------------------------------------------------------------------------

/// The largest CUDA array of each shape a compute capability 8.x/9.x GPU creates (as its
/// `CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE*` attributes report them): width of a 1D array,
/// width and height of a 2D one, each extent of a 3D one, and the same for mipmapped
/// arrays. A real H100 refuses a 1D array of 64 Mi elements with
/// `CUDA_ERROR_INVALID_VALUE`; earlier versions of the simulator created it.
pub mod array_limits {
    /// 1D width.
    pub const TEX1D: u64 = 131_072;
    /// 2D width, height.
    pub const TEX2D: (u64, u64) = (131_072, 65_536);
    /// 3D width, height, depth.
    pub const TEX3D: u64 = 16_384;
    /// 1D mipmapped width.
    pub const TEX1D_MIPMAP: u64 = 32_768;
    /// 2D mipmapped width and height.
    pub const TEX2D_MIPMAP: u64 = 32_768;
}

/// Whether an array of `w` × `h` × `d` elements (0 for an absent dimension, as in the
/// descriptor) fits the device's limits; layered and cubemap arrays (`flags` with
/// `CUDA_ARRAY3D_LAYERED` or `CUDA_ARRAY3D_CUBEMAP`) are not checked.
pub fn array_extent_fits(w: u64, h: u64, d: u64, flags: u32, mipmapped: bool) -> bool {
    use array_limits::*;
    const LAYERED: u32 = 0x01;
    const CUBEMAP: u32 = 0x04;
    if flags & (LAYERED | CUBEMAP) != 0 {
        return true;
    }
    match (h, d, mipmapped) {
        (0, 0, false) => w <= TEX1D,
        (0, 0, true) => w <= TEX1D_MIPMAP,
        (_, 0, false) => w <= TEX2D.0 && h <= TEX2D.1,
        (_, 0, true) => w <= TEX2D_MIPMAP && h <= TEX2D_MIPMAP,
        (0, _, _) => false,
        _ => w <= TEX3D && h <= TEX3D && d <= TEX3D,
    }
}

/// Creates an array (or a mipmapped array with `levels` > 0).
pub fn array_create(
    drv: &Driver,
    dev: usize,
    desc: CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> CuResult<u64> {
    let elem = array_format_bytes(desc.Format).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if desc.Width == 0
        || !matches!(desc.NumChannels, 1 | 2 | 4)
        || !array_extent_fits(
            desc.Width as u64,
            desc.Height as u64,
            desc.Depth as u64,
            desc.Flags,
            levels > 0,
        )
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dims = |w: u64, h: u64, d: u64| -> CuResult<(u64, u64)> {
        let row = w
            .checked_mul(elem * u64::from(desc.NumChannels))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let bytes = row
            .checked_mul(h.max(1))
            .and_then(|b| b.checked_mul(d.max(1)))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok((row, bytes))
    };
    let (w, h, d) = (desc.Width as u64, desc.Height as u64, desc.Depth as u64);
    let mut level_dims = Vec::new();
    let nlev = levels.max(1);
    for l in 0..nlev {
        let (lw, lh, ld) = (
            (w >> l).max(1),
            if h == 0 { 0 } else { (h >> l).max(1) },
            if d == 0 { 0 } else { (d >> l).max(1) },
        );
        level_dims.push((lw, lh, ld, dims(lw, lh, ld)?));
    }
    let total: u64 = level_dims.iter().map(|l| l.3.1).sum();
    drv.check_alive(dev)?;
    let charged = drv.charge(dev, total, true)?;
    let len = page_round(total)?;
    let base = match map_anon(len, true) {
        Ok(b) => b,
        Err(e) => {
            drv.uncharge(dev, charged);
            return Err(e);
        }
    };
    let mut o = drv.objects();
    let mut child_ids = Vec::new();
    if levels > 0 {
        let mut off = 0usize;
        for &(lw, lh, ld, (row, bytes)) in &level_dims {
            let id = new_handle(Kind::Array);
            let mut ldesc = desc;
            ldesc.Width = lw as usize;
            ldesc.Height = lh as usize;
            ldesc.Depth = ld as usize;
            o.arrays.insert(
                id,
                Arc::new(ArrayObj {
                    id,
                    dev,
                    desc: ldesc,
                    row_bytes: row,
                    bytes,
                    base: base + off,
                    map_len: 0,
                    charged: 0,
                    levels: Vec::new(),
                }),
            );
            child_ids.push(id);
            off += bytes as usize;
        }
    }
    let id = new_handle(Kind::Array);
    let (row, _) = level_dims[0].3;
    o.arrays.insert(
        id,
        Arc::new(ArrayObj {
            id,
            dev,
            desc,
            row_bytes: row,
            bytes: total,
            base,
            map_len: len,
            charged,
            levels: child_ids,
        }),
    );
    Ok(id)
}

/// Destroys an array (with its levels).
pub fn array_destroy(drv: &'static Driver, id: u64) -> CuResult<()> {
    let a = drv
        .objects()
        .arrays
        .get(&id)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if a.map_len == 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE); // a level is destroyed with its parent
    }
    drv.worker(a.dev).drain();
    {
        let mut o = drv.objects();
        o.arrays.remove(&id);
        for l in &a.levels {
            o.arrays.remove(l);
        }
    }
    unmap(a.base, a.map_len);
    drv.uncharge(a.dev, a.charged);
    Ok(())
}

/// Looks an array up.
pub fn array(drv: &Driver, id: u64) -> CuResult<Arc<ArrayObj>> {
    drv.objects()
        .arrays
        .get(&id)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// One side of a 2D copy, resolved to an address and a pitch.
#[derive(Debug, Clone, Copy)]
pub struct Side {
    /// Address of (x, y) = (0, 0) of the region.
    pub addr: u64,
    /// Row pitch.
    pub pitch: u64,
    /// Whether it is device memory (or an array).
    pub device: bool,
}

/// Resolves one side of a `CUDA_MEMCPY2D`.
pub fn side(
    drv: &Driver,
    mt: u32,
    host: u64,
    dptr: u64,
    arr: u64,
    x: u64,
    y: u64,
    pitch: u64,
    width: u64,
    height: u64,
) -> CuResult<Side> {
    let row_span = |p: u64| -> CuResult<u64> {
        height
            .saturating_sub(1)
            .checked_mul(p)
            .and_then(|v| v.checked_add(width))
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    };
    match mt {
        memorytype::HOST => Ok(Side {
            addr: host + y * pitch + x,
            pitch,
            device: false,
        }),
        memorytype::DEVICE => {
            let addr = dptr
                .checked_add(y * pitch + x)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            check_device_range(&drv.objects(), addr, row_span(pitch)?)?;
            Ok(Side {
                addr,
                pitch,
                device: true,
            })
        }
        memorytype::UNIFIED => {
            let addr = dptr
                .checked_add(y * pitch + x)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let dev = is_device_ptr(&drv.objects(), addr);
            if dev {
                check_device_range(&drv.objects(), addr, row_span(pitch)?)?;
            }
            Ok(Side {
                addr,
                pitch,
                device: dev,
            })
        }
        memorytype::ARRAY => {
            let id = crate::rt::from_ptr(arr as usize as CUarray, Kind::Array)?;
            let a = array(drv, id)?;
            let p = a.row_bytes;
            let off = y
                .checked_mul(p)
                .and_then(|v| v.checked_add(x))
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if off.checked_add(row_span(p)?).is_none_or(|e| e > a.bytes) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            Ok(Side {
                addr: a.base as u64 + off,
                pitch: p,
                device: true,
            })
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Copies `height` rows of `width` bytes between resolved sides (synchronously, after
/// the devices' queued work).
pub fn copy_2d(
    drv: &'static Driver,
    dst: Side,
    src: Side,
    width: u64,
    height: u64,
) -> CuResult<()> {
    if width > dst.pitch.max(width) || (height > 1 && (width > dst.pitch || width > src.pitch)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    for d in 0..drv.device_count() {
        drv.worker(d).drain();
    }
    for r in 0..height {
        // SAFETY: device/array rows were bounds-checked in `side`; host rows are the
        // application's, valid per the API contract.
        unsafe {
            std::ptr::copy(
                (src.addr + r * src.pitch) as *const u8,
                (dst.addr + r * dst.pitch) as *mut u8,
                width as usize,
            )
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::array_extent_fits;

    #[test]
    fn arrays_past_the_devices_extents_are_refused() {
        // 1D: 131072 fits, one more does not; 64 Mi elements (what a real H100 refused).
        assert!(array_extent_fits(131_072, 0, 0, 0, false));
        assert!(!array_extent_fits(131_073, 0, 0, 0, false));
        assert!(!array_extent_fits(64 << 20, 0, 0, 0, false));
        // 2D: 131072 × 65536.
        assert!(array_extent_fits(65_536, 1024, 0, 0, false));
        assert!(!array_extent_fits(65_536, 65_537, 0, 0, false));
        // 3D: 16384 each; a depth without a height is not a shape.
        assert!(array_extent_fits(16_384, 64, 64, 0, false));
        assert!(!array_extent_fits(16_385, 1, 1, 0, false));
        assert!(!array_extent_fits(16, 0, 4, 0, false));
        // Mipmapped arrays are smaller.
        assert!(!array_extent_fits(65_536, 0, 0, 0, true));
        assert!(array_extent_fits(32_768, 32_768, 0, 0, true));
        // Layered arrays are not checked here.
        assert!(array_extent_fits(16, 16, 1 << 20, 0x01, false));
    }
}
