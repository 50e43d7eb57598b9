//! Host memory the library allocates for windows: each allocation is a memfd mapped shared, so
//! that the peers on this host can map it too and reach it with plain loads, stores and atomics.

use crate::error::Result;
use crate::sys::{self, Mapping};
use crate::units::whole_units;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::LazyLock;

struct Alloc {
    fd: OwnedFd,
    map: Mapping,
}

/// Live allocations by base address.
static ALLOCS: LazyLock<Mutex<BTreeMap<usize, Alloc>>> =
    LazyLock::new(|| Mutex::new(BTreeMap::new()));

/// `size` bytes (rounded up to whole pages; at least one), zero-filled, page aligned.
pub(crate) fn alloc(size: usize) -> Result<*mut u8> {
    let len = whole_units(size, 4096)?;
    let fd = sys::memfd("comm-window", len)?;
    let map = Mapping::map(fd.as_raw_fd(), len)?;
    let ptr = map.ptr();
    ALLOCS.lock().insert(ptr as usize, Alloc { fd, map });
    Ok(ptr)
}

/// Frees an allocation made by [`alloc`]; false when `ptr` is not the start of one.
pub(crate) fn free(ptr: *mut u8) -> bool {
    ALLOCS.lock().remove(&(ptr as usize)).is_some()
}

/// The allocation that holds all of `[ptr, ptr+len)`: a duplicate of its descriptor, the
/// allocation's length, and the offset of `ptr` in it.
pub(crate) fn find(ptr: usize, len: usize) -> Option<(OwnedFd, usize, usize)> {
    let allocs = ALLOCS.lock();
    let (&base, a) = allocs.range(..=ptr).next_back()?;
    let end = base + a.map.len();
    if ptr + len > end {
        return None;
    }
    let fd = sys::dup(a.fd.as_raw_fd()).ok()?;
    Some((fd, a.map.len(), ptr - base))
}
