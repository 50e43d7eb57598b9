//! Every collective x every datatype x every op, in place and out of place, at sizes 0, 1, 7,
//! not divisible by the rank count, and 1 MiB + 3 elements, checked element by element against
//! a reference, with 1, 2, 3, 4 and 8 ranks as processes and as threads.

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
fn passed_on(ctx: &Ctx, _level: &str) -> Result<(), String> {
    for (dt, op) in [(9, SUM), (2, AVG), (8, PREMULSUM), (0, MAX), (5, PROD)] {
        let count = (32 << 20) / size_of(dt) + 3;
        run_case(ctx, Coll::AllReduce, dt, op, count, false)?;
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
fn large_float_3_threads() {
    threads(3, "large", "", 10);
}
