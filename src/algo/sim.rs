//! A reference interpreter for schedules, used by the algorithm tests: every rank runs its steps
//! in list order over i64 elements, and inputs are scaled by a per-rank factor so that a schedule
//! that counts an input twice (or never) is caught. Each check runs twice: with unbounded
//! message queues, and with every channel holding at most SLOTS undelivered messages (a sender
//! then waits), the way a GPU stream runs a schedule: strictly in order, with a few slots per
//! peer. A schedule that deadlocks there cannot run on the device executor.

use super::{schedule, Algorithm, Buf, Collective, Operand, Region, Shape, Step};
use std::collections::{HashMap, VecDeque};

const E: usize = 8;

/// Message slots per channel in the bounded run (the device executor's default).
const SLOTS: usize = 2;

thread_local! {
    static BOUNDED: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// The ring order the checks run with (None: rank order); see `with_ring`.
    static RING: std::cell::RefCell<Option<Vec<usize>>> = const { std::cell::RefCell::new(None) };
    /// Each rank's host and the layout's `direct_max` (None: one host); see `with_hosts`.
    static HOSTS: std::cell::RefCell<Option<(Vec<usize>, usize)>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs the checks in `f` with rank r on host `host_of[r]`.
pub(crate) fn with_hosts(host_of: Vec<usize>, direct_max: usize, f: impl FnOnce()) {
    HOSTS.with(|h| *h.borrow_mut() = Some((host_of, direct_max)));
    f();
    HOSTS.with(|h| *h.borrow_mut() = None);
}

/// Runs the checks in `f` with rings that visit the ranks in `order`.
pub(crate) fn with_ring(order: Vec<usize>, f: impl FnOnce()) {
    RING.with(|r| *r.borrow_mut() = Some(order));
    f();
    RING.with(|r| *r.borrow_mut() = None);
}

struct Rank {
    mem: Vec<i64>,
    send_base: usize,
    recv_base: usize,
    scratch_base: usize,
    scale: i64,
}

impl Rank {
    fn at(&self, r: Region) -> std::ops::Range<usize> {
        let base = match r.buf {
            Buf::Send => self.send_base,
            Buf::Recv => self.recv_base,
            Buf::Scratch => self.scratch_base,
        };
        assert_eq!(r.offset % E, 0);
        assert_eq!(r.len % E, 0);
        base + r.offset / E..base + (r.offset + r.len) / E
    }

    fn read(&self, op: Operand) -> Vec<i64> {
        let f = if op.input { self.scale } else { 1 };
        self.mem[self.at(op.region)]
            .iter()
            .map(|v| v.wrapping_mul(f))
            .collect()
    }
}

/// Runs `coll` on n ranks. `layout(rank)` gives (memory size, send base, recv base) in elements;
/// scratch goes after. Returns each rank's memory.
fn run_once(
    n: usize,
    coll: &impl Fn(usize) -> Collective,
    slice_elems: usize,
    algo: Algorithm,
    in_place: bool,
    init: &impl Fn(usize) -> (Vec<i64>, usize, usize),
) -> Vec<Vec<i64>> {
    let mut ranks = Vec::new();
    let mut plans = Vec::new();
    for r in 0..n {
        let shape = Shape {
            rank: r,
            nranks: n,
            elem: E,
            in_place,
            slice_bytes: slice_elems * E,
            ring: RING.with(|o| o.borrow().clone().and_then(super::RingOrder::new)),
            hosts: HOSTS.with(|h| {
                h.borrow()
                    .as_ref()
                    .and_then(|(of, max)| super::HostLayout::new(of, *max))
            }),
        };
        let sched = schedule(&coll(r), &shape, algo);
        let (mut mem, send_base, recv_base) = init(r);
        let scratch_base = mem.len();
        mem.resize(mem.len() + sched.scratch / E, -777);
        ranks.push(Rank {
            mem,
            send_base,
            recv_base,
            scratch_base,
            scale: r as i64 + 2,
        });
        plans.push(sched.steps);
    }
    let mut queues: HashMap<(usize, usize), VecDeque<Vec<i64>>> = HashMap::new();
    let mut pc = vec![0usize; n];
    loop {
        let mut moved = false;
        for r in 0..n {
            while pc[r] < plans[r].len() {
                let rank = &mut ranks[r];
                match plans[r][pc[r]] {
                    Step::Send { peer, src } => {
                        let q = queues.entry((r, peer)).or_default();
                        if BOUNDED.with(|b| b.get()).is_some_and(|k| q.len() >= k) {
                            break;
                        }
                        let data = rank.read(src);
                        queues.entry((r, peer)).or_default().push_back(data);
                    }
                    Step::Recv {
                        peer,
                        dst,
                        reduce_with,
                        ..
                    } => {
                        let Some(mut data) = queues.entry((peer, r)).or_default().pop_front()
                        else {
                            break;
                        };
                        assert_eq!(
                            data.len() * E,
                            dst.len,
                            "rank {r} got a message of the wrong size from {peer}"
                        );
                        if let Some(w) = reduce_with {
                            for (d, x) in data.iter_mut().zip(rank.read(w)) {
                                *d = d.wrapping_add(x);
                            }
                        }
                        let range = rank.at(dst);
                        rank.mem[range].copy_from_slice(&data);
                    }
                    Step::Local { dst, a, b, .. } => {
                        let mut data = rank.read(a);
                        if let Some(b) = b {
                            for (d, x) in data.iter_mut().zip(rank.read(b)) {
                                *d = d.wrapping_add(x);
                            }
                        }
                        let range = rank.at(dst);
                        rank.mem[range].copy_from_slice(&data);
                    }
                }
                pc[r] += 1;
                moved = true;
            }
        }
        if (0..n).all(|r| pc[r] == plans[r].len()) {
            break;
        }
        assert!(moved, "schedule deadlocks: positions {pc:?}");
    }
    assert!(
        queues.values().all(|q| q.is_empty()),
        "unreceived messages left"
    );
    ranks.into_iter().map(|r| r.mem).collect()
}

/// Runs the schedules unbounded and bounded; both must give the same memory.
fn run(
    n: usize,
    coll: impl Fn(usize) -> Collective,
    slice_elems: usize,
    algo: Algorithm,
    in_place: bool,
    init: impl Fn(usize) -> (Vec<i64>, usize, usize),
) -> Vec<Vec<i64>> {
    let free = run_once(n, &coll, slice_elems, algo, in_place, &init);
    BOUNDED.with(|b| b.set(Some(SLOTS)));
    let bounded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_once(n, &coll, slice_elems, algo, in_place, &init)
    }));
    BOUNDED.with(|b| b.set(None));
    let bounded = bounded.unwrap_or_else(|e| std::panic::resume_unwind(e));
    assert_eq!(free, bounded, "bounded and unbounded runs differ");
    free
}

fn value(rank: usize, i: usize) -> i64 {
    (rank as i64 + 1) * 1000 + i as i64
}

fn scaled_sum(n: usize, i: usize) -> i64 {
    (0..n).map(|r| value(r, i) * (r as i64 + 2)).sum()
}

pub(crate) fn check_all_reduce(n: usize, count: usize, slice_elems: usize, algo: Algorithm) {
    for in_place in [false, true] {
        let out = run(
            n,
            |_| Collective::AllReduce { count },
            slice_elems,
            algo,
            in_place,
            |r| {
                let mut mem: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
                if in_place {
                    (mem, 0, 0)
                } else {
                    mem.resize(2 * count, -1);
                    (mem, 0, count)
                }
            },
        );
        for (r, mem) in out.iter().enumerate() {
            let base = if in_place { 0 } else { count };
            for i in 0..count {
                assert_eq!(
                    mem[base + i],
                    scaled_sum(n, i),
                    "{algo:?} n={n} count={count} rank {r} elem {i} in_place={in_place}"
                );
            }
        }
    }
}

pub(crate) fn check_all_gather(n: usize, count: usize, slice_elems: usize, algo: Algorithm) {
    for in_place in [false, true] {
        let out = run(
            n,
            |_| Collective::AllGather { count },
            slice_elems,
            algo,
            in_place,
            |r| {
                let mut mem = vec![-1; n * count + if in_place { 0 } else { count }];
                let send_base = if in_place { r * count } else { n * count };
                for i in 0..count {
                    mem[send_base + i] = value(r, i);
                }
                (mem, send_base, 0)
            },
        );
        for mem in &out {
            for p in 0..n {
                for i in 0..count {
                    assert_eq!(
                        mem[p * count + i],
                        value(p, i),
                        "{algo:?} allgather n={n} count={count} in_place={in_place}"
                    );
                }
            }
        }
    }
}

pub(crate) fn check_reduce_scatter(n: usize, count: usize, slice_elems: usize, algo: Algorithm) {
    for in_place in [false, true] {
        let out = run(
            n,
            |_| Collective::ReduceScatter { count },
            slice_elems,
            algo,
            in_place,
            |r| {
                let mut mem: Vec<i64> = (0..n * count).map(|i| value(r, i)).collect();
                let recv_base = if in_place { r * count } else { n * count };
                if !in_place {
                    mem.resize(n * count + count, -1);
                }
                (mem, 0, recv_base)
            },
        );
        for (r, mem) in out.iter().enumerate() {
            let base = if in_place { r * count } else { n * count };
            for i in 0..count {
                assert_eq!(
                    mem[base + i],
                    scaled_sum(n, r * count + i),
                    "{algo:?} reduce_scatter n={n} count={count} rank {r} in_place={in_place}"
                );
            }
        }
    }
}

pub(crate) fn check_broadcast(
    n: usize,
    count: usize,
    root: usize,
    slice_elems: usize,
    algo: Algorithm,
) {
    let out = run(
        n,
        |_| Collective::Broadcast { count, root },
        slice_elems,
        algo,
        false,
        |r| {
            let mut mem = vec![-1; 2 * count];
            if r == root {
                for (i, m) in mem.iter_mut().take(count).enumerate() {
                    *m = value(r, i);
                }
            }
            (mem, 0, count)
        },
    );
    for mem in &out {
        for i in 0..count {
            assert_eq!(
                mem[count + i],
                value(root, i),
                "{algo:?} broadcast n={n} root={root}"
            );
        }
    }
}

pub(crate) fn check_reduce(
    n: usize,
    count: usize,
    root: usize,
    slice_elems: usize,
    algo: Algorithm,
) {
    let out = run(
        n,
        |_| Collective::Reduce { count, root },
        slice_elems,
        algo,
        false,
        |r| {
            let mut mem: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
            mem.resize(2 * count, -1);
            (mem, 0, count)
        },
    );
    for i in 0..count {
        assert_eq!(
            out[root][count + i],
            scaled_sum(n, i),
            "{algo:?} reduce n={n} root={root}"
        );
    }
}

pub(crate) fn check_gather(n: usize, count: usize, root: usize, slice_elems: usize) {
    let out = run(
        n,
        |_| Collective::Gather { count, root },
        slice_elems,
        Algorithm::Direct,
        false,
        |r| {
            let mut mem = vec![-1; n * count + count];
            for i in 0..count {
                mem[n * count + i] = value(r, i);
            }
            (mem, n * count, 0)
        },
    );
    for p in 0..n {
        for i in 0..count {
            assert_eq!(out[root][p * count + i], value(p, i));
        }
    }
}

pub(crate) fn check_scatter(n: usize, count: usize, root: usize, slice_elems: usize) {
    let out = run(
        n,
        |_| Collective::Scatter { count, root },
        slice_elems,
        Algorithm::Direct,
        false,
        |r| {
            let mut mem: Vec<i64> = (0..n * count).map(|i| value(r, i)).collect();
            mem.resize(n * count + count, -1);
            (mem, 0, n * count)
        },
    );
    for (r, mem) in out.iter().enumerate() {
        for i in 0..count {
            assert_eq!(mem[n * count + i], value(root, r * count + i));
        }
    }
}

pub(crate) fn check_all_to_all(n: usize, count: usize, in_place: bool, slice_elems: usize) {
    let out = run(
        n,
        |_| Collective::AlltoAll { count },
        slice_elems,
        Algorithm::Ring,
        in_place,
        |r| {
            let mut mem: Vec<i64> = (0..n * count).map(|i| value(r, i)).collect();
            if in_place {
                (mem, 0, 0)
            } else {
                mem.resize(2 * n * count, -1);
                (mem, 0, n * count)
            }
        },
    );
    for (r, mem) in out.iter().enumerate() {
        let base = if in_place { 0 } else { n * count };
        for p in 0..n {
            for i in 0..count {
                assert_eq!(
                    mem[base + p * count + i],
                    value(p, r * count + i),
                    "alltoall n={n} in_place={in_place}"
                );
            }
        }
    }
}
