//! What a group of device calls needs around its program: the streams it runs on, and, with
//! registered buffers about, the per-program agreement on which messages are read in place.

use super::compile::{DeviceOp, Links};
use crate::algo::Step;
use crate::cuda::{Event, Stream};
use crate::error::Result;
use crate::topo::{Path, Placement};
use crate::transport::p2p::DeviceWorld;
use crate::transport::reg::{tables, Plan, Registry};
use crate::transport::shm::ShmWorld;
use crate::transport::Transports;

/// The streams of a group's calls. The program runs on the first; the others join it before
/// and wait for it after, as NCCL does with the streams of a group.
pub(crate) struct GroupStreams {
    pub(crate) main: Stream,
    others: Vec<Stream>,
}

impl GroupStreams {
    /// Joins `streams` (in call order, repeats allowed) into the first one.
    pub(crate) fn join(
        world: &DeviceWorld,
        streams: impl IntoIterator<Item = Stream>,
    ) -> Result<GroupStreams> {
        let mut all: Vec<Stream> = Vec::new();
        for s in streams {
            if !all.contains(&s) {
                all.push(s);
            }
        }
        // The legacy default stream is one queue for the whole context: a program there would
        // wait for flags that another rank's program, queued behind it, is to set.
        let legacy = |s: &Stream| s.0.is_null() || s.0 as usize == crate::cuda::STREAM_LEGACY;
        if world.gpu_shared_in_process && all.iter().any(legacy) {
            return crate::invalid_usage!(
                "stream is the legacy default stream (0), but other ranks of this communicator are threads of this process on the same GPU and would queue behind this rank on it: give each rank a stream of its own (cudaStreamCreateWithFlags with cudaStreamNonBlocking)"
            );
        }
        let Some(&main) = all.first() else {
            return crate::internal_err!("a device group without calls");
        };
        let others = all.split_off(1);
        if !others.is_empty() {
            let _bound = world.device.bind()?;
            for s in &others {
                let joined = Event::new(&world.device)?;
                joined.record(*s)?;
                joined.wait_on(main)?;
            }
        }
        Ok(GroupStreams { main, others })
    }

    /// After the program: the other streams wait for it.
    pub(crate) fn release(&self, world: &DeviceWorld) -> Result<()> {
        if self.others.is_empty() {
            return Ok(());
        }
        let _bound = world.device.bind()?;
        let done = Event::new(&world.device)?;
        done.record(self.main)?;
        self.others.iter().try_for_each(|s| done.wait_on(*s))
    }
}

/// The peers a group's operations send to and receive from.
fn peers_of(ops: &[DeviceOp], nranks: usize) -> (Vec<bool>, Vec<bool>) {
    let (mut to, mut from) = (vec![false; nranks], vec![false; nranks]);
    for step in ops.iter().flat_map(|o| o.schedule.steps.iter()) {
        match *step {
            Step::Send { peer, .. } => to[peer] = true,
            Step::Recv { peer, .. } => from[peer] = true,
            Step::Local { .. } => {}
        }
    }
    (to, from)
}

/// How a program's messages travel when registered buffers are about: each pair agrees, per
/// program, whether its messages carry descriptors (that counts the program, so from then on
/// it must reach the stream, or the communicator is unusable).
pub(crate) struct Described<'a> {
    shm: &'a ShmWorld,
    rank: usize,
    plan: Plan,
}

impl<'a> Described<'a> {
    /// None where the transports share no memory with peers (no registry tables to read).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn agree(
        reg: &'a Registry,
        transports: &'a Transports,
        world: &DeviceWorld,
        paths: &[Path],
        placements: &[Placement],
        ops: &[DeviceOp],
        rank: usize,
        nranks: usize,
    ) -> Option<Described<'a>> {
        let shm = tables(transports)?;
        let (sends_to, recvs_from) = peers_of(ops, nranks);
        let plan = reg.plan(
            shm,
            Some(&world.device),
            paths,
            placements,
            &sends_to,
            &recvs_from,
        );
        Some(Described { shm, rank, plan })
    }

    /// Where `peer` reads `len` bytes of this rank's memory at `addr` in place, if it can.
    pub(crate) fn view(&self, peer: usize, addr: u64, len: usize) -> Option<u64> {
        self.plan.peer_view(self.shm, self.rank, peer, addr, len)
    }

    /// The program's links, reading in place through `view` (a closure over [`Self::view`]).
    pub(crate) fn links<'v>(
        &self,
        view: &'v dyn Fn(usize, u64, usize) -> Option<u64>,
    ) -> Links<'v> {
        Links {
            describe_to: self.plan.describe_to.clone(),
            described_from: self.plan.described_from.clone(),
            peer_view: view,
        }
    }
}
