//! The communicator: lifecycle (init, split, shrink, grow, finalize, destroy, abort), its
//! configuration and state, and turning validated calls into executable operations.

pub(crate) mod buffers;
pub(crate) mod config;
pub(crate) mod gate;
pub(crate) mod ops;
pub(crate) mod registry;
pub(crate) mod staged;

use crate::algo::tuner::Tuner;
use crate::bootstrap::{Bootstrap, UniqueId};
use crate::error::{Error, ErrorKind, Result};
use crate::exec::host::Wiring;
use crate::topo::{self, Path, Placement};
use crate::transport::Closing;
use crate::wire::Reader;
use config::Config;
use ops::CustomOps;
use parking_lot::Mutex;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long destroy waits for this rank's last device program, and then for the other ranks
/// to reach destroy, before it leaves the device memory allocated (see `DeviceWorld::retire`).
/// The split color of a rank that joins no child: the header's NCCL_SPLIT_NOCOLOR
/// (`ffi::types` checks).
pub(crate) const SPLIT_NOCOLOR: i32 = -1;

const DESTROY_WAIT: Duration = Duration::from_secs(30);

/// Lifecycle states (NCCL: finalize, then destroy; abort or revoke at any time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Life {
    Active = 0,
    Finalized = 1,
    Revoked = 2,
    Aborted = 3,
    Failed = 4,
}

pub(crate) struct Comm {
    pub rank: usize,
    pub nranks: usize,
    /// Identifies this communicator among all communicators of the job (same on every rank).
    pub tag: u64,
    pub config: Config,
    pub boot: Bootstrap,
    pub placements: Vec<Placement>,
    pub paths: Vec<Path>,
    /// How windows reach each rank: `paths`, or every other rank over the network with
    /// COMM_WIN_NET=1.
    pub window_paths: Vec<Path>,
    /// The transports that made `wiring.links` (shm, net, ...), asked for registration, the
    /// cost model's figures and one transport's own capability (`Transports::find`).
    pub transports: crate::transport::Transports,
    /// Device memory shared with the peers, when every rank has a usable GPU.
    pub device: Option<crate::transport::p2p::DeviceWorld>,
    /// Why there is no device path (this rank's own failure where it had one), for the error
    /// a call on device memory gets.
    pub device_missing: Option<String>,
    /// Registered device buffers published to the peers and mapped from them, for in-place
    /// reads (with a device path and peers on this host, unless NCCL_LOCAL_REGISTER=0).
    pub registry: Option<crate::transport::reg::Registry>,
    /// The stream the last device program went to, and an event after it: a program on
    /// another stream waits for it, since programs share the slots and flags.
    pub device_order: Mutex<Option<(crate::cuda::Stream, crate::cuda::Event)>>,
    pub wiring: Wiring,
    pub tuner: Tuner,
    /// The order rings visit the ranks in: each host's ranks together (None: rank order).
    pub ring: Option<crate::algo::RingOrder>,
    /// The ranks grouped by host (None: all on one host).
    pub hosts: Option<Arc<crate::algo::HostLayout>>,
    pub slice_bytes: usize,
    /// The CUDA device this rank was created on, or -1 on a host without one.
    pub cuda_device: i32,
    /// Operations issued so far; tags every message so that mismatched calls are detected.
    pub seq: AtomicU64,
    /// Splits made so far, to derive every child's tag identically on all ranks (every rank
    /// takes part in a split, NCCL_SPLIT_NOCOLOR too).
    pub children: AtomicU64,
    /// Shrinks made so far, by the list of ranks they left out: an excluded rank takes no
    /// part in its shrink, so only the ranks that shrank by the same list count alike.
    shrinks: Mutex<std::collections::HashMap<Vec<usize>, u64>>,
    pub custom_ops: CustomOps,
    /// Schedules built so far, reused by calls of the same shape.
    pub schedules: ops::ScheduleCache,
    life: AtomicU8,
    pub async_error: Mutex<Option<Error>>,
    /// The message of this communicator's last failed call, shared with its registry entry so
    /// that a failure recorded before the communicator existed (its init) or after it left the
    /// entry's hands (a group) lands in the one place ncclGetLastError reads.
    pub last_error: LastError,
    pub suspended: AtomicBool,
    /// One call at a time, and a non-blocking communicator's operation running in the
    /// background, which destroy and abort wait for (the caller's buffers are in use until it
    /// ends).
    pub gate: gate::Gate,
    /// Whether calls block (`config.blocking` at init; `commSetBlocking` changes it later).
    blocking: AtomicBool,
}

/// Where the message of a communicator's last failure is kept (see `Comm::last_error`).
pub(crate) type LastError = Arc<Mutex<Option<String>>>;

/// Records that `func` failed with `e` in `slot`, in the form ncclGetLastError reports.
pub(crate) fn note_error(slot: &LastError, func: &str, e: &Error) -> String {
    let msg = format!("{func}: {}", e.msg);
    *slot.lock() = Some(msg.clone());
    msg
}

fn hash_tag(parts: impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

/// Settings that decide how ranks exchange data: which schedule a collective runs, how it cuts
/// messages, which transports connect the ranks. A rank whose value differs runs another
/// schedule against the others' (COMM_ALGO=tree on one of two ranks: its all-reduce returned
/// success with only its own input), so every rank compares them at init.
static AGREED: [&crate::env::Knob; 9] = [
    &crate::env::ALGO,
    &crate::env::DIRECT_MAX_BYTES,
    &crate::env::TREE_MAX_BYTES,
    &crate::env::HIER_DIRECT_MAX_BYTES,
    &crate::env::RING_BY_HOST,
    &crate::env::SLICE_BYTES,
    &crate::env::SHM_DISABLE,
    &crate::env::DEVICE_ONESHOT_MAX,
    &crate::env::DEVICE_TWOSHOT_MAX,
];

/// This process's values of `AGREED`, as the library reads them ("" where unset).
fn agreed_settings() -> Vec<String> {
    use crate::env::Kind;
    AGREED
        .iter()
        .map(|k| match k.kind {
            Kind::Size => k.size_if_set().map(|v| v.to_string()),
            Kind::Flag => k.set_value().map(|_| k.flag().to_string()),
            Kind::Int => k.int_if_set().map(|v| v.to_string()),
            _ => k.text().map(|t| t.trim().to_ascii_lowercase()),
        })
        .map(Option::unwrap_or_default)
        .collect()
}

/// Fails init, on every rank alike, where the ranks' `AGREED` settings differ.
fn check_agreement(settings: &[Vec<String>]) -> Result<()> {
    let Some(first) = settings.first() else {
        return Ok(());
    };
    for (i, knob) in AGREED.iter().enumerate() {
        if settings.iter().all(|s| s[i] == first[i]) {
            continue;
        }
        let mut by_value: Vec<(&str, Vec<usize>)> = Vec::new();
        for (r, s) in settings.iter().enumerate() {
            match by_value.iter_mut().find(|(v, _)| *v == s[i]) {
                Some((_, ranks)) => ranks.push(r),
                None => by_value.push((&s[i], vec![r])),
            }
        }
        let sides: Vec<String> = by_value
            .iter()
            .map(|(v, ranks)| {
                let v = if v.is_empty() { "unset" } else { v };
                format!("{} on {}", v, crate::bootstrap::describe_ranks(ranks))
            })
            .collect();
        return crate::invalid_usage!(
            "{} differs between ranks ({}): it decides how ranks exchange data, so it must be the same on every rank",
            knob.env,
            sides.join(", ")
        );
    }
    Ok(())
}

/// What a rank tells the others of itself at setup, one record: its placement (host and
/// process), its `AGREED` settings and its network transport's `Hello`; with this rank's
/// network offer (the device it found) and its settings alone, to compare.
struct Card {
    bytes: Vec<u8>,
    settings: Vec<u8>,
    net_offer: crate::transport::net::Offer,
}

impl Card {
    fn new(net: &crate::transport::net::NetChoice) -> Card {
        let net_offer = crate::transport::net::Offer::probe(net);
        let mut bytes = Vec::new();
        topo::this_process().encode(&mut bytes);
        let mut settings = Vec::new();
        for v in agreed_settings() {
            crate::wire::put_blob(&mut settings, v.as_bytes());
        }
        crate::wire::put_blob(&mut bytes, &settings);
        net_offer.hello.encode(&mut bytes);
        Card {
            bytes,
            settings,
            net_offer,
        }
    }
}

/// How long waits may last, from COMM_TIMEOUT (seconds; unset or 0 = no limit).
fn op_timeout() -> Option<Duration> {
    crate::env::TIMEOUT.seconds()
}

impl Comm {
    /// ncclCommInitRank and friends: rendezvous through the root(s) of `ids`, then connect.
    pub(crate) fn init(
        ids: &[UniqueId],
        rank: usize,
        nranks: usize,
        config: Config,
        device: i32,
    ) -> Result<Comm> {
        if nranks == 0 {
            return crate::invalid_arg!("nranks is 0; a communicator needs at least one rank");
        }
        if rank >= nranks {
            return crate::invalid_arg!("rank {rank} is out of range for {nranks} ranks");
        }
        let started = Instant::now();
        let timeout = crate::bootstrap::init_timeout();
        // This rank's card rides on the bootstrap's rounds, which gather every rank's without
        // an allgather of their own. A network name that is none of ours still fails after
        // the bootstrap, as before: the others learn it from the card this rank leaves empty.
        let net = crate::transport::net::NetChoice::resolve(config.raw.net_name.as_deref());
        let card = net.as_ref().ok().map(Card::new);
        let (boot, cards) = Bootstrap::init_with(
            ids,
            rank,
            nranks,
            timeout,
            card.as_ref().map_or(&[][..], |c| &c.bytes),
        )?;
        net?;
        let Some(card) = card else {
            return crate::internal_err!("no setup record although the network name resolved");
        };
        let tag = hash_tag(("comm", boot.secret(), nranks));
        Comm::establish(
            boot,
            config,
            tag,
            device,
            timeout,
            started,
            card,
            Some(cards),
        )
    }

    /// Everything after the bootstrap: where the peers are, and the transports to reach them.
    /// `started`: when the communicator's setup began (its bootstrap included), for the
    /// timings line. `gathered`: every rank's card, where the bootstrap brought them; else
    /// they are gathered here.
    #[allow(clippy::too_many_arguments)]
    fn establish(
        boot: Bootstrap,
        config: Config,
        tag: u64,
        device: i32,
        timeout: Option<Duration>,
        started: Instant,
        card: Card,
        gathered: Option<Vec<Vec<u8>>>,
    ) -> Result<Comm> {
        let bootstrapped = Instant::now();
        let deadline = timeout.map(|t| bootstrapped + t);
        let rank = boot.rank();
        let nranks = boot.nranks();
        let _scope = crate::log::rank_scope(rank as i32);
        crate::log::version_once();
        // Every rank's card: brought by the bootstrap's rounds at init, gathered here for a
        // communicator made from another. Each round of an allgather waits for the slowest
        // rank, so the transports take their parts of the cards instead of each running one.
        let Card {
            bytes: mine,
            settings,
            net_offer,
        } = card;
        let gathered = match gathered {
            Some(g) => g,
            None => boot.allgather(&mine)?,
        };
        let mut placements = Vec::with_capacity(nranks);
        let mut net_hellos = Vec::with_capacity(nranks);
        let mut all_settings = Vec::with_capacity(nranks);
        for (r, b) in gathered.iter().enumerate() {
            if b.is_empty() {
                return crate::invalid_usage!(
                    "rank {r} could not describe itself for setup (its own error says why)"
                );
            }
            let mut rd = Reader::new(b);
            placements.push(Placement::decode(&mut rd)?);
            let len = rd.u32()? as usize;
            all_settings.push(rd.bytes(len)?);
            net_hellos.push(crate::transport::net::Hello::decode(&mut rd)?);
        }
        let me = placements[rank].clone();
        // The settings are read one by one only where some rank's differ, to name them.
        if all_settings.iter().any(|s| *s != settings.as_slice()) {
            let settings = all_settings
                .iter()
                .map(|b| {
                    let mut r = Reader::new(b);
                    (0..AGREED.len())
                        .map(|_| r.string())
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            check_agreement(&settings)?;
        }
        let exchanged = Instant::now();
        let paths: Vec<Path> = placements
            .iter()
            .enumerate()
            .map(|(r, p)| me.path_to(p, r == rank))
            .collect();
        let host_of: Vec<u64> = placements.iter().map(|p| p.host_hash).collect();
        let nhosts = host_of
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len();
        let layout = crate::algo::HostLayout::new(
            &host_of,
            crate::algo::HostLayout::default_direct_max(nhosts),
        );
        let replies = crate::exec::replies::Setting::from_env()?;
        let crate::transport::Links {
            links,
            doorbell,
            presence,
            huge_pages,
            warm,
            transports,
        } = crate::transport::establish(&boot, &placements, net_offer, &net_hellos, tag, deadline)?;
        let transported = Instant::now();
        let (device_world, device_missing) = match crate::transport::p2p::DeviceWorld::connect(
            &boot,
            (device >= 0 && crate::cuda::device_count() > 0).then_some(device),
            &paths,
            &placements,
        )? {
            Ok(w) => (Some(w), None),
            Err(why) => (None, Some(why)),
        };
        let devices_done = Instant::now();
        let registry = (device_world.is_some() && crate::env::LOCAL_REGISTER.flag())
            .then(|| crate::transport::reg::Registry::over(&transports, rank, nranks))
            .flatten();
        let local_ranks = topo::ranks_on_host(&paths);
        // With more ranks than cores, spinning steals the core from the rank we wait for:
        // yield it instead, then sleep.
        let oversubscribed = local_ranks > topo::usable_cpus();
        // A round trip over the network (tens of microseconds) outlasts a spin sized for shared
        // memory, and a rank that sleeps through it pays a wake-up on every small message:
        // with network peers, spin as long as a few round trips.
        let spin_default = match (oversubscribed, transports.networked()) {
            (true, _) => 0,
            (false, true) => 1000,
            (false, false) => 50,
        };
        let spin_us = crate::env::SPIN_US.int_if_set().unwrap_or(spin_default);
        let yield_us = crate::env::YIELD_US
            .int_if_set()
            .unwrap_or(if oversubscribed { 200 } else { 0 });
        let huge_pages_from = (huge_pages && crate::env::SHM_HUGEPAGES.flag())
            .then(|| crate::env::SHM_HUGEPAGES_FROM.size());
        let wiring = Wiring {
            rank,
            doorbell,
            presence,
            warm,
            abort: Arc::new(AtomicBool::new(false)),
            timeout: crate::exec::op::Limit::new(op_timeout()),
            warn_after: crate::bootstrap::warn_after(),
            cache: Mutex::new(crate::exec::host::ExecCache::new(replies)),
            spin: Duration::from_micros(spin_us.max(0) as u64),
            yield_for: Duration::from_micros(yield_us.max(0) as u64),
            spread: !oversubscribed,
            hand_over: spin_us <= 0 && local_ranks > topo::online_cpus(),
            home: topo::place_on_host(&paths, rank),
            links,
            huge_pages_from,
        };
        crate::info!(
            "rank {rank}/{nranks} ready on {} (comm {tag:016x}{})",
            me.hostname,
            config
                .comm_name
                .as_deref()
                .map(|n| format!(", \"{n}\""))
                .unwrap_or_default()
        );
        // One line per rank at INFO (INIT), as NCCL's "Init timings": where the setup's time
        // went, to find what grows faster than the rank count.
        let formed = boot.formed();
        let s = |d: Duration| format!("{:.3}", d.as_secs_f64());
        crate::info!(
            "init timings: rank {rank}/{nranks} total {} s: bootstrap {} (check-in {}, rounds {}), cards {}, transports {}, device world {}, rest {}",
            s(started.elapsed()),
            s(bootstrapped - started),
            s(formed.check_in),
            s(formed.rounds),
            s(exchanged - bootstrapped),
            s(transported - exchanged),
            s(devices_done - transported),
            s(devices_done.elapsed())
        );
        Ok(Comm {
            rank,
            nranks,
            tag,
            tuner: Tuner::from_env(nranks, layout.as_deref()),
            ring: crate::env::RING_BY_HOST
                .flag()
                .then(|| crate::algo::RingOrder::by_host(&host_of))
                .flatten(),
            hosts: layout,
            slice_bytes: crate::env::SLICE_BYTES.size().max(64),
            blocking: AtomicBool::new(config.blocking),
            config,
            boot,
            placements,
            window_paths: paths
                .iter()
                .map(|&p| match p {
                    Path::SelfRank => p,
                    _ if crate::env::WIN_NET.flag() => Path::Network,
                    _ => p,
                })
                .collect(),
            paths,
            transports,
            device: device_world,
            device_missing,
            registry,
            device_order: Mutex::new(None),
            wiring,
            cuda_device: device,
            seq: AtomicU64::new(0),
            gate: Default::default(),
            children: AtomicU64::new(0),
            shrinks: Mutex::new(Default::default()),
            custom_ops: CustomOps::default(),
            schedules: Default::default(),
            life: AtomicU8::new(Life::Active as u8),
            async_error: Mutex::new(None),
            last_error: LastError::default(),
            suspended: AtomicBool::new(false),
        })
    }

    pub(crate) fn life(&self) -> Life {
        match self.life.load(Ordering::SeqCst) {
            0 => Life::Active,
            1 => Life::Finalized,
            2 => Life::Revoked,
            3 => Life::Aborted,
            _ => Life::Failed,
        }
    }

    fn set_life(&self, l: Life) {
        self.life.store(l as u8, Ordering::SeqCst);
    }

    /// Whether new operations may be issued; the error says why not.
    /// Whether some peer is on another host, where device programs cannot map its memory.
    pub(crate) fn spans_hosts(&self) -> bool {
        self.hosts.is_some()
    }

    /// What windows need of this communicator (they never see the communicator itself).
    pub(crate) fn window_members(&self) -> crate::window::Members<'_> {
        crate::window::Members {
            rank: self.rank,
            nranks: self.nranks,
            tag: self.tag,
            boot: &self.boot,
            placements: &self.placements,
            paths: &self.window_paths,
            links: &self.wiring.links,
            transports: &self.transports,
            abort: &self.wiring.abort,
            timeout: self.wiring.timeout.get(),
            spin: self.wiring.spin,
            device: self.device.as_ref().map(|d| d.device.clone()),
        }
    }

    /// Ok while the communicator is active; otherwise the reason it is not (`unusable`).
    #[inline]
    pub(crate) fn check_usable(&self) -> Result<()> {
        if self.life.load(Ordering::SeqCst) == Life::Active as u8 {
            Ok(())
        } else {
            self.unusable()
        }
    }

    #[cold]
    #[inline(never)]
    fn unusable(&self) -> Result<()> {
        match self.life() {
            Life::Active => Ok(()),
            Life::Finalized => crate::invalid_usage!(
                "the communicator was finalized; only ncclCommDestroy may follow"
            ),
            Life::Revoked => crate::invalid_usage!(
                "the communicator was revoked; destroy it, or split/shrink it into a new one"
            ),
            Life::Aborted => crate::invalid_usage!("the communicator was aborted"),
            Life::Failed => {
                let cause = self
                    .async_error
                    .lock()
                    .as_ref()
                    .map(|e| e.msg.clone())
                    .unwrap_or_default();
                Err(Error::new(
                    ErrorKind::InvalidUsage,
                    format!("the communicator failed earlier and can only be aborted or destroyed ({cause})"),
                ))
            }
        }
    }

    /// Whether this communicator's calls block until done, or (non-blocking) return
    /// ncclInProgress and complete in the background.
    pub(crate) fn blocking(&self) -> bool {
        self.blocking.load(Ordering::Relaxed)
    }

    /// commSetBlocking.
    pub(crate) fn set_blocking(&self, blocking: bool) {
        self.blocking.store(blocking, Ordering::Relaxed);
    }

    /// Records a failure that leaves the communicator unusable (a dead peer, a timeout, ranks
    /// that disagree about the operation). Validation errors do not come here.
    pub(crate) fn fail(&self, e: &Error) {
        let mut slot = self.async_error.lock();
        if slot.is_none() {
            *slot = Some(e.clone());
        }
        // An abort from another thread is what stopped the operation when the communicator is
        // aborted already: it stays aborted, and its peers hear of the abort, not of a failure
        // (this thread may close the links before the aborting one does).
        let aborted = self
            .life
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| {
                (l != Life::Aborted as u8).then_some(Life::Failed as u8)
            })
            .is_err();
        drop(slot);
        // A failed communicator can only be destroyed: tell the peers now, and which rank
        // was lost, so that ranks waiting on this one fail at once and name the cause.
        let how = if aborted {
            Closing::Aborted
        } else if e.kind == ErrorKind::Timeout {
            Closing::TimedOut
        } else if e.kind == ErrorKind::InvalidUsage {
            Closing::Disagreed
        } else {
            Closing::Failed
        };
        for l in &self.wiring.links {
            if let (Closing::Disagreed, Some((ours, theirs))) = (how, e.disagreed) {
                l.tell_disagreement(ours, theirs);
            }
            l.close(how, e.lost);
        }
    }

    pub(crate) fn finalize(&self) -> Result<()> {
        match self.life() {
            Life::Active => {
                self.set_life(Life::Finalized);
                Ok(())
            }
            Life::Finalized => crate::invalid_usage!("the communicator was already finalized"),
            Life::Revoked => crate::invalid_usage!("a revoked communicator cannot be finalized"),
            _ => self.check_usable(),
        }
    }

    /// Local teardown: peers still waiting on this rank get an error instead of hanging.
    pub(crate) fn destroy(&self) {
        crate::fault::point("destroy");
        for l in &self.wiring.links {
            l.close(Closing::Destroyed, None);
        }
        // A call still waiting on another thread (using a communicator while destroying it is
        // the application's mistake) stops with an error, as after an abort: it went on
        // waiting for peers that had been told this rank left, and could wait forever.
        self.wiring.abort.store(true, Ordering::SeqCst);
        self.boot.abort_handle().store(true, Ordering::SeqCst);
        self.wiring.doorbell.ring();
        self.gate.wait_background();
    }

    /// Stops any operation in progress (from any thread) and tells the peers.
    pub(crate) fn abort(&self) {
        self.set_life(Life::Aborted);
        self.wiring.abort.store(true, Ordering::SeqCst);
        self.boot.abort_handle().store(true, Ordering::SeqCst);
        for l in &self.wiring.links {
            l.close(Closing::Aborted, None);
        }
        self.wiring.doorbell.ring();
        self.gate.wait_background();
    }

    /// ncclCommRevoke: in-flight operations stop; only destroy, split and shrink remain.
    pub(crate) fn revoke(&self) {
        self.set_life(Life::Revoked);
        self.wiring.abort.store(true, Ordering::SeqCst);
        self.wiring.doorbell.ring();
    }

    fn child_tag(&self, what: &str, extra: i64) -> u64 {
        let n = self.children.fetch_add(1, Ordering::SeqCst);
        hash_tag((self.tag, what, n, extra))
    }

    /// ncclCommSplit. Collective over this communicator; `None` for NCCL_SPLIT_NOCOLOR.
    pub(crate) fn split(
        &self,
        color: i32,
        key: i32,
        config: Option<Config>,
    ) -> Result<Option<Comm>> {
        if self.life() == Life::Aborted || self.life() == Life::Failed {
            self.check_usable()?;
        }
        if color < 0 && color != SPLIT_NOCOLOR {
            return crate::invalid_arg!(
                "color {color} is negative; use a non-negative color or NCCL_SPLIT_NOCOLOR (-1)"
            );
        }
        let mut mine = Vec::new();
        crate::wire::put_u32(&mut mine, color as u32);
        crate::wire::put_u32(&mut mine, key as u32);
        let all = self.boot.allgather(&mine)?;
        crate::fault::point("split:colors");
        let mut entries = Vec::with_capacity(self.nranks);
        for (r, b) in all.iter().enumerate() {
            let mut rd = Reader::new(b);
            entries.push((rd.u32()? as i32, rd.u32()? as i32, r));
        }
        // Every rank derives the tag, even those that take no part in a child.
        let tag = self.child_tag("split", color as i64);
        if color == SPLIT_NOCOLOR {
            return Ok(None);
        }
        let mut members: Vec<(i32, usize)> = entries
            .iter()
            .filter(|e| e.0 == color)
            .map(|e| (e.1, e.2))
            .collect();
        members.sort();
        let members: Vec<usize> = members.into_iter().map(|m| m.1).collect();
        self.child(&members, tag, config).map(Some)
    }

    /// A communicator of `members` (ranks of this one, in their new order) under `tag`; the
    /// config is this communicator's unless one is given.
    fn child(&self, members: &[usize], tag: u64, config: Option<Config>) -> Result<Comm> {
        let started = Instant::now();
        let timeout = crate::bootstrap::init_timeout();
        let boot = self.boot.sub(members, tag, timeout)?;
        let config = config.unwrap_or_else(|| self.config.clone());
        let net = crate::transport::net::NetChoice::resolve(config.raw.net_name.as_deref())?;
        let card = Card::new(&net);
        Comm::establish(
            boot,
            config,
            tag,
            self.cuda_device,
            timeout,
            started,
            card,
            None,
        )
    }

    /// ncclCommShrink: a new communicator of every rank not in `exclude`, built without the
    /// excluded ranks (they may be dead).
    pub(crate) fn shrink(
        &self,
        exclude: &[usize],
        config: Option<Config>,
        abort_first: bool,
    ) -> Result<Comm> {
        if exclude.contains(&self.rank) {
            return crate::invalid_usage!(
                "rank {} is in its own exclude list; excluded ranks must not call ncclCommShrink",
                self.rank
            );
        }
        if abort_first {
            self.wiring.abort.store(true, Ordering::SeqCst);
        }
        let members: Vec<usize> = (0..self.nranks).filter(|r| !exclude.contains(r)).collect();
        let mut sorted = exclude.to_vec();
        sorted.sort_unstable();
        let n = {
            let mut shrinks = self.shrinks.lock();
            let n = shrinks.entry(sorted.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let tag = hash_tag((self.tag, "shrink", &sorted, n));
        self.child(&members, tag, config)
    }

    /// ncclCommGrow for an existing rank: whoever holds the id shares it, then every rank (old
    /// and new) rendezvous through it. Existing ranks keep their numbers.
    pub(crate) fn grow(
        &self,
        nranks: usize,
        id: Option<&UniqueId>,
        config: Option<Config>,
    ) -> Result<Comm> {
        self.check_usable()?;
        if nranks < self.nranks {
            return crate::invalid_arg!(
                "nRanks {nranks} is smaller than the communicator's {} ranks; growing cannot shrink",
                self.nranks
            );
        }
        let mine = id.map(|i| i.to_bytes().to_vec()).unwrap_or_default();
        let all = self.boot.allgather(&mine)?;
        let holders: Vec<usize> = (0..self.nranks).filter(|&r| !all[r].is_empty()).collect();
        let id = match holders.as_slice() {
            [one] => {
                let bytes: [u8; crate::bootstrap::UNIQUE_ID_BYTES] = all[*one]
                    .as_slice()
                    .try_into()
                    .map_err(|_| Error::new(ErrorKind::Internal, "unique id of wrong length"))?;
                UniqueId::from_bytes(&bytes)?
            }
            [] => {
                return crate::invalid_usage!(
                    "no existing rank passed the unique id to ncclCommGrow; exactly one must (the one that called ncclCommGetUniqueId)"
                )
            }
            many => {
                return crate::invalid_usage!(
                    "ranks {many:?} all passed a unique id to ncclCommGrow; exactly one existing rank must"
                )
            }
        };
        let config = config.unwrap_or_else(|| self.config.clone());
        Comm::init(&[id], self.rank, nranks, config, self.cuda_device)
    }
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Comm(rank {}/{}, tag {:016x}, {:?})",
            self.rank,
            self.nranks,
            self.tag,
            self.life()
        )
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.destroy();
        let Some(world) = self.device.take() else {
            return;
        };
        // The device memory (ours, and peers' buffers mapped here) must outlive the last
        // program that may use it. An aborted or failed communicator's programs may wait
        // forever for a peer, so it does not wait at all; otherwise a bounded wait.
        let deadline = Instant::now()
            + if matches!(self.life(), Life::Aborted | Life::Failed) {
                Duration::ZERO
            } else {
                DESTROY_WAIT
            };
        let quiet = match self.device_order.lock().as_ref() {
            Some((_, ev)) => ev.wait_until(deadline),
            None => true,
        };
        if !quiet {
            std::mem::forget(self.registry.take());
        }
        world.retire(&self.boot, quiet, deadline);
    }
}
