//! The host executor: runs schedules on host memory with the CPU doing the copies and reductions.
//!
//! A step may start once every earlier step it conflicts with has finished (it writes what they
//! read or write, or reads what they write: found by intersecting the byte ranges). Per peer,
//! sends start in list order and receives start in list order. Within those rules everything
//! runs as soon as it can, interleaved on one thread: pipelining falls out of the slicing, and
//! send/recv pairs never deadlock whatever order the caller issued them in. One call can drive
//! several communicators (a group over several communicators from one thread).

mod blame;
mod cache;
mod drive;
mod engine;
mod hazards;
mod placement;
mod plan;
mod sink;
mod straight;
#[cfg(test)]
mod tests;

use super::op::{HostOp, Limit};
use crate::error::Result;
use crate::reduce::Scale;
use crate::sys;
use crate::topo::{Activity, Presence};
use crate::transport::{Doorbell, Link, Warm};
use blame::WARM_AFTER;
use drive::drive;
use engine::Exec;
use parking_lot::Mutex;
use placement::this_cpu;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;
use straight::run_alone;

pub(crate) use cache::{ExecCache, Footprint, Repeat};
pub(crate) use straight::run_again_in;

impl HostOp {
    /// The larger of the bytes it reads from its send buffer and writes to its receive buffer.
    pub(super) fn extent(&self) -> usize {
        self.schedule.send_extent.max(self.schedule.recv_extent)
    }

    /// For an address in the send buffer, the same place in the receive buffer.
    pub(super) fn in_recv(&self, p: usize) -> Option<usize> {
        let send = self.send as usize;
        (send..send + self.schedule.send_extent)
            .contains(&p)
            .then(|| p - send + self.recv as usize)
    }

    /// Moves the operation's large buffers onto huge pages before peers in other processes
    /// copy from or into them (`Wiring::huge_pages_from`).
    pub(super) fn collapse_to_huge_pages(&self, wiring: &Wiring) {
        wiring.collapse_if_large(self.send as usize, self.schedule.send_extent);
        wiring.collapse_if_large(self.recv as usize, self.schedule.recv_extent);
    }
}

/// What the executor needs from a communicator.
pub(crate) struct Wiring {
    pub rank: usize,
    /// One transport per peer, this rank's own loopback included.
    pub links: Vec<Arc<dyn Link>>,
    /// The doorbell links ring when they give this rank something to do.
    pub doorbell: Arc<dyn Doorbell>,
    /// Where this communicator's ranks on this host run, told and read (`placement`); None
    /// without peers on this host that share memory.
    pub presence: Option<Arc<dyn Presence>>,
    /// What the transports keep warm between operations (`warm_links`); None where nothing.
    pub warm: Option<Arc<dyn Warm>>,
    pub abort: Arc<AtomicBool>,
    /// Give up (ncclTimeout) after this long without progress.
    pub timeout: Limit,
    /// Log which ranks we are waiting for after this long without progress.
    pub warn_after: Duration,
    /// Memory reused from call to call: scratch space (so large operations do not fault in
    /// fresh pages every call) and the executor's own tables (so small ones allocate nothing).
    pub cache: Mutex<ExecCache>,
    /// Spin this long before sleeping on the doorbell.
    pub spin: Duration,
    /// Then give the core away (sched_yield) for this long before sleeping: with more ranks
    /// than cores the rank we wait for is often runnable, and yielding hands it our core
    /// without a futex round trip.
    pub yield_for: Duration,
    /// This host's ranks fit its CPUs: a peer found waiting for this rank's CPU got there by
    /// an accident of scheduling, and this rank moves off that CPU (see `crowded`). With more
    /// ranks than CPUs sharing is the rule, and yielding serves better.
    pub spread: bool,
    /// This host runs more of the communicator's ranks than it has CPUs (and no spin window
    /// was asked for): a rank with nothing to do gives its core away at every look instead of
    /// polling on.
    pub hand_over: bool,
    /// This rank's place among the communicator's ranks on this host, where there are several
    /// (`settle`); None otherwise.
    pub home: Option<usize>,
    /// Buffers at least this large are moved onto huge pages before peers in other processes
    /// copy from or into them (None: never).
    pub huge_pages_from: Option<usize>,
}

impl Wiring {
    /// After an operation large enough to push them out, brings back into this core's caches
    /// and TLB what the links' next small messages touch (`transport::Warm`), so that the
    /// next small calls do not pay for it one page walk at a time.
    pub(super) fn warm_links(&self) {
        if let Some(w) = &self.warm {
            w.warm();
        }
    }

    /// On the application's thread, once the communicator is ready. The first communicator a
    /// thread creates moves it onto the CPU of its mask that its place among the host's ranks
    /// numbers (`home`), if it is not there; the mask stays whole, so the scheduler may move
    /// it later. The wake-ups that end initialisation often left two unpinned ranks on one
    /// CPU, and `crowded` moved one only once it waited, in its first calls: 60-80 us on the
    /// 2-vCPU VM (the CPU it goes to is idle, and wakes first), in the first timed calls of
    /// about half of the 2-rank benchmark runs. With more ranks than CPUs the places wrap
    /// round the mask, so each CPU starts with its share, the same ones in every run: left
    /// to the scheduler, which pairs it made decided 4 ranks on 2 CPUs (a one-shot
    /// all-to-all of 128 B-8 KiB took 11-17 us a call, or half that). Later communicators (a
    /// split, say) leave the thread where it is: their places need not match the first one's.
    ///
    /// Then tells the peers on this host where the rank runs, back in its application, so
    /// that a peer about to sleep knows which CPUs to keep off (`hold_for_sleep`) from the
    /// first call on.
    ///
    /// Returns the CPU the thread moved to, if it moved.
    pub(crate) fn settle(&self) -> Option<u32> {
        thread_local! {
            static SETTLED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        }
        let first = !SETTLED.replace(true);
        let moved = self.home.filter(|_| first).and_then(sys::move_to_nth_cpu);
        if let (Some(cpu), Some(p)) = (this_cpu(), &self.presence) {
            p.set_running_on(cpu, Activity::Outside);
        }
        moved
    }

    /// Moves `[ptr, ptr + len)` onto huge pages when it is at least `huge_pages_from` long.
    pub(super) fn collapse_if_large(&self, ptr: usize, len: usize) {
        if self.huge_pages_from.is_some_and(|min| len >= min) {
            crate::sys::collapse_to_huge_pages(ptr, len);
        }
    }
}

/// Where `send_bytes` at `send` and `recv_bytes` at `recv` share bytes, how far the send
/// buffer lies past the receive buffer; None where they share none (an empty one shares
/// none). Neither may wrap around the address space.
pub(crate) fn overlap(
    send: usize,
    send_bytes: usize,
    recv: usize,
    recv_bytes: usize,
) -> Option<isize> {
    (send_bytes > 0 && recv_bytes > 0 && send < recv + recv_bytes && recv < send + send_bytes)
        .then(|| send as isize - recv as isize)
}

/// Reads a PreMulSum scalar that lives at a host address (ncclScalarDevice residence used with
/// host memory): the value in force when the collective runs.
pub(crate) fn read_scalar(addr: usize, dtype: crate::reduce::DataType) -> Scale {
    let mut bytes = [0u8; 8];
    // SAFETY: ncclRedOpCreatePreMulSum checked the address is not NULL, and the caller promises
    // it stays valid for a scalar of `dtype` while the op exists.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, bytes.as_mut_ptr(), dtype.size()) };
    Scale(bytes)
}

/// Runs every communicator's operations to completion (or the first error).
#[cfg(test)]
pub(crate) fn run(jobs: Vec<(&Wiring, Vec<HostOp>)>) -> Result<()> {
    let mut guards: Vec<_> = jobs.iter().map(|(w, _)| w.cache.lock()).collect();
    run_in(
        jobs.into_iter()
            .zip(guards.iter_mut())
            .map(|((w, ops), c)| (w, &mut **c, ops))
            .collect(),
    )
}

/// `run`, on each communicator's executor cache, which the caller holds (`comm::gate`).
pub(crate) fn run_in(jobs: Vec<(&Wiring, &mut ExecCache, Vec<HostOp>)>) -> Result<()> {
    let mut execs = Vec::with_capacity(jobs.len());
    let mut large = Vec::with_capacity(jobs.len());
    for (wiring, cache, ops) in jobs {
        if ops.iter().map(HostOp::extent).sum::<usize>() >= WARM_AFTER {
            large.push(wiring);
        }
        cache.repeat = None;
        cache.tables.ops = ops;
        // Groups write folded bytes back: their runs mix operations, whose times say nothing
        // of one way.
        cache.tables.forward_first = false;
        execs.push(Exec::new(wiring, cache)?);
    }
    drive(&mut execs)?;
    for w in large {
        w.warm_links();
    }
    Ok(())
}

/// Runs one operation of one communicator (a call outside any group); `repeat`, the call's
/// key and footprint, lets the same call run again without being built (`run_again`).
#[cfg(test)]
pub(crate) fn run_one(
    wiring: &Wiring,
    op: HostOp,
    repeat: Option<(Repeat, Footprint)>,
) -> Result<()> {
    run_one_in(wiring, &mut wiring.cache.lock(), op, repeat)
}

/// `run_one`, on the communicator's executor cache, which the caller holds (`comm::gate`).
pub(crate) fn run_one_in(
    wiring: &Wiring,
    cache: &mut ExecCache,
    op: HostOp,
    repeat: Option<(Repeat, Footprint)>,
) -> Result<()> {
    let large = op.extent() >= WARM_AFTER;
    cache.repeat = None;
    cache.tables.ops.clear();
    cache.tables.ops.push(op);
    run_alone(wiring, cache, large)?;
    if cache.built.is_some() {
        cache.repeat = repeat;
    }
    Ok(())
}
