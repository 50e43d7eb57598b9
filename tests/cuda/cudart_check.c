/* Checks of the CUDA runtime's semantics that the benchmarks and the example rely on: run over
 * softgpu's libcudart.so.13 (scripts/test_softgpu.sh), and meant to pass unchanged over
 * NVIDIA's runtime on a real GPU (the same file, linked against -lcudart -lcuda).
 *
 *   cudart_check        exit 0: every check passed; 1: a check failed (each one is named)
 *
 * With two or more devices it also checks that the device is per thread. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      failures++;                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                       \
      fprintf(stderr, "\n");                              \
    }                                                     \
  } while (0)
#define RT(call)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    CHECK(e_ == cudaSuccess, "%s -> %s (%s)", #call, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
  } while (0)

static void* other_thread(void* arg) {
  int* seen = arg;
  /* A new thread starts on device 0, whatever another thread chose. */
  if (cudaGetDevice(seen) != cudaSuccess) *seen = -1;
  return NULL;
}

int main(void) {
  /* No context is current before the first runtime call that needs one. */
  CUcontext cur = (CUcontext)1;
  int count = 0;
  RT(cudaGetDeviceCount(&count));
  CHECK(count >= 1, "cudaGetDeviceCount gave %d", count);
  CHECK(cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == NULL,
        "a context is current before any runtime call needs one");

  /* The first allocation makes device 0's primary context current; the driver knows the memory. */
  void* d = NULL;
  enum { N = 4096 };
  RT(cudaMalloc(&d, N));
  CUcontext prim = NULL;
  CHECK(cuDevicePrimaryCtxRetain(&prim, 0) == CUDA_SUCCESS, "cuDevicePrimaryCtxRetain(0)");
  CHECK(cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == prim,
        "the runtime did not make device 0's primary context current");
  unsigned type = 0;
  CHECK(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)d) == CUDA_SUCCESS &&
            type == CU_MEMORYTYPE_DEVICE,
        "the driver does not see cudaMalloc's memory as device memory");

  /* Copies and memset, synchronous and on a non-blocking stream. */
  unsigned char host[N], back[N];
  for (int i = 0; i < N; i++) host[i] = (unsigned char)(i * 7 + 1);
  RT(cudaMemcpy(d, host, N, cudaMemcpyHostToDevice));
  memset(back, 0, N);
  RT(cudaMemcpy(back, d, N, cudaMemcpyDeviceToHost));
  CHECK(memcmp(host, back, N) == 0, "cudaMemcpy round trip differs");
  RT(cudaMemset((char*)d + 100, 0xAB, 50));
  RT(cudaDeviceSynchronize());
  RT(cudaMemcpy(back, d, N, cudaMemcpyDefault));
  int bad = 0;
  for (int i = 0; i < N; i++) bad += back[i] != ((i >= 100 && i < 150) ? 0xAB : host[i]);
  CHECK(bad == 0, "cudaMemset: %d bytes wrong", bad);

  cudaStream_t s;
  RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* d2 = NULL;
  RT(cudaMalloc(&d2, N));
  RT(cudaMemsetAsync(d2, 0, N, s));
  RT(cudaMemcpyAsync(d2, d, N / 2, cudaMemcpyDeviceToDevice, s));
  cudaEvent_t ev;
  RT(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  RT(cudaEventRecord(ev, s));
  RT(cudaEventSynchronize(ev));
  RT(cudaEventQuery(ev));
  RT(cudaStreamSynchronize(s));
  RT(cudaStreamQuery(s));
  memset(back, 0xFF, N);
  RT(cudaMemcpy(back, d2, N, cudaMemcpyDeviceToHost));
  bad = 0;
  for (int i = 0; i < N; i++) bad += back[i] != (i < N / 2 ? ((i >= 100 && i < 150) ? 0xAB : host[i]) : 0);
  CHECK(bad == 0, "stream copy after memset: %d bytes wrong", bad);

  /* softgpu's runtime refuses a kind that contradicts the pointers (NVIDIA's, with unified
   * addressing, may not), and the refusal becomes the last error. */
  char name[128] = "";
  CUdevice dev0;
  if (cuDeviceGet(&dev0, 0) == CUDA_SUCCESS) cuDeviceGetName(name, sizeof name, dev0);
  if (strstr(name, "softgpu")) {
    CHECK(cudaMemcpy(back, d, 16, cudaMemcpyHostToDevice) == cudaErrorInvalidValue,
          "a host-to-device copy into host memory was accepted");
    CHECK(cudaGetLastError() == cudaErrorInvalidValue, "the refused copy is not the last error");
  }

  /* Errors are not sticky unless the context is broken: the last error resets once read. */
  CHECK(cudaSetDevice(count + 5) == cudaErrorInvalidDevice, "cudaSetDevice(bad ordinal)");
  CHECK(cudaPeekAtLastError() == cudaErrorInvalidDevice, "cudaPeekAtLastError");
  CHECK(cudaPeekAtLastError() == cudaErrorInvalidDevice, "cudaPeekAtLastError reset the error");
  CHECK(cudaGetLastError() == cudaErrorInvalidDevice, "cudaGetLastError");
  CHECK(cudaGetLastError() == cudaSuccess, "cudaGetLastError did not reset the error");
  RT(cudaMemcpy(back, d, 16, cudaMemcpyDeviceToHost));
  CHECK(strcmp(cudaGetErrorName(cudaErrorInvalidDevice), "cudaErrorInvalidDevice") == 0, "cudaGetErrorName");
  CHECK(strlen(cudaGetErrorString(cudaErrorMemoryAllocation)) > 0, "cudaGetErrorString");
  CHECK(cudaFree(NULL) == cudaSuccess, "cudaFree(NULL)");

  /* Per-thread device, and a context made current through the driver API wins. */
  if (count >= 2) {
    RT(cudaSetDevice(1));
    int dev = -1;
    RT(cudaGetDevice(&dev));
    CHECK(dev == 1, "cudaGetDevice after cudaSetDevice(1) gave %d", dev);
    pthread_t th;
    int seen = -2;
    pthread_create(&th, NULL, other_thread, &seen);
    pthread_join(th, NULL);
    CHECK(seen == 0, "a new thread's device is %d, not 0", seen);
    void* d1 = NULL;
    RT(cudaMalloc(&d1, 64));
    int ord = -1;
    CHECK(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)d1) == CUDA_SUCCESS &&
              ord == 1,
          "memory allocated after cudaSetDevice(1) is on device %d", ord);
    RT(cudaFree(d1));
    CHECK(cuCtxSetCurrent(prim) == CUDA_SUCCESS, "cuCtxSetCurrent(primary of 0)");
    RT(cudaGetDevice(&dev));
    CHECK(dev == 0, "cudaGetDevice ignores the driver's current context (gave %d)", dev);
  }

  RT(cudaEventDestroy(ev));
  RT(cudaStreamDestroy(s));
  RT(cudaFree(d2));
  RT(cudaFree(d));
  size_t free_b = 0, total = 0;
  RT(cudaMemGetInfo(&free_b, &total));
  CHECK(total > 0 && free_b <= total, "cudaMemGetInfo");
  cuDevicePrimaryCtxRelease(0);
  if (failures) {
    fprintf(stderr, "cudart_check: %d checks failed\n", failures);
    return 1;
  }
  printf("cudart_check: all checks passed (%d devices)\n", count);
  return 0;
}
