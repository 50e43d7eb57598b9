//! What the executor keeps between calls: its tables, scratch, built steps and the key of
//! the last call, so that repeated calls allocate and analyse nothing.

use super::hazards::Hazards;
use super::overlap;
use super::plan::{Built, StepQueue, XStep};
use crate::algo::Schedule;
use crate::exec::op::HostOp;
use crate::exec::replies::Replies;
use std::sync::Arc;

/// How an operation's buffers relate, which together with its schedule fixes its hazards:
/// disjoint, or the send buffer at a given distance from the receive buffer.
pub(super) type Aliasing = Option<isize>;

/// The executor's tables, kept between calls so that their memory is reused.
#[derive(Default)]
pub(crate) struct ExecCache {
    /// Hazards of single-operation runs, by schedule (its address: the Arc is kept alive in
    /// the value) and aliasing. Repeated calls of one shape skip the quadratic analysis.
    pub(super) hazards: rustc_hash::FxHashMap<(usize, Aliasing), (Arc<Schedule>, Arc<Hazards>)>,
    /// Whole cache lines, so that scratch starts on one: from the allocator it would start 16
    /// bytes past a page, a distance to a page-aligned user buffer at which the C library's
    /// copies can be very slow (see `reduce::copy_bytes`), and a reduction's lines would
    /// straddle.
    pub(super) scratch: Vec<Line>,
    pub(super) tables: Tables,
    /// What `tables.steps` was last built for, when that was one operation alone.
    pub(super) built: Option<Built>,
    /// The call the last run served, when it was one operation alone that ran to the end and
    /// its entry point gave it a key, and where that call's buffers lay (`run_again`):
    /// `tables.ops[0]` is its operation.
    pub(super) repeat: Option<(Repeat, Footprint)>,
    /// How folded bytes went back in calls that forward, and how long those took.
    pub(super) replies: Replies,
}

impl ExecCache {
    /// An empty cache whose calls send folded bytes back as COMM_SHM_REPLY says.
    pub(crate) fn new(replies: crate::exec::replies::Setting) -> ExecCache {
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
pub(super) struct Line(pub(super) [u8; 64]);

/// The tables one run works on, left in place between runs so that their memory is reused
/// and nothing is moved in and out on each call.
#[derive(Default)]
pub(super) struct Tables {
    pub(super) ops: Vec<HostOp>,
    pub(super) steps: Vec<XStep>,
    pub(super) send_q: Vec<StepQueue>,
    pub(super) recv_q: Vec<StepQueue>,
    /// Per peer: its receives mix send/recv calls with collectives (`match_by_tag`).
    pub(super) mixed: Vec<bool>,
    /// Per peer: the receive at the front of its queue was matched to the message that has
    /// begun to arrive (`match_by_tag`), so it goes on with it.
    pub(super) matched: Vec<bool>,
    pub(super) peers: Vec<usize>,
    pub(super) posted: Vec<u32>,
    pub(super) ready_local: Vec<u32>,
    /// The local steps that wait for nothing, in the order `ready_local` starts with.
    pub(super) first_local: Vec<u32>,
    /// The steps' dependents (`Hazards::edges`) as last built: a repeated call keeps them
    /// without touching a reference count.
    pub(super) edges: Arc<[u32]>,
    /// Receives that may forward (`Reply::next`) do so rather than write back
    /// (`Reply::forward_first`): the way `ExecCache::replies` chose for this run.
    pub(super) forward_first: bool,
    /// Some receive of this run could forward.
    pub(super) could_forward: bool,
    /// `straight` tried the run's steps: those it finished are marked so (their dependents'
    /// counts lowered) and the others kept what the try did. The executor that takes over
    /// goes on from there instead of starting them afresh.
    pub(super) tried: bool,
}

// SAFETY: what keeps the cache from being Send automatically is raw pointers into the user's
// buffers and scratch (`HostOp`, the built steps), left from the last run. They are followed
// only during a run, by the thread that holds the comm's `Mutex<ExecCache>` for it, after that
// run stored its own call's buffers in them (`run_again_in` replaces `send`/`recv` once the
// new call is admitted); between runs nothing reads through them, so the cache may move to
// another thread.
unsafe impl Send for ExecCache {}

/// How an operation's send and receive buffers overlap (see `Aliasing`).
pub(super) fn aliasing(op: &HostOp) -> Aliasing {
    overlap(
        op.send as usize,
        op.schedule.send_extent,
        op.recv as usize,
        op.schedule.recv_extent,
    )
}
