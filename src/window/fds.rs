//! Handing a memfd to every peer on this host, the way the shm transport hands out its
//! segments: an authenticated abstract unix socket per rank, descriptors passed with
//! SCM_RIGHTS (no ptrace permission needed). Threads of one process duplicate it instead.

use crate::bootstrap::Bootstrap;
use crate::error::{Error, ErrorKind, Result};
use crate::sys::{self, ProcessWatch};
use crate::topo::{Path, Placement};
use crate::transport::shm::{fetch_segment, serve_segment};
use crate::wire::{self, Reader};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

/// Collective over `boot`: every rank offers `fd` (or nothing) and gets, per rank, the
/// descriptor that rank offered when it is on this host (itself included). `tag` keeps
/// concurrent exchanges apart.
pub(super) fn exchange(
    boot: &Bootstrap,
    paths: &[Path],
    placements: &[Placement],
    tag: u64,
    fd: Option<&OwnedFd>,
    deadline: Option<Instant>,
) -> Result<Vec<Option<OwnedFd>>> {
    let me = boot.rank();
    let others: Vec<usize> = (0..paths.len())
        .filter(|&r| paths[r] == Path::SameHost)
        .collect();
    let mut nonce = [0u8; 4];
    getrandom::getrandom(&mut nonce)
        .map_err(|e| Error::new(ErrorKind::System, format!("getrandom: {e}")))?;
    let socket = format!(
        "comm-win-{:016x}-{tag:016x}-{me}-{:08x}",
        placements[me].process_token,
        u32::from_ne_bytes(nonce)
    );
    let serving = fd.is_some() && !others.is_empty();
    let listener = if serving {
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())
            .map_err(|e| Error::from_io("abstract unix socket name", e))?;
        Some(
            UnixListener::bind_addr(&addr)
                .map_err(|e| Error::from_io(format!("bind unix socket {socket}"), e))?,
        )
    } else {
        None
    };
    let mut mine = Vec::new();
    wire::put_u32(&mut mine, fd.is_some() as u32);
    wire::put_u32(&mut mine, fd.map_or(0, |f| f.as_raw_fd() as u32));
    wire::put_blob(&mut mine, socket.as_bytes());
    let all = boot.allgather(&mine)?;
    let mut offers = Vec::with_capacity(all.len());
    for b in &all {
        let mut r = Reader::new(b);
        offers.push((r.u32()? != 0, r.u32()? as i32, r.string()?));
    }
    // Only the peers that take something from us connect.
    let stop = AtomicBool::new(false);
    let secret = *boot.secret();
    let served = std::thread::scope(|s| {
        let server = listener.map(|l| {
            let expected: Vec<(usize, ProcessWatch)> = others
                .iter()
                .map(|&r| (r, ProcessWatch::new(placements[r].pid)))
                .collect();
            let raw = fd.map_or(-1, |f| f.as_raw_fd());
            let stop = &stop;
            let stopped = move || stop.load(std::sync::atomic::Ordering::SeqCst);
            s.spawn(move || serve_segment(l, raw, &expected, &secret, tag, me, deadline, stopped))
        });
        let fetched = (|| -> Result<Vec<Option<OwnedFd>>> {
            let mut got: Vec<Option<OwnedFd>> = (0..paths.len()).map(|_| None).collect();
            for (r, offer) in offers.iter().enumerate() {
                if !offer.0 {
                    continue;
                }
                got[r] = match paths[r] {
                    Path::SelfRank => Some(sys::dup(fd.map_or(-1, |f| f.as_raw_fd()))?),
                    Path::SameProcess => Some(sys::dup(offer.1)?),
                    Path::SameHost => {
                        let watch = ProcessWatch::new(placements[r].pid);
                        Some(
                            fetch_segment(&offer.2, &secret, tag, me, r, deadline, Some(&watch))
                                .map_err(|e| {
                                    e.context(format!("fetching rank {r}'s window memory"))
                                })?,
                        )
                    }
                    Path::Network => None,
                };
            }
            Ok(got)
        })();
        if fetched.is_err() {
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let served = server
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| crate::internal_err!("window setup thread panicked"))
            })
            .unwrap_or(Ok(()));
        fetched.and_then(|f| served.map(|_| f))
    })?;
    Ok(served)
}
