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

/// Runs the driver on `n` ranks with `args`, killing it after `limit`; every rank's report.
fn run(n: usize, args: &[&str], limit: Duration) -> Vec<Report> {
    let mut child = Command::new(driver())
        .arg("-n")
        .arg(n.to_string())
        .args(args)
        .arg("-c")
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
    reports
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
        // Over TCP every rank still connects to every other at init: one socket a peer, and
        // the bootstrap's two a round.
        let (rank, fds) = (r.get("rank"), r.get("fds"));
        assert!(
            fds <= (2 * n + 64) as f64,
            "rank {rank} holds {fds} descriptors"
        );
    }
}
