//! Socket I/O with the daemon (the gate thread's, and the hooks' admission), each call bounded: a connect that never
//! waits for a full backlog, a readiness wait with a timeout, a receive that takes the
//! board's and the claim page's descriptors (`SCM_RIGHTS`).

use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// `s` cut to at most `max` bytes (at a character boundary).
pub(super) fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Connects to the unix socket `path` without waiting: a daemon whose listen backlog is
/// full (frozen, overwhelmed) is an error now, not a block. The stream returned blocks.
pub(crate) fn connect_nonblocking(path: &std::path::Path) -> io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: a zeroed sockaddr_un is valid; the family and path are set below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = libc::c_char::from_ne_bytes([*b]);
    }
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor this function owns from here on.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid sockaddr_un of the size given.
    let r = unsafe {
        libc::connect(
            fd,
            (&raw const addr).cast::<libc::sockaddr>(),
            u32::try_from(size_of::<libc::sockaddr_un>()).unwrap_or(u32::MAX),
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(if e.kind() == io::ErrorKind::WouldBlock {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "the daemon's socket accepts no connection (backlog full)",
            )
        } else {
            e
        });
    }
    let s = UnixStream::from(owned);
    s.set_nonblocking(false)?;
    Ok(s)
}

/// Waits at most `timeout` for `fd` to be readable (or closed); false: timed out.
pub(crate) fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let ready = vgpu_sys::poll::readable(&[fd], timeout.max(Duration::from_millis(1)))?;
    Ok(ready.first().copied().unwrap_or(false))
}

/// Most descriptors kept from one message (the board and the claim page); any more are
/// closed.
pub(super) const MAX_FDS: usize = 2;

/// Receives bytes and at most [`MAX_FDS`] descriptors (`SCM_RIGHTS`), in the order sent.
pub(super) fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: a zeroed msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&cbuf);
    // SAFETY: valid socket and buffers that outlive the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`; each
    // SCM_RIGHTS message holds as many descriptors as its length says.
    unsafe {
        let header = libc::CMSG_LEN(0) as usize;
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*c).cmsg_len as usize).saturating_sub(header) / size_of::<RawFd>();
                let at = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(at.add(i));
                    if raw >= 0 && fds.len() < MAX_FDS {
                        fds.push(OwnedFd::from_raw_fd(raw));
                    } else if raw >= 0 {
                        libc::close(raw);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, fds))
}
