//! A rank's side of the root service (see [`super::root`]): what it says when it checks in, what
//! it hears back, and how it waits: warning after COMM_WARN_AFTER with the root's list of who is
//! missing, and asking the root again when its own deadline passes, so that the error names them.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::auth::{self, TcpWire};
use super::net::{self, kind_from_code, pollfd, Dec, Enc, Header, Waiter};
use super::root::{root_context, FAIL, PEEK, QUERY, QUERY_GRACE, READY, ROOT_FRAME_LIMIT, STATUS};
use super::UniqueId;
use crate::error::{Error, ErrorKind, Result};

/// What a rank tells its root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CheckIn {
    pub rank: u32,
    pub nranks: u32,
    pub nroots: u32,
    pub root_index: u32,
    pub tag: u64,
    pub listen: SocketAddr,
    /// The rank's record for the others (opaque here; empty if none), which travels with its
    /// address: to its predecessor through the root, then through the rounds to everyone.
    pub card: Vec<u8>,
}

impl CheckIn {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.rank)
            .u32(self.nranks)
            .u32(self.nroots)
            .u32(self.root_index)
            .u64(self.tag)
            .addr(&self.listen)
            .blob(&self.card);
        e.0
    }

    pub(super) fn decode(b: &[u8]) -> Result<CheckIn> {
        let mut d = Dec::new(b);
        let c = CheckIn {
            rank: d.u32()?,
            nranks: d.u32()?,
            nroots: d.u32()?,
            root_index: d.u32()?,
            tag: d.u64()?,
            listen: d.addr()?,
            card: d.blob()?,
        };
        d.finish()?;
        Ok(c)
    }
}

/// What a checked-in rank learns from its root: the listener addresses of its successor and of its
/// predecessor, so that it can connect to the one and watch for the other.
///
/// With several roots the predecessor of the first rank of a block is the last rank of the
/// previous block, which this root does not know: `prev` is then `None`, and the rank learns it from
/// the previous root's answer to its announcement (see [`announced_prev`]), which it waits for anyway;
/// so every rank gets both without an extra round trip.
///
/// Wire format: next address, then a presence byte (0 or 1) and, when 1, the prev address, then
/// the successor's card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ready {
    pub next: SocketAddr,
    pub prev: Option<SocketAddr>,
    /// The successor's card (see `CheckIn::card`).
    pub next_card: Vec<u8>,
}

impl Ready {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.addr(&self.next);
        match &self.prev {
            Some(p) => e.u8(1).addr(p),
            None => e.u8(0),
        };
        e.blob(&self.next_card);
        e.0
    }

    pub(super) fn decode(b: &[u8]) -> Result<Ready> {
        let mut d = Dec::new(b);
        let next = d.addr()?;
        let prev = match d.u8()? {
            0 => None,
            1 => Some(d.addr()?),
            k => {
                return crate::internal_err!(
                    "the bootstrap root sent a READY frame with a bad predecessor marker {k}"
                )
            }
        };
        let next_card = d.blob()?;
        d.finish()?;
        Ok(Ready {
            next,
            prev,
            next_card,
        })
    }
}

/// The root's answer to an announcement: the announcer's predecessor, the last rank of the block
/// that root serves.
pub(crate) fn announced_prev(b: &[u8]) -> Result<SocketAddr> {
    let mut d = Dec::new(b);
    let prev = d.addr()?;
    d.finish()?;
    Ok(prev)
}

/// A rank's connection to a root.
pub(crate) struct RootSession {
    stream: TcpStream,
    root: SocketAddr,
}

impl RootSession {
    /// Connects (retrying while the root is not up yet), authenticates and checks in.
    pub(super) fn open(
        id: &UniqueId,
        kind: u8,
        me: &CheckIn,
        w: Waiter<'_>,
    ) -> Result<RootSession> {
        let who = format!("the bootstrap root {}", id.root);
        let stream = net::connect(id.root, w, true, &who)?;
        let mut wire = TcpWire {
            stream: &stream,
            waiter: w,
            peer: &who,
        };
        auth::client_on(&mut wire, &id.secret, &root_context(id)).map_err(|e| {
            if e.kind == ErrorKind::Remote && id.root_at_init {
                // Every rank derives the id from NCCL_COMM_ID and COMM_SECRET: a root that does
                // not know it was most likely given another secret.
                e.context(format!(
                    "the bootstrap root {} does not serve this rank's id: the ranks' COMM_SECRET (or NCCL_COMM_ID strings) most likely differ; else the rendezvous is over or expired after COMM_INIT_TIMEOUT",
                    id.root
                ))
            } else if e.kind == ErrorKind::Remote {
                e.context(format!(
                    "the bootstrap root {} does not serve this unique id (any more): its rendezvous is over, it expired after COMM_INIT_TIMEOUT, or the process that made it restarted",
                    id.root
                ))
            } else {
                e
            }
        })?;
        let body = me.encode();
        net::send_frame(&stream, Header::new(kind, 0, 0, body.len()), &body, w, &who)?;
        Ok(RootSession {
            stream,
            root: id.root,
        })
    }

    /// Waits for the root's go-ahead and returns its payload. When `warn` says so and the wait
    /// lasts, we ask the root who is missing and warn, then wait on. When our own deadline passes
    /// first we ask the root who is missing, so that the error names them.
    pub(super) fn wait_ready(
        &self,
        w: Waiter<'_>,
        started: Instant,
        warn: Option<&WarnWait>,
    ) -> Result<Vec<u8>> {
        let who = format!("the bootstrap root {}", self.root);
        if let Some(warn) = warn.filter(|_| w.deadline.is_none_or(|d| d > started + warn_after())) {
            let early = Waiter::new(Some(started + warn_after()), w.abort);
            // Only wait for something to read here: a frame is read whole below.
            loop {
                if self.readable(early.slice())? {
                    break;
                }
                if let Err(e) = early.check(|| who.clone()) {
                    if e.kind != ErrorKind::Timeout {
                        return Err(e);
                    }
                    if let Some(answer) = self.warn_still_waiting(warn, w, started)? {
                        return Ok(answer);
                    }
                    break;
                }
            }
        }
        match net::recv_frame(&self.stream, ROOT_FRAME_LIMIT, w, &who) {
            Ok((h, body)) => self.answer(h, &body),
            Err(e) if e.kind == ErrorKind::Timeout => Err(self.ask_who_is_missing(w, started)),
            Err(e) if e.kind == ErrorKind::Remote => Err(Error::new(
                ErrorKind::Remote,
                format!(
                    "{} before the rendezvous completed (did the process that created the unique id exit?)",
                    e.msg
                ),
            )),
            Err(e) => Err(e),
        }
    }

    fn answer(&self, h: Header, body: &[u8]) -> Result<Vec<u8>> {
        match h.kind {
            READY => Ok(body.to_vec()),
            FAIL => {
                let mut d = Dec::new(body);
                let kind = kind_from_code(d.u8()?);
                Err(Error::new(kind, d.text()?))
            }
            k => crate::internal_err!(
                "the bootstrap root {} sent unexpected message kind {k}",
                self.root
            ),
        }
    }

    /// Whether the root has sent something, waiting at most `slice`.
    fn readable(&self, slice: Duration) -> Result<bool> {
        let mut fds = [pollfd(self.stream.as_raw_fd(), libc::POLLIN)];
        net::poll(&mut fds, Some(slice))?;
        Ok(fds[0].revents != 0)
    }

    /// COMM_WARN_AFTER has passed: asks the root who is missing and warns. The root's go-ahead may
    /// cross the question; it is then returned.
    fn warn_still_waiting(
        &self,
        warn: &WarnWait,
        w: Waiter<'_>,
        started: Instant,
    ) -> Result<Option<Vec<u8>>> {
        let who = format!("the bootstrap root {}", self.root);
        let grace = Waiter::new(Some(Instant::now() + QUERY_GRACE), w.abort);
        let asked = net::send_frame(&self.stream, Header::new(PEEK, 0, 0, 0), &[], grace, &who)
            .and_then(|_| net::recv_frame(&self.stream, ROOT_FRAME_LIMIT, grace, &who));
        let (text, arrived) = match asked {
            Ok((h, body)) if h.kind == STATUS => {
                let mut d = Dec::new(&body);
                let text = d.text().unwrap_or_default();
                (text, d.u32().ok().map(|a| a as usize))
            }
            Ok((h, body)) => return self.answer(h, &body).map(Some),
            Err(e) if e.kind == ErrorKind::Timeout => (
                format!("{who} did not say who is missing ({})", e.msg),
                None,
            ),
            Err(e) => return Err(e),
        };
        crate::warn!(
            "{}",
            still_waiting_text(
                warn,
                &text,
                arrived,
                started.elapsed(),
                w.deadline.map(|d| d - started)
            )
        );
        Ok(None)
    }

    fn ask_who_is_missing(&self, w: Waiter<'_>, started: Instant) -> Error {
        let waited = started.elapsed().as_secs_f64();
        let who = format!("the bootstrap root {}", self.root);
        let grace = Waiter::new(Some(Instant::now() + QUERY_GRACE), w.abort);
        let asked = net::send_frame(&self.stream, Header::new(QUERY, 0, 0, 0), &[], grace, &who)
            .and_then(|_| net::recv_frame(&self.stream, ROOT_FRAME_LIMIT, grace, &who));
        match asked {
            Ok((h, body)) if h.kind == STATUS => {
                let text = Dec::new(&body).text().unwrap_or_default();
                Error::new(
                    ErrorKind::Timeout,
                    format!("bootstrap init timed out after {waited:.1} s: {text}"),
                )
            }
            Ok((h, body)) if h.kind == FAIL => self
                .answer(h, &body)
                .err()
                .unwrap_or_else(|| Error::new(ErrorKind::Internal, "unreachable")),
            Ok(_) => Error::new(
                ErrorKind::Timeout,
                format!(
                    "bootstrap init timed out after {waited:.1} s, just as the rendezvous at {} completed",
                    self.root
                ),
            ),
            Err(e) => Error::new(
                ErrorKind::Timeout,
                format!(
                    "bootstrap init timed out after {waited:.1} s waiting for the other ranks at {who}, which did not say who is missing ({})",
                    e.msg
                ),
            ),
        }
    }
}

/// What a rank waiting at its root knows for the warning of [`RootSession::wait_ready`].
pub(crate) struct WarnWait {
    pub rank: usize,
    pub nranks: usize,
    /// The unique id was made by ncclGetUniqueId in this very process.
    pub id_made_here: bool,
}

/// COMM_WARN_AFTER, for init and for the communicators' operations: 0 (no limit) gives the
/// default, as the warning cannot be turned off.
pub(crate) fn warn_after() -> Duration {
    crate::env::WARN_AFTER
        .seconds_if_set()
        .flatten()
        .or_else(|| crate::env::WARN_AFTER.default_seconds())
        .expect("COMM_WARN_AFTER declares a limit")
}

/// The warning of a rank whose init has waited COMM_WARN_AFTER at its root: who is missing
/// (`text`, the root's words), and the likely cause when this rank is alone there.
fn still_waiting_text(
    warn: &WarnWait,
    text: &str,
    arrived: Option<usize>,
    waited: Duration,
    limit: Option<Duration>,
) -> String {
    let WarnWait {
        rank,
        nranks,
        id_made_here,
    } = *warn;
    let mut msg = format!(
        "rank {rank} of {nranks}: init has waited {} for the other ranks (COMM_WARN_AFTER): {text}",
        crate::log::secs(Duration::from_secs(waited.as_secs()))
    );
    let alone = arrived == Some(1) && nranks > 1;
    if alone && rank != 0 && id_made_here {
        msg.push_str(&format!(
            "; rank {rank} uses a unique id its own process made with ncclGetUniqueId: the ranks seem to have each called ncclGetUniqueId for themselves, so that each waits at a root of its own; call it on rank 0 only and pass that id to every rank (MPI_Bcast, a file, a key-value store)"
        ));
    } else if alone {
        msg.push_str(
            "; no other rank has reached this root: are the other processes running, and were they all given rank 0's unique id? Ranks that each call ncclGetUniqueId for themselves wait at roots of their own",
        );
    }
    msg.push_str(&format!(
        "; waiting on until COMM_INIT_TIMEOUT ({})",
        crate::log::limit(limit)
    ));
    msg
}
