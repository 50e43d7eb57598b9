//! InfiniBand links made at first use (NCCL_RUNTIME_CONNECT=1, the default, when every rank
//! asks for it).
//!
//! At init nothing of a peer's link exists: every network peer gets an `OnDemand` link
//! (`transport::demand`) whose connector is `net::on_demand`'s `Connector`, shared with TCP
//! (the deadline from first use, the probe, how the peer is named), with this file's `IbEnds`.
//! The pair follows the TCP transport's rule: **the lower rank dials**, at its first send,
//! receive or peek on the link, one authenticated connection to the higher rank's bootstrap
//! service (`Purpose::Net`, key 0; a communicator's network links are all TCP or all
//! InfiniBand, so the purpose is free for whichever it uses). Over it the two ends exchange
//! what the eager allgather carries (each queue pair's number, PSN, LID, GID and MTU, the
//! ring's address and key), in three messages:
//!
//! 1. the lower rank makes its queue pairs and registered slots for this peer only, and sends
//!    their entry;
//! 2. the higher rank's exchange thread makes its own for the lower rank, moves its queue pairs
//!    to ready-to-send connected to the lower rank's, posts its receives, and answers with its
//!    entry (or with how this end was closed, if it was before the dial came; or with why it
//!    could not make its end);
//! 3. the lower rank connects its queue pairs and posts its receives, answers "ready", and
//!    its link is made; the higher rank's thread files its link for this peer, rings the
//!    doorbell, and the higher rank's connector takes it at its next poll.
//!
//! So neither end's queue pairs receive a write before they are ready for it: the lower rank
//! writes only after the higher rank's answer, the higher rank only after "ready". The
//! connection is closed once the exchange is over; a made link holds no descriptor.
//!
//! Why the higher rank's end is made by a thread and not at its own first use: the lower
//! rank's first use then waits only for that thread (alive from the first dial to destroy,
//! whatever the higher rank's program does), as a TCP dial waits only for the peer's service;
//! the argument of `net::on_demand` that connecting adds no wait a message did not already
//! have carries over unchanged. The service's own thread must not serve connections, hence a
//! thread of this module, started at the first dial that reaches this rank (a rank no lower
//! peer ever uses starts none), serving one exchange at a time; each is bounded by the
//! bootstrap's handshake timeout on this side and by the init timeout from first use on the
//! lower rank's.
//!
//! Kept from the TCP connector: the deadline from first use, naming the peer and its service's
//! address; a higher rank waiting for a peer that is gone (process exited, communicator
//! destroyed or aborted) learns it from `check_peer`'s probes; a higher rank that closed the
//! link before it was connected answers a later dial with the close, and closes a link it made
//! but never took, so the lower rank fails naming how; abort ends a wait (the bootstrap's
//! abort flag). Resources: the queue pairs and slots of a link, made or filed, are freed with
//! the communicator's links; the exchange thread stops, and the route goes, when the
//! communicator's network side is dropped.

use super::link::{closed_error, IbLink};
use super::{decode_entry, entry, finish, Maker, NetLinks};
use crate::bootstrap::{Bootstrap, Purpose, Route};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::demand::OnDemand;
use crate::transport::net::on_demand::{Connector, Ends, Pair};
use crate::transport::{Closing, Doorbell, Link};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The first byte of the higher rank's answer: its entry follows; this end was closed (how,
/// and the rank it lost plus one, 0 for none, follow); it could not make its end (why
/// follows).
const MADE: u8 = 1;
const CLOSED: u8 = 2;
const REFUSED: u8 = 3;
/// The lower rank's last message: its queue pairs are connected and its receives posted.
const READY: u8 = 4;
/// No message of the exchange is longer (16 queue pairs' entry is under 500 bytes).
const MAX_MESSAGE: usize = 4096;

/// This rank's network links, each made at first use; the service side if any lower peer
/// may dial.
pub(super) fn links(
    boot: &Bootstrap,
    peers: &[usize],
    maker: Arc<Maker>,
) -> (NetLinks, Option<Served>) {
    let me = boot.rank();
    let mut lower = vec![false; boot.nranks()];
    for &p in peers.iter().filter(|&&p| p < me) {
        lower[p] = true;
    }
    let arrivals = Arc::new(Arrivals {
        me,
        lower,
        slots: Mutex::new(HashMap::new()),
        doorbell: maker.doorbell.clone(),
    });
    let abort = boot.abort_handle();
    let served = arrivals.lower.contains(&true).then(|| {
        Served::start(
            boot,
            Arc::new(Exchange {
                maker: maker.clone(),
                arrivals: arrivals.clone(),
                abort: abort.clone(),
            }),
        )
    });
    let dialer = boot.dialer();
    let timeout = crate::bootstrap::init_timeout();
    let mut links: NetLinks = (0..boot.nranks()).map(|_| None).collect();
    for &p in peers {
        let connect = Connector {
            pair: Pair::new(me, p, dialer.clone(), timeout, "InfiniBand"),
            ends: IbEnds {
                maker: maker.clone(),
                arrivals: arrivals.clone(),
                abort: abort.clone(),
            },
        };
        links[p] = Some(Arc::new(OnDemand::new(Box::new(connect))) as Arc<dyn Link>);
    }
    crate::info!(
        "rank {me}: {} InfiniBand peers, each connected at first use (NCCL_RUNTIME_CONNECT=0 connects them at init)",
        peers.len()
    );
    (links, served)
}

/// What became of one lower peer's dial, until this rank's connector takes the link.
#[derive(Default)]
struct Slot {
    link: Option<Arc<IbLink>>,
    /// This rank could not make its end (the connector fails with it).
    failed: Option<Error>,
    /// This end was closed before it was connected: how, and whom it lost.
    closed: Option<(Closing, Option<usize>)>,
}

/// The links the exchange thread made for lower peers, by peer.
struct Arrivals {
    me: usize,
    /// The ranks that may dial this one: its lower network peers.
    lower: Vec<bool>,
    slots: Mutex<HashMap<usize, Slot>>,
    doorbell: Arc<dyn Doorbell>,
}

impl Arrivals {
    /// `peer`'s link, made: filed for the connector, or closed at once if this end was closed
    /// meanwhile (kept until destroy, so that the close reaches the peer).
    fn file(&self, peer: usize, link: Arc<IbLink>) {
        let mut slots = self.slots.lock();
        let slot = slots.entry(peer).or_default();
        if let Some((how, lost)) = slot.closed {
            link.close(how, lost);
        } else if slot.link.is_some() {
            crate::warn!(
                "rank {}: dropped a second InfiniBand connection from rank {peer}",
                self.me
            );
            return;
        }
        slot.link = Some(link);
        drop(slots);
        self.doorbell.ring();
    }

    fn fail(&self, peer: usize, e: Error) {
        self.slots.lock().entry(peer).or_default().failed = Some(e);
        self.doorbell.ring();
    }

    /// How this end of `peer`'s link was closed, if it was before it was connected.
    fn closed(&self, peer: usize) -> Option<(Closing, Option<usize>)> {
        self.slots.lock().get(&peer).and_then(|s| s.closed)
    }

    fn close(&self, peer: usize, how: Closing, lost: Option<usize>) {
        let mut slots = self.slots.lock();
        let slot = slots.entry(peer).or_default();
        slot.closed.get_or_insert((how, lost));
        if let Some(l) = &slot.link {
            l.close(how, lost);
        }
    }

    /// `peer`'s link once the exchange made it; the error if this rank could not make it.
    fn take(&self, peer: usize) -> Result<Option<Arc<IbLink>>> {
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(&peer).filter(|s| s.closed.is_none()) else {
            return Ok(None);
        };
        if let Some(e) = slot.failed.take() {
            return Err(e);
        }
        Ok(slot.link.take())
    }

    /// Whether the exchange with `peer` ended (its next poll takes the link or the error).
    fn ended(&self, peer: usize) -> bool {
        self.slots
            .lock()
            .get(&peer)
            .is_some_and(|s| s.link.is_some() || s.failed.is_some())
    }
}

/// InfiniBand's part of a peer's connector (`on_demand::Connector` does the rest).
struct IbEnds {
    maker: Arc<Maker>,
    arrivals: Arc<Arrivals>,
    abort: Arc<AtomicBool>,
}

impl Ends for IbEnds {
    const KIND: &'static str = "ib";

    /// The lower rank's side of the exchange: its end made, the peer's answer, "ready".
    fn dial(&self, pair: &Pair, deadline: Option<Instant>) -> Result<Arc<dyn Link>> {
        let link = self.maker.link(pair.peer)?;
        let s = pair.dialer.dial(pair.peer, Purpose::Net, 0, deadline)?;
        let who = pair.who();
        let until = Until {
            deadline,
            abort: &self.abort,
            who: &who,
        };
        let mut mine = Vec::new();
        entry(&link, &mut mine);
        send(&s, &mine, &until)?;
        let answer = receive(&s, &until)?;
        match answer.split_first() {
            Some((&MADE, theirs)) => {
                let Some((theirs, _)) = decode_entry(theirs) else {
                    return Err(malformed(&who));
                };
                finish(&link, theirs)?;
                send(&s, &[READY], &until)?;
                Ok(link)
            }
            Some((&CLOSED, &[how, a, b, c, d])) => {
                let how = Closing::from_code(u32::from(how)).unwrap_or(Closing::Failed);
                let lost = (u32::from_le_bytes([a, b, c, d]) as usize).checked_sub(1);
                Err(closed_error(pair.peer, how, lost))
            }
            Some((&REFUSED, why)) => Err(Error::lost_peer(
                pair.peer,
                format!(
                    "{who} could not make its end: {}",
                    String::from_utf8_lossy(why)
                ),
            )),
            _ => Err(malformed(&who)),
        }
    }

    fn take(&self, peer: usize) -> Result<Option<Arc<dyn Link>>> {
        Ok(self.arrivals.take(peer)?.map(|l| l as Arc<dyn Link>))
    }

    fn served(&self, peer: usize) -> bool {
        self.arrivals.ended(peer)
    }

    fn close(&self, peer: usize, how: Closing, lost: Option<usize>) {
        self.arrivals.close(peer, how, lost);
    }
}

/// The higher rank's side of the exchanges, run by the exchange thread.
struct Exchange {
    maker: Arc<Maker>,
    arrivals: Arc<Arrivals>,
    abort: Arc<AtomicBool>,
}

impl Exchange {
    fn serve(&self, from: usize, s: TcpStream) {
        let me = self.arrivals.me;
        let deadline = crate::bootstrap::handshake_timeout().map(|t| Instant::now() + t);
        let who = format!("rank {from}");
        let until = Until {
            deadline,
            abort: &self.abort,
            who: &who,
        };
        let theirs = match receive(&s, &until) {
            Ok(b) => b,
            Err(e) => {
                crate::warn!("rank {me}: InfiniBand connection from rank {from} dropped: {e}");
                return;
            }
        };
        if let Some((how, lost)) = self.arrivals.closed(from) {
            let mut answer = vec![CLOSED, how as u8];
            answer.extend_from_slice(&lost.map_or(0, |l| l as u32 + 1).to_le_bytes());
            let _ = send(&s, &answer, &until);
            return;
        }
        let made = decode_entry(&theirs)
            .ok_or_else(|| malformed(&who))
            .and_then(|(theirs, _)| {
                let link = self.maker.link(from)?;
                finish(&link, theirs)?;
                Ok(link)
            });
        let link = match made {
            Ok(l) => l,
            Err(e) => {
                let mut answer = vec![REFUSED];
                answer.extend_from_slice(e.msg.as_bytes());
                answer.truncate(MAX_MESSAGE);
                let _ = send(&s, &answer, &until);
                let e = e.context(format!(
                    "making this rank's end of the InfiniBand link to rank {from}, which dialled"
                ));
                self.arrivals.fail(from, e);
                return;
            }
        };
        let mut answer = vec![MADE];
        entry(&link, &mut answer);
        let ready = send(&s, &answer, &until)
            .and_then(|_| receive(&s, &until))
            .and_then(|b| match b[..] {
                [READY] => Ok(()),
                _ => Err(malformed(&who)),
            });
        match ready {
            Ok(()) => self.arrivals.file(from, link),
            // The lower rank fails its own first use; this rank's connector goes on waiting
            // for a dial, and probes.
            Err(e) => crate::warn!(
                "rank {me}: the InfiniBand exchange with rank {from} failed, its link is dropped: {e}"
            ),
        }
    }
}

/// The route that takes lower ranks' dials, and the thread that serves them.
pub(super) struct Served {
    route: Option<Route>,
    queue: Arc<Queue>,
}

/// Between the service's thread (which only hands connections on) and the exchange thread.
struct Queue {
    /// Set when the communicator's network side goes: later dials are dropped.
    stopped: AtomicBool,
    to_thread: Mutex<Option<Sender<(usize, TcpStream)>>>,
    /// Taken by the thread when the first dial starts it.
    for_thread: Mutex<Option<Receiver<(usize, TcpStream)>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    exchange: Arc<Exchange>,
}

impl Queue {
    /// On the service's thread: hands an authenticated dial to the exchange thread.
    fn deliver(&self, from: usize, key: u64, s: TcpStream) {
        let me = self.exchange.arrivals.me;
        if self.stopped.load(Ordering::Acquire) {
            return;
        }
        if key != 0 || !self.exchange.arrivals.lower.get(from).is_some_and(|&l| l) {
            crate::warn!(
                "rank {me}: dropped an InfiniBand connection from rank {from} (key {key}): this rank expects none from it"
            );
            return;
        }
        if let Some(tx) = &*self.to_thread.lock() {
            let _ = tx.send((from, s));
        }
        let mut thread = self.thread.lock();
        if thread.is_some() {
            return;
        }
        let Some(rx) = self.for_thread.lock().take() else {
            return;
        };
        let exchange = self.exchange.clone();
        match std::thread::Builder::new()
            .name(format!("comm-ib-{me}"))
            .spawn(move || {
                // Ends when the sender goes (the network side is dropped).
                while let Ok((from, s)) = rx.recv() {
                    exchange.serve(from, s);
                }
            }) {
            Ok(t) => *thread = Some(t),
            Err(e) => crate::warn!(
                "rank {me}: could not start the InfiniBand exchange thread ({e}); lower peers cannot connect"
            ),
        }
    }
}

impl Served {
    fn start(boot: &Bootstrap, exchange: Arc<Exchange>) -> Served {
        let (tx, rx) = std::sync::mpsc::channel();
        let queue = Arc::new(Queue {
            stopped: AtomicBool::new(false),
            to_thread: Mutex::new(Some(tx)),
            for_thread: Mutex::new(Some(rx)),
            thread: Mutex::new(None),
            exchange,
        });
        let q = queue.clone();
        let route = boot.route(
            Purpose::Net,
            Box::new(move |c, s| q.deliver(c.from as usize, c.key, s)),
        );
        Served {
            route: Some(route),
            queue,
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.queue.stopped.store(true, Ordering::Release);
        self.route = None;
        self.queue.to_thread.lock().take();
        let thread = self.queue.thread.lock().take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// How long an exchange's reads and writes may wait, and whom they wait for.
struct Until<'a> {
    deadline: Option<Instant>,
    abort: &'a AtomicBool,
    who: &'a str,
}

impl Until<'_> {
    /// Waits (a slice at most) for `s` to be ready for `events`; Err past the deadline or
    /// once the communicator is aborted.
    fn wait(&self, s: &TcpStream, events: i16) -> Result<()> {
        if self.abort.load(Ordering::Acquire) {
            return crate::internal_err!(
                "aborted (ncclCommAbort) while exchanging InfiniBand connection details with {}",
                self.who
            );
        }
        let left = match self.deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => Duration::MAX,
        };
        if left.is_zero() {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "{} did not complete the InfiniBand connection exchange in time",
                    self.who
                ),
            ));
        }
        let mut fd = libc::pollfd {
            fd: s.as_raw_fd(),
            events,
            revents: 0,
        };
        let ms = left.min(Duration::from_millis(100)).as_millis().max(1) as i32;
        // SAFETY: one valid pollfd for an open descriptor; poll only writes its revents.
        unsafe { libc::poll(&mut fd, 1, ms) };
        Ok(())
    }

    fn gone(&self) -> Error {
        Error::new(
            ErrorKind::Remote,
            format!(
                "{} closed the connection during the InfiniBand connection exchange (its process exited, or its communicator was destroyed or aborted)",
                self.who
            ),
        )
    }
}

/// Moves all of `buf` over the non-blocking `s`: into it when `fill`, out of it otherwise.
fn transfer(s: &TcpStream, buf: &mut [u8], fill: bool, until: &Until<'_>) -> Result<()> {
    s.set_nonblocking(true)
        .map_err(|e| Error::from_io("configure an InfiniBand exchange connection", e))?;
    let mut done = 0;
    while done < buf.len() {
        let mut io = s;
        let r = if fill {
            io.read(&mut buf[done..])
        } else {
            io.write(&buf[done..])
        };
        match r {
            Ok(0) => return Err(until.gone()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                until.wait(s, if fill { libc::POLLIN } else { libc::POLLOUT })?
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Err(until.gone()),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Err(until.gone()),
            Err(e) => {
                return Err(Error::from_io(
                    format!("the InfiniBand connection exchange with {}", until.who),
                    e,
                ))
            }
        }
    }
    Ok(())
}

/// One message: its length (4 bytes) and its bytes.
fn send(s: &TcpStream, body: &[u8], until: &Until<'_>) -> Result<()> {
    let mut framed = (body.len() as u32).to_le_bytes().to_vec();
    framed.extend_from_slice(body);
    transfer(s, &mut framed, false, until)
}

fn receive(s: &TcpStream, until: &Until<'_>) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    transfer(s, &mut len, true, until)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_MESSAGE {
        return Err(malformed(until.who));
    }
    let mut body = vec![0; len];
    transfer(s, &mut body, true, until)?;
    Ok(body)
}

fn malformed(who: &str) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!("{who} sent a malformed InfiniBand connection exchange message"),
    )
}
