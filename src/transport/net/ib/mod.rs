//! InfiniBand / RoCE: one RC queue pair per peer, messages RDMA-written with immediate data
//! into slots the receiver registered, under credits (`link.rs`). The verbs it uses are behind
//! a narrow interface (`verbs.rs`), implemented over `libibverbs.so.1` opened at run time
//! (`libverbs.rs`), so the library loads and falls back to sockets where rdma-core or a device
//! is missing; the tests run the protocol over an in-process model of that interface.
//!
//! Selection (`net::connect`): `COMM_NET` / `NCCL_NET` `ib` requires it; unset, IB is used when
//! every rank has a usable device and active port, sockets otherwise, and an INFO line says
//! which and why.
//!
//! Every pair's queue pair is made at init (an allgather of queue-pair numbers and slot
//! addresses), whatever NCCL_RUNTIME_CONNECT says: unlike the TCP transport, InfiniBand does
//! not connect at first use yet, so a rank holds a queue pair and its registered slots for
//! every network peer. Doing it would mean exchanging the two ends' queue-pair info over a
//! service connection at the link's first use instead.
//!
//! This transport has been tested against the model only, never on RDMA hardware.

mod libverbs;
mod link;
pub(crate) mod onesided;
pub(crate) mod verbs;

use crate::bootstrap::Bootstrap;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{Doorbell, Link};
use link::{Buffer, IbLink, HEADER, RECVS, SLOTS};
use parking_lot::Mutex;
use std::sync::Arc;
use verbs::{Device, Mr, Provider, QpAddr, Remote, Source};

static PROVIDER: Mutex<Option<Arc<dyn Provider>>> = Mutex::new(None);

/// Replaces the verbs library with `p` (a test's model), or restores it (`None`).
#[doc(hidden)]
pub fn set_provider(p: Option<Arc<dyn Provider>>) {
    *PROVIDER.lock() = p;
}

#[cfg(test)]
thread_local! {
    /// The provider for connections this thread makes, ahead of `set_provider` (the
    /// conformance suite runs over the model without changing it for other tests).
    pub(crate) static PROVIDER_FOR_TEST: std::cell::RefCell<Option<Arc<dyn Provider>>> =
        const { std::cell::RefCell::new(None) };
    /// Queue pairs per connection for this thread, ahead of the environment.
    pub(crate) static QPS_FOR_TEST: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

fn provider() -> Arc<dyn Provider> {
    #[cfg(test)]
    if let Some(p) = PROVIDER_FOR_TEST.with(|c| c.borrow().clone()) {
        return p;
    }
    PROVIDER
        .lock()
        .clone()
        .unwrap_or_else(|| Arc::new(libverbs::Library))
}

/// A usable device, or why there is none.
pub(super) fn probe() -> std::result::Result<Arc<dyn Device>, String> {
    match provider().open() {
        Ok(r) => r,
        Err(e) => Err(e.msg),
    }
}

/// Bytes of one slot: its header and up to `COMM_IB_SLOT_BYTES` (default 256 KiB) of data.
fn slot_bytes() -> usize {
    crate::env::IB_SLOT_BYTES.size().clamp(4 << 10, 16 << 20) + HEADER
}

/// One link per rank (`None` where the network does not carry the traffic).
type NetLinks = Vec<Option<Arc<dyn Link>>>;

/// Keeps the device (held by the registrations) and, through the links, the queue pairs alive.
pub(crate) struct IbWorld {
    regs: Arc<Registered>,
}

impl IbWorld {
    /// Registers `len` bytes at `addr` (ncclCommRegister): the links send pieces of it
    /// straight from there. Returns the registration's number, for `deregister`.
    pub(crate) fn register(&self, addr: *mut u8, len: usize) -> Result<u64> {
        self.regs.register(Source::Host(addr), len)
    }

    pub(crate) fn deregister(&self, id: u64) {
        self.regs.deregister(id)
    }

    /// Queue pairs for one-sided window operations to every rank (collective: every rank of
    /// the communicator calls it). `on_imm` runs here when a peer's signal arrives.
    pub(crate) fn one_sided(
        &self,
        boot: &Bootstrap,
        on_imm: onesided::OnImm,
    ) -> Result<onesided::OneSided> {
        onesided::OneSided::connect(self.regs.clone(), boot, on_imm)
    }
}

/// The user buffers registered with the device (ncclCommRegister), which the links send from
/// without copying. Only what the user registered is used this way: the user promises those
/// pages stay valid until ncclCommDeregister, which ordinary memory never promises (a freed
/// and reused range would keep its old pinned pages under a cached registration).
struct Registration {
    id: u64,
    start: u64,
    end: u64,
    mr: Arc<dyn Mr>,
}

pub(super) struct Registered {
    device: Arc<dyn Device>,
    regs: Mutex<Vec<Registration>>,
    next: std::sync::atomic::AtomicU64,
}

impl Registered {
    fn new(device: Arc<dyn Device>) -> Registered {
        Registered {
            device,
            regs: Mutex::new(Vec::new()),
            next: std::sync::atomic::AtomicU64::new(1),
        }
    }

    fn register(&self, source: Source, len: usize) -> Result<u64> {
        let mr = source.register(&*self.device, len)?;
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let start = source.addr();
        self.regs.lock().push(Registration {
            id,
            start,
            end: start + len as u64,
            mr,
        });
        Ok(id)
    }

    fn deregister(&self, id: u64) {
        self.regs.lock().retain(|r| r.id != id);
    }

    /// The remote key of registration `id`.
    fn rkey(&self, id: u64) -> Option<u32> {
        self.regs
            .lock()
            .iter()
            .find(|r| r.id == id)
            .map(|r| r.mr.rkey())
    }

    /// The local key of a registration that covers `len` bytes at `addr`, if one does.
    pub(super) fn lkey(&self, addr: u64, len: usize) -> Option<u32> {
        let end = addr.checked_add(len as u64)?;
        self.regs
            .lock()
            .iter()
            .find(|r| r.start <= addr && end <= r.end)
            .map(|r| r.mr.lkey())
    }
}

/// Connects this rank to `peers` over `device`. Collective over the bootstrap: every rank
/// calls it (with or without peers of its own) once every rank chose IB.
pub(super) fn connect(
    boot: &Bootstrap,
    peers: &[usize],
    device: Option<Arc<dyn Device>>,
    doorbell: Arc<dyn Doorbell>,
) -> Result<(NetLinks, Option<IbWorld>)> {
    let me = boot.rank();
    let n = boot.nranks();
    let slot = slot_bytes();
    let mut made: Vec<Option<Arc<IbLink>>> = (0..n).map(|_| None).collect();
    let device = match device {
        Some(d) => Some(d),
        None if peers.is_empty() => None,
        None => return crate::internal_err!("InfiniBand chosen without a device"),
    };
    let regs = device
        .as_ref()
        .map(|d| Arc::new(Registered::new(d.clone())));
    for &p in peers {
        let device = device.as_ref().expect("checked");
        let ring = Buffer::new(SLOTS * slot)?;
        let staging = Buffer::new(SLOTS * slot)?;
        let ring_mr = device.register(ring.ptr(), SLOTS * slot)?;
        let staging_mr = device.register(staging.ptr(), SLOTS * slot)?;
        let qps = (0..qps_per_connection())
            .map(|_| {
                let bell = doorbell.clone();
                device.create_qp(2 * RECVS, Arc::new(move || bell.ring()))
            })
            .collect::<Result<Vec<_>>>()?;
        made[p] = Some(Arc::new(IbLink::new(
            me,
            p,
            device.name(),
            slot,
            qps,
            ring,
            staging,
            ring_mr,
            staging_mr,
            regs.clone().expect("a device"),
        )));
    }
    // For every rank: how many queue pairs connect us (0: it is no peer), their addresses,
    // and our ring for it.
    let mut mine = Vec::new();
    for link in &made {
        match link {
            Some(l) => {
                let addrs = l.qp_addrs();
                mine.push(addrs.len() as u8);
                for a in &addrs {
                    a.encode(&mut mine);
                }
                let k = l.ring_key();
                mine.extend_from_slice(&k.addr.to_le_bytes());
                mine.extend_from_slice(&k.rkey.to_le_bytes());
            }
            None => mine.push(0),
        }
    }
    let all = boot.allgather(&mine)?;
    for &p in peers {
        let theirs = entry_for(&all[p], me).ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("rank {p} published no InfiniBand connection for rank {me}"),
            )
        })?;
        let l = made[p].as_ref().expect("made above");
        l.connect(&theirs.0)
            .map_err(|e| e.context(format!("connecting the queue pair to rank {p}")))?;
        l.start(theirs.1)?;
        crate::info!("rank {me} -> rank {p}: {}", l.describe());
    }
    // Every queue pair is ready to receive before anyone sends.
    boot.barrier()?;
    let links = made
        .into_iter()
        .map(|l| l.map(|l| l as Arc<dyn Link>))
        .collect();
    Ok((links, regs.map(|regs| IbWorld { regs })))
}

/// Rank `of`'s entry in a published table: its queue pairs' addresses and its ring.
fn entry_for(table: &[u8], of: usize) -> Option<(Vec<QpAddr>, Remote)> {
    let mut at = 0;
    for r in 0..=of {
        let nq = *table.get(at)? as usize;
        at += 1;
        let entry = nq * QpAddr::BYTES + 12;
        if r == of {
            if nq == 0 {
                return None;
            }
            let b = table.get(at..at + entry)?;
            let qps = (0..nq)
                .map(|i| QpAddr::decode(&b[i * QpAddr::BYTES..]))
                .collect::<Option<Vec<_>>>()?;
            let k = &b[nq * QpAddr::BYTES..];
            let addr = u64::from_le_bytes(k[0..8].try_into().ok()?);
            let rkey = u32::from_le_bytes(k[8..12].try_into().ok()?);
            return Some((qps, Remote { addr, rkey }));
        }
        if nq > 0 {
            at += entry;
        }
    }
    None
}

/// Queue pairs per peer: `NCCL_IB_QPS_PER_CONNECTION` (1 to 16, default 1).
fn qps_per_connection() -> usize {
    #[cfg(test)]
    if let Some(n) = QPS_FOR_TEST.with(|c| c.get()) {
        return n;
    }
    crate::env::IB_QPS_PER_CONNECTION.int().clamp(1, 16) as usize
}
