//! A rank's shared segment: its layout (control lines, one FIFO of slots per sender), the
//! atomics in it, and the doorbell the segment carries.

use crate::error::{Error, Result};
use crate::sys::{self, Mapping};
use crate::transport::{Closing, Doorbell};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

pub(super) const SEG_MAGIC: u64 = 0x636f_6d6d_7368_6d38; // "commshm8": the segment layout's version

pub(super) const LINE: usize = 128;

/// The CPU's bits in the `running_on` word.
pub(super) const CPU_MASK: u32 = (1 << 30) - 1;

pub(super) const CTL_BASE: usize = 4 * LINE;

pub(super) const CTL_STRIDE: usize = 3 * LINE;

/// A slot starts with its message number (8 bytes, written last) and the header; data follows
/// on the next cache line.
pub(super) const SLOT_HEADER: usize = 64;

pub(super) const SLOT_FIELDS: usize = 8;

pub(super) const KIND_EAGER: u32 = 1;

pub(super) const KIND_PULL: u32 = 2;

/// No bytes: the receiver of an earlier pulled message wrote this one's bytes into the buffer
/// that message came from (`Offer::reply_at`), which is where this one lands (`src_addr`).
pub(super) const KIND_RETURNED: u32 = 3;

pub(super) const FLAG_SCALE: u32 = 1;

/// On a pull descriptor: the sender offers a place for the reply (`Offer::reply_at`), whose
/// address is the descriptor's one word of data.
pub(super) const FLAG_REPLY_AT: u32 = 2;

/// Geometry of a segment, chosen by its owner and read back by peers from its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) nranks: usize,
    pub(super) nslots: usize,
    pub(super) slot_bytes: usize,
    /// Bytes at the end for the registry of registered buffers (`transport::reg` lays them
    /// out; the segment only reserves them).
    pub(super) registry_bytes: usize,
}

impl Geometry {
    pub(super) fn from_env(nranks: usize, registry_bytes: usize) -> Geometry {
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

    pub(super) fn slot_stride(&self) -> usize {
        SLOT_HEADER + self.slot_bytes
    }

    /// One sender's ring of slots.
    pub(super) fn fifo_bytes(&self) -> usize {
        self.nslots * self.slot_stride()
    }

    pub(super) fn slots_base(&self) -> usize {
        (CTL_BASE + self.nranks * CTL_STRIDE).next_multiple_of(4096)
    }

    /// Where the registry of registered buffers begins (see `transport::reg`).
    pub(super) fn registry_base(&self) -> usize {
        (self.slots_base() + self.nranks * self.nslots * self.slot_stride()).next_multiple_of(4096)
    }

    pub(super) fn total(&self) -> usize {
        self.registry_base() + self.registry_bytes
    }
}

/// The header the sender writes into a slot before publishing it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct SlotHeader {
    pub(super) kind: u32,
    pub(super) flags: u32,
    pub(super) msg_len: u64,
    pub(super) tag: u64,
    pub(super) scale: [u8; 8],
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) src_addr: u64,
}

/// Where a segment's slots lie, worked out once from its geometry: `Segment::slot` runs
/// several times per message, and working out the area's start each time cost 40-60
/// instructions a message on each side (callgrind, 8-byte two-rank broadcast).
#[derive(Clone, Copy, Debug)]
pub(super) struct SlotArea {
    pub(super) base: usize,
    pub(super) stride: usize,
    pub(super) nslots: usize,
    /// `nslots - 1` where the count is a power of two, as it is unless set otherwise: a mask
    /// instead of a division (tens of cycles).
    pub(super) mask: Option<u64>,
}

impl SlotArea {
    pub(super) fn of(g: &Geometry) -> SlotArea {
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
    pub(super) map: Mapping,
    pub(super) geo: Geometry,
    pub(super) slots: SlotArea,
    /// Held by the owner so same-process peers can duplicate it while the communicator lives.
    pub(super) fd: Option<OwnedFd>,
}

impl Segment {
    pub(super) fn create(owner_rank: usize, geo: Geometry, nonce: u64) -> Result<Segment> {
        let fd = sys::memfd(&format!("comm-shm-r{owner_rank}"), geo.total())?;
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
    pub(super) fn open(fd: OwnedFd, nonce: u64, nranks: usize) -> Result<Segment> {
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

    pub(super) fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= self.map.len() && off % 4 == 0);
        // SAFETY: in bounds and aligned (checked above); the mapping lives as long as &self and is
        // only ever accessed atomically at this offset.
        unsafe { &*(self.map.ptr().add(off) as *const AtomicU32) }
    }

    /// The 64-bit word at byte `off` of the registry area.
    pub(in crate::transport) fn registry_u64(&self, off: usize) -> &AtomicU64 {
        self.atomic_u64(self.geo.registry_base() + off)
    }

    pub(super) fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= self.map.len() && off % 8 == 0);
        // SAFETY: as in atomic_u32.
        unsafe { &*(self.map.ptr().add(off) as *const AtomicU64) }
    }

    pub(super) fn closed(&self) -> &AtomicU32 {
        self.atomic_u32(28)
    }

    /// The first peer this rank found gone, plus one (0: none). Peers that see this rank
    /// abort or destroy read it, so their error names the rank that was lost first.
    pub(super) fn first_lost(&self) -> &AtomicU32 {
        self.atomic_u32(3 * LINE)
    }

    pub(super) fn doorbell(&self) -> &AtomicU32 {
        self.atomic_u32(LINE)
    }

    /// Where this rank closed as `Closing::Disagreed`: the tag it expected and the tag it
    /// received (0 and 0 until then), written before the close, read by peers after it.
    pub(super) fn disagreed(&self) -> (&AtomicU64, &AtomicU64) {
        (
            self.atomic_u64(3 * LINE + 8),
            self.atomic_u64(3 * LINE + 16),
        )
    }

    /// The CPU the owner's progress loop last ran on, plus one (0: never said), in the low 30
    /// bits; in the top two what it does (`topo::Activity`: 0 polling, 1 sleeping, 2 outside).
    /// Written only when it changes, so the line stays shared between the owner and the peers
    /// that read it.
    pub(super) fn running_on(&self) -> &AtomicU32 {
        self.atomic_u32(3 * LINE + 64)
    }

    /// Counts up while the owner's progress loop runs (see `Presence::heartbeat`); in the line
    /// of `running_on`, which readers fetch anyway.
    pub(super) fn beat(&self) -> &AtomicU32 {
        self.atomic_u32(3 * LINE + 68)
    }

    pub(super) fn sleepers(&self) -> &AtomicU32 {
        self.atomic_u32(2 * LINE)
    }

    pub(super) fn head(&self, sender: usize) -> &AtomicU64 {
        self.atomic_u64(CTL_BASE + sender * CTL_STRIDE)
    }

    pub(super) fn tail(&self, sender: usize) -> &AtomicU64 {
        self.atomic_u64(CTL_BASE + sender * CTL_STRIDE + LINE)
    }

    pub(super) fn pull_ok(&self, sender: usize) -> &AtomicU32 {
        self.atomic_u32(CTL_BASE + sender * CTL_STRIDE + 2 * LINE)
    }

    /// How `sender` ended, as it wrote into this (the receiver's) segment when it closed its
    /// end of their link (`ShmPeer::note_end`): its `Closing` code (0: not yet), the first
    /// rank it lost plus one, and the tags of a disagreement. In the line of `pull_ok`, so
    /// that a receiver that maps the sender's segment only after the sender freed it still
    /// learns how the sender ended.
    pub(super) fn end_note(
        &self,
        sender: usize,
    ) -> (&AtomicU32, &AtomicU32, &AtomicU64, &AtomicU64) {
        let at = CTL_BASE + sender * CTL_STRIDE + 2 * LINE;
        (
            self.atomic_u32(at + 8),
            self.atomic_u32(at + 12),
            self.atomic_u64(at + 16),
            self.atomic_u64(at + 24),
        )
    }

    /// The message number the slot holds now: message k is in its slot once this reads k + 1.
    pub(super) fn slot_number(&self, sender: usize, seq: u64) -> &AtomicU64 {
        // SAFETY: the slot start is in bounds (checked by slot()) and 8-aligned (the slot area
        // and strides are multiples of 64); this word is only ever accessed atomically.
        unsafe { &*(self.slot(sender, seq) as *const AtomicU64) }
    }

    /// Faults in the pages of `sender`'s FIFO in this mapping (MADV_POPULATE_WRITE, Linux
    /// 5.14+; nothing on older kernels), so that the first messages through the slots do not
    /// pay a page fault per 4 KiB in each process: about 0.4 ms for the default 1 MiB FIFO,
    /// which a short run that had pulled everything before showed as 1.2-1.3x slower in-place
    /// all-to-all calls for its first hundred calls.
    pub(super) fn prefault_fifo(&self, sender: usize) {
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
    pub(super) fn read_slot_numbers(&self, sender: usize) {
        for seq in 0..self.geo.nslots as u64 {
            std::hint::black_box(self.slot_number(sender, seq).load(Ordering::Relaxed));
        }
    }

    /// Asks the CPU to bring the first two lines of `sender`'s slot `seq` (its number, header
    /// and first data) into this core's cache; nothing on other architectures.
    #[inline]
    pub(super) fn prefetch_slot(&self, sender: usize, seq: u64) {
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

    pub(super) fn slot(&self, sender: usize, seq: u64) -> *mut u8 {
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
    pub(super) fn mark_closed(&self, how: Closing, lost: Option<usize>) {
        if let Some(l) = lost {
            self.note_lost(l);
        }
        // A failure or an abort stays one when the communicator is destroyed afterwards.
        self.closed().fetch_max(how as u32, Ordering::SeqCst);
    }

    /// The first rank this rank lost, for peers that later see it close.
    pub(super) fn note_lost(&self, rank: usize) {
        let _ = self.first_lost().compare_exchange(
            0,
            rank as u32 + 1,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    pub(super) fn base_addr(&self) -> usize {
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
            sys::futex_wake_all(self.doorbell());
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
        sys::futex_wait(self.doorbell(), seen, timeout);
        self.sleepers().fetch_sub(1, Ordering::SeqCst);
    }
}
