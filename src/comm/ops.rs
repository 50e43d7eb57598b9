//! From a caller's arguments to an executable operation: validation (every rule NCCL documents,
//! plus buffer overlaps NCCL leaves undefined), reduction ops (built-in and custom), and the
//! schedule the tuner picks.

use super::Comm;
use crate::algo::{self, Collective, PerPeer, Shape};
use crate::error::Result;
use crate::exec::host::{overlap, run_again_in, Footprint, Repeat};
use crate::exec::op::{HostOp, Reduction};
use crate::reduce::{DataType, ReduceOp, Reducer, Scale};
use crate::tag::{kind, tag};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::sync::LazyLock;

/// The first value of a dynamic (user-created) op, as in NCCL.
pub(crate) const FIRST_DYNAMIC_OP: i32 = 5;

/// comm's bitwise reductions (integer datatypes only), numbered past NCCL's op numbers: the
/// values of the header's COMM_OP_BAND, COMM_OP_BOR and COMM_OP_BXOR (`ffi::types` checks).
pub(crate) const COMM_OP_BAND: i32 = 0x7fff_0001;
pub(crate) const COMM_OP_BOR: i32 = 0x7fff_0002;
pub(crate) const COMM_OP_BXOR: i32 = 0x7fff_0003;

/// Where a PreMulSum scalar is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ScalarSrc {
    /// Read when the op was created (ncclScalarHostImmediate).
    Value(Scale),
    /// Read when the collective runs (ncclScalarDevice; on host memory, a host address).
    Pointer(usize),
}

/// A reduction as named by an `ncclRedOp_t`, resolved against one communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpChoice {
    Plain(ReduceOp),
    Avg,
    PreMulSum(ScalarSrc),
}

#[derive(Clone, Copy, Debug)]
struct CustomOp {
    dtype: DataType,
    scalar: ScalarSrc,
}

/// The custom ops of one communicator.
#[derive(Default)]
pub(crate) struct CustomOps {
    ops: Mutex<HashMap<i32, CustomOp>>,
}

/// Op values are unique across communicators, so an op used on the wrong one is recognised.
static NEXT_OP: AtomicI32 = AtomicI32::new(FIRST_DYNAMIC_OP);
static OP_OWNER: LazyLock<Mutex<HashMap<i32, u64>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// What a schedule depends on: calls with equal keys get the same (cached) schedule.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ScheduleKey {
    call: CallKey,
    algo: algo::Algorithm,
}

/// The call's part of a schedule's key, which also fixes the tuner's choice of algorithm.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CallKey {
    coll: Collective,
    elem: usize,
    in_place: bool,
    slice_bytes: usize,
    stage: bool,
    device: bool,
}

impl CallKey {
    fn of(call: &Call, slice_bytes: usize) -> CallKey {
        CallKey {
            coll: call.coll.clone(),
            elem: call.dtype.size(),
            in_place: call.in_place,
            slice_bytes,
            stage: call.stage,
            device: call.device,
        }
    }

    /// `CallKey::of(call, slice_bytes) == *self`, without cloning the collective.
    fn matches(&self, call: &Call, slice_bytes: usize) -> bool {
        self.coll == call.coll
            && self.elem == call.dtype.size()
            && self.in_place == call.in_place
            && self.slice_bytes == slice_bytes
            && self.stage == call.stage
            && self.device == call.device
    }
}

/// A communicator's schedules, by what they depend on.
pub(crate) type ScheduleCache = Mutex<Schedules>;

#[derive(Default)]
pub(crate) struct Schedules {
    by_key: rustc_hash::FxHashMap<ScheduleKey, Arc<algo::Schedule>>,
    /// The last call's schedule, looked at first under the same lock as the map: a loop
    /// repeating one call that `Comm::again` does not serve (in a group, on a non-blocking
    /// communicator) skips the tuner and the hashing.
    last: Option<(CallKey, Arc<algo::Schedule>)>,
}

/// A validated call, waiting for its turn (the end of the group).
#[derive(Clone, Debug)]
pub(crate) struct Call {
    pub coll: Collective,
    pub send: *const u8,
    pub recv: *mut u8,
    pub dtype: DataType,
    pub op: Option<OpChoice>,
    /// Whether the send and receive buffers overlap (as NCCL's in-place rules allow).
    pub in_place: bool,
    /// What the checks found the call reads and writes, and where (`Comm::again`).
    pub footprint: Footprint,
    /// For a send: copy the data aside before offering it, because a receive of the same group
    /// writes over it (see `group::stage_overwritten_sends`).
    pub stage: bool,
    /// The caller's CUDA stream (an address; null is the default stream).
    pub stream: usize,
    /// The buffers are device memory: the call runs as a program on `stream`.
    pub device: bool,
}

// SAFETY: the pointers are only addresses here; they are dereferenced by the executor on the
// thread that runs the group, which the caller guarantees keeps the buffers alive.
unsafe impl Send for Call {}

#[inline]
pub(crate) fn parse_dtype(raw: i32) -> Result<DataType> {
    DataType::from_raw(raw).map_or_else(
        || crate::invalid_arg!("datatype {raw} is not a valid ncclDataType_t (0..=11)"),
        Ok,
    )
}

/// Whether a ncclScalarDevice scalar lives in device memory (read by the kernels) rather than
/// host memory (read when the operation is built).
fn scalar_on_device(p: usize) -> bool {
    crate::cuda::classify(p as *const std::ffi::c_void) != crate::cuda::MemKind::Host
}

fn bytes_of(count: usize, times: usize, dtype: DataType, what: &str) -> Result<usize> {
    count
        .checked_mul(times)
        .and_then(|c| c.checked_mul(dtype.size()))
        .filter(|&b| b <= isize::MAX as usize)
        .map_or_else(
            || {
                crate::invalid_arg!(
                    "{what} of {count} x {times} elements of {} overflows the address space",
                    dtype.name()
                )
            },
            Ok,
        )
}

/// The key of a call for `Comm::again`, where it may take the short way: not an all-to-all-v
/// (its counts are the caller's arrays, read anew by each call), and its op, if any, a
/// built-in one (a PreMulSum op reads its scalar when the call is built, and may be destroyed
/// and its number given to another op).
pub(crate) fn repeat_key(
    coll: &Collective,
    dtype: i32,
    op: Option<i32>,
    stream: usize,
) -> Option<Repeat> {
    let builtin = |op: i32| {
        (0..FIRST_DYNAMIC_OP).contains(&op) || (COMM_OP_BAND..=COMM_OP_BXOR).contains(&op)
    };
    if matches!(coll, Collective::AlltoAllv(_)) || op.is_some_and(|op| !builtin(op)) {
        return None;
    }
    Some(Repeat {
        coll: coll.clone(),
        dtype,
        op,
        stream,
    })
}

/// The tag of the messages of a collective numbered `seq`, with its datatype and op, so ranks
/// that pass different ones fail instead of combining unlike bytes; point-to-point calls match
/// by order.
fn tag_of(coll: &Collective, dtype: DataType, op: u8, seq: u64) -> u64 {
    match coll {
        Collective::Send { .. } | Collective::Recv { .. } => tag(kind::P2P, 0),
        _ => crate::tag::op_tag(coll.kind(), coll.root(), Some(dtype), op, seq),
    }
}

/// An op as tags carry it (`tag::op`).
fn op_code(op: Option<OpChoice>) -> u8 {
    use crate::tag::op;
    match op {
        None => 0,
        Some(OpChoice::Avg) => op::AVG,
        Some(OpChoice::PreMulSum(_)) => op::PREMULSUM,
        Some(OpChoice::Plain(p)) => match p {
            ReduceOp::Sum => op::SUM,
            ReduceOp::Prod => op::PROD,
            ReduceOp::Max => op::MAX,
            ReduceOp::Min => op::MIN,
            ReduceOp::BitAnd => op::BAND,
            ReduceOp::BitOr => op::BOR,
            ReduceOp::BitXor => op::BXOR,
        },
    }
}

fn check_ptr(name: &str, p: usize, bytes: usize) -> Result<()> {
    if bytes > 0 && p == 0 {
        return crate::invalid_arg!("{name} is NULL but the operation needs {bytes} bytes there");
    }
    if p.checked_add(bytes).is_none() {
        return crate::invalid_arg!("{name} + {bytes} bytes wraps around the address space");
    }
    Ok(())
}

impl Comm {
    pub(crate) fn create_premulsum(&self, dtype: DataType, scalar: ScalarSrc) -> Result<i32> {
        self.check_usable()?;
        let op = NEXT_OP.fetch_add(1, Ordering::SeqCst);
        if op <= 0 {
            return crate::invalid_usage!("too many reduction ops were created in this process");
        }
        self.custom_ops
            .ops
            .lock()
            .insert(op, CustomOp { dtype, scalar });
        OP_OWNER.lock().insert(op, self.tag);
        Ok(op)
    }

    pub(crate) fn destroy_op(&self, op: i32) -> Result<()> {
        if (0..FIRST_DYNAMIC_OP).contains(&op) || (COMM_OP_BAND..=COMM_OP_BXOR).contains(&op) {
            return crate::invalid_arg!(
                "op {op} is a built-in op; only ops from ncclRedOpCreatePreMulSum can be destroyed"
            );
        }
        if self.custom_ops.ops.lock().remove(&op).is_some() {
            OP_OWNER.lock().remove(&op);
            return Ok(());
        }
        Err(self.unknown_op(op))
    }

    fn unknown_op(&self, op: i32) -> crate::error::Error {
        let owner = OP_OWNER.lock().get(&op).copied();
        let msg = match owner {
            Some(_) => format!("op {op} was created on another communicator; custom ops are valid only on the communicator that created them"),
            None if op >= FIRST_DYNAMIC_OP && op < NEXT_OP.load(Ordering::SeqCst) => {
                format!("op {op} was destroyed")
            }
            None => format!("op {op} is not a valid ncclRedOp_t (built-ins are 0..=4, COMM_OP_BAND/BOR/BXOR are comm's bitwise ops; others come from ncclRedOpCreatePreMulSum)"),
        };
        crate::error::Error::new(crate::error::ErrorKind::InvalidArgument, msg)
    }

    /// Resolves an `ncclRedOp_t` value for `dtype` on this communicator.
    #[inline]
    pub(crate) fn resolve_op(&self, op: i32, dtype: DataType) -> Result<OpChoice> {
        let choice = match op {
            0 => OpChoice::Plain(ReduceOp::Sum),
            1 => OpChoice::Plain(ReduceOp::Prod),
            2 => OpChoice::Plain(ReduceOp::Max),
            3 => OpChoice::Plain(ReduceOp::Min),
            4 => OpChoice::Avg,
            COMM_OP_BAND => OpChoice::Plain(ReduceOp::BitAnd),
            COMM_OP_BOR => OpChoice::Plain(ReduceOp::BitOr),
            COMM_OP_BXOR => OpChoice::Plain(ReduceOp::BitXor),
            _ => return self.resolve_custom_op(op, dtype),
        };
        Ok(choice)
    }

    /// An op made by ncclRedOpCreatePreMulSum on this communicator, for `dtype`.
    #[inline(never)]
    fn resolve_custom_op(&self, op: i32, dtype: DataType) -> Result<OpChoice> {
        let custom = self.custom_ops.ops.lock().get(&op).copied();
        let c = custom.ok_or_else(|| self.unknown_op(op))?;
        if c.dtype != dtype {
            return crate::invalid_arg!(
                "op {op} was created for datatype {} but the collective uses {}",
                c.dtype.name(),
                dtype.name()
            );
        }
        Ok(OpChoice::PreMulSum(c.scalar))
    }

    /// The checks of a call that do not look at its buffers: the communicator usable, the
    /// datatype, the op (and that it suits the datatype), the root or peer in range. All a
    /// collective of zero elements gets, as in NCCL: it moves nothing, so it is a no-op on
    /// every rank once these pass.
    #[inline(always)]
    pub(crate) fn check_kind(
        &self,
        coll: &Collective,
        dtype: i32,
        op: Option<i32>,
    ) -> Result<(DataType, Option<OpChoice>)> {
        self.check_usable()?;
        let dtype = parse_dtype(dtype)?;
        let op = match (coll.reduces(), op) {
            (true, Some(op)) => Some(self.resolve_op(op, dtype)?),
            _ => None,
        };
        if let Some(OpChoice::Plain(p @ (ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor))) =
            op
        {
            if dtype.is_float() {
                return crate::invalid_arg!(
                    "op {} works on integer datatypes only, not {}",
                    p.name(),
                    dtype.name()
                );
            }
        }
        let (what, r) = match *coll {
            Collective::Broadcast { root, .. }
            | Collective::Reduce { root, .. }
            | Collective::Gather { root, .. }
            | Collective::Scatter { root, .. } => ("root", root),
            Collective::Send { peer, .. } | Collective::Recv { peer, .. } => ("peer", peer),
            _ => return Ok((dtype, op)),
        };
        let n = self.nranks;
        if r >= n {
            return crate::invalid_arg!(
                "{what} {r} is out of range for a communicator of {n} ranks"
            );
        }
        Ok((dtype, op))
    }

    /// Validates one call against NCCL's rules for this rank.
    pub(crate) fn check_call(
        &self,
        coll: Collective,
        send: *const u8,
        recv: *mut u8,
        dtype: i32,
        op: Option<i32>,
        stream: usize,
    ) -> Result<Call> {
        let (dtype, op) = self.check_kind(&coll, dtype, op)?;
        let n = self.nranks;
        let me = self.rank;
        // Bytes this rank reads from sendbuff and writes to recvbuff, and where sendbuff sits
        // relative to recvbuff when the call is in place.
        let (send_bytes, recv_bytes, in_place_delta): (usize, usize, Option<isize>) = match &coll {
            Collective::AllReduce { count } => {
                let b = bytes_of(*count, 1, dtype, "count")?;
                (b, b, Some(0))
            }
            Collective::Broadcast { count, root } => {
                let b = bytes_of(*count, 1, dtype, "count")?;
                (if me == *root { b } else { 0 }, b, Some(0))
            }
            Collective::Reduce { count, root } => {
                let b = bytes_of(*count, 1, dtype, "count")?;
                (b, if me == *root { b } else { 0 }, Some(0))
            }
            Collective::AllGather { count } => {
                let b = bytes_of(*count, 1, dtype, "sendcount")?;
                bytes_of(*count, n, dtype, "recvbuff")?;
                (b, b * n, Some((me * b) as isize))
            }
            Collective::ReduceScatter { count } => {
                let b = bytes_of(*count, 1, dtype, "recvcount")?;
                bytes_of(*count, n, dtype, "sendbuff")?;
                (b * n, b, Some(-((me * b) as isize)))
            }
            Collective::AlltoAll { count } => {
                let b = bytes_of(*count, n, dtype, "count")?;
                (b, b, Some(0))
            }
            Collective::AlltoAllv(v) => {
                let PerPeer {
                    send_counts,
                    send_displs,
                    recv_counts,
                    recv_displs,
                } = &**v;
                for (name, v) in [
                    ("sendcounts", send_counts),
                    ("sdispls", send_displs),
                    ("recvcounts", recv_counts),
                    ("rdispls", recv_displs),
                ] {
                    if v.len() != n {
                        return crate::internal_err!(
                            "{name} has {} entries for {n} ranks",
                            v.len()
                        );
                    }
                }
                if send_counts[me] != recv_counts[me] {
                    return crate::invalid_arg!(
                        "sendcounts[{me}] = {} but recvcounts[{me}] = {}: a rank's block to itself must have one size",
                        send_counts[me],
                        recv_counts[me]
                    );
                }
                let extent = |counts: &[usize], displs: &[usize], what: &str| -> Result<usize> {
                    let mut end = 0usize;
                    for p in 0..n {
                        if counts[p] == 0 {
                            continue;
                        }
                        let e = displs[p].checked_add(counts[p]).map_or_else(
                            || crate::invalid_arg!("{what} block for rank {p} overflows"),
                            Ok,
                        )?;
                        end = end.max(e);
                    }
                    bytes_of(end, 1, dtype, what)
                };
                (
                    extent(send_counts, send_displs, "sendcounts/sdispls")?,
                    extent(recv_counts, recv_displs, "recvcounts/rdispls")?,
                    Some(0),
                )
            }
            Collective::Gather { count, root } => {
                let b = bytes_of(*count, 1, dtype, "count")?;
                bytes_of(*count, n, dtype, "recvbuff")?;
                (
                    b,
                    if me == *root { b * n } else { 0 },
                    Some((*root * b) as isize),
                )
            }
            Collective::Scatter { count, root } => {
                let b = bytes_of(*count, 1, dtype, "count")?;
                bytes_of(*count, n, dtype, "sendbuff")?;
                (
                    if me == *root { b * n } else { 0 },
                    b,
                    Some(-((*root * b) as isize)),
                )
            }
            Collective::Send { count, .. } => (bytes_of(*count, 1, dtype, "count")?, 0, None),
            Collective::Recv { count, .. } => (0, bytes_of(*count, 1, dtype, "count")?, None),
        };
        let (s, r) = (send as usize, recv as usize);
        check_ptr("sendbuff", s, send_bytes)?;
        check_ptr("recvbuff", r, recv_bytes)?;
        // Overlapping buffers are in place only at the distance NCCL's rule puts them.
        let shared = overlap(s, send_bytes, r, recv_bytes);
        if shared.is_some() && shared != in_place_delta {
            return crate::invalid_arg!(
                "sendbuff [{s:#x}, +{send_bytes}) and recvbuff [{r:#x}, +{recv_bytes}) overlap, but not in the way {} allows for in-place use{}",
                coll.name(),
                match in_place_delta {
                    Some(0) => " (sendbuff == recvbuff)".to_string(),
                    Some(d) if d > 0 => format!(" (sendbuff == recvbuff + {d} bytes)"),
                    Some(d) => format!(" (recvbuff == sendbuff + {} bytes)", -d),
                    None => String::new(),
                }
            );
        }
        let device = self.memory_kind(send, send_bytes, recv, recv_bytes)?;
        if device {
            // Kernels load whole elements; a misaligned one is a fault that kills the context.
            let elem = dtype.size();
            for (name, at, bytes) in [("sendbuff", s, send_bytes), ("recvbuff", r, recv_bytes)] {
                if bytes > 0 && at % elem != 0 {
                    return crate::invalid_arg!(
                        "{name} {at:#x} is not aligned to its {elem}-byte {} elements (device buffers must be)",
                        dtype.name()
                    );
                }
            }
        }
        if let Some(OpChoice::PreMulSum(ScalarSrc::Pointer(p))) = op {
            if !device && scalar_on_device(p) {
                return crate::invalid_arg!(
                    "the PreMulSum scalar is in device memory but the buffers are host memory; host calls read their scalar on the host (use ncclScalarHostImmediate or a host address)"
                );
            }
        }
        let in_place = shared.is_some();
        let footprint = Footprint {
            send_bytes,
            recv_bytes,
            in_place: shared,
        };
        Ok(Call {
            coll,
            send,
            recv,
            dtype,
            op,
            in_place,
            footprint,
            stage: false,
            stream,
            device,
        })
    }

    /// Whether a call's buffers are device memory (true) or host memory (false); they must agree
    /// and, when on a GPU, be on this communicator's.
    fn memory_kind(
        &self,
        send: *const u8,
        send_bytes: usize,
        recv: *mut u8,
        recv_bytes: usize,
    ) -> Result<bool> {
        use crate::cuda::{classify, MemKind};
        if !crate::cuda::any_device_memory() {
            return Ok(false);
        }
        let kind = |p: *const u8, bytes: usize| {
            (bytes > 0 && !p.is_null()).then(|| classify(p as *const std::ffi::c_void))
        };
        let (ks, kr) = (kind(send, send_bytes), kind(recv, recv_bytes));
        if let (Some(a), Some(b)) = (ks, kr) {
            if a != b {
                return crate::invalid_arg!(
                    "sendbuff is {a:?} memory but recvbuff is {b:?} memory; both must be host or both device memory"
                );
            }
        }
        let first = ks.map(|k| ("sendbuff", k)).or(kr.map(|k| ("recvbuff", k)));
        match first {
            Some((name, MemKind::Device(ordinal))) => match &self.device {
                Some(w) if w.device.ordinal == ordinal => Ok(true),
                Some(w) => crate::invalid_arg!(
                    "{name} is memory of GPU {ordinal} but this communicator was created on GPU {}",
                    w.device.ordinal
                ),
                None => crate::invalid_usage!(
                    "{name} is device memory, but this communicator has no device path: {}",
                    self.device_missing.as_deref().unwrap_or(
                        "some rank has no usable GPU, or the build has no kernels (see COMM_DEBUG=INFO)"
                    )
                ),
            },
            _ => Ok(false),
        }
    }

    /// Runs a call outside any group (the caller checks that) on `send` and `recv` the short
    /// way when it repeats the last call this communicator ran (`key`, see `Repeat`) on buffers
    /// that lie alike (`Footprint::admits`): that call's checks passed and give the same
    /// answers now (the communicator is still usable, and no device memory exists in the
    /// process that the buffers could be), its operation is kept and takes the new buffers, and
    /// only its number in the sequence is new. None, having done nothing, where the full path
    /// must take the call.
    pub(crate) fn again(&self, key: &Repeat, send: *const u8, recv: *mut u8) -> Option<Result<()>> {
        if self.device.is_some()
            || !self.blocking()
            || crate::cuda::any_device_memory()
            || self.check_usable().is_err()
        {
            return None;
        }
        // The gate is the executor's cache (`gate`): no lock beyond the one the run takes.
        let mut cache = match self.gate.enter(&self.wiring.cache) {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        let r = run_again_in(&self.wiring, &mut cache, key, send, recv, || {
            self.number(&key.coll)
        })?;
        if let Err(e) = &r {
            crate::warn!("{}", e.msg);
            self.fail(e);
        }
        Some(r)
    }

    /// Turns a validated call into an operation, numbering it. Called in issue order when the
    /// group runs, identically on every rank.
    pub(crate) fn prepare(&self, call: &Call) -> Result<HostOp> {
        let seq = self.number(&call.coll);
        self.build(call, seq)
    }

    /// The number of a collective in this communicator's sequence (0 for point-to-point
    /// calls, which match by order). Calls on one communicator are issued one at a time, as
    /// NCCL requires, so a plain load and store do: no locked instruction, which would wait
    /// for the previous call's stores into a peer's FIFO to reach that peer's core.
    fn number(&self, coll: &Collective) -> u64 {
        match coll {
            Collective::Send { .. } | Collective::Recv { .. } => 0,
            _ => {
                let s = self.seq.load(Ordering::Relaxed);
                self.seq.store(s + 1, Ordering::Relaxed);
                s
            }
        }
    }

    /// Turns a group's validated device calls into one program on their stream.
    pub(crate) fn enqueue_device(&self, calls: &[Call]) -> Result<()> {
        use crate::cuda::Stream;
        use crate::exec::device::{Described, DeviceOp, GroupStreams, Links, OpBuffers};
        let world = self.device.as_ref().ok_or_else(|| {
            crate::error::Error::new(
                crate::error::ErrorKind::Internal,
                "device call without a device path",
            )
        })?;
        // The communicator's GPU is current for the whole enqueue, as NCCL sets its device: the
        // legacy default stream (a NULL stream) is then that GPU's, whatever context the
        // calling thread has current, or none (a thread that never touched CUDA).
        let _bound = world.device.bind()?;
        let _relaxed = crate::cuda::RelaxedCapture::enter();
        let streams = GroupStreams::join(
            world,
            calls
                .iter()
                .map(|c| Stream(c.stream as *mut std::ffi::c_void)),
        )?;
        let mut ops = Vec::with_capacity(calls.len());
        let mut offsets = Vec::with_capacity(calls.len());
        let mut scratch = 0usize;
        for call in calls {
            let seq = self.number(&call.coll);
            let op = self.build_with_slice(call, seq, world.slot_bytes)?;
            offsets.push(scratch);
            scratch += op.schedule.scratch.next_multiple_of(256);
            ops.push(DeviceOp {
                coll: call.coll.clone(),
                schedule: op.schedule,
                reduction: op.reduction,
                elem: call.dtype.size(),
            });
        }
        let scratch_base = if scratch > 0 {
            world.scratch(scratch)?
        } else {
            0
        };
        let bufs: Vec<OpBuffers> = calls
            .iter()
            .zip(&offsets)
            .map(|(c, off)| OpBuffers {
                send: c.send as u64,
                recv: c.recv as u64,
                scratch: scratch_base + *off as u64,
            })
            .collect();
        let described = self.registry.as_ref().and_then(|reg| {
            Described::agree(
                reg,
                &self.transports,
                world,
                &self.paths,
                &self.placements,
                &ops,
                self.rank,
                self.nranks,
            )
        });
        let view = |peer: usize, addr: u64, len: usize| {
            described.as_ref().and_then(|d| d.view(peer, addr, len))
        };
        let links = match &described {
            Some(d) => d.links(&view),
            None => Links::staged(self.nranks),
        };
        let counted = described.is_some();
        let enqueued = self
            .enqueue_program(&ops, &bufs, &links, world, streams.main)
            .and_then(|()| streams.release(world));
        if let Err(e) = &enqueued {
            if counted {
                self.fail(e);
            }
        }
        enqueued
    }

    /// Compiles and enqueues one program, after the previous one on another stream.
    fn enqueue_program(
        &self,
        ops: &[crate::exec::device::DeviceOp],
        bufs: &[crate::exec::device::OpBuffers],
        links: &crate::exec::device::Links,
        world: &crate::transport::p2p::DeviceWorld,
        stream: crate::cuda::Stream,
    ) -> Result<()> {
        use crate::exec::device::{compile, enqueue, SLOTS};
        let prog = compile(
            ops,
            bufs,
            self.rank,
            self.nranks,
            SLOTS,
            world.slot_bytes,
            links,
        )?;
        let capturing = stream.capturing();
        let mut order = self.device_order.lock();
        if !capturing {
            if let Some((last, ev)) = order.as_ref() {
                if *last != stream {
                    ev.wait_on(stream)?;
                }
            }
        }
        enqueue(&prog, world, bufs, stream)?;
        if !capturing {
            let ev = match order.take() {
                Some((_, ev)) => ev,
                None => crate::cuda::Event::new(&world.device)?,
            };
            ev.record(stream)?;
            *order = Some((stream, ev));
        }
        if let Some(reg) = &self.registry {
            // The program is on its way; a failure here only keeps old mappings longer.
            if let Err(e) = reg.after_enqueue(&world.device, stream) {
                crate::warn!("releasing peers' retired buffers: {}", e.msg);
            }
        }
        Ok(())
    }

    pub(crate) fn build(&self, call: &Call, seq: u64) -> Result<HostOp> {
        self.build_with_slice(call, seq, self.slice_bytes)
    }

    fn build_with_slice(&self, call: &Call, seq: u64, slice_bytes: usize) -> Result<HostOp> {
        let tag = tag_of(&call.coll, call.dtype, op_code(call.op), seq);
        let reduction = call.op.map(|op| self.reduction(op, call.dtype));
        let op = |schedule| HostOp {
            schedule,
            send: call.send,
            recv: call.recv,
            tag,
            reduction,
        };
        let elem = call.dtype.size();
        // One look under one lock: the last call's schedule (`Schedules::last`), then the
        // tuner and the map. A call that misses both builds its schedule outside the lock.
        let key = {
            let mut all = self.schedules.lock();
            if let Some((_, s)) = all
                .last
                .as_ref()
                .filter(|(k, _)| k.matches(call, slice_bytes))
            {
                return Ok(op(s.clone()));
            }
            let (algo, _) = self.algorithm(call);
            let key = ScheduleKey {
                call: CallKey::of(call, slice_bytes),
                algo,
            };
            if let Some(s) = all.by_key.get(&key).cloned() {
                all.last = Some((key.call, s.clone()));
                return Ok(op(s));
            }
            key
        };
        let algo = key.algo;
        let bytes = algo::cost::tuner_bytes(&call.coll, elem);
        // Made only here: its ring order and host layout are reference counted, and a call
        // whose schedule is cached needs neither.
        let shape = Shape {
            rank: self.rank,
            nranks: self.nranks,
            elem,
            in_place: call.in_place,
            slice_bytes,
            ring: self.ring.clone(),
            hosts: self.hosts.clone(),
        };
        let s = Arc::new(match call.coll {
            Collective::Send { peer, count } if call.stage => {
                algo::staged_send(peer, count * shape.elem, &shape)
            }
            _ => algo::schedule(&call.coll, &shape, algo),
        });
        crate::trace!(
            "{} {bytes} bytes {} with {} ({} steps)",
            call.coll.name(),
            call.dtype.name(),
            algo.name(),
            s.steps.len()
        );
        let mut all = self.schedules.lock();
        if all.by_key.len() >= 256 {
            all.by_key.clear();
        }
        all.last = Some((key.call.clone(), s.clone()));
        all.by_key.insert(key, s.clone());
        Ok(op(s))
    }

    fn reduction(&self, op: OpChoice, dtype: DataType) -> Reduction {
        let sum = Reducer::new(dtype, ReduceOp::Sum);
        match op {
            OpChoice::Plain(p) => Reduction {
                reducer: Reducer::new(dtype, p),
                input_scale: None,
                input_scale_at: None,
                divide_by: None,
            },
            OpChoice::Avg if dtype.is_float() => Reduction {
                reducer: sum,
                input_scale: Some(Scale::reciprocal(dtype, self.nranks)),
                input_scale_at: None,
                divide_by: None,
            },
            OpChoice::Avg => Reduction {
                reducer: sum,
                input_scale: None,
                input_scale_at: None,
                divide_by: Some(self.nranks),
            },
            // A scalar in device memory is read by the kernels, when the call runs on the
            // stream (only device calls get here with one; see check_call).
            OpChoice::PreMulSum(ScalarSrc::Pointer(p)) if scalar_on_device(p) => Reduction {
                reducer: sum,
                input_scale: None,
                input_scale_at: Some(p as u64),
                divide_by: None,
            },
            OpChoice::PreMulSum(src) => Reduction {
                reducer: sum,
                input_scale: Some(match src {
                    ScalarSrc::Value(s) => s,
                    ScalarSrc::Pointer(p) => crate::exec::host::read_scalar(p, dtype),
                }),
                input_scale_at: None,
                divide_by: None,
            },
        }
    }
}

impl Comm {
    /// The tuner's algorithm for `call`, and the bytes it decided on.
    fn algorithm(&self, call: &Call) -> (algo::Algorithm, usize) {
        let bytes = algo::cost::tuner_bytes(&call.coll, call.dtype.size());
        let algo = if call.device {
            self.tuner.choose_device(&call.coll, bytes, self.nranks)
        } else {
            self.tuner.choose(&call.coll, bytes, self.nranks)
        };
        (algo, bytes)
    }

    /// ncclGroupSimulateEnd's estimate for one call, in microseconds: the cost model of
    /// `algo/cost.rs` on the schedules this call would run, with the figures of the transports
    /// that link this rank to its peers inside its host and between hosts (`Transports::
    /// figures`; the model's host-memory fabric where it has no such peers), and this host's
    /// cores shared by its ranks. Device buffers are priced as host memory.
    pub(crate) fn estimate_us(&self, call: &Call) -> f32 {
        let (algo, _) = self.algorithm(call);
        let ranks_per_host = self.hosts.as_deref().map_or(self.nranks, |l| {
            l.members.iter().map(Vec::len).max().unwrap_or(1)
        });
        let mut fabric =
            algo::cost::Fabric::host_memory(1250.0, crate::topo::usable_cpus(), ranks_per_host);
        // Ranks of one host that talk over the network (shared memory disabled) pay its link
        // inside the host too.
        if let Some(hop) = self.transports.figures(true) {
            fabric.intra = hop;
        }
        if let Some(hop) = self.transports.figures(false) {
            fabric.inter = hop;
        }
        algo::cost::predict(
            &call.coll,
            algo,
            call.dtype.size(),
            self.rank,
            self.nranks,
            self.ring.as_ref(),
            self.hosts.as_ref(),
            self.slice_bytes,
            &fabric,
        )
        .us
    }
}
