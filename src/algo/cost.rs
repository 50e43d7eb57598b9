//! The cost model behind `ncclGroupSimulateEnd`: how long one collective takes, from the
//! schedules the executor would run and a few numbers about the links.
//!
//! A collective costs the longer of two things:
//!
//! - **its path**: the dependent hops a piece of data makes from the first rank that holds it to
//!   the last that needs it (2(N-1) around a ring all-reduce, twice the depth of a tree, one for
//!   one-shot), each paying its link's latency, plus what the busiest rank does on the way: a
//!   fixed cost per message it sends or receives, its received bytes at its links' speed, and its
//!   reductions and local copies at memory speed. Pipelining overlaps the hops with the bytes, so
//!   the sum is an upper bound of that overlap and right where one of the two dominates.
//! - **its host's CPUs**: a host whose ranks outnumber its cores runs their work (messages,
//!   copies, reductions) in turn, so the per-rank work times ranks/cores bounds the time from
//!   below; every hop then also waits for the receiving rank to get a core back (a wake-up).
//!
//! The busiest rank is found by building the schedules of a few ranks (the caller's, the first,
//! the first of the second host, the last): every schedule here is symmetric up to the host
//! boundaries, so those cover the distinct roles without building N schedules. Links between
//! hosts are NICs: a host's ranks that send across hosts at once share its NICs.
//!
//! What it leaves out: contention inside a host's memory system, congestion of the network's
//! core, protocol and slot flow control, and the skew with which ranks arrive. Measured against
//! the executor in bench/RESULTS.md ("Cost model against measurements").

use super::{schedule, Algorithm, Collective, HostLayout, RingOrder, Shape, Step};
use std::sync::Arc;

/// One kind of link: the latency of a message and the speed of its bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub latency_us: f32,
    pub bytes_per_us: f32,
}

impl Link {
    /// Shared memory inside a host: a hop is a few cache-line hand-overs between cores (slot,
    /// then flag) to a receiver that spins, and bytes move at one core's memcpy speed for
    /// large buffers.
    pub(crate) const SHARED_MEMORY: Link = Link {
        latency_us: 0.5,
        bytes_per_us: 8_000.0,
    };

    /// A network interface running at `bytes_per_us`: a hop is one way through two kernels'
    /// network stacks (half a round trip of tens of microseconds).
    pub(crate) const fn tcp(bytes_per_us: f32) -> Link {
        Link {
            latency_us: 10.0,
            bytes_per_us,
        }
    }
}

/// What the model knows about the machines.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fabric {
    /// Between ranks of one host (shared memory, or NVLink for a device-class host).
    pub intra: Link,
    /// Between hosts, per NIC.
    pub inter: Link,
    pub nics_per_host: usize,
    /// CPU time a rank spends per message it sends or receives, beyond its bytes.
    pub message_us: f32,
    /// Bytes per microsecond a rank reduces (reads two operands, writes one) or copies locally.
    pub reduce_bytes_per_us: f32,
    /// Cores of a host (fractional where other work takes a share), and how many ranks share
    /// them (the most on any host).
    pub cores_per_host: f32,
    pub ranks_per_host: usize,
    /// What a hop costs when the receiving rank had to give up its core: a wake-up.
    pub wake_us: f32,
}

impl Fabric {
    /// Host memory over shared memory inside a host and TCP between hosts, whose interface
    /// runs at `net_bytes_per_us` (`Link::SHARED_MEMORY`, `Link::tcp`): the fabric
    /// `Comm::estimate_us` starts from before its transports give their own figures. A
    /// message costs its rank some bookkeeping besides.
    pub fn host_memory(
        net_bytes_per_us: f32,
        cores_per_host: usize,
        ranks_per_host: usize,
    ) -> Fabric {
        Fabric {
            intra: Link::SHARED_MEMORY,
            inter: Link::tcp(net_bytes_per_us),
            nics_per_host: 1,
            message_us: 0.2,
            reduce_bytes_per_us: 8_000.0,
            cores_per_host: cores_per_host.max(1) as f32,
            ranks_per_host: ranks_per_host.max(1),
            wake_us: 5.0,
        }
    }

    fn oversubscription(&self) -> f32 {
        (self.ranks_per_host as f32 / self.cores_per_host).max(1.0)
    }
}

/// The model's answer for one collective.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    pub us: f32,
    /// The dependent hops inside hosts and between them.
    pub hops_intra: usize,
    pub hops_inter: usize,
    /// The two bounds: the path (latency and the busiest rank's work) and the host's CPUs.
    pub path_us: f32,
    pub cpu_us: f32,
}

/// What one rank's schedule does, split by link.
#[derive(Default, Debug)]
struct Work {
    messages: usize,
    bytes_intra: usize,
    bytes_inter: usize,
    /// Bytes reduced or copied locally.
    local: usize,
}

fn work_of(s: &super::Schedule, rank: usize, across: &dyn Fn(usize, usize) -> bool) -> Work {
    let mut w = Work::default();
    for step in &s.steps {
        match *step {
            Step::Send { .. } => w.messages += 1,
            Step::Recv {
                peer,
                dst,
                reduce_with,
                ..
            } => {
                w.messages += 1;
                if across(rank, peer) {
                    w.bytes_inter += dst.len;
                } else {
                    w.bytes_intra += dst.len;
                }
                if reduce_with.is_some() {
                    w.local += dst.len;
                }
            }
            Step::Local { dst, a, b, .. } => {
                // A copy onto itself moves nothing.
                if b.is_some() || a.region != dst {
                    w.local += dst.len;
                }
            }
        }
    }
    w
}

/// Dependent hops on the critical path of `algo` for `coll`: (inside hosts, between hosts).
fn hops(
    coll: &Collective,
    algo: Algorithm,
    nranks: usize,
    layout: Option<&HostLayout>,
    bytes: usize,
) -> (usize, usize) {
    let n = nranks;
    if n <= 1 {
        return (0, 0);
    }
    let hosts = layout.map_or(1, |l| l.hosts());
    let biggest = layout.map_or(n, |l| l.members.iter().map(Vec::len).max().unwrap_or(1));
    let log2 = |x: usize| x.next_power_of_two().trailing_zeros() as usize;
    // One hop, between hosts when there are several.
    let one = |k: usize| if hosts > 1 { (0, k) } else { (k, 0) };
    // `steps` steps around a ring that crosses each of the `hosts` boundaries once.
    let ring = |steps: usize| {
        if hosts == 1 {
            (steps, 0)
        } else {
            let inter = (steps * hosts).div_ceil(n);
            (steps - inter.min(steps), inter.min(steps))
        }
    };
    // A tree of trees: a binomial tree over the hosts, one inside each host.
    let tree = |ways: usize| (ways * log2(biggest), ways * log2(hosts));
    match coll {
        Collective::AllReduce { .. } => match algo {
            Algorithm::Ring => ring(2 * (n - 1)),
            Algorithm::Tree => tree(2),
            Algorithm::Direct => one(1),
            Algorithm::TwoShot => one(2),
            Algorithm::Hier => match layout.and_then(|l| l.per_host().map(|p| (l, p))) {
                Some((l, per)) if per > 1 => {
                    let part = bytes / per;
                    let inter = if part <= l.direct_max {
                        1
                    } else {
                        2 * (hosts - 1)
                    };
                    (2 * (per - 1), inter)
                }
                _ => ring(2 * (n - 1)),
            },
        },
        Collective::AllGather { .. } | Collective::ReduceScatter { .. } => match algo {
            Algorithm::Direct => one(1),
            _ => ring(n - 1),
        },
        Collective::Broadcast { .. } | Collective::Reduce { .. } => match algo {
            Algorithm::Tree => tree(1),
            // A chain from the root enters each other host once.
            _ => (n - hosts, hosts - 1),
        },
        _ => one(1),
    }
}

/// Bytes of one rank's share, as the tuner counts them (the block of an all-gather or
/// reduce-scatter, the whole buffer otherwise).
pub(crate) fn tuner_bytes(coll: &Collective, elem: usize) -> usize {
    match coll {
        Collective::AllReduce { count }
        | Collective::Broadcast { count, .. }
        | Collective::Reduce { count, .. }
        | Collective::AllGather { count }
        | Collective::ReduceScatter { count } => count * elem,
        _ => 0,
    }
}

/// The collective's predicted time with `algo`, for `rank` (whose schedule is among those
/// looked at) in a communicator of `nranks` laid out as `layout` says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn predict(
    coll: &Collective,
    algo: Algorithm,
    elem: usize,
    rank: usize,
    nranks: usize,
    ring: Option<&RingOrder>,
    layout: Option<&Arc<HostLayout>>,
    slice_bytes: usize,
    fabric: &Fabric,
) -> Prediction {
    let across = |a: usize, b: usize| layout.is_some_and(|l| l.place[a].0 != l.place[b].0);
    // A point-to-point call's schedule is its caller's alone.
    let mut ranks = vec![rank];
    if !matches!(
        coll,
        Collective::Send { .. } | Collective::Recv { .. } | Collective::AlltoAllv(_)
    ) {
        ranks.extend([0, nranks - 1]);
        if let Some(l) = layout {
            ranks.push(l.members[1][0]);
        }
    }
    ranks.sort_unstable();
    ranks.dedup();
    let (hops_intra, hops_inter) = hops(
        coll,
        algo,
        nranks,
        layout.map(|l| &**l),
        tuner_bytes(coll, elem),
    );
    // The ranks of a host that send across hosts at once share its NICs.
    let senders = match (algo, layout) {
        (_, None) => 1,
        (Algorithm::Ring | Algorithm::Tree, _) => 1,
        (_, Some(l)) => l.members.iter().map(Vec::len).max().unwrap_or(1),
    };
    let inter_bw =
        fabric.inter.bytes_per_us * fabric.nics_per_host.min(senders) as f32 / senders as f32;
    let over = fabric.oversubscription();
    let hop_latency = |link: &Link| {
        if over > 1.0 {
            link.latency_us.max(fabric.wake_us)
        } else {
            link.latency_us
        }
    };
    let latency = hops_intra as f32 * hop_latency(&fabric.intra)
        + hops_inter as f32 * hop_latency(&fabric.inter);
    let (mut busiest, mut cpu) = (0f32, 0f32);
    for r in ranks {
        let shape = Shape {
            rank: r,
            nranks,
            elem,
            in_place: false,
            slice_bytes,
            ring: ring.cloned(),
            hosts: layout.cloned(),
        };
        let s = schedule(coll, &shape, algo);
        let w = work_of(&s, r, &across);
        // CPU work: messages, bytes copied through memory (shared memory's copies, and the
        // kernel's copies of socket bytes), reductions and local copies.
        let cpu_work = w.messages as f32 * fabric.message_us
            + (w.bytes_intra + w.bytes_inter) as f32 / fabric.intra.bytes_per_us
            + w.local as f32 / fabric.reduce_bytes_per_us;
        let on_links = w.messages as f32 * fabric.message_us
            + w.bytes_intra as f32 / fabric.intra.bytes_per_us
            + w.bytes_inter as f32 / inter_bw
            + w.local as f32 / fabric.reduce_bytes_per_us;
        busiest = busiest.max(on_links);
        cpu = cpu.max(cpu_work * over);
    }
    let path_us = latency + busiest;
    Prediction {
        us: path_us.max(cpu),
        hops_intra,
        hops_inter,
        path_us,
        cpu_us: cpu,
    }
}

/// A collective as nccl-tests names it (`allreduce`, `allgather`, `reducescatter`, `broadcast`,
/// `reduce`) on `bytes` of floats in nccl-tests' sense (the all-gather's output, the
/// reduce-scatter's input), for `nranks` ranks.
fn collective(name: &str, bytes: usize, nranks: usize) -> Result<Collective, String> {
    let count = bytes / 4;
    let block = count / nranks;
    Ok(match name {
        "allreduce" => Collective::AllReduce { count },
        "allgather" => Collective::AllGather { count: block },
        "reducescatter" => Collective::ReduceScatter { count: block },
        "broadcast" => Collective::Broadcast { count, root: 0 },
        "reduce" => Collective::Reduce { count, root: 0 },
        _ => return Err(format!("unknown collective {name}")),
    })
}

/// The tuner's pick and the model's time for a collective on a layout that exists only here:
/// `nranks` ranks, `per_host` to a host in rank order, host memory (the tuner's host-buffer
/// choice, with the knobs of this process's environment), on `fabric`. For the cost-model
/// example; the library itself asks `Comm::estimate_us`.
pub fn synthetic(
    name: &str,
    bytes: usize,
    nranks: usize,
    per_host: usize,
    fabric: &Fabric,
) -> Result<(&'static str, Prediction), String> {
    if nranks == 0 || per_host == 0 || nranks % per_host != 0 {
        return Err(format!("{nranks} ranks do not make hosts of {per_host}"));
    }
    let coll = collective(name, bytes, nranks)?;
    let host_of: Vec<usize> = (0..nranks).map(|r| r / per_host).collect();
    let hosts = nranks / per_host;
    let layout = HostLayout::new(&host_of, HostLayout::default_direct_max(hosts));
    let ring = RingOrder::by_host(&host_of);
    let tuner = super::tuner::Tuner::from_env(nranks, layout.as_deref());
    let algo = tuner.choose(&coll, tuner_bytes(&coll, 4), nranks);
    let p = predict(
        &coll,
        algo,
        4,
        0,
        nranks,
        ring.as_ref(),
        layout.as_ref(),
        crate::env::SLICE_BYTES.size().max(64),
        fabric,
    );
    Ok((algo.name(), p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(nranks: usize, per_host: usize) -> Option<Arc<HostLayout>> {
        let host_of: Vec<usize> = (0..nranks).map(|r| r / per_host).collect();
        HostLayout::new(&host_of, 64 << 10)
    }

    fn time(
        coll: &Collective,
        algo: Algorithm,
        nranks: usize,
        per_host: usize,
        fabric: &Fabric,
    ) -> f32 {
        let l = layout(nranks, per_host);
        let host_of: Vec<usize> = (0..nranks).map(|r| r / per_host).collect();
        let ring = RingOrder::by_host(&host_of);
        predict(
            coll,
            algo,
            4,
            0,
            nranks,
            ring.as_ref(),
            l.as_ref(),
            512 << 10,
            fabric,
        )
        .us
    }

    fn colls(bytes: usize, nranks: usize) -> Vec<(Collective, Vec<Algorithm>)> {
        let count = bytes / 4;
        let block = (count / nranks).max(1);
        use Algorithm::*;
        vec![
            (
                Collective::AllReduce { count },
                vec![Ring, Tree, Direct, TwoShot, Hier],
            ),
            (Collective::AllGather { count: block }, vec![Ring, Direct]),
            (
                Collective::ReduceScatter { count: block },
                vec![Ring, Direct],
            ),
            (Collective::Broadcast { count, root: 0 }, vec![Ring, Tree]),
            (Collective::Reduce { count, root: 0 }, vec![Ring, Tree]),
        ]
    }

    /// With the algorithm fixed, more bytes never take less time, on one host, on hosts of
    /// several ranks and on hosts of one, with a core per rank and with ranks sharing cores.
    #[test]
    fn more_bytes_never_take_less_time() {
        for (n, per_host) in [(8, 8), (16, 4), (12, 1)] {
            for cores in [per_host, 2] {
                let f = Fabric::host_memory(1250.0, cores, per_host);
                for (i, algos) in colls(8, n).into_iter().map(|(_, a)| a).enumerate() {
                    for algo in algos {
                        let mut last = 0.0;
                        for shift in (3..=26).step_by(2) {
                            let (coll, _) = colls(1 << shift, n).swap_remove(i);
                            let t = time(&coll, algo, n, per_host, &f);
                            assert!(
                                t >= last && t.is_finite(),
                                "{coll:?} with {algo:?}, {n} ranks, {per_host} a host, \
                                 {cores} cores: {t} us after {last} us"
                            );
                            last = t;
                        }
                    }
                }
            }
        }
    }

    /// With the size fixed, more ranks never take less time for the algorithms whose path or
    /// per-rank work grows with the rank count, whether every rank has a core or all share two.
    #[test]
    fn more_ranks_never_take_less_time() {
        use Algorithm::*;
        for bytes in [8, 64 << 10, 4 << 20] {
            for shared in [false, true] {
                let mut last = [0f32; 4];
                for n in [2, 4, 8, 16, 32, 64, 128] {
                    let cores = if shared { 2 } else { n };
                    let f = Fabric::host_memory(1250.0, cores, n);
                    let ar = Collective::AllReduce { count: bytes / 4 };
                    let ag = Collective::AllGather {
                        count: (bytes / 4 / n).max(1),
                    };
                    let t = [
                        time(&ar, Ring, n, n, &f),
                        time(&ar, Tree, n, n, &f),
                        time(&ar, Direct, n, n, &f),
                        time(&ag, Ring, n, n, &f),
                    ];
                    for k in 0..4 {
                        assert!(
                            t[k] >= last[k],
                            "case {k}, {bytes} bytes, shared cores {shared}: {n} ranks take \
                             {} us, fewer took {} us",
                            t[k],
                            last[k]
                        );
                    }
                    last = t;
                }
            }
        }
    }

    /// The tuner's choices for 1024 and 8192 ranks, 8 to a host, are algorithms that run on
    /// that layout, with finite, positive times that cross hosts as the algorithm says.
    #[test]
    fn choices_at_thousands_of_ranks_can_run_there() {
        let f = Fabric {
            nics_per_host: 8,
            ..Fabric::host_memory(50_000.0, 8, 8)
        };
        for n in [1024, 8192] {
            let mut shift = 3;
            while shift <= 33 {
                let bytes = 1usize << shift;
                for name in ["allreduce", "allgather", "reducescatter"] {
                    if name != "allreduce" && bytes < 4 * n {
                        continue;
                    }
                    let (algo, p) = synthetic(name, bytes, n, 8, &f).unwrap();
                    let ok: &[&str] = match name {
                        "allreduce" => &["ring", "tree", "direct", "hier"],
                        _ => &["ring", "direct"],
                    };
                    assert!(ok.contains(&algo), "{name} {bytes} on {n}: {algo}");
                    assert!(
                        p.us.is_finite() && p.us > 0.0,
                        "{name} {bytes} on {n}: {p:?}"
                    );
                    assert!(
                        p.hops_inter >= 1,
                        "{name} {bytes} on {n} never leaves a host"
                    );
                }
                shift += 6;
            }
        }
        assert!(
            synthetic("allreduce", 8, 1001, 8, &f).is_err(),
            "uneven hosts"
        );
        assert!(synthetic("alltoall", 8, 1024, 8, &f).is_err());
    }

    /// A host with more ranks than cores does their work in turn: the same call on the same
    /// layout takes longer on two cores than with a core per rank, by about the ratio.
    #[test]
    fn shared_cores_stretch_the_work() {
        let ar = Collective::AllReduce { count: 1 << 20 };
        let own = time(
            &ar,
            Algorithm::Ring,
            64,
            64,
            &Fabric::host_memory(1250.0, 64, 64),
        );
        let two = time(
            &ar,
            Algorithm::Ring,
            64,
            64,
            &Fabric::host_memory(1250.0, 2, 64),
        );
        assert!(
            two > 16.0 * own && two < 40.0 * own,
            "{own} us, {two} us on two cores"
        );
    }
}
