//! The device executor: turns a group's schedules into a *device program*, an ordered list of
//! stream operations (copies, reduction kernels, flag writes and flag waits) that a CUDA backend
//! enqueues on the caller's stream. Nothing blocks the host, nothing spins on the GPU: ranks
//! synchronise through flags in each other's memory with stream memory operations, which also
//! works for several processes sharing one GPU (their kernels would not run concurrently, so a
//! kernel waiting for another process's kernel could stall for whole time slices).
//!
//! Every rank owns, in device memory its peers map:
//! - for each peer `to`, `slots` outgoing message slots of `slot_bytes` each;
//! - a flag array: `Full[from][slot]` (set by `from` when it filled its slot for us) and
//!   `Empty[to][slot]` (set by `to` when it has read our slot, so we may refill it).
//!
//! A message k on a channel uses slot k mod `slots`, counted from 0 in every program, and leaves
//! the flags as it found them: Empty set, Full clear. So a program can be captured in a CUDA
//! graph and replayed any number of times.
//!
//! The sender stages its data into its own slot (applying its input scale there, so receivers
//! need not know it) and raises the receiver's Full flag; the receiver waits for Full, lowers it,
//! reads the slot across the peer mapping (copying it, or combining it with its own data in a
//! reduction kernel) and raises the sender's Empty flag. Steps run strictly in list order, which
//! the algorithms make safe (see `algo::interleave` and the bounded simulation in algo tests).
//!
//! Registered buffers skip the staging copy. Once a receiver has mapped some registered buffer of
//! a sender, the pair switches to *described* messages (see `transport::reg` for how both sides
//! agree on the program from which on): with every message the sender stores a descriptor,
//! `Desc[from][slot]` in the receiver's area, before it raises Full. The descriptor is the
//! address, in the receiver's mapping, of the sender's own buffer when the bytes sit in a
//! registered buffer that nothing later in the program overwrites, and 0 when they were staged
//! into the slot as usual. The receiver's kernels read the descriptor and take the bytes from
//! wherever it points. A sender whose message was read in place waits, at the end of its
//! program, for the receiver's Empty flag of that message, so the caller's buffer is not reused
//! before the peer has read it.

mod compile;
mod enqueue;
mod group;
mod program;
#[cfg(test)]
mod tests;

pub(crate) use crate::transport::p2p::SLOTS;
pub(crate) use compile::{compile, DeviceOp, Links};
pub(crate) use enqueue::{enqueue, OpBuffers};
pub(crate) use group::{Described, GroupStreams};
