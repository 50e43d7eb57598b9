//! The pull protocol: large messages copied straight out of the sender's buffer (CMA between
//! processes, a plain read between threads), and replies written back into it or forwarded.

use super::peer::{Access, ShmPeer};
use super::segment::{SlotHeader, FLAG_REPLY_AT, FLAG_SCALE, KIND_EAGER, SLOT_HEADER};
use crate::error::Result;
use crate::reduce::Scale;
use crate::sys;
use crate::transport::{Doorbell, RecvCursor, Sink};
use std::sync::atomic::Ordering;

/// The smallest message a receiver pulls from the sender's buffer instead of taking it through
/// the slots, by default: between ranks of one process the pull is a memcpy, between
/// processes a process_vm_readv, whose system call and page walk cost more than the slots'
/// second copy (which pipelines) up to about a megabyte. Two processes, alternating runs of 32 KiB
/// to 16 MiB: at 1 MiB instead of 32 KiB, all-reduce 128 KiB 13-16 us instead of 40-55, in-place
/// all-gather 512 KiB 28 instead of 124-145, reduce-scatter 512 KiB 35 instead of 38-54;
/// from 4 MiB on, within noise.
pub(super) const PULL_FROM_THREAD: usize = 32 << 10;

pub(super) const PULL_FROM_PROCESS: usize = 1 << 20;

/// The same between processes when the sender has received bytes of its own to copy in the run
/// (all-reduce, all-gather, all-to-all, exchanges): a slice-sized message then costs the
/// machine one copy instead of two, and the sender's time goes to its own receives. Where the
/// sender has nothing else to do (a broadcast's root) the slots' two copies, one on each core,
/// pipeline and win, and where every receive reduces (reduce-scatter) the receiver's pull
/// lands in scratch before its fold, which costs as much as the sender's copy into a slot.
/// Alternating runs, 2 and 4 processes, against 1 MiB: all-reduce 4-64 MiB 0.82-0.97x the
/// time, all-gather 0.70-0.85x, all-to-all 0.73-0.89x; reduce-scatter and in-place broadcast
/// 1.1-1.5x slower when they pulled too (so they do not).
pub(super) const PULL_FROM_BUSY_PROCESS: usize = 512 << 10;

/// Lower when the receiver copies the bytes as they are (`Offer::copied`: nothing in the
/// operation reduces) or may write its reply back (`Offer::reply_at`): the pull then replaces
/// both slot copies with one. Below this the slots still win: their two copies pipeline, one
/// on each core, while a pull pays a system call and a walk of the sender's pages, and (where
/// a host has more ranks than CPUs) completes only once the receiver has been scheduled.
/// Measured on the project's AMD EPYC VM (2 vCPUs, 2 processes), libraries differing only
/// here, alternating runs, median time against 16 KiB (which an Intel VM had favoured where
/// ranks fit the CPUs, before the slots' receivers fetched ahead): on buffers the caches hold
/// (the benchmark's `-e` at 1-2 MiB), all-gather 32-64 KiB 0.44-0.92x and all-to-all 32-64 KiB
/// 0.66-0.87x; on buffers that move every call (`-e 64M`, 8 rounds), in place 0.69-0.90x at
/// 32 KiB, the rest within the noise (+-15 %). Higher thresholds gained more on cached
/// buffers (128-256 KiB: 128 KiB operations 0.48-0.69x) but were 1.06-1.21x slower out of
/// place on moving ones, so this stays where both agree.
pub(super) const PULL_FROM_BUSY_COPY: usize = 64 << 10;

/// Bytes pulled per call, so one large message cannot starve the other channels of its thread.
pub(super) const PULL_BUDGET: usize = 4 << 20;

/// Pieces a CMA pull is cut into when the bytes must be combined rather than copied: small
/// enough that the piece, the receiver's own bytes and the sender's lines all stay in L2
/// between the copy, the reduction and a write-back (`Offer::reply_at`), large enough that
/// the kernel's per-call cost (pinning pages) stays small. The scratch they land in is
/// huge-page backed. A model of the two-rank all-reduce in place (two processes pulling,
/// folding and writing back 32 MiB each) took 5.6-6.3 ms with 128-256 KiB pieces, 6.3 ms
/// with 512 KiB and 9.0 ms with 1 MiB.
pub(super) const PULL_PIECE: usize = 256 << 10;

/// A pulled piece lands in scratch at the same offset within a page as it lies in the sender's
/// buffer (`landing`): a copy whose destination runs a little ahead of its source modulo
/// 4 KiB has each load wait on an earlier store to a different address with the same low
/// bits (4K aliasing). Two processes, 64 MiB all-reduce, buffers at 16 or 64 bytes into a
/// page against 4080: out of place 16-22 ms against 33-34, in place 12-15 against 24-29,
/// with the scratch at a page's start.
pub(super) const PAGE_SPAN: usize = 4096;

/// Where in the scratch (`PULL_PIECE + PAGE_SPAN` bytes) the piece of the sender's buffer
/// at `src` lands: its offset within a page.
pub(super) fn landing(src: usize) -> usize {
    src % PAGE_SPAN
}

/// A message the receiver is copying out of the sender's buffer, as its descriptor says.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pulling {
    /// Its address in the sender.
    pub(super) src: usize,
    pub(super) total: usize,
    pub(super) scale: Option<Scale>,
    /// Where the sender lets the receiver write its reply (`Offer::reply_at`), in the
    /// sender's memory.
    pub(super) reply_at: Option<usize>,
}

/// What a receive in progress holds for this transport, in the cursor's word of the link's
/// own (`RecvCursor::link`): whether its bytes are being pulled (the descriptor stays in
/// its slot until then, so what it says is read there), how many bytes of the reply went
/// ahead through the slots (`forward`), and whether forwarding stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PullState {
    pub(super) pulling: bool,
    pub(super) forwarded: usize,
    pub(super) stopped: bool,
}

const PULLING: u64 = 1 << 63;
const STOPPED: u64 = 1 << 62;

impl PullState {
    /// A pull that begins.
    pub(super) const START: u64 = PULLING;

    pub(super) fn of(word: u64) -> PullState {
        PullState {
            pulling: word & PULLING != 0,
            stopped: word & STOPPED != 0,
            forwarded: (word & (STOPPED - 1)) as usize,
        }
    }

    pub(super) fn word(self) -> u64 {
        // A message's bytes fit 62 bits.
        (self.forwarded as u64 & (STOPPED - 1))
            | if self.pulling { PULLING } else { 0 }
            | if self.stopped { STOPPED } else { 0 }
    }
}

impl ShmPeer {
    /// The pull descriptor of the message being received: the first slot not yet released,
    /// which the sender leaves alone until the pull is done.
    pub(super) fn descriptor(&self) -> Pulling {
        let tail = self.consumed.load(Ordering::Relaxed);
        let h = self.read_header(tail);
        Pulling {
            src: h.src_addr as usize,
            total: h.msg_len as usize,
            scale: (h.flags & FLAG_SCALE != 0).then_some(Scale(h.scale)),
            // SAFETY: the descriptor's data word, published with it.
            reply_at: (h.flags & FLAG_REPLY_AT != 0).then(|| unsafe {
                (self.local.slot(self.peer, tail).add(SLOT_HEADER) as *const u64).read() as usize
            }),
        }
    }

    /// Moves up to PULL_BUDGET bytes of a pulled message into the sink; and, where the sender
    /// lets us and the sink will send the combined bytes straight back, writes them into the
    /// sender's buffer piece by piece while they are in cache (`write_back`).
    pub(super) fn pull(
        &self,
        cur: &mut RecvCursor,
        st: &mut PullState,
        p: Pulling,
        tag: u64,
        sink: &mut dyn Sink,
    ) -> Result<()> {
        let Pulling {
            src, total, scale, ..
        } = p;
        let back = write_back(p, &*sink, self.access);
        let forward = back.is_none() && sink.reply().is_some_and(|r| r.next);
        let end = total.min(cur.received + PULL_BUDGET);
        if let Some(dst) = sink.direct() {
            let (off, n) = (cur.received, end - cur.received);
            match self.access {
                // SAFETY: the sender keeps [src, src+total) valid and unchanged until we release
                // its descriptor; dst is the sink's destination of at least `total` bytes.
                Access::Direct => unsafe {
                    crate::reduce::copy_bytes(dst.add(off), (src + off) as *const u8, n)
                },
                // The kernel's copy would run slow at this distance (`just_ahead`): pieces
                // land in scratch at the source's offset within a page and a loop copies them on.
                Access::Cma(pid)
                    if crate::reduce::just_ahead(
                        // SAFETY: dst covers `total` bytes, `off` among them.
                        unsafe { dst.add(off) },
                        (src + off) as *const u8,
                    ) =>
                {
                    let mut scratch = self.scratch()?;
                    let mut k = 0;
                    while k < n {
                        let m = PULL_PIECE.min(n - k);
                        let at = src + off + k;
                        // SAFETY: scratch holds PULL_PIECE + PAGE_SPAN bytes; dst covers
                        // `total` bytes, [off + k, off + k + m) among them.
                        unsafe {
                            let land = scratch.as_mut_ptr().add(landing(at));
                            sys::cma_read(pid, land, at, m).map_err(|e| self.cma_error(e))?;
                            crate::reduce::copy_bytes(dst.add(off + k), land, m);
                        }
                        k += m;
                    }
                }
                // SAFETY: dst is valid for `total` bytes of writes.
                Access::Cma(pid) => unsafe { sys::cma_read(pid, dst.add(off), src + off, n) }
                    .map_err(|e| self.cma_error(e))?,
            }
            sink.placed(off, n, scale)?;
            if let Some((d, at)) = back {
                self.put_back(d, at, off, n, None)?;
            }
            cur.received = end;
            return Ok(());
        }
        match self.access {
            Access::Direct => {
                let (off, n) = (cur.received, end - cur.received);
                // SAFETY: as above, the sender's bytes stay put until we release the descriptor.
                let data = unsafe { std::slice::from_raw_parts((src + off) as *const u8, n) };
                sink.put(off, data, scale)?;
                if let Some((d, at)) = back {
                    self.put_back(d, at, off, n, None)?;
                }
                cur.received = end;
            }
            Access::Cma(pid) => {
                let mut scratch = self.scratch()?;
                while cur.received < end {
                    let n = PULL_PIECE.min(end - cur.received);
                    // SAFETY: scratch holds PULL_PIECE + PAGE_SPAN bytes, so n <= PULL_PIECE
                    // of them from any landing offset below PAGE_SPAN.
                    let land = unsafe { scratch.as_mut_ptr().add(landing(src + cur.received)) };
                    // SAFETY: as above.
                    unsafe { sys::cma_read(pid, land, src + cur.received, n) }
                        .map_err(|e| self.cma_error(e))?;
                    // SAFETY: the n bytes at `land` were just written.
                    let data = unsafe { std::slice::from_raw_parts(land, n) };
                    let done = if forward && !st.stopped {
                        self.forward(cur, st, (tag, total), data, scale, sink)?
                    } else {
                        0
                    };
                    if done < n {
                        // What is forwarded must be the reply's first bytes: no more of it.
                        st.stopped = true;
                        sink.put(cur.received + done, &data[done..], scale)?;
                    }
                    if let Some((d, at)) = back {
                        self.put_back(d, at, cur.received, n, Some(&mut scratch))?;
                    }
                    cur.received += n;
                }
            }
        }
        Ok(())
    }

    /// Folds `data`, bytes `[cur.received, ..)` of a pulled message, through the sink
    /// (`Sink::put_also`) straight into free slots of our FIFO to the peer, as the first bytes
    /// of the reply (`Reply::next`: the next message to that peer, `total` bytes with `tag`,
    /// from the sink's result). Returns how many bytes went; when the slots run out,
    /// forwarding stops for the rest of the message, which the reply's send then sends. So
    /// it does where earlier bytes of the message went elsewhere (the sink began forwarding
    /// only after the first pieces, or they were written back): what goes into the slots must
    /// be the reply's first bytes, without a gap.
    pub(super) fn forward(
        &self,
        cur: &mut RecvCursor,
        st: &mut PullState,
        (tag, total): (u64, usize),
        data: &[u8],
        scale: Option<Scale>,
        sink: &mut dyn Sink,
    ) -> Result<usize> {
        let Some(from) = sink.reply().map(|r| r.at) else {
            return Ok(0);
        };
        if st.forwarded != cur.received {
            st.stopped = true;
            return Ok(0);
        }
        let mut head = self.remote.head(self.me).load(Ordering::Relaxed);
        let mut tail = self.tail_seen.load(Ordering::Relaxed);
        let mut k = 0;
        while k < data.len() {
            if !self.slot_free(head, &mut tail) {
                st.stopped = true;
                break;
            }
            let m = self.remote.geo.slot_bytes.min(data.len() - k);
            let at = cur.received + k;
            let h = SlotHeader {
                kind: KIND_EAGER,
                flags: 0,
                msg_len: total as u64,
                offset: at as u64,
                len: m as u64,
                src_addr: from as u64,
                tag,
                scale: [0; 8],
            };
            self.fill_slot(head, &h, |out| {
                sink.put_also(at, &data[k..k + m], scale, out)
            })?;
            head += 1;
            k += m;
        }
        st.forwarded += k;
        if k > 0 {
            self.remote.ring();
        }
        Ok(k)
    }

    /// Writes bytes `[off, off+n)` of the sink's result `d` into the sender's memory at `src`
    /// (the place it offered for its reply). Where the kernel's copy would run slow
    /// (`just_ahead`) and `scratch` (of `PULL_PIECE + PAGE_SPAN` bytes, `n <= PULL_PIECE`) is
    /// at hand, the bytes go through it at the destination's distance.
    pub(super) fn put_back(
        &self,
        d: *const u8,
        src: usize,
        off: usize,
        n: usize,
        scratch: Option<&mut sys::HugeMem>,
    ) -> Result<()> {
        match self.access {
            // SAFETY: d covers the message's bytes of the sink's result; the sender lent us
            // [src, src+total) for its reply (FLAG_REPLY_AT) and touches none of it until we
            // release the descriptor.
            Access::Direct => unsafe {
                crate::reduce::copy_bytes((src + off) as *mut u8, d.add(off), n)
            },
            // SAFETY: as above, in the sender's address space; the staged copy stays inside
            // scratch, which the caller sized.
            Access::Cma(pid) => unsafe {
                let (from, to) = (d.add(off), src + off);
                let from = match scratch {
                    Some(s)
                        if n <= PULL_PIECE && crate::reduce::just_ahead(to as *const u8, from) =>
                    {
                        let stage = s.as_mut_ptr().add(landing(to));
                        crate::reduce::copy_bytes(stage, from, n);
                        stage.cast_const()
                    }
                    _ => from,
                };
                sys::cma_write(pid, from, to, n)
            }
            .map_err(|e| self.cma_failed(e, "writing a reply into", "process_vm_writev"))?,
        }
        Ok(())
    }

    /// The scratch that CMA pulls land in (`PULL_PIECE + PAGE_SPAN` bytes), made on first use.
    pub(super) fn scratch(&self) -> Result<parking_lot::MappedMutexGuard<'_, sys::HugeMem>> {
        let mut slot = self.scratch.lock();
        if slot.is_none() {
            *slot = Some(sys::HugeMem::new(PULL_PIECE + PAGE_SPAN)?);
        }
        Ok(parking_lot::MutexGuard::map(slot, |s| {
            s.as_mut().expect("made above")
        }))
    }
}

/// Where the receiver's combined bytes are and where they go in the sender, when it writes
/// them there as it pulls: the sender offered a place (`Offer::reply_at`), the sink sends the
/// bytes straight back (`Sink::reply`) and would not rather forward them through the slots
/// (`Reply::forward_first`: the executor's choice by measured times, whose measurements are in
/// `exec::replies`). Below the sizes that forward, writing back wins: 512 KiB 115-130 us
/// against 176-235 through the slots, 2-8 MiB within noise to 0.8x the time.
///
/// Only pulls through the kernel forward (`ShmPeer::forward`); between threads of one process
/// the bytes are written back whatever the sink would rather.
pub(super) fn write_back(
    p: Pulling,
    sink: &dyn Sink,
    access: Access,
) -> Option<(*const u8, usize)> {
    let at = p.reply_at?;
    let r = sink.reply()?;
    if r.forward_first && matches!(access, Access::Cma(_)) {
        return None;
    }
    Some((r.at, at))
}
