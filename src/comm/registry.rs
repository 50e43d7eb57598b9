//! Communicator handles. A handle is a number that is never reused, looked up in a table: a
//! destroyed communicator is recognised as such instead of being dereferenced, and a
//! communicator whose non-blocking initialisation is still running has a valid handle already.
//! Calls skip the table while the thread's last communicator is still the one they name and
//! no communicator was destroyed or aborted since (`ffi::lane::with_comm`).

use super::Comm;
use crate::error::{Error, ErrorKind, Result};
use parking_lot::{Condvar, Mutex, RwLock};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

const BASE: usize = 0x6c00_0000_0000;
const STRIDE: usize = 0x40;

pub(crate) enum State {
    Initializing,
    Ready(Arc<Comm>),
    Failed(Error),
}

pub(crate) struct Entry {
    state: Mutex<State>,
    /// The communicator once `state` is `Ready` (it never leaves that state): calls find it
    /// without taking the lock.
    ready: OnceLock<Arc<Comm>>,
    settled: Condvar,
    pub blocking: bool,
    /// Set by ncclCommAbort: stops an initialisation that is still running.
    pub abort: Arc<AtomicBool>,
    /// The communicator's last error message (the communicator shares it once it exists).
    pub last_error: super::LastError,
}

impl Entry {
    pub(crate) fn new(blocking: bool) -> Arc<Entry> {
        Arc::new(Entry {
            state: Mutex::new(State::Initializing),
            ready: OnceLock::new(),
            settled: Condvar::new(),
            blocking,
            abort: Default::default(),
            last_error: Default::default(),
        })
    }

    pub(crate) fn ready_now(comm: Comm) -> Arc<Entry> {
        let blocking = comm.config.blocking;
        let comm = Arc::new(comm);
        Arc::new(Entry {
            last_error: comm.last_error.clone(),
            state: Mutex::new(State::Ready(comm.clone())),
            ready: OnceLock::from(comm),
            settled: Condvar::new(),
            blocking,
            abort: Default::default(),
        })
    }

    pub(crate) fn settle(&self, result: Result<Comm>) {
        let mut st = self.state.lock();
        *st = match result {
            Ok(mut c) => {
                c.last_error = self.last_error.clone();
                let c = Arc::new(c);
                // Settled once: a second settle finds it set and changes nothing there.
                let _ = self.ready.set(c.clone());
                State::Ready(c)
            }
            Err(e) => {
                super::note_error(&self.last_error, "communicator initialization", &e);
                State::Failed(e)
            }
        };
        self.settled.notify_all();
    }

    /// The communicator, if its initialisation has finished successfully.
    pub(crate) fn comm(&self) -> Result<Arc<Comm>> {
        if let Some(c) = self.ready.get() {
            return Ok(c.clone());
        }
        match &*self.state.lock() {
            State::Ready(c) => Ok(c.clone()),
            State::Initializing => crate::invalid_usage!(
                "the communicator is still initializing (non-blocking init); poll ncclCommGetAsyncError until it returns ncclSuccess"
            ),
            State::Failed(e) => Err(Error::new(
                ErrorKind::InvalidUsage,
                format!("the communicator's initialization failed: {}", e.msg),
            )),
        }
    }

    /// Whether initialisation is still running.
    pub(crate) fn initializing(&self) -> bool {
        self.ready.get().is_none() && matches!(*self.state.lock(), State::Initializing)
    }

    /// Blocks until initialisation settles.
    pub(crate) fn wait(&self) -> Result<Arc<Comm>> {
        self.wait_settled();
        self.comm()
    }

    fn wait_settled(&self) {
        let mut st = self.state.lock();
        while matches!(*st, State::Initializing) {
            self.settled.wait(&mut st);
        }
    }

    /// Blocks until initialisation settles and returns how it ended: the init's own error
    /// (a timeout stays a timeout), not the error of using a communicator that failed.
    pub(crate) fn init_outcome(&self) -> Result<Arc<Comm>> {
        self.wait_settled();
        match &*self.state.lock() {
            State::Failed(e) => Err(e.clone()),
            State::Ready(c) => Ok(c.clone()),
            State::Initializing => crate::internal_err!("init settled but is still running"),
        }
    }

    /// ncclCommGetAsyncError's view: in progress, failed, or the communicator's own state.
    pub(crate) fn async_state(&self) -> Result<()> {
        match &*self.state.lock() {
            State::Initializing => Err(Error::new(
                ErrorKind::InProgress,
                "initialization in progress",
            )),
            State::Failed(e) => Err(e.clone()),
            State::Ready(c) => match c.async_error.lock().clone() {
                Some(e) => Err(e),
                None if c.gate.in_progress() => Err(Error::new(
                    ErrorKind::InProgress,
                    "an operation is in progress",
                )),
                None => Ok(()),
            },
        }
    }
}

/// Entries by handle number (`(handle - BASE) / STRIDE - 1`): a lookup is an index, no hash.
static TABLE: RwLock<Vec<Option<Arc<Entry>>>> = RwLock::new(Vec::new());
static ISSUED: AtomicUsize = AtomicUsize::new(0);

fn slot(h: usize) -> Option<usize> {
    (h > BASE && (h - BASE) % STRIDE == 0).then(|| (h - BASE) / STRIDE - 1)
}

pub(crate) fn insert(e: Arc<Entry>) -> usize {
    let mut table = TABLE.write();
    let n = ISSUED.fetch_add(1, Ordering::SeqCst);
    if table.len() <= n {
        table.resize(n + 1, None);
    }
    table[n] = Some(e);
    BASE + STRIDE * (n + 1)
}

fn unknown(h: usize) -> Error {
    let issued = ISSUED.load(Ordering::SeqCst);
    let msg = if h == 0 {
        "comm is NULL".to_string()
    } else if h > BASE && h <= BASE + STRIDE * issued && (h - BASE) % STRIDE == 0 {
        format!("communicator {h:#x} was destroyed or aborted and cannot be used any more")
    } else {
        format!("{h:#x} is not a communicator handle from this library")
    };
    Error::new(ErrorKind::InvalidArgument, msg)
}

pub(crate) fn lookup(h: usize) -> Result<Arc<Entry>> {
    slot(h)
        .and_then(|i| TABLE.read().get(i).cloned().flatten())
        .ok_or_else(|| unknown(h))
}

/// The communicator behind handle `h`, ready for use; the common case takes the table's read
/// lock and one reference count, nothing else.
pub(crate) fn comm_of(h: usize) -> Result<Arc<Comm>> {
    if let Some(i) = slot(h) {
        if let Some(Some(e)) = TABLE.read().get(i) {
            if let Some(c) = e.ready.get() {
                return Ok(c.clone());
            }
        }
    }
    lookup(h)?.comm()
}

pub(crate) fn remove(h: usize) -> Result<Arc<Entry>> {
    slot(h)
        .and_then(|i| TABLE.write().get_mut(i).and_then(Option::take))
        .ok_or_else(|| unknown(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_never_reused_and_stale_ones_are_named() {
        let a = insert(Entry::new(true));
        let b = insert(Entry::new(true));
        assert_ne!(a, b);
        assert!(lookup(a).is_ok());
        remove(a).unwrap();
        let e = lookup(a).err().unwrap();
        assert!(e.msg.contains("destroyed"), "{}", e.msg);
        let e = lookup(12345).err().unwrap();
        assert!(e.msg.contains("not a communicator"), "{}", e.msg);
        assert!(lookup(0).err().unwrap().msg.contains("NULL"));
        assert!(remove(a).is_err());
        remove(b).unwrap();
    }

    #[test]
    fn initializing_entries_report_in_progress() {
        let e = Entry::new(false);
        assert_eq!(e.async_state().unwrap_err().kind, ErrorKind::InProgress);
        assert!(e.comm().unwrap_err().msg.contains("still initializing"));
        e.settle(crate::invalid_arg!("boom"));
        assert_eq!(
            e.async_state().unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert!(e.wait().unwrap_err().msg.contains("boom"));
    }
}
