//! Version, unique ids, communicator lifecycle, errors and queries.

use super::types::*;
use super::{comm_of, guard, guard_comm, guard_on, input_slice, nonneg, out, write_out};
use crate::bootstrap::{self, UniqueId, UNIQUE_ID_BYTES};
use crate::comm::config::{Config, RawConfig};
use crate::comm::registry::{self, Entry};
use crate::comm::Comm;
use crate::error::{Error, ErrorKind, Result};
use crate::group;
use std::os::raw::{c_char, c_int};
use std::sync::Arc;

/// The CUDA device a host-only rank reports: there is none.
pub const NO_CUDA_DEVICE: c_int = -1;

fn id_from(id: &ncclUniqueId) -> Result<UniqueId> {
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    for (b, c) in bytes.iter_mut().zip(id.internal.iter()) {
        *b = *c as u8;
    }
    UniqueId::from_bytes(&bytes)
}

fn id_to(id: &UniqueId) -> ncclUniqueId {
    let mut out = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    for (c, b) in out.internal.iter_mut().zip(id.to_bytes().iter()) {
        *c = *b as c_char;
    }
    out
}

/// # Safety
/// `config` is NULL or the caller's `ncclConfig_t`, readable for its `size` field's bytes.
unsafe fn config_from(config: *mut ncclConfig_t) -> Result<Option<Config>> {
    // SAFETY: this function's contract is `read_raw`'s.
    match unsafe { super::config::read_raw(config) }? {
        Some(raw) => Ok(Some(Config::resolve(raw)?)),
        None => Ok(None),
    }
}

fn default_config() -> Result<Config> {
    Config::resolve(RawConfig::default())
}

/// Creates a handle for the communicator `run` makes and writes it to `out_comm` (see
/// `group::init`: now when blocking, at the end of the group inside one, in the background
/// for a non-blocking config).
///
/// # Safety
/// `out_comm` is NULL or writable (the caller's out-parameter).
unsafe fn start_init(
    out_comm: *mut ncclComm_t,
    blocking: bool,
    parent: Option<usize>,
    run: impl FnOnce() -> Result<Comm> + Send + 'static,
) -> Result<()> {
    group::init(blocking, parent, run, &mut |h| {
        // SAFETY: this function's contract.
        unsafe { write_out(out_comm, "comm", h as ncclComm_t) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    guard("ncclGetVersion", || {
        // SAFETY: `version` is the C caller's out-parameter.
        unsafe { write_out(version, "version", NCCL_VERSION_CODE) }
    })
}

/// comm extension: what this build of the library supports, as COMM_FEATURE_* bits. Lets
/// wrappers (the PyTorch backend) refuse what is missing before calling into it.
#[no_mangle]
pub unsafe extern "C" fn commGetFeatures(features: *mut c_int) -> ncclResult_t {
    guard("commGetFeatures", || {
        out(features, "features")?;
        let mut f = COMM_FEATURE_WINDOWS;
        if crate::cuda::device_count() > 0 {
            f |= COMM_FEATURE_DEVICE_MEMORY;
        }
        // SAFETY: `features` is the C caller's out-parameter.
        unsafe { write_out(features, "features", f) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
    guard("ncclGetUniqueId", || {
        out(uniqueId, "uniqueId")?;
        let id = bootstrap::new_unique_id()?;
        // SAFETY: `uniqueId` is the C caller's out-parameter.
        unsafe { write_out(uniqueId, "uniqueId", id_to(&id)) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    // SAFETY: the C caller's pointer, passed on; a NULL config is allowed.
    unsafe { ncclCommInitRankConfig(comm, nranks, commId, rank, std::ptr::null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    guard("ncclCommInitRankConfig", || {
        out(comm, "comm")?;
        let n = nonneg(nranks, "nranks")?;
        let r = nonneg(rank, "rank")?;
        if n == 0 || r >= n {
            return crate::invalid_arg!("rank {rank} is out of range for nranks {nranks}");
        }
        let id = id_from(&commId)?;
        // SAFETY: `config` is the C caller's (NULL or an ncclConfig_t).
        let cfg = unsafe { config_from(config) }?.map_or_else(default_config, Ok)?;
        let blocking = cfg.blocking;
        // The device current at the call, not when the init runs: inside a group that is at
        // ncclGroupEnd, perhaps on another thread, after the caller switched devices.
        let dev = crate::cuda::current_device();
        // SAFETY: `comm` is the C caller's out-parameter.
        unsafe {
            start_init(comm, blocking, None, move || {
                Comm::init(&[id], r, n, cfg, dev)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    newcomm: *mut ncclComm_t,
    nranks: c_int,
    myrank: c_int,
    nId: c_int,
    commIds: *mut ncclUniqueId,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    guard("ncclCommInitRankScalable", || {
        out(newcomm, "newcomm")?;
        out(commIds, "commIds")?;
        let n = nonneg(nranks, "nranks")?;
        let r = nonneg(myrank, "myrank")?;
        let k = nonneg(nId, "nId")?;
        if n == 0 || r >= n {
            return crate::invalid_arg!("myrank {myrank} is out of range for nranks {nranks}");
        }
        if k == 0 || k > n {
            return crate::invalid_arg!("nId is {nId}; it must be between 1 and nranks ({nranks})");
        }
        // SAFETY: `commIds` is the C caller's array of `nId` ids.
        let ids = unsafe { input_slice(commIds, k, "commIds") }?
            .iter()
            .map(id_from)
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: `config` is the C caller's (NULL or an ncclConfig_t).
        let cfg = unsafe { config_from(config) }?.map_or_else(default_config, Ok)?;
        let blocking = cfg.blocking;
        // The device current at the call (see ncclCommInitRankConfig).
        let dev = crate::cuda::current_device();
        // SAFETY: `newcomm` is the C caller's out-parameter.
        unsafe {
            start_init(newcomm, blocking, None, move || {
                Comm::init(&ids, r, n, cfg, dev)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comm: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    guard("ncclCommInitAll", || {
        out(comm, "comm")?;
        let n = nonneg(ndev, "ndev")?;
        if n == 0 {
            return crate::invalid_arg!("ndev is 0; ncclCommInitAll needs at least one rank");
        }
        let devices: Vec<c_int> = if devlist.is_null() {
            (0..ndev).collect()
        } else {
            // SAFETY: `devlist` is the C caller's array of `ndev` devices.
            unsafe { input_slice(devlist, n, "devlist") }?.to_vec()
        };
        let id = bootstrap::new_unique_id()?;
        let threads: Vec<_> = (0..n)
            .map(|r| {
                let id = id.clone();
                let dev = if crate::cuda::device_count() > 0 {
                    devices[r]
                } else {
                    NO_CUDA_DEVICE
                };
                std::thread::Builder::new()
                    .name(format!("comm-initall-{r}"))
                    .spawn(move || Comm::init(&[id], r, n, default_config()?, dev))
                    .map_err(|e| Error::from_io("spawn init thread", e))
            })
            .collect::<Result<_>>()?;
        let results: Vec<Result<Comm>> = threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| crate::internal_err!("init thread panicked"))
            })
            .collect();
        if let Some(e) = results.iter().find_map(|r| r.as_ref().err()) {
            return Err(e.clone());
        }
        for (r, c) in results.into_iter().enumerate() {
            let c = c.expect("checked above");
            let h = registry::insert(Entry::ready_now(c)) as ncclComm_t;
            // SAFETY: `comm` is not NULL (checked) and the C caller's array of `ndev` handles;
            // `r < ndev`.
            unsafe { comm.add(r).write(h) };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    guard_comm("ncclCommFinalize", comm, |c| c.finalize())
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    guard_on("ncclCommDestroy", comm, || {
        if comm.is_null() {
            return Ok(());
        }
        let entry = registry::remove(comm as usize)?;
        super::lane::invalidate();
        // A non-blocking initialisation still running is given up, as ncclCommAbort does:
        // waiting for it kept the caller until COMM_INIT_TIMEOUT where a peer never came.
        if entry.initializing() {
            entry.abort.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        if let Ok(c) = entry.wait() {
            c.destroy();
            crate::window::forget(&c.window_members());
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    guard_on("ncclCommAbort", comm, || {
        if comm.is_null() {
            return Ok(());
        }
        let entry = registry::remove(comm as usize)?;
        super::lane::invalidate();
        // An initialisation still running gives up at its next wait (within 100 ms).
        entry.abort.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Ok(c) = entry.wait() {
            c.abort();
            crate::window::forget(&c.window_members());
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) -> ncclResult_t {
    guard_comm("ncclCommRevoke", comm, |c| {
        if revokeFlags != NCCL_REVOKE_DEFAULT {
            return crate::invalid_arg!(
                "revokeFlags is {revokeFlags}; it must be NCCL_REVOKE_DEFAULT (0)"
            );
        }
        c.revoke();
        Ok(())
    })
}

/// Runs a derivation (split, shrink, grow) of the communicator at address `parent` and
/// writes the new handle to `newcomm` (see `group::derive`).
///
/// # Safety
/// `newcomm` is NULL or writable (the caller's out-parameter).
unsafe fn start_derive(
    newcomm: *mut ncclComm_t,
    parent: usize,
    blocking: bool,
    run: impl FnOnce() -> Result<Option<Comm>> + Send + 'static,
) -> Result<()> {
    group::derive(parent, blocking, run, &mut |h| {
        // SAFETY: this function's contract.
        unsafe { write_out(newcomm, "newcomm", h as ncclComm_t) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    guard_comm("ncclCommSplit", comm, |c| {
        out(newcomm, "newcomm")?;
        // SAFETY: `config` is the C caller's (NULL or an ncclConfig_t).
        let cfg = unsafe { config_from(config) }?;
        let blocking = cfg.as_ref().unwrap_or(&c.config).blocking;
        let c = c.clone();
        // SAFETY: `newcomm` is the C caller's out-parameter.
        unsafe {
            start_derive(newcomm, Arc::as_ptr(&c) as usize, blocking, move || {
                c.split(color, key, cfg)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: ncclComm_t,
    excludeRanksList: *mut c_int,
    excludeRanksCount: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
    shrinkFlags: c_int,
) -> ncclResult_t {
    guard_comm("ncclCommShrink", comm, |c| {
        out(newcomm, "newcomm")?;
        let count = nonneg(excludeRanksCount, "excludeRanksCount")?;
        if count > 0 && excludeRanksList.is_null() {
            return crate::invalid_arg!(
                "excludeRanksList is NULL but excludeRanksCount is {count}"
            );
        }
        if shrinkFlags & !(NCCL_SHRINK_ABORT) != 0 {
            return crate::invalid_arg!(
                "shrinkFlags is {shrinkFlags}; only NCCL_SHRINK_DEFAULT and NCCL_SHRINK_ABORT are defined"
            );
        }
        // SAFETY: `excludeRanksList` is the C caller's array of `excludeRanksCount` ranks.
        let list = unsafe { input_slice(excludeRanksList, count, "excludeRanksList") }?;
        let mut exclude = Vec::with_capacity(count);
        for (i, &r) in list.iter().enumerate() {
            let r = usize::try_from(r)
                .ok()
                .filter(|&r| r < c.nranks)
                .map_or_else(
                    || crate::invalid_arg!("excludeRanksList[{i}] = {r} is not a rank of this {}-rank communicator", c.nranks),
                    Ok,
                )?;
            if exclude.contains(&r) {
                return crate::invalid_arg!("rank {r} appears twice in excludeRanksList");
            }
            exclude.push(r);
        }
        if exclude.len() >= c.nranks {
            return crate::invalid_arg!("excludeRanksList excludes every rank");
        }
        // SAFETY: `config` is the C caller's (NULL or an ncclConfig_t).
        let cfg = unsafe { config_from(config) }?;
        let blocking = cfg.as_ref().unwrap_or(&c.config).blocking;
        let abort_first = shrinkFlags & NCCL_SHRINK_ABORT != 0;
        let c = c.clone();
        // SAFETY: `newcomm` is the C caller's out-parameter.
        unsafe {
            start_derive(newcomm, Arc::as_ptr(&c) as usize, blocking, move || {
                c.shrink(&exclude, cfg, abort_first).map(Some)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetUniqueId(
    comm: ncclComm_t,
    uniqueId: *mut ncclUniqueId,
) -> ncclResult_t {
    guard_comm("ncclCommGetUniqueId", comm, |c| {
        out(uniqueId, "uniqueId")?;
        c.check_usable()?;
        let id = id_to(&bootstrap::new_unique_id()?);
        // SAFETY: `uniqueId` is the C caller's out-parameter.
        unsafe { write_out(uniqueId, "uniqueId", id) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGrow(
    comm: ncclComm_t,
    nRanks: c_int,
    uniqueId: *const ncclUniqueId,
    rank: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    guard_on("ncclCommGrow", comm, || {
        out(newcomm, "newcomm")?;
        let n = nonneg(nRanks, "nRanks")?;
        // SAFETY: `config` is the C caller's (NULL or an ncclConfig_t).
        let cfg = unsafe { config_from(config) }?;
        // SAFETY: `uniqueId` is the C caller's (NULL or an ncclUniqueId).
        let id = match unsafe { uniqueId.as_ref() } {
            None => None,
            Some(id) => Some(id_from(id)?),
        };
        if comm.is_null() {
            // A new rank joining.
            let r = nonneg(rank, "rank")?;
            let Some(id) = id else {
                return crate::invalid_arg!("a new rank (comm NULL) must pass the unique id");
            };
            if r >= n {
                return crate::invalid_arg!("rank {rank} is out of range for nRanks {nRanks}");
            }
            let cfg = cfg.map_or_else(default_config, Ok)?;
            let blocking = cfg.blocking;
            // The device current at the call (see ncclCommInitRankConfig).
            let dev = crate::cuda::current_device();
            // SAFETY: `newcomm` is the C caller's out-parameter.
            return unsafe {
                start_init(newcomm, blocking, None, move || {
                    Comm::init(&[id], r, n, cfg, dev)
                })
            };
        }
        let c = comm_of(comm)?;
        if rank != -1 {
            return crate::invalid_arg!("an existing rank must pass rank = -1, not {rank}");
        }
        let blocking = cfg.as_ref().unwrap_or(&c.config).blocking;
        // SAFETY: `newcomm` is the C caller's out-parameter.
        unsafe {
            start_derive(newcomm, Arc::as_ptr(&c) as usize, blocking, move || {
                c.grow(n, id.as_ref(), cfg).map(Some)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
    guard_comm("ncclCommSuspend", comm, |c| {
        if flags & !NCCL_SUSPEND_MEM != 0 {
            return crate::invalid_arg!("flags is {flags}; only NCCL_SUSPEND_MEM is defined");
        }
        c.check_usable()?;
        // Host communicators hold no GPU memory to release; the state is still tracked.
        c.suspended.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommResume(comm: ncclComm_t) -> ncclResult_t {
    guard_comm("ncclCommResume", comm, |c| {
        if !c.suspended.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return crate::invalid_usage!("the communicator is not suspended");
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommMemStats(
    comm: ncclComm_t,
    stat: RawMemStat,
    value: *mut u64,
) -> ncclResult_t {
    guard_comm("ncclCommMemStats", comm, |c| {
        out(value, "value")?;
        let v = match stat {
            // No GPU memory is allocated by a host communicator.
            0 | 2 | 3 => 0,
            1 => c.suspended.load(std::sync::atomic::Ordering::SeqCst) as u64,
            _ => return crate::invalid_arg!("stat {stat} is not an ncclCommMemStat_t (0..=3)"),
        };
        // SAFETY: `value` is the C caller's out-parameter.
        unsafe { write_out(value, "value", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetErrorString(result: RawResult) -> *const c_char {
    let s: &'static std::ffi::CStr = match result {
        0 => c"no error",
        1 => c"unhandled cuda error (run with COMM_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with COMM_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the comm developers",
        4 => c"invalid argument (run with COMM_DEBUG=WARN for details)",
        5 => c"invalid usage (run with COMM_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"operation in progress",
        8 => c"timeout",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    super::last_error_ptr(comm)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: ncclComm_t,
    asyncError: *mut ncclResult_t,
) -> ncclResult_t {
    guard_on("ncclCommGetAsyncError", comm, || {
        out(asyncError, "asyncError")?;
        let entry = registry::lookup(comm as usize)?;
        let v = match entry.async_state() {
            Ok(()) => ncclResult_t::ncclSuccess,
            Err(e) => {
                if e.kind != ErrorKind::InProgress {
                    super::note_async_error(&entry, &e);
                }
                super::code(e.kind)
            }
        };
        // SAFETY: `asyncError` is the C caller's out-parameter.
        unsafe { write_out(asyncError, "asyncError", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    guard_comm("ncclCommCount", comm, |c| {
        // SAFETY: `count` is the C caller's out-parameter.
        unsafe { write_out(count, "count", c.nranks as c_int) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    guard_comm("ncclCommUserRank", comm, |c| {
        // SAFETY: `rank` is the C caller's out-parameter.
        unsafe { write_out(rank, "rank", c.rank as c_int) }
    })
}

/// The CUDA device of the rank; -1 when the rank runs without a GPU.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    guard_comm("ncclCommCuDevice", comm, |c| {
        // SAFETY: `device` is the C caller's out-parameter.
        unsafe { write_out(device, "device", c.cuda_device) }
    })
}

/// comm extension: how long this communicator's collectives, sends and receives may wait
/// without progress before they fail with ncclTimeout (COMM_TIMEOUT sets it when the
/// communicator is made); 0 for no limit. Takes effect from the next wait on. Windows keep the
/// limit they were registered with.
#[no_mangle]
pub extern "C" fn commSetTimeout(comm: ncclComm_t, seconds: f64) -> ncclResult_t {
    guard_comm("commSetTimeout", comm, |c| {
        if !seconds.is_finite() || seconds < 0.0 {
            return crate::invalid_arg!(
                "seconds is {seconds}; it must be a finite number, 0 for no limit"
            );
        }
        // Beyond what a Duration holds is no limit either.
        let limit = (seconds > 0.0)
            .then(|| std::time::Duration::try_from_secs_f64(seconds).ok())
            .flatten();
        c.wiring.timeout.set(limit);
        Ok(())
    })
}

/// comm extension: whether this communicator's later calls block until done (`blocking` 1)
/// or return ncclInProgress and complete in the background (0), as `config.blocking` chose at
/// init. For callers that made the communicator non-blocking only to bound its init (poll
/// ncclCommGetAsyncError, abort when it takes too long) and want blocking calls after it.
/// Refused while an operation is in progress.
#[no_mangle]
pub extern "C" fn commSetBlocking(comm: ncclComm_t, blocking: c_int) -> ncclResult_t {
    guard_comm("commSetBlocking", comm, |c| {
        if blocking != 0 && blocking != 1 {
            return crate::invalid_arg!("blocking is {blocking}; it must be 0 or 1");
        }
        let _held = c.gate.enter(&c.wiring.cache)?;
        c.set_blocking(blocking == 1);
        Ok(())
    })
}

/// Re-reads logging settings in NCCL; logging here is configured once per process, so this
/// does nothing (NCCL itself marks it deprecated).
#[no_mangle]
pub extern "C" fn ncclResetDebugInit() {}
