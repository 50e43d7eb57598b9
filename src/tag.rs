//! Message tags: which operation a message belongs to. The schedule layer names operations by
//! their kind; the transports carry the tag with every message, match receives by it, and name
//! the operation in their errors. Both use this module, so neither imports the other for it.

/// Message tags: the kind of operation in the top byte, the communicator's operation count below.
pub(crate) fn tag(kind: u8, seq: u64) -> u64 {
    ((kind as u64) << 56) | (seq & ((1 << 56) - 1))
}

pub(crate) fn tag_kind(tag: u64) -> u8 {
    (tag >> 56) as u8
}

pub(crate) fn tag_seq(tag: u64) -> u64 {
    tag & ((1 << 56) - 1)
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
    if (tag_kind(sent) == kind::P2P) != (tag_kind(expected) == kind::P2P) {
        " (or, in a group, send/recv calls that share a buffer with a collective of the group run in the order called: the ranks must place them alike around it)"
    } else {
        ""
    }
}

/// "AllReduce #12" or "Send/Recv".
pub(crate) fn describe_tag(tag: u64) -> String {
    let k = tag_kind(tag);
    if k == kind::P2P {
        kind::name(k).to_string()
    } else {
        format!("{} #{}", kind::name(k), tag_seq(tag))
    }
}
