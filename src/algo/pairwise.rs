//! Pairwise exchange for all-to-all: in round k every rank sends to rank+k and receives from
//! rank-k, so each round is a perfect matching and no rank is a hot spot.

use super::{Buf, Operand, Region, Schedule, Shape, Step};

/// All-to-all with per-peer counts and displacements (elements). When the caller's buffers
/// overlap, the input is first copied to scratch: otherwise a peer's block could be overwritten
/// by what that same peer sends back before it has read it.
pub(crate) fn all_to_all_v(
    send_counts: &[usize],
    send_displs: &[usize],
    recv_counts: &[usize],
    recv_displs: &[usize],
    shape: &Shape,
) -> Schedule {
    let (n, e, me) = (shape.nranks, shape.elem, shape.rank);
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
    for k in 1..n {
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
        super::interleave(&mut s, sends, recvs);
    }
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
