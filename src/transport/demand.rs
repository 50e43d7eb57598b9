//! Links made when a schedule first needs them (NCCL_RUNTIME_CONNECT, on by default).
//!
//! A transport that connects on demand hands the communicator an `OnDemand` link per peer
//! instead of a connected one. Its first send, receive or peek asks the transport's
//! `Connect` to move the connection forward; until that returns the real link, the call moves
//! nothing (the executor sleeps on its doorbell, which the connector rings when the
//! connection arrives), and afterwards every call goes straight to the real link. The rule
//! for who connects, the authentication, the deadline and how a peer that cannot be reached
//! is named belong to the transport's `Connect`; this file only holds the state change from
//! "not connected" to "connected" once, for every caller.
//!
//! A peer that the schedules never use costs no connection at all, which is what keeps the
//! descriptors, threads and memory of a rank proportional to the peers its algorithms talk to
//! rather than to the communicator's size.

use super::{
    Closing, InExpect, Link, Offer, OutMsg, Progress, RecvCursor, SendCursor, SendState, Sink,
};
use crate::error::Result;
use parking_lot::Mutex;
use std::sync::{Arc, OnceLock};

/// How a transport makes one peer's link when it is first needed.
pub(crate) trait Connect: Send + Sync {
    /// Moves the connection forward without blocking for long (a dial to a listening
    /// service, a look for an accepted connection): the link once it exists. Errors are
    /// final: the peer cannot be reached (named), the deadline passed, the peer is gone.
    fn poll(&self) -> Result<Option<Arc<dyn Link>>>;
    /// While not connected: Err when the peer is known to be unable to take part.
    fn check_peer(&self) -> Result<()>;
    /// For logs and errors, while not connected ("tcp to rank 5, not connected yet").
    fn describe(&self) -> String;
    /// This end goes away before the link was made: tell the peer where the transport can
    /// (by default nothing; the peer's own connector then finds this rank gone).
    fn close(&self, _how: Closing, _lost: Option<usize>) {}
}

/// A peer's link that is made at first use; see the module doc.
pub(crate) struct OnDemand {
    made: OnceLock<Arc<dyn Link>>,
    pending: Mutex<Pending>,
}

/// What an `OnDemand` holds until its link is made, under one lock.
struct Pending {
    /// Taken once the link is made (it holds what the connection needed: a dialer, a route).
    connect: Option<Box<dyn Connect>>,
    /// Set by `close` before the link was made: nothing connects afterwards.
    closed: Option<Closing>,
}

impl OnDemand {
    pub(crate) fn new(connect: Box<dyn Connect>) -> OnDemand {
        OnDemand {
            made: OnceLock::new(),
            pending: Mutex::new(Pending {
                connect: Some(connect),
                closed: None,
            }),
        }
    }

    /// The link, made now if the connector has it; None while the connection is under way.
    fn link(&self) -> Result<Option<&Arc<dyn Link>>> {
        if let Some(l) = self.made.get() {
            return Ok(Some(l));
        }
        let mut pending = self.pending.lock();
        // Another caller may have made it while this one waited for the lock.
        if let Some(l) = self.made.get() {
            return Ok(Some(l));
        }
        if let Some(how) = pending.closed {
            return crate::remote_err!(
                "this rank's end of the link was closed ({how:?}) before it was connected"
            );
        }
        let Some(c) = pending.connect.as_ref() else {
            return crate::internal_err!("an on-demand link lost its connector unconnected");
        };
        match c.poll()? {
            Some(l) => {
                pending.connect = None;
                Ok(Some(self.made.get_or_init(|| l)))
            }
            None => Ok(None),
        }
    }

    /// Whether the link has been made.
    #[cfg(test)]
    fn connected(&self) -> bool {
        self.made.get().is_some()
    }
}

impl Link for OnDemand {
    fn send(&self, msg: &OutMsg, cur: &mut SendCursor) -> Result<Progress<SendState>> {
        self.send_offered(msg, Offer::default(), cur)
    }

    fn send_offered(
        &self,
        msg: &OutMsg,
        offer: Offer,
        cur: &mut SendCursor,
    ) -> Result<Progress<SendState>> {
        match self.link()? {
            Some(l) => l.send_offered(msg, offer, cur),
            None => Ok(Progress {
                state: SendState::Pending,
                moved: false,
            }),
        }
    }

    fn recv(
        &self,
        expect: &InExpect,
        cur: &mut RecvCursor,
        sink: &mut dyn Sink,
    ) -> Result<Progress<bool>> {
        match self.link()? {
            Some(l) => l.recv(expect, cur, sink),
            None => Ok(Progress {
                state: false,
                moved: false,
            }),
        }
    }

    fn check_peer(&self) -> Result<()> {
        if let Some(l) = self.made.get() {
            return l.check_peer();
        }
        match self.pending.lock().connect.as_ref() {
            Some(c) => c.check_peer(),
            None => self.made.get().map_or(Ok(()), |l| l.check_peer()),
        }
    }

    fn hung_up_reason(&self) -> Option<String> {
        self.made.get().and_then(|l| l.hung_up_reason())
    }

    fn tells_its_losses(&self) -> bool {
        self.made.get().is_some_and(|l| l.tells_its_losses())
    }

    fn peek(&self) -> Result<Option<(usize, u64)>> {
        match self.link()? {
            Some(l) => l.peek(),
            None => Ok(None),
        }
    }

    fn describe(&self) -> String {
        if let Some(l) = self.made.get() {
            return l.describe();
        }
        match self.pending.lock().connect.as_ref() {
            Some(c) => c.describe(),
            None => self
                .made
                .get()
                .map_or_else(|| "closed before it was connected".into(), |l| l.describe()),
        }
    }

    fn close(&self, how: Closing, lost: Option<usize>) {
        let mut pending = self.pending.lock();
        if let Some(l) = self.made.get() {
            return l.close(how, lost);
        }
        pending.closed = Some(how);
        if let Some(c) = pending.connect.as_ref() {
            c.close(how, lost);
        }
    }

    fn tell_disagreement(&self, ours: u64, theirs: u64) {
        if let Some(l) = self.made.get() {
            l.tell_disagreement(ours, theirs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::loopback::Loopback;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Connects on its `ready`-th poll; counts polls.
    struct After {
        ready: usize,
        polls: Arc<AtomicUsize>,
        fail: bool,
    }

    impl Connect for After {
        fn poll(&self) -> Result<Option<Arc<dyn Link>>> {
            let n = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
            if self.fail {
                return crate::remote_err!("rank 3 cannot be reached");
            }
            Ok((n >= self.ready).then(|| Arc::new(Loopback::default()) as Arc<dyn Link>))
        }
        fn check_peer(&self) -> Result<()> {
            Ok(())
        }
        fn describe(&self) -> String {
            "test, not connected yet".into()
        }
    }

    struct Keep(Vec<u8>);

    impl Sink for Keep {
        fn direct(&mut self) -> Option<*mut u8> {
            None
        }
        fn put(
            &mut self,
            offset: usize,
            data: &[u8],
            _: Option<crate::reduce::Scale>,
        ) -> Result<()> {
            self.0[offset..offset + data.len()].copy_from_slice(data);
            Ok(())
        }
        fn placed(&mut self, _: usize, _: usize, _: Option<crate::reduce::Scale>) -> Result<()> {
            Ok(())
        }
    }

    fn msg(data: &[u8]) -> OutMsg {
        OutMsg {
            src: data.as_ptr(),
            len: data.len(),
            scale: None,
            tag: 7,
        }
    }

    #[test]
    fn moves_nothing_until_connected_then_goes_straight_to_the_link() {
        let polls = Arc::new(AtomicUsize::new(0));
        let l = OnDemand::new(Box::new(After {
            ready: 3,
            polls: polls.clone(),
            fail: false,
        }));
        let data = [1u8, 2, 3, 4];
        let mut cur = SendCursor::default();
        for _ in 0..2 {
            let p = l.send(&msg(&data), &mut cur).unwrap();
            assert_eq!((p.state, p.moved), (SendState::Pending, false));
            assert!(!l.connected());
            assert_eq!(l.describe(), "test, not connected yet");
        }
        let p = l.send(&msg(&data), &mut cur).unwrap();
        assert!(p.moved, "the third poll connects and the send goes through");
        assert!(l.connected());
        let mut keep = Keep(vec![0; 4]);
        let mut rc = RecvCursor::default();
        let expect = InExpect { len: 4, tag: 7 };
        let got = l.recv(&expect, &mut rc, &mut keep).unwrap();
        assert!(got.state);
        assert_eq!(keep.0, data);
        assert_eq!(polls.load(Ordering::SeqCst), 3, "no poll once connected");
    }

    #[test]
    fn a_failed_connection_is_an_error_and_a_closed_link_never_connects() {
        let l = OnDemand::new(Box::new(After {
            ready: 1,
            polls: Arc::default(),
            fail: true,
        }));
        let e = l.send(&msg(&[1]), &mut SendCursor::default()).unwrap_err();
        assert!(e.msg.contains("rank 3 cannot be reached"), "{e}");

        let polls = Arc::new(AtomicUsize::new(0));
        let l = OnDemand::new(Box::new(After {
            ready: 1,
            polls: polls.clone(),
            fail: false,
        }));
        l.close(Closing::Aborted, None);
        assert!(l.peek().is_err());
        assert_eq!(polls.load(Ordering::SeqCst), 0);
        assert!(!l.connected());
    }
}
