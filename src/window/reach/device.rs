//! Device memory this process addresses (a peer's GPU memory mapped with CUDA IPC or a VMM
//! descriptor, or a thread's of this process): copies by the driver, on the caller's stream
//! (ncclPutSignal) or complete on return; atomics as a read and a write by the driver under
//! the lock in the owner's control segment.

use super::{locked_atomic, set_pad_mapped, signal_mapped, Atomic, PeerWindow, Target};
use crate::cuda::Stream;
use crate::error::Result;

/// The part at this device address of this process.
pub(crate) struct Device {
    pub base: usize,
}

impl PeerWindow for Device {
    unsafe fn put(
        &self,
        t: &Target,
        off: usize,
        src: *const u8,
        len: usize,
        signal: bool,
        stream: Option<Stream>,
    ) -> Result<()> {
        let dev = t.w.device_of()?;
        let (dst, src) = ((self.base + off) as u64, src as u64);
        if let Some(s) = stream {
            s.copy(dst, src, len)?;
            if signal {
                // Counted once the copy before it on the stream is done.
                crate::window::signals::signal_on(s, t.w.cw.clone(), t.peer)?;
            }
            return Ok(());
        }
        // SAFETY: the destination lies inside the peer's window (checked by the caller),
        // mapped here; the caller guarantees `src` holds `len` bytes.
        unsafe { crate::cuda::copy_sync(dev, dst, src, len) }?;
        if signal {
            self.signal(t)?;
        }
        Ok(())
    }

    unsafe fn get(&self, t: &Target, off: usize, dst: *mut u8, len: usize) -> Result<()> {
        let from = (self.base + off) as u64;
        // SAFETY: the source lies inside the peer's window (checked by the caller), mapped
        // here; the caller guarantees `dst` has room for `len` bytes.
        unsafe { crate::cuda::copy_sync(t.w.device_of()?, dst as u64, from, len) }
    }

    fn atomic(&self, t: &Target, off: usize, op: Atomic) -> Result<u64> {
        let dev = t.w.device_of()?;
        let at = (self.base + off) as u64;
        locked_atomic(
            t,
            off,
            op,
            || {
                let mut old = 0u64;
                // SAFETY: the word lies inside the peer's window (checked by the caller),
                // mapped here, and `old` is 8 bytes of this frame.
                unsafe { crate::cuda::copy_sync(dev, &mut old as *mut u64 as u64, at, 8) }?;
                Ok(old)
            },
            // SAFETY: as above; `v` is 8 bytes of this closure's frame, and the atomics lock
            // keeps other writers of the word out.
            |v| unsafe { crate::cuda::copy_sync(dev, at, &v as *const u64 as u64, 8) },
        )
    }

    fn signal(&self, t: &Target) -> Result<()> {
        signal_mapped(t)
    }

    fn set_pad(&self, t: &Target, channel: usize) -> Result<bool> {
        set_pad_mapped(t, channel)
    }

    fn flush(&self, _: &Target) -> Result<()> {
        // Copies queued on streams are waited for once per window, with the device (see
        // `ops::flush`); the others were done on return.
        Ok(())
    }
}
