//! The grant protocol's tunables ([`Params`], the daemon's flags) and the constants its
//! rules are built on, each with the measurement that chose it.

/// How soon a lone holder's slice is looked at again when it was not renewed because
/// another tenant had unread input (`Scheduler::tick_unread`), ns.
pub const UNREAD_RECHECK_NS: u64 = 1_000_000;

/// How far back a demand's own time (when the launcher blocked, [`demand_time`]) is
/// believed, ns: a daemon throttled by its CFS quota reads a demand up to a period (100
/// ms) after it was made, and dating it at the read took that wait for a sleep. A
/// tenant that lies about it gains at most this much owed time per sleep: a sleep this
/// short passes for no sleep, as one shorter than a quantum already does.
pub const MAX_DEMAND_AGE_NS: u64 = 100_000_000;

/// When a demand read at `now` was made: the shim's `since_ns` (CLOCK_MONOTONIC, shared
/// by the node's processes), no later than `now` and no earlier than
/// [`MAX_DEMAND_AGE_NS`] before it; `now` without one (an older shim).
pub fn demand_time(since_ns: Option<u64>, now: u64) -> u64 {
    since_ns.map_or(now, |s| s.clamp(now.saturating_sub(MAX_DEMAND_AGE_NS), now))
}

/// How many times the GPU kept free for an owed tenant is kept free
/// [`UNREAD_RECHECK_NS`] more because that tenant has unread input. Counted in looks,
/// not in wall time: a daemon throttled for 80 ms does not look meanwhile, and its
/// first look after it must not give the GPU away; a tenant that floods its socket
/// keeps the GPU idle for at most this many rechecks (10 ms) past the grace.
pub const RESERVATION_RECHECKS: u32 = 10;

/// Co-holders are revoked (and report) at least every this many of the holder's slices
/// while nobody waits, so that their fills stay current.
pub const CO_REFRESH_SLICES: u32 = 10;

/// Least part of the time a tenant's container must be throttled by its CPU limit for
/// the tenant to be co-held beside a holder. Fills alone (tenants starved of CPU by
/// other processes, not throttled) were tried: with ten CPU-limited tenants of short
/// kernels on two CPUs some got 0.13× the device time they use unshared. Above a half:
/// 0.5-CPU containers sharing two CPUs read 0.49–0.61 ([`vgpu_core::cpu_cgroup::stopped_part`])
/// and take turns best.
pub const CO_HOLD_MIN_STOPPED: f64 = 0.6;

/// Default [`Params::claim_timeout_ns`]: a blocked launcher of a running container wakes
/// and claims within tens of microseconds; a stopped one waits up to the rest of its CFS
/// period (tens of milliseconds).
pub const DEFAULT_CLAIM_TIMEOUT_NS: u64 = 2_000_000;

/// Margin beyond a throttled holder's queued work before the GPU goes on without its
/// report (`Scheduler::handoff_at`).
pub(super) const THROTTLED_HAND_ON_MARGIN_NS: u64 = 1_000_000;

/// Least part of the time a holder's container must be throttled by its CPU limit for
/// the daemon to look at its claim before the slice ends ([`Params::claim_timeout_ns`]):
/// an unclaimed grant is then most likely a container stopped now, not a launcher slow
/// to wake on a busy node (which the look would also take the grant from, at the cost
/// of a round trip to its gate thread).
pub const CLAIM_MIN_STOPPED: f64 = 0.1;

/// Most grants in a row a tenant loses at looks (`Scheduler::withdraw`) before one is
/// left to it to the slice's end, as without looks: a container whose runs never meet
/// its grants (the phases of its CFS period and the others' slices locked) still gets a
/// whole slice at least every fourth grant. A grant of its that a process claims starts
/// the count again. Without it, a 0.2-CPU tenant of 100 ms kernels lost all nine of its
/// grants in three seconds and ran nothing (CI, stop 27).
pub const MAX_WITHDRAWN_IN_ROW: u32 = 3;

/// Default of [`Params::co_hold_fill_pct`]: on, at the bound it was measured with (ADR
/// 0029). On an H200 (run 9, `tests/gpu`), two PyTorch tenants at 30/70 in 0.5-CPU
/// containers did 1.6–1.7× the work with co-holding that they did taking turns, each
/// more than unshared; saturating tenants' shares were unchanged (within 0.1 pp).
pub const DEFAULT_CO_HOLD_FILL_PCT: u32 = CO_HOLD_FILL_PCT_MEASURED;

/// The bound the measurements of ADR 0029 used (`--co-hold-fill-pct 80`).
pub const CO_HOLD_FILL_PCT_MEASURED: u32 = 80;

/// A holder's slice lasts this many times its hand-over cost, its start plus its
/// report's lag ([`stretched_slice`](crate::arbiter::rules::stretched_slice)): the GPU's idle time at each hand-over is then at
/// most about a fifth of the cycle.
pub const SLICE_PER_LAG: u64 = 4;

/// Default of [`Params::max_slice_quanta`].
pub const DEFAULT_MAX_SLICE_QUANTA: u32 = 4;

/// A holder's queue-ahead bound is this many times its hand-over cost
/// ([`deepened_queue`](crate::arbiter::rules::deepened_queue)): a launcher out of budget resumes only after its gate thread
/// and then itself got a CPU, about one hand-over, and the queue must last that long.
pub const QUEUE_PER_LAG: u64 = 2;

/// Default of [`Params::max_queue_ahead_ns`]: half the longest slice at the default
/// [`DEFAULT_MAX_SLICE_QUANTA`] and quantum.
pub const DEFAULT_MAX_QUEUE_AHEAD_NS: u64 = 20_000_000;

/// Weight of the past in a tenant's start and report lag: each measure halves what the
/// ones before it count for.
pub(super) const LAG_DECAY: f64 = 0.5;

/// Weight of the past in a tenant's fill: each measured grant halves what the grants
/// before it count for.
pub(super) const FILL_DECAY: f64 = 0.5;

/// Least device time a tenant's unshared grants must have measured (weighted as the
/// fill) before its shared grants are charged per launch ([`TenantState::unshared_cost`](crate::arbiter::tenant::TenantState::unshared_cost)).
pub(super) const MIN_COST_SAMPLE_NS: u64 = 1_000_000;

/// Default [`Params::grant_expiry_margin_ns`]: five quanta. A daemon throttled by a CPU
/// limit misses up to most of a 100 ms CFS period; what it did not revoke within this
/// margin the holder's shim yields by itself (ADR 0036).
pub const DEFAULT_GRANT_EXPIRY_MARGIN_NS: u64 = 50_000_000;

/// A lone holder's grant expires this many [`Params::grant_expiry_margin_ns`] past its
/// slice's end (`Scheduler::expiry`): a tenant may have started waiting that a stalled
/// daemon did not read.
pub const ALONE_EXPIRY_MARGINS: u64 = 4;

/// Tunables.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Slice length, ns.
    pub quantum_ns: u64,
    /// Longest a revoked holder may take to drain before the next grant, ns.
    pub drain_timeout_ns: u64,
    /// Window of [`TenantStats::recent_share_pct`](crate::arbiter::tenant::TenantStats::recent_share_pct), ns.
    pub window_ns: u64,
    /// How long the GPU stays free for a releasing tenant that is still owed time, ns
    /// (0: hand it on at once).
    pub regrant_grace_ns: u64,
    /// Least charge of a slice, percent of its time from grant to drain, whatever
    /// device time the tenant reports: bounds what a tenant that holds the GPU idle
    /// (or under-reports its busy time) costs the others to about `100 /
    /// min_charge_pct` times its share of the GPU's time.
    pub min_charge_pct: u32,
    /// How much GPU time a revoked holder can have queued: the shims' queue-ahead
    /// bound, ns. With [`Params::handoff_margin_ns`], when the GPU may go on to a waiting
    /// tenant before a revoked holder reported its drain ([`handoff_delay`](crate::arbiter::rules::handoff_delay)); 0: never
    /// (wait for the report, up to `drain_timeout_ns`).
    pub handoff_queue_ns: u64,
    /// Margin beyond the revoked holder's queued work before the GPU goes on, ns.
    pub handoff_margin_ns: u64,
    /// Co-holding: a waiting `burst` tenant whose container is throttled most of the
    /// time ([`CO_HOLD_MIN_STOPPED`]) is granted the GPU beside the holder (and the
    /// tenants already beside it) while their expected uses (fill × the part of the time
    /// their container runs) add up to at most this percent ([`co_fits`](crate::arbiter::rules::co_fits)); 0: never.
    /// Tenants stopped most of each CFS period by their container's CPU limit then run
    /// at once, as they would unshared.
    pub co_hold_fill_pct: u32,
    /// The shims' queue-ahead bound, ns (`--queue-ahead-us`; 0: unbounded): the device
    /// time a process may have queued beyond what completed (two launches are always
    /// allowed), which its work can run on for after its container is stopped
    /// (co-holding's expected use). A holder slow to start and to report gets more
    /// ([`deepened_queue`](crate::arbiter::rules::deepened_queue)).
    pub queue_ahead_ns: u64,
    /// How long after a grant, while another tenant waits, the daemon looks at whether
    /// the holder claimed it (a process launched under it; ADR 0030), for holders whose
    /// containers are throttled at least [`CLAIM_MIN_STOPPED`] of the time (and whose
    /// launches are short: `Scheduler::claim_due`); unclaimed,
    /// the grant is withdrawn and the GPU goes on at once (the tenant is not granted
    /// again before its drain report, which it sends when its container runs). 0: only
    /// at the slice's end. Every revoke of an unclaimed grant goes on at once, whatever
    /// this is.
    pub claim_timeout_ns: u64,
    /// Longest slice, in quanta, of a holder slow to start under its grants and to
    /// report its drains ([`stretched_slice`](crate::arbiter::rules::stretched_slice): [`SLICE_PER_LAG`] times those waits, at
    /// least a quantum; ADR 0031); 1: every slice is a quantum.
    pub max_slice_quanta: u32,
    /// Deepest queue-ahead bound of a holder slow to start and to report
    /// ([`deepened_queue`](crate::arbiter::rules::deepened_queue): [`QUEUE_PER_LAG`] times those waits, at least
    /// `queue_ahead_ns`, at most half its slice; ADR 0032), ns; at most `queue_ahead_ns`:
    /// every holder's bound is `queue_ahead_ns`.
    pub max_queue_ahead_ns: u64,
    /// How long past its slice's end a grant held while another tenant waits (or a
    /// capped tenant's, whose tokens end with its slice) expires in the shims without
    /// word from the daemon (`Scheduler::expiry`, ADR 0036), ns; a lone holder's,
    /// [`ALONE_EXPIRY_MARGINS`] times that; 0: never.
    /// Bounds what a daemon too starved of CPU to revoke on time (or frozen) lets a
    /// holder run beyond its slice.
    pub grant_expiry_margin_ns: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            quantum_ns: 10_000_000,
            drain_timeout_ns: 500_000_000,
            window_ns: 10_000_000_000,
            regrant_grace_ns: 2_000_000,
            min_charge_pct: 10,
            handoff_queue_ns: 0,
            handoff_margin_ns: 1_000_000,
            co_hold_fill_pct: DEFAULT_CO_HOLD_FILL_PCT,
            queue_ahead_ns: 2_000_000,
            claim_timeout_ns: DEFAULT_CLAIM_TIMEOUT_NS,
            max_slice_quanta: DEFAULT_MAX_SLICE_QUANTA,
            max_queue_ahead_ns: DEFAULT_MAX_QUEUE_AHEAD_NS,
            grant_expiry_margin_ns: DEFAULT_GRANT_EXPIRY_MARGIN_NS,
        }
    }
}

/// Queue-ahead bound of a best-effort grant on a GPU with latency-sensitive tenants.
pub const PREEMPTIBLE_QUEUE_AHEAD_NS: u64 = 300_000;
