//! Hazard analysis: which steps of a run wait for which (by intersecting the byte ranges
//! they read and write), and the hints that let a receive fold and return in place.

use super::plan::{overlaps, Action, Range, XStep};
use std::sync::Arc;

/// The dependency graph of one schedule: how many steps each step waits for, and which steps
/// wait for it (`edges[first[i]..first[i] + count[i]]`).
pub(super) struct Hazards {
    pub(super) waiting_on: Vec<u32>,
    pub(super) first: Vec<u32>,
    pub(super) count: Vec<u32>,
    pub(super) edges: Arc<[u32]>,
    /// Per step, `XStep::hint`.
    pub(super) hints: Vec<Hint>,
}

/// What `Hazards::hints` found out about a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Hint {
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
pub(super) enum Near {
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
pub(super) const NEAR_ALL_UP_TO: usize = 64;

impl Near {
    pub(super) fn new(steps: &[XStep], mirror: &dyn Fn(usize, usize) -> Option<usize>) -> Near {
        if steps.len() <= NEAR_ALL_UP_TO {
            Near::All(steps.len())
        } else {
            Near::of_ops(steps, mirror)
        }
    }

    pub(super) fn of_ops(steps: &[XStep], mirror: &dyn Fn(usize, usize) -> Option<usize>) -> Near {
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
    pub(super) fn before(&self, i: usize, op: usize) -> impl Iterator<Item = usize> + '_ {
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
    pub(super) fn after(&self, i: usize, op: usize) -> impl Iterator<Item = usize> + '_ {
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
    pub(super) fn compute(
        steps: &[XStep],
        mirror: &dyn Fn(usize, usize) -> Option<usize>,
    ) -> Hazards {
        Hazards::compute_near(steps, mirror, &Near::new(steps, mirror))
    }

    pub(super) fn compute_near(
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
    /// of; see `Offer::reply_at`). A send from R is `ReplyHere` when no earlier step reads R
    /// (one that did could still be waiting to run when the peer writes) and the next step to
    /// touch R receives, from the same peer, exactly R. Else, where R lies in its operation's
    /// send buffer, it is `ReplyInRecv` when the same place M of the receive buffer is apart
    /// from R, no earlier step touches M and the next step to touch it receives, from the
    /// same peer, exactly M. A folding receive into D `Returns` when the next step to touch D
    /// sends exactly D, unscaled, to the same peer.
    pub(super) fn hints(
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
