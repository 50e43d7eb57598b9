//! Simulated hosts for multi-host tests: network namespaces made by `scripts/netns.sh`, each
//! with its own address and its own PID, IPC and mount namespaces, linked only through veth
//! pairs and a bridge. `Hosts` removes them when dropped, passed or failed.

use super::*;
use comm::ffi::types::NCCL_UNIQUE_ID_BYTES;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/netns.sh")
}

/// What every rank of one launch runs.
pub struct Job<'a> {
    nranks: usize,
    scenario: &'a str,
    arg: &'a str,
    env: &'a [(&'a str, &'a str)],
    /// The bootstrap root's port on host 0 (NCCL_COMM_ID).
    port: u16,
}

/// Simulated hosts; removed on drop.
pub struct Hosts {
    pub prefix: String,
    n: usize,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

impl Hosts {
    /// `n` hosts, or None (with the reason printed) where namespaces cannot be made here.
    pub fn up(n: usize) -> Option<Hosts> {
        // SAFETY: geteuid takes nothing and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let ip = Command::new("ip").arg("-V").output().is_ok();
        if !root || !ip {
            let why = format!("multi-host tests need root and iproute2 (root: {root}, ip: {ip})");
            assert!(std::env::var("CI").is_err(), "{why}");
            eprintln!("skipped: {why}");
            return None;
        }
        let prefix = format!(
            "cmh{}x{}",
            std::process::id() % 100_000,
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let hosts = Hosts { prefix, n };
        let st = Command::new(script())
            .args(["up", &hosts.prefix, &n.to_string()])
            .status()
            .expect("run netns.sh");
        assert!(st.success(), "netns.sh up failed");
        Some(hosts)
    }

    pub fn count(&self) -> usize {
        self.n
    }

    pub fn addr(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    pub fn run(&self, args: &[&str]) {
        let st = Command::new(script())
            .arg(args[0])
            .arg(&self.prefix)
            .args(&args[1..])
            .status()
            .expect("run netns.sh");
        assert!(st.success(), "netns.sh {args:?} failed");
    }

    /// Starts rank `rank` of `job` on host `host`.
    pub fn spawn(&self, host: usize, rank: usize, job: &Job) -> Child {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(script());
        // nsenter stops itself when its child stops (as a shell would, for job control) and
        // then never reaps it: a rank frozen by a fault test, then killed, would leave it
        // stopped for good. A shell in between waits only for the rank's exit.
        cmd.args(["exec", &self.prefix, &host.to_string()])
            .args(["sh", "-c", "\"$0\" \"$@\" & wait $!"])
            .arg(exe)
            .args(["worker", "--exact", "--nocapture", "--test-threads=1"])
            .env("COMM_TEST_SCENARIO", job.scenario)
            .env("COMM_TEST_RANK", rank.to_string())
            .env("COMM_TEST_NRANKS", job.nranks.to_string())
            .env("COMM_TEST_ID", "00".repeat(NCCL_UNIQUE_ID_BYTES))
            .env("COMM_TEST_ARG", job.arg)
            .env("COMM_TEST_HOST", host.to_string())
            .env("NCCL_COMM_ID", format!("{}:{}", self.addr(0), job.port))
            .env("COMM_SECRET", format!("{}-{}", self.prefix, job.port))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in job.env {
            cmd.env(k, v);
        }
        cmd.spawn().expect("spawn a rank in a namespace")
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = Command::new(script()).args(["down", &self.prefix]).status();
    }
}

/// Runs `per_host[h]` ranks on each host h (ranks numbered host by host) and waits for all,
/// killing everything after `timeout`. `during` runs once the ranks are started.
pub fn launch_on(
    hosts: &Hosts,
    per_host: &[usize],
    scenario: &str,
    arg: &str,
    env: &[(&str, &str)],
    timeout: Duration,
    during: impl FnOnce(),
) -> Vec<RankResult> {
    let host_of: Vec<usize> = per_host
        .iter()
        .enumerate()
        .flat_map(|(h, &k)| std::iter::repeat_n(h, k))
        .collect();
    launch_at(hosts, &host_of, scenario, arg, env, timeout, during)
}

/// Like `launch_on`, with rank r on host `host_of[r]` (rank 0 must be on host 0, where the
/// bootstrap root listens).
pub fn launch_at(
    hosts: &Hosts,
    host_of: &[usize],
    scenario: &str,
    arg: &str,
    env: &[(&str, &str)],
    timeout: Duration,
    during: impl FnOnce(),
) -> Vec<RankResult> {
    assert_eq!(host_of.first(), Some(&0), "rank 0 must be on host 0");
    let nranks = host_of.len();
    let port =
        20000 + (std::process::id() % 20000) as u16 + NEXT.fetch_add(1, Ordering::SeqCst) as u16;
    let job = Job {
        nranks,
        scenario,
        arg,
        env,
        port,
    };
    let children = host_of
        .iter()
        .enumerate()
        .map(|(rank, &h)| (rank, hosts.spawn(h, rank, &job)))
        .collect();
    during();
    collect(
        children,
        timeout,
        &format!("{scenario} with ranks on hosts {host_of:?}"),
    )
}
