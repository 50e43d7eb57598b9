/* scale: how init, split and the first collectives grow with the number of ranks.
 *
 *   scale -n N [-r ROOTS] [-H hosts] [-c] [-S] [-p] [-I] [-b BASE:COUNT]
 *
 * Starts N ranks as processes (fork), each its own simulated host (COMM_HOSTID=scale-<rank>)
 * unless -H says how many hosts the ranks share (-H 1: all on one host, shared memory; rank r
 * is on host r * hosts / N). With -r ROOTS > 1 the ranks use ncclCommInitRankScalable with that
 * many unique ids, each made by the first rank of its block (the root service runs in that
 * rank's process, as in a real job); -r 1 uses ncclCommInitRank. The ids travel through a
 * shared anonymous mapping made before the fork.
 *
 * Each rank prints one line: times of init, of a split in two (color = rank % 2), of the first
 * and the tenth 8-byte all-reduce, then its peak descriptors (/proc/self/fd), threads and peak
 * RSS (VmHWM, KiB), its sockets and the shared-memory segments it maps, all sampled after the
 * tenth all-reduce, then the CPU time its process spent in init (every thread) and when init
 * began and ended (CLOCK_MONOTONIC, ms: the job's init runs from the first start to the last
 * end, forks of late ranks included). With -c every collective runs once with small counts and its result is
 * checked ("check ok" or "check FAILED" in the line). -S skips the split (a job of one
 * communicator and all-reduces only); -p replaces the all-reduces with a send/recv between
 * ranks 2k and 2k+1 (N even; no split), a job in which each rank talks to one peer; -I runs
 * init and destroy only (no split, no collective: a profile of init alone). The line
 * also carries the rank's pid, which the library's log lines name. scripts/scale_bench.sh
 * aggregates the lines.
 *
 * With -b BASE:COUNT this process starts only ranks BASE .. BASE+COUNT-1 of the N; the others
 * run in other processes (scripts/scale_netns.sh starts one per network namespace, each a real
 * simulated host). The host is then the namespace (no COMM_HOSTID), and the unique id comes
 * from NCCL_COMM_ID=host:port, which every rank derives on its own and whose root rank 0
 * starts (one root only).
 *
 * The parent exits 0 when every child did; a child that fails or dies makes the parent kill
 * the others and exit 1.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

#define MAX_ROOTS 64

struct shared {
  volatile int ready[MAX_ROOTS];
  ncclUniqueId ids[MAX_ROOTS];
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* CPU time of this process (every thread: the library's service and progress threads too). */
static double cpu_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void die(int rank, const char *what, ncclResult_t r) {
  fprintf(stderr, "scale: rank %d: %s failed: %s\n", rank, what, ncclGetErrorString(r));
  exit(2);
}

#define CHECK(what, call)                  \
  do {                                     \
    ncclResult_t r_ = (call);              \
    if (r_ != ncclSuccess) die(rank, what, r_); \
  } while (0)

/* Shared-memory segments mapped now (this rank's own and its peers', of both communicators):
 * the library names each segment's memfd comm-shm-r<rank>. */
static int count_segments(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[512];
  int segs = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, "/memfd:comm-shm-r")) segs++;
  fclose(f);
  return segs;
}

/* Descriptors and sockets open now. */
static void count_fds(int *fds, int *sockets) {
  *fds = 0;
  *sockets = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return;
  struct dirent *e;
  char path[300], target[64];
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    (*fds)++;
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n > 0) {
      target[n] = 0;
      if (strncmp(target, "socket:", 7) == 0) (*sockets)++;
    }
  }
  closedir(d);
  (*fds)--; /* the directory itself */
}

static long status_field(const char *name) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long v = -1;
  size_t len = strlen(name);
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, name, len) == 0 && line[len] == ':') {
      v = strtol(line + len + 1, NULL, 10);
      break;
    }
  }
  fclose(f);
  return v;
}

/* Every collective once with small counts; returns the number of wrong elements. */
static long check_all(ncclComm_t comm, int rank, int n) {
  long bad = 0;
  const int c = 4;
  float *in = calloc((size_t)c * n, sizeof(float));
  float *out = calloc((size_t)c * n, sizeof(float));
  for (int i = 0; i < c * n; i++) in[i] = (float)(rank + 1) + i % 7;

  /* all-reduce: sum over ranks of (r + 1) + i % 7 */
  CHECK("ncclAllReduce", ncclAllReduce(in, out, c, ncclFloat, ncclSum, comm, NULL));
  for (int i = 0; i < c; i++)
    if (out[i] != (float)n * (n + 1) / 2 + (float)n * (i % 7)) bad++;
  /* broadcast from the last rank */
  CHECK("ncclBroadcast", ncclBroadcast(in, out, c, ncclFloat, n - 1, comm, NULL));
  for (int i = 0; i < c; i++)
    if (out[i] != (float)n + i % 7) bad++;
  /* reduce (max) to rank 0 */
  CHECK("ncclReduce", ncclReduce(in, out, c, ncclFloat, ncclMax, 0, comm, NULL));
  if (rank == 0)
    for (int i = 0; i < c; i++)
      if (out[i] != (float)n + i % 7) bad++;
  /* all-gather */
  CHECK("ncclAllGather", ncclAllGather(in, out, c, ncclFloat, comm, NULL));
  for (int r = 0; r < n; r++)
    for (int i = 0; i < c; i++)
      if (out[r * c + i] != (float)(r + 1) + i % 7) bad++;
  /* reduce-scatter: element j of the full vector is sum (r + 1) + j % 7 */
  CHECK("ncclReduceScatter", ncclReduceScatter(in, out, c, ncclFloat, ncclSum, comm, NULL));
  for (int i = 0; i < c; i++)
    if (out[i] != (float)n * (n + 1) / 2 + (float)n * ((rank * c + i) % 7)) bad++;
  /* all-to-all by send/recv: block r of rank s's output is rank r's block s */
  CHECK("ncclGroupStart", ncclGroupStart());
  for (int r = 0; r < n; r++) {
    CHECK("ncclSend", ncclSend(in + r * c, c, ncclFloat, r, comm, NULL));
    CHECK("ncclRecv", ncclRecv(out + r * c, c, ncclFloat, r, comm, NULL));
  }
  CHECK("ncclGroupEnd", ncclGroupEnd());
  for (int r = 0; r < n; r++)
    for (int i = 0; i < c; i++)
      if (out[r * c + i] != (float)(r + 1) + (rank * c + i) % 7) bad++;
  /* all-to-all: block r of rank s's output is rank r's block s */
  CHECK("ncclAlltoAll", ncclAlltoAll(in, out, c, ncclFloat, comm, NULL));
  for (int r = 0; r < n; r++)
    for (int i = 0; i < c; i++)
      if (out[r * c + i] != (float)(r + 1) + (rank * c + i) % 7) bad++;
  /* gather to the last rank, scatter from rank 0 */
  CHECK("ncclGather", ncclGather(in, out, c, ncclFloat, n - 1, comm, NULL));
  if (rank == n - 1)
    for (int r = 0; r < n; r++)
      for (int i = 0; i < c; i++)
        if (out[r * c + i] != (float)(r + 1) + i % 7) bad++;
  CHECK("ncclScatter", ncclScatter(in, out, c, ncclFloat, 0, comm, NULL));
  for (int i = 0; i < c; i++)
    if (out[i] != 1.0f + (rank * c + i) % 7) bad++;
  /* a ring of send/recv */
  CHECK("ncclGroupStart", ncclGroupStart());
  CHECK("ncclSend", ncclSend(in, c, ncclFloat, (rank + 1) % n, comm, NULL));
  CHECK("ncclRecv", ncclRecv(out, c, ncclFloat, (rank + n - 1) % n, comm, NULL));
  CHECK("ncclGroupEnd", ncclGroupEnd());
  for (int i = 0; i < c; i++)
    if (out[i] != (float)((rank + n - 1) % n + 1) + i % 7) bad++;
  free(in);
  free(out);
  return bad;
}

/* One 8-byte exchange with rank ^ 1: 1 when the peer's value did not arrive. */
static long pair_exchange(ncclComm_t comm, int rank, double *x, double *y) {
  int peer = rank ^ 1;
  *y = -1;
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) r = ncclSend(x, 1, ncclDouble, peer, comm, NULL);
  if (r == ncclSuccess) r = ncclRecv(y, 1, ncclDouble, peer, comm, NULL);
  ncclResult_t e = ncclGroupEnd();
  if (r == ncclSuccess) r = e;
  if (r != ncclSuccess) die(rank, "send/recv with the pair's other rank", r);
  return *y != (double)peer;
}

static int run_rank(struct shared *sh, int rank, int n, int nroots, int hosts, int check,
                    int split, int pairs, int external, int init_only) {
  char host[64];
  ncclUniqueId own;
  ncclUniqueId *ids = sh->ids;
  if (external) {
    /* The namespace is the host; the id comes from NCCL_COMM_ID (see the top). */
    CHECK("ncclGetUniqueId", ncclGetUniqueId(&own));
    ids = &own;
  } else if (hosts > 0)
    snprintf(host, sizeof host, "scale-h%d", (int)((long)rank * hosts / n));
  else
    snprintf(host, sizeof host, "scale-r%d", rank);
  if (!external) setenv("COMM_HOSTID", host, 1);

  /* Block b of the ranks checks in with root b, which its first rank makes (as the library
   * assigns them: rank r to root r * nroots / n). */
  int my_root = (int)((long)rank * nroots / n);
  int first = (int)(((long)my_root * n + nroots - 1) / nroots);
  if (rank == first && !external) {
    CHECK("ncclGetUniqueId", ncclGetUniqueId(&sh->ids[my_root]));
    __atomic_store_n(&sh->ready[my_root], 1, __ATOMIC_RELEASE);
  }
  for (int b = 0; b < nroots && !external; b++)
    while (!__atomic_load_n(&sh->ready[b], __ATOMIC_ACQUIRE)) usleep(1000);

  ncclComm_t comm;
  double c0 = cpu_ms();
  double t0 = now_ms(), init_start = t0;
  if (nroots == 1) {
    CHECK("ncclCommInitRank", ncclCommInitRank(&comm, n, ids[0], rank));
  } else {
    CHECK("ncclCommInitRankScalable",
          ncclCommInitRankScalable(&comm, n, rank, nroots, ids, NULL));
  }
  double init_end = now_ms(), t_init = init_end - t0, c_init = cpu_ms() - c0;

  double x = rank, y = 0;
  double want = (double)n * (n - 1) / 2;
  long bad = 0;
  double t_first = 0, t_tenth = 0;
  for (int i = 1; i <= 10 && !init_only; i++) {
    t0 = now_ms();
    if (pairs) {
      bad += pair_exchange(comm, rank, &x, &y);
    } else {
      CHECK("ncclAllReduce", ncclAllReduce(&x, &y, 1, ncclDouble, ncclSum, comm, NULL));
      bad += y != want;
    }
    if (i == 1) t_first = now_ms() - t0;
    if (i == 10) t_tenth = now_ms() - t0;
  }

  ncclComm_t half = NULL;
  double t_split = 0;
  if (split) {
    t0 = now_ms();
    CHECK("ncclCommSplit", ncclCommSplit(comm, rank % 2, rank, &half, NULL));
    t_split = now_ms() - t0;
  }
  if (half) {
    /* The split's first call: its links are made like the parent's. */
    int hn = 0;
    CHECK("ncclCommCount", ncclCommCount(half, &hn));
    CHECK("ncclAllReduce", ncclAllReduce(&x, &y, 1, ncclDouble, ncclSum, half, NULL));
  }

  if (check) bad += check_all(comm, rank, n);

  int fds, sockets;
  count_fds(&fds, &sockets);
  int segs = count_segments();
  long threads = status_field("Threads");
  long hwm = status_field("VmHWM");

  if (half) CHECK("ncclCommDestroy", ncclCommDestroy(half));
  t0 = now_ms();
  CHECK("ncclCommDestroy", ncclCommDestroy(comm));
  double t_destroy = now_ms() - t0;

  printf("scale rank=%d n=%d roots=%d init_ms=%.3f split_ms=%.3f first_ms=%.3f tenth_ms=%.3f "
         "destroy_ms=%.3f fds=%d threads=%ld rss_kib=%ld sockets=%d segs=%d pid=%d "
         "init_cpu_ms=%.3f init_start=%.3f init_end=%.3f check=%s\n",
         rank, n, nroots, t_init, t_split, t_first, t_tenth, t_destroy, fds, threads, hwm,
         sockets, segs, (int)getpid(), c_init, init_start, init_end, bad ? "FAILED" : "ok");
  fflush(stdout);
  return bad ? 3 : 0;
}

int main(int argc, char **argv) {
  int n = 2, nroots = 1, hosts = 0, check = 0, split = 1, pairs = 0, init_only = 0, base = 0;
  int count = -1, opt;
  while ((opt = getopt(argc, argv, "n:r:H:cSpIb:")) != -1) {
    switch (opt) {
      case 'n': n = atoi(optarg); break;
      case 'r': nroots = atoi(optarg); break;
      case 'H': hosts = atoi(optarg); break;
      case 'c': check = 1; break;
      case 'S': split = 0; break;
      case 'p': pairs = 1; split = 0; break;
      case 'I': init_only = 1; split = 0; break;
      case 'b':
        if (sscanf(optarg, "%d:%d", &base, &count) != 2) count = -2;
        break;
      default:
        fprintf(stderr, "usage: %s -n N [-r ROOTS] [-H HOSTS] [-c] [-S] [-p] [-I] [-b BASE:COUNT]\n",
                argv[0]);
        return 64;
    }
  }
  int external = count != -1;
  if (!external) count = n;
  if (n < 1 || nroots < 1 || nroots > MAX_ROOTS || nroots > n || hosts < 0 || hosts > n) {
    fprintf(stderr, "scale: need 1 <= ROOTS <= min(N, %d) and 0 <= HOSTS <= N\n", MAX_ROOTS);
    return 64;
  }
  if (init_only && (pairs || check)) {
    fprintf(stderr, "scale: -I runs no collective: no -p or -c\n");
    return 64;
  }
  if (pairs && (n % 2 || check)) {
    fprintf(stderr, "scale: -p needs an even N and no -c\n");
    return 64;
  }
  if (external && (count < 1 || base < 0 || base + count > n || nroots != 1 || hosts != 0 ||
                   !getenv("NCCL_COMM_ID"))) {
    fprintf(stderr, "scale: -b BASE:COUNT needs 0 <= BASE, BASE+COUNT <= N, one root, no -H "
                    "and NCCL_COMM_ID\n");
    return 64;
  }
  struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) {
    perror("scale: mmap");
    return 1;
  }
  memset(sh, 0, sizeof *sh);
  pid_t *pids = calloc(n, sizeof(pid_t));
  fflush(stdout);
  for (int r = base; r < base + count; r++) {
    pid_t p = fork();
    if (p < 0) {
      perror("scale: fork");
      for (int i = base; i < r; i++) kill(pids[i], SIGKILL);
      return 1;
    }
    if (p == 0) {
      /* A child whose parent died goes too. */
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      _exit(run_rank(sh, r, n, nroots, hosts, check, split, pairs, external, init_only));
    }
    pids[r] = p;
  }
  int failed = 0;
  for (int left = count; left > 0; left--) {
    int st;
    pid_t p = wait(&st);
    if (p < 0) break;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      int r = -1;
      for (int i = base; i < base + count; i++)
        if (pids[i] == p) r = i;
      if (!failed) {
        if (WIFSIGNALED(st))
          fprintf(stderr, "scale: rank %d died of signal %d; stopping the others\n", r,
                  WTERMSIG(st));
        else
          fprintf(stderr, "scale: rank %d exited with %d; stopping the others\n", r,
                  WEXITSTATUS(st));
        for (int i = base; i < base + count; i++)
          if (pids[i] != p) kill(pids[i], SIGKILL);
      }
      failed = 1;
    }
  }
  return failed;
}
