//! One peer over TCP: one or several non-blocking streams carrying framed messages.
//!
//! A message is a 32-byte header (magic, flags, tag, length, scale) followed by its bytes. With
//! several sockets, every header travels on socket 0, and a message of `SPLIT_FROM` bytes or
//! more is cut into one part per socket (equal parts, each a multiple of `PART_ALIGN` bytes but
//! the last): part i goes on socket i, with no header of its own, since both ends derive the
//! cut from the length. Smaller messages go whole on socket 0. Every socket carries its parts in
//! message order, so the channel keeps its order; the receiver takes a message's parts from
//! whichever sockets have bytes, and only once its header has arrived.
//!
//! The sender writes straight from the caller's buffer and is done when the kernel has taken
//! every byte; the receiver reads straight into the destination when the bytes need no
//! combining, otherwise through a staging buffer per socket into the sink, always in whole
//! chunks (a multiple of any element size, or the end of the message). The link keeps how far
//! each socket got with the message being sent and the one arriving.
//!
//! A closing end sends a close header on socket 0 when it is between two messages (so the peer
//! can tell an abort or a destroy from a crash), then shuts down the sending side of every
//! socket: the peer reads every message sent before the close, and only then learns that
//! nothing more will come.

use super::notes::Notes;
use super::Waker;
use crate::error::{Error, Result};
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

/// Messages of at least this many bytes are cut across a peer's sockets.
pub(super) const SPLIT_FROM: usize = 128 << 10;
/// Every part but the last is a multiple of this many bytes.
pub(super) const PART_ALIGN: usize = 4096;

/// Where part `i` of a `len`-byte message lies (start, length) when a peer has `n` sockets.
pub(super) fn part(len: usize, n: usize, i: usize) -> (usize, usize) {
    if n <= 1 || len < SPLIT_FROM {
        return if i == 0 { (0, len) } else { (len, 0) };
    }
    let size = len.div_ceil(n).next_multiple_of(PART_ALIGN);
    let start = (i * size).min(len);
    let end = ((i + 1) * size).min(len);
    (start, end - start)
}

/// One socket's share of the message arriving.
#[derive(Default)]
struct PartIn {
    /// Bytes of the part given to the sink.
    done: usize,
    /// Bytes of the current chunk read but not yet given to the sink.
    staged: usize,
    staging: Vec<u8>,
}

/// The message arriving: its header so far (on socket 0), then each socket's part.
#[derive(Default)]
struct Arriving {
    raw: [u8; HEADER],
    got: usize,
    parts: Vec<PartIn>,
}

pub(crate) struct SocketLink {
    peer: usize,
    streams: Vec<TcpStream>,
    waker: Arc<Waker>,
    arriving: Mutex<Arriving>,
    /// Bytes each socket has taken of the message being sent (socket 0's count includes the
    /// header).
    sending: Mutex<Vec<usize>>,
    /// Part of a message is on the wire: a close header now would be read as its rest.
    mid_message: AtomicBool,
    /// Why the peer will send nothing more (OPEN while it may).
    state: AtomicU32,
    /// The rank the peer said it lost before closing, plus one (0: none).
    peer_lost: AtomicU32,
    /// The two operations the peer said it found the ranks disagreeing on (its own tag, the
    /// one it received), from its close header; and this rank's, for its own close header.
    peer_disagreed: Mutex<Option<(u64, u64)>>,
    disagreed: Mutex<Option<(u64, u64)>>,
    closed: AtomicBool,
    /// Where notes about closes in the middle of a message go and come from (see `notes`).
    notes: Option<Arc<Notes>>,
}

enum Io {
    Moved(usize),
    Blocked,
    Eof,
}

impl SocketLink {
    pub(super) fn new(peer: usize, streams: Vec<TcpStream>, waker: Arc<Waker>) -> SocketLink {
        let n = streams.len();
        assert!(n >= 1, "a link needs a socket");
        SocketLink {
            peer,
            streams,
            waker,
            arriving: Mutex::new(Arriving {
                parts: (0..n).map(|_| PartIn::default()).collect(),
                ..Default::default()
            }),
            sending: Mutex::new(vec![0; n]),
            mid_message: AtomicBool::new(false),
            state: AtomicU32::new(OPEN),
            peer_lost: AtomicU32::new(0),
            peer_disagreed: Mutex::new(None),
            disagreed: Mutex::new(None),
            closed: AtomicBool::new(false),
            notes: None,
        }
    }

    /// The link, sending and reading close notes through `notes`.
    pub(super) fn with_notes(mut self, notes: Arc<Notes>) -> SocketLink {
        self.notes = Some(notes);
        self
    }

    fn fd(&self, i: usize) -> i32 {
        self.streams[i].as_raw_fd()
    }

    fn write(&self, i: usize, parts: &[&[u8]]) -> Result<Io> {
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
                unsafe { libc::sendmsg(self.fd(i), &mh, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
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

    fn read(&self, i: usize, dst: *mut u8, len: usize) -> Result<Io> {
        loop {
            // SAFETY: the caller passes `len` writable bytes at `dst`.
            let n = unsafe { libc::recv(self.fd(i), dst.cast(), len, libc::MSG_DONTWAIT) };
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
    /// for it on socket 0, so the error names the cause rather than a broken pipe. Not while a
    /// message is being received: its reader will come to the header itself.
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
                match self.read(0, scratch.as_mut_ptr(), n) {
                    Ok(Io::Moved(k)) => skip -= k,
                    _ => return None,
                }
                continue;
            }
            match self.header(&mut a) {
                Ok(Some(h)) => {
                    // Socket 0 carries only the first part of a message that was cut.
                    skip = part(h.len as usize, self.streams.len(), 0).1;
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

    /// The peer hung up in the middle of a message: what it said on the side, if it did.
    fn ended_with_note(&self) -> Option<Error> {
        self.notes.as_ref()?.from(self.peer)?;
        Some(self.ended())
    }

    /// The rank this link's failure is due to: the one the peer said it lost, or the peer.
    fn first_lost(&self) -> usize {
        match self.peer_lost.load(Ordering::SeqCst) {
            0 => self.peer,
            r => r as usize - 1,
        }
    }

    fn gone_error(&self) -> Option<Error> {
        if self.state.load(Ordering::SeqCst) == PEER_GONE {
            // The peer closed in the middle of a message: it said how on the side.
            if let Some((how, lost)) = self.notes.as_ref().and_then(|n| n.from(self.peer)) {
                self.peer_lost
                    .store(lost.map_or(0, |l| l as u32 + 1), Ordering::SeqCst);
                self.state.store(how as u32, Ordering::SeqCst);
            }
        }
        let state = self.state.load(Ordering::SeqCst);
        let how = Closing::from_code(state);
        let msg = match how {
            Some(how) => {
                let lost = (self.first_lost() != self.peer).then(|| self.first_lost());
                how.describe_with(self.peer, lost, *self.peer_disagreed.lock())
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
            e.disagreed = *self.peer_disagreed.lock();
        }
        Some(e)
    }

    /// Reads the rest of the next header from socket 0. Ok(None) while it is incomplete.
    fn header(&self, a: &mut Arriving) -> Result<Option<Header>> {
        while a.got < HEADER {
            let at = a.got;
            // SAFETY: the rest of `raw` is writable.
            match self.read(0, unsafe { a.raw.as_mut_ptr().add(at) }, HEADER - at)? {
                Io::Moved(n) => a.got += n,
                Io::Blocked => {
                    self.waker.want_read(self.fd(0));
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
                if how == Closing::Disagreed && h.len != 0 {
                    *self.peer_disagreed.lock() = Some((h.len, u64::from_le_bytes(h.scale)));
                }
                self.state.store(how as u32, Ordering::SeqCst);
                Err(self.gone_error().expect("state set above"))
            }
            other => crate::internal_err!(
                "rank {} sent a malformed message header (magic {other:#x}) over TCP",
                self.peer
            ),
        }
    }

    /// Socket `i` hung up. Bytes it buffered before may still be unread: the executor's next
    /// pass takes them, and it fails only if that pass finds nothing; and a rank that failed
    /// because of another loss names this one too (`with_other_losses`), so a peer killed
    /// while its bytes wait unread here is still named.
    /// Bytes socket `i` holds that were not read yet (0 where the kernel does not say).
    fn unread(&self, i: usize) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int through the pointer, which is valid.
        let r = unsafe { libc::ioctl(self.fd(i), libc::FIONREAD, &mut n) };
        if r == 0 {
            n.max(0) as usize
        } else {
            0
        }
    }

    fn hung_up(&self, i: usize) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd(i),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut p, 1, 0) };
        ready > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

impl Link for SocketLink {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>> {
        let n = self.streams.len();
        let mut sent = self.sending.lock();
        if !cur.started {
            sent.iter_mut().for_each(|s| *s = 0);
            cur.started = true;
        }
        let header = Header::for_message(msg).encode();
        // SAFETY: `src` holds `len` bytes and stays valid until the send completes.
        let payload = unsafe { std::slice::from_raw_parts(msg.src, msg.len) };
        let mut moved = false;
        for (i, done) in sent.iter_mut().enumerate() {
            let (start, len) = part(msg.len, n, i);
            let head = if i == 0 { HEADER } else { 0 };
            let mine = &payload[start..start + len];
            while *done < head + len {
                let (h, p) = if *done < head {
                    (&header[*done..], mine)
                } else {
                    (&header[..0], &mine[*done - head..])
                };
                match self.write(i, &[h, p])? {
                    Io::Moved(k) => {
                        *done += k;
                        moved |= k > 0;
                    }
                    Io::Blocked | Io::Eof => {
                        self.waker.want_write(self.fd(i));
                        break;
                    }
                }
            }
        }
        cur.sent = sent.iter().sum();
        let total = HEADER + msg.len;
        self.mid_message
            .store(cur.sent > 0 && cur.sent < total, Ordering::Relaxed);
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
        let mut guard = self.arriving.lock();
        let a = &mut *guard;
        let idle = Progress {
            state: false,
            moved: false,
        };
        let Some(h) = self.header(a)? else {
            return Ok(idle);
        };
        if h.tag != expect.tag || h.len as usize != expect.len {
            return Err(crate::transport::mismatch_error(
                self.peer, h.len, h.tag, expect,
            ));
        }
        cur.started = true;
        let scale = (h.flags & FLAG_SCALE != 0).then_some(Scale(h.scale));
        let n = self.streams.len();
        let mut moved = false;
        let mut budget = RECV_BUDGET;
        // Bytes reach the sink in whole chunks (a multiple of any element size, or the end of
        // the message): a reduction or a scale cannot apply to part of an element. Parts start
        // at multiples of PART_ALIGN, so their chunks do too.
        while cur.received < expect.len && budget > 0 {
            let mut any = false;
            for i in 0..n {
                let (start, len) = part(expect.len, n, i);
                let p = &mut a.parts[i];
                if p.done == len {
                    continue;
                }
                let chunk = (len - p.done).min(STAGING);
                let direct = sink.direct();
                let at = start + p.done;
                let io = match direct {
                    Some(dst) => {
                        // SAFETY: the destination covers the message; this piece lies inside it.
                        self.read(i, unsafe { dst.add(at + p.staged) }, chunk - p.staged)?
                    }
                    None => {
                        if p.staging.len() < chunk {
                            p.staging.resize(chunk, 0);
                        }
                        // SAFETY: the staging buffer holds `chunk` bytes.
                        let to = unsafe { p.staging.as_mut_ptr().add(p.staged) };
                        self.read(i, to, chunk - p.staged)?
                    }
                };
                match io {
                    Io::Moved(k) => {
                        p.staged += k;
                        budget = budget.saturating_sub(k);
                        moved = true;
                        any = true;
                        if p.staged == chunk {
                            match direct {
                                Some(_) => sink.placed(at, chunk, scale)?,
                                None => sink.put(at, &p.staging[..chunk], scale)?,
                            }
                            p.done += chunk;
                            p.staged = 0;
                            cur.received += chunk;
                        }
                    }
                    Io::Blocked => {}
                    Io::Eof => return Err(self.ended()),
                }
            }
            if !any {
                // Nothing on any socket that owes bytes: ring when one of them has some.
                for i in 0..n {
                    if a.parts[i].done < part(expect.len, n, i).1 {
                        self.waker.want_read(self.fd(i));
                    }
                }
                break;
            }
        }
        let done = cur.received == expect.len;
        if done {
            a.got = 0;
            for p in a.parts.iter_mut() {
                p.done = 0;
                p.staged = 0;
            }
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
        let Some(mut a) = self.arriving.try_lock() else {
            return Ok(());
        };
        if a.got < HEADER {
            self.header(&mut a)?;
            return Ok(());
        }
        // In the middle of a message nothing may be consumed here, but the kernel knows
        // whether the peer hung up. Only a socket that still owes bytes of this message and
        // holds none unread tells anything (the peer may close once the kernel took its last
        // bytes, one socket can drain before another, and bytes still queued are read first).
        let len = Header::decode(&a.raw).len as usize;
        let n = self.streams.len();
        for i in 0..n {
            if a.parts[i].done < part(len, n, i).1 && self.hung_up(i) && self.unread(i) == 0 {
                // The message can never be completed: the peer is gone.
                if let Some(e) = self.ended_with_note() {
                    return Err(e);
                }
                return Err(Error::lost_peer(
                    self.first_lost(),
                    format!(
                        "rank {} closed its TCP connection in the middle of a message (its process exited, or its host or the link failed)",
                        self.peer
                    ),
                ));
            }
        }
        Ok(())
    }

    fn hung_up_reason(&self) -> Option<String> {
        (0..self.streams.len()).any(|i| self.hung_up(i)).then(|| {
            format!(
                "rank {} hung up its TCP connection (its process exited, or its host or the link failed)",
                self.peer
            )
        })
    }

    fn peek(&self) -> Result<Option<(usize, u64)>> {
        let mut a = self.arriving.lock();
        Ok(self.header(&mut a)?.map(|h| (h.len as usize, h.tag)))
    }

    fn describe(&self) -> String {
        let n = self.streams.len();
        let sockets = if n > 1 {
            format!(" ({n} sockets)")
        } else {
            String::new()
        };
        match self.streams[0].peer_addr() {
            Ok(a) => format!("net/socket {a}{sockets}"),
            Err(_) => format!("net/socket{sockets}"),
        }
    }

    fn tell_disagreement(&self, ours: u64, theirs: u64) {
        self.disagreed.lock().get_or_insert((ours, theirs));
    }

    fn close(&self, how: Closing, lost: Option<usize>) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        if !self.mid_message.load(Ordering::Relaxed) {
            let (ours, theirs) = match how {
                Closing::Disagreed => self.disagreed.lock().unwrap_or_default(),
                _ => (0, 0),
            };
            let h = Header {
                magic: MAGIC_CLOSE,
                flags: how as u32,
                tag: lost.map_or(0, |l| l as u64 + 1),
                len: ours,
                scale: theirs.to_le_bytes(),
            };
            // One attempt: a full socket buffer means the peer is not reading, and the
            // shutdown below still tells it we are gone.
            let _ = self.write(0, &[&h.encode()]);
        } else if let Some(notes) = &self.notes {
            notes.tell(self.peer, how, lost);
        }
        for s in &self.streams {
            let _ = s.shutdown(Shutdown::Write);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// The header of a plain message of `len` bytes.
    fn a_message_of(len: u64) -> Header {
        Header {
            magic: MAGIC_MSG,
            flags: 0,
            tag: 7,
            len,
            scale: [0; 8],
        }
    }

    /// A peer that sent a message and then went away: its end of stream waits behind the
    /// message, so `check_peer` still finds the peer alive, but the hang-up is already known
    /// to the kernel and `hung_up_reason` names it (an error about another rank then says
    /// this one is gone too).
    #[test]
    fn a_hang_up_behind_unread_bytes_is_seen() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut theirs = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        ours.set_nonblocking(true).unwrap();
        let link = SocketLink::new(1, vec![ours], Arc::new(Waker::direct().unwrap()));
        assert!(link.hung_up_reason().is_none(), "nothing happened yet");
        let h = a_message_of(64);
        std::io::Write::write_all(&mut theirs, &h.encode()).unwrap();
        std::io::Write::write_all(&mut theirs, &[5u8; 16]).unwrap();
        drop(theirs);
        let deadline = Instant::now() + Duration::from_secs(10);
        let why = loop {
            if let Some(why) = link.hung_up_reason() {
                break why;
            }
            assert!(Instant::now() < deadline, "the hang-up never showed");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(why.contains("rank 1"), "{why}");
        assert!(
            link.check_peer().is_ok(),
            "the message's bytes still come first"
        );
    }

    /// A link closed in the middle of a message cannot write its close header; its note comes
    /// through the peer's connection service, and the peer reports the rank it named, not
    /// only that the connection ended.
    #[test]
    fn a_close_in_the_middle_of_a_message_is_explained_on_the_side() {
        use crate::bootstrap::{tests::init_all, Purpose};
        let id = crate::bootstrap::new_unique_id().unwrap();
        let b = init_all(std::slice::from_ref(&id), 3);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let theirs = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        for s in [&ours, &theirs] {
            s.set_nonblocking(true).unwrap();
        }
        let waker = Arc::new(Waker::direct().unwrap());
        let notes = [0, 1].map(|r| Arc::new(Notes::new(b[r].dialer())));
        let to = notes[1].clone();
        let _route = b[1].route(Purpose::Note, Box::new(move |c, s| to.deliver(c, s)));
        let sender = SocketLink::new(1, vec![theirs], waker.clone()).with_notes(notes[0].clone());
        let receiver = SocketLink::new(0, vec![ours], waker).with_notes(notes[1].clone());
        let h = a_message_of(64);
        assert!(matches!(
            sender.write(0, &[&h.encode()]),
            Ok(Io::Moved(HEADER))
        ));
        sender.mid_message.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while receiver.arriving.lock().got < HEADER {
            receiver.check_peer().unwrap();
            assert!(Instant::now() < deadline, "the header never came");
        }
        sender.close(Closing::Failed, Some(2));
        let e = loop {
            if let Err(e) = receiver.check_peer() {
                break e;
            }
            assert!(Instant::now() < deadline, "the close never showed");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(
            e.msg.contains("rank 0 failed after it lost rank 2"),
            "{}",
            e.msg
        );
        assert_eq!(e.lost, Some(2), "{}", e.msg);
    }

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

    #[test]
    fn parts_cover_a_message_once_in_aligned_pieces() {
        for n in [1, 2, 3, 4, 7, 64] {
            for len in [
                0,
                1,
                SPLIT_FROM - 1,
                SPLIT_FROM,
                300_001,
                (1 << 20) + 12,
                1 << 26,
            ] {
                let mut next = 0;
                for i in 0..n {
                    let (start, l) = part(len, n, i);
                    assert_eq!(start, next.min(len), "n={n} len={len} part {i}");
                    if start + l < len {
                        assert_eq!(l % PART_ALIGN, 0, "n={n} len={len} part {i}");
                    }
                    next = start + l;
                }
                assert_eq!(next, len, "n={n} len={len}");
                let cut = (0..n).filter(|&i| part(len, n, i).1 > 0).count();
                if n > 1 && len >= SPLIT_FROM {
                    assert!(cut > 1, "n={n} len={len} went on {cut} socket");
                } else {
                    assert!(cut <= 1, "n={n} len={len} went on {cut} sockets");
                }
            }
        }
    }
}
