/* An application written against NVIDIA's own nccl.h and the CUDA driver API, as a user of NCCL
 * would write it, run over comm (libnccl.so.2) and checked element by element:
 *
 *   1. device memory from cuMemAlloc, a non-blocking stream from cuStreamCreate;
 *   2. collectives enqueued on that stream: all-reduce (in and out of place), all-gather,
 *      reduce-scatter, broadcast;
 *   3. one group of ncclSend/ncclRecv: every rank sends to both ring neighbours and receives
 *      from both;
 *   4. an all-reduce captured into a CUDA graph on the non-blocking stream, replayed three times
 *      with new inputs.
 *
 *   nccl_driver_example RANK NRANKS ID_FILE
 *
 * Rank 0 writes the unique id to ID_FILE (written to a temporary name, then renamed); the others
 * wait up to 60 s for it. The GPU is RANK modulo the device count, so several ranks may share
 * one. Exit status 0 when every element of every result is right, 1 otherwise (the first wrong
 * element of each check is printed). scripts/test_cuda_example.sh runs it as 2 and 3 processes
 * on the software GPU. */
#define _POSIX_C_SOURCE 200809L
#include <cuda.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int g_rank;

#define CU(call)                                                                  \
  do {                                                                            \
    CUresult r_ = (call);                                                         \
    if (r_ != CUDA_SUCCESS) {                                                     \
      const char* n_ = NULL;                                                      \
      cuGetErrorName(r_, &n_);                                                    \
      fprintf(stderr, "rank %d: %s failed: %s (%s:%d)\n", g_rank, #call,          \
              n_ ? n_ : "?", __FILE__, __LINE__);                                 \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

#define NC(comm, call)                                                            \
  do {                                                                            \
    ncclResult_t r_ = (call);                                                     \
    if (r_ != ncclSuccess) {                                                      \
      fprintf(stderr, "rank %d: %s failed: %s / %s (%s:%d)\n", g_rank, #call,     \
              ncclGetErrorString(r_), ncclGetLastError(comm), __FILE__, __LINE__); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

static void exchange_id(ncclUniqueId* id, int rank, const char* path) {
  if (rank == 0) {
    NC(NULL, ncclGetUniqueId(id));
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) {
      perror("writing the unique id");
      exit(1);
    }
    return;
  }
  for (int waited_ms = 0; waited_ms < 60000; waited_ms += 10) {
    FILE* f = fopen(path, "rb");
    if (f) {
      size_t got = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (got == 1) return;
    }
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  fprintf(stderr, "rank %d: no unique id appeared in %s within 60 s\n", rank, path);
  exit(1);
}

static int failures;

/* Compares n floats of device memory with the expected values; names the first wrong one. */
static void check(const char* what, CUstream stream, CUdeviceptr d, const float* want, size_t n) {
  CU(cuStreamSynchronize(stream));
  float* got = malloc(n * sizeof(float));
  CU(cuMemcpyDtoH(got, d, n * sizeof(float)));
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < n; i++)
    if (got[i] != want[i] && wrong++ == 0) first = i;
  if (wrong) {
    fprintf(stderr, "rank %d: %s: %zu of %zu elements wrong; first at %zu: %g, expected %g\n", g_rank,
            what, wrong, n, first, got[first], want[first]);
    failures++;
  } else {
    printf("rank %d: %s: %zu elements right\n", g_rank, what, n);
  }
  free(got);
}

/* Inputs go in on the collectives' own stream. (A synchronous cuMemcpyHtoD from pageable memory
 * may return before the data lands, and a non-blocking stream is not ordered after it.) The
 * source is pageable, so CUDA has staged it when the call returns and it may be reused. */
static void upload(CUstream stream, CUdeviceptr d, const float* host, size_t bytes) {
  CU(cuMemcpyAsync(d, (CUdeviceptr)(uintptr_t)host, bytes, stream));
}

/* The value rank r contributes at element i in round k: small integers, exact in float. */
static float value(int r, size_t i, int k) { return (float)((r + 1) * 10 + (int)(i % 97) + k * 1000); }

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s RANK NRANKS ID_FILE\n", argv[0]);
    return 2;
  }
  int rank = atoi(argv[1]), nranks = atoi(argv[2]);
  g_rank = rank;
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    fprintf(stderr, "bad rank %d of %d\n", rank, nranks);
    return 2;
  }

  CU(cuInit(0));
  int ndev = 0;
  CU(cuDeviceGetCount(&ndev));
  CUdevice dev;
  CU(cuDeviceGet(&dev, rank % ndev));
  CUcontext ctx;
  CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cuCtxSetCurrent(ctx));
  CUstream stream;
  CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

  ncclUniqueId id;
  exchange_id(&id, rank, argv[3]);
  ncclComm_t comm;
  NC(NULL, ncclCommInitRank(&comm, nranks, id, rank));
  int cudev = -1;
  NC(comm, ncclCommCuDevice(comm, &cudev));
  if (cudev != rank % ndev) {
    fprintf(stderr, "rank %d: the communicator is on GPU %d, not the current GPU %d\n", rank, cudev,
            rank % ndev);
    failures++;
  }

  const size_t count = 3000; /* not a multiple of anything in particular */
  const size_t bytes = count * sizeof(float), all = count * (size_t)nranks;
  CUdeviceptr send, recv, big;
  CU(cuMemAlloc(&send, bytes));
  CU(cuMemAlloc(&recv, bytes));
  CU(cuMemAlloc(&big, all * sizeof(float)));
  float* host = malloc(all * sizeof(float));
  float* want = malloc(all * sizeof(float));

  /* 1. All-reduce, out of place then in place. */
  for (size_t i = 0; i < count; i++) host[i] = value(rank, i, 0);
  upload(stream, send, host, bytes);
  NC(comm, ncclAllReduce((void*)send, (void*)recv, count, ncclFloat32, ncclSum, comm, (cudaStream_t)stream));
  for (size_t i = 0; i < count; i++) {
    want[i] = 0;
    for (int r = 0; r < nranks; r++) want[i] += value(r, i, 0);
  }
  check("all-reduce sum (out of place)", stream, recv, want, count);
  NC(comm, ncclAllReduce((void*)send, (void*)send, count, ncclFloat32, ncclMax, comm, (cudaStream_t)stream));
  for (size_t i = 0; i < count; i++) want[i] = value(nranks - 1, i, 0);
  check("all-reduce max (in place)", stream, send, want, count);

  /* 2. All-gather, reduce-scatter, broadcast. */
  for (size_t i = 0; i < count; i++) host[i] = value(rank, i, 1);
  upload(stream, send, host, bytes);
  NC(comm, ncclAllGather((void*)send, (void*)big, count, ncclFloat32, comm, (cudaStream_t)stream));
  for (int r = 0; r < nranks; r++)
    for (size_t i = 0; i < count; i++) want[(size_t)r * count + i] = value(r, i, 1);
  check("all-gather", stream, big, want, all);

  for (size_t i = 0; i < all; i++) host[i] = value(rank, i, 2);
  upload(stream, big, host, all * sizeof(float));
  NC(comm, ncclReduceScatter((void*)big, (void*)recv, count, ncclFloat32, ncclSum, comm, (cudaStream_t)stream));
  for (size_t i = 0; i < count; i++) {
    want[i] = 0;
    for (int r = 0; r < nranks; r++) want[i] += value(r, (size_t)rank * count + i, 2);
  }
  check("reduce-scatter sum", stream, recv, want, count);

  int root = nranks - 1;
  for (size_t i = 0; i < count; i++) host[i] = value(rank, i, 3);
  upload(stream, send, host, bytes);
  NC(comm, ncclBroadcast((void*)send, (void*)recv, count, ncclFloat32, root, comm, (cudaStream_t)stream));
  for (size_t i = 0; i < count; i++) want[i] = value(root, i, 3);
  check("broadcast", stream, recv, want, count);

  /* 3. One group of sends and receives: to and from both ring neighbours. The halves of `big`
   * receive from the left and from the right neighbour. */
  int right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
  for (size_t i = 0; i < count; i++) host[i] = value(rank, i, 4);
  upload(stream, send, host, bytes);
  CU(cuMemsetD32Async(big, 0, 2 * count, stream));
  NC(comm, ncclGroupStart());
  NC(comm, ncclSend((void*)send, count, ncclFloat32, right, comm, (cudaStream_t)stream));
  NC(comm, ncclRecv((void*)big, count, ncclFloat32, left, comm, (cudaStream_t)stream));
  NC(comm, ncclSend((void*)send, count, ncclFloat32, left, comm, (cudaStream_t)stream));
  NC(comm, ncclRecv((void*)(big + bytes), count, ncclFloat32, right, comm, (cudaStream_t)stream));
  NC(comm, ncclGroupEnd());
  for (size_t i = 0; i < count; i++) {
    want[i] = value(left, i, 4);
    want[count + i] = value(right, i, 4);
  }
  check("grouped send/recv with both neighbours", stream, big, want, 2 * count);

  /* 4. An all-reduce captured into a graph on the non-blocking stream, replayed with new inputs
   * copied in on the same stream before each launch. */
  CU(cuStreamSynchronize(stream));
  CU(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
  NC(comm, ncclAllReduce((void*)send, (void*)recv, count, ncclFloat32, ncclSum, comm, (cudaStream_t)stream));
  CUgraph graph;
  CU(cuStreamEndCapture(stream, &graph));
  CUgraphExec exec;
  CU(cuGraphInstantiate(&exec, graph, 0));
  for (int k = 0; k < 3; k++) {
    for (size_t i = 0; i < count; i++) host[i] = value(rank, i, 10 + k);
    upload(stream, send, host, bytes);
    CU(cuGraphLaunch(exec, stream));
    for (size_t i = 0; i < count; i++) {
      want[i] = 0;
      for (int r = 0; r < nranks; r++) want[i] += value(r, i, 10 + k);
    }
    char what[64];
    snprintf(what, sizeof what, "graph replay %d of an all-reduce", k + 1);
    check(what, stream, recv, want, count);
  }
  CU(cuGraphExecDestroy(exec));
  CU(cuGraphDestroy(graph));

  NC(comm, ncclCommFinalize(comm));
  NC(comm, ncclCommDestroy(comm));
  CU(cuMemFree(send));
  CU(cuMemFree(recv));
  CU(cuMemFree(big));
  CU(cuStreamDestroy(stream));
  CU(cuDevicePrimaryCtxRelease(dev));
  free(host);
  free(want);
  if (failures) {
    fprintf(stderr, "rank %d: %d checks FAILED\n", rank, failures);
    return 1;
  }
  printf("rank %d of %d: every check passed\n", rank, nranks);
  return 0;
}
