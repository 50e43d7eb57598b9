//! Ordinary memory of another process on this host, which this process cannot map: puts and
//! gets with a single copy by the kernel (`process_vm_writev` / `readv`), atomics as a read
//! and a write under the lock in the owner's control segment.

use super::{locked_atomic, set_pad_mapped, signal_mapped, Atomic, PeerWindow, Target};
use crate::cuda::Stream;
use crate::error::{Error, ErrorKind, Result};
use crate::sys;

/// The part at `addr` of process `pid`.
pub(crate) struct Cma {
    pub pid: u32,
    pub addr: usize,
}

impl PeerWindow for Cma {
    unsafe fn put(
        &self,
        t: &Target,
        off: usize,
        src: *const u8,
        len: usize,
        signal: bool,
        _stream: Option<Stream>,
    ) -> Result<()> {
        if len > 0 {
            // SAFETY: the caller guarantees src holds len bytes.
            unsafe { sys::cma_write(self.pid, src, self.addr + off, len) }
                .map_err(|e| cma_error(t.peer, "writing into", e))?;
        }
        if signal {
            self.signal(t)?;
        }
        Ok(())
    }

    unsafe fn get(&self, t: &Target, off: usize, dst: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees dst holds len bytes.
        unsafe { sys::cma_read(self.pid, dst, self.addr + off, len) }
            .map_err(|e| cma_error(t.peer, "reading from", e))
    }

    fn atomic(&self, t: &Target, off: usize, op: Atomic) -> Result<u64> {
        let at = self.addr + off;
        let fail = |e| cma_error(t.peer, "an atomic on", e);
        locked_atomic(
            t,
            off,
            op,
            || {
                let mut old = [0u8; 8];
                // SAFETY: old is 8 writable bytes.
                unsafe { sys::cma_read(self.pid, old.as_mut_ptr(), at, 8) }.map_err(fail)?;
                Ok(u64::from_ne_bytes(old))
            },
            |v| {
                // SAFETY: v is 8 readable bytes.
                unsafe { sys::cma_write(self.pid, v.to_ne_bytes().as_ptr(), at, 8) }.map_err(fail)
            },
        )
    }

    fn signal(&self, t: &Target) -> Result<()> {
        signal_mapped(t)
    }

    fn set_pad(&self, t: &Target, channel: usize) -> Result<bool> {
        set_pad_mapped(t, channel)
    }

    fn flush(&self, _: &Target) -> Result<()> {
        // The kernel's copy is done when the call returns.
        Ok(())
    }
}

/// A failed single copy: the peer's process is gone (ncclRemoteError) or the kernel refused.
pub(in crate::window) fn cma_error(peer: usize, what: &str, e: std::io::Error) -> Error {
    let kind = if e.raw_os_error() == Some(libc::ESRCH) {
        ErrorKind::Remote
    } else {
        ErrorKind::System
    };
    Error::new(kind, format!("{what} rank {peer}'s window: {e}"))
}
