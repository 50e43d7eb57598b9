//! Where windows are found: the communicators' window state and the windows by handle.

use super::register::retire;
use super::{CommWindows, Members, Window};
use crate::error::Result;
use parking_lot::Mutex;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// Window state by (communicator tag, rank); a few entries, so a list.
pub(super) type CommKey = (u64, usize);

pub(super) static COMMS: Mutex<Vec<(CommKey, Arc<CommWindows>)>> = Mutex::new(Vec::new());

pub(super) fn find_comm(c: &Members) -> Option<Arc<CommWindows>> {
    let k = key(c);
    COMMS.lock().iter().find(|e| e.0 == k).map(|e| e.1.clone())
}

/// Live windows of this process, by handle number (handles are never reused).
pub(super) static WINDOWS: Mutex<Vec<Option<Arc<Window>>>> = Mutex::new(Vec::new());

pub(super) static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(1);

pub(super) const HANDLE_BASE: usize = 0x3a11_0000_0000;

pub(super) const HANDLE_STEP: usize = 0x40;

pub(super) fn handle_number(handle: usize) -> Option<usize> {
    let n = handle.checked_sub(HANDLE_BASE)?;
    (n % HANDLE_STEP == 0).then_some(n / HANDLE_STEP)
}

/// The live window with this handle, whatever its communicator.
pub(crate) fn window_by_handle(handle: usize) -> Option<Arc<Window>> {
    let n = handle_number(handle)?;
    WINDOWS.lock().get(n).cloned().flatten()
}

pub(super) fn key(c: &Members) -> (u64, usize) {
    (c.tag, c.rank)
}

pub(super) fn existing(c: &Members, what: &str) -> Result<Arc<CommWindows>> {
    match find_comm(c) {
        Some(cw) => Ok(cw),
        None => crate::invalid_usage!(
            "{what} needs a window: register one on this communicator first (ncclCommWindowRegister is collective)"
        ),
    }
}

/// The window behind `handle`, which must belong to communicator `c`.
pub(crate) fn lookup(c: &Members, handle: usize) -> Result<Arc<Window>> {
    match window_by_handle(handle) {
        Some(w) if w.comm == key(c) => Ok(w),
        Some(_) => crate::invalid_arg!(
            "window {handle:#x} was registered on another communicator; use a window of this one"
        ),
        None => crate::invalid_arg!(
            "window {handle:#x} is not a live window (never registered, or already deregistered)"
        ),
    }
}

/// The communicator is going away (destroy, abort): its windows go with it, memory allocated
/// with them is freed, its listener stops and its connections close.
pub(crate) fn forget(c: &Members) {
    let k = key(c);
    COMMS.lock().retain(|e| e.0 != k);
    let gone: Vec<Arc<Window>> = WINDOWS
        .lock()
        .iter_mut()
        .filter(|w| w.as_ref().is_some_and(|w| w.comm == k))
        .filter_map(Option::take)
        .collect();
    for w in gone {
        retire(&w);
    }
}

/// This rank's own address of the window.
pub(crate) fn user_ptr(c: &Members, handle: usize) -> Result<usize> {
    let w = lookup(c, handle)?;
    Ok(w.peers[c.rank].addr)
}

/// The communicator's window state, once it has registered a window.
pub(crate) fn registered_state(c: &Members) -> Option<Arc<CommWindows>> {
    find_comm(c)
}
