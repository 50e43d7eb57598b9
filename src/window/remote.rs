//! One-sided operations between hosts: active messages over TCP, applied at the target by a
//! thread of the library (the target's application does not call in). An origin opens one
//! connection per target, on demand, through the communicator's connection service (the
//! bootstrap's listener: authenticated with the communicator's secret for the purpose
//! "windows", handshakes run side by side and bounded by their deadline), and sends frames in
//! program order, so a signal is applied after the puts before it. Puts and signals are not
//! answered; gets, atomics, pad updates and flushes are, and a flush is answered only after
//! everything sent before it was applied.
//!
//! At the target one thread per communicator serves every origin's connection from one poll
//! loop, without blocking on any: a put's payload is read into the window as it arrives, an
//! answer is written as the origin takes it, and no request of a connection is read while an
//! answer to it is owed. A slow or stopped origin therefore holds up only itself.

use super::ctl::Ctl;
use super::ops::{atomic_at, check_range};
use super::registry::window_by_handle;
use super::{Reach, Window};
use crate::bootstrap::{Bootstrap, Dialer, PeerCtx, Purpose};
use crate::error::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// The network side of a rank's windows: what dials the targets on other hosts, and this
/// rank's connections to them.
pub(super) struct NetSide {
    dialer: Dialer,
    conns: Vec<Mutex<Option<TcpStream>>>,
    /// Set when a peer's connection to us broke: waits for it fail at once.
    pub lost: Arc<Vec<AtomicBool>>,
    timeout: Option<Duration>,
}

/// How long an origin waits for a target's service to take its connection and authenticate it
/// (less when the communicator's timeout is shorter).
const CONNECT: Duration = Duration::from_secs(10);

/// A connection gets this many bytes of requests served in a row before the others get a turn.
const TURN: usize = 4 << 20;

/// Starts serving the window operations of peers on other hosts to this rank (communicator tag
/// `tag`): their connections come through `boot`'s connection service, and one thread applies
/// their operations to this rank's windows and control segment `ctl` until `stop` is set.
/// Returns, per rank, whether its connection to us broke.
pub(super) fn listen(
    boot: &Bootstrap,
    tag: u64,
    rank: usize,
    nranks: usize,
    ctl: Arc<Ctl>,
    stop: Arc<AtomicBool>,
) -> Result<Arc<Vec<AtomicBool>>> {
    let (wake, woken) =
        UnixStream::pair().map_err(|e| Error::from_io("the window server's wake-up pair", e))?;
    woken
        .set_nonblocking(true)
        .and_then(|_| wake.set_nonblocking(true))
        .map_err(|e| Error::from_io("the window server's wake-up pair", e))?;
    let arrived: Arc<Mutex<Vec<(usize, TcpStream)>>> = Arc::default();
    let queue = arrived.clone();
    let route = boot.route(
        Purpose::Window,
        Box::new(move |c: PeerCtx, s: TcpStream| {
            queue.lock().push((c.from as usize, s));
            // A full pipe already holds a wake-up.
            let _ = (&wake).write(&[1]);
        }),
    );
    let lost: Arc<Vec<AtomicBool>> =
        Arc::new((0..nranks).map(|_| AtomicBool::new(false)).collect());
    let lost2 = lost.clone();
    std::thread::Builder::new()
        .name(format!("comm-win-{rank}"))
        .spawn(move || {
            // Connections go back to the stash once this thread is done.
            let _route = route;
            serve(&woken, &arrived, tag, rank, nranks, &ctl, &lost2, &stop);
        })
        .map_err(|e| Error::from_io("start the window server thread", e))?;
    Ok(lost)
}

fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::from_io(what, e)
}

/// The server's loop: every origin's connection, served as it becomes ready.
#[allow(clippy::too_many_arguments)]
fn serve(
    woken: &UnixStream,
    arrived: &Mutex<Vec<(usize, TcpStream)>>,
    tag: u64,
    me: usize,
    nranks: usize,
    ctl: &Ctl,
    lost: &[AtomicBool],
    stop: &AtomicBool,
) {
    let mut conns: Vec<Conn> = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let mut fds = Vec::with_capacity(1 + conns.len());
        fds.push(libc::pollfd {
            fd: woken.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(conns.iter().map(|c| libc::pollfd {
            fd: c.s.as_raw_fd(),
            events: c.events(),
            revents: 0,
        }));
        // SAFETY: `fds` holds valid pollfds for open descriptors; a bounded wait so that
        // `stop` is seen.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 200) };
        let mut kept = Vec::with_capacity(conns.len());
        for (mut c, fd) in conns.into_iter().zip(&fds[1..]) {
            if fd.revents == 0 {
                kept.push(c);
                continue;
            }
            match c.progress(tag, me, ctl) {
                Ok(true) => kept.push(c),
                outcome => {
                    if let Err(e) = outcome {
                        crate::warn!("window connection from rank {}: {}", c.from, e.msg);
                    }
                    // A clean close after the origin destroyed its communicator, or a broken
                    // connection: either way no more signals come from that rank.
                    lost[c.from].store(true, Ordering::SeqCst);
                    ctl.ring();
                }
            }
        }
        conns = kept;
        if fds[0].revents != 0 {
            let mut buf = [0u8; 64];
            while matches!((&*woken).read(&mut buf), Ok(n) if n > 0) {}
            for (from, s) in arrived.lock().drain(..) {
                // An origin keeps one connection and opens another only when that one broke:
                // a few per rank is the most that can be legitimate.
                if from >= nranks || conns.len() >= 2 * nranks + 8 {
                    crate::warn!(
                        "rank {me}: refused a window connection from rank {from}: too many open"
                    );
                    continue;
                }
                conns.push(Conn::new(s, from));
            }
        }
    }
}

/// A put whose payload is being read: where it lands (None: it is skipped), how far it is.
struct Put {
    win: Option<Arc<Window>>,
    at: usize,
    len: usize,
    done: usize,
    signal: bool,
}

/// One origin's connection at the target.
struct Conn {
    s: TcpStream,
    from: usize,
    head: [u8; FRAME],
    got: usize,
    put: Option<Put>,
    /// The answers owed, and how much of them is written.
    out: Vec<u8>,
    out_off: usize,
    /// The first put that could not land, reported at the next flush.
    sticky: Option<Error>,
}

impl Conn {
    fn new(s: TcpStream, from: usize) -> Conn {
        Conn {
            s,
            from,
            head: [0; FRAME],
            got: 0,
            put: None,
            out: Vec::new(),
            out_off: 0,
            sticky: None,
        }
    }

    fn events(&self) -> i16 {
        if self.out_off < self.out.len() {
            libc::POLLOUT
        } else {
            libc::POLLIN
        }
    }

    /// Serves what the connection allows without blocking. Ok(false) when the origin closed it
    /// between requests.
    fn progress(&mut self, tag: u64, me: usize, ctl: &Ctl) -> Result<bool> {
        let mut served = 0usize;
        loop {
            while self.out_off < self.out.len() {
                match (&self.s).write(&self.out[self.out_off..]) {
                    Ok(0) => return crate::remote_err!("the origin stopped taking answers"),
                    Ok(n) => self.out_off += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Error::from_io("answer a window request", e)),
                }
            }
            self.out.clear();
            self.out_off = 0;
            if served >= TURN {
                return Ok(true);
            }
            if let Some(p) = &mut self.put {
                let mut scratch = [0u8; 4096];
                while p.done < p.len {
                    let left = p.len - p.done;
                    let r = match &p.win {
                        Some(_) => {
                            // SAFETY: [at, at + len) lies inside this rank's registered window
                            // (checked when the put began), kept alive while we hold `p.win`.
                            let dst = unsafe {
                                std::slice::from_raw_parts_mut((p.at + p.done) as *mut u8, left)
                            };
                            (&self.s).read(dst)
                        }
                        None => (&self.s).read(&mut scratch[..left.min(4096)]),
                    };
                    match r {
                        Ok(0) => return crate::remote_err!("the origin closed in a put's data"),
                        Ok(n) => {
                            p.done += n;
                            served += n;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(Error::from_io("read a window put", e)),
                    }
                }
                if p.win.is_some() && p.signal {
                    ctl.counter(self.from).fetch_add(1, Ordering::SeqCst);
                    ctl.ring();
                }
                self.put = None;
            }
            while self.got < FRAME {
                match (&self.s).read(&mut self.head[self.got..]) {
                    Ok(0) if self.got == 0 => return Ok(false),
                    Ok(0) => return crate::remote_err!("the origin closed in a request"),
                    Ok(n) => self.got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Error::from_io("read a window request", e)),
                }
            }
            self.got = 0;
            served += FRAME;
            let f = Frame::decode(&self.head);
            self.apply(&f, tag, me, ctl)?;
        }
    }

    fn apply(&mut self, f: &Frame, tag: u64, me: usize, ctl: &Ctl) -> Result<()> {
        let from = self.from;
        match f.op {
            OP_PUT => {
                let put = match own_range(f, tag, me) {
                    Ok((w, at)) => Put {
                        win: Some(w),
                        at,
                        len: f.len as usize,
                        done: 0,
                        signal: f.flags & FLAG_SIGNAL != 0,
                    },
                    Err(e) => {
                        // The data does not land, so its signal is not counted either: a
                        // signal promises its put's data. The origin learns why at its next
                        // flush.
                        self.sticky.get_or_insert(e);
                        Put {
                            win: None,
                            at: 0,
                            len: f.len as usize,
                            done: 0,
                            signal: false,
                        }
                    }
                };
                self.put = Some(put);
                Ok(())
            }
            OP_SIGNAL => {
                ctl.counter(from).fetch_add(1, Ordering::SeqCst);
                ctl.ring();
                Ok(())
            }
            OP_GET => {
                match own_range(f, tag, me) {
                    Ok((_w, at)) => {
                        // SAFETY: as for puts; the bytes are copied out before `_w` goes.
                        let src =
                            unsafe { std::slice::from_raw_parts(at as *const u8, f.len as usize) };
                        answer(&mut self.out, Ok(0), Some(src));
                    }
                    Err(e) => answer(&mut self.out, Err(e), None),
                }
                Ok(())
            }
            OP_FETCH_ADD | OP_CAS => {
                let r = target(f.win, tag, me).and_then(|w| {
                    let cas = (f.op == OP_CAS).then_some(f.a);
                    check_range(&w.peers[me], f.off as usize, 8, me)?;
                    atomic_at(&w, me, f.off as usize, cas, f.b, ctl, Default::default())
                });
                answer(&mut self.out, r, None);
                Ok(())
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
                answer(&mut self.out, r, None);
                Ok(())
            }
            OP_FLUSH => {
                let r = self.sticky.take().map_or(Ok(0), Err);
                answer(&mut self.out, r, None);
                Ok(())
            }
            op => crate::invalid_usage!("unknown window request {op}"),
        }
    }
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

/// Appends the answer to a request: status, message length, value, then the message or the
/// data.
fn answer(out: &mut Vec<u8>, r: Result<u64>, data: Option<&[u8]>) {
    match &r {
        Ok(v) => {
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&v.to_le_bytes());
            if let Some(d) = data {
                out.extend_from_slice(d);
            }
        }
        Err(e) => {
            out.extend_from_slice(&(e.kind.code() as u32).to_le_bytes());
            out.extend_from_slice(&(e.msg.len() as u32).to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(e.msg.as_bytes());
        }
    }
}

impl NetSide {
    pub(super) fn new(
        dialer: Dialer,
        nranks: usize,
        lost: Arc<Vec<AtomicBool>>,
        timeout: Option<Duration>,
    ) -> NetSide {
        let conns = (0..nranks).map(|_| Mutex::new(None)).collect();
        NetSide {
            dialer,
            conns,
            lost,
            timeout,
        }
    }

    fn connect(&self, peer: usize) -> Result<TcpStream> {
        let limit = self.timeout.map_or(CONNECT, |t| t.min(CONNECT));
        let s = self
            .dialer
            .dial(peer, Purpose::Window, 0, Some(Instant::now() + limit))
            .map_err(|e| e.context(format!("connecting to rank {peer}'s windows")))?;
        s.set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(self.timeout))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Instant;

    /// A connected pair of TCP streams on loopback: (origin's end, target's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let origin = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (target, _) = l.accept().unwrap();
        target.set_nonblocking(true).unwrap();
        (origin, target)
    }

    /// An origin that stopped in the middle of a request holds up only itself: another
    /// origin's signal is applied at once, the stalled request completes when its bytes come,
    /// and a closed connection marks its rank lost.
    #[test]
    fn a_stalled_origin_holds_up_only_itself() {
        let (ctl, _fd) = Ctl::create(3, 1).unwrap();
        let ctl = Arc::new(ctl);
        let (wake, woken) = UnixStream::pair().unwrap();
        woken.set_nonblocking(true).unwrap();
        let arrived: Mutex<Vec<(usize, TcpStream)>> = Mutex::default();
        let lost: Vec<AtomicBool> = (0..3).map(|_| AtomicBool::new(false)).collect();
        let stop = AtomicBool::new(false);
        let (mut slow, slow_t) = pair();
        let (mut quick, quick_t) = pair();
        arrived.lock().extend([(1, slow_t), (2, quick_t)]);
        (&wake).write_all(&[1]).unwrap();
        let signal = Frame {
            op: OP_SIGNAL,
            ..Frame::default()
        }
        .encode();
        let until = |what: &str, done: &dyn Fn() -> bool| {
            let t0 = Instant::now();
            while !done() {
                assert!(t0.elapsed() < Duration::from_secs(5), "{what}");
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        std::thread::scope(|s| {
            s.spawn(|| serve(&woken, &arrived, 0, 0, 3, &ctl, &lost, &stop));
            slow.write_all(&signal[..FRAME / 2]).unwrap();
            quick.write_all(&signal).unwrap();
            until("the quick origin's signal", &|| {
                ctl.counter(2).load(Ordering::SeqCst) == 1
            });
            assert_eq!(ctl.counter(1).load(Ordering::SeqCst), 0);
            slow.write_all(&signal[FRAME / 2..]).unwrap();
            until("the slow origin's signal", &|| {
                ctl.counter(1).load(Ordering::SeqCst) == 1
            });
            drop(quick);
            until("rank 2 marked lost", &|| lost[2].load(Ordering::SeqCst));
            assert!(!lost[1].load(Ordering::SeqCst));
            stop.store(true, Ordering::SeqCst);
        });
    }
}
