//! A rank's channel to itself (a send to one's own rank inside a group): the receive copies
//! straight from the send buffer.

use super::{InExpect, Link, OutMsg, Progress, RecvCursor, SendCursor, SendState, Sink};
use crate::error::Result;
use parking_lot::Mutex;
use std::collections::VecDeque;

#[derive(Default)]
pub(crate) struct Loopback {
    /// Posted sends not yet consumed, and how many have been consumed in total.
    state: Mutex<(VecDeque<OutMsgSend>, u64, u64)>,
}

#[derive(Clone, Copy)]
struct OutMsgSend(OutMsg);

// SAFETY: the raw pointer in OutMsg is only dereferenced by the receiving side of the same rank,
// on the thread that runs that rank's operations.
unsafe impl Send for OutMsgSend {}

impl Link for Loopback {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>> {
        let mut st = self.state.lock();
        if let Some(seq) = cur.link {
            let done = st.2 > seq;
            return Ok(Progress {
                state: if done {
                    SendState::Complete
                } else {
                    SendState::Posted
                },
                moved: done,
            });
        }
        st.0.push_back(OutMsgSend(*msg));
        let seq = st.1;
        st.1 += 1;
        cur.started = true;
        cur.sent = msg.len;
        cur.link = Some(seq);
        Ok(Progress {
            state: SendState::Posted,
            moved: true,
        })
    }

    fn recv(
        &self,
        expect: &InExpect,
        _cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        let msg = {
            let st = self.state.lock();
            match st.0.front() {
                Some(m) => m.0,
                None => {
                    return Ok(Progress {
                        state: false,
                        moved: false,
                    })
                }
            }
        };
        if msg.len != expect.len || msg.tag != expect.tag {
            return crate::invalid_usage!(
                "this rank sent itself {} bytes for {} but receives {} bytes for {}",
                msg.len,
                crate::tag::describe_tag(msg.tag),
                expect.len,
                crate::tag::describe_tag(expect.tag)
            );
        }
        match sink.direct() {
            Some(dst) => {
                if !std::ptr::eq(dst, msg.src) {
                    // SAFETY: the send keeps src valid until released below; dst holds len bytes;
                    // distinct buffers of one rank's group do not partially overlap (validated).
                    unsafe { std::ptr::copy(msg.src, dst, msg.len) };
                }
                sink.placed(0, msg.len, msg.scale)?;
            }
            None => {
                // SAFETY: as above, src stays valid and unchanged until released.
                let data = unsafe { std::slice::from_raw_parts(msg.src, msg.len) };
                sink.put(0, data, msg.scale)?;
            }
        }
        let mut st = self.state.lock();
        st.0.pop_front();
        st.2 += 1;
        Ok(Progress {
            state: true,
            moved: true,
        })
    }

    fn check_peer(&self) -> Result<()> {
        Ok(())
    }

    fn peek(&self) -> Result<Option<(usize, u64)>> {
        Ok(self.state.lock().0.front().map(|m| (m.0.len, m.0.tag)))
    }

    fn describe(&self) -> String {
        "loopback".into()
    }
}
