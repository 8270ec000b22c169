//! GPU memory allocations the shims refused over a container's quota: each process
//! reports a running count per GPU with its usage; the container's health record keeps
//! the sum and the latest figures (also after the container leaves), for the metrics,
//! the API and the device plugin's pod event.

use tracing::debug;

use super::registration::health_rec;
use super::{Daemon, DaemonError};
use crate::model::MemoryRefusals;
use vgpu_core::sched_proto::MemoryRefusal;

impl Daemon {
    /// A process reports `refused` allocations on its GPU `gpu` so far (a running count)
    /// and the latest one; what is new since its last report is added to its container's
    /// record.
    pub fn memory_refusals(
        &self,
        conn: u64,
        gpu: u32,
        refused: u64,
        last: Option<MemoryRefusal>,
    ) -> Result<(), DaemonError> {
        let mut g = self.lock();
        let Some((uuid, _)) = self.conn_gpu(&g, conn, gpu)? else {
            return Ok(());
        };
        let key = g
            .conns
            .get(&conn)
            .map(|c| c.tenant.clone())
            .unwrap_or_default();
        let Some(t) = g.tenants.get_mut(&key) else {
            return Ok(());
        };
        let Some(r) = t.gpus.get_mut(&uuid) else {
            return Ok(());
        };
        let before = r.refused.insert(conn, refused).unwrap_or(0);
        // A count that went down is a new process' (or garbage): nothing new.
        let new = refused.saturating_sub(before);
        if new == 0 {
            return Ok(());
        }
        let ident = t.ident.clone();
        let Some(h) = health_rec(&mut g, &ident) else {
            return Ok(());
        };
        let i = match h.memory_refusals.iter().position(|m| m.uuid == uuid) {
            Some(i) => i,
            None => {
                h.memory_refusals.push(MemoryRefusals {
                    uuid: uuid.clone(),
                    ..MemoryRefusals::default()
                });
                h.memory_refusals.len() - 1
            }
        };
        let m = &mut h.memory_refusals[i];
        m.count = m.count.saturating_add(new);
        if let Some(l) = last {
            m.last_asked = l.asked;
            m.last_used = l.used;
            m.last_quota = l.quota;
        }
        m.last_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let (count, asked, used, quota) = (m.count, m.last_asked, m.last_used, m.last_quota);
        drop(g);
        debug!(tenant = %ident.key, gpu = %uuid, count, asked, used, quota, "allocations refused over the memory quota");
        Ok(())
    }
}
