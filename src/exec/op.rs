//! The operation model shared by the executors, the device compiler and the communicator:
//! one operation of one communicator with its buffers and reduction, and the wait limit.

use crate::algo::Schedule;
use crate::reduce::{Reducer, Scale};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How a reducing operation combines values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reduction {
    pub reducer: Reducer,
    /// Applied once to this rank's own input (PreMulSum's scalar, 1/n for a float average).
    pub input_scale: Option<Scale>,
    /// Device calls only: the input's multiplier is read from this device address when the
    /// kernels run (a PreMulSum scalar in device memory, ncclScalarDevice).
    pub input_scale_at: Option<u64>,
    /// Final values are divided by this (an integer average).
    pub divide_by: Option<usize>,
}

/// One operation of one communicator, with its buffers.
pub(crate) struct HostOp {
    pub schedule: Arc<Schedule>,
    pub send: *const u8,
    pub recv: *mut u8,
    pub tag: u64,
    pub reduction: Option<Reduction>,
}

/// How long a wait may last without progress (`Wiring::timeout`): COMM_TIMEOUT when the
/// communicator was made, changed later by commSetTimeout (the torch backend sets a group's
/// timeout with it). Nanoseconds; 0 for no limit.
#[derive(Debug, Default)]
pub(crate) struct Limit(AtomicU64);

impl Limit {
    pub(crate) fn new(limit: Option<Duration>) -> Limit {
        let l = Limit::default();
        l.set(limit);
        l
    }

    pub(crate) fn get(&self) -> Option<Duration> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }

    pub(crate) fn set(&self, limit: Option<Duration>) {
        let n = limit.map_or(0, |d| d.as_nanos().clamp(1, u64::MAX as u128) as u64);
        self.0.store(n, Ordering::Relaxed);
    }
}
