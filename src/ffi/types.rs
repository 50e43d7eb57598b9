//! The C types of the NCCL ABI (API level 2.30): the enums, structs and constants cbindgen writes
//! into `include/nccl.h`. Values and layouts are NCCL's; `tests/abi_layout.rs` compares them with
//! NVIDIA's header.
//!
//! Enum-typed *arguments* arrive as plain integers (`Raw*` aliases, renamed to the enum names in
//! the header) because C may pass any int, and a Rust enum holding an undeclared value is undefined
//! behaviour. The Rust enums below exist to give the header its enumerators.

#![allow(non_camel_case_types, non_snake_case)]

use std::os::raw::{c_char, c_int, c_uint};

// The values the library's own modules use, which know nothing of the C API, are the header's.
const _: () = {
    assert!(NCCL_VERSION_CODE == crate::version::NCCL_API_LEVEL);
    assert!(NCCL_SPLIT_NOCOLOR == crate::comm::SPLIT_NOCOLOR);
    assert!(NCCL_WIN_COLL_SYMMETRIC == crate::window::WIN_COLL_SYMMETRIC);
    assert!(COMM_OP_BAND == crate::comm::ops::COMM_OP_BAND);
    assert!(COMM_OP_BOR == crate::comm::ops::COMM_OP_BOR);
    assert!(COMM_OP_BXOR == crate::comm::ops::COMM_OP_BXOR);
};

pub const NCCL_MAJOR: c_int = 2;
pub const NCCL_MINOR: c_int = 30;
pub const NCCL_PATCH: c_int = 7;
pub const NCCL_VERSION_CODE: c_int = 23007;
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;
pub const NCCL_API_MAGIC: c_uint = 0xcafebeef;
pub const NCCL_SIM_INFO_MAGIC: c_uint = 0x74685283;
pub const NCCL_WIN_DEFAULT: c_int = 0x00;
pub const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;
pub const NCCL_WIN_STRICT_ORDERING: c_int = 0x02;
pub const NCCL_WIN_REQUIRED_ALIGNMENT: c_int = 4096;
pub const NCCL_CTA_POLICY_DEFAULT: c_int = 0x00;
pub const NCCL_CTA_POLICY_EFFICIENCY: c_int = 0x01;
pub const NCCL_CTA_POLICY_ZERO: c_int = 0x02;
pub const NCCL_SHRINK_DEFAULT: c_int = 0x00;
pub const NCCL_SHRINK_ABORT: c_int = 0x01;
pub const NCCL_REVOKE_DEFAULT: c_int = 0x00;
pub const NCCL_SUSPEND_MEM: c_int = 0x01;

/// comm extension: bitwise and/or/xor reductions, for integer datatypes only (torch's
/// ReduceOp.BAND/BOR/BXOR). Pass them where an ncclRedOp_t goes.
pub const COMM_OP_BAND: c_int = 0x7fff_0001;
pub const COMM_OP_BOR: c_int = 0x7fff_0002;
pub const COMM_OP_BXOR: c_int = 0x7fff_0003;

/// comm extension: bits of `commGetFeatures`.
/// Device (CUDA) buffers are supported by this build and a driver was found.
pub const COMM_FEATURE_DEVICE_MEMORY: c_int = 0x1;
/// Windows and one-sided operations on host memory: NCCL's put / signal / wait_signal, and
/// comm's get, atomics, peer pointers, flush and signal-pad channels.
pub const COMM_FEATURE_WINDOWS: c_int = 0x2;

/// Opaque communicator handle (`struct ncclComm*`).
#[repr(C)]
pub struct ncclComm {
    _private: [u8; 0],
}
pub type ncclComm_t = *mut ncclComm;

/// Opaque window handle (`struct ncclWindow_vidmem*`).
#[repr(C)]
pub struct ncclWindow_vidmem {
    _private: [u8; 0],
}
pub type ncclWindow_t = *mut ncclWindow_vidmem;

/// Opaque parameter handle of the ncclParam* API.
#[repr(C)]
pub struct ncclParamHandle {
    _private: [u8; 0],
}
pub type ncclParamHandle_t = *mut ncclParamHandle;

/// CUDA stream (`struct CUstream_st*`), declared by the header only when CUDA's headers are absent.
#[repr(C)]
pub struct CUstream_st {
    _private: [u8; 0],
}
pub type cudaStream_t = *mut CUstream_st;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclResult_t {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclTimeout = 8,
    ncclNumResults = 9,
}

#[repr(C)]
pub enum ncclRedOp_dummy_t {
    ncclNumOps_dummy = 5,
}

#[repr(C)]
pub enum ncclRedOp_t {
    ncclSum = 0,
    ncclProd = 1,
    ncclMax = 2,
    ncclMin = 3,
    ncclAvg = 4,
    ncclNumOps = 5,
    ncclMaxRedOp = 0x7fffffff,
}

#[repr(C)]
pub enum ncclDataType_t {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
    ncclFloat8e4m3 = 10,
    ncclFloat8e5m2 = 11,
    ncclNumTypes = 12,
}

#[repr(C)]
pub enum ncclScalarResidence_t {
    ncclScalarDevice = 0,
    ncclScalarHostImmediate = 1,
}

#[repr(C)]
pub enum ncclCommMemStat_t {
    ncclStatGpuMemSuspend = 0,
    ncclStatGpuMemSuspended = 1,
    ncclStatGpuMemPersist = 2,
    ncclStatGpuMemTotal = 3,
}

/// Enum-typed arguments as they cross the boundary (see the module comment).
pub type RawResult = c_int;
pub type RawDataType = c_int;
pub type RawRedOp = c_int;
pub type RawScalarResidence = c_int;
pub type RawMemStat = c_int;

/// Communicator configuration, NCCL 2.30 layout (96 bytes). Read through `comm::config`, which
/// honours `size`, `magic` and `version` so that callers built against older headers still work.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
    pub graphUsageMode: c_int,
    pub numRmaCtx: c_int,
    pub maxP2pPeers: c_int,
    pub graphStreamOrdering: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclSimInfo_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub estimatedTime: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclWaitSignalDesc_t {
    pub opCnt: c_int,
    pub peer: c_int,
    pub sigIdx: c_int,
    pub ctx: c_int,
}
