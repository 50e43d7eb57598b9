//! Sharing device allocations between processes, for registered buffers that peers read in
//! place: what a registering rank exports, and the mapping a peer makes of it.
//!
//! Memory from `cuMemAlloc` (and `cudaMalloc`) travels as a legacy IPC handle; memory from
//! `ncclMemAlloc` (VMM) as a POSIX file descriptor the peer duplicates with `pidfd_getfd`.
//! Other VMM memory has no handle this library can hand out: peers that are threads of the same
//! process still read it in place, others get it staged.

use super::{check, cu, Device, PeerMem, VMM};
use crate::error::Result;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// How a peer in another process can map an allocation.
pub(crate) enum Shareable {
    Ipc([u8; 64]),
    Fd(OwnedFd),
}

/// The allocation that holds a registered buffer.
pub(crate) struct Exported {
    pub alloc_base: u64,
    pub alloc_len: usize,
    /// None: only peers in this process can reach it (by address).
    pub how: Option<Shareable>,
}

/// Finds the allocation around device address `ptr` and a handle for it.
pub(crate) fn export(device: &Arc<Device>, ptr: u64) -> Result<Exported> {
    let _b = device.bind()?;
    let vmm = VMM
        .lock()
        .iter()
        .find(|e| ptr >= e.0 && ptr < e.0 + e.2 as u64)
        .copied();
    if let Some((base, handle, size, _)) = vmm {
        let mut fd: i32 = -1;
        // SAFETY: handle is a live allocation made shareable as a POSIX fd; fd is an int
        // out-value as that handle type requires.
        let r = unsafe {
            cu::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut c_void,
                handle,
                cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        let how = check(r, "cuMemExportToShareableHandle")
            .ok()
            // SAFETY: the driver created this descriptor for us; we own it from here.
            .map(|_| Shareable::Fd(unsafe { OwnedFd::from_raw_fd(fd) }));
        return Ok(Exported {
            alloc_base: base,
            alloc_len: size,
            how,
        });
    }
    let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
    check(
        // SAFETY: out-pointers are valid; the driver only inspects the address.
        unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
        "cuMemGetAddressRange",
    )?;
    // SAFETY: CUipcMemHandle is 64 plain bytes.
    let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: base is the start of the allocation holding ptr; h is a valid out-pointer. VMM
    // allocations refuse, which leaves the buffer to same-process peers.
    let how = match unsafe { cu::cuIpcGetMemHandle(&mut h, base) } {
        cu::CUresult::CUDA_SUCCESS => {
            let mut out = [0u8; 64];
            for (o, b) in out.iter_mut().zip(h.reserved.iter()) {
                *o = *b as u8;
            }
            Some(Shareable::Ipc(out))
        }
        r => {
            crate::info!(
                "the allocation at {base:#x} has no IPC handle ({r:?}): only ranks in this process read it in place"
            );
            None
        }
    };
    Ok(Exported {
        alloc_base: base,
        alloc_len: size,
        how,
    })
}

/// A peer's allocation mapped into this process.
pub(crate) enum Imported {
    Ipc(PeerMem),
    Vmm(VmmMapping),
}

impl Imported {
    /// Where the allocation starts here.
    pub(crate) fn base(&self) -> u64 {
        match self {
            Imported::Ipc(m) => m.ptr,
            Imported::Vmm(m) => m.ptr,
        }
    }
}

/// Maps an allocation exported with a legacy IPC handle.
pub(crate) fn import_ipc(device: &Arc<Device>, handle: &[u8; 64]) -> Result<Imported> {
    PeerMem::open(device, handle).map(Imported::Ipc)
}

/// A VMM allocation imported from a file descriptor and mapped for this device.
pub(crate) struct VmmMapping {
    ptr: u64,
    len: usize,
    handle: cu::CUmemGenericAllocationHandle,
    device: Arc<Device>,
}

/// Maps `len` bytes of the VMM allocation behind `fd` (a descriptor of this process).
pub(crate) fn import_fd(device: &Arc<Device>, fd: &OwnedFd, len: usize) -> Result<Imported> {
    let _b = device.bind()?;
    let mut handle: cu::CUmemGenericAllocationHandle = 0;
    check(
        // SAFETY: a POSIX fd handle is passed as the descriptor's value in the pointer argument.
        unsafe {
            cu::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        },
        "cuMemImportFromShareableHandle",
    )?;
    // The exporter's size is a multiple of its granularity, which the mapping requires.
    let ptr = super::map_allocation(handle, len, 0, &[device.ordinal])?;
    Ok(Imported::Vmm(VmmMapping {
        ptr,
        len,
        handle,
        device: device.clone(),
    }))
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        if let Ok(_b) = self.device.bind() {
            // SAFETY: made by import_fd, released once, in reverse order.
            unsafe {
                cu::cuMemUnmap(self.ptr, self.len);
                cu::cuMemAddressFree(self.ptr, self.len);
                cu::cuMemRelease(self.handle);
            }
        }
    }
}
