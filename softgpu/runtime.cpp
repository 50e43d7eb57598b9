// softgpu's CUDA runtime: a small libcudart.so.13 over the stand-in driver.
//
// Every function here is a thin layer over the driver entry points of the same process
// (libcuda.so.1, which is softgpu's driver when run through scripts/softgpu.sh), so the runtime
// and the driver share one set of devices, primary contexts, streams, events and allocations,
// as NVIDIA's runtime and driver do. It covers what bench/cudart.c and small test programs use;
// anything else is simply not exported, so a program that needs it fails at dlsym or at link time
// with the missing name instead of running on a pretence.
//
// Runtime semantics kept:
//  * The device is per thread (0 until cudaSetDevice). The first call that needs a context makes
//    the device's primary context current on the calling thread, unless a context is current
//    already (made current through the driver API), which the runtime then uses, as CUDA's does.
//    cudaSetDevice makes the primary context current at once (CUDA 12 and later).
//  * Errors: every call returns its own result and records a failure as the thread's last error;
//    cudaGetLastError returns it and resets it, cudaPeekAtLastError does not. Errors that leave
//    the context unusable (illegal address, launch failure, ...) are sticky: once one is seen,
//    every later call of the process returns it and cudaGetLastError does not clear it.
//  * Streams and events are the driver's (cudaStream_t and CUstream are one type); stream 0 is
//    the legacy default stream. Events are created without timing whatever the flags say (the
//    driver models ordering, not time): cudaEventElapsedTime says so and fails.
//  * cudaMemcpy with an explicit kind refuses a kind that contradicts the pointers (CUDA with
//    unified addressing may accept some): a direction mistake shows here rather than on a GPU.
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <mutex>
#include <sys/syscall.h>
#include <unistd.h>

#define SOFTGPU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

thread_local int t_device = 0;
thread_local cudaError_t t_last = cudaSuccess;
std::atomic<int> g_sticky{cudaSuccess};

std::mutex g_init_m;
bool g_init_done = false;
cudaError_t g_init_result = cudaSuccess;
int g_count = 0;
CUcontext g_primary[64] = {}; // retained primary contexts, by ordinal

void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void say(const char *fmt, ...) {
  char buf[512];
  int n = snprintf(buf, sizeof buf, "softgpu-cudart[%d:%ld] ", (int)getpid(), (long)syscall(SYS_gettid));
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + n, sizeof buf - n, fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s\n", buf);
}

bool is_sticky(cudaError_t e) {
  switch (e) {
  case cudaErrorIllegalAddress:
  case cudaErrorLaunchFailure:
  case cudaErrorHardwareStackError:
  case cudaErrorIllegalInstruction:
  case cudaErrorMisalignedAddress:
  case cudaErrorInvalidAddressSpace:
  case cudaErrorInvalidPc:
  case cudaErrorLaunchTimeout:
  case cudaErrorECCUncorrectable:
    return true;
  default:
    return false;
  }
}

// The runtime's code for a driver result. Most codes are numerically equal by NVIDIA's design;
// the few that differ are named, and anything unknown is cudaErrorUnknown.
cudaError_t from_driver(CUresult r) {
  switch (r) {
  case CUDA_SUCCESS:
    return cudaSuccess;
  case CUDA_ERROR_NOT_INITIALIZED:
    return cudaErrorInitializationError;
  case CUDA_ERROR_DEINITIALIZED:
    return cudaErrorCudartUnloading;
  case CUDA_ERROR_INVALID_CONTEXT:
    return cudaErrorDeviceUninitialized;
  case CUDA_ERROR_INVALID_HANDLE:
    return cudaErrorInvalidResourceHandle;
  case CUDA_ERROR_INVALID_VALUE:
  case CUDA_ERROR_OUT_OF_MEMORY:
  case CUDA_ERROR_NO_DEVICE:
  case CUDA_ERROR_INVALID_DEVICE:
  case CUDA_ERROR_INVALID_IMAGE:
  case CUDA_ERROR_ALREADY_MAPPED:
  case CUDA_ERROR_NOT_MAPPED:
  case CUDA_ERROR_NOT_FOUND:
  case CUDA_ERROR_NOT_READY:
  case CUDA_ERROR_ILLEGAL_ADDRESS:
  case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
  case CUDA_ERROR_LAUNCH_FAILED:
  case CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
  case CUDA_ERROR_PEER_ACCESS_NOT_ENABLED:
  case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
  case CUDA_ERROR_NOT_PERMITTED:
  case CUDA_ERROR_NOT_SUPPORTED:
  case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
  case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
  case CUDA_ERROR_STREAM_CAPTURE_MERGE:
  case CUDA_ERROR_STREAM_CAPTURE_UNMATCHED:
  case CUDA_ERROR_STREAM_CAPTURE_UNJOINED:
  case CUDA_ERROR_STREAM_CAPTURE_ISOLATION:
  case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
  case CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
  case CUDA_ERROR_CAPTURED_EVENT:
    return (cudaError_t)(int)r;
  default:
    return cudaErrorUnknown;
  }
}

// The end of every call: a sticky error of the process wins; a failure becomes the thread's
// last error; a sticky failure becomes the process's.
cudaError_t done(cudaError_t e) {
  if (e != cudaSuccess) {
    if (is_sticky(e)) {
      int expected = cudaSuccess;
      g_sticky.compare_exchange_strong(expected, e);
    }
    t_last = e;
  }
  return e;
}
cudaError_t done(CUresult r) { return done(from_driver(r)); }

#define RT_STICKY()                                                                                \
  do {                                                                                             \
    int s_ = g_sticky.load(std::memory_order_relaxed);                                             \
    if (s_ != cudaSuccess) return done((cudaError_t)s_);                                           \
  } while (0)
#define RT_TRY(expr)                                                                               \
  do {                                                                                             \
    cudaError_t e_ = (expr);                                                                       \
    if (e_ != cudaSuccess) return done(e_);                                                        \
  } while (0)
#define RT_DRV(expr)                                                                               \
  do {                                                                                             \
    CUresult r_ = (expr);                                                                          \
    if (r_ != CUDA_SUCCESS) return done(r_);                                                       \
  } while (0)

// cuInit once per process; remembers the device count.
cudaError_t init() {
  std::lock_guard<std::mutex> l(g_init_m);
  if (!g_init_done) {
    g_init_done = true;
    CUresult r = cuInit(0);
    if (r == CUDA_SUCCESS) r = cuDeviceGetCount(&g_count);
    if (r == CUDA_SUCCESS && g_count > (int)(sizeof g_primary / sizeof g_primary[0]))
      g_count = (int)(sizeof g_primary / sizeof g_primary[0]);
    if (r != CUDA_SUCCESS) g_count = 0;
    g_init_result = r == CUDA_SUCCESS ? (g_count ? cudaSuccess : cudaErrorNoDevice)
                                      : (r == CUDA_ERROR_NO_DEVICE ? cudaErrorNoDevice
                                                                   : cudaErrorInitializationError);
  }
  return g_init_result;
}

// The primary context of `dev`, retained once for the life of the process (as cudart keeps it
// until cudaDeviceReset, which is not provided).
cudaError_t primary(int dev, CUcontext *out) {
  RT_TRY(init());
  if (dev < 0 || dev >= g_count) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> l(g_init_m);
  if (!g_primary[dev]) {
    CUresult r = cuDevicePrimaryCtxRetain(&g_primary[dev], dev);
    if (r != CUDA_SUCCESS) return from_driver(r);
  }
  *out = g_primary[dev];
  return cudaSuccess;
}

// Makes sure a context is current on this thread: the one already current (set through the
// driver API or by an earlier runtime call), else the primary context of the thread's device.
cudaError_t need_context() {
  RT_TRY(init());
  CUcontext cur = nullptr;
  CUresult r = cuCtxGetCurrent(&cur);
  if (r != CUDA_SUCCESS) return from_driver(r);
  if (cur) {
    CUdevice d;
    if (cuCtxGetDevice(&d) == CUDA_SUCCESS) t_device = d;
    return cudaSuccess;
  }
  CUcontext ctx;
  RT_TRY(primary(t_device, &ctx));
  return from_driver(cuCtxSetCurrent(ctx));
}

bool is_device(const void *p) {
  unsigned type = 0;
  return p && cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)p) ==
                  CUDA_SUCCESS &&
         type == CU_MEMORYTYPE_DEVICE;
}

// A copy's kind against its pointers; cudaMemcpyDefault lets the pointers decide.
cudaError_t check_kind(void *dst, const void *src, cudaMemcpyKind kind) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return cudaErrorInvalidMemcpyDirection;
  if (kind == cudaMemcpyDefault) return cudaSuccess;
  bool want_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  bool want_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  if (is_device(src) != want_src || is_device(dst) != want_dst) {
    say("cudaMemcpy kind %d contradicts the pointers (dst %p is %s, src %p is %s)", (int)kind, dst,
        is_device(dst) ? "device" : "host", src, is_device(src) ? "device" : "host");
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

struct ErrorText {
  cudaError_t code;
  const char *name;
  const char *text;
};

const ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorCudartUnloading, "cudaErrorCudartUnloading", "driver shutting down"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorDeviceUninitialized, "cudaErrorDeviceUninitialized", "invalid device context"},
    {cudaErrorInvalidKernelImage, "cudaErrorInvalidKernelImage", "device kernel image is invalid"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources",
     "too many resources requested for launch"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorPeerAccessAlreadyEnabled, "cudaErrorPeerAccessAlreadyEnabled",
     "peer access is already enabled"},
    {cudaErrorPeerAccessNotEnabled, "cudaErrorPeerAccessNotEnabled", "peer access has not been enabled"},
    {cudaErrorPeerAccessUnsupported, "cudaErrorPeerAccessUnsupported",
     "peer access is not supported between these two devices"},
    {cudaErrorNotPermitted, "cudaErrorNotPermitted", "operation not permitted"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureIsolation, "cudaErrorStreamCaptureIsolation",
     "dependency created on uncaptured work in another stream"},
    {cudaErrorSymbolNotFound, "cudaErrorSymbolNotFound", "named symbol not found"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const ErrorText *error_text(cudaError_t e) {
  for (const auto &t : kErrors)
    if (t.code == e) return &t;
  return nullptr;
}

} // namespace

// ---------------------------------------------------------------------------------------------
// Errors and versions
// ---------------------------------------------------------------------------------------------

SOFTGPU_EXPORT const char *cudaGetErrorString(cudaError_t e) {
  const ErrorText *t = error_text(e);
  return t ? t->text : "unrecognized error code";
}

SOFTGPU_EXPORT const char *cudaGetErrorName(cudaError_t e) {
  const ErrorText *t = error_text(e);
  return t ? t->name : "cudaErrorUnknown";
}

SOFTGPU_EXPORT cudaError_t cudaGetLastError(void) {
  int s = g_sticky.load(std::memory_order_relaxed);
  if (s != cudaSuccess) return (cudaError_t)s;
  cudaError_t e = t_last;
  t_last = cudaSuccess;
  return e;
}

SOFTGPU_EXPORT cudaError_t cudaPeekAtLastError(void) {
  int s = g_sticky.load(std::memory_order_relaxed);
  return s != cudaSuccess ? (cudaError_t)s : t_last;
}

SOFTGPU_EXPORT cudaError_t cudaRuntimeGetVersion(int *v) {
  if (!v) return done(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

SOFTGPU_EXPORT cudaError_t cudaDriverGetVersion(int *v) {
  if (!v) return done(cudaErrorInvalidValue);
  return done(cuDriverGetVersion(v));
}

// ---------------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------------

SOFTGPU_EXPORT cudaError_t cudaGetDeviceCount(int *count) {
  if (!count) return done(cudaErrorInvalidValue);
  cudaError_t e = init();
  *count = g_count;
  return done(e);
}

SOFTGPU_EXPORT cudaError_t cudaSetDevice(int dev) {
  RT_STICKY();
  CUcontext ctx;
  RT_TRY(primary(dev, &ctx));
  RT_DRV(cuCtxSetCurrent(ctx));
  t_device = dev;
  return cudaSuccess;
}

SOFTGPU_EXPORT cudaError_t cudaGetDevice(int *dev) {
  if (!dev) return done(cudaErrorInvalidValue);
  RT_STICKY();
  RT_TRY(init());
  CUcontext cur = nullptr;
  CUdevice d;
  if (cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur && cuCtxGetDevice(&d) == CUDA_SUCCESS)
    t_device = d;
  *dev = t_device;
  return cudaSuccess;
}

SOFTGPU_EXPORT cudaError_t cudaDeviceSynchronize(void) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuCtxSynchronize());
}

SOFTGPU_EXPORT cudaError_t cudaDeviceGetPCIBusId(char *bus, int len, int dev) {
  RT_TRY(init());
  return done(cuDeviceGetPCIBusId(bus, len, dev));
}

SOFTGPU_EXPORT cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer) {
  RT_TRY(init());
  return done(cuDeviceCanAccessPeer(can, dev, peer));
}

SOFTGPU_EXPORT cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuMemGetInfo_v2(free_bytes, total));
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

SOFTGPU_EXPORT cudaError_t cudaMalloc(void **p, size_t n) {
  if (!p) return done(cudaErrorInvalidValue);
  RT_STICKY();
  RT_TRY(need_context());
  if (n == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  CUdeviceptr d = 0;
  CUresult r = cuMemAlloc_v2(&d, n);
  if (r != CUDA_SUCCESS) return done(r);
  *p = (void *)d;
  return cudaSuccess;
}

SOFTGPU_EXPORT cudaError_t cudaFree(void *p) {
  RT_STICKY();
  RT_TRY(need_context());
  if (!p) return cudaSuccess;
  return done(cuMemFree_v2((CUdeviceptr)p));
}

SOFTGPU_EXPORT cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
  RT_STICKY();
  RT_TRY(need_context());
  RT_TRY(check_kind(dst, src, kind));
  if (n == 0) return cudaSuccess;
  return done(cuMemcpy((CUdeviceptr)dst, (CUdeviceptr)src, n));
}

SOFTGPU_EXPORT cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                                           cudaStream_t s) {
  RT_STICKY();
  RT_TRY(need_context());
  RT_TRY(check_kind(dst, src, kind));
  return done(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, (CUstream)s));
}

// The runtime's memset runs on the legacy stream and is asynchronous for device memory, as
// CUDA documents.
SOFTGPU_EXPORT cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t s) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuMemsetD8Async((CUdeviceptr)p, (unsigned char)value, n, (CUstream)s));
}

SOFTGPU_EXPORT cudaError_t cudaMemset(void *p, int value, size_t n) {
  return cudaMemsetAsync(p, value, n, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------------------------

SOFTGPU_EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
  RT_STICKY();
  RT_TRY(need_context());
  if (!s || (flags & ~(unsigned)cudaStreamNonBlocking)) return done(cudaErrorInvalidValue);
  return done(cuStreamCreate((CUstream *)s, flags));
}

SOFTGPU_EXPORT cudaError_t cudaStreamCreate(cudaStream_t *s) {
  return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

SOFTGPU_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t s) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuStreamDestroy_v2((CUstream)s));
}

SOFTGPU_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuStreamSynchronize((CUstream)s));
}

SOFTGPU_EXPORT cudaError_t cudaStreamQuery(cudaStream_t s) {
  RT_STICKY();
  RT_TRY(need_context());
  CUresult r = cuStreamQuery((CUstream)s);
  // Not ready is an answer, not an error: it does not become the last error.
  return r == CUDA_ERROR_NOT_READY ? cudaErrorNotReady : done(r);
}

SOFTGPU_EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuStreamWaitEvent((CUstream)s, (CUevent)e, flags));
}

SOFTGPU_EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
  RT_STICKY();
  RT_TRY(need_context());
  if (!e) return done(cudaErrorInvalidValue);
  if (flags & ~(unsigned)(cudaEventDisableTiming | cudaEventBlockingSync)) {
    say("cudaEventCreateWithFlags: flags %#x are not modelled (only cudaEventDisableTiming and "
        "cudaEventBlockingSync)",
        flags);
    return done(cudaErrorNotSupported);
  }
  // Timing is not modelled: every event is created without it, and cudaEventElapsedTime fails.
  return done(cuEventCreate((CUevent *)e, CU_EVENT_DISABLE_TIMING));
}

SOFTGPU_EXPORT cudaError_t cudaEventCreate(cudaEvent_t *e) {
  return cudaEventCreateWithFlags(e, cudaEventDefault);
}

SOFTGPU_EXPORT cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuEventRecord((CUevent)e, (CUstream)s));
}

SOFTGPU_EXPORT cudaError_t cudaEventQuery(cudaEvent_t e) {
  RT_STICKY();
  RT_TRY(need_context());
  CUresult r = cuEventQuery((CUevent)e);
  return r == CUDA_ERROR_NOT_READY ? cudaErrorNotReady : done(r);
}

SOFTGPU_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuEventSynchronize((CUevent)e));
}

SOFTGPU_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t e) {
  RT_STICKY();
  RT_TRY(need_context());
  return done(cuEventDestroy_v2((CUevent)e));
}

SOFTGPU_EXPORT cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t, cudaEvent_t) {
  if (ms) *ms = 0;
  say("cudaEventElapsedTime: timing is not modelled by the software GPU");
  return done(cudaErrorNotSupported);
}
