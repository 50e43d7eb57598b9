//! One-sided operations for windows over RC queue pairs of their own: the links' queue pairs
//! carry the collectives' pieces under credits, and window traffic on them would consume the
//! receives those credits count. A communicator whose windows use InfiniBand connects one queue
//! pair from every rank to every rank, itself included (a loopback queue pair: its own atomics
//! go through its HCA like everyone else's, see `window/mod.rs` on atomicity).
//!
//! - put: RDMA write. From the caller's buffer where it lies in registered memory (windows,
//!   ncclCommRegister), and then the call waits for the write to complete, so that the buffer
//!   is the caller's again on return; otherwise copied into a staging slot, and the call
//!   returns once the write is posted.
//! - get: RDMA read, into the caller's buffer where it is registered, else through staging.
//! - device memory (GPUDirect RDMA): a window part is registered through a dmabuf of it
//!   (`Source::Dmabuf`), which the caller exports; a local buffer of a put or get in device
//!   memory cannot be staged by the CPU, so it always goes in place, registered through a
//!   dmabuf of its whole allocation the first time and kept for later calls (`device_lkey`).
//! - fetch-add, compare-and-swap: verbs atomics; the old value lands in a staging word.
//! - signal: a zero-byte write with immediate value, posted after the puts on the same queue
//!   pair. RC places their data before the target sees the receive completion, whose handler
//!   (on the target, without its application) counts the signal and rings its doorbell.
//! - flush: waits until every work request posted to the peer completed, the last being a
//!   read after the writes (answered only once they are placed at the peer).
//!
//! Every work request is signaled and numbered in posting order; a queue pair's send
//! completions arrive in that order, so one count says which are done. One operation at a time
//! per peer: its lock is held from posting to the completions the operation needs. Completions
//! of the peer's writes with immediate to this rank are taken by whoever holds the lock, or by
//! the completion notification, which takes the lock when it is free and otherwise leaves a
//! mark that the holder honours when it lets go.
//!
//! A completion with an error status fails that peer only (ncclRemoteError naming the device,
//! the peer and the verbs status, for this and every later operation to it); other peers keep
//! working.

use super::link::Buffer;
use super::verbs::{
    Completed, Completion, Device, Local, Mr, Op, Qp, QpAddr, Remote, SendWr, Source,
};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, ErrorKind, Result};
use crate::sys;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Immediate values of the zero-byte writes: an NCCL signal to count, or a signal pad changed.
pub(crate) const IMM_SIGNAL: u32 = 1;
pub(crate) const IMM_PAD: u32 = 2;

/// Staging slots per peer (allocated at its first use) and their size.
const STAGE_SLOTS: usize = 4;
const STAGE_BYTES: usize = 64 << 10;
/// Where in the staging buffer the old value of an atomic lands.
const RESULT_AT: usize = STAGE_SLOTS * STAGE_BYTES;
/// Receives kept posted for the peer's writes with immediate.
const RECVS: u32 = 64;
/// Send work requests outstanding at most per queue pair.
const DEPTH: u64 = 128;
/// Puts and gets at least this long use the caller's registered memory directly.
const ZERO_COPY_MIN: usize = 16 << 10;
/// Bytes of one write or read straight from or to the caller's memory.
const DIRECT_CHUNK: usize = 1 << 30;

/// Called on the target with (sender, immediate value) when a peer's write with immediate
/// arrived: its data is in place.
pub(crate) type OnImm = Arc<dyn Fn(usize, u32) + Send + Sync>;

#[derive(Default)]
struct PeerState {
    /// Work requests posted (their ids are 1, 2, ...) and completed, in order.
    posted: u64,
    done: u64,
    /// The work request that last used each staging slot, and the next slot to use.
    slot_wr: [u64; STAGE_SLOTS],
    next_slot: usize,
    staging: Option<(Buffer, Arc<dyn Mr>)>,
    /// Writes were posted since the last flush's read.
    unflushed: bool,
    failed: Option<Error>,
}

/// This rank's queue pair to one rank.
struct Peer {
    me: usize,
    peer: usize,
    device: Arc<dyn Device>,
    qp: OnceLock<Arc<dyn Qp>>,
    state: Mutex<PeerState>,
    /// A completion notification found the lock taken: the holder drains once more.
    pending: AtomicBool,
    /// Bumped by every notification: what an operation waiting for a completion sleeps on.
    bell: AtomicU32,
    /// Set once the peer's queue pair failed, for quick checks without the lock.
    broken: AtomicBool,
    on_imm: OnImm,
}

/// The one-sided side of a rank: a queue pair per rank, and the registrations peers reach.
pub(crate) struct OneSided {
    peers: Vec<Arc<Peer>>,
    regs: Arc<super::Registered>,
    device: Arc<dyn Device>,
    /// Device memory registered through a dmabuf as the local buffer of puts and gets.
    device_mrs: Mutex<Vec<DeviceMr>>,
}

/// A device allocation registered through a dmabuf (addresses `start..end`), with the
/// driver's number for it: a new allocation at the same addresses has another number, and
/// replaces the registration instead of reusing pages that were freed.
struct DeviceMr {
    start: u64,
    end: u64,
    ident: u64,
    mr: Arc<dyn Mr>,
}

/// A device allocation: its addresses, and the driver's number for it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Allocation {
    pub start: u64,
    pub len: usize,
    pub ident: u64,
}

/// Registered memory that peers reach with this key until it is dropped.
pub(crate) struct Exposed {
    id: Option<u64>,
    regs: Arc<super::Registered>,
    pub(crate) rkey: u32,
    _mr: Option<Arc<dyn Mr>>,
}

impl Drop for Exposed {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.regs.deregister(id);
        }
    }
}

impl OneSided {
    /// Connects this rank to every rank, itself included. Collective over the bootstrap:
    /// every rank of the communicator calls it with a device.
    pub(super) fn connect(
        regs: Arc<super::Registered>,
        boot: &Bootstrap,
        on_imm: OnImm,
    ) -> Result<OneSided> {
        let (me, n) = (boot.rank(), boot.nranks());
        let device = regs.device.clone();
        let mut peers = Vec::with_capacity(n);
        for p in 0..n {
            let peer = Arc::new(Peer {
                me,
                peer: p,
                device: device.clone(),
                qp: OnceLock::new(),
                state: Mutex::new(PeerState::default()),
                pending: AtomicBool::new(false),
                bell: AtomicU32::new(0),
                broken: AtomicBool::new(false),
                on_imm: on_imm.clone(),
            });
            let weak: Weak<Peer> = Arc::downgrade(&peer);
            let qp = device.create_qp(
                (DEPTH as u32).max(RECVS),
                Arc::new(move || {
                    if let Some(p) = weak.upgrade() {
                        p.notified();
                    }
                }),
            )?;
            let _ = peer.qp.set(qp);
            peers.push(peer);
        }
        let mut mine = Vec::with_capacity(n * QpAddr::BYTES);
        for p in &peers {
            p.qp().addr().encode(&mut mine);
        }
        let all = boot.allgather(&mine)?;
        for (r, p) in peers.iter().enumerate() {
            let theirs = all[r]
                .get(me * QpAddr::BYTES..)
                .and_then(QpAddr::decode)
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Internal,
                        format!("rank {r} published no window queue pair for rank {me}"),
                    )
                })?;
            p.qp().connect(&theirs).map_err(|e| {
                e.context(format!(
                    "connecting the window queue pair of rank {me} to rank {r}"
                ))
            })?;
            for i in 0..RECVS {
                p.qp().post_recv(u64::from(i))?;
            }
            p.qp().arm()?;
        }
        // Every queue pair is ready to receive before anyone writes.
        boot.barrier()?;
        crate::info!(
            "rank {me}: windows reach every rank over InfiniBand {} ({n} queue pairs)",
            device.name()
        );
        Ok(OneSided {
            peers,
            regs,
            device,
            device_mrs: Mutex::new(Vec::new()),
        })
    }

    /// The local key of `len` bytes of device memory at `addr` inside allocation `alloc`:
    /// from a registration that covers them (a window, an earlier call), or from one of the
    /// whole allocation made now through the dmabuf `export` gives (the descriptor and the
    /// allocation's offset in it), kept for later calls.
    pub(crate) fn device_lkey(
        &self,
        addr: u64,
        len: usize,
        alloc: Allocation,
        export: impl FnOnce() -> Result<(std::os::fd::OwnedFd, u64)>,
    ) -> Result<u32> {
        if let Some(lkey) = self.regs.lkey(addr, len) {
            return Ok(lkey);
        }
        let end = addr.saturating_add(len as u64);
        let mut mrs = self.device_mrs.lock();
        if let Some(m) = mrs
            .iter()
            .find(|m| m.ident == alloc.ident && m.start <= addr && end <= m.end)
        {
            return Ok(m.mr.lkey());
        }
        // A freed allocation's registration goes with it.
        let (a_start, a_end) = (alloc.start, alloc.start + alloc.len as u64);
        mrs.retain(|m| m.end <= a_start || a_end <= m.start);
        let (fd, offset) = export()?;
        let source = Source::Dmabuf {
            fd: std::os::fd::AsRawFd::as_raw_fd(&fd),
            offset,
            iova: alloc.start,
        };
        let mr = source.register(&*self.device, alloc.len)?;
        // The registration keeps the pages; the descriptor is no longer needed.
        drop(fd);
        let lkey = mr.lkey();
        mrs.push(DeviceMr {
            start: a_start,
            end: a_end,
            ident: alloc.ident,
            mr,
        });
        Ok(lkey)
    }

    /// Registers `len` bytes of `source` for the peers' operations (host memory, or device
    /// memory through a dmabuf). Through the communicator's registration cache (`cached`:
    /// window memory, which puts and sends may also use as a local buffer), or privately (the
    /// control segment).
    pub(crate) fn expose(&self, source: Source, len: usize, cached: bool) -> Result<Exposed> {
        if len == 0 {
            return Ok(Exposed {
                id: None,
                regs: self.regs.clone(),
                rkey: 0,
                _mr: None,
            });
        }
        if cached {
            let id = self.regs.register(source, len)?;
            let rkey = self.regs.rkey(id).unwrap_or(0);
            return Ok(Exposed {
                id: Some(id),
                regs: self.regs.clone(),
                rkey,
                _mr: None,
            });
        }
        let mr = source.register(&*self.device, len)?;
        Ok(Exposed {
            id: None,
            regs: self.regs.clone(),
            rkey: mr.rkey(),
            _mr: Some(mr),
        })
    }

    fn peer(&self, p: usize) -> &Peer {
        &self.peers[p]
    }

    /// Why `peer`'s queue pair can no longer be used, if it cannot.
    pub(crate) fn failure(&self, peer: usize) -> Option<Error> {
        let p = self.peer(peer);
        if !p.broken.load(Ordering::SeqCst) {
            return None;
        }
        p.state.lock().failed.clone()
    }

    /// Writes `len` bytes at `src` to `to` at `peer`. Returns once `src` may be reused; the
    /// data has landed once `flush` returns. `lkey`: `src` is registered memory the CPU may
    /// not copy (device memory), written in place whatever its length.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes of reads (by the CPU, without `lkey`).
    pub(crate) unsafe fn put(
        &self,
        peer: usize,
        src: *const u8,
        len: usize,
        to: Remote,
        lkey: Option<u32>,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let p = self.peer(peer);
        p.with(|st| {
            let direct = lkey.or_else(|| {
                (len >= ZERO_COPY_MIN)
                    .then(|| self.regs.lkey(src as u64, len))
                    .flatten()
            });
            if let Some(lkey) = direct {
                // The caller's buffer is read by the device until the writes complete.
                return p.in_place(st, Op::Write, (src as u64, lkey), len, to, deadline);
            }
            for at in (0..len).step_by(STAGE_BYTES) {
                let n = STAGE_BYTES.min(len - at);
                let (local, slot) = p.stage(st, n, deadline)?;
                // SAFETY: the slot holds STAGE_BYTES bytes and no outstanding work request
                // reads it (`stage` waited); the caller guarantees `src` holds `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(src.add(at), local.addr as *mut u8, n) };
                let id = p.post(st, Op::Write, local, offset(to, at), deadline)?;
                st.slot_wr[slot] = id;
            }
            Ok(())
        })
    }

    /// Reads `len` bytes at `from` of `peer` into `dst`; complete on return. `lkey`: as for
    /// `put`.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes (by the CPU, without `lkey`).
    pub(crate) unsafe fn get(
        &self,
        peer: usize,
        dst: *mut u8,
        len: usize,
        from: Remote,
        lkey: Option<u32>,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let p = self.peer(peer);
        p.with(|st| {
            let direct = lkey.or_else(|| {
                (len >= ZERO_COPY_MIN)
                    .then(|| self.regs.lkey(dst as u64, len))
                    .flatten()
            });
            if let Some(lkey) = direct {
                return p.in_place(st, Op::Read, (dst as u64, lkey), len, from, deadline);
            }
            for at in (0..len).step_by(STAGE_BYTES) {
                let n = STAGE_BYTES.min(len - at);
                let (local, slot) = p.stage(st, n, deadline)?;
                let id = p.post(st, Op::Read, local, offset(from, at), deadline)?;
                st.slot_wr[slot] = id;
                p.wait_for(st, id, deadline)?;
                // SAFETY: the read completed into the slot; the caller guarantees `dst`
                // holds `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(local.addr as *const u8, dst.add(at), n) };
            }
            Ok(())
        })
    }

    /// An 8-byte fetch-add (`cas` None) or compare-and-swap at `at` of `peer`; the old value.
    pub(crate) fn atomic(
        &self,
        peer: usize,
        at: Remote,
        cas: Option<u64>,
        val: u64,
        deadline: Option<Instant>,
    ) -> Result<u64> {
        let p = self.peer(peer);
        p.with(|st| {
            let (buf, lkey) = p.staging(st)?;
            let local = Local {
                addr: buf + RESULT_AT as u64,
                len: 8,
                lkey,
            };
            let op = match cas {
                Some(cmp) => Op::CompareSwap(cmp, val),
                None => Op::FetchAdd(val),
            };
            let id = p.post(st, op, local, at, deadline)?;
            p.wait_for(st, id, deadline)?;
            // SAFETY: the atomic completed, its old value in the result word of the staging
            // buffer, which lives while `st` holds it.
            Ok(unsafe { std::ptr::read_volatile(local.addr as *const u64) })
        })
    }

    /// A zero-byte write with immediate value `imm` to `peer`, after everything posted to it
    /// before; `at` is any key of the peer's (RC needs one even for no bytes).
    pub(crate) fn notify(
        &self,
        peer: usize,
        imm: u32,
        at: Remote,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let p = self.peer(peer);
        p.with(|st| {
            let local = Local {
                addr: 0,
                len: 0,
                lkey: 0,
            };
            p.post(st, Op::WriteImm(imm), local, at, deadline)
                .map(|_| ())
        })
    }

    /// PyTorch's put_signal over the network: sets the 4-byte pad word at `pad` of `peer`
    /// from 0 to 1 and wakes the peer; false (nothing written) while it is still 1.
    ///
    /// Not an atomic: only this rank ever sets this word (it is this rank's pad at the peer)
    /// and only the peer clears it, so a word read as 0 stays 0 until this rank writes it.
    pub(crate) fn set_pad(
        &self,
        peer: usize,
        pad: Remote,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        let p = self.peer(peer);
        p.with(|st| {
            let (buf, lkey) = p.staging(st)?;
            let word = Local {
                addr: buf + RESULT_AT as u64,
                len: 4,
                lkey,
            };
            let id = p.post(st, Op::Read, word, pad, deadline)?;
            p.wait_for(st, id, deadline)?;
            // SAFETY: the read completed into the result word.
            let seen = unsafe { std::ptr::read_volatile(word.addr as *const u32) };
            if seen != 0 {
                return Ok(false);
            }
            // SAFETY: as above; nothing outstanding uses the result word.
            unsafe { std::ptr::write_volatile(word.addr as *mut u32, 1) };
            let id = p.post(st, Op::WriteImm(IMM_PAD), word, pad, deadline)?;
            // The word is reused by the next operation: wait until the write has read it.
            p.wait_for(st, id, deadline)?;
            Ok(true)
        })
    }

    /// Returns once everything posted to `peer` so far has completed and its writes are in
    /// the peer's memory. A write's completion says the peer's HCA acknowledged it; a read
    /// posted after the writes on the same queue pair (`probe`: 8 readable bytes of the peer)
    /// is answered only once they are placed, so a flush after writes ends with one.
    pub(crate) fn flush(
        &self,
        peer: usize,
        probe: Remote,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let p = self.peer(peer);
        p.with(|st| {
            let mut last = st.posted;
            if st.unflushed {
                let (buf, lkey) = p.staging(st)?;
                let word = Local {
                    addr: buf + RESULT_AT as u64,
                    len: 8,
                    lkey,
                };
                last = p.post(st, Op::Read, word, probe, deadline)?;
                st.unflushed = false;
            }
            p.wait_for(st, last, deadline)
        })
    }
}

fn offset(r: Remote, by: usize) -> Remote {
    Remote {
        addr: r.addr + by as u64,
        rkey: r.rkey,
    }
}

impl Peer {
    fn qp(&self) -> &Arc<dyn Qp> {
        self.qp.get().expect("made with the peer")
    }

    /// Runs `f` holding the lock, then takes the completions a notification left meanwhile.
    fn with<T>(&self, f: impl FnOnce(&mut PeerState) -> Result<T>) -> Result<T> {
        let r = {
            let mut st = self.state.lock();
            match st.failed.clone() {
                Some(e) => Err(e),
                None => f(&mut st),
            }
        };
        if self.pending.load(Ordering::SeqCst) {
            self.notified();
        }
        r
    }

    /// A completion arrived (some other thread, or the poster's): take completions now if no
    /// one holds the lock, else leave it to the holder.
    fn notified(&self) {
        self.pending.store(true, Ordering::SeqCst);
        self.bell.fetch_add(1, Ordering::SeqCst);
        sys::futex_wake_all(&self.bell);
        loop {
            let Some(mut st) = self.state.try_lock() else {
                return;
            };
            self.pending.store(false, Ordering::SeqCst);
            let _ = self.drain(&mut st).and_then(|_| self.arm(&mut st));
            drop(st);
            if !self.pending.load(Ordering::SeqCst) {
                return;
            }
        }
    }

    fn fail(&self, st: &mut PeerState, what: String) -> Error {
        let e = Error::new(
            ErrorKind::Remote,
            format!(
                "InfiniBand {}: window operations rank {} -> rank {}: {what}",
                self.device.name(),
                self.me,
                self.peer
            ),
        );
        if st.failed.is_none() {
            st.failed = Some(e.clone());
            self.broken.store(true, Ordering::SeqCst);
            crate::warn!("{}", e.msg);
        }
        st.failed.clone().unwrap_or(e)
    }

    /// Takes every completion there is.
    fn drain(&self, st: &mut PeerState) -> Result<()> {
        let mut got: Vec<Completion> = Vec::new();
        loop {
            got.clear();
            if let Err(e) = self.qp().poll(&mut got, 32) {
                return Err(self.fail(st, format!("polling completions failed: {}", e.msg)));
            }
            if got.is_empty() {
                return match &st.failed {
                    Some(e) => Err(e.clone()),
                    None => Ok(()),
                };
            }
            for c in &got {
                if let Some(status) = &c.error {
                    let what = match c.what {
                        Completed::Send => "a one-sided operation",
                        Completed::RecvImm(_) => "a receive for the peer's signals",
                    };
                    self.fail(st, format!("{what} completed with status {status}"));
                    continue;
                }
                match c.what {
                    Completed::Send => st.done = st.done.max(c.wr_id),
                    Completed::RecvImm(imm) => {
                        if let Err(e) = self.qp().post_recv(c.wr_id) {
                            self.fail(st, format!("reposting a receive failed: {}", e.msg));
                        }
                        (self.on_imm)(self.peer, imm);
                    }
                }
            }
        }
    }

    /// Asks for a notification at the next completion, then takes any that slipped in.
    fn arm(&self, st: &mut PeerState) -> Result<()> {
        if let Err(e) = self.qp().arm() {
            return Err(self.fail(
                st,
                format!("arming completion notification failed: {}", e.msg),
            ));
        }
        self.drain(st)
    }

    /// Waits until work request `id` (and every one before it) completed.
    /// `op` (a write or a read) between `len` bytes of registered memory at `local` (its
    /// address and key) and `remote`, in pieces of DIRECT_CHUNK; returns once the last is
    /// done, so the device no longer touches the local memory.
    fn in_place(
        &self,
        st: &mut PeerState,
        op: Op,
        local: (u64, u32),
        len: usize,
        remote: Remote,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let mut last = 0;
        for at in (0..len).step_by(DIRECT_CHUNK) {
            let piece = Local {
                addr: local.0 + at as u64,
                len: DIRECT_CHUNK.min(len - at) as u32,
                lkey: local.1,
            };
            last = self.post(st, op, piece, offset(remote, at), deadline)?;
        }
        self.wait_for(st, last, deadline)
    }

    fn wait_for(&self, st: &mut PeerState, id: u64, deadline: Option<Instant>) -> Result<()> {
        let mut polls = 0u32;
        loop {
            self.drain(st)?;
            if st.done >= id {
                return Ok(());
            }
            polls += 1;
            if polls < 256 {
                std::hint::spin_loop();
                continue;
            }
            let seen = self.bell.load(Ordering::SeqCst);
            self.arm(st)?;
            if st.done >= id {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() > d) {
                return crate::timeout_err!(
                    "InfiniBand {}: window operations rank {} -> rank {}: timed out waiting for {} work requests to complete",
                    self.device.name(),
                    self.me,
                    self.peer,
                    id - st.done
                );
            }
            sys::futex_wait(&self.bell, seen, Duration::from_millis(5));
        }
    }

    /// Posts one signaled work request; returns its id.
    fn post(
        &self,
        st: &mut PeerState,
        op: Op,
        local: Local,
        remote: Remote,
        deadline: Option<Instant>,
    ) -> Result<u64> {
        if st.posted - st.done >= DEPTH {
            self.wait_for(st, st.posted + 1 - DEPTH, deadline)?;
        }
        let id = st.posted + 1;
        if matches!(op, Op::Write | Op::WriteImm(_)) {
            st.unflushed = true;
        }
        let wr = SendWr {
            wr_id: id,
            op,
            local,
            remote,
            signaled: true,
        };
        if let Err(e) = self.qp().post_send(&wr) {
            return Err(self.fail(st, format!("posting a work request failed: {}", e.msg)));
        }
        st.posted = id;
        Ok(id)
    }

    /// The staging buffer's address and key, made at first use.
    fn staging(&self, st: &mut PeerState) -> Result<(u64, u32)> {
        if st.staging.is_none() {
            let buf = Buffer::new(RESULT_AT + 64)?;
            let mr = self.device.register(buf.ptr(), RESULT_AT + 64)?;
            st.staging = Some((buf, mr));
        }
        let (buf, mr) = st.staging.as_ref().expect("made above");
        Ok((buf.addr(), mr.lkey()))
    }

    /// The next staging slot, once no work request still uses it: its first `n` bytes, and
    /// its number.
    fn stage(
        &self,
        st: &mut PeerState,
        n: usize,
        deadline: Option<Instant>,
    ) -> Result<(Local, usize)> {
        let (buf, lkey) = self.staging(st)?;
        let slot = st.next_slot;
        st.next_slot = (slot + 1) % STAGE_SLOTS;
        let last = st.slot_wr[slot];
        self.wait_for(st, last, deadline)?;
        Ok((
            Local {
                addr: buf + (slot * STAGE_BYTES) as u64,
                len: n as u32,
                lkey,
            },
            slot,
        ))
    }
}
