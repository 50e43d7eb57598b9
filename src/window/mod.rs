//! Windows, one-sided operations and symmetric memory.
//!
//! A [`Window`] is a region of every rank's memory, registered collectively, plus for each peer
//! the way this rank reaches that peer's region: a [`Reach`], which holds one implementation
//! of the small interface of one-sided operations (`reach::PeerWindow`: put, get, atomic,
//! signal, signal-pad update, flush) per medium, each in a file of its own under `reach/`:
//!
//! - **direct**: the peer is this rank, a thread of this process, or a process on this host whose
//!   region the library allocated (a memfd every rank on the host maps): loads, stores and
//!   hardware atomics;
//! - **cma**: a process on this host whose region is ordinary memory: single-copy
//!   `process_vm_writev` / `readv`, and atomics under a lock in the target's control segment;
//! - **device**: device memory this process addresses (a peer's GPU memory mapped with CUDA
//!   IPC or a VMM descriptor, or a thread's): copies by the driver, on the caller's stream or
//!   complete on return, and atomics under the lock as for cma;
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

mod channels;
mod ctl;
mod fds;
pub(crate) mod gdr;
mod ops;
mod reach;
mod register;
mod registry;
mod remote;
pub(crate) mod shared;
mod signals;

use crate::bootstrap::Bootstrap;
use crate::cuda::share::Imported;
use crate::cuda::Device;
use crate::error::Result;
use crate::sys::Mapping;
use crate::topo::Path;
use crate::topo::Placement;
use crate::transport::net::ib::onesided::{Exposed, OneSided};
use crate::transport::net::ib::verbs::Remote;
use crate::transport::net::ib::IbWorld;
use crate::transport::net::NetWorld;
use crate::transport::Link;
use crate::transport::Transports;
use ctl::Ctl;
use parking_lot::Mutex;
use remote::NetSide;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use channels::{channel_barrier, channel_signal, channel_wait, signal_pads};
pub(crate) use ops::{
    atomic, check_peer, check_put_signal, flush, get, peer_device_ptr, peer_ptr, peer_size, put,
    DirectPuts,
};
pub(crate) use reach::Reach;
pub(crate) use register::{deregister, register};
pub(crate) use registry::{forget, lookup, registered_state, user_ptr};
pub(crate) use signals::{signal, took_signals, wait_signals, wait_signals_on};

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
    /// The communicator's transports, asked for the capabilities windows build on.
    pub transports: &'a Transports,
}

impl<'a> Members<'a> {
    /// The InfiniBand side of the network transport, where it is InfiniBand (windows reach
    /// peers on other hosts with its one-sided operations).
    pub(crate) fn ib(&self) -> Option<&'a IbWorld> {
        self.transports.find::<NetWorld>()?.ib()
    }
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
    rdma: Option<RdmaSide>,
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
struct RdmaSide {
    qps: OneSided,
    ctls: Vec<Remote>,
    _own_ctl: Exposed,
}

/// A window registered with this flag is symmetric (every rank's part at one offset of its
/// allocation): the header's NCCL_WIN_COLL_SYMMETRIC (`ffi::types` checks).
pub(crate) const WIN_COLL_SYMMETRIC: i32 = 0x01;

fn deadline_of(t: Option<Duration>) -> Option<Instant> {
    t.map(|t| Instant::now() + t)
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

    fn rdma(&self, peer: usize) -> Result<&RdmaSide> {
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
        self.peers[peer].data.is_device()
    }
}
