//! One peer over TCP: a non-blocking stream carrying framed messages.
//!
//! A message is a 32-byte header (magic, flags, tag, length, scale) followed by its bytes. The
//! sender writes straight from the caller's buffer and is done when the kernel has taken every
//! byte; the receiver reads straight into the destination when the bytes need no combining,
//! otherwise through a staging buffer into the sink. Messages on a channel are handled one at
//! a time in order, so the only state the link keeps is the header of the message arriving.
//!
//! A closing end sends a close header when it is between two messages (so the peer can tell an
//! abort or a destroy from a crash), then shuts down its sending side: the peer reads every
//! message sent before the close, and only then learns that nothing more will come.

use super::Waker;
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::Scale;
use crate::transport::{
    Closing, InExpect, Link, OutMsg, Progress, RecvCursor, SendCursor, SendState, Sink,
};
use parking_lot::Mutex;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

pub(super) const HEADER: usize = 32;
const MAGIC_MSG: u32 = 0x636d_4d31; // "cmM1"
const MAGIC_CLOSE: u32 = 0x636d_4331; // "cmC1"
const FLAG_SCALE: u32 = 1;
/// Bytes one receive call takes before it lets the executor turn to other channels.
const RECV_BUDGET: usize = 4 << 20;
const STAGING: usize = 256 << 10;

/// `state`: the peer may still send; otherwise a `Closing` code it sent, or this.
const OPEN: u32 = 0;
const PEER_GONE: u32 = 9;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    magic: u32,
    flags: u32,
    tag: u64,
    len: u64,
    scale: [u8; 8],
}

impl Header {
    fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.scale);
        b
    }

    fn decode(b: &[u8; HEADER]) -> Header {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Header {
            magic: u32_at(0),
            flags: u32_at(4),
            tag: u64_at(8),
            len: u64_at(16),
            scale: b[24..32].try_into().unwrap(),
        }
    }

    fn for_message(msg: &OutMsg) -> Header {
        Header {
            magic: MAGIC_MSG,
            flags: if msg.scale.is_some() { FLAG_SCALE } else { 0 },
            tag: msg.tag,
            len: msg.len as u64,
            scale: msg.scale.map(|s| s.0).unwrap_or_default(),
        }
    }
}

/// The message arriving: its header so far, then how it is being delivered.
#[derive(Default)]
struct Arriving {
    raw: [u8; HEADER],
    got: usize,
    /// Bytes of the current chunk read but not yet given to the sink.
    staged: usize,
    staging: Vec<u8>,
}

pub(crate) struct SocketLink {
    me: usize,
    peer: usize,
    stream: TcpStream,
    waker: Arc<Waker>,
    arriving: Mutex<Arriving>,
    /// Part of a message is on the wire: a close header now would be read as its rest.
    mid_message: AtomicBool,
    /// Why the peer will send nothing more (OPEN while it may).
    state: AtomicU32,
    /// The rank the peer said it lost before closing, plus one (0: none).
    peer_lost: AtomicU32,
    closed: AtomicBool,
}

enum Io {
    Moved(usize),
    Blocked,
    Eof,
}

impl SocketLink {
    pub(super) fn new(me: usize, peer: usize, stream: TcpStream, waker: Arc<Waker>) -> SocketLink {
        SocketLink {
            me,
            peer,
            stream,
            waker,
            arriving: Mutex::new(Arriving::default()),
            mid_message: AtomicBool::new(false),
            state: AtomicU32::new(OPEN),
            peer_lost: AtomicU32::new(0),
            closed: AtomicBool::new(false),
        }
    }

    pub(super) fn fd(&self) -> i32 {
        self.stream.as_raw_fd()
    }

    fn write(&self, parts: &[&[u8]]) -> Result<Io> {
        let iov: Vec<libc::iovec> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            })
            .collect();
        if iov.is_empty() {
            return Ok(Io::Moved(0));
        }
        // SAFETY: a zeroed msghdr is valid; it points at `iov`, which outlives the call.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        mh.msg_iov = iov.as_ptr() as *mut libc::iovec;
        mh.msg_iovlen = iov.len() as _;
        loop {
            // SAFETY: the descriptor is ours; every iovec covers readable memory of the caller.
            let n =
                unsafe { libc::sendmsg(self.fd(), &mh, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if n >= 0 {
                return Ok(Io::Moved(n as usize));
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => continue,
                std::io::ErrorKind::WouldBlock => return Ok(Io::Blocked),
                _ => {
                    let why = self.reason_behind();
                    return Err(why.unwrap_or_else(|| self.broken("sending to", e)));
                }
            }
        }
    }

    fn read(&self, dst: *mut u8, len: usize) -> Result<Io> {
        loop {
            // SAFETY: the caller passes `len` writable bytes at `dst`.
            let n = unsafe { libc::recv(self.fd(), dst.cast(), len, libc::MSG_DONTWAIT) };
            if n > 0 {
                return Ok(Io::Moved(n as usize));
            }
            if n == 0 {
                return Ok(Io::Eof);
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => continue,
                std::io::ErrorKind::WouldBlock => return Ok(Io::Blocked),
                _ => return Err(self.broken("receiving from", e)),
            }
        }
    }

    /// The connection failed under us: the peer's process or host, or the link, is gone.
    fn broken(&self, what: &str, e: std::io::Error) -> Error {
        self.state
            .compare_exchange(OPEN, PEER_GONE, Ordering::SeqCst, Ordering::SeqCst)
            .ok();
        Error::lost_peer(
            self.first_lost(),
            format!(
                "{what} rank {} over TCP failed: {e} (its process exited, or its host or the link failed)",
                self.peer
            ),
        )
    }

    /// A send failed: the peer may have said why it went, in a close header that waits behind
    /// messages nobody will read now (a broadcast root never reads from its successor). Look
    /// for it, so the error names the cause rather than a broken pipe. Not while a message is
    /// being received: its reader will come to the header itself.
    fn reason_behind(&self) -> Option<Error> {
        let mut a = self.arriving.try_lock()?;
        if a.got >= HEADER {
            return None;
        }
        let mut skip = 0usize;
        let mut scratch = vec![0u8; 64 << 10];
        // Bounded: what is in the socket buffer, a few MiB at most.
        for _ in 0..1024 {
            if skip > 0 {
                let n = skip.min(scratch.len());
                match self.read(scratch.as_mut_ptr(), n) {
                    Ok(Io::Moved(k)) => skip -= k,
                    _ => return None,
                }
                continue;
            }
            match self.header(&mut a) {
                Ok(Some(h)) => {
                    skip = h.len as usize;
                    a.got = 0;
                }
                Ok(None) => return None,
                Err(e) => {
                    let told = Closing::from_code(self.state.load(Ordering::SeqCst)).is_some();
                    return told.then_some(e);
                }
            }
        }
        None
    }

    /// The peer closed its side: what it told us, or a plain end of stream.
    fn ended(&self) -> Error {
        self.state
            .compare_exchange(OPEN, PEER_GONE, Ordering::SeqCst, Ordering::SeqCst)
            .ok();
        self.gone_error()
            .unwrap_or_else(|| Error::lost_peer(self.peer, "connection ended"))
    }

    /// The rank this link's failure is due to: the one the peer said it lost, or the peer.
    fn first_lost(&self) -> usize {
        match self.peer_lost.load(Ordering::SeqCst) {
            0 => self.peer,
            r => r as usize - 1,
        }
    }

    fn gone_error(&self) -> Option<Error> {
        let state = self.state.load(Ordering::SeqCst);
        let how = Closing::from_code(state);
        let msg = match how {
            Some(how) => {
                let lost = (self.first_lost() != self.peer).then(|| self.first_lost());
                how.describe(self.peer, lost)
            }
            None if state == PEER_GONE => format!(
                "rank {} closed its TCP connection (its process exited, or its host or the link failed)",
                self.peer
            ),
            None => return None,
        };
        let mut e = Error::lost_peer(self.first_lost(), msg);
        if let Some(how) = how {
            e.kind = how.kind();
        }
        Some(e)
    }

    /// Reads the rest of the next header. Ok(None) while it is incomplete.
    fn header(&self, a: &mut Arriving) -> Result<Option<Header>> {
        while a.got < HEADER {
            let at = a.got;
            // SAFETY: the rest of `raw` is writable.
            match self.read(unsafe { a.raw.as_mut_ptr().add(at) }, HEADER - at)? {
                Io::Moved(n) => a.got += n,
                Io::Blocked => {
                    self.waker.want_read(self);
                    return Ok(None);
                }
                Io::Eof => return Err(self.ended()),
            }
        }
        let h = Header::decode(&a.raw);
        match h.magic {
            MAGIC_MSG => Ok(Some(h)),
            MAGIC_CLOSE => {
                let how = Closing::from_code(h.flags).unwrap_or(Closing::Destroyed);
                self.peer_lost.store(h.tag as u32, Ordering::SeqCst);
                self.state.store(how as u32, Ordering::SeqCst);
                Err(self.gone_error().expect("state set above"))
            }
            other => crate::internal_err!(
                "rank {} sent a malformed message header (magic {other:#x}) over TCP",
                self.peer
            ),
        }
    }
}

impl Link for SocketLink {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>> {
        let total = HEADER + msg.len;
        let mut moved = false;
        let header = Header::for_message(msg).encode();
        // SAFETY: `src` holds `len` bytes and stays valid until the send completes.
        let payload = unsafe { std::slice::from_raw_parts(msg.src, msg.len) };
        cur.started = true;
        while cur.sent < total {
            let (h, p) = if cur.sent < HEADER {
                (&header[cur.sent..], payload)
            } else {
                (&header[..0], &payload[cur.sent - HEADER..])
            };
            match self.write(&[h, p])? {
                Io::Moved(n) => {
                    cur.sent += n;
                    moved |= n > 0;
                    self.mid_message.store(cur.sent < total, Ordering::Relaxed);
                }
                Io::Blocked | Io::Eof => {
                    self.waker.want_write(self);
                    break;
                }
            }
        }
        let state = if cur.sent == total {
            SendState::Complete
        } else {
            SendState::Pending
        };
        Ok(Progress { state, moved })
    }

    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        let mut a = self.arriving.lock();
        let idle = Progress {
            state: false,
            moved: false,
        };
        let Some(h) = self.header(&mut a)? else {
            return Ok(idle);
        };
        if h.tag != expect.tag || h.len as usize != expect.len {
            return Err(Error::new(
                ErrorKind::InvalidUsage,
                format!(
                    "rank {} sent {} bytes for {} where rank {} expects {} bytes for {}: the ranks called different operations or used different counts",
                    self.peer,
                    h.len,
                    crate::transport::describe_tag(h.tag),
                    self.me,
                    expect.len,
                    crate::transport::describe_tag(expect.tag)
                ),
            ));
        }
        cur.started = true;
        let scale = (h.flags & FLAG_SCALE != 0).then_some(Scale(h.scale));
        let mut moved = false;
        let mut budget = RECV_BUDGET;
        // Bytes reach the sink in whole chunks (a multiple of any element size, or the end of
        // the message): a reduction or a scale cannot apply to part of an element.
        while cur.received < expect.len && budget > 0 {
            let chunk = (expect.len - cur.received).min(STAGING);
            let direct = sink.direct();
            let at = cur.received + a.staged;
            let io = match direct {
                // SAFETY: the destination covers the message; this piece lies inside it.
                Some(dst) => self.read(unsafe { dst.add(at) }, chunk - a.staged)?,
                None => {
                    if a.staging.len() < chunk {
                        a.staging.resize(chunk, 0);
                    }
                    let staged = a.staged;
                    // SAFETY: the staging buffer holds `chunk` bytes.
                    self.read(
                        unsafe { a.staging.as_mut_ptr().add(staged) },
                        chunk - staged,
                    )?
                }
            };
            match io {
                Io::Moved(n) => {
                    a.staged += n;
                    budget = budget.saturating_sub(n);
                    moved = true;
                    if a.staged == chunk {
                        match direct {
                            Some(_) => sink.placed(cur.received, chunk, scale)?,
                            None => sink.put(cur.received, &a.staging[..chunk], scale)?,
                        }
                        cur.received += chunk;
                        a.staged = 0;
                    }
                }
                Io::Blocked => {
                    self.waker.want_read(self);
                    break;
                }
                Io::Eof => return Err(self.ended()),
            }
        }
        let done = cur.received == expect.len;
        if done {
            a.got = 0;
            moved = true;
        }
        Ok(Progress { state: done, moved })
    }

    fn check_peer(&self) -> Result<()> {
        if let Some(e) = self.gone_error() {
            return Err(e);
        }
        // A peer that closed is known only once its close header or end of stream is read.
        // Between messages, read the next header now (recv and peek find it afterwards); in
        // the middle of one, its receiver reads on and finds out.
        if let Some(mut a) = self.arriving.try_lock() {
            if a.got < HEADER {
                self.header(&mut a)?;
                return Ok(());
            }
        }
        // In the middle of a message nothing may be consumed here, but the kernel knows
        // whether the peer hung up. Its buffered bytes can still be read: the caller's next
        // pass takes them, and it fails only if that pass finds nothing.
        let mut p = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut p, 1, 0) };
        if ready > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            return Err(Error::lost_peer(
                self.first_lost(),
                format!(
                    "rank {} closed its TCP connection in the middle of a message (its process exited, or its host or the link failed)",
                    self.peer
                ),
            ));
        }
        Ok(())
    }

    fn peek(&self) -> Result<Option<(usize, u64)>> {
        let mut a = self.arriving.lock();
        Ok(self.header(&mut a)?.map(|h| (h.len as usize, h.tag)))
    }

    fn describe(&self) -> String {
        match self.stream.peer_addr() {
            Ok(a) => format!("net/socket {a}"),
            Err(_) => "net/socket".into(),
        }
    }

    fn close(&self, how: Closing, lost: Option<usize>) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        if !self.mid_message.load(Ordering::Relaxed) {
            let h = Header {
                magic: MAGIC_CLOSE,
                flags: how as u32,
                tag: lost.map_or(0, |l| l as u64 + 1),
                len: 0,
                scale: [0; 8],
            };
            // One attempt: a full socket buffer means the peer is not reading, and the
            // shutdown below still tells it we are gone.
            let _ = self.write(&[&h.encode()]);
        }
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let h = Header {
            magic: MAGIC_MSG,
            flags: FLAG_SCALE,
            tag: 0x0102_0304_0506_0708,
            len: 12345,
            scale: [9, 8, 7, 6, 5, 4, 3, 2],
        };
        assert_eq!(Header::decode(&h.encode()), h);
    }
}
