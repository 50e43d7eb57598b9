//! ncclGroupStart / ncclGroupEnd. Groups are per thread and nest; nothing queued inside a group
//! starts before the outermost end. At the end, every communicator's operations run together in
//! one executor pass, so send/recv pairs never deadlock whatever their order, and one thread can
//! drive several communicators. Communicator inits queued in a group run concurrently.

use crate::algo::Collective;
use crate::comm::ops::Call;
use crate::comm::registry::{self, Entry};
use crate::comm::Comm;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::host::Repeat;
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A communicator initialisation to run at the end of the group.
struct InitJob {
    entry: Arc<Entry>,
    /// The communicator it derives from (split, shrink, grow), as an address: derivations of
    /// one communicator exchange through it and take their tags from its counters, so those
    /// of a group run one after the other, in the order called.
    parent: Option<usize>,
    run: Box<dyn FnOnce() -> Result<Comm> + Send>,
}

impl InitJob {
    /// Runs the initialisation where ncclCommAbort on its handle can stop it.
    fn execute(self) -> Result<Comm> {
        crate::bootstrap::abortable(&self.entry.abort, self.run)
    }
}

/// When a window operation queued in a group runs at its end.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Window registrations: collective, so those of the group run concurrently, first (one
    /// thread may drive several communicators).
    Collective,
    /// Puts and signals, in order.
    Issue,
    /// Waits for signals, after every issue and every other call of the group, so that no
    /// order of them inside a group can deadlock.
    Wait,
}

/// A window operation to run at the end of the group.
struct OneSided {
    phase: Phase,
    /// Which communicator it belongs to (any value equal for the same one): collective
    /// operations of one communicator run one after the other, in order.
    comm: usize,
    run: Box<dyn FnOnce() -> Result<()> + Send>,
}

#[derive(Default)]
struct Group {
    depth: u32,
    calls: Vec<(Arc<Comm>, Call)>,
    inits: Vec<InitJob>,
    one_sided: Vec<OneSided>,
    error: Option<Error>,
    /// Whether the group's communicators are blocking, as the first one met says: NCCL refuses
    /// a group mixing the two kinds (its end would have to both wait and return InProgress).
    blocking: Option<bool>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// How many threads have a group open now. While none has, `in_group` need not look at this
/// thread's own state (a thread-local access is a call into the dynamic loader in a shared
/// library, which the short ways of one-sided calls avoid).
static OPEN: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn start() {
    let depth = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        g.depth += 1;
        g.depth
    });
    if depth == 1 {
        OPEN.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whether this thread is inside a group.
pub(crate) fn in_group() -> bool {
    OPEN.load(Ordering::Relaxed) != 0 && depth() != 0
}

pub(crate) fn depth() -> u32 {
    GROUP.with(|g| g.borrow().depth)
}

/// Remembers the first failed call of the group (`func`, the entry point that failed): the
/// outermost end reports it, naming the call, and runs nothing.
pub(crate) fn record_error(func: &str, e: &Error) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && g.error.is_none() {
            g.error = Some(e.clone().context(func));
        }
    });
}

/// What the outermost group end found to do.
enum Outcome {
    Nested,
    Run(Vec<(Arc<Comm>, Call)>, Vec<InitJob>, Vec<OneSided>),
}

fn close() -> Result<Outcome> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return crate::invalid_usage!("ncclGroupEnd called without a matching ncclGroupStart");
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok(Outcome::Nested);
        }
        OPEN.fetch_sub(1, Ordering::SeqCst);
        let calls = std::mem::take(&mut g.calls);
        let inits = std::mem::take(&mut g.inits);
        let one_sided = std::mem::take(&mut g.one_sided);
        g.blocking = None;
        match g.error.take() {
            Some(e) => {
                // Initialisations still have to settle their handles.
                for job in inits {
                    job.entry.settle(Err(e.clone()));
                }
                Err(Error::new(
                    e.kind,
                    format!(
                        "a call in the group failed, so the group did nothing: {}",
                        e.msg
                    ),
                ))
            }
            None => Ok(Outcome::Run(calls, inits, one_sided)),
        }
    })
}

/// ncclGroupEnd. Returns `InProgress` as an error kind when non-blocking inits are still running.
pub(crate) fn end() -> Result<()> {
    match close()? {
        Outcome::Nested => Ok(()),
        Outcome::Run(calls, inits, one_sided) => {
            run_inits(inits)?;
            let (collective, rest): (Vec<OneSided>, Vec<OneSided>) = one_sided
                .into_iter()
                .partition(|o| o.phase == Phase::Collective);
            run_concurrently(collective)?;
            let (waits, issues): (Vec<OneSided>, Vec<OneSided>) =
                rest.into_iter().partition(|o| o.phase == Phase::Wait);
            // A put or signal that fails here (its target deregistered the window, say) was
            // accepted when it was called, and concerns one peer: the group's other puts and
            // signals still run (their targets wait for them), and so do its collectives and
            // send/recv calls, or this rank would fall out of step with the others (its next
            // call would meet what they ran in this group).
            let mut failed: Option<Error> = None;
            for o in issues {
                if let Err(e) = (o.run)() {
                    failed.get_or_insert(e);
                }
            }
            let may_background = waits.is_empty() && failed.is_none();
            run_calls(calls, may_background)?;
            for o in waits {
                (o.run)()?;
            }
            match failed {
                Some(mut e) => {
                    e.msg = format!("{} (the group's other operations ran)", e.msg);
                    Err(e)
                }
                None => Ok(()),
            }
        }
    }
}

/// ncclGroupSimulateEnd: closes the group like ncclGroupEnd, but estimates instead of running.
/// Returns the estimated time in microseconds.
pub(crate) fn simulate_end() -> Result<f32> {
    match close()? {
        Outcome::Nested => Ok(0.0),
        Outcome::Run(calls, inits, _) => {
            for job in inits {
                job.entry.settle(crate::invalid_usage!(
                    "the communicator's init was in a group ended by ncclGroupSimulateEnd, which runs nothing"
                ));
            }
            Ok(calls.iter().map(|(c, call)| c.estimate_us(call)).sum())
        }
    }
}

/// Queues a call in the current group, or runs it now outside of one. `call` comes straight
/// from `Comm::check_call`, which also found the communicator usable; a collective of zero
/// elements never gets here (`ffi::coll::submit` stops it after `Comm::check_kind`).
/// `repeat`: the call's key as its entry point saw it, for running it again the short way
/// (`Comm::again`).
pub(crate) fn submit(comm: &Arc<Comm>, call: Call, repeat: Option<Repeat>) -> Result<()> {
    if in_group() {
        GROUP.with(|g| {
            let mut g = g.borrow_mut();
            join(&mut g, comm.blocking())?;
            g.calls.push((comm.clone(), call));
            Ok(())
        })
    } else {
        run_one(comm, &call, repeat)
    }
}

/// A call outside any group, just checked (`Comm::check_call`, which found the communicator
/// usable): straight to its executor, without a group's bookkeeping.
fn run_one(c: &Arc<Comm>, call: &Call, repeat: Option<Repeat>) -> Result<()> {
    if call.device && c.spans_hosts() {
        return run_calls(vec![(c.clone(), call.clone())], true);
    }
    // Held until the operation ends: a second caller is refused (`comm::gate`).
    let mut cache = c.gate.enter(&c.wiring.cache)?;
    if call.device {
        return c.enqueue_device(std::slice::from_ref(call));
    }
    let op = c.prepare(call)?;
    if !c.blocking() {
        // Numbered here, in call order; run in the background (`in_background`).
        let op = SendOp(op);
        // Refused from before the cache is let go, so that no call comes between.
        c.gate.start_background();
        drop(cache);
        return in_background(std::slice::from_ref(c), move |c| {
            let op = op;
            let _scope = crate::log::rank_scope(c[0].rank as i32);
            let result = crate::exec::host::run_one_in(
                &c[0].wiring,
                &mut c[0].wiring.cache.lock(),
                op.0,
                None,
            );
            if let Err(e) = &result {
                crate::warn!("{}", e.msg);
                c[0].fail(e);
            }
            result
        });
    }
    let _scope = crate::log::rank_scope(c.rank as i32);
    let repeat = repeat.map(|r| (r, call.footprint));
    let result = crate::exec::host::run_one_in(&c.wiring, &mut cache, op, repeat);
    if let Err(e) = &result {
        crate::warn!("{}", e.msg);
        c.fail(e);
    }
    result
}

/// commRecvAny: waits for the first message of `count` elements of `dtype` that any rank
/// sends to this one, then receives it as a receive from that rank; returns the rank. Outside
/// groups only (the source is chosen when the call runs, a group runs its calls at its end),
/// on host memory, and of at least one element (a send of nothing puts no message on the
/// channel to match).
pub(crate) fn recv_any(
    c: &Arc<Comm>,
    recv: *mut u8,
    count: usize,
    dtype: i32,
    stream: usize,
) -> Result<usize> {
    if depth() > 0 {
        return crate::invalid_usage!(
            "commRecvAny cannot be part of a group: it chooses its source when it runs, and a group runs its calls only at ncclGroupEnd"
        );
    }
    // The same checks as a receive from a named peer (this rank stands in for it).
    let mine = Collective::Recv {
        peer: c.rank,
        count,
    };
    let call = c.check_call(mine, std::ptr::null(), recv, dtype, None, stream)?;
    if call.device {
        return crate::invalid_usage!(
            "commRecvAny takes host memory only; recvbuff is device memory"
        );
    }
    if count == 0 {
        return crate::invalid_arg!(
            "count is 0: a send of nothing puts no message on the channel, so a receive from any source has nothing to match"
        );
    }
    // A send travels in slices of whole elements (algo::Shape::slices); the matching one
    // begins with a slice of this length.
    let elem = call.dtype.size();
    let first = (count * elem).min((c.slice_bytes / elem).max(1) * elem);
    let p2p = crate::tag::tag(crate::tag::kind::P2P, 0);
    let peer = crate::exec::anysource::wait_any_source(&c.wiring, p2p, first)?;
    let coll = Collective::Recv { peer, count };
    let repeat = crate::comm::ops::repeat_key(&coll, dtype, None, stream);
    let call = c
        .check_call(coll, std::ptr::null(), recv, dtype, None, stream)
        .map_err(|e| e.context(format!("peer {peer}, count {count}")))?;
    run_one(c, &call, repeat)?;
    Ok(peer)
}

/// A prepared operation moved to the thread that runs it in the background.
struct SendOp(crate::exec::op::HostOp);
// SAFETY: its pointers are addresses of the caller's buffers, which a caller of a non-blocking
// communicator keeps valid until ncclCommGetAsyncError reports the operation done (NCCL's
// contract); nothing else in it is tied to a thread.
unsafe impl Send for SendOp {}

/// Runs `work` on the communicators `comms` (of a non-blocking kind, whose gates the caller
/// entered and set to refuse calls, `Gate::start_background`) on a thread of its own, until
/// which ends their calls are refused: the caller gets InProgress now,
/// ncclCommGetAsyncError reports the end, and destroy or abort waits for it.
fn in_background(
    comms: &[Arc<Comm>],
    work: impl FnOnce(&[Arc<Comm>]) -> Result<()> + Send + 'static,
) -> Result<()> {
    let owned: Vec<Arc<Comm>> = comms.to_vec();
    let spawned = std::thread::Builder::new()
        .name("comm-nonblocking".into())
        .spawn(move || {
            let _ = work(&owned);
            for c in &owned {
                c.gate.release_background();
            }
        });
    match spawned {
        // Detached: destroy and abort wait on the gates (`Gate::wait_background`).
        Ok(_) => Err(Error::new(
            ErrorKind::InProgress,
            "the operation runs in the background",
        )),
        Err(e) => {
            for c in comms {
                c.gate.release_background();
            }
            Err(Error::from_io(
                "starting the thread of a non-blocking operation",
                e,
            ))
        }
    }
}

/// Runs collective window operations of a group: those of one communicator in order, those
/// of different communicators at the same time (each waits for its peers). The first error
/// wins.
fn run_concurrently(ops: Vec<OneSided>) -> Result<()> {
    let mut by_comm: Vec<(usize, Vec<OneSided>)> = Vec::new();
    for o in ops {
        match by_comm.iter_mut().find(|(c, _)| *c == o.comm) {
            Some((_, list)) => list.push(o),
            None => by_comm.push((o.comm, vec![o])),
        }
    }
    let in_order = |list: Vec<OneSided>| list.into_iter().try_for_each(|o| (o.run)());
    if by_comm.len() <= 1 {
        return by_comm.into_iter().try_for_each(|(_, list)| in_order(list));
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = by_comm
            .into_iter()
            .map(|(_, list)| s.spawn(move || in_order(list)))
            .collect();
        let mut first = None;
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| crate::internal_err!("a window registration panicked"));
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    })
}

/// Admits to the group a call on a communicator that is `blocking` or not: the first one met
/// decides for the group, and one of the other kind is refused (as NCCL does).
fn join(g: &mut Group, blocking: bool) -> Result<()> {
    let kind = |b: bool| if b { "blocking" } else { "non-blocking" };
    match g.blocking {
        Some(b) if b != blocking => crate::invalid_arg!(
            "a group may not mix blocking and non-blocking communicators: this call's communicator is {}, the group's earlier ones are {}",
            kind(blocking),
            kind(b)
        ),
        _ => {
            g.blocking = Some(blocking);
            Ok(())
        }
    }
}

/// Queues `item`, for a communicator that is `blocking` or not, in the current group (in the
/// list `list` picks); gives it back when there is no group.
fn defer<T>(item: T, blocking: bool, list: fn(&mut Group) -> &mut Vec<T>) -> Result<Option<T>> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            join(&mut g, blocking)?;
            list(&mut g).push(item);
            Ok(None)
        } else {
            Ok(Some(item))
        }
    })
}

/// Runs a window operation of communicator `comm` (any value equal for the same one), which
/// is `blocking` or not, now, or in `phase` of the end of the current group.
pub(crate) fn one_sided(
    comm: usize,
    blocking: bool,
    phase: Phase,
    run: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<()> {
    if depth() == 0 {
        return run();
    }
    let op = OneSided {
        phase,
        comm,
        run: Box::new(run),
    };
    match defer(op, blocking, |g| &mut g.one_sided)? {
        Some(op) => (op.run)(),
        None => Ok(()),
    }
}

/// Creates the handle of a communicator that `run` makes, hands it to `publish` (the caller's
/// out-parameter, which has it as soon as it exists), and runs `run`: at the end of the group
/// inside one, now when `blocking`, else in the background (the call returns InProgress and
/// ncclCommGetAsyncError reports the end). `parent`: the address of the communicator it
/// derives from (see `InitJob::parent`). Where the init fails before this returns, the handle
/// is removed and `publish` gets 0.
pub(crate) fn init(
    blocking: bool,
    parent: Option<usize>,
    run: impl FnOnce() -> Result<Comm> + Send + 'static,
    publish: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<()> {
    let entry = Entry::new(blocking);
    let h = registry::insert(entry.clone());
    publish(h)?;
    let job = InitJob {
        entry: entry.clone(),
        parent,
        run: Box::new(run),
    };
    let job = match defer(job, blocking, |g| &mut g.inits) {
        Ok(Some(job)) => job,
        Ok(None) => return Ok(()),
        Err(e) => {
            let _ = registry::remove(h);
            publish(0)?;
            return Err(e);
        }
    };
    if blocking {
        entry.settle(job.execute());
        if let Err(e) = entry.init_outcome() {
            let _ = registry::remove(h);
            publish(0)?;
            return Err(e);
        }
        Ok(())
    } else {
        run_inits(vec![job])
    }
}

/// A derivation (split, shrink, grow) of the communicator at address `parent`, run now, or at
/// the end of the group inside one (several ranks driven by one thread must derive their
/// communicators together); `publish` gets the new handle, 0 where `run` gives None (this
/// rank chose NCCL_SPLIT_NOCOLOR, which a group cannot take: its handle exists before).
pub(crate) fn derive(
    parent: usize,
    blocking: bool,
    run: impl FnOnce() -> Result<Option<Comm>> + Send + 'static,
    publish: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<()> {
    if depth() > 0 {
        let run = move || {
            run()?.ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidUsage,
                    "this rank chose NCCL_SPLIT_NOCOLOR inside a group",
                )
            })
        };
        return init(blocking, Some(parent), run, publish);
    }
    let h = match run()? {
        Some(c) => registry::insert(Entry::ready_now(c)),
        None => 0,
    };
    publish(h)
}

/// Runs inits concurrently (they rendezvous with each other). Blocking ones are waited for;
/// when any is non-blocking the caller gets InProgress and polls ncclCommGetAsyncError.
fn run_inits(inits: Vec<InitJob>) -> Result<()> {
    if inits.is_empty() {
        return Ok(());
    }
    let all_blocking = inits.iter().all(|j| j.entry.blocking);
    let entries: Vec<Arc<Entry>> = inits.iter().map(|j| j.entry.clone()).collect();
    // A thread per chain: the derivations of one parent in order, or one init of its own.
    let mut chains: Vec<(Option<usize>, Vec<InitJob>)> = Vec::new();
    for job in inits {
        match chains
            .iter_mut()
            .find(|(p, _)| p.is_some() && *p == job.parent)
        {
            Some((_, chain)) => chain.push(job),
            None => chains.push((job.parent, vec![job])),
        }
    }
    let mut threads = Vec::new();
    for (_, chain) in chains {
        let h = std::thread::Builder::new()
            .name("comm-init".into())
            .spawn(move || {
                for job in chain {
                    let entry = job.entry.clone();
                    let r =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.execute()))
                            .unwrap_or_else(|_| crate::internal_err!("communicator init panicked"));
                    entry.settle(r);
                }
            })
            .map_err(|e| Error::from_io("spawn init thread", e))?;
        threads.push(h);
    }
    if !all_blocking {
        return Err(Error::new(
            ErrorKind::InProgress,
            "communicator initialization in progress",
        ));
    }
    for h in threads {
        let _ = h.join();
    }
    let mut first_err = None;
    for entry in entries {
        match entry.init_outcome() {
            // The calls will come from this thread, not from the one that built the
            // communicator: it settles on its CPU, and its peers learn where it runs.
            Ok(c) => {
                c.wiring.settle();
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Marks the sends of a group whose buffer a receive of the same group overwrites (an in-place
/// send/recv exchange, as nccl-tests' sendrecv does). Such a send must not keep its buffer busy
/// until the peer has read it: around a ring, every rank's receive would wait for its own
/// send, which waits for the next rank's receive. The data is copied aside first instead.
fn stage_overwritten_sends(calls: &mut [Call]) {
    use crate::algo::Collective;
    let written: Vec<(usize, usize)> = calls
        .iter()
        .filter_map(|c| match c.coll {
            Collective::Recv { count, .. } => Some((c.recv as usize, count * c.dtype.size())),
            _ => None,
        })
        .collect();
    for c in calls.iter_mut() {
        if let Collective::Send { count, .. } = c.coll {
            let (s, len) = (c.send as usize, count * c.dtype.size());
            c.stage = written.iter().any(|&(r, rl)| s < r + rl && r < s + len);
        }
    }
}

/// Refuses a group in which two ranks of one communicator (threads of this process) put device
/// work on the same stream: each rank's program waits for flags the other's sets, and one stream
/// runs them one after the other, so the first would wait forever. The legacy and per-thread
/// default streams (handles 0, 1 and 2) are one stream per GPU: ranks on different GPUs that
/// both pass NULL use two streams.
fn refuse_shared_streams(comms: &[Arc<Comm>], per_comm: &[Vec<Call>]) -> Result<()> {
    let uses = comms.iter().zip(per_comm).flat_map(|(c, calls)| {
        let gpu = c.device.as_ref().map_or(-1, |w| w.device.ordinal);
        calls
            .iter()
            .filter(|call| call.device)
            .map(move |call| (c.tag, c.rank, stream_key(call.stream, gpu)))
    });
    match shared_stream(uses) {
        Some((a, b, (stream, gpu))) => {
            let which = if gpu >= 0 {
                format!("the default stream ({stream:#x}) of GPU {gpu}")
            } else {
                format!("the same stream ({stream:#x})")
            };
            crate::invalid_usage!(
                "ranks {a} and {b} of one communicator put device calls of this group on {which}; each rank's program waits for the other's, so each rank needs a stream of its own"
            )
        }
        None => Ok(()),
    }
}

/// What names one stream: a created stream's handle, or a default stream's handle with its GPU.
fn stream_key(stream: usize, gpu: i32) -> (usize, i32) {
    if stream <= 2 {
        (stream, gpu)
    } else {
        (stream, -1)
    }
}

/// The first two different ranks of one communicator (equal tags) on one stream, among
/// (communicator tag, rank, stream) uses: (earlier rank, later rank, stream).
fn shared_stream<S: PartialEq + Copy>(
    uses: impl Iterator<Item = (u64, usize, S)>,
) -> Option<(usize, usize, S)> {
    let mut seen: Vec<(u64, usize, S)> = Vec::new();
    for (tag, rank, stream) in uses {
        if let Some(&(_, other, _)) = seen
            .iter()
            .find(|&&(t, r, s)| t == tag && r != rank && s == stream)
        {
            return Some((other, rank, stream));
        }
        seen.push((tag, rank, stream));
    }
    None
}

/// Runs calls now: per communicator in issue order, all communicators in one executor pass.
/// Each communicator admits one call at a time (`comm::gate`); a group of non-blocking ones
/// runs in the background where `may_background` (nothing of the group waits behind it).
pub(crate) fn run_calls(calls: Vec<(Arc<Comm>, Call)>, may_background: bool) -> Result<()> {
    if calls.is_empty() {
        return Ok(());
    }
    let mut comms: Vec<Arc<Comm>> = Vec::new();
    let mut per_comm: Vec<Vec<Call>> = Vec::new();
    for (c, call) in calls {
        match comms.iter().position(|x| Arc::ptr_eq(x, &c)) {
            Some(i) => per_comm[i].push(call),
            None => {
                comms.push(c);
                per_comm.push(vec![call]);
            }
        }
    }
    // Held until the group ends: a second caller is refused (`comm::gate`).
    let mut caches = Vec::with_capacity(comms.len());
    for c in &comms {
        caches.push(c.gate.enter(&c.wiring.cache)?);
    }
    let host_only = per_comm.iter().flatten().all(|call| !call.device);
    if may_background && host_only && comms.iter().all(|c| !c.blocking()) {
        // Numbered in the background, where no call can come between (the gates refuse
        // every call until it ends).
        for c in &comms {
            c.gate.start_background();
        }
        drop(caches);
        let per_comm = SendCalls(per_comm);
        return in_background(&comms, move |comms| {
            let per_comm = per_comm;
            let mut caches: Vec<_> = comms.iter().map(|c| c.wiring.cache.lock()).collect();
            let result = run_grouped(comms, per_comm.0, &mut caches);
            note_group_error(comms, &result);
            result
        });
    }
    let result = run_grouped(&comms, per_comm, &mut caches);
    note_group_error(&comms, &result);
    drop(caches);
    result
}

/// A group's calls moved to the thread that runs them in the background.
struct SendCalls(Vec<Vec<Call>>);
// SAFETY: as `SendOp`; `Call` itself is Send for the same reason.
unsafe impl Send for SendCalls {}

/// Every communicator of a group that failed did nothing or failed with it: its last error
/// says so.
fn note_group_error(comms: &[Arc<Comm>], result: &Result<()>) {
    if let Err(e) = result {
        for c in comms {
            crate::comm::note_error(&c.last_error, "ncclGroupEnd", e);
        }
    }
}

/// The calls of a group, by communicator (`per_comm[i]` are `comms[i]`'s, run on the executor
/// cache `caches[i]`, which the caller holds).
fn run_grouped(
    comms: &[Arc<Comm>],
    per_comm: Vec<Vec<Call>>,
    caches: &mut [parking_lot::MutexGuard<'_, crate::exec::host::ExecCache>],
) -> Result<()> {
    refuse_shared_streams(comms, &per_comm)?;
    let mut jobs = Vec::with_capacity(comms.len());
    let mut staged = Vec::new();
    for ((c, calls), cache) in comms.iter().zip(per_comm).zip(caches.iter_mut()) {
        // Device calls become one program on their stream and return at once; across hosts
        // they run here, through host memory.
        let (device, mut calls): (Vec<Call>, Vec<Call>) = calls.into_iter().partition(|c| c.device);
        if !device.is_empty() {
            c.check_usable()?;
            if c.spans_hosts() {
                let s = crate::comm::staged::Staged::take(c, &device)?;
                calls.extend(s.calls.iter().cloned());
                staged.push(s);
            } else {
                c.enqueue_device(&device)?;
            }
        }
        if calls.is_empty() {
            continue;
        }
        stage_overwritten_sends(&mut calls);
        c.check_usable()?;
        let ops = calls
            .iter()
            .map(|call| c.prepare(call))
            .collect::<Result<Vec<_>>>()?;
        jobs.push((&c.wiring, &mut **cache, ops));
    }
    if jobs.is_empty() {
        return Ok(());
    }
    let _scope = crate::log::rank_scope(comms[0].rank as i32);
    let result = crate::exec::host::run_in(jobs);
    if let Err(e) = &result {
        crate::warn!("{}", e.msg);
        for c in comms {
            c.fail(e);
        }
    }
    result?;
    staged.into_iter().try_for_each(|s| s.put_back())
}

#[cfg(test)]
mod tests {
    use super::{shared_stream, stream_key};

    #[test]
    fn two_ranks_of_one_communicator_on_one_stream_are_found() {
        // Different communicators, or one rank with several calls, may share a stream.
        let fine = [
            (1, 0, 7),
            (1, 0, 7),
            (2, 1, 7),
            (1, 1, 8),
            (3, 0, 0),
            (4, 0, 0),
        ];
        assert_eq!(shared_stream(fine.into_iter()), None);
        // Ranks 0 and 2 of communicator 5 both on stream 9.
        let clash = [(5, 0, 9), (6, 2, 9), (5, 1, 10), (5, 2, 9)];
        assert_eq!(shared_stream(clash.into_iter()), Some((0, 2, 9)));
        // The legacy stream (0) counts like any other on one GPU, but each GPU has its own.
        let on = |gpu| stream_key(0, gpu);
        assert_eq!(
            shared_stream([(5, 0, on(0)), (5, 1, on(0))].into_iter()),
            Some((0, 1, (0, 0)))
        );
        assert_eq!(
            shared_stream([(5, 0, on(0)), (5, 1, on(1)), (5, 2, on(2))].into_iter()),
            None
        );
        // A created stream is one stream whichever GPU's rank names it.
        assert_eq!(
            shared_stream([(5, 0, stream_key(77, 0)), (5, 1, stream_key(77, 1))].into_iter()),
            Some((0, 1, (77, -1)))
        );
    }
}
