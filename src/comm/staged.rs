//! Device buffers on a communicator whose ranks span hosts. Device programs reach only the peers
//! whose GPU memory they can map (`transport::p2p`), so calls on device buffers of such a
//! communicator go through host memory instead, as a proxy would: the calls' streams are
//! drained, the inputs copied to host buffers, the host executor runs the calls over the
//! communicator's links (shared memory inside a host, the network between hosts), and the
//! results are copied back before the call returns. The calling thread blocks for the whole
//! call, and such calls cannot be captured into a CUDA graph (refused with a message).
//!
//! This path has not run on a GPU: no machine this was written on had one.

use super::ops::{Call, OpChoice, ScalarSrc};
use super::Comm;
use crate::cuda::{Device, Stream};
use crate::error::Result;
use crate::reduce::Scale;
use std::sync::Arc;

/// One call's host copy: the bytes from `dev` (the lowest device address the call touches)
/// to `dev + host.len()`, to be written back from `back` on.
struct Copy {
    host: Vec<u8>,
    dev: u64,
    /// Offset and length, in `host`, of what the call writes (its receive buffer).
    back: (usize, usize),
}

/// Calls moved to host memory, and what to copy back once they ran.
pub(crate) struct Staged {
    device: Arc<Device>,
    copies: Vec<Copy>,
    /// The calls, rewritten to the host copies.
    pub calls: Vec<Call>,
}

impl Staged {
    /// Drains the calls' streams and copies their inputs (and their receive buffers, whose
    /// bytes the call may leave alone) to host memory.
    pub(crate) fn take(comm: &Comm, calls: &[Call]) -> Result<Staged> {
        let world = comm.device.as_ref().ok_or_else(|| {
            crate::error::Error::new(
                crate::error::ErrorKind::Internal,
                "device call without a device path",
            )
        })?;
        let device = world.device.clone();
        let _bound = device.bind()?;
        let mut streams: Vec<Stream> = Vec::new();
        for c in calls {
            let s = Stream(c.stream as *mut std::ffi::c_void);
            if s.capturing() {
                return crate::invalid_usage!(
                    "{} on device buffers is being captured into a CUDA graph, but this communicator spans hosts, where device buffers are staged through host memory by the calling thread; run it outside the capture",
                    c.coll.name()
                );
            }
            if !streams.contains(&s) {
                streams.push(s);
            }
        }
        for s in &streams {
            s.synchronize()?;
        }
        let mut copies = Vec::with_capacity(calls.len());
        let mut host_calls = Vec::with_capacity(calls.len());
        for call in calls {
            let op = comm.build(call, 0)?;
            let (s, sb) = (call.send as u64, op.schedule.send_extent as u64);
            let (r, rb) = (call.recv as u64, op.schedule.recv_extent as u64);
            let mut hosts: Vec<(u64, Vec<u8>)> = Vec::new();
            for (a, b) in host_ranges(s, sb, r, rb) {
                let mut h = vec![0u8; (b - a) as usize];
                // SAFETY: `[a, b)` lies within the call's device buffers (`host_ranges`),
                // which the caller keeps valid for the call, after its streams synchronised.
                unsafe { crate::cuda::copy_from_device(&device, &mut h, a) }?;
                hosts.push((a, h));
            }
            // Where a non-empty device buffer starting at `addr` is in the host copies.
            let at = |hosts: &mut Vec<(u64, Vec<u8>)>, addr: u64| -> *mut u8 {
                for (base, h) in hosts.iter_mut() {
                    if addr >= *base && addr < *base + h.len() as u64 {
                        // SAFETY: `addr - base` is within the host copy.
                        return unsafe { h.as_mut_ptr().add((addr - *base) as usize) };
                    }
                }
                std::ptr::null_mut()
            };
            let mut host_call = call.clone();
            host_call.device = false;
            host_call.send = if sb > 0 { at(&mut hosts, s) } else { call.send };
            host_call.recv = if rb > 0 { at(&mut hosts, r) } else { call.recv };
            if let Some(OpChoice::PreMulSum(ScalarSrc::Pointer(p))) = call.op {
                let mut b = [0u8; 8];
                let n = call.dtype.size();
                // SAFETY: a device scalar of PreMulSum is one element of the call's datatype,
                // which the caller keeps valid for the call.
                unsafe { crate::cuda::copy_from_device(&device, &mut b[..n], p as u64) }?;
                host_call.op = Some(OpChoice::PreMulSum(ScalarSrc::Value(Scale::from_bytes(
                    call.dtype,
                    &b[..n],
                ))));
            }
            host_calls.push(host_call);
            if rb > 0 {
                let (base, h) = hosts.pop().expect("the receive buffer has a copy");
                copies.push(Copy {
                    back: ((r - base) as usize, rb as usize),
                    host: h,
                    dev: base,
                });
            }
            // A send-only copy has nothing to write back but must live until the call ran.
            for (base, h) in hosts {
                copies.push(Copy {
                    host: h,
                    dev: base,
                    back: (0, 0),
                });
            }
        }
        Ok(Staged {
            device,
            copies,
            calls: host_calls,
        })
    }

    /// Copies the results back to the device buffers.
    pub(crate) fn put_back(self) -> Result<()> {
        let _bound = self.device.bind()?;
        for c in &self.copies {
            let (off, len) = c.back;
            if len > 0 {
                // SAFETY: `c.dev + off .. + len` is the receive buffer's range in the device
                // copy it was taken from (`stage`), valid for the call.
                unsafe {
                    crate::cuda::copy_to_device(
                        &self.device,
                        c.dev + off as u64,
                        &c.host[off..off + len],
                    )
                }?;
            }
        }
        Ok(())
    }
}

/// The device ranges `[start, end)` a call with `sb` bytes to send at `s` and `rb` to receive
/// at `r` needs copied to host memory: one where the buffers overlap (in place; the host copy
/// keeps them the same distance apart), else one per non-empty buffer, the receive buffer's
/// last.
fn host_ranges(s: u64, sb: u64, r: u64, rb: u64) -> Vec<(u64, u64)> {
    let overlap = sb > 0 && rb > 0 && s < r + rb && r < s + sb;
    if overlap {
        vec![(s.min(r), (s + sb).max(r + rb))]
    } else {
        [(s, sb), (r, rb)]
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .map(|(a, len)| (a, a + len))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::host_ranges;

    #[test]
    fn host_copies_cover_each_buffer_once() {
        // Separate buffers: two copies, the receive buffer's last.
        assert_eq!(
            host_ranges(1000, 64, 5000, 256),
            vec![(1000, 1064), (5000, 5256)]
        );
        // In-place all-reduce, and an in-place all-gather (rank 2's input inside the output).
        assert_eq!(host_ranges(1000, 64, 1000, 64), vec![(1000, 1064)]);
        assert_eq!(host_ranges(1128, 64, 1000, 256), vec![(1000, 1256)]);
        // A reduce-scatter's output inside its input.
        assert_eq!(host_ranges(1000, 256, 1064, 64), vec![(1000, 1256)]);
        // A gather's non-root (nothing received), a scatter's non-root (nothing sent), nothing.
        assert_eq!(host_ranges(1000, 64, 1000, 0), vec![(1000, 1064)]);
        assert_eq!(host_ranges(1000, 0, 1000, 64), vec![(1000, 1064)]);
        assert!(host_ranges(1000, 0, 2000, 0).is_empty());
        // Adjacent but not overlapping: two copies.
        assert_eq!(
            host_ranges(1000, 64, 1064, 64),
            vec![(1000, 1064), (1064, 1128)]
        );
    }
}
