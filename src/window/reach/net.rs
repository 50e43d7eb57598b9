//! Memory of a rank on another host reached over TCP: active messages, applied at the target
//! by a thread of the library (`super::super::remote`, which serves them and keeps the
//! connections). Frames go in program order, so a signal is applied after the puts before
//! it, and a flush is answered after everything sent before it was applied.

use super::{Atomic, PeerWindow, Target};
use crate::cuda::Stream;
use crate::error::Result;
use crate::window::remote::{self, Frame};
use crate::window::CommWindows;

/// The part of the window the target knows by handle `id`.
pub(crate) struct Net {
    pub id: u64,
}

impl Net {
    /// Sends `f` (and `payload`) to the target; with `answer`, waits for its reply (read
    /// into `data`) and returns its value.
    fn call(t: &Target, f: &Frame, payload: &[u8], answer: bool, data: &mut [u8]) -> Result<u64> {
        t.cw().net(t.peer)?.call(t.peer, f, payload, answer, data)
    }
}

impl PeerWindow for Net {
    unsafe fn put(
        &self,
        t: &Target,
        off: usize,
        src: *const u8,
        len: usize,
        signal: bool,
        _stream: Option<Stream>,
    ) -> Result<()> {
        // SAFETY: the caller guarantees src holds len bytes.
        let payload = unsafe { std::slice::from_raw_parts(src, len) };
        let f = Frame {
            op: remote::OP_PUT,
            // The target counts the signal once it has the data.
            flags: if signal { remote::FLAG_SIGNAL } else { 0 },
            win: self.id,
            off: off as u64,
            len: len as u64,
            ..Default::default()
        };
        Net::call(t, &f, payload, false, &mut []).map(|_| ())
    }

    unsafe fn get(&self, t: &Target, off: usize, dst: *mut u8, len: usize) -> Result<()> {
        let f = Frame {
            op: remote::OP_GET,
            win: self.id,
            off: off as u64,
            len: len as u64,
            ..Default::default()
        };
        // SAFETY: the caller guarantees dst holds len bytes.
        let out = unsafe { std::slice::from_raw_parts_mut(dst, len) };
        Net::call(t, &f, &[], true, out).map(|_| ())
    }

    fn atomic(&self, t: &Target, off: usize, op: Atomic) -> Result<u64> {
        let (op, a, b) = match op {
            Atomic::FetchAdd(v) => (remote::OP_FETCH_ADD, 0, v),
            Atomic::CompareSwap { expect, new } => (remote::OP_CAS, expect, new),
        };
        let f = Frame {
            op,
            win: self.id,
            off: off as u64,
            a,
            b,
            ..Default::default()
        };
        Net::call(t, &f, &[], true, &mut [])
    }

    fn signal(&self, t: &Target) -> Result<()> {
        signal(t.cw(), t.peer)
    }

    fn set_pad(&self, t: &Target, channel: usize) -> Result<bool> {
        let f = Frame {
            op: remote::OP_PAD_CAS,
            win: self.id,
            off: channel as u64,
            a: 0,
            b: 1,
            ..Default::default()
        };
        Ok(Net::call(t, &f, &[], true, &mut [])? == 0)
    }

    fn flush(&self, t: &Target) -> Result<()> {
        let f = Frame {
            op: remote::OP_FLUSH,
            win: self.id,
            ..Default::default()
        };
        Net::call(t, &f, &[], true, &mut []).map(|_| ())
    }
}

/// One NCCL signal to `peer` over the network, after the frames before it.
pub(in crate::window) fn signal(cw: &CommWindows, peer: usize) -> Result<()> {
    let f = Frame {
        op: remote::OP_SIGNAL,
        ..Default::default()
    };
    cw.net(peer)?
        .call(peer, &f, &[], false, &mut [])
        .map(|_| ())
}
