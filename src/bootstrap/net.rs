//! Socket plumbing shared by the root, the listeners and the ring: a poll wrapper, waits that honour
//! a deadline and the abort flag, length-prefixed frames that can be pushed forward a piece at a time
//! (so one thread can interleave a send and a receive), and a small binary codec.

use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream,
};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

/// The longest a blocked call sleeps before it looks at the abort flag and its deadline again.
pub(crate) const SLICE: Duration = Duration::from_millis(100);

/// Connection backlog of every bootstrap listener: at scale, thousands of ranks knock on one root at
/// once, and a short queue turns that burst into SYN retransmissions that cost seconds.
const BACKLOG: libc::c_int = 16384;

pub(crate) fn pollfd(fd: RawFd, events: i16) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// poll(2); `None` waits until an event.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> Result<usize> {
    let ms: libc::c_int = match timeout {
        None => -1,
        // Rounded up so that a wait of a few microseconds does not become a busy loop.
        Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int,
    };
    loop {
        // SAFETY: `fds` is an exclusively borrowed, initialised array of pollfd whose length is passed
        // with it; the kernel writes only the `revents` fields inside it.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(Error::from_io("poll", e));
        }
    }
}

/// Binds a listening TCP socket. std already sets SO_REUSEADDR on Unix, so a port freed by an
/// earlier rendezvous (NCCL_COMM_ID mode reuses one) can be bound again at once.
pub(crate) fn listen(addr: SocketAddr) -> Result<TcpListener> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| Error::from_io(format!("cannot listen on {addr}"), e))?;
    // SAFETY: the descriptor is a valid listening socket owned by `listener`; listen() on a socket
    // that already listens only changes the length of its accept queue.
    unsafe { libc::listen(listener.as_raw_fd(), BACKLOG) };
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::from_io(format!("listener on {addr}"), e))?;
    Ok(listener)
}

/// What a blocked call honours: its deadline and the communicator's abort flag.
#[derive(Clone, Copy)]
pub(crate) struct Waiter<'a> {
    pub deadline: Option<Instant>,
    pub abort: &'a AtomicBool,
}

impl<'a> Waiter<'a> {
    pub(crate) fn new(deadline: Option<Instant>, abort: &'a AtomicBool) -> Waiter<'a> {
        Waiter { deadline, abort }
    }

    /// Err once aborted or past the deadline; `what` completes "waiting for ...".
    pub(crate) fn check(&self, what: impl FnOnce() -> String) -> Result<()> {
        if self.abort.load(Ordering::Acquire) || super::init_aborted() {
            return Err(aborted(&what()));
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return crate::timeout_err!("timed out waiting for {}", what());
        }
        Ok(())
    }

    /// How long the next poll may sleep.
    pub(crate) fn slice(&self) -> Duration {
        match self.deadline {
            None => SLICE,
            Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
        }
    }
}

/// NCCL reports an aborted socket operation as an internal error; so do we.
pub(crate) fn aborted(what: &str) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!("bootstrap aborted (ncclCommAbort) while waiting for {what}"),
    )
}

fn wait_fd(fd: RawFd, events: i16, w: &Waiter<'_>) -> Result<()> {
    poll(&mut [pollfd(fd, events)], Some(w.slice())).map(|_| ())
}

/// `who` at `addr` refused a connection. Its process has probably exited; at a loopback
/// address it may also be a rank of another host listening on its own loopback interface,
/// reached here at this host's, where nobody listens.
pub(crate) fn refused(who: &str, addr: SocketAddr) -> Error {
    let hint = if addr.ip().is_loopback() {
        ", or, if it runs on another host, it listens on its loopback interface (check NCCL_SOCKET_IFNAME there)"
    } else {
        ""
    };
    Error::new(
        ErrorKind::Remote,
        format!("{who} refused the connection: its process has probably exited{hint}"),
    )
}

/// Connects with TCP_NODELAY and returns a non-blocking stream. A refused connection is retried
/// only when `retry_refused` (a root that is not up yet); otherwise the peer is gone.
pub(crate) fn connect(
    addr: SocketAddr,
    w: Waiter<'_>,
    retry_refused: bool,
    who: &str,
) -> Result<TcpStream> {
    let mut last: Option<io::Error> = None;
    loop {
        w.check(|| match &last {
            Some(e) => format!("a connection to {who} (last attempt: {e})"),
            None => format!("a connection to {who}"),
        })?;
        // connect_timeout cannot be interrupted, so it gets a bounded piece of the wait; a second
        // is long enough for any SYN round trip and short enough for ncclCommAbort.
        let piece = w
            .deadline
            .map_or(Duration::from_secs(1), |d| {
                d.saturating_duration_since(Instant::now())
            })
            .clamp(Duration::from_millis(10), Duration::from_secs(1));
        match TcpStream::connect_timeout(&addr, piece) {
            Ok(s) => {
                let setup = s.set_nodelay(true).and_then(|_| s.set_nonblocking(true));
                setup.map_err(|e| Error::from_io(format!("socket to {who}"), e))?;
                return Ok(s);
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused && retry_refused => {
                last = Some(e);
                std::thread::sleep(w.slice().min(Duration::from_millis(50)));
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                return Err(refused(who, addr));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                ) =>
            {
                last = Some(e);
            }
            Err(e) => return Err(Error::from_io(format!("connecting to {who}"), e)),
        }
    }
}

/// Reads exactly `buf.len()` bytes from a non-blocking stream.
pub(crate) fn read_exact(s: &TcpStream, buf: &mut [u8], w: Waiter<'_>, who: &str) -> Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let mut r = s;
        match r.read(&mut buf[off..]) {
            Ok(0) => return crate::remote_err!("{who} closed the connection"),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                w.check(|| format!("{who} to answer"))?;
                wait_fd(s.as_raw_fd(), libc::POLLIN, &w)?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::from_io(format!("reading from {who}"), e)),
        }
    }
    Ok(())
}

/// Writes all of `buf` to a non-blocking stream. std sends with MSG_NOSIGNAL, so a vanished peer is
/// an EPIPE error here rather than a SIGPIPE that kills the host application.
pub(crate) fn write_all(s: &TcpStream, buf: &[u8], w: Waiter<'_>, who: &str) -> Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let mut wr = s;
        match wr.write(&buf[off..]) {
            Ok(0) => return crate::remote_err!("{who} closed the connection"),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                w.check(|| format!("{who} to accept data"))?;
                wait_fd(s.as_raw_fd(), libc::POLLOUT, &w)?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::from_io(format!("writing to {who}"), e)),
        }
    }
    Ok(())
}

pub(crate) const HEADER_BYTES: usize = 24;
const FRAME_MAGIC: [u8; 2] = [0xC0, 0x4D];

/// Every message after the handshake: `kind` says what it is, `arg` and `seq` let the receiver check
/// that both sides are in the same operation, `len` bytes of payload follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u8,
    pub arg: u32,
    pub seq: u64,
    pub len: u64,
}

impl Header {
    pub(super) fn new(kind: u8, arg: u32, seq: u64, len: usize) -> Header {
        Header {
            kind,
            arg,
            seq,
            len: len as u64,
        }
    }

    pub(super) fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[..2].copy_from_slice(&FRAME_MAGIC);
        b[2] = self.kind;
        b[4..8].copy_from_slice(&self.arg.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8; HEADER_BYTES]) -> Option<Header> {
        if b[..2] != FRAME_MAGIC || b[3] != 0 {
            return None;
        }
        Some(Header {
            kind: b[2],
            arg: u32::from_le_bytes(b[4..8].try_into().ok()?),
            seq: u64::from_le_bytes(b[8..16].try_into().ok()?),
            len: u64::from_le_bytes(b[16..24].try_into().ok()?),
        })
    }
}

/// Receives one frame in as many pieces as the socket delivers, never reading past its end (what
/// follows belongs to the next frame).
pub(crate) struct FrameReader {
    head: [u8; HEADER_BYTES],
    got: usize,
    header: Option<Header>,
    body: Vec<u8>,
    limit: u64,
}

impl FrameReader {
    pub(super) fn new(limit: u64) -> FrameReader {
        FrameReader {
            head: [0; HEADER_BYTES],
            got: 0,
            header: None,
            body: Vec::new(),
            limit,
        }
    }

    /// Reads what is available; Ok(true) once the whole frame is in.
    pub(super) fn progress(&mut self, s: &TcpStream, who: &str) -> Result<bool> {
        loop {
            let dst: &mut [u8] = match self.header {
                None => &mut self.head[self.got..],
                Some(h) if self.got as u64 == h.len => return Ok(true),
                Some(_) => &mut self.body[self.got..],
            };
            let mut r = s;
            match r.read(dst) {
                Ok(0) => return crate::remote_err!("{who} closed the connection"),
                Ok(n) => {
                    self.got += n;
                    if self.header.is_none() && self.got == HEADER_BYTES {
                        let Some(h) = Header::decode(&self.head) else {
                            return crate::internal_err!(
                                "{who} sent a malformed bootstrap frame (stream out of sync)"
                            );
                        };
                        if h.len > self.limit {
                            return crate::internal_err!(
                                "{who} announced a bootstrap frame of {} bytes, above the limit of {}",
                                h.len,
                                self.limit
                            );
                        }
                        self.header = Some(h);
                        self.body = vec![0; h.len as usize];
                        self.got = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::from_io(format!("reading from {who}"), e)),
            }
        }
    }

    /// The frame, once `progress` said it is complete.
    pub(super) fn into_frame(self) -> (Header, Vec<u8>) {
        let header = self
            .header
            .expect("into_frame before the frame was complete");
        (header, self.body)
    }
}

/// Sends one frame in as many pieces as the socket accepts.
pub(crate) struct FrameWriter<'a> {
    /// The header, with the payload appended when it is small (one segment on the wire).
    small: Vec<u8>,
    big: &'a [u8],
    off: usize,
}

impl<'a> FrameWriter<'a> {
    pub(super) fn new(h: Header, body: &'a [u8]) -> FrameWriter<'a> {
        let mut small = h.encode().to_vec();
        let big = if body.len() <= 4096 {
            small.extend_from_slice(body);
            &[][..]
        } else {
            body
        };
        FrameWriter { small, big, off: 0 }
    }

    /// Writes what the socket takes; Ok(true) once everything is sent.
    pub(super) fn progress(&mut self, s: &TcpStream, who: &str) -> Result<bool> {
        let total = self.small.len() + self.big.len();
        while self.off < total {
            let chunk = if self.off < self.small.len() {
                &self.small[self.off..]
            } else {
                &self.big[self.off - self.small.len()..]
            };
            let mut wr = s;
            match wr.write(chunk) {
                Ok(0) => return crate::remote_err!("{who} closed the connection"),
                Ok(n) => self.off += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::from_io(format!("writing to {who}"), e)),
            }
        }
        Ok(true)
    }
}

pub(crate) fn send_frame(
    s: &TcpStream,
    h: Header,
    body: &[u8],
    w: Waiter<'_>,
    who: &str,
) -> Result<()> {
    let mut fw = FrameWriter::new(h, body);
    while !fw.progress(s, who)? {
        w.check(|| format!("{who} to accept data"))?;
        wait_fd(s.as_raw_fd(), libc::POLLOUT, &w)?;
    }
    Ok(())
}

pub(crate) fn recv_frame(
    s: &TcpStream,
    limit: u64,
    w: Waiter<'_>,
    who: &str,
) -> Result<(Header, Vec<u8>)> {
    let mut fr = FrameReader::new(limit);
    while !fr.progress(s, who)? {
        w.check(|| format!("{who} to answer"))?;
        wait_fd(s.as_raw_fd(), libc::POLLIN, &w)?;
    }
    Ok(fr.into_frame())
}

pub(crate) const ADDR_BYTES: usize = 23;

/// family (4 or 6), 16 address bytes, port (big-endian), IPv6 scope id.
pub(crate) fn encode_addr(a: &SocketAddr) -> [u8; ADDR_BYTES] {
    let mut b = [0u8; ADDR_BYTES];
    match a {
        SocketAddr::V4(v4) => {
            b[0] = 4;
            b[1..5].copy_from_slice(&v4.ip().octets());
        }
        SocketAddr::V6(v6) => {
            b[0] = 6;
            b[1..17].copy_from_slice(&v6.ip().octets());
            b[19..23].copy_from_slice(&v6.scope_id().to_le_bytes());
        }
    }
    b[17..19].copy_from_slice(&a.port().to_be_bytes());
    b
}

pub(crate) fn decode_addr(b: &[u8]) -> Option<SocketAddr> {
    if b.len() != ADDR_BYTES {
        return None;
    }
    let port = u16::from_be_bytes([b[17], b[18]]);
    match b[0] {
        4 => {
            let ip: [u8; 4] = b[1..5].try_into().ok()?;
            if b[5..17].iter().chain(&b[19..23]).any(|&x| x != 0) {
                return None;
            }
            Some(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip), port)))
        }
        6 => {
            let ip: [u8; 16] = b[1..17].try_into().ok()?;
            let scope = u32::from_le_bytes(b[19..23].try_into().ok()?);
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(ip),
                port,
                0,
                scope,
            )))
        }
        _ => None,
    }
}

/// The unspecified address of `ip`'s family has no use here; loopback of the same family does.
pub(crate) fn loopback_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
    }
}

/// Little-endian encoder for the bootstrap's own messages.
#[derive(Default)]
pub(crate) struct Enc(pub Vec<u8>);

impl Enc {
    pub(super) fn u8(&mut self, v: u8) -> &mut Enc {
        self.0.push(v);
        self
    }
    pub(super) fn u32(&mut self, v: u32) -> &mut Enc {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u64(&mut self, v: u64) -> &mut Enc {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn addr(&mut self, a: &SocketAddr) -> &mut Enc {
        self.0.extend_from_slice(&encode_addr(a));
        self
    }
    pub(super) fn text(&mut self, s: &str) -> &mut Enc {
        self.blob(s.as_bytes())
    }
    pub(super) fn blob(&mut self, b: &[u8]) -> &mut Enc {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
}

pub(crate) struct Dec<'a> {
    b: &'a [u8],
}

impl<'a> Dec<'a> {
    pub(super) fn new(b: &'a [u8]) -> Dec<'a> {
        Dec { b }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return crate::internal_err!("truncated bootstrap message");
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    pub(super) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub(super) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub(super) fn addr(&mut self) -> Result<SocketAddr> {
        match decode_addr(self.take(ADDR_BYTES)?) {
            Some(a) => Ok(a),
            None => crate::internal_err!("malformed address in bootstrap message"),
        }
    }
    pub(super) fn text(&mut self) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.blob()?).into_owned())
    }
    pub(super) fn blob(&mut self) -> Result<Vec<u8>> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    pub(super) fn finish(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            crate::internal_err!("{} trailing bytes in bootstrap message", self.b.len())
        }
    }
}

/// The ncclResult_t class a peer sent us, back as an ErrorKind.
pub(crate) fn kind_from_code(code: u8) -> ErrorKind {
    match code {
        1 => ErrorKind::UnhandledCuda,
        2 => ErrorKind::System,
        4 => ErrorKind::InvalidArgument,
        5 => ErrorKind::InvalidUsage,
        6 => ErrorKind::Remote,
        7 => ErrorKind::InProgress,
        8 => ErrorKind::Timeout,
        _ => ErrorKind::Internal,
    }
}
