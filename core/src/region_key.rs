//! Where a container's shim accounting region lives (ADR 0015): the SysV shared memory
//! keys derived from the container directory's identity. One home for the shim, which
//! creates and attaches the region, and for whoever looks at it from outside (tools,
//! tests acting as a tenant).

/// The region's layout version; part of every key, so different layouts never attach
/// each other's region.
pub const LAYOUT_VERSION: u32 = 3;

/// Keys tried per directory, in order: a key held by a segment that is not this
/// directory's region is skipped for the next.
pub const PROBES: u32 = 8;

/// The identity of a container directory: device, inode and birth time (ns since the
/// epoch, 0 where the filesystem keeps none), so that a new directory reusing a deleted
/// one's inode number does not inherit its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirIdentity {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
    /// `statx` birth time in ns, or 0.
    pub born: u64,
}

/// The SysV key of probe `probe` (FNV-1a of the identity, the layout and the probe),
/// never 0 (`IPC_PRIVATE`).
pub fn key(id: DirIdentity, probe: u32) -> i32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id
        .dev
        .to_le_bytes()
        .into_iter()
        .chain(id.ino.to_le_bytes())
        .chain(id.born.to_le_bytes())
        .chain(LAYOUT_VERSION.to_le_bytes())
        .chain(probe.to_le_bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let k = ((h ^ (h >> 32)) as u32).cast_signed();
    if k == 0 { 1 } else { k }
}

/// Every key of a directory, in the order tried.
pub fn keys(id: DirIdentity) -> Vec<i32> {
    (0..PROBES).map(|p| key(id, p)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_directory_birth_and_probe_and_are_never_private() {
        let a = DirIdentity {
            dev: 1,
            ino: 2,
            born: 3,
        };
        let ka = keys(a);
        assert_eq!(ka.len(), PROBES as usize);
        let mut sorted = ka.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ka.len(), "probes collide: {ka:?}");
        assert!(ka.iter().all(|&k| k != 0));
        // Same inode, born later (a reused inode number): other keys.
        let b = DirIdentity { born: 4, ..a };
        assert!(keys(b).iter().all(|k| !ka.contains(k)));
        assert_eq!(keys(a), ka, "deterministic");
    }
}
