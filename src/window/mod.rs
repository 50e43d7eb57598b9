//! Windows, one-sided operations and symmetric memory.
//!
//! A [`Window`] is a region of every rank's memory, registered collectively, plus for each peer
//! the way this rank reaches that peer's region:
//!
//! - **direct**: the peer is this rank, a thread of this process, or a process on this host whose
//!   region the library allocated (a memfd every rank on the host maps): loads, stores and
//!   hardware atomics;
//! - **cma**: a process on this host whose region is ordinary memory: single-copy
//!   `process_vm_writev` / `readv`, and atomics under a lock in the target's control segment;
//! - **rdma**: a rank on another host, where the communicator's network transport is
//!   InfiniBand: RDMA writes, reads and verbs atomics on queue pairs of the windows' own
//!   (`transport::net::ib::onesided`). Device memory there, window parts and local buffers
//!   alike, is registered through a dmabuf (GPUDirect RDMA, [`gdr`]) or refused, saying why;
//! - **net**: a rank on another host otherwise: active messages over TCP, applied by a thread
//!   of the target ([`remote`]).
//!
//! None of them needs the target to call the library. Signals (NCCL's per-sender counters and
//! PyTorch-style signal pads) live in each rank's control segment ([`ctl`]), which the peers on
//! the host map; a signal is counted only after the data of its put is in place.
//!
//! Atomicity over RDMA. A verbs atomic is atomic only against other atomics executed by the
//! same HCA, not against the CPU's. So where a communicator's windows use InfiniBand, every
//! window atomic of that communicator, to any rank (this host's ranks and this rank itself
//! included), is a verbs atomic executed by the target's HCA: every rank has a queue pair to
//! every rank, a loopback one to itself, as NVSHMEM does. No window word is then ever changed
//! by a CPU atomic of the library while the HCA may change it. The signal counters and pads
//! stay CPU words: a signal over RDMA is a write with immediate whose completion handler, on
//! the target, counts it with a CPU atomic (RC places the data of the puts before it on the
//! same queue pair first, and the handler rings the target's doorbell); a pad is set by a read
//! and a write, which is safe because only its sender sets it and only the target clears it.

mod ctl;
mod fds;
pub(crate) mod gdr;
mod remote;
pub(crate) mod shared;

use crate::bootstrap::Bootstrap;
use crate::cuda::share::{self, Imported, Shareable};
use crate::cuda::{Device, MemKind, Stream};
use crate::error::{Error, ErrorKind, Result};
use crate::sys::{self, Mapping};
use crate::topo::Path;
use crate::topo::Placement;
use crate::transport::net::ib::onesided::{self, Exposed, OneSided};
use crate::transport::net::ib::verbs::{Remote, Source};
use crate::transport::net::ib::IbWorld;
use crate::transport::Link;
use crate::wait::{wait, Patience, Wait};
use crate::wire::{self, Reader};
use ctl::{Ctl, Stop};
use parking_lot::Mutex;
use remote::{Frame, NetSide};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What windows need of a communicator: its members, how to reach them, and its limits.
/// The communicator lends it (`Comm::window_members`); windows never see the communicator.
pub(crate) struct Members<'a> {
    pub rank: usize,
    pub nranks: usize,
    /// The communicator's tag, the same on every rank.
    pub tag: u64,
    pub boot: &'a Bootstrap,
    pub placements: &'a [Placement],
    pub paths: &'a [Path],
    /// One link per rank: whether a peer is still there.
    pub links: &'a [Arc<dyn Link>],
    pub abort: &'a AtomicBool,
    /// Give up (ncclTimeout) after this long.
    pub timeout: Option<Duration>,
    /// Spin this long before sleeping.
    pub spin: Duration,
    /// The communicator's GPU, when it has a device path (device-memory windows need it).
    pub device: Option<Arc<Device>>,
    /// The InfiniBand side of the network transport, where it is InfiniBand.
    pub ib: Option<&'a IbWorld>,
}

/// How this rank reaches one rank's part of a window.
pub(crate) enum Reach {
    /// Loads and stores at this address.
    Direct(usize),
    /// process_vm_writev / readv into process `pid` at `addr`.
    Cma { pid: u32, addr: usize },
    /// Active messages to the target, naming its window handle `id`.
    Net { id: u64 },
    /// RDMA into the target's memory at `addr` (in its process), registered with `rkey`.
    Rdma { addr: usize, rkey: u32 },
    /// Device memory at this address of this process (the peer's own GPU memory mapped with
    /// CUDA IPC, or a thread's in this process): copies by the driver, on a stream or not.
    Device(usize),
}

/// What keeps a peer's part mapped in this process.
enum Keep {
    Nothing,
    Host(#[allow(dead_code)] Mapping),
    Device(#[allow(dead_code)] Imported),
}

/// One rank's part of a window, as seen from this rank.
pub(crate) struct PeerWin {
    pub len: usize,
    /// Its address in its own process (for alignment checks).
    pub addr: usize,
    /// Its window slot in its control segment.
    pub slot: usize,
    /// Its handle for the window (what its slot's live word holds while registered).
    pub handle: u64,
    /// Atomics on it take the lock in its control segment (its memory is not shared).
    pub locked: bool,
    /// Its key for RDMA, where the communicator's windows use InfiniBand: then every atomic
    /// on it is a verbs atomic, whatever `data` says (see the module's notes).
    pub rkey: Option<u32>,
    pub data: Reach,
    _keep: Keep,
}

pub(crate) struct Window {
    pub handle: usize,
    /// (communicator tag, rank) of the communicator it was registered on.
    pub comm: (u64, usize),
    pub flags: i32,
    pub slot: usize,
    pub peers: Vec<PeerWin>,
    /// Memory allocated with the window (commWindowAllocate), freed with it.
    owned: Option<usize>,
    /// The communicator's window state (kept here so operations need no second look-up).
    cw: Arc<CommWindows>,
    /// This rank's GPU, for windows with a part in device memory (copies go through it).
    device: Option<Arc<Device>>,
    /// This rank's part registered with the InfiniBand device, until deregistration: taken
    /// then, before memory allocated with the window is freed, so that no remote access can
    /// reach the freed pages.
    exposed: Mutex<Option<Exposed>>,
}

/// A communicator's state for windows, made at its first window registration.
pub(crate) struct CommWindows {
    rank: usize,
    channels: usize,
    /// Control segments: ours, and those of the peers on this host.
    ctls: Vec<Option<Arc<Ctl>>>,
    /// NCCL signals already consumed by waits, per sender.
    waited: Vec<AtomicU64>,
    slots: Mutex<Vec<bool>>,
    net: Option<NetSide>,
    /// Peers reached over InfiniBand, where the network transport is InfiniBand.
    rdma: Option<Rdma>,
    /// Operations give up after this long (ncclTimeout).
    timeout: Option<Duration>,
    /// Stops the listener for peers on other hosts once this state is dropped.
    stop: Arc<AtomicBool>,
}

impl Drop for CommWindows {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Windows over InfiniBand: the queue pairs, and every rank's control segment as its peers
/// reach it (the signal pads; and some key for the zero-byte writes that carry signals).
struct Rdma {
    qps: OneSided,
    ctls: Vec<Remote>,
    _own_ctl: Exposed,
}

/// Window state by (communicator tag, rank); a few entries, so a list.
type CommKey = (u64, usize);
static COMMS: Mutex<Vec<(CommKey, Arc<CommWindows>)>> = Mutex::new(Vec::new());

fn find_comm(c: &Members) -> Option<Arc<CommWindows>> {
    let k = key(c);
    COMMS.lock().iter().find(|e| e.0 == k).map(|e| e.1.clone())
}
/// Live windows of this process, by handle number (handles are never reused).
static WINDOWS: Mutex<Vec<Option<Arc<Window>>>> = Mutex::new(Vec::new());
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(1);
/// A window registered with this flag is symmetric (every rank's part at one offset of its
/// allocation): the header's NCCL_WIN_COLL_SYMMETRIC (`ffi::types` checks).
pub(crate) const WIN_COLL_SYMMETRIC: i32 = 0x01;

const HANDLE_BASE: usize = 0x3a11_0000_0000;
const HANDLE_STEP: usize = 0x40;

fn handle_number(handle: usize) -> Option<usize> {
    let n = handle.checked_sub(HANDLE_BASE)?;
    (n % HANDLE_STEP == 0).then_some(n / HANDLE_STEP)
}

/// The live window with this handle, whatever its communicator.
pub(crate) fn window_by_handle(handle: usize) -> Option<Arc<Window>> {
    let n = handle_number(handle)?;
    WINDOWS.lock().get(n).cloned().flatten()
}

fn key(c: &Members) -> (u64, usize) {
    (c.tag, c.rank)
}

fn deadline_of(t: Option<Duration>) -> Option<Instant> {
    t.map(|t| Instant::now() + t)
}

/// Every rank says whether its part went well; all fail when one did, naming it.
fn agree(c: &Members, mine: Result<()>) -> Result<()> {
    let mut b = Vec::new();
    match &mine {
        Ok(()) => wire::put_u32(&mut b, 0),
        Err(e) => {
            wire::put_u32(&mut b, e.kind.code() as u32);
            wire::put_blob(&mut b, e.msg.as_bytes());
        }
    }
    let all = c.boot.allgather(&b)?;
    mine?;
    for (r, v) in all.iter().enumerate() {
        let mut rd = Reader::new(v);
        if rd.u32()? != 0 {
            return Err(Error::new(
                ErrorKind::InvalidUsage,
                format!(
                    "rank {r} could not take part in the window registration: {}",
                    rd.string()?
                ),
            ));
        }
    }
    Ok(())
}

/// The communicator's window state, made collectively the first time.
fn comm_windows(c: &Members) -> Result<Arc<CommWindows>> {
    if let Some(cw) = find_comm(c) {
        return Ok(cw);
    }
    let (me, n) = (c.rank, c.nranks);
    let channels = {
        let mine = (crate::env::WIN_CHANNELS.int().clamp(1, 4096) as u32).to_le_bytes();
        let b = c.boot.broadcast(0, &mine)?;
        u32::from_le_bytes(b[..4].try_into().unwrap_or(32u32.to_le_bytes())) as usize
    };
    let deadline = deadline_of(crate::bootstrap::init_timeout());
    let (own, fd) = Ctl::create(n, channels)?;
    let own = Arc::new(own);
    // The same tag on every rank: derived from the communicator alone.
    let tag = c.tag ^ 0x5769_6e43_746c_0000;
    let fds = fds::exchange(c.boot, c.paths, c.placements, tag, Some(&fd), deadline)?;
    let mut ctls: Vec<Option<Arc<Ctl>>> = Vec::with_capacity(n);
    for (r, f) in fds.iter().enumerate() {
        ctls.push(match f {
            _ if r == me => Some(own.clone()),
            Some(f) => Some(Arc::new(Ctl::open(f, n, channels)?)),
            None => None,
        });
    }
    let remote_peers = c.paths.contains(&Path::Network);
    // RDMA where every rank can: each needs a device, and all need the same protocol.
    let can_rdma = remote_peers && c.ib.is_some();
    let use_rdma = c
        .boot
        .allgather(&[u8::from(can_rdma)])?
        .iter()
        .all(|v| v.first() == Some(&1));
    let mut rdma = None;
    let mut mine = Vec::new();
    let mut lost = None;
    let stop = Arc::new(AtomicBool::new(false));
    if let (true, Some(ib)) = (use_rdma, c.ib) {
        let ctl = own.clone();
        let qps = ib.one_sided(
            c.boot,
            Arc::new(move |from, imm| {
                if imm == onesided::IMM_SIGNAL {
                    ctl.counter(from).fetch_add(1, Ordering::SeqCst);
                }
                ctl.ring();
            }),
        )?;
        let (base, len) = own.region();
        let exposed = qps.expose(Source::Host(base), len, false)?;
        wire::put_u64(&mut mine, base as u64);
        wire::put_u32(&mut mine, exposed.rkey);
        rdma = Some((qps, exposed));
    } else if remote_peers {
        let (addr, l) = remote::listen(
            c.boot.listen_ip(),
            c.tag,
            me,
            n,
            *c.boot.secret(),
            own.clone(),
            stop.clone(),
        )?;
        mine.extend_from_slice(&crate::bootstrap::encode_addr(&addr));
        lost = Some(l);
    }
    let addrs = c.boot.allgather(&mine)?;
    let rdma = match rdma {
        Some((qps, own_ctl)) => {
            let mut ctls = Vec::with_capacity(n);
            for a in &addrs {
                let mut r = Reader::new(a);
                ctls.push(Remote {
                    addr: r.u64()?,
                    rkey: r.u32()?,
                });
            }
            Some(Rdma {
                qps,
                ctls,
                _own_ctl: own_ctl,
            })
        }
        None => None,
    };
    let net = lost.map(|lost| {
        NetSide::new(
            me,
            c.tag,
            *c.boot.secret(),
            addrs
                .iter()
                .map(|a| crate::bootstrap::decode_addr(a))
                .collect(),
            lost,
            c.timeout,
        )
    });
    let cw = Arc::new(CommWindows {
        rank: me,
        channels,
        ctls,
        waited: (0..n).map(|_| AtomicU64::new(0)).collect(),
        slots: Mutex::new(vec![false; ctl::MAX_WINDOWS]),
        net,
        rdma,
        timeout: c.timeout,
        stop,
    });
    crate::info!(
        "windows ready: {channels} signal channels, {} peers reached over the network{}",
        c.paths.iter().filter(|p| **p == Path::Network).count(),
        if cw.rdma.is_some() {
            " (RDMA; every window atomic goes through the target's HCA)"
        } else {
            ""
        }
    );
    COMMS.lock().push((key(c), cw.clone()));
    Ok(cw)
}

fn existing(c: &Members, what: &str) -> Result<Arc<CommWindows>> {
    match find_comm(c) {
        Some(cw) => Ok(cw),
        None => crate::invalid_usage!(
            "{what} needs a window: register one on this communicator first (ncclCommWindowRegister is collective)"
        ),
    }
}

impl CommWindows {
    fn own(&self) -> &Ctl {
        self.ctls[self.rank]
            .as_deref()
            .expect("own control segment")
    }

    fn take_slot(&self) -> Result<usize> {
        let mut s = self.slots.lock();
        match s.iter().position(|u| !u) {
            Some(i) => {
                s[i] = true;
                self.own().reset_slot(i);
                Ok(i)
            }
            None => crate::invalid_usage!(
                "this communicator already has {} windows registered; deregister some first",
                ctl::MAX_WINDOWS
            ),
        }
    }

    fn rdma(&self, peer: usize) -> Result<&Rdma> {
        self.rdma.as_ref().map_or_else(
            || {
                crate::internal_err!(
                    "rank {peer} is reached by RDMA but windows have no queue pairs"
                )
            },
            Ok,
        )
    }

    fn deadline(&self) -> Option<Instant> {
        deadline_of(self.timeout)
    }

    fn net(&self, peer: usize) -> Result<&NetSide> {
        self.net.as_ref().map_or_else(
            || {
                crate::internal_err!(
                    "rank {peer} is on another host but windows have no network side"
                )
            },
            Ok,
        )
    }
}

/// ncclCommWindowRegister (and commWindowAllocate with `owned`): collective. `precheck` is
/// this rank's verdict on its arguments; every rank learns every verdict, so bad arguments on
/// one rank fail the call everywhere instead of leaving the others waiting.
pub(crate) fn register(
    c: &Members,
    buff: usize,
    size: usize,
    flags: i32,
    owned: bool,
    precheck: Result<()>,
) -> Result<usize> {
    let mut exported = None;
    let precheck = precheck.and_then(|_| {
        exported = device_part(c, buff)?;
        Ok(())
    });
    agree(c, precheck)?;
    let cw = comm_windows(c)?;
    let n = c.nranks;
    let slot = cw.take_slot();
    let shared = shared::find(buff, size);
    // Where peers reach windows by RDMA: this rank's part registered with the device, through
    // a dmabuf where it is device memory (the descriptor is closed once registered).
    let exposed = match (&cw.rdma, &exported) {
        (Some(r), _) => Some(gdr::PartSource::of(buff, size).and_then(|part| {
            r.qps.expose(part.source(), size, true).map_err(|e| {
                if part.is_device() {
                    e.context("GPUDirect RDMA of this rank's device-memory window part (ranks on other hosts reach it only that way; register host memory for windows across hosts where it is unavailable)")
                } else {
                    e
                }
            })
        }))
        .transpose(),
        (None, Some(_)) if c.paths.contains(&Path::Network) => {
            Err(Error::new(ErrorKind::InvalidUsage, ACROSS_HOSTS_NEEDS_IB))
        }
        (None, _) => Ok(None),
    };
    let rkey = exposed
        .as_ref()
        .ok()
        .and_then(|e| e.as_ref())
        .map_or(0, |e| e.rkey);
    let handle = HANDLE_BASE + HANDLE_STEP * NEXT_HANDLE.fetch_add(1, Ordering::SeqCst);
    let mut mine = Vec::new();
    match &slot {
        Ok(s) => wire::put_u32(&mut mine, *s as u32),
        Err(_) => wire::put_u32(&mut mine, u32::MAX),
    }
    for v in [buff as u64, size as u64, handle as u64] {
        wire::put_u64(&mut mine, v);
    }
    match &shared {
        Some((_, alloc_len, off)) => {
            wire::put_u32(&mut mine, 1);
            wire::put_u64(&mut mine, *alloc_len as u64);
            wire::put_u64(&mut mine, *off as u64);
        }
        None => wire::put_u32(&mut mine, 0),
    }
    // Device memory: how peers on this host map it, its allocation's length and our offset.
    match &exported {
        None => wire::put_u32(&mut mine, DEV_NONE),
        Some(ex) => {
            match &ex.how {
                None => wire::put_u32(&mut mine, DEV_UNSHARED),
                Some(Shareable::Ipc(h)) => {
                    wire::put_u32(&mut mine, DEV_IPC);
                    wire::put_blob(&mut mine, h);
                }
                Some(Shareable::Fd(_)) => wire::put_u32(&mut mine, DEV_FD),
            }
            wire::put_u64(&mut mine, ex.alloc_len as u64);
            wire::put_u64(&mut mine, (buff as u64).wrapping_sub(ex.alloc_base));
        }
    }
    wire::put_u32(&mut mine, rkey);
    let all = c.boot.allgather(&mine)?;
    struct Info {
        slot: u32,
        addr: usize,
        len: usize,
        handle: u64,
        shared: Option<(usize, usize)>,
        /// Device memory: (how, IPC handle, allocation length, offset in it).
        dev: Option<(u32, [u8; 64], usize, usize)>,
        /// Its key for RDMA (0 without).
        rkey: u32,
    }
    let mut infos = Vec::with_capacity(n);
    for b in &all {
        let mut r = Reader::new(b);
        let slot = r.u32()?;
        let (addr, len, handle) = (r.u64()? as usize, r.u64()? as usize, r.u64()?);
        let shared = if r.u32()? != 0 {
            Some((r.u64()? as usize, r.u64()? as usize))
        } else {
            None
        };
        let dev = match r.u32()? {
            DEV_NONE => None,
            how => {
                let mut ipc = [0u8; 64];
                if how == DEV_IPC {
                    let h = r.blob()?;
                    if h.len() != 64 {
                        return crate::internal_err!("a CUDA IPC handle of {} bytes", h.len());
                    }
                    ipc.copy_from_slice(&h);
                }
                Some((how, ipc, r.u64()? as usize, r.u64()? as usize))
            }
        };
        let rkey = r.u32()?;
        infos.push(Info {
            slot,
            addr,
            len,
            handle,
            shared,
            dev,
            rkey,
        });
    }
    let taken = slot.as_ref().ok().copied();
    let release = |cw: &CommWindows| {
        if let Some(s) = taken {
            cw.slots.lock()[s] = false;
        }
    };
    if let Some(r) = infos.iter().position(|i| i.slot == u32::MAX) {
        release(&cw);
        slot?;
        return crate::invalid_usage!(
            "rank {r} already has {} windows registered on this communicator",
            ctl::MAX_WINDOWS
        );
    }
    let slot = slot?;
    // Library memory: hand its memfd to the peers on this host, which map it.
    let mut data_fds: Vec<Option<std::os::fd::OwnedFd>> = (0..n).map(|_| None).collect();
    if infos.iter().any(|i| i.shared.is_some()) {
        let deadline = deadline_of(crate::bootstrap::init_timeout());
        let tag = c.tag ^ 0x5769_6e44_6174_0000 ^ ((infos[0].handle) << 16);
        match fds::exchange(
            c.boot,
            c.paths,
            c.placements,
            tag,
            shared.as_ref().map(|s| &s.0),
            deadline,
        ) {
            Ok(f) => data_fds = f,
            Err(e) => {
                release(&cw);
                return Err(e);
            }
        }
    }
    // VMM device memory (ncclMemAlloc) travels as a file descriptor.
    let mut dev_fds: Vec<Option<std::os::fd::OwnedFd>> = (0..n).map(|_| None).collect();
    if infos.iter().any(|i| matches!(i.dev, Some((DEV_FD, ..)))) {
        let deadline = deadline_of(crate::bootstrap::init_timeout());
        let tag = c.tag ^ 0x5769_6e44_6576_0000 ^ ((infos[0].handle) << 16);
        let mine = match &exported {
            Some(share::Exported {
                how: Some(Shareable::Fd(fd)),
                ..
            }) => Some(fd),
            _ => None,
        };
        match fds::exchange(c.boot, c.paths, c.placements, tag, mine, deadline) {
            Ok(f) => dev_fds = f,
            Err(e) => {
                release(&cw);
                return Err(e);
            }
        }
    }
    let rdma = cw.rdma.is_some();
    let exposed_failed = exposed.as_ref().err().cloned();
    let built = (|| -> Result<Vec<PeerWin>> {
        if let Some(e) = exposed_failed {
            return Err(e.context("registering the window with the InfiniBand device"));
        }
        let mut peers = Vec::with_capacity(n);
        for (r, i) in infos.iter().enumerate() {
            if let Some((how, ipc, alloc_len, off)) = &i.dev {
                let rkey = rdma.then_some(i.rkey);
                let (data, keep) = device_reach(
                    c,
                    r,
                    i.addr,
                    *how,
                    ipc,
                    *alloc_len,
                    *off,
                    &mut dev_fds[r],
                    rkey,
                )?;
                peers.push(PeerWin {
                    len: i.len,
                    addr: i.addr,
                    slot: i.slot as usize,
                    handle: i.handle,
                    // Atomics on device memory are a read and a write by the driver, or
                    // verbs atomics of the target's HCA where windows use RDMA.
                    locked: true,
                    rkey,
                    data,
                    _keep: keep,
                });
                continue;
            }
            let (data, map, locked) = match c.paths[r] {
                Path::SelfRank | Path::SameProcess => {
                    (Reach::Direct(i.addr), None, i.shared.is_none())
                }
                Path::SameHost => match (&i.shared, &data_fds[r]) {
                    (Some((alloc_len, off)), Some(fd)) => {
                        let m = Mapping::map(fd.as_raw_fd(), *alloc_len)?;
                        (Reach::Direct(m.ptr() as usize + off), Some(m), false)
                    }
                    _ => {
                        let pid = c.placements[r].pid;
                        if i.len > 0 {
                            let mut probe = [0u8; 1];
                            if let Err(e) =
                                // SAFETY: probe is one writable byte.
                                unsafe { sys::cma_read(pid, probe.as_mut_ptr(), i.addr, 1) }
                            {
                                return crate::invalid_usage!(
                                    "rank {r}'s window ({} bytes at {:#x}) is ordinary memory of another process (pid {pid}), and this rank may not reach it with process_vm_readv/writev: {e}. Allocate window memory with ncclMemAlloc or commMemAllocShared (shared memory every rank on the host maps), or allow the ranks to trace each other (kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE)",
                                    i.len, i.addr
                                );
                            }
                        }
                        (Reach::Cma { pid, addr: i.addr }, None, true)
                    }
                },
                Path::Network if rdma => (
                    Reach::Rdma {
                        addr: i.addr,
                        rkey: i.rkey,
                    },
                    None,
                    false,
                ),
                Path::Network => (Reach::Net { id: i.handle }, None, i.shared.is_none()),
            };
            peers.push(PeerWin {
                len: i.len,
                addr: i.addr,
                slot: i.slot as usize,
                handle: i.handle,
                locked,
                rkey: rdma.then_some(i.rkey),
                data,
                _keep: map.map_or(Keep::Nothing, Keep::Host),
            });
        }
        Ok(peers)
    })();
    let ok = built.as_ref().map(|_| ()).map_err(|e| e.clone());
    // Published before the last agreement: once any rank is past it, every rank's window is
    // in its table, so a peer's first put over the network finds it.
    let at = handle / HANDLE_STEP - HANDLE_BASE / HANDLE_STEP;
    let published = built.ok().map(|peers| {
        let has_device = peers.iter().any(|p| matches!(p.data, Reach::Device(_)));
        let w = Arc::new(Window {
            handle,
            comm: key(c),
            flags,
            slot,
            peers,
            owned: owned.then_some(buff),
            cw: cw.clone(),
            device: c.device.clone().filter(|_| has_device),
            exposed: Mutex::new(exposed.ok().flatten()),
        });
        let mut all = WINDOWS.lock();
        if all.len() <= at {
            all.resize(at + 1, None);
        }
        all[at] = Some(w.clone());
        cw.own().live(slot).store(handle as u64, Ordering::SeqCst);
        w
    });
    if let Err(e) = agree(c, ok) {
        if published.is_some() {
            WINDOWS.lock()[at] = None;
            cw.own().live(slot).store(0, Ordering::SeqCst);
        }
        release(&cw);
        return Err(e);
    }
    let Some(w) = published else {
        return crate::internal_err!("window registration agreed although this rank failed");
    };
    crate::info!(
        "window {handle:#x}: {size} bytes at {buff:#x}; peers reached {}",
        w.peers
            .iter()
            .enumerate()
            .map(|(r, p)| format!(
                "{r}:{}",
                match p.data {
                    Reach::Direct(_) => "direct",
                    Reach::Cma { .. } => "cma",
                    Reach::Net { .. } => "net",
                    Reach::Rdma { .. } => "rdma",
                    Reach::Device(_) => "device",
                }
            ))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(handle)
}

/// Why a device-memory window part cannot be reached from other hosts without InfiniBand.
const ACROSS_HOSTS_NEEDS_IB: &str = "this communicator has ranks on other hosts, which reach a device-memory window part only by GPUDirect RDMA over InfiniBand, and its network transport is not InfiniBand (COMM_NET / NCCL_NET, NCCL_IB_DISABLE, or a rank without an RDMA device): register host memory for windows across hosts, or run over InfiniBand";

const DEV_NONE: u32 = 0;
/// Device memory without a handle another process can map (VMM memory not from ncclMemAlloc).
const DEV_UNSHARED: u32 = 1;
const DEV_IPC: u32 = 2;
const DEV_FD: u32 = 3;

/// This rank's verdict on a window part at `buff`: None for host memory; for device memory,
/// the allocation around it and how peers in other processes may map it.
fn device_part(c: &Members, buff: usize) -> Result<Option<share::Exported>> {
    let MemKind::Device(ordinal) = crate::cuda::classify(buff as *const std::ffi::c_void) else {
        return Ok(None);
    };
    let Some(dev) = &c.device else {
        return crate::invalid_usage!(
            "buff is memory of GPU {ordinal}, but this communicator has no device path (it was made without a usable GPU on some rank; see the INFO lines of its init): register host memory, or make the communicator with every rank on a GPU"
        );
    };
    if dev.ordinal != ordinal {
        return crate::invalid_usage!(
            "buff is memory of GPU {ordinal}, but this communicator's GPU is {}",
            dev.ordinal
        );
    }
    if c.paths.contains(&Path::Network) && c.ib.is_none() {
        return crate::invalid_usage!("{}", ACROSS_HOSTS_NEEDS_IB);
    }
    share::export(dev, buff as u64).map(Some)
}

/// How this rank reaches rank `r`'s device-memory part at `addr` (in r's process); `rkey`
/// where windows use RDMA (the part was registered through a dmabuf).
#[allow(clippy::too_many_arguments)]
fn device_reach(
    c: &Members,
    r: usize,
    addr: usize,
    how: u32,
    ipc: &[u8; 64],
    alloc_len: usize,
    off: usize,
    fd: &mut Option<std::os::fd::OwnedFd>,
    rkey: Option<u32>,
) -> Result<(Reach, Keep)> {
    // GPUDirect RDMA: its part was registered through a dmabuf; no GPU of this rank involved.
    if c.paths[r] == Path::Network {
        return match rkey {
            Some(rkey) => Ok((Reach::Rdma { addr, rkey }, Keep::Nothing)),
            None => crate::invalid_usage!(
                "rank {r}'s window part is device memory on another host, and windows of this communicator do not use RDMA: {ACROSS_HOSTS_NEEDS_IB}"
            ),
        };
    }
    let Some(dev) = &c.device else {
        return crate::invalid_usage!(
            "rank {r}'s window part is device memory, but this rank's communicator has no device path"
        );
    };
    let imported = match c.paths[r] {
        // A thread of this process (or this rank): the address is valid here.
        Path::SelfRank | Path::SameProcess => return Ok((Reach::Device(addr), Keep::Nothing)),
        Path::Network => return crate::internal_err!("a network peer's device part handled above"),
        Path::SameHost => match (how, fd.take()) {
            (DEV_IPC, _) => share::import_ipc(dev, ipc)?,
            (DEV_FD, Some(fd)) => share::import_fd(dev, &fd, alloc_len)?,
            _ => {
                return crate::invalid_usage!(
                    "rank {r}'s window part is device memory that another process cannot map (virtual memory not from ncclMemAlloc); allocate window memory with cudaMalloc or ncclMemAlloc"
                )
            }
        },
    };
    let at = imported.base() as usize + off;
    Ok((Reach::Device(at), Keep::Device(imported)))
}

/// The window behind `handle`, which must belong to communicator `c`.
pub(crate) fn lookup(c: &Members, handle: usize) -> Result<Arc<Window>> {
    match window_by_handle(handle) {
        Some(w) if w.comm == key(c) => Ok(w),
        Some(_) => crate::invalid_arg!(
            "window {handle:#x} was registered on another communicator; use a window of this one"
        ),
        None => crate::invalid_arg!(
            "window {handle:#x} is not a live window (never registered, or already deregistered)"
        ),
    }
}

/// ncclCommWindowDeregister: local. Memory allocated with the window is freed.
pub(crate) fn deregister(c: &Members, handle: usize) -> Result<()> {
    let w = lookup(c, handle)?;
    if let Some(n) = handle_number(handle) {
        WINDOWS.lock()[n] = None;
    }
    retire(&w);
    Ok(())
}

/// A window leaves this rank (deregistered, or its communicator destroyed or aborted): peers on
/// this host look at its live word before they reach into it, so it is cleared first (puts
/// and atomics into the memory of a destroyed communicator's windows, reused by then,
/// succeeded while only deregistering cleared it); then its slot, its exposure to peers on
/// other hosts and the memory allocated with it go.
fn retire(w: &Window) {
    w.cw.own().live(w.slot).store(0, Ordering::SeqCst);
    w.cw.slots.lock()[w.slot] = false;
    w.exposed.lock().take();
    if let Some(p) = w.owned {
        shared::free(p as *mut u8);
    }
}

/// The communicator is going away (destroy, abort): its windows go with it, memory allocated
/// with them is freed, its listener stops and its connections close.
pub(crate) fn forget(c: &Members) {
    let k = key(c);
    COMMS.lock().retain(|e| e.0 != k);
    let gone: Vec<Arc<Window>> = WINDOWS
        .lock()
        .iter_mut()
        .filter(|w| w.as_ref().is_some_and(|w| w.comm == k))
        .filter_map(Option::take)
        .collect();
    for w in gone {
        retire(&w);
    }
}

/// This rank's own address of the window.
pub(crate) fn user_ptr(c: &Members, handle: usize) -> Result<usize> {
    let w = lookup(c, handle)?;
    Ok(w.peers[c.rank].addr)
}

fn peer_index(c: &Members, peer: i32) -> Result<usize> {
    match usize::try_from(peer) {
        Ok(p) if p < c.nranks => Ok(p),
        _ => crate::invalid_arg!(
            "peer {peer} is out of range for a communicator of {} ranks",
            c.nranks
        ),
    }
}

/// Checks a peer number: the rank it names.
pub(crate) fn check_peer(c: &Members, peer: i32) -> Result<usize> {
    peer_index(c, peer)
}

/// Checks an access of `len` bytes at `off` of `peer`'s part of window `handle`.
/// Returns the window and the peer's rank.
pub(crate) fn check_access(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    len: usize,
) -> Result<(Arc<Window>, usize)> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    check_range(&w.peers[peer], off, len, peer)?;
    Ok((w, peer))
}

pub(crate) fn check_range(p: &PeerWin, off: usize, len: usize, peer: usize) -> Result<()> {
    match off.checked_add(len) {
        Some(end) if end <= p.len => Ok(()),
        _ => crate::invalid_arg!(
            "offset {off} + {len} bytes is past the end of rank {peer}'s window ({} bytes)",
            p.len
        ),
    }
}

/// A local buffer in device memory goes only with a window part in device memory (the copy
/// is the GPU's) or one reached by RDMA (GPUDirect); host buffers go with either.
pub(crate) fn check_local(buf: usize, name: &str, w: &Window, peer: usize) -> Result<()> {
    if let MemKind::Device(d) = crate::cuda::classify(buf as *const std::ffi::c_void) {
        if !w.is_device(peer) && !matches!(w.peers[peer].data, Reach::Rdma { .. }) {
            return crate::invalid_usage!(
                "{name} is memory of GPU {d}, but rank {peer}'s part of the window is host memory: use a host buffer, or register the window on device memory"
            );
        }
    }
    Ok(())
}

impl Window {
    /// The GPU that copies into and out of this window's device-memory parts.
    fn device_of(&self) -> Result<&Device> {
        match &self.device {
            Some(d) => Ok(d),
            None => crate::internal_err!("a device-memory window without a device"),
        }
    }

    /// Whether `peer`'s part is device memory (then this rank has the communicator's GPU).
    pub(crate) fn is_device(&self, peer: usize) -> bool {
        matches!(self.peers[peer].data, Reach::Device(_))
    }
}

/// Refuses an operation into `peer`'s part of `w` once the peer has deregistered it (peers
/// on this host; across hosts the target's server refuses it). Deregistration is local, as in
/// NCCL, so this catches a program that deregisters too early instead of letting a put land
/// in memory the peer may have freed and reused.
fn check_live(cw: &CommWindows, w: &Window, peer: usize) -> Result<()> {
    let p = &w.peers[peer];
    match &cw.ctls[peer] {
        Some(ctl) if peer != cw.rank && ctl.live(p.slot).load(Ordering::Acquire) != p.handle => {
            crate::invalid_usage!(
                "rank {peer} has deregistered its part of window {:#x} (or destroyed or aborted its communicator); one-sided operations into it are refused (ncclCommWindowDeregister is local: every rank must be done with a window before any rank deregisters it)",
                w.handle
            )
        }
        _ => Ok(()),
    }
}

fn cma_error(peer: usize, what: &str, e: std::io::Error) -> Error {
    let kind = if e.raw_os_error() == Some(libc::ESRCH) {
        ErrorKind::Remote
    } else {
        ErrorKind::System
    };
    Error::new(kind, format!("{what} rank {peer}'s window: {e}"))
}

/// Puts `len` bytes from `src` at `off` of `peer`'s part of window `handle`, then (with
/// `signal`) counts one NCCL signal at the peer, seen only after the data.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads.
pub(crate) unsafe fn put(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    src: *const u8,
    len: usize,
    signal: bool,
) -> Result<()> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    check_range(&w.peers[peer], off, len, peer)?;
    check_local(src as usize, "localbuff", &w, peer)?;
    // SAFETY: `peer` and the range were checked just above, as `put_checked` requires; `src`
    // holds `len` bytes (this function's caller), and without a stream the copy is done on
    // return.
    unsafe { put_checked(&w, peer, off, src, len, signal, None) }
}

/// [`put`] on a window already looked up, with `peer` and the range checked. Into device
/// memory with a `stream` (ncclPutSignal), the copy and then the signal are queued on it: the
/// signal is counted once the copy is done. Over RDMA from device memory with a `stream`, the
/// put waits for the stream first. Otherwise the put is complete on return.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads (until the stream reaches the copy, with one).
pub(crate) unsafe fn put_checked(
    w: &Window,
    peer: usize,
    off: usize,
    src: *const u8,
    len: usize,
    signal: bool,
    stream: Option<Stream>,
) -> Result<()> {
    let p = &w.peers[peer];
    let cw = &*w.cw;
    check_live(cw, w, peer)?;
    match p.data {
        Reach::Device(base) => {
            let dev = w.device_of()?;
            let (dst, src) = ((base + off) as u64, src as u64);
            if let Some(s) = stream {
                s.copy(dst, src, len)?;
                if signal {
                    signal_on(s, w.cw.clone(), peer)?;
                }
                return Ok(());
            }
            crate::cuda::copy_sync(dev, dst, src, len)?;
        }
        // SAFETY: the destination lies inside the peer's registered window (checked by the
        // caller), mapped here; the caller guarantees src holds len bytes.
        Reach::Direct(base) => unsafe { store_direct((base + off) as *mut u8, src, len) },
        Reach::Cma { pid, addr } => {
            if len > 0 {
                // SAFETY: the caller guarantees src holds len bytes.
                unsafe { sys::cma_write(pid, src, addr + off, len) }
                    .map_err(|e| cma_error(peer, "writing into", e))?;
            }
        }
        Reach::Rdma { addr, rkey } => {
            let r = cw.rdma(peer)?;
            let to = Remote {
                addr: (addr + off) as u64,
                rkey,
            };
            let from_device = stream.zip(match crate::cuda::classify(src.cast()) {
                MemKind::Device(o) => Some(o),
                MemKind::Host => None,
            });
            if let Some((s, o)) = from_device {
                // A device-memory source (GPUDirect RDMA) written by work queued on the
                // stream: the HCA reads it once that is done, the caller waiting meanwhile, as
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
            unsafe { r.qps.put(peer, src, len, to, lkey, cw.deadline()) }?;
            if signal {
                // On the same queue pair: counted at the target after the data landed.
                r.qps
                    .notify(peer, onesided::IMM_SIGNAL, r.ctls[peer], cw.deadline())?;
            }
            return Ok(());
        }
        Reach::Net { id } => {
            // SAFETY: the caller guarantees src holds len bytes.
            let payload = unsafe { std::slice::from_raw_parts(src, len) };
            let f = Frame {
                op: remote::OP_PUT,
                flags: if signal { remote::FLAG_SIGNAL } else { 0 },
                win: id,
                off: off as u64,
                len: len as u64,
                ..Default::default()
            };
            cw.net(peer)?.call(peer, &f, payload, false, &mut [])?;
            return Ok(());
        }
    }
    if signal {
        signal_to(cw, peer)?;
    }
    Ok(())
}

/// What ncclPutSignal's short way (see `ffi::lane`) needs of a window, worked out once: for
/// each peer whose part is host memory this process maps, where it is, how long, the word
/// that says it is still registered, and the control segment its signals count in. Puts from
/// a host buffer into such a part, with the window symmetric and the range inside it, go the
/// short way; anything else, and a part its rank deregistered, is left to the full path,
/// which decides and reports.
pub(crate) struct DirectPuts {
    rank: usize,
    peers: Vec<Option<DirectPeer>>,
    /// Holds every mapping the pointers below point into.
    _w: Arc<Window>,
}

struct DirectPeer {
    base: *mut u8,
    len: usize,
    /// The peer's live word for this window and the handle it holds while the part is
    /// registered (None for this rank's own part).
    live: Option<(*const AtomicU64, u64)>,
    ctl: *const Ctl,
}

impl DirectPuts {
    pub(crate) fn new(w: Arc<Window>) -> DirectPuts {
        let cw = &w.cw;
        let symmetric = w.flags & WIN_COLL_SYMMETRIC != 0;
        let peers = (0..w.peers.len())
            .map(|r| {
                let p = &w.peers[r];
                match (&p.data, &cw.ctls[r]) {
                    (&Reach::Direct(base), Some(ctl)) if symmetric => Some(DirectPeer {
                        base: base as *mut u8,
                        len: p.len,
                        live: (r != cw.rank).then(|| (ctl.live(p.slot) as *const _, p.handle)),
                        ctl: &**ctl,
                    }),
                    _ => None,
                }
            })
            .collect();
        DirectPuts {
            rank: cw.rank,
            peers,
            _w: w,
        }
    }

    /// Puts `len` bytes from `src` at `off` of `peer`'s part and signals it: true once done;
    /// false, having done nothing, where the full path must take the call.
    ///
    /// # Safety
    /// As `put`: `src` must be valid for `len` bytes of reads.
    pub(crate) unsafe fn put_signal(
        &self,
        peer: usize,
        off: usize,
        src: *const u8,
        len: usize,
    ) -> bool {
        let Some(Some(d)) = self.peers.get(peer) else {
            return false;
        };
        // The full path's checks: the range (check_range), a host source buffer for a host
        // part (check_local), the part still registered (check_live).
        let plain = off.checked_add(len).is_some_and(|end| end <= d.len)
            && !matches!(
                crate::cuda::classify(src.cast()),
                crate::cuda::MemKind::Device(_)
            )
            && d.live.is_none_or(|(word, handle)| {
                // SAFETY: the live word sits in the peer's control block, which the window
                // `_w` (held by `self`) keeps mapped.
                unsafe { &*word }.load(Ordering::Acquire) == handle
            });
        if plain {
            // SAFETY: inside the peer's part (checked), mapped here; src as this function's.
            unsafe { store_direct(d.base.add(off), src, len) };
            // SAFETY: `ctl` points into the window's control blocks, which `_w` keeps alive.
            signal_ctl(unsafe { &*d.ctl }, self.rank);
        }
        plain
    }
}

/// A put's bytes into a part mapped here. `src` and `dst` may overlap when a rank puts into its
/// own window (a word is read whole before it is written). One word, the common signal
/// payload, goes without a call to memmove.
///
/// # Safety
/// `dst` valid for `len` bytes of writes, `src` for `len` bytes of reads.
#[inline]
unsafe fn store_direct(dst: *mut u8, src: *const u8, len: usize) {
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

/// One NCCL signal from rank `from` to the rank whose control segment this is, seen after
/// every store `from` made before it.
#[inline]
fn signal_ctl(ctl: &Ctl, from: usize) {
    ctl.counter(from).fetch_add(1, Ordering::SeqCst);
    ctl.ring();
}

fn signal_to(cw: &CommWindows, peer: usize) -> Result<()> {
    match &cw.ctls[peer] {
        Some(ctl) => {
            signal_ctl(ctl, cw.rank);
            Ok(())
        }
        None if cw.rdma.is_some() => {
            let r = cw.rdma(peer)?;
            r.qps
                .notify(peer, onesided::IMM_SIGNAL, r.ctls[peer], cw.deadline())
        }
        None => {
            let f = Frame {
                op: remote::OP_SIGNAL,
                ..Default::default()
            };
            cw.net(peer)?.call(peer, &f, &[], false, &mut [])?;
            Ok(())
        }
    }
}

/// One NCCL signal to `peer`, counted once everything queued on `s` before it is done.
fn signal_on(s: Stream, cw: Arc<CommWindows>, peer: usize) -> Result<()> {
    s.host_fn(Box::new(move || {
        if let Err(e) = signal_to(&cw, peer) {
            crate::warn!(
                "a signal to rank {peer} queued on a stream was lost: {}",
                e.msg
            );
        }
    }))
}

/// ncclSignal: one NCCL signal to `peer`, after every earlier put and signal to it. On a
/// communicator with a GPU it is queued on `stream`, behind the puts queued there before it.
pub(crate) fn signal(c: &Members, peer: i32, stream: Option<Stream>) -> Result<()> {
    let peer = peer_index(c, peer)?;
    let cw = existing(c, "ncclSignal")?;
    match stream.filter(|_| c.device.is_some()) {
        Some(s) => signal_on(s, cw, peer),
        None => signal_to(&cw, peer),
    }
}

/// Reads `len` bytes at `off` of `peer`'s part of window `handle` into `dst`.
///
/// # Safety
/// `dst` must be valid for `len` bytes of writes.
pub(crate) unsafe fn get(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    dst: *mut u8,
    len: usize,
) -> Result<()> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    let p = &w.peers[peer];
    check_range(p, off, len, peer)?;
    check_live(&w.cw, &w, peer)?;
    check_local(dst as usize, "localbuff", &w, peer)?;
    if len == 0 {
        return Ok(());
    }
    match p.data {
        Reach::Device(base) => {
            crate::cuda::copy_sync(w.device_of()?, dst as u64, (base + off) as u64, len)?
        }
        // SAFETY: the source lies inside the peer's window; the caller guarantees dst holds len bytes.
        Reach::Direct(base) => unsafe { std::ptr::copy((base + off) as *const u8, dst, len) },
        // SAFETY: as above.
        Reach::Cma { pid, addr } => unsafe { sys::cma_read(pid, dst, addr + off, len) }
            .map_err(|e| cma_error(peer, "reading from", e))?,
        Reach::Rdma { addr, rkey } => {
            let from = Remote {
                addr: (addr + off) as u64,
                rkey,
            };
            let r = w.cw.rdma(peer)?;
            let lkey = gdr::local_key(&r.qps, dst as usize, len, "localbuff")?;
            // SAFETY: the caller guarantees dst holds len bytes.
            unsafe { r.qps.get(peer, dst, len, from, lkey, w.cw.deadline()) }?;
        }
        Reach::Net { id } => {
            let cw = w.cw.clone();
            let f = Frame {
                op: remote::OP_GET,
                win: id,
                off: off as u64,
                len: len as u64,
                ..Default::default()
            };
            // SAFETY: the caller guarantees dst holds len bytes.
            let out = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            cw.net(peer)?.call(peer, &f, &[], true, out)?;
        }
    }
    Ok(())
}

/// An 8-byte atomic on `peer`'s part of `w` done by this process (the peer is reached
/// directly or with CMA): fetch-add of `val`, or with `cas` a compare-and-swap to `val`.
/// Returns the old value. `ctl` is the target's control segment (for the lock); `stop` ends a
/// wait for the lock.
pub(crate) fn atomic_at(
    w: &Window,
    peer: usize,
    off: usize,
    cas: Option<u64>,
    val: u64,
    ctl: &Ctl,
    stop: Stop,
) -> Result<u64> {
    let p = &w.peers[peer];
    // The lock of the word where it lies in the target's memory, whichever window reaches it.
    let key = p.addr + off;
    let new = |old: u64| match cas {
        Some(cmp) if old == cmp => val,
        Some(_) => old,
        None => old.wrapping_add(val),
    };
    match p.data {
        Reach::Direct(base) => {
            // SAFETY: the word lies inside the window (checked by the caller), is 8-byte aligned
            // (checked too) and is only ever accessed atomically by the library.
            let a = unsafe { &*((base + off) as *const AtomicU64) };
            if p.locked {
                ctl.locked(key, stop, || {
                    let old = a.load(Ordering::SeqCst);
                    crate::fault::point("window_atomic_locked");
                    a.store(new(old), Ordering::SeqCst);
                    old
                })
            } else {
                Ok(match cas {
                    Some(cmp) => {
                        match a.compare_exchange(cmp, val, Ordering::SeqCst, Ordering::SeqCst) {
                            Ok(v) | Err(v) => v,
                        }
                    }
                    None => a.fetch_add(val, Ordering::SeqCst),
                })
            }
        }
        Reach::Cma { pid, addr } => ctl.locked(key, stop, || {
            let mut old = [0u8; 8];
            // SAFETY: old is 8 writable bytes.
            unsafe { sys::cma_read(pid, old.as_mut_ptr(), addr + off, 8) }
                .map_err(|e| cma_error(peer, "an atomic on", e))?;
            let old = u64::from_ne_bytes(old);
            crate::fault::point("window_atomic_locked");
            let v = new(old);
            if v != old {
                // SAFETY: v is 8 readable bytes.
                unsafe { sys::cma_write(pid, v.to_ne_bytes().as_ptr(), addr + off, 8) }
                    .map_err(|e| cma_error(peer, "an atomic on", e))?;
            }
            Ok(old)
        })?,
        Reach::Device(base) => {
            let dev = w.device_of()?;
            ctl.locked(key, stop, || {
                let mut old = 0u64;
                let at = (base + off) as u64;
                crate::cuda::copy_sync(dev, &mut old as *mut u64 as u64, at, 8)?;
                crate::fault::point("window_atomic_locked");
                let v = new(old);
                if v != old {
                    crate::cuda::copy_sync(dev, at, &v as *const u64 as u64, 8)?;
                }
                Ok(old)
            })?
        }
        Reach::Net { .. } | Reach::Rdma { .. } => {
            crate::internal_err!("atomic on a remote window applied locally")
        }
    }
}

/// 8-byte fetch-add (`cas` None) or compare-and-swap on `peer`'s window at `off`; the old value.
pub(crate) fn atomic(
    c: &Members,
    handle: usize,
    peer: i32,
    off: usize,
    cas: Option<u64>,
    val: u64,
) -> Result<u64> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    let p = &w.peers[peer];
    check_range(p, off, 8, peer)?;
    if (p.addr + off) % 8 != 0 {
        return crate::invalid_arg!(
            "atomics need an 8-byte aligned target; offset {off} of rank {peer}'s window is at address {:#x}",
            p.addr + off
        );
    }
    let cw = w.cw.clone();
    if let (Some(r), Some(rkey)) = (&cw.rdma, p.rkey) {
        // Every atomic through the target's HCA, this host's ranks and this rank included.
        check_live(&cw, &w, peer)?;
        let at = Remote {
            addr: (p.addr + off) as u64,
            rkey,
        };
        return r.qps.atomic(peer, at, cas, val, deadline_of(c.timeout));
    }
    match p.data {
        Reach::Net { id } => {
            let f = Frame {
                op: if cas.is_some() {
                    remote::OP_CAS
                } else {
                    remote::OP_FETCH_ADD
                },
                win: id,
                off: off as u64,
                a: cas.unwrap_or(0),
                b: val,
                ..Default::default()
            };
            cw.net(peer)?.call(peer, &f, &[], true, &mut [])
        }
        _ => {
            let ctl = cw.ctls[peer].as_deref().ok_or_else(|| {
                Error::new(ErrorKind::Internal, "no control segment for a local peer")
            })?;
            check_live(&cw, &w, peer)?;
            // The word is mapped here and outlives its owner: an atomic into a rank that is
            // gone would succeed and return a value nobody will see change again.
            if peer != c.rank {
                c.links[peer].check_peer()?;
            }
            atomic_at(
                &w,
                peer,
                off,
                cas,
                val,
                ctl,
                Stop {
                    deadline: deadline_of(c.timeout),
                    abort: Some(c.abort),
                },
            )
        }
    }
}

/// Returns once every earlier put from this rank to `peer` (every peer when None) has landed.
pub(crate) fn flush(c: &Members, handle: usize, peer: Option<i32>) -> Result<()> {
    let w = lookup(c, handle)?;
    let peers = match peer {
        Some(p) => vec![peer_index(c, p)?],
        None => (0..c.nranks).collect(),
    };
    std::sync::atomic::fence(Ordering::SeqCst);
    if let Some(dev) = &w.device {
        // Puts into device memory queued on streams (ncclPutSignal) are done once the device is.
        crate::cuda::synchronize(dev)?;
    }
    let cw = w.cw.clone();
    for p in peers {
        if let Reach::Rdma { .. } = w.peers[p].data {
            let r = cw.rdma(p)?;
            // Any 8 bytes of the peer serve the read that ends the flush: its control segment.
            r.qps.flush(p, r.ctls[p], deadline_of(c.timeout))?;
        }
        if let Reach::Net { id } = w.peers[p].data {
            let f = Frame {
                op: remote::OP_FLUSH,
                win: id,
                ..Default::default()
            };
            cw.net(p)?.call(p, &f, &[], true, &mut [])?;
        }
    }
    Ok(())
}

/// The address at which this rank reaches `peer`'s window with loads and stores, if it can.
pub(crate) fn peer_ptr(c: &Members, handle: usize, peer: i32) -> Result<Option<usize>> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    check_live(&w.cw, &w, peer)?;
    Ok(match w.peers[peer].data {
        Reach::Direct(a) | Reach::Device(a) => Some(a),
        _ => None,
    })
}

/// The bytes of `peer`'s part of window `handle` (sizes may differ between ranks).
pub(crate) fn peer_size(c: &Members, handle: usize, peer: i32) -> Result<usize> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    Ok(w.peers[peer].len)
}

/// ncclGetPeerDevicePointer: the device address at which this rank's GPU reaches `offset` of
/// `peer`'s part of window `handle` (a device-memory window; NCCL takes no communicator here).
pub(crate) fn peer_device_ptr(handle: usize, offset: usize, peer: i32) -> Result<usize> {
    let Some(w) = window_by_handle(handle) else {
        return crate::invalid_arg!(
            "window {handle:#x} is not a live window (never registered, or already deregistered)"
        );
    };
    let peer = match usize::try_from(peer) {
        Ok(p) if p < w.peers.len() => p,
        _ => {
            return crate::invalid_arg!(
                "peer {peer} is out of range for a window of {} ranks",
                w.peers.len()
            )
        }
    };
    check_range(&w.peers[peer], offset, 0, peer)?;
    check_live(&w.cw, &w, peer)?;
    match w.peers[peer].data {
        Reach::Device(a) => Ok(a + offset),
        _ => crate::invalid_usage!(
            "rank {peer}'s part of window {handle:#x} is host memory, which has no device pointer (commWinPeerPtr gives host addresses)"
        ),
    }
}

/// `peer`'s signal pads of window `handle` (channels x nranks u32 words) where this rank maps
/// them, and the number of channels.
pub(crate) fn signal_pads(c: &Members, handle: usize, peer: i32) -> Result<(Option<usize>, usize)> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    let cw = w.cw.clone();
    Ok((
        cw.ctls[peer]
            .as_ref()
            .map(|ctl| ctl.pads_ptr(w.peers[peer].slot) as usize),
        cw.channels,
    ))
}

/// Waits until `ready`, failing when `peer` is lost, the communicator aborted, or `limit`
/// passed, as `wait` says: spins briefly (at least `MIN_SPIN`), then sleeps on this rank's
/// bell. `ready` may consume what it finds (a signal-pad word), so the wait ends the first
/// time it returns true.
#[inline(never)]
fn wait_until(
    c: &Members,
    cw: &CommWindows,
    peer: usize,
    limit: Option<Duration>,
    what: &dyn Fn() -> String,
    ready: &mut dyn FnMut() -> bool,
) -> Result<()> {
    let patience = Patience {
        spin: c.spin.max(MIN_SPIN),
        yield_for: Duration::ZERO,
        nap: Duration::from_millis(10),
        warn_after: None,
        timeout: limit,
    };
    wait(
        &patience,
        &mut ForPeer {
            c,
            cw,
            peer,
            what,
            ready,
        },
    )
}

/// Looks at a signal word before a wait takes the slow way (`wait_until`).
const QUICK_LOOKS: u32 = 256;

/// A signal as short as a ping-pong's is worth this much spinning before a sleep.
const MIN_SPIN: Duration = Duration::from_micros(20);

/// A window wait for something `peer` does.
struct ForPeer<'a, 'm> {
    c: &'a Members<'m>,
    cw: &'a CommWindows,
    peer: usize,
    what: &'a dyn Fn() -> String,
    ready: &'a mut dyn FnMut() -> bool,
}

impl Wait for ForPeer<'_, '_> {
    type Out = ();

    fn look(&mut self) -> Result<Option<()>> {
        Ok((self.ready)().then_some(()))
    }

    fn sleep(&mut self, nap: Duration) -> Result<Option<()>> {
        Ok(self.cw.own().sleep_unless(nap, self.ready).then_some(()))
    }

    fn check(&mut self) -> Result<Option<()>> {
        let (c, peer) = (self.c, self.peer);
        if c.abort.load(Ordering::SeqCst) {
            return crate::invalid_usage!(
                "the communicator was aborted while waiting for {}",
                (self.what)()
            );
        }
        if peer != c.rank {
            if let Some(gone) = peer_lost(c, self.cw, peer) {
                // What it sent before it went still counts.
                if (self.ready)() {
                    return Ok(Some(()));
                }
                return Err(Error::lost_peer(
                    peer,
                    format!(
                        "rank {peer} is gone while this rank waited for {}: {gone}",
                        (self.what)()
                    ),
                ));
            }
        }
        Ok(None)
    }

    fn warn(&mut self, _: Duration) {}

    fn timed_out(&mut self, _: Duration) -> Error {
        Error::new(
            ErrorKind::Timeout,
            format!("timed out waiting for {}", (self.what)()),
        )
    }
}

/// Why `peer` can no longer signal this rank, if it cannot: its link says it is gone, or (on
/// another host) its window connection closed.
fn peer_lost(c: &Members, cw: &CommWindows, peer: usize) -> Option<String> {
    if let Err(e) = c.links[peer].check_peer() {
        return Some(e.msg);
    }
    if let Some(e) = cw.rdma.as_ref().and_then(|r| r.qps.failure(peer)) {
        return Some(e.msg);
    }
    let net = cw.net.as_ref().filter(|_| c.paths[peer] == Path::Network)?;
    (net.lost[peer].load(Ordering::SeqCst) || net.peer_gone(peer)).then(|| {
        "its connection closed (its process exited, or its host or the link failed)".to_string()
    })
}

/// ncclWaitSignal: for each (peer, opCnt), waits until `peer` has sent `opCnt` more signals
/// than earlier waits consumed, and consumes them.
pub(crate) fn wait_signals(
    c: &Members,
    descs: impl IntoIterator<Item = (usize, u64)>,
) -> Result<()> {
    let cw = existing(c, "ncclWaitSignal")?;
    wait_signals_on(c, &cw, descs)
}

/// The communicator's window state, once it has registered a window.
pub(crate) fn registered_state(c: &Members) -> Option<Arc<CommWindows>> {
    find_comm(c)
}

/// [`wait_signals`] with the communicator's window state already at hand.
pub(crate) fn wait_signals_on(
    c: &Members,
    cw: &CommWindows,
    descs: impl IntoIterator<Item = (usize, u64)>,
) -> Result<()> {
    for (peer, n) in descs {
        if took_signals(cw, peer, n) {
            continue;
        }
        let goal = cw.waited[peer].load(Ordering::Relaxed) + n;
        let counter = cw.own().counter(peer);
        wait_until(
            c,
            cw,
            peer,
            c.timeout,
            &|| {
                format!(
                    "signals from rank {peer} ({} of {goal} arrived)",
                    counter.load(Ordering::SeqCst)
                )
            },
            &mut || counter.load(Ordering::Acquire) >= goal,
        )?;
        consume_signals(cw, peer, goal);
    }
    Ok(())
}

/// The first look of a wait for `n` more signals from `peer` (`peer` in range): a short spin
/// without the clock, in which a ping-pong's signal comes. True, having consumed them, when
/// they arrived; false, having consumed nothing, when the wait must go the slow way.
pub(crate) fn took_signals(cw: &CommWindows, peer: usize, n: u64) -> bool {
    let goal = cw.waited[peer].load(Ordering::Relaxed) + n;
    let counter = cw.own().counter(peer);
    let arrived = (0..QUICK_LOOKS).any(|_| counter.load(Ordering::Acquire) >= goal);
    if arrived {
        consume_signals(cw, peer, goal);
    }
    arrived
}

/// Counts the signals from `peer` up to `goal` as consumed by waits.
fn consume_signals(cw: &CommWindows, peer: usize, goal: u64) {
    // Not fetch_max: a locked instruction on the ping-pong's path, while only a thread that
    // waits on this communicator moves it (calls on one communicator are not made from
    // several threads at once), and never backwards.
    let waited = &cw.waited[peer];
    if waited.load(Ordering::Relaxed) < goal {
        waited.store(goal, Ordering::Relaxed);
    }
}

fn channel_of(cw: &CommWindows, channel: i32) -> Result<usize> {
    match usize::try_from(channel) {
        Ok(ch) if ch < cw.channels => Ok(ch),
        _ => crate::invalid_arg!(
            "channel {channel} is out of range: windows have {} signal channels (COMM_WIN_CHANNELS)",
            cw.channels
        ),
    }
}

fn pad_deadline(c: &Members, timeout_ms: u64) -> Option<Instant> {
    if timeout_ms > 0 {
        deadline_of(Some(Duration::from_millis(timeout_ms)))
    } else {
        deadline_of(c.timeout)
    }
}

/// PyTorch's put_signal: sets this rank's pad word for `channel` at `dst` from 0 to 1, waiting
/// while it is still 1 from the previous signal.
pub(crate) fn channel_signal(
    c: &Members,
    handle: usize,
    dst: i32,
    channel: i32,
    timeout_ms: u64,
) -> Result<()> {
    let (w, dst, ch) = channel_args(c, handle, dst, channel)?;
    check_live(&w.cw, &w, dst)?;
    channel_signal_to(c, &w.cw, &w, dst, ch, pad_deadline(c, timeout_ms))
}

/// The window, peer and channel of a channel operation, checked.
fn channel_args(
    c: &Members,
    handle: usize,
    peer: i32,
    channel: i32,
) -> Result<(Arc<Window>, usize, usize)> {
    let w = lookup(c, handle)?;
    let peer = peer_index(c, peer)?;
    let ch = channel_of(&w.cw, channel)?;
    Ok((w, peer, ch))
}

fn channel_signal_to(
    c: &Members,
    cw: &CommWindows,
    w: &Window,
    dst: usize,
    ch: usize,
    deadline: Option<Instant>,
) -> Result<()> {
    let me = c.rank;
    let mut pause = Duration::from_micros(1);
    loop {
        let set = match (&cw.ctls[dst], &w.peers[dst].data) {
            (Some(ctl), _) => {
                let ok = ctl
                    .pad(w.peers[dst].slot, ch, me)
                    .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok();
                if ok {
                    ctl.ring();
                }
                ok
            }
            (None, Reach::Rdma { .. }) => {
                let r = cw.rdma(dst)?;
                let pad = Remote {
                    addr: r.ctls[dst].addr + cw.own().pad_offset(w.peers[dst].slot, ch, me) as u64,
                    rkey: r.ctls[dst].rkey,
                };
                r.qps.set_pad(dst, pad, deadline)?
            }
            (None, Reach::Net { id }) => {
                let f = Frame {
                    op: remote::OP_PAD_CAS,
                    win: *id,
                    off: ch as u64,
                    a: 0,
                    b: 1,
                    ..Default::default()
                };
                cw.net(dst)?.call(dst, &f, &[], true, &mut [])? == 0
            }
            (None, _) => return crate::internal_err!("rank {dst}'s signal pads are unreachable"),
        };
        if set {
            return Ok(());
        }
        if c.abort.load(Ordering::SeqCst) {
            return crate::invalid_usage!(
                "the communicator was aborted while waiting to signal rank {dst} on channel {ch}"
            );
        }
        if dst != me {
            if let Err(e) = c.links[dst].check_peer() {
                return Err(Error::lost_peer(
                    dst,
                    format!("rank {dst} is gone while this rank waited to signal it on channel {ch}: {}", e.msg),
                ));
            }
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            return crate::timeout_err!(
                "timed out signalling rank {dst} on channel {ch}: it has not consumed the previous signal"
            );
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_micros(200));
    }
}

/// PyTorch's wait_signal: waits until `src` has signalled this rank on `channel`, and clears it.
pub(crate) fn channel_wait(
    c: &Members,
    handle: usize,
    src: i32,
    channel: i32,
    timeout_ms: u64,
) -> Result<()> {
    let (w, src, ch) = channel_args(c, handle, src, channel)?;
    channel_wait_from(c, &w.cw, &w, src, ch, pad_deadline(c, timeout_ms))
}

fn channel_wait_from(
    c: &Members,
    cw: &CommWindows,
    w: &Window,
    src: usize,
    ch: usize,
    deadline: Option<Instant>,
) -> Result<()> {
    let pad = cw.own().pad(w.slot, ch, src);
    let limit = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    wait_until(
        c,
        cw,
        src,
        limit,
        &|| format!("a signal from rank {src} on channel {ch}"),
        &mut || {
            pad.compare_exchange(1, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        },
    )
}

/// PyTorch's barrier: signal every peer on `channel`, then wait for every peer's signal.
pub(crate) fn channel_barrier(
    c: &Members,
    handle: usize,
    channel: i32,
    timeout_ms: u64,
) -> Result<()> {
    let w = lookup(c, handle)?;
    let cw = w.cw.clone();
    let ch = channel_of(&cw, channel)?;
    let deadline = pad_deadline(c, timeout_ms);
    // As channel_signal does: a peer's pads that now belong to another window must not be
    // set (its wait there would end on this rank's signal).
    for p in (0..c.nranks).filter(|&p| p != c.rank) {
        check_live(&cw, &w, p)?;
    }
    for p in (0..c.nranks).filter(|&p| p != c.rank) {
        channel_signal_to(c, &cw, &w, p, ch, deadline)?;
    }
    for p in (0..c.nranks).filter(|&p| p != c.rank) {
        channel_wait_from(c, &cw, &w, p, ch, deadline)?;
    }
    Ok(())
}
