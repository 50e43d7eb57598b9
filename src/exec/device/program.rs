//! A device program: the stream operations a rank's part of a group compiles to, with places
//! named (not yet resolved to addresses), so that any rank's program can be run by the CPU
//! model as well as enqueued.

use crate::algo::Buf;
use crate::reduce::{Reducer, Scale};
use crate::transport::p2p::{Desc, Flag};

/// A place in device memory, named so that any rank's program can be checked on the CPU and
/// resolved by the backend to an address (local or peer-mapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Loc {
    /// A buffer of operation `op` of the program (the caller's, or this program's scratch).
    Buf { op: usize, buf: Buf, offset: usize },
    /// Byte `offset` of slot `slot` that rank `owner` keeps for its messages to rank `to`.
    Slot {
        owner: usize,
        to: usize,
        slot: usize,
        offset: usize,
    },
    /// The message `from` sent `to` through slot `slot`, wherever its descriptor
    /// (`Desc { owner: to, from, slot }`) says it is: in the sender's registered buffer, or in
    /// that slot. Only read, and only by `to`.
    Message { from: usize, to: usize, slot: usize },
}

/// A multiplier: known when the program is built, or read from device memory when it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Factor {
    Value(Scale),
    /// A value of the datatype at this device address of the rank (ncclScalarDevice).
    At(u64),
}

/// One source of a reduction, with the multiplier applied to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    pub loc: Loc,
    pub scale: Option<Factor>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum DevOp {
    /// A plain copy of `len` bytes.
    Copy { dst: Loc, src: Loc, len: usize },
    /// `dst = srcs[0] (+) srcs[1] (+) ...` over `count` elements, each source scaled first when it
    /// has a scale, the result divided by `divide_by` when set. One source: a scaled copy.
    Reduce {
        dst: Loc,
        srcs: Vec<Source>,
        count: usize,
        reducer: Reducer,
        divide_by: Option<usize>,
    },
    /// Stores `value` into a flag (after everything before it in the stream is visible).
    Set { flag: Flag, value: u32 },
    /// Holds the stream until a flag (in this rank's own area) equals `value`.
    Wait { flag: Flag, value: u32 },
    /// Stores a message's descriptor in the receiver's area (before the Full flag that
    /// announces the message). `direct` is None for a message staged in its slot; otherwise the
    /// sender's own bytes (for the CPU model) and the address at which the receiver reads them.
    Describe {
        desc: Desc,
        len: usize,
        direct: Option<(Loc, u64)>,
    },
}
