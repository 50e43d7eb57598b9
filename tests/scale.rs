//! 128 ranks, each a process: init, every collective once with its result checked, a split,
//! destroy; and what each rank holds meanwhile. Runs bench/scale.c (the driver of
//! scripts/scale_bench.sh) built against libcomm.so of this profile (`cargo build [--release]`
//! first, as for tests/c_abi.rs).

mod common;

use common::{lib_dir, libcomm, root};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The driver, compiled once for all the tests of this file: two tests compiling it into the
/// same path at once would run one while the other writes it ("Text file busy").
fn driver() -> PathBuf {
    static DRIVER: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DRIVER.get_or_init(build_driver).clone()
}

fn build_driver() -> PathBuf {
    libcomm();
    let lib = lib_dir();
    let exe = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("comm_scale_test");
    let out = Command::new("gcc")
        .args(["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg(root().join("bench/scale.c"))
        .arg(format!("-I{}", root().join("include").display()))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lcomm")
        .output()
        .expect("run gcc");
    assert!(
        out.status.success(),
        "gcc failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// One rank's report line, as key=value pairs.
struct Report(Vec<(String, String)>);

impl Report {
    fn get(&self, k: &str) -> f64 {
        self.0
            .iter()
            .find(|(key, _)| key == k)
            .unwrap_or_else(|| panic!("no {k} in the report"))
            .1
            .parse()
            .unwrap_or(f64::NAN)
    }

    fn text(&self, k: &str) -> &str {
        &self.0.iter().find(|(key, _)| key == k).unwrap().1
    }
}

/// Runs the driver on `n` ranks with `args` and every collective checked (-c), killing it
/// after `limit`; every rank's report.
fn run(n: usize, args: &[&str], limit: Duration) -> Vec<Report> {
    let args: Vec<&str> = args.iter().copied().chain(["-c"]).collect();
    run_env(n, &args, &[], limit).0
}

/// `run` with exactly `args` and `env` added to the ranks' environment; the reports and the
/// ranks' standard error (their log).
fn run_env(
    n: usize,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> (Vec<Report>, String) {
    let mut child = Command::new(driver())
        .arg("-n")
        .arg(n.to_string())
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the scale driver");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > limit {
            // The ranks die with the driver (PR_SET_PDEATHSIG).
            let _ = child.kill();
            let _ = child.wait();
            panic!("{n} ranks {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{n} ranks {args:?}: {status}\n{err}");
    let reports: Vec<Report> = out
        .lines()
        .filter_map(|l| l.strip_prefix("scale "))
        .map(|l| {
            Report(
                l.split_whitespace()
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        })
        .collect();
    assert_eq!(
        reports.len(),
        n,
        "{n} ranks {args:?}: reports\n{out}\n{err}"
    );
    for r in &reports {
        assert_eq!(
            r.text("check"),
            "ok",
            "rank {} got wrong results",
            r.get("rank")
        );
    }
    println!(
        "{n} ranks {args:?}: {:.1} s; max init {:.0} ms, fds {}, sockets {}",
        t0.elapsed().as_secs_f64(),
        reports.iter().map(|r| r.get("init_ms")).fold(0.0, f64::max),
        reports.iter().map(|r| r.get("fds")).fold(0.0, f64::max),
        reports.iter().map(|r| r.get("sockets")).fold(0.0, f64::max),
    );
    (reports, err)
}

/// The peers rank `r` (the process `pid`) made a TCP link to, from its log (COMM_DEBUG=INFO):
/// the lines "rank r -> rank p: net/socket ..." that the transport writes when a link is made.
fn tcp_links(log: &str, pid: u64, r: u64) -> Vec<u64> {
    let want = format!("COMM INFO rank {r} -> rank ");
    let mut peers: Vec<u64> = log
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .and_then(|who| who.split(':').nth(1))
                .is_some_and(|p| p == pid.to_string())
        })
        .filter_map(|l| l.split(&want).nth(1))
        .filter_map(|rest| rest.split_once(": net/socket"))
        .filter_map(|(p, _)| p.parse().ok())
        .collect();
    peers.sort_unstable();
    peers
}

/// Every rank's TCP peers, by rank.
fn links_by_rank(reports: &[Report], log: &str) -> Vec<Vec<u64>> {
    let mut by_rank = vec![Vec::new(); reports.len()];
    for r in reports {
        let rank = r.get("rank") as u64;
        by_rank[rank as usize] = tcp_links(log, r.get("pid") as u64, rank);
    }
    by_rank
}

#[test]
fn a_hundred_and_twenty_eight_processes_on_one_host() {
    let n = 128;
    let reports = run(n, &["-H", "1"], Duration::from_secs(180));
    for r in &reports {
        let rank = r.get("rank");
        // Shared memory holds descriptors per local peer (its segment, its process);
        // anything beyond two a peer is a leak.
        let fds = r.get("fds");
        assert!(
            fds <= (2 * n + 64) as f64,
            "rank {rank} holds {fds} descriptors"
        );
        // The bootstrap's connections grow as log2 N (two a round; the parent and the split
        // half), not with N; the rest are the listeners and unix sockets of the host.
        let sockets = r.get("sockets");
        let rounds = (usize::BITS - (n - 1).leading_zeros()) as usize;
        assert!(
            sockets <= (4 * rounds + 24) as f64,
            "rank {rank} holds {sockets} sockets for {n} ranks on one host"
        );
    }
}

#[test]
fn thirty_two_processes_each_its_own_host() {
    let n = 32;
    let reports = run(n, &[], Duration::from_secs(180));
    for r in &reports {
        // Every collective runs once (-c): the all-to-all, and the one-shot algorithms of
        // small sizes, connect every pair, one socket a peer; plus the bootstrap's two a round.
        let (rank, fds) = (r.get("rank"), r.get("fds"));
        assert!(
            fds <= (2 * n + 64) as f64,
            "rank {rank} holds {fds} descriptors"
        );
    }
}

/// Only ring and tree (COMM_ALGO=ring,tree; the tuner's one-shot all-reduce of small sizes
/// reads from every rank, so it would connect every pair): an all-reduce-only job of 8 and of
/// 32 simulated hosts connects each rank to its ring and tree neighbours only, at first use,
/// and a rank's descriptors grow as the bootstrap's log2 N rounds, not with N.
#[test]
fn an_all_reduce_only_job_connects_only_its_algorithms_peers() {
    let env = [("COMM_ALGO", "ring,tree"), ("COMM_DEBUG", "INFO")];
    let mut most_fds = Vec::new();
    for n in [8usize, 32] {
        let (reports, log) = run_env(n, &["-S"], &env, Duration::from_secs(180));
        let links = links_by_rank(&reports, &log);
        for (rank, peers) in links.iter().enumerate() {
            // A ring's two neighbours and a tree's parent and two children, at most.
            assert!(
                peers.len() <= 5,
                "{n} ranks: rank {rank} connected to {peers:?}"
            );
        }
        // Each link is seen from both ends; ring and tree together have at most 2N edges,
        // every pair connected would be N(N-1)/2.
        let ends: usize = links.iter().map(|p| p.len()).sum();
        assert!(ends > 0 && ends <= 4 * n, "{n} ranks: {ends} link ends");
        for (rank, peers) in links.iter().enumerate() {
            for &p in peers {
                assert!(
                    links[p as usize].contains(&(rank as u64)),
                    "{n} ranks: rank {rank} has a link to rank {p}, which has none back"
                );
            }
        }
        let fds = reports.iter().map(|r| r.get("fds")).fold(0.0, f64::max);
        most_fds.push(fds);
    }
    // Two more bootstrap rounds (two sockets each) from 8 to 32 ranks, and a tree level.
    assert!(
        most_fds[1] <= most_fds[0] + 8.0,
        "descriptors per rank grew from {} at 8 ranks to {} at 32",
        most_fds[0],
        most_fds[1]
    );
}

/// A job in which each rank only exchanges with one peer (2k with 2k+1) connects that pair and
/// nothing else.
#[test]
fn send_recv_pairs_connect_only_their_own_peer() {
    let n = 8;
    let env = [("COMM_DEBUG", "INFO")];
    let (reports, log) = run_env(n, &["-p"], &env, Duration::from_secs(120));
    for (rank, peers) in links_by_rank(&reports, &log).iter().enumerate() {
        assert_eq!(peers, &vec![(rank ^ 1) as u64], "rank {rank}'s TCP links");
    }
}

/// NCCL_RUNTIME_CONNECT=0: every rank connects to every other at init, used or not.
#[test]
fn runtime_connect_0_connects_every_peer_at_init() {
    let n = 8;
    let env = [
        ("NCCL_RUNTIME_CONNECT", "0"),
        ("COMM_ALGO", "ring,tree"),
        ("COMM_DEBUG", "INFO"),
    ];
    let (reports, log) = run_env(n, &["-S"], &env, Duration::from_secs(120));
    for (rank, peers) in links_by_rank(&reports, &log).iter().enumerate() {
        let all: Vec<u64> = (0..n as u64).filter(|&p| p != rank as u64).collect();
        assert_eq!(peers, &all, "rank {rank}'s TCP links");
    }
}
