//! Process-slot liveness from open-file-description locks: the owner of slot *i* holds
//! a lock on byte *i* of a file, which the kernel drops when the owner's open file
//! description goes away (the process died, SIGKILL included). Anyone else asks the
//! kernel whether the byte is still locked. OFD locks (unlike POSIX `F_SETLK` ones)
//! belong to the open file description, not the process, so two opens in one process
//! see each other's locks, and closing an unrelated descriptor drops nothing.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// The lock a slot's owner holds on its byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// `F_RDLCK`: owners of other slots may also hold read locks; possible on a file
    /// opened read-only (the shim locks its container directory).
    Read,
    /// `F_WRLCK`: the file must be open for writing.
    Write,
}

/// One `fcntl` OFD-lock command on byte `slot` of `fd`.
fn ofd_lock(
    fd: impl AsFd,
    slot: usize,
    cmd: libc::c_int,
    ty: libc::c_int,
) -> io::Result<libc::flock> {
    // SAFETY: flock is plain old data; all-zero is a valid value (and `l_pid` must be
    // 0 for OFD commands).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ty as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = libc::off_t::try_from(slot).unwrap_or(libc::off_t::MAX);
    fl.l_len = 1;
    // SAFETY: the descriptor is open for the call (`fd` borrows it); `fl` is a valid,
    // writable flock, which F_OFD_GETLK fills in.
    let rc = unsafe { libc::fcntl(fd.as_fd().as_raw_fd(), cmd, &mut fl) };
    if rc == 0 {
        Ok(fl)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Takes this open file description's lock on byte `slot` of `fd`, without waiting; an
/// error when another open file description holds a conflicting lock there.
pub fn hold(fd: impl AsFd, slot: usize, how: Hold) -> io::Result<()> {
    let ty = match how {
        Hold::Read => libc::F_RDLCK,
        Hold::Write => libc::F_WRLCK,
    };
    ofd_lock(fd, slot, libc::F_OFD_SETLK, ty).map(drop)
}

/// Drops this open file description's lock on byte `slot` of `fd`.
pub fn release(fd: impl AsFd, slot: usize) -> io::Result<()> {
    ofd_lock(fd, slot, libc::F_OFD_SETLK, libc::F_UNLCK).map(drop)
}

/// Whether another open file description holds a lock on byte `slot` of `fd` (the
/// slot's owner is alive: a write lock is what conflicts with either kind). When the
/// kernel cannot tell, alive: never reclaim a live process's slot.
pub fn owner_alive(fd: impl AsFd, slot: usize) -> bool {
    match ofd_lock(fd, slot, libc::F_OFD_GETLK, libc::F_WRLCK) {
        Ok(fl) => fl.l_type != libc::F_UNLCK as libc::c_short,
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use std::fs::{File, OpenOptions};
    use std::path::PathBuf;

    use super::*;

    /// A scratch file (no tempfile crate: this crate depends on libc only).
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let p = std::env::temp_dir().join(format!(
                "vgpu-sys-{name}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            File::create(&p).expect("create scratch file");
            Scratch(p)
        }

        /// A new open file description of it.
        fn open(&self) -> File {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&self.0)
                .expect("open scratch file")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn a_held_slot_is_alive_to_others_until_released_or_closed() {
        let s = Scratch::new("slots");
        let (owner, other) = (s.open(), s.open());
        assert!(!owner_alive(&other, 3));
        hold(&owner, 3, Hold::Write).expect("free slot");
        assert!(owner_alive(&other, 3));
        assert!(!owner_alive(&other, 4), "one byte per slot");
        assert!(hold(&other, 3, Hold::Write).is_err(), "a taken slot");
        release(&owner, 3).expect("release");
        assert!(!owner_alive(&other, 3));
        hold(&owner, 3, Hold::Write).expect("free again");
        drop(owner);
        assert!(
            !owner_alive(&other, 3),
            "closing the description drops its lock"
        );
    }

    #[test]
    fn read_holds_are_alive_and_do_not_exclude_each_other() {
        let s = Scratch::new("read");
        let (a, b, probe) = (s.open(), s.open(), s.open());
        hold(&a, 0, Hold::Read).expect("read lock");
        hold(&b, 0, Hold::Read).expect("a second read lock");
        assert!(owner_alive(&probe, 0));
        release(&a, 0).expect("release");
        assert!(owner_alive(&probe, 0));
        release(&b, 0).expect("release");
        assert!(!owner_alive(&probe, 0));
    }
}
