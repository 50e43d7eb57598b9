// An in-process software model of the verbs the InfiniBand transport uses
// (`comm::testing::ib`), for ranks that are threads of one process. RC
// semantics as the transport relies on them: work requests of a queue pair take effect in
// order; a write with immediate lands its bytes before the target's receive completion and
// waits for a posted receive (an unlimited RNR retry); atomics are atomic against each other
// but, as on a real HCA, not against the CPU's atomics (the model reads the word, sleeps
// 20 us, then writes it); remote accesses are checked against registered memory and
// its keys. Memory registered through a dmabuf (GPUDirect RDMA; tests pass a memfd as the
// stand-in for a GPU's export) is mapped by the model from the descriptor, so that work
// requests naming its iova reach the descriptor's pages, not whatever the iova is in this
// process; a flag makes the device lack dmabuf support. Faults can be injected: a write or an
// atomic that completes with an error status (both ends of its connection go to error, as a
// real RC connection does), a connection broken outright, and completions delayed by a fixed
// time.
//
// The library's own conformance suite includes this file too (src/transport/conformance.rs),
// which is why its notes are plain comments and it names the crate `comm` only in `use`s.
//
// Everything happens under one lock, which is what makes the ordering easy to trust; a
// delayed operation is applied later by the fabric's thread, still in posting order.

use comm::error::{Error, ErrorKind, Result};
use comm::testing::ib::*;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What goes wrong, and when.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// The n-th write with data (counted from 1 over the whole fabric) completes with
    /// `status`, and its connection goes to error.
    pub fail_write: Option<(u64, String)>,
    /// Every operation takes effect (and completes) this much later than it was posted.
    pub delay: Option<Duration>,
    /// The n-th atomic (counted from 1 over the whole fabric) completes with `status`, and
    /// its connection goes to error.
    pub fail_atomic: Option<(u64, String)>,
    /// The device has no dmabuf registration (as with an rdma-core older than v34).
    pub no_dmabuf: bool,
}

struct Region {
    /// The device (one per opening: a rank's communicator) that registered it.
    device: u32,
    addr: u64,
    len: u64,
    key: u32,
    /// Where `addr` is in this process: the same for host memory, the model's own mapping of
    /// the descriptor for a dmabuf.
    host: u64,
    dmabuf: bool,
}

struct QpState {
    remote: Option<u32>,
    cq: VecDeque<Completion>,
    /// Posted receives, and writes with immediate waiting for one.
    recvs: VecDeque<u64>,
    waiting_imm: VecDeque<u32>,
    error: bool,
}

struct ModelQp {
    qpn: u32,
    fabric: Arc<Fabric>,
    notify: Arc<dyn Fn() + Send + Sync>,
}

struct State {
    qps: HashMap<u32, QpState>,
    notifies: HashMap<u32, Arc<dyn Fn() + Send + Sync>>,
    regions: Vec<Region>,
    next_qpn: u32,
    next_key: u32,
    writes: u64,
    /// Of those, plain writes (no immediate value).
    plain_writes: u64,
    /// RDMA reads and atomics carried out (or failed) so far.
    reads: u64,
    atomics: u64,
    /// Work requests whose remote memory, and whose local memory, was registered through a
    /// dmabuf.
    dmabuf_remote: u64,
    dmabuf_local: u64,
    /// Delayed operations: when, on which queue pair, what.
    later: VecDeque<(Instant, u32, SendWr)>,
    faults: Faults,
    /// Per device opened so far: queue pairs created, bytes registered now and at most.
    devices: Vec<DeviceUse>,
}

/// What one opened device (a rank's communicator) made.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceUse {
    pub queue_pairs: u32,
    pub registered: u64,
    pub peak_registered: u64,
}

pub struct Fabric {
    state: Mutex<State>,
    tick: Condvar,
}

const FLUSH: &str = "work request flushed error (5)";

impl Fabric {
    pub fn new(faults: Faults) -> Arc<Fabric> {
        let f = Arc::new(Fabric {
            state: Mutex::new(State {
                qps: HashMap::new(),
                notifies: HashMap::new(),
                regions: Vec::new(),
                next_qpn: 0x100,
                next_key: 0x1000,
                writes: 0,
                plain_writes: 0,
                reads: 0,
                atomics: 0,
                dmabuf_remote: 0,
                dmabuf_local: 0,
                later: VecDeque::new(),
                faults,
                devices: Vec::new(),
            }),
            tick: Condvar::new(),
        });
        if f.state.lock().unwrap().faults.delay.is_some() {
            let weak = Arc::downgrade(&f);
            std::thread::spawn(move || Fabric::deliver_later(weak));
        }
        f
    }

    /// Queue pairs created so far.
    pub fn queue_pairs(&self) -> u32 {
        self.state.lock().unwrap().next_qpn - 0x100
    }

    /// What each device opened so far made, in the order they were opened (one per rank's
    /// communicator: ranks that are threads open theirs in no particular order).
    pub fn per_device(&self) -> Vec<DeviceUse> {
        self.state.lock().unwrap().devices.clone()
    }

    /// Writes with data so far, over the whole fabric.
    pub fn writes(&self) -> u64 {
        self.state.lock().unwrap().writes
    }

    /// RDMA reads so far, over the whole fabric.
    pub fn reads(&self) -> u64 {
        self.state.lock().unwrap().reads
    }

    /// Atomics (fetch-add, compare-and-swap) so far, over the whole fabric.
    pub fn atomics(&self) -> u64 {
        self.state.lock().unwrap().atomics
    }

    /// Work requests carried out whose remote memory, and those whose local memory, was
    /// registered through a dmabuf, over the whole fabric.
    pub fn dmabuf_ops(&self) -> (u64, u64) {
        let st = self.state.lock().unwrap();
        (st.dmabuf_remote, st.dmabuf_local)
    }

    /// Registrations through a dmabuf alive now.
    pub fn dmabuf_regions(&self) -> usize {
        self.state
            .lock()
            .unwrap()
            .regions
            .iter()
            .filter(|r| r.dmabuf)
            .count()
    }

    /// Work requests posted but not yet carried out (with `delay`) whose local buffer
    /// overlaps `len` bytes at `addr`: what may still read that memory.
    pub fn pending_on(&self, addr: u64, len: u64) -> usize {
        let st = self.state.lock().unwrap();
        st.later
            .iter()
            .filter(|(_, _, wr)| {
                let l = &wr.local;
                l.len > 0 && l.addr < addr + len && addr < l.addr + u64::from(l.len)
            })
            .count()
    }

    /// Writes with data but no immediate value so far (the transport's pieces sent straight
    /// from registered user memory).
    pub fn plain_writes(&self) -> u64 {
        self.state.lock().unwrap().plain_writes
    }

    fn deliver_later(fabric: std::sync::Weak<Fabric>) {
        loop {
            let Some(f) = fabric.upgrade() else { return };
            let mut st = f.state.lock().unwrap();
            let due = st.later.front().map(|(t, _, _)| *t);
            match due {
                Some(t) if t <= Instant::now() => {
                    let (_, qpn, wr) = st.later.pop_front().unwrap();
                    let woken = apply(&mut st, qpn, &wr);
                    drop(st);
                    ring(&f, woken);
                }
                Some(t) => {
                    let left = t.saturating_duration_since(Instant::now());
                    let _ = f.tick.wait_timeout(st, left).unwrap();
                }
                None => {
                    let _ = f.tick.wait_timeout(st, Duration::from_millis(20)).unwrap();
                }
            }
        }
    }
}

fn ring(f: &Fabric, qpns: Vec<u32>) {
    let notifies: Vec<_> = {
        let st = f.state.lock().unwrap();
        qpns.iter()
            .filter_map(|q| st.notifies.get(q).cloned())
            .collect()
    };
    for n in notifies {
        n();
    }
}

/// Both ends of `qpn`'s connection go to error: their posted receives flush, later work
/// requests fail. Returns the queue pairs to wake.
fn break_connection(st: &mut State, qpn: u32) -> Vec<u32> {
    let peer = st.qps.get(&qpn).and_then(|q| q.remote);
    let mut woken = Vec::new();
    for q in [Some(qpn), peer].into_iter().flatten() {
        if let Some(s) = st.qps.get_mut(&q) {
            s.error = true;
            while let Some(id) = s.recvs.pop_front() {
                s.cq.push_back(Completion {
                    wr_id: id,
                    what: Completed::RecvImm(0),
                    error: Some(FLUSH.into()),
                });
            }
            woken.push(q);
        }
    }
    woken
}

/// Where `len` bytes at `addr` registered with `key` are in this process, and whether through
/// a dmabuf; None where no registration covers them.
fn translate(st: &State, addr: u64, len: u64, key: u32, local: bool) -> Option<(u64, bool)> {
    // A zero-byte local buffer needs no key; a remote one still names a registered region.
    if local && len == 0 {
        return Some((addr, false));
    }
    st.regions
        .iter()
        .find(|r| r.key == key && addr >= r.addr && addr + len <= r.addr + r.len)
        .map(|r| (r.host + (addr - r.addr), r.dmabuf))
}

/// Carries out one work request of `qpn`; returns the queue pairs to wake.
fn apply(st: &mut State, qpn: u32, wr: &SendWr) -> Vec<u32> {
    let complete = |st: &mut State, error: Option<String>| {
        if let Some(q) = st.qps.get_mut(&qpn) {
            if wr.signaled || error.is_some() {
                q.cq.push_back(Completion {
                    wr_id: wr.wr_id,
                    what: Completed::Send,
                    error,
                });
            }
        }
    };
    let (err, remote) = match st.qps.get(&qpn) {
        Some(q) => (q.error, q.remote),
        None => return Vec::new(),
    };
    if err {
        complete(st, Some(FLUSH.into()));
        return vec![qpn];
    }
    let Some(target) = remote.filter(|r| st.qps.get(r).is_some_and(|q| !q.error)) else {
        complete(st, Some("transport retry counter exceeded (12)".into()));
        let mut w = break_connection(st, qpn);
        w.push(qpn);
        return w;
    };
    let data = matches!(wr.op, Op::Write | Op::WriteImm(_)) && wr.local.len > 0;
    if data {
        st.writes += 1;
        if matches!(wr.op, Op::Write) {
            st.plain_writes += 1;
        }
        if let Some((n, status)) = st.faults.fail_write.clone() {
            if st.writes == n {
                complete(st, Some(status));
                let mut w = break_connection(st, qpn);
                w.push(qpn);
                return w;
            }
        }
    }
    match wr.op {
        Op::Read => st.reads += 1,
        Op::FetchAdd(_) | Op::CompareSwap(..) => {
            st.atomics += 1;
            if let Some((n, status)) = st.faults.fail_atomic.clone() {
                if st.atomics == n {
                    complete(st, Some(status));
                    let mut w = break_connection(st, qpn);
                    w.push(qpn);
                    return w;
                }
            }
        }
        _ => {}
    }
    let len = match wr.op {
        Op::FetchAdd(_) | Op::CompareSwap(..) => 8,
        _ => u64::from(wr.local.len),
    };
    let (Some((r, r_dmabuf)), Some((l, l_dmabuf))) = (
        translate(st, wr.remote.addr, len, wr.remote.rkey, false),
        translate(st, wr.local.addr, len, wr.local.lkey, true),
    ) else {
        complete(st, Some("remote access error (10)".into()));
        let mut w = break_connection(st, qpn);
        w.push(qpn);
        return w;
    };
    st.dmabuf_remote += u64::from(r_dmabuf);
    st.dmabuf_local += u64::from(l_dmabuf);
    // An atomic of the model is atomic against the others (the fabric's lock), not against
    // the CPU: it reads the word, sleeps a little, and writes it back, so that a CPU
    // atomic on the same word in between is lost, as it may be with a real HCA.
    let atomic = |r: *mut u8, new: &dyn Fn(u64) -> u64| -> u64 {
        // SAFETY: `r` is 8 bytes of registered memory (checked below before the call).
        unsafe {
            let p = r as *mut u64;
            let old = std::ptr::read_volatile(p);
            std::thread::sleep(Duration::from_micros(20));
            std::ptr::write_volatile(p, new(old));
            old
        }
    };
    // SAFETY: both ranges are registered memory of this process (translated above), which
    // the transport keeps alive while work requests are outstanding.
    unsafe {
        let (l, r) = (l as *mut u8, r as *mut u8);
        match wr.op {
            Op::Write | Op::WriteImm(_) => std::ptr::copy(l, r, len as usize),
            Op::Read => std::ptr::copy(r, l, len as usize),
            Op::FetchAdd(add) => {
                let old = atomic(r, &|v| v.wrapping_add(add));
                (l as *mut u64).write_unaligned(old);
            }
            Op::CompareSwap(cmp, swap) => {
                let old = atomic(r, &|v| if v == cmp { swap } else { v });
                (l as *mut u64).write_unaligned(old);
            }
        }
    }
    complete(st, None);
    let mut woken = vec![qpn];
    if let Op::WriteImm(imm) = wr.op {
        let t = st.qps.get_mut(&target).expect("checked");
        match t.recvs.pop_front() {
            Some(id) => t.cq.push_back(Completion {
                wr_id: id,
                what: Completed::RecvImm(imm),
                error: None,
            }),
            None => t.waiting_imm.push_back(imm),
        }
        woken.push(target);
    }
    woken
}

impl Qp for ModelQp {
    fn addr(&self) -> QpAddr {
        QpAddr {
            qpn: self.qpn,
            psn: self.qpn * 7 % 0xff_ffff,
            lid: 1,
            gid: [0; 16],
            mtu: 5,
        }
    }

    fn connect(&self, remote: &QpAddr) -> Result<()> {
        let mut st = self.fabric.state.lock().unwrap();
        if !st.qps.contains_key(&remote.qpn) {
            return Err(Error::new(
                ErrorKind::System,
                format!("no queue pair {:#x} on the fabric", remote.qpn),
            ));
        }
        st.qps.get_mut(&self.qpn).unwrap().remote = Some(remote.qpn);
        Ok(())
    }

    fn post_send(&self, wr: &SendWr) -> Result<()> {
        let mut st = self.fabric.state.lock().unwrap();
        if let Some(d) = st.faults.delay {
            st.later.push_back((Instant::now() + d, self.qpn, *wr));
            self.fabric.tick.notify_all();
            return Ok(());
        }
        let woken = apply(&mut st, self.qpn, wr);
        drop(st);
        ring(&self.fabric, woken);
        Ok(())
    }

    fn post_recv(&self, wr_id: u64) -> Result<()> {
        let mut st = self.fabric.state.lock().unwrap();
        let q = st.qps.get_mut(&self.qpn).unwrap();
        if q.error {
            q.cq.push_back(Completion {
                wr_id,
                what: Completed::RecvImm(0),
                error: Some(FLUSH.into()),
            });
        } else if let Some(imm) = q.waiting_imm.pop_front() {
            q.cq.push_back(Completion {
                wr_id,
                what: Completed::RecvImm(imm),
                error: None,
            });
        } else {
            q.recvs.push_back(wr_id);
            return Ok(());
        }
        drop(st);
        (self.notify)();
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<()> {
        let mut st = self.fabric.state.lock().unwrap();
        let q = st.qps.get_mut(&self.qpn).unwrap();
        while out.len() < max {
            match q.cq.pop_front() {
                Some(c) => out.push(c),
                None => break,
            }
        }
        Ok(())
    }

    fn arm(&self) -> Result<()> {
        Ok(())
    }
}

impl Drop for ModelQp {
    fn drop(&mut self) {
        let mut st = self.fabric.state.lock().unwrap();
        st.qps.remove(&self.qpn);
        st.notifies.remove(&self.qpn);
    }
}

struct ModelMr {
    key: u32,
    fabric: Arc<Fabric>,
    /// The model's mapping of a dmabuf (address, length), unmapped with the registration.
    map: Option<(usize, usize)>,
}

impl Mr for ModelMr {
    fn lkey(&self) -> u32 {
        self.key
    }

    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for ModelMr {
    fn drop(&mut self) {
        let mut st = self.fabric.state.lock().unwrap();
        if let Some(r) = st.regions.iter().find(|r| r.key == self.key) {
            let (device, len) = (r.device, r.len as i64);
            registered(&mut st, device, -len);
        }
        st.regions.retain(|r| r.key != self.key);
        if let Some((at, len)) = self.map {
            // SAFETY: mapped by register_dmabuf, no region names it any more.
            unsafe { libc::munmap(at as *mut libc::c_void, len) };
        }
    }
}

struct ModelDevice {
    fabric: Arc<Fabric>,
    id: u32,
}

/// `device` registered `len` more bytes (fewer, when negative).
fn registered(st: &mut State, device: u32, len: i64) {
    let d = &mut st.devices[device as usize];
    d.registered = (d.registered as i64 + len) as u64;
    d.peak_registered = d.peak_registered.max(d.registered);
}

impl Device for ModelDevice {
    fn name(&self) -> String {
        "model_0:1".into()
    }

    fn register(&self, addr: *mut u8, len: usize) -> Result<Arc<dyn Mr>> {
        let mut st = self.fabric.state.lock().unwrap();
        st.next_key += 1;
        let key = st.next_key;
        registered(&mut st, self.id, len as i64);
        st.regions.push(Region {
            device: self.id,
            addr: addr as u64,
            len: len as u64,
            key,
            host: addr as u64,
            dmabuf: false,
        });
        Ok(Arc::new(ModelMr {
            key,
            fabric: self.fabric.clone(),
            map: None,
        }))
    }

    fn dmabuf_support(&self) -> std::result::Result<(), String> {
        if self.fabric.state.lock().unwrap().faults.no_dmabuf {
            return Err("the model's device has no dmabuf registration".into());
        }
        Ok(())
    }

    fn register_dmabuf(
        &self,
        fd: std::os::fd::RawFd,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<Arc<dyn Mr>> {
        if let Err(why) = self.dmabuf_support() {
            return Err(Error::new(ErrorKind::InvalidUsage, why));
        }
        // Where the dmabuf begins in the descriptor's file: 0 for a real dmabuf (which cannot
        // seek, and always spans exactly the exported range) and for a test's memfd; the
        // software GPU (softgpu/) exports an inner range of an allocation as a new open file of
        // the allocation's memfd whose position is where the range starts.
        // SAFETY: lseek only reads the descriptor's position.
        let origin = match unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) } {
            p if p > 0 => p as u64,
            _ => 0,
        };
        let offset = origin + offset;
        // The pages of the descriptor, as an HCA reaches them: mapped from the page that
        // holds `offset`.
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        let start = offset / page * page;
        let map_len = (offset - start) as usize + len.max(1);
        // SAFETY: a fresh shared mapping of the caller's descriptor; checked below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                start as libc::off_t,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(Error::new(
                ErrorKind::System,
                format!(
                    "the model could not map dmabuf fd {fd} at {offset}: {}",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        let mut st = self.fabric.state.lock().unwrap();
        st.next_key += 1;
        let key = st.next_key;
        registered(&mut st, self.id, len as i64);
        st.regions.push(Region {
            device: self.id,
            addr: iova,
            len: len as u64,
            key,
            host: at as u64 + (offset - start),
            dmabuf: true,
        });
        Ok(Arc::new(ModelMr {
            key,
            fabric: self.fabric.clone(),
            map: Some((at as usize, map_len)),
        }))
    }

    fn create_qp(&self, _depth: u32, notify: Arc<dyn Fn() + Send + Sync>) -> Result<Arc<dyn Qp>> {
        let mut st = self.fabric.state.lock().unwrap();
        st.next_qpn += 1;
        let qpn = st.next_qpn;
        st.devices[self.id as usize].queue_pairs += 1;
        st.qps.insert(
            qpn,
            QpState {
                remote: None,
                cq: VecDeque::new(),
                recvs: VecDeque::new(),
                waiting_imm: VecDeque::new(),
                error: false,
            },
        );
        st.notifies.insert(qpn, notify.clone());
        Ok(Arc::new(ModelQp {
            qpn,
            fabric: self.fabric.clone(),
            notify,
        }))
    }
}

/// Hands out the model's one device, or says there is none.
pub struct ModelProvider {
    pub fabric: Option<Arc<Fabric>>,
}

impl Provider for ModelProvider {
    fn open(&self) -> Result<std::result::Result<Arc<dyn Device>, String>> {
        Ok(match &self.fabric {
            Some(f) => {
                let mut st = f.state.lock().unwrap();
                st.devices.push(DeviceUse::default());
                let id = st.devices.len() as u32 - 1;
                Ok(Arc::new(ModelDevice {
                    fabric: f.clone(),
                    id,
                }))
            }
            None => Err("the model has no device".into()),
        })
    }
}
