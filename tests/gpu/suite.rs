//! comm-gpu-suite: the device-memory correctness suite, built here and run on a GPU machine
//! (which has no Rust toolchain). Every collective x datatype x op on device buffers, in place
//! and out of place, with ranks as processes sharing one GPU and as threads of one process,
//! checked element by element against the same reference as the host tests.
//!
//!     comm-gpu-suite [--ranks 1,2,4,8] [--max-mib 256] [--quick]
//!
//! On the software GPU only (softgpu/, which fails driver calls on request and counts what
//! streams are given): `--faults` makes allocations and IPC opens fail and checks the errors
//! and the communicators after them; `--cost` prints per-call counts of what the device path
//! enqueues for each collective and size (scripts/softgpu_cost.sh makes a table of them).
//!
//! Exit status: 0 every check passed; 1 something failed; 77 there is no usable GPU, nothing
//! was tested (never a pass).

#[path = "../common/values.rs"]
#[allow(dead_code)]
mod values;

#[path = "../common/cases.rs"]
#[allow(dead_code)]
mod cases;

use cases::*;
use comm::ffi::types::*;
use comm::ffi::*;
use comm::testing::cuda::{self, Device};
use std::os::raw::c_void;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use values::*;

const NO_GPU: i32 = 77;

fn last_error() -> String {
    // SAFETY: returns a NUL-terminated string owned by the library.
    unsafe { std::ffi::CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

macro_rules! nccl {
    ($e:expr) => {{
        // SAFETY: the suite calls the C API as a C program would.
        #[allow(unused_unsafe, clippy::macro_metavars_in_unsafe)]
        let r = unsafe { $e };
        if r != ncclResult_t::ncclSuccess {
            return Err(format!(
                "{} returned {r:?}: {}",
                stringify!($e),
                last_error()
            ));
        }
    }};
}

/// How the suite's device buffers are made and whether they are registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Memory {
    /// ncclMemAlloc, not registered: every message staged through the slots.
    Plain,
    /// ncclMemAlloc (VMM, shared with peers as a file descriptor), registered.
    RegisteredVmm,
    /// cuMemAlloc (shared with peers as a legacy IPC handle), registered.
    RegisteredIpc,
}

impl Memory {
    fn parse(s: &str) -> Memory {
        match s {
            "vmm" => Memory::RegisteredVmm,
            "ipc" => Memory::RegisteredIpc,
            _ => Memory::Plain,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Memory::Plain => "plain",
            Memory::RegisteredVmm => "vmm",
            Memory::RegisteredIpc => "ipc",
        }
    }

    fn registered(self) -> bool {
        self != Memory::Plain
    }
}

/// Device memory (ncclMemAlloc or cuMemAlloc), registered with the communicator when asked;
/// deregistered and freed on drop.
struct DevBuf {
    ptr: u64,
    len: usize,
    comm: ncclComm_t,
    handle: *mut c_void,
    _plain: Option<cuda::DeviceMem>,
}

impl DevBuf {
    fn new(
        len: usize,
        memory: Memory,
        device: &Arc<Device>,
        comm: ncclComm_t,
    ) -> Result<DevBuf, String> {
        let (ptr, plain) = if memory == Memory::RegisteredIpc {
            let m = cuda::DeviceMem::new(device, len.max(256)).map_err(|e| e.msg)?;
            (m.ptr, Some(m))
        } else {
            let mut p: *mut c_void = std::ptr::null_mut();
            nccl!(ncclMemAlloc(&mut p, len.max(256)));
            (p as u64, None)
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        if memory.registered() {
            nccl!(ncclCommRegister(comm, ptr as *mut c_void, len, &mut handle));
        }
        Ok(DevBuf {
            ptr,
            len,
            comm,
            handle,
            _plain: plain,
        })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: registered on this communicator and allocated above, released once.
        unsafe {
            if !self.handle.is_null() {
                ncclCommDeregister(self.comm, self.handle);
            }
            if self._plain.is_none() {
                ncclMemFree(self.ptr as *mut c_void);
            }
        }
    }
}

struct Rank {
    comm: ncclComm_t,
    rank: usize,
    n: usize,
    device: Arc<Device>,
    /// One big buffer for in-place cases and two for out-of-place ones.
    a: DevBuf,
    b: DevBuf,
    /// Where PreMulSum scalars in device memory live.
    scalar: cuda::DeviceMem,
    /// The rank's own non-blocking stream (ranks that are threads on one GPU cannot share the
    /// legacy default stream).
    stream: cuda::Stream,
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let _ = self.stream.destroy();
    }
}

impl Rank {
    /// A rank's buffers for cases up to `max_bytes`.
    fn new(
        comm: ncclComm_t,
        rank: usize,
        n: usize,
        device: Arc<Device>,
        max_bytes: usize,
        memory: Memory,
    ) -> Result<Rank, String> {
        let buf = max_bytes.max(16 << 20);
        Ok(Rank {
            comm,
            rank,
            n,
            a: DevBuf::new(buf, memory, &device, comm)?,
            b: DevBuf::new(buf, memory, &device, comm)?,
            scalar: cuda::DeviceMem::new(&device, 256).map_err(|e| e.msg)?,
            stream: cuda::Stream::create(&device).map_err(|e| e.msg)?,
            device,
        })
    }

    fn run_case(
        &self,
        coll: Coll,
        dt: i32,
        op: i32,
        count: usize,
        in_place: bool,
    ) -> Result<(), String> {
        let (rank, n) = (self.rank, self.n);
        let es = size_of(dt);
        let root = root_for(count, n);
        let what = format!(
            "{coll:?} {} count={count} op={op} in_place={in_place} root={root} rank={rank}/{n}",
            name_of(dt)
        );
        let (send_elems, recv_elems) = elems(coll, count, n);
        let (send_bytes, recv_bytes) = (send_elems * es, recv_elems * es);
        if send_bytes.max(recv_bytes) > self.a.len {
            return Ok(());
        }
        let (soff, roff) = if in_place {
            in_place_offsets(coll, rank, root, count, es)
        } else {
            (0, 0)
        };
        let sendp = self.a.ptr + soff as u64;
        let recvp = if in_place {
            self.a.ptr + roff as u64
        } else {
            self.b.ptr
        };
        let mut host = vec![0u8; send_bytes];
        for (j, e) in host.chunks_exact_mut(es).enumerate() {
            encode(dt, contribution(coll, dt, op, rank, j), e);
        }
        // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
        unsafe { cuda::copy_to_device(&self.device, sendp, &host) }.map_err(|e| e.msg)?;
        let mut scalar_bytes = [0u8; 8];
        let mut redop = op;
        if reduces(coll) && op == PREMULSUM {
            encode(dt, scalar(dt), &mut scalar_bytes[..es]);
            // Odd counts take the scalar from device memory (ncclScalarDevice), read by the
            // kernels when the call runs; even ones as an immediate value.
            let (at, residence) = if count % 2 == 1 {
                // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
                unsafe { cuda::copy_to_device(&self.device, self.scalar.ptr, &scalar_bytes) }
                    .map_err(|e| e.msg)?;
                (self.scalar.ptr as *mut c_void, 0)
            } else {
                (scalar_bytes.as_mut_ptr() as *mut c_void, 1)
            };
            nccl!(ncclRedOpCreatePreMulSum(
                &mut redop, at, dt, residence, self.comm
            ));
        }
        let c = self.comm;
        let s = self.stream.0 as cudaStream_t;
        let sp = sendp as *const c_void;
        let rp = recvp as *mut c_void;
        let call = Call {
            coll,
            dt,
            count,
            redop,
            root,
            rank,
            n,
        };
        nccl!(call.make(sp, rp, c, s));
        self.stream.synchronize().map_err(|e| e.msg)?;
        if redop >= 5 {
            nccl!(ncclRedOpDestroy(redop, c));
        }
        if !has_output(coll, rank, root) {
            return Ok(());
        }
        let mut out = vec![0u8; recv_bytes];
        // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
        unsafe { cuda::copy_from_device(&self.device, &mut out, recvp) }.map_err(|e| e.msg)?;
        verify(coll, dt, op, rank, n, count, &what, &out)
    }

    /// A float all-reduce of 1003 elements from `send` on `stream` must be refused with
    /// `expected` and a message containing `needle`; `what` describes the call for a failure.
    fn expect_refused(
        &self,
        send: u64,
        stream: cudaStream_t,
        expected: ncclResult_t,
        needle: &str,
        what: &str,
    ) -> Result<(), String> {
        // SAFETY: valid device buffers and communicator; the call is expected to be refused.
        let r = unsafe {
            ncclAllReduce(
                send as *const c_void,
                self.b.ptr as *mut c_void,
                1003,
                7,
                SUM,
                self.comm,
                stream,
            )
        };
        let message = last_error();
        if r != expected || !message.contains(needle) {
            return Err(format!(
                "{what} returned {r:?} ({message}); expected {expected:?} with \"{needle}\""
            ));
        }
        Ok(())
    }

    /// Ranks that are threads on one GPU: a device call on the legacy default stream is
    /// refused with a message (their programs would queue behind each other there), and
    /// nothing of it is left behind (the matrix runs after it).
    fn legacy_stream_refused(&self) -> Result<(), String> {
        self.expect_refused(
            self.a.ptr,
            std::ptr::null_mut(),
            ncclResult_t::ncclInvalidUsage,
            "legacy default stream",
            "an all-reduce on the legacy stream by a thread rank sharing the GPU",
        )
    }

    /// Ranks on GPUs of their own: an all-reduce on the legacy default stream issued from a
    /// thread that has no context current (as nccl-tests' worker threads do with `-y 1`) runs
    /// on the communicator's GPU's legacy stream, as NCCL's does after its cudaSetDevice.
    fn legacy_stream_from_bare_thread(&self) -> Result<(), String> {
        let (n, count) = (self.n, 1003usize);
        let host: Vec<u8> = (0..count)
            .flat_map(|j| ((self.rank * 100 + j) as f32).to_ne_bytes())
            .collect();
        // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
        unsafe { cuda::copy_to_device(&self.device, self.a.ptr, &host) }.map_err(|e| e.msg)?;
        let (send, recv, comm) = (self.a.ptr, self.b.ptr, self.comm as usize);
        let outcome = std::thread::spawn(move || {
            // SAFETY: valid device buffers of `count` floats and a communicator no other
            // thread uses meanwhile.
            let r = unsafe {
                ncclAllReduce(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    7,
                    SUM,
                    comm as ncclComm_t,
                    std::ptr::null_mut(),
                )
            };
            (r, last_error())
        })
        .join()
        .map_err(|_| "the calling thread panicked".to_string())?;
        if outcome.0 != ncclResult_t::ncclSuccess {
            return Err(format!(
                "an all-reduce on the legacy stream from a thread without a current context returned {:?}: {}",
                outcome.0, outcome.1
            ));
        }
        let _b = self.device.bind().map_err(|e| e.msg)?;
        cuda::Stream(std::ptr::null_mut())
            .synchronize()
            .map_err(|e| e.msg)?;
        let mut out = vec![0u8; count * 4];
        // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
        unsafe { cuda::copy_from_device(&self.device, &mut out, recv) }.map_err(|e| e.msg)?;
        for (j, b) in out.chunks_exact(4).enumerate() {
            let got = f32::from_ne_bytes(b.try_into().unwrap());
            let want = (0..n).map(|r| (r * 100 + j) as f32).sum::<f32>();
            if got != want {
                return Err(format!(
                    "legacy-stream all-reduce from a bare thread: element {j} is {got}, expected {want}"
                ));
            }
        }
        Ok(())
    }

    /// A float buffer 2 bytes off its element alignment is refused with a message (a kernel
    /// would fault on it and take the context down), and nothing was enqueued.
    fn misaligned_refused(&self) -> Result<(), String> {
        self.expect_refused(
            self.a.ptr + 2,
            self.stream.0 as cudaStream_t,
            ncclResult_t::ncclInvalidArgument,
            "not aligned",
            "an all-reduce of floats from a misaligned sendbuff",
        )
    }

    /// One group of all-reduces issued on two streams (NCCL joins a group's streams): each
    /// result checked, on both streams, after synchronizing them.
    fn grouped_streams(&self) -> Result<(), String> {
        let (n, count) = (self.n, 1000usize + 3);
        let s1 = cuda::Stream::create(&self.device).map_err(|e| e.msg)?;
        let s2 = cuda::Stream::create(&self.device).map_err(|e| e.msg)?;
        let half = (self.a.len / 2) as u64;
        let mut bufs = Vec::new();
        for (k, base) in [(0usize, self.a.ptr), (1, self.a.ptr + half)] {
            let host: Vec<u8> = (0..count)
                .flat_map(|j| ((self.rank * 7 + j + k) as f32).to_ne_bytes())
                .collect();
            // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
            unsafe { cuda::copy_to_device(&self.device, base, &host) }.map_err(|e| e.msg)?;
            bufs.push((base, self.b.ptr + k as u64 * half));
        }
        nccl!(ncclGroupStart());
        for (k, (src, dst)) in bufs.iter().enumerate() {
            let s = if k == 0 { s1 } else { s2 };
            nccl!(ncclAllReduce(
                *src as *const c_void,
                *dst as *mut c_void,
                count,
                7,
                SUM,
                self.comm,
                s.0 as cudaStream_t
            ));
        }
        nccl!(ncclGroupEnd());
        for s in [s1, s2] {
            s.synchronize().map_err(|e| e.msg)?;
            s.destroy().map_err(|e| e.msg)?;
        }
        for (k, (_, dst)) in bufs.iter().enumerate() {
            let mut out = vec![0u8; count * 4];
            // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
            unsafe { cuda::copy_from_device(&self.device, &mut out, *dst) }.map_err(|e| e.msg)?;
            for (j, c) in out.chunks_exact(4).enumerate() {
                let got = f32::from_ne_bytes(c.try_into().unwrap());
                let want: f32 = (0..n).map(|r| (r * 7 + j + k) as f32).sum();
                if got != want {
                    return Err(format!(
                        "all-reduce {k} of a group on two streams: element {j} is {got}, expected {want}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// All-reduces captured into a CUDA graph, then replayed three times with new inputs in
    /// between: every replay's result checked (flags and slots must come back to their start
    /// for that to work). Sizes for the one-shot, two-shot and ring algorithms.
    fn graph_replay(&self) -> Result<(), String> {
        let stream = cuda::Stream::create(&self.device).map_err(|e| e.msg)?;
        for count in [1003usize, (1 << 20) + 3, (24 << 20) + 3] {
            if count * 4 > self.a.len {
                continue;
            }
            let fill = |round: usize| -> Result<(), String> {
                let host: Vec<u8> = (0..count)
                    .flat_map(|j| ((self.rank * 3 + j % 1000 + round) as f32).to_ne_bytes())
                    .collect();
                // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
                unsafe { cuda::copy_to_device(&self.device, self.a.ptr, &host) }.map_err(|e| e.msg)
            };
            let reduce = || {
                nccl!(ncclAllReduce(
                    self.a.ptr as *const c_void,
                    self.b.ptr as *mut c_void,
                    count,
                    7,
                    SUM,
                    self.comm,
                    stream.0 as cudaStream_t
                ));
                Ok::<(), String>(())
            };
            // Once eagerly first, so that nothing has to be allocated while capturing.
            fill(0)?;
            reduce()?;
            stream.synchronize().map_err(|e| e.msg)?;
            cuda::Graph::begin_capture(&self.device, stream).map_err(|e| e.msg)?;
            let captured = reduce();
            let graph = cuda::Graph::end_capture(&self.device, stream).map_err(|e| e.msg)?;
            captured?;
            for round in 1..=3 {
                fill(round)?;
                graph.launch(stream).map_err(|e| e.msg)?;
                stream.synchronize().map_err(|e| e.msg)?;
                let mut out = vec![0u8; count * 4];
                // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
                unsafe { cuda::copy_from_device(&self.device, &mut out, self.b.ptr) }
                    .map_err(|e| e.msg)?;
                for (j, c) in out.chunks_exact(4).enumerate() {
                    let got = f32::from_ne_bytes(c.try_into().unwrap());
                    let want: f32 = (0..self.n).map(|r| (r * 3 + j % 1000 + round) as f32).sum();
                    if got != want {
                        return Err(format!(
                            "graph replay {round} of an all-reduce of {count}: element {j} is {got}, expected {want}"
                        ));
                    }
                }
            }
        }
        stream.destroy().map_err(|e| e.msg)
    }

    /// Capture that forks onto a second stream and joins back, as PyTorch captures: the
    /// capture begins on stream A, an event recorded there is waited on by stream B (which
    /// joins the capture), a group runs one all-reduce on A and one on B, an in-place
    /// all-reduce of B's result runs on B alone, and B's last work is joined back into A by
    /// another event. The graph is
    /// replayed with new inputs and both results checked. A fork that is not joined back makes
    /// the capture fail (cudaErrorStreamCaptureUnjoined).
    fn forkjoin_capture(&self) -> Result<(), String> {
        let count = 1003usize;
        let a = cuda::Stream::create(&self.device).map_err(|e| e.msg)?;
        let b = cuda::Stream::create(&self.device).map_err(|e| e.msg)?;
        let fork = cuda::Event::new(&self.device).map_err(|e| e.msg)?;
        let join = cuda::Event::new(&self.device).map_err(|e| e.msg)?;
        let half = (self.a.len / 2) as u64;
        let (src, dst) = (
            [self.a.ptr, self.a.ptr + half],
            [self.b.ptr, self.b.ptr + half],
        );
        let fill = |round: usize| -> Result<(), String> {
            for (k, p) in src.iter().enumerate() {
                let host: Vec<u8> = (0..count)
                    .flat_map(|j| ((self.rank * 5 + j % 100 + round + k) as f32).to_ne_bytes())
                    .collect();
                // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
                unsafe { cuda::copy_to_device(&self.device, *p, &host) }.map_err(|e| e.msg)?;
            }
            Ok(())
        };
        let reduce = |k: usize, s: cuda::Stream| {
            nccl!(ncclAllReduce(
                src[k] as *const c_void,
                dst[k] as *mut c_void,
                count,
                7,
                SUM,
                self.comm,
                s.0 as cudaStream_t
            ));
            Ok::<(), String>(())
        };
        let work = || -> Result<(), String> {
            nccl!(ncclGroupStart());
            let r = reduce(0, a).and_then(|()| reduce(1, b));
            nccl!(ncclGroupEnd());
            r?;
            // In place on the group's result: right only if it runs after the group on B.
            nccl!(ncclAllReduce(
                dst[1] as *const c_void,
                dst[1] as *mut c_void,
                count,
                7,
                SUM,
                self.comm,
                b.0 as cudaStream_t
            ));
            Ok(())
        };
        // Eagerly first, so that nothing is allocated while capturing.
        fill(0)?;
        work()?;
        for s in [a, b] {
            s.synchronize().map_err(|e| e.msg)?;
        }
        cuda::Graph::begin_capture(&self.device, a).map_err(|e| e.msg)?;
        let recorded = fork
            .record(a)
            .and_then(|()| fork.wait_on(b))
            .map_err(|e| e.msg);
        let captured = recorded.and_then(|()| work());
        let joined = join
            .record(b)
            .and_then(|()| join.wait_on(a))
            .map_err(|e| e.msg);
        let graph = cuda::Graph::end_capture(&self.device, a).map_err(|e| e.msg)?;
        captured?;
        joined?;
        for round in 1..=2 {
            fill(round)?;
            graph.launch(a).map_err(|e| e.msg)?;
            a.synchronize().map_err(|e| e.msg)?;
            for (k, p) in dst.iter().enumerate() {
                let mut out = vec![0u8; count * 4];
                // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
                unsafe { cuda::copy_from_device(&self.device, &mut out, *p) }.map_err(|e| e.msg)?;
                // Buffer 1 was reduced twice: the second all-reduce sums the first's result.
                let times = if k == 0 { 1.0 } else { self.n as f32 };
                for (j, c) in out.chunks_exact(4).enumerate() {
                    let got = f32::from_ne_bytes(c.try_into().unwrap());
                    let sum: f32 = (0..self.n)
                        .map(|r| (r * 5 + j % 100 + round + k) as f32)
                        .sum();
                    if got != sum * times {
                        return Err(format!(
                            "fork/join graph replay {round}, buffer {k}: element {j} is {got}, expected {}",
                            sum * times
                        ));
                    }
                }
            }
        }
        drop(graph);
        // A fork never joined back: the capture must fail, not hand out a graph that leaves
        // stream B's work behind. Only this rank's streams: no collective is captured.
        cuda::Graph::begin_capture(&self.device, a).map_err(|e| e.msg)?;
        fork.record(a)
            .and_then(|()| fork.wait_on(b))
            .map_err(|e| e.msg)?;
        b.set_flag(self.scalar.ptr, 7).map_err(|e| e.msg)?;
        match cuda::Graph::end_capture(&self.device, a) {
            Ok(_) => return Err("a capture with an unjoined fork ended successfully".into()),
            Err(e) if e.msg.contains("UNJOINED") => {}
            Err(e) => return Err(format!("an unjoined fork failed otherwise: {}", e.msg)),
        }
        // Both streams left the capture: they run work again.
        b.set_flag(self.scalar.ptr, 9).map_err(|e| e.msg)?;
        b.synchronize().map_err(|e| e.msg)?;
        let mut flag = [0u8; 4];
        // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
        unsafe { cuda::copy_from_device(&self.device, &mut flag, self.scalar.ptr) }
            .map_err(|e| e.msg)?;
        if u32::from_ne_bytes(flag) != 9 {
            return Err(format!(
                "after the failed capture, stream B's write gave {}, not 9",
                u32::from_ne_bytes(flag)
            ));
        }
        for s in [a, b] {
            s.destroy().map_err(|e| e.msg)?;
        }
        Ok(())
    }

    /// Windows on device memory (cudaMalloc memory, then ncclMemAlloc memory): each rank puts
    /// a pattern into the next rank's window with ncclPutSignal on its stream and waits for
    /// the previous rank's signal on it; then gets, fetch-adds on rank 0's window and peer
    /// device pointers. Checked byte by byte.
    fn device_windows(&self) -> Result<(), String> {
        let (me, n) = (self.rank, self.n);
        let next = (me + 1) % n;
        let prev = (me + n - 1) % n;
        let len = (1usize << 20) + 13;
        let size = len + 64;
        let pat = |r: usize, i: usize| (r * 29 + i * 7 + i / 509 + 3) as u8;
        for vmm in [false, true] {
            let plain;
            let mem = if vmm {
                let mut p: *mut c_void = std::ptr::null_mut();
                nccl!(ncclMemAlloc(&mut p, size));
                plain = None;
                p as u64
            } else {
                let m = cuda::DeviceMem::new(&self.device, size).map_err(|e| e.msg)?;
                let p = m.ptr;
                plain = Some(m);
                p
            };
            // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
            unsafe { cuda::copy_to_device(&self.device, mem, &vec![0u8; size]) }
                .map_err(|e| e.msg)?;
            let mut win: ncclWindow_t = std::ptr::null_mut();
            nccl!(ncclCommWindowRegister(
                self.comm,
                mem as *mut c_void,
                size,
                &mut win,
                NCCL_WIN_COLL_SYMMETRIC
            ));
            let src: Vec<u8> = (0..len).map(|i| pat(me, i)).collect();
            // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
            unsafe { cuda::copy_to_device(&self.device, self.a.ptr, &src) }.map_err(|e| e.msg)?;
            let s = self.stream.0 as cudaStream_t;
            nccl!(ncclPutSignal(
                self.a.ptr as *const c_void,
                len,
                1,
                next as i32,
                win,
                0,
                0,
                0,
                0,
                self.comm,
                s
            ));
            let mut d = [ncclWaitSignalDesc_t {
                opCnt: 1,
                peer: prev as i32,
                sigIdx: 0,
                ctx: 0,
            }];
            nccl!(ncclWaitSignal(1, d.as_mut_ptr(), self.comm, s));
            self.stream.synchronize().map_err(|e| e.msg)?;
            let mut got = vec![0u8; len];
            // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
            unsafe { cuda::copy_from_device(&self.device, &mut got, mem) }.map_err(|e| e.msg)?;
            if let Some(i) = (0..len).find(|&i| got[i] != pat(prev, i)) {
                return Err(format!(
                    "device window (vmm {vmm}): byte {i} from rank {prev} is {}, expected {}",
                    got[i],
                    pat(prev, i)
                ));
            }
            // The next rank's window holds what this rank put: read it back with a get.
            let mut back = vec![0u8; len];
            nccl!(commWinGet(
                back.as_mut_ptr() as *mut c_void,
                len,
                1,
                next as i32,
                win,
                0,
                self.comm
            ));
            if back != src {
                return Err(format!(
                    "device window (vmm {vmm}): get from rank {next} differs"
                ));
            }
            for _ in 0..100 {
                nccl!(commWinFetchAdd(
                    1,
                    std::ptr::null_mut(),
                    5,
                    0,
                    win,
                    len.next_multiple_of(8),
                    self.comm
                ));
            }
            let mut p: *mut c_void = std::ptr::null_mut();
            nccl!(ncclGetPeerDevicePointer(win, 0, next as i32, &mut p));
            if p.is_null() {
                return Err(format!(
                    "device window (vmm {vmm}): no device pointer for rank {next}"
                ));
            }
            nccl!(commWinChannelBarrier(0, 60_000, win, self.comm));
            if me == 0 {
                let mut word = [0u8; 8];
                // SAFETY: inside one of this rank's device allocations, sized for it, idle at this point.
                unsafe {
                    cuda::copy_from_device(
                        &self.device,
                        &mut word,
                        mem + len.next_multiple_of(8) as u64,
                    )
                }
                .map_err(|e| e.msg)?;
                let v = u64::from_ne_bytes(word);
                if v != 100 * n as u64 {
                    return Err(format!(
                        "device window (vmm {vmm}): counter {v} after {n} x 100 fetch-adds"
                    ));
                }
            }
            nccl!(commWinChannelBarrier(0, 60_000, win, self.comm));
            nccl!(ncclCommWindowDeregister(self.comm, win));
            if vmm {
                nccl!(ncclMemFree(mem as *mut c_void));
            }
            drop(plain);
        }
        Ok(())
    }

    /// Every collective x datatype x op; the largest sizes for float sums only.
    fn matrix(&self, max_bytes: usize, quick: bool) -> Result<usize, String> {
        let n = self.n;
        let mut cases = 0;
        let small = [0usize, 1, 7, 5 * n + 1, 1000];
        for coll in COLLS {
            for &(dt, _, es) in DTYPES.iter() {
                let ops: Vec<i32> = if reduces(coll) {
                    OPS.iter().map(|o| o.0).collect()
                } else {
                    vec![SUM]
                };
                for &op in &ops {
                    let mut sizes = small.to_vec();
                    if !quick {
                        sizes.push((1 << 20) + 3);
                    }
                    if dt == 7 && op == SUM {
                        sizes.push(max_bytes / es / n.max(1));
                    }
                    for &count in &sizes {
                        for in_place in [false, true] {
                            if coll == Coll::SendRecv && in_place {
                                continue;
                            }
                            self.run_case(coll, dt, op, count, in_place)?;
                            cases += 1;
                        }
                    }
                }
            }
        }
        Ok(cases)
    }
}

fn id_hex(id: &ncclUniqueId) -> String {
    id.internal
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect()
}

fn id_from(hex: &str) -> ncclUniqueId {
    let mut id = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    for (i, c) in id.internal.iter_mut().enumerate() {
        *c = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0) as std::os::raw::c_char;
    }
    id
}

fn worker(
    rank: usize,
    n: usize,
    id: ncclUniqueId,
    max_bytes: usize,
    quick: bool,
    memory: Memory,
) -> Result<usize, String> {
    let device = Device::get(0).map_err(|e| e.msg)?;
    let _bound = device.bind().map_err(|e| e.msg)?;
    let mut comm: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommInitRank(&mut comm, n as i32, id, rank as i32));
    let mut features = 0;
    nccl!(commGetFeatures(&mut features));
    if features & COMM_FEATURE_DEVICE_MEMORY == 0 {
        return Err("the library reports no device memory support".into());
    }
    let r = Rank::new(comm, rank, n, device, max_bytes, memory)?;
    r.misaligned_refused()?;
    let cases = r.matrix(max_bytes, quick)?;
    r.grouped_streams()?;
    // Across hosts, device buffers are staged through host memory by the calling thread,
    // which a graph cannot capture (the library refuses it).
    if std::env::var("COMM_HOSTID").is_err() {
        r.graph_replay()?;
        r.forkjoin_capture()?;
        r.device_windows()?;
    }
    drop(r);
    nccl!(ncclCommDestroy(comm));
    Ok(cases)
}

/// The software GPU's own controls (softgpu/, a CPU stand-in for the CUDA driver), looked up
/// in the loaded driver; None on a real driver.
mod softgpu {
    use std::os::raw::{c_char, c_int, c_long, c_void};

    /// `struct softgpu_counters` of softgpu/counts.cpp, version 1.
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct Counters {
        pub version: u64,
        pub kernels: u64,
        pub write_values: u64,
        pub wait_values: u64,
        pub copies: u64,
        pub memsets: u64,
        pub host_funcs: u64,
        pub event_records: u64,
        pub event_waits: u64,
        pub graph_launches: u64,
        pub copy_bytes: u64,
        pub captured: u64,
        pub copy_sizes: [u64; 40],
    }

    fn symbol(name: &std::ffi::CStr) -> Option<*mut c_void> {
        // SAFETY: RTLD_NOLOAD only finds a library already loaded (the driver cudarc opened).
        let lib =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        let lib = if lib.is_null() {
            // SAFETY: as above, under cudarc's first name.
            unsafe { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) }
        } else {
            lib
        };
        if lib.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated name in a loaded library.
        let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
        (!f.is_null()).then_some(f)
    }

    /// Makes the k-th call of driver entry point `name` from now fail.
    pub fn fail_call(name: &std::ffi::CStr, k: i64) -> Result<(), String> {
        let f = symbol(c"softgpu_fail_call")
            .ok_or("failures on request need the software GPU (scripts/softgpu.sh)")?;
        // SAFETY: the signature of softgpu_fail_call in softgpu/faults.cpp.
        let f: extern "C" fn(*const c_char, c_long) -> c_int = unsafe { std::mem::transmute(f) };
        if f(name.as_ptr(), k as c_long) != 0 {
            return Err(format!("softgpu_fail_call({name:?}, {k}) refused"));
        }
        Ok(())
    }

    /// This process's running totals of work given to streams.
    pub fn counters() -> Result<Counters, String> {
        let f = symbol(c"softgpu_counters")
            .ok_or("counting needs the software GPU (scripts/softgpu.sh)")?;
        // SAFETY: the signature of softgpu_counters in softgpu/counts.cpp.
        let f: extern "C" fn(*mut Counters) -> c_int = unsafe { std::mem::transmute(f) };
        // SAFETY: plain integers, for which zero is a value.
        let mut c: Counters = unsafe { std::mem::zeroed() };
        if f(&mut c) != 0 || c.version != 1 {
            return Err("softgpu_counters: unknown layout".into());
        }
        Ok(c)
    }
}

/// Failures on request (the software GPU only), in each of 2 processes: a failed allocation
/// or IPC open makes the call that needed it return an error naming the driver call, takes
/// nothing with it (SOFTGPU_LEAKS at exit, checked by scripts/test_softgpu.sh), and the next
/// attempt works. `ids`: unique ids of the communicators the worker makes, in order.
fn fault_worker(rank: usize, n: usize, ids: &[ncclUniqueId]) -> Result<(), String> {
    let device = Device::get(0).map_err(|e| e.msg)?;
    let _bound = device.bind().map_err(|e| e.msg)?;
    let expect_err = |r: ncclResult_t, what: &str, names: &str| -> Result<(), String> {
        if r == ncclResult_t::ncclSuccess {
            return Err(format!(
                "{what} succeeded although the driver failed {names}"
            ));
        }
        let msg = last_error();
        if !msg.contains(names) {
            return Err(format!(
                "{what} failed ({r:?}) without naming {names}: {msg}"
            ));
        }
        Ok(())
    };
    // 1. ncclMemAlloc: the VMM allocation, the address reservation and the mapping fail in
    // turn; each time nothing stays held, and then an allocation works.
    for call in [c"cuMemCreate", c"cuMemAddressReserve", c"cuMemMap"] {
        softgpu::fail_call(call, 1)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let r = unsafe { ncclMemAlloc(&mut p, 3 << 20) };
        expect_err(r, "ncclMemAlloc", call.to_str().unwrap())?;
        if !p.is_null() {
            return Err("a failed ncclMemAlloc handed out a pointer".into());
        }
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    nccl!(ncclMemAlloc(&mut p, 3 << 20));
    nccl!(ncclMemFree(p));
    // 2 and 3. A rank cannot allocate its device area (every rank: cuMemAlloc), or cannot
    // map a peer's (rank 1: cuIpcOpenMemHandle): the communicator is still made, on host
    // memory only (every rank agrees), and a call on device memory is refused naming the
    // driver call that failed on the rank where it failed; host memory still works.
    for (k, call) in [(0usize, c"cuMemAlloc_v2"), (1, c"cuIpcOpenMemHandle_v2")] {
        let here = k == 0 || rank == 1;
        if here {
            softgpu::fail_call(call, 1)?;
        }
        let mut comm: ncclComm_t = std::ptr::null_mut();
        nccl!(ncclCommInitRank(&mut comm, n as i32, ids[k], rank as i32));
        let buf = cuda::DeviceMem::new(&device, 4096).map_err(|e| e.msg)?;
        let stream = cuda::Stream::create(&device).map_err(|e| e.msg)?;
        // SAFETY: a device buffer of 4096 bytes, a valid communicator and stream.
        let r = unsafe {
            ncclAllReduce(
                buf.ptr as *const c_void,
                buf.ptr as *mut c_void,
                1024,
                7,
                SUM,
                comm,
                stream.0 as cudaStream_t,
            )
        };
        let name = call.to_str().unwrap().trim_end_matches("_v2");
        expect_err(
            r,
            "a device all-reduce without a device path",
            if here { name } else { "no device path" },
        )?;
        let mut host = vec![1.0f32 + rank as f32; 1000];
        nccl!(ncclAllReduce(
            host.as_ptr() as *const c_void,
            host.as_mut_ptr() as *mut c_void,
            1000,
            7,
            SUM,
            comm,
            std::ptr::null_mut()
        ));
        let want: f32 = (0..n).map(|r| 1.0 + r as f32).sum();
        if host.iter().any(|&x| x != want) {
            return Err(format!(
                "a host all-reduce after {name} failed gave {}",
                host[0]
            ));
        }
        drop(buf);
        stream.destroy().map_err(|e| e.msg)?;
        nccl!(ncclCommDestroy(comm));
    }
    // 4. Now a communicator works, and on registered cuMemAlloc buffers rank 1 cannot map
    // rank 0's: its messages stay staged and the results are still right.
    let mut comm: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommInitRank(&mut comm, n as i32, ids[2], rank as i32));
    if rank == 1 {
        softgpu::fail_call(c"cuIpcOpenMemHandle_v2", 1)?;
    }
    let r = Rank::new(comm, rank, n, device, 1 << 20, Memory::RegisteredIpc)?;
    for coll in [Coll::AllReduce, Coll::AllGather, Coll::SendRecv] {
        for count in [1usize, 1003, 65537] {
            r.run_case(coll, 7, SUM, count, false)?;
        }
    }
    drop(r);
    nccl!(ncclCommDestroy(comm));
    println!("  rank {rank}: every failed driver call answered with an error naming it; 9 cases passed after them");
    Ok(())
}

/// One worker per rank for `--faults`, with a deadline.
fn run_faults(n: usize) -> Result<(), String> {
    let mut ids = Vec::new();
    for _ in 0..3 {
        let mut id = ncclUniqueId {
            internal: [0; NCCL_UNIQUE_ID_BYTES],
        };
        nccl!(ncclGetUniqueId(&mut id));
        ids.push(id_hex(&id));
    }
    let outs = spawn_ranks(
        "--fault-worker",
        n,
        &ids,
        Duration::from_secs(120),
        |_, cmd| {
            cmd.env("COMM_TIMEOUT", "20").env("COMM_DEBUG", "WARN");
        },
    )?;
    all_passed(&outs)
}

/// Runs this program once per rank as `role rank n args...`, each command given its
/// environment by `env(rank, command)`, and waits for them all (killed at `limit`). Returns
/// each rank's output, in rank order.
fn spawn_ranks(
    role: &str,
    n: usize,
    args: &[String],
    limit: Duration,
    env: impl Fn(usize, &mut Command),
) -> Result<Vec<std::process::Output>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Vec::new();
    for r in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args([role, &r.to_string(), &n.to_string()])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        env(r, &mut cmd);
        match cmd.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                for c in children.iter_mut() {
                    let _ = c.kill();
                }
                return Err(format!("rank {r}: {e}"));
            }
        }
    }
    let deadline = Instant::now() + limit;
    while !children
        .iter_mut()
        .all(|c| matches!(c.try_wait(), Ok(Some(_))))
    {
        if Instant::now() > deadline {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            return Err(format!(
                "{n} ranks did not finish within {} s",
                limit.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    children
        .into_iter()
        .map(|c| c.wait_with_output().map_err(|e| e.to_string()))
        .collect()
}

/// What a failed rank said: its output and the last lines of its log.
fn rank_failure(r: usize, out: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
    format!(
        "rank {r}: {}\n{}",
        stdout.trim(),
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    )
}

/// Prints what the ranks that passed said; Ok when they all passed, else every failure.
fn all_passed(outs: &[std::process::Output]) -> Result<(), String> {
    let mut failures = Vec::new();
    for (r, out) in outs.iter().enumerate() {
        if out.status.success() {
            print!("{}", String::from_utf8_lossy(&out.stdout));
        } else {
            failures.push(rank_failure(r, out));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

/// The collectives and sizes `--cost` measures.
const COST_COLLS: [Coll; 6] = [
    Coll::AllReduce,
    Coll::AllGather,
    Coll::ReduceScatter,
    Coll::Broadcast,
    Coll::AlltoAll,
    Coll::SendRecv,
];
const COST_BYTES: [usize; 5] = [8, 4 << 10, 256 << 10, 4 << 20, 64 << 20];
const COST_ITERS: u64 = 4;

/// `--cost`: what one call of each collective gives the device's streams, per rank: float
/// sums of COST_BYTES per rank (the send size, as nccl-tests counts), eager, on the rank's
/// own stream; counted by the software GPU over COST_ITERS calls after one warm-up call.
/// Prints one line per collective and size: `COST coll bytes nranks rank kernels
/// write_values wait_values copies copy_bytes memsets host_funcs event_records event_waits`.
fn cost_worker(rank: usize, n: usize, id: ncclUniqueId) -> Result<(), String> {
    let device = Device::get(0).map_err(|e| e.msg)?;
    let _bound = device.bind().map_err(|e| e.msg)?;
    let mut comm: ncclComm_t = std::ptr::null_mut();
    nccl!(ncclCommInitRank(&mut comm, n as i32, id, rank as i32));
    let max = *COST_BYTES.iter().max().unwrap();
    let r = Rank::new(comm, rank, n, device, max * n, Memory::Plain)?;
    let s = r.stream.0 as cudaStream_t;
    for coll in COST_COLLS {
        for bytes in COST_BYTES {
            let count = match coll {
                Coll::ReduceScatter => bytes / 4 / n,
                Coll::AlltoAll => bytes / 4 / n,
                _ => bytes / 4,
            }
            .max(1);
            let call = Call {
                coll,
                dt: 7,
                count,
                redop: SUM,
                root: 0,
                rank,
                n,
            };
            let (sp, rp) = (r.a.ptr as *const c_void, r.b.ptr as *mut c_void);
            nccl!(call.make(sp, rp, comm, s));
            r.stream.synchronize().map_err(|e| e.msg)?;
            let before = softgpu::counters()?;
            for _ in 0..COST_ITERS {
                nccl!(call.make(sp, rp, comm, s));
            }
            r.stream.synchronize().map_err(|e| e.msg)?;
            let after = softgpu::counters()?;
            let d = |f: fn(&softgpu::Counters) -> u64| {
                (f(&after) - f(&before)) as f64 / COST_ITERS as f64
            };
            println!(
                "COST {coll:?} {bytes} {n} {rank} {} {} {} {} {} {} {} {} {}",
                d(|c| c.kernels),
                d(|c| c.write_values),
                d(|c| c.wait_values),
                d(|c| c.copies),
                d(|c| c.copy_bytes),
                d(|c| c.memsets),
                d(|c| c.host_funcs),
                d(|c| c.event_records),
                d(|c| c.event_waits),
            );
        }
    }
    drop(r);
    nccl!(ncclCommDestroy(comm));
    Ok(())
}

fn run_cost(n: usize) -> Result<(), String> {
    let mut id = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    nccl!(ncclGetUniqueId(&mut id));
    let outs = spawn_ranks(
        "--cost-worker",
        n,
        &[id_hex(&id)],
        Duration::from_secs(600),
        |_, cmd| {
            cmd.env("COMM_DEBUG", "WARN");
        },
    )?;
    all_passed(&outs)
}

/// `hosts`: tell the ranks they are on two hosts (COMM_HOSTID by parity), so that device
/// buffers go through host memory and the TCP transport.
fn run_processes(
    n: usize,
    max_bytes: usize,
    quick: bool,
    memory: Memory,
    hosts: bool,
) -> Result<(), String> {
    let mut id = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    nccl!(ncclGetUniqueId(&mut id));
    let args = [
        id_hex(&id),
        max_bytes.to_string(),
        if quick { "1" } else { "0" }.to_string(),
        memory.name().to_string(),
    ];
    let outs = spawn_ranks(
        "--worker",
        n,
        &args,
        Duration::from_secs(60 * 20),
        |r, cmd| {
            if hosts {
                cmd.env("COMM_HOSTID", format!("gpu-suite-host-{}", r % 2));
            }
            // The log says when a pair switches to reading registered buffers in place, and
            // warns when destroy leaves device memory allocated.
            cmd.env(
                "COMM_DEBUG",
                if memory.registered() { "INFO" } else { "WARN" },
            );
        },
    )?;
    let mut failures = Vec::new();
    let mut in_place = 0;
    for (r, out) in outs.iter().enumerate() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        in_place += stderr.matches("read through descriptors").count();
        // Destroy after a clean run frees the device memory (every rank reaches it).
        let leaked: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("stays allocated"))
            .collect();
        if out.status.success() && !leaked.is_empty() {
            failures.push(format!(
                "rank {r} left device memory allocated at destroy:\n{}",
                leaked.join("\n")
            ));
        } else if !out.status.success() {
            failures.push(rank_failure(r, out));
        } else if r == 0 {
            print!("{}", String::from_utf8_lossy(&out.stdout));
        }
    }
    if failures.is_empty() && memory.registered() && n > 1 {
        // Every rank receives from some peer in these collectives, so every rank must have
        // switched at least one pair to in-place reads.
        if in_place < n {
            failures.push(format!(
                "registered buffers: only {in_place} of {n} ranks read any peer's buffer in place"
            ));
        } else {
            println!("  {in_place} sender->receiver pairs read registered buffers in place");
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

/// `n` thread ranks of one process; rank r on GPU r % `gpus` (1: all on GPU 0, which they share;
/// more: peers on other GPUs, reached through peer access).
/// Thread ranks of one process. `grouped`: the communicators are made as nccl-tests and the
/// benchmarks make them, by one thread inside ncclGroupStart/End, switching the current device
/// before each ncclCommInitRank (each must keep the device current at its call); otherwise
/// with ncclCommInitAll.
fn run_threads(
    n: usize,
    gpus: usize,
    max_bytes: usize,
    memory: Memory,
    grouped: bool,
) -> Result<(), String> {
    let device = Device::get(0).map_err(|e| e.msg)?;
    let _bound = device.bind().map_err(|e| e.msg)?;
    let mut comms = vec![std::ptr::null_mut(); n];
    let devs: Vec<i32> = (0..n).map(|r| (r % gpus.max(1)) as i32).collect();
    if grouped {
        // SAFETY: all-zero bytes are a valid ncclUniqueId to be filled.
        let mut id: ncclUniqueId = unsafe { std::mem::zeroed() };
        nccl!(ncclGetUniqueId(&mut id));
        nccl!(ncclGroupStart());
        for (rank, comm) in comms.iter_mut().enumerate() {
            let d = Device::get(devs[rank]).map_err(|e| e.msg)?;
            let _b = d.bind().map_err(|e| e.msg)?;
            nccl!(ncclCommInitRank(comm, n as i32, id, rank as i32));
        }
        nccl!(ncclGroupEnd());
        for (rank, c) in comms.iter().enumerate() {
            let mut dev = -1;
            nccl!(ncclCommCuDevice(*c, &mut dev));
            if dev != devs[rank] {
                return Err(format!(
                    "rank {rank} was made while GPU {} was current but its communicator is on GPU {dev}",
                    devs[rank]
                ));
            }
        }
    } else {
        nccl!(ncclCommInitAll(comms.as_mut_ptr(), n as i32, devs.as_ptr()));
    }
    let handles: Vec<_> = comms
        .iter()
        .enumerate()
        .map(|(rank, c)| {
            let c = *c as usize;
            let ordinal = devs[rank];
            let shares_gpu = devs.iter().filter(|&&d| d == ordinal).count() > 1;
            // Every rank on a GPU of its own (all of them run the same extra call).
            let own_gpus = n <= gpus && gpus > 1;
            std::thread::spawn(move || -> Result<usize, String> {
                let device = Device::get(ordinal).map_err(|e| e.msg)?;
                let _b = device.bind().map_err(|e| e.msg)?;
                let r = Rank::new(c as ncclComm_t, rank, n, device, max_bytes, memory)?;
                if shares_gpu {
                    r.legacy_stream_refused()?;
                } else if own_gpus {
                    r.legacy_stream_from_bare_thread()?;
                }
                r.matrix(max_bytes, true)
            })
        })
        .collect();
    let mut errors = Vec::new();
    for (r, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => errors.push(format!("thread rank {r}: {e}")),
            Err(_) => errors.push(format!("thread rank {r} panicked")),
        }
    }
    for c in comms {
        // SAFETY: comms came from ncclCommInitAll.
        unsafe { ncclCommDestroy(c) };
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--worker") {
        let get = |i: usize| args.get(i).cloned().unwrap_or_default();
        let (rank, n) = (get(2).parse().unwrap_or(0), get(3).parse().unwrap_or(1));
        let max_bytes = get(5).parse().unwrap_or(256 << 20);
        match worker(
            rank,
            n,
            id_from(&get(4)),
            max_bytes,
            get(6) == "1",
            Memory::parse(&get(7)),
        ) {
            Ok(cases) => {
                println!("  {n} ranks: {cases} cases per rank passed");
                std::process::exit(0)
            }
            Err(e) => {
                println!("FAILED: {e}");
                std::process::exit(1)
            }
        }
    }
    let get = |i: usize| args.get(i).cloned().unwrap_or_default();
    if args.get(1).map(String::as_str) == Some("--fault-worker") {
        let (rank, n) = (get(2).parse().unwrap_or(0), get(3).parse().unwrap_or(1));
        let ids: Vec<ncclUniqueId> = (4..7).map(|i| id_from(&get(i))).collect();
        match fault_worker(rank, n, &ids) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                println!("FAILED: {e}");
                std::process::exit(1)
            }
        }
    }
    if args.get(1).map(String::as_str) == Some("--cost-worker") {
        let (rank, n) = (get(2).parse().unwrap_or(0), get(3).parse().unwrap_or(1));
        match cost_worker(rank, n, id_from(&get(4))) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                println!("FAILED: {e}");
                std::process::exit(1)
            }
        }
    }
    let mut ranks = vec![1usize, 2, 4, 8];
    let mut max_mib = 256usize;
    let mut quick = false;
    let mut mode = "suite";
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--ranks" => {
                ranks = args
                    .get(i + 1)
                    .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
                    .unwrap_or(ranks);
                i += 1;
            }
            "--max-mib" => {
                max_mib = args
                    .get(i + 1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(max_mib);
                i += 1;
            }
            "--quick" => quick = true,
            // Failures on request and counting need the software GPU (softgpu/).
            "--faults" => mode = "faults",
            "--cost" => mode = "cost",
            other => {
                eprintln!("comm-gpu-suite: unknown argument {other}");
                std::process::exit(2);
            }
        }
        i += 1;
    }
    if cuda::device_count() == 0 {
        println!("comm-gpu-suite: no GPU: no CUDA driver, no device, or a build without kernels; nothing was tested");
        std::process::exit(NO_GPU);
    }
    if mode != "suite" {
        let mut failed = false;
        for &n in &ranks {
            let t = Instant::now();
            let r = if mode == "faults" {
                run_faults(n.max(2))
            } else {
                run_cost(n)
            };
            match r {
                Ok(()) => eprintln!(
                    "PASS {mode}, {n} ranks ({:.1} s)",
                    t.elapsed().as_secs_f64()
                ),
                Err(e) => {
                    println!("FAIL {mode}, {n} ranks:\n{e}");
                    failed = true;
                }
            }
        }
        std::process::exit(if failed { 1 } else { 0 });
    }
    let max_bytes = max_mib << 20;
    let mut failed = false;
    let mut report = |what: String, t: Instant, r: Result<(), String>| match r {
        Ok(()) => println!("PASS {what} ({:.1} s)", t.elapsed().as_secs_f64()),
        Err(e) => {
            println!("FAIL {what}:\n{e}");
            failed = true;
        }
    };
    for &n in &ranks {
        let t = Instant::now();
        let r = run_processes(n, max_bytes, quick, Memory::Plain, false);
        report(format!("{n} processes on one GPU"), t, r);
    }
    // Ranks on two simulated hosts: device buffers staged through host memory.
    for n in [2usize, 3] {
        let t = Instant::now();
        let r = run_processes(n, max_bytes.min(16 << 20), true, Memory::Plain, true);
        report(
            format!("{n} processes on one GPU as two hosts (staged through host memory)"),
            t,
            r,
        );
    }
    // Registered buffers, read in place by the peers: VMM memory (file descriptors) and
    // cuMemAlloc memory (IPC handles), odd and even rank counts; the quick matrix.
    for (n, memory) in [
        (2usize, Memory::RegisteredVmm),
        (3, Memory::RegisteredVmm),
        (2, Memory::RegisteredIpc),
        (4, Memory::RegisteredIpc),
    ] {
        let t = Instant::now();
        let r = run_processes(n, max_bytes.min(64 << 20), true, memory, false);
        report(
            format!(
                "{n} processes on one GPU, registered {} buffers",
                memory.name()
            ),
            t,
            r,
        );
    }
    for (n, memory) in [
        (2usize, Memory::Plain),
        (4, Memory::Plain),
        (3, Memory::RegisteredVmm),
    ] {
        let t = Instant::now();
        let r = run_threads(n, 1, max_bytes.min(64 << 20), memory, false);
        report(
            format!(
                "{n} threads (ncclCommInitAll) on one GPU, {} buffers",
                memory.name()
            ),
            t,
            r,
        );
    }
    // Thread ranks on different GPUs (peer access), where there are several.
    let gpus = (cuda::device_count() as usize).min(2);
    if gpus > 1 {
        for (n, memory, grouped) in [
            (2usize, Memory::Plain, false),
            (3, Memory::RegisteredVmm, false),
            (2, Memory::Plain, true),
        ] {
            let t = Instant::now();
            let r = run_threads(n, gpus, max_bytes.min(64 << 20), memory, grouped);
            let how = if grouped {
                "ncclCommInitRank in a group, one thread"
            } else {
                "ncclCommInitAll"
            };
            report(
                format!(
                    "{n} threads ({how}) on {gpus} GPUs, {} buffers",
                    memory.name()
                ),
                t,
                r,
            );
        }
    }
    std::process::exit(if failed { 1 } else { 0 });
}
