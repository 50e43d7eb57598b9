//! The shape of one collective test case, shared by the host tests and the device suite: which
//! collectives there are, how many elements each side holds, where the in-place send part
//! lives, what each rank contributes and what every output element must be.

use super::values::*;
use comm::ffi::types::*;
use comm::ffi::*;
use std::os::raw::c_void;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coll {
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

pub const COLLS: [Coll; 9] = [
    Coll::AllReduce,
    Coll::Broadcast,
    Coll::Reduce,
    Coll::AllGather,
    Coll::ReduceScatter,
    Coll::AlltoAll,
    Coll::Gather,
    Coll::Scatter,
    Coll::SendRecv,
];

pub fn reduces(c: Coll) -> bool {
    matches!(c, Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter)
}

/// The root a case uses: it moves with the count so that every rank gets to be one.
pub fn root_for(count: usize, n: usize) -> usize {
    (count + 1) % n
}

/// Elements in the send and the receive buffer of one rank.
pub fn elems(c: Coll, count: usize, n: usize) -> (usize, usize) {
    match c {
        Coll::AllReduce | Coll::Broadcast | Coll::Reduce | Coll::SendRecv => (count, count),
        Coll::AllGather | Coll::Gather => (count, count * n),
        Coll::ReduceScatter | Coll::Scatter => (count * n, count),
        Coll::AlltoAll => (count * n, count * n),
    }
}

/// In place, one buffer holds both sides: the byte offsets of the send and receive parts in it,
/// where NCCL's in-place rule puts them.
pub fn in_place_offsets(
    c: Coll,
    rank: usize,
    root: usize,
    count: usize,
    es: usize,
) -> (usize, usize) {
    match c {
        Coll::AllGather => (rank * count * es, 0),
        Coll::Gather if rank == root => (root * count * es, 0),
        Coll::ReduceScatter => (0, rank * count * es),
        Coll::Scatter if rank == root => (0, root * count * es),
        _ => (0, 0),
    }
}

/// Element `j` of rank `r`'s send buffer.
pub fn contribution(c: Coll, dt: i32, op: i32, r: usize, j: usize) -> f64 {
    if reduces(c) {
        input(dt, op, r, j)
    } else {
        payload(dt, r, j)
    }
}

/// Whether this rank's receive buffer holds a result to check.
pub fn has_output(c: Coll, rank: usize, root: usize) -> bool {
    !(matches!(c, Coll::Reduce | Coll::Gather) && rank != root)
}

/// Checks every element of `out`, this rank's receive buffer, against the reference.
#[allow(clippy::too_many_arguments)]
pub fn verify(
    c: Coll,
    dt: i32,
    op: i32,
    rank: usize,
    n: usize,
    count: usize,
    what: &str,
    out: &[u8],
) -> Result<(), String> {
    let root = root_for(count, n);
    if !has_output(c, rank, root) {
        return Ok(());
    }
    let val = |r: usize, j: usize| contribution(c, dt, op, r, j);
    let all = |j: usize| (0..n).map(|r| val(r, j)).collect::<Vec<f64>>();
    let cnt = count.max(1);
    match c {
        Coll::AllReduce | Coll::Reduce => check(dt, op, n, what, out, |i| reduce(dt, op, &all(i))),
        Coll::Broadcast => check(dt, op, n, what, out, |i| val(root, i)),
        Coll::AllGather | Coll::Gather => check(dt, op, n, what, out, |i| val(i / cnt, i % cnt)),
        Coll::ReduceScatter => check(dt, op, n, what, out, |i| {
            reduce(dt, op, &all(rank * count + i))
        }),
        Coll::AlltoAll => check(dt, op, n, what, out, |i| {
            val(i / cnt, rank * count + i % cnt)
        }),
        Coll::Scatter => check(dt, op, n, what, out, |i| val(root, rank * count + i)),
        Coll::SendRecv => check(dt, op, n, what, out, |i| val((rank + n - 1) % n, i)),
    }
}

/// The call a case makes, on rank `rank` of `n`: the collective `coll` of `count` elements of
/// `dt`, with `redop` where it reduces and the case's `root`.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    pub coll: Coll,
    pub dt: i32,
    pub count: usize,
    pub redop: i32,
    pub root: usize,
    pub rank: usize,
    pub n: usize,
}

impl Call {
    /// Makes the call from `send` into `recv` on `comm` and `stream`: the first result that
    /// is not a success, as the C API gives it. A send and receive is a ring shift inside a
    /// group of its own (everyone sends before anyone receives), which nests in an open one.
    ///
    /// # Safety
    /// The buffers and the communicator must be what the C API requires of such a call.
    pub unsafe fn make(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t {
        let (c, s, root) = (comm, stream, self.root as i32);
        let (dt, count, redop) = (self.dt, self.count, self.redop);
        // SAFETY: each arm is one C API call with the caller's buffers, communicator and
        // stream, which the caller promises suit it (# Safety), and this case's own counts.
        unsafe {
            match self.coll {
                Coll::AllReduce => ncclAllReduce(send, recv, count, dt, redop, c, s),
                Coll::Broadcast => ncclBroadcast(send, recv, count, dt, root, c, s),
                Coll::Reduce => ncclReduce(send, recv, count, dt, redop, root, c, s),
                Coll::AllGather => ncclAllGather(send, recv, count, dt, c, s),
                Coll::ReduceScatter => ncclReduceScatter(send, recv, count, dt, redop, c, s),
                Coll::AlltoAll => ncclAlltoAll(send, recv, count, dt, c, s),
                Coll::Gather => ncclGather(send, recv, count, dt, root, c, s),
                Coll::Scatter => ncclScatter(send, recv, count, dt, root, c, s),
                Coll::SendRecv => {
                    let (rank, n) = (self.rank, self.n);
                    let (next, prev) = (((rank + 1) % n) as i32, ((rank + n - 1) % n) as i32);
                    let ok = ncclResult_t::ncclSuccess;
                    let mut r = ncclGroupStart();
                    if r == ok {
                        r = ncclSend(send, count, dt, next, c, s);
                    }
                    if r == ok {
                        r = ncclRecv(recv, count, dt, prev, c, s);
                    }
                    if r == ok {
                        r = ncclGroupEnd();
                    }
                    r
                }
            }
        }
    }
}
