//! Who is where: the identity of this host and process, and which transport reaches each peer.

use parking_lot::Mutex;
use std::hash::{Hash, Hasher};

/// What a rank tells its peers about where it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    /// Equal for processes that can share memory: same kernel boot, same hostname, same network
    /// and PID namespaces (or the same COMM_HOSTID).
    pub host_hash: u64,
    /// Random per process, so ranks that are threads of one process recognise each other even
    /// across pid namespaces.
    pub process_token: u64,
    pub pid: u32,
    pub hostname: String,
}

/// How a rank reaches one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// The peer is this rank.
    SelfRank,
    /// A thread of this same process: direct pointers.
    SameProcess,
    /// Another process on this host: shared memory.
    SameHost,
    /// Another host: the network.
    Network,
}

fn identify() -> Placement {
    let hostname = crate::log::hostname();
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    // Processes in different network or PID namespaces are different hosts: abstract unix
    // sockets are per network namespace, and pids (process_vm_readv, liveness) per PID one.
    let ns = |kind: &str| {
        std::fs::read_link(format!("/proc/self/ns/{kind}"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let netns = format!("{} {}", ns("net"), ns("pid"));
    let mut h = std::collections::hash_map::DefaultHasher::new();
    // COMM_HOSTID / NCCL_HOSTID replaces the host's identity: processes that give the same one
    // share memory, processes that give different ones talk over the network.
    match crate::env::HOSTID.text() {
        Some(id) => ("hostid", id).hash(&mut h),
        None => (hostname.as_str(), boot_id.trim(), netns.as_str()).hash(&mut h),
    }
    let mut token = [0u8; 8];
    getrandom::getrandom(&mut token).expect("the OS random source is unavailable");
    Placement {
        host_hash: h.finish(),
        process_token: u64::from_ne_bytes(token),
        pid: std::process::id(),
        hostname,
    }
}

/// What a rank's progress loop is doing, as its peers on the host see it (with the CPU it
/// last ran on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Activity {
    /// Polling its links: running, unless its heartbeat stopped.
    Polling,
    /// Asleep on its doorbell, until a peer rings.
    Sleeping,
    /// Back in the application between operations: it may compute for long.
    Outside,
}

/// Where the ranks of one communicator on this host run, as each tells the others: the
/// CPU its progress loop last ran on, what it does there, and a heartbeat. The host
/// executor's placement (`exec::host::placement`) reads it to give way to a peer stuck
/// behind it; a transport whose peers share memory with this rank provides it (shm, from
/// its segments), and a communicator without such peers has none. Nothing here moves
/// messages, so links need not know of it.
pub(crate) trait Presence: Send + Sync {
    /// Tells the peers on this host which CPU this rank last ran on and what it does there. A
    /// peer that finds itself on that CPU knows this rank is not running, and gives the core
    /// up instead of spinning for it.
    fn set_running_on(&self, cpu: u32, what: Activity);
    /// Tells the peers on this host that this rank's progress loop is running (see
    /// `stalled`): called now and then while it polls.
    fn heartbeat(&self);
    /// The CPU `rank`'s progress loop last said it runs on, and what it does there; None for
    /// this rank, for ranks elsewhere, and for a peer that has not said yet.
    fn running_on(&self, rank: usize) -> Option<(u32, Activity)>;
    /// Whether neither what `rank` says it does (`running_on`) nor its heartbeat has changed
    /// for `after` up to `now`. False where that cannot be told. Called by this rank's
    /// progress loop only.
    fn stalled(&self, rank: usize, now: std::time::Instant, after: std::time::Duration) -> bool;
}

static THIS_PROCESS: Mutex<Option<Placement>> = Mutex::new(None);

/// Where this process runs. Recomputed in a child after fork(), which must not pass for its
/// parent.
pub(crate) fn this_process() -> Placement {
    let mut slot = THIS_PROCESS.lock();
    match &*slot {
        Some(p) if p.pid == std::process::id() => p.clone(),
        _ => {
            let p = identify();
            *slot = Some(p.clone());
            p
        }
    }
}

impl Placement {
    pub(crate) fn path_to(&self, peer: &Placement, is_self: bool) -> Path {
        if is_self {
            Path::SelfRank
        } else if peer.host_hash != self.host_hash {
            Path::Network
        } else if peer.process_token == self.process_token {
            Path::SameProcess
        } else {
            Path::SameHost
        }
    }

    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.host_hash.to_le_bytes());
        out.extend_from_slice(&self.process_token.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&(self.hostname.len() as u32).to_le_bytes());
        out.extend_from_slice(self.hostname.as_bytes());
    }

    pub(crate) fn decode(r: &mut crate::wire::Reader<'_>) -> crate::error::Result<Placement> {
        Ok(Placement {
            host_hash: r.u64()?,
            process_token: r.u64()?,
            pid: r.u32()?,
            hostname: r.string()?,
        })
    }
}

/// `rank`'s place among the ranks on its own host (those its `paths` do not reach over the
/// network), counted from 0 in rank order; None where it is alone there. Wherever the host
/// has several ranks, more than its CPUs included, the place picks the CPU a rank starts its
/// calls on (`Wiring::settle`, round its mask).
pub(crate) fn place_on_host(paths: &[Path], rank: usize) -> Option<usize> {
    (ranks_on_host(paths) > 1).then(|| ranks_on_host(&paths[..rank]))
}

/// How many of the ranks `paths` leads to are on this host (this rank included when the
/// slice holds its own entry): those not reached over the network.
pub(crate) fn ranks_on_host(paths: &[Path]) -> usize {
    paths.iter().filter(|p| **p != Path::Network).count()
}

/// CPUs this process may run on: more local ranks than this means waits must yield the core.
/// The CPUs this host has online, whatever this process may run on: ranks each pinned to a
/// CPU of their own see one usable CPU each but do not crowd the host.
pub(crate) fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(0).max(1)
}

pub(crate) fn usable_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's place counts only the ranks on its own host before it, whether or not the
    /// host has more ranks than CPUs; a rank alone on its host has none.
    #[test]
    fn places_on_a_host_skip_ranks_across_the_network() {
        use Path::*;
        // Rank 3's view of 6 ranks: 0, 2 and 5 on other hosts, 1 another process here, 4 a
        // thread of its own process.
        let paths = [Network, SameHost, Network, SelfRank, SameProcess, Network];
        assert_eq!(place_on_host(&paths, 3), Some(1));
        // Rank 4 (a thread beside rank 3) sees the same hosts.
        let paths4 = [Network, SameHost, Network, SameProcess, SelfRank, Network];
        assert_eq!(place_on_host(&paths4, 4), Some(2));
        assert_eq!(place_on_host(&[SelfRank, Network, Network], 0), None);
        // Eight ranks on one host get eight places, however many CPUs it has.
        for r in 0..8 {
            let paths: Vec<Path> = (0..8)
                .map(|p| if p == r { SelfRank } else { SameHost })
                .collect();
            assert_eq!(place_on_host(&paths, r), Some(r));
        }
    }

    #[test]
    fn paths_follow_host_and_process_identity() {
        let me = this_process();
        assert_eq!(me.path_to(&me, true), Path::SelfRank);
        assert_eq!(me.path_to(&me, false), Path::SameProcess);
        let other_proc = Placement {
            process_token: me.process_token ^ 1,
            ..me.clone()
        };
        assert_eq!(me.path_to(&other_proc, false), Path::SameHost);
        let other_host = Placement {
            host_hash: me.host_hash ^ 1,
            ..other_proc
        };
        assert_eq!(me.path_to(&other_host, false), Path::Network);
    }

    #[test]
    fn placement_round_trips_through_bytes() {
        let me = this_process();
        assert_eq!(me, this_process());
        let mut buf = Vec::new();
        me.encode(&mut buf);
        let mut r = crate::wire::Reader::new(&buf);
        assert_eq!(Placement::decode(&mut r).unwrap(), me);
        assert!(r.is_empty());
    }
}
