//! GPUDirect RDMA for windows: device memory that ranks on other hosts reach through the
//! InfiniBand device. A window part in device memory is registered through a dmabuf the CUDA
//! driver exports (`cuda::dmabuf`), so that peers' RDMA writes, reads and atomics land in GPU
//! memory without the CPU; a local buffer of a put or get in device memory is registered the
//! same way (`OneSided::device_lkey`). Where that is unavailable (no `ibv_reg_dmabuf_mr`, a
//! device or kernel without dmabuf, a driver that cannot export) the call fails saying why:
//! nothing is staged through host memory behind the caller's back.
//!
//! Tests have no GPU: `stand_in` declares a range of host memory to be reached by the HCA only
//! through a dmabuf (a memfd standing in for a GPU's export), which then takes exactly the
//! registration path device memory takes. The CPU may still read it, which the tests use to
//! check the bytes.

use crate::cuda::dmabuf::{self, Dmabuf};
use crate::cuda::{Device, MemKind};
use crate::error::Result;
use crate::sys;
use crate::transport::net::ib::onesided::{Allocation, OneSided};
use crate::transport::net::ib::verbs::Source;
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// Host memory a test declared to be reached through a dmabuf.
struct StandIn {
    start: usize,
    len: usize,
    fd: OwnedFd,
    offset: u64,
    ident: u64,
}

static STAND_INS: Mutex<Vec<StandIn>> = Mutex::new(Vec::new());
static NEXT_IDENT: AtomicU64 = AtomicU64::new(1);

/// Declares `len` bytes at `addr` to be memory the InfiniBand device reaches only through the
/// dmabuf `fd` from `offset` (which must hold the same pages), as it reaches device memory.
#[doc(hidden)]
pub fn stand_in(addr: *mut u8, len: usize, fd: BorrowedFd<'_>, offset: u64) -> Result<()> {
    let fd = sys::dup(fd.as_raw_fd())?;
    STAND_INS.lock().push(StandIn {
        start: addr as usize,
        len,
        fd,
        offset,
        ident: NEXT_IDENT.fetch_add(1, Ordering::Relaxed),
    });
    Ok(())
}

/// Undoes `stand_in` for the range at `addr`.
#[doc(hidden)]
pub fn forget_stand_in(addr: *mut u8) {
    STAND_INS.lock().retain(|s| s.start != addr as usize);
}

/// The stand-in covering `len` bytes at `addr`: a dmabuf of those bytes, and its allocation.
fn stand_in_at(addr: usize, len: usize) -> Option<Result<(Dmabuf, Allocation)>> {
    let all = STAND_INS.lock();
    let s = all
        .iter()
        .find(|s| s.start <= addr && addr + len <= s.start + s.len)?;
    Some(sys::dup(s.fd.as_raw_fd()).map(|fd| {
        (
            Dmabuf {
                fd,
                offset: s.offset + (addr - s.start) as u64,
                iova: addr as u64,
            },
            Allocation {
                start: s.start as u64,
                len: s.len,
                ident: s.ident,
            },
        )
    }))
}

/// What the InfiniBand device registers for a window part of `len` bytes at `addr`: the
/// address of host memory; a dmabuf of device memory, which `register` takes and then drops
/// (the registration keeps the pages).
pub(super) enum PartSource {
    Host(*mut u8),
    Dmabuf(Dmabuf),
}

impl PartSource {
    pub(super) fn of(addr: usize, len: usize) -> Result<PartSource> {
        if len == 0 {
            return Ok(PartSource::Host(addr as *mut u8));
        }
        if let Some(s) = stand_in_at(addr, len) {
            return s.map(|(d, _)| PartSource::Dmabuf(d));
        }
        match crate::cuda::classify(addr as *const std::ffi::c_void) {
            MemKind::Host => Ok(PartSource::Host(addr as *mut u8)),
            MemKind::Device(o) => {
                let dev = Device::get(o)?;
                let d = dmabuf::export(&dev, addr as u64, len).map_err(|e| {
                    e.context(format!(
                        "the window part is memory of GPU {o}, which ranks on other hosts reach only by GPUDirect RDMA, and the CUDA driver could not export it as a dmabuf"
                    ))
                })?;
                Ok(PartSource::Dmabuf(d))
            }
        }
    }

    pub(super) fn source(&self) -> Source {
        match self {
            PartSource::Host(p) => Source::Host(*p),
            PartSource::Dmabuf(d) => Source::Dmabuf {
                fd: d.fd.as_raw_fd(),
                offset: d.offset,
                iova: d.iova,
            },
        }
    }

    pub(super) fn is_device(&self) -> bool {
        matches!(self, PartSource::Dmabuf(_))
    }
}

/// The local key of a put's or get's buffer (`name`) of `len` bytes at `addr` where it is
/// device memory (or a stand-in), registered through a dmabuf of its allocation; None for host
/// memory, which the transport copies or finds registered.
pub(super) fn local_key(
    qps: &OneSided,
    addr: usize,
    len: usize,
    name: &str,
) -> Result<Option<u32>> {
    if let Some(s) = stand_in_at(addr, len.max(1)) {
        let (d, alloc) = s?;
        let offset = d.offset - (addr as u64 - alloc.start);
        return qps
            .device_lkey(addr as u64, len, alloc, || Ok((d.fd, offset)))
            .map(Some)
            .map_err(|e| e.context(format!("{name} is memory the HCA reaches through a dmabuf")));
    }
    let MemKind::Device(o) = crate::cuda::classify(addr as *const std::ffi::c_void) else {
        return Ok(None);
    };
    let why = |e: crate::error::Error| {
        e.context(format!(
            "{name} is memory of GPU {o}, which the InfiniBand device reaches only by GPUDirect RDMA (a dmabuf registration); use a host buffer where that is unavailable"
        ))
    };
    let (start, alen, ident) = dmabuf::allocation(addr as u64).map_err(why)?;
    let alloc = Allocation {
        start,
        len: alen,
        ident,
    };
    qps.device_lkey(addr as u64, len, alloc, || {
        let dev = Device::get(o)?;
        let d = dmabuf::export(&dev, start, alen)?;
        Ok((d.fd, d.offset))
    })
    .map(Some)
    .map_err(why)
}
