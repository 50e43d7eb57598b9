//! Failure attribution: which peer an error is about, and how an error that only says a
//! peer hung up waits briefly for the loss that explains it.

use super::engine::Exec;
use crate::error::{Error, ErrorKind};
use std::time::Duration;

/// Operations of at least this many bytes leave the links' small-message lines and pages out
/// of this core's caches and TLB (its 1536 entries map 6 MiB of small pages), and take long
/// enough that warming them again (`transport::Warm`, about 2 us on a 2-rank communicator) is lost
/// in their time.
pub(super) const WARM_AFTER: usize = 16 << 20;

/// "a, b (x3), c" from "a, b, b, b, c": a pipeline waits on many messages of one peer.
pub(super) fn count_repeats(parts: Vec<String>) -> String {
    let mut out: Vec<(String, usize)> = Vec::new();
    for p in parts {
        match out.iter_mut().find(|(q, _)| *q == p) {
            Some((_, n)) => *n += 1,
            None => out.push((p, 1)),
        }
    }
    out.iter()
        .map(|(p, n)| {
            if *n > 1 {
                format!("{p} (x{n})")
            } else {
                p.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A peer failed under a send or receive: name every other peer that is gone too, so that the
/// error reaches the cause (a root that failed because another rank died).
pub(super) fn with_other_losses(execs: &[Exec], e: Error) -> Error {
    match (e.kind, e.lost, execs) {
        (ErrorKind::Remote, Some(p), [only]) => only.with_other_losses(e, p),
        _ => e,
    }
}

/// After giving up, how long a rank listens for the rank it suspects: when that rank timed out
/// too, waiting for a third, the third is the cause, and the error names it.
pub(super) fn grace(timeout: Duration) -> Duration {
    (timeout / 2).min(Duration::from_secs(1))
}
