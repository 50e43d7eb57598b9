//! The `pnccl*` profiling twins NCCL exports beside every `nccl*` function (PMPI style), so
//! tools that interpose on the `nccl*` names can still reach the library. Each forwards to its
//! `nccl*` name, which `-Bsymbolic-functions` binds to this library's own definition.

use super::types::*;
use std::os::raw::{c_char, c_int, c_uint, c_void};

#[no_mangle]
pub unsafe extern "C" fn pncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclBcast(buff, count, datatype, root, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    op: RawRedOp,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: RawDataType,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclAlltoAll(sendbuff, recvbuff, count, datatype, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclGather(sendbuff, recvbuff, count, datatype, root, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclScatter(sendbuff, recvbuff, count, datatype, root, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: RawDataType,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclSend(sendbuff, count, datatype, peer, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclRecv(recvbuff, count, datatype, peer, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclRedOpCreatePreMulSum(
    op: *mut RawRedOp,
    scalar: *mut c_void,
    datatype: RawDataType,
    residence: RawScalarResidence,
    comm: ncclComm_t,
) -> ncclResult_t {
    super::ncclRedOpCreatePreMulSum(op, scalar, datatype, residence, comm)
}

#[no_mangle]
pub unsafe extern "C" fn pncclRedOpDestroy(op: RawRedOp, comm: ncclComm_t) -> ncclResult_t {
    super::ncclRedOpDestroy(op, comm)
}

#[no_mangle]
pub unsafe extern "C" fn pncclGroupStart() -> ncclResult_t {
    super::ncclGroupStart()
}

#[no_mangle]
pub unsafe extern "C" fn pncclGroupEnd() -> ncclResult_t {
    super::ncclGroupEnd()
}

#[no_mangle]
pub unsafe extern "C" fn pncclGroupSimulateEnd(simInfo: *mut ncclSimInfo_t) -> ncclResult_t {
    super::ncclGroupSimulateEnd(simInfo)
}

#[no_mangle]
pub unsafe extern "C" fn pncclGetVersion(version: *mut c_int) -> ncclResult_t {
    super::ncclGetVersion(version)
}

#[no_mangle]
pub unsafe extern "C" fn pncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
    super::ncclGetUniqueId(uniqueId)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    super::ncclCommInitRank(comm, nranks, commId, rank)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    super::ncclCommInitRankConfig(comm, nranks, commId, rank, config)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommInitRankScalable(
    newcomm: *mut ncclComm_t,
    nranks: c_int,
    myrank: c_int,
    nId: c_int,
    commIds: *mut ncclUniqueId,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    super::ncclCommInitRankScalable(newcomm, nranks, myrank, nId, commIds, config)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommInitAll(
    comm: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    super::ncclCommInitAll(comm, ndev, devlist)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    super::ncclCommFinalize(comm)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    super::ncclCommDestroy(comm)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    super::ncclCommAbort(comm)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) -> ncclResult_t {
    super::ncclCommRevoke(comm, revokeFlags)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    super::ncclCommSplit(comm, color, key, newcomm, config)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommShrink(
    comm: ncclComm_t,
    excludeRanksList: *mut c_int,
    excludeRanksCount: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
    shrinkFlags: c_int,
) -> ncclResult_t {
    super::ncclCommShrink(
        comm,
        excludeRanksList,
        excludeRanksCount,
        newcomm,
        config,
        shrinkFlags,
    )
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommGetUniqueId(
    comm: ncclComm_t,
    uniqueId: *mut ncclUniqueId,
) -> ncclResult_t {
    super::ncclCommGetUniqueId(comm, uniqueId)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommGrow(
    comm: ncclComm_t,
    nRanks: c_int,
    uniqueId: *const ncclUniqueId,
    rank: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    super::ncclCommGrow(comm, nRanks, uniqueId, rank, newcomm, config)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
    super::ncclCommSuspend(comm, flags)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommResume(comm: ncclComm_t) -> ncclResult_t {
    super::ncclCommResume(comm)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommMemStats(
    comm: ncclComm_t,
    stat: RawMemStat,
    value: *mut u64,
) -> ncclResult_t {
    super::ncclCommMemStats(comm, stat, value)
}

#[no_mangle]
pub unsafe extern "C" fn pncclGetErrorString(result: RawResult) -> *const c_char {
    super::ncclGetErrorString(result)
}

#[no_mangle]
pub unsafe extern "C" fn pncclGetLastError(comm: ncclComm_t) -> *const c_char {
    super::ncclGetLastError(comm)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommGetAsyncError(
    comm: ncclComm_t,
    asyncError: *mut ncclResult_t,
) -> ncclResult_t {
    super::ncclCommGetAsyncError(comm, asyncError)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    super::ncclCommCount(comm, count)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    super::ncclCommUserRank(comm, rank)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    super::ncclCommCuDevice(comm, device)
}

#[no_mangle]
pub unsafe extern "C" fn pncclResetDebugInit() {
    super::ncclResetDebugInit()
}

#[no_mangle]
pub unsafe extern "C" fn pncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    super::ncclMemAlloc(ptr, size)
}

#[no_mangle]
pub unsafe extern "C" fn pncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    super::ncclMemFree(ptr)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    super::ncclCommRegister(comm, buff, size, handle)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommDeregister(
    comm: ncclComm_t,
    handle: *mut c_void,
) -> ncclResult_t {
    super::ncclCommDeregister(comm, handle)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    winFlags: c_int,
) -> ncclResult_t {
    super::ncclCommWindowRegister(comm, buff, size, win, winFlags)
}

#[no_mangle]
pub unsafe extern "C" fn pncclCommWindowDeregister(
    comm: ncclComm_t,
    win: ncclWindow_t,
) -> ncclResult_t {
    super::ncclCommWindowDeregister(comm, win)
}

#[no_mangle]
pub unsafe extern "C" fn pncclWinGetUserPtr(
    comm: ncclComm_t,
    win: ncclWindow_t,
    outUserPtr: *mut *mut c_void,
) -> ncclResult_t {
    super::ncclWinGetUserPtr(comm, win, outUserPtr)
}

#[no_mangle]
pub unsafe extern "C" fn pncclPutSignal(
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
    super::ncclPutSignal(
        localbuff,
        count,
        datatype,
        peer,
        peerWin,
        peerWinOffset,
        sigIdx,
        ctx,
        flags,
        comm,
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn pncclSignal(
    peer: c_int,
    sigIdx: c_int,
    ctx: c_int,
    flags: c_uint,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclSignal(peer, sigIdx, ctx, flags, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclWaitSignal(
    nDesc: c_int,
    signalDescs: *mut ncclWaitSignalDesc_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    super::ncclWaitSignal(nDesc, signalDescs, comm, stream)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamBind(
    out_h: *mut ncclParamHandle_t,
    key: *const c_char,
) -> ncclResult_t {
    super::ncclParamBind(out_h, key)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetI8(h: ncclParamHandle_t, out_v: *mut i8) -> ncclResult_t {
    super::ncclParamGetI8(h, out_v)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetI16(h: ncclParamHandle_t, out_v: *mut i16) -> ncclResult_t {
    super::ncclParamGetI16(h, out_v)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetI32(h: ncclParamHandle_t, out_v: *mut i32) -> ncclResult_t {
    super::ncclParamGetI32(h, out_v)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetI64(h: ncclParamHandle_t, out_v: *mut i64) -> ncclResult_t {
    super::ncclParamGetI64(h, out_v)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetU8(h: ncclParamHandle_t, out_v: *mut u8) -> ncclResult_t {
    super::ncclParamGetU8(h, out_v)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetU16(h: ncclParamHandle_t, out_v: *mut u16) -> ncclResult_t {
    super::ncclParamGetU16(h, out_v)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetU32(h: ncclParamHandle_t, out_v: *mut u32) -> ncclResult_t {
    super::ncclParamGetU32(h, out_v)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetU64(h: ncclParamHandle_t, out_v: *mut u64) -> ncclResult_t {
    super::ncclParamGetU64(h, out_v)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetStr(
    h: ncclParamHandle_t,
    out_s: *mut *const c_char,
) -> ncclResult_t {
    super::ncclParamGetStr(h, out_s)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGet(
    h: ncclParamHandle_t,
    out_v: *mut std::os::raw::c_void,
    maxLen: c_int,
    len: *mut c_int,
) -> ncclResult_t {
    super::ncclParamGet(h, out_v, maxLen, len)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetParameter(
    key: *const c_char,
    value: *mut *const c_char,
    valueLen: *mut c_int,
) -> ncclResult_t {
    super::ncclParamGetParameter(key, value, valueLen)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamGetAllParameterKeys(
    table: *mut *mut *const c_char,
    tableLen: *mut c_int,
) -> ncclResult_t {
    super::ncclParamGetAllParameterKeys(table, tableLen)
}

#[no_mangle]
pub unsafe extern "C" fn pncclParamDumpAll() {
    super::ncclParamDumpAll()
}
