//! Ranks that disagree about an operation fail; ranks that agree get the right answer.
//!
//! Every message carries the operation's kind, number, root, datatype and reduction op, so a
//! float all-reduce on one rank and an int32 all-reduce of the same byte count on another, or
//! a sum against a max, fail with ncclInvalidUsage naming both operations instead of folding
//! unlike bytes. The property test sends random mixes of collectives, datatypes, ops and
//! counts where one rank now and then disagrees, and asserts that no rank ever returns a
//! wrong value, that every rank learns of every disagreement, and that every agreement is
//! correct element by element.

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
use std::os::raw::c_void;
use std::time::Duration;

const SCENARIOS: &[(&str, Scenario)] = &[("operands", operands), ("property", property)];

const S: cudaStream_t = std::ptr::null_mut();
const INT32: i32 = 2;
const FLOAT: i32 = 7;

/// arg: `dtype` or `op`. Rank 1 passes int32 where the others pass float (same byte count),
/// or max where they pass sum. Every rank must fail with ncclInvalidUsage, its message naming
/// both operations, and the communicator stays failed.
fn operands(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let odd = w.rank == 1;
    let (dt, op, want) = match w.arg.as_str() {
        "dtype" => (
            if odd { INT32 } else { FLOAT },
            SUM,
            ["(float, sum)", "(int32, sum)"],
        ),
        "op" => (
            FLOAT,
            if odd { MAX } else { SUM },
            ["(float, sum)", "(float, max)"],
        ),
        other => return Err(format!("unknown variant {other}")),
    };
    let count = 1000;
    let send = vec![1u32; count];
    let mut recv = vec![0u32; count];
    let r = unsafe {
        ncclAllReduce(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            count,
            dt,
            op,
            c,
            S,
        )
    };
    let msg = last_error();
    println!("result {r:?}: {msg}");
    if r != ncclResult_t::ncclInvalidUsage {
        return Err(format!("{}: returned {r:?}: {msg}", w.arg));
    }
    for needle in want {
        if !msg.contains(needle) {
            return Err(format!("the error does not name {needle}: {msg}"));
        }
    }
    let mut x = [1f32; 4];
    let xp = x.as_mut_ptr() as *mut c_void;
    let r = unsafe { ncclAllReduce(xp, xp, 4, FLOAT, SUM, c, S) };
    if r != ncclResult_t::ncclInvalidUsage {
        return Err(format!(
            "the next call on the failed communicator returned {r:?}: {}",
            last_error()
        ));
    }
    nccl!(ncclCommDestroy(c));
    Ok(())
}

#[test]
fn a_datatype_or_op_mismatch_fails_on_every_rank() {
    for (variant, env) in [
        ("dtype", vec![]),
        ("op", vec![]),
        ("dtype", vec![("COMM_SHM_DISABLE", "1")]),
        ("op", vec![("COMM_SHM_DISABLE", "1")]),
    ] {
        let mut env = env.clone();
        env.push(("COMM_TIMEOUT", "30"));
        let r = launch(
            "worker",
            "operands",
            3,
            variant,
            &env,
            Duration::from_secs(90),
        );
        assert_all_ok(&r, &format!("operands {variant} {env:?}"));
    }
}

/// A small deterministic generator, the same on every rank for one seed.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A datatype of the same size as `dt` but another type.
fn same_size_other(dt: i32) -> i32 {
    match dt {
        0 => 1,
        1 => 0,
        2 => 7,
        3 => 2,
        4 => 8,
        5 => 4,
        6 => 9,
        7 => 3,
        8 => 5,
        9 => 6,
        10 => 11,
        _ => 10,
    }
}

/// What the odd rank of a trial changes.
#[derive(Clone, Copy, Debug)]
enum Deviation {
    Datatype,
    Op,
    Count,
    Collective,
}

/// arg: the seed. Trials on a fresh child of one communicator each: a random collective,
/// datatype, op, count and placement; in about one trial of three one rank changes one of
/// them. A call that succeeds must have given the right answer for what this rank asked;
/// where the ranks disagreed, every rank must learn it with ncclInvalidUsage, from the call
/// itself or, for a rank that had nothing to receive (a broadcast's root), from its next call.
///
/// Ranks that call different collectives may each wait for a message the other never sends
/// (a reduce against a broadcast with the same root): no message of the wrong operation ever
/// arrives, so nothing but the timeout can end it, which then names who waits for whom. Such
/// trials accept ncclTimeout, on a child with a short timeout.
fn property(w: &Worker) -> Result<(), String> {
    let parent = init_rank(w)?;
    let seed: u64 = w.arg.parse().map_err(|_| "seed is not a number")?;
    let mut g = Lcg(seed);
    let n = w.nranks;
    // The collectives: send/recv match by bytes, not datatype (as NCCL's).
    let colls: Vec<Coll> = COLLS.into_iter().filter(|&c| c != Coll::SendRecv).collect();
    let (mut agreed, mut disagreed) = (0, 0);
    for trial in 0..40 {
        let coll = colls[g.below(colls.len())];
        let dt = DTYPES[g.below(DTYPES.len())].0;
        let op = OPS[g.below(OPS.len())].0;
        let count = [0, 1, 7, 3 * n + 1, 1000, 5000][g.below(6)];
        let in_place = g.below(2) == 1;
        let odd = (g.below(3) == 0 && count > 0).then(|| {
            let kinds = [
                Deviation::Datatype,
                Deviation::Op,
                Deviation::Count,
                Deviation::Collective,
            ];
            (g.below(n), kinds[g.below(kinds.len())])
        });
        let mut spec = Spec {
            coll,
            dt,
            op,
            count,
            in_place,
        };
        let mut deviation = None;
        if let Some((who, how)) = odd {
            // An op only matters where the collective reduces; another collective is drawn
            // even where it is the same one again (then no rank disagrees).
            let other = colls[g.below(colls.len())];
            let changes = match how {
                Deviation::Datatype => true,
                Deviation::Op => reduces(coll),
                Deviation::Count => true,
                Deviation::Collective => other != coll,
            };
            if changes {
                deviation = Some((who, how));
                if who == w.rank {
                    match how {
                        Deviation::Datatype => spec.dt = same_size_other(dt),
                        Deviation::Op => spec.op = if op == MAX { MIN } else { MAX },
                        // The root moves with the count (`root_for`): keep it.
                        Deviation::Count => spec.count = count + n,
                        Deviation::Collective => spec.coll = other,
                    }
                }
            }
        }
        let what = format!("trial {trial}: {spec:?}, deviation {deviation:?}");
        let mut child: ncclComm_t = std::ptr::null_mut();
        nccl!(ncclCommSplit(
            parent,
            0,
            w.rank as i32,
            &mut child,
            std::ptr::null_mut()
        ));
        nccl!(commSetTimeout(child, 5.0));
        let ctx = Ctx {
            comm: child,
            rank: w.rank,
            n,
        };
        let mut bufs = CaseBufs::new(spec.coll, spec.count, n, size_of(spec.dt));
        let case = Case::prepare(&ctx, &mut bufs, spec)?;
        // SAFETY: the case's own buffers on a live communicator.
        let r = unsafe { case.call(&ctx) };
        let msg = last_error();
        match (r, deviation) {
            (OK, None) => {
                case.check(&ctx).map_err(|e| format!("{what}: {e}"))?;
                agreed += 1;
            }
            (OK, Some(_)) => {
                // Nothing told this rank yet: its own answer must be right, and the next
                // call must fail.
                case.check(&ctx)
                    .map_err(|e| format!("{what}: succeeded with a wrong value: {e}"))?;
                let mut x = [1f32; 4];
                let xp = x.as_mut_ptr() as *mut c_void;
                let r = unsafe { ncclAllReduce(xp, xp, 4, FLOAT, SUM, child, S) };
                if !told(r, deviation) {
                    return Err(format!(
                        "{what}: the call succeeded and the next returned {r:?} ({})",
                        last_error()
                    ));
                }
                disagreed += 1;
            }
            (r, Some(_)) if told(r, deviation) => disagreed += 1,
            (r, _) => return Err(format!("{what}: returned {r:?}: {msg}")),
        }
        nccl!(ncclCommDestroy(child));
    }
    println!("{agreed} agreed, {disagreed} disagreed");
    // The parent never saw a disagreement: it still works.
    let mut x = [1f32; 4];
    let xp = x.as_mut_ptr() as *mut c_void;
    nccl!(ncclAllReduce(xp, xp, 4, FLOAT, SUM, parent, S));
    if x != [n as f32; 4] {
        return Err(format!("the parent's all-reduce gave {x:?}"));
    }
    nccl!(ncclCommDestroy(parent));
    Ok(())
}

/// Whether `r` is how a rank learns of `deviation`: ncclInvalidUsage, or, where the ranks
/// called different collectives, ncclTimeout.
fn told(r: ncclResult_t, deviation: Option<(usize, Deviation)>) -> bool {
    r == ncclResult_t::ncclInvalidUsage
        || (r == ncclResult_t::ncclTimeout && matches!(deviation, Some((_, Deviation::Collective))))
}

#[test]
fn random_disagreements_fail_everywhere_and_agreements_are_right() {
    for (n, seed, env) in [
        (3, "1", vec![]),
        (4, "2", vec![]),
        // Over TCP, with every pair connected at init: a rank whose link to the deviating
        // rank was never used learns of the disagreement from the close on that link. With
        // links made at first use (the default) such a rank may first dial the deviating
        // rank after it destroyed its communicator, and then learns only that it is gone
        // (ncclRemoteError naming it): see `transport::net::on_demand`.
        (
            3,
            "3",
            vec![("COMM_SHM_DISABLE", "1"), ("NCCL_RUNTIME_CONNECT", "0")],
        ),
    ] {
        let mut env = env.clone();
        env.push(("COMM_TIMEOUT", "30"));
        let r = launch(
            "worker",
            "property",
            n,
            seed,
            &env,
            Duration::from_secs(240),
        );
        assert_all_ok(&r, &format!("property {n} ranks seed {seed} {env:?}"));
        let summary = r[0]
            .stdout
            .lines()
            .find(|l| l.contains("agreed"))
            .unwrap_or("");
        eprintln!("{n} ranks seed {seed}: {summary}");
    }
}

scenario_tests!(SCENARIOS);
