//! The InfiniBand transport over the software model of verbs (`common/ibmodel.rs`), with ranks
//! as threads of this process (ncclCommInitAll, shared memory off so that they talk over the
//! network transport): the collective matrix, delayed completions, injected errors, and the
//! fall back to sockets where there is no device. No RDMA hardware is involved anywhere: the
//! model stands in for it (see the README for what a first run on a fabric must check).
//!
//! The tests set process-wide environment variables and the verbs provider, so they take a
//! lock and run one at a time.

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
