// The CPU build of comm's kernels, as the driver sees it: a table by name.
#ifndef SOFTGPU_KERNELS_CPU_H
#define SOFTGPU_KERNELS_CPU_H

#include <cstddef>
#include <vector_types.h>

namespace softgpu {

struct CpuKernel {
  const char *name;
  // Bytes of the blob that holds a copy of the kernel's arguments.
  size_t (*bytes)();
  // Copies the arguments cuLaunchKernel's kernelParams point at into a blob.
  void (*pack)(void **params, unsigned char *blob);
  // Runs the whole grid on the calling thread, block after block, thread after thread.
  void (*run)(const unsigned char *blob, dim3 grid, dim3 block);
  // The same, but the kernel's output appears all at once when the grid is done, a little
  // while later (adversarial mode): until then its destination holds what it held before.
  void (*run_published_at_end)(const unsigned char *blob, dim3 grid, dim3 block);
};

const CpuKernel *find_cpu_kernel(const char *name);
size_t cpu_kernel_count();
const CpuKernel &cpu_kernel(size_t i);

} // namespace softgpu

#endif
