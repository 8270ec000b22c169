//! Reading the trace's CSV files (`openb_node_list_gpu_node.csv`, `openb_pod_list_*.csv`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use vgpu_core::packing::{GpuSpec, NodeSpec, Task};
use vgpu_core::resources::{GpuDemand, ModelConstraint};

/// Why a trace file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A required column is missing from the header.
    #[error("{path}: missing column {column:?} in the header")]
    MissingColumn {
        /// The file.
        path: PathBuf,
        /// The column.
        column: &'static str,
    },
    /// A field is not what the column needs.
    #[error("{path}:{line}: column {column:?}: bad value {value:?}: {reason}")]
    BadField {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The column.
        column: &'static str,
        /// The text.
        value: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// Two nodes share a name.
    #[error("{path}:{line}: duplicate node name {name:?}")]
    DuplicateNode {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The name.
        name: String,
    },
}

struct Csv {
    path: PathBuf,
    header: Vec<String>,
    rows: Vec<(usize, Vec<String>)>,
}

impl Csv {
    fn read(path: &Path) -> Result<Self, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: path.to_owned(),
            source,
        })?;
        let mut lines = text.lines().enumerate();
        let header = lines
            .next()
            .map(|(_, h)| h.split(',').map(|s| s.trim().to_owned()).collect())
            .unwrap_or_default();
        let rows = lines
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| (i + 1, l.split(',').map(|s| s.trim().to_owned()).collect()))
            .collect();
        Ok(Csv {
            path: path.to_owned(),
            header,
            rows,
        })
    }

    fn column(&self, name: &'static str) -> Result<usize, TraceError> {
        self.header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| TraceError::MissingColumn {
                path: self.path.clone(),
                column: name,
            })
    }

    fn optional_column(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| h == name)
    }

    fn field<'a>(
        &self,
        line: usize,
        row: &'a [String],
        col: usize,
        name: &'static str,
    ) -> Result<&'a str, TraceError> {
        row.get(col)
            .map(String::as_str)
            .ok_or_else(|| TraceError::BadField {
                path: self.path.clone(),
                line,
                column: name,
                value: String::new(),
                reason: "missing field",
            })
    }

    fn number(
        &self,
        line: usize,
        row: &[String],
        col: usize,
        name: &'static str,
    ) -> Result<u64, TraceError> {
        let v = self.field(line, row, col, name)?;
        v.parse().map_err(|_| TraceError::BadField {
            path: self.path.clone(),
            line,
            column: name,
            value: v.to_owned(),
            reason: "expected a non-negative integer",
        })
    }
}

/// GPU memory by model, MiB. The trace gives none; every task's memory is proportional to
/// its compute share, so these values only set the unit.
fn model_memory_mib(model: &str) -> u64 {
    match model {
        "V100M32" => 32 * 1024,
        "A10" => 24 * 1024,
        "T4" => 15 * 1024,
        _ => 16 * 1024,
    }
}

/// Reads the node list (`sn,cpu_milli,memory_mib,gpu,model`).
pub fn read_nodes(path: &Path) -> Result<Vec<NodeSpec>, TraceError> {
    let csv = Csv::read(path)?;
    let (sn, cpu, mem, gpu, model) = (
        csv.column("sn")?,
        csv.column("cpu_milli")?,
        csv.column("memory_mib")?,
        csv.column("gpu")?,
        csv.column("model")?,
    );
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(csv.rows.len());
    for (line, row) in &csv.rows {
        let name = csv.field(*line, row, sn, "sn")?.to_owned();
        if !seen.insert(name.clone()) {
            return Err(TraceError::DuplicateNode {
                path: path.to_owned(),
                line: *line,
                name,
            });
        }
        let n_gpu = csv.number(*line, row, gpu, "gpu")?;
        if n_gpu > 1024 {
            return Err(TraceError::BadField {
                path: path.to_owned(),
                line: *line,
                column: "gpu",
                value: n_gpu.to_string(),
                reason: "more than 1024 GPUs on one node",
            });
        }
        let model = csv.field(*line, row, model, "model")?.to_owned();
        let gpus = (0..n_gpu)
            .map(|i| GpuSpec {
                uuid: format!("{name}-gpu{i}"),
                model: model.clone(),
                memory_mib: model_memory_mib(&model),
            })
            .collect();
        out.push(NodeSpec {
            topology: Default::default(),
            cpu_milli: csv.number(*line, row, cpu, "cpu_milli")?,
            memory_mib: csv.number(*line, row, mem, "memory_mib")?,
            gpus,
            name,
            slices_per_gpu: vgpu_core::resources::SLICES_PER_GPU,
        });
    }
    Ok(out)
}

/// Reads a task list (`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,…]`).
pub fn read_tasks(path: &Path) -> Result<Vec<Task>, TraceError> {
    let csv = Csv::read(path)?;
    let (cpu, mem, num, milli) = (
        csv.column("cpu_milli")?,
        csv.column("memory_mib")?,
        csv.column("num_gpu")?,
        csv.column("gpu_milli")?,
    );
    let spec = csv.optional_column("gpu_spec");
    let mut out = Vec::with_capacity(csv.rows.len());
    for (line, row) in &csv.rows {
        let bad = |column: &'static str, value: u64, reason: &'static str| TraceError::BadField {
            path: path.to_owned(),
            line: *line,
            column,
            value: value.to_string(),
            reason,
        };
        let n = csv.number(*line, row, num, "num_gpu")?;
        let m = csv.number(*line, row, milli, "gpu_milli")?;
        let n32 = u32::try_from(n).map_err(|_| bad("num_gpu", n, "too large"))?;
        let m32 = u32::try_from(m).map_err(|_| bad("gpu_milli", m, "too large"))?;
        let gpus = match (n32, m32) {
            (0, 0) => Vec::new(),
            (0, _) => return Err(bad("gpu_milli", m, "GPU share without a GPU")),
            (_, 0) => return Err(bad("gpu_milli", m, "a GPU task needs gpu_milli > 0")),
            (_, m) if m > 1000 => {
                return Err(bad(
                    "gpu_milli",
                    u64::from(m),
                    "more than 1000 milli on one GPU",
                ));
            }
            (1, m) if m < 1000 => vec![GpuDemand::share_milli(m)],
            (k, 1000) => vec![GpuDemand::whole(k)],
            (_, _) => {
                return Err(bad("gpu_milli", m, "fractions only for single-GPU tasks"));
            }
        };
        let models = match spec.and_then(|c| row.get(c)) {
            Some(s) if !s.trim().is_empty() => ModelConstraint::only(s.split('|').map(str::trim)),
            _ => ModelConstraint::any(),
        };
        out.push(Task {
            cpu_milli: csv.number(*line, row, cpu, "cpu_milli")?,
            memory_mib: csv.number(*line, row, mem, "memory_mib")?,
            gpus,
            models,
        });
    }
    Ok(out)
}
