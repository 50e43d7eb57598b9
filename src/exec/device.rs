//! The device executor: turns a group's schedules into a *device program*, an ordered list of
//! stream operations (copies, reduction kernels, flag writes and flag waits) that a CUDA backend
//! enqueues on the caller's stream. Nothing blocks the host, nothing spins on the GPU: ranks
//! synchronise through flags in each other's memory with stream memory operations, which also
//! works for several processes sharing one GPU (their kernels would not run concurrently, so a
//! kernel waiting for another process's kernel could stall for whole time slices).
//!
//! Every rank owns, in device memory its peers map:
//! - for each peer `to`, `slots` outgoing message slots of `slot_bytes` each;
//! - a flag array: `Full[from][slot]` (set by `from` when it filled its slot for us) and
//!   `Empty[to][slot]` (set by `to` when it has read our slot, so we may refill it).
//!
//! A message k on a channel uses slot k mod `slots`, counted from 0 in every program, and leaves
//! the flags as it found them: Empty set, Full clear. So a program can be captured in a CUDA
//! graph and replayed any number of times.
//!
//! The sender stages its data into its own slot (applying its input scale there, so receivers
//! need not know it) and raises the receiver's Full flag; the receiver waits for Full, lowers it,
//! reads the slot across the peer mapping (copying it, or combining it with its own data in a
//! reduction kernel) and raises the sender's Empty flag. Steps run strictly in list order, which
//! the algorithms make safe (see `algo::interleave` and the bounded simulation in algo tests).
//!
//! Registered buffers skip the staging copy. Once a receiver has mapped some registered buffer of
//! a sender, the pair switches to *described* messages (see `transport::reg` for how both sides
//! agree on the program from which on): with every message the sender stores a descriptor,
//! `Desc[from][slot]` in the receiver's area, before it raises Full. The descriptor is the
//! address, in the receiver's mapping, of the sender's own buffer when the bytes sit in a
//! registered buffer that nothing later in the program overwrites, and 0 when they were staged
//! into the slot as usual. The receiver's kernels read the descriptor and take the bytes from
//! wherever it points. A sender whose message was read in place waits, at the end of its
//! program, for the receiver's Empty flag of that message, so the caller's buffer is not reused
//! before the peer has read it.

use super::host::Reduction;
use crate::algo::{Buf, Collective, Operand, Region, Schedule, Step};
use crate::error::Result;
use crate::reduce::{ReduceOp, Reducer, Scale};

/// Message slots per peer and direction.
pub(crate) const SLOTS: usize = 2;

/// A place in device memory, named so that any rank's program can be checked on the CPU and
/// resolved by the backend to an address (local or peer-mapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Loc {
    /// A buffer of operation `op` of the program (the caller's, or this program's scratch).
    Buf { op: usize, buf: Buf, offset: usize },
    /// Byte `offset` of slot `slot` that rank `owner` keeps for its messages to rank `to`.
    Slot {
        owner: usize,
        to: usize,
        slot: usize,
        offset: usize,
    },
    /// The message `from` sent `to` through slot `slot`, wherever its descriptor
    /// (`Desc { owner: to, from, slot }`) says it is: in the sender's registered buffer, or in
    /// that slot. Only read, and only by `to`.
    Message { from: usize, to: usize, slot: usize },
}

/// A 64-bit descriptor cell in rank `owner`'s area: where the message `from` sent it through
/// slot `slot` can be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub owner: usize,
    pub from: usize,
    pub slot: usize,
}

impl Desc {
    /// Index of the cell among its owner's descriptor cells.
    pub(crate) fn index(&self, slots: usize) -> usize {
        self.from * slots + self.slot
    }
}

/// A 32-bit flag in some rank's signal area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flag {
    /// In `owner`'s area: raised by `from` when its slot `slot` for `owner` holds a message.
    Full {
        owner: usize,
        from: usize,
        slot: usize,
    },
    /// In `owner`'s area: raised by `to` when it has read `owner`'s slot `slot` for it.
    Empty {
        owner: usize,
        to: usize,
        slot: usize,
    },
}

impl Flag {
    /// The rank whose memory holds the flag.
    pub(crate) fn owner(&self) -> usize {
        match *self {
            Flag::Full { owner, .. } | Flag::Empty { owner, .. } => owner,
        }
    }

    /// Index of the flag in its owner's signal area of `nranks` ranks with `slots` slots.
    pub(crate) fn index(&self, nranks: usize, slots: usize) -> usize {
        match *self {
            Flag::Full { from, slot, .. } => from * slots + slot,
            Flag::Empty { to, slot, .. } => nranks * slots + to * slots + slot,
        }
    }
}

/// Flags in each rank's signal area.
pub(crate) fn flag_count(nranks: usize, slots: usize) -> usize {
    2 * nranks * slots
}

/// A multiplier: known when the program is built, or read from device memory when it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Factor {
    Value(Scale),
    /// A value of the datatype at this device address of the rank (ncclScalarDevice).
    At(u64),
}

/// One source of a reduction, with the multiplier applied to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    pub loc: Loc,
    pub scale: Option<Factor>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum DevOp {
    /// A plain copy of `len` bytes.
    Copy { dst: Loc, src: Loc, len: usize },
    /// `dst = srcs[0] (+) srcs[1] (+) ...` over `count` elements, each source scaled first when it
    /// has a scale, the result divided by `divide_by` when set. One source: a scaled copy.
    Reduce {
        dst: Loc,
        srcs: Vec<Source>,
        count: usize,
        reducer: Reducer,
        divide_by: Option<usize>,
    },
    /// Stores `value` into a flag (after everything before it in the stream is visible).
    Set { flag: Flag, value: u32 },
    /// Holds the stream until a flag (in this rank's own area) equals `value`.
    Wait { flag: Flag, value: u32 },
    /// Stores a message's descriptor in the receiver's area (before the Full flag that
    /// announces the message). `direct` is None for a message staged in its slot; otherwise the
    /// sender's own bytes (for the CPU model) and the address at which the receiver reads them.
    Describe {
        desc: Desc,
        len: usize,
        direct: Option<(Loc, u64)>,
    },
}

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
    let steps = order(ops);
    let addr = |op: usize, r: Region| bufs[op].base(r.buf) + r.offset as u64;
    let overwritten = if links.describe_to.iter().any(|&d| d) {
        overwritten_later(ops, &steps, &addr)
    } else {
        Vec::new()
    };
    let mut prog = Vec::new();
    let mut sent = vec![0usize; nranks];
    let mut received = vec![0usize; nranks];
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
                let slot = sent[peer] % slots;
                sent[peer] += 1;
                let empty = Flag::Empty {
                    owner: rank,
                    to: peer,
                    slot,
                };
                prog.push(DevOp::Wait {
                    flag: empty,
                    value: 1,
                });
                prog.push(DevOp::Set {
                    flag: empty,
                    value: 0,
                });
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
                prog.push(DevOp::Set {
                    flag: Flag::Full {
                        owner: peer,
                        from: rank,
                        slot,
                    },
                    value: 1,
                });
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
                let slot = received[peer] % slots;
                received[peer] += 1;
                let full = Flag::Full {
                    owner: rank,
                    from: peer,
                    slot,
                };
                prog.push(DevOp::Wait {
                    flag: full,
                    value: 1,
                });
                prog.push(DevOp::Set {
                    flag: full,
                    value: 0,
                });
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
                prog.push(DevOp::Set {
                    flag: Flag::Empty {
                        owner: peer,
                        to: rank,
                        slot,
                    },
                    value: 1,
                });
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
            prog.push(DevOp::Wait {
                flag: Flag::Empty {
                    owner: rank,
                    to: peer,
                    slot,
                },
                value: 1,
            });
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

/// A union of byte ranges, kept as disjoint `start -> end` entries.
#[derive(Default)]
struct Intervals(std::collections::BTreeMap<u64, u64>);

impl Intervals {
    fn insert(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        let (mut lo, mut hi) = (start, start + len);
        // Absorb every range that touches [lo, hi).
        while let Some((&s, &e)) = self.0.range(..=hi).next_back() {
            if e < lo {
                break;
            }
            self.0.remove(&s);
            lo = lo.min(s);
            hi = hi.max(e);
        }
        self.0.insert(lo, hi);
    }

    fn overlaps(&self, start: u64, len: u64) -> bool {
        len > 0
            && self
                .0
                .range(..start + len)
                .next_back()
                .is_some_and(|(_, &e)| e > start)
    }
}

/// The order in which a group's steps run on the stream: collectives one after another in
/// call order; consecutive point-to-point calls interleaved slice by slice, so that a send to a
/// peer and a receive from it (in either order, in any sizes) both move along.
fn order(ops: &[DeviceOp]) -> Vec<(usize, usize)> {
    let is_p2p = |o: &DeviceOp| matches!(o.coll, Collective::Send { .. } | Collective::Recv { .. });
    let mut out = Vec::new();
    let mut i = 0;
    while i < ops.len() {
        if !is_p2p(&ops[i]) {
            out.extend((0..ops[i].schedule.steps.len()).map(|k| (i, k)));
            i += 1;
            continue;
        }
        let mut j = i;
        while j < ops.len() && is_p2p(&ops[j]) {
            j += 1;
        }
        let mut cursor = vec![0usize; j - i];
        loop {
            let mut any = false;
            for (k, c) in cursor.iter_mut().enumerate() {
                let op = i + k;
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
            if !any {
                break;
            }
        }
        i = j;
    }
    out
}

/// The device addresses of one operation's buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpBuffers {
    pub send: u64,
    pub recv: u64,
    pub scratch: u64,
}

impl OpBuffers {
    pub(crate) fn base(&self, buf: Buf) -> u64 {
        match buf {
            Buf::Send => self.send,
            Buf::Recv => self.recv,
            Buf::Scratch => self.scratch,
        }
    }
}

/// Enqueues a compiled program on `stream`. Nothing waits on the host: the program's own flag
/// waits hold the stream until the peers' programs have done their part.
pub(crate) fn enqueue(
    prog: &[DevOp],
    world: &crate::transport::p2p::DeviceWorld,
    bufs: &[OpBuffers],
    stream: crate::cuda::Stream,
) -> Result<()> {
    use crate::cuda::kernels::{reduce_kernel_name, ReduceArgs, MAX_SOURCES};
    use crate::reduce::DataType;
    // A location's address, and the descriptor cell to read first when it is a message that
    // may sit in the sender's registered buffer.
    let resolve = |loc: Loc| -> Result<(u64, u64)> {
        match loc {
            Loc::Buf { op, buf, offset } => Ok((bufs[op].base(buf) + offset as u64, 0)),
            Loc::Slot { .. } => Ok((world.slot_addr(loc)?, 0)),
            Loc::Message { from, to, slot } => Ok((
                world.slot_addr(Loc::Slot {
                    owner: from,
                    to,
                    slot,
                    offset: 0,
                })?,
                world.desc_addr(Desc {
                    owner: to,
                    from,
                    slot,
                })?,
            )),
        }
    };
    let _bound = world.device.bind()?;
    for op in prog {
        match op {
            DevOp::Copy { dst, src, len } => {
                let (s, via) = resolve(*src)?;
                let (d, _) = resolve(*dst)?;
                if via == 0 {
                    stream.copy(d, s, *len)?;
                } else {
                    // Where the bytes are is known only on the device: a byte copy kernel that
                    // reads the descriptor first.
                    let mut args = ReduceArgs {
                        dst: d as *mut std::ffi::c_void,
                        nsrc: 1,
                        count: *len as u64,
                        ..ReduceArgs::default()
                    };
                    args.src[0] = s as *const std::ffi::c_void;
                    args.via[0] = via as *const u64;
                    let name =
                        reduce_kernel_name(DataType::Uint8, ReduceOp::Sum).expect("u8 sum exists");
                    stream.reduce(&world.device, name, DataType::Uint8, &args)?;
                }
            }
            DevOp::Set { flag, value } => stream.set_flag(world.flag_addr(*flag)?, *value)?,
            DevOp::Wait { flag, value } => stream.wait_flag(world.flag_addr(*flag)?, *value)?,
            DevOp::Describe { desc, direct, .. } => {
                stream.set_u64(world.desc_addr(*desc)?, direct.map_or(0, |d| d.1))?
            }
            DevOp::Reduce {
                dst,
                srcs,
                count,
                reducer,
                divide_by,
            } => {
                if srcs.len() > MAX_SOURCES {
                    return crate::internal_err!("{} sources for one reduction", srcs.len());
                }
                let name = reduce_kernel_name(reducer.dtype, reducer.op).ok_or_else(|| {
                    crate::error::Error::new(
                        crate::error::ErrorKind::InvalidArgument,
                        format!(
                            "{} is not defined on {}",
                            reducer.op.name(),
                            reducer.dtype.name()
                        ),
                    )
                })?;
                let (dst_addr, _) = resolve(*dst)?;
                let mut resolved = srcs
                    .iter()
                    .map(|s| Ok((resolve(s.loc)?, s.scale)))
                    .collect::<Result<Vec<_>>>()?;
                // The kernels allow only the first source to be the destination itself; the
                // op is commutative, so put the aliased source first.
                if let Some(k) = resolved.iter().position(|((a, _), _)| *a == dst_addr) {
                    resolved.swap(0, k);
                }
                let mut args = ReduceArgs {
                    dst: dst_addr as *mut std::ffi::c_void,
                    nsrc: resolved.len() as i32,
                    count: *count as u64,
                    divide_by: divide_by.unwrap_or(0) as u64,
                    ..ReduceArgs::default()
                };
                for (i, ((a, via), scale)) in resolved.iter().enumerate() {
                    args.src[i] = *a as *const std::ffi::c_void;
                    if *via != 0 {
                        args.via[i] = *via as *const u64;
                    }
                    match scale {
                        Some(Factor::Value(s)) => args.scale[i] = u64::from_le_bytes(s.0),
                        Some(Factor::At(at)) => args.scale_at[i] = *at as *const std::ffi::c_void,
                        None => {}
                    }
                    if scale.is_some() {
                        args.has_scale |= 1 << i;
                    }
                }
                stream.reduce(&world.device, name, reducer.dtype, &args)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Runs every rank's program on the CPU: each rank's memory is one byte vector in which the
    //! operations' buffers sit at their addresses (so in-place aliasing is real), slots and flags
    //! are separate, waits block the rank until the flag holds the value. Checks results against
    //! exact sums, registered-buffer programs against the staged ones byte for byte, that no
    //! rank overwrites bytes a peer has yet to read in place, and that flags end as they started.
    use super::*;
    use crate::algo::{self, Algorithm, Shape};
    use crate::reduce::DataType;
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
            Collective::AllGather { count } | Collective::Gather { count, .. } => {
                (count, count * n)
            }
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
                                input_scale: scaled.then(|| {
                                    Scale::from_bytes(DataType::Float32, &3f32.to_ne_bytes())
                                }),
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

    #[test]
    fn intervals_merge_and_answer_overlaps() {
        let mut iv = Intervals::default();
        iv.insert(10, 5); // [10, 15)
        iv.insert(20, 5); // [20, 25)
        assert!(!iv.overlaps(15, 5));
        assert!(iv.overlaps(14, 1));
        assert!(iv.overlaps(0, 11));
        assert!(!iv.overlaps(0, 10));
        assert!(!iv.overlaps(12, 0));
        iv.insert(15, 5); // joins both: [10, 25)
        assert_eq!(iv.0.len(), 1);
        assert!(iv.overlaps(24, 100));
        assert!(!iv.overlaps(25, 100));
    }
}
