//! The narrow interface the InfiniBand transport needs from verbs: one opened device (port,
//! protection domain), memory registration, and reliable-connected queue pairs that each
//! complete into a queue of their own. `libverbs.rs` implements it over `libibverbs.so.1`
//! opened at run time; the tests implement it with an in-process model of RC semantics
//! (`tests/common/ibmodel.rs`), installed with `set_provider`.
//!
//! What an implementation must guarantee (RC semantics, as the protocol relies on them):
//! - work requests posted on one queue pair execute in order, and their effects on the peer's
//!   memory are visible in that order;
//! - a write with immediate places its bytes in the target's memory before the target sees its
//!   receive completion, and consumes one posted receive there (waiting, as with an unlimited
//!   RNR retry count, while none is posted);
//! - atomics are atomic with respect to every other atomic on the same location;
//! - once a queue pair is in error, every posted and later work request completes with an
//!   error status, on both ends once the peer notices.

use crate::error::Result;
use std::sync::Arc;

/// What one side of a connection tells the other over the bootstrap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpAddr {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    /// The GID (RoCE, or InfiniBand across subnets); all zero where the LID is enough.
    pub gid: [u8; 16],
    /// The active MTU as the `ibv_mtu` enumeration counts it (1: 256 B .. 5: 4096 B).
    pub mtu: u8,
}

impl QpAddr {
    pub(crate) const BYTES: usize = 4 + 4 + 2 + 16 + 1;

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.qpn.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.push(self.mtu);
    }

    pub fn decode(b: &[u8]) -> Option<QpAddr> {
        if b.len() < Self::BYTES {
            return None;
        }
        Some(QpAddr {
            qpn: u32::from_le_bytes(b[0..4].try_into().ok()?),
            psn: u32::from_le_bytes(b[4..8].try_into().ok()?),
            lid: u16::from_le_bytes(b[8..10].try_into().ok()?),
            gid: b[10..26].try_into().ok()?,
            mtu: b[26],
        })
    }
}

/// Registered memory: the keys that name it to the local device and to peers.
pub trait Mr: Send + Sync {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
}

/// Memory to register with a device: where its bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Memory of this process at this address.
    Host(*mut u8),
    /// A dmabuf (a GPU's memory exported by its driver, for GPUDirect RDMA): the bytes from
    /// `offset` of `fd`, which work requests name by the addresses from `iova` on.
    Dmabuf {
        fd: std::os::fd::RawFd,
        offset: u64,
        iova: u64,
    },
}

impl Source {
    /// The address work requests give its first byte.
    pub fn addr(&self) -> u64 {
        match *self {
            Source::Host(p) => p as u64,
            Source::Dmabuf { iova, .. } => iova,
        }
    }

    /// Registers `len` bytes of it with `device`; a dmabuf where the device has no dmabuf
    /// registration fails saying why.
    pub fn register(&self, device: &dyn Device, len: usize) -> Result<Arc<dyn Mr>> {
        match *self {
            Source::Host(p) => device.register(p, len),
            Source::Dmabuf { fd, offset, iova } => {
                if let Err(why) = device.dmabuf_support() {
                    return Err(crate::error::Error::new(
                        crate::error::ErrorKind::InvalidUsage,
                        format!(
                            "{} cannot register device memory for GPUDirect RDMA: {why}",
                            device.name()
                        ),
                    ));
                }
                device.register_dmabuf(fd, offset, len, iova)
            }
        }
    }
}

/// The remote end of an RDMA operation: an address in memory the peer registered, and its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    pub addr: u64,
    pub rkey: u32,
}

/// A local buffer of a work request, inside memory registered with `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// RDMA write of `local` to `remote`.
    Write,
    /// RDMA write that also completes a receive at the target with this immediate value.
    WriteImm(u32),
    /// RDMA read of `remote` into `local`.
    Read,
    /// 8-byte fetch-and-add at `remote`; the old value lands in `local`.
    FetchAdd(u64),
    /// 8-byte compare-and-swap at `remote` (compare, swap); the old value lands in `local`.
    CompareSwap(u64, u64),
}

#[derive(Clone, Copy, Debug)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: Op,
    pub local: Local,
    pub remote: Remote,
    /// Whether it produces a completion on the sender when it succeeds (failures always do).
    pub signaled: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completed {
    /// A work request this side posted with `post_send`.
    Send,
    /// A posted receive, consumed by the peer's write with this immediate value.
    RecvImm(u32),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub what: Completed,
    /// The verbs status when the work request failed (`ibv_wc_status_str` and its number).
    pub error: Option<String>,
}

/// A reliable-connected queue pair and the completion queue it completes into.
pub trait Qp: Send + Sync {
    /// What the peer needs to connect to this queue pair.
    fn addr(&self) -> QpAddr;
    /// Moves it to ready-to-send, connected to `remote`.
    fn connect(&self, remote: &QpAddr) -> Result<()>;
    fn post_send(&self, wr: &SendWr) -> Result<()>;
    /// A receive for a write with immediate (no buffer: the bytes go where the write says).
    fn post_recv(&self, wr_id: u64) -> Result<()>;
    /// Appends up to `max` completions to `out`.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<()>;
    /// Asks for `notify` (given at creation) to be called at the next completion. A completion
    /// that arrived just before may not call it: poll once more after arming.
    fn arm(&self) -> Result<()>;
}

/// One opened device, port and protection domain.
pub trait Device: Send + Sync {
    /// "mlx5_0:1", for messages.
    fn name(&self) -> String;
    /// Registers `len` bytes at `addr` for local access and remote write, read and atomics.
    fn register(&self, addr: *mut u8, len: usize) -> Result<Arc<dyn Mr>>;
    /// Whether `register_dmabuf` can work on this device, or why it cannot (no
    /// `ibv_reg_dmabuf_mr` in this rdma-core, or a kernel or driver without dmabuf support).
    fn dmabuf_support(&self) -> std::result::Result<(), String>;
    /// Registers `len` bytes from `offset` of the dmabuf `fd` (a GPU's memory exported by its
    /// driver: GPUDirect RDMA, the HCA reaches the pages without the CPU) with the same
    /// access as `register`. Work requests name those bytes by the addresses from `iova` on.
    /// `fd` may be closed once this returns; the registration keeps the pages.
    fn register_dmabuf(
        &self,
        fd: std::os::fd::RawFd,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<Arc<dyn Mr>>;
    /// A queue pair with room for `depth` outstanding sends and receives; `notify` runs (on
    /// some other thread) when a completion arrives after `arm`.
    fn create_qp(&self, depth: u32, notify: Arc<dyn Fn() + Send + Sync>) -> Result<Arc<dyn Qp>>;
}

/// Opens a device: the run-time verbs library, or a test's model.
pub trait Provider: Send + Sync {
    /// The device to use, or `Ok(None)` (with the reason) where there is none: no verbs
    /// library, no device, no active port, or none matching `NCCL_IB_HCA`.
    fn open(&self) -> Result<std::result::Result<Arc<dyn Device>, String>>;
}
