//! The bootstrap root: a thread that serves one rendezvous and exits.
//!
//! Ranks check in with their listener address. The root knows which ranks to expect from the first
//! valid check-in (nranks, and with several roots which block of ranks is its own). When all are
//! there it tells each rank the listener addresses of its successor and predecessor (see [`Ready`]),
//! so the ranks can form a ring and learn everything else from each other; the root never sends the
//! O(nranks) table to everyone.
//!
//! With several roots (ncclCommInitRankScalable), root k serves the ranks r with
//! r * nroots / nranks == k, and the first rank of the next block also announces itself to root k,
//! so that k can hand the last rank of its block its successor, and hand the announcer its
//! predecessor (the last rank of k's block) in return.
//!
//! The root handles every connection from one poll loop: an unauthenticated, silent or slow client
//! costs a slot until its handshake deadline and never delays anybody else. A checked-in rank may
//! ask which ranks are still missing (it does so when its own timeout expires), and the root tells
//! everybody when its own deadline passes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth::{self, TcpWire};
use super::listener::{accept_all, Handshaking, Progress, MAX_PENDING};
use super::net::{self, kind_from_code, pollfd, Dec, Enc, FrameReader, Header, Waiter, SLICE};
use super::{describe_ranks, UniqueId};
use crate::error::{Error, ErrorKind, Result};

pub(crate) const CHECK_IN: u8 = 1;
pub(crate) const ANNOUNCE: u8 = 2;
pub(crate) const READY: u8 = 3;
pub(crate) const FAIL: u8 = 4;
pub(crate) const QUERY: u8 = 5;
pub(crate) const STATUS: u8 = 6;

/// Everything the root exchanges is tiny; anything bigger is not a rank of ours.
const ROOT_FRAME_LIMIT: u64 = 64 << 10;

/// How long a rank whose own timeout expired waits for the root to say who is missing.
const QUERY_GRACE: Duration = Duration::from_secs(2);

/// The secret proves a client belongs to the job; the context binds the handshake to this root.
pub(crate) fn root_context(root: SocketAddr) -> Vec<u8> {
    let mut c = b"comm-root-v1".to_vec();
    c.extend_from_slice(&net::encode_addr(&root));
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

/// What a rank tells its root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CheckIn {
    pub rank: u32,
    pub nranks: u32,
    pub nroots: u32,
    pub root_index: u32,
    pub tag: u64,
    pub listen: SocketAddr,
}

impl CheckIn {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.rank)
            .u32(self.nranks)
            .u32(self.nroots)
            .u32(self.root_index)
            .u64(self.tag)
            .addr(&self.listen);
        e.0
    }

    pub fn decode(b: &[u8]) -> Result<CheckIn> {
        let mut d = Dec::new(b);
        let c = CheckIn {
            rank: d.u32()?,
            nranks: d.u32()?,
            nroots: d.u32()?,
            root_index: d.u32()?,
            tag: d.u64()?,
            listen: d.addr()?,
        };
        d.finish()?;
        Ok(c)
    }
}

/// What a checked-in rank learns from its root: the listener addresses of its successor and of its
/// predecessor, so that it can connect to the one and watch for the other.
///
/// With several roots the predecessor of the first rank of a block is the last rank of the
/// previous block, which this root does not know: `prev` is then `None`, and the rank learns it from
/// the previous root's answer to its announcement (see [`announced_prev`]), which it waits for anyway;
/// so every rank gets both without an extra round trip.
///
/// Wire format: next address, then a presence byte (0 or 1) and, when 1, the prev address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ready {
    pub next: SocketAddr,
    pub prev: Option<SocketAddr>,
}

impl Ready {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.addr(&self.next);
        match &self.prev {
            Some(p) => e.u8(1).addr(p),
            None => e.u8(0),
        };
        e.0
    }

    pub fn decode(b: &[u8]) -> Result<Ready> {
        let mut d = Dec::new(b);
        let next = d.addr()?;
        let prev = match d.u8()? {
            0 => None,
            1 => Some(d.addr()?),
            k => {
                return crate::internal_err!(
                    "the bootstrap root sent a READY frame with a bad predecessor marker {k}"
                )
            }
        };
        d.finish()?;
        Ok(Ready { next, prev })
    }
}

/// The root's answer to an announcement: the announcer's predecessor, the last rank of the block
/// that root serves.
pub(crate) fn announced_prev(b: &[u8]) -> Result<SocketAddr> {
    let mut d = Dec::new(b);
    let prev = d.addr()?;
    d.finish()?;
    Ok(prev)
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct RootConfig {
    pub handshake_timeout: Option<Duration>,
    /// Counted from the first valid check-in.
    pub init_timeout: Option<Duration>,
}

impl RootConfig {
    pub fn from_env() -> RootConfig {
        RootConfig {
            handshake_timeout: super::handshake_timeout(),
            init_timeout: super::init_timeout(),
        }
    }
}

pub(crate) struct RootHandle {
    #[allow(dead_code)] // joined by tests; detached otherwise
    pub thread: JoinHandle<()>,
    /// Ranks admitted so far; lets tests order events without sleeping.
    #[allow(dead_code)]
    pub admitted: Arc<AtomicUsize>,
}

/// Starts the root service on an already bound, non-blocking listener.
pub(crate) fn spawn(listener: TcpListener, id: &UniqueId, cfg: RootConfig) -> Result<RootHandle> {
    let admitted = Arc::new(AtomicUsize::new(0));
    let root = Root {
        addr: id.root,
        secret: id.secret,
        ctx: root_context(id.root),
        listener: Some(listener),
        paused_until: None,
        incoming: Vec::new(),
        members: BTreeMap::new(),
        announcer: None,
        plan: None,
        departed: BTreeSet::new(),
        deadline: None,
        cfg,
        admitted: admitted.clone(),
        label: format!("bootstrap root {}", id.root),
    };
    let thread = std::thread::Builder::new()
        .name("comm-boot-root".into())
        .spawn(move || root.run())
        .map_err(|e| Error::from_io("starting the bootstrap root thread", e))?;
    Ok(RootHandle { thread, admitted })
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
                "rank {rank} announced itself to root #{}, which expects that from rank {:?}",
                self.index, self.announcer
            ),
        }
    }
}

struct Member {
    stream: TcpStream,
    peer: SocketAddr,
    listen: SocketAddr,
    reader: FrameReader,
}

struct Incoming {
    hs: Handshaking,
    /// Set once authenticated: the check-in frame being read.
    reader: Option<FrameReader>,
}

struct Root {
    addr: SocketAddr,
    secret: [u8; 32],
    ctx: Vec<u8>,
    listener: Option<TcpListener>,
    paused_until: Option<Instant>,
    incoming: Vec<Incoming>,
    members: BTreeMap<usize, Member>,
    announcer: Option<(usize, Member)>,
    plan: Option<Plan>,
    /// Ranks that checked in and then hung up before the rendezvous completed.
    departed: BTreeSet<usize>,
    deadline: Option<Instant>,
    cfg: RootConfig,
    admitted: Arc<AtomicUsize>,
    label: String,
}

enum Who {
    Rank(usize),
    Announcer,
}

impl Root {
    fn run(mut self) {
        loop {
            if self.complete() {
                self.finish();
                return;
            }
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                let msg = format!(
                    "{} (the root waited {:.1} s; see COMM_INIT_TIMEOUT)",
                    self.missing_text(),
                    self.cfg.init_timeout.unwrap_or_default().as_secs_f64()
                );
                crate::warn!("{}: giving up: {msg}", self.label);
                self.fail_all(ErrorKind::Timeout, &msg);
                return;
            }
            if !self.departed.is_empty() && self.members.is_empty() && self.announcer.is_none() {
                crate::warn!(
                    "{}: every rank that checked in has left ({}); the rendezvous is over",
                    self.label,
                    self.missing_text()
                );
                return;
            }
            if let Err(e) = self.turn() {
                crate::warn!("{}: {e}; giving up", self.label);
                self.fail_all(e.kind, &e.msg);
                return;
            }
        }
    }

    fn complete(&self) -> bool {
        let Some(p) = self.plan else { return false };
        self.members.len() == p.end - p.first
            && p.announcer
                .is_none_or(|a| self.announcer.as_ref().is_some_and(|m| m.0 == a))
    }

    fn turn(&mut self) -> Result<()> {
        let now = Instant::now();
        if self.paused_until.is_some_and(|t| now >= t) {
            self.paused_until = None;
        }
        let mut fds = Vec::with_capacity(1 + self.incoming.len() + self.members.len() + 1);
        let lfd = match (&self.listener, self.paused_until) {
            (Some(l), None) => l.as_raw_fd(),
            _ => -1,
        };
        fds.push(pollfd(lfd, libc::POLLIN));
        for inc in &self.incoming {
            let events = if inc.reader.is_some() {
                libc::POLLIN
            } else {
                inc.hs.events()
            };
            fds.push(pollfd(inc.hs.stream().as_raw_fd(), events));
        }
        let member_base = fds.len();
        let mut who = Vec::with_capacity(self.members.len() + 1);
        for (&r, m) in &self.members {
            fds.push(pollfd(m.stream.as_raw_fd(), libc::POLLIN));
            who.push(Who::Rank(r));
        }
        if let Some((_, m)) = &self.announcer {
            fds.push(pollfd(m.stream.as_raw_fd(), libc::POLLIN));
            who.push(Who::Announcer);
        }
        net::poll(&mut fds, Some(SLICE))?;

        self.serve_incoming(&fds[1..member_base]);
        for (j, w) in who.iter().enumerate() {
            if fds[member_base + j].revents != 0 {
                self.serve_member(w);
            }
        }
        if fds[0].revents != 0 {
            if let Some(l) = &self.listener {
                let (fresh, healthy) = accept_all(l, self.cfg.handshake_timeout, &self.label);
                if !healthy {
                    self.paused_until = Some(Instant::now() + SLICE);
                }
                self.incoming
                    .extend(fresh.into_iter().map(|hs| Incoming { hs, reader: None }));
                while self.incoming.len() > MAX_PENDING {
                    let old = self.incoming.remove(0);
                    crate::warn!(
                        "{}: refused connection from {}: too many unfinished handshakes",
                        self.label,
                        old.hs.peer
                    );
                }
            }
        }
        Ok(())
    }

    fn serve_incoming(&mut self, fds: &[libc::pollfd]) {
        let now = Instant::now();
        let secret = self.secret;
        let ctx = self.ctx.clone();
        let lookup = move |c: &[u8]| -> std::result::Result<[u8; 32], String> {
            if c == ctx.as_slice() {
                Ok(secret)
            } else {
                Err("is meant for another bootstrap root or purpose (context mismatch)".into())
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
                    Progress::Done => inc.reader = Some(FrameReader::new(ROOT_FRAME_LIMIT)),
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
                        "{}: refused connection from {}: no complete handshake and check-in within {:?} (silent or half-open client)",
                        self.label,
                        inc.hs.peer,
                        self.cfg.handshake_timeout.unwrap_or_default()
                    );
                }
                Ok(false) => kept.push(inc),
                Err(why) => {
                    crate::warn!(
                        "{}: refused connection from {}: {why}",
                        self.label,
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
            self.admit(inc.hs.into_stream(), peer, h, &body);
        }
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
            self.deadline = self.cfg.init_timeout.map(|t| Instant::now() + t);
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
        if c.nranks as usize != plan.nranks {
            return Err((
                ErrorKind::InvalidUsage,
                format!(
                    "rank {rank} declares {} ranks but the ranks already here declared {}",
                    c.nranks, plan.nranks
                ),
            ));
        }
        if c.tag != plan.tag {
            return Err((
                ErrorKind::InvalidUsage,
                format!(
                    "rank {rank} belongs to another communicator (it was given different unique ids)"
                ),
            ));
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
                if h.kind == QUERY {
                    let text = self.missing_text();
                    let m = match who {
                        Who::Rank(r) => self.members.get(r),
                        Who::Announcer => self.announcer.as_ref().map(|(_, m)| m),
                    };
                    if let Some(m) = m {
                        let mut e = Enc::default();
                        e.text(&text);
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
                "{} of {} never arrived at the bootstrap root {}",
                describe_ranks(&never),
                p.nranks,
                self.addr
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

    fn finish(mut self) {
        // No more check-ins: a late duplicate is refused by the kernel rather than left hanging.
        self.listener = None;
        let Some(p) = self.plan else { return };
        for (&r, m) in &self.members {
            let next = (r + 1) % p.nranks;
            let next_addr = match self.members.get(&next) {
                Some(n) => n.listen,
                None => match &self.announcer {
                    Some((a, n)) if *a == next => n.listen,
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
                next: next_addr,
                prev: prev_addr.map(|m| m.listen),
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

/// A small frame to a rank, which is always waiting to read; bounded in case it is not.
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

/// A rank's connection to a root.
pub(crate) struct RootSession {
    stream: TcpStream,
    root: SocketAddr,
}

impl RootSession {
    /// Connects (retrying while the root is not up yet), authenticates and checks in.
    pub fn open(id: &UniqueId, kind: u8, me: &CheckIn, w: Waiter<'_>) -> Result<RootSession> {
        let who = format!("the bootstrap root {}", id.root);
        let stream = net::connect(id.root, w, true, &who)?;
        let mut wire = TcpWire {
            stream: &stream,
            waiter: w,
            peer: &who,
        };
        auth::client_on(&mut wire, &id.secret, &root_context(id.root))?;
        let body = me.encode();
        net::send_frame(&stream, Header::new(kind, 0, 0, body.len()), &body, w, &who)?;
        Ok(RootSession {
            stream,
            root: id.root,
        })
    }

    /// Waits for the root's go-ahead and returns its payload. When our own deadline passes first we
    /// ask the root who is missing, so that the error names them.
    pub fn wait_ready(&self, w: Waiter<'_>, started: Instant) -> Result<Vec<u8>> {
        let who = format!("the bootstrap root {}", self.root);
        match net::recv_frame(&self.stream, ROOT_FRAME_LIMIT, w, &who) {
            Ok((h, body)) => self.answer(h, &body),
            Err(e) if e.kind == ErrorKind::Timeout => Err(self.ask_who_is_missing(w, started)),
            Err(e) if e.kind == ErrorKind::Remote => Err(Error::new(
                ErrorKind::Remote,
                format!(
                    "{} before the rendezvous completed (did the process that created the unique id exit?)",
                    e.msg
                ),
            )),
            Err(e) => Err(e),
        }
    }

    fn answer(&self, h: Header, body: &[u8]) -> Result<Vec<u8>> {
        match h.kind {
            READY => Ok(body.to_vec()),
            FAIL => {
                let mut d = Dec::new(body);
                let kind = kind_from_code(d.u8()?);
                Err(Error::new(kind, d.text()?))
            }
            k => crate::internal_err!(
                "the bootstrap root {} sent unexpected message kind {k}",
                self.root
            ),
        }
    }

    fn ask_who_is_missing(&self, w: Waiter<'_>, started: Instant) -> Error {
        let waited = started.elapsed().as_secs_f64();
        let who = format!("the bootstrap root {}", self.root);
        let grace = Waiter::new(Some(Instant::now() + QUERY_GRACE), w.abort);
        let asked = net::send_frame(&self.stream, Header::new(QUERY, 0, 0, 0), &[], grace, &who)
            .and_then(|_| net::recv_frame(&self.stream, ROOT_FRAME_LIMIT, grace, &who));
        match asked {
            Ok((h, body)) if h.kind == STATUS => {
                let text = Dec::new(&body).text().unwrap_or_default();
                Error::new(
                    ErrorKind::Timeout,
                    format!("bootstrap init timed out after {waited:.1} s: {text}"),
                )
            }
            Ok((h, body)) if h.kind == FAIL => self
                .answer(h, &body)
                .err()
                .unwrap_or_else(|| Error::new(ErrorKind::Internal, "unreachable")),
            Ok(_) => Error::new(
                ErrorKind::Timeout,
                format!(
                    "bootstrap init timed out after {waited:.1} s, just as the rendezvous at {} completed",
                    self.root
                ),
            ),
            Err(e) => Error::new(
                ErrorKind::Timeout,
                format!(
                    "bootstrap init timed out after {waited:.1} s waiting for the other ranks at {who}, which did not say who is missing ({})",
                    e.msg
                ),
            ),
        }
    }
}
