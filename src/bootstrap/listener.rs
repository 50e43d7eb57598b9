//! Every rank's listener: the one authenticated connection service of a communicator. A thread
//! accepts connections, runs their handshakes side by side from one poll loop (a silent or
//! half-open client only costs a slot until its handshake deadline; past `MAX_PENDING`, or when
//! descriptors run out, the oldest that has not spoken yet is dropped) and hands each
//! authenticated connection on by what it is for: to the handler a module registered for that
//! purpose (`Bootstrap::route`: window operations), or into a stash, keyed by its whole context,
//! until someone asks for it (`Bootstrap::accept`: the bootstrap's rounds, sub-communicators,
//! the TCP transport's sockets). Connections for a sub-communicator may arrive long before this rank
//! calls `sub`; they wait here.
//!
//! The service lives as long as the communicator's bootstrap, so a peer may connect at any time,
//! not only during init. A client proves the communicator's secret for a context that names the
//! communicator, the purpose, a key within it (a socket's index, a child's tag), and both ranks
//! (`PeerCtx`): a connection authenticated for one of those cannot be passed off as another.
//! `Dialer` is the client side, which outlives the bootstrap's borrow (to connect on demand:
//! windows do).

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::auth::{self, Lookup, ServerHandshake, Step, TcpWire};
use super::net::{self, pollfd, Waiter, SLICE};
use crate::error::{Error, Result};

/// Handshakes in flight at once; beyond this the oldest is dropped, so a flood of idle sockets
/// cannot exhaust descriptors.
pub(crate) const MAX_PENDING: usize = 1024;

const PEER_CTX_LABEL: &[u8] = b"comm-peer-v1";

/// How often a rank waiting for a peer's connection checks that the peer still exists.
pub(crate) const PROBE_EVERY: Duration = Duration::from_millis(250);
const PEER_CTX_BYTES: usize = PEER_CTX_LABEL.len() + 8 + 1 + 8 + 4 + 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// The bootstrap rounds of the communicator whose tag is `tag` (see `rounds`).
    Ring = 1,
    /// The rounds of a sub-communicator (`key` is its tag), set up over the parent's listeners.
    Sub = 2,
    /// A rank waiting for this one checks that it is still alive; dropped once authenticated.
    Probe = 3,
    /// A socket of the TCP transport (`key` is its index among the pair's sockets).
    Net = 4,
    /// One-sided window operations from another host (`key` 0).
    Window = 5,
    /// How a TCP link closed in the middle of a message (`key`: see `transport::net::notes`).
    Note = 6,
}

/// What a rank-to-rank connection is for; bound into its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerCtx {
    pub tag: u64,
    pub purpose: Purpose,
    pub key: u64,
    pub from: u32,
    pub to: u32,
}

impl PeerCtx {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(PEER_CTX_BYTES);
        b.extend_from_slice(PEER_CTX_LABEL);
        b.extend_from_slice(&self.tag.to_le_bytes());
        b.push(self.purpose as u8);
        b.extend_from_slice(&self.key.to_le_bytes());
        b.extend_from_slice(&self.from.to_le_bytes());
        b.extend_from_slice(&self.to.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8]) -> Option<PeerCtx> {
        if b.len() != PEER_CTX_BYTES || !b.starts_with(PEER_CTX_LABEL) {
            return None;
        }
        let b = &b[PEER_CTX_LABEL.len()..];
        let purpose = match b[8] {
            1 => Purpose::Ring,
            2 => Purpose::Sub,
            3 => Purpose::Probe,
            4 => Purpose::Net,
            5 => Purpose::Window,
            6 => Purpose::Note,
            _ => return None,
        };
        Some(PeerCtx {
            tag: u64::from_le_bytes(b[0..8].try_into().ok()?),
            purpose,
            key: u64::from_le_bytes(b[9..17].try_into().ok()?),
            from: u32::from_le_bytes(b[17..21].try_into().ok()?),
            to: u32::from_le_bytes(b[21..25].try_into().ok()?),
        })
    }
}

/// Whom a listener serves: connections must be addressed to this rank of this communicator.
#[derive(Clone)]
pub(crate) struct Identity {
    pub secret: [u8; 32],
    pub tag: u64,
    pub rank: usize,
    pub nranks: usize,
}

impl Identity {
    /// The secret a client asking for `ctx` must prove, or why it is refused.
    fn admit(&self, ctx: &[u8]) -> std::result::Result<[u8; 32], String> {
        let Some(c) = PeerCtx::decode(ctx) else {
            return Err("not a bootstrap peer connection (unknown context)".into());
        };
        if c.tag != self.tag {
            return Err(format!(
                "belongs to another communicator (tag {:016x}, this one is {:016x})",
                c.tag, self.tag
            ));
        }
        if c.to as usize != self.rank {
            return Err(format!(
                "is addressed to rank {} but this is rank {}",
                c.to, self.rank
            ));
        }
        if c.from == c.to {
            return Err(format!(
                "claims to come from rank {}, this rank itself",
                c.from
            ));
        }
        if c.from as usize >= self.nranks {
            return Err(format!(
                "claims to come from rank {} of a communicator of {} ranks",
                c.from, self.nranks
            ));
        }
        Ok(self.secret)
    }
}

/// An accepted connection whose server-side handshake is under way, driven without blocking.
pub(crate) struct Handshaking {
    stream: TcpStream,
    pub peer: SocketAddr,
    pub deadline: Option<Instant>,
    hs: ServerHandshake,
    inbuf: Vec<u8>,
    filled: usize,
    out: Vec<u8>,
    out_off: usize,
    finished: bool,
    spoke: bool,
}

pub(crate) enum Progress {
    Pending,
    Done,
    Failed(String),
}

impl Handshaking {
    pub(super) fn new(
        stream: TcpStream,
        peer: SocketAddr,
        timeout: Option<Duration>,
    ) -> Handshaking {
        Handshaking {
            stream,
            peer,
            deadline: timeout.map(|t| Instant::now() + t),
            hs: ServerHandshake::new(),
            inbuf: Vec::new(),
            filled: 0,
            out: Vec::new(),
            out_off: 0,
            finished: false,
            spoke: false,
        }
    }

    pub(super) fn stream(&self) -> &TcpStream {
        &self.stream
    }

    pub(super) fn events(&self) -> i16 {
        if self.out_off < self.out.len() {
            libc::POLLOUT
        } else {
            libc::POLLIN
        }
    }

    /// Whether the client has sent any byte yet.
    fn spoke(&self) -> bool {
        self.spoke
    }

    pub(super) fn context(&self) -> &[u8] {
        self.hs.context()
    }

    pub(super) fn into_stream(self) -> TcpStream {
        self.stream
    }

    pub(super) fn progress(&mut self, lookup: &Lookup<'_>) -> Progress {
        loop {
            while self.out_off < self.out.len() {
                match (&self.stream).write(&self.out[self.out_off..]) {
                    Ok(0) => return Progress::Failed("closed the connection".into()),
                    Ok(n) => self.out_off += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Pending,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Progress::Failed(format!("write failed: {e}")),
                }
            }
            if self.finished {
                return Progress::Done;
            }
            let need = self.hs.need();
            if self.inbuf.len() != need {
                self.inbuf.resize(need, 0);
            }
            while self.filled < need {
                match (&self.stream).read(&mut self.inbuf[self.filled..]) {
                    Ok(0) => {
                        return Progress::Failed(
                            "closed the connection in the middle of the handshake".into(),
                        )
                    }
                    Ok(n) => {
                        self.filled += n;
                        self.spoke = true;
                        if let Some(why) = self.hs.refuses_early(&self.inbuf[..self.filled]) {
                            return Progress::Failed(why);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Pending,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Progress::Failed(format!("read failed: {e}")),
                }
            }
            self.filled = 0;
            match self.hs.on_message(&self.inbuf, lookup) {
                Step::Reply(r) => {
                    self.out = r;
                    self.out_off = 0;
                }
                Step::Done(r) => {
                    self.out = r;
                    self.out_off = 0;
                    self.finished = true;
                }
                Step::Refuse(r, why) => {
                    // One attempt to say no; the peer learns it either way when we close.
                    let _ = (&self.stream).write(&r);
                    return Progress::Failed(why);
                }
            }
        }
    }
}

/// When a listener of this process last could not accept for want of file descriptors, and the
/// error: a rendezvous that then times out says so rather than only that ranks never came.
static OUT_OF_DESCRIPTORS: parking_lot::Mutex<Option<(Instant, String)>> =
    parking_lot::Mutex::new(None);

/// ", and this process could not accept connections meanwhile: ..." when a listener of this
/// process ran out of descriptors since `since`; empty otherwise.
pub(crate) fn accept_trouble_since(since: Instant) -> String {
    match &*OUT_OF_DESCRIPTORS.lock() {
        Some((at, e)) if *at >= since => {
            format!(" (this process could not accept their connections: {e}; raise `ulimit -n`)")
        }
        _ => String::new(),
    }
}

/// Accepts every queued connection. The flag is false when out of descriptors, in which case the
/// caller stops watching the listener for a moment instead of spinning on it.
pub(crate) fn accept_all(
    listener: &TcpListener,
    timeout: Option<Duration>,
    label: &str,
) -> (Vec<Handshaking>, bool) {
    let mut fresh = Vec::new();
    loop {
        match listener.accept() {
            Ok((s, peer)) => {
                if let Err(e) = s.set_nonblocking(true).and_then(|_| s.set_nodelay(true)) {
                    crate::warn!("{label}: dropped connection from {peer}: {e}");
                    continue;
                }
                crate::trace!("{label}: connection from {peer}");
                fresh.push(Handshaking::new(s, peer, timeout));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return (fresh, true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
            Err(e) => {
                let hint = match e.raw_os_error() {
                    Some(libc::EMFILE) | Some(libc::ENFILE) => {
                        *OUT_OF_DESCRIPTORS.lock() = Some((Instant::now(), e.to_string()));
                        " (out of file descriptors: raise `ulimit -n`, or spread ranks over more roots)"
                    }
                    _ => "",
                };
                crate::warn!("{label}: accept failed: {e}{hint}");
                return (fresh, false);
            }
        }
    }
}

/// Takes the authenticated connections of one purpose as they arrive, on the listener's thread:
/// it must only hand them on (to a queue, a thread's wake-up), never serve them there.
pub(crate) type Handler = Box<dyn Fn(PeerCtx, TcpStream) + Send + Sync>;

#[derive(Default)]
struct Shared {
    stash: Mutex<HashMap<Vec<u8>, VecDeque<TcpStream>>>,
    arrived: Condvar,
    /// Registered handlers by purpose, each with the number its `Route` removes it by.
    routes: Mutex<HashMap<u8, (u64, Arc<Handler>)>>,
    next_route: std::sync::atomic::AtomicU64,
    /// How the communicator ended, once a transport said (`Dialer::tell_closed`): the answer
    /// to every later probe, so a rank waiting for this one's connection hears it.
    closed: Mutex<Option<Closed>>,
}

/// A communicator's end as a probe answers it: a transport's own 8-byte code for how it closed
/// (`transport::net::notes`), little-endian.
pub(crate) type Closed = [u8; 8];

impl Shared {
    /// Hands an authenticated connection to its purpose's handler, or stashes it.
    fn deliver(&self, ctx: Vec<u8>, stream: TcpStream) {
        if let Some(c) = PeerCtx::decode(&ctx) {
            let handler = self
                .routes
                .lock()
                .get(&(c.purpose as u8))
                .map(|h| h.1.clone());
            if let Some(h) = handler {
                h(c, stream);
                return;
            }
        }
        self.stash.lock().entry(ctx).or_default().push_back(stream);
        self.arrived.notify_all();
    }
}

/// While it lives, connections of its purpose go to its handler. Dropping it unregisters the
/// handler (later connections are stashed again) unless another registration replaced it.
pub(crate) struct Route {
    shared: std::sync::Weak<Shared>,
    purpose: u8,
    id: u64,
}

impl Drop for Route {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            let mut routes = shared.routes.lock();
            if routes.get(&self.purpose).is_some_and(|r| r.0 == self.id) {
                routes.remove(&self.purpose);
            }
        }
    }
}

pub(crate) struct Listener {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// Shutting it down wakes the thread (its end of the pair reads EOF) and tells it to stop.
    stop: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    pub(super) fn start(
        ip: IpAddr,
        me: Identity,
        handshake_timeout: Option<Duration>,
    ) -> Result<Listener> {
        let listener = net::listen(SocketAddr::new(ip, 0))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::from_io("bootstrap listener address", e))?;
        let (stop, stopped) =
            UnixStream::pair().map_err(|e| Error::from_io("bootstrap listener wake-up pair", e))?;
        let shared = Arc::new(Shared::default());
        let thread_shared = shared.clone();
        let label = format!("bootstrap listener of rank {} ({addr})", me.rank);
        let thread = std::thread::Builder::new()
            .name(format!("comm-boot-{}", me.rank))
            .spawn(move || {
                serve(
                    listener,
                    stopped,
                    thread_shared,
                    me,
                    handshake_timeout,
                    label,
                )
            })
            .map_err(|e| Error::from_io("starting the bootstrap listener thread", e))?;
        Ok(Listener {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends every connection for `purpose` to `handler` from now on, those already stashed
    /// first.
    pub(super) fn route(&self, purpose: Purpose, handler: Handler) -> Route {
        let id = self
            .shared
            .next_route
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let handler = Arc::new(handler);
        let waiting: Vec<(PeerCtx, TcpStream)> = {
            // Registered under the stash's lock, so that none arrives between the two.
            let mut stash = self.shared.stash.lock();
            self.shared
                .routes
                .lock()
                .insert(purpose as u8, (id, handler.clone()));
            let keys: Vec<Vec<u8>> = stash
                .keys()
                .filter(|k| PeerCtx::decode(k).is_some_and(|c| c.purpose == purpose))
                .cloned()
                .collect();
            keys.into_iter()
                .flat_map(|k| {
                    let c = PeerCtx::decode(&k).expect("decoded above");
                    stash
                        .remove(&k)
                        .unwrap_or_default()
                        .into_iter()
                        .map(move |s| (c, s))
                })
                .collect()
        };
        for (c, s) in waiting {
            handler(c, s);
        }
        Route {
            shared: Arc::downgrade(&self.shared),
            purpose: purpose as u8,
            id,
        }
    }

    /// The next authenticated connection whose context is `ctx`, waiting for it if needed.
    /// Every `PROBE_EVERY` of waiting, `alive` checks that the rank expected to connect still
    /// exists; its error ends the wait.
    pub(super) fn take(
        &self,
        ctx: &[u8],
        w: Waiter<'_>,
        what: &dyn Fn() -> String,
        alive: &dyn Fn() -> Result<()>,
    ) -> Result<TcpStream> {
        let mut stash = self.shared.stash.lock();
        let mut next_probe = Instant::now() + PROBE_EVERY;
        loop {
            if let Some(queue) = stash.get_mut(ctx) {
                let stream = queue.pop_front();
                if queue.is_empty() {
                    stash.remove(ctx);
                }
                if let Some(s) = stream {
                    return Ok(s);
                }
            }
            w.check(what)?;
            if Instant::now() >= next_probe {
                // Probing connects and authenticates: not under the lock the listener needs.
                parking_lot::MutexGuard::unlocked(&mut stash, alive)?;
                next_probe = Instant::now() + PROBE_EVERY;
                continue;
            }
            let slice = w.slice();
            self.shared.arrived.wait_for(&mut stash, slice);
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Shut down, not only closed: a child forked since holds a copy of the descriptor,
        // and the thread would read no end of file until that child exited.
        if let Some(stop) = self.stop.take() {
            let _ = stop.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    listener: TcpListener,
    stopped: UnixStream,
    shared: Arc<Shared>,
    me: Identity,
    handshake_timeout: Option<Duration>,
    label: String,
) {
    let lookup = |ctx: &[u8]| me.admit(ctx);
    let mut pending: Vec<Handshaking> = Vec::new();
    let mut paused_until: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if paused_until.is_some_and(|t| now >= t) {
            paused_until = None;
        }
        // Sleep until an event, the nearest handshake deadline or the end of a pause.
        let wake = pending
            .iter()
            .filter_map(|p| p.deadline)
            .chain(paused_until)
            .min()
            .map(|t| t.saturating_duration_since(now));
        let mut fds = Vec::with_capacity(2 + pending.len());
        fds.push(pollfd(stopped.as_raw_fd(), libc::POLLIN));
        // A negative descriptor is skipped by poll, which keeps the indexes below fixed.
        let lfd = if paused_until.is_some() {
            -1
        } else {
            listener.as_raw_fd()
        };
        fds.push(pollfd(lfd, libc::POLLIN));
        fds.extend(
            pending
                .iter()
                .map(|p| pollfd(p.stream().as_raw_fd(), p.events())),
        );
        if let Err(e) = net::poll(&mut fds, wake) {
            crate::warn!("{label}: {e}");
            std::thread::sleep(SLICE);
            continue;
        }
        if fds[0].revents != 0 {
            return;
        }
        let now = Instant::now();
        let mut kept = Vec::with_capacity(pending.len());
        for (i, mut p) in pending.into_iter().enumerate() {
            let outcome = if fds[2 + i].revents != 0 {
                p.progress(&lookup)
            } else {
                Progress::Pending
            };
            match outcome {
                Progress::Done => {
                    let ctx = p.context().to_vec();
                    let probe = PeerCtx::decode(&ctx).filter(|c| c.purpose == Purpose::Probe);
                    if let Some(c) = probe {
                        crate::trace!("{label}: rank {} checked that this rank is alive", c.from);
                        if let Some(b) = *shared.closed.lock() {
                            // One small write to a fresh socket; the drop below ends it.
                            let _ = p.into_stream().write(&b);
                        }
                        continue;
                    }
                    if let Some(c) = PeerCtx::decode(&ctx) {
                        crate::trace!(
                            "{label}: rank {} ({}) connected for {:?}",
                            c.from,
                            p.peer,
                            c.purpose
                        );
                    }
                    shared.deliver(ctx, p.into_stream());
                }
                Progress::Failed(why) => {
                    crate::warn!("{label}: refused connection from {}: {why}", p.peer);
                }
                Progress::Pending if p.deadline.is_some_and(|d| now >= d) => {
                    crate::warn!(
                        "{label}: refused connection from {}: no complete handshake within {} (silent or half-open client)",
                        p.peer,
                        crate::log::limit(handshake_timeout)
                    );
                }
                Progress::Pending => kept.push(p),
            }
        }
        pending = kept;
        if fds[1].revents != 0 {
            let (fresh, healthy) = accept_all(&listener, handshake_timeout, &label);
            pending.extend(fresh);
            if !healthy {
                if pending.is_empty() {
                    paused_until = Some(Instant::now() + SLICE);
                } else {
                    // The connection waits in the backlog: make room for it, so that a flood
                    // of idle connections cannot keep a real peer out until their deadlines.
                    evict(
                        &mut pending,
                        &label,
                        "this process ran out of file descriptors",
                    );
                }
            }
            while pending.len() > MAX_PENDING {
                evict(&mut pending, &label, "too many unfinished handshakes");
            }
        }
    }
}

/// The client side of the service: dials a peer's listener and proves the communicator's secret
/// for one purpose. Cheap to clone, and independent of the bootstrap's lifetime, so that a
/// module can connect on demand long after init.
#[derive(Clone)]
pub(crate) struct Dialer {
    rank: usize,
    tag: u64,
    secret: [u8; 32],
    addrs: Arc<Vec<SocketAddr>>,
    abort: Arc<AtomicBool>,
    service: Arc<Shared>,
}

impl Dialer {
    /// An authenticated connection to `peer` for `purpose` (and `key` within it), non-blocking
    /// and without Nagle. A peer whose listener refuses connections is gone (ncclRemoteError
    /// naming it); the wait ends at `deadline` or when the communicator is aborted.
    pub(crate) fn dial(
        &self,
        peer: usize,
        purpose: Purpose,
        key: u64,
        deadline: Option<Instant>,
    ) -> Result<TcpStream> {
        if peer >= self.addrs.len() || peer == self.rank {
            return crate::internal_err!(
                "rank {} cannot dial rank {peer} of a communicator of {} ranks",
                self.rank,
                self.addrs.len()
            );
        }
        let addr = self.addrs[peer];
        let who = format!("rank {peer} ({addr})");
        let w = Waiter::new(deadline, &self.abort);
        let s = net::connect(addr, w, false, &who)?;
        let ctx = PeerCtx {
            tag: self.tag,
            purpose,
            key,
            from: self.rank as u32,
            to: peer as u32,
        };
        let mut wire = TcpWire {
            stream: &s,
            waiter: w,
            peer: &who,
        };
        auth::client_on(&mut wire, &self.secret, &ctx.encode())?;
        Ok(s)
    }

    /// Where `peer`'s service listens (for messages).
    pub(crate) fn addr(&self, peer: usize) -> Option<SocketAddr> {
        self.addrs.get(peer).copied()
    }

    /// Err (ncclRemoteError) when `peer`'s service refuses connections: its process exited, or
    /// its communicator was destroyed or aborted. A peer that answers, or cannot be reached
    /// within a second (a slow host), counts as alive; the caller's deadline covers those.
    /// Otherwise Ok with how `peer`'s communicator ended if a transport of it said so
    /// (`tell_closed`), in that transport's code.
    pub(crate) fn check_state(&self, peer: usize) -> Result<Option<u64>> {
        let Some(addr) = self.addr(peer) else {
            return crate::internal_err!("rank {peer} is no rank of this communicator");
        };
        let watch = super::Watch {
            addr,
            secret: self.secret,
            ctx: PeerCtx {
                tag: self.tag,
                purpose: Purpose::Probe,
                key: 0,
                from: self.rank as u32,
                to: peer as u32,
            },
        };
        Ok(watch.state(peer, &self.abort)?.map(u64::from_le_bytes))
    }

    /// Records how this rank's communicator ended (the first call wins), for the probes of
    /// ranks still waiting for a connection from it.
    pub(crate) fn tell_closed(&self, code: u64) {
        self.service.closed.lock().get_or_insert(code.to_le_bytes());
    }
}

/// The connection service as the rest of the library sees it.
impl super::Bootstrap {
    /// What dials this communicator's peers, for as long as the caller keeps it.
    pub(crate) fn dialer(&self) -> Dialer {
        Dialer {
            rank: self.rank,
            tag: self.tag,
            secret: self.secret,
            addrs: Arc::new(self.addrs.clone()),
            abort: self.abort.clone(),
            service: self.listener.shared.clone(),
        }
    }

    /// Where this rank's service listens (for messages).
    pub(crate) fn service_addr(&self) -> SocketAddr {
        self.listener.addr()
    }

    /// The tag the service's connections name (for messages and tests).
    pub(crate) fn service_tag(&self) -> u64 {
        self.tag
    }

    /// An authenticated connection to `peer` for `purpose`/`key`; see [`Dialer::dial`].
    pub(crate) fn dial(
        &self,
        peer: usize,
        purpose: Purpose,
        key: u64,
        deadline: Option<Instant>,
    ) -> Result<TcpStream> {
        self.dialer().dial(peer, purpose, key, deadline)
    }

    /// The connection `peer` made to this rank for `purpose`/`key` (non-blocking), waiting for
    /// it until `deadline` or an abort. While it waits it checks that `peer`'s process still
    /// exists, so a dead peer ends the wait at once, named. `what` completes "waiting for rank
    /// N to connect ..." in messages.
    pub(crate) fn accept(
        &self,
        peer: usize,
        purpose: Purpose,
        key: u64,
        deadline: Option<Instant>,
        what: &str,
    ) -> Result<TcpStream> {
        if peer >= self.nranks || peer == self.rank {
            return crate::internal_err!(
                "rank {} cannot take a connection from rank {peer} of {}",
                self.rank,
                self.nranks
            );
        }
        let started = Instant::now();
        let ctx = PeerCtx {
            tag: self.tag,
            purpose,
            key,
            from: peer as u32,
            to: self.rank as u32,
        };
        let watch = super::Watch {
            addr: self.addrs[peer],
            secret: self.secret,
            ctx: PeerCtx {
                purpose: Purpose::Probe,
                key: 0,
                from: self.rank as u32,
                to: peer as u32,
                ..ctx
            },
        };
        let w = Waiter::new(deadline, &self.abort);
        self.listener.take(
            &ctx.encode(),
            w,
            &|| {
                format!(
                    "rank {peer} to connect {what}{}",
                    accept_trouble_since(started)
                )
            },
            &|| watch.alive(peer, &self.abort),
        )
    }

    /// Hands every connection made to this rank for `purpose` to `handler` while the returned
    /// route lives (connections that arrived before are handed over at once).
    pub(crate) fn route(&self, purpose: Purpose, handler: Handler) -> Route {
        self.listener.route(purpose, handler)
    }
}

/// Drops one handshaking connection to make room: the oldest that has sent nothing yet (a real
/// peer speaks at once), else the oldest.
fn evict(pending: &mut Vec<Handshaking>, label: &str, why: &str) {
    let i = pending.iter().position(|p| !p.spoke()).unwrap_or(0);
    let old = pending.remove(i);
    crate::warn!(
        "{label}: refused connection from {}: {why}; it was dropped to make room",
        old.peer
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Running out of descriptors while accepting is named by rendezvous that began before it,
    /// not by later ones.
    #[test]
    fn accept_trouble_is_named_since_it_happened() {
        let before = Instant::now();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let _c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        // Simulated: the accept itself is not made to fail (that would need this whole test
        // process out of descriptors); the record is what accept_all writes when it does.
        *OUT_OF_DESCRIPTORS.lock() =
            Some((Instant::now(), "Too many open files (os error 24)".into()));
        let (fresh, healthy) = accept_all(&l, None, "test");
        assert!(healthy && fresh.len() == 1);
        let said = accept_trouble_since(before);
        assert!(
            said.contains("Too many open files") && said.contains("ulimit -n"),
            "{said}"
        );
        assert_eq!(accept_trouble_since(Instant::now()), "");
        *OUT_OF_DESCRIPTORS.lock() = None;
    }

    fn boots(n: usize) -> Vec<super::super::Bootstrap> {
        let id = super::super::new_unique_id().unwrap();
        super::super::tests::init_all(std::slice::from_ref(&id), n)
    }

    fn soon() -> Option<Instant> {
        Some(Instant::now() + Duration::from_secs(10))
    }

    /// Connections for one purpose and key reach whoever takes exactly that: two sockets of the
    /// TCP transport from one rank, taken in the opposite order, each arrive where they were
    /// meant to.
    #[test]
    fn accepted_connections_are_told_apart_by_purpose_and_key() {
        let _w = super::super::tests::watchdog("told_apart", Duration::from_secs(30));
        let b = boots(3);
        for key in [0u64, 1] {
            let mut s = b[0].dial(2, Purpose::Net, key, soon()).unwrap();
            s.set_nonblocking(false).unwrap();
            s.write_all(&[key as u8 + 10]).unwrap();
        }
        for key in [1u64, 0] {
            let mut s = b[2]
                .accept(0, Purpose::Net, key, soon(), "for the test")
                .unwrap();
            s.set_nonblocking(false).unwrap();
            let mut got = [0u8];
            s.read_exact(&mut got).unwrap();
            assert_eq!(got[0], key as u8 + 10);
        }
        // Rank 1 connected for nothing of this kind: the wait ends at its deadline, named.
        let e = b[2]
            .accept(
                1,
                Purpose::Net,
                0,
                Some(Instant::now() + Duration::from_millis(300)),
                "over TCP (socket 0)",
            )
            .unwrap_err();
        assert!(
            e.msg.contains("rank 1 to connect over TCP (socket 0)"),
            "{}",
            e.msg
        );
    }

    /// A registered route takes its purpose's connections as they come, and those that came
    /// before it; once the route is dropped they are stashed again.
    #[test]
    fn routes_take_their_purpose_at_any_time() {
        let _w = super::super::tests::watchdog("routes", Duration::from_secs(30));
        let b = boots(3);
        let early = b[0].dial(1, Purpose::Window, 0, soon()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let route = b[1].route(
            Purpose::Window,
            Box::new(move |c: PeerCtx, s: TcpStream| {
                tx.lock().unwrap().send((c.from, c.purpose, s)).unwrap();
            }),
        );
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((got.0, got.1), (0, Purpose::Window));
        let _late = b[2].dial(1, Purpose::Window, 0, soon()).unwrap();
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((got.0, got.1), (2, Purpose::Window));
        drop(route);
        let _after = b[2].dial(1, Purpose::Window, 0, soon()).unwrap();
        b[1].accept(2, Purpose::Window, 0, soon(), "again").unwrap();
        drop(early);
    }

    /// A rank waiting for a peer that is gone learns it at once, named, not at its deadline.
    #[test]
    fn waiting_for_a_dead_peer_names_it() {
        let _w = super::super::tests::watchdog("dead_peer", Duration::from_secs(30));
        let mut b = boots(2);
        drop(b.remove(0));
        let t0 = Instant::now();
        let e = b[0]
            .accept(
                0,
                Purpose::Net,
                0,
                Some(Instant::now() + Duration::from_secs(20)),
                "",
            )
            .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert_eq!(e.kind, crate::error::ErrorKind::Remote, "{}", e.msg);
        assert!(e.msg.contains("rank 0 is gone"), "{}", e.msg);
        let e = b[0].dial(0, Purpose::Net, 0, soon()).unwrap_err();
        assert!(e.msg.contains("rank 0"), "{}", e.msg);
    }

    /// A client that claims to be the rank it connects to is refused: no purpose connects a
    /// rank to itself.
    #[test]
    fn a_connection_from_the_rank_itself_is_refused() {
        let me = Identity {
            secret: [1; 32],
            tag: 7,
            rank: 1,
            nranks: 2,
        };
        let ctx = |from: u32| {
            PeerCtx {
                tag: 7,
                purpose: Purpose::Net,
                key: 0,
                from,
                to: 1,
            }
            .encode()
        };
        assert!(me.admit(&ctx(0)).is_ok());
        let e = me.admit(&ctx(1)).unwrap_err();
        assert!(e.contains("this rank itself"), "{e}");
    }
}
