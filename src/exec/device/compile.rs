//! Compiling a group's schedules into one device program.

use super::program::{DevOp, Factor, Loc, Source};
use super::OpBuffers;
use crate::algo::{Buf, Collective, Operand, Region, Schedule, Step};
use crate::error::Result;
use crate::exec::op::Reduction;
use crate::exec::ranges::{kinds_apart, Intervals, OpBytes};
use crate::transport::p2p::{Desc, Flag};

/// How the messages of one program travel between this rank and each peer.
pub(crate) struct Links<'a> {
    /// Per peer: every message to it carries a descriptor (the peer reads through them).
    pub describe_to: Vec<bool>,
    /// Per peer: every message from it is read through its descriptor.
    pub described_from: Vec<bool>,
    /// Where `peer` reads `len` bytes of this rank's memory at `addr` in place (registered
    /// memory the peer has mapped), if it can.
    pub peer_view: &'a dyn Fn(usize, u64, usize) -> Option<u64>,
}

impl Links<'static> {
    /// Every message staged through the slots: no registered buffers anywhere.
    pub(crate) fn staged(nranks: usize) -> Links<'static> {
        Links {
            describe_to: vec![false; nranks],
            described_from: vec![false; nranks],
            peer_view: &|_, _, _| None,
        }
    }
}

/// The slot protocol between this rank and its peers, one channel per peer and direction. A
/// sender *acquires* its next slot to a peer (waits until the peer released it, and takes it),
/// fills it and *publishes* it; the receiver *consumes* the next slot from that peer (waits
/// until it is published, and takes it), reads it and *releases* it. Message k of a channel
/// uses slot k mod `slots`, counted from 0 in every program, and every flag ends a program as
/// it began (Empty raised, Full lowered), so programs can be replayed.
struct SlotChannels {
    rank: usize,
    slots: usize,
    sent: Vec<usize>,
    received: Vec<usize>,
}

impl SlotChannels {
    fn new(rank: usize, nranks: usize, slots: usize) -> SlotChannels {
        SlotChannels {
            rank,
            slots,
            sent: vec![0; nranks],
            received: vec![0; nranks],
        }
    }

    /// The slot of the next message to `peer`, once `peer` has read the last one in it.
    fn acquire(&mut self, prog: &mut Vec<DevOp>, peer: usize) -> usize {
        let slot = self.sent[peer] % self.slots;
        self.sent[peer] += 1;
        take(prog, self.empty_to(peer, slot));
        slot
    }

    /// Tells `peer` that `slot` holds its message (after everything before is visible).
    fn publish(&self, prog: &mut Vec<DevOp>, peer: usize, slot: usize) {
        prog.push(DevOp::Set {
            flag: Flag::Full {
                owner: peer,
                from: self.rank,
                slot,
            },
            value: 1,
        });
    }

    /// The slot of the next message from `peer`, once `peer` has published it.
    fn consume(&mut self, prog: &mut Vec<DevOp>, peer: usize) -> usize {
        let slot = self.received[peer] % self.slots;
        self.received[peer] += 1;
        take(
            prog,
            Flag::Full {
                owner: self.rank,
                from: peer,
                slot,
            },
        );
        slot
    }

    /// Tells `peer` that this rank has read its message in `slot`.
    fn release(&self, prog: &mut Vec<DevOp>, peer: usize, slot: usize) {
        prog.push(DevOp::Set {
            flag: Flag::Empty {
                owner: peer,
                to: self.rank,
                slot,
            },
            value: 1,
        });
    }

    /// Waits until `peer` has released `slot` without taking it (the end of a program whose
    /// message there is read in place from the caller's buffer).
    fn await_release(&self, prog: &mut Vec<DevOp>, peer: usize, slot: usize) {
        prog.push(DevOp::Wait {
            flag: self.empty_to(peer, slot),
            value: 1,
        });
    }

    fn empty_to(&self, peer: usize, slot: usize) -> Flag {
        Flag::Empty {
            owner: self.rank,
            to: peer,
            slot,
        }
    }
}

/// Waits until `flag` is raised, then lowers it.
fn take(prog: &mut Vec<DevOp>, flag: Flag) {
    prog.push(DevOp::Wait { flag, value: 1 });
    prog.push(DevOp::Set { flag, value: 0 });
}

/// One operation of a group, ready to compile.
pub(crate) struct DeviceOp {
    pub coll: Collective,
    pub schedule: std::sync::Arc<Schedule>,
    pub reduction: Option<Reduction>,
    pub elem: usize,
}

/// Compiles a group's operations, whose buffers are `bufs`, into one program for `rank` of
/// `nranks`. Messages must fit a slot (the caller slices schedules with
/// `slice_bytes <= slot_bytes`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn compile(
    ops: &[DeviceOp],
    bufs: &[OpBuffers],
    rank: usize,
    nranks: usize,
    slots: usize,
    slot_bytes: usize,
    links: &Links,
) -> Result<Vec<DevOp>> {
    let steps = order(ops, bufs);
    let addr = |op: usize, r: Region| bufs[op].base(r.buf) + r.offset as u64;
    let overwritten = if links.describe_to.iter().any(|&d| d) {
        overwritten_later(ops, &steps, &addr)
    } else {
        Vec::new()
    };
    let mut prog = Vec::new();
    let mut chan = SlotChannels::new(rank, nranks, slots);
    // Per peer and slot: whether the last message through it is read in place.
    let mut read_in_place = vec![vec![false; slots]; nranks];
    for (k, &(op, i)) in steps.iter().enumerate() {
        let o = &ops[op];
        let step = o.schedule.steps[i];
        let loc = |r: Region| Loc::Buf {
            op,
            buf: r.buf,
            offset: r.offset,
        };
        let input_scale = o.reduction.and_then(|r| {
            r.input_scale_at
                .map(Factor::At)
                .or(r.input_scale.map(Factor::Value))
        });
        let source = |x: Operand| Source {
            loc: loc(x.region),
            scale: if x.input { input_scale } else { None },
        };
        let divide = |last: bool| {
            if last {
                o.reduction.and_then(|r| r.divide_by)
            } else {
                None
            }
        };
        match step {
            Step::Send { peer, src } => {
                let len = src.region.len;
                if len > slot_bytes {
                    return crate::internal_err!(
                        "a {len}-byte message does not fit a {slot_bytes}-byte device slot"
                    );
                }
                let slot = chan.acquire(&mut prog, peer);
                let s = source(src);
                // In place: the receiver reads the caller's (registered) bytes, so they must be
                // final (unscaled) and stay as they are until the end of the program.
                let direct = if links.describe_to[peer]
                    && s.scale.is_none()
                    && src.region.buf != Buf::Scratch
                    && !overwritten[k]
                {
                    (links.peer_view)(peer, addr(op, src.region), len).map(|at| (s.loc, at))
                } else {
                    None
                };
                if direct.is_none() {
                    let dst = Loc::Slot {
                        owner: rank,
                        to: peer,
                        slot,
                        offset: 0,
                    };
                    match (s.scale, o.reduction) {
                        (Some(_), Some(red)) => prog.push(DevOp::Reduce {
                            dst,
                            srcs: vec![s],
                            count: len / o.elem,
                            reducer: red.reducer,
                            divide_by: None,
                        }),
                        _ => prog.push(DevOp::Copy {
                            dst,
                            src: s.loc,
                            len,
                        }),
                    }
                }
                if links.describe_to[peer] {
                    prog.push(DevOp::Describe {
                        desc: Desc {
                            owner: peer,
                            from: rank,
                            slot,
                        },
                        len,
                        direct,
                    });
                }
                read_in_place[peer][slot] = direct.is_some();
                chan.publish(&mut prog, peer, slot);
            }
            Step::Recv {
                peer,
                dst,
                reduce_with,
                last,
            } => {
                if dst.len > slot_bytes {
                    return crate::internal_err!(
                        "a {}-byte message does not fit a {slot_bytes}-byte device slot",
                        dst.len
                    );
                }
                let slot = chan.consume(&mut prog, peer);
                let msg = Source {
                    loc: if links.described_from[peer] {
                        Loc::Message {
                            from: peer,
                            to: rank,
                            slot,
                        }
                    } else {
                        Loc::Slot {
                            owner: peer,
                            to: rank,
                            slot,
                            offset: 0,
                        }
                    },
                    scale: None,
                };
                let divide_by = divide(last);
                match (reduce_with, o.reduction) {
                    (Some(w), Some(red)) => prog.push(DevOp::Reduce {
                        dst: loc(dst),
                        srcs: vec![source(w), msg],
                        count: dst.len / o.elem,
                        reducer: red.reducer,
                        divide_by,
                    }),
                    (None, Some(red)) if divide_by.is_some() => prog.push(DevOp::Reduce {
                        dst: loc(dst),
                        srcs: vec![msg],
                        count: dst.len / o.elem,
                        reducer: red.reducer,
                        divide_by,
                    }),
                    (Some(_), None) => {
                        return crate::internal_err!("a reducing receive without a reduction")
                    }
                    _ => prog.push(DevOp::Copy {
                        dst: loc(dst),
                        src: msg.loc,
                        len: dst.len,
                    }),
                }
                chan.release(&mut prog, peer, slot);
            }
            Step::Local { dst, a, b, last } => {
                let a = source(a);
                let divide_by = divide(last);
                match (b, o.reduction) {
                    (Some(b), Some(red)) => prog.push(DevOp::Reduce {
                        dst: loc(dst),
                        srcs: vec![a, source(b)],
                        count: dst.len / o.elem,
                        reducer: red.reducer,
                        divide_by,
                    }),
                    (None, Some(red)) if a.scale.is_some() || divide_by.is_some() => {
                        prog.push(DevOp::Reduce {
                            dst: loc(dst),
                            srcs: vec![a],
                            count: dst.len / o.elem,
                            reducer: red.reducer,
                            divide_by,
                        })
                    }
                    (Some(_), None) => {
                        return crate::internal_err!("a local reduction without a reduction")
                    }
                    _ => {
                        if a.loc != loc(dst) {
                            prog.push(DevOp::Copy {
                                dst: loc(dst),
                                src: a.loc,
                                len: dst.len,
                            })
                        }
                    }
                }
            }
        }
    }
    // The program is done only once every peer has read what it reads in place.
    for (peer, per_slot) in read_in_place.iter().enumerate() {
        for (slot, _) in per_slot.iter().enumerate().filter(|(_, &r)| r) {
            chan.await_release(&mut prog, peer, slot);
        }
    }
    Ok(prog)
}

/// For each step of `steps` (program order): whether a later step writes any byte it sends.
fn overwritten_later(
    ops: &[DeviceOp],
    steps: &[(usize, usize)],
    addr: &dyn Fn(usize, Region) -> u64,
) -> Vec<bool> {
    let mut later = Intervals::default();
    let mut out = vec![false; steps.len()];
    for (k, &(op, i)) in steps.iter().enumerate().rev() {
        match ops[op].schedule.steps[i] {
            Step::Send { src, .. } => {
                out[k] = later.overlaps(addr(op, src.region), src.region.len as u64)
            }
            Step::Recv { dst, .. } | Step::Local { dst, .. } => {
                later.insert(addr(op, dst), dst.len as u64)
            }
        }
    }
    out
}

fn is_p2p(o: &DeviceOp) -> bool {
    matches!(o.coll, Collective::Send { .. } | Collective::Recv { .. })
}

/// The order in which a group's steps run on the stream: collectives one after another in
/// call order; consecutive point-to-point calls interleaved slice by slice, sends before
/// receives in each round, so that sends and receives (in any order, in any sizes) all move
/// along.
///
/// Messages between two ranks are matched by their place in the program, and ranks may
/// interleave their point-to-point calls with collectives differently (NCCL allows a group of
/// `ncclSend(peer)`, `ncclAllReduce`, `ncclRecv(peer)` on every rank: each rank would then send
/// its point-to-point message before the all-reduce's and expect the peer's after): so all the
/// group's point-to-point calls run first, as one interleaved run, then the collectives. Where
/// a point-to-point call shares bytes with a collective of the group and either writes them,
/// the calls keep the order called instead, and the ranks must place them alike.
fn order(ops: &[DeviceOp], bufs: &[OpBuffers]) -> Vec<(usize, usize)> {
    let all: Vec<usize> = (0..ops.len()).collect();
    let hoist = kinds_apart(op_bytes(ops, bufs));
    let calls = if hoist {
        let (p2p, colls): (Vec<usize>, Vec<usize>) =
            all.into_iter().partition(|&i| is_p2p(&ops[i]));
        [p2p, colls].concat()
    } else {
        all
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < calls.len() {
        if !is_p2p(&ops[calls[i]]) {
            let op = calls[i];
            out.extend((0..ops[op].schedule.steps.len()).map(|k| (op, k)));
            i += 1;
            continue;
        }
        let mut j = i;
        while j < calls.len() && is_p2p(&ops[calls[j]]) {
            j += 1;
        }
        // Each round, the next slice of every send, then of every receive: a program waits at
        // a receive until its message is there, so were every rank of a ring to receive first
        // (each calling ncclRecv before ncclSend), none would ever send.
        let mut cursor = vec![0usize; j - i];
        loop {
            let mut any = false;
            for sends in [true, false] {
                for (k, c) in cursor.iter_mut().enumerate() {
                    let op = calls[i + k];
                    if matches!(ops[op].coll, Collective::Send { .. }) != sends {
                        continue;
                    }
                    let steps = &ops[op].schedule.steps;
                    // A staged send's first step (its copy aside) goes with its first slice.
                    while *c < steps.len() {
                        out.push((op, *c));
                        *c += 1;
                        any = true;
                        if !matches!(steps[*c - 1], Step::Local { .. }) {
                            break;
                        }
                    }
                }
            }
            if !any {
                break;
            }
        }
        i = j;
    }
    out
}

/// What each call of a group reads and writes (`ranges::kinds_apart`).
fn op_bytes<'a>(
    ops: &'a [DeviceOp],
    bufs: &'a [OpBuffers],
) -> impl Iterator<Item = OpBytes> + Clone + 'a {
    ops.iter().zip(bufs).map(|(o, b)| OpBytes {
        p2p: is_p2p(o),
        read: (b.send, o.schedule.send_extent as u64),
        write: (b.recv, o.schedule.recv_extent as u64),
    })
}
