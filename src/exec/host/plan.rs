//! Step planning: a schedule's steps resolved on one operation's buffers (`XStep`, `Action`),
//! the per-peer queues they start from, and what a repeated call may keep of the last build.

use super::cache::{aliasing, Aliasing};
use super::hazards::{Hazards, Hint};
use super::sink::RecvSink;
use crate::algo::{Buf, Operand, Region, Schedule, Step};
use crate::error::Result;
use crate::exec::op::{HostOp, Reduction};
use crate::exec::ranges::OpBytes;
use crate::reduce::Scale;
use crate::transport::{
    InExpect, Link, Offer, OutMsg, Progress, RecvCursor, SendCursor, SendState,
};
use std::sync::Arc;

#[derive(Clone, Copy, Debug)]
pub(super) struct Src {
    pub(super) ptr: *const u8,
    pub(super) scale: Option<Scale>,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Action {
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
    /// Sends what more of this send step of `op` its link takes, offering what the executor
    /// knows of the message (`Offer`); `busy`: `Offer::sender_busy`.
    #[inline]
    pub(super) fn send_on(
        &mut self,
        links: &[Arc<dyn Link>],
        op: &HostOp,
        busy: bool,
    ) -> Result<Progress<SendState>> {
        let Action::Send { peer, src, len } = self.action else {
            unreachable!("a message of a step that sends nothing")
        };
        let msg = OutMsg {
            src: src.ptr,
            len,
            scale: src.scale,
            tag: op.tag,
        };
        let offer = Offer {
            sender_busy: busy,
            copied: self.copied,
            reply_at: match self.hint {
                Hint::ReplyHere => Some(src.ptr as usize),
                Hint::ReplyInRecv => op.in_recv(src.ptr as usize),
                _ => None,
            },
        };
        links[peer].send_offered(&msg, offer, &mut self.send)
    }

    /// Receives what more of this receive step has come on its link, numbered `tag`, folding
    /// with `reduction`; `stream`, `forwards` and `forward_first` as `RecvSink` has them.
    pub(super) fn receive(
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
    pub(super) fn restart(&mut self, waiting_on: u32) {
        self.waiting_on = waiting_on;
        self.finished = false;
        self.send = SendCursor::default();
        self.recv = RecvCursor::default();
    }
}

pub(super) struct XStep {
    pub(super) action: Action,
    pub(super) op: usize,
    pub(super) waiting_on: u32,
    /// This step's dependents are `edges[first_dependent..first_dependent + dependents]`.
    pub(super) first_dependent: u32,
    pub(super) dependents: u32,
    /// A send: where its reply lands (`Offer::reply_at`). A receive: its sink offers a `reply` (see
    /// `Hazards::hints`).
    pub(super) hint: Hint,
    /// A send: `Offer::copied`, for operations that reduce nothing, except from scratch (an
    /// in-place all-to-all's blocks, just copied there: 2 processes, 128-512 KiB, 1.1-1.6x
    /// slower when peers pulled them out of this core's cache than through the slots).
    pub(super) copied: bool,
    /// `straight` finished it (the executor that takes over skips it).
    pub(super) finished: bool,
    pub(super) send: SendCursor,
    pub(super) recv: RecvCursor,
}

pub(super) fn is_p2p(op: &HostOp) -> bool {
    crate::tag::tag_kind(op.tag) == crate::tag::kind::P2P
}

/// What each operation of a group reads and writes (`ranges::kinds_apart`, without which the
/// receives keep the order called: `Exec::match_by_tag`).
pub(super) fn op_bytes(ops: &[HostOp]) -> impl Iterator<Item = OpBytes> + Clone + '_ {
    ops.iter().map(|op| OpBytes {
        p2p: is_p2p(op),
        read: (op.send as u64, op.schedule.send_extent as u64),
        write: (op.recv as u64, op.schedule.recv_extent as u64),
    })
}

/// One peer's sends or receives in schedule order, and how many are done. The list stays
/// between runs: a repeated call only rewinds it.
#[derive(Default)]
pub(super) struct StepQueue {
    pub(super) steps: Vec<u32>,
    pub(super) head: usize,
}

impl StepQueue {
    pub(super) fn front(&self) -> Option<&u32> {
        self.steps.get(self.head)
    }

    pub(super) fn pop_front(&mut self) {
        self.head += 1;
    }
}

/// A single-operation run's steps depend only on its schedule, its buffers, its input scale and
/// where scratch is: a call that repeats all of them (a training or benchmark loop) resets the
/// steps' progress instead of building them and looking up their hazards again, and one that
/// repeats all but the buffers, on buffers that overlap alike (a loop over the slices of a
/// buffer, as nccl-tests runs), also resolves the steps' addresses anew.
pub(super) struct Built {
    pub(super) schedule: Arc<Schedule>,
    pub(super) send: *const u8,
    pub(super) recv: *mut u8,
    pub(super) aliasing: Aliasing,
    pub(super) input_scale: Option<Scale>,
    pub(super) scratch: *mut u8,
    pub(super) hazards: Arc<Hazards>,
}

/// How much of the last single-operation run's steps a new operation can keep
/// (`Built::reuse`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reuse {
    /// Everything: the same operation on the same buffers.
    All,
    /// All but the addresses: the same operation on other buffers that overlap alike, so
    /// its hazards, queues and hints are the same (they depend on the schedule and the
    /// aliasing only).
    Structure,
    Nothing,
}

impl Built {
    /// The key of the plan these steps were built for (`ExecCache::plans`).
    pub(super) fn plan_key(&self) -> super::cache::PlanKey {
        (Arc::as_ptr(&self.schedule) as usize, self.aliasing)
    }

    /// Resolves `steps` anew on `op`'s buffers, which overlap as the last run's did
    /// (`Reuse::Structure`), and keeps those buffers as the ones the steps were built for.
    pub(super) fn take_buffers(&mut self, op: &HostOp, scratch: *mut u8, steps: &mut [XStep]) {
        let at = resolver(op, scratch);
        let input_scale = op.reduction.and_then(|r| r.input_scale);
        for (x, step) in steps.iter_mut().zip(&op.schedule.steps) {
            x.action = Action::of(step, &at, input_scale);
        }
        (self.send, self.recv) = (op.send, op.recv);
    }

    pub(super) fn reuse(&self, op: &HostOp, scratch: *mut u8, steps: usize) -> Reuse {
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
pub(super) fn resolver(op: &HostOp, scratch: *mut u8) -> impl Fn(Region) -> *mut u8 + '_ {
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
pub(super) type Range = (usize, usize);

pub(super) fn overlaps(a: Option<Range>, b: Option<Range>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.0 < b.1 && b.0 < a.1,
        _ => false,
    }
}

impl Action {
    /// `step` with its regions resolved to addresses by `at`; `input_scale` applies to this
    /// rank's own input.
    pub(super) fn of(
        step: &Step,
        at: impl Fn(Region) -> *mut u8,
        input_scale: Option<Scale>,
    ) -> Action {
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
    pub(super) fn ranges(&self) -> ([Option<Range>; 2], Option<Range>) {
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
