//! GPUDirect RDMA: device memory exported as a dmabuf, which the InfiniBand device registers
//! (`ibv_reg_dmabuf_mr`) so that its reads, writes and atomics reach GPU memory without the CPU.
//!
//! `cuMemGetHandleForAddressRange` (CUDA 11.7 and later) exports a range that must start and
//! end on host-page boundaries; the range is widened to pages here and the buffer's offset in
//! it carried along, for the registration. The GPU and its kernel driver must support dmabuf
//! (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: the open kernel module, Linux 5.12 or later).
//!
//! **Compiled only**: written on a machine without a GPU; see the README for what a first run
//! on a GPU with an RDMA device must check.

use super::{check, cu, driver, Device};
use crate::error::{Error, ErrorKind, Result};
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};

/// A device range exported as a dmabuf: bytes from `offset` of `fd` are those at device
/// address `iova`. The registration keeps the pages: drop it (closing `fd`) once
/// registered.
pub(crate) struct Dmabuf {
    pub fd: OwnedFd,
    pub offset: u64,
    pub iova: u64,
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// The page-aligned range around `len` bytes at `ptr`: its start and length.
fn pages_around(ptr: u64, len: usize, page: u64) -> (u64, usize) {
    let start = ptr / page * page;
    let end = (ptr + len.max(1) as u64).div_ceil(page) * page;
    (start, (end - start) as usize)
}

/// Exports `len` bytes of `device`'s memory at `ptr` as a dmabuf.
pub(crate) fn export(device: &Device, ptr: u64, len: usize) -> Result<Dmabuf> {
    if driver().is_none() {
        return crate::invalid_usage!("exporting device memory as a dmabuf needs a CUDA driver");
    }
    let _bound = device.bind()?;
    let mut dev: cu::CUdevice = 0;
    check(
        // SAFETY: the ordinal names an existing device (Device::get checked it).
        unsafe { cu::cuDeviceGet(&mut dev, device.ordinal) },
        "cuDeviceGet",
    )?;
    let mut supported = 0;
    // SAFETY: a valid out-pointer and device.
    let r = unsafe {
        cu::cuDeviceGetAttribute(
            &mut supported,
            cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            dev,
        )
    };
    if r != cu::CUresult::CUDA_SUCCESS || supported == 0 {
        return Err(Error::new(
            ErrorKind::InvalidUsage,
            format!(
                "GPU {} cannot export its memory as a dmabuf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is {}): GPUDirect RDMA through dmabuf needs CUDA 11.7 or later, NVIDIA's open kernel module and Linux 5.12 or later",
                device.ordinal,
                if r == cu::CUresult::CUDA_SUCCESS { "0".to_string() } else { format!("unknown, {r:?}") }
            ),
        ));
    }
    let (start, span) = pages_around(ptr, len, page_size());
    let mut fd: i32 = -1;
    // cudarc panics where the driver lacks the function (older than CUDA 11.7).
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: fd is an int out-value, as the dmabuf handle type requires; the driver
        // checks that the range is device memory of the current context.
        unsafe {
            cu::cuMemGetHandleForAddressRange(
                &mut fd as *mut i32 as *mut c_void,
                start,
                span,
                cu::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
    }))
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidUsage,
            "this CUDA driver has no cuMemGetHandleForAddressRange (CUDA 11.7 or later exports device memory as a dmabuf)",
        )
    })?;
    check(
        r,
        "cuMemGetHandleForAddressRange (exporting device memory as a dmabuf)",
    )
    .map_err(|e| {
        e.context(format!(
            "{span} bytes at {start:#x} of GPU {} (around {len} bytes at {ptr:#x})",
            device.ordinal
        ))
    })?;
    if fd < 0 {
        return crate::internal_err!("cuMemGetHandleForAddressRange returned no descriptor");
    }
    Ok(Dmabuf {
        // SAFETY: the driver made this descriptor for us; we own it from here.
        fd: unsafe { OwnedFd::from_raw_fd(fd) },
        offset: ptr - start,
        iova: ptr,
    })
}

/// The allocation that holds device address `ptr`: its start, its length, and the driver's
/// number for it, never reused within the process (so a registration of a freed allocation
/// is told apart from one of a new allocation at the same address).
pub(crate) fn allocation(ptr: u64) -> Result<(u64, usize, u64)> {
    if driver().is_none() {
        return crate::invalid_usage!("device memory needs a CUDA driver");
    }
    let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
    check(
        // SAFETY: out-pointers are valid; the driver only inspects the address.
        unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
        "cuMemGetAddressRange",
    )?;
    let mut id: u64 = 0;
    check(
        // SAFETY: BUFFER_ID is an unsigned long long out-value.
        unsafe {
            cu::cuPointerGetAttribute(
                &mut id as *mut u64 as *mut c_void,
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr,
            )
        },
        "cuPointerGetAttribute(BUFFER_ID)",
    )?;
    Ok((base, size, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_widen_to_whole_pages() {
        assert_eq!(pages_around(0x1000, 0x1000, 0x1000), (0x1000, 0x1000));
        assert_eq!(pages_around(0x1010, 0x10, 0x1000), (0x1000, 0x1000));
        assert_eq!(pages_around(0x1ff0, 0x20, 0x1000), (0x1000, 0x2000));
        assert_eq!(pages_around(0x3000, 0, 0x1000), (0x3000, 0x1000));
    }

    #[test]
    fn without_a_driver_a_lookup_says_why() {
        if super::super::device_count() > 0 {
            return;
        }
        let e = allocation(0x1000).expect_err("no driver");
        assert!(e.msg.contains("CUDA driver"), "{}", e.msg);
    }
}
