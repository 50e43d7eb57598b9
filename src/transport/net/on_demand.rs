//! TCP connections made at first use (NCCL_RUNTIME_CONNECT=1, the default).
//!
//! At init the transport only agrees on the socket count per pair (one allgather, as for
//! eager setup) and registers a route for `Purpose::Net` with the bootstrap's connection
//! service; every network peer gets an `OnDemand` link (`transport::demand`) whose connector is
//! a `Connector` with TCP's `TcpEnds`. The rule both ends know without asking anyone: **the lower rank of a pair
//! dials**, all of the pair's sockets (`Purpose::Net`, key = the socket's index), at its first
//! send, receive or peek on the link; **the higher rank never dials**: the service routes the
//! authenticated connections into a per-peer slot here as they come (ringing the
//! communicator's doorbell), and the higher rank's connector takes them, without blocking, once
//! all of them are there. Authentication is the service's, as for eager setup.
//!
//! Why this cannot deadlock a correct NCCL program. A dial waits only for the peer's service
//! thread, which runs from the peer's bootstrap to its destroy whatever the peer's executor is
//! doing, so the lower rank's first use never waits on the higher rank's program. The higher
//! rank's first use waits for the lower rank to touch the link; every message on the link has a
//! receiver that touches the same link: when the higher rank receives, the lower one sends to
//! it; when the higher rank sends, the lower one receives from it, and a program correct for
//! NCCL already lets that send wait for its receiver (NCCL's own sends may). So the connection
//! adds no wait that the message itself did not already have. The dial does block the lower
//! rank's executor for a connect and a handshake with a live service (bounded by the deadline
//! and the communicator's abort), not on anything its peer's program must do.
//!
//! A receive from any source peeks every candidate link: on a lower rank that is a first use,
//! so it dials every higher peer it looks at (an any-source receive costs a connection to each
//! peer that could send); on a higher rank it only looks for connections that arrived.
//!
//! Other rules kept from eager setup: the deadline is the init timeout, counted from this
//! rank's first use of the link; a peer that cannot be reached by then is named with its
//! service's address. While the higher rank waits, `check_peer` probes the peer's service (a
//! `Purpose::Probe` dial, every `PROBE_EVERY` after the first), so a peer whose process died,
//! or which destroyed or aborted its communicator, ends the wait with an error naming it
//! rather than at the deadline. A higher rank that closes a link before it was connected
//! answers the lower rank's connections, when they come, with the close a connected link
//! would have sent (abort, failure, whom it lost). A lower rank that closes first dials
//! nobody (that would mean dialling every peer it never used at an abort): it records how it
//! ended with its service, which answers every later probe with it, so a peer waiting for its
//! dial learns it at its next probe while the communicator exists, and that it is gone once
//! the service goes away (destroy, abort). So a rank that first reaches a failed peer after that peer destroyed its communicator
//! learns only that it is gone (ncclRemoteError naming it), not why it failed (a disagreement
//! on the operation, a timeout), which a link connected at init would have carried.
//! Connections the service routed here that nobody took are held in the slots and closed
//! with the communicator.
//!
//! `Pair` and `Connector` hold what does not depend on TCP (who dials, the deadline from first
//! use, the probe, the messages naming the peer); a transport brings its `Ends` (how the lower
//! rank makes the link, where the higher rank finds it). InfiniBand's links made at first use
//! (`ib::demand`) share them.
//!
//! Rejected alternative: each sender dialling for its own direction would need a socket set per
//! direction (twice the descriptors) or a protocol to merge two dials into one pair; with the
//! lower rank dialling, a pair keeps the one set of bidirectional sockets it has when eager.

use super::socket::SocketLink;
use super::Waker;
use crate::bootstrap::{Dialer, PeerCtx, Purpose};
use crate::error::{Error, Result};
use crate::transport::demand::Connect;
use crate::transport::{Closing, Doorbell, Link};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The connections the service routed to this rank, by lower peer, until its link takes them.
pub(super) struct Arrivals {
    me: usize,
    /// Sockets expected from each rank (0: none; a rank this one dials, or no network peer).
    expect: Vec<usize>,
    slots: Mutex<HashMap<usize, Slot>>,
    doorbell: Arc<dyn Doorbell>,
    waker: Arc<Waker>,
    /// Links closed as soon as they arrived (this end was closed first), kept open until
    /// destroy so that the peer reads the close before the end of stream.
    told: Mutex<Vec<SocketLink>>,
}

/// One lower peer's sockets by index, and how this end was closed if it was before they came.
#[derive(Default)]
struct Slot {
    sockets: Vec<Option<TcpStream>>,
    closed: Option<(Closing, Option<usize>)>,
}

impl Slot {
    fn complete(&self) -> bool {
        !self.sockets.is_empty() && self.sockets.iter().all(|s| s.is_some())
    }

    fn take(&mut self) -> Vec<TcpStream> {
        std::mem::take(&mut self.sockets)
            .into_iter()
            .flatten()
            .collect()
    }
}

impl Arrivals {
    pub(super) fn new(
        me: usize,
        expect: Vec<usize>,
        doorbell: Arc<dyn Doorbell>,
        waker: Arc<Waker>,
    ) -> Arrivals {
        Arrivals {
            me,
            expect,
            slots: Mutex::new(HashMap::new()),
            doorbell,
            waker,
            told: Mutex::new(Vec::new()),
        }
    }

    /// The route's handler, on the service's thread: files the connection and rings.
    pub(super) fn deliver(&self, c: PeerCtx, s: TcpStream) {
        let from = c.from as usize;
        let n = self.expect.get(from).copied().unwrap_or(0);
        if n == 0 || c.key as usize >= n {
            crate::warn!(
                "rank {}: dropped a TCP transport connection from rank {from} (socket {}): this rank expects {n} from it",
                self.me,
                c.key
            );
            return;
        }
        let mut slots = self.slots.lock();
        let slot = slots.entry(from).or_default();
        if slot.sockets.is_empty() {
            slot.sockets = (0..n).map(|_| None).collect();
        }
        if slot.sockets[c.key as usize].is_some() {
            crate::warn!(
                "rank {}: dropped a second TCP transport connection from rank {from} for socket {}",
                self.me,
                c.key
            );
            return;
        }
        slot.sockets[c.key as usize] = Some(s);
        if let (true, Some((how, lost))) = (slot.complete(), slot.closed) {
            let streams = slot.take();
            drop(slots);
            self.tell_closed(from, streams, how, lost);
            return;
        }
        drop(slots);
        self.doorbell.ring();
    }

    /// This end of `peer`'s link was closed before it was connected: connections that come
    /// later are answered with the close, as a connected link would have told it.
    fn close(&self, peer: usize, how: Closing, lost: Option<usize>) {
        let mut slots = self.slots.lock();
        let slot = slots.entry(peer).or_default();
        slot.closed.get_or_insert((how, lost));
        if slot.complete() {
            let streams = slot.take();
            drop(slots);
            self.tell_closed(peer, streams, how, lost);
        }
    }

    fn tell_closed(&self, peer: usize, streams: Vec<TcpStream>, how: Closing, lost: Option<usize>) {
        if streams
            .iter()
            .any(|s| s.set_nonblocking(true).and(s.set_nodelay(true)).is_err())
        {
            return;
        }
        let link = SocketLink::new(peer, streams, self.waker.clone());
        link.close(how, lost);
        self.told.lock().push(link);
    }

    /// Every socket of `peer`, once all of them arrived.
    fn take(&self, peer: usize) -> Option<Vec<TcpStream>> {
        let mut slots = self.slots.lock();
        let slot = slots.get_mut(&peer)?;
        if !slot.complete() {
            return None;
        }
        let streams = slot.take();
        slots.remove(&peer);
        Some(streams)
    }

    fn complete(&self, peer: usize) -> bool {
        self.slots.lock().get(&peer).is_some_and(|s| s.complete())
    }
}

/// What a network connector made at first use knows of its pair, whatever carries the link
/// (TCP here, InfiniBand in `ib::demand`): who dials, the deadline counted from the first use,
/// the rate-limited probe of a peer this rank waits for, and how the peer is named.
pub(super) struct Pair {
    pub(super) me: usize,
    pub(super) peer: usize,
    pub(super) dialer: Dialer,
    /// The init timeout, counted from the first use.
    timeout: Option<Duration>,
    /// What carries the link, for messages ("TCP", "InfiniBand").
    over: &'static str,
    /// When the link was first used, and when the peer's service is next probed.
    used: Mutex<Option<(Instant, Instant)>>,
}

impl Pair {
    pub(super) fn new(
        me: usize,
        peer: usize,
        dialer: Dialer,
        timeout: Option<Duration>,
        over: &'static str,
    ) -> Pair {
        Pair {
            me,
            peer,
            dialer,
            timeout,
            over,
            used: Mutex::new(None),
        }
    }

    /// The lower rank of a pair dials; see the module doc.
    pub(super) fn dials(&self) -> bool {
        self.me < self.peer
    }

    /// "rank 5 (10.0.0.2:4000)".
    pub(super) fn who(&self) -> String {
        match self.dialer.addr(self.peer) {
            Some(a) => format!("rank {} ({a})", self.peer),
            None => format!("rank {}", self.peer),
        }
    }

    /// `e`, blamed on the peer unless it names another rank.
    pub(super) fn named(&self, mut e: Error) -> Error {
        e.lost.get_or_insert(self.peer);
        e
    }

    /// Records the first use (once) and returns the deadline it starts.
    pub(super) fn first_use(&self) -> Option<Instant> {
        let started = self
            .used
            .lock()
            .get_or_insert_with(|| {
                let now = Instant::now();
                (now, now + crate::bootstrap::PROBE_EVERY)
            })
            .0;
        self.timeout.map(|t| started + t)
    }

    /// The error of a higher rank whose lower peer has not connected by `deadline`.
    pub(super) fn overdue(&self, deadline: Option<Instant>) -> Result<()> {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let mut e = Error::new(
                crate::error::ErrorKind::Timeout,
                format!(
                    "{} did not connect over {} within {} of this rank's first use of the link (it dials when it first sends to or receives from this rank)",
                    self.who(),
                    self.over,
                    crate::log::limit(self.timeout)
                ),
            );
            e.lost = Some(self.peer);
            return Err(e);
        }
        Ok(())
    }

    /// While a higher rank waits for its peer's dial: probes the peer's service, at most
    /// every `PROBE_EVERY` after the first use, so that a peer that is gone is named.
    pub(super) fn probe(&self) -> Result<()> {
        {
            let mut used = self.used.lock();
            let Some((_, next)) = used.as_mut() else {
                return Ok(());
            };
            let now = Instant::now();
            if now < *next {
                return Ok(());
            }
            *next = now + crate::bootstrap::PROBE_EVERY;
        }
        let told = self.dialer.check_state(self.peer).map_err(|e| {
            self.named(e.context(format!(
                "waiting for rank {} to connect over {}",
                self.peer, self.over
            )))
        })?;
        match told.and_then(super::notes::decode) {
            Some((how, lost)) => {
                let mut e = Error::lost_peer(
                    lost.unwrap_or(self.peer),
                    format!(
                        "{} (it never connected to this rank)",
                        how.describe(self.peer, lost)
                    ),
                );
                e.kind = how.kind();
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// "tcp to rank 5 (...), not connected yet (this rank dials)", `kind` being "tcp".
    pub(super) fn describe(&self, kind: &str) -> String {
        if self.dials() {
            format!(
                "{kind} to {}, not connected yet (this rank dials)",
                self.who()
            )
        } else {
            format!(
                "{kind} to {}, not connected yet (it dials at its first use)",
                self.who()
            )
        }
    }
}

/// What a network transport brings to a connector made at first use (`Connector` does the
/// rest, the same for every transport).
pub(super) trait Ends: Send + Sync {
    /// "tcp", "ib": how `describe` names the link.
    const KIND: &'static str;
    /// The lower rank's first use: dials `pair.peer` and makes the link (the connector adds
    /// who and what to an error).
    fn dial(&self, pair: &Pair, deadline: Option<Instant>) -> Result<Arc<dyn Link>>;
    /// The higher rank: the link once `peer`'s dial was served here, or why it was not.
    fn take(&self, peer: usize) -> Result<Option<Arc<dyn Link>>>;
    /// The higher rank: whether `peer`'s dial was served (the next `take` has the outcome).
    fn served(&self, peer: usize) -> bool;
    /// The higher rank's end was closed before it was connected.
    fn close(&self, peer: usize, how: Closing, lost: Option<usize>);
}

/// One network peer's connector; see the module doc.
pub(super) struct Connector<E> {
    pub(super) pair: Pair,
    pub(super) ends: E,
}

impl<E: Ends> Connect for Connector<E> {
    fn poll(&self) -> Result<Option<Arc<dyn Link>>> {
        let pair = &self.pair;
        let deadline = pair.first_use();
        if pair.dials() {
            return self.ends.dial(pair, deadline).map(Some).map_err(|e| {
                pair.named(e.context(format!(
                    "connecting to rank {} over {} at first use",
                    pair.peer, pair.over
                )))
            });
        }
        if let Some(link) = self.ends.take(pair.peer)? {
            return Ok(Some(link));
        }
        pair.overdue(deadline)?;
        Ok(None)
    }

    fn check_peer(&self) -> Result<()> {
        if self.pair.dials() || self.ends.served(self.pair.peer) {
            // The dial reports its own failures; what a served dial made is taken at the next
            // poll, whatever became of the peer since.
            return Ok(());
        }
        self.pair.probe()
    }

    fn close(&self, how: Closing, lost: Option<usize>) {
        if self.pair.dials() {
            // The peer may be waiting for this rank's dial: its probes hear how it ended.
            self.pair
                .dialer
                .tell_closed(super::notes::encode(how, lost));
        } else {
            self.ends.close(self.pair.peer, how, lost);
        }
    }

    fn describe(&self) -> String {
        self.pair.describe(E::KIND)
    }
}

/// TCP's part of a connector: the pair's sockets.
pub(super) struct TcpEnds {
    pub(super) count: usize,
    pub(super) arrivals: Arc<Arrivals>,
    pub(super) waker: Arc<Waker>,
    pub(super) notes: Arc<super::notes::Notes>,
}

impl Ends for TcpEnds {
    const KIND: &'static str = "tcp";

    fn dial(&self, pair: &Pair, deadline: Option<Instant>) -> Result<Arc<dyn Link>> {
        let mut streams = Vec::with_capacity(self.count);
        for i in 0..self.count {
            let s = pair
                .dialer
                .dial(pair.peer, Purpose::Net, i as u64, deadline)
                .map_err(|e| e.context(format!("socket {i}")))?;
            streams.push(s);
        }
        super::socket_link(pair.me, pair.peer, streams, &self.waker, &self.notes)
    }

    fn take(&self, peer: usize) -> Result<Option<Arc<dyn Link>>> {
        self.arrivals
            .take(peer)
            .map(|streams| {
                super::socket_link(self.arrivals.me, peer, streams, &self.waker, &self.notes)
            })
            .transpose()
    }

    fn served(&self, peer: usize) -> bool {
        self.arrivals.complete(peer)
    }

    fn close(&self, peer: usize, how: Closing, lost: Option<usize>) {
        self.arrivals.close(peer, how, lost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::tests::{init_all, watchdog};
    use crate::bootstrap::{Bootstrap, Route, PROBE_EVERY};
    use crate::error::ErrorKind;

    fn pair() -> Vec<Bootstrap> {
        let id = crate::bootstrap::new_unique_id().unwrap();
        init_all(std::slice::from_ref(&id), 2)
    }

    type TcpConnect = Connector<TcpEnds>;

    /// `b`'s connector for its link to `peer` (one socket), with its route.
    fn connector(b: &Bootstrap, peer: usize, timeout: Duration) -> (TcpConnect, Route) {
        let me = b.rank();
        let waker = Arc::new(Waker::direct().unwrap());
        let mut expect = vec![0; b.nranks()];
        if peer < me {
            expect[peer] = 1;
        }
        let arrivals = Arc::new(Arrivals::new(me, expect, waker.clone(), waker.clone()));
        let to = arrivals.clone();
        let route = b.route(Purpose::Net, Box::new(move |c, s| to.deliver(c, s)));
        let c = Connector {
            pair: Pair::new(me, peer, b.dialer(), Some(timeout), "TCP"),
            ends: TcpEnds {
                count: 1,
                arrivals,
                waker,
                notes: Arc::new(super::super::notes::Notes::new(b.dialer())),
            },
        };
        (c, route)
    }

    fn wait_link(c: &TcpConnect) -> Arc<dyn Link> {
        let t0 = Instant::now();
        loop {
            if let Some(l) = c.poll().unwrap() {
                return l;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no connection came");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The lower rank's first poll dials; the higher rank's poll finds the connection its route
    /// filed; neither makes anything before its first poll.
    #[test]
    fn the_lower_rank_dials_and_the_higher_one_takes_the_connection() {
        let _w = watchdog("lower_dials", Duration::from_secs(30));
        let b = pair();
        let (hi, _r1) = connector(&b[1], 0, Duration::from_secs(10));
        let (lo, _r0) = connector(&b[0], 1, Duration::from_secs(10));
        assert!(hi.poll().unwrap().is_none(), "nobody dialled yet");
        assert!(
            lo.describe().contains("this rank dials"),
            "{}",
            lo.describe()
        );
        let l0 = lo
            .poll()
            .unwrap()
            .expect("a dial to a live service connects at once");
        let l1 = wait_link(&hi);
        assert!(l0.describe().contains("net/socket"), "{}", l0.describe());
        assert!(l1.describe().contains("net/socket"), "{}", l1.describe());
    }

    /// A lower rank that never dials is named, with its service's address, once the higher
    /// rank's deadline (counted from its first use) passes.
    #[test]
    fn a_peer_that_never_dials_is_named_at_the_deadline() {
        let _w = watchdog("never_dials", Duration::from_secs(30));
        let b = pair();
        let (c, _route) = connector(&b[1], 0, Duration::from_millis(300));
        let t0 = Instant::now();
        let e = loop {
            match c.poll() {
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Ok(Some(_)) => panic!("connected although nobody dialled"),
                Err(e) => break e,
            }
        };
        assert!(t0.elapsed() >= Duration::from_millis(300));
        assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.msg);
        assert_eq!(e.lost, Some(0));
        let addr = b[0].service_addr();
        assert!(
            e.msg.contains(&format!("rank 0 ({addr}) did not connect")),
            "{}",
            e.msg
        );
    }

    /// While the higher rank waits for the dial, a lower rank whose service is gone is found
    /// by the probe, named, well before the deadline.
    #[test]
    fn a_dead_peer_is_named_while_this_rank_waits_for_its_dial() {
        let _w = watchdog("dead_dialer", Duration::from_secs(30));
        let mut b = pair();
        let (c, _route) = connector(&b[1], 0, Duration::from_secs(20));
        assert!(c.check_peer().is_ok(), "an unused link probes nothing");
        assert!(c.poll().unwrap().is_none());
        drop(b.remove(0));
        std::thread::sleep(PROBE_EVERY);
        let e = c.check_peer().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
        assert_eq!(e.lost, Some(0));
        assert!(e.msg.contains("rank 0 is gone"), "{}", e.msg);
    }

    /// A lower rank whose communicator failed before it ever dialled, and which neither
    /// destroys nor aborts it: its service answers the waiting rank's probe with how it ended,
    /// so the wait ends at the next probe naming the rank it lost, not at the deadline.
    #[test]
    fn a_failed_peer_that_never_dialled_is_heard_at_the_next_probe() {
        let _w = watchdog("failed_dialer", Duration::from_secs(30));
        let id = crate::bootstrap::new_unique_id().unwrap();
        let b = init_all(std::slice::from_ref(&id), 3);
        let (hi, _r1) = connector(&b[1], 0, Duration::from_secs(20));
        let (lo, _r0) = connector(&b[0], 1, Duration::from_secs(20));
        assert!(hi.poll().unwrap().is_none(), "nobody dialled yet");
        std::thread::sleep(PROBE_EVERY);
        assert!(hi.check_peer().is_ok(), "rank 0 is alive and said nothing");
        lo.close(Closing::Failed, Some(2));
        std::thread::sleep(PROBE_EVERY);
        let e = hi.check_peer().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
        assert_eq!(e.lost, Some(2), "{}", e.msg);
        assert!(
            e.msg.contains("rank 0 failed after it lost rank 2"),
            "{}",
            e.msg
        );
    }
}
