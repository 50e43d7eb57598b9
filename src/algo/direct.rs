//! Direct schedules: every rank talks to every other rank (or to the root) at once. Best when
//! latency dominates: small all-reduces, gather and scatter.

use super::{Buf, Operand, Region, Schedule, Shape, Step};

/// The largest in-place one-shot all-reduce that folds straight into its input (see
/// `all_reduce`): below the smallest size from which a peer reads a folded message from the
/// sender's buffer (`shm::pull::PULL_FROM_THREAD`, between threads of one process).
const IN_PLACE_OVER_INPUT: usize = 16 << 10;

/// One-shot all-reduce: every rank sends its input to every other rank and adds up all inputs
/// itself. Contributions are combined in rank order on every rank, so all ranks get the same
/// bits even for floating point. Partial sums live in scratch.
///
/// In place, the last step overwrites the input that this rank's sends read. Up to
/// `IN_PLACE_OVER_INPUT` bytes the sends have copied it out (into the peers' FIFOs) by the time
/// they complete, and the last step writes the sum straight over the input once they have.
/// A larger message is read by each peer straight from the sender's buffer, so that step
/// would wait for every peer's read, a round trip per slice: the sum lands in scratch and is
/// copied over the input once every send is done.
pub(crate) fn all_reduce(count: usize, shape: &Shape) -> Schedule {
    let (n, bytes) = (shape.nranks, count * shape.elem);
    let mut s = Schedule::default();
    if n == 1 {
        return Schedule::local_copy(bytes);
    }
    let through_scratch = shape.in_place && bytes > IN_PLACE_OVER_INPUT;
    s.scratch = if through_scratch { 2 * bytes } else { bytes };
    for input in shape.slices(Buf::Send, 0, bytes) {
        let input = Operand::input(input);
        let (off, len) = (input.region.offset, input.region.len);
        let out = Region::new(Buf::Recv, off, len);
        let acc = Region::new(Buf::Scratch, off, len);
        for k in 1..n {
            s.push(Step::Send {
                peer: shape.rel(k as isize),
                src: input,
            });
        }
        if through_scratch {
            // A send that read a copy instead would wait for the copy, a pass later.
            let sum = Region::new(Buf::Scratch, bytes + off, len);
            fold_in_rank_order(&mut s, shape.rank, n, &|q| q, input, acc, sum);
            s.push(Step::Local {
                dst: out,
                a: Operand::partial(sum),
                b: None,
                last: false,
            });
        } else {
            fold_in_rank_order(&mut s, shape.rank, n, &|q| q, input, acc, out);
        }
    }
    s
}

/// Appends the steps that combine every rank's contribution to one slice in rank order,
/// `((x0 (+) x1) (+) x2) ...`, so that every rank computing it gets the same bits: the others'
/// contributions arrive as messages, this rank's own is `input`. Partial results go to `acc`,
/// the final one to `out`. When this rank comes first, its input starts the chain where it is.
/// The contributors are `peer_of(0..n)`, this rank being `peer_of(me)`.
pub(super) fn fold_in_rank_order(
    s: &mut Schedule,
    me: usize,
    n: usize,
    peer_of: &dyn Fn(usize) -> usize,
    input: Operand,
    acc: Region,
    out: Region,
) {
    let mut prior: Option<Operand> = None;
    for q in 0..n {
        let last = q == n - 1;
        let dst = if last { out } else { acc };
        if q == me {
            if prior.is_none() && !last {
                prior = Some(input);
                continue;
            }
            let (a, b) = match prior {
                Some(p) => (p, Some(input)),
                None => (input, None),
            };
            s.push(Step::Local { dst, a, b, last });
        } else {
            s.push(Step::Recv {
                peer: peer_of(q),
                dst,
                reduce_with: prior,
                last,
            });
        }
        prior = Some(Operand::partial(acc));
    }
}

/// Two-shot all-reduce: rank p gathers part p of every input and reduces it (in rank order, so
/// the result does not depend on who computes it), then every rank gathers every reduced part.
/// Each element crosses the links twice, as in a ring, but in two hops instead of 2(n-1).
pub(crate) fn all_reduce_two_shot(count: usize, shape: &Shape) -> Schedule {
    let (n, e) = (shape.nranks, shape.elem);
    if n == 1 {
        return all_reduce(count, shape);
    }
    let mut s = Schedule::default();
    let parts: Vec<(usize, usize)> = super::partition(count, n)
        .into_iter()
        .map(|(at, len)| (at * e, len * e))
        .collect();
    let mine = parts[shape.rank];
    reduce_parts(&mut s, shape, &parts, mine.0);
    exchange_parts(&mut s, shape, &parts, Buf::Recv, mine.0);
    s
}

/// Direct all-gather: this rank's block goes to every other rank at once and every other
/// rank's block lands here, one hop however many ranks there are (a ring takes n-1). For
/// small blocks with more than two ranks, where hops, not bytes, cost the time.
pub(crate) fn all_gather(count: usize, shape: &Shape) -> Schedule {
    let (n, bytes) = (shape.nranks, count * shape.elem);
    let mut s = Schedule::default();
    s.own_block(shape, bytes);
    let parts: Vec<(usize, usize)> = (0..n).map(|p| (p * bytes, bytes)).collect();
    exchange_parts(&mut s, shape, &parts, Buf::Send, 0);
    s
}

/// Direct reduce-scatter: block p of this rank's input goes straight to rank p, and block
/// `rank` of every input is added up here in rank order: one hop instead of the ring's n-1.
pub(crate) fn reduce_scatter(count: usize, shape: &Shape) -> Schedule {
    let bytes = count * shape.elem;
    let mut s = Schedule::default();
    let parts: Vec<(usize, usize)> = (0..shape.nranks).map(|p| (p * bytes, bytes)).collect();
    reduce_parts(&mut s, shape, &parts, 0);
    s
}

/// Part p (`(offset, len)` in bytes of the send buffer) of this rank's input goes to rank p,
/// and part `rank` of every input is reduced here, in rank order, into the receive buffer at
/// `out`. One slice index at a time, so that every channel moves along together. Needs
/// scratch for one part.
fn reduce_parts(s: &mut Schedule, shape: &Shape, parts: &[(usize, usize)], out: usize) {
    let (n, me) = (shape.nranks, shape.rank);
    let mine = parts[me];
    s.scratch = s.scratch.max(mine.1);
    let outgoing: Vec<(usize, Vec<Region>)> = (1..n)
        .map(|k| {
            let to = shape.rel(k as isize);
            let (at, len) = parts[to];
            (to, shape.slices(Buf::Send, at, len))
        })
        .collect();
    let acc_slices = shape.slices(Buf::Scratch, 0, mine.1);
    let in_slices = shape.slices(Buf::Send, mine.0, mine.1);
    let rounds = outgoing
        .iter()
        .map(|(_, v)| v.len())
        .chain([acc_slices.len()])
        .max()
        .unwrap_or(0);
    for j in 0..rounds {
        for (to, slices) in &outgoing {
            if let Some(r) = slices.get(j) {
                s.push(Step::Send {
                    peer: *to,
                    src: Operand::input(*r),
                });
            }
        }
        let (Some(&slice), Some(&input)) = (acc_slices.get(j), in_slices.get(j)) else {
            continue;
        };
        let dst_final = Region::new(Buf::Recv, out + input.offset - mine.0, input.len);
        fold_in_rank_order(s, me, n, &|q| q, Operand::input(input), slice, dst_final);
    }
}

/// This rank's part, found in `from` at `at`, goes to every other rank, and every other
/// rank's part p lands in the receive buffer at `parts[p]`.
fn exchange_parts(s: &mut Schedule, shape: &Shape, parts: &[(usize, usize)], from: Buf, at: usize) {
    let len = parts[shape.rank].1;
    for k in 1..shape.nranks {
        let to = shape.rel(k as isize);
        let source = shape.rel(-(k as isize));
        let sends = shape.slices(from, at, len).into_iter().map(|r| Step::Send {
            peer: to,
            src: Operand::partial(r),
        });
        let (theirs_at, theirs_len) = parts[source];
        let recvs = shape
            .slices(Buf::Recv, theirs_at, theirs_len)
            .into_iter()
            .map(|dst| Step::Recv {
                peer: source,
                dst,
                reduce_with: None,
                last: false,
            });
        super::interleave(s, sends, recvs);
    }
}

/// Every rank sends its block to the root, which places block i at offset i.
pub(crate) fn gather(count: usize, root: usize, shape: &Shape) -> Schedule {
    let bytes = count * shape.elem;
    let mut s = Schedule::default();
    let mine = Operand::partial(Region::new(Buf::Send, 0, bytes));
    if shape.rank != root {
        for r in shape.slices(Buf::Send, 0, bytes) {
            s.push(Step::Send {
                peer: root,
                src: Operand::partial(r),
            });
        }
        return s;
    }
    for p in 0..shape.nranks {
        if p == root {
            s.push(Step::Local {
                dst: Region::new(Buf::Recv, p * bytes, bytes),
                a: mine,
                b: None,
                last: false,
            });
            continue;
        }
        for dst in shape.slices(Buf::Recv, p * bytes, bytes) {
            s.push(Step::Recv {
                peer: p,
                dst,
                reduce_with: None,
                last: false,
            });
        }
    }
    s
}

/// The root sends block i to rank i.
pub(crate) fn scatter(count: usize, root: usize, shape: &Shape) -> Schedule {
    let bytes = count * shape.elem;
    let mut s = Schedule::default();
    let out = Region::new(Buf::Recv, 0, bytes);
    if shape.rank != root {
        for dst in shape.slices(Buf::Recv, 0, bytes) {
            s.push(Step::Recv {
                peer: root,
                dst,
                reduce_with: None,
                last: false,
            });
        }
        return s;
    }
    for p in 0..shape.nranks {
        if p == root {
            s.push(Step::Local {
                dst: out,
                a: Operand::partial(Region::new(Buf::Send, p * bytes, bytes)),
                b: None,
                last: false,
            });
            continue;
        }
        for r in shape.slices(Buf::Send, p * bytes, bytes) {
            s.push(Step::Send {
                peer: p,
                src: Operand::partial(r),
            });
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::super::{sim, Algorithm};

    #[test]
    fn direct_collectives_compute_the_reference_result() {
        for n in 1..=6 {
            for count in [0, 1, 5, 13] {
                for slice_elems in [1, 4, 1000] {
                    sim::check_all_reduce(n, count, slice_elems, Algorithm::Direct);
                    sim::check_all_reduce(n, count, slice_elems, Algorithm::TwoShot);
                    sim::check_all_gather(n, count, slice_elems, Algorithm::Direct);
                    sim::check_reduce_scatter(n, count, slice_elems, Algorithm::Direct);
                    for root in 0..n {
                        sim::check_gather(n, count, root, slice_elems);
                        sim::check_scatter(n, count, root, slice_elems);
                    }
                }
            }
        }
    }

    /// In place, a one-shot all-reduce folds straight into its input up to
    /// IN_PLACE_OVER_INPUT bytes and through scratch beyond: both ways give the reference sum,
    /// at the bound and just past it, in one slice and in many.
    #[test]
    fn in_place_one_shot_sums_over_the_input_or_through_scratch() {
        let at_bound = super::IN_PLACE_OVER_INPUT / 8;
        for n in [2, 3] {
            for count in [at_bound, at_bound + 1] {
                for slice_elems in [at_bound / 3, 4 * at_bound] {
                    sim::check_all_reduce(n, count, slice_elems, Algorithm::Direct);
                }
            }
        }
        let shape = |in_place| super::Shape {
            rank: 0,
            nranks: 2,
            elem: 8,
            in_place,
            slice_bytes: 1 << 30,
            ring: None,
            hosts: None,
        };
        let small = super::all_reduce(at_bound, &shape(true));
        let large = super::all_reduce(at_bound + 1, &shape(true));
        assert_eq!(
            small.scratch,
            at_bound * 8,
            "no second scratch copy up to the bound"
        );
        assert_eq!(
            small.steps.len(),
            super::all_reduce(at_bound, &shape(false)).steps.len()
        );
        assert_eq!(
            large.scratch,
            2 * (at_bound + 1) * 8,
            "a sum in scratch past it"
        );
    }
}
