// The kernels of kernels/*.cu, unchanged, compiled for the CPU, and a table that lets the
// driver look them up by name and launch them.
//
// A launch copies the kernel's arguments into a blob (as the driver copies them at
// cuLaunchKernel) and later runs every block and every thread of the grid one after another on
// the stream's worker thread. That is exact for these kernels: they use no shared memory, no
// __syncthreads, no warp functions and no atomics, and each element is read and written by one
// thread only (see kernels/README.md).
#include "cpu_cuda_shim.h"

#include "../kernels/fill.cu"
#include "../kernels/reduce.cu"

#include "kernels_cpu.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <tuple>
#include <utility>

thread_local uint3 threadIdx, blockIdx;
thread_local dim3 blockDim, gridDim;

namespace softgpu {

namespace {

// The signature of a kernel, taken apart: its argument types, their sizes and offsets in a blob,
// and a call that unpacks a blob into them.
template <class F> struct Signature;
template <class... A> struct Signature<void (*)(A...)> {
  static constexpr size_t count = sizeof...(A);

  static size_t offset_of(size_t i) {
    const size_t sizes[] = {sizeof(A)..., 0};
    const size_t aligns[] = {alignof(A)..., 1};
    size_t at = 0;
    for (size_t k = 0;; ++k) {
      at = (at + aligns[k] - 1) / aligns[k] * aligns[k];
      if (k == i) return at;
      at += sizes[k];
    }
  }
  static size_t blob_bytes() { return offset_of(count) + 16; }

  static void pack(void **params, unsigned char *blob) {
    const size_t sizes[] = {sizeof(A)..., 0};
    for (size_t i = 0; i < count; ++i) memcpy(blob + offset_of(i), params[i], sizes[i]);
  }

  template <size_t... I>
  static void call(void (*f)(A...), const unsigned char *blob, std::index_sequence<I...>) {
    f(*reinterpret_cast<const A *>(blob + offset_of(I))...);
  }
};

template <auto F> struct Kernel {
  using Sig = Signature<decltype(F)>;
  static void pack(void **params, unsigned char *blob) { Sig::pack(params, blob); }
  static size_t bytes() { return Sig::blob_bytes(); }
  static void run(const unsigned char *blob, dim3 grid, dim3 block) {
    gridDim = grid;
    blockDim = block;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = uint3{x, y, z};
          for (unsigned tz = 0; tz < block.z; ++tz)
            for (unsigned ty = 0; ty < block.y; ++ty)
              for (unsigned tx = 0; tx < block.x; ++tx) {
                threadIdx = uint3{tx, ty, tz};
                Sig::call(F, blob, std::make_index_sequence<Sig::count>());
              }
        }
  }
};

// Element sizes of the datatypes in kernel names.
constexpr size_t kBytes_i8 = 1, kBytes_u8 = 1, kBytes_e4m3 = 1, kBytes_e5m2 = 1, kBytes_f16 = 2,
                 kBytes_bf16 = 2, kBytes_i32 = 4, kBytes_u32 = 4, kBytes_f32 = 4, kBytes_i64 = 8,
                 kBytes_u64 = 8, kBytes_f64 = 8;

// A reduce kernel whose output is published only when it completes. On a GPU, nothing orders a
// kernel's stores as another agent sees them until the kernel is done and the stream's next
// release (a flag write, an event) publishes them: a consumer that looks at the destination
// before the flag may see any mix of old and new bytes. The most a correct consumer can be
// told is "all of it, after completion", and the least an early consumer may see is "none of
// it": the kernel writes into a private copy of its destination (aligned as the destination,
// so the same vector paths run), waits a moment, then copies it into place. Its inputs are
// read while it runs, as on a GPU, so a producer that overwrites them early is caught too.
template <auto F, size_t kElem> struct LateReduce {
  static void run(const unsigned char *blob, dim3 grid, dim3 block) {
    ReduceArgs args;
    memcpy(&args, blob, sizeof args);
    size_t bytes = (size_t)args.count * kElem;
    if (bytes == 0 || !args.dst) {
      Kernel<F>::run(blob, grid, block);
      return;
    }
    uintptr_t dst = (uintptr_t)args.dst;
    unsigned char *raw = (unsigned char *)malloc(bytes + 128);
    if (!raw) abort();
    uintptr_t shadow = ((uintptr_t)raw + 63) / 64 * 64 + dst % 64;
    memcpy((void *)shadow, (const void *)dst, bytes);
    args.dst = (void *)shadow;
    alignas(64) unsigned char copy[sizeof(ReduceArgs) + 64];
    memcpy(copy, blob, Kernel<F>::bytes() < sizeof copy ? Kernel<F>::bytes() : sizeof copy);
    memcpy(copy, &args, sizeof args);
    Kernel<F>::run(copy, grid, block);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    memcpy((void *)dst, (const void *)shadow, bytes);
    free(raw);
  }
};

#define SOFTGPU_KERNEL_ENTRY(T, OP)                                                                \
  {"comm_reduce_" #T "_" #OP, &Kernel<comm_reduce_##T##_##OP>::bytes,                              \
   &Kernel<comm_reduce_##T##_##OP>::pack, &Kernel<comm_reduce_##T##_##OP>::run,                    \
   &LateReduce<comm_reduce_##T##_##OP, kBytes_##T>::run},

const CpuKernel kKernels[] = {
    COMM_FOR_EACH_REDUCE_KERNEL(SOFTGPU_KERNEL_ENTRY)
    // Not launched by comm: its output is published as it is written, in both modes.
    {"comm_fill_u32", &Kernel<comm_fill_u32>::bytes, &Kernel<comm_fill_u32>::pack,
     &Kernel<comm_fill_u32>::run, &Kernel<comm_fill_u32>::run},
};
#undef SOFTGPU_KERNEL_ENTRY

} // namespace

const CpuKernel *find_cpu_kernel(const char *name) {
  for (const CpuKernel &k : kKernels)
    if (strcmp(k.name, name) == 0) return &k;
  return nullptr;
}

size_t cpu_kernel_count() { return sizeof(kKernels) / sizeof(kKernels[0]); }
const CpuKernel &cpu_kernel(size_t i) { return kKernels[i]; }

} // namespace softgpu
