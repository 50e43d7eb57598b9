//! Runs every rank's program on the CPU: each rank's memory is one byte vector in which the
//! operations' buffers sit at their addresses (so in-place aliasing is real), slots and flags
//! are separate, waits block the rank until the flag holds the value. Checks results against
//! exact sums, registered-buffer programs against the staged ones byte for byte, that no
//! rank overwrites bytes a peer has yet to read in place, and that flags end as they started.
use super::compile::*;
use super::program::*;
use super::*;
use crate::algo::Shape;
use crate::algo::{self, Algorithm, Collective};
use crate::exec::op::Reduction;
use crate::reduce::DataType;
use crate::reduce::{ReduceOp, Reducer, Scale};
use crate::transport::p2p::{flag_count, Desc, Flag};
use std::collections::HashMap;

struct Rank {
    mem: Vec<u8>,
    bufs: Vec<OpBuffers>,
    slots: Vec<Vec<Vec<u8>>>,
    flags: Vec<u32>,
    descs: Vec<u64>,
    /// Descriptor cells written since their message was last read.
    fresh: Vec<bool>,
    pc: usize,
}

impl Rank {
    fn new(n: usize, slot_bytes: usize, mem: Vec<u8>, bufs: Vec<OpBuffers>) -> Rank {
        let mut flags = vec![0u32; flag_count(n, SLOTS)];
        for to in 0..n {
            for slot in 0..SLOTS {
                flags[Flag::Empty { owner: 0, to, slot }.index(n, SLOTS)] = 1;
            }
        }
        Rank {
            mem,
            bufs,
            slots: (0..n).map(|_| vec![vec![0u8; slot_bytes]; SLOTS]).collect(),
            flags,
            descs: vec![0; n * SLOTS],
            fresh: vec![false; n * SLOTS],
            pc: 0,
        }
    }
}

/// Memory of a rank that peers are still to read in place: (peer, slot) -> (start, len).
type Pinned = Vec<HashMap<(usize, usize), (usize, usize)>>;

fn read(ranks: &mut [Rank], pinned: &mut Pinned, me: usize, loc: Loc, len: usize) -> Vec<u8> {
    match loc {
        Loc::Buf { op, buf, offset } => {
            let at = ranks[me].bufs[op].base(buf) as usize + offset;
            ranks[me].mem[at..at + len].to_vec()
        }
        Loc::Slot {
            owner,
            to,
            slot,
            offset,
        } => ranks[owner].slots[to][slot][offset..offset + len].to_vec(),
        Loc::Message { from, to, slot } => {
            assert_eq!(to, me, "rank {me} read a message meant for rank {to}");
            let d = Desc {
                owner: to,
                from,
                slot,
            }
            .index(SLOTS);
            assert!(
                ranks[me].fresh[d],
                "rank {me} read a stale descriptor from rank {from}"
            );
            ranks[me].fresh[d] = false;
            match ranks[me].descs[d] {
                0 => ranks[from].slots[to][slot][..len].to_vec(),
                at => {
                    let (start, plen) = pinned[from]
                        .remove(&(to, slot))
                        .expect("a direct message is pinned");
                    assert_eq!((start, plen), (at as usize, len));
                    ranks[from].mem[at as usize..at as usize + len].to_vec()
                }
            }
        }
    }
}

fn write(ranks: &mut [Rank], pinned: &Pinned, me: usize, loc: Loc, data: &[u8]) {
    let dst = match loc {
        Loc::Buf { op, buf, offset } => {
            let at = ranks[me].bufs[op].base(buf) as usize + offset;
            for (&(peer, slot), &(start, len)) in &pinned[me] {
                assert!(
                    at + data.len() <= start || start + len <= at,
                    "rank {me} overwrote bytes rank {peer} had yet to read in place (slot {slot})"
                );
            }
            &mut ranks[me].mem[at..at + data.len()]
        }
        Loc::Slot {
            owner,
            to,
            slot,
            offset,
        } => {
            assert_eq!(owner, me, "rank {me} wrote into rank {owner}'s slot");
            &mut ranks[owner].slots[to][slot][offset..offset + data.len()]
        }
        Loc::Message { .. } => panic!("rank {me} wrote into a message"),
    };
    dst.copy_from_slice(data);
}

/// Runs the programs of all ranks to the end (or panics on deadlock).
fn run(progs: &[Vec<DevOp>], ranks: &mut [Rank], n: usize, elem: usize) {
    let mut pinned: Pinned = vec![HashMap::new(); n];
    loop {
        let mut moved = false;
        for me in 0..n {
            while ranks[me].pc < progs[me].len() {
                match &progs[me][ranks[me].pc] {
                    DevOp::Wait { flag, value } => {
                        assert_eq!(flag.owner(), me, "rank {me} waits on another rank's flag");
                        if ranks[me].flags[flag.index(n, SLOTS)] != *value {
                            break;
                        }
                    }
                    DevOp::Set { flag, value } => {
                        let i = flag.index(n, SLOTS);
                        ranks[flag.owner()].flags[i] = *value;
                    }
                    DevOp::Describe { desc, len, direct } => {
                        assert_ne!(desc.owner, me);
                        let i = desc.index(SLOTS);
                        let at = match direct {
                            Some((loc, at)) => {
                                let Loc::Buf { op, buf, offset } = *loc else {
                                    panic!("a direct message outside the caller's buffers")
                                };
                                assert_eq!(
                                    *at as usize,
                                    ranks[me].bufs[op].base(buf) as usize + offset
                                );
                                *at
                            }
                            None => 0,
                        };
                        ranks[desc.owner].descs[i] = at;
                        ranks[desc.owner].fresh[i] = true;
                        if at != 0 {
                            pinned[me].insert((desc.owner, desc.slot), (at as usize, *len));
                        }
                    }
                    DevOp::Copy { dst, src, len } => {
                        let data = read(ranks, &mut pinned, me, *src, *len);
                        write(ranks, &pinned, me, *dst, &data);
                    }
                    DevOp::Reduce {
                        dst,
                        srcs,
                        count,
                        reducer,
                        divide_by,
                    } => {
                        let len = count * elem;
                        let first = &srcs[0];
                        let factor = |f: Option<Factor>, rank: &Rank| {
                            f.map(|f| match f {
                                Factor::Value(s) => s,
                                Factor::At(at) => Scale::from_bytes(
                                    reducer.dtype,
                                    &rank.mem[at as usize..at as usize + elem],
                                ),
                            })
                        };
                        let mut acc = read(ranks, &mut pinned, me, first.loc, len);
                        if let Some(s) = factor(first.scale, &ranks[me]) {
                            reducer.scale_in_place(&mut acc, s);
                        }
                        for s in &srcs[1..] {
                            let b = read(ranks, &mut pinned, me, s.loc, len);
                            let f = factor(s.scale, &ranks[me]);
                            reducer.reduce_in_place(&mut acc, None, &b, f);
                        }
                        if let Some(d) = divide_by {
                            reducer.divide_in_place(&mut acc, *d);
                        }
                        write(ranks, &pinned, me, *dst, &acc);
                    }
                }
                ranks[me].pc += 1;
                moved = true;
            }
            if ranks[me].pc == progs[me].len() {
                assert!(
                    pinned[me].is_empty(),
                    "rank {me} finished while peers had yet to read {:?} in place",
                    pinned[me]
                );
            }
        }
        if (0..n).all(|r| ranks[r].pc == progs[r].len()) {
            return;
        }
        assert!(
            moved,
            "device programs deadlock at {:?}",
            ranks.iter().map(|r| r.pc).collect::<Vec<_>>()
        );
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Elements in the send and the receive buffer of one rank.
fn elems(c: &Collective, n: usize) -> (usize, usize) {
    match *c {
        Collective::AllReduce { count }
        | Collective::Broadcast { count, .. }
        | Collective::Reduce { count, .. } => (count, count),
        Collective::AllGather { count } | Collective::Gather { count, .. } => (count, count * n),
        Collective::ReduceScatter { count } | Collective::Scatter { count, .. } => {
            (count * n, count)
        }
        Collective::AlltoAll { count } => (count * n, count * n),
        Collective::Send { count, .. } => (count, 0),
        Collective::Recv { count, .. } => (0, count),
        _ => unreachable!("not used here"),
    }
}

/// NCCL's in-place rule: byte offsets of the send and receive parts in the one buffer.
fn in_place_offsets(c: &Collective, rank: usize, es: usize) -> (usize, usize) {
    match *c {
        Collective::AllGather { count } => (rank * count * es, 0),
        Collective::Gather { count, root } if rank == root => (root * count * es, 0),
        Collective::ReduceScatter { count } => (0, rank * count * es),
        Collective::Scatter { count, root } if rank == root => (0, root * count * es),
        _ => (0, 0),
    }
}

/// A tiny deterministic generator (xorshift).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

/// One rank's operations, laid out in one memory: (ops, buffers, memory filled with small
/// integral floats).
struct Setup {
    ops: Vec<DeviceOp>,
    bufs: Vec<OpBuffers>,
    mem: Vec<u8>,
}

#[allow(clippy::too_many_arguments)]
fn setup(
    colls: &[Collective],
    algo: Algorithm,
    rank: usize,
    n: usize,
    in_place: bool,
    slot_bytes: usize,
    reduction: Option<Reduction>,
    seed: u64,
) -> Setup {
    let es = 4;
    let shape = Shape {
        rank,
        nranks: n,
        elem: es,
        in_place,
        slice_bytes: slot_bytes,
        ring: None,
        hosts: None,
    };
    let mut ops = Vec::new();
    let mut bufs = Vec::new();
    let mut at = 64usize;
    for c in colls {
        let schedule = algo::schedule(c, &shape, algo);
        let (se, re) = elems(c, n);
        let (send, recv) = if in_place {
            let (so, ro) = in_place_offsets(c, rank, es);
            let base = at;
            at += (se * es).max(re * es) + 64;
            (base + so, base + ro)
        } else {
            let s = at;
            at += se * es + 64;
            let r = at;
            at += re * es + 64;
            (s, r)
        };
        let scratch = at;
        at += schedule.scratch + 64;
        let reduces = matches!(
            c,
            Collective::AllReduce { .. }
                | Collective::Reduce { .. }
                | Collective::ReduceScatter { .. }
        );
        ops.push(DeviceOp {
            coll: c.clone(),
            schedule: schedule.into(),
            reduction: if reduces { reduction } else { None },
            elem: es,
        });
        bufs.push(OpBuffers {
            send: send as u64,
            recv: recv as u64,
            scratch: scratch as u64,
        });
    }
    let mut rng = Rng(seed | 1);
    let mem = (0..at / 4)
        .flat_map(|_| ((rng.next() % 64) as f32).to_ne_bytes())
        .collect();
    Setup { ops, bufs, mem }
}

/// Runs one program per rank; returns every rank's memory and checks the flags came back.
fn run_all(setups: &[Setup], links: &[Links], slot_bytes: usize) -> Vec<Vec<u8>> {
    let n = setups.len();
    let progs: Vec<Vec<DevOp>> = setups
        .iter()
        .enumerate()
        .map(|(r, s)| compile(&s.ops, &s.bufs, r, n, SLOTS, slot_bytes, &links[r]).unwrap())
        .collect();
    let mut ranks: Vec<Rank> = setups
        .iter()
        .map(|s| Rank::new(n, slot_bytes, s.mem.clone(), s.bufs.clone()))
        .collect();
    let initial: Vec<Vec<u32>> = ranks.iter().map(|r| r.flags.clone()).collect();
    run(&progs, &mut ranks, n, 4);
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(rank.flags, initial[r], "rank {r}'s flags not restored");
    }
    ranks.into_iter().map(|r| r.mem).collect()
}

/// All-reduce of f32 sums with every algorithm, twice in a row (slots and flags must be
/// reusable), compared with the exact sum; PreMulSum with a different scalar per rank, known
/// when the program is built or read from the rank's memory when it runs.
#[test]
fn all_reduce_programs_compute_sums_and_restore_flags() {
    let slot_bytes = 16;
    for n in 1..=5 {
        for count in [0usize, 1, 7, 33] {
            for algo in [
                Algorithm::Ring,
                Algorithm::Tree,
                Algorithm::Direct,
                Algorithm::TwoShot,
            ] {
                for scaling in ["none", "value", "memory"] {
                    // Rank r multiplies its input by r + 2.
                    let factor = |r: usize| {
                        if scaling == "none" {
                            1.0
                        } else {
                            r as f32 + 2.0
                        }
                    };
                    let reduction = |r: usize| Reduction {
                        reducer: Reducer::new(DataType::Float32, ReduceOp::Sum),
                        input_scale: (scaling == "value").then(|| {
                            Scale::from_bytes(DataType::Float32, &factor(r).to_ne_bytes())
                        }),
                        // Bytes 0..4 of the rank's memory (its buffers start at 64).
                        input_scale_at: (scaling == "memory").then_some(0),
                        divide_by: None,
                    };
                    let colls = vec![Collective::AllReduce { count }; 2];
                    let setups: Vec<Setup> = (0..n)
                        .map(|r| {
                            let mut s = setup(
                                &colls,
                                algo,
                                r,
                                n,
                                false,
                                slot_bytes,
                                Some(reduction(r)),
                                r as u64 + 7,
                            );
                            s.mem[..4].copy_from_slice(&factor(r).to_ne_bytes());
                            s
                        })
                        .collect();
                    let links: Vec<Links> = (0..n).map(|_| Links::staged(n)).collect();
                    let mems = run_all(&setups, &links, slot_bytes);
                    for (r, mem) in mems.iter().enumerate() {
                        for op in 0..2 {
                            let recv = setups[r].bufs[op].recv as usize;
                            let got = f32s(&mem[recv..recv + count * 4]);
                            for (i, g) in got.iter().enumerate() {
                                let want: f32 = (0..n)
                                    .map(|q| {
                                        let s = setups[q].bufs[op].send as usize + 4 * i;
                                        factor(q) * f32s(&setups[q].mem[s..s + 4])[0]
                                    })
                                    .sum();
                                assert_eq!(
                                    *g, want,
                                    "{algo:?} {scaling} n={n} count={count} rank {r} op {op} elem {i}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Case {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AlltoAll,
    Gather,
    Scatter,
    SendRecv,
}

const CASES: [(Algorithm, Case); 14] = [
    (Algorithm::Ring, Case::AllReduce),
    (Algorithm::Tree, Case::AllReduce),
    (Algorithm::Direct, Case::AllReduce),
    (Algorithm::TwoShot, Case::AllReduce),
    (Algorithm::Ring, Case::Broadcast),
    (Algorithm::Tree, Case::Broadcast),
    (Algorithm::Ring, Case::Reduce),
    (Algorithm::Tree, Case::Reduce),
    (Algorithm::Ring, Case::AllGather),
    (Algorithm::Ring, Case::ReduceScatter),
    (Algorithm::Ring, Case::AlltoAll),
    (Algorithm::Ring, Case::Gather),
    (Algorithm::Ring, Case::Scatter),
    (Algorithm::Ring, Case::SendRecv),
];

/// What rank `r` of `n` calls in one group for a case: the collective twice (slots and
/// flags reused), or a send to the next rank and a receive from the previous one. Roots
/// move with the count (and the algorithm), so every rank gets to be one.
fn colls(case: Case, algo: Algorithm, r: usize, n: usize, count: usize) -> Vec<Collective> {
    let root = (count + (algo == Algorithm::Tree) as usize) % n;
    let one = match case {
        Case::AllReduce => Collective::AllReduce { count },
        Case::Broadcast => Collective::Broadcast { count, root },
        Case::Reduce => Collective::Reduce { count, root },
        Case::AllGather => Collective::AllGather { count },
        Case::ReduceScatter => Collective::ReduceScatter { count },
        Case::AlltoAll => Collective::AlltoAll { count },
        Case::Gather => Collective::Gather { count, root },
        Case::Scatter => Collective::Scatter { count, root },
        Case::SendRecv => {
            return vec![
                Collective::Send {
                    peer: (r + 1) % n,
                    count,
                },
                Collective::Recv {
                    peer: (r + n - 1) % n,
                    count,
                },
            ]
        }
    };
    vec![one; 2]
}

type PeerView<'a> = Box<dyn Fn(usize, u64, usize) -> Option<u64> + 'a>;

/// Every collective, in place and out of place, with registered buffers read in place by
/// peers (randomly chosen registrations and described pairs): the same bytes as the staged
/// programs give, no rank overwrites what a peer has yet to read, no deadlock, flags
/// restored.
#[test]
fn registered_buffers_read_in_place_give_the_staged_results() {
    let slot_bytes = 24;
    let mut rng = Rng(0x5eed_1234_abcd);
    let mut direct_reads = 0usize;
    for n in 1..=5usize {
        for &(algo, case) in CASES.iter() {
            let p2p = case == Case::SendRecv;
            if p2p && n == 1 {
                continue;
            }
            for in_place in [false, true] {
                if p2p && in_place {
                    continue;
                }
                for count in [0usize, 1, 7, 33] {
                    for scaled in [false, true] {
                        let reduction = Reduction {
                            reducer: Reducer::new(DataType::Float32, ReduceOp::Sum),
                            input_scale: scaled
                                .then(|| Scale::from_bytes(DataType::Float32, &3f32.to_ne_bytes())),
                            input_scale_at: None,
                            divide_by: None,
                        };
                        let setups: Vec<Setup> = (0..n)
                            .map(|r| {
                                setup(
                                    &colls(case, algo, r, n, count),
                                    algo,
                                    r,
                                    n,
                                    in_place,
                                    slot_bytes,
                                    Some(reduction),
                                    (r * 131 + count) as u64,
                                )
                            })
                            .collect();
                        let staged: Vec<Links> = (0..n).map(|_| Links::staged(n)).collect();
                        let want = run_all(&setups, &staged, slot_bytes);
                        for _trial in 0..3 {
                            // Which pairs are described, and which buffers each rank
                            // registered (a random subset of its operations' buffers).
                            let described: Vec<Vec<bool>> = (0..n)
                                .map(|_| (0..n).map(|_| rng.coin()).collect())
                                .collect();
                            let registered: Vec<Vec<(u64, u64)>> = setups
                                .iter()
                                .map(|s| {
                                    let mut regs = Vec::new();
                                    for b in &s.bufs {
                                        if rng.coin() {
                                            regs.push((b.send.min(b.recv), b.scratch));
                                        }
                                    }
                                    regs
                                })
                                .collect();
                            let counter = std::cell::Cell::new(0usize);
                            let views: Vec<PeerView> = registered
                                .iter()
                                .map(|regs| {
                                    let regs = regs.clone();
                                    let counter = &counter;
                                    Box::new(move |_peer: usize, a: u64, len: usize| {
                                        let hit = regs
                                            .iter()
                                            .any(|&(lo, hi)| a >= lo && a + len as u64 <= hi);
                                        hit.then(|| {
                                            counter.set(counter.get() + 1);
                                            a
                                        })
                                    }) as PeerView
                                })
                                .collect();
                            let links: Vec<Links> = (0..n)
                                .map(|r| Links {
                                    describe_to: (0..n).map(|p| described[r][p]).collect(),
                                    described_from: (0..n).map(|p| described[p][r]).collect(),
                                    peer_view: &*views[r],
                                })
                                .collect();
                            let got = run_all(&setups, &links, slot_bytes);
                            for r in 0..n {
                                assert!(
                                    got[r] == want[r],
                                    "{algo:?} {case:?} n={n} count={count} in_place={in_place} scaled={scaled}: rank {r} differs from the staged run"
                                );
                            }
                            direct_reads += counter.get();
                        }
                    }
                }
            }
        }
    }
    // The registered path must actually have been taken, and often.
    assert!(
        direct_reads > 1000,
        "only {direct_reads} messages were read in place"
    );
}

/// Point-to-point in a group, sends and receives in opposite orders on the two sides and
/// many slices long: interleaving keeps the in-order programs from deadlocking.
#[test]
fn grouped_sendrecv_programs_exchange_without_deadlock() {
    let (n, count, slot_bytes) = (2usize, 40usize, 8usize);
    let setups: Vec<Setup> = (0..n)
        .map(|r| {
            let peer = 1 - r;
            let mut colls = vec![
                Collective::Send { peer, count },
                Collective::Recv { peer, count },
            ];
            if r == 1 {
                colls.reverse();
            }
            setup(
                &colls,
                Algorithm::Ring,
                r,
                n,
                false,
                slot_bytes,
                None,
                3 + r as u64,
            )
        })
        .collect();
    let links: Vec<Links> = (0..n).map(|_| Links::staged(n)).collect();
    let mems = run_all(&setups, &links, slot_bytes);
    // Rank 1 issued its receive first: op 0 is the receive there.
    let (s0, r0) = (
        setups[0].bufs[0].send as usize,
        setups[0].bufs[1].recv as usize,
    );
    let (s1, r1) = (
        setups[1].bufs[1].send as usize,
        setups[1].bufs[0].recv as usize,
    );
    assert_eq!(
        mems[0][r0..r0 + count * 4],
        setups[1].mem[s1..s1 + count * 4]
    );
    assert_eq!(
        mems[1][r1..r1 + count * 4],
        setups[0].mem[s0..s0 + count * 4]
    );
}

#[test]
fn oversized_messages_are_refused() {
    let s = setup(
        &[Collective::Send { peer: 1, count: 16 }],
        Algorithm::Ring,
        0,
        2,
        false,
        64,
        None,
        1,
    );
    assert!(compile(&s.ops, &s.bufs, 0, 2, SLOTS, 32, &Links::staged(2)).is_err());
}

/// Point-to-point calls and all-reduces in one group, interleaved differently on different
/// ranks (a send before the all-reduce and the receive after it, or the reverse), and a ring
/// whose every rank receives before it sends: each receive gets its sender's bytes and each
/// all-reduce the exact sums, one slice or many.
#[test]
fn groups_mixing_sendrecv_and_collectives_match_each_kind_alike() {
    let slot_bytes = 16;
    let red = Reduction {
        reducer: Reducer::new(DataType::Float32, ReduceOp::Sum),
        input_scale: None,
        input_scale_at: None,
        divide_by: None,
    };
    for n in [2usize, 3] {
        for count in [1usize, 4, 40] {
            for orders in [
                &["SAR"][..],
                &["RAS"],
                &["ARS", "SRA"],
                &["SAR", "RSA", "ASR"],
                &["RS"],
            ] {
                let order = |r: usize| orders[r % orders.len()];
                let setups: Vec<Setup> = (0..n)
                    .map(|r| {
                        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                        let colls: Vec<Collective> = (order(r).chars())
                            .map(|c| match c {
                                'S' => Collective::Send { peer: next, count },
                                'R' => Collective::Recv { peer: prev, count },
                                _ => Collective::AllReduce { count },
                            })
                            .collect();
                        let s = Some(red);
                        setup(
                            &colls,
                            Algorithm::Ring,
                            r,
                            n,
                            false,
                            slot_bytes,
                            s,
                            11 + r as u64,
                        )
                    })
                    .collect();
                let links: Vec<Links> = (0..n).map(|_| Links::staged(n)).collect();
                let mems = run_all(&setups, &links, slot_bytes);
                let at = |r: usize, c: char| order(r).find(c);
                let bytes = count * 4;
                let sum: Vec<f32> = (0..count)
                    .map(|e| {
                        (0..n)
                            .filter_map(|r| {
                                let a = setups[r].bufs[at(r, 'A')?].send as usize + e * 4;
                                Some(f32s(&setups[r].mem[a..a + 4])[0])
                            })
                            .sum()
                    })
                    .collect();
                for r in 0..n {
                    let prev = (r + n - 1) % n;
                    let got = setups[r].bufs[at(r, 'R').unwrap()].recv as usize;
                    let sent = setups[prev].bufs[at(prev, 'S').unwrap()].send as usize;
                    assert_eq!(
                        mems[r][got..got + bytes],
                        setups[prev].mem[sent..sent + bytes],
                        "{n} ranks, {count} elements, rank {r} ({}): the receive",
                        order(r)
                    );
                    let Some(a) = at(r, 'A') else {
                        continue;
                    };
                    let ar = setups[r].bufs[a].recv as usize;
                    assert_eq!(
                        f32s(&mems[r][ar..ar + bytes]),
                        sum,
                        "{n} ranks, {count} elements, rank {r} ({}): the all-reduce",
                        order(r)
                    );
                }
            }
        }
    }
}
