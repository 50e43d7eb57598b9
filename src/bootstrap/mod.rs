//! Bootstrap: the unique id, an authenticated TCP rendezvous, and out-of-band collectives
//! (allgather, barrier, broadcast) between the ranks of a communicator.
//!
//! `new_unique_id` (ncclGetUniqueId) makes a random secret and registers a session with the
//! process's one root service (started with the first id, listening on a local address); the id
//! carries the address and the secret. Each rank starts a listener of its own, checks in with the
//! root and learns its successor's and predecessor's listener addresses: the root sends each rank
//! two addresses, never the table of all N. The ranks then make their connections in ceil(log2 N)
//! rounds, round k to rank r + 2^k and from rank r - 2^k, and exchange listener addresses on
//! them as they go: before round k a rank knows the addresses of ranks r .. r + 2^k, the one it
//! connects to in that round included, and the round doubles that (see [`rounds`], which also
//! runs the later allgathers, barriers and broadcasts on the same connections in as many
//! rounds). A rank may give a card of its own to `init_with`: it travels with the rank's address
//! (to the root at check-in, from the root to the predecessor, then through the rounds), so
//! every rank ends with every card and the communicator needs no allgather of them. No step
//! of init waits on an O(N) chain of ranks. While a rank waits for its round's
//! connection it watches the connections it already has, and in the first round it probes its
//! predecessor's listener, so a dead or failed peer ends the wait at once. Every connection, to
//! the root or between ranks, opens with the HMAC challenge/response of [`auth`], bound to what
//! the connection is for; anything that fails it is logged and dropped without disturbing the
//! rendezvous.
//!
//! Environment:
//! - `COMM_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME`, `COMM_SOCKET_FAMILY`: see [`local_ip`].
//! - `NCCL_COMM_ID=host:port`: the root listens there and is started by rank 0 inside `init`;
//!   `COMM_SECRET` then supplies the secret (see [`new_unique_id`]).
//! - `COMM_INIT_TIMEOUT` (seconds, default 600, 0 = forever): see [`init_timeout`].
//! - `COMM_BOOTSTRAP_HANDSHAKE_TIMEOUT` (seconds, default 5): how long a root or listener keeps a
//!   connection that has not completed its handshake.

pub(crate) mod auth;
mod checkin;
mod id;
pub(crate) mod iface;
mod listener;
mod net;
mod root;
mod rounds;

#[cfg(test)]
pub(crate) mod tests;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub(crate) use id::{new_unique_id, UniqueId};
pub(crate) use iface::local_ip;

use crate::error::{ErrorKind, Result};
pub(crate) use checkin::warn_after;
use checkin::{CheckIn, RootSession};
pub(crate) use listener::{Dialer, PeerCtx, Purpose, Route, PROBE_EVERY};
use listener::{Identity, Listener};
use net::Waiter;
use rounds::{rounds_for, Rounds};

pub(crate) const UNIQUE_ID_BYTES: usize = 128;

thread_local! {
    /// The abort flag of the communicator whose initialisation runs on this thread.
    static INIT_ABORT: std::cell::RefCell<Option<Arc<AtomicBool>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f`, a communicator's initialisation, so that every bootstrap and transport-setup wait
/// inside it gives up soon after `abort` is set: ncclCommAbort on a handle whose non-blocking
/// init is still running sets it, and must not wait for COMM_INIT_TIMEOUT.
pub(crate) fn abortable<R>(abort: &Arc<AtomicBool>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Arc<AtomicBool>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            INIT_ABORT.with(|a| *a.borrow_mut() = prev);
        }
    }
    let _restore = Restore(INIT_ABORT.with(|a| a.replace(Some(abort.clone()))));
    f()
}

/// The abort flag of the initialisation running on this thread, if any.
pub(crate) fn init_abort_flag() -> Option<Arc<AtomicBool>> {
    INIT_ABORT.with(|a| a.borrow().clone())
}

/// Whether the initialisation running on this thread was aborted.
pub(crate) fn init_aborted() -> bool {
    INIT_ABORT.with(|a| {
        a.borrow()
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::Acquire))
    })
}

/// COMM_INIT_TIMEOUT in seconds (0 or negative: wait forever; default 600 s).
pub(crate) fn init_timeout() -> Option<Duration> {
    crate::env::INIT_TIMEOUT.seconds()
}

/// COMM_BOOTSTRAP_HANDSHAKE_TIMEOUT in seconds (0 or negative: no limit; default 5 s).
pub(crate) fn handshake_timeout() -> Option<Duration> {
    crate::env::BOOTSTRAP_HANDSHAKE_TIMEOUT.seconds()
}

/// "rank 3" or "ranks 3, 5-7" for an ascending list.
pub(crate) fn describe_ranks(ranks: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if j == i {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    let plural = ranks.len() != 1;
    format!("rank{} {}", if plural { "s" } else { "" }, parts.join(", "))
}

/// One rank's view of a communicator's bootstrap network.
pub(crate) struct Bootstrap {
    rank: usize,
    nranks: usize,
    tag: u64,
    secret: [u8; 32],
    /// Every rank's listener, indexed by rank: where `sub` reaches the members.
    addrs: Vec<SocketAddr>,
    listener: Listener,
    rounds: Mutex<Rounds>,
    abort: Arc<AtomicBool>,
    formed: Formed,
}

/// How long a rank's bootstrap took to form, for the init timings line (zero for a
/// sub-communicator's, which has no root).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Formed {
    /// From the start of init until the root answered this rank's check-in: the wait for
    /// every rank of its block to arrive.
    pub check_in: Duration,
    /// The ceil(log2 N) rounds that make the connections and gather the listener addresses.
    pub rounds: Duration,
}

/// The communicator's secret and tag, the same on every rank that holds the same ids.
fn comm_identity(ids: &[UniqueId]) -> ([u8; 32], u64) {
    let bytes: Vec<[u8; UNIQUE_ID_BYTES]> = ids.iter().map(UniqueId::to_bytes).collect();
    let mut parts: Vec<&[u8]> = vec![b"comm-secret-v1"];
    parts.extend(bytes.iter().map(|b| &b[..]));
    let secret = auth::hmac(&ids[0].secret, &parts);
    (secret, tag_of(&secret))
}

fn tag_of(secret: &[u8; 32]) -> u64 {
    let h = auth::hmac(secret, &[b"comm-tag-v1"]);
    u64::from_le_bytes(h[..8].try_into().unwrap())
}

/// Where this rank's listener binds: a loopback root means a single-host job, so loopback serves;
/// otherwise the configured interface.
fn listen_ip(root: SocketAddr) -> Result<IpAddr> {
    if root.ip().is_loopback() {
        Ok(net::loopback_like(root.ip()))
    } else {
        local_ip()
    }
}

impl Bootstrap {
    /// Rendezvous `nranks` ranks through the root(s) named in `ids`; see the module documentation.
    ///
    /// With several ids (ncclCommInitRankScalable) rank r checks in with root r * ids.len() / nranks.
    /// Fails after `timeout` with ErrorKind::Timeout naming the ranks that never arrived, or Remote
    /// when the root or a peer vanished.
    #[cfg(test)]
    pub(crate) fn init(
        ids: &[UniqueId],
        rank: usize,
        nranks: usize,
        timeout: Option<Duration>,
    ) -> Result<Bootstrap> {
        Bootstrap::init_with(ids, rank, nranks, timeout, &[]).map(|(b, _)| b)
    }

    /// `init`, gathering every rank's `card` (a record of its own for the others) on the way:
    /// each card travels with its rank's listener address, to the predecessor through the root
    /// and then through the rounds, so it costs no allgather of its own. Returns the cards in
    /// rank order.
    pub(crate) fn init_with(
        ids: &[UniqueId],
        rank: usize,
        nranks: usize,
        timeout: Option<Duration>,
        card: &[u8],
    ) -> Result<(Bootstrap, Vec<Vec<u8>>)> {
        if ids.is_empty() {
            return crate::invalid_arg!("no unique id given");
        }
        if nranks == 0 || nranks > u32::MAX as usize {
            return crate::invalid_arg!("nranks {nranks} is out of range");
        }
        if rank >= nranks {
            return crate::invalid_arg!(
                "rank {rank} is out of range for a communicator of {nranks} ranks"
            );
        }
        if ids.len() > nranks {
            return crate::invalid_arg!(
                "{} unique ids for {nranks} ranks: there can be at most one root per rank",
                ids.len()
            );
        }
        let started = Instant::now();
        // The communicator's abort flag from its first wait on: ncclCommAbort reaches it.
        let abort = init_abort_flag().unwrap_or_default();
        let w = Waiter::new(timeout.map(|t| started + t), &abort);
        let (secret, tag) = comm_identity(ids);
        let nroots = ids.len();
        let my_root = root::root_of(rank, nranks, nroots);
        let id = &ids[my_root];
        let first_of_block = rank == root::first_of(my_root, nranks, nroots);
        if id.root_at_init && first_of_block {
            let l = net::listen(id.root).map_err(|e| {
                e.context(format!(
                    "rank {rank} starts the bootstrap root at NCCL_COMM_ID={}",
                    id.root
                ))
            })?;
            // The process's root service owns the listener until the rendezvous ends.
            root::serve_at(l, id)?;
        }

        let listener = Listener::start(
            listen_ip(id.root)?,
            Identity {
                secret,
                tag,
                rank,
                nranks,
            },
            handshake_timeout(),
        )?;
        let me = CheckIn {
            rank: rank as u32,
            nranks: nranks as u32,
            nroots: nroots as u32,
            root_index: my_root as u32,
            tag,
            listen: listener.addr(),
            card: card.to_vec(),
        };
        let session = RootSession::open(id, root::CHECK_IN, &me, w)?;
        crate::fault::point("init:checked-in");
        // The first rank of a block is the successor of the previous block's last rank, which
        // only the previous root can introduce to it.
        let announce = if nroots > 1 && first_of_block {
            let prev_root = root::root_of((rank + nranks - 1) % nranks, nranks, nroots);
            let announcement = CheckIn {
                root_index: prev_root as u32,
                ..me.clone()
            };
            Some(RootSession::open(
                &ids[prev_root],
                root::ANNOUNCE,
                &announcement,
                w,
            )?)
        } else {
            None
        };
        let warn = checkin::WarnWait {
            rank,
            nranks,
            id_made_here: root::made_here(id),
        };
        let mut ready = checkin::Ready::decode(&session.wait_ready(w, started, Some(&warn))?)?;
        if let Some(a) = &announce {
            // The previous root answers with our predecessor, the last rank of its block.
            let answer = a.wait_ready(w, started, None)?;
            ready.prev = Some(checkin::announced_prev(&answer)?);
        }
        let next_addr = ready.next;
        // Used to probe the predecessor's liveness while waiting for its connection.
        let Some(prev_addr) = ready.prev else {
            return crate::internal_err!(
                "the bootstrap root did not say which rank precedes rank {rank}"
            );
        };
        drop((session, announce));
        let checked_in = started.elapsed();

        let ctx = |from: usize, to: usize| PeerCtx {
            tag,
            purpose: Purpose::Ring,
            key: 0,
            from: from as u32,
            to: to as u32,
        };
        let mut rounds = Rounds::new(rank, nranks);
        // The allgather of listener addresses runs while the connections are made: before
        // round k a rank knows the addresses of ranks r .. r + 2^k, the one it connects to
        // in that round included (the root named the successor, r + 1).
        let seq = rounds.begin_forming();
        // Each entry: a listener address, then that rank's card.
        let mut known = vec![
            [&net::encode_addr(&listener.addr())[..], card].concat(),
            [&net::encode_addr(&next_addr)[..], &ready.next_card].concat(),
        ];
        known.truncate(nranks);
        for k in 0..rounds_for(nranks) {
            let step = 1usize << k;
            let (up, down) = ((rank + step) % nranks, (rank + nranks - step) % nranks);
            let up_addr = net::Dec::new(&known[step]).addr()?;
            // Only the predecessor's listener address is known this early.
            let watch = (k == 0).then(|| Watch {
                addr: prev_addr,
                secret,
                ctx: PeerCtx {
                    purpose: Purpose::Probe,
                    ..ctx(rank, down)
                },
            });
            form_round(
                &listener,
                &secret,
                &mut rounds,
                (up, up_addr, ctx(rank, up)),
                (down, ctx(down, rank), watch),
                w,
            )?;
            if k == 0 {
                // The successor and the predecessor are connected; nothing is exchanged yet.
                crate::fault::point("init:ring");
            }
            rounds.forming_round(k, seq, &mut known, w)?;
        }
        known.rotate_right(rank);
        let cards = known
            .iter()
            .map(|e| e.get(net::ADDR_BYTES..).unwrap_or_default().to_vec())
            .collect();
        let mut boot = Bootstrap::built(
            rank,
            nranks,
            tag,
            secret,
            &known,
            listener,
            rounds,
            abort.clone(),
        )?;
        boot.formed = Formed {
            check_in: checked_in,
            rounds: started.elapsed().saturating_sub(checked_in),
        };
        if rank == 0 {
            crate::info!(
                "bootstrap: {nranks} ranks connected in {:.3} s (root {})",
                started.elapsed().as_secs_f64(),
                ids[0].root
            );
        }
        Ok((boot, cards))
    }

    /// Exchanges listener addresses over freshly made connections and wraps everything up.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        rank: usize,
        nranks: usize,
        tag: u64,
        secret: [u8; 32],
        listener: Listener,
        mut rounds: Rounds,
        abort: Arc<AtomicBool>,
        w: Waiter<'_>,
    ) -> Result<Bootstrap> {
        let mine = net::encode_addr(&listener.addr());
        let all = rounds.allgather(&mine, rounds::ALLGATHER, w)?;
        Bootstrap::built(rank, nranks, tag, secret, &all, listener, rounds, abort)
    }

    /// The bootstrap of a rank whose connections are made and which has every rank's listener
    /// address (`gathered`, in rank order, as `net::encode_addr` wrote them).
    #[allow(clippy::too_many_arguments)]
    fn built(
        rank: usize,
        nranks: usize,
        tag: u64,
        secret: [u8; 32],
        gathered: &[Vec<u8>],
        listener: Listener,
        rounds: Rounds,
        abort: Arc<AtomicBool>,
    ) -> Result<Bootstrap> {
        let addrs = gathered
            .iter()
            .map(|b| net::Dec::new(b).addr())
            .collect::<Result<Vec<_>>>()?;
        crate::trace!(
            "bootstrap: rank {rank}/{nranks} ready, listening on {}",
            listener.addr()
        );
        Ok(Bootstrap {
            rank,
            nranks,
            tag,
            secret,
            addrs,
            listener,
            rounds: Mutex::new(rounds),
            abort,
            formed: Formed::default(),
        })
    }

    /// A new bootstrap among `members` (ranks of self); member i becomes rank i. Every member
    /// calls it with the same list and `tag`; non-members take no part and may be dead.
    pub(crate) fn sub(
        &self,
        members: &[usize],
        tag: u64,
        timeout: Option<Duration>,
    ) -> Result<Bootstrap> {
        if members.is_empty() {
            return crate::invalid_arg!("sub-communicator with no members");
        }
        let mut seen = vec![false; self.nranks];
        for &m in members {
            if m >= self.nranks {
                return crate::invalid_arg!(
                    "member rank {m} is out of range for a communicator of {} ranks",
                    self.nranks
                );
            }
            if std::mem::replace(&mut seen[m], true) {
                return crate::invalid_arg!("rank {m} appears twice among the members");
            }
        }
        let Some(i) = members.iter().position(|&m| m == self.rank) else {
            return crate::invalid_usage!(
                "rank {} builds a sub-communicator it is not a member of",
                self.rank
            );
        };
        let n = members.len();
        crate::fault::point("sub:start");
        let started = Instant::now();
        let w = Waiter::new(timeout.map(|t| started + t), &self.abort);

        // Member lists are part of the derivation: two groups given the same tag still differ.
        let list: Vec<u8> = members
            .iter()
            .flat_map(|&m| (m as u32).to_le_bytes())
            .collect();
        let secret = auth::hmac(
            &self.secret,
            &[
                b"comm-sub-secret-v1",
                &tag.to_le_bytes(),
                &(n as u64).to_le_bytes(),
                &list,
            ],
        );
        let child_tag = tag_of(&secret);
        let listener = Listener::start(
            self.listener.addr().ip(),
            Identity {
                secret,
                tag: child_tag,
                rank: i,
                nranks: n,
            },
            handshake_timeout(),
        )?;
        let ctx = |from: usize, to: usize| PeerCtx {
            tag: self.tag,
            purpose: Purpose::Sub,
            key: child_tag,
            from: from as u32,
            to: to as u32,
        };
        let mut rounds = Rounds::new(i, n);
        for k in 0..rounds_for(n) {
            let step = 1usize << k;
            let (up, down) = (members[(i + step) % n], members[(i + n - step) % n]);
            // The peer's listener is its parent listener, which answers as long as its process
            // lives.
            let watch = Watch {
                addr: self.addrs[down],
                secret: self.secret,
                ctx: PeerCtx {
                    purpose: Purpose::Probe,
                    key: 0,
                    ..ctx(self.rank, down)
                },
            };
            form_round(
                &self.listener,
                &self.secret,
                &mut rounds,
                (up, self.addrs[up], ctx(self.rank, up)),
                (down, ctx(down, self.rank), Some(watch)),
                w,
            )
            .map_err(|e| e.context(format!("sub-communicator {tag:#x} of {n} ranks")))?;
        }
        let child = Bootstrap::assemble(
            i,
            n,
            child_tag,
            secret,
            listener,
            rounds,
            Arc::new(AtomicBool::new(false)),
            w,
        )
        .map_err(|e| e.context(format!("sub-communicator {tag:#x} of {n} ranks")))?;
        crate::trace!(
            "bootstrap: rank {} is rank {i} of sub-communicator {tag:#x} ({n} ranks)",
            self.rank
        );
        Ok(child)
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn nranks(&self) -> usize {
        self.nranks
    }

    /// The address this rank's bootstrap listens on: the interface the transports use too.
    pub(crate) fn listen_ip(&self) -> IpAddr {
        self.listener.addr().ip()
    }

    /// The transports reuse it to authenticate their own connections.
    /// How long this bootstrap took to form (zero for a sub-communicator's).
    pub(crate) fn formed(&self) -> Formed {
        self.formed
    }

    pub(crate) fn secret(&self) -> &[u8; 32] {
        &self.secret
    }

    /// Every rank's contribution, indexed by rank (contributions may differ in length).
    pub(crate) fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let w = Waiter::new(None, &self.abort);
        self.rounds.lock().allgather(mine, rounds::ALLGATHER, w)
    }

    pub(crate) fn barrier(&self) -> Result<()> {
        self.barrier_until(None)
    }

    /// A barrier that fails once `deadline` has passed.
    pub(crate) fn barrier_until(&self, deadline: Option<Instant>) -> Result<()> {
        let w = Waiter::new(deadline, &self.abort);
        self.rounds
            .lock()
            .allgather(&[], rounds::BARRIER, w)
            .map(|_| ())
    }

    /// A barrier that the abort flag does not stop, for teardown: destroy raises the flag (so a
    /// call another thread still makes on the communicator stops), and afterwards the ranks
    /// must still agree that every peer is done with memory they share. `deadline` bounds it,
    /// and a peer that is gone ends it with an error.
    pub(crate) fn barrier_at_teardown(&self, deadline: Instant) -> Result<()> {
        let not_aborted = AtomicBool::new(false);
        let w = Waiter::new(Some(deadline), &not_aborted);
        self.rounds
            .lock()
            .allgather(&[], rounds::BARRIER, w)
            .map(|_| ())
    }

    /// Rank `root`'s bytes, delivered to everyone.
    pub(crate) fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if root >= self.nranks {
            return crate::invalid_arg!(
                "broadcast root {root} is out of range for a communicator of {} ranks",
                self.nranks
            );
        }
        let w = Waiter::new(None, &self.abort);
        self.rounds.lock().broadcast(root, data, w)
    }

    /// Setting the flag makes any call blocked in this bootstrap return an error within ~100 ms.
    pub(crate) fn abort_handle(&self) -> Arc<AtomicBool> {
        self.abort.clone()
    }
}

/// Where a peer's listener is and how to prove we may knock: enough to tell whether the peer's
/// process still exists.
struct Watch {
    addr: SocketAddr,
    secret: [u8; 32],
    ctx: PeerCtx,
}

impl Watch {
    /// Err(Remote) when the peer's listener refuses connections: its process is gone. A peer
    /// that answers, or cannot be reached in time (a slow or partitioned host), counts as alive;
    /// the caller's deadline covers those.
    fn alive(&self, rank: usize, abort: &AtomicBool) -> Result<()> {
        self.state(rank, abort).map(|_| ())
    }

    /// `alive`, and what the peer's service answered: how its communicator ended, where it
    /// said (an alive peer that said nothing just closes the probe).
    fn state(&self, rank: usize, abort: &AtomicBool) -> Result<Option<listener::Closed>> {
        let who = format!("rank {rank} ({})", self.addr);
        let w = Waiter::new(Some(Instant::now() + Duration::from_secs(1)), abort);
        let stream = match net::connect(self.addr, w, false, &who) {
            Ok(s) => s,
            Err(e) if e.kind == ErrorKind::Remote => {
                return crate::remote_err!(
                    "rank {rank} is gone: its bootstrap listener at {} refuses connections (the process exited or was killed)",
                    self.addr
                )
            }
            Err(_) => return Ok(None),
        };
        let mut wire = auth::TcpWire {
            stream: &stream,
            waiter: w,
            peer: &who,
        };
        if let Err(e) = auth::client_steps(&mut wire, &self.secret, &self.ctx.encode()) {
            crate::trace!("liveness probe of {who}: {}", e.msg);
            return Ok(None);
        }
        let mut told: listener::Closed = Default::default();
        Ok(net::read_exact(&stream, &mut told, w, &who)
            .ok()
            .map(|_| told))
    }
}

/// Makes round k's two connections (see [`rounds`]): to `up` and, through our listener, from
/// `down`. While it waits for `down` it checks that `down` still exists when `watch` says how,
/// and that no connection made so far brings a failure notice or a hang-up.
fn form_round(
    listener: &Listener,
    secret: &[u8; 32],
    rounds: &mut Rounds,
    up: (usize, SocketAddr, PeerCtx),
    down: (usize, PeerCtx, Option<Watch>),
    w: Waiter<'_>,
) -> Result<()> {
    let started = Instant::now();
    let (up_rank, up_addr, up_ctx) = up;
    let (down_rank, down_ctx, watch) = down;
    let who = format!("rank {up_rank} ({up_addr})");
    let to_up = net::connect(up_addr, w, false, &who).and_then(|s| {
        let mut wire = auth::TcpWire {
            stream: &s,
            waiter: w,
            peer: &who,
        };
        auth::client_on(&mut wire, secret, &up_ctx.encode()).map(|_| s)
    });
    let to_up = match to_up {
        Ok(s) => s,
        Err(e) => {
            // `down` connects to us and would wait on that connection: give it a moment to
            // arrive and tell it why nothing will come.
            let brief = Waiter::new(Some(Instant::now() + Duration::from_secs(1)), w.abort);
            let no_probe = || Ok(());
            if let Ok(s) = listener.take(&down_ctx.encode(), brief, &String::new, &no_probe) {
                rounds.add_down(s);
            }
            return Err(rounds.fail(e));
        }
    };
    let (me, n) = (rounds.rank(), rounds.nranks());
    let cell = std::cell::RefCell::new(&mut *rounds);
    let alive = || {
        if let Some(watch) = &watch {
            // A peer that left because this rank's listener, out of descriptors, dropped its
            // connection is gone for that reason: say so.
            watch.alive(down_rank, w.abort).map_err(|e| {
                let trouble = listener::accept_trouble_since(started);
                if trouble.is_empty() {
                    e
                } else {
                    crate::error::Error::new(ErrorKind::System, format!("{}{trouble}", e.msg))
                }
            })?;
        }
        match cell.borrow_mut().trouble() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    };
    let from_down = listener
        .take(
            &down_ctx.encode(),
            w,
            &|| {
                format!(
                    "rank {down_rank} to connect to this rank's bootstrap listener{}",
                    listener::accept_trouble_since(started)
                )
            },
            &alive,
        )
        .map_err(|e| match e.kind {
            // `down` may be alive and itself stuck on a rank that failed, with the same
            // deadline as ours: give its notice a moment to arrive, so that the error names
            // the rank that failed rather than the one that waited for it. Twice the grace a
            // data wait takes, as `down` may be in one, lingering for notices itself.
            ErrorKind::Timeout => cell
                .borrow_mut()
                .notice_within(2 * rounds::NOTICE_GRACE)
                .unwrap_or_else(|| e.context(format!("rank {me} of {n}"))),
            _ => e,
        });
    match from_down {
        Ok(s) => {
            rounds.add_round(to_up, s);
            Ok(())
        }
        // `up` is already connected and will wait on it: tell it why nothing comes, so that
        // the cause travels on instead of a bare hang-up.
        Err(e) => {
            rounds.add_up(to_up);
            Err(rounds.fail(e))
        }
    }
}
