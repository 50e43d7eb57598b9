//! Memory allocation and registration, windows and one-sided operations, and the host side of
//! NCCL's device API. What this build cannot do yet fails with ncclInvalidUsage and says why.
//! The window logic lives in `crate::window`; these shells check arguments the way NCCL 2.30
//! does and queue one-sided operations in groups.

use super::types::*;
use super::{guard, guard_comm, input_slice, out, write_out};
use crate::error::Result;
use crate::group;
use crate::window;
use std::os::raw::{c_int, c_uint, c_void};

/// Device memory from CUDA's virtual memory management API on the calling thread's GPU (NCCL
/// 2.19): suitable for every path of the library, freed with ncclMemFree. Where no GPU is
/// present, host memory shared with the peers on this host (as commMemAllocShared gives).
#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    guard("ncclMemAlloc", || {
        out(ptr, "ptr")?;
        let p = if crate::cuda::device_count() > 0 {
            crate::cuda::vmm_alloc(size)? as *mut c_void
        } else {
            window::shared::alloc(size)? as *mut c_void
        };
        // SAFETY: `ptr` is the C caller's out-parameter.
        unsafe { write_out(ptr, "ptr", p) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    guard("ncclMemFree", || {
        if ptr.is_null() || window::shared::free(ptr as *mut u8) {
            return Ok(());
        }
        crate::cuda::vmm_free(ptr as u64)
    })
}

/// comm extension: `size` bytes of host memory (whole pages, zero-filled) backed by a memfd
/// that every rank on this host maps once the memory is in a window, so peers reach it with
/// loads and stores (`commWinPeerPtr`). Free with commMemFreeShared or ncclMemFree.
#[no_mangle]
pub unsafe extern "C" fn commMemAllocShared(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    guard("commMemAllocShared", || {
        out(ptr, "ptr")?;
        let p = window::shared::alloc(size)? as *mut c_void;
        // SAFETY: `ptr` is the C caller's out-parameter.
        unsafe { write_out(ptr, "ptr", p) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn commMemFreeShared(ptr: *mut c_void) -> ncclResult_t {
    guard("commMemFreeShared", || {
        if ptr.is_null() || window::shared::free(ptr as *mut u8) {
            Ok(())
        } else {
            crate::invalid_arg!(
                "ptr {ptr:p} was not allocated by commMemAllocShared (or was freed already)"
            )
        }
    })
}

/// Registered buffers: device memory is published to the peers on this host, which then
/// read it in place; host memory is registered with the InfiniBand device where the network
/// links use one. The handle is checked when it is deregistered.
#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    guard_comm("ncclCommRegister", comm, |c| {
        out(handle, "handle")?;
        c.check_usable()?;
        if buff.is_null() && size > 0 {
            return crate::invalid_arg!("buff is NULL but size is {size}");
        }
        let h = c.register_buffer(buff.cast(), size)?;
        // SAFETY: `handle` is the C caller's out-parameter.
        unsafe { write_out(handle, "handle", h as *mut c_void) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    guard_comm("ncclCommDeregister", comm, |c| {
        c.deregister_buffer(handle as usize)
    })
}

/// What NCCL 2.30 checks of a window's buffer and flags (where the memory is, host or the
/// communicator's GPU, registration checks).
fn window_args(buff: *mut c_void, size: usize, win_flags: c_int) -> Result<()> {
    if buff.is_null() {
        return crate::invalid_arg!("buff is NULL");
    }
    if size == 0 {
        return crate::invalid_arg!("size is 0; a window needs at least one byte");
    }
    let known = NCCL_WIN_COLL_SYMMETRIC | NCCL_WIN_STRICT_ORDERING;
    if win_flags & !known != 0 {
        return crate::invalid_arg!(
            "winFlags {win_flags:#x} has bits NCCL 2.30 does not define (NCCL_WIN_COLL_SYMMETRIC = 0x1, NCCL_WIN_STRICT_ORDERING = 0x2)"
        );
    }
    Ok(())
}

/// Collective. Inside a group it runs at ncclGroupEnd, concurrently with the group's other
/// registrations, and `*win` is set then. Windows on host memory: memory from ncclMemAlloc (on a host without a GPU),
/// commMemAllocShared or commWindowAllocate is shared with the peers on this host, which then
/// reach it with loads and stores; other memory is reached with process_vm_writev / readv, and
/// registration fails, saying why, where the kernel forbids that. Ranks on other hosts reach
/// it through a progress thread of the target. Sizes may differ between ranks.
#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    winFlags: c_int,
) -> ncclResult_t {
    guard_comm("ncclCommWindowRegister", comm, |c| {
        out(win, "win")?;
        let pre = c
            .check_usable()
            .and_then(|_| window_args(buff, size, winFlags));
        let (b, w) = (buff as usize, win as usize);
        let c = c.clone();
        group::one_sided(
            comm as usize,
            c.blocking(),
            crate::group::Phase::Collective,
            move || {
                let h = window::register(&c.window_members(), b, size, winFlags, false, pre)?;
                // SAFETY: the caller keeps `win` valid until the call (or its group) returns.
                unsafe { *(w as *mut ncclWindow_t) = h as ncclWindow_t };
                Ok(())
            },
        )
    })
}

/// comm extension, collective: allocates `size` bytes of shared host memory on every rank
/// (as commMemAllocShared) and registers them as a window; `*ptr` is this rank's part.
/// ncclCommWindowDeregister frees the memory. Sizes may differ between ranks.
#[no_mangle]
pub unsafe extern "C" fn commWindowAllocate(
    comm: ncclComm_t,
    size: usize,
    winFlags: c_int,
    ptr: *mut *mut c_void,
    win: *mut ncclWindow_t,
) -> ncclResult_t {
    guard_comm("commWindowAllocate", comm, |c| {
        let mut mem = std::ptr::null_mut();
        let pre = out(win, "win")
            .and_then(|_| out(ptr, "ptr"))
            .and_then(|_| c.check_usable())
            .and_then(|_| {
                if size == 0 {
                    return crate::invalid_arg!("size is 0; a window needs at least one byte");
                }
                mem = window::shared::alloc(size)?;
                window_args(mem.cast(), size, winFlags)
            });
        match window::register(&c.window_members(), mem as usize, size, winFlags, true, pre) {
            // SAFETY: `win` and `ptr` are the C caller's out-parameters (and not NULL: `pre`
            // checked them, and registration fails when `pre` did).
            Ok(h) => unsafe {
                write_out(win, "win", h as ncclWindow_t)?;
                write_out(ptr, "ptr", mem.cast())
            },
            Err(e) => {
                if !mem.is_null() {
                    window::shared::free(mem);
                }
                Err(e)
            }
        }
    })
}

/// Local, as in NCCL: no operation may still use the window.
#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowDeregister(
    comm: ncclComm_t,
    win: ncclWindow_t,
) -> ncclResult_t {
    guard_comm("ncclCommWindowDeregister", comm, |c| {
        super::lane::invalidate();
        window::deregister(&c.window_members(), win as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclWinGetUserPtr(
    comm: ncclComm_t,
    win: ncclWindow_t,
    outUserPtr: *mut *mut c_void,
) -> ncclResult_t {
    guard_comm("ncclWinGetUserPtr", comm, |c| {
        out(outUserPtr, "outUserPtr")?;
        let p = window::user_ptr(&c.window_members(), win as usize)? as *mut c_void;
        // SAFETY: `outUserPtr` is the C caller's out-parameter.
        unsafe { write_out(outUserPtr, "outUserPtr", p) }
    })
}

/// NCCL 2.30 reserves sigIdx, ctx and flags: each must be 0.
fn reserved_zero(sig_idx: c_int, ctx: c_int, flags: c_uint) -> Result<()> {
    if sig_idx != 0 {
        return crate::invalid_arg!("sigIdx is {sig_idx}; NCCL 2.30 requires 0");
    }
    if ctx != 0 {
        return crate::invalid_arg!("ctx is {ctx}; NCCL 2.30 requires 0");
    }
    if flags != 0 {
        return crate::invalid_arg!("flags is {flags:#x}; NCCL 2.30 requires 0");
    }
    Ok(())
}

/// Bytes of `count` elements of `datatype` at `buf`.
fn buffer_bytes(
    buf: *const c_void,
    count: usize,
    datatype: RawDataType,
    name: &str,
) -> Result<usize> {
    let dt = crate::comm::ops::parse_dtype(datatype)?;
    let Some(bytes) = count.checked_mul(dt.size()) else {
        return crate::invalid_arg!("count {count} of {} overflows", dt.name());
    };
    if buf.is_null() && bytes > 0 {
        return crate::invalid_arg!("{name} is NULL but count is {count}");
    }
    Ok(bytes)
}

/// Host memory: `localbuff` may be reused when the call (or the group) returns. For a peer on
/// this host the data is in its window and counted by one signal by then; for one on another
/// host it may still be on its way, and lands before the signal counts (the peer's
/// ncclWaitSignal returns with it in place; commWinFlush waits for it here). Unlike NCCL,
/// `localbuff` need not lie in a window. Device memory is
/// copied on `stream`; to a peer on another host (GPUDirect RDMA) the call first waits for
/// `stream`, so that the device reads `localbuff` after the work queued before it.
#[no_mangle]
pub unsafe extern "C" fn ncclPutSignal(
    localbuff: *const c_void,
    count: usize,
    datatype: RawDataType,
    peer: c_int,
    peerWin: ncclWindow_t,
    peerWinOffset: usize,
    sigIdx: c_int,
    ctx: c_int,
    flags: c_uint,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    if sigIdx == 0 && ctx == 0 && flags == 0 {
        // SAFETY: `localbuff` is the C caller's buffer of `count` elements, as below.
        let short = std::panic::catch_unwind(|| unsafe {
            super::lane::put_signal(
                comm,
                localbuff,
                count,
                datatype,
                peer,
                peerWin,
                peerWinOffset,
            )
        });
        if matches!(short, Ok(true)) {
            return ncclResult_t::ncclSuccess;
        }
    }
    guard_comm("ncclPutSignal", comm, |c| {
        c.check_usable()?;
        reserved_zero(sigIdx, ctx, flags)?;
        if localbuff.is_null() {
            return crate::invalid_arg!("localbuff is NULL");
        }
        let bytes = buffer_bytes(localbuff, count, datatype, "localbuff")?;
        let put = window::check_put_signal(
            &c.window_members(),
            peerWin as usize,
            peer,
            peerWinOffset,
            localbuff as usize,
            bytes,
            crate::cuda::Stream(stream as *mut c_void),
        )?;
        group::one_sided(
            comm as usize,
            c.blocking(),
            crate::group::Phase::Issue,
            move || {
                // SAFETY: `localbuff` is the C caller's buffer of `count` elements (`bytes` bytes),
                // which NCCL requires valid until the call, or its group, returns (on a stream:
                // until the stream has done the copy).
                unsafe { put.run() }
            },
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclSignal(
    peer: c_int,
    sigIdx: c_int,
    ctx: c_int,
    flags: c_uint,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    guard_comm("ncclSignal", comm, |c| {
        c.check_usable()?;
        reserved_zero(sigIdx, ctx, flags)?;
        let on = crate::cuda::Stream(stream as *mut c_void);
        window::check_peer(&c.window_members(), peer)?;
        let c = c.clone();
        group::one_sided(
            comm as usize,
            c.blocking(),
            crate::group::Phase::Issue,
            move || window::signal(&c.window_members(), peer, Some(on)),
        )
    })
}

/// Host memory: returns (or the group ends) once every descriptor's signals arrived, their
/// data visible; a peer that is lost gives ncclRemoteError, COMM_TIMEOUT ncclTimeout.
#[no_mangle]
pub unsafe extern "C" fn ncclWaitSignal(
    nDesc: c_int,
    signalDescs: *mut ncclWaitSignalDesc_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let _ = stream;
    if !signalDescs.is_null() && nDesc > 0 {
        let short = std::panic::catch_unwind(|| {
            // SAFETY: `signalDescs` is the C caller's array of `nDesc` descriptors.
            let descs = unsafe { input_slice(signalDescs, nDesc as usize, "signalDescs") }.ok()?;
            super::lane::wait_signal(comm, descs)
        });
        if let Ok(Some(code)) = short {
            return code;
        }
    }
    guard_comm("ncclWaitSignal", comm, |c| {
        c.check_usable()?;
        if signalDescs.is_null() {
            return crate::invalid_arg!("signalDescs is NULL");
        }
        if nDesc <= 0 {
            return crate::invalid_arg!("nDesc is {nDesc}; it must be positive");
        }
        // SAFETY: `signalDescs` is the C caller's array of `nDesc` descriptors.
        let given = unsafe { input_slice(signalDescs, nDesc as usize, "signalDescs") }?;
        for (i, d) in given.iter().enumerate() {
            if d.opCnt <= 0 {
                return crate::invalid_arg!(
                    "signalDescs[{i}].opCnt is {}; it must be positive",
                    d.opCnt
                );
            }
            reserved_zero(d.sigIdx, d.ctx, 0)
                .map_err(|e| e.context(format!("signalDescs[{i}]")))?;
            window::check_peer(&c.window_members(), d.peer)?;
        }
        // Checked above: peers in range, counts positive.
        let descs = given.iter().map(|d| (d.peer as usize, d.opCnt as u64));
        if crate::group::depth() == 0 {
            return window::wait_signals(&c.window_members(), descs);
        }
        let descs: Vec<(usize, u64)> = descs.collect();
        let c = c.clone();
        group::one_sided(
            comm as usize,
            c.blocking(),
            crate::group::Phase::Wait,
            move || window::wait_signals(&c.window_members(), descs),
        )
    })
}

/// comm extension: puts `count` elements from `localbuff` at byte offset `peerWinOffset` of
/// `peer`'s window, without a signal. Host-synchronous: `localbuff` is reusable on return, and
/// the data has landed once commWinFlush returns (at once for peers on this host).
#[no_mangle]
pub unsafe extern "C" fn commWinPut(
    localbuff: *const c_void,
    count: usize,
    datatype: RawDataType,
    peer: c_int,
    peerWin: ncclWindow_t,
    peerWinOffset: usize,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("commWinPut", comm, |c| {
        c.check_usable()?;
        let bytes = buffer_bytes(localbuff, count, datatype, "localbuff")?;
        // SAFETY: `localbuff` is the C caller's buffer of `count` elements (`bytes` bytes).
        unsafe {
            window::put(
                &c.window_members(),
                peerWin as usize,
                peer,
                peerWinOffset,
                localbuff.cast(),
                bytes,
                false,
            )
        }
    })
}

/// comm extension: reads `count` elements at byte offset `peerWinOffset` of `peer`'s window
/// into `localbuff`; complete on return. The peer does not take part.
#[no_mangle]
pub unsafe extern "C" fn commWinGet(
    localbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    peer: c_int,
    peerWin: ncclWindow_t,
    peerWinOffset: usize,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("commWinGet", comm, |c| {
        c.check_usable()?;
        let bytes = buffer_bytes(localbuff, count, datatype, "localbuff")?;
        // SAFETY: `localbuff` is the C caller's buffer of `count` elements (`bytes` bytes).
        unsafe {
            window::get(
                &c.window_members(),
                peerWin as usize,
                peer,
                peerWinOffset,
                localbuff.cast(),
                bytes,
            )
        }
    })
}

fn atomic_type(datatype: RawDataType) -> Result<()> {
    let dt = crate::comm::ops::parse_dtype(datatype)?;
    if dt.size() != 8 || dt.is_float() {
        return crate::invalid_arg!(
            "datatype {} is {} bytes; window atomics operate on 8-byte integers (ncclInt64, ncclUint64)",
            dt.name(),
            dt.size()
        );
    }
    Ok(())
}

/// comm extension: atomically adds `value` to the 8-byte integer at byte offset
/// `peerWinOffset` (8-byte aligned) of `peer`'s window and stores the previous value in
/// `*oldValue` (may be NULL). Atomic against every rank's window atomics on that word.
#[no_mangle]
pub unsafe extern "C" fn commWinFetchAdd(
    value: u64,
    oldValue: *mut u64,
    datatype: RawDataType,
    peer: c_int,
    peerWin: ncclWindow_t,
    peerWinOffset: usize,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("commWinFetchAdd", comm, |c| {
        c.check_usable()?;
        atomic_type(datatype)?;
        let old = window::atomic(
            &c.window_members(),
            peerWin as usize,
            peer,
            peerWinOffset,
            None,
            value,
        )?;
        if !oldValue.is_null() {
            // SAFETY: `oldValue` is the C caller's out-parameter (optional: it was not NULL).
            unsafe { write_out(oldValue, "oldValue", old) }?;
        }
        Ok(())
    })
}

/// comm extension: atomically replaces the 8-byte integer at byte offset `peerWinOffset` of
/// `peer`'s window with `value` if it equals `compare`; `*oldValue` (may be NULL) receives the
/// value found, so the swap happened when it equals `compare`.
#[no_mangle]
pub unsafe extern "C" fn commWinCompareSwap(
    compare: u64,
    value: u64,
    oldValue: *mut u64,
    datatype: RawDataType,
    peer: c_int,
    peerWin: ncclWindow_t,
    peerWinOffset: usize,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("commWinCompareSwap", comm, |c| {
        c.check_usable()?;
        atomic_type(datatype)?;
        let old = window::atomic(
            &c.window_members(),
            peerWin as usize,
            peer,
            peerWinOffset,
            Some(compare),
            value,
        )?;
        if !oldValue.is_null() {
            // SAFETY: `oldValue` is the C caller's out-parameter (optional: it was not NULL).
            unsafe { write_out(oldValue, "oldValue", old) }?;
        }
        Ok(())
    })
}

/// comm extension: returns once every earlier put from this rank to `peer` through any
/// window has landed in the peer's memory.
#[no_mangle]
pub unsafe extern "C" fn commWinFlush(
    peer: c_int,
    win: ncclWindow_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("commWinFlush", comm, |c| {
        c.check_usable()?;
        window::flush(&c.window_members(), win as usize, Some(peer))
    })
}

/// comm extension: the address at which this process reaches `peer`'s part of the window with
/// loads and stores (the peer itself, a thread of this process, or memory shared with this
/// host's peers); NULL where it cannot (ordinary memory of another process, another host).
#[no_mangle]
pub unsafe extern "C" fn commWinPeerPtr(
    comm: ncclComm_t,
    win: ncclWindow_t,
    peer: c_int,
    ptr: *mut *mut c_void,
) -> ncclResult_t {
    guard_comm("commWinPeerPtr", comm, |c| {
        out(ptr, "ptr")?;
        let p =
            window::peer_ptr(&c.window_members(), win as usize, peer)?.unwrap_or(0) as *mut c_void;
        // SAFETY: `ptr` is the C caller's out-parameter.
        unsafe { write_out(ptr, "ptr", p) }
    })
}

/// comm extension: the size in bytes of `peer`'s part of the window, as `peer` registered it
/// (sizes may differ between ranks).
#[no_mangle]
pub unsafe extern "C" fn commWinPeerSize(
    comm: ncclComm_t,
    win: ncclWindow_t,
    peer: c_int,
    size: *mut usize,
) -> ncclResult_t {
    guard_comm("commWinPeerSize", comm, |c| {
        out(size, "size")?;
        let n = window::peer_size(&c.window_members(), win as usize, peer)?;
        // SAFETY: `size` is the C caller's out-parameter.
        unsafe { write_out(size, "size", n) }
    })
}

/// comm extension: `peer`'s signal pads of the window, as PyTorch's SymmetricMemory lays them
/// out: `*nchannels * nranks` uint32 words, the word of (channel, rank r) at
/// `channel * nranks + r`; NULL for a peer on another host. Zero when no synchronisation is
/// in progress.
#[no_mangle]
pub unsafe extern "C" fn commWinSignalPads(
    comm: ncclComm_t,
    win: ncclWindow_t,
    peer: c_int,
    pads: *mut *mut c_void,
    nchannels: *mut c_int,
) -> ncclResult_t {
    guard_comm("commWinSignalPads", comm, |c| {
        out(pads, "pads")?;
        out(nchannels, "nchannels")?;
        let (p, n) = window::signal_pads(&c.window_members(), win as usize, peer)?;
        // SAFETY: `pads` and `nchannels` are the C caller's out-parameters.
        unsafe {
            write_out(pads, "pads", p.unwrap_or(0) as *mut c_void)?;
            write_out(nchannels, "nchannels", n as c_int)
        }
    })
}

/// comm extension, PyTorch SymmetricMemory's put_signal: sets this rank's slot for `channel`
/// in `peer`'s signal pad, waiting while the previous signal is still unconsumed.
/// `timeoutMs` 0 waits as long as COMM_TIMEOUT allows; ncclTimeout when it passes.
#[no_mangle]
pub unsafe extern "C" fn commWinChannelSignal(
    peer: c_int,
    channel: c_int,
    timeoutMs: u64,
    win: ncclWindow_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("commWinChannelSignal", comm, |c| {
        c.check_usable()?;
        window::channel_signal(&c.window_members(), win as usize, peer, channel, timeoutMs)
    })
}

/// comm extension, PyTorch SymmetricMemory's wait_signal: waits for `peer`'s signal on
/// `channel` and clears it. ncclTimeout after `timeoutMs` (0: COMM_TIMEOUT, or no limit),
/// ncclRemoteError when the peer is lost.
#[no_mangle]
pub unsafe extern "C" fn commWinChannelWait(
    peer: c_int,
    channel: c_int,
    timeoutMs: u64,
    win: ncclWindow_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("commWinChannelWait", comm, |c| {
        c.check_usable()?;
        window::channel_wait(&c.window_members(), win as usize, peer, channel, timeoutMs)
    })
}

/// comm extension, PyTorch SymmetricMemory's barrier: signals every peer on `channel`, then
/// waits for every peer's signal. The pads are zero again afterwards.
#[no_mangle]
pub unsafe extern "C" fn commWinChannelBarrier(
    channel: c_int,
    timeoutMs: u64,
    win: ncclWindow_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("commWinChannelBarrier", comm, |c| {
        c.check_usable()?;
        window::channel_barrier(&c.window_members(), win as usize, channel, timeoutMs)
    })
}

// The host side of NCCL's device API (declared in nccl_device.h, not nccl.h). PyTorch imports
// these names; kernels that call into a device communicator are not supported.

#[no_mangle]
pub unsafe extern "C" fn ncclDevCommCreate(
    comm: ncclComm_t,
    reqs: *const c_void,
    outDevComm: *mut c_void,
) -> ncclResult_t {
    let _ = (reqs, outDevComm);
    guard_comm("ncclDevCommCreate", comm, |_c| {
        crate::invalid_usage!("NCCL's device API (ncclDevCommCreate) is not supported by comm")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclDevCommDestroy(
    comm: ncclComm_t,
    devComm: *const c_void,
) -> ncclResult_t {
    let _ = devComm;
    guard_comm("ncclDevCommDestroy", comm, |_c| {
        crate::invalid_usage!("NCCL's device API (ncclDevCommDestroy) is not supported by comm")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetLsaMultimemDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (window, offset, outPtr);
    guard("ncclGetLsaMultimemDevicePointer", || {
        crate::invalid_usage!("NVLink multicast (NVLS) memory is not supported by comm")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetPeerDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    peer: c_int,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    guard("ncclGetPeerDevicePointer", || {
        out(outPtr, "outPtr")?;
        let p = window::peer_device_ptr(window as usize, offset, peer)?;
        // SAFETY: `outPtr` is the C caller's out-parameter.
        unsafe { write_out(outPtr, "outPtr", p as *mut c_void) }
    })
}
