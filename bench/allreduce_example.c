/* all_reduce across several local ranks on host memory, written only against nccl.h.
 *
 *   allreduce_example [nranks [bytes [iterations]]]      (defaults: 4 ranks, 64 MiB, 20)
 *
 * The first process makes the unique id and starts the other ranks as copies of itself (the id
 * travels on their command line), then every rank checks the result and rank 0 prints timings. */
#define _GNU_SOURCE
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call)                                                                       \
  do {                                                                                    \
    ncclResult_t r_ = (call);                                                             \
    if (r_ != ncclSuccess) {                                                              \
      fprintf(stderr, "rank %d: %s: %s\n", rank, #call, ncclGetLastError(NULL));          \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void to_hex(const ncclUniqueId* id, char* out) {
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) sprintf(out + 2 * i, "%02x", (unsigned char)id->internal[i]);
}

static void from_hex(const char* s, ncclUniqueId* id) {
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) {
    unsigned v;
    sscanf(s + 2 * i, "%2x", &v);
    id->internal[i] = (char)v;
  }
}

static int run_rank(int rank, int nranks, ncclUniqueId id, size_t bytes, int iters) {
  size_t count = bytes / sizeof(float);
  float* buf = malloc(count * sizeof(float) + 1);
  float* out = malloc(count * sizeof(float) + 1);
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  for (size_t i = 0; i < count; i++) buf[i] = (float)(rank + 1) + (float)(i % 7);

  CHECK(ncclAllReduce(buf, out, count, ncclFloat, ncclSum, comm, NULL)); /* warm-up */
  double best = 1e30, total = 0;
  for (int it = 0; it < iters; it++) {
    double t = now();
    CHECK(ncclAllReduce(buf, out, count, ncclFloat, ncclSum, comm, NULL));
    t = now() - t;
    total += t;
    if (t < best) best = t;
  }
  size_t wrong = 0;
  for (size_t i = 0; i < count; i++) {
    float want = nranks * (nranks + 1) / 2.0f + nranks * (float)(i % 7);
    if (out[i] != want) wrong++;
  }
  /* Everyone's count of wrong elements, summed. */
  double w = (double)wrong, wsum = 0;
  CHECK(ncclAllReduce(&w, &wsum, 1, ncclDouble, ncclSum, comm, NULL));
  if (rank == 0) {
    double avg = total / iters;
    double busbw = bytes / avg * 2.0 * (nranks - 1) / nranks / 1e9;
    printf("all_reduce float sum: %d ranks, %zu bytes, %d iterations\n", nranks, bytes, iters);
    printf("  average %.1f us, best %.1f us, bus bandwidth %.2f GB/s (average)\n", avg * 1e6, best * 1e6, busbw);
    printf("  wrong elements: %.0f %s\n", wsum, wsum == 0 ? "OK" : "FAILED");
  }
  CHECK(ncclCommDestroy(comm));
  free(buf);
  free(out);
  return wsum == 0 ? 0 : 2;
}

int main(int argc, char** argv) {
  int rank = 0;
  if (argc > 1 && strcmp(argv[1], "--rank") == 0) {
    /* A started rank: --rank R NRANKS BYTES ITERS IDHEX */
    ncclUniqueId id;
    rank = atoi(argv[2]);
    from_hex(argv[6], &id);
    return run_rank(rank, atoi(argv[3]), id, strtoull(argv[4], NULL, 10), atoi(argv[5]));
  }
  int nranks = argc > 1 ? atoi(argv[1]) : 4;
  size_t bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)64 << 20;
  int iters = argc > 3 ? atoi(argv[3]) : 20;
  if (nranks < 1 || iters < 1) {
    fprintf(stderr, "usage: %s [nranks [bytes [iterations]]]\n", argv[0]);
    return 1;
  }
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  char hex[2 * NCCL_UNIQUE_ID_BYTES + 1];
  to_hex(&id, hex);
  char r[16], n[16], b[32], it[16];
  snprintf(n, sizeof n, "%d", nranks);
  snprintf(b, sizeof b, "%zu", bytes);
  snprintf(it, sizeof it, "%d", iters);
  pid_t* kids = calloc(nranks, sizeof(pid_t));
  for (int i = 1; i < nranks; i++) {
    snprintf(r, sizeof r, "%d", i);
    kids[i] = fork();
    if (kids[i] == 0) {
      execl("/proc/self/exe", argv[0], "--rank", r, n, b, it, hex, (char*)NULL);
      perror("execl");
      _exit(127);
    }
  }
  int status = run_rank(0, nranks, id, bytes, iters);
  for (int i = 1; i < nranks; i++) {
    int st = 0;
    waitpid(kids[i], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) status = status ? status : 3;
  }
  free(kids);
  return status;
}
