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
use crate::transport::net::ib::verbs::{Remote, Source};
use crate::transport::Doorbell;
use crate::wire::{self, Reader};
use parking_lot::Mutex;
use std::os::fd::AsRawFd;
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

/// The communicator's window state, made collectively the first time.
pub(super) fn comm_windows(c: &Members) -> Result<Arc<CommWindows>> {
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
                // A pad was written by the HCA, not by a SeqCst store of this thread: the
                // doorbell's ring, with its fence.
                Doorbell::ring(&*ctl);
            }),
        )?;
        let (base, len) = own.region();
        let exposed = qps.expose(Source::Host(base), len, false)?;
        wire::put_u64(&mut mine, base as u64);
        wire::put_u32(&mut mine, exposed.rkey);
        rdma = Some((qps, exposed));
    } else if remote_peers {
        lost = Some(remote::listen(
            c.boot,
            c.tag,
            me,
            n,
            own.clone(),
            stop.clone(),
        )?);
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
            Some(RdmaSide {
                qps,
                ctls,
                _own_ctl: own_ctl,
            })
        }
        None => None,
    };
    let net = lost.map(|lost| NetSide::new(c.boot.dialer(), n, lost, c.timeout));
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
                        (Reach::Cma(reach::Cma { pid, addr: i.addr }), None, true)
                    }
                },
                Path::Network if rdma => (
                    Reach::Rdma(reach::Rdma {
                        addr: i.addr,
                        rkey: i.rkey,
                    }),
                    None,
                    false,
                ),
                Path::Network => (
                    Reach::Net(reach::Net { id: i.handle }),
                    None,
                    i.shared.is_none(),
                ),
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
        let has_device = peers.iter().any(|p| p.data.is_device());
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
            .map(|(r, p)| format!("{r}:{}", p.data.name()))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(handle)
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
    if c.paths.contains(&Path::Network) && c.ib.is_none() {
        return crate::invalid_usage!("{}", ACROSS_HOSTS_NEEDS_IB);
    }
    share::export(dev, buff as u64).map(Some)
}

/// How this rank reaches rank `r`'s device-memory part at `addr` (in r's process); `rkey`
/// where windows use RDMA (the part was registered through a dmabuf).
#[allow(clippy::too_many_arguments)]
pub(super) fn device_reach(
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
