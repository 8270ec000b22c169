//! Readiness of descriptors to read (`poll(2)`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

/// Waits at most `timeout` (zero: not at all; a part of a millisecond counts as one) for
/// input on any of `fds`, and says for each whether a read would not block now: input
/// is there, the peer hung up, or the descriptor failed. An interrupted wait is made
/// again.
pub fn readable(fds: &[BorrowedFd<'_>], timeout: Duration) -> io::Result<Vec<bool>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = if timeout.is_zero() {
        0
    } else {
        i32::try_from(timeout.as_millis())
            .unwrap_or(i32::MAX)
            .max(1)
    };
    let n = libc::nfds_t::try_from(p.len())
        .map_err(|_| io::Error::other(format!("{} descriptors to poll", p.len())))?;
    loop {
        // SAFETY: `p` is an array of `n` initialised pollfd structs that outlives the call;
        // each holds a descriptor borrowed for at least as long.
        let r = unsafe { libc::poll(p.as_mut_ptr(), n, ms) };
        if r >= 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    let ready = libc::POLLIN | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL;
    Ok(p.iter().map(|x| x.revents & ready != 0).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn says_which_descriptors_have_input() {
        let (a, mut b) = UnixStream::pair().expect("pair");
        let (c, _d) = UnixStream::pair().expect("pair");
        assert_eq!(
            readable(&[a.as_fd(), c.as_fd()], Duration::ZERO).expect("poll"),
            vec![false, false]
        );
        b.write_all(b"x").expect("write");
        assert_eq!(
            readable(&[a.as_fd(), c.as_fd()], Duration::ZERO).expect("poll"),
            vec![true, false]
        );
        drop(b);
        drop(_d);
        assert_eq!(
            readable(&[a.as_fd(), c.as_fd()], Duration::from_millis(10)).expect("poll"),
            vec![true, true],
            "hung up: a read would not block"
        );
        assert!(readable(&[], Duration::ZERO).expect("none").is_empty());
    }
}
