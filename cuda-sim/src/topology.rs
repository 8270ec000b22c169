//! The simulated node's topology: where each GPU sits on the PCIe tree (NUMA node, host
//! bridge, PCIe switches), its NVLinks (direct links to peers, or an NVSwitch fabric), and
//! the CPUs of each NUMA node. NVML's topology queries, the driver's peer-to-peer answers
//! and the cost of peer copies are all derived from it here, once.
//!
//! Read from the `[topology]` table of the simulator's configuration (or a preset, see
//! [`crate::presets`]); without one every GPU hangs off its own host bridge of NUMA node 0
//! and has no NVLink. The topology is written next to the node's state when the state is
//! created (`topology-v1.toml`, [`publish`]) and read back by every process ([`load`]), so
//! processes attaching to an existing node see the topology it was created with, as they
//! see its devices. How link classes map to NVML's levels: ADR 0019.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config_error::ConfigError;

/// The file holding a node's topology, in the state directory.
pub const TOPOLOGY_FILE: &str = "topology-v1.toml";
/// NVML's `NVML_NVLINK_MAX_LINKS`: links per GPU.
pub const MAX_NVLINKS: u32 = 18;
/// Most CPUs a NUMA node list may name (NVML's affinity masks are sized by the caller).
pub const MAX_CPUS: u32 = 4096;

/// NVML's `nvmlGpuTopologyLevel_t`: how far apart two GPUs are on the PCIe tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum PcieLevel {
    /// The same GPU (`NVML_TOPOLOGY_INTERNAL`, e.g. the two dies of a K80).
    Internal = 0,
    /// Under the same PCIe switch (`NVML_TOPOLOGY_SINGLE`; `nvidia-smi topo`: PIX).
    Single = 10,
    /// Under several switches, without crossing the host bridge (`MULTIPLE`; PXB).
    Multiple = 20,
    /// Through the same host bridge (`HOSTBRIDGE`; PHB).
    HostBridge = 30,
    /// Across host bridges within one NUMA node (`NODE`; NODE).
    Node = 40,
    /// Across NUMA nodes, over the CPUs' interconnect (`SYSTEM`; SYS).
    System = 50,
}

impl PcieLevel {
    /// Every level, nearest first.
    pub const ALL: [PcieLevel; 6] = [
        PcieLevel::Internal,
        PcieLevel::Single,
        PcieLevel::Multiple,
        PcieLevel::HostBridge,
        PcieLevel::Node,
        PcieLevel::System,
    ];

    /// The level with NVML value `v`.
    pub fn from_nvml(v: u32) -> Option<PcieLevel> {
        PcieLevel::ALL.into_iter().find(|l| *l as u32 == v)
    }

    /// The `nvidia-smi topo -m` label.
    pub fn label(self) -> &'static str {
        match self {
            PcieLevel::Internal => "X",
            PcieLevel::Single => "PIX",
            PcieLevel::Multiple => "PXB",
            PcieLevel::HostBridge => "PHB",
            PcieLevel::Node => "NODE",
            PcieLevel::System => "SYS",
        }
    }

    /// Share of the slower GPU's PCIe link bandwidth a peer copy gets at this level.
    /// Anchored on measured P2P writes over PCIe Gen5 x16 (about 54-56 GB/s of 63 GB/s
    /// within a socket, 39-51 GB/s across sockets: docs/cuda-sim.md, "Topology"); the
    /// steps between the in-socket levels are the model's, kept in the order NVIDIA's
    /// levels promise.
    pub fn pcie_share_permille(self) -> u64 {
        match self {
            PcieLevel::Internal => 1000,
            PcieLevel::Single => 880,
            PcieLevel::Multiple => 860,
            PcieLevel::HostBridge => 840,
            PcieLevel::Node => 800,
            PcieLevel::System => 650,
        }
    }
}

/// How two GPUs talk: a bonded set of NVLinks, or the PCIe tree at some level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkClass {
    /// The same GPU.
    SelfLink,
    /// `n` NVLinks (directly, or through the NVSwitch fabric).
    NvLink(u32),
    /// Only PCIe, at this level.
    Pcie(PcieLevel),
}

impl LinkClass {
    /// The `nvidia-smi topo -m` label: `X`, `NV#`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`.
    pub fn label(self) -> String {
        match self {
            LinkClass::SelfLink => "X".to_owned(),
            LinkClass::NvLink(n) => format!("NV{n}"),
            LinkClass::Pcie(l) => l.label().to_owned(),
        }
    }

    /// A rank, lower is better: NVLink first (more links better), then PCIe levels.
    pub fn rank(self) -> u32 {
        match self {
            LinkClass::SelfLink => 0,
            LinkClass::NvLink(n) => 1 + MAX_NVLINKS.saturating_sub(n),
            LinkClass::Pcie(l) => 100 + l as u32,
        }
    }
}

/// One NUMA node: its CPUs and the socket it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// Logical CPU numbers, ascending.
    pub cpus: Vec<u32>,
    /// The CPU package (socket) holding it.
    pub socket: u32,
}

/// Where one GPU sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPlace {
    /// Its NUMA node (index into [`Topology::numa`]).
    pub numa: u32,
    /// Its PCIe host bridge (root complex); GPUs sharing one are at most PHB apart.
    pub host_bridge: u32,
    /// The PCIe switches above it, from the host bridge down; GPUs sharing the last one
    /// are PIX, sharing an earlier one PXB.
    pub switches: Vec<u32>,
    /// Direct NVLinks: the peer GPU of each link, by link number.
    pub nvlinks: Vec<u32>,
    /// Its PCIe link bandwidth, GB/s per direction.
    pub pcie_gbps: u32,
}

/// The node's topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// NUMA nodes.
    pub numa: Vec<NumaNode>,
    /// One entry per GPU, in device index order.
    pub gpus: Vec<GpuPlace>,
    /// NVLink generation (3: A100, 4: H100); 0 without NVLink.
    pub nvlink_version: u32,
    /// Bandwidth of one NVLink, GB/s per direction.
    pub nvlink_gbps: u32,
    /// With an NVSwitch fabric: links from each GPU into it (0: no fabric).
    pub nvswitch_links: u32,
    /// NVSwitch chips of the fabric (link `l` of every GPU goes to chip `l % nvswitches`).
    pub nvswitches: u32,
}

/// The `[topology]` table as written in the configuration and in the state directory.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTopology {
    #[serde(skip_serializing_if = "Option::is_none")]
    nvlink_version: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nvlink_gbps: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nvswitch_links: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nvswitches: Option<u32>,
    #[serde(default)]
    numa: Vec<RawNuma>,
    #[serde(default)]
    gpu: Vec<RawGpu>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawNuma {
    cpus: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    socket: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    #[serde(skip_serializing_if = "Option::is_none")]
    numa: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    host_bridge: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    switches: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    nvlinks: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pcie_gbps: Option<u32>,
}

/// Default PCIe bandwidth of a GPU without one configured: Gen5 x16, GB/s per direction.
pub const DEFAULT_PCIE_GBPS: u32 = 64;
/// Default bandwidth of one NVLink (NVLink 3 and 4 alike), GB/s per direction.
pub const DEFAULT_NVLINK_GBPS: u32 = 25;

/// Parses a Linux CPU list (`0-55,112-167`).
pub fn parse_cpu_list(s: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?),
            None => {
                let v = part.parse::<u32>().ok()?;
                (v, v)
            }
        };
        if a > b || b >= MAX_CPUS {
            return None;
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    (!out.is_empty()).then_some(out)
}

/// Formats CPUs as a Linux CPU list (`0-55,112-167`), as `nvidia-smi topo -m` prints them.
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

/// CPUs of the machine the simulator runs on (for the default topology's one NUMA node).
fn host_cpus() -> Vec<u32> {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_cpu_list(&s))
        .unwrap_or_else(|| {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            (0..u32::try_from(n).unwrap_or(1)).collect()
        })
}

impl Topology {
    /// The default: one NUMA node with the host's CPUs, each GPU on its own host bridge,
    /// no PCIe switch, no NVLink (every pair of GPUs is NODE apart).
    pub fn default_for(devices: usize) -> Topology {
        Topology {
            numa: vec![NumaNode {
                cpus: host_cpus(),
                socket: 0,
            }],
            gpus: (0..devices)
                .map(|i| GpuPlace {
                    numa: 0,
                    host_bridge: u32::try_from(i).expect("few devices"),
                    switches: Vec::new(),
                    nvlinks: Vec::new(),
                    pcie_gbps: DEFAULT_PCIE_GBPS,
                })
                .collect(),
            nvlink_version: 0,
            nvlink_gbps: DEFAULT_NVLINK_GBPS,
            nvswitch_links: 0,
            nvswitches: 0,
        }
    }

    /// Validates a `[topology]` table for `devices` GPUs; `path` names the file in errors.
    pub fn from_raw(raw: RawTopology, devices: usize, path: &str) -> Result<Topology, ConfigError> {
        let bad = |field: String, value: String, why: &str| ConfigError::Value {
            path: path.to_owned(),
            field,
            value,
            why: why.to_owned(),
        };
        let mut t = Topology::default_for(devices);
        if !raw.numa.is_empty() {
            t.numa.clear();
            for (i, n) in raw.numa.iter().enumerate() {
                let cpus = parse_cpu_list(&n.cpus).ok_or_else(|| {
                    bad(
                        format!("topology.numa[{i}].cpus"),
                        n.cpus.clone(),
                        "expected a CPU list such as 0-55,112-167",
                    )
                })?;
                for (j, other) in t.numa.iter().enumerate() {
                    if let Some(c) = cpus.iter().find(|c| other.cpus.contains(c)) {
                        return Err(bad(
                            format!("topology.numa[{i}].cpus"),
                            n.cpus.clone(),
                            &format!("CPU {c} is also in topology.numa[{j}]"),
                        ));
                    }
                }
                let socket = n.socket.unwrap_or(u32::try_from(i).expect("few nodes"));
                t.numa.push(NumaNode { cpus, socket });
            }
        }
        if !raw.gpu.is_empty() && raw.gpu.len() != devices {
            return Err(bad(
                "topology.gpu".into(),
                raw.gpu.len().to_string(),
                &format!("needs one entry per device ({devices})"),
            ));
        }
        let numa_count = t.numa.len();
        for (i, g) in raw.gpu.iter().enumerate() {
            let key = |k: &str| format!("topology.gpu[{i}].{k}");
            let place = &mut t.gpus[i];
            if let Some(n) = g.numa {
                if n as usize >= numa_count {
                    return Err(bad(key("numa"), n.to_string(), "no such NUMA node"));
                }
                place.numa = n;
            }
            if let Some(h) = g.host_bridge {
                place.host_bridge = h;
            }
            place.switches.clone_from(&g.switches);
            if let Some(p) = g.pcie_gbps {
                if p == 0 {
                    return Err(bad(key("pcie_gbps"), "0".into(), "must be positive"));
                }
                place.pcie_gbps = p;
            }
            if g.nvlinks.len() > MAX_NVLINKS as usize {
                return Err(bad(
                    key("nvlinks"),
                    g.nvlinks.len().to_string(),
                    &format!("at most {MAX_NVLINKS} links"),
                ));
            }
            for &p in &g.nvlinks {
                if p as usize >= devices || p as usize == i {
                    return Err(bad(
                        key("nvlinks"),
                        p.to_string(),
                        "a link's peer must be another device's index",
                    ));
                }
            }
            place.nvlinks.clone_from(&g.nvlinks);
        }
        t.nvlink_version = raw.nvlink_version.unwrap_or(0);
        t.nvlink_gbps = raw.nvlink_gbps.unwrap_or(DEFAULT_NVLINK_GBPS);
        t.nvswitch_links = raw.nvswitch_links.unwrap_or(0);
        t.nvswitches = raw.nvswitches.unwrap_or(u32::from(t.nvswitch_links > 0));
        if t.nvswitch_links > MAX_NVLINKS {
            return Err(bad(
                "topology.nvswitch_links".into(),
                t.nvswitch_links.to_string(),
                &format!("at most {MAX_NVLINKS}"),
            ));
        }
        if t.nvswitch_links > 0 && t.nvswitches == 0 {
            return Err(bad(
                "topology.nvswitches".into(),
                "0".into(),
                "a fabric needs at least one NVSwitch",
            ));
        }
        let has_links = t.nvswitch_links > 0 || t.gpus.iter().any(|g| !g.nvlinks.is_empty());
        if has_links && !(1..=5).contains(&t.nvlink_version) {
            return Err(bad(
                "topology.nvlink_version".into(),
                t.nvlink_version.to_string(),
                "NVLinks need a version from 1 to 5",
            ));
        }
        if t.nvlink_gbps == 0 {
            return Err(bad(
                "topology.nvlink_gbps".into(),
                "0".into(),
                "must be positive",
            ));
        }
        if t.nvswitch_links > 0 && t.gpus.iter().any(|g| !g.nvlinks.is_empty()) {
            return Err(bad(
                "topology.nvswitch_links".into(),
                t.nvswitch_links.to_string(),
                "a GPU's links go either to peers (gpu[].nvlinks) or into the fabric, not both",
            ));
        }
        // Direct links are symmetric: as many links a→b as b→a.
        for a in 0..devices {
            for b in 0..devices {
                let ab = t.direct_links(a, b);
                let ba = t.direct_links(b, a);
                if ab != ba {
                    return Err(bad(
                        format!("topology.gpu[{a}].nvlinks"),
                        format!("{ab} links to {b}"),
                        &format!("gpu[{b}] has {ba} links back"),
                    ));
                }
            }
        }
        // The PCIe tree is a tree: a host bridge belongs to one NUMA node, a switch has one
        // parent path.
        for a in 0..devices {
            for b in 0..a {
                let (ga, gb) = (&t.gpus[a], &t.gpus[b]);
                if ga.host_bridge == gb.host_bridge && ga.numa != gb.numa {
                    return Err(bad(
                        format!("topology.gpu[{a}].host_bridge"),
                        ga.host_bridge.to_string(),
                        &format!("gpu[{b}] has it on another NUMA node"),
                    ));
                }
                for (i, s) in ga.switches.iter().enumerate() {
                    if let Some(j) = gb.switches.iter().position(|x| x == s)
                        && (i != j
                            || ga.host_bridge != gb.host_bridge
                            || ga.switches[..i] != gb.switches[..j])
                    {
                        return Err(bad(
                            format!("topology.gpu[{a}].switches"),
                            s.to_string(),
                            &format!("switch {s} has another parent under gpu[{b}]"),
                        ));
                    }
                }
            }
        }
        Ok(t)
    }

    /// The raw form, for [`publish`] (read back through [`Topology::from_raw`]).
    pub fn to_raw(&self) -> RawTopology {
        RawTopology {
            nvlink_version: Some(self.nvlink_version),
            nvlink_gbps: Some(self.nvlink_gbps),
            nvswitch_links: Some(self.nvswitch_links),
            nvswitches: Some(self.nvswitches),
            numa: self
                .numa
                .iter()
                .map(|n| RawNuma {
                    cpus: format_cpu_list(&n.cpus),
                    socket: Some(n.socket),
                })
                .collect(),
            gpu: self
                .gpus
                .iter()
                .map(|g| RawGpu {
                    numa: Some(g.numa),
                    host_bridge: Some(g.host_bridge),
                    switches: g.switches.clone(),
                    nvlinks: g.nvlinks.clone(),
                    pcie_gbps: Some(g.pcie_gbps),
                })
                .collect(),
        }
    }

    /// Number of GPUs.
    pub fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    fn direct_links(&self, a: usize, b: usize) -> u32 {
        let n = self.gpus[a]
            .nvlinks
            .iter()
            .filter(|&&p| p as usize == b)
            .count();
        u32::try_from(n).expect("at most 18 links")
    }

    /// NVLinks GPU `a` has (direct ones, or its links into the fabric).
    pub fn link_count(&self, a: usize) -> u32 {
        if self.nvswitch_links > 0 {
            self.nvswitch_links
        } else {
            u32::try_from(self.gpus[a].nvlinks.len()).expect("at most 18 links")
        }
    }

    /// NVLinks usable between `a` and `b` (all of a GPU's links through a fabric).
    pub fn nvlinks_between(&self, a: usize, b: usize) -> u32 {
        if a == b {
            0
        } else if self.nvswitch_links > 0 {
            self.nvswitch_links
        } else {
            self.direct_links(a, b)
        }
    }

    /// Where link `link` of GPU `a` leads: `Some(Ok(peer))` to a GPU, `Some(Err(chip))`
    /// to NVSwitch chip `chip`, `None` if `a` has no such link.
    pub fn link_peer(&self, a: usize, link: u32) -> Option<Result<usize, u32>> {
        if link >= self.link_count(a) {
            return None;
        }
        if self.nvswitch_links > 0 {
            Some(Err(link % self.nvswitches.max(1)))
        } else {
            Some(Ok(self.gpus[a].nvlinks[link as usize] as usize))
        }
    }

    /// NVML's common ancestor of `a` and `b` on the PCIe tree.
    pub fn pcie_level(&self, a: usize, b: usize) -> PcieLevel {
        if a == b {
            return PcieLevel::Internal;
        }
        let (ga, gb) = (&self.gpus[a], &self.gpus[b]);
        if ga.numa != gb.numa {
            let (sa, sb) = (
                self.numa[ga.numa as usize].socket,
                self.numa[gb.numa as usize].socket,
            );
            // NUMA nodes of one socket (AMD's NPS modes) still cross host bridges only.
            return if sa == sb {
                PcieLevel::Node
            } else {
                PcieLevel::System
            };
        }
        if ga.host_bridge != gb.host_bridge {
            return PcieLevel::Node;
        }
        let shared = ga
            .switches
            .iter()
            .zip(&gb.switches)
            .take_while(|(x, y)| x == y)
            .count();
        if shared == 0 {
            PcieLevel::HostBridge
        } else if shared == ga.switches.len() && shared == gb.switches.len() {
            PcieLevel::Single
        } else {
            PcieLevel::Multiple
        }
    }

    /// The class of the best path between `a` and `b`.
    pub fn link_class(&self, a: usize, b: usize) -> LinkClass {
        if a == b {
            return LinkClass::SelfLink;
        }
        match self.nvlinks_between(a, b) {
            0 => LinkClass::Pcie(self.pcie_level(a, b)),
            n => LinkClass::NvLink(n),
        }
    }

    /// Whether `a` can map `b`'s memory (peer access): over NVLink, or over PCIe within a
    /// socket. Across sockets the simulator, like most x86 chipsets, refuses PCIe P2P.
    pub fn p2p_supported(&self, a: usize, b: usize) -> bool {
        a != b && (self.nvlinks_between(a, b) > 0 || self.pcie_level(a, b) <= PcieLevel::Node)
    }

    /// Bandwidth of a peer copy from `a` to `b`, GB/s (= bytes per ns): the NVLinks', or
    /// the slower PCIe link's share at the pair's level (through host memory when P2P is
    /// not supported).
    pub fn copy_gbps(&self, a: usize, b: usize) -> u64 {
        match self.link_class(a, b) {
            LinkClass::SelfLink => 0,
            LinkClass::NvLink(n) => u64::from(n) * u64::from(self.nvlink_gbps),
            LinkClass::Pcie(l) => {
                let pcie = u64::from(self.gpus[a].pcie_gbps.min(self.gpus[b].pcie_gbps));
                (pcie * l.pcie_share_permille() / 1000).max(1)
            }
        }
    }

    /// CPUs local to GPU `a`: its NUMA node's, or its socket's.
    pub fn cpus_of(&self, a: usize, socket_scope: bool) -> Vec<u32> {
        let own = &self.numa[self.gpus[a].numa as usize];
        if !socket_scope {
            return own.cpus.clone();
        }
        let mut v: Vec<u32> = self
            .numa
            .iter()
            .filter(|n| n.socket == own.socket)
            .flat_map(|n| n.cpus.iter().copied())
            .collect();
        v.sort_unstable();
        v
    }

    /// NUMA nodes local to GPU `a`: its own, or all of its socket's.
    pub fn numa_nodes_of(&self, a: usize, socket_scope: bool) -> Vec<u32> {
        let own = self.gpus[a].numa;
        if !socket_scope {
            return vec![own];
        }
        let socket = self.numa[own as usize].socket;
        (0..self.numa.len())
            .filter(|&n| self.numa[n].socket == socket)
            .map(|n| u32::try_from(n).expect("few nodes"))
            .collect()
    }

    /// GPUs other than `a` whose common ancestor with `a` is at `level` or nearer
    /// (`nvmlDeviceGetTopologyNearestGpus`), ascending.
    pub fn nearest(&self, a: usize, level: PcieLevel) -> Vec<usize> {
        (0..self.gpus.len())
            .filter(|&b| b != a && self.pcie_level(a, b) <= level)
            .collect()
    }

    /// GPUs whose local CPUs include `cpu` (`nvmlSystemGetTopologyGpuSet`), ascending.
    pub fn gpus_near_cpu(&self, cpu: u32) -> Vec<usize> {
        (0..self.gpus.len())
            .filter(|&a| self.numa[self.gpus[a].numa as usize].cpus.contains(&cpu))
            .collect()
    }
}

/// Why a node's topology file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TopologyFileError {
    /// It could not be written.
    #[error("cannot write topology file {path}")]
    Write {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// It is not a topology for this node.
    #[error("invalid topology file")]
    Invalid(#[source] ConfigError),
}

/// Writes `t` into the state directory `dir` (complete or not at all; the first writer
/// wins, as for the state file itself).
pub fn publish(dir: &Path, t: &Topology) -> Result<(), TopologyFileError> {
    let path = dir.join(TOPOLOGY_FILE);
    let text = toml::to_string(&t.to_raw()).expect("a topology always serialises");
    let tmp = dir.join(format!(".{TOPOLOGY_FILE}.{}.tmp", std::process::id()));
    let err = |source| TopologyFileError::Write {
        path: path.display().to_string(),
        source,
    };
    std::fs::write(&tmp, text).map_err(err)?;
    vgpu_sys::publish::publish_by_link(&tmp, &path).map_err(err)
}

/// Reads the topology of the node in `dir`, which has `devices` GPUs. A node created
/// before topologies existed (no file) has the default one.
pub fn load(dir: &Path, devices: usize) -> Result<Topology, TopologyFileError> {
    let path = dir.join(TOPOLOGY_FILE);
    let shown = path.display().to_string();
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Topology::default_for(devices));
    };
    let raw: RawTopology = toml::from_str(&text).map_err(|source| {
        TopologyFileError::Invalid(ConfigError::Toml {
            path: shown.clone(),
            source,
        })
    })?;
    Topology::from_raw(raw, devices, &shown).map_err(TopologyFileError::Invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, devices: usize) -> Result<Topology, ConfigError> {
        let raw: RawTopology = toml::from_str(text).expect("toml");
        Topology::from_raw(raw, devices, "t.toml")
    }

    #[test]
    fn cpu_lists_round_trip() {
        let v = parse_cpu_list("0-3,8,10-11").expect("valid");
        assert_eq!(v, vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(format_cpu_list(&v), "0-3,8,10-11");
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn the_default_puts_every_gpu_on_its_own_host_bridge() {
        let t = Topology::default_for(3);
        assert_eq!(t.link_class(0, 1), LinkClass::Pcie(PcieLevel::Node));
        assert_eq!(t.link_class(1, 1), LinkClass::SelfLink);
        assert!(t.p2p_supported(0, 2));
        assert_eq!(t.numa.len(), 1);
        assert_eq!(t.gpus_near_cpu(t.numa[0].cpus[0]), vec![0, 1, 2]);
    }

    #[test]
    fn pcie_levels_follow_the_tree() {
        let t = parse(
            r#"
            [[topology.numa]]
            cpus = "0-3"
            [[topology.numa]]
            cpus = "4-7"
            [[topology.gpu]]
            numa = 0
            host_bridge = 0
            switches = [1, 2]
            [[topology.gpu]]
            numa = 0
            host_bridge = 0
            switches = [1, 2]
            [[topology.gpu]]
            numa = 0
            host_bridge = 0
            switches = [1, 3]
            [[topology.gpu]]
            numa = 0
            host_bridge = 0
            [[topology.gpu]]
            numa = 0
            host_bridge = 1
            [[topology.gpu]]
            numa = 1
            host_bridge = 2
            "#
            .replace("[[topology.", "[[")
            .as_str(),
            6,
        )
        .expect("valid");
        assert_eq!(t.pcie_level(0, 1), PcieLevel::Single);
        assert_eq!(t.pcie_level(0, 2), PcieLevel::Multiple);
        assert_eq!(t.pcie_level(0, 3), PcieLevel::HostBridge);
        assert_eq!(t.pcie_level(0, 4), PcieLevel::Node);
        assert_eq!(t.pcie_level(0, 5), PcieLevel::System);
        assert_eq!(t.nearest(0, PcieLevel::Multiple), vec![1, 2]);
        assert!(!t.p2p_supported(0, 5));
        // Copies get slower with distance.
        let bw: Vec<u64> = (1..6).map(|b| t.copy_gbps(0, b)).collect();
        assert!(bw.windows(2).all(|w| w[0] >= w[1]), "{bw:?}");
        assert!(bw[0] > bw[4]);
    }

    #[test]
    fn bad_topologies_name_the_key() {
        let cases = [
            ("[[gpu]]\nnuma = 3", "topology.gpu[0].numa"),
            ("[[gpu]]\nnvlinks = [0]\n[[gpu]]", "topology.gpu[0].nvlinks"),
            (
                "nvlink_version = 3\n[[gpu]]\nnvlinks = [1]\n[[gpu]]",
                "topology.gpu[0].nvlinks",
            ),
            (
                "[[gpu]]\nnvlinks = [1]\n[[gpu]]\nnvlinks = [0]",
                "topology.nvlink_version",
            ),
            (
                "[[numa]]\ncpus = \"0-3\"\n[[numa]]\ncpus = \"3-4\"",
                "topology.numa[1].cpus",
            ),
            ("[[numa]]\ncpus = \"zero\"", "topology.numa[0].cpus"),
            ("[[gpu]]", "topology.gpu"),
            ("nvswitch_links = 19", "topology.nvswitch_links"),
            (
                "[[numa]]\ncpus=\"0\"\n[[numa]]\ncpus=\"1\"\n[[gpu]]\nnuma=0\nhost_bridge=0\n[[gpu]]\nnuma=1\nhost_bridge=0",
                "topology.gpu[1].host_bridge",
            ),
            (
                "[[gpu]]\nswitches=[1,2]\nhost_bridge=0\n[[gpu]]\nswitches=[2]\nhost_bridge=0",
                "topology.gpu[1].switches",
            ),
        ];
        for (text, key) in cases {
            // One device per [[gpu]], except where the count itself is wrong.
            let n = text.matches("[[gpu]]").count().max(1);
            let n = if key == "topology.gpu" { 2 } else { n };
            let e = parse(text, n).expect_err(text);
            assert!(e.to_string().contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn a_topology_survives_its_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = parse(
            "nvlink_version = 3\n[[numa]]\ncpus = \"0-7\"\n[[gpu]]\nnvlinks = [1, 1]\nswitches = [4]\n[[gpu]]\nnvlinks = [0, 0]",
            2,
        )
        .expect("valid");
        publish(dir.path(), &t).expect("publish");
        assert_eq!(load(dir.path(), 2).expect("load"), t);
        assert_eq!(t.link_class(0, 1), LinkClass::NvLink(2));
        assert_eq!(t.copy_gbps(0, 1), 50);
        let empty = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            load(empty.path(), 2).expect("default"),
            Topology::default_for(2)
        );
    }
}
