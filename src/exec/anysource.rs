//! Receives from any source (`commRecvAny`): which peer's message a receive takes is decided
//! when it runs. The channels stay ordered point-to-point FIFOs; this only finds a peer whose
//! next message is a point-to-point message that has begun to arrive, and the receive itself is
//! then an ordinary receive from that peer. It waits as `wait` says: spin a little, yield, then
//! sleep on the doorbell that senders ring, checking the peers and the timeout.

use super::host::Wiring;
use crate::error::{Error, ErrorKind, Result};
use crate::wait::{wait, Patience, Wait};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Where the next search starts, so that one busy sender cannot starve the others.
static NEXT_START: AtomicUsize = AtomicUsize::new(0);

/// The first peer, in round-robin order from `start`, whose next message is a point-to-point
/// message (`tag`) whose first slice is `first` bytes long, as the send this receive matches
/// would begin. A peer whose next message is of another kind (it is ahead, in a collective this
/// rank has not reached) or another size (a send for a later receive) is passed over.
fn find(wiring: &Wiring, tag: u64, first: usize, start: usize) -> Result<Option<usize>> {
    let n = wiring.links.len();
    for i in 0..n {
        let peer = (start + i) % n;
        if let Some((len, msg_tag)) = wiring.links[peer].peek()? {
            if msg_tag == tag && len == first {
                return Ok(Some(peer));
            }
        }
    }
    Ok(None)
}

/// Waits until a point-to-point message whose first slice is `first` bytes has begun to arrive
/// from some peer; returns the peer.
pub(crate) fn wait_any_source(wiring: &Wiring, tag: u64, first: usize) -> Result<usize> {
    let patience = Patience {
        spin: wiring.spin,
        yield_for: wiring.yield_for,
        nap: Duration::from_millis(20),
        warn_after: Some(wiring.warn_after),
        timeout: wiring.timeout.get(),
    };
    let start = NEXT_START.fetch_add(1, Ordering::Relaxed);
    wait(
        &patience,
        &mut AnySource {
            wiring,
            tag,
            first,
            start,
        },
    )
}

/// A receive from any source waiting for its sender.
struct AnySource<'a> {
    wiring: &'a Wiring,
    tag: u64,
    first: usize,
    start: usize,
}

impl Wait for AnySource<'_> {
    type Out = usize;

    fn look(&mut self) -> Result<Option<usize>> {
        find(self.wiring, self.tag, self.first, self.start)
    }

    fn sleep(&mut self, nap: Duration) -> Result<Option<usize>> {
        let wiring = self.wiring;
        let (tag, first, start) = (self.tag, self.first, self.start);
        crate::wait::nap_on(&*wiring.doorbell, nap, || find(wiring, tag, first, start))
    }

    fn check(&mut self) -> Result<Option<usize>> {
        let w = self.wiring;
        if w.abort.load(Ordering::SeqCst) {
            return crate::remote_err!(
                "the communicator was aborted while a receive from any source was waiting"
            );
        }
        // Only a dead peer's channel can never deliver; a live one might still send.
        let mut alive = 0;
        let mut last_err = None;
        for (peer, link) in w.links.iter().enumerate() {
            match link.check_peer() {
                Ok(()) => alive += 1,
                Err(e) if peer != w.rank => last_err = Some(e),
                Err(_) => {}
            }
        }
        match last_err {
            Some(e) if alive <= 1 => Err(e.context(format!(
                "rank {}: no peer is left to send to a receive from any source",
                w.rank
            ))),
            _ => Ok(None),
        }
    }

    fn warn(&mut self, waited: Duration) {
        crate::warn!(
            "rank {} has waited {:.0} s for a message from any source",
            self.wiring.rank,
            waited.as_secs_f64()
        );
    }

    fn timed_out(&mut self, waited: Duration) -> Error {
        Error::new(
            ErrorKind::Timeout,
            format!(
                "rank {} timed out after {:.1} s waiting for a message from any source (a send whose first slice is {} bytes)",
                self.wiring.rank,
                waited.as_secs_f64(),
                self.first
            ),
        )
    }
}
