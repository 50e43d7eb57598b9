//! Shared helpers for the multi-rank tests: launching ranks as processes (the test binary
//! re-executes itself) or as threads (ncclCommInitAll), datatypes as test values, and checks.
#![allow(dead_code)]

pub mod cases;
pub mod hosts;
pub mod ibmodel;
pub mod run;
pub mod values;

use comm::ffi::types::*;
use comm::ffi::*;
use std::ffi::CStr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const OK: ncclResult_t = ncclResult_t::ncclSuccess;

/// The two tests every table of named scenarios has: `worker`, which a launched rank runs (it
/// finds its scenario by the name `launch` gave it and exits with the outcome), and a check
/// that the table's names are distinct.
#[macro_export]
macro_rules! scenario_tests {
    ($table:expr) => {
        #[test]
        fn worker() {
            if let Some(w) = worker_env() {
                finish(find_scenario($table, &w.scenario).and_then(|run| run(&w)));
            }
        }

        #[test]
        fn scenario_names_are_distinct() {
            assert_distinct_names($table);
        }
    };
}

/// Fails with the library's last error message when a call does not return `ncclSuccess`.
#[macro_export]
macro_rules! nccl {
    ($e:expr) => {{
        // Test code calls the C ABI as C would; the macro saves an unsafe block per call.
        #[allow(unused_unsafe, clippy::macro_metavars_in_unsafe)]
        // SAFETY: `$e` is a C API call whose arguments the test made for it.
        let r = unsafe { $e };
        if r != comm::ffi::types::ncclResult_t::ncclSuccess {
            return Err(format!(
                "{} returned {:?}: {}",
                stringify!($e),
                r,
                $crate::common::last_error()
            ));
        }
    }};
}

pub fn last_error() -> String {
    // SAFETY: ncclGetLastError returns a NUL-terminated string that stays valid for a while.
    unsafe { CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

pub fn unique_id() -> ncclUniqueId {
    let mut id = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a local out-parameter of the right type.
    let r = unsafe { ncclGetUniqueId(&mut id) };
    assert_eq!(r, OK, "ncclGetUniqueId: {}", last_error());
    id
}

pub fn id_to_hex(id: &ncclUniqueId) -> String {
    id.internal
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect()
}

pub fn id_from_hex(s: &str) -> ncclUniqueId {
    let mut id = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    for (i, c) in id.internal.iter_mut().enumerate() {
        *c = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap() as std::os::raw::c_char;
    }
    id
}

/// An ncclConfig_t as NCCL_CONFIG_INITIALIZER makes it, with `blocking` and a name set.
pub fn config(blocking: i32, name: &'static CStr) -> ncclConfig_t {
    let undef = i32::MIN;
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafebeef,
        version: NCCL_VERSION_CODE as u32,
        blocking,
        cgaClusterSize: undef,
        minCTAs: undef,
        maxCTAs: undef,
        netName: std::ptr::null(),
        splitShare: undef,
        trafficClass: undef,
        commName: name.as_ptr(),
        collnetEnable: undef,
        CTAPolicy: undef,
        shrinkShare: undef,
        nvlsCTAs: undef,
        nChannelsPerNetPeer: undef,
        nvlinkCentricSched: undef,
        graphUsageMode: undef,
        numRmaCtx: undef,
        maxP2pPeers: undef,
        graphStreamOrdering: undef,
    }
}

/// What a call on `comm` that returned `r` came to: where it returned ncclInProgress (a
/// non-blocking communicator), ncclCommGetAsyncError is polled until it reports anything else
/// (for at most `limit`).
pub fn settled(comm: ncclComm_t, r: ncclResult_t, limit: Duration) -> ncclResult_t {
    if r != ncclResult_t::ncclInProgress {
        return r;
    }
    let t = std::time::Instant::now();
    loop {
        let mut state = ncclResult_t::ncclInternalError;
        // SAFETY: `comm` is the caller's live communicator; `state` is a local out-parameter.
        let q = unsafe { ncclCommGetAsyncError(comm, &mut state) };
        if q != OK {
            return q;
        }
        if state != ncclResult_t::ncclInProgress || t.elapsed() > limit {
            return state;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The environment a worker process finds: which scenario, its rank, the rank count, the id.
pub struct Worker {
    pub scenario: String,
    pub rank: usize,
    pub nranks: usize,
    pub id: ncclUniqueId,
    pub arg: String,
}

/// The id a launcher passed, or, where it passed none (all zeros: ranks on simulated hosts,
/// which cannot share one made here), the id every rank derives from NCCL_COMM_ID and
/// COMM_SECRET.
fn launched_id(hex: &str) -> ncclUniqueId {
    if hex.bytes().all(|b| b == b'0') && std::env::var("NCCL_COMM_ID").is_ok() {
        unique_id()
    } else {
        id_from_hex(hex)
    }
}

/// When this process was launched as a rank, describes it.
pub fn worker_env() -> Option<Worker> {
    let scenario = std::env::var("COMM_TEST_SCENARIO").ok()?;
    Some(Worker {
        scenario,
        rank: std::env::var("COMM_TEST_RANK").ok()?.parse().ok()?,
        nranks: std::env::var("COMM_TEST_NRANKS").ok()?.parse().ok()?,
        id: launched_id(&std::env::var("COMM_TEST_ID").ok()?),
        arg: std::env::var("COMM_TEST_ARG").unwrap_or_default(),
    })
}

pub fn init_rank(w: &Worker) -> Result<ncclComm_t, String> {
    let mut c: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommInitRank(
        &mut c,
        w.nranks as i32,
        w.id,
        w.rank as i32
    ));
    Ok(c)
}

/// Rank 1's init fails just after it announced its shared-memory segment, while its process
/// lives on for `linger` (an exit would be seen by the others as one): every rank's init must
/// fail within 5 s, rank 1 naming the injected fault and the others saying `others_say`.
pub fn a_peers_init_fails(w: &Worker, others_say: &str, linger: Duration) -> Result<(), String> {
    if w.rank == 1 {
        std::env::set_var("COMM_FAULT_INJECT", "shm:announced:fail");
    }
    let t = Instant::now();
    let mut c: ncclComm_t = std::ptr::null_mut();
    // SAFETY: plain init; the handle is only written on success.
    let r = unsafe { ncclCommInitRank(&mut c, w.nranks as i32, w.id, w.rank as i32) };
    let (took, msg) = (t.elapsed(), last_error());
    if r == OK {
        return Err("init succeeded though rank 1's failed".into());
    }
    let want = if w.rank == 1 {
        "COMM_FAULT_INJECT"
    } else {
        others_say
    };
    if !msg.contains(want) || took > Duration::from_secs(5) {
        return Err(format!("{r:?} after {took:?}: {msg}"));
    }
    if w.rank == 1 {
        std::thread::sleep(linger);
    }
    Ok(())
}

/// What one rank process printed and how it ended.
pub struct RankResult {
    pub rank: usize,
    pub status: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl RankResult {
    pub fn ok(&self) -> bool {
        self.status == Some(0)
    }
}

/// Launches `nranks` processes of this test binary running `entry` (a #[test] that calls
/// `run_worker`), with scenario `scenario`. Kills them all after `timeout`.
pub fn launch(
    entry: &str,
    scenario: &str,
    nranks: usize,
    arg: &str,
    env: &[(&str, &str)],
    timeout: Duration,
) -> Vec<RankResult> {
    launch_ranks(
        entry,
        scenario,
        nranks,
        &(0..nranks).collect::<Vec<_>>(),
        arg,
        env,
        timeout,
    )
}

/// Like `launch`, for a subset of the ranks of an `nranks` communicator (the others never come).
pub fn launch_ranks(
    entry: &str,
    scenario: &str,
    nranks: usize,
    ranks: &[usize],
    arg: &str,
    env: &[(&str, &str)],
    timeout: Duration,
) -> Vec<RankResult> {
    let id = unique_id();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<(usize, Child)> = ranks
        .iter()
        .map(|&rank| {
            let mut cmd = Command::new(&exe);
            cmd.args([entry, "--exact", "--nocapture", "--test-threads=1"])
                .env("COMM_TEST_SCENARIO", scenario)
                .env("COMM_TEST_RANK", rank.to_string())
                .env("COMM_TEST_NRANKS", nranks.to_string())
                .env("COMM_TEST_ID", id_to_hex(&id))
                .env("COMM_TEST_ARG", arg)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                cmd.env(k, v);
            }
            (rank, cmd.spawn().expect("spawn rank process"))
        })
        .collect();
    collect(
        children,
        timeout,
        &format!("{scenario} with {nranks} ranks"),
    )
}

/// Waits for rank processes (rank, child), killing them all after `timeout`; panics with
/// every rank's output when they did not finish in time.
pub fn collect(
    mut children: Vec<(usize, Child)>,
    timeout: Duration,
    what: &str,
) -> Vec<RankResult> {
    let deadline = Instant::now() + timeout;
    let mut statuses: Vec<Option<i32>> = vec![None; children.len()];
    let mut timed_out = false;
    loop {
        let mut all = true;
        for (i, (_, c)) in children.iter_mut().enumerate() {
            if statuses[i].is_none() {
                match c.try_wait().unwrap() {
                    Some(s) => statuses[i] = Some(s.code().unwrap_or(-1)),
                    None => all = false,
                }
            }
        }
        if all {
            break;
        }
        if Instant::now() > deadline {
            timed_out = true;
            for (_, c) in children.iter_mut() {
                let _ = c.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let results: Vec<RankResult> = children
        .into_iter()
        .zip(statuses)
        .map(|((rank, c), status)| {
            let out = c.wait_with_output().unwrap();
            RankResult {
                rank,
                status: if timed_out && status.is_none() {
                    None
                } else {
                    status.or(out.status.code())
                },
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }
        })
        .collect();
    if timed_out {
        for r in &results {
            eprintln!(
                "--- rank {} (status {:?}) stdout:\n{}\n--- stderr:\n{}",
                r.rank, r.status, r.stdout, r.stderr
            );
        }
        panic!("{what} did not finish within {timeout:?}");
    }
    results
}

/// Asserts every rank exited 0, printing the output of those that did not.
pub fn assert_all_ok(results: &[RankResult], what: &str) {
    let bad: Vec<&RankResult> = results.iter().filter(|r| !r.ok()).collect();
    for r in &bad {
        eprintln!(
            "--- rank {} exited {:?}\nstdout:\n{}\nstderr:\n{}",
            r.rank, r.status, r.stdout, r.stderr
        );
    }
    assert!(
        bad.is_empty(),
        "{what}: {} of {} ranks failed",
        bad.len(),
        results.len()
    );
}

/// Runs a worker body and exits the process with its outcome (0 = pass).
pub fn finish(result: Result<(), String>) -> ! {
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            println!("FAILED: {e}");
            std::process::exit(1)
        }
    }
}

/// A rank process's scenario: what the rank does once launched, Err when a check failed.
pub type Scenario = fn(&Worker) -> Result<(), String>;

/// The entry of `table` called `name`. Test files list their scenarios as (name, body) pairs,
/// so adding one is adding an entry; a name missing from the table is an error that lists the
/// ones there are (a launcher and its table that drifted apart).
pub fn find_scenario<F: Copy>(table: &[(&str, F)], name: &str) -> Result<F, String> {
    match table.iter().find(|(n, _)| *n == name) {
        Some((_, f)) => Ok(*f),
        None => Err(format!(
            "unknown scenario {name:?}; this test binary has {}",
            table.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// Runs `body` (comm, rank, nranks) on a fresh communicator of every launched rank, then
/// destroys it: the scenario of a body that the thread tests run as well.
pub fn on_comm(
    w: &Worker,
    body: fn(ncclComm_t, usize, usize) -> Result<(), String>,
) -> Result<(), String> {
    let c = init_rank(w)?;
    body(c, w.rank, w.nranks)?;
    nccl!(ncclCommDestroy(c));
    Ok(())
}

/// Panics unless every name of a scenario table is distinct (a duplicate would shadow the
/// later entry without a word).
pub fn assert_distinct_names<F>(table: &[(&str, F)]) {
    for (i, (a, _)) in table.iter().enumerate() {
        assert!(
            table[..i].iter().all(|(b, _)| a != b),
            "scenario {a:?} is listed twice"
        );
    }
}

/// Runs `body` on `n` ranks that are threads of this process (ncclCommInitAll), with a timeout.
pub fn with_threads(
    n: usize,
    timeout: Duration,
    body: impl Fn(ncclComm_t, usize, usize) -> Result<(), String> + Send + Sync + 'static,
) {
    with_threads_on(None, n, timeout, body)
}

/// `with_threads`, with rank r's communicator on GPU `devs[r]` where `devs` is given (the
/// device list of ncclCommInitAll).
#[allow(dead_code)]
pub fn with_threads_on(
    devs: Option<&[i32]>,
    n: usize,
    timeout: Duration,
    body: impl Fn(ncclComm_t, usize, usize) -> Result<(), String> + Send + Sync + 'static,
) {
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); n];
    let list = devs.map_or(std::ptr::null(), |d| d.as_ptr());
    // SAFETY: `comms` has room for `n` communicators; `list` is null or `devs`, one device per
    // rank as callers give it.
    let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), n as i32, list) };
    assert_eq!(r, OK, "ncclCommInitAll: {}", last_error());
    let body = std::sync::Arc::new(body);
    let (tx, rx) = std::sync::mpsc::channel();
    for (rank, c) in comms.iter().enumerate() {
        let c = *c as usize;
        let tx = tx.clone();
        let body = body.clone();
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                body(c as ncclComm_t, rank, n)
            }))
            .unwrap_or_else(|_| Err("panicked".into()));
            let _ = tx.send((rank, r));
        });
    }
    let deadline = Instant::now() + timeout;
    let mut failures = Vec::new();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Err(e))) => failures.push(format!("rank {rank}: {e}")),
            Ok(_) => {}
            Err(_) => {
                panic!("threads did not finish within {timeout:?}; failures so far: {failures:?}")
            }
        }
    }
    for c in comms {
        // SAFETY: `c` came from ncclCommInitAll above and is destroyed once, its threads done.
        unsafe { ncclCommDestroy(c) };
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The repository (this crate's manifest directory).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// target/<profile>, where cargo puts libcomm.so for the profile these tests were built with.
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// libcomm.so of this profile; fails the test, saying how to build it, when it is missing.
pub fn libcomm() -> PathBuf {
    let p = lib_dir().join("libcomm.so");
    assert!(
        p.exists(),
        "{} is missing: build the library first (`cargo build{}`; scripts/test.sh does)",
        p.display(),
        if cfg!(debug_assertions) {
            ""
        } else {
            " --release"
        }
    );
    p
}
