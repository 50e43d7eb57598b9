//! The transport list: the kinds of transport a communicator may use, in the order they are
//! tried, and what each connected transport offers besides its links.
//!
//! A `Kind` says which peers it reaches (by `Path`) and runs its setup. Each pair of ranks uses
//! the first kind of the list that reaches it, and every rank derives the same choice from the
//! placements (`plan`), so a kind's setup, a collective over the bootstrap, runs on every rank
//! wherever any pair uses it, and on none otherwise. A pair no kind reaches fails the init on
//! every rank alike, naming the ranks. The setup returns this rank's `Transport` (None where
//! this rank itself has no peer of that kind), which hands out one `Link` per peer it reaches
//! (made at init or at first use, as it decides) and answers what the communicator asks of its
//! transports as a group: registering memory, the figures of the cost model, where the host's
//! ranks run, warming its caches after a large operation.
//!
//! The list is a list of trait objects rather than an enum over the transports: adding a
//! transport is then one `Kind` and one entry in `kinds`, and nothing that holds the list
//! names it. A caller that needs one transport's own capability (device-buffer registration
//! over shared memory, the InfiniBand device that windows reach peers with) asks the list for
//! it by type (`Transports::find`) at registration or plan time; the executor holds the links
//! themselves, so no message pays for the list.
//!
//! Closing is the links' (`Link::close` tells each peer how this end went); a transport's own
//! resources (a progress thread, a device, a segment) go when the communicator drops it.

use super::{loopback, net, reg, shm, Doorbell, Link, LocalDoorbell, Presence, Warm};
use crate::algo::cost::Link as Hop;
use crate::bootstrap::Bootstrap;
use crate::error::Result;
use crate::topo::{Path, Placement};
use parking_lot::Mutex;
use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// What a kind's setup is given.
pub(crate) struct Setup<'a> {
    pub boot: &'a Bootstrap,
    pub placements: &'a [Placement],
    /// This rank's path to each rank.
    pub paths: &'a [Path],
    pub comm_tag: u64,
    pub deadline: Option<Instant>,
    /// The doorbell so far: the first transport whose peers ring a bell of their own sets it
    /// (shm: the futex word in this rank's segment; the network, where nothing came before:
    /// its epoll); a later one rings it. None after the list: a `LocalDoorbell`.
    pub doorbell: Option<Arc<dyn Doorbell>>,
}

/// A kind of transport before it is connected.
pub(crate) trait Kind {
    fn name(&self) -> &'static str;
    /// Whether it reaches a peer on `path` (`Path::SelfRank`: this rank's channel to itself).
    fn reaches(&self, path: Path) -> bool;
    /// Its setup, on every rank when any pair of ranks uses this kind (`peers`: the ranks this
    /// rank links through it, maybe none), in the list's order relative to the other kinds.
    fn connect(&self, setup: &mut Setup<'_>, peers: &[usize])
        -> Result<Option<Box<dyn Transport>>>;
}

/// A connected transport of one communicator.
pub(crate) trait Transport: Send + Sync {
    fn name(&self) -> &'static str;
    /// Rank `r`'s link, for a rank this transport was connected to (`Kind::connect`'s peers).
    fn link(&self, r: usize) -> Option<Arc<dyn Link>>;
    /// The latency and speed of one hop over its links, for the cost model; None for a
    /// channel that is no hop (a rank's own).
    fn figures(&self) -> Option<Hop>;
    /// Whether its links go through a network stack, whose round trips (tens of
    /// microseconds) outlast a spin sized for shared memory.
    fn networked(&self) -> bool {
        false
    }
    /// Registers user memory its links may send from without a copy (ncclCommRegister);
    /// None where it needs nothing.
    fn register(&self, _addr: *mut u8, _len: usize) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Undoes a `register` that returned `id`.
    fn deregister(&self, _id: u64) {}
    /// Where this host's ranks run, for a transport that shares memory with them.
    fn presence(&self) -> Option<Arc<dyn Presence>> {
        None
    }
    /// Whether large buffers should be backed by huge pages (see `Links::huge_pages`).
    fn prefers_huge_pages(&self) -> bool {
        false
    }
    /// What brings its small-message state back into the caches (see `Warm`).
    fn warm(&self) -> Option<Arc<dyn Warm>> {
        None
    }
    /// For `Transports::find`.
    fn as_any(&self) -> &dyn Any;
}

/// The kinds a communicator tries, in order: loopback for a rank's own channel, shared memory
/// for ranks of this host (unless `shm_on` is false), the network (TCP or InfiniBand, as
/// `net` says) for every other peer.
pub(crate) fn kinds(shm_on: bool, offer: net::Offer, hellos: &[net::Hello]) -> Vec<Box<dyn Kind>> {
    let mut all: Vec<Box<dyn Kind>> = vec![Box::new(LoopbackKind)];
    if shm_on {
        all.push(Box::new(ShmKind));
    }
    all.push(Box::new(NetKind {
        offer: Mutex::new(Some(offer)),
        hellos: hellos.to_vec(),
    }));
    all
}

/// Which kind links which pair, the same on every rank.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Per kind, whether any pair of ranks uses it: its setup runs on every rank.
    pub used: Vec<bool>,
    /// Per rank, the kind that links this rank to it.
    pub of: Vec<usize>,
}

/// Each pair's kind: the first of `kinds` that reaches it. Err where some pair is out of every
/// kind's reach, on every rank alike: naming this rank's peer where it has one out of reach,
/// else one such pair.
pub(crate) fn plan(kinds: &[Box<dyn Kind>], placements: &[Placement], me: usize) -> Result<Plan> {
    let first = |p: Path| kinds.iter().position(|k| k.reaches(p));
    let names = || {
        kinds
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    // A path depends only on whether two ranks share a host and a process, so one example of
    // each path between the ranks stands for every pair on it.
    let mut example: Vec<(Path, usize, usize)> = vec![(Path::SelfRank, me, me)];
    let mut host_first: HashMap<u64, (usize, u64)> = HashMap::new();
    let mut process_first: HashMap<u64, usize> = HashMap::new();
    let mut seen = |p: Path, a: usize, b: usize| {
        if !example.iter().any(|e| e.0 == p) {
            example.push((p, a, b));
        }
    };
    for (r, pl) in placements.iter().enumerate() {
        match host_first.get(&pl.host_hash) {
            Some(&(a, token)) if token != pl.process_token => seen(Path::SameHost, a, r),
            Some(_) => {}
            None => {
                if let Some((_, &(a, _))) = host_first.iter().next() {
                    seen(Path::Network, a, r);
                }
                host_first.insert(pl.host_hash, (r, pl.process_token));
            }
        }
        match process_first.get(&pl.process_token) {
            Some(&a) => seen(Path::SameProcess, a, r),
            None => {
                process_first.insert(pl.process_token, r);
            }
        }
    }
    let of = placements
        .iter()
        .enumerate()
        .map(|(r, pl)| {
            let p = placements[me].path_to(pl, r == me);
            first(p).ok_or_else(|| {
                crate::error::Error::new(
                    crate::error::ErrorKind::InvalidUsage,
                    format!(
                        "no transport reaches rank {r} from rank {me} ({p:?}; this communicator's transports are {})",
                        names()
                    ),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut used = vec![false; kinds.len()];
    for &(p, a, b) in &example {
        match first(p) {
            Some(k) => used[k] = true,
            None => {
                return crate::invalid_usage!(
                    "no transport reaches rank {b} from rank {a} ({p:?}; this communicator's transports are {})",
                    names()
                )
            }
        }
    }
    Ok(Plan { used, of })
}

/// The transports of one communicator: every kind connected on this rank.
pub(crate) struct Transports {
    all: Vec<Box<dyn Transport>>,
    /// Per entry of `all`, whether it links a rank on this host (this rank's own channel left
    /// out).
    on_host: Vec<bool>,
    /// Per entry of `all`, whether it links a rank on another host.
    off_host: Vec<bool>,
}

impl Transports {
    /// The transport of type `T`, where this communicator has one: how a caller reaches a
    /// capability only that transport has.
    pub(crate) fn find<T: Transport + 'static>(&self) -> Option<&T> {
        self.all.iter().find_map(|t| t.as_any().downcast_ref::<T>())
    }

    /// The figures of the transport linking this rank to its peers on this host (`on_host`)
    /// or on other hosts; None without such peers.
    pub(crate) fn figures(&self, on_host: bool) -> Option<Hop> {
        let links = if on_host {
            &self.on_host
        } else {
            &self.off_host
        };
        self.all
            .iter()
            .zip(links)
            .filter(|(_, l)| **l)
            .find_map(|(t, _)| t.figures())
    }

    /// Whether some peer is linked through a network stack (`Transport::networked`).
    pub(crate) fn networked(&self) -> bool {
        self.all.iter().any(|t| t.networked())
    }

    /// Registers `len` bytes at `addr` with every transport that wants to know of them;
    /// what `deregister` undoes.
    pub(crate) fn register(&self, addr: *mut u8, len: usize) -> Result<Registered> {
        let mut ids = Vec::new();
        for (i, t) in self.all.iter().enumerate() {
            match t.register(addr, len) {
                Ok(Some(id)) => ids.push((i, id)),
                Ok(None) => {}
                Err(e) => {
                    self.deregister(&Registered(ids));
                    return Err(e);
                }
            }
        }
        Ok(Registered(ids))
    }

    pub(crate) fn deregister(&self, r: &Registered) {
        for &(i, id) in &r.0 {
            self.all[i].deregister(id);
        }
    }

    /// The names of the transports that registered `r`.
    pub(crate) fn registered_with(&self, r: &Registered) -> Vec<&'static str> {
        r.0.iter().map(|&(i, _)| self.all[i].name()).collect()
    }
}

/// Memory registered with a communicator's transports: per transport that took it, its id.
#[derive(Debug, Default)]
pub(crate) struct Registered(Vec<(usize, u64)>);

impl Registered {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Connects this rank to every peer with `kinds` (`plan`), and returns the links, the
/// transports and the doorbell. Collective.
pub(crate) fn connect(
    kinds: &[Box<dyn Kind>],
    boot: &Bootstrap,
    placements: &[Placement],
    comm_tag: u64,
    deadline: Option<Instant>,
) -> Result<super::Links> {
    let me = boot.rank();
    let plan = plan(kinds, placements, me)?;
    let paths: Vec<Path> = placements
        .iter()
        .enumerate()
        .map(|(r, p)| placements[me].path_to(p, r == me))
        .collect();
    let mut setup = Setup {
        boot,
        placements,
        paths: &paths,
        comm_tag,
        deadline,
        doorbell: None,
    };
    // Per kind, its index in `all` where it connected on this rank.
    let mut at: Vec<Option<usize>> = vec![None; kinds.len()];
    let mut all: Vec<Box<dyn Transport>> = Vec::new();
    for (k, kind) in kinds.iter().enumerate() {
        if !plan.used[k] {
            continue;
        }
        let peers: Vec<usize> = (0..paths.len()).filter(|&r| plan.of[r] == k).collect();
        if let Some(t) = kind.connect(&mut setup, &peers)? {
            at[k] = Some(all.len());
            all.push(t);
        }
    }
    let mut of = Vec::with_capacity(paths.len());
    let mut links: Vec<Arc<dyn Link>> = Vec::with_capacity(paths.len());
    for (r, &k) in plan.of.iter().enumerate() {
        let link = at[k].and_then(|i| Some((i, all[i].link(r)?)));
        let Some((i, link)) = link else {
            return crate::internal_err!(
                "the {} transport made no link to rank {r}",
                kinds[k].name()
            );
        };
        of.push(i);
        links.push(link);
    }
    let mut on_host = vec![false; all.len()];
    let mut off_host = vec![false; all.len()];
    let mut count = vec![0usize; all.len()];
    for (r, &p) in paths.iter().enumerate() {
        count[of[r]] += 1;
        match p {
            Path::SelfRank => {}
            Path::Network => off_host[of[r]] = true,
            Path::SameHost | Path::SameProcess => on_host[of[r]] = true,
        }
    }
    crate::info!(
        "rank {me}: transports {}",
        all.iter()
            .zip(&count)
            .map(|(t, &n)| format!("{} ({n} rank{})", t.name(), if n == 1 { "" } else { "s" }))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let doorbell = setup
        .doorbell
        .unwrap_or_else(|| Arc::new(LocalDoorbell::default()));
    let presence = all.iter().find_map(|t| t.presence());
    let huge_pages = all.iter().any(|t| t.prefers_huge_pages());
    let mut warms: Vec<Arc<dyn Warm>> = all.iter().filter_map(|t| t.warm()).collect();
    let warm = match warms.len() {
        0 | 1 => warms.pop(),
        _ => Some(Arc::new(WarmAll(warms)) as Arc<dyn Warm>),
    };
    Ok(super::Links {
        links,
        doorbell,
        presence,
        huge_pages,
        warm,
        transports: Transports {
            all,
            on_host,
            off_host,
        },
    })
}

/// Several transports' `Warm`, asked together.
struct WarmAll(Vec<Arc<dyn Warm>>);

impl Warm for WarmAll {
    fn warm(&self) {
        for w in &self.0 {
            w.warm();
        }
    }
}

/// A rank's channel to itself.
struct LoopbackKind;

impl Kind for LoopbackKind {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn reaches(&self, path: Path) -> bool {
        path == Path::SelfRank
    }

    fn connect(
        &self,
        setup: &mut Setup<'_>,
        _peers: &[usize],
    ) -> Result<Option<Box<dyn Transport>>> {
        Ok(Some(Box::new(Myself(setup.boot.rank()))))
    }
}

/// The loopback transport of rank `.0`.
struct Myself(usize);

impl Transport for Myself {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn link(&self, r: usize) -> Option<Arc<dyn Link>> {
        (r == self.0).then(|| Arc::new(loopback::Loopback::default()) as Arc<dyn Link>)
    }

    fn figures(&self) -> Option<Hop> {
        None
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Shared memory between ranks of one host (`transport::shm`).
struct ShmKind;

impl Kind for ShmKind {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn reaches(&self, path: Path) -> bool {
        matches!(path, Path::SameHost | Path::SameProcess)
    }

    fn connect(
        &self,
        setup: &mut Setup<'_>,
        peers: &[usize],
    ) -> Result<Option<Box<dyn Transport>>> {
        // The segment serves the ranks shm links and no other: to its setup, a rank that
        // another transport links is as far as one on another host.
        let me = setup.boot.rank();
        let paths: Vec<Path> = (0..setup.paths.len())
            .map(|r| match setup.paths[r] {
                p if r == me || peers.contains(&r) => p,
                _ => Path::Network,
            })
            .collect();
        let world = shm::connect_as(
            setup.boot,
            &paths,
            setup.placements,
            setup.comm_tag,
            reg::area_bytes(paths.len()),
            setup.deadline,
            shm::demand_wanted(),
        )?;
        // Local peers ring the futex word in this rank's segment, so the executor must sleep
        // on that and nothing else: shm comes before any transport with a bell of its own.
        if setup.doorbell.is_some() {
            return crate::internal_err!(
                "shared memory set up after a transport that brought its own doorbell: its peers would ring a bell nobody sleeps on"
            );
        }
        setup.doorbell = Some(world.local.clone());
        Ok(Some(Box::new(world)))
    }
}

impl Transport for shm::ShmWorld {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn link(&self, r: usize) -> Option<Arc<dyn Link>> {
        shm::ShmWorld::link(self, r)
    }

    fn figures(&self) -> Option<Hop> {
        Some(Hop::SHARED_MEMORY)
    }

    fn presence(&self) -> Option<Arc<dyn Presence>> {
        Some(shm::ShmWorld::presence(self))
    }

    fn prefers_huge_pages(&self) -> bool {
        shm::ShmWorld::prefers_huge_pages(self)
    }

    fn warm(&self) -> Option<Arc<dyn Warm>> {
        Some(shm::ShmWorld::warm(self))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The network between hosts (`transport::net`: TCP, or InfiniBand as the offer and every
/// rank's hello agree); its setup takes the offer, so it runs once.
struct NetKind {
    offer: Mutex<Option<net::Offer>>,
    hellos: Vec<net::Hello>,
}

impl Kind for NetKind {
    fn name(&self) -> &'static str {
        "net"
    }

    fn reaches(&self, path: Path) -> bool {
        path != Path::SelfRank
    }

    fn connect(
        &self,
        setup: &mut Setup<'_>,
        peers: &[usize],
    ) -> Result<Option<Box<dyn Transport>>> {
        // Without a doorbell of another transport, a rank sleeps in epoll on its sockets
        // (see `net::Waker`).
        let (doorbell, direct): (Arc<dyn Doorbell>, _) = match &setup.doorbell {
            Some(d) => (d.clone(), None),
            None => {
                let w = Arc::new(net::Waker::direct()?);
                (w.clone(), Some(w))
            }
        };
        setup.doorbell = Some(doorbell.clone());
        let Some(offer) = self.offer.lock().take() else {
            return crate::internal_err!("the network transport was set up twice");
        };
        let world = net::connect(
            setup.boot,
            peers,
            offer,
            &self.hellos,
            doorbell,
            direct,
            setup.comm_tag,
            setup.deadline,
        )?;
        Ok(world.map(|w| Box::new(w) as Box<dyn Transport>))
    }
}

impl Transport for net::NetWorld {
    fn name(&self) -> &'static str {
        if self.ib().is_some() {
            "net/ib"
        } else {
            "net/socket"
        }
    }

    fn link(&self, r: usize) -> Option<Arc<dyn Link>> {
        self.links.get(r)?.clone()
    }

    fn figures(&self) -> Option<Hop> {
        Some(Hop::tcp(self.bytes_per_us))
    }

    fn networked(&self) -> bool {
        true
    }

    fn register(&self, addr: *mut u8, len: usize) -> Result<Option<u64>> {
        net::NetWorld::register(self, addr, len)
    }

    fn deregister(&self, id: u64) {
        net::NetWorld::deregister(self, id);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(host: u64, process: u64) -> Placement {
        Placement {
            host_hash: host,
            process_token: process,
            pid: process as u32,
            hostname: format!("host{host}"),
        }
    }

    fn names(kinds: &[Box<dyn Kind>], plan: &Plan) -> Vec<&'static str> {
        plan.of.iter().map(|&k| kinds[k].name()).collect()
    }

    /// A kind that reaches other hosts only (never connected here).
    struct HostsOnly;

    impl Kind for HostsOnly {
        fn name(&self) -> &'static str {
            "hosts-only"
        }

        fn reaches(&self, path: Path) -> bool {
            path == Path::Network
        }

        fn connect(&self, _: &mut Setup<'_>, _: &[usize]) -> Result<Option<Box<dyn Transport>>> {
            crate::internal_err!("a planning test connects nothing")
        }
    }

    /// A connected transport that records what it registered.
    struct Fake {
        name: &'static str,
        hop: Option<Hop>,
        refuse: bool,
        held: parking_lot::Mutex<Vec<u64>>,
    }

    impl Fake {
        fn new(name: &'static str, latency_us: f32, refuse: bool) -> Fake {
            Fake {
                name,
                hop: Some(Hop {
                    latency_us,
                    bytes_per_us: 1.0,
                }),
                refuse,
                held: Default::default(),
            }
        }
    }

    impl Transport for Fake {
        fn name(&self) -> &'static str {
            self.name
        }

        fn link(&self, _: usize) -> Option<Arc<dyn Link>> {
            None
        }

        fn figures(&self) -> Option<Hop> {
            self.hop
        }

        fn register(&self, addr: *mut u8, _len: usize) -> Result<Option<u64>> {
            if self.refuse {
                return crate::invalid_arg!("{} refuses", self.name);
            }
            self.held.lock().push(addr as u64);
            Ok(Some(addr as u64))
        }

        fn deregister(&self, id: u64) {
            self.held.lock().retain(|&h| h != id);
        }

        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn fakes(all: Vec<Fake>, on_host: Vec<bool>, off_host: Vec<bool>) -> Transports {
        Transports {
            all: all
                .into_iter()
                .map(|f| Box::new(f) as Box<dyn Transport>)
                .collect(),
            on_host,
            off_host,
        }
    }

    fn fake(t: &Transports, i: usize) -> &Fake {
        t.all[i].as_any().downcast_ref::<Fake>().expect("a fake")
    }

    #[test]
    fn figures_come_from_the_transport_that_links_each_side() {
        let t = fakes(
            vec![Fake::new("near", 1.0, false), Fake::new("far", 9.0, false)],
            vec![true, false],
            vec![false, true],
        );
        assert_eq!(t.figures(true).map(|h| h.latency_us), Some(1.0));
        assert_eq!(t.figures(false).map(|h| h.latency_us), Some(9.0));
        // Without peers on other hosts the model keeps its own figures.
        let t = fakes(vec![Fake::new("near", 1.0, false)], vec![true], vec![false]);
        assert_eq!(t.figures(false), None);
        assert!(t.find::<Fake>().is_some() && t.find::<shm::ShmWorld>().is_none());
    }

    #[test]
    fn a_registration_one_transport_refuses_is_undone_on_the_others() {
        let t = fakes(
            vec![
                Fake::new("takes", 1.0, false),
                Fake::new("refuses", 1.0, true),
            ],
            vec![true, true],
            vec![false, false],
        );
        let e = t
            .register(0x1000 as *mut u8, 64)
            .expect_err("one transport refuses");
        assert!(e.msg.contains("refuses"), "{}", e.msg);
        assert!(fake(&t, 0).held.lock().is_empty());
        let t = fakes(
            vec![Fake::new("a", 1.0, false), Fake::new("b", 1.0, false)],
            vec![true, true],
            vec![false, false],
        );
        let r = t.register(0x2000 as *mut u8, 64).expect("registered");
        assert_eq!(t.registered_with(&r), ["a", "b"]);
        t.deregister(&r);
        assert!(fake(&t, 0).held.lock().is_empty() && fake(&t, 1).held.lock().is_empty());
    }

    fn offer() -> net::Offer {
        net::Offer::probe(&net::NetChoice::resolve(Some("socket")).expect("socket is a network"))
    }

    #[test]
    fn each_path_takes_the_first_transport_that_reaches_it() {
        // Rank 0 and 1 are threads of one process, 2 another process of their host, 3 on
        // another host.
        let placements = [at(1, 10), at(1, 10), at(1, 11), at(2, 20)];
        let kinds = kinds(true, offer(), &[]);
        let p = plan(&kinds, &placements, 0).expect("plan");
        assert_eq!(names(&kinds, &p), ["loopback", "shm", "shm", "net"]);
        assert_eq!(p.used, [true, true, true]);
        let p = plan(&kinds, &placements, 3).expect("plan");
        assert_eq!(names(&kinds, &p), ["net", "net", "net", "loopback"]);
        // Without shared memory, the ranks of one host go over the network too.
        let kinds = super::kinds(false, offer(), &[]);
        let p = plan(&kinds, &placements, 2).expect("plan");
        assert_eq!(names(&kinds, &p), ["net", "net", "loopback", "net"]);
    }

    #[test]
    fn a_kind_is_used_where_any_pair_uses_it_not_only_this_rank() {
        // Rank 0 alone on its host: it has no shared-memory peer, but ranks 1 and 2 do, so
        // rank 0 takes part in shm's setup too (it is collective).
        let placements = [at(1, 10), at(2, 20), at(2, 21)];
        let kinds = kinds(true, offer(), &[]);
        let p = plan(&kinds, &placements, 0).expect("plan");
        assert_eq!(names(&kinds, &p), ["loopback", "net", "net"]);
        assert_eq!(p.used, [true, true, true]);
        // One host, one process: the network is set up nowhere.
        let p = plan(&kinds, &[at(1, 10), at(1, 10)], 1).expect("plan");
        assert_eq!(p.used, [true, true, false]);
    }

    #[test]
    fn a_pair_no_transport_reaches_fails_naming_the_ranks() {
        let placements = [at(1, 10), at(1, 11), at(2, 20)];
        let kinds: Vec<Box<dyn Kind>> = vec![Box::new(LoopbackKind), Box::new(ShmKind)];
        let e = plan(&kinds, &placements, 0).expect_err("rank 2 is out of reach");
        assert!(
            e.msg.contains("no transport reaches rank 2 from rank 0")
                && e.msg.contains("Network")
                && e.msg.contains("loopback, shm"),
            "{}",
            e.msg
        );
        // Ranks 1 and 2 reach each other, and each names the peer it cannot reach.
        let placements = [at(1, 10), at(2, 20), at(2, 21)];
        let e = plan(&kinds, &placements, 2).expect_err("rank 0 is out of reach");
        assert!(e.msg.contains("rank 0 from rank 2"), "{}", e.msg);
        // A rank whose own peers are all reached fails too, naming a pair that is not: rank
        // 0 reaches the other host, whose two processes do not reach each other.
        let kinds: Vec<Box<dyn Kind>> = vec![Box::new(LoopbackKind), Box::new(HostsOnly)];
        let e = plan(&kinds, &placements, 0).expect_err("ranks 1 and 2 are out of reach");
        assert!(
            e.msg.contains("no transport reaches rank 2 from rank 1"),
            "{}",
            e.msg
        );
        assert!(e.msg.contains("SameHost"), "{}", e.msg);
    }
}
