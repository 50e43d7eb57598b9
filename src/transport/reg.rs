//! Registered device buffers, read in place by peers on the same host (the programs that do it
//! are in `exec::device`).
//!
//! A rank publishes what it registers (`ncclCommRegister` of device memory) in a table in its
//! shared-memory segment: the buffer, its allocation and a handle for it (a legacy IPC handle, a
//! VMM file descriptor number, or nothing when only peers in the same process can reach it).
//! Whenever a peer enqueues a device program it first looks whether the table changed, maps the
//! new entries (and lets go of the dead ones, once nothing can read them any more), and
//! acknowledges each mapping in its own segment with the address it has there. A sender reads
//! those acknowledgements to tell a receiver where to find a message in place.
//!
//! Which programs carry descriptors is agreed per ordered pair without any waiting: both sides
//! number the programs that carry messages from the sender to the receiver, and the receiver,
//! once it has something mapped, picks the number from which on it reads through descriptors,
//! at or after the sender's next one. The sender counts its programs and learns that number in
//! one atomic update of a shared word, so each of its programs is either before the switch
//! (for both sides) or after it (for both sides).
//!
//! Layout of a rank's registry area (in its segment; all words 64-bit, zero at creation):
//! - a line with the table version (bumped after every change of the table);
//! - a line per sender with its pair word: `(switch + 1) << 32 | programs mod 2^32` where a
//!   zero high half means no switch yet;
//! - [`ENTRIES`] entries of 16 words: state `generation << 1 | live`, the buffer, its allocation,
//!   how to map it, and the 64-byte handle;
//! - per sender, [`ENTRIES`] acknowledgements of 2 words: generation, address of the allocation
//!   in this rank.

use super::shm::{Segment, ShmWorld};
use super::Transports;
use crate::cuda::share::{self, Imported, Shareable};
use crate::cuda::{Device, Event, Stream};
use crate::error::Result;
use crate::topo::{Path, Placement};
use parking_lot::Mutex;
use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

/// Registered buffers a rank can publish at once; more stay registered but are staged.
pub(crate) const ENTRIES: usize = 128;
const LINE: usize = 128;
const ENTRY_WORDS: usize = 16;
const ACK_BYTES: usize = 16;

const KIND_LOCAL: u64 = 0;
const KIND_IPC: u64 = 1;
const KIND_FD: u64 = 2;

fn pair_off(sender: usize) -> usize {
    LINE + sender * LINE
}

fn entry_off(nranks: usize, index: usize) -> usize {
    LINE + nranks * LINE + index * ENTRY_WORDS * 8
}

fn ack_off(nranks: usize, sender: usize, index: usize) -> usize {
    entry_off(nranks, ENTRIES) + (sender * ENTRIES + index) * ACK_BYTES
}

/// Bytes of the registry area of a segment for `nranks` ranks.
pub(crate) fn area_bytes(nranks: usize) -> usize {
    ack_off(nranks, nranks, 0).next_multiple_of(4096)
}

/// The full 64-bit value nearest to `reference` whose low 32 bits are `low` (program numbers of
/// two ranks never drift 2^31 apart).
fn widen(reference: u64, low: u32) -> u64 {
    reference.wrapping_add(low.wrapping_sub(reference as u32) as i32 as i64 as u64)
}

/// Sender side of a pair word: counts program `number` (the sender's own count) and returns
/// the program number from which on the receiver reads descriptors, if it has chosen one.
fn sender_count(word: &AtomicU64, number: u64) -> Option<u64> {
    let mut old = word.load(Ordering::Acquire);
    loop {
        let new = (old & !0xffff_ffff) | u64::from((old as u32).wrapping_add(1));
        match word.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break,
            Err(now) => old = now,
        }
    }
    let high = (old >> 32) as u32;
    (high != 0).then(|| widen(number, high.wrapping_sub(1)))
}

/// Receiver side: chooses (once) the first program, by number, read through descriptors: no
/// earlier than the receiver's next one (`next`) nor the sender's next one.
fn receiver_switch(word: &AtomicU64, next: u64) -> u64 {
    let mut old = word.load(Ordering::Acquire);
    loop {
        let high = (old >> 32) as u32;
        if high != 0 {
            return widen(next, high.wrapping_sub(1));
        }
        let mut at = next.max(widen(next, old as u32));
        if (at as u32).wrapping_add(1) == 0 {
            at += 1; // the stored value must not read as "no switch"
        }
        let new = (u64::from((at as u32).wrapping_add(1)) << 32) | (old & 0xffff_ffff);
        match word.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return at,
            Err(now) => old = now,
        }
    }
}

/// One entry of a table as read by anyone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    generation: u64,
    start: u64,
    len: u64,
    alloc_base: u64,
    alloc_len: u64,
    kind: u64,
    fd: i32,
    pid: u32,
    handle: [u8; 64],
}

/// A rank's registry area, in whichever process maps it.
struct Table<'a> {
    seg: &'a Segment,
    nranks: usize,
}

impl Table<'_> {
    fn version(&self) -> &AtomicU64 {
        self.seg.registry_u64(0)
    }

    fn pair(&self, sender: usize) -> &AtomicU64 {
        self.seg.registry_u64(pair_off(sender))
    }

    fn word(&self, index: usize, w: usize) -> &AtomicU64 {
        self.seg.registry_u64(entry_off(self.nranks, index) + 8 * w)
    }

    /// Writes entry `index` (owner only): hidden while it changes, then live.
    fn publish(&self, index: usize, e: &Entry) {
        self.word(index, 0)
            .store(e.generation << 1, Ordering::Release);
        fence(Ordering::SeqCst);
        let fields = [
            e.start,
            e.len,
            e.alloc_base,
            e.alloc_len,
            e.kind | (u64::from(e.fd as u32) << 32),
            u64::from(e.pid),
        ];
        for (w, v) in fields.iter().enumerate() {
            self.word(index, 1 + w).store(*v, Ordering::Relaxed);
        }
        for (w, chunk) in e.handle.chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            self.word(index, 8 + w).store(v, Ordering::Relaxed);
        }
        self.word(index, 0)
            .store((e.generation << 1) | 1, Ordering::Release);
        self.version().fetch_add(1, Ordering::AcqRel);
    }

    /// Marks entry `index` dead (owner only).
    fn retract(&self, index: usize, generation: u64) {
        self.word(index, 0).store(generation << 1, Ordering::SeqCst);
        self.version().fetch_add(1, Ordering::AcqRel);
    }

    /// Entry `index` if it is live (a consistent copy, retried while its owner rewrites it).
    fn read(&self, index: usize) -> Option<Entry> {
        loop {
            let state = self.word(index, 0).load(Ordering::Acquire);
            if state & 1 == 0 {
                return None;
            }
            let w = |k: usize| self.word(index, k).load(Ordering::Relaxed);
            let mut handle = [0u8; 64];
            for (k, chunk) in handle.chunks_exact_mut(8).enumerate() {
                chunk.copy_from_slice(&w(8 + k).to_le_bytes());
            }
            let e = Entry {
                generation: state >> 1,
                start: w(1),
                len: w(2),
                alloc_base: w(3),
                alloc_len: w(4),
                kind: w(5) & 0xffff_ffff,
                fd: (w(5) >> 32) as u32 as i32,
                pid: w(6) as u32,
                handle,
            };
            fence(Ordering::Acquire);
            if self.word(index, 0).load(Ordering::Relaxed) == state {
                return Some(e);
            }
        }
    }

    fn ack_words(&self, sender: usize, index: usize) -> (&AtomicU64, &AtomicU64) {
        let off = ack_off(self.nranks, sender, index);
        (self.seg.registry_u64(off), self.seg.registry_u64(off + 8))
    }

    /// Acknowledges (owner only) that `sender`'s entry `index` of `generation` is mapped at
    /// `base` here; generation 0 withdraws the acknowledgement.
    fn ack(&self, sender: usize, index: usize, generation: u64, base: u64) {
        let (g, a) = self.ack_words(sender, index);
        g.store(0, Ordering::Release);
        fence(Ordering::SeqCst);
        a.store(base, Ordering::Relaxed);
        g.store(generation, Ordering::Release);
    }

    /// Where this rank maps `sender`'s entry `index`, if it acknowledged `generation`.
    fn acked(&self, sender: usize, index: usize, generation: u64) -> Option<u64> {
        let (g, a) = self.ack_words(sender, index);
        let before = g.load(Ordering::Acquire);
        let base = a.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        let after = g.load(Ordering::Relaxed);
        (before == generation && after == generation).then_some(base)
    }
}

/// What this rank registered and published.
struct Export {
    generation: u64,
    start: u64,
    len: u64,
    alloc_base: u64,
    /// Kept open while the entry is live: peers duplicate it.
    _fd: Option<std::os::fd::OwnedFd>,
}

/// How this rank reaches a peer's registered allocation.
enum Reach {
    /// The peer is a thread of this process: its address works here.
    Direct(u64),
    Mapped(Imported),
    /// Could not be mapped; remembered so it is not tried again.
    Unusable,
}

impl Reach {
    fn base(&self) -> Option<u64> {
        match self {
            Reach::Direct(b) => Some(*b),
            Reach::Mapped(m) => Some(m.base()),
            Reach::Unusable => None,
        }
    }
}

struct Import {
    generation: u64,
    reach: Reach,
}

/// A mapping let go of once every program that might read it has been enqueued (`until`
/// programs from its sender) and has finished.
struct Retiring {
    sender: usize,
    until: u64,
    event: Option<Event>,
    _reach: Reach,
}

struct State {
    exports: Vec<Option<Export>>,
    generations: Vec<u64>,
    /// As a sender, per receiver: programs with messages to it so far, and its switch.
    sent: Vec<u64>,
    send_switch: Vec<Option<u64>>,
    /// As a receiver, per sender.
    received: Vec<u64>,
    recv_switch: Vec<Option<u64>>,
    seen_version: Vec<u64>,
    imports: Vec<Vec<Option<Import>>>,
    retiring: Vec<Retiring>,
    told_full: bool,
}

/// The registered-buffer state of one rank of a communicator.
pub(crate) struct Registry {
    me: usize,
    nranks: usize,
    state: Mutex<State>,
}

/// What one program may do: the descriptor modes per peer, and where peers read this rank's
/// registered bytes.
pub(crate) struct Plan {
    pub describe_to: Vec<bool>,
    pub described_from: Vec<bool>,
    /// (generation, start, len, allocation base, index) of every live export.
    exports: Vec<(u64, u64, u64, u64, usize)>,
}

/// The shared-memory world whose segments hold the registry tables, among a communicator's
/// transports.
pub(crate) fn tables(transports: &Transports) -> Option<&ShmWorld> {
    transports.find::<ShmWorld>()
}

impl Registry {
    /// A communicator's registry, where its transports share memory with peers (the tables
    /// live in the shared-memory segments); None otherwise.
    pub(crate) fn over(transports: &Transports, me: usize, nranks: usize) -> Option<Registry> {
        tables(transports).map(|_| Registry::new(me, nranks))
    }

    pub(crate) fn new(me: usize, nranks: usize) -> Registry {
        Registry {
            me,
            nranks,
            state: Mutex::new(State {
                exports: (0..ENTRIES).map(|_| None).collect(),
                generations: vec![0; ENTRIES],
                sent: vec![0; nranks],
                send_switch: vec![None; nranks],
                received: vec![0; nranks],
                recv_switch: vec![None; nranks],
                seen_version: vec![0; nranks],
                imports: (0..nranks)
                    .map(|_| (0..ENTRIES).map(|_| None).collect())
                    .collect(),
                retiring: Vec::new(),
                told_full: false,
            }),
        }
    }

    fn table<'a>(&self, seg: &'a Segment) -> Table<'a> {
        Table {
            seg,
            nranks: self.nranks,
        }
    }

    /// Publishes device buffer `[ptr, ptr + len)` for peers to read in place. None when the
    /// table is full (the buffer is still registered, but staged).
    pub(crate) fn export(
        &self,
        transports: &Transports,
        device: &Arc<Device>,
        ptr: u64,
        len: usize,
    ) -> Result<Option<usize>> {
        let Some(shm) = tables(transports) else {
            return crate::internal_err!("a registry without shared-memory segments");
        };
        if self.state.lock().exports.iter().all(|e| e.is_some()) {
            return Ok(self.publish(shm, ptr, len, None));
        }
        let ex = share::export(device, ptr)?;
        Ok(self.publish(shm, ptr, len, Some(ex)))
    }

    /// Publishes `[ptr, ptr + len)` of allocation `ex`: the entry index, or None when the
    /// table is full (or `ex` is None, which only a full table passes).
    fn publish(
        &self,
        shm: &ShmWorld,
        ptr: u64,
        len: usize,
        ex: Option<share::Exported>,
    ) -> Option<usize> {
        let mut st = self.state.lock();
        let Some(index) = st.exports.iter().position(|e| e.is_none()) else {
            if !st.told_full {
                crate::info!(
                    "{ENTRIES} buffers are registered for in-place reads already; later ones are staged"
                );
                st.told_full = true;
            }
            return None;
        };
        let ex = ex?;
        let (kind, fd, handle) = match &ex.how {
            Some(Shareable::Ipc(h)) => (KIND_IPC, -1, *h),
            Some(Shareable::Fd(f)) => (KIND_FD, f.as_raw_fd(), [0; 64]),
            None => (KIND_LOCAL, -1, [0; 64]),
        };
        // A buffer running past its allocation is only read in place where it lies inside it.
        let end = (ptr + len as u64).min(ex.alloc_base + ex.alloc_len as u64);
        st.generations[index] += 1;
        let generation = st.generations[index];
        let entry = Entry {
            generation,
            start: ptr,
            len: end.saturating_sub(ptr),
            alloc_base: ex.alloc_base,
            alloc_len: ex.alloc_len as u64,
            kind,
            fd,
            pid: std::process::id(),
            handle,
        };
        self.table(&shm.local).publish(index, &entry);
        st.exports[index] = Some(Export {
            generation,
            start: entry.start,
            len: entry.len,
            alloc_base: ex.alloc_base,
            _fd: match ex.how {
                Some(Shareable::Fd(f)) => Some(f),
                _ => None,
            },
        });
        crate::info!(
            "registered {len} bytes at {ptr:#x} for in-place reads (entry {index}, {})",
            match kind {
                KIND_IPC => "IPC handle",
                KIND_FD => "VMM file descriptor",
                _ => "this process only",
            }
        );
        Some(index)
    }

    /// Withdraws an export. Programs enqueued before keep reading it; the peers let go of
    /// their mappings once those are done.
    pub(crate) fn unexport(&self, transports: &Transports, index: usize) {
        if let Some(shm) = tables(transports) {
            self.retract(shm, index);
        }
    }

    fn retract(&self, shm: &ShmWorld, index: usize) {
        let mut st = self.state.lock();
        if let Some(e) = st.exports[index].take() {
            // Dead first, then the descriptor closes (when `e` drops): a peer that duplicated
            // it saw the entry live both before and after, so it got this one.
            self.table(&shm.local).retract(index, e.generation);
        }
    }

    /// Brings this rank's view of the peers' tables up to date and plans one program that
    /// sends to the peers marked in `sends_to` and receives from those in `recvs_from`.
    /// Counts the program: call it once per enqueued program, in enqueue order.
    pub(crate) fn plan(
        &self,
        shm: &ShmWorld,
        device: Option<&Arc<Device>>,
        paths: &[Path],
        placements: &[Placement],
        sends_to: &[bool],
        recvs_from: &[bool],
    ) -> Plan {
        let mut st = self.state.lock();
        let mine = self.table(&shm.local);
        for s in 0..self.nranks {
            let Some(peer) = shm.peer(s) else { continue };
            self.refresh(
                &mut st,
                &mine,
                &self.table(&peer.remote),
                s,
                device,
                paths,
                placements,
            );
        }
        let mut plan = Plan {
            describe_to: vec![false; self.nranks],
            described_from: vec![false; self.nranks],
            exports: st
                .exports
                .iter()
                .enumerate()
                .filter_map(|(i, e)| {
                    e.as_ref()
                        .map(|e| (e.generation, e.start, e.len, e.alloc_base, i))
                })
                .collect(),
        };
        for p in 0..self.nranks {
            let Some(peer) = shm.peer(p) else { continue };
            if sends_to[p] {
                let number = st.sent[p];
                st.sent[p] += 1;
                if let Some(at) = sender_count(self.table(&peer.remote).pair(self.me), number) {
                    st.send_switch[p] = Some(at);
                }
                plan.describe_to[p] = st.send_switch[p].is_some_and(|at| number >= at);
            }
            if recvs_from[p] {
                let number = st.received[p];
                st.received[p] += 1;
                plan.described_from[p] = st.recv_switch[p].is_some_and(|at| number >= at);
            }
        }
        plan
    }

    /// Maps what sender `s` added to its table, retires what it removed, and switches the pair
    /// to descriptors once something of it is mapped.
    #[allow(clippy::too_many_arguments)]
    fn refresh(
        &self,
        st: &mut State,
        mine: &Table,
        theirs: &Table,
        s: usize,
        device: Option<&Arc<Device>>,
        paths: &[Path],
        placements: &[Placement],
    ) {
        let version = theirs.version().load(Ordering::Acquire);
        if version == st.seen_version[s] {
            return;
        }
        st.seen_version[s] = version;
        for i in 0..ENTRIES {
            let live = theirs.read(i);
            let current = st.imports[s][i].as_ref().map(|m| m.generation);
            if live.map(|e| e.generation) == current {
                continue;
            }
            if let Some(old) = st.imports[s][i].take() {
                mine.ack(s, i, 0, 0);
                // Programs of the sender numbered below its count now may still describe the
                // old mapping; keep it until they have run here.
                let until = widen(st.received[s], mine.pair(s).load(Ordering::Acquire) as u32);
                st.retiring.push(Retiring {
                    sender: s,
                    until,
                    event: None,
                    _reach: old.reach,
                });
            }
            let Some(e) = live else { continue };
            let reach = match self.reach(&e, s, device, paths, placements) {
                Ok(r) => r,
                Err(err) => {
                    crate::info!(
                        "rank {s}'s registered buffer at {:#x} cannot be mapped here ({}); its messages stay staged",
                        e.start,
                        err.msg
                    );
                    Reach::Unusable
                }
            };
            if let Some(base) = reach.base() {
                mine.ack(s, i, e.generation, base);
            }
            st.imports[s][i] = Some(Import {
                generation: e.generation,
                reach,
            });
        }
        let usable = st.imports[s]
            .iter()
            .flatten()
            .any(|m| m.reach.base().is_some());
        if usable && st.recv_switch[s].is_none() {
            let at = receiver_switch(mine.pair(s), st.received[s]);
            crate::info!(
                "messages from rank {s} are read through descriptors from its program {at} on"
            );
            st.recv_switch[s] = Some(at);
        }
    }

    fn reach(
        &self,
        e: &Entry,
        s: usize,
        device: Option<&Arc<Device>>,
        paths: &[Path],
        placements: &[Placement],
    ) -> Result<Reach> {
        if paths[s] == Path::SameProcess {
            if device.is_some_and(|d| !crate::cuda::readable_from(d, e.alloc_base)) {
                return crate::invalid_usage!(
                    "it is VMM memory of another GPU that does not grant this GPU access"
                );
            }
            return Ok(Reach::Direct(e.alloc_base));
        }
        let Some(device) = device else {
            return crate::internal_err!("mapping a peer's buffer without a device");
        };
        match e.kind {
            KIND_IPC => Ok(Reach::Mapped(share::import_ipc(device, &e.handle)?)),
            KIND_FD => {
                let fd = crate::sys::take_fd(placements[s].pid, e.fd)?;
                Ok(Reach::Mapped(share::import_fd(
                    device,
                    &fd,
                    e.alloc_len as usize,
                )?))
            }
            _ => crate::invalid_usage!("the allocation has no handle other processes can open"),
        }
    }

    /// After a program was enqueued on `stream`: lets go of retired mappings nothing reads any
    /// more.
    pub(crate) fn after_enqueue(&self, device: &Arc<Device>, stream: Stream) -> Result<()> {
        // An event recorded during graph capture becomes part of the graph and says nothing
        // about when work runs; retire on the next eager program instead.
        if stream.capturing() {
            return Ok(());
        }
        let mut st = self.state.lock();
        let received = st.received.clone();
        for r in st.retiring.iter_mut() {
            if r.event.is_none() && received[r.sender] >= r.until {
                let ev = Event::new(device)?;
                ev.record(stream)?;
                r.event = Some(ev);
            }
        }
        st.retiring
            .retain(|r| !r.event.as_ref().is_some_and(|e| e.done()));
        Ok(())
    }

    /// Whether this rank maps anything of its peers (which must outlive the device work).
    #[cfg(test)]
    pub(crate) fn holds_mappings(&self) -> bool {
        let st = self.state.lock();
        !st.retiring.is_empty() || st.imports.iter().flatten().any(|m| m.is_some())
    }
}

impl Plan {
    /// Where `peer` reads `len` bytes of this rank's memory at `addr` in place, if it mapped the
    /// registered buffer that holds them.
    pub(crate) fn peer_view(
        &self,
        shm: &ShmWorld,
        me: usize,
        peer: usize,
        addr: u64,
        len: usize,
    ) -> Option<u64> {
        let theirs = Table {
            seg: &shm.peer(peer)?.remote,
            nranks: shm.nranks(),
        };
        let &(generation, _, _, alloc_base, index) = self
            .exports
            .iter()
            .find(|e| addr >= e.1 && addr + len as u64 <= e.1 + e.2)?;
        let base = theirs.acked(me, index, generation)?;
        Some(base + (addr - alloc_base))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{new_unique_id, Bootstrap};
    use std::time::{Duration, Instant};

    /// The shared-memory worlds of `n` ranks that are threads of this process.
    fn worlds(n: usize) -> Vec<(ShmWorld, Vec<Path>, Vec<Placement>)> {
        let id = new_unique_id().expect("unique id");
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let id = id.clone();
                    s.spawn(move || {
                        let t = Some(Duration::from_secs(20));
                        let boot = Bootstrap::init(&[id], r, n, t).expect("bootstrap");
                        let me = crate::topo::this_process();
                        let placements = vec![me.clone(); n];
                        let paths: Vec<Path> =
                            (0..n).map(|q| me.path_to(&placements[q], q == r)).collect();
                        let deadline = Some(Instant::now() + Duration::from_secs(20));
                        let w = super::super::shm::connect(
                            &boot,
                            &paths,
                            &placements,
                            7,
                            area_bytes(n),
                            deadline,
                        )
                        .expect("shm");
                        (w, paths, placements)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn fake(base: u64, len: usize) -> share::Exported {
        share::Exported {
            alloc_base: base,
            alloc_len: len,
            how: None,
        }
    }

    /// Registration, the receiver's mapping and switch, the sender's view of where the
    /// receiver reads, deregistration and re-registration, between ranks that are threads
    /// (no GPU needed: same-process peers read by address).
    #[test]
    fn peers_map_registrations_and_agree_on_descriptors() {
        let w = worlds(3);
        let regs: Vec<Registry> = (0..3).map(|r| Registry::new(r, 3)).collect();
        let plan = |r: usize, to: &[usize], from: &[usize]| {
            let mut sends = vec![false; 3];
            let mut recvs = vec![false; 3];
            to.iter().for_each(|&p| sends[p] = true);
            from.iter().for_each(|&p| recvs[p] = true);
            regs[r].plan(&w[r].0, None, &w[r].1, &w[r].2, &sends, &recvs)
        };
        // Nothing registered: nobody describes anything.
        let p0 = plan(0, &[1], &[2]);
        let p1 = plan(1, &[2], &[0]);
        let p2 = plan(2, &[0], &[1]);
        for p in [&p0, &p1, &p2] {
            assert!(p.describe_to.iter().chain(&p.described_from).all(|d| !d));
        }
        // Rank 0 registers 4 KiB inside a larger allocation.
        let (alloc, buf) = (0x7000_0000u64, 0x7000_0100u64);
        let i = regs[0]
            .publish(&w[0].0, buf, 4096, Some(fake(alloc, 1 << 20)))
            .expect("a free entry");
        // Its next program to rank 1 (number 1) comes before rank 1 has looked: staged.
        let p0 = plan(0, &[1], &[]);
        assert!(!p0.describe_to[1]);
        // Rank 1 looks (its program number 1 from rank 0): it maps the buffer and switches
        // from the sender's next program on (number 2), not from its own (number 1).
        let p1 = plan(1, &[], &[0]);
        assert!(
            !p1.described_from[0],
            "rank 1 switched before rank 0 could know"
        );
        let p1 = plan(1, &[], &[0]);
        assert!(p1.described_from[0]);
        let p0 = plan(0, &[1, 2], &[]);
        assert!(p0.describe_to[1], "rank 0 missed the switch");
        assert!(!p0.describe_to[2], "rank 2 never asked for descriptors");
        // Rank 1 reads rank 0's bytes at their address (same process); rank 2 maps nothing.
        assert_eq!(p0.peer_view(&w[0].0, 0, 1, buf + 16, 64), Some(buf + 16));
        assert_eq!(
            p0.peer_view(&w[0].0, 0, 1, buf + 4090, 64),
            None,
            "past the buffer"
        );
        assert_eq!(
            p0.peer_view(&w[0].0, 0, 1, buf - 8, 4),
            None,
            "before the buffer"
        );
        assert_eq!(p0.peer_view(&w[0].0, 0, 2, buf + 16, 64), None);
        // Rank 2 maps it too once it looks; programs keep agreeing.
        let p2 = plan(2, &[], &[0]);
        assert!(!p2.described_from[0]);
        let p0 = plan(0, &[2], &[]);
        let p2 = plan(2, &[], &[0]);
        assert_eq!(p0.describe_to[2], p2.described_from[0]);
        assert_eq!(p0.peer_view(&w[0].0, 0, 2, buf, 4096), Some(buf));
        // Deregistered: no view any more, and rank 1 withdraws its acknowledgement and keeps
        // the old mapping until the programs that might use it are enqueued.
        regs[0].retract(&w[0].0, i);
        let p0 = plan(0, &[1], &[]);
        assert_eq!(p0.peer_view(&w[0].0, 0, 1, buf, 64), None);
        let p1 = plan(1, &[], &[0]);
        assert!(p1.described_from[0], "the pair stays on descriptors");
        assert_eq!(regs[1].state.lock().retiring.len(), 1);
        assert!(regs[1].holds_mappings());
        // A new registration in the same entry gets a new generation: the old
        // acknowledgement does not vouch for it until rank 1 has mapped it.
        let j = regs[0]
            .publish(&w[0].0, buf, 128, Some(fake(buf, 128)))
            .unwrap();
        assert_eq!(i, j);
        let p0 = plan(0, &[1], &[]);
        assert_eq!(p0.peer_view(&w[0].0, 0, 1, buf, 64), None, "not mapped yet");
        plan(1, &[], &[0]);
        let p0 = plan(0, &[1], &[]);
        assert_eq!(p0.peer_view(&w[0].0, 0, 1, buf, 64), Some(buf));
    }

    #[test]
    fn a_full_table_leaves_later_buffers_staged() {
        let w = worlds(2);
        let reg = Registry::new(0, 2);
        for k in 0..ENTRIES as u64 {
            let at = 0x1000_0000 + k * 0x1000;
            assert!(reg.publish(&w[0].0, at, 64, Some(fake(at, 4096))).is_some());
        }
        assert_eq!(
            reg.publish(&w[0].0, 0x9000_0000, 64, Some(fake(0x9000_0000, 64))),
            None
        );
        reg.retract(&w[0].0, 5);
        assert_eq!(
            reg.publish(&w[0].0, 0x9000_0000, 64, Some(fake(0x9000_0000, 64))),
            Some(5)
        );
    }

    #[test]
    fn widening_recovers_the_nearest_full_number() {
        assert_eq!(widen(10, 12), 12);
        assert_eq!(widen(10, 7), 7);
        assert_eq!(widen(0x1_0000_0005, 3), 0x1_0000_0003);
        assert_eq!(widen(0x1_ffff_fffe, 2), 0x2_0000_0002);
        assert_eq!(widen(0x2_0000_0001, 0xffff_fff0), 0x1_ffff_fff0);
    }

    /// Sender and receiver racing on the pair word from two threads: every program the sender
    /// counts is on the same side of the switch for both (the receiver's choice is no earlier
    /// than any number the sender had already used).
    #[test]
    fn sender_and_receiver_agree_on_the_switch() {
        for trial in 0..200u64 {
            let start = trial * 0x0800_0000; // crosses 2^32 on some trials
                                             // Both sides have numbered `start` programs of the pair so far.
            let word = Arc::new(AtomicU64::new(u64::from(start as u32)));
            let w = word.clone();
            let sender = std::thread::spawn(move || {
                (0..300u64)
                    .map(|k| sender_count(&w, start + k).map(|at| (start + k, at)))
                    .collect::<Vec<_>>()
            });
            // The receiver is somewhere around the sender (it may be ahead or behind).
            let mine = start + (trial % 7) * 40;
            std::thread::yield_now();
            let at = receiver_switch(&word, mine);
            let seen = sender.join().unwrap();
            assert!(
                at >= mine,
                "switch {at} before the receiver's next program {mine}"
            );
            for (k, s) in seen.iter().enumerate() {
                let number = start + k as u64;
                match s {
                    // Counted before the switch existed: the receiver must not describe it.
                    None => assert!(number < at, "program {number} missed the switch at {at}"),
                    Some((_, got)) => assert_eq!(*got, at),
                }
            }
            // And the receiver's answer stays the same when asked again.
            assert_eq!(receiver_switch(&word, mine + 5), at);
        }
    }
}
