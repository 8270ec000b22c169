//! `device-probe`: which GPUs a process sees, through the CUDA driver API and NVML, for the
//! device-visibility tests. It loads `libcuda.so.1` and `libnvidia-ml.so.1` by name (so
//! `LD_LIBRARY_PATH` and `LD_PRELOAD` decide what it gets) and runs its arguments as a
//! script, printing `key=value` lines:
//!
//! ```text
//! route dlsym|procaddr   how CUDA entry points are resolved (default dlsym on the
//!                        driver's handle; procaddr: cuGetProcAddress_v2, CUDA 13.0)
//! cuda                   cuInit; cuda_count=N, per ordinal i cuda_uuid_i= cuda_pci_i=,
//!                        cuda_get_N=<CUresult of cuDeviceGet(N)>, and after retaining
//!                        device 0's primary context, cuda_ctx_device=<cuCtxGetDevice_v2>
//! cuda-pci BUSID         cuda_pci_lookup=<ordinal> or err<CUresult> (cuDeviceGetByPCIBusId)
//! nvml                   nvmlInit_v2; nvml_count= nvml_count_v1=, per index i
//!                        nvml_uuid_i= nvml_pci_i= nvml_serial_i= nvml_index_i=,
//!                        nvml_get_N=<nvmlReturn_t of nvmlDeviceGetHandleByIndex_v2(N)>
//! nvml-uuid|nvml-pci|nvml-serial KEY
//!                        nvml_lookup=<nvmlDeviceGetIndex of the handle> or err<code>
//! ```

// The probe calls C entry points resolved with dlopen/dlsym; each block says why the
// call matches its C signature.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

use anyhow::{Context, Result, bail};
use libloading::Library;
use vgpu_core::gpu_uuid::format_uuid;

struct Cuda {
    lib: Library,
    procaddr: bool,
}

impl Cuda {
    /// Resolves `name` with `dlsym`, or with `cuGetProcAddress_v2` (base name, CUDA 13.0).
    fn sym<T: Copy>(&self, name: &str) -> Result<T> {
        const { assert!(size_of::<T>() == size_of::<usize>()) };
        let p: usize = if self.procaddr {
            type GetProc = unsafe extern "C" fn(
                *const c_char,
                *mut *mut c_void,
                c_int,
                u64,
                *mut c_int,
            ) -> c_uint;
            // SAFETY: cuGetProcAddress_v2's C signature.
            let gp: libloading::Symbol<'_, GetProc> =
                unsafe { self.lib.get(b"cuGetProcAddress_v2") }.context("cuGetProcAddress_v2")?;
            let base = name.strip_suffix("_v2").unwrap_or(name);
            let c = CString::new(base)?;
            let (mut p, mut status) = (std::ptr::null_mut(), 0);
            // SAFETY: a valid name and out-pointers.
            let r = unsafe { gp(c.as_ptr(), &mut p, 13000, 0, &mut status) };
            if r != 0 || p.is_null() {
                bail!("cuGetProcAddress_v2({base}) failed: {r} status {status}");
            }
            p as usize
        } else {
            // SAFETY: reading the address of a named driver entry point.
            let s: libloading::Symbol<'_, usize> = unsafe { self.lib.get(name.as_bytes()) }
                .with_context(|| format!("resolve {name}"))?;
            // SAFETY: as above.
            unsafe { s.into_raw().into_raw() as usize }
        };
        // SAFETY: `p` is the entry point; the caller gives its C signature as `T`.
        Ok(unsafe { std::mem::transmute_copy::<usize, T>(&p) })
    }
}

fn text(buf: &[c_char]) -> String {
    // SAFETY: the library wrote a NUL-terminated string into the zeroed buffer.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn cuda(c: &Cuda) -> Result<()> {
    type Init = unsafe extern "C" fn(c_uint) -> c_uint;
    type Count = unsafe extern "C" fn(*mut c_int) -> c_uint;
    type Get = unsafe extern "C" fn(*mut c_int, c_int) -> c_uint;
    type Uuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_uint;
    type Pci = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_uint;
    type Retain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_uint;
    type SetCur = unsafe extern "C" fn(*mut c_void) -> c_uint;
    type CtxDev = unsafe extern "C" fn(*mut c_int, *mut c_void) -> c_uint;
    // SAFETY: every call passes arguments matching its driver API signature.
    unsafe {
        let r = c.sym::<Init>("cuInit")?(0);
        if r != 0 {
            bail!("cuInit failed with {r}");
        }
        let mut n = 0;
        let r = c.sym::<Count>("cuDeviceGetCount")?(&mut n);
        if r != 0 {
            bail!("cuDeviceGetCount failed with {r}");
        }
        println!("cuda_count={n}");
        let get = c.sym::<Get>("cuDeviceGet")?;
        for i in 0..n {
            let mut d = -1;
            let r = get(&mut d, i);
            if r != 0 {
                bail!("cuDeviceGet({i}) failed with {r}");
            }
            let mut u = [0u8; 16];
            let r = c.sym::<Uuid>("cuDeviceGetUuid_v2")?(&mut u, d);
            if r != 0 {
                bail!("cuDeviceGetUuid_v2({d}) failed with {r}");
            }
            let mut pci = [0 as c_char; 32];
            let r = c.sym::<Pci>("cuDeviceGetPCIBusId")?(pci.as_mut_ptr(), 32, d);
            if r != 0 {
                bail!("cuDeviceGetPCIBusId({d}) failed with {r}");
            }
            println!(
                "cuda_uuid_{i}={} cuda_pci_{i}={}",
                format_uuid(&u),
                text(&pci)
            );
        }
        let mut d = -1;
        println!("cuda_get_{n}={}", get(&mut d, n));
        if n > 0 {
            let mut ctx = std::ptr::null_mut();
            let r = c.sym::<Retain>("cuDevicePrimaryCtxRetain")?(&mut ctx, 0);
            if r != 0 {
                bail!("cuDevicePrimaryCtxRetain(0) failed with {r}");
            }
            let r = c.sym::<SetCur>("cuCtxSetCurrent")?(ctx);
            if r != 0 {
                bail!("cuCtxSetCurrent failed with {r}");
            }
            let mut dev = -1;
            let r = c.sym::<CtxDev>("cuCtxGetDevice_v2")?(&mut dev, std::ptr::null_mut());
            println!("cuda_ctx_device={dev} code={r}");
        }
    }
    Ok(())
}

fn cuda_pci(c: &Cuda, bus: &str) -> Result<()> {
    type ByPci = unsafe extern "C" fn(*mut c_int, *const c_char) -> c_uint;
    let key = CString::new(bus)?;
    let mut d = -1;
    // SAFETY: cuDeviceGetByPCIBusId(CUdevice*, const char*).
    let r = unsafe { c.sym::<ByPci>("cuDeviceGetByPCIBusId")?(&mut d, key.as_ptr()) };
    if r == 0 {
        println!("cuda_pci_lookup={d}");
    } else {
        println!("cuda_pci_lookup=err{r}");
    }
    Ok(())
}

type H = *mut c_void;

fn nvml_str(lib: &Library, name: &[u8], h: H) -> Result<String> {
    type Str = unsafe extern "C" fn(H, *mut c_char, c_uint) -> c_uint;
    let mut buf = [0 as c_char; 96];
    // SAFETY: nvmlDeviceGet{UUID,Serial}(nvmlDevice_t, char*, unsigned int).
    let r = unsafe { lib.get::<Str>(name)?(h, buf.as_mut_ptr(), 96) };
    Ok(if r == 0 {
        text(&buf)
    } else {
        format!("err{r}")
    })
}

fn nvml_pci(lib: &Library, h: H) -> Result<String> {
    #[repr(C)]
    struct PciInfo {
        legacy: [c_char; 16],
        domain: c_uint,
        bus: c_uint,
        device: c_uint,
        id: c_uint,
        subsys: c_uint,
        bus_id: [c_char; 32],
    }
    type Pci = unsafe extern "C" fn(H, *mut PciInfo) -> c_uint;
    // SAFETY: nvmlPciInfo_t is plain data; zero is a valid value.
    let mut p: PciInfo = unsafe { std::mem::zeroed() };
    // SAFETY: nvmlDeviceGetPciInfo_v3(nvmlDevice_t, nvmlPciInfo_t*).
    let r = unsafe { lib.get::<Pci>(b"nvmlDeviceGetPciInfo_v3")?(h, &mut p) };
    Ok(if r == 0 {
        text(&p.bus_id)
    } else {
        format!("err{r}")
    })
}

fn nvml_index(lib: &Library, h: H) -> Result<String> {
    type Index = unsafe extern "C" fn(H, *mut c_uint) -> c_uint;
    let mut i = 0;
    // SAFETY: nvmlDeviceGetIndex(nvmlDevice_t, unsigned int*).
    let r = unsafe { lib.get::<Index>(b"nvmlDeviceGetIndex")?(h, &mut i) };
    Ok(if r == 0 {
        i.to_string()
    } else {
        format!("err{r}")
    })
}

fn nvml(lib: &Library) -> Result<()> {
    type Count = unsafe extern "C" fn(*mut c_uint) -> c_uint;
    type ByIndex = unsafe extern "C" fn(c_uint, *mut H) -> c_uint;
    // SAFETY: every call passes arguments matching its nvml.h signature.
    unsafe {
        let r = lib.get::<unsafe extern "C" fn() -> c_uint>(b"nvmlInit_v2")?();
        if r != 0 {
            bail!("nvmlInit_v2 failed with {r}");
        }
        let (mut n, mut n1) = (0, 0);
        let r = lib.get::<Count>(b"nvmlDeviceGetCount_v2")?(&mut n);
        let r1 = lib.get::<Count>(b"nvmlDeviceGetCount")?(&mut n1);
        if r != 0 || r1 != 0 {
            bail!("nvmlDeviceGetCount failed with {r}/{r1}");
        }
        println!("nvml_count={n} nvml_count_v1={n1}");
        let by_index = lib.get::<ByIndex>(b"nvmlDeviceGetHandleByIndex_v2")?;
        let by_index_v1 = lib.get::<ByIndex>(b"nvmlDeviceGetHandleByIndex")?;
        for i in 0..n {
            let (mut h, mut h1) = (std::ptr::null_mut(), std::ptr::null_mut());
            let r = by_index(i, &mut h);
            let r1 = by_index_v1(i, &mut h1);
            if r != 0 || r1 != 0 || h != h1 {
                bail!("nvmlDeviceGetHandleByIndex({i}) failed with {r}/{r1}");
            }
            println!(
                "nvml_uuid_{i}={} nvml_pci_{i}={} nvml_serial_{i}={} nvml_index_{i}={}",
                nvml_str(lib, b"nvmlDeviceGetUUID", h)?,
                nvml_pci(lib, h)?,
                nvml_str(lib, b"nvmlDeviceGetSerial", h)?,
                nvml_index(lib, h)?
            );
        }
        let mut h = std::ptr::null_mut();
        println!("nvml_get_{n}={}", by_index(n, &mut h));
    }
    Ok(())
}

fn nvml_lookup(lib: &Library, func: &[u8], key: &str) -> Result<()> {
    type ByKey = unsafe extern "C" fn(*const c_char, *mut H) -> c_uint;
    let k = CString::new(key)?;
    let mut h = std::ptr::null_mut();
    // SAFETY: nvmlDeviceGetHandleBy{UUID,PciBusId_v2,Serial}(const char*, nvmlDevice_t*).
    let r = unsafe { lib.get::<ByKey>(func)?(k.as_ptr(), &mut h) };
    if r == 0 {
        println!("nvml_lookup={}", nvml_index(lib, h)?);
    } else {
        println!("nvml_lookup=err{r}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    let mut procaddr = false;
    let mut cu: Option<Cuda> = None;
    let mut nv: Option<Library> = None;
    let nvml_lib = || -> Result<Library> {
        // SAFETY: loading NVML; its initializers are the library's.
        unsafe { Library::new("libnvidia-ml.so.1") }.context("dlopen libnvidia-ml.so.1")
    };
    while let Some(cmd) = it.next() {
        match cmd.as_str() {
            "route" => procaddr = it.next().map(String::as_str) == Some("procaddr"),
            "cuda" | "cuda-pci" => {
                if cu.is_none() {
                    // SAFETY: loading the driver; its initializers are the driver's.
                    let lib =
                        unsafe { Library::new("libcuda.so.1") }.context("dlopen libcuda.so.1")?;
                    let c = Cuda { lib, procaddr };
                    if cmd == "cuda" {
                        cuda(&c)?;
                    }
                    cu = Some(c);
                }
                if cmd == "cuda-pci" {
                    let key = it.next().context("missing PCI bus id")?;
                    cuda_pci(cu.as_ref().context("cuda first")?, key)?;
                }
            }
            "nvml" => {
                let lib = nvml_lib()?;
                nvml(&lib)?;
                nv = Some(lib);
            }
            "nvml-uuid" | "nvml-pci" | "nvml-serial" => {
                let key = it.next().context("missing key")?;
                let func: &[u8] = match cmd.as_str() {
                    "nvml-uuid" => b"nvmlDeviceGetHandleByUUID",
                    "nvml-pci" => b"nvmlDeviceGetHandleByPciBusId_v2",
                    _ => b"nvmlDeviceGetHandleBySerial",
                };
                nvml_lookup(nv.as_ref().context("nvml first")?, func, key)?;
            }
            other => bail!("unknown command {other:?}"),
        }
    }
    Ok(())
}
