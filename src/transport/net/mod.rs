//! Transports between hosts. `socket` is TCP; every connection is made at communicator setup
//! over the bootstrap and proves it knows the communicator's secret.
//!
//! Setup is collective: every rank publishes the address of a listener of its own over the
//! bootstrap, then the lower rank of each pair that talks over the network connects to the
//! higher one, names itself and runs the bootstrap's HMAC challenge/response bound to the
//! communicator and the pair. Anything else that connects meanwhile (a stray client, garbage,
//! a wrong secret, a half-open connection) is logged and dropped; once every peer is connected
//! the listener is closed, so later connections are refused by the kernel.
//!
//! A waiting executor sleeps on its doorbell. A link that found its socket empty (or full)
//! asks the `Waker` to watch it: one thread per communicator waits in epoll for those sockets
//! and rings the doorbell when one becomes ready.
//!
//! Environment: `COMM_SHM_DISABLE` / `NCCL_SHM_DISABLE` puts ranks of one host on the network
//! too; `COMM_NET` / `NCCL_NET` names the network transport (`socket`; `ib` is not built yet).

pub mod ib;
mod socket;

use crate::bootstrap::{auth, Bootstrap};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{Doorbell, Link};
use parking_lot::Mutex;
use socket::SocketLink;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an accepted connection may take to name itself and authenticate.
const HANDSHAKE: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Net {
    /// InfiniBand where every rank has a device, sockets otherwise.
    Auto,
    Socket,
    Ib,
}

/// Which network transport to use, from COMM_NET / NCCL_NET.
fn chosen() -> Result<Net> {
    match crate::env::var("NET").as_deref() {
        None | Some("") => Ok(Net::Auto),
        Some(n) if n.eq_ignore_ascii_case("socket") => Ok(Net::Socket),
        Some(n) if n.eq_ignore_ascii_case("ib") => Ok(Net::Ib),
        Some(n) => crate::invalid_arg!("COMM_NET={n} is not a network transport (socket, ib)"),
    }
}

/// Watches sockets for the executor and rings its doorbell when one is ready.
pub(crate) struct Waker {
    epoll: OwnedFd,
    doorbell: Arc<dyn Doorbell>,
    /// Serialises arming, so that interest in reading and in writing combine correctly.
    armed: Mutex<()>,
    stop: AtomicBool,
    /// Written to wake the thread when it must stop.
    wake: OwnedFd,
}

impl Waker {
    fn new(doorbell: Arc<dyn Doorbell>) -> Result<Waker> {
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

    fn arm(&self, link: &SocketLink, events: u32) {
        let _g = self.armed.lock();
        let mut ev = libc::epoll_event {
            events: events | (libc::EPOLLONESHOT | libc::EPOLLRDHUP) as u32,
            u64: 0,
        };
        // SAFETY: both descriptors are open (the link is registered); `ev` is valid. A failure
        // only costs the wake-up: the executor's sleep is bounded.
        unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_MOD,
                link.fd(),
                &mut ev,
            )
        };
    }

    /// The link's socket had nothing to read: ring when it has.
    pub(super) fn want_read(&self, link: &SocketLink) {
        self.arm(link, libc::EPOLLIN as u32);
    }

    /// The link's socket was full: ring when it takes more.
    pub(super) fn want_write(&self, link: &SocketLink) {
        self.arm(link, (libc::EPOLLIN | libc::EPOLLOUT) as u32);
    }

    fn run(&self) {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        while !self.stop.load(Ordering::Acquire) {
            // SAFETY: `events` has room for 16 entries.
            let n =
                unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 16, 1000) };
            if n > 0 {
                self.doorbell.ring();
            }
        }
    }
}

/// The network side of one communicator: its links and the thread that wakes the executor.
pub struct NetWorld {
    pub(crate) links: Vec<Option<Arc<dyn Link>>>,
    /// The speed of the interface the connections use, in bytes per microsecond (10 Gbit/s
    /// where the kernel does not say), for estimates.
    pub(crate) bytes_per_us: f32,
    waker: Option<Arc<Waker>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The InfiniBand device the links use, kept open while they exist.
    _ib: Option<ib::IbWorld>,
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

fn context(tag: u64, from: usize, to: usize) -> Vec<u8> {
    format!("comm net/socket {tag:016x} {from}->{to}").into_bytes()
}

/// Connects this rank to every rank in `peers` over TCP. Collective: every rank of the
/// bootstrap calls it, in the same order relative to the other setup collectives, even with
/// no peers of its own.
pub(crate) fn connect(
    boot: &Bootstrap,
    peers: &[usize],
    doorbell: Arc<dyn Doorbell>,
    comm_tag: u64,
    deadline: Option<Instant>,
) -> Result<Option<NetWorld>> {
    let me = boot.rank();
    let nranks = boot.nranks();
    let want = chosen()?;
    // Every rank votes: 2 without network peers (either will do), 1 with a usable InfiniBand
    // device, 0 without one (or with sockets asked for).
    let (vote, device, why) = if peers.is_empty() {
        (2u8, None, String::new())
    } else if want == Net::Socket {
        (0, None, "COMM_NET=socket".to_string())
    } else {
        match ib::probe() {
            Ok(d) => (1, Some(d), String::new()),
            Err(why) => (0, None, why),
        }
    };
    let listener = if peers.iter().any(|&p| p < me) {
        let l = TcpListener::bind(SocketAddr::new(boot.listen_ip(), 0))
            .map_err(|e| Error::from_io("bind the TCP transport's listener", e))?;
        Some(l)
    } else {
        None
    };
    let mut mine = vec![vote];
    if let Some(l) = &listener {
        let a = l
            .local_addr()
            .map_err(|e| Error::from_io("the TCP transport's listener address", e))?;
        mine.extend_from_slice(&crate::bootstrap::encode_addr(&a));
    }
    let addrs = boot.allgather(&mine)?;
    let without: Vec<usize> = (0..nranks)
        .filter(|&r| addrs[r].first() == Some(&0))
        .collect();
    let use_ib = without.is_empty() && addrs.iter().any(|a| a.first() == Some(&1));
    if want == Net::Ib && !use_ib && !without.is_empty() {
        return crate::invalid_usage!(
            "COMM_NET=ib, but {} {} no usable InfiniBand device{}",
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
            _ib: world,
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
    let secret = *boot.secret();
    let mut streams: Vec<Option<TcpStream>> = (0..nranks).map(|_| None).collect();
    // Upward first: a higher rank's listener takes the connection even while its owner is
    // still connecting upward itself, so the chain always resolves from the top.
    for &p in peers.iter().filter(|&&p| p > me) {
        let addr = crate::bootstrap::decode_addr(&addrs[p][1..]).ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("rank {p} published no TCP transport address"),
            )
        })?;
        streams[p] = Some(
            dial(addr, me, p, &secret, comm_tag, deadline)
                .map_err(|e| e.context(format!("connecting to rank {p} ({addr}) over TCP")))?,
        );
    }
    if let Some(l) = listener {
        let expected: Vec<usize> = peers.iter().copied().filter(|&p| p < me).collect();
        for (p, s) in accept_all(&l, &expected, me, &secret, comm_tag, deadline)? {
            streams[p] = Some(s);
        }
    }
    let waker = Arc::new(Waker::new(doorbell)?);
    let mut links: Vec<Option<Arc<dyn Link>>> = (0..nranks).map(|_| None).collect();
    for (p, s) in streams.into_iter().enumerate() {
        let Some(s) = s else { continue };
        s.set_nonblocking(true)
            .and_then(|_| s.set_nodelay(true))
            .map_err(|e| Error::from_io("configure a TCP connection", e))?;
        waker.add(s.as_raw_fd(), p)?;
        let link = SocketLink::new(me, p, s, waker.clone());
        crate::info!("rank {me} -> rank {p}: {}", link.describe());
        links[p] = Some(Arc::new(link));
    }
    let w = waker.clone();
    let thread = std::thread::Builder::new()
        .name(format!("comm-net-{me}"))
        .spawn(move || w.run())
        .map_err(|e| Error::from_io("start the network progress thread", e))?;
    Ok(Some(NetWorld {
        links,
        bytes_per_us: crate::bootstrap::iface::speed_of(boot.listen_ip()).unwrap_or(1250.0),
        waker: Some(waker),
        thread: Some(thread),
        _ib: None,
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
    secret: &[u8; 32],
    tag: u64,
    deadline: Option<Instant>,
) -> Result<TcpStream> {
    let left = remaining(deadline)?;
    let mut s = TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(30))).map_err(
        |e| match e.kind() {
            std::io::ErrorKind::ConnectionRefused => Error::new(
                ErrorKind::Remote,
                format!("rank {peer} refused the connection: its process has probably exited"),
            ),
            _ => Error::from_io("connect", e),
        },
    )?;
    s.set_read_timeout(Some(left))
        .and_then(|_| s.set_write_timeout(Some(left)))
        .map_err(|e| Error::from_io("socket timeouts", e))?;
    let mut hello = Vec::with_capacity(12);
    crate::wire::put_u64(&mut hello, tag);
    crate::wire::put_u32(&mut hello, me as u32);
    s.write_all(&hello)
        .map_err(|e| Error::from_io("send the hello", e))?;
    auth::client(&mut s, secret, &context(tag, me, peer))?;
    s.set_read_timeout(None)
        .and_then(|_| s.set_write_timeout(None))
        .map_err(|e| Error::from_io("socket timeouts", e))?;
    Ok(s)
}

/// Accepts the connections of `expected` (lower ranks), refusing anything else.
fn accept_all(
    l: &TcpListener,
    expected: &[usize],
    me: usize,
    secret: &[u8; 32],
    tag: u64,
    deadline: Option<Instant>,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut got: Vec<(usize, TcpStream)> = Vec::new();
    l.set_nonblocking(true)
        .map_err(|e| Error::from_io("listener", e))?;
    while got.len() < expected.len() {
        let missing: Vec<usize> = expected
            .iter()
            .copied()
            .filter(|p| got.iter().all(|g| g.0 != *p))
            .collect();
        if crate::bootstrap::init_aborted() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "aborted (ncclCommAbort) while waiting for {} to connect over TCP",
                    crate::bootstrap::describe_ranks(&missing)
                ),
            ));
        }
        if remaining(deadline).is_err() {
            return crate::timeout_err!(
                "timed out waiting for {} to connect over TCP",
                crate::bootstrap::describe_ranks(&missing)
            );
        }
        let (mut s, from) = match l.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut p = libc::pollfd {
                    fd: l.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut p, 1, 100) };
                continue;
            }
            Err(e) => return Err(Error::from_io("accept a TCP transport connection", e)),
        };
        let handshake = (|| -> Result<usize> {
            s.set_nonblocking(false)
                .and_then(|_| s.set_read_timeout(Some(HANDSHAKE)))
                .and_then(|_| s.set_write_timeout(Some(HANDSHAKE)))
                .map_err(|e| Error::from_io("socket", e))?;
            let mut hello = [0u8; 12];
            s.read_exact(&mut hello)
                .map_err(|e| Error::from_io("read the hello", e))?;
            let their_tag = u64::from_le_bytes(hello[..8].try_into().unwrap());
            let rank = u32::from_le_bytes(hello[8..].try_into().unwrap()) as usize;
            if their_tag != tag {
                return crate::invalid_usage!("it belongs to another communicator");
            }
            if !missing.contains(&rank) {
                return crate::invalid_usage!(
                    "it claims to be rank {rank}, which is not due to connect"
                );
            }
            auth::server(&mut s, secret, &context(tag, rank, me))?;
            s.set_read_timeout(None)
                .and_then(|_| s.set_write_timeout(None))
                .map_err(|e| Error::from_io("socket", e))?;
            Ok(rank)
        })();
        match handshake {
            Ok(rank) => got.push((rank, s)),
            Err(e) => crate::warn!(
                "rank {me}: refused a connection to the TCP transport from {from}: {}",
                e.msg
            ),
        }
    }
    Ok(got)
}
