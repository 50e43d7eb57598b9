//! Pairwise exchange for all-to-all: in round k every rank sends to rank+k and receives from
//! rank-k, so each round is a perfect matching and no rank is a hot spot.

use super::{Buf, Operand, Region, Schedule, Shape, Step};

/// All-to-all with per-peer counts and displacements (elements). In place, a block may be
/// overwritten by what its peer sends back before that peer has read it, so it is first copied
/// to scratch; when every block's place is the same in both directions (all-to-all, or an
/// all-to-all-v with equal counts and displacements) only the blocks whose receive does not
/// come after their send are copied (see `in_place_blocks`), else the whole input is.
pub(crate) fn all_to_all_v(
    send_counts: &[usize],
    send_displs: &[usize],
    recv_counts: &[usize],
    recv_displs: &[usize],
    shape: &Shape,
) -> Schedule {
    let (n, e, me) = (shape.nranks, shape.elem, shape.rank);
    if shape.in_place && send_counts == recv_counts && send_displs == recv_displs {
        return in_place_blocks(send_counts, send_displs, shape);
    }
    let mut s = Schedule::default();
    let mut src_buf = Buf::Send;
    if shape.in_place {
        let extent = (0..n)
            .map(|p| (send_displs[p] + send_counts[p]) * e)
            .max()
            .unwrap_or(0);
        s.scratch = extent;
        s.push(Step::Local {
            dst: Region::new(Buf::Scratch, 0, extent),
            a: Operand::partial(Region::new(Buf::Send, 0, extent)),
            b: None,
            last: false,
        });
        src_buf = Buf::Scratch;
    }
    let block_out = |p: usize| Region::new(src_buf, send_displs[p] * e, send_counts[p] * e);
    let block_in = |p: usize| Region::new(Buf::Recv, recv_displs[p] * e, recv_counts[p] * e);
    s.push(Step::Local {
        dst: block_in(me),
        a: Operand::partial(block_out(me)),
        b: None,
        last: false,
    });
    rounds(&mut s, shape, block_out, block_in);
    s
}

/// The n-1 rounds: in round k, the block `block_out(rank+k)` goes to rank+k and what rank-k
/// sends lands in `block_in(rank-k)`, slice by slice, sends and receives interleaved.
fn rounds(
    s: &mut Schedule,
    shape: &Shape,
    block_out: impl Fn(usize) -> Region,
    block_in: impl Fn(usize) -> Region,
) {
    for k in 1..shape.nranks {
        let to = shape.rel(k as isize);
        let from = shape.rel(-(k as isize));
        let out = block_out(to);
        let inb = block_in(from);
        let sends = shape
            .slices(out.buf, out.offset, out.len)
            .into_iter()
            .map(|r| Step::Send {
                peer: to,
                src: Operand::partial(r),
            });
        let recvs = shape
            .slices(inb.buf, inb.offset, inb.len)
            .into_iter()
            .map(|dst| Step::Recv {
                peer: from,
                dst,
                reduce_with: None,
                last: false,
            });
        super::interleave(s, sends, recvs);
    }
}

/// In place, each block where both directions put it. The block for rank `rank+k` is sent in
/// round k and overwritten by what that rank sends back in round n-k. When k < n-k the send
/// comes first, and the executor's hazards hold the receive until the peer has read the block,
/// so it goes from where it is. Otherwise (the receive first, or both in one round, where each
/// side's receive would wait for its own send to be read) it is copied to scratch first, all of
/// those at the start. This rank's own block stays where it is.
fn in_place_blocks(counts: &[usize], displs: &[usize], shape: &Shape) -> Schedule {
    let (n, e) = (shape.nranks, shape.elem);
    let mut s = Schedule::default();
    let mut out: Vec<Region> = (0..n)
        .map(|p| Region::new(Buf::Send, displs[p] * e, counts[p] * e))
        .collect();
    let mut scratch = 0;
    for k in (1..n).filter(|&k| 2 * k >= n) {
        let to = shape.rel(k as isize);
        let block = out[to];
        let aside = Region::new(Buf::Scratch, scratch, block.len);
        scratch += block.len;
        if block.len > 0 {
            s.push(Step::Local {
                dst: aside,
                a: Operand::partial(block),
                b: None,
                last: false,
            });
        }
        out[to] = aside;
    }
    s.scratch = scratch;
    rounds(
        &mut s,
        shape,
        |p| out[p],
        |p| Region::new(Buf::Recv, displs[p] * e, counts[p] * e),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::super::sim;

    #[test]
    fn all_to_all_delivers_every_block() {
        for n in 1..=6 {
            for count in [0, 1, 3, 10] {
                for slice_elems in [1, 4, 1000] {
                    sim::check_all_to_all(n, count, false, slice_elems);
                    sim::check_all_to_all(n, count, true, slice_elems);
                }
            }
        }
    }
}
