//! The bootstrap root service: one thread per process that serves the rendezvous of every unique
//! id created in it.
//!
//! Each id is a session of the service, found by the key in the handshake context (see
//! [`root_context`]). Ranks check in with their listener address. A session knows which ranks to
//! expect from the first valid check-in (nranks, and with several roots which block of ranks is its
//! own). When all are there it tells each rank the listener addresses of its successor and
//! predecessor (see [`super::checkin::Ready`]), so the ranks can make their first connections and learn
//! everything else from each other; the root never sends the O(nranks) table to everyone.
//!
//! With several roots (ncclCommInitRankScalable), root k serves the ranks r with
//! r * nroots / nranks == k, and the first rank of the next block also announces itself to root k,
//! so that k can hand the last rank of its block its successor, and hand the announcer its
//! predecessor (the last rank of k's block) in return. Roots made by one process are sessions of
//! the same service.
//!
//! The service handles every connection of every session from one poll loop: an unauthenticated,
//! silent or slow client costs a slot until its handshake deadline and never delays anybody else. A
//! checked-in rank may ask which ranks are still missing (it does so when its own timeout expires),
//! and a session tells everybody when its own deadline passes.
//!
//! Cost: one thread, one wake-up socket pair and one listening socket per local address, however
//! many ids are made (NCCL spends a thread and a socket on every id, forever if it is never used).
//! A session's state is dropped when its rendezvous completes, or when COMM_INIT_TIMEOUT passes:
//! counted from the id's creation while no rank has used it, and from the first check-in once one
//! has (as before), so a slow but live rendezvous gets the same time it always had.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::auth;
use super::checkin::{CheckIn, Ready};
use super::listener::{accept_all, Handshaking, Progress, MAX_PENDING};
use super::net::{self, pollfd, Enc, FrameReader, Header, Waiter, SLICE};
use super::{describe_ranks, UniqueId};
use crate::error::{Error, ErrorKind, Result};

pub(crate) const CHECK_IN: u8 = 1;
pub(crate) const ANNOUNCE: u8 = 2;
pub(crate) const READY: u8 = 3;
pub(crate) const FAIL: u8 = 4;
pub(crate) const QUERY: u8 = 5;
pub(crate) const STATUS: u8 = 6;
/// As QUERY, from a rank that keeps waiting (its COMM_WARN_AFTER passed, not its timeout).
pub(crate) const PEEK: u8 = 7;

/// Everything the root exchanges is tiny; anything bigger is not a rank of ours.
pub(super) const ROOT_FRAME_LIMIT: u64 = 64 << 10;

/// How long a rank whose own timeout expired waits for the root to say who is missing.
pub(super) const QUERY_GRACE: Duration = Duration::from_secs(2);

const CONTEXT_LABEL: &[u8] = b"comm-root-v2";

/// The secret proves a client belongs to the job; the context binds the handshake to this root and
/// names the id (the session) it is for, by a key derived from the id's secret.
///
/// The key is a one-way function of the secret, so it may travel in the clear: the service answers
/// the handshake with the secret of the session the key names, and only a client that knows that
/// secret can complete it. A client that knows one id's secret therefore cannot join another id's
/// session, whether it sends its own key (it lands in its own session) or the other's (it cannot
/// prove the other secret).
pub(crate) fn root_context(id: &UniqueId) -> Vec<u8> {
    let addr = net::encode_addr(&id.root);
    let key = auth::hmac(&id.secret, &[b"comm-root-session-v1", &addr]);
    let mut c = CONTEXT_LABEL.to_vec();
    c.extend_from_slice(&addr);
    c.extend_from_slice(&key);
    c
}
/// Which root serves `rank`.
pub(crate) fn root_of(rank: usize, nranks: usize, nroots: usize) -> usize {
    (rank as u128 * nroots as u128 / nranks as u128) as usize
}

/// The first rank root `k` serves (`nranks` for k == nroots).
pub(crate) fn first_of(k: usize, nranks: usize, nroots: usize) -> usize {
    (k as u128 * nranks as u128).div_ceil(nroots as u128) as usize
}

/// A fresh unique id, served by this process's root service on a local address.
pub(crate) fn new_id(ip: IpAddr) -> Result<UniqueId> {
    let (id, _) = RootService::global()?.new_id(ip, super::init_timeout())?;
    Ok(id)
}

/// Whether `id` was made by ncclGetUniqueId in this process (its root is this process's service).
pub(crate) fn made_here(id: &UniqueId) -> bool {
    if id.root_at_init {
        return false;
    }
    let global = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    match *global {
        Some((pid, service)) if pid == std::process::id() => {
            service.shared.lock().values().any(|a| *a == id.root)
        }
        _ => false,
    }
}

/// NCCL_COMM_ID mode: serves `id` on `listener`, bound by the caller at the user's address, until
/// its rendezvous ends.
pub(crate) fn serve_at(listener: TcpListener, id: &UniqueId) -> Result<()> {
    RootService::global()?.serve_at(listener, id, super::init_timeout());
    Ok(())
}

/// What the creator of an id can observe of its session.
#[derive(Clone)]
#[cfg_attr(not(test), allow(dead_code))] // read by tests
pub(crate) struct SessionHandle {
    /// Ranks admitted so far; lets tests order events without sleeping.
    pub admitted: Arc<AtomicUsize>,
    ended: Arc<AtomicBool>,
}

#[cfg_attr(not(test), allow(dead_code))]
impl SessionHandle {
    /// Whether the service has dropped the session (completed, timed out, abandoned or expired).
    pub(super) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }
}

/// What the caller hands the service thread.
#[derive(Default)]
struct Inbox {
    listeners: Vec<TcpListener>,
    sessions: Vec<Session>,
}

/// The root service: a thread that serves every session from one poll loop.
///
/// The process-wide one ([`RootService::global`]) starts with the first id and is never stopped.
/// When its last session ends it keeps its thread and listening socket rather than releasing them:
/// the id of every session to come names that socket's port, so releasing it would mean a new port
/// (and a fresh thread) for the next id and a race between an id being made and the service winding
/// down, to save one idle thread that sleeps in poll with no timeout and one descriptor per address.
/// Neither count grows with the number of ids.
pub(crate) struct RootService {
    handshake_timeout: Option<Duration>,
    inbox: Arc<Mutex<Inbox>>,
    /// The listener shared by the ids made for each local address, bound on first use.
    shared: Mutex<HashMap<IpAddr, SocketAddr>>,
    live: Arc<AtomicUsize>,
    /// A byte written here wakes the thread; closing it stops the thread.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

/// This process's service and the process id it was started in: a child forked after the first
/// id inherits the memory but not the thread, so it starts a service of its own.
static GLOBAL: std::sync::Mutex<Option<(u32, &'static RootService)>> = std::sync::Mutex::new(None);

impl RootService {
    /// This process's service, started on first use.
    pub(super) fn global() -> Result<&'static RootService> {
        let mut global = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
        let pid = std::process::id();
        match *global {
            Some((started_in, service)) if started_in == pid => Ok(service),
            _ => {
                // Never stopped: see the type's documentation.
                let service = Box::leak(Box::new(RootService::start(super::handshake_timeout())?));
                *global = Some((pid, service));
                Ok(service)
            }
        }
    }

    /// A service of its own (tests use one to choose timeouts); dropping it stops it, closing every
    /// connection it holds.
    pub(super) fn start(handshake_timeout: Option<Duration>) -> Result<RootService> {
        let (wake, woken) = UnixStream::pair()
            .and_then(|(a, b)| {
                a.set_nonblocking(true)?;
                b.set_nonblocking(true)?;
                Ok((a, b))
            })
            .map_err(|e| Error::from_io("bootstrap root service wake-up socket", e))?;
        let inbox = Arc::new(Mutex::new(Inbox::default()));
        let live = Arc::new(AtomicUsize::new(0));
        let service = Service {
            woken,
            inbox: inbox.clone(),
            live: live.clone(),
            handshake_timeout,
            ports: Vec::new(),
            incoming: Vec::new(),
            sessions: BTreeMap::new(),
            by_ctx: HashMap::new(),
            next_serial: 0,
        };
        let thread = std::thread::Builder::new()
            .name("comm-boot-root".into())
            .spawn(move || service.run())
            .map_err(|e| Error::from_io("starting the bootstrap root service thread", e))?;
        Ok(RootService {
            handshake_timeout,
            inbox,
            shared: Mutex::new(HashMap::new()),
            live,
            wake: Some(wake),
            thread: Some(thread),
        })
    }

    /// A fresh id, served through this service's listener on `ip` (every id for `ip` shares it).
    pub(super) fn new_id(
        &self,
        ip: IpAddr,
        init_timeout: Option<Duration>,
    ) -> Result<(UniqueId, SessionHandle)> {
        let root = self.shared_listener(ip)?;
        let id = UniqueId {
            root,
            secret: auth::random32()?,
            root_at_init: false,
        };
        let handle = self.register(&id, None, init_timeout);
        Ok((id, handle))
    }

    /// Serves `id` on a listener of its own, closed when the session ends (NCCL_COMM_ID mode).
    pub(super) fn serve_at(
        &self,
        listener: TcpListener,
        id: &UniqueId,
        init_timeout: Option<Duration>,
    ) -> SessionHandle {
        self.register(id, Some(listener), init_timeout)
    }

    /// Sessions not yet ended.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) fn live_sessions(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    fn shared_listener(&self, ip: IpAddr) -> Result<SocketAddr> {
        let mut shared = self.shared.lock();
        if let Some(addr) = shared.get(&ip) {
            return Ok(*addr);
        }
        let listener = net::listen(SocketAddr::new(ip, 0))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::from_io("bootstrap root address", e))?;
        self.inbox.lock().listeners.push(listener);
        self.wake();
        shared.insert(ip, addr);
        crate::info!(
            "bootstrap root service listening on {addr} (handshake timeout {})",
            crate::log::limit(self.handshake_timeout)
        );
        Ok(addr)
    }

    fn register(
        &self,
        id: &UniqueId,
        listener: Option<TcpListener>,
        init_timeout: Option<Duration>,
    ) -> SessionHandle {
        let session = Session::new(id, listener, init_timeout);
        let handle = SessionHandle {
            admitted: session.admitted.clone(),
            ended: session.ended.clone(),
        };
        self.live.fetch_add(1, Ordering::AcqRel);
        // The session is in the inbox before the id leaves this function, and the thread empties
        // the inbox after every poll, before it looks at any handshake: no check-in can arrive
        // before its session is known.
        self.inbox.lock().sessions.push(session);
        self.wake();
        handle
    }

    fn wake(&self) {
        if let Some(w) = &self.wake {
            // WouldBlock means wake-ups are already pending, which is just as good.
            let _ = (&*w).write(&[1]);
        }
    }
}

impl Drop for RootService {
    fn drop(&mut self) {
        // Shut down, not only closed (a forked child's copy would keep it open).
        if let Some(w) = self.wake.take() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A listening socket the service accepts on.
struct Port {
    listener: TcpListener,
    /// Out of descriptors: the listener is left alone until then instead of spinning on it.
    paused_until: Option<Instant>,
    label: String,
}

impl Port {
    fn new(listener: TcpListener) -> Port {
        let label = match listener.local_addr() {
            Ok(a) => format!("bootstrap root {a}"),
            Err(_) => "bootstrap root".to_string(),
        };
        Port {
            listener,
            paused_until: None,
            label,
        }
    }

    /// The descriptor to poll, or -1 while paused.
    fn fd(&mut self, now: Instant) -> RawFd {
        if self.paused_until.is_some_and(|t| now >= t) {
            self.paused_until = None;
        }
        match self.paused_until {
            None => self.listener.as_raw_fd(),
            Some(_) => -1,
        }
    }

    fn accept(&mut self, timeout: Option<Duration>, into: &mut Vec<Incoming>) {
        let (fresh, healthy) = accept_all(&self.listener, timeout, &self.label);
        if !healthy {
            self.paused_until = Some(Instant::now() + SLICE);
        }
        into.extend(fresh.into_iter().map(|hs| Incoming {
            hs,
            label: self.label.clone(),
            session: None,
            reader: None,
        }));
    }
}

/// An accepted connection that has not checked in yet.
struct Incoming {
    hs: Handshaking,
    /// The listener it came through, for the log.
    label: String,
    /// Set once authenticated: the session its context named.
    session: Option<u64>,
    /// Set once authenticated: the check-in frame being read.
    reader: Option<FrameReader>,
}

/// What a polled descriptor belongs to.
enum Slot {
    Port(usize),
    OwnPort(u64),
    Member(u64, Who),
}

/// The service thread's state.
struct Service {
    woken: UnixStream,
    inbox: Arc<Mutex<Inbox>>,
    live: Arc<AtomicUsize>,
    handshake_timeout: Option<Duration>,
    ports: Vec<Port>,
    incoming: Vec<Incoming>,
    sessions: BTreeMap<u64, Session>,
    /// Handshake context -> session.
    by_ctx: HashMap<Vec<u8>, u64>,
    next_serial: u64,
}

impl Service {
    fn run(mut self) {
        loop {
            self.take_inbox();
            self.settle();
            match self.turn() {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    crate::warn!("bootstrap root service: {e}; failing every rendezvous under way");
                    let serials: Vec<u64> = self.sessions.keys().copied().collect();
                    for k in serials {
                        if let Some(s) = self.sessions.get(&k) {
                            s.fail_all(e.kind, &e.msg);
                        }
                        self.end(k);
                    }
                    std::thread::sleep(SLICE);
                }
            }
        }
        let serials: Vec<u64> = self.sessions.keys().copied().collect();
        for k in serials {
            if let Some(s) = self.sessions.get(&k) {
                s.fail_all(ErrorKind::Remote, "the bootstrap root service stopped");
            }
            self.end(k);
        }
    }

    fn take_inbox(&mut self) {
        let Inbox {
            listeners,
            sessions,
        } = std::mem::take(&mut *self.inbox.lock());
        self.ports.extend(listeners.into_iter().map(Port::new));
        for s in sessions {
            if self.by_ctx.contains_key(&s.ctx) {
                // Only NCCL_COMM_ID ids can repeat, and their address cannot be bound twice.
                crate::warn!(
                    "{}: a rendezvous for this unique id is already under way; refusing a second one",
                    s.label
                );
                s.ended.store(true, Ordering::Release);
                self.live.fetch_sub(1, Ordering::AcqRel);
                continue;
            }
            let k = self.next_serial;
            self.next_serial += 1;
            self.by_ctx.insert(s.ctx.clone(), k);
            self.sessions.insert(k, s);
        }
    }

    /// Ends the sessions that are complete, timed out, abandoned or expired.
    fn settle(&mut self) {
        let now = Instant::now();
        let over: Vec<u64> = self
            .sessions
            .iter_mut()
            .filter_map(|(&k, s)| s.settle(now).then_some(k))
            .collect();
        for k in over {
            self.end(k);
        }
    }

    fn end(&mut self, k: u64) {
        if let Some(s) = self.sessions.remove(&k) {
            self.by_ctx.remove(&s.ctx);
            s.ended.store(true, Ordering::Release);
            self.live.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// One poll and whatever it found; false once the owner has gone.
    fn turn(&mut self) -> Result<bool> {
        let now = Instant::now();
        let mut fds = vec![pollfd(self.woken.as_raw_fd(), libc::POLLIN)];
        let mut slots = Vec::new();
        for (i, p) in self.ports.iter_mut().enumerate() {
            fds.push(pollfd(p.fd(now), libc::POLLIN));
            slots.push(Slot::Port(i));
        }
        for (&k, s) in self.sessions.iter_mut() {
            if let Some(p) = s.listener.as_mut() {
                fds.push(pollfd(p.fd(now), libc::POLLIN));
                slots.push(Slot::OwnPort(k));
            }
        }
        let incoming_at = fds.len();
        for inc in &self.incoming {
            let events = if inc.reader.is_some() {
                libc::POLLIN
            } else {
                inc.hs.events()
            };
            fds.push(pollfd(inc.hs.stream().as_raw_fd(), events));
        }
        let members_at = fds.len();
        for (&k, s) in &self.sessions {
            for (&r, m) in &s.members {
                fds.push(pollfd(m.stream.as_raw_fd(), libc::POLLIN));
                slots.push(Slot::Member(k, Who::Rank(r)));
            }
            if let Some((_, m)) = &s.announcer {
                fds.push(pollfd(m.stream.as_raw_fd(), libc::POLLIN));
                slots.push(Slot::Member(k, Who::Announcer));
            }
        }
        // Idle, the thread sleeps until a connection or a new id arrives; otherwise it wakes every
        // slice for deadlines.
        let idle = self.sessions.is_empty()
            && self.incoming.is_empty()
            && self.ports.iter().all(|p| p.paused_until.is_none());
        net::poll(&mut fds, if idle { None } else { Some(SLICE) })?;

        if fds[0].revents != 0 && !self.drain_wake_ups() {
            return Ok(false);
        }
        self.take_inbox();
        self.serve_incoming(&fds[incoming_at..members_at]);
        let listeners = slots.iter().filter(|s| !matches!(s, Slot::Member(..)));
        let members = slots.iter().filter(|s| matches!(s, Slot::Member(..)));
        for (j, slot) in members.enumerate() {
            if fds[members_at + j].revents == 0 {
                continue;
            }
            if let Slot::Member(k, who) = slot {
                if let Some(s) = self.sessions.get_mut(k) {
                    s.serve_member(who);
                }
            }
        }
        for (j, slot) in listeners.enumerate() {
            if fds[1 + j].revents == 0 {
                continue;
            }
            let port = match slot {
                Slot::Port(i) => self.ports.get_mut(*i),
                Slot::OwnPort(k) => self.sessions.get_mut(k).and_then(|s| s.listener.as_mut()),
                Slot::Member(..) => None,
            };
            if let Some(p) = port {
                p.accept(self.handshake_timeout, &mut self.incoming);
            }
        }
        while self.incoming.len() > MAX_PENDING {
            let old = self.incoming.remove(0);
            crate::warn!(
                "{}: refused connection from {}: too many unfinished handshakes",
                old.label,
                old.hs.peer
            );
        }
        Ok(true)
    }

    /// False when the owner closed its end: time to stop.
    fn drain_wake_ups(&mut self) -> bool {
        let mut buf = [0u8; 64];
        loop {
            match (&self.woken).read(&mut buf) {
                Ok(0) => return false,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return true,
            }
        }
    }

    fn serve_incoming(&mut self, fds: &[libc::pollfd]) {
        let now = Instant::now();
        let (sessions, by_ctx) = (&self.sessions, &self.by_ctx);
        let lookup = |c: &[u8]| -> std::result::Result<[u8; 32], String> {
            match by_ctx.get(c).and_then(|k| sessions.get(k)) {
                Some(s) => Ok(s.secret),
                None if c.starts_with(CONTEXT_LABEL) => Err(
                    "asks for a unique id this root does not serve (its rendezvous is over, it expired after COMM_INIT_TIMEOUT, or another process made it; with NCCL_COMM_ID, the ranks' COMM_SECRET most likely differ)"
                        .into(),
                ),
                None => {
                    Err("is meant for another bootstrap root or purpose (context mismatch)".into())
                }
            }
        };
        let mut kept = Vec::with_capacity(self.incoming.len());
        let mut arrived = Vec::new();
        for (i, mut inc) in std::mem::take(&mut self.incoming).into_iter().enumerate() {
            let ready = fds.get(i).is_some_and(|f| f.revents != 0);
            let mut outcome = Ok(false);
            if ready && inc.reader.is_none() {
                match inc.hs.progress(&lookup) {
                    Progress::Pending => {}
                    Progress::Done => {
                        inc.session = by_ctx.get(inc.hs.context()).copied();
                        inc.reader = Some(FrameReader::new(ROOT_FRAME_LIMIT));
                    }
                    Progress::Failed(why) => outcome = Err(why),
                }
            }
            if ready && outcome.is_ok() {
                if let Some(r) = inc.reader.as_mut() {
                    let who = format!("the client at {}", inc.hs.peer);
                    outcome = r.progress(inc.hs.stream(), &who).map_err(|e| e.msg);
                }
            }
            match outcome {
                Ok(true) => arrived.push(inc),
                Ok(false) if inc.hs.deadline.is_some_and(|d| now >= d) => {
                    crate::warn!(
                        "{}: refused connection from {}: no complete handshake and check-in within {} (silent or half-open client)",
                        inc.label,
                        inc.hs.peer,
                        crate::log::limit(self.handshake_timeout)
                    );
                }
                Ok(false) => kept.push(inc),
                Err(why) => {
                    crate::warn!(
                        "{}: refused connection from {}: {why}",
                        inc.label,
                        inc.hs.peer
                    );
                }
            }
        }
        self.incoming = kept;
        for inc in arrived {
            let reader = inc.reader.expect("arrived without a frame");
            let peer = inc.hs.peer;
            let (h, body) = reader.into_frame();
            let stream = inc.hs.into_stream();
            match inc.session.and_then(|k| self.sessions.get_mut(&k)) {
                Some(s) => s.admit(stream, peer, h, &body),
                None => {
                    // It authenticated, then its session ended before its check-in arrived.
                    let msg = "the rendezvous of this unique id is over";
                    crate::warn!("{}: refused connection from {peer}: {msg}", inc.label);
                    let _ = send_fail(&stream, ErrorKind::InvalidUsage, msg);
                }
            }
        }
    }
}
/// Which ranks this root serves, fixed by the first valid check-in.
#[derive(Clone, Copy, Debug)]
struct Plan {
    nranks: usize,
    nroots: usize,
    index: usize,
    tag: u64,
    first: usize,
    end: usize,
    /// The first rank of the next root's block, which announces itself here.
    announcer: Option<usize>,
}

impl Plan {
    fn from_first(kind: u8, c: &CheckIn) -> std::result::Result<Plan, String> {
        let (rank, nranks, nroots, index) = (
            c.rank as usize,
            c.nranks as usize,
            c.nroots as usize,
            c.root_index as usize,
        );
        if nranks == 0 || rank >= nranks {
            return Err(format!("rank {rank} is out of range for {nranks} ranks"));
        }
        if nroots == 0 || nroots > nranks || index >= nroots {
            return Err(format!(
                "root #{index} of {nroots} roots does not fit {nranks} ranks"
            ));
        }
        let first = first_of(index, nranks, nroots);
        let end = first_of(index + 1, nranks, nroots);
        let announcer = (nroots > 1).then_some(end % nranks);
        let plan = Plan {
            nranks,
            nroots,
            index,
            tag: c.tag,
            first,
            end,
            announcer,
        };
        let fits = match kind {
            CHECK_IN => (first..end).contains(&rank),
            _ => announcer == Some(rank),
        };
        if !fits {
            return Err(plan.misfit(kind, rank));
        }
        Ok(plan)
    }

    fn misfit(&self, kind: u8, rank: usize) -> String {
        match kind {
            CHECK_IN => format!(
                "rank {rank} belongs to another root: root #{} of {} serves ranks {}-{}",
                self.index,
                self.nroots,
                self.first,
                self.end - 1
            ),
            _ => format!(
                "rank {rank} announced itself to root #{}, which expects that from {}",
                self.index,
                self.announcer
                    .map_or_else(|| "no rank".to_string(), |a| format!("rank {a}"))
            ),
        }
    }
}

struct Member {
    stream: TcpStream,
    peer: SocketAddr,
    listen: SocketAddr,
    card: Vec<u8>,
    reader: FrameReader,
}

/// The rendezvous of one unique id.
struct Session {
    addr: SocketAddr,
    secret: [u8; 32],
    ctx: Vec<u8>,
    /// NCCL_COMM_ID mode: the listener at the user's address, closed when the session ends.
    listener: Option<Port>,
    members: BTreeMap<usize, Member>,
    announcer: Option<(usize, Member)>,
    plan: Option<Plan>,
    /// Ranks that checked in and then hung up before the rendezvous completed.
    departed: BTreeSet<usize>,
    /// Ranks that asked who is missing: their own init timeout expired.
    timed_out: BTreeSet<usize>,
    /// A rank of this communicator (same unique id) declared another rank count: the
    /// rendezvous cannot complete, and the ranks already here are told why.
    conflict: Option<String>,
    /// Until the first check-in, when the unused id expires; after it, when the rendezvous times out.
    deadline: Option<Instant>,
    created: Instant,
    init_timeout: Option<Duration>,
    admitted: Arc<AtomicUsize>,
    ended: Arc<AtomicBool>,
    label: String,
}

enum Who {
    Rank(usize),
    Announcer,
}

impl Session {
    fn new(
        id: &UniqueId,
        listener: Option<TcpListener>,
        init_timeout: Option<Duration>,
    ) -> Session {
        let created = Instant::now();
        Session {
            addr: id.root,
            secret: id.secret,
            ctx: root_context(id),
            listener: listener.map(Port::new),
            members: BTreeMap::new(),
            announcer: None,
            plan: None,
            departed: BTreeSet::new(),
            timed_out: BTreeSet::new(),
            conflict: None,
            deadline: init_timeout.map(|t| created + t),
            created,
            init_timeout,
            admitted: Arc::new(AtomicUsize::new(0)),
            ended: Arc::new(AtomicBool::new(false)),
            label: format!("bootstrap root {} [id {}]", id.root, id.fingerprint()),
        }
    }

    /// Whether the session is over, having done what its end calls for.
    fn settle(&mut self, now: Instant) -> bool {
        if self.complete() {
            self.finish();
            return true;
        }
        if self.deadline.is_some_and(|d| now >= d) {
            if self.plan.is_none() {
                crate::info!(
                    "{}: no rank used this unique id within {:.1} s of its creation; dropping it (see COMM_INIT_TIMEOUT)",
                    self.label,
                    now.duration_since(self.created).as_secs_f64()
                );
                return true;
            }
            let msg = format!(
                "{} (the root waited {:.1} s; see COMM_INIT_TIMEOUT)",
                self.missing_text(),
                self.init_timeout.unwrap_or_default().as_secs_f64()
            );
            crate::warn!("{}: giving up: {msg}", self.label);
            self.fail_all(ErrorKind::Timeout, &msg);
            return true;
        }
        if let Some(msg) = &self.conflict {
            crate::warn!("{}: giving up: {msg}", self.label);
            self.fail_all(ErrorKind::InvalidUsage, msg);
            return true;
        }
        if !self.departed.is_empty() && self.departed.is_subset(&self.timed_out) {
            // Ranks that left after their own timeout: the others time out too, told who never
            // came.
            let msg = format!(
                "bootstrap init timed out: {} (the root waited {:.1} s)",
                self.missing_text(),
                now.duration_since(self.created).as_secs_f64()
            );
            crate::warn!("{}: giving up: {msg}", self.label);
            self.fail_all(ErrorKind::Timeout, &msg);
            return true;
        }
        if !self.departed.is_empty() {
            // A rank that checked in and hung up died or gave up: the rendezvous cannot
            // complete, and the ranks still waiting learn it now rather than at their timeout.
            let msg = format!(
                "{} checked in at the bootstrap root {} and left before the rendezvous completed (the process exited, was killed or gave up)",
                describe_ranks(&self.departed.iter().copied().collect::<Vec<_>>()),
                self.addr
            );
            crate::warn!("{}: giving up: {msg}", self.label);
            self.fail_all(ErrorKind::Remote, &msg);
            return true;
        }
        false
    }

    fn complete(&self) -> bool {
        let Some(p) = self.plan else { return false };
        self.members.len() == p.end - p.first
            && p.announcer
                .is_none_or(|a| self.announcer.as_ref().is_some_and(|m| m.0 == a))
    }

    fn admit(&mut self, stream: TcpStream, peer: SocketAddr, h: Header, body: &[u8]) {
        match self.judge(h.kind, body) {
            Err((kind, msg)) => {
                crate::warn!("{}: refused connection from {peer}: {msg}", self.label);
                let _ = send_fail(&stream, kind, &msg);
            }
            Ok(c) => {
                let rank = c.rank as usize;
                let m = Member {
                    stream,
                    peer,
                    listen: c.listen,
                    card: c.card,
                    reader: FrameReader::new(ROOT_FRAME_LIMIT),
                };
                if h.kind == CHECK_IN {
                    self.members.insert(rank, m);
                } else {
                    self.announcer = Some((rank, m));
                }
                self.departed.remove(&rank);
                self.admitted.fetch_add(1, Ordering::Release);
                crate::trace!("{}: rank {rank} checked in from {peer}", self.label);
            }
        }
    }

    /// Whether a check-in fits this rendezvous; the first valid one defines it.
    fn judge(
        &mut self,
        kind: u8,
        body: &[u8],
    ) -> std::result::Result<CheckIn, (ErrorKind, String)> {
        if kind != CHECK_IN && kind != ANNOUNCE {
            return Err((
                ErrorKind::InvalidUsage,
                format!("sent message kind {kind} where a check-in was expected"),
            ));
        }
        let c = CheckIn::decode(body).map_err(|e| (ErrorKind::InvalidUsage, e.msg))?;
        let rank = c.rank as usize;
        let Some(plan) = self.plan else {
            let plan = Plan::from_first(kind, &c).map_err(|m| (ErrorKind::InvalidArgument, m))?;
            self.plan = Some(plan);
            // From now on the rendezvous gets its full time, however old the id is.
            self.deadline = self.init_timeout.map(|t| Instant::now() + t);
            crate::info!(
                "{}: first rank arrived; expecting {} (root #{} of {} for a communicator of {} ranks)",
                self.label,
                describe_ranks(&(plan.first..plan.end).collect::<Vec<_>>()),
                plan.index,
                plan.nroots,
                plan.nranks
            );
            return Ok(c);
        };
        if c.tag != plan.tag {
            return Err((
                ErrorKind::InvalidUsage,
                format!(
                    "rank {rank} belongs to another communicator (it was given different unique ids)"
                ),
            ));
        }
        if c.nranks as usize != plan.nranks {
            let msg = format!(
                "rank {rank} declares {} ranks but the ranks already here declared {}: the ranks passed different nranks to the init",
                c.nranks, plan.nranks
            );
            // The ranks already here would otherwise wait for COMM_INIT_TIMEOUT and then blame
            // ranks that did arrive.
            self.conflict.get_or_insert(msg.clone());
            return Err((ErrorKind::InvalidUsage, msg));
        }
        if c.nroots as usize != plan.nroots || c.root_index as usize != plan.index {
            return Err((
                ErrorKind::InvalidUsage,
                format!(
                    "rank {rank} thinks this is root #{} of {}, but it is root #{} of {}",
                    c.root_index, c.nroots, plan.index, plan.nroots
                ),
            ));
        }
        let fits = match kind {
            CHECK_IN => (plan.first..plan.end).contains(&rank),
            _ => plan.announcer == Some(rank),
        };
        if !fits {
            return Err((ErrorKind::InvalidArgument, plan.misfit(kind, rank)));
        }
        let earlier = match kind {
            CHECK_IN => self.members.get(&rank),
            _ => self.announcer.as_ref().map(|(_, m)| m),
        };
        if let Some(m) = earlier {
            return Err((
                ErrorKind::InvalidUsage,
                format!(
                    "rank {rank} has already checked in from {}: two processes claim the same rank",
                    m.peer
                ),
            ));
        }
        Ok(c)
    }

    fn serve_member(&mut self, who: &Who) {
        let label = self.label.clone();
        let (rank, m) = match who {
            Who::Rank(r) => match self.members.get_mut(r) {
                Some(m) => (*r, m),
                None => return,
            },
            Who::Announcer => match self.announcer.as_mut() {
                Some((r, m)) => (*r, m),
                None => return,
            },
        };
        let name = format!("rank {rank} ({})", m.peer);
        match m.reader.progress(&m.stream, &name) {
            Ok(false) => {}
            Ok(true) => {
                let reader = std::mem::replace(&mut m.reader, FrameReader::new(ROOT_FRAME_LIMIT));
                let (h, _) = reader.into_frame();
                if h.kind == QUERY || h.kind == PEEK {
                    if h.kind == QUERY {
                        self.timed_out.insert(rank);
                    }
                    let text = self.missing_text();
                    let arrived = self.members.len() + usize::from(self.announcer.is_some());
                    let m = match who {
                        Who::Rank(r) => self.members.get(r),
                        Who::Announcer => self.announcer.as_ref().map(|(_, m)| m),
                    };
                    if let Some(m) = m {
                        // The count after the text: a reader of the text alone ignores it.
                        let mut e = Enc::default();
                        e.text(&text).u32(arrived as u32);
                        let _ = send(&m.stream, STATUS, &e.0, &name);
                    }
                } else {
                    crate::warn!("{label}: {name} sent unexpected message kind {}", h.kind);
                }
            }
            Err(e) => {
                let why = if e.kind == ErrorKind::Remote {
                    "it gave up or exited".to_string()
                } else {
                    e.msg
                };
                crate::warn!("{label}: {name} left before the rendezvous completed ({why})");
                match who {
                    Who::Rank(r) => {
                        self.members.remove(r);
                    }
                    Who::Announcer => self.announcer = None,
                }
                self.departed.insert(rank);
            }
        }
    }

    /// "ranks 3, 5-7 of 8 never arrived at the bootstrap root ...", plus who left early.
    fn missing_text(&self) -> String {
        let Some(p) = self.plan else {
            return format!("no rank has arrived at the bootstrap root {}", self.addr);
        };
        let mut missing: Vec<usize> = (p.first..p.end)
            .filter(|r| !self.members.contains_key(r))
            .collect();
        if let Some(a) = p.announcer {
            if self.announcer.as_ref().is_none_or(|m| m.0 != a) {
                missing.push(a);
            }
        }
        missing.sort_unstable();
        missing.dedup();
        let departed: Vec<usize> = self.departed.iter().copied().collect();
        let never: Vec<usize> = missing
            .iter()
            .copied()
            .filter(|r| !self.departed.contains(r))
            .collect();
        let mut text = if never.is_empty() {
            format!("all ranks reached the bootstrap root {}", self.addr)
        } else {
            format!(
                "{} of {} never arrived at the bootstrap root {}{}",
                describe_ranks(&never),
                p.nranks,
                self.addr,
                super::listener::accept_trouble_since(self.created)
            )
        };
        if !departed.is_empty() {
            text.push_str(&format!(
                "; {} checked in but left before the rendezvous completed",
                describe_ranks(&departed)
            ));
        }
        text
    }

    fn finish(&mut self) {
        // Before anyone hears READY: NCCL_COMM_ID's address must be free again by the time a rank
        // can start its next rendezvous there. A late duplicate is refused (by the kernel, or by
        // the shared listener's handshake since the session is gone) rather than left hanging.
        self.listener = None;
        let Some(p) = self.plan else { return };
        for (&r, m) in &self.members {
            let next = (r + 1) % p.nranks;
            let successor = match self.members.get(&next) {
                Some(n) => n,
                None => match &self.announcer {
                    Some((a, n)) if *a == next => n,
                    _ => {
                        let _ = send_fail(&m.stream, ErrorKind::Internal, "successor unknown");
                        continue;
                    }
                },
            };
            // Unknown only for the first rank of a block when there are several roots: that rank
            // learns it from the previous root, which answers its announcement below.
            let prev_addr = self.members.get(&((r + p.nranks - 1) % p.nranks));
            let ready = Ready {
                next: successor.listen,
                prev: prev_addr.map(|m| m.listen),
                next_card: successor.card.clone(),
            };
            if let Err(e) = send(&m.stream, READY, &ready.encode(), &format!("rank {r}")) {
                crate::warn!(
                    "{}: could not tell rank {r} its neighbours: {e}",
                    self.label
                );
            }
        }
        if let Some((a, m)) = &self.announcer {
            // The announcer's predecessor is the last rank of this block.
            let mut e = Enc::default();
            if let Some(last) = self.members.get(&(p.end - 1)) {
                e.addr(&last.listen);
            }
            if let Err(e) = send(&m.stream, READY, &e.0, &format!("rank {a}")) {
                crate::warn!("{}: could not acknowledge rank {a}: {e}", self.label);
            }
        }
        crate::info!(
            "{}: rendezvous complete, all {} ranks arrived{}",
            self.label,
            p.end - p.first,
            if p.nroots > 1 {
                format!(" (root #{} of {})", p.index, p.nroots)
            } else {
                String::new()
            }
        );
    }

    fn fail_all(&self, kind: ErrorKind, msg: &str) {
        let all = self
            .members
            .values()
            .chain(self.announcer.iter().map(|(_, m)| m));
        for m in all {
            let _ = send_fail(&m.stream, kind, msg);
        }
    }
}

/// A small frame to a rank, which is always waiting to read; bounded in case it is not. The frames
/// are far smaller than a socket's send buffer, so in practice this never waits and one session's
/// stuck rank cannot hold up the service's other sessions.
fn send(s: &TcpStream, kind: u8, body: &[u8], who: &str) -> Result<()> {
    let never = AtomicBool::new(false);
    let w = Waiter::new(Some(Instant::now() + Duration::from_secs(5)), &never);
    net::send_frame(s, Header::new(kind, 0, 0, body.len()), body, w, who)
}

fn send_fail(s: &TcpStream, kind: ErrorKind, msg: &str) -> Result<()> {
    let mut e = Enc::default();
    e.u8(kind.code() as u8).text(msg);
    send(s, FAIL, &e.0, "the client")
}
