//! One end of a shared-memory link (`ShmPeer`): its state, slot bookkeeping, and the errors
//! it reports.

use super::packed::Packing;
use super::segment::Segment;
use super::segment::{SlotHeader, SLOT_FIELDS, SLOT_HEADER};
use crate::error::{Error, Result};
use crate::sys::{self, ProcessWatch};
use crate::transport::{Doorbell, InExpect, Link, OutMsg};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A message whose bytes this rank moved while it received what they were combined from, and
/// whose send is still to come: the send of `len` bytes from `local` with `tag`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Carried {
    pub(super) tag: u64,
    pub(super) local: usize,
    pub(super) len: usize,
    pub(super) how: Carriage,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Carriage {
    /// Written into the sender's buffer at `remote` (`Offer::reply_at`): the send is a
    /// notice.
    WrittenBack { remote: usize },
    /// The first `sent` bytes went into the FIFO's slots as they were folded
    /// (`Reply::next`): the send goes on from there.
    Forwarded { sent: usize },
}

/// The carried messages whose sends are still to come. Every send looks here first, so an
/// empty list must cost no lock: a locked instruction waits until the previous message's
/// stores into the peer's FIFO have reached the peer's core.
#[derive(Default)]
pub(super) struct CarriedList {
    pub(super) list: Mutex<Vec<Carried>>,
    /// Whether `list` may hold something. Pushes and takes happen in the executor that owns
    /// the link, one at a time (its communicator's lock orders successive runs).
    pub(super) any: AtomicBool,
}

impl CarriedList {
    pub(super) fn push(&self, w: Carried) {
        self.list.lock().push(w);
        self.any.store(true, Ordering::Relaxed);
    }

    /// What carried `msg`'s bytes already, if anything (taken off the list).
    pub(super) fn take(&self, msg: &OutMsg) -> Option<Carried> {
        if !self.any.load(Ordering::Relaxed) {
            return None;
        }
        let mut list = self.list.lock();
        let at = list
            .iter()
            .position(|w| w.tag == msg.tag && w.local == msg.src as usize && w.len == msg.len)?;
        let w = list.swap_remove(at);
        if list.is_empty() {
            self.any.store(false, Ordering::Relaxed);
        }
        Some(w)
    }
}

/// How a receiver reads a sender's buffer in the pull protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Access {
    /// Threads of one process: the address is ours too.
    Direct,
    /// Another process: process_vm_readv.
    Cma(u32),
}

/// One peer reached through shared memory.
pub(crate) struct ShmPeer {
    pub(super) me: usize,
    pub(super) peer: usize,
    /// Our segment: the FIFO this peer sends us, and our doorbell.
    pub(super) local: Arc<Segment>,
    /// The peer's segment: the FIFO we send it, and its doorbell.
    pub(in crate::transport) remote: Arc<Segment>,
    pub(super) access: Access,
    pub(super) watch: Option<ProcessWatch>,
    pub(super) pull_threshold: usize,
    /// The threshold for messages whose sender is busy (`Offer::sender_busy`).
    pub(super) pull_threshold_busy: usize,
    /// The threshold for a busy sender's messages that the receiver copies as they are
    /// (`Offer::copied`) and for those that offer their buffer for the reply.
    pub(super) pull_threshold_copied: usize,
    pub(super) scratch: Mutex<Option<sys::HugeMem>>,
    /// Combined bytes this rank wrote back into the peer's buffer or forwarded through the
    /// slots (`Sink::reply`), whose sends are a notice or the rest of the bytes.
    pub(super) carried: CarriedList,
    /// The last value of the peer's tail this rank read (a lower bound of the real one).
    pub(super) tail_seen: AtomicU64,
    /// How many slots of the peer's FIFO this rank has read. The tail the peer sees follows
    /// it every `tail_step` eager slots, and whenever this rank finds the FIFO empty or
    /// finishes a pulled or returned message: the tail's line then moves to the sender's core
    /// once per few messages instead of after each.
    pub(super) consumed: AtomicU64,
    pub(super) tail_step: u64,
    /// Where this end stands in packed slots, sending and receiving.
    pub(super) pack: Packing,
    /// Why the peer is gone, where it ended before this rank mapped its segment (`remote` is
    /// then a stand-in): what it sent before arrives, sends and waits fail with this.
    pub(super) gone: Option<Error>,
}

impl ShmPeer {
    /// Reads the number of every slot of both FIFOs with this peer: one line and one page each,
    /// which a large operation pushed out of the caches and the TLB (`transport::Warm`). In a
    /// sweep that came back from 64 MiB the first 8 B calls ran at 0.4-0.7 us (2 ranks) and
    /// 6.5-9 us (4 ranks on 2 cores) instead of 0.24 and 3.3 until every slot had been used
    /// once.
    pub(super) fn warm(&self) {
        self.local.read_slot_numbers(self.peer);
        self.remote.read_slot_numbers(self.me);
    }

    /// The header of slot `seq` of the peer's FIFO.
    pub(super) fn read_header(&self, seq: u64) -> SlotHeader {
        // SAFETY: the header lies inside our segment after the slot's number; the sender wrote
        // it before publishing that number with Release, which we read with Acquire.
        unsafe {
            (self.local.slot(self.peer, seq).add(SLOT_FIELDS) as *const SlotHeader).read_unaligned()
        }
    }

    pub(super) fn write_header(&self, seq: u64, h: &SlotHeader) {
        // SAFETY: the header lies inside the peer's segment after the slot's number; the slot is
        // free (head - tail < nslots), and the receiver reads the header only once we publish
        // the number.
        unsafe {
            (self.remote.slot(self.me, seq).add(SLOT_FIELDS) as *mut SlotHeader).write_unaligned(*h)
        }
    }

    /// Whether slot `head` of our FIFO to the peer is free. The peer's tail (`tail`, the last
    /// value seen) is read again, and remembered in `tail_seen`, only when the slots known to
    /// be free have run out.
    #[inline]
    pub(super) fn slot_free(&self, head: u64, tail: &mut u64) -> bool {
        let nslots = self.remote.geo.nslots as u64;
        if head - *tail >= nslots {
            *tail = self.remote.tail(self.me).load(Ordering::Acquire);
            self.tail_seen.store(*tail, Ordering::Relaxed);
        }
        head - *tail < nslots
    }

    /// Fills the free slot `head` of our FIFO to the peer: header `h`, then `fill` writes the
    /// data area (`h.len` bytes), then the slot's number and the head are published (no ring).
    #[inline]
    pub(super) fn fill_slot(
        &self,
        head: u64,
        h: &SlotHeader,
        fill: impl FnOnce(*mut u8) -> Result<()>,
    ) -> Result<()> {
        self.write_header(head, h);
        // SAFETY: the slot is free (the caller checked head - tail < nslots) and its data area
        // holds slot_bytes >= h.len bytes, which the peer reads only once the number is out.
        fill(unsafe { self.remote.slot(self.me, head).add(SLOT_HEADER) })?;
        self.remote
            .slot_number(self.me, head)
            .store(head + 1, Ordering::Release);
        self.remote.head(self.me).store(head + 1, Ordering::Relaxed);
        Ok(())
    }

    /// Releases the peer's slots before `upto` (this rank has read them) and wakes the peer.
    pub(super) fn release(&self, upto: u64) {
        self.consumed.store(upto, Ordering::Relaxed);
        self.local.tail(self.peer).store(upto, Ordering::Release);
        self.remote.ring();
    }

    /// Publishes a slot of a header and at most one word of data (a pull descriptor, with the
    /// place offered for the reply, or a notice) at `head` and rings.
    pub(super) fn publish(&self, head: u64, h: &SlotHeader, word: Option<u64>) {
        // Nothing here can fail.
        let _ = self.fill_slot(head, h, |data| {
            if let Some(w) = word {
                // SAFETY: the slot's data area holds slot_bytes >= 8 bytes, line-aligned.
                unsafe { (data as *mut u64).write(w) };
            }
            Ok(())
        });
        self.remote.ring();
    }

    /// Writes into the peer's segment how this end closed (see `Segment::end_note`): what
    /// this rank's segment says, read by a peer that maps it no more.
    pub(super) fn note_end(&self) {
        let (how, first, ours, theirs) = self.remote.end_note(self.me);
        let (o, t) = self.local.disagreed();
        ours.store(o.load(Ordering::SeqCst), Ordering::Relaxed);
        theirs.store(t.load(Ordering::SeqCst), Ordering::Relaxed);
        first.store(
            self.local.first_lost().load(Ordering::SeqCst),
            Ordering::Relaxed,
        );
        how.store(
            self.local.closed().load(Ordering::SeqCst),
            Ordering::Release,
        );
    }

    /// How the peer ended, as it noted in this rank's segment before it freed its own (None:
    /// it noted nothing); the error is the one `check_peer` gives for a closed peer.
    pub(super) fn ended(&self) -> Option<Error> {
        let (how, first, ours, theirs) = self.local.end_note(self.peer);
        let how = crate::transport::Closing::from_code(how.load(Ordering::Acquire))?;
        let first = (first.load(Ordering::Relaxed) as usize).checked_sub(1);
        let tags = match (ours.load(Ordering::Relaxed), theirs.load(Ordering::Relaxed)) {
            (0, 0) => None,
            pair => Some(pair),
        };
        let msg = how.describe_with(self.peer, first, tags);
        let mut e = self.lost(first.filter(|&r| r != self.me).unwrap_or(self.peer), msg);
        e.lost = Some(first.unwrap_or(self.peer));
        e.kind = how.kind();
        e.disagreed = tags.filter(|_| how == crate::transport::Closing::Disagreed);
        Some(e)
    }

    /// This rank lost `rank` (its peer, or the rank the peer lost first): noted in our segment
    /// for the other peers, and the error.
    pub(super) fn lost(&self, rank: usize, msg: String) -> Error {
        self.local.note_lost(rank);
        Error::lost_peer(rank, msg)
    }

    pub(super) fn cma_error(&self, e: std::io::Error) -> Error {
        self.cma_failed(e, "reading", "process_vm_readv")
    }

    pub(super) fn cma_failed(&self, e: std::io::Error, what: &str, call: &str) -> Error {
        if let Err(dead) = self.check_peer() {
            return dead;
        }
        // The process is being torn down: its memory is gone before it counts as exited.
        if e.raw_os_error() == Some(libc::ESRCH) {
            return self.lost(
                self.peer,
                format!("rank {} exited (its process is gone)", self.peer),
            );
        }
        Error::from_io(format!("{what} rank {}'s buffer with {call}", self.peer), e)
    }

    pub(super) fn mismatch(&self, len: u64, tag: u64, expect: &InExpect) -> Error {
        crate::transport::mismatch_error(self.peer, len, tag, expect)
    }
}

/// Every how many eager slots a receiver publishes its tail (`ShmPeer::consumed`): a quarter
/// of a FIFO of 16 slots or more, each slot in smaller ones. A power of two.
pub(super) fn tail_step(nslots: usize) -> u64 {
    if nslots >= 16 {
        4
    } else {
        1
    }
}
