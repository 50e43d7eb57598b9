//! Collectives, point-to-point, custom reduction ops and groups.

use super::types::*;
use super::{guard, guard_comm, input_slice, lane, nonneg, out, outcome, write_out};
use crate::algo::{Collective, PerPeer};
use crate::comm::ops::{parse_dtype, repeat_key, ScalarSrc};
use crate::comm::Comm;
use crate::error::Result;
use crate::group;
use crate::reduce::Scale;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;

/// A collective entry point: `coll` (or the error found in its arguments) on `comm`. A call
/// that moves nothing, on the communicator this thread used last, whose checks pass is done
/// here with nothing more than those checks (a C loop of zero-element all-gathers on one rank:
/// 13.6 -> 6.4 ns a call; OpenMPI's MPI_Allgather of nothing takes 3.4). A call outside any
/// group that repeats the last one that communicator ran, but for its buffers, runs that
/// call's kept operation on its own buffers (`Comm::again`). Anything else, a failed check
/// included, takes the full way, which reports what is wrong.
#[allow(clippy::too_many_arguments)]
fn call(
    func: &'static str,
    comm: ncclComm_t,
    coll: Result<Collective>,
    send: *const c_void,
    recv: *mut c_void,
    dtype: RawDataType,
    op: Option<RawRedOp>,
    stream: cudaStream_t,
) -> ncclResult_t {
    if let Ok(k) = &coll {
        if k.moves_nothing() && lane::with_kept(comm, |c| c.check_kind(k, dtype, op).is_ok()) {
            return ncclResult_t::ncclSuccess;
        }
        // Inside a group a call is queued: the full path takes it.
        let key = (!crate::group::in_group())
            .then(|| repeat_key(k, dtype, op, stream as usize))
            .flatten();
        if let Some(key) = &key {
            let mut rank = None;
            let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                lane::kept(comm, |c| {
                    rank = Some(c.rank as i32);
                    let _scope = crate::log::rank_scope(c.rank as i32);
                    c.again(key, send as *const u8, recv as *mut u8)
                })
            }));
            match again {
                Ok(None) => {}
                Ok(Some(r)) => return outcome(func, comm, Ok(r), rank),
                Err(p) => return outcome(func, comm, Err(p), rank),
            }
        }
    }
    guard_comm(func, comm, |c| {
        submit(c, coll?, send, recv, dtype, op, stream)
    })
}

/// Validates and submits one call (now, or at the end of the group).
fn submit(
    c: &Arc<Comm>,
    coll: Collective,
    send: *const c_void,
    recv: *mut c_void,
    dtype: RawDataType,
    op: Option<RawRedOp>,
    stream: cudaStream_t,
) -> Result<()> {
    if coll.moves_nothing() {
        // A collective of zero elements: its buffers are never looked at (see check_kind).
        return c.check_kind(&coll, dtype, op).map(drop);
    }
    let repeat = repeat_key(&coll, dtype, op, stream as usize);
    // A send or receive that fails is named by its peer and count: in a group of many, its
    // entry point's name alone does not say which one failed.
    let p2p = match coll {
        Collective::Send { peer, count } | Collective::Recv { peer, count } => {
            Some(format!("peer {peer}, count {count}"))
        }
        _ => None,
    };
    let call = c
        .check_call(
            coll,
            send as *const u8,
            recv as *mut u8,
            dtype,
            op,
            stream as usize,
        )
        .map_err(|e| match p2p {
            Some(what) => e.context(what),
            None => e,
        })?;
    group::submit(c, call, repeat)
}

fn root_of(root: c_int) -> Result<usize> {
    nonneg(root, "root")
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclAllReduce",
        comm,
        Ok(Collective::AllReduce { count }),
        sendbuff,
        recvbuff,
        datatype,
        Some(op),
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclBroadcast",
        comm,
        root_of(root).map(|root| Collective::Broadcast { count, root }),
        sendbuff,
        recvbuff,
        datatype,
        None,
        stream,
    )
}

/// In-place broadcast (deprecated in NCCL, still exported).
#[no_mangle]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclBcast",
        comm,
        root_of(root).map(|root| Collective::Broadcast { count, root }),
        buff,
        buff,
        datatype,
        None,
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    op: RawRedOp,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclReduce",
        comm,
        root_of(root).map(|root| Collective::Reduce { count, root }),
        sendbuff,
        recvbuff,
        datatype,
        Some(op),
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: RawDataType,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclAllGather",
        comm,
        Ok(Collective::AllGather { count: sendcount }),
        sendbuff,
        recvbuff,
        datatype,
        None,
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclReduceScatter",
        comm,
        Ok(Collective::ReduceScatter { count: recvcount }),
        sendbuff,
        recvbuff,
        datatype,
        Some(op),
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclAlltoAll",
        comm,
        Ok(Collective::AlltoAll { count }),
        sendbuff,
        recvbuff,
        datatype,
        None,
        stream,
    )
}

/// All-to-all with per-peer counts and displacements, in elements (an extension of comm, the
/// shape of MPI_Alltoallv and of torch's `all_to_all_single` with split sizes). Arrays have one
/// entry per rank. Block `p` of the send buffer (`sendcounts[p]` elements at `sdispls[p]`) goes
/// to rank `p`, which stores it at its `rdispls[me]`.
#[no_mangle]
pub unsafe extern "C" fn commAlltoAllv(
    sendbuff: *const c_void,
    sendcounts: *const usize,
    sdispls: *const usize,
    recvbuff: *mut c_void,
    recvcounts: *const usize,
    rdispls: *const usize,
    datatype: RawDataType,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    guard_comm("commAlltoAllv", comm, |c| {
        let n = c.nranks;
        let arr = |p: *const usize, name: &str| -> Result<Vec<usize>> {
            // SAFETY: each array is the C caller's, with one entry per rank (`n >= 1`).
            Ok(unsafe { input_slice(p, n, name) }?.to_vec())
        };
        let coll = Collective::AlltoAllv(Box::new(PerPeer {
            send_counts: arr(sendcounts, "sendcounts")?,
            send_displs: arr(sdispls, "sdispls")?,
            recv_counts: arr(recvcounts, "recvcounts")?,
            recv_displs: arr(rdispls, "rdispls")?,
        }));
        submit(c, coll, sendbuff, recvbuff, datatype, None, stream)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclGather",
        comm,
        root_of(root).map(|root| Collective::Gather { count, root }),
        sendbuff,
        recvbuff,
        datatype,
        None,
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclScatter",
        comm,
        root_of(root).map(|root| Collective::Scatter { count, root }),
        sendbuff,
        recvbuff,
        datatype,
        None,
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: RawDataType,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclSend",
        comm,
        nonneg(peer, "peer").map(|peer| Collective::Send { peer, count }),
        sendbuff,
        std::ptr::null_mut(),
        datatype,
        None,
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    call(
        "ncclRecv",
        comm,
        nonneg(peer, "peer").map(|peer| Collective::Recv { peer, count }),
        std::ptr::null(),
        recvbuff,
        datatype,
        None,
        stream,
    )
}

/// Receive from any source (an extension of comm; MPI_ANY_SOURCE, torch's `recv` without a
/// source): receives the next point-to-point message of `count` elements that any rank sends
/// to this one with `ncclSend`, and stores that rank in `*source`. Messages from one sender
/// arrive in the order it sent them; among senders the library decides. Host memory only, and
/// never inside a group, since the peer is chosen when the call runs; complete on return.
#[no_mangle]
pub unsafe extern "C" fn commRecvAny(
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    source: *mut c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    guard_comm("commRecvAny", comm, |c| {
        out(source, "source")?;
        let peer = group::recv_any(c, recvbuff as *mut u8, count, datatype, stream as usize)?;
        // SAFETY: `source` is the C caller's out-parameter.
        unsafe { write_out(source, "source", peer as c_int) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut RawRedOp,
    scalar: *mut c_void,
    datatype: RawDataType,
    residence: RawScalarResidence,
    comm: ncclComm_t,
) -> ncclResult_t {
    guard_comm("ncclRedOpCreatePreMulSum", comm, |c| {
        out(op, "op")?;
        if scalar.is_null() {
            return crate::invalid_arg!("scalar is NULL");
        }
        let dtype = parse_dtype(datatype)?;
        let src = match residence {
            1 => ScalarSrc::Value(Scale::from_bytes(
                dtype,
                // SAFETY: `scalar` is the C caller's host value of one `datatype` element.
                unsafe { input_slice(scalar as *const u8, dtype.size(), "scalar") }?,
            )),
            0 => ScalarSrc::Pointer(scalar as usize),
            r => {
                return crate::invalid_arg!(
                    "residence {r} is not an ncclScalarResidence_t (0 = ncclScalarDevice, 1 = ncclScalarHostImmediate)"
                )
            }
        };
        let created = c.create_premulsum(dtype, src)?;
        // SAFETY: `op` is the C caller's out-parameter.
        unsafe { write_out(op, "op", created) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRedOpDestroy(op: RawRedOp, comm: ncclComm_t) -> ncclResult_t {
    guard_comm("ncclRedOpDestroy", comm, |c| c.destroy_op(op))
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    guard("ncclGroupStart", || {
        group::start();
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    guard("ncclGroupEnd", group::end)
}

/// NULL runs the group, as ncclGroupEnd (NCCL does the same). Otherwise the struct is read and
/// written up to its `size`, as NCCL does (an older, shorter struct works): `magic` must be
/// there and be NCCL_SIM_INFO_INITIALIZER's, and `estimatedTime` is filled where it fits.
#[no_mangle]
pub unsafe extern "C" fn ncclGroupSimulateEnd(simInfo: *mut ncclSimInfo_t) -> ncclResult_t {
    guard("ncclGroupSimulateEnd", || {
        if simInfo.is_null() {
            return group::end();
        }
        let magic_end = std::mem::offset_of!(ncclSimInfo_t, magic) + 4;
        let time_end = std::mem::offset_of!(ncclSimInfo_t, estimatedTime) + 4;
        // SAFETY: `simInfo` is not NULL and the C caller's struct, which begins with its
        // `size`; `magic` is read only where `size` says it is there.
        let (size, magic) = unsafe {
            let size = std::ptr::read_unaligned(simInfo as *const usize);
            let magic = if size >= magic_end {
                std::ptr::read_unaligned(std::ptr::addr_of!((*simInfo).magic))
            } else {
                0
            };
            (size, magic)
        };
        if magic != NCCL_SIM_INFO_MAGIC {
            // Still end the group so the caller's nesting stays balanced.
            let _ = group::simulate_end();
            return crate::invalid_arg!(
                "simInfo was not initialized with NCCL_SIM_INFO_INITIALIZER (size {size}, magic {magic:#x})"
            );
        }
        let us = group::simulate_end()?;
        if size >= time_end {
            // SAFETY: `size` says the caller's struct reaches past `estimatedTime`.
            unsafe {
                std::ptr::write_unaligned(std::ptr::addr_of_mut!((*simInfo).estimatedTime), us)
            };
        }
        Ok(())
    })
}
