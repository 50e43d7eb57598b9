/* cost_model: ncclGroupSimulateEnd's prediction beside the measured time, per collective and size.
 *
 *   cost_model -n N [-H hosts] [-s "8 65536 4194304"] [-c "allreduce allgather reducescatter"]
 *              [-r reps] [-p]
 *
 * Starts N ranks as processes (fork), each its own simulated host (COMM_HOSTID) unless -H says
 * how many hosts they share (-H 1: one host, shared memory; rank r is on host r * hosts / N),
 * as bench/scale.c does. For each collective and size (bytes of the all-reduce's buffer, of the
 * all-gather's output, of the reduce-scatter's input, as nccl-tests counts them; floats) every
 * rank asks ncclGroupSimulateEnd for the call's estimate, then runs the call: two calls to warm
 * up, then `reps` timed rounds, each of `batch` calls back to back (more for small sizes, so a
 * round is not one clock reading), after an untimed 8-byte all-reduce that lines the ranks up.
 * Rank 0 prints one line per cell:
 *
 *   cell n=N hosts=H coll=allreduce bytes=S pred_us=P meas_us=M min_us=A max_us=B
 *
 * where M is the median over rounds of the time per call, A and B the fastest and slowest round.
 * With -p only the predictions are printed (meas_us=-1): no call runs. Exit status as scale.c's.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

#define MAX_CELLS 64
#define MAX_REPS 64

struct shared {
  volatile int ready;
  ncclUniqueId id;
};

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void die(int rank, const char *what, ncclResult_t r) {
  fprintf(stderr, "cost_model: rank %d: %s failed: %s (%s)\n", rank, what, ncclGetErrorString(r),
          ncclGetLastError(NULL));
  exit(2);
}

#define CHECK(what, call)                       \
  do {                                          \
    ncclResult_t r_ = (call);                   \
    if (r_ != ncclSuccess) die(rank, what, r_); \
  } while (0)

enum coll { ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER };
static const char *coll_names[] = {"allreduce", "allgather", "reducescatter"};

static int parse_coll(const char *w) {
  for (int c = 0; c < 3; c++)
    if (strcmp(w, coll_names[c]) == 0) return c;
  return -1;
}

/* One call of `coll` on `bytes` (nccl-tests' size) over float buffers. */
static ncclResult_t call(int coll, size_t bytes, int n, float *in, float *out, ncclComm_t comm) {
  size_t count = bytes / sizeof(float);
  switch (coll) {
    case ALL_REDUCE: return ncclAllReduce(in, out, count, ncclFloat, ncclSum, comm, NULL);
    case ALL_GATHER: return ncclAllGather(in, out, count / n, ncclFloat, comm, NULL);
    default: return ncclReduceScatter(in, out, count / n, ncclFloat, ncclSum, comm, NULL);
  }
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static int run_rank(struct shared *sh, int rank, int n, int hosts, const size_t *sizes,
                    int nsizes, const int *colls, int ncolls, int reps, int predict_only) {
  char host[64];
  if (hosts > 0)
    snprintf(host, sizeof host, "cost-h%d", (int)((long)rank * hosts / n));
  else
    snprintf(host, sizeof host, "cost-r%d", rank);
  setenv("COMM_HOSTID", host, 1);
  if (rank == 0) {
    CHECK("ncclGetUniqueId", ncclGetUniqueId(&sh->id));
    __atomic_store_n(&sh->ready, 1, __ATOMIC_RELEASE);
  }
  while (!__atomic_load_n(&sh->ready, __ATOMIC_ACQUIRE)) usleep(1000);
  ncclComm_t comm;
  CHECK("ncclCommInitRank", ncclCommInitRank(&comm, n, sh->id, rank));

  size_t most = 0;
  for (int i = 0; i < nsizes; i++)
    if (sizes[i] > most) most = sizes[i];
  float *in = malloc(most + 64), *out = malloc(most + 64);
  if (!in || !out) {
    fprintf(stderr, "cost_model: rank %d: out of memory for %zu bytes\n", rank, most);
    exit(2);
  }
  for (size_t i = 0; i < most / sizeof(float); i++) in[i] = (float)(rank + i % 5);
  memset(out, 0, most);
  double one = 1, sum = 0;
  for (int c = 0; c < ncolls; c++) {
    for (int s = 0; s < nsizes; s++) {
      size_t bytes = sizes[s];
      /* The all-gather and reduce-scatter need a block of at least one float per rank. */
      if (colls[c] != ALL_REDUCE && bytes < (size_t)n * sizeof(float)) continue;
      ncclSimInfo_t info = NCCL_SIM_INFO_INITIALIZER;
      CHECK("ncclGroupStart", ncclGroupStart());
      CHECK(coll_names[colls[c]], call(colls[c], bytes, n, in, out, comm));
      CHECK("ncclGroupSimulateEnd", ncclGroupSimulateEnd(&info));
      double med = -1, lo = -1, hi = -1;
      if (!predict_only) {
        int batch = bytes <= 4096 ? 20 : bytes <= (256 << 10) ? 5 : 1;
        double t[MAX_REPS];
        for (int w = 0; w < 2; w++) CHECK(coll_names[colls[c]], call(colls[c], bytes, n, in, out, comm));
        for (int r = 0; r < reps; r++) {
          CHECK("ncclAllReduce", ncclAllReduce(&one, &sum, 1, ncclDouble, ncclSum, comm, NULL));
          double t0 = now_us();
          for (int b = 0; b < batch; b++)
            CHECK(coll_names[colls[c]], call(colls[c], bytes, n, in, out, comm));
          t[r] = (now_us() - t0) / batch;
        }
        qsort(t, reps, sizeof t[0], cmp_double);
        med = reps % 2 ? t[reps / 2] : (t[reps / 2 - 1] + t[reps / 2]) / 2;
        lo = t[0];
        hi = t[reps - 1];
      }
      if (rank == 0) {
        printf("cell n=%d hosts=%d coll=%s bytes=%zu pred_us=%.2f meas_us=%.2f min_us=%.2f "
               "max_us=%.2f\n",
               n, hosts > 0 ? hosts : n, coll_names[colls[c]], bytes, info.estimatedTime, med,
               lo, hi);
        fflush(stdout);
      }
    }
  }
  CHECK("ncclCommDestroy", ncclCommDestroy(comm));
  free(in);
  free(out);
  return 0;
}

int main(int argc, char **argv) {
  int n = 2, hosts = 0, reps = 5, predict_only = 0, opt;
  const char *size_list = "8 65536 4194304", *coll_list = "allreduce allgather reducescatter";
  while ((opt = getopt(argc, argv, "n:H:s:c:r:p")) != -1) {
    switch (opt) {
      case 'n': n = atoi(optarg); break;
      case 'H': hosts = atoi(optarg); break;
      case 's': size_list = optarg; break;
      case 'c': coll_list = optarg; break;
      case 'r': reps = atoi(optarg); break;
      case 'p': predict_only = 1; break;
      default:
        fprintf(stderr, "usage: %s -n N [-H HOSTS] [-s SIZES] [-c COLLS] [-r REPS] [-p]\n",
                argv[0]);
        return 64;
    }
  }
  size_t sizes[MAX_CELLS];
  int colls[3], nsizes = 0, ncolls = 0;
  char *copy = strdup(size_list), *save = NULL;
  for (char *w = strtok_r(copy, " ,", &save); w && nsizes < MAX_CELLS; w = strtok_r(NULL, " ,", &save))
    sizes[nsizes++] = strtoull(w, NULL, 0);
  copy = strdup(coll_list);
  for (char *w = strtok_r(copy, " ,", &save); w && ncolls < 3; w = strtok_r(NULL, " ,", &save)) {
    int c = parse_coll(w);
    if (c < 0) {
      fprintf(stderr, "cost_model: unknown collective %s (allreduce, allgather, reducescatter)\n", w);
      return 64;
    }
    colls[ncolls++] = c;
  }
  if (n < 1 || hosts < 0 || hosts > n || reps < 1 || reps > MAX_REPS || nsizes == 0) {
    fprintf(stderr, "cost_model: need N >= 1, 0 <= HOSTS <= N, 1 <= REPS <= %d, a size\n", MAX_REPS);
    return 64;
  }
  for (int i = 0; i < nsizes; i++)
    if (sizes[i] < sizeof(float) || sizes[i] % sizeof(float)) {
      fprintf(stderr, "cost_model: size %zu is not a positive multiple of 4 bytes\n", sizes[i]);
      return 64;
    }
  struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                           -1, 0);
  if (sh == MAP_FAILED) {
    perror("cost_model: mmap");
    return 1;
  }
  memset(sh, 0, sizeof *sh);
  pid_t *pids = calloc(n, sizeof(pid_t));
  fflush(stdout);
  for (int r = 0; r < n; r++) {
    pid_t p = fork();
    if (p < 0) {
      perror("cost_model: fork");
      for (int i = 0; i < r; i++) kill(pids[i], SIGKILL);
      return 1;
    }
    if (p == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      _exit(run_rank(sh, r, n, hosts, sizes, nsizes, colls, ncolls, reps, predict_only));
    }
    pids[r] = p;
  }
  int failed = 0;
  for (int left = n; left > 0; left--) {
    int st;
    pid_t p = wait(&st);
    if (p < 0) break;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      if (!failed) {
        fprintf(stderr, "cost_model: a rank failed (status %#x); stopping the others\n", st);
        for (int i = 0; i < n; i++)
          if (pids[i] != p) kill(pids[i], SIGKILL);
      }
      failed = 1;
    }
  }
  return failed;
}
