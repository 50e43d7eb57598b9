//! Memory of a rank on another host, where the communicator's network transport is
//! InfiniBand: RDMA writes, reads and verbs atomics on the windows' own queue pairs
//! (`transport::net::ib::onesided`). A signal is a zero-byte write with immediate on the same
//! queue pair as the puts before it, so RC places their data first; the target's completion
//! handler counts it. Device memory, the part's or a local buffer's, is reached through a
//! dmabuf (GPUDirect RDMA, `super::super::gdr`) or refused.

use super::{Atomic, PeerWindow, Target};
use crate::cuda::{Device, MemKind, Stream};
use crate::error::Result;
use crate::transport::net::ib::onesided;
use crate::transport::net::ib::verbs::Remote;
use crate::window::gdr;

/// The part at `addr` of the target's process, registered with `rkey`.
pub(crate) struct Rdma {
    pub addr: usize,
    pub rkey: u32,
}

impl Rdma {
    fn at(&self, off: usize) -> Remote {
        Remote {
            addr: (self.addr + off) as u64,
            rkey: self.rkey,
        }
    }
}

impl PeerWindow for Rdma {
    unsafe fn put(
        &self,
        t: &Target,
        off: usize,
        src: *const u8,
        len: usize,
        signal: bool,
        stream: Option<Stream>,
    ) -> Result<()> {
        let (cw, peer) = (t.cw(), t.peer);
        let r = cw.rdma(peer)?;
        let from_device = stream.zip(match crate::cuda::classify(src.cast()) {
            MemKind::Device(o) => Some(o),
            MemKind::Host => None,
        });
        if let Some((s, o)) = from_device {
            // A device-memory source (GPUDirect RDMA) written by work queued on the stream:
            // the HCA reads it once that is done, the caller waiting meanwhile, as
            // collectives on device buffers across hosts do.
            if s.capturing() {
                return crate::invalid_usage!(
                    "a put from device memory to rank {peer} on another host waits for its stream, which a CUDA graph capture cannot record; issue it outside the capture"
                );
            }
            let dev = Device::get(o)?;
            let _bound = dev.bind()?;
            s.synchronize()?;
        }
        let lkey = gdr::local_key(&r.qps, src as usize, len, "localbuff")?;
        // SAFETY: the caller guarantees src holds len bytes.
        unsafe { r.qps.put(peer, src, len, self.at(off), lkey, cw.deadline()) }?;
        if signal {
            // On the same queue pair: counted at the target after the data landed.
            self.signal(t)?;
        }
        Ok(())
    }

    unsafe fn get(&self, t: &Target, off: usize, dst: *mut u8, len: usize) -> Result<()> {
        let (cw, peer) = (t.cw(), t.peer);
        let r = cw.rdma(peer)?;
        let lkey = gdr::local_key(&r.qps, dst as usize, len, "localbuff")?;
        // SAFETY: the caller guarantees dst holds len bytes.
        unsafe { r.qps.get(peer, dst, len, self.at(off), lkey, cw.deadline()) }
    }

    fn atomic(&self, t: &Target, off: usize, op: Atomic) -> Result<u64> {
        let r = t.cw().rdma(t.peer)?;
        let (cas, val) = match op {
            Atomic::FetchAdd(v) => (None, v),
            Atomic::CompareSwap { expect, new } => (Some(expect), new),
        };
        r.qps
            .atomic(t.peer, self.at(off), cas, val, t.stop.deadline)
    }

    fn signal(&self, t: &Target) -> Result<()> {
        signal(t.cw(), t.peer)
    }

    fn set_pad(&self, t: &Target, channel: usize) -> Result<bool> {
        let (cw, peer) = (t.cw(), t.peer);
        let r = cw.rdma(peer)?;
        let ctl = r.ctls[peer];
        let pad = Remote {
            addr: ctl.addr + cw.own().pad_offset(t.part().slot, channel, cw.rank) as u64,
            rkey: ctl.rkey,
        };
        r.qps.set_pad(peer, pad, t.stop.deadline)
    }

    fn flush(&self, t: &Target) -> Result<()> {
        let r = t.cw().rdma(t.peer)?;
        // Any 8 bytes of the peer serve the read that ends the flush: its control segment.
        r.qps.flush(t.peer, r.ctls[t.peer], t.stop.deadline)
    }
}

/// One NCCL signal to `peer` over RDMA, on the queue pair of the puts before it.
pub(in crate::window) fn signal(cw: &crate::window::CommWindows, peer: usize) -> Result<()> {
    let r = cw.rdma(peer)?;
    r.qps
        .notify(peer, onesided::IMM_SIGNAL, r.ctls[peer], cw.deadline())
}
