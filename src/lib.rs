//! comm: collective communication with the NCCL C ABI, on host and device memory.
//!
//! The library's interface is its C ABI (`ffi`, from which cbindgen writes include/nccl.h);
//! every other module is internal to the crate. `error` is public because `ffi` results and the
//! InfiniBand verbs interface speak it, and `testing` re-exports the few internals the
//! integration tests and the GPU suite drive directly.

// An item marked `pub` that the crate root does not export is a mistake: it hides dead code
// from the compiler and, for a constant, leaks into the generated C header.
#![warn(unreachable_pub)]

pub mod error;
#[macro_use]
pub(crate) mod log;
pub(crate) mod env;
pub(crate) mod tag;
pub(crate) mod wire;

pub(crate) mod algo;
pub(crate) mod bootstrap;
pub(crate) mod comm;
pub(crate) mod cuda;
pub(crate) mod exec;
mod fault;
pub mod ffi;
pub(crate) mod group;
pub(crate) mod reduce;
pub(crate) mod sys;
pub(crate) mod topo;
pub(crate) mod transport;
pub(crate) mod units;
pub(crate) mod version;
pub(crate) mod wait;
pub(crate) mod window;

#[doc(hidden)]
pub mod testing;
