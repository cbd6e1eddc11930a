//! Passing segment fds over the socket with SCM_RIGHTS: the daemon sends them (HELLO's and
//! SEGMENT's replies; tokio-uring's UnixStream has no sendmsg with control messages, so those
//! replies go out through a plain `sendmsg(2)` (rustix) on the same socket, every other byte
//! through io_uring), the clients receive them.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Most fds one message carries (one per host segment).
pub const MAX_FDS: usize = 64;

/// Sends `bytes` with `fds` attached to them, without ever blocking: a full socket buffer is
/// `ErrorKind::WouldBlock` (the daemon then waits for writability on its event loop; a blocking
/// send there would freeze every client behind one that does not read). Returns how many bytes
/// went out (the fds ride with the first byte; the caller writes any remainder normally).
pub fn send_with_fds(
    socket: impl AsFd,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<usize> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len().max(1)))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other("too many fds for one message"));
    }
    loop {
        match rustix::net::sendmsg(
            &socket,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
        ) {
            Ok(n) => return Ok(n),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives into `buf`, collecting any fds that arrive. Returns the bytes read.
pub fn recv_with_fds(
    socket: impl AsFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> std::io::Result<usize> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let n = loop {
        match rustix::net::recvmsg(
            &socket,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => break r.bytes,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = msg {
            fds.extend(received);
        }
    }
    Ok(n)
}
