//! The device transport between ranks of one host: each rank's device area (signal flags and
//! outgoing message slots, see `exec::device`) is exported with a CUDA IPC handle and mapped by
//! every peer in another process; ranks that are threads of one process use the address
//! directly (enabling peer access when their GPUs differ). Peers then read each other's slots
//! and raise each other's flags over NVLink or PCIe, and ranks sharing one GPU read from the
//! same device memory.

use crate::bootstrap::Bootstrap;
use crate::cuda::{self, Device, DeviceMem, PeerMem};
use crate::error::Result;
use crate::topo::{Path, Placement};
use crate::wire::{self, Reader};
use parking_lot::Mutex;
use std::sync::{Arc, Weak};
use std::time::Instant;

/// Message slots per peer and direction.
pub(crate) const SLOTS: usize = 2;

/// A 64-bit descriptor cell in rank `owner`'s area: where the message `from` sent it through
/// slot `slot` can be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub owner: usize,
    pub from: usize,
    pub slot: usize,
}

impl Desc {
    /// Index of the cell among its owner's descriptor cells.
    pub(crate) fn index(&self, slots: usize) -> usize {
        self.from * slots + self.slot
    }
}

/// A 32-bit flag in some rank's signal area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flag {
    /// In `owner`'s area: raised by `from` when its slot `slot` for `owner` holds a message.
    Full {
        owner: usize,
        from: usize,
        slot: usize,
    },
    /// In `owner`'s area: raised by `to` when it has read `owner`'s slot `slot` for it.
    Empty {
        owner: usize,
        to: usize,
        slot: usize,
    },
}

impl Flag {
    /// The rank whose memory holds the flag.
    pub(crate) fn owner(&self) -> usize {
        match *self {
            Flag::Full { owner, .. } | Flag::Empty { owner, .. } => owner,
        }
    }

    /// Index of the flag in its owner's signal area of `nranks` ranks with `slots` slots.
    pub(crate) fn index(&self, nranks: usize, slots: usize) -> usize {
        match *self {
            Flag::Full { from, slot, .. } => from * slots + slot,
            Flag::Empty { to, slot, .. } => nranks * slots + to * slots + slot,
        }
    }
}

/// Flags in each rank's signal area.
pub(crate) fn flag_count(nranks: usize, slots: usize) -> usize {
    2 * nranks * slots
}

/// The device areas of this process's ranks, by address, so that a rank that is a thread of
/// this process holds its peers' areas: an area is freed only once no rank here may still run a
/// program reading it.
static AREAS: Mutex<Vec<(u64, Weak<DeviceMem>)>> = Mutex::new(Vec::new());

/// Whether every rank says yes.
fn all_agree(boot: &Bootstrap, mine: bool) -> Result<bool> {
    Ok(boot
        .allgather(&[mine as u8])?
        .iter()
        .all(|v| v.as_slice() == [1]))
}

/// Where the descriptor cells begin in an area (after the flags).
fn descs_offset(nranks: usize) -> usize {
    (flag_count(nranks, SLOTS) * 4).next_multiple_of(64)
}

/// Where the control part (flags, descriptors) ends and the slots begin in an area.
fn control_bytes(nranks: usize) -> usize {
    (descs_offset(nranks) + nranks * SLOTS * 8).next_multiple_of(4096)
}

/// A peer's area as this process reaches it.
enum Mapped {
    /// Our own area.
    Own(u64),
    /// A same-process peer's area, kept allocated while we may read it.
    Kept(Arc<DeviceMem>),
    /// Another process's area, opened through its IPC handle.
    Ipc(PeerMem),
}

impl Mapped {
    fn base(&self) -> u64 {
        match self {
            Mapped::Own(p) => *p,
            Mapped::Kept(m) => m.ptr,
            Mapped::Ipc(m) => m.ptr,
        }
    }
}

/// One rank's view of the device memory of its communicator.
pub(crate) struct DeviceWorld {
    pub device: Arc<Device>,
    pub nranks: usize,
    pub slot_bytes: usize,
    _area: Arc<DeviceMem>,
    bases: Vec<Option<Mapped>>,
    /// Some other rank is a thread of this process on this same GPU: its programs and ours
    /// share the context's legacy default stream, so that stream cannot carry them.
    pub gpu_shared_in_process: bool,
    /// Device scratch for the operations' own temporaries; grows, never shrinks (a captured
    /// graph may still point into an older block, so those are kept too).
    scratch: Mutex<Vec<DeviceMem>>,
}

impl DeviceWorld {
    /// Sets up the device areas of every rank. Collective over the bootstrap: either every rank
    /// gets a world, or (when any rank has no usable GPU or cannot map a peer) every rank gets
    /// the reason instead (this rank's own failure where it had one) and the communicator stays
    /// on host memory, with the reason logged.
    pub(crate) fn connect(
        boot: &Bootstrap,
        ordinal: Option<i32>,
        paths: &[Path],
        placements: &[Placement],
    ) -> Result<std::result::Result<DeviceWorld, String>> {
        let elsewhere = "another rank could not set up its device memory or map this rank's (its COMM_DEBUG=WARN log says why)";
        let attempt = ordinal.map(|o| Self::allocate(boot.nranks(), o));
        let ready = matches!(attempt, Some(Ok(_)));
        let mut why = match &attempt {
            None => "this rank has no usable GPU".to_string(),
            Some(Err(e)) => {
                crate::warn!("no device path: {}", e.msg);
                e.msg.clone()
            }
            Some(Ok(_)) => elsewhere.to_string(),
        };
        if !all_agree(boot, ready)? {
            // The area allocated here (if any) is freed as `attempt` goes.
            return Ok(Err(why));
        }
        let (device, area, slot_bytes) = attempt.expect("checked").expect("checked");
        let mapped = Self::map_peers(
            boot,
            &device,
            &area,
            ordinal.expect("checked"),
            paths,
            placements,
        );
        if let Err(e) = &mapped {
            crate::warn!("no device path: {}", e.msg);
            why = e.msg.clone();
        }
        if !all_agree(boot, mapped.is_ok())? {
            return Ok(Err(why));
        }
        crate::info!(
            "device path on GPU {}: {} x {} MiB slots per peer",
            device.ordinal,
            SLOTS,
            slot_bytes >> 20
        );
        let (bases, local) = mapped.expect("checked");
        // Streams of one context share the GPU's hardware queues; a program waiting for a flag
        // holds up whatever shares its queue, so ranks of one process on one GPU need a queue
        // each (CUDA hands out CUDA_DEVICE_MAX_CONNECTIONS of them, 8 by default).
        let queues = crate::env::CUDA_DEVICE_MAX_CONNECTIONS
            .set_value()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or_else(|| crate::env::CUDA_DEVICE_MAX_CONNECTIONS.default_int() as usize);
        if local > queues {
            crate::warn!(
                "{local} ranks of this communicator are threads of this process on GPU {}, but CUDA_DEVICE_MAX_CONNECTIONS allows {queues} hardware queues: their streams may share queues and wait for each other; raise it (up to 32) before CUDA starts",
                device.ordinal
            );
        }
        let gpu_shared_in_process = local > 1;
        Ok(Ok(DeviceWorld {
            nranks: boot.nranks(),
            slot_bytes,
            bases,
            gpu_shared_in_process,
            _area: area,
            device,
            scratch: Mutex::new(Vec::new()),
        }))
    }

    fn allocate(nranks: usize, ordinal: i32) -> Result<(Arc<Device>, Arc<DeviceMem>, usize)> {
        let device = Device::get(ordinal)?;
        let slot_bytes = crate::env::DEVICE_SLOT_BYTES
            .size()
            .next_multiple_of(256)
            .max(4096);
        let area_len = control_bytes(nranks) + nranks * SLOTS * slot_bytes;
        let area = DeviceMem::new(&device, area_len)?;
        // Full flags start low, Empty flags start raised (every slot free), and no message is
        // described yet: all of it in place before the area is shown to any peer, and on a
        // stream of our own, not behind the application's work.
        let stream = cuda::Stream::create(&device)?;
        let half = flag_count(nranks, SLOTS) / 2;
        let filled = area
            .fill_u32(stream, 0, 0, half)
            .and_then(|()| area.fill_u32(stream, half * 4, 1, half))
            .and_then(|()| area.fill_u32(stream, descs_offset(nranks), 0, nranks * SLOTS * 2))
            .and_then(|()| stream.synchronize());
        let destroyed = stream.destroy();
        filled.and(destroyed)?;
        let area = Arc::new(area);
        let mut areas = AREAS.lock();
        areas.retain(|(_, a)| a.strong_count() > 0);
        areas.push((area.ptr, Arc::downgrade(&area)));
        Ok((device, area, slot_bytes))
    }

    fn map_peers(
        boot: &Bootstrap,
        device: &Arc<Device>,
        area: &Arc<DeviceMem>,
        ordinal: i32,
        paths: &[Path],
        placements: &[Placement],
    ) -> Result<(Vec<Option<Mapped>>, usize)> {
        let nranks = boot.nranks();
        // Ranks of this process on this GPU, this one included.
        let mut local = 1;
        let handle = area.ipc_handle()?;
        let mut mine = Vec::new();
        wire::put_u64(&mut mine, area.ptr);
        wire::put_u32(&mut mine, ordinal as u32);
        wire::put_blob(&mut mine, &handle);
        let all = boot.allgather(&mine)?;
        let mut bases = Vec::with_capacity(nranks);
        for (r, bytes) in all.iter().enumerate() {
            let mut rd = Reader::new(bytes);
            let ptr = rd.u64()?;
            let their_device = rd.u32()? as i32;
            let h: [u8; 64] = rd.blob()?.as_slice().try_into().map_err(|_| {
                crate::error::Error::new(
                    crate::error::ErrorKind::Internal,
                    "IPC handle of wrong size",
                )
            })?;
            let mapped = match paths[r] {
                Path::SelfRank => Some(Mapped::Own(area.ptr)),
                Path::SameProcess => {
                    local += usize::from(their_device == ordinal);
                    cuda::enable_peer_access(device, &Device::get(their_device)?)?;
                    let theirs = AREAS
                        .lock()
                        .iter()
                        .rev()
                        .find(|(p, _)| *p == ptr)
                        .and_then(|(_, a)| a.upgrade());
                    Some(Mapped::Kept(theirs.ok_or_else(|| {
                        crate::error::Error::new(
                            crate::error::ErrorKind::Internal,
                            format!(
                                "rank {r}'s device area at {ptr:#x} is not known in this process"
                            ),
                        )
                    })?))
                }
                Path::SameHost => Some(Mapped::Ipc(PeerMem::open(device, &h).map_err(|e| {
                    e.context(format!(
                        "mapping rank {r}'s device memory (pid {}, GPU {their_device})",
                        placements[r].pid
                    ))
                })?)),
                Path::Network => None,
            };
            bases.push(mapped);
        }
        Ok((bases, local))
    }

    /// Lets go of the device memory at destroy, once this rank's last program is done
    /// (`quiet`). Peers in other processes map this rank's area and may still read its slots
    /// (a sender's program ends before the receiver has read its last message), so the area
    /// is freed only after every rank has closed its mappings, which a bootstrap barrier
    /// (bounded by `deadline`) shows. Where that cannot be shown, or our own programs may
    /// still run, the memory is left allocated, with a warning: a leak, not a fault.
    pub(crate) fn retire(mut self, boot: &Bootstrap, quiet: bool, deadline: Instant) {
        if !quiet {
            crate::warn!(
                "device work of this communicator is still pending at destroy (a peer gone, or the communicator aborted); its device memory stays allocated"
            );
            std::mem::forget(self);
            return;
        }
        // Every rank of a communicator that spans processes takes part in the barrier, also one
        // that maps no other process's area (alone on its host): the barrier is the whole
        // communicator's, and a rank that left early failed it for the others.
        let other_processes = self
            .bases
            .iter()
            .any(|b| matches!(b, Some(Mapped::Ipc(_)) | None));
        if !other_processes {
            return;
        }
        // Close our mappings of the peers' areas, then wait for them to close theirs of ours.
        // Destroy has raised the bootstrap's abort flag by now; this barrier must not heed it.
        self.bases.clear();
        if let Err(e) = boot.barrier_at_teardown(deadline) {
            crate::warn!(
                "not every rank reached destroy ({}); this rank's device area stays allocated, since peers may still map it",
                e.msg
            );
            std::mem::forget(self);
        }
    }

    fn base(&self, rank: usize) -> Result<u64> {
        match &self.bases[rank] {
            Some(m) => Ok(m.base()),
            None => crate::invalid_usage!(
                "rank {rank} is on another host: device buffers need the network transport, which this build does not have"
            ),
        }
    }

    /// The address of byte `offset` of slot `slot` that rank `owner` keeps for its messages
    /// to rank `to`.
    pub(crate) fn slot_addr(
        &self,
        owner: usize,
        to: usize,
        slot: usize,
        offset: usize,
    ) -> Result<u64> {
        Ok(self.base(owner)?
            + (control_bytes(self.nranks) + (to * SLOTS + slot) * self.slot_bytes + offset) as u64)
    }

    /// The address of a descriptor cell in whichever rank's area holds it.
    pub(crate) fn desc_addr(&self, desc: Desc) -> Result<u64> {
        Ok(self.base(desc.owner)? + (descs_offset(self.nranks) + desc.index(SLOTS) * 8) as u64)
    }

    pub(crate) fn flag_addr(&self, flag: Flag) -> Result<u64> {
        Ok(self.base(flag.owner())? + (flag.index(self.nranks, SLOTS) * 4) as u64)
    }

    /// At least `len` bytes of device scratch, valid until the communicator is destroyed.
    pub(crate) fn scratch(&self, len: usize) -> Result<u64> {
        let mut blocks = self.scratch.lock();
        if let Some(last) = blocks.last() {
            if last.len >= len {
                return Ok(last.ptr);
            }
        }
        let block = DeviceMem::new(&self.device, len.next_multiple_of(1 << 20))?;
        let ptr = block.ptr;
        blocks.push(block);
        Ok(ptr)
    }
}
