//! Executors carry schedules out: `host` with the CPU on host memory, `device` as a program
//! of stream operations for device memory.

pub mod anysource;
pub mod device;
pub mod host;
