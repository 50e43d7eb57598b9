//! The TCP transport between simulated hosts (network namespaces, `scripts/netns.sh`): hostile
//! connections to the connection service it sets up through (the bootstrap's listener), and
//! several sockets per peer.
//!
//! Needs root and iproute2 (CI has both). Without them each test says so and passes only when
//! not in CI; in CI (CI=true) a missing prerequisite fails the test. Every launch has a
//! timeout, and every simulated host is removed when its test ends.

// The unsafe blocks here call the library's C API (ncclX/commX) with arguments the test
// itself made; what each call needs is in the C API's documentation, not repeated per block.
#![allow(clippy::undocumented_unsafe_blocks)]

mod common;

use common::cases::*;
use common::hosts::*;
use common::run::*;
use common::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const FLOAT: i32 = 7;
const INT32: i32 = 2;
const SUM: i32 = 0;
const MAX: i32 = 2;

/// How long the service gives a connection to finish its handshake.
const HANDSHAKE: Duration = Duration::from_secs(5);

/// Handshakes the service keeps going at once (the bootstrap listener's MAX_PENDING).
const MAX_PENDING: usize = 1024;

/// Silent connections the attacker holds open: more than the service handshakes with at once,
/// where the descriptor limit lets it (see `silent_count`).
const SILENT: usize = 1100;

/// This process's hard limit on descriptors, which the attacker (a child) inherits.
fn nofile_hard() -> libc::rlim_t {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a local rlimit the call fills in.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    lim.rlim_max
}

/// How many silent connections the attacker makes: SILENT, or fewer where its hard descriptor
/// limit would not allow that many (then the service is not crowded past MAX_PENDING, and only
/// the rest is checked).
fn silent_count() -> usize {
    SILENT.min((nofile_hard() as usize).saturating_sub(64))
}

// ---------------------------------------------------------------------------------------------
// Rank side

/// Every scenario by name: `launch` names one, the worker runs it (the attacker is no rank).
const SCENARIOS: &[(&str, Scenario)] = &[("hostile", hostile), ("split_messages", split_messages)];

#[test]
fn worker() {
    if let Ok(base) = std::env::var("COMM_TEST_ATTACK") {
        finish(attacker(&base));
    }
    if let Some(w) = worker_env() {
        finish(find_scenario(SCENARIOS, &w.scenario).and_then(|run| run(&w)));
    }
}

#[test]
fn scenario_names_are_distinct() {
    assert_distinct_names(SCENARIOS);
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Polls `what` every 20 ms until it gives a value or `limit` passes.
fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T, String> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if start.elapsed() > limit {
            return Err(format!("waited {limit:?} for {what}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every collective, float sum of 1001 elements out of place and int32 max of a large odd
/// count in place, each checked element by element.
fn each_collective(ctx: &Ctx) -> Result<(), String> {
    for coll in COLLS {
        run_case(ctx, coll, FLOAT, SUM, 1001, false)?;
        run_case(ctx, coll, INT32, MAX, (1 << 18) + 7, coll != Coll::SendRecv)?;
    }
    Ok(())
}

/// arg: a path prefix for the files the ranks and the attacker share. The ranks log to
/// `<arg>.log` (COMM_DEBUG_FILE), where rank 1's TCP transport says where it takes its
/// connections (the bootstrap's service) and under which tag. Rank 0
/// freezes itself
/// once every listener is published (COMM_FAULT_INJECT=net:published:stop), after starting an
/// attacker process of its own, which goes at rank 1's listener while rank 1 waits for rank 0
/// and then lets rank 0 go on (SIGCONT), noting when in `<arg>.released`.
fn hostile(w: &Worker) -> Result<(), String> {
    let base = w.arg.clone();
    let mut attacker = None;
    if w.rank == 0 {
        std::env::set_var("COMM_FAULT_INJECT", "net:published:stop");
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["worker", "--exact", "--nocapture", "--test-threads=1"])
            .env("COMM_TEST_ATTACK", &base)
            .spawn()
            .map_err(|e| format!("start the attacker: {e}"))?;
        attacker = Some(child);
    } else if let Ok(n) = std::env::var("COMM_TEST_NOFILE") {
        // Fewer descriptors than the attacker's connections: the listener runs out of them.
        let n: u64 = n.parse().unwrap();
        let lim = libc::rlimit {
            rlim_cur: n,
            rlim_max: n,
        };
        // SAFETY: `lim` is a local, initialised rlimit the call only reads.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(format!("setrlimit: {}", std::io::Error::last_os_error()));
        }
    }
    let c = init_rank(w)?;
    let released = std::fs::read_to_string(format!("{base}.released"))
        .map_err(|e| format!("the attacker never released rank 0: {e}"))?;
    let took = Duration::from_nanos(
        now_ns().saturating_sub(released.trim().parse::<u128>().unwrap()) as u64,
    );
    println!(
        "rank {}: init finished {took:?} after rank 0 was released",
        w.rank
    );
    // The attacker's silent connections are still open: they must not have held setup up. A
    // listener that served them one at a time would have waited for each until the handshake
    // limit: the bound is half of that, and setup takes milliseconds.
    if took >= HANDSHAKE / 2 {
        return Err(format!(
            "setup took {took:?} after the real peer was released: the hostile connections held it up"
        ));
    }
    let ctx = Ctx {
        comm: c,
        rank: w.rank,
        n: w.nranks,
    };
    // TCP links connect at first use: rank 0 dials rank 1 in the first collective, while
    // the attacker's silent connections are still open, and the attacker waits for that.
    // The second round keeps rank 1's service up until the attacker is done with it, so that
    // every silent connection is refused in the log.
    each_collective(&ctx)?;
    if let Some(mut child) = attacker {
        let status = wait_for(Duration::from_secs(60), "the attacker to exit", || {
            child.try_wait().ok().flatten()
        });
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                let _ = child.kill();
                return Err(e);
            }
        };
        if !status.success() {
            return Err(format!(
                "the attacker failed ({status}); see its output above"
            ));
        }
    }
    each_collective(&ctx)?;
    nccl!(comm::ffi::ncclCommDestroy(c));
    Ok(())
}

/// What a connection to the service says it is for: the bootstrap's peer context for a TCP
/// transport socket (purpose 4) from rank `from` to rank 1.
fn context(tag: u64, from: u32, socket: u64) -> Vec<u8> {
    let mut b = b"comm-peer-v1".to_vec();
    b.extend_from_slice(&tag.to_le_bytes());
    b.push(4);
    b.extend_from_slice(&socket.to_le_bytes());
    b.extend_from_slice(&from.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes());
    b
}

/// The first message of the handshake: magic, version, the context and a client nonce.
fn hello(ctx: &[u8]) -> Vec<u8> {
    let mut auth = b"COMMAUTH".to_vec();
    auth.extend_from_slice(&1u16.to_le_bytes());
    auth.extend_from_slice(&(ctx.len() as u16).to_le_bytes());
    auth.extend_from_slice(&[7u8; 32]);
    auth.extend_from_slice(ctx);
    auth
}

/// The listener must close `s`: reads until the end of the stream, at most 10 s. Returns what
/// the listener said before closing.
fn expect_closed(mut s: TcpStream, what: &str) -> Result<Vec<u8>, String> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut said = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok(said),
            Ok(n) => said.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(said),
            Err(e) => {
                return Err(format!(
                    "{what}: the listener kept the connection open ({e})"
                ))
            }
        }
    }
}

fn dial(addr: SocketAddr, bytes: &[u8]) -> Result<TcpStream, String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    s.write_all(bytes).map_err(|e| format!("write: {e}"))?;
    Ok(s)
}

/// The attacker: finds rank 1's service in its log, waits until rank 0 is frozen, connects
/// in every wrong way, releases rank 0 and checks that the service still refuses garbage after
/// setup (it stays up, for connections made on demand).
fn attacker(base: &str) -> Result<(), String> {
    // SAFETY: getppid takes nothing and cannot fail.
    let parent = unsafe { libc::getppid() };
    let log = format!("{base}.log");
    let outcome = attack_and_release(base, parent, &log);
    // Whatever went wrong, rank 0 must not stay frozen.
    // SAFETY: kill takes a pid and a signal number and touches no memory of ours.
    unsafe { libc::kill(parent, libc::SIGCONT) };
    outcome
}

fn attack_and_release(base: &str, parent: i32, log: &str) -> Result<(), String> {
    let (tag, addr) = wait_for(Duration::from_secs(60), "rank 1's service", || {
        let text = std::fs::read_to_string(log).ok()?;
        let line = text
            .lines()
            .find(|l| l.contains("rank 1: TCP transport") && l.contains("listening on "))?;
        let tag = line.split("service of communicator ").nth(1)?.get(..16)?;
        let addr = line.split("listening on ").nth(1)?.trim();
        Some((
            u64::from_str_radix(tag, 16).ok()?,
            addr.parse::<SocketAddr>().ok()?,
        ))
    })?;
    println!("attacker: rank 1's service listens on {addr} for communicator {tag:016x}");
    wait_for(Duration::from_secs(60), "rank 0 to freeze", || {
        let stat = std::fs::read_to_string(format!("/proc/{parent}/stat")).ok()?;
        let state = stat.rsplit(')').next()?.split_whitespace().next()?;
        (state == "T").then_some(())
    })?;
    let outcome = attack(tag, addr);
    let made = Instant::now();
    std::fs::write(format!("{base}.released"), now_ns().to_string()).unwrap();
    // SAFETY: kill takes a pid and a signal number and touches no memory of ours.
    unsafe { libc::kill(parent, libc::SIGCONT) };
    let held = outcome?;
    // Setup ends when rank 1 has its link to rank 0; the service stays up for the
    // communicator's life, and still refuses what does not authenticate.
    wait_for(Duration::from_secs(60), "rank 1's link to rank 0", || {
        let text = std::fs::read_to_string(log).ok()?;
        text.contains("rank 1 -> rank 0: net/socket").then_some(())
    })?;
    let s = dial(addr, b"GET / HTTP/1.1\r\nHost: comm\r\n\r\n")?;
    expect_closed(s, "garbage after setup")?;
    // Held open until the service has dropped every one (at its handshake deadline at the
    // latest), so that each is refused for being silent, not for closing.
    std::thread::sleep((HANDSHAKE + Duration::from_secs(1)).saturating_sub(made.elapsed()));
    drop(held);
    println!("attacker: every attack refused, during and after setup");
    Ok(())
}

/// Each attack in turn, the silent connections last; returns those, which stay open until
/// after setup.
fn attack(tag: u64, addr: SocketAddr) -> Result<Vec<TcpStream>, String> {
    // (b) Garbage.
    let s = dial(addr, b"GET / HTTP/1.1\r\nHost: comm\r\n\r\n")?;
    expect_closed(s, "garbage")?;
    // (c) A well-formed hello for another communicator.
    let s = dial(addr, &hello(&context(tag ^ 0x5a5a, 0, 0)))?;
    expect_closed(s, "another communicator's tag")?;
    // (d) The right tag and a rank of the communicator, but no knowledge of the secret: the
    // server's challenge is answered with a proof made up of nothing.
    let mut s = dial(addr, &hello(&context(tag, 0, 0)))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut challenge = [0u8; 65];
    s.read_exact(&mut challenge)
        .map_err(|e| format!("wrong secret: no challenge from the listener: {e}"))?;
    if challenge[0] != 1 {
        return Err(format!(
            "wrong secret: the listener refused before the proof (status {})",
            challenge[0]
        ));
    }
    let mut proof = vec![1u8];
    proof.extend_from_slice(&[0x42; 32]);
    s.write_all(&proof).map_err(|e| format!("write: {e}"))?;
    let said = expect_closed(s, "wrong secret")?;
    // 4: the listener checked the proof and found it wrong.
    if said != [4] {
        return Err(format!(
            "wrong secret: the listener answered {said:?}, not [4]"
        ));
    }
    // (e) Ranks that cannot be: the service's own rank, and one beyond the communicator.
    for rank in [1, 7] {
        let s = dial(addr, &hello(&context(tag, rank, 0)))?;
        expect_closed(s, &format!("rank {rank}, not a peer"))?;
    }
    // More descriptors than a default soft limit gives.
    // SAFETY: `lim` is a local rlimit the call reads.
    unsafe {
        let lim = libc::rlimit {
            rlim_cur: nofile_hard(),
            rlim_max: nofile_hard(),
        };
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    // (a) Half-open: connected, silent, held open through setup. Made last, just before rank 0
    // is released, so that a listener that served connections one at a time would make the
    // real peer wait behind them; and more of them than the listener handshakes with at once,
    // so that it must drop some to make room (never the real peer's).
    let mut silent = Vec::new();
    for _ in 0..silent_count() {
        silent.push(dial(addr, &[])?);
    }
    std::thread::sleep(Duration::from_millis(200));
    Ok(silent)
}

/// arg: sockets per peer. All-reduce and all-gather with sizes around the point where messages
/// are cut across the sockets, and counts that do and do not divide by the number of sockets;
/// checked element by element, in and out of place; then every socket must have carried data.
fn split_messages(w: &Worker) -> Result<(), String> {
    let c = init_rank(w)?;
    let ctx = Ctx {
        comm: c,
        rank: w.rank,
        n: w.nranks,
    };
    for count in [7, 50_001, 300_001, 1 << 20, (1 << 20) + 3, 4 << 20] {
        for coll in [Coll::AllReduce, Coll::AllGather] {
            for in_place in [false, true] {
                run_case(&ctx, coll, FLOAT, SUM, count, in_place)?;
            }
        }
    }
    run_case(&ctx, Coll::AllReduce, INT32, MAX, (1 << 20) + 1, false)?;
    // Large messages went over every socket: count this host's connections to the other
    // host that carried more than 1 MiB (the bootstrap's carry far less).
    let want: usize = w.arg.parse().unwrap();
    let busy = busy_connections(if w.rank == 0 {
        "10.77.0.2"
    } else {
        "10.77.0.1"
    })?;
    println!("rank {}: {busy} connections sent more than 1 MiB", w.rank);
    // Neither rank closes its connections before both have counted.
    run_case(&ctx, Coll::AllReduce, FLOAT, SUM, 1, false)?;
    if busy != want {
        return Err(format!(
            "{busy} connections to the other host carried more than 1 MiB, not {want}"
        ));
    }
    nccl!(comm::ffi::ncclCommDestroy(c));
    Ok(())
}

/// Connections of this network namespace to `peer_ip` that sent more than 1 MiB, from `ss`.
fn busy_connections(peer_ip: &str) -> Result<usize, String> {
    let out = std::process::Command::new("ss")
        .args(["-tinH", "state", "established"])
        .output()
        .map_err(|e| format!("run ss: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut peer = String::new();
    let mut busy = 0;
    for line in text.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        // A connection's line: Recv-Q Send-Q Local Peer; its details follow, indented.
        if !line.starts_with(char::is_whitespace) && cols.len() >= 4 {
            peer = cols[3].to_string();
        }
        let sent = cols
            .iter()
            .find_map(|c| c.strip_prefix("bytes_sent:"))
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(sent) = sent {
            if peer.starts_with(&format!("{peer_ip}:")) && sent > 1 << 20 {
                busy += 1;
            }
        }
    }
    Ok(busy)
}

// ---------------------------------------------------------------------------------------------
// Tests

fn remove(paths: &[String]) {
    for p in paths {
        let _ = std::fs::remove_file(Path::new(p));
    }
}

/// While rank 1's TCP transport waits for rank 0's connections at its connection service, an
/// attacker connects there: garbage, another communicator's hello, a peer's context without
/// the secret, ranks that cannot be, then more silent connections than the service handshakes
/// with at once, held open. Setup must finish as soon as rank 0 comes, whatever the silent
/// connections do; every attack must be refused and logged; collectives must be right
/// afterwards; and garbage must still be refused once setup is over. With `nofile`, rank 1 may
/// hold only that many descriptors, fewer than the silent connections.
fn hostile_run(nofile: Option<&str>) {
    let Some(hosts) = Hosts::up(2) else { return };
    let base = std::env::temp_dir()
        .join(format!("comm-net-socket-{}", hosts.prefix))
        .display()
        .to_string();
    let files = [format!("{base}.log"), format!("{base}.released")];
    remove(&files);
    let mut env = vec![
        ("COMM_DEBUG", "INFO"),
        ("COMM_DEBUG_FILE", files[0].as_str()),
        // A rank that fails gives up in time: the launch's own timeout cannot reach what the
        // ranks leave behind.
        ("COMM_INIT_TIMEOUT", "60"),
    ];
    if let Some(n) = nofile {
        env.push(("COMM_TEST_NOFILE", n));
    }
    let r = launch_on(
        &hosts,
        &[1, 1],
        "hostile",
        &base,
        &env,
        Duration::from_secs(180),
        || {},
    );
    let log = std::fs::read_to_string(&files[0]).unwrap_or_default();
    remove(&files);
    for rank in &r {
        print!("--- rank {} stdout:\n{}", rank.rank, rank.stdout);
    }
    println!("--- log:\n{log}");
    assert_all_ok(&r, "hostile connections");
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("bootstrap listener of rank 1 (") && l.contains(": refused connection from ")
        })
        .collect();
    let count = |what: &str| refused.iter().filter(|l| l.contains(what)).count();
    assert_eq!(
        count("bad magic"),
        2,
        "garbage during and after setup: {refused:#?}"
    );
    assert_eq!(count("belongs to another communicator"), 1, "{refused:#?}");
    assert_eq!(count("wrong secret"), 1, "{refused:#?}");
    assert_eq!(count("this rank itself"), 1, "{refused:#?}");
    assert_eq!(count("claims to come from rank 7"), 1, "{refused:#?}");
    // The silent ones: some dropped to make room (past MAX_PENDING in flight, or when
    // descriptors ran out), the rest at their handshake deadline.
    let crowded = count("too many unfinished handshakes");
    let starved = count("this process ran out of file descriptors");
    let expired = count("no complete handshake within");
    if nofile.is_some() {
        assert!(starved > 0, "descriptors never ran out");
    } else {
        assert!(
            crowded + starved >= silent_count().saturating_sub(MAX_PENDING),
            "{crowded} + {starved} dropped to make room"
        );
    }
    assert_eq!(
        crowded + starved + expired,
        silent_count(),
        "{crowded} + {starved} + {expired}"
    );
    assert_eq!(refused.len(), silent_count() + 6, "{refused:#?}");
    assert!(
        log.contains("rank 1 -> rank 0: net/socket 10.77.0.1:"),
        "{log}"
    );
}

#[test]
fn hostile_connections_to_the_listener_are_refused() {
    hostile_run(None);
}

/// The same with rank 1 limited to 128 descriptors: running out of them while the attacker's
/// connections wait must cost one of those, not the setup.
#[test]
fn hostile_connections_that_exhaust_descriptors_are_refused() {
    hostile_run(Some("128"));
}

/// Four sockets per peer (NCCL's NSOCKS_PERTHREAD) between two hosts: the links say so, each of
/// the four sockets carries megabytes, and all-reduce and all-gather give the right results at
/// sizes that are and are not cut evenly.
#[test]
fn four_sockets_per_peer_across_hosts() {
    let Some(hosts) = Hosts::up(2) else { return };
    let r = launch_on(
        &hosts,
        &[1, 1],
        "split_messages",
        "4",
        &[("NCCL_NSOCKS_PERTHREAD", "4"), ("COMM_DEBUG", "INFO")],
        Duration::from_secs(300),
        || {},
    );
    assert_all_ok(&r, "four sockets per peer");
    for (rank, other) in [(0, 1), (1, 0)] {
        let want = format!(
            "rank {rank} -> rank {other}: net/socket {}:",
            hosts.addr(other)
        );
        let line = r[rank]
            .stderr
            .lines()
            .find(|l| l.contains(&want))
            .unwrap_or_else(|| {
                panic!(
                    "rank {rank} has no link to rank {other}: {}",
                    r[rank].stderr
                )
            });
        assert!(line.ends_with("(4 sockets)"), "{line}");
    }
}
