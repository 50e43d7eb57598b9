//! The shared-memory transport between ranks of one host.
//!
//! Every rank owns one segment (a memfd) that holds its doorbell and one FIFO per peer for the
//! messages that peer sends it. Peers in other processes receive the memfd over an authenticated
//! unix socket; peers that are threads of the same process duplicate the descriptor. A FIFO is a
//! ring of slots with a head (advanced by the sender) and a tail (advanced by the receiver).
//!
//! Small messages travel *eagerly*: copied into slots by the sender, out of them by the receiver.
//! Those of up to `PACK_MAX` bytes share slots (`KIND_PACKED`): each is an entry after the last,
//! stamped with its number, so a sender that runs ahead puts several in one cache line and a
//! FIFO holds hundreds of them (a root's small broadcasts to ranks that wait for a CPU).
//! Large ones are *pulled*: the sender publishes the address of its buffer and the receiver copies
//! straight out of it, with `process_vm_readv` (CMA) between processes or a plain read between
//! threads; releasing the descriptor's slot tells the sender its buffer is free again. Whether a
//! receiver may pull is probed at setup, so kernels or sandboxes that forbid CMA fall back to the
//! eager path cleanly.
//!
//! A pulled message may also carry the sender's leave to write the reply into its buffer
//! (`OutMsg::reply_at`: a two-rank all-reduce receives the reduced half exactly where it sent
//! its input from, in place, or at the same place of its receive buffer, out of place). A
//! receiver that folds the message and sends the result straight back writes it there piece
//! by piece (`process_vm_writev`) while the folded bytes are still in its cache, and its later
//! send is a notice without data.

use super::os::{self, Mapping, ProcessWatch};
use super::{
    Activity, Closing, Doorbell, InExpect, Link, OutMsg, Progress, Pulling, RecvCursor, SendCursor,
    SendState, Sink,
};
use crate::bootstrap::{auth, Bootstrap};
use crate::error::{Error, Result};
use crate::reduce::Scale;
use crate::topo::{Path, Placement};
use crate::wire::{self, Reader};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SEG_MAGIC: u64 = 0x636f_6d6d_7368_6d38; // "commshm8": the segment layout's version
const LINE: usize = 128;
/// The CPU's bits in the `running_on` word.
const CPU_MASK: u32 = (1 << 30) - 1;
const CTL_BASE: usize = 4 * LINE;
const CTL_STRIDE: usize = 3 * LINE;
/// A slot starts with its message number (8 bytes, written last) and the header; data follows
/// on the next cache line.
const SLOT_HEADER: usize = 64;
const SLOT_FIELDS: usize = 8;

const KIND_EAGER: u32 = 1;
const KIND_PULL: u32 = 2;
/// No bytes: the receiver of an earlier pulled message wrote this one's bytes into the buffer
/// that message came from (`OutMsg::reply_at`), which is where this one lands (`src_addr`).
const KIND_RETURNED: u32 = 3;
/// Many small messages, one after the other, each in an entry of its own (`Packed`): a sender
/// that runs ahead fills a line with several of them, so the line moves to the receiver's core
/// once for all, and a FIFO holds hundreds of them instead of one a slot.
const KIND_PACKED: u32 = 4;
/// Messages of up to this many bytes are packed.
const PACK_MAX: usize = 256;
/// The bytes of a slot that its packed entries may fill (from the slot's start), before the
/// sender takes the next slot: a page, whose lines stay in the caches as the ring turns.
const PACK_AREA: usize = 4096;
/// Where a packed slot's first entry begins: after its number and kind, in the same line.
const PACK_FIRST: usize = 16;
/// The cache line that packed entries of up to its size do not straddle.
const PACK_LINE: usize = 64;
/// The smallest message a receiver pulls from the sender's buffer instead of taking it through
/// the slots, by default: between ranks of one process the pull is a memcpy, between
/// processes a process_vm_readv, whose system call and page walk cost more than the slots'
/// second copy (which pipelines) up to about a megabyte. Two processes, alternating runs of 32 KiB
/// to 16 MiB: at 1 MiB instead of 32 KiB, all-reduce 128 KiB 13-16 us instead of 40-55, in-place
/// all-gather 512 KiB 28 instead of 124-145, reduce-scatter 512 KiB 35 instead of 38-54;
/// from 4 MiB on, within noise.
const PULL_FROM_THREAD: usize = 32 << 10;
const PULL_FROM_PROCESS: usize = 1 << 20;
/// The same between processes when the sender has received bytes of its own to copy in the run
/// (all-reduce, all-gather, all-to-all, exchanges): a slice-sized message then costs the
/// machine one copy instead of two, and the sender's time goes to its own receives. Where the
/// sender has nothing else to do (a broadcast's root) the slots' two copies, one on each core,
/// pipeline and win, and where every receive reduces (reduce-scatter) the receiver's pull
/// lands in scratch before its fold, which costs as much as the sender's copy into a slot.
/// Alternating runs, 2 and 4 processes, against 1 MiB: all-reduce 4-64 MiB 0.82-0.97x the
/// time, all-gather 0.70-0.85x, all-to-all 0.73-0.89x; reduce-scatter and in-place broadcast
/// 1.1-1.5x slower when they pulled too (so they do not).
const PULL_FROM_BUSY_PROCESS: usize = 512 << 10;
/// Lower when the receiver copies the bytes as they are (`OutMsg::copied`: nothing in the
/// operation reduces) or may write its reply back (`OutMsg::reply_at`): the pull then replaces
/// both slot copies with one. Below this the slots still win: their two copies pipeline, one
/// on each core, while a pull pays a system call and a walk of the sender's pages, and (where
/// a host has more ranks than CPUs) completes only once the receiver has been scheduled.
/// Measured on the project's AMD EPYC VM (2 vCPUs, 2 processes), libraries differing only
/// here, alternating runs, median time against 16 KiB (which an Intel VM had favoured where
/// ranks fit the CPUs, before the slots' receivers fetched ahead): on buffers the caches hold
/// (the benchmark's `-e` at 1-2 MiB), all-gather 32-64 KiB 0.44-0.92x and all-to-all 32-64 KiB
/// 0.66-0.87x; on buffers that move every call (`-e 64M`, 8 rounds), in place 0.69-0.90x at
/// 32 KiB, the rest within the noise (+-15 %). Higher thresholds gained more on cached
/// buffers (128-256 KiB: 128 KiB operations 0.48-0.69x) but were 1.06-1.21x slower out of
/// place on moving ones, so this stays where both agree.
const PULL_FROM_BUSY_COPY: usize = 64 << 10;
const FLAG_SCALE: u32 = 1;
/// On a pull descriptor: the sender offers a place for the reply (`OutMsg::reply_at`), whose
/// address is the descriptor's one word of data.
const FLAG_REPLY_AT: u32 = 2;

/// Slot memory faulted in at setup only while one segment's FIFOs stay within this.
const PREFAULT_MAX: usize = 16 << 20;

/// Bytes pulled per call, so one large message cannot starve the other channels of its thread.
const PULL_BUDGET: usize = 4 << 20;
/// Pieces a CMA pull is cut into when the bytes must be combined rather than copied: small
/// enough that the piece, the receiver's own bytes and the sender's lines all stay in L2
/// between the copy, the reduction and a write-back (`OutMsg::reply_at`), large enough that
/// the kernel's per-call cost (pinning pages) stays small. The scratch they land in is
/// huge-page backed. A model of the two-rank all-reduce in place (two processes pulling,
/// folding and writing back 32 MiB each) took 5.6-6.3 ms with 128-256 KiB pieces, 6.3 ms
/// with 512 KiB and 9.0 ms with 1 MiB.
const PULL_PIECE: usize = 256 << 10;
/// A pulled piece lands in scratch at the same offset within a page as it lies in the sender's
/// buffer (`landing`): a copy whose destination runs a little ahead of its source modulo
/// 4 KiB has each load wait on an earlier store to a different address with the same low
/// bits (4K aliasing). Two processes, 64 MiB all-reduce, buffers at 16 or 64 bytes into a
/// page against 4080: out of place 16-22 ms against 33-34, in place 12-15 against 24-29,
/// with the scratch at a page's start.
const PAGE_SPAN: usize = 4096;

/// Where in the scratch (`PULL_PIECE + PAGE_SPAN` bytes) the piece of the sender's buffer
/// at `src` lands: its offset within a page.
fn landing(src: usize) -> usize {
    src % PAGE_SPAN
}

/// Geometry of a segment, chosen by its owner and read back by peers from its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    nranks: usize,
    nslots: usize,
    slot_bytes: usize,
    /// Bytes at the end for the registry of registered buffers (`transport::reg` lays them
    /// out; the segment only reserves them).
    registry_bytes: usize,
}

impl Geometry {
    fn from_env(nranks: usize, registry_bytes: usize) -> Geometry {
        let nslots = crate::env::SHM_SLOTS
            .int_if_set()
            .filter(|&v| (2..=1024).contains(&v))
            .unwrap_or_else(|| crate::env::SHM_SLOTS.default_int()) as usize;
        let slot_bytes = crate::env::SHM_SLOT_BYTES
            .size_if_set()
            .filter(|&v| (4096..=(64 << 20)).contains(&v))
            .unwrap_or_else(|| crate::env::SHM_SLOT_BYTES.default_size());
        Geometry {
            nranks,
            nslots,
            slot_bytes: slot_bytes.next_multiple_of(LINE),
            registry_bytes,
        }
    }

    fn slot_stride(&self) -> usize {
        SLOT_HEADER + self.slot_bytes
    }

    /// One sender's ring of slots.
    fn fifo_bytes(&self) -> usize {
        self.nslots * self.slot_stride()
    }

    fn slots_base(&self) -> usize {
        (CTL_BASE + self.nranks * CTL_STRIDE).next_multiple_of(4096)
    }

    /// Where the registry of registered buffers begins (see `transport::reg`).
    fn registry_base(&self) -> usize {
        (self.slots_base() + self.nranks * self.nslots * self.slot_stride()).next_multiple_of(4096)
    }

    fn total(&self) -> usize {
        self.registry_base() + self.registry_bytes
    }
}

/// The header the sender writes into a slot before publishing it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SlotHeader {
    kind: u32,
    flags: u32,
    msg_len: u64,
    tag: u64,
    scale: [u8; 8],
    offset: u64,
    len: u64,
    src_addr: u64,
}

/// Where a segment's slots lie, worked out once from its geometry: `Segment::slot` runs
/// several times per message, and working out the area's start each time cost 40-60
/// instructions a message on each side (callgrind, 8-byte two-rank broadcast).
#[derive(Clone, Copy, Debug)]
struct SlotArea {
    base: usize,
    stride: usize,
    nslots: usize,
    /// `nslots - 1` where the count is a power of two, as it is unless set otherwise: a mask
    /// instead of a division (tens of cycles).
    mask: Option<u64>,
}

impl SlotArea {
    fn of(g: &Geometry) -> SlotArea {
        SlotArea {
            base: g.slots_base(),
            stride: g.slot_stride(),
            nslots: g.nslots,
            mask: g.nslots.is_power_of_two().then(|| g.nslots as u64 - 1),
        }
    }
}

/// One rank's segment, mapped into this process.
pub(crate) struct Segment {
    map: Mapping,
    geo: Geometry,
    slots: SlotArea,
    /// Held by the owner so same-process peers can duplicate it while the communicator lives.
    fd: Option<OwnedFd>,
}

impl Segment {
    fn create(owner_rank: usize, geo: Geometry, nonce: u64) -> Result<Segment> {
        let fd = os::memfd(&format!("comm-shm-r{owner_rank}"), geo.total())?;
        let map = Mapping::map(fd.as_raw_fd(), geo.total())?;
        let seg = Segment {
            map,
            geo,
            slots: SlotArea::of(&geo),
            fd: Some(fd),
        };
        // SAFETY: the header fields lie inside the first line of a fresh mapping nobody else sees yet.
        unsafe {
            let p = seg.map.ptr();
            (p.add(8) as *mut u32).write(geo.nranks as u32);
            (p.add(12) as *mut u32).write(geo.nslots as u32);
            (p.add(16) as *mut u64).write(geo.slot_bytes as u64);
            (p.add(24) as *mut u32).write(std::process::id());
            (p.add(32) as *mut u64).write(nonce);
            (p.add(40) as *mut u64).write(geo.registry_bytes as u64);
        }
        seg.atomic_u64(0).store(SEG_MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Maps a peer's segment and checks it is the one the peer announced.
    fn open(fd: OwnedFd, nonce: u64, nranks: usize) -> Result<Segment> {
        // SAFETY: fstat only fills the stat buffer.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is valid and st is a writable stat.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::last_os("fstat of a peer's shared segment"));
        }
        let len = st.st_size as usize;
        if len < 4096 {
            return crate::remote_err!("peer's shared segment is only {len} bytes");
        }
        let map = Mapping::map(fd.as_raw_fd(), len)?;
        // SAFETY: the mapping is at least one page, the header is in its first line.
        let (magic, geo, seg_nonce) = unsafe {
            let p = map.ptr();
            (
                (*(p as *const AtomicU64)).load(Ordering::Acquire),
                Geometry {
                    nranks: (p.add(8) as *const u32).read() as usize,
                    nslots: (p.add(12) as *const u32).read() as usize,
                    slot_bytes: (p.add(16) as *const u64).read() as usize,
                    registry_bytes: (p.add(40) as *const u64).read() as usize,
                },
                (p.add(32) as *const u64).read(),
            )
        };
        if magic != SEG_MAGIC || seg_nonce != nonce || geo.nranks != nranks || geo.total() != len {
            return crate::remote_err!(
                "peer's shared segment does not match what it announced (magic {magic:#x}, nonce {seg_nonce:#x} vs {nonce:#x}, {} ranks vs {nranks}, {len} bytes)",
                geo.nranks
            );
        }
        Ok(Segment {
            map,
            geo,
            slots: SlotArea::of(&geo),
            fd: None,
        })
    }

    fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= self.map.len() && off % 4 == 0);
        // SAFETY: in bounds and aligned (checked above); the mapping lives as long as &self and is
        // only ever accessed atomically at this offset.
        unsafe { &*(self.map.ptr().add(off) as *const AtomicU32) }
    }

    /// The 64-bit word at byte `off` of the registry area.
    pub(super) fn registry_u64(&self, off: usize) -> &AtomicU64 {
        self.atomic_u64(self.geo.registry_base() + off)
    }

    fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= self.map.len() && off % 8 == 0);
        // SAFETY: as in atomic_u32.
        unsafe { &*(self.map.ptr().add(off) as *const AtomicU64) }
    }

    fn closed(&self) -> &AtomicU32 {
        self.atomic_u32(28)
    }

    /// The first peer this rank found gone, plus one (0: none). Peers that see this rank
    /// abort or destroy read it, so their error names the rank that was lost first.
    fn first_lost(&self) -> &AtomicU32 {
        self.atomic_u32(3 * LINE)
    }

    fn doorbell(&self) -> &AtomicU32 {
        self.atomic_u32(LINE)
    }

    /// Where this rank closed as `Closing::Disagreed`: the tag it expected and the tag it
    /// received (0 and 0 until then), written before the close, read by peers after it.
    fn disagreed(&self) -> (&AtomicU64, &AtomicU64) {
        (
            self.atomic_u64(3 * LINE + 8),
            self.atomic_u64(3 * LINE + 16),
        )
    }

    /// The CPU the owner's progress loop last ran on, plus one (0: never said), in the low 30
    /// bits; in the top two what it does (`Activity`: 0 polling, 1 sleeping, 2 outside).
    /// Written only when it changes, so the line stays shared between the owner and the peers
    /// that read it.
    fn running_on(&self) -> &AtomicU32 {
        self.atomic_u32(3 * LINE + 64)
    }

    /// Counts up while the owner's progress loop runs (see `Doorbell::heartbeat`); in the line
    /// of `running_on`, which readers fetch anyway.
    fn beat(&self) -> &AtomicU32 {
        self.atomic_u32(3 * LINE + 68)
    }

    fn sleepers(&self) -> &AtomicU32 {
        self.atomic_u32(2 * LINE)
    }

    fn head(&self, sender: usize) -> &AtomicU64 {
        self.atomic_u64(CTL_BASE + sender * CTL_STRIDE)
    }

    fn tail(&self, sender: usize) -> &AtomicU64 {
        self.atomic_u64(CTL_BASE + sender * CTL_STRIDE + LINE)
    }

    fn pull_ok(&self, sender: usize) -> &AtomicU32 {
        self.atomic_u32(CTL_BASE + sender * CTL_STRIDE + 2 * LINE)
    }

    /// The message number the slot holds now: message k is in its slot once this reads k + 1.
    fn slot_number(&self, sender: usize, seq: u64) -> &AtomicU64 {
        // SAFETY: the slot start is in bounds (checked by slot()) and 8-aligned (the slot area
        // and strides are multiples of 64); this word is only ever accessed atomically.
        unsafe { &*(self.slot(sender, seq) as *const AtomicU64) }
    }

    /// Faults in the pages of `sender`'s FIFO in this mapping (MADV_POPULATE_WRITE, Linux
    /// 5.14+; nothing on older kernels), so that the first messages through the slots do not
    /// pay a page fault per 4 KiB in each process: about 0.4 ms for the default 1 MiB FIFO,
    /// which a short run that had pulled everything before showed as 1.2-1.3x slower in-place
    /// all-to-all calls for its first hundred calls.
    fn prefault_fifo(&self, sender: usize) {
        const MADV_POPULATE_WRITE: i32 = 23;
        let len = self.geo.fifo_bytes();
        let start = self.geo.slots_base() + sender * len;
        let (from, to) = (start & !4095, (start + len).next_multiple_of(4096));
        if to <= self.map.len() {
            // SAFETY: the range lies inside the mapping; populating leaves the contents as
            // they are.
            unsafe {
                libc::madvise(
                    self.map.ptr().add(from).cast(),
                    to - from,
                    MADV_POPULATE_WRITE,
                )
            };
        }
    }

    /// Reads the number of each of `sender`'s slots (for `Link::warm`).
    fn read_slot_numbers(&self, sender: usize) {
        for seq in 0..self.geo.nslots as u64 {
            std::hint::black_box(self.slot_number(sender, seq).load(Ordering::Relaxed));
        }
    }

    /// Asks the CPU to bring the first two lines of `sender`'s slot `seq` (its number, header
    /// and first data) into this core's cache; nothing on other architectures.
    #[inline]
    fn prefetch_slot(&self, sender: usize, seq: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let p = self.slot(sender, seq) as *const i8;
            // SAFETY: prefetching is a hint with no architectural effect; both lines lie in
            // the slot, inside the mapping (slots are at least SLOT_HEADER + 64 bytes apart).
            unsafe {
                _mm_prefetch(p, _MM_HINT_T0);
                _mm_prefetch(p.add(SLOT_HEADER), _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (sender, seq);
    }

    fn slot(&self, sender: usize, seq: u64) -> *mut u8 {
        let a = &self.slots;
        let idx = match a.mask {
            Some(m) => seq & m,
            None => seq % a.nslots as u64,
        } as usize;
        let off = a.base + (sender * a.nslots + idx) * a.stride;
        assert!(off + a.stride <= self.map.len());
        // SAFETY: in bounds (checked above).
        unsafe { self.map.ptr().add(off) }
    }

    /// Tells peers this end is gone, and why; they fail instead of waiting for it.
    fn mark_closed(&self, how: Closing, lost: Option<usize>) {
        if let Some(l) = lost {
            self.note_lost(l);
        }
        // A failure or an abort stays one when the communicator is destroyed afterwards.
        self.closed().fetch_max(how as u32, Ordering::SeqCst);
    }

    /// The first rank this rank lost, for peers that later see it close.
    fn note_lost(&self, rank: usize) {
        let _ = self.first_lost().compare_exchange(
            0,
            rank as u32 + 1,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    fn base_addr(&self) -> usize {
        self.map.ptr() as usize
    }
}

impl Doorbell for Segment {
    /// Wakes the owner if it sleeps on its doorbell. Callers publish their change first; the
    /// fence orders it before the look at `sleepers`, so either the owner's last look for work
    /// (see `prepare_sleep`) sees the change or this sees the owner asleep. The doorbell line
    /// is only written when someone sleeps, so busy ranks do not bounce it between cores.
    fn ring(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleepers().load(Ordering::SeqCst) > 0 {
            self.doorbell().fetch_add(1, Ordering::SeqCst);
            os::futex_wake_all(self.doorbell());
        }
    }

    /// Announces that the owner is about to sleep and returns the doorbell value to sleep on.
    /// The owner must look for work once more afterwards, then call `sleep` or `cancel_sleep`.
    fn prepare_sleep(&self) -> u32 {
        self.sleepers().fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence in ring(): the owner's next look for work cannot move before the
        // announcement (on x86 the locked add already is a full barrier).
        std::sync::atomic::fence(Ordering::SeqCst);
        self.doorbell().load(Ordering::SeqCst)
    }

    fn cancel_sleep(&self) {
        self.sleepers().fetch_sub(1, Ordering::SeqCst);
    }

    /// Sleeps until someone rings after `prepare_sleep` returned `seen`, or `timeout` passes.
    fn sleep(&self, seen: u32, timeout: Duration) {
        os::futex_wait(self.doorbell(), seen, timeout);
        self.sleepers().fetch_sub(1, Ordering::SeqCst);
    }

    fn set_running_on(&self, cpu: u32, what: Activity) {
        let state = match what {
            Activity::Polling => 0,
            Activity::Sleeping => 1,
            Activity::Outside => 2,
        };
        let v = (cpu.wrapping_add(1) & CPU_MASK) | state << 30;
        let word = self.running_on();
        if word.load(Ordering::Relaxed) != v {
            word.store(v, Ordering::Relaxed);
        }
    }

    fn heartbeat(&self) {
        let b = self.beat();
        b.store(b.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }
}

/// A message whose bytes this rank moved while it received what they were combined from, and
/// whose send is still to come: the send of `len` bytes from `local` with `tag`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Carried {
    tag: u64,
    local: usize,
    len: usize,
    how: Carriage,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Carriage {
    /// Written into the sender's buffer at `remote` (`OutMsg::reply_at`): the send is a
    /// notice.
    WrittenBack { remote: usize },
    /// The first `sent` bytes went into the FIFO's slots as they were folded
    /// (`Sink::forwards`): the send goes on from there.
    Forwarded { sent: usize },
}

/// The carried messages whose sends are still to come. Every send looks here first, so an
/// empty list must cost no lock: a locked instruction waits until the previous message's
/// stores into the peer's FIFO have reached the peer's core.
#[derive(Default)]
struct CarriedList {
    list: Mutex<Vec<Carried>>,
    /// Whether `list` may hold something. Pushes and takes happen in the executor that owns
    /// the link, one at a time (its communicator's lock orders successive runs).
    any: AtomicBool,
}

impl CarriedList {
    fn push(&self, w: Carried) {
        self.list.lock().push(w);
        self.any.store(true, Ordering::Relaxed);
    }

    /// What carried `msg`'s bytes already, if anything (taken off the list).
    fn take(&self, msg: &OutMsg) -> Option<Carried> {
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
enum Access {
    /// Threads of one process: the address is ours too.
    Direct,
    /// Another process: process_vm_readv.
    Cma(u32),
}

/// One peer reached through shared memory.
pub(crate) struct ShmPeer {
    me: usize,
    peer: usize,
    /// Our segment: the FIFO this peer sends us, and our doorbell.
    local: Arc<Segment>,
    /// The peer's segment: the FIFO we send it, and its doorbell.
    pub(super) remote: Arc<Segment>,
    access: Access,
    watch: Option<ProcessWatch>,
    pull_threshold: usize,
    /// The threshold for messages whose sender is busy (`OutMsg::sender_busy`).
    pull_threshold_busy: usize,
    /// The threshold for a busy sender's messages that the receiver copies as they are
    /// (`OutMsg::copied`) and for those that offer their buffer for the reply.
    pull_threshold_copied: usize,
    scratch: Mutex<Option<os::HugeMem>>,
    /// Combined bytes this rank wrote back into the peer's buffer (`Sink::returns`) or
    /// forwarded (`Sink::forwards`), whose sends are a notice or the rest of the bytes.
    carried: CarriedList,
    /// The last value of the peer's tail this rank read (a lower bound of the real one).
    tail_seen: AtomicU64,
    /// How many slots of the peer's FIFO this rank has read. The tail the peer sees follows
    /// it every `tail_step` eager slots, and whenever this rank finds the FIFO empty or
    /// finishes a pulled or returned message: the tail's line then moves to the sender's core
    /// once per few messages instead of after each.
    consumed: AtomicU64,
    tail_step: u64,
    /// Where this end stands in packed slots, sending and receiving.
    pack: Packing,
    /// The peer's `running_on` and heartbeat as last read, and since when they have had
    /// those values.
    beat_seen: Mutex<Option<(u64, Instant)>>,
}

impl ShmPeer {
    /// The header of slot `seq` of the peer's FIFO.
    fn read_header(&self, seq: u64) -> SlotHeader {
        // SAFETY: the header lies inside our segment after the slot's number; the sender wrote
        // it before publishing that number with Release, which we read with Acquire.
        unsafe {
            (self.local.slot(self.peer, seq).add(SLOT_FIELDS) as *const SlotHeader).read_unaligned()
        }
    }

    fn write_header(&self, seq: u64, h: &SlotHeader) {
        // SAFETY: the header lies inside the peer's segment after the slot's number; the slot is
        // free (head - tail < nslots), and the receiver reads the header only once we publish
        // the number.
        unsafe {
            (self.remote.slot(self.me, seq).add(SLOT_FIELDS) as *mut SlotHeader).write_unaligned(*h)
        }
    }

    /// Moves up to PULL_BUDGET bytes of a pulled message into the sink; and, where the sender
    /// lets us and the sink will send the combined bytes straight back, writes them into the
    /// sender's buffer piece by piece while they are in cache (`write_back`).
    fn pull(&self, cur: &mut RecvCursor, p: Pulling, tag: u64, sink: &mut dyn Sink) -> Result<()> {
        let Pulling {
            src, total, scale, ..
        } = p;
        let back = write_back(p, &*sink, self.access);
        let forward = back.is_none() && sink.forwards();
        let end = total.min(cur.received + PULL_BUDGET);
        if let Some(dst) = sink.direct() {
            let (off, n) = (cur.received, end - cur.received);
            match self.access {
                // SAFETY: the sender keeps [src, src+total) valid and unchanged until we release
                // its descriptor; dst is the sink's destination of at least `total` bytes.
                Access::Direct => unsafe {
                    crate::reduce::copy_bytes(dst.add(off), (src + off) as *const u8, n)
                },
                // The kernel's copy would run slow at this distance (`just_ahead`): pieces
                // land in scratch at the source's offset within a page and a loop copies them on.
                Access::Cma(pid)
                    if crate::reduce::just_ahead(
                        // SAFETY: dst covers `total` bytes, `off` among them.
                        unsafe { dst.add(off) },
                        (src + off) as *const u8,
                    ) =>
                {
                    let mut scratch = self.scratch()?;
                    let mut k = 0;
                    while k < n {
                        let m = PULL_PIECE.min(n - k);
                        let at = src + off + k;
                        // SAFETY: scratch holds PULL_PIECE + PAGE_SPAN bytes; dst covers
                        // `total` bytes, [off + k, off + k + m) among them.
                        unsafe {
                            let land = scratch.as_mut_ptr().add(landing(at));
                            os::cma_read(pid, land, at, m).map_err(|e| self.cma_error(e))?;
                            crate::reduce::copy_bytes(dst.add(off + k), land, m);
                        }
                        k += m;
                    }
                }
                // SAFETY: dst is valid for `total` bytes of writes.
                Access::Cma(pid) => unsafe { os::cma_read(pid, dst.add(off), src + off, n) }
                    .map_err(|e| self.cma_error(e))?,
            }
            sink.placed(off, n, scale)?;
            if let Some((d, at)) = back {
                self.put_back(d, at, off, n, None)?;
            }
            cur.received = end;
            return Ok(());
        }
        match self.access {
            Access::Direct => {
                let (off, n) = (cur.received, end - cur.received);
                // SAFETY: as above, the sender's bytes stay put until we release the descriptor.
                let data = unsafe { std::slice::from_raw_parts((src + off) as *const u8, n) };
                sink.put(off, data, scale)?;
                if let Some((d, at)) = back {
                    self.put_back(d, at, off, n, None)?;
                }
                cur.received = end;
            }
            Access::Cma(pid) => {
                let mut scratch = self.scratch()?;
                while cur.received < end {
                    let n = PULL_PIECE.min(end - cur.received);
                    // SAFETY: scratch holds PULL_PIECE + PAGE_SPAN bytes, so n <= PULL_PIECE
                    // of them from any landing offset below PAGE_SPAN.
                    let land = unsafe { scratch.as_mut_ptr().add(landing(src + cur.received)) };
                    // SAFETY: as above.
                    unsafe { os::cma_read(pid, land, src + cur.received, n) }
                        .map_err(|e| self.cma_error(e))?;
                    // SAFETY: the n bytes at `land` were just written.
                    let data = unsafe { std::slice::from_raw_parts(land, n) };
                    let done = if forward && !cur.forward_stopped {
                        self.forward(cur, (tag, total), data, scale, sink)?
                    } else {
                        0
                    };
                    if done < n {
                        // What is forwarded must be the reply's first bytes: no more of it.
                        cur.forward_stopped = true;
                        sink.put(cur.received + done, &data[done..], scale)?;
                    }
                    if let Some((d, at)) = back {
                        self.put_back(d, at, cur.received, n, Some(&mut scratch))?;
                    }
                    cur.received += n;
                }
            }
        }
        Ok(())
    }

    /// Folds `data`, bytes `[cur.received, ..)` of a pulled message, through the sink
    /// (`Sink::put_also`) straight into free slots of our FIFO to the peer, as the first bytes
    /// of the reply (`Sink::forwards`: the next message to that peer, `total` bytes with `tag`,
    /// from the sink's result). Returns how many bytes went; when the slots run out,
    /// forwarding stops for the rest of the message, which the reply's send then sends. So
    /// it does where earlier bytes of the message went elsewhere (the sink began forwarding
    /// only after the first pieces, or they were written back): what goes into the slots must
    /// be the reply's first bytes, without a gap.
    fn forward(
        &self,
        cur: &mut RecvCursor,
        (tag, total): (u64, usize),
        data: &[u8],
        scale: Option<Scale>,
        sink: &mut dyn Sink,
    ) -> Result<usize> {
        let Some(from) = sink.returns() else {
            return Ok(0);
        };
        if cur.forwarded != cur.received {
            cur.forward_stopped = true;
            return Ok(0);
        }
        let mut head = self.remote.head(self.me).load(Ordering::Relaxed);
        let mut tail = self.tail_seen.load(Ordering::Relaxed);
        let mut k = 0;
        while k < data.len() {
            if !self.slot_free(head, &mut tail) {
                cur.forward_stopped = true;
                break;
            }
            let m = self.remote.geo.slot_bytes.min(data.len() - k);
            let at = cur.received + k;
            let h = SlotHeader {
                kind: KIND_EAGER,
                flags: 0,
                msg_len: total as u64,
                offset: at as u64,
                len: m as u64,
                src_addr: from as u64,
                tag,
                scale: [0; 8],
            };
            self.fill_slot(head, &h, |out| {
                sink.put_also(at, &data[k..k + m], scale, out)
            })?;
            head += 1;
            k += m;
        }
        cur.forwarded += k;
        if k > 0 {
            self.remote.ring();
        }
        Ok(k)
    }

    /// Whether slot `head` of our FIFO to the peer is free. The peer's tail (`tail`, the last
    /// value seen) is read again, and remembered in `tail_seen`, only when the slots known to
    /// be free have run out.
    #[inline]
    fn slot_free(&self, head: u64, tail: &mut u64) -> bool {
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
    fn fill_slot(
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

    /// Sends a message of up to PACK_MAX bytes as an entry of a packed slot: the open one while
    /// it is the last slot published and has room, else a new one (pending while the FIFO is
    /// full).
    fn send_packed(&self, msg: &OutMsg, head: u64, tail: &mut u64) -> Progress<SendState> {
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
    fn find_packed(&self, seq: u64, mut at: usize, stamp: u64) -> Found {
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
    fn slot_kind(&self, seq: u64) -> u32 {
        // SAFETY: the kind lies right after the slot's number, which the sender published with
        // Release after writing it, and which the caller read with Acquire.
        unsafe { (self.local.slot(self.peer, seq).add(SLOT_FIELDS) as *const u32).read() }
    }

    /// The length, tag, scale and data of the packed entry at `at` of slot `seq` (control word
    /// `ctl`).
    fn packed_entry(
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

    /// Releases the peer's slots before `upto` (this rank has read them) and wakes the peer.
    fn release(&self, upto: u64) {
        self.consumed.store(upto, Ordering::Relaxed);
        self.local.tail(self.peer).store(upto, Ordering::Release);
        self.remote.ring();
    }

    /// Publishes a slot of a header and at most one word of data (a pull descriptor, with the
    /// place offered for the reply, or a notice) at `head` and rings.
    fn publish(&self, head: u64, h: &SlotHeader, word: Option<u64>) {
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

    /// Writes bytes `[off, off+n)` of the sink's result `d` into the sender's memory at `src`
    /// (the place it offered for its reply). Where the kernel's copy would run slow
    /// (`just_ahead`) and `scratch` (of `PULL_PIECE + PAGE_SPAN` bytes, `n <= PULL_PIECE`) is
    /// at hand, the bytes go through it at the destination's distance.
    fn put_back(
        &self,
        d: *const u8,
        src: usize,
        off: usize,
        n: usize,
        scratch: Option<&mut os::HugeMem>,
    ) -> Result<()> {
        match self.access {
            // SAFETY: d covers the message's bytes of the sink's result; the sender lent us
            // [src, src+total) for its reply (FLAG_REPLY_AT) and touches none of it until we
            // release the descriptor.
            Access::Direct => unsafe {
                crate::reduce::copy_bytes((src + off) as *mut u8, d.add(off), n)
            },
            // SAFETY: as above, in the sender's address space; the staged copy stays inside
            // scratch, which the caller sized.
            Access::Cma(pid) => unsafe {
                let (from, to) = (d.add(off), src + off);
                let from = match scratch {
                    Some(s)
                        if n <= PULL_PIECE && crate::reduce::just_ahead(to as *const u8, from) =>
                    {
                        let stage = s.as_mut_ptr().add(landing(to));
                        crate::reduce::copy_bytes(stage, from, n);
                        stage.cast_const()
                    }
                    _ => from,
                };
                os::cma_write(pid, from, to, n)
            }
            .map_err(|e| self.cma_failed(e, "writing a reply into", "process_vm_writev"))?,
        }
        Ok(())
    }

    /// The scratch that CMA pulls land in (`PULL_PIECE + PAGE_SPAN` bytes), made on first use.
    fn scratch(&self) -> Result<parking_lot::MappedMutexGuard<'_, os::HugeMem>> {
        let mut slot = self.scratch.lock();
        if slot.is_none() {
            *slot = Some(os::HugeMem::new(PULL_PIECE + PAGE_SPAN)?);
        }
        Ok(parking_lot::MutexGuard::map(slot, |s| {
            s.as_mut().expect("made above")
        }))
    }

    /// This rank lost `rank` (its peer, or the rank the peer lost first): noted in our segment
    /// for the other peers, and the error.
    fn lost(&self, rank: usize, msg: String) -> Error {
        self.local.note_lost(rank);
        Error::lost_peer(rank, msg)
    }

    fn cma_error(&self, e: std::io::Error) -> Error {
        self.cma_failed(e, "reading", "process_vm_readv")
    }

    fn cma_failed(&self, e: std::io::Error, what: &str, call: &str) -> Error {
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

    fn mismatch(&self, len: u64, tag: u64, expect: &InExpect) -> Error {
        crate::transport::mismatch_error(self.peer, len, tag, expect)
    }
}

/// A packed entry begins with a control word: the stamp of its message (`Packing`) in the top
/// 48 bits, then these flags, then its length.
const ENTRY_SCALE: u64 = 1 << 13;
/// Not an entry: the entry with this stamp begins at the next line.
const ENTRY_SKIP: u64 = 1 << 14;
const ENTRY_LEN: u64 = ENTRY_SCALE - 1;
const STAMP_SHIFT: u32 = 16;

/// The stamp of the `n`th packed message on a FIFO: never 0 (fresh memory), and the same
/// again only after 2^48 - 1 messages.
fn stamp_of(n: u64) -> u64 {
    n % ((1 << (64 - STAMP_SHIFT)) - 1) + 1
}

/// The bytes of a packed entry: its control word and tag, the scale where there is one, and
/// the data rounded up to 8 bytes.
fn entry_bytes(len: usize, scaled: bool) -> usize {
    16 + if scaled { 8 } else { 0 } + len.next_multiple_of(8)
}

/// Where an entry of `bytes` goes when the previous one ended at `at`: there, unless it would
/// straddle a line boundary it need not (it fits in a line, or is larger and could start
/// one); then at the next line, and a skip at `at` says so.
fn entry_place(at: usize, bytes: usize) -> usize {
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
unsafe fn entry_ctl<'a>(slot: *mut u8, at: usize) -> &'a AtomicU64 {
    // SAFETY: the caller's promise; slots are 64-byte aligned, so the word is 8-aligned.
    unsafe { &*(slot.add(at) as *const AtomicU64) }
}

/// What a receiver finds in a packed slot (`ShmPeer::find_packed`).
enum Found {
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
struct Packing {
    /// Sending: one more than the number of the slot that takes entries (0: none). It takes
    /// them while it is the last slot published (`head - 1`).
    open: AtomicU64,
    /// Sending: where its next entry goes.
    at: AtomicU64,
    /// Sending: packed messages sent.
    sent: AtomicU64,
    /// Receiving: where the next entry of the slot at `consumed` is (0: it is not begun).
    read_at: AtomicU64,
    /// Receiving: packed messages received.
    received: AtomicU64,
}

impl Packing {
    /// Where the receiver looks for the next entry of the packed slot at `consumed`.
    fn read_from(&self) -> usize {
        match self.read_at.load(Ordering::Relaxed) {
            0 => PACK_FIRST,
            a => a as usize,
        }
    }
}

/// Every how many eager slots a receiver publishes its tail (`ShmPeer::consumed`): a quarter
/// of a FIFO of 16 slots or more, each slot in smaller ones. A power of two.
fn tail_step(nslots: usize) -> u64 {
    if nslots >= 16 {
        4
    } else {
        1
    }
}

/// Where the receiver's combined bytes are and where they go in the sender, when it writes
/// them there as it pulls: the sender offered a place (`OutMsg::reply_at`), the sink sends the
/// bytes straight back (`Sink::returns`) and would not rather forward them through the slots
/// (`Sink::forward_first`: the executor's choice by measured times, whose measurements are in
/// `exec::replies`). Below the sizes that forward, writing back wins: 512 KiB 115-130 us
/// against 176-235 through the slots, 2-8 MiB within noise to 0.8x the time.
///
/// Only pulls through the kernel forward (`ShmPeer::forward`); between threads of one process
/// the bytes are written back whatever the sink would rather.
fn write_back(p: Pulling, sink: &dyn Sink, access: Access) -> Option<(*const u8, usize)> {
    let at = p.reply_at?;
    if sink.forward_first() && matches!(access, Access::Cma(_)) {
        return None;
    }
    sink.returns().map(|d| (d, at))
}

impl Link for ShmPeer {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>> {
        let head_ref = self.remote.head(self.me);
        let tail_ref = self.remote.tail(self.me);
        if let Some(seq) = cur.await_release {
            let done = tail_ref.load(Ordering::Acquire) > seq;
            return Ok(Progress {
                state: if done {
                    SendState::Complete
                } else {
                    SendState::Posted
                },
                moved: done,
            });
        }
        let mut head = head_ref.load(Ordering::Relaxed);
        // The tail lives in the peer's memory and changes under its hands: look at it only when
        // the slots we know to be free run out, not on every send.
        let mut tail = self.tail_seen.load(Ordering::Relaxed);
        let room = self.slot_free(head, &mut tail);
        let (scale, mut flags) = match msg.scale {
            Some(s) => (s.0, FLAG_SCALE),
            None => ([0u8; 8], 0),
        };
        if msg.reply_at.is_some() {
            flags |= FLAG_REPLY_AT;
        }
        let header = |kind, offset: usize, len: usize| SlotHeader {
            kind,
            flags,
            msg_len: msg.len as u64,
            offset: offset as u64,
            len: len as u64,
            src_addr: msg.src as u64,
            tag: msg.tag,
            scale,
        };
        // The peer published whether it may pull from us in our FIFO's control block, in its segment.
        let peer_can_pull = self.remote.pull_ok(self.me).load(Ordering::Acquire) != 0;
        if !cur.started {
            match self.carried.take(msg) {
                // A KIND_RETURNED notice naming where the bytes went.
                Some(
                    w @ Carried {
                        how: Carriage::WrittenBack { remote },
                        ..
                    },
                ) => {
                    if !room {
                        self.carried.push(w);
                        return Ok(Progress {
                            state: SendState::Pending,
                            moved: false,
                        });
                    }
                    let mut h = header(KIND_RETURNED, 0, 0);
                    h.src_addr = remote as u64;
                    self.publish(head, &h, None);
                    cur.started = true;
                    cur.sent = msg.len;
                    return Ok(Progress {
                        state: SendState::Complete,
                        moved: true,
                    });
                }
                Some(Carried {
                    how: Carriage::Forwarded { sent },
                    ..
                }) => {
                    // The slots hold the first `sent` bytes; the rest goes eagerly after them.
                    cur.started = true;
                    cur.sent = sent;
                    if sent == msg.len {
                        return Ok(Progress {
                            state: SendState::Complete,
                            moved: true,
                        });
                    }
                }
                None => {}
            }
        }
        let threshold = if msg.reply_at.is_some() || (msg.sender_busy && msg.copied) {
            self.pull_threshold_copied
        } else if msg.sender_busy {
            self.pull_threshold_busy
        } else {
            self.pull_threshold
        };
        if !cur.started && msg.len >= threshold && peer_can_pull {
            if !room {
                return Ok(Progress {
                    state: SendState::Pending,
                    moved: false,
                });
            }
            // The reply's place, where the sender offers one, is the descriptor's word of data.
            let reply_at = msg.reply_at.map(|at| at as u64);
            self.publish(head, &header(KIND_PULL, 0, msg.len), reply_at);
            cur.started = true;
            cur.sent = msg.len;
            cur.await_release = Some(head);
            return Ok(Progress {
                state: SendState::Posted,
                moved: true,
            });
        }
        if !cur.started && msg.len <= PACK_MAX {
            let p = self.send_packed(msg, head, &mut tail);
            if p.moved {
                cur.started = true;
                cur.sent = msg.len;
            }
            return Ok(p);
        }
        let mut moved = false;
        while !(cur.started && cur.sent == msg.len) {
            if !self.slot_free(head, &mut tail) {
                break;
            }
            let n = self.remote.geo.slot_bytes.min(msg.len - cur.sent);
            let from = msg.src.wrapping_add(cur.sent);
            let h = header(KIND_EAGER, cur.sent, n);
            self.fill_slot(head, &h, |out| {
                // SAFETY: `out` holds n bytes (fill_slot); msg.src is valid for msg.len bytes
                // of reads.
                unsafe { crate::reduce::copy_bytes(out, from, n) };
                Ok(())
            })?;
            head += 1;
            cur.sent += n;
            cur.started = true;
            moved = true;
        }
        if moved {
            self.remote.ring();
        }
        Ok(Progress {
            state: if cur.started && cur.sent == msg.len {
                SendState::Complete
            } else {
                SendState::Pending
            },
            moved,
        })
    }

    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        let tail_ref = self.local.tail(self.peer);
        let (mut moved, mut published) = (false, false);
        loop {
            if let Some(p) = cur.pulling {
                self.pull(cur, p, expect.tag, sink)?;
                moved = true;
                if cur.received < p.total {
                    return Ok(Progress {
                        state: false,
                        moved,
                    });
                }
                cur.pulling = None;
                if let Some((d, at)) = write_back(p, sink, self.access) {
                    self.carried.push(Carried {
                        tag: expect.tag,
                        local: d as usize,
                        len: p.total,
                        how: Carriage::WrittenBack { remote: at },
                    });
                } else if cur.forwarded > 0 {
                    if let Some(d) = sink.returns() {
                        self.carried.push(Carried {
                            tag: expect.tag,
                            local: d as usize,
                            len: p.total,
                            how: Carriage::Forwarded {
                                sent: cur.forwarded,
                            },
                        });
                    }
                }
                self.release(self.consumed.load(Ordering::Relaxed) + 1);
                return Ok(Progress { state: true, moved });
            }
            let tail = self.consumed.load(Ordering::Relaxed);
            if self
                .local
                .slot_number(self.peer, tail)
                .load(Ordering::Acquire)
                != tail + 1
            {
                // Nothing more for now: whatever was read is released before this rank waits.
                if tail_ref.load(Ordering::Relaxed) != tail {
                    tail_ref.store(tail, Ordering::Release);
                    published = true;
                }
                break;
            }
            if self.slot_kind(tail) == KIND_PACKED {
                if cur.started {
                    return crate::internal_err!(
                        "shm FIFO from rank {} has packed messages in the middle of a message",
                        self.peer
                    );
                }
                let at = self.pack.read_from();
                let n = self.pack.received.load(Ordering::Relaxed);
                match self.find_packed(tail, at, stamp_of(n)) {
                    Found::Entry { at, ctl } => {
                        let (len, tag, scale, data) = self.packed_entry(tail, at, ctl);
                        let end = at + entry_bytes(len, scale.is_some());
                        if len > PACK_MAX || end > PACK_AREA {
                            return crate::internal_err!(
                                "shm packed entry from rank {} claims {len} bytes at {at}",
                                self.peer
                            );
                        }
                        if len != expect.len || tag != expect.tag {
                            return Err(self.mismatch(len as u64, tag, expect));
                        }
                        // SAFETY: `len` bytes of the entry, inside the slot (checked above),
                        // written before its control word; the sender does not touch them
                        // until the slot is released.
                        sink.put(0, unsafe { std::slice::from_raw_parts(data, len) }, scale)?;
                        cur.started = true;
                        cur.received = len;
                        moved = true;
                        self.pack.read_at.store(end as u64, Ordering::Relaxed);
                        self.pack.received.store(n + 1, Ordering::Relaxed);
                        break;
                    }
                    Found::Closed => {
                        self.pack.read_at.store(0, Ordering::Relaxed);
                        self.consumed.store(tail + 1, Ordering::Relaxed);
                        moved = true;
                        if (tail + 1) & (self.tail_step - 1) == 0 {
                            tail_ref.store(tail + 1, Ordering::Release);
                            published = true;
                        }
                        continue;
                    }
                    Found::Nothing => {
                        if tail_ref.load(Ordering::Relaxed) != tail {
                            tail_ref.store(tail, Ordering::Release);
                            published = true;
                        }
                        break;
                    }
                }
            }
            let h = self.read_header(tail);
            // A sender that runs ahead has the next message in place already: fetch its first
            // lines while this one is handled (a stream of 8 B broadcasts: 0.37 -> 0.28 us).
            self.local.prefetch_slot(self.peer, tail + 1);
            if !cur.started {
                if h.msg_len as usize != expect.len || h.tag != expect.tag {
                    return Err(self.mismatch(h.msg_len, h.tag, expect));
                }
                cur.started = true;
            } else if h.offset as usize != cur.received {
                return crate::internal_err!(
                    "shm FIFO from rank {} out of order: slot at offset {} while {} bytes were received",
                    self.peer,
                    h.offset,
                    cur.received
                );
            }
            let scale = (h.flags & FLAG_SCALE != 0).then_some(Scale(h.scale));
            match h.kind {
                KIND_PULL => {
                    cur.pulling = Some(Pulling {
                        src: h.src_addr as usize,
                        total: h.msg_len as usize,
                        scale,
                        // SAFETY: the descriptor's data word, published with it.
                        reply_at: (h.flags & FLAG_REPLY_AT != 0).then(|| unsafe {
                            (self.local.slot(self.peer, tail).add(SLOT_HEADER) as *const u64).read()
                                as usize
                        }),
                    })
                }
                KIND_RETURNED => {
                    let at = h.src_addr as usize;
                    if sink.direct() != Some(at as *mut u8) {
                        return crate::internal_err!(
                            "rank {} wrote {} bytes back at {at:#x}, where this receive does not land",
                            self.peer,
                            h.msg_len
                        );
                    }
                    sink.placed(0, expect.len, None)?;
                    cur.received = expect.len;
                    self.release(tail + 1);
                    return Ok(Progress {
                        state: true,
                        moved: true,
                    });
                }
                KIND_EAGER => {
                    let len = h.len as usize;
                    if len > self.local.geo.slot_bytes || cur.received + len > expect.len {
                        return crate::internal_err!(
                            "shm slot from rank {} claims {len} bytes",
                            self.peer
                        );
                    }
                    // SAFETY: the slot's data area holds `len` <= slot_bytes published bytes that the
                    // sender does not touch until we advance the tail.
                    let data = unsafe {
                        std::slice::from_raw_parts(
                            self.local.slot(self.peer, tail).add(SLOT_HEADER),
                            len,
                        )
                    };
                    sink.put(cur.received, data, scale)?;
                    cur.received += len;
                    self.consumed.store(tail + 1, Ordering::Relaxed);
                    moved = true;
                    if (tail + 1) & (self.tail_step - 1) == 0 {
                        tail_ref.store(tail + 1, Ordering::Release);
                        published = true;
                    }
                    if cur.received == expect.len {
                        break;
                    }
                }
                k => {
                    return crate::internal_err!(
                        "shm slot from rank {} has unknown kind {k}",
                        self.peer
                    )
                }
            }
        }
        if published {
            self.remote.ring();
        }
        Ok(Progress {
            state: cur.started && cur.received == expect.len,
            moved,
        })
    }

    fn peer_running_on(&self) -> Option<(u32, Activity)> {
        let v = self.remote.running_on().load(Ordering::Relaxed);
        let cpu = (v & CPU_MASK).checked_sub(1)?;
        let what = match v >> 30 {
            0 => Activity::Polling,
            1 => Activity::Sleeping,
            _ => Activity::Outside,
        };
        Some((cpu, what))
    }

    fn peer_stalled(&self, now: Instant, after: Duration) -> bool {
        let word = u64::from(self.remote.running_on().load(Ordering::Relaxed));
        let beat = word << 32 | u64::from(self.remote.beat().load(Ordering::Relaxed));
        let mut seen = self.beat_seen.lock();
        match *seen {
            Some((b, since)) if b == beat => now.saturating_duration_since(since) >= after,
            _ => {
                *seen = Some((beat, now));
                false
            }
        }
    }

    fn tells_its_losses(&self) -> bool {
        true
    }

    fn check_peer(&self) -> Result<()> {
        let first = match self.remote.first_lost().load(Ordering::SeqCst) {
            0 => None,
            r => Some(r as usize - 1),
        };
        // The rank this rank counts as lost first: the one the peer lost, unless the peer lost
        // this very rank (it timed out waiting for it), which this rank then told its other
        // peers it had lost itself ("rank 1 timed out waiting for rank 1"): then the peer.
        // The error still says what the peer reported (the blame check reads `lost`).
        let gone = |msg: String| {
            let mut e = self.lost(first.filter(|&r| r != self.me).unwrap_or(self.peer), msg);
            e.lost = Some(first.unwrap_or(self.peer));
            e
        };
        let closed = Closing::from_code(self.remote.closed().load(Ordering::SeqCst));
        if let Some(how) = closed {
            let (ours, theirs) = self.remote.disagreed();
            let tags = match (ours.load(Ordering::SeqCst), theirs.load(Ordering::SeqCst)) {
                (0, 0) => None,
                pair => Some(pair),
            };
            let mut e = gone(how.describe_with(self.peer, first, tags));
            e.kind = how.kind();
            e.disagreed = tags.filter(|_| how == Closing::Disagreed);
            return Err(e);
        }
        if self.watch.as_ref().is_some_and(|w| !w.alive()) {
            return Err(gone(format!(
                "rank {} exited (its process is gone)",
                self.peer
            )));
        }
        Ok(())
    }

    fn peek(&self) -> Result<Option<(usize, u64)>> {
        let mut tail = self.consumed.load(Ordering::Relaxed);
        let mut at = self.pack.read_from();
        let stamp = stamp_of(self.pack.received.load(Ordering::Relaxed));
        // A closed packed slot is followed by a published one: at most two looks.
        for _ in 0..2 {
            let published = self
                .local
                .slot_number(self.peer, tail)
                .load(Ordering::Acquire);
            if published != tail + 1 {
                return Ok(None);
            }
            if self.slot_kind(tail) == KIND_PACKED {
                match self.find_packed(tail, at, stamp) {
                    Found::Entry { at, ctl } => {
                        let (len, tag, _, _) = self.packed_entry(tail, at, ctl);
                        return Ok(Some((len, tag)));
                    }
                    Found::Nothing => return Ok(None),
                    Found::Closed => {
                        tail += 1;
                        at = PACK_FIRST;
                        continue;
                    }
                }
            }
            // The first slot of a message: eager data from offset 0, or a pull descriptor.
            let h = self.read_header(tail);
            return Ok((h.offset == 0).then_some((h.msg_len as usize, h.tag)));
        }
        Ok(None)
    }

    fn close(&self, how: Closing, lost: Option<usize>) {
        self.local.mark_closed(how, lost);
        self.remote.ring();
    }

    fn tell_disagreement(&self, ours: u64, theirs: u64) {
        // The first disagreement this rank found stays: every link shares the segment.
        let (o, t) = self.local.disagreed();
        if o.compare_exchange(0, ours, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            t.store(theirs, Ordering::SeqCst);
        }
    }

    /// Reads the number of every slot of both FIFOs with this peer: one line and one page each,
    /// which a large operation pushed out of the caches and the TLB. In a sweep that came back
    /// from 64 MiB the first 8 B calls ran at 0.4-0.7 us (2 ranks) and 6.5-9 us (4 ranks on 2
    /// cores) instead of 0.24 and 3.3 until every slot had been used once.
    fn warm(&self) {
        self.local.read_slot_numbers(self.peer);
        self.remote.read_slot_numbers(self.me);
    }

    fn prefers_huge_pages(&self) -> bool {
        matches!(self.access, Access::Cma(_))
            && self.remote.pull_ok(self.me).load(Ordering::Relaxed) != 0
    }

    fn describe(&self) -> String {
        match self.access {
            Access::Direct => "shm/direct".into(),
            Access::Cma(_) => {
                if self.remote.pull_ok(self.me).load(Ordering::Relaxed) != 0 {
                    "shm/cma".into()
                } else {
                    "shm/eager".into()
                }
            }
        }
    }
}

/// What a rank tells its peers so they can reach its segment.
struct Announce {
    socket: String,
    fd: i32,
    nonce: u64,
    base: u64,
}

impl Announce {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        wire::put_blob(&mut out, self.socket.as_bytes());
        wire::put_u32(&mut out, self.fd as u32);
        wire::put_u64(&mut out, self.nonce);
        wire::put_u64(&mut out, self.base);
        out
    }

    fn decode(b: &[u8]) -> Result<Announce> {
        let mut r = Reader::new(b);
        Ok(Announce {
            socket: r.string()?,
            fd: r.u32()? as i32,
            nonce: r.u64()?,
            base: r.u64()?,
        })
    }
}

/// The shm side of a communicator: our segment and a transport per local peer.
pub(crate) struct ShmWorld {
    pub local: Arc<Segment>,
    pub peers: Vec<Option<Arc<ShmPeer>>>,
}

fn auth_context(comm_tag: u64, from: usize, to: usize) -> Vec<u8> {
    format!("comm shm {comm_tag:016x} {from}->{to}").into_bytes()
}

/// Builds the shm transports of one rank. Collective over the communicator's bootstrap.
pub(crate) fn connect(
    boot: &Bootstrap,
    paths: &[Path],
    placements: &[Placement],
    comm_tag: u64,
    registry_bytes: usize,
    deadline: Option<Instant>,
) -> Result<ShmWorld> {
    let me = boot.rank();
    let nranks = boot.nranks();
    let geo = Geometry::from_env(nranks, registry_bytes);
    let mut nonce_bytes = [0u8; 8];
    getrandom::getrandom(&mut nonce_bytes)
        .map_err(|e| Error::new(crate::error::ErrorKind::System, format!("getrandom: {e}")))?;
    let nonce = u64::from_ne_bytes(nonce_bytes);
    let local = Arc::new(Segment::create(me, geo, nonce)?);

    let other_process: Vec<usize> = (0..nranks)
        .filter(|&r| paths[r] == Path::SameHost)
        .collect();
    let socket = format!(
        "comm-shm-{:016x}-{comm_tag:016x}-{me}-{:08x}",
        placements[me].process_token, nonce as u32
    );
    let listener = if other_process.is_empty() {
        None
    } else {
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())
            .map_err(|e| Error::from_io("abstract unix socket name", e))?;
        Some(
            UnixListener::bind_addr(&addr)
                .map_err(|e| Error::from_io(format!("bind unix socket {socket}"), e))?,
        )
    };
    let mine = Announce {
        socket: socket.clone(),
        fd: local.fd.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1),
        nonce,
        base: local.base_addr() as u64,
    };
    let all = boot.allgather(&mine.encode())?;
    crate::fault::point("shm:announced");
    if crate::fault::fails("shm:announced") {
        return Err(Error::new(
            crate::error::ErrorKind::System,
            "COMM_FAULT_INJECT: failing after the shared-memory announcement",
        ));
    }
    let announces = all
        .iter()
        .map(|b| Announce::decode(b))
        .collect::<Result<Vec<_>>>()?;

    // Serve our memfd to the peers in other processes while we fetch theirs.
    let stop = Arc::new(AtomicBool::new(false));
    // Peers that die while we set up must not leave us waiting for them until the deadline.
    let watches: Vec<(usize, ProcessWatch)> = other_process
        .iter()
        .map(|&r| (r, ProcessWatch::new(placements[r].pid)))
        .collect();
    let server = listener.map(|l| {
        let expected: Vec<(usize, ProcessWatch)> = other_process
            .iter()
            .map(|&r| (r, ProcessWatch::new(placements[r].pid)))
            .collect();
        let secret = *boot.secret();
        let fd = mine.fd;
        let stop = stop.clone();
        let aborted = crate::bootstrap::init_abort_flag();
        std::thread::Builder::new()
            .name("comm-shm-setup".into())
            .spawn(move || {
                let stop_or_abort = || {
                    stop.load(Ordering::SeqCst)
                        || aborted.as_ref().is_some_and(|a| a.load(Ordering::SeqCst))
                };
                serve_segment(
                    l,
                    fd,
                    &expected,
                    &secret,
                    comm_tag,
                    me,
                    deadline,
                    stop_or_abort,
                )
            })
            .map_err(|e| Error::from_io("spawn shm setup thread", e))
    });
    let server = server.transpose()?;

    let disable_pull = !crate::env::SHM_PULL.flag();
    let pull_threshold_set = crate::env::SHM_PULL_THRESHOLD.size_if_set();
    let fetched = (|| -> Result<Vec<Option<Arc<ShmPeer>>>> {
        let mut peers: Vec<Option<Arc<ShmPeer>>> = (0..nranks).map(|_| None).collect();
        // A peer that died fails its own fetch, but the fetches from the living go on: each of
        // them serves its segment until every living rank has it, so a rank that stopped at the
        // first failure would leave the others waiting on its server.
        let mut lost: Option<Error> = None;
        for r in 0..nranks {
            let (fd, access) = match paths[r] {
                Path::SameProcess => (os::dup(announces[r].fd)?, Access::Direct),
                Path::SameHost => {
                    let watch = watches.iter().find(|w| w.0 == r).map(|w| &w.1);
                    let fd = fetch_segment(
                        &announces[r].socket,
                        boot.secret(),
                        comm_tag,
                        me,
                        r,
                        deadline,
                        watch,
                    )
                    .map_err(|e| e.context(format!("connecting to rank {r}'s shared memory")));
                    match fd {
                        Ok(fd) => (fd, Access::Cma(placements[r].pid)),
                        // A peer that failed its init (it refused or dropped the fetch) but
                        // lives on will not fetch from us either, and the server would wait for
                        // it until the deadline: stop serving too, which tells the other peers
                        // at once (their fetches from us fail in turn).
                        Err(e)
                            if e.kind == crate::error::ErrorKind::Remote
                                && watch.is_some_and(lives_on) =>
                        {
                            stop.store(true, Ordering::SeqCst);
                            return Err(stopped_serving(r, &e, &watches));
                        }
                        Err(e) if e.kind == crate::error::ErrorKind::Remote => {
                            lost.get_or_insert(e);
                            continue;
                        }
                        Err(e) => return Err(e),
                    }
                }
                _ => continue,
            };
            let remote = Arc::new(Segment::open(fd, announces[r].nonce, nranks)?);
            let can_pull = !disable_pull
                && match access {
                    Access::Direct => true,
                    Access::Cma(pid) => probe_cma(pid, announces[r].base as usize),
                };
            if !can_pull && !disable_pull {
                crate::info!(
                    "process_vm_readv from rank {r} (pid {}) is not permitted; large messages from it go through shared-memory slots",
                    placements[r].pid
                );
            }
            local.pull_ok(r).store(can_pull as u32, Ordering::Release);
            let (plain, busy, copied) = match access {
                Access::Direct => (PULL_FROM_THREAD, PULL_FROM_THREAD, PULL_FROM_THREAD),
                Access::Cma(_) => (
                    PULL_FROM_PROCESS,
                    PULL_FROM_BUSY_PROCESS,
                    PULL_FROM_BUSY_COPY,
                ),
            };
            // Both ends of both FIFOs with this peer, where the memory that takes stays small
            // (every FIFO of a host with many ranks would be nranks^2 of them).
            if nranks * local.geo.fifo_bytes() <= PREFAULT_MAX {
                local.prefault_fifo(r);
                remote.prefault_fifo(me);
            }
            peers[r] = Some(Arc::new(ShmPeer {
                me,
                peer: r,
                local: local.clone(),
                remote,
                access,
                watch: matches!(access, Access::Cma(_))
                    .then(|| ProcessWatch::new(placements[r].pid)),
                pull_threshold: pull_threshold_set.unwrap_or(plain),
                pull_threshold_busy: pull_threshold_set.unwrap_or(busy),
                pull_threshold_copied: pull_threshold_set.unwrap_or(copied),
                scratch: Mutex::new(None),
                carried: CarriedList::default(),
                tail_seen: AtomicU64::new(0),
                consumed: AtomicU64::new(0),
                tail_step: tail_step(local.geo.nslots),
                pack: Packing::default(),
                beat_seen: Mutex::new(None),
            }));
        }
        match lost {
            Some(e) => Err(e),
            None => Ok(peers),
        }
    })();
    // A lost peer does not stop the server: the living still fetch from us (see above). A
    // peer whose init failed does (the fetch loop stopped it).
    if fetched
        .as_ref()
        .is_err_and(|e| e.kind != crate::error::ErrorKind::Remote)
    {
        stop.store(true, Ordering::SeqCst);
    }
    let served = server
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| crate::internal_err!("shm setup thread panicked"))
        })
        .unwrap_or(Ok(()));
    // This process's own failure to serve (out of descriptors, say) explains the peers'
    // refusals that the fetches met: it goes first.
    if let Err(e) = &served {
        if e.kind == crate::error::ErrorKind::System {
            return Err(e.clone());
        }
    }
    let peers = fetched?;
    served?;
    // Nobody sends before every receiver has published whether it can pull.
    boot.barrier()?;
    for (r, p) in peers.iter().enumerate() {
        if let Some(p) = p {
            crate::info!("rank {me} -> rank {r}: {}", p.describe());
        }
    }
    Ok(ShmWorld { local, peers })
}

fn probe_cma(pid: u32, remote_base: usize) -> bool {
    let mut word = [0u8; 8];
    // SAFETY: word is 8 writable bytes.
    let ok = unsafe { os::cma_read(pid, word.as_mut_ptr(), remote_base, 8) }.is_ok();
    ok && u64::from_ne_bytes(word) == SEG_MAGIC
}

/// Serves descriptor `fd` to each of the `expected` peers that connects to `listener` and
/// proves it knows the secret (also used by `window` to share window memory).
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve_segment(
    listener: UnixListener,
    fd: i32,
    expected: &[(usize, ProcessWatch)],
    secret: &[u8; 32],
    comm_tag: u64,
    me: usize,
    deadline: Option<Instant>,
    stop: impl Fn() -> bool,
) -> Result<()> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::from_io("unix listener", e))?;
    let mut pending: Vec<usize> = expected.iter().map(|e| e.0).collect();
    // Peers that died before fetching: the living are still served, then this is the error.
    let mut lost: Option<Error> = None;
    while !pending.is_empty() {
        if stop() {
            return Ok(());
        }
        for (r, w) in expected {
            if pending.contains(r) && !w.alive() {
                pending.retain(|p| p != r);
                lost.get_or_insert_with(|| {
                    Error::new(
                        crate::error::ErrorKind::Remote,
                        format!(
                            "rank {r} exited before it fetched this rank's shared memory segment"
                        ),
                    )
                });
            }
        }
        if pending.is_empty() {
            break;
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            return crate::timeout_err!(
                "ranks {pending:?} never fetched this rank's shared memory segment"
            );
        }
        let (mut s, _) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(Error::from_io("accept on shm setup socket", e)),
        };
        let handshake = (|| -> Result<usize> {
            s.set_nonblocking(false)
                .map_err(|e| Error::from_io("unix socket", e))?;
            let t = Some(Duration::from_secs(5));
            s.set_read_timeout(t)
                .map_err(|e| Error::from_io("unix socket", e))?;
            s.set_write_timeout(t)
                .map_err(|e| Error::from_io("unix socket", e))?;
            let mut rb = [0u8; 4];
            s.read_exact(&mut rb)
                .map_err(|e| Error::from_io("read peer rank", e))?;
            let from = u32::from_le_bytes(rb) as usize;
            if !pending.contains(&from) {
                return crate::invalid_usage!("unexpected shm connection claiming rank {from}");
            }
            auth::server(&mut s, secret, &auth_context(comm_tag, from, me))?;
            os::send_fd(&s, fd)?;
            Ok(from)
        })();
        match handshake {
            Ok(from) => pending.retain(|&r| r != from),
            Err(e) => crate::warn!("refused a connection to the shm setup socket: {}", e.msg),
        }
    }
    lost.map_or(Ok(()), Err)
}

/// What a failed fetch from a peer that lives on means: its init failed.
const STOPPED_SERVING: &str = "stopped serving its shared memory segment before this rank fetched it: its communicator init failed (its own error says why)";

/// The error of a rank whose fetch from rank `r` failed while `r` lives on: `r` stopped
/// serving because its init failed, most often because another rank died. The rank that died
/// is named first, as the cause (a peer killed during init made its neighbours give up, and the
/// rank that found one of them given up blamed it, a live rank, 1 run in 7), where one of
/// `watches` shows it gone within a moment.
fn stopped_serving(r: usize, e: &Error, watches: &[(usize, ProcessWatch)]) -> Error {
    let until = Instant::now() + Duration::from_millis(100);
    loop {
        if let Some(&(dead, _)) = watches.iter().find(|(p, w)| *p != r && !w.alive()) {
            return Error::lost_peer(
                dead,
                format!(
                    "rank {dead} exited during init (its process is gone); rank {r} then {STOPPED_SERVING} ({})",
                    e.msg
                ),
            );
        }
        if Instant::now() >= until {
            return Error::lost_peer(r, format!("rank {r} {STOPPED_SERVING} ({})", e.msg));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether a peer whose fetch just failed is still alive a moment later: a process being killed
/// resets its connections before it counts as exited.
fn lives_on(w: &ProcessWatch) -> bool {
    let until = Instant::now() + Duration::from_millis(50);
    while w.alive() {
        if Instant::now() >= until {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// Fetches the descriptor a peer serves with [`serve_segment`] on abstract socket `socket`.
pub(crate) fn fetch_segment(
    socket: &str,
    secret: &[u8; 32],
    comm_tag: u64,
    me: usize,
    peer: usize,
    deadline: Option<Instant>,
    watch: Option<&ProcessWatch>,
) -> Result<OwnedFd> {
    let addr = SocketAddr::from_abstract_name(socket.as_bytes())
        .map_err(|e| Error::from_io("abstract unix socket name", e))?;
    let mut s = loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => break s,
            Err(_) if watch.is_some_and(|w| !w.alive()) => {
                return crate::remote_err!(
                    "rank {peer} exited before it served its shared memory segment"
                )
            }
            // The peer bound its socket before it announced it: refused now means it closed
            // it, which it does only when its own init failed (it serves until every peer has
            // fetched). Waiting would last until the deadline (COMM_INIT_TIMEOUT).
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return crate::remote_err!("rank {peer} closed its shared memory setup socket")
            }
            Err(_) if crate::bootstrap::init_aborted() => {
                return Err(Error::new(
                    crate::error::ErrorKind::Internal,
                    format!("aborted (ncclCommAbort) while fetching rank {peer}'s shared memory"),
                ))
            }
            Err(e) if deadline.is_none_or(|d| Instant::now() < d) => {
                crate::trace!("connect to rank {peer}'s shm socket: {e}; retrying");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                return Err(Error::from_io(
                    format!("connect to unix socket {socket}"),
                    e,
                ))
            }
        }
    };
    // A peer that stops answering must not hold this rank past its deadline.
    let left = deadline.map_or(Duration::from_secs(30), |d| {
        d.saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(100), Duration::from_secs(30))
    });
    let t = Some(left);
    s.set_read_timeout(t)
        .map_err(|e| Error::from_io("unix socket", e))?;
    s.set_write_timeout(t)
        .map_err(|e| Error::from_io("unix socket", e))?;
    s.write_all(&(me as u32).to_le_bytes())
        .map_err(|e| Error::from_io("send rank", e))?;
    auth::client(&mut s, secret, &auth_context(comm_tag, me, peer))?;
    os::recv_fd(&s)
}

#[cfg(test)]
mod tests {
    //! The FIFO protocol between two ends built by hand in this process (no bootstrap): small
    //! rings to make wrap-around and back-pressure happen, both the eager and the pull path,
    //! closing, the doorbell, and the checks on opening a peer's segment.

    use super::*;
    use crate::error::ErrorKind;

    const TAG: u64 = crate::tag::tag(crate::tag::kind::ALL_REDUCE, 5);

    /// Rank 0's link to rank 1 and rank 1's link to rank 0, over two fresh segments.
    /// `pull`: whether each receiver may pull from the other; `access`: how it reads.
    fn pair(
        nslots: usize,
        slot_bytes: usize,
        pull: bool,
        pull_threshold: usize,
        access: Access,
    ) -> (ShmPeer, ShmPeer) {
        let geo = Geometry {
            nranks: 2,
            nslots,
            slot_bytes,
            registry_bytes: 4096,
        };
        let s0 = Arc::new(Segment::create(0, geo, 0x1111).expect("segment 0"));
        let s1 = Arc::new(Segment::create(1, geo, 0x2222).expect("segment 1"));
        // Whether a receiver may pull lives in its own segment, in the sender's control block.
        s0.pull_ok(1).store(pull as u32, Ordering::Release);
        s1.pull_ok(0).store(pull as u32, Ordering::Release);
        let link = |me: usize, local: &Arc<Segment>, remote: &Arc<Segment>| ShmPeer {
            me,
            peer: 1 - me,
            local: local.clone(),
            remote: remote.clone(),
            access,
            watch: None,
            pull_threshold,
            pull_threshold_busy: pull_threshold,
            pull_threshold_copied: pull_threshold,
            scratch: Mutex::new(None),
            carried: CarriedList::default(),
            tail_seen: AtomicU64::new(0),
            consumed: AtomicU64::new(0),
            tail_step: tail_step(nslots),
            pack: Packing::default(),
            beat_seen: Mutex::new(None),
        };
        (link(0, &s0, &s1), link(1, &s1, &s0))
    }

    /// Where a rank runs and what it does there is what its peer reads.
    #[test]
    fn a_peer_sees_where_this_rank_runs_and_what_it_does() {
        let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
        assert_eq!(b.peer_running_on(), None, "a fresh segment says nothing");
        a.local.set_running_on(3, Activity::Polling);
        assert_eq!(b.peer_running_on(), Some((3, Activity::Polling)));
        assert_eq!(
            a.peer_running_on(),
            None,
            "only the owner's own word changed"
        );
        a.local.set_running_on(0, Activity::Sleeping);
        assert_eq!(
            b.peer_running_on(),
            Some((0, Activity::Sleeping)),
            "CPU 0 is a CPU, not 'nothing'"
        );
        a.local.set_running_on(1023, Activity::Outside);
        assert_eq!(b.peer_running_on(), Some((1023, Activity::Outside)));
    }

    /// A peer is stalled once neither its word nor its heartbeat moved for the given time;
    /// either moving starts the count again.
    #[test]
    fn a_peer_without_a_heartbeat_is_stalled() {
        let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
        let after = Duration::from_micros(10);
        let t0 = Instant::now();
        a.local.set_running_on(2, Activity::Polling);
        assert!(!b.peer_stalled(t0, after), "first look: nothing to compare");
        assert!(
            !b.peer_stalled(t0 + after / 2, after),
            "not for long enough"
        );
        assert!(b.peer_stalled(t0 + after, after), "silent for `after`");
        a.local.heartbeat();
        assert!(
            !b.peer_stalled(t0 + after * 2, after),
            "a beat is a sign of life"
        );
        assert!(b.peer_stalled(t0 + after * 3, after));
        a.local.set_running_on(2, Activity::Sleeping);
        assert!(
            !b.peer_stalled(t0 + after * 4, after),
            "so is a change of state"
        );
        assert!(b.peer_stalled(t0 + after * 5, after));
    }

    /// Where received bytes land: written by the link itself (`direct`) or handed over.
    struct Collect {
        buf: Vec<u8>,
        direct: bool,
        /// (offset, length) of every piece, in order.
        pieces: Vec<(usize, usize)>,
        scales: Vec<Option<Scale>>,
        /// The address every piece given to `put` lay at.
        from: Vec<usize>,
    }

    impl Collect {
        fn new(len: usize, direct: bool) -> Collect {
            Collect {
                buf: vec![0; len],
                direct,
                pieces: Vec::new(),
                scales: Vec::new(),
                from: Vec::new(),
            }
        }
    }

    impl Sink for Collect {
        fn direct(&mut self) -> Option<*mut u8> {
            self.direct.then_some(self.buf.as_mut_ptr())
        }

        fn put(&mut self, offset: usize, data: &[u8], scale: Option<Scale>) -> Result<()> {
            self.buf[offset..offset + data.len()].copy_from_slice(data);
            self.pieces.push((offset, data.len()));
            self.from.push(data.as_ptr() as usize);
            self.scales.push(scale);
            Ok(())
        }

        fn placed(&mut self, offset: usize, len: usize, scale: Option<Scale>) -> Result<()> {
            self.pieces.push((offset, len));
            self.scales.push(scale);
            Ok(())
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 8) as u8)
            .collect()
    }

    fn out(data: &[u8], tag: u64, scale: Option<Scale>) -> OutMsg {
        OutMsg {
            src: data.as_ptr(),
            len: data.len(),
            scale,
            tag,
            sender_busy: false,
            copied: false,
            reply_at: None,
        }
    }

    /// Sends `msgs` (data, tag, scale) on `tx` while `rx` receives them, both driven from this
    /// thread as an executor drives them: sends start in order, a posted send is polled until
    /// its buffer is free, and the receiver takes what has arrived. Returns each message's sink.
    fn exchange(
        tx: &ShmPeer,
        rx: &ShmPeer,
        msgs: &[(Vec<u8>, u64, Option<Scale>)],
        direct: bool,
    ) -> Vec<Collect> {
        let mut cursors = vec![SendCursor::default(); msgs.len()];
        let mut complete = vec![false; msgs.len()];
        let mut next = 0;
        let mut got: Vec<Collect> = Vec::new();
        let mut cur = RecvCursor::default();
        let mut sink = msgs.first().map(|m| Collect::new(m.0.len(), direct));
        for _ in 0..1_000_000 {
            if got.len() == msgs.len() && complete.iter().all(|&c| c) {
                return got;
            }
            for i in 0..msgs.len() {
                if complete[i] || i > next {
                    continue;
                }
                let (data, tag, scale) = &msgs[i];
                match tx
                    .send(&out(data, *tag, *scale), &mut cursors[i])
                    .unwrap()
                    .state
                {
                    SendState::Pending => break,
                    SendState::Posted => next = next.max(i + 1),
                    SendState::Complete => {
                        complete[i] = true;
                        next = next.max(i + 1);
                    }
                }
            }
            if let Some(s) = sink.as_mut() {
                let (data, tag, _) = &msgs[got.len()];
                let expect = InExpect {
                    len: data.len(),
                    tag: *tag,
                };
                if rx.recv(&expect, &mut cur, s).unwrap().state {
                    got.push(sink.take().unwrap());
                    cur = RecvCursor::default();
                    sink = msgs.get(got.len()).map(|m| Collect::new(m.0.len(), direct));
                }
            }
        }
        panic!(
            "stalled: {} of {} received, sends complete {complete:?}",
            got.len(),
            msgs.len()
        );
    }

    /// Messages that each cut into at most `slot_bytes` pieces, in order, cover every byte.
    fn assert_eager(got: &Collect, data: &[u8], slot_bytes: usize, what: &str) {
        assert_eq!(got.buf, data, "{what}");
        let mut at = 0;
        for &(off, len) in &got.pieces {
            assert_eq!(off, at, "{what}: pieces {:?}", got.pieces);
            assert!(len <= slot_bytes, "{what}: a piece of {len} bytes");
            at += len;
        }
        assert_eq!(at, data.len(), "{what}");
    }

    /// Messages of every size through a ring of two 4 KiB slots: each takes one slot per
    /// 4 KiB (a zero-length message one slot), the ring wraps around dozens of times, and
    /// without permission to pull even messages above the pull threshold go through slots.
    #[test]
    fn eager_messages_wrap_around_a_two_slot_ring() {
        let slot = 4096;
        let (a, b) = pair(2, slot, false, 1024, Access::Direct);
        // Above PACK_MAX: each message takes slots of its own (packing has its own tests).
        let lengths = [
            PACK_MAX + 1,
            slot,
            slot + 1,
            3 * slot + 5,
            50_000,
            PACK_MAX + 7,
        ];
        let msgs: Vec<_> = lengths
            .iter()
            .enumerate()
            .map(|(i, &l)| (pattern(l, i as u8), TAG + i as u64, None))
            .collect();
        for direct in [false, true] {
            let head_before = b.local.head(0).load(Ordering::Relaxed);
            let got = exchange(&a, &b, &msgs, direct);
            for (i, (g, m)) in got.iter().zip(&msgs).enumerate() {
                assert_eager(
                    g,
                    &m.0,
                    slot,
                    &format!("message {i} of {} bytes", m.0.len()),
                );
            }
            let slots: u64 = lengths
                .iter()
                .map(|&l| l.div_ceil(slot).max(1) as u64)
                .sum();
            let head = b.local.head(0).load(Ordering::Relaxed);
            assert_eq!(head - head_before, slots, "slots used");
            assert_eq!(
                b.local.tail(0).load(Ordering::Relaxed),
                head,
                "all released"
            );
        }
        // The other direction is a FIFO of its own.
        let got = exchange(&b, &a, &msgs[..3], true);
        assert_eq!(got[2].buf, msgs[2].0);
        assert_eq!(a.local.head(1).load(Ordering::Relaxed), 4);
        assert_eq!(a.describe(), "shm/direct");
    }

    /// A sender fills the free slots and waits; each receive frees them again.
    #[test]
    fn a_full_ring_holds_the_sender_back() {
        let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
        let data = pattern(20_000, 3);
        let msg = out(&data, TAG, None);
        let mut sc = SendCursor::default();
        let p = a.send(&msg, &mut sc).unwrap();
        assert_eq!(
            (p.state, p.moved, sc.sent),
            (SendState::Pending, true, 8192)
        );
        let p = a.send(&msg, &mut sc).unwrap();
        assert_eq!(
            (p.state, p.moved, sc.sent),
            (SendState::Pending, false, 8192)
        );
        let mut rc = RecvCursor::default();
        let mut sink = Collect::new(data.len(), false);
        let expect = InExpect {
            len: data.len(),
            tag: TAG,
        };
        for (sent, state) in [(16384, SendState::Pending), (20_000, SendState::Complete)] {
            let before = rc.received;
            let p = b.recv(&expect, &mut rc, &mut sink).unwrap();
            assert_eq!((p.state, p.moved), (false, true));
            assert_eq!(rc.received, before + 8192);
            let p = a.send(&msg, &mut sc).unwrap();
            assert_eq!((p.state, sc.sent), (state, sent));
        }
        let p = b.recv(&expect, &mut rc, &mut sink).unwrap();
        assert!(p.state);
        assert_eq!(sink.buf, data);
        // Nothing more is there.
        let p = b
            .recv(&expect, &mut RecvCursor::default(), &mut sink)
            .unwrap();
        assert_eq!((p.state, p.moved), (false, false));
    }

    /// A receiver of a FIFO of 16 slots publishes its tail every fourth slot it reads and
    /// whenever it finds the FIFO empty; a sender whose FIFO looks full gets its room back
    /// either way, and nothing read is ever left unpublished while the receiver waits.
    #[test]
    fn the_tail_follows_the_reads_in_steps_and_before_a_wait() {
        let (a, b) = pair(16, 4096, false, usize::MAX, Access::Direct);
        // Above PACK_MAX, one slot each.
        let msgs: Vec<Vec<u8>> = (0..16)
            .map(|i| pattern(PACK_MAX + 1 + i, i as u8))
            .collect();
        for (i, m) in msgs.iter().enumerate() {
            let p = a
                .send(&out(m, TAG + i as u64, None), &mut SendCursor::default())
                .unwrap();
            assert_eq!(p.state, SendState::Complete, "message {i}");
        }
        // Full: the 17th waits.
        let extra = pattern(PACK_MAX + 1, 99);
        let mut extra_cur = SendCursor::default();
        let p = a
            .send(&out(&extra, TAG + 16, None), &mut extra_cur)
            .unwrap();
        assert_eq!((p.state, p.moved), (SendState::Pending, false));
        let published = || b.local.tail(0).load(Ordering::Relaxed);
        let receive = |i: usize| {
            let m = &msgs[i];
            let mut sink = Collect::new(m.len(), false);
            let expect = InExpect {
                len: m.len(),
                tag: TAG + i as u64,
            };
            let p = b
                .recv(&expect, &mut RecvCursor::default(), &mut sink)
                .unwrap();
            assert!(p.state && p.moved, "message {i} received");
            assert_eq!(&sink.buf, m, "message {i}");
        };
        for i in 0..3 {
            receive(i);
            assert_eq!(published(), 0, "after {} reads", i + 1);
        }
        let p = a
            .send(&out(&extra, TAG + 16, None), &mut extra_cur)
            .unwrap();
        assert_eq!(
            p.state,
            SendState::Pending,
            "three read slots are not out yet"
        );
        receive(3);
        assert_eq!(published(), 4, "the fourth read publishes");
        let p = a
            .send(&out(&extra, TAG + 16, None), &mut extra_cur)
            .unwrap();
        assert_eq!(p.state, SendState::Complete, "room again");
        for i in 4..16 {
            receive(i);
        }
        assert_eq!(published(), 16);
        // One more read leaves the tail behind, and the look that finds nothing more (as a
        // receiver makes before it waits) publishes it.
        let mut sink = Collect::new(extra.len(), false);
        let expect = InExpect {
            len: extra.len(),
            tag: TAG + 16,
        };
        assert!(
            b.recv(&expect, &mut RecvCursor::default(), &mut sink)
                .unwrap()
                .state
        );
        assert_eq!(sink.buf, extra);
        assert_eq!(published(), 16);
        let expect = InExpect {
            len: PACK_MAX + 1,
            tag: TAG,
        };
        let p = b
            .recv(&expect, &mut RecvCursor::default(), &mut sink)
            .unwrap();
        assert_eq!((p.state, p.moved), (false, false));
        assert_eq!(published(), 17, "an empty FIFO publishes what was read");
    }

    /// Two messages in the FIFO at once stay two: a receive takes exactly the first, `peek`
    /// shows the next, and a receive that expects another length or tag is refused without
    /// consuming it.
    #[test]
    fn messages_keep_their_boundaries() {
        let (a, b) = pair(8, 4096, false, usize::MAX, Access::Direct);
        assert_eq!(b.peek().unwrap(), None);
        let (m1, m2) = (pattern(10, 1), pattern(20, 2));
        for (m, tag) in [(&m1, TAG), (&m2, TAG + 1)] {
            let p = a
                .send(&out(m, tag, None), &mut SendCursor::default())
                .unwrap();
            assert_eq!(p.state, SendState::Complete);
        }
        assert_eq!(b.peek().unwrap(), Some((10, TAG)));
        let mut sink = Collect::new(10, false);
        let expect = InExpect { len: 10, tag: TAG };
        let p = b
            .recv(&expect, &mut RecvCursor::default(), &mut sink)
            .unwrap();
        assert!(p.state);
        assert_eq!(sink.buf, m1);
        assert_eq!(b.peek().unwrap(), Some((20, TAG + 1)));
        for wrong in [
            InExpect {
                len: 21,
                tag: TAG + 1,
            },
            InExpect { len: 20, tag: TAG },
        ] {
            let e = b
                .recv(
                    &wrong,
                    &mut RecvCursor::default(),
                    &mut Collect::new(21, false),
                )
                .expect_err("a mismatch is refused");
            assert_eq!(e.kind, ErrorKind::InvalidUsage);
            assert!(
                e.msg.contains("rank 0 sent 20 bytes")
                    && e.msg.contains(&format!("expects {} bytes", wrong.len)),
                "{}",
                e.msg
            );
        }
        let mut sink = Collect::new(20, true);
        let expect = InExpect {
            len: 20,
            tag: TAG + 1,
        };
        assert!(
            b.recv(&expect, &mut RecvCursor::default(), &mut sink)
                .unwrap()
                .state
        );
        assert_eq!(sink.buf, m2);
        assert_eq!(b.peek().unwrap(), None);
    }

    /// A message at or above the threshold travels as one descriptor; the receiver copies it
    /// out of the sender's buffer at most PULL_BUDGET bytes per call, and the sender's buffer
    /// is free (Complete) only once the receiver released the descriptor.
    #[test]
    fn large_messages_are_pulled_in_budgeted_pieces_and_released() {
        let threshold = 32 << 10;
        let (a, b) = pair(4, 4096, true, threshold, Access::Direct);
        let data = pattern(2 * PULL_BUDGET + 12_345, 9);
        let msg = out(&data, TAG, None);
        let mut sc = SendCursor::default();
        let p = a.send(&msg, &mut sc).unwrap();
        assert_eq!((p.state, p.moved), (SendState::Posted, true));
        assert_eq!(sc.await_release, Some(0));
        assert_eq!(b.local.head(0).load(Ordering::Relaxed), 1, "one slot");
        assert_eq!(b.peek().unwrap(), Some((data.len(), TAG)));
        let p = a.send(&msg, &mut sc).unwrap();
        assert_eq!((p.state, p.moved), (SendState::Posted, false));
        let mut rc = RecvCursor::default();
        let mut sink = Collect::new(data.len(), true);
        let expect = InExpect {
            len: data.len(),
            tag: TAG,
        };
        for k in 1..=2 {
            let p = b.recv(&expect, &mut rc, &mut sink).unwrap();
            assert_eq!((p.state, p.moved), (false, true));
            assert_eq!(rc.received, k * PULL_BUDGET);
            assert_eq!(a.send(&msg, &mut sc).unwrap().state, SendState::Posted);
        }
        assert!(b.recv(&expect, &mut rc, &mut sink).unwrap().state);
        assert_eq!(sink.buf, data);
        assert_eq!(
            sink.pieces,
            vec![
                (0, PULL_BUDGET),
                (PULL_BUDGET, PULL_BUDGET),
                (2 * PULL_BUDGET, 12_345)
            ]
        );
        let p = a.send(&msg, &mut sc).unwrap();
        assert_eq!((p.state, p.moved), (SendState::Complete, true));

        // Exactly the threshold is pulled (one slot, one piece through `put`); one byte less
        // goes eagerly, a slot per 4 KiB.
        let at = pattern(threshold, 1);
        let below = pattern(threshold - 1, 2);
        let msgs = [(at.clone(), TAG, None), (below.clone(), TAG + 1, None)];
        let got = exchange(&a, &b, &msgs[..1], false);
        assert_eq!(got[0].buf, at);
        assert_eq!(got[0].pieces, vec![(0, threshold)]);
        assert_eq!(b.local.head(0).load(Ordering::Relaxed), 2);
        let got = exchange(&a, &b, &msgs[1..], false);
        assert_eager(&got[0], &below, 4096, "below the threshold");
        assert_eq!(b.local.head(0).load(Ordering::Relaxed), 2 + 8);
    }

    /// Which threshold a message meets: the lowest for a busy sender's message that the
    /// receiver copies as it is, or for one that offers its buffer for the reply; the middle one
    /// for a busy sender's message that the receiver folds; the highest otherwise.
    #[test]
    fn each_kind_of_message_is_pulled_from_its_own_threshold() {
        let (mut a, b) = pair(16, 4096, true, 64 << 10, Access::Direct);
        a.pull_threshold_busy = 32 << 10;
        a.pull_threshold_copied = 16 << 10;
        let data = pattern(24 << 10, 9);
        let cases = [
            // (busy, copied, reply_here, pulled)
            (true, true, false, true),
            (true, false, false, false),
            (false, true, false, false),
            (false, false, true, true),
            (false, false, false, false),
        ];
        for (busy, copied, reply_here, pulled) in cases {
            let what = format!("busy {busy}, copied {copied}, reply_here {reply_here}");
            let mut msg = out(&data, TAG, None);
            msg.reply_at = reply_here.then_some(msg.src as usize);
            (msg.sender_busy, msg.copied) = (busy, copied);
            let head = b.local.head(0).load(Ordering::Relaxed);
            let mut got = vec![0u8; data.len()];
            let mut sink = Fold::landing(&mut got);
            let (first, r) = transfer(&a, &b, &msg, &mut sink);
            r.unwrap();
            assert_eq!(first == SendState::Posted, pulled, "{what}");
            let slots = if pulled { 1 } else { 6 };
            assert_eq!(
                b.local.head(0).load(Ordering::Relaxed),
                head + slots,
                "{what}"
            );
            assert_eq!(got, data, "{what}");
        }
    }

    /// A sender busy with receives of its own has its messages pulled from the lower threshold;
    /// the same message from a sender with nothing else to do goes through the slots.
    #[test]
    fn a_busy_senders_message_is_pulled_from_the_lower_threshold() {
        let (mut a, b) = pair(16, 4096, true, 64 << 10, Access::Direct);
        a.pull_threshold_busy = 16 << 10;
        let data = pattern(32 << 10, 5);
        let expect = InExpect {
            len: data.len(),
            tag: TAG,
        };
        let mut msg = out(&data, TAG, None);
        msg.sender_busy = true;
        let mut sc = SendCursor::default();
        let p = a.send(&msg, &mut sc).unwrap();
        assert_eq!(
            (p.state, p.moved),
            (SendState::Posted, true),
            "busy: pulled"
        );
        assert_eq!(
            b.local.head(0).load(Ordering::Relaxed),
            1,
            "one descriptor slot"
        );
        let (mut rc, mut sink) = (RecvCursor::default(), Collect::new(data.len(), true));
        assert!(b.recv(&expect, &mut rc, &mut sink).unwrap().state);
        assert_eq!(sink.buf, data);
        assert_eq!(sink.pieces, vec![(0, data.len())]);
        assert_eq!(a.send(&msg, &mut sc).unwrap().state, SendState::Complete);

        msg.sender_busy = false;
        let mut sc = SendCursor::default();
        let p = a.send(&msg, &mut sc).unwrap();
        assert_eq!(
            p.state,
            SendState::Complete,
            "not busy: copied into the slots"
        );
        assert_eq!(
            b.local.head(0).load(Ordering::Relaxed),
            1 + 8,
            "a slot per 4 KiB"
        );
        let (mut rc, mut sink) = (RecvCursor::default(), Collect::new(data.len(), true));
        assert!(b.recv(&expect, &mut rc, &mut sink).unwrap().state);
        assert_eager(&sink, &data, 4096, "not busy");
    }

    /// Pulling with process_vm_readv (from this very process) into a sink that combines:
    /// the bytes come through the scratch buffer in PULL_PIECE pieces.
    #[test]
    fn a_cma_pull_into_a_combining_sink_goes_piece_by_piece() {
        let (a, b) = pair(4, 4096, true, 32 << 10, Access::Cma(std::process::id()));
        if !probe_cma(std::process::id(), a.local.base_addr()) {
            eprintln!("process_vm_readv is not permitted here; the CMA pull is not tested");
            return;
        }
        let data = pattern(2 * PULL_PIECE + 100, 4);
        let msgs = [(data.clone(), TAG, None)];
        let got = exchange(&a, &b, &msgs, false);
        assert_eq!(got[0].buf, data);
        // Each piece lies in scratch at its offset within a page in the sender's buffer.
        let src = msgs[0].0.as_ptr() as usize;
        for (&(off, _), &from) in got[0].pieces.iter().zip(&got[0].from) {
            assert_eq!(from % PAGE_SPAN, (src + off) % PAGE_SPAN, "piece at {off}");
        }
        assert_eq!(got[0].from.len(), 3);
        assert_eq!(
            got[0].pieces,
            vec![
                (0, PULL_PIECE),
                (PULL_PIECE, PULL_PIECE),
                (2 * PULL_PIECE, 100)
            ]
        );
        assert_eq!(
            b.local.head(0).load(Ordering::Relaxed),
            1,
            "pulled, not eager"
        );
        assert!(a.prefers_huge_pages());
        assert_eq!(a.describe(), "shm/cma");
        // The probe reads the segment's first word: another address does not pass.
        assert!(!probe_cma(std::process::id(), a.local.base_addr() + 64));
    }

    /// A sink over memory it does not own: copies into it (`direct`) or folds into it (XOR),
    /// and says whether its result goes back to the sender (`returns`).
    struct Fold {
        dst: *mut u8,
        len: usize,
        direct: bool,
        returns: bool,
        forwards: bool,
        forward_first: bool,
        pieces: Vec<(usize, usize)>,
    }

    impl Fold {
        /// Folds into `buf`, whose result goes back to the sender.
        fn returning(buf: &mut [u8]) -> Fold {
            Fold::over(buf, false, true)
        }

        /// Takes the bytes straight into `buf`.
        fn landing(buf: &mut [u8]) -> Fold {
            Fold::over(buf, true, false)
        }

        fn over(buf: &mut [u8], direct: bool, returns: bool) -> Fold {
            Fold {
                dst: buf.as_mut_ptr(),
                len: buf.len(),
                direct,
                returns,
                forwards: false,
                forward_first: false,
                pieces: Vec::new(),
            }
        }
    }

    impl Sink for Fold {
        fn direct(&mut self) -> Option<*mut u8> {
            self.direct.then_some(self.dst)
        }

        fn put(&mut self, offset: usize, data: &[u8], _: Option<Scale>) -> Result<()> {
            assert!(offset + data.len() <= self.len);
            for (i, &x) in data.iter().enumerate() {
                // SAFETY: the test's buffer covers `len` bytes.
                unsafe { *self.dst.add(offset + i) ^= x };
            }
            self.pieces.push((offset, data.len()));
            Ok(())
        }

        fn placed(&mut self, offset: usize, len: usize, _: Option<Scale>) -> Result<()> {
            self.pieces.push((offset, len));
            Ok(())
        }

        fn returns(&self) -> Option<*const u8> {
            self.returns.then_some(self.dst.cast_const())
        }

        fn forwards(&self) -> bool {
            self.forwards
        }

        fn forward_first(&self) -> bool {
            self.forward_first
        }
    }

    /// Sends `msg` on `tx` until it completes while `rx` receives it into `sink`; the send's
    /// first state and the receive's result.
    fn transfer(
        tx: &ShmPeer,
        rx: &ShmPeer,
        msg: &OutMsg,
        sink: &mut Fold,
    ) -> (SendState, Result<()>) {
        let mut sc = SendCursor::default();
        let mut rc = RecvCursor::default();
        let expect = InExpect {
            len: msg.len,
            tag: msg.tag,
        };
        let first = tx.send(msg, &mut sc).unwrap().state;
        let mut state = first;
        for _ in 0..100_000 {
            match rx.recv(&expect, &mut rc, sink) {
                Ok(p) if p.state => {}
                Ok(_) => continue,
                Err(e) => return (first, Err(e)),
            }
            while state != SendState::Complete {
                state = tx.send(msg, &mut sc).unwrap().state;
            }
            return (first, Ok(()));
        }
        panic!("stalled");
    }

    /// Kernel copies at a distance where `rep movsb` runs slow (the destination 1 to 63 bytes
    /// past the source modulo a page) go through scratch; the bytes land all the same, pulled
    /// straight into a receive buffer or folded and written back into the sender's memory.
    #[test]
    fn kernel_copies_at_a_slow_distance_land_all_the_same() {
        let pid = std::process::id();
        let (probe, _) = pair(2, 4096, true, 0, Access::Direct);
        if !probe_cma(pid, probe.local.base_addr()) {
            eprintln!("process_vm_readv is not permitted here; staged CMA copies are not tested");
            return;
        }
        let len = 2 * PULL_PIECE + 100;
        for skew in [0, 16, 48, 4080] {
            // Page-aligned sources; the receive buffer `skew` bytes into its page.
            let (mut sbuf, mut fbuf, mut rbuf) = (
                vec![0u8; len + 2 * PAGE_SPAN],
                vec![0u8; len + 2 * PAGE_SPAN],
                vec![0u8; len + 2 * PAGE_SPAN],
            );
            let s0 = sbuf.as_ptr().align_offset(PAGE_SPAN);
            let f0 = fbuf.as_ptr().align_offset(PAGE_SPAN);
            let r0 = rbuf.as_ptr().align_offset(PAGE_SPAN) + skew;
            let (a0, b0) = (pattern(len, 7), pattern(len, 8));
            sbuf[s0..s0 + len].copy_from_slice(&a0);
            let (a, b) = pair(4, 4096, true, 32 << 10, Access::Cma(pid));
            let msg = out(&sbuf[s0..s0 + len], TAG, None);
            let mut land = Fold::landing(&mut rbuf[r0..r0 + len]);
            let (first, r) = transfer(&a, &b, &msg, &mut land);
            r.unwrap();
            assert_eq!(first, SendState::Posted, "skew {skew}: pulled");
            assert!(rbuf[r0..r0 + len] == a0[..], "skew {skew}: pulled bytes");

            // The receiver folds into fbuf (page-aligned) and writes the result back into
            // rbuf, `skew` bytes past it modulo a page.
            rbuf.fill(0);
            fbuf[f0..f0 + len].copy_from_slice(&b0);
            let (a, b) = pair(4, 4096, true, 32 << 10, Access::Cma(pid));
            let mut msg = out(&sbuf[s0..s0 + len], TAG, None);
            msg.reply_at = Some(rbuf[r0..].as_ptr() as usize);
            let mut fold = Fold::returning(&mut fbuf[f0..f0 + len]);
            let (first, r) = transfer(&a, &b, &msg, &mut fold);
            r.unwrap();
            assert_eq!(first, SendState::Posted, "skew {skew}: folded");
            let folded: Vec<u8> = a0.iter().zip(&b0).map(|(x, y)| x ^ y).collect();
            assert!(
                fbuf[f0..f0 + len] == folded[..],
                "skew {skew}: folded bytes"
            );
            assert!(
                rbuf[r0..r0 + len] == folded[..],
                "skew {skew}: written back"
            );
            assert!(rbuf[..r0].iter().chain(&rbuf[r0 + len..]).all(|&x| x == 0));
        }
    }

    /// A folding receiver whose result goes straight back writes it where the sender offered
    /// (its own buffer in place, another out of place) as it pulls, when (and only when) the
    /// sender offered a place; its send of the result is then a notice that completes at once,
    /// and the sender's receive into that place takes the notice without copying. A notice
    /// for a receive that lands elsewhere is an error. Between threads (plain copies) and with
    /// process_vm_readv/writev.
    #[test]
    fn a_folded_reply_is_written_back_and_its_send_is_a_notice() {
        let mut accesses = vec![Access::Direct];
        let (probe, _) = pair(2, 4096, true, 0, Access::Direct);
        if probe_cma(std::process::id(), probe.local.base_addr()) {
            accesses.push(Access::Cma(std::process::id()));
        } else {
            eprintln!("process_vm_readv is not permitted here; the CMA write-back is not tested");
        }
        let len = 2 * PULL_PIECE + 100;
        for access in accesses {
            // Offered: none, the sent bytes themselves, a separate receive buffer.
            for offered in [None, Some(false), Some(true)] {
                let what = format!("{access:?}, offered {offered:?}");
                let (a, b) = pair(4, 4096, true, 32 << 10, access);
                let (a0, b0) = (pattern(len, 1), pattern(len, 2));
                let folded: Vec<u8> = a0.iter().zip(&b0).map(|(x, y)| x ^ y).collect();
                let (mut abuf, mut bbuf) = (a0.clone(), b0.clone());
                let mut arecv = vec![0u8; len];
                let mut msg = out(&abuf, TAG, None);
                msg.reply_at = offered.map(|elsewhere| {
                    if elsewhere {
                        arecv.as_ptr() as usize
                    } else {
                        abuf.as_ptr() as usize
                    }
                });
                let mut fold = Fold::returning(&mut bbuf);
                let (first, r) = transfer(&a, &b, &msg, &mut fold);
                r.unwrap();
                assert_eq!(first, SendState::Posted, "{what}: pulled");
                assert_eq!(bbuf, folded, "{what}");
                // Between processes the pull goes piece by piece through scratch.
                let pieces = if access == Access::Direct { 1 } else { 3 };
                assert_eq!(fold.pieces.len(), pieces, "{what}");
                assert_eq!(
                    abuf == folded,
                    offered == Some(false),
                    "{what}: written back"
                );
                assert_eq!(
                    arecv == folded,
                    offered == Some(true),
                    "{what}: written there"
                );
                if offered == Some(true) {
                    assert_eq!(abuf, a0, "{what}: the sent bytes stay");
                }
                let heads = a.local.head(1).load(Ordering::Relaxed);
                let reply = out(&bbuf, TAG, None);
                let lands = if offered == Some(true) {
                    &mut arecv
                } else {
                    &mut abuf
                };
                let mut land = Fold::landing(lands);
                let (first, r) = transfer(&b, &a, &reply, &mut land);
                r.unwrap();
                let expect = if offered.is_some() {
                    SendState::Complete
                } else {
                    SendState::Posted
                };
                assert_eq!(first, expect, "{what}: the reply's send");
                assert_eq!(a.local.head(1).load(Ordering::Relaxed), heads + 1, "{what}");
                assert_eq!(land.pieces, vec![(0, len)], "{what}");
                assert_eq!(*lands, folded, "{what}: the reply landed");
                assert!(b.carried.list.lock().is_empty(), "{what}");
            }
            // A notice whose address is not where the receive lands.
            let (a, b) = pair(4, 4096, true, 32 << 10, access);
            let (abuf, mut bbuf) = (pattern(len, 1), pattern(len, 2));
            let mut msg = out(&abuf, TAG, None);
            msg.reply_at = Some(msg.src as usize);
            transfer(&a, &b, &msg, &mut Fold::returning(&mut bbuf))
                .1
                .unwrap();
            let mut elsewhere = vec![0u8; len];
            let mut land = Fold::landing(&mut elsewhere);
            let e = transfer(&b, &a, &out(&bbuf, TAG, None), &mut land)
                .1
                .unwrap_err();
            assert_eq!(e.kind, crate::error::ErrorKind::Internal, "{}", e.msg);
            assert!(e.msg.contains("does not land"), "{}", e.msg);
            assert!(elsewhere.iter().all(|&x| x == 0));
        }
    }

    /// A folding receiver whose result is the next message to the sender (`Sink::forwards`)
    /// puts each folded piece straight into its FIFO's slots while it pulls, as long as slots
    /// are free; the result's send then sends only the rest (nothing, when every piece went),
    /// and the sender receives the whole result in order. Without `forwards` nothing goes
    /// ahead and the result is sent as usual. Between processes (process_vm_readv) only.
    #[test]
    fn a_forwarded_fold_goes_into_the_slots_as_it_folds_and_its_send_sends_the_rest() {
        let (probe, _) = pair(2, 4096, true, 0, Access::Direct);
        if !probe_cma(std::process::id(), probe.local.base_addr()) {
            eprintln!("process_vm_readv is not permitted here; forwarding is not tested");
            return;
        }
        let access = Access::Cma(std::process::id());
        let len = 2 * PULL_PIECE + 100;
        let slot = 4096;
        let need = len.div_ceil(slot);
        for (nslots, forwards, ahead) in [(256, true, need), (8, true, 8), (256, false, 0)] {
            let what = format!("{nslots} slots, forwards {forwards}");
            let (a, b) = pair(nslots, slot, true, 32 << 10, access);
            let (a0, b0) = (pattern(len, 1), pattern(len, 2));
            let folded: Vec<u8> = a0.iter().zip(&b0).map(|(x, y)| x ^ y).collect();
            let (mut abuf, mut bbuf) = (a0.clone(), b0.clone());
            let msg = out(&abuf, TAG, None);
            let mut fold = Fold::returning(&mut bbuf);
            fold.forwards = forwards;
            let before = b.remote.head(1).load(Ordering::Relaxed);
            let (first, r) = transfer(&a, &b, &msg, &mut fold);
            r.unwrap();
            assert_eq!(first, SendState::Posted, "{what}: pulled");
            assert!(bbuf == folded, "{what}");
            let went = (b.remote.head(1).load(Ordering::Relaxed) - before) as usize;
            assert_eq!(went, ahead, "{what}: slots filled while folding");
            // The result's send and the sender's receive, driven in turn (into zeros: the
            // test sink folds eager pieces in with xor).
            let reply = out(&bbuf, TAG, None);
            abuf.fill(0);
            let mut land = Fold::landing(&mut abuf);
            let expect = InExpect { len, tag: TAG };
            let (mut sc, mut rc) = (SendCursor::default(), RecvCursor::default());
            let first = b.send(&reply, &mut sc).unwrap().state;
            let (mut sent, mut got) = (first == SendState::Complete, false);
            for _ in 0..100_000 {
                if !got {
                    got = a.recv(&expect, &mut rc, &mut land).unwrap().state;
                }
                if !sent {
                    sent = b.send(&reply, &mut sc).unwrap().state == SendState::Complete;
                }
                if sent && got {
                    break;
                }
            }
            assert!(sent && got, "{what}: stalled");
            let expect_first = match ahead {
                0 => SendState::Posted,
                a if a == need => SendState::Complete,
                _ => SendState::Pending,
            };
            assert_eq!(first, expect_first, "{what}: the result's first send");
            assert!(abuf == folded, "{what}: the result landed");
            if ahead > 0 {
                let offsets: Vec<usize> = land.pieces.iter().map(|p| p.0).collect();
                let want: Vec<usize> = (0..need).map(|k| k * slot).collect();
                assert_eq!(offsets, want, "{what}: in order, slot by slot");
            }
            assert!(b.carried.list.lock().is_empty(), "{what}");
        }
    }

    /// Where the sender offered a place for the reply and the folded bytes may also be
    /// forwarded, the sink's choice (`Sink::forward_first`, the executor's by measured times)
    /// decides: forwarding fills the slots and leaves the offered place untouched, otherwise
    /// the bytes are written back there and no slot fills. Between threads (plain copies,
    /// which never forward) they are written back whatever the sink would rather.
    #[test]
    fn an_offered_place_is_written_back_unless_the_sink_would_rather_forward() {
        let pid = std::process::id();
        let (probe, _) = pair(2, 4096, true, 0, Access::Direct);
        if !probe_cma(pid, probe.local.base_addr()) {
            eprintln!("process_vm_readv is not permitted here; the choice is not tested");
            return;
        }
        let (len, slot) = (2 * PULL_PIECE + 100, 4096);
        for (first, access) in [
            (true, Access::Cma(pid)),
            (false, Access::Cma(pid)),
            (true, Access::Direct),
        ] {
            let (a, b) = pair(256, slot, true, 32 << 10, access);
            let (a0, b0) = (pattern(len, 3), pattern(len, 4));
            let folded: Vec<u8> = a0.iter().zip(&b0).map(|(x, y)| x ^ y).collect();
            let mut bbuf = b0.clone();
            let arecv = vec![0u8; len];
            let mut msg = out(&a0, TAG, None);
            msg.reply_at = Some(arecv.as_ptr() as usize);
            let mut fold = Fold::returning(&mut bbuf);
            fold.forwards = true;
            fold.forward_first = first;
            let before = b.remote.head(1).load(Ordering::Relaxed);
            transfer(&a, &b, &msg, &mut fold).1.unwrap();
            let what = format!("forward first {first}, {access:?}");
            assert_eq!(bbuf, folded, "{what}: folded");
            let went = (b.remote.head(1).load(Ordering::Relaxed) - before) as usize;
            // Between threads nothing forwards: the bytes are written back all the same.
            let forwarded = first && access != Access::Direct;
            let need = if forwarded { len.div_ceil(slot) } else { 0 };
            assert_eq!(went, need, "{what}: slots filled");
            if forwarded {
                assert!(arecv.iter().all(|&x| x == 0), "written back all the same");
            } else {
                assert_eq!(arecv, folded, "not written back");
            }
        }
    }

    /// A sender's multiplier reaches the receiver with every piece, eager or pulled.
    #[test]
    fn a_scale_travels_with_the_message() {
        let (a, b) = pair(2, 4096, true, 32 << 10, Access::Direct);
        let s = Some(Scale([1, 2, 3, 4, 5, 6, 7, 8]));
        let msgs = [
            (pattern(10_000, 1), TAG, s),
            (pattern(100_000, 2), TAG + 1, s),
            (pattern(100, 3), TAG + 2, None),
        ];
        for direct in [false, true] {
            let got = exchange(&a, &b, &msgs, direct);
            for (g, m) in got.iter().zip(&msgs) {
                assert_eq!(g.buf, m.0);
                assert!(!g.scales.is_empty());
                assert!(g.scales.iter().all(|&x| x == m.2), "{:?}", g.scales);
            }
        }
    }

    /// Warming a link only reads: messages in flight either way still arrive whole, and no
    /// head or tail moves.
    #[test]
    fn warming_a_link_changes_nothing_in_its_fifos() {
        let (a, b) = pair(16, 4096, false, usize::MAX, Access::Direct);
        let msgs: Vec<Vec<u8>> = (0..3).map(|i| pattern(100 + i, i as u8)).collect();
        for (i, m) in msgs.iter().enumerate() {
            let p = a
                .send(&out(m, TAG + i as u64, None), &mut SendCursor::default())
                .unwrap();
            assert_eq!(p.state, SendState::Complete);
        }
        let state = |l: &ShmPeer| {
            (
                l.local.head(l.peer).load(Ordering::Relaxed),
                l.local.tail(l.peer).load(Ordering::Relaxed),
                l.remote.head(l.me).load(Ordering::Relaxed),
                l.remote.tail(l.me).load(Ordering::Relaxed),
            )
        };
        let before = (state(&a), state(&b));
        a.warm();
        b.warm();
        assert_eq!((state(&a), state(&b)), before);
        for (i, m) in msgs.iter().enumerate() {
            let mut sink = Collect::new(m.len(), false);
            let expect = InExpect {
                len: m.len(),
                tag: TAG + i as u64,
            };
            assert!(
                b.recv(&expect, &mut RecvCursor::default(), &mut sink)
                    .unwrap()
                    .state
            );
            assert_eq!(&sink.buf, m);
        }
    }

    /// Receives one message of `len` bytes with `tag` on `b`, checking `peek` first; its bytes
    /// and scales.
    fn take(b: &ShmPeer, len: usize, tag: u64) -> Collect {
        assert_eq!(b.peek().unwrap(), Some((len, tag)), "peek of {len} bytes");
        let mut sink = Collect::new(len, false);
        let mut rc = RecvCursor::default();
        let expect = InExpect { len, tag };
        for _ in 0..16 {
            if b.recv(&expect, &mut rc, &mut sink).unwrap().state {
                return sink;
            }
        }
        panic!("{len} bytes with tag {tag:#x} did not arrive");
    }

    /// Messages of up to PACK_MAX bytes share slots, entry after entry, with or without a
    /// scale; larger ones and pulled ones take slots of their own between them, and the
    /// receiver gets every message in order, also through `peek`. A packed slot's first message
    /// lies in the line of the slot's number.
    #[test]
    fn small_messages_are_packed_and_keep_their_order_among_others() {
        let (a, b) = pair(8, 4096, false, usize::MAX, Access::Direct);
        let s = Some(Scale([9, 8, 7, 6, 5, 4, 3, 2]));
        let msgs: Vec<(usize, Option<Scale>)> = vec![
            (8, None),
            (0, None),
            (1, s),
            (24, s),
            (40, None),
            (48, None),
            (49, s),
            (PACK_MAX, s),
            (PACK_MAX + 1, None),
            (3, None),
            (5000, s),
            (8, None),
            (100, None),
        ];
        let datas: Vec<Vec<u8>> = msgs
            .iter()
            .map(|&(len, _)| pattern(len, len as u8 ^ 0x5a))
            .collect();
        for (i, (&(len, scale), data)) in msgs.iter().zip(&datas).enumerate() {
            let p = a
                .send(
                    &out(data, TAG + i as u64, scale),
                    &mut SendCursor::default(),
                )
                .unwrap();
            assert_eq!(p.state, SendState::Complete, "message {i}: {len} bytes");
        }
        // Slots: one packed (the first eight), one for PACK_MAX + 1, one packed, two for 5000
        // bytes, one packed.
        assert_eq!(a.remote.head(0).load(Ordering::Relaxed), 6);
        let first = b.local.slot(0, 0);
        // SAFETY: slot 0 of a mapped FIFO, published.
        unsafe {
            assert_eq!((first.add(SLOT_FIELDS) as *const u32).read(), KIND_PACKED);
            let ctl = entry_ctl(first, PACK_FIRST).load(Ordering::Acquire);
            assert_eq!(ctl & ENTRY_LEN, 8);
            assert!(PACK_FIRST + entry_bytes(8, false) <= PACK_LINE);
            let data = std::slice::from_raw_parts(first.add(PACK_FIRST + 16), 8);
            assert_eq!(
                data,
                &datas[0][..],
                "the first message in the number's line"
            );
        }
        for (i, (&(len, scale), data)) in msgs.iter().zip(&datas).enumerate() {
            let got = take(&b, len, TAG + i as u64);
            assert_eq!(&got.buf, data, "message {i}: {len} bytes");
            assert!(got.scales.iter().all(|&x| x == scale), "message {i}: scale");
        }
        assert_eq!(b.peek().unwrap(), None);
    }

    /// A FIFO of two slots holds hundreds of small messages. When packed slots fill, the
    /// sender waits for the receiver to finish one (pending, nothing written), and entries
    /// left from earlier turns of the ring never pass for new ones: every byte is checked over
    /// many turns, with receives lagging behind sends by different amounts.
    #[test]
    fn packed_slots_hold_many_messages_and_turn_around_the_ring() {
        let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
        let msg = |i: usize| pattern(8 + i % 3 * 8, i as u8);
        let send = |i: usize| {
            let data = msg(i);
            a.send(
                &out(&data, TAG + i as u64, None),
                &mut SendCursor::default(),
            )
            .unwrap()
        };
        let receive = |i: usize| {
            let got = take(&b, msg(i).len(), TAG + i as u64);
            assert_eq!(got.buf, msg(i), "message {i}");
        };
        let (mut sent, mut received) = (0usize, 0usize);
        // Entries of 24-40 bytes, one or two to a line, in two slots of PACK_AREA bytes.
        loop {
            let p = send(sent);
            if p.state == SendState::Pending {
                assert!(!p.moved, "a pending send writes nothing");
                break;
            }
            sent += 1;
        }
        assert!(sent >= 150, "only {sent} messages fit in two slots");
        for lag in [1usize, 7, 100, 3, 255] {
            for _ in 0..2000 {
                while received + lag < sent {
                    receive(received);
                    received += 1;
                }
                if send(sent).state == SendState::Complete {
                    sent += 1;
                } else {
                    receive(received);
                    received += 1;
                }
            }
        }
        while received < sent {
            receive(received);
            received += 1;
        }
        assert_eq!(b.peek().unwrap(), None);
        assert!(
            a.remote.head(0).load(Ordering::Relaxed) > 20,
            "the ring turned"
        );
    }

    /// Bytes that an eager message left in a slot, shaped like the control word the receiver
    /// waits for next, are not taken for a packed entry when the slot is packed later: the
    /// receiver finds nothing until the entry is sent.
    #[test]
    fn leftover_bytes_that_look_like_an_entry_are_not_one() {
        let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
        // Every word says "stamp of the second packed message, 0 bytes".
        let fake: Vec<u8> = std::iter::repeat_n((stamp_of(1) << STAMP_SHIFT).to_le_bytes(), 500)
            .flatten()
            .collect();
        let filler = pattern(PACK_MAX + 1, 7);
        for (i, m) in [&fake, &filler].into_iter().enumerate() {
            a.send(&out(m, TAG + i as u64, None), &mut SendCursor::default())
                .unwrap();
            assert_eq!(&take(&b, m.len(), TAG + i as u64).buf, m);
        }
        // Slot 0 again, packed: an entry of 56 bytes goes to the second line and ends where
        // the fake words are.
        let first = pattern(56, 1);
        a.send(&out(&first, TAG + 2, None), &mut SendCursor::default())
            .unwrap();
        assert_eq!(a.remote.head(0).load(Ordering::Relaxed), 3);
        assert_eq!(take(&b, 56, TAG + 2).buf, first);
        assert_eq!(b.peek().unwrap(), None, "nothing sent yet");
        let expect = InExpect {
            len: 8,
            tag: TAG + 3,
        };
        let mut sink = Collect::new(8, false);
        let mut rc = RecvCursor::default();
        let p = b.recv(&expect, &mut rc, &mut sink).unwrap();
        assert_eq!((p.state, p.moved), (false, false));
        let second = pattern(8, 2);
        a.send(&out(&second, TAG + 3, None), &mut SendCursor::default())
            .unwrap();
        assert!(b.recv(&expect, &mut rc, &mut sink).unwrap().state);
        assert_eq!(sink.buf, second);
    }

    /// A rank that finds a live peer stopped serving blames the rank that died, where one did,
    /// not the live one that gave up because of it.
    #[test]
    fn a_peer_that_stopped_serving_is_not_blamed_for_a_rank_that_died() {
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let watch = ProcessWatch::new(dead.id());
        dead.wait().unwrap();
        let live = ProcessWatch::new(std::process::id());
        let cause = Error::new(ErrorKind::Remote, "connection refused");
        let e = stopped_serving(1, &cause, &[(1, live), (4, watch)]);
        assert_eq!(e.kind, ErrorKind::Remote);
        assert_eq!(e.lost, Some(4));
        assert!(e.msg.starts_with("rank 4 exited"), "{}", e.msg);
        assert!(e.msg.contains("rank 1 then stopped serving"), "{}", e.msg);
        let e = stopped_serving(1, &cause, &[(1, ProcessWatch::new(std::process::id()))]);
        assert_eq!(e.lost, Some(1));
        assert!(e.msg.starts_with("rank 1 stopped serving"), "{}", e.msg);
    }

    /// A packed message that is not what the receiver expects (length or tag) is the same
    /// mismatch error as an eager one, and the message stays for the right receive.
    #[test]
    fn a_packed_message_of_another_size_or_operation_is_a_mismatch() {
        let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
        let data = pattern(8, 1);
        a.send(&out(&data, TAG, None), &mut SendCursor::default())
            .unwrap();
        for expect in [
            InExpect { len: 16, tag: TAG },
            InExpect {
                len: 8,
                tag: TAG + 1,
            },
        ] {
            let mut sink = Collect::new(expect.len, false);
            let e = b
                .recv(&expect, &mut RecvCursor::default(), &mut sink)
                .expect_err("a mismatch");
            assert_eq!(e.kind, ErrorKind::InvalidUsage, "{}", e.msg);
            assert!(e.msg.contains("sent 8 bytes"), "{}", e.msg);
        }
        assert_eq!(take(&b, 8, TAG).buf, data);
    }

    /// Closing one end is what the other end's peer check reports: how it closed and which
    /// rank it had lost, the worst way it closed winning. Bytes sent before still arrive.
    #[test]
    fn a_closed_end_is_reported_with_how_and_whom_it_lost() {
        let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
        assert!(b.check_peer().is_ok());
        let data = pattern(100, 5);
        a.send(&out(&data, TAG, None), &mut SendCursor::default())
            .unwrap();
        a.close(Closing::Aborted, Some(5));
        let e = b.check_peer().expect_err("rank 0 aborted");
        assert_eq!(e.kind, ErrorKind::Remote);
        assert!(
            e.msg
                .contains("rank 0 aborted its communicator after it lost rank 5"),
            "{}",
            e.msg
        );
        assert_eq!(e.lost, Some(5));
        // The loss is noted for this rank's own peers too.
        assert_eq!(b.local.first_lost().load(Ordering::SeqCst), 6);
        // Destroying after aborting is still an abort.
        a.close(Closing::Destroyed, None);
        assert!(b.check_peer().unwrap_err().msg.contains("aborted"));
        let mut sink = Collect::new(100, false);
        let expect = InExpect { len: 100, tag: TAG };
        assert!(
            b.recv(&expect, &mut RecvCursor::default(), &mut sink)
                .unwrap()
                .state
        );
        assert_eq!(sink.buf, data);

        let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
        a.close(Closing::TimedOut, Some(1));
        let e = b.check_peer().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Timeout);
        assert!(
            e.msg.contains("rank 0 timed out waiting for rank 1"),
            "{}",
            e.msg
        );
        // The error says whom rank 0 waited for (this rank, 1: the blame check reads it), but
        // what this rank tells its own peers it lost is rank 0, not itself (they said "rank 1
        // timed out waiting for rank 1").
        assert_eq!(e.lost, Some(1));
        assert_eq!(b.local.first_lost().load(Ordering::SeqCst), 1);

        let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
        b.close(Closing::Destroyed, None);
        let e = a.check_peer().unwrap_err();
        assert!(
            e.msg.contains("rank 1 destroyed its communicator"),
            "{}",
            e.msg
        );
        assert_eq!(e.lost, Some(1));
    }

    /// A ring wakes the owner asleep on its doorbell, and so does a peer's send; a ring
    /// with nobody asleep leaves the doorbell word alone.
    #[test]
    fn the_doorbell_wakes_a_sleeping_owner() {
        let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
        let seg = b.local.clone();
        let word = seg.doorbell().load(Ordering::SeqCst);
        seg.ring();
        assert_eq!(seg.doorbell().load(Ordering::SeqCst), word);
        let data = [7u8; 8];
        let wakers: [&dyn Fn(); 2] = [&|| seg.ring(), &|| {
            a.send(&out(&data, TAG, None), &mut SendCursor::default())
                .unwrap();
        }];
        for wake in wakers {
            let took = std::thread::scope(|s| {
                let sleeper = s.spawn(|| {
                    let seen = seg.prepare_sleep();
                    let t = Instant::now();
                    seg.sleep(seen, Duration::from_secs(10));
                    t.elapsed()
                });
                while seg.sleepers().load(Ordering::SeqCst) == 0 {
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_millis(20));
                wake();
                sleeper.join().unwrap()
            });
            assert!(took < Duration::from_secs(5), "slept {took:?}");
            assert_eq!(seg.sleepers().load(Ordering::SeqCst), 0);
        }
    }

    /// A peer's segment is used only when it is what the peer announced: the nonce, the rank
    /// count and the size must match.
    #[test]
    fn a_segment_opens_only_as_announced() {
        let geo = Geometry {
            nranks: 2,
            nslots: 4,
            slot_bytes: 4096,
            registry_bytes: 4096,
        };
        let seg = Segment::create(0, geo, 0xabc).unwrap();
        let fd = || os::dup(seg.fd.as_ref().unwrap().as_raw_fd()).unwrap();
        let opened = Segment::open(fd(), 0xabc, 2).expect("as announced");
        assert_eq!(opened.geo, geo);
        assert_eq!(opened.map.len(), geo.total());
        assert!(opened.fd.is_none());
        for (nonce, nranks) in [(0xabd, 2), (0xabc, 3)] {
            let e = Segment::open(fd(), nonce, nranks).err().expect("refused");
            assert_eq!(e.kind, ErrorKind::Remote);
            assert!(e.msg.contains("does not match"), "{}", e.msg);
        }
        let small = os::memfd("comm-shm-test", 100).unwrap();
        let e = Segment::open(small, 0xabc, 2).err().expect("too small");
        assert!(e.msg.contains("only 100 bytes"), "{}", e.msg);
    }

    /// The areas of a segment follow one another without overlapping, page-aligned.
    #[test]
    fn segment_areas_do_not_overlap() {
        for (nranks, nslots, slot_bytes) in [(1, 2, 4096), (2, 16, 65536), (9, 3, 4224)] {
            let g = Geometry {
                nranks,
                nslots,
                slot_bytes,
                registry_bytes: 4096,
            };
            assert!(g.slots_base() >= CTL_BASE + nranks * CTL_STRIDE);
            assert_eq!(g.slots_base() % 4096, 0);
            assert!(g.registry_base() >= g.slots_base() + nranks * nslots * g.slot_stride());
            assert_eq!(g.registry_base() % 4096, 0);
            assert_eq!(g.total(), g.registry_base() + 4096);
            assert_eq!(g.slot_stride() % 64, 0);
        }
    }
}
