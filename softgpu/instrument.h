// What the stand-in counts and what it fails on request: the device path's cost seen without a
// GPU (SOFTGPU_COUNTS, softgpu_counters) and failures injected into chosen driver calls
// (SOFTGPU_FAIL, softgpu_fail_call). See softgpu/README.md.
#ifndef SOFTGPU_INSTRUMENT_H
#define SOFTGPU_INSTRUMENT_H

#include <cstddef>
#include <cstdint>

namespace softgpu {

// Kinds of work a stream is given. Keep in step with kCountNames in counts.cpp and with
// struct softgpu_counters below.
enum class Count {
  KernelLaunch,  // cuLaunchKernel
  WriteValue,    // cuStreamWriteValue32/64
  WaitValue,     // cuStreamWaitValue32
  Copy,          // cuMemcpyAsync and the synchronous copies
  Memset,        // cuMemsetD8Async/D32Async
  HostFunc,      // cuLaunchHostFunc
  EventRecord,   // cuEventRecord
  EventWait,     // cuStreamWaitEvent
  GraphLaunch,   // cuGraphLaunch (its nodes are counted as they were captured, once per launch)
  kCount
};

// One operation of `kind` (a copy: of `bytes`) was given to a stream, or, when `captured`, was
// recorded into a graph (counted separately, and again at every launch of the graph).
void count(Count kind, uint64_t bytes = 0, bool captured = false);

// Counts of a graph's nodes, added again at each launch.
struct GraphCounts {
  uint64_t n[(int)Count::kCount] = {0};
  uint64_t copy_bytes = 0;
  uint64_t copy_sizes[40] = {0};
};
void count_graph_node(GraphCounts &g, Count kind, uint64_t bytes);
void count_graph_launch(const GraphCounts &g);

// Whether this call of `name` (a driver entry point, e.g. "cuMemAlloc_v2") is one that was asked
// to fail (SOFTGPU_FAIL=name:N,... or softgpu_fail_call). Counts the call.
bool fail_now(const char *name);

} // namespace softgpu

#endif
