//! Transports move messages between two ranks. Each peer is reached through one `Link`, made by
//! the first transport of the list that reaches it (`establish`, `list`): `loopback` for a
//! rank's channel to itself, `shm` for ranks on one host (processes or threads), `net` (TCP or
//! InfiniBand) between hosts. Device buffers
//! travel as stream programs over `p2p`'s CUDA IPC mappings instead. The executor sleeps on a
//! `Doorbell` that links ring.
//!
//! A message is an ordered byte string on a directed channel (this rank -> peer). The k-th message
//! sent on a channel is the k-th message received on it; both sides know its length in advance,
//! and the tag lets the receiver detect ranks that disagree about which operation they are in.
//! All calls are non-blocking: they move as much as they can and report how far they got, so one
//! thread can progress many channels (and many communicators) at once without deadlock.

#[cfg(test)]
mod conformance;
pub(crate) mod demand;
pub(crate) mod list;
pub(crate) mod loopback;
pub(crate) mod net;
pub(crate) mod p2p;
pub(crate) mod reg;
pub(crate) mod shm;

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::reduce::Scale;
use crate::topo::{Placement, Presence};
pub(crate) use list::Transports;
use std::sync::Arc;
use std::time::Instant;

/// Every link of one communicator, made by the transports that reach its peers, and the
/// doorbell its executor sleeps on.
pub(crate) struct Links {
    /// One per rank, this rank's own loopback included.
    pub links: Vec<Arc<dyn Link>>,
    pub doorbell: Arc<dyn Doorbell>,
    /// Where the ranks on this host run, from the transport that shares memory with them
    /// (None without such peers).
    pub presence: Option<Arc<dyn Presence>>,
    /// Whether large buffers should be backed by huge pages: a transport copies from or
    /// into them with the kernel, which pins every page it touches (shm's pulls between
    /// processes). A property of how the transports use memory, not of one message.
    pub huge_pages: bool,
    /// What keeps the transports' small-message state warm between operations (None where
    /// no transport has such state).
    pub warm: Option<Arc<dyn Warm>>,
    /// The transports that made the links, for what a communicator asks of them besides
    /// (registration, figures, one transport's own capability); they live as long as it.
    pub transports: Transports,
}

/// Connects this rank to every peer with the first transport of the list (`list::kinds`:
/// loopback, shm, net) that reaches it: shm for ranks of this host (unless COMM_SHM_DISABLE),
/// the network for the rest. Collective: every rank derives the same plan from the
/// placements, so each transport's setup runs on all ranks or on none. `net_hellos`: every
/// rank's network `Hello`, gathered with the placements; `offer`: this rank's.
pub(crate) fn establish(
    boot: &Bootstrap,
    placements: &[Placement],
    offer: net::Offer,
    net_hellos: &[net::Hello],
    comm_tag: u64,
    deadline: Option<Instant>,
) -> Result<Links> {
    let shm_on = !crate::env::SHM_DISABLE.flag();
    let kinds = list::kinds(shm_on, offer, net_hellos);
    list::connect(&kinds, boot, placements, comm_tag, deadline)
}

/// `establish` with shared memory allowed (`shm_on`) or not, whatever the environment says,
/// the network's hellos gathered in an allgather of their own (the transport tests' way in).
#[cfg(test)]
pub(crate) fn establish_with(
    boot: &Bootstrap,
    placements: &[Placement],
    comm_tag: u64,
    deadline: Option<Instant>,
    shm_on: bool,
    net: &net::NetChoice,
) -> Result<Links> {
    let offer = net::Offer::probe(net);
    let hellos = offer.exchange(boot)?;
    let kinds = list::kinds(shm_on, offer, &hellos);
    list::connect(&kinds, boot, placements, comm_tag, deadline)
}

/// An outgoing message. `src` stays valid and unmodified until the send reports `Complete`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutMsg {
    pub src: *const u8,
    pub len: usize,
    /// A multiplier the receiver applies to these bytes (a rank's raw input under PreMulSum or a
    /// float average), carried with the message.
    pub scale: Option<Scale>,
    pub tag: u64,
}

/// What the executor knows of an outgoing message beyond its bytes: the one optional
/// capability of the sending side (`Link::send_offered`), as `Sink::reply` is of the
/// receiving side. A link may use any of it to choose how to move the message, or ignore it
/// all; the bytes that arrive are the same.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Offer {
    /// The sending rank also has received bytes of its own to copy in this run, so a transport
    /// that can have the receiver pull the message saves the sender a copy that would delay
    /// the rest of its run (shm pulls such messages from a lower size).
    pub sender_busy: bool,
    /// The operation reduces nothing, so the receiver copies these bytes as they are: one copy
    /// out of the sender's buffer replaces a copy in and a copy out of a transport's buffer,
    /// with no fold waiting behind it (shm pulls a busy sender's such messages from a lower
    /// size still).
    pub copied: bool,
    /// The sender's half of a matched pair (`Reply` is the receiver's): where this rank will
    /// next receive, from the same peer, a message of the same length, with nothing touching
    /// those bytes before: `src` itself (the other half of a two-rank all-reduce in place) or
    /// the same place in the receive buffer (out of place). A receiver that folds the message
    /// and will send the result straight back (`Sink::reply`) may write that result there as
    /// it folds, while the bytes are still in its cache, and later send only a notice (shm
    /// does, for pulled messages).
    pub reply_at: Option<usize>,
}

/// The error of a receive that expected `expect` from rank `peer` but found a message of `len`
/// bytes tagged `tag`: the ranks called different operations, or the same with different
/// counts, datatypes, ops or roots. Every rank that sees it fails with a usage error, and its
/// peers are told both operations (`Closing::Disagreed`).
pub(crate) fn mismatch_error(peer: usize, len: u64, tag: u64, expect: &InExpect) -> Error {
    let mut e = Error::new(
        crate::error::ErrorKind::InvalidUsage,
        format!(
            "rank {peer} sent {len} bytes in a message of {} where this rank expects {} bytes for {} (a message is one piece of an operation's data, not all of it): the ranks called different operations or passed different counts, datatypes, reduction ops or roots{}",
            crate::tag::describe_tag(tag),
            expect.len,
            crate::tag::describe_tag(expect.tag),
            crate::tag::mismatch_hint(tag, expect.tag)
        ),
    );
    e.disagreed = Some((expect.tag, tag));
    e
}

/// What the receiver expects next on a channel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InExpect {
    pub len: usize,
    pub tag: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SendState {
    /// Not all bytes have been handed to the transport yet.
    Pending,
    /// Every byte is handed over (the next message on the channel may start), but the peer may
    /// still be reading from `src`.
    Posted,
    /// `src` may be reused.
    Complete,
}

/// Per-message progress of a send, kept by the caller between calls: which message (the
/// cursor belongs to one) and how far it got. `link` is the link's own word about it.
#[derive(Clone, Debug, Default)]
pub(crate) struct SendCursor {
    pub sent: usize,
    pub started: bool,
    /// What the link needs to tell when a message it handed over (`SendState::Posted`) is
    /// complete: a FIFO position whose release means the peer finished reading `src` (shm,
    /// loopback), a work request's number (ib). Only the link reads or writes it.
    pub link: Option<u64>,
}

/// Per-message progress of a receive, kept by the caller between calls: which message and
/// how far it got. `link` is the link's own word about it.
#[derive(Clone, Debug, Default)]
pub(crate) struct RecvCursor {
    pub received: usize,
    pub started: bool,
    /// The link's own state of this message while it is in progress (shm: whether it is
    /// being pulled, and how much of the reply went ahead with it); zero before it starts.
    /// Only the link reads or writes it.
    pub link: u64,
}

/// Where received bytes go. The executor implements it: a plain copy, or a reduction into the
/// destination.
pub(crate) trait Sink {
    /// The destination, when the bytes can be written there as they are (no combining).
    fn direct(&mut self) -> Option<*mut u8>;
    /// Bytes `[offset, offset + data.len())` of the message.
    fn put(&mut self, offset: usize, data: &[u8], scale: Option<Scale>) -> Result<()>;
    /// Bytes `[offset, offset + len)` were written straight into `direct()`.
    fn placed(&mut self, offset: usize, len: usize, scale: Option<Scale>) -> Result<()>;
    /// The optional capability of the receiving side (`Offer` is the sending side's): this
    /// receive and a send of its result back to the same peer are a matched pair (`Reply`).
    /// None by default; a link may ignore it.
    fn reply(&self) -> Option<Reply> {
        None
    }
    /// `put`, leaving a copy of the combined bytes at `out` as well (`len` bytes of memory
    /// that nothing else touches meanwhile): how a link that takes up a `reply` folds the
    /// bytes into the reply's message as well.
    fn put_also(
        &mut self,
        offset: usize,
        data: &[u8],
        scale: Option<Scale>,
        out: *mut u8,
    ) -> Result<()> {
        put_then_copy(self, offset, data, scale, out)
    }
}

/// What a receive's sink tells a link that may fold and return (`Sink::reply`): this rank's
/// next use of the combined bytes is to send them, unchanged and whole, back to the peer
/// they came from. A link may then move the reply while it folds (shm writes it into the
/// sender's buffer where the sender offered a place, `Offer::reply_at`, or forwards it
/// through its slots), and its later send of those bytes finishes what was begun.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reply {
    /// Where the combined bytes are.
    pub at: *const u8,
    /// The reply is the very next message this rank sends that peer (every earlier one is
    /// handed over already), so a link may send it while it folds.
    pub next: bool,
    /// Where the sender also offered a place for the reply, send it as the next message
    /// (`next`) rather than write it there: which is faster changes from run to run
    /// (`exec::replies`), and the executor chooses.
    pub forward_first: bool,
}

/// `Sink::put_also` done plainly: `put`, then a copy of the combined bytes out of the reply.
pub(crate) fn put_then_copy<S: Sink + ?Sized>(
    sink: &mut S,
    offset: usize,
    data: &[u8],
    scale: Option<Scale>,
    out: *mut u8,
) -> Result<()> {
    sink.put(offset, data, scale)?;
    let d = sink.reply().map(|r| r.at).ok_or_else(|| {
        Error::new(
            crate::error::ErrorKind::Internal,
            "a copy of combined bytes asked of a sink that keeps none",
        )
    })?;
    // SAFETY: the reply's bytes cover the message, which this piece lies inside; `out` is the
    // caller's memory of `data.len()` bytes.
    unsafe { crate::reduce::copy_bytes(out, d.add(offset), data.len()) };
    Ok(())
}

/// Whether a call moved anything; the executor sleeps only after a pass where nothing moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Progress<T> {
    pub state: T,
    pub moved: bool,
}

/// One peer's channel pair (this rank -> peer and back), made by a transport. A link keeps
/// its own in-flight state; the cursors only say which message and how far it got.
pub(crate) trait Link: Send + Sync {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>>;
    /// `send`, with what the executor offers about the message (`Offer`, the same on every
    /// call for one message). A link that has no use for it sends plainly (the default).
    fn send_offered(
        &self,
        msg: &OutMsg,
        _offer: Offer,
        cur: &mut SendCursor,
    ) -> Result<Progress<SendState>> {
        self.send(msg, cur)
    }
    /// Returns `state == true` once the whole message has been delivered to the sink.
    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>>;
    /// Err when the peer can no longer take part: it exited, aborted or destroyed its end.
    fn check_peer(&self) -> Result<()>;
    /// Why the peer is known to have hung up even though `check_peer` finds nothing yet (its
    /// end of stream waits behind messages nobody has read); None where the transport cannot
    /// tell or the peer has not. Only for naming every lost peer in an error.
    fn hung_up_reason(&self) -> Option<String> {
        None
    }
    /// Whether `check_peer`'s error already says whom the peer lost first, if anyone (the peer
    /// records it where this rank reads it before it fails), so that no other link need be
    /// waited for to find the cause.
    fn tells_its_losses(&self) -> bool {
        false
    }
    /// The length and tag of the next message on the channel once it has begun to arrive,
    /// without taking anything off the channel; None while nothing has. Called only between
    /// messages (no receive on the channel in progress). A receive from any source uses it to
    /// find a peer whose message is waiting.
    fn peek(&self) -> Result<Option<(usize, u64)>> {
        crate::invalid_usage!(
            "the {} transport cannot tell whether a message is waiting, so it does not support receives from any source",
            self.describe()
        )
    }
    /// A short description for logs ("shm/cma", "shm/direct", ...).
    fn describe(&self) -> String;
    /// This end is going away: the peer must stop waiting for it and fail instead, told how
    /// and, when this rank failed because it lost a rank, which one.
    fn close(&self, _how: Closing, _lost: Option<usize>) {}
    /// Before a `close` as `Closing::Disagreed`: the two operations this rank found the ranks
    /// disagreeing on (its own tag, the tag it received), for the peer's error to name. Links
    /// that cannot carry them leave the peer's error more general.
    fn tell_disagreement(&self, _ours: u64, _theirs: u64) {}
}

/// How a rank's end of its links went away, as its peers will report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Closing {
    Destroyed = 1,
    Aborted = 2,
    /// The communicator failed (a lost peer, ranks that disagree): it can only be destroyed.
    Failed = 3,
    /// The communicator timed out waiting (for the rank given as lost): it failed too.
    TimedOut = 4,
    /// The communicator failed because the ranks called different operations (kind, count,
    /// datatype, op or root): the peers fail with the usage error too, not a remote one.
    Disagreed = 5,
}

impl Closing {
    pub(crate) fn from_code(c: u32) -> Option<Closing> {
        match c {
            1 => Some(Closing::Destroyed),
            2 => Some(Closing::Aborted),
            3 => Some(Closing::Failed),
            4 => Some(Closing::TimedOut),
            5 => Some(Closing::Disagreed),
            _ => None,
        }
    }

    /// "rank 4 aborted its communicator after it lost rank 3 while this rank still needs it".
    pub(crate) fn describe(self, rank: usize, lost: Option<usize>) -> String {
        self.describe_with(rank, lost, None)
    }

    /// `describe`, naming the two operations a rank that closed as `Disagreed` saw, where it
    /// said (its own tag and the one it received).
    pub(crate) fn describe_with(
        self,
        rank: usize,
        lost: Option<usize>,
        disagreed: Option<(u64, u64)>,
    ) -> String {
        if let (Closing::Disagreed, Some((ours, theirs))) = (self, disagreed) {
            return format!(
                "rank {rank} stopped because the ranks called different operations: it called {} but received a message of {}{}",
                crate::tag::describe_tag(ours),
                crate::tag::describe_tag(theirs),
                crate::tag::mismatch_hint(theirs, ours)
            );
        }
        let after = lost
            .map(|l| format!(" after it lost rank {l}"))
            .unwrap_or_default();
        match self {
            Closing::Destroyed => format!(
                "rank {rank} destroyed its communicator{after} while this rank still needs it"
            ),
            Closing::Aborted => format!("rank {rank} aborted its communicator{after}"),
            Closing::Failed => format!("rank {rank} failed{after}"),
            Closing::TimedOut => match lost {
                Some(l) => format!("rank {rank} timed out waiting for rank {l}"),
                None => format!("rank {rank} timed out"),
            },
            Closing::Disagreed => format!(
                "rank {rank} stopped because the ranks called different operations (collective, count, datatype, reduction op or root; its own error names the two it saw)"
            ),
        }
    }

    /// The kind of error a peer reports when this end closed this way.
    pub(crate) fn kind(self) -> crate::error::ErrorKind {
        match self {
            Closing::TimedOut => crate::error::ErrorKind::Timeout,
            Closing::Disagreed => crate::error::ErrorKind::InvalidUsage,
            _ => crate::error::ErrorKind::Remote,
        }
    }
}

/// What a waiting executor sleeps on. Links ring it when they give the rank something to do:
/// shm peers through the futex word in this rank's segment, network links from their
/// progress thread. The protocol: `prepare_sleep`, one more look for work, then `sleep` or
/// `cancel_sleep`; a `ring` after `prepare_sleep` always wakes the sleeper.
pub(crate) trait Doorbell: Send + Sync {
    fn ring(&self);
    fn prepare_sleep(&self) -> u32;
    fn cancel_sleep(&self);
    fn sleep(&self, seen: u32, timeout: std::time::Duration);
}

/// A communicator's transports, told that an operation large enough to push them out of this
/// core's caches and TLB has ended: they bring back the lines and pages that the next small
/// messages either way will touch (shm: the slot numbers of every FIFO with every peer). A
/// hint about the communicator's state between operations, not about any message, so it
/// is asked of the transports rather than of each link.
pub(crate) trait Warm: Send + Sync {
    fn warm(&self);
}

/// A doorbell in this process's memory, for ranks without a shared-memory segment.
#[derive(Default)]
pub(crate) struct LocalDoorbell {
    word: std::sync::atomic::AtomicU32,
    sleepers: std::sync::atomic::AtomicU32,
}

impl LocalDoorbell {
    fn bell(&self) -> crate::sys::FutexBell<'_> {
        crate::sys::FutexBell {
            bell: &self.word,
            sleepers: &self.sleepers,
        }
    }
}

impl Doorbell for LocalDoorbell {
    fn ring(&self) {
        self.bell().ring();
    }

    fn prepare_sleep(&self) -> u32 {
        self.bell().prepare_sleep()
    }

    fn cancel_sleep(&self) {
        self.bell().cancel_sleep();
    }

    fn sleep(&self, seen: u32, timeout: std::time::Duration) {
        self.bell().sleep(seen, timeout);
    }
}
