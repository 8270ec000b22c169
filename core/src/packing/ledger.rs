//! The ledger: every node's GPUs, what is free on each, and which pod holds what.
//!
//! All arithmetic is in integers: CPU in milli-cores, memory in MiB, GPU compute in
//! milli-GPU, GPU memory in MiB, device-plugin slices in 0.1-GPU units. A commit is
//! checked GPU by GPU, so no sequence of commits and releases can over-assign a GPU.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::inventory::NodeInventory;
use crate::resources::{GpuDemand, MILLI_PER_GPU, ModelConstraint, SLICES_PER_GPU};
use crate::topology::{LinkClass, NodeTopology, TopologyRequirement};

/// One physical GPU as the device plugin publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSpec {
    /// NVML UUID (`GPU-…`).
    pub uuid: String,
    /// Model name as used in model constraints (`A100-80GB`, `T4`, …).
    pub model: String,
    /// Total memory, MiB.
    pub memory_mib: u64,
}

/// A node's capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    /// Node name.
    pub name: String,
    /// Allocatable CPU, milli-cores.
    pub cpu_milli: u64,
    /// Allocatable memory, MiB.
    pub memory_mib: u64,
    /// GPUs, by device index.
    pub gpus: Vec<GpuSpec>,
    /// How the GPUs are connected, keyed by their index in `gpus` (not NVML's index);
    /// empty when unknown, and then placement is topology-blind (ADR 0021).
    pub topology: NodeTopology,
    /// Device-plugin slices (device IDs) per GPU: [`SLICES_PER_GPU`] (10) by default, up
    /// to 100 on a node configured for fine sharing (ADR 0023). Every container holds at
    /// least one on each of its GPUs, so this is the most containers a GPU takes.
    pub slices_per_gpu: u32,
}

impl NodeSpec {
    /// A node as its device plugin's GPU inventory describes it: each GPU's UUID, model
    /// and memory by position, its topology and its slices per GPU; no CPU or memory of
    /// the node (0). The one reading of an inventory into a node of the ledger.
    pub fn from_inventory(name: String, inventory: &NodeInventory) -> NodeSpec {
        NodeSpec {
            topology: NodeTopology::by_position(inventory),
            name,
            cpu_milli: 0,
            memory_mib: 0,
            gpus: inventory
                .gpus
                .iter()
                .map(|g| GpuSpec {
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                })
                .collect(),
            slices_per_gpu: inventory.slices_per_gpu,
        }
    }
}

/// What is free on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GpuFree {
    /// Free compute, milli-GPU.
    pub milli: u32,
    /// Free memory, MiB.
    pub memory_mib: u64,
    /// Free device-plugin slices.
    pub slices: u32,
}

/// One container's share of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grant {
    /// GPU device index on the node.
    pub gpu: u16,
    /// Compute, milli-GPU.
    pub milli: u32,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Device-plugin slices.
    pub slices: u32,
}

/// A concrete decision: the node and, per GPU container of the task, its grants.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Placement {
    /// Node index in the ledger.
    pub node: usize,
    /// Per container (same order as [`Task::gpus`]), one grant per GPU.
    pub containers: Vec<Vec<Grant>>,
}

/// What a task (a pod) needs: CPU and memory of the node, GPU demands per container,
/// and the GPU models it may use.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Task {
    /// CPU request, milli-cores.
    pub cpu_milli: u64,
    /// Memory request, MiB.
    pub memory_mib: u64,
    /// One demand per GPU-using container (empty for a CPU-only task).
    pub gpus: Vec<GpuDemand>,
    /// GPU model constraint.
    pub models: ModelConstraint,
}

impl Task {
    /// Total milli-GPU of compute the task takes.
    pub fn total_gpu_milli(&self) -> u64 {
        self.gpus.iter().map(GpuDemand::total_milli).sum()
    }

    /// The single demand when the task is one container on one GPU with a fraction of it
    /// (the case where policies choose among GPUs).
    pub fn single_share(&self) -> Option<&GpuDemand> {
        match self.gpus.as_slice() {
            [d] if d.count == 1 && !d.is_whole() => Some(d),
            _ => None,
        }
    }
}

/// Why a node cannot take a task: one precise, human-readable reason.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reject {
    /// Not enough CPU left.
    Cpu {
        /// Free milli-cores.
        free: u64,
        /// Requested milli-cores.
        need: u64,
    },
    /// Not enough memory left.
    Memory {
        /// Free MiB.
        free: u64,
        /// Requested MiB.
        need: u64,
    },
    /// No GPU of an allowed model.
    Model {
        /// Models present on the node.
        node_models: Vec<String>,
        /// The constraint, in words.
        constraint: String,
    },
    /// Too few GPUs of the allowed models at all.
    GpuCount {
        /// GPUs of allowed models on the node.
        have: usize,
        /// GPUs needed.
        need: u32,
    },
    /// Too few fully free GPUs for whole-GPU demands.
    WholeGpus {
        /// Fully free GPUs.
        free: usize,
        /// Needed.
        need: u32,
    },
    /// No GPU with enough free compute.
    GpuCompute {
        /// Largest free compute on one GPU, milli-GPU.
        max_free: u32,
        /// Needed per GPU.
        need: u32,
        /// GPUs needed with that much.
        count: u32,
    },
    /// No GPU with enough free memory.
    GpuMemory {
        /// Largest free memory on one GPU that has the compute, MiB.
        max_free: u64,
        /// Needed per GPU, MiB (on the largest GPU).
        need: u64,
    },
    /// No GPU with enough free device-plugin slices (each container holds at least one:
    /// at most 10 tenants per GPU, 100 on a node configured for fine sharing).
    GpuSlices {
        /// Largest number of free slices on one GPU.
        max_free: u32,
        /// Needed per GPU.
        need: u32,
        /// Slices each GPU of the node has ([`NodeSpec::slices_per_gpu`]).
        per_gpu: u32,
    },
    /// The best set of GPUs a multi-GPU container can get here is worse than the pod's
    /// `vgpu.io/gpu-topology` requirement.
    Topology {
        /// GPUs in the container's set.
        count: u32,
        /// The class the pod requires.
        need: LinkClass,
        /// The class of the best set this node can give now (`ever`), or at all.
        best: LinkClass,
        /// Whether the node could give it with all its GPUs free (freeing GPUs, e.g.
        /// by preemption, may help); false: never on this node.
        ever: bool,
    },
    /// The node is not in the ledger.
    UnknownNode(String),
}

fn gib(mib: u64) -> String {
    let g = mib as f64 / 1024.0;
    if mib.is_multiple_of(1024) {
        format!("{} GiB", mib / 1024)
    } else if g >= 1.0 {
        format!("{g:.1} GiB")
    } else {
        format!("{mib} MiB")
    }
}

fn cores(milli: u64) -> String {
    if milli.is_multiple_of(1000) {
        format!("{} cores", milli / 1000)
    } else {
        format!("{:.3} cores", milli as f64 / 1000.0)
    }
}

fn gpus(milli: u32) -> String {
    format!("{:.3} GPU", f64::from(milli) / 1000.0)
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reject::Cpu { free, need } => {
                write!(f, "CPU: free {} < {}", cores(*free), cores(*need))
            }
            Reject::Memory { free, need } => {
                write!(f, "memory: free {} < {}", gib(*free), gib(*need))
            }
            Reject::Model {
                node_models,
                constraint,
            } => write!(
                f,
                "GPU model: node has {} but the pod needs {constraint}",
                if node_models.is_empty() {
                    "no GPU".to_owned()
                } else {
                    node_models.join(", ")
                }
            ),
            Reject::GpuCount { have, need } => {
                write!(f, "GPU count: {have} GPUs of an allowed model < {need}")
            }
            Reject::WholeGpus { free, need } => {
                write!(f, "whole GPUs: {free} fully free < {need}")
            }
            Reject::GpuCompute {
                max_free,
                need,
                count,
            } => {
                if *count > 1 {
                    write!(
                        f,
                        "GPU compute: fewer than {count} GPUs with {} free (max free {})",
                        gpus(*need),
                        gpus(*max_free)
                    )
                } else {
                    write!(
                        f,
                        "GPU compute: max free {} < {}",
                        gpus(*max_free),
                        gpus(*need)
                    )
                }
            }
            Reject::GpuMemory { max_free, need } => {
                write!(
                    f,
                    "GPU memory: max free {} < {}",
                    gib(*max_free),
                    gib(*need)
                )
            }
            Reject::GpuSlices {
                max_free,
                need,
                per_gpu,
            } => {
                write!(
                    f,
                    "GPU slices: max free {max_free} < {need} (each container holds at least one; {per_gpu} per GPU on this node)"
                )
            }
            Reject::Topology {
                count,
                need,
                best,
                ever,
            } => write!(
                f,
                "GPU topology: the best {count} GPUs {} are connected at {best}, the pod requires {need} (vgpu.io/gpu-topology)",
                if *ever { "free here" } else { "of this node" }
            ),
            Reject::UnknownNode(n) => write!(f, "node {n:?} is not in the ledger"),
        }
    }
}

/// Why a commit or release was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The pod already holds resources.
    #[error("pod {0:?} is already placed")]
    AlreadyPlaced(String),
    /// The pod holds nothing.
    #[error("pod {0:?} is not placed")]
    NotPlaced(String),
    /// The placement does not fit the node any more.
    #[error("pod {pod:?} does not fit node {node:?}: {reason}")]
    DoesNotFit {
        /// Pod key.
        pod: String,
        /// Node name.
        node: String,
        /// Why.
        reason: String,
    },
    /// A node with this name exists already.
    #[error("node {0:?} is already in the ledger")]
    DuplicateNode(String),
    /// A relabel that would change more than GPU models.
    #[error("cannot relabel GPUs in place: {0}")]
    Relabel(String),
}

/// One node's live state.
#[derive(Debug, Clone)]
pub struct NodeState {
    /// Capacity.
    pub spec: NodeSpec,
    /// Free CPU, milli-cores.
    pub cpu_free: u64,
    /// Free memory, MiB.
    pub memory_free: u64,
    /// Free resources per GPU, by device index.
    pub gpus: Vec<GpuFree>,
    /// Bumped on every change, so that callers can cache per-node results.
    pub generation: u64,
    pods: BTreeMap<String, Placement>,
}

impl NodeState {
    fn new(spec: NodeSpec) -> Self {
        let gpus = spec
            .gpus
            .iter()
            .map(|g| GpuFree {
                milli: MILLI_PER_GPU,
                memory_mib: g.memory_mib,
                slices: spec.slices_per_gpu,
            })
            .collect();
        NodeState {
            cpu_free: spec.cpu_milli,
            memory_free: spec.memory_mib,
            gpus,
            generation: 0,
            pods: BTreeMap::new(),
            spec,
        }
    }

    /// Whether GPU `i` is entirely free.
    pub fn gpu_fully_free(&self, i: usize) -> bool {
        let g = &self.gpus[i];
        g.milli == MILLI_PER_GPU
            && g.memory_mib == self.spec.gpus[i].memory_mib
            && g.slices == self.spec.slices_per_gpu
    }

    /// Number of fully free GPUs.
    pub fn fully_free_count(&self) -> usize {
        (0..self.gpus.len())
            .filter(|&i| self.gpu_fully_free(i))
            .count()
    }

    /// Total free milli-GPU on the node.
    pub fn gpu_milli_free(&self) -> u64 {
        self.gpus.iter().map(|g| u64::from(g.milli)).sum()
    }

    /// Pods placed here, with their placements.
    pub fn pods(&self) -> impl Iterator<Item = (&str, &Placement)> {
        self.pods.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Whether `demand` fits on GPU `i` as a share (not whole).
    pub fn share_fits(&self, i: usize, demand: &GpuDemand) -> bool {
        let g = &self.gpus[i];
        g.milli >= demand.compute_milli
            && g.memory_mib >= demand.memory.resolve(self.spec.gpus[i].memory_mib)
            && g.slices >= demand.slices
    }

    /// Checks CPU, memory and the model constraint only (the cheap part of a fit).
    pub fn check_host(&self, task: &Task) -> Result<(), Reject> {
        if self.cpu_free < task.cpu_milli {
            return Err(Reject::Cpu {
                free: self.cpu_free,
                need: task.cpu_milli,
            });
        }
        if self.memory_free < task.memory_mib {
            return Err(Reject::Memory {
                free: self.memory_free,
                need: task.memory_mib,
            });
        }
        if !task.gpus.is_empty()
            && !task.models.is_any()
            && !self.spec.gpus.iter().any(|g| task.models.allows(&g.model))
        {
            let mut models: Vec<String> = self.spec.gpus.iter().map(|g| g.model.clone()).collect();
            models.dedup();
            return Err(Reject::Model {
                node_models: models,
                constraint: task.models.to_string(),
            });
        }
        Ok(())
    }

    /// Places the task's GPU demands on a scratch copy of the free list: whole GPUs on the
    /// lowest-numbered fully free ones, shares on the tightest-fitting GPU (least free
    /// compute that fits, then lowest index). `pick` overrides the GPU of the first share
    /// of a single-share task (policies that choose among GPUs).
    pub fn plan(&self, task: &Task, pick: Option<usize>) -> Result<Vec<Vec<Grant>>, Reject> {
        let mut free = self.gpus.clone();
        let mut out = Vec::with_capacity(task.gpus.len());
        let allowed: Vec<bool> = self
            .spec
            .gpus
            .iter()
            .map(|g| task.models.allows(&g.model))
            .collect();
        for demand in &task.gpus {
            let have = allowed.iter().filter(|a| **a).count();
            if have < demand.count as usize {
                return Err(Reject::GpuCount {
                    have,
                    need: demand.count,
                });
            }
            let mut grants = Vec::with_capacity(demand.count as usize);
            if demand.is_whole() {
                let fully_free = |i: usize, g: &GpuFree| {
                    allowed[i]
                        && g.milli == MILLI_PER_GPU
                        && g.memory_mib == self.spec.gpus[i].memory_mib
                        && g.slices == self.spec.slices_per_gpu
                };
                // With a known topology, the best-connected set of fully free GPUs
                // (one GPU: the one whose loss breaks the least); else the lowest-numbered.
                let chosen = self.topology_set(&free, demand.count, fully_free);
                for (i, g) in free.iter_mut().enumerate() {
                    if grants.len() == demand.count as usize {
                        break;
                    }
                    let cap = &self.spec.gpus[i];
                    if chosen.as_ref().map_or(fully_free(i, g), |c| c.contains(&i)) {
                        grants.push(Grant {
                            gpu: u16::try_from(i).expect("fewer than 65536 GPUs per node"),
                            milli: MILLI_PER_GPU,
                            memory_mib: cap.memory_mib,
                            slices: demand.slices.min(SLICES_PER_GPU),
                        });
                        *g = GpuFree {
                            milli: 0,
                            memory_mib: 0,
                            slices: self.spec.slices_per_gpu - demand.slices.min(SLICES_PER_GPU),
                        };
                    }
                }
                if grants.len() < demand.count as usize {
                    return Err(Reject::WholeGpus {
                        free: grants.len(),
                        need: demand.count,
                    });
                }
            } else {
                let fits = |i: usize, g: &GpuFree| {
                    allowed[i]
                        && g.milli >= demand.compute_milli
                        && g.memory_mib >= demand.memory.resolve(self.spec.gpus[i].memory_mib)
                        && g.slices >= demand.slices
                };
                let mut used = vec![false; free.len()];
                // Several GPUs with a known topology: the best-connected set of those
                // the share fits on; else the tightest fit, GPU by GPU.
                let set = if demand.count >= 2 {
                    self.topology_set(&free, demand.count, fits)
                } else {
                    None
                };
                for k in 0..demand.count {
                    let chosen = match pick {
                        _ if set.is_some() => set.as_ref().and_then(|s| s.get(k as usize)).copied(),
                        Some(p) if k == 0 && task.gpus.len() == 1 && demand.count == 1 => {
                            (p < free.len() && fits(p, &free[p])).then_some(p)
                        }
                        _ => free
                            .iter()
                            .enumerate()
                            .filter(|(i, g)| !used[*i] && fits(*i, g))
                            .min_by_key(|(i, g)| (g.milli, *i))
                            .map(|(i, _)| i),
                    };
                    let Some(i) = chosen else {
                        return Err(share_reject(self, &free, &allowed, demand));
                    };
                    used[i] = true;
                    let mem = demand.memory.resolve(self.spec.gpus[i].memory_mib);
                    let g = &mut free[i];
                    g.milli -= demand.compute_milli;
                    g.memory_mib -= mem;
                    g.slices -= demand.slices;
                    grants.push(Grant {
                        gpu: u16::try_from(i).expect("fewer than 65536 GPUs per node"),
                        milli: demand.compute_milli,
                        memory_mib: mem,
                        slices: demand.slices,
                    });
                }
            }
            out.push(grants);
        }
        Ok(out)
    }

    /// The GPUs (indices into `gpus`) a demand of `count` takes among those `eligible`,
    /// when the node's topology is known: [`NodeTopology::best_set`]. `None` when the
    /// topology is unknown (the caller's topology-blind rule applies) or too few are
    /// eligible (the caller reports why).
    fn topology_set(
        &self,
        free: &[GpuFree],
        count: u32,
        eligible: impl Fn(usize, &GpuFree) -> bool,
    ) -> Option<Vec<usize>> {
        if !self.spec.topology.is_known() {
            return None;
        }
        let cands: Vec<u32> = (0..free.len())
            .filter(|&i| eligible(i, &free[i]))
            .filter_map(|i| u32::try_from(i).ok())
            .collect();
        let set = self.spec.topology.best_set(&cands, &[], count as usize)?;
        Some(set.into_iter().map(|i| i as usize).collect())
    }

    /// Checks a plan's multi-GPU containers against a pod's topology requirement: each
    /// container with two or more GPUs must have a set at least as good as `need`
    /// ([`TopologyRequirement::accepts`]). The plan already holds the best set each
    /// container can get (see [`NodeState::plan`]), so a refusal means that no set on
    /// this node, as it is now, meets the requirement.
    pub fn check_topology(
        &self,
        containers: &[Vec<Grant>],
        need: TopologyRequirement,
    ) -> Result<(), Reject> {
        let TopologyRequirement::AtLeast(class) = need else {
            return Ok(());
        };
        for grants in containers {
            if grants.len() < 2 {
                continue;
            }
            let set: Vec<u32> = grants.iter().map(|g| u32::from(g.gpu)).collect();
            let best = self
                .spec
                .topology
                .set_class(&set)
                .unwrap_or(LinkClass::System);
            if !need.accepts(best) {
                let all: Vec<u32> = (0..self.spec.gpus.len())
                    .filter_map(|i| u32::try_from(i).ok())
                    .collect();
                let empty = self
                    .spec
                    .topology
                    .best_class(&all, grants.len())
                    .unwrap_or(LinkClass::System);
                let ever = need.accepts(empty);
                return Err(Reject::Topology {
                    count: u32::try_from(grants.len()).unwrap_or(u32::MAX),
                    need: class,
                    best: if ever { best } else { empty },
                    ever,
                });
            }
        }
        Ok(())
    }

    /// Full fit check: host resources, model, then a GPU plan.
    pub fn fit(&self, task: &Task) -> Result<Vec<Vec<Grant>>, Reject> {
        self.check_host(task)?;
        self.plan(task, None)
    }

    fn apply(&mut self, placement: &Placement, sign: i8) {
        for grants in &placement.containers {
            for g in grants {
                let f = &mut self.gpus[usize::from(g.gpu)];
                if sign > 0 {
                    f.milli -= g.milli;
                    f.memory_mib -= g.memory_mib;
                    f.slices -= g.slices;
                } else {
                    f.milli += g.milli;
                    f.memory_mib += g.memory_mib;
                    f.slices += g.slices;
                }
            }
        }
        self.generation += 1;
    }
}

fn share_reject(node: &NodeState, free: &[GpuFree], allowed: &[bool], d: &GpuDemand) -> Reject {
    let max_milli = free
        .iter()
        .zip(allowed)
        .filter(|(_, a)| **a)
        .map(|(g, _)| g.milli)
        .max()
        .unwrap_or(0);
    let with_compute: Vec<usize> = (0..free.len())
        .filter(|&i| allowed[i] && free[i].milli >= d.compute_milli)
        .collect();
    if (with_compute.len() as u32) < d.count {
        return Reject::GpuCompute {
            max_free: max_milli,
            need: d.compute_milli,
            count: d.count,
        };
    }
    let with_memory: Vec<usize> = with_compute
        .iter()
        .copied()
        .filter(|&i| free[i].memory_mib >= d.memory.resolve(node.spec.gpus[i].memory_mib))
        .collect();
    if (with_memory.len() as u32) < d.count {
        let (max_free, need) = with_compute
            .iter()
            .map(|&i| {
                (
                    free[i].memory_mib,
                    d.memory.resolve(node.spec.gpus[i].memory_mib),
                )
            })
            .max()
            .unwrap_or((0, 0));
        return Reject::GpuMemory { max_free, need };
    }
    Reject::GpuSlices {
        max_free: with_memory
            .iter()
            .map(|&i| free[i].slices)
            .max()
            .unwrap_or(0),
        need: d.slices,
        per_gpu: node.spec.slices_per_gpu,
    }
}

/// Every node's GPUs and every placed pod.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    nodes: Vec<NodeState>,
    by_name: HashMap<String, usize>,
    pods: HashMap<String, usize>,
    host: HashMap<String, (u64, u64)>,
    /// Number of GPUs by free milli-GPU (index 0..=1000).
    free_hist: Vec<u32>,
    /// Number of nodes by their count of fully free GPUs.
    whole_hist: Vec<u32>,
    /// The same per node size: `whole_by_size[g][k]` nodes of `g` GPUs have exactly `k`
    /// fully free.
    whole_by_size: Vec<Vec<u32>>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// A ledger over the given nodes.
    pub fn with_nodes(nodes: impl IntoIterator<Item = NodeSpec>) -> Result<Self, LedgerError> {
        let mut l = Ledger::new();
        for n in nodes {
            l.add_node(n)?;
        }
        Ok(l)
    }

    /// Adds a node with nothing assigned; returns its index.
    pub fn add_node(&mut self, spec: NodeSpec) -> Result<usize, LedgerError> {
        if self.by_name.contains_key(&spec.name) {
            return Err(LedgerError::DuplicateNode(spec.name));
        }
        let i = self.nodes.len();
        self.by_name.insert(spec.name.clone(), i);
        if self.free_hist.is_empty() {
            self.free_hist = vec![0; MILLI_PER_GPU as usize + 1];
        }
        self.free_hist[MILLI_PER_GPU as usize] +=
            u32::try_from(spec.gpus.len()).expect("GPU count fits u32");
        if self.whole_hist.len() <= spec.gpus.len() {
            self.whole_hist.resize(spec.gpus.len() + 1, 0);
        }
        self.whole_hist[spec.gpus.len()] += 1;
        let g = spec.gpus.len();
        if self.whole_by_size.len() <= g {
            self.whole_by_size.resize(g + 1, Vec::new());
        }
        let row = &mut self.whole_by_size[g];
        if row.is_empty() {
            *row = vec![0; g + 1];
        }
        row[g] += 1;
        self.nodes.push(NodeState::new(spec));
        Ok(i)
    }

    /// Number of GPUs in the cluster by free milli-GPU: `hist[m]` GPUs have exactly `m`
    /// milli free (0..=1000).
    pub fn free_histogram(&self) -> &[u32] {
        &self.free_hist
    }

    fn hist_update(hist: &mut [u32], node: &NodeState, placement: &Placement, add: bool) {
        for grants in &placement.containers {
            for g in grants {
                let m = node.gpus[usize::from(g.gpu)].milli.min(MILLI_PER_GPU) as usize;
                if add {
                    hist[m] += 1;
                } else {
                    hist[m] = hist[m].saturating_sub(1);
                }
            }
        }
    }

    /// Number of nodes by their count of fully free GPUs: `hist[k]` nodes have exactly `k`.
    pub fn whole_histogram(&self) -> &[u32] {
        &self.whole_hist
    }

    /// Number of nodes of `gpus` GPUs by their count of fully free GPUs: `hist[k]` nodes
    /// of that size have exactly `k` (empty when there is no such node).
    pub fn whole_histogram_of_size(&self, gpus: usize) -> &[u32] {
        self.whole_by_size.get(gpus).map_or(&[], Vec::as_slice)
    }

    fn whole_update(hist: &mut [u32], by_size: &mut [Vec<u32>], node: &NodeState, add: bool) {
        let k = node.fully_free_count();
        let row = by_size
            .get_mut(node.gpus.len())
            .map_or(&mut [][..], Vec::as_mut_slice);
        for h in [hist.get_mut(k), row.get_mut(k)].into_iter().flatten() {
            if add {
                *h += 1;
            } else {
                *h = h.saturating_sub(1);
            }
        }
    }

    /// All nodes, by index.
    pub fn nodes(&self) -> &[NodeState] {
        &self.nodes
    }

    /// One node.
    pub fn node(&self, i: usize) -> &NodeState {
        &self.nodes[i]
    }

    /// A node's index by name.
    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Renames the models of node `n`'s GPUs in place (the extender marks a GPU's health
    /// in its model name), keeping every placement: only the models of new placements
    /// are checked against them. Refused, naming the difference, unless `spec` equals
    /// the node's spec but for GPU models. Bumps the node's generation.
    pub fn relabel_gpus(&mut self, n: usize, spec: &NodeSpec) -> Result<(), LedgerError> {
        let node = self
            .nodes
            .get_mut(n)
            .ok_or_else(|| LedgerError::Relabel(format!("no node #{n}")))?;
        let old = &node.spec;
        let why = if old.name != spec.name {
            Some(format!("name {:?} is not {:?}", spec.name, old.name))
        } else if old.cpu_milli != spec.cpu_milli || old.memory_mib != spec.memory_mib {
            Some(format!("node {:?}: CPU or memory changed", old.name))
        } else if old.gpus.len() != spec.gpus.len() {
            Some(format!(
                "node {:?}: {} GPUs, not {}",
                old.name,
                spec.gpus.len(),
                old.gpus.len()
            ))
        } else if old.topology != spec.topology {
            Some(format!("node {:?}: GPU topology changed", old.name))
        } else {
            old.gpus
                .iter()
                .zip(&spec.gpus)
                .enumerate()
                .find(|(_, (a, b))| a.uuid != b.uuid || a.memory_mib != b.memory_mib)
                .map(|(i, (a, b))| {
                    format!(
                        "node {:?} GPU {i}: {} ({} MiB) is not {} ({} MiB)",
                        old.name, b.uuid, b.memory_mib, a.uuid, a.memory_mib
                    )
                })
        };
        if let Some(why) = why {
            return Err(LedgerError::Relabel(why));
        }
        for (g, new) in node.spec.gpus.iter_mut().zip(&spec.gpus) {
            g.model.clone_from(&new.model);
        }
        node.generation += 1;
        Ok(())
    }

    /// Where a pod is placed.
    pub fn placement(&self, pod: &str) -> Option<&Placement> {
        let n = *self.pods.get(pod)?;
        self.nodes[n].pods.get(pod)
    }

    /// Number of placed pods.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// Records a placement after checking, GPU by GPU, that it still fits.
    pub fn commit(
        &mut self,
        pod: &str,
        task: &Task,
        placement: Placement,
    ) -> Result<(), LedgerError> {
        if self.pods.contains_key(pod) {
            return Err(LedgerError::AlreadyPlaced(pod.to_owned()));
        }
        let node = self
            .nodes
            .get_mut(placement.node)
            .ok_or_else(|| LedgerError::DoesNotFit {
                pod: pod.to_owned(),
                node: format!("#{}", placement.node),
                reason: "no such node".into(),
            })?;
        let fail = |reason: String| LedgerError::DoesNotFit {
            pod: pod.to_owned(),
            node: node.spec.name.clone(),
            reason,
        };
        node.check_host(task).map_err(|r| fail(r.to_string()))?;
        if placement.containers.len() != task.gpus.len() {
            return Err(fail(
                "placement does not match the task's containers".into(),
            ));
        }
        let mut free = node.gpus.clone();
        for (grants, demand) in placement.containers.iter().zip(&task.gpus) {
            if grants.len() != demand.count as usize {
                return Err(fail(format!(
                    "{} grants for {} GPUs",
                    grants.len(),
                    demand.count
                )));
            }
            let mut seen = Vec::with_capacity(grants.len());
            for g in grants {
                let i = usize::from(g.gpu);
                let Some(cap) = node.spec.gpus.get(i) else {
                    return Err(fail(format!("no GPU {i}")));
                };
                if seen.contains(&i) {
                    return Err(fail(format!("GPU {i} granted twice to one container")));
                }
                seen.push(i);
                if !task.models.allows(&cap.model) {
                    return Err(fail(format!(
                        "GPU {i} is a {} ({})",
                        cap.model, task.models
                    )));
                }
                let f = &mut free[i];
                let whole = demand.is_whole();
                if whole && (f.milli != MILLI_PER_GPU || f.memory_mib != cap.memory_mib) {
                    return Err(fail(format!("GPU {i} is not fully free")));
                }
                if g.milli < demand.compute_milli.min(MILLI_PER_GPU)
                    || g.memory_mib < demand.memory.resolve(cap.memory_mib)
                {
                    return Err(fail(format!("grant on GPU {i} is smaller than the demand")));
                }
                if f.milli < g.milli || f.memory_mib < g.memory_mib || f.slices < g.slices {
                    return Err(fail(format!(
                        "GPU {i}: free {} milli / {} MiB / {} slices < granted {} / {} / {}",
                        f.milli, f.memory_mib, f.slices, g.milli, g.memory_mib, g.slices
                    )));
                }
                f.milli -= g.milli;
                f.memory_mib -= g.memory_mib;
                f.slices -= g.slices;
            }
        }
        node.cpu_free -= task.cpu_milli;
        node.memory_free -= task.memory_mib;
        Self::hist_update(&mut self.free_hist, node, &placement, false);
        Self::whole_update(&mut self.whole_hist, &mut self.whole_by_size, node, false);
        node.apply(&placement, 1);
        Self::hist_update(&mut self.free_hist, node, &placement, true);
        Self::whole_update(&mut self.whole_hist, &mut self.whole_by_size, node, true);
        debug_assert_eq!(node.gpus, free);
        let n = placement.node;
        node.pods.insert(pod.to_owned(), placement);
        self.pods.insert(pod.to_owned(), n);
        // Keep the task's host resources with the placement for release.
        self.host
            .insert(pod.to_owned(), (task.cpu_milli, task.memory_mib));
        Ok(())
    }

    /// Releases everything a pod holds; returns its placement.
    pub fn release(&mut self, pod: &str) -> Result<Placement, LedgerError> {
        let n = self
            .pods
            .remove(pod)
            .ok_or_else(|| LedgerError::NotPlaced(pod.to_owned()))?;
        let node = &mut self.nodes[n];
        let placement = node
            .pods
            .remove(pod)
            .expect("the pod index and the node's pod map agree");
        let (cpu, mem) = self.host.remove(pod).unwrap_or((0, 0));
        node.cpu_free += cpu;
        node.memory_free += mem;
        Self::hist_update(&mut self.free_hist, node, &placement, false);
        Self::whole_update(&mut self.whole_hist, &mut self.whole_by_size, node, false);
        node.apply(&placement, -1);
        Self::hist_update(&mut self.free_hist, node, &placement, true);
        Self::whole_update(&mut self.whole_hist, &mut self.whole_by_size, node, true);
        Ok(placement)
    }
}
