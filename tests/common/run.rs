//! Running one collective case on a communicator: buffers with canaries, the op (PreMulSum
//! created when needed), in place or out of place, and the element-by-element check.

use super::cases::*;
use super::values::*;
use crate::nccl;
use comm::ffi::types::*;
use comm::ffi::*;
use std::os::raw::c_void;

const GUARD: usize = 64;
const CANARY: u8 = 0xa5;

/// A buffer with canaries on both sides, to catch writes out of bounds; its data may begin
/// some bytes past the allocation's alignment (`Buf::at`), as a tensor's storage offset or a
/// sub-buffer puts it.
pub struct Buf {
    bytes: Vec<u8>,
    len: usize,
    /// Where the data begins: the guard plus the offset asked for.
    start: usize,
}

impl Buf {
    pub fn new(len: usize) -> Buf {
        Buf::at(len, 0)
    }
    /// `len` bytes beginning `offset` bytes past where `new` would put them.
    pub fn at(len: usize, offset: usize) -> Buf {
        Buf {
            bytes: vec![CANARY; len + offset + 2 * GUARD],
            len,
            start: GUARD + offset,
        }
    }
    pub fn ptr(&mut self) -> *mut c_void {
        // SAFETY: `start` is `GUARD + offset`, inside the `len + offset + 2 * GUARD` bytes.
        unsafe { self.bytes.as_mut_ptr().add(self.start) as *mut c_void }
    }
    pub fn data(&self) -> &[u8] {
        &self.bytes[self.start..self.start + self.len]
    }
    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.start..self.start + self.len]
    }
    /// Every byte outside the data (the guards and the offset's bytes) as it was made.
    pub fn canaries_intact(&self) -> bool {
        self.bytes[..self.start].iter().all(|&b| b == CANARY)
            && self.bytes[self.start + self.len..]
                .iter()
                .all(|&b| b == CANARY)
    }
}

pub struct Ctx {
    pub comm: ncclComm_t,
    pub rank: usize,
    pub n: usize,
}

/// The op value to pass for `op` on `dt` (creating the PreMulSum op when needed).
pub fn make_op(
    ctx: &Ctx,
    dt: i32,
    op: i32,
    device_residence: bool,
    scalar_store: &mut [u8; 8],
) -> Result<i32, String> {
    if op != PREMULSUM {
        return Ok(op);
    }
    let mut out = 0;
    encode(dt, scalar(dt), &mut scalar_store[..size_of(dt)]);
    let residence = if device_residence { 0 } else { 1 };
    nccl!(ncclRedOpCreatePreMulSum(
        &mut out,
        scalar_store.as_mut_ptr() as *mut c_void,
        dt,
        residence,
        ctx.comm
    ));
    Ok(out)
}

/// The buffers of a case of one collective, count and element size: kept from call to call
/// by a test that repeats calls on the same buffers (`run_case_on`).
pub struct CaseBufs {
    /// In place, one buffer holds both sides.
    big: Buf,
    recv: Buf,
    send: Buf,
    shape: (Coll, usize, usize),
}

impl CaseBufs {
    pub fn new(coll: Coll, count: usize, n: usize, es: usize) -> CaseBufs {
        CaseBufs::at(coll, count, n, es, [0; 3])
    }

    /// Buffers whose data begin `offsets` bytes (in place, send, receive) past where `new`
    /// puts them.
    pub fn at(coll: Coll, count: usize, n: usize, es: usize, offsets: [usize; 3]) -> CaseBufs {
        let (send_elems, recv_elems) = elems(coll, count, n);
        CaseBufs {
            big: Buf::at(send_elems.max(recv_elems) * es, offsets[0]),
            recv: Buf::at(recv_elems * es, offsets[2]),
            send: Buf::at(send_elems * es, offsets[1]),
            shape: (coll, count, es),
        }
    }

    /// Every byte back to the canary: nothing a call left there can pass for its output.
    fn clear(&mut self) {
        for b in [&mut self.big, &mut self.recv, &mut self.send] {
            b.data_mut().fill(CANARY);
        }
    }
}

/// Runs one case and checks every element of the result (and the canaries).
pub fn run_case(
    ctx: &Ctx,
    coll: Coll,
    dt: i32,
    op: i32,
    count: usize,
    in_place: bool,
) -> Result<(), String> {
    let mut bufs = CaseBufs::new(coll, count, ctx.n, size_of(dt));
    run_case_on(ctx, &mut bufs, coll, dt, op, count, in_place)
}

/// `run_case` on buffers made for `coll`, `count` and the element size of `dt`, which may
/// have served earlier calls: they are cleared first.
pub fn run_case_on(
    ctx: &Ctx,
    bufs: &mut CaseBufs,
    coll: Coll,
    dt: i32,
    op: i32,
    count: usize,
    in_place: bool,
) -> Result<(), String> {
    let spec = Spec {
        coll,
        dt,
        op,
        count,
        in_place,
    };
    run_spec_on(ctx, bufs, spec)
}

/// `run_case_on` for one `Spec`.
pub fn run_spec_on(ctx: &Ctx, bufs: &mut CaseBufs, spec: Spec) -> Result<(), String> {
    let case = Case::prepare(ctx, bufs, spec)?;
    case.launch(ctx)?;
    case.check(ctx)
}

/// What one case calls: the collective, datatype, op, count, and in place or not.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub coll: Coll,
    pub dt: i32,
    pub op: i32,
    pub count: usize,
    pub in_place: bool,
}

/// One case with its buffers filled and its op made, to be launched (alone, or with others
/// inside a group) and then checked.
pub struct Case<'a> {
    bufs: &'a mut CaseBufs,
    spec: Spec,
    root: usize,
    redop: i32,
    /// A PreMulSum op's scalar, which a call may read where it lies when it runs.
    _scalar: Box<[u8; 8]>,
    /// The call's send and receive pointers (the receive one null where `null_recv`), and
    /// where the receive part begins in its buffer (bytes).
    sendp: *const c_void,
    recvp: *mut c_void,
    recv_at: usize,
    /// A rank other than the root passes no receive buffer to a reduce or gather.
    null_recv: bool,
    what: String,
}

impl<'a> Case<'a> {
    /// Clears the buffers, fills the send part and makes the op.
    pub fn prepare(ctx: &Ctx, bufs: &'a mut CaseBufs, spec: Spec) -> Result<Case<'a>, String> {
        let Spec {
            coll,
            dt,
            op,
            count,
            in_place,
        } = spec;
        let (rank, n) = (ctx.rank, ctx.n);
        let es = size_of(dt);
        if bufs.shape != (coll, count, es) {
            return Err(format!(
                "buffers made for {:?} are used for {:?}",
                bufs.shape,
                (coll, count, es)
            ));
        }
        bufs.clear();
        let root = root_for(count, n);
        let what = format!(
            "{coll:?} count={count} op={op} in_place={in_place} root={root} rank={rank}/{n}"
        );
        let fill = |b: &mut [u8], r: usize| {
            for (j, e) in b.chunks_exact_mut(es).enumerate() {
                encode(dt, contribution(coll, dt, op, r, j), e);
            }
        };
        let send_elems = elems(coll, count, n).0;
        let mut scalar = Box::new([0u8; 8]);
        let redop = if reduces(coll) {
            make_op(ctx, dt, op, count % 2 == 1, &mut scalar)?
        } else {
            0
        };
        // In place: one buffer, with the send part where NCCL's rule puts it.
        let (send_at, recv_at) = if in_place {
            let (soff, roff) = in_place_offsets(coll, rank, root, count, es);
            if !(matches!(coll, Coll::Scatter) && rank != root) {
                fill(&mut bufs.big.data_mut()[soff..soff + send_elems * es], rank);
            }
            (soff, roff)
        } else {
            fill(bufs.send.data_mut(), rank);
            (0, 0)
        };
        let null_recv = !in_place
            && matches!(coll, Coll::Reduce | Coll::Gather)
            && rank != root
            && count % 2 == 0;
        let (send_base, recv_base) = if in_place {
            let big = bufs.big.ptr() as *mut u8;
            (big, big)
        } else {
            (bufs.send.ptr() as *mut u8, bufs.recv.ptr() as *mut u8)
        };
        // SAFETY: `send_at` is 0 or the in-place send part's offset inside `big`.
        let sendp = unsafe { send_base.add(send_at) } as *const c_void;
        let recvp = if null_recv {
            std::ptr::null_mut()
        } else {
            // SAFETY: `recv_at` is 0 or the in-place receive part's offset inside `big`.
            unsafe { recv_base.add(recv_at) as *mut c_void }
        };
        Ok(Case {
            bufs,
            spec,
            root,
            redop,
            _scalar: scalar,
            sendp,
            recvp,
            recv_at,
            null_recv,
            what,
        })
    }

    /// Makes the call (`Call::make`).
    pub fn launch(&self, ctx: &Ctx) -> Result<(), String> {
        nccl!(self.call(ctx));
        Ok(())
    }

    /// Makes the call and returns what the C API returned.
    ///
    /// # Safety
    /// As `Call::make`: the buffers are this case's own and `ctx.comm` is a communicator.
    pub unsafe fn call(&self, ctx: &Ctx) -> ncclResult_t {
        let call = Call {
            coll: self.spec.coll,
            dt: self.spec.dt,
            count: self.spec.count,
            redop: self.redop,
            root: self.root,
            rank: ctx.rank,
            n: ctx.n,
        };
        // SAFETY: the caller's promise.
        unsafe { call.make(self.sendp, self.recvp, ctx.comm, std::ptr::null_mut()) }
    }

    /// After the call (or its group) completed: destroys the op, then checks the canaries and
    /// every element of the output.
    pub fn check(self, ctx: &Ctx) -> Result<(), String> {
        if self.redop >= 5 {
            nccl!(ncclRedOpDestroy(self.redop, ctx.comm));
        }
        let CaseBufs {
            big,
            recv: recv_buf,
            send: send_buf,
            ..
        } = &*self.bufs;
        let what = &self.what;
        if !big.canaries_intact() || !recv_buf.canaries_intact() || !send_buf.canaries_intact() {
            return Err(format!("{what}: wrote outside its buffers"));
        }
        if self.null_recv {
            return Ok(());
        }
        let sp = self.spec;
        let es = size_of(sp.dt);
        let recv_elems = elems(sp.coll, sp.count, ctx.n).1;
        let out: &[u8] = if sp.in_place {
            &big.data()[self.recv_at..self.recv_at + recv_elems * es]
        } else {
            recv_buf.data()
        };
        verify(sp.coll, sp.dt, sp.op, ctx.rank, ctx.n, sp.count, what, out)
    }
}

/// Every collective x datatype x op, in place and out of place, at sizes 0, 1, 7 and one not
/// divisible by the rank count; with `large`, also 1 MiB + 3 elements (sums, and every
/// datatype of the collectives that do not reduce).
pub fn matrix(ctx: &Ctx, large: bool) -> Result<(), String> {
    let n = ctx.n;
    let mut sizes = vec![0usize, 1, 7, 5 * n + 1];
    if large {
        sizes.push((1 << 20) + 3);
    }
    for coll in COLLS {
        for &(dt, _, _) in DTYPES.iter() {
            let ops: Vec<i32> = if reduces(coll) {
                OPS.iter().map(|o| o.0).collect()
            } else {
                vec![0]
            };
            for &op in &ops {
                for &count in &sizes {
                    if count > 1000 && op != 0 {
                        continue;
                    }
                    for in_place in [false, true] {
                        if coll == Coll::SendRecv && in_place {
                            continue;
                        }
                        run_case(ctx, coll, dt, op, count, in_place)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Rank s sends (s + 2d) % 4 elements to rank d (zero-sized blocks included), at scattered
/// displacements, in place and out of place.
pub fn alltoallv_uneven(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let count = |s: usize, d: usize| (s + 2 * d) % 4;
    let value = |s: usize, d: usize, i: usize| (s * 10_000 + d * 100 + i) as i32;
    for in_place in [false, true] {
        // Displacements leave a gap of 3 elements between blocks.
        let sc: Vec<usize> = (0..n).map(|d| count(rank, d)).collect();
        let rc: Vec<usize> = (0..n).map(|s| count(s, rank)).collect();
        let mut sd = Vec::new();
        let mut at = 0;
        for &c in &sc {
            sd.push(at);
            at += c + 3;
        }
        let send_len = at;
        let mut rd = Vec::new();
        at = 1;
        for &c in &rc {
            rd.push(at);
            at += c + 3;
        }
        let recv_len = at;
        let mut send = vec![-1i32; send_len];
        for d in 0..n {
            for i in 0..sc[d] {
                send[sd[d] + i] = value(rank, d, i);
            }
        }
        let mut recv = vec![-7i32; recv_len.max(send_len)];
        if in_place {
            // The same displacements on both sides, so the blocks line up in one buffer.
            if sc != rc {
                continue;
            }
            recv[..send_len].copy_from_slice(&send);
            let p = recv.as_mut_ptr() as *mut c_void;
            nccl!(commAlltoAllv(
                p,
                sc.as_ptr(),
                sd.as_ptr(),
                p,
                sc.as_ptr(),
                sd.as_ptr(),
                2, /* int32 */
                comm,
                std::ptr::null_mut()
            ));
            for s in 0..n {
                for i in 0..rc[s] {
                    if recv[sd[s] + i] != value(s, rank, i) {
                        return Err(format!(
                            "in-place alltoallv from {s} element {i}: {}",
                            recv[sd[s] + i]
                        ));
                    }
                }
            }
            continue;
        }
        nccl!(commAlltoAllv(
            send.as_ptr() as *const c_void,
            sc.as_ptr(),
            sd.as_ptr(),
            recv.as_mut_ptr() as *mut c_void,
            rc.as_ptr(),
            rd.as_ptr(),
            2, /* int32 */
            comm,
            std::ptr::null_mut()
        ));
        let mut expect = vec![-7i32; recv.len()];
        for s in 0..n {
            for i in 0..rc[s] {
                expect[rd[s] + i] = value(s, rank, i);
            }
        }
        if recv != expect {
            return Err(format!(
                "alltoallv on rank {rank}: got {recv:?}, expected {expect:?}"
            ));
        }
    }
    Ok(())
}

/// Sends and receives `count` floats with `peer` in one group, checking that what arrives is
/// `peer`'s rank.
pub fn swap(c: ncclComm_t, me: usize, peer: usize, count: usize) -> Result<(), String> {
    const FLOAT: i32 = 7;
    let s: cudaStream_t = std::ptr::null_mut();
    let send = vec![me as f32; count];
    let mut recv = vec![0f32; count];
    nccl!(ncclGroupStart());
    nccl!(ncclSend(
        send.as_ptr() as *const c_void,
        count,
        FLOAT,
        peer as i32,
        c,
        s
    ));
    nccl!(ncclRecv(
        recv.as_mut_ptr() as *mut c_void,
        count,
        FLOAT,
        peer as i32,
        c,
        s
    ));
    nccl!(ncclGroupEnd());
    if recv.iter().any(|&v| v != peer as f32) {
        return Err(format!("from rank {peer}: {:?}", &recv[..4]));
    }
    Ok(())
}
