//! Schedules: what one rank does, step by step, to carry out a collective. Independent of memory
//! kinds and transports: a step names logical buffers and byte ranges; an executor resolves them
//! to addresses and carries the step out over whatever reaches the peer.
//!
//! Steps are listed in an order that respects data flow; an executor may run any step whose
//! inputs are final (it derives that from the byte ranges each step reads and writes) and must
//! keep, per peer, sends in list order and receives in list order.

pub(crate) mod cost;
pub(crate) mod direct;
pub(crate) mod hier;
pub(crate) mod pairwise;
pub(crate) mod ring;
pub(crate) mod tree;
pub(crate) mod tuner;

pub(crate) use tuner::Algorithm;

/// The buffers a schedule refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Buf {
    /// The caller's send buffer.
    Send,
    /// The caller's receive buffer.
    Recv,
    /// Temporary space the executor provides (`Schedule::scratch` bytes).
    Scratch,
}

/// `len` bytes at `offset` of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    pub buf: Buf,
    pub offset: usize,
    pub len: usize,
}

impl Region {
    pub(crate) fn new(buf: Buf, offset: usize, len: usize) -> Region {
        Region { buf, offset, len }
    }
}

/// A source of data. `input` marks this rank's own contribution to a reduction, untouched so
/// far: per-rank scaling (PreMulSum, floating-point Avg) applies to it exactly once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Operand {
    pub region: Region,
    pub input: bool,
}

impl Operand {
    pub(crate) fn input(region: Region) -> Operand {
        Operand {
            region,
            input: true,
        }
    }

    pub(crate) fn partial(region: Region) -> Operand {
        Operand {
            region,
            input: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Make `src` available to `peer`; its next receive from this rank gets it.
    Send { peer: usize, src: Operand },
    /// Take the next message from `peer` into `dst`, first combining it with `reduce_with` when
    /// given. `last` marks the step that produces final values (an integer average divides there).
    Recv {
        peer: usize,
        dst: Region,
        reduce_with: Option<Operand>,
        last: bool,
    },
    /// `dst = a` or `dst = a (+) b`, locally.
    Local {
        dst: Region,
        a: Operand,
        b: Option<Operand>,
        last: bool,
    },
}

impl Step {
    /// Every region the step reads or writes.
    pub(crate) fn regions(&self) -> impl Iterator<Item = Region> {
        let (a, b, c) = match *self {
            Step::Send { src, .. } => (Some(src.region), None, None),
            Step::Recv {
                dst, reduce_with, ..
            } => (Some(dst), reduce_with.map(|o| o.region), None),
            Step::Local { dst, a, b, .. } => (Some(dst), Some(a.region), b.map(|o| o.region)),
        };
        [a, b, c].into_iter().flatten()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Schedule {
    pub steps: Vec<Step>,
    /// Bytes of scratch space the steps use.
    pub scratch: usize,
    /// How far into the send and receive buffers the steps reach.
    pub send_extent: usize,
    pub recv_extent: usize,
    /// Some receive copies its bytes as they are, without reducing them.
    pub copies_in: bool,
}

impl Schedule {
    /// What every collective is on one rank: the input copied to the output (nothing when they
    /// are the same bytes).
    fn local_copy(bytes: usize) -> Schedule {
        let mut s = Schedule::default();
        s.push(Step::Local {
            dst: Region::new(Buf::Recv, 0, bytes),
            a: Operand::input(Region::new(Buf::Send, 0, bytes)),
            b: None,
            last: true,
        });
        s
    }

    /// An all-gather's first step: this rank's own block copied from the input into its place in
    /// the output. In place it is there already, and a copy onto itself would only hold back
    /// the sends that read it.
    fn own_block(&mut self, shape: &Shape, bytes: usize) {
        if !shape.in_place {
            self.push(Step::Local {
                dst: Region::new(Buf::Recv, shape.rank * bytes, bytes),
                a: Operand::partial(Region::new(Buf::Send, 0, bytes)),
                b: None,
                last: false,
            });
        }
    }

    fn push(&mut self, step: Step) {
        let len = match step {
            Step::Send { src, .. } => src.region.len,
            Step::Recv { dst, .. } | Step::Local { dst, .. } => dst.len,
        };
        if len == 0 {
            return;
        }
        if let Step::Recv {
            reduce_with: None, ..
        } = step
        {
            self.copies_in = true;
        }
        for r in step.regions() {
            match r.buf {
                Buf::Send => self.send_extent = self.send_extent.max(r.offset + r.len),
                Buf::Recv => self.recv_extent = self.recv_extent.max(r.offset + r.len),
                Buf::Scratch => {}
            }
        }
        self.steps.push(step);
    }
}

/// An all-to-all-v's element counts and displacements, one entry per rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PerPeer {
    pub send_counts: Vec<usize>,
    pub send_displs: Vec<usize>,
    pub recv_counts: Vec<usize>,
    pub recv_displs: Vec<usize>,
}

/// A collective (or one side of a point-to-point transfer) as every rank describes it. Counts are
/// elements; `elem` is the element size in bytes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Collective {
    AllReduce {
        count: usize,
    },
    Broadcast {
        count: usize,
        root: usize,
    },
    Reduce {
        count: usize,
        root: usize,
    },
    /// `count` elements from each rank.
    AllGather {
        count: usize,
    },
    /// `count` result elements per rank.
    ReduceScatter {
        count: usize,
    },
    /// `count` elements to each peer.
    AlltoAll {
        count: usize,
    },
    /// Per-peer element counts and displacements (boxed: every call moves a `Collective`
    /// several times, and the other kinds are two words).
    AlltoAllv(Box<PerPeer>),
    Gather {
        count: usize,
        root: usize,
    },
    Scatter {
        count: usize,
        root: usize,
    },
    Send {
        peer: usize,
        count: usize,
    },
    Recv {
        peer: usize,
        count: usize,
    },
}

impl Collective {
    /// Whether the call moves no data on any rank: a collective whose one count, the same on
    /// every rank, is zero. (Sends and receives of nothing already put nothing on a channel;
    /// an all-to-all-v with nothing here may still have traffic between other ranks.)
    pub(crate) fn moves_nothing(&self) -> bool {
        match self {
            Collective::AllReduce { count }
            | Collective::Broadcast { count, .. }
            | Collective::Reduce { count, .. }
            | Collective::AllGather { count }
            | Collective::ReduceScatter { count }
            | Collective::AlltoAll { count }
            | Collective::Gather { count, .. }
            | Collective::Scatter { count, .. } => *count == 0,
            _ => false,
        }
    }

    /// Whether data is combined (and the reduction op matters).
    pub(crate) fn reduces(&self) -> bool {
        matches!(
            self,
            Collective::AllReduce { .. }
                | Collective::Reduce { .. }
                | Collective::ReduceScatter { .. }
        )
    }

    /// The message-tag kind of this operation.
    pub(crate) fn kind(&self) -> u8 {
        use crate::tag::kind;
        match self {
            Collective::AllReduce { .. } => kind::ALL_REDUCE,
            Collective::Broadcast { .. } => kind::BROADCAST,
            Collective::Reduce { .. } => kind::REDUCE,
            Collective::AllGather { .. } => kind::ALL_GATHER,
            Collective::ReduceScatter { .. } => kind::REDUCE_SCATTER,
            Collective::AlltoAll { .. } => kind::ALL_TO_ALL,
            Collective::AlltoAllv(_) => kind::ALL_TO_ALL_V,
            Collective::Gather { .. } => kind::GATHER,
            Collective::Scatter { .. } => kind::SCATTER,
            Collective::Send { .. } | Collective::Recv { .. } => kind::P2P,
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        crate::tag::kind::name(self.kind())
    }

    /// The root of a rooted collective.
    pub(crate) fn root(&self) -> Option<usize> {
        match self {
            Collective::Broadcast { root, .. }
            | Collective::Reduce { root, .. }
            | Collective::Gather { root, .. }
            | Collective::Scatter { root, .. } => Some(*root),
            _ => None,
        }
    }
}

/// Who runs the schedule: its rank, the rank count, the element size, and whether the caller's
/// send and receive buffers overlap (some schedules then keep a copy of the input in scratch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub rank: usize,
    pub nranks: usize,
    pub elem: usize,
    pub in_place: bool,
    /// Upper bound of one pipelined message, in bytes.
    pub slice_bytes: usize,
    /// The order in which rings visit the ranks (`None`: rank order).
    pub ring: Option<RingOrder>,
    /// Which ranks share a host (`None`: all of them, or not known).
    pub hosts: Option<std::sync::Arc<HostLayout>>,
}

/// The most peers a one-shot exchange (every rank sends to every other) is chosen for by
/// default: beyond, the tree's 2 log2 N messages a rank beat its N-1 even for 8 bytes, and
/// each rank would hold a connection to every peer, which does not scale.
pub(crate) const ONE_SHOT_MAX_PEERS: usize = 16;

/// The ranks grouped by host, for schedules that keep most traffic on the links inside a host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostLayout {
    /// The ranks of each host in rank order; hosts in the order of their first rank.
    pub members: Vec<Vec<usize>>,
    /// Each rank's host (an index into `members`) and its index among that host's ranks.
    pub place: Vec<(usize, usize)>,
    /// The hierarchical all-reduce exchanges a part of up to this many bytes between hosts
    /// one-shot (one message to each other host); above it, around a ring of the hosts.
    pub direct_max: usize,
}

impl HostLayout {
    /// The layout of ranks whose hosts are `host_of`, or `None` when they share one host.
    pub(crate) fn new<H: std::hash::Hash + Eq>(
        host_of: &[H],
        direct_max: usize,
    ) -> Option<std::sync::Arc<HostLayout>> {
        let mut index: std::collections::HashMap<&H, usize> = Default::default();
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut place = Vec::with_capacity(host_of.len());
        for (r, h) in host_of.iter().enumerate() {
            let i = *index.entry(h).or_insert_with(|| {
                members.push(Vec::new());
                members.len() - 1
            });
            place.push((i, members[i].len()));
            members[i].push(r);
        }
        (members.len() > 1).then(|| {
            std::sync::Arc::new(HostLayout {
                members,
                place,
                direct_max,
            })
        })
    }

    pub(crate) fn hosts(&self) -> usize {
        self.members.len()
    }

    /// The default of `direct_max` for `hosts` hosts (COMM_HIER_DIRECT_MAX_BYTES overrides
    /// it). Between two hosts a one-shot exchange moves the same bytes as a ring of the hosts
    /// in one hop instead of two; between a few it moves more bytes in fewer hops; past
    /// `ONE_SHOT_MAX_PEERS` hosts never, since every rank would connect to every other host
    /// and send to each of them (the tuner takes the tree for small sizes there instead).
    pub(crate) fn default_direct_max(hosts: usize) -> usize {
        crate::env::HIER_DIRECT_MAX_BYTES
            .size_if_set()
            .unwrap_or(match hosts {
                0..=2 => usize::MAX,
                h if h <= ONE_SHOT_MAX_PEERS => 64 << 10,
                _ => 0,
            })
    }

    /// The number of ranks on each host, when every host has the same number.
    pub(crate) fn per_host(&self) -> Option<usize> {
        let n = self.members[0].len();
        self.members.iter().all(|m| m.len() == n).then_some(n)
    }
}

/// A ring that visits the ranks in another order than their numbers: each host's ranks one
/// after another, so that a ring crosses each host boundary once (see `RingOrder::by_host`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RingOrder {
    /// The rank at each position.
    at: std::sync::Arc<[usize]>,
    /// The position of each rank.
    pos: std::sync::Arc<[usize]>,
}

impl RingOrder {
    /// Ranks grouped by host (hosts in the order of their first rank, ranks in rank order inside
    /// one), or `None` when that is rank order already.
    pub(crate) fn by_host<H: std::hash::Hash + Eq>(host_of: &[H]) -> Option<RingOrder> {
        // Each host's first rank, found in one pass: init runs this once per communicator,
        // and a search per comparison would be quadratic in the rank count.
        let mut first: std::collections::HashMap<&H, usize> = Default::default();
        for (r, h) in host_of.iter().enumerate() {
            first.entry(h).or_insert(r);
        }
        let mut at: Vec<usize> = (0..host_of.len()).collect();
        at.sort_by_key(|&r| (first[&host_of[r]], r));
        RingOrder::new(at)
    }

    /// The ranks in ring order.
    #[cfg(test)]
    pub(crate) fn ranks(&self) -> &[usize] {
        &self.at
    }

    /// The ring that visits `at[0], at[1], ...`; `None` for rank order.
    pub(crate) fn new(at: Vec<usize>) -> Option<RingOrder> {
        if at.iter().enumerate().all(|(i, &r)| i == r) {
            return None;
        }
        let mut pos = vec![0; at.len()];
        for (i, &r) in at.iter().enumerate() {
            pos[r] = i;
        }
        Some(RingOrder {
            at: at.into(),
            pos: pos.into(),
        })
    }
}

impl Shape {
    /// This rank's position on the ring.
    fn position(&self) -> usize {
        self.ring.as_ref().map_or(self.rank, |o| o.pos[self.rank])
    }

    fn rank_at(&self, pos: usize) -> usize {
        self.ring.as_ref().map_or(pos, |o| o.at[pos])
    }

    pub(crate) fn next(&self) -> usize {
        self.rel(1)
    }

    pub(crate) fn prev(&self) -> usize {
        self.rel(-1)
    }

    /// The rank `k` places further along the ring, for any signed k (`(rank + k) mod nranks`
    /// in rank order).
    pub(crate) fn rel(&self, k: isize) -> usize {
        let n = self.nranks as isize;
        self.rank_at((self.position() as isize + k).rem_euclid(n) as usize)
    }

    /// The order in which a chain from `root` visits the ranks: around the ring from the root,
    /// each host's ranks together and the root's host first (so that the chain enters every
    /// other host once and never comes back).
    pub(crate) fn chain_from(&self, root: usize) -> Vec<usize> {
        let n = self.nranks;
        let start = self.ring.as_ref().map_or(root, |o| o.pos[root]);
        let order = (0..n).map(|k| self.rank_at((start + k) % n));
        let Some(l) = self.hosts.as_deref() else {
            return order.collect();
        };
        let mut by_host: Vec<Vec<usize>> = Vec::new();
        let mut slot = vec![usize::MAX; l.hosts()];
        for r in order {
            let h = l.place[r].0;
            if slot[h] == usize::MAX {
                slot[h] = by_host.len();
                by_host.push(Vec::new());
            }
            by_host[slot[h]].push(r);
        }
        by_host.concat()
    }

    /// Splits `[offset, offset + bytes)` into pipeline slices of whole elements.
    pub(crate) fn slices(&self, buf: Buf, offset: usize, bytes: usize) -> Vec<Region> {
        let per = (self.slice_bytes / self.elem).max(1) * self.elem;
        let mut out = Vec::with_capacity(bytes.div_ceil(per).max(1));
        let mut at = 0;
        while at < bytes {
            let n = per.min(bytes - at);
            out.push(Region::new(buf, offset + at, n));
            at += n;
        }
        out
    }
}

/// Appends sends and receives alternately, slice by slice: an executor that runs steps
/// strictly in order (a GPU stream) with a few message slots per peer then never waits for a
/// slot that only its own later receives could free.
pub(crate) fn interleave(
    s: &mut Schedule,
    sends: impl Iterator<Item = Step>,
    recvs: impl Iterator<Item = Step>,
) {
    let mut recvs = recvs.peekable();
    for send in sends {
        s.push(send);
        if let Some(r) = recvs.next() {
            s.push(r);
        }
    }
    for r in recvs {
        s.push(r);
    }
}

/// `count` elements cut into `parts` nearly equal pieces (the first `count % parts` one larger):
/// `(start, len)` in elements.
pub(crate) fn partition(count: usize, parts: usize) -> Vec<(usize, usize)> {
    let base = count / parts;
    let extra = count % parts;
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let piece = (start, len);
            start += len;
            piece
        })
        .collect()
}

/// The schedule of `coll` for `shape` with `algo` (the tuner's choice or the caller's override).
pub(crate) fn schedule(coll: &Collective, shape: &Shape, algo: Algorithm) -> Schedule {
    let e = shape.elem;
    match coll {
        Collective::AllReduce { count } => match algo {
            Algorithm::Direct => direct::all_reduce(*count, shape),
            Algorithm::TwoShot => direct::all_reduce_two_shot(*count, shape),
            Algorithm::Tree => tree::all_reduce(*count, shape),
            Algorithm::Ring => ring::all_reduce(*count, shape),
            Algorithm::Hier => hier::all_reduce(*count, shape),
        },
        Collective::Broadcast { count, root } => match algo {
            Algorithm::Tree => tree::broadcast(*count, *root, shape),
            _ => ring::broadcast(*count, *root, shape),
        },
        Collective::Reduce { count, root } => match algo {
            Algorithm::Tree => tree::reduce(*count, *root, shape),
            _ => ring::reduce(*count, *root, shape),
        },
        Collective::AllGather { count } => match algo {
            Algorithm::Direct => direct::all_gather(*count, shape),
            _ => ring::all_gather(*count, shape),
        },
        Collective::ReduceScatter { count } => match algo {
            Algorithm::Direct => direct::reduce_scatter(*count, shape),
            _ => ring::reduce_scatter(*count, shape),
        },
        Collective::AlltoAll { count } => {
            let counts = vec![*count; shape.nranks];
            let displs: Vec<usize> = (0..shape.nranks).map(|p| p * count).collect();
            pairwise::all_to_all_v(&counts, &displs, &counts, &displs, shape)
        }
        Collective::AlltoAllv(v) => pairwise::all_to_all_v(
            &v.send_counts,
            &v.send_displs,
            &v.recv_counts,
            &v.recv_displs,
            shape,
        ),
        Collective::Gather { count, root } => direct::gather(*count, *root, shape),
        Collective::Scatter { count, root } => direct::scatter(*count, *root, shape),
        Collective::Send { peer, count } => {
            let mut s = Schedule::default();
            for r in shape.slices(Buf::Send, 0, count * e) {
                s.push(Step::Send {
                    peer: *peer,
                    src: Operand::partial(r),
                });
            }
            s
        }
        Collective::Recv { peer, count } => {
            let mut s = Schedule::default();
            for dst in shape.slices(Buf::Recv, 0, count * e) {
                s.push(Step::Recv {
                    peer: *peer,
                    dst,
                    reduce_with: None,
                    last: false,
                });
            }
            s
        }
    }
}

/// A send whose data is first copied to scratch, so that the caller's buffer is free as soon as
/// the copy is made (see `group::stage_overwritten_sends`).
pub(crate) fn staged_send(peer: usize, bytes: usize, shape: &Shape) -> Schedule {
    let mut s = Schedule {
        scratch: bytes,
        ..Schedule::default()
    };
    let aside = Region::new(Buf::Scratch, 0, bytes);
    s.push(Step::Local {
        dst: aside,
        a: Operand::partial(Region::new(Buf::Send, 0, bytes)),
        b: None,
        last: false,
    });
    for r in shape.slices(Buf::Scratch, 0, bytes) {
        s.push(Step::Send {
            peer,
            src: Operand::partial(r),
        });
    }
    s
}

#[cfg(test)]
pub(crate) mod sim;

#[cfg(test)]
mod tests {
    use super::*;

    /// `copies_in` tells whether some receive lands bytes without reducing them.
    #[test]
    fn schedules_know_whether_they_copy_received_bytes_in() {
        let shape = |rank| Shape {
            rank,
            nranks: 3,
            elem: 4,
            in_place: false,
            slice_bytes: 64,
            ring: None,
            hosts: None,
        };
        assert!(ring::all_reduce(100, &shape(0)).copies_in);
        assert!(ring::all_gather(100, &shape(1)).copies_in);
        assert!(!ring::reduce_scatter(100, &shape(1)).copies_in);
        assert!(!ring::broadcast(100, 0, &shape(0)).copies_in, "the root");
        assert!(ring::broadcast(100, 0, &shape(1)).copies_in);
        assert!(
            !ring::all_reduce(0, &shape(0)).copies_in,
            "nothing to receive"
        );
    }

    #[test]
    fn partition_covers_everything_once() {
        for count in [0, 1, 7, 8, 9, 1000] {
            for parts in 1..9 {
                let p = partition(count, parts);
                assert_eq!(p.len(), parts);
                assert_eq!(p.iter().map(|x| x.1).sum::<usize>(), count);
                for w in p.windows(2) {
                    assert_eq!(w[0].0 + w[0].1, w[1].0);
                    assert!(w[0].1 >= w[1].1 && w[0].1 - w[1].1 <= 1);
                }
            }
        }
    }

    #[test]
    fn slices_are_whole_elements_and_cover_the_range() {
        let shape = Shape {
            rank: 0,
            nranks: 2,
            elem: 4,
            in_place: false,
            slice_bytes: 10,
            ring: None,
            hosts: None,
        };
        let s = shape.slices(Buf::Recv, 100, 28);
        assert_eq!(
            s.iter().map(|r| (r.offset, r.len)).collect::<Vec<_>>(),
            vec![(100, 8), (108, 8), (116, 8), (124, 4)]
        );
        assert!(shape.slices(Buf::Recv, 0, 0).is_empty());
    }
}
