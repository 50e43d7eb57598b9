//! Who may call into a communicator now.
//!
//! NCCL communicators are not thread-safe: calls on one communicator come one at a time, from
//! any thread (PyTorch's backends hand a communicator from thread to thread, one call after
//! the other). Two threads inside calls on one communicator at once would number their
//! operations in whatever order they happened to run, and the ranks could pair different
//! calls with each other: the second caller is refused instead, told the rule.
//!
//! The gate is the executor's cache, which every call on host memory needs anyway: a call
//! takes it with `try_lock` before its operation is numbered and keeps it until the operation
//! ends, so a second caller finds it taken and is refused, at no cost beyond the lock a call
//! already took. A non-blocking communicator (`config.blocking = 0`) runs its operations in
//! the background: the call returns `ncclInProgress` and `background` stays set until the
//! operation ends, as `ncclCommGetAsyncError` reports; a call made before then is refused the
//! same way.

use crate::error::Result;
use crate::exec::host::ExecCache;
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Default)]
pub(crate) struct Gate {
    /// A non-blocking operation runs in the background (read by every call: an atomic).
    background: AtomicBool,
    /// Where `wait_background` sleeps until `release_background`.
    ended: Mutex<()>,
    ended_cv: Condvar,
}

impl Gate {
    /// Enters a call: the executor cache `cache`, or a refusal while another call holds it or a
    /// background operation runs (the entry point's name heads the message where the error is
    /// reported).
    pub(crate) fn enter<'a>(
        &self,
        cache: &'a Mutex<ExecCache>,
    ) -> Result<MutexGuard<'a, ExecCache>> {
        // Asked before the cache too: a background operation holds the cache while it runs,
        // and a call made meanwhile is told that, not that another thread is inside a call.
        // Asked again once the cache is held, for an operation sent to the background between
        // the two looks (`start_background` comes before that call lets the cache go).
        if self.background.load(Ordering::Acquire) {
            return still_in_progress();
        }
        let Some(held) = cache.try_lock() else {
            return crate::invalid_usage!(
                "called while another thread is inside a call on this communicator; calls on one communicator must come one at a time (from any thread, one after the other), or the ranks may pair different operations"
            );
        };
        if self.background.load(Ordering::Acquire) {
            return still_in_progress();
        }
        Ok(held)
    }

    /// Whether a non-blocking operation is still running.
    pub(crate) fn in_progress(&self) -> bool {
        self.background.load(Ordering::Acquire)
    }

    /// A call that holds the cache (`enter`) hands its operation to the background: calls are
    /// refused until `release_background`, though the cache itself is let go for the thread
    /// that runs it.
    pub(crate) fn start_background(&self) {
        self.background.store(true, Ordering::Release);
    }

    /// The background operation is done (whatever its outcome).
    pub(crate) fn release_background(&self) {
        let _ended = self.ended.lock();
        self.background.store(false, Ordering::Release);
        self.ended_cv.notify_all();
    }

    /// Returns once no background operation runs: after destroy or abort (which stop it), the
    /// caller may free the buffers it used.
    pub(crate) fn wait_background(&self) {
        let mut ended = self.ended.lock();
        while self.background.load(Ordering::Acquire) {
            self.ended_cv.wait(&mut ended);
        }
    }
}

#[cold]
fn still_in_progress<T>() -> Result<T> {
    crate::invalid_usage!(
        "called while an earlier operation of this non-blocking communicator is still in progress; poll ncclCommGetAsyncError until it returns ncclSuccess before the next call"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn a_second_caller_is_refused_and_the_gate_opens_after_each_call() {
        let g = Gate::default();
        let cache = Mutex::new(ExecCache::default());
        let held = g.enter(&cache).unwrap();
        let e = g.enter(&cache).err().unwrap();
        assert_eq!(e.kind, ErrorKind::InvalidUsage);
        assert!(e.msg.contains("another thread"), "{}", e.msg);
        drop(held);
        let held = g.enter(&cache).unwrap();
        g.start_background();
        drop(held);
        assert!(g.in_progress());
        let e = g.enter(&cache).err().unwrap();
        assert!(e.msg.contains("ncclCommGetAsyncError"), "{}", e.msg);
        // The background operation holding the cache, as it does while it runs.
        let running = cache.lock();
        let e = g.enter(&cache).err().unwrap();
        assert!(e.msg.contains("ncclCommGetAsyncError"), "{}", e.msg);
        drop(running);
        std::thread::scope(|s| {
            s.spawn(|| g.release_background());
            g.wait_background();
        });
        assert!(!g.in_progress());
        drop(g.enter(&cache).unwrap());
    }
}
