//! `vgpu-smi`: an `nvidia-smi`-like view of a node's GPUs and the compute processes on
//! them, read through NVML with the unmodified [`nvml_wrapper`] client crate.
//!
//! On a real node it shows the real driver's view; with `LD_LIBRARY_PATH` pointing at the
//! simulated driver (`target/cuda-sim`, built by `cargo xtask sim`) it shows the simulated
//! node named by `VGPU_SIM_DIR`. Every figure comes from NVML: memory and processes from
//! the driver's accounting, utilization from its measurement of device time.
//!
//! `vgpu-smi topo -m` prints the GPU connection matrix as `nvidia-smi topo -m` does
//! ([`topo`]).
//!
//! The library is split into [`snapshot`] (the NVML queries, into a plain [`NodeView`]) and
//! pure renderers ([`render_table`], [`render_json`]), so the formatting is unit-tested
//! without a driver.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessUtilizationSample;
use serde::Serialize;

pub mod topo;

/// The NVML library loaded when `--nvml-lib` is not given: the driver's runtime name,
/// found through the dynamic linker's search path (`LD_LIBRARY_PATH`, `ld.so.cache`).
pub const DEFAULT_NVML_LIB: &str = "libnvidia-ml.so.1";

/// What `vgpu-smi` does: one validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// NVML library to load: a path or a name for the dynamic linker's search.
    pub nvml_lib: PathBuf,
    /// Time between views; `None` shows one view.
    pub watch: Option<Duration>,
    /// Number of views; `None` with `watch` means until interrupted.
    pub count: Option<u64>,
    /// Print each view as one line of JSON instead of a table.
    pub json: bool,
    /// Show the GPU topology matrix (`vgpu-smi topo -m`) instead of the GPU table.
    pub topo: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            nvml_lib: PathBuf::from(DEFAULT_NVML_LIB),
            watch: None,
            count: None,
            json: false,
            topo: false,
        }
    }
}

/// Why a view could not be shown.
#[derive(Debug, thiserror::Error)]
pub enum SmiError {
    /// NVML could not be loaded or initialized.
    #[error("cannot load and initialize NVML from {lib} (nvmlInit_v2)")]
    Init {
        /// The library asked for.
        lib: String,
        /// The cause.
        #[source]
        source: NvmlError,
    },
    /// An NVML query failed.
    #[error("NVML call {call} failed{}", on_gpu(.gpu))]
    Call {
        /// The NVML function, as named in `nvml.h`.
        call: &'static str,
        /// The GPU index it was asked about, if any.
        gpu: Option<u32>,
        /// The cause.
        #[source]
        source: NvmlError,
    },
    /// The view could not be written (e.g. the reader closed the pipe).
    #[error("cannot write the view to the output")]
    Write(#[source] std::io::Error),
    /// The view could not be encoded as JSON.
    #[error("cannot encode the view as JSON")]
    Json(#[source] serde_json::Error),
}

fn on_gpu(gpu: &Option<u32>) -> String {
    gpu.map(|g| format!(" for GPU {g}")).unwrap_or_default()
}

/// The node as NVML shows it at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeView {
    /// Driver version string (`nvmlSystemGetDriverVersion`).
    pub driver_version: String,
    /// CUDA driver API version, `major * 1000 + minor * 10`
    /// (`nvmlSystemGetCudaDriverVersion_v2`).
    pub cuda_version: i32,
    /// The GPUs, in NVML index order.
    pub gpus: Vec<GpuView>,
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuView {
    /// NVML index.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// `GPU-xxxxxxxx-...` UUID.
    pub uuid: String,
    /// PCI bus id, `DDDDDDDD:BB:DD.F`.
    pub pci_bus_id: String,
    /// Device memory in use, bytes (contexts and allocations of every process).
    pub memory_used: u64,
    /// Device memory, bytes.
    pub memory_total: u64,
    /// Percent of the last sample period in which a kernel ran; `None` where the device
    /// does not report it.
    pub utilization_pct: Option<u32>,
    /// Processes with a compute context on this GPU, by pid.
    pub processes: Vec<ProcessView>,
}

/// One compute process on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessView {
    /// Process id (in NVML's pid namespace: the host's on a real node).
    pub pid: u32,
    /// Process name, where NVML can tell it.
    pub name: Option<String>,
    /// Device memory the process holds, bytes; `None` where the driver does not say.
    pub memory_used: Option<u64>,
    /// The process's SM utilization averaged over the driver's buffered samples, percent;
    /// `None` where no sample is available.
    pub sm_pct: Option<u32>,
}

/// Maps a failed NVML query to [`SmiError::Call`].
fn call<T>(name: &'static str, gpu: Option<u32>, r: Result<T, NvmlError>) -> Result<T, SmiError> {
    r.map_err(|source| SmiError::Call {
        call: name,
        gpu,
        source,
    })
}

/// Like [`call`], for queries a device or driver may legitimately not answer: those
/// answers become `None`, every other error is still an error.
fn optional<T>(
    name: &'static str,
    gpu: Option<u32>,
    r: Result<T, NvmlError>,
) -> Result<Option<T>, SmiError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(
            NvmlError::NotSupported
            | NvmlError::NotFound
            | NvmlError::NoPermission
            | NvmlError::FunctionNotFound
            | NvmlError::FailedToLoadSymbol(_),
        ) => Ok(None),
        Err(source) => Err(SmiError::Call {
            call: name,
            gpu,
            source,
        }),
    }
}

/// Loads and initializes NVML from `lib` (a path, or a name for the dynamic linker).
pub fn open(lib: &OsStr) -> Result<Nvml, SmiError> {
    Nvml::builder()
        .lib_path(lib)
        .init()
        .map_err(|source| SmiError::Init {
            lib: lib.to_string_lossy().into_owned(),
            source,
        })
}

/// Reads the node's view from NVML.
pub fn snapshot(nvml: &Nvml) -> Result<NodeView, SmiError> {
    let driver_version = call(
        "nvmlSystemGetDriverVersion",
        None,
        nvml.sys_driver_version(),
    )?;
    let cuda_version = call(
        "nvmlSystemGetCudaDriverVersion_v2",
        None,
        nvml.sys_cuda_driver_version(),
    )?;
    let count = call("nvmlDeviceGetCount_v2", None, nvml.device_count())?;
    let gpus = (0..count)
        .map(|i| gpu_view(nvml, i))
        .collect::<Result<_, _>>()?;
    Ok(NodeView {
        driver_version,
        cuda_version,
        gpus,
    })
}

fn gpu_view(nvml: &Nvml, index: u32) -> Result<GpuView, SmiError> {
    let g = Some(index);
    let dev = call(
        "nvmlDeviceGetHandleByIndex_v2",
        g,
        nvml.device_by_index(index),
    )?;
    let name = call("nvmlDeviceGetName", g, dev.name())?;
    let uuid = call("nvmlDeviceGetUUID", g, dev.uuid())?;
    let pci = call("nvmlDeviceGetPciInfo_v3", g, dev.pci_info())?;
    let mem = call("nvmlDeviceGetMemoryInfo_v2", g, dev.memory_info())?;
    let utilization_pct =
        optional("nvmlDeviceGetUtilizationRates", g, dev.utilization_rates())?.map(|u| u.gpu);
    let procs = call(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        g,
        dev.running_compute_processes(),
    )?;
    let samples = optional(
        "nvmlDeviceGetProcessUtilization",
        g,
        dev.process_utilization_stats(None),
    )?
    .unwrap_or_default();
    let sm = average_sm_by_pid(&samples);
    let mut processes = Vec::with_capacity(procs.len());
    for p in procs {
        // The process may exit between the two queries: no name then, not an error.
        let name = optional(
            "nvmlSystemGetProcessName",
            g,
            nvml.sys_process_name(p.pid, 64),
        )?;
        processes.push(ProcessView {
            pid: p.pid,
            name,
            memory_used: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            },
            sm_pct: sm.get(&p.pid).copied(),
        });
    }
    processes.sort_by_key(|p| p.pid);
    Ok(GpuView {
        index,
        name,
        uuid,
        pci_bus_id: pci.bus_id,
        memory_used: mem.used,
        memory_total: mem.total,
        utilization_pct,
        processes,
    })
}

/// The mean SM utilization of each pid over its samples (NVML may buffer several samples
/// per process; the simulated driver gives one per process).
pub fn average_sm_by_pid(samples: &[ProcessUtilizationSample]) -> BTreeMap<u32, u32> {
    let mut acc: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for s in samples {
        let e = acc.entry(s.pid).or_default();
        e.0 += u64::from(s.sm_util);
        e.1 += 1;
    }
    acc.into_iter()
        .map(|(pid, (sum, n))| {
            let mean = (sum + n / 2) / n;
            (pid, u32::try_from(mean).unwrap_or(u32::MAX))
        })
        .collect()
}

/// Bytes as a short human figure: `512 B`, `300 MiB`, `20.5 GiB`.
pub fn format_bytes(b: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if b >= GIB {
        format!("{:.1} GiB", b as f64 / GIB as f64)
    } else if b >= MIB {
        format!("{} MiB", (b + MIB / 2) / MIB)
    } else if b >= KIB {
        format!("{} KiB", (b + KIB / 2) / KIB)
    } else {
        format!("{b} B")
    }
}

/// NVML's CUDA version number (`12040`) as text (`12.4`).
pub fn format_cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A process name as the table shows it: NVML gives the executable's path, the table its
/// last component.
pub fn short_name(name: &str) -> &str {
    name.rsplit('/').find(|s| !s.is_empty()).unwrap_or(name)
}

fn pct(p: Option<u32>) -> String {
    p.map(|p| format!("{p} %")).unwrap_or_else(|| "n/a".into())
}

/// The view as a table, `nvidia-smi`-like: a header, then per GPU its identity, memory and
/// utilization, and its compute processes.
pub fn render_table(v: &NodeView) -> String {
    let mut s = format!(
        "Driver {}   CUDA {}   {} GPU(s)\n",
        v.driver_version,
        format_cuda_version(v.cuda_version),
        v.gpus.len()
    );
    for g in &v.gpus {
        let share = if g.memory_total > 0 {
            format!(
                " ({} %)",
                (u128::from(g.memory_used) * 100 + u128::from(g.memory_total) / 2)
                    / u128::from(g.memory_total)
            )
        } else {
            String::new()
        };
        s.push_str(&format!(
            "\nGPU {}  {}  {}  bus {}\n",
            g.index, g.name, g.uuid, g.pci_bus_id
        ));
        s.push_str(&format!(
            "  memory {} / {}{}   utilization {}\n",
            format_bytes(g.memory_used),
            format_bytes(g.memory_total),
            share,
            pct(g.utilization_pct)
        ));
        if g.processes.is_empty() {
            s.push_str("  no compute processes\n");
            continue;
        }
        s.push_str(&format!(
            "  {:>8}  {:<16}  {:>10}  {:>5}\n",
            "PID", "PROCESS", "MEMORY", "SM"
        ));
        for p in &g.processes {
            s.push_str(&format!(
                "  {:>8}  {:<16}  {:>10}  {:>5}\n",
                p.pid,
                p.name.as_deref().map(short_name).unwrap_or("?"),
                p.memory_used
                    .map(format_bytes)
                    .unwrap_or_else(|| "n/a".into()),
                pct(p.sm_pct)
            ));
        }
    }
    s
}

/// The view as one line of JSON (the fields of [`NodeView`]).
pub fn render_json(v: &NodeView) -> Result<String, SmiError> {
    serde_json::to_string(v).map_err(SmiError::Json)
}

/// Shows the view as `config` asks, writing to `out`.
pub fn run(config: &Config, out: &mut dyn Write) -> Result<(), SmiError> {
    let nvml = open(config.nvml_lib.as_os_str())?;
    if config.topo {
        let view = topo::snapshot(&nvml)?;
        let text = if config.json {
            serde_json::to_string(&view).map_err(SmiError::Json)?
        } else {
            topo::render_matrix(&view)
        };
        writeln!(out, "{text}").map_err(SmiError::Write)?;
        return out.flush().map_err(SmiError::Write);
    }
    let views = match (config.watch, config.count) {
        (_, Some(n)) => n,
        (Some(_), None) => u64::MAX,
        (None, None) => 1,
    };
    for i in 0..views {
        if i > 0 {
            std::thread::sleep(config.watch.unwrap_or(Duration::from_secs(1)));
        }
        let view = snapshot(&nvml)?;
        let text = if config.json {
            render_json(&view)?
        } else if i > 0 {
            format!("\n{}", render_table(&view))
        } else {
            render_table(&view)
        };
        writeln!(out, "{text}").map_err(SmiError::Write)?;
        out.flush().map_err(SmiError::Write)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn sample(pid: u32, sm: u32) -> ProcessUtilizationSample {
        ProcessUtilizationSample {
            pid,
            timestamp: 1,
            sm_util: sm,
            mem_util: 0,
            enc_util: 0,
            dec_util: 0,
        }
    }

    fn view() -> NodeView {
        NodeView {
            driver_version: "550.54.15".into(),
            cuda_version: 12040,
            gpus: vec![
                GpuView {
                    index: 0,
                    name: "NVIDIA H100 80GB HBM3".into(),
                    uuid: "GPU-51570000-0000-4000-8000-000000000000".into(),
                    pci_bus_id: "00000000:18:00.0".into(),
                    memory_used: 20 * GIB,
                    memory_total: 80 * GIB,
                    utilization_pct: Some(100),
                    processes: vec![
                        ProcessView {
                            pid: 4242,
                            name: Some("/opt/bin/cuda-probe".into()),
                            memory_used: Some(20 * GIB),
                            sm_pct: Some(51),
                        },
                        ProcessView {
                            pid: 77,
                            name: None,
                            memory_used: None,
                            sm_pct: None,
                        },
                    ],
                },
                GpuView {
                    index: 1,
                    name: "NVIDIA A100-SXM4-40GB".into(),
                    uuid: "GPU-b".into(),
                    pci_bus_id: "00000000:28:00.0".into(),
                    memory_used: 0,
                    memory_total: 40 * GIB,
                    utilization_pct: None,
                    processes: vec![],
                },
            ],
        }
    }

    #[test]
    fn bytes_are_short_and_rounded() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "2 KiB");
        assert_eq!(format_bytes(300 << 20), "300 MiB");
        assert_eq!(format_bytes((1 << 30) - 1), "1024 MiB");
        assert_eq!(format_bytes(GIB), "1.0 GiB");
        assert_eq!(format_bytes(20 * GIB + (GIB / 2)), "20.5 GiB");
        assert_eq!(format_bytes(80 * GIB), "80.0 GiB");
    }

    #[test]
    fn process_names_lose_their_directories() {
        assert_eq!(short_name("/work/target/release/cuda-probe"), "cuda-probe");
        assert_eq!(short_name("python3"), "python3");
        assert_eq!(short_name("dir/"), "dir");
        assert_eq!(short_name(""), "");
    }

    #[test]
    fn cuda_versions_read_as_major_minor() {
        assert_eq!(format_cuda_version(12040), "12.4");
        assert_eq!(format_cuda_version(13000), "13.0");
        assert_eq!(format_cuda_version(11080), "11.8");
    }

    #[test]
    fn sm_utilization_is_the_rounded_mean_per_pid() {
        let s = [sample(1, 50), sample(2, 10), sample(1, 51), sample(1, 52)];
        let m = average_sm_by_pid(&s);
        assert_eq!(m.get(&1), Some(&51));
        assert_eq!(m.get(&2), Some(&10));
        assert_eq!(m.len(), 2);
        assert!(average_sm_by_pid(&[]).is_empty());
        // Rounds half up: (50 + 51) / 2 = 50.5.
        assert_eq!(
            average_sm_by_pid(&[sample(3, 50), sample(3, 51)]).get(&3),
            Some(&51)
        );
    }

    #[test]
    fn the_table_shows_every_gpu_and_process() {
        let t = render_table(&view());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "Driver 550.54.15   CUDA 12.4   2 GPU(s)");
        assert!(t.contains(
            "GPU 0  NVIDIA H100 80GB HBM3  GPU-51570000-0000-4000-8000-000000000000  bus 00000000:18:00.0"
        ));
        assert!(t.contains("memory 20.0 GiB / 80.0 GiB (25 %)   utilization 100 %"));
        assert!(t.contains("memory 0 B / 40.0 GiB (0 %)   utilization n/a"));
        let row = lines
            .iter()
            .find(|l| l.contains("4242"))
            .expect("a row for pid 4242");
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            ["4242", "cuda-probe", "20.0", "GiB", "51", "%"]
        );
        let row = lines
            .iter()
            .find(|l| l.contains(" 77 "))
            .expect("a row for pid 77");
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            ["77", "?", "n/a", "n/a"]
        );
        // GPU 1 has no processes, and says so after its own header.
        let g1 = t.find("GPU 1").expect("GPU 1 header");
        assert!(t[g1..].contains("no compute processes"));
        assert!(!t[..g1].contains("no compute processes"));
    }

    #[test]
    fn the_table_columns_line_up() {
        let t = render_table(&view());
        let header = t
            .lines()
            .find(|l| l.contains("PID"))
            .expect("a process header");
        let row = t
            .lines()
            .find(|l| l.contains("4242"))
            .expect("a row for pid 4242");
        assert_eq!(header.len(), row.len(), "{header:?} vs {row:?}");
        assert_eq!(
            header.find("MEMORY").map(|i| i + 6),
            row.find("GiB").map(|i| i + 3)
        );
    }

    #[test]
    fn json_is_one_line_with_every_field() {
        let j = render_json(&view()).expect("encodes");
        assert!(!j.contains('\n'));
        let back: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        assert_eq!(back["cuda_version"], 12040);
        assert_eq!(back["gpus"][0]["processes"][0]["pid"], 4242);
        assert_eq!(back["gpus"][0]["processes"][0]["memory_used"], 20 * GIB);
        assert_eq!(back["gpus"][0]["processes"][0]["sm_pct"], 51);
        assert_eq!(
            back["gpus"][0]["processes"][1]["name"],
            serde_json::Value::Null
        );
        assert_eq!(back["gpus"][1]["utilization_pct"], serde_json::Value::Null);
        assert_eq!(back["gpus"][1]["memory_total"], 40 * GIB);
    }

    #[test]
    fn a_missing_library_is_a_clear_error_naming_the_call() {
        let e = open(OsStr::new("/nonexistent/libnvidia-ml.so.1")).expect_err("no library");
        let msg = e.to_string();
        assert!(msg.contains("/nonexistent/libnvidia-ml.so.1"), "{msg}");
        assert!(msg.contains("nvmlInit_v2"), "{msg}");
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn call_errors_name_the_call_and_the_gpu() {
        let e = call::<()>(
            "nvmlDeviceGetMemoryInfo_v2",
            Some(1),
            Err(NvmlError::GpuLost),
        )
        .expect_err("an error");
        assert_eq!(
            e.to_string(),
            "NVML call nvmlDeviceGetMemoryInfo_v2 failed for GPU 1"
        );
        let e = call::<()>("nvmlSystemGetDriverVersion", None, Err(NvmlError::Unknown))
            .expect_err("an error");
        assert_eq!(e.to_string(), "NVML call nvmlSystemGetDriverVersion failed");
    }

    #[test]
    fn optional_queries_tolerate_only_unsupported_answers() {
        assert_eq!(
            optional::<u32>("x", None, Err(NvmlError::NotSupported)).expect("tolerated"),
            None
        );
        assert_eq!(
            optional::<u32>("x", None, Err(NvmlError::NotFound)).expect("tolerated"),
            None
        );
        assert_eq!(optional("x", None, Ok(3)).expect("ok"), Some(3));
        assert!(optional::<u32>("x", Some(0), Err(NvmlError::GpuLost)).is_err());
    }
}
