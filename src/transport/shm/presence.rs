//! `topo::Presence` from the segments: each rank writes where its progress loop runs, what it
//! does there and a heartbeat into a line of its own segment, which its peers on the host
//! have mapped and read.

use super::segment::{Segment, CPU_MASK};
use super::setup::Peers;
use crate::topo::{Activity, Presence};
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Segment {
    /// Writes where the owner runs and what it does (`Presence::set_running_on`); only when
    /// it changed, so the line stays shared with the peers that read it.
    pub(super) fn set_running_on(&self, cpu: u32, what: Activity) {
        let state = match what {
            Activity::Polling => 0,
            Activity::Sleeping => 1,
            Activity::Outside => 2,
        };
        let v = (cpu.wrapping_add(1) & CPU_MASK) | state << 30;
        let word = self.running_on();
        if word.load(Ordering::Relaxed) != v {
            word.store(v, Ordering::Relaxed);
        }
    }

    /// One beat of the owner's heartbeat (`Presence::heartbeat`).
    pub(super) fn heartbeat(&self) {
        let b = self.beat();
        b.store(b.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// What the owner last said: its CPU and what it does there; None before it said.
    pub(super) fn said_running_on(&self) -> Option<(u32, Activity)> {
        let v = self.running_on().load(Ordering::Relaxed);
        let cpu = (v & CPU_MASK).checked_sub(1)?;
        let what = match v >> 30 {
            0 => Activity::Polling,
            1 => Activity::Sleeping,
            _ => Activity::Outside,
        };
        Some((cpu, what))
    }

    /// The owner's `running_on` word and heartbeat together: changes whenever either does.
    fn signs_of_life(&self) -> u64 {
        let word = u64::from(self.running_on().load(Ordering::Relaxed));
        word << 32 | u64::from(self.beat().load(Ordering::Relaxed))
    }
}

/// One communicator's ranks on this host, through their segments.
pub(crate) struct ShmPresence {
    local: Arc<Segment>,
    peers: Segments,
    /// Per rank: its signs of life as last read, and since when they have had that value.
    seen: Vec<Mutex<Option<(u64, Instant)>>>,
}

/// Where the peers' segments come from.
enum Segments {
    /// Those of the links made so far: a peer whose segment this rank has not mapped (its
    /// link is made at first use) says nothing.
    Links(Arc<Peers>),
    /// A fixed set (tests).
    #[cfg(test)]
    Fixed(Vec<Option<Arc<Segment>>>),
}

impl ShmPresence {
    pub(super) fn of_links(peers: Arc<Peers>) -> ShmPresence {
        let seen = (0..peers.nranks()).map(|_| Mutex::new(None)).collect();
        ShmPresence {
            local: peers.local().clone(),
            peers: Segments::Links(peers),
            seen,
        }
    }

    #[cfg(test)]
    pub(super) fn new(local: Arc<Segment>, peers: Vec<Option<Arc<Segment>>>) -> ShmPresence {
        let seen = peers.iter().map(|_| Mutex::new(None)).collect();
        ShmPresence {
            local,
            peers: Segments::Fixed(peers),
            seen,
        }
    }

    fn segment(&self, rank: usize) -> Option<&Arc<Segment>> {
        match &self.peers {
            Segments::Links(p) => p.made(rank).map(|p| &p.remote),
            #[cfg(test)]
            Segments::Fixed(v) => v.get(rank)?.as_ref(),
        }
    }
}

impl Presence for ShmPresence {
    fn set_running_on(&self, cpu: u32, what: Activity) {
        self.local.set_running_on(cpu, what);
    }

    fn heartbeat(&self) {
        self.local.heartbeat();
    }

    fn running_on(&self, rank: usize) -> Option<(u32, Activity)> {
        self.segment(rank)?.said_running_on()
    }

    fn stalled(&self, rank: usize, now: Instant, after: Duration) -> bool {
        let Some(peer) = self.segment(rank) else {
            return false;
        };
        let life = peer.signs_of_life();
        let mut seen = self.seen[rank].lock();
        match *seen {
            Some((b, since)) if b == life => now.saturating_duration_since(since) >= after,
            _ => {
                *seen = Some((life, now));
                false
            }
        }
    }
}
