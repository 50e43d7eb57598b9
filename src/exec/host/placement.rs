//! CPU placement and crowding: where a rank's thread runs, when it moves off a CPU a
//! peer needs, and what it tells its peers on this host before it sleeps.

use super::engine::Exec;
use crate::sys;
use crate::topo::{Activity, Presence};
use std::time::{Duration, Instant};

/// How often at most a thread moves itself to another CPU (see `crowded`).
pub(super) const MOVE_EVERY: Duration = Duration::from_micros(500);

thread_local! {
    /// When this thread last moved itself to another CPU.
    pub(super) static LAST_MOVE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// A peer that polls or sleeps without any sign of life for this long is not running: its
/// heartbeat stopped, or it was woken and has not resumed.
pub(super) const STALLED_AFTER: Duration = Duration::from_micros(10);

/// How long at most a rank keeps waiting awake, spinning or yielding, while a peer on this
/// host sleeps on its doorbell (`peer_asleep`). A sleeping peer this rank waits for was rung
/// by what this rank sent it, or will be by a third rank; waking takes it 100-250 us on an idle
/// virtual CPU, past the 50 us spin window. Two ranks that each gave up while the other woke
/// slept in turn at every call: 100-300 us a call for the first milliseconds of a run, on
/// separate CPUs.
pub(super) const WAKE_GRACE: Duration = Duration::from_micros(500);

/// Whether a peer on this host says it sleeps on its doorbell, where this host's ranks fit its
/// CPUs (otherwise the sleeper may need this rank's CPU to wake on, and this rank's waiting
/// awake would delay it).
pub(super) fn peer_asleep(execs: &[Exec]) -> bool {
    spread(execs) && local_peers(execs).any(|(.., (_, what))| what == Activity::Sleeping)
}

/// Whether this host's ranks fit its CPUs, for every communicator driven (`Wiring::spread`).
pub(super) fn spread(execs: &[Exec]) -> bool {
    execs.iter().all(|e| e.wiring.spread)
}

/// Every peer on this host that said where it runs, for every communicator driven: whether
/// its rank is above this one's, its rank and where its communicator's ranks say they run,
/// and the CPU it last said it runs on and what it does there (`Presence::running_on`).
pub(super) fn local_peers<'e>(
    execs: &'e [Exec],
) -> impl Iterator<Item = (bool, (usize, &'e dyn Presence), (u32, Activity))> + 'e {
    execs.iter().flat_map(|e| {
        let me = e.wiring.rank;
        let presence = e.wiring.presence.as_deref();
        let ranks = presence.map_or(0..0, |_| 0..e.wiring.links.len());
        ranks.filter_map(move |p| {
            let at = presence?;
            let seen = at.running_on(p).filter(|_| p != me)?;
            Some((p > me, (p, at), seen))
        })
    })
}

/// The CPU the caller runs on (None where the kernel does not say).
pub(super) fn this_cpu() -> Option<u32> {
    // SAFETY: sched_getcpu has no preconditions (the vDSO answers it).
    u32::try_from(unsafe { libc::sched_getcpu() }).ok()
}

/// Whether a peer that last said it runs on `peer.0`, doing `peer.1`, is stuck behind this
/// rank, which runs on `cpu` (see `crowded`); `stalled` says whether it showed no sign of life
/// for `STALLED_AFTER`.
pub(super) fn stuck(cpu: u32, peer: (u32, Activity), stalled: impl FnOnce() -> bool) -> bool {
    peer.0 == cpu || (peer.1 != Activity::Outside && stalled())
}

/// A peer on this host as a waiting rank sees it: the CPU it last said it runs on, whether it
/// is stuck behind this rank (`stuck`), and whether its rank is above this one's.
#[derive(Clone, Copy, Debug)]
pub(super) struct PeerSeen {
    pub(super) cpu: u32,
    pub(super) stuck: bool,
    pub(super) above: bool,
}

/// What a rank on `cpu` does about the peers it sees.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Crowding {
    /// Nobody is stuck behind it.
    Alone,
    /// Someone is: it gives the core up for a while.
    GiveWay,
    /// Someone is: it moves to another CPU, not to one of these.
    Move { avoid: Vec<u32> },
}

pub(super) fn crowding<I: Iterator<Item = PeerSeen>>(cpu: u32, peers: impl Fn() -> I) -> Crowding {
    if !peers().any(|p| p.stuck) {
        return Crowding::Alone;
    }
    // Two ranks on one CPU each find the other there. Were both to move, they would land
    // together on the same free CPU (they take turns on this one, so both get to decide):
    // only the higher rank moves, the lower one gives it the core.
    if peers().any(|p| p.cpu == cpu && p.above) {
        return Crowding::GiveWay;
    }
    // Every other CPU a peer said it runs on is taken, whatever the peer does there: one that
    // polls there may be silent because it is moving there (it says where to first, then
    // lands tens of microseconds later); one that sleeps there is held there (`hold_for_sleep`)
    // and wakes there, and one woken a moment ago shows no sign of life until its CPU resumes
    // (on a VM an idle virtual CPU takes tens of microseconds); one in its application runs
    // there. Moving onto a sleeping peer's CPU put the two together when it woke; the higher
    // rank then moved back, found it asleep and stalled again, and moved onto it once more
    // every `MOVE_EVERY`, for a whole run at 40-100 us a call (traced, unpinned 2-rank runs).
    let avoid = peers().filter(|p| p.cpu != cpu).map(|p| p.cpu).collect();
    Crowding::Move { avoid }
}

/// Whether a peer on this host is stuck behind this rank (see `drive`): it last ran on this
/// CPU (polling, asleep or between operations: it cannot run here while this rank does, so it
/// waits for this CPU or moved since), or it polls or sleeps with no sign of life for
/// `STALLED_AFTER` (it waits in some CPU's queue: moved there by the scheduler after it last
/// said where it runs, or woken onto a busy CPU). Then this rank moves to another CPU it may
/// use where no peer said it runs (`crowding`), and the answer is false; or, where there is none or
/// it leaves the move to a peer, true (the caller gives the core up). Also tells the peers
/// where this rank polls, and that it runs.
pub(super) fn crowded(execs: &[Exec], now: Instant) -> bool {
    if !spread(execs) {
        return false;
    }
    let Some(cpu) = this_cpu() else {
        return false;
    };
    // Every peer on this host that said where it runs: its CPU, whether it is stuck, and
    // whether its rank is above this one's (the common answer, nobody here, allocates
    // nothing).
    let peers = || {
        local_peers(execs).map(|(above, (p, at), (c, what))| PeerSeen {
            cpu: c,
            stuck: stuck(cpu, (c, what), || at.stalled(p, now, STALLED_AFTER)),
            above,
        })
    };
    for p in presences(execs) {
        p.set_running_on(cpu, Activity::Polling);
        p.heartbeat();
    }
    let avoid = match crowding(cpu, peers) {
        Crowding::Alone => return false,
        Crowding::GiveWay => return true,
        Crowding::Move { avoid } => avoid,
    };
    // Wake-ups pull a woken rank onto its waker's CPU, so ranks that sleep now and then end up
    // sharing one CPU while another is free; moving costs tens of microseconds, so not too
    // often: at most once per MOVE_EVERY for the thread, whatever the number of calls (a
    // broadcast root's calls are shorter than a move).
    if LAST_MOVE.get().is_some_and(|t| now - t < MOVE_EVERY) {
        return true;
    }
    LAST_MOVE.set(Some(now));
    // Peers learn the destination before the move: one that runs on this CPU meanwhile must
    // not take this rank for stuck there and move too, onto the destination.
    let moved = crate::sys::move_off_cpu(cpu, &avoid, |to| {
        for p in presences(execs) {
            p.set_running_on(to, Activity::Polling);
        }
    });
    if moved.is_some() {
        return false;
    }
    for p in presences(execs) {
        p.set_running_on(cpu, Activity::Polling);
    }
    true
}

/// Before this rank sleeps, where it has peers on this host and the host's ranks fit its CPUs
/// (`Wiring::spread`): holds it on its CPU while it sleeps, or, where a peer runs there
/// (polling or in its application), off the CPUs its peers run on (`sys::hold_for_sleep`).
/// Unpinned ranks were woken onto their waker's CPU, waiting 100-160 us behind it with the
/// other CPU idle, in the first milliseconds of about half the runs of a 2-rank benchmark on
/// the 2-vCPU VM.
pub(super) fn hold_for_sleep(execs: &[Exec]) -> Option<sys::Narrowed> {
    if !spread(execs) {
        return None;
    }
    let cpu = this_cpu()?;
    let mut avoid: Vec<u32> = Vec::new();
    let mut local = false;
    for (.., (c, what)) in local_peers(execs) {
        local = true;
        if what != Activity::Sleeping {
            avoid.push(c);
        }
    }
    // Peers only across the network wake this rank from a progress thread, wherever that
    // runs: the kernel's choice stands.
    if !local {
        return None;
    }
    sys::hold_for_sleep(cpu, &avoid)
}

/// Tells the peers on this host what this rank does now, where it runs.
pub(super) fn publish(execs: &[Exec], what: Activity) {
    if let Some(cpu) = this_cpu() {
        for p in presences(execs) {
            p.set_running_on(cpu, what);
        }
    }
}

/// Where each driven communicator tells its peers on this host where this rank runs.
fn presences<'e>(execs: &'e [Exec]) -> impl Iterator<Item = &'e dyn Presence> + 'e {
    execs.iter().filter_map(|e| e.wiring.presence.as_deref())
}
