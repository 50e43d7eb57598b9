//! The step engine: one communicator's share of a run, starting steps as their hazards and
//! per-peer order allow and progressing them on their links.

use super::blame::count_repeats;
use super::cache::{plan_key, Line, Plan, Tables};
use super::hazards::{Hazards, Hint};
use super::plan::{is_p2p, op_bytes, resolver, Action, Built, Reuse, StepQueue, XStep};
use super::straight::run_local;
use super::{ExecCache, Wiring};
use crate::algo::{Buf, Step};
use crate::error::{Error, Result};
use crate::exec::op::Reduction;
use crate::exec::ranges::kinds_apart;
use crate::tag::describe_tag;
use crate::transport::{RecvCursor, SendCursor, SendState};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One communicator's share of a run.
pub(super) struct Exec<'a> {
    pub(super) wiring: &'a Wiring,
    pub(super) t: &'a mut Tables,
    pub(super) remaining: usize,
    /// Some operation of the run copies received bytes in (`Offer::sender_busy`).
    pub(super) busy: bool,
}

/// How long an error about a peer that only hung up waits for other links to show a loss
/// that explains it (`Exec::with_other_losses`).
pub(super) const LOSS_GRACE: Duration = Duration::from_millis(200);

/// Operations whose output is at least this large write received bytes that are not read
/// again in the run with non-temporal stores (`RecvSink::stream`), and forward folded bytes
/// (`Reply::next`): the size from which a two-rank all-reduce is scheduled for that.
pub(super) const STREAM_FROM: usize = crate::algo::ring::FUSE_FROM;

/// Bytes received from one peer in one pass before the executor turns to other work.
pub(super) const RECV_BYTES_PER_PASS: usize = 256 << 10;

impl<'a> Exec<'a> {
    /// The executor for the operations in `cache.tables.ops`, over the cache's tables.
    pub(super) fn new(wiring: &'a Wiring, cache: &'a mut ExecCache) -> Result<Exec<'a>> {
        let npeers = wiring.links.len();
        cache.recall();
        let ExecCache {
            plans: known,
            scratch,
            tables: t,
            built,
            repeat: _,
            replies: _,
        } = cache;
        let need: usize = t
            .ops
            .iter()
            .map(|o| o.schedule.scratch.next_multiple_of(64))
            .sum();
        if scratch.len() < need / 64 {
            scratch.resize(need / 64, Line([0; 64]));
        }
        let scratch = scratch.as_mut_ptr() as *mut u8;
        // Peers pull from scratch too (an in-place all-to-all sends its blocks from there); it
        // is collapsed the second time it comes (`sys::collapse_to_huge_pages`), so repeated
        // calls look at it as well.
        wiring.collapse_if_large(scratch as usize, need);
        if let ([op], Some(b)) = (t.ops.as_slice(), built.as_mut()) {
            let reuse = b.reuse(op, scratch, t.plan.steps.len());
            if reuse != Reuse::Nothing {
                op.collapse_to_huge_pages(wiring);
                if reuse == Reuse::Structure {
                    b.take_buffers(op, scratch, &mut t.plan.steps);
                }
                let tried = std::mem::take(&mut t.tried);
                if !tried {
                    for (i, s) in t.plan.steps.iter_mut().enumerate() {
                        s.restart(b.hazards.waiting_on[i]);
                    }
                }
                return Ok(Exec::rewind(wiring, t, tried));
            }
        }
        *built = None;
        t.tried = false;
        let steps = &mut t.plan.steps;
        steps.clear();
        let mut scratch_at = 0usize;
        for (oi, op) in t.ops.iter().enumerate() {
            op.collapse_to_huge_pages(wiring);
            // SAFETY: scratch holds the sum of every op's scratch bytes (rounded).
            let at = resolver(op, unsafe { scratch.add(scratch_at) });
            let input_scale = op.reduction.and_then(|r| r.input_scale);
            for step in &op.schedule.steps {
                let action = Action::of(step, &at, input_scale);
                let copied = op.reduction.is_none()
                    && !matches!(step, Step::Send { src, .. } if src.region.buf == Buf::Scratch);
                if let Action::Send { peer, .. } | Action::Recv { peer, .. } = action {
                    if peer >= npeers {
                        return crate::internal_err!("schedule names rank {peer} of {npeers}");
                    }
                }
                steps.push(XStep {
                    action,
                    op: oi,
                    waiting_on: 0,
                    first_dependent: 0,
                    dependents: 0,
                    hint: Hint::None,
                    copied,
                    finished: false,
                    send: SendCursor::default(),
                    recv: RecvCursor::default(),
                });
            }
            scratch_at += op.schedule.scratch.next_multiple_of(64);
        }
        let ops = &t.ops;
        let mirror = |op: usize, p: usize| ops[op].in_recv(p);
        let hazards = match t.ops.as_slice() {
            [op] => {
                let key = plan_key(op);
                let h = match known.get(&key) {
                    Some(p) => p.hazards.clone(),
                    None => {
                        let h = Arc::new(Hazards::compute(steps, &mirror));
                        if known.len() >= 256 {
                            known.clear();
                        }
                        let plan = Plan {
                            _schedule: op.schedule.clone(),
                            hazards: h.clone(),
                            parked: None,
                        };
                        known.insert(key, plan);
                        h
                    }
                };
                *built = Some(Built {
                    schedule: op.schedule.clone(),
                    send: op.send,
                    recv: op.recv,
                    aliasing: key.1,
                    input_scale: op.reduction.and_then(|r| r.input_scale),
                    scratch,
                    hazards: h.clone(),
                });
                h
            }
            _ => Arc::new(Hazards::compute(steps, &mirror)),
        };
        for (i, s) in steps.iter_mut().enumerate() {
            s.waiting_on = hazards.waiting_on[i];
            s.first_dependent = hazards.first[i];
            s.dependents = hazards.count[i];
            s.hint = hazards.hints[i];
        }
        t.edges = hazards.edges.clone();
        Ok(Exec::queue(wiring, t))
    }

    /// The executor over newly built steps: every step queued behind its peer's earlier ones,
    /// and the local steps that wait for nothing ready to run.
    pub(super) fn queue(wiring: &'a Wiring, t: &'a mut Tables) -> Exec<'a> {
        let npeers = wiring.links.len();
        for q in t.plan.send_q.iter_mut().chain(t.plan.recv_q.iter_mut()) {
            q.steps.clear();
        }
        t.plan.send_q.resize_with(npeers, StepQueue::default);
        t.plan.recv_q.resize_with(npeers, StepQueue::default);
        t.plan.first_local.clear();
        for (i, s) in t.plan.steps.iter().enumerate() {
            match s.action {
                Action::Send { peer, .. } => t.plan.send_q[peer].steps.push(i as u32),
                Action::Recv { peer, .. } => t.plan.recv_q[peer].steps.push(i as u32),
                Action::Local { .. } => {
                    if s.waiting_on == 0 {
                        t.plan.first_local.push(i as u32)
                    }
                }
            }
        }
        t.plan.first_local.reverse();
        t.plan.peers.clear();
        let (send_q, recv_q) = (&t.plan.send_q, &t.plan.recv_q);
        t.plan.peers.extend(
            (0..npeers).filter(|&p| !send_q[p].steps.is_empty() || !recv_q[p].steps.is_empty()),
        );
        let (ops, steps) = (&t.ops, &t.plan.steps);
        let p2p = |i: &u32| is_p2p(&ops[steps[*i as usize].op]);
        let apart = kinds_apart(op_bytes(ops));
        t.plan.mixed.clear();
        t.plan.mixed.extend(
            recv_q
                .iter()
                .map(|q| apart && q.steps.iter().any(p2p) && !q.steps.iter().all(p2p)),
        );
        Exec::rewind(wiring, t, false)
    }

    /// The executor over steps queued before (by `queue`), from their start, or, when
    /// `straight` `tried` them, past those it finished (their dependents' counts lowered).
    pub(super) fn rewind(wiring: &'a Wiring, t: &'a mut Tables, tried: bool) -> Exec<'a> {
        let steps = &t.plan.steps;
        for &p in &t.plan.peers {
            // What `straight` finished of a queue comes first in it.
            for q in [&mut t.plan.send_q[p], &mut t.plan.recv_q[p]] {
                q.head = if tried {
                    q.steps
                        .iter()
                        .take_while(|&&i| steps[i as usize].finished)
                        .count()
                } else {
                    0
                };
            }
        }
        t.matched.clear();
        t.matched.resize(t.plan.recv_q.len(), false);
        t.ready_local.clear();
        let mut remaining = steps.len();
        if !tried {
            t.ready_local.extend_from_slice(&t.plan.first_local);
        } else {
            remaining -= steps.iter().filter(|s| s.finished).count();
            // Lowest first off the stack, as `first_local` has them.
            t.ready_local
                .extend((0..steps.len() as u32).rev().filter(|&i| {
                    let s = &steps[i as usize];
                    !s.finished && s.waiting_on == 0 && matches!(s.action, Action::Local { .. })
                }));
        }
        t.posted.clear();
        let busy = t.ops.iter().any(|o| o.schedule.copies_in);
        Exec {
            wiring,
            t,
            remaining,
            busy,
        }
    }

    pub(super) fn complete(&mut self, i: u32) {
        let step = &self.t.plan.steps[i as usize];
        let range =
            step.first_dependent as usize..(step.first_dependent + step.dependents) as usize;
        self.remaining -= 1;
        for k in range {
            let d = self.t.edges[k];
            let s = &mut self.t.plan.steps[d as usize];
            s.waiting_on -= 1;
            if s.waiting_on == 0 && matches!(s.action, Action::Local { .. }) {
                self.t.ready_local.push(d);
            }
        }
    }

    pub(super) fn reduction(&self, i: u32) -> Option<Reduction> {
        self.t.ops[self.t.plan.steps[i as usize].op].reduction
    }

    pub(super) fn tag(&self, i: u32) -> u64 {
        self.t.ops[self.t.plan.steps[i as usize].op].tag
    }

    /// One pass over everything that can move. Returns whether anything did.
    ///
    /// Sends are posted first and receiving is bounded per peer and pass: otherwise a rank
    /// fed a steady stream of incoming messages keeps receiving and never posts its own
    /// sends, and the peer that feeds it starves (both ranks then alternate instead of
    /// working at the same time).
    pub(super) fn pass(&mut self) -> Result<bool> {
        let mut moved = self.reap_posted()?;
        for pi in 0..self.t.plan.peers.len() {
            moved |= self.post_sends(self.t.plan.peers[pi])?;
        }
        for pi in 0..self.t.plan.peers.len() {
            let peer = self.t.plan.peers[pi];
            let mut budget = RECV_BYTES_PER_PASS;
            while budget > 0 {
                if self.t.plan.mixed[peer] && !self.t.matched[peer] && !self.match_by_tag(peer) {
                    break;
                }
                let Some(&i) = self.t.plan.recv_q[peer].front() else {
                    break;
                };
                if self.t.plan.steps[i as usize].waiting_on > 0 {
                    break;
                }
                let (finished, m) = self.drive_recv(i)?;
                moved |= m;
                if !finished {
                    break;
                }
                if let Action::Recv { len, .. } = self.t.plan.steps[i as usize].action {
                    budget = budget.saturating_sub(len.max(1));
                }
                self.t.matched[peer] = false;
                self.t.plan.recv_q[peer].pop_front();
                self.complete(i);
            }
        }
        while let Some(i) = self.t.ready_local.pop() {
            self.run_local(i)?;
            self.complete(i);
            moved = true;
        }
        Ok(moved)
    }

    /// Where a group's receives from `peer` mix send/recv calls with collectives (`mixed`):
    /// brings the receive that the message now arriving from `peer` belongs to to the front of
    /// its queue. Collectives match across ranks in the order called, and so do the send/recv
    /// calls between two ranks, but how a rank interleaves the two is its own: NCCL lets every
    /// rank's group hold `ncclSend(peer)`, `ncclAllReduce`, `ncclRecv(peer)`, and each rank's
    /// sends to the peer then arrive in an order its receives do not expect. Returns whether
    /// the front may go on: not while nothing has arrived, nor while the receive the message
    /// belongs to waits for an earlier step (one of its own operation's, or of its own kind:
    /// `mixed` holds only where no send/recv call shares a buffer with a collective of the
    /// group). A transport that cannot look at the next message, or a message no receive
    /// expects, leaves the front as called (which then names the mismatch).
    pub(super) fn match_by_tag(&mut self, peer: usize) -> bool {
        let tag = match self.wiring.links[peer].peek() {
            Ok(Some((_, tag))) => tag,
            Ok(None) => return false,
            Err(_) => return true,
        };
        let q = &mut self.t.plan.recv_q[peer];
        let (ops, steps) = (&self.t.ops, &self.t.plan.steps);
        let Some(k) = q.steps[q.head..]
            .iter()
            .position(|&i| ops[steps[i as usize].op].tag == tag)
        else {
            return true;
        };
        let at = q.head + k;
        if steps[q.steps[at] as usize].waiting_on > 0 {
            return false;
        }
        // The others keep their order behind it.
        q.steps[q.head..=at].rotate_right(1);
        self.t.matched[peer] = true;
        true
    }

    /// Completes posted sends whose buffers the peers have finished reading.
    pub(super) fn reap_posted(&mut self) -> Result<bool> {
        let mut moved = false;
        let mut k = 0;
        while k < self.t.posted.len() {
            let i = self.t.posted[k];
            if self.drive_send(i)? == SendState::Complete {
                self.t.posted.swap_remove(k);
                self.complete(i);
                moved = true;
            } else {
                k += 1;
            }
        }
        Ok(moved)
    }

    /// Posts as many of `peer`'s ready sends, in order, as its FIFO takes.
    pub(super) fn post_sends(&mut self, peer: usize) -> Result<bool> {
        let mut moved = false;
        while let Some(&i) = self.t.plan.send_q[peer].front() {
            if self.t.plan.steps[i as usize].waiting_on > 0 {
                break;
            }
            let before = self.t.plan.steps[i as usize].send.sent;
            let state = self.drive_send(i)?;
            moved |=
                self.t.plan.steps[i as usize].send.sent != before || state != SendState::Pending;
            match state {
                SendState::Pending => break,
                SendState::Posted => {
                    self.t.plan.send_q[peer].pop_front();
                    self.t.posted.push(i);
                }
                SendState::Complete => {
                    self.t.plan.send_q[peer].pop_front();
                    self.complete(i);
                }
            }
        }
        Ok(moved)
    }

    pub(super) fn drive_send(&mut self, i: u32) -> Result<SendState> {
        let step = &mut self.t.plan.steps[i as usize];
        let p = step.send_on(&self.wiring.links, &self.t.ops[step.op], self.busy)?;
        Ok(p.state)
    }

    pub(super) fn drive_recv(&mut self, i: u32) -> Result<(bool, bool)> {
        let tag = self.tag(i);
        let reduction = self.reduction(i);
        let Action::Recv { peer, dst, len, .. } = self.t.plan.steps[i as usize].action else {
            unreachable!("receive queue holds a non-receive step")
        };
        let (hint, op) = (
            self.t.plan.steps[i as usize].hint,
            self.t.plan.steps[i as usize].op,
        );
        let stream = self.t.ops[op].schedule.recv_extent >= STREAM_FROM;
        // The reply (the next step to touch dst, by the hint) is at the front of the peer's
        // sends: every earlier message to that peer is handed over. It belongs to the same
        // operation, so it carries the same tag.
        let returns = hint == Hint::Returns;
        let forwards = returns
            && stream
            && self.t.plan.send_q[peer].front().is_some_and(|&s| {
                let s = &self.t.plan.steps[s as usize];
                s.op == op
                    && matches!(s.action, Action::Send { src, len: l, .. }
                        if src.ptr == dst.cast_const() && l == len)
            });
        self.t.could_forward |= forwards;
        let forward_first = self.t.forward_first;
        let p = self.t.plan.steps[i as usize].receive(
            &self.wiring.links,
            tag,
            reduction,
            stream,
            forwards,
            forward_first,
        )?;
        Ok((p.state, p.moved))
    }

    pub(super) fn run_local(&mut self, i: u32) -> Result<()> {
        run_local(self.t.plan.steps[i as usize].action, self.reduction(i))
    }

    /// Describes the channels that are stuck, for warnings and timeouts.
    pub(super) fn blocked_on(&self) -> (Vec<usize>, String) {
        let mut ranks = Vec::new();
        let mut parts = Vec::new();
        for &peer in &self.t.plan.peers {
            if let Some(&i) = self.t.plan.recv_q[peer].front() {
                let s = &self.t.plan.steps[i as usize];
                if s.waiting_on == 0 {
                    if let Action::Recv { len, .. } = s.action {
                        ranks.push(peer);
                        parts.push(format!(
                            "receive of {len} bytes from rank {peer} ({})",
                            describe_tag(self.tag(i))
                        ));
                    }
                }
            }
            if let Some(&i) = self.t.plan.send_q[peer].front() {
                if self.t.plan.steps[i as usize].waiting_on == 0 {
                    ranks.push(peer);
                    parts.push(format!("send to rank {peer} (its buffer is full)"));
                }
            }
        }
        for &i in &self.t.posted {
            if let Action::Send { peer, len, .. } = self.t.plan.steps[i as usize].action {
                ranks.push(peer);
                parts.push(format!("rank {peer} to read {len} bytes it was offered"));
            }
        }
        ranks.sort_unstable();
        ranks.dedup();
        (ranks, count_repeats(parts))
    }

    /// The operations of this run, as their tags describe them ("AllReduce #3 (float, sum)").
    pub(super) fn called(&self) -> String {
        let mut seen: Vec<u64> = Vec::new();
        for op in &self.t.ops {
            if !seen.contains(&op.tag) {
                seen.push(op.tag);
            }
        }
        let names: Vec<String> = seen.iter().map(|&t| describe_tag(t)).collect();
        names.join(", ")
    }

    /// This rank gives up: the peers hear at once that it timed out and whom it suspects, so
    /// that a peer waiting on it can tell its own story instead of blaming it.
    pub(super) fn give_up(&self, err: &Error) {
        for l in &self.wiring.links {
            l.close(crate::transport::Closing::TimedOut, err.lost);
        }
    }

    pub(super) fn check_peers(&self) -> Result<()> {
        if self.wiring.abort.load(Ordering::SeqCst) {
            return crate::remote_err!(
                "the communicator was aborted or destroyed while an operation was in progress"
            );
        }
        let (ranks, _) = self.blocked_on();
        for r in ranks {
            if let Err(e) = self.wiring.links[r].check_peer() {
                return Err(self.with_other_losses(e, r));
            }
        }
        Ok(())
    }

    /// A peer we wait for failed; it may have failed because another rank was lost first (it
    /// aborted after losing it). Name every peer that is gone, so the error reaches the cause.
    ///
    /// A peer that only hung up, without saying whom it lost (a TCP peer that aborted in the
    /// middle of a message cannot; a shared-memory peer always can), may still have failed
    /// because of another rank whose own hang-up reaches this rank a moment later: the other
    /// links get up to LOSS_GRACE to show it before the peer alone is blamed. Seen in CI: a rank killed, its neighbour
    /// aborting, and the third rank's send to that neighbour reset 3 ms after the kill, before
    /// the victim's connection to it showed the hang-up.
    pub(super) fn with_other_losses(&self, e: Error, first: usize) -> Error {
        let look = || -> Vec<String> {
            (0..self.wiring.links.len())
                .filter(|&p| p != first && p != self.wiring.rank)
                .filter_map(|p| {
                    let link = &self.wiring.links[p];
                    link.check_peer()
                        .err()
                        .map(|e| e.msg)
                        .or_else(|| link.hung_up_reason())
                })
                .collect()
        };
        let mut others = look();
        if others.is_empty()
            && e.lost == Some(first)
            && self.wiring.links.len() > 2
            && !self.wiring.links[first].tells_its_losses()
        {
            let until = Instant::now() + LOSS_GRACE;
            while others.is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
                others = look();
            }
        }
        // Peers often report the same loss in the same words ("rank 0 failed after it lost
        // rank 1" from two of them): each is said once, and not again when the error says it.
        let mut told: Vec<String> = Vec::new();
        for o in others {
            if !e.msg.contains(&o) && !told.contains(&o) {
                told.push(o);
            }
        }
        if told.is_empty() {
            e
        } else {
            let mut out = Error::new(e.kind, format!("{}; also {}", e.msg, told.join("; ")));
            out.lost = e.lost;
            out
        }
    }
}
