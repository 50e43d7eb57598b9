//! Registration and deregistration, collective: the ranks agree, exchange how each reaches
//! the others' parts (shared memory, CMA, IPC or file descriptors for device memory, RDMA,
//! the network), and map them.

use super::ctl::Ctl;
use super::reach;
use super::registry::{
    find_comm, handle_number, key, lookup, COMMS, HANDLE_BASE, HANDLE_STEP, NEXT_HANDLE, WINDOWS,
};
use super::remote::NetSide;
use super::{
    ctl, deadline_of, fds, gdr, remote, shared, CommWindows, Keep, Members, PeerWin, RdmaSide,
    Reach, Window,
};
use crate::cuda::share::{self, Shareable};
use crate::cuda::MemKind;
use crate::error::{Error, ErrorKind, Result};
use crate::sys::{self, Mapping};
use crate::topo::Path;
use crate::transport::net::ib::onesided;
use crate::transport::net::ib::onesided::Exposed;
use crate::transport::net::ib::verbs::{Remote, Source};
use crate::transport::net::ib::IbWorld;
use crate::transport::Doorbell;
use crate::wire::{self, Reader};
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Every rank says whether its part went well; all fail when one did, naming it.
pub(super) fn agree(c: &Members, mine: Result<()>) -> Result<()> {
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

/// The communicator's window state, made collectively the first time: the signal channels
/// agreed, every rank's control segment mapped by its peers on the host, and the ranks on
/// other hosts reached by RDMA or the network.
pub(super) fn comm_windows(c: &Members) -> Result<Arc<CommWindows>> {
    if let Some(cw) = find_comm(c) {
        return Ok(cw);
    }
    let channels = {
        let mine = (crate::env::WIN_CHANNELS.int().clamp(1, 4096) as u32).to_le_bytes();
        let b = c.boot.broadcast(0, &mine)?;
        u32::from_le_bytes(b[..4].try_into().unwrap_or(32u32.to_le_bytes())) as usize
    };
    let (ctls, own_fd) = control_segments(c, channels)?;
    let own = ctls[c.rank].clone().expect("own control segment");
    let stop = Arc::new(AtomicBool::new(false));
    let (rdma, net) = other_hosts(c, &own, &stop)?;
    // Only now, past a collective step after the exchange, may it close (see
    // `control_segments`).
    drop(own_fd);
    let cw = Arc::new(CommWindows {
        rank: c.rank,
        channels,
        ctls,
        waited: (0..c.nranks).map(|_| AtomicU64::new(0)).collect(),
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

/// Collective: every rank's control segment as this rank maps it: a new one of its own, and
/// those of the peers on this host; and the descriptor of its own. Threads of this process
/// duplicate that descriptor by its number in their part of the exchange, which may end after
/// this rank's: the caller keeps it open until every rank has passed a later collective step.
fn control_segments(c: &Members, channels: usize) -> Result<(Vec<Option<Arc<Ctl>>>, OwnedFd)> {
    let n = c.nranks;
    let deadline = deadline_of(crate::bootstrap::init_timeout());
    let (own, fd) = Ctl::create(n, channels)?;
    let own = Arc::new(own);
    // The same tag on every rank: derived from the communicator alone.
    let tag = c.tag ^ 0x5769_6e43_746c_0000;
    let fds = fds::exchange(c.boot, c.paths, c.placements, tag, Some(&fd), deadline)?;
    let mut ctls = Vec::with_capacity(n);
    for (r, f) in fds.iter().enumerate() {
        ctls.push(match f {
            _ if r == c.rank => Some(own.clone()),
            Some(f) => Some(Arc::new(Ctl::open(f, n, channels)?)),
            None => None,
        });
    }
    Ok((ctls, fd))
}

/// Collective: how this rank reaches ranks on other hosts: RDMA where every rank can (each
/// needs a device, and all need the same protocol), else active messages over TCP served by
/// a listener of this rank's (stopped by `stop`). Every rank takes part, with or without
/// such peers.
fn other_hosts(
    c: &Members,
    own: &Arc<Ctl>,
    stop: &Arc<AtomicBool>,
) -> Result<(Option<RdmaSide>, Option<NetSide>)> {
    let remote_peers = c.paths.contains(&Path::Network);
    let can_rdma = remote_peers && c.ib().is_some();
    let use_rdma = c
        .boot
        .allgather(&[u8::from(can_rdma)])?
        .iter()
        .all(|v| v.first() == Some(&1));
    match c.ib().filter(|_| use_rdma) {
        Some(ib) => rdma_side(c, ib, own).map(|r| (Some(r), None)),
        None if remote_peers => net_side(c, own, stop).map(|n| (None, Some(n))),
        None => c.boot.allgather(&[]).map(|_| (None, None)),
    }
}

/// Windows' queue pairs to every rank, and every rank's control segment registered with its
/// device (for the signals and pads carried by RDMA).
fn rdma_side(c: &Members, ib: &IbWorld, own: &Arc<Ctl>) -> Result<RdmaSide> {
    let ctl = own.clone();
    let qps = ib.one_sided(
        c.boot,
        Arc::new(move |from, imm| {
            if imm == onesided::IMM_SIGNAL {
                ctl.counter(from).fetch_add(1, Ordering::SeqCst);
            }
            // A pad was written by the HCA, not by a SeqCst store of this thread: the
            // doorbell's ring, with its fence.
            Doorbell::ring(&*ctl);
        }),
    )?;
    let (base, len) = own.region();
    let exposed = qps.expose(Source::Host(base), len, false)?;
    let mut mine = Vec::new();
    wire::put_u64(&mut mine, base as u64);
    wire::put_u32(&mut mine, exposed.rkey);
    let mut ctls = Vec::with_capacity(c.nranks);
    for a in &c.boot.allgather(&mine)? {
        let mut r = Reader::new(a);
        ctls.push(Remote {
            addr: r.u64()?,
            rkey: r.u32()?,
        });
    }
    Ok(RdmaSide {
        qps,
        ctls,
        _own_ctl: exposed,
    })
}

/// Window requests from other hosts, taken from this rank's connection service, and the way
/// to send this rank's own (connections made when first needed).
fn net_side(c: &Members, own: &Arc<Ctl>, stop: &Arc<AtomicBool>) -> Result<NetSide> {
    let lost = remote::listen(c.boot, c.tag, c.rank, c.nranks, own.clone(), stop.clone())?;
    // Every rank takes one collective step here, whichever side it made (see `other_hosts`);
    // past it, every rank's route for window connections is in place.
    c.boot.allgather(&[])?;
    Ok(NetSide::new(c.boot.dialer(), c.nranks, lost, c.timeout))
}

/// ncclCommWindowRegister (and commWindowAllocate with `owned`): collective. `precheck` is
/// this rank's verdict on its arguments; every rank learns every verdict, so bad arguments on
/// one rank fail the call everywhere instead of leaving the others waiting. Then the ranks
/// exchange how each reaches its part (`exchange`), map the others' parts (`map`), and agree
/// that every rank did, publishing the window (`publish`).
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
    let mine = Mine::new(c, &cw, buff, size, exported);
    let (infos, mut fds) = exchange(c, &cw, &mine)?;
    // Free: `exchange` fails where any rank's slot is not.
    let slot = mine.slot.clone()?;
    let peers = match &mine.exposed {
        Err(e) => Err(e
            .clone()
            .context("registering the window with the InfiniBand device")),
        Ok(_) => map(c, cw.rdma.is_some(), &infos, &mut fds),
    };
    let w = publish(c, &cw, mine, slot, flags, owned, peers)?;
    crate::info!(
        "window {:#x}: {size} bytes at {buff:#x}; peers reached {}",
        w.handle,
        w.peers
            .iter()
            .enumerate()
            .map(|(r, p)| format!("{r}:{}", p.data.name()))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(w.handle)
}

/// This rank's part of a window being registered, before the exchange. It lives until the
/// registration's last agreement (`publish`): threads of this process duplicate its
/// descriptors by number in their part of the exchange, which may end after this rank's.
struct Mine {
    buff: usize,
    size: usize,
    handle: usize,
    /// Its window slot in this rank's control segment (none free: the error).
    slot: Result<usize>,
    /// Library memory: its memfd, the allocation's length and the part's offset in it.
    shared: Option<(OwnedFd, usize, usize)>,
    /// Device memory: the allocation around it and how other processes map it.
    exported: Option<share::Exported>,
    /// Where peers reach windows by RDMA: the part registered with the device.
    exposed: Result<Option<Exposed>>,
}

impl Mine {
    fn new(
        c: &Members,
        cw: &CommWindows,
        buff: usize,
        size: usize,
        exported: Option<share::Exported>,
    ) -> Mine {
        let exposed = match (&cw.rdma, &exported) {
            (Some(r), _) => expose(r, buff, size).map(Some),
            (None, Some(_)) if c.paths.contains(&Path::Network) => {
                Err(Error::new(ErrorKind::InvalidUsage, ACROSS_HOSTS_NEEDS_IB))
            }
            (None, _) => Ok(None),
        };
        Mine {
            buff,
            size,
            handle: HANDLE_BASE + HANDLE_STEP * NEXT_HANDLE.fetch_add(1, Ordering::SeqCst),
            slot: cw.take_slot(),
            shared: shared::find(buff, size),
            exported,
            exposed,
        }
    }

    /// What the peers learn of it.
    fn info(&self) -> Info {
        let dev = self.exported.as_ref().map(|ex| {
            let (how, ipc) = match &ex.how {
                None => (DEV_UNSHARED, [0u8; 64]),
                Some(Shareable::Ipc(h)) => (DEV_IPC, *h),
                Some(Shareable::Fd(_)) => (DEV_FD, [0u8; 64]),
            };
            let off = (self.buff as u64).wrapping_sub(ex.alloc_base) as usize;
            (how, ipc, ex.alloc_len, off)
        });
        Info {
            slot: self.slot.as_ref().map_or(u32::MAX, |s| *s as u32),
            addr: self.buff,
            len: self.size,
            handle: self.handle as u64,
            shared: self.shared.as_ref().map(|s| (s.1, s.2)),
            dev,
            rkey: self
                .exposed
                .as_ref()
                .ok()
                .and_then(|e| e.as_ref())
                .map_or(0, |e| e.rkey),
        }
    }

    /// The descriptor of its device memory, where peers on this host map it from one.
    fn device_fd(&self) -> Option<&OwnedFd> {
        match &self.exported {
            Some(share::Exported {
                how: Some(Shareable::Fd(fd)),
                ..
            }) => Some(fd),
            _ => None,
        }
    }
}

/// A part registered with the InfiniBand device, through a dmabuf where it is device memory
/// (the descriptor is closed once registered).
fn expose(r: &RdmaSide, buff: usize, size: usize) -> Result<Exposed> {
    let part = gdr::PartSource::of(buff, size)?;
    r.qps.expose(part.source(), size, true).map_err(|e| {
        if part.is_device() {
            e.context("GPUDirect RDMA of this rank's device-memory window part (ranks on other hosts reach it only that way; register host memory for windows across hosts where it is unavailable)")
        } else {
            e
        }
    })
}

/// One rank's part of a window as the others learn it.
struct Info {
    slot: u32,
    addr: usize,
    len: usize,
    handle: u64,
    /// Library memory: the allocation's length and the part's offset in it.
    shared: Option<(usize, usize)>,
    /// Device memory: (how, IPC handle, allocation length, offset in it).
    dev: Option<(u32, [u8; 64], usize, usize)>,
    /// Its key for RDMA (0 without).
    rkey: u32,
}

impl Info {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        wire::put_u32(&mut b, self.slot);
        for v in [self.addr as u64, self.len as u64, self.handle] {
            wire::put_u64(&mut b, v);
        }
        match self.shared {
            Some((alloc_len, off)) => {
                wire::put_u32(&mut b, 1);
                wire::put_u64(&mut b, alloc_len as u64);
                wire::put_u64(&mut b, off as u64);
            }
            None => wire::put_u32(&mut b, 0),
        }
        match &self.dev {
            None => wire::put_u32(&mut b, DEV_NONE),
            Some((how, ipc, alloc_len, off)) => {
                wire::put_u32(&mut b, *how);
                if *how == DEV_IPC {
                    wire::put_blob(&mut b, ipc);
                }
                wire::put_u64(&mut b, *alloc_len as u64);
                wire::put_u64(&mut b, *off as u64);
            }
        }
        wire::put_u32(&mut b, self.rkey);
        b
    }

    fn decode(b: &[u8]) -> Result<Info> {
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
        Ok(Info {
            slot,
            addr,
            len,
            handle,
            shared,
            dev,
            rkey: r.u32()?,
        })
    }
}

/// Descriptors received from the peers on this host: of library memory and of VMM device
/// memory, per rank.
struct Fds {
    data: Vec<Option<OwnedFd>>,
    dev: Vec<Option<OwnedFd>>,
}

/// Collective: every rank learns every rank's part, and receives the descriptors of the
/// peers on this host whose parts travel as one. On failure this rank's slot is free again.
fn exchange(c: &Members, cw: &CommWindows, mine: &Mine) -> Result<(Vec<Info>, Fds)> {
    let release = || {
        if let Ok(s) = mine.slot {
            cw.slots.lock()[s] = false;
        }
    };
    let infos = c
        .boot
        .allgather(&mine.info().encode())?
        .iter()
        .map(|b| Info::decode(b))
        .collect::<Result<Vec<_>>>()?;
    if let Some(r) = infos.iter().position(|i| i.slot == u32::MAX) {
        release();
        mine.slot.clone()?;
        return crate::invalid_usage!(
            "rank {r} already has {} windows registered on this communicator",
            ctl::MAX_WINDOWS
        );
    }
    let none = || (0..c.nranks).map(|_| None).collect::<Vec<_>>();
    let mut fds = Fds {
        data: none(),
        dev: none(),
    };
    // Library memory: its memfd goes to the peers on this host, which map it.
    if infos.iter().any(|i| i.shared.is_some()) {
        let tag = c.tag ^ 0x5769_6e44_6174_0000 ^ (infos[0].handle << 16);
        let mine = mine.shared.as_ref().map(|s| &s.0);
        fds.data = exchange_fds(c, tag, mine).inspect_err(|_| release())?;
    }
    // VMM device memory (ncclMemAlloc) travels as a file descriptor.
    if infos.iter().any(|i| matches!(i.dev, Some((DEV_FD, ..)))) {
        let tag = c.tag ^ 0x5769_6e44_6576_0000 ^ (infos[0].handle << 16);
        fds.dev = exchange_fds(c, tag, mine.device_fd()).inspect_err(|_| release())?;
    }
    Ok((infos, fds))
}

fn exchange_fds(c: &Members, tag: u64, mine: Option<&OwnedFd>) -> Result<Vec<Option<OwnedFd>>> {
    let deadline = deadline_of(crate::bootstrap::init_timeout());
    fds::exchange(c.boot, c.paths, c.placements, tag, mine, deadline)
}

/// How this rank reaches each rank's part, mapping what it must; `rdma` where the
/// communicator's windows use InfiniBand.
fn map(c: &Members, rdma: bool, infos: &[Info], fds: &mut Fds) -> Result<Vec<PeerWin>> {
    let mut peers = Vec::with_capacity(infos.len());
    for (r, i) in infos.iter().enumerate() {
        let rkey = rdma.then_some(i.rkey);
        let (data, keep, locked) = match &i.dev {
            // Atomics on device memory are a read and a write by the driver, or verbs atomics
            // of the target's HCA where windows use RDMA.
            Some((how, ipc, alloc_len, off)) => {
                let dev = DevicePart {
                    addr: i.addr,
                    how: *how,
                    ipc,
                    alloc_len: *alloc_len,
                    off: *off,
                };
                let (data, keep) = device_reach(c, r, &dev, &mut fds.dev[r], rkey)?;
                (data, keep, true)
            }
            None => host_reach(c, r, i, &fds.data[r], rdma)?,
        };
        peers.push(PeerWin {
            len: i.len,
            addr: i.addr,
            slot: i.slot as usize,
            handle: i.handle,
            locked,
            rkey,
            data,
            _keep: keep,
        });
    }
    Ok(peers)
}

/// How this rank reaches rank `r`'s part in host memory (`fd`: the memfd of library memory
/// it received), what keeps it mapped, and whether its atomics take the lock.
fn host_reach(
    c: &Members,
    r: usize,
    i: &Info,
    fd: &Option<OwnedFd>,
    rdma: bool,
) -> Result<(Reach, Keep, bool)> {
    Ok(match c.paths[r] {
        Path::SelfRank | Path::SameProcess => {
            (Reach::Direct(i.addr), Keep::Nothing, i.shared.is_none())
        }
        Path::SameHost => match (&i.shared, fd) {
            (Some((alloc_len, off)), Some(fd)) => {
                let m = Mapping::map(fd.as_raw_fd(), *alloc_len)?;
                (Reach::Direct(m.ptr() as usize + off), Keep::Host(m), false)
            }
            _ => {
                let pid = c.placements[r].pid;
                probe_cma(r, pid, i)?;
                (
                    Reach::Cma(reach::Cma { pid, addr: i.addr }),
                    Keep::Nothing,
                    true,
                )
            }
        },
        Path::Network if rdma => {
            let part = reach::Rdma {
                addr: i.addr,
                rkey: i.rkey,
            };
            (Reach::Rdma(part), Keep::Nothing, false)
        }
        Path::Network => (
            Reach::Net(reach::Net { id: i.handle }),
            Keep::Nothing,
            i.shared.is_none(),
        ),
    })
}

/// Refuses rank `r`'s part in ordinary memory of process `pid` where this rank may not reach
/// it with process_vm_readv/writev, saying how to do without.
fn probe_cma(r: usize, pid: u32, i: &Info) -> Result<()> {
    if i.len == 0 {
        return Ok(());
    }
    let mut probe = [0u8; 1];
    // SAFETY: probe is one writable byte.
    match unsafe { sys::cma_read(pid, probe.as_mut_ptr(), i.addr, 1) } {
        Ok(_) => Ok(()),
        Err(e) => crate::invalid_usage!(
            "rank {r}'s window ({} bytes at {:#x}) is ordinary memory of another process (pid {pid}), and this rank may not reach it with process_vm_readv/writev: {e}. Allocate window memory with ncclMemAlloc or commMemAllocShared (shared memory every rank on the host maps), or allow the ranks to trace each other (kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE)",
            i.len, i.addr
        ),
    }
}

/// Makes the window from `peers` (or this rank's failure to map them) and agrees with the
/// other ranks: all succeed or all fail. It is published before the agreement, so that once
/// any rank is past it every rank's window is in its table and a peer's first put over the
/// network finds it; on failure it is taken back and the slot freed.
fn publish(
    c: &Members,
    cw: &Arc<CommWindows>,
    mine: Mine,
    slot: usize,
    flags: i32,
    owned: bool,
    peers: Result<Vec<PeerWin>>,
) -> Result<Arc<Window>> {
    let ok = peers.as_ref().map(|_| ()).map_err(|e| e.clone());
    let handle = mine.handle;
    let at = handle / HANDLE_STEP - HANDLE_BASE / HANDLE_STEP;
    let published = peers.ok().map(|peers| {
        let has_device = peers.iter().any(|p| p.data.is_device());
        let w = Arc::new(Window {
            handle,
            comm: key(c),
            flags,
            slot,
            peers,
            owned: owned.then_some(mine.buff),
            cw: cw.clone(),
            device: c.device.clone().filter(|_| has_device),
            exposed: Mutex::new(mine.exposed.ok().flatten()),
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
        cw.slots.lock()[slot] = false;
        return Err(e);
    }
    match published {
        Some(w) => Ok(w),
        None => crate::internal_err!("window registration agreed although this rank failed"),
    }
}

/// Why a device-memory window part cannot be reached from other hosts without InfiniBand.
pub(super) const ACROSS_HOSTS_NEEDS_IB: &str = "this communicator has ranks on other hosts, which reach a device-memory window part only by GPUDirect RDMA over InfiniBand, and its network transport is not InfiniBand (COMM_NET / NCCL_NET, NCCL_IB_DISABLE, or a rank without an RDMA device): register host memory for windows across hosts, or run over InfiniBand";

pub(super) const DEV_NONE: u32 = 0;

/// Device memory without a handle another process can map (VMM memory not from ncclMemAlloc).
pub(super) const DEV_UNSHARED: u32 = 1;

pub(super) const DEV_IPC: u32 = 2;

pub(super) const DEV_FD: u32 = 3;

/// This rank's verdict on a window part at `buff`: None for host memory; for device memory,
/// the allocation around it and how peers in other processes may map it.
pub(super) fn device_part(c: &Members, buff: usize) -> Result<Option<share::Exported>> {
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
    if c.paths.contains(&Path::Network) && c.ib().is_none() {
        return crate::invalid_usage!("{}", ACROSS_HOSTS_NEEDS_IB);
    }
    share::export(dev, buff as u64).map(Some)
}

/// Rank `r`'s part in device memory, as it described it.
struct DevicePart<'a> {
    /// Its address in r's process.
    addr: usize,
    /// How other processes map it (`DEV_*`), with its CUDA IPC handle where that is how.
    how: u32,
    ipc: &'a [u8; 64],
    alloc_len: usize,
    /// The part's offset in its allocation.
    off: usize,
}

/// How this rank reaches rank `r`'s device-memory part; `fd`, the descriptor of its VMM
/// allocation where it sent one; `rkey` where windows use RDMA (the part was registered
/// through a dmabuf).
fn device_reach(
    c: &Members,
    r: usize,
    part: &DevicePart,
    fd: &mut Option<OwnedFd>,
    rkey: Option<u32>,
) -> Result<(Reach, Keep)> {
    let DevicePart {
        addr,
        how,
        ipc,
        alloc_len,
        off,
    } = *part;
    // GPUDirect RDMA: its part was registered through a dmabuf; no GPU of this rank involved.
    if c.paths[r] == Path::Network {
        return match rkey {
            Some(rkey) => Ok((Reach::Rdma(reach::Rdma { addr, rkey }), Keep::Nothing)),
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
        Path::SelfRank | Path::SameProcess => {
            return Ok((Reach::Device(reach::Device { base: addr }), Keep::Nothing))
        }
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
    Ok((
        Reach::Device(reach::Device { base: at }),
        Keep::Device(imported),
    ))
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
pub(super) fn retire(w: &Window) {
    w.cw.own().live(w.slot).store(0, Ordering::SeqCst);
    w.cw.slots.lock()[w.slot] = false;
    w.exposed.lock().take();
    if let Some(p) = w.owned {
        shared::free(p as *mut u8);
    }
}
