//! Communicator lifecycle: queries, split and shrink into sub-communicators (then collectives on
//! them), non-blocking init, scalable init, grow, finalize/destroy, groups over several
//! communicators, deadlock-free send/recv, group simulation.

// The unsafe blocks here call the library's C API (ncclX/commX) with arguments the test
// itself made; what each call needs is in the C API's documentation, not repeated per block.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use comm::ffi::types::*;
use comm::ffi::*;
use common::*;
use std::os::raw::c_void;
use std::time::{Duration, Instant};

const FLOAT: i32 = 7;
const SUM: i32 = 0;
const S: cudaStream_t = std::ptr::null_mut();

/// All-reduces `value` over `comm` and checks the sum equals `want`.
fn sum_check(comm: ncclComm_t, value: f32, want: f32, count: usize) -> Result<(), String> {
    let send = vec![value; count];
    let mut recv = vec![0f32; count];
    // A non-blocking communicator's call completes in the background.
    nccl!(settled(
        comm,
        ncclAllReduce(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            count,
            FLOAT,
            SUM,
            comm,
            S,
        ),
        Duration::from_secs(60)
    ));
    if let Some(i) = recv.iter().position(|&v| v != want) {
        return Err(format!("element {i} is {}, expected {want}", recv[i]));
    }
    Ok(())
}

fn queries(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let (mut count, mut r, mut dev) = (0, 0, 0);
    nccl!(ncclCommCount(comm, &mut count));
    nccl!(ncclCommUserRank(comm, &mut r));
    nccl!(ncclCommCuDevice(comm, &mut dev));
    if count as usize != n || r as usize != rank || dev != -1 {
        return Err(format!(
            "count {count} rank {r} device {dev}, expected {n} {rank} -1"
        ));
    }
    let mut state = ncclResult_t::ncclInternalError;
    nccl!(ncclCommGetAsyncError(comm, &mut state));
    if state != OK {
        return Err(format!("async error of a healthy comm is {state:?}"));
    }
    Ok(())
}

/// Splits by parity with keys that reverse the order; rank 4 (when present) opts out.
fn split(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let color = if rank == 4 {
        NCCL_SPLIT_NOCOLOR
    } else {
        (rank % 2) as i32
    };
    let mut child: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommSplit(
        comm,
        color,
        -(rank as i32),
        &mut child,
        std::ptr::null_mut()
    ));
    // The parent still works beside its children, for every rank.
    sum_check(comm, 1.0, n as f32, 5)?;
    if rank == 4 {
        return if child.is_null() {
            Ok(())
        } else {
            Err("NOCOLOR rank got a communicator".into())
        };
    }
    let members: Vec<usize> = (0..n).filter(|&r| r != 4 && r % 2 == rank % 2).collect();
    let (mut cn, mut cr) = (0, 0);
    nccl!(ncclCommCount(child, &mut cn));
    nccl!(ncclCommUserRank(child, &mut cr));
    // Keys are -rank: the highest parent rank becomes child rank 0.
    let expect_rank = members.iter().rev().position(|&m| m == rank).unwrap();
    if cn as usize != members.len() || cr as usize != expect_rank {
        return Err(format!(
            "child of rank {rank}: {cn} ranks, rank {cr}; expected {} and {expect_rank}",
            members.len()
        ));
    }
    let want: usize = members.iter().map(|m| m + 1).sum();
    sum_check(child, (rank + 1) as f32, want as f32, 1001)?;
    // A grandchild: split the child again, everyone together.
    let mut grand: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommSplit(child, 0, 0, &mut grand, std::ptr::null_mut()));
    sum_check(grand, 2.0, 2.0 * members.len() as f32, 3)?;
    nccl!(ncclCommFinalize(grand));
    nccl!(ncclCommDestroy(grand));
    nccl!(ncclCommDestroy(child));
    Ok(())
}

/// Excludes the last rank, which does not take part; then the first (the last takes part),
/// the last again, and finally every rank splits the parent. The excluded ranks are alive
/// throughout: a shrink they sit out must not leave them out of step with the others.
fn shrink(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    for left_out in [n - 1, 0, n - 1] {
        if rank == left_out {
            continue;
        }
        let mut exclude = [left_out as i32];
        let mut child: ncclComm_t = std::ptr::null_mut();
        nccl!(ncclCommShrink(
            comm,
            exclude.as_mut_ptr(),
            1,
            &mut child,
            std::ptr::null_mut(),
            NCCL_SHRINK_DEFAULT
        ));
        let mut cn = 0;
        nccl!(ncclCommCount(child, &mut cn));
        if cn as usize != n - 1 {
            return Err(format!("shrunk comm has {cn} ranks"));
        }
        let want: usize = (0..n).filter(|&r| r != left_out).map(|r| r + 1).sum();
        sum_check(child, (rank + 1) as f32, want as f32, 77)?;
        nccl!(ncclCommDestroy(child));
    }
    let mut all: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommSplit(
        comm,
        0,
        rank as i32,
        &mut all,
        std::ptr::null_mut()
    ));
    sum_check(all, 1.0, n as f32, 9)?;
    nccl!(ncclCommDestroy(all));
    Ok(())
}

/// Two splits of one communicator in one group, as tensor- and data-parallel groups are made
/// (`rank / 2` and `rank % 2`): each child has the members and order its colors and keys say.
fn grouped_splits(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let colors = [|r: usize| r / 2, |r: usize| r % 2];
    let mut kids = [std::ptr::null_mut(); 2];
    nccl!(ncclGroupStart());
    for (k, color) in colors.iter().enumerate() {
        // Keys reverse the order in the second split.
        let key = if k == 0 { rank as i32 } else { -(rank as i32) };
        nccl!(ncclCommSplit(
            comm,
            color(rank) as i32,
            key,
            &mut kids[k],
            std::ptr::null_mut()
        ));
    }
    nccl!(ncclGroupEnd());
    for (k, color) in colors.iter().enumerate() {
        let mut members: Vec<usize> = (0..n).filter(|&r| color(r) == color(rank)).collect();
        if k == 1 {
            members.reverse();
        }
        let (mut cn, mut cr) = (0, 0);
        nccl!(ncclCommCount(kids[k], &mut cn));
        nccl!(ncclCommUserRank(kids[k], &mut cr));
        let expect_rank = members.iter().position(|&m| m == rank).unwrap();
        if cn as usize != members.len() || cr as usize != expect_rank {
            return Err(format!(
                "split {k} of rank {rank}: {cn} ranks, rank {cr}; expected {} and {expect_rank}",
                members.len()
            ));
        }
        let want: usize = members.iter().map(|m| m + 1).sum();
        sum_check(kids[k], (rank + 1) as f32, want as f32, 513)?;
    }
    for kid in kids {
        nccl!(ncclCommDestroy(kid));
    }
    Ok(())
}

/// One group of every rank: a send to the next rank (`S`), a receive from the previous (`R`)
/// and all-reduces (`A`) in the order `order` gives; every receive and all-reduce checked.
fn mixed_group(
    comm: ncclComm_t,
    rank: usize,
    n: usize,
    order: &str,
    count: usize,
    reduced: usize,
) -> Result<(), String> {
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let value = |r: usize, i: usize| (r * 1000 + i % 1000) as f32;
    let send: Vec<f32> = (0..count).map(|i| value(rank, i)).collect();
    let mut got = vec![-1f32; count];
    let alls = order.matches('A').count();
    let ins: Vec<Vec<f32>> = (0..alls)
        .map(|a| vec![(rank + 1 + a) as f32; reduced])
        .collect();
    let mut outs = vec![vec![0f32; reduced]; alls];
    nccl!(ncclGroupStart());
    let mut a = 0;
    for c in order.chars() {
        match c {
            'S' => nccl!(ncclSend(
                send.as_ptr() as *const c_void,
                count,
                FLOAT,
                next as i32,
                comm,
                S
            )),
            'R' => nccl!(ncclRecv(
                got.as_mut_ptr() as *mut c_void,
                count,
                FLOAT,
                prev as i32,
                comm,
                S
            )),
            _ => {
                nccl!(ncclAllReduce(
                    ins[a].as_ptr() as *const c_void,
                    outs[a].as_mut_ptr() as *mut c_void,
                    reduced,
                    FLOAT,
                    SUM,
                    comm,
                    S
                ));
                a += 1;
            }
        }
    }
    nccl!(ncclGroupEnd());
    let what = format!("group {order} ({count} sent, {reduced} reduced)");
    if let Some(i) = (0..count).find(|&i| got[i] != value(prev, i)) {
        return Err(format!(
            "{what}: element {i} received {} expected {}",
            got[i],
            value(prev, i)
        ));
    }
    for (a, out) in outs.iter().enumerate() {
        // Ranks put in rank + 1 + a.
        let want = (n * (n + 1) / 2 + n * a) as f32;
        if let Some(i) = out.iter().position(|&v| v != want) {
            return Err(format!(
                "{what}: all-reduce {a} element {i} is {} expected {want}",
                out[i]
            ));
        }
    }
    Ok(())
}

/// Send/recv calls and collectives in one group, interleaved differently on different ranks
/// (collectives match in the order called, send/recv calls between two ranks too, the two
/// kinds not with each other), small messages and ones pulled by the peer, then one whose
/// send/recv calls share buffers with its all-reduces (those run in the order called, every
/// rank calling them alike). The communicator stays usable throughout.
fn mixed_groups(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let per_rank: &[&[&str]] = &[
        &["SAR"],
        &["RAS"],
        &["ASRA"],
        &["ARS", "SRA"],
        &["SAR", "RSA", "ASR"],
        &["AARS", "SAAR"],
    ];
    for orders in per_rank {
        let order = orders[rank % orders.len()];
        for (count, reduced) in [(1, 1), (4099, 7), (3 << 20, 1), (5, (1 << 20) + 3)] {
            mixed_group(comm, rank, n, order, count, reduced)?;
        }
    }
    // y = sum(x), sent on; z received, w = sum(z): each rank's z is its previous rank's y.
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let x = vec![rank as f32 + 1.0; 1000];
    let (mut y, mut z, mut w) = (vec![0f32; 1000], vec![0f32; 1000], vec![0f32; 1000]);
    nccl!(ncclGroupStart());
    nccl!(ncclAllReduce(
        x.as_ptr() as *const c_void,
        y.as_mut_ptr() as *mut c_void,
        1000,
        FLOAT,
        SUM,
        comm,
        S
    ));
    nccl!(ncclSend(
        y.as_ptr() as *const c_void,
        1000,
        FLOAT,
        next as i32,
        comm,
        S
    ));
    nccl!(ncclRecv(
        z.as_mut_ptr() as *mut c_void,
        1000,
        FLOAT,
        prev as i32,
        comm,
        S
    ));
    nccl!(ncclAllReduce(
        z.as_ptr() as *const c_void,
        w.as_mut_ptr() as *mut c_void,
        1000,
        FLOAT,
        SUM,
        comm,
        S
    ));
    nccl!(ncclGroupEnd());
    let total = (n * (n + 1) / 2) as f32;
    if y.iter().chain(&z).any(|&v| v != total) || w.iter().any(|&v| v != total * n as f32) {
        return Err(format!(
            "dependent group: y[0] {} z[0] {} w[0] {}, expected {total}, {total}, {}",
            y[0],
            z[0],
            w[0],
            total * n as f32
        ));
    }
    sum_check(comm, 1.0, n as f32, 3)
}

/// Send/recv in a group never deadlocks, whatever the order, even past the FIFO's capacity.
fn sendrecv_orders(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    for count in [1usize, 4099, 3 << 20] {
        let send: Vec<f32> = (0..count)
            .map(|i| (rank * 1000 + i % 1000) as f32)
            .collect();
        let mut from_prev = vec![0f32; count];
        let mut from_next = vec![0f32; count];
        let next = (rank + 1) % n;
        let prev = (rank + n - 1) % n;
        nccl!(ncclGroupStart());
        // Odd ranks receive first, even ranks send first; both directions at once.
        if rank % 2 == 1 {
            nccl!(ncclRecv(
                from_prev.as_mut_ptr() as *mut c_void,
                count,
                FLOAT,
                prev as i32,
                comm,
                S
            ));
            nccl!(ncclRecv(
                from_next.as_mut_ptr() as *mut c_void,
                count,
                FLOAT,
                next as i32,
                comm,
                S
            ));
        }
        nccl!(ncclSend(
            send.as_ptr() as *const c_void,
            count,
            FLOAT,
            next as i32,
            comm,
            S
        ));
        nccl!(ncclSend(
            send.as_ptr() as *const c_void,
            count,
            FLOAT,
            prev as i32,
            comm,
            S
        ));
        if rank % 2 == 0 {
            nccl!(ncclRecv(
                from_next.as_mut_ptr() as *mut c_void,
                count,
                FLOAT,
                next as i32,
                comm,
                S
            ));
            nccl!(ncclRecv(
                from_prev.as_mut_ptr() as *mut c_void,
                count,
                FLOAT,
                prev as i32,
                comm,
                S
            ));
        }
        nccl!(ncclGroupEnd());
        for i in 0..count {
            let (p, q) = (
                (prev * 1000 + i % 1000) as f32,
                (next * 1000 + i % 1000) as f32,
            );
            if from_prev[i] != p || from_next[i] != q {
                return Err(format!(
                    "count {count} element {i}: got {} {} expected {p} {q}",
                    from_prev[i], from_next[i]
                ));
            }
        }
    }
    // A send to oneself inside a group.
    let mine = vec![rank as f32 + 0.5; 10];
    let mut back = vec![0f32; 10];
    nccl!(ncclGroupStart());
    nccl!(ncclSend(
        mine.as_ptr() as *const c_void,
        10,
        FLOAT,
        rank as i32,
        comm,
        S
    ));
    nccl!(ncclRecv(
        back.as_mut_ptr() as *mut c_void,
        10,
        FLOAT,
        rank as i32,
        comm,
        S
    ));
    nccl!(ncclGroupEnd());
    if back != mine {
        return Err(format!("self send/recv gave {back:?}"));
    }
    Ok(())
}

/// Send and receive on the same buffer in one group (nccl-tests' in-place sendrecv): the data
/// sent is the data from before the call, whatever the size.
fn sendrecv_in_place(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    for count in [1usize, 8191, 1 << 20, 3 << 20] {
        let mut buf: Vec<f32> = (0..count).map(|i| (rank * 7 + i % 5) as f32).collect();
        let p = buf.as_mut_ptr() as *mut c_void;
        nccl!(ncclGroupStart());
        nccl!(ncclSend(p, count, FLOAT, ((rank + 1) % n) as i32, comm, S));
        nccl!(ncclRecv(
            p,
            count,
            FLOAT,
            ((rank + n - 1) % n) as i32,
            comm,
            S
        ));
        nccl!(ncclGroupEnd());
        let prev = (rank + n - 1) % n;
        if let Some(i) = (0..count).find(|&i| buf[i] != (prev * 7 + i % 5) as f32) {
            return Err(format!(
                "count {count}: element {i} is {}, expected {}",
                buf[i],
                prev * 7 + i % 5
            ));
        }
    }
    Ok(())
}

/// A collective of zero elements is a no-op, as in NCCL: it returns at once without any peer
/// taking part (here only rank 0 calls them, in and out of groups, and the next real
/// collective still pairs up), yet it still refuses bad arguments.
fn zero_count_is_a_no_op(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let mut buf = vec![rank as f32 + 1.0; 4 * n];
    let p = buf.as_mut_ptr() as *mut c_void;
    if rank == 0 {
        nccl!(ncclAllReduce(p, p, 0, FLOAT, SUM, comm, S));
        nccl!(ncclBroadcast(p, p, 0, FLOAT, 1, comm, S));
        nccl!(ncclAllGather(p, p, 0, FLOAT, comm, S));
        nccl!(ncclGroupStart());
        nccl!(ncclReduceScatter(p, p, 0, FLOAT, SUM, comm, S));
        nccl!(ncclAlltoAll(p, p, 0, FLOAT, comm, S));
        nccl!(ncclGroupEnd());
        let r = unsafe { ncclAllReduce(p, p, 0, 99, SUM, comm, S) };
        if r != ncclResult_t::ncclInvalidArgument {
            return Err(format!("a bad datatype with count 0 gave {r:?}"));
        }
        let r = unsafe { ncclAllReduce(p, p, 0, FLOAT, 77, comm, S) };
        if r != ncclResult_t::ncclInvalidArgument {
            return Err(format!("an unknown op with count 0 gave {r:?}"));
        }
        let r = unsafe { ncclBroadcast(p, p, 0, FLOAT, n as i32, comm, S) };
        if r != ncclResult_t::ncclInvalidArgument {
            return Err(format!("root {n} of {n} ranks with count 0 gave {r:?}"));
        }
        // Null buffers are fine when nothing moves.
        let null = std::ptr::null_mut();
        nccl!(ncclReduce(null, null, 0, FLOAT, SUM, 0, comm, S));
    }
    nccl!(ncclAllReduce(p, p, 4, FLOAT, SUM, comm, S));
    let want = (n * (n + 1) / 2) as f32;
    match buf[..4].iter().find(|&&v| v != want) {
        Some(v) => Err(format!(
            "after the no-ops the all-reduce gave {v}, expected {want}"
        )),
        None => Ok(()),
    }
}

#[test]
fn zero_count_collectives_are_no_ops_threads() {
    with_threads(3, Duration::from_secs(60), zero_count_is_a_no_op);
}

/// A simulated group estimates and runs nothing; ncclGroupSimulateEnd(NULL) runs the group.
fn simulate(comm: ncclComm_t, _rank: usize, nranks: usize) -> Result<(), String> {
    let send = vec![1f32; 1 << 16];
    let mut recv = vec![-1f32; 1 << 16];
    let mut info = ncclSimInfo_t {
        size: std::mem::size_of::<ncclSimInfo_t>(),
        magic: 0x74685283,
        version: NCCL_VERSION_CODE as u32,
        estimatedTime: -1.0,
    };
    // The group's one call, into `recv`.
    let all_reduce = |recv: &mut [f32]| unsafe {
        ncclAllReduce(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            1 << 16,
            FLOAT,
            SUM,
            comm,
            S,
        )
    };
    nccl!(ncclGroupStart());
    nccl!(all_reduce(&mut recv));
    nccl!(ncclGroupSimulateEnd(&mut info));
    if info.estimatedTime.is_nan() || info.estimatedTime <= 0.0 {
        return Err(format!("estimated time {}", info.estimatedTime));
    }
    if recv.iter().any(|&v| v != -1.0) {
        return Err("a simulated group ran its all-reduce".into());
    }
    println!("estimated {} us", info.estimatedTime);
    // A smaller call is estimated shorter: the estimate grows with the size.
    let mut small = ncclSimInfo_t {
        estimatedTime: -1.0,
        ..info
    };
    nccl!(ncclGroupStart());
    nccl!(unsafe {
        ncclAllReduce(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            16,
            FLOAT,
            SUM,
            comm,
            S,
        )
    });
    nccl!(ncclGroupSimulateEnd(&mut small));
    if !(small.estimatedTime > 0.0 && small.estimatedTime < info.estimatedTime) {
        return Err(format!(
            "estimated {} us for 16 floats and {} us for 65536",
            small.estimatedTime, info.estimatedTime
        ));
    }
    // A struct of an older, shorter layout (size 16: no estimatedTime) is read up to its
    // size, as NCCL does: accepted, and nothing past it is written.
    let mut short = [0u64; 3];
    short[0] = 16;
    short[1] = 0x74685283 | ((NCCL_VERSION_CODE as u64) << 32);
    short[2] = u64::MAX;
    nccl!(ncclGroupStart());
    nccl!(ncclGroupSimulateEnd(
        short.as_mut_ptr() as *mut ncclSimInfo_t
    ));
    if short[2] != u64::MAX {
        return Err("ncclGroupSimulateEnd wrote past a 16-byte simInfo".into());
    }
    // NULL: the group runs, as with ncclGroupEnd (it used to be dropped without a word).
    let n = nranks as f32;
    nccl!(ncclGroupStart());
    nccl!(all_reduce(&mut recv));
    nccl!(ncclGroupSimulateEnd(std::ptr::null_mut()));
    if let Some(i) = recv.iter().position(|&v| v != n) {
        return Err(format!(
            "after ncclGroupSimulateEnd(NULL) element {i} is {}, expected {n}",
            recv[i]
        ));
    }
    Ok(())
}

/// ncclCommRegister / ncclCommDeregister on host memory: buffers stay usable while
/// registered; bad handles, double deregistration and another communicator's handle are
/// refused with a message and leave the communicator working.
fn registration(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let count = 4099;
    let mut buf = vec![rank as f32 + 1.0; count];
    let bytes = count * 4;
    let mut h: *mut c_void = std::ptr::null_mut();
    nccl!(ncclCommRegister(
        comm,
        buf.as_mut_ptr() as *mut c_void,
        bytes,
        &mut h
    ));
    if h.is_null() {
        return Err("ncclCommRegister succeeded but gave a NULL handle".into());
    }
    // In place on the registered buffer.
    let p = buf.as_mut_ptr() as *mut c_void;
    nccl!(ncclAllReduce(p, p, count, FLOAT, SUM, comm, S));
    let want = (n * (n + 1) / 2) as f32;
    if let Some(i) = buf.iter().position(|&v| v != want) {
        return Err(format!(
            "registered buffer: element {i} is {}, expected {want}",
            buf[i]
        ));
    }
    let refused = |what: &str, r: ncclResult_t, code: ncclResult_t, words: &str| {
        let msg = last_error();
        if r != code || !msg.contains(words) {
            Err(format!(
                "{what}: got {r:?} \"{msg}\", expected {code:?} mentioning \"{words}\""
            ))
        } else {
            Ok(())
        }
    };
    // SAFETY: the calls are made as a C program would, with deliberately bad arguments.
    unsafe {
        let r = ncclCommRegister(comm, std::ptr::null_mut(), 64, &mut h);
        refused("NULL buffer", r, ncclResult_t::ncclInvalidArgument, "NULL")?;
        let r = ncclCommRegister(comm, p, bytes, std::ptr::null_mut());
        refused(
            "NULL handle pointer",
            r,
            ncclResult_t::ncclInvalidArgument,
            "handle",
        )?;
        let r = ncclCommDeregister(comm, 0x1234 as *mut c_void);
        refused(
            "made-up handle",
            r,
            ncclResult_t::ncclInvalidArgument,
            "not a live registration",
        )?;
    }
    // A handle of another communicator is refused there.
    let mut other: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommSplit(
        comm,
        0,
        rank as i32,
        &mut other,
        std::ptr::null_mut()
    ));
    // SAFETY: as above.
    let r = unsafe { ncclCommDeregister(other, h) };
    refused(
        "another communicator's handle",
        r,
        ncclResult_t::ncclInvalidArgument,
        "another communicator",
    )?;
    nccl!(ncclCommDestroy(other));
    nccl!(ncclCommDeregister(comm, h));
    // SAFETY: as above.
    let r = unsafe { ncclCommDeregister(comm, h) };
    refused(
        "second deregistration",
        r,
        ncclResult_t::ncclInvalidArgument,
        "already deregistered",
    )?;
    // The communicator still works after every refusal.
    sum_check(comm, 1.0, n as f32, 17)
}

/// Every scenario a rank process runs, by the name its launcher gives. Most are the bodies the
/// thread tests run too, on a communicator of their own; the rest set up their communicator
/// themselves.
const SCENARIOS: &[(&str, Scenario)] = &[
    ("queries", |w| on_comm(w, queries)),
    ("registration", |w| on_comm(w, registration)),
    ("split", |w| on_comm(w, split)),
    ("shrink", |w| on_comm(w, shrink)),
    ("grouped_splits", |w| on_comm(w, grouped_splits)),
    ("fork_then_destroy", fork_then_destroy),
    ("out_of_descriptors", out_of_descriptors),
    ("peer_init_fails", peer_init_fails),
    ("sendrecv", |w| on_comm(w, sendrecv_orders)),
    ("mixed_groups", |w| on_comm(w, mixed_groups)),
    ("sendrecv_in_place", |w| on_comm(w, sendrecv_in_place)),
    ("simulate", |w| on_comm(w, simulate)),
    ("shrink_dead", shrink_dead),
    ("nonblocking", nonblocking),
    ("scalable", scalable),
    ("bad_knob", bad_knob),
];

/// A child forked after init (a data-loader worker, say) that never uses the library holds
/// copies of its descriptors; destroy and abort must not wait for it to exit.
fn fork_then_destroy(w: &Worker) -> Result<(), String> {
    let parent = init_rank(w)?;
    let mut child: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommSplit(
        parent,
        0,
        w.rank as i32,
        &mut child,
        std::ptr::null_mut()
    ));
    let comms = [parent, child];
    sum_check(comms[1], 1.0, w.nranks as f32, 3)?;
    // SAFETY: the child only sleeps and exits, both async-signal-safe.
    let child = unsafe { libc::fork() };
    if child == 0 {
        unsafe {
            libc::sleep(20);
            libc::_exit(0);
        }
    }
    if child < 0 {
        return Err("fork failed".into());
    }
    let t = Instant::now();
    // SAFETY: both handles are live and used by this thread only.
    let r = unsafe { (ncclCommDestroy(comms[1]), ncclCommAbort(comms[0])) };
    let took = t.elapsed();
    unsafe {
        libc::kill(child, libc::SIGKILL);
        libc::waitpid(child, std::ptr::null_mut(), 0);
    }
    if r != (OK, OK) || took > Duration::from_secs(5) {
        return Err(format!(
            "destroy and abort with a forked child alive: {r:?} in {took:?}"
        ));
    }
    Ok(())
}

/// Rank 0 runs out of file descriptors while splitting: its error says so (it used to blame
/// the peer: "peer sent no file descriptor for its shared segment"), and the communicator it
/// split from still works once descriptors are free again.
fn out_of_descriptors(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count()) as u64;
    let mut kids = Vec::new();
    let mut failure = None;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `old` is a local rlimit for the call to fill.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) };
    if w.rank == 0 {
        let low = libc::rlimit {
            rlim_cur: open + 24,
            rlim_max: old.rlim_max,
        };
        // SAFETY: `low` is a local, initialised rlimit the call only reads.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) };
    }
    for _ in 0..40 {
        let mut kid: ncclComm_t = std::ptr::null_mut();
        let r = unsafe { ncclCommSplit(c, 0, w.rank as i32, &mut kid, std::ptr::null_mut()) };
        if r != OK {
            failure = Some((r, last_error()));
            break;
        }
        kids.push(kid);
    }
    // SAFETY: `old` is the local rlimit getrlimit filled, which the call only reads.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) };
    let kids_made = kids.len();
    for kid in kids {
        unsafe { ncclCommDestroy(kid) };
    }
    if w.rank == 0 {
        match failure {
            None => return Err("40 splits with 24 descriptors to spare all succeeded".into()),
            Some((r, msg)) => {
                if !(msg.contains("Too many open files") || msg.contains("no file descriptor left"))
                {
                    return Err(format!("out of descriptors: {r:?} {msg}"));
                }
                println!("split {kids_made} failed as it should: {msg}");
            }
        }
    }
    nccl!(ncclCommAbort(c));
    Ok(())
}

/// Rank 1's init fails after it announced its shared memory, while its process lives on: the
/// others must fail at once (they waited for its segment until COMM_INIT_TIMEOUT, 60 s here).
fn peer_init_fails(w: &Worker) -> Result<(), String> {
    a_peers_init_fails(w, "stopped serving", Duration::from_secs(8))
}

/// An unknown value of a knob read at init (COMM_SHM_REPLY, set by the launcher) fails the
/// init with ncclInvalidArgument and a message naming the knob and the values it takes.
fn bad_knob(w: &Worker) -> Result<(), String> {
    let mut c: ncclComm_t = std::ptr::null_mut();
    // SAFETY: plain init; the handle is only written on success.
    let r = unsafe { ncclCommInitRank(&mut c, w.nranks as i32, w.id, w.rank as i32) };
    let msg = last_error();
    if r != ncclResult_t::ncclInvalidArgument {
        return Err(format!("init with COMM_SHM_REPLY=sideways: {r:?} ({msg})"));
    }
    if !(msg.contains("COMM_SHM_REPLY=sideways") && msg.contains("writeback")) {
        return Err(format!("the refusal does not say what is wrong: {msg}"));
    }
    Ok(())
}

/// The last rank dies; the survivors shrink it away and carry on.
fn shrink_dead(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    sum_check(c, 1.0, w.nranks as f32, 8)?;
    if w.rank == w.nranks - 1 {
        std::process::exit(0);
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut exclude = [(w.nranks - 1) as i32];
    let mut child: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommShrink(
        c,
        exclude.as_mut_ptr(),
        1,
        &mut child,
        std::ptr::null_mut(),
        NCCL_SHRINK_ABORT
    ));
    sum_check(child, 2.0, 2.0 * (w.nranks - 1) as f32, 4097)?;
    nccl!(ncclCommDestroy(child));
    nccl!(ncclCommAbort(c));
    Ok(())
}

/// Non-blocking init: the communicator reports progress until it is ready, then works.
fn nonblocking(w: &Worker) -> Result<(), String> {
    let mut cfg = config(0, c"nonblocking-test");
    let mut c: ncclComm_t = std::ptr::null_mut();
    let r =
        unsafe { ncclCommInitRankConfig(&mut c, w.nranks as i32, w.id, w.rank as i32, &mut cfg) };
    if r != ncclResult_t::ncclInProgress && r != OK {
        return Err(format!(
            "non-blocking init returned {r:?}: {}",
            last_error()
        ));
    }
    match settled(c, r, Duration::from_secs(30)) {
        OK => {}
        other => return Err(format!("non-blocking init ended with {other:?}")),
    }
    sum_check(c, 3.0, 3.0 * w.nranks as f32, 10)?;
    mixed_kinds_in_one_group(w, c)?;
    nccl!(ncclCommFinalize(c));
    nccl!(ncclCommDestroy(c));
    Ok(())
}

/// A group may not hold calls on a non-blocking communicator (`c`) and a blocking one (as
/// NCCL): the call that mixes them fails with ncclInvalidArgument, the group does nothing, and
/// both communicators stay usable.
fn mixed_kinds_in_one_group(w: &Worker, c: ncclComm_t) -> Result<(), String> {
    let mut cfg = config(1, c"blocking-child");
    let mut b: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommSplit(c, 0, w.rank as i32, &mut b, &mut cfg));
    let send = [1f32; 4];
    let mut recv = [[0f32; 4]; 2];
    nccl!(ncclGroupStart());
    nccl!(ncclAllReduce(
        send.as_ptr() as *const c_void,
        recv[0].as_mut_ptr() as *mut c_void,
        4,
        FLOAT,
        SUM,
        c,
        S
    ));
    let mixed = unsafe {
        ncclAllReduce(
            send.as_ptr() as *const c_void,
            recv[1].as_mut_ptr() as *mut c_void,
            4,
            FLOAT,
            SUM,
            b,
            S,
        )
    };
    let message = last_error();
    let end = ncclGroupEnd();
    if mixed != ncclResult_t::ncclInvalidArgument || !message.contains("non-blocking") {
        return Err(format!(
            "a blocking comm's call in a non-blocking comm's group returned {mixed:?}: {message}"
        ));
    }
    if end != ncclResult_t::ncclInvalidArgument || recv != [[0f32; 4]; 2] {
        return Err(format!(
            "the mixed group ended with {end:?} and results {recv:?}; it should do nothing"
        ));
    }
    sum_check(c, 1.0, w.nranks as f32, 4)?;
    sum_check(b, 2.0, 2.0 * w.nranks as f32, 4)?;
    nccl!(ncclCommDestroy(b));
    Ok(())
}

/// Two unique ids spread the rendezvous (ncclCommInitRankScalable); rank 0 made both.
fn scalable(w: &Worker) -> Result<(), String> {
    let mut ids: Vec<ncclUniqueId> = w.arg.split(',').map(id_from_hex).collect();
    let mut c: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommInitRankScalable(
        &mut c,
        w.nranks as i32,
        w.rank as i32,
        ids.len() as i32,
        ids.as_mut_ptr(),
        std::ptr::null_mut()
    ));
    sum_check(c, 1.0, w.nranks as f32, 3)?;
    nccl!(ncclCommDestroy(c));
    Ok(())
}

scenario_tests!(SCENARIOS);

fn procs(scenario: &str, n: usize, env: &[(&str, &str)]) {
    let r = launch("worker", scenario, n, "", env, Duration::from_secs(120));
    assert_all_ok(&r, &format!("{scenario} with {n} processes"));
}

#[test]
fn queries_report_rank_count_and_no_device() {
    procs("queries", 3, &[]);
}

#[test]
fn registration_processes() {
    procs("registration", 3, &[]);
}

#[test]
fn registration_threads() {
    with_threads(2, Duration::from_secs(120), registration);
}

#[test]
fn a_bad_knob_fails_init_and_says_why() {
    procs("bad_knob", 2, &[("COMM_SHM_REPLY", "sideways")]);
}

#[test]
fn split_processes() {
    procs("split", 5, &[]);
}

#[test]
fn split_threads() {
    with_threads(5, Duration::from_secs(120), split);
}

#[test]
fn two_splits_of_one_communicator_in_a_group() {
    for _ in 0..3 {
        procs("grouped_splits", 4, &[]);
    }
    procs("grouped_splits", 3, &[]);
}

#[test]
fn two_splits_of_one_communicator_in_a_group_threads() {
    with_threads(4, Duration::from_secs(120), grouped_splits);
}

/// One thread drives every rank: two splits per rank in one group. Each rank's splits run in
/// order while the ranks' run side by side (they wait for each other).
#[test]
fn two_splits_per_rank_in_one_group_of_one_thread() {
    let n = 3;
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); n];
    let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), n as i32, std::ptr::null()) };
    assert_eq!(r, OK, "ncclCommInitAll: {}", last_error());
    let mut kids = vec![[std::ptr::null_mut(); 2]; n];
    assert_eq!(ncclGroupStart(), OK);
    for (rank, c) in comms.iter().enumerate() {
        for (k, kid) in kids[rank].iter_mut().enumerate() {
            let key = if k == 0 { rank as i32 } else { -(rank as i32) };
            let r = unsafe { ncclCommSplit(*c, 0, key, kid, std::ptr::null_mut()) };
            assert_eq!(r, OK, "split {k} of rank {rank}: {}", last_error());
        }
    }
    assert_eq!(ncclGroupEnd(), OK, "{}", last_error());
    for (rank, pair) in kids.iter().enumerate() {
        for (k, kid) in pair.iter().enumerate() {
            let mut cr = 0;
            assert_eq!(unsafe { ncclCommUserRank(*kid, &mut cr) }, OK);
            let want = if k == 0 { rank } else { n - 1 - rank };
            assert_eq!(cr as usize, want, "split {k} of rank {rank}");
        }
    }
    for c in kids.into_iter().flatten().chain(comms) {
        assert_eq!(unsafe { ncclCommDestroy(c) }, OK);
    }
}

#[test]
fn a_forked_child_does_not_hold_up_destroy() {
    procs("fork_then_destroy", 2, &[]);
}

#[test]
fn running_out_of_descriptors_says_so() {
    let r = launch(
        "worker",
        "out_of_descriptors",
        2,
        "",
        &[("COMM_INIT_TIMEOUT", "5")],
        Duration::from_secs(120),
    );
    // Rank 1 fails too (its partner gave up), with whatever it saw; rank 0 must say why.
    assert!(
        r[0].status == Some(0),
        "rank 0: {:?} {}",
        r[0].status,
        r[0].stdout
    );
}

#[test]
fn a_peer_whose_init_fails_fails_the_others_at_once() {
    let r = launch(
        "worker",
        "peer_init_fails",
        3,
        "",
        // The fetches at init are what tell the others (tests/shm_demand.rs has the same
        // with the links made at first use).
        &[("COMM_INIT_TIMEOUT", "60"), ("NCCL_RUNTIME_CONNECT", "0")],
        Duration::from_secs(120),
    );
    assert_all_ok(&r, "peer_init_fails with 3 processes");
}

#[test]
fn shrink_processes() {
    procs("shrink", 4, &[]);
}

#[test]
fn shrink_threads() {
    with_threads(3, Duration::from_secs(120), shrink);
}

#[test]
fn shrink_away_a_dead_rank() {
    procs("shrink_dead", 4, &[]);
}

#[test]
fn sendrecv_never_deadlocks_processes() {
    procs("sendrecv", 3, &[]);
}

#[test]
fn sendrecv_never_deadlocks_without_pull() {
    procs("sendrecv", 4, &[("COMM_SHM_PULL", "0")]);
}

#[test]
fn groups_mixing_sendrecv_and_collectives_processes() {
    procs("mixed_groups", 2, &[]);
    procs("mixed_groups", 3, &[]);
}

#[test]
fn groups_mixing_sendrecv_and_collectives_socket() {
    procs("mixed_groups", 3, &[("COMM_SHM_DISABLE", "1")]);
}

#[test]
fn groups_mixing_sendrecv_and_collectives_threads() {
    with_threads(3, Duration::from_secs(120), mixed_groups);
}

#[test]
fn sendrecv_never_deadlocks_threads() {
    with_threads(4, Duration::from_secs(120), sendrecv_orders);
}

#[test]
fn in_place_sendrecv_rings_complete_processes() {
    procs("sendrecv_in_place", 3, &[]);
    procs("sendrecv_in_place", 2, &[("COMM_SHM_PULL", "0")]);
}

#[test]
fn in_place_sendrecv_rings_complete_threads() {
    with_threads(3, Duration::from_secs(120), sendrecv_in_place);
}

#[test]
fn nonblocking_init_reports_progress() {
    procs("nonblocking", 3, &[]);
}

#[test]
fn group_simulation_estimates_without_running() {
    procs("simulate", 2, &[]);
}

/// The estimate counts what the links cost: the same all-reduce over TCP (shared memory off)
/// is estimated slower than over shared memory.
#[test]
fn group_simulation_counts_the_network() {
    let estimate = |env: &[(&str, &str)]| -> f32 {
        let r = launch("worker", "simulate", 2, "", env, Duration::from_secs(120));
        assert_all_ok(&r, &format!("simulate {env:?}"));
        r[0].stdout
            .split("estimated ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("rank 0 prints its estimate")
    };
    let shm = estimate(&[]);
    let tcp = estimate(&[("COMM_SHM_DISABLE", "1")]);
    println!("256 KiB all-reduce on 2 ranks: {shm} us over shared memory, {tcp} us over TCP");
    assert!(tcp > 2.0 * shm, "TCP {tcp} us, shared memory {shm} us");
}

#[test]
fn scalable_init_with_two_ids() {
    let ids = format!("{},{}", id_to_hex(&unique_id()), id_to_hex(&unique_id()));
    let r = launch("worker", "scalable", 5, &ids, &[], Duration::from_secs(120));
    assert_all_ok(&r, "scalable init");
}

/// One thread drives three communicators (ranks of an InitAll clique) in one group.
#[test]
fn one_thread_drives_several_communicators() {
    let n = 3;
    let mut comms = vec![std::ptr::null_mut(); n];
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), n as i32, std::ptr::null()) },
        OK,
        "{}",
        last_error()
    );
    let sends: Vec<Vec<f32>> = (0..n).map(|r| vec![(r + 1) as f32; 70_000]).collect();
    let mut recvs: Vec<Vec<f32>> = (0..n).map(|_| vec![0f32; 70_000]).collect();
    unsafe {
        assert_eq!(ncclGroupStart(), OK);
        for r in 0..n {
            assert_eq!(
                ncclAllReduce(
                    sends[r].as_ptr() as *const c_void,
                    recvs[r].as_mut_ptr() as *mut c_void,
                    70_000,
                    FLOAT,
                    SUM,
                    comms[r],
                    S
                ),
                OK
            );
        }
        assert_eq!(ncclGroupEnd(), OK, "{}", last_error());
    }
    for r in recvs {
        assert!(r.iter().all(|&v| v == 6.0));
    }
    // Splitting them from one thread also needs a group.
    let mut children = vec![std::ptr::null_mut(); n];
    unsafe {
        assert_eq!(ncclGroupStart(), OK);
        for r in 0..n {
            assert_eq!(
                ncclCommSplit(
                    comms[r],
                    0,
                    r as i32,
                    &mut children[r],
                    std::ptr::null_mut()
                ),
                OK
            );
        }
        assert_eq!(ncclGroupEnd(), OK, "{}", last_error());
        for r in 0..n {
            let mut cn = 0;
            assert_eq!(ncclCommCount(children[r], &mut cn), OK, "{}", last_error());
            assert_eq!(cn, n as i32);
            ncclCommDestroy(children[r]);
            ncclCommDestroy(comms[r]);
        }
    }
}

/// Two ranks grow to three: the new rank joins through ncclCommGetUniqueId's id.
#[test]
fn grow_adds_a_rank() {
    let mut comms = vec![std::ptr::null_mut(); 2];
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) },
        OK
    );
    let mut id = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    assert_eq!(
        unsafe { ncclCommGetUniqueId(comms[0], &mut id) },
        OK,
        "{}",
        last_error()
    );
    let old: Vec<usize> = comms.iter().map(|c| *c as usize).collect();
    let mut threads = Vec::new();
    for (r, c) in old.into_iter().enumerate() {
        let id = id;
        threads.push(std::thread::spawn(move || {
            let mut g: ncclComm_t = std::ptr::null_mut();
            let idp = if r == 0 {
                &id as *const ncclUniqueId
            } else {
                std::ptr::null()
            };
            let res =
                unsafe { ncclCommGrow(c as ncclComm_t, 3, idp, -1, &mut g, std::ptr::null_mut()) };
            assert_eq!(res, OK, "{}", last_error());
            (g as usize, r)
        }));
    }
    threads.push(std::thread::spawn(move || {
        let mut g: ncclComm_t = std::ptr::null_mut();
        let res = unsafe {
            ncclCommGrow(
                std::ptr::null_mut(),
                3,
                &id,
                2,
                &mut g,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(res, OK, "{}", last_error());
        (g as usize, 2)
    }));
    let grown: Vec<(usize, usize)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let workers: Vec<_> = grown
        .into_iter()
        .map(|(g, r)| {
            std::thread::spawn(move || {
                let mut rank = 0;
                unsafe { ncclCommUserRank(g as ncclComm_t, &mut rank) };
                assert_eq!(rank as usize, r);
                sum_check(g as ncclComm_t, (r + 1) as f32, 6.0, 100).unwrap();
                unsafe { ncclCommDestroy(g as ncclComm_t) };
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    for c in comms {
        unsafe { ncclCommDestroy(c) };
    }
}

/// A call stuck on a peer that never comes, aborted from another thread: the communicator
/// stays aborted (the failing call does not relabel it as failed), so the next call says it was
/// aborted, and the peer hears of an abort. Threads of one process (ncclCommInitAll).
#[test]
fn an_abort_under_a_blocked_call_stays_an_abort() {
    let mut comms = vec![std::ptr::null_mut(); 2];
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) },
        OK
    );
    let handle = comms[0] as usize;
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        unsafe { ncclCommAbort(handle as ncclComm_t) };
    });
    // Rank 1 never joins: the all-reduce waits until the abort stops it.
    let mut buf = vec![1.0f32; 1024];
    let p = buf.as_mut_ptr() as *mut c_void;
    let started = Instant::now();
    let r = unsafe { ncclAllReduce(p, p, buf.len(), FLOAT, SUM, comms[0], std::ptr::null_mut()) };
    aborter.join().unwrap();
    assert_ne!(r, OK, "the all-reduce succeeded without its peer");
    assert!(started.elapsed() < Duration::from_secs(10));
    // The handle is gone after the abort; the peer learns why. Its first all-reduce may still
    // complete with the contribution rank 0 had sent before the abort; the next cannot.
    let peer_call =
        || unsafe { ncclAllReduce(p, p, buf.len(), FLOAT, SUM, comms[1], std::ptr::null_mut()) };
    if peer_call() == OK {
        assert_ne!(
            peer_call(),
            OK,
            "the peer's second all-reduce succeeded without rank 0"
        );
    }
    let msg = last_error();
    assert!(
        msg.contains("rank 0 aborted its communicator"),
        "the peer should hear of the abort: {msg}"
    );
    unsafe { ncclCommDestroy(comms[1]) };
}
