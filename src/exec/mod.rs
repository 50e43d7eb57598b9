//! Executors carry schedules out: `host` with the CPU on host memory.

pub mod host;
