//! The receive sink: where a link puts the bytes of a receive step (copied, folded with a
//! local operand, forwarded or returned).

use super::plan::Src;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::op::Reduction;
use crate::reduce::{Reducer, Scale};
use crate::transport::{Reply, Sink};

pub(super) struct RecvSink {
    pub(super) dst: *mut u8,
    pub(super) len: usize,
    pub(super) with: Option<Src>,
    pub(super) reduction: Option<Reduction>,
    pub(super) last: bool,
    /// The combined bytes go back to the sender unchanged next (`Sink::reply`).
    pub(super) returns: bool,
    /// ... as the very next message to that peer (`Reply::next`).
    pub(super) forwards: bool,
    /// ... and should go that way rather than be written back (`Reply::forward_first`).
    pub(super) forward_first: bool,
    /// The operation's output is too large to stay in cache: bytes that are not read again
    /// during the run are written with non-temporal stores (`stream_copy`).
    pub(super) stream: bool,
}

impl Sink for RecvSink {
    fn direct(&mut self) -> Option<*mut u8> {
        self.with.is_none().then_some(self.dst)
    }

    fn put(&mut self, offset: usize, data: &[u8], scale: Option<Scale>) -> Result<()> {
        if offset + data.len() > self.len {
            return crate::internal_err!("message piece beyond the receive region");
        }
        // SAFETY: dst (and with) cover `len` bytes; this piece lies inside; `data` is the
        // transport's buffer or the sender's, never the destination itself.
        unsafe {
            let dst = self.dst.add(offset);
            let incoming = Src {
                ptr: data.as_ptr(),
                scale,
            };
            match self.with {
                None if self.stream && scale.is_none() => {
                    crate::reduce::stream_copy(dst, data.as_ptr(), data.len(), true)
                }
                None => copy_scaled(dst, incoming, data.len(), self.reduction),
                Some(w) => {
                    let red = self.reduction.ok_or_else(|| {
                        Error::new(ErrorKind::Internal, "reducing receive without an op")
                    })?;
                    let w = Src {
                        ptr: w.ptr.add(offset),
                        scale: w.scale,
                    };
                    combine(dst, w, incoming, data.len(), &red.reducer);
                }
            }
            finish(dst, data.len(), self.last, self.reduction);
        }
        Ok(())
    }

    fn reply(&self) -> Option<Reply> {
        (self.returns && self.with.is_some()).then_some(Reply {
            at: self.dst.cast_const(),
            next: self.forwards,
            forward_first: self.forward_first && self.forwards,
        })
    }

    fn put_also(
        &mut self,
        offset: usize,
        data: &[u8],
        scale: Option<Scale>,
        out: *mut u8,
    ) -> Result<()> {
        if offset + data.len() > self.len {
            return crate::internal_err!("message piece beyond the receive region");
        }
        if let (true, Some(w), Some(r)) = (self.stream, self.with, self.reduction) {
            let divides = self.last && r.divide_by.is_some();
            if !divides && !std::ptr::eq(w.ptr, self.dst) {
                // SAFETY: dst and with cover `len` bytes, apart, and this piece lies inside;
                // `out` is the caller's memory of data.len() bytes, overlapping neither.
                unsafe {
                    let n = data.len();
                    r.reducer.reduce_twice(
                        std::slice::from_raw_parts_mut(self.dst.add(offset), n),
                        std::slice::from_raw_parts_mut(out, n),
                        std::slice::from_raw_parts(w.ptr.add(offset), n),
                        w.scale,
                        data,
                        scale,
                    );
                }
                return Ok(());
            }
        }
        // An integer average divides after the fold (and a fold in place reads dst): a copy
        // out of the cache follows.
        crate::transport::put_then_copy(self, offset, data, scale, out)
    }

    fn placed(&mut self, offset: usize, len: usize, scale: Option<Scale>) -> Result<()> {
        // SAFETY: the transport wrote [offset, offset+len) of dst, which covers `self.len` bytes.
        unsafe {
            let dst = self.dst.add(offset);
            if let (Some(s), Some(red)) = (scale, self.reduction) {
                red.reducer
                    .scale_in_place(std::slice::from_raw_parts_mut(dst, len), s);
            }
            finish(dst, len, self.last, self.reduction);
        }
        Ok(())
    }
}

/// `dst = scale * a` (a plain copy without a scale; nothing when it is the same memory).
///
/// # Safety
/// `dst` and `a.ptr` cover `len` bytes and either coincide or do not overlap.
pub(super) unsafe fn copy_scaled(dst: *mut u8, a: Src, len: usize, reduction: Option<Reduction>) {
    match (a.scale, reduction) {
        (Some(s), Some(red)) => {
            // SAFETY: the caller vouches for `len` bytes at `dst`; nothing else refers to them
            // while `d` lives (the shared view of `a` below is made only when it is elsewhere).
            let d = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            if std::ptr::eq(a.ptr, dst) {
                red.reducer.scale_in_place(d, s);
            } else {
                // SAFETY: `a.ptr` covers `len` bytes (caller) and, not coinciding with `dst`,
                // does not overlap it (caller), so it does not alias `d`.
                let a = unsafe { std::slice::from_raw_parts(a.ptr, len) };
                red.reducer.scale(d, a, s);
            }
        }
        _ => {
            if !std::ptr::eq(a.ptr, dst) {
                // SAFETY: both cover `len` bytes (caller), and not coinciding they do not
                // overlap (caller): `copy_bytes`'s contract.
                unsafe { crate::reduce::copy_bytes(dst, a.ptr, len) };
            }
        }
    }
}

/// `dst = a (+) b`, where dst may be exactly a or exactly b.
///
/// # Safety
/// All three cover `len` bytes; dst coincides with a, with b, or overlaps neither.
pub(super) unsafe fn combine(dst: *mut u8, a: Src, b: Src, len: usize, reducer: &Reducer) {
    if a.scale.is_none()
        && b.scale.is_none()
        // SAFETY: `reduce_small` asks exactly this function's contract, which the caller
        // upholds.
        && unsafe { reducer.reduce_small(dst, a.ptr, b.ptr, len) }
    {
        return;
    }
    // SAFETY: the caller vouches for `len` bytes at `dst`; the shared views below are of
    // operands that are not `dst` and so (caller) do not overlap it.
    let d = unsafe { std::slice::from_raw_parts_mut(dst, len) };
    if std::ptr::eq(a.ptr, dst) && std::ptr::eq(b.ptr, dst) {
        // One buffer as both operands (no schedule folds a buffer with itself today): fold
        // with a copy of it, so that no shared view aliases `d`.
        let b_copy = d.to_vec();
        reducer.reduce_in_place(d, a.scale, &b_copy, b.scale);
    } else if std::ptr::eq(a.ptr, dst) {
        // SAFETY: `b.ptr` covers `len` bytes (caller) and is not `dst` (the branch above), so
        // it overlaps neither (caller).
        let b_bytes = unsafe { std::slice::from_raw_parts(b.ptr, len) };
        reducer.reduce_in_place(d, a.scale, b_bytes, b.scale);
    } else if std::ptr::eq(b.ptr, dst) {
        // SAFETY: `a.ptr` covers `len` bytes (caller) and is not `dst`, so it overlaps
        // neither (caller).
        let a_bytes = unsafe { std::slice::from_raw_parts(a.ptr, len) };
        reducer.reduce_in_place(d, b.scale, a_bytes, a.scale);
    } else {
        // SAFETY: both cover `len` bytes (caller) and, being neither `dst`, overlap neither
        // (caller); shared views of the two may overlap each other.
        let (a_bytes, b_bytes) = unsafe {
            (
                std::slice::from_raw_parts(a.ptr, len),
                std::slice::from_raw_parts(b.ptr, len),
            )
        };
        reducer.reduce(d, a_bytes, a.scale, b_bytes, b.scale);
    }
}

/// The end of an integer average: divide final values by the rank count.
///
/// # Safety
/// `dst` covers `len` bytes.
pub(super) unsafe fn finish(dst: *mut u8, len: usize, last: bool, reduction: Option<Reduction>) {
    if let (true, Some(red)) = (last, reduction) {
        if let Some(n) = red.divide_by {
            // SAFETY: the caller vouches for `len` bytes at `dst`, and no other reference to
            // them is live here.
            let d = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            red.reducer.divide_in_place(d, n);
        }
    }
}
