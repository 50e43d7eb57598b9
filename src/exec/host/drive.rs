//! The driving loop: passes over every communicator's steps, spinning, yielding and sleeping
//! on the doorbell, until all are done, one fails, the call is aborted or times out.

use super::blame::{grace, with_other_losses};
use super::engine::Exec;
use super::placement::{crowded, hold_for_sleep, peer_asleep, publish, WAKE_GRACE};
use crate::error::{Error, ErrorKind, Result};
use crate::topo::Activity;
use std::time::{Duration, Instant};

/// Progresses every communicator's steps until all are done or one fails.
pub(super) fn drive(execs: &mut [Exec]) -> Result<()> {
    let r = drive_steps(execs);
    // Back to the application: peers must not take a long absence for a stall, but one that
    // finds itself on this rank's CPU knows the rank waits for it.
    publish(execs, Activity::Outside);
    r
}

/// One pass over every communicator's steps: whether anything moved, and whether all are done.
pub(super) fn pass_all(execs: &mut [Exec]) -> Result<(bool, bool)> {
    let mut moved = false;
    for e in execs.iter_mut() {
        moved |= e.pass()?;
    }
    Ok((moved, execs.iter().all(|e| e.remaining == 0)))
}

pub(super) fn drive_steps(execs: &mut [Exec]) -> Result<()> {
    // A small call often finishes on its first pass: that pass comes before the state that
    // waiting needs.
    if pass_all(execs).map_err(|e| with_other_losses(execs, e))?.1 {
        return Ok(());
    }
    let mut started: Option<Instant> = None;
    let mut idle_since: Option<Instant> = None;
    let mut last_check: Option<Instant> = None;
    let mut spins = 0u32;
    let mut moves = 0u32;
    let mut warned = false;
    // Once this rank has given up: until when it listens, its own error, and which
    // communicator gave up.
    let mut gave_up: Option<(Instant, Error, usize)> = None;
    loop {
        if let Some((until, own, i)) = &gave_up {
            let e = &execs[*i];
            let me = e.wiring.rank;
            // A network link learns of a close by reading it: look at the next header too.
            let told = own.lost.map(|s| {
                let link = &e.wiring.links[s];
                (s, link.check_peer().and_then(|_| link.peek().map(|_| ())))
            });
            match told {
                Some((suspect, Err(theirs))) if theirs.lost.is_some_and(|l| l != me) => {
                    crate::info!("rank {me}: rank {suspect} gave up too: {}", theirs.msg);
                    let mut err = Error::new(theirs.kind, format!("{}; {}", own.msg, theirs.msg));
                    err.lost = theirs.lost;
                    return Err(err);
                }
                _ if Instant::now() >= *until => return Err(own.clone()),
                _ => {}
            }
            // No more progress: the peers were told this rank gave up, and its links are
            // closed for sending.
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let (moved, done) = pass_all(execs).map_err(|e| with_other_losses(execs, e))?;
        if done {
            return Ok(());
        }
        if moved {
            idle_since = None;
            spins = 0;
            // Busy is running too: peers that wait for this rank must not think it stalled.
            moves = moves.wrapping_add(1);
            if moves % 16 == 0 {
                for p in execs.iter().filter_map(|e| e.wiring.presence.as_ref()) {
                    p.heartbeat();
                }
            }
            continue;
        }
        // Reading the clock costs about as much as a pass: only now and then while spinning.
        spins = spins.wrapping_add(1);
        if spins % 64 != 0 {
            // More ranks on this host than it has cores: the rank this one waits for is
            // likely runnable on this very core, so every idle pass hands the core over; 63
            // passes of polling first cost that rank a couple of microseconds.
            if execs[0].wiring.hand_over {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let now = Instant::now();
        let started = *started.get_or_insert(now);
        let idle = now - *idle_since.get_or_insert(now);
        // A peer stuck behind this rank (see `crowded`, which answers only where the host's
        // ranks fit its CPUs) is not running: spinning only delays it. Yield through the spin
        // window instead: the core goes to the peer if it waits for this one, and the rank
        // stays runnable, so nothing wakes it onto its waker's CPU (sleeping ranks were woken
        // next to each other and took 5-15 us a call for the first milliseconds of one run in
        // five). Then sleep, which hands the core over whatever else runs.
        let crowded = crowded(execs, now);
        let w = execs[0].wiring;
        let spin = if idle >= w.spin && idle < WAKE_GRACE && peer_asleep(execs) {
            WAKE_GRACE
        } else {
            w.spin
        };
        if idle < spin && !crowded {
            continue;
        }
        let yield_until = if crowded { spin } else { spin + w.yield_for };
        if idle < yield_until {
            std::thread::yield_now();
            spins = spins.wrapping_add(63);
            continue;
        }
        if last_check.is_none_or(|t| now - t >= Duration::from_millis(20)) {
            last_check = Some(now);
            let lost = execs.iter().find_map(|e| {
                e.check_peers().err().map(|err| {
                    // A peer that found the ranks disagreeing names the two operations it
                    // saw; this rank adds its own, so every rank's error says what it called.
                    if err.kind == ErrorKind::InvalidUsage {
                        err.context(format!("rank {} (in {})", e.wiring.rank, e.called()))
                    } else {
                        err.context(format!("rank {}", e.wiring.rank))
                    }
                })
            });
            // A peer that gave up waiting for this rank: this rank's own wait is the story.
            let blamed = execs.iter().enumerate().find_map(|(i, e)| {
                let me = e.wiring.rank;
                let (waited_for, what) = e.blocked_on();
                let p = *waited_for.iter().find(|&&p| {
                    e.wiring.links[p]
                        .check_peer()
                        .is_err_and(|pe| pe.kind == ErrorKind::Timeout && pe.lost == Some(me))
                })?;
                let suspect = waited_for.iter().copied().find(|&s| s != p);
                let mut err = Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rank {p} timed out waiting for rank {me}, which is waiting for {what}"
                    ),
                );
                err.lost = suspect.or(Some(p));
                Some((i, err))
            });
            if let Some((i, err)) = blamed {
                execs[i].give_up(&err);
                gave_up = Some((
                    now + grace(execs[i].wiring.timeout.get().unwrap_or_default()),
                    err,
                    i,
                ));
                continue;
            }
            if let Some(err) = lost {
                // A peer that finished and left published everything it was going to send
                // before it marked its end closed, so the departure being visible now means
                // its last bytes are visible too. Only a pass that still finds nothing after
                // seeing the departure proves we lack data that will never come.
                match pass_all(execs)? {
                    (_, true) => return Ok(()),
                    (true, false) => {
                        idle_since = None;
                        spins = 0;
                        continue;
                    }
                    (false, false) => return Err(err),
                }
            }
            for (i, e) in execs.iter().enumerate() {
                let (waited_for, what) = e.blocked_on();
                if !warned && idle >= e.wiring.warn_after {
                    crate::warn!(
                        "rank {} has made no progress for {:.0} s, waiting for {what}",
                        e.wiring.rank,
                        idle.as_secs_f64()
                    );
                    warned = true;
                }
                if let Some(t) = e.wiring.timeout.get() {
                    if idle >= t {
                        let mut err = Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "rank {} timed out after {:.1} s without progress ({:.1} s into the operation), waiting for {what}",
                                e.wiring.rank,
                                idle.as_secs_f64(),
                                (now - started).as_secs_f64()
                            ),
                        );
                        // The rank waited for is the suspect its peers will be told about.
                        err.lost = waited_for.first().copied();
                        e.give_up(&err);
                        gave_up = Some((now + grace(t), err, i));
                        break;
                    }
                }
            }
            if gave_up.is_some() {
                continue;
            }
        }
        let single_doorbell = match &*execs {
            [only] => Some(only.wiring.doorbell.clone()),
            _ => None,
        };
        match &single_doorbell {
            Some(d) => {
                // Announce the sleep, then look once more: a peer that published before it saw
                // the announcement is caught by this pass, one that published after rings.
                publish(execs, Activity::Sleeping);
                let seen = d.prepare_sleep();
                match pass_all(execs) {
                    Ok((false, false)) => {
                        let narrowed = hold_for_sleep(execs);
                        if narrowed.is_some() {
                            // It may have moved: peers must see where it sleeps.
                            publish(execs, Activity::Sleeping);
                        }
                        d.sleep(seen, Duration::from_millis(20));
                        drop(narrowed);
                        publish(execs, Activity::Polling);
                    }
                    Ok((_, done)) => {
                        d.cancel_sleep();
                        if done {
                            return Ok(());
                        }
                        idle_since = None;
                    }
                    Err(e) => {
                        d.cancel_sleep();
                        return Err(e);
                    }
                }
            }
            None => std::thread::yield_now(),
        }
    }
}
