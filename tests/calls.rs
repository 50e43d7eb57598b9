//! Who may call into a communicator, and when a call completes.
//!
//! Calls on one communicator come one at a time (NCCL's rule): a second thread calling while
//! another is inside a call is refused with ncclInvalidUsage, and the first call completes
//! correctly; handing a communicator from thread to thread, one call after the other, works.
//! A non-blocking communicator (`config.blocking = 0`) returns ncclInProgress from its
//! collectives and group ends, completes them in the background as ncclCommGetAsyncError
//! reports, refuses a call made before that, and can be aborted mid-flight; `commSetBlocking`
//! turns it blocking after its init.

// The unsafe blocks here call the library's C API (ncclX/commX) with arguments the test
// itself made; what each call needs is in the C API's documentation, not repeated per block.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use comm::ffi::types::*;
use comm::ffi::*;
use common::*;
use std::os::raw::c_void;
use std::time::{Duration, Instant};

const SCENARIOS: &[(&str, Scenario)] = &[
    ("two_threads", two_threads),
    ("nonblocking", nonblocking),
    ("nonblocking_abort", nonblocking_abort),
];

const S: cudaStream_t = std::ptr::null_mut();
const FLOAT: i32 = 7;
const SUM: i32 = 0;

/// A handle that may cross threads (the test's threads take turns as the rule says, or are
/// meant to collide).
#[derive(Clone, Copy)]
struct Handle(ncclComm_t);
// SAFETY: a communicator may be used from any thread (the library's C API says so; calls on
// one at the same time are refused, which is what these tests check), so its handle may move.
unsafe impl Send for Handle {}

fn all_reduce(c: ncclComm_t, buf: &mut [f32]) -> ncclResult_t {
    let p = buf.as_mut_ptr() as *mut c_void;
    unsafe { ncclAllReduce(p, p, buf.len(), FLOAT, SUM, c, S) }
}

/// Rank 0's first thread starts an all-reduce that waits for rank 1, which comes late; while
/// it waits, a second thread calls on the same communicator and must be refused at once. The
/// first all-reduce is right, and threads taking turns then work.
fn two_threads(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let n = w.nranks as f32;
    if w.rank == 0 {
        let h = Handle(c);
        let first = std::thread::spawn(move || {
            let h = h;
            let mut buf = vec![1f32; 100_000];
            let r = all_reduce(h.0, &mut buf);
            (r, buf.iter().all(|&v| v == n), last_error())
        });
        std::thread::sleep(Duration::from_millis(300));
        let mut x = vec![5f32; 8];
        let t = Instant::now();
        let r = all_reduce(c, &mut x);
        let msg = last_error();
        if r != ncclResult_t::ncclInvalidUsage || !msg.contains("another thread") {
            return Err(format!("the second thread's call returned {r:?}: {msg}"));
        }
        if t.elapsed() > Duration::from_secs(1) || x != vec![5f32; 8] {
            return Err(format!(
                "the refused call took {:?} or touched its buffer: {x:?}",
                t.elapsed()
            ));
        }
        let (r, right, msg) = first.join().map_err(|_| "first thread panicked")?;
        if r != OK || !right {
            return Err(format!(
                "the first thread's all-reduce: {r:?} right={right} {msg}"
            ));
        }
    } else {
        std::thread::sleep(Duration::from_millis(1000));
        let mut buf = vec![1f32; 100_000];
        nccl!(all_reduce(c, &mut buf));
    }
    // Threads taking turns: each call on a thread of its own, one after the other.
    for i in 0..6 {
        let h = Handle(c);
        let r = std::thread::spawn(move || {
            let h = h;
            let mut buf = vec![i as f32; 33];
            (all_reduce(h.0, &mut buf), buf)
        })
        .join()
        .map_err(|_| "panicked")?;
        if r.0 != OK || r.1.iter().any(|&v| v != i as f32 * n) {
            return Err(format!(
                "turn {i}: {:?} {:?}: {}",
                r.0,
                &r.1[..2],
                last_error()
            ));
        }
    }
    nccl!(ncclCommDestroy(c));
    Ok(())
}

fn nonblocking_comm(w: &Worker) -> Result<ncclComm_t, String> {
    let mut cfg = config(0, c"nonblocking-calls");
    let mut c: ncclComm_t = std::ptr::null_mut();
    let r =
        unsafe { ncclCommInitRankConfig(&mut c, w.nranks as i32, w.id, w.rank as i32, &mut cfg) };
    match settled(c, r, Duration::from_secs(60)) {
        OK => Ok(c),
        other => Err(format!("non-blocking init: {other:?}: {}", last_error())),
    }
}

/// A collective on a non-blocking communicator returns ncclInProgress at once while rank 1 is
/// late, a call before it completes is refused, ncclCommGetAsyncError reports it done, and the
/// result is right; so is a group of calls, and a collective of every rank at once.
fn nonblocking(w: &Worker) -> Result<(), String> {
    let c = nonblocking_comm(w)?;
    let n = w.nranks as f32;
    let mut buf = vec![1f32; 4096];
    if w.rank == 1 {
        std::thread::sleep(Duration::from_millis(500));
    }
    let t = Instant::now();
    let r = all_reduce(c, &mut buf);
    if w.rank == 0 {
        if r != ncclResult_t::ncclInProgress || t.elapsed() > Duration::from_millis(300) {
            return Err(format!(
                "the all-reduce returned {r:?} after {:?}; it should return ncclInProgress at once",
                t.elapsed()
            ));
        }
        let mut state = OK;
        nccl!(ncclCommGetAsyncError(c, &mut state));
        if state != ncclResult_t::ncclInProgress {
            return Err(format!("the state while rank 1 is late is {state:?}"));
        }
        let mut other = vec![1f32; 4];
        let r2 = all_reduce(c, &mut other);
        let msg = last_error();
        if r2 != ncclResult_t::ncclInvalidUsage || !msg.contains("ncclCommGetAsyncError") {
            return Err(format!("a call while in progress returned {r2:?}: {msg}"));
        }
    }
    match settled(c, r, Duration::from_secs(60)) {
        OK => {}
        other => {
            return Err(format!(
                "the all-reduce ended with {other:?}: {}",
                last_error()
            ))
        }
    }
    if buf.iter().any(|&v| v != n) {
        return Err(format!("the all-reduce gave {:?}", &buf[..4]));
    }
    // A group: its end returns ncclInProgress or, if done already, ncclSuccess.
    let (mut a, mut b) = (vec![2f32; 7], vec![3f32; 1001]);
    nccl!(ncclGroupStart());
    let ra = all_reduce(c, &mut a);
    let rb = all_reduce(c, &mut b);
    let end = ncclGroupEnd();
    if ra != OK || rb != OK {
        return Err(format!("calls inside the group returned {ra:?} {rb:?}"));
    }
    match settled(c, end, Duration::from_secs(60)) {
        OK => {}
        other => return Err(format!("the group ended with {other:?}: {}", last_error())),
    }
    if a.iter().any(|&v| v != 2.0 * n) || b.iter().any(|&v| v != 3.0 * n) {
        return Err(format!("the group gave {:?} {:?}", &a[..2], &b[..2]));
    }
    // commSetBlocking: from now on calls complete before they return.
    nccl!(commSetBlocking(c, 1));
    let mut x = vec![4f32; 9];
    nccl!(all_reduce(c, &mut x));
    if x.iter().any(|&v| v != 4.0 * n) {
        return Err(format!("the blocking all-reduce gave {:?}", &x[..2]));
    }
    if commSetBlocking(c, 2) != ncclResult_t::ncclInvalidArgument {
        return Err("commSetBlocking(2) was accepted".into());
    }
    nccl!(ncclCommFinalize(c));
    nccl!(ncclCommDestroy(c));
    Ok(())
}

/// Rank 1 never joins the all-reduce; rank 0's returns ncclInProgress and ncclCommAbort stops
/// it at once. Rank 1 waits for the abort to reach it before leaving.
fn nonblocking_abort(w: &Worker) -> Result<(), String> {
    let c = nonblocking_comm(w)?;
    if w.rank == 0 {
        let mut buf = vec![1f32; 1 << 16];
        let r = all_reduce(c, &mut buf);
        if r != ncclResult_t::ncclInProgress {
            return Err(format!("the all-reduce returned {r:?}"));
        }
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        nccl!(ncclCommAbort(c));
        if t.elapsed() > Duration::from_secs(5) {
            return Err(format!("the abort took {:?}", t.elapsed()));
        }
        // The buffer is the caller's again: the background operation has ended.
        buf.fill(0.0);
    } else {
        std::thread::sleep(Duration::from_millis(1500));
        nccl!(ncclCommDestroy(c));
    }
    Ok(())
}

/// Runs `scenario` on `n` processes, each call bounded by COMM_TIMEOUT.
fn procs(scenario: &str, n: usize) {
    let r = launch(
        "worker",
        scenario,
        n,
        "",
        &[("COMM_TIMEOUT", "30")],
        Duration::from_secs(90),
    );
    assert_all_ok(&r, &format!("{scenario} with {n} ranks"));
}

#[test]
fn a_second_thread_in_a_call_is_refused_and_turns_work() {
    procs("two_threads", 2);
}

#[test]
fn nonblocking_collectives_complete_in_the_background() {
    for n in [2, 3] {
        procs("nonblocking", n);
    }
}

#[test]
fn a_nonblocking_collective_is_aborted_mid_flight() {
    procs("nonblocking_abort", 2);
}

scenario_tests!(SCENARIOS);
