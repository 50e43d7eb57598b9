//! NCCL's counted signals (ncclSignal, ncclPutSignal, ncclWaitSignal) and the waiting they
//! share with the channels.

use super::ctl::Ctl;
use super::ops::peer_index;
use super::reach;
use super::registry::existing;
use super::{CommWindows, Members};
use crate::cuda::Stream;
use crate::error::{Error, ErrorKind, Result};
use crate::topo::Path;
use crate::wait::{nap_on, wait, Patience, Wait};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// One NCCL signal from rank `from` to the rank whose control segment this is, seen after
/// every store `from` made before it.
#[inline]
pub(super) fn signal_ctl(ctl: &Ctl, from: usize) {
    ctl.counter(from).fetch_add(1, Ordering::SeqCst);
    ctl.ring();
}

/// One NCCL signal to `peer` over whatever reaches its control segment: mapped here (a peer
/// on this host), RDMA or the network (see `super::reach`).
pub(super) fn signal_to(cw: &CommWindows, peer: usize) -> Result<()> {
    match &cw.ctls[peer] {
        Some(ctl) => {
            signal_ctl(ctl, cw.rank);
            Ok(())
        }
        None if cw.rdma.is_some() => reach::rdma::signal(cw, peer),
        None => reach::net::signal(cw, peer),
    }
}

/// One NCCL signal to `peer`, counted once everything queued on `s` before it is done.
pub(super) fn signal_on(s: Stream, cw: Arc<CommWindows>, peer: usize) -> Result<()> {
    s.host_fn(Box::new(move || {
        if let Err(e) = signal_to(&cw, peer) {
            crate::warn!(
                "a signal to rank {peer} queued on a stream was lost: {}",
                e.msg
            );
        }
    }))
}

/// ncclSignal: one NCCL signal to `peer`, after every earlier put and signal to it. On a
/// communicator with a GPU it is queued on `stream`, behind the puts queued there before it.
pub(crate) fn signal(c: &Members, peer: i32, stream: Option<Stream>) -> Result<()> {
    let peer = peer_index(c, peer)?;
    let cw = existing(c, "ncclSignal")?;
    match stream.filter(|_| c.device.is_some()) {
        Some(s) => signal_on(s, cw, peer),
        None => signal_to(&cw, peer),
    }
}

/// Waits until `ready`, failing when `peer` is lost, the communicator aborted, or `limit`
/// passed, as `wait` says: spins briefly (at least `MIN_SPIN`), then sleeps on this rank's
/// bell. `ready` may consume what it finds (a signal-pad word), so the wait ends the first
/// time it returns true.
#[inline(never)]
pub(super) fn wait_until(
    c: &Members,
    cw: &CommWindows,
    peer: usize,
    limit: Option<Duration>,
    what: &dyn Fn() -> String,
    ready: &mut dyn FnMut() -> bool,
) -> Result<()> {
    let patience = Patience {
        spin: c.spin.max(MIN_SPIN),
        yield_for: Duration::ZERO,
        nap: Duration::from_millis(10),
        warn_after: None,
        timeout: limit,
    };
    wait(
        &patience,
        &mut ForPeer {
            c,
            cw,
            peer,
            what,
            ready,
        },
    )
}

/// Looks at a signal word before a wait takes the slow way (`wait_until`).
pub(super) const QUICK_LOOKS: u32 = 256;

/// A signal as short as a ping-pong's is worth this much spinning before a sleep.
pub(super) const MIN_SPIN: Duration = Duration::from_micros(20);

/// A window wait for something `peer` does.
pub(super) struct ForPeer<'a, 'm> {
    pub(super) c: &'a Members<'m>,
    pub(super) cw: &'a CommWindows,
    pub(super) peer: usize,
    pub(super) what: &'a dyn Fn() -> String,
    pub(super) ready: &'a mut dyn FnMut() -> bool,
}

impl Wait for ForPeer<'_, '_> {
    type Out = ();

    fn look(&mut self) -> Result<Option<()>> {
        Ok((self.ready)().then_some(()))
    }

    fn sleep(&mut self, nap: Duration) -> Result<Option<()>> {
        let ready = &mut *self.ready;
        nap_on(self.cw.own(), nap, || Ok(ready().then_some(())))
    }

    fn check(&mut self) -> Result<Option<()>> {
        let (c, peer) = (self.c, self.peer);
        if c.abort.load(Ordering::SeqCst) {
            return crate::invalid_usage!(
                "the communicator was aborted while waiting for {}",
                (self.what)()
            );
        }
        if peer != c.rank {
            if let Some(gone) = peer_lost(c, self.cw, peer) {
                // What it sent before it went still counts.
                if (self.ready)() {
                    return Ok(Some(()));
                }
                return Err(Error::lost_peer(
                    peer,
                    format!(
                        "rank {peer} is gone while this rank waited for {}: {gone}",
                        (self.what)()
                    ),
                ));
            }
        }
        Ok(None)
    }

    fn warn(&mut self, _: Duration) {}

    fn timed_out(&mut self, _: Duration) -> Error {
        Error::new(
            ErrorKind::Timeout,
            format!("timed out waiting for {}", (self.what)()),
        )
    }
}

/// Why `peer` can no longer signal this rank, if it cannot: its link says it is gone, or (on
/// another host) its window connection closed.
pub(super) fn peer_lost(c: &Members, cw: &CommWindows, peer: usize) -> Option<String> {
    if let Err(e) = c.links[peer].check_peer() {
        return Some(e.msg);
    }
    if let Some(e) = cw.rdma.as_ref().and_then(|r| r.qps.failure(peer)) {
        return Some(e.msg);
    }
    let net = cw.net.as_ref().filter(|_| c.paths[peer] == Path::Network)?;
    (net.lost[peer].load(Ordering::SeqCst) || net.peer_gone(peer)).then(|| {
        "its connection closed (its process exited, or its host or the link failed)".to_string()
    })
}

/// ncclWaitSignal: for each (peer, opCnt), waits until `peer` has sent `opCnt` more signals
/// than earlier waits consumed, and consumes them.
pub(crate) fn wait_signals(
    c: &Members,
    descs: impl IntoIterator<Item = (usize, u64)>,
) -> Result<()> {
    let cw = existing(c, "ncclWaitSignal")?;
    wait_signals_on(c, &cw, descs)
}

/// [`wait_signals`] with the communicator's window state already at hand.
pub(crate) fn wait_signals_on(
    c: &Members,
    cw: &CommWindows,
    descs: impl IntoIterator<Item = (usize, u64)>,
) -> Result<()> {
    for (peer, n) in descs {
        if took_signals(cw, peer, n) {
            continue;
        }
        let goal = cw.waited[peer].load(Ordering::Relaxed) + n;
        let counter = cw.own().counter(peer);
        wait_until(
            c,
            cw,
            peer,
            c.timeout,
            &|| {
                format!(
                    "signals from rank {peer} ({} of {goal} arrived)",
                    counter.load(Ordering::SeqCst)
                )
            },
            &mut || counter.load(Ordering::Acquire) >= goal,
        )?;
        consume_signals(cw, peer, goal);
    }
    Ok(())
}

/// The first look of a wait for `n` more signals from `peer` (`peer` in range): a short spin
/// without the clock, in which a ping-pong's signal comes. True, having consumed them, when
/// they arrived; false, having consumed nothing, when the wait must go the slow way.
pub(crate) fn took_signals(cw: &CommWindows, peer: usize, n: u64) -> bool {
    let goal = cw.waited[peer].load(Ordering::Relaxed) + n;
    let counter = cw.own().counter(peer);
    let arrived = (0..QUICK_LOOKS).any(|_| counter.load(Ordering::Acquire) >= goal);
    if arrived {
        consume_signals(cw, peer, goal);
    }
    arrived
}

/// Counts the signals from `peer` up to `goal` as consumed by waits.
pub(super) fn consume_signals(cw: &CommWindows, peer: usize, goal: u64) {
    // Not fetch_max: a locked instruction on the ping-pong's path, while only a thread that
    // waits on this communicator moves it (calls on one communicator are not made from
    // several threads at once), and never backwards.
    let waited = &cw.waited[peer];
    if waited.load(Ordering::Relaxed) < goal {
        waited.store(goal, Ordering::Relaxed);
    }
}
