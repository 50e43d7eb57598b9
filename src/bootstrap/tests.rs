//! Ranks run as threads of the test process; every wait is bounded so a regression fails instead
//! of hanging.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::checkin::{self, CheckIn, RootSession};
use super::iface::{choose, Family, IfSpec, Iface};
use super::net::Waiter;
use super::root::{self, RootService, SessionHandle};
use super::*;
use crate::error::ErrorKind;

const T: Option<Duration> = Some(Duration::from_secs(20));

/// Kills the test process if a test is still running after `limit`: a regression that makes a
/// collective wait forever must fail the run, not hang it.
pub(crate) struct Watchdog(std::sync::Arc<std::sync::atomic::AtomicBool>);

pub(crate) fn watchdog(name: &'static str, limit: Duration) -> Watchdog {
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = done.clone();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        while !seen.load(Ordering::Acquire) {
            if t0.elapsed() > limit {
                eprintln!("test {name} still running after {limit:?}: aborting the test process");
                std::process::abort();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    Watchdog(done)
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Timeouts of a test's root service and of the id it serves.
#[derive(Clone, Copy, Debug)]
struct RootConfig {
    /// How long an accepted connection may take to authenticate and check in.
    handshake_timeout: Option<Duration>,
    /// COMM_INIT_TIMEOUT of the id.
    init_timeout: Option<Duration>,
}

/// A root service of the test's own on loopback with chosen timeouts, and an id it serves, as
/// new_unique_id would make it. Dropping the service stops it.
fn loopback_root(cfg: RootConfig) -> (UniqueId, SessionHandle, RootService) {
    let service = RootService::start(cfg.handshake_timeout).unwrap();
    let (id, handle) = service
        .new_id(IpAddr::V4(Ipv4Addr::LOCALHOST), cfg.init_timeout)
        .unwrap();
    (id, handle, service)
}

pub(crate) fn init_all(ids: &[UniqueId], n: usize) -> Vec<Bootstrap> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| s.spawn(move || Bootstrap::init(ids, r, n, T)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().expect("init"))
            .collect()
    })
}

/// Runs `f` on every bootstrap at once, one thread each.
fn on_all<R: Send>(boots: &[Bootstrap], f: impl Fn(&Bootstrap) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = boots.iter().map(|b| s.spawn(|| f(b))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn payload(rank: usize) -> Vec<u8> {
    let len = if rank == 1 { 4 << 20 } else { rank * 13 };
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ rank as u8)
        .collect()
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "timed out waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn sample_id() -> UniqueId {
    UniqueId {
        root: "10.1.2.3:4567".parse().unwrap(),
        secret: std::array::from_fn(|i| i as u8 * 7 + 1),
        root_at_init: false,
    }
}

#[test]
fn id_round_trips_through_bytes() {
    let v4 = sample_id();
    assert_eq!(UniqueId::from_bytes(&v4.to_bytes()).unwrap(), v4);
    let v6 = UniqueId {
        root: SocketAddr::new(
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2)),
            29500,
        ),
        secret: [0xee; 32],
        root_at_init: true,
    };
    assert_eq!(UniqueId::from_bytes(&v6.to_bytes()).unwrap(), v6);
    assert!(
        !format!("{v6:?}").contains("238"),
        "Debug must not print the secret"
    );
}

#[test]
fn garbage_ids_are_rejected() {
    let zeros = [0u8; UNIQUE_ID_BYTES];
    let e = UniqueId::from_bytes(&zeros).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.msg.contains("magic"), "{}", e.msg);

    let good = sample_id().to_bytes();
    let mut flipped = good;
    flipped[40] ^= 1;
    let e = UniqueId::from_bytes(&flipped).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.msg.contains("corrupted"), "{}", e.msg);

    let mut newer = good;
    newer[4] = 9;
    let e = UniqueId::from_bytes(&newer).unwrap_err();
    assert!(e.msg.contains("version 9"), "{}", e.msg);
}

#[test]
fn comm_id_mode_derives_the_same_id_everywhere() {
    let a = id::id_from_comm_id("127.0.0.1:29500", None).unwrap();
    let b = id::id_from_comm_id(" 127.0.0.1:29500 ", None).unwrap();
    assert_eq!(a, b);
    assert!(a.root_at_init);
    assert_eq!(a.root, "127.0.0.1:29500".parse().unwrap());
    let c = id::id_from_comm_id("127.0.0.1:29500", Some("s3cret")).unwrap();
    assert_ne!(a.secret, c.secret);
    let d = id::id_from_comm_id("127.0.0.1:29501", None).unwrap();
    assert_ne!(a.secret, d.secret);
    let v6 = id::id_from_comm_id("[::1]:29500", None).unwrap();
    assert!(v6.root.is_ipv6());
    for bad in ["nonsense", "127.0.0.1", "127.0.0.1:0", ""] {
        let e = id::id_from_comm_id(bad, None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{bad:?}");
    }
}

#[test]
fn ranks_rendezvous_and_run_collectives() {
    let _w = watchdog(
        "ranks_rendezvous_and_run_collectives",
        Duration::from_secs(60),
    );
    for n in [1usize, 2, 3, 5, 8] {
        let id = new_unique_id().unwrap();
        let boots = init_all(std::slice::from_ref(&id), n);
        for (r, b) in boots.iter().enumerate() {
            assert_eq!((b.rank(), b.nranks()), (r, n));
            assert_eq!(b.secret(), boots[0].secret());
        }
        let gathered = on_all(&boots, |b| b.allgather(&payload(b.rank())));
        let expected: Vec<Vec<u8>> = (0..n).map(payload).collect();
        for g in gathered {
            assert!(g.unwrap() == expected, "allgather of {n} ranks");
        }
        for r in on_all(&boots, |b| b.barrier()) {
            r.unwrap();
        }
        let root = n - 1;
        let data = b"from the last rank".repeat(1000);
        let got = on_all(&boots, |b| {
            let mine = if b.rank() == root {
                data.clone()
            } else {
                Vec::new()
            };
            b.broadcast(root, &mine)
        });
        for g in got {
            assert_eq!(g.unwrap(), data);
        }
        // A second round works on the same ring.
        let again = on_all(&boots, |b| b.allgather(&[b.rank() as u8]));
        for g in again {
            assert_eq!(
                g.unwrap(),
                (0..n).map(|r| vec![r as u8]).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn rounds_work_at_every_size_and_from_every_root() {
    let _w = watchdog(
        "rounds_work_at_every_size_and_from_every_root",
        Duration::from_secs(120),
    );
    // Powers of two, one past them and one short of them: every shape of the last round.
    for n in [4usize, 6, 7, 9, 12, 16, 17] {
        let id = new_unique_id().unwrap();
        let boots = init_all(std::slice::from_ref(&id), n);
        for b in &boots {
            assert_eq!(b.addrs, boots[0].addrs, "{n} ranks");
            assert_eq!(b.addrs[b.rank()], b.listener.addr());
        }
        let small = |r: usize| vec![r as u8; r % 5];
        for g in on_all(&boots, |b| b.allgather(&small(b.rank()))) {
            assert_eq!(
                g.unwrap(),
                (0..n).map(small).collect::<Vec<_>>(),
                "{n} ranks"
            );
        }
        for root in 0..n {
            let data = format!("root {root} of {n}").into_bytes();
            let got = on_all(&boots, |b| {
                b.broadcast(root, if b.rank() == root { &data } else { b"" })
            });
            for g in got {
                assert_eq!(g.unwrap(), data);
            }
        }
        for r in on_all(&boots, |b| b.barrier()) {
            r.unwrap();
        }
        // A sub-communicator of every third rank, in reverse order.
        let members: Vec<usize> = (0..n).rev().filter(|r| r % 3 == 0).collect();
        let subs = on_all(&boots, |b| {
            members.contains(&b.rank()).then(|| b.sub(&members, 9, T))
        });
        let subs: Vec<Bootstrap> = subs.into_iter().flatten().map(|c| c.unwrap()).collect();
        for g in on_all(&subs, |c| c.allgather(&[c.rank() as u8])) {
            let want: Vec<Vec<u8>> = (0..members.len()).map(|i| vec![i as u8]).collect();
            assert_eq!(g.unwrap(), want);
        }
    }
}

/// TCP connections the bootstraps of this process hold between ranks: twice ceil(log2 n) per
/// rank, not one per peer.
#[test]
fn each_rank_holds_two_connections_per_round() {
    for (n, rounds) in [(1usize, 0usize), (2, 1), (3, 2), (8, 3), (9, 4), (33, 6)] {
        assert_eq!(rounds::rounds_for(n), rounds, "{n} ranks");
    }
    let _w = watchdog(
        "each_rank_holds_two_connections_per_round",
        Duration::from_secs(60),
    );
    let id = new_unique_id().unwrap();
    let boots = init_all(std::slice::from_ref(&id), 9);
    for b in &boots {
        let r = b.rounds.lock();
        assert_eq!(r.connections(), 2 * 4);
    }
}

#[test]
fn a_failure_reaches_every_rank_and_names_its_origin() {
    let _w = watchdog(
        "a_failure_reaches_every_rank_and_names_its_origin",
        Duration::from_secs(60),
    );
    let id = new_unique_id().unwrap();
    let boots = init_all(std::slice::from_ref(&id), 11);
    let flag = boots[6].abort_handle();
    let t0 = Instant::now();
    let results = on_all(&boots, |b| {
        if b.rank() == 6 {
            std::thread::sleep(Duration::from_millis(200));
            flag.store(true, Ordering::Release);
        }
        b.allgather(&[1]).and_then(|_| b.barrier())
    });
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    for (r, res) in results.into_iter().enumerate() {
        let e = res.unwrap_err();
        // The others name the rank where the failure started.
        assert!(r == 6 || e.msg.contains("rank 6"), "rank {r}: {}", e.msg);
        assert!(e.msg.contains("aborted"), "rank {r}: {}", e.msg);
    }
}

#[test]
fn scalable_init_with_several_roots() {
    let _w = watchdog("scalable_init_with_several_roots", Duration::from_secs(30));
    let ids: Vec<UniqueId> = (0..3).map(|_| new_unique_id().unwrap()).collect();
    let boots = init_all(&ids, 7);
    let gathered = on_all(&boots, |b| b.allgather(&[b.rank() as u8; 3]));
    for g in gathered {
        assert_eq!(
            g.unwrap(),
            (0..7).map(|r| vec![r as u8; 3]).collect::<Vec<_>>()
        );
    }
    // Every rank knows every rank's listener.
    for b in &boots {
        assert_eq!(b.addrs.len(), 7);
        assert_eq!(b.addrs[b.rank()], b.listener.addr());
        assert_eq!(b.addrs, boots[0].addrs);
    }
}

/// Checks every rank in with its root(s) the way `Bootstrap::init` does, with made-up listener
/// addresses (nobody connects to them), and returns what each rank learns: its root's READY and,
/// for the first rank of a block with several roots, the previous root's answer to its announcement.
fn neighbours_from_the_roots(
    ids: &[UniqueId],
    n: usize,
    listen: impl Fn(usize) -> SocketAddr + Sync,
) -> Vec<(checkin::Ready, Option<SocketAddr>)> {
    let (_, tag) = comm_identity(ids);
    let nroots = ids.len();
    let listen = &listen;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    let never = std::sync::atomic::AtomicBool::new(false);
                    let started = Instant::now();
                    let w = Waiter::new(Some(started + Duration::from_secs(20)), &never);
                    let k = root::root_of(r, n, nroots);
                    let me = CheckIn {
                        rank: r as u32,
                        nranks: n as u32,
                        nroots: nroots as u32,
                        root_index: k as u32,
                        tag,
                        listen: listen(r),
                        card: Vec::new(),
                    };
                    let own = RootSession::open(&ids[k], root::CHECK_IN, &me, w).unwrap();
                    let announce = (nroots > 1 && r == root::first_of(k, n, nroots)).then(|| {
                        let prev_root = root::root_of((r + n - 1) % n, n, nroots);
                        let a = CheckIn {
                            root_index: prev_root as u32,
                            ..me.clone()
                        };
                        RootSession::open(&ids[prev_root], root::ANNOUNCE, &a, w).unwrap()
                    });
                    let ready =
                        checkin::Ready::decode(&own.wait_ready(w, started, None).unwrap()).unwrap();
                    let announced = announce.map(|a| {
                        checkin::announced_prev(&a.wait_ready(w, started, None).unwrap()).unwrap()
                    });
                    (ready, announced)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ready_names_the_successor_and_the_predecessor() {
    let _w = watchdog(
        "ready_names_the_successor_and_the_predecessor",
        Duration::from_secs(60),
    );
    let fake = |r: usize| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 40000 + r as u16);
    for (n, nroots) in [(1usize, 1usize), (2, 1), (5, 1), (7, 3), (5, 2), (4, 4)] {
        let ids: Vec<UniqueId> = (0..nroots).map(|_| new_unique_id().unwrap()).collect();
        let got = neighbours_from_the_roots(&ids, n, fake);
        for (r, (ready, announced)) in got.into_iter().enumerate() {
            let case = format!("rank {r} of {n} with {nroots} roots");
            assert_eq!(ready.next, fake((r + 1) % n), "{case}: next");
            let first_of_block = r == root::first_of(root::root_of(r, n, nroots), n, nroots);
            if nroots > 1 && first_of_block {
                // Only the previous root knows it, and says so in its answer to the announcement.
                assert_eq!(ready.prev, None, "{case}: own root's prev");
                assert_eq!(
                    announced,
                    Some(fake((r + n - 1) % n)),
                    "{case}: announced prev"
                );
            } else {
                assert_eq!(ready.prev, Some(fake((r + n - 1) % n)), "{case}: prev");
                assert_eq!(announced, None, "{case}: no announcement");
            }
        }
    }
}

#[test]
fn comm_id_mode_rank0_starts_the_root_and_the_port_can_be_reused() {
    let _w = watchdog(
        "comm_id_mode_rank0_starts_the_root_and_the_port_can_be_reused",
        Duration::from_secs(60),
    );
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let id = id::id_from_comm_id(&format!("127.0.0.1:{port}"), None).unwrap();
    for round in 0..2 {
        let boots = init_all(std::slice::from_ref(&id), 3);
        let g = on_all(&boots, |b| b.allgather(&[b.rank() as u8, round]));
        for x in g {
            assert_eq!(
                x.unwrap(),
                vec![vec![0, round], vec![1, round], vec![2, round]]
            );
        }
    }
}

#[test]
fn sub_splits_into_independent_groups() {
    let _w = watchdog(
        "sub_splits_into_independent_groups",
        Duration::from_secs(60),
    );
    let id = new_unique_id().unwrap();
    let boots = init_all(std::slice::from_ref(&id), 6);
    let children = on_all(&boots, |b| {
        let (members, tag) = if b.rank() % 2 == 0 {
            (vec![0, 2, 4], 1)
        } else {
            (vec![1, 3, 5], 2)
        };
        b.sub(&members, tag, T)
    });
    let children: Vec<Bootstrap> = children.into_iter().map(|c| c.unwrap()).collect();
    for (r, c) in children.iter().enumerate() {
        assert_eq!((c.rank(), c.nranks()), (r / 2, 3));
        assert_ne!(c.secret(), boots[r].secret());
    }
    assert_ne!(children[0].secret(), children[1].secret());
    assert_eq!(children[0].secret(), children[2].secret());
    // Each child sees exactly its own members' data, in child rank order.
    let parent_ranks = [0usize, 1, 2, 3, 4, 5];
    let gathered = std::thread::scope(|s| {
        let hs: Vec<_> = children
            .iter()
            .zip(parent_ranks)
            .map(|(c, p)| s.spawn(move || c.allgather(format!("parent {p}").as_bytes())))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for (p, g) in gathered.into_iter().enumerate() {
        let want: Vec<Vec<u8>> = (0..3)
            .map(|i| format!("parent {}", 2 * i + p % 2).into_bytes())
            .collect();
        assert_eq!(g.unwrap(), want);
    }
    // The parent still works alongside its children.
    for r in on_all(&boots, |b| b.barrier()) {
        r.unwrap();
    }
}

#[test]
fn sub_works_without_a_dead_non_member() {
    let _w = watchdog(
        "sub_works_without_a_dead_non_member",
        Duration::from_secs(60),
    );
    let id = new_unique_id().unwrap();
    let mut boots = init_all(std::slice::from_ref(&id), 5);
    drop(boots.pop()); // rank 4 is gone: its listener and ring connections are closed
    let children = on_all(&boots, |b| {
        // A late member: the others' connections wait in its listener until it asks.
        if b.rank() == 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
        b.sub(&[0, 1, 2, 3], 77, T)
    });
    let children: Vec<Bootstrap> = children.into_iter().map(|c| c.unwrap()).collect();
    let g = on_all(&children, |c| c.allgather(&[c.rank() as u8 + 10]));
    for x in g {
        assert_eq!(x.unwrap(), vec![vec![10], vec![11], vec![12], vec![13]]);
    }
    let b = on_all(&children, |c| {
        c.broadcast(2, if c.rank() == 2 { b"two" } else { b"" })
    });
    for x in b {
        assert_eq!(x.unwrap(), b"two");
    }
    // A sub of the sub, after the parent is gone.
    drop(boots);
    let grand = on_all(&children, |c| {
        c.sub(&[3, 1], 5, T).map(|g| (g.rank(), g.nranks()))
    });
    assert_eq!(grand[1].as_ref().unwrap(), &(1, 2));
    assert_eq!(grand[3].as_ref().unwrap(), &(0, 2));
    assert_eq!(grand[0].as_ref().unwrap_err().kind, ErrorKind::InvalidUsage);
}

#[test]
fn init_timeout_names_the_missing_rank() {
    let _w = watchdog(
        "init_timeout_names_the_missing_rank",
        Duration::from_secs(60),
    );
    let id = new_unique_id().unwrap();
    let t0 = Instant::now();
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let id = &id;
                s.spawn(move || {
                    Bootstrap::init(std::slice::from_ref(id), r, 4, Some(Duration::from_secs(1)))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    for r in results {
        let e = r.err().expect("init must fail");
        assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.msg);
        assert!(e.msg.contains("rank 3 of 4 never arrived"), "{}", e.msg);
    }
}

#[test]
fn root_reports_its_own_deadline_to_everyone() {
    let _w = watchdog(
        "root_reports_its_own_deadline_to_everyone",
        Duration::from_secs(60),
    );
    let cfg = RootConfig {
        handshake_timeout: Some(Duration::from_secs(5)),
        init_timeout: Some(Duration::from_millis(500)),
    };
    let (id, handle, service) = loopback_root(cfg);
    let t0 = Instant::now();
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = [0usize, 2]
            .into_iter()
            .map(|r| {
                let id = &id;
                s.spawn(move || Bootstrap::init(std::slice::from_ref(id), r, 6, T))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
    for r in results {
        let e = r.err().expect("init must fail");
        assert_eq!(e.kind, ErrorKind::Timeout);
        assert!(
            e.msg.contains("ranks 1, 3-5 of 6 never arrived"),
            "{}",
            e.msg
        );
    }
    // The session is gone with its deadline.
    wait_until("the session has ended", || handle.ended());
    assert_eq!(service.live_sessions(), 0);
}

fn rogue_check_in(id: &UniqueId, c: CheckIn) -> crate::error::Error {
    let never = std::sync::atomic::AtomicBool::new(false);
    let w = Waiter::new(Some(Instant::now() + Duration::from_secs(5)), &never);
    let session = RootSession::open(id, root::CHECK_IN, &c, w).expect("right secret authenticates");
    session
        .wait_ready(w, Instant::now(), None)
        .expect_err("the root must refuse this check-in")
}

#[test]
fn hostile_connections_are_refused_and_the_rendezvous_goes_on() {
    let _w = watchdog(
        "hostile_connections_are_refused_and_the_rendezvous_goes_on",
        Duration::from_secs(60),
    );
    let cfg = RootConfig {
        handshake_timeout: Some(Duration::from_secs(5)),
        init_timeout: Some(Duration::from_secs(20)),
    };
    let (id, handle, service) = loopback_root(cfg);
    let (_, tag) = comm_identity(std::slice::from_ref(&id));
    let nobody: SocketAddr = "127.0.0.1:9".parse().unwrap();

    // Connects and says nothing: a half-open socket as far as the root can tell.
    let mut silent = TcpStream::connect(id.root).unwrap();
    // Bytes that are not a handshake.
    let mut garbage = TcpStream::connect(id.root).unwrap();
    garbage.write_all(&[0x5a; 300]).unwrap();
    // Speaks the protocol with the wrong secret.
    let mut wrong = TcpStream::connect(id.root).unwrap();
    wrong
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let e = auth::client(&mut wrong, &[7u8; 32], &root::root_context(&id)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);

    let t0 = Instant::now();
    let gathered = std::thread::scope(|s| {
        let run = |r: usize| {
            let id = &id;
            move || {
                let b = Bootstrap::init(std::slice::from_ref(id), r, 3, T)?;
                b.allgather(&[r as u8])
            }
        };
        let mut hs = vec![s.spawn(run(0)), s.spawn(run(1))];
        wait_until("a legitimate rank has checked in", || {
            handle.admitted.load(Ordering::Acquire) >= 1
        });
        // Right secret, right size, another communicator.
        let e = rogue_check_in(
            &id,
            CheckIn {
                rank: 2,
                nranks: 3,
                nroots: 1,
                root_index: 0,
                tag: tag ^ 1,
                listen: nobody,
                card: Vec::new(),
            },
        );
        assert_eq!(e.kind, ErrorKind::InvalidUsage, "{}", e.msg);
        // A rank number out of range.
        let e = rogue_check_in(
            &id,
            CheckIn {
                rank: 3,
                nranks: 3,
                nroots: 1,
                root_index: 0,
                tag,
                listen: nobody,
                card: Vec::new(),
            },
        );
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.msg);
        hs.push(s.spawn(run(2)));
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for g in gathered {
        assert_eq!(g.unwrap(), vec![vec![0], vec![1], vec![2]]);
    }
    // The silent client held nobody up (its handshake deadline is 5 s).
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t0.elapsed()
    );
    wait_until("the session has ended", || handle.ended());
    assert_eq!(service.live_sessions(), 0);
    // Stopping the service takes the bad connections with it.
    drop(service);
    for s in [&mut silent, &mut garbage] {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut b = [0u8; 16];
        match s.read(&mut b) {
            Ok(0) => {}
            Ok(n) => panic!("a refused client got {n} bytes"),
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ),
                "{e}"
            ),
        }
    }
}

/// A rank of the same communicator (same ids) that declares another rank count: the
/// rendezvous cannot complete, and the ranks already checked in fail at once, told why (they
/// used to wait for COMM_INIT_TIMEOUT and then blame ranks that had come).
#[test]
fn a_rank_declaring_another_rank_count_fails_the_rendezvous_at_once() {
    let _w = watchdog(
        "a_rank_declaring_another_rank_count_fails_the_rendezvous_at_once",
        Duration::from_secs(60),
    );
    let cfg = RootConfig {
        handshake_timeout: Some(Duration::from_secs(5)),
        init_timeout: Some(Duration::from_secs(30)),
    };
    let (id, handle, service) = loopback_root(cfg);
    let (_, tag) = comm_identity(std::slice::from_ref(&id));
    let nobody: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let id = &id;
        let first = s.spawn(move || Bootstrap::init(std::slice::from_ref(id), 0, 3, T).map(|_| ()));
        wait_until("rank 0 has checked in", || {
            handle.admitted.load(Ordering::Acquire) >= 1
        });
        let e = rogue_check_in(
            id,
            CheckIn {
                rank: 1,
                nranks: 2,
                nroots: 1,
                root_index: 0,
                tag,
                listen: nobody,
                card: Vec::new(),
            },
        );
        assert_eq!(e.kind, ErrorKind::InvalidUsage, "{}", e.msg);
        assert!(e.msg.contains("declares 2 ranks"), "{}", e.msg);
        let e = first.join().unwrap().unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidUsage, "{}", e.msg);
        assert!(
            e.msg
                .contains("rank 1 declares 2 ranks but the ranks already here declared 3"),
            "{}",
            e.msg
        );
    });
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    wait_until("the session has ended", || handle.ended());
    assert_eq!(service.live_sessions(), 0);
}

#[test]
fn silent_clients_are_dropped_after_the_handshake_timeout() {
    let _w = watchdog(
        "silent_clients_are_dropped_after_the_handshake_timeout",
        Duration::from_secs(60),
    );
    let cfg = RootConfig {
        handshake_timeout: Some(Duration::from_millis(200)),
        init_timeout: Some(Duration::from_secs(10)),
    };
    let (id, _handle, _service) = loopback_root(cfg);
    let mut silent = TcpStream::connect(id.root).unwrap();
    let mut partial = TcpStream::connect(id.root).unwrap();
    partial.write_all(b"COMMAUTH").unwrap();
    let t0 = Instant::now();
    for s in [&mut silent, &mut partial] {
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut b = [0u8; 1];
        let r = s.read(&mut b);
        assert!(
            matches!(r, Ok(0)) || r.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset)
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn duplicate_rank_is_refused_and_the_rendezvous_goes_on() {
    let _w = watchdog(
        "duplicate_rank_is_refused_and_the_rendezvous_goes_on",
        Duration::from_secs(60),
    );
    let cfg = RootConfig {
        handshake_timeout: Some(Duration::from_secs(5)),
        init_timeout: Some(Duration::from_secs(20)),
    };
    let (id, handle, _service) = loopback_root(cfg);
    let (_, tag) = comm_identity(std::slice::from_ref(&id));
    std::thread::scope(|s| {
        let first = s.spawn(|| Bootstrap::init(std::slice::from_ref(&id), 0, 2, T));
        wait_until("rank 0 has checked in", || {
            handle.admitted.load(Ordering::Acquire) >= 1
        });
        let e = rogue_check_in(
            &id,
            CheckIn {
                rank: 0,
                nranks: 2,
                nroots: 1,
                root_index: 0,
                tag,
                listen: "127.0.0.1:9".parse().unwrap(),
                card: Vec::new(),
            },
        );
        assert_eq!(e.kind, ErrorKind::InvalidUsage, "{}", e.msg);
        assert!(e.msg.contains("already checked in"), "{}", e.msg);
        let second = Bootstrap::init(std::slice::from_ref(&id), 1, 2, T).unwrap();
        let first = first.join().unwrap().unwrap();
        assert_eq!((first.rank(), second.rank()), (0, 1));
    });
}

#[test]
fn bad_arguments_are_reported() {
    let id = sample_id();
    let e = Bootstrap::init(std::slice::from_ref(&id), 4, 4, T)
        .err()
        .unwrap();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.msg.contains("rank 4"), "{}", e.msg);
    assert_eq!(
        Bootstrap::init(&[], 0, 1, T).err().unwrap().kind,
        ErrorKind::InvalidArgument
    );
    let two = [id.clone(), id];
    assert_eq!(
        Bootstrap::init(&two, 0, 1, T).err().unwrap().kind,
        ErrorKind::InvalidArgument
    );

    let solo = init_all(&[new_unique_id().unwrap()], 1).pop().unwrap();
    assert_eq!(
        solo.broadcast(1, b"x").unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        solo.sub(&[0, 0], 1, T).err().unwrap().kind,
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        solo.sub(&[3], 1, T).err().unwrap().kind,
        ErrorKind::InvalidArgument
    );
    assert_eq!(solo.sub(&[0], 1, T).unwrap().nranks(), 1);
}

fn auth_pair(
    client_secret: [u8; 32],
    client_ctx: &[u8],
    server_secret: [u8; 32],
    server_ctx: &[u8],
) -> (crate::error::Result<()>, crate::error::Result<()>) {
    let (mut a, mut b) = UnixStream::pair().unwrap();
    for s in [&a, &b] {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    }
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let r = auth::server(&mut b, &server_secret, server_ctx);
            if r.is_ok() {
                // Nothing past the handshake was consumed.
                let mut rest = [0u8; 5];
                b.read_exact(&mut rest).unwrap();
                assert_eq!(&rest, b"after");
            }
            r
        });
        let c = auth::client(&mut a, &client_secret, client_ctx);
        if c.is_ok() {
            a.write_all(b"after").unwrap();
        }
        // Close our end so a server waiting for more learns the client has given up.
        drop(a);
        (c, server.join().unwrap())
    })
}

#[test]
fn auth_accepts_the_right_secret_and_refuses_the_rest() {
    let _w = watchdog(
        "auth_accepts_the_right_secret_and_refuses_the_rest",
        Duration::from_secs(60),
    );
    let secret = [42u8; 32];
    let (c, s) = auth_pair(secret, b"ctx", secret, b"ctx");
    c.unwrap();
    s.unwrap();

    let (c, s) = auth_pair([1u8; 32], b"ctx", secret, b"ctx");
    assert!(c.is_err(), "client must notice the server's secret differs");
    assert!(s.is_err(), "server must refuse a wrong secret");

    let (c, s) = auth_pair(secret, b"rank 1 -> 2", secret, b"rank 1 -> 3");
    assert!(
        c.is_err() && s.is_err(),
        "a different context must fail on both sides"
    );

    let (c, s) = auth_pair(secret, b"", secret, b"");
    c.unwrap();
    s.unwrap();
}

#[test]
fn auth_rejects_garbage() {
    let (mut a, mut b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    a.write_all(&[0xffu8; 64]).unwrap();
    let e = auth::server(&mut b, &[1; 32], b"x").unwrap_err();
    assert!(e.msg.contains("garbage"), "{}", e.msg);
}

#[test]
fn peer_death_ends_a_blocked_allgather() {
    let _w = watchdog(
        "peer_death_ends_a_blocked_allgather",
        Duration::from_secs(60),
    );
    let id = new_unique_id().unwrap();
    let mut boots = init_all(std::slice::from_ref(&id), 3);
    let third = boots.pop().unwrap();
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .iter()
            .map(|b| s.spawn(move || (b.allgather(&[1, 2, 3]), Instant::now())))
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let died = Instant::now();
        drop(third);
        hs.into_iter()
            .map(|h| {
                let (r, t) = h.join().unwrap();
                (r, t.saturating_duration_since(died))
            })
            .collect::<Vec<_>>()
    });
    for (r, after) in results {
        let e = r.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
        assert!(e.msg.contains("rank 2"), "{}", e.msg);
        assert!(after < Duration::from_secs(2), "noticed after {after:?}");
    }
    // The ring stays unusable, and says so at once.
    let e = boots[0].barrier().unwrap_err();
    assert!(e.msg.contains("failed earlier"), "{}", e.msg);
}

#[test]
fn abort_unblocks_a_waiting_call() {
    let _w = watchdog("abort_unblocks_a_waiting_call", Duration::from_secs(30));
    let id = new_unique_id().unwrap();
    let boots = init_all(std::slice::from_ref(&id), 2);
    let flag = boots[0].abort_handle();
    let t0 = Instant::now();
    let r = std::thread::scope(|s| {
        let h = s.spawn(|| boots[0].allgather(b"alone"));
        std::thread::sleep(Duration::from_millis(200));
        flag.store(true, Ordering::Release);
        h.join().unwrap()
    });
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(r.unwrap_err().msg.contains("aborted"));
    // The peer is told instead of being left to hang. Its first allgather may still complete,
    // since rank 0 had sent its contribution before it was aborted; the next call cannot.
    let t1 = Instant::now();
    let first = boots[1].allgather(b"late");
    let e = first.and_then(|_| boots[1].barrier()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
    assert!(e.msg.contains("aborted"), "{}", e.msg);
    assert!(t1.elapsed() < Duration::from_secs(2));
}

#[test]
fn collectives_called_out_of_order_are_reported() {
    let _w = watchdog(
        "collectives_called_out_of_order_are_reported",
        Duration::from_secs(60),
    );
    let id = new_unique_id().unwrap();
    let boots = init_all(std::slice::from_ref(&id), 2);
    let r = std::thread::scope(|s| {
        let a = s.spawn(|| boots[0].barrier().map(|_| ()));
        let b = s.spawn(|| boots[1].allgather(b"x").map(|_| ()));
        (a.join().unwrap(), b.join().unwrap())
    });
    let (a, b) = (r.0.unwrap_err(), r.1.unwrap_err());
    assert!(
        a.msg.contains("out of step") || b.msg.contains("out of step"),
        "{} / {}",
        a.msg,
        b.msg
    );
}

#[test]
fn root_and_block_arithmetic() {
    for (nranks, nroots) in [(7usize, 3usize), (8, 8), (5, 1), (100, 7)] {
        for k in 0..nroots {
            let (a, b) = (
                root::first_of(k, nranks, nroots),
                root::first_of(k + 1, nranks, nroots),
            );
            assert!(a < b, "root {k} of {nroots} for {nranks} ranks has no rank");
            for r in a..b {
                assert_eq!(root::root_of(r, nranks, nroots), k);
            }
        }
        assert_eq!(root::first_of(nroots, nranks, nroots), nranks);
    }
}

#[test]
fn missing_ranks_are_listed_compactly() {
    assert_eq!(describe_ranks(&[3]), "rank 3");
    assert_eq!(describe_ranks(&[3, 5, 6, 7]), "ranks 3, 5-7");
    assert_eq!(describe_ranks(&[0, 1, 4, 9, 10]), "ranks 0-1, 4, 9-10");
}

fn ifaces(list: &[(&str, &str)]) -> Vec<Iface> {
    list.iter()
        .map(|(n, a)| Iface {
            name: n.to_string(),
            addr: a.parse().unwrap(),
        })
        .collect()
}

#[test]
fn interface_selection_follows_nccl_socket_ifname() {
    let list = ifaces(&[
        ("lo", "127.0.0.1"),
        ("docker0", "172.17.0.1"),
        ("eth0", "fd00::2"),
        ("eth0", "10.0.0.2"),
        ("eth1", "10.1.0.2"),
        ("ib0", "192.168.0.2"),
        ("virbr0", "192.168.122.1"),
    ]);
    let pick =
        |spec: Option<&str>, fam| choose(&list, spec, fam).map(|i| (i.name, i.addr.to_string()));
    let some = |n: &str, a: &str| Some((n.to_string(), a.to_string()));
    // Default: InfiniBand first.
    assert_eq!(pick(None, None), some("ib0", "192.168.0.2"));
    // Prefixes, with IPv4 preferred within an interface.
    assert_eq!(pick(Some("eth"), None), some("eth0", "10.0.0.2"));
    assert_eq!(pick(Some("eth"), Some(Family::V6)), some("eth0", "fd00::2"));
    assert_eq!(pick(Some("eth1,ib"), None), some("eth1", "10.1.0.2"));
    // Exclusions.
    assert_eq!(pick(Some("^lo,docker"), None), some("eth0", "10.0.0.2"));
    assert_eq!(
        pick(Some("^lo,docker,eth"), None),
        some("ib0", "192.168.0.2")
    );
    // Exact names.
    assert_eq!(pick(Some("=eth"), None), None);
    assert_eq!(pick(Some("=eth1"), None), some("eth1", "10.1.0.2"));
    assert_eq!(
        pick(Some("^=eth0,lo,docker0"), None),
        some("eth1", "10.1.0.2")
    );
    assert_eq!(pick(Some("nothing"), None), None);

    // Without InfiniBand: anything but docker, loopback and virbr.
    let no_ib = ifaces(&[
        ("lo", "127.0.0.1"),
        ("docker0", "172.17.0.1"),
        ("virbr0", "192.168.122.1"),
        ("enp1s0", "10.9.0.1"),
    ]);
    assert_eq!(choose(&no_ib, None, None).unwrap().name, "enp1s0");
    // Only loopback and bridges: loopback.
    let bare = ifaces(&[
        ("docker0", "172.17.0.1"),
        ("lo", "127.0.0.1"),
        ("virbr0", "192.168.122.1"),
    ]);
    assert_eq!(choose(&bare, None, None).unwrap().name, "lo");
    assert_eq!(choose(&bare, None, Some(Family::V6)), None);

    let spec = IfSpec::parse("^=eth0, ib");
    assert!(
        !spec.matches("eth0")
            && !spec.matches("ib")
            && spec.matches("ib0")
            && spec.matches("eth00")
    );
}

#[test]
fn local_ip_finds_an_address() {
    let ip = local_ip().unwrap();
    assert!(!ip.is_unspecified());
    // The address can be listened on.
    TcpListener::bind((ip, 0)).unwrap();
}

#[test]
fn ranks_may_leave_right_after_the_last_collective() {
    let _w = watchdog(
        "ranks_may_leave_right_after_the_last_collective",
        Duration::from_secs(60),
    );
    // A rank that has all it needs returns and closes its communicator while its predecessor may
    // still be receiving from further back; that must not fail the predecessor.
    for round in 0..10 {
        let id = new_unique_id().unwrap();
        let boots = init_all(std::slice::from_ref(&id), 4);
        let results = std::thread::scope(|s| {
            let hs: Vec<_> = boots
                .into_iter()
                .map(|b| {
                    s.spawn(move || {
                        let all = b.allgather(&payload(b.rank()))?;
                        if b.rank() % 2 == 1 {
                            std::thread::sleep(Duration::from_millis(round));
                        }
                        b.barrier()?;
                        Ok::<_, crate::error::Error>(all.len())
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for r in results {
            assert_eq!(r.unwrap(), 4, "round {round}");
        }
    }
}

#[test]
fn rank_listeners_refuse_strangers() {
    let _w = watchdog("rank_listeners_refuse_strangers", Duration::from_secs(30));
    let id = new_unique_id().unwrap();
    let boots = init_all(std::slice::from_ref(&id), 3);
    let target = boots[0].listener.addr();
    let secret = *boots[0].secret();
    let ctx = |tag: u64, to: u32| {
        PeerCtx {
            tag,
            purpose: Purpose::Ring,
            key: 0,
            from: 1,
            to,
        }
        .encode()
    };
    let dial = || {
        let s = TcpStream::connect(target).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    let _silent = dial();
    dial().write_all(&[0u8; 100]).unwrap();
    let tag = boots[0].tag;
    let refused = [
        ([9u8; 32], ctx(tag, 0)),            // wrong secret
        (secret, ctx(tag ^ 1, 0)),           // another communicator
        (secret, ctx(tag, 2)),               // meant for another rank
        (secret, b"not a context".to_vec()), // unknown purpose
    ];
    for (i, (secret, ctx)) in refused.iter().enumerate() {
        let e = auth::client(&mut dial(), secret, ctx).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Remote, "case {i}: {}", e.msg);
    }
    // The communicator carries on, and so does a sub-communicator set up through the listeners.
    for r in on_all(&boots, |b| b.barrier()) {
        r.unwrap();
    }
    let subs = on_all(&boots, |b| b.sub(&[2, 0, 1], 3, T).map(|c| c.rank()));
    let ranks: Vec<usize> = subs.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(ranks, vec![1, 2, 0]);
}

/// This process's threads and open descriptors.
fn threads_and_fds() -> (usize, usize) {
    let count = |dir: &str| std::fs::read_dir(dir).unwrap().count();
    (count("/proc/self/task"), count("/proc/self/fd"))
}

const CHILD_ENV: &str = "COMM_BOOTSTRAP_TEST_CHILD";

#[test]
fn unused_ids_cost_no_thread_or_descriptor_each() {
    const NAME: &str = "bootstrap::tests::unused_ids_cost_no_thread_or_descriptor_each";
    const IDS: usize = 100;
    if std::env::var(CHILD_ENV).as_deref() == Ok("unused-ids") {
        // The child: alone in its process, so the counts are exact.
        let before = threads_and_fds();
        let ids: Vec<UniqueId> = (0..IDS).map(|_| new_unique_id().unwrap()).collect();
        let after = threads_and_fds();
        let ports: std::collections::BTreeSet<SocketAddr> = ids.iter().map(|i| i.root).collect();
        println!(
            "COUNTS threads {} -> {}, fds {} -> {}, {} distinct root addresses",
            before.0,
            after.0,
            before.1,
            after.1,
            ports.len()
        );
        return;
    }
    let _w = watchdog(NAME, Duration::from_secs(60));
    // Other tests of this process start and stop threads and sockets all the time: measure in a
    // process of its own.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "unused-ids")
        .env_remove("COMM_ID")
        .env_remove("NCCL_COMM_ID")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("COUNTS ").map(|(_, c)| c))
        .unwrap_or_else(|| panic!("no counts in the child's output: {stdout}"));
    eprintln!("{IDS} unused ids: {line}");
    let n: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let (threads, fds, addrs) = (n[1] - n[0], n[3] - n[2], n[4]);
    // One service thread, its listener and its wake-up pair, however many ids.
    assert!(threads <= 2, "{IDS} ids added {threads} threads: {line}");
    assert!(fds <= 4, "{IDS} ids added {fds} descriptors: {line}");
    assert_eq!(addrs, 1, "ids of one process share the root's port: {line}");
}

#[test]
fn an_unused_id_is_dropped_after_the_init_timeout() {
    let _w = watchdog(
        "an_unused_id_is_dropped_after_the_init_timeout",
        Duration::from_secs(60),
    );
    let cfg = RootConfig {
        handshake_timeout: Some(Duration::from_secs(5)),
        init_timeout: Some(Duration::from_secs(1)),
    };
    let t0 = Instant::now();
    let (id, handle, service) = loopback_root(cfg);
    // A second id that is used in time is not disturbed by the first one's expiry.
    let (used, _) = service
        .new_id(id.root.ip(), Some(Duration::from_secs(20)))
        .unwrap();
    assert_eq!(service.live_sessions(), 2);
    wait_until("the unused id has expired", || handle.ended());
    let expired_after = t0.elapsed();
    assert!(
        expired_after >= Duration::from_millis(900) && expired_after < Duration::from_secs(3),
        "the unused id expired after {expired_after:?}, its timeout is 1 s"
    );
    assert_eq!(service.live_sessions(), 1);
    // A late rank is told, at once, that nobody serves this id any more.
    let t1 = Instant::now();
    let e = Bootstrap::init(std::slice::from_ref(&id), 0, 2, T)
        .err()
        .expect("a late check-in must fail");
    assert!(
        t1.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t1.elapsed()
    );
    assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
    assert!(e.msg.contains("does not serve this unique id"), "{}", e.msg);
    let boots = init_all(std::slice::from_ref(&used), 2);
    for r in on_all(&boots, |b| b.barrier()) {
        r.unwrap();
    }
    assert_eq!(service.live_sessions(), 0);
}

#[test]
fn two_ids_rendezvous_at_once_on_one_service() {
    let _w = watchdog(
        "two_ids_rendezvous_at_once_on_one_service",
        Duration::from_secs(60),
    );
    let service = RootService::start(Some(Duration::from_secs(5))).unwrap();
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let (a, ha) = service.new_id(lo, Some(Duration::from_secs(20))).unwrap();
    let (b, hb) = service.new_id(lo, Some(Duration::from_secs(20))).unwrap();
    assert_eq!(a.root, b.root, "ids of one service share its listener");
    assert_ne!(a.secret, b.secret);
    let (_, tag_b) = comm_identity(std::slice::from_ref(&b));
    let results = std::thread::scope(|s| {
        let run = |id: &UniqueId, r: usize, n: usize| {
            let id = id.clone();
            s.spawn(move || {
                let boot = Bootstrap::init(std::slice::from_ref(&id), r, n, T)?;
                boot.allgather(&[r as u8, n as u8])
            })
        };
        // Interleaved: A0, B1, A2, then the intruders, then B0 and A1.
        let mut hs = vec![run(&a, 0, 3)];
        wait_until("A0 is in", || ha.admitted.load(Ordering::Acquire) >= 1);
        hs.push(run(&b, 1, 2));
        wait_until("B1 is in", || hb.admitted.load(Ordering::Acquire) >= 1);
        hs.push(run(&a, 2, 3));
        wait_until("A2 is in", || ha.admitted.load(Ordering::Acquire) >= 2);

        // A's secret with B's context: the service answers with B's secret, which A's holder
        // cannot match.
        let mut forged = TcpStream::connect(b.root).unwrap();
        forged
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let e = auth::client(&mut forged, &a.secret, &root::root_context(&b)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
        // A's secret with a context naming A but a check-in meant for B's communicator: it lands
        // in A's session, which refuses it as another communicator's.
        let e = rogue_check_in(
            &a,
            CheckIn {
                rank: 0,
                nranks: 2,
                nroots: 1,
                root_index: 0,
                tag: tag_b,
                listen: "127.0.0.1:9".parse().unwrap(),
                card: Vec::new(),
            },
        );
        assert_eq!(e.kind, ErrorKind::InvalidUsage, "{}", e.msg);
        assert_eq!(
            hb.admitted.load(Ordering::Acquire),
            1,
            "B took in an intruder"
        );

        hs.push(run(&b, 0, 2));
        hs.push(run(&a, 1, 3));
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    let want_a = vec![vec![0, 3], vec![1, 3], vec![2, 3]];
    let want_b = vec![vec![0, 2], vec![1, 2]];
    let wants = [&want_a, &want_b, &want_a, &want_b, &want_a];
    for (r, want) in results.into_iter().zip(wants) {
        assert_eq!(&r.unwrap(), want);
    }
    wait_until("both sessions have ended", || ha.ended() && hb.ended());
    assert_eq!(service.live_sessions(), 0);
}

/// NCCL_COMM_ID mode with a COMM_SECRET that differs on one rank: that rank is told the
/// secrets most likely differ (it was told the rendezvous was over or had expired).
#[test]
fn a_different_secret_under_nccl_comm_id_is_named() {
    let _w = watchdog(
        "a_different_secret_under_nccl_comm_id_is_named",
        Duration::from_secs(60),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let spec = format!("127.0.0.1:{port}");
    let ours = id::id_from_comm_id(&spec, Some("one secret")).unwrap();
    let theirs = id::id_from_comm_id(&spec, Some("another secret")).unwrap();
    let short = Some(Duration::from_secs(3));
    std::thread::scope(|s| {
        let first =
            s.spawn(|| Bootstrap::init(std::slice::from_ref(&ours), 0, 2, short).map(|_| ()));
        // Rank 0 starts the root at init; rank 1 retries its connection until it is up.
        let e = Bootstrap::init(std::slice::from_ref(&theirs), 1, 2, short)
            .err()
            .expect("a rank with another secret must be refused");
        assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
        assert!(e.msg.contains("COMM_SECRET"), "{}", e.msg);
        assert!(first.join().unwrap().is_err());
    });
}

/// A refused connection to a loopback address may be a rank of another host that listens on
/// its loopback interface: the error says so, and which knob to look at.
#[test]
fn a_refused_loopback_peer_points_at_the_interface_knob() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let never = std::sync::atomic::AtomicBool::new(false);
    let w = Waiter::new(Some(Instant::now() + Duration::from_secs(5)), &never);
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let e = super::net::connect(addr, w, false, "rank 1").unwrap_err();
    assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
    assert!(e.msg.contains("NCCL_SOCKET_IFNAME"), "{}", e.msg);
}
