//! The out-of-band collectives: a ring over one TCP connection to the next rank and one from the
//! previous rank.
//!
//! Allgather: in step s every rank sends the contribution of rank (r - s) to its successor and
//! receives that of rank (r - s - 1) from its predecessor; after nranks - 1 steps everyone has all.
//! The send and the receive of a step progress together from one poll loop, so large contributions
//! cannot deadlock on full socket buffers. Barrier is an allgather of nothing; broadcast passes the
//! root's bytes along the ring.
//!
//! Every frame names its operation and sequence number, so ranks that call the collectives in a
//! different order get an error instead of each other's data. When a rank fails (its peer vanished,
//! it was aborted, ...) it tells its successor why, then closes both connections: both neighbours
//! stop waiting at once, the failure travels around the ring, and every rank's error names the
//! rank where it started.

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;

use super::net::{self, kind_from_code, pollfd, FrameReader, FrameWriter, Header, Waiter};
use crate::error::{Error, ErrorKind, Result};

pub(crate) const ALLGATHER: u8 = 16;
pub(crate) const BARRIER: u8 = 17;
pub(crate) const BROADCAST: u8 = 18;
const ABORT: u8 = 19;

/// Sanity limit of one contribution.
pub(crate) const MAX_FRAME: u64 = 1 << 30;
/// Sanity limit of a failure notice.
const NOTICE_LIMIT: u64 = 64 << 10;
/// After its own deadline, how long a rank still listens for its predecessor's failure
/// notice: the ranks of a ring time out at about the same moment, and the one nearest the
/// cause (the rank that never came) has the message worth reporting.
const NOTICE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

fn op_name(kind: u8) -> &'static str {
    match kind {
        ALLGATHER => "allgather",
        BARRIER => "barrier",
        BROADCAST => "broadcast",
        _ => "an unknown operation",
    }
}

pub(crate) struct Ring {
    rank: usize,
    nranks: usize,
    next: Option<TcpStream>,
    prev: Option<TcpStream>,
    seq: u64,
    /// Set by the first failure; the ring is unusable after it.
    broken: Option<Error>,
    /// Part of a frame is on the wire to `next`: a failure notice now would be read as its rest.
    next_mid_frame: bool,
    /// The original cause when the failure was relayed to us by a neighbour.
    relayed: Option<String>,
    /// Reads the connection to `next` backwards: only a failure notice ever comes that way.
    back: FrameReader,
    /// `next` hung up without a notice. Not an error by itself: a successor that has everything
    /// it needs from us may finish the last collective and close its communicator while we still
    /// wait on our predecessor. Writing to it again will fail, and that is the error.
    next_gone: bool,
}

struct Expect {
    kind: u8,
    arg: u32,
    seq: u64,
}

impl Ring {
    pub(super) fn solo() -> Ring {
        Ring::new(0, 1, None, None)
    }

    pub(super) fn new(
        rank: usize,
        nranks: usize,
        next: Option<TcpStream>,
        prev: Option<TcpStream>,
    ) -> Ring {
        Ring {
            rank,
            nranks,
            next,
            prev,
            seq: 0,
            broken: None,
            next_mid_frame: false,
            relayed: None,
            back: FrameReader::new(NOTICE_LIMIT),
            next_gone: false,
        }
    }

    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.nranks
    }

    fn prev_rank(&self) -> usize {
        (self.rank + self.nranks - 1) % self.nranks
    }

    /// Starts an operation: refuses when broken or aborted, and numbers it.
    fn begin(&mut self, kind: u8, w: &Waiter<'_>) -> Result<u64> {
        if let Some(e) = &self.broken {
            return Err(e
                .clone()
                .context("the bootstrap network failed earlier and cannot be used"));
        }
        if let Err(e) = w.check(|| format!("the start of a bootstrap {}", op_name(kind))) {
            return Err(self.fail(e));
        }
        self.seq += 1;
        Ok(self.seq)
    }

    /// Every rank's contribution, indexed by rank.
    pub(super) fn allgather(
        &mut self,
        mine: &[u8],
        kind: u8,
        w: Waiter<'_>,
    ) -> Result<Vec<Vec<u8>>> {
        if mine.len() as u64 > MAX_FRAME {
            return crate::invalid_arg!(
                "bootstrap allgather contribution of {} bytes exceeds the limit of {MAX_FRAME}",
                mine.len()
            );
        }
        let seq = self.begin(kind, &w)?;
        let n = self.nranks;
        let mut slots: Vec<Option<Vec<u8>>> = vec![None; n];
        slots[self.rank] = Some(mine.to_vec());
        for step in 0..n.saturating_sub(1) {
            let send_idx = (self.rank + n - step) % n;
            let recv_idx = (self.rank + n - step - 1) % n;
            let body = slots[send_idx].as_deref().unwrap_or_default();
            let h = Header::new(kind, send_idx as u32, seq, body.len());
            let expect = Expect {
                kind,
                arg: recv_idx as u32,
                seq,
            };
            match self.exchange(Some((h, body)), Some(expect), w) {
                Ok(got) => slots[recv_idx] = got,
                Err(e) => return Err(self.fail(e)),
            }
        }
        Ok(slots.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// `root`'s bytes, delivered to everyone.
    pub(super) fn broadcast(&mut self, root: usize, data: &[u8], w: Waiter<'_>) -> Result<Vec<u8>> {
        if data.len() as u64 > MAX_FRAME {
            return crate::invalid_arg!(
                "bootstrap broadcast of {} bytes exceeds the limit of {MAX_FRAME}",
                data.len()
            );
        }
        let seq = self.begin(BROADCAST, &w)?;
        if self.nranks == 1 {
            return Ok(data.to_vec());
        }
        let h = |len| Header::new(BROADCAST, root as u32, seq, len);
        let result = if self.rank == root {
            self.exchange(Some((h(data.len()), data)), None, w)
                .map(|_| data.to_vec())
        } else {
            let expect = Expect {
                kind: BROADCAST,
                arg: root as u32,
                seq,
            };
            self.exchange(None, Some(expect), w).and_then(|got| {
                let got = got.unwrap_or_default();
                if self.next_rank() != root {
                    self.exchange(Some((h(got.len()), &got)), None, w)?;
                }
                Ok(got)
            })
        };
        result.map_err(|e| self.fail(e))
    }

    /// Sends one frame to `next` and/or receives one from `prev`, both at once. While waiting it
    /// also watches `next` for a hang-up, so the death of either neighbour ends the wait.
    fn exchange(
        &mut self,
        send: Option<(Header, &[u8])>,
        expect: Option<Expect>,
        w: Waiter<'_>,
    ) -> Result<Option<Vec<u8>>> {
        let (next_rank, prev_rank) = (self.next_rank(), self.prev_rank());
        let (Some(next), Some(prev)) = (self.next.as_ref(), self.prev.as_ref()) else {
            return crate::internal_err!(
                "bootstrap ring of {} ranks has no connections",
                self.nranks
            );
        };
        let next_who = format!("rank {next_rank}");
        let prev_who = format!("rank {prev_rank}");
        let mut writer = send.map(|(h, body)| FrameWriter::new(h, body));
        let mut reader = expect.as_ref().map(|_| FrameReader::new(MAX_FRAME));
        let mut got = None;
        let mut grace: Option<std::time::Instant> = None;
        loop {
            if let Some(wr) = writer.as_mut() {
                let res = wr.progress(next, &next_who).map_err(|e| gone(e, next_rank));
                self.next_mid_frame = wr.started() && !matches!(res, Ok(true));
                if res? {
                    writer = None;
                }
            }
            if let (Some(rd), Some(e)) = (reader.as_mut(), expect.as_ref()) {
                if rd
                    .progress(prev, &prev_who)
                    .map_err(|e| gone(e, prev_rank))?
                {
                    let (h, body) = reader.take().expect("reader present").into_frame();
                    match check_frame(h, body, e, prev_rank, self.rank) {
                        Ok(b) => got = Some(b),
                        Err((err, relayed)) => {
                            self.relayed = relayed;
                            return Err(err);
                        }
                    }
                }
            }
            if writer.is_none() && reader.is_none() {
                return Ok(got);
            }
            // The rank whose contribution is late, which is not the predecessor relaying it.
            let awaited = || match expect.as_ref().map(|e| e.arg as usize) {
                Some(origin) if origin != prev_rank => {
                    format!("rank {origin}'s bootstrap data (relayed by {prev_who})")
                }
                _ => format!("bootstrap data from {prev_who}"),
            };
            let waited = w.check(|| match (&writer, &reader) {
                (Some(_), Some(_)) => format!("{next_who} and {}", awaited()),
                (Some(_), None) => format!("{next_who} to take bootstrap data"),
                _ => awaited(),
            });
            match waited {
                Ok(()) => {}
                Err(e) if e.kind == ErrorKind::Timeout && reader.is_some() => {
                    let until =
                        *grace.get_or_insert_with(|| std::time::Instant::now() + NOTICE_GRACE);
                    if std::time::Instant::now() >= until {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
            let out = if writer.is_some() { libc::POLLOUT } else { 0 };
            let inp = if reader.is_some() { libc::POLLIN } else { 0 };
            // A hung-up socket reports POLLHUP whatever it is asked for; leave it out unless we
            // still have to write to it.
            let next_fd = if self.next_gone && writer.is_none() {
                -1
            } else {
                next.as_raw_fd()
            };
            let back = if self.next_gone { 0 } else { libc::POLLIN };
            let mut fds = [pollfd(prev.as_raw_fd(), inp), pollfd(next_fd, back | out)];
            let slice = match grace {
                Some(_) => std::time::Duration::from_millis(20),
                None => w.slice(),
            };
            net::poll(&mut fds, Some(slice))?;
            let hangup = libc::POLLIN | libc::POLLHUP | libc::POLLERR;
            if !self.next_gone && fds[1].revents & hangup != 0 {
                match probe(&mut self.back, next, next_rank) {
                    Ok(gone) => self.next_gone = gone,
                    Err((err, relayed)) => {
                        self.relayed = relayed;
                        return Err(err);
                    }
                }
            }
        }
    }

    /// Marks the ring broken, tells both neighbours why and closes our sending side towards them,
    /// so that they stop waiting on us at once. Only the sending side: shutting down reception
    /// would make the kernel answer a neighbour's next bytes with a reset, which can overtake the
    /// notice and leave that neighbour without the reason.
    pub(crate) fn fail(&mut self, e: Error) -> Error {
        let cause = self
            .relayed
            .take()
            .unwrap_or_else(|| format!("rank {}: {}", self.rank, e.msg));
        // The notice's sequence field carries the error kind, so a relayed timeout stays one.
        let mut notice = Header::new(ABORT, self.rank as u32, e.kind.code() as u64, cause.len())
            .encode()
            .to_vec();
        notice.extend_from_slice(cause.as_bytes());
        if let Some(next) = &self.next {
            if !self.next_mid_frame {
                let _ = (&*next).write(&notice);
            }
            let _ = next.shutdown(Shutdown::Write);
        }
        if let Some(prev) = &self.prev {
            // Nothing else is ever written this way, so the stream is always at a frame boundary.
            let _ = (&*prev).write(&notice);
            let _ = prev.shutdown(Shutdown::Write);
        }
        self.broken = Some(e.clone());
        e
    }
}

/// Our connection to the successor carries nothing back but a failure notice. Err when the
/// successor failed and said so; Ok(true) when it hung up silently.
fn probe(back: &mut FrameReader, next: &TcpStream, next_rank: usize) -> FrameCheck<bool> {
    let who = format!("rank {next_rank}");
    match back.progress(next, &who) {
        Ok(false) => Ok(false),
        Ok(true) => {
            let (h, body) = std::mem::replace(back, FrameReader::new(NOTICE_LIMIT)).into_frame();
            if h.kind == ABORT {
                return Err(relayed(&h, &body, next_rank));
            }
            let err = Error::new(
                ErrorKind::Internal,
                format!(
                    "{who} sent unexpected data (kind {}) on the bootstrap ring",
                    h.kind
                ),
            );
            Err((err, None))
        }
        Err(e) if e.kind == ErrorKind::Remote => Ok(true),
        Err(e) => Err((e, None)),
    }
}

/// A neighbour's connection ended (EOF, reset, broken pipe): say which rank, not which syscall.
fn gone(e: Error, rank: usize) -> Error {
    if e.kind != ErrorKind::Remote {
        return e;
    }
    Error::new(
        ErrorKind::Remote,
        format!("rank {rank} closed its bootstrap connection (it exited, aborted or failed)"),
    )
}

fn relayed(h: &Header, body: &[u8], from: usize) -> (Error, Option<String>) {
    let cause = String::from_utf8_lossy(body).into_owned();
    // A timeout somewhere on the ring is a timeout here too; anything else is a peer failure.
    let kind = match kind_from_code(h.seq as u8) {
        ErrorKind::Timeout => ErrorKind::Timeout,
        _ => ErrorKind::Remote,
    };
    let err = Error::new(
        kind,
        format!("bootstrap peer failure: {cause} (relayed by rank {from})"),
    );
    (err, Some(cause))
}

/// A failure, with the original cause when a neighbour relayed it.
type FrameCheck<T> = std::result::Result<T, (Error, Option<String>)>;

fn check_frame(
    h: Header,
    body: Vec<u8>,
    e: &Expect,
    prev: usize,
    me: usize,
) -> FrameCheck<Vec<u8>> {
    if h.kind == ABORT {
        return Err(relayed(&h, &body, prev));
    }
    if h.kind != e.kind || h.seq != e.seq {
        let err = Error::new(
            ErrorKind::InvalidUsage,
            format!(
                "bootstrap collectives out of step: rank {prev} is in {} #{} while rank {me} is in {} #{}; every rank must call them in the same order",
                op_name(h.kind),
                h.seq,
                op_name(e.kind),
                e.seq
            ),
        );
        return Err((err, None));
    }
    if h.arg != e.arg {
        let err = if e.kind == BROADCAST {
            Error::new(
                ErrorKind::InvalidUsage,
                format!(
                    "bootstrap broadcast: rank {prev} uses root {} but rank {me} uses root {}",
                    h.arg, e.arg
                ),
            )
        } else {
            Error::new(
                ErrorKind::Internal,
                format!(
                    "bootstrap allgather: rank {prev} forwarded rank {}'s data where rank {}'s was due",
                    h.arg, e.arg
                ),
            )
        };
        return Err((err, None));
    }
    Ok(body)
}
