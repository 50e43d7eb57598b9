//! A communicator's window control segment: one per rank, in shared memory that the rank's
//! peers on the host map. It holds what one-sided operations change at the target besides the
//! data: NCCL's signal counters (one per sending rank), the doorbell a waiting rank sleeps on,
//! the locks that serialise atomics on window memory that peers cannot reach with loads and
//! stores, and one slot per window with its signal pads (one word per channel and peer).

use crate::error::Result;
use crate::sys::{self, Mapping};
use crate::transport::Doorbell;
use crate::wait::FutexBell;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Windows one communicator may have registered at once (per rank).
pub(super) const MAX_WINDOWS: usize = 256;

const BELL: usize = 0;
const SLEEPERS: usize = 4;
const COUNTERS: usize = 64;
/// Atomics locks, one per cache line, each holding its holder's pid (0: free). A word's lock
/// is chosen by the word's address in the target's memory, not by the window: two windows
/// over the same memory serialise their atomics on a word with one lock (with a lock per
/// window, fetch-adds through two of them lost a third of their updates).
const LOCKS: usize = 64;
/// In a window's slot: the handle of the window that now owns the slot (0: none), then the
/// signal pads on the next cache line.
const SLOT_LIVE: usize = 0;
const SLOT_PADS: usize = 64;

fn locks_at(nranks: usize) -> usize {
    (COUNTERS + 8 * nranks).next_multiple_of(64)
}

/// When a wait for an atomics lock gives up: past `deadline`, or once `abort` is set.
#[derive(Clone, Copy, Default)]
pub(crate) struct Stop<'a> {
    pub deadline: Option<Instant>,
    pub abort: Option<&'a AtomicBool>,
}

/// The lock (of `LOCKS`) that serialises atomics on the 8-byte word at `addr`.
fn lock_of(addr: usize) -> usize {
    ((addr as u64 >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % LOCKS
}

pub(crate) struct Ctl {
    map: Mapping,
    nranks: usize,
    channels: usize,
}

fn slots_at(nranks: usize) -> usize {
    (locks_at(nranks) + 64 * LOCKS).next_multiple_of(4096)
}

fn slot_bytes(nranks: usize, channels: usize) -> usize {
    (SLOT_PADS + 4 * channels * nranks).next_multiple_of(64)
}

impl Ctl {
    /// A fresh, zeroed control segment and its descriptor (to share with the peers).
    pub(crate) fn create(nranks: usize, channels: usize) -> Result<(Ctl, OwnedFd)> {
        let len = slots_at(nranks) + MAX_WINDOWS * slot_bytes(nranks, channels);
        let fd = sys::memfd("comm-window-ctl", len)?;
        let ctl = Ctl::open(&fd, nranks, channels)?;
        Ok((ctl, fd))
    }

    /// Maps a peer's control segment.
    pub(crate) fn open(fd: &OwnedFd, nranks: usize, channels: usize) -> Result<Ctl> {
        let len = slots_at(nranks) + MAX_WINDOWS * slot_bytes(nranks, channels);
        Ok(Ctl {
            map: Mapping::map(fd.as_raw_fd(), len)?,
            nranks,
            channels,
        })
    }

    #[inline]
    fn word32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= self.map.len() && off % 4 == 0);
        // SAFETY: the offset is inside the mapping and 4-byte aligned (the mapping is page
        // aligned); the mapping lives as long as self, and every access to it is atomic.
        unsafe { &*(self.map.ptr().add(off) as *const AtomicU32) }
    }

    #[inline]
    fn word64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= self.map.len() && off % 8 == 0);
        // SAFETY: as in word32, with 8-byte alignment.
        unsafe { &*(self.map.ptr().add(off) as *const AtomicU64) }
    }

    /// How many NCCL signals rank `from` has sent this rank.
    #[inline]
    pub(crate) fn counter(&self, from: usize) -> &AtomicU64 {
        self.word64(COUNTERS + 8 * from)
    }

    fn slot(&self, slot: usize) -> usize {
        slots_at(self.nranks) + slot * slot_bytes(self.nranks, self.channels)
    }

    /// The signal pad word of window slot `slot` for `channel` and `peer`.
    pub(crate) fn pad(&self, slot: usize, channel: usize, peer: usize) -> &AtomicU32 {
        self.word32(self.pad_offset(slot, channel, peer))
    }

    /// Where the pad word of `slot`, `channel` and `peer` lies from the segment's start (the
    /// same in every rank's segment of a communicator).
    pub(crate) fn pad_offset(&self, slot: usize, channel: usize, peer: usize) -> usize {
        self.slot(slot) + SLOT_PADS + 4 * (channel * self.nranks + peer)
    }

    /// The segment's start and length, for registering it with an RDMA device.
    pub(crate) fn region(&self) -> (*mut u8, usize) {
        (self.map.ptr(), self.map.len())
    }

    /// The signal pads of window slot `slot`: `channels * nranks` words, as PyTorch lays them out.
    pub(crate) fn pads_ptr(&self, slot: usize) -> *mut u8 {
        // SAFETY: the slot lies inside the mapping.
        unsafe { self.map.ptr().add(self.slot(slot) + SLOT_PADS) }
    }

    /// The handle of the window registered in slot `slot` of this rank, 0 when none is: a peer
    /// checks it before reaching into the window, so that an operation into memory the target
    /// has deregistered (and perhaps freed and reused) is refused instead of corrupting it.
    #[inline]
    pub(crate) fn live(&self, slot: usize) -> &AtomicU64 {
        self.word64(self.slot(slot) + SLOT_LIVE)
    }

    /// Clears a window slot for a new window.
    pub(crate) fn reset_slot(&self, slot: usize) {
        self.live(slot).store(0, Ordering::SeqCst);
        for ch in 0..self.channels {
            for p in 0..self.nranks {
                self.pad(slot, ch, p).store(0, Ordering::SeqCst);
            }
        }
    }

    /// Runs `f` holding the atomics lock of the word at `addr` (its address in this rank's
    /// memory). The lock word holds the holder's pid: a waiter that finds the holder's process
    /// gone takes the lock over (the holder died between its read and its write of one word,
    /// or after both); one that waits past `stop.deadline` gives up with ncclTimeout, and one
    /// whose communicator is aborted (`stop.abort`) with ncclInvalidUsage.
    pub(crate) fn locked<T>(&self, addr: usize, stop: Stop, f: impl FnOnce() -> T) -> Result<T> {
        let Stop { deadline, abort } = stop;
        let word = self.word32(locks_at(self.nranks) + 64 * lock_of(addr));
        let me = std::process::id().max(1);
        let mut spins = 0u32;
        let mut seen = 0u32;
        loop {
            match word.compare_exchange_weak(seen, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => break,
                Err(0) => seen = 0,
                Err(holder) => {
                    seen = 0;
                    spins += 1;
                    if spins < 64 {
                        std::hint::spin_loop();
                        continue;
                    }
                    std::thread::yield_now();
                    if spins % 256 == 0 {
                        if !sys::ProcessWatch::new(holder).alive() {
                            crate::warn!(
                                "process {holder} died holding a window's atomics lock; taking it over"
                            );
                            seen = holder;
                        } else if deadline.is_some_and(|d| Instant::now() > d) {
                            return crate::timeout_err!(
                                "timed out waiting for a window's atomics lock, held by process {holder}"
                            );
                        } else if abort.is_some_and(|a| a.load(Ordering::SeqCst)) {
                            return crate::invalid_usage!(
                                "the communicator was aborted while waiting for a window's atomics lock, held by process {holder}"
                            );
                        }
                    }
                }
            }
        }
        let r = f();
        word.store(0, Ordering::Release);
        Ok(r)
    }

    /// This rank's doorbell: the bell word and the count of its sleepers, in this segment, so
    /// that the peers on the host ring it.
    #[inline]
    fn bell(&self) -> FutexBell<'_> {
        FutexBell {
            bell: self.word32(BELL),
            sleepers: self.word32(SLEEPERS),
        }
    }

    /// Wakes this rank's waiters after a signal or a pad changed. Callers change the word a
    /// waiter looks at with a SeqCst store or read-modify-write first (then no fence is
    /// needed, see `FutexBell::ring_after_seqcst`); the `Doorbell` ring is for any other.
    #[inline]
    pub(crate) fn ring(&self) {
        self.bell().ring_after_seqcst();
    }
}

/// The control segment's bell is the doorbell window waits sleep on (`wait::nap_on`).
impl Doorbell for Ctl {
    fn ring(&self) {
        self.bell().ring();
    }

    fn prepare_sleep(&self) -> u32 {
        self.bell().prepare_sleep()
    }

    fn cancel_sleep(&self) {
        self.bell().cancel_sleep();
    }

    fn sleep(&self, seen: u32, timeout: Duration) {
        self.bell().sleep(seen, timeout);
    }
}
