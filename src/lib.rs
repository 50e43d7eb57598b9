//! comm: collective communication with the NCCL C ABI, on host and device memory.

pub mod error;
#[macro_use]
pub mod log;
pub mod env;
pub mod wire;

pub mod algo;
pub mod bootstrap;
pub mod comm;
pub mod cuda;
pub mod exec;
mod fault;
pub mod ffi;
pub mod group;
pub mod reduce;
pub mod topo;
pub mod transport;
pub mod window;
