//! Ring and chain schedules: bandwidth-optimal for large messages. Each rank talks only to its
//! ring neighbours, and every chunk is cut into slices so that a rank forwards slice j while
//! its neighbour is still busy with slice j+1.

use super::{interleave, partition, Buf, Operand, Region, Schedule, Shape, Step};

/// Reduce-scatter around the ring, then all-gather around it. After the first phase rank r holds
/// the final value of chunk r+1; the second phase passes the final chunks on.
///
/// The last reduce-scatter step and the first all-gather step go slice by slice together:
/// each slice is sent on right after its final value is folded, while it is still in cache,
/// and a transport can send it while it folds (`Reply::next`).
/// The smallest all-reduce (bytes) that `fuses`.
pub(crate) const FUSE_FROM: usize = 32 << 20;

/// Whether a two-rank all-reduce out of place sends each slice's final value back right after
/// folding it, slice by slice, instead of all folds first: then the value is the very next
/// message to the peer, which a transport may send as it folds (`Reply::next`; shm writes it
/// into the FIFO's slots and into the receive buffer with non-temporal stores). That pays off
/// only where the buffers are too large to stay in cache: two processes on a machine with a
/// large shared L3, against all folds first, 64 MiB 0.88-0.93x the time, 32 MiB 0.93x,
/// 128 MiB 0.85x, but 16 MiB 1.26x and 4 MiB 1.23x slower (the ranks then go in lockstep, one
/// slice at a time). In place the folded bytes are written back instead (`Offer::reply_at`)
/// and the order stays, as it does between two hosts, where nothing forwards and the lockstep
/// would add a round trip per slice. Between processes of one host shm now writes the folded
/// bytes back out of place too (the sends offer the receive buffer), which leaves forwarding
/// to sends that offer no place; with the write-back, fused and unfused 32-64 MiB measured the
/// same (two processes pinned, 4 alternating runs each).
fn fuses(shape: &Shape, bytes: usize) -> bool {
    shape.nranks == 2 && !shape.in_place && shape.hosts.is_none() && bytes >= FUSE_FROM
}

pub(crate) fn all_reduce(count: usize, shape: &Shape) -> Schedule {
    let (n, e) = (shape.nranks, shape.elem);
    let mut s = Schedule::default();
    if n == 1 {
        return Schedule::local_copy(count * e);
    }
    let chunks = partition(count, n);
    let chunk = |buf, c: usize| shape.slices(buf, chunks[c].0 * e, chunks[c].1 * e);
    let mut phases = Vec::with_capacity(2 * (n - 1));
    for step in 0..n - 1 {
        let send_c = shape.rel(-(step as isize));
        let recv_c = shape.rel(-(step as isize) - 1);
        let src_buf = if step == 0 { Buf::Send } else { Buf::Recv };
        let sends = chunk(src_buf, send_c).into_iter().map(|r| Step::Send {
            peer: shape.next(),
            src: Operand {
                region: r,
                input: step == 0,
            },
        });
        let recvs = chunk(Buf::Recv, recv_c)
            .into_iter()
            .zip(chunk(Buf::Send, recv_c))
            .map(|(dst, mine)| Step::Recv {
                peer: shape.prev(),
                dst,
                reduce_with: Some(Operand::input(mine)),
                last: step == n - 2,
            });
        phases.push((sends.collect::<Vec<_>>(), recvs.collect::<Vec<_>>()));
    }
    for step in 0..n - 1 {
        let send_c = shape.rel(1 - step as isize);
        let recv_c = shape.rel(-(step as isize));
        let sends = chunk(Buf::Recv, send_c).into_iter().map(|r| Step::Send {
            peer: shape.next(),
            src: Operand::partial(r),
        });
        let recvs = chunk(Buf::Recv, recv_c).into_iter().map(|dst| Step::Recv {
            peer: shape.prev(),
            dst,
            reduce_with: None,
            last: false,
        });
        phases.push((sends.collect(), recvs.collect()));
    }
    if !fuses(shape, count * e) {
        for (sends, recvs) in phases {
            interleave(&mut s, sends.into_iter(), recvs.into_iter());
        }
        return s;
    }
    // Phase 0, the only fold, and phase 1, the pass-on, go together: one slice of each of the
    // four step lists in turn.
    let mut phases = phases.into_iter();
    let (fold_sends, folds) = phases.next().expect("the reduce-scatter step");
    let (pass_sends, pass_recvs) = phases.next().expect("the all-gather step");
    let mut lists = [fold_sends, folds, pass_sends, pass_recvs].map(|v| v.into_iter());
    loop {
        let mut any = false;
        for step in lists.iter_mut().filter_map(|l| l.next()) {
            s.push(step);
            any = true;
        }
        if !any {
            break;
        }
    }
    for (sends, recvs) in phases {
        interleave(&mut s, sends.into_iter(), recvs.into_iter());
    }
    s
}

/// Each rank forwards its own block, then every block it receives, to the next rank.
pub(crate) fn all_gather(count: usize, shape: &Shape) -> Schedule {
    let (n, bytes) = (shape.nranks, count * shape.elem);
    let mut s = Schedule::default();
    s.own_block(shape, bytes);
    for step in 0..n.saturating_sub(1) {
        let send_b = shape.rel(-(step as isize));
        let recv_b = shape.rel(-(step as isize) - 1);
        let src = if step == 0 {
            shape.slices(Buf::Send, 0, bytes)
        } else {
            shape.slices(Buf::Recv, send_b * bytes, bytes)
        };
        let sends = src.into_iter().map(|r| Step::Send {
            peer: shape.next(),
            src: Operand::partial(r),
        });
        let recvs = shape
            .slices(Buf::Recv, recv_b * bytes, bytes)
            .into_iter()
            .map(|dst| Step::Recv {
                peer: shape.prev(),
                dst,
                reduce_with: None,
                last: false,
            });
        interleave(&mut s, sends, recvs);
    }
    s
}

/// Partial sums travel around the ring through two alternating scratch chunks; the last hop
/// lands each chunk, complete, in its owner's receive buffer.
pub(crate) fn reduce_scatter(count: usize, shape: &Shape) -> Schedule {
    let (n, bytes) = (shape.nranks, count * shape.elem);
    let mut s = Schedule::default();
    if n == 1 {
        return Schedule::local_copy(bytes);
    }
    s.scratch = 2 * bytes;
    let scratch = |step: usize| Region::new(Buf::Scratch, (step % 2) * bytes, bytes);
    for step in 0..n - 1 {
        let send_c = shape.rel(-(step as isize) - 1);
        let recv_c = shape.rel(-(step as isize) - 2);
        let src = if step == 0 {
            shape.slices(Buf::Send, send_c * bytes, bytes)
        } else {
            let r = scratch(step - 1);
            shape.slices(Buf::Scratch, r.offset, bytes)
        };
        let sends = src.into_iter().map(|r| Step::Send {
            peer: shape.next(),
            src: Operand {
                region: r,
                input: step == 0,
            },
        });
        let last = step == n - 2;
        let dst = if last {
            shape.slices(Buf::Recv, 0, bytes)
        } else {
            shape.slices(Buf::Scratch, scratch(step).offset, bytes)
        };
        let recvs = dst
            .into_iter()
            .zip(shape.slices(Buf::Send, recv_c * bytes, bytes))
            .map(|(dst, mine)| Step::Recv {
                peer: shape.prev(),
                dst,
                reduce_with: Some(Operand::input(mine)),
                last,
            });
        interleave(&mut s, sends, recvs);
    }
    s
}

/// A pipelined chain from the root around the ring (see `Shape::chain_from`).
pub(crate) fn broadcast(count: usize, root: usize, shape: &Shape) -> Schedule {
    let (n, bytes) = (shape.nranks, count * shape.elem);
    let mut s = Schedule::default();
    let chain = shape.chain_from(root);
    let pos = chain.iter().position(|&r| r == shape.rank).unwrap_or(0);
    let next = chain.get(pos + 1).copied();
    if pos == 0 {
        // In place the root's input already is its output (NCCL allows no other overlap).
        if !shape.in_place {
            s.push(Step::Local {
                dst: Region::new(Buf::Recv, 0, bytes),
                a: Operand::partial(Region::new(Buf::Send, 0, bytes)),
                b: None,
                last: false,
            });
        }
        if let Some(next) = next {
            for r in shape.slices(Buf::Send, 0, bytes) {
                s.push(Step::Send {
                    peer: next,
                    src: Operand::partial(r),
                });
            }
        }
        return s;
    }
    for dst in shape.slices(Buf::Recv, 0, bytes) {
        s.push(Step::Recv {
            peer: chain[pos - 1],
            dst,
            reduce_with: None,
            last: false,
        });
        if let Some(next) = next.filter(|_| pos < n - 1) {
            s.push(Step::Send {
                peer: next,
                src: Operand::partial(dst),
            });
        }
    }
    s
}

/// A pipelined chain that ends at the root, each rank adding its input: the broadcast's chain
/// run backwards.
pub(crate) fn reduce(count: usize, root: usize, shape: &Shape) -> Schedule {
    let (n, bytes) = (shape.nranks, count * shape.elem);
    let mut s = Schedule::default();
    if n == 1 {
        return Schedule::local_copy(bytes);
    }
    let mut chain = shape.chain_from(root);
    chain.reverse();
    // Position along the chain: the first sender is 0, the root is last.
    let pos = chain.iter().position(|&r| r == shape.rank).unwrap_or(0);
    if pos == 0 {
        for r in shape.slices(Buf::Send, 0, bytes) {
            s.push(Step::Send {
                peer: chain[1],
                src: Operand::input(r),
            });
        }
        return s;
    }
    let is_root = pos == n - 1;
    if !is_root {
        s.scratch = bytes;
    }
    let dst_buf = if is_root { Buf::Recv } else { Buf::Scratch };
    for (dst, mine) in shape
        .slices(dst_buf, 0, bytes)
        .into_iter()
        .zip(shape.slices(Buf::Send, 0, bytes))
    {
        s.push(Step::Recv {
            peer: chain[pos - 1],
            dst,
            reduce_with: Some(Operand::input(mine)),
            last: is_root,
        });
        if !is_root {
            s.push(Step::Send {
                peer: chain[pos + 1],
                src: Operand::partial(dst),
            });
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::super::sim;

    #[test]
    fn rings_in_host_order_compute_the_reference_result() {
        // Ranks of two and three hosts numbered round-robin, as a launcher may number them,
        // and a reversed ring.
        let by_host =
            |hosts: &[u32]| super::super::RingOrder::by_host(hosts).map(|o| o.ranks().to_vec());
        assert_eq!(by_host(&[0, 1, 0, 1]), Some(vec![0, 2, 1, 3]));
        assert_eq!(by_host(&[7, 3, 3, 7, 9, 3]), Some(vec![0, 3, 1, 2, 5, 4]));
        assert_eq!(by_host(&[7, 7, 3, 3]), None, "hosts already contiguous");
        let orders: Vec<Vec<usize>> = vec![
            vec![0, 2, 1, 3],
            vec![0, 3, 1, 4, 2, 5],
            vec![4, 3, 2, 1, 0],
            vec![2, 0, 1],
        ];
        for order in orders {
            let n = order.len();
            sim::with_ring(order, || {
                for count in [0, 1, 5, 13, 64] {
                    for slice_elems in [1, 3, 1000] {
                        let ring = super::super::Algorithm::Ring;
                        sim::check_all_reduce(n, count, slice_elems, ring);
                        sim::check_all_reduce(
                            n,
                            count,
                            slice_elems,
                            super::super::Algorithm::Direct,
                        );
                        sim::check_all_gather(n, count, slice_elems, ring);
                        sim::check_reduce_scatter(n, count, slice_elems, ring);
                        sim::check_all_to_all(n, count, false, slice_elems);
                        for root in 0..n {
                            sim::check_broadcast(n, count, root, slice_elems, ring);
                            sim::check_reduce(n, count, root, slice_elems, ring);
                        }
                    }
                }
            });
        }
    }

    /// Broadcast and reduce chains enter each host but the root's once, with rings in host
    /// order or in rank order, and still compute the reference result.
    #[test]
    fn chains_on_several_hosts_enter_each_host_once() {
        use super::super::{HostLayout, RingOrder, Shape};
        let layouts: [&[usize]; 3] = [&[0, 1, 0, 1], &[0, 0, 1, 1, 2, 2], &[2, 0, 1, 2, 0, 1, 1]];
        for hosts in layouts {
            let n = hosts.len();
            let distinct = hosts.iter().collect::<std::collections::HashSet<_>>().len();
            for by_host in [true, false] {
                let ring = by_host.then(|| RingOrder::by_host(hosts)).flatten();
                for root in 0..n {
                    let shape = Shape {
                        rank: 0,
                        nranks: n,
                        elem: 8,
                        in_place: false,
                        slice_bytes: 64,
                        ring: ring.clone(),
                        hosts: HostLayout::new(hosts, 0),
                    };
                    let chain = shape.chain_from(root);
                    assert_eq!(chain[0], root);
                    let mut sorted = chain.clone();
                    sorted.sort();
                    assert_eq!(sorted, (0..n).collect::<Vec<_>>());
                    let crossings = chain.windows(2).filter(|w| hosts[w[0]] != hosts[w[1]]);
                    assert_eq!(crossings.count(), distinct - 1, "{hosts:?} root {root}");
                }
                let order = ring.map_or((0..n).collect(), |o| o.ranks().to_vec());
                sim::with_ring(order, || {
                    sim::with_hosts(hosts.to_vec(), 0, || {
                        for count in [0, 1, 13] {
                            for root in 0..n {
                                let ring = super::super::Algorithm::Ring;
                                sim::check_broadcast(n, count, root, 4, ring);
                                sim::check_reduce(n, count, root, 4, ring);
                            }
                        }
                    })
                });
            }
        }
    }

    /// From `FUSE_FROM` on, two ranks out of place send each folded slice back right after
    /// folding it (the step after the fold sends exactly its destination), and the result is
    /// still the reference one, with unbounded and with two-slot channels. In place and below
    /// the size, all folds come first.
    #[test]
    fn two_ranks_pass_each_folded_slice_on_before_the_next_fold_from_the_fusing_size() {
        use super::super::{Buf, HostLayout, Shape, Step};
        let fused_count = super::FUSE_FROM / 8 + 3;
        let slice_bytes = 1 << 20;
        for (count, in_place, nranks, two_hosts, fused) in [
            (fused_count, false, 2, false, true),
            (fused_count, true, 2, false, false),
            (fused_count, false, 3, false, false),
            (fused_count, false, 2, true, false),
            (fused_count - 6, false, 2, false, false),
        ] {
            let shape = Shape {
                rank: 1,
                nranks,
                elem: 8,
                in_place,
                slice_bytes,
                ring: None,
                hosts: two_hosts.then(|| HostLayout::new(&[0, 1], 0)).flatten(),
            };
            let steps = super::all_reduce(count, &shape).steps;
            // Step k + 1 after a fold: does it send the fold's destination on?
            let passed_on = |k: usize| match (&steps[k], steps.get(k + 1)) {
                (
                    Step::Recv {
                        dst,
                        reduce_with: Some(_),
                        ..
                    },
                    Some(Step::Send { src, .. }),
                ) => src.region == *dst,
                _ => false,
            };
            let folds: Vec<usize> = (0..steps.len())
                .filter(|&k| {
                    matches!(
                        steps[k],
                        Step::Recv {
                            reduce_with: Some(_),
                            ..
                        }
                    )
                })
                .collect();
            let what =
                format!("count {count} in_place {in_place} nranks {nranks} two_hosts {two_hosts}");
            assert!(folds.len() >= 4, "{what}: {} folds", folds.len());
            if fused {
                assert!(folds.iter().all(|&k| passed_on(k)), "{what}");
                let k = folds[1];
                assert!(
                    matches!(&steps[k - 1], Step::Send { src, .. } if src.region.buf == Buf::Send)
                );
            } else {
                assert!(folds.iter().all(|&k| !passed_on(k)), "{what}");
            }
        }
        for slice_elems in [1 << 17, (1 << 17) + 1] {
            sim::check_all_reduce(2, fused_count, slice_elems, super::super::Algorithm::Ring);
        }
    }

    #[test]
    fn ring_collectives_compute_the_reference_result() {
        for n in 1..=6 {
            for count in [0, 1, 5, 13, 64] {
                for slice_elems in [1, 3, 1000] {
                    sim::check_all_reduce(n, count, slice_elems, super::super::Algorithm::Ring);
                    sim::check_all_gather(n, count, slice_elems, super::super::Algorithm::Ring);
                    sim::check_reduce_scatter(n, count, slice_elems, super::super::Algorithm::Ring);
                    for root in 0..n {
                        sim::check_broadcast(
                            n,
                            count,
                            root,
                            slice_elems,
                            super::super::Algorithm::Ring,
                        );
                        sim::check_reduce(
                            n,
                            count,
                            root,
                            slice_elems,
                            super::super::Algorithm::Ring,
                        );
                    }
                }
            }
        }
    }
}
