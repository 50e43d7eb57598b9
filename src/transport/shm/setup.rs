//! Setting up the transport: segments made and announced, then each link made at its first use
//! (the peer's segment taken out of its process with pidfd_getfd, see `connect_as`) or every
//! link at init (segments fetched from peers over an authenticated unix socket, or duplicated
//! between threads).

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
use crate::transport::demand::{Connect, OnDemand};
use crate::transport::{Closing, Link};
use crate::wire::{self, Reader};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Slot memory faulted in at setup only while one segment's FIFOs stay within this.
pub(super) const PREFAULT_MAX: usize = 16 << 20;

/// Threads (this one included) that fetch a rank's peers' segments at once.
const FETCH_THREADS: usize = 8;

#[cfg(test)]
thread_local! {
    /// Whether links are made on demand in the tests of this thread, whatever
    /// NCCL_RUNTIME_CONNECT says (None: what it says).
    pub(crate) static DEMAND_FOR_TEST: std::cell::Cell<Option<bool>> =
        const { std::cell::Cell::new(None) };
}

/// Whether this rank asks for its shared-memory links to be made at first use
/// (NCCL_RUNTIME_CONNECT; see `connect_as`).
pub(crate) fn demand_wanted() -> bool {
    #[cfg(test)]
    if let Some(d) = DEMAND_FOR_TEST.with(|c| c.get()) {
        return d;
    }
    crate::env::RUNTIME_CONNECT.flag()
}

/// What a rank tells its peers so they can reach its segment.
pub(super) struct Announce {
    pub(super) socket: String,
    pub(super) fd: i32,
    pub(super) nonce: u64,
    pub(super) base: u64,
    /// This rank asks for links made on demand and may take the descriptors of every local
    /// peer in another process (`sys::may_take_fds`). Every rank's must hold for any to.
    pub(super) takes: bool,
}

impl Announce {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        wire::put_blob(&mut out, self.socket.as_bytes());
        wire::put_u32(&mut out, self.fd as u32);
        wire::put_u64(&mut out, self.nonce);
        wire::put_u64(&mut out, self.base);
        wire::put_u32(&mut out, self.takes as u32);
        out
    }

    pub(super) fn decode(b: &[u8]) -> Result<Announce> {
        let mut r = Reader::new(b);
        Ok(Announce {
            socket: r.string()?,
            fd: r.u32()? as i32,
            nonce: r.u64()?,
            base: r.u64()?,
            takes: r.u32()? != 0,
        })
    }
}

/// The shm side of a communicator: our segment and a transport per local peer.
pub(crate) struct ShmWorld {
    pub local: Arc<Segment>,
    peers: Arc<Peers>,
}

/// How this rank reaches a local peer's segment on demand: from its announcement.
struct Reach {
    /// The peer's descriptor of its segment, in the peer's process.
    fd: i32,
    nonce: u64,
    access: Access,
    /// A peer in this process: its segment itself, held from init. It costs no mapping (the
    /// owner mapped it) and outlives the owner's communicator, so that a peer that first uses
    /// the link after the owner aborted or destroyed still reads how it ended.
    held: Option<Arc<Segment>>,
}

/// The segments of this process's communicators, by nonce, for their peers in this process.
static IN_THIS_PROCESS: Mutex<Vec<(u64, std::sync::Weak<Segment>)>> = Mutex::new(Vec::new());

/// Lists `seg` (nonce `nonce`) for peers in this process, forgetting the segments gone.
fn list_in_this_process(nonce: u64, seg: &Arc<Segment>) {
    let mut all = IN_THIS_PROCESS.lock();
    all.retain(|(_, w)| w.strong_count() > 0);
    all.push((nonce, Arc::downgrade(seg)));
}

/// The segment of nonce `nonce` made in this process, while its communicator lives.
fn in_this_process(nonce: u64) -> Option<Arc<Segment>> {
    let all = IN_THIS_PROCESS.lock();
    all.iter().find(|(n, _)| *n == nonce)?.1.upgrade()
}

/// A rank's links to its local peers: made at init (every peer, `RUNTIME_CONNECT=0` or where
/// descriptors cannot be taken from the peers), or each when first needed (`reach`).
pub(crate) struct Peers {
    me: usize,
    nranks: usize,
    local: Arc<Segment>,
    /// Per rank, how to map its segment on demand; empty when every link was made at init.
    reach: Vec<Option<Reach>>,
    made: Vec<OnceLock<Arc<ShmPeer>>>,
    /// One mapping at a time (each is a few system calls).
    mapping: Mutex<()>,
    pull_threshold_set: Option<usize>,
    disable_pull: bool,
}

impl Peers {
    /// Rank `r`'s link, if it has been made.
    pub(super) fn made(&self, r: usize) -> Option<&Arc<ShmPeer>> {
        self.made.get(r)?.get()
    }

    /// Rank `r`'s link, made now if it can be (on demand): its segment is duplicated out of
    /// the peer's process with pidfd_getfd (or out of this process), checked against the
    /// announcement and mapped. Nothing here waits for the peer.
    fn connect(&self, r: usize) -> Result<Arc<ShmPeer>> {
        if let Some(p) = self.made(r) {
            return Ok(p.clone());
        }
        let Some(reach) = self.reach.get(r).and_then(|x| x.as_ref()) else {
            return crate::internal_err!("rank {r} is not reached through shared memory");
        };
        let _one = self.mapping.lock();
        if let Some(p) = self.made(r) {
            return Ok(p.clone());
        }
        // Kept by the link to tell when the peer exits; its pidfd also takes the descriptor.
        let watch = match reach.access {
            Access::Cma(pid) => Some(ProcessWatch::new(pid)),
            Access::Direct => None,
        };
        // The peer's descriptor is gone, or is no longer its segment: the peer exited, or
        // freed the segment with its communicator (destroy, abort, a failed init), which its
        // segment would have said had this rank mapped it before.
        let gone = |e: Error| {
            let exited = e.kind == crate::error::ErrorKind::Remote
                || watch.as_ref().is_some_and(|w| !w.alive());
            if exited {
                Error::lost_peer(
                    r,
                    format!(
                        "rank {r} exited before this rank first used their link (its process is gone)"
                    ),
                )
            } else {
                Error::lost_peer(
                    r,
                    format!(
                        "rank {r} freed its shared memory segment (it destroyed or aborted the communicator, or its init failed) before this rank first used their link ({})",
                        e.msg
                    ),
                )
            }
        };
        let remote = (|| -> Result<Arc<Segment>> {
            if let Some(seg) = &reach.held {
                return Ok(seg.clone());
            }
            let fd = match reach.access {
                Access::Direct => sys::dup(reach.fd).map_err(gone)?,
                Access::Cma(pid) => watch
                    .as_ref()
                    .map_or_else(|| sys::take_fd(pid, reach.fd), |w| w.take_fd(reach.fd))
                    .map_err(|e| match e.kind {
                        // The process is exiting.
                        crate::error::ErrorKind::Remote => gone(e),
                        // Not permitted (the pid now belongs to another process, say).
                        crate::error::ErrorKind::System
                            if sys::may_take_fds(pid)
                                || !watch.as_ref().is_some_and(|w| w.alive()) =>
                        {
                            gone(e)
                        }
                        _ => e.context(format!(
                            "taking rank {r}'s shared memory segment out of its process (pid {pid})"
                        )),
                    })?,
            };
            Ok(Arc::new(
                Segment::open(fd, reach.nonce, self.nranks).map_err(gone)?,
            ))
        })();
        // A peer that ended before this rank mapped its segment may have sent its last
        // messages already: they lie in this rank's own segment, and are received as from a
        // peer that ended afterwards. The link stands on a segment of this rank's own making
        // (nothing rings or reads the peer's); sends and waits on it fail naming the peer.
        let (remote, gone) = match remote {
            Ok(seg) => (seg, None),
            Err(e) if e.lost == Some(r) => {
                let stand_in = Segment::create(r, self.local.geo, reach.nonce)?;
                (Arc::new(stand_in), Some(e))
            }
            Err(e) => return Err(e),
        };
        let mut p = new_peer(
            self.me,
            r,
            &self.local,
            remote,
            reach.access,
            watch,
            self.pull_threshold_set,
        );
        // What the peer noted in this rank's segment of how it ended says more than that it
        // is gone (an abort, the operations it disagreed on).
        let gone = gone.map(|e| p.ended().unwrap_or(e));
        match &gone {
            Some(e) => crate::info!("rank {} -> rank {r}: {}", self.me, e.msg),
            None => crate::info!(
                "rank {} -> rank {r}: {} (mapped at first use)",
                self.me,
                p.describe()
            ),
        }
        p.gone = gone;
        let p = Arc::new(p);
        Ok(self.made[r].get_or_init(|| p).clone())
    }

    /// How many peers' segments this rank has mapped.
    #[cfg(test)]
    pub(crate) fn mapped(&self) -> usize {
        self.made.iter().filter(|m| m.get().is_some()).count()
    }

    pub(super) fn nranks(&self) -> usize {
        self.nranks
    }

    pub(super) fn local(&self) -> &Arc<Segment> {
        &self.local
    }
}

/// The link of a local peer that is made at first use (`transport::demand`).
struct ShmConnect {
    peers: Arc<Peers>,
    peer: usize,
}

impl Connect for ShmConnect {
    fn poll(&self) -> Result<Option<Arc<dyn Link>>> {
        Ok(Some(self.peers.connect(self.peer)? as Arc<dyn Link>))
    }

    /// Nothing to check before the first use: the first use maps the segment or names the
    /// peer that is gone, and a link that a schedule waits on has had its first use.
    fn check_peer(&self) -> Result<()> {
        Ok(())
    }

    fn describe(&self) -> String {
        format!("shm to rank {}, not mapped yet", self.peer)
    }

    /// Marks this rank's segment closed, which a peer reads once it maps it (or already
    /// does, through its own link to this rank). No peer's doorbell is rung: this rank has
    /// not mapped the peer's segment.
    fn close(&self, how: Closing, lost: Option<usize>) {
        self.peers.local.mark_closed(how, lost);
        // A peer that maps this rank's segment only after it was freed learns how this rank
        // ended from a note in its own segment; for a failure, which is worth a mapping, this
        // rank makes the link to leave it. A destroy leaves none (the peer finds the segment
        // freed, and receives what was sent before).
        if how != Closing::Destroyed {
            if let Ok(p) = self.peers.connect(self.peer) {
                p.close(how, lost);
            }
        }
    }
}

/// Faults in both ends of both FIFOs of a link made at init, where the memory that takes stays
/// small (every FIFO of a host with many ranks would be nranks^2 of them). A link made at
/// first use does not: its pages are faulted as messages first touch them (an 8-byte message
/// one page of each FIFO, not the 2 MiB of both, which the first call would have paid for).
fn prefault(me: usize, r: usize, local: &Segment, remote: &Segment) {
    if local.geo.nranks * local.geo.fifo_bytes() <= PREFAULT_MAX {
        local.prefault_fifo(r);
        remote.prefault_fifo(me);
    }
}

/// One end of a link with rank `r`, whose segment `remote` is mapped.
fn new_peer(
    me: usize,
    r: usize,
    local: &Arc<Segment>,
    remote: Arc<Segment>,
    access: Access,
    watch: Option<ProcessWatch>,
    pull_threshold_set: Option<usize>,
) -> ShmPeer {
    let (plain, busy, copied) = match access {
        Access::Direct => (PULL_FROM_THREAD, PULL_FROM_THREAD, PULL_FROM_THREAD),
        Access::Cma(_) => (
            PULL_FROM_PROCESS,
            PULL_FROM_BUSY_PROCESS,
            PULL_FROM_BUSY_COPY,
        ),
    };
    ShmPeer {
        me,
        peer: r,
        local: local.clone(),
        remote,
        access,
        watch,
        pull_threshold: pull_threshold_set.unwrap_or(plain),
        pull_threshold_busy: pull_threshold_set.unwrap_or(busy),
        pull_threshold_copied: pull_threshold_set.unwrap_or(copied),
        scratch: Mutex::new(None),
        carried: CarriedList::default(),
        tail_seen: AtomicU64::new(0),
        consumed: AtomicU64::new(0),
        tail_step: tail_step(local.geo.nslots),
        pack: Packing::default(),
        gone: None,
    }
}

impl ShmWorld {
    /// A world whose links were all made (`peers[r]`: rank r's, where shared memory reaches it).
    pub(super) fn made_of(
        me: usize,
        local: Arc<Segment>,
        peers: Vec<Option<Arc<ShmPeer>>>,
        disable_pull: bool,
    ) -> ShmWorld {
        let made = peers
            .into_iter()
            .map(|p| p.map_or_else(OnceLock::new, OnceLock::from))
            .collect();
        ShmWorld::of(me, local, Vec::new(), made, None, disable_pull)
    }

    /// A world whose links are made at first use, from the peers' announcements (`reach`).
    fn on_demand(
        me: usize,
        local: Arc<Segment>,
        reach: Vec<Option<Reach>>,
        pull_threshold_set: Option<usize>,
        disable_pull: bool,
    ) -> ShmWorld {
        let made = reach.iter().map(|_| OnceLock::new()).collect();
        ShmWorld::of(me, local, reach, made, pull_threshold_set, disable_pull)
    }

    fn of(
        me: usize,
        local: Arc<Segment>,
        reach: Vec<Option<Reach>>,
        made: Vec<OnceLock<Arc<ShmPeer>>>,
        pull_threshold_set: Option<usize>,
        disable_pull: bool,
    ) -> ShmWorld {
        ShmWorld {
            local: local.clone(),
            peers: Arc::new(Peers {
                me,
                nranks: made.len(),
                local,
                reach,
                made,
                mapping: Mutex::new(()),
                pull_threshold_set,
                disable_pull,
            }),
        }
    }

    /// Where this host's ranks run, read from their segments (`topo::Presence`): those
    /// mapped so far.
    pub(crate) fn presence(&self) -> Arc<super::ShmPresence> {
        Arc::new(super::ShmPresence::of_links(self.peers.clone()))
    }

    /// What warms every link of this world again (`transport::Warm`): those made so far.
    pub(crate) fn warm(&self) -> Arc<ShmWarm> {
        Arc::new(ShmWarm(self.peers.clone()))
    }

    /// Rank `r`'s link as the communicator holds it: the link itself when it was made at
    /// init, else one that maps the peer's segment at first use; None where shared memory
    /// does not reach `r`.
    pub(crate) fn link(&self, r: usize) -> Option<Arc<dyn Link>> {
        if let Some(p) = self.peers.made(r) {
            return Some(p.clone());
        }
        self.peers.reach.get(r)?.as_ref()?;
        Some(Arc::new(OnDemand::new(Box::new(ShmConnect {
            peers: self.peers.clone(),
            peer: r,
        }))))
    }

    /// Rank `r`'s link, mapping its segment now if that has not happened yet (device
    /// buffer registration reads every local peer's registry); None where shared memory does
    /// not reach `r` or the mapping failed (the link's first use reports why).
    pub(crate) fn peer(&self, r: usize) -> Option<Arc<ShmPeer>> {
        self.peers.connect(r).ok()
    }

    /// How many ranks this rank's links reach through shared memory.
    pub(crate) fn nranks(&self) -> usize {
        self.peers.nranks
    }

    /// How many peers' segments this rank has mapped.
    #[cfg(test)]
    pub(crate) fn mapped(&self) -> usize {
        self.peers.mapped()
    }

    /// Whether some peer in another process may pull from this rank's buffers: the kernel
    /// then copies them (process_vm_readv/writev), pinning every page it touches, and large
    /// ones are better backed by huge pages.
    pub(crate) fn prefers_huge_pages(&self) -> bool {
        let p = &self.peers;
        // On demand, every local peer may take this rank's descriptors, which is the
        // permission its pulls need too; it pulls unless pulls are turned off.
        if p.reach
            .iter()
            .flatten()
            .any(|r| matches!(r.access, Access::Cma(_)))
        {
            return !p.disable_pull;
        }
        p.made.iter().filter_map(|m| m.get()).any(|p| {
            matches!(p.access, Access::Cma(_))
                && p.remote.pull_ok(p.me).load(Ordering::Relaxed) != 0
        })
    }
}

/// The links of one shm world, warmed together after a large operation.
pub(crate) struct ShmWarm(Arc<Peers>);

impl crate::transport::Warm for ShmWarm {
    fn warm(&self) {
        for p in self.0.made.iter().filter_map(|m| m.get()) {
            p.warm();
        }
    }
}

pub(super) fn auth_context(comm_tag: u64, from: usize, to: usize) -> Vec<u8> {
    format!("comm shm {comm_tag:016x} {from}->{to}").into_bytes()
}

/// Builds the shm transports of one rank, every link at once. Collective over the
/// communicator's bootstrap.
#[cfg(test)]
pub(crate) fn connect(
    boot: &Bootstrap,
    paths: &[Path],
    placements: &[Placement],
    comm_tag: u64,
    registry_bytes: usize,
    deadline: Option<Instant>,
) -> Result<ShmWorld> {
    connect_as(
        boot,
        paths,
        placements,
        comm_tag,
        registry_bytes,
        deadline,
        false,
    )
}

/// Builds the shm transports of one rank. Collective over the communicator's bootstrap.
///
/// With `demand` (NCCL_RUNTIME_CONNECT), a peer's segment is mapped when a schedule first
/// uses the link (`transport::demand`): this rank duplicates the peer's descriptor out of its
/// process with pidfd_getfd, which needs nothing from the peer (no service, no handshake,
/// no wait) and the permission of ptrace over it. That permission is stronger than the
/// secret the socket fetch checks (it reads the peer's memory, the secret included), and it
/// is what pulls need too, so the receiver publishes in its segment, before announcing it,
/// that it may pull from each local peer: no barrier is needed before the first message.
/// Where any rank cannot take its local peers' descriptors (a sandbox that forbids
/// pidfd_getfd, Linux before 5.6) or does not ask for it, every rank fetches every segment
/// at init over the authenticated unix socket, as with `demand` off.
#[allow(clippy::too_many_arguments)]
pub(crate) fn connect_as(
    boot: &Bootstrap,
    paths: &[Path],
    placements: &[Placement],
    comm_tag: u64,
    registry_bytes: usize,
    deadline: Option<Instant>,
    demand: bool,
) -> Result<ShmWorld> {
    let me = boot.rank();
    let nranks = boot.nranks();
    let geo = Geometry::from_env(nranks, registry_bytes);
    let mut nonce_bytes = [0u8; 8];
    getrandom::getrandom(&mut nonce_bytes)
        .map_err(|e| Error::new(crate::error::ErrorKind::System, format!("getrandom: {e}")))?;
    let nonce = u64::from_ne_bytes(nonce_bytes);
    let local = Arc::new(Segment::create(me, geo, nonce)?);
    if demand && paths.contains(&Path::SameProcess) {
        list_in_this_process(nonce, &local);
    }

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
    let disable_pull = !crate::env::SHM_PULL.flag();
    let pull_threshold_set = crate::env::SHM_PULL_THRESHOLD.size_if_set();
    let takes = demand
        && other_process
            .iter()
            .all(|&r| sys::may_take_fds(placements[r].pid));
    if takes {
        // Before the announcement, so that a peer that maps this segment at once reads it.
        // Where every rank takes descriptors, each may ptrace every other, as pulls need;
        // otherwise the fetches below write it again before the barrier.
        for r in (0..nranks).filter(|&r| matches!(paths[r], Path::SameHost | Path::SameProcess)) {
            local
                .pull_ok(r)
                .store(!disable_pull as u32, Ordering::Release);
        }
    }
    let mine = Announce {
        socket: socket.clone(),
        fd: local.fd.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1),
        nonce,
        base: local.base_addr() as u64,
        takes,
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
    if announces.iter().all(|a| a.takes) {
        drop(listener);
        let reach = (0..nranks)
            .map(|r| {
                let access = match paths[r] {
                    Path::SameProcess => Access::Direct,
                    Path::SameHost => Access::Cma(placements[r].pid),
                    _ => return None,
                };
                Some(Reach {
                    fd: announces[r].fd,
                    nonce: announces[r].nonce,
                    access,
                    held: (access == Access::Direct)
                        .then(|| in_this_process(announces[r].nonce))
                        .flatten(),
                })
            })
            .collect();
        // Nothing here needs the peers any more; the barrier keeps init's promise that a rank
        // whose init failed fails every rank's init (a killed or stopped rank is named by the
        // bootstrap), not their first call.
        boot.barrier_until(deadline)?;
        return Ok(ShmWorld::on_demand(
            me,
            local,
            reach,
            pull_threshold_set,
            disable_pull,
        ));
    }

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
            prefault(me, r, &local, &remote);
            peers[r] = Some(Arc::new(new_peer(
                me,
                r,
                &local,
                remote,
                access,
                matches!(access, Access::Cma(_)).then(|| ProcessWatch::new(placements[r].pid)),
                pull_threshold_set,
            )));
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
    Ok(ShmWorld::made_of(me, local, peers, disable_pull))
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
