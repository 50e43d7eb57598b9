//! Direct schedules: every rank talks to every other rank (or to the root) at once. Best when
//! latency dominates: small all-reduces, gather and scatter.

use super::{Buf, Operand, Region, Schedule, Shape, Step};

/// One-shot all-reduce: every rank sends its input to every other rank and adds up all inputs
/// itself. Contributions are combined in rank order on every rank, so all ranks get the same
/// bits even for floating point. The running sum lives in scratch, so the caller's input stays
/// intact until the last step, whether or not the buffers overlap.
pub fn all_reduce(count: usize, shape: &Shape) -> Schedule {
    let (n, bytes) = (shape.nranks, count * shape.elem);
    let mut s = Schedule::default();
    if n == 1 {
        s.push(Step::Local {
            dst: Region::new(Buf::Recv, 0, bytes),
            a: Operand::input(Region::new(Buf::Send, 0, bytes)),
            b: None,
            last: true,
        });
        return s;
    }
    s.scratch = bytes;
    for input in shape.slices(Buf::Send, 0, bytes) {
        let input = Operand::input(input);
        let out = Region::new(Buf::Recv, input.region.offset, input.region.len);
        let acc = Region::new(Buf::Scratch, input.region.offset, input.region.len);
        for k in 1..n {
            s.push(Step::Send {
                peer: shape.rel(k as isize),
                src: input,
            });
        }
        for q in 0..n {
            let last = q == n - 1;
            let dst = if last { out } else { acc };
            let prior = (q > 0).then_some(Operand::partial(acc));
            if q == shape.rank {
                let (a, b) = match prior {
                    Some(p) => (p, Some(input)),
                    None => (input, None),
                };
                s.push(Step::Local { dst, a, b, last });
            } else {
                s.push(Step::Recv {
                    peer: q,
                    dst,
                    reduce_with: prior,
                    last,
                });
            }
        }
    }
    s
}

/// Every rank sends its block to the root, which places block i at offset i.
pub fn gather(count: usize, root: usize, shape: &Shape) -> Schedule {
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
pub fn scatter(count: usize, root: usize, shape: &Shape) -> Schedule {
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
                    for root in 0..n {
                        sim::check_gather(n, count, root, slice_elems);
                        sim::check_scatter(n, count, root, slice_elems);
                    }
                }
            }
        }
    }
}
