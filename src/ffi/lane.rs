//! The short way through the calls of a one-sided ping-pong (ncclPutSignal, ncclWaitSignal),
//! and to the communicator of any call (`with_comm`).
//!
//! The full path finds the communicator's handle in the registry and the window's in the
//! window table on every call, each behind a lock and a reference count: about 40 ns of a put
//! that otherwise costs an 8-byte copy and one atomic add. Here each thread keeps the last
//! communicator and window it used and finds them again with a few plain loads. Anything out
//! of the ordinary (a group, device memory, a peer on another host or reached with CMA,
//! reserved arguments, any bad argument, a deregistered window) goes the full way, which checks
//! and reports everything: the short way only ever serves calls the full path would serve, and
//! serves them the same way.
//!
//! What a thread keeps is good while `EPOCH` has not moved: destroying or aborting a
//! communicator and deregistering a window move it, so every thread's entries go stale at once,
//! and the thread that did it drops its own at once. Only communicators without a GPU are kept
//! (a kept reference must never hold back a device's teardown).

use super::types::{ncclComm_t, ncclResult_t, ncclWaitSignalDesc_t, ncclWindow_t, RawDataType};
use crate::comm::{Comm, Life};
use crate::reduce::DataType;
use crate::window::{CommWindows, DirectPuts};
use std::cell::RefCell;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static EPOCH: AtomicU64 = AtomicU64::new(0);

struct PutKept {
    epoch: u64,
    comm: usize,
    win: usize,
    c: Arc<Comm>,
    w: DirectPuts,
}

struct WaitKept {
    epoch: u64,
    comm: usize,
    c: Arc<Comm>,
    cw: Arc<CommWindows>,
}

struct CommKept {
    epoch: u64,
    comm: usize,
    c: Arc<Comm>,
}

#[derive(Default)]
struct Kept {
    put: Option<PutKept>,
    wait: Option<WaitKept>,
    call: Option<CommKept>,
}

thread_local! {
    static KEPT: RefCell<Kept> = const { RefCell::new(Kept { put: None, wait: None, call: None }) };
}

/// Runs `body` on the communicator behind `comm`. The registry's way costs a lock and a
/// reference count, four locked instructions in all: a third of a zero-element collective's
/// time, and each one waits until the previous call's stores into a peer's FIFO have reached
/// the peer. The communicator this thread used last is kept and found again with plain loads
/// while `EPOCH` stays put. `body` may call in again (it then takes the registry's way).
pub(crate) fn with_comm<T>(
    comm: ncclComm_t,
    body: impl FnOnce(&Arc<Comm>) -> crate::error::Result<T>,
) -> crate::error::Result<T> {
    let epoch = EPOCH.load(Ordering::Acquire);
    let id = comm as usize;
    // Taken out for the call, so that a call made from inside `body` finds nothing kept.
    let kept = KEPT
        .try_with(|k| k.try_borrow_mut().ok().and_then(|mut k| k.call.take()))
        .ok()
        .flatten()
        .filter(|k| k.epoch == epoch && k.comm == id);
    let kept = match kept {
        Some(k) => k,
        None => {
            let c = super::comm_of(comm)?;
            if c.device.is_some() {
                return body(&c);
            }
            CommKept { epoch, comm: id, c }
        }
    };
    let r = body(&kept.c);
    let _ = KEPT.try_with(|k| {
        if let Ok(mut k) = k.try_borrow_mut() {
            k.call = Some(kept);
        }
    });
    r
}

/// `f` on the communicator behind `comm` when it is the one this thread used last and nothing
/// was destroyed or aborted since; false, without calling `f`, otherwise (or from inside a
/// `with_comm` body). Borrows what is kept instead of taking it out as `with_comm` does: for
/// calls that only look (a collective of zero elements).
pub(crate) fn with_kept(comm: ncclComm_t, f: impl FnOnce(&Comm) -> bool) -> bool {
    kept(comm, |c| f(c).then_some(())).is_some()
}

/// `f` on the communicator behind `comm` as `with_kept` finds it; None, without calling `f`,
/// where `with_kept` would not call it.
pub(crate) fn kept<T>(comm: ncclComm_t, f: impl FnOnce(&Comm) -> Option<T>) -> Option<T> {
    let epoch = EPOCH.load(Ordering::Acquire);
    KEPT.try_with(|k| {
        let k = k.try_borrow().ok()?;
        let k = k.call.as_ref()?;
        (k.epoch == epoch && k.comm == comm as usize)
            .then(|| f(&k.c))
            .flatten()
    })
    .ok()
    .flatten()
}

/// Makes every thread's kept entries stale (a communicator or window is going away) and drops
/// this thread's.
pub(crate) fn invalidate() {
    EPOCH.fetch_add(1, Ordering::SeqCst);
    // try_with: also called while thread-locals are being torn down.
    let _ = KEPT.try_with(|k| {
        if let Ok(mut k) = k.try_borrow_mut() {
            *k = Kept::default();
        }
    });
}

/// The communicator behind `comm` if the short way may keep it.
fn keepable(comm: ncclComm_t) -> Option<Arc<Comm>> {
    let c = super::comm_of(comm).ok()?;
    c.device.is_none().then_some(c)
}

/// ncclPutSignal the short way: true once the put and its signal are done; false, having done
/// nothing, where the full path must take the call.
///
/// # Safety
/// `src` is the C caller's buffer of `count` elements of `datatype` (or NULL).
pub(super) unsafe fn put_signal(
    comm: ncclComm_t,
    src: *const c_void,
    count: usize,
    datatype: RawDataType,
    peer: c_int,
    win: ncclWindow_t,
    off: usize,
) -> bool {
    if src.is_null() || crate::group::in_group() {
        return false;
    }
    let (Some(dt), Ok(peer)) = (DataType::from_raw(datatype), usize::try_from(peer)) else {
        return false;
    };
    let Some(len) = count.checked_mul(dt.size()) else {
        return false;
    };
    let epoch = EPOCH.load(Ordering::Acquire);
    let (comm_id, win_id) = (comm as usize, win as usize);
    KEPT.with(|k| {
        let Ok(mut k) = k.try_borrow_mut() else {
            return false;
        };
        let fresh = k
            .put
            .as_ref()
            .is_some_and(|p| p.epoch == epoch && p.comm == comm_id && p.win == win_id);
        if !fresh {
            k.put = None;
            let Some(c) = keepable(comm) else {
                return false;
            };
            let Ok(w) = crate::window::lookup(&c.window_members(), win_id) else {
                return false;
            };
            let w = DirectPuts::new(w);
            k.put = Some(PutKept {
                epoch,
                comm: comm_id,
                win: win_id,
                c,
                w,
            });
        }
        let Some(p) = k.put.as_ref() else {
            return false;
        };
        // SAFETY: as this function's.
        p.c.life() == Life::Active && unsafe { p.w.put_signal(peer, off, src.cast(), len) }
    })
}

/// ncclWaitSignal the short way: None where the full path must take the call; otherwise the
/// wait's return code (an error reported as the full path reports it).
pub(super) fn wait_signal(
    comm: ncclComm_t,
    descs: &[ncclWaitSignalDesc_t],
) -> Option<ncclResult_t> {
    if descs.is_empty() || crate::group::in_group() {
        return None;
    }
    let epoch = EPOCH.load(Ordering::Acquire);
    let comm_id = comm as usize;
    // The entry stays borrowed through the wait: this thread calls nothing else meanwhile.
    KEPT.with(|k| {
        let mut k = k.try_borrow_mut().ok()?;
        let fresh = k
            .wait
            .as_ref()
            .is_some_and(|w| w.epoch == epoch && w.comm == comm_id);
        if !fresh {
            k.wait = None;
            let c = keepable(comm)?;
            let cw = crate::window::registered_state(&c.window_members())?;
            k.wait = Some(WaitKept {
                epoch,
                comm: comm_id,
                c,
                cw,
            });
        }
        let WaitKept { c, cw, .. } = k.wait.as_ref()?;
        let plain = c.life() == Life::Active
            && descs.iter().all(|d| {
                d.opCnt > 0
                    && d.sigIdx == 0
                    && d.ctx == 0
                    && usize::try_from(d.peer).is_ok_and(|p| p < c.nranks)
            });
        if !plain {
            return None;
        }
        if let [d] = descs {
            if crate::window::took_signals(cw, d.peer as usize, d.opCnt as u64) {
                return Some(ncclResult_t::ncclSuccess);
            }
        }
        let descs = descs.iter().map(|d| (d.peer as usize, d.opCnt as u64));
        Some(
            match crate::window::wait_signals_on(&c.window_members(), cw, descs) {
                Ok(()) => ncclResult_t::ncclSuccess,
                Err(e) => super::reported("ncclWaitSignal", comm, Err(e), c.rank as i32),
            },
        )
    })
}
