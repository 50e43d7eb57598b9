//! What the executor keeps between calls: its tables, scratch, built steps, the key of the
//! last call and its plans (per schedule and aliasing: the hazards, and the steps of a plan
//! whose run is not the last one), so that repeated calls, and calls that take turns,
//! allocate and analyse nothing.

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
    /// The plans of single-operation runs, by schedule (its address: the Arc is kept alive in
    /// the value) and aliasing: their hazards, so that calls of one shape skip the quadratic
    /// analysis, and the steps of those not in the tables now (`Plan::parked`).
    pub(super) plans: rustc_hash::FxHashMap<PlanKey, Plan>,
    /// Whole cache lines, so that scratch starts on one: from the allocator it would start 16
    /// bytes past a page, a distance to a page-aligned user buffer at which the C library's
    /// copies can be very slow (see `reduce::copy_bytes`), and a reduction's lines would
    /// straddle.
    pub(super) scratch: Vec<Line>,
    pub(super) tables: Tables,
    /// What `tables.plan` was last built for, when that was one operation alone (its plan's
    /// steps are in the tables, not parked).
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

    /// Before a run of the operations in the tables: when that is one operation whose plan
    /// ran before and was parked, its steps come back into the tables (`Built::reuse` then
    /// says how much of them it keeps), and the steps there go to their own plan. Calls that
    /// take turns (a training loop's buckets) so keep their steps as a repeated call does.
    /// Any other run parks the steps in the tables and builds its own.
    pub(super) fn recall(&mut self) {
        let key = match self.tables.ops.as_slice() {
            [op] => plan_key(op),
            _ => return self.park(),
        };
        if self.built.as_ref().is_some_and(|b| b.plan_key() == key) {
            return;
        }
        self.park();
        let Some(p) = self.plans.get_mut(&key).and_then(|p| p.parked.take()) else {
            return;
        };
        let t = &mut self.tables;
        t.plan = p.steps;
        t.edges = p.built.hazards.edges.clone();
        t.tried = false;
        self.built = Some(p.built);
    }

    /// Moves the steps of the single operation the tables were built for (`built`) to its
    /// plan, to come back when that plan runs again (dropped if the plan is gone, or if they
    /// are more than `PARK_UP_TO`).
    fn park(&mut self) {
        let Some(built) = self.built.take() else {
            return;
        };
        if self.tables.plan.steps.len() > PARK_UP_TO {
            return;
        }
        let Some(plan) = self.plans.get_mut(&built.plan_key()) else {
            return;
        };
        plan.parked = Some(Parked {
            built,
            steps: std::mem::take(&mut self.tables.plan),
        });
    }
}

/// Plans of at most this many steps keep them while another plan runs. Building steps costs
/// what a small call costs, and small calls have few steps; a large call's steps would hold
/// memory for a saving its bytes' time hides.
const PARK_UP_TO: usize = 1024;

/// A plan's key: its schedule's address and how its buffers overlap.
pub(super) type PlanKey = (usize, Aliasing);

pub(super) fn plan_key(op: &HostOp) -> PlanKey {
    (Arc::as_ptr(&op.schedule) as usize, aliasing(op))
}

/// What the executor keeps of one plan (a schedule, on buffers that overlap one way).
pub(super) struct Plan {
    /// Keeps the schedule whose address is the key alive.
    pub(super) _schedule: Arc<Schedule>,
    pub(super) hazards: Arc<Hazards>,
    /// The steps its last run left, while another run's are in the tables.
    pub(super) parked: Option<Parked>,
}

/// A plan's steps and their queues, out of the tables (`ExecCache::park`), and what they were
/// built for.
pub(super) struct Parked {
    built: Built,
    steps: PlanSteps,
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
    /// The steps of the plan the tables were built for, and their queues: what a plan parks
    /// while another one runs (`ExecCache::park`), moved out and back whole.
    pub(super) plan: PlanSteps,
    /// Per peer: the receive at the front of its queue was matched to the message that has
    /// begun to arrive (`match_by_tag`), so it goes on with it.
    pub(super) matched: Vec<bool>,
    pub(super) posted: Vec<u32>,
    pub(super) ready_local: Vec<u32>,
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

/// A plan's steps resolved on buffers and the per-peer queues they start from (`Exec::queue`):
/// everything of a run's tables that depends on its plan alone, with the progress of its last
/// run.
#[derive(Default)]
pub(super) struct PlanSteps {
    pub(super) steps: Vec<XStep>,
    pub(super) send_q: Vec<StepQueue>,
    pub(super) recv_q: Vec<StepQueue>,
    /// Per peer: its receives mix send/recv calls with collectives (`match_by_tag`).
    pub(super) mixed: Vec<bool>,
    /// The peers with a send or a receive in the run.
    pub(super) peers: Vec<usize>,
    /// The local steps that wait for nothing, in the order `ready_local` starts with.
    pub(super) first_local: Vec<u32>,
}

// SAFETY: what keeps the cache from being Send automatically is raw pointers into the user's
// buffers and scratch (`HostOp`, the built steps, the parked plans' steps), left from earlier
// runs. They are followed only during a run, by the thread that holds the comm's
// `Mutex<ExecCache>` for it, after that run stored its own call's buffers in them
// (`run_again_in` replaces `send`/`recv` once the new call is admitted; steps brought back are
// kept only on the same buffers or resolved again, `Built::reuse`); between runs nothing reads
// through them, so the cache may move to another thread.
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
