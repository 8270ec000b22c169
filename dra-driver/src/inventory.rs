//! The node's GPUs as NVML reports them (index, UUID, model, memory): what the driver
//! maps DRA device names (`gpu-<index>`) to.

use std::path::Path;

use nvml_wrapper::Nvml;
use vgpu_core::inventory::GpuInfo;

/// Why the GPUs could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// NVML could not be loaded or initialised.
    #[error("initialise NVML ({lib})")]
    Init {
        /// The library asked for.
        lib: String,
        /// NVML's error.
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    /// A query of one GPU failed.
    #[error("NVML: GPU {index}: {what}")]
    Query {
        /// The GPU's index.
        index: u32,
        /// The query.
        what: &'static str,
        /// NVML's error.
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
}

/// The GPUs NVML (the system's, or the library `lib`) lists, by index.
pub fn discover(lib: Option<&Path>) -> Result<Vec<GpuInfo>, InventoryError> {
    let name = lib.map_or_else(
        || "libnvidia-ml.so.1".to_owned(),
        |p| p.display().to_string(),
    );
    let init = |source| InventoryError::Init {
        lib: name.clone(),
        source,
    };
    let nvml = match lib {
        Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
        None => Nvml::init(),
    }
    .map_err(init)?;
    let count = nvml.device_count().map_err(init)?;
    let mut gpus = Vec::new();
    for index in 0..count {
        let q = |what| {
            move |source| InventoryError::Query {
                index,
                what,
                source,
            }
        };
        let d = nvml.device_by_index(index).map_err(q("device"))?;
        gpus.push(GpuInfo {
            index,
            uuid: d.uuid().map_err(q("uuid"))?,
            model: d.name().map_err(q("name"))?,
            memory_mib: d.memory_info().map_err(q("memory"))?.total >> 20,
            healthy: true,
            topology: None,
        });
    }
    Ok(gpus)
}
