//! The board: one page of shared memory per tenant holding its grant words (one per
//! GPU of the tenant, [`BOARD_STRIDE`] bytes apart). The daemon maps it read-write,
//! seals it against any later writable mapping, and passes its descriptor to each of
//! the tenant's processes, which can therefore only map it read-only: a tenant cannot
//! grant itself the GPU by writing its word.
//!
//! A word is a [`GrantWord`] (`generation << 1 | held`). Writers bump the generation on every change and
//! wake the futex waiters (shared, not private futexes: the waiters are other
//! processes).
//!
//! Beside it, the tenant's claim page: one page the tenant's processes map writable (it
//! is only sealed against shrinking and growing, so a tenant cannot make the daemon's
//! reads fault), where a launcher stores the grant word it launches under
//! ([`vgpu_core::sched_proto`], "Claims"; ADR 0030). Whatever a tenant writes there,
//! the daemon only compares it with the grant it revoked.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

use vgpu_core::sched_proto::{
    BOARD_BYTES, BOARD_STRIDE, CLAIM_TIME_OFFSET, EXPIRY_AT_OFFSET, EXPIRY_GEN_OFFSET,
    EXPIRY_WRITING, GrantWord,
};
use vgpu_core::suspension::{SUSPEND_OFFSET, next_word};
use vgpu_sys::futex_wake;
use vgpu_sys::shm::{SharedMap, memfd, seal_size, seal_writes_by_others};

/// A sealable one-page memfd named `name` (a name with a NUL byte: `vgpu-page`).
fn page(name: &str) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).unwrap_or_else(|_| c"vgpu-page".to_owned());
    memfd(&cname, BOARD_BYTES, true)
}

/// One tenant's board, and its claim page.
#[derive(Debug)]
pub struct Board {
    fd: OwnedFd,
    map: SharedMap,
    claims_fd: OwnedFd,
    claims: SharedMap,
}

impl Board {
    /// Creates a sealed board, every word `0` (not held, generation 0).
    pub fn new(name: &str) -> io::Result<Board> {
        let fd = page(&format!("vgpu-board-{name}"))?;
        let map = SharedMap::map(fd.as_fd(), BOARD_BYTES, true)?;
        seal_writes_by_others(fd.as_fd())?;
        let claims_fd = page(&format!("vgpu-claims-{name}"))?;
        seal_size(claims_fd.as_fd())?;
        let claims = SharedMap::map(claims_fd.as_fd(), BOARD_BYTES, false)?;
        Ok(Board {
            fd,
            map,
            claims_fd,
            claims,
        })
    }

    /// The descriptor to pass to the tenant's processes.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// The claim page's descriptor, passed beside the board's.
    pub fn claims_fd(&self) -> &OwnedFd {
        &self.claims_fd
    }

    /// Whether the claim word beside grant word `i` names grant `generation`: some
    /// process of the tenant may have launched under it. Read after the revocation's
    /// store ([`Board::set`]), a claim that names another grant means none did.
    pub fn claimed(&self, i: usize, generation: u32) -> bool {
        let w = self.claims.atomic_u32(i * BOARD_STRIDE);
        w.load(Ordering::SeqCst) == GrantWord::held(generation).pack()
    }

    /// When the claim beside grant word `i` was made (CLOCK_MONOTONIC ns; 0: not said).
    /// The tenant's own figure: read after [`Board::claimed`], and only to be believed
    /// within the grant it names.
    pub fn claimed_at(&self, i: usize) -> u64 {
        self.claims
            .atomic_u64(i * BOARD_STRIDE + CLAIM_TIME_OFFSET)
            .load(Ordering::Relaxed)
    }

    /// Word `i` (the daemon writes words `0..MAX_GPUS`; the page has
    /// [`vgpu_core::sched_proto::NEVER_HELD_WORD`] too, never written).
    pub fn word(&self, i: usize) -> &AtomicU32 {
        assert!(
            i < BOARD_BYTES / BOARD_STRIDE,
            "board word {i} out of range"
        );
        self.map.atomic_u32(i * BOARD_STRIDE)
    }

    /// Says beside word `i` that grant `generation` expires at `at_ns` (CLOCK_MONOTONIC;
    /// 0: it does not), for the tenant's shims (ADR 0036; the sequence lock of
    /// [`vgpu_core::sched_proto`], "Expiry"). The daemon is the one writer (under its
    /// lock); an unchanged expiry is not written again.
    pub fn set_expiry(&self, i: usize, generation: u32, at_ns: u64) {
        let g = self.map.atomic_u32(i * BOARD_STRIDE + EXPIRY_GEN_OFFSET);
        let at = self.map.atomic_u64(i * BOARD_STRIDE + EXPIRY_AT_OFFSET);
        if g.load(Ordering::SeqCst) == generation && at.load(Ordering::SeqCst) == at_ns {
            return;
        }
        g.store(EXPIRY_WRITING, Ordering::SeqCst);
        at.store(at_ns, Ordering::SeqCst);
        g.store(generation, Ordering::SeqCst);
    }

    /// Says in the tenant's suspension word ([`vgpu_core::suspension`]) whether it is
    /// suspended, and wakes its waiters.
    pub fn set_suspended(&self, suspended: bool) {
        let w = self.map.atomic_u32(SUSPEND_OFFSET);
        let old = w.load(Ordering::SeqCst);
        w.store(next_word(old, suspended), Ordering::SeqCst);
        futex_wake(w);
    }

    /// Sets word `i` to held/not held with generation `generation`, and wakes its waiters.
    pub fn set(&self, i: usize, generation: u32, held: bool) {
        let w = self.word(i);
        // Sequentially consistent: a revocation's store and the claim read after it pair
        // with a launcher's claim store and its read of this word (ADR 0030).
        w.store(GrantWord { generation, held }.pack(), Ordering::SeqCst);
        futex_wake(w);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn an_expiry_is_written_beside_its_word_generation_last() {
        let b = Board::new("e").expect("memfd");
        b.set(2, 7, true);
        b.set_expiry(2, 7, 123_456);
        let at = |i: usize| b.map.atomic_u64(i * BOARD_STRIDE + EXPIRY_AT_OFFSET);
        let gen_of = |i: usize| b.map.atomic_u32(i * BOARD_STRIDE + EXPIRY_GEN_OFFSET);
        assert_eq!(gen_of(2).load(Ordering::SeqCst), 7);
        assert_eq!(at(2).load(Ordering::SeqCst), 123_456);
        // The word itself and the neighbours' fields are untouched.
        assert_eq!(b.word(2).load(Ordering::SeqCst), GrantWord::held(7).pack());
        assert_eq!(at(1).load(Ordering::SeqCst), 0);
        assert_eq!(gen_of(3).load(Ordering::SeqCst), 0);
        b.set_expiry(2, 8, 0);
        assert_eq!(
            (
                gen_of(2).load(Ordering::SeqCst),
                at(2).load(Ordering::SeqCst)
            ),
            (8, 0)
        );
    }

    #[test]
    fn sealed_board_cannot_be_mapped_writable_by_others() {
        let b = Board::new("t").expect("memfd");
        b.set(3, 5, true);
        assert_eq!(b.word(3).load(Ordering::Acquire), 11);
        // SAFETY: trying a writable shared mapping of the sealed descriptor.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BOARD_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                b.fd().as_raw_fd(),
                0,
            )
        };
        assert_eq!(p, libc::MAP_FAILED, "a writable mapping must be refused");
        // SAFETY: a read-only shared mapping is allowed.
        let r = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BOARD_BYTES,
                libc::PROT_READ,
                libc::MAP_SHARED,
                b.fd().as_raw_fd(),
                0,
            )
        };
        assert_ne!(r, libc::MAP_FAILED);
        // SAFETY: offset 3 * stride inside the mapping, aligned.
        let seen = unsafe { &*r.cast::<u8>().add(3 * BOARD_STRIDE).cast::<AtomicU32>() };
        assert_eq!(seen.load(Ordering::Acquire), 11);
        b.set(3, 6, false);
        assert_eq!(seen.load(Ordering::Acquire), 12);
        // SAFETY: the read-only mapping cannot be made writable.
        let rc = unsafe { libc::mprotect(r, BOARD_BYTES, libc::PROT_READ | libc::PROT_WRITE) };
        assert_ne!(rc, 0, "mprotect to writable must be refused");
        // SAFETY: unmapping our test mapping.
        unsafe { libc::munmap(r, BOARD_BYTES) };
    }

    #[test]
    fn a_claim_counts_only_for_the_grant_it_names_and_the_page_cannot_shrink() {
        let b = Board::new("c").expect("memfd");
        let c = SharedMap::map(b.claims_fd().as_fd(), BOARD_BYTES, true).expect("writable");
        assert!(!b.claimed(2, 7), "an empty page claims nothing");
        c.atomic_u32(2 * BOARD_STRIDE)
            .store(GrantWord::held(7).pack(), Ordering::SeqCst);
        assert!(b.claimed(2, 7));
        assert!(!b.claimed(2, 8), "a claim of grant 7 is not one of grant 8");
        assert!(!b.claimed(1, 7), "nor one on another GPU's word");
        c.atomic_u32(2 * BOARD_STRIDE)
            .store(GrantWord::held(7).pack() & !1, Ordering::SeqCst);
        assert!(!b.claimed(2, 7), "a revoked word's value is no claim");
        // SAFETY: a valid descriptor; the tenant's truncation must fail.
        assert_ne!(unsafe { libc::ftruncate(b.claims_fd().as_raw_fd(), 0) }, 0);
        assert!(!b.claimed(2, 7));
    }
}
