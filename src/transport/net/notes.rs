//! Close notes that cannot ride the link they are about.
//!
//! A TCP link that closes between messages writes a close header saying how it ended and
//! which rank it lost (`SocketLink::close`). In the middle of a message it cannot: the peer
//! would read the header as the rest of the message, so the link only shuts its sockets down,
//! and the peer learns no more than "rank p closed its connection". When `p` failed because
//! it lost a third rank, the peer would then blame `p`, or find the third rank only through a
//! link of its own to it; with connections made on demand that link may never have been used.
//!
//! So a link closing in the middle of a message sends the note on a connection of its own:
//! it dials the peer's connection service (`Purpose::Note`, the closing code and the lost rank
//! in the key, authenticated like every connection of the communicator) and waits, briefly,
//! for one byte back. The service's handler records the note before it answers, and the
//! link shuts its sockets only after the answer or its deadline, so a peer that reads the end
//! of stream finds the note already recorded and reports it as if the close header had come.

use crate::bootstrap::{Dialer, PeerCtx, Purpose};
use crate::transport::Closing;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// How long a closing link waits for the peer's service to take its note. A peer that does
/// not answer in time learns only that the connection ended.
const NOTE_WAIT: Duration = Duration::from_millis(250);

/// The close notes the peers of one communicator's network links sent this rank, by peer,
/// and the means to send this rank's own.
pub(crate) struct Notes {
    dialer: Dialer,
    got: Mutex<HashMap<usize, (Closing, Option<usize>)>>,
}

/// The one code for how a link closed and whom it lost: the key of a note, and what a rank's
/// service answers probes with once it closed (`Dialer::tell_closed`).
pub(super) fn encode(how: Closing, lost: Option<usize>) -> u64 {
    how as u64 | (lost.map_or(0, |l| l as u64 + 1) << 8)
}

pub(super) fn decode(key: u64) -> Option<(Closing, Option<usize>)> {
    let how = Closing::from_code((key & 0xff) as u32)?;
    let lost = (key >> 8).checked_sub(1).map(|l| l as usize);
    Some((how, lost))
}

impl Notes {
    pub(crate) fn new(dialer: Dialer) -> Notes {
        Notes {
            dialer,
            got: Mutex::new(HashMap::new()),
        }
    }

    /// The route's handler, on the service's thread: records the note, then answers.
    pub(crate) fn deliver(&self, c: PeerCtx, mut s: TcpStream) {
        let Some(note) = decode(c.key) else {
            crate::warn!(
                "dropped a close note from rank {} with an unknown code {:#x}",
                c.from,
                c.key
            );
            return;
        };
        self.got.lock().insert(c.from as usize, note);
        let _ = s.write_all(&[1]);
    }

    /// What `peer` said when it closed its link to this rank in the middle of a message.
    pub(crate) fn from(&self, peer: usize) -> Option<(Closing, Option<usize>)> {
        self.got.lock().get(&peer).copied()
    }

    /// Tells `peer` how this rank's link to it closed (see the module doc), waiting at most
    /// `NOTE_WAIT` for its service to take the note. Nothing is sent to the rank this one lost.
    pub(crate) fn tell(&self, peer: usize, how: Closing, lost: Option<usize>) {
        if lost == Some(peer) {
            return;
        }
        let deadline = Instant::now() + NOTE_WAIT;
        let sent = self
            .dialer
            .dial(peer, Purpose::Note, encode(how, lost), Some(deadline))
            .and_then(|mut s| {
                let left = deadline.saturating_duration_since(Instant::now());
                s.set_nonblocking(false)
                    .and_then(|_| s.set_read_timeout(Some(left.max(Duration::from_millis(1)))))
                    .and_then(|_| s.read_exact(&mut [0u8]))
                    .map_err(|e| crate::error::Error::from_io("wait for a close note's answer", e))
            });
        if let Err(e) = sent {
            crate::info!("rank {peer} was not told how this rank's link to it closed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_survives_its_encoding() {
        for how in [
            Closing::Destroyed,
            Closing::Aborted,
            Closing::Failed,
            Closing::TimedOut,
            Closing::Disagreed,
        ] {
            for lost in [None, Some(0), Some(7), Some(65_535)] {
                assert_eq!(decode(encode(how, lost)), Some((how, lost)));
            }
        }
        assert_eq!(decode(0), None, "no closing code");
    }
}
