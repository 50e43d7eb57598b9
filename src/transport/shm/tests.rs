//! The FIFO protocol between two ends built by hand in this process (no bootstrap): small
//! rings to make wrap-around and back-pressure happen, both the eager and the pull path,
//! closing, the doorbell, and the checks on opening a peer's segment.

use super::packed::{
    entry_bytes, entry_ctl, stamp_of, Packing, ENTRY_LEN, KIND_PACKED, PACK_FIRST, PACK_LINE,
    PACK_MAX, STAMP_SHIFT,
};
use super::peer::{tail_step, Access, CarriedList, ShmPeer};
use super::pull::{PullState, PAGE_SPAN, PULL_BUDGET, PULL_PIECE};
use super::segment::{Geometry, CTL_BASE, CTL_STRIDE, SLOT_FIELDS};
use super::setup::{probe_cma, stopped_serving};
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::Scale;
use crate::sys::{self, ProcessWatch};
use crate::topo::{Activity, Presence};
use crate::transport::{
    Closing, Doorbell, InExpect, Link, Offer, OutMsg, RecvCursor, Reply, SendCursor, SendState,
    Sink,
};
use parking_lot::Mutex;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

const TAG: u64 = crate::tag::tag(crate::tag::kind::ALL_REDUCE, 5);

/// Rank 0's link to rank 1 and rank 1's link to rank 0, over two fresh segments.
/// `pull`: whether each receiver may pull from the other; `access`: how it reads.
fn pair(
    nslots: usize,
    slot_bytes: usize,
    pull: bool,
    pull_threshold: usize,
    access: Access,
) -> (ShmPeer, ShmPeer) {
    let geo = Geometry {
        nranks: 2,
        nslots,
        slot_bytes,
        registry_bytes: 4096,
    };
    let s0 = Arc::new(Segment::create(0, geo, 0x1111).expect("segment 0"));
    let s1 = Arc::new(Segment::create(1, geo, 0x2222).expect("segment 1"));
    // Whether a receiver may pull lives in its own segment, in the sender's control block.
    s0.pull_ok(1).store(pull as u32, Ordering::Release);
    s1.pull_ok(0).store(pull as u32, Ordering::Release);
    let link = |me: usize, local: &Arc<Segment>, remote: &Arc<Segment>| ShmPeer {
        me,
        peer: 1 - me,
        local: local.clone(),
        remote: remote.clone(),
        access,
        watch: None,
        pull_threshold,
        pull_threshold_busy: pull_threshold,
        pull_threshold_copied: pull_threshold,
        scratch: Mutex::new(None),
        carried: CarriedList::default(),
        tail_seen: AtomicU64::new(0),
        consumed: AtomicU64::new(0),
        tail_step: tail_step(nslots),
        pack: Packing::default(),
        gone: None,
    };
    (link(0, &s0, &s1), link(1, &s1, &s0))
}

/// Where a rank runs and what it does there is what its peer reads.
#[test]
fn a_peer_sees_where_this_rank_runs_and_what_it_does() {
    let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
    let seen_by_b = ShmPresence::new(b.local.clone(), vec![Some(a.local.clone()), None]);
    let seen_by_a = ShmPresence::new(a.local.clone(), vec![None, Some(b.local.clone())]);
    assert_eq!(
        seen_by_b.running_on(0),
        None,
        "a fresh segment says nothing"
    );
    seen_by_a.set_running_on(3, Activity::Polling);
    assert_eq!(seen_by_b.running_on(0), Some((3, Activity::Polling)));
    assert_eq!(
        seen_by_a.running_on(1),
        None,
        "only the owner's own word changed"
    );
    assert_eq!(seen_by_b.running_on(1), None, "no segment, nothing said");
    seen_by_a.set_running_on(0, Activity::Sleeping);
    assert_eq!(
        seen_by_b.running_on(0),
        Some((0, Activity::Sleeping)),
        "CPU 0 is a CPU, not 'nothing'"
    );
    seen_by_a.set_running_on(1023, Activity::Outside);
    assert_eq!(seen_by_b.running_on(0), Some((1023, Activity::Outside)));
}

/// A peer is stalled once neither its word nor its heartbeat moved for the given time;
/// either moving starts the count again.
#[test]
fn a_peer_without_a_heartbeat_is_stalled() {
    let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
    let seen_by_b = ShmPresence::new(b.local.clone(), vec![Some(a.local.clone()), None]);
    let seen_by_a = ShmPresence::new(a.local.clone(), vec![None, Some(b.local.clone())]);
    let after = Duration::from_micros(10);
    let t0 = Instant::now();
    seen_by_a.set_running_on(2, Activity::Polling);
    assert!(
        !seen_by_b.stalled(0, t0, after),
        "first look: nothing to compare"
    );
    assert!(
        !seen_by_b.stalled(0, t0 + after / 2, after),
        "not for long enough"
    );
    assert!(
        seen_by_b.stalled(0, t0 + after, after),
        "silent for `after`"
    );
    seen_by_a.heartbeat();
    assert!(
        !seen_by_b.stalled(0, t0 + after * 2, after),
        "a beat is a sign of life"
    );
    assert!(seen_by_b.stalled(0, t0 + after * 3, after));
    seen_by_a.set_running_on(2, Activity::Sleeping);
    assert!(
        !seen_by_b.stalled(0, t0 + after * 4, after),
        "so is a change of state"
    );
    assert!(seen_by_b.stalled(0, t0 + after * 5, after));
    assert!(
        !seen_by_b.stalled(1, t0 + after * 9, after),
        "a rank without a segment cannot tell"
    );
}

/// Where received bytes land: written by the link itself (`direct`) or handed over.
struct Collect {
    buf: Vec<u8>,
    direct: bool,
    /// (offset, length) of every piece, in order.
    pieces: Vec<(usize, usize)>,
    scales: Vec<Option<Scale>>,
    /// The address every piece given to `put` lay at.
    from: Vec<usize>,
}

impl Collect {
    fn new(len: usize, direct: bool) -> Collect {
        Collect {
            buf: vec![0; len],
            direct,
            pieces: Vec::new(),
            scales: Vec::new(),
            from: Vec::new(),
        }
    }
}

impl Sink for Collect {
    fn direct(&mut self) -> Option<*mut u8> {
        self.direct.then_some(self.buf.as_mut_ptr())
    }

    fn put(&mut self, offset: usize, data: &[u8], scale: Option<Scale>) -> Result<()> {
        self.buf[offset..offset + data.len()].copy_from_slice(data);
        self.pieces.push((offset, data.len()));
        self.from.push(data.as_ptr() as usize);
        self.scales.push(scale);
        Ok(())
    }

    fn placed(&mut self, offset: usize, len: usize, scale: Option<Scale>) -> Result<()> {
        self.pieces.push((offset, len));
        self.scales.push(scale);
        Ok(())
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn out(data: &[u8], tag: u64, scale: Option<Scale>) -> OutMsg {
    OutMsg {
        src: data.as_ptr(),
        len: data.len(),
        scale,
        tag,
    }
}

/// Sends `msgs` (data, tag, scale) on `tx` while `rx` receives them, both driven from this
/// thread as an executor drives them: sends start in order, a posted send is polled until
/// its buffer is free, and the receiver takes what has arrived. Returns each message's sink.
fn exchange(
    tx: &ShmPeer,
    rx: &ShmPeer,
    msgs: &[(Vec<u8>, u64, Option<Scale>)],
    direct: bool,
) -> Vec<Collect> {
    let mut cursors = vec![SendCursor::default(); msgs.len()];
    let mut complete = vec![false; msgs.len()];
    let mut next = 0;
    let mut got: Vec<Collect> = Vec::new();
    let mut cur = RecvCursor::default();
    let mut sink = msgs.first().map(|m| Collect::new(m.0.len(), direct));
    for _ in 0..1_000_000 {
        if got.len() == msgs.len() && complete.iter().all(|&c| c) {
            return got;
        }
        for i in 0..msgs.len() {
            if complete[i] || i > next {
                continue;
            }
            let (data, tag, scale) = &msgs[i];
            match tx
                .send(&out(data, *tag, *scale), &mut cursors[i])
                .unwrap()
                .state
            {
                SendState::Pending => break,
                SendState::Posted => next = next.max(i + 1),
                SendState::Complete => {
                    complete[i] = true;
                    next = next.max(i + 1);
                }
            }
        }
        if let Some(s) = sink.as_mut() {
            let (data, tag, _) = &msgs[got.len()];
            let expect = InExpect {
                len: data.len(),
                tag: *tag,
            };
            if rx.recv(&expect, &mut cur, s).unwrap().state {
                got.push(sink.take().unwrap());
                cur = RecvCursor::default();
                sink = msgs.get(got.len()).map(|m| Collect::new(m.0.len(), direct));
            }
        }
    }
    panic!(
        "stalled: {} of {} received, sends complete {complete:?}",
        got.len(),
        msgs.len()
    );
}

/// Messages that each cut into at most `slot_bytes` pieces, in order, cover every byte.
fn assert_eager(got: &Collect, data: &[u8], slot_bytes: usize, what: &str) {
    assert_eq!(got.buf, data, "{what}");
    let mut at = 0;
    for &(off, len) in &got.pieces {
        assert_eq!(off, at, "{what}: pieces {:?}", got.pieces);
        assert!(len <= slot_bytes, "{what}: a piece of {len} bytes");
        at += len;
    }
    assert_eq!(at, data.len(), "{what}");
}

/// Messages of every size through a ring of two 4 KiB slots: each takes one slot per
/// 4 KiB (a zero-length message one slot), the ring wraps around dozens of times, and
/// without permission to pull even messages above the pull threshold go through slots.
#[test]
fn eager_messages_wrap_around_a_two_slot_ring() {
    let slot = 4096;
    let (a, b) = pair(2, slot, false, 1024, Access::Direct);
    // Above PACK_MAX: each message takes slots of its own (packing has its own tests).
    let lengths = [
        PACK_MAX + 1,
        slot,
        slot + 1,
        3 * slot + 5,
        50_000,
        PACK_MAX + 7,
    ];
    let msgs: Vec<_> = lengths
        .iter()
        .enumerate()
        .map(|(i, &l)| (pattern(l, i as u8), TAG + i as u64, None))
        .collect();
    for direct in [false, true] {
        let head_before = b.local.head(0).load(Ordering::Relaxed);
        let got = exchange(&a, &b, &msgs, direct);
        for (i, (g, m)) in got.iter().zip(&msgs).enumerate() {
            assert_eager(
                g,
                &m.0,
                slot,
                &format!("message {i} of {} bytes", m.0.len()),
            );
        }
        let slots: u64 = lengths
            .iter()
            .map(|&l| l.div_ceil(slot).max(1) as u64)
            .sum();
        let head = b.local.head(0).load(Ordering::Relaxed);
        assert_eq!(head - head_before, slots, "slots used");
        assert_eq!(
            b.local.tail(0).load(Ordering::Relaxed),
            head,
            "all released"
        );
    }
    // The other direction is a FIFO of its own.
    let got = exchange(&b, &a, &msgs[..3], true);
    assert_eq!(got[2].buf, msgs[2].0);
    assert_eq!(a.local.head(1).load(Ordering::Relaxed), 4);
    assert_eq!(a.describe(), "shm/direct");
}

/// A sender fills the free slots and waits; each receive frees them again.
#[test]
fn a_full_ring_holds_the_sender_back() {
    let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
    let data = pattern(20_000, 3);
    let msg = out(&data, TAG, None);
    let mut sc = SendCursor::default();
    let p = a.send(&msg, &mut sc).unwrap();
    assert_eq!(
        (p.state, p.moved, sc.sent),
        (SendState::Pending, true, 8192)
    );
    let p = a.send(&msg, &mut sc).unwrap();
    assert_eq!(
        (p.state, p.moved, sc.sent),
        (SendState::Pending, false, 8192)
    );
    let mut rc = RecvCursor::default();
    let mut sink = Collect::new(data.len(), false);
    let expect = InExpect {
        len: data.len(),
        tag: TAG,
    };
    for (sent, state) in [(16384, SendState::Pending), (20_000, SendState::Complete)] {
        let before = rc.received;
        let p = b.recv(&expect, &mut rc, &mut sink).unwrap();
        assert_eq!((p.state, p.moved), (false, true));
        assert_eq!(rc.received, before + 8192);
        let p = a.send(&msg, &mut sc).unwrap();
        assert_eq!((p.state, sc.sent), (state, sent));
    }
    let p = b.recv(&expect, &mut rc, &mut sink).unwrap();
    assert!(p.state);
    assert_eq!(sink.buf, data);
    // Nothing more is there.
    let p = b
        .recv(&expect, &mut RecvCursor::default(), &mut sink)
        .unwrap();
    assert_eq!((p.state, p.moved), (false, false));
}

/// A receiver of a FIFO of 16 slots publishes its tail every fourth slot it reads and
/// whenever it finds the FIFO empty; a sender whose FIFO looks full gets its room back
/// either way, and nothing read is ever left unpublished while the receiver waits.
#[test]
fn the_tail_follows_the_reads_in_steps_and_before_a_wait() {
    let (a, b) = pair(16, 4096, false, usize::MAX, Access::Direct);
    // Above PACK_MAX, one slot each.
    let msgs: Vec<Vec<u8>> = (0..16)
        .map(|i| pattern(PACK_MAX + 1 + i, i as u8))
        .collect();
    for (i, m) in msgs.iter().enumerate() {
        let p = a
            .send(&out(m, TAG + i as u64, None), &mut SendCursor::default())
            .unwrap();
        assert_eq!(p.state, SendState::Complete, "message {i}");
    }
    // Full: the 17th waits.
    let extra = pattern(PACK_MAX + 1, 99);
    let mut extra_cur = SendCursor::default();
    let p = a
        .send(&out(&extra, TAG + 16, None), &mut extra_cur)
        .unwrap();
    assert_eq!((p.state, p.moved), (SendState::Pending, false));
    let published = || b.local.tail(0).load(Ordering::Relaxed);
    let receive = |i: usize| {
        let m = &msgs[i];
        let mut sink = Collect::new(m.len(), false);
        let expect = InExpect {
            len: m.len(),
            tag: TAG + i as u64,
        };
        let p = b
            .recv(&expect, &mut RecvCursor::default(), &mut sink)
            .unwrap();
        assert!(p.state && p.moved, "message {i} received");
        assert_eq!(&sink.buf, m, "message {i}");
    };
    for i in 0..3 {
        receive(i);
        assert_eq!(published(), 0, "after {} reads", i + 1);
    }
    let p = a
        .send(&out(&extra, TAG + 16, None), &mut extra_cur)
        .unwrap();
    assert_eq!(
        p.state,
        SendState::Pending,
        "three read slots are not out yet"
    );
    receive(3);
    assert_eq!(published(), 4, "the fourth read publishes");
    let p = a
        .send(&out(&extra, TAG + 16, None), &mut extra_cur)
        .unwrap();
    assert_eq!(p.state, SendState::Complete, "room again");
    for i in 4..16 {
        receive(i);
    }
    assert_eq!(published(), 16);
    // One more read leaves the tail behind, and the look that finds nothing more (as a
    // receiver makes before it waits) publishes it.
    let mut sink = Collect::new(extra.len(), false);
    let expect = InExpect {
        len: extra.len(),
        tag: TAG + 16,
    };
    assert!(
        b.recv(&expect, &mut RecvCursor::default(), &mut sink)
            .unwrap()
            .state
    );
    assert_eq!(sink.buf, extra);
    assert_eq!(published(), 16);
    let expect = InExpect {
        len: PACK_MAX + 1,
        tag: TAG,
    };
    let p = b
        .recv(&expect, &mut RecvCursor::default(), &mut sink)
        .unwrap();
    assert_eq!((p.state, p.moved), (false, false));
    assert_eq!(published(), 17, "an empty FIFO publishes what was read");
}

/// Two messages in the FIFO at once stay two: a receive takes exactly the first, `peek`
/// shows the next, and a receive that expects another length or tag is refused without
/// consuming it.
#[test]
fn messages_keep_their_boundaries() {
    let (a, b) = pair(8, 4096, false, usize::MAX, Access::Direct);
    assert_eq!(b.peek().unwrap(), None);
    let (m1, m2) = (pattern(10, 1), pattern(20, 2));
    for (m, tag) in [(&m1, TAG), (&m2, TAG + 1)] {
        let p = a
            .send(&out(m, tag, None), &mut SendCursor::default())
            .unwrap();
        assert_eq!(p.state, SendState::Complete);
    }
    assert_eq!(b.peek().unwrap(), Some((10, TAG)));
    let mut sink = Collect::new(10, false);
    let expect = InExpect { len: 10, tag: TAG };
    let p = b
        .recv(&expect, &mut RecvCursor::default(), &mut sink)
        .unwrap();
    assert!(p.state);
    assert_eq!(sink.buf, m1);
    assert_eq!(b.peek().unwrap(), Some((20, TAG + 1)));
    for wrong in [
        InExpect {
            len: 21,
            tag: TAG + 1,
        },
        InExpect { len: 20, tag: TAG },
    ] {
        let e = b
            .recv(
                &wrong,
                &mut RecvCursor::default(),
                &mut Collect::new(21, false),
            )
            .expect_err("a mismatch is refused");
        assert_eq!(e.kind, ErrorKind::InvalidUsage);
        assert!(
            e.msg.contains("rank 0 sent 20 bytes")
                && e.msg.contains(&format!("expects {} bytes", wrong.len)),
            "{}",
            e.msg
        );
    }
    let mut sink = Collect::new(20, true);
    let expect = InExpect {
        len: 20,
        tag: TAG + 1,
    };
    assert!(
        b.recv(&expect, &mut RecvCursor::default(), &mut sink)
            .unwrap()
            .state
    );
    assert_eq!(sink.buf, m2);
    assert_eq!(b.peek().unwrap(), None);
}

/// A message at or above the threshold travels as one descriptor; the receiver copies it
/// out of the sender's buffer at most PULL_BUDGET bytes per call, and the sender's buffer
/// is free (Complete) only once the receiver released the descriptor.
#[test]
fn large_messages_are_pulled_in_budgeted_pieces_and_released() {
    let threshold = 32 << 10;
    let (a, b) = pair(4, 4096, true, threshold, Access::Direct);
    let data = pattern(2 * PULL_BUDGET + 12_345, 9);
    let msg = out(&data, TAG, None);
    let mut sc = SendCursor::default();
    let p = a.send(&msg, &mut sc).unwrap();
    assert_eq!((p.state, p.moved), (SendState::Posted, true));
    assert_eq!(sc.link, Some(0), "released with slot 0");
    assert_eq!(b.local.head(0).load(Ordering::Relaxed), 1, "one slot");
    assert_eq!(b.peek().unwrap(), Some((data.len(), TAG)));
    let p = a.send(&msg, &mut sc).unwrap();
    assert_eq!((p.state, p.moved), (SendState::Posted, false));
    let mut rc = RecvCursor::default();
    let mut sink = Collect::new(data.len(), true);
    let expect = InExpect {
        len: data.len(),
        tag: TAG,
    };
    for k in 1..=2 {
        let p = b.recv(&expect, &mut rc, &mut sink).unwrap();
        assert_eq!((p.state, p.moved), (false, true));
        assert_eq!(rc.received, k * PULL_BUDGET);
        assert_eq!(a.send(&msg, &mut sc).unwrap().state, SendState::Posted);
    }
    assert!(b.recv(&expect, &mut rc, &mut sink).unwrap().state);
    assert_eq!(sink.buf, data);
    assert_eq!(
        sink.pieces,
        vec![
            (0, PULL_BUDGET),
            (PULL_BUDGET, PULL_BUDGET),
            (2 * PULL_BUDGET, 12_345)
        ]
    );
    let p = a.send(&msg, &mut sc).unwrap();
    assert_eq!((p.state, p.moved), (SendState::Complete, true));

    // Exactly the threshold is pulled (one slot, one piece through `put`); one byte less
    // goes eagerly, a slot per 4 KiB.
    let at = pattern(threshold, 1);
    let below = pattern(threshold - 1, 2);
    let msgs = [(at.clone(), TAG, None), (below.clone(), TAG + 1, None)];
    let got = exchange(&a, &b, &msgs[..1], false);
    assert_eq!(got[0].buf, at);
    assert_eq!(got[0].pieces, vec![(0, threshold)]);
    assert_eq!(b.local.head(0).load(Ordering::Relaxed), 2);
    let got = exchange(&a, &b, &msgs[1..], false);
    assert_eager(&got[0], &below, 4096, "below the threshold");
    assert_eq!(b.local.head(0).load(Ordering::Relaxed), 2 + 8);
}

/// Which threshold a message meets: the lowest for a busy sender's message that the
/// receiver copies as it is, or for one that offers its buffer for the reply; the middle one
/// for a busy sender's message that the receiver folds; the highest otherwise.
#[test]
fn each_kind_of_message_is_pulled_from_its_own_threshold() {
    let (mut a, b) = pair(16, 4096, true, 64 << 10, Access::Direct);
    a.pull_threshold_busy = 32 << 10;
    a.pull_threshold_copied = 16 << 10;
    let data = pattern(24 << 10, 9);
    let cases = [
        // (busy, copied, reply_here, pulled)
        (true, true, false, true),
        (true, false, false, false),
        (false, true, false, false),
        (false, false, true, true),
        (false, false, false, false),
    ];
    for (busy, copied, reply_here, pulled) in cases {
        let what = format!("busy {busy}, copied {copied}, reply_here {reply_here}");
        let msg = out(&data, TAG, None);
        let offer = Offer {
            sender_busy: busy,
            copied,
            reply_at: reply_here.then_some(msg.src as usize),
        };
        let head = b.local.head(0).load(Ordering::Relaxed);
        let mut got = vec![0u8; data.len()];
        let mut sink = Fold::landing(&mut got);
        let (first, r) = transfer(&a, &b, &msg, offer, &mut sink);
        r.unwrap();
        assert_eq!(first == SendState::Posted, pulled, "{what}");
        let slots = if pulled { 1 } else { 6 };
        assert_eq!(
            b.local.head(0).load(Ordering::Relaxed),
            head + slots,
            "{what}"
        );
        assert_eq!(got, data, "{what}");
    }
}

/// A sender busy with receives of its own has its messages pulled from the lower threshold;
/// the same message from a sender with nothing else to do goes through the slots.
#[test]
fn a_busy_senders_message_is_pulled_from_the_lower_threshold() {
    let (mut a, b) = pair(16, 4096, true, 64 << 10, Access::Direct);
    a.pull_threshold_busy = 16 << 10;
    let data = pattern(32 << 10, 5);
    let expect = InExpect {
        len: data.len(),
        tag: TAG,
    };
    let msg = out(&data, TAG, None);
    let mut offer = Offer {
        sender_busy: true,
        ..Offer::default()
    };
    let mut sc = SendCursor::default();
    let p = a.send_offered(&msg, offer, &mut sc).unwrap();
    assert_eq!(
        (p.state, p.moved),
        (SendState::Posted, true),
        "busy: pulled"
    );
    assert_eq!(
        b.local.head(0).load(Ordering::Relaxed),
        1,
        "one descriptor slot"
    );
    let (mut rc, mut sink) = (RecvCursor::default(), Collect::new(data.len(), true));
    assert!(b.recv(&expect, &mut rc, &mut sink).unwrap().state);
    assert_eq!(sink.buf, data);
    assert_eq!(sink.pieces, vec![(0, data.len())]);
    let p = a.send_offered(&msg, offer, &mut sc).unwrap();
    assert_eq!(p.state, SendState::Complete);

    offer.sender_busy = false;
    let mut sc = SendCursor::default();
    let p = a.send_offered(&msg, offer, &mut sc).unwrap();
    assert_eq!(
        p.state,
        SendState::Complete,
        "not busy: copied into the slots"
    );
    assert_eq!(
        b.local.head(0).load(Ordering::Relaxed),
        1 + 8,
        "a slot per 4 KiB"
    );
    let (mut rc, mut sink) = (RecvCursor::default(), Collect::new(data.len(), true));
    assert!(b.recv(&expect, &mut rc, &mut sink).unwrap().state);
    assert_eager(&sink, &data, 4096, "not busy");
}

/// Pulling with process_vm_readv (from this very process) into a sink that combines:
/// the bytes come through the scratch buffer in PULL_PIECE pieces.
#[test]
fn a_cma_pull_into_a_combining_sink_goes_piece_by_piece() {
    let (a, b) = pair(4, 4096, true, 32 << 10, Access::Cma(std::process::id()));
    if !probe_cma(std::process::id(), a.local.base_addr()) {
        eprintln!("process_vm_readv is not permitted here; the CMA pull is not tested");
        return;
    }
    let data = pattern(2 * PULL_PIECE + 100, 4);
    let msgs = [(data.clone(), TAG, None)];
    let got = exchange(&a, &b, &msgs, false);
    assert_eq!(got[0].buf, data);
    // Each piece lies in scratch at its offset within a page in the sender's buffer.
    let src = msgs[0].0.as_ptr() as usize;
    for (&(off, _), &from) in got[0].pieces.iter().zip(&got[0].from) {
        assert_eq!(from % PAGE_SPAN, (src + off) % PAGE_SPAN, "piece at {off}");
    }
    assert_eq!(got[0].from.len(), 3);
    assert_eq!(
        got[0].pieces,
        vec![
            (0, PULL_PIECE),
            (PULL_PIECE, PULL_PIECE),
            (2 * PULL_PIECE, 100)
        ]
    );
    assert_eq!(
        b.local.head(0).load(Ordering::Relaxed),
        1,
        "pulled, not eager"
    );
    assert_eq!(a.describe(), "shm/cma");
    // The probe reads the segment's first word: another address does not pass.
    assert!(!probe_cma(std::process::id(), a.local.base_addr() + 64));
    // The kernel copies this rank's buffers: large ones are better on huge pages.
    let world = ShmWorld::made_of(0, a.local.clone(), vec![None, Some(Arc::new(a))], false);
    assert!(world.prefers_huge_pages());
}

/// A sink over memory it does not own: copies into it (`direct`) or folds into it (XOR),
/// and says whether its result goes back to the sender (`returns`).
struct Fold {
    dst: *mut u8,
    len: usize,
    direct: bool,
    returns: bool,
    forwards: bool,
    forward_first: bool,
    pieces: Vec<(usize, usize)>,
}

impl Fold {
    /// Folds into `buf`, whose result goes back to the sender.
    fn returning(buf: &mut [u8]) -> Fold {
        Fold::over(buf, false, true)
    }

    /// Takes the bytes straight into `buf`.
    fn landing(buf: &mut [u8]) -> Fold {
        Fold::over(buf, true, false)
    }

    fn over(buf: &mut [u8], direct: bool, returns: bool) -> Fold {
        Fold {
            dst: buf.as_mut_ptr(),
            len: buf.len(),
            direct,
            returns,
            forwards: false,
            forward_first: false,
            pieces: Vec::new(),
        }
    }
}

impl Sink for Fold {
    fn direct(&mut self) -> Option<*mut u8> {
        self.direct.then_some(self.dst)
    }

    fn put(&mut self, offset: usize, data: &[u8], _: Option<Scale>) -> Result<()> {
        assert!(offset + data.len() <= self.len);
        for (i, &x) in data.iter().enumerate() {
            // SAFETY: the test's buffer covers `len` bytes.
            unsafe { *self.dst.add(offset + i) ^= x };
        }
        self.pieces.push((offset, data.len()));
        Ok(())
    }

    fn placed(&mut self, offset: usize, len: usize, _: Option<Scale>) -> Result<()> {
        self.pieces.push((offset, len));
        Ok(())
    }

    fn reply(&self) -> Option<Reply> {
        self.returns.then_some(Reply {
            at: self.dst.cast_const(),
            next: self.forwards,
            forward_first: self.forward_first,
        })
    }
}

/// Sends `msg` on `tx` until it completes while `rx` receives it into `sink`; the send's
/// first state and the receive's result.
fn transfer(
    tx: &ShmPeer,
    rx: &ShmPeer,
    msg: &OutMsg,
    offer: Offer,
    sink: &mut Fold,
) -> (SendState, Result<()>) {
    let mut sc = SendCursor::default();
    let mut rc = RecvCursor::default();
    let expect = InExpect {
        len: msg.len,
        tag: msg.tag,
    };
    let first = tx.send_offered(msg, offer, &mut sc).unwrap().state;
    let mut state = first;
    for _ in 0..100_000 {
        match rx.recv(&expect, &mut rc, sink) {
            Ok(p) if p.state => {}
            Ok(_) => continue,
            Err(e) => return (first, Err(e)),
        }
        while state != SendState::Complete {
            state = tx.send_offered(msg, offer, &mut sc).unwrap().state;
        }
        return (first, Ok(()));
    }
    panic!("stalled");
}

/// Kernel copies at a distance where `rep movsb` runs slow (the destination 1 to 63 bytes
/// past the source modulo a page) go through scratch; the bytes land all the same, pulled
/// straight into a receive buffer or folded and written back into the sender's memory.
#[test]
fn kernel_copies_at_a_slow_distance_land_all_the_same() {
    let pid = std::process::id();
    let (probe, _) = pair(2, 4096, true, 0, Access::Direct);
    if !probe_cma(pid, probe.local.base_addr()) {
        eprintln!("process_vm_readv is not permitted here; staged CMA copies are not tested");
        return;
    }
    let len = 2 * PULL_PIECE + 100;
    for skew in [0, 16, 48, 4080] {
        // Page-aligned sources; the receive buffer `skew` bytes into its page.
        let (mut sbuf, mut fbuf, mut rbuf) = (
            vec![0u8; len + 2 * PAGE_SPAN],
            vec![0u8; len + 2 * PAGE_SPAN],
            vec![0u8; len + 2 * PAGE_SPAN],
        );
        let s0 = sbuf.as_ptr().align_offset(PAGE_SPAN);
        let f0 = fbuf.as_ptr().align_offset(PAGE_SPAN);
        let r0 = rbuf.as_ptr().align_offset(PAGE_SPAN) + skew;
        let (a0, b0) = (pattern(len, 7), pattern(len, 8));
        sbuf[s0..s0 + len].copy_from_slice(&a0);
        let (a, b) = pair(4, 4096, true, 32 << 10, Access::Cma(pid));
        let msg = out(&sbuf[s0..s0 + len], TAG, None);
        let mut land = Fold::landing(&mut rbuf[r0..r0 + len]);
        let (first, r) = transfer(&a, &b, &msg, Offer::default(), &mut land);
        r.unwrap();
        assert_eq!(first, SendState::Posted, "skew {skew}: pulled");
        assert!(rbuf[r0..r0 + len] == a0[..], "skew {skew}: pulled bytes");

        // The receiver folds into fbuf (page-aligned) and writes the result back into
        // rbuf, `skew` bytes past it modulo a page.
        rbuf.fill(0);
        fbuf[f0..f0 + len].copy_from_slice(&b0);
        let (a, b) = pair(4, 4096, true, 32 << 10, Access::Cma(pid));
        let msg = out(&sbuf[s0..s0 + len], TAG, None);
        let offer = Offer {
            reply_at: Some(rbuf[r0..].as_ptr() as usize),
            ..Offer::default()
        };
        let mut fold = Fold::returning(&mut fbuf[f0..f0 + len]);
        let (first, r) = transfer(&a, &b, &msg, offer, &mut fold);
        r.unwrap();
        assert_eq!(first, SendState::Posted, "skew {skew}: folded");
        let folded: Vec<u8> = a0.iter().zip(&b0).map(|(x, y)| x ^ y).collect();
        assert!(
            fbuf[f0..f0 + len] == folded[..],
            "skew {skew}: folded bytes"
        );
        assert!(
            rbuf[r0..r0 + len] == folded[..],
            "skew {skew}: written back"
        );
        assert!(rbuf[..r0].iter().chain(&rbuf[r0 + len..]).all(|&x| x == 0));
    }
}

/// A folding receiver whose result goes straight back writes it where the sender offered
/// (its own buffer in place, another out of place) as it pulls, when (and only when) the
/// sender offered a place; its send of the result is then a notice that completes at once,
/// and the sender's receive into that place takes the notice without copying. A notice
/// for a receive that lands elsewhere is an error. Between threads (plain copies) and with
/// process_vm_readv/writev.
#[test]
fn a_folded_reply_is_written_back_and_its_send_is_a_notice() {
    let mut accesses = vec![Access::Direct];
    let (probe, _) = pair(2, 4096, true, 0, Access::Direct);
    if probe_cma(std::process::id(), probe.local.base_addr()) {
        accesses.push(Access::Cma(std::process::id()));
    } else {
        eprintln!("process_vm_readv is not permitted here; the CMA write-back is not tested");
    }
    let len = 2 * PULL_PIECE + 100;
    for access in accesses {
        // Offered: none, the sent bytes themselves, a separate receive buffer.
        for offered in [None, Some(false), Some(true)] {
            let what = format!("{access:?}, offered {offered:?}");
            let (a, b) = pair(4, 4096, true, 32 << 10, access);
            let (a0, b0) = (pattern(len, 1), pattern(len, 2));
            let folded: Vec<u8> = a0.iter().zip(&b0).map(|(x, y)| x ^ y).collect();
            let (mut abuf, mut bbuf) = (a0.clone(), b0.clone());
            let mut arecv = vec![0u8; len];
            let msg = out(&abuf, TAG, None);
            let offer = Offer {
                reply_at: offered.map(|elsewhere| {
                    if elsewhere {
                        arecv.as_ptr() as usize
                    } else {
                        abuf.as_ptr() as usize
                    }
                }),
                ..Offer::default()
            };
            let mut fold = Fold::returning(&mut bbuf);
            let (first, r) = transfer(&a, &b, &msg, offer, &mut fold);
            r.unwrap();
            assert_eq!(first, SendState::Posted, "{what}: pulled");
            assert_eq!(bbuf, folded, "{what}");
            // Between processes the pull goes piece by piece through scratch.
            let pieces = if access == Access::Direct { 1 } else { 3 };
            assert_eq!(fold.pieces.len(), pieces, "{what}");
            assert_eq!(
                abuf == folded,
                offered == Some(false),
                "{what}: written back"
            );
            assert_eq!(
                arecv == folded,
                offered == Some(true),
                "{what}: written there"
            );
            if offered == Some(true) {
                assert_eq!(abuf, a0, "{what}: the sent bytes stay");
            }
            let heads = a.local.head(1).load(Ordering::Relaxed);
            let reply = out(&bbuf, TAG, None);
            let lands = if offered == Some(true) {
                &mut arecv
            } else {
                &mut abuf
            };
            let mut land = Fold::landing(lands);
            let (first, r) = transfer(&b, &a, &reply, Offer::default(), &mut land);
            r.unwrap();
            let expect = if offered.is_some() {
                SendState::Complete
            } else {
                SendState::Posted
            };
            assert_eq!(first, expect, "{what}: the reply's send");
            assert_eq!(a.local.head(1).load(Ordering::Relaxed), heads + 1, "{what}");
            assert_eq!(land.pieces, vec![(0, len)], "{what}");
            assert_eq!(*lands, folded, "{what}: the reply landed");
            assert!(b.carried.list.lock().is_empty(), "{what}");
        }
        // A notice whose address is not where the receive lands.
        let (a, b) = pair(4, 4096, true, 32 << 10, access);
        let (abuf, mut bbuf) = (pattern(len, 1), pattern(len, 2));
        let msg = out(&abuf, TAG, None);
        let offer = Offer {
            reply_at: Some(msg.src as usize),
            ..Offer::default()
        };
        transfer(&a, &b, &msg, offer, &mut Fold::returning(&mut bbuf))
            .1
            .unwrap();
        let mut elsewhere = vec![0u8; len];
        let mut land = Fold::landing(&mut elsewhere);
        let e = transfer(&b, &a, &out(&bbuf, TAG, None), Offer::default(), &mut land)
            .1
            .unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Internal, "{}", e.msg);
        assert!(e.msg.contains("does not land"), "{}", e.msg);
        assert!(elsewhere.iter().all(|&x| x == 0));
    }
}

/// A folding receiver whose result is the next message to the sender (`Reply::next`)
/// puts each folded piece straight into its FIFO's slots while it pulls, as long as slots
/// are free; the result's send then sends only the rest (nothing, when every piece went),
/// and the sender receives the whole result in order. Without `forwards` nothing goes
/// ahead and the result is sent as usual. Between processes (process_vm_readv) only.
#[test]
fn a_forwarded_fold_goes_into_the_slots_as_it_folds_and_its_send_sends_the_rest() {
    let (probe, _) = pair(2, 4096, true, 0, Access::Direct);
    if !probe_cma(std::process::id(), probe.local.base_addr()) {
        eprintln!("process_vm_readv is not permitted here; forwarding is not tested");
        return;
    }
    let access = Access::Cma(std::process::id());
    let len = 2 * PULL_PIECE + 100;
    let slot = 4096;
    let need = len.div_ceil(slot);
    for (nslots, forwards, ahead) in [(256, true, need), (8, true, 8), (256, false, 0)] {
        let what = format!("{nslots} slots, forwards {forwards}");
        let (a, b) = pair(nslots, slot, true, 32 << 10, access);
        let (a0, b0) = (pattern(len, 1), pattern(len, 2));
        let folded: Vec<u8> = a0.iter().zip(&b0).map(|(x, y)| x ^ y).collect();
        let (mut abuf, mut bbuf) = (a0.clone(), b0.clone());
        let msg = out(&abuf, TAG, None);
        let mut fold = Fold::returning(&mut bbuf);
        fold.forwards = forwards;
        let before = b.remote.head(1).load(Ordering::Relaxed);
        let (first, r) = transfer(&a, &b, &msg, Offer::default(), &mut fold);
        r.unwrap();
        assert_eq!(first, SendState::Posted, "{what}: pulled");
        assert!(bbuf == folded, "{what}");
        let went = (b.remote.head(1).load(Ordering::Relaxed) - before) as usize;
        assert_eq!(went, ahead, "{what}: slots filled while folding");
        // The result's send and the sender's receive, driven in turn (into zeros: the
        // test sink folds eager pieces in with xor).
        let reply = out(&bbuf, TAG, None);
        abuf.fill(0);
        let mut land = Fold::landing(&mut abuf);
        let expect = InExpect { len, tag: TAG };
        let (mut sc, mut rc) = (SendCursor::default(), RecvCursor::default());
        let first = b.send(&reply, &mut sc).unwrap().state;
        let (mut sent, mut got) = (first == SendState::Complete, false);
        for _ in 0..100_000 {
            if !got {
                got = a.recv(&expect, &mut rc, &mut land).unwrap().state;
            }
            if !sent {
                sent = b.send(&reply, &mut sc).unwrap().state == SendState::Complete;
            }
            if sent && got {
                break;
            }
        }
        assert!(sent && got, "{what}: stalled");
        let expect_first = match ahead {
            0 => SendState::Posted,
            a if a == need => SendState::Complete,
            _ => SendState::Pending,
        };
        assert_eq!(first, expect_first, "{what}: the result's first send");
        assert!(abuf == folded, "{what}: the result landed");
        if ahead > 0 {
            let offsets: Vec<usize> = land.pieces.iter().map(|p| p.0).collect();
            let want: Vec<usize> = (0..need).map(|k| k * slot).collect();
            assert_eq!(offsets, want, "{what}: in order, slot by slot");
        }
        assert!(b.carried.list.lock().is_empty(), "{what}");
    }
}

/// Where the sender offered a place for the reply and the folded bytes may also be
/// forwarded, the sink's choice (`Reply::forward_first`, the executor's by measured times)
/// decides: forwarding fills the slots and leaves the offered place untouched, otherwise
/// the bytes are written back there and no slot fills. Between threads (plain copies,
/// which never forward) they are written back whatever the sink would rather.
#[test]
fn an_offered_place_is_written_back_unless_the_sink_would_rather_forward() {
    let pid = std::process::id();
    let (probe, _) = pair(2, 4096, true, 0, Access::Direct);
    if !probe_cma(pid, probe.local.base_addr()) {
        eprintln!("process_vm_readv is not permitted here; the choice is not tested");
        return;
    }
    let (len, slot) = (2 * PULL_PIECE + 100, 4096);
    for (first, access) in [
        (true, Access::Cma(pid)),
        (false, Access::Cma(pid)),
        (true, Access::Direct),
    ] {
        let (a, b) = pair(256, slot, true, 32 << 10, access);
        let (a0, b0) = (pattern(len, 3), pattern(len, 4));
        let folded: Vec<u8> = a0.iter().zip(&b0).map(|(x, y)| x ^ y).collect();
        let mut bbuf = b0.clone();
        let arecv = vec![0u8; len];
        let msg = out(&a0, TAG, None);
        let offer = Offer {
            reply_at: Some(arecv.as_ptr() as usize),
            ..Offer::default()
        };
        let mut fold = Fold::returning(&mut bbuf);
        fold.forwards = true;
        fold.forward_first = first;
        let before = b.remote.head(1).load(Ordering::Relaxed);
        transfer(&a, &b, &msg, offer, &mut fold).1.unwrap();
        let what = format!("forward first {first}, {access:?}");
        assert_eq!(bbuf, folded, "{what}: folded");
        let went = (b.remote.head(1).load(Ordering::Relaxed) - before) as usize;
        // Between threads nothing forwards: the bytes are written back all the same.
        let forwarded = first && access != Access::Direct;
        let need = if forwarded { len.div_ceil(slot) } else { 0 };
        assert_eq!(went, need, "{what}: slots filled");
        if forwarded {
            assert!(arecv.iter().all(|&x| x == 0), "written back all the same");
        } else {
            assert_eq!(arecv, folded, "not written back");
        }
    }
}

/// A sender's multiplier reaches the receiver with every piece, eager or pulled.
#[test]
fn a_scale_travels_with_the_message() {
    let (a, b) = pair(2, 4096, true, 32 << 10, Access::Direct);
    let s = Some(Scale([1, 2, 3, 4, 5, 6, 7, 8]));
    let msgs = [
        (pattern(10_000, 1), TAG, s),
        (pattern(100_000, 2), TAG + 1, s),
        (pattern(100, 3), TAG + 2, None),
    ];
    for direct in [false, true] {
        let got = exchange(&a, &b, &msgs, direct);
        for (g, m) in got.iter().zip(&msgs) {
            assert_eq!(g.buf, m.0);
            assert!(!g.scales.is_empty());
            assert!(g.scales.iter().all(|&x| x == m.2), "{:?}", g.scales);
        }
    }
}

/// Warming a link only reads: messages in flight either way still arrive whole, and no
/// head or tail moves.
#[test]
fn warming_a_link_changes_nothing_in_its_fifos() {
    let (a, b) = pair(16, 4096, false, usize::MAX, Access::Direct);
    let msgs: Vec<Vec<u8>> = (0..3).map(|i| pattern(100 + i, i as u8)).collect();
    for (i, m) in msgs.iter().enumerate() {
        let p = a
            .send(&out(m, TAG + i as u64, None), &mut SendCursor::default())
            .unwrap();
        assert_eq!(p.state, SendState::Complete);
    }
    let state = |l: &ShmPeer| {
        (
            l.local.head(l.peer).load(Ordering::Relaxed),
            l.local.tail(l.peer).load(Ordering::Relaxed),
            l.remote.head(l.me).load(Ordering::Relaxed),
            l.remote.tail(l.me).load(Ordering::Relaxed),
        )
    };
    let before = (state(&a), state(&b));
    a.warm();
    b.warm();
    assert_eq!((state(&a), state(&b)), before);
    for (i, m) in msgs.iter().enumerate() {
        let mut sink = Collect::new(m.len(), false);
        let expect = InExpect {
            len: m.len(),
            tag: TAG + i as u64,
        };
        assert!(
            b.recv(&expect, &mut RecvCursor::default(), &mut sink)
                .unwrap()
                .state
        );
        assert_eq!(&sink.buf, m);
    }
}

/// Receives one message of `len` bytes with `tag` on `b`, checking `peek` first; its bytes
/// and scales.
fn take(b: &ShmPeer, len: usize, tag: u64) -> Collect {
    assert_eq!(b.peek().unwrap(), Some((len, tag)), "peek of {len} bytes");
    let mut sink = Collect::new(len, false);
    let mut rc = RecvCursor::default();
    let expect = InExpect { len, tag };
    for _ in 0..16 {
        if b.recv(&expect, &mut rc, &mut sink).unwrap().state {
            return sink;
        }
    }
    panic!("{len} bytes with tag {tag:#x} did not arrive");
}

/// Messages of up to PACK_MAX bytes share slots, entry after entry, with or without a
/// scale; larger ones and pulled ones take slots of their own between them, and the
/// receiver gets every message in order, also through `peek`. A packed slot's first message
/// lies in the line of the slot's number.
#[test]
fn small_messages_are_packed_and_keep_their_order_among_others() {
    let (a, b) = pair(8, 4096, false, usize::MAX, Access::Direct);
    let s = Some(Scale([9, 8, 7, 6, 5, 4, 3, 2]));
    let msgs: Vec<(usize, Option<Scale>)> = vec![
        (8, None),
        (0, None),
        (1, s),
        (24, s),
        (40, None),
        (48, None),
        (49, s),
        (PACK_MAX, s),
        (PACK_MAX + 1, None),
        (3, None),
        (5000, s),
        (8, None),
        (100, None),
    ];
    let datas: Vec<Vec<u8>> = msgs
        .iter()
        .map(|&(len, _)| pattern(len, len as u8 ^ 0x5a))
        .collect();
    for (i, (&(len, scale), data)) in msgs.iter().zip(&datas).enumerate() {
        let p = a
            .send(
                &out(data, TAG + i as u64, scale),
                &mut SendCursor::default(),
            )
            .unwrap();
        assert_eq!(p.state, SendState::Complete, "message {i}: {len} bytes");
    }
    // Slots: one packed (the first eight), one for PACK_MAX + 1, one packed, two for 5000
    // bytes, one packed.
    assert_eq!(a.remote.head(0).load(Ordering::Relaxed), 6);
    let first = b.local.slot(0, 0);
    // SAFETY: slot 0 of a mapped FIFO, published.
    unsafe {
        assert_eq!((first.add(SLOT_FIELDS) as *const u32).read(), KIND_PACKED);
        let ctl = entry_ctl(first, PACK_FIRST).load(Ordering::Acquire);
        assert_eq!(ctl & ENTRY_LEN, 8);
        assert!(PACK_FIRST + entry_bytes(8, false) <= PACK_LINE);
        let data = std::slice::from_raw_parts(first.add(PACK_FIRST + 16), 8);
        assert_eq!(
            data,
            &datas[0][..],
            "the first message in the number's line"
        );
    }
    for (i, (&(len, scale), data)) in msgs.iter().zip(&datas).enumerate() {
        let got = take(&b, len, TAG + i as u64);
        assert_eq!(&got.buf, data, "message {i}: {len} bytes");
        assert!(got.scales.iter().all(|&x| x == scale), "message {i}: scale");
    }
    assert_eq!(b.peek().unwrap(), None);
}

/// A FIFO of two slots holds hundreds of small messages. When packed slots fill, the
/// sender waits for the receiver to finish one (pending, nothing written), and entries
/// left from earlier turns of the ring never pass for new ones: every byte is checked over
/// many turns, with receives lagging behind sends by different amounts.
#[test]
fn packed_slots_hold_many_messages_and_turn_around_the_ring() {
    let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
    let msg = |i: usize| pattern(8 + i % 3 * 8, i as u8);
    let send = |i: usize| {
        let data = msg(i);
        a.send(
            &out(&data, TAG + i as u64, None),
            &mut SendCursor::default(),
        )
        .unwrap()
    };
    let receive = |i: usize| {
        let got = take(&b, msg(i).len(), TAG + i as u64);
        assert_eq!(got.buf, msg(i), "message {i}");
    };
    let (mut sent, mut received) = (0usize, 0usize);
    // Entries of 24-40 bytes, one or two to a line, in two slots of PACK_AREA bytes.
    loop {
        let p = send(sent);
        if p.state == SendState::Pending {
            assert!(!p.moved, "a pending send writes nothing");
            break;
        }
        sent += 1;
    }
    assert!(sent >= 150, "only {sent} messages fit in two slots");
    for lag in [1usize, 7, 100, 3, 255] {
        for _ in 0..2000 {
            while received + lag < sent {
                receive(received);
                received += 1;
            }
            if send(sent).state == SendState::Complete {
                sent += 1;
            } else {
                receive(received);
                received += 1;
            }
        }
    }
    while received < sent {
        receive(received);
        received += 1;
    }
    assert_eq!(b.peek().unwrap(), None);
    assert!(
        a.remote.head(0).load(Ordering::Relaxed) > 20,
        "the ring turned"
    );
}

/// Bytes that an eager message left in a slot, shaped like the control word the receiver
/// waits for next, are not taken for a packed entry when the slot is packed later: the
/// receiver finds nothing until the entry is sent.
#[test]
fn leftover_bytes_that_look_like_an_entry_are_not_one() {
    let (a, b) = pair(2, 4096, false, usize::MAX, Access::Direct);
    // Every word says "stamp of the second packed message, 0 bytes".
    let fake: Vec<u8> = std::iter::repeat_n((stamp_of(1) << STAMP_SHIFT).to_le_bytes(), 500)
        .flatten()
        .collect();
    let filler = pattern(PACK_MAX + 1, 7);
    for (i, m) in [&fake, &filler].into_iter().enumerate() {
        a.send(&out(m, TAG + i as u64, None), &mut SendCursor::default())
            .unwrap();
        assert_eq!(&take(&b, m.len(), TAG + i as u64).buf, m);
    }
    // Slot 0 again, packed: an entry of 56 bytes goes to the second line and ends where
    // the fake words are.
    let first = pattern(56, 1);
    a.send(&out(&first, TAG + 2, None), &mut SendCursor::default())
        .unwrap();
    assert_eq!(a.remote.head(0).load(Ordering::Relaxed), 3);
    assert_eq!(take(&b, 56, TAG + 2).buf, first);
    assert_eq!(b.peek().unwrap(), None, "nothing sent yet");
    let expect = InExpect {
        len: 8,
        tag: TAG + 3,
    };
    let mut sink = Collect::new(8, false);
    let mut rc = RecvCursor::default();
    let p = b.recv(&expect, &mut rc, &mut sink).unwrap();
    assert_eq!((p.state, p.moved), (false, false));
    let second = pattern(8, 2);
    a.send(&out(&second, TAG + 3, None), &mut SendCursor::default())
        .unwrap();
    assert!(b.recv(&expect, &mut rc, &mut sink).unwrap().state);
    assert_eq!(sink.buf, second);
}

/// A rank that finds a live peer stopped serving blames the rank that died, where one did,
/// not the live one that gave up because of it.
#[test]
fn a_peer_that_stopped_serving_is_not_blamed_for_a_rank_that_died() {
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let watch = ProcessWatch::new(dead.id());
    dead.wait().unwrap();
    let live = ProcessWatch::new(std::process::id());
    let cause = Error::new(ErrorKind::Remote, "connection refused");
    let e = stopped_serving(1, &cause, &[(1, live), (4, watch)]);
    assert_eq!(e.kind, ErrorKind::Remote);
    assert_eq!(e.lost, Some(4));
    assert!(e.msg.starts_with("rank 4 exited"), "{}", e.msg);
    assert!(e.msg.contains("rank 1 then stopped serving"), "{}", e.msg);
    let e = stopped_serving(1, &cause, &[(1, ProcessWatch::new(std::process::id()))]);
    assert_eq!(e.lost, Some(1));
    assert!(e.msg.starts_with("rank 1 stopped serving"), "{}", e.msg);
}

/// A packed message that is not what the receiver expects (length or tag) is the same
/// mismatch error as an eager one, and the message stays for the right receive.
#[test]
fn a_packed_message_of_another_size_or_operation_is_a_mismatch() {
    let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
    let data = pattern(8, 1);
    a.send(&out(&data, TAG, None), &mut SendCursor::default())
        .unwrap();
    for expect in [
        InExpect { len: 16, tag: TAG },
        InExpect {
            len: 8,
            tag: TAG + 1,
        },
    ] {
        let mut sink = Collect::new(expect.len, false);
        let e = b
            .recv(&expect, &mut RecvCursor::default(), &mut sink)
            .expect_err("a mismatch");
        assert_eq!(e.kind, ErrorKind::InvalidUsage, "{}", e.msg);
        assert!(e.msg.contains("sent 8 bytes"), "{}", e.msg);
    }
    assert_eq!(take(&b, 8, TAG).buf, data);
}

/// Closing one end is what the other end's peer check reports: how it closed and which
/// rank it had lost, the worst way it closed winning. Bytes sent before still arrive.
#[test]
fn a_closed_end_is_reported_with_how_and_whom_it_lost() {
    let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
    assert!(b.check_peer().is_ok());
    let data = pattern(100, 5);
    a.send(&out(&data, TAG, None), &mut SendCursor::default())
        .unwrap();
    a.close(Closing::Aborted, Some(5));
    let e = b.check_peer().expect_err("rank 0 aborted");
    assert_eq!(e.kind, ErrorKind::Remote);
    assert!(
        e.msg
            .contains("rank 0 aborted its communicator after it lost rank 5"),
        "{}",
        e.msg
    );
    assert_eq!(e.lost, Some(5));
    // The loss is noted for this rank's own peers too.
    assert_eq!(b.local.first_lost().load(Ordering::SeqCst), 6);
    // Destroying after aborting is still an abort.
    a.close(Closing::Destroyed, None);
    assert!(b.check_peer().unwrap_err().msg.contains("aborted"));
    let mut sink = Collect::new(100, false);
    let expect = InExpect { len: 100, tag: TAG };
    assert!(
        b.recv(&expect, &mut RecvCursor::default(), &mut sink)
            .unwrap()
            .state
    );
    assert_eq!(sink.buf, data);

    let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
    a.close(Closing::TimedOut, Some(1));
    let e = b.check_peer().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Timeout);
    assert!(
        e.msg.contains("rank 0 timed out waiting for rank 1"),
        "{}",
        e.msg
    );
    // The error says whom rank 0 waited for (this rank, 1: the blame check reads it), but
    // what this rank tells its own peers it lost is rank 0, not itself (they said "rank 1
    // timed out waiting for rank 1").
    assert_eq!(e.lost, Some(1));
    assert_eq!(b.local.first_lost().load(Ordering::SeqCst), 1);

    let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
    b.close(Closing::Destroyed, None);
    let e = a.check_peer().unwrap_err();
    assert!(
        e.msg.contains("rank 1 destroyed its communicator"),
        "{}",
        e.msg
    );
    assert_eq!(e.lost, Some(1));
}

/// A ring wakes the owner asleep on its doorbell, and so does a peer's send; a ring
/// with nobody asleep leaves the doorbell word alone.
#[test]
fn the_doorbell_wakes_a_sleeping_owner() {
    let (a, b) = pair(4, 4096, false, usize::MAX, Access::Direct);
    let seg = b.local.clone();
    let word = seg.doorbell().load(Ordering::SeqCst);
    seg.ring();
    assert_eq!(seg.doorbell().load(Ordering::SeqCst), word);
    let data = [7u8; 8];
    let wakers: [&dyn Fn(); 2] = [&|| seg.ring(), &|| {
        a.send(&out(&data, TAG, None), &mut SendCursor::default())
            .unwrap();
    }];
    for wake in wakers {
        let took = std::thread::scope(|s| {
            let sleeper = s.spawn(|| {
                let seen = seg.prepare_sleep();
                let t = Instant::now();
                seg.sleep(seen, Duration::from_secs(10));
                t.elapsed()
            });
            while seg.sleepers().load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(20));
            wake();
            sleeper.join().unwrap()
        });
        assert!(took < Duration::from_secs(5), "slept {took:?}");
        assert_eq!(seg.sleepers().load(Ordering::SeqCst), 0);
    }
}

/// A peer's segment is used only when it is what the peer announced: the nonce, the rank
/// count and the size must match.
#[test]
fn a_segment_opens_only_as_announced() {
    let geo = Geometry {
        nranks: 2,
        nslots: 4,
        slot_bytes: 4096,
        registry_bytes: 4096,
    };
    let seg = Segment::create(0, geo, 0xabc).unwrap();
    let fd = || sys::dup(seg.fd.as_ref().unwrap().as_raw_fd()).unwrap();
    let opened = Segment::open(fd(), 0xabc, 2).expect("as announced");
    assert_eq!(opened.geo, geo);
    assert_eq!(opened.map.len(), geo.total());
    assert!(opened.fd.is_none());
    for (nonce, nranks) in [(0xabd, 2), (0xabc, 3)] {
        let e = Segment::open(fd(), nonce, nranks).err().expect("refused");
        assert_eq!(e.kind, ErrorKind::Remote);
        assert!(e.msg.contains("does not match"), "{}", e.msg);
    }
    let small = sys::memfd("comm-shm-test", 100).unwrap();
    let e = Segment::open(small, 0xabc, 2).err().expect("too small");
    assert!(e.msg.contains("only 100 bytes"), "{}", e.msg);
}

/// The areas of a segment follow one another without overlapping, page-aligned.
#[test]
fn segment_areas_do_not_overlap() {
    for (nranks, nslots, slot_bytes) in [(1, 2, 4096), (2, 16, 65536), (9, 3, 4224)] {
        let g = Geometry {
            nranks,
            nslots,
            slot_bytes,
            registry_bytes: 4096,
        };
        assert!(g.slots_base() >= CTL_BASE + nranks * CTL_STRIDE);
        assert_eq!(g.slots_base() % 4096, 0);
        assert!(g.registry_base() >= g.slots_base() + nranks * nslots * g.slot_stride());
        assert_eq!(g.registry_base() % 4096, 0);
        assert_eq!(g.total(), g.registry_base() + 4096);
        assert_eq!(g.slot_stride() % 64, 0);
    }
}

/// Threads of one process copy each other's buffers themselves, without the kernel: no huge
/// pages asked for them, pulls or not.
#[test]
fn only_pulls_through_the_kernel_ask_for_huge_pages() {
    let (a, _b) = pair(2, 4096, true, 1024, Access::Direct);
    let world = ShmWorld::made_of(0, a.local.clone(), vec![None, Some(Arc::new(a))], false);
    assert!(!world.prefers_huge_pages());
}

/// What a receive keeps of a pull in its cursor's word comes back the same, and a fresh
/// cursor's zero is a receive that pulls nothing.
#[test]
fn a_pull_in_progress_lives_in_the_cursor_word() {
    let states = [
        PullState::default(),
        PullState::of(PullState::START),
        PullState {
            pulling: true,
            forwarded: 123_456_789,
            stopped: true,
        },
        PullState {
            pulling: false,
            forwarded: (1 << 40) + 3,
            stopped: true,
        },
    ];
    for st in states {
        assert_eq!(PullState::of(st.word()), st);
    }
    assert_eq!(PullState::of(0), PullState::default());
    assert!(PullState::of(PullState::START).pulling);
    assert_eq!(PullState::of(PullState::START).forwarded, 0);
}

/// The links of `n` ranks that are threads of this process, shared memory's made at first use.
fn on_demand(n: usize) -> Vec<(crate::bootstrap::Bootstrap, crate::transport::Links)> {
    let id = crate::bootstrap::new_unique_id().expect("unique id");
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let id = id.clone();
                s.spawn(move || {
                    super::DEMAND_FOR_TEST.with(|c| c.set(Some(true)));
                    let t = Some(Duration::from_secs(20));
                    let boot = crate::bootstrap::Bootstrap::init(&[id], r, n, t).expect("boot");
                    let me = crate::topo::this_process();
                    let placements = vec![me; n];
                    let deadline = Some(Instant::now() + Duration::from_secs(20));
                    let net = crate::transport::net::NetChoice::resolve(None).expect("net");
                    let links = crate::transport::establish_with(
                        &boot,
                        &placements,
                        0x5eed,
                        deadline,
                        true,
                        &net,
                    )
                    .expect("links");
                    (boot, links)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// One message from `tx` to `rx`, driven from this thread.
fn one_message(tx: &dyn Link, rx: &dyn Link, data: &[u8]) -> Result<Vec<u8>> {
    let mut sc = SendCursor::default();
    let mut rc = RecvCursor::default();
    let mut sink = Collect::new(data.len(), false);
    let expect = InExpect {
        len: data.len(),
        tag: TAG,
    };
    let (mut sent, mut got) = (false, false);
    for _ in 0..100_000 {
        if !sent {
            sent = tx.send(&out(data, TAG, None), &mut sc)?.state == SendState::Complete;
        }
        if !got {
            got = rx.recv(&expect, &mut rc, &mut sink)?.state;
        }
        if sent && got {
            return Ok(sink.buf);
        }
    }
    panic!("stalled: sent {sent}, received {got}");
}

/// A rank maps a peer's segment when their link is first used, and only then: the ranks that
/// talk map each other's, the one that talks to nobody maps nothing, and what a rank reads of
/// where its peers run comes from the segments it mapped.
#[test]
fn a_link_maps_its_peers_segment_at_first_use_and_no_other() {
    let w = on_demand(3);
    for (_, l) in &w {
        assert_eq!(
            l.transports.find::<super::ShmWorld>().unwrap().mapped(),
            0,
            "nothing mapped at init"
        );
    }
    let link = |from: usize, to: usize| w[from].1.links[to].clone();
    assert!(link(0, 2).describe().contains("not mapped yet"));
    let data = pattern(300, 4);
    assert_eq!(
        one_message(&*link(0, 1), &*link(1, 0), &data).unwrap(),
        data
    );
    let back = pattern(70_000, 5);
    assert_eq!(
        one_message(&*link(1, 0), &*link(0, 1), &back).unwrap(),
        back
    );
    let mapped: Vec<usize> = w
        .iter()
        .map(|(_, l)| l.transports.find::<super::ShmWorld>().unwrap().mapped())
        .collect();
    assert_eq!(mapped, [1, 1, 0]);
    assert_eq!(link(0, 1).describe(), "shm/direct");
    // Where a peer runs is read from its segment, once mapped.
    let presence = |r: usize| w[r].1.presence.clone().unwrap();
    presence(1).set_running_on(1, Activity::Polling);
    presence(2).set_running_on(0, Activity::Polling);
    assert_eq!(presence(0).running_on(1), Some((1, Activity::Polling)));
    assert_eq!(
        presence(0).running_on(2),
        None,
        "rank 2's segment is not mapped"
    );
}

/// A peer that aborted before it ever used its link to this rank (a half-connected
/// communicator) is found by this rank's first use of the link, named with how it ended.
#[test]
fn a_peer_that_closed_an_unused_link_is_named_at_first_use() {
    let w = on_demand(3);
    let link = |from: usize, to: usize| w[from].1.links[to].clone();
    let data = pattern(64, 1);
    assert_eq!(
        one_message(&*link(0, 1), &*link(1, 0), &data).unwrap(),
        data
    );
    link(2, 0).close(Closing::Aborted, Some(1));
    link(2, 1).close(Closing::Aborted, Some(1));
    assert!(link(2, 0)
        .send(&out(&data, TAG, None), &mut SendCursor::default())
        .is_err());
    let mut sink = Collect::new(64, false);
    let expect = InExpect { len: 64, tag: TAG };
    let r = link(0, 2).recv(&expect, &mut RecvCursor::default(), &mut sink);
    assert!(!r.unwrap().state, "nothing arrives");
    let e = link(0, 2).check_peer().unwrap_err();
    assert!(e.msg.contains("rank 2 aborted"), "{}", e.msg);
    assert_eq!(
        w[0].1
            .transports
            .find::<super::ShmWorld>()
            .unwrap()
            .mapped(),
        2
    );
    // An abort maps the peers to leave each a note of how it ended (a destroy would not).
    assert_eq!(
        w[2].1
            .transports
            .find::<super::ShmWorld>()
            .unwrap()
            .mapped(),
        2
    );
}
