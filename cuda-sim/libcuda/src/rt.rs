//! The driver's process-wide runtime: initialization, the object registry (handles),
//! devices, contexts and the per-thread context stack.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_sim::node_state::{AllocError, State};

use crate::exec::{Event, Stream, Worker};
use crate::mem::{Alloc, ArrayObj, Pool, VmmHandle};
use crate::module::{Function, Module};

// The handle machinery is `handle.rs`'s; named here too, where the driver's files have
// always found it.
pub use crate::handle::{CuResult, Kind, from_ptr, new_handle, to_ptr};

/// A context.
#[derive(Debug)]
pub struct Ctx {
    /// Handle value.
    pub id: u64,
    /// Device ordinal.
    pub dev: usize,
    /// Whether it is the device's primary context.
    pub primary: bool,
    /// Creation flags.
    pub flags: u32,
    /// Its default (legacy) stream.
    pub default_stream: Arc<Stream>,
    /// Set when destroyed; a stale handle then fails cleanly.
    pub destroyed: AtomicBool,
}

/// Primary-context bookkeeping of one device.
#[derive(Debug, Default)]
pub struct Primary {
    /// The primary context, while retained.
    pub ctx: Option<Arc<Ctx>>,
    /// Retain count.
    pub retain: u32,
    /// Flags set with `cuDevicePrimaryCtxSetFlags`.
    pub flags: u32,
}

/// Everything the process has created, by handle.
#[derive(Debug, Default)]
pub struct Objects {
    /// Contexts.
    pub ctxs: HashMap<u64, Arc<Ctx>>,
    /// Primary contexts by device.
    pub primary: Vec<Primary>,
    /// Modules and libraries.
    pub modules: HashMap<u64, Arc<Module>>,
    /// Functions and kernels.
    pub funcs: HashMap<u64, Arc<Function>>,
    /// Streams (not the default ones).
    pub streams: HashMap<u64, Arc<Stream>>,
    /// Events.
    pub events: HashMap<u64, Arc<Event>>,
    /// Memory ranges by base address (device, managed, host, pool, VMM reservations).
    pub allocs: BTreeMap<u64, Alloc>,
    /// Arrays and mipmapped arrays.
    pub arrays: HashMap<u64, Arc<ArrayObj>>,
    /// Memory pools.
    pub pools: HashMap<u64, Arc<Pool>>,
    /// Physical allocations of the VMM API.
    pub vmm: HashMap<u64, VmmHandle>,
    /// `cuMemAlloc` allocations exported with `cuIpcGetMemHandle`: base → (memfd, inode).
    pub ipc: HashMap<u64, (i32, u64)>,
    /// Graphs under construction.
    pub graphs: HashMap<u64, Arc<Mutex<crate::exec::Graph>>>,
    /// Instantiated graphs.
    pub graph_execs: HashMap<u64, Arc<crate::exec::Graph>>,
}

/// The initialized driver.
#[derive(Debug)]
pub struct Driver {
    /// The node's shared state.
    pub state: State,
    /// This process's slot in it.
    pub slot: usize,
    /// Registry.
    objects: Mutex<Objects>,
    /// One execution worker per device, started on first use.
    workers: Vec<OnceLock<Arc<Worker>>>,
    /// Default memory pool per device.
    pub default_pools: Vec<OnceLock<Arc<Pool>>>,
    /// Whether to print every `cuGetProcAddress` lookup (env `VGPU_SIM_TRACE`).
    pub trace: bool,
    /// The node's devices this process sees, by CUDA ordinal (`CUDA_VISIBLE_DEVICES`,
    /// read once at `cuInit` as the real driver does; internal indices are the node's).
    visible: Vec<usize>,
    /// The device nodes opened at `cuInit`, held for the process's life as the real
    /// driver holds its own.
    _nodes: Vec<std::os::fd::OwnedFd>,
}

static DRIVER: OnceLock<Result<Driver, CUresult>> = OnceLock::new();

thread_local! {
    static CTX_STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The driver version reported by `cuDriverGetVersion` (CUDA 13.0).
pub const DRIVER_VERSION: i32 = 13000;

/// Initializes the driver (idempotent; the first result sticks, as with the real one).
pub fn init() -> CuResult<&'static Driver> {
    DRIVER
        .get_or_init(|| {
            let state = State::open_from_env().map_err(|e| {
                eprintln!("vgpu cuda-sim: cannot open the simulated node: {e}");
                CUDA_ERROR_NO_DEVICE
            })?;
            let n = state.device_count();
            // The driver opens its device nodes first: a GPU whose node the device cgroup
            // refuses (or that is absent) is not there for this process, a refused
            // control node is an unknown error (see `vgpu_cuda_sim::devnodes`).
            let opened = vgpu_cuda_sim::devnodes::open_all(
                state.dir(),
                n,
                vgpu_cuda_sim::devnodes::Client::Cuda,
            )
            .map_err(|e| {
                eprintln!("vgpu cuda-sim: cuInit: {e}");
                CUDA_ERROR_UNKNOWN
            })?;
            // `CUDA_VISIBLE_DEVICES` numbers the GPUs the process has, as the real one.
            let uuids: Vec<String> = opened
                .gpus
                .iter()
                .map(|&i| vgpu_core::gpu_uuid::format_uuid(&state.info(i).uuid))
                .collect();
            let cvd = std::env::var_os(vgpu_core::visible::CUDA_VISIBLE_DEVICES)
                .map(|v| v.to_string_lossy().into_owned());
            let visible: Vec<usize> = vgpu_core::visible::cuda_visible(cvd.as_deref(), &uuids)
                .into_iter()
                .filter_map(|o| opened.gpus.get(o).copied())
                .collect();
            if visible.is_empty() {
                // As the real driver: no visible device, no driver.
                return Err(CUDA_ERROR_NO_DEVICE);
            }
            let slot = state.claim_slot().map_err(|e| {
                eprintln!("vgpu cuda-sim: {e}");
                CUDA_ERROR_OPERATING_SYSTEM
            })?;
            let objects = Objects {
                primary: (0..n).map(|_| Primary::default()).collect(),
                ..Objects::default()
            };
            INIT_PID.store(std::process::id(), Ordering::Relaxed);
            // SAFETY: registering a plain `extern "C" fn()` with the C library.
            unsafe { libc::atexit(record_at_exit) };
            Ok(Driver {
                state,
                slot,
                objects: Mutex::new(objects),
                workers: (0..n).map(|_| OnceLock::new()).collect(),
                default_pools: (0..n).map(|_| OnceLock::new()).collect(),
                trace: std::env::var_os("VGPU_SIM_TRACE")
                    .is_some_and(|v| !v.is_empty() && v != "0"),
                visible,
                _nodes: opened.fds,
            })
        })
        .as_ref()
        .map_err(|&e| e)
}

/// The process that initialized the driver (its workers are its threads).
static INIT_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// At a normal exit, the work that already ran on the device's clock (a synchronize
/// returns then, not when the worker thread gets to it: see `Worker::wait_on_device`) is
/// recorded by the workers before the process goes, as a real GPU's accounting has it;
/// at most 1 s per device, so that an exit never hangs on a stuck worker.
extern "C" fn record_at_exit() {
    // A forked child that exits has no worker threads (they stay in the parent).
    if INIT_PID.load(Ordering::Relaxed) != std::process::id() {
        return;
    }
    if let Some(Ok(d)) = DRIVER.get() {
        for w in d.workers.iter().filter_map(OnceLock::get) {
            w.drain_within(std::time::Duration::from_secs(1));
        }
    }
}

/// The driver, if `cuInit` succeeded.
pub fn driver() -> CuResult<&'static Driver> {
    match DRIVER.get() {
        Some(Ok(d)) => Ok(d),
        Some(Err(e)) => Err(*e),
        None => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

impl Driver {
    /// The object registry. Never held across a blocking wait.
    pub fn objects(&self) -> MutexGuard<'_, Objects> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of devices of the node (visible or not: internal indices).
    pub fn device_count(&self) -> usize {
        self.state.device_count()
    }

    /// Number of devices this process sees (`cuDeviceGetCount`).
    pub fn visible_count(&self) -> usize {
        self.visible.len()
    }

    /// The node's device of CUDA ordinal `dev` (an ordinal this process cannot see is
    /// invalid).
    pub fn device(&self, dev: CUdevice) -> CuResult<usize> {
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.visible.get(d).copied())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// The CUDA ordinal of the node's device `node` (None: not visible to this process).
    pub fn ordinal(&self, node: usize) -> Option<CUdevice> {
        self.visible
            .iter()
            .position(|&v| v == node)
            .and_then(|o| CUdevice::try_from(o).ok())
    }

    /// Fails if device `d` has fallen off the bus.
    pub fn check_alive(&self, d: usize) -> CuResult<()> {
        if self.state.is_lost(d) {
            Err(CUDA_ERROR_DEVICE_UNAVAILABLE)
        } else {
            Ok(())
        }
    }

    /// The execution worker of device `d`.
    pub fn worker(&'static self, d: usize) -> Arc<Worker> {
        self.workers[d]
            .get_or_init(|| Worker::start(self, d))
            .clone()
    }

    /// Charges `bytes` of device `d` memory to this process (rounded to the device's
    /// granularity); returns the charged amount.
    pub fn charge(&self, d: usize, bytes: u64, counted: bool) -> CuResult<u64> {
        let charged = self
            .state
            .granular(d, bytes.max(1))
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        self.state
            .reserve(self.slot, d, charged, counted)
            .map_err(|e| match e {
                AllocError::OutOfMemory | AllocError::Injected => CUDA_ERROR_OUT_OF_MEMORY,
                AllocError::DeviceLost => CUDA_ERROR_DEVICE_UNAVAILABLE,
            })?;
        Ok(charged)
    }

    /// Returns `charged` bytes of device `d` memory.
    pub fn uncharge(&self, d: usize, charged: u64) {
        self.state.release(self.slot, d, charged);
    }

    // ---- contexts ---------------------------------------------------------------------

    fn make_ctx(&'static self, d: usize, primary: bool, flags: u32) -> CuResult<Arc<Ctx>> {
        self.check_alive(d)?;
        let overhead = self.state.info(d).context_overhead;
        if overhead > 0 {
            self.state
                .reserve(self.slot, d, overhead, false)
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        }
        self.state.slot(self.slot).devs[d]
            .contexts
            .fetch_add(1, Ordering::AcqRel);
        let id = new_handle(Kind::Ctx);
        let ctx = Arc::new(Ctx {
            id,
            dev: d,
            primary,
            flags,
            default_stream: Stream::new_default(id, d),
            destroyed: AtomicBool::new(false),
        });
        self.objects().ctxs.insert(id, ctx.clone());
        Ok(ctx)
    }

    fn drop_ctx(&'static self, ctx: &Arc<Ctx>) {
        if ctx.destroyed.swap(true, Ordering::AcqRel) {
            return;
        }
        // Work of the context finishes first, as cuCtxDestroy waits for it.
        self.worker(ctx.dev).drain();
        let freed = crate::mem::free_ctx_memory(self, ctx.id);
        let _ = freed;
        {
            let mut o = self.objects();
            o.ctxs.remove(&ctx.id);
            o.streams.retain(|_, s| s.ctx != ctx.id);
        }
        let sd = &self.state.slot(self.slot).devs[ctx.dev];
        let _ = sd
            .contexts
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                Some(c.saturating_sub(1))
            });
        let overhead = self.state.info(ctx.dev).context_overhead;
        if overhead > 0 {
            self.state.release(self.slot, ctx.dev, overhead);
        }
        CTX_STACK.with(|s| s.borrow_mut().retain(|&c| c != ctx.id));
    }

    /// `cuCtxCreate`: a new context, made current.
    pub fn ctx_create(&'static self, flags: u32, dev: CUdevice) -> CuResult<u64> {
        let d = self.device(dev)?;
        let ctx = self.make_ctx(d, false, flags)?;
        CTX_STACK.with(|s| s.borrow_mut().push(ctx.id));
        Ok(ctx.id)
    }

    /// `cuCtxDestroy`.
    pub fn ctx_destroy(&'static self, id: u64) -> CuResult<()> {
        let ctx = self
            .objects()
            .ctxs
            .get(&id)
            .cloned()
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if ctx.primary {
            // The primary context is released through cuDevicePrimaryCtxRelease.
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        self.drop_ctx(&ctx);
        Ok(())
    }

    /// `cuDevicePrimaryCtxRetain`.
    pub fn primary_retain(&'static self, dev: CUdevice) -> CuResult<u64> {
        let d = self.device(dev)?;
        let existing = {
            let mut o = self.objects();
            let p = &mut o.primary[d];
            match &p.ctx {
                Some(c) => {
                    p.retain += 1;
                    Some(c.id)
                }
                None => None,
            }
        };
        if let Some(id) = existing {
            return Ok(id);
        }
        let flags = self.objects().primary[d].flags;
        let ctx = self.make_ctx(d, true, flags)?;
        let mut o = self.objects();
        let p = &mut o.primary[d];
        if let Some(c) = &p.ctx {
            // Another thread won the race: keep its context, undo ours.
            p.retain += 1;
            let id = c.id;
            drop(o);
            self.drop_ctx(&ctx);
            return Ok(id);
        }
        p.ctx = Some(ctx.clone());
        p.retain = 1;
        Ok(ctx.id)
    }

    /// `cuDevicePrimaryCtxRelease`.
    pub fn primary_release(&'static self, dev: CUdevice) -> CuResult<()> {
        let d = self.device(dev)?;
        let gone = {
            let mut o = self.objects();
            let p = &mut o.primary[d];
            if p.retain == 0 {
                return Err(CUDA_ERROR_INVALID_CONTEXT);
            }
            p.retain -= 1;
            if p.retain == 0 { p.ctx.take() } else { None }
        };
        if let Some(c) = gone {
            self.drop_ctx(&c);
        }
        Ok(())
    }

    /// `cuDevicePrimaryCtxReset`.
    pub fn primary_reset(&'static self, dev: CUdevice) -> CuResult<()> {
        let d = self.device(dev)?;
        let gone = {
            let mut o = self.objects();
            let p = &mut o.primary[d];
            p.retain = 0;
            p.ctx.take()
        };
        if let Some(c) = gone {
            self.drop_ctx(&c);
        }
        Ok(())
    }

    /// `cuDevicePrimaryCtxGetState`: (flags, active).
    pub fn primary_state(&self, dev: CUdevice) -> CuResult<(u32, bool)> {
        let d = self.device(dev)?;
        let o = self.objects();
        Ok((o.primary[d].flags, o.primary[d].ctx.is_some()))
    }

    /// `cuDevicePrimaryCtxSetFlags`.
    pub fn primary_set_flags(&self, dev: CUdevice, flags: u32) -> CuResult<()> {
        let d = self.device(dev)?;
        self.objects().primary[d].flags = flags;
        Ok(())
    }

    /// Looks a context up by handle.
    pub fn ctx(&self, id: u64) -> CuResult<Arc<Ctx>> {
        let c = self
            .objects()
            .ctxs
            .get(&id)
            .cloned()
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if c.destroyed.load(Ordering::Acquire) {
            return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
        }
        Ok(c)
    }

    /// The calling thread's current context.
    pub fn current(&self) -> CuResult<Arc<Ctx>> {
        let top = CTX_STACK
            .with(|s| s.borrow().last().copied())
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        self.ctx(top)
    }
}

/// Current context handle of the calling thread (0 if none).
pub fn current_id() -> u64 {
    CTX_STACK.with(|s| s.borrow().last().copied().unwrap_or(0))
}

/// `cuCtxSetCurrent`: replaces the top of the stack (0 pops it).
pub fn set_current(id: u64) {
    CTX_STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        if id != 0 {
            s.push(id);
        }
    });
}

/// `cuCtxPushCurrent`.
pub fn push_current(id: u64) {
    CTX_STACK.with(|s| s.borrow_mut().push(id));
}

/// `cuCtxPopCurrent`.
pub fn pop_current() -> Option<u64> {
    CTX_STACK.with(|s| s.borrow_mut().pop())
}
