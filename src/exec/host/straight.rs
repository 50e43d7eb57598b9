//! The fast path for repeated small calls: a call's steps tried in order, straight on their
//! links, before the engine is built; and local steps.

use super::blame::{with_other_losses, WARM_AFTER};
use super::drive::drive;
use super::engine::{Exec, STREAM_FROM};
use super::placement::{publish, this_cpu};
use super::plan::{Action, Reuse};
use super::sink::{combine, copy_scaled, finish};
use super::{ExecCache, Repeat, Wiring};
use crate::error::{Error, ErrorKind, Result};
use crate::exec::op::Reduction;
use crate::exec::replies::Way;
use crate::sys;
use crate::topo::Activity;
use crate::transport::SendState;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// A local step: a copy or a reduction of this rank's own buffers.
pub(super) fn run_local(action: Action, reduction: Option<Reduction>) -> Result<()> {
    let Action::Local {
        dst,
        len,
        a,
        b,
        last,
    } = action
    else {
        unreachable!("local list holds a non-local step")
    };
    // SAFETY: every pointer covers `len` bytes of a validated buffer or of scratch; the
    // hazard rules guarantee nothing else touches them now; exact aliases are handled by
    // the in-place forms and partial overlaps were rejected at validation.
    unsafe {
        match b {
            None => copy_scaled(dst, a, len, reduction),
            Some(b) => {
                let red = reduction.ok_or_else(|| {
                    Error::new(ErrorKind::Internal, "local reduction without an op")
                })?;
                combine(dst, a, b, len, &red.reducer);
            }
        }
        finish(dst, len, last, reduction);
    }
    Ok(())
}

/// A repeated call's steps tried in order, each straight on its link or locally, for as long
/// as each finishes at once: what the executor's passes would do, without building it, which
/// costs more than the steps themselves in small calls. An 8-byte two-rank broadcast took
/// about 1330 instructions a call at the root and 1420 at the other rank, of which the link's
/// send or receive 230-390; tried this way, 890-1010 and 1050 (callgrind). With four ranks the
/// root sends to two peers and a rank between receives and passes on: tried only when a call
/// was one send or receive, they took 1820 and 2090 instructions a call; 1240 and 1300 now.
/// Returns whether the run is done; when it is not, the steps keep what the try did
/// (`Tables::tried`: which finished, the progress of the others) and the executor goes on
/// from there. False, having tried nothing, for a run it does not take: one of several
/// operations, one not run before on this plan, one whose buffers are large enough to move
/// onto huge pages, or one that forwards folded bytes (only the executor sees which receive
/// may).
///
/// Steps wait only for earlier ones (`Hazards`), so in order each finds what it waits for
/// done. Past a step that did not finish, the try goes on only with sends that wait for
/// nothing unfinished, to peers none of whose sends stayed behind: each peer's messages keep
/// their order, and peers get what they wait for as soon as the executor would give it. A
/// local step that nothing waits for (an all-gather's own block) runs last, once every link
/// step finished, as the executor runs local steps after its sends.
pub(super) fn straight(wiring: &Wiring, cache: &mut ExecCache) -> Result<bool> {
    cache.recall();
    let ExecCache {
        scratch,
        tables: t,
        built,
        ..
    } = cache;
    let ([op], Some(b)) = (t.ops.as_slice(), built.as_mut()) else {
        return Ok(false);
    };
    // Buffers large enough to move onto huge pages take the executor's way, which moves them
    // (a range is moved the second time it is seen, so it must be seen once a call).
    let huge = |len: usize| wiring.huge_pages_from.is_some_and(|m| len >= m);
    if huge(op.extent()) || huge(op.schedule.scratch) {
        return Ok(false);
    }
    // A receive forwards only when the executor sees the reply queued behind it.
    let stream = op.schedule.recv_extent >= STREAM_FROM;
    if stream
        && t.plan
            .steps
            .iter()
            .filter(|s| !matches!(s.action, Action::Local { .. }))
            .nth(1)
            .is_some()
    {
        return Ok(false);
    }
    let scratch = scratch.as_mut_ptr() as *mut u8;
    let reuse = b.reuse(op, scratch, t.plan.steps.len());
    if reuse == Reuse::Nothing {
        return Ok(false);
    }
    if reuse == Reuse::Structure {
        b.take_buffers(op, scratch, &mut t.plan.steps);
    }
    for (s, &w) in t.plan.steps.iter_mut().zip(b.hazards.waiting_on.iter()) {
        s.restart(w);
    }
    // Peers (a bit each, all from the 128th on) whose next send waits behind one that has
    // not finished: later sends to them wait too.
    let bit = |peer: usize| if peer < 128 { 1u128 << peer } else { u128::MAX };
    let mut closed = 0u128;
    // Every step so far finished: receives and local steps go on only while so, sends
    // whose turn and inputs have come go on regardless (the executor posts them first too).
    let mut all = true;
    let mut deferred = false;
    for k in 0..t.plan.steps.len() {
        let x = &mut t.plan.steps[k];
        let finished = match x.action {
            Action::Send { peer, .. } => {
                let complete = closed & bit(peer) == 0 && x.waiting_on == 0 && {
                    let p = x.send_on(&wiring.links, op, op.schedule.copies_in)?;
                    p.state == SendState::Complete
                };
                if !complete {
                    closed |= bit(peer);
                }
                complete
            }
            Action::Recv { .. } => {
                all && x.waiting_on == 0 && {
                    let links = &wiring.links;
                    x.receive(links, op.tag, op.reduction, stream, false, false)?
                        .state
                }
            }
            // Last, if every link step finishes (see above).
            Action::Local { .. } if x.dependents == 0 => {
                deferred = true;
                continue;
            }
            Action::Local { .. } => {
                all && x.waiting_on == 0 && {
                    run_local(x.action, op.reduction)?;
                    true
                }
            }
        };
        if !finished {
            all = false;
            continue;
        }
        x.finished = true;
        let (from, n) = (x.first_dependent as usize, x.dependents as usize);
        for &d in &t.edges[from..from + n] {
            t.plan.steps[d as usize].waiting_on -= 1;
        }
    }
    if all && deferred {
        // Every other step finished, so these wait for nothing.
        for x in t.plan.steps.iter_mut() {
            if !x.finished {
                run_local(x.action, op.reduction)?;
                x.finished = true;
            }
        }
    }
    #[cfg(test)]
    STRAIGHT_RUNS.with(|c| {
        let mut v = c.get();
        let some = t.plan.steps.iter().any(|s| s.finished);
        v[if all { 0 } else { 1 + usize::from(some) }] += 1;
        c.set(v);
    });
    t.tried = !all;
    Ok(all)
}

#[cfg(test)]
thread_local! {
    /// Runs this thread's `straight` tried: [finished there, handed over to the executor at
    /// the first step, handed over later].
    pub(super) static STRAIGHT_RUNS: std::cell::Cell<[u32; 3]> = const { std::cell::Cell::new([0; 3]) };
}

/// Runs the one operation in `cache.tables.ops`, then warms the links again after a `large`
/// one (see `WARM_AFTER`). An operation out of place large enough to forward its folded bytes
/// (`STREAM_FROM`) goes the way `ExecCache::replies` chooses and is timed for it; in place,
/// folded bytes are written back into the lines the pull just read and the schedule does not
/// forward, and smaller calls cannot afford a look at the clock.
pub(super) fn run_alone(wiring: &Wiring, cache: &mut ExecCache, large: bool) -> Result<()> {
    let op = &cache.tables.ops[0];
    let timed =
        (op.schedule.recv_extent >= STREAM_FROM && !std::ptr::eq(op.send, op.recv)).then(|| {
            let advised = sys::PAGES_ADVISED.load(Ordering::Relaxed);
            (cache.replies.choose(), advised, Instant::now())
        });
    cache.tables.forward_first = matches!(timed, Some((Way::Forward, ..)));
    cache.tables.could_forward = false;
    if timed.is_none() && !large {
        match straight(wiring, cache) {
            Ok(false) => {}
            Ok(true) => {
                if let (Some(p), Some(cpu)) = (&wiring.presence, this_cpu()) {
                    p.set_running_on(cpu, Activity::Outside);
                }
                return Ok(());
            }
            Err(e) => {
                let exec = Exec::new(wiring, cache)?;
                let e = with_other_losses(std::slice::from_ref(&exec), e);
                publish(std::slice::from_ref(&exec), Activity::Outside);
                return Err(e);
            }
        }
    }
    drive(std::slice::from_mut(&mut Exec::new(wiring, cache)?))?;
    if let Some((way, advised, start)) = timed {
        // A call that moved pages onto huge pages is slow for that, whichever way it took.
        if cache.tables.could_forward && sys::PAGES_ADVISED.load(Ordering::Relaxed) == advised {
            let bytes = cache.tables.ops[0].extent();
            cache.replies.record(way, start.elapsed(), bytes);
        }
    }
    if large {
        wiring.warm_links();
    }
    Ok(())
}

/// Runs the last call again on the buffers `send` and `recv` when `key` is its key and its
/// footprint admits them (`run_one`), numbered `seq()`: the operation is kept and takes the
/// new buffers and number (its tag is the same call's, so it keeps kind, root, datatype and
/// op); its steps, on the same buffers, are kept too and only their progress is reset. None,
/// having done nothing, when the last run was another call (or failed).
#[cfg(test)]
pub(crate) fn run_again(
    wiring: &Wiring,
    key: &Repeat,
    send: *const u8,
    recv: *mut u8,
    seq: impl FnOnce() -> u64,
) -> Option<Result<()>> {
    run_again_in(wiring, &mut wiring.cache.lock(), key, send, recv, seq)
}

/// `run_again`, on the communicator's executor cache, which the caller holds (`comm::gate`).
pub(crate) fn run_again_in(
    wiring: &Wiring,
    cache: &mut ExecCache,
    key: &Repeat,
    send: *const u8,
    recv: *mut u8,
    seq: impl FnOnce() -> u64,
) -> Option<Result<()>> {
    // Looked at in place: moving the key out and back costs more than the look.
    let (k, f) = cache.repeat.as_ref()?;
    if *k != *key || !f.admits(send as usize, recv as usize) {
        return None;
    }
    let op = &mut cache.tables.ops[0];
    op.send = send;
    op.recv = recv;
    op.tag = crate::tag::renumbered(op.tag, seq());
    let large = op.extent() >= WARM_AFTER;
    let r = run_alone(wiring, cache, large);
    if r.is_err() {
        cache.repeat = None;
    }
    Some(r)
}
