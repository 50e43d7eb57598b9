//! Hierarchical all-reduce for ranks spread over several hosts, each host holding the same
//! number of them: the links inside a host (shared memory) are fast and the ones between hosts
//! slow, so only one share of the data per rank leaves the host.
//!
//! With H hosts of L ranks each, local rank l of host h:
//! 1. reduce-scatter around the ring of the host's ranks: l ends with the host's sum of chunk
//!    (l + 1) mod L, one of L nearly equal chunks of the buffer;
//! 2. all-reduce of that chunk with the ranks of the same local index on the other hosts: a
//!    ring of the H hosts (reduce-scatter then all-gather of H parts of the chunk), or, for a
//!    chunk of up to `HostLayout::direct_max` bytes, one-shot (the chunk to every other host,
//!    every host's chunk combined in host order so that all get the same bits);
//! 3. all-gather around the host's ring, so that every rank has every chunk.
//!
//! Each host sends 2(H-1)/H of the buffer to the others in ring mode, the least an all-reduce
//! can send (a flat ring through all H*L ranks sends 2(HL-1)/HL), and the L ranks of a host
//! share that traffic, each on a connection of its own.

use super::direct::fold_in_rank_order;
use super::{interleave, partition, ring, Buf, Operand, Region, Schedule, Shape, Step};

pub(crate) fn all_reduce(count: usize, shape: &Shape) -> Schedule {
    let layout = match shape.hosts.as_deref() {
        Some(l) if l.per_host().is_some_and(|per| per > 1) => l,
        // Nothing to gain (one rank per host, or one host) or uneven hosts: a ring, whose
        // order already visits each host's ranks together.
        _ => return ring::all_reduce(count, shape),
    };
    let per = layout.per_host().unwrap_or(1);
    let hosts = layout.hosts();
    let e = shape.elem;
    let (h, l) = layout.place[shape.rank];
    let local = &layout.members[h];
    let (lnext, lprev) = (local[(l + 1) % per], local[(l + per - 1) % per]);
    let chunks = partition(count, per);
    let chunk = |buf, c: usize| shape.slices(buf, chunks[c].0 * e, chunks[c].1 * e);
    // Local index l + k, modulo L.
    let at = |k: isize| (l as isize + k).rem_euclid(per as isize) as usize;
    let mut s = Schedule::default();

    // 1. Reduce-scatter inside the host, as the first half of a ring all-reduce.
    for step in 0..per - 1 {
        let (send_c, recv_c) = (at(-(step as isize)), at(-(step as isize) - 1));
        let src_buf = if step == 0 { Buf::Send } else { Buf::Recv };
        let sends = chunk(src_buf, send_c).into_iter().map(|r| Step::Send {
            peer: lnext,
            src: Operand {
                region: r,
                input: step == 0,
            },
        });
        let recvs = chunk(Buf::Recv, recv_c)
            .into_iter()
            .zip(chunk(Buf::Send, recv_c))
            .map(|(dst, mine)| Step::Recv {
                peer: lprev,
                dst,
                reduce_with: Some(Operand::input(mine)),
                last: false,
            });
        interleave(&mut s, sends, recvs);
    }

    // 2. Across hosts, among the ranks with local index l.
    let mine = at(1);
    let (off, elems) = (chunks[mine].0 * e, chunks[mine].1);
    let across = |k: usize| layout.members[(h + k) % hosts][l];
    if elems * e <= layout.direct_max {
        across_one_shot(
            &mut s,
            shape,
            Region::new(Buf::Recv, off, elems * e),
            h,
            &|q| layout.members[q][l],
        );
    } else {
        let parts = partition(elems, hosts);
        let part = |c: usize| shape.slices(Buf::Recv, off + parts[c].0 * e, parts[c].1 * e);
        let hat = |k: isize| (h as isize + k).rem_euclid(hosts as isize) as usize;
        let (hnext, hprev) = (across(1), across(hosts - 1));
        for step in 0..hosts - 1 {
            let (send_c, recv_c) = (hat(-(step as isize)), hat(-(step as isize) - 1));
            let sends = part(send_c).into_iter().map(|r| Step::Send {
                peer: hnext,
                src: Operand::partial(r),
            });
            let recvs = part(recv_c).into_iter().map(|dst| Step::Recv {
                peer: hprev,
                dst,
                reduce_with: Some(Operand::partial(dst)),
                last: step == hosts - 2,
            });
            interleave(&mut s, sends, recvs);
        }
        for step in 0..hosts - 1 {
            let (send_c, recv_c) = (hat(1 - step as isize), hat(-(step as isize)));
            let sends = part(send_c).into_iter().map(|r| Step::Send {
                peer: hnext,
                src: Operand::partial(r),
            });
            let recvs = part(recv_c).into_iter().map(|dst| Step::Recv {
                peer: hprev,
                dst,
                reduce_with: None,
                last: false,
            });
            interleave(&mut s, sends, recvs);
        }
    }

    // 3. All-gather inside the host, as the second half of a ring all-reduce.
    for step in 0..per - 1 {
        let (send_c, recv_c) = (at(1 - step as isize), at(-(step as isize)));
        let sends = chunk(Buf::Recv, send_c).into_iter().map(|r| Step::Send {
            peer: lnext,
            src: Operand::partial(r),
        });
        let recvs = chunk(Buf::Recv, recv_c).into_iter().map(|dst| Step::Recv {
            peer: lprev,
            dst,
            reduce_with: None,
            last: false,
        });
        interleave(&mut s, sends, recvs);
    }
    s
}

/// Phase 2 for a small chunk: this host's sum of `chunk` to the matching rank of every other
/// host, and every host's sum combined here in host order. The chunk is sent from a copy in
/// scratch, since the final value overwrites it while peers may still be reading it.
fn across_one_shot(
    s: &mut Schedule,
    shape: &Shape,
    chunk: Region,
    me: usize,
    rank_on: &dyn Fn(usize) -> usize,
) {
    let hosts = shape.hosts.as_deref().map_or(1, |l| l.hosts());
    let bytes = chunk.len;
    s.scratch = s.scratch.max(2 * bytes);
    for slice in shape.slices(Buf::Recv, chunk.offset, bytes) {
        let rel = slice.offset - chunk.offset;
        let copy = Region::new(Buf::Scratch, rel, slice.len);
        let acc = Region::new(Buf::Scratch, bytes + rel, slice.len);
        s.push(Step::Local {
            dst: copy,
            a: Operand::partial(slice),
            b: None,
            last: false,
        });
        for k in 1..hosts {
            s.push(Step::Send {
                peer: rank_on((me + k) % hosts),
                src: Operand::partial(copy),
            });
        }
        fold_in_rank_order(s, me, hosts, rank_on, Operand::partial(slice), acc, slice);
    }
}

#[cfg(test)]
mod tests {
    use super::super::sim::{check_all_reduce, with_hosts};
    use super::super::Algorithm;

    #[test]
    fn hierarchical_all_reduce_sums_every_element_once() {
        // Hosts of 2 and 3 ranks, with ranks numbered by host and round-robin over hosts.
        let layouts: [&[usize]; 5] = [
            &[0, 0, 1, 1],
            &[0, 1, 0, 1],
            &[0, 0, 0, 1, 1, 1],
            &[2, 0, 1, 2, 0, 1],
            &[0, 1, 2, 0, 1, 2, 0, 1, 2],
        ];
        for hosts in layouts {
            let n = hosts.len();
            for direct_max in [0, usize::MAX] {
                with_hosts(hosts.to_vec(), direct_max, || {
                    for count in [0, 1, 2, 5, n - 1, 3 * n + 1, 97] {
                        for slice in [1, 3, 64] {
                            check_all_reduce(n, count, slice, Algorithm::Hier);
                        }
                    }
                });
            }
        }
    }

    #[test]
    fn uneven_hosts_fall_back_to_the_ring() {
        with_hosts(vec![0, 0, 1], 0, || {
            for count in [0, 1, 7, 30] {
                check_all_reduce(3, count, 4, Algorithm::Hier);
            }
        });
        with_hosts(vec![0, 1, 2], 0, || {
            check_all_reduce(3, 10, 4, Algorithm::Hier)
        });
    }
}
