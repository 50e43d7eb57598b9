//! The packed protocol: small messages as stamped entries sharing slots.

use super::peer::ShmPeer;
use super::segment::SLOT_FIELDS;
use crate::reduce::Scale;
use crate::transport::{Doorbell, OutMsg, Progress, SendState};
use std::sync::atomic::{AtomicU64, Ordering};

/// Many small messages, one after the other, each in an entry of its own (`Packed`): a sender
/// that runs ahead fills a line with several of them, so the line moves to the receiver's core
/// once for all, and a FIFO holds hundreds of them instead of one a slot.
pub(super) const KIND_PACKED: u32 = 4;

/// Messages of up to this many bytes are packed.
pub(super) const PACK_MAX: usize = 256;

/// The bytes of a slot that its packed entries may fill (from the slot's start), before the
/// sender takes the next slot: a page, whose lines stay in the caches as the ring turns.
pub(super) const PACK_AREA: usize = 4096;

/// Where a packed slot's first entry begins: after its number and kind, in the same line.
pub(super) const PACK_FIRST: usize = 16;

/// The cache line that packed entries of up to its size do not straddle.
pub(super) const PACK_LINE: usize = 64;

impl ShmPeer {
    /// Sends a message of up to PACK_MAX bytes as an entry of a packed slot: the open one while
    /// it is the last slot published and has room, else a new one (pending while the FIFO is
    /// full).
    pub(super) fn send_packed(
        &self,
        msg: &OutMsg,
        head: u64,
        tail: &mut u64,
    ) -> Progress<SendState> {
        let p = &self.pack;
        let scaled = msg.scale.is_some();
        let bytes = entry_bytes(msg.len, scaled);
        let open = head > 0 && p.open.load(Ordering::Relaxed) == head;
        let mut at = PACK_FIRST;
        if open {
            at = p.at.load(Ordering::Relaxed) as usize;
        }
        let mut place = entry_place(at, bytes);
        let fresh = !open || place + bytes > PACK_AREA;
        if fresh {
            if !self.slot_free(head, tail) {
                return Progress {
                    state: SendState::Pending,
                    moved: false,
                };
            }
            at = PACK_FIRST;
            place = entry_place(at, bytes);
        }
        let seq = if fresh { head } else { head - 1 };
        let slot = self.remote.slot(self.me, seq);
        let n = p.sent.load(Ordering::Relaxed);
        let stamp = stamp_of(n) << STAMP_SHIFT;
        let end = place + bytes;
        // SAFETY: a fresh slot is free (slot_free); in the open one the bytes from `at` on are
        // unused and the receiver reads none of them before it sees their control word.
        // place + bytes <= PACK_AREA <= the slot's stride; msg.src holds msg.len bytes.
        unsafe {
            if fresh {
                (slot.add(SLOT_FIELDS) as *mut u32).write(KIND_PACKED);
                (slot.add(SLOT_FIELDS + 4) as *mut u32).write(0);
            }
            let e = slot.add(place);
            (e.add(8) as *mut u64).write_unaligned(msg.tag);
            let mut data = e.add(16);
            if let Some(s) = msg.scale {
                (data as *mut [u8; 8]).write(s.0);
                data = data.add(8);
            }
            std::ptr::copy_nonoverlapping(msg.src, data, msg.len);
            // Where the receiver looks next holds whatever an earlier use of the slot left
            // there, eager data included, which may look like any stamp: it reads a zero
            // until the next entry is written.
            if end + 16 <= PACK_AREA {
                entry_ctl(slot, end).store(0, Ordering::Relaxed);
            }
            let flags = if scaled { ENTRY_SCALE } else { 0 };
            entry_ctl(slot, place).store(stamp | flags | msg.len as u64, Ordering::Release);
            if place != at {
                entry_ctl(slot, at).store(stamp | ENTRY_SKIP, Ordering::Release);
            }
        }
        if fresh {
            self.remote
                .slot_number(self.me, head)
                .store(head + 1, Ordering::Release);
            self.remote.head(self.me).store(head + 1, Ordering::Relaxed);
            p.open.store(head + 1, Ordering::Relaxed);
        }
        p.at.store(end as u64, Ordering::Relaxed);
        p.sent.store(n + 1, Ordering::Relaxed);
        self.remote.ring();
        Progress {
            state: SendState::Complete,
            moved: true,
        }
    }

    /// Looks in the packed slot `seq` of the peer's FIFO, from `at`, for the entry stamped
    /// `stamp`, following a skip to the next line. The slot is closed once the next slot is
    /// published and the entry is still not there: the sender writes its last entries before
    /// it publishes the next slot.
    pub(super) fn find_packed(&self, seq: u64, mut at: usize, stamp: u64) -> Found {
        let slot = self.local.slot(self.peer, seq);
        let mut next_out = false;
        loop {
            if at + 16 <= PACK_AREA {
                // SAFETY: at + 16 <= PACK_AREA, 8-aligned (entries are multiples of 8 bytes).
                let ctl = unsafe { entry_ctl(slot, at) }.load(Ordering::Acquire);
                if ctl >> STAMP_SHIFT == stamp {
                    if ctl & ENTRY_SKIP != 0 {
                        at = at.next_multiple_of(PACK_LINE);
                        continue;
                    }
                    return Found::Entry { at, ctl };
                }
            }
            if next_out {
                return Found::Closed;
            }
            let next = self.local.slot_number(self.peer, seq + 1);
            if next.load(Ordering::Acquire) != seq + 2 {
                return Found::Nothing;
            }
            next_out = true;
        }
    }

    /// The kind of the published slot `seq` of the peer's FIFO.
    pub(super) fn slot_kind(&self, seq: u64) -> u32 {
        // SAFETY: the kind lies right after the slot's number, which the sender published with
        // Release after writing it, and which the caller read with Acquire.
        unsafe { (self.local.slot(self.peer, seq).add(SLOT_FIELDS) as *const u32).read() }
    }

    /// The length, tag, scale and data of the packed entry at `at` of slot `seq` (control word
    /// `ctl`).
    pub(super) fn packed_entry(
        &self,
        seq: u64,
        at: usize,
        ctl: u64,
    ) -> (usize, u64, Option<Scale>, *const u8) {
        let e = self.local.slot(self.peer, seq).wrapping_add(at);
        // SAFETY: the entry lies inside the slot (the sender placed it below PACK_AREA) and was
        // written before its control word, which the caller read with Acquire.
        unsafe {
            let tag = (e.add(8) as *const u64).read_unaligned();
            if ctl & ENTRY_SCALE != 0 {
                let s = Scale((e.add(16) as *const [u8; 8]).read());
                ((ctl & ENTRY_LEN) as usize, tag, Some(s), e.add(24))
            } else {
                ((ctl & ENTRY_LEN) as usize, tag, None, e.add(16))
            }
        }
    }
}

/// A packed entry begins with a control word: the stamp of its message (`Packing`) in the top
/// 48 bits, then these flags, then its length.
pub(super) const ENTRY_SCALE: u64 = 1 << 13;

/// Not an entry: the entry with this stamp begins at the next line.
pub(super) const ENTRY_SKIP: u64 = 1 << 14;

pub(super) const ENTRY_LEN: u64 = ENTRY_SCALE - 1;

pub(super) const STAMP_SHIFT: u32 = 16;

/// The stamp of the `n`th packed message on a FIFO: never 0 (fresh memory), and the same
/// again only after 2^48 - 1 messages.
pub(super) fn stamp_of(n: u64) -> u64 {
    n % ((1 << (64 - STAMP_SHIFT)) - 1) + 1
}

/// The bytes of a packed entry: its control word and tag, the scale where there is one, and
/// the data rounded up to 8 bytes.
pub(super) fn entry_bytes(len: usize, scaled: bool) -> usize {
    16 + if scaled { 8 } else { 0 } + len.next_multiple_of(8)
}

/// Where an entry of `bytes` goes when the previous one ended at `at`: there, unless it would
/// straddle a line boundary it need not (it fits in a line, or is larger and could start
/// one); then at the next line, and a skip at `at` says so.
pub(super) fn entry_place(at: usize, bytes: usize) -> usize {
    let into = at % PACK_LINE;
    if into != 0 && into + bytes > PACK_LINE {
        at.next_multiple_of(PACK_LINE)
    } else {
        at
    }
}

/// The control word of the entry at `at` in the slot at `slot`.
///
/// # Safety
/// `slot` is a slot of a mapped FIFO and `at + 8 <= PACK_AREA`, 8-aligned.
pub(super) unsafe fn entry_ctl<'a>(slot: *mut u8, at: usize) -> &'a AtomicU64 {
    // SAFETY: the caller's promise; slots are 64-byte aligned, so the word is 8-aligned.
    unsafe { &*(slot.add(at) as *const AtomicU64) }
}

/// What a receiver finds in a packed slot (`ShmPeer::find_packed`).
pub(super) enum Found {
    /// The next message's entry, at this offset, with its control word.
    Entry { at: usize, ctl: u64 },
    /// The slot holds no more: the sender has gone on to the next one.
    Closed,
    /// Nothing yet.
    Nothing,
}

/// Where one end of a link stands in the packed slots of its two FIFOs (`KIND_PACKED`). Both
/// ends count the packed messages, so a receiver knows the stamp of the next entry, and an
/// entry left by an earlier turn of the ring never passes for it. Other leftovers (an earlier
/// eager message's bytes) can look like any stamp, so the sender zeroes the word after each
/// entry before it publishes the entry: the receiver looks only at words written for the slot's
/// present use.
#[derive(Default)]
pub(super) struct Packing {
    /// Sending: one more than the number of the slot that takes entries (0: none). It takes
    /// them while it is the last slot published (`head - 1`).
    pub(super) open: AtomicU64,
    /// Sending: where its next entry goes.
    pub(super) at: AtomicU64,
    /// Sending: packed messages sent.
    pub(super) sent: AtomicU64,
    /// Receiving: where the next entry of the slot at `consumed` is (0: it is not begun).
    pub(super) read_at: AtomicU64,
    /// Receiving: packed messages received.
    pub(super) received: AtomicU64,
}

impl Packing {
    /// Where the receiver looks for the next entry of the packed slot at `consumed`.
    pub(super) fn read_from(&self) -> usize {
        match self.read_at.load(Ordering::Relaxed) {
            0 => PACK_FIRST,
            a => a as usize,
        }
    }
}
