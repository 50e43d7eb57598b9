//! The InfiniBand transport over the software model of verbs (`common/ibmodel.rs`), with ranks
//! as threads of this process (ncclCommInitAll, shared memory off so that they talk over the
//! network transport): the collective matrix, delayed completions, injected errors, and the
//! fall back to sockets where there is no device. No RDMA hardware is involved anywhere: the
//! model stands in for it (see the README for what a first run on a fabric must check).
//!
//! Windows over the model: with COMM_WIN_NET=1 every other rank's window part is reached as if
//! on another host, so one-sided operations go over RDMA (reads, writes, atomics of the model)
//! instead of loads and stores. GPUDirect RDMA (dmabuf) runs the same way, with a memfd standing
//! in for a GPU's dmabuf export (`ib::stand_in`), which the model maps as an HCA would.
//!
//! The tests set process-wide environment variables and the verbs provider, so they take a
//! lock and run one at a time.

// The unsafe blocks here call the library's C API (ncclX/commX) with arguments the test
// itself made; what each call needs is in the C API's documentation, not repeated per block.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use comm::ffi::types::*;
use comm::ffi::*;
use comm::testing::ib;
use common::cases::*;
use common::ibmodel::{Fabric, Faults, ModelProvider};
use common::run::*;
use common::*;
use std::os::raw::c_void;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const FLOAT: i32 = 7;
const SUM: i32 = 0;
const S: cudaStream_t = std::ptr::null_mut();

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `f` with the model (or no device, for `None`) as the verbs provider and `net` as
/// COMM_NET, ranks of one process on the network transport.
fn with_model<T>(fabric: Option<Arc<Fabric>>, net: &str, f: impl FnOnce() -> T) -> T {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("COMM_SHM_DISABLE", "1");
    std::env::set_var("COMM_NET", net);
    ib::set_provider(Some(Arc::new(ModelProvider { fabric })));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    ib::set_provider(None);
    std::env::remove_var("COMM_NET");
    std::env::remove_var("COMM_TIMEOUT");
    std::env::remove_var("NCCL_IB_DISABLE");
    std::env::remove_var("COMM_WIN_NET");
    match r {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e),
    }
}

fn every_case(c: ncclComm_t, rank: usize, n: usize) -> Result<(), String> {
    let ctx = Ctx { comm: c, rank, n };
    matrix(&ctx, false)?;
    for coll in COLLS {
        run_case(&ctx, coll, FLOAT, SUM, (1 << 20) + 3, false)?;
        if coll != Coll::SendRecv {
            run_case(&ctx, coll, FLOAT, SUM, (1 << 20) + 3, true)?;
        }
    }
    Ok(())
}

/// Every collective, datatype, op, size and in/out-of-place case over the model, on 2, 3 and
/// 4 ranks; the fabric counts the writes, so the cases really went over it.
#[test]
fn collectives_over_the_model() {
    for n in [2, 3, 4] {
        let fabric = Fabric::new(Faults::default());
        with_model(Some(fabric.clone()), "ib", || {
            with_threads(n, Duration::from_secs(600), every_case);
        });
        assert!(
            fabric.writes() > 1000,
            "only {} RDMA writes on {n} ranks",
            fabric.writes()
        );
    }
}

/// Three queue pairs per peer: pieces alternate between them, and every result is right,
/// with a slot size that cuts the messages into many pieces.
#[test]
fn several_queue_pairs_per_connection() {
    let fabric = Fabric::new(Faults::default());
    with_model(Some(fabric.clone()), "ib", || {
        // Set under the lock with_model holds, so no other test sees them.
        std::env::set_var("NCCL_IB_QPS_PER_CONNECTION", "3");
        std::env::set_var("COMM_IB_SLOT_BYTES", "4K");
        with_threads(3, Duration::from_secs(300), |c, rank, n| {
            let ctx = Ctx { comm: c, rank, n };
            for coll in COLLS {
                for count in [0, 1, 1001, 100_003] {
                    run_case(&ctx, coll, FLOAT, SUM, count, false)?;
                }
            }
            Ok(())
        });
        std::env::remove_var("NCCL_IB_QPS_PER_CONNECTION");
        std::env::remove_var("COMM_IB_SLOT_BYTES");
    });
    assert_eq!(
        fabric.queue_pairs(),
        3 * 2 * 3,
        "3 ranks x 2 peers x 3 queue pairs"
    );
}

/// Unset COMM_NET picks InfiniBand where every rank has a device.
#[test]
fn picked_automatically_where_every_rank_has_a_device() {
    let fabric = Fabric::new(Faults::default());
    with_model(Some(fabric.clone()), "", || {
        with_threads(3, Duration::from_secs(120), |c, rank, n| {
            let ctx = Ctx { comm: c, rank, n };
            run_case(&ctx, Coll::AllReduce, FLOAT, SUM, 100_003, false)
        });
    });
    assert!(fabric.writes() > 0, "no RDMA writes: sockets were used");
}

/// NCCL_IB_DISABLE=1 keeps the network transport on sockets although every rank has a device;
/// with COMM_NET=ib it is refused and says why.
#[test]
fn ib_disable_falls_back_to_sockets() {
    let fabric = Fabric::new(Faults::default());
    with_model(Some(fabric.clone()), "", || {
        // Set under the lock with_model holds (which removes it), so no other test sees it.
        std::env::set_var("NCCL_IB_DISABLE", "1");
        with_threads(3, Duration::from_secs(120), |c, rank, n| {
            let ctx = Ctx { comm: c, rank, n };
            run_case(&ctx, Coll::AllReduce, FLOAT, SUM, 100_003, false)
        });
    });
    assert_eq!(fabric.writes(), 0, "RDMA writes with NCCL_IB_DISABLE=1");
    with_model(Some(fabric.clone()), "ib", || {
        std::env::set_var("NCCL_IB_DISABLE", "1");
        let mut comms = [std::ptr::null_mut(); 2];
        let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) };
        let msg = last_error();
        assert_eq!(r, ncclResult_t::ncclInvalidUsage, "{msg}");
        assert!(
            msg.contains("COMM_NET=ib") && msg.contains("COMM_IB_DISABLE=1"),
            "{msg}"
        );
    });
    assert_eq!(fabric.writes(), 0, "RDMA writes with NCCL_IB_DISABLE=1");
}

/// Every operation takes effect 200 us after it was posted: results are still right.
#[test]
fn delayed_completions() {
    let fabric = Fabric::new(Faults {
        delay: Some(Duration::from_micros(200)),
        ..Faults::default()
    });
    with_model(Some(fabric), "ib", || {
        with_threads(3, Duration::from_secs(300), |c, rank, n| {
            let ctx = Ctx { comm: c, rank, n };
            for coll in COLLS {
                run_case(&ctx, coll, FLOAT, SUM, 300_001, false)?;
                run_case(&ctx, coll, FLOAT, SUM, 0, false)?;
            }
            Ok(())
        });
    });
}

/// The 40th write completes with a remote access error and its connection goes to error:
/// every rank's all-reduce loop ends in an error (none hangs), the ranks at the broken
/// connection name the device, the peer and the status, and the communicators can still be
/// destroyed.
#[test]
fn an_error_completion_fails_the_collective() {
    let status = "remote access error (10)";
    let fabric = Fabric::new(Faults {
        fail_write: Some((40, status.into())),
        ..Faults::default()
    });
    // (rank, result, message, time to fail)
    type Failure = (usize, ncclResult_t, String, Duration);
    let errors: Arc<Mutex<Vec<Failure>>> = Default::default();
    let seen = errors.clone();
    with_model(Some(fabric), "ib", || {
        std::env::set_var("COMM_TIMEOUT", "20");
        with_threads(3, Duration::from_secs(120), move |c, rank, _n| {
            let mut buf = vec![1f32; 1 << 20];
            let t = Instant::now();
            for _ in 0..100 {
                let p = buf.as_mut_ptr() as *mut c_void;
                let r = unsafe { ncclAllReduce(p, p, buf.len(), FLOAT, SUM, c, S) };
                if r != OK {
                    let msg = last_error();
                    seen.lock().unwrap().push((rank, r, msg, t.elapsed()));
                    return Ok(());
                }
            }
            Err("100 all-reduces succeeded through a broken connection".into())
        });
    });
    let errors = errors.lock().unwrap();
    assert_eq!(errors.len(), 3, "{errors:?}");
    let naming = errors
        .iter()
        .filter(|(_, _, m, _)| m.contains("InfiniBand model_0:1") && m.contains(status))
        .count();
    assert!(
        naming >= 1,
        "no rank names the device and status: {errors:?}"
    );
    for (rank, r, msg, t) in errors.iter() {
        println!("rank {rank}: {r:?} after {t:?}: {msg}");
        assert!(
            matches!(
                r,
                ncclResult_t::ncclRemoteError | ncclResult_t::ncclSystemError
            ),
            "rank {rank}: {r:?} {msg}"
        );
        assert!(*t < Duration::from_secs(15), "rank {rank} took {t:?}");
    }
}

/// Without a device: unset COMM_NET falls back to sockets; COMM_NET=ib is refused with the
/// reason.
#[test]
fn without_a_device() {
    with_model(None, "", || {
        with_threads(2, Duration::from_secs(120), |c, rank, n| {
            let ctx = Ctx { comm: c, rank, n };
            run_case(&ctx, Coll::AllReduce, FLOAT, SUM, 1001, false)
        });
    });
    with_model(None, "ib", || {
        let mut comms = [std::ptr::null_mut(); 2];
        let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) };
        let msg = last_error();
        assert_eq!(r, ncclResult_t::ncclInvalidUsage, "{msg}");
        assert!(
            msg.contains("COMM_NET=ib") && msg.contains("the model has no device"),
            "{msg}"
        );
    });
}

/// The real verbs library, on this machine (which has no RDMA device): loaded at run time,
/// and a reason to fall back when it is absent or lists no device.
#[test]
fn the_verbs_library_is_opened_at_run_time() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("COMM_SHM_DISABLE", "1");
    std::env::set_var("COMM_NET", "ib");
    let mut comms = [std::ptr::null_mut(); 2];
    let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) };
    let msg = last_error();
    std::env::remove_var("COMM_NET");
    assert_eq!(r, ncclResult_t::ncclInvalidUsage, "{msg}");
    assert!(
        msg.contains("libibverbs.so.1 is not installed")
            || msg.contains("libibverbs lists no RDMA device"),
        "{msg}"
    );
    // No load-time dependency on rdma-core.
    let lib = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(if cfg!(debug_assertions) {
        "target/debug/libcomm.so"
    } else {
        "target/release/libcomm.so"
    });
    if let Ok(out) = std::process::Command::new("readelf")
        .arg("-d")
        .arg(&lib)
        .output()
    {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("NEEDED"),
            "readelf -d {}: {text}",
            lib.display()
        );
        assert!(!text.contains("libibverbs"), "{text}");
    }
}

/// Buffers registered with ncclCommRegister are sent from where they are: pieces of them go
/// as plain RDMA writes from the user's memory (the model checks their keys), results stay
/// right, and after ncclCommDeregister they are copied again. A buffer registered only in part
/// is sent right too.
#[test]
fn registered_buffers_are_sent_without_a_copy() {
    let fabric = Fabric::new(Faults::default());
    let f = fabric.clone();
    with_model(Some(fabric.clone()), "ib", move || {
        let f = f.clone();
        with_threads(3, Duration::from_secs(300), move |c, rank, n| {
            let count = (3 << 20) / 4 + 7;
            let value = |r: usize, i: usize| ((r * 7 + i % 1013) % 251) as f32;
            let send: Vec<f32> = (0..count).map(|i| value(rank, i)).collect();
            let mut recv = vec![0f32; count * n];
            let sync = || -> Result<(), String> {
                let mut x = [0f32];
                nccl!(ncclAllReduce(
                    x.as_ptr() as *const c_void,
                    x.as_mut_ptr() as *mut c_void,
                    1,
                    FLOAT,
                    SUM,
                    c,
                    S
                ));
                Ok(())
            };
            let mut run = |what: &str| -> Result<(), String> {
                nccl!(ncclAllReduce(
                    send.as_ptr() as *const c_void,
                    recv.as_mut_ptr() as *mut c_void,
                    count,
                    FLOAT,
                    SUM,
                    c,
                    S
                ));
                for (i, got) in recv[..count].iter().enumerate() {
                    let want: f32 = (0..n).map(|r| value(r, i)).sum();
                    if *got != want {
                        return Err(format!(
                            "{what}: all-reduce element {i} is {got}, expected {want}"
                        ));
                    }
                }
                nccl!(ncclAllGather(
                    send.as_ptr() as *const c_void,
                    recv.as_mut_ptr() as *mut c_void,
                    count,
                    FLOAT,
                    c,
                    S
                ));
                for r in 0..n {
                    for i in 0..count {
                        if recv[r * count + i] != value(r, i) {
                            return Err(format!(
                                "{what}: all-gather element {i} of rank {r} is {}",
                                recv[r * count + i]
                            ));
                        }
                    }
                }
                Ok(())
            };
            // Registered whole, then only its first half.
            for part in [count * 4, count * 2] {
                let mut h: *mut c_void = std::ptr::null_mut();
                nccl!(ncclCommRegister(
                    c,
                    send.as_ptr() as *mut c_void,
                    part,
                    &mut h
                ));
                run("registered")?;
                sync()?;
                nccl!(ncclCommDeregister(c, h));
            }
            sync()?;
            let before = f.plain_writes();
            if before == 0 {
                return Err("no piece was written straight from a registered buffer".into());
            }
            sync()?;
            run("deregistered")?;
            sync()?;
            let after = f.plain_writes();
            if after != before {
                return Err(format!(
                    "{} pieces were written from a deregistered buffer",
                    after - before
                ));
            }
            Ok(())
        });
    });
}

/// A send from a registered buffer returns only once the RDMA writes that read it are done:
/// with every operation delayed 2 ms, rank 0 overwrites its buffer the moment ncclSend
/// returns, and rank 1 must still receive what was there before.
#[test]
fn a_send_from_a_registered_buffer_returns_after_its_writes() {
    let fabric = Fabric::new(Faults {
        delay: Some(Duration::from_millis(2)),
        ..Faults::default()
    });
    let f = fabric.clone();
    let model = fabric.clone();
    with_model(Some(fabric), "ib", move || {
        with_threads(2, Duration::from_secs(60), move |c, rank, _n| {
            let count = (1 << 20) + 3;
            let value = |round: usize, i: usize| ((round * 31 + i % 509) % 241) as f32;
            let mut buf: Vec<f32> = vec![0f32; count];
            let mut h: *mut c_void = std::ptr::null_mut();
            nccl!(ncclCommRegister(
                c,
                buf.as_mut_ptr() as *mut c_void,
                count * 4,
                &mut h
            ));
            for round in 0..4 {
                if rank == 0 {
                    buf.iter_mut()
                        .enumerate()
                        .for_each(|(i, v)| *v = value(round, i));
                    nccl!(ncclSend(
                        buf.as_ptr() as *const c_void,
                        count,
                        FLOAT,
                        1,
                        c,
                        S
                    ));
                    let pending = model.pending_on(buf.as_ptr() as u64, (count * 4) as u64);
                    if pending > 0 {
                        return Err(format!(
                            "round {round}: ncclSend returned with {pending} writes still to read its buffer"
                        ));
                    }
                    // From the end: the last pieces posted are the likeliest still in flight.
                    buf.iter_mut().rev().for_each(|v| *v = -1.0);
                } else {
                    nccl!(ncclRecv(
                        buf.as_mut_ptr() as *mut c_void,
                        count,
                        FLOAT,
                        0,
                        c,
                        S
                    ));
                    if let Some(i) = (0..count).find(|&i| buf[i] != value(round, i)) {
                        return Err(format!(
                            "round {round}: element {i} is {}, expected {}",
                            buf[i],
                            value(round, i)
                        ));
                    }
                }
            }
            nccl!(ncclCommDeregister(c, h));
            Ok(())
        });
    });
    assert!(
        f.plain_writes() > 0,
        "no piece was written straight from the registered buffer"
    );
}

// ---------------------------------------------------------------------------------------
// Windows over RDMA.

const UINT8: i32 = 1;
const UINT64: i32 = 5;
const SYM: i32 = NCCL_WIN_COLL_SYMMETRIC;

/// Runs `body` on `n` ranks (threads) whose windows reach each other over the model's RDMA.
fn with_rdma_windows(
    fabric: Arc<Fabric>,
    net: &str,
    n: usize,
    timeout: Duration,
    body: impl Fn(ncclComm_t, usize, usize) -> Result<(), String> + Send + Sync + 'static,
) {
    with_model(Some(fabric), net, || {
        std::env::set_var("COMM_WIN_NET", "1");
        // A wait that would never end fails instead (ncclTimeout), well within `timeout`.
        std::env::set_var("COMM_TIMEOUT", "30");
        with_threads(n, timeout, body);
    });
}

/// A barrier of threads that gives up after 30 s (a rank that failed never arrives), for
/// ranks that must not call the library meanwhile.
struct Meet {
    state: Mutex<(usize, u64)>,
    cv: std::sync::Condvar,
    n: usize,
}

impl Meet {
    fn new(n: usize) -> Arc<Meet> {
        Arc::new(Meet {
            state: Mutex::new((0, 0)),
            cv: std::sync::Condvar::new(),
            n,
        })
    }

    fn wait(&self) -> Result<(), String> {
        let mut st = self.state.lock().unwrap();
        let generation = st.1;
        st.0 += 1;
        if st.0 == self.n {
            *st = (0, generation + 1);
            self.cv.notify_all();
            return Ok(());
        }
        let (st, t) = self
            .cv
            .wait_timeout_while(st, Duration::from_secs(30), |s| s.1 == generation)
            .unwrap();
        drop(st);
        if t.timed_out() {
            return Err("a rank never reached the barrier".into());
        }
        Ok(())
    }
}

/// A collective as a barrier between the ranks.
fn lib_barrier(c: ncclComm_t) -> Result<(), String> {
    let mut x = [0f32];
    nccl!(ncclAllReduce(
        x.as_ptr() as *const c_void,
        x.as_mut_ptr() as *mut c_void,
        1,
        FLOAT,
        SUM,
        c,
        S
    ));
    Ok(())
}

/// A window of `len` bytes of ordinary memory (zeroed), registered on `c`. Never freed: a
/// rank that fails a check returns at once, while peers may still write into its window.
fn rdma_window(c: ncclComm_t, len: usize) -> Result<(&'static mut [u8], ncclWindow_t), String> {
    let mem: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
    let mut win: ncclWindow_t = std::ptr::null_mut();
    nccl!(ncclCommWindowRegister(
        c,
        mem.as_mut_ptr() as *mut c_void,
        len,
        &mut win,
        SYM
    ));
    Ok((mem, win))
}

fn word(mem: &[u8], off: usize) -> u64 {
    // SAFETY: an aligned word inside `mem`, which the HCA (model) may change concurrently.
    unsafe { std::ptr::read_volatile(mem.as_ptr().add(off) as *const u64) }
}

fn pattern(rank: usize, i: usize) -> u8 {
    ((rank * 131 + i * 7 + i / 253) % 251) as u8
}

/// Puts, gets and fetch-adds into rank 0, which does not call the library while the others
/// work on its window: puts of several sizes (through staging, and straight from a buffer
/// registered with ncclCommRegister) read back with gets, and fetch-adds that end at their
/// sum. The model counts its reads and atomics, so the operations really went over RDMA.
/// The puts the window tests make back to back: empty, one byte, odd, just over a page, large.
const PUT_SIZES: [usize; 5] = [0, 1, 7, 4099, 300_001];

/// Puts the first `len` bytes of `src` for each of PUT_SIZES back to back from `base` of rank
/// 0's part of `win`, flushes, reads them all back into `back` and checks them byte by byte.
fn put_each_size_and_read_back(
    c: ncclComm_t,
    win: ncclWindow_t,
    src: &[u8],
    back: &mut [u8],
    base: usize,
) -> Result<(), String> {
    let mut at = base;
    for &len in &PUT_SIZES {
        nccl!(commWinPut(
            src.as_ptr() as *const c_void,
            len,
            UINT8,
            0,
            win,
            at,
            c
        ));
        at += len;
    }
    nccl!(commWinFlush(0, win, c));
    nccl!(commWinGet(
        back.as_mut_ptr() as *mut c_void,
        at - base,
        UINT8,
        0,
        win,
        base,
        c
    ));
    let mut off = 0;
    for &len in &PUT_SIZES {
        if let Some(i) = (0..len).find(|&i| back[off + i] != src[i]) {
            return Err(format!(
                "the put of {len} bytes read back wrong at byte {i}: {} instead of {}",
                back[off + i],
                src[i]
            ));
        }
        off += len;
    }
    Ok(())
}

/// `adds` fetch-adds of 1 to the first word of rank 0's part of `win`.
fn add_to_rank0(c: ncclComm_t, win: ncclWindow_t, adds: u64) -> Result<(), String> {
    for _ in 0..adds {
        nccl!(commWinFetchAdd(
            1,
            std::ptr::null_mut(),
            UINT64,
            0,
            win,
            0,
            c
        ));
    }
    Ok(())
}

/// Rank 0's look at its own part: rank `r`'s puts of PUT_SIZES (of `pattern(r, _)`) landed
/// back to back from `base`.
fn check_puts_landed(mem: &[u8], r: usize, base: usize) -> Result<(), String> {
    let mut at = base;
    for &l in &PUT_SIZES {
        if let Some(i) = (0..l).find(|&i| mem[at + i] != pattern(r, i)) {
            return Err(format!(
                "rank {r}'s put of {l} bytes: byte {i} is {}, expected {}",
                mem[at + i],
                pattern(r, i)
            ));
        }
        at += l;
    }
    Ok(())
}

fn put_get_fetch_add(fabric: Arc<Fabric>, net: &str, expect_rdma: bool) {
    const REGION: usize = 1 << 20;
    const ADDS: u64 = 300;
    let n = 3;
    let quiet = Meet::new(n);
    with_rdma_windows(
        fabric.clone(),
        net,
        n,
        Duration::from_secs(120),
        move |c, rank, n| {
            let (mem, win) = rdma_window(c, 64 + REGION * n)?;
            lib_barrier(c)?;
            // Rank 0 stays out of the library from here to the second barrier.
            quiet.wait()?;
            if rank != 0 {
                let base = 64 + REGION * rank;
                let src: Vec<u8> = (0..REGION).map(|i| pattern(rank, i)).collect();
                let mut reg: *mut c_void = std::ptr::null_mut();
                nccl!(ncclCommRegister(
                    c,
                    src.as_ptr() as *mut c_void,
                    REGION,
                    &mut reg
                ));
                let mut back = vec![0u8; PUT_SIZES.iter().sum()];
                put_each_size_and_read_back(c, win, &src, &mut back, base)?;
                add_to_rank0(c, win, ADDS)?;
                nccl!(ncclCommDeregister(c, reg));
            }
            quiet.wait()?;
            lib_barrier(c)?;
            // Every rank reaches the last barrier, whatever rank 0 finds: no one waits in vain.
            let verdict = (|| -> Result<(), String> {
                if rank == 0 {
                    let want = ADDS * (n as u64 - 1);
                    if word(mem, 0) != want {
                        return Err(format!("the counter is {}, expected {want}", word(mem, 0)));
                    }
                    for r in 1..n {
                        check_puts_landed(mem, r, 64 + REGION * r)?;
                    }
                }
                Ok(())
            })();
            lib_barrier(c)?;
            nccl!(ncclCommWindowDeregister(c, win));
            verdict
        },
    );
    let (reads, atomics) = (fabric.reads(), fabric.atomics());
    if expect_rdma {
        assert!(
            atomics >= ADDS * 2,
            "only {atomics} atomics went over the fabric"
        );
        assert!(reads >= 2, "only {reads} RDMA reads");
        assert!(
            fabric.plain_writes() >= 2,
            "no put was written from the registered buffer"
        );
    } else {
        assert_eq!((reads, atomics), (0, 0), "RDMA used on the TCP path");
    }
}

#[test]
fn windows_put_get_fetch_add_over_rdma() {
    put_get_fetch_add(Fabric::new(Faults::default()), "ib", true);
}

/// Where the network transport is sockets, windows keep their TCP path (same operations).
#[test]
fn windows_over_sockets_do_not_use_rdma() {
    put_get_fetch_add(Fabric::new(Faults::default()), "socket", false);
}

/// Every rank, the target itself included, adds to one word of rank 0 many times; and every
/// rank takes a lock in rank 0's window with compare-and-swap to increment a second word by a
/// get and a put. Both end exactly at their sums: the target's own atomics go through the HCA
/// too (the model's atomics are not atomic against the CPU's, as with a real HCA).
#[test]
fn windows_atomics_from_every_rank_and_a_cas_lock() {
    const ADDS: u64 = 400;
    const LOCKED: u64 = 40;
    let n = 4;
    let fabric = Fabric::new(Faults {
        delay: None,
        ..Faults::default()
    });
    with_rdma_windows(
        fabric.clone(),
        "ib",
        n,
        Duration::from_secs(120),
        move |c, rank, n| {
            let (mem, win) = rdma_window(c, 64)?;
            lib_barrier(c)?;
            for i in 0..ADDS {
                let mut old = 0u64;
                nccl!(commWinFetchAdd(1, &mut old, UINT64, 0, win, 0, c));
                if i == 0 && old >= ADDS * n as u64 {
                    return Err(format!("fetch-add returned {old}"));
                }
                if rank == 0 {
                    // The target's own adds spread over the others', so that they overlap.
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            let me = rank as u64 + 1;
            for _ in 0..LOCKED {
                // Acquire: swap 0 for our mark.
                loop {
                    let mut old = u64::MAX;
                    nccl!(commWinCompareSwap(0, me, &mut old, UINT64, 0, win, 8, c));
                    if old == 0 {
                        break;
                    }
                    if old > n as u64 {
                        return Err(format!("the lock word holds {old}"));
                    }
                    std::thread::yield_now();
                }
                let mut v = [0u64];
                nccl!(commWinGet(
                    v.as_mut_ptr() as *mut c_void,
                    8,
                    UINT8,
                    0,
                    win,
                    16,
                    c
                ));
                v[0] += 1;
                nccl!(commWinPut(
                    v.as_ptr() as *const c_void,
                    8,
                    UINT8,
                    0,
                    win,
                    16,
                    c
                ));
                nccl!(commWinFlush(0, win, c));
                let mut old = 0u64;
                nccl!(commWinCompareSwap(me, 0, &mut old, UINT64, 0, win, 8, c));
                if old != me {
                    return Err(format!("released a lock held by {old}"));
                }
            }
            lib_barrier(c)?;
            let verdict = (|| -> Result<(), String> {
                if rank == 0 {
                    let (adds, locked) = (word(mem, 0), word(mem, 16));
                    if adds != ADDS * n as u64 || locked != LOCKED * n as u64 || word(mem, 8) != 0 {
                        return Err(format!(
                    "counter {adds} (expected {}), locked counter {locked} (expected {}), lock {}",
                    ADDS * n as u64,
                    LOCKED * n as u64,
                    word(mem, 8)
                ));
                    }
                }
                Ok(())
            })();
            lib_barrier(c)?;
            nccl!(ncclCommWindowDeregister(c, win));
            verdict
        },
    );
    assert!(
        fabric.atomics() >= ADDS * n as u64 + 2 * LOCKED * n as u64,
        "only {} atomics went over the fabric",
        fabric.atomics()
    );
}

fn wait_desc(peer: usize, op_cnt: i32) -> ncclWaitSignalDesc_t {
    ncclWaitSignalDesc_t {
        opCnt: op_cnt,
        peer: peer as i32,
        sigIdx: 0,
        ctx: 0,
    }
}

/// NCCL signals and signal pads over RDMA, with every operation of the fabric delayed (so
/// that a signal overtaking its data would be seen): per round, a put with signal into a
/// fresh slot, checked the moment the signal is; several puts and a bare signal consumed by
/// one wait with opCnt; then pad signals, waits and barriers on several channels.
#[test]
fn windows_signals_over_rdma_follow_their_data() {
    let fabric = Fabric::new(Faults {
        delay: Some(Duration::from_micros(100)),
        ..Faults::default()
    });
    let n = 3;
    with_rdma_windows(
        fabric.clone(),
        "ib",
        n,
        Duration::from_secs(120),
        move |c, rank, n| {
            const ROUNDS: usize = 60;
            const SLOT: usize = 5000;
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            let (mem, win) = rdma_window(c, SLOT * ROUNDS + 64)?;
            lib_barrier(c)?;
            for k in 0..ROUNDS {
                let src: Vec<u8> = (0..SLOT).map(|i| pattern(rank, i + k)).collect();
                nccl!(ncclPutSignal(
                    src.as_ptr() as *const c_void,
                    SLOT,
                    UINT8,
                    next as i32,
                    win,
                    SLOT * k,
                    0,
                    0,
                    0,
                    c,
                    S
                ));
                let mut d = [wait_desc(prev, 1)];
                nccl!(ncclWaitSignal(1, d.as_mut_ptr(), c, S));
                let got = &mem[SLOT * k..SLOT * (k + 1)];
                if let Some(i) = (0..SLOT).find(|&i| got[i] != pattern(prev, i + k)) {
                    return Err(format!(
                        "round {k}: the signal was seen before byte {i} of its put landed"
                    ));
                }
            }
            // Three puts and a bare signal, one wait for the four.
            for j in 0..3 {
                let src = [j as u8 + 1; 16];
                nccl!(ncclPutSignal(
                    src.as_ptr() as *const c_void,
                    16,
                    UINT8,
                    next as i32,
                    win,
                    16 * j,
                    0,
                    0,
                    0,
                    c,
                    S
                ));
            }
            nccl!(ncclSignal(next as i32, 0, 0, 0, c, S));
            let mut d = [wait_desc(prev, 4)];
            nccl!(ncclWaitSignal(1, d.as_mut_ptr(), c, S));
            for j in 0..3 {
                if mem[16 * j..16 * (j + 1)].iter().any(|&b| b != j as u8 + 1) {
                    return Err(format!("after the opCnt=4 wait, put {j} has not landed"));
                }
            }
            // Signal pads: a ping-pong on channel 1, then barriers on channels 0 and 2.
            for _ in 0..20 {
                if rank == 0 {
                    nccl!(commWinChannelSignal(1, 1, 20_000, win, c));
                    nccl!(commWinChannelWait(1, 1, 20_000, win, c));
                } else if rank == 1 {
                    nccl!(commWinChannelWait(0, 1, 20_000, win, c));
                    nccl!(commWinChannelSignal(0, 1, 20_000, win, c));
                }
            }
            for ch in [0, 2, 0, 2] {
                nccl!(commWinChannelBarrier(ch, 20_000, win, c));
            }
            lib_barrier(c)?;
            nccl!(ncclCommWindowDeregister(c, win));
            Ok(())
        },
    );
    assert!(
        fabric.reads() >= 40,
        "only {} RDMA reads (pad signals)",
        fabric.reads()
    );
}

/// The third atomic over the fabric completes with an error: the rank that posted it gets
/// ncclRemoteError naming the device, the peer and the status (no hang), so does its next
/// operation to that peer, and its operations to other ranks still work.
#[test]
fn windows_rdma_error_completion_is_a_remote_error() {
    let status = "remote operation error (11)";
    let fabric = Fabric::new(Faults {
        fail_atomic: Some((3, status.into())),
        ..Faults::default()
    });
    let n = 3;
    let order = Meet::new(n);
    with_rdma_windows(
        fabric.clone(),
        "ib",
        n,
        Duration::from_secs(60),
        move |c, rank, _n| {
            let (mem, win) = rdma_window(c, 64)?;
            lib_barrier(c)?;
            order.wait()?;
            if rank == 1 {
                let t = Instant::now();
                let mut failed = None;
                for i in 0..3 {
                    let r =
                        unsafe { commWinFetchAdd(1, std::ptr::null_mut(), UINT64, 0, win, 0, c) };
                    if r != OK {
                        failed = Some((i, r, last_error()));
                        break;
                    }
                }
                let Some((i, r, msg)) = failed else {
                    return Err("three fetch-adds succeeded through a failing fabric".into());
                };
                if i != 2
                    || r != ncclResult_t::ncclRemoteError
                    || !msg.contains("model_0:1")
                    || !msg.contains(status)
                    || !msg.contains("rank 0")
                {
                    return Err(format!("fetch-add {i}: {r:?}: {msg}"));
                }
                if t.elapsed() > Duration::from_secs(10) {
                    return Err(format!("the error took {:?}", t.elapsed()));
                }
                let r = unsafe { commWinFetchAdd(1, std::ptr::null_mut(), UINT64, 0, win, 0, c) };
                if r != ncclResult_t::ncclRemoteError {
                    return Err(format!("the next fetch-add to rank 0: {r:?}"));
                }
                // Other peers, and this rank itself, are still reachable.
                for peer in [2, 1] {
                    let mut old = u64::MAX;
                    nccl!(commWinFetchAdd(5, &mut old, UINT64, peer, win, 8, c));
                    if old != 0 {
                        return Err(format!("fetch-add at rank {peer} found {old}"));
                    }
                }
                let v = [7u8; 8];
                nccl!(commWinPut(
                    v.as_ptr() as *const c_void,
                    8,
                    UINT8,
                    2,
                    win,
                    16,
                    c
                ));
                nccl!(commWinFlush(2, win, c));
            }
            order.wait()?;
            if rank == 2 && (word(mem, 8) != 5 || mem[16..24] != [7u8; 8]) {
                return Err(format!("rank 2's window: {:?}", &mem[..24]));
            }
            order.wait()?;
            nccl!(ncclCommWindowDeregister(c, win));
            Ok(())
        },
    );
}

/// A put into a window its target has already deregistered (its memory no longer registered
/// with the device) fails the queue pair with a remote access error: the flush after it
/// waits for it and returns ncclRemoteError naming the device, the target and the status, without hanging, and
/// the other peers stay reachable.
#[test]
fn windows_put_into_a_deregistered_window_is_a_remote_error() {
    // Delayed, so that the error is known only once the flush has waited for it.
    let fabric = Fabric::new(Faults {
        delay: Some(Duration::from_millis(2)),
        ..Faults::default()
    });
    let n = 3;
    let order = Meet::new(n);
    with_rdma_windows(
        fabric.clone(),
        "ib",
        n,
        Duration::from_secs(60),
        move |c, rank, _n| {
            let (mem, win) = rdma_window(c, 4096)?;
            lib_barrier(c)?;
            if rank == 0 {
                nccl!(ncclCommWindowDeregister(c, win));
            }
            order.wait()?;
            let mut verdict = Ok(());
            if rank == 1 {
                let t = Instant::now();
                let v = [9u8; 100];
                let put =
                    unsafe { commWinPut(v.as_ptr() as *const c_void, 100, UINT8, 0, win, 0, c) };
                let flush = unsafe { commWinFlush(0, win, c) };
                let msg = last_error();
                let named = msg.contains("model_0:1")
                    && msg.contains("remote access error")
                    && msg.contains("rank 0");
                if put != OK && put != ncclResult_t::ncclRemoteError
                    || flush != ncclResult_t::ncclRemoteError
                    || !named
                {
                    verdict = Err(format!("put {put:?}, flush {flush:?}: {msg}"));
                } else if t.elapsed() > Duration::from_secs(10) {
                    verdict = Err(format!("the error took {:?}", t.elapsed()));
                } else {
                    nccl!(commWinPut(
                        v.as_ptr() as *const c_void,
                        100,
                        UINT8,
                        2,
                        win,
                        0,
                        c
                    ));
                    nccl!(commWinFlush(2, win, c));
                }
            }
            order.wait()?;
            if rank == 2 && mem[..100] != [9u8; 100] {
                verdict = Err("rank 1's put to rank 2 did not land".into());
            }
            order.wait()?;
            if rank != 0 {
                nccl!(ncclCommWindowDeregister(c, win));
            }
            verdict
        },
    );
}

// ---------------------------------------------------------------------------------------
// GPUDirect RDMA: window memory and local buffers registered through a dmabuf. No GPU here:
// a memfd stands in for a GPU's dmabuf export (`ib::stand_in`), and the model reaches its
// pages through the descriptor, as an HCA reaches a GPU's.

/// `len` bytes of a fresh memfd from `offset` on, mapped (whole) into this process, and
/// declared to windows as memory reached through that dmabuf. Returns the bytes and the
/// memfd, which has as many bytes again after them (zeros: what a registration at a wrong
/// offset would reach, instead of the end of the file). Never unmapped: peers may still reach
/// it when a rank fails a check.
fn dmabuf_memory(offset: usize, len: usize) -> (&'static mut [u8], std::os::fd::OwnedFd) {
    use std::os::fd::{AsFd, AsRawFd, FromRawFd};
    // SAFETY: a NUL-terminated name; the descriptor is owned below.
    let fd = unsafe { libc::memfd_create(c"comm-dmabuf-stand-in".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a descriptor just made, owned from here.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let total = offset + 2 * len;
    assert_eq!(
        // SAFETY: resizing a memfd of ours.
        unsafe { libc::ftruncate(fd.as_raw_fd(), total as libc::off_t) },
        0
    );
    // SAFETY: a fresh shared mapping of the whole memfd; checked below.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(at, libc::MAP_FAILED, "mmap of the memfd");
    // SAFETY: `len` bytes of the mapping from `offset` on, never unmapped.
    let mem = unsafe { std::slice::from_raw_parts_mut((at as *mut u8).add(offset), len) };
    ib::stand_in(mem.as_mut_ptr(), len, fd.as_fd(), offset as u64).expect("stand_in");
    (mem, fd)
}

/// Ranks 1.. put into rank 0's window from a local buffer, get it back into another, and do
/// fetch-adds and compare-and-swaps on it, all over RDMA, where every window part and every
/// local buffer is memory registered through a dmabuf (at offsets that are not page aligned
/// in their descriptors). Rank 0 stays out of the library meanwhile, then checks its window
/// byte by byte; each other rank checks what it read back byte by byte. The model counts the
/// work requests that went through dmabuf registrations, so the bytes really went that way.
#[test]
fn windows_rdma_on_dmabuf_memory() {
    const REGION: usize = 1 << 20;
    const ADDS: u64 = 50;
    let n = 3;
    let fabric = Fabric::new(Faults::default());
    let quiet = Meet::new(n);
    with_rdma_windows(
        fabric.clone(),
        "ib",
        n,
        Duration::from_secs(120),
        move |c, rank, n| {
            let len = 64 + REGION * n;
            let (mem, _fd) = dmabuf_memory(2 * 4096 + 64, len);
            let mut win: ncclWindow_t = std::ptr::null_mut();
            nccl!(ncclCommWindowRegister(
                c,
                mem.as_mut_ptr() as *mut c_void,
                len,
                &mut win,
                SYM
            ));
            lib_barrier(c)?;
            quiet.wait()?;
            if rank != 0 {
                // The destination of the gets and, after it, the source of the puts: one
                // "allocation", first used away from its start.
                let (local, _lfd) = dmabuf_memory(4096 + 128, 2 * REGION);
                let (back, src) = local.split_at_mut(REGION);
                for (i, b) in src.iter_mut().enumerate() {
                    *b = pattern(rank, i);
                }
                put_each_size_and_read_back(c, win, src, back, 64 + REGION * rank)?;
                add_to_rank0(c, win, ADDS)?;
                // This rank's word: 0 -> rank, then a swap that must not happen.
                let me = rank as u64;
                let mut old = u64::MAX;
                nccl!(commWinCompareSwap(
                    0,
                    me,
                    &mut old,
                    UINT64,
                    0,
                    win,
                    8 * rank,
                    c
                ));
                if old != 0 {
                    return Err(format!("the first compare-and-swap found {old}, not 0"));
                }
                nccl!(commWinCompareSwap(
                    0,
                    99,
                    &mut old,
                    UINT64,
                    0,
                    win,
                    8 * rank,
                    c
                ));
                if old != me {
                    return Err(format!("the second compare-and-swap found {old}, not {me}"));
                }
                ib::forget_stand_in(local.as_mut_ptr());
            }
            quiet.wait()?;
            lib_barrier(c)?;
            let verdict = (|| -> Result<(), String> {
                if rank != 0 {
                    return Ok(());
                }
                let want = ADDS * (n as u64 - 1);
                if word(mem, 0) != want {
                    return Err(format!("the counter is {}, expected {want}", word(mem, 0)));
                }
                for r in 1..n {
                    if word(mem, 8 * r) != r as u64 {
                        return Err(format!(
                            "rank {r}'s compare-and-swap word is {}, expected {r}",
                            word(mem, 8 * r)
                        ));
                    }
                    check_puts_landed(mem, r, 64 + REGION * r)?;
                }
                Ok(())
            })();
            lib_barrier(c)?;
            nccl!(ncclCommWindowDeregister(c, win));
            ib::forget_stand_in(mem.as_mut_ptr());
            verdict
        },
    );
    // Per putting rank: 4 puts (the empty one posts nothing), 1 get, the adds, 2 CASes, all
    // into dmabuf memory; the puts and the get also from or to dmabuf memory.
    let (remote, local) = fabric.dmabuf_ops();
    let others = n as u64 - 1;
    assert!(
        remote >= (4 + 1 + ADDS + 2) * others,
        "only {remote} work requests reached window memory through dmabuf registrations"
    );
    assert!(
        local >= (4 + 1) * others,
        "only {local} work requests used a local buffer through a dmabuf registration"
    );
    assert_eq!(
        fabric.dmabuf_regions(),
        0,
        "dmabuf registrations outlived their windows and communicators"
    );
}

/// GPUDirect RDMA on device memory of the software GPU (softgpu/, run by
/// scripts/test_softgpu.sh; without a device the test says so and checks nothing): window
/// parts and local buffers are inner ranges of cuMemAlloc allocations, not page aligned, so
/// the library exports the pages around them (`cuMemGetHandleForAddressRange` of a range that
/// starts inside the allocation) and registers them at the buffer's offset in that dmabuf; the
/// verbs model maps the descriptor from the range's start. Puts from device memory, gets into
/// device memory and fetch-adds, checked byte by byte through copies from the device.
#[test]
fn windows_rdma_on_device_memory_of_the_software_gpu() {
    use comm::testing::cuda::{self, Device, DeviceMem};
    if cuda::device_count() == 0 {
        eprintln!("no GPU (run under scripts/softgpu.sh): nothing checked");
        return;
    }
    const REGION: usize = 1 << 20;
    const ADDS: u64 = 20;
    const WIN_AT: usize = 2 * 4096 + 64;
    const LOCAL_AT: usize = 4096 + 128;
    let n = 3;
    let fabric = Fabric::new(Faults::default());
    let quiet = Meet::new(n);
    with_model(Some(fabric.clone()), "ib", || {
        std::env::set_var("COMM_WIN_NET", "1");
        std::env::set_var("COMM_TIMEOUT", "30");
        // Every rank on GPU 0, so that the communicators have a device path.
        with_threads_on(
            Some(&[0, 0, 0]),
            n,
            Duration::from_secs(120),
            move |c, rank, n| {
                let dev = Device::get(0).map_err(|e| e.msg)?;
                let _bound = dev.bind().map_err(|e| e.msg)?;
                let len = 64 + REGION * n;
                let alloc = DeviceMem::new(&dev, WIN_AT + len + 4096).map_err(|e| e.msg)?;
                let win_ptr = alloc.ptr + WIN_AT as u64;
                // SAFETY: inside a device allocation of this test's, sized for it, idle at this point.
                unsafe { cuda::copy_to_device(&dev, alloc.ptr, &vec![0u8; alloc.len]) }
                    .map_err(|e| e.msg)?;
                let mut win: ncclWindow_t = std::ptr::null_mut();
                nccl!(ncclCommWindowRegister(
                    c,
                    win_ptr as *mut c_void,
                    len,
                    &mut win,
                    SYM
                ));
                lib_barrier(c)?;
                quiet.wait()?;
                if rank != 0 {
                    let local = DeviceMem::new(&dev, LOCAL_AT + 2 * REGION).map_err(|e| e.msg)?;
                    let back = local.ptr + LOCAL_AT as u64;
                    let src = back + REGION as u64;
                    let pat: Vec<u8> = (0..REGION).map(|i| pattern(rank, i)).collect();
                    // SAFETY: inside a device allocation of this test's, sized for it, idle at this point.
                    unsafe { cuda::copy_to_device(&dev, src, &pat) }.map_err(|e| e.msg)?;
                    let mut at = 64 + REGION * rank;
                    for &l in &PUT_SIZES {
                        nccl!(commWinPut(src as *const c_void, l, UINT8, 0, win, at, c));
                        at += l;
                    }
                    nccl!(commWinFlush(0, win, c));
                    let total = at - (64 + REGION * rank);
                    nccl!(commWinGet(
                        back as *mut c_void,
                        total,
                        UINT8,
                        0,
                        win,
                        64 + REGION * rank,
                        c
                    ));
                    let mut got = vec![0u8; total];
                    // SAFETY: inside a device allocation of this test's, sized for it, idle at this point.
                    unsafe { cuda::copy_from_device(&dev, &mut got, back) }.map_err(|e| e.msg)?;
                    let mut off = 0;
                    for &l in &PUT_SIZES {
                        if let Some(i) = (0..l).find(|&i| got[off + i] != pat[i]) {
                            return Err(format!(
                            "the put of {l} bytes read back wrong at byte {i}: {} instead of {}",
                            got[off + i],
                            pat[i]
                        ));
                        }
                        off += l;
                    }
                    add_to_rank0(c, win, ADDS)?;
                }
                quiet.wait()?;
                lib_barrier(c)?;
                let verdict = (|| -> Result<(), String> {
                    if rank != 0 {
                        return Ok(());
                    }
                    let mut mem = vec![0u8; len];
                    // SAFETY: inside a device allocation of this test's, sized for it, idle at this point.
                    unsafe { cuda::copy_from_device(&dev, &mut mem, win_ptr) }
                        .map_err(|e| e.msg)?;
                    let want = ADDS * (n as u64 - 1);
                    let counter = u64::from_ne_bytes(mem[..8].try_into().unwrap());
                    if counter != want {
                        return Err(format!("the counter is {counter}, expected {want}"));
                    }
                    for r in 1..n {
                        check_puts_landed(&mem, r, 64 + REGION * r)?;
                    }
                    // Nothing landed before the window part: the registration's offset was right.
                    let mut before = vec![0u8; WIN_AT];
                    // SAFETY: inside a device allocation of this test's, sized for it, idle at this point.
                    unsafe { cuda::copy_from_device(&dev, &mut before, alloc.ptr) }
                        .map_err(|e| e.msg)?;
                    if let Some(i) = before.iter().position(|&b| b != 0) {
                        return Err(format!(
                            "byte {i} of the allocation, before the window, changed"
                        ));
                    }
                    Ok(())
                })();
                lib_barrier(c)?;
                nccl!(ncclCommWindowDeregister(c, win));
                verdict
            },
        );
    });
    let (remote, local) = fabric.dmabuf_ops();
    let others = n as u64 - 1;
    assert!(
        remote >= (4 + 1 + ADDS) * others,
        "only {remote} work requests reached window memory through dmabuf registrations"
    );
    assert!(
        local >= (4 + 1) * others,
        "only {local} work requests used a local buffer through a dmabuf registration"
    );
    assert_eq!(
        fabric.dmabuf_regions(),
        0,
        "dmabuf registrations outlived their windows"
    );
}

/// Where the device has no dmabuf registration, a window part that needs one is refused with
/// the reason and what to do, and so is a put from a local buffer that needs one; the
/// communicator keeps working: a window on host memory, its puts and gets, collectives.
#[test]
fn windows_without_dmabuf_refuse_device_memory() {
    let fabric = Fabric::new(Faults {
        no_dmabuf: true,
        ..Faults::default()
    });
    with_rdma_windows(
        fabric.clone(),
        "ib",
        2,
        Duration::from_secs(60),
        |c, rank, _| {
            let expect = |what: &str, r: ncclResult_t, wanted: &[&str]| -> Result<(), String> {
                let msg = last_error();
                if r != ncclResult_t::ncclInvalidUsage {
                    return Err(format!(
                        "{what} returned {r:?} ({msg}), not ncclInvalidUsage"
                    ));
                }
                for w in wanted {
                    if !msg.contains(w) {
                        return Err(format!("{what}: the message does not say {w:?}: {msg}"));
                    }
                }
                Ok(())
            };
            let (mem, _fd) = dmabuf_memory(64, 4096);
            let mut win: ncclWindow_t = std::ptr::null_mut();
            // SAFETY: valid arguments; the call fails.
            let r = unsafe {
                ncclCommWindowRegister(c, mem.as_mut_ptr() as *mut c_void, 4096, &mut win, SYM)
            };
            expect(
                "registering a window part that needs dmabuf",
                r,
                &[
                    "cannot register device memory for GPUDirect RDMA",
                    "the model's device has no dmabuf registration",
                    "register host memory for windows across hosts",
                ],
            )?;
            ib::forget_stand_in(mem.as_mut_ptr());
            lib_barrier(c)?;
            let (host, hwin) = rdma_window(c, 4096)?;
            lib_barrier(c)?;
            let peer = 1 - rank as i32;
            let (local, _lfd) = dmabuf_memory(64, 4096);
            // SAFETY: valid arguments; the call fails.
            let r =
                unsafe { commWinPut(local.as_ptr() as *const c_void, 64, UINT8, peer, hwin, 0, c) };
            expect(
                "a put from a local buffer that needs dmabuf",
                r,
                &[
                    "localbuff is memory the HCA reaches through a dmabuf",
                    "the model's device has no dmabuf registration",
                ],
            )?;
            ib::forget_stand_in(local.as_mut_ptr());
            let src: Vec<u8> = (0..4096).map(|i| pattern(rank, i)).collect();
            nccl!(commWinPut(
                src.as_ptr() as *const c_void,
                src.len(),
                UINT8,
                peer,
                hwin,
                0,
                c
            ));
            nccl!(commWinFlush(peer, hwin, c));
            let mut back = vec![0u8; 4096];
            nccl!(commWinGet(
                back.as_mut_ptr() as *mut c_void,
                back.len(),
                UINT8,
                peer,
                hwin,
                0,
                c
            ));
            if let Some(i) = (0..4096).find(|&i| back[i] != src[i]) {
                return Err(format!("byte {i} read back wrong after the refusals"));
            }
            lib_barrier(c)?;
            let theirs = 1 - rank;
            if let Some(i) = (0..4096).find(|&i| host[i] != pattern(theirs, i)) {
                return Err(format!(
                    "byte {i} of this rank's window is not rank {theirs}'s"
                ));
            }
            lib_barrier(c)?;
            nccl!(ncclCommWindowDeregister(c, hwin));
            Ok(())
        },
    );
    assert_eq!(fabric.dmabuf_ops(), (0, 0));
}

/// Sets `vars` for the length of `f` (under the lock `with_model` holds), then puts back
/// what was there: the tests below choose NCCL_RUNTIME_CONNECT themselves, whatever the run's
/// environment says.
fn with_vars<T>(vars: &[(&str, &str)], f: impl FnOnce() -> T) -> T {
    let before: Vec<_> = vars.iter().map(|(k, _)| std::env::var_os(k)).collect();
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    for ((k, _), old) in vars.iter().zip(before) {
        match old {
            Some(v) => std::env::set_var(k, v),
            None => std::env::remove_var(k),
        }
    }
    r.unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Runs `f` on a thread of its own; panics if it has not returned within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => std::panic::resume_unwind(e),
        Err(_) => panic!("did not return within {limit:?}"),
    }
}

/// Bytes the model still has registered, once they are all freed or 10 s passed: a thread
/// that called a communicator keeps it (`ffi/lane.rs`) until it exits or calls another, so a
/// rank thread may free its links a moment after destroy returned.
fn registered_after_destroy(fabric: &Fabric) -> u64 {
    let t0 = Instant::now();
    loop {
        let alive: u64 = fabric.per_device().iter().map(|d| d.registered).sum();
        if alive == 0 || t0.elapsed() > Duration::from_secs(10) {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `n` communicators of this process (threads as ranks), as addresses that threads can share.
fn init_all(n: usize) -> Vec<usize> {
    let mut comms = vec![std::ptr::null_mut(); n];
    let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), n as i32, std::ptr::null()) };
    assert_eq!(r, OK, "ncclCommInitAll: {}", last_error());
    comms.into_iter().map(|c| c as usize).collect()
}

/// What an all-reduce-only job of `n` ranks made on the model: each rank's queue pairs, and
/// the registered bytes of the busiest rank. Ring and tree only (the tuner's one-shot
/// all-reduce of small sizes reads from every rank up to 16); links made at first use
/// (`runtime_connect` "1") or at init ("0").
fn all_reduce_job(n: usize, runtime_connect: &str) -> (Vec<u32>, u64) {
    let fabric = Fabric::new(Faults::default());
    with_model(Some(fabric.clone()), "ib", || {
        with_vars(
            &[
                ("COMM_RUNTIME_CONNECT", runtime_connect),
                ("COMM_ALGO", "ring,tree"),
            ],
            || {
                with_threads(n, Duration::from_secs(300), |c, rank, n| {
                    let ctx = Ctx { comm: c, rank, n };
                    for count in [1001, (1 << 20) + 3] {
                        run_case(&ctx, Coll::AllReduce, FLOAT, SUM, count, false)?;
                    }
                    Ok(())
                })
            },
        )
    });
    let per = fabric.per_device();
    assert_eq!(per.len(), n, "one device per rank");
    let bytes = per.iter().map(|d| d.peak_registered).max().unwrap();
    (per.iter().map(|d| d.queue_pairs).collect(), bytes)
}

/// An all-reduce-only job makes queue pairs only for each rank's ring and tree neighbours, at
/// first use: a ring's two and a binomial tree's parent and children, so at most log2 N + 2
/// for the tree's root and fewer than 4 a rank on average, at 8 ranks as at 32 (every pair
/// would be N - 1 a rank).
#[test]
fn an_all_reduce_only_job_makes_queue_pairs_for_its_algorithms_peers_only() {
    let mut mean = Vec::new();
    for n in [8usize, 32] {
        let (qps, _) = all_reduce_job(n, "1");
        let most = n.ilog2() + 2;
        assert!(
            qps.iter().all(|&q| q <= most),
            "{n} ranks: queue pairs per rank {qps:?}"
        );
        let avg = qps.iter().sum::<u32>() as f64 / n as f64;
        assert!(avg <= 4.0, "{n} ranks: {avg} queue pairs per rank");
        mean.push(avg);
    }
    assert!(
        mean[1] <= mean[0] + 0.5,
        "queue pairs per rank grew from {} at 8 ranks to {} at 32",
        mean[0],
        mean[1]
    );
}

/// NCCL_RUNTIME_CONNECT=0: every pair's queue pair is made at init, before any call; with
/// links made at first use, init makes none.
#[test]
fn runtime_connect_0_makes_every_queue_pair_at_init() {
    for (rc, want) in [("0", 4 * 3), ("1", 0)] {
        let fabric = Fabric::new(Faults::default());
        with_model(Some(fabric.clone()), "ib", || {
            with_vars(&[("COMM_RUNTIME_CONNECT", rc)], || {
                let comms = init_all(4);
                assert_eq!(
                    fabric.queue_pairs(),
                    want,
                    "NCCL_RUNTIME_CONNECT={rc}: queue pairs after init"
                );
                for c in comms {
                    assert_eq!(unsafe { ncclCommDestroy(c as ncclComm_t) }, OK);
                }
            })
        });
        let alive = registered_after_destroy(&fabric);
        assert_eq!(alive, 0, "registered bytes left after destroy");
    }
}

/// A job in which each rank only swaps with its partner (rank ^ 1) makes that one queue pair
/// per rank and nothing else; destroy frees every registration.
#[test]
fn send_recv_pairs_make_only_their_queue_pair() {
    let n = 8;
    let fabric = Fabric::new(Faults::default());
    with_model(Some(fabric.clone()), "ib", || {
        with_vars(&[("COMM_RUNTIME_CONNECT", "1")], || {
            with_threads(n, Duration::from_secs(120), |c, me, _| {
                for count in [16usize, 300_001] {
                    swap(c, me, me ^ 1, count)?;
                }
                Ok(())
            })
        })
    });
    let per = fabric.per_device();
    assert!(
        per.iter().all(|d| d.queue_pairs == 1),
        "queue pairs per rank: {:?}",
        per.iter().map(|d| d.queue_pairs).collect::<Vec<_>>()
    );
    assert_eq!(registered_after_destroy(&fabric), 0, "{per:?}");
}

/// Rank 1 aborts its communicator before anyone used a link to it. Rank 0 (lower: it dials)
/// and rank 2 (higher: it waits for rank 1's dial and probes its service) each fail their
/// first call to it with ncclRemoteError naming rank 1, well before the init timeout.
#[test]
fn a_peer_gone_before_first_use_is_named() {
    let fabric = Fabric::new(Faults::default());
    with_model(Some(fabric), "ib", || {
        with_vars(
            &[("COMM_RUNTIME_CONNECT", "1"), ("COMM_INIT_TIMEOUT", "120")],
            || {
                let comms = init_all(3);
                assert_eq!(unsafe { ncclCommAbort(comms[1] as ncclComm_t) }, OK);
                let t0 = Instant::now();
                let waits: Vec<_> = [(0usize, true), (2, false)]
                    .into_iter()
                    .map(|(me, sends)| {
                        let c = comms[me] as ncclComm_t as usize;
                        std::thread::spawn(move || {
                            let c = c as ncclComm_t;
                            let mut x = vec![1f32; 16];
                            let p = x.as_mut_ptr() as *mut c_void;
                            let r = unsafe {
                                if sends {
                                    ncclSend(p, 16, FLOAT, 1, c, S)
                                } else {
                                    ncclRecv(p, 16, FLOAT, 1, c, S)
                                }
                            };
                            (me, r, last_error())
                        })
                    })
                    .collect();
                for w in waits {
                    let (me, r, msg) = within(Duration::from_secs(60), move || w.join().unwrap());
                    assert_eq!(r, ncclResult_t::ncclRemoteError, "rank {me}: {msg}");
                    assert!(msg.contains("rank 1"), "rank {me}: {msg}");
                }
                assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
                for c in [comms[0], comms[2]] {
                    unsafe { ncclCommDestroy(c as ncclComm_t) };
                }
            },
        )
    });
}

/// Abort on a half-connected communicator: rank 0 sent to rank 2 (connected from rank 0's
/// end, rank 2's end made but not yet taken), and rank 2 waits in a receive from rank 1, which
/// never dials. Aborting rank 2 from another thread ends its receive and returns; rank 0 then
/// learns from the link that rank 2 aborted.
#[test]
fn abort_on_a_half_connected_communicator_returns() {
    let fabric = Fabric::new(Faults::default());
    with_model(Some(fabric.clone()), "ib", || {
        with_vars(
            &[("COMM_RUNTIME_CONNECT", "1"), ("COMM_INIT_TIMEOUT", "120")],
            || {
                let comms = init_all(3);
                let c0 = comms[0] as ncclComm_t;
                let x = [1f32; 16];
                let r = unsafe { ncclSend(x.as_ptr() as *const c_void, 16, FLOAT, 2, c0, S) };
                assert_eq!(r, OK, "{}", last_error());
                let c2 = comms[2];
                let waiting = std::thread::spawn(move || {
                    let mut y = vec![0f32; 16];
                    let p = y.as_mut_ptr() as *mut c_void;
                    let r = unsafe { ncclRecv(p, 16, FLOAT, 1, c2 as ncclComm_t, S) };
                    (r, last_error())
                });
                std::thread::sleep(Duration::from_millis(500));
                assert!(!waiting.is_finished(), "the receive from rank 1 returned");
                within(Duration::from_secs(30), move || {
                    assert_eq!(unsafe { ncclCommAbort(c2 as ncclComm_t) }, OK)
                });
                let (r, msg) = within(Duration::from_secs(30), move || waiting.join().unwrap());
                assert_ne!(r, OK, "the receive succeeded: {msg}");
                let c0 = comms[0];
                let (r, msg) = within(Duration::from_secs(60), move || {
                    let mut y = vec![0f32; 16];
                    let p = y.as_mut_ptr() as *mut c_void;
                    let r = unsafe { ncclRecv(p, 16, FLOAT, 2, c0 as ncclComm_t, S) };
                    (r, last_error())
                });
                assert_eq!(r, ncclResult_t::ncclRemoteError, "{msg}");
                assert!(msg.contains("rank 2") && msg.contains("abort"), "{msg}");
                for c in [comms[0], comms[1]] {
                    unsafe { ncclCommAbort(c as ncclComm_t) };
                }
            },
        )
    });
    assert_eq!(fabric.queue_pairs(), 2, "only rank 0 and rank 2's link");
    let alive = registered_after_destroy(&fabric);
    assert_eq!(alive, 0, "registered bytes left after abort");
}

/// Resources per rank of an all-reduce-only job on the verbs model (bench/RESULTS.md,
/// "InfiniBand on demand"): `cargo test --release --test ib -- --ignored --nocapture
/// resources_per_rank`, for the rank counts in IB_BENCH_RANKS (default 8,32,128) and the
/// NCCL_RUNTIME_CONNECT values in IB_BENCH_CONNECT (default 0,1). Every rank is a thread of
/// this process, and the slots are ordinary memory: at 128 ranks with every pair connected,
/// set COMM_IB_SLOT_BYTES=4K to keep them within the machine's memory.
#[test]
#[ignore]
fn resources_per_rank() {
    let list = |var: &str, default: &str| -> Vec<String> {
        let v = std::env::var(var).unwrap_or_else(|_| default.into());
        v.split(',').map(|x| x.trim().to_string()).collect()
    };
    for n in list("IB_BENCH_RANKS", "8,32,128") {
        let n: usize = n.parse().unwrap();
        for rc in list("IB_BENCH_CONNECT", "0,1") {
            let rc = rc.as_str();
            let t0 = Instant::now();
            let (qps, bytes) = all_reduce_job(n, rc);
            println!(
                "ranks {n:4}  NCCL_RUNTIME_CONNECT={rc}  queue pairs/rank mean {:6.2} max {:4}  registered MiB, busiest rank {:8.1}  ({:.1} s)",
                qps.iter().sum::<u32>() as f64 / n as f64,
                qps.iter().max().unwrap(),
                bytes as f64 / (1 << 20) as f64,
                t0.elapsed().as_secs_f64()
            );
        }
    }
}
