//! Every collective x every datatype x every op, in place and out of place, at sizes 0, 1, 7,
//! not divisible by the rank count, and 1 MiB + 3 elements, checked element by element against
//! a reference, with 1, 2, 3, 4 and 8 ranks as processes and as threads.

// The unsafe blocks here call the library's C API (ncclX/commX) with arguments the test
// itself made; what each call needs is in the C API's documentation, not repeated per block.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use comm::ffi::types::*;
use comm::ffi::*;
use common::cases::*;
use common::run::*;
use common::values::*;
use common::*;
use std::time::Duration;

/// A scenario's body: it runs on a communicator of every rank, processes or threads, with the
/// launch argument (the matrix's level).
type Body = fn(&Ctx, &str) -> Result<(), String>;

/// Every scenario by name: the process tests launch one, the thread tests call one.
const SCENARIOS: &[(&str, Body)] = &[
    ("matrix", matrix_at_level),
    ("large", large),
    ("passed_on", passed_on),
    ("repeats", repeats),
];

/// The collective x datatype x op matrix: "full" or the small set.
fn matrix_at_level(ctx: &Ctx, level: &str) -> Result<(), String> {
    matrix(ctx, level == "full")
}

/// Large float sums: 64 MiB all-reduce / reduce-scatter / all-gather / broadcast.
fn large(ctx: &Ctx, _level: &str) -> Result<(), String> {
    let count = (64 << 20) / 4;
    run_case(ctx, Coll::AllReduce, 7, SUM, count, false)?;
    run_case(ctx, Coll::AllReduce, 7, SUM, count, true)?;
    run_case(ctx, Coll::ReduceScatter, 7, SUM, count / ctx.n, false)?;
    run_case(ctx, Coll::AllGather, 7, SUM, count / ctx.n, true)?;
    run_case(ctx, Coll::Broadcast, 7, SUM, count, false)
}

/// Out-of-place all-reduces of 32 MiB and more (plus an odd element), which two processes fold
/// and pass on slice by slice, the folded bytes going into the FIFO's slots and, with
/// non-temporal stores, into the receive buffer as they are folded: a narrow float, an
/// integer average (its division comes after the fold), a scaled sum, one-byte elements and a
/// product.
/// Then one such call again and again on the same buffers, which the default setting
/// (COMM_SHM_REPLY=auto) times and sends back one way and the other (`exec::replies`); the
/// tests run it with each way set too.
fn passed_on(ctx: &Ctx, _level: &str) -> Result<(), String> {
    for (dt, op) in [(9, SUM), (2, AVG), (8, PREMULSUM), (0, MAX), (5, PROD)] {
        let count = (32 << 20) / size_of(dt) + 3;
        run_case(ctx, Coll::AllReduce, dt, op, count, false)?;
    }
    let count = (32 << 20) / 4 + 3;
    let mut bufs = CaseBufs::new(Coll::AllReduce, count, ctx.n, 4);
    for op in [SUM, SUM, MAX, SUM, SUM, SUM, MAX, SUM] {
        run_case_on(ctx, &mut bufs, Coll::AllReduce, 7, op, count, false)?;
    }
    Ok(())
}

/// Calls repeated on the same buffers and on others, which run again without being checked and
/// built anew (`Comm::again`), and calls that differ from the one before in one respect only:
/// a datatype of the same width, the op, in place or not. Every output is cleared before the
/// call and checked element by element. Then a PreMulSum scalar whose value changes between two equal
/// calls, and sends and receives outside a group, repeated.
fn repeats(ctx: &Ctx, _level: &str) -> Result<(), String> {
    let n = ctx.n;
    // Pairs of one width: float and int32, double and int64, half and bfloat16, int8 and uint8.
    let pairs = [(7, 2), (8, 4), (6, 9), (0, 1)];
    for coll in COLLS.into_iter().filter(|&c| c != Coll::SendRecv) {
        let ops: &[i32] = if reduces(coll) {
            &[SUM, SUM, MAX, MAX, AVG]
        } else {
            &[SUM]
        };
        for count in [1, 5 * n + 1] {
            for (a, b) in pairs {
                // Two sets of buffers: a call repeated on other buffers takes the short way too.
                let mut bufs = [0, 1].map(|_| CaseBufs::new(coll, count, n, size_of(a)));
                for in_place in [false, true, false] {
                    for &op in ops {
                        for (i, dt) in [a, a, a, a, b, b, a].into_iter().enumerate() {
                            let on = &mut bufs[i / 2 % 2];
                            run_case_on(ctx, on, coll, dt, op, count, in_place)?;
                        }
                    }
                }
            }
        }
    }
    changing_scalar(ctx)?;
    repeated_sends(ctx)
}

/// A PreMulSum op whose scalar lives at a host address: a call reads the value in force when
/// it runs, so the same call again after the value changed scales by the new one.
fn changing_scalar(ctx: &Ctx) -> Result<(), String> {
    let (c, count) = (ctx.comm, 5usize);
    // Written through the pointer the op holds, behind the compiler's back.
    let scalar: *mut f32 = Box::into_raw(Box::new(2.0f32));
    let mut op = 0;
    nccl!(ncclRedOpCreatePreMulSum(
        &mut op,
        scalar as *mut std::os::raw::c_void,
        7,
        0,
        c
    ));
    let send: Vec<f32> = (0..count).map(|j| (ctx.rank + j) as f32).collect();
    let mut recv = vec![0f32; count];
    for s in [2.0f32, 3.0, 3.0, 5.0] {
        // SAFETY: `scalar` is the live box made above, and no call that reads it is running.
        unsafe { scalar.write_volatile(s) };
        recv.fill(-1.0);
        nccl!(ncclAllReduce(
            send.as_ptr() as *const _,
            recv.as_mut_ptr() as *mut _,
            count,
            7,
            op,
            c,
            std::ptr::null_mut()
        ));
        for (j, &got) in recv.iter().enumerate() {
            let want = s * (0..ctx.n).map(|r| (r + j) as f32).sum::<f32>();
            if got != want {
                return Err(format!(
                    "PreMulSum with scalar {s}: element {j} is {got}, expected {want}"
                ));
            }
        }
    }
    nccl!(ncclRedOpDestroy(op, c));
    // SAFETY: `scalar` came from `Box::into_raw` above, and the op that read it is destroyed.
    drop(unsafe { Box::from_raw(scalar) });
    Ok(())
}

/// Ranks in pairs (0 with 1, 2 with 3, ...; an odd last rank sits out) exchange a message each
/// way with plain sends and receives, the lower rank sending first, several times over the
/// same buffers.
fn repeated_sends(ctx: &Ctx) -> Result<(), String> {
    let (c, rank) = (ctx.comm, ctx.rank);
    let peer = rank ^ 1;
    if peer >= ctx.n {
        return Ok(());
    }
    let count = 7usize;
    let mut send = vec![0i32; count];
    let mut recv = vec![0i32; count];
    for round in 0..4i32 {
        for (j, v) in send.iter_mut().enumerate() {
            *v = round * 1000 + rank as i32 * 100 + j as i32;
        }
        recv.fill(-1);
        let s = std::ptr::null_mut();
        let (sp, rp) = (send.as_ptr() as *const _, recv.as_mut_ptr() as *mut _);
        if rank < peer {
            nccl!(ncclSend(sp, count, 2, peer as i32, c, s));
            nccl!(ncclRecv(rp, count, 2, peer as i32, c, s));
        } else {
            nccl!(ncclRecv(rp, count, 2, peer as i32, c, s));
            nccl!(ncclSend(sp, count, 2, peer as i32, c, s));
        }
        for (j, &got) in recv.iter().enumerate() {
            let want = round * 1000 + peer as i32 * 100 + j as i32;
            if got != want {
                return Err(format!(
                    "round {round}: element {j} from rank {peer} is {got}, expected {want}"
                ));
            }
        }
    }
    Ok(())
}

fn scenario(comm: ncclComm_t, rank: usize, n: usize, name: &str, arg: &str) -> Result<(), String> {
    let body = find_scenario(SCENARIOS, name)?;
    body(&Ctx { comm, rank, n }, arg)
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

#[test]
fn scenario_names_are_distinct() {
    assert_distinct_names(SCENARIOS);
}

fn processes(n: usize, scenario_name: &str, level: &str, minutes: u64) {
    processes_with(n, scenario_name, level, minutes, &[]);
}

fn processes_with(n: usize, scenario_name: &str, level: &str, minutes: u64, env: &[(&str, &str)]) {
    let r = launch(
        "worker",
        scenario_name,
        n,
        level,
        env,
        Duration::from_secs(60 * minutes),
    );
    assert_all_ok(&r, &format!("{scenario_name} with {n} processes {env:?}"));
}

/// The transport axis: the same cases with every rank on the TCP transport.
const SOCKET: &[(&str, &str)] = &[("COMM_SHM_DISABLE", "1")];

#[test]
fn matrix_2_processes_socket() {
    processes_with(2, "matrix", "full", 10, SOCKET);
}

#[test]
fn matrix_3_processes_socket() {
    processes_with(3, "matrix", "full", 10, SOCKET);
}

#[test]
fn matrix_4_processes_socket() {
    processes_with(4, "matrix", "small", 10, SOCKET);
}

#[test]
fn large_float_3_processes_socket() {
    processes_with(3, "large", "", 10, SOCKET);
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
fn passed_on_2_processes() {
    processes(2, "passed_on", "", 10);
}

#[test]
fn passed_on_2_threads() {
    threads(2, "passed_on", "", 10);
}

#[test]
fn passed_on_2_processes_forwarded() {
    processes_with(2, "passed_on", "", 10, &[("COMM_SHM_REPLY", "forward")]);
}

#[test]
fn passed_on_2_processes_written_back() {
    processes_with(2, "passed_on", "", 10, &[("COMM_SHM_REPLY", "writeback")]);
}

#[test]
fn repeats_1_process() {
    processes(1, "repeats", "", 5);
}

/// Two ranks: broadcasts, reduces, sends and receives are one step per rank, tried straight
/// on the link when repeated (`exec::host::one_step`).
#[test]
fn repeats_2_processes() {
    processes(2, "repeats", "", 5);
}

#[test]
fn repeats_3_processes() {
    processes(3, "repeats", "", 5);
}

#[test]
fn repeats_4_threads() {
    threads(4, "repeats", "", 5);
}

#[test]
fn large_float_3_threads() {
    threads(3, "large", "", 10);
}
