//! A part mapped here: this rank's own, a thread's of this process, or library memory that
//! every rank on the host maps. Puts and gets are loads and stores; atomics are the CPU's,
//! or, on memory a peer cannot map (its own ordinary memory, which other processes reach
//! with CMA), taken under the lock in the owner's control segment that those peers take too.

use super::{locked_atomic, set_pad_mapped, signal_mapped, Atomic, PeerWindow, Target};
use crate::cuda::Stream;
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering};

/// The part at this address of this process.
pub(crate) struct Direct(pub usize);

impl PeerWindow for Direct {
    #[inline]
    unsafe fn put(
        &self,
        t: &Target,
        off: usize,
        src: *const u8,
        len: usize,
        signal: bool,
        _stream: Option<Stream>,
    ) -> Result<()> {
        // SAFETY: the destination lies inside the peer's registered part (checked by the
        // caller), mapped here; the caller guarantees src holds len bytes.
        unsafe { store_direct((self.0 + off) as *mut u8, src, len) };
        if signal {
            self.signal(t)?;
        }
        Ok(())
    }

    unsafe fn get(&self, _: &Target, off: usize, dst: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the source lies inside the peer's part; the caller guarantees dst holds
        // len bytes.
        unsafe { std::ptr::copy((self.0 + off) as *const u8, dst, len) };
        Ok(())
    }

    fn atomic(&self, t: &Target, off: usize, op: Atomic) -> Result<u64> {
        // SAFETY: the word lies inside the part (checked by the caller), is 8-byte aligned
        // (checked too) and is only ever accessed atomically by the library.
        let a = unsafe { &*((self.0 + off) as *const AtomicU64) };
        if t.part().locked {
            return locked_atomic(
                t,
                off,
                op,
                || Ok(a.load(Ordering::SeqCst)),
                |v| {
                    a.store(v, Ordering::SeqCst);
                    Ok(())
                },
            );
        }
        t.check_alive()?;
        Ok(match op {
            Atomic::CompareSwap { expect, new } => {
                match a.compare_exchange(expect, new, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }
            Atomic::FetchAdd(v) => a.fetch_add(v, Ordering::SeqCst),
        })
    }

    #[inline]
    fn signal(&self, t: &Target) -> Result<()> {
        signal_mapped(t)
    }

    fn set_pad(&self, t: &Target, channel: usize) -> Result<bool> {
        set_pad_mapped(t, channel)
    }

    fn flush(&self, _: &Target) -> Result<()> {
        // Stores into a mapping are in place once made.
        Ok(())
    }
}

/// A put's bytes into a part mapped here. `src` and `dst` may overlap when a rank puts into its
/// own window (a word is read whole before it is written). One word, the common signal
/// payload, goes without a call to memmove.
///
/// # Safety
/// `dst` valid for `len` bytes of writes, `src` for `len` bytes of reads.
#[inline]
pub(in crate::window) unsafe fn store_direct(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: as this function's.
    unsafe {
        if len == 8 {
            dst.cast::<u64>()
                .write_unaligned(src.cast::<u64>().read_unaligned());
        } else if len > 0 {
            std::ptr::copy(src, dst, len);
        }
    }
}
