//! Message tags: which operation a message belongs to. The schedule layer names operations by
//! their kind; the transports carry the tag with every message, match receives by it, and name
//! the operation in their errors. Both use this module, so neither imports the other for it.

/// Bits of a tag that hold the communicator's operation count.
const SEQ_BITS: u32 = 40;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// Roots are told apart up to this many ranks (beyond, they wrap: a mismatch of roots this
/// far apart goes unnoticed, as every root mismatch did before).
const ROOTS: u64 = 0xffff;

/// Message tags: the kind of operation in the top byte, the communicator's operation count in
/// the low 40 bits.
pub(crate) fn tag(kind: u8, seq: u64) -> u64 {
    rooted_tag(kind, None, seq)
}

/// A tag that also carries the root of a rooted collective (plus one, in the 16 bits between
/// kind and count): ranks that pass different roots tag their messages differently, so the
/// receiver reports the mismatch instead of taking another root's data.
pub(crate) fn rooted_tag(kind: u8, root: Option<usize>, seq: u64) -> u64 {
    let r = root.map_or(0, |r| r as u64 % ROOTS + 1);
    ((kind as u64) << 56) | (r << SEQ_BITS) | (seq & SEQ_MASK)
}

pub(crate) fn tag_kind(tag: u64) -> u8 {
    (tag >> 56) as u8
}

pub(crate) fn tag_seq(tag: u64) -> u64 {
    tag & SEQ_MASK
}

/// The root a tag carries, if its operation has one.
pub(crate) fn tag_root(tag: u64) -> Option<u64> {
    match (tag >> SEQ_BITS) & ROOTS {
        0 => None,
        r => Some(r - 1),
    }
}

/// The kinds of operation a message can belong to (the top byte of its tag).
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
/// `expected`: where one is a send/recv call's and the other a collective's, the likely cause.
pub(crate) fn mismatch_hint(sent: u64, expected: u64) -> &'static str {
    if tag_kind(sent) == tag_kind(expected)
        && tag_seq(sent) == tag_seq(expected)
        && tag_root(sent) != tag_root(expected)
    {
        " (the ranks passed different roots)"
    } else if (tag_kind(sent) == kind::P2P) != (tag_kind(expected) == kind::P2P) {
        " (or, in a group, send/recv calls that share a buffer with a collective of the group run in the order called: the ranks must place them alike around it)"
    } else {
        ""
    }
}

/// "AllReduce #12", "Broadcast #3 (root 1)" or "Send/Recv".
pub(crate) fn describe_tag(tag: u64) -> String {
    let k = tag_kind(tag);
    match tag_root(tag) {
        _ if k == kind::P2P => kind::name(k).to_string(),
        Some(r) => format!("{} #{} (root {r})", kind::name(k), tag_seq(tag)),
        None => format!("{} #{}", kind::name(k), tag_seq(tag)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_carry_kind_count_and_root() {
        let t = rooted_tag(kind::BROADCAST, Some(3), (1 << 40) + 17);
        assert_eq!(
            (tag_kind(t), tag_seq(t), tag_root(t)),
            (kind::BROADCAST, 17, Some(3))
        );
        assert_eq!(describe_tag(t), "Broadcast #17 (root 3)");
        let other = rooted_tag(kind::BROADCAST, Some(0), 17);
        assert_ne!(t, other);
        assert!(mismatch_hint(other, t).contains("different roots"));
        let a = tag(kind::ALL_REDUCE, 5);
        assert_eq!(
            (tag_root(a), describe_tag(a).as_str()),
            (None, "AllReduce #5")
        );
        assert_eq!(mismatch_hint(a, tag(kind::ALL_REDUCE, 6)), "");
    }
}
