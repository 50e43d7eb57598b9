/* The CUDA runtime, opened at run time so that the benchmarks build and run without CUDA.
 *
 * Only functions whose signatures have not changed across CUDA 11-13 are used. The device
 * name comes from the driver's cuDeviceGetName: cudaDeviceProp's layout changes between
 * runtime versions, so reading its name field through a struct compiled here would be wrong
 * for some of them. */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include "harness.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

bench_cuda bench_cu;

static void* open_first(const char* const* names, char* tried, size_t len) {
  for (int i = 0; names[i]; i++) {
    void* h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    size_t used = strlen(tried);
    snprintf(tried + used, len - used, "%s%s", used ? ", " : "", names[i]);
  }
  return NULL;
}

int bench_cuda_load(char* why, size_t len) {
  static const char* const rt_names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so", NULL};
  static const char* const drv_names[] = {"libcuda.so.1", "libcuda.so", NULL};
  char tried[512] = "";
  void* rt = open_first(rt_names, tried, sizeof tried);
  if (!rt) {
    snprintf(why, len, "no CUDA runtime could be loaded (tried %s)", tried);
    return -1;
  }
  struct {
    void** slot;
    const char* name;
  } rt_syms[] = {
      {(void**)&bench_cu.GetDeviceCount, "cudaGetDeviceCount"},
      {(void**)&bench_cu.SetDevice, "cudaSetDevice"},
      {(void**)&bench_cu.Malloc, "cudaMalloc"},
      {(void**)&bench_cu.Free, "cudaFree"},
      {(void**)&bench_cu.Memcpy, "cudaMemcpy"},
      {(void**)&bench_cu.StreamCreateWithFlags, "cudaStreamCreateWithFlags"},
      {(void**)&bench_cu.StreamDestroy, "cudaStreamDestroy"},
      {(void**)&bench_cu.StreamSynchronize, "cudaStreamSynchronize"},
      {(void**)&bench_cu.DeviceGetPCIBusId, "cudaDeviceGetPCIBusId"},
      {(void**)&bench_cu.GetErrorString, "cudaGetErrorString"},
  };
  for (size_t i = 0; i < sizeof rt_syms / sizeof rt_syms[0]; i++) {
    *rt_syms[i].slot = dlsym(rt, rt_syms[i].name);
    if (!*rt_syms[i].slot) {
      snprintf(why, len, "the CUDA runtime lacks %s", rt_syms[i].name);
      return -1;
    }
  }
  *(void**)&bench_cu.MemGetInfo = dlsym(rt, "cudaMemGetInfo");

  tried[0] = 0;
  void* drv = open_first(drv_names, tried, sizeof tried);
  if (!drv) {
    snprintf(why, len, "no CUDA driver could be loaded (tried %s)", tried);
    return -1;
  }
  *(void**)&bench_cu.cuInit = dlsym(drv, "cuInit");
  *(void**)&bench_cu.cuDeviceGet = dlsym(drv, "cuDeviceGet");
  *(void**)&bench_cu.cuDeviceGetName = dlsym(drv, "cuDeviceGetName");
  if (!bench_cu.cuInit || !bench_cu.cuDeviceGet || !bench_cu.cuDeviceGetName) {
    snprintf(why, len, "the CUDA driver lacks cuInit/cuDeviceGet/cuDeviceGetName");
    return -1;
  }
  /* In the process's global scope when something loaded the stand-in so; else in the driver
   * opened here (RTLD_LOCAL). A real driver has neither. */
  *(void**)&bench_cu.softgpu_counters = dlsym(RTLD_DEFAULT, "softgpu_counters");
  if (!bench_cu.softgpu_counters) *(void**)&bench_cu.softgpu_counters = dlsym(drv, "softgpu_counters");

  int count = 0;
  int err = bench_cu.GetDeviceCount(&count);
  if (err != 0) {
    snprintf(why, len, "cudaGetDeviceCount failed: %s", bench_cu.GetErrorString(err));
    return -1;
  }
  if (count == 0) {
    snprintf(why, len, "no CUDA device is visible");
    return -1;
  }
  return count;
}

void bench_cuda_describe(int dev, unsigned* domain, unsigned* bus, unsigned* device, char* name,
                         size_t len) {
  char pci[64] = "";
  *domain = *bus = *device = 0;
  if (bench_cu.DeviceGetPCIBusId(pci, sizeof pci, dev) == 0) sscanf(pci, "%x:%x:%x", domain, bus, device);
  snprintf(name, len, "CUDA device %d", dev);
  int cudev;
  if (bench_cu.cuInit(0) == 0 && bench_cu.cuDeviceGet(&cudev, dev) == 0)
    bench_cu.cuDeviceGetName(name, (int)len, cudev);
}

int bench_cuda_upload(int dev, void* dst, const void* src, size_t n) {
  int e = bench_cu.SetDevice(dev);
  if (e == 0) e = bench_cu.Memcpy(dst, src, n, BENCH_H2D);
  if (e == 0) e = bench_cu.StreamSynchronize(NULL);
  return e;
}

int bench_cuda_sync(int dev, cudaStream_t s) {
  int e = s ? 0 : bench_cu.SetDevice(dev);
  return e ? e : bench_cu.StreamSynchronize(s);
}
