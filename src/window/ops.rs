//! One-sided operations on a window: put, get, atomics and flush, with the checks of their
//! arguments, each handed once to the medium that reaches the peer's part (`super::reach`);
//! and the direct puts of the short way.

use super::ctl::{Ctl, Stop};
use super::reach::direct::store_direct;
use super::reach::{self, Atomic, PeerWindow, Target};
use super::registry::{lookup, window_by_handle};
use super::signals::signal_ctl;
use super::{deadline_of, CommWindows, Members, PeerWin, Reach, Window, WIN_COLL_SYMMETRIC};
use crate::cuda::{MemKind, Stream};
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(super) fn peer_index(c: &Members, peer: i32) -> Result<usize> {
    match usize::try_from(peer) {
        Ok(p) if p < c.nranks => Ok(p),
        _ => crate::invalid_arg!(
            "peer {peer} is out of range for a communicator of {} ranks",
            c.nranks
        ),
    }
}

/// Checks a peer number: the rank it names.
pub(crate) fn check_peer(c: &Members, peer: i32) -> Result<usize> {
    peer_index(c, peer)
}

/// Checks an access of `len` bytes at `off` of `peer`'s part of window `handle`.
/// Returns the window and the peer's rank.
pub(super) fn check_access(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    len: usize,
) -> Result<(Arc<Window>, usize)> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    check_range(&w.peers[peer], off, len, peer)?;
    Ok((w, peer))
}

pub(crate) fn check_range(p: &PeerWin, off: usize, len: usize, peer: usize) -> Result<()> {
    match off.checked_add(len) {
        Some(end) if end <= p.len => Ok(()),
        _ => crate::invalid_arg!(
            "offset {off} + {len} bytes is past the end of rank {peer}'s window ({} bytes)",
            p.len
        ),
    }
}

/// A local buffer in device memory goes only with a window part in device memory (the copy
/// is the GPU's) or one reached by RDMA (GPUDirect); host buffers go with either.
pub(super) fn check_local(buf: usize, name: &str, w: &Window, peer: usize) -> Result<()> {
    if let MemKind::Device(d) = crate::cuda::classify(buf as *const std::ffi::c_void) {
        if !w.peers[peer].data.takes_device_buffers() {
            return crate::invalid_usage!(
                "{name} is memory of GPU {d}, but rank {peer}'s part of the window is host memory: use a host buffer, or register the window on device memory"
            );
        }
    }
    Ok(())
}

/// Refuses an operation into `peer`'s part of `w` once the peer has deregistered it (peers
/// on this host; across hosts the target's server refuses it). Deregistration is local, as in
/// NCCL, so this catches a program that deregisters too early instead of letting a put land
/// in memory the peer may have freed and reused.
pub(super) fn check_live(cw: &CommWindows, w: &Window, peer: usize) -> Result<()> {
    let p = &w.peers[peer];
    match &cw.ctls[peer] {
        Some(ctl) if peer != cw.rank && ctl.live(p.slot).load(Ordering::Acquire) != p.handle => {
            crate::invalid_usage!(
                "rank {peer} has deregistered its part of window {:#x} (or destroyed or aborted its communicator); one-sided operations into it are refused (ncclCommWindowDeregister is local: every rank must be done with a window before any rank deregisters it)",
                w.handle
            )
        }
        _ => Ok(()),
    }
}

/// ncclPutSignal, checked when it is called (the put itself may wait for its group's end):
/// the window, the peer, the range, the local buffer, and the symmetric registration NCCL
/// requires for one-sided operations.
pub(crate) struct CheckedPut {
    w: Arc<Window>,
    peer: usize,
    off: usize,
    src: usize,
    len: usize,
    /// The stream the copy and its signal go on: into device memory they are queued there,
    /// as in NCCL; from device memory over RDMA the put waits for the stream first.
    on: Option<Stream>,
}

/// Checks an ncclPutSignal of `len` bytes from `src` into `peer`'s part of window `handle`
/// at `off`, on `stream`.
pub(crate) fn check_put_signal(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    src: usize,
    len: usize,
    stream: Stream,
) -> Result<CheckedPut> {
    let (w, peer) = check_access(c, handle, peer, off, len)?;
    check_local(src, "localbuff", &w, peer)?;
    let on = (w.is_device(peer)
        || matches!(
            crate::cuda::classify(src as *const std::ffi::c_void),
            MemKind::Device(_)
        ))
    .then_some(stream);
    if w.flags & WIN_COLL_SYMMETRIC == 0 {
        return crate::invalid_arg!(
            "peerWin was registered without NCCL_WIN_COLL_SYMMETRIC, which NCCL requires for one-sided operations"
        );
    }
    Ok(CheckedPut {
        w,
        peer,
        off,
        src,
        len,
        on,
    })
}

impl CheckedPut {
    /// Puts the bytes and counts one signal at the peer.
    ///
    /// # Safety
    /// The source buffer must be valid for the put's bytes of reads (on a stream: until the
    /// stream has done the copy).
    pub(crate) unsafe fn run(&self) -> Result<()> {
        // SAFETY: the peer and the range were checked by `check_put_signal`; the source is
        // this function's caller's.
        unsafe {
            put_checked(
                &self.w,
                self.peer,
                self.off,
                self.src as *const u8,
                self.len,
                true,
                self.on,
            )
        }
    }
}

/// Puts `len` bytes from `src` at `off` of `peer`'s part of window `handle`, then (with
/// `signal`) counts one NCCL signal at the peer, seen only after the data.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads.
pub(crate) unsafe fn put(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    src: *const u8,
    len: usize,
    signal: bool,
) -> Result<()> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    check_range(&w.peers[peer], off, len, peer)?;
    check_local(src as usize, "localbuff", &w, peer)?;
    // SAFETY: `peer` and the range were checked just above, as `put_checked` requires; `src`
    // holds `len` bytes (this function's caller), and without a stream the copy is done on
    // return.
    unsafe { put_checked(&w, peer, off, src, len, signal, None) }
}

/// [`put`] on a window already looked up, with `peer` and the range checked. Into device
/// memory with a `stream` (ncclPutSignal), the copy and then the signal are queued on it: the
/// signal is counted once the copy is done. Over RDMA from device memory with a `stream`, the
/// put waits for the stream first. Otherwise the put is complete on return.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads (until the stream reaches the copy, with one).
pub(super) unsafe fn put_checked(
    w: &Window,
    peer: usize,
    off: usize,
    src: *const u8,
    len: usize,
    signal: bool,
    stream: Option<Stream>,
) -> Result<()> {
    check_live(&w.cw, w, peer)?;
    let t = Target {
        w,
        peer,
        stop: Stop::default(),
        link: None,
    };
    // SAFETY: as this function's.
    unsafe { w.peers[peer].data.put(&t, off, src, len, signal, stream) }
}

/// What ncclPutSignal's short way (see `ffi::lane`) needs of a window, worked out once: for
/// each peer whose part is host memory this process maps, where it is, how long, the word
/// that says it is still registered, and the control segment its signals count in. Puts from
/// a host buffer into such a part, with the window symmetric and the range inside it, go the
/// short way; anything else, and a part its rank deregistered, is left to the full path,
/// which decides and reports.
pub(crate) struct DirectPuts {
    pub(super) rank: usize,
    pub(super) peers: Vec<Option<DirectPeer>>,
    /// Holds every mapping the pointers below point into.
    pub(super) _w: Arc<Window>,
}

pub(super) struct DirectPeer {
    pub(super) base: *mut u8,
    pub(super) len: usize,
    /// The peer's live word for this window and the handle it holds while the part is
    /// registered (None for this rank's own part).
    pub(super) live: Option<(*const AtomicU64, u64)>,
    pub(super) ctl: *const Ctl,
}

impl DirectPuts {
    pub(crate) fn new(w: Arc<Window>) -> DirectPuts {
        let cw = &w.cw;
        let symmetric = w.flags & WIN_COLL_SYMMETRIC != 0;
        let peers = (0..w.peers.len())
            .map(|r| {
                let p = &w.peers[r];
                match (&p.data, &cw.ctls[r]) {
                    (&Reach::Direct(base), Some(ctl)) if symmetric => Some(DirectPeer {
                        base: base as *mut u8,
                        len: p.len,
                        live: (r != cw.rank).then(|| (ctl.live(p.slot) as *const _, p.handle)),
                        ctl: &**ctl,
                    }),
                    _ => None,
                }
            })
            .collect();
        DirectPuts {
            rank: cw.rank,
            peers,
            _w: w,
        }
    }

    /// Puts `len` bytes from `src` at `off` of `peer`'s part and signals it: true once done;
    /// false, having done nothing, where the full path must take the call.
    ///
    /// # Safety
    /// As `put`: `src` must be valid for `len` bytes of reads.
    pub(crate) unsafe fn put_signal(
        &self,
        peer: usize,
        off: usize,
        src: *const u8,
        len: usize,
    ) -> bool {
        let Some(Some(d)) = self.peers.get(peer) else {
            return false;
        };
        // The full path's checks: the range (check_range), a host source buffer for a host
        // part (check_local), the part still registered (check_live).
        let plain = off.checked_add(len).is_some_and(|end| end <= d.len)
            && !matches!(
                crate::cuda::classify(src.cast()),
                crate::cuda::MemKind::Device(_)
            )
            && d.live.is_none_or(|(word, handle)| {
                // SAFETY: the live word sits in the peer's control block, which the window
                // `_w` (held by `self`) keeps mapped.
                unsafe { &*word }.load(Ordering::Acquire) == handle
            });
        if plain {
            // SAFETY: inside the peer's part (checked), mapped here; src as this function's.
            unsafe { store_direct(d.base.add(off), src, len) };
            // SAFETY: `ctl` points into the window's control blocks, which `_w` keeps alive.
            signal_ctl(unsafe { &*d.ctl }, self.rank);
        }
        plain
    }
}

/// Reads `len` bytes at `off` of `peer`'s part of window `handle` into `dst`.
///
/// # Safety
/// `dst` must be valid for `len` bytes of writes.
pub(crate) unsafe fn get(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    dst: *mut u8,
    len: usize,
) -> Result<()> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    let p = &w.peers[peer];
    check_range(p, off, len, peer)?;
    check_live(&w.cw, &w, peer)?;
    check_local(dst as usize, "localbuff", &w, peer)?;
    if len == 0 {
        return Ok(());
    }
    let t = Target {
        w: &w,
        peer,
        stop: Stop::default(),
        link: None,
    };
    // SAFETY: as this function's.
    unsafe { p.data.get(&t, off, dst, len) }
}

/// An 8-byte atomic on `peer`'s part of `w` done by this process (the peer is reached
/// directly or with CMA): fetch-add of `val`, or with `cas` a compare-and-swap to `val`.
/// Returns the old value. `stop` ends a wait for the lock in the target's control segment
/// (`_ctl`, which the part's medium finds itself). The network server applies its peers'
/// atomics on this rank's own part with it.
pub(crate) fn atomic_at(
    w: &Window,
    peer: usize,
    off: usize,
    cas: Option<u64>,
    val: u64,
    _ctl: &Ctl,
    stop: Stop,
) -> Result<u64> {
    let t = Target {
        w,
        peer,
        stop,
        link: None,
    };
    w.peers[peer].data.atomic(&t, off, Atomic::of(cas, val))
}

/// 8-byte fetch-add (`cas` None) or compare-and-swap on `peer`'s window at `off`; the old value.
pub(crate) fn atomic(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    cas: Option<u64>,
    val: u64,
) -> Result<u64> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    let p = &w.peers[peer];
    check_range(p, off, 8, peer)?;
    if (p.addr + off) % 8 != 0 {
        return crate::invalid_arg!(
            "atomics need an 8-byte aligned target; offset {off} of rank {peer}'s window is at address {:#x}",
            p.addr + off
        );
    }
    check_live(&w.cw, &w, peer)?;
    let t = Target {
        w: &w,
        peer,
        stop: Stop {
            deadline: deadline_of(c.timeout),
            abort: Some(c.abort),
        },
        link: (peer != c.rank).then(|| &*c.links[peer]),
    };
    let op = Atomic::of(cas, val);
    match (&w.cw.rdma, p.rkey) {
        // Where windows use InfiniBand, every atomic goes through the target's HCA, this
        // host's ranks and this rank included (see the module's notes).
        (Some(_), Some(rkey)) => reach::Rdma { addr: p.addr, rkey }.atomic(&t, off, op),
        _ => p.data.atomic(&t, off, op),
    }
}

/// Returns once every earlier put from this rank to `peer` (every peer when None) has landed.
pub(crate) fn flush(c: &Members, handle: usize, peer: Option<i32>) -> Result<()> {
    let w = lookup(c, handle)?;
    let peers = match peer {
        Some(p) => vec![peer_index(c, p)?],
        None => (0..c.nranks).collect(),
    };
    std::sync::atomic::fence(Ordering::SeqCst);
    if let Some(dev) = &w.device {
        // Puts into device memory queued on streams (ncclPutSignal) are done once the device is.
        crate::cuda::synchronize(dev)?;
    }
    let stop = Stop {
        deadline: deadline_of(c.timeout),
        abort: None,
    };
    for peer in peers {
        let t = Target {
            w: &w,
            peer,
            stop,
            link: None,
        };
        w.peers[peer].data.flush(&t)?;
    }
    Ok(())
}

/// The address at which this rank reaches `peer`'s window with loads and stores, if it can.
pub(crate) fn peer_ptr(c: &Members, handle: usize, peer: i32) -> Result<Option<usize>> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    check_live(&w.cw, &w, peer)?;
    Ok(w.peers[peer].data.address())
}

/// The bytes of `peer`'s part of window `handle` (sizes may differ between ranks).
pub(crate) fn peer_size(c: &Members, handle: usize, peer: i32) -> Result<usize> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    Ok(w.peers[peer].len)
}

/// ncclGetPeerDevicePointer: the device address at which this rank's GPU reaches `offset` of
/// `peer`'s part of window `handle` (a device-memory window; NCCL takes no communicator here).
pub(crate) fn peer_device_ptr(handle: usize, offset: usize, peer: i32) -> Result<usize> {
    let Some(w) = window_by_handle(handle) else {
        return crate::invalid_arg!(
            "window {handle:#x} is not a live window (never registered, or already deregistered)"
        );
    };
    let peer = match usize::try_from(peer) {
        Ok(p) if p < w.peers.len() => p,
        _ => {
            return crate::invalid_arg!(
                "peer {peer} is out of range for a window of {} ranks",
                w.peers.len()
            )
        }
    };
    check_range(&w.peers[peer], offset, 0, peer)?;
    check_live(&w.cw, &w, peer)?;
    match &w.peers[peer].data {
        Reach::Device(d) => Ok(d.base + offset),
        _ => crate::invalid_usage!(
            "rank {peer}'s part of window {handle:#x} is host memory, which has no device pointer (commWinPeerPtr gives host addresses)"
        ),
    }
}
