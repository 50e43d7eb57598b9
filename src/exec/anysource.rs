//! Receives from any source (`commRecvAny`): which peer's message a receive takes is decided
//! when it runs. The channels stay ordered point-to-point FIFOs; this only finds a peer whose
//! next message is a point-to-point message that has begun to arrive, and the receive itself is
//! then an ordinary receive from that peer. Waiting follows the executor's rules: spin a little,
//! yield, then sleep on the doorbell that senders ring, checking the peers and the timeout.

use super::host::Wiring;
use crate::error::{Error, ErrorKind, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
    let start = NEXT_START.fetch_add(1, Ordering::Relaxed);
    let began = Instant::now();
    let mut warned = false;
    loop {
        if let Some(peer) = find(wiring, tag, first, start)? {
            return Ok(peer);
        }
        if wiring.abort.load(Ordering::SeqCst) {
            return crate::remote_err!(
                "the communicator was aborted while a receive from any source was waiting"
            );
        }
        let waited = began.elapsed();
        if waited < wiring.spin {
            std::hint::spin_loop();
            continue;
        }
        if waited < wiring.spin + wiring.yield_for {
            std::thread::yield_now();
            continue;
        }
        // Only a dead peer's channel can never deliver; a live one might still send.
        let mut alive = 0;
        let mut last_err = None;
        for (peer, link) in wiring.links.iter().enumerate() {
            match link.check_peer() {
                Ok(()) => alive += 1,
                Err(e) if peer != wiring.rank => last_err = Some(e),
                Err(_) => {}
            }
        }
        if alive <= 1 {
            if let Some(e) = last_err {
                return Err(e.context(format!(
                    "rank {}: no peer is left to send to a receive from any source",
                    wiring.rank
                )));
            }
        }
        if !warned && waited >= wiring.warn_after {
            crate::warn!(
                "rank {} has waited {:.0} s for a message from any source",
                wiring.rank,
                waited.as_secs_f64()
            );
            warned = true;
        }
        if let Some(t) = wiring.timeout.get() {
            if waited >= t {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rank {} timed out after {:.1} s waiting for a message from any source (a send whose first slice is {first} bytes)",
                        wiring.rank,
                        waited.as_secs_f64()
                    ),
                ));
            }
        }
        // Announce the sleep, then look once more: a sender that published before it saw the
        // announcement is found by this look, one that published after rings.
        let d = &wiring.doorbell;
        let seen = d.prepare_sleep();
        match find(wiring, tag, first, start) {
            Ok(None) => d.sleep(seen, Duration::from_millis(20)),
            other => {
                d.cancel_sleep();
                if let Some(peer) = other? {
                    return Ok(peer);
                }
            }
        }
    }
}
