//! How a large two-rank all-reduce out of place on one host sends each folded slice back
//! (`algo::ring::FUSE_FROM`): forwarded through the FIFO's slots as it folds
//! (`Reply::next`: the folded bytes go into shared lines the peer reads next, and into the
//! receive buffer with non-temporal stores) or written back into the peer's receive buffer
//! (`Offer::reply_at`, a kernel copy into lines no cache holds).
//!
//! Which is faster changes from run to run and within a run. Forwarding moves every byte
//! between the two cores' caches and writes less memory; two processes pinned on a 2-vCPU VM,
//! 64 MiB: forwarding took 12.4-13.9 ms in most runs and 20-30 ms in others (one of them
//! with a cache line's round trip between the vCPUs at 560 ns, against 60-150 ns otherwise:
//! the host moves the vCPUs), and in one sweep the 128 MiB calls forwarded in 55-63 ms after
//! 64 MiB ones in 12-14; writing back took 16-20 ms (29-35 at 128 MiB) in every run. Nothing
//! inside the VM tells which state holds, so the executor times the calls and takes the way
//! measured faster lately, trying the other now and then (`Replies`).

use std::time::Duration;

/// A way of sending the folded bytes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Way {
    Forward,
    WriteBack,
}

impl Way {
    fn other(self) -> Way {
        match self {
            Way::Forward => Way::WriteBack,
            Way::WriteBack => Way::Forward,
        }
    }

    fn index(self) -> usize {
        match self {
            Way::Forward => 0,
            Way::WriteBack => 1,
        }
    }
}

/// COMM_SHM_REPLY: one way always, or whichever measured faster (the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum Setting {
    #[default]
    Auto,
    Always(Way),
}

impl Setting {
    /// From COMM_SHM_REPLY.
    pub(crate) fn from_env() -> crate::error::Result<Setting> {
        match crate::env::SHM_REPLY.text().as_deref() {
            None | Some("") => Ok(Setting::Auto),
            Some(s) if s.eq_ignore_ascii_case("auto") => Ok(Setting::Auto),
            Some(s) if s.eq_ignore_ascii_case("forward") => Ok(Setting::Always(Way::Forward)),
            Some(s) if s.eq_ignore_ascii_case("writeback") => Ok(Setting::Always(Way::WriteBack)),
            Some(s) => crate::invalid_arg!(
                "COMM_SHM_REPLY={s} is not a way to send folded bytes back (auto, forward, writeback)"
            ),
        }
    }
}

/// Every this many timed calls, the way not in favour runs once, so that a change of
/// placement is noticed. At the 2x between the ways in a bad placement this costs about 6 %
/// of the calls' time, at the 1.4x of a good one about 3 %.
pub(crate) const TRY_OTHER_EVERY: u64 = 16;

/// Times kept per way; the estimate is their median (the lower of two), so that one call
/// slowed by something else (a page collapse, a rank descheduled) does not decide.
const KEEP: usize = 3;

/// Times each way takes first, before one is chosen by them.
const FIRST: usize = 2;

/// The last few times of each way, in nanoseconds per byte of the operation.
#[derive(Clone, Debug, Default)]
pub(crate) struct Replies {
    setting: Setting,
    /// Timed calls so far. Both ranks time the same calls, so they try the other way in the
    /// same call.
    timed: u64,
    times: [Kept; 2],
}

#[derive(Clone, Copy, Debug, Default)]
struct Kept {
    ns_per_byte: [f64; KEEP],
    len: usize,
    next: usize,
}

impl Kept {
    fn push(&mut self, v: f64) {
        self.ns_per_byte[self.next] = v;
        self.next = (self.next + 1) % KEEP;
        self.len = (self.len + 1).min(KEEP);
    }

    fn estimate(&self) -> Option<f64> {
        let mut v = self.ns_per_byte;
        let v = &mut v[..self.len];
        v.sort_by(f64::total_cmp);
        v.get((self.len.max(1) - 1) / 2).copied()
    }
}

impl Replies {
    pub(crate) fn new(setting: Setting) -> Replies {
        Replies {
            setting,
            ..Default::default()
        }
    }

    /// The way for the next call: a fixed setting's, else each way in turn until both have
    /// `FIRST` times, then the one with the lower estimate, but the other every
    /// `TRY_OTHER_EVERY` calls.
    pub(crate) fn choose(&self) -> Way {
        if let Setting::Always(w) = self.setting {
            return w;
        }
        let [f, b] = &self.times;
        if f.len < FIRST || b.len < FIRST {
            return if f.len <= b.len {
                Way::Forward
            } else {
                Way::WriteBack
            };
        }
        let (f, b) = (f.estimate().unwrap_or(0.0), b.estimate().unwrap_or(0.0));
        let best = if f <= b { Way::Forward } else { Way::WriteBack };
        if self.timed % TRY_OTHER_EVERY == TRY_OTHER_EVERY - 1 {
            best.other()
        } else {
            best
        }
    }

    /// A call that sent folded bytes back took `took` for `bytes` bytes, going `way`.
    pub(crate) fn record(&mut self, way: Way, took: Duration, bytes: usize) {
        if bytes == 0 {
            return;
        }
        self.timed += 1;
        self.times[way.index()].push(took.as_nanos() as f64 / bytes as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    const MIB64: usize = 64 << 20;

    /// Runs `calls` calls, each timed by `time(way, call)`; returns the ways taken.
    fn run(r: &mut Replies, calls: usize, time: impl Fn(Way, usize) -> f64) -> Vec<Way> {
        (0..calls)
            .map(|c| {
                let w = r.choose();
                r.record(w, ms(time(w, c)), MIB64);
                w
            })
            .collect()
    }

    #[test]
    fn each_way_is_tried_then_the_faster_kept_but_for_a_look_at_the_other() {
        let mut r = Replies::default();
        let ways = run(&mut r, 64, |w, _| match w {
            Way::Forward => 13.0,
            Way::WriteBack => 18.0,
        });
        assert_eq!(
            &ways[..4],
            &[Way::Forward, Way::WriteBack, Way::Forward, Way::WriteBack]
        );
        let back: Vec<usize> = (0..64).filter(|&c| ways[c] == Way::WriteBack).collect();
        // Calls 1 and 3 tried it; then once in every TRY_OTHER_EVERY calls.
        assert_eq!(back, vec![1, 3, 15, 31, 47, 63], "{ways:?}");
    }

    #[test]
    fn a_change_of_placement_turns_the_choice_around_within_a_few_looks() {
        let mut r = Replies::default();
        // Forwarding fast for 64 calls, then twice as slow as writing back.
        let ways = run(&mut r, 192, |w, c| match (w, c < 64) {
            (Way::Forward, true) => 13.0,
            (Way::Forward, false) => 30.0,
            (Way::WriteBack, _) => 18.0,
        });
        // Two slow calls forwarding outvote the fast one kept: from then on only the looks
        // forward.
        for (c, &w) in ways.iter().enumerate().skip(66) {
            let looks = c as u64 % TRY_OTHER_EVERY == TRY_OTHER_EVERY - 1;
            assert_eq!(w == Way::Forward, looks, "call {c}: {ways:?}");
        }
        // And back within two looks when forwarding is fast again.
        let ways = run(&mut r, 96, |w, _| match w {
            Way::Forward => 12.0,
            Way::WriteBack => 18.0,
        });
        for (c, &w) in ways.iter().enumerate().skip(2 * TRY_OTHER_EVERY as usize) {
            let looks = (192 + c) as u64 % TRY_OTHER_EVERY == TRY_OTHER_EVERY - 1;
            assert_eq!(w == Way::WriteBack, looks, "call {c}: {ways:?}");
        }
    }

    #[test]
    fn one_slow_call_does_not_decide() {
        let mut r = Replies::default();
        // The first calls are slow for reasons of their own (pages collapsed, say).
        let ways = run(&mut r, 40, |w, c| match (w, c) {
            (_, 0 | 1) => 90.0,
            (Way::Forward, 20) => 200.0,
            (Way::Forward, _) => 13.0,
            (Way::WriteBack, _) => 18.0,
        });
        // Calls 2 and 3 took both ways again.
        for (c, w) in ways.iter().enumerate().skip(4) {
            let looks = c as u64 % TRY_OTHER_EVERY == TRY_OTHER_EVERY - 1;
            assert_eq!(*w == Way::WriteBack, looks, "call {c}: {ways:?}");
        }
    }

    #[test]
    fn a_fixed_setting_is_kept_whatever_the_times() {
        for w in [Way::Forward, Way::WriteBack] {
            let mut r = Replies::new(Setting::Always(w));
            let ways = run(&mut r, 40, |x, _| if x == w { 100.0 } else { 1.0 });
            assert!(ways.iter().all(|&x| x == w));
        }
    }

    #[test]
    fn the_estimate_is_the_median_of_the_last_three() {
        let mut k = Kept::default();
        assert_eq!(k.estimate(), None);
        k.push(5.0);
        assert_eq!(k.estimate(), Some(5.0));
        k.push(1.0);
        assert_eq!(k.estimate(), Some(1.0));
        k.push(9.0);
        assert_eq!(k.estimate(), Some(5.0));
        k.push(7.0); // 5 drops out: 1, 9, 7
        assert_eq!(k.estimate(), Some(7.0));
    }
}
