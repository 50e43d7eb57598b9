//! Signal-pad channels (PyTorch's symmetric-memory signal pads): signal, wait and barrier
//! per channel.

use super::ctl::Stop;
use super::ops::{check_live, peer_index};
use super::reach::{PeerWindow, Target};
use super::registry::lookup;
use super::signals::wait_until;
use super::{deadline_of, CommWindows, Members, Window};
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

pub(super) fn channel_of(cw: &CommWindows, channel: i32) -> Result<usize> {
    match usize::try_from(channel) {
        Ok(ch) if ch < cw.channels => Ok(ch),
        _ => crate::invalid_arg!(
            "channel {channel} is out of range: windows have {} signal channels (COMM_WIN_CHANNELS)",
            cw.channels
        ),
    }
}

pub(super) fn pad_deadline(c: &Members, timeout_ms: u64) -> Option<Instant> {
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
    channel_signal_to(c, &w, dst, ch, pad_deadline(c, timeout_ms))
}

/// The window, peer and channel of a channel operation, checked.
pub(super) fn channel_args(
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

pub(super) fn channel_signal_to(
    c: &Members,
    w: &Window,
    dst: usize,
    ch: usize,
    deadline: Option<Instant>,
) -> Result<()> {
    let me = c.rank;
    let target = Target {
        w,
        peer: dst,
        stop: Stop {
            deadline,
            abort: None,
        },
        link: None,
    };
    let mut pause = Duration::from_micros(1);
    loop {
        let set = w.peers[dst].data.set_pad(&target, ch)?;
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

pub(super) fn channel_wait_from(
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
        channel_signal_to(c, &w, p, ch, deadline)?;
    }
    for p in (0..c.nranks).filter(|&p| p != c.rank) {
        channel_wait_from(c, &cw, &w, p, ch, deadline)?;
    }
    Ok(())
}
