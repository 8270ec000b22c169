//! How well a node's GPUs are connected to each other, and the best-connected set of `n`.
//!
//! One home for the link-class decision (issue 14, ADR 0021): the scheduler extender
//! (which GPUs of the chosen node a multi-GPU container gets, and whether a node can
//! meet a pod's `vgpu.io/gpu-topology` requirement) and the device plugin's
//! `GetPreferredAllocation` both call [`NodeTopology::best_set`]. The input is what the
//! device plugin publishes in the Node's GPU inventory ([`GpuTopology`] per GPU: NUMA
//! node, PCIe switch peers, NVLink peers with their link counts).
//!
//! # Link classes
//!
//! The [`LinkClass`] of two GPUs of one node, best first:
//!
//! | class | when | `nvidia-smi topo -m` |
//! |---|---|---|
//! | [`LinkClass::NvLink`] | either GPU lists the other among its NVLink peers (direct or through an NVSwitch fabric) | `NV<n>` |
//! | [`LinkClass::Switch`] | under the same PCIe switch | `PIX` |
//! | [`LinkClass::Numa`] | on the same NUMA node (same host bridge, or host bridges of one NUMA node) | `PXB`, `PHB`, `NODE` |
//! | [`LinkClass::System`] | anything else: across sockets, **or unknown** | `SYS` |
//!
//! A GPU whose topology is unknown (no `topology` in the inventory: an older plugin, a
//! driver that does not say) is [`LinkClass::System`] with every other GPU: the
//! worst class, so that a requirement is never met on a guess and a known good set is
//! always preferred to an unknown one. Two GPUs on different NUMA nodes of one socket
//! (AMD NPS modes) are `System` too: the inventory does not carry sockets.
//!
//! Within NVLink, more links are better: a pair's [`Link`] is its class plus its
//! number of NVLinks (`nvlinks`, 0 outside NVLink), ordered by class, then links.
//!
//! # The class of a set
//!
//! A set's link is its **worst pair** ([`NodeTopology::set_link`]). Collective
//! operations (all-reduce, all-gather) move data between every pair of members over
//! their lifetime (a ring visits every member; a tree or NCCL's choice among rings
//! depends on the library, not on us), and the slowest hop bounds their step time: a
//! set of three NVLinked GPUs and one across the sockets runs at the socket link's
//! speed. The worst pair is also what a requirement can promise ("every pair of my
//! GPUs talks over NVLink").
//!
//! # Choosing a set
//!
//! [`NodeTopology::best_set`] picks `n` GPUs among candidates (those free enough for
//! the container), lexicographically by:
//!
//! 1. the best worst-pair link (class, then NVLink count): the best class available;
//! 2. the most connectivity inside the set (sum of [`Link::weight`] over its pairs);
//! 3. the least connectivity broken outside it (sum of [`Link::weight`] between the set
//!    and the candidates left over): take the GPUs whose neighbours are already gone,
//!    keeping intact the connected groups that later multi-GPU containers need;
//! 4. the lowest indices (the set's sorted indices compared lexicographically).
//!
//! The search is exact (a clique search over the pairs at least as good as the level
//! tried, best level first) within [`SEARCH_BUDGET`] steps per level; node shapes
//! that exist (≤ 16 GPUs, groups that are cliques) stay far below it. Past the budget the
//! result is still a valid set, deterministic, but may not be the best.

use crate::inventory::{GpuTopology, NodeInventory};
use std::cmp::Ordering;
use std::fmt;

/// Pod annotation stating a multi-GPU container's link requirement (see
/// [`TopologyRequirement`]).
pub const ANNOTATION_GPU_TOPOLOGY: &str = "vgpu.io/gpu-topology";

/// Steps (set extensions tried) a single level of [`NodeTopology::best_set`]'s search may
/// take before it stops with the best found so far.
pub const SEARCH_BUDGET: u32 = 200_000;

/// How two GPUs of one node are connected, worst first (so `Ord` says "better").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkClass {
    /// Across CPU sockets, or unknown: traffic crosses the inter-socket link (or may).
    System,
    /// The same NUMA node: through a host bridge of that node, no inter-socket hop.
    Numa,
    /// The same PCIe switch: peer traffic stays below the switch.
    Switch,
    /// NVLink, directly or through an NVSwitch fabric.
    NvLink,
}

impl LinkClass {
    /// Every class, best first.
    pub const ALL_BEST_FIRST: [LinkClass; 4] = [
        LinkClass::NvLink,
        LinkClass::Switch,
        LinkClass::Numa,
        LinkClass::System,
    ];

    /// The class's name, as the annotation spells it (`nvlink`, `switch`, `numa`,
    /// `system`).
    pub fn name(self) -> &'static str {
        match self {
            LinkClass::NvLink => "nvlink",
            LinkClass::Switch => "switch",
            LinkClass::Numa => "numa",
            LinkClass::System => "system",
        }
    }

    /// Index of the class, 0 for [`LinkClass::System`] up to 3 for [`LinkClass::NvLink`].
    pub fn rank(self) -> usize {
        self as usize
    }
}

impl fmt::Display for LinkClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The connection between two GPUs: class, then NVLink count (0 outside NVLink).
/// Ordered worse-to-better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Link {
    /// The class.
    pub class: LinkClass,
    /// NVLinks between the two (the fewer of what each side reports, at least 1 for
    /// [`LinkClass::NvLink`]); 0 for the other classes.
    pub nvlinks: u32,
}

impl Link {
    /// The worst link: [`LinkClass::System`].
    pub const SYSTEM: Link = Link {
        class: LinkClass::System,
        nvlinks: 0,
    };

    /// A GPU with itself: better than any link between two GPUs.
    pub const SAME: Link = Link {
        class: LinkClass::NvLink,
        nvlinks: u32::MAX,
    };

    /// How much connectivity the pair carries, for the tie-breaks of
    /// [`NodeTopology::best_set`]: System 0, Numa 1, Switch 2, NVLink 2 + links.
    pub fn weight(self) -> u64 {
        match self.class {
            LinkClass::System => 0,
            LinkClass::Numa => 1,
            LinkClass::Switch => 2,
            LinkClass::NvLink => 2 + u64::from(self.nvlinks.min(1 << 16)),
        }
    }
}

/// What a pod's [`ANNOTATION_GPU_TOPOLOGY`] asks of its multi-GPU containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TopologyRequirement {
    /// No requirement (annotation absent, or `any`): the best set available on the
    /// chosen node is still preferred.
    #[default]
    Any,
    /// Every pair of the container's GPUs must be at least this class (`nvlink`,
    /// `switch`, `numa`); a node that cannot give it is filtered out.
    AtLeast(LinkClass),
}

/// A bad value of [`ANNOTATION_GPU_TOPOLOGY`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// Not one of the values the annotation accepts.
    #[error(
        "annotation vgpu.io/gpu-topology: unknown value {0:?} (expected nvlink, switch, numa or any)"
    )]
    UnknownValue(String),
}

impl TopologyRequirement {
    /// Parses the annotation's value: `nvlink`, `switch`, `numa` or `any`
    /// (ASCII case-insensitive, surrounding blanks ignored).
    pub fn parse(value: &str) -> Result<Self, TopologyError> {
        let v = value.trim();
        let class = if v.eq_ignore_ascii_case("any") {
            return Ok(TopologyRequirement::Any);
        } else if v.eq_ignore_ascii_case("nvlink") {
            LinkClass::NvLink
        } else if v.eq_ignore_ascii_case("switch") {
            LinkClass::Switch
        } else if v.eq_ignore_ascii_case("numa") {
            LinkClass::Numa
        } else {
            return Err(TopologyError::UnknownValue(value.to_string()));
        };
        Ok(TopologyRequirement::AtLeast(class))
    }

    /// Reads the requirement from a pod's annotation value, `None` (absent) being
    /// [`TopologyRequirement::Any`].
    pub fn from_annotation(value: Option<&str>) -> Result<Self, TopologyError> {
        value.map_or(Ok(TopologyRequirement::Any), Self::parse)
    }

    /// Whether a set whose worst pair is `class` meets the requirement.
    pub fn accepts(self, class: LinkClass) -> bool {
        match self {
            TopologyRequirement::Any => true,
            TopologyRequirement::AtLeast(min) => class >= min,
        }
    }
}

impl fmt::Display for TopologyRequirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TopologyRequirement::Any => f.write_str("any"),
            TopologyRequirement::AtLeast(c) => write!(f, "{c}"),
        }
    }
}

/// One node's GPUs and how they are connected, by NVML index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeTopology {
    /// The NVML indices, ascending, one entry per index.
    index: Vec<u32>,
    /// Whether each GPU's topology is known.
    known: Vec<bool>,
    /// `links[i * len + j]`: the link between `index[i]` and `index[j]`.
    links: Vec<Link>,
}

impl NodeTopology {
    /// The topology of the GPUs of `gpus` (`(NVML index, its topology if known)`); a
    /// repeated index keeps its first entry.
    pub fn new(gpus: impl IntoIterator<Item = (u32, Option<GpuTopology>)>) -> Self {
        let mut v: Vec<(u32, Option<GpuTopology>)> = gpus.into_iter().collect();
        v.sort_by_key(|(i, _)| *i);
        v.dedup_by_key(|(i, _)| *i);
        let len = v.len();
        let mut links = vec![Link::SYSTEM; len * len];
        for (i, (a, ta)) in v.iter().enumerate() {
            for (j, (b, tb)) in v.iter().enumerate() {
                links[i * len + j] = if i == j {
                    Link::SAME
                } else {
                    pair_link(*a, ta.as_ref(), *b, tb.as_ref())
                };
            }
        }
        NodeTopology {
            index: v.iter().map(|(i, _)| *i).collect(),
            known: v.iter().map(|(_, t)| t.is_some()).collect(),
            links,
        }
    }

    /// The topology the device plugin published for a node.
    pub fn from_inventory(inv: &NodeInventory) -> Self {
        Self::new(inv.gpus.iter().map(|g| (g.index, g.topology.clone())))
    }

    /// The same topology keyed by each GPU's position in `inv.gpus` rather than its NVML
    /// index (the scheduler's ledger numbers a node's GPUs by position); peers the
    /// record does not list are dropped.
    pub fn by_position(inv: &NodeInventory) -> Self {
        let pos = |index: u32| -> Option<u32> {
            inv.gpus
                .iter()
                .position(|g| g.index == index)
                .and_then(|p| u32::try_from(p).ok())
        };
        Self::new(inv.gpus.iter().enumerate().filter_map(|(p, g)| {
            let p = u32::try_from(p).ok()?;
            let topo = g.topology.as_ref().map(|t| GpuTopology {
                numa_node: t.numa_node,
                switch_peers: t.switch_peers.iter().filter_map(|&i| pos(i)).collect(),
                nvlink_peers: t
                    .nvlink_peers
                    .iter()
                    .filter_map(|l| {
                        Some(crate::inventory::NvLinkPeer {
                            index: pos(l.index)?,
                            links: l.links,
                        })
                    })
                    .collect(),
            });
            Some((p, topo))
        }))
    }

    /// Whether any GPU of the node has a known topology.
    pub fn is_known(&self) -> bool {
        self.known.iter().any(|k| *k)
    }

    /// The NVML indices the node has, ascending.
    pub fn indices(&self) -> &[u32] {
        &self.index
    }

    fn pos(&self, index: u32) -> Option<usize> {
        self.index.binary_search(&index).ok()
    }

    fn at(&self, i: usize, j: usize) -> Link {
        self.links[i * self.index.len() + j]
    }

    /// How GPUs `a` and `b` are connected. NVLink: either side lists the other (the
    /// fewer links where both do); same switch: either lists the other as a switch
    /// peer; same NUMA node: both know theirs and they are equal; otherwise (unknown
    /// topology, or a GPU the node does not have) [`Link::SYSTEM`]. `link(a, a)` is
    /// [`Link::SAME`], better than any link, so that a set's worst pair ignores repeats.
    pub fn link(&self, a: u32, b: u32) -> Link {
        if a == b {
            return Link::SAME;
        }
        match (self.pos(a), self.pos(b)) {
            (Some(i), Some(j)) => self.at(i, j),
            _ => Link::SYSTEM,
        }
    }

    /// The worst pair of a set of GPUs; `None` for fewer than two distinct GPUs.
    pub fn set_link(&self, set: &[u32]) -> Option<Link> {
        let mut worst: Option<Link> = None;
        for (k, &a) in set.iter().enumerate() {
            for &b in &set[k + 1..] {
                if a == b {
                    continue;
                }
                let l = self.link(a, b);
                worst = Some(worst.map_or(l, |w| w.min(l)));
            }
        }
        worst
    }

    /// The class of a set's worst pair; `None` for fewer than two distinct GPUs.
    pub fn set_class(&self, set: &[u32]) -> Option<LinkClass> {
        self.set_link(set).map(|l| l.class)
    }

    /// The best class a set of `n` GPUs taken from `candidates` can have (`None` when
    /// `n < 2` or there are fewer than `n` distinct candidates): the class of
    /// [`NodeTopology::best_set`]'s answer.
    pub fn best_class(&self, candidates: &[u32], n: usize) -> Option<LinkClass> {
        if n < 2 {
            return None;
        }
        self.best_set(candidates, &[], n)
            .and_then(|s| self.set_class(&s))
    }

    /// The best-connected set of `n` GPUs among `candidates` that contains every GPU of
    /// `required` (the device plugin's "must include"), ascending; `None` when there is
    /// no such set (fewer than `n` distinct GPUs, or `required` has more than `n` or a
    /// GPU that is not a candidate). Ranking: see the module documentation. Duplicates
    /// in either list are ignored; a candidate the node does not list is
    /// [`LinkClass::System`] with every other.
    pub fn best_set(&self, candidates: &[u32], required: &[u32], n: usize) -> Option<Vec<u32>> {
        let mut cands: Vec<u32> = candidates.to_vec();
        cands.sort_unstable();
        cands.dedup();
        let mut must: Vec<u32> = required.to_vec();
        must.sort_unstable();
        must.dedup();
        if cands.len() < n || must.len() > n || must.iter().any(|m| cands.binary_search(m).is_err())
        {
            return None;
        }
        if n == 0 {
            return Some(Vec::new());
        }
        if cands.len() == n {
            return Some(cands);
        }
        // Work on positions in `cands`, with the candidates' own link matrix.
        let m = cands.len();
        let mut links = vec![Link::SAME; m * m];
        for i in 0..m {
            for j in 0..m {
                if i != j {
                    links[i * m + j] = self.link(cands[i], cands[j]);
                }
            }
        }
        let must_pos: Vec<usize> = (0..m).filter(|&i| must.contains(&cands[i])).collect();
        let free: Vec<usize> = (0..m).filter(|&i| !must.contains(&cands[i])).collect();
        // The levels to try, best first: every distinct link among candidate pairs, at
        // most as good as `required`'s own worst pair (no superset beats it).
        let must_worst = worst_of(&links, m, &must_pos);
        let mut levels: Vec<Link> = links
            .iter()
            .copied()
            .filter(|l| *l != Link::SAME && must_worst.is_none_or(|w| *l <= w))
            .collect();
        levels.push(Link::SYSTEM);
        levels.sort_unstable_by(|x, y| y.cmp(x));
        levels.dedup();
        for level in levels {
            let mut search = Search {
                links: &links,
                m,
                level,
                n,
                steps: 0,
                best: None,
            };
            let mut chosen = must_pos.clone();
            search.extend(&mut chosen, &free, 0);
            if let Some((_, set)) = search.best {
                return Some(set.into_iter().map(|i| cands[i]).collect());
            }
        }
        None
    }
}

/// The worst link among the pairs of `set` (positions in an `m`×`m` matrix).
fn worst_of(links: &[Link], m: usize, set: &[usize]) -> Option<Link> {
    let mut worst: Option<Link> = None;
    for (k, &a) in set.iter().enumerate() {
        for &b in &set[k + 1..] {
            let l = links[a * m + b];
            worst = Some(worst.map_or(l, |w| w.min(l)));
        }
    }
    worst
}

/// The link between two distinct GPUs from their records (see [`NodeTopology::link`]).
fn pair_link(a: u32, ta: Option<&GpuTopology>, b: u32, tb: Option<&GpuTopology>) -> Link {
    let (Some(ta), Some(tb)) = (ta, tb) else {
        return Link::SYSTEM;
    };
    let la = ta
        .nvlink_peers
        .iter()
        .find(|p| p.index == b)
        .map(|p| p.links);
    let lb = tb
        .nvlink_peers
        .iter()
        .find(|p| p.index == a)
        .map(|p| p.links);
    let links = match (la, lb) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    };
    if let Some(l) = links {
        return Link {
            class: LinkClass::NvLink,
            nvlinks: l.max(1),
        };
    }
    if ta.switch_peers.contains(&b) || tb.switch_peers.contains(&a) {
        return Link {
            class: LinkClass::Switch,
            nvlinks: 0,
        };
    }
    match (ta.numa_node, tb.numa_node) {
        (Some(x), Some(y)) if x == y => Link {
            class: LinkClass::Numa,
            nvlinks: 0,
        },
        _ => Link::SYSTEM,
    }
}

/// The tie-break key of a complete set: more inside, less cut outside (then lower
/// indices, compared by the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SetKey {
    inside: u64,
    cut: u64,
}

impl SetKey {
    /// `Greater` when `self` is the better set.
    fn compare(&self, other: &SetKey) -> Ordering {
        self.inside
            .cmp(&other.inside)
            .then_with(|| other.cut.cmp(&self.cut))
    }
}

/// One level's clique search: sets of `n` whose every pair is at least `level`, over
/// positions in an `m`×`m` link matrix.
struct Search<'a> {
    links: &'a [Link],
    m: usize,
    level: Link,
    n: usize,
    steps: u32,
    best: Option<(SetKey, Vec<usize>)>,
}

impl Search<'_> {
    fn at(&self, a: usize, b: usize) -> Link {
        self.links[a * self.m + b]
    }

    /// Extends `chosen` with positions from `pool[from..]` that link to every chosen
    /// one at `level` or better.
    fn extend(&mut self, chosen: &mut Vec<usize>, pool: &[usize], from: usize) {
        if chosen.len() == self.n {
            self.consider(chosen);
            return;
        }
        let need = self.n - chosen.len();
        for k in from..pool.len() {
            if pool.len() - k < need || self.steps >= SEARCH_BUDGET {
                return;
            }
            self.steps += 1;
            let g = pool[k];
            if chosen.iter().all(|&c| self.at(c, g) >= self.level) {
                chosen.push(g);
                self.extend(chosen, pool, k + 1);
                chosen.pop();
            }
        }
    }

    fn consider(&mut self, set: &[usize]) {
        if worst_of(self.links, self.m, set).is_some_and(|l| l < self.level) {
            return; // `required` itself may hold a pair below the level
        }
        let mut inside = 0;
        let mut cut = 0;
        for o in 0..self.m {
            let member = set.contains(&o);
            for &s in set {
                if s == o {
                    continue;
                }
                let w = self.at(s, o).weight();
                if member {
                    inside += w; // each inside pair twice: harmless for comparing
                } else {
                    cut += w;
                }
            }
        }
        let key = SetKey { inside, cut };
        let mut sorted = set.to_vec();
        sorted.sort_unstable();
        let better = match &self.best {
            None => true,
            Some((k, s)) => match key.compare(k) {
                Ordering::Greater => true,
                Ordering::Less => false,
                Ordering::Equal => sorted < *s,
            },
        };
        if better {
            self.best = Some((key, sorted));
        }
    }
}

#[cfg(test)]
mod tests;
