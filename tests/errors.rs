//! Every error path: bad arguments get a clear code and message and leave the communicator
//! usable; a dead, absent or disagreeing peer gives an error instead of a hang.

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

/// Expects `code` and a last-error message containing every word of `needles`.
fn expect_err(
    r: ncclResult_t,
    code: ncclResult_t,
    needles: &[&str],
    what: &str,
) -> Result<(), String> {
    if r != code {
        return Err(format!(
            "{what}: returned {r:?}, expected {code:?} ({})",
            last_error()
        ));
    }
    let msg = last_error();
    for n in needles {
        if !msg.contains(n) {
            return Err(format!("{what}: message {msg:?} does not mention {n:?}"));
        }
    }
    Ok(())
}

/// An all-reduce of `rank + 1` that must give n(n+1)/2: proof the communicator still works.
fn still_works(comm: ncclComm_t, n: usize, rank: usize) -> Result<(), String> {
    let send = [(rank + 1) as f32; 33];
    let mut recv = vec![0f32; 33];
    nccl!(ncclAllReduce(
        send.as_ptr() as *const c_void,
        recv.as_mut_ptr() as *mut c_void,
        33,
        FLOAT,
        SUM,
        comm,
        S
    ));
    let want = (n * (n + 1) / 2) as f32;
    if recv.iter().any(|&v| v != want) {
        return Err(format!(
            "all-reduce after an error gave {:?}, expected {want}",
            &recv[..3]
        ));
    }
    Ok(())
}

/// Bad arguments on every entry point family, each followed by a working collective.
fn bad_arguments(comm: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let buf = vec![0f32; 64];
    let mut out = vec![0f32; 64 * n];
    let sp = buf.as_ptr() as *const c_void;
    let rp = out.as_mut_ptr() as *mut c_void;
    let invalid = ncclResult_t::ncclInvalidArgument;
    unsafe {
        expect_err(
            ncclAllReduce(std::ptr::null(), rp, 8, FLOAT, SUM, comm, S),
            invalid,
            &["ncclAllReduce", "sendbuff", "NULL"],
            "null sendbuff",
        )?;
        expect_err(
            ncclAllReduce(sp, std::ptr::null_mut(), 8, FLOAT, SUM, comm, S),
            invalid,
            &["recvbuff", "NULL"],
            "null recvbuff",
        )?;
        expect_err(
            ncclAllReduce(sp, rp, 8, 99, SUM, comm, S),
            invalid,
            &["datatype", "99"],
            "bad datatype",
        )?;
        expect_err(
            ncclAllReduce(sp, rp, 8, -1, SUM, comm, S),
            invalid,
            &["datatype"],
            "negative datatype",
        )?;
        expect_err(
            ncclAllReduce(sp, rp, 8, FLOAT, 17, comm, S),
            invalid,
            &["op 17"],
            "unknown op",
        )?;
        expect_err(
            ncclBroadcast(sp, rp, 8, FLOAT, n as i32, comm, S),
            invalid,
            &["root", "out of range"],
            "root too large",
        )?;
        expect_err(
            ncclReduce(sp, rp, 8, FLOAT, SUM, -2, comm, S),
            invalid,
            &["root"],
            "negative root",
        )?;
        expect_err(
            ncclSend(sp, 8, FLOAT, n as i32 + 3, comm, S),
            invalid,
            &["peer"],
            "peer out of range",
        )?;
        expect_err(
            ncclRecv(rp, 8, FLOAT, -1, comm, S),
            invalid,
            &["peer"],
            "negative peer",
        )?;
        expect_err(
            ncclAllGather(sp, rp, usize::MAX / 2, FLOAT, comm, S),
            invalid,
            &["overflow"],
            "count overflow",
        )?;
        // Overlapping buffers that are not the in-place layout.
        let p = out.as_mut_ptr();
        expect_err(
            ncclAllReduce(
                p.add(1) as *const c_void,
                p as *mut c_void,
                8,
                FLOAT,
                SUM,
                comm,
                S,
            ),
            invalid,
            &["overlap"],
            "partial overlap",
        )?;
        // Queries with NULL outputs.
        expect_err(
            ncclCommCount(comm, std::ptr::null_mut()),
            invalid,
            &["count", "NULL"],
            "null count",
        )?;
        expect_err(
            ncclGetVersion(std::ptr::null_mut()),
            invalid,
            &["version"],
            "null version",
        )?;
        // A custom op: wrong datatype, destroyed, destroyed twice.
        let mut op = 0;
        let mut scalar = 2.0f32;
        expect_err(
            ncclRedOpCreatePreMulSum(&mut op, std::ptr::null_mut(), FLOAT, 1, comm),
            invalid,
            &["scalar"],
            "null scalar",
        )?;
        expect_err(
            ncclRedOpCreatePreMulSum(
                &mut op,
                &mut scalar as *mut f32 as *mut c_void,
                FLOAT,
                7,
                comm,
            ),
            invalid,
            &["residence"],
            "bad residence",
        )?;
        nccl!(ncclRedOpCreatePreMulSum(
            &mut op,
            &mut scalar as *mut f32 as *mut c_void,
            FLOAT,
            1,
            comm
        ));
        expect_err(
            ncclAllReduce(sp, rp, 8, 8, op, comm, S),
            invalid,
            &["created for datatype float"],
            "op on wrong datatype",
        )?;
        nccl!(ncclRedOpDestroy(op, comm));
        expect_err(
            ncclAllReduce(sp, rp, 8, FLOAT, op, comm, S),
            invalid,
            &["destroyed"],
            "destroyed op",
        )?;
        expect_err(
            ncclRedOpDestroy(op, comm),
            invalid,
            &["destroyed"],
            "op destroyed twice",
        )?;
        expect_err(
            ncclRedOpDestroy(SUM, comm),
            invalid,
            &["built-in"],
            "destroying a built-in op",
        )?;
        // Group misuse.
        expect_err(
            ncclGroupEnd(),
            ncclResult_t::ncclInvalidUsage,
            &["without a matching"],
            "unbalanced group end",
        )?;
        // Config misuse.
        let mut child: ncclComm_t = std::ptr::null_mut();
        let mut cfg: ncclConfig_t = std::mem::zeroed();
        cfg.size = std::mem::size_of::<ncclConfig_t>();
        expect_err(
            ncclCommSplit(comm, 0, 0, &mut child, &mut cfg),
            invalid,
            &["NCCL_CONFIG_INITIALIZER"],
            "config without magic",
        )?;
        expect_err(
            ncclCommSplit(comm, -5, 0, &mut child, std::ptr::null_mut()),
            invalid,
            &["color"],
            "negative color",
        )?;
    }
    still_works(comm, n, rank)?;
    // A failed call inside a group makes the whole group do nothing, and says so.
    unsafe {
        nccl!(ncclGroupStart());
        let r1 = ncclAllReduce(sp, rp, 8, 42, SUM, comm, S);
        let r2 = ncclAllReduce(sp, rp, 8, FLOAT, SUM, comm, S);
        let end = ncclGroupEnd();
        if r1 != ncclResult_t::ncclInvalidArgument
            || r2 != OK
            || end != ncclResult_t::ncclInvalidArgument
        {
            return Err(format!("group with a bad call: {r1:?} {r2:?} {end:?}"));
        }
        // The group's error names the call that failed: its entry point, peer and count.
        let peer = ((rank + 1) % n) as i32;
        nccl!(ncclGroupStart());
        let r1 = ncclRecv(rp, 8, FLOAT, peer, comm, S);
        let r2 = ncclSend(std::ptr::null(), 8, FLOAT, peer, comm, S);
        expect_err(
            ncclGroupEnd(),
            invalid,
            &[
                "group did nothing",
                "ncclSend",
                &format!("peer {peer}, count 8"),
                "sendbuff",
            ],
            "group with a bad send",
        )?;
        if r1 != OK || r2 != invalid {
            return Err(format!("group with a bad send: {r1:?} {r2:?}"));
        }
    }
    still_works(comm, n, rank)?;
    // Op of another communicator.
    let mut dup: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommSplit(
        comm,
        0,
        rank as i32,
        &mut dup,
        std::ptr::null_mut()
    ));
    let mut op = 0;
    let mut scalar = 1.0f32;
    nccl!(ncclRedOpCreatePreMulSum(
        &mut op,
        &mut scalar as *mut f32 as *mut c_void,
        FLOAT,
        1,
        dup
    ));
    unsafe {
        expect_err(
            ncclAllReduce(sp, rp, 8, FLOAT, op, comm, S),
            invalid,
            &["another communicator"],
            "op of another comm",
        )?;
    }
    nccl!(ncclRedOpDestroy(op, dup));
    nccl!(ncclCommDestroy(dup));
    // Use after destroy.
    unsafe {
        let mut count = 0;
        expect_err(
            ncclCommCount(dup, &mut count),
            invalid,
            &["destroyed"],
            "count after destroy",
        )?;
        expect_err(
            ncclAllReduce(sp, rp, 8, FLOAT, SUM, dup, S),
            invalid,
            &["destroyed"],
            "all-reduce after destroy",
        )?;
        expect_err(
            ncclCommCount(std::ptr::null_mut(), &mut count),
            invalid,
            &["NULL"],
            "null comm",
        )?;
        expect_err(
            ncclCommCount(0x1234 as ncclComm_t, &mut count),
            invalid,
            &["not a communicator"],
            "bogus comm",
        )?;
    }
    still_works(comm, n, rank)
}

fn init_errors() -> Result<(), String> {
    let id = unique_id();
    let mut c: ncclComm_t = std::ptr::null_mut();
    let invalid = ncclResult_t::ncclInvalidArgument;
    unsafe {
        expect_err(
            ncclCommInitRank(&mut c, 2, id, 2),
            invalid,
            &["rank 2", "out of range"],
            "rank >= nranks",
        )?;
        expect_err(
            ncclCommInitRank(&mut c, -1, id, 0),
            invalid,
            &["nranks"],
            "negative nranks",
        )?;
        expect_err(
            ncclCommInitRank(std::ptr::null_mut(), 1, id, 0),
            invalid,
            &["comm", "NULL"],
            "null comm out",
        )?;
        let garbage = ncclUniqueId {
            internal: [7; NCCL_UNIQUE_ID_BYTES],
        };
        let r = ncclCommInitRank(&mut c, 1, garbage, 0);
        if r == OK {
            return Err("init with a garbage unique id succeeded".into());
        }
        let mut cfg: ncclConfig_t = std::mem::zeroed();
        cfg.size = std::mem::size_of::<ncclConfig_t>();
        cfg.magic = 0x1234;
        expect_err(
            ncclCommInitRankConfig(&mut c, 1, id, 0, &mut cfg),
            invalid,
            &["magic"],
            "bad config magic",
        )?;
        expect_err(
            ncclCommInitAll(&mut c, 0, std::ptr::null()),
            invalid,
            &["ndev"],
            "InitAll with 0 ranks",
        )?;
        // A network that does not exist fails the init (as NCCL's "network ... not found"),
        // even for a communicator that needs no network; one that does is taken.
        let mut cfg = config(1, c"net");
        cfg.netName = c"Bogus".as_ptr();
        expect_err(
            ncclCommInitRankConfig(&mut c, 1, unique_id(), 0, &mut cfg),
            invalid,
            &["netName \"Bogus\"", "not found"],
            "an unknown netName",
        )?;
        cfg.netName = c"Socket".as_ptr();
        let r = ncclCommInitRankConfig(&mut c, 1, unique_id(), 0, &mut cfg);
        if r != OK {
            return Err(format!("netName Socket: {r:?} {}", last_error()));
        }
        ncclCommDestroy(c);
    }
    Ok(())
}

#[test]
fn init_arguments_are_checked() {
    init_errors().unwrap();
}

/// A size that cannot be mapped, whole pages of it wrapping around or not, is refused as an
/// argument, naming the size asked for; the out-pointer keeps its value.
#[test]
fn allocations_too_large_to_map_are_refused() {
    let sentinel = std::ptr::dangling_mut::<c_void>();
    let mut p = sentinel;
    for size in [usize::MAX, usize::MAX - 4095, 1usize << 63] {
        unsafe {
            expect_err(
                ncclMemAlloc(&mut p, size),
                ncclResult_t::ncclInvalidArgument,
                &[&format!("size {size} bytes"), "more than can be mapped"],
                "ncclMemAlloc of too much",
            )
            .unwrap();
            expect_err(
                commMemAllocShared(&mut p, size),
                ncclResult_t::ncclInvalidArgument,
                &[&format!("size {size} bytes")],
                "commMemAllocShared of too much",
            )
            .unwrap();
        }
        assert_eq!(p, sentinel, "a refused allocation wrote its out-pointer");
    }
    // A plain size still works afterwards.
    unsafe {
        assert_eq!(ncclMemAlloc(&mut p, 5000), OK);
        assert_eq!(ncclMemFree(p), OK);
    }
}

/// Each thread keeps the communicator it called last (`ffi::lane::with_comm`): once another
/// thread destroys it, the kept one must not serve a call, which fails as use after destroy.
#[test]
fn a_communicator_destroyed_elsewhere_is_not_served_from_a_thread_that_kept_it() {
    let mut c: ncclComm_t = std::ptr::null_mut();
    assert_eq!(unsafe { ncclCommInitRank(&mut c, 1, unique_id(), 0) }, OK);
    let handle = c as usize;
    let (to_main, from_user) = std::sync::mpsc::channel::<ncclResult_t>();
    let (to_user, from_main) = std::sync::mpsc::channel::<()>();
    let user = std::thread::spawn(move || {
        let c = handle as ncclComm_t;
        let (send, mut recv) = ([3.0f32; 5], [0.0f32; 5]);
        let call = |recv: &mut [f32; 5], count| unsafe {
            ncclAllReduce(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                count,
                FLOAT,
                SUM,
                c,
                S,
            )
        };
        // A zero-element call and a real one, both on the kept communicator.
        to_main.send(call(&mut recv, 0)).unwrap();
        to_main.send(call(&mut recv, 5)).unwrap();
        assert_eq!(recv, [3.0; 5]);
        from_main.recv().unwrap();
        let after = call(&mut recv, 0);
        let msg = last_error();
        assert!(msg.contains("destroyed"), "{msg}");
        to_main.send(after).unwrap();
    });
    assert_eq!(from_user.recv().unwrap(), OK);
    assert_eq!(from_user.recv().unwrap(), OK);
    assert_eq!(unsafe { ncclCommDestroy(c) }, OK);
    to_user.send(()).unwrap();
    assert_eq!(
        from_user.recv_timeout(Duration::from_secs(60)).unwrap(),
        ncclResult_t::ncclInvalidArgument
    );
    user.join().unwrap();
}

#[test]
fn panics_and_strings() {
    unsafe {
        let s = std::ffi::CStr::from_ptr(ncclGetErrorString(4))
            .to_string_lossy()
            .into_owned();
        assert!(s.contains("invalid argument"), "{s}");
        let s = std::ffi::CStr::from_ptr(ncclGetErrorString(99))
            .to_string_lossy()
            .into_owned();
        assert!(s.contains("unknown"), "{s}");
        let mut v = 0;
        assert_eq!(ncclGetVersion(&mut v), OK);
        assert_eq!(v, NCCL_VERSION_CODE);
    }
}

#[test]
fn bad_arguments_leave_the_communicator_usable_threads() {
    with_threads(3, Duration::from_secs(120), bad_arguments);
}

/// Every scenario a rank process runs, by the name its launcher gives.
const SCENARIOS: &[(&str, Scenario)] = &[
    ("bad_arguments", |w| on_comm(w, bad_arguments)),
    ("dead_peer", dead_peer),
    ("mismatch", mismatch),
    ("root_mismatch", root_mismatch),
    ("settings_differ", settings_differ),
    ("absent_peer", absent_peer),
    ("missing_at_init", missing_at_init),
    ("abort_unblocks", abort_unblocks),
];

/// Rank 1 dies in the middle; the others must get an error, not hang.
fn dead_peer(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    still_works(c, w.nranks, w.rank)?;
    if w.rank == 1 {
        std::process::exit(3);
    }
    let mut big = vec![1f32; 1 << 20];
    let t = Instant::now();
    let r = unsafe {
        ncclAllReduce(
            big.as_ptr() as *const c_void,
            big.as_mut_ptr() as *mut c_void,
            1 << 20,
            FLOAT,
            SUM,
            c,
            S,
        )
    };
    if r != ncclResult_t::ncclRemoteError {
        return Err(format!(
            "all-reduce with a dead peer returned {r:?}: {}",
            last_error()
        ));
    }
    let msg = last_error();
    // Either this rank saw rank 1 die, or it saw a survivor abort after seeing it.
    let other = if w.rank == 0 { "rank 2" } else { "rank 0" };
    if !(msg.contains("rank 1") || (msg.contains(other) && msg.contains("aborted"))) {
        return Err(format!(
            "error names neither the dead rank nor the aborting one: {msg}"
        ));
    }
    let mut state = ncclResult_t::ncclSuccess;
    nccl!(ncclCommGetAsyncError(c, &mut state));
    if state != ncclResult_t::ncclRemoteError {
        return Err(format!("async error after a dead peer is {state:?}"));
    }
    println!("detected in {:?}: {msg}", t.elapsed());
    nccl!(ncclCommAbort(c));
    Ok(())
}

/// Rank 1 calls a different collective: both sides must say so.
fn mismatch(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let send = vec![1f32; 100];
    let mut recv = vec![0f32; 100 * w.nranks];
    let r = unsafe {
        if w.rank == 0 {
            ncclAllReduce(
                send.as_ptr() as *const c_void,
                recv.as_mut_ptr() as *mut c_void,
                100,
                FLOAT,
                SUM,
                c,
                S,
            )
        } else {
            ncclAllGather(
                send.as_ptr() as *const c_void,
                recv.as_mut_ptr() as *mut c_void,
                100,
                FLOAT,
                c,
                S,
            )
        }
    };
    let msg = last_error();
    if r == OK {
        return Err("mismatched collectives succeeded".into());
    }
    if !(msg.contains("AllReduce") && msg.contains("AllGather")) {
        return Err(format!(
            "mismatch message does not name both collectives: {msg}"
        ));
    }
    nccl!(ncclCommAbort(c));
    Ok(())
}

/// arg: a rooted collective. Rank 0 passes root 0, the others root 1. Broadcast and scatter
/// used to succeed everywhere, the third rank silently taking rank 1's data; now the rank that
/// receives another root's message says the ranks passed different roots. Every rank prints
/// what its call returned; the test reads it.
fn root_mismatch(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let n = w.nranks;
    let root = if w.rank == 0 { 0 } else { 1 };
    let count = 100;
    let send = vec![(w.rank + 1) as f32; count * n];
    let mut recv = vec![0f32; count * n];
    let (sp, rp) = (
        send.as_ptr() as *const c_void,
        recv.as_mut_ptr() as *mut c_void,
    );
    let r = unsafe {
        match w.arg.as_str() {
            "Broadcast" => ncclBroadcast(sp, rp, count, FLOAT, root, c, S),
            "Scatter" => ncclScatter(sp, rp, count, FLOAT, root, c, S),
            "Reduce" => ncclReduce(sp, rp, count, FLOAT, SUM, root, c, S),
            "Gather" => ncclGather(sp, rp, count, FLOAT, root, c, S),
            other => return Err(format!("unknown collective {other}")),
        }
    };
    println!("result {r:?}: {}", last_error());
    // A rank that succeeded and is no root in its own view received data: it must be its
    // root's, not another root's.
    if r == OK && w.rank as i32 != root && matches!(w.arg.as_str(), "Broadcast" | "Scatter") {
        let want = (root + 1) as f32;
        if let Some(i) = recv[..count].iter().position(|&v| v != want) {
            return Err(format!(
                "{} succeeded with element {i} = {}, not root {root}'s {want}",
                w.arg, recv[i]
            ));
        }
    }
    if r == OK {
        // The other root's message may still be on its way here: the next collective must
        // not take it for its own, and the error says whose it is.
        let mut x = [1f32; 4];
        let xp = x.as_mut_ptr() as *mut c_void;
        let r = unsafe { ncclAllReduce(xp, xp, 4, FLOAT, SUM, c, S) };
        println!("next: {r:?}: {}", last_error());
        if r == OK && x != [n as f32; 4] {
            return Err(format!("the next all-reduce succeeded with {x:?}"));
        }
    }
    unsafe { ncclCommAbort(c) };
    Ok(())
}

/// arg: `VAR=A/B[/ok]`. Rank 1 sets VAR to B, the others to A (unset when empty), before
/// init. A setting that decides how ranks exchange data must agree: init fails on every rank
/// naming VAR and rank 1, unless `/ok` says the two values are the same (64K and 65536), and
/// then a collective is correct.
fn settings_differ(w: &Worker) -> Result<(), String> {
    let (var, rest) = w.arg.split_once('=').ok_or("bad arg")?;
    let parts: Vec<&str> = rest.split('/').collect();
    let value = if w.rank == 1 { parts[1] } else { parts[0] };
    if !value.is_empty() {
        std::env::set_var(var, value);
    }
    let same = parts.get(2) == Some(&"ok");
    let mut c: ncclComm_t = std::ptr::null_mut();
    let r = unsafe { ncclCommInitRank(&mut c, w.nranks as i32, w.id, w.rank as i32) };
    let msg = last_error();
    if same {
        if r != OK {
            return Err(format!("init with equal {var} failed: {msg}"));
        }
        let n = w.nranks;
        let mut x = vec![(w.rank + 1) as f32; 1001];
        let xp = x.as_mut_ptr() as *mut c_void;
        nccl!(ncclAllReduce(xp, xp, 1001, FLOAT, SUM, c, S));
        let want = (n * (n + 1) / 2) as f32;
        if let Some(i) = x.iter().position(|&v| v != want) {
            return Err(format!("element {i} is {}, expected {want}", x[i]));
        }
        nccl!(ncclCommDestroy(c));
        return Ok(());
    }
    if r != ncclResult_t::ncclInvalidUsage || !msg.contains(var) || !msg.contains("on rank 1") {
        return Err(format!("init with {var} differing on rank 1: {r:?} {msg}"));
    }
    Ok(())
}

/// Rank 1 never joins the collective: rank 0 times out naming it.
/// With arg "set": no COMM_TIMEOUT; rank 0 sets its limit with commSetTimeout instead (after
/// refusing a negative and a NaN limit) and must time out after about that.
fn absent_peer(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let t = Instant::now();
    if w.arg == "set" && w.rank == 0 {
        for bad in [-1.0, f64::NAN] {
            if commSetTimeout(c, bad) != ncclResult_t::ncclInvalidArgument {
                return Err(format!("commSetTimeout({bad}) was accepted"));
            }
        }
        nccl!(commSetTimeout(c, 1.5));
    }
    if w.rank == 1 {
        std::thread::sleep(Duration::from_secs(6));
        nccl!(ncclCommDestroy(c));
        return Ok(());
    }
    let send = [1f32; 16];
    let mut recv = vec![0f32; 16];
    let r = unsafe {
        ncclAllReduce(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            16,
            FLOAT,
            SUM,
            c,
            S,
        )
    };
    let msg = last_error();
    if r != ncclResult_t::ncclTimeout || !msg.contains("rank 1") {
        return Err(format!("absent peer: {r:?} {msg}"));
    }
    if t.elapsed() > Duration::from_secs(4) {
        return Err(format!("the timeout came after {:?}", t.elapsed()));
    }
    nccl!(ncclCommAbort(c));
    Ok(())
}

/// One rank never arrives at init: the others fail after COMM_INIT_TIMEOUT naming it.
fn missing_at_init(w: &Worker) -> Result<(), String> {
    let mut c: ncclComm_t = std::ptr::null_mut();
    let t = Instant::now();
    let r = unsafe { ncclCommInitRank(&mut c, w.nranks as i32, w.id, w.rank as i32) };
    let msg = last_error();
    if r == OK {
        return Err("init succeeded with a rank missing".into());
    }
    if r != ncclResult_t::ncclTimeout
        || !msg.contains("rank 3")
        || !msg.contains("never arrived")
        || t.elapsed() > Duration::from_secs(20)
    {
        return Err(format!(
            "init with rank 3 missing: {r:?} after {:?}: {msg}",
            t.elapsed()
        ));
    }
    Ok(())
}

/// ncclCommAbort from another thread unblocks a call stuck on a peer that never comes.
fn abort_unblocks(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    if w.rank == 1 {
        std::thread::sleep(Duration::from_secs(4));
        nccl!(ncclCommDestroy(c));
        return Ok(());
    }
    let handle = c as usize;
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        unsafe { ncclCommAbort(handle as ncclComm_t) };
    });
    let send = [1f32; 16];
    let mut recv = vec![0f32; 16];
    let t = Instant::now();
    let r = unsafe {
        ncclAllReduce(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            16,
            FLOAT,
            SUM,
            c,
            S,
        )
    };
    if r == OK || t.elapsed() > Duration::from_secs(3) {
        return Err(format!(
            "abort did not unblock: {r:?} after {:?}",
            t.elapsed()
        ));
    }
    Ok(())
}

scenario_tests!(SCENARIOS);

#[test]
fn bad_arguments_leave_the_communicator_usable_processes() {
    let r = launch(
        "worker",
        "bad_arguments",
        2,
        "",
        &[],
        Duration::from_secs(120),
    );
    assert_all_ok(&r, "bad arguments");
}

#[test]
fn a_dead_peer_gives_remote_error() {
    let r = launch("worker", "dead_peer", 3, "", &[], Duration::from_secs(60));
    assert_eq!(r[1].status, Some(3));
    assert!(
        r[0].ok() && r[2].ok(),
        "rank 0: {}\n{}\nrank 2: {}\n{}",
        r[0].stdout,
        r[0].stderr,
        r[2].stdout,
        r[2].stderr
    );
}

#[test]
fn mismatched_collectives_are_reported() {
    let r = launch(
        "worker",
        "mismatch",
        2,
        "",
        &[("COMM_TIMEOUT", "20")],
        Duration::from_secs(60),
    );
    assert_all_ok(&r, "mismatch");
}

#[test]
fn ranks_passing_different_roots_are_told_so() {
    for coll in ["Broadcast", "Scatter", "Reduce", "Gather"] {
        let t = Instant::now();
        let r = launch(
            "worker",
            "root_mismatch",
            3,
            coll,
            &[("COMM_TIMEOUT", "5")],
            Duration::from_secs(60),
        );
        assert_all_ok(&r, &format!("root_mismatch {coll}"));
        for x in &r {
            eprintln!("{coll} rank {}: {}", x.rank, x.stdout.trim());
        }
        assert!(
            r.iter()
                .any(|x| x.stdout.contains("different roots") || x.stdout.contains("(root ")),
            "{coll}: no rank was told of the other root"
        );
        eprintln!("{coll}: {:?}", t.elapsed());
    }
}

#[test]
fn settings_that_shape_the_exchange_must_agree_at_init() {
    for arg in [
        "COMM_ALGO=/tree",
        "COMM_SLICE_BYTES=/4096",
        "COMM_SHM_DISABLE=0/1",
        "COMM_RING_BY_HOST=/0",
        "COMM_DIRECT_MAX_BYTES=64K/65536/ok",
        "COMM_ALGO=ring,tree/ RING,Tree /ok",
    ] {
        let r = launch(
            "worker",
            "settings_differ",
            3,
            arg,
            &[("COMM_INIT_TIMEOUT", "30")],
            Duration::from_secs(60),
        );
        assert_all_ok(&r, &format!("settings_differ {arg}"));
    }
}

#[test]
fn an_absent_peer_times_out_with_its_rank_named() {
    let r = launch(
        "worker",
        "absent_peer",
        2,
        "",
        &[("COMM_TIMEOUT", "1.5")],
        Duration::from_secs(60),
    );
    assert_all_ok(&r, "absent peer");
    let r = launch(
        "worker",
        "absent_peer",
        2,
        "set",
        &[],
        Duration::from_secs(60),
    );
    assert_all_ok(&r, "absent peer, limit set with commSetTimeout");
}

#[test]
fn init_times_out_naming_the_missing_rank() {
    let r = launch_ranks(
        "worker",
        "missing_at_init",
        4,
        &[0, 1, 2],
        "",
        &[("COMM_INIT_TIMEOUT", "2")],
        Duration::from_secs(60),
    );
    assert_all_ok(&r, "missing rank at init");
}

#[test]
fn abort_from_another_thread_unblocks() {
    let r = launch(
        "worker",
        "abort_unblocks",
        2,
        "",
        &[],
        Duration::from_secs(60),
    );
    assert_all_ok(&r, "abort unblocks");
}
