//! Memory allocation and registration, windows and one-sided operations, and the host side of
//! NCCL's device API. What this build cannot do yet fails with ncclInvalidUsage and says why.

use super::types::*;
use super::{guard, guard_comm, out};
use crate::error::Result;
use once_cell::sync::Lazy;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::raw::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

fn no_windows<T>(what: &str) -> Result<T> {
    crate::invalid_usage!(
        "{what}: windows and one-sided operations are not implemented in this version of comm yet"
    )
}

/// Device memory from CUDA's virtual memory management API on the calling thread's GPU (NCCL
/// 2.19): suitable for every path of the library, freed with ncclMemFree.
#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    guard("ncclMemAlloc", || {
        out(ptr, "ptr")?;
        *ptr = crate::cuda::vmm_alloc(size)? as *mut c_void;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    guard("ncclMemFree", || {
        if ptr.is_null() {
            return Ok(());
        }
        crate::cuda::vmm_free(ptr as u64)
    })
}

/// Registered buffers. Device memory is published to the peers on this host, which then read
/// it in place instead of having it staged (`transport::reg`); host memory needs no pinning or
/// mapping for the host transports. Handles are tracked so that deregistration is checked.
struct Registration {
    comm: usize,
    /// The communicator's registry entry, for device memory published to the peers.
    entry: Option<usize>,
}

static REGISTRATIONS: Lazy<Mutex<HashMap<usize, Registration>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));
static NEXT_REG: AtomicUsize = AtomicUsize::new(1);

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
        let mut entry = None;
        match crate::cuda::classify(buff) {
            crate::cuda::MemKind::Device(ordinal) if size > 0 => {
                match (&c.device, &c.shm, &c.registry) {
                    (Some(w), _, _) if w.device.ordinal != ordinal => {
                        return crate::invalid_arg!(
                            "buff is memory of GPU {ordinal} but this communicator was created on GPU {}",
                            w.device.ordinal
                        )
                    }
                    (Some(w), Some(shm), Some(reg)) => {
                        entry = reg.export(shm, &w.device, buff as u64, size)?;
                    }
                    _ => crate::info!(
                        "registered {size} bytes of device memory at {buff:p}; no peer on this host reads it in place (no device path, no local peers, or NCCL_LOCAL_REGISTER=0)"
                    ),
                }
            }
            _ => crate::info!("registered {size} bytes at {buff:p} (host memory: nothing to pin)"),
        }
        let h = 0x5e60_0000_0000 + 0x40 * NEXT_REG.fetch_add(1, Ordering::SeqCst);
        REGISTRATIONS.lock().insert(
            h,
            Registration {
                comm: comm as usize,
                entry,
            },
        );
        *handle = h as *mut c_void;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    guard_comm("ncclCommDeregister", comm, |c| {
        let mut regs = REGISTRATIONS.lock();
        match regs.get(&(handle as usize)) {
            Some(r) if r.comm == comm as usize => {
                if let (Some(i), Some(shm), Some(reg)) = (r.entry, &c.shm, &c.registry) {
                    reg.unexport(shm, i);
                }
                regs.remove(&(handle as usize));
                Ok(())
            }
            Some(_) => crate::invalid_arg!("handle {handle:p} was registered on another communicator"),
            None => crate::invalid_arg!("handle {handle:p} is not a live registration (never registered, or already deregistered)"),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    winFlags: c_int,
) -> ncclResult_t {
    let _ = (buff, size, winFlags);
    guard_comm("ncclCommWindowRegister", comm, |_c| {
        out(win, "win")?;
        no_windows("ncclCommWindowRegister")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowDeregister(
    comm: ncclComm_t,
    win: ncclWindow_t,
) -> ncclResult_t {
    let _ = win;
    guard_comm("ncclCommWindowDeregister", comm, |_c| {
        no_windows("ncclCommWindowDeregister")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclWinGetUserPtr(
    comm: ncclComm_t,
    win: ncclWindow_t,
    outUserPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (win, outUserPtr);
    guard_comm("ncclWinGetUserPtr", comm, |_c| {
        no_windows("ncclWinGetUserPtr")
    })
}

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
    let _ = (
        localbuff,
        count,
        datatype,
        peer,
        peerWin,
        peerWinOffset,
        sigIdx,
        ctx,
        flags,
        stream,
    );
    guard_comm("ncclPutSignal", comm, |_c| no_windows("ncclPutSignal"))
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
    let _ = (peer, sigIdx, ctx, flags, stream);
    guard_comm("ncclSignal", comm, |_c| no_windows("ncclSignal"))
}

#[no_mangle]
pub unsafe extern "C" fn ncclWaitSignal(
    nDesc: c_int,
    signalDescs: *mut ncclWaitSignalDesc_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let _ = (nDesc, signalDescs, stream);
    guard_comm("ncclWaitSignal", comm, |_c| no_windows("ncclWaitSignal"))
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
    let _ = (window, offset, peer, outPtr);
    guard("ncclGetPeerDevicePointer", || {
        no_windows("ncclGetPeerDevicePointer")
    })
}
