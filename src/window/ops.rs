//! One-sided operations on a window: put, get, atomics and flush, per reach kind, with the
//! checks of their arguments; and the direct puts of the short way.

use super::ctl::{Ctl, Stop};
use super::registry::{lookup, window_by_handle};
use super::remote::Frame;
use super::signals::{signal_ctl, signal_on, signal_to};
use super::{
    deadline_of, gdr, remote, CommWindows, Members, PeerWin, Reach, Window, WIN_COLL_SYMMETRIC,
};
use crate::cuda::{Device, MemKind, Stream};
use crate::error::{Error, ErrorKind, Result};
use crate::sys;
use crate::transport::net::ib::onesided;
use crate::transport::net::ib::verbs::Remote;
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
pub(crate) fn check_access(
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
pub(crate) fn check_local(buf: usize, name: &str, w: &Window, peer: usize) -> Result<()> {
    if let MemKind::Device(d) = crate::cuda::classify(buf as *const std::ffi::c_void) {
        if !w.is_device(peer) && !matches!(w.peers[peer].data, Reach::Rdma { .. }) {
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

pub(super) fn cma_error(peer: usize, what: &str, e: std::io::Error) -> Error {
    let kind = if e.raw_os_error() == Some(libc::ESRCH) {
        ErrorKind::Remote
    } else {
        ErrorKind::System
    };
    Error::new(kind, format!("{what} rank {peer}'s window: {e}"))
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
pub(crate) unsafe fn put_checked(
    w: &Window,
    peer: usize,
    off: usize,
    src: *const u8,
    len: usize,
    signal: bool,
    stream: Option<Stream>,
) -> Result<()> {
    let p = &w.peers[peer];
    let cw = &*w.cw;
    check_live(cw, w, peer)?;
    match p.data {
        Reach::Device(base) => {
            let dev = w.device_of()?;
            let (dst, src) = ((base + off) as u64, src as u64);
            if let Some(s) = stream {
                s.copy(dst, src, len)?;
                if signal {
                    signal_on(s, w.cw.clone(), peer)?;
                }
                return Ok(());
            }
            // SAFETY: the destination lies inside the peer's window (checked by the caller),
            // mapped here; the caller guarantees src holds len bytes.
            unsafe { crate::cuda::copy_sync(dev, dst, src, len) }?;
        }
        // SAFETY: the destination lies inside the peer's registered window (checked by the
        // caller), mapped here; the caller guarantees src holds len bytes.
        Reach::Direct(base) => unsafe { store_direct((base + off) as *mut u8, src, len) },
        Reach::Cma { pid, addr } => {
            if len > 0 {
                // SAFETY: the caller guarantees src holds len bytes.
                unsafe { sys::cma_write(pid, src, addr + off, len) }
                    .map_err(|e| cma_error(peer, "writing into", e))?;
            }
        }
        Reach::Rdma { addr, rkey } => {
            let r = cw.rdma(peer)?;
            let to = Remote {
                addr: (addr + off) as u64,
                rkey,
            };
            let from_device = stream.zip(match crate::cuda::classify(src.cast()) {
                MemKind::Device(o) => Some(o),
                MemKind::Host => None,
            });
            if let Some((s, o)) = from_device {
                // A device-memory source (GPUDirect RDMA) written by work queued on the
                // stream: the HCA reads it once that is done, the caller waiting meanwhile, as
                // collectives on device buffers across hosts do.
                if s.capturing() {
                    return crate::invalid_usage!(
                        "a put from device memory to rank {peer} on another host waits for its stream, which a CUDA graph capture cannot record; issue it outside the capture"
                    );
                }
                let dev = Device::get(o)?;
                let _bound = dev.bind()?;
                s.synchronize()?;
            }
            let lkey = gdr::local_key(&r.qps, src as usize, len, "localbuff")?;
            // SAFETY: the caller guarantees src holds len bytes.
            unsafe { r.qps.put(peer, src, len, to, lkey, cw.deadline()) }?;
            if signal {
                // On the same queue pair: counted at the target after the data landed.
                r.qps
                    .notify(peer, onesided::IMM_SIGNAL, r.ctls[peer], cw.deadline())?;
            }
            return Ok(());
        }
        Reach::Net { id } => {
            // SAFETY: the caller guarantees src holds len bytes.
            let payload = unsafe { std::slice::from_raw_parts(src, len) };
            let f = Frame {
                op: remote::OP_PUT,
                flags: if signal { remote::FLAG_SIGNAL } else { 0 },
                win: id,
                off: off as u64,
                len: len as u64,
                ..Default::default()
            };
            cw.net(peer)?.call(peer, &f, payload, false, &mut [])?;
            return Ok(());
        }
    }
    if signal {
        signal_to(cw, peer)?;
    }
    Ok(())
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

/// A put's bytes into a part mapped here. `src` and `dst` may overlap when a rank puts into its
/// own window (a word is read whole before it is written). One word, the common signal
/// payload, goes without a call to memmove.
///
/// # Safety
/// `dst` valid for `len` bytes of writes, `src` for `len` bytes of reads.
#[inline]
pub(super) unsafe fn store_direct(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: as this function's.
    unsafe {
        if len == 8 {
            dst.cast::<u64>()
                .write_unaligned(src.cast::<u64>().read_unaligned());
        } else if len > 0 {
            std::ptr::copy(src, dst, len);
        }
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
    match p.data {
        Reach::Device(base) => {
            // SAFETY: the source lies inside the peer's window (checked above); the caller
            // guarantees dst holds len bytes.
            unsafe { crate::cuda::copy_sync(w.device_of()?, dst as u64, (base + off) as u64, len) }?
        }
        // SAFETY: the source lies inside the peer's window; the caller guarantees dst holds len bytes.
        Reach::Direct(base) => unsafe { std::ptr::copy((base + off) as *const u8, dst, len) },
        // SAFETY: as above.
        Reach::Cma { pid, addr } => unsafe { sys::cma_read(pid, dst, addr + off, len) }
            .map_err(|e| cma_error(peer, "reading from", e))?,
        Reach::Rdma { addr, rkey } => {
            let from = Remote {
                addr: (addr + off) as u64,
                rkey,
            };
            let r = w.cw.rdma(peer)?;
            let lkey = gdr::local_key(&r.qps, dst as usize, len, "localbuff")?;
            // SAFETY: the caller guarantees dst holds len bytes.
            unsafe { r.qps.get(peer, dst, len, from, lkey, w.cw.deadline()) }?;
        }
        Reach::Net { id } => {
            let cw = w.cw.clone();
            let f = Frame {
                op: remote::OP_GET,
                win: id,
                off: off as u64,
                len: len as u64,
                ..Default::default()
            };
            // SAFETY: the caller guarantees dst holds len bytes.
            let out = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            cw.net(peer)?.call(peer, &f, &[], true, out)?;
        }
    }
    Ok(())
}

/// An 8-byte atomic on `peer`'s part of `w` done by this process (the peer is reached
/// directly or with CMA): fetch-add of `val`, or with `cas` a compare-and-swap to `val`.
/// Returns the old value. `ctl` is the target's control segment (for the lock); `stop` ends a
/// wait for the lock.
pub(crate) fn atomic_at(
    w: &Window,
    peer: usize,
    off: usize,
    cas: Option<u64>,
    val: u64,
    ctl: &Ctl,
    stop: Stop,
) -> Result<u64> {
    let p = &w.peers[peer];
    // The lock of the word where it lies in the target's memory, whichever window reaches it.
    let key = p.addr + off;
    let new = |old: u64| match cas {
        Some(cmp) if old == cmp => val,
        Some(_) => old,
        None => old.wrapping_add(val),
    };
    match p.data {
        Reach::Direct(base) => {
            // SAFETY: the word lies inside the window (checked by the caller), is 8-byte aligned
            // (checked too) and is only ever accessed atomically by the library.
            let a = unsafe { &*((base + off) as *const AtomicU64) };
            if p.locked {
                ctl.locked(key, stop, || {
                    let old = a.load(Ordering::SeqCst);
                    crate::fault::point("window_atomic_locked");
                    a.store(new(old), Ordering::SeqCst);
                    old
                })
            } else {
                Ok(match cas {
                    Some(cmp) => {
                        match a.compare_exchange(cmp, val, Ordering::SeqCst, Ordering::SeqCst) {
                            Ok(v) | Err(v) => v,
                        }
                    }
                    None => a.fetch_add(val, Ordering::SeqCst),
                })
            }
        }
        Reach::Cma { pid, addr } => ctl.locked(key, stop, || {
            let mut old = [0u8; 8];
            // SAFETY: old is 8 writable bytes.
            unsafe { sys::cma_read(pid, old.as_mut_ptr(), addr + off, 8) }
                .map_err(|e| cma_error(peer, "an atomic on", e))?;
            let old = u64::from_ne_bytes(old);
            crate::fault::point("window_atomic_locked");
            let v = new(old);
            if v != old {
                // SAFETY: v is 8 readable bytes.
                unsafe { sys::cma_write(pid, v.to_ne_bytes().as_ptr(), addr + off, 8) }
                    .map_err(|e| cma_error(peer, "an atomic on", e))?;
            }
            Ok(old)
        })?,
        Reach::Device(base) => {
            let dev = w.device_of()?;
            ctl.locked(key, stop, || {
                let mut old = 0u64;
                let at = (base + off) as u64;
                // SAFETY: `at` is 8 bytes inside the peer's window (its callers checked the
                // range), `old` 8 writable bytes; the lock keeps other atomics off the word.
                unsafe { crate::cuda::copy_sync(dev, &mut old as *mut u64 as u64, at, 8) }?;
                crate::fault::point("window_atomic_locked");
                let v = new(old);
                if v != old {
                    // SAFETY: as above, `v` 8 readable bytes.
                    unsafe { crate::cuda::copy_sync(dev, at, &v as *const u64 as u64, 8) }?;
                }
                Ok(old)
            })?
        }
        Reach::Net { .. } | Reach::Rdma { .. } => {
            crate::internal_err!("atomic on a remote window applied locally")
        }
    }
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
    let cw = w.cw.clone();
    if let (Some(r), Some(rkey)) = (&cw.rdma, p.rkey) {
        // Every atomic through the target's HCA, this host's ranks and this rank included.
        check_live(&cw, &w, peer)?;
        let at = Remote {
            addr: (p.addr + off) as u64,
            rkey,
        };
        return r.qps.atomic(peer, at, cas, val, deadline_of(c.timeout));
    }
    match p.data {
        Reach::Net { id } => {
            let f = Frame {
                op: if cas.is_some() {
                    remote::OP_CAS
                } else {
                    remote::OP_FETCH_ADD
                },
                win: id,
                off: off as u64,
                a: cas.unwrap_or(0),
                b: val,
                ..Default::default()
            };
            cw.net(peer)?.call(peer, &f, &[], true, &mut [])
        }
        _ => {
            let ctl = cw.ctls[peer].as_deref().ok_or_else(|| {
                Error::new(ErrorKind::Internal, "no control segment for a local peer")
            })?;
            check_live(&cw, &w, peer)?;
            // The word is mapped here and outlives its owner: an atomic into a rank that is
            // gone would succeed and return a value nobody will see change again.
            if peer != c.rank {
                c.links[peer].check_peer()?;
            }
            atomic_at(
                &w,
                peer,
                off,
                cas,
                val,
                ctl,
                Stop {
                    deadline: deadline_of(c.timeout),
                    abort: Some(c.abort),
                },
            )
        }
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
    let cw = w.cw.clone();
    for p in peers {
        if let Reach::Rdma { .. } = w.peers[p].data {
            let r = cw.rdma(p)?;
            // Any 8 bytes of the peer serve the read that ends the flush: its control segment.
            r.qps.flush(p, r.ctls[p], deadline_of(c.timeout))?;
        }
        if let Reach::Net { id } = w.peers[p].data {
            let f = Frame {
                op: remote::OP_FLUSH,
                win: id,
                ..Default::default()
            };
            cw.net(p)?.call(p, &f, &[], true, &mut [])?;
        }
    }
    Ok(())
}

/// The address at which this rank reaches `peer`'s window with loads and stores, if it can.
pub(crate) fn peer_ptr(c: &Members, handle: usize, peer: i32) -> Result<Option<usize>> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    check_live(&w.cw, &w, peer)?;
    Ok(match w.peers[peer].data {
        Reach::Direct(a) | Reach::Device(a) => Some(a),
        _ => None,
    })
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
    match w.peers[peer].data {
        Reach::Device(a) => Ok(a + offset),
        _ => crate::invalid_usage!(
            "rank {peer}'s part of window {handle:#x} is host memory, which has no device pointer (commWinPeerPtr gives host addresses)"
        ),
    }
}
