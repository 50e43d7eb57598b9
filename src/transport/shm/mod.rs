//! The shared-memory transport between ranks of one host.
//!
//! Every rank owns one segment (a memfd) that holds its doorbell and one FIFO per peer for the
//! messages that peer sends it. With NCCL_RUNTIME_CONNECT (the default) a rank maps a peer's
//! segment when their link is first used: it takes the memfd out of the peer's process with
//! pidfd_getfd (threads of one process duplicate the descriptor), so the peers a rank's
//! schedules never use cost it no mapping, no descriptor and no page. Where a rank may not take
//! its peers' descriptors, or with NCCL_RUNTIME_CONNECT=0, every rank fetches every peer's memfd
//! at init over an authenticated unix socket instead (`setup.rs`). Only the two ends of a link
//! touch each other's segments, and only once it is made: a sender rings the doorbell of a
//! segment it mapped. A FIFO is a ring of slots with a head (advanced by the sender) and a tail
//! (advanced by the receiver).
//!
//! Small messages travel *eagerly*: copied into slots by the sender, out of them by the receiver.
//! Those of up to `PACK_MAX` bytes share slots (`KIND_PACKED`): each is an entry after the last,
//! stamped with its number, so a sender that runs ahead puts several in one cache line and a
//! FIFO holds hundreds of them (a root's small broadcasts to ranks that wait for a CPU).
//! Large ones are *pulled*: the sender publishes the address of its buffer and the receiver copies
//! straight out of it, with `process_vm_readv` (CMA) between processes or a plain read between
//! threads; releasing the descriptor's slot tells the sender its buffer is free again. Whether a
//! receiver may pull is published in its segment before any sender can read it (probed at
//! setup, or implied by the permission that links on demand need), so kernels or sandboxes that
//! forbid CMA fall back to the eager path cleanly.
//!
//! A pulled message may also carry the sender's leave to write the reply into its buffer
//! (`Offer::reply_at`: a two-rank all-reduce receives the reduced half exactly where it sent
//! its input from, in place, or at the same place of its receive buffer, out of place). A
//! receiver that folds the message and sends the result straight back writes it there piece
//! by piece (`process_vm_writev`) while the folded bytes are still in its cache, and its later
//! send is a notice without data.

mod link;
mod packed;
mod peer;
mod presence;
mod pull;
mod segment;
mod setup;
#[cfg(test)]
mod tests;

pub(crate) use presence::ShmPresence;
pub(crate) use segment::Segment;
#[cfg(test)]
pub(crate) use setup::connect;
#[cfg(test)]
pub(crate) use setup::DEMAND_FOR_TEST;
pub(crate) use setup::{connect_as, demand_wanted, fetch_segment, serve_segment, ShmWorld};
