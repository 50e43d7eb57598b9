//! Transports between hosts. `socket` is TCP; every connection goes through the bootstrap's
//! service and proves it knows the communicator's secret.
//!
//! Setup is collective: every rank publishes whether it has a usable InfiniBand device, how many
//! sockets it wants per peer and whether it connects on demand (its `Hello`, carried with its
//! placement in its card, `comm::Card`); then the lower rank of each pair that
//! talks over the network opens that many connections (the smaller of the two ranks' counts) to the higher
//! one: at the link's first use (`on_demand`, NCCL_RUNTIME_CONNECT=1, the default, when every
//! rank asks for it) or at once for every pair (NCCL_RUNTIME_CONNECT=0). The connections go
//! through the bootstrap's connection service (`Bootstrap::dial` / `Bootstrap::accept`): the
//! listener every rank already runs, which authenticates each connection with the HMAC
//! challenge/response bound to the communicator, the pair, the purpose and the socket's index,
//! runs all handshakes side by side from one poll loop, and drops whatever fails (a stray
//! client, garbage, a wrong communicator, a wrong secret, a rank claiming to be another, a
//! half-open connection) without disturbing the real peers; see `bootstrap::listener`. The
//! transport has no listener of its own. A rank waiting for a lower rank's connection checks
//! that the rank still exists, and names it when it does not.
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
//! `COMM_RUNTIME_CONNECT` / `NCCL_RUNTIME_CONNECT` (default 1): TCP links connect at first use;
//! 0 connects every pair at init. InfiniBand (`ib`) follows the same knob: at first use its
//! lower rank dials to exchange the queue pairs' details (`ib::demand`), or every pair's are
//! exchanged in one allgather at init.

pub(crate) mod ib;
mod notes;
mod on_demand;
mod socket;

use crate::bootstrap::{Bootstrap, Purpose};
use crate::error::{Error, Result};
use crate::transport::demand::OnDemand;
use crate::transport::{Doorbell, Link};
use parking_lot::Mutex;
use socket::SocketLink;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// NCCL's cap on sockets per peer (NSOCKS_PERTHREAD x SOCKET_NTHREADS).
pub(crate) const MAX_SOCKETS: usize = 64;

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
    /// Take the connections peers make at their first use of a link (see `on_demand`) and
    /// the notes of links closed in the middle of a message (see `notes`).
    _routes: Vec<crate::bootstrap::Route>,
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

/// What a rank's network transport tells the others at init: whether it can use InfiniBand,
/// its sockets per peer and whether it connects at first use. It travels with the rank's
/// placement in its card (`comm::Card`, brought by the bootstrap's rounds), so that the
/// transport needs no round of its own; every rank then derives the same choices from all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    /// A usable InfiniBand device, and no socket transport asked for.
    ib: bool,
    sockets: u32,
    on_demand: bool,
}

impl Hello {
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.ib as u8);
        crate::wire::put_u32(out, self.sockets);
        out.push(self.on_demand as u8);
    }

    pub(crate) fn decode(r: &mut crate::wire::Reader<'_>) -> Result<Hello> {
        Ok(Hello {
            ib: r.bytes(1)? == [1],
            sockets: r.u32()?,
            on_demand: r.bytes(1)? == [1],
        })
    }
}

/// This rank's `Hello`, with the InfiniBand device it found (or why none) and what was asked.
pub(crate) struct Offer {
    pub(crate) hello: Hello,
    device: Option<Arc<dyn ib::verbs::Device>>,
    why: String,
    choice: NetChoice,
}

impl Offer {
    /// Looks for an InfiniBand device unless sockets were asked for. Done before the cards
    /// are exchanged, which are still to say whether this rank has network peers at all,
    /// so a communicator within one host looks too (as NCCL initialises its network for
    /// every communicator); the device is dropped unused there.
    pub(crate) fn probe(choice: &NetChoice) -> Offer {
        let (device, why) = if choice.net == Net::Socket {
            (None, choice.from.clone())
        } else if crate::env::IB_DISABLE.flag() {
            (None, "COMM_IB_DISABLE=1".to_string())
        } else {
            match ib::probe() {
                Ok(d) => (Some(d), String::new()),
                Err(why) => (None, why),
            }
        };
        Offer {
            hello: Hello {
                ib: device.is_some(),
                sockets: sockets_per_peer() as u32,
                on_demand: crate::env::RUNTIME_CONNECT.flag(),
            },
            device,
            why,
            choice: choice.clone(),
        }
    }

    /// Every rank's `Hello` in an allgather of its own, for callers without the cards
    /// (transport tests).
    #[cfg(test)]
    pub(crate) fn exchange(&self, boot: &Bootstrap) -> Result<Vec<Hello>> {
        let mut mine = Vec::new();
        self.hello.encode(&mut mine);
        boot.allgather(&mine)?
            .iter()
            .map(|b| Hello::decode(&mut crate::wire::Reader::new(b)))
            .collect()
    }
}

/// Connects this rank to every rank in `peers` over TCP or InfiniBand, from every rank's
/// `hellos` (in rank order) and this rank's `offer`. Collective: every rank of the bootstrap
/// calls it where any rank has network peers, and then every rank has some.
#[allow(clippy::too_many_arguments)]
pub(crate) fn connect(
    boot: &Bootstrap,
    peers: &[usize],
    offer: Offer,
    hellos: &[Hello],
    doorbell: Arc<dyn Doorbell>,
    direct: Option<Arc<Waker>>,
    comm_tag: u64,
    deadline: Option<Instant>,
) -> Result<Option<NetWorld>> {
    let me = boot.rank();
    let nranks = boot.nranks();
    let Offer {
        hello,
        device,
        why,
        choice,
    } = offer;
    let want = choice.net;
    let sockets = hello.sockets as usize;
    if hellos.len() != nranks {
        return crate::internal_err!(
            "{} network transport settings for {nranks} ranks",
            hellos.len()
        );
    }
    if peers.iter().any(|&p| p < me) {
        crate::info!(
            "rank {me}: TCP transport of communicator {comm_tag:016x} takes its connections through the bootstrap's service of communicator {:016x}, listening on {}",
            boot.service_tag(),
            boot.service_addr()
        );
    }
    // A failure test can freeze this rank here, with every listener open and nobody connected.
    crate::fault::point("net:published");
    let without: Vec<usize> = (0..nranks).filter(|&r| !hellos[r].ib).collect();
    let use_ib = without.is_empty() && nranks > 1;
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
    // On demand only when every rank asks for it: a rank connecting eagerly waits at init for
    // connections that a rank connecting on demand would make only at first use.
    let eager: Vec<usize> = (0..nranks).filter(|&r| !hellos[r].on_demand).collect();
    if use_ib {
        if let Some(d) = &device {
            crate::info!(
                "network transport: InfiniBand on {}, which every rank has",
                d.name()
            );
        }
        let (links, world) = ib::connect(boot, peers, device, doorbell, eager.is_empty())?;
        if peers.is_empty() {
            return Ok(None);
        }
        return Ok(Some(NetWorld {
            links,
            bytes_per_us: 12_500.0,
            waker: None,
            thread: None,
            ib: world,
            _routes: Vec::new(),
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
    let count = |p: usize| {
        sockets
            .min(hellos[p].sockets as usize)
            .clamp(1, MAX_SOCKETS)
    };
    let (waker, thread_needed) = match direct {
        Some(w) => (w, false),
        None => (Arc::new(Waker::new(Some(doorbell.clone()))?), true),
    };
    let mut links: Vec<Option<Arc<dyn Link>>> = (0..nranks).map(|_| None).collect();
    let notes = Arc::new(notes::Notes::new(boot.dialer()));
    let to = notes.clone();
    let mut routes = vec![boot.route(Purpose::Note, Box::new(move |c, s| to.deliver(c, s)))];
    if eager.is_empty() {
        let mut expect = vec![0; nranks];
        for &p in peers.iter().filter(|&&p| p < me) {
            expect[p] = count(p);
        }
        let arrivals = Arc::new(on_demand::Arrivals::new(
            me,
            expect,
            doorbell,
            waker.clone(),
        ));
        let to = arrivals.clone();
        let route = boot.route(Purpose::Net, Box::new(move |c, s| to.deliver(c, s)));
        let dialer = boot.dialer();
        let timeout = crate::bootstrap::init_timeout();
        for &p in peers {
            let connect = on_demand::Connector {
                pair: on_demand::Pair::new(me, p, dialer.clone(), timeout, "TCP"),
                ends: on_demand::TcpEnds {
                    count: count(p),
                    arrivals: arrivals.clone(),
                    waker: waker.clone(),
                    notes: notes.clone(),
                },
            };
            links[p] = Some(Arc::new(OnDemand::new(Box::new(connect))));
        }
        crate::info!(
            "rank {me}: {} TCP peers, each connected at first use (NCCL_RUNTIME_CONNECT=0 connects them at init)",
            peers.len()
        );
        routes.push(route);
    } else {
        if eager.len() < nranks {
            crate::info!(
                "network transport: every peer connected at init, since {} set NCCL_RUNTIME_CONNECT=0",
                crate::bootstrap::describe_ranks(&eager)
            );
        }
        connect_all(boot, peers, &count, deadline, &waker, &notes, &mut links)?;
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
        _routes: routes,
    }))
}

/// Eager setup (NCCL_RUNTIME_CONNECT=0): this rank's connections to every network peer, now.
fn connect_all(
    boot: &Bootstrap,
    peers: &[usize],
    count: &dyn Fn(usize) -> usize,
    deadline: Option<Instant>,
    waker: &Arc<Waker>,
    notes: &Arc<notes::Notes>,
    links: &mut [Option<Arc<dyn Link>>],
) -> Result<()> {
    let me = boot.rank();
    let mut streams: Vec<Vec<TcpStream>> = (0..links.len()).map(|_| Vec::new()).collect();
    // The lower rank of each pair dials; the higher one's service takes the connection and
    // runs the handshake on its own thread, so dialling never waits for the peer's own setup.
    for &p in peers.iter().filter(|&&p| p > me) {
        for i in 0..count(p) {
            let s = boot
                .dial(p, Purpose::Net, i as u64, deadline)
                .map_err(|e| e.context(format!("connecting to rank {p} over TCP (socket {i})")))?;
            streams[p].push(s);
        }
    }
    for &p in peers.iter().filter(|&&p| p < me) {
        for i in 0..count(p) {
            let what = format!("over TCP (socket {i})");
            streams[p].push(boot.accept(p, Purpose::Net, i as u64, deadline, &what)?);
        }
    }
    for (p, ss) in streams.into_iter().enumerate() {
        if ss.is_empty() {
            continue;
        }
        links[p] = Some(socket_link(me, p, ss, waker, notes)?);
    }
    Ok(())
}

/// The link to rank `peer` over its connected `streams`, at init or at first use: each
/// socket made non-blocking without Nagle's delay and watched by the waker.
pub(super) fn socket_link(
    me: usize,
    peer: usize,
    streams: Vec<TcpStream>,
    waker: &Arc<Waker>,
    notes: &Arc<notes::Notes>,
) -> Result<Arc<dyn Link>> {
    for s in &streams {
        s.set_nonblocking(true)
            .and_then(|_| s.set_nodelay(true))
            .map_err(|e| Error::from_io("configure a TCP connection", e))?;
        waker.add(s.as_raw_fd(), peer)?;
    }
    let link = SocketLink::new(peer, streams, waker.clone()).with_notes(notes.clone());
    crate::info!("rank {me} -> rank {peer}: {}", link.describe());
    Ok(Arc::new(link))
}
