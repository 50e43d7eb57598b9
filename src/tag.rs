//! Message tags: which operation a message belongs to. The schedule layer names operations by
//! their kind; the transports carry the tag with every message, match receives by it, and name
//! the operation in their errors. Both use this module, so neither imports the other for it.
//!
//! A tag holds everything two ranks must agree on for their messages to mean the same thing
//! beyond the byte count the receiver checks anyway: the kind of operation, its number in the
//! communicator's sequence, its root, its datatype and its reduction op. Ranks that disagree on
//! any of these tag their messages differently, so the receiver refuses the message and names
//! both operations, instead of folding an int32 into a float or a max into a sum.

use crate::reduce::DataType;

/// Bits of a tag that hold the communicator's operation count (it wraps: only ranks in step
/// compare counts, and they are at most one operation apart).
const SEQ_BITS: u32 = 34;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// Roots are told apart up to this many ranks (beyond, they wrap: a mismatch of roots this
/// far apart goes unnoticed, as every root mismatch did before).
const ROOTS: u64 = 0xffff;
const ROOT_SHIFT: u32 = SEQ_BITS;
/// The reduction op (`op::*`, 0 for none) in 4 bits above the root.
const OP_SHIFT: u32 = ROOT_SHIFT + 16;
/// The datatype plus one (0 for none) in 5 bits above the op.
const DTYPE_SHIFT: u32 = OP_SHIFT + 4;
/// The kind of operation in the top 5 bits.
const KIND_SHIFT: u32 = DTYPE_SHIFT + 5;

/// Message tags: the kind of operation and the communicator's operation count.
pub(crate) const fn tag(kind: u8, seq: u64) -> u64 {
    ((kind as u64) << KIND_SHIFT) | (seq & SEQ_MASK)
}

/// The tag of a collective's messages: its kind, root (plus one: ranks that pass different
/// roots tag their messages differently, so the receiver reports the mismatch instead of taking
/// another root's data), datatype, reduction op (`op::*`, 0 for none) and number.
pub(crate) fn op_tag(
    kind: u8,
    root: Option<usize>,
    dtype: Option<DataType>,
    op: u8,
    seq: u64,
) -> u64 {
    let r = root.map_or(0, |r| r as u64 % ROOTS + 1);
    let d = dtype.map_or(0, |d| d as u64 + 1);
    tag(kind, seq) | (d << DTYPE_SHIFT) | (((op & 0xf) as u64) << OP_SHIFT) | (r << ROOT_SHIFT)
}

/// `tag` with the operation number `seq` in place of its own: the same operation, run again.
pub(crate) fn renumbered(tag: u64, seq: u64) -> u64 {
    (tag & !SEQ_MASK) | (seq & SEQ_MASK)
}

pub(crate) fn tag_kind(tag: u64) -> u8 {
    (tag >> KIND_SHIFT) as u8
}

pub(crate) fn tag_seq(tag: u64) -> u64 {
    tag & SEQ_MASK
}

/// The root a tag carries, if its operation has one.
pub(crate) fn tag_root(tag: u64) -> Option<u64> {
    match (tag >> ROOT_SHIFT) & ROOTS {
        0 => None,
        r => Some(r - 1),
    }
}

/// The datatype a tag carries, if its operation has one.
pub(crate) fn tag_dtype(tag: u64) -> Option<DataType> {
    match (tag >> DTYPE_SHIFT) & 0x1f {
        0 => None,
        d => DataType::from_raw(d as i32 - 1),
    }
}

/// The reduction op a tag carries (`op::*`, 0 for none).
pub(crate) fn tag_op(tag: u64) -> u8 {
    ((tag >> OP_SHIFT) & 0xf) as u8
}

/// Reduction ops as tags carry them. Ops made by `ncclRedOpCreatePreMulSum` are numbered per
/// communicator and per rank, so they travel as one kind; their scalars may differ by rank.
pub(crate) mod op {
    pub(crate) const SUM: u8 = 1;
    pub(crate) const PROD: u8 = 2;
    pub(crate) const MAX: u8 = 3;
    pub(crate) const MIN: u8 = 4;
    pub(crate) const AVG: u8 = 5;
    pub(crate) const PREMULSUM: u8 = 6;
    pub(crate) const BAND: u8 = 7;
    pub(crate) const BOR: u8 = 8;
    pub(crate) const BXOR: u8 = 9;

    pub(crate) fn name(op: u8) -> &'static str {
        match op {
            SUM => "sum",
            PROD => "prod",
            MAX => "max",
            MIN => "min",
            AVG => "avg",
            PREMULSUM => "premulsum",
            BAND => "band",
            BOR => "bor",
            BXOR => "bxor",
            _ => "no op",
        }
    }
}

/// The kinds of operation a message can belong to (the top 5 bits of its tag).
pub(crate) mod kind {
    pub(crate) const P2P: u8 = 1;
    pub(crate) const ALL_REDUCE: u8 = 2;
    pub(crate) const BROADCAST: u8 = 3;
    pub(crate) const REDUCE: u8 = 4;
    pub(crate) const ALL_GATHER: u8 = 5;
    pub(crate) const REDUCE_SCATTER: u8 = 6;
    pub(crate) const ALL_TO_ALL: u8 = 7;
    pub(crate) const ALL_TO_ALL_V: u8 = 8;
    pub(crate) const GATHER: u8 = 9;
    pub(crate) const SCATTER: u8 = 10;
    pub(crate) const BARRIER: u8 = 11;

    pub(crate) fn name(k: u8) -> &'static str {
        match k {
            P2P => "Send/Recv",
            ALL_REDUCE => "AllReduce",
            BROADCAST => "Broadcast",
            REDUCE => "Reduce",
            ALL_GATHER => "AllGather",
            REDUCE_SCATTER => "ReduceScatter",
            ALL_TO_ALL => "AlltoAll",
            ALL_TO_ALL_V => "AlltoAllv",
            GATHER => "Gather",
            SCATTER => "Scatter",
            BARRIER => "Barrier",
            _ => "an unknown operation",
        }
    }
}

/// What to add to a mismatch between a message tagged `sent` and a receive expecting
/// `expected`: what the ranks disagree on, or, where one is a send/recv call's and the other a
/// collective's, the likely cause.
pub(crate) fn mismatch_hint(sent: u64, expected: u64) -> &'static str {
    let same_call = tag_kind(sent) == tag_kind(expected) && tag_seq(sent) == tag_seq(expected);
    if same_call && tag_root(sent) != tag_root(expected) {
        " (the ranks passed different roots)"
    } else if same_call && tag_dtype(sent) != tag_dtype(expected) {
        " (the ranks passed different datatypes)"
    } else if same_call && tag_op(sent) != tag_op(expected) {
        " (the ranks passed different reduction ops)"
    } else if (tag_kind(sent) == kind::P2P) != (tag_kind(expected) == kind::P2P) {
        " (or, in a group, send/recv calls that share a buffer with a collective of the group run in the order called: the ranks must place them alike around it)"
    } else {
        ""
    }
}

/// "AllReduce #12 (float, sum)", "Broadcast #3 (root 1, int32)" or "Send/Recv".
pub(crate) fn describe_tag(tag: u64) -> String {
    let k = tag_kind(tag);
    if k == kind::P2P {
        return kind::name(k).to_string();
    }
    let mut what = Vec::new();
    if let Some(r) = tag_root(tag) {
        what.push(format!("root {r}"));
    }
    if let Some(d) = tag_dtype(tag) {
        what.push(d.name().to_string());
    }
    if tag_op(tag) != 0 {
        what.push(op::name(tag_op(tag)).to_string());
    }
    let head = format!("{} #{}", kind::name(k), tag_seq(tag));
    if what.is_empty() {
        head
    } else {
        format!("{head} ({})", what.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_carry_kind_count_and_root() {
        let t = op_tag(kind::BROADCAST, Some(3), None, 0, (1 << SEQ_BITS) + 17);
        assert_eq!(
            (tag_kind(t), tag_seq(t), tag_root(t)),
            (kind::BROADCAST, 17, Some(3))
        );
        assert_eq!(describe_tag(t), "Broadcast #17 (root 3)");
        let other = op_tag(kind::BROADCAST, Some(0), None, 0, 17);
        assert_ne!(t, other);
        assert!(mismatch_hint(other, t).contains("different roots"));
        let a = tag(kind::ALL_REDUCE, 5);
        assert_eq!(
            (tag_root(a), describe_tag(a).as_str()),
            (None, "AllReduce #5")
        );
        assert_eq!(mismatch_hint(a, tag(kind::ALL_REDUCE, 6)), "");
    }

    #[test]
    fn a_renumbered_tag_keeps_everything_but_the_number() {
        let t = op_tag(kind::REDUCE, Some(2), Some(DataType::Bfloat16), op::MIN, 7);
        let r = renumbered(t, SEQ_MASK + 9);
        assert_eq!(
            r,
            op_tag(kind::REDUCE, Some(2), Some(DataType::Bfloat16), op::MIN, 8)
        );
        assert_eq!(tag(kind::P2P, 3), op_tag(kind::P2P, None, None, 0, 3));
    }

    #[test]
    fn tags_carry_datatype_and_op() {
        let f = op_tag(kind::ALL_REDUCE, None, Some(DataType::Float32), op::SUM, 9);
        let i = op_tag(kind::ALL_REDUCE, None, Some(DataType::Int32), op::SUM, 9);
        let m = op_tag(kind::ALL_REDUCE, None, Some(DataType::Float32), op::MAX, 9);
        assert_eq!(describe_tag(f), "AllReduce #9 (float, sum)");
        assert_eq!(describe_tag(i), "AllReduce #9 (int32, sum)");
        assert_ne!(f, i);
        assert_ne!(f, m);
        assert!(mismatch_hint(i, f).contains("different datatypes"));
        assert!(mismatch_hint(m, f).contains("different reduction ops"));
        // Every field survives every other at its largest value.
        for d in DataType::ALL {
            for o in [op::SUM, op::BXOR] {
                let t = op_tag(kind::BARRIER, Some(0xfffe), Some(d), o, SEQ_MASK);
                assert_eq!(
                    (
                        tag_kind(t),
                        tag_root(t),
                        tag_dtype(t),
                        tag_op(t),
                        tag_seq(t)
                    ),
                    (kind::BARRIER, Some(0xfffe), Some(d), o, SEQ_MASK)
                );
            }
        }
        let b = op_tag(kind::BROADCAST, Some(2), Some(DataType::Int8), 0, 4);
        assert_eq!(describe_tag(b), "Broadcast #4 (root 2, int8)");
    }
}
