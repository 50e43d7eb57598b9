//! An init whose ranks have not all arrived says so after COMM_WARN_AFTER, long before
//! COMM_INIT_TIMEOUT: it names the missing ranks and the root's address, and says when the ranks
//! seem to have each called ncclGetUniqueId for themselves instead of sharing rank 0's id.
//!
//! One test in its own binary: the logger reads COMM_DEBUG and COMM_DEBUG_FILE once per process,
//! so they are set before anything logs.

use comm::ffi::types::*;
use comm::ffi::*;
use std::time::{Duration, Instant};

#[test]
fn ranks_that_made_their_own_ids_are_told_so_after_warn_after() {
    let dir = std::env::temp_dir().join(format!("comm-init-warning-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("log");
    // Edition 2021: set_var is safe; no other thread runs yet.
    std::env::set_var("COMM_DEBUG", "WARN");
    std::env::set_var("COMM_DEBUG_FILE", &log);
    std::env::set_var("COMM_WARN_AFTER", "1");
    std::env::set_var("COMM_INIT_TIMEOUT", "4");

    let started = Instant::now();
    // The mistake: each rank makes a unique id of its own instead of receiving rank 0's.
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut id = ncclUniqueId {
                    internal: [0; NCCL_UNIQUE_ID_BYTES],
                };
                // SAFETY: out-parameters on the stack.
                unsafe {
                    assert_eq!(ncclGetUniqueId(&mut id), ncclResult_t::ncclSuccess);
                    let mut c: ncclComm_t = std::ptr::null_mut();
                    ncclCommInitRank(&mut c, 2, id, rank)
                }
            })
        })
        .collect();
    for r in ranks {
        assert_ne!(r.join().unwrap(), ncclResult_t::ncclSuccess);
    }
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");

    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in the log:\n{text}"))
            .to_string()
    };
    let one = line("rank 1 of 2: init has waited");
    assert!(one.contains(" WARN "), "{one}");
    // The root's words: who is missing, and where.
    assert!(
        one.contains("rank 0 of 2 never arrived at the bootstrap root "),
        "{one}"
    );
    assert!(
        one.contains("each called ncclGetUniqueId for themselves"),
        "{one}"
    );
    assert!(one.contains("COMM_INIT_TIMEOUT (4 s)"), "{one}");
    let zero = line("rank 0 of 2: init has waited");
    assert!(
        zero.contains("rank 1 of 2 never arrived at the bootstrap root "),
        "{zero}"
    );
    assert!(
        zero.contains("no other rank has reached this root"),
        "{zero}"
    );
    // Before the timeout, not with it.
    assert!(text.find(&one).unwrap() < text.find("timed out").unwrap_or(usize::MAX));
}
