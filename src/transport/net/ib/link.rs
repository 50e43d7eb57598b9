//! One peer over RC queue pairs: messages cut into pieces, each RDMA-written with immediate
//! data into a ring of slots the receiver registered for this sender, under credits. With
//! several queue pairs per connection (`NCCL_IB_QPS_PER_CONNECTION`), piece k travels on queue
//! pair k mod n, so that a message spreads over several paths of the fabric; each queue pair
//! keeps its own pieces in order, and the receiver takes piece k once its queue pair has
//! delivered its share up to k.
//!
//! A slot holds a 32-byte header (tag, message length, the piece's offset and length, the
//! scale) and up to `SLOT - HEADER` bytes of the message. The sender copies a piece into its
//! own registered staging slot and writes it into the receiver's slot of the same number; the
//! write's immediate value completes a receive at the receiver, which counts arrivals (RC
//! delivers them in order). Having drained slots into the destination (a copy, or a reduction
//! through the sink), the receiver returns the count it consumed as the immediate value of a
//! zero-byte write: the sender's credit. A sender never has more than `SLOTS` pieces unconsumed,
//! so it never overruns the ring, and reuses a staging slot only after the write that read it
//! completed. A message of zero bytes is one piece with no payload.
//!
//! Immediate values: bit 31 marks a credit (the consumed count, modulo 2^31), bit 30 a close
//! (how, and the rank this side lost, plus one); neither marks a piece of data.
//!
//! Every completion with an error status fails the link, with the device, the peer and the
//! verbs status in the message; the executor turns that into an error of the operation.

use super::verbs::{Completed, Completion, Local, Mr, Op, Qp, Remote, SendWr};
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::Scale;
use crate::transport::{
    Closing, InExpect, Link, OutMsg, Progress, RecvCursor, SendCursor, SendState, Sink,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub(super) const SLOTS: usize = 8;
pub(super) const HEADER: usize = 32;
const CREDIT: u32 = 1 << 31;
const CLOSE: u32 = 1 << 30;
/// Receives kept posted: every write with immediate the peer may have in flight (its pieces,
/// its credits, a close), with room to spare.
pub(super) const RECVS: u32 = 4 * SLOTS as u32;
/// Work-request ids of data pieces carry this bit (and the piece's number).
const DATA_WR: u64 = 1 << 63;
/// Pieces at least this long are written straight from the caller's buffer when it lies in
/// memory registered with ncclCommRegister (a second work request beats a copy from here on).
const ZERO_COPY_MIN: usize = 16 << 10;

/// The error of a rank whose peer closed its end (`how`, having lost `lost`): named after
/// the rank it lost, else the peer itself.
pub(super) fn closed_error(peer: usize, how: Closing, lost: Option<usize>) -> Error {
    let mut e = Error::lost_peer(lost.unwrap_or(peer), how.describe(peer, lost));
    e.kind = how.kind();
    e
}

/// Page-aligned memory that stays where it is while registered.
pub(super) struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is plain bytes owned by the buffer; access is synchronised by the link.
unsafe impl Send for Buffer {}
// SAFETY: as above.
unsafe impl Sync for Buffer {}

impl Buffer {
    pub(super) fn new(len: usize) -> Result<Buffer> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return crate::system_err!("out of memory for {len} bytes of InfiniBand buffers");
        }
        Ok(Buffer { ptr, len })
    }

    pub(super) fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len.max(1), 4096).expect("layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    tag: u64,
    msg_len: u64,
    /// The piece's number within its message.
    offset: u32,
    len: u32,
    scale: Option<[u8; 8]>,
}

impl Header {
    fn write(&self, to: *mut u8) {
        let mut b = [0u8; HEADER];
        b[0..8].copy_from_slice(&self.tag.to_le_bytes());
        b[8..16].copy_from_slice(&self.msg_len.to_le_bytes());
        b[16..20].copy_from_slice(&self.offset.to_le_bytes());
        b[20..24]
            .copy_from_slice(&(self.len | (u32::from(self.scale.is_some()) << 31)).to_le_bytes());
        b[24..32].copy_from_slice(&self.scale.unwrap_or_default());
        // SAFETY: `to` is the start of a slot of at least HEADER bytes.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), to, HEADER) };
    }

    fn read(from: *const u8) -> Header {
        let mut b = [0u8; HEADER];
        // SAFETY: `from` is the start of a slot the peer's write filled before its completion.
        unsafe { std::ptr::copy_nonoverlapping(from, b.as_mut_ptr(), HEADER) };
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let len_word = u32_at(20);
        Header {
            tag: u64_at(0),
            msg_len: u64_at(8),
            offset: u32_at(16),
            len: len_word & !(1 << 31),
            scale: (len_word >> 31 == 1).then(|| b[24..32].try_into().unwrap()),
        }
    }
}

#[derive(Default)]
struct State {
    /// Pieces this side posted, and, per queue pair, how many of its writes completed here.
    posted: u64,
    written: Vec<u64>,
    /// Pieces the peer consumed (its last credit).
    credit: u64,
    /// Pieces that arrived here per queue pair, how many were consumed in all, and the count
    /// last sent as credit.
    arrived: Vec<u64>,
    consumed: u64,
    credited: u64,
    /// The first failure: completion errors, refused posts.
    failed: Option<Error>,
    /// The peer closed its end: how, and the rank it lost.
    peer_closed: Option<(Closing, Option<usize>)>,
}

/// This side of a connection to one peer.
pub(super) struct IbLink {
    me: usize,
    peer: usize,
    device: String,
    slot: usize,
    qps: Vec<Arc<dyn Qp>>,
    /// The slots the peer writes into, and the ones this side sends from.
    ring: Buffer,
    staging: Buffer,
    ring_mr: Arc<dyn Mr>,
    staging_mr: Arc<dyn Mr>,
    /// User buffers registered with the device, sent from without a copy.
    regs: Arc<super::Registered>,
    /// The peer's ring for this side's pieces, set when the connection is made.
    remote: Mutex<Option<Remote>>,
    state: Mutex<State>,
    closed: AtomicBool,
}

impl IbLink {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        me: usize,
        peer: usize,
        device: String,
        slot: usize,
        qps: Vec<Arc<dyn Qp>>,
        ring: Buffer,
        staging: Buffer,
        ring_mr: Arc<dyn Mr>,
        staging_mr: Arc<dyn Mr>,
        regs: Arc<super::Registered>,
    ) -> IbLink {
        IbLink {
            me,
            peer,
            device,
            slot,
            ring,
            staging,
            ring_mr,
            staging_mr,
            regs,
            remote: Mutex::new(None),
            state: Mutex::new(State {
                written: vec![0; qps.len()],
                arrived: vec![0; qps.len()],
                ..State::default()
            }),
            qps,
            closed: AtomicBool::new(false),
        }
    }

    /// This rank and the peer.
    pub(super) fn ends(&self) -> (usize, usize) {
        (self.me, self.peer)
    }

    pub(super) fn qp_addrs(&self) -> Vec<super::verbs::QpAddr> {
        self.qps.iter().map(|q| q.addr()).collect()
    }

    /// Connects queue pair i to the peer's queue pair i.
    pub(super) fn connect(&self, remote: &[super::verbs::QpAddr]) -> Result<()> {
        if remote.len() != self.qps.len() {
            return crate::invalid_usage!(
                "rank {} uses {} queue pairs per connection and this rank {}: set NCCL_IB_QPS_PER_CONNECTION alike on every rank",
                self.peer,
                remote.len(),
                self.qps.len()
            );
        }
        for (q, r) in self.qps.iter().zip(remote) {
            q.connect(r)?;
        }
        Ok(())
    }

    fn nq(&self) -> u64 {
        self.qps.len() as u64
    }

    /// Whether piece `k` has arrived: its queue pair delivered its share up to it.
    fn has_arrived(&self, st: &State, k: u64) -> bool {
        st.arrived[(k % self.nq()) as usize] > k / self.nq()
    }

    /// Whether the write of piece `k` completed here (its staging slot is free again).
    fn was_written(&self, st: &State, k: u64) -> bool {
        st.written[(k % self.nq()) as usize] > k / self.nq()
    }

    /// What the peer needs to write into this side's ring.
    pub(super) fn ring_key(&self) -> Remote {
        Remote {
            addr: self.ring.addr(),
            rkey: self.ring_mr.rkey(),
        }
    }

    /// Connected: the peer's ring, and the receives its first writes will consume.
    pub(super) fn start(&self, remote: Remote) -> Result<()> {
        *self.remote.lock() = Some(remote);
        for q in &self.qps {
            for i in 0..RECVS {
                q.post_recv(u64::from(i))?;
            }
            q.arm()?;
        }
        Ok(())
    }

    fn payload(&self) -> usize {
        self.slot - HEADER
    }

    fn fail(&self, st: &mut State, what: String) -> Error {
        let e = Error::lost_peer(
            self.peer,
            format!(
                "InfiniBand {}: rank {} <-> rank {}: {what}",
                self.device, self.me, self.peer
            ),
        );
        if st.failed.is_none() {
            st.failed = Some(e.clone());
        }
        e
    }

    fn post(&self, st: &mut State, q: usize, wr: &SendWr) -> Result<()> {
        if let Err(e) = self.qps[q].post_send(wr) {
            return Err(self.fail(st, format!("posting a work request failed: {}", e.msg)));
        }
        Ok(())
    }

    fn zero_byte_write(&self, st: &mut State, imm: u32) -> Result<()> {
        let Some(remote) = *self.remote.lock() else {
            return crate::internal_err!("InfiniBand link to rank {} not connected", self.peer);
        };
        let wr = SendWr {
            wr_id: u64::from(imm),
            op: Op::WriteImm(imm),
            local: Local {
                addr: self.staging.addr(),
                len: 0,
                lkey: self.staging_mr.lkey(),
            },
            remote,
            signaled: false,
        };
        self.post(st, 0, &wr)
    }

    /// Takes every completion there is; returns whether there were any.
    fn progress(&self, st: &mut State) -> Result<bool> {
        let mut any = false;
        for q in 0..self.qps.len() {
            any |= self.progress_qp(st, q)?;
        }
        Ok(any)
    }

    fn progress_qp(&self, st: &mut State, q: usize) -> Result<bool> {
        let qp = &self.qps[q];
        let mut got: Vec<Completion> = Vec::new();
        let mut any = false;
        loop {
            got.clear();
            if let Err(e) = qp.poll(&mut got, 64) {
                return Err(self.fail(st, format!("polling completions failed: {}", e.msg)));
            }
            if got.is_empty() {
                return Ok(any);
            }
            any = true;
            for c in &got {
                if let Some(status) = &c.error {
                    let what = match c.what {
                        Completed::Send if c.wr_id & DATA_WR != 0 => "an RDMA write",
                        Completed::Send => "a credit or close write",
                        Completed::RecvImm(_) => "a receive",
                    };
                    return Err(self.fail(st, format!("{what} completed with status {status}")));
                }
                match c.what {
                    Completed::Send => {
                        if c.wr_id & DATA_WR != 0 {
                            st.written[q] += 1;
                        }
                    }
                    Completed::RecvImm(imm) => {
                        if let Err(e) = qp.post_recv(c.wr_id) {
                            return Err(
                                self.fail(st, format!("reposting a receive failed: {}", e.msg))
                            );
                        }
                        if imm & CREDIT != 0 {
                            let v = u64::from(imm & !CREDIT);
                            let ahead = v.wrapping_sub(st.credit) & ((1 << 31) - 1);
                            st.credit += ahead;
                        } else if imm & CLOSE != 0 {
                            let how = Closing::from_code((imm >> 24) & 0x3f);
                            let lost = (imm & 0xff_ffff) as usize;
                            st.peer_closed =
                                Some((how.unwrap_or(Closing::Failed), lost.checked_sub(1)));
                        } else {
                            st.arrived[q] += 1;
                        }
                    }
                }
            }
        }
    }

    /// Nothing to do right now: ask for a doorbell at the next completion, then look once
    /// more (one may have slipped in before the request).
    fn idle(&self, st: &mut State) -> Result<bool> {
        for qp in &self.qps {
            if let Err(e) = qp.arm() {
                return Err(self.fail(
                    st,
                    format!("arming completion notification failed: {}", e.msg),
                ));
            }
        }
        self.progress(st)
    }

    fn usable(&self, st: &State) -> Result<()> {
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        Ok(())
    }

    /// The peer closed its end: an error naming how, and the first rank lost (the one it
    /// said it lost, else itself).
    fn peer_gone(&self, st: &State) -> Option<Error> {
        st.peer_closed
            .map(|(how, lost)| closed_error(self.peer, how, lost))
    }

    fn give_credit(&self, st: &mut State) -> Result<()> {
        if st.consumed != st.credited {
            let imm = CREDIT | (st.consumed as u32 & !CREDIT);
            self.zero_byte_write(st, imm)?;
            st.credited = st.consumed;
        }
        Ok(())
    }

    fn slot_ptr(buf: &Buffer, slot: usize, i: u64) -> *mut u8 {
        // SAFETY: the buffers hold SLOTS slots of `slot` bytes.
        unsafe { buf.ptr().add((i % SLOTS as u64) as usize * slot) }
    }
}

impl Link for IbLink {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>> {
        let mut st = self.state.lock();
        self.usable(&st)?;
        let mut moved = self.progress(&mut st)?;
        let Some(remote) = *self.remote.lock() else {
            return crate::internal_err!("InfiniBand link to rank {} not connected", self.peer);
        };
        while cur.sent < msg.len || !cur.started {
            let s = st.posted;
            let room = s - st.credit < SLOTS as u64
                && (s < SLOTS as u64 || self.was_written(&st, s - SLOTS as u64));
            if !room {
                if self.idle(&mut st)? {
                    moved = true;
                    continue;
                }
                break;
            }
            let n = self.payload().min(msg.len - cur.sent);
            let at = Self::slot_ptr(&self.staging, self.slot, s);
            Header {
                tag: msg.tag,
                msg_len: msg.len as u64,
                offset: (cur.sent / self.payload()) as u32,
                len: n as u32,
                scale: msg.scale.map(|s| s.0),
            }
            .write(at);
            // SAFETY: `src` holds `len` bytes, so the piece is inside it.
            let piece = unsafe { msg.src.add(cur.sent) };
            let in_slot = remote.addr + (s % SLOTS as u64) * self.slot as u64;
            let q = (s % self.nq()) as usize;
            let direct = (n >= ZERO_COPY_MIN)
                .then(|| self.regs.lkey(piece as u64, n))
                .flatten();
            let carried = match direct {
                Some(lkey) => {
                    // The payload from where it is, then the header with the immediate value:
                    // the queue pair places the first before the peer sees the second complete.
                    let payload = SendWr {
                        wr_id: DATA_WR | s,
                        op: Op::Write,
                        local: Local {
                            addr: piece as u64,
                            len: n as u32,
                            lkey,
                        },
                        remote: Remote {
                            addr: in_slot + HEADER as u64,
                            rkey: remote.rkey,
                        },
                        signaled: false,
                    };
                    self.post(&mut st, q, &payload)?;
                    cur.link = Some(s);
                    0
                }
                None => {
                    // SAFETY: the slot has room for HEADER + n, and `piece` holds n bytes.
                    unsafe { std::ptr::copy_nonoverlapping(piece, at.add(HEADER), n) };
                    n
                }
            };
            let wr = SendWr {
                wr_id: DATA_WR | s,
                op: Op::WriteImm(0),
                local: Local {
                    addr: at as u64,
                    len: (HEADER + carried) as u32,
                    lkey: self.staging_mr.lkey(),
                },
                remote: Remote {
                    addr: in_slot,
                    rkey: remote.rkey,
                },
                signaled: true,
            };
            self.post(&mut st, q, &wr)?;
            st.posted += 1;
            cur.sent += n;
            cur.started = true;
            moved = true;
        }
        // Every byte copied to staging: the caller's buffer is free once all are posted; some
        // written from it: once the last of those writes is done (asking for a doorbell when
        // it is not yet, so that the caller hears of it).
        let state = match (cur.started && cur.sent == msg.len, cur.link) {
            (false, _) => SendState::Pending,
            (true, None) => SendState::Complete,
            (true, Some(last)) => {
                let done = self.was_written(&st, last) || {
                    moved |= self.idle(&mut st)?;
                    self.was_written(&st, last)
                };
                if done {
                    cur.link = None;
                    SendState::Complete
                } else {
                    SendState::Posted
                }
            }
        };
        Ok(Progress { state, moved })
    }

    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        let mut st = self.state.lock();
        self.usable(&st)?;
        let mut moved = self.progress(&mut st)?;
        let mut done = false;
        loop {
            while !done && self.has_arrived(&st, st.consumed) {
                let at = Self::slot_ptr(&self.ring, self.slot, st.consumed);
                std::sync::atomic::fence(Ordering::Acquire);
                let h = Header::read(at);
                if h.tag != expect.tag
                    || h.msg_len != expect.len as u64
                    || h.offset as usize * self.payload() != cur.received
                    || h.len as usize > self.payload()
                    || cur.received + h.len as usize > expect.len
                {
                    return Err(crate::transport::mismatch_error(
                        self.peer, h.msg_len, h.tag, expect,
                    ));
                }
                let scale = h.scale.map(Scale);
                let n = h.len as usize;
                // SAFETY: the slot holds HEADER + n bytes the peer wrote.
                let data = unsafe { std::slice::from_raw_parts(at.add(HEADER), n) };
                match sink.direct() {
                    Some(dst) => {
                        // SAFETY: the destination holds `expect.len` bytes.
                        unsafe {
                            std::ptr::copy_nonoverlapping(data.as_ptr(), dst.add(cur.received), n)
                        };
                        sink.placed(cur.received, n, scale)?;
                    }
                    None => sink.put(cur.received, data, scale)?,
                }
                st.consumed += 1;
                cur.received += n;
                cur.started = true;
                moved = true;
                done = cur.received == expect.len;
            }
            self.give_credit(&mut st)?;
            if done {
                return Ok(Progress { state: true, moved });
            }
            if let Some(e) = self.peer_gone(&st) {
                return Err(e);
            }
            if self.idle(&mut st)? {
                moved = true;
                continue;
            }
            return Ok(Progress {
                state: false,
                moved,
            });
        }
    }

    fn check_peer(&self) -> Result<()> {
        let mut st = self.state.lock();
        self.usable(&st)?;
        self.progress(&mut st)?;
        if self.has_arrived(&st, st.consumed) {
            return Ok(());
        }
        match self.peer_gone(&st) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn peek(&self) -> Result<Option<(usize, u64)>> {
        let mut st = self.state.lock();
        self.usable(&st)?;
        self.progress(&mut st)?;
        if !self.has_arrived(&st, st.consumed) {
            self.idle(&mut st)?;
        }
        if self.has_arrived(&st, st.consumed) {
            std::sync::atomic::fence(Ordering::Acquire);
            let h = Header::read(Self::slot_ptr(&self.ring, self.slot, st.consumed));
            return Ok(Some((h.msg_len as usize, h.tag)));
        }
        Ok(None)
    }

    fn describe(&self) -> String {
        format!("ib/{} rc", self.device)
    }

    fn close(&self, how: Closing, lost: Option<usize>) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut st = self.state.lock();
        if st.failed.is_some() {
            return;
        }
        let lost = lost.map_or(0, |l| (l + 1) as u32 & 0xff_ffff);
        let imm = CLOSE | ((how as u32) << 24) | lost;
        // Best effort: the peer learns of the close from it, or from its queue pair failing.
        let _ = self.zero_byte_write(&mut st, imm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let mut b = [0u8; HEADER];
        for scale in [None, Some([1, 2, 3, 4, 5, 6, 7, 8])] {
            let h = Header {
                tag: 0x0203_0000_0000_0042,
                msg_len: 1 << 33,
                offset: 7 << 20,
                len: 262_112,
                scale,
            };
            h.write(b.as_mut_ptr());
            assert_eq!(Header::read(b.as_ptr()), h);
        }
    }
}
