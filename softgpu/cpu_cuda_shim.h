// What nvcc provides and a host compiler lacks, for building kernels/*.cu as CPU code: the
// `__noinline__` keyword and the four built-in index variables. Everything else (the
// __global__/__device__ qualifiers, vector types, the fp16/bf16 host intrinsics) comes from
// the CUDA headers themselves. The index variables are thread-local: each stream's worker
// thread runs its own launches.
#ifndef SOFTGPU_CPU_CUDA_SHIM_H
#define SOFTGPU_CPU_CUDA_SHIM_H

#include <cstdint>
#include <cstring>
#include <vector_types.h>

#ifndef __noinline__
#define __noinline__ __attribute__((noinline))
#endif

extern thread_local uint3 threadIdx, blockIdx;
extern thread_local dim3 blockDim, gridDim;

#endif
