//! Shared-memory links made at first use (NCCL_RUNTIME_CONNECT, on by default) between rank
//! processes: a rank maps the segments of the peers it talks to and no others, a peer that is
//! gone before its segment was mapped is named, an abort on a communicator whose links are
//! partly made reaches the peer that then uses one, and `NCCL_RUNTIME_CONNECT=0` maps every
//! peer at init. Threads of one process are covered by `ncclCommInitAll` here and by the unit
//! tests in `src/transport/shm/tests.rs`.

// The unsafe blocks here call the library's C API with arguments the test itself made.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use comm::ffi::types::*;
use comm::ffi::*;
use common::run::swap;
use common::*;
use std::os::raw::c_void;
use std::time::{Duration, Instant};

const FLOAT: i32 = 7;
const SUM: i32 = 0;
const S: cudaStream_t = std::ptr::null_mut();

/// The ranks other than `me` whose shared-memory segment this process maps (the segments are
/// memfds named after their owner, `comm-shm-r<rank>`).
fn mapped_peers(me: usize) -> Vec<usize> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut ranks: Vec<usize> = maps
        .lines()
        .filter_map(|l| l.split("/memfd:comm-shm-r").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .filter(|&r| r != me)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

fn all_reduce(c: ncclComm_t, n: usize) -> Result<(), String> {
    let send = vec![1f32; 1000];
    let mut recv = vec![0f32; 1000];
    nccl!(ncclAllReduce(
        send.as_ptr() as *const c_void,
        recv.as_mut_ptr() as *mut c_void,
        1000,
        FLOAT,
        SUM,
        c,
        S
    ));
    if recv.iter().any(|&v| v != n as f32) {
        return Err(format!("all-reduce gave {}", recv[0]));
    }
    Ok(())
}

/// arg `demand` or `init`: each rank swaps messages (small, then pulled) with its partner
/// (rank ^ 1) only, and then maps that partner's segment only (on demand) or every peer's (at
/// init); an all-reduce afterwards still works.
fn partners(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let all: Vec<usize> = (0..w.nranks).filter(|&r| r != w.rank).collect();
    if w.arg == "demand" && !mapped_peers(w.rank).is_empty() {
        return Err(format!("mapped at init: {:?}", mapped_peers(w.rank)));
    }
    let partner = w.rank ^ 1;
    swap(c, w.rank, partner, 16)?;
    swap(c, w.rank, partner, 1 << 20)?;
    let want = if w.arg == "demand" {
        vec![partner]
    } else {
        all.clone()
    };
    if mapped_peers(w.rank) != want {
        return Err(format!(
            "maps the segments of {:?}, expected {want:?}",
            mapped_peers(w.rank)
        ));
    }
    all_reduce(c, w.nranks)?;
    nccl!(ncclCommDestroy(c));
    Ok(())
}

/// Rank 2 exits right after init, before anyone mapped its segment; rank 0's first send to it
/// fails naming it, without waiting for a timeout.
fn gone_before_mapped(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    match w.rank {
        2 => std::process::exit(0),
        0 => {
            // The launcher reaps rank 2 within milliseconds of its exit.
            std::thread::sleep(Duration::from_millis(500));
            let data = [1f32; 8];
            let t = Instant::now();
            let r = unsafe { ncclSend(data.as_ptr() as *const c_void, 8, FLOAT, 2, c, S) };
            let msg = last_error();
            if r == OK || !msg.contains("rank 2") || !msg.contains("exited") {
                return Err(format!("send to a gone rank: {r:?}: {msg}"));
            }
            if t.elapsed() > Duration::from_secs(5) {
                return Err(format!("the error took {:?}", t.elapsed()));
            }
            unsafe { ncclCommAbort(c) };
        }
        _ => {
            std::thread::sleep(Duration::from_millis(1000));
            nccl!(ncclCommDestroy(c));
        }
    }
    Ok(())
}

/// Ranks 0 and 1 talk, 2 and 3 do not; then rank 2 aborts, which frees its segment. Rank 0's
/// first receive from rank 2 (whose link neither has made) fails naming it; everyone ends.
fn abort_half_connected(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    if w.rank < 2 {
        swap(c, w.rank, w.rank ^ 1, 64)?;
    }
    match w.rank {
        2 => {
            nccl!(ncclCommAbort(c));
            // Alive while rank 0 looks: the abort, not an exit, is what it must find.
            std::thread::sleep(Duration::from_millis(1500));
        }
        0 => {
            std::thread::sleep(Duration::from_millis(300));
            let mut data = [0f32; 8];
            let t = Instant::now();
            let r = unsafe { ncclRecv(data.as_mut_ptr() as *mut c_void, 8, FLOAT, 2, c, S) };
            let msg = last_error();
            // Its segment went with its communicator; the abort left a note in rank 0's.
            if r == OK || !msg.contains("rank 2 aborted its communicator") {
                return Err(format!("receive from an aborted rank: {r:?}: {msg}"));
            }
            if t.elapsed() > Duration::from_secs(5) {
                return Err(format!("the error took {:?}", t.elapsed()));
            }
            unsafe { ncclCommAbort(c) };
        }
        _ => nccl!(ncclCommAbort(c)),
    }
    Ok(())
}

/// Rank 1's init fails after it announced its segment; the others' init fails too, at once,
/// naming it (the links are not made yet, so only init's last barrier can tell them).
fn peer_init_fails(w: &Worker) -> Result<(), String> {
    a_peers_init_fails(w, "rank 1", Duration::from_secs(2))
}

/// Rank 1 sends to rank 2 and destroys its communicator at once; rank 2 first uses the link
/// afterwards, finds the segment freed, and still receives what was sent (it lies in rank 2's
/// own segment); a second receive fails naming rank 1.
fn sent_then_destroyed(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let data = [7f32; 4];
    match w.rank {
        1 => {
            nccl!(ncclSend(data.as_ptr() as *const c_void, 4, FLOAT, 2, c, S));
            nccl!(ncclCommDestroy(c));
            std::thread::sleep(Duration::from_millis(1000));
            return Ok(());
        }
        2 => {
            std::thread::sleep(Duration::from_millis(300));
            let mut got = [0f32; 4];
            nccl!(ncclRecv(got.as_mut_ptr() as *mut c_void, 4, FLOAT, 1, c, S));
            if got != data {
                return Err(format!("received {got:?}"));
            }
            let t = Instant::now();
            let r = unsafe { ncclRecv(got.as_mut_ptr() as *mut c_void, 4, FLOAT, 1, c, S) };
            let msg = last_error();
            if r == OK || !msg.contains("rank 1") || t.elapsed() > Duration::from_secs(5) {
                return Err(format!(
                    "a second receive: {r:?} after {:?}: {msg}",
                    t.elapsed()
                ));
            }
            unsafe { ncclCommAbort(c) };
            return Ok(());
        }
        _ => {}
    }
    nccl!(ncclCommDestroy(c));
    Ok(())
}

const SCENARIOS: &[(&str, Scenario)] = &[
    ("sent_then_destroyed", sent_then_destroyed),
    ("partners", partners),
    ("gone_before_mapped", gone_before_mapped),
    ("abort_half_connected", abort_half_connected),
    ("peer_init_fails", peer_init_fails),
];

scenario_tests!(SCENARIOS);

fn procs(scenario: &str, n: usize, arg: &str, env: &[(&str, &str)]) {
    let r = launch("worker", scenario, n, arg, env, Duration::from_secs(60));
    assert_all_ok(&r, &format!("{scenario} {arg} with {n} processes"));
}

#[test]
fn a_rank_maps_the_segments_of_the_peers_it_talks_to_only() {
    procs("partners", 4, "demand", &[]);
}

#[test]
fn without_runtime_connect_every_segment_is_mapped_at_init() {
    procs("partners", 4, "init", &[("NCCL_RUNTIME_CONNECT", "0")]);
}

#[test]
fn a_peer_gone_before_its_segment_was_mapped_is_named() {
    procs("gone_before_mapped", 3, "", &[]);
}

#[test]
fn an_abort_on_a_half_connected_communicator_reaches_the_peer_that_looks() {
    procs("abort_half_connected", 4, "", &[]);
}

#[test]
fn what_a_peer_sent_before_it_destroyed_arrives_though_its_segment_was_never_mapped() {
    procs(
        "sent_then_destroyed",
        3,
        "",
        &[("COMM_DEBUG", "TRACE"), ("COMM_DEBUG_SUBSYS", "ALL")],
    );
}

#[test]
fn a_peer_whose_init_fails_fails_the_others_at_once_on_demand() {
    procs("peer_init_fails", 3, "", &[("COMM_INIT_TIMEOUT", "60")]);
}

/// Ranks that are threads of this process (`ncclCommInitAll`), links made at first use:
/// partners swap, then all-reduce.
#[test]
fn threads_connect_on_demand() {
    const N: usize = 4;
    let mut comms = vec![std::ptr::null_mut(); N];
    let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), N as i32, std::ptr::null()) };
    assert_eq!(r, ncclResult_t::ncclSuccess, "{}", last_error());
    let comms: Vec<usize> = comms.into_iter().map(|c| c as usize).collect();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (me, &c) in comms.iter().enumerate() {
            s.spawn(move || {
                let c = c as ncclComm_t;
                swap(c, me, me ^ 1, 16).unwrap();
                swap(c, me, me ^ 1, 1 << 20).unwrap();
                all_reduce(c, N).unwrap();
                assert_eq!(unsafe { ncclCommDestroy(c) }, ncclResult_t::ncclSuccess);
            });
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(60));
}
