//! Executors carry schedules out: `host` with the CPU on host memory, `device` as a program
//! of stream operations for device memory.

pub(crate) mod anysource;
pub(crate) mod device;
pub(crate) mod host;
pub(crate) mod op;
pub(crate) mod ranges;
pub(crate) mod replies;
