//! The waiting policy of calls that wait for a peer outside the host executor's passes (a
//! receive from any source, a window's signal or flush): look without reading the clock for a
//! while, spin, give the core away, then sleep on a doorbell in naps, checking between naps
//! that the wait can still end (not aborted, the peer still there), warning once after a while
//! and failing after the timeout. The caller supplies the looking, the sleeping (with its
//! doorbell's announce-then-look-again protocol, so that a ring between the last look and the
//! sleep wakes the sleeper) and the words of its errors; the phases and their order are here.
//!
//! `FutexBell` (in `sys`, re-exported here) is the doorbell on two futex words that window
//! control segments and `transport::LocalDoorbell` ring and sleep on; `nap_on` is the announce-look-sleep step of a wait on any `Doorbell`.
//!
//! The host executor's loop (`exec::host::drive`) runs the same phases with more to weigh
//! (CPU crowding, several communicators, a peer that gave up); its parameters are the same
//! `Wiring` fields these waits take theirs from.

use crate::error::{Error, Result};
pub(crate) use crate::sys::FutexBell;
use crate::transport::Doorbell;
use std::time::{Duration, Instant};

/// How long each phase lasts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Patience {
    /// Spin (looking, with a pause instruction between looks) this long.
    pub spin: Duration,
    /// Then yield the core between looks this long.
    pub yield_for: Duration,
    /// Then sleep in naps of at most this long, checking between them.
    pub nap: Duration,
    /// Say once that the wait is long after this.
    pub warn_after: Option<Duration>,
    /// Fail after this.
    pub timeout: Option<Duration>,
}

/// Looks between clock readings: reading the clock costs about as much as a look.
const LOOKS_PER_CLOCK: u32 = 64;

/// What one wait looks for, and how it sleeps and fails.
pub(crate) trait Wait {
    type Out;
    /// Looks once: Some when the wait is over.
    fn look(&mut self) -> Result<Option<Self::Out>>;
    /// Announces the sleep on the doorbell, looks once more, and sleeps at most `nap` unless
    /// that look found the wait over (its outcome is returned).
    fn sleep(&mut self, nap: Duration) -> Result<Option<Self::Out>>;
    /// Between naps: an error when the wait can no longer end (aborted, the peer gone);
    /// Some when it ended after all (what a departed peer sent before it left still counts).
    fn check(&mut self) -> Result<Option<Self::Out>>;
    /// Says that the wait has lasted `waited`.
    fn warn(&mut self, waited: Duration);
    /// The error of a wait that timed out after `waited`.
    fn timed_out(&mut self, waited: Duration) -> Error;
}

/// Waits as `patience` says until `w` finds what it waits for, or fails.
pub(crate) fn wait<W: Wait>(patience: &Patience, w: &mut W) -> Result<W::Out> {
    let mut looks = 0u32;
    let mut began: Option<Instant> = None;
    let mut yielding = false;
    let mut warned = false;
    loop {
        if let Some(out) = w.look()? {
            return Ok(out);
        }
        looks = looks.wrapping_add(1);
        if looks % LOOKS_PER_CLOCK != 0 {
            if yielding {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let waited = began.get_or_insert_with(Instant::now).elapsed();
        if waited < patience.spin {
            continue;
        }
        if waited < patience.spin + patience.yield_for {
            yielding = true;
            continue;
        }
        if let Some(out) = w.check()? {
            return Ok(out);
        }
        if !warned && patience.warn_after.is_some_and(|after| waited >= after) {
            w.warn(waited);
            warned = true;
        }
        if patience.timeout.is_some_and(|t| waited >= t) {
            return Err(w.timed_out(waited));
        }
        if let Some(out) = w.sleep(patience.nap)? {
            return Ok(out);
        }
        // The next look reads the clock again.
        looks = LOOKS_PER_CLOCK - 1;
    }
}

/// The sleep of a `Wait` on a doorbell, with the doorbell's protocol: announce the sleep, look
/// once more (a change published before the announcement was seen is found by this look; one
/// published after it rings), then sleep at most `nap` or cancel. Returns what the look found.
pub(crate) fn nap_on<T, D: Doorbell + ?Sized>(
    bell: &D,
    nap: Duration,
    look: impl FnOnce() -> Result<Option<T>>,
) -> Result<Option<T>> {
    let seen = bell.prepare_sleep();
    match look() {
        Ok(None) => {
            bell.sleep(seen, nap);
            Ok(None)
        }
        other => {
            bell.cancel_sleep();
            other
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use std::sync::atomic::Ordering;

    /// Ready after `ready_after` looks; counts what the policy asked of it.
    #[derive(Default)]
    struct Counted {
        ready_after: Option<u32>,
        looks: u32,
        sleeps: u32,
        checks: u32,
        warnings: u32,
        gone_after_checks: Option<u32>,
    }

    impl Wait for Counted {
        type Out = u32;
        fn look(&mut self) -> Result<Option<u32>> {
            self.looks += 1;
            Ok(self
                .ready_after
                .filter(|&n| self.looks >= n)
                .map(|_| self.looks))
        }
        fn sleep(&mut self, nap: Duration) -> Result<Option<u32>> {
            self.sleeps += 1;
            if let Some(out) = self.look()? {
                return Ok(Some(out));
            }
            std::thread::sleep(nap);
            Ok(None)
        }
        fn check(&mut self) -> Result<Option<u32>> {
            self.checks += 1;
            if self.gone_after_checks.is_some_and(|n| self.checks >= n) {
                return crate::remote_err!("the peer is gone");
            }
            Ok(None)
        }
        fn warn(&mut self, _: Duration) {
            self.warnings += 1;
        }
        fn timed_out(&mut self, waited: Duration) -> Error {
            Error::new(ErrorKind::Timeout, format!("timed out after {waited:?}"))
        }
    }

    fn patience(spin_us: u64, timeout_ms: Option<u64>) -> Patience {
        Patience {
            spin: Duration::from_micros(spin_us),
            yield_for: Duration::from_micros(50),
            nap: Duration::from_millis(1),
            warn_after: Some(Duration::from_millis(5)),
            timeout: timeout_ms.map(Duration::from_millis),
        }
    }

    #[test]
    fn a_wait_that_ends_while_spinning_never_sleeps() {
        let mut w = Counted {
            ready_after: Some(10),
            ..Default::default()
        };
        assert_eq!(wait(&patience(10_000, None), &mut w).unwrap(), 10);
        assert_eq!((w.sleeps, w.checks), (0, 0));
    }

    #[test]
    fn a_long_wait_sleeps_checks_warns_once_and_times_out() {
        let mut w = Counted::default();
        let t = Instant::now();
        // Long beside the 1 ms naps, so that a loaded machine that oversleeps one nap still
        // leaves time for a second.
        let e = wait(&patience(0, Some(300)), &mut w).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.msg);
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(
            w.sleeps >= 2 && w.checks >= w.sleeps,
            "{} {}",
            w.sleeps,
            w.checks
        );
        assert_eq!(w.warnings, 1);
    }

    #[test]
    fn a_check_that_fails_ends_the_wait_with_its_error() {
        let mut w = Counted {
            gone_after_checks: Some(3),
            ..Default::default()
        };
        let e = wait(&patience(0, None), &mut w).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
        assert_eq!(w.checks, 3);
    }

    #[test]
    fn the_look_before_a_sleep_ends_the_wait() {
        // Ready on the first look after the spin: the look inside `sleep` finds it.
        let mut w = Counted::default();
        let p = patience(0, Some(10_000));
        // Nothing is ready until a sleep has begun.
        struct ReadyInSleep(Counted);
        impl Wait for ReadyInSleep {
            type Out = u32;
            fn look(&mut self) -> Result<Option<u32>> {
                self.0.look().map(|_| (self.0.sleeps > 0).then_some(7))
            }
            fn sleep(&mut self, nap: Duration) -> Result<Option<u32>> {
                self.0.sleeps += 1;
                match self.look()? {
                    Some(out) => Ok(Some(out)),
                    None => self.0.sleep(nap),
                }
            }
            fn check(&mut self) -> Result<Option<u32>> {
                self.0.check()
            }
            fn warn(&mut self, waited: Duration) {
                self.0.warn(waited)
            }
            fn timed_out(&mut self, waited: Duration) -> Error {
                self.0.timed_out(waited)
            }
        }
        w.ready_after = None;
        let mut r = ReadyInSleep(w);
        assert_eq!(wait(&p, &mut r).unwrap(), 7);
        assert_eq!(r.0.sleeps, 1);
    }

    #[test]
    fn a_ring_after_prepare_sleep_wakes_the_sleeper_and_a_ring_without_one_writes_nothing() {
        use std::sync::atomic::AtomicU32;
        let (bell, sleepers) = (AtomicU32::new(0), AtomicU32::new(0));
        let b = FutexBell {
            bell: &bell,
            sleepers: &sleepers,
        };
        b.ring();
        b.ring_after_seqcst();
        assert_eq!(bell.load(Ordering::SeqCst), 0);
        let seen = b.prepare_sleep();
        let t = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                b.ring();
            });
            b.sleep(seen, Duration::from_secs(20));
        });
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert_eq!(sleepers.load(Ordering::SeqCst), 0);
        assert_eq!(bell.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_nap_whose_look_finds_the_change_does_not_sleep() {
        use std::sync::atomic::AtomicU32;
        #[derive(Default)]
        struct Bell {
            bell: AtomicU32,
            sleepers: AtomicU32,
        }
        impl Doorbell for Bell {
            fn ring(&self) {
                FutexBell {
                    bell: &self.bell,
                    sleepers: &self.sleepers,
                }
                .ring()
            }
            fn prepare_sleep(&self) -> u32 {
                FutexBell {
                    bell: &self.bell,
                    sleepers: &self.sleepers,
                }
                .prepare_sleep()
            }
            fn cancel_sleep(&self) {
                FutexBell {
                    bell: &self.bell,
                    sleepers: &self.sleepers,
                }
                .cancel_sleep()
            }
            fn sleep(&self, seen: u32, timeout: Duration) {
                FutexBell {
                    bell: &self.bell,
                    sleepers: &self.sleepers,
                }
                .sleep(seen, timeout)
            }
        }
        let b = Bell::default();
        let t = Instant::now();
        let found = nap_on(&b, Duration::from_secs(20), || {
            assert_eq!(
                b.sleepers.load(Ordering::SeqCst),
                1,
                "the look comes after the count"
            );
            Ok(Some(3))
        });
        assert_eq!(found.unwrap(), Some(3));
        assert!(t.elapsed() < Duration::from_secs(10));
        assert_eq!(b.sleepers.load(Ordering::SeqCst), 0);
        assert_eq!(
            nap_on(&b, Duration::from_millis(5), || Ok(None::<u32>)).unwrap(),
            None
        );
        assert_eq!(b.sleepers.load(Ordering::SeqCst), 0);
    }
}
