//! Transports between hosts. `socket` is TCP; every connection is made at communicator setup
//! over the bootstrap and proves it knows the communicator's secret.
//!
//! Setup is collective: every rank publishes, over the bootstrap, how many sockets it wants per
//! peer and the address of a listener of its own; then the lower rank of each pair that talks
//! over the network opens that many connections (the smaller of the two ranks' counts) to the
//! higher one, and on each names itself and the socket's index and runs the bootstrap's HMAC
//! challenge/response bound to the communicator, the pair and the index. The listener runs the
//! handshakes of every connection it accepts side by side from one poll loop, so anything else
//! that connects meanwhile (a stray client, garbage, a wrong communicator, a wrong secret, a
//! rank that is not due, a half-open connection) costs the real peers nothing: it is logged
//! ("refused a connection to the TCP transport") and dropped, when it misbehaves or at the
//! latest after `HANDSHAKE`. Once every peer is connected the listener is closed, so later
//! connections are refused by the kernel.
//!
//! A waiting executor sleeps on its doorbell. A link that found a socket empty (or full)
//! asks the `Waker` to watch it: one thread per communicator waits in epoll for those sockets
//! and rings the doorbell when one becomes ready. The executor itself moves every byte, on all
//! of a peer's sockets, without blocking; there are no helper threads.
//!
//! Environment: `COMM_SHM_DISABLE` / `NCCL_SHM_DISABLE` puts ranks of one host on the network
//! too; `COMM_NET` / `NCCL_NET` names the network transport (`socket`, or `ib`: see `ib`).
//! `COMM_NSOCKS_PERTHREAD` / `NCCL_NSOCKS_PERTHREAD` times `COMM_SOCKET_NTHREADS` /
//! `NCCL_SOCKET_NTHREADS` is the number of sockets per peer (at most 64, as in NCCL); large
//! messages are cut across them (see `socket`). NCCL runs SOCKET_NTHREADS helper threads per
//! connection; this transport starts none, so that knob only multiplies the socket count.

pub(crate) mod ib;
mod socket;

use crate::bootstrap::{auth, Bootstrap};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{Doorbell, Link};
use parking_lot::Mutex;
use socket::SocketLink;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an accepted connection may take to name itself and authenticate.
const HANDSHAKE: Duration = Duration::from_secs(5);

/// Connections whose handshake may be under way at once (or twice the lower peers, if more);
/// beyond this, or when descriptors run out, one is dropped: the oldest that has not yet named
/// a rank that is due, else the oldest. So a flood of idle connections can neither exhaust
/// descriptors nor push out a real peer (each dials one socket at a time, and its handshake
/// takes a few round trips).
const MAX_PENDING: usize = 256;

/// NCCL's cap on sockets per peer (NSOCKS_PERTHREAD x SOCKET_NTHREADS).
pub(crate) const MAX_SOCKETS: usize = 64;

/// The hello a connecting rank sends before authenticating: communicator tag, its rank and the
/// index of this socket among its sockets to the peer.
const HELLO: usize = 16;

#[cfg(test)]
thread_local! {
    /// Sockets per peer for connections this thread makes, whatever the environment says (the
    /// conformance suite runs with several sockets without touching the process environment).
    pub(crate) static SOCKETS_FOR_TEST: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

/// Sockets per peer this rank asks for: COMM_NSOCKS_PERTHREAD x COMM_SOCKET_NTHREADS (NCCL_
/// names too), each at least 1, the product at most 64.
fn sockets_per_peer() -> usize {
    #[cfg(test)]
    if let Some(n) = SOCKETS_FOR_TEST.with(|c| c.get()) {
        return n.clamp(1, MAX_SOCKETS);
    }
    let per_thread = crate::env::NSOCKS_PERTHREAD.int();
    let threads = crate::env::SOCKET_NTHREADS.int();
    let n = per_thread.max(1) * threads.max(1);
    if n > MAX_SOCKETS as i64 {
        crate::warn!(
            "NSOCKS_PERTHREAD x SOCKET_NTHREADS = {n} sockets per peer; using {MAX_SOCKETS}"
        );
    }
    n.min(MAX_SOCKETS as i64) as usize
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Net {
    /// InfiniBand where every rank has a device, sockets otherwise.
    Auto,
    Socket,
    Ib,
}

/// Which network transport a communicator uses, and who said so (for messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NetChoice {
    net: Net,
    from: String,
}

impl NetChoice {
    /// As NCCL: the environment (COMM_NET / NCCL_NET) where set, else the config's `netName`,
    /// else the best there is. A name that is no transport of this library fails the init,
    /// whether or not the communicator needs the network.
    pub(crate) fn resolve(config_name: Option<&str>) -> Result<NetChoice> {
        let (name, from) = match crate::env::NET.text() {
            Some(n) => {
                let var = crate::env::NET.set_name().unwrap_or("COMM_NET");
                (Some(n.clone()), format!("{var}={n}"))
            }
            None => match config_name.filter(|n| !n.is_empty()) {
                Some(n) => (Some(n.to_string()), format!("config netName \"{n}\"")),
                None => (None, String::new()),
            },
        };
        let net = match name.as_deref() {
            None => Net::Auto,
            Some(n) if n.eq_ignore_ascii_case("socket") => Net::Socket,
            Some(n) if n.eq_ignore_ascii_case("ib") => Net::Ib,
            Some(_) => {
                return crate::invalid_arg!(
                    "{from}: network not found; this library's are Socket and IB"
                )
            }
        };
        Ok(NetChoice { net, from })
    }
}

/// Watches sockets for the executor. Two modes:
/// - with a thread: the thread waits in epoll and rings the communicator's doorbell (a
///   shared-memory futex, when the communicator has peers on its host too) when one is ready;
/// - direct, for communicators whose peers are all across the network: the waker *is* the
///   doorbell, and a rank going to sleep waits in epoll itself, on its sockets and on an
///   eventfd that rings write. A message then wakes the rank that waits for it with no other
///   thread in between, one scheduling delay fewer on the path of every small message.
pub(crate) struct Waker {
    epoll: OwnedFd,
    /// The doorbell to ring (thread mode); None when the waker is the doorbell.
    doorbell: Option<Arc<dyn Doorbell>>,
    /// Direct mode: bumped by every ring, and how many ranks are preparing to sleep or asleep.
    word: AtomicU32,
    sleepers: AtomicU32,
    /// Serialises arming, so that interest in reading and in writing combine correctly.
    armed: Mutex<()>,
    stop: AtomicBool,
    /// Written to wake the thread when it must stop.
    wake: OwnedFd,
}

impl Waker {
    /// A waker that is its communicator's doorbell (direct mode).
    pub(crate) fn direct() -> Result<Waker> {
        Waker::new(None)
    }

    fn new(doorbell: Option<Arc<dyn Doorbell>>) -> Result<Waker> {
        // SAFETY: epoll_create1 takes flags and returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(Error::from_io(
                "epoll_create1",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: a fresh descriptor we own.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: eventfd takes a count and flags and returns a new descriptor or -1.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(Error::from_io("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor we own.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let w = Waker {
            epoll,
            doorbell,
            word: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
            armed: Mutex::new(()),
            stop: AtomicBool::new(false),
            wake,
        };
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: u64::MAX,
        };
        // SAFETY: both descriptors are open; `ev` is a valid event.
        let r = unsafe {
            libc::epoll_ctl(
                w.epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                w.wake.as_raw_fd(),
                &mut ev,
            )
        };
        if r < 0 {
            return Err(Error::from_io("epoll_ctl", std::io::Error::last_os_error()));
        }
        Ok(w)
    }

    fn add(&self, fd: i32, peer: usize) -> Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLONESHOT as u32,
            u64: peer as u64,
        };
        // SAFETY: both descriptors are open; `ev` is a valid event.
        let r =
            unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if r < 0 {
            return Err(Error::from_io("epoll_ctl", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    fn arm(&self, fd: i32, events: u32) {
        let _g = self.armed.lock();
        let mut ev = libc::epoll_event {
            events: events | (libc::EPOLLONESHOT | libc::EPOLLRDHUP) as u32,
            u64: 0,
        };
        // SAFETY: both descriptors are open (the link is registered); `ev` is valid. A failure
        // only costs the wake-up: the executor's sleep is bounded.
        unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, &mut ev) };
    }

    /// A link's socket had nothing to read: ring when it has.
    pub(super) fn want_read(&self, fd: i32) {
        self.arm(fd, libc::EPOLLIN as u32);
    }

    /// A link's socket was full: ring when it takes more.
    pub(super) fn want_write(&self, fd: i32) {
        self.arm(fd, (libc::EPOLLIN | libc::EPOLLOUT) as u32);
    }

    fn run(&self) {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        while !self.stop.load(Ordering::Acquire) {
            // SAFETY: `events` has room for 16 entries.
            let n =
                unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 16, 1000) };
            if n > 0 {
                if let Some(d) = &self.doorbell {
                    d.ring();
                }
            }
        }
    }
}

impl Doorbell for Waker {
    fn ring(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.word.fetch_add(1, Ordering::SeqCst);
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes to our eventfd, which wakes an epoll_wait on it.
            unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }

    fn prepare_sleep(&self) -> u32 {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        self.word.load(Ordering::SeqCst)
    }

    fn cancel_sleep(&self) {
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    fn sleep(&self, seen: u32, timeout: Duration) {
        if self.word.load(Ordering::SeqCst) == seen {
            let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
            let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: `events` has room for 16 entries.
            let n =
                unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 16, ms) };
            if n > 0 && events[..n as usize].iter().any(|e| e.u64 == u64::MAX) {
                let mut buf = [0u8; 8];
                // SAFETY: reads the eventfd's counter (non-blocking), resetting it.
                unsafe { libc::read(self.wake.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
            }
        }
        self.cancel_sleep();
    }
}

/// The network side of one communicator: its links and the thread that wakes the executor.
pub(crate) struct NetWorld {
    pub(crate) links: Vec<Option<Arc<dyn Link>>>,
    /// The speed of the interface the connections use, in bytes per microsecond (10 Gbit/s
    /// where the kernel does not say), for estimates.
    pub(crate) bytes_per_us: f32,
    waker: Option<Arc<Waker>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The InfiniBand device the links use, kept open while they exist.
    ib: Option<ib::IbWorld>,
}

impl NetWorld {
    /// Registers user memory with the InfiniBand device, where the links use one, so that
    /// they send from it without a copy (ncclCommRegister). None over sockets.
    pub(crate) fn register(&self, addr: *mut u8, len: usize) -> Result<Option<u64>> {
        self.ib
            .as_ref()
            .map(|ib| ib.register(addr, len))
            .transpose()
    }

    /// The InfiniBand side, where the links use InfiniBand (windows reach peers with it).
    pub(crate) fn ib(&self) -> Option<&ib::IbWorld> {
        self.ib.as_ref()
    }

    pub(crate) fn deregister(&self, id: u64) {
        if let Some(ib) = &self.ib {
            ib.deregister(id);
        }
    }
}

impl Drop for NetWorld {
    fn drop(&mut self) {
        let Some(waker) = &self.waker else { return };
        waker.stop.store(true, Ordering::Release);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes to our eventfd, which wakes the thread's epoll_wait.
        unsafe { libc::write(waker.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn context(tag: u64, from: usize, to: usize, socket: usize) -> Vec<u8> {
    format!("comm net/socket {tag:016x} {from}->{to} #{socket}").into_bytes()
}

/// What a rank publishes for the TCP transport: its socket count, then its listener's address
/// (none when no lower rank connects to it).
fn publication(sockets: usize, listener: Option<&TcpListener>) -> Result<Vec<u8>> {
    let mut mine = (sockets as u32).to_le_bytes().to_vec();
    if let Some(l) = listener {
        let a = l
            .local_addr()
            .map_err(|e| Error::from_io("the TCP transport's listener address", e))?;
        mine.extend_from_slice(&crate::bootstrap::encode_addr(&a));
    }
    Ok(mine)
}

/// Connects this rank to every rank in `peers` over TCP. Collective: every rank of the
/// bootstrap calls it, in the same order relative to the other setup collectives, even with
/// no peers of its own.
pub(crate) fn connect(
    boot: &Bootstrap,
    peers: &[usize],
    doorbell: Arc<dyn Doorbell>,
    direct: Option<Arc<Waker>>,
    comm_tag: u64,
    deadline: Option<Instant>,
    choice: &NetChoice,
) -> Result<Option<NetWorld>> {
    let me = boot.rank();
    let nranks = boot.nranks();
    let want = choice.net;
    // Every rank votes: 2 without network peers (either will do), 1 with a usable InfiniBand
    // device, 0 without one (or with sockets asked for).
    let (vote, device, why) = if peers.is_empty() {
        (2u8, None, String::new())
    } else if want == Net::Socket {
        (0, None, choice.from.clone())
    } else if crate::env::IB_DISABLE.flag() {
        (0, None, "COMM_IB_DISABLE=1".to_string())
    } else {
        match ib::probe() {
            Ok(d) => (1, Some(d), String::new()),
            Err(why) => (0, None, why),
        }
    };
    let listener = if peers.iter().any(|&p| p < me) {
        let l = TcpListener::bind(SocketAddr::new(boot.listen_ip(), 0))
            .map_err(|e| Error::from_io("bind the TCP transport's listener", e))?;
        if let Ok(a) = l.local_addr() {
            crate::info!(
                "rank {me}: TCP transport of communicator {comm_tag:016x} listening on {a}"
            );
        }
        Some(l)
    } else {
        None
    };
    let sockets = sockets_per_peer();
    let mut mine = vec![vote];
    mine.extend(publication(sockets, listener.as_ref())?);
    let addrs = boot.allgather(&mine)?;
    // A failure test can freeze this rank here, with every listener open and nobody connected.
    crate::fault::point("net:published");
    let without: Vec<usize> = (0..nranks)
        .filter(|&r| addrs[r].first() == Some(&0))
        .collect();
    let use_ib = without.is_empty() && addrs.iter().any(|a| a.first() == Some(&1));
    if want == Net::Ib && !use_ib && !without.is_empty() {
        return crate::invalid_usage!(
            "{}, but {} {} no usable InfiniBand device{}",
            choice.from,
            crate::bootstrap::describe_ranks(&without),
            if without.len() == 1 { "has" } else { "have" },
            if why.is_empty() {
                String::new()
            } else {
                format!(" (here: {why})")
            }
        );
    }
    if use_ib {
        if let Some(d) = &device {
            crate::info!(
                "network transport: InfiniBand on {}, which every rank has",
                d.name()
            );
        }
        let (links, world) = ib::connect(boot, peers, device, doorbell)?;
        if peers.is_empty() {
            return Ok(None);
        }
        return Ok(Some(NetWorld {
            links,
            bytes_per_us: 12_500.0,
            waker: None,
            thread: None,
            ib: world,
        }));
    }
    if peers.is_empty() {
        return Ok(None);
    }
    if want == Net::Auto {
        match without.first() {
            Some(&r) if r == me => crate::info!("network transport: sockets ({why})"),
            Some(&r) => {
                crate::info!("network transport: sockets (rank {r} has no InfiniBand device)")
            }
            None => {}
        }
    }
    // Each pair uses the smaller of the two ranks' counts, so both ends agree.
    let count = |p: usize| -> Result<usize> {
        let theirs = addrs[p]
            .get(1..5)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Internal,
                    format!("rank {p} published no TCP transport settings"),
                )
            })?;
        Ok(sockets.min(theirs).clamp(1, MAX_SOCKETS))
    };
    let secret = *boot.secret();
    let mut streams: Vec<Vec<TcpStream>> = (0..nranks).map(|_| Vec::new()).collect();
    // Upward first: a higher rank's listener takes the connection even while its owner is
    // still connecting upward itself, so the chain always resolves from the top.
    for &p in peers.iter().filter(|&&p| p > me) {
        let addr = crate::bootstrap::decode_addr(&addrs[p][5..]).ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("rank {p} published no TCP transport address"),
            )
        })?;
        for i in 0..count(p)? {
            let s = dial(addr, me, p, i, &secret, comm_tag, deadline).map_err(|e| {
                e.context(format!(
                    "connecting to rank {p} ({addr}) over TCP (socket {i})"
                ))
            })?;
            streams[p].push(s);
        }
    }
    if let Some(l) = listener {
        let mut due = HashMap::new();
        for &p in peers.iter().filter(|&&p| p < me) {
            due.insert(p, count(p)?);
        }
        for (p, s) in accept_all(&l, &due, me, &secret, comm_tag, deadline)? {
            streams[p] = s;
        }
    }
    let (waker, thread_needed) = match direct {
        Some(w) => (w, false),
        None => (Arc::new(Waker::new(Some(doorbell))?), true),
    };
    let mut links: Vec<Option<Arc<dyn Link>>> = (0..nranks).map(|_| None).collect();
    for (p, ss) in streams.into_iter().enumerate() {
        if ss.is_empty() {
            continue;
        }
        for s in &ss {
            s.set_nonblocking(true)
                .and_then(|_| s.set_nodelay(true))
                .map_err(|e| Error::from_io("configure a TCP connection", e))?;
            waker.add(s.as_raw_fd(), p)?;
        }
        let link = SocketLink::new(p, ss, waker.clone());
        crate::info!("rank {me} -> rank {p}: {}", link.describe());
        links[p] = Some(Arc::new(link));
    }
    let thread = if thread_needed {
        let w = waker.clone();
        Some(
            std::thread::Builder::new()
                .name(format!("comm-net-{me}"))
                .spawn(move || w.run())
                .map_err(|e| Error::from_io("start the network progress thread", e))?,
        )
    } else {
        None
    };
    Ok(Some(NetWorld {
        links,
        bytes_per_us: crate::bootstrap::iface::speed_of(boot.listen_ip()).unwrap_or(1250.0),
        waker: Some(waker),
        thread,
        ib: None,
    }))
}

fn remaining(deadline: Option<Instant>) -> Result<Duration> {
    match deadline {
        None => Ok(Duration::from_secs(3600)),
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                crate::timeout_err!("timed out setting up TCP connections")
            } else {
                Ok(left)
            }
        }
    }
}

fn dial(
    addr: SocketAddr,
    me: usize,
    peer: usize,
    socket: usize,
    secret: &[u8; 32],
    tag: u64,
    deadline: Option<Instant>,
) -> Result<TcpStream> {
    let left = remaining(deadline)?;
    let mut s = TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(30))).map_err(
        |e| match e.kind() {
            std::io::ErrorKind::ConnectionRefused if addr.ip().is_loopback() => {
                crate::bootstrap::refused(&format!("rank {peer} ({addr})"), addr)
            }
            std::io::ErrorKind::ConnectionRefused => {
                crate::bootstrap::refused(&format!("rank {peer}"), addr)
            }
            _ => Error::from_io("connect", e),
        },
    )?;
    s.set_read_timeout(Some(left))
        .and_then(|_| s.set_write_timeout(Some(left)))
        .map_err(|e| Error::from_io("socket timeouts", e))?;
    let mut hello = Vec::with_capacity(HELLO);
    crate::wire::put_u64(&mut hello, tag);
    crate::wire::put_u32(&mut hello, me as u32);
    crate::wire::put_u32(&mut hello, socket as u32);
    s.write_all(&hello)
        .map_err(|e| Error::from_io("send the hello", e))?;
    auth::client(&mut s, secret, &context(tag, me, peer, socket))?;
    s.set_read_timeout(None)
        .and_then(|_| s.set_write_timeout(None))
        .map_err(|e| Error::from_io("socket timeouts", e))?;
    Ok(s)
}

/// An accepted connection on its way through the hello and the server side of the handshake,
/// driven without blocking so that many run side by side.
struct Incoming {
    stream: TcpStream,
    from: SocketAddr,
    deadline: Instant,
    hello: [u8; HELLO],
    /// (rank, socket index) it claims, once its hello is read.
    claim: Option<(usize, usize)>,
    hs: auth::ServerHandshake,
    /// Bytes of the current message read so far (the hello, then the handshake's messages).
    buf: Vec<u8>,
    filled: usize,
    out: Vec<u8>,
    out_off: usize,
    finished: bool,
}

enum Handshake {
    Pending,
    Done(usize, usize),
    Refused(String),
}

impl Incoming {
    fn new(stream: TcpStream, from: SocketAddr) -> Incoming {
        Incoming {
            stream,
            from,
            deadline: Instant::now() + HANDSHAKE,
            hello: [0; HELLO],
            claim: None,
            hs: auth::ServerHandshake::new(),
            buf: Vec::new(),
            filled: 0,
            out: Vec::new(),
            out_off: 0,
            finished: false,
        }
    }

    fn events(&self) -> i16 {
        if self.out_off < self.out.len() {
            libc::POLLOUT
        } else {
            libc::POLLIN
        }
    }

    /// Reads into `dst` until full; Ok(false) while the socket has no more for now.
    fn fill(
        stream: &TcpStream,
        dst: &mut [u8],
        filled: &mut usize,
    ) -> std::result::Result<bool, String> {
        while *filled < dst.len() {
            match (&*stream).read(&mut dst[*filled..]) {
                Ok(0) => {
                    return Err("it closed the connection before finishing its handshake".into())
                }
                Ok(n) => *filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("reading its handshake failed: {e}")),
            }
        }
        Ok(true)
    }

    /// Moves the handshake on as far as the socket allows. `due` says whether a (rank, socket)
    /// may still connect.
    fn progress(
        &mut self,
        me: usize,
        tag: u64,
        secret: &[u8; 32],
        due: &dyn Fn(usize, usize) -> bool,
    ) -> Handshake {
        let refuse = |why: String| Handshake::Refused(why);
        if self.claim.is_none() {
            let mut got = self.filled;
            match Self::fill(&self.stream, &mut self.hello, &mut got) {
                Ok(true) => {}
                Ok(false) => {
                    self.filled = got;
                    return Handshake::Pending;
                }
                Err(e) => return refuse(e),
            }
            self.filled = 0;
            let their_tag = u64::from_le_bytes(self.hello[..8].try_into().unwrap());
            let rank = u32::from_le_bytes(self.hello[8..12].try_into().unwrap()) as usize;
            let socket = u32::from_le_bytes(self.hello[12..].try_into().unwrap()) as usize;
            if their_tag != tag {
                return refuse(format!(
                    "it belongs to another communicator (tag {their_tag:016x}, this one is {tag:016x}), or sent garbage"
                ));
            }
            if !due(rank, socket) {
                return refuse(format!(
                    "it claims to be socket {socket} of rank {rank}, which is not due to connect"
                ));
            }
            self.claim = Some((rank, socket));
        }
        let (rank, socket) = self.claim.expect("claimed above");
        let expected = context(tag, rank, me, socket);
        let lookup = |ctx: &[u8]| -> std::result::Result<[u8; 32], String> {
            if ctx == expected.as_slice() {
                Ok(*secret)
            } else {
                Err("its handshake is meant for another communicator, pair or socket".into())
            }
        };
        loop {
            while self.out_off < self.out.len() {
                match (&self.stream).write(&self.out[self.out_off..]) {
                    Ok(0) => return refuse("it closed the connection".into()),
                    Ok(n) => self.out_off += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        return Handshake::Pending
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return refuse(format!("writing to it failed: {e}")),
                }
            }
            if self.finished {
                return Handshake::Done(rank, socket);
            }
            let need = self.hs.need();
            self.buf.resize(need, 0);
            match Self::fill(&self.stream, &mut self.buf, &mut self.filled) {
                Ok(true) => {}
                Ok(false) => return Handshake::Pending,
                Err(e) => return refuse(e),
            }
            self.filled = 0;
            match self.hs.on_message(&self.buf, &lookup) {
                auth::Step::Reply(r) => {
                    self.out = r;
                    self.out_off = 0;
                }
                auth::Step::Done(r) => {
                    self.out = r;
                    self.out_off = 0;
                    self.finished = true;
                }
                auth::Step::Refuse(r, why) => {
                    // One attempt to say no; it learns either way when the connection closes.
                    let _ = (&self.stream).write(&r);
                    return refuse(why);
                }
            }
        }
    }
}

/// Drops one handshaking connection to make room: the oldest that has not named a due rank,
/// else the oldest.
fn evict(pending: &mut Vec<Incoming>, me: usize, why: &str) {
    let i = pending.iter().position(|c| c.claim.is_none()).unwrap_or(0);
    let c = pending.remove(i);
    refused(me, c.from, &format!("{why}; it was dropped to make room"));
}

fn refused(me: usize, from: SocketAddr, why: &str) {
    crate::warn!("rank {me}: refused a connection to the TCP transport from {from}: {why}");
}

/// Accepts `due[rank]` connections from each lower rank, refusing anything else. Handshakes
/// run side by side: a connection that stays silent, or goes slowly, holds up nobody else.
fn accept_all(
    l: &TcpListener,
    due: &HashMap<usize, usize>,
    me: usize,
    secret: &[u8; 32],
    tag: u64,
    deadline: Option<Instant>,
) -> Result<Vec<(usize, Vec<TcpStream>)>> {
    let want: usize = due.values().sum();
    let mut got: HashMap<(usize, usize), TcpStream> = HashMap::new();
    let mut pending: Vec<Incoming> = Vec::new();
    l.set_nonblocking(true)
        .map_err(|e| Error::from_io("listener", e))?;
    while got.len() < want {
        let missing = || -> Vec<usize> {
            let mut m: Vec<usize> = due
                .iter()
                .filter(|(&p, &n)| (0..n).any(|i| !got.contains_key(&(p, i))))
                .map(|(&p, _)| p)
                .collect();
            m.sort_unstable();
            m
        };
        if crate::bootstrap::init_aborted() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "aborted (ncclCommAbort) while waiting for {} to connect over TCP",
                    crate::bootstrap::describe_ranks(&missing())
                ),
            ));
        }
        if remaining(deadline).is_err() {
            return crate::timeout_err!(
                "timed out waiting for {} to connect over TCP",
                crate::bootstrap::describe_ranks(&missing())
            );
        }
        let mut fds = vec![libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        fds.extend(pending.iter().map(|c| libc::pollfd {
            fd: c.stream.as_raw_fd(),
            events: c.events(),
            revents: 0,
        }));
        let now = Instant::now();
        let wait = pending
            .iter()
            .map(|c| c.deadline.saturating_duration_since(now))
            .fold(Duration::from_millis(100), Duration::min);
        // SAFETY: `fds` holds valid pollfds for open descriptors.
        unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as _,
                wait.as_millis() as i32 + 1,
            )
        };
        loop {
            match l.accept() {
                Ok((s, from)) => {
                    if let Err(e) = s.set_nonblocking(true) {
                        refused(me, from, &format!("configuring it failed: {e}"));
                        continue;
                    }
                    if pending.len() >= MAX_PENDING.max(2 * due.len()) {
                        evict(
                            &mut pending,
                            me,
                            "too many connections were handshaking at once",
                        );
                    }
                    pending.push(Incoming::new(s, from));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
                        && !pending.is_empty() =>
                {
                    // The connection waits in the backlog; make room for it.
                    evict(&mut pending, me, "this process ran out of file descriptors");
                    break;
                }
                Err(e) => return Err(Error::from_io("accept a TCP transport connection", e)),
            }
        }
        let mut i = 0;
        while i < pending.len() {
            let due_now = |r: usize, s: usize| {
                due.get(&r).is_some_and(|&n| s < n) && !got.contains_key(&(r, s))
            };
            match pending[i].progress(me, tag, secret, &due_now) {
                Handshake::Pending if Instant::now() < pending[i].deadline => i += 1,
                Handshake::Pending => {
                    let c = pending.remove(i);
                    refused(
                        me,
                        c.from,
                        &format!(
                            "it did not complete its handshake within {}",
                            crate::log::secs(HANDSHAKE)
                        ),
                    );
                }
                Handshake::Refused(why) => {
                    let c = pending.remove(i);
                    refused(me, c.from, &why);
                }
                Handshake::Done(r, s) => {
                    let c = pending.remove(i);
                    match got.entry((r, s)) {
                        std::collections::hash_map::Entry::Occupied(_) => refused(
                            me,
                            c.from,
                            &format!("socket {s} of rank {r} is connected already"),
                        ),
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(c.stream);
                        }
                    }
                }
            }
        }
    }
    for c in pending {
        refused(
            me,
            c.from,
            "every peer connected before it finished its handshake",
        );
    }
    let mut out = Vec::new();
    for (&p, &n) in due {
        let ss: Vec<TcpStream> = (0..n)
            .map(|i| got.remove(&(p, i)).expect("every socket is connected"))
            .collect();
        out.push((p, ss));
    }
    Ok(out)
}
