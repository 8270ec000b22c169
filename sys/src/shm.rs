//! Shared memory mapped from a descriptor: an anonymous sized file (`memfd_create(2)` +
//! `ftruncate(2)`), its seals, and a shared mapping of it (or of any file) that unmaps
//! itself when dropped. The daemon's grant board, cuda-sim's node state and cuda-sim's
//! VMM allocations are built from these.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// An anonymous file of `len` bytes, zero-filled, closed on exec; `sealable` lets
/// [`seal_writes_by_others`] seal it later.
pub fn memfd(name: &CStr, len: usize, sealable: bool) -> io::Result<OwnedFd> {
    let flags = libc::MFD_CLOEXEC | if sealable { libc::MFD_ALLOW_SEALING } else { 0 };
    // SAFETY: a valid NUL-terminated name; flags are plain constants.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len =
        libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a valid descriptor and a non-negative length.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Seals a [`memfd`] made `sealable` against shrinking, growing and any *later* writable
/// mapping: mappings made before stay writable, every one made after is read-only.
pub fn seal_writes_by_others(fd: BorrowedFd<'_>) -> io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE;
    // SAFETY: a valid descriptor; sealing changes no memory of this process.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Seals a [`memfd`] made `sealable` against shrinking, growing and further seals, and
/// leaves it writable: a page others write (a tenant's claim page) that they cannot
/// shrink under the mapper, whose reads past the new end would raise SIGBUS.
pub fn seal_size(fd: BorrowedFd<'_>) -> io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: a valid descriptor; sealing changes no memory of this process.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `fd` is at least `len` bytes long and sealed against shrinking: a mapping of
/// its first `len` bytes then never faults, whoever else holds the file (a descriptor
/// a peer sent, which could otherwise be truncated under the mapping).
pub fn cannot_shrink_below(fd: BorrowedFd<'_>, len: usize) -> bool {
    // SAFETY: a zeroed stat is a valid out-parameter for fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a stat buffer that outlives the call.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    // SAFETY: a valid descriptor; F_GET_SEALS only reads.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    u64::try_from(st.st_size).is_ok_and(|n| n >= len as u64)
        && seals >= 0
        && seals & libc::F_SEAL_SHRINK != 0
}

/// A shared mapping of the first `len` bytes of a file, at an address the kernel chose;
/// unmapped on drop.
#[derive(Debug)]
pub struct SharedMap {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory shared with other processes anyway; this type hands
// out only raw pointers and atomics, so moving or sharing it between threads adds nothing.
unsafe impl Send for SharedMap {}
// SAFETY: as above.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// Maps `len` bytes of `fd` from offset 0, shared, readable, and writable if `writable`.
    pub fn map(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<SharedMap> {
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a new mapping at a kernel-chosen address (no existing memory is
        // replaced); the result is checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(SharedMap { base, len })
    }

    /// The first byte (page aligned); valid for [`len`](Self::len) bytes while `self` lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// The mapped length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never, for a successful [`map`](Self::map)).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of a `size`-byte word at byte `offset`. Panics when `offset` is not
    /// `size`-aligned or the word is out of range.
    fn word_at(&self, offset: usize, size: usize) -> *mut u8 {
        assert!(
            offset.is_multiple_of(size) && offset.checked_add(size).is_some_and(|e| e <= self.len),
            "word at byte {offset} out of a {}-byte mapping",
            self.len
        );
        // SAFETY: `offset + size <= len`: inside the mapping.
        unsafe { self.base.as_ptr().add(offset) }
    }

    /// The `u64` word at byte `offset`, atomically accessed (as [`SharedMap::atomic_u32`]).
    /// Panics when `offset` is not 8-aligned or the word is out of range.
    pub fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: in range and 8-aligned (the base is page aligned), inside a mapping that
        // lives as long as the returned reference; all access is atomic.
        unsafe { &*self.word_at(offset, 8).cast::<AtomicU64>() }
    }

    /// The `u32` word at byte `offset`, atomically accessed (the mapping is shared with
    /// other processes). Panics when `offset` is not 4-aligned or the word is out of range.
    pub fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: in range and 4-aligned (the base is page aligned), inside a mapping that
        // lives as long as the returned reference; all access is atomic.
        unsafe { &*self.word_at(offset, 4).cast::<AtomicU32>() }
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map`, once; no reference handed
        // out outlives `self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_sealed_memfd_is_shared_and_read_only_to_later_mappers() {
        let fd = memfd(c"vgpu-sys-test", 4096, true).expect("memfd");
        let w = SharedMap::map(fd.as_fd(), 4096, true).expect("writable before sealing");
        seal_writes_by_others(fd.as_fd()).expect("seal");
        assert!(SharedMap::map(fd.as_fd(), 4096, true).is_err());
        let r = SharedMap::map(fd.as_fd(), 4096, false).expect("read-only after sealing");
        w.atomic_u32(8).store(7, Ordering::Release);
        assert_eq!(r.atomic_u32(8).load(Ordering::Acquire), 7);
        assert_eq!(r.len(), 4096);
    }

    #[test]
    fn a_size_sealed_memfd_stays_writable_and_cannot_shrink() {
        let fd = memfd(c"vgpu-sys-test", 4096, true).expect("memfd");
        seal_size(fd.as_fd()).expect("seal");
        let w = SharedMap::map(fd.as_fd(), 4096, true).expect("still writable");
        w.atomic_u32(0).store(3, Ordering::SeqCst);
        // SAFETY: a valid descriptor; the call is expected to fail.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
        // SAFETY: as above.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 8192) }, 0);
        assert_eq!(w.atomic_u32(0).load(Ordering::SeqCst), 3);
    }

    #[test]
    fn only_a_long_enough_page_sealed_against_shrinking_is_sound() {
        let fd = memfd(c"vgpu-sys-test", 4096, true).expect("memfd");
        assert!(!cannot_shrink_below(fd.as_fd(), 4096), "not sealed yet");
        seal_size(fd.as_fd()).expect("seal");
        assert!(cannot_shrink_below(fd.as_fd(), 4096));
        assert!(!cannot_shrink_below(fd.as_fd(), 8192), "too short");
        let short = memfd(c"vgpu-sys-test", 100, true).expect("memfd");
        seal_writes_by_others(short.as_fd()).expect("seal");
        assert!(!cannot_shrink_below(short.as_fd(), 4096));
    }

    #[test]
    #[should_panic(expected = "out of a 4096-byte mapping")]
    fn a_word_past_the_end_is_refused() {
        let fd = memfd(c"vgpu-sys-test", 4096, false).expect("memfd");
        let m = SharedMap::map(fd.as_fd(), 4096, true).expect("map");
        m.atomic_u32(4096);
    }

    #[test]
    fn u64_words_are_shared_and_misaligned_or_past_the_end_ones_refused() {
        let fd = memfd(c"vgpu-sys-test", 4096, false).expect("memfd");
        let m = SharedMap::map(fd.as_fd(), 4096, true).expect("map");
        let r = SharedMap::map(fd.as_fd(), 4096, false).expect("map");
        m.atomic_u64(4088).store(u64::MAX - 1, Ordering::Release);
        assert_eq!(r.atomic_u64(4088).load(Ordering::Acquire), u64::MAX - 1);
        for bad in [4, 4092, 4096, usize::MAX - 3] {
            let refused = std::panic::catch_unwind(|| {
                m.atomic_u64(bad);
            });
            assert!(refused.is_err(), "a u64 word at byte {bad}");
        }
    }
}
