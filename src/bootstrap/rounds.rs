//! The out-of-band collectives in ceil(log2 N) rounds over 2 ceil(log2 N) TCP connections per rank.
//!
//! Round k pairs every rank r with `up` = r + 2^k and `down` = r - 2^k (mod N): r holds the
//! connection it made to `up` and the one `down` made to it (see `Bootstrap::init`, which makes
//! them round by round). On these:
//!
//! - Allgather (Bruck): before round k a rank holds the contributions of ranks r .. r + 2^k - 1;
//!   in round k it sends the first min(2^k, N - 2^k) of them to `down` and receives as many from
//!   `up`, those of ranks up .. . After the last round it holds all N. Barrier is an allgather of
//!   nothing (a dissemination barrier).
//! - Broadcast (binomial tree): relative to the root, rank v receives in round floor(log2 v) from
//!   v - 2^k, then sends in each later round j to v + 2^j while that is below N.
//!
//! So no step of a collective waits for more than log2 N hops, where a ring needed N - 1 of them.
//! The send and the receive of a round progress together from one poll loop, so large
//! contributions cannot deadlock on full socket buffers, and every connection is read in the
//! meantime: frames a peer sends ahead (it may be a round or a collective ahead) wait in that
//! connection's inbox.
//!
//! Every frame names its operation and sequence number, so ranks that call the collectives in a
//! different order get an error instead of each other's data. When a rank fails (its peer vanished,
//! it was aborted, ...) it sends a failure notice on every connection, then closes its sending side
//! of each: every rank that reads one fails the same way and passes it on, so the failure reaches
//! every rank within log2 N hops, and every rank's error names the rank where it started. A peer
//! that hangs up without a notice is not a failure by itself (a rank that has all it needs may
//! finish and close its communicator first); needing it again is.

use std::collections::VecDeque;
use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::net::{self, kind_from_code, pollfd, FrameReader, Header, Waiter};
use crate::error::{Error, ErrorKind, Result};

pub(crate) const ALLGATHER: u8 = 16;
pub(crate) const BARRIER: u8 = 17;
pub(crate) const BROADCAST: u8 = 18;
const ABORT: u8 = 19;

/// Sanity limit of one contribution.
pub(crate) const MAX_FRAME: u64 = 1 << 30;
/// After its own deadline, how long a rank still listens for a failure notice: the ranks time
/// out at about the same moment, and the one nearest the cause (the rank that never came) has the
/// message worth reporting.
pub(super) const NOTICE_GRACE: Duration = Duration::from_secs(1);

fn op_name(kind: u8) -> &'static str {
    match kind {
        ALLGATHER => "allgather",
        BARRIER => "barrier",
        BROADCAST => "broadcast",
        _ => "an unknown operation",
    }
}

/// The number of rounds for `n` ranks: ceil(log2 n).
pub(super) fn rounds_for(n: usize) -> usize {
    (usize::BITS - n.saturating_sub(1).leading_zeros()) as usize
}

/// Which connection of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    /// The one this rank made, to rank + 2^k.
    Up,
    /// The one rank - 2^k made to this rank.
    Down,
}

struct Conn {
    rank: usize,
    stream: TcpStream,
    reader: FrameReader,
    /// Complete frames not asked for yet, in the order they came.
    inbox: VecDeque<(Header, Vec<u8>)>,
    /// The peer hung up without a notice.
    gone: bool,
    /// Part of a frame of ours is on the wire: a failure notice now would be read as its rest.
    mid_frame: bool,
}

impl Conn {
    fn who(&self) -> String {
        format!("rank {}", self.rank)
    }
}

pub(super) struct Expect {
    pub kind: u8,
    pub arg: u32,
    pub seq: u64,
}

pub(crate) struct Rounds {
    rank: usize,
    nranks: usize,
    up: Vec<Conn>,
    down: Vec<Conn>,
    seq: u64,
    /// Set by the first failure; the connections are unusable after it.
    broken: Option<Error>,
    /// The original cause when the failure was relayed to us by a peer.
    relayed: Option<String>,
}

/// Contributions travel as one frame per round: for each, its length and its bytes.
fn encode_blocks<'a>(blocks: impl Iterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    for b in blocks {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

fn decode_blocks(body: &[u8], count: usize, from: usize) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(count);
    let mut at = 0usize;
    for _ in 0..count {
        let len = body
            .get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize);
        let Some(block) = len.and_then(|l| body.get(at + 8..(at + 8).checked_add(l)?)) else {
            return crate::internal_err!("rank {from} sent a malformed bootstrap allgather frame");
        };
        at += 8 + block.len();
        out.push(block.to_vec());
    }
    if at != body.len() {
        return crate::internal_err!("rank {from} sent a malformed bootstrap allgather frame");
    }
    Ok(out)
}

impl Rounds {
    pub(super) fn new(rank: usize, nranks: usize) -> Rounds {
        Rounds {
            rank,
            nranks,
            up: Vec::new(),
            down: Vec::new(),
            seq: 0,
            broken: None,
            relayed: None,
        }
    }

    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    pub(super) fn nranks(&self) -> usize {
        self.nranks
    }

    /// How many connections this rank holds.
    #[cfg(test)]
    pub(super) fn connections(&self) -> usize {
        self.up.len() + self.down.len()
    }

    /// Adds the next round's connections: to rank + 2^k (made here) and from rank - 2^k.
    pub(super) fn add_round(&mut self, up: TcpStream, down: TcpStream) {
        let k = self.up.len();
        let n = self.nranks;
        let conn = |rank, stream| Conn {
            rank,
            stream,
            reader: FrameReader::new(MAX_FRAME),
            inbox: VecDeque::new(),
            gone: false,
            mid_frame: false,
        };
        self.up.push(conn((self.rank + (1 << k)) % n, up));
        self.down
            .push(conn((self.rank + n - (1 << k) % n) % n, down));
    }

    /// Adds only the connection to rank + 2^k, for a failure notice when the other never came.
    pub(super) fn add_up(&mut self, up: TcpStream) {
        let k = self.up.len();
        self.up.push(Conn {
            rank: (self.rank + (1 << k)) % self.nranks,
            stream: up,
            reader: FrameReader::new(MAX_FRAME),
            inbox: VecDeque::new(),
            gone: false,
            mid_frame: false,
        });
    }

    /// Adds only the connection from rank - 2^k, for a failure notice.
    pub(super) fn add_down(&mut self, down: TcpStream) {
        let k = self.down.len();
        let n = self.nranks;
        self.down.push(Conn {
            rank: (self.rank + n - (1 << k) % n) % n,
            stream: down,
            reader: FrameReader::new(MAX_FRAME),
            inbox: VecDeque::new(),
            gone: false,
            mid_frame: false,
        });
    }

    fn conn(&mut self, side: Side, k: usize) -> &mut Conn {
        match side {
            Side::Up => &mut self.up[k],
            Side::Down => &mut self.down[k],
        }
    }

    /// Starts an operation: refuses when broken or aborted, and numbers it.
    pub(super) fn begin(&mut self, kind: u8, w: &Waiter<'_>) -> Result<u64> {
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
        let (r, rounds) = (self.rank, rounds_for(n));
        // slots[i] is the contribution of rank r + i.
        let mut slots: Vec<Vec<u8>> = vec![mine.to_vec()];
        for k in 0..rounds {
            let count = (1usize << k).min(n - (1 << k));
            let up = (r + (1 << k)) % n;
            let body = encode_blocks(slots[..count].iter().map(Vec::as_slice));
            let h = Header::new(kind, r as u32, seq, body.len());
            let expect = Expect {
                kind,
                arg: up as u32,
                seq,
            };
            match self.step(k, Some((Side::Down, h, &body)), Some((Side::Up, expect)), w) {
                Ok(got) => match decode_blocks(&got.unwrap_or_default(), count, up) {
                    Ok(blocks) => slots.extend(blocks),
                    Err(e) => return Err(self.fail(e)),
                },
                Err(e) => return Err(self.fail(e)),
            }
        }
        slots.rotate_right(r);
        Ok(slots)
    }

    /// One round of the allgather of listener addresses that runs while the connections are
    /// made (see `Bootstrap::init`): `known` holds the contributions of ranks r .. r + 2^k
    /// (one more than a plain allgather has, the successor's, from the root); this round brings
    /// those up to r + 2^(k+1). Every call of the rounds belongs to one allgather, `seq`.
    pub(super) fn forming_round(
        &mut self,
        k: usize,
        seq: u64,
        known: &mut Vec<Vec<u8>>,
        w: Waiter<'_>,
    ) -> Result<()> {
        let n = self.nranks;
        let r = self.rank;
        let step = 1usize << k;
        // Down holds down .. r and wants r + 1 .. down + 2^(k+1); up sends us the same for us.
        let count = step.min(n - step - 1);
        let send = (1..=count).map(|i| known[i].as_slice());
        let body = encode_blocks(send);
        let h = Header::new(ALLGATHER, ((r + 1) % n) as u32, seq, body.len());
        let up = (r + step) % n;
        let expect = Expect {
            kind: ALLGATHER,
            arg: ((up + 1) % n) as u32,
            seq,
        };
        let got = self
            .step(k, Some((Side::Down, h, &body)), Some((Side::Up, expect)), w)
            .and_then(|got| decode_blocks(&got.unwrap_or_default(), count, up));
        match got {
            Ok(blocks) => {
                known.extend(blocks);
                Ok(())
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Numbers the allgather that `forming_round` carries out.
    pub(super) fn begin_forming(&mut self) -> u64 {
        self.seq += 1;
        self.seq
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
        let n = self.nranks;
        let v = (self.rank + n - root) % n;
        let rounds = rounds_for(n);
        let h = |len| Header::new(BROADCAST, root as u32, seq, len);
        let result = (|| {
            // The round in which we receive: the highest bit of v.
            let (got, first_send) = if v == 0 {
                (data.to_vec(), 0)
            } else {
                let k = (usize::BITS - 1 - v.leading_zeros()) as usize;
                let expect = Expect {
                    kind: BROADCAST,
                    arg: root as u32,
                    seq,
                };
                let got = self.step(k, None, Some((Side::Down, expect)), w)?;
                (got.unwrap_or_default(), k + 1)
            };
            for j in first_send..rounds {
                if v + (1 << j) < n {
                    self.step(j, Some((Side::Up, h(got.len()), &got)), None, w)?;
                }
            }
            Ok(got)
        })();
        result.map_err(|e| self.fail(e))
    }

    /// Sends one frame and/or receives one, on round `k`'s connections, both at once. While
    /// waiting it reads every connection, so a failure notice or the death of the peer it
    /// waits for ends the wait.
    fn step(
        &mut self,
        k: usize,
        send: Option<(Side, Header, &[u8])>,
        expect: Option<(Side, Expect)>,
        w: Waiter<'_>,
    ) -> Result<Option<Vec<u8>>> {
        let mut out: Option<(Side, Vec<u8>, usize)> = send.map(|(side, h, body)| {
            let mut bytes = h.encode().to_vec();
            bytes.extend_from_slice(body);
            (side, bytes, 0)
        });
        if let Some((side, _, _)) = &out {
            let c = self.conn(*side, k);
            if c.gone {
                return Err(gone_err(c.rank));
            }
        }
        let mut got = None;
        let mut grace: Option<Instant> = None;
        loop {
            if let Some((side, bytes, off)) = out.as_mut() {
                let c = self.conn(*side, k);
                while *off < bytes.len() {
                    match (&c.stream).write(&bytes[*off..]) {
                        Ok(0) => return Err(gone_err(c.rank)),
                        Ok(m) => *off += m,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            return Err(
                                match Error::from_io(format!("writing to {}", c.who()), e) {
                                    e if e.kind == ErrorKind::Remote => gone_err(c.rank),
                                    e => e,
                                },
                            )
                        }
                    }
                }
                c.mid_frame = *off > 0 && *off < bytes.len();
                if *off == bytes.len() {
                    out = None;
                }
            }
            if let Some((side, e)) = expect.as_ref() {
                if got.is_none() {
                    let c = self.conn(*side, k);
                    if let Some((h, body)) = c.inbox.pop_front() {
                        match check_frame(h, body, e, c.rank, self.rank) {
                            Ok(b) => got = Some(b),
                            Err((err, relayed)) => {
                                self.relayed = relayed;
                                return Err(err);
                            }
                        }
                    } else if c.gone {
                        return Err(gone_err(c.rank));
                    }
                }
            }
            if out.is_none() && (expect.is_none() || got.is_some()) {
                return Ok(got);
            }
            let awaited = || match (&out, &expect) {
                (Some((side, _, _)), None) => {
                    format!("rank {} to take bootstrap data", self.peer(*side, k))
                }
                (_, Some((side, e))) => format!(
                    "bootstrap {} data from rank {} (round {} of {})",
                    op_name(e.kind),
                    self.peer(*side, k),
                    k + 1,
                    rounds_for(self.nranks)
                ),
                (None, None) => String::new(),
            };
            match w.check(awaited) {
                Ok(()) => {}
                Err(e) if e.kind == ErrorKind::Timeout && expect.is_some() => {
                    let until = *grace.get_or_insert_with(|| Instant::now() + NOTICE_GRACE);
                    if Instant::now() >= until {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
            let slice = match grace {
                Some(_) => Duration::from_millis(20),
                None => w.slice(),
            };
            let writing = out.as_ref().map(|(side, _, _)| *side);
            self.poll_all(k, writing, slice)?;
        }
    }

    fn peer(&self, side: Side, k: usize) -> usize {
        match side {
            Side::Up => self.up[k].rank,
            Side::Down => self.down[k].rank,
        }
    }

    /// Waits up to `slice` for any connection to have something, then reads every frame there
    /// is into the inboxes. A failure notice is an error at once.
    fn poll_all(&mut self, k: usize, writing: Option<Side>, slice: Duration) -> Result<()> {
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.up.len() + self.down.len());
        for (side, list) in [(Side::Up, &self.up), (Side::Down, &self.down)] {
            for (j, c) in list.iter().enumerate() {
                let out = if writing == Some(side) && j == k {
                    libc::POLLOUT
                } else {
                    0
                };
                // A hung-up socket reports POLLHUP whatever it is asked for; leave it out
                // unless we still write to it.
                let fd = if c.gone && out == 0 {
                    -1
                } else {
                    c.stream.as_raw_fd()
                };
                fds.push(pollfd(fd, libc::POLLIN | out));
            }
        }
        net::poll(&mut fds, Some(slice))?;
        let ready = libc::POLLIN | libc::POLLHUP | libc::POLLERR;
        let nup = self.up.len();
        for (i, fd) in fds.iter().enumerate() {
            if fd.fd < 0 || fd.revents & ready == 0 {
                continue;
            }
            let c = if i < nup {
                &mut self.up[i]
            } else {
                &mut self.down[i - nup]
            };
            if let Err((err, relayed)) = read_frames(c) {
                self.relayed = relayed;
                return Err(err);
            }
        }
        Ok(())
    }

    /// Reads what the connections made so far have brought (while the others are being made):
    /// the error a failure notice or a hang-up means, if any. Data frames wait in the inboxes.
    pub(super) fn trouble(&mut self) -> Option<Error> {
        match self.poll_all(0, None, Duration::ZERO) {
            Err(e) => Some(e),
            Ok(()) => self
                .up
                .iter()
                .chain(self.down.iter())
                .find(|c| c.gone)
                .map(|c| gone_err(c.rank)),
        }
    }

    /// `trouble`, waiting up to `d` on the connections for a failure notice or a hang-up to
    /// arrive; None if none did.
    pub(super) fn notice_within(&mut self, d: Duration) -> Option<Error> {
        let until = Instant::now() + d;
        loop {
            if let Some(e) = self.trouble() {
                return Some(e);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            if let Err(e) = self.poll_all(0, None, left.min(Duration::from_millis(50))) {
                return Some(e);
            }
        }
    }

    /// Marks the connections broken, tells every peer why and closes our sending side towards
    /// them, so that they stop waiting on us at once. Only the sending side: shutting down
    /// reception would make the kernel answer a peer's next bytes with a reset, which can
    /// overtake the notice and leave that peer without the reason.
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
        for c in self.up.iter_mut().chain(self.down.iter_mut()) {
            if !c.mid_frame {
                let _ = (&c.stream).write(&notice);
            }
            let _ = c.stream.shutdown(Shutdown::Write);
        }
        self.broken = Some(e.clone());
        e
    }
}

/// Reads every complete frame `c` has into its inbox. Err when the peer failed and said so;
/// a hang-up marks it gone.
fn read_frames(c: &mut Conn) -> FrameCheck<()> {
    let who = c.who();
    loop {
        match c.reader.progress(&c.stream, &who) {
            Ok(false) => return Ok(()),
            Ok(true) => {
                let (h, body) =
                    std::mem::replace(&mut c.reader, FrameReader::new(MAX_FRAME)).into_frame();
                if h.kind == ABORT {
                    return Err(relayed(&h, &body, c.rank));
                }
                c.inbox.push_back((h, body));
            }
            Err(e) if e.kind == ErrorKind::Remote => {
                c.gone = true;
                return Ok(());
            }
            Err(e) => return Err((e, None)),
        }
    }
}

/// A peer's connection ended (EOF, reset, broken pipe): say which rank, not which syscall.
fn gone_err(rank: usize) -> Error {
    Error::new(
        ErrorKind::Remote,
        format!("rank {rank} closed its bootstrap connection (it exited, aborted or failed)"),
    )
}

fn relayed(h: &Header, body: &[u8], from: usize) -> (Error, Option<String>) {
    let cause = String::from_utf8_lossy(body).into_owned();
    // A timeout somewhere is a timeout here too; anything else is a peer failure.
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

/// A failure, with the original cause when a peer relayed it.
type FrameCheck<T> = std::result::Result<T, (Error, Option<String>)>;

fn check_frame(
    h: Header,
    body: Vec<u8>,
    e: &Expect,
    from: usize,
    me: usize,
) -> FrameCheck<Vec<u8>> {
    if h.kind != e.kind || h.seq != e.seq {
        let err = Error::new(
            ErrorKind::InvalidUsage,
            format!(
                "bootstrap collectives out of step: rank {from} is in {} #{} while rank {me} is in {} #{}; every rank must call them in the same order",
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
                    "bootstrap broadcast: rank {from} uses root {} but rank {me} uses root {}",
                    h.arg, e.arg
                ),
            )
        } else {
            Error::new(
                ErrorKind::Internal,
                format!(
                    "bootstrap allgather: rank {from} sent rank {}'s data where rank {}'s was due",
                    h.arg, e.arg
                ),
            )
        };
        return Err((err, None));
    }
    Ok(body)
}
