//! Every collective x every datatype x every op, in place and out of place, at sizes 0, 1, 7,
//! not divisible by the rank count, and 1 MiB + 3 elements, checked element by element against
//! a reference, with 1, 2, 3, 4 and 8 ranks as processes and as threads.

mod common;

use comm::ffi::types::*;
use comm::ffi::*;
use common::cases::*;
use common::values::*;
use common::*;
use std::os::raw::c_void;
use std::time::Duration;

const GUARD: usize = 64;
const CANARY: u8 = 0xa5;

/// A buffer with canaries on both sides, to catch writes out of bounds.
struct Buf {
    bytes: Vec<u8>,
    len: usize,
}

impl Buf {
    fn new(len: usize) -> Buf {
        Buf {
            bytes: vec![CANARY; len + 2 * GUARD],
            len,
        }
    }
    fn ptr(&mut self) -> *mut c_void {
        unsafe { self.bytes.as_mut_ptr().add(GUARD) as *mut c_void }
    }
    fn data(&self) -> &[u8] {
        &self.bytes[GUARD..GUARD + self.len]
    }
    fn data_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[GUARD..GUARD + self.len]
    }
    fn canaries_intact(&self) -> bool {
        self.bytes[..GUARD].iter().all(|&b| b == CANARY)
            && self.bytes[GUARD + self.len..].iter().all(|&b| b == CANARY)
    }
}

struct Ctx {
    comm: ncclComm_t,
    rank: usize,
    n: usize,
}

/// The op value to pass for `op` on `dt` (creating the PreMulSum op when needed).
fn make_op(
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

/// Runs one case and checks every element of the result (and the canaries).
fn run_case(
    ctx: &Ctx,
    coll: Coll,
    dt: i32,
    op: i32,
    count: usize,
    in_place: bool,
) -> Result<(), String> {
    let (rank, n) = (ctx.rank, ctx.n);
    let es = size_of(dt);
    let root = root_for(count, n);
    let what =
        format!("{coll:?} count={count} op={op} in_place={in_place} root={root} rank={rank}/{n}");
    let fill = |b: &mut [u8], r: usize| {
        for (j, e) in b.chunks_exact_mut(es).enumerate() {
            encode(dt, contribution(coll, dt, op, r, j), e);
        }
    };
    let (send_elems, recv_elems) = elems(coll, count, n);
    let mut scalar_store = [0u8; 8];
    let redop = if reduces(coll) {
        make_op(ctx, dt, op, count % 2 == 1, &mut scalar_store)?
    } else {
        0
    };
    // In place: one buffer, with the send part where NCCL's rule puts it.
    let mut big = Buf::new(send_elems.max(recv_elems) * es);
    let mut recv_buf = Buf::new(recv_elems * es);
    let mut send_buf = Buf::new(send_elems * es);
    let (sendp, recvp): (*const c_void, *mut c_void);
    if in_place {
        let base = big.ptr() as *mut u8;
        let (soff, roff) = in_place_offsets(coll, rank, root, count, es);
        let s = unsafe { std::slice::from_raw_parts_mut(base.add(soff), send_elems * es) };
        if !(matches!(coll, Coll::Scatter) && rank != root) {
            fill(s, rank);
        }
        sendp = unsafe { base.add(soff) } as *const c_void;
        recvp = unsafe { base.add(roff) } as *mut c_void;
    } else {
        fill(send_buf.data_mut(), rank);
        sendp = send_buf.ptr();
        recvp = recv_buf.ptr();
    }
    let null_recv =
        !in_place && matches!(coll, Coll::Reduce | Coll::Gather) && rank != root && count % 2 == 0;
    let recvp = if null_recv {
        std::ptr::null_mut()
    } else {
        recvp
    };
    let c = ctx.comm;
    let s = std::ptr::null_mut();
    match coll {
        Coll::AllReduce => nccl!(ncclAllReduce(sendp, recvp, count, dt, redop, c, s)),
        Coll::Broadcast => nccl!(ncclBroadcast(sendp, recvp, count, dt, root as i32, c, s)),
        Coll::Reduce => nccl!(ncclReduce(
            sendp,
            recvp,
            count,
            dt,
            redop,
            root as i32,
            c,
            s
        )),
        Coll::AllGather => nccl!(ncclAllGather(sendp, recvp, count, dt, c, s)),
        Coll::ReduceScatter => nccl!(ncclReduceScatter(sendp, recvp, count, dt, redop, c, s)),
        Coll::AlltoAll => nccl!(ncclAlltoAll(sendp, recvp, count, dt, c, s)),
        Coll::Gather => nccl!(ncclGather(sendp, recvp, count, dt, root as i32, c, s)),
        Coll::Scatter => nccl!(ncclScatter(sendp, recvp, count, dt, root as i32, c, s)),
        Coll::SendRecv => {
            // A ring shift inside one group: everyone sends before anyone receives.
            nccl!(ncclGroupStart());
            nccl!(ncclSend(sendp, count, dt, ((rank + 1) % n) as i32, c, s));
            nccl!(ncclRecv(
                recvp,
                count,
                dt,
                ((rank + n - 1) % n) as i32,
                c,
                s
            ));
            nccl!(ncclGroupEnd());
        }
    }
    if redop >= 5 {
        nccl!(ncclRedOpDestroy(redop, c));
    }
    if !big.canaries_intact() || !recv_buf.canaries_intact() || !send_buf.canaries_intact() {
        return Err(format!("{what}: wrote outside its buffers"));
    }
    if null_recv {
        return Ok(());
    }
    let out: &[u8] = if in_place {
        let roff = recvp as usize - big.ptr() as usize;
        &big.data()[roff..roff + recv_elems * es]
    } else {
        recv_buf.data()
    };
    verify(coll, dt, op, rank, n, count, &what, out)
}

/// The whole matrix on one communicator. `level` "full" adds 1 MiB + 3 elements (sum and the
/// non-reducing collectives, every datatype).
fn matrix(ctx: &Ctx, level: &str) -> Result<(), String> {
    let n = ctx.n;
    let mut sizes = vec![0usize, 1, 7, 5 * n + 1];
    if level == "full" {
        sizes.push((1 << 20) + 3);
    }
    for coll in COLLS {
        for &(dt, _, _) in DTYPES.iter() {
            let ops: Vec<i32> = if reduces(coll) {
                OPS.iter().map(|o| o.0).collect()
            } else {
                vec![SUM]
            };
            for &op in &ops {
                for &count in &sizes {
                    if count > 1000 && op != SUM {
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

/// Large float sums: 64 MiB all-reduce / reduce-scatter / all-gather / broadcast.
fn large(ctx: &Ctx) -> Result<(), String> {
    let count = (64 << 20) / 4;
    run_case(ctx, Coll::AllReduce, 7, SUM, count, false)?;
    run_case(ctx, Coll::AllReduce, 7, SUM, count, true)?;
    run_case(ctx, Coll::ReduceScatter, 7, SUM, count / ctx.n, false)?;
    run_case(ctx, Coll::AllGather, 7, SUM, count / ctx.n, true)?;
    run_case(ctx, Coll::Broadcast, 7, SUM, count, false)
}

fn scenario(comm: ncclComm_t, rank: usize, n: usize, name: &str, arg: &str) -> Result<(), String> {
    let ctx = Ctx { comm, rank, n };
    match name {
        "matrix" => matrix(&ctx, arg),
        "large" => large(&ctx),
        other => Err(format!("unknown scenario {other}")),
    }
}

#[test]
fn worker() {
    if let Some(w) = worker_env() {
        finish((|| {
            let comm = init_rank(&w)?;
            scenario(comm, w.rank, w.nranks, &w.scenario, &w.arg)?;
            nccl!(ncclCommDestroy(comm));
            Ok(())
        })());
    }
}

fn processes(n: usize, scenario_name: &str, level: &str, minutes: u64) {
    let r = launch(
        "worker",
        scenario_name,
        n,
        level,
        &[],
        Duration::from_secs(60 * minutes),
    );
    assert_all_ok(&r, &format!("{scenario_name} with {n} processes"));
}

fn threads(n: usize, scenario_name: &'static str, level: &'static str, minutes: u64) {
    with_threads(n, Duration::from_secs(60 * minutes), move |c, rank, n| {
        scenario(c, rank, n, scenario_name, level)
    });
}

#[test]
fn matrix_1_process() {
    processes(1, "matrix", "full", 5);
}

#[test]
fn matrix_2_processes() {
    processes(2, "matrix", "full", 10);
}

#[test]
fn matrix_3_processes() {
    processes(3, "matrix", "full", 10);
}

#[test]
fn matrix_4_processes() {
    processes(4, "matrix", "full", 15);
}

#[test]
fn matrix_8_processes() {
    processes(8, "matrix", "small", 15);
}

#[test]
fn matrix_1_thread() {
    threads(1, "matrix", "small", 5);
}

#[test]
fn matrix_2_threads() {
    threads(2, "matrix", "small", 10);
}

#[test]
fn matrix_3_threads() {
    threads(3, "matrix", "full", 10);
}

#[test]
fn matrix_4_threads() {
    threads(4, "matrix", "small", 10);
}

#[test]
fn matrix_8_threads() {
    threads(8, "matrix", "small", 15);
}

#[test]
fn large_float_2_processes() {
    processes(2, "large", "", 10);
}

#[test]
fn large_float_3_threads() {
    threads(3, "large", "", 10);
}
