//! The ways this rank reaches a peer's part of a window, one implementation of [`PeerWindow`]
//! per medium (as MSCCL++ has one connection class per medium):
//!
//! - [`direct`]: loads, stores and hardware atomics on memory mapped here (this rank, a thread
//!   of this process, or library memory every rank on the host maps);
//! - [`cma`]: another process's ordinary memory, with `process_vm_writev` / `readv`;
//! - [`device`]: device memory this process addresses, copied by the driver;
//! - [`rdma`]: another host's memory through the InfiniBand device (verbs);
//! - [`net`]: another host's memory through active messages over TCP (`super::remote`).
//!
//! [`Reach`] holds one of them per peer part and delegates each operation to it, so an
//! operation decides the medium once. The checks every operation shares (range, liveness,
//! alignment, local buffers) stay with the operations (`super::ops`).

pub(super) mod cma;
pub(super) mod device;
pub(super) mod direct;
pub(super) mod net;
pub(super) mod rdma;

use super::ctl::{Ctl, Stop};
use super::{CommWindows, PeerWin, Window};
use crate::cuda::Stream;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::Link;
pub(super) use cma::Cma;
pub(super) use device::Device;
pub(super) use direct::Direct;
pub(super) use net::Net;
pub(super) use rdma::Rdma;

/// An 8-byte atomic on a window word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Atomic {
    /// Adds (wrapping) and returns the old value.
    FetchAdd(u64),
    /// Stores `new` if the word holds `expect`; returns the old value either way.
    CompareSwap { expect: u64, new: u64 },
}

impl Atomic {
    /// The old value and NCCL's (`cas`, `val`) pair: a compare-and-swap with `cas`.
    pub(crate) fn of(cas: Option<u64>, val: u64) -> Atomic {
        match cas {
            Some(expect) => Atomic::CompareSwap { expect, new: val },
            None => Atomic::FetchAdd(val),
        }
    }

    /// The word's value after the atomic, given its value `old` before.
    #[inline]
    pub(super) fn apply(self, old: u64) -> u64 {
        match self {
            Atomic::FetchAdd(v) => old.wrapping_add(v),
            Atomic::CompareSwap { expect, new } if old == expect => new,
            Atomic::CompareSwap { .. } => old,
        }
    }
}

/// The target of one operation: `peer`'s part of window `w`.
pub(crate) struct Target<'a> {
    pub w: &'a Window,
    pub peer: usize,
    /// When a wait inside an atomic, a flush or a pad update gives up. (Puts and gets over
    /// RDMA take the windows' timeout from their start themselves, so that the direct path
    /// reads no clock.)
    pub stop: Stop<'a>,
    /// The peer's link, to ask whether it is still there before an atomic on a word mapped
    /// here (which outlives its owner: an atomic into a rank that is gone would succeed and
    /// return a value nobody will see change again). None for this rank's own part.
    pub link: Option<&'a dyn Link>,
}

impl Target<'_> {
    #[inline]
    pub(super) fn part(&self) -> &PeerWin {
        &self.w.peers[self.peer]
    }

    #[inline]
    pub(super) fn cw(&self) -> &CommWindows {
        &self.w.cw
    }

    /// The peer's control segment, mapped here (peers on this host).
    pub(super) fn ctl(&self) -> Result<&Ctl> {
        self.w.cw.ctls[self.peer]
            .as_deref()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "no control segment for a local peer"))
    }

    /// Whether the peer is still there (see `link`).
    #[inline]
    pub(super) fn check_alive(&self) -> Result<()> {
        self.link.map_or(Ok(()), |l| l.check_peer())
    }
}

/// How this rank operates on one peer's part of a window. None of the operations needs the
/// target to call the library; each is complete on return unless it says otherwise. The
/// caller has checked the range (and the alignment of atomics) and that the part is still
/// registered.
pub(crate) trait PeerWindow {
    /// Puts `len` bytes from `src` at `off`; with `signal`, then counts one NCCL signal at
    /// the peer, seen only after the data. Only device memory takes a `stream`: the copy and
    /// the signal are then queued on it.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes of reads (until the stream reaches the copy, with
    /// one).
    unsafe fn put(
        &self,
        t: &Target,
        off: usize,
        src: *const u8,
        len: usize,
        signal: bool,
        stream: Option<Stream>,
    ) -> Result<()>;

    /// Reads `len` bytes at `off` into `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes.
    unsafe fn get(&self, t: &Target, off: usize, dst: *mut u8, len: usize) -> Result<()>;

    /// An 8-byte atomic at `off`; the word's old value.
    fn atomic(&self, t: &Target, off: usize, op: Atomic) -> Result<u64>;

    /// One NCCL signal to the peer, counted after every earlier put of this rank to it.
    fn signal(&self, t: &Target) -> Result<()>;

    /// Sets this rank's signal-pad word for `channel` at the peer from 0 to 1: false, having
    /// changed nothing, while it is still 1 from the previous signal.
    fn set_pad(&self, t: &Target, channel: usize) -> Result<bool>;

    /// Returns once every earlier put of this rank to the peer has landed.
    fn flush(&self, t: &Target) -> Result<()>;
}

/// How this rank reaches one rank's part of a window.
pub(crate) enum Reach {
    /// Loads and stores at this address. (A bare address: the network server in `remote`
    /// reads this rank's own part through it.)
    Direct(usize),
    /// process_vm_writev / readv into another process.
    Cma(Cma),
    /// Active messages to the target.
    Net(Net),
    /// RDMA into the target's memory.
    Rdma(Rdma),
    /// Device memory at an address of this process, copied by the driver.
    Device(Device),
}

/// Delegates `$call` to the implementation `Reach` holds: the one place an operation
/// chooses its medium.
macro_rules! dispatch {
    ($reach:expr, $r:ident => $call:expr) => {
        match $reach {
            Reach::Direct(base) => {
                let $r = &Direct(*base);
                $call
            }
            Reach::Cma($r) => $call,
            Reach::Net($r) => $call,
            Reach::Rdma($r) => $call,
            Reach::Device($r) => $call,
        }
    };
}

impl PeerWindow for Reach {
    #[inline]
    unsafe fn put(
        &self,
        t: &Target,
        off: usize,
        src: *const u8,
        len: usize,
        signal: bool,
        stream: Option<Stream>,
    ) -> Result<()> {
        // SAFETY: as this function's.
        dispatch!(self, r => unsafe { r.put(t, off, src, len, signal, stream) })
    }

    #[inline]
    unsafe fn get(&self, t: &Target, off: usize, dst: *mut u8, len: usize) -> Result<()> {
        // SAFETY: as this function's.
        dispatch!(self, r => unsafe { r.get(t, off, dst, len) })
    }

    #[inline]
    fn atomic(&self, t: &Target, off: usize, op: Atomic) -> Result<u64> {
        dispatch!(self, r => r.atomic(t, off, op))
    }

    #[inline]
    fn signal(&self, t: &Target) -> Result<()> {
        dispatch!(self, r => r.signal(t))
    }

    #[inline]
    fn set_pad(&self, t: &Target, channel: usize) -> Result<bool> {
        dispatch!(self, r => r.set_pad(t, channel))
    }

    #[inline]
    fn flush(&self, t: &Target) -> Result<()> {
        dispatch!(self, r => r.flush(t))
    }
}

impl Reach {
    /// The medium's name, for logs.
    pub(super) fn name(&self) -> &'static str {
        match self {
            Reach::Direct(_) => "direct",
            Reach::Cma(_) => "cma",
            Reach::Net(_) => "net",
            Reach::Rdma(_) => "rdma",
            Reach::Device(_) => "device",
        }
    }

    /// The address at which this process reaches the part with loads and stores (host memory
    /// mapped here, or device memory it addresses).
    pub(super) fn address(&self) -> Option<usize> {
        match self {
            Reach::Direct(a) => Some(*a),
            Reach::Device(d) => Some(d.base),
            _ => None,
        }
    }

    /// Whether the part is device memory this process addresses.
    pub(super) fn is_device(&self) -> bool {
        matches!(self, Reach::Device(_))
    }

    /// Whether a local buffer in device memory may go with this part: the GPU copies into a
    /// device part, and the HCA reads and writes device memory by GPUDirect RDMA.
    pub(super) fn takes_device_buffers(&self) -> bool {
        matches!(self, Reach::Device(_) | Reach::Rdma(_))
    }
}

/// An atomic on a word of a peer on this host, done by this process under the lock of the
/// word in the peer's control segment: `read` gives the old value, `write` stores the new one
/// where it differs. The media that reach memory of this host take it where the hardware
/// cannot make the atomic one instruction.
pub(super) fn locked_atomic(
    t: &Target,
    off: usize,
    op: Atomic,
    read: impl FnOnce() -> Result<u64>,
    write: impl FnOnce(u64) -> Result<()>,
) -> Result<u64> {
    let ctl = t.ctl()?;
    t.check_alive()?;
    // The lock of the word where it lies in the target's memory, whichever window reaches it.
    let key = t.part().addr + off;
    ctl.locked(key, t.stop, || {
        let old = read()?;
        crate::fault::point("window_atomic_locked");
        let new = op.apply(old);
        if new != old {
            write(new)?;
        }
        Ok(old)
    })?
}

/// One NCCL signal to a peer on this host: its counter in its control segment, mapped here.
pub(super) fn signal_mapped(t: &Target) -> Result<()> {
    super::signals::signal_ctl(t.ctl()?, t.cw().rank);
    Ok(())
}

/// Sets this rank's pad word for `channel` in a peer's control segment mapped here.
pub(super) fn set_pad_mapped(t: &Target, channel: usize) -> Result<bool> {
    let ctl = t.ctl()?;
    let set = ctl
        .pad(t.part().slot, channel, t.cw().rank)
        .compare_exchange(
            0,
            1,
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
        )
        .is_ok();
    if set {
        ctl.ring();
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::Atomic;

    #[test]
    fn atomics_compute_the_new_word_from_the_old() {
        assert_eq!(Atomic::of(None, 5).apply(u64::MAX - 1), 3);
        let cas = Atomic::of(Some(7), 9);
        assert_eq!(cas, Atomic::CompareSwap { expect: 7, new: 9 });
        assert_eq!(cas.apply(7), 9);
        assert_eq!(cas.apply(8), 8);
    }
}
