//! The host executor: runs schedules on host memory with the CPU doing the copies and reductions.
//!
//! A step may start once every earlier step it conflicts with has finished (it writes what they
//! read or write, or reads what they write: found by intersecting the byte ranges). Per peer,
//! sends start in list order and receives start in list order. Within those rules everything
//! runs as soon as it can, interleaved on one thread: pipelining falls out of the slicing, and
//! send/recv pairs never deadlock whatever order the caller issued them in. One call can drive
//! several communicators (a group over several communicators from one thread).

use super::replies::{Replies, Way};
use crate::algo::{Buf, Operand, Region, Schedule, Step};
use crate::error::{Error, ErrorKind, Result};
use crate::exec::ranges::{kinds_apart, OpBytes};
use crate::reduce::{Reducer, Scale};
use crate::tag::describe_tag;
use crate::transport::{
    os, Activity, Doorbell, InExpect, Link, OutMsg, Progress, RecvCursor, SendCursor, SendState,
    Sink,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a reducing operation combines values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reduction {
    pub reducer: Reducer,
    /// Applied once to this rank's own input (PreMulSum's scalar, 1/n for a float average).
    pub input_scale: Option<Scale>,
    /// Device calls only: the input's multiplier is read from this device address when the
    /// kernels run (a PreMulSum scalar in device memory, ncclScalarDevice).
    pub input_scale_at: Option<u64>,
    /// Final values are divided by this (an integer average).
    pub divide_by: Option<usize>,
}

/// One operation of one communicator, with its buffers.
pub(crate) struct HostOp {
    pub schedule: Arc<Schedule>,
    pub send: *const u8,
    pub recv: *mut u8,
    pub tag: u64,
    pub reduction: Option<Reduction>,
}

impl HostOp {
    /// The larger of the bytes it reads from its send buffer and writes to its receive buffer.
    fn extent(&self) -> usize {
        self.schedule.send_extent.max(self.schedule.recv_extent)
    }

    /// For an address in the send buffer, the same place in the receive buffer.
    fn in_recv(&self, p: usize) -> Option<usize> {
        let send = self.send as usize;
        (send..send + self.schedule.send_extent)
            .contains(&p)
            .then(|| p - send + self.recv as usize)
    }

    /// Moves the operation's large buffers onto huge pages before peers in other processes
    /// copy from or into them (`Wiring::huge_pages_from`).
    fn collapse_to_huge_pages(&self, wiring: &Wiring) {
        wiring.collapse_if_large(self.send as usize, self.schedule.send_extent);
        wiring.collapse_if_large(self.recv as usize, self.schedule.recv_extent);
    }
}

/// How long a wait may last without progress (`Wiring::timeout`): COMM_TIMEOUT when the
/// communicator was made, changed later by commSetTimeout (the torch backend sets a group's
/// timeout with it). Nanoseconds; 0 for no limit.
#[derive(Debug, Default)]
pub(crate) struct Limit(AtomicU64);

impl Limit {
    pub(crate) fn new(limit: Option<Duration>) -> Limit {
        let l = Limit::default();
        l.set(limit);
        l
    }

    pub(crate) fn get(&self) -> Option<Duration> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }

    pub(crate) fn set(&self, limit: Option<Duration>) {
        let n = limit.map_or(0, |d| d.as_nanos().clamp(1, u64::MAX as u128) as u64);
        self.0.store(n, Ordering::Relaxed);
    }
}

/// What the executor needs from a communicator.
pub(crate) struct Wiring {
    pub rank: usize,
    /// One transport per peer, this rank's own loopback included.
    pub links: Vec<Arc<dyn Link>>,
    /// The doorbell links ring when they give this rank something to do.
    pub doorbell: Arc<dyn Doorbell>,
    pub abort: Arc<AtomicBool>,
    /// Give up (ncclTimeout) after this long without progress.
    pub timeout: Limit,
    /// Log which ranks we are waiting for after this long without progress.
    pub warn_after: Duration,
    /// Memory reused from call to call: scratch space (so large operations do not fault in
    /// fresh pages every call) and the executor's own tables (so small ones allocate nothing).
    pub cache: Mutex<ExecCache>,
    /// Spin this long before sleeping on the doorbell.
    pub spin: Duration,
    /// Then give the core away (sched_yield) for this long before sleeping: with more ranks
    /// than cores the rank we wait for is often runnable, and yielding hands it our core
    /// without a futex round trip.
    pub yield_for: Duration,
    /// This host's ranks fit its CPUs: a peer found waiting for this rank's CPU got there by
    /// an accident of scheduling, and this rank moves off that CPU (see `crowded`). With more
    /// ranks than CPUs sharing is the rule, and yielding serves better.
    pub spread: bool,
    /// This host runs more of the communicator's ranks than it has CPUs (and no spin window
    /// was asked for): a rank with nothing to do gives its core away at every look instead of
    /// polling on.
    pub hand_over: bool,
    /// This rank's place among the communicator's ranks on this host, where there are several
    /// (`settle`); None otherwise.
    pub home: Option<usize>,
    /// Buffers at least this large are moved onto huge pages before peers in other processes
    /// copy from or into them (None: never).
    pub huge_pages_from: Option<usize>,
}

impl Wiring {
    /// After an operation large enough to push them out, brings back into this core's caches
    /// and TLB what the links' next small messages touch (`Link::warm`), so that the next
    /// small calls do not pay for it one page walk at a time.
    fn warm_links(&self) {
        for l in &self.links {
            l.warm();
        }
    }

    /// On the application's thread, once the communicator is ready. The first communicator a
    /// thread creates moves it onto the CPU of its mask that its place among the host's ranks
    /// numbers (`home`), if it is not there; the mask stays whole, so the scheduler may move
    /// it later. The wake-ups that end initialisation often left two unpinned ranks on one
    /// CPU, and `crowded` moved one only once it waited, in its first calls: 60-80 us on the
    /// 2-vCPU VM (the CPU it goes to is idle, and wakes first), in the first timed calls of
    /// about half of the 2-rank benchmark runs. With more ranks than CPUs the places wrap
    /// round the mask, so each CPU starts with its share, the same ones in every run: left
    /// to the scheduler, which pairs it made decided 4 ranks on 2 CPUs (a one-shot
    /// all-to-all of 128 B-8 KiB took 11-17 us a call, or half that). Later communicators (a
    /// split, say) leave the thread where it is: their places need not match the first one's.
    ///
    /// Then tells the peers on this host where the rank runs, back in its application, so
    /// that a peer about to sleep knows which CPUs to keep off (`hold_for_sleep`) from the
    /// first call on.
    ///
    /// Returns the CPU the thread moved to, if it moved.
    pub(crate) fn settle(&self) -> Option<u32> {
        thread_local! {
            static SETTLED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        }
        let first = !SETTLED.replace(true);
        let moved = self.home.filter(|_| first).and_then(os::move_to_nth_cpu);
        if let Some(cpu) = this_cpu() {
            self.doorbell.set_running_on(cpu, Activity::Outside);
        }
        moved
    }

    /// Moves `[ptr, ptr + len)` onto huge pages when it is at least `huge_pages_from` long.
    fn collapse_if_large(&self, ptr: usize, len: usize) {
        if self.huge_pages_from.is_some_and(|min| len >= min) {
            crate::transport::os::collapse_to_huge_pages(ptr, len);
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Src {
    ptr: *const u8,
    scale: Option<Scale>,
}

#[derive(Clone, Copy, Debug)]
enum Action {
    Send {
        peer: usize,
        src: Src,
        len: usize,
    },
    Recv {
        peer: usize,
        dst: *mut u8,
        len: usize,
        with: Option<Src>,
        last: bool,
    },
    Local {
        dst: *mut u8,
        len: usize,
        a: Src,
        b: Option<Src>,
        last: bool,
    },
}

impl XStep {
    /// The message of this send step of `op`; `busy`: `OutMsg::sender_busy`.
    fn message(&self, op: &HostOp, busy: bool) -> OutMsg {
        let Action::Send { src, len, .. } = self.action else {
            unreachable!("a message of a step that sends nothing")
        };
        OutMsg {
            src: src.ptr,
            len,
            scale: src.scale,
            tag: op.tag,
            sender_busy: busy,
            copied: self.copied,
            reply_at: match self.hint {
                Hint::ReplyHere => Some(src.ptr as usize),
                Hint::ReplyInRecv => op.in_recv(src.ptr as usize),
                _ => None,
            },
        }
    }

    /// Receives what more of this receive step has come on its link, numbered `tag`, folding
    /// with `reduction`; `stream`, `forwards` and `forward_first` as `RecvSink` has them.
    fn receive(
        &mut self,
        links: &[Arc<dyn Link>],
        tag: u64,
        reduction: Option<Reduction>,
        stream: bool,
        forwards: bool,
        forward_first: bool,
    ) -> Result<Progress<bool>> {
        let Action::Recv {
            peer,
            dst,
            len,
            with,
            last,
        } = self.action
        else {
            unreachable!("a receive of a step that receives nothing")
        };
        let mut sink = RecvSink {
            dst,
            len,
            with,
            reduction,
            last,
            returns: self.hint == Hint::Returns,
            forwards,
            forward_first,
            stream,
        };
        links[peer].recv(&InExpect { len, tag }, &mut self.recv, &mut sink)
    }

    /// Back to the start: no progress, waiting for `waiting_on` earlier steps.
    fn restart(&mut self, waiting_on: u32) {
        self.waiting_on = waiting_on;
        self.finished = false;
        self.send = SendCursor::default();
        self.recv = RecvCursor::default();
    }
}

struct XStep {
    action: Action,
    op: usize,
    waiting_on: u32,
    /// This step's dependents are `edges[first_dependent..first_dependent + dependents]`.
    first_dependent: u32,
    dependents: u32,
    /// A send: where its reply lands (`OutMsg::reply_at`). A receive: its sink `returns` (see
    /// `Hazards::hints`).
    hint: Hint,
    /// A send: `OutMsg::copied`, for operations that reduce nothing, except from scratch (an
    /// in-place all-to-all's blocks, just copied there: 2 processes, 128-512 KiB, 1.1-1.6x
    /// slower when peers pulled them out of this core's cache than through the slots).
    copied: bool,
    /// `straight` finished it (the executor that takes over skips it).
    finished: bool,
    send: SendCursor,
    recv: RecvCursor,
}

/// The dependency graph of one schedule: how many steps each step waits for, and which steps
/// wait for it (`edges[first[i]..first[i] + count[i]]`).
struct Hazards {
    waiting_on: Vec<u32>,
    first: Vec<u32>,
    count: Vec<u32>,
    edges: Arc<[u32]>,
    /// Per step, `XStep::hint`.
    hints: Vec<Hint>,
}

/// What `Hazards::hints` found out about a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Hint {
    #[default]
    None,
    /// A send whose reply lands in its own bytes (in place).
    ReplyHere,
    /// A send from its operation's send buffer whose reply lands at the same place of the
    /// receive buffer (out of place).
    ReplyInRecv,
    /// A folding receive whose result is next sent back, whole, to the same peer.
    Returns,
}

/// Which steps `Hazards` compares with which. A group of many small operations on buffers of
/// their own would otherwise compare every step with every other (4000 one-element
/// all-reduces in a group took 4.4 s, against 0.02 s one by one); for a few steps that is
/// the cheaper way.
enum Near {
    /// Every step with every other, for these many steps.
    All(usize),
    /// Only the steps of operations whose bytes meet. Steps are built operation by operation,
    /// so an operation's steps are one run of indices.
    Ops {
        /// Per operation, its steps' indices (start, end).
        steps: Vec<(usize, usize)>,
        /// Per operation, the operations (itself included, ascending) whose footprints overlap
        /// its own: every byte a step reads or writes, and the mirror of every send's bytes in
        /// its operation's receive buffer (`Hazards::hints` asks who touches those).
        near: Vec<Vec<usize>>,
    },
}

/// Up to this many steps `Near::All` compares them all.
const NEAR_ALL_UP_TO: usize = 64;

impl Near {
    fn new(steps: &[XStep], mirror: &dyn Fn(usize, usize) -> Option<usize>) -> Near {
        if steps.len() <= NEAR_ALL_UP_TO {
            Near::All(steps.len())
        } else {
            Near::of_ops(steps, mirror)
        }
    }

    fn of_ops(steps: &[XStep], mirror: &dyn Fn(usize, usize) -> Option<usize>) -> Near {
        let nops = steps.last().map_or(0, |s| s.op + 1);
        let mut runs = vec![(0usize, 0usize); nops];
        // (start, end, operation, whether a step touches it rather than a hint asks about it)
        let mut spans: Vec<(usize, usize, usize, bool)> = Vec::with_capacity(steps.len() * 2);
        for (i, s) in steps.iter().enumerate() {
            if runs[s.op].1 == 0 {
                runs[s.op].0 = i;
            }
            runs[s.op].1 = i + 1;
            let (reads, write) = s.action.ranges();
            let mirrored = match s.action {
                Action::Send { src, len, .. } if len > 0 => {
                    mirror(s.op, src.ptr as usize).map(|m| (m, m + len))
                }
                _ => None,
            };
            // Empty ranges too: `overlaps` finds one strictly inside another.
            let touched = reads.into_iter().chain([write]).flatten();
            spans.extend(touched.map(|(a, b)| (a, b, s.op, true)));
            spans.extend(mirrored.map(|(a, b)| (a, b, s.op, false)));
        }
        // A sweep by start: every span still open when another starts overlaps it. Two
        // mirrors meeting matter to nobody (a send's to nowhere, where its operation has no
        // receive buffer, is at address 0 for every send of a group).
        spans.sort_unstable();
        let mut pairs: Vec<(usize, usize)> = (0..nops).map(|o| (o, o)).collect();
        let mut open: Vec<(usize, usize, bool)> = Vec::new();
        for &(start, end, op, touch) in &spans {
            open.retain(|&(e, ..)| e > start);
            let meets = open.iter().filter(|&&(_, o, t)| o != op && (t || touch));
            pairs.extend(meets.flat_map(|&(_, o, _)| [(o, op), (op, o)]));
            open.push((end, op, touch));
        }
        pairs.sort_unstable();
        pairs.dedup();
        let mut near = vec![Vec::new(); nops];
        for (a, b) in pairs {
            near[a].push(b);
        }
        Near::Ops { steps: runs, near }
    }

    /// The steps before `i` (of operation `op`) that may touch its bytes, ascending.
    fn before(&self, i: usize, op: usize) -> impl Iterator<Item = usize> + '_ {
        let (all, ops) = match self {
            Near::All(_) => (Some(0..i), None),
            Near::Ops { steps, near } => {
                let ops = near[op].iter().take_while(move |&&o| o <= op);
                (
                    None,
                    Some(ops.flat_map(move |&o| steps[o].0..steps[o].1.min(i))),
                )
            }
        };
        all.into_iter().flatten().chain(ops.into_iter().flatten())
    }

    /// The steps after `i` (of operation `op`) that may touch its bytes, ascending.
    fn after(&self, i: usize, op: usize) -> impl Iterator<Item = usize> + '_ {
        let (all, ops) = match self {
            Near::All(n) => (Some(i + 1..*n), None),
            Near::Ops { steps, near } => {
                let ops = near[op].iter().skip_while(move |&&o| o < op);
                (
                    None,
                    Some(ops.flat_map(move |&o| steps[o].0.max(i + 1)..steps[o].1)),
                )
            }
        };
        all.into_iter().flatten().chain(ops.into_iter().flatten())
    }
}

impl Hazards {
    /// Step i waits for every earlier step j it conflicts with: it writes what j reads or
    /// writes, or reads what j writes. `mirror(op, p)`: for an address `p` in operation
    /// `op`'s send buffer, the same place in its receive buffer (`HostOp::in_recv`; see
    /// `hints`). Only steps of operations whose bytes meet are compared (`Near`).
    fn compute(steps: &[XStep], mirror: &dyn Fn(usize, usize) -> Option<usize>) -> Hazards {
        Hazards::compute_near(steps, mirror, &Near::new(steps, mirror))
    }

    fn compute_near(
        steps: &[XStep],
        mirror: &dyn Fn(usize, usize) -> Option<usize>,
        near: &Near,
    ) -> Hazards {
        let n = steps.len();
        let mut pairs = Vec::new();
        let mut waiting_on = vec![0u32; n];
        let mut count = vec![0u32; n];
        for i in 0..n {
            let (ri, wi) = steps[i].action.ranges();
            for j in near.before(i, steps[i].op) {
                let (rj, wj) = steps[j].action.ranges();
                let conflict = overlaps(wi, wj)
                    || rj.iter().any(|&r| overlaps(wi, r))
                    || ri.iter().any(|&r| overlaps(r, wj));
                if conflict {
                    pairs.push((j as u32, i as u32));
                    waiting_on[i] += 1;
                    count[j] += 1;
                }
            }
        }
        let mut first = vec![0u32; n];
        let mut at = 0u32;
        for j in 0..n {
            first[j] = at;
            at += count[j];
        }
        let mut edges = vec![0u32; pairs.len()];
        let mut filled = vec![0u32; n];
        for &(j, i) in &pairs {
            edges[(first[j as usize] + filled[j as usize]) as usize] = i;
            filled[j as usize] += 1;
        }
        Hazards {
            waiting_on,
            first,
            count,
            edges: edges.into(),
            hints: Hazards::hints(steps, mirror, near),
        }
    }

    /// Which sends may have their reply written by the peer straight where it lands, and which
    /// folding receives may write their result there (the pairs a two-rank all-reduce is made
    /// of; see `OutMsg::reply_at`). A send from R is `ReplyHere` when no earlier step reads R
    /// (one that did could still be waiting to run when the peer writes) and the next step to
    /// touch R receives, from the same peer, exactly R. Else, where R lies in its operation's
    /// send buffer, it is `ReplyInRecv` when the same place M of the receive buffer is apart
    /// from R, no earlier step touches M and the next step to touch it receives, from the
    /// same peer, exactly M. A folding receive into D `Returns` when the next step to touch D
    /// sends exactly D, unscaled, to the same peer.
    fn hints(
        steps: &[XStep],
        mirror: &dyn Fn(usize, usize) -> Option<usize>,
        near: &Near,
    ) -> Vec<Hint> {
        let touches = |s: &XStep, r: Range| {
            let (reads, write) = s.action.ranges();
            let [a, b] = reads;
            [a, b, write].into_iter().any(|x| overlaps(x, Some(r)))
        };
        let next_toucher = |from: usize, r: Range| {
            let mut later = near.after(from, steps[from].op).map(|k| &steps[k]);
            later.find(|s| touches(s, r))
        };
        steps
            .iter()
            .enumerate()
            .map(|(i, s)| match s.action {
                Action::Send { peer, src, len } if len > 0 => {
                    let r = (src.ptr as usize, src.ptr as usize + len);
                    let replied_into = |at: usize| {
                        matches!(next_toucher(i, (at, at + len)).map(|k| k.action),
                            Some(Action::Recv { peer: p, dst, len: l, with: None, .. })
                                if p == peer && dst as usize == at && l == len)
                    };
                    let mut before = near.before(i, s.op).map(|k| &steps[k]);
                    let read_before =
                        before.any(|k| k.action.ranges().0.iter().any(|&x| overlaps(x, Some(r))));
                    if !read_before && replied_into(r.0) {
                        return Hint::ReplyHere;
                    }
                    let Some(m) = mirror(s.op, r.0) else {
                        return Hint::None;
                    };
                    let mr = (m, m + len);
                    let touched_before = near.before(i, s.op).any(|k| touches(&steps[k], mr));
                    if !overlaps(Some(r), Some(mr)) && !touched_before && replied_into(m) {
                        Hint::ReplyInRecv
                    } else {
                        Hint::None
                    }
                }
                Action::Recv {
                    peer,
                    dst,
                    len,
                    with: Some(_),
                    ..
                } if len > 0 => {
                    let r = (dst as usize, dst as usize + len);
                    let returns = matches!(next_toucher(i, r).map(|k| k.action),
                        Some(Action::Send { peer: p, src, len: l })
                            if p == peer && src.ptr as usize == r.0 && l == len && src.scale.is_none());
                    if returns {
                        Hint::Returns
                    } else {
                        Hint::None
                    }
                }
                _ => Hint::None,
            })
            .collect()
    }
}

/// How an operation's buffers relate, which together with its schedule fixes its hazards:
/// disjoint, or the send buffer at a given distance from the receive buffer.
type Aliasing = Option<isize>;

/// The executor's tables, kept between calls so that their memory is reused.
#[derive(Default)]
pub(crate) struct ExecCache {
    /// Hazards of single-operation runs, by schedule (its address: the Arc is kept alive in
    /// the value) and aliasing. Repeated calls of one shape skip the quadratic analysis.
    hazards: rustc_hash::FxHashMap<(usize, Aliasing), (Arc<Schedule>, Arc<Hazards>)>,
    /// Whole cache lines, so that scratch starts on one: from the allocator it would start 16
    /// bytes past a page, a distance to a page-aligned user buffer at which the C library's
    /// copies can be very slow (see `reduce::copy_bytes`), and a reduction's lines would
    /// straddle.
    scratch: Vec<Line>,
    tables: Tables,
    /// What `tables.steps` was last built for, when that was one operation alone.
    built: Option<Built>,
    /// The call the last run served, when it was one operation alone that ran to the end and
    /// its entry point gave it a key, and where that call's buffers lay (`run_again`):
    /// `tables.ops[0]` is its operation.
    repeat: Option<(Repeat, Footprint)>,
    /// How folded bytes went back in calls that forward, and how long those took.
    replies: Replies,
}

impl ExecCache {
    /// An empty cache whose calls send folded bytes back as COMM_SHM_REPLY says.
    pub(crate) fn new(replies: super::replies::Setting) -> ExecCache {
        ExecCache {
            replies: Replies::new(replies),
            ..Default::default()
        }
    }
}

/// A call outside any group as its entry point received it, but for its buffers: the
/// collective, the raw datatype and (built-in) op and the stream. Calls with equal keys on one
/// communicator whose buffers lie alike (`Footprint::admits`) pass the same checks and are
/// built into the same operation, but for their buffers and their number in the
/// communicator's sequence.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Repeat {
    pub coll: crate::algo::Collective,
    pub dtype: i32,
    pub op: Option<i32>,
    pub stream: usize,
}

/// The bytes a checked call reads from its send buffer and writes to its receive buffer, and,
/// when the two overlap (in place), how far the send buffer lies past the receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Footprint {
    pub send_bytes: usize,
    pub recv_bytes: usize,
    pub in_place: Option<isize>,
}

impl Footprint {
    /// Whether a call with this footprint's sizes on buffers at `send` and `recv` passes the
    /// checks of the call it was taken from with the same answers: no NULL buffer that must
    /// hold bytes, none wrapping around the address space, and in place exactly when that
    /// call was, at the same distance (any other overlap is an error the full path reports).
    pub(crate) fn admits(&self, send: usize, recv: usize) -> bool {
        let fits = |p: usize, n: usize| n == 0 || (p != 0 && p.checked_add(n).is_some());
        let (sb, rb) = (self.send_bytes, self.recv_bytes);
        fits(send, sb) && fits(recv, rb) && overlap(send, sb, recv, rb) == self.in_place
    }
}

/// One cache line of scratch.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// The tables one run works on, left in place between runs so that their memory is reused
/// and nothing is moved in and out on each call.
#[derive(Default)]
struct Tables {
    ops: Vec<HostOp>,
    steps: Vec<XStep>,
    send_q: Vec<StepQueue>,
    recv_q: Vec<StepQueue>,
    /// Per peer: its receives mix send/recv calls with collectives (`match_by_tag`).
    mixed: Vec<bool>,
    /// Per peer: the receive at the front of its queue was matched to the message that has
    /// begun to arrive (`match_by_tag`), so it goes on with it.
    matched: Vec<bool>,
    peers: Vec<usize>,
    posted: Vec<u32>,
    ready_local: Vec<u32>,
    /// The local steps that wait for nothing, in the order `ready_local` starts with.
    first_local: Vec<u32>,
    /// The steps' dependents (`Hazards::edges`) as last built: a repeated call keeps them
    /// without touching a reference count.
    edges: Arc<[u32]>,
    /// Receives that may forward (`Sink::forwards`) do so rather than write back
    /// (`Sink::forward_first`): the way `ExecCache::replies` chose for this run.
    forward_first: bool,
    /// Some receive of this run could forward.
    could_forward: bool,
    /// `straight` tried the run's steps: those it finished are marked so (their dependents'
    /// counts lowered) and the others kept what the try did. The executor that takes over
    /// goes on from there instead of starting them afresh.
    tried: bool,
}

fn is_p2p(op: &HostOp) -> bool {
    crate::tag::tag_kind(op.tag) == crate::tag::kind::P2P
}

/// What each operation of a group reads and writes (`ranges::kinds_apart`, without which the
/// receives keep the order called: `Exec::match_by_tag`).
fn op_bytes(ops: &[HostOp]) -> impl Iterator<Item = OpBytes> + Clone + '_ {
    ops.iter().map(|op| OpBytes {
        p2p: is_p2p(op),
        read: (op.send as u64, op.schedule.send_extent as u64),
        write: (op.recv as u64, op.schedule.recv_extent as u64),
    })
}

/// One peer's sends or receives in schedule order, and how many are done. The list stays
/// between runs: a repeated call only rewinds it.
#[derive(Default)]
struct StepQueue {
    steps: Vec<u32>,
    head: usize,
}

impl StepQueue {
    fn front(&self) -> Option<&u32> {
        self.steps.get(self.head)
    }

    fn pop_front(&mut self) {
        self.head += 1;
    }
}

/// A single-operation run's steps depend only on its schedule, its buffers, its input scale and
/// where scratch is: a call that repeats all of them (a training or benchmark loop) resets the
/// steps' progress instead of building them and looking up their hazards again, and one that
/// repeats all but the buffers, on buffers that overlap alike (a loop over the slices of a
/// buffer, as nccl-tests runs), also resolves the steps' addresses anew.
struct Built {
    schedule: Arc<Schedule>,
    send: *const u8,
    recv: *mut u8,
    aliasing: Aliasing,
    input_scale: Option<Scale>,
    scratch: *mut u8,
    hazards: Arc<Hazards>,
}

/// How much of the last single-operation run's steps a new operation can keep
/// (`Built::reuse`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reuse {
    /// Everything: the same operation on the same buffers.
    All,
    /// All but the addresses: the same operation on other buffers that overlap alike, so
    /// its hazards, queues and hints are the same (they depend on the schedule and the
    /// aliasing only).
    Structure,
    Nothing,
}

impl Built {
    /// Resolves `steps` anew on `op`'s buffers, which overlap as the last run's did
    /// (`Reuse::Structure`), and keeps those buffers as the ones the steps were built for.
    fn take_buffers(&mut self, op: &HostOp, scratch: *mut u8, steps: &mut [XStep]) {
        let at = resolver(op, scratch);
        let input_scale = op.reduction.and_then(|r| r.input_scale);
        for (x, step) in steps.iter_mut().zip(&op.schedule.steps) {
            x.action = Action::of(step, &at, input_scale);
        }
        (self.send, self.recv) = (op.send, op.recv);
    }

    fn reuse(&self, op: &HostOp, scratch: *mut u8, steps: usize) -> Reuse {
        let same = Arc::ptr_eq(&self.schedule, &op.schedule)
            && self.input_scale == op.reduction.and_then(|r| r.input_scale)
            && self.scratch == scratch
            && steps == op.schedule.steps.len();
        if !same {
            Reuse::Nothing
        } else if self.send == op.send && self.recv == op.recv {
            Reuse::All
        } else if self.aliasing == aliasing(op) {
            Reuse::Structure
        } else {
            Reuse::Nothing
        }
    }
}

/// Where a region of `op`'s buffers lies, its scratch starting at `scratch`.
fn resolver(op: &HostOp, scratch: *mut u8) -> impl Fn(Region) -> *mut u8 + '_ {
    move |r: Region| {
        let base = match r.buf {
            Buf::Send => op.send as *mut u8,
            Buf::Recv => op.recv,
            Buf::Scratch => scratch,
        };
        // SAFETY: regions lie inside the buffers the caller validated for this op, and
        // scratch holds the op's scratch bytes from `scratch`.
        unsafe { base.add(r.offset) }
    }
}

// SAFETY: between calls the tables hold the last run's operations and steps, whose addresses
// are never dereferenced then; a run, under the communicator's lock, either rebuilds them for
// its own buffers or (`Built::reuse`) keeps them because its buffers are the same ones or
// re-resolves their addresses for its own.
unsafe impl Send for ExecCache {}

/// One communicator's share of a run.
struct Exec<'a> {
    wiring: &'a Wiring,
    t: &'a mut Tables,
    remaining: usize,
    /// Some operation of the run copies received bytes in (`OutMsg::sender_busy`).
    busy: bool,
}

type Range = (usize, usize);

/// How long an error about a peer that only hung up waits for other links to show a loss
/// that explains it (`Exec::with_other_losses`).
const LOSS_GRACE: Duration = Duration::from_millis(200);

/// Operations whose output is at least this large write received bytes that are not read
/// again in the run with non-temporal stores (`RecvSink::stream`), and forward folded bytes
/// (`Sink::forwards`): the size from which a two-rank all-reduce is scheduled for that.
const STREAM_FROM: usize = crate::algo::ring::FUSE_FROM;

/// Bytes received from one peer in one pass before the executor turns to other work.
const RECV_BYTES_PER_PASS: usize = 256 << 10;

fn overlaps(a: Option<Range>, b: Option<Range>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.0 < b.1 && b.0 < a.1,
        _ => false,
    }
}

impl Action {
    /// `step` with its regions resolved to addresses by `at`; `input_scale` applies to this
    /// rank's own input.
    fn of(step: &Step, at: impl Fn(Region) -> *mut u8, input_scale: Option<Scale>) -> Action {
        let src = |o: Operand| Src {
            ptr: at(o.region),
            scale: if o.input { input_scale } else { None },
        };
        match *step {
            Step::Send { peer, src: s } => Action::Send {
                peer,
                src: src(s),
                len: s.region.len,
            },
            Step::Recv {
                peer,
                dst,
                reduce_with,
                last,
            } => Action::Recv {
                peer,
                dst: at(dst),
                len: dst.len,
                with: reduce_with.map(src),
                last,
            },
            Step::Local { dst, a, b, last } => Action::Local {
                dst: at(dst),
                len: dst.len,
                a: src(a),
                b: b.map(src),
                last,
            },
        }
    }

    /// The byte ranges the step reads (up to two) and writes.
    fn ranges(&self) -> ([Option<Range>; 2], Option<Range>) {
        let r = |p: *const u8, len: usize| Some((p as usize, p as usize + len));
        match *self {
            Action::Send { src, len, .. } => ([r(src.ptr, len), None], None),
            Action::Recv { dst, len, with, .. } => {
                ([with.and_then(|w| r(w.ptr, len)), None], r(dst, len))
            }
            Action::Local { dst, len, a, b, .. } => {
                ([r(a.ptr, len), b.and_then(|b| r(b.ptr, len))], r(dst, len))
            }
        }
    }
}

impl<'a> Exec<'a> {
    /// The executor for the operations in `cache.tables.ops`, over the cache's tables.
    fn new(wiring: &'a Wiring, cache: &'a mut ExecCache) -> Result<Exec<'a>> {
        let npeers = wiring.links.len();
        let ExecCache {
            hazards: known,
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
        // is collapsed the second time it comes (`os::collapse_to_huge_pages`), so repeated
        // calls look at it as well.
        wiring.collapse_if_large(scratch as usize, need);
        if let ([op], Some(b)) = (t.ops.as_slice(), built.as_mut()) {
            let reuse = b.reuse(op, scratch, t.steps.len());
            if reuse != Reuse::Nothing {
                op.collapse_to_huge_pages(wiring);
                if reuse == Reuse::Structure {
                    b.take_buffers(op, scratch, &mut t.steps);
                }
                let tried = std::mem::take(&mut t.tried);
                if !tried {
                    for (i, s) in t.steps.iter_mut().enumerate() {
                        s.restart(b.hazards.waiting_on[i]);
                    }
                }
                return Ok(Exec::rewind(wiring, t, tried));
            }
        }
        *built = None;
        t.tried = false;
        let steps = &mut t.steps;
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
                let key = (Arc::as_ptr(&op.schedule) as usize, aliasing(op));
                let h = match known.get(&key) {
                    Some((_, h)) => h.clone(),
                    None => {
                        let h = Arc::new(Hazards::compute(steps, &mirror));
                        if known.len() >= 256 {
                            known.clear();
                        }
                        known.insert(key, (op.schedule.clone(), h.clone()));
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
    fn queue(wiring: &'a Wiring, t: &'a mut Tables) -> Exec<'a> {
        let npeers = wiring.links.len();
        for q in t.send_q.iter_mut().chain(t.recv_q.iter_mut()) {
            q.steps.clear();
        }
        t.send_q.resize_with(npeers, StepQueue::default);
        t.recv_q.resize_with(npeers, StepQueue::default);
        t.first_local.clear();
        for (i, s) in t.steps.iter().enumerate() {
            match s.action {
                Action::Send { peer, .. } => t.send_q[peer].steps.push(i as u32),
                Action::Recv { peer, .. } => t.recv_q[peer].steps.push(i as u32),
                Action::Local { .. } => {
                    if s.waiting_on == 0 {
                        t.first_local.push(i as u32)
                    }
                }
            }
        }
        t.first_local.reverse();
        t.peers.clear();
        let (send_q, recv_q) = (&t.send_q, &t.recv_q);
        t.peers.extend(
            (0..npeers).filter(|&p| !send_q[p].steps.is_empty() || !recv_q[p].steps.is_empty()),
        );
        let (ops, steps) = (&t.ops, &t.steps);
        let p2p = |i: &u32| is_p2p(&ops[steps[*i as usize].op]);
        let apart = kinds_apart(op_bytes(ops));
        t.mixed.clear();
        t.mixed.extend(
            recv_q
                .iter()
                .map(|q| apart && q.steps.iter().any(p2p) && !q.steps.iter().all(p2p)),
        );
        Exec::rewind(wiring, t, false)
    }

    /// The executor over steps queued before (by `queue`), from their start, or, when
    /// `straight` `tried` them, past those it finished (their dependents' counts lowered).
    fn rewind(wiring: &'a Wiring, t: &'a mut Tables, tried: bool) -> Exec<'a> {
        let steps = &t.steps;
        for &p in &t.peers {
            // What `straight` finished of a queue comes first in it.
            for q in [&mut t.send_q[p], &mut t.recv_q[p]] {
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
        t.matched.resize(t.recv_q.len(), false);
        t.ready_local.clear();
        let mut remaining = steps.len();
        if !tried {
            t.ready_local.extend_from_slice(&t.first_local);
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

    fn complete(&mut self, i: u32) {
        let step = &self.t.steps[i as usize];
        let range =
            step.first_dependent as usize..(step.first_dependent + step.dependents) as usize;
        self.remaining -= 1;
        for k in range {
            let d = self.t.edges[k];
            let s = &mut self.t.steps[d as usize];
            s.waiting_on -= 1;
            if s.waiting_on == 0 && matches!(s.action, Action::Local { .. }) {
                self.t.ready_local.push(d);
            }
        }
    }

    fn reduction(&self, i: u32) -> Option<Reduction> {
        self.t.ops[self.t.steps[i as usize].op].reduction
    }

    fn tag(&self, i: u32) -> u64 {
        self.t.ops[self.t.steps[i as usize].op].tag
    }

    /// One pass over everything that can move. Returns whether anything did.
    ///
    /// Sends are posted first and receiving is bounded per peer and pass: otherwise a rank
    /// fed a steady stream of incoming messages keeps receiving and never posts its own
    /// sends, and the peer that feeds it starves (both ranks then alternate instead of
    /// working at the same time).
    fn pass(&mut self) -> Result<bool> {
        let mut moved = self.reap_posted()?;
        for pi in 0..self.t.peers.len() {
            moved |= self.post_sends(self.t.peers[pi])?;
        }
        for pi in 0..self.t.peers.len() {
            let peer = self.t.peers[pi];
            let mut budget = RECV_BYTES_PER_PASS;
            while budget > 0 {
                if self.t.mixed[peer] && !self.t.matched[peer] && !self.match_by_tag(peer) {
                    break;
                }
                let Some(&i) = self.t.recv_q[peer].front() else {
                    break;
                };
                if self.t.steps[i as usize].waiting_on > 0 {
                    break;
                }
                let (finished, m) = self.drive_recv(i)?;
                moved |= m;
                if !finished {
                    break;
                }
                if let Action::Recv { len, .. } = self.t.steps[i as usize].action {
                    budget = budget.saturating_sub(len.max(1));
                }
                self.t.matched[peer] = false;
                self.t.recv_q[peer].pop_front();
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
    fn match_by_tag(&mut self, peer: usize) -> bool {
        let tag = match self.wiring.links[peer].peek() {
            Ok(Some((_, tag))) => tag,
            Ok(None) => return false,
            Err(_) => return true,
        };
        let q = &mut self.t.recv_q[peer];
        let (ops, steps) = (&self.t.ops, &self.t.steps);
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
    fn reap_posted(&mut self) -> Result<bool> {
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
    fn post_sends(&mut self, peer: usize) -> Result<bool> {
        let mut moved = false;
        while let Some(&i) = self.t.send_q[peer].front() {
            if self.t.steps[i as usize].waiting_on > 0 {
                break;
            }
            let before = self.t.steps[i as usize].send.sent;
            let state = self.drive_send(i)?;
            moved |= self.t.steps[i as usize].send.sent != before || state != SendState::Pending;
            match state {
                SendState::Pending => break,
                SendState::Posted => {
                    self.t.send_q[peer].pop_front();
                    self.t.posted.push(i);
                }
                SendState::Complete => {
                    self.t.send_q[peer].pop_front();
                    self.complete(i);
                }
            }
        }
        Ok(moved)
    }

    fn drive_send(&mut self, i: u32) -> Result<SendState> {
        let step = &mut self.t.steps[i as usize];
        let Action::Send { peer, .. } = step.action else {
            unreachable!("send queue holds a non-send step")
        };
        let msg = step.message(&self.t.ops[step.op], self.busy);
        let p = self.wiring.links[peer].send(&msg, &mut step.send)?;
        Ok(p.state)
    }

    fn drive_recv(&mut self, i: u32) -> Result<(bool, bool)> {
        let tag = self.tag(i);
        let reduction = self.reduction(i);
        let Action::Recv { peer, dst, len, .. } = self.t.steps[i as usize].action else {
            unreachable!("receive queue holds a non-receive step")
        };
        let (hint, op) = (self.t.steps[i as usize].hint, self.t.steps[i as usize].op);
        let stream = self.t.ops[op].schedule.recv_extent >= STREAM_FROM;
        // The reply (the next step to touch dst, by the hint) is at the front of the peer's
        // sends: every earlier message to that peer is handed over. It belongs to the same
        // operation, so it carries the same tag.
        let returns = hint == Hint::Returns;
        let forwards = returns
            && stream
            && self.t.send_q[peer].front().is_some_and(|&s| {
                let s = &self.t.steps[s as usize];
                s.op == op
                    && matches!(s.action, Action::Send { src, len: l, .. }
                        if src.ptr == dst.cast_const() && l == len)
            });
        self.t.could_forward |= forwards;
        let forward_first = self.t.forward_first;
        let p = self.t.steps[i as usize].receive(
            &self.wiring.links,
            tag,
            reduction,
            stream,
            forwards,
            forward_first,
        )?;
        Ok((p.state, p.moved))
    }

    fn run_local(&mut self, i: u32) -> Result<()> {
        run_local(self.t.steps[i as usize].action, self.reduction(i))
    }

    /// Describes the channels that are stuck, for warnings and timeouts.
    fn blocked_on(&self) -> (Vec<usize>, String) {
        let mut ranks = Vec::new();
        let mut parts = Vec::new();
        for &peer in &self.t.peers {
            if let Some(&i) = self.t.recv_q[peer].front() {
                let s = &self.t.steps[i as usize];
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
            if let Some(&i) = self.t.send_q[peer].front() {
                if self.t.steps[i as usize].waiting_on == 0 {
                    ranks.push(peer);
                    parts.push(format!("send to rank {peer} (its buffer is full)"));
                }
            }
        }
        for &i in &self.t.posted {
            if let Action::Send { peer, len, .. } = self.t.steps[i as usize].action {
                ranks.push(peer);
                parts.push(format!("rank {peer} to read {len} bytes it was offered"));
            }
        }
        ranks.sort_unstable();
        ranks.dedup();
        (ranks, count_repeats(parts))
    }

    /// The operations of this run, as their tags describe them ("AllReduce #3 (float, sum)").
    fn called(&self) -> String {
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
    fn give_up(&self, err: &Error) {
        for l in &self.wiring.links {
            l.close(crate::transport::Closing::TimedOut, err.lost);
        }
    }

    fn check_peers(&self) -> Result<()> {
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
    fn with_other_losses(&self, e: Error, first: usize) -> Error {
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

struct RecvSink {
    dst: *mut u8,
    len: usize,
    with: Option<Src>,
    reduction: Option<Reduction>,
    last: bool,
    /// The combined bytes go back to the sender unchanged next (`Sink::returns`).
    returns: bool,
    /// ... as the very next message to that peer (`Sink::forwards`).
    forwards: bool,
    /// ... and should go that way rather than be written back (`Sink::forward_first`).
    forward_first: bool,
    /// The operation's output is too large to stay in cache: bytes that are not read again
    /// during the run are written with non-temporal stores (`stream_copy`).
    stream: bool,
}

impl Sink for RecvSink {
    fn direct(&mut self) -> Option<*mut u8> {
        self.with.is_none().then_some(self.dst)
    }

    fn put(&mut self, offset: usize, data: &[u8], scale: Option<Scale>) -> Result<()> {
        if offset + data.len() > self.len {
            return crate::internal_err!("message piece beyond the receive region");
        }
        // SAFETY: dst (and with) cover `len` bytes; this piece lies inside; `data` is the
        // transport's buffer or the sender's, never the destination itself.
        unsafe {
            let dst = self.dst.add(offset);
            let incoming = Src {
                ptr: data.as_ptr(),
                scale,
            };
            match self.with {
                None if self.stream && scale.is_none() => {
                    crate::reduce::stream_copy(dst, data.as_ptr(), data.len(), true)
                }
                None => copy_scaled(dst, incoming, data.len(), self.reduction),
                Some(w) => {
                    let red = self.reduction.ok_or_else(|| {
                        Error::new(ErrorKind::Internal, "reducing receive without an op")
                    })?;
                    let w = Src {
                        ptr: w.ptr.add(offset),
                        scale: w.scale,
                    };
                    combine(dst, w, incoming, data.len(), &red.reducer);
                }
            }
            finish(dst, data.len(), self.last, self.reduction);
        }
        Ok(())
    }

    fn returns(&self) -> Option<*const u8> {
        (self.returns && self.with.is_some()).then_some(self.dst.cast_const())
    }

    fn forwards(&self) -> bool {
        self.forwards && self.returns().is_some()
    }

    fn forward_first(&self) -> bool {
        self.forward_first && self.forwards()
    }

    fn put_also(
        &mut self,
        offset: usize,
        data: &[u8],
        scale: Option<Scale>,
        out: *mut u8,
    ) -> Result<()> {
        if offset + data.len() > self.len {
            return crate::internal_err!("message piece beyond the receive region");
        }
        if let (true, Some(w), Some(r)) = (self.stream, self.with, self.reduction) {
            let divides = self.last && r.divide_by.is_some();
            if !divides && !std::ptr::eq(w.ptr, self.dst) {
                // SAFETY: dst and with cover `len` bytes, apart, and this piece lies inside;
                // `out` is the caller's memory of data.len() bytes, overlapping neither.
                unsafe {
                    let n = data.len();
                    r.reducer.reduce_twice(
                        std::slice::from_raw_parts_mut(self.dst.add(offset), n),
                        std::slice::from_raw_parts_mut(out, n),
                        std::slice::from_raw_parts(w.ptr.add(offset), n),
                        w.scale,
                        data,
                        scale,
                    );
                }
                return Ok(());
            }
        }
        // An integer average divides after the fold (and a fold in place reads dst): a copy
        // out of the cache follows.
        crate::transport::put_then_copy(self, offset, data, scale, out)
    }

    fn placed(&mut self, offset: usize, len: usize, scale: Option<Scale>) -> Result<()> {
        // SAFETY: the transport wrote [offset, offset+len) of dst, which covers `self.len` bytes.
        unsafe {
            let dst = self.dst.add(offset);
            if let (Some(s), Some(red)) = (scale, self.reduction) {
                red.reducer
                    .scale_in_place(std::slice::from_raw_parts_mut(dst, len), s);
            }
            finish(dst, len, self.last, self.reduction);
        }
        Ok(())
    }
}

/// `dst = scale * a` (a plain copy without a scale; nothing when it is the same memory).
///
/// # Safety
/// `dst` and `a.ptr` cover `len` bytes and either coincide or do not overlap.
unsafe fn copy_scaled(dst: *mut u8, a: Src, len: usize, reduction: Option<Reduction>) {
    match (a.scale, reduction) {
        (Some(s), Some(red)) => {
            let d = std::slice::from_raw_parts_mut(dst, len);
            if std::ptr::eq(a.ptr, dst) {
                red.reducer.scale_in_place(d, s);
            } else {
                red.reducer
                    .scale(d, std::slice::from_raw_parts(a.ptr, len), s);
            }
        }
        _ => {
            if !std::ptr::eq(a.ptr, dst) {
                crate::reduce::copy_bytes(dst, a.ptr, len);
            }
        }
    }
}

/// `dst = a (+) b`, where dst may be exactly a or exactly b.
///
/// # Safety
/// All three cover `len` bytes; dst coincides with a, with b, or overlaps neither.
unsafe fn combine(dst: *mut u8, a: Src, b: Src, len: usize, reducer: &Reducer) {
    if a.scale.is_none() && b.scale.is_none() && reducer.reduce_small(dst, a.ptr, b.ptr, len) {
        return;
    }
    let d = std::slice::from_raw_parts_mut(dst, len);
    if std::ptr::eq(a.ptr, dst) {
        reducer.reduce_in_place(d, a.scale, std::slice::from_raw_parts(b.ptr, len), b.scale);
    } else if std::ptr::eq(b.ptr, dst) {
        reducer.reduce_in_place(d, b.scale, std::slice::from_raw_parts(a.ptr, len), a.scale);
    } else {
        reducer.reduce(
            d,
            std::slice::from_raw_parts(a.ptr, len),
            a.scale,
            std::slice::from_raw_parts(b.ptr, len),
            b.scale,
        );
    }
}

/// The end of an integer average: divide final values by the rank count.
///
/// # Safety
/// `dst` covers `len` bytes.
unsafe fn finish(dst: *mut u8, len: usize, last: bool, reduction: Option<Reduction>) {
    if let (true, Some(red)) = (last, reduction) {
        if let Some(n) = red.divide_by {
            red.reducer
                .divide_in_place(std::slice::from_raw_parts_mut(dst, len), n);
        }
    }
}

/// How an operation's send and receive buffers overlap (see `Aliasing`).
fn aliasing(op: &HostOp) -> Aliasing {
    overlap(
        op.send as usize,
        op.schedule.send_extent,
        op.recv as usize,
        op.schedule.recv_extent,
    )
}

/// Where `send_bytes` at `send` and `recv_bytes` at `recv` share bytes, how far the send
/// buffer lies past the receive buffer; None where they share none (an empty one shares
/// none). Neither may wrap around the address space.
pub(crate) fn overlap(
    send: usize,
    send_bytes: usize,
    recv: usize,
    recv_bytes: usize,
) -> Option<isize> {
    (send_bytes > 0 && recv_bytes > 0 && send < recv + recv_bytes && recv < send + send_bytes)
        .then(|| send as isize - recv as isize)
}

/// Reads a PreMulSum scalar that lives at a host address (ncclScalarDevice residence used with
/// host memory): the value in force when the collective runs.
pub(crate) fn read_scalar(addr: usize, dtype: crate::reduce::DataType) -> Scale {
    let mut bytes = [0u8; 8];
    // SAFETY: ncclRedOpCreatePreMulSum checked the address is not NULL, and the caller promises
    // it stays valid for a scalar of `dtype` while the op exists.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, bytes.as_mut_ptr(), dtype.size()) };
    Scale(bytes)
}

/// Runs every communicator's operations to completion (or the first error).
#[cfg(test)]
pub(crate) fn run(jobs: Vec<(&Wiring, Vec<HostOp>)>) -> Result<()> {
    let mut guards: Vec<_> = jobs.iter().map(|(w, _)| w.cache.lock()).collect();
    run_in(
        jobs.into_iter()
            .zip(guards.iter_mut())
            .map(|((w, ops), c)| (w, &mut **c, ops))
            .collect(),
    )
}

/// `run`, on each communicator's executor cache, which the caller holds (`comm::gate`).
pub(crate) fn run_in(jobs: Vec<(&Wiring, &mut ExecCache, Vec<HostOp>)>) -> Result<()> {
    let mut execs = Vec::with_capacity(jobs.len());
    let mut large = Vec::with_capacity(jobs.len());
    for (wiring, cache, ops) in jobs {
        if ops.iter().map(HostOp::extent).sum::<usize>() >= WARM_AFTER {
            large.push(wiring);
        }
        cache.repeat = None;
        cache.tables.ops = ops;
        // Groups write folded bytes back: their runs mix operations, whose times say nothing
        // of one way.
        cache.tables.forward_first = false;
        execs.push(Exec::new(wiring, cache)?);
    }
    drive(&mut execs)?;
    for w in large {
        w.warm_links();
    }
    Ok(())
}

/// Runs one operation of one communicator (a call outside any group); `repeat`, the call's
/// key and footprint, lets the same call run again without being built (`run_again`).
#[cfg(test)]
pub(crate) fn run_one(
    wiring: &Wiring,
    op: HostOp,
    repeat: Option<(Repeat, Footprint)>,
) -> Result<()> {
    run_one_in(wiring, &mut wiring.cache.lock(), op, repeat)
}

/// `run_one`, on the communicator's executor cache, which the caller holds (`comm::gate`).
pub(crate) fn run_one_in(
    wiring: &Wiring,
    cache: &mut ExecCache,
    op: HostOp,
    repeat: Option<(Repeat, Footprint)>,
) -> Result<()> {
    let large = op.extent() >= WARM_AFTER;
    cache.repeat = None;
    cache.tables.ops.clear();
    cache.tables.ops.push(op);
    run_alone(wiring, cache, large)?;
    if cache.built.is_some() {
        cache.repeat = repeat;
    }
    Ok(())
}

/// A local step: a copy or a reduction of this rank's own buffers.
fn run_local(action: Action, reduction: Option<Reduction>) -> Result<()> {
    let Action::Local {
        dst,
        len,
        a,
        b,
        last,
    } = action
    else {
        unreachable!("local list holds a non-local step")
    };
    // SAFETY: every pointer covers `len` bytes of a validated buffer or of scratch; the
    // hazard rules guarantee nothing else touches them now; exact aliases are handled by
    // the in-place forms and partial overlaps were rejected at validation.
    unsafe {
        match b {
            None => copy_scaled(dst, a, len, reduction),
            Some(b) => {
                let red = reduction.ok_or_else(|| {
                    Error::new(ErrorKind::Internal, "local reduction without an op")
                })?;
                combine(dst, a, b, len, &red.reducer);
            }
        }
        finish(dst, len, last, reduction);
    }
    Ok(())
}

/// A repeated call's steps tried in order, each straight on its link or locally, for as long
/// as each finishes at once: what the executor's passes would do, without building it, which
/// costs more than the steps themselves in small calls. An 8-byte two-rank broadcast took
/// about 1330 instructions a call at the root and 1420 at the other rank, of which the link's
/// send or receive 230-390; tried this way, 890-1010 and 1050 (callgrind). With four ranks the
/// root sends to two peers and a rank between receives and passes on: tried only when a call
/// was one send or receive, they took 1820 and 2090 instructions a call; 1240 and 1300 now.
/// Returns whether the run is done; when it is not, the steps keep what the try did
/// (`Tables::tried`: which finished, the progress of the others) and the executor goes on
/// from there. False, having tried nothing, for a run it does not take: one of several
/// operations, one not run before on this plan, one whose buffers are large enough to move
/// onto huge pages, or one that forwards folded bytes (only the executor sees which receive
/// may).
///
/// Steps wait only for earlier ones (`Hazards`), so in order each finds what it waits for
/// done. Past a step that did not finish, the try goes on only with sends that wait for
/// nothing unfinished, to peers none of whose sends stayed behind: each peer's messages keep
/// their order, and peers get what they wait for as soon as the executor would give it. A
/// local step that nothing waits for (an all-gather's own block) runs last, once every link
/// step finished, as the executor runs local steps after its sends.
fn straight(wiring: &Wiring, cache: &mut ExecCache) -> Result<bool> {
    let ExecCache {
        scratch,
        tables: t,
        built,
        ..
    } = cache;
    let ([op], Some(b)) = (t.ops.as_slice(), built.as_mut()) else {
        return Ok(false);
    };
    // Buffers large enough to move onto huge pages take the executor's way, which moves them
    // (a range is moved the second time it is seen, so it must be seen once a call).
    let huge = |len: usize| wiring.huge_pages_from.is_some_and(|m| len >= m);
    if huge(op.extent()) || huge(op.schedule.scratch) {
        return Ok(false);
    }
    // A receive forwards only when the executor sees the reply queued behind it.
    let stream = op.schedule.recv_extent >= STREAM_FROM;
    if stream
        && t.steps
            .iter()
            .filter(|s| !matches!(s.action, Action::Local { .. }))
            .nth(1)
            .is_some()
    {
        return Ok(false);
    }
    let scratch = scratch.as_mut_ptr() as *mut u8;
    let reuse = b.reuse(op, scratch, t.steps.len());
    if reuse == Reuse::Nothing {
        return Ok(false);
    }
    if reuse == Reuse::Structure {
        b.take_buffers(op, scratch, &mut t.steps);
    }
    for (s, &w) in t.steps.iter_mut().zip(b.hazards.waiting_on.iter()) {
        s.restart(w);
    }
    // Peers (a bit each, all from the 128th on) whose next send waits behind one that has
    // not finished: later sends to them wait too.
    let bit = |peer: usize| if peer < 128 { 1u128 << peer } else { u128::MAX };
    let mut closed = 0u128;
    // Every step so far finished: receives and local steps go on only while so, sends
    // whose turn and inputs have come go on regardless (the executor posts them first too).
    let mut all = true;
    let mut deferred = false;
    for k in 0..t.steps.len() {
        let x = &mut t.steps[k];
        let finished = match x.action {
            Action::Send { peer, .. } => {
                let complete = closed & bit(peer) == 0 && x.waiting_on == 0 && {
                    let msg = x.message(op, op.schedule.copies_in);
                    wiring.links[peer].send(&msg, &mut x.send)?.state == SendState::Complete
                };
                if !complete {
                    closed |= bit(peer);
                }
                complete
            }
            Action::Recv { .. } => {
                all && x.waiting_on == 0 && {
                    let links = &wiring.links;
                    x.receive(links, op.tag, op.reduction, stream, false, false)?
                        .state
                }
            }
            // Last, if every link step finishes (see above).
            Action::Local { .. } if x.dependents == 0 => {
                deferred = true;
                continue;
            }
            Action::Local { .. } => {
                all && x.waiting_on == 0 && {
                    run_local(x.action, op.reduction)?;
                    true
                }
            }
        };
        if !finished {
            all = false;
            continue;
        }
        x.finished = true;
        let (from, n) = (x.first_dependent as usize, x.dependents as usize);
        for &d in &t.edges[from..from + n] {
            t.steps[d as usize].waiting_on -= 1;
        }
    }
    if all && deferred {
        // Every other step finished, so these wait for nothing.
        for x in t.steps.iter_mut() {
            if !x.finished {
                run_local(x.action, op.reduction)?;
                x.finished = true;
            }
        }
    }
    #[cfg(test)]
    STRAIGHT_RUNS.with(|c| {
        let mut v = c.get();
        let some = t.steps.iter().any(|s| s.finished);
        v[if all { 0 } else { 1 + usize::from(some) }] += 1;
        c.set(v);
    });
    t.tried = !all;
    Ok(all)
}

#[cfg(test)]
thread_local! {
    /// Runs this thread's `straight` tried: [finished there, handed over to the executor at
    /// the first step, handed over later].
    static STRAIGHT_RUNS: std::cell::Cell<[u32; 3]> = const { std::cell::Cell::new([0; 3]) };
}

/// Runs the one operation in `cache.tables.ops`, then warms the links again after a `large`
/// one (see `WARM_AFTER`). An operation out of place large enough to forward its folded bytes
/// (`STREAM_FROM`) goes the way `ExecCache::replies` chooses and is timed for it; in place,
/// folded bytes are written back into the lines the pull just read and the schedule does not
/// forward, and smaller calls cannot afford a look at the clock.
fn run_alone(wiring: &Wiring, cache: &mut ExecCache, large: bool) -> Result<()> {
    let op = &cache.tables.ops[0];
    let timed =
        (op.schedule.recv_extent >= STREAM_FROM && !std::ptr::eq(op.send, op.recv)).then(|| {
            let advised = os::PAGES_ADVISED.load(Ordering::Relaxed);
            (cache.replies.choose(), advised, Instant::now())
        });
    cache.tables.forward_first = matches!(timed, Some((Way::Forward, ..)));
    cache.tables.could_forward = false;
    if timed.is_none() && !large {
        match straight(wiring, cache) {
            Ok(false) => {}
            Ok(true) => {
                if let Some(cpu) = this_cpu() {
                    wiring.doorbell.set_running_on(cpu, Activity::Outside);
                }
                return Ok(());
            }
            Err(e) => {
                let exec = Exec::new(wiring, cache)?;
                let e = with_other_losses(std::slice::from_ref(&exec), e);
                publish(std::slice::from_ref(&exec), Activity::Outside);
                return Err(e);
            }
        }
    }
    drive(std::slice::from_mut(&mut Exec::new(wiring, cache)?))?;
    if let Some((way, advised, start)) = timed {
        // A call that moved pages onto huge pages is slow for that, whichever way it took.
        if cache.tables.could_forward && os::PAGES_ADVISED.load(Ordering::Relaxed) == advised {
            let bytes = cache.tables.ops[0].extent();
            cache.replies.record(way, start.elapsed(), bytes);
        }
    }
    if large {
        wiring.warm_links();
    }
    Ok(())
}

/// Runs the last call again on the buffers `send` and `recv` when `key` is its key and its
/// footprint admits them (`run_one`), numbered `seq()`: the operation is kept and takes the
/// new buffers and number (its tag is the same call's, so it keeps kind, root, datatype and
/// op); its steps, on the same buffers, are kept too and only their progress is reset. None,
/// having done nothing, when the last run was another call (or failed).
#[cfg(test)]
pub(crate) fn run_again(
    wiring: &Wiring,
    key: &Repeat,
    send: *const u8,
    recv: *mut u8,
    seq: impl FnOnce() -> u64,
) -> Option<Result<()>> {
    run_again_in(wiring, &mut wiring.cache.lock(), key, send, recv, seq)
}

/// `run_again`, on the communicator's executor cache, which the caller holds (`comm::gate`).
pub(crate) fn run_again_in(
    wiring: &Wiring,
    cache: &mut ExecCache,
    key: &Repeat,
    send: *const u8,
    recv: *mut u8,
    seq: impl FnOnce() -> u64,
) -> Option<Result<()>> {
    // Looked at in place: moving the key out and back costs more than the look.
    let (k, f) = cache.repeat.as_ref()?;
    if *k != *key || !f.admits(send as usize, recv as usize) {
        return None;
    }
    let op = &mut cache.tables.ops[0];
    op.send = send;
    op.recv = recv;
    op.tag = crate::tag::renumbered(op.tag, seq());
    let large = op.extent() >= WARM_AFTER;
    let r = run_alone(wiring, cache, large);
    if r.is_err() {
        cache.repeat = None;
    }
    Some(r)
}

/// Operations of at least this many bytes leave the links' small-message lines and pages out
/// of this core's caches and TLB (its 1536 entries map 6 MiB of small pages), and take long
/// enough that warming them again (`Link::warm`, about 2 us on a 2-rank communicator) is lost
/// in their time.
const WARM_AFTER: usize = 16 << 20;

/// "a, b (x3), c" from "a, b, b, b, c": a pipeline waits on many messages of one peer.
fn count_repeats(parts: Vec<String>) -> String {
    let mut out: Vec<(String, usize)> = Vec::new();
    for p in parts {
        match out.iter_mut().find(|(q, _)| *q == p) {
            Some((_, n)) => *n += 1,
            None => out.push((p, 1)),
        }
    }
    out.iter()
        .map(|(p, n)| {
            if *n > 1 {
                format!("{p} (x{n})")
            } else {
                p.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A peer failed under a send or receive: name every other peer that is gone too, so that the
/// error reaches the cause (a root that failed because another rank died).
fn with_other_losses(execs: &[Exec], e: Error) -> Error {
    match (e.kind, e.lost, execs) {
        (ErrorKind::Remote, Some(p), [only]) => only.with_other_losses(e, p),
        _ => e,
    }
}

/// After giving up, how long a rank listens for the rank it suspects: when that rank timed out
/// too, waiting for a third, the third is the cause, and the error names it.
fn grace(timeout: Duration) -> Duration {
    (timeout / 2).min(Duration::from_secs(1))
}

/// How often at most a thread moves itself to another CPU (see `crowded`).
const MOVE_EVERY: Duration = Duration::from_micros(500);

thread_local! {
    /// When this thread last moved itself to another CPU.
    static LAST_MOVE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// A peer that polls or sleeps without any sign of life for this long is not running: its
/// heartbeat stopped, or it was woken and has not resumed.
const STALLED_AFTER: Duration = Duration::from_micros(10);

/// How long at most a rank keeps waiting awake, spinning or yielding, while a peer on this
/// host sleeps on its doorbell (`peer_asleep`). A sleeping peer this rank waits for was rung
/// by what this rank sent it, or will be by a third rank; waking takes it 100-250 us on an idle
/// virtual CPU, past the 50 us spin window. Two ranks that each gave up while the other woke
/// slept in turn at every call: 100-300 us a call for the first milliseconds of a run, on
/// separate CPUs.
const WAKE_GRACE: Duration = Duration::from_micros(500);

/// Whether a peer on this host says it sleeps on its doorbell, where this host's ranks fit its
/// CPUs (otherwise the sleeper may need this rank's CPU to wake on, and this rank's waiting
/// awake would delay it).
fn peer_asleep(execs: &[Exec]) -> bool {
    spread(execs) && local_peers(execs).any(|(.., (_, what))| what == Activity::Sleeping)
}

/// Whether this host's ranks fit its CPUs, for every communicator driven (`Wiring::spread`).
fn spread(execs: &[Exec]) -> bool {
    execs.iter().all(|e| e.wiring.spread)
}

/// Every peer on this host that said where it runs, for every communicator driven: whether
/// its rank is above this one's, its link, and the CPU it last said it runs on and what it
/// does there (`Link::peer_running_on`).
fn local_peers<'e>(
    execs: &'e [Exec],
) -> impl Iterator<Item = (bool, &'e dyn Link, (u32, Activity))> + 'e {
    execs.iter().flat_map(|e| {
        let me = e.wiring.rank;
        let links = e.wiring.links.iter().enumerate();
        links.filter_map(move |(p, l)| {
            let seen = l.peer_running_on().filter(|_| p != me)?;
            Some((p > me, &**l, seen))
        })
    })
}

/// The CPU the caller runs on (None where the kernel does not say).
fn this_cpu() -> Option<u32> {
    // SAFETY: sched_getcpu has no preconditions (the vDSO answers it).
    u32::try_from(unsafe { libc::sched_getcpu() }).ok()
}

/// Whether a peer that last said it runs on `peer.0`, doing `peer.1`, is stuck behind this
/// rank, which runs on `cpu` (see `crowded`); `stalled` says whether it showed no sign of life
/// for `STALLED_AFTER`.
fn stuck(cpu: u32, peer: (u32, Activity), stalled: impl FnOnce() -> bool) -> bool {
    peer.0 == cpu || (peer.1 != Activity::Outside && stalled())
}

/// A peer on this host as a waiting rank sees it: the CPU it last said it runs on, whether it
/// is stuck behind this rank (`stuck`), and whether its rank is above this one's.
#[derive(Clone, Copy, Debug)]
struct PeerSeen {
    cpu: u32,
    stuck: bool,
    above: bool,
}

/// What a rank on `cpu` does about the peers it sees.
#[derive(Debug, PartialEq, Eq)]
enum Crowding {
    /// Nobody is stuck behind it.
    Alone,
    /// Someone is: it gives the core up for a while.
    GiveWay,
    /// Someone is: it moves to another CPU, not to one of these.
    Move { avoid: Vec<u32> },
}

fn crowding<I: Iterator<Item = PeerSeen>>(cpu: u32, peers: impl Fn() -> I) -> Crowding {
    if !peers().any(|p| p.stuck) {
        return Crowding::Alone;
    }
    // Two ranks on one CPU each find the other there. Were both to move, they would land
    // together on the same free CPU (they take turns on this one, so both get to decide):
    // only the higher rank moves, the lower one gives it the core.
    if peers().any(|p| p.cpu == cpu && p.above) {
        return Crowding::GiveWay;
    }
    // Every other CPU a peer said it runs on is taken, whatever the peer does there: one that
    // polls there may be silent because it is moving there (it says where to first, then
    // lands tens of microseconds later); one that sleeps there is held there (`hold_for_sleep`)
    // and wakes there, and one woken a moment ago shows no sign of life until its CPU resumes
    // (on a VM an idle virtual CPU takes tens of microseconds); one in its application runs
    // there. Moving onto a sleeping peer's CPU put the two together when it woke; the higher
    // rank then moved back, found it asleep and stalled again, and moved onto it once more
    // every `MOVE_EVERY`, for a whole run at 40-100 us a call (traced, unpinned 2-rank runs).
    let avoid = peers().filter(|p| p.cpu != cpu).map(|p| p.cpu).collect();
    Crowding::Move { avoid }
}

/// Whether a peer on this host is stuck behind this rank (see `drive`): it last ran on this
/// CPU (polling, asleep or between operations: it cannot run here while this rank does, so it
/// waits for this CPU or moved since), or it polls or sleeps with no sign of life for
/// `STALLED_AFTER` (it waits in some CPU's queue: moved there by the scheduler after it last
/// said where it runs, or woken onto a busy CPU). Then this rank moves to another CPU it may
/// use where no peer said it runs (`crowding`), and the answer is false; or, where there is none or
/// it leaves the move to a peer, true (the caller gives the core up). Also tells the peers
/// where this rank polls, and that it runs.
fn crowded(execs: &[Exec], now: Instant) -> bool {
    if !spread(execs) {
        return false;
    }
    let Some(cpu) = this_cpu() else {
        return false;
    };
    // Every peer on this host that said where it runs: its CPU, whether it is stuck, and
    // whether its rank is above this one's (the common answer, nobody here, allocates
    // nothing).
    let peers = || {
        local_peers(execs).map(|(above, l, (c, what))| PeerSeen {
            cpu: c,
            stuck: stuck(cpu, (c, what), || l.peer_stalled(now, STALLED_AFTER)),
            above,
        })
    };
    for e in execs {
        e.wiring.doorbell.set_running_on(cpu, Activity::Polling);
        e.wiring.doorbell.heartbeat();
    }
    let avoid = match crowding(cpu, peers) {
        Crowding::Alone => return false,
        Crowding::GiveWay => return true,
        Crowding::Move { avoid } => avoid,
    };
    // Wake-ups pull a woken rank onto its waker's CPU, so ranks that sleep now and then end up
    // sharing one CPU while another is free; moving costs tens of microseconds, so not too
    // often: at most once per MOVE_EVERY for the thread, whatever the number of calls (a
    // broadcast root's calls are shorter than a move).
    if LAST_MOVE.get().is_some_and(|t| now - t < MOVE_EVERY) {
        return true;
    }
    LAST_MOVE.set(Some(now));
    // Peers learn the destination before the move: one that runs on this CPU meanwhile must
    // not take this rank for stuck there and move too, onto the destination.
    let moved = crate::transport::os::move_off_cpu(cpu, &avoid, |to| {
        for e in execs {
            e.wiring.doorbell.set_running_on(to, Activity::Polling);
        }
    });
    if moved.is_some() {
        return false;
    }
    for e in execs {
        e.wiring.doorbell.set_running_on(cpu, Activity::Polling);
    }
    true
}

/// Before this rank sleeps, where it has peers on this host and the host's ranks fit its CPUs
/// (`Wiring::spread`): holds it on its CPU while it sleeps, or, where a peer runs there
/// (polling or in its application), off the CPUs its peers run on (`os::hold_for_sleep`).
/// Unpinned ranks were woken onto their waker's CPU, waiting 100-160 us behind it with the
/// other CPU idle, in the first milliseconds of about half the runs of a 2-rank benchmark on
/// the 2-vCPU VM.
fn hold_for_sleep(execs: &[Exec]) -> Option<os::Narrowed> {
    if !spread(execs) {
        return None;
    }
    let cpu = this_cpu()?;
    let mut avoid: Vec<u32> = Vec::new();
    let mut local = false;
    for (.., (c, what)) in local_peers(execs) {
        local = true;
        if what != Activity::Sleeping {
            avoid.push(c);
        }
    }
    // Peers only across the network wake this rank from a progress thread, wherever that
    // runs: the kernel's choice stands.
    if !local {
        return None;
    }
    os::hold_for_sleep(cpu, &avoid)
}

/// Tells the peers on this host what this rank does now, where it runs.
fn publish(execs: &[Exec], what: Activity) {
    if let Some(cpu) = this_cpu() {
        for e in execs {
            e.wiring.doorbell.set_running_on(cpu, what);
        }
    }
}

/// Progresses every communicator's steps until all are done or one fails.
fn drive(execs: &mut [Exec]) -> Result<()> {
    let r = drive_steps(execs);
    // Back to the application: peers must not take a long absence for a stall, but one that
    // finds itself on this rank's CPU knows the rank waits for it.
    publish(execs, Activity::Outside);
    r
}

/// One pass over every communicator's steps: whether anything moved, and whether all are done.
fn pass_all(execs: &mut [Exec]) -> Result<(bool, bool)> {
    let mut moved = false;
    for e in execs.iter_mut() {
        moved |= e.pass()?;
    }
    Ok((moved, execs.iter().all(|e| e.remaining == 0)))
}

fn drive_steps(execs: &mut [Exec]) -> Result<()> {
    // A small call often finishes on its first pass: that pass comes before the state that
    // waiting needs.
    if pass_all(execs).map_err(|e| with_other_losses(execs, e))?.1 {
        return Ok(());
    }
    let mut started: Option<Instant> = None;
    let mut idle_since: Option<Instant> = None;
    let mut last_check: Option<Instant> = None;
    let mut spins = 0u32;
    let mut moves = 0u32;
    let mut warned = false;
    // Once this rank has given up: until when it listens, its own error, and which
    // communicator gave up.
    let mut gave_up: Option<(Instant, Error, usize)> = None;
    loop {
        if let Some((until, own, i)) = &gave_up {
            let e = &execs[*i];
            let me = e.wiring.rank;
            // A network link learns of a close by reading it: look at the next header too.
            let told = own.lost.map(|s| {
                let link = &e.wiring.links[s];
                (s, link.check_peer().and_then(|_| link.peek().map(|_| ())))
            });
            match told {
                Some((suspect, Err(theirs))) if theirs.lost.is_some_and(|l| l != me) => {
                    crate::info!("rank {me}: rank {suspect} gave up too: {}", theirs.msg);
                    let mut err = Error::new(theirs.kind, format!("{}; {}", own.msg, theirs.msg));
                    err.lost = theirs.lost;
                    return Err(err);
                }
                _ if Instant::now() >= *until => return Err(own.clone()),
                _ => {}
            }
            // No more progress: the peers were told this rank gave up, and its links are
            // closed for sending.
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let (moved, done) = pass_all(execs).map_err(|e| with_other_losses(execs, e))?;
        if done {
            return Ok(());
        }
        if moved {
            idle_since = None;
            spins = 0;
            // Busy is running too: peers that wait for this rank must not think it stalled.
            moves = moves.wrapping_add(1);
            if moves % 16 == 0 {
                for e in execs.iter() {
                    e.wiring.doorbell.heartbeat();
                }
            }
            continue;
        }
        // Reading the clock costs about as much as a pass: only now and then while spinning.
        spins = spins.wrapping_add(1);
        if spins % 64 != 0 {
            // More ranks on this host than it has cores: the rank this one waits for is
            // likely runnable on this very core, so every idle pass hands the core over; 63
            // passes of polling first cost that rank a couple of microseconds.
            if execs[0].wiring.hand_over {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let now = Instant::now();
        let started = *started.get_or_insert(now);
        let idle = now - *idle_since.get_or_insert(now);
        // A peer stuck behind this rank (see `crowded`, which answers only where the host's
        // ranks fit its CPUs) is not running: spinning only delays it. Yield through the spin
        // window instead: the core goes to the peer if it waits for this one, and the rank
        // stays runnable, so nothing wakes it onto its waker's CPU (sleeping ranks were woken
        // next to each other and took 5-15 us a call for the first milliseconds of one run in
        // five). Then sleep, which hands the core over whatever else runs.
        let crowded = crowded(execs, now);
        let w = execs[0].wiring;
        let spin = if idle >= w.spin && idle < WAKE_GRACE && peer_asleep(execs) {
            WAKE_GRACE
        } else {
            w.spin
        };
        if idle < spin && !crowded {
            continue;
        }
        let yield_until = if crowded { spin } else { spin + w.yield_for };
        if idle < yield_until {
            std::thread::yield_now();
            spins = spins.wrapping_add(63);
            continue;
        }
        if last_check.is_none_or(|t| now - t >= Duration::from_millis(20)) {
            last_check = Some(now);
            let lost = execs.iter().find_map(|e| {
                e.check_peers().err().map(|err| {
                    // A peer that found the ranks disagreeing names the two operations it
                    // saw; this rank adds its own, so every rank's error says what it called.
                    if err.kind == ErrorKind::InvalidUsage {
                        err.context(format!("rank {} (in {})", e.wiring.rank, e.called()))
                    } else {
                        err.context(format!("rank {}", e.wiring.rank))
                    }
                })
            });
            // A peer that gave up waiting for this rank: this rank's own wait is the story.
            let blamed = execs.iter().enumerate().find_map(|(i, e)| {
                let me = e.wiring.rank;
                let (waited_for, what) = e.blocked_on();
                let p = *waited_for.iter().find(|&&p| {
                    e.wiring.links[p]
                        .check_peer()
                        .is_err_and(|pe| pe.kind == ErrorKind::Timeout && pe.lost == Some(me))
                })?;
                let suspect = waited_for.iter().copied().find(|&s| s != p);
                let mut err = Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "rank {p} timed out waiting for rank {me}, which is waiting for {what}"
                    ),
                );
                err.lost = suspect.or(Some(p));
                Some((i, err))
            });
            if let Some((i, err)) = blamed {
                execs[i].give_up(&err);
                gave_up = Some((
                    now + grace(execs[i].wiring.timeout.get().unwrap_or_default()),
                    err,
                    i,
                ));
                continue;
            }
            if let Some(err) = lost {
                // A peer that finished and left published everything it was going to send
                // before it marked its end closed, so the departure being visible now means
                // its last bytes are visible too. Only a pass that still finds nothing after
                // seeing the departure proves we lack data that will never come.
                match pass_all(execs)? {
                    (_, true) => return Ok(()),
                    (true, false) => {
                        idle_since = None;
                        spins = 0;
                        continue;
                    }
                    (false, false) => return Err(err),
                }
            }
            for (i, e) in execs.iter().enumerate() {
                let (waited_for, what) = e.blocked_on();
                if !warned && idle >= e.wiring.warn_after {
                    crate::warn!(
                        "rank {} has made no progress for {:.0} s, waiting for {what}",
                        e.wiring.rank,
                        idle.as_secs_f64()
                    );
                    warned = true;
                }
                if let Some(t) = e.wiring.timeout.get() {
                    if idle >= t {
                        let mut err = Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "rank {} timed out after {:.1} s without progress ({:.1} s into the operation), waiting for {what}",
                                e.wiring.rank,
                                idle.as_secs_f64(),
                                (now - started).as_secs_f64()
                            ),
                        );
                        // The rank waited for is the suspect its peers will be told about.
                        err.lost = waited_for.first().copied();
                        e.give_up(&err);
                        gave_up = Some((now + grace(t), err, i));
                        break;
                    }
                }
            }
            if gave_up.is_some() {
                continue;
            }
        }
        let single_doorbell = match &*execs {
            [only] => Some(only.wiring.doorbell.clone()),
            _ => None,
        };
        match &single_doorbell {
            Some(d) => {
                // Announce the sleep, then look once more: a peer that published before it saw
                // the announcement is caught by this pass, one that published after rings.
                publish(execs, Activity::Sleeping);
                let seen = d.prepare_sleep();
                match pass_all(execs) {
                    Ok((false, false)) => {
                        let narrowed = hold_for_sleep(execs);
                        if narrowed.is_some() {
                            // It may have moved: peers must see where it sleeps.
                            publish(execs, Activity::Sleeping);
                        }
                        d.sleep(seen, Duration::from_millis(20));
                        drop(narrowed);
                        publish(execs, Activity::Polling);
                    }
                    Ok((_, done)) => {
                        d.cancel_sleep();
                        if done {
                            return Ok(());
                        }
                        idle_since = None;
                    }
                    Err(e) => {
                        d.cancel_sleep();
                        return Err(e);
                    }
                }
            }
            None => std::thread::yield_now(),
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::{Buf, Region, Step};
    use crate::transport::loopback::Loopback;
    use crate::transport::Progress;
    use std::sync::atomic::AtomicUsize;

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

    /// A peer on another CPU that says it sleeps (or polls) and whose message arrives
    /// `ready_after` the first look for it.
    struct WakingPeer {
        asleep: bool,
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

        fn peer_running_on(&self) -> Option<(u32, Activity)> {
            // A CPU no test machine has: never this rank's.
            let what = if self.asleep {
                Activity::Sleeping
            } else {
                Activity::Polling
            };
            Some((4000, what))
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

    /// How many times a rank with a 50 us spin window slept while it received from a peer
    /// that says it sleeps (or polls) and whose message comes `ready_after` the first look.
    fn sleeps_waiting_for(asleep: bool, ready_after: Duration) -> usize {
        let doorbell = Arc::new(CountingDoorbell::default());
        let peer = Arc::new(WakingPeer {
            asleep,
            ready_after,
            first_look: Mutex::new(None),
        });
        let w = Wiring {
            doorbell: doorbell.clone(),
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
            let mask = crate::transport::os::cpus_allowed();
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
            assert_eq!(
                crate::transport::os::cpus_allowed(),
                mask,
                "the mask stays whole"
            );
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

    use crate::algo::{direct, ring, tree, Operand, Schedule, Shape};
    use crate::reduce::{DataType, ReduceOp};
    use crate::transport::{Closing, LocalDoorbell};
    use std::collections::VecDeque;

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
    fn on_threads<T: Send>(
        wirings: &[Wiring],
        body: impl Fn(usize, &Wiring) -> T + Sync,
    ) -> Vec<T> {
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
                    input_scale: scale
                        .map(|s| Scale::from_bytes(DataType::Float32, &s.to_ne_bytes())),
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
                            let mut bufs = [0, 1]
                                .map(|_| [vec![0u8; count * 4], vec![0u8; blocks * count * 4]]);
                            for k in 0..6 {
                                // Twice on one pair of buffers, then twice on the other.
                                let [send, recv] = &mut bufs[k / 2 % 2];
                                let input =
                                    f32s((0..count).map(|i| (value(r, i) + k as i32) as f32));
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
        assert_eq!(m.wirings[0].cache.lock().hazards.len(), 2);
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
}
