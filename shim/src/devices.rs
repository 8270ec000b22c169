//! The devices a container sees (ADR 0014). With a quota file, a process sees exactly the
//! container's GPUs, in the file's order, numbered from 0, whatever the runtime mounted;
//! without one nothing is hidden.
//!
//! - The CUDA driver is told which GPUs before it initialises: [`restrict_driver`] sets
//!   `CUDA_VISIBLE_DEVICES` to the granted GPUs' UUIDs (narrowed by the process's own
//!   `CUDA_VISIBLE_DEVICES`, whose indices count the container's GPUs), so the driver
//!   itself renumbers every call that takes or returns a device, whichever route
//!   (exports, `dlsym`, `cuGetProcAddress`) reached it.
//! - NVML ignores that variable: its enumeration hooks (count, handles by index, UUID,
//!   PCI bus id and serial, index of a handle) go through the [`DeviceMap`] of
//!   [`nvml_map`]; a GPU the container was not given is not found.
//!
//! Everything here calls the real libraries only (never the hooks).

use std::ffi::{CStr, c_char, c_uint};
use std::sync::OnceLock;

use vgpu_core::container_quota::{ContainerQuota, same_gpu};
use vgpu_core::visible::{CUDA_VISIBLE_DEVICES, DeviceMap, container_selection, visible_value};
use vgpu_cuda_abi::fns::{
    PFN_nvmlDeviceGetHandleByUUID, PFN_nvmlDeviceGetIndex, PFN_nvmlDeviceGetUUID,
};
use vgpu_cuda_abi::nvml::{
    NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_NOT_FOUND, NVML_SUCCESS, nvmlDevice_t, nvmlReturn_t,
};

use crate::real::{self, real};
use crate::table::Id;

/// The container's GPUs (the quota file's, in its order); unset without a quota file.
static GRANTED: OnceLock<Vec<String>> = OnceLock::new();
/// The container's GPUs this process chose with its own `CUDA_VISIBLE_DEVICES`.
static SELECTED: OnceLock<Vec<String>> = OnceLock::new();
/// The ordinals the accounts know (UUIDs by ordinal), once restricted: the CUDA
/// driver's devices, then the container's GPUs this process left out with its own
/// `CUDA_VISIBLE_DEVICES` ([`driver_view`]).
static ORDINALS: OnceLock<Vec<String>> = OnceLock::new();
/// NVML's indices of the container's GPUs, once NVML could say.
static NVML_MAP: OnceLock<DeviceMap> = OnceLock::new();

/// The GPUs of the quota file `quota_text`, in its order (None if it cannot be read: the
/// configuration reports the file by name and value).
pub(crate) fn granted_of(quota_text: &str) -> Option<Vec<String>> {
    ContainerQuota::from_json(quota_text)
        .ok()
        .map(|q| q.gpus.iter().map(|g| g.uuid.trim().to_owned()).collect())
}

/// The container's GPUs that a process whose own `CUDA_VISIBLE_DEVICES` is `tenant`
/// uses (its indices and UUIDs name the container's GPUs `granted`), in its order.
pub fn selected(tenant: Option<&str>, granted: &[String]) -> Vec<String> {
    container_selection(tenant, granted)
        .into_iter()
        .filter_map(|i| granted.get(i).cloned())
        .collect()
}

/// The `CUDA_VISIBLE_DEVICES` value that shows this process the container's GPUs
/// `granted`, narrowed by the process's own value `tenant`.
pub fn driver_value(tenant: Option<&str>, granted: &[String]) -> String {
    visible_value(&selected(tenant, granted))
}

/// Hides from the CUDA driver every GPU the quota file `quota_text` does not grant:
/// sets `CUDA_VISIBLE_DEVICES` before the driver initialises (the shim's configuration
/// runs before the first real `cuInit`). Writes the environment only when the value
/// changes (in Kubernetes the device plugin already sets it).
pub fn restrict_driver(quota_text: &str) {
    let Some(granted) = granted_of(quota_text) else {
        // A file no reader can use fails the configuration, loudly, naming the file; until
        // then NVML shows no GPU, and the driver is left alone so that the error is that
        // one, not a missing device.
        let _ = GRANTED.set(Vec::new());
        return;
    };
    let tenant = std::env::var_os(CUDA_VISIBLE_DEVICES).map(|v| v.to_string_lossy().into_owned());
    let chosen = selected(tenant.as_deref(), &granted);
    let value = visible_value(&chosen);
    // A UUID with a NUL cannot be an environment value (nor any GPU's: the quota file
    // check reports it); the driver is then left alone.
    if tenant.as_deref() != Some(value.as_str()) && !value.contains('\0') {
        // SAFETY: `setenv` may race with another thread reading the environment. It runs
        // at most once or twice per process (the shim's configuration, before the real
        // driver initialises), replacing a variable is one pointer store in glibc (the
        // old string is never freed), and where the device plugin set the variable, as
        // in Kubernetes, the value is already right and nothing is written (ADR 0014).
        unsafe { std::env::set_var(CUDA_VISIBLE_DEVICES, &value) };
    }
    let _ = SELECTED.set(chosen);
    let _ = GRANTED.set(granted);
}

/// Records the driver's devices after [`restrict_driver`] (UUIDs by CUDA ordinal), and
/// says once, loudly, if the driver shows a GPU the container was not granted (a driver
/// that ignored `CUDA_VISIBLE_DEVICES`: those GPUs then get no memory and no share).
///
/// Returns the list to check the quota file against: the driver's devices, then the
/// container's GPUs this process left out with its own `CUDA_VISIBLE_DEVICES`, at
/// ordinals no device has (so the file is still checked whole: a granted GPU the node
/// lacks remains an error, one the tenant chose not to use is not).
pub fn driver_view(uuids: &[String]) -> Vec<String> {
    if let Some(granted) = GRANTED.get() {
        let extra: Vec<&str> = uuids
            .iter()
            .filter(|u| !granted.iter().any(|g| same_gpu(g, u)))
            .map(String::as_str)
            .collect();
        if !extra.is_empty() {
            static ONCE: OnceLock<()> = OnceLock::new();
            ONCE.get_or_init(|| {
                crate::say!(
                    "vgpu: WARNING: the CUDA driver ignored CUDA_VISIBLE_DEVICES and shows {}, which this container was not granted: nothing can be allocated there",
                    extra.join(", ")
                );
            });
        }
    }
    let all = match (GRANTED.get(), SELECTED.get()) {
        (Some(granted), Some(chosen)) => with_left_out(uuids, granted, chosen),
        _ => uuids.to_vec(),
    };
    let _ = ORDINALS.set(all.clone());
    all
}

/// The devices `uuids` (by CUDA ordinal), then the container's GPUs `granted` that this
/// process left out of its selection `chosen` and that `uuids` lacks, at the ordinals
/// past the driver's: the ordinals the accounts know.
pub fn with_left_out(uuids: &[String], granted: &[String], chosen: &[String]) -> Vec<String> {
    let mut all = uuids.to_vec();
    for g in granted {
        let left_out = !chosen.iter().any(|c| same_gpu(c, g));
        if left_out && !all.iter().any(|u| same_gpu(u, g)) {
            all.push(g.clone());
        }
    }
    all
}

/// The container's GPUs if the shim hides the others (a quota file), else None (also
/// when `passes_through`, the shim's mode under `VGPU_ON_ERROR=unenforced` after an
/// error: everything passes through). The caller decides the mode first: that runs the
/// configuration, which reads the quota file.
pub fn granted(passes_through: bool) -> Option<&'static [String]> {
    if passes_through {
        return None;
    }
    GRANTED.get().map(Vec::as_slice)
}

/// The UUID of an NVML handle, from the real NVML.
pub(crate) fn handle_uuid(device: nvmlDevice_t) -> Result<String, nvmlReturn_t> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = *P.get_or_init(|| real::nvml().map_or(0, |l| l.sym(c"nvmlDeviceGetUUID")));
    if p == 0 {
        return Err(NVML_ERROR_FUNCTION_NOT_FOUND);
    }
    // SAFETY: `p` is the real nvmlDeviceGetUUID(nvmlDevice_t, char*, unsigned int).
    let f = unsafe { std::mem::transmute::<usize, PFN_nvmlDeviceGetUUID>(p) };
    let mut buf = [0 as c_char; 96];
    // SAFETY: a handle the caller got from NVML and a buffer of the stated length.
    let r = unsafe { f(device, buf.as_mut_ptr(), buf.len() as c_uint) };
    if r != NVML_SUCCESS {
        return Err(r);
    }
    // SAFETY: NVML wrote a NUL-terminated string within the zeroed buffer, whose last
    // byte it never writes past.
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Ok(s.to_string_lossy().into_owned())
}

/// NVML's index of a handle, from the real NVML.
fn real_index(device: nvmlDevice_t) -> Result<usize, nvmlReturn_t> {
    // SAFETY: the C signature of nvmlDeviceGetIndex.
    let f = unsafe { real::<PFN_nvmlDeviceGetIndex>(Id::nvmlDeviceGetIndex) }
        .ok_or(NVML_ERROR_FUNCTION_NOT_FOUND)?;
    let mut i: c_uint = 0;
    // SAFETY: a handle NVML gave and a valid out-pointer.
    let r = unsafe { f(device, &mut i) };
    if r == NVML_SUCCESS {
        Ok(i as usize)
    } else {
        Err(r)
    }
}

/// The container's GPUs against NVML's indices (None: nothing is hidden, as when
/// `passes_through`, see [`granted`]). Built from the real NVML once it answers for
/// every granted GPU (the application has called `nvmlInit`), then kept: NVML's indices
/// do not change while the driver is loaded.
pub fn nvml_map(passes_through: bool) -> Result<Option<&'static DeviceMap>, nvmlReturn_t> {
    let Some(granted) = granted(passes_through) else {
        return Ok(None);
    };
    if let Some(m) = NVML_MAP.get() {
        return Ok(Some(m));
    }
    // SAFETY: the C signature of nvmlDeviceGetHandleByUUID.
    let by_uuid = unsafe { real::<PFN_nvmlDeviceGetHandleByUUID>(Id::nvmlDeviceGetHandleByUUID) }
        .ok_or(NVML_ERROR_FUNCTION_NOT_FOUND)?;
    let mut real_uuids: Vec<(usize, String)> = Vec::new();
    for g in granted {
        let Ok(key) = std::ffi::CString::new(g.as_str()) else {
            continue;
        };
        let mut h: nvmlDevice_t = std::ptr::null_mut();
        // SAFETY: a NUL-terminated UUID and a valid out-pointer.
        match unsafe { by_uuid(key.as_ptr(), &mut h) } {
            NVML_SUCCESS => real_uuids.push((real_index(h)?, g.clone())),
            NVML_ERROR_NOT_FOUND => {}
            e => return Err(e),
        }
    }
    // NVML's enumeration as far as the container's GPUs are concerned: UUIDs by index.
    let len = real_uuids.iter().map(|(i, _)| i + 1).max().unwrap_or(0);
    let mut by_index = vec![String::new(); len];
    for (i, u) in real_uuids {
        if let Some(slot) = by_index.get_mut(i) {
            *slot = u;
        }
    }
    Ok(Some(
        NVML_MAP.get_or_init(|| DeviceMap::new(granted, &by_index)),
    ))
}

/// Whether the container may see NVML device `device` (a GPU it was granted, or any
/// when nothing is hidden; `passes_through` as for [`nvml_map`]).
pub(crate) fn nvml_visible(
    device: nvmlDevice_t,
    passes_through: bool,
) -> Result<bool, nvmlReturn_t> {
    match nvml_map(passes_through)? {
        None => Ok(true),
        Some(m) => Ok(m.virt(real_index(device)?).is_some()),
    }
}

/// The CUDA ordinal of NVML device `device` (the accounts are kept by CUDA ordinal):
/// the driver's device with the same UUID, or for a granted GPU this process left out
/// with its own `CUDA_VISIBLE_DEVICES` (NVML still shows it), the ordinal past the
/// driver's that [`driver_view`] gave it, so that NVML shows its quota and usage too;
/// without a quota file (the driver was not asked), NVML's index, which the device
/// plugin's `CUDA_DEVICE_ORDER=PCI_BUS_ID` makes agree.
pub(crate) fn cuda_ordinal(device: nvmlDevice_t) -> Option<usize> {
    match ORDINALS.get() {
        Some(uuids) => {
            let u = handle_uuid(device).ok()?;
            uuids.iter().position(|d| same_gpu(d, &u))
        }
        None => real_index(device).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-51570000-0000-4000-8000-000000000000";
    const B: &str = "GPU-51570000-0000-4000-8000-000000000001";

    #[test]
    fn the_driver_is_shown_the_granted_gpus_narrowed_by_the_tenant() {
        let granted = vec![B.to_owned(), A.to_owned()];
        assert_eq!(driver_value(None, &granted), format!("{B},{A}"));
        assert_eq!(
            driver_value(Some("1"), &granted),
            A,
            "index 1 = 2nd granted"
        );
        assert_eq!(
            driver_value(Some(&format!("{B},{A}")), &granted),
            format!("{B},{A}")
        );
        assert_eq!(
            driver_value(Some("GPU-51570000-0000-4000-8000-000000000002"), &granted),
            ""
        );
        assert_eq!(driver_value(Some("2"), &granted), "");
        assert_eq!(driver_value(None, &[]), "", "no GPU granted: none shown");
        assert_eq!(granted_of("{not json"), None);
    }
}
