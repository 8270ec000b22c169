//! The `dlsym` route to the hooks: a program that `dlopen`s the driver (or NVML) and
//! looks up an intercepted entry point on its handle gets the hook instead of the real
//! function. Here: the exported `dlsym` (a naked tail jump to libc's for `RTLD_NEXT` and
//! `RTLD_DEFAULT`), its logic, and the resolution of libc's `dlsym` when the library
//! loads. The exports themselves and `cuGetProcAddress` are [`crate::hooks`]'s.

use std::ffi::{CStr, c_char, c_void};

use crate::hooks::{guard, hook_addr};
use crate::real;

#[cfg_attr(test, allow(dead_code))]
/// The logic of the `dlsym` hook: what the real `dlsym` finds, replaced by our hook when
/// it is the real function of an intercepted entry point.
unsafe extern "C" fn dlsym_hook(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real::real_dlsym(handle, name) };
    if r.is_null() || name.is_null() {
        return r;
    }
    // SAFETY: dlsym found `name`, so it is a NUL-terminated string.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    let Some(id) = crate::table::find(bytes) else {
        return r;
    };
    if real::loading() {
        // The real library's own initializers look themselves up.
        return r;
    }
    guard(
        r,
        || r,
        || match real::lib(crate::table::entry(id).lib) {
            Ok(lib) if lib.ptr(id) == r as usize => hook_addr(id) as *mut c_void,
            Ok(_) => r,
            // The configured real library cannot be loaded: our hook reports it (loudly)
            // rather than letting the application run unenforced.
            Err(_) => hook_addr(id) as *mut c_void,
        },
    )
}

/// `dlsym`: a program that `dlopen`s the driver and looks up an intercepted entry point
/// on its handle gets our hook. `RTLD_NEXT` and `RTLD_DEFAULT` lookups jump straight to
/// libc's `dlsym` with the caller's return address intact (a naked tail jump): both are
/// resolved relative to the caller's scope, and in the global scope the preloaded shim's
/// exports come first anyway.
///
/// # Safety
/// libc's `dlsym` contract: `handle` is a handle from `dlopen` (or `RTLD_NEXT`,
/// `RTLD_DEFAULT`) and `name` a NUL-terminated string.
#[cfg(all(not(test), target_arch = "x86_64"))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "test rdi, rdi",
        "jz 2f",
        "cmp rdi, -1",
        "jne {hook}",
        "2:",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz {hook}",
        "jmp rax",
        hook = sym dlsym_hook,
        real = sym real::REAL_DLSYM,
    )
}

/// Resolves libc's `dlsym` when the library loads, before any application lookup.
#[cfg(not(test))]
extern "C" fn on_load() {
    let _ = real::dlsym_fn();
}

#[cfg(not(test))]
#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;
