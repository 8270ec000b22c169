//! A revoked (or yielded) grant's drain as the tenant's processes report it, one report
//! per process: the arbiter hands the sum to the scheduler once every process of the
//! tenant on the GPU has reported (or closed its connection).

use std::collections::HashSet;

use super::TenantId;

/// The drain of grant `generation` of `tenant`, being reported.
#[derive(Debug)]
pub(super) struct Reports {
    pub(super) generation: u32,
    pub(super) tenant: TenantId,
    /// Connections still to report.
    pub(super) pending: HashSet<u64>,
    /// The latest end of work reported (0: none said).
    pub(super) end: u64,
    /// Device time the reporting processes measured (None once one did not measure).
    pub(super) busy: Option<u64>,
    /// Kernels they launched under the grant.
    pub(super) launches: u64,
    /// Some process still has launches blocked.
    pub(super) waiting: bool,
}

impl Reports {
    /// A drain of grant `generation` that processes `pending` are to report.
    pub(super) fn new(tenant: TenantId, generation: u32, pending: HashSet<u64>) -> Reports {
        Reports {
            generation,
            tenant,
            pending,
            end: 0,
            busy: Some(0),
            launches: 0,
            waiting: false,
        }
    }

    /// Process `conn` reports the drain (or a yield).
    pub(super) fn report(
        &mut self,
        conn: u64,
        end_ns: u64,
        busy_ns: Option<u64>,
        launches: u64,
        waiting: bool,
    ) {
        self.pending.remove(&conn);
        self.end = self.end.max(end_ns);
        // The tenant's processes share the slice: their busy times add up (the
        // scheduler bounds the sum by the slice).
        self.busy = self.busy.zip(busy_ns).map(|(a, b)| a.saturating_add(b));
        self.launches = self.launches.saturating_add(launches);
        self.waiting |= waiting;
    }

    /// Process `conn` closed its connection before reporting.
    pub(super) fn closed(&mut self, conn: u64, now: u64) {
        if self.pending.remove(&conn) {
            self.end = self.end.max(now);
            // What the closed process ran is unknown: the slice is charged whole.
            self.busy = None;
        }
    }

    /// Every process has reported.
    pub(super) fn complete(&self) -> bool {
        self.pending.is_empty()
    }

    /// When the work drained: the latest end reported, `now` when none was said.
    pub(super) fn end_or(&self, now: u64) -> u64 {
        if self.end == 0 { now } else { self.end }
    }
}
