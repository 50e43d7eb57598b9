//! One-sided operations between hosts: active messages over TCP, applied at the target by a
//! thread of the library (the target's application does not call in). Each rank that has
//! windows and peers on other hosts listens; an origin opens one authenticated connection per
//! target and sends frames in program order, so a signal is applied after the puts before it.
//! Puts and signals are not answered; gets, atomics, pad updates and flushes are, and a flush
//! is answered only after everything sent before it was applied.

use super::ctl::Ctl;
use super::ops::{atomic_at, check_range};
use super::registry::window_by_handle;
use super::{Reach, Window};
use crate::bootstrap::auth;
use crate::error::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub(super) const OP_PUT: u32 = 1;
pub(super) const OP_GET: u32 = 2;
pub(super) const OP_FETCH_ADD: u32 = 3;
pub(super) const OP_CAS: u32 = 4;
pub(super) const OP_SIGNAL: u32 = 5;
pub(super) const OP_PAD_CAS: u32 = 6;
pub(super) const OP_FLUSH: u32 = 7;
/// With OP_PUT: count one NCCL signal once the data is in place.
pub(super) const FLAG_SIGNAL: u32 = 1;

const FRAME: usize = 48;

/// One request: `win` is the target's window handle; for OP_PAD_CAS `off` is the channel.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Frame {
    pub op: u32,
    pub flags: u32,
    pub win: u64,
    pub off: u64,
    pub len: u64,
    pub a: u64,
    pub b: u64,
}

impl Frame {
    fn encode(&self) -> [u8; FRAME] {
        let mut out = [0u8; FRAME];
        out[0..4].copy_from_slice(&self.op.to_le_bytes());
        out[4..8].copy_from_slice(&self.flags.to_le_bytes());
        for (i, v) in [self.win, self.off, self.len, self.a, self.b]
            .iter()
            .enumerate()
        {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn decode(b: &[u8; FRAME]) -> Frame {
        let u64_at = |i: usize| u64::from_le_bytes(b[8 + 8 * i..16 + 8 * i].try_into().unwrap());
        Frame {
            op: u32::from_le_bytes(b[0..4].try_into().unwrap()),
            flags: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            win: u64_at(0),
            off: u64_at(1),
            len: u64_at(2),
            a: u64_at(3),
            b: u64_at(4),
        }
    }
}

fn context(tag: u64, from: usize, to: usize) -> Vec<u8> {
    format!("comm window {tag:016x} {from}->{to}").into_bytes()
}

/// The network side of a rank's windows: its listener's address, and its connections to the
/// targets on other hosts.
pub(super) struct NetSide {
    pub rank: usize,
    pub tag: u64,
    secret: [u8; 32],
    pub addrs: Vec<Option<SocketAddr>>,
    conns: Vec<Mutex<Option<TcpStream>>>,
    /// Set when a peer's connection to us broke: waits for it fail at once.
    pub lost: Arc<Vec<AtomicBool>>,
    timeout: Option<Duration>,
}

/// Starts listening on `ip` for peers' connections to this rank (tag `tag`), applying their
/// operations to this rank's windows and control segment `ctl`, until `stop` is set.
pub(super) fn listen(
    ip: std::net::IpAddr,
    tag: u64,
    rank: usize,
    nranks: usize,
    secret: [u8; 32],
    ctl: Arc<Ctl>,
    stop: Arc<AtomicBool>,
) -> Result<(SocketAddr, Arc<Vec<AtomicBool>>)> {
    let l = TcpListener::bind(SocketAddr::new(ip, 0))
        .map_err(|e| Error::from_io("bind the window listener", e))?;
    let addr = l
        .local_addr()
        .map_err(|e| Error::from_io("the window listener's address", e))?;
    l.set_nonblocking(true)
        .map_err(|e| Error::from_io("the window listener", e))?;
    let lost: Arc<Vec<AtomicBool>> =
        Arc::new((0..nranks).map(|_| AtomicBool::new(false)).collect());
    let lost2 = lost.clone();
    std::thread::Builder::new()
        .name(format!("comm-win-{rank}"))
        .spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let s = match l.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        let mut p = libc::pollfd {
                            fd: std::os::fd::AsRawFd::as_raw_fd(&l),
                            events: libc::POLLIN,
                            revents: 0,
                        };
                        // SAFETY: one valid pollfd; a bounded wait so that `stop` is seen.
                        unsafe { libc::poll(&mut p, 1, 200) };
                        continue;
                    }
                    Err(_) => continue,
                };
                let (ctl, lost) = (ctl.clone(), lost2.clone());
                let _ = std::thread::Builder::new()
                    .name(format!("comm-win-{rank}-conn"))
                    .spawn(move || {
                        let _ = s.set_nonblocking(false);
                        if let Err(e) = serve(s, tag, rank, nranks, &secret, &ctl, &lost) {
                            crate::warn!("window connection: {}", e.msg);
                        }
                    });
            }
        })
        .map_err(|e| Error::from_io("start the window listener thread", e))?;
    Ok((addr, lost))
}

fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::from_io(what, e)
}

/// One origin's connection: authenticate, then apply its frames until it closes.
fn serve(
    mut s: TcpStream,
    tag: u64,
    me: usize,
    nranks: usize,
    secret: &[u8; 32],
    ctl: &Ctl,
    lost: &[AtomicBool],
) -> Result<()> {
    s.set_nodelay(true).map_err(io("window connection"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io("window connection"))?;
    let mut hello = [0u8; 4];
    s.read_exact(&mut hello).map_err(io("window hello"))?;
    let from = u32::from_le_bytes(hello) as usize;
    if from >= nranks {
        return crate::invalid_usage!("window connection claims rank {from} of {nranks}");
    }
    auth::server(&mut s, secret, &context(tag, from, me))?;
    s.set_read_timeout(None).map_err(io("window connection"))?;
    let mut sticky: Option<Error> = None;
    let r = (|| -> Result<()> {
        let mut head = [0u8; FRAME];
        loop {
            match s.read_exact(&mut head) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(Error::from_io("read a window request", e)),
            }
            let f = Frame::decode(&head);
            apply(&mut s, &f, tag, me, from, ctl, &mut sticky)?;
        }
    })();
    // A clean close after the origin destroyed its communicator, or a broken connection: either
    // way no more signals come from that rank.
    lost[from].store(true, Ordering::SeqCst);
    ctl.ring();
    r
}

fn target(win: u64, tag: u64, me: usize) -> Result<Arc<Window>> {
    match window_by_handle(win as usize) {
        Some(w) if w.comm == (tag, me) => Ok(w),
        _ => crate::invalid_usage!("window {win:#x} is no longer registered at rank {me}"),
    }
}

/// The window a put or get names and the address of its range in this rank's part, checked.
fn own_range(f: &Frame, tag: u64, me: usize) -> Result<(Arc<Window>, usize)> {
    let w = target(f.win, tag, me)?;
    check_range(&w.peers[me], f.off as usize, f.len as usize, me)?;
    match w.peers[me].data {
        Reach::Direct(base) => Ok((w.clone(), base + f.off as usize)),
        _ => crate::internal_err!("this rank's own window is not directly addressable"),
    }
}

fn reply(s: &mut TcpStream, r: Result<u64>, data: Option<&[u8]>) -> Result<()> {
    let mut out = Vec::with_capacity(16);
    match &r {
        Ok(v) => {
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&v.to_le_bytes());
        }
        Err(e) => {
            out.extend_from_slice(&(e.kind.code() as u32).to_le_bytes());
            out.extend_from_slice(&(e.msg.len() as u32).to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(e.msg.as_bytes());
        }
    }
    s.write_all(&out).map_err(io("answer a window request"))?;
    if let (Ok(_), Some(d)) = (&r, data) {
        s.write_all(d).map_err(io("answer a window get"))?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn apply(
    s: &mut TcpStream,
    f: &Frame,
    tag: u64,
    me: usize,
    from: usize,
    ctl: &Ctl,
    sticky: &mut Option<Error>,
) -> Result<()> {
    match f.op {
        OP_PUT => {
            match own_range(f, tag, me) {
                Ok((_w, at)) => {
                    // SAFETY: the range lies inside this rank's registered window, kept alive
                    // while we hold `_w`.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(at as *mut u8, f.len as usize) };
                    s.read_exact(dst).map_err(io("read a window put"))?;
                }
                Err(e) => {
                    std::io::copy(&mut (&mut *s).take(f.len), &mut std::io::sink())
                        .map_err(io("skip a window put"))?;
                    // The data did not land, so its signal is not counted either: a signal
                    // promises its put's data. The origin learns why at its next flush.
                    sticky.get_or_insert(e);
                    return Ok(());
                }
            }
            if f.flags & FLAG_SIGNAL != 0 {
                ctl.counter(from).fetch_add(1, Ordering::SeqCst);
                ctl.ring();
            }
            Ok(())
        }
        OP_SIGNAL => {
            ctl.counter(from).fetch_add(1, Ordering::SeqCst);
            ctl.ring();
            Ok(())
        }
        OP_GET => match own_range(f, tag, me) {
            Ok((_w, at)) => {
                // SAFETY: as for puts.
                let src = unsafe { std::slice::from_raw_parts(at as *const u8, f.len as usize) };
                reply(s, Ok(0), Some(src))
            }
            Err(e) => reply(s, Err(e), None),
        },
        OP_FETCH_ADD | OP_CAS => {
            let r = target(f.win, tag, me).and_then(|w| {
                let cas = (f.op == OP_CAS).then_some(f.a);
                check_range(&w.peers[me], f.off as usize, 8, me)?;
                atomic_at(&w, me, f.off as usize, cas, f.b, ctl, Default::default())
            });
            reply(s, r, None)
        }
        OP_PAD_CAS => {
            let r = target(f.win, tag, me).map(|w| {
                let pad = ctl.pad(w.slot, f.off as usize, from);
                let old = match pad.compare_exchange(
                    f.a as u32,
                    f.b as u32,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(v) | Err(v) => v,
                };
                ctl.ring();
                old as u64
            });
            reply(s, r, None)
        }
        OP_FLUSH => reply(s, sticky.take().map_or(Ok(0), Err), None),
        op => crate::invalid_usage!("unknown window request {op}"),
    }
}

impl NetSide {
    pub(super) fn new(
        rank: usize,
        tag: u64,
        secret: [u8; 32],
        addrs: Vec<Option<SocketAddr>>,
        lost: Arc<Vec<AtomicBool>>,
        timeout: Option<Duration>,
    ) -> NetSide {
        let conns = (0..addrs.len()).map(|_| Mutex::new(None)).collect();
        NetSide {
            rank,
            tag,
            secret,
            addrs,
            conns,
            lost,
            timeout,
        }
    }

    fn connect(&self, peer: usize) -> Result<TcpStream> {
        let Some(addr) = self.addrs[peer] else {
            return crate::internal_err!("rank {peer} published no window address");
        };
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).map_err(|e| {
            Error::new(
                ErrorKind::Remote,
                format!("connect to rank {peer}'s windows at {addr}: {e}"),
            )
        })?;
        s.set_nodelay(true).map_err(io("window connection"))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(io("window connection"))?;
        s.write_all(&(self.rank as u32).to_le_bytes())
            .map_err(io("window hello"))?;
        auth::client(&mut s, &self.secret, &context(self.tag, self.rank, peer))?;
        s.set_read_timeout(self.timeout)
            .map_err(io("window connection"))?;
        Ok(s)
    }

    /// Whether `peer`'s process is gone, judged by this rank's connection to its windows (one
    /// is opened if needed): the target never speaks unasked, so a readable connection means
    /// it closed. False while another thread uses the connection.
    pub(super) fn peer_gone(&self, peer: usize) -> bool {
        let Some(mut slot) = self.conns[peer].try_lock() else {
            return false;
        };
        if slot.is_none() {
            match self.connect(peer) {
                Ok(s) => *slot = Some(s),
                Err(e) => return e.kind == ErrorKind::Remote,
            }
        }
        let fd = slot.as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd);
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        let gone = n > 0 && p.revents != 0;
        if gone {
            *slot = None;
        }
        gone
    }

    /// Sends `f` (and `payload`) to `peer`; with `answer`, reads the reply into `data` and
    /// returns its value. A broken connection is ncclRemoteError and is dropped.
    pub(super) fn call(
        &self,
        peer: usize,
        f: &Frame,
        payload: &[u8],
        answer: bool,
        data: &mut [u8],
    ) -> Result<u64> {
        let mut slot = self.conns[peer].lock();
        if slot.is_none() {
            *slot = Some(self.connect(peer)?);
        }
        let s = slot.as_mut().unwrap();
        let r = (|| -> std::io::Result<std::result::Result<u64, Error>> {
            if payload.is_empty() {
                s.write_all(&f.encode())?;
            } else {
                let head = f.encode();
                let bufs = [std::io::IoSlice::new(&head), std::io::IoSlice::new(payload)];
                write_all_vectored(s, &bufs)?;
            }
            if !answer {
                return Ok(Ok(0));
            }
            let mut head = [0u8; 16];
            s.read_exact(&mut head)?;
            let status = u32::from_le_bytes(head[0..4].try_into().unwrap());
            let mlen = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
            let value = u64::from_le_bytes(head[8..16].try_into().unwrap());
            if status != 0 {
                let mut msg = vec![0u8; mlen];
                s.read_exact(&mut msg)?;
                let kind = kind_of(status);
                return Ok(Err(Error::new(
                    kind,
                    format!("rank {peer}: {}", String::from_utf8_lossy(&msg)),
                )));
            }
            s.read_exact(data)?;
            Ok(Ok(value))
        })();
        match r {
            Ok(v) => v,
            Err(e) => {
                *slot = None;
                let kind = if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) {
                    ErrorKind::Timeout
                } else {
                    ErrorKind::Remote
                };
                Err(Error::new(
                    kind,
                    format!("the connection to rank {peer}'s windows failed: {e}"),
                ))
            }
        }
    }
}

fn write_all_vectored(s: &mut TcpStream, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<()> {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let mut done = 0usize;
    while done < total {
        // Rebuild the slices past what was written (at most two pieces).
        let mut rest = Vec::with_capacity(bufs.len());
        let mut skip = done;
        for b in bufs {
            if skip >= b.len() {
                skip -= b.len();
                continue;
            }
            rest.push(std::io::IoSlice::new(&b[skip..]));
            skip = 0;
        }
        match s.write_vectored(&rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn kind_of(code: u32) -> ErrorKind {
    [
        ErrorKind::UnhandledCuda,
        ErrorKind::System,
        ErrorKind::Internal,
        ErrorKind::InvalidArgument,
        ErrorKind::InvalidUsage,
        ErrorKind::Remote,
        ErrorKind::Timeout,
    ]
    .into_iter()
    .find(|k| k.code() as u32 == code)
    .unwrap_or(ErrorKind::Remote)
}
