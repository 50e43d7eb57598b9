//! A thin layer over the CUDA driver API (cudarc, opened at run time): whether a driver and
//! devices exist, what kind of memory a pointer is, primary contexts, device memory, IPC
//! handles, the embedded kernels, and the stream operations device programs are made of.
//!
//! cudarc panics when it cannot load libcuda; every path here first checks that the library is
//! present, so a process without CUDA simply sees "no devices" and stays on host memory.

pub(crate) mod dmabuf;
pub(crate) mod kernels;
pub(crate) mod share;

use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::sys as cu;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::OnceLock;

/// What this process found when it first looked for CUDA.
struct Driver {
    devices: i32,
}

static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();

fn driver() -> Option<&'static Driver> {
    DRIVER
        .get_or_init(|| {
            if !crate::env::DEVICE.flag() {
                crate::info!("COMM_DEVICE=0: device memory support is off");
                return None;
            }
            if kernels::FATBIN.is_empty() {
                crate::info!(
                    "this build has no device kernels (built without nvcc): host memory only"
                );
                return None;
            }
            // SAFETY: only tries to open the library; nothing is called through it.
            if !unsafe { cu::is_culib_present() } {
                crate::info!("no CUDA driver library found: host memory only");
                return None;
            }
            let found = std::panic::catch_unwind(|| {
                // SAFETY: cuInit has no preconditions; the symbol exists in every driver.
                let r = unsafe { cu::cuInit(0) };
                if r != cu::CUresult::CUDA_SUCCESS {
                    return Err(r);
                }
                let mut n = 0;
                // SAFETY: n is a valid out-pointer.
                let r = unsafe { cu::cuDeviceGetCount(&mut n) };
                if r != cu::CUresult::CUDA_SUCCESS {
                    return Err(r);
                }
                Ok(n)
            });
            match found {
                Ok(Ok(n)) if n > 0 => Some(Driver { devices: n }),
                Ok(Ok(_)) => {
                    crate::info!("the CUDA driver reports no devices: host memory only");
                    None
                }
                Ok(Err(r)) => {
                    crate::info!("CUDA driver initialisation failed ({r:?}): host memory only");
                    None
                }
                Err(_) => {
                    crate::warn!("loading the CUDA driver failed: host memory only");
                    None
                }
            }
        })
        .as_ref()
}

/// How many CUDA devices this process can use (0 without a driver).
pub fn device_count() -> i32 {
    driver().map_or(0, |d| d.devices)
}

/// Turns a driver result into an error that names the call.
pub(crate) fn check(r: cu::CUresult, what: &str) -> Result<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::os::raw::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or fails, leaving it null).
    unsafe { cu::cuGetErrorName(r, &mut name) };
    let name = if name.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    };
    Err(Error::new(
        ErrorKind::UnhandledCuda,
        format!("{what} failed: {name}"),
    ))
}

/// The CUDA device of the calling thread: the current context's, device 0 when the thread has
/// none yet (as cudaGetDevice answers), -1 without devices.
pub(crate) fn current_device() -> i32 {
    if driver().is_none() {
        return -1;
    }
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: ctx is a valid out-pointer.
    if unsafe { cu::cuCtxGetCurrent(&mut ctx) } != cu::CUresult::CUDA_SUCCESS || ctx.is_null() {
        return 0;
    }
    let mut dev: cu::CUdevice = 0;
    // SAFETY: a context is current; dev is a valid out-pointer.
    if unsafe { cu::cuCtxGetDevice(&mut dev) } != cu::CUresult::CUDA_SUCCESS {
        return 0;
    }
    dev
}

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MemKind {
    Host,
    /// Memory of CUDA device `n` (including managed memory).
    Device(i32),
}

/// Whether this process can have device memory at all (a CUDA driver was found and device
/// support is on): when not, every pointer is host memory.
pub(crate) fn any_device_memory() -> bool {
    driver().is_some()
}

/// Classifies a pointer: device memory when the driver says so, host memory otherwise
/// (including every pointer when there is no driver).
pub(crate) fn classify(ptr: *const c_void) -> MemKind {
    if ptr.is_null() || driver().is_none() {
        return MemKind::Host;
    }
    let mut kind: u32 = 0;
    // SAFETY: kind is a 4-byte out-value as the MEMORY_TYPE attribute requires; the driver
    // only inspects the address.
    let r = unsafe {
        cu::cuPointerGetAttribute(
            &mut kind as *mut u32 as *mut c_void,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as cu::CUdeviceptr,
        )
    };
    if r != cu::CUresult::CUDA_SUCCESS || kind != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return MemKind::Host;
    }
    let mut ordinal: i32 = 0;
    // SAFETY: as above, a 4-byte out-value.
    let r = unsafe {
        cu::cuPointerGetAttribute(
            &mut ordinal as *mut i32 as *mut c_void,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr as cu::CUdeviceptr,
        )
    };
    MemKind::Device(if r == cu::CUresult::CUDA_SUCCESS {
        ordinal
    } else {
        0
    })
}

/// Whether kernels on `device` may read device memory at `ptr` through its address in this
/// process: memory of `device` itself, or of another GPU when it is not a VMM mapping (peer
/// access covers cuMemAlloc memory) or the VMM mapping grants `device` access.
pub(crate) fn readable_from(device: &Device, ptr: u64) -> bool {
    match classify(ptr as *const c_void) {
        MemKind::Device(o) if o == device.ordinal => return true,
        MemKind::Device(_) => {}
        MemKind::Host => return false,
    }
    // SAFETY: plain-data struct.
    let mut location: cu::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    location.id = device.ordinal;
    let mut flags: u64 = 0;
    // SAFETY: out-pointer and location are valid; the driver only inspects the address.
    let r = unsafe { cu::cuMemGetAccess(&mut flags, &location, ptr) };
    r != cu::CUresult::CUDA_SUCCESS
        || flags != cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE as u64
}

/// A device's primary context and what the library loaded into it.
pub struct Device {
    pub ordinal: i32,
    ctx: cu::CUcontext,
    module: cu::CUmodule,
    functions: Mutex<HashMap<&'static str, usize>>,
    pub sms: u32,
}

// SAFETY: CUDA contexts and modules may be used from any thread once made current there.
unsafe impl Send for Device {}
// SAFETY: as above; the function cache is behind a mutex.
unsafe impl Sync for Device {}

static DEVICES: Mutex<Vec<Option<Arc<Device>>>> = Mutex::new(Vec::new());

/// Makes a context current on this thread and restores the previous one when dropped.
pub struct Bound {
    previous: cu::CUcontext,
}

impl Drop for Bound {
    fn drop(&mut self) {
        // SAFETY: restoring a context that was current before (possibly none).
        unsafe { cu::cuCtxSetCurrent(self.previous) };
    }
}

impl Device {
    /// The device `ordinal`, its primary context retained and the kernels loaded.
    pub fn get(ordinal: i32) -> Result<Arc<Device>> {
        let d = driver().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidUsage,
                "device memory needs a CUDA driver and a GPU; none is usable here",
            )
        })?;
        if ordinal < 0 || ordinal >= d.devices {
            return crate::invalid_arg!(
                "CUDA device {ordinal} does not exist ({} devices)",
                d.devices
            );
        }
        let mut all = DEVICES.lock();
        if all.len() < d.devices as usize {
            all.resize(d.devices as usize, None);
        }
        if let Some(dev) = &all[ordinal as usize] {
            return Ok(dev.clone());
        }
        let mut handle: cu::CUdevice = 0;
        check(
            // SAFETY: ordinal is in range; handle is a valid out-pointer.
            unsafe { cu::cuDeviceGet(&mut handle, ordinal) },
            "cuDeviceGet",
        )?;
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: retains the device's primary context (shared with the CUDA runtime).
            unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, handle) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let mut sms = 0;
        check(
            // SAFETY: sms is a valid out-pointer.
            unsafe {
                cu::cuDeviceGetAttribute(
                    &mut sms,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    handle,
                )
            },
            "cuDeviceGetAttribute",
        )?;
        let mut previous: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: previous is a valid out-pointer; ctx was just retained.
        unsafe { cu::cuCtxGetCurrent(&mut previous) };
        let _bound = Bound { previous };
        // SAFETY: as above.
        check(unsafe { cu::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
        let mut module: cu::CUmodule = std::ptr::null_mut();
        check(
            // SAFETY: FATBIN is a complete fatbin image embedded at build time.
            unsafe { cu::cuModuleLoadData(&mut module, kernels::FATBIN.as_ptr() as *const c_void) },
            "cuModuleLoadData (comm's kernels)",
        )?;
        // Every kernel is resolved now: with lazy loading (CUDA's default) a kernel is loaded
        // at its first lookup, which may wait for the context to go idle, and by then another
        // rank's program in this process may hold a stream waiting for this rank.
        let mut functions = HashMap::new();
        for name in kernels::reduce_kernel_names().chain([kernels::FILL_U32]) {
            functions.insert(name, load_function(module, name)? as usize);
        }
        let dev = Arc::new(Device {
            ordinal,
            ctx,
            module,
            functions: Mutex::new(functions),
            sms: sms.max(1) as u32,
        });
        all[ordinal as usize] = Some(dev.clone());
        Ok(dev)
    }

    /// Makes this device's context current until the guard drops.
    pub fn bind(&self) -> Result<Bound> {
        let mut previous: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: previous is a valid out-pointer.
        unsafe { cu::cuCtxGetCurrent(&mut previous) };
        // SAFETY: the primary context stays retained for the life of the process.
        check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")?;
        Ok(Bound { previous })
    }

    fn function(&self, name: &'static str) -> Result<cu::CUfunction> {
        let mut fns = self.functions.lock();
        if let Some(f) = fns.get(name) {
            return Ok(*f as cu::CUfunction);
        }
        let f = load_function(self.module, name)?;
        fns.insert(name, f as usize);
        Ok(f)
    }
}

/// Looks kernel `name` up in `module` (which loads it, under lazy loading).
fn load_function(module: cu::CUmodule, name: &'static str) -> Result<cu::CUfunction> {
    let cname = std::ffi::CString::new(name).expect("kernel names have no NUL");
    let mut f: cu::CUfunction = std::ptr::null_mut();
    check(
        // SAFETY: module is loaded; f is a valid out-pointer.
        unsafe { cu::cuModuleGetFunction(&mut f, module, cname.as_ptr()) },
        &format!("cuModuleGetFunction({name})"),
    )?;
    Ok(f)
}

/// Device memory from cuMemAlloc, freed on drop. Used with this device's context bound.
pub struct DeviceMem {
    pub ptr: u64,
    pub len: usize,
    device: Arc<Device>,
}

impl DeviceMem {
    pub fn new(device: &Arc<Device>, len: usize) -> Result<DeviceMem> {
        let _b = device.bind()?;
        let mut ptr: cu::CUdeviceptr = 0;
        check(
            // SAFETY: ptr is a valid out-pointer; the context is current.
            unsafe { cu::cuMemAlloc_v2(&mut ptr, len.max(1)) },
            &format!("cuMemAlloc({len} bytes)"),
        )?;
        Ok(DeviceMem {
            ptr,
            len,
            device: device.clone(),
        })
    }

    /// Sets `count` 32-bit words at byte `offset` to `value`, ordered on `stream`. (Not the
    /// synchronous cuMemsetD32: on device memory it returns before it is done, and it runs on the
    /// legacy stream, behind whatever the application queued there.)
    pub fn fill_u32(&self, stream: Stream, offset: usize, value: u32, count: usize) -> Result<()> {
        let _b = self.device.bind()?;
        // SAFETY: the range lies inside the allocation (callers' layout).
        check(
            unsafe { cu::cuMemsetD32Async(self.ptr + offset as u64, value, count, stream.raw()) },
            "cuMemsetD32Async",
        )
    }

    /// The IPC handle other processes open to map this allocation.
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        let _b = self.device.bind()?;
        // SAFETY: CUipcMemHandle is 64 plain bytes.
        let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: ptr is the base of an allocation made by cuMemAlloc.
            unsafe { cu::cuIpcGetMemHandle(&mut h, self.ptr) },
            "cuIpcGetMemHandle",
        )?;
        let mut out = [0u8; 64];
        for (o, b) in out.iter_mut().zip(h.reserved.iter()) {
            *o = *b as u8;
        }
        Ok(out)
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if let Ok(_b) = self.device.bind() {
            // SAFETY: ptr came from cuMemAlloc and is freed once.
            unsafe { cu::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Another process's allocation mapped into this one through its IPC handle.
pub(crate) struct PeerMem {
    pub ptr: u64,
    device: Arc<Device>,
}

impl PeerMem {
    pub(crate) fn open(device: &Arc<Device>, handle: &[u8; 64]) -> Result<PeerMem> {
        let _b = device.bind()?;
        // SAFETY: CUipcMemHandle is 64 plain bytes.
        let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, b) in h.reserved.iter_mut().zip(handle.iter()) {
            *d = *b as _;
        }
        let mut ptr: cu::CUdeviceptr = 0;
        check(
            // SAFETY: h is a handle another process exported; ptr is a valid out-pointer.
            unsafe {
                cu::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(PeerMem {
            ptr,
            device: device.clone(),
        })
    }
}

impl Drop for PeerMem {
    fn drop(&mut self) {
        if let Ok(_b) = self.device.bind() {
            // SAFETY: ptr came from cuIpcOpenMemHandle and is closed once.
            unsafe { cu::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Lets `device`'s context reach memory of `peer` (ranks that are threads of one process on
/// different GPUs). Already enabled is fine.
pub(crate) fn enable_peer_access(device: &Arc<Device>, peer: &Arc<Device>) -> Result<()> {
    if device.ordinal == peer.ordinal {
        return Ok(());
    }
    let _b = device.bind()?;
    // SAFETY: both contexts are retained primary contexts.
    let r = unsafe { cu::cuCtxEnablePeerAccess(peer.ctx, 0) };
    if r == cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check(r, "cuCtxEnablePeerAccess")
}

/// `CU_STREAM_LEGACY`: the legacy default stream named explicitly (as null names it).
pub(crate) const STREAM_LEGACY: usize = 0x1;

/// A CUDA stream as the C API hands it over (`cudaStream_t` and `CUstream` are the same
/// handle; null is the legacy default stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream(pub *mut c_void);

// SAFETY: a stream handle is a plain identifier CUDA accepts from any thread.
unsafe impl Send for Stream {}

impl Stream {
    fn raw(self) -> cu::CUstream {
        self.0 as cu::CUstream
    }

    /// Copies `len` bytes between device addresses (this device's or mapped peers').
    pub fn copy(self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: both ranges are device memory the caller resolved; the copy is stream-ordered.
        check(
            unsafe { cu::cuMemcpyAsync(dst, src, len, self.raw()) },
            "cuMemcpyAsync",
        )
    }

    /// Stores `value` at `addr` once everything before it on the stream is done and visible.
    pub fn set_flag(self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: addr is a 4-byte flag in device memory (local or mapped peer).
        check(
            unsafe { cu::cuStreamWriteValue32_v2(self.raw(), addr, value, 0) },
            "cuStreamWriteValue32",
        )
    }

    /// Stores a 64-bit `value` at `addr` once everything before it on the stream is done and
    /// visible (a message descriptor; the flag raised after it orders it for the reader).
    pub fn set_u64(self, addr: u64, value: u64) -> Result<()> {
        // SAFETY: addr is an 8-byte aligned cell in device memory (local or mapped peer).
        check(
            unsafe { cu::cuStreamWriteValue64_v2(self.raw(), addr, value, 0) },
            "cuStreamWriteValue64",
        )
    }

    /// Holds the stream until the flag at `addr` equals `value`.
    pub fn wait_flag(self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: addr is a 4-byte flag in this device's memory.
        check(
            unsafe {
                cu::cuStreamWaitValue32_v2(
                    self.raw(),
                    addr,
                    value,
                    cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
                )
            },
            "cuStreamWaitValue32",
        )
    }

    /// Launches `comm_reduce_<dtype>_<op>` with `args`.
    pub fn reduce(
        self,
        device: &Device,
        name: &'static str,
        dtype: crate::reduce::DataType,
        args: &kernels::ReduceArgs,
    ) -> Result<()> {
        let f = device.function(name)?;
        let grid = kernels::launch_grid(dtype, args.count, device.sms);
        let mut params = [args as *const kernels::ReduceArgs as *mut c_void];
        // SAFETY: the kernel takes exactly one ReduceArgs by value; params points at it for the
        // duration of the call (the driver copies kernel arguments at launch).
        check(
            unsafe {
                cu::cuLaunchKernel(
                    f,
                    grid,
                    1,
                    1,
                    kernels::BLOCK_THREADS,
                    1,
                    1,
                    0,
                    self.raw(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            &format!("cuLaunchKernel({name})"),
        )
    }

    /// A new non-blocking stream on `device` (tests and benchmarks); destroy it with
    /// [`Stream::destroy`].
    pub fn create(device: &Device) -> Result<Stream> {
        let _b = device.bind()?;
        let mut raw: cu::CUstream = std::ptr::null_mut();
        check(
            // SAFETY: raw is a valid out-pointer; the context is current.
            unsafe {
                cu::cuStreamCreate(&mut raw, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            },
            "cuStreamCreate",
        )?;
        Ok(Stream(raw as *mut c_void))
    }

    /// Destroys a stream made by [`Stream::create`] (its pending work still completes).
    pub fn destroy(self) -> Result<()> {
        // SAFETY: the stream came from cuStreamCreate and is destroyed once.
        check(
            unsafe { cu::cuStreamDestroy_v2(self.raw()) },
            "cuStreamDestroy",
        )
    }

    /// Waits on the host until everything on the stream is done.
    pub fn synchronize(self) -> Result<()> {
        // SAFETY: the handle is valid (or null, the default stream).
        check(
            unsafe { cu::cuStreamSynchronize(self.raw()) },
            "cuStreamSynchronize",
        )
    }

    /// Whether the stream is being captured into a CUDA graph.
    pub fn capturing(self) -> bool {
        let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: status is a valid out-pointer.
        let r = unsafe { cu::cuStreamIsCapturing(self.raw(), &mut status) };
        r == cu::CUresult::CUDA_SUCCESS
            && status == cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
    }
}

/// Copies `len` bytes between any two addresses the driver knows (host, this device, a
/// mapped peer), and returns once the bytes are in place.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes (host memory, or device memory
/// the driver can reach from `device`'s context), and nothing else may write `dst` during the
/// copy. The driver tells the kinds apart by unified addressing; it checks neither range.
pub(crate) unsafe fn copy_sync(device: &Device, dst: u64, src: u64, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let _b = device.bind()?;
    // SAFETY: this function's contract: both ranges are valid for `len` bytes.
    check(unsafe { cu::cuMemcpy(dst, src, len) }, "cuMemcpy")?;
    landed()
}

/// Waits for the copies a "synchronous" copy call may leave in flight. CUDA's API
/// synchronization rules let cuMemcpy/cuMemcpyHtoD return before the bytes land when the source
/// is pageable host memory (once it is staged) or device memory (no host synchronisation at
/// all); the transfer is ordered on the legacy stream, which work on the caller's non-blocking
/// streams, other processes and the host do not wait for. Synchronising the legacy stream
/// finishes it. Only the context bound by the caller is concerned.
fn landed() -> Result<()> {
    // SAFETY: null is the legacy stream of the current context, which the caller bound.
    check(
        unsafe { cu::cuStreamSynchronize(std::ptr::null_mut()) },
        "cuStreamSynchronize (after a synchronous copy)",
    )
}

/// Waits until every operation on `device` is done.
pub(crate) fn synchronize(device: &Device) -> Result<()> {
    let _b = device.bind()?;
    // SAFETY: a context is bound.
    check(unsafe { cu::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// Runs a host function queued with [`Stream::host_fn`], once.
unsafe extern "C" fn run_host_fn(data: *mut c_void) {
    // SAFETY: `data` is the box host_fn leaked for exactly this one call.
    let f = unsafe { Box::from_raw(data as *mut Box<dyn FnOnce() + Send>) };
    // A panic must not unwind into the driver.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

impl Stream {
    /// Runs `f` on a driver thread once everything queued on the stream before it is done.
    /// `f` must not call CUDA.
    pub fn host_fn(self, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        let data = Box::into_raw(Box::new(f));
        // SAFETY: run_host_fn takes back the box exactly once, when the driver runs it.
        let r = unsafe { cu::cuLaunchHostFunc(self.raw(), Some(run_host_fn), data as *mut c_void) };
        if r != cu::CUresult::CUDA_SUCCESS {
            // SAFETY: the driver refused it, so it will never run: the box is still ours.
            drop(unsafe { Box::from_raw(data) });
        }
        check(r, "cuLaunchHostFunc")
    }
}

/// Copies host bytes to device memory; the bytes are in place when it returns, for work on any
/// stream (for tests, setup, and results staged back to the device).
///
/// # Safety
/// `dst` must be device memory reachable from `device`'s context, writable for `src.len()`
/// bytes, that no other work writes or reads during the copy; the driver does not check it.
pub unsafe fn copy_to_device(device: &Device, dst: u64, src: &[u8]) -> Result<()> {
    let _b = device.bind()?;
    check(
        // SAFETY: this function's contract: `dst` covers `src.len()` bytes of device memory.
        unsafe { cu::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len()) },
        "cuMemcpyHtoD",
    )?;
    landed()
}

/// Copies device memory to host bytes (synchronously; for tests and setup).
///
/// # Safety
/// `src` must be device memory reachable from `device`'s context, readable for `dst.len()`
/// bytes; the driver does not check it.
pub unsafe fn copy_from_device(device: &Device, dst: &mut [u8], src: u64) -> Result<()> {
    let _b = device.bind()?;
    // SAFETY: this function's contract: `src` covers `dst.len()` bytes of device memory.
    check(
        unsafe { cu::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len()) },
        "cuMemcpyDtoH",
    )
}

/// Allocations made by `vmm_alloc`: address -> (handle, size), to unmap them again.
static VMM: Mutex<Vec<(u64, u64, usize, i32)>> = Mutex::new(Vec::new());

/// ncclMemAlloc: device memory from the virtual memory management API (cuMemCreate), on the
/// calling thread's device, shareable through POSIX file descriptors, rounded up to the
/// recommended granularity.
pub(crate) fn vmm_alloc(size: usize) -> Result<u64> {
    let ordinal = current_device();
    if ordinal < 0 {
        return crate::invalid_usage!(
            "ncclMemAlloc allocates CUDA memory, and no usable GPU was found"
        );
    }
    let device = Device::get(ordinal)?;
    let _b = device.bind()?;
    // SAFETY: plain-data structs; zero is a valid start for every field.
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    let mut gran = 0usize;
    check(
        // SAFETY: prop is initialised; gran is a valid out-pointer.
        unsafe {
            cu::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        },
        "cuMemGetAllocationGranularity",
    )?;
    let size = crate::units::whole_units(size, gran)?;
    let mut handle: cu::CUmemGenericAllocationHandle = 0;
    check(
        // SAFETY: prop is initialised; handle is a valid out-pointer.
        unsafe { cu::cuMemCreate(&mut handle, size, &prop, 0) },
        &format!("cuMemCreate({size} bytes)"),
    )?;
    // Like cuMemAlloc memory under peer access, readable by every GPU that can reach this one
    // (ranks that are threads on other GPUs read registered buffers in place).
    let mut access = vec![ordinal];
    access.extend(
        (0..device_count()).filter(|&other| other != ordinal && can_access_peer(other, ordinal)),
    );
    let ptr = map_allocation(handle, size, gran, &access)?;
    VMM.lock().push((ptr, handle, size, ordinal));
    Ok(ptr)
}

/// Whether device `from` can map memory of device `to` (false where anything fails).
fn can_access_peer(from: i32, to: i32) -> bool {
    let (mut a, mut b): (cu::CUdevice, cu::CUdevice) = (0, 0);
    let mut can = 0;
    // SAFETY: out-pointers are valid; ordinals come from device_count().
    unsafe {
        cu::cuDeviceGet(&mut a, from) == cu::CUresult::CUDA_SUCCESS
            && cu::cuDeviceGet(&mut b, to) == cu::CUresult::CUDA_SUCCESS
            && cu::cuDeviceCanAccessPeer(&mut can, a, b) == cu::CUresult::CUDA_SUCCESS
            && can == 1
    }
}

/// Maps all `size` bytes of VMM allocation `handle` at a fresh address, readable and writable
/// by each device of `ordinals`. On failure everything is undone and the handle released.
fn map_allocation(
    handle: cu::CUmemGenericAllocationHandle,
    size: usize,
    align: usize,
    ordinals: &[i32],
) -> Result<u64> {
    let mut ptr: cu::CUdeviceptr = 0;
    // SAFETY: reserves a fresh address range of `size` bytes.
    let r = unsafe { cu::cuMemAddressReserve(&mut ptr, size, align, 0, 0) };
    if let Err(e) = check(r, "cuMemAddressReserve") {
        // SAFETY: the handle is valid and not mapped.
        unsafe { cu::cuMemRelease(handle) };
        return Err(e);
    }
    // SAFETY: maps the whole allocation at the reserved address.
    let mapped =
        check(unsafe { cu::cuMemMap(ptr, size, 0, handle, 0) }, "cuMemMap").and_then(|_| {
            let access: Vec<cu::CUmemAccessDesc> = ordinals
                .iter()
                .map(|&ordinal| {
                    // SAFETY: plain-data struct.
                    let mut a: cu::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                    a.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                    a.location.id = ordinal;
                    a.flags = cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                    a
                })
                .collect();
            // SAFETY: [ptr, ptr+size) is mapped; `access` holds that many descriptors.
            check(
                unsafe { cu::cuMemSetAccess(ptr, size, access.as_ptr(), access.len()) },
                "cuMemSetAccess",
            )
        });
    if let Err(e) = mapped {
        // SAFETY: undoing what was done above, in reverse.
        unsafe {
            cu::cuMemUnmap(ptr, size);
            cu::cuMemAddressFree(ptr, size);
            cu::cuMemRelease(handle);
        }
        return Err(e);
    }
    Ok(ptr)
}

/// ncclMemFree of memory from `vmm_alloc`.
pub(crate) fn vmm_free(ptr: u64) -> Result<()> {
    let entry = {
        let mut all = VMM.lock();
        match all.iter().position(|e| e.0 == ptr) {
            Some(i) => all.swap_remove(i),
            None => {
                return crate::invalid_arg!(
                    "{ptr:#x} was not allocated by ncclMemAlloc (or was freed already)"
                )
            }
        }
    };
    let (ptr, handle, size, ordinal) = entry;
    let device = Device::get(ordinal)?;
    let _b = device.bind()?;
    // SAFETY: the mapping, reservation and handle were made by vmm_alloc and are released once.
    unsafe {
        check(cu::cuMemUnmap(ptr, size), "cuMemUnmap")?;
        check(cu::cuMemAddressFree(ptr, size), "cuMemAddressFree")?;
        check(cu::cuMemRelease(handle), "cuMemRelease")
    }
}

/// Work captured from a stream into an instantiated CUDA graph (the device tests capture
/// collectives and replay them).
pub struct Graph {
    graph: cu::CUgraph,
    exec: cu::CUgraphExec,
    device: Arc<Device>,
}

impl Graph {
    /// Starts capturing what this thread enqueues on `stream`.
    pub fn begin_capture(device: &Device, stream: Stream) -> Result<()> {
        let _b = device.bind()?;
        // SAFETY: the stream is valid; thread-local mode keeps other threads' calls legal.
        check(
            unsafe {
                cu::cuStreamBeginCapture_v2(
                    stream.raw(),
                    cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            },
            "cuStreamBeginCapture",
        )
    }

    /// Ends the capture on `stream` and instantiates what it recorded.
    pub fn end_capture(device: &Arc<Device>, stream: Stream) -> Result<Graph> {
        let _b = device.bind()?;
        let mut graph: cu::CUgraph = std::ptr::null_mut();
        check(
            // SAFETY: the stream is capturing (begin_capture); graph is a valid out-pointer.
            unsafe { cu::cuStreamEndCapture(stream.raw(), &mut graph) },
            "cuStreamEndCapture",
        )?;
        let mut exec: cu::CUgraphExec = std::ptr::null_mut();
        if let Err(e) = check(
            // SAFETY: graph was just captured; exec is a valid out-pointer.
            unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            "cuGraphInstantiate",
        ) {
            // SAFETY: the graph is ours and not instantiated.
            unsafe { cu::cuGraphDestroy(graph) };
            return Err(e);
        }
        Ok(Graph {
            graph,
            exec,
            device: device.clone(),
        })
    }

    /// Enqueues one replay on `stream`.
    pub fn launch(&self, stream: Stream) -> Result<()> {
        // SAFETY: exec is an instantiated graph of this device; the stream is valid.
        check(
            unsafe { cu::cuGraphLaunch(self.exec, stream.raw()) },
            "cuGraphLaunch",
        )
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Ok(_b) = self.device.bind() {
            // SAFETY: made by end_capture, destroyed once.
            unsafe {
                cu::cuGraphExecDestroy(self.exec);
                cu::cuGraphDestroy(self.graph);
            }
        }
    }
}

/// Lets this thread make calls that stream capture in global mode would refuse (allocating
/// scratch, mapping a peer's newly registered buffer, querying events) until dropped, as NCCL
/// does while it enqueues: an application capturing on some stream must not have its capture
/// invalidated by the library's own bookkeeping. Nothing of it is captured either way.
pub(crate) struct RelaxedCapture {
    /// The mode to put back (None when the exchange failed and nothing changed).
    previous: Option<cu::CUstreamCaptureMode>,
}

impl RelaxedCapture {
    pub(crate) fn enter() -> RelaxedCapture {
        let mut mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: mode is a valid in/out value; the call only changes this thread's mode.
        let r = unsafe { cu::cuThreadExchangeStreamCaptureMode(&mut mode) };
        if r != cu::CUresult::CUDA_SUCCESS {
            crate::warn!("cuThreadExchangeStreamCaptureMode failed ({r:?})");
            return RelaxedCapture { previous: None };
        }
        RelaxedCapture {
            previous: Some(mode),
        }
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.previous {
            // SAFETY: as in enter().
            unsafe { cu::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// A CUDA event used to order a communicator's work across streams.
pub struct Event {
    raw: cu::CUevent,
    device: Arc<Device>,
}

// SAFETY: events may be recorded and waited on from any thread.
unsafe impl Send for Event {}

impl Event {
    pub fn new(device: &Arc<Device>) -> Result<Event> {
        let _b = device.bind()?;
        let mut raw: cu::CUevent = std::ptr::null_mut();
        check(
            // SAFETY: raw is a valid out-pointer; timing is not needed.
            unsafe {
                cu::cuEventCreate(&mut raw, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
        )?;
        Ok(Event {
            raw,
            device: device.clone(),
        })
    }

    pub fn record(&self, stream: Stream) -> Result<()> {
        // SAFETY: both handles are valid.
        check(
            unsafe { cu::cuEventRecord(self.raw, stream.raw()) },
            "cuEventRecord",
        )
    }

    /// Whether the work recorded in this event is known to be done. An error answers no: it
    /// may only mean the query was refused (another thread capturing in global mode), and
    /// what the work reads must then stay mapped.
    pub(crate) fn done(&self) -> bool {
        // SAFETY: the event is valid.
        let r = unsafe { cu::cuEventQuery(self.raw) };
        r == cu::CUresult::CUDA_SUCCESS
    }

    /// Waits on the host, polling, for the work recorded in this event: true once it is done,
    /// false at `deadline` (or on an error, when nothing says it is done).
    pub(crate) fn wait_until(&self, deadline: std::time::Instant) -> bool {
        loop {
            // SAFETY: the event is valid.
            match unsafe { cu::cuEventQuery(self.raw) } {
                cu::CUresult::CUDA_SUCCESS => return true,
                cu::CUresult::CUDA_ERROR_NOT_READY if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_micros(200))
                }
                _ => return false,
            }
        }
    }

    /// Makes `stream` wait for the work recorded in this event.
    pub fn wait_on(&self, stream: Stream) -> Result<()> {
        // SAFETY: both handles are valid.
        check(
            unsafe { cu::cuStreamWaitEvent(stream.raw(), self.raw, 0) },
            "cuStreamWaitEvent",
        )
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_b) = self.device.bind() {
            // SAFETY: the event was created by cuEventCreate and is destroyed once.
            unsafe { cu::cuEventDestroy_v2(self.raw) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_everything_is_host_memory() {
        // This machine (and CI) has no GPU: the queries must answer so, without panicking.
        if device_count() == 0 {
            let x = 5u32;
            assert_eq!(classify(&x as *const u32 as *const c_void), MemKind::Host);
            assert_eq!(current_device(), -1);
            assert!(Device::get(0).is_err());
        }
        assert_eq!(classify(std::ptr::null()), MemKind::Host);
    }

    /// What a synchronous copy to the device wrote is there for work on a non-blocking stream
    /// queued right after it. CUDA lets cuMemcpyHtoD (pageable source) and device-to-device
    /// cuMemcpy return before the bytes land; the software GPU's adversarial mode
    /// (`SOFTGPU_ADVERSARIAL=1 scripts/softgpu.sh cargo test --release --lib cuda::`) makes them
    /// land late, and this failed before the copies waited for the legacy stream. Without a
    /// device it checks nothing.
    #[test]
    fn synchronous_copies_have_landed_for_other_streams() {
        if device_count() == 0 {
            return;
        }
        let dev = Device::get(0).expect("device 0");
        let len = 4096;
        let a = DeviceMem::new(&dev, len).expect("alloc");
        let b = DeviceMem::new(&dev, len).expect("alloc");
        let c = DeviceMem::new(&dev, len).expect("alloc");
        let stream = Stream::create(&dev).expect("stream");
        for round in 1..=10u8 {
            let host = vec![round; len];
            // SAFETY: `a` and `b` are allocations of `len` bytes on `dev`, used by nothing else.
            unsafe { copy_to_device(&dev, a.ptr, &host) }.expect("host to device");
            // SAFETY: as above.
            unsafe { copy_sync(&dev, b.ptr, a.ptr, len) }.expect("device to device");
            {
                let _bound = dev.bind().expect("bind");
                stream.copy(c.ptr, b.ptr, len).expect("copy on the stream");
                stream.synchronize().expect("synchronize");
            }
            let mut out = vec![0u8; len];
            // SAFETY: `c` is an allocation of `len` bytes on `dev`; the stream is done with it.
            unsafe { copy_from_device(&dev, &mut out, c.ptr) }.expect("device to host");
            assert!(
                out.iter().all(|&x| x == round),
                "round {round}: stale bytes"
            );
        }
        stream.destroy().expect("destroy");
    }
}
