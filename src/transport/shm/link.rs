//! `Link` for `ShmPeer`: sending (eager, packed or pulled) and receiving, peer checks,
//! closing.

use super::packed::{entry_bytes, stamp_of, Found, KIND_PACKED, PACK_AREA, PACK_FIRST, PACK_MAX};
use super::peer::{Access, Carriage, Carried, ShmPeer};
use super::pull::{write_back, PullState};
use super::segment::{
    SlotHeader, FLAG_REPLY_AT, FLAG_SCALE, KIND_EAGER, KIND_PULL, KIND_RETURNED, SLOT_HEADER,
};
use crate::error::Result;
use crate::reduce::Scale;
use crate::transport::{
    Closing, Doorbell, InExpect, Link, Offer, OutMsg, Progress, RecvCursor, SendCursor, SendState,
    Sink,
};
use std::sync::atomic::Ordering;

impl Link for ShmPeer {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>> {
        self.send_offered(msg, Offer::default(), cur)
    }

    /// Takes up every part of the offer: a busy sender's messages, more so those the receiver
    /// only copies or may reply into, are pulled from lower sizes, and the reply's place goes
    /// with the pull descriptor.
    fn send_offered(
        &self,
        msg: &OutMsg,
        offer: Offer,
        cur: &mut SendCursor,
    ) -> Result<Progress<SendState>> {
        if let Some(e) = &self.gone {
            return Err(e.clone());
        }
        let head_ref = self.remote.head(self.me);
        let tail_ref = self.remote.tail(self.me);
        if let Some(seq) = cur.link {
            let done = tail_ref.load(Ordering::Acquire) > seq;
            return Ok(Progress {
                state: if done {
                    SendState::Complete
                } else {
                    SendState::Posted
                },
                moved: done,
            });
        }
        let mut head = head_ref.load(Ordering::Relaxed);
        // The tail lives in the peer's memory and changes under its hands: look at it only when
        // the slots we know to be free run out, not on every send.
        let mut tail = self.tail_seen.load(Ordering::Relaxed);
        let room = self.slot_free(head, &mut tail);
        let (scale, mut flags) = match msg.scale {
            Some(s) => (s.0, FLAG_SCALE),
            None => ([0u8; 8], 0),
        };
        if offer.reply_at.is_some() {
            flags |= FLAG_REPLY_AT;
        }
        let header = |kind, offset: usize, len: usize| SlotHeader {
            kind,
            flags,
            msg_len: msg.len as u64,
            offset: offset as u64,
            len: len as u64,
            src_addr: msg.src as u64,
            tag: msg.tag,
            scale,
        };
        // The peer published whether it may pull from us in our FIFO's control block, in its segment.
        let peer_can_pull = self.remote.pull_ok(self.me).load(Ordering::Acquire) != 0;
        if !cur.started {
            match self.carried.take(msg) {
                // A KIND_RETURNED notice naming where the bytes went.
                Some(
                    w @ Carried {
                        how: Carriage::WrittenBack { remote },
                        ..
                    },
                ) => {
                    if !room {
                        self.carried.push(w);
                        return Ok(Progress {
                            state: SendState::Pending,
                            moved: false,
                        });
                    }
                    let mut h = header(KIND_RETURNED, 0, 0);
                    h.src_addr = remote as u64;
                    self.publish(head, &h, None);
                    cur.started = true;
                    cur.sent = msg.len;
                    return Ok(Progress {
                        state: SendState::Complete,
                        moved: true,
                    });
                }
                Some(Carried {
                    how: Carriage::Forwarded { sent },
                    ..
                }) => {
                    // The slots hold the first `sent` bytes; the rest goes eagerly after them.
                    cur.started = true;
                    cur.sent = sent;
                    if sent == msg.len {
                        return Ok(Progress {
                            state: SendState::Complete,
                            moved: true,
                        });
                    }
                }
                None => {}
            }
        }
        let threshold = if offer.reply_at.is_some() || (offer.sender_busy && offer.copied) {
            self.pull_threshold_copied
        } else if offer.sender_busy {
            self.pull_threshold_busy
        } else {
            self.pull_threshold
        };
        if !cur.started && msg.len >= threshold && peer_can_pull {
            if !room {
                return Ok(Progress {
                    state: SendState::Pending,
                    moved: false,
                });
            }
            // The reply's place, where the sender offers one, is the descriptor's word of data.
            let reply_at = offer.reply_at.map(|at| at as u64);
            self.publish(head, &header(KIND_PULL, 0, msg.len), reply_at);
            cur.started = true;
            cur.sent = msg.len;
            cur.link = Some(head);
            return Ok(Progress {
                state: SendState::Posted,
                moved: true,
            });
        }
        if !cur.started && msg.len <= PACK_MAX {
            let p = self.send_packed(msg, head, &mut tail);
            if p.moved {
                cur.started = true;
                cur.sent = msg.len;
            }
            return Ok(p);
        }
        let mut moved = false;
        while !(cur.started && cur.sent == msg.len) {
            if !self.slot_free(head, &mut tail) {
                break;
            }
            let n = self.remote.geo.slot_bytes.min(msg.len - cur.sent);
            let from = msg.src.wrapping_add(cur.sent);
            let h = header(KIND_EAGER, cur.sent, n);
            self.fill_slot(head, &h, |out| {
                // SAFETY: `out` holds n bytes (fill_slot); msg.src is valid for msg.len bytes
                // of reads.
                unsafe { crate::reduce::copy_bytes(out, from, n) };
                Ok(())
            })?;
            head += 1;
            cur.sent += n;
            cur.started = true;
            moved = true;
        }
        if moved {
            self.remote.ring();
        }
        Ok(Progress {
            state: if cur.started && cur.sent == msg.len {
                SendState::Complete
            } else {
                SendState::Pending
            },
            moved,
        })
    }

    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        let tail_ref = self.local.tail(self.peer);
        let (mut moved, mut published) = (false, false);
        loop {
            let mut st = PullState::of(cur.link);
            if st.pulling {
                let p = self.descriptor();
                self.pull(cur, &mut st, p, expect.tag, sink)?;
                moved = true;
                if cur.received < p.total {
                    cur.link = st.word();
                    return Ok(Progress {
                        state: false,
                        moved,
                    });
                }
                st.pulling = false;
                cur.link = st.word();
                if let Some((d, at)) = write_back(p, sink, self.access) {
                    self.carried.push(Carried {
                        tag: expect.tag,
                        local: d as usize,
                        len: p.total,
                        how: Carriage::WrittenBack { remote: at },
                    });
                } else if st.forwarded > 0 {
                    if let Some(d) = sink.reply().map(|r| r.at) {
                        self.carried.push(Carried {
                            tag: expect.tag,
                            local: d as usize,
                            len: p.total,
                            how: Carriage::Forwarded { sent: st.forwarded },
                        });
                    }
                }
                self.release(self.consumed.load(Ordering::Relaxed) + 1);
                return Ok(Progress { state: true, moved });
            }
            let tail = self.consumed.load(Ordering::Relaxed);
            if self
                .local
                .slot_number(self.peer, tail)
                .load(Ordering::Acquire)
                != tail + 1
            {
                // Nothing more for now: whatever was read is released before this rank waits.
                if tail_ref.load(Ordering::Relaxed) != tail {
                    tail_ref.store(tail, Ordering::Release);
                    published = true;
                }
                break;
            }
            if self.slot_kind(tail) == KIND_PACKED {
                if cur.started {
                    return crate::internal_err!(
                        "shm FIFO from rank {} has packed messages in the middle of a message",
                        self.peer
                    );
                }
                let at = self.pack.read_from();
                let n = self.pack.received.load(Ordering::Relaxed);
                match self.find_packed(tail, at, stamp_of(n)) {
                    Found::Entry { at, ctl } => {
                        let (len, tag, scale, data) = self.packed_entry(tail, at, ctl);
                        let end = at + entry_bytes(len, scale.is_some());
                        if len > PACK_MAX || end > PACK_AREA {
                            return crate::internal_err!(
                                "shm packed entry from rank {} claims {len} bytes at {at}",
                                self.peer
                            );
                        }
                        if len != expect.len || tag != expect.tag {
                            return Err(self.mismatch(len as u64, tag, expect));
                        }
                        // SAFETY: `len` bytes of the entry, inside the slot (checked above),
                        // written before its control word; the sender does not touch them
                        // until the slot is released.
                        sink.put(0, unsafe { std::slice::from_raw_parts(data, len) }, scale)?;
                        cur.started = true;
                        cur.received = len;
                        moved = true;
                        self.pack.read_at.store(end as u64, Ordering::Relaxed);
                        self.pack.received.store(n + 1, Ordering::Relaxed);
                        break;
                    }
                    Found::Closed => {
                        self.pack.read_at.store(0, Ordering::Relaxed);
                        self.consumed.store(tail + 1, Ordering::Relaxed);
                        moved = true;
                        if (tail + 1) & (self.tail_step - 1) == 0 {
                            tail_ref.store(tail + 1, Ordering::Release);
                            published = true;
                        }
                        continue;
                    }
                    Found::Nothing => {
                        if tail_ref.load(Ordering::Relaxed) != tail {
                            tail_ref.store(tail, Ordering::Release);
                            published = true;
                        }
                        break;
                    }
                }
            }
            let h = self.read_header(tail);
            // A sender that runs ahead has the next message in place already: fetch its first
            // lines while this one is handled (a stream of 8 B broadcasts: 0.37 -> 0.28 us).
            self.local.prefetch_slot(self.peer, tail + 1);
            if !cur.started {
                if h.msg_len as usize != expect.len || h.tag != expect.tag {
                    return Err(self.mismatch(h.msg_len, h.tag, expect));
                }
                cur.started = true;
            } else if h.offset as usize != cur.received {
                return crate::internal_err!(
                    "shm FIFO from rank {} out of order: slot at offset {} while {} bytes were received",
                    self.peer,
                    h.offset,
                    cur.received
                );
            }
            let scale = (h.flags & FLAG_SCALE != 0).then_some(Scale(h.scale));
            match h.kind {
                // The descriptor stays in its slot until the pull is done (`descriptor`).
                KIND_PULL => cur.link = PullState::START,
                KIND_RETURNED => {
                    let at = h.src_addr as usize;
                    if sink.direct() != Some(at as *mut u8) {
                        return crate::internal_err!(
                            "rank {} wrote {} bytes back at {at:#x}, where this receive does not land",
                            self.peer,
                            h.msg_len
                        );
                    }
                    sink.placed(0, expect.len, None)?;
                    cur.received = expect.len;
                    self.release(tail + 1);
                    return Ok(Progress {
                        state: true,
                        moved: true,
                    });
                }
                KIND_EAGER => {
                    let len = h.len as usize;
                    if len > self.local.geo.slot_bytes || cur.received + len > expect.len {
                        return crate::internal_err!(
                            "shm slot from rank {} claims {len} bytes",
                            self.peer
                        );
                    }
                    // SAFETY: the slot's data area holds `len` <= slot_bytes published bytes that the
                    // sender does not touch until we advance the tail.
                    let data = unsafe {
                        std::slice::from_raw_parts(
                            self.local.slot(self.peer, tail).add(SLOT_HEADER),
                            len,
                        )
                    };
                    sink.put(cur.received, data, scale)?;
                    cur.received += len;
                    self.consumed.store(tail + 1, Ordering::Relaxed);
                    moved = true;
                    if (tail + 1) & (self.tail_step - 1) == 0 {
                        tail_ref.store(tail + 1, Ordering::Release);
                        published = true;
                    }
                    if cur.received == expect.len {
                        break;
                    }
                }
                k => {
                    return crate::internal_err!(
                        "shm slot from rank {} has unknown kind {k}",
                        self.peer
                    )
                }
            }
        }
        if published {
            self.remote.ring();
        }
        Ok(Progress {
            state: cur.started && cur.received == expect.len,
            moved,
        })
    }

    fn tells_its_losses(&self) -> bool {
        true
    }

    fn check_peer(&self) -> Result<()> {
        if let Some(e) = &self.gone {
            return Err(e.clone());
        }
        let first = match self.remote.first_lost().load(Ordering::SeqCst) {
            0 => None,
            r => Some(r as usize - 1),
        };
        // The rank this rank counts as lost first: the one the peer lost, unless the peer lost
        // this very rank (it timed out waiting for it), which this rank then told its other
        // peers it had lost itself ("rank 1 timed out waiting for rank 1"): then the peer.
        // The error still says what the peer reported (the blame check reads `lost`).
        let gone = |msg: String| {
            let mut e = self.lost(first.filter(|&r| r != self.me).unwrap_or(self.peer), msg);
            e.lost = Some(first.unwrap_or(self.peer));
            e
        };
        let closed = Closing::from_code(self.remote.closed().load(Ordering::SeqCst));
        if let Some(how) = closed {
            let (ours, theirs) = self.remote.disagreed();
            let tags = match (ours.load(Ordering::SeqCst), theirs.load(Ordering::SeqCst)) {
                (0, 0) => None,
                pair => Some(pair),
            };
            let mut e = gone(how.describe_with(self.peer, first, tags));
            e.kind = how.kind();
            e.disagreed = tags.filter(|_| how == Closing::Disagreed);
            return Err(e);
        }
        if self.watch.as_ref().is_some_and(|w| !w.alive()) {
            return Err(gone(format!(
                "rank {} exited (its process is gone)",
                self.peer
            )));
        }
        Ok(())
    }

    fn peek(&self) -> Result<Option<(usize, u64)>> {
        let mut tail = self.consumed.load(Ordering::Relaxed);
        let mut at = self.pack.read_from();
        let stamp = stamp_of(self.pack.received.load(Ordering::Relaxed));
        // A closed packed slot is followed by a published one: at most two looks.
        for _ in 0..2 {
            let published = self
                .local
                .slot_number(self.peer, tail)
                .load(Ordering::Acquire);
            if published != tail + 1 {
                return Ok(None);
            }
            if self.slot_kind(tail) == KIND_PACKED {
                match self.find_packed(tail, at, stamp) {
                    Found::Entry { at, ctl } => {
                        let (len, tag, _, _) = self.packed_entry(tail, at, ctl);
                        return Ok(Some((len, tag)));
                    }
                    Found::Nothing => return Ok(None),
                    Found::Closed => {
                        tail += 1;
                        at = PACK_FIRST;
                        continue;
                    }
                }
            }
            // The first slot of a message: eager data from offset 0, or a pull descriptor.
            let h = self.read_header(tail);
            return Ok((h.offset == 0).then_some((h.msg_len as usize, h.tag)));
        }
        Ok(None)
    }

    fn close(&self, how: Closing, lost: Option<usize>) {
        self.local.mark_closed(how, lost);
        self.note_end();
        self.remote.ring();
    }

    fn tell_disagreement(&self, ours: u64, theirs: u64) {
        // The first disagreement this rank found stays: every link shares the segment.
        let (o, t) = self.local.disagreed();
        if o.compare_exchange(0, ours, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            t.store(theirs, Ordering::SeqCst);
        }
    }

    fn describe(&self) -> String {
        match self.access {
            Access::Direct => "shm/direct".into(),
            Access::Cma(_) => {
                if self.remote.pull_ok(self.me).load(Ordering::Relaxed) != 0 {
                    "shm/cma".into()
                } else {
                    "shm/eager".into()
                }
            }
        }
    }
}
