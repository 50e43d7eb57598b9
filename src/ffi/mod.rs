//! Every `extern "C"` entry point. Each is a thin shell: check pointers, catch panics, translate
//! errors into `ncclResult_t` and remember their message for `ncclGetLastError`. The logic
//! lives in `comm`, `group` and below.

// Every raw-pointer operation is an explicit `unsafe { }` block that says why it is sound,
// even inside an `unsafe extern "C" fn`.
#![deny(unsafe_op_in_unsafe_fn)]
// Parameter names follow NCCL's header, which the generated nccl.h repeats. The entry points
// carry no `# Safety` sections: cbindgen copies their doc comments into include/nccl.h, so a
// section on each of 148 functions (64 of them the pnccl twins) would change the C header;
// their contract is NCCL's, stated once above `write_out`.
#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod coll;
pub(crate) mod config;
pub mod init;
mod lane;
pub mod mem;
pub mod param;
pub mod profiling;
pub mod types;
pub mod version;

pub use coll::*;
pub use init::*;
pub use mem::*;
pub use param::*;
pub use version::*;

use crate::comm::registry;
use crate::comm::Comm;
use crate::error::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use std::ffi::CString;
use std::os::raw::c_char;
use std::sync::Arc;
use std::sync::LazyLock;
use types::{ncclComm_t, ncclResult_t};

/// Recent error messages. `ncclGetLastError` hands out pointers into this ring, which stay
/// valid until 64 newer errors have replaced them.
struct LastErrors {
    ring: Vec<CString>,
    next: usize,
    latest: Option<usize>,
}

static LAST: LazyLock<Mutex<LastErrors>> = LazyLock::new(|| {
    Mutex::new(LastErrors {
        ring: (0..64).map(|_| CString::default()).collect(),
        next: 0,
        latest: None,
    })
});

fn remember(msg: &str) -> *const c_char {
    let mut l = LAST.lock();
    let i = l.next;
    l.ring[i] = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    l.next = (i + 1) % l.ring.len();
    l.latest = Some(i);
    l.ring[i].as_ptr()
}

thread_local! {
    /// This thread's last failure, and whether its call named a communicator.
    static THREAD_LAST: std::cell::RefCell<Option<(String, bool)>> = const { std::cell::RefCell::new(None) };
}

/// The message for `ncclGetLastError`: the communicator's last failure when one is named, else
/// this thread's, else the process's (so a watchdog thread still sees a worker's error).
pub(crate) fn last_error_ptr(comm: ncclComm_t) -> *const c_char {
    let of_comm = registry::lookup(comm as usize)
        .ok()
        .and_then(|e| e.last_error.lock().clone());
    let of_thread = THREAD_LAST.with(|t| t.borrow().clone());
    let msg = match (of_comm, of_thread) {
        // This thread's latest failure named no communicator (ncclGroupEnd without a start, a
        // NULL handle): it is what the caller asks about, whatever communicator it names (NCCL
        // ignores the argument). Answering with that communicator's older failure misled.
        (_, Some((m, false))) => Some(m),
        (Some(m), _) => Some(m),
        (None, t) => t.map(|(m, _)| m),
    };
    if let Some(msg) = msg {
        return remember(&msg);
    }
    let l = LAST.lock();
    match l.latest {
        Some(i) => l.ring[i].as_ptr(),
        None => c"".as_ptr(),
    }
}

fn code(kind: ErrorKind) -> ncclResult_t {
    match kind {
        ErrorKind::UnhandledCuda => ncclResult_t::ncclUnhandledCudaError,
        ErrorKind::System => ncclResult_t::ncclSystemError,
        ErrorKind::Internal => ncclResult_t::ncclInternalError,
        ErrorKind::InvalidArgument => ncclResult_t::ncclInvalidArgument,
        ErrorKind::InvalidUsage => ncclResult_t::ncclInvalidUsage,
        ErrorKind::Remote => ncclResult_t::ncclRemoteError,
        ErrorKind::InProgress => ncclResult_t::ncclInProgress,
        ErrorKind::Timeout => ncclResult_t::ncclTimeout,
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Records a failure of `func` so `ncclGetLastError` can report it: for this thread, for the
/// process, and for the communicator the call named (`comm`, when the handle is known).
pub(crate) fn report(func: &str, e: &Error, comm: ncclComm_t) {
    let (msg, named) = match registry::lookup(comm as usize) {
        Ok(entry) => (crate::comm::note_error(&entry.last_error, func, e), true),
        Err(_) => (format!("{func}: {}", e.msg), false),
    };
    crate::warn!("{msg}");
    remember(&msg);
    THREAD_LAST.with(|t| *t.borrow_mut() = Some((msg, named)));
    crate::group::record_error(func, e);
}

/// ncclCommGetAsyncError found the communicator failed: from now on ncclGetLastError describes
/// that failure (unless it already does), for the communicator and for this thread.
pub(crate) fn note_async_error(entry: &registry::Entry, e: &Error) {
    let mut slot = entry.last_error.lock();
    if slot.as_deref().is_some_and(|m| m.contains(&e.msg)) {
        return;
    }
    let msg = format!("asynchronous error: {}", e.msg);
    *slot = Some(msg.clone());
    remember(&msg);
    THREAD_LAST.with(|t| *t.borrow_mut() = Some((msg, true)));
}

/// Runs an entry point's body: no panic crosses the C boundary, every error becomes its code
/// and a message.
pub(crate) fn guard(func: &'static str, body: impl FnOnce() -> Result<()>) -> ncclResult_t {
    guard_on(func, std::ptr::null_mut(), body)
}

/// Like `guard`, for an entry point that names communicator `comm` without needing it ready
/// (destroy, abort, grow, the async-error query): a failure is also recorded on it.
pub(crate) fn guard_on(
    func: &'static str,
    comm: ncclComm_t,
    body: impl FnOnce() -> Result<()>,
) -> ncclResult_t {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    outcome(func, comm, r, None)
}

/// The code for how an entry point's body ended; failures are reported (inside the rank's log
/// scope when the communicator was found).
fn outcome(
    func: &'static str,
    comm: ncclComm_t,
    r: std::thread::Result<Result<()>>,
    rank: Option<i32>,
) -> ncclResult_t {
    match r {
        Ok(Ok(())) => ncclResult_t::ncclSuccess,
        Ok(Err(e)) if e.kind == ErrorKind::InProgress => ncclResult_t::ncclInProgress,
        Ok(Err(e)) => {
            let _scope = rank.map(crate::log::rank_scope);
            report(func, &e, comm);
            code(e.kind)
        }
        Err(p) => {
            let _scope = rank.map(crate::log::rank_scope);
            let e = Error::new(
                ErrorKind::Internal,
                format!("internal error (panic): {}", panic_message(&*p)),
            );
            report(func, &e, comm);
            ncclResult_t::ncclInternalError
        }
    }
}

/// The return code of an entry point on `comm` (of rank `rank`) that ran to `r` without
/// `guard_comm`; an error is reported as `guard_comm` reports it.
pub(crate) fn reported(
    func: &'static str,
    comm: ncclComm_t,
    r: Result<()>,
    rank: i32,
) -> ncclResult_t {
    outcome(func, comm, Ok(r), Some(rank))
}

/// Like `guard`, for entry points on a communicator: also records the message on it.
pub(crate) fn guard_comm(
    func: &'static str,
    comm: ncclComm_t,
    body: impl FnOnce(&Arc<Comm>) -> Result<()>,
) -> ncclResult_t {
    let mut rank: Option<i32> = None;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lane::with_comm(comm, |c| {
            rank = Some(c.rank as i32);
            let _scope = crate::log::rank_scope(c.rank as i32);
            body(c)
        })
    }));
    outcome(func, comm, r, rank)
}

/// The communicator behind a handle, ready for use.
pub(crate) fn comm_of(comm: ncclComm_t) -> Result<Arc<Comm>> {
    registry::comm_of(comm as usize)
}

/// Checks an output pointer.
pub(crate) fn out<T>(p: *mut T, name: &str) -> Result<()> {
    if p.is_null() {
        crate::invalid_arg!("{name} is NULL")
    } else {
        Ok(())
    }
}

// The C caller's contract, as NCCL's: every pointer argument is NULL or valid for what the
// function does with it (an out-parameter writable, an input array of the given length
// readable, a string NUL-terminated), aligned, and not freed or written by another thread
// during the call. The helpers below are where the library relies on it; each call site
// names the pointer it passes.

/// Writes `v` through the caller's out-parameter `p`; NULL is an invalid argument named `name`.
///
/// # Safety
/// `p` is NULL or valid for a write of one aligned `T`.
pub(crate) unsafe fn write_out<T: Copy>(p: *mut T, name: &str, v: T) -> Result<()> {
    out(p, name)?;
    // SAFETY: `p` is not NULL (checked above) and, by this function's contract, writable and
    // aligned; `T: Copy`, so the value it held needs no drop.
    unsafe { p.write(v) };
    Ok(())
}

/// The caller's input array `p` of `n` elements, borrowed for the call; NULL with `n > 0` is an
/// invalid argument named `name`. `n == 0` gives an empty slice without reading `p`.
///
/// # Safety
/// `p` is NULL or points to `n` initialized, aligned `T` that nothing writes during `'a`.
pub(crate) unsafe fn input_slice<'a, T>(p: *const T, n: usize, name: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return crate::invalid_arg!("{name} is NULL");
    }
    // SAFETY: `p` is not NULL and `n > 0` (checked above); by this function's contract it
    // points to `n` initialized `T` left alone for `'a`.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// The caller's NUL-terminated string `p`, or None when it is NULL.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that nothing writes during `'a`.
pub(crate) unsafe fn input_cstr<'a>(p: *const c_char) -> Option<&'a std::ffi::CStr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is not NULL (checked above) and, by this function's contract, a
    // NUL-terminated string left alone for `'a`.
    Some(unsafe { std::ffi::CStr::from_ptr(p) })
}

/// Converts a C int that must be a non-negative count or rank.
pub(crate) fn nonneg(v: i32, name: &str) -> Result<usize> {
    usize::try_from(v).map_or_else(
        |_| crate::invalid_arg!("{name} is {v}; it must not be negative"),
        Ok,
    )
}
