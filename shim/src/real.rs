//! The real driver and NVML: loaded once, every intercepted entry point resolved once,
//! never through ourselves.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::table::{IDS, Id, Lib, TABLE, entry};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// Address of libc's `dlsym` (0 until resolved).
pub static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// libc's `dlsym`, found with `dlvsym(RTLD_NEXT, ...)` so that it is never our hook.
pub fn dlsym_fn() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p == 0 {
        for ver in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: dlvsym with RTLD_NEXT and valid NUL-terminated strings; it does not
            // call dlsym, so this cannot recurse into our hook.
            let f = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), ver.as_ptr()) };
            if !f.is_null() {
                p = f as usize;
                break;
            }
        }
        if p == 0 {
            return None;
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: `p` is the address of libc's dlsym, whose C signature is DlsymFn.
    Some(unsafe { std::mem::transmute::<usize, DlsymFn>(p) })
}

/// `dlsym` of libc (not our hook); null if unavailable.
///
/// # Safety
/// `handle` must be a handle `dlsym` accepts; `name` a NUL-terminated string.
pub unsafe fn real_dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    match dlsym_fn() {
        // SAFETY: forwarded preconditions.
        Some(f) => unsafe { f(handle, name) },
        None => std::ptr::null_mut(),
    }
}

/// A loaded real library with the intercepted entry points resolved.
#[derive(Debug)]
pub struct RealLib {
    /// The dlopen handle.
    pub handle: usize,
    /// Real address per table row (0: not in this library).
    ptrs: Vec<usize>,
}

impl RealLib {
    /// The real function of row `id` (0 if the library lacks it).
    pub fn ptr(&self, id: Id) -> usize {
        self.ptrs.get(id as usize).copied().unwrap_or(0)
    }

    /// Resolves any other symbol of the library (0 if absent).
    pub fn sym(&self, name: &CStr) -> usize {
        // SAFETY: a handle from dlopen and a NUL-terminated name.
        unsafe { real_dlsym(self.handle as *mut c_void, name.as_ptr()) as usize }
    }

    /// The row whose real function is at `addr`.
    pub fn id_of(&self, addr: usize) -> Option<Id> {
        if addr == 0 {
            return None;
        }
        self.ptrs
            .iter()
            .position(|&p| p == addr)
            .and_then(|i| IDS.get(i).copied())
    }
}

/// The base address of the loaded object (executable or shared library) that holds
/// `addr`, if any.
fn object_base(addr: usize) -> Option<usize> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the loader's tables and writes the `Dl_info` it is
    // given, which is valid for writes.
    let found = unsafe { libc::dladdr(addr as *const c_void, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so it filled the structure (all-zero was valid anyway:
    // it holds only pointers).
    let info = unsafe { info.assume_init() };
    Some(info.dli_fbase as usize)
}

/// Whether `addr` lies in this library (libvgpu) itself: a "real" library that resolves
/// an entry point there resolves to our hook.
fn in_this_library(addr: usize) -> bool {
    let ours = object_base(in_this_library as *const () as usize);
    ours.is_some() && object_base(addr) == ours
}

fn load(lib: Lib, name: &str) -> Result<RealLib, String> {
    let cname = CString::new(name).map_err(|_| format!("library name {name:?} contains NUL"))?;
    // SAFETY: dlopen with a NUL-terminated name; the library's initializers run as for
    // any CUDA program.
    let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a NUL-terminated string or null.
        let err = unsafe { libc::dlerror() };
        let why = if err.is_null() {
            "unknown error".to_owned()
        } else {
            // SAFETY: non-null dlerror result is a valid C string.
            unsafe { CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(format!("cannot load {name}: {why}"));
    }
    let mut ptrs = vec![0usize; TABLE.len()];
    for (i, e) in TABLE.iter().enumerate() {
        if e.lib != lib {
            continue;
        }
        let Ok(sym) = CString::new(e.symbol) else {
            continue;
        };
        // SAFETY: a handle from dlopen and a NUL-terminated name.
        let p = unsafe { real_dlsym(handle, sym.as_ptr()) } as usize;
        if p != 0 && in_this_library(p) {
            return Err(format!(
                "{name} resolves to libvgpu itself (set VGPU_REAL_LIBCUDA/VGPU_REAL_LIBNVML to the real library)"
            ));
        }
        ptrs[i] = p;
    }
    Ok(RealLib {
        handle: handle as usize,
        ptrs,
    })
}

static CUDA: OnceLock<Result<RealLib, String>> = OnceLock::new();
static NVML: OnceLock<Result<RealLib, String>> = OnceLock::new();

thread_local! {
    /// Set while this thread loads a real library (its initializers may call `dlsym`).
    static LOADING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is inside the `dlopen` of a real library.
pub fn loading() -> bool {
    LOADING.try_with(Cell::get).unwrap_or(false)
}

fn get_or_load(
    cell: &'static OnceLock<Result<RealLib, String>>,
    lib: Lib,
) -> Result<&'static RealLib, &'static str> {
    if let Some(r) = cell.get() {
        return r.as_ref().map_err(String::as_str);
    }
    if loading() {
        // A re-entrant lookup from the library's own initializers: never wait on
        // ourselves.
        return Err("the real library is still loading");
    }
    cell.get_or_init(|| {
        let _ = LOADING.try_with(|l| l.set(true));
        let r = load(lib, &lib_name(lib));
        let _ = LOADING.try_with(|l| l.set(false));
        r
    })
    .as_ref()
    .map_err(String::as_str)
}

/// The real library name to load for `lib` (configuration, else the default).
pub fn lib_name(lib: Lib) -> String {
    let (var, default) = match lib {
        Lib::Cuda => ("VGPU_REAL_LIBCUDA", "libcuda.so.1"),
        Lib::Nvml => ("VGPU_REAL_LIBNVML", "libnvidia-ml.so.1"),
    };
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => v,
        _ => default.to_owned(),
    }
}

/// The real CUDA driver (loaded on first use).
pub fn cuda() -> Result<&'static RealLib, &'static str> {
    get_or_load(&CUDA, Lib::Cuda)
}

/// The real NVML (loaded on first use).
pub fn nvml() -> Result<&'static RealLib, &'static str> {
    get_or_load(&NVML, Lib::Nvml)
}

/// The real library of `lib`.
pub fn lib(lib: Lib) -> Result<&'static RealLib, &'static str> {
    match lib {
        Lib::Cuda => cuda(),
        Lib::Nvml => nvml(),
    }
}

/// The real function of row `id` as the function-pointer type `F`.
///
/// # Safety
/// `F` must be the `unsafe extern "C" fn` type of the row's C signature.
pub unsafe fn real<F: Copy>(id: Id) -> Option<F> {
    const { assert!(size_of::<F>() == size_of::<usize>()) };
    let p = lib(entry(id).lib).ok()?.ptr(id);
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the non-null address of the real function with signature `F`.
    Some(unsafe { std::mem::transmute_copy::<usize, F>(&p) })
}
