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
//! When links are made: with NCCL_RUNTIME_CONNECT=1 (the default, when every rank asks for
//! it) at a link's first use (`demand.rs`): the lower rank dials the higher one's bootstrap
//! service, and the two ends make their queue pairs and registered slots for that peer only
//! and exchange what connects them over that authenticated connection, so a rank holds queue
//! pairs and slots only for the peers its schedules use. With NCCL_RUNTIME_CONNECT=0 every
//! pair's queue pairs are made at init and connected through one allgather of the same
//! entries (`entry`: queue-pair numbers, PSN, LID, GID, MTU, the ring's address and key),
//! followed by a barrier. `Maker` makes a link's end and `finish` connects it, either way.
//!
//! This transport has been tested against the model only, never on RDMA hardware.

mod demand;
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
    /// The exchanges of links made at first use (dropped first: it stops taking them).
    _served: Option<demand::Served>,
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

/// What makes one peer's link, at init or at first use: the device, the registrations the
/// links send from, the doorbell their completions ring, the slot size and queue pairs per
/// connection.
pub(super) struct Maker {
    me: usize,
    device: Arc<dyn Device>,
    regs: Arc<Registered>,
    doorbell: Arc<dyn Doorbell>,
    slot: usize,
    qps: usize,
}

impl Maker {
    /// `peer`'s link, not connected yet: its queue pairs, and its ring and staging slots
    /// registered with the device.
    fn link(&self, peer: usize) -> Result<Arc<IbLink>> {
        let bytes = SLOTS * self.slot;
        let ring = Buffer::new(bytes)?;
        let staging = Buffer::new(bytes)?;
        let ring_mr = self.device.register(ring.ptr(), bytes)?;
        let staging_mr = self.device.register(staging.ptr(), bytes)?;
        let qps = (0..self.qps)
            .map(|_| {
                let bell = self.doorbell.clone();
                self.device
                    .create_qp(2 * RECVS, Arc::new(move || bell.ring()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(IbLink::new(
            self.me,
            peer,
            self.device.name(),
            self.slot,
            qps,
            ring,
            staging,
            ring_mr,
            staging_mr,
            self.regs.clone(),
        )))
    }
}

/// Connects `link` to the peer's end described by `theirs` (from `entry`): its queue pairs
/// to ready-to-send, its receives posted.
fn finish(link: &IbLink, theirs: (Vec<QpAddr>, Remote)) -> Result<()> {
    let (me, peer) = link.ends();
    link.connect(&theirs.0)
        .map_err(|e| e.context(format!("connecting the queue pair to rank {peer}")))?;
    link.start(theirs.1)?;
    crate::info!("rank {me} -> rank {peer}: {}", link.describe());
    Ok(())
}

/// Connects this rank to `peers` over `device`. Collective over the bootstrap: every rank
/// calls it (with or without peers of its own) once every rank chose IB, with the same
/// `at_first_use` (NCCL_RUNTIME_CONNECT as every rank asked for it).
pub(super) fn connect(
    boot: &Bootstrap,
    peers: &[usize],
    device: Option<Arc<dyn Device>>,
    doorbell: Arc<dyn Doorbell>,
    at_first_use: bool,
) -> Result<(NetLinks, Option<IbWorld>)> {
    let me = boot.rank();
    let n = boot.nranks();
    let device = match device {
        Some(d) => d,
        None if peers.is_empty() && at_first_use => return Ok((Vec::new(), None)),
        None if peers.is_empty() => {
            // Eager setup is collective: the others' allgather and barrier wait for this rank.
            boot.allgather(&vec![0u8; n])?;
            boot.barrier()?;
            return Ok((Vec::new(), None));
        }
        None => return crate::internal_err!("InfiniBand chosen without a device"),
    };
    let maker = Arc::new(Maker {
        me,
        device: device.clone(),
        regs: Arc::new(Registered::new(device)),
        doorbell,
        slot: slot_bytes(),
        qps: qps_per_connection(),
    });
    if at_first_use {
        let (links, served) = demand::links(boot, peers, maker.clone());
        return Ok((
            links,
            Some(IbWorld {
                _served: served,
                regs: maker.regs.clone(),
            }),
        ));
    }
    let mut made: Vec<Option<Arc<IbLink>>> = (0..n).map(|_| None).collect();
    for &p in peers {
        made[p] = Some(maker.link(p)?);
    }
    // For every rank: its entry (0: it is no peer).
    let mut mine = Vec::new();
    for link in &made {
        match link {
            Some(l) => entry(l, &mut mine),
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
        finish(made[p].as_ref().expect("made above"), theirs)?;
    }
    // Every queue pair is ready to receive before anyone sends.
    boot.barrier()?;
    let links = made
        .into_iter()
        .map(|l| l.map(|l| l as Arc<dyn Link>))
        .collect();
    Ok((
        links,
        Some(IbWorld {
            _served: None,
            regs: maker.regs.clone(),
        }),
    ))
}

/// What a peer needs to connect to `link`: how many queue pairs (at least one), their
/// addresses, and the ring it writes into.
fn entry(link: &IbLink, out: &mut Vec<u8>) {
    let addrs = link.qp_addrs();
    out.push(addrs.len() as u8);
    for a in &addrs {
        a.encode(out);
    }
    let k = link.ring_key();
    out.extend_from_slice(&k.addr.to_le_bytes());
    out.extend_from_slice(&k.rkey.to_le_bytes());
}

/// An `entry` at the start of `b`, and its length; None for a 0 (no peer) or a short one.
fn decode_entry(b: &[u8]) -> Option<((Vec<QpAddr>, Remote), usize)> {
    let nq = *b.first()? as usize;
    if nq == 0 {
        return None;
    }
    let len = 1 + nq * QpAddr::BYTES + 12;
    let b = b.get(1..len)?;
    let qps = (0..nq)
        .map(|i| QpAddr::decode(&b[i * QpAddr::BYTES..]))
        .collect::<Option<Vec<_>>>()?;
    let k = &b[nq * QpAddr::BYTES..];
    let addr = u64::from_le_bytes(k[0..8].try_into().ok()?);
    let rkey = u32::from_le_bytes(k[8..12].try_into().ok()?);
    Some(((qps, Remote { addr, rkey }), len))
}

/// Rank `of`'s entry in a published table: one `entry` (or a 0) per rank.
fn entry_for(table: &[u8], of: usize) -> Option<(Vec<QpAddr>, Remote)> {
    let mut at = 0;
    for r in 0..=of {
        if *table.get(at)? == 0 {
            if r == of {
                return None;
            }
            at += 1;
            continue;
        }
        let (e, len) = decode_entry(&table[at..])?;
        if r == of {
            return Some(e);
        }
        at += len;
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
