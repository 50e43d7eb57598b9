// softgpu: a CPU stand-in for the CUDA driver (libcuda.so), for running comm's device path on a
// machine without a GPU. See softgpu/README.md for what it models and what it cannot show.
//
// Layout of this file, top to bottom:
//   configuration and tracing      SOFTGPU_* variables, the trace switch, error names
//   devices and contexts           virtual GPUs, primary contexts, the per-thread current context
//   memory                         cuMemAlloc (memfd), pointer attributes, IPC, VMM, dmabuf
//   streams                        one worker thread per stream, the legacy stream, stream
//                                  memory operations, host functions, events, synchronisation
//   capture and graphs             captured work is recorded and replayed, never run at capture
//   modules and kernels            the embedded fatbin checked, kernels run on the CPU
//
// Every entry point either does what the CUDA driver API documents (within the limits written
// next to it) or returns an error and says why on stderr; none answers success without doing
// the work.

#include <cuda.h>

#include "instrument.h"
#include "kernels_cpu.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <functional>
#include <linux/futex.h>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <vector>

#define SOFTGPU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ---------------------------------------------------------------------------------------------
// Configuration and tracing
// ---------------------------------------------------------------------------------------------

long env_long(const char *name, long fallback) {
  const char *v = getenv(name);
  if (!v || !*v) return fallback;
  char *end = nullptr;
  long x = strtol(v, &end, 0);
  return (end && *end == 0) ? x : fallback;
}

struct Config {
  int devices;          // SOFTGPU_DEVICES (default 1)
  int sms;              // SOFTGPU_SMS: multiprocessors per device (default 4)
  int dmabuf;           // SOFTGPU_DMABUF: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (default 1)
  int peer;             // SOFTGPU_PEER: devices can access each other (default 1)
  long long mem_bytes;  // SOFTGPU_MEM_MIB: memory per device (default 16 GiB)
  int trace;            // SOFTGPU_TRACE: print every call on stderr
  long watchdog_s;      // SOFTGPU_WATCHDOG_S: name stream waits stuck longer than this
                        // SOFTGPU_LOG_DIR: write what is said to a file per process there
  std::string name;     // SOFTGPU_NAME
  // SOFTGPU_ADVERSARIAL: apply CUDA's documented worst cases where an ordinary run is lucky:
  // synchronous copies from pageable host memory to the device return once the source is
  // staged and land later on the legacy stream, and stream operations start after random
  // delays.
  int adversarial;
  int leaks; // SOFTGPU_LEAKS: list the device memory still allocated when the process exits
  // SOFTGPU_HW_QUEUES=1: the streams of a context share CUDA_DEVICE_MAX_CONNECTIONS hardware
  // queues (round robin, as a GPU hands them out), with the false dependencies that brings;
  // 0 (default): every stream has a queue of its own. hw_queues holds the number, or 0.
  int hw_queues;
};

Config &config() {
  static Config c = [] {
    Config c;
    c.devices = (int)std::clamp(env_long("SOFTGPU_DEVICES", 1), 0L, 64L);
    c.sms = (int)std::clamp(env_long("SOFTGPU_SMS", 4), 1L, 1024L);
    c.dmabuf = env_long("SOFTGPU_DMABUF", 1) != 0;
    c.peer = env_long("SOFTGPU_PEER", 1) != 0;
    c.mem_bytes = (long long)std::max(1L, env_long("SOFTGPU_MEM_MIB", 16384)) << 20;
    c.trace = env_long("SOFTGPU_TRACE", 0) != 0;
    c.watchdog_s = std::max(1L, env_long("SOFTGPU_WATCHDOG_S", 30));
    const char *n = getenv("SOFTGPU_NAME");
    c.name = n && *n ? n : "softgpu virtual GPU (CPU stand-in)";
    c.adversarial = env_long("SOFTGPU_ADVERSARIAL", 0) != 0;
    c.leaks = env_long("SOFTGPU_LEAKS", 0) != 0;
    c.hw_queues = env_long("SOFTGPU_HW_QUEUES", 0) != 0
                      ? (int)std::clamp(env_long("CUDA_DEVICE_MAX_CONNECTIONS", 8), 1L, 32L)
                      : 0;
    return c;
  }();
  return c;
}

const char *error_name(CUresult r) {
  switch (r) {
#define SOFTGPU_ERR(x)                                                                             \
  case x:                                                                                          \
    return #x;
    SOFTGPU_ERR(CUDA_SUCCESS)
    SOFTGPU_ERR(CUDA_ERROR_INVALID_VALUE)
    SOFTGPU_ERR(CUDA_ERROR_OUT_OF_MEMORY)
    SOFTGPU_ERR(CUDA_ERROR_NOT_INITIALIZED)
    SOFTGPU_ERR(CUDA_ERROR_DEINITIALIZED)
    SOFTGPU_ERR(CUDA_ERROR_NO_DEVICE)
    SOFTGPU_ERR(CUDA_ERROR_INVALID_DEVICE)
    SOFTGPU_ERR(CUDA_ERROR_INVALID_IMAGE)
    SOFTGPU_ERR(CUDA_ERROR_INVALID_CONTEXT)
    SOFTGPU_ERR(CUDA_ERROR_ALREADY_MAPPED)
    SOFTGPU_ERR(CUDA_ERROR_NOT_MAPPED)
    SOFTGPU_ERR(CUDA_ERROR_INVALID_SOURCE)
    SOFTGPU_ERR(CUDA_ERROR_FILE_NOT_FOUND)
    SOFTGPU_ERR(CUDA_ERROR_INVALID_HANDLE)
    SOFTGPU_ERR(CUDA_ERROR_NOT_FOUND)
    SOFTGPU_ERR(CUDA_ERROR_NOT_READY)
    SOFTGPU_ERR(CUDA_ERROR_ILLEGAL_ADDRESS)
    SOFTGPU_ERR(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
    SOFTGPU_ERR(CUDA_ERROR_LAUNCH_FAILED)
    SOFTGPU_ERR(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    SOFTGPU_ERR(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED)
    SOFTGPU_ERR(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED)
    SOFTGPU_ERR(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE)
    SOFTGPU_ERR(CUDA_ERROR_CONTEXT_IS_DESTROYED)
    SOFTGPU_ERR(CUDA_ERROR_NOT_PERMITTED)
    SOFTGPU_ERR(CUDA_ERROR_NOT_SUPPORTED)
    SOFTGPU_ERR(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    SOFTGPU_ERR(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    SOFTGPU_ERR(CUDA_ERROR_STREAM_CAPTURE_MERGE)
    SOFTGPU_ERR(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED)
    SOFTGPU_ERR(CUDA_ERROR_STREAM_CAPTURE_UNJOINED)
    SOFTGPU_ERR(CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
    SOFTGPU_ERR(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    SOFTGPU_ERR(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
    SOFTGPU_ERR(CUDA_ERROR_CAPTURED_EVENT)
    SOFTGPU_ERR(CUDA_ERROR_ILLEGAL_STATE)
    SOFTGPU_ERR(CUDA_ERROR_UNKNOWN)
#undef SOFTGPU_ERR
  default:
    return nullptr;
  }
}

pid_t tid() { return (pid_t)syscall(SYS_gettid); }

void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void say(const char *fmt, ...) {
  char buf[1024];
  int n = snprintf(buf, sizeof buf, "softgpu[%d:%d] ", (int)getpid(), (int)tid());
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + n, sizeof buf - n, fmt, ap);
  va_end(ap);
  // SOFTGPU_LOG_DIR: one file per process there instead of stderr (which a test harness may
  // swallow, as comm-gpu-suite does for its workers' unless they fail).
  static FILE *log = [] {
    const char *dir = getenv("SOFTGPU_LOG_DIR");
    if (!dir || !*dir) return stderr;
    std::string path = std::string(dir) + "/softgpu." + std::to_string(getpid()) + ".log";
    FILE *f = fopen(path.c_str(), "a");
    if (f) setvbuf(f, nullptr, _IOLBF, 0);
    return f ? f : stderr;
  }();
  fprintf(log, "%s\n", buf);
}

// A call into the driver as the trace shows it: its name and arguments on entry, its result on
// return.
struct Call {
  const char *name;
  char args[256] = {0};
  explicit Call(const char *n) : name(n) {}
  void describe(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
  }
  CUresult ret(CUresult r) const {
    if (config().trace) {
      const char *n = error_name(r);
      say("%s(%s) -> %s", name, args, n ? n : "?");
    }
    return r;
  }
  // An error the caller should understand without a trace: said once per call site kind.
  CUresult refuse(CUresult r, const char *why) const {
    const char *n = error_name(r);
    say("%s(%s) -> %s: %s", name, args, n ? n : "?", why);
    return r;
  }
};

std::atomic<bool> g_initialized{false};
thread_local bool t_in_host_fn = false;

// Entry of every API function but cuInit, cuDriverGetVersion and the error-name calls.
#define SG_API(NAME, ...)                                                                          \
  Call call_(NAME);                                                                                \
  if (config().trace) call_.describe(__VA_ARGS__);                                                 \
  if (t_in_host_fn)                                                                                \
    return call_.refuse(CUDA_ERROR_NOT_PERMITTED,                                                  \
                        "a host function queued with cuLaunchHostFunc must not call CUDA");        \
  if (!g_initialized.load(std::memory_order_acquire)) return call_.ret(CUDA_ERROR_NOT_INITIALIZED)
#define SG_RET(r) return call_.ret(r)
// Failures on request (SOFTGPU_FAIL, softgpu_fail_call): the call fails as an exhausted
// driver's does, having taken nothing.
#define SG_FAULT()                                                                                 \
  do {                                                                                             \
    if (softgpu::fail_now(call_.name))                                                             \
      return call_.refuse(CUDA_ERROR_OUT_OF_MEMORY,                                                \
                          "failed on request (SOFTGPU_FAIL or softgpu_fail_call)");                \
  } while (0)
#define SG_CHECK(cond, err)                                                                        \
  do {                                                                                             \
    if (!(cond)) return call_.ret(err);                                                            \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Devices and contexts
// ---------------------------------------------------------------------------------------------

struct Stream;
struct HwQueue;

struct Context {
  int device;
  std::mutex m;
  std::vector<std::weak_ptr<Stream>> streams; // every stream made in it, for synchronisation
  std::shared_ptr<Stream> legacy;             // the NULL stream, made at first use
  std::set<int> peers;                        // devices whose memory peer access was enabled for
  std::vector<std::shared_ptr<HwQueue>> queues; // SOFTGPU_HW_QUEUES: the shared hardware queues
  unsigned next_queue = 0;                      // round robin over them
};

struct Device {
  int ordinal;
  Context primary;
  int primary_retains = 0;
};

std::vector<std::unique_ptr<Device>> g_devices;
std::mutex g_devices_m;
thread_local Context *t_ctx = nullptr;

Device *device(int ordinal) {
  if (ordinal < 0 || ordinal >= (int)g_devices.size()) return nullptr;
  return g_devices[ordinal].get();
}

bool known_context(CUcontext c) {
  for (auto &d : g_devices)
    if ((CUcontext)&d->primary == c) return true;
  return false;
}

#define SG_NEED_CTX()                                                                              \
  do {                                                                                             \
    if (!t_ctx)                                                                                    \
      return call_.refuse(CUDA_ERROR_INVALID_CONTEXT, "no context is current on this thread");    \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

size_t page_size() {
  static size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}
size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// One reservation of VMM memory (cuMemCreate): a memfd, kept alive by its handle and by every
// mapping of it.
struct VmmAllocation {
  int fd;
  size_t size;
  int device;
  bool exported_or_imported;
};

enum class RegionKind { Alloc, Ipc, Vmm };

// Device memory mapped in this process at [base, base + size).
struct Region {
  uintptr_t base = 0;
  size_t size = 0;
  RegionKind kind = RegionKind::Alloc;
  int device = 0;
  uint64_t buffer_id = 0;
  int fd = -1;            // Alloc: its memfd
  size_t mapped = 0;      // Alloc, Ipc: bytes mapped (size rounded to pages, plus a guard page)
  pid_t ipc_owner = 0;    // Ipc: the exporting process
  uint64_t ipc_id = 0;    // Ipc: the exporter's buffer id
  int ipc_refs = 0;       // Ipc: opens not yet closed
  std::shared_ptr<VmmAllocation> vmm; // Vmm
  size_t vmm_offset = 0;              // Vmm: where in the allocation the mapping starts
  std::vector<uint64_t> access;       // Vmm: CUmemAccess_flags per device
};

std::shared_mutex g_mem_m;
std::map<uintptr_t, Region> g_regions;                               // by base
std::map<uintptr_t, size_t> g_reserved;                              // VMM address reservations
std::unordered_map<uint64_t, std::shared_ptr<VmmAllocation>> g_vmm; // handle -> allocation
uint64_t g_next_buffer_id = 1;
uint64_t g_next_vmm_handle = 1;

// The region holding ptr (caller holds g_mem_m).
Region *region_of(uintptr_t ptr) {
  auto it = g_regions.upper_bound(ptr);
  if (it == g_regions.begin()) return nullptr;
  --it;
  Region &r = it->second;
  return ptr < r.base + r.size ? &r : nullptr;
}

const char *kind_name(RegionKind k) {
  switch (k) {
  case RegionKind::Alloc:
    return "cuMemAlloc";
  case RegionKind::Ipc:
    return "IPC mapping";
  case RegionKind::Vmm:
    return "VMM mapping";
  }
  return "?";
}

// Who owns the memory at ptr, for diagnostics.
std::string describe_address(uintptr_t ptr) {
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  Region *r = region_of(ptr);
  char buf[200];
  if (!r) {
    snprintf(buf, sizeof buf, "%#lx (not device memory of this process)", (unsigned long)ptr);
  } else if (r->kind == RegionKind::Ipc) {
    snprintf(buf, sizeof buf, "%#lx (+%#lx in buffer %llu of process %d, opened by IPC)",
             (unsigned long)ptr, (unsigned long)(ptr - r->base), (unsigned long long)r->ipc_id,
             (int)r->ipc_owner);
  } else {
    snprintf(buf, sizeof buf, "%#lx (+%#lx in %s buffer %llu of GPU %d, this process)",
             (unsigned long)ptr, (unsigned long)(ptr - r->base), kind_name(r->kind),
             (unsigned long long)r->buffer_id, r->device);
  }
  return buf;
}

// The bytes of an IPC handle: enough for another process to find the exporter's memfd.
struct IpcWire {
  char magic[8]; // "softgpu"
  int32_t pid;
  int32_t fd;
  uint64_t size;
  uint64_t buffer_id;
  int32_t device;
  char pad[28];
};
static_assert(sizeof(IpcWire) == 64, "an IPC handle is 64 bytes");

std::string memfd_name(pid_t pid, uint64_t id) {
  return "softgpu-" + std::to_string(pid) + "-" + std::to_string(id);
}

// Maps `size` bytes of `fd` at a fresh address followed by an inaccessible guard page, so that a
// kernel or copy running past the end faults as it would on a GPU.
void *map_with_guard(int fd, size_t size, size_t *mapped) {
  size_t len = round_up(std::max<size_t>(size, 1), page_size());
  void *at = mmap(nullptr, len + page_size(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) return nullptr;
  if (mmap(at, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    munmap(at, len + page_size());
    return nullptr;
  }
  *mapped = len + page_size();
  return at;
}

// ---------------------------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------------------------

using Op = std::function<void()>;

// One node of a captured graph: an operation, or (wait_lane >= 0) a dependency on the first
// wait_pos nodes of another lane, made by an event recorded there and waited on here.
struct Node {
  Op op;
  int wait_lane = -1;
  size_t wait_pos = 0;
};

// A capture: lane 0 is the stream the capture began on; every stream that joined it (by waiting
// on an event recorded in it) records into a lane of its own. A launch runs the lanes
// concurrently, each in order, honouring the dependencies between them.
struct Graph {
  std::vector<std::vector<Node>> lanes{1};
  softgpu::GraphCounts counts;
  std::atomic<bool> invalidated{false};
  bool live = true;                          // still being captured (under g_captures_m)
  std::vector<std::shared_ptr<Stream>> members; // streams capturing into it, origin first
};

struct Stream {
  Context *ctx = nullptr;
  bool legacy = false;
  bool nonblocking = false;
  unsigned id = 0;
  std::shared_ptr<HwQueue> hw; // the queue its work runs on

  std::mutex m;
  std::condition_variable cv; // work done
  uint64_t enqueued = 0;
  uint64_t completed = 0;

  // Capture (under m).
  Graph *capture = nullptr;
  int capture_lane = 0;
  CUstreamCaptureMode capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  std::thread::id capture_thread;
};

// A hardware queue: one worker thread runs the operations of the streams mapped onto it, in
// the order they were queued. By default every stream has one of its own; SOFTGPU_HW_QUEUES
// maps a context's streams onto CUDA_DEVICE_MAX_CONNECTIONS of them, so that an operation
// waiting on one stream holds up the others sharing its queue, as on a GPU.
struct HwQueue {
  struct Item {
    std::shared_ptr<Stream> stream;
    uint64_t seq;
    Op op;
  };
  std::mutex m;
  std::condition_variable cv;
  std::deque<Item> items;
  bool started = false;
  bool closing = false; // a private queue whose stream was destroyed: ends once drained
};

std::mutex g_streams_m;
std::unordered_map<CUstream, std::shared_ptr<Stream>> g_streams;
std::atomic<unsigned> g_next_stream_id{1};

// Up to 300 us before a stream operation starts, so streams that nothing orders interleave
// differently from run to run.
void adversarial_delay() {
  thread_local unsigned long long state = (unsigned long long)tid() * 0x9E3779B97F4A7C15ull;
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  unsigned us = (unsigned)(state >> 33) % 300;
  if (us > 150) std::this_thread::sleep_for(std::chrono::microseconds(us - 150));
}

void worker_loop(std::shared_ptr<HwQueue> q) {
  std::unique_lock<std::mutex> l(q->m);
  for (;;) {
    q->cv.wait(l, [&] { return !q->items.empty() || q->closing; });
    if (q->items.empty()) return; // closed and drained
    HwQueue::Item it = std::move(q->items.front());
    q->items.pop_front();
    l.unlock();
    if (config().adversarial) adversarial_delay();
    it.op();
    {
      std::lock_guard<std::mutex> sl(it.stream->m);
      it.stream->completed = it.seq;
      it.stream->cv.notify_all();
    }
    it = HwQueue::Item();
    l.lock();
  }
}

// The queue a new stream of ctx runs on.
std::shared_ptr<HwQueue> queue_for(Context *ctx) {
  if (!config().hw_queues || !ctx) return std::make_shared<HwQueue>();
  std::lock_guard<std::mutex> l(ctx->m);
  if (ctx->queues.empty())
    for (int i = 0; i < config().hw_queues; ++i) ctx->queues.push_back(std::make_shared<HwQueue>());
  return ctx->queues[ctx->next_queue++ % ctx->queues.size()];
}

// Waits until `s` has completed its operation number `seq`.
void wait_for(Stream *s, uint64_t seq) {
  std::unique_lock<std::mutex> l(s->m);
  s->cv.wait(l, [&] { return s->completed >= seq; });
}

std::shared_ptr<Stream> legacy_stream(Context *ctx) {
  std::lock_guard<std::mutex> l(ctx->m);
  if (!ctx->legacy) {
    ctx->legacy = std::make_shared<Stream>();
    ctx->legacy->ctx = ctx;
    ctx->legacy->legacy = true;
    ctx->legacy->id = 0;
    ctx->legacy->hw = std::make_shared<HwQueue>();
  }
  return ctx->legacy;
}

// The stream a handle names: null and CU_STREAM_LEGACY are the current context's legacy stream.
CUresult resolve_stream(CUstream h, std::shared_ptr<Stream> &out) {
  if (h == nullptr || h == CU_STREAM_LEGACY) {
    if (!t_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    out = legacy_stream(t_ctx);
    return CUDA_SUCCESS;
  }
  if (h == CU_STREAM_PER_THREAD) return CUDA_ERROR_NOT_SUPPORTED;
  std::lock_guard<std::mutex> l(g_streams_m);
  auto it = g_streams.find(h);
  if (it == g_streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  out = it->second;
  return CUDA_SUCCESS;
}

// Queues `op` on `s` after everything queued there before and, following the legacy stream's
// rules, after the legacy stream's earlier work (blocking streams) or after every blocking
// stream's earlier work (the legacy stream). Returns the operation's number.
uint64_t push(const std::shared_ptr<Stream> &s, Op op) {
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> deps;
  if (s->legacy) {
    std::lock_guard<std::mutex> l(s->ctx->m);
    for (auto &w : s->ctx->streams) {
      auto o = w.lock();
      if (!o || o->nonblocking) continue;
      std::lock_guard<std::mutex> ol(o->m);
      if (o->completed < o->enqueued) deps.emplace_back(o, o->enqueued);
    }
  } else if (!s->nonblocking) {
    auto lg = legacy_stream(s->ctx);
    std::lock_guard<std::mutex> ll(lg->m);
    if (lg->completed < lg->enqueued) deps.emplace_back(lg, lg->enqueued);
  }
  if (!deps.empty()) {
    op = [deps, inner = std::move(op)] {
      for (auto &d : deps) wait_for(d.first.get(), d.second);
      inner();
    };
  }
  std::lock_guard<std::mutex> l(s->m);
  uint64_t seq = ++s->enqueued;
  HwQueue &q = *s->hw;
  std::lock_guard<std::mutex> ql(q.m);
  q.items.push_back(HwQueue::Item{s, seq, std::move(op)});
  if (!q.started) {
    q.started = true;
    std::thread(worker_loop, s->hw).detach();
  }
  q.cv.notify_all();
  return seq;
}

// Queues `op` on `s`, or records it into the stream's lane of the graph being captured there;
// counted as one operation of `kind` (a copy: of `bytes`).
CUresult enqueue(const std::shared_ptr<Stream> &s, softgpu::Count kind, uint64_t bytes, Op op) {
  {
    std::lock_guard<std::mutex> l(s->m);
    if (s->capture) {
      if (s->capture->invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
      s->capture->lanes[s->capture_lane].push_back(Node{std::move(op)});
      softgpu::count_graph_node(s->capture->counts, kind, bytes);
      softgpu::count(kind, bytes, true);
      return CUDA_SUCCESS;
    }
  }
  softgpu::count(kind, bytes);
  push(s, std::move(op));
  return CUDA_SUCCESS;
}

void synchronize(Stream *s) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> l(s->m);
    seq = s->enqueued;
  }
  wait_for(s, seq);
}

void synchronize_context(Context *ctx) {
  std::vector<std::shared_ptr<Stream>> all;
  {
    std::lock_guard<std::mutex> l(ctx->m);
    for (auto &w : ctx->streams)
      if (auto s = w.lock()) all.push_back(s);
    if (ctx->legacy) all.push_back(ctx->legacy);
  }
  for (auto &s : all) synchronize(s.get());
}

int futex(void *addr, int op, uint32_t val, const struct timespec *ts) {
  return (int)syscall(SYS_futex, addr, op, val, ts, nullptr, 0);
}

// Wakes whoever sleeps in a stream wait on the 4-byte word(s) at addr. Not the private futex:
// the word may be shared memory another process waits on.
void wake(void *addr, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 4) futex((char *)addr + o, FUTEX_WAKE, INT_MAX, nullptr);
}

bool wait_condition(uint32_t v, uint32_t want, unsigned flags) {
  switch (flags & 0x3) {
  case CU_STREAM_WAIT_VALUE_GEQ:
    return (int32_t)(v - want) >= 0;
  case CU_STREAM_WAIT_VALUE_EQ:
    return v == want;
  case CU_STREAM_WAIT_VALUE_AND:
    return (v & want) != 0;
  default: // NOR
    return ~(v | want) != 0;
  }
}

// Holds the calling stream worker until the word at addr satisfies the condition. Sleeps on the
// futex (stream writes wake it); the timeout only covers words written by kernels or copies,
// which wake nobody.
void stream_wait(unsigned stream_id, uint32_t *addr, uint32_t want, unsigned flags) {
  auto start = std::chrono::steady_clock::now();
  long warned_at = 0;
  for (;;) {
    uint32_t v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    if (wait_condition(v, want, flags)) return;
    struct timespec ts = {0, 2 * 1000 * 1000};
    futex(addr, FUTEX_WAIT, v, &ts);
    long waited =
        (long)std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() -
                                                               start)
            .count();
    if (waited >= (warned_at + 1) * config().watchdog_s) {
      warned_at = waited / config().watchdog_s;
      say("watchdog: stream %u has waited %ld s at %s for the value %u (flags %#x); it holds %u",
          stream_id, waited, describe_address((uintptr_t)addr).c_str(), want, flags,
          __atomic_load_n(addr, __ATOMIC_ACQUIRE));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Capture mode bookkeeping
// ---------------------------------------------------------------------------------------------

thread_local CUstreamCaptureMode t_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
std::atomic<int> g_global_captures{0};
std::mutex g_captures_m;
std::set<Stream *> g_capturing; // streams being captured (for invalidation)

// CUDA refuses "potentially unsafe" calls (synchronisation, queries, allocation) while a capture
// in global mode is under way anywhere, or one in thread-local mode on this thread, unless this
// thread's mode is relaxed; the call invalidates those captures.
bool capture_forbids() {
  if (t_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return false;
  std::lock_guard<std::mutex> l(g_captures_m);
  bool hit = false;
  for (Stream *s : g_capturing) {
    std::lock_guard<std::mutex> sl(s->m);
    bool applies = s->capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL ||
                   (s->capture_mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
                    s->capture_thread == std::this_thread::get_id());
    if (applies && s->capture) {
      s->capture->invalidated = true;
      hit = true;
    }
  }
  return hit;
}

#define SG_CAPTURE_SAFE()                                                                          \
  do {                                                                                             \
    if (capture_forbids())                                                                         \
      return call_.refuse(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,                                   \
                          "not permitted while a stream is captured (capture invalidated)");      \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------------

struct Event {
  std::mutex m;
  std::shared_ptr<Stream> stream; // where it was last recorded (outside capture)
  uint64_t seq = 0;
  Graph *captured_in = nullptr; // recorded during a capture into this graph
  int lane = 0;                 // ... on this lane of it
  size_t pos = 0;               // ... after this many of the lane's nodes
};

std::mutex g_events_m;
std::set<Event *> g_events;

bool known_event(CUevent e) {
  std::lock_guard<std::mutex> l(g_events_m);
  return g_events.count((Event *)e) != 0;
}

// ---------------------------------------------------------------------------------------------
// Modules
// ---------------------------------------------------------------------------------------------

struct Module {
  std::vector<unsigned char> image;
  Context *ctx;
};

struct Function {
  const softgpu::CpuKernel *kernel;
  Module *module;
};

struct GraphExec {
  std::vector<std::vector<Node>> lanes;
  softgpu::GraphCounts counts;
};

std::mutex g_objects_m;
std::set<Module *> g_modules;
std::set<Function *> g_functions;
std::set<Graph *> g_graphs;
std::set<GraphExec *> g_execs;

template <class T> bool known(std::set<T *> &set, void *p) {
  std::lock_guard<std::mutex> l(g_objects_m);
  return set.count((T *)p) != 0;
}

// At exit (SOFTGPU_LEAKS=1): the allocations, VMM handles and IPC mappings never given back.
void report_leaks() {
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  size_t bytes = 0, count = 0;
  for (auto &[base, r] : g_regions) {
    ++count;
    bytes += r.size;
    say("leak: %zu bytes of %s at %#lx (buffer %llu, GPU %d)", r.size, kind_name(r.kind),
        (unsigned long)base, (unsigned long long)r.buffer_id, r.device);
  }
  for (auto &[h, a] : g_vmm) say("leak: VMM handle %llu of %zu bytes never released",
                                  (unsigned long long)h, a->size);
  for (auto &[base, size] : g_reserved)
    say("leak: VMM address range of %zu bytes at %#lx never freed", size, (unsigned long)base);
  say("at exit: %zu mappings (%zu bytes) and %zu VMM handles still held%s", count, bytes,
      g_vmm.size(), g_reserved.empty() ? "" : ", and VMM address ranges");
}

} // namespace

// =============================================================================================
// Initialisation, devices, errors
// =============================================================================================

SOFTGPU_EXPORT CUresult cuInit(unsigned int flags) {
  Call call_("cuInit");
  if (config().trace) call_.describe("flags=%u", flags);
  if (flags != 0) SG_RET(CUDA_ERROR_INVALID_VALUE);
  std::lock_guard<std::mutex> l(g_devices_m);
  if (!g_initialized.load()) {
    for (int i = 0; i < config().devices; ++i) {
      auto d = std::make_unique<Device>();
      d->ordinal = i;
      d->primary.device = i;
      g_devices.push_back(std::move(d));
    }
    g_initialized.store(true, std::memory_order_release);
    if (config().leaks) atexit(report_leaks);
  }
  SG_RET(config().devices > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE);
}

SOFTGPU_EXPORT CUresult cuDriverGetVersion(int *version) {
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = 13000;
  return CUDA_SUCCESS;
}

SOFTGPU_EXPORT CUresult cuGetErrorName(CUresult error, const char **str) {
  if (!str) return CUDA_ERROR_INVALID_VALUE;
  const char *n = error_name(error);
  *str = n;
  return n ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SOFTGPU_EXPORT CUresult cuGetErrorString(CUresult error, const char **str) {
  return cuGetErrorName(error, str);
}

SOFTGPU_EXPORT CUresult cuDeviceGetCount(int *count) {
  SG_API("cuDeviceGetCount", "");
  SG_CHECK(count, CUDA_ERROR_INVALID_VALUE);
  *count = (int)g_devices.size();
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  SG_API("cuDeviceGet", "ordinal=%d", ordinal);
  SG_CHECK(dev, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(device(ordinal), CUDA_ERROR_INVALID_DEVICE);
  *dev = ordinal;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  SG_API("cuDeviceGetName", "dev=%d", dev);
  SG_CHECK(name && len > 0, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(device(dev), CUDA_ERROR_INVALID_DEVICE);
  snprintf(name, (size_t)len, "%s", config().name.c_str());
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev) {
  SG_API("cuDeviceGetPCIBusId", "dev=%d", dev);
  SG_CHECK(bus && len > 0, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(device(dev), CUDA_ERROR_INVALID_DEVICE);
  snprintf(bus, (size_t)len, "00000000:%02X:00.0", 0x10 + dev);
  SG_RET(CUDA_SUCCESS);
}

static void fill_uuid(CUuuid *uuid, CUdevice dev) {
  // A fixed, recognisable UUID per ordinal: "softgpu" then the ordinal.
  memset(uuid->bytes, 0, sizeof uuid->bytes);
  memcpy(uuid->bytes, "softgpu", 7);
  uuid->bytes[15] = (char)dev;
}

// cuda.h names this cuDeviceGetUuid_v2.
SOFTGPU_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
  SG_API("cuDeviceGetUuid_v2", "dev=%d", dev);
  SG_CHECK(uuid, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(device(dev), CUDA_ERROR_INVALID_DEVICE);
  fill_uuid(uuid, dev);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
  SG_API("cuDeviceTotalMem_v2", "dev=%d", dev);
  SG_CHECK(bytes, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(device(dev), CUDA_ERROR_INVALID_DEVICE);
  *bytes = (size_t)config().mem_bytes;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attr, CUdevice dev) {
  SG_API("cuDeviceGetAttribute", "attr=%d dev=%d", (int)attr, dev);
  SG_CHECK(value, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(device(dev), CUDA_ERROR_INVALID_DEVICE);
  switch (attr) {
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
    *value = config().sms;
    break;
  case CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED:
    *value = config().dmabuf;
    break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
    *value = 9;
    break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
    *value = 0;
    break;
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
  case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
  case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y:
    *value = 1024;
    break;
  case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z:
    *value = 64;
    break;
  case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X:
    *value = INT_MAX;
    break;
  case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
  case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z:
    *value = 65535;
    break;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
    *value = 32;
    break;
  case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
    *value = 0x10 + dev;
    break;
  case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
  case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
    *value = 0;
    break;
  case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
  case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
  case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
  case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS:
  case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR:
    *value = 1;
    break;
  default:
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "this device attribute is not modelled");
  }
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
  SG_API("cuDeviceCanAccessPeer", "dev=%d peer=%d", dev, peer);
  SG_CHECK(can, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(device(dev) && device(peer), CUDA_ERROR_INVALID_DEVICE);
  *can = (dev != peer && config().peer) ? 1 : 0;
  SG_RET(CUDA_SUCCESS);
}

// =============================================================================================
// Contexts
// =============================================================================================

SOFTGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
  SG_API("cuDevicePrimaryCtxRetain", "dev=%d", dev);
  SG_CHECK(ctx, CUDA_ERROR_INVALID_VALUE);
  Device *d = device(dev);
  SG_CHECK(d, CUDA_ERROR_INVALID_DEVICE);
  std::lock_guard<std::mutex> l(g_devices_m);
  d->primary_retains++;
  *ctx = (CUcontext)&d->primary;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  SG_API("cuDevicePrimaryCtxRelease_v2", "dev=%d", dev);
  Device *d = device(dev);
  SG_CHECK(d, CUDA_ERROR_INVALID_DEVICE);
  std::lock_guard<std::mutex> l(g_devices_m);
  SG_CHECK(d->primary_retains > 0, CUDA_ERROR_INVALID_CONTEXT);
  // The context's state is kept when the last retain goes (a real driver destroys it); nothing
  // in comm releases it.
  d->primary_retains--;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) {
  SG_API("cuCtxGetCurrent", "");
  SG_CHECK(ctx, CUDA_ERROR_INVALID_VALUE);
  *ctx = (CUcontext)t_ctx;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
  SG_API("cuCtxSetCurrent", "ctx=%p", (void *)ctx);
  SG_CHECK(ctx == nullptr || known_context(ctx), CUDA_ERROR_INVALID_CONTEXT);
  t_ctx = (Context *)ctx;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuCtxGetDevice(CUdevice *dev) {
  SG_API("cuCtxGetDevice", "");
  SG_CHECK(dev, CUDA_ERROR_INVALID_VALUE);
  SG_NEED_CTX();
  *dev = t_ctx->device;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuCtxSynchronize() {
  SG_API("cuCtxSynchronize", "");
  SG_NEED_CTX();
  SG_CAPTURE_SAFE();
  synchronize_context(t_ctx);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
  SG_API("cuCtxEnablePeerAccess", "peer=%p flags=%u", (void *)peer, flags);
  SG_NEED_CTX();
  SG_CHECK(flags == 0, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(known_context(peer), CUDA_ERROR_INVALID_CONTEXT);
  Context *p = (Context *)peer;
  SG_CHECK(p != t_ctx && config().peer, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
  std::lock_guard<std::mutex> l(t_ctx->m);
  if (!t_ctx->peers.insert(p->device).second) SG_RET(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  SG_RET(CUDA_SUCCESS);
}

// =============================================================================================
// Memory: cuMemAlloc, pointer attributes, address ranges
// =============================================================================================

SOFTGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
  SG_API("cuMemAlloc_v2", "size=%zu", size);
  SG_CHECK(dptr, CUDA_ERROR_INVALID_VALUE);
  SG_NEED_CTX();
  SG_CHECK(size > 0, CUDA_ERROR_INVALID_VALUE);
  SG_CAPTURE_SAFE();
  SG_FAULT();
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  uint64_t id = g_next_buffer_id++;
  int fd = (int)syscall(SYS_memfd_create, memfd_name(getpid(), id).c_str(), MFD_CLOEXEC);
  if (fd < 0) SG_RET(CUDA_ERROR_OUT_OF_MEMORY);
  if (ftruncate(fd, (off_t)round_up(size, page_size())) != 0) {
    close(fd);
    SG_RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  size_t mapped = 0;
  void *at = map_with_guard(fd, size, &mapped);
  if (!at) {
    close(fd);
    SG_RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  Region r;
  r.base = (uintptr_t)at;
  r.size = size;
  r.kind = RegionKind::Alloc;
  r.device = t_ctx->device;
  r.buffer_id = id;
  r.fd = fd;
  r.mapped = mapped;
  g_regions[r.base] = r;
  *dptr = (CUdeviceptr)r.base;
  if (config().trace) call_.describe("size=%zu -> %#llx id %llu", size, *dptr, (unsigned long long)id);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
  SG_API("cuMemFree_v2", "ptr=%#llx", dptr);
  SG_NEED_CTX();
  SG_CAPTURE_SAFE();
  {
    std::shared_lock<std::shared_mutex> l(g_mem_m);
    auto it = g_regions.find((uintptr_t)dptr);
    SG_CHECK(it != g_regions.end() && it->second.kind == RegionKind::Alloc, CUDA_ERROR_INVALID_VALUE);
  }
  // cuMemFree waits for the device to be done with the memory (an implicit synchronisation on a
  // real GPU too); without it a queued copy would fault here where the GPU would not.
  synchronize_context(t_ctx);
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  auto it = g_regions.find((uintptr_t)dptr);
  SG_CHECK(it != g_regions.end() && it->second.kind == RegionKind::Alloc, CUDA_ERROR_INVALID_VALUE);
  // The address range is unmapped, so a later use faults rather than reading stale bytes.
  munmap((void *)it->second.base, it->second.mapped);
  close(it->second.fd);
  g_regions.erase(it);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
  SG_API("cuMemGetInfo_v2", "");
  SG_NEED_CTX();
  SG_CHECK(free_bytes && total, CUDA_ERROR_INVALID_VALUE);
  size_t used = 0;
  {
    std::shared_lock<std::shared_mutex> l(g_mem_m);
    for (auto &[base, r] : g_regions)
      if (r.kind != RegionKind::Ipc && r.device == t_ctx->device) used += r.size;
  }
  *total = (size_t)config().mem_bytes;
  *free_bytes = used < *total ? *total - used : 0;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attr,
                                              CUdeviceptr ptr) {
  SG_API("cuPointerGetAttribute", "attr=%d ptr=%#llx", (int)attr, ptr);
  SG_CHECK(data, CUDA_ERROR_INVALID_VALUE);
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  Region *r = region_of((uintptr_t)ptr);
  // Host memory of every kind (stack, heap, shared mappings) is unknown to the driver.
  SG_CHECK(r, CUDA_ERROR_INVALID_VALUE);
  switch (attr) {
  case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
    *(unsigned int *)data = CU_MEMORYTYPE_DEVICE;
    break;
  case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
    *(int *)data = r->device;
    break;
  case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    *(unsigned long long *)data = r->buffer_id;
    break;
  case CU_POINTER_ATTRIBUTE_CONTEXT:
    *(CUcontext *)data = (CUcontext)&g_devices[r->device]->primary;
    break;
  case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    *(CUdeviceptr *)data = ptr;
    break;
  case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    *(CUdeviceptr *)data = (CUdeviceptr)r->base;
    break;
  case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    *(size_t *)data = r->size;
    break;
  case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    *(unsigned int *)data = 0;
    break;
  case CU_POINTER_ATTRIBUTE_MAPPED:
    *(unsigned int *)data = 1;
    break;
  case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
    *(unsigned int *)data = r->kind == RegionKind::Alloc;
    break;
  default:
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "this pointer attribute is not modelled");
  }
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
  SG_API("cuMemGetAddressRange_v2", "ptr=%#llx", ptr);
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  Region *r = region_of((uintptr_t)ptr);
  SG_CHECK(r, CUDA_ERROR_NOT_FOUND);
  if (base) *base = (CUdeviceptr)r->base;
  if (size) *size = r->size;
  SG_RET(CUDA_SUCCESS);
}

// =============================================================================================
// IPC
// =============================================================================================

SOFTGPU_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr ptr) {
  SG_API("cuIpcGetMemHandle", "ptr=%#llx", ptr);
  SG_CHECK(handle, CUDA_ERROR_INVALID_VALUE);
  SG_NEED_CTX();
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  Region *r = region_of((uintptr_t)ptr);
  SG_CHECK(r, CUDA_ERROR_INVALID_VALUE);
  // Legacy IPC covers cuMemAlloc memory only: VMM memory is shared through its own handles.
  if (r->kind != RegionKind::Alloc)
    return call_.refuse(CUDA_ERROR_INVALID_VALUE, "only cuMemAlloc memory has a legacy IPC handle");
  IpcWire w;
  memset(&w, 0, sizeof w);
  memcpy(w.magic, "softgpu", 8);
  w.pid = (int32_t)getpid();
  w.fd = r->fd;
  w.size = r->size;
  w.buffer_id = r->buffer_id;
  w.device = r->device;
  static_assert(sizeof(CUipcMemHandle) == sizeof(IpcWire), "handle size");
  memcpy(handle, &w, sizeof w);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle handle,
                                              unsigned int flags) {
  SG_API("cuIpcOpenMemHandle_v2", "flags=%u", flags);
  SG_CHECK(dptr, CUDA_ERROR_INVALID_VALUE);
  SG_NEED_CTX();
  IpcWire w;
  memcpy(&w, &handle, sizeof w);
  SG_CHECK(memcmp(w.magic, "softgpu", 8) == 0, CUDA_ERROR_INVALID_VALUE);
  if (w.pid == (int32_t)getpid())
    return call_.refuse(CUDA_ERROR_INVALID_CONTEXT,
                        "an IPC handle cannot be opened in the process that made it");
  SG_FAULT();
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  // The same handle opened again maps once, counted.
  for (auto &[base, r] : g_regions) {
    if (r.kind == RegionKind::Ipc && r.ipc_owner == w.pid && r.ipc_id == w.buffer_id) {
      r.ipc_refs++;
      *dptr = (CUdeviceptr)r.base;
      SG_RET(CUDA_SUCCESS);
    }
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)w.pid, (int)w.fd);
  char link[256] = {0};
  ssize_t n = readlink(path, link, sizeof link - 1);
  std::string want = "/memfd:" + memfd_name(w.pid, w.buffer_id) + " ";
  if (n <= 0 || strncmp(link, want.c_str(), want.size()) != 0)
    return call_.refuse(CUDA_ERROR_INVALID_VALUE,
                        "the allocation behind this IPC handle is gone (freed, or its process ended)");
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0)
    return call_.refuse(CUDA_ERROR_INVALID_VALUE,
                        "cannot open the exporting process's memory (/proc/<pid>/fd)");
  size_t mapped = 0;
  void *at = map_with_guard(fd, w.size, &mapped);
  close(fd);
  SG_CHECK(at, CUDA_ERROR_OUT_OF_MEMORY);
  Region r;
  r.base = (uintptr_t)at;
  r.size = w.size;
  r.kind = RegionKind::Ipc;
  r.device = w.device;
  r.buffer_id = g_next_buffer_id++;
  r.mapped = mapped;
  r.ipc_owner = w.pid;
  r.ipc_id = w.buffer_id;
  r.ipc_refs = 1;
  g_regions[r.base] = r;
  *dptr = (CUdeviceptr)r.base;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  SG_API("cuIpcCloseMemHandle", "ptr=%#llx", dptr);
  SG_NEED_CTX();
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  auto it = g_regions.find((uintptr_t)dptr);
  SG_CHECK(it != g_regions.end() && it->second.kind == RegionKind::Ipc, CUDA_ERROR_INVALID_VALUE);
  if (--it->second.ipc_refs == 0) {
    munmap((void *)it->second.base, it->second.mapped);
    g_regions.erase(it);
  }
  SG_RET(CUDA_SUCCESS);
}

// =============================================================================================
// Virtual memory management
// =============================================================================================

static constexpr size_t kGranularity = 2 << 20;

static bool valid_prop(const CUmemAllocationProp *prop) {
  return prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
         prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && device(prop->location.id);
}

SOFTGPU_EXPORT CUresult cuMemGetAllocationGranularity(size_t *gran, const CUmemAllocationProp *prop,
                                                      CUmemAllocationGranularity_flags option) {
  SG_API("cuMemGetAllocationGranularity", "option=%d", (int)option);
  SG_CHECK(gran && valid_prop(prop), CUDA_ERROR_INVALID_VALUE);
  *gran = kGranularity;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                    const CUmemAllocationProp *prop, unsigned long long flags) {
  SG_API("cuMemCreate", "size=%zu", size);
  SG_CHECK(handle && valid_prop(prop) && flags == 0, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(size > 0 && size % kGranularity == 0, CUDA_ERROR_INVALID_VALUE);
  if (prop->requestedHandleTypes & ~(unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "only POSIX file descriptor handles are modelled");
  SG_FAULT();
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  uint64_t id = g_next_vmm_handle++;
  int fd = (int)syscall(SYS_memfd_create, ("softgpu-vmm-" + std::to_string(id)).c_str(),
                        MFD_CLOEXEC);
  SG_CHECK(fd >= 0, CUDA_ERROR_OUT_OF_MEMORY);
  if (ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    SG_RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  auto a = std::make_shared<VmmAllocation>();
  a->fd = fd;
  a->size = size;
  a->device = prop->location.id;
  a->exported_or_imported = prop->requestedHandleTypes != 0;
  g_vmm[id] = a;
  *handle = id;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  SG_API("cuMemRelease", "handle=%llu", handle);
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  auto it = g_vmm.find(handle);
  SG_CHECK(it != g_vmm.end(), CUDA_ERROR_INVALID_VALUE);
  // Mappings keep the memory (their shared_ptr); the handle goes.
  g_vmm.erase(it);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                            CUdeviceptr addr, unsigned long long flags) {
  SG_API("cuMemAddressReserve", "size=%zu align=%zu", size, alignment);
  SG_CHECK(ptr && size > 0 && size % kGranularity == 0 && flags == 0, CUDA_ERROR_INVALID_VALUE);
  if (addr != 0)
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "a fixed address hint is not modelled");
  size_t align = std::max(alignment, kGranularity);
  SG_CHECK((align & (align - 1)) == 0, CUDA_ERROR_INVALID_VALUE);
  SG_FAULT();
  void *at = mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  SG_CHECK(at != MAP_FAILED, CUDA_ERROR_OUT_OF_MEMORY);
  uintptr_t start = round_up((uintptr_t)at, align);
  if (start > (uintptr_t)at) munmap(at, start - (uintptr_t)at);
  uintptr_t end = (uintptr_t)at + size + align;
  if (end > start + size) munmap((void *)(start + size), end - (start + size));
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  g_reserved[start] = size;
  *ptr = (CUdeviceptr)start;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  SG_API("cuMemAddressFree", "ptr=%#llx size=%zu", ptr, size);
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  auto it = g_reserved.find((uintptr_t)ptr);
  SG_CHECK(it != g_reserved.end() && it->second == size, CUDA_ERROR_INVALID_VALUE);
  for (auto &[base, r] : g_regions)
    if (r.base >= ptr && r.base < ptr + size)
      return call_.refuse(CUDA_ERROR_INVALID_VALUE, "the range is still mapped");
  munmap((void *)ptr, size);
  g_reserved.erase(it);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                 CUmemGenericAllocationHandle handle, unsigned long long flags) {
  SG_API("cuMemMap", "ptr=%#llx size=%zu offset=%zu handle=%llu", ptr, size, offset, handle);
  SG_CHECK(flags == 0 && size > 0, CUDA_ERROR_INVALID_VALUE);
  SG_FAULT();
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  auto h = g_vmm.find(handle);
  SG_CHECK(h != g_vmm.end(), CUDA_ERROR_INVALID_HANDLE);
  SG_CHECK(offset + size <= h->second->size && offset % kGranularity == 0, CUDA_ERROR_INVALID_VALUE);
  auto res = g_reserved.upper_bound((uintptr_t)ptr);
  SG_CHECK(res != g_reserved.begin(), CUDA_ERROR_INVALID_VALUE);
  --res;
  SG_CHECK(ptr + size <= res->first + res->second, CUDA_ERROR_INVALID_VALUE);
  for (auto &[base, r] : g_regions)
    if (r.base < ptr + size && ptr < r.base + r.size) SG_RET(CUDA_ERROR_ALREADY_MAPPED);
  // Mapped but inaccessible until cuMemSetAccess, as on a GPU.
  if (mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second->fd, (off_t)offset) ==
      MAP_FAILED)
    SG_RET(CUDA_ERROR_OUT_OF_MEMORY);
  Region r;
  r.base = (uintptr_t)ptr;
  r.size = size;
  r.kind = RegionKind::Vmm;
  r.device = h->second->device;
  r.buffer_id = g_next_buffer_id++;
  r.vmm = h->second;
  r.vmm_offset = offset;
  r.access.assign(g_devices.size(), CU_MEM_ACCESS_FLAGS_PROT_NONE);
  g_regions[r.base] = r;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  SG_API("cuMemUnmap", "ptr=%#llx size=%zu", ptr, size);
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  auto it = g_regions.find((uintptr_t)ptr);
  SG_CHECK(it != g_regions.end() && it->second.kind == RegionKind::Vmm && it->second.size == size,
           CUDA_ERROR_INVALID_VALUE);
  // Back to a reserved, inaccessible range: a use after unmap faults.
  mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  g_regions.erase(it);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                       size_t count) {
  SG_API("cuMemSetAccess", "ptr=%#llx size=%zu count=%zu", ptr, size, count);
  SG_CHECK(desc && count > 0, CUDA_ERROR_INVALID_VALUE);
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  auto it = g_regions.find((uintptr_t)ptr);
  SG_CHECK(it != g_regions.end() && it->second.kind == RegionKind::Vmm && it->second.size == size,
           CUDA_ERROR_INVALID_VALUE);
  Region &r = it->second;
  for (size_t i = 0; i < count; ++i) {
    SG_CHECK(desc[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && device(desc[i].location.id),
             CUDA_ERROR_INVALID_DEVICE);
    r.access[desc[i].location.id] = desc[i].flags;
  }
  // One CPU stands for every device: the range is accessible when any device may access it.
  int prot = PROT_NONE;
  for (uint64_t f : r.access) {
    if (f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot = PROT_READ | PROT_WRITE;
    else if (f == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE) prot = PROT_READ;
  }
  SG_CHECK(mprotect((void *)ptr, size, prot) == 0, CUDA_ERROR_INVALID_VALUE);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location,
                                       CUdeviceptr ptr) {
  SG_API("cuMemGetAccess", "ptr=%#llx", ptr);
  SG_CHECK(flags && location && location->type == CU_MEM_LOCATION_TYPE_DEVICE,
           CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(device(location->id), CUDA_ERROR_INVALID_DEVICE);
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  Region *r = region_of((uintptr_t)ptr);
  SG_CHECK(r && r->kind == RegionKind::Vmm, CUDA_ERROR_INVALID_VALUE);
  *flags = r->access[location->id];
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle,
                                                     CUmemAllocationHandleType type,
                                                     unsigned long long flags) {
  SG_API("cuMemExportToShareableHandle", "handle=%llu type=%d", handle, (int)type);
  SG_CHECK(out && flags == 0, CUDA_ERROR_INVALID_VALUE);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "only POSIX file descriptor handles are modelled");
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  auto h = g_vmm.find(handle);
  SG_CHECK(h != g_vmm.end(), CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(h->second->exported_or_imported, CUDA_ERROR_INVALID_VALUE);
  int fd = fcntl(h->second->fd, F_DUPFD_CLOEXEC, 0);
  SG_CHECK(fd >= 0, CUDA_ERROR_OUT_OF_MEMORY);
  *(int *)out = fd;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                       void *os_handle,
                                                       CUmemAllocationHandleType type) {
  SG_API("cuMemImportFromShareableHandle", "fd=%d type=%d", (int)(intptr_t)os_handle, (int)type);
  SG_CHECK(handle, CUDA_ERROR_INVALID_VALUE);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "only POSIX file descriptor handles are modelled");
  SG_FAULT();
  int given = (int)(intptr_t)os_handle;
  struct stat st;
  SG_CHECK(fstat(given, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0, CUDA_ERROR_INVALID_VALUE);
  int fd = fcntl(given, F_DUPFD_CLOEXEC, 0);
  SG_CHECK(fd >= 0, CUDA_ERROR_OUT_OF_MEMORY);
  std::unique_lock<std::shared_mutex> l(g_mem_m);
  auto a = std::make_shared<VmmAllocation>();
  a->fd = fd;
  a->size = (size_t)st.st_size;
  // The exporter's device is not in the descriptor; the importer's current device stands in.
  a->device = t_ctx ? t_ctx->device : 0;
  a->exported_or_imported = true;
  uint64_t id = g_next_vmm_handle++;
  g_vmm[id] = a;
  *handle = id;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemGetHandleForAddressRange(void *out, CUdeviceptr ptr, size_t size,
                                                      CUmemRangeHandleType type,
                                                      unsigned long long flags) {
  SG_API("cuMemGetHandleForAddressRange", "ptr=%#llx size=%zu", ptr, size);
  SG_CHECK(out && flags == 0 && size > 0, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(type == CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(ptr % page_size() == 0 && size % page_size() == 0, CUDA_ERROR_INVALID_VALUE);
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  Region *r = region_of((uintptr_t)ptr);
  SG_CHECK(r && ptr + size <= r->base + round_up(r->size, page_size()), CUDA_ERROR_INVALID_VALUE);
  int src = r->kind == RegionKind::Alloc ? r->fd : r->kind == RegionKind::Vmm ? r->vmm->fd : -1;
  if (src < 0)
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "a dmabuf of IPC-mapped memory is not modelled");
  SG_FAULT();
  // A real dmabuf holds exactly the range: its byte 0 is the byte at ptr. A memfd holds its whole
  // allocation, so the stand-in's dmabuf is a new open file of the allocation's memfd whose file
  // position is where the range starts; an importer (the verbs model) adds that position to
  // every offset it is given. A real dmabuf's position is 0 and stays so (it cannot seek), so
  // an importer that honours the position is right for both.
  size_t start = (size_t)(ptr - r->base) + (r->kind == RegionKind::Vmm ? r->vmm_offset : 0);
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", src);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  SG_CHECK(fd >= 0, CUDA_ERROR_OUT_OF_MEMORY);
  if (lseek(fd, (off_t)start, SEEK_SET) != (off_t)start) {
    close(fd);
    SG_RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  *(int *)out = fd;
  SG_RET(CUDA_SUCCESS);
}

// =============================================================================================
// Streams
// =============================================================================================

SOFTGPU_EXPORT CUresult cuStreamCreate(CUstream *out, unsigned int flags) {
  SG_API("cuStreamCreate", "flags=%u", flags);
  SG_CHECK(out && (flags & ~(unsigned)CU_STREAM_NON_BLOCKING) == 0, CUDA_ERROR_INVALID_VALUE);
  SG_NEED_CTX();
  SG_FAULT();
  auto s = std::make_shared<Stream>();
  s->ctx = t_ctx;
  s->nonblocking = flags & CU_STREAM_NON_BLOCKING;
  s->id = g_next_stream_id++;
  s->hw = queue_for(t_ctx);
  {
    std::lock_guard<std::mutex> l(t_ctx->m);
    t_ctx->streams.erase(std::remove_if(t_ctx->streams.begin(), t_ctx->streams.end(),
                                        [](auto &w) { return w.expired(); }),
                         t_ctx->streams.end());
    t_ctx->streams.push_back(s);
  }
  std::lock_guard<std::mutex> l(g_streams_m);
  g_streams[(CUstream)s.get()] = s;
  *out = (CUstream)s.get();
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuStreamDestroy_v2(CUstream h) {
  SG_API("cuStreamDestroy_v2", "stream=%p", (void *)h);
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> l(g_streams_m);
    auto it = g_streams.find(h);
    SG_CHECK(it != g_streams.end(), CUDA_ERROR_INVALID_HANDLE);
    s = it->second;
    g_streams.erase(it);
  }
  // Work already queued still runs; a private queue's worker ends once it is drained (a shared
  // queue's serves the context's other streams).
  if (!config().hw_queues) {
    std::lock_guard<std::mutex> l(s->hw->m);
    s->hw->closing = true;
    s->hw->cv.notify_all();
  }
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuStreamSynchronize(CUstream h) {
  SG_API("cuStreamSynchronize", "stream=%p", (void *)h);
  std::shared_ptr<Stream> s;
  SG_CHECK(resolve_stream(h, s) == CUDA_SUCCESS, h ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT);
  {
    std::lock_guard<std::mutex> l(s->m);
    if (s->capture) {
      s->capture->invalidated = true;
      return call_.refuse(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                          "synchronising a stream that is being captured");
    }
  }
  SG_CAPTURE_SAFE();
  synchronize(s.get());
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuStreamQuery(CUstream h) {
  SG_API("cuStreamQuery", "stream=%p", (void *)h);
  std::shared_ptr<Stream> s;
  SG_CHECK(resolve_stream(h, s) == CUDA_SUCCESS, CUDA_ERROR_INVALID_HANDLE);
  SG_CAPTURE_SAFE();
  std::lock_guard<std::mutex> l(s->m);
  SG_RET(s->completed >= s->enqueued ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY);
}

#define SG_STREAM(h, s)                                                                            \
  std::shared_ptr<Stream> s;                                                                       \
  do {                                                                                             \
    CUresult r_ = resolve_stream(h, s);                                                            \
    if (r_ != CUDA_SUCCESS) SG_RET(r_);                                                            \
  } while (0)

// Whether [p, p + n) is memory of a device (of any process's allocation mapped here).
static bool is_device_range(uintptr_t p, size_t n) {
  std::shared_lock<std::shared_mutex> l(g_mem_m);
  Region *r = region_of(p);
  return r && p + n <= r->base + r->size;
}

SOFTGPU_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
  SG_API("cuMemcpyAsync", "dst=%#llx src=%#llx n=%zu stream=%p", dst, src, n, (void *)h);
  SG_STREAM(h, s);
  if (n == 0) SG_RET(CUDA_SUCCESS);
  bool src_dev = is_device_range(src, n), dst_dev = is_device_range(dst, n);
  bool capturing;
  {
    std::lock_guard<std::mutex> l(s->m);
    capturing = s->capture != nullptr;
  }
  if (!src_dev && dst_dev && !capturing) {
    // From pageable host memory: CUDA stages the source before the call returns, so the caller
    // may reuse its buffer at once.
    auto staged = std::make_shared<std::vector<unsigned char>>((unsigned char *)src,
                                                               (unsigned char *)src + n);
    SG_RET(enqueue(s, softgpu::Count::Copy, n,
                   [dst, staged] { memcpy((void *)dst, staged->data(), staged->size()); }));
  }
  CUresult r =
      enqueue(s, softgpu::Count::Copy, n, [dst, src, n] { memmove((void *)dst, (const void *)src, n); });
  if (r != CUDA_SUCCESS || capturing) SG_RET(r);
  if (src_dev && !dst_dev) synchronize(s.get()); // to pageable host memory: returns when done
  SG_RET(CUDA_SUCCESS);
}

// A synchronous copy: on the legacy stream, and done when it returns, except (adversarial mode)
// to the device: CUDA's "API synchronization behavior" lets a copy from pageable host memory
// (all host memory here) return once the source is staged, and a device-to-device copy return
// at once; the transfer lands later, ordered on the legacy stream only.
static CUresult copy_sync(Call &call_, CUdeviceptr dst, CUdeviceptr src, size_t n) {
  SG_NEED_CTX();
  SG_CAPTURE_SAFE();
  if (n == 0) SG_RET(CUDA_SUCCESS);
  auto s = legacy_stream(t_ctx);
  softgpu::count(softgpu::Count::Copy, n);
  if (config().adversarial && is_device_range(dst, n)) {
    auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char *)src,
                                                               (const unsigned char *)src + n);
    push(s, [dst, staged] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      memcpy((void *)dst, staged->data(), staged->size());
    });
    SG_RET(CUDA_SUCCESS);
  }
  push(s, [dst, src, n] { memmove((void *)dst, (const void *)src, n); });
  synchronize(s.get());
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  SG_API("cuMemcpy", "dst=%#llx src=%#llx n=%zu", dst, src, n);
  return copy_sync(call_, dst, src, n);
}

SOFTGPU_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  SG_API("cuMemcpyHtoD_v2", "dst=%#llx src=%p n=%zu", dst, src, n);
  if (n && !is_device_range(dst, n)) SG_RET(CUDA_ERROR_INVALID_VALUE);
  return copy_sync(call_, dst, (CUdeviceptr)src, n);
}

SOFTGPU_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  SG_API("cuMemcpyDtoH_v2", "dst=%p src=%#llx n=%zu", dst, src, n);
  if (n && !is_device_range(src, n)) SG_RET(CUDA_ERROR_INVALID_VALUE);
  return copy_sync(call_, (CUdeviceptr)dst, src, n);
}

// cudaMemset(Async) of softgpu's runtime (runtime.cpp) comes here.
SOFTGPU_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count,
                                        CUstream h) {
  SG_API("cuMemsetD8Async", "dst=%#llx value=%u count=%zu", dst, (unsigned)value, count);
  SG_STREAM(h, s);
  if (count && !is_device_range(dst, count)) SG_RET(CUDA_ERROR_INVALID_VALUE);
  SG_RET(enqueue(s, softgpu::Count::Memset, 0, [dst, value, count] { memset((void *)dst, value, count); }));
}

SOFTGPU_EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count,
                                         CUstream h) {
  SG_API("cuMemsetD32Async", "dst=%#llx value=%u count=%zu", dst, value, count);
  SG_STREAM(h, s);
  SG_CHECK(dst % 4 == 0, CUDA_ERROR_INVALID_VALUE);
  if (count && !is_device_range(dst, count * 4)) SG_RET(CUDA_ERROR_INVALID_VALUE);
  SG_RET(enqueue(s, softgpu::Count::Memset, 0, [dst, value, count] {
    uint32_t *p = (uint32_t *)dst;
    for (size_t i = 0; i < count; ++i) p[i] = value;
  }));
}

SOFTGPU_EXPORT CUresult cuStreamWriteValue32_v2(CUstream h, CUdeviceptr addr, cuuint32_t value,
                                                unsigned int flags) {
  SG_API("cuStreamWriteValue32_v2", "stream=%p addr=%#llx value=%u flags=%u", (void *)h, addr,
         value, flags);
  SG_STREAM(h, s);
  SG_CHECK(addr % 4 == 0 && (flags & ~(unsigned)CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER) == 0,
           CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(is_device_range(addr, 4), CUDA_ERROR_INVALID_VALUE);
  // Earlier work on the stream is complete when the worker gets here; the release store makes
  // its writes visible to whoever reads the value, in this process or another.
  SG_RET(enqueue(s, softgpu::Count::WriteValue, 0, [addr, value] {
    __atomic_store_n((uint32_t *)addr, value, __ATOMIC_RELEASE);
    wake((void *)addr, 4);
  }));
}

SOFTGPU_EXPORT CUresult cuStreamWriteValue64_v2(CUstream h, CUdeviceptr addr, cuuint64_t value,
                                                unsigned int flags) {
  SG_API("cuStreamWriteValue64_v2", "stream=%p addr=%#llx value=%llu flags=%u", (void *)h, addr,
         (unsigned long long)value, flags);
  SG_STREAM(h, s);
  SG_CHECK(addr % 8 == 0 && (flags & ~(unsigned)CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER) == 0,
           CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(is_device_range(addr, 8), CUDA_ERROR_INVALID_VALUE);
  SG_RET(enqueue(s, softgpu::Count::WriteValue, 0, [addr, value] {
    __atomic_store_n((uint64_t *)addr, value, __ATOMIC_RELEASE);
    wake((void *)addr, 8);
  }));
}

SOFTGPU_EXPORT CUresult cuStreamWaitValue32_v2(CUstream h, CUdeviceptr addr, cuuint32_t value,
                                               unsigned int flags) {
  SG_API("cuStreamWaitValue32_v2", "stream=%p addr=%#llx value=%u flags=%u", (void *)h, addr, value,
         flags);
  SG_STREAM(h, s);
  SG_CHECK(addr % 4 == 0 && (flags & ~(0x3u | CU_STREAM_WAIT_VALUE_FLUSH)) == 0,
           CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(is_device_range(addr, 4), CUDA_ERROR_INVALID_VALUE);
  unsigned id = s->id;
  SG_RET(enqueue(s, softgpu::Count::WaitValue, 0,
                 [id, addr, value, flags] { stream_wait(id, (uint32_t *)addr, value, flags); }));
}

SOFTGPU_EXPORT CUresult cuLaunchHostFunc(CUstream h, CUhostFn fn, void *data) {
  SG_API("cuLaunchHostFunc", "stream=%p", (void *)h);
  SG_CHECK(fn, CUDA_ERROR_INVALID_VALUE);
  SG_STREAM(h, s);
  SG_RET(enqueue(s, softgpu::Count::HostFunc, 0, [fn, data] {
    t_in_host_fn = true;
    fn(data);
    t_in_host_fn = false;
  }));
}

// =============================================================================================
// Events
// =============================================================================================

SOFTGPU_EXPORT CUresult cuEventCreate(CUevent *out, unsigned int flags) {
  SG_API("cuEventCreate", "flags=%u", flags);
  SG_CHECK(out, CUDA_ERROR_INVALID_VALUE);
  SG_NEED_CTX();
  if (!(flags & CU_EVENT_DISABLE_TIMING))
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "timing events are not modelled (use CU_EVENT_DISABLE_TIMING)");
  SG_FAULT();
  auto *e = new Event();
  std::lock_guard<std::mutex> l(g_events_m);
  g_events.insert(e);
  *out = (CUevent)e;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuEventDestroy_v2(CUevent ev) {
  SG_API("cuEventDestroy_v2", "event=%p", (void *)ev);
  std::lock_guard<std::mutex> l(g_events_m);
  auto it = g_events.find((Event *)ev);
  SG_CHECK(it != g_events.end(), CUDA_ERROR_INVALID_HANDLE);
  delete *it;
  g_events.erase(it);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuEventRecord(CUevent ev, CUstream h) {
  SG_API("cuEventRecord", "event=%p stream=%p", (void *)ev, (void *)h);
  SG_CHECK(known_event(ev), CUDA_ERROR_INVALID_HANDLE);
  SG_STREAM(h, s);
  Event *e = (Event *)ev;
  std::lock_guard<std::mutex> el(e->m);
  std::lock_guard<std::mutex> l(s->m);
  if (s->capture) {
    e->captured_in = s->capture;
    e->lane = s->capture_lane;
    e->pos = s->capture->lanes[s->capture_lane].size();
    e->stream.reset();
    softgpu::count(softgpu::Count::EventRecord, 0, true);
    softgpu::count_graph_node(s->capture->counts, softgpu::Count::EventRecord, 0);
  } else {
    softgpu::count(softgpu::Count::EventRecord);
    e->captured_in = nullptr;
    e->stream = s;
    e->seq = s->enqueued;
  }
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuEventQuery(CUevent ev) {
  SG_API("cuEventQuery", "event=%p", (void *)ev);
  SG_CHECK(known_event(ev), CUDA_ERROR_INVALID_HANDLE);
  SG_CAPTURE_SAFE();
  Event *e = (Event *)ev;
  std::lock_guard<std::mutex> el(e->m);
  if (e->captured_in) SG_RET(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  if (!e->stream) SG_RET(CUDA_SUCCESS);
  std::lock_guard<std::mutex> l(e->stream->m);
  SG_RET(e->stream->completed >= e->seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY);
}

SOFTGPU_EXPORT CUresult cuEventSynchronize(CUevent ev) {
  SG_API("cuEventSynchronize", "event=%p", (void *)ev);
  SG_CHECK(known_event(ev), CUDA_ERROR_INVALID_HANDLE);
  SG_CAPTURE_SAFE();
  Event *e = (Event *)ev;
  std::shared_ptr<Stream> s;
  uint64_t seq;
  {
    std::lock_guard<std::mutex> el(e->m);
    if (e->captured_in) SG_RET(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    s = e->stream;
    seq = e->seq;
  }
  if (s) wait_for(s.get(), seq);
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags) {
  SG_API("cuStreamWaitEvent", "stream=%p event=%p flags=%u", (void *)h, (void *)ev, flags);
  SG_CHECK(flags == 0, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(known_event(ev), CUDA_ERROR_INVALID_HANDLE);
  SG_STREAM(h, s);
  Event *e = (Event *)ev;
  std::shared_ptr<Stream> other;
  uint64_t seq;
  Graph *captured_in;
  int lane;
  size_t pos;
  {
    std::lock_guard<std::mutex> el(e->m);
    other = e->stream;
    seq = e->seq;
    captured_in = e->captured_in;
    lane = e->lane;
    pos = e->pos;
  }
  if (captured_in) {
    // Fork and join: the event was recorded in a capture. The waiting stream depends on the
    // work recorded before it; a stream not yet capturing joins the capture with a lane of its
    // own (as CUDA makes it part of the capture sequence).
    std::lock_guard<std::mutex> cl(g_captures_m);
    if (!captured_in->live)
      return call_.refuse(CUDA_ERROR_CAPTURED_EVENT,
                          "the event was recorded in a capture that has ended");
    std::lock_guard<std::mutex> l(s->m);
    if (s->capture && s->capture != captured_in)
      return call_.refuse(CUDA_ERROR_STREAM_CAPTURE_MERGE,
                          "the stream is being captured into another graph");
    if (!s->capture) {
      if (s->legacy)
        return call_.refuse(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                            "the legacy stream cannot join a capture");
      Stream *origin = captured_in->members.front().get();
      s->capture = captured_in;
      s->capture_lane = (int)captured_in->lanes.size();
      s->capture_mode = origin->capture_mode;
      s->capture_thread = origin->capture_thread;
      captured_in->lanes.emplace_back();
      captured_in->members.push_back(s);
      g_capturing.insert(s.get());
    }
    if (s->capture_lane != lane) {
      Node n;
      n.wait_lane = lane;
      n.wait_pos = pos;
      captured_in->lanes[s->capture_lane].push_back(std::move(n));
      softgpu::count(softgpu::Count::EventWait, 0, true);
      softgpu::count_graph_node(captured_in->counts, softgpu::Count::EventWait, 0);
    }
    SG_RET(CUDA_SUCCESS);
  }
  Graph *capture;
  {
    std::lock_guard<std::mutex> l(s->m);
    capture = s->capture;
  }
  if (capture) {
    capture->invalidated = true;
    return call_.refuse(CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                        "a captured stream waited on an event recorded outside the capture");
  }
  softgpu::count(softgpu::Count::EventWait);
  if (!other || other == s) SG_RET(CUDA_SUCCESS);
  push(s, [other, seq] { wait_for(other.get(), seq); });
  SG_RET(CUDA_SUCCESS);
}

// =============================================================================================
// Capture and graphs
// =============================================================================================

SOFTGPU_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
  SG_API("cuThreadExchangeStreamCaptureMode", "mode=%d", mode ? (int)*mode : -1);
  SG_CHECK(mode, CUDA_ERROR_INVALID_VALUE);
  CUstreamCaptureMode previous = t_capture_mode;
  t_capture_mode = *mode;
  *mode = previous;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuStreamBeginCapture_v2(CUstream h, CUstreamCaptureMode mode) {
  SG_API("cuStreamBeginCapture_v2", "stream=%p mode=%d", (void *)h, (int)mode);
  if (h == nullptr || h == CU_STREAM_LEGACY)
    return call_.refuse(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "the legacy stream cannot be captured");
  SG_STREAM(h, s);
  std::lock_guard<std::mutex> cl(g_captures_m);
  std::lock_guard<std::mutex> l(s->m);
  SG_CHECK(!s->capture, CUDA_ERROR_ILLEGAL_STATE);
  s->capture = new Graph();
  s->capture->members.push_back(s);
  s->capture_lane = 0;
  s->capture_mode = mode;
  s->capture_thread = std::this_thread::get_id();
  g_capturing.insert(s.get());
  SG_RET(CUDA_SUCCESS);
}

// Whether every lane of g is joined back into lane 0: some joined lane waits for all of its
// nodes.
static bool all_joined(const Graph &g) {
  std::vector<bool> joined(g.lanes.size(), false);
  joined[0] = true;
  for (bool grew = true; grew;) {
    grew = false;
    for (size_t j = 0; j < g.lanes.size(); ++j) {
      if (!joined[j]) continue;
      for (const Node &n : g.lanes[j])
        if (n.wait_lane >= 0 && !joined[n.wait_lane] && n.wait_pos == g.lanes[n.wait_lane].size()) {
          joined[n.wait_lane] = true;
          grew = true;
        }
    }
  }
  return std::all_of(joined.begin(), joined.end(), [](bool b) { return b; });
}

SOFTGPU_EXPORT CUresult cuStreamEndCapture(CUstream h, CUgraph *graph) {
  SG_API("cuStreamEndCapture", "stream=%p", (void *)h);
  SG_CHECK(graph, CUDA_ERROR_INVALID_VALUE);
  SG_STREAM(h, s);
  std::lock_guard<std::mutex> cl(g_captures_m);
  Graph *g;
  {
    std::lock_guard<std::mutex> l(s->m);
    SG_CHECK(s->capture, CUDA_ERROR_ILLEGAL_STATE);
    if (s->capture_lane != 0)
      return call_.refuse(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
                          "the capture must end on the stream it began on");
    if (s->capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED &&
        s->capture_thread != std::this_thread::get_id())
      SG_RET(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    g = s->capture;
  }
  bool unjoined = !all_joined(*g);
  // The capture ends on every stream that took part in it.
  for (auto &m : g->members) {
    std::lock_guard<std::mutex> l(m->m);
    m->capture = nullptr;
    m->capture_lane = 0;
    g_capturing.erase(m.get());
  }
  g->members.clear();
  g->live = false;
  *graph = nullptr;
  if (unjoined) {
    delete g;
    return call_.refuse(CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
                        "a stream that joined the capture was not joined back into the origin stream");
  }
  if (g->invalidated) {
    delete g;
    SG_RET(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  }
  {
    std::lock_guard<std::mutex> ol(g_objects_m);
    g_graphs.insert(g);
  }
  *graph = (CUgraph)g;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuStreamIsCapturing(CUstream h, CUstreamCaptureStatus *status) {
  SG_API("cuStreamIsCapturing", "stream=%p", (void *)h);
  SG_CHECK(status, CUDA_ERROR_INVALID_VALUE);
  SG_STREAM(h, s);
  std::lock_guard<std::mutex> l(s->m);
  *status = !s->capture ? CU_STREAM_CAPTURE_STATUS_NONE
            : s->capture->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                      : CU_STREAM_CAPTURE_STATUS_ACTIVE;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph,
                                                    unsigned long long flags) {
  SG_API("cuGraphInstantiateWithFlags", "graph=%p flags=%llu", (void *)graph, flags);
  SG_CHECK(exec && flags == 0, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(known(g_graphs, graph), CUDA_ERROR_INVALID_VALUE);
  auto *x = new GraphExec();
  x->lanes = ((Graph *)graph)->lanes;
  x->counts = ((Graph *)graph)->counts;
  std::lock_guard<std::mutex> l(g_objects_m);
  g_execs.insert(x);
  *exec = (CUgraphExec)x;
  SG_RET(CUDA_SUCCESS);
}

// One replay of a graph: lane 0 on the calling worker, every other lane on a thread of its own,
// each in order; a dependency node waits until the lane it names has run that many nodes.
static void run_lanes(const std::vector<std::vector<Node>> &lanes) {
  std::mutex m;
  std::condition_variable cv;
  std::vector<size_t> done(lanes.size(), 0);
  auto run = [&](size_t i) {
    for (const Node &n : lanes[i]) {
      if (n.wait_lane >= 0) {
        std::unique_lock<std::mutex> l(m);
        cv.wait(l, [&] { return done[n.wait_lane] >= n.wait_pos; });
      } else {
        n.op();
      }
      std::lock_guard<std::mutex> l(m);
      done[i]++;
      cv.notify_all();
    }
  };
  std::vector<std::thread> others;
  for (size_t i = 1; i < lanes.size(); ++i) others.emplace_back(run, i);
  run(0);
  for (auto &t : others) t.join();
}

SOFTGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream h) {
  SG_API("cuGraphLaunch", "exec=%p stream=%p", (void *)exec, (void *)h);
  SG_CHECK(known(g_execs, exec), CUDA_ERROR_INVALID_VALUE);
  SG_STREAM(h, s);
  {
    std::lock_guard<std::mutex> l(s->m);
    if (s->capture)
      return call_.refuse(CUDA_ERROR_NOT_SUPPORTED, "launching a graph into a capture is not modelled");
  }
  // One replay is one stream operation: nothing else queued on the stream runs in between.
  auto x = (GraphExec *)exec;
  softgpu::count(softgpu::Count::GraphLaunch);
  softgpu::count_graph_launch(x->counts);
  auto lanes = std::make_shared<std::vector<std::vector<Node>>>(x->lanes);
  push(s, [lanes] { run_lanes(*lanes); });
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec) {
  SG_API("cuGraphExecDestroy", "exec=%p", (void *)exec);
  std::lock_guard<std::mutex> l(g_objects_m);
  SG_CHECK(g_execs.erase((GraphExec *)exec), CUDA_ERROR_INVALID_VALUE);
  delete (GraphExec *)exec;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuGraphDestroy(CUgraph graph) {
  SG_API("cuGraphDestroy", "graph=%p", (void *)graph);
  std::lock_guard<std::mutex> l(g_objects_m);
  SG_CHECK(g_graphs.erase((Graph *)graph), CUDA_ERROR_INVALID_VALUE);
  delete (Graph *)graph;
  SG_RET(CUDA_SUCCESS);
}

// =============================================================================================
// Modules and kernels
// =============================================================================================

SOFTGPU_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  SG_API("cuModuleLoadData", "image=%p", image);
  SG_CHECK(module && image, CUDA_ERROR_INVALID_VALUE);
  SG_NEED_CTX();
  // A fatbin starts with magic 0xBA55ED50, a 16-bit version, a 16-bit header size and a 64-bit
  // size of what follows the header.
  const unsigned char *p = (const unsigned char *)image;
  uint32_t magic;
  uint16_t header;
  uint64_t body;
  memcpy(&magic, p, 4);
  memcpy(&header, p + 6, 2);
  memcpy(&body, p + 8, 8);
  if (magic != 0xBA55ED50u || header < 16 || body > (1ull << 32))
    return call_.refuse(CUDA_ERROR_INVALID_IMAGE, "not a fatbin (only comm's embedded fatbin is understood)");
  auto *m = new Module();
  m->image.assign(p, p + header + body);
  m->ctx = t_ctx;
  std::lock_guard<std::mutex> l(g_objects_m);
  g_modules.insert(m);
  *module = (CUmodule)m;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuModuleUnload(CUmodule module) {
  SG_API("cuModuleUnload", "module=%p", (void *)module);
  std::lock_guard<std::mutex> l(g_objects_m);
  SG_CHECK(g_modules.erase((Module *)module), CUDA_ERROR_INVALID_HANDLE);
  delete (Module *)module;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuModuleGetFunction(CUfunction *fn, CUmodule module, const char *name) {
  SG_API("cuModuleGetFunction", "name=%s", name ? name : "(null)");
  SG_CHECK(fn && name, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK(known(g_modules, module), CUDA_ERROR_INVALID_HANDLE);
  Module *m = (Module *)module;
  // The kernel must be in the image the library loaded (as a NUL-terminated symbol name) and in
  // the CPU build: the two are built from the same sources, and this keeps them from drifting.
  std::string needle(name, strlen(name) + 1);
  bool in_image = std::search(m->image.begin(), m->image.end(), needle.begin(), needle.end()) !=
                  m->image.end();
  if (!in_image) SG_RET(CUDA_ERROR_NOT_FOUND);
  const softgpu::CpuKernel *k = softgpu::find_cpu_kernel(name);
  if (!k) return call_.refuse(CUDA_ERROR_NOT_FOUND, "the fatbin has this kernel but the CPU build does not");
  auto *f = new Function{k, m};
  std::lock_guard<std::mutex> l(g_objects_m);
  g_functions.insert(f);
  *fn = (CUfunction)f;
  SG_RET(CUDA_SUCCESS);
}

SOFTGPU_EXPORT CUresult cuLaunchKernel(CUfunction fn, unsigned gx, unsigned gy, unsigned gz,
                                       unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                       CUstream h, void **params, void **extra) {
  SG_API("cuLaunchKernel", "grid=%u,%u,%u block=%u,%u,%u shared=%u stream=%p", gx, gy, gz, bx, by,
         bz, shared, (void *)h);
  SG_CHECK(known(g_functions, fn), CUDA_ERROR_INVALID_HANDLE);
  SG_CHECK(gx && gy && gz && bx && by && bz, CUDA_ERROR_INVALID_VALUE);
  SG_CHECK((unsigned long long)bx * by * bz <= 1024 && bz <= 64 && gy <= 65535 && gz <= 65535,
           CUDA_ERROR_INVALID_VALUE);
  if (shared != 0 || extra != nullptr)
    return call_.refuse(CUDA_ERROR_NOT_SUPPORTED,
                        "dynamic shared memory and `extra` arguments are not modelled");
  SG_CHECK(params, CUDA_ERROR_INVALID_VALUE);
  SG_STREAM(h, s);
  if (((Function *)fn)->module->ctx != s->ctx)
    return call_.refuse(CUDA_ERROR_INVALID_HANDLE,
                        "the kernel's module was loaded in another context than the stream's");
  const softgpu::CpuKernel *k = ((Function *)fn)->kernel;
  // The arguments are copied now: the caller may reuse them as soon as the call returns.
  auto blob = std::make_shared<std::vector<unsigned char>>(k->bytes());
  k->pack(params, blob->data());
  dim3 grid(gx, gy, gz), block(bx, by, bz);
  // Adversarial: the kernel's output is published only when it completes (see README).
  bool late = config().adversarial;
  SG_RET(enqueue(s, softgpu::Count::KernelLaunch, 0, [k, blob, grid, block, late] {
    if (late) k->run_published_at_end(blob->data(), grid, block);
    else k->run(blob->data(), grid, block);
  }));
}

// cudarc and the CUDA runtime may look entry points up through the driver; every one this
// stand-in has is exported under its own name, so a look-up by name is a dlsym.
SOFTGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                            cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
  (void)version;
  (void)flags;
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  *pfn = nullptr;
  if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  say("cuGetProcAddress_v2(%s): look-ups through the driver are not modelled", symbol);
  return CUDA_ERROR_NOT_FOUND;
}
