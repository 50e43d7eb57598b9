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

use super::host::Reduction;
use crate::algo::{Buf, Collective, Operand, Region, Schedule, Step};
use crate::error::Result;
use crate::reduce::{ReduceOp, Reducer, Scale};

/// Message slots per peer and direction.
pub(crate) const SLOTS: usize = 2;

/// A place in device memory, named so that any rank's program can be checked on the CPU and
/// resolved by the backend to an address (local or peer-mapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// A buffer of operation `op` of the program (the caller's, or this program's scratch).
    Buf { op: usize, buf: Buf, offset: usize },
    /// Byte `offset` of slot `slot` that rank `owner` keeps for its messages to rank `to`.
    Slot {
        owner: usize,
        to: usize,
        slot: usize,
        offset: usize,
    },
}

/// A 32-bit flag in some rank's signal area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flag {
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
    pub fn owner(&self) -> usize {
        match *self {
            Flag::Full { owner, .. } | Flag::Empty { owner, .. } => owner,
        }
    }

    /// Index of the flag in its owner's signal area of `nranks` ranks with `slots` slots.
    pub fn index(&self, nranks: usize, slots: usize) -> usize {
        match *self {
            Flag::Full { from, slot, .. } => from * slots + slot,
            Flag::Empty { to, slot, .. } => nranks * slots + to * slots + slot,
        }
    }
}

/// Flags in each rank's signal area.
pub fn flag_count(nranks: usize, slots: usize) -> usize {
    2 * nranks * slots
}

/// One source of a reduction, with the multiplier applied to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    pub loc: Loc,
    pub scale: Option<Scale>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum DevOp {
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
}

/// One operation of a group, ready to compile.
pub struct DeviceOp {
    pub coll: Collective,
    pub schedule: std::sync::Arc<Schedule>,
    pub reduction: Option<Reduction>,
    pub elem: usize,
}

/// Compiles a group's operations into one program for `rank` of `nranks`. Messages must fit a
/// slot (the caller slices schedules with `slice_bytes <= slot_bytes`).
pub fn compile(
    ops: &[DeviceOp],
    rank: usize,
    nranks: usize,
    slots: usize,
    slot_bytes: usize,
) -> Result<Vec<DevOp>> {
    let mut prog = Vec::new();
    let mut sent = vec![0usize; nranks];
    let mut received = vec![0usize; nranks];
    for (op, i) in order(ops) {
        let o = &ops[op];
        let step = o.schedule.steps[i];
        let loc = |r: Region| Loc::Buf {
            op,
            buf: r.buf,
            offset: r.offset,
        };
        let input_scale = o.reduction.and_then(|r| r.input_scale);
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
                let dst = Loc::Slot {
                    owner: rank,
                    to: peer,
                    slot,
                    offset: 0,
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
                    loc: Loc::Slot {
                        owner: peer,
                        to: rank,
                        slot,
                        offset: 0,
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
    Ok(prog)
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
pub struct OpBuffers {
    pub send: u64,
    pub recv: u64,
    pub scratch: u64,
}

/// Enqueues a compiled program on `stream`. Nothing waits on the host: the program's own flag
/// waits hold the stream until the peers' programs have done their part.
pub fn enqueue(
    prog: &[DevOp],
    world: &crate::transport::p2p::DeviceWorld,
    bufs: &[OpBuffers],
    stream: crate::cuda::Stream,
) -> Result<()> {
    let addr = |loc: Loc| -> Result<u64> {
        match loc {
            Loc::Buf { op, buf, offset } => {
                let b = &bufs[op];
                let base = match buf {
                    Buf::Send => b.send,
                    Buf::Recv => b.recv,
                    Buf::Scratch => b.scratch,
                };
                Ok(base + offset as u64)
            }
            Loc::Slot { .. } => world.slot_addr(loc),
        }
    };
    let _bound = world.device.bind()?;
    for op in prog {
        match op {
            DevOp::Copy { dst, src, len } => stream.copy(addr(*dst)?, addr(*src)?, *len)?,
            DevOp::Set { flag, value } => stream.set_flag(world.flag_addr(*flag)?, *value)?,
            DevOp::Wait { flag, value } => stream.wait_flag(world.flag_addr(*flag)?, *value)?,
            DevOp::Reduce {
                dst,
                srcs,
                count,
                reducer,
                divide_by,
            } => {
                use crate::cuda::kernels::{reduce_kernel_name, ReduceArgs, MAX_SOURCES};
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
                let dst_addr = addr(*dst)?;
                let mut resolved = srcs
                    .iter()
                    .map(|s| Ok((addr(s.loc)?, s.scale)))
                    .collect::<Result<Vec<_>>>()?;
                // The kernels allow only the first source to be the destination itself; the
                // op is commutative, so put the aliased source first.
                if let Some(k) = resolved.iter().position(|(a, _)| *a == dst_addr) {
                    resolved.swap(0, k);
                }
                let mut args = ReduceArgs {
                    dst: dst_addr as *mut std::ffi::c_void,
                    src: [std::ptr::null(); MAX_SOURCES],
                    scale: [0; MAX_SOURCES],
                    has_scale: 0,
                    nsrc: resolved.len() as i32,
                    count: *count as u64,
                    divide_by: divide_by.unwrap_or(0) as u64,
                };
                for (i, (a, scale)) in resolved.iter().enumerate() {
                    args.src[i] = *a as *const std::ffi::c_void;
                    if let Some(s) = scale {
                        args.scale[i] = u64::from_le_bytes(s.0);
                        args.has_scale |= 1 << i;
                    }
                }
                stream.reduce(&world.device, name, reducer.dtype, &args)?;
            }
        }
    }
    Ok(())
}

/// Whether a reduction op can run on the device: bitwise ops only on integer types (checked
/// before), everything else always.
pub fn supported(reducer: &Reducer) -> bool {
    !matches!(
        reducer.op,
        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor
    ) || !reducer.dtype.is_float()
}

#[cfg(test)]
mod tests {
    //! Runs every rank's program on the CPU: memories as byte vectors, flags as integers,
    //! waits block the rank until the flag holds the value. Checks results against the host
    //! reference and that every flag ends as it started.
    use super::*;
    use crate::algo::{self, Algorithm, Shape};
    use crate::reduce::DataType;

    struct Rank {
        bufs: Vec<[Vec<u8>; 3]>,
        slots: Vec<Vec<Vec<u8>>>,
        flags: Vec<u32>,
        pc: usize,
    }

    fn buf_index(b: Buf) -> usize {
        match b {
            Buf::Send => 0,
            Buf::Recv => 1,
            Buf::Scratch => 2,
        }
    }

    fn read(ranks: &[Rank], me: usize, loc: Loc, len: usize) -> Vec<u8> {
        match loc {
            Loc::Buf { op, buf, offset } => {
                ranks[me].bufs[op][buf_index(buf)][offset..offset + len].to_vec()
            }
            Loc::Slot {
                owner,
                to,
                slot,
                offset,
            } => ranks[owner].slots[to][slot][offset..offset + len].to_vec(),
        }
    }

    fn write(ranks: &mut [Rank], me: usize, loc: Loc, data: &[u8]) {
        let dst = match loc {
            Loc::Buf { op, buf, offset } => {
                &mut ranks[me].bufs[op][buf_index(buf)][offset..offset + data.len()]
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
        };
        dst.copy_from_slice(data);
    }

    /// Runs the programs of all ranks to the end (or panics on deadlock).
    fn run(progs: &[Vec<DevOp>], ranks: &mut [Rank], n: usize, elem: usize) {
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
                        DevOp::Copy { dst, src, len } => {
                            let data = read(ranks, me, *src, *len);
                            write(ranks, me, *dst, &data);
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
                            let mut acc = read(ranks, me, first.loc, len);
                            if let Some(s) = first.scale {
                                reducer.scale_in_place(&mut acc, s);
                            }
                            for s in &srcs[1..] {
                                let b = read(ranks, me, s.loc, len);
                                reducer.reduce_in_place(&mut acc, None, &b, s.scale);
                            }
                            if let Some(d) = divide_by {
                                reducer.divide_in_place(&mut acc, *d);
                            }
                            write(ranks, me, *dst, &acc);
                        }
                    }
                    ranks[me].pc += 1;
                    moved = true;
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

    fn fresh_ranks(n: usize, slot_bytes: usize, ops: usize) -> Vec<Rank> {
        (0..n)
            .map(|_| {
                let mut flags = vec![0u32; flag_count(n, SLOTS)];
                for to in 0..n {
                    for slot in 0..SLOTS {
                        flags[Flag::Empty { owner: 0, to, slot }.index(n, SLOTS)] = 1;
                    }
                }
                Rank {
                    bufs: (0..ops)
                        .map(|_| [Vec::new(), Vec::new(), Vec::new()])
                        .collect(),
                    slots: (0..n).map(|_| vec![vec![0u8; slot_bytes]; SLOTS]).collect(),
                    flags,
                    pc: 0,
                }
            })
            .collect()
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    /// All-reduce of f32 sums with every algorithm, twice in a row (slots and flags must be
    /// reusable), compared with the exact sum; PreMulSum-like input scaling included.
    #[test]
    fn all_reduce_programs_compute_sums_and_restore_flags() {
        for n in 1..=5 {
            for count in [0usize, 1, 7, 33] {
                for algo in [
                    Algorithm::Ring,
                    Algorithm::Tree,
                    Algorithm::Direct,
                    Algorithm::TwoShot,
                ] {
                    for scaled in [false, true] {
                        let slot_bytes = 16;
                        let sum = Reducer::new(DataType::Float32, ReduceOp::Sum);
                        let reduction = Reduction {
                            reducer: sum,
                            input_scale: scaled
                                .then(|| Scale::from_bytes(DataType::Float32, &2f32.to_ne_bytes())),
                            divide_by: None,
                        };
                        let coll = Collective::AllReduce { count };
                        let progs: Vec<Vec<DevOp>> = (0..n)
                            .map(|r| {
                                let shape = Shape {
                                    rank: r,
                                    nranks: n,
                                    elem: 4,
                                    in_place: false,
                                    slice_bytes: slot_bytes,
                                };
                                let ops: Vec<DeviceOp> = (0..2)
                                    .map(|_| DeviceOp {
                                        coll: coll.clone(),
                                        schedule: algo::schedule(&coll, &shape, algo).into(),
                                        reduction: Some(reduction),
                                        elem: 4,
                                    })
                                    .collect();
                                compile(&ops, r, n, SLOTS, slot_bytes).unwrap()
                            })
                            .collect();
                        let mut ranks = fresh_ranks(n, slot_bytes, 2);
                        let initial_flags: Vec<Vec<u32>> =
                            ranks.iter().map(|r| r.flags.clone()).collect();
                        for (r, rank) in ranks.iter_mut().enumerate() {
                            for op in 0..2 {
                                let input: Vec<f32> =
                                    (0..count).map(|i| (r * 10 + i + op) as f32).collect();
                                let shape = Shape {
                                    rank: r,
                                    nranks: n,
                                    elem: 4,
                                    in_place: false,
                                    slice_bytes: slot_bytes,
                                };
                                let scratch = algo::schedule(&coll, &shape, algo).scratch;
                                rank.bufs[op] =
                                    [bytes(&input), vec![0u8; count * 4], vec![0u8; scratch]];
                            }
                        }
                        run(&progs, &mut ranks, n, 4);
                        let f = if scaled { 2.0 } else { 1.0 };
                        for (r, rank) in ranks.iter().enumerate() {
                            for op in 0..2 {
                                let got = f32s(&rank.bufs[op][1]);
                                for (i, g) in got.iter().enumerate() {
                                    let want: f32 =
                                        (0..n).map(|q| f * (q * 10 + i + op) as f32).sum();
                                    assert_eq!(
                                        *g, want,
                                        "{algo:?} n={n} count={count} rank {r} op {op} elem {i}"
                                    );
                                }
                            }
                            assert_eq!(
                                rank.flags, initial_flags[r],
                                "flags not restored ({algo:?} n={n})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Point-to-point in a group, sends and receives in opposite orders on the two sides and
    /// many slices long: interleaving keeps the in-order programs from deadlocking.
    #[test]
    fn grouped_sendrecv_programs_exchange_without_deadlock() {
        let (n, count, slot_bytes) = (2usize, 40usize, 8usize);
        let progs: Vec<Vec<DevOp>> = (0..n)
            .map(|r| {
                let shape = Shape {
                    rank: r,
                    nranks: n,
                    elem: 4,
                    in_place: false,
                    slice_bytes: slot_bytes,
                };
                let peer = 1 - r;
                let mut colls = vec![
                    Collective::Send { peer, count },
                    Collective::Recv { peer, count },
                ];
                if r == 1 {
                    colls.reverse();
                }
                let ops: Vec<DeviceOp> = colls
                    .into_iter()
                    .map(|c| DeviceOp {
                        schedule: algo::schedule(&c, &shape, Algorithm::Ring).into(),
                        coll: c,
                        reduction: None,
                        elem: 4,
                    })
                    .collect();
                compile(&ops, r, n, SLOTS, slot_bytes).unwrap()
            })
            .collect();
        let mut ranks = fresh_ranks(n, slot_bytes, 2);
        for (r, rank) in ranks.iter_mut().enumerate() {
            let data: Vec<f32> = (0..count).map(|i| (r * 100 + i) as f32).collect();
            // Rank 1 issued its receive first: op 0 is the receive there.
            let (s, v) = if r == 0 { (0, 1) } else { (1, 0) };
            rank.bufs[s] = [bytes(&data), Vec::new(), Vec::new()];
            rank.bufs[v] = [Vec::new(), vec![0u8; count * 4], Vec::new()];
        }
        run(&progs, &mut ranks, n, 4);
        let got0 = f32s(&ranks[0].bufs[1][1]);
        let got1 = f32s(&ranks[1].bufs[0][1]);
        for i in 0..count {
            assert_eq!(got0[i], (100 + i) as f32);
            assert_eq!(got1[i], i as f32);
        }
    }

    #[test]
    fn oversized_messages_are_refused() {
        let shape = Shape {
            rank: 0,
            nranks: 2,
            elem: 4,
            in_place: false,
            slice_bytes: 64,
        };
        let coll = Collective::Send { peer: 1, count: 16 };
        let op = DeviceOp {
            schedule: algo::schedule(&coll, &shape, Algorithm::Ring).into(),
            coll,
            reduction: None,
            elem: 4,
        };
        assert!(compile(&[op], 0, 2, SLOTS, 32).is_err());
    }
}
