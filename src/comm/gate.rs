//! Who may call into a communicator now.
//!
//! NCCL communicators are not thread-safe: calls on one communicator come one at a time, from
//! any thread (PyTorch's backends hand a communicator from thread to thread, one call after
//! the other). Two threads inside calls on one communicator at once would number their
//! operations in whatever order they happened to run, and the ranks could pair different
//! calls with each other: the second caller is refused instead, told the rule.
//!
//! A non-blocking communicator (`config.blocking = 0`) runs its operations in the background:
//! the call returns `ncclInProgress` and the operation holds the gate until it completes, as
//! `ncclCommGetAsyncError` reports; a call made before then is refused the same way.

use crate::error::Result;
use std::sync::atomic::{AtomicU8, Ordering};

const FREE: u8 = 0;
/// A thread is inside a call.
const CALLING: u8 = 1;
/// A non-blocking operation runs in the background.
const BACKGROUND: u8 = 2;

#[derive(Default)]
pub(crate) struct Gate {
    state: AtomicU8,
}

/// The gate held by one call; opened again when dropped.
pub(crate) struct Held<'a> {
    gate: &'a Gate,
}

impl Gate {
    /// Enters a call, or refuses it while another call or a background operation holds the
    /// communicator (the entry point's name heads the message where the error is reported).
    pub(crate) fn enter(&self) -> Result<Held<'_>> {
        match self
            .state
            .compare_exchange(FREE, CALLING, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => Ok(Held { gate: self }),
            Err(BACKGROUND) => crate::invalid_usage!(
                "called while an earlier operation of this non-blocking communicator is still in progress; poll ncclCommGetAsyncError until it returns ncclSuccess before the next call"
            ),
            Err(_) => crate::invalid_usage!(
                "called while another thread is inside a call on this communicator; calls on one communicator must come one at a time (from any thread, one after the other), or the ranks may pair different operations"
            ),
        }
    }

    /// Whether a non-blocking operation is still running.
    pub(crate) fn in_progress(&self) -> bool {
        self.state.load(Ordering::Acquire) == BACKGROUND
    }
}

impl Held<'_> {
    /// Hands the gate to a background operation: it stays shut until `release_background`.
    pub(crate) fn hand_to_background(self) {
        self.gate.state.store(BACKGROUND, Ordering::Release);
        std::mem::forget(self);
    }
}

impl Gate {
    /// The background operation is done (whatever its outcome).
    pub(crate) fn release_background(&self) {
        self.state.store(FREE, Ordering::Release);
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.gate.state.store(FREE, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn a_second_caller_is_refused_and_the_gate_opens_after_each_call() {
        let g = Gate::default();
        let held = g.enter().unwrap();
        let e = g.enter().err().unwrap();
        assert_eq!(e.kind, ErrorKind::InvalidUsage);
        assert!(e.msg.contains("another thread"), "{}", e.msg);
        drop(held);
        let held = g.enter().unwrap();
        held.hand_to_background();
        assert!(g.in_progress());
        let e = g.enter().err().unwrap();
        assert!(e.msg.contains("ncclCommGetAsyncError"), "{}", e.msg);
        g.release_background();
        assert!(!g.in_progress());
        drop(g.enter().unwrap());
    }
}
