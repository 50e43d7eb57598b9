//! The host executor's tests: one rank driving loopback and in-memory links.

use super::blame::count_repeats;
use super::engine::LOSS_GRACE;
use super::hazards::{Hazards, Hint, Near};
use super::placement::{crowding, stuck, Crowding, PeerSeen, WAKE_GRACE};
use super::plan::{overlaps, Action, Src, XStep};
use super::sink::combine;
use super::straight::{run_again, STRAIGHT_RUNS};
use super::*;
use crate::algo::{direct, ring, tree, Buf, Operand, Region, Schedule, Shape, Step};
use crate::error::{Error, ErrorKind, Result};
use crate::exec::op::Reduction;
use crate::reduce::{DataType, ReduceOp, Reducer, Scale};
use crate::transport::loopback::Loopback;
use crate::transport::{Closing, LocalDoorbell};
use crate::transport::{
    Doorbell, InExpect, Link, OutMsg, Progress, RecvCursor, SendCursor, SendState, Sink,
};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A peer whose bytes become visible only after the executor has noticed that the peer
/// left: the order a slow receiver sees when the sender finishes and destroys its end
/// between two of the receiver's passes.
#[derive(Default)]
struct DepartedAfterSending {
    payload: Vec<u8>,
    checks: AtomicUsize,
    /// Passes (receive attempts) after the first peer check that still see nothing.
    hidden_after_check: usize,
    attempts_after_check: AtomicUsize,
}

impl Link for DepartedAfterSending {
    fn send(&self, _: &OutMsg, _: &mut SendCursor) -> Result<Progress<SendState>> {
        crate::internal_err!("this peer only sends")
    }

    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        let idle = Progress {
            state: false,
            moved: false,
        };
        if self.checks.load(Ordering::SeqCst) == 0 {
            return Ok(idle);
        }
        if self.attempts_after_check.fetch_add(1, Ordering::SeqCst) < self.hidden_after_check {
            return Ok(idle);
        }
        assert_eq!(expect.len, self.payload.len());
        deliver(&self.payload, cur, sink)
    }

    fn check_peer(&self) -> Result<()> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        crate::remote_err!("rank 1 destroyed its communicator while this rank still needs it")
    }

    fn describe(&self) -> String {
        "test/departed".into()
    }
}

/// A receive's whole message `bytes` put at once: the receive is complete.
fn deliver(bytes: &[u8], cur: &mut RecvCursor, sink: &mut dyn Sink) -> Result<Progress<bool>> {
    sink.put(0, bytes, None)?;
    cur.received = bytes.len();
    Ok(Progress {
        state: true,
        moved: true,
    })
}

fn wiring(peer: Arc<DepartedAfterSending>) -> Wiring {
    wiring_at(peer, None)
}

/// `wiring` for a rank whose place among its host's ranks is `home`, with `peer` as rank 1.
fn wiring_at(peer: Arc<dyn Link>, home: Option<usize>) -> Wiring {
    Wiring {
        rank: 0,
        links: vec![Arc::new(Loopback::default()), peer],
        doorbell: Arc::new(crate::transport::LocalDoorbell::default()),
        presence: None,
        warm: None,
        abort: Arc::new(AtomicBool::new(false)),
        timeout: Limit::new(Some(Duration::from_secs(20))),
        warn_after: Duration::from_secs(60),
        cache: Mutex::new(Default::default()),
        spin: Duration::ZERO,
        yield_for: Duration::ZERO,
        spread: false,
        hand_over: false,
        home,
        huge_pages_from: None,
    }
}

fn receive_from_rank_1(w: &Wiring, dst: &mut [u8]) -> Result<()> {
    let mut schedule = Schedule::default();
    schedule.steps.push(Step::Recv {
        peer: 1,
        dst: Region::new(Buf::Recv, 0, dst.len()),
        reduce_with: None,
        last: true,
    });
    schedule.recv_extent = dst.len();
    run_one(
        w,
        HostOp {
            schedule: Arc::new(schedule),
            send: dst.as_ptr(),
            recv: dst.as_mut_ptr(),
            tag: crate::tag::tag(crate::tag::kind::ALL_REDUCE, 1),
            reduction: None,
        },
        None,
    )
}

/// A peer whose message arrives `ready_after` the first look for it (where it says it runs:
/// `WakingPresence`).
struct WakingPeer {
    ready_after: Duration,
    first_look: Mutex<Option<Instant>>,
}

impl Link for WakingPeer {
    fn send(&self, _: &OutMsg, _: &mut SendCursor) -> Result<Progress<SendState>> {
        crate::internal_err!("this peer only sends")
    }

    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        let first = *self.first_look.lock().get_or_insert_with(Instant::now);
        if first.elapsed() < self.ready_after {
            return Ok(Progress {
                state: false,
                moved: false,
            });
        }
        deliver(&vec![7u8; expect.len], cur, sink)
    }

    fn check_peer(&self) -> Result<()> {
        Ok(())
    }

    fn describe(&self) -> String {
        "test/waking".into()
    }
}

/// A doorbell that counts the sleeps taken on it.
#[derive(Default)]
struct CountingDoorbell {
    inner: crate::transport::LocalDoorbell,
    sleeps: AtomicUsize,
}

impl crate::transport::Doorbell for CountingDoorbell {
    fn ring(&self) {
        self.inner.ring()
    }
    fn prepare_sleep(&self) -> u32 {
        self.inner.prepare_sleep()
    }
    fn cancel_sleep(&self) {
        self.inner.cancel_sleep()
    }
    fn sleep(&self, seen: u32, timeout: Duration) {
        self.sleeps.fetch_add(1, Ordering::SeqCst);
        self.inner.sleep(seen, timeout)
    }
}

/// Where a `WakingPeer` says it runs: on a CPU no test machine has (never this rank's),
/// asleep or polling.
struct WakingPresence {
    asleep: bool,
}

impl Presence for WakingPresence {
    fn set_running_on(&self, _cpu: u32, _what: Activity) {}

    fn heartbeat(&self) {}

    fn running_on(&self, rank: usize) -> Option<(u32, Activity)> {
        let what = if self.asleep {
            Activity::Sleeping
        } else {
            Activity::Polling
        };
        (rank == 1).then_some((4000, what))
    }

    fn stalled(&self, _rank: usize, _now: Instant, _after: Duration) -> bool {
        false
    }
}

/// How many times a rank with a 50 us spin window slept while it received from a peer
/// that says it sleeps (or polls) and whose message comes `ready_after` the first look.
fn sleeps_waiting_for(asleep: bool, ready_after: Duration) -> usize {
    let doorbell = Arc::new(CountingDoorbell::default());
    let peer = Arc::new(WakingPeer {
        ready_after,
        first_look: Mutex::new(None),
    });
    let w = Wiring {
        doorbell: doorbell.clone(),
        presence: Some(Arc::new(WakingPresence { asleep })),
        spin: Duration::from_micros(50),
        spread: true,
        ..wiring_at(peer, None)
    };
    let mut dst = vec![0u8; 8];
    receive_from_rank_1(&w, &mut dst).expect("the message comes");
    assert_eq!(dst, vec![7u8; 8]);
    doorbell.sleeps.load(Ordering::SeqCst)
}

/// A peer that sleeps on its doorbell is waking (or will be woken): waiting for it, a rank
/// stays awake past its spin window, up to `WAKE_GRACE`, instead of sleeping in turn; a
/// peer that polls gets the spin window only, and a sleeper that takes longer than the
/// grace lets the rank sleep.
#[test]
fn a_rank_stays_awake_for_a_peer_that_is_waking() {
    let soon = Duration::from_micros(150);
    let late = WAKE_GRACE * 4;
    assert!(
        sleeps_waiting_for(false, late) >= 1,
        "a polling peer's message late: the rank sleeps after its spin window"
    );
    assert!(
        sleeps_waiting_for(true, late) >= 1,
        "a sleeping peer that takes longer than the grace: the rank sleeps"
    );
    // Past the 50 us window, within the grace: the rank never slept in at least two of
    // three tries (a try can lose the CPU for longer than the grace on a busy machine).
    let awake = (0..3)
        .filter(|_| sleeps_waiting_for(true, soon) == 0)
        .count();
    assert!(
        awake >= 2,
        "slept waiting for a waking peer in {} of 3 tries",
        3 - awake
    );
}

/// The first communicator a thread creates moves it onto the CPU its place numbers among
/// those of its mask; the thread's later communicators leave it where it is.
#[test]
fn a_thread_settles_where_its_first_communicator_places_it() {
    std::thread::spawn(|| {
        let mask = crate::sys::cpus_allowed();
        // SAFETY: no preconditions.
        let here = unsafe { libc::sched_getcpu() } as u32;
        let peer = || Arc::new(DepartedAfterSending::default());
        let Some(k) = mask.iter().position(|&c| c != here) else {
            assert_eq!(
                wiring_at(peer(), Some(0)).settle(),
                None,
                "one CPU: nowhere to go"
            );
            return;
        };
        let to = wiring_at(peer(), Some(k)).settle();
        // SAFETY: no preconditions.
        let now = unsafe { libc::sched_getcpu() } as u32;
        // The scheduler may have put the thread there meanwhile: then it need not move.
        assert!(
            to == Some(mask[k]) || (to.is_none() && now == mask[k]),
            "placed on {}, moved to {to:?}, runs on {now}",
            mask[k]
        );
        assert_eq!(crate::sys::cpus_allowed(), mask, "the mask stays whole");
        let other = (k + 1) % mask.len();
        assert_eq!(
            wiring_at(peer(), Some(other)).settle(),
            None,
            "a second communicator moved the thread"
        );
    })
    .join()
    .unwrap();
    std::thread::spawn(|| {
        let peer = Arc::new(DepartedAfterSending::default());
        assert_eq!(wiring_at(peer, None).settle(), None, "no place, no move");
    })
    .join()
    .unwrap();
}

/// Which peers count as waiting for this rank's CPU (3 here): any that last ran on it;
/// elsewhere, one that polls or sleeps without a sign of life, never one back in its
/// application (it may compute for long), and the stall is only asked about when needed.
#[test]
fn a_peer_is_stuck_behind_this_cpu_when_it_cannot_be_running() {
    use Activity::*;
    let never = || -> bool { panic!("the stall did not matter") };
    for what in [Polling, Sleeping, Outside] {
        assert!(stuck(3, (3, what), never), "{what:?} on this CPU");
    }
    for what in [Polling, Sleeping] {
        assert!(stuck(3, (1, what), || true), "{what:?} elsewhere, stalled");
        assert!(!stuck(3, (1, what), || false), "{what:?} elsewhere, alive");
    }
    assert!(!stuck(3, (1, Outside), never), "outside, elsewhere");
}

/// A rank on CPU 3 and what it does about its peers: nothing when none is stuck; when
/// two share its CPU only the higher moves; a move avoids every CPU a peer said it runs on,
/// stalled or not (a moving peer is silent, a sleeping one is held where it sleeps).
#[test]
fn only_the_higher_of_two_ranks_on_one_cpu_moves_and_never_onto_a_peer() {
    let seen = |cpu, stuck, above| PeerSeen { cpu, stuck, above };
    let of = |v: Vec<PeerSeen>| crowding(3, move || v.clone().into_iter());
    assert_eq!(of(vec![]), Crowding::Alone);
    assert_eq!(of(vec![seen(1, false, true)]), Crowding::Alone);
    // Both on CPU 3: the lower rank gives way, the higher one moves.
    assert_eq!(of(vec![seen(3, true, true)]), Crowding::GiveWay);
    assert_eq!(
        of(vec![seen(3, true, false)]),
        Crowding::Move { avoid: vec![] }
    );
    // A peer that announced CPU 0 and went silent while it moves there, or that sleeps on
    // CPU 0 and was woken a moment ago: this rank must not go to 0.
    assert_eq!(
        of(vec![seen(0, true, false)]),
        Crowding::Move { avoid: vec![0] }
    );
    // Where peers sleep (1) or run (0, 2) is taken as well as where they poll.
    assert_eq!(
        of(vec![
            seen(3, true, false),
            seen(0, false, true),
            seen(1, false, true),
            seen(2, true, false),
        ]),
        Crowding::Move {
            avoid: vec![0, 1, 2]
        }
    );
}

#[test]
fn a_departed_peer_whose_bytes_arrived_does_not_fail_the_receiver() {
    let peer = Arc::new(DepartedAfterSending {
        payload: (0..=255).collect(),
        checks: AtomicUsize::new(0),
        hidden_after_check: 0,
        attempts_after_check: AtomicUsize::new(0),
    });
    let w = wiring(peer.clone());
    let mut dst = vec![0u8; 256];
    receive_from_rank_1(&w, &mut dst).expect("every byte was there after the departure");
    assert_eq!(dst, peer.payload);
    assert!(peer.checks.load(Ordering::SeqCst) >= 1);
}

#[test]
fn a_departed_peer_whose_bytes_never_come_fails_the_receiver() {
    let peer = Arc::new(DepartedAfterSending {
        payload: vec![7; 16],
        checks: AtomicUsize::new(0),
        hidden_after_check: usize::MAX,
        attempts_after_check: AtomicUsize::new(0),
    });
    let w = wiring(peer.clone());
    let mut dst = vec![0u8; 16];
    let t = Instant::now();
    let e = receive_from_rank_1(&w, &mut dst).expect_err("the bytes never come");
    assert_eq!(e.kind, ErrorKind::Remote);
    assert!(e.msg.contains("rank 1 destroyed"), "{}", e.msg);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(dst, vec![0u8; 16]);
}

// ---------------------------------------------------------------------------------------
// The executor over an in-memory mesh: ranks are threads, links hand messages across.

/// A message in flight: its bytes, tag and scale.
type Message = (Vec<u8>, u64, Option<Scale>);

/// One direction of an in-memory channel: whole messages, in order.
#[derive(Default)]
struct Channel {
    msgs: Mutex<VecDeque<Message>>,
}

/// A link between two ranks of this process. A send copies the message into the channel at
/// once (so it completes in one call); a receive hands it to the sink in pieces of at most
/// `piece` bytes per call, so that one message spans several passes of the executor.
struct MemLink {
    out: Arc<Channel>,
    inbox: Arc<Channel>,
    /// The receiving rank's doorbell, rung on every send.
    peer_bell: Arc<LocalDoorbell>,
    piece: usize,
    /// Bytes of the first message in the inbox handed to a sink so far: a receive cursor
    /// must say the same (the executor never loses a receive's progress).
    handed: Mutex<usize>,
    /// How this end was closed, if it was.
    closed: Mutex<Option<(Closing, Option<usize>)>>,
    /// From this instant on the peer (this rank) counts as lost: sends and `check_peer`
    /// fail.
    lost_from: Mutex<Option<(Instant, usize)>>,
}

impl MemLink {
    fn lost(&self) -> Result<()> {
        match *self.lost_from.lock() {
            Some((t, r)) if Instant::now() >= t => {
                Err(Error::lost_peer(r, format!("rank {r} is gone")))
            }
            _ => Ok(()),
        }
    }
}

impl Link for MemLink {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>> {
        self.lost()?;
        // SAFETY: the executor keeps `src` valid for `len` bytes until the send completes.
        let data = unsafe { std::slice::from_raw_parts(msg.src, msg.len) }.to_vec();
        self.out.msgs.lock().push_back((data, msg.tag, msg.scale));
        cur.started = true;
        cur.sent = msg.len;
        self.peer_bell.ring();
        Ok(Progress {
            state: SendState::Complete,
            moved: true,
        })
    }

    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        let mut q = self.inbox.msgs.lock();
        let Some((data, tag, scale)) = q.front() else {
            return Ok(Progress {
                state: false,
                moved: false,
            });
        };
        if data.len() != expect.len || *tag != expect.tag {
            return crate::invalid_usage!(
                "{} bytes tagged {tag:#x} arrived where {} bytes tagged {:#x} were expected",
                data.len(),
                expect.len,
                expect.tag
            );
        }
        let mut handed = self.handed.lock();
        if cur.received != *handed {
            return crate::internal_err!(
                "a receive resumed at byte {} of a message {} bytes of which were handed over",
                cur.received,
                *handed
            );
        }
        let end = data.len().min(cur.received + self.piece);
        sink.put(cur.received, &data[cur.received..end], *scale)?;
        cur.started = true;
        cur.received = end;
        *handed = end;
        let done = end == data.len();
        if done {
            q.pop_front();
            *handed = 0;
        }
        Ok(Progress {
            state: done,
            moved: true,
        })
    }

    fn check_peer(&self) -> Result<()> {
        self.lost()
    }

    fn describe(&self) -> String {
        "test/memory".into()
    }

    fn close(&self, how: Closing, lost: Option<usize>) {
        *self.closed.lock() = Some((how, lost));
    }
}

/// `n` ranks joined by memory links (loopback to themselves); `mem[a][b]` is rank a's link
/// to rank b.
struct Mesh {
    wirings: Vec<Wiring>,
    mem: Vec<Vec<Option<Arc<MemLink>>>>,
}

fn mesh(n: usize, piece: usize, timeout: Duration) -> Mesh {
    let bells: Vec<Arc<LocalDoorbell>> = (0..n).map(|_| Arc::default()).collect();
    let chans: Vec<Vec<Arc<Channel>>> = (0..n)
        .map(|_| (0..n).map(|_| Arc::default()).collect())
        .collect();
    let mem: Vec<Vec<Option<Arc<MemLink>>>> = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| {
                    (a != b).then(|| {
                        Arc::new(MemLink {
                            out: chans[a][b].clone(),
                            inbox: chans[b][a].clone(),
                            peer_bell: bells[b].clone(),
                            piece,
                            handed: Mutex::new(0),
                            closed: Mutex::new(None),
                            lost_from: Mutex::new(None),
                        })
                    })
                })
                .collect()
        })
        .collect();
    let wirings = (0..n)
        .map(|a| Wiring {
            rank: a,
            links: (0..n)
                .map(|b| match &mem[a][b] {
                    Some(l) => l.clone() as Arc<dyn Link>,
                    None => Arc::new(Loopback::default()) as Arc<dyn Link>,
                })
                .collect(),
            doorbell: bells[a].clone(),
            presence: None,
            warm: None,
            abort: Arc::new(AtomicBool::new(false)),
            timeout: Limit::new(Some(timeout)),
            warn_after: Duration::from_secs(60),
            cache: Mutex::new(Default::default()),
            spin: Duration::ZERO,
            yield_for: Duration::ZERO,
            spread: false,
            hand_over: false,
            home: None,
            huge_pages_from: None,
        })
        .collect();
    Mesh { wirings, mem }
}

/// Runs `body(rank, wiring)` for every rank of `wirings`, each on a thread of its own.
fn on_threads<T: Send>(wirings: &[Wiring], body: impl Fn(usize, &Wiring) -> T + Sync) -> Vec<T> {
    let body = &body;
    std::thread::scope(|s| {
        let hs: Vec<_> = wirings
            .iter()
            .enumerate()
            .map(|(r, w)| s.spawn(move || body(r, w)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn shape(rank: usize, nranks: usize, elem: usize, in_place: bool, slice_bytes: usize) -> Shape {
    Shape {
        rank,
        nranks,
        elem,
        in_place,
        slice_bytes,
        ring: None,
        hosts: None,
    }
}

fn plain(dtype: DataType) -> Reduction {
    Reduction {
        reducer: Reducer::new(dtype, ReduceOp::Sum),
        input_scale: None,
        input_scale_at: None,
        divide_by: None,
    }
}

const ALL_REDUCE_TAG: u64 = crate::tag::tag(crate::tag::kind::ALL_REDUCE, 1);

/// This rank's part of a ring all-reduce of `input` (4-byte elements, 64-byte slices): the
/// bytes of the result.
fn ring_all_reduce(
    w: &Wiring,
    nranks: usize,
    input: &[u8],
    in_place: bool,
    reduction: Reduction,
) -> Result<Vec<u8>> {
    let count = input.len() / 4;
    let schedule = ring::all_reduce(count, &shape(w.rank, nranks, 4, in_place, 64));
    let mut send = input.to_vec();
    let mut recv = vec![0u8; input.len()];
    let sp = send.as_mut_ptr();
    let rp = if in_place { sp } else { recv.as_mut_ptr() };
    run_one(
        w,
        HostOp {
            schedule: Arc::new(schedule),
            send: sp,
            recv: rp,
            tag: ALL_REDUCE_TAG,
            reduction: Some(reduction),
        },
        None,
    )?;
    Ok(if in_place { send } else { recv })
}

fn i32s(v: impl IntoIterator<Item = i32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn as_i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn as_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Rank r's i-th input: distinct per rank and element, some negative.
fn value(rank: usize, i: usize) -> i32 {
    (rank as i32 + 1) * 1000 + (i % 97) as i32 - 40
}

/// Three ranks, a count the rank count does not divide, 64-byte slices and messages that
/// arrive in 24-byte pieces: every element is the sum of the three inputs, out of place
/// and in place.
#[test]
fn a_ring_all_reduce_over_three_ranks_sums_every_element() {
    let (n, count) = (3, 1001);
    for in_place in [false, true] {
        let m = mesh(n, 24, Duration::from_secs(20));
        let out = on_threads(&m.wirings, |r, w| {
            let input = i32s((0..count).map(|i| value(r, i)));
            ring_all_reduce(w, n, &input, in_place, plain(DataType::Int32))
        });
        for (r, res) in out.into_iter().enumerate() {
            let got = as_i32s(&res.unwrap_or_else(|e| panic!("rank {r}: {}", e.msg)));
            assert_eq!(got.len(), count);
            for (i, &g) in got.iter().enumerate() {
                let want: i32 = (0..n).map(|q| value(q, i)).sum();
                assert_eq!(g, want, "rank {r} element {i} (in place: {in_place})");
            }
        }
    }
}

/// An integer average divides the sum once, at the step that makes final values
/// (truncating toward zero).
#[test]
fn an_integer_average_divides_once_at_the_end() {
    let (n, count) = (3, 257);
    let m = mesh(n, 1 << 20, Duration::from_secs(20));
    let out = on_threads(&m.wirings, |r, w| {
        let input = i32s((0..count).map(|i| value(r, i) * if i % 2 == 0 { 1 } else { -1 }));
        let reduction = Reduction {
            divide_by: Some(n),
            ..plain(DataType::Int32)
        };
        ring_all_reduce(w, n, &input, false, reduction)
    });
    for (r, res) in out.into_iter().enumerate() {
        let got = as_i32s(&res.unwrap());
        for (i, &g) in got.iter().enumerate() {
            let sign = if i % 2 == 0 { 1 } else { -1 };
            let sum: i32 = (0..n).map(|q| value(q, i) * sign).sum();
            assert_eq!(g, sum / n as i32, "rank {r} element {i}");
        }
    }
}

/// A PreMulSum scalar multiplies each rank's own input exactly once, however many hops
/// the partial sums make.
#[test]
fn an_input_scale_applies_once_per_input() {
    let (n, count) = (3, 300);
    let m = mesh(n, 1 << 20, Duration::from_secs(20));
    let half = Scale::from_bytes(DataType::Float32, &0.5f32.to_ne_bytes());
    let out = on_threads(&m.wirings, |r, w| {
        let input = f32s((0..count).map(|i| value(r, i) as f32));
        let reduction = Reduction {
            input_scale: Some(half),
            ..plain(DataType::Float32)
        };
        ring_all_reduce(w, n, &input, false, reduction)
    });
    for (r, res) in out.into_iter().enumerate() {
        let got = as_f32s(&res.unwrap());
        for (i, &g) in got.iter().enumerate() {
            let want: f32 = (0..n).map(|q| value(q, i) as f32 * 0.5).sum();
            assert_eq!(g, want, "rank {r} element {i}");
        }
    }
}

/// A call repeating the last one (same schedule and buffers) reuses its built steps: every
/// repetition still runs from the start on the inputs it is given, a new input scale is
/// honoured, and a different call in between changes nothing.
#[test]
fn a_repeated_call_starts_afresh_with_its_own_inputs_and_scale() {
    let (n, count) = (3, 300);
    let m = mesh(n, 256, Duration::from_secs(20));
    let scales = [Some(0.5f32), Some(0.25), None, Some(0.5)];
    let out = on_threads(&m.wirings, |r, w| {
        let shape = shape(r, n, 4, false, 64);
        let schedule = Arc::new(ring::all_reduce(count, &shape));
        let other = Arc::new(ring::all_reduce(count / 2, &shape));
        let mut send = vec![0u8; count * 4];
        let mut recv = vec![0u8; count * 4];
        let mut results = Vec::new();
        for (k, scale) in scales.iter().enumerate() {
            send.copy_from_slice(&f32s((0..count).map(|i| (value(r, i) + k as i32) as f32)));
            let reduction = Reduction {
                input_scale: scale.map(|s| Scale::from_bytes(DataType::Float32, &s.to_ne_bytes())),
                ..plain(DataType::Float32)
            };
            let op = |schedule: &Arc<Schedule>, recv: &mut Vec<u8>| HostOp {
                schedule: schedule.clone(),
                send: send.as_ptr(),
                recv: recv.as_mut_ptr(),
                tag: ALL_REDUCE_TAG + k as u64,
                reduction: Some(reduction),
            };
            run_one(w, op(&schedule, &mut recv), None)?;
            results.push(as_f32s(&recv));
            if k == 1 {
                let mut elsewhere = vec![0u8; count * 4];
                run_one(w, op(&other, &mut elsewhere), None)?;
            }
        }
        Ok(results)
    });
    for (r, res) in out.into_iter().enumerate() {
        let res = res.unwrap_or_else(|e: Error| panic!("rank {r}: {}", e.msg));
        for (k, (got, scale)) in res.iter().zip(scales).enumerate() {
            for (i, &g) in got.iter().enumerate() {
                let want: f32 = (0..n)
                    .map(|q| (value(q, i) + k as i32) as f32 * scale.unwrap_or(1.0))
                    .sum();
                assert_eq!(g, want, "rank {r} repetition {k} element {i}");
            }
        }
    }
}

/// A repeated two-rank broadcast or reduce is one send or receive per rank (and the
/// root's own copy), which `straight` tries on the link. A try that finds
/// nothing yet (the root starts late) or only part of the message (it arrives in 24-byte
/// pieces) hands over to the executor, which goes on from where the try stopped: the link
/// fails a receive that starts over. Every repetition delivers its own inputs, on the same
/// buffers and on others, in place and out of place.
#[test]
fn a_call_tried_straight_that_does_not_finish_goes_on_where_it_stopped() {
    let n = 2;
    let m = mesh(n, 24, Duration::from_secs(20));
    let out = on_threads(&m.wirings, |r, w| {
        let mut results = Vec::new();
        let mut tag = crate::tag::tag(crate::tag::kind::BROADCAST, 0);
        for count in [5, 100] {
            for in_place in [false, true] {
                let shape = shape(r, n, 4, in_place, 1 << 20);
                let cases = [
                    (Arc::new(ring::broadcast(count, 0, &shape)), None),
                    (
                        Arc::new(ring::reduce(count, 0, &shape)),
                        Some(plain(DataType::Float32)),
                    ),
                ];
                for (c, (schedule, reduction)) in cases.into_iter().enumerate() {
                    assert_eq!(
                        schedule.steps.len(),
                        1 + usize::from(r == 0 && c == 0 && !in_place)
                    );
                    let mut bufs = [0, 1].map(|_| [vec![0u8; count * 4], vec![0u8; count * 4]]);
                    for k in 0..6 {
                        // Twice on one pair of buffers, then twice on the other.
                        let [send, recv] = &mut bufs[k / 2 % 2];
                        send.copy_from_slice(&f32s(
                            (0..count).map(|i| (value(r, i) + k as i32) as f32),
                        ));
                        recv.fill(0);
                        let recv = if in_place { send } else { recv };
                        let recv = recv.as_mut_ptr();
                        if r == 0 && k % 3 == 1 {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        tag += 1;
                        let op = HostOp {
                            schedule: schedule.clone(),
                            send: recv.cast_const(),
                            recv,
                            tag,
                            reduction,
                        };
                        let op = if in_place {
                            op
                        } else {
                            HostOp {
                                send: bufs[k / 2 % 2][0].as_ptr(),
                                ..op
                            }
                        };
                        run_one(w, op, None)?;
                        let [send, recv] = &bufs[k / 2 % 2];
                        let got = as_f32s(if in_place { send } else { recv });
                        results.push((c, count, in_place, k, got));
                    }
                }
            }
        }
        Ok((results, STRAIGHT_RUNS.get()))
    });
    for (r, res) in out.into_iter().enumerate() {
        let (res, runs) = res.unwrap_or_else(|e: Error| panic!("rank {r}: {}", e.msg));
        assert_eq!(res.len(), 48);
        for (c, count, in_place, k, got) in res {
            let want: Vec<f32> = (0..count)
                .map(|i| match c {
                    0 => (value(0, i) + k as i32) as f32,
                    _ => (0..n).map(|q| (value(q, i) + k as i32) as f32).sum(),
                })
                .collect();
            let mine: Vec<f32> = (0..count)
                .map(|i| (value(r, i) + k as i32) as f32)
                .collect();
            let want = match (c, r, in_place) {
                (0, _, _) | (_, 0, _) => want,
                // The reduce leaves the other rank's buffers as they were.
                (_, _, true) => mine,
                _ => vec![0.0; count],
            };
            assert_eq!(
                got, want,
                "rank {r} case {c} count {count} in place {in_place} call {k}"
            );
        }
        // Sends finish at once on this link; receives of 100 floats never do.
        assert!(runs[0] > 0 && runs[1] + runs[2] > 0, "rank {r}: {runs:?}");
    }
}

/// Three ranks, 64-byte slices, messages in 24-byte pieces: a ring or tree broadcast or
/// reduce is a chain of receives and sends on a rank that passes slices on, each send
/// waiting for its receive, which `straight` tries in order. Ranks other than the root
/// sometimes start late (the slices are all there: the try finishes the chain) and
/// sometimes early (it stops at a receive, in the first slice or a later one, partly
/// received: the executor goes on from there). Every repetition delivers its own
/// inputs, on the same buffers and on others, in place and out of place, from two roots.
#[test]
fn chains_of_steps_tried_straight_go_on_where_they_stopped() {
    let n = 3;
    let m = mesh(n, 24, Duration::from_secs(20));
    /// What a rank's receive buffer holds after the call.
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Out {
        Root,
        SumAtRoot,
        Sum,
        Blocks,
    }
    type Build = fn(usize, usize, &Shape) -> Schedule;
    let kinds: [(Build, Out); 6] = [
        (ring::broadcast, Out::Root),
        (tree::broadcast, Out::Root),
        (ring::reduce, Out::SumAtRoot),
        (tree::reduce, Out::SumAtRoot),
        (|count, _, shape| ring::all_reduce(count, shape), Out::Sum),
        (
            |count, _, shape| direct::all_gather(count, shape),
            Out::Blocks,
        ),
    ];
    let out = on_threads(&m.wirings, |r, w| {
        let mut results = Vec::new();
        let mut tag = crate::tag::tag(crate::tag::kind::ALL_GATHER, 0);
        for (count, slice) in [(5, 64), (100, 64), (100, 16)] {
            for root in [0, 2] {
                for in_place in [false, true] {
                    let shape = shape(r, n, 4, in_place, slice);
                    for &(build, out) in &kinds {
                        let schedule = Arc::new(build(count, root, &shape));
                        let reduction = matches!(out, Out::SumAtRoot | Out::Sum)
                            .then(|| plain(DataType::Float32));
                        // In place the input lies in the receive buffer, a gather's
                        // at this rank's block.
                        let (blocks, at) = match out {
                            Out::Blocks => (n, r * count * 4),
                            _ => (1, 0),
                        };
                        let mut bufs =
                            [0, 1].map(|_| [vec![0u8; count * 4], vec![0u8; blocks * count * 4]]);
                        for k in 0..6 {
                            // Twice on one pair of buffers, then twice on the other.
                            let [send, recv] = &mut bufs[k / 2 % 2];
                            let input = f32s((0..count).map(|i| (value(r, i) + k as i32) as f32));
                            send.copy_from_slice(&input);
                            recv.fill(0);
                            if in_place {
                                recv[at..at + input.len()].copy_from_slice(&input);
                            }
                            let rp = recv.as_mut_ptr();
                            let sp = if in_place {
                                rp.wrapping_add(at).cast_const()
                            } else {
                                send.as_ptr()
                            };
                            if r != root && k % 3 == 1 {
                                std::thread::sleep(Duration::from_millis(5));
                            }
                            tag += 1;
                            let op = HostOp {
                                schedule: schedule.clone(),
                                send: sp,
                                recv: rp,
                                tag,
                                reduction,
                            };
                            run_one(w, op, None)?;
                            let got = as_f32s(&bufs[k / 2 % 2][1]);
                            results.push((out, count, root, in_place, k, got));
                        }
                    }
                }
            }
        }
        Ok((results, STRAIGHT_RUNS.get()))
    });
    for (r, res) in out.into_iter().enumerate() {
        let (res, runs) = res.unwrap_or_else(|e: Error| panic!("rank {r}: {}", e.msg));
        assert_eq!(res.len(), 3 * 2 * 2 * kinds.len() * 6);
        for (out, count, root, in_place, k, got) in res {
            let v = |q: usize, i: usize| (value(q, i) + k as i32) as f32;
            let want: Vec<f32> = match out {
                Out::Root => (0..count).map(|i| v(root, i)).collect(),
                Out::SumAtRoot | Out::Sum => {
                    (0..count).map(|i| (0..n).map(|q| v(q, i)).sum()).collect()
                }
                Out::Blocks => (0..n * count).map(|j| v(j / count, j % count)).collect(),
            };
            // A reduce leaves only the root's output defined.
            if out != Out::SumAtRoot || r == root {
                assert_eq!(
                    got, want,
                    "rank {r} {out:?} count {count} root {root} in place {in_place} call {k}"
                );
            }
        }
        // Some tries finished the run (a root's sends, a late rank's chain), some
        // handed it over at a first receive, some past finished steps (an all-reduce's
        // first send, a gather's own block and sends, a chain whose first slices had
        // come).
        assert!(runs.iter().all(|&k| k > 0), "rank {r}: {runs:?}");
    }
}

/// Rank 0 receives 8 bytes from rank 1 and sends them back, then sends 8 bytes of its
/// own: the second send waits for nothing, but its message must not pass the first, which
/// waits for the receive. Rank 1 sends late, so each repeated call's `straight` try on
/// rank 0 stops at the receive with both sends still to go.
#[test]
fn a_send_behind_one_that_waits_keeps_its_place() {
    let m = mesh(2, 1 << 20, Duration::from_secs(20));
    let region = |buf, at| Region::new(buf, at, 8);
    let mut echo = Schedule::default();
    echo.steps.push(Step::Recv {
        peer: 1,
        dst: region(Buf::Recv, 0),
        reduce_with: None,
        last: false,
    });
    for src in [region(Buf::Recv, 0), region(Buf::Send, 0)] {
        echo.steps.push(Step::Send {
            peer: 1,
            src: Operand::partial(src),
        });
    }
    (echo.send_extent, echo.recv_extent) = (8, 8);
    let mut ask = Schedule::default();
    ask.steps.push(Step::Send {
        peer: 0,
        src: Operand::partial(region(Buf::Send, 0)),
    });
    for at in [0, 8] {
        ask.steps.push(Step::Recv {
            peer: 0,
            dst: region(Buf::Recv, at),
            reduce_with: None,
            last: false,
        });
    }
    (ask.send_extent, ask.recv_extent) = (8, 16);
    let schedules = [Arc::new(echo), Arc::new(ask)];
    let out = on_threads(&m.wirings, |r, w| {
        let mut got = Vec::new();
        for k in 0..4u8 {
            let send = [10 * (r as u8 + 1) + k; 8];
            let mut recv = vec![0u8; 16];
            if r == 1 {
                std::thread::sleep(Duration::from_millis(20));
            }
            let op = HostOp {
                schedule: schedules[r].clone(),
                send: send.as_ptr(),
                recv: recv.as_mut_ptr(),
                tag: ALL_REDUCE_TAG + u64::from(k),
                reduction: None,
            };
            run_one(w, op, None)?;
            got.push(recv);
        }
        Ok::<_, Error>((got, STRAIGHT_RUNS.get()))
    });
    let mut it = out.into_iter();
    let (_, runs) = it.next().unwrap().expect("rank 0");
    assert!(runs[1] > 0, "rank 0 never handed a try over: {runs:?}");
    let (got, _) = it.next().unwrap().expect("rank 1");
    for (k, recv) in got.into_iter().enumerate() {
        let k = k as u8;
        assert_eq!(recv[..8], [20 + k; 8], "call {k}: its own bytes back first");
        assert_eq!(recv[8..], [10 + k; 8], "call {k}: then rank 0's");
    }
}

/// `run_again` runs the last call again, on the buffers it is given and the inputs they
/// hold now, with the number it is given, only when its key is the last run's and the
/// buffers lie as that run's did: not for another key, not in place after a run out of
/// place (nor on overlapping buffers), not after a run without a key, not after a group's
/// run.
#[test]
fn only_the_call_that_ran_last_runs_again() {
    let (n, count) = (3, 300);
    let bytes = count * 4;
    let m = mesh(n, 256, Duration::from_secs(20));
    let out = on_threads(&m.wirings, |r, w| {
        let shape = shape(r, n, 4, false, 64);
        let schedule = Arc::new(ring::all_reduce(count, &shape));
        let key = |count| Repeat {
            coll: crate::algo::Collective::AllReduce { count },
            dtype: 7,
            op: Some(0),
            stream: 0,
        };
        let (a, b) = (key(count), key(count + 1));
        let footprint = Footprint {
            send_bytes: bytes,
            recv_bytes: bytes,
            in_place: None,
        };
        // Two pairs of buffers, used in turn.
        let mut bufs = [
            [vec![0u8; bytes], vec![0u8; bytes]],
            [vec![0u8; bytes], vec![0u8; bytes]],
        ];
        let op = |[send, recv]: &mut [Vec<u8>; 2], seq: u64| HostOp {
            schedule: schedule.clone(),
            send: send.as_ptr(),
            recv: recv.as_mut_ptr(),
            tag: ALL_REDUCE_TAG + seq,
            reduction: Some(plain(DataType::Float32)),
        };
        let fill = |send: &mut Vec<u8>, k: i32| {
            send.copy_from_slice(&f32s((0..count).map(|i| (value(r, i) + k) as f32)))
        };
        let again = |[send, recv]: &mut [Vec<u8>; 2], k: i32, key: &Repeat| {
            fill(send, k);
            recv.fill(0);
            run_again(w, key, send.as_ptr(), recv.as_mut_ptr(), || {
                crate::tag::tag_seq(ALL_REDUCE_TAG) + k as u64
            })
            .map(|r| r.map(|()| as_f32s(recv)))
        };
        let mut results = Vec::new();
        fill(&mut bufs[0][0], 0);
        run_one(w, op(&mut bufs[0], 0), Some((a.clone(), footprint)))?;
        results.push(as_f32s(&bufs[0][1]));
        for k in 1..5 {
            let got = again(&mut bufs[k as usize % 2], k, &a).expect("a repeat runs")?;
            results.push(got);
        }
        assert!(again(&mut bufs[0], 5, &b).is_none(), "another key");
        let [send, _] = &mut bufs[0];
        let p = send.as_mut_ptr();
        assert!(run_again(w, &a, p, p, || 0).is_none(), "in place");
        assert!(
            run_again(w, &a, p, p.wrapping_add(4), || 0).is_none(),
            "overlapping"
        );
        run_one(w, op(&mut bufs[0], 5), None)?;
        assert!(
            again(&mut bufs[0], 6, &a).is_none(),
            "after a run without key"
        );
        run_one(w, op(&mut bufs[1], 6), Some((a.clone(), footprint)))?;
        run(vec![(w, vec![op(&mut bufs[1], 7)])])?;
        assert!(again(&mut bufs[1], 8, &a).is_none(), "after a group");
        Ok(results)
    });
    for (r, res) in out.into_iter().enumerate() {
        let res = res.unwrap_or_else(|e: Error| panic!("rank {r}: {}", e.msg));
        assert_eq!(res.len(), 5);
        for (k, got) in res.iter().enumerate() {
            for (i, &g) in got.iter().enumerate() {
                let want: f32 = (0..n).map(|q| (value(q, i) + k as i32) as f32).sum();
                assert_eq!(g, want, "rank {r} run {k} element {i}");
            }
        }
    }
}

/// Two calls that take turns, each on buffers of its own and then on the other pair: from the
/// third call on, each finds its plan's steps again (parked while the other ran) and is tried
/// straight, and every result is its own call's.
#[test]
fn calls_that_take_turns_keep_their_steps() {
    let n = 3;
    // The larger first: scratch grows once, on the first call, and stays where the plans saw it.
    let counts = [301, 300];
    let m = mesh(n, 256, Duration::from_secs(20));
    let out = on_threads(&m.wirings, |r, w| {
        let shape = shape(r, n, 4, false, 64);
        let schedules = counts.map(|c| Arc::new(ring::all_reduce(c, &shape)));
        let mut bufs = counts.map(|c| [vec![0u8; c * 4], vec![0u8; c * 4]]);
        let mut results = Vec::new();
        let before = STRAIGHT_RUNS.get().iter().sum::<u32>();
        for k in 0..6 {
            let which = k % 2;
            let count = counts[which];
            let [send, recv] = &mut bufs[which];
            send.copy_from_slice(&f32s((0..count).map(|i| (value(r, i) + k as i32) as f32)));
            recv.fill(0);
            let op = HostOp {
                schedule: schedules[which].clone(),
                send: send.as_ptr(),
                recv: recv.as_mut_ptr(),
                tag: ALL_REDUCE_TAG + k as u64,
                reduction: Some(plain(DataType::Float32)),
            };
            run_one(w, op, None)?;
            results.push(as_f32s(recv));
        }
        let tried = STRAIGHT_RUNS.get().iter().sum::<u32>() - before;
        Ok::<_, Error>((results, tried, w.cache.lock().plans.len()))
    });
    for (r, res) in out.into_iter().enumerate() {
        let (res, tried, plans) = res.unwrap_or_else(|e: Error| panic!("rank {r}: {}", e.msg));
        assert_eq!(tried, 4, "rank {r}: calls 3 to 6 tried straight");
        assert_eq!(plans, 2, "rank {r}");
        for (k, got) in res.iter().enumerate() {
            assert_eq!(got.len(), counts[k % 2]);
            for (i, &g) in got.iter().enumerate() {
                let want: f32 = (0..n).map(|q| (value(q, i) + k as i32) as f32).sum();
                assert_eq!(g, want, "rank {r} call {k} element {i}");
            }
        }
    }
}

/// A footprint admits buffers that pass the same checks the same way.
#[test]
fn footprints_admit_buffers_that_lie_alike() {
    let out = Footprint {
        send_bytes: 64,
        recv_bytes: 128,
        in_place: None,
    };
    assert!(out.admits(0x1000, 0x2000));
    assert!(out.admits(0x2000, 0x1000 - 128));
    assert!(!out.admits(0x1000, 0x1000 + 32), "overlap");
    assert!(!out.admits(0, 0x2000), "NULL send buffer");
    assert!(!out.admits(usize::MAX - 8, 0x2000), "wraps");
    let root_only = Footprint {
        send_bytes: 0,
        ..out
    };
    assert!(
        root_only.admits(0, 0x2000),
        "a send buffer that holds nothing"
    );
    let in_place = Footprint {
        send_bytes: 64,
        recv_bytes: 128,
        in_place: Some(64),
    };
    assert!(in_place.admits(0x1040, 0x1000));
    assert!(!in_place.admits(0x1000, 0x1000), "another distance");
    assert!(!in_place.admits(0x4000, 0x1000), "out of place");
}

/// One thread drives both ranks of a pair in one `run` (a group over two communicators):
/// neither waits for the other.
#[test]
fn one_thread_drives_two_ranks_to_completion() {
    let (n, count) = (2, 4099);
    let m = mesh(n, 1000, Duration::from_secs(20));
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| i32s((0..count).map(|i| value(r, i))))
        .collect();
    let mut outs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; count * 4]).collect();
    let schedules: Vec<Arc<Schedule>> = (0..n)
        .map(|r| Arc::new(ring::all_reduce(count, &shape(r, n, 4, false, 256))))
        .collect();
    let jobs: Vec<(&Wiring, Vec<HostOp>)> = outs
        .iter_mut()
        .enumerate()
        .map(|(r, out)| {
            let op = HostOp {
                schedule: schedules[r].clone(),
                send: inputs[r].as_ptr(),
                recv: out.as_mut_ptr(),
                tag: ALL_REDUCE_TAG,
                reduction: Some(plain(DataType::Int32)),
            };
            (&m.wirings[r], vec![op])
        })
        .collect();
    run(jobs).expect("both ranks complete");
    for (r, out) in outs.iter().enumerate() {
        for (i, g) in as_i32s(out).into_iter().enumerate() {
            assert_eq!(g, value(0, i) + value(1, i), "rank {r} element {i}");
        }
    }
}

/// Rank 0 receives 8 bytes from rank 1 into recv[0..8], and copies send[0..8] to
/// recv[8..16]. Out of place the two steps are independent; in place (send is recv) the
/// copy reads what the receive writes, so it must wait for it. Rank 1 sends late, so a
/// copy that did not wait would copy the old bytes.
fn receive_then_copy() -> Schedule {
    let mut s = Schedule::default();
    s.steps.push(Step::Recv {
        peer: 1,
        dst: Region::new(Buf::Recv, 0, 8),
        reduce_with: None,
        last: false,
    });
    s.steps.push(Step::Local {
        dst: Region::new(Buf::Recv, 8, 8),
        a: Operand::partial(Region::new(Buf::Send, 0, 8)),
        b: None,
        last: false,
    });
    s.send_extent = 8;
    s.recv_extent = 16;
    s
}

fn send_8_bytes_late(w: &Wiring, data: &[u8; 8]) -> Result<()> {
    std::thread::sleep(Duration::from_millis(100));
    send_8_bytes(w, 0, data)
}

/// Runs a schedule of one step: `data` sent to `peer`.
fn send_8_bytes(w: &Wiring, peer: usize, data: &[u8; 8]) -> Result<()> {
    let mut s = Schedule::default();
    s.steps.push(Step::Send {
        peer,
        src: Operand::partial(Region::new(Buf::Send, 0, 8)),
    });
    s.send_extent = 8;
    run_one(
        w,
        HostOp {
            schedule: Arc::new(s),
            send: data.as_ptr(),
            recv: std::ptr::null_mut(),
            tag: ALL_REDUCE_TAG,
            reduction: None,
        },
        None,
    )
}

/// The hazards of one schedule are cached per aliasing: the in-place call after an
/// out-of-place one of the same schedule does not reuse the out-of-place hazards.
#[test]
fn a_step_waits_for_the_receive_it_reads_and_the_cache_tells_aliasings_apart() {
    let m = mesh(2, 1 << 20, Duration::from_secs(20));
    let schedule = Arc::new(receive_then_copy());
    let incoming: [u8; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
    for in_place in [false, true] {
        let out = on_threads(&m.wirings, |r, w| {
            if r == 1 {
                return send_8_bytes_late(w, &incoming).map(|_| Vec::new());
            }
            let mut send = vec![9u8; if in_place { 16 } else { 8 }];
            let mut recv = vec![0u8; 16];
            let sp = send.as_mut_ptr();
            let rp = if in_place { sp } else { recv.as_mut_ptr() };
            run_one(
                w,
                HostOp {
                    schedule: schedule.clone(),
                    send: sp,
                    recv: rp,
                    tag: ALL_REDUCE_TAG,
                    reduction: None,
                },
                None,
            )?;
            Ok(if in_place { send } else { recv })
        });
        let mut it = out.into_iter();
        let got = it.next().unwrap().expect("rank 0");
        it.next().unwrap().expect("rank 1");
        assert_eq!(got[..8], incoming, "in place: {in_place}");
        let copied: &[u8] = if in_place { &incoming } else { &[9; 8] };
        assert_eq!(&got[8..], copied, "in place: {in_place}");
    }
    assert_eq!(m.wirings[0].cache.lock().plans.len(), 2);
}

/// Scratch space stays allocated between calls (rounded up to 64 bytes per operation),
/// grows when a call needs more, and carries nothing from one call into the next.
#[test]
fn scratch_is_reused_from_call_to_call() {
    let m = mesh(1, 1 << 20, Duration::from_secs(20));
    let w = &m.wirings[0];
    let through_scratch = |bytes: usize| -> Arc<Schedule> {
        let mut s = Schedule {
            scratch: bytes,
            send_extent: bytes,
            recv_extent: bytes,
            ..Schedule::default()
        };
        s.steps.push(Step::Local {
            dst: Region::new(Buf::Scratch, 0, bytes),
            a: Operand::partial(Region::new(Buf::Send, 0, bytes)),
            b: None,
            last: false,
        });
        s.steps.push(Step::Local {
            dst: Region::new(Buf::Recv, 0, bytes),
            a: Operand::partial(Region::new(Buf::Scratch, 0, bytes)),
            b: None,
            last: false,
        });
        Arc::new(s)
    };
    let copy = |schedule: &Arc<Schedule>, seed: u8| -> (Vec<u8>, Vec<u8>) {
        let len = schedule.scratch;
        let send: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_add(seed)).collect();
        let mut recv = vec![0u8; len];
        run_one(
            w,
            HostOp {
                schedule: schedule.clone(),
                send: send.as_ptr(),
                recv: recv.as_mut_ptr(),
                tag: ALL_REDUCE_TAG,
                reduction: None,
            },
            None,
        )
        .unwrap();
        (send, recv)
    };
    let small = through_scratch(1000);
    let (send, recv) = copy(&small, 1);
    assert_eq!(recv, send);
    let (len, at) = {
        let c = w.cache.lock();
        (c.scratch.len() * 64, c.scratch.as_ptr())
    };
    assert_eq!(len, 1024, "1000 bytes of scratch, rounded up to 64");
    assert_eq!(at as usize % 64, 0, "scratch starts on a cache line");
    let (send, recv) = copy(&small, 77);
    assert_eq!(recv, send, "the second call copies its own input");
    assert_eq!(
        w.cache.lock().scratch.as_ptr(),
        at,
        "the same scratch again"
    );
    let large = through_scratch(5000);
    let (send, recv) = copy(&large, 5);
    assert_eq!(recv, send);
    assert_eq!(w.cache.lock().scratch.len() * 64, 5056);
    copy(&small, 3);
    assert_eq!(
        w.cache.lock().scratch.len() * 64,
        5056,
        "scratch does not shrink"
    );
}

/// A receive that never comes times out after the configured time: the error names the
/// rank and the receive, suspects that rank, and the peers are told this rank gave up.
#[test]
fn a_receive_that_never_comes_times_out_naming_the_peer() {
    let m = mesh(2, 1 << 20, Duration::from_millis(300));
    let mut dst = vec![0u8; 64];
    let t = Instant::now();
    let mut s = Schedule::default();
    s.steps.push(Step::Recv {
        peer: 1,
        dst: Region::new(Buf::Recv, 0, 64),
        reduce_with: None,
        last: false,
    });
    s.recv_extent = 64;
    let e = run_one(
        &m.wirings[0],
        HostOp {
            schedule: Arc::new(s),
            send: dst.as_ptr(),
            recv: dst.as_mut_ptr(),
            tag: ALL_REDUCE_TAG,
            reduction: None,
        },
        None,
    )
    .expect_err("nobody sends");
    let took = t.elapsed();
    assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.msg);
    assert!(
        e.msg.contains("rank 0 timed out") && e.msg.contains("receive of 64 bytes from rank 1"),
        "{}",
        e.msg
    );
    assert_eq!(e.lost, Some(1));
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let closed = *m.mem[0][1].as_ref().unwrap().closed.lock();
    assert_eq!(closed, Some((Closing::TimedOut, Some(1))));
}

/// Setting the abort flag from another thread ends a call stuck on a peer.
#[test]
fn the_abort_flag_ends_a_stuck_call() {
    let m = mesh(2, 1 << 20, Duration::from_secs(60));
    let w = &m.wirings[0];
    let mut dst = vec![0u8; 8];
    let mut s = Schedule::default();
    s.steps.push(Step::Recv {
        peer: 1,
        dst: Region::new(Buf::Recv, 0, 8),
        reduce_with: None,
        last: false,
    });
    s.recv_extent = 8;
    let t = Instant::now();
    let e = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            w.abort.store(true, Ordering::SeqCst);
        });
        run_one(
            w,
            HostOp {
                schedule: Arc::new(s),
                send: dst.as_ptr(),
                recv: dst.as_mut_ptr(),
                tag: ALL_REDUCE_TAG,
                reduction: None,
            },
            None,
        )
    })
    .expect_err("aborted");
    assert_eq!(e.kind, ErrorKind::Remote, "{}", e.msg);
    assert!(e.msg.contains("aborted"), "{}", e.msg);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// A peer that fails without naming another loss is blamed alone only after the other
/// links had LOSS_GRACE to show one: a loss that shows 30 ms later is named too; with none
/// the error comes once the grace is over.
#[test]
fn a_bare_loss_waits_briefly_for_the_loss_behind_it() {
    for later in [Some(Duration::from_millis(30)), None] {
        let m = mesh(3, 1 << 20, Duration::from_secs(20));
        let now = Instant::now();
        *m.mem[0][1].as_ref().unwrap().lost_from.lock() = Some((now, 1));
        if let Some(d) = later {
            *m.mem[0][2].as_ref().unwrap().lost_from.lock() = Some((now + d, 2));
        }
        let e = send_8_bytes(&m.wirings[0], 1, &[0u8; 8]).expect_err("rank 1 is gone");
        let took = now.elapsed();
        assert_eq!(e.lost, Some(1), "{}", e.msg);
        assert!(e.msg.contains("rank 1 is gone"), "{}", e.msg);
        assert_eq!(
            e.msg.contains("rank 2 is gone"),
            later.is_some(),
            "{}",
            e.msg
        );
        match later {
            Some(d) => assert!(took >= d && took < LOSS_GRACE, "{took:?}"),
            None => assert!(took >= LOSS_GRACE, "{took:?}"),
        }
    }
}

/// A schedule that names a rank the communicator does not have is refused before anything
/// moves.
#[test]
fn a_schedule_naming_a_missing_rank_is_refused() {
    let m = mesh(2, 1 << 20, Duration::from_secs(20));
    let e = send_8_bytes(&m.wirings[0], 5, &[0u8; 8]).expect_err("rank 5 of 2");
    assert_eq!(e.kind, ErrorKind::Internal);
    assert!(e.msg.contains("rank 5 of 2"), "{}", e.msg);
    assert!(m.mem[0][1].as_ref().unwrap().out.msgs.lock().is_empty());
}

fn xstep(action: Action) -> XStep {
    XStep {
        action,
        op: 0,
        waiting_on: 0,
        first_dependent: 0,
        dependents: 0,
        hint: Hint::None,
        copied: false,
        finished: false,
        send: SendCursor::default(),
        recv: RecvCursor::default(),
    }
}

/// The steps of `schedule` with the send buffer at `send` and the receive buffer at `recv`.
fn resolved(schedule: &Schedule, send: usize, recv: usize) -> Vec<XStep> {
    let at = |r: Region| -> *mut u8 {
        let base = match r.buf {
            Buf::Send => send,
            Buf::Recv => recv,
            Buf::Scratch => 1 << 40,
        };
        (base + r.offset) as *mut u8
    };
    (schedule.steps.iter())
        .map(|s| xstep(Action::of(s, at, None)))
        .collect()
}

/// A two-rank ring all-reduce is made of the pairs `Hazards::hints` looks for: each
/// reduce-scatter send's reply is the all-gather's receive from the same peer, into the
/// same bytes in place and into the same place of the receive buffer out of place, and
/// each folded slice is next sent back to that peer. On three ranks (sends go to one
/// neighbour, receives come from the other) and where an earlier step still reads the
/// buffer or touches its mirror, no send is marked.
#[test]
fn hints_mark_the_sends_whose_reply_lands_in_place_and_the_folds_that_return() {
    let sliced = |rank, nranks, in_place, slice_bytes| crate::algo::Shape {
        rank,
        nranks,
        elem: 4,
        in_place,
        slice_bytes,
        ring: None,
        hosts: None,
    };
    let shape = |rank, nranks, in_place| sliced(rank, nranks, in_place, 1 << 10);
    // The operation's buffers as `resolved` places them: send at 1 MiB, receive at `recv`.
    let mirror_for = |recv: usize| {
        move |_op: usize, p: usize| {
            ((1 << 20)..(65 << 20))
                .contains(&p)
                .then(|| p - (1 << 20) + recv)
        }
    };
    let count = 5000; // 20000 bytes: ten slices a half, the last one short.
                      // And 36 MiB in 1 MiB slices, which the out-of-place schedule fuses.
    let big = (crate::algo::ring::FUSE_FROM + (4 << 20)) / 4;
    for (count, slice, recv) in [(count, 1 << 10, 1 << 22), (big, 1 << 20, 1 << 27)] {
        for rank in 0..2 {
            for in_place in [true, false] {
                let recv = if in_place { 1 << 20 } else { recv };
                let shape = sliced(rank, 2, in_place, slice);
                let s = crate::algo::ring::all_reduce(count, &shape);
                let steps = resolved(&s, 1 << 20, recv);
                let hints = Hazards::compute(&steps, &mirror_for(recv)).hints;
                let reply = if in_place {
                    Hint::ReplyHere
                } else {
                    Hint::ReplyInRecv
                };
                let mut marked = (0, 0);
                for (st, &h) in s.steps.iter().zip(&hints) {
                    let what = format!("rank {rank}, in place {in_place}: {st:?}");
                    match *st {
                        // The reduce-scatter's sends read this rank's input; the
                        // all-gather's read folded slices.
                        Step::Send { src, .. } => {
                            let want = if src.input { reply } else { Hint::None };
                            assert_eq!(h, want, "{what}");
                            marked.0 += src.input as usize;
                        }
                        Step::Recv { reduce_with, .. } => {
                            let want = if reduce_with.is_some() {
                                Hint::Returns
                            } else {
                                Hint::None
                            };
                            assert_eq!(h, want, "{what}");
                            marked.1 += reduce_with.is_some() as usize;
                        }
                        Step::Local { .. } => assert_eq!(h, Hint::None, "{what}"),
                    }
                }
                let slices = (count * 4 / 2).div_ceil(slice);
                assert_eq!(marked, (slices, slices), "rank {rank}, in place {in_place}");
                // Without a mirror (a send from scratch, say) no out-of-place send is
                // marked; the folds still are.
                let hints = Hazards::compute(&steps, &|_, _| None).hints;
                assert_eq!(
                    hints.iter().filter(|&&h| h == Hint::ReplyInRecv).count(),
                    0,
                    "rank {rank}, in place {in_place}"
                );
            }
        }
    }
    let s = crate::algo::ring::all_reduce(count, &shape(1, 3, true));
    let steps = resolved(&s, 1 << 20, 1 << 20);
    assert!(
        (Hazards::compute(&steps, &mirror_for(1 << 20)).hints.iter()).all(|&h| h == Hint::None),
        "three ranks"
    );
    let s = crate::algo::ring::all_reduce(count, &shape(1, 3, false));
    let steps = resolved(&s, 1 << 20, 1 << 22);
    assert!(
        (Hazards::compute(&steps, &mirror_for(1 << 22)).hints.iter()).all(|&h| h == Hint::None),
        "three ranks out of place"
    );
    // A local step before the first send that reads its bytes (in place) or writes their
    // mirror (out of place): the peer's write could overtake it, so the send is not
    // marked (the fold still is).
    for in_place in [true, false] {
        let recv = if in_place { 1 << 20 } else { 1 << 22 };
        let s = crate::algo::ring::all_reduce(count, &shape(0, 2, in_place));
        let first_send = s
            .steps
            .iter()
            .position(|st| matches!(st, Step::Send { .. }))
            .expect("a send");
        let Step::Send { src, .. } = s.steps[first_send] else {
            unreachable!()
        };
        let mut steps = resolved(&s, 1 << 20, recv);
        let (dst, from) = if in_place {
            (1usize << 30, (1 << 20) + src.region.offset)
        } else {
            (recv + src.region.offset + 4, 1 << 30)
        };
        let early = Action::Local {
            dst: dst as *mut u8,
            len: 4,
            a: Src {
                ptr: from as *const u8,
                scale: None,
            },
            b: None,
            last: false,
        };
        steps.insert(0, xstep(early));
        let hints = Hazards::compute(&steps, &mirror_for(recv)).hints;
        assert_eq!(hints[first_send + 1], Hint::None, "in place {in_place}");
        let marked = hints.iter().filter(|&&h| h != Hint::None).count();
        assert_eq!(marked, 19, "in place {in_place}");
    }
}

/// Which steps wait for which: write after read, read after write and write after write
/// make a step wait; disjoint and merely adjacent ranges do not.
#[test]
fn hazards_follow_the_byte_ranges() {
    let at = |a: usize| Src {
        ptr: (0x1000 + a) as *const u8,
        scale: None,
    };
    let dst = |a: usize| (0x1000 + a) as *mut u8;
    let steps: Vec<XStep> = [
        // 0: reads [0, 8).
        Action::Send {
            peer: 1,
            src: at(0),
            len: 8,
        },
        // 1: writes [8, 16).
        Action::Recv {
            peer: 1,
            dst: dst(8),
            len: 8,
            with: None,
            last: false,
        },
        // 2: writes [0, 8), which 0 reads.
        Action::Local {
            dst: dst(0),
            len: 8,
            a: at(16),
            b: None,
            last: false,
        },
        // 3: reads [8, 16), which 1 writes; writes [24, 32).
        Action::Local {
            dst: dst(24),
            len: 8,
            a: at(8),
            b: None,
            last: false,
        },
        // 4: writes [8, 16) again (after 1), which 3 reads.
        Action::Recv {
            peer: 1,
            dst: dst(8),
            len: 8,
            with: None,
            last: false,
        },
        // 5: reads [32, 40): touches nothing written.
        Action::Send {
            peer: 1,
            src: at(32),
            len: 8,
        },
        // 6: writes [40, 48), next to 5's range; reads [16, 24), which 2 read too.
        Action::Local {
            dst: dst(40),
            len: 8,
            a: at(16),
            b: Some(at(16)),
            last: false,
        },
    ]
    .into_iter()
    .map(xstep)
    .collect();
    let h = Hazards::compute(&steps, &|_, _| None);
    assert_eq!(h.waiting_on, vec![0, 0, 1, 1, 2, 0, 0]);
    let dependents = |j: usize| -> Vec<u32> {
        let (f, c) = (h.first[j] as usize, h.count[j] as usize);
        h.edges[f..f + c].to_vec()
    };
    assert_eq!(dependents(0), vec![2]);
    assert_eq!(dependents(1), vec![3, 4]);
    assert_eq!(dependents(2), Vec::<u32>::new());
    assert_eq!(dependents(3), vec![4]);
    for j in 4..7 {
        assert_eq!(dependents(j), Vec::<u32>::new(), "step {j}");
    }
}

/// Random groups of operations on a small address space, so that their bytes often meet:
/// comparing only the steps of operations whose bytes meet finds the same hazards and hints
/// as comparing every step with every other.
#[test]
fn hazards_of_nearby_operations_only_are_those_of_all_pairs() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as usize
    };
    for _ in 0..400 {
        let nops = 1 + rand(6);
        let bases: Vec<(usize, usize)> = (0..nops)
            // Some with their receive buffer at 0, as a send's is (no buffer).
            .map(|_| {
                (
                    0x1000 + rand(16) * 16,
                    rand(4).min(1) * (0x1000 + rand(16) * 16),
                )
            })
            .collect();
        let mut steps = Vec::new();
        for (op, &(send, recv)) in bases.iter().enumerate() {
            for _ in 0..rand(6) {
                let (len, peer) = (rand(4) * 8, rand(2));
                let src = |base: usize, off: usize| Src {
                    ptr: (base + off) as *const u8,
                    scale: None,
                };
                let (a, d) = (send + rand(4) * 8, recv + rand(4) * 8);
                let action = match rand(4) {
                    0 => Action::Send {
                        peer,
                        src: src(a, 0),
                        len,
                    },
                    1 => Action::Recv {
                        peer,
                        dst: d as *mut u8,
                        len,
                        with: (rand(2) == 0).then(|| src(d, 0)),
                        last: false,
                    },
                    2 => Action::Send {
                        peer,
                        src: src(d, 0),
                        len,
                    },
                    _ => Action::Local {
                        dst: d as *mut u8,
                        len,
                        a: src(a, 0),
                        b: (rand(2) == 0).then(|| src(d, 8)),
                        last: false,
                    },
                };
                steps.push(XStep {
                    op,
                    ..xstep(action)
                });
            }
        }
        let mirror = |op: usize, p: usize| {
            let (send, recv) = bases[op];
            (send..send + 64).contains(&p).then(|| p - send + recv)
        };
        let near = Hazards::compute_near(&steps, &mirror, &Near::of_ops(&steps, &mirror));
        let all = Hazards::compute_near(&steps, &mirror, &Near::All(steps.len()));
        assert_eq!(near.waiting_on, all.waiting_on);
        assert_eq!((near.first, near.count), (all.first, all.count));
        assert_eq!(near.edges, all.edges);
        assert_eq!(near.hints, all.hints);
    }
}

#[test]
fn overlaps_is_half_open() {
    assert!(overlaps(Some((0, 8)), Some((7, 9))));
    assert!(!overlaps(Some((0, 8)), Some((8, 16))));
    assert!(!overlaps(Some((8, 16)), Some((0, 8))));
    assert!(overlaps(Some((0, 16)), Some((4, 5))));
    assert!(!overlaps(None, Some((0, 8))));
}

#[test]
fn repeated_waits_are_counted() {
    let parts = ["a", "b", "b", "c", "b"].map(String::from).to_vec();
    assert_eq!(count_repeats(parts), "a, b (x3), c");
    assert_eq!(count_repeats(vec!["x".into()]), "x");
    assert_eq!(count_repeats(Vec::new()), "");
}

#[test]
fn a_buffer_folded_with_itself_is_folded_with_its_own_values() {
    // Large enough to pass the small-reduction path by.
    let mut v = i32s(0..4096);
    let p = v.as_mut_ptr();
    let src = Src {
        ptr: p,
        scale: None,
    };
    let red = plain(DataType::Int32);
    // SAFETY: `v` covers the bytes, and one buffer as dst, a and b is what is tested.
    unsafe { combine(p, src, src, v.len(), &red.reducer) };
    assert_eq!(as_i32s(&v), (0..4096).map(|x| 2 * x).collect::<Vec<_>>());
}
