// The work streams are given, counted per process: what the device path costs, seen without a
// GPU. SOFTGPU_COUNTS=path appends one line of totals per process at exit; a program reads the
// running totals with softgpu_counters() (found with dlsym in the loaded libcuda).
#include "instrument.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unistd.h>

#define SOFTGPU_EXPORT extern "C" __attribute__((visibility("default")))

// The layout softgpu_counters() fills; version 1. Fields in the order of softgpu::Count.
struct softgpu_counters {
  uint64_t version;          // 1
  uint64_t kernel_launches;  // cuLaunchKernel
  uint64_t write_values;     // cuStreamWriteValue32/64
  uint64_t wait_values;      // cuStreamWaitValue32
  uint64_t copies;           // cuMemcpyAsync, cuMemcpy, cuMemcpyHtoD/DtoH
  uint64_t memsets;          // cuMemsetD8Async/D32Async
  uint64_t host_funcs;       // cuLaunchHostFunc
  uint64_t event_records;    // cuEventRecord
  uint64_t event_waits;      // cuStreamWaitEvent
  uint64_t graph_launches;   // cuGraphLaunch
  uint64_t copy_bytes;       // bytes of all copies
  uint64_t captured;         // operations recorded into graphs (not run at capture)
  uint64_t copy_sizes[40];   // copies of [2^(i-1), 2^i) bytes; [0] holds empty copies
};

namespace softgpu {
namespace {

constexpr int kKinds = (int)Count::kCount;
const char *const kCountNames[kKinds] = {"kernels",     "write_values", "wait_values",
                                         "copies",      "memsets",      "host_funcs",
                                         "event_records", "event_waits", "graph_launches"};

std::atomic<uint64_t> g_n[kKinds];
std::atomic<uint64_t> g_copy_bytes{0};
std::atomic<uint64_t> g_captured{0};
std::atomic<uint64_t> g_copy_sizes[40];

int size_bucket(uint64_t bytes) {
  int b = 0;
  while (bytes && b < 39) {
    bytes >>= 1;
    ++b;
  }
  return b;
}

void write_totals() {
  const char *path = getenv("SOFTGPU_COUNTS");
  if (!path || !*path) return;
  FILE *f = fopen(path, "a");
  if (!f) return;
  std::string line = "pid=" + std::to_string(getpid());
  for (int i = 0; i < kKinds; ++i)
    line += std::string(" ") + kCountNames[i] + "=" + std::to_string(g_n[i].load());
  line += " copy_bytes=" + std::to_string(g_copy_bytes.load());
  line += " captured=" + std::to_string(g_captured.load());
  line += "\n";
  // One write, so lines of processes that end together do not interleave.
  fputs(line.c_str(), f);
  fclose(f);
}

void arm_exit_report() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char *path = getenv("SOFTGPU_COUNTS");
    if (path && *path) atexit(write_totals);
  });
}

} // namespace

void count(Count kind, uint64_t bytes, bool captured) {
  arm_exit_report();
  if (captured) {
    g_captured.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  g_n[(int)kind].fetch_add(1, std::memory_order_relaxed);
  if (kind == Count::Copy) {
    g_copy_bytes.fetch_add(bytes, std::memory_order_relaxed);
    g_copy_sizes[size_bucket(bytes)].fetch_add(1, std::memory_order_relaxed);
  }
}

void count_graph_node(GraphCounts &g, Count kind, uint64_t bytes) {
  g.n[(int)kind]++;
  if (kind == Count::Copy) {
    g.copy_bytes += bytes;
    g.copy_sizes[size_bucket(bytes)]++;
  }
}

void count_graph_launch(const GraphCounts &g) {
  arm_exit_report();
  for (int i = 0; i < kKinds; ++i) g_n[i].fetch_add(g.n[i], std::memory_order_relaxed);
  g_copy_bytes.fetch_add(g.copy_bytes, std::memory_order_relaxed);
  for (int i = 0; i < 40; ++i) g_copy_sizes[i].fetch_add(g.copy_sizes[i], std::memory_order_relaxed);
}

} // namespace softgpu

// Copies the running totals of this process into *out (softgpu_counters, version 1). Returns
// 0, or -1 for a null pointer.
SOFTGPU_EXPORT int softgpu_counters(struct softgpu_counters *out) {
  using namespace softgpu;
  if (!out) return -1;
  memset(out, 0, sizeof *out);
  out->version = 1;
  uint64_t *fields = &out->kernel_launches;
  for (int i = 0; i < kKinds; ++i) fields[i] = g_n[i].load();
  out->copy_bytes = g_copy_bytes.load();
  out->captured = g_captured.load();
  for (int i = 0; i < 40; ++i) out->copy_sizes[i] = g_copy_sizes[i].load();
  return 0;
}
