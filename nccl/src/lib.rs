//! libnccl.so.2: comm's C ABI under NVIDIA NCCL's library name.
//!
//! A cdylib exports the `#[no_mangle]` functions of the crates it links, so linking `comm` is
//! all this crate does; `build.rs` gives the library NCCL's SONAME. The C API is include/nccl.h.

// Referenced so that the linker keeps comm's exported functions.
pub use comm::ffi;
