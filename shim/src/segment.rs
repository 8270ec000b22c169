//! The shared memory behind the container's accounting region (ADR 0015): a SysV shared
//! memory segment found by a key derived from the container directory's identity. A
//! segment cannot be truncated, grown or unlinked under a process that has it attached,
//! so no tenant can make a mapper fault (a `MAP_SHARED` file could be truncated by
//! anyone, SIGBUSing every process of the container), and it needs no space in the
//! container directory's filesystem.
//!
//! This module is the one home of the segment's system calls: key derivation, create or
//! attach, the sizes, the namespace's listing (`/proc/sysvipc/shm`), removal of what is
//! dead.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

pub use vgpu_core::region_key::{DirIdentity as DirId, PROBES};

/// The identity of the container directory `dir`.
pub fn dir_id(dir: &Path) -> io::Result<DirId> {
    let m = std::fs::metadata(dir)?;
    let born = m
        .created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    Ok(DirId {
        dev: m.dev(),
        ino: m.ino(),
        born,
    })
}

/// The SysV key of probe `probe` for a directory (never `IPC_PRIVATE`).
pub fn key(id: DirId, probe: u32) -> libc::key_t {
    vgpu_core::region_key::key(id, probe)
}

/// An attached segment.
#[derive(Debug)]
pub struct Segment {
    /// The segment's id.
    pub id: libc::c_int,
    /// Its key.
    pub key: libc::key_t,
    /// Where it is attached.
    pub base: *mut u8,
    /// Whether this process created it (and must initialise it).
    pub created: bool,
    /// The mode it had when this process could not use it and restored it to 0666
    /// (a tenant's `shmctl(IPC_SET)`; see [`create_or_attach`]), None when untouched.
    pub restored_from: Option<u32>,
}

/// What `shmctl(IPC_STAT)` says of a segment: its size and how many processes have it
/// attached.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    /// Bytes.
    pub size: u64,
    /// Attached processes.
    pub attached: u64,
    /// Marked for removal (`IPC_RMID`): new processes cannot find it any more.
    pub removed: bool,
}

/// `SHM_DEST` of `<linux/shm.h>`: the segment goes when its last process detaches.
const SHM_DEST: u32 = 0o1000;

/// `shmctl(IPC_STAT)`.
pub fn stat(id: libc::c_int) -> io::Result<Stat> {
    // SAFETY: shmid_ds is plain old data; all-zero is valid.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer for IPC_STAT.
    if unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Stat {
        size: ds.shm_segsz as u64,
        attached: ds.shm_nattch as u64,
        removed: u32::from(ds.shm_perm.mode) & SHM_DEST != 0,
    })
}

/// Marks segment `id` for removal (it goes when the last process detaches).
pub fn remove(id: libc::c_int) -> io::Result<()> {
    // SAFETY: IPC_RMID takes no buffer.
    if unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Attaches segment `id` read-write (a segment marked for removal included: Linux lets a
/// process attach one that others still have attached).
pub fn attach(id: libc::c_int) -> io::Result<*mut u8> {
    // SAFETY: attaching a segment read-write at an address the kernel picks; the result
    // is checked against (void*)-1.
    let p = unsafe { libc::shmat(id, std::ptr::null(), 0) };
    if p as isize == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// Detaches a segment attached at `base`.
///
/// # Safety
/// `base` was returned by an attach of this module and nothing refers into it any more.
pub unsafe fn detach(base: *mut u8) {
    // SAFETY: per the contract.
    unsafe { libc::shmdt(base.cast()) };
}

/// Whether `e` says this process may not use a segment (its mode, its owner).
fn denied(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM))
}

/// Gives segment `id`, which this process may not use, its mode 0666 back (keeping its
/// owner): a tenant's `shmctl(IPC_SET)` changed it, and any process of the owner's or
/// creator's uid may change it back. Returns the mode it had. An error, naming the
/// segment, its mode and its owner, when this process may not (another uid, without
/// `CAP_SYS_ADMIN`).
pub fn restore_mode(id: libc::c_int) -> io::Result<u32> {
    let listed = listing().into_iter().find(|s| s.id == id);
    let (perms, uid, gid) = listed.map_or((0, 0, 0), |s| (s.perms, s.uid, s.gid));
    // SAFETY: shmid_ds is plain old data; all-zero is valid.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    ds.shm_perm.uid = uid;
    ds.shm_perm.gid = gid;
    // The field's type differs between libc targets (u16/u32): 0o666 fits both.
    ds.shm_perm.mode = 0o666;
    // SAFETY: IPC_SET reads uid, gid and mode from a valid shmid_ds.
    if unsafe { libc::shmctl(id, libc::IPC_SET, &mut ds) } != 0 {
        let e = io::Error::last_os_error();
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "shared memory segment id {id} has mode {:03o} (owner uid {uid}): this process (uid {me}) may not use it, nor give it its mode 0666 back: {e}",
                perms & 0o777
            ),
        ));
    }
    Ok(perms & 0o777)
}

/// Creates the segment of `key` with `len` bytes (zero-filled), or attaches the one that
/// exists. `Ok(None)`: a segment with that key exists but is not one of this layout's
/// size (another's, or garbage), or was removed meanwhile: the caller tries again or the
/// next key. A segment this process may not use (its mode changed by a tenant's
/// `shmctl(IPC_SET)`) is never taken for another's: its mode is restored to 0666 (said in
/// [`Segment::restored_from`]), or, when this process may not do that either, it is an
/// error (ADR 0015, amended by ADR 0042: a fresh region beside the container's would
/// split its budget).
pub fn create_or_attach(key: libc::key_t, len: usize) -> io::Result<Option<Segment>> {
    // SAFETY: shmget only allocates or looks up a segment; 0o666: every user of the
    // container shares one budget.
    let id = unsafe { libc::shmget(key, len, libc::IPC_CREAT | libc::IPC_EXCL | 0o666) };
    if id >= 0 {
        let base = match attach(id) {
            Ok(b) => b,
            Err(e) => {
                let _ = remove(id);
                return Err(e);
            }
        };
        return Ok(Some(Segment {
            id,
            key,
            base,
            created: true,
            restored_from: None,
        }));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EEXIST) {
        return Err(err);
    }
    // SAFETY: flags 0 only looks the key up (no permission is asked for).
    let id = unsafe { libc::shmget(key, 0, 0) };
    if id < 0 {
        let e = io::Error::last_os_error();
        if denied(&e) {
            return Err(e);
        }
        return Ok(None);
    }
    let mut restored_from = None;
    let st = match stat(id) {
        Err(e) if denied(&e) => {
            restored_from = Some(restore_mode(id)?);
            stat(id)
        }
        r => r,
    };
    match st {
        Ok(s) if s.size == len as u64 => {}
        // Another size: not a region of this layout (a tenant's, or garbage). Dead if
        // nobody has it attached: removed, and the caller tries the key again.
        Ok(s) => {
            if s.attached == 0 {
                let _ = remove(id);
            }
            return Ok(None);
        }
        Err(e) if denied(&e) => return Err(e),
        // Removed meanwhile.
        Err(_) => return Ok(None),
    }
    let attached = match attach(id) {
        Err(e) if denied(&e) && restored_from.is_none() => {
            restored_from = Some(restore_mode(id)?);
            attach(id)
        }
        r => r,
    };
    match attached {
        Ok(base) => Ok(Some(Segment {
            id,
            key,
            base,
            created: false,
            restored_from,
        })),
        Err(e) if denied(&e) => Err(e),
        Err(_) => Ok(None),
    }
}

/// One segment as `/proc/sysvipc/shm` lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listed {
    /// Its id.
    pub id: libc::c_int,
    /// Its permissions, with `SHM_DEST` when it is marked for removal.
    pub perms: u32,
    /// Bytes.
    pub size: u64,
    /// Attached processes.
    pub attached: u64,
    /// Its owner's uid.
    pub uid: u32,
    /// Its owner's gid.
    pub gid: u32,
}

/// The segments of the text of `/proc/sysvipc/shm` (a header line, then `key shmid perms
/// size cpid lpid nattch uid gid …`, perms in octal); lines that do not parse are
/// skipped.
pub fn parse_listing(text: &str) -> Vec<Listed> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(Listed {
                id: f.get(1)?.parse().ok()?,
                perms: u32::from_str_radix(f.get(2)?, 8).ok()?,
                size: f.get(3)?.parse().ok()?,
                attached: f.get(6)?.parse().ok()?,
                uid: f.get(7)?.parse().ok()?,
                gid: f.get(8)?.parse().ok()?,
            })
        })
        .collect()
}

/// The segments of this IPC namespace (none when `/proc/sysvipc/shm` cannot be read).
fn listing() -> Vec<Listed> {
    std::fs::read_to_string("/proc/sysvipc/shm").map_or_else(|_| Vec::new(), |t| parse_listing(&t))
}

/// The ids of the segments of `len` bytes that no process has attached (candidates for
/// removal when the directory they belonged to is gone).
pub fn unattached_of_size(len: usize) -> Vec<libc::c_int> {
    listing()
        .into_iter()
        .filter(|s| s.size == len as u64 && s.attached == 0)
        .map(|s| s.id)
        .collect()
}

/// The ids of the segments of `len` bytes marked for removal that processes still have
/// attached (a region a tenant removed under its container's processes), oldest first:
/// the kernel numbers segments in the order it creates them.
pub fn removed_in_use_of_size(len: usize) -> Vec<libc::c_int> {
    let mut ids: Vec<libc::c_int> = listing()
        .into_iter()
        .filter(|s| s.size == len as u64 && s.attached > 0 && s.perms & SHM_DEST != 0)
        .map(|s| s.id)
        .collect();
    ids.sort_unstable();
    ids
}

/// Attaches segment `id` read-only, to look at it (see [`unattached_of_size`]).
pub fn attach_read_only(id: libc::c_int) -> io::Result<*mut u8> {
    // SAFETY: attaching read-only at an address the kernel picks; the result is checked
    // against (void*)-1.
    let p = unsafe { libc::shmat(id, std::ptr::null(), libc::SHM_RDONLY) };
    if p as isize == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listing_gives_ids_permissions_sizes_and_attachments() {
        let text = "       key      shmid perms                  size  cpid  lpid nattch   uid   gid\n\
                    \x20    20817         11   666                 71680 27298 27298      1     0     0\n\
                    \x20        0         12  1666                 71680 27298 27345      2  1000   100\n\
                    garbage line\n\
                    \x20        0         x   666                 71680 1 1 0 0 0\n";
        let l = parse_listing(text);
        assert_eq!(
            l,
            vec![
                Listed {
                    id: 11,
                    perms: 0o666,
                    size: 71680,
                    attached: 1,
                    uid: 0,
                    gid: 0,
                },
                Listed {
                    id: 12,
                    perms: 0o1666,
                    size: 71680,
                    attached: 2,
                    uid: 1000,
                    gid: 100,
                },
            ]
        );
        assert!(l[1].perms & SHM_DEST != 0 && l[0].perms & SHM_DEST == 0);
    }
}
