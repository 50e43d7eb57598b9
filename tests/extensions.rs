//! comm's extensions and the remaining API promises: all-to-all-v with uneven blocks, bitwise
//! reductions, nested groups, and log lines that carry host, pid and rank.

// The unsafe blocks here call the library's C API (ncclX/commX) with arguments the test
// itself made; what each call needs is in the C API's documentation, not repeated per block.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use comm::ffi::types::*;
use comm::ffi::*;
use common::*;
use std::os::raw::c_void;
use std::time::Duration;

const S: cudaStream_t = std::ptr::null_mut();
const INT32: i32 = 2;
const FLOAT: i32 = 7;

fn bitwise(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    for (op, fold) in [
        (COMM_OP_BAND, (|a, b| a & b) as fn(u32, u32) -> u32),
        (COMM_OP_BOR, |a, b| a | b),
        (COMM_OP_BXOR, |a, b| a ^ b),
    ] {
        let input = |r: usize, i: usize| {
            (0x9e37_79b9u32.wrapping_mul((r * 131 + i) as u32 + 1)) | (1 << (i % 32))
        };
        let send: Vec<u32> = (0..1000).map(|i| input(rank, i)).collect();
        let mut recv = vec![0u32; 1000];
        nccl!(ncclAllReduce(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            1000,
            3,
            op,
            comm,
            S
        ));
        for (i, got) in recv.iter().enumerate() {
            let want = (1..n).fold(input(0, i), |acc, r| fold(acc, input(r, i)));
            if *got != want {
                return Err(format!("op {op:#x} element {i}: {got:#x} != {want:#x}"));
            }
        }
    }
    let f = [1f32; 4];
    let mut g = [0f32; 4];
    let r = unsafe {
        ncclAllReduce(
            f.as_ptr() as *const c_void,
            g.as_mut_ptr() as *mut c_void,
            4,
            FLOAT,
            COMM_OP_BAND,
            comm,
            S,
        )
    };
    if r != ncclResult_t::ncclInvalidArgument || !last_error().contains("integer") {
        return Err(format!("bitwise op on floats: {r:?} {}", last_error()));
    }
    Ok(())
}

/// Groups nest: nothing runs before the outermost end.
fn nested_groups(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let send = [rank as f32 + 1.0; 16];
    let mut a = [0f32; 16];
    let mut b = [0f32; 16];
    nccl!(ncclGroupStart());
    nccl!(ncclGroupStart());
    nccl!(ncclAllReduce(
        send.as_ptr() as *const c_void,
        a.as_mut_ptr() as *mut c_void,
        16,
        FLOAT,
        0,
        comm,
        S
    ));
    nccl!(ncclGroupEnd());
    if a[0] != 0.0 {
        return Err("an inner group end ran the operation".into());
    }
    nccl!(ncclAllReduce(
        send.as_ptr() as *const c_void,
        b.as_mut_ptr() as *mut c_void,
        16,
        FLOAT,
        2,
        comm,
        S
    ));
    nccl!(ncclGroupEnd());
    let sum = (n * (n + 1) / 2) as f32;
    if a != [sum; 16] || b != [n as f32; 16] {
        return Err(format!("nested group results {a:?} {b:?}"));
    }
    Ok(())
}

/// Every rank but 0 sends rank 0 `MSGS` messages at once, small ones (eager, through the
/// FIFO) then large ones (offered for the receiver to pull); rank 0 takes them all with
/// commRecvAny. Each message names its sender and its number, so rank 0 checks that the source
/// reported is the sender, that each sender's messages come in order, and that none is lost.
fn any_source(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    const MSGS: usize = 6;
    for count in [4usize, 1 << 20] {
        let stamp = |src: usize, k: usize| (src * 1000 + k) as i32;
        if rank == 0 {
            // Refusals first: a NULL source, and a call inside a group.
            let mut buf = vec![0i32; count];
            let mut source: i32 = -1;
            let p = buf.as_mut_ptr() as *mut c_void;
            let r = unsafe { commRecvAny(p, count, INT32, std::ptr::null_mut(), comm, S) };
            if r != ncclResult_t::ncclInvalidArgument || !last_error().contains("source is NULL") {
                return Err(format!("NULL source: {r:?} {}", last_error()));
            }
            nccl!(ncclGroupStart());
            let r = unsafe { commRecvAny(p, count, INT32, &mut source, comm, S) };
            let in_group = last_error();
            let _ = ncclGroupEnd();
            if r != ncclResult_t::ncclInvalidUsage
                || !in_group.contains("cannot be part of a group")
            {
                return Err(format!("inside a group: {r:?} {in_group}"));
            }
            let mut next = vec![0usize; n];
            for _ in 0..(n - 1) * MSGS {
                buf.fill(-1);
                nccl!(commRecvAny(p, count, INT32, &mut source, comm, S));
                let src = usize::try_from(source).map_err(|_| format!("source {source}"))?;
                if src == 0 || src >= n {
                    return Err(format!("source {src} is not a sender"));
                }
                let want = stamp(src, next[src]);
                if buf[0] != want || buf[count - 1] != want {
                    return Err(format!(
                        "{count} elements from rank {src}: got {} .. {}, expected message {} ({want})",
                        buf[0],
                        buf[count - 1],
                        next[src]
                    ));
                }
                next[src] += 1;
            }
            if next[1..].iter().any(|&k| k != MSGS) {
                return Err(format!(
                    "messages per sender {next:?}, expected {MSGS} each"
                ));
            }
        } else {
            for k in 0..MSGS {
                let buf = vec![stamp(rank, k); count];
                nccl!(ncclSend(
                    buf.as_ptr() as *const c_void,
                    count,
                    INT32,
                    0,
                    comm,
                    S
                ));
            }
        }
    }
    // The communicator is still in step: a collective after the receives.
    let mut x = [rank as i32 + 1];
    let p = x.as_mut_ptr() as *mut c_void;
    nccl!(ncclAllReduce(p, p, 1, INT32, 0, comm, S));
    if x[0] != (n * (n + 1) / 2) as i32 {
        return Err(format!("all-reduce after the receives gave {}", x[0]));
    }
    Ok(())
}

/// Provokes a warning: it must reach the log with host, pid and rank.
fn log(c: ncclComm_t, _rank: usize, _n: usize) -> Result<(), String> {
    let r = unsafe { ncclAllReduce(std::ptr::null(), std::ptr::null_mut(), 4, FLOAT, 0, c, S) };
    if r == OK {
        return Err("NULL buffers accepted".into());
    }
    Ok(())
}

/// Every scenario by name: `launch` names one, the worker runs it.
const SCENARIOS: &[(&str, Scenario)] = &[
    ("alltoallv", |w| on_comm(w, common::run::alltoallv_uneven)),
    ("bitwise", |w| on_comm(w, bitwise)),
    ("nested", |w| on_comm(w, nested_groups)),
    ("anysource", |w| on_comm(w, any_source)),
    ("log", |w| on_comm(w, log)),
];

scenario_tests!(SCENARIOS);

#[test]
fn alltoallv_uneven_blocks_processes() {
    for n in [2, 3, 5] {
        assert_all_ok(
            &launch("worker", "alltoallv", n, "", &[], Duration::from_secs(60)),
            "alltoallv",
        );
    }
}

#[test]
fn alltoallv_uneven_blocks_threads() {
    with_threads(4, Duration::from_secs(60), common::run::alltoallv_uneven);
}

#[test]
fn bitwise_ops_processes() {
    assert_all_ok(
        &launch("worker", "bitwise", 3, "", &[], Duration::from_secs(60)),
        "bitwise",
    );
}

#[test]
fn recv_from_any_source_processes() {
    for n in [2, 3] {
        assert_all_ok(
            &launch("worker", "anysource", n, "", &[], Duration::from_secs(90)),
            "anysource",
        );
    }
}

#[test]
fn recv_from_any_source_threads() {
    with_threads(3, Duration::from_secs(90), any_source);
}

#[test]
fn nested_groups_threads() {
    with_threads(3, Duration::from_secs(60), nested_groups);
}

#[test]
fn log_lines_carry_host_pid_and_rank() {
    let r = launch(
        "worker",
        "log",
        2,
        "",
        &[("COMM_DEBUG", "INFO")],
        Duration::from_secs(60),
    );
    assert_all_ok(&r, "log");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    for rr in &r {
        let warn = rr
            .stderr
            .lines()
            .find(|l| l.contains("COMM WARN") && l.contains("sendbuff is NULL"))
            .unwrap_or_else(|| panic!("rank {} logged no warning:\n{}", rr.rank, rr.stderr));
        // WARN lines begin with a timestamp in NCCL's default format, "[%F %T] ".
        let (stamp, rest) = warn.split_once("] ").unwrap_or_else(|| panic!("{warn}"));
        assert!(
            stamp.starts_with("[20") && stamp.len() == "[2001-09-09 01:46:40".len(),
            "{warn}"
        );
        assert!(rest.starts_with(host.trim()), "{warn}");
        assert!(warn.contains(&format!("[{}]", rr.rank)), "{warn}");
        assert!(
            rr.stderr
                .lines()
                .any(|l| l.contains("COMM INFO") && l.contains("ready")),
            "no INFO line:\n{}",
            rr.stderr
        );
    }
}
