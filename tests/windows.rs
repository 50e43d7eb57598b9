//! Windows and one-sided operations, between real processes: puts, gets and atomics into a
//! target that is busy and never calls the library; NCCL's signal counters (opCnt, groups,
//! ordering); contention on one word; signal-pad channels used by two threads at once; bad
//! input; a peer that dies during a wait. Each runs with ranks on one host (shared memory the
//! library allocated, and ordinary memory reached with process_vm_writev/readv) and with
//! ranks on two simulated hosts (COMM_HOSTID per rank, so the TCP path and the target's
//! listener thread do the work).

// The unsafe blocks here call the library's C API (ncclX/commX) with arguments the test
// itself made, or read and write window memory the test allocated (ncclMemAlloc, or its own
// mapping) inside the sizes it asked for; what each needs is not repeated per block.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use comm::ffi::types::*;
use comm::ffi::*;
use common::*;
use std::os::raw::c_void;
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

const S: cudaStream_t = std::ptr::null_mut();
const UINT8: i32 = 1;
const INT32: i32 = 2;
const UINT64: i32 = 5;
const FLOAT32: i32 = 7;
const SYM: i32 = NCCL_WIN_COLL_SYMMETRIC;

/// The byte rank `r` writes at position `i` of its block.
fn pat(r: usize, i: usize) -> u8 {
    (r * 131 + i * 7 + i / 251 + 1) as u8
}

/// How a scenario's windows are made and where the ranks are, from the launch argument:
/// "shared" (commWindowAllocate) or "user" (ordinary heap memory), optionally ",net" (ranks
/// on two hosts by parity, told apart by COMM_HOSTID, so neighbours talk over TCP) or
/// ",netns" (the same hosts as network namespaces).
struct Mode {
    shared: bool,
    /// Shared memory from ncclMemAlloc (no GPU here), registered with ncclCommWindowRegister.
    memalloc: bool,
    net: bool,
}

fn mode(w: &Worker) -> Mode {
    Mode {
        shared: w.arg.contains("shared") || w.arg.contains("memalloc"),
        memalloc: w.arg.contains("memalloc"),
        net: w.arg.contains("net"),
    }
}

fn init(w: &Worker) -> Result<ncclComm_t, String> {
    if w.arg.contains("netns") {
        // A rank of a network namespace: the id comes from NCCL_COMM_ID and COMM_SECRET.
        let id = unique_id();
        let mut c: ncclComm_t = null_mut();
        nccl!(ncclCommInitRank(&mut c, w.nranks as i32, id, w.rank as i32));
        return Ok(c);
    }
    if mode(w).net {
        std::env::set_var("COMM_HOSTID", format!("win-host-{}", w.rank % 2));
    }
    init_rank(w)
}

/// A window of `size` bytes on every rank: its local address and handle. User memory is
/// leaked on purpose (the process exits at the end of the scenario).
fn window(comm: ncclComm_t, size: usize, m: &Mode) -> Result<(*mut u8, ncclWindow_t), String> {
    let mut win: ncclWindow_t = null_mut();
    if m.memalloc {
        let mut p: *mut c_void = null_mut();
        nccl!(ncclMemAlloc(&mut p, size));
        nccl!(ncclCommWindowRegister(comm, p, size, &mut win, SYM));
        Ok((p as *mut u8, win))
    } else if m.shared {
        let mut p: *mut c_void = null_mut();
        nccl!(commWindowAllocate(comm, size, SYM, &mut p, &mut win));
        Ok((p as *mut u8, win))
    } else {
        // 8-byte aligned for the atomics.
        let v: &'static mut [u64] = Vec::leak(vec![0u64; size.div_ceil(8)]);
        let p = v.as_mut_ptr() as *mut u8;
        nccl!(ncclCommWindowRegister(
            comm,
            p as *mut c_void,
            size,
            &mut win,
            SYM
        ));
        Ok((p, win))
    }
}

fn barrier(comm: ncclComm_t) -> Result<(), String> {
    let mut x = [1.0f32];
    nccl!(ncclAllReduce(
        x.as_ptr() as *const c_void,
        x.as_mut_ptr() as *mut c_void,
        1,
        FLOAT32,
        0,
        comm,
        S
    ));
    Ok(())
}

/// A collective after an error: the communicator must still work.
fn still_works(comm: ncclComm_t, n: usize) -> Result<(), String> {
    let mut x = [1.0f32; 3];
    nccl!(ncclAllReduce(
        x.as_ptr() as *const c_void,
        x.as_mut_ptr() as *mut c_void,
        3,
        FLOAT32,
        0,
        comm,
        S
    ));
    if x != [n as f32; 3] {
        return Err(format!("allreduce after the error gave {x:?}"));
    }
    Ok(())
}

/// Expects `r` to be `want` with a last error that mentions `needle`.
fn expect(r: ncclResult_t, want: ncclResult_t, needle: &str, what: &str) -> Result<(), String> {
    if r != want {
        return Err(format!(
            "{what}: returned {r:?}, wanted {want:?} (last error: {})",
            last_error()
        ));
    }
    let msg = last_error();
    if !msg.contains(needle) {
        return Err(format!(
            "{what}: last error {msg:?} does not mention {needle:?}"
        ));
    }
    Ok(())
}

const SIZES: [usize; 5] = [0, 1, 7, 4099, (1 << 20) + 5];
/// Per origin: a block large enough for every size, one after the other.
const BLOCK: usize = 2 << 20;

/// Rank 0 is the target: it fills a region, then sleeps or computes without calling the
/// library while every other rank puts, gets, adds and swaps in its window; the origins must
/// finish well before the target comes back. Then everything is checked at the target.
fn busy_target(w: &Worker, computing: bool) -> Result<(), String> {
    let m = mode(w);
    let comm = init(w)?;
    let n = w.nranks;
    let size = 64 + BLOCK * (n + 1);
    let (mem, win) = window(comm, size, &m)?;
    let busy = Duration::from_secs(4);
    // The region origins read: the last block, filled by the target before it goes busy.
    let readable = 64 + BLOCK * n;
    if w.rank == 0 {
        let s = unsafe { std::slice::from_raw_parts_mut(mem.add(readable), BLOCK) };
        for (i, b) in s.iter_mut().enumerate() {
            *b = pat(99, i);
        }
    }
    barrier(comm)?;
    if w.rank == 0 {
        let t = Instant::now();
        if computing {
            let mut x = 1u64;
            while t.elapsed() < busy {
                for _ in 0..10_000 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                }
                std::hint::black_box(x);
            }
        } else {
            std::thread::sleep(busy);
        }
        barrier(comm)?;
        // Every origin's block, the counter, the swapped words.
        for r in 1..n {
            let s = unsafe { std::slice::from_raw_parts(mem.add(64 + BLOCK * r), BLOCK) };
            let last = SIZES[SIZES.len() - 1];
            for (i, &b) in s[..last].iter().enumerate() {
                if b != pat(r, i) {
                    return Err(format!(
                        "target: byte {i} of rank {r}'s block is {b}, wanted {}",
                        pat(r, i)
                    ));
                }
            }
            let swapped = unsafe { *(mem.add(8 * r) as *const u64) };
            if swapped != 1000 + r as u64 {
                return Err(format!("target: rank {r}'s swapped word is {swapped}"));
            }
        }
        let counter = unsafe { *(mem as *const u64) };
        let adds = 1000u64;
        let want = (n as u64 - 1) * adds * (adds + 1) / 2;
        if counter != want {
            return Err(format!("target: counter {counter}, wanted {want}"));
        }
    } else {
        let me = w.rank;
        // Where loads and stores reach the target: shared memory on the same host only.
        let mut direct: *mut c_void = null_mut();
        nccl!(commWinPeerPtr(comm, win, 0, &mut direct));
        let same_host = !m.net || me % 2 == 0;
        if (m.shared && same_host) == direct.is_null() {
            return Err(format!(
                "peer pointer to rank 0 is {direct:?} (shared {}, same host {same_host})",
                m.shared
            ));
        }
        if !direct.is_null() {
            let s =
                unsafe { std::slice::from_raw_parts((direct as *const u8).add(readable), 4096) };
            if let Some(i) = (0..4096).find(|&i| s[i] != pat(99, i)) {
                return Err(format!(
                    "load through the peer pointer: byte {i} is {}",
                    s[i]
                ));
            }
        }
        let start = Instant::now();
        let off = 64 + BLOCK * me;
        for &len in &SIZES {
            let src: Vec<u8> = (0..len).map(|i| pat(me, i)).collect();
            nccl!(commWinPut(
                src.as_ptr() as *const c_void,
                len,
                UINT8,
                0,
                win,
                off,
                comm
            ));
            nccl!(commWinFlush(0, win, comm));
            let mut back = vec![0u8; len];
            nccl!(commWinGet(
                back.as_mut_ptr() as *mut c_void,
                len,
                UINT8,
                0,
                win,
                off,
                comm
            ));
            if back != src {
                return Err(format!("get after put of {len} bytes differs"));
            }
            // An odd offset into what the target wrote.
            let mut got = vec![0u8; len];
            nccl!(commWinGet(
                got.as_mut_ptr() as *mut c_void,
                len,
                UINT8,
                0,
                win,
                readable + 3,
                comm
            ));
            if let Some(i) = (0..len).find(|&i| got[i] != pat(99, i + 3)) {
                return Err(format!("get of {len} bytes: byte {i} is {}", got[i]));
            }
        }
        for k in 1..=1000u64 {
            nccl!(commWinFetchAdd(k, null_mut(), UINT64, 0, win, 0, comm));
        }
        let mut old = 7u64;
        nccl!(commWinCompareSwap(
            0,
            1000 + me as u64,
            &mut old,
            UINT64,
            0,
            win,
            8 * me,
            comm
        ));
        if old != 0 {
            return Err(format!("first compare-and-swap found {old}, wanted 0"));
        }
        nccl!(commWinCompareSwap(
            5,
            77,
            &mut old,
            UINT64,
            0,
            win,
            8 * me,
            comm
        ));
        if old != 1000 + me as u64 {
            return Err(format!("failed compare-and-swap found {old}"));
        }
        let took = start.elapsed();
        if took >= busy - Duration::from_millis(500) {
            return Err(format!(
                "the one-sided operations took {took:?}: they waited for the target, which was busy for {busy:?}"
            ));
        }
        barrier(comm)?;
    }
    nccl!(ncclCommWindowDeregister(comm, win));
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

fn desc(peer: usize, op_cnt: i32) -> ncclWaitSignalDesc_t {
    ncclWaitSignalDesc_t {
        opCnt: op_cnt,
        peer: peer as i32,
        sigIdx: 0,
        ctx: 0,
    }
}

/// A put into a window the moment its registration returns: every rank's window must be in
/// place by then, also for a peer on another host whose put arrives over TCP. Many rounds of
/// register, put + signal to the next rank, wait for the previous one, check, deregister.
fn fresh_windows(w: &Worker) -> Result<(), String> {
    let m = mode(w);
    let comm = init(w)?;
    let (n, me) = (w.nranks, w.rank);
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    for round in 0..300usize {
        let (mem, win) = window(comm, 64, &m)?;
        let src: Vec<u8> = (0..8).map(|i| pat(me, round + i)).collect();
        nccl!(ncclPutSignal(
            src.as_ptr() as *const c_void,
            8,
            UINT8,
            next as i32,
            win,
            0,
            0,
            0,
            0,
            comm,
            S
        ));
        let mut d = [desc(prev, 1)];
        nccl!(ncclWaitSignal(1, d.as_mut_ptr(), comm, S));
        let got = unsafe { std::slice::from_raw_parts(mem, 8) };
        if let Some(i) = (0..8).find(|&i| got[i] != pat(prev, round + i)) {
            return Err(format!("round {round}: byte {i} is {}", got[i]));
        }
        // Nobody deregisters before every put of the round has landed.
        barrier(comm)?;
        nccl!(ncclCommWindowDeregister(comm, win));
    }
    Ok(())
}

/// NCCL's counters: several puts and a signal consumed by one wait with opCnt; surplus
/// signals satisfy later waits; a barrier of signals and waits in one group (waits first);
/// and data visible as soon as its signal is, over many rounds into distinct slots.
fn signals(w: &Worker) -> Result<(), String> {
    let m = mode(w);
    let comm = init(w)?;
    let (n, me) = (w.nranks, w.rank);
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let rounds = 200usize;
    let slot = 4096 + 13;
    let size = slot * rounds + 64;
    let (mem, win) = window(comm, size, &m)?;
    barrier(comm)?;
    // Three puts of different sizes and one bare signal: one wait for all four.
    let parts = [(0usize, 1usize), (8, 7), (64, 4000)];
    for &(off, len) in &parts {
        let src: Vec<u8> = (0..len).map(|i| pat(me, off + i)).collect();
        nccl!(ncclPutSignal(
            src.as_ptr() as *const c_void,
            len,
            UINT8,
            next as i32,
            win,
            off,
            0,
            0,
            0,
            comm,
            S
        ));
    }
    nccl!(ncclSignal(next as i32, 0, 0, 0, comm, S));
    let mut d = [desc(prev, 4)];
    nccl!(ncclWaitSignal(1, d.as_mut_ptr(), comm, S));
    for &(off, len) in &parts {
        let s = unsafe { std::slice::from_raw_parts(mem.add(off), len) };
        if let Some(i) = (0..len).find(|&i| s[i] != pat(prev, off + i)) {
            return Err(format!(
                "after the opCnt=4 wait, byte {} is {}",
                off + i,
                s[i]
            ));
        }
    }
    // Five signals, consumed by waits of 2 and 3.
    for _ in 0..5 {
        nccl!(ncclSignal(next as i32, 0, 0, 0, comm, S));
    }
    let mut d = [desc(prev, 2)];
    nccl!(ncclWaitSignal(1, d.as_mut_ptr(), comm, S));
    let mut d = [desc(prev, 3)];
    nccl!(ncclWaitSignal(1, d.as_mut_ptr(), comm, S));
    // The barrier NCCL documents, with the wait queued before the signals.
    for _ in 0..3 {
        let mut all: Vec<ncclWaitSignalDesc_t> =
            (0..n).filter(|&p| p != me).map(|p| desc(p, 1)).collect();
        nccl!(ncclGroupStart());
        nccl!(ncclWaitSignal(all.len() as i32, all.as_mut_ptr(), comm, S));
        for p in (0..n).filter(|&p| p != me) {
            nccl!(ncclSignal(p as i32, 0, 0, 0, comm, S));
        }
        nccl!(ncclGroupEnd());
    }
    barrier(comm)?;
    // Ordering: round k's data in slot k, then its signal; the receiver checks slot k the
    // moment its k-th signal is seen.
    for k in 0..rounds {
        let src: Vec<u8> = (0..slot).map(|i| pat(me + k, i)).collect();
        nccl!(ncclGroupStart());
        nccl!(ncclPutSignal(
            src.as_ptr() as *const c_void,
            slot,
            UINT8,
            next as i32,
            win,
            k * slot,
            0,
            0,
            0,
            comm,
            S
        ));
        nccl!(ncclGroupEnd());
        let mut d = [desc(prev, 1)];
        nccl!(ncclWaitSignal(1, d.as_mut_ptr(), comm, S));
        let s = unsafe { std::slice::from_raw_parts(mem.add(k * slot), slot) };
        if let Some(i) = (0..slot).find(|&i| s[i] != pat(prev + k, i)) {
            return Err(format!(
                "round {k}: signal seen but byte {i} of the data not there ({})",
                s[i]
            ));
        }
    }
    barrier(comm)?;
    nccl!(ncclCommWindowDeregister(comm, win));
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

/// Every rank adds 1 to rank 0's counter `adds` times; then a compare-and-swap lock guards a
/// read-modify-write (get, add, put, flush) of a plain word across processes.
fn contention(w: &Worker) -> Result<(), String> {
    let m = mode(w);
    let comm = init(w)?;
    let n = w.nranks;
    let adds: u64 = w
        .arg
        .split(',')
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let (mem, win) = window(comm, 4096, &m)?;
    barrier(comm)?;
    for _ in 0..adds {
        nccl!(commWinFetchAdd(1, null_mut(), UINT64, 0, win, 0, comm));
    }
    let sections = 300u64;
    let me = w.rank as u64 + 1;
    for _ in 0..sections {
        let mut old = 0u64;
        loop {
            nccl!(commWinCompareSwap(0, me, &mut old, UINT64, 0, win, 8, comm));
            if old == 0 {
                break;
            }
            std::thread::yield_now();
        }
        let mut v = 0u64;
        nccl!(commWinGet(
            &mut v as *mut u64 as *mut c_void,
            8,
            UINT8,
            0,
            win,
            16,
            comm
        ));
        v += 1;
        nccl!(commWinPut(
            &v as *const u64 as *const c_void,
            8,
            UINT8,
            0,
            win,
            16,
            comm
        ));
        nccl!(commWinFlush(0, win, comm));
        nccl!(commWinCompareSwap(me, 0, &mut old, UINT64, 0, win, 8, comm));
        if old != me {
            return Err(format!("the lock was {old} while rank {} held it", w.rank));
        }
    }
    barrier(comm)?;
    if w.rank == 0 {
        let words = unsafe { std::slice::from_raw_parts(mem as *const u64, 3) };
        if words[0] != n as u64 * adds {
            return Err(format!(
                "counter {} after {n} x {adds} fetch-adds",
                words[0]
            ));
        }
        if words[2] != n as u64 * sections {
            return Err(format!(
                "locked counter {} after {n} x {sections} sections",
                words[2]
            ));
        }
    }
    barrier(comm)?;
    nccl!(ncclCommWindowDeregister(comm, win));
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

/// Two threads of each rank, each with a channel of its own on one window: ping-pong between
/// ranks 0 and 1 on channel 1 while all ranks run barriers on channel 2. Mixed-up channels
/// would consume each other's signals and time out. The pads are zero afterwards.
fn channels(w: &Worker) -> Result<(), String> {
    let m = mode(w);
    let comm = init(w)?;
    let (n, me) = (w.nranks, w.rank);
    let (_mem, win) = window(comm, 64, &m)?;
    barrier(comm)?;
    let (c, h) = (comm as usize, win as usize);
    let ping = std::thread::spawn(move || -> Result<(), String> {
        let (comm, win) = (c as ncclComm_t, h as ncclWindow_t);
        for _ in 0..500 {
            match me {
                0 => {
                    nccl!(commWinChannelSignal(1, 1, 20_000, win, comm));
                    nccl!(commWinChannelWait(1, 1, 20_000, win, comm));
                }
                1 => {
                    nccl!(commWinChannelWait(0, 1, 20_000, win, comm));
                    nccl!(commWinChannelSignal(0, 1, 20_000, win, comm));
                }
                _ => {}
            }
        }
        Ok(())
    });
    let bar = std::thread::spawn(move || -> Result<(), String> {
        let (comm, win) = (c as ncclComm_t, h as ncclWindow_t);
        for _ in 0..300 {
            nccl!(commWinChannelBarrier(2, 20_000, win, comm));
        }
        Ok(())
    });
    ping.join().map_err(|_| "ping thread panicked")??;
    bar.join().map_err(|_| "barrier thread panicked")??;
    barrier(comm)?;
    let mut pads: *mut c_void = null_mut();
    let mut nch = 0;
    nccl!(commWinSignalPads(comm, win, me as i32, &mut pads, &mut nch));
    if pads.is_null() || nch < 3 {
        return Err(format!("own signal pads {pads:?}, {nch} channels"));
    }
    let words = unsafe { std::slice::from_raw_parts(pads as *const u32, nch as usize * n) };
    if let Some(i) = words.iter().position(|&x| x != 0) {
        return Err(format!(
            "signal pad word {i} is {} after the synchronisations",
            words[i]
        ));
    }
    nccl!(ncclCommWindowDeregister(comm, win));
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

/// Bad input, each a clear error, the communicator working after each.
fn bad_input(w: &Worker) -> Result<(), String> {
    use ncclResult_t::*;
    let m = mode(w);
    let comm = init(w)?;
    let (n, me) = (w.nranks, w.rank);
    let (_mem, win) = window(comm, 4096, &m)?;
    let next = ((me + 1) % n) as i32;
    let mut buf = [0u8; 64];
    let dst = buf.as_mut_ptr() as *mut c_void;
    let src = dst as *const c_void;
    let mut old = 0u64;
    expect(
        unsafe { ncclPutSignal(src, 8, UINT8, next, win, 4093, 0, 0, 0, comm, S) },
        ncclInvalidArgument,
        "past the end",
        "put past the end",
    )?;
    expect(
        unsafe { commWinGet(dst, 2, INT32, next, win, 4090, comm) },
        ncclInvalidArgument,
        "past the end",
        "get past the end",
    )?;
    expect(
        unsafe { commWinPut(src, 1, UINT8, next, win, usize::MAX, comm) },
        ncclInvalidArgument,
        "past the end",
        "offset that overflows",
    )?;
    for peer in [n as i32, -1] {
        expect(
            unsafe { ncclPutSignal(src, 1, UINT8, peer, win, 0, 0, 0, 0, comm, S) },
            ncclInvalidArgument,
            "out of range",
            "peer out of range",
        )?;
        expect(
            unsafe { commWinFetchAdd(1, &mut old, UINT64, peer, win, 0, comm) },
            ncclInvalidArgument,
            "out of range",
            "atomic on a peer out of range",
        )?;
    }
    expect(
        unsafe { commWinFetchAdd(1, &mut old, UINT64, next, win, 4, comm) },
        ncclInvalidArgument,
        "aligned",
        "unaligned atomic",
    )?;
    expect(
        unsafe { commWinCompareSwap(0, 1, &mut old, INT32, next, win, 0, comm) },
        ncclInvalidArgument,
        "8-byte integers",
        "4-byte atomic",
    )?;
    expect(
        unsafe { commWinFetchAdd(1, &mut old, FLOAT32 + 1, next, win, 0, comm) },
        ncclInvalidArgument,
        "8-byte integers",
        "float64 atomic",
    )?;
    expect(
        unsafe { commWinFetchAdd(1, &mut old, UINT64, next, win, 4092, comm) },
        ncclInvalidArgument,
        "past the end",
        "atomic past the end",
    )?;
    for (sig, ctx, flags, what) in [(1, 0, 0, "sigIdx"), (0, 1, 0, "ctx"), (0, 0, 1, "flags")] {
        expect(
            unsafe { ncclPutSignal(src, 1, UINT8, next, win, 0, sig, ctx, flags, comm, S) },
            ncclInvalidArgument,
            what,
            "reserved argument of ncclPutSignal",
        )?;
        expect(
            unsafe { ncclSignal(next, sig, ctx, flags, comm, S) },
            ncclInvalidArgument,
            what,
            "reserved argument of ncclSignal",
        )?;
    }
    let mut d = [desc(next as usize, 0)];
    expect(
        unsafe { ncclWaitSignal(1, d.as_mut_ptr(), comm, S) },
        ncclInvalidArgument,
        "opCnt",
        "opCnt 0",
    )?;
    expect(
        unsafe { ncclWaitSignal(0, d.as_mut_ptr(), comm, S) },
        ncclInvalidArgument,
        "nDesc",
        "nDesc 0",
    )?;
    let mut d = [ncclWaitSignalDesc_t {
        opCnt: 1,
        peer: next,
        sigIdx: 2,
        ctx: 0,
    }];
    expect(
        unsafe { ncclWaitSignal(1, d.as_mut_ptr(), comm, S) },
        ncclInvalidArgument,
        "sigIdx",
        "wait sigIdx",
    )?;
    expect(
        unsafe { commWinChannelSignal(next, 1 << 20, 100, win, comm) },
        ncclInvalidArgument,
        "channel",
        "channel out of range",
    )?;
    let mut p: *mut c_void = null_mut();
    expect(
        unsafe { ncclGetPeerDevicePointer(win, 0, next, &mut p) },
        ncclInvalidUsage,
        "host memory",
        "a device pointer into a host-memory window",
    )?;
    expect(
        unsafe { ncclGetPeerDevicePointer(win, 0, n as i32, &mut p) },
        ncclInvalidArgument,
        "out of range",
        "a device pointer of a peer out of range",
    )?;
    expect(
        unsafe { ncclGetPeerDevicePointer(win, 4097, next, &mut p) },
        ncclInvalidArgument,
        "past the end",
        "a device pointer past the end",
    )?;
    still_works(comm, n)?;

    // A window of another communicator.
    let mut other: ncclComm_t = null_mut();
    nccl!(ncclCommSplit(comm, 0, me as i32, &mut other, null_mut()));
    let (_m2, win2) = window(other, 256, &m)?;
    expect(
        unsafe { commWinPut(src, 1, UINT8, next, win2, 0, comm) },
        ncclInvalidArgument,
        "another communicator",
        "window of another communicator",
    )?;
    // A deregistered one.
    nccl!(ncclCommWindowDeregister(other, win2));
    expect(
        unsafe { commWinGet(dst, 1, UINT8, next, win2, 0, other) },
        ncclInvalidArgument,
        "not a live window",
        "deregistered window",
    )?;
    expect(
        unsafe { ncclCommWindowDeregister(other, win2) },
        ncclInvalidArgument,
        "not a live window",
        "deregistered twice",
    )?;
    nccl!(ncclCommDestroy(other));
    // Bad flags on rank 0 only: every rank fails, none hangs.
    let mut w3: ncclWindow_t = null_mut();
    let mut spare = vec![0u64; 16];
    let flags = if me == 0 { 0x10 } else { SYM };
    let r = unsafe {
        ncclCommWindowRegister(comm, spare.as_mut_ptr() as *mut c_void, 128, &mut w3, flags)
    };
    expect(
        r,
        if me == 0 {
            ncclInvalidArgument
        } else {
            ncclInvalidUsage
        },
        if me == 0 { "winFlags" } else { "rank 0" },
        "bad flags on one rank",
    )?;
    let r = unsafe { ncclCommWindowRegister(comm, null_mut(), 128, &mut w3, SYM) };
    expect(r, ncclInvalidArgument, "buff is NULL", "NULL buffer")?;
    still_works(comm, n)?;

    // Waits nobody answers: a timeout, not a hang.
    let t = Instant::now();
    expect(
        unsafe { commWinChannelWait(next, 0, 300, win, comm) },
        ncclTimeout,
        "timed out",
        "channel wait without a signal",
    )?;
    if t.elapsed() > Duration::from_secs(5) {
        return Err(format!("the 300 ms channel wait took {:?}", t.elapsed()));
    }
    let mut d = [desc(next as usize, 1)];
    expect(
        unsafe { ncclWaitSignal(1, d.as_mut_ptr(), comm, S) },
        ncclTimeout,
        "timed out",
        "ncclWaitSignal without a signal (COMM_TIMEOUT)",
    )?;
    still_works(comm, n)?;
    // Still usable for windows too.
    barrier(comm)?;
    let v = [me as u8 + 1];
    nccl!(ncclPutSignal(
        v.as_ptr() as *const c_void,
        1,
        UINT8,
        next,
        win,
        0,
        0,
        0,
        0,
        comm,
        S
    ));
    let prev = (me + n - 1) % n;
    let mut d = [desc(prev, 1)];
    nccl!(ncclWaitSignal(1, d.as_mut_ptr(), comm, S));
    barrier(comm)?;
    nccl!(ncclCommWindowDeregister(comm, win));
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

/// Rank 0 dies after registering; rank 1 waits for its signal (NCCL counter, or a channel)
/// and must get ncclRemoteError, not hang.
fn peer_dies(w: &Worker) -> Result<(), String> {
    let m = mode(w);
    let comm = init(w)?;
    let (_mem, win) = window(comm, 64, &m)?;
    barrier(comm)?;
    if w.rank == 0 {
        std::thread::sleep(Duration::from_millis(300));
        std::process::exit(3);
    }
    let t = Instant::now();
    let r = if w.arg.contains("channel") {
        unsafe { commWinChannelWait(0, 0, 0, win, comm) }
    } else {
        let mut d = [desc(0, 1)];
        unsafe { ncclWaitSignal(1, d.as_mut_ptr(), comm, S) }
    };
    expect(
        r,
        ncclResult_t::ncclRemoteError,
        "rank 0",
        "wait on a dead peer",
    )?;
    if t.elapsed() > Duration::from_secs(20) {
        return Err(format!(
            "noticed the dead peer only after {:?}",
            t.elapsed()
        ));
    }
    // Atomics into the dead rank's window fail too: the old value they would return was read
    // from memory nobody owns any more.
    let mut old = 0u64;
    expect(
        unsafe { commWinFetchAdd(1, &mut old, UINT64, 0, win, 0, comm) },
        ncclResult_t::ncclRemoteError,
        "rank 0",
        "fetch-add into a dead peer",
    )?;
    expect(
        unsafe { commWinCompareSwap(0, 1, &mut old, UINT64, 0, win, 0, comm) },
        ncclResult_t::ncclRemoteError,
        "rank 0",
        "compare-and-swap into a dead peer",
    )?;
    Ok(())
}

/// Registrations of two communicators queued in one group by one thread: they run together at
/// the group's end (one after the other would wait forever for the second), and the handles
/// are set then.
fn group_register(w: &Worker) -> Result<(), String> {
    let comm = init(w)?;
    let (n, me) = (w.nranks, w.rank);
    let mut child: ncclComm_t = null_mut();
    nccl!(ncclCommSplit(comm, 0, me as i32, &mut child, null_mut()));
    let a: &'static mut [u64] = Vec::leak(vec![0u64; 64]);
    let b: &'static mut [u64] = Vec::leak(vec![0u64; 64]);
    let (mut wa, mut wb): (ncclWindow_t, ncclWindow_t) = (null_mut(), null_mut());
    // A second window of `comm` in the same group: those of one communicator run in order.
    let a2: &'static mut [u64] = Vec::leak(vec![0u64; 64]);
    let mut wa2: ncclWindow_t = null_mut();
    nccl!(ncclGroupStart());
    nccl!(ncclCommWindowRegister(
        comm,
        a.as_mut_ptr() as *mut c_void,
        512,
        &mut wa,
        SYM
    ));
    nccl!(ncclCommWindowRegister(
        child,
        b.as_mut_ptr() as *mut c_void,
        512,
        &mut wb,
        SYM
    ));
    nccl!(ncclCommWindowRegister(
        comm,
        a2.as_mut_ptr() as *mut c_void,
        256,
        &mut wa2,
        SYM
    ));
    nccl!(ncclGroupEnd());
    if wa.is_null() || wb.is_null() || wa2.is_null() {
        return Err("a window handle is NULL after ncclGroupEnd".into());
    }
    let next = ((me + 1) % n) as i32;
    let v = [me as u64 + 5];
    nccl!(ncclPutSignal(
        v.as_ptr() as *const c_void,
        1,
        UINT64,
        next,
        wb,
        8,
        0,
        0,
        0,
        child,
        S
    ));
    let mut d = [desc((me + n - 1) % n, 1)];
    nccl!(ncclWaitSignal(1, d.as_mut_ptr(), child, S));
    let want = ((me + n - 1) % n) as u64 + 5;
    let got = unsafe { std::ptr::read_volatile(&b[1]) };
    if got != want {
        return Err(format!(
            "put through the child's window left {got}, wanted {want}"
        ));
    }
    let r = unsafe { commWinPut(v.as_ptr() as *const c_void, 1, UINT64, next, wa2, 256, comm) };
    expect(
        r,
        ncclResult_t::ncclInvalidArgument,
        "256 bytes",
        "past the end of the 256-byte window",
    )?;
    barrier(comm)?;
    nccl!(ncclCommWindowDeregister(comm, wa));
    nccl!(ncclCommWindowDeregister(comm, wa2));
    // Destroying the child takes its windows with it.
    nccl!(ncclCommDestroy(child));
    expect(
        unsafe { commWinPut(v.as_ptr() as *const c_void, 1, UINT64, next, wb, 0, comm) },
        ncclResult_t::ncclInvalidArgument,
        "not a live window",
        "a window of a destroyed communicator",
    )?;
    still_works(comm, n)?;
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

/// Rank 1 deregisters its part of the window while rank 0 still uses it. On this host every
/// operation into it is refused (nothing lands in memory rank 1 may have freed); across hosts
/// the put is refused by rank 1's server and the next flush says so. Either way the signal of
/// that put is never counted: rank 1's wait for it times out.
fn target_deregistered(w: &Worker) -> Result<(), String> {
    use ncclResult_t::*;
    let m = mode(w);
    let comm = init(w)?;
    let (n, me) = (w.nranks, w.rank);
    let (_mem, win) = window(comm, 4096, &m)?;
    // A put that succeeds first: the same put after the deregistration must still be refused,
    // whatever this thread kept of the window (ncclPutSignal's short way).
    let v = [5u64; 2];
    if me == 0 {
        let src = v.as_ptr() as *const c_void;
        nccl!(ncclPutSignal(src, 8, UINT8, 1, win, 0, 0, 0, 0, comm, S));
    } else if me == 1 {
        nccl!(ncclWaitSignal(1, [desc(0, 1)].as_mut_ptr(), comm, S));
    }
    barrier(comm)?;
    if me == 1 {
        nccl!(ncclCommWindowDeregister(comm, win));
    }
    barrier(comm)?;
    if me == 0 {
        let v = [7u64; 2];
        let src = v.as_ptr() as *const c_void;
        let r = unsafe { ncclPutSignal(src, 8, UINT8, 1, win, 0, 0, 0, 0, comm, S) };
        if m.net {
            if r != ncclSuccess {
                return Err(format!("put across hosts returned {r:?} before any answer"));
            }
            expect(
                unsafe { commWinFlush(1, win, comm) },
                ncclInvalidUsage,
                "no longer registered",
                "flush after a put into a deregistered window",
            )?;
            let mut back = [0u64; 1];
            expect(
                unsafe { commWinGet(back.as_mut_ptr() as *mut c_void, 8, UINT8, 1, win, 0, comm) },
                ncclInvalidUsage,
                "no longer registered",
                "get from a deregistered window across hosts",
            )?;
        } else {
            expect(
                r,
                ncclInvalidUsage,
                "deregistered",
                "put into a deregistered window",
            )?;
            let mut back = [0u64; 1];
            let dst = back.as_mut_ptr() as *mut c_void;
            expect(
                unsafe { commWinGet(dst, 8, UINT8, 1, win, 0, comm) },
                ncclInvalidUsage,
                "deregistered",
                "get from a deregistered window",
            )?;
            let mut old = 0u64;
            expect(
                unsafe { commWinFetchAdd(1, &mut old, UINT64, 1, win, 0, comm) },
                ncclInvalidUsage,
                "deregistered",
                "fetch-add on a deregistered window",
            )?;
            expect(
                unsafe { commWinChannelSignal(1, 0, 100, win, comm) },
                ncclInvalidUsage,
                "deregistered",
                "channel signal into a deregistered window",
            )?;
            expect(
                unsafe { commWinChannelBarrier(0, 100, win, comm) },
                ncclInvalidUsage,
                "deregistered",
                "channel barrier over a window a peer deregistered",
            )?;
            let mut p: *mut c_void = null_mut();
            expect(
                unsafe { commWinPeerPtr(comm, win, 1, &mut p) },
                ncclInvalidUsage,
                "deregistered",
                "peer pointer of a deregistered window",
            )?;
        }
        // The communicator's other peers are untouched.
        if n > 2 {
            nccl!(commWinPut(src, 8, UINT8, 2, win, 0, comm));
            nccl!(commWinFlush(2, win, comm));
        }
    }
    barrier(comm)?;
    if me == 1 {
        let mut d = [desc(0, 1)];
        expect(
            unsafe { ncclWaitSignal(1, d.as_mut_ptr(), comm, S) },
            ncclTimeout,
            "timed out",
            "a wait for the signal of a put that did not land",
        )?;
    } else {
        // Past rank 1's wait (COMM_TIMEOUT, 2 s), so that the collective below does not time
        // out on it.
        std::thread::sleep(Duration::from_millis(2500));
    }
    still_works(comm, n)?;
    if me != 1 {
        nccl!(ncclCommWindowDeregister(comm, win));
    }
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

/// The lock that makes atomics on ordinary (not shared) memory atomic, with its holder frozen
/// and then killed inside the critical section: rank 2 waiting for it gets ncclTimeout naming
/// the holder's process, kills that process, and then takes the lock over. Rank 0 is the target
/// and never calls the library until rank 2 tells it, through the window, that it is done.
fn lock_holder_dies(w: &Worker) -> Result<(), String> {
    use ncclResult_t::*;
    let m = mode(w);
    if w.rank == 1 {
        // Read once, at the library's first fault point (in init).
        std::env::set_var("COMM_FAULT_INJECT", "window_atomic_locked:stop");
    }
    let comm = init(w)?;
    let (mem, win) = window(comm, 4096, &m)?;
    barrier(comm)?;
    let mut old = 0u64;
    match w.rank {
        0 => {
            let t = Instant::now();
            let word = |i: usize| unsafe { std::ptr::read_volatile((mem as *const u64).add(i)) };
            while word(1) == 0 {
                if t.elapsed() > Duration::from_secs(60) {
                    return Err("rank 2 never said it was done".into());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            if word(0) != 5 {
                return Err(format!(
                    "the word is {} after rank 1 died before its write and rank 2 added 5",
                    word(0)
                ));
            }
        }
        1 => {
            nccl!(commWinFetchAdd(100, &mut old, UINT64, 0, win, 0, comm));
            return Err("rank 1 went on past its fault point".into());
        }
        _ => {
            std::thread::sleep(Duration::from_millis(500));
            let t = Instant::now();
            expect(
                unsafe { commWinFetchAdd(5, &mut old, UINT64, 0, win, 0, comm) },
                ncclTimeout,
                "atomics lock, held by process",
                "fetch-add while the lock holder is frozen",
            )?;
            if t.elapsed() > Duration::from_secs(20) {
                return Err(format!(
                    "the lock wait took {:?} with COMM_TIMEOUT=2",
                    t.elapsed()
                ));
            }
            let msg = last_error();
            let pid: i32 = msg
                .rsplit("held by process ")
                .next()
                .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("no pid in {msg:?}"))?;
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let t = Instant::now();
            nccl!(commWinFetchAdd(5, &mut old, UINT64, 0, win, 0, comm));
            if old != 0 {
                return Err(format!("fetch-add after the takeover found {old}, not 0"));
            }
            if t.elapsed() > Duration::from_secs(10) {
                return Err(format!("the takeover took {:?}", t.elapsed()));
            }
            let one = 1u64;
            nccl!(commWinPut(
                &one as *const u64 as *const c_void,
                8,
                UINT8,
                0,
                win,
                8,
                comm
            ));
        }
    }
    Ok(())
}

/// A second communicator over the same ranks (a split of `comm`): the one whose windows a
/// rank destroys while `comm` carries on.
fn dup(comm: ncclComm_t) -> Result<ncclComm_t, String> {
    let mut c: ncclComm_t = null_mut();
    nccl!(ncclCommSplit(comm, 0, 0, &mut c, null_mut()));
    Ok(c)
}

/// Rank 1 destroys a communicator that has a window while rank 0 still holds its own end:
/// rank 0's puts, atomics and signals into rank 1's part are refused (they used to succeed,
/// writing into memory rank 1 had reused), and rank 1's memory keeps what it wrote there.
fn destroyed_target(w: &Worker) -> Result<(), String> {
    use ncclResult_t::*;
    let m = mode(w);
    let world = init(w)?;
    let comm = dup(world)?;
    let me = w.rank;
    let (mem, win) = window(comm, 4096, &m)?;
    barrier(world)?;
    if me == 1 {
        nccl!(ncclCommDestroy(comm));
        if !m.shared || m.memalloc {
            // Memory the application registered outlives the communicator: it reuses it.
            unsafe { std::ptr::write_bytes(mem, 0x11, 4096) };
        }
    }
    barrier(world)?;
    if me == 0 {
        let v = [0xdead_beef_u64; 4];
        let src = v.as_ptr() as *const c_void;
        expect(
            unsafe { commWinPut(src, 32, UINT8, 1, win, 0, comm) },
            ncclInvalidUsage,
            "destroyed",
            "a put into the window of a destroyed communicator",
        )?;
        expect(
            unsafe { ncclPutSignal(src, 32, UINT8, 1, win, 64, 0, 0, 0, comm, S) },
            ncclInvalidUsage,
            "destroyed",
            "ncclPutSignal into the window of a destroyed communicator",
        )?;
        let mut old = 0u64;
        expect(
            unsafe { commWinFetchAdd(1, &mut old, UINT64, 1, win, 128, comm) },
            ncclInvalidUsage,
            "destroyed",
            "a fetch-add on the window of a destroyed communicator",
        )?;
        // Rank 2's part is still there.
        if w.nranks > 2 {
            nccl!(commWinPut(src, 32, UINT8, 2, win, 0, comm));
        }
    }
    barrier(world)?;
    if me == 1 && (!m.shared || m.memalloc) {
        let bytes = unsafe { std::slice::from_raw_parts(mem, 4096) };
        if let Some(i) = bytes.iter().position(|&b| b != 0x11) {
            return Err(format!(
                "byte {i} of the memory of the destroyed communicator's window is {:#x}, not 0x11",
                bytes[i]
            ));
        }
    }
    if me == 2 {
        let got = unsafe { std::ptr::read_volatile(mem as *const u64) };
        if got != 0xdead_beef {
            return Err(format!("rank 2's window holds {got:#x} after rank 0's put"));
        }
    }
    if me != 1 {
        nccl!(ncclCommDestroy(comm));
    }
    still_works(world, w.nranks)?;
    nccl!(ncclCommDestroy(world));
    Ok(())
}

/// A group on rank 0 holds a put into rank 1's part of a window rank 1 has deregistered (it
/// fails at ncclGroupEnd), a put with a signal to rank 2 and an all-reduce. The group's other
/// operations must still run: the all-reduce gives every rank the right sum (rank 0 used to
/// skip it, so its next collective met the others' all-reduce), rank 2 gets its data and
/// signal, and ncclGroupEnd reports the failed put.
fn group_with_failing_put(w: &Worker) -> Result<(), String> {
    use ncclResult_t::*;
    let m = mode(w);
    let comm = init(w)?;
    let (n, me) = (w.nranks, w.rank);
    let (mem, win) = window(comm, 4096, &m)?;
    barrier(comm)?;
    if me == 1 {
        nccl!(ncclCommWindowDeregister(comm, win));
    }
    barrier(comm)?;
    let mut x = [(me + 1) as f32; 5];
    let sum = (n * (n + 1) / 2) as f32;
    let v = [0x0123_4567_89ab_cdef_u64; 2];
    let src = v.as_ptr() as *const c_void;
    let xp = x.as_mut_ptr() as *mut c_void;
    if me == 0 {
        nccl!(ncclGroupStart());
        nccl!(ncclPutSignal(src, 16, UINT8, 1, win, 0, 0, 0, 0, comm, S));
        nccl!(ncclPutSignal(src, 16, UINT8, 2, win, 8, 0, 0, 0, comm, S));
        nccl!(ncclAllReduce(xp, xp, 5, FLOAT32, 0, comm, S));
        expect(
            ncclGroupEnd(),
            ncclInvalidUsage,
            "other operations ran",
            "a group whose put fails at its end",
        )?;
    } else {
        nccl!(ncclAllReduce(xp, xp, 5, FLOAT32, 0, comm, S));
    }
    if x != [sum; 5] {
        return Err(format!("the group's all-reduce gave {x:?}, not {sum}"));
    }
    if me == 2 {
        nccl!(ncclWaitSignal(1, [desc(0, 1)].as_mut_ptr(), comm, S));
        let got = unsafe { std::ptr::read_unaligned(mem.add(8) as *const [u64; 2]) };
        if got != v {
            return Err(format!(
                "rank 2's window holds {got:x?} after the group's put"
            ));
        }
    }
    still_works(comm, n)?;
    if me != 1 {
        nccl!(ncclCommWindowDeregister(comm, win));
    }
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

/// One buffer registered as two windows: fetch-adds from every rank on one of rank 0's words,
/// through either window in turn, must all count (with a lock per window, a third were lost
/// where the lock serialises them: ordinary memory, and across hosts).
fn two_windows_one_word(w: &Worker) -> Result<(), String> {
    let comm = init(w)?;
    let (n, me) = (w.nranks, w.rank);
    let v: &'static mut [u64] = Vec::leak(vec![0u64; 512]);
    let p = v.as_mut_ptr() as *mut c_void;
    let (mut a, mut b): (ncclWindow_t, ncclWindow_t) = (null_mut(), null_mut());
    nccl!(ncclCommWindowRegister(comm, p, 4096, &mut a, SYM));
    nccl!(ncclCommWindowRegister(comm, p, 4096, &mut b, SYM));
    barrier(comm)?;
    const ADDS: u64 = 3000;
    let mut old = 0u64;
    for i in 0..ADDS {
        let win = if (i + me as u64) % 2 == 0 { a } else { b };
        nccl!(commWinFetchAdd(1, &mut old, UINT64, 0, win, 8 * 17, comm));
    }
    barrier(comm)?;
    if me == 0 {
        let got = unsafe { std::ptr::read_volatile(v.as_ptr().add(17)) };
        if got != ADDS * n as u64 {
            return Err(format!(
                "the word counts {got} after {ADDS} fetch-adds from each of {n} ranks"
            ));
        }
    }
    barrier(comm)?;
    nccl!(ncclCommWindowDeregister(comm, b));
    nccl!(ncclCommWindowDeregister(comm, a));
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

/// A thread of rank 0 waits to signal rank 1 on a channel whose previous signal rank 1 never
/// consumes (no time limit), while rank 1 stays alive; ncclCommAbort on rank 0's main thread
/// must end that wait at once (it used to go on until rank 1 exited).
fn abort_while_signalling(w: &Worker) -> Result<(), String> {
    let comm = init(w)?;
    let (_mem, win) = window(comm, 4096, &mode(w))?;
    barrier(comm)?;
    if w.rank == 1 {
        std::thread::sleep(Duration::from_secs(8));
        return Ok(());
    }
    nccl!(commWinChannelSignal(1, 0, 0, win, comm));
    let (c, wn) = (comm as usize, win as usize);
    let waiter = std::thread::spawn(move || {
        let r = unsafe { commWinChannelSignal(1, 0, 0, wn as ncclWindow_t, c as ncclComm_t) };
        (r, Instant::now(), last_error())
    });
    std::thread::sleep(Duration::from_millis(300));
    let aborted = Instant::now();
    nccl!(ncclCommAbort(comm));
    let (r, at, msg) = waiter.join().map_err(|_| "the waiter panicked")?;
    if r != ncclResult_t::ncclInvalidUsage || !msg.contains("aborted") {
        return Err(format!("the blocked signal returned {r:?} ({msg})"));
    }
    let late = at.saturating_duration_since(aborted);
    if late > Duration::from_secs(3) {
        return Err(format!(
            "the blocked signal returned {late:?} after the abort"
        ));
    }
    Ok(())
}

/// Every scenario by name: `run` names one, the worker runs it.
const SCENARIOS: &[(&str, Scenario)] = &[
    ("sleeping", |w| busy_target(w, false)),
    ("computing", |w| busy_target(w, true)),
    ("signals", signals),
    ("contention", contention),
    ("channels", channels),
    ("bad", bad_input),
    ("dies", peer_dies),
    ("group_register", group_register),
    ("fresh", fresh_windows),
    ("deregistered", target_deregistered),
    ("lock_dies", lock_holder_dies),
    ("destroyed", destroyed_target),
    ("group_put_fails", group_with_failing_put),
    ("two_windows", two_windows_one_word),
    ("abort_signal", abort_while_signalling),
];

scenario_tests!(SCENARIOS);

fn run(scenario: &str, n: usize, arg: &str, env: &[(&str, &str)], secs: u64) {
    assert_all_ok(
        &launch("worker", scenario, n, arg, env, Duration::from_secs(secs)),
        &format!("{scenario} ({arg}, {n} ranks)"),
    );
}

#[test]
fn one_sided_ops_into_a_sleeping_or_computing_target() {
    for arg in ["shared", "user"] {
        for n in [2, 3] {
            run("sleeping", n, arg, &[], 120);
        }
        run("computing", 3, arg, &[], 120);
    }
    // ncclMemAlloc without a GPU gives shared memory too.
    run("sleeping", 2, "memalloc", &[], 120);
}

/// Ranks that are threads of one process: every operation on every other rank's window.
fn threads_body(comm: ncclComm_t, me: usize, n: usize) -> Result<(), String> {
    for shared in [false, true] {
        let m = Mode {
            shared,
            memalloc: false,
            net: false,
        };
        let (mem, win) = window(comm, 4096, &m)?;
        let next = (me + 1) % n;
        let prev = (me + n - 1) % n;
        let src: Vec<u8> = (0..1001).map(|i| pat(me, i)).collect();
        nccl!(ncclPutSignal(
            src.as_ptr() as *const c_void,
            1001,
            UINT8,
            next as i32,
            win,
            24,
            0,
            0,
            0,
            comm,
            S
        ));
        let mut d = [desc(prev, 1)];
        nccl!(ncclWaitSignal(1, d.as_mut_ptr(), comm, S));
        let got = unsafe { std::slice::from_raw_parts(mem.add(24), 1001) };
        if let Some(i) = (0..1001).find(|&i| got[i] != pat(prev, i)) {
            return Err(format!("threads: byte {i} from rank {prev} is {}", got[i]));
        }
        let mut back = vec![0u8; 1001];
        nccl!(commWinGet(
            back.as_mut_ptr() as *mut c_void,
            1001,
            UINT8,
            next as i32,
            win,
            24,
            comm
        ));
        if back != src {
            return Err("threads: get of what this rank put differs".into());
        }
        for _ in 0..1000 {
            nccl!(commWinFetchAdd(1, null_mut(), UINT64, 0, win, 0, comm));
        }
        let mut p: *mut c_void = null_mut();
        nccl!(commWinPeerPtr(comm, win, next as i32, &mut p));
        if p.is_null() {
            return Err("threads: no direct pointer to a thread's window".into());
        }
        nccl!(commWinChannelBarrier(0, 20_000, win, comm));
        if me == 0 {
            let v = unsafe { std::ptr::read_volatile(mem as *const u64) };
            if v != 1000 * n as u64 {
                return Err(format!("threads: counter {v}"));
            }
        }
        nccl!(commWinChannelBarrier(0, 20_000, win, comm));
        nccl!(ncclCommWindowDeregister(comm, win));
    }
    Ok(())
}

/// The short way through ncclPutSignal and ncclWaitSignal (what a thread keeps of its last
/// communicator and window) serves only what the full path would: after puts and waits that
/// took it, bad arguments, a group, a deregistered window and a destroyed communicator still
/// get the full path's answers.
fn short_way_body(comm: ncclComm_t, me: usize, n: usize) -> Result<(), String> {
    use ncclResult_t::*;
    let m = Mode {
        shared: true,
        memalloc: false,
        net: false,
    };
    let (mem, win) = window(comm, 4096, &m)?;
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let put = |v: &u64, off: usize, peer: usize, sig: i32| unsafe {
        ncclPutSignal(
            v as *const u64 as *const c_void,
            1,
            UINT64,
            peer as i32,
            win,
            off,
            sig,
            0,
            0,
            comm,
            S,
        )
    };
    let seen = |off: usize| unsafe { std::ptr::read_volatile(mem.add(off) as *const u64) };
    for round in 1..=100u64 {
        let v = round * 1000 + me as u64;
        nccl!(put(&v, 8 * (round as usize % 8), next, 0));
        nccl!(ncclWaitSignal(1, [desc(prev, 1)].as_mut_ptr(), comm, S));
        let want = round * 1000 + prev as u64;
        if seen(8 * (round as usize % 8)) != want {
            return Err(format!("round {round}: {} from rank {prev}", seen(8)));
        }
    }
    let v = 7u64;
    expect(
        put(&v, 4090, next, 0),
        ncclInvalidArgument,
        "past the end",
        "a put past the end",
    )?;
    expect(
        put(&v, 0, n, 0),
        ncclInvalidArgument,
        "out of range",
        "a peer out of range",
    )?;
    expect(
        put(&v, 0, next, 1),
        ncclInvalidArgument,
        "sigIdx",
        "a nonzero sigIdx",
    )?;
    let r = unsafe { ncclPutSignal(null(), 1, UINT64, next as i32, win, 0, 0, 0, 0, comm, S) };
    expect(r, ncclInvalidArgument, "NULL", "a NULL buffer")?;
    let mut bad = [desc(prev, 0)];
    let r = unsafe { ncclWaitSignal(1, bad.as_mut_ptr(), comm, S) };
    expect(r, ncclInvalidArgument, "opCnt", "a wait for no signal")?;
    // In a group the put is issued at the group's end, and reads its buffer then (which must
    // live until that end).
    let mut mine = 1;
    nccl!(ncclGroupStart());
    nccl!(put(&mine, 64, next, 0));
    nccl!(ncclWaitSignal(1, [desc(prev, 1)].as_mut_ptr(), comm, S));
    mine = v + me as u64;
    std::hint::black_box(&mut mine);
    nccl!(ncclGroupEnd());
    if seen(64) != v + prev as u64 {
        return Err(format!("grouped put: {} from rank {prev}", seen(64)));
    }
    still_works(comm, n)?;
    // Every rank done with the window before any deregisters it.
    nccl!(commWinChannelBarrier(0, 20_000, win, comm));
    nccl!(ncclCommWindowDeregister(comm, win));
    expect(
        put(&v, 0, next, 0),
        ncclInvalidArgument,
        "not a live window",
        "a deregistered window",
    )?;
    Ok(())
}

#[test]
fn the_short_way_serves_only_what_the_full_path_would() {
    with_threads(3, Duration::from_secs(60), short_way_body);
}

/// After ncclCommDestroy, the handle a thread used a moment ago is refused as destroyed.
#[test]
fn a_destroyed_communicator_is_refused_after_puts_through_it() {
    let mut comms: Vec<ncclComm_t> = vec![null_mut(); 2];
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) },
        ncclResult_t::ncclSuccess
    );
    let (c0, c1) = (comms[0] as usize, comms[1] as usize);
    let other = std::thread::spawn(move || -> Result<(), String> {
        let c = c1 as ncclComm_t;
        let mut p: *mut c_void = null_mut();
        let mut win: ncclWindow_t = null_mut();
        nccl!(commWindowAllocate(c, 4096, SYM, &mut p, &mut win));
        nccl!(ncclWaitSignal(1, [desc(0, 3)].as_mut_ptr(), c, S));
        nccl!(ncclCommDestroy(c));
        Ok(())
    });
    let c = c0 as ncclComm_t;
    let mut p: *mut c_void = null_mut();
    let mut win: ncclWindow_t = null_mut();
    let r = (|| -> Result<(), String> {
        nccl!(commWindowAllocate(c, 4096, SYM, &mut p, &mut win));
        let v = 9u64;
        let src = &v as *const u64 as *const c_void;
        for _ in 0..3 {
            nccl!(ncclPutSignal(src, 1, UINT64, 1, win, 0, 0, 0, 0, c, S));
        }
        nccl!(ncclCommDestroy(c));
        let r = unsafe { ncclPutSignal(src, 1, UINT64, 1, win, 0, 0, 0, 0, c, S) };
        expect(
            r,
            ncclResult_t::ncclInvalidArgument,
            "destroyed",
            "a put on a destroyed communicator",
        )
    })();
    let theirs = other.join().expect("the other rank panicked");
    r.unwrap();
    theirs.unwrap();
}

#[test]
fn ranks_that_are_threads_of_one_process() {
    with_threads(3, Duration::from_secs(60), threads_body);
}

#[test]
fn one_sided_ops_across_hosts() {
    run("sleeping", 2, "user,net", &[], 120);
    run("computing", 3, "shared,net", &[], 120);
}

#[test]
fn signal_counters_groups_and_ordering() {
    for arg in ["shared", "user"] {
        for n in [2, 3] {
            run("signals", n, arg, &[], 120);
        }
    }
}

#[test]
fn puts_into_windows_the_moment_they_are_registered() {
    run("fresh", 3, "user,net", &[], 120);
    run("fresh", 2, "shared,net", &[], 120);
}

#[test]
fn signal_counters_across_hosts() {
    run("signals", 2, "user,net", &[], 120);
    run("signals", 3, "shared,net", &[], 120);
}

#[test]
fn fetch_add_contention_and_cas_lock() {
    run("contention", 3, "shared", &[], 300);
    run("contention", 2, "user", &[], 300);
}

#[test]
fn fetch_add_contention_across_hosts() {
    run("contention", 3, "shared,net", &[], 300);
}

#[test]
fn channels_isolate_two_threads() {
    run("channels", 2, "shared", &[], 120);
    run("channels", 3, "user", &[], 120);
    run("channels", 3, "shared,net", &[], 120);
}

#[test]
fn bad_input_gives_clear_errors() {
    for (n, arg) in [(2, "shared"), (3, "user"), (3, "shared,net")] {
        run("bad", n, arg, &[("COMM_TIMEOUT", "2")], 120);
    }
}

#[test]
fn operations_into_a_window_its_target_deregistered_are_refused() {
    for (n, arg) in [
        (2, "shared"),
        (3, "user"),
        (3, "shared,net"),
        (2, "user,net"),
    ] {
        run("deregistered", n, arg, &[("COMM_TIMEOUT", "2")], 120);
    }
}

#[test]
fn operations_into_a_window_of_a_destroyed_communicator_are_refused() {
    for (n, arg) in [(2, "shared"), (3, "user"), (3, "memalloc")] {
        run("destroyed", n, arg, &[("COMM_TIMEOUT", "10")], 120);
    }
}

#[test]
fn a_put_that_fails_at_group_end_leaves_the_rest_of_the_group_running() {
    for (n, arg) in [(3, "shared"), (3, "user"), (4, "user")] {
        run("group_put_fails", n, arg, &[("COMM_TIMEOUT", "10")], 120);
    }
}

#[test]
fn atomics_through_two_windows_over_one_word_are_atomic() {
    for (n, arg) in [(3, "user"), (2, "user"), (3, "user,net")] {
        run("two_windows", n, arg, &[("COMM_TIMEOUT", "20")], 180);
    }
}

#[test]
fn abort_ends_a_wait_to_signal_a_live_peer() {
    for arg in ["shared", "user"] {
        run("abort_signal", 2, arg, &[], 60);
    }
}

#[test]
fn a_frozen_or_dead_holder_of_the_atomics_lock_times_out_or_is_taken_over() {
    let r = launch(
        "worker",
        "lock_dies",
        3,
        "user",
        &[("COMM_TIMEOUT", "2")],
        Duration::from_secs(90),
    );
    for i in [2, 0] {
        assert_all_ok(std::slice::from_ref(&r[i]), "lock_dies (user, 3 ranks)");
    }
}

#[test]
fn a_peer_that_dies_during_a_wait_is_a_remote_error() {
    for arg in ["shared", "shared,channel", "user,net", "user,net,channel"] {
        let r = launch("worker", "dies", 2, arg, &[], Duration::from_secs(90));
        assert_all_ok(&r[1..], &format!("dies ({arg})"));
    }
}

#[test]
fn registrations_of_two_communicators_in_one_group() {
    run("group_register", 3, "user", &[], 120);
    run("group_register", 2, "user,net", &[], 120);
}

#[test]
fn features_report_windows() {
    let mut f = 0;
    assert_eq!(unsafe { commGetFeatures(&mut f) }, OK, "{}", last_error());
    assert_ne!(f & COMM_FEATURE_WINDOWS, 0, "features {f:#x}");
}

/// Two hosts as network namespaces (scripts/netns.sh, see tests/common/hosts.rs), rank r on
/// host r % 2; skipped, with the reason printed, where they cannot be made (needs root and
/// iproute2; required in CI).
fn in_namespaces(scenario: &str, n: usize, arg: &str, secs: u64) {
    let Some(hosts) = common::hosts::Hosts::up(2) else {
        return;
    };
    let host_of: Vec<usize> = (0..n).map(|r| r % 2).collect();
    let r = common::hosts::launch_at(
        &hosts,
        &host_of,
        scenario,
        arg,
        &[],
        Duration::from_secs(secs),
        || {},
    );
    assert_all_ok(
        &r,
        &format!("{scenario} ({arg}, {n} ranks, network namespaces)"),
    );
}

#[test]
fn one_sided_ops_across_network_namespaces() {
    in_namespaces("sleeping", 3, "user,netns", 120);
    in_namespaces("signals", 3, "shared,netns", 120);
    in_namespaces("channels", 2, "shared,netns", 120);
    in_namespaces("contention", 3, "shared,netns", 300);
}
