//! Setting up the transport: segments made and announced, fetched from peers over an
//! authenticated unix socket (or duplicated between threads), and links made.

use super::packed::Packing;
use super::peer::{tail_step, Access, CarriedList, ShmPeer};
use super::pull::PULL_FROM_THREAD;
use super::pull::{PULL_FROM_BUSY_COPY, PULL_FROM_BUSY_PROCESS, PULL_FROM_PROCESS};
use super::segment::Segment;
use super::segment::{Geometry, SEG_MAGIC};
use crate::bootstrap::{auth, Bootstrap};
use crate::error::{Error, Result};
use crate::sys::{self, ProcessWatch};
use crate::topo::{Path, Placement};
use crate::transport::Link;
use crate::wire::{self, Reader};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Slot memory faulted in at setup only while one segment's FIFOs stay within this.
pub(super) const PREFAULT_MAX: usize = 16 << 20;

/// Threads (this one included) that fetch a rank's peers' segments at once.
const FETCH_THREADS: usize = 8;

/// What a rank tells its peers so they can reach its segment.
pub(super) struct Announce {
    pub(super) socket: String,
    pub(super) fd: i32,
    pub(super) nonce: u64,
    pub(super) base: u64,
}

impl Announce {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        wire::put_blob(&mut out, self.socket.as_bytes());
        wire::put_u32(&mut out, self.fd as u32);
        wire::put_u64(&mut out, self.nonce);
        wire::put_u64(&mut out, self.base);
        out
    }

    pub(super) fn decode(b: &[u8]) -> Result<Announce> {
        let mut r = Reader::new(b);
        Ok(Announce {
            socket: r.string()?,
            fd: r.u32()? as i32,
            nonce: r.u64()?,
            base: r.u64()?,
        })
    }
}

/// The shm side of a communicator: our segment and a transport per local peer.
pub(crate) struct ShmWorld {
    pub local: Arc<Segment>,
    pub peers: Vec<Option<Arc<ShmPeer>>>,
}

impl ShmWorld {
    /// Where this host's ranks run, read from their segments (`topo::Presence`).
    pub(crate) fn presence(&self) -> Arc<super::ShmPresence> {
        let segments = self
            .peers
            .iter()
            .map(|p| p.as_ref().map(|p| p.remote.clone()));
        Arc::new(super::ShmPresence::new(
            self.local.clone(),
            segments.collect(),
        ))
    }

    /// What warms every link of this world again (`transport::Warm`).
    pub(crate) fn warm(&self) -> Arc<ShmWarm> {
        Arc::new(ShmWarm(self.peers.iter().flatten().cloned().collect()))
    }

    /// Whether some peer in another process may pull from this rank's buffers: the kernel
    /// then copies them (process_vm_readv/writev), pinning every page it touches, and large
    /// ones are better backed by huge pages.
    pub(crate) fn prefers_huge_pages(&self) -> bool {
        self.peers.iter().flatten().any(|p| {
            matches!(p.access, Access::Cma(_))
                && p.remote.pull_ok(p.me).load(Ordering::Relaxed) != 0
        })
    }
}

/// The links of one shm world, warmed together after a large operation.
pub(crate) struct ShmWarm(Vec<Arc<ShmPeer>>);

impl crate::transport::Warm for ShmWarm {
    fn warm(&self) {
        for p in &self.0 {
            p.warm();
        }
    }
}

pub(super) fn auth_context(comm_tag: u64, from: usize, to: usize) -> Vec<u8> {
    format!("comm shm {comm_tag:016x} {from}->{to}").into_bytes()
}

/// Builds the shm transports of one rank. Collective over the communicator's bootstrap.
pub(crate) fn connect(
    boot: &Bootstrap,
    paths: &[Path],
    placements: &[Placement],
    comm_tag: u64,
    registry_bytes: usize,
    deadline: Option<Instant>,
) -> Result<ShmWorld> {
    let me = boot.rank();
    let nranks = boot.nranks();
    let geo = Geometry::from_env(nranks, registry_bytes);
    let mut nonce_bytes = [0u8; 8];
    getrandom::getrandom(&mut nonce_bytes)
        .map_err(|e| Error::new(crate::error::ErrorKind::System, format!("getrandom: {e}")))?;
    let nonce = u64::from_ne_bytes(nonce_bytes);
    let local = Arc::new(Segment::create(me, geo, nonce)?);

    let other_process: Vec<usize> = (0..nranks)
        .filter(|&r| paths[r] == Path::SameHost)
        .collect();
    let socket = format!(
        "comm-shm-{:016x}-{comm_tag:016x}-{me}-{:08x}",
        placements[me].process_token, nonce as u32
    );
    let listener = if other_process.is_empty() {
        None
    } else {
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())
            .map_err(|e| Error::from_io("abstract unix socket name", e))?;
        Some(
            UnixListener::bind_addr(&addr)
                .map_err(|e| Error::from_io(format!("bind unix socket {socket}"), e))?,
        )
    };
    let mine = Announce {
        socket: socket.clone(),
        fd: local.fd.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1),
        nonce,
        base: local.base_addr() as u64,
    };
    let all = boot.allgather(&mine.encode())?;
    crate::fault::point("shm:announced");
    if crate::fault::fails("shm:announced") {
        return Err(Error::new(
            crate::error::ErrorKind::System,
            "COMM_FAULT_INJECT: failing after the shared-memory announcement",
        ));
    }
    let announces = all
        .iter()
        .map(|b| Announce::decode(b))
        .collect::<Result<Vec<_>>>()?;

    // Serve our memfd to the peers in other processes while we fetch theirs.
    let stop = Arc::new(AtomicBool::new(false));
    // Peers that die while we set up must not leave us waiting for them until the deadline.
    let watches: Vec<(usize, ProcessWatch)> = other_process
        .iter()
        .map(|&r| (r, ProcessWatch::new(placements[r].pid)))
        .collect();
    let server = listener.map(|l| {
        let expected: Vec<(usize, ProcessWatch)> = other_process
            .iter()
            .map(|&r| (r, ProcessWatch::new(placements[r].pid)))
            .collect();
        let secret = *boot.secret();
        let fd = mine.fd;
        let stop = stop.clone();
        let aborted = crate::bootstrap::init_abort_flag();
        std::thread::Builder::new()
            .name("comm-shm-setup".into())
            .spawn(move || {
                let stop_or_abort = || {
                    stop.load(Ordering::SeqCst)
                        || aborted.as_ref().is_some_and(|a| a.load(Ordering::SeqCst))
                };
                serve_segment(
                    l,
                    fd,
                    &expected,
                    &secret,
                    comm_tag,
                    me,
                    deadline,
                    stop_or_abort,
                )
            })
            .map_err(|e| Error::from_io("spawn shm setup thread", e))
    });
    let server = server.transpose()?;

    let disable_pull = !crate::env::SHM_PULL.flag();
    let pull_threshold_set = crate::env::SHM_PULL_THRESHOLD.size_if_set();
    let fetched = (|| -> Result<Vec<Option<Arc<ShmPeer>>>> {
        let mut peers: Vec<Option<Arc<ShmPeer>>> = (0..nranks).map(|_| None).collect();
        // A peer that died fails its own fetch, but the fetches from the living go on: each of
        // them serves its segment until every living rank has it, so a rank that stopped at the
        // first failure would leave the others waiting on its server.
        let mut lost: Option<Error> = None;
        let mut fds = fetch_all(
            &announces,
            paths,
            boot.secret(),
            comm_tag,
            me,
            deadline,
            &watches,
            &stop,
        );
        // Each rank starts with itself, then the peer after it: were all to go in rank order,
        // every rank would first queue on rank 0's server (one connection at a time) while
        // the other servers idle, then all on rank 1's, and so on.
        for r in (0..nranks).map(|k| (me + k) % nranks) {
            let (fd, access) = match paths[r] {
                Path::SameProcess => (sys::dup(announces[r].fd)?, Access::Direct),
                Path::SameHost => match fds[r].take() {
                    Some(Ok(fd)) => (fd, Access::Cma(placements[r].pid)),
                    Some(Err(Fetched::Lost(e))) => {
                        lost.get_or_insert(e);
                        continue;
                    }
                    Some(Err(Fetched::StoppedServing(e))) => {
                        return Err(stopped_serving(r, &e, &watches))
                    }
                    Some(Err(Fetched::Failed(e))) => return Err(e),
                    // Never tried: another fetch failed first, and its error is the one to
                    // give (a later rank in this order holds it).
                    None => continue,
                },
                _ => continue,
            };
            let remote = Arc::new(Segment::open(fd, announces[r].nonce, nranks)?);
            let can_pull = !disable_pull
                && match access {
                    Access::Direct => true,
                    Access::Cma(pid) => probe_cma(pid, announces[r].base as usize),
                };
            if !can_pull && !disable_pull {
                crate::info!(
                    "process_vm_readv from rank {r} (pid {}) is not permitted; large messages from it go through shared-memory slots",
                    placements[r].pid
                );
            }
            local.pull_ok(r).store(can_pull as u32, Ordering::Release);
            let (plain, busy, copied) = match access {
                Access::Direct => (PULL_FROM_THREAD, PULL_FROM_THREAD, PULL_FROM_THREAD),
                Access::Cma(_) => (
                    PULL_FROM_PROCESS,
                    PULL_FROM_BUSY_PROCESS,
                    PULL_FROM_BUSY_COPY,
                ),
            };
            // Both ends of both FIFOs with this peer, where the memory that takes stays small
            // (every FIFO of a host with many ranks would be nranks^2 of them).
            if nranks * local.geo.fifo_bytes() <= PREFAULT_MAX {
                local.prefault_fifo(r);
                remote.prefault_fifo(me);
            }
            peers[r] = Some(Arc::new(ShmPeer {
                me,
                peer: r,
                local: local.clone(),
                remote,
                access,
                watch: matches!(access, Access::Cma(_))
                    .then(|| ProcessWatch::new(placements[r].pid)),
                pull_threshold: pull_threshold_set.unwrap_or(plain),
                pull_threshold_busy: pull_threshold_set.unwrap_or(busy),
                pull_threshold_copied: pull_threshold_set.unwrap_or(copied),
                scratch: Mutex::new(None),
                carried: CarriedList::default(),
                tail_seen: AtomicU64::new(0),
                consumed: AtomicU64::new(0),
                tail_step: tail_step(local.geo.nslots),
                pack: Packing::default(),
            }));
        }
        match lost {
            Some(e) => Err(e),
            None => Ok(peers),
        }
    })();
    // A lost peer does not stop the server: the living still fetch from us (see above). A
    // peer whose init failed does (the fetch loop stopped it).
    if fetched
        .as_ref()
        .is_err_and(|e| e.kind != crate::error::ErrorKind::Remote)
    {
        stop.store(true, Ordering::SeqCst);
    }
    let served = server
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| crate::internal_err!("shm setup thread panicked"))
        })
        .unwrap_or(Ok(()));
    // This process's own failure to serve (out of descriptors, say) explains the peers'
    // refusals that the fetches met: it goes first.
    if let Err(e) = &served {
        if e.kind == crate::error::ErrorKind::System {
            return Err(e.clone());
        }
    }
    let peers = fetched?;
    served?;
    // Nobody sends before every receiver has published whether it can pull.
    boot.barrier()?;
    for (r, p) in peers.iter().enumerate() {
        if let Some(p) = p {
            crate::info!("rank {me} -> rank {r}: {}", p.describe());
        }
    }
    Ok(ShmWorld { local, peers })
}

/// Why the fetch of one peer's segment failed, sorted by what it means for the whole setup.
enum Fetched {
    /// The peer is gone: the fetches from the living go on (they serve until every living
    /// rank has fetched), and this is the error afterwards.
    Lost(Error),
    /// The peer refused or dropped the fetch and lives on: its init failed. This rank has
    /// stopped serving already, which tells the other peers at once.
    StoppedServing(Error),
    /// This rank's own failure (deadline, abort, out of descriptors): nothing more is tried.
    Failed(Error),
}

/// Fetches the segments of this rank's peers in other processes (`paths` says which) from
/// a few threads at once: each fetch is a few round trips with a peer that serves one
/// connection at a time, and one after another they added up to most of a large host's init.
/// Each thread takes the next peer in the order that starts after this rank; after a failure
/// other than a lost peer, nothing more is started. Index r of the result is rank r's fetch,
/// `None` where there is none (not another process, or not tried).
#[allow(clippy::too_many_arguments)]
fn fetch_all(
    announces: &[Announce],
    paths: &[Path],
    secret: &[u8; 32],
    comm_tag: u64,
    me: usize,
    deadline: Option<Instant>,
    watches: &[(usize, ProcessWatch)],
    stop: &AtomicBool,
) -> Vec<Option<std::result::Result<OwnedFd, Fetched>>> {
    let nranks = paths.len();
    let order: Vec<usize> = (0..nranks)
        .map(|k| (me + k) % nranks)
        .filter(|&r| paths[r] == Path::SameHost)
        .collect();
    let results: Vec<Mutex<Option<std::result::Result<OwnedFd, Fetched>>>> =
        (0..nranks).map(|_| Mutex::new(None)).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let quit = AtomicBool::new(false);
    let fetch_one = |r: usize| -> std::result::Result<OwnedFd, Fetched> {
        let watch = watches.iter().find(|w| w.0 == r).map(|w| &w.1);
        fetch_segment(
            &announces[r].socket,
            secret,
            comm_tag,
            me,
            r,
            deadline,
            watch,
        )
        .map_err(|e| e.context(format!("connecting to rank {r}'s shared memory")))
        .map_err(|e| match e.kind {
            // A peer that failed its init (it refused or dropped the fetch) but lives on
            // will not fetch from us either, and our server would wait for it until the
            // deadline: stop serving too, which tells the other peers at once (their fetches
            // from us fail in turn).
            crate::error::ErrorKind::Remote if watch.is_some_and(lives_on) => {
                stop.store(true, Ordering::SeqCst);
                quit.store(true, Ordering::SeqCst);
                Fetched::StoppedServing(e)
            }
            crate::error::ErrorKind::Remote => Fetched::Lost(e),
            _ => {
                quit.store(true, Ordering::SeqCst);
                Fetched::Failed(e)
            }
        })
    };
    let work = || {
        while !quit.load(Ordering::SeqCst) {
            let Some(&r) = order.get(next.fetch_add(1, Ordering::Relaxed)) else {
                break;
            };
            let got = fetch_one(r);
            *results[r].lock() = Some(got);
        }
    };
    let helpers = order.len().min(FETCH_THREADS).saturating_sub(1);
    std::thread::scope(|s| {
        for _ in 0..helpers {
            // A helper that cannot start leaves its share to the others (this thread works too).
            let _ = std::thread::Builder::new()
                .name("comm-shm-fetch".into())
                .spawn_scoped(s, work);
        }
        work();
    });
    results.into_iter().map(|m| m.into_inner()).collect()
}

pub(super) fn probe_cma(pid: u32, remote_base: usize) -> bool {
    let mut word = [0u8; 8];
    // SAFETY: word is 8 writable bytes.
    let ok = unsafe { sys::cma_read(pid, word.as_mut_ptr(), remote_base, 8) }.is_ok();
    ok && u64::from_ne_bytes(word) == SEG_MAGIC
}

/// Serves descriptor `fd` to each of the `expected` peers that connects to `listener` and
/// proves it knows the secret (also used by `window` to share window memory).
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve_segment(
    listener: UnixListener,
    fd: i32,
    expected: &[(usize, ProcessWatch)],
    secret: &[u8; 32],
    comm_tag: u64,
    me: usize,
    deadline: Option<Instant>,
    stop: impl Fn() -> bool,
) -> Result<()> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::from_io("unix listener", e))?;
    let mut pending: Vec<usize> = expected.iter().map(|e| e.0).collect();
    // Peers that died before fetching: the living are still served, then this is the error.
    let mut lost: Option<Error> = None;
    while !pending.is_empty() {
        if stop() {
            return Ok(());
        }
        for (r, w) in expected {
            if pending.contains(r) && !w.alive() {
                pending.retain(|p| p != r);
                lost.get_or_insert_with(|| {
                    Error::new(
                        crate::error::ErrorKind::Remote,
                        format!(
                            "rank {r} exited before it fetched this rank's shared memory segment"
                        ),
                    )
                });
            }
        }
        if pending.is_empty() {
            break;
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            return crate::timeout_err!(
                "ranks {pending:?} never fetched this rank's shared memory segment"
            );
        }
        let (mut s, _) = match listener.accept() {
            Ok(c) => c,
            // Nothing queued: sleep in poll, which wakes as soon as a peer connects (a fixed
            // sleep here delayed every fetcher that found the server idle). The bound keeps
            // stop, abort, dead peers and the deadline checked above.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                sys::wait_readable(listener.as_raw_fd(), Duration::from_millis(10))?;
                continue;
            }
            Err(e) => return Err(Error::from_io("accept on shm setup socket", e)),
        };
        let handshake = (|| -> Result<usize> {
            s.set_nonblocking(false)
                .map_err(|e| Error::from_io("unix socket", e))?;
            let t = Some(Duration::from_secs(5));
            s.set_read_timeout(t)
                .map_err(|e| Error::from_io("unix socket", e))?;
            s.set_write_timeout(t)
                .map_err(|e| Error::from_io("unix socket", e))?;
            let mut rb = [0u8; 4];
            s.read_exact(&mut rb)
                .map_err(|e| Error::from_io("read peer rank", e))?;
            let from = u32::from_le_bytes(rb) as usize;
            if !pending.contains(&from) {
                return crate::invalid_usage!("unexpected shm connection claiming rank {from}");
            }
            auth::server(&mut s, secret, &auth_context(comm_tag, from, me))?;
            sys::send_fd(&s, fd)?;
            Ok(from)
        })();
        match handshake {
            Ok(from) => pending.retain(|&r| r != from),
            Err(e) => crate::warn!("refused a connection to the shm setup socket: {}", e.msg),
        }
    }
    lost.map_or(Ok(()), Err)
}

/// What a failed fetch from a peer that lives on means: its init failed.
pub(super) const STOPPED_SERVING: &str = "stopped serving its shared memory segment before this rank fetched it: its communicator init failed (its own error says why)";

/// The error of a rank whose fetch from rank `r` failed while `r` lives on: `r` stopped
/// serving because its init failed, most often because another rank died. The rank that died
/// is named first, as the cause (a peer killed during init made its neighbours give up, and the
/// rank that found one of them given up blamed it, a live rank, 1 run in 7), where one of
/// `watches` shows it gone within a moment.
pub(super) fn stopped_serving(r: usize, e: &Error, watches: &[(usize, ProcessWatch)]) -> Error {
    let until = Instant::now() + Duration::from_millis(100);
    loop {
        if let Some(&(dead, _)) = watches.iter().find(|(p, w)| *p != r && !w.alive()) {
            return Error::lost_peer(
                dead,
                format!(
                    "rank {dead} exited during init (its process is gone); rank {r} then {STOPPED_SERVING} ({})",
                    e.msg
                ),
            );
        }
        if Instant::now() >= until {
            return Error::lost_peer(r, format!("rank {r} {STOPPED_SERVING} ({})", e.msg));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether a peer whose fetch just failed is still alive a moment later: a process being killed
/// resets its connections before it counts as exited.
pub(super) fn lives_on(w: &ProcessWatch) -> bool {
    let until = Instant::now() + Duration::from_millis(50);
    while w.alive() {
        if Instant::now() >= until {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// Fetches the descriptor a peer serves with [`serve_segment`] on abstract socket `socket`.
pub(crate) fn fetch_segment(
    socket: &str,
    secret: &[u8; 32],
    comm_tag: u64,
    me: usize,
    peer: usize,
    deadline: Option<Instant>,
    watch: Option<&ProcessWatch>,
) -> Result<OwnedFd> {
    let addr = SocketAddr::from_abstract_name(socket.as_bytes())
        .map_err(|e| Error::from_io("abstract unix socket name", e))?;
    let mut s = loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => break s,
            Err(_) if watch.is_some_and(|w| !w.alive()) => {
                return crate::remote_err!(
                    "rank {peer} exited before it served its shared memory segment"
                )
            }
            // The peer bound its socket before it announced it: refused now means it closed
            // it, which it does only when its own init failed (it serves until every peer has
            // fetched). Waiting would last until the deadline (COMM_INIT_TIMEOUT).
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return crate::remote_err!("rank {peer} closed its shared memory setup socket")
            }
            // Out of descriptors is this rank's own failure, and waiting does not cure it.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                return Err(Error::from_io(
                    format!("connect to unix socket {socket}"),
                    e,
                ))
            }
            Err(_) if crate::bootstrap::init_aborted() => {
                return Err(Error::new(
                    crate::error::ErrorKind::Internal,
                    format!("aborted (ncclCommAbort) while fetching rank {peer}'s shared memory"),
                ))
            }
            Err(e) if deadline.is_none_or(|d| Instant::now() < d) => {
                crate::trace!("connect to rank {peer}'s shm socket: {e}; retrying");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                return Err(Error::from_io(
                    format!("connect to unix socket {socket}"),
                    e,
                ))
            }
        }
    };
    // A peer that stops answering must not hold this rank past its deadline.
    let left = deadline.map_or(Duration::from_secs(30), |d| {
        d.saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(100), Duration::from_secs(30))
    });
    let t = Some(left);
    s.set_read_timeout(t)
        .map_err(|e| Error::from_io("unix socket", e))?;
    s.set_write_timeout(t)
        .map_err(|e| Error::from_io("unix socket", e))?;
    s.write_all(&(me as u32).to_le_bytes())
        .map_err(|e| Error::from_io("send rank", e))?;
    auth::client(&mut s, secret, &auth_context(comm_tag, me, peer))?;
    sys::recv_fd(&s)
}
