//! The conformance suite every `Link` passes: message order and lengths, tags, both kinds of
//! sink, zero-byte messages, a peer that closes (destroyed, aborted with a lost rank). It runs
//! against the shm transport (links made at first use and made at init) and the socket transports (with one socket per peer and with several, so that
//! large messages are cut across sockets) and InfiniBand over the tests' verbs model (one and
//! three queue pairs) between two ranks that are threads of this process, and the parts that
//! apply to a rank's channel to itself against loopback.

use super::{
    establish_with, Closing, InExpect, Link, Links, Offer, OutMsg, RecvCursor, SendCursor,
};
use super::{SendState, Sink};
use crate::bootstrap::{new_unique_id, Bootstrap};
use crate::error::{ErrorKind, Result};
use crate::reduce::Scale;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Shared memory, each link made at first use (NCCL_RUNTIME_CONNECT=1).
    Shm,
    /// Shared memory, every link made at init.
    ShmAtInit,
    /// TCP with this many sockets per peer.
    Socket(usize),
    /// InfiniBand over the model, with this many queue pairs per peer.
    Ib(usize),
}

/// The tests' verbs model, which names this crate `comm` as the integration tests do. Its items
/// are `pub` for the integration tests that share the file.
#[allow(dead_code, unreachable_pub)]
mod ibmodel {
    use crate as comm;
    include!("../../tests/common/ibmodel.rs");
}

/// Two ranks' links to each other (and their bootstraps, kept alive with them).
struct Pair {
    _boots: Vec<Bootstrap>,
    links: Vec<Links>,
}

impl Pair {
    fn new(kind: Kind) -> Pair {
        let id = new_unique_id().expect("unique id");
        let fabric = ibmodel::Fabric::new(ibmodel::Faults::default());
        let t = Some(Duration::from_secs(30));
        let made: Vec<(Bootstrap, Links)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let id = id.clone();
                    let fabric = fabric.clone();
                    s.spawn(move || {
                        crate::transport::shm::DEMAND_FOR_TEST
                            .with(|c| c.set(Some(kind == Kind::Shm)));
                        if let Kind::Socket(n) = kind {
                            super::net::SOCKETS_FOR_TEST.with(|c| c.set(Some(n)));
                        }
                        if let Kind::Ib(n) = kind {
                            let model = ibmodel::ModelProvider {
                                fabric: Some(fabric),
                            };
                            super::net::ib::PROVIDER_FOR_TEST
                                .with(|c| *c.borrow_mut() = Some(Arc::new(model)));
                            super::net::ib::QPS_FOR_TEST.with(|c| c.set(Some(n)));
                        }
                        let boot = Bootstrap::init(&[id], r, 2, t).expect("bootstrap");
                        let me = crate::topo::this_process();
                        let placements = vec![me.clone(), me];
                        let deadline = Some(Instant::now() + Duration::from_secs(30));
                        let links = establish_with(
                            &boot,
                            &placements,
                            0xc0ffee,
                            deadline,
                            matches!(kind, Kind::Shm | Kind::ShmAtInit),
                            &super::net::NetChoice::resolve(None).expect("net"),
                        )
                        .expect("links");
                        let mapped = links
                            .transports
                            .find::<crate::transport::shm::ShmWorld>()
                            .map(|w| w.mapped());
                        match kind {
                            Kind::Shm => assert_eq!(mapped, Some(0), "nothing mapped before use"),
                            Kind::ShmAtInit => assert_eq!(mapped, Some(1)),
                            _ => {}
                        }
                        (boot, links)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (boots, links) = made.into_iter().unzip();
        Pair {
            _boots: boots,
            links,
        }
    }

    /// Rank `from`'s link to the other rank.
    fn link(&self, from: usize) -> Arc<dyn Link> {
        self.links[from].links[1 - from].clone()
    }
}

/// A receive buffer; `direct` lets the link write into it, otherwise bytes come through `put`.
struct TestSink {
    buf: Vec<u8>,
    direct: bool,
    /// Every piece delivered: (offset, length).
    pieces: Vec<(usize, usize)>,
    scale: Option<Scale>,
}

impl TestSink {
    fn new(len: usize, direct: bool) -> TestSink {
        TestSink {
            buf: vec![0; len],
            direct,
            pieces: Vec::new(),
            scale: None,
        }
    }
}

impl Sink for TestSink {
    fn direct(&mut self) -> Option<*mut u8> {
        self.direct.then_some(self.buf.as_mut_ptr())
    }

    fn put(&mut self, offset: usize, data: &[u8], scale: Option<Scale>) -> Result<()> {
        self.buf[offset..offset + data.len()].copy_from_slice(data);
        self.pieces.push((offset, data.len()));
        self.scale = scale;
        Ok(())
    }

    fn placed(&mut self, offset: usize, len: usize, scale: Option<Scale>) -> Result<()> {
        self.pieces.push((offset, len));
        self.scale = scale;
        Ok(())
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Sends `msgs` (payload, tag) on `tx` while `rx` receives them expecting `expect`, both driven
/// from this thread as the executor would. Returns each received message's sink.
fn transfer(
    tx: &dyn Link,
    rx: &dyn Link,
    msgs: &[(Vec<u8>, u64)],
    expect: &[(usize, u64)],
    direct: bool,
) -> Result<Vec<TestSink>> {
    transfer_offered(tx, rx, msgs, expect, direct, Offer::default())
}

/// `transfer`, each message sent with `offer`.
fn transfer_offered(
    tx: &dyn Link,
    rx: &dyn Link,
    msgs: &[(Vec<u8>, u64)],
    expect: &[(usize, u64)],
    direct: bool,
    offer: Offer,
) -> Result<Vec<TestSink>> {
    let mut sends: Vec<SendCursor> = vec![SendCursor::default(); msgs.len()];
    let mut done_send = vec![false; msgs.len()];
    let mut next_send = 0;
    let mut got: Vec<TestSink> = Vec::new();
    let mut cur = RecvCursor::default();
    let mut sink = expect.first().map(|e| TestSink::new(e.0, direct));
    let started = Instant::now();
    while got.len() < expect.len() || done_send.iter().any(|d| !d) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "transfer stalled: {} of {} received, sends done {:?}, expecting {:?}",
            got.len(),
            expect.len(),
            done_send,
            expect
        );
        // Sends start in order; a posted one is polled until its buffer is free.
        for i in 0..msgs.len() {
            if done_send[i] || i > next_send {
                continue;
            }
            let (data, tag) = &msgs[i];
            let m = OutMsg {
                src: data.as_ptr(),
                len: data.len(),
                scale: None,
                tag: *tag,
            };
            match tx.send_offered(&m, offer, &mut sends[i])?.state {
                SendState::Pending => break,
                SendState::Posted => next_send = next_send.max(i + 1),
                SendState::Complete => {
                    done_send[i] = true;
                    next_send = next_send.max(i + 1);
                }
            }
        }
        if let Some(s) = sink.as_mut() {
            let (len, tag) = expect[got.len()];
            let p = rx.recv(&InExpect { len, tag }, &mut cur, s)?;
            if p.state {
                got.push(sink.take().unwrap());
                cur = RecvCursor::default();
                sink = expect.get(got.len()).map(|e| TestSink::new(e.0, direct));
            } else if !p.moved {
                // As the executor does when a channel is idle: is the peer still there?
                rx.check_peer()?;
            }
        }
    }
    Ok(got)
}

const LENGTHS: [usize; 7] = [0, 1, 7, 4096, 0, 300_001, (1 << 20) + 12];

fn messages(seed: u8) -> Vec<(Vec<u8>, u64)> {
    LENGTHS
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            (
                pattern(l, seed + i as u8),
                crate::tag::tag(crate::tag::kind::ALL_REDUCE, 0x100 + i as u64),
            )
        })
        .collect()
}

fn order_and_lengths(tx: &dyn Link, rx: &dyn Link, direct: bool) {
    order_and_lengths_offered(tx, rx, direct, Offer::default())
}

/// `order_and_lengths`, each message sent with `offer`: a link may take any of it up or
/// ignore it, and the same bytes arrive.
fn order_and_lengths_offered(tx: &dyn Link, rx: &dyn Link, direct: bool, offer: Offer) {
    let msgs = messages(if direct { 3 } else { 5 });
    let expect: Vec<(usize, u64)> = msgs.iter().map(|(d, t)| (d.len(), *t)).collect();
    let got = transfer_offered(tx, rx, &msgs, &expect, direct, offer).expect("transfer");
    for (i, (sink, (data, _))) in got.iter().zip(&msgs).enumerate() {
        assert_eq!(&sink.buf, data, "message {i} of {} bytes", data.len());
        let covered: usize = sink.pieces.iter().map(|p| p.1).sum();
        assert_eq!(covered, data.len(), "message {i}: pieces {:?}", sink.pieces);
        // Pieces are whole chunks: every piece but the last a multiple of 8 bytes.
        for &(off, len) in &sink.pieces {
            assert_eq!(off % 8, 0, "message {i}: piece at {off}");
            assert!(
                len % 8 == 0 || off + len == data.len(),
                "message {i}: piece {len}"
            );
        }
    }
}

fn suite(kind: Kind) {
    let pair = Pair::new(kind);
    let (a, b) = (pair.link(0), pair.link(1));
    // Both directions, both kinds of sink.
    order_and_lengths(&*a, &*b, true);
    // (TCP links connect at their first use, so they say how only afterwards.)
    if let Kind::Socket(n @ 2..) = kind {
        let d = a.describe();
        assert!(d.contains(&format!("({n} sockets)")), "{d}");
    }
    order_and_lengths(&*b, &*a, false);
    order_and_lengths(&*a, &*b, false);
    // What the executor offers about a message changes at most how it travels.
    let busy = Offer {
        sender_busy: true,
        copied: true,
        reply_at: None,
    };
    order_and_lengths_offered(&*a, &*b, true, busy);
    order_and_lengths_offered(&*b, &*a, false, busy);

    // A receive that expects another tag or length is refused, naming both.
    let msgs = vec![(
        pattern(64, 1),
        crate::tag::tag(crate::tag::kind::ALL_REDUCE, 0x42),
    )];
    let e = transfer(
        &*a,
        &*b,
        &msgs,
        &[(64, crate::tag::tag(crate::tag::kind::BROADCAST, 0x42))],
        true,
    )
    .err()
    .expect("a tag mismatch is an error");
    assert_eq!(e.kind, ErrorKind::InvalidUsage, "{}", e.msg);
    assert!(
        e.msg.contains("AllReduce") && e.msg.contains("Broadcast"),
        "{}",
        e.msg
    );
}

fn closing(kind: Kind) {
    let pair = Pair::new(kind);
    let (a, b) = (pair.link(0), pair.link(1));
    // What was sent before the close still arrives; then the close is an error naming it.
    let msgs = vec![(
        pattern(1000, 9),
        crate::tag::tag(crate::tag::kind::ALL_REDUCE, 0x07),
    )];
    let got = transfer(
        &*a,
        &*b,
        &msgs,
        &[(1000, crate::tag::tag(crate::tag::kind::ALL_REDUCE, 0x07))],
        true,
    )
    .unwrap();
    assert_eq!(got[0].buf, msgs[0].0);
    a.close(Closing::Destroyed, None);
    let e = transfer(
        &*a,
        &*b,
        &[],
        &[(8, crate::tag::tag(crate::tag::kind::ALL_REDUCE, 0x08))],
        true,
    )
    .err()
    .expect("a receive after the peer destroyed its end fails");
    assert_eq!(e.kind, ErrorKind::Remote);
    assert!(e.msg.contains("rank 0 destroyed"), "{}", e.msg);
    assert_eq!(e.lost, Some(0));
    assert!(b.check_peer().is_err());

    let pair = Pair::new(kind);
    let (mut a, mut b) = (pair.link(0), pair.link(1));
    let mut closer = 0;
    if matches!(kind, Kind::Socket(_) | Kind::Ib(_)) {
        // Network links connect at first use, the lower rank dialling; a lower rank that
        // closes before it dialled tells nothing (see `net::on_demand`), a higher one answers
        // the dial with its close.
        std::mem::swap(&mut a, &mut b);
        closer = 1;
    }
    a.close(Closing::Aborted, Some(7));
    let e = transfer(
        &*a,
        &*b,
        &[],
        &[(8, crate::tag::tag(crate::tag::kind::ALL_REDUCE, 0x08))],
        false,
    )
    .err()
    .expect("a receive after the peer aborted fails");
    assert!(
        e.msg.contains(&format!("rank {closer} aborted")) && e.msg.contains("after it lost rank 7"),
        "{}",
        e.msg
    );
    assert_eq!(e.lost, Some(7));
}

#[test]
fn shm_links_conform() {
    suite(Kind::Shm);
    closing(Kind::Shm);
}

#[test]
fn shm_links_made_at_init_conform() {
    suite(Kind::ShmAtInit);
    closing(Kind::ShmAtInit);
}

#[test]
fn socket_links_conform() {
    suite(Kind::Socket(1));
    closing(Kind::Socket(1));
}

#[test]
fn socket_links_with_several_sockets_conform() {
    for n in [2, 4] {
        suite(Kind::Socket(n));
        closing(Kind::Socket(n));
    }
}

#[test]
fn ib_links_over_the_model_conform() {
    for n in [1, 3] {
        suite(Kind::Ib(n));
        closing(Kind::Ib(n));
    }
}

#[test]
fn loopback_links_conform() {
    let l = super::loopback::Loopback::default();
    for direct in [true, false] {
        let msgs = messages(11);
        let expect: Vec<(usize, u64)> = msgs.iter().map(|(d, t)| (d.len(), *t)).collect();
        let got = transfer(&l, &l, &msgs, &expect, direct).expect("transfer");
        for (sink, (data, _)) in got.iter().zip(&msgs) {
            assert_eq!(&sink.buf, data);
        }
    }
}
