//! The CUDA layer. This build has no device path yet: every query answers "no GPU", and the
//! library treats every buffer as host memory.

pub mod kernels;

/// The CUDA device of the calling thread, or -1 without one.
pub fn current_device() -> i32 {
    -1
}

/// How many CUDA devices this process can use.
pub fn device_count() -> i32 {
    0
}
