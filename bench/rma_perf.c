/* rma_perf: comm's one-sided operations next to MPI-3 RMA, in one program, alternating.
 *
 *   mpirun -np 2 rma_perf [rounds [iterations]]        (defaults: 7 rounds, 20000 iterations)
 *
 * Two processes on one host. Both libraries are set up once (comm's unique id travels over
 * MPI); then every round measures, one after the other:
 *
 *   signal    8-byte put + signal + wait, ping-pong: ncclPutSignal + ncclWaitSignal on a window
 *             from commWindowAllocate, against MPI_Put + MPI_Win_flush + a zero-byte
 *             MPI_Send / MPI_Recv as the notification (window from MPI_Win_allocate, inside
 *             MPI_Win_lock_all). Reported: one-way time (round trip / 2).
 *   floor     the same exchange with no library at all, as the hardware's floor for it: the
 *             8-byte value stored straight into the peer's window (through commWinPeerPtr),
 *             then a counter on another cache line of it raised with an atomic add, the peer
 *             spinning on its counter and then reading the value. This is what any put +
 *             signal whose data lands in the target's window before the target looks must do.
 *   fetch_add rank 0 adds to a word of rank 1's window and waits for the old value, while
 *             rank 1 sits in MPI_Barrier: commWinFetchAdd against MPI_Fetch_and_op +
 *             MPI_Win_flush in a passive-target epoch (MPI_Win_lock_all). Reported: time per op.
 *   put_64M   64 MiB from rank 0 into rank 1's window: commWinPut against a single-core memcpy
 *             of 64 MiB between two buffers of rank 0 (the bound), and MPI_Put + MPI_Win_flush.
 *             Reported: GB/s.
 *
 * Every result is checked (values seen at the target, old values of the fetch-adds). The
 * summary gives each measurement's median over the rounds and the ratios of medians, then
 * the best round of each. */
#define _GNU_SOURCE
#include <mpi.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NC(call)                                                                         \
  do {                                                                                   \
    ncclResult_t r_ = (call);                                                            \
    if (r_ != ncclSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, ncclGetLastError(NULL)); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                      \
    }                                                                                    \
  } while (0)

#define CHECK(cond, ...)                   \
  do {                                     \
    if (!(cond)) {                         \
      fprintf(stderr, __VA_ARGS__);        \
      MPI_Abort(MPI_COMM_WORLD, 2);        \
    }                                      \
  } while (0)

#define BIG ((size_t)64 << 20)
#define ROUNDS_MAX 64

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int me, iters;
static ncclComm_t comm;
static ncclWindow_t cwin, cbig;
static volatile uint64_t* cmem;
static MPI_Win mwin, mbig;
static volatile uint64_t* mmem;

static double comm_signal(void) {
  int peer = 1 - me;
  ncclWaitSignalDesc_t d = {1, peer, 0, 0};
  uint64_t v;
  MPI_Barrier(MPI_COMM_WORLD);
  double t = now();
  for (int i = 0; i < iters; i++) {
    v = (uint64_t)i + 1;
    if (me == 0) {
      NC(ncclPutSignal(&v, 1, ncclUint64, peer, cwin, 0, 0, 0, 0, comm, NULL));
      NC(ncclWaitSignal(1, &d, comm, NULL));
      CHECK(cmem[0] == v, "comm signal: round %d saw %llu\n", i, (unsigned long long)cmem[0]);
    } else {
      NC(ncclWaitSignal(1, &d, comm, NULL));
      CHECK(cmem[0] == v, "comm signal: round %d saw %llu\n", i, (unsigned long long)cmem[0]);
      NC(ncclPutSignal(&v, 1, ncclUint64, peer, cwin, 0, 0, 0, 0, comm, NULL));
    }
  }
  return (now() - t) / (2.0 * iters);
}

static double mpi_signal(void) {
  int peer = 1 - me;
  uint64_t v;
  MPI_Barrier(MPI_COMM_WORLD);
  double t = now();
  for (int i = 0; i < iters; i++) {
    v = (uint64_t)i + 1;
    if (me == 0) {
      MPI_Put(&v, 1, MPI_UINT64_T, peer, 0, 1, MPI_UINT64_T, mwin);
      MPI_Win_flush(peer, mwin);
      MPI_Send(NULL, 0, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
      MPI_Recv(NULL, 0, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Win_sync(mwin);
      CHECK(mmem[0] == v, "mpi signal: round %d saw %llu\n", i, (unsigned long long)mmem[0]);
    } else {
      MPI_Recv(NULL, 0, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Win_sync(mwin);
      CHECK(mmem[0] == v, "mpi signal: round %d saw %llu\n", i, (unsigned long long)mmem[0]);
      MPI_Put(&v, 1, MPI_UINT64_T, peer, 0, 1, MPI_UINT64_T, mwin);
      MPI_Win_flush(peer, mwin);
      MPI_Send(NULL, 0, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
    }
  }
  return (now() - t) / (2.0 * iters);
}

/* Window words of the floor exchange: the value, and the counter on its own cache lines. */
#define FLOOR_DATA 128
#define FLOOR_COUNT 256
static volatile uint64_t* cpeer;

static double floor_signal(uint64_t base) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t = now();
  for (int i = 0; i < iters; i++) {
    uint64_t v = base + (uint64_t)i + 1;
    if (me == 0) {
      cpeer[FLOOR_DATA / 8] = v;
      __atomic_fetch_add(&cpeer[FLOOR_COUNT / 8], 1, __ATOMIC_SEQ_CST);
      while (__atomic_load_n(&cmem[FLOOR_COUNT / 8], __ATOMIC_ACQUIRE) < v) {
      }
      CHECK(cmem[FLOOR_DATA / 8] == v, "floor: round %d saw %llu\n", i, (unsigned long long)cmem[FLOOR_DATA / 8]);
    } else {
      while (__atomic_load_n(&cmem[FLOOR_COUNT / 8], __ATOMIC_ACQUIRE) < v) {
      }
      CHECK(cmem[FLOOR_DATA / 8] == v, "floor: round %d saw %llu\n", i, (unsigned long long)cmem[FLOOR_DATA / 8]);
      cpeer[FLOOR_DATA / 8] = v;
      __atomic_fetch_add(&cpeer[FLOOR_COUNT / 8], 1, __ATOMIC_SEQ_CST);
    }
  }
  return (now() - t) / (2.0 * iters);
}

/* Rank 0 adds; the word starts at `base` (the previous rounds' sum). */
static double comm_fetch_add(uint64_t base) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t = now();
  if (me == 0) {
    for (int i = 0; i < iters; i++) {
      uint64_t old = 0;
      NC(commWinFetchAdd(1, &old, ncclUint64, 1, cwin, 8, comm));
      CHECK(old == base + (uint64_t)i, "comm fetch_add: old %llu, wanted %llu\n", (unsigned long long)old,
            (unsigned long long)(base + i));
    }
  }
  t = now() - t;
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 1) CHECK(cmem[1] == base + (uint64_t)iters, "comm fetch_add: final %llu\n", (unsigned long long)cmem[1]);
  return t / iters;
}

static double mpi_fetch_add(uint64_t base) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t = now();
  if (me == 0) {
    uint64_t one = 1;
    for (int i = 0; i < iters; i++) {
      uint64_t old = 0;
      MPI_Fetch_and_op(&one, &old, MPI_UINT64_T, 1, 8, MPI_SUM, mwin);
      MPI_Win_flush(1, mwin);
      CHECK(old == base + (uint64_t)i, "mpi fetch_add: old %llu, wanted %llu\n", (unsigned long long)old,
            (unsigned long long)(base + i));
    }
  }
  t = now() - t;
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 1) {
    MPI_Win_sync(mwin);
    CHECK(mmem[1] == base + (uint64_t)iters, "mpi fetch_add: final %llu\n", (unsigned long long)mmem[1]);
  }
  return t / iters;
}

enum { BIG_COMM, BIG_MEMCPY, BIG_MPI };

/* GB/s of 64 MiB moves by rank 0; the target checks the first and last words. */
static double big(int how, char* src, char* dst, int reps, unsigned char mark) {
  memset(src, mark, BIG);
  MPI_Barrier(MPI_COMM_WORLD);
  double t = now();
  if (me == 0) {
    for (int i = 0; i < reps; i++) {
      if (how == BIG_COMM) NC(commWinPut(src, BIG, ncclUint8, 1, cbig, 0, comm));
      if (how == BIG_MEMCPY) memcpy(dst, src, BIG);
      if (how == BIG_MPI) {
        MPI_Put(src, (int)BIG, MPI_BYTE, 1, 0, (int)BIG, MPI_BYTE, mbig);
        MPI_Win_flush(1, mbig);
      }
    }
  }
  t = now() - t;
  MPI_Barrier(MPI_COMM_WORLD);
  return (double)BIG * reps / t / 1e9;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static double median(double* v, int n) {
  double s[ROUNDS_MAX];
  memcpy(s, v, sizeof(double) * n);
  qsort(s, n, sizeof(double), cmp);
  return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

/* The least (`least`) or the greatest value of v[0..n). */
static double best(const double* v, int n, int least) {
  double b = v[0];
  for (int i = 1; i < n; i++)
    if (least ? v[i] < b : v[i] > b) b = v[i];
  return b;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int rounds = argc > 1 ? atoi(argv[1]) : 7;
  iters = argc > 2 ? atoi(argv[2]) : 20000;
  if (n != 2 || rounds < 1 || rounds > ROUNDS_MAX || iters < 1) {
    if (me == 0) fprintf(stderr, "usage: mpirun -np 2 %s [rounds (1..%d) [iterations]]\n", argv[0], ROUNDS_MAX);
    MPI_Finalize();
    return 1;
  }
  ncclUniqueId id;
  if (me == 0) NC(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  NC(ncclCommInitRank(&comm, 2, id, me));
  void* p;
  NC(commWindowAllocate(comm, 4096, NCCL_WIN_COLL_SYMMETRIC, &p, &cwin));
  cmem = p;
  void* pp = NULL;
  NC(commWinPeerPtr(comm, cwin, 1 - me, &pp));
  CHECK(pp != NULL, "no direct pointer to the peer's window\n");
  cpeer = pp;
  void* pb;
  NC(commWindowAllocate(comm, BIG, NCCL_WIN_COLL_SYMMETRIC, &pb, &cbig));
  MPI_Win_allocate(4096, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &p, &mwin);
  mmem = p;
  memset((void*)mmem, 0, 4096);
  MPI_Win_allocate(BIG, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &pb, &mbig);
  MPI_Win_lock_all(0, mwin);
  MPI_Win_lock_all(0, mbig);
  char* src = malloc(BIG);
  char* dst = malloc(BIG);
  memset(dst, 1, BIG);

  double fs[ROUNDS_MAX], cs[ROUNDS_MAX], ms[ROUNDS_MAX], cf[ROUNDS_MAX], mf[ROUNDS_MAX], cb[ROUNDS_MAX], bb[ROUNDS_MAX],
      mb[ROUNDS_MAX];
  comm_signal();
  mpi_signal();
  uint64_t cbase = 0, mbase = 0, fbase = 0;
  floor_signal(fbase);
  fbase += iters;
  int reps = 8;
  for (int r = 0; r < rounds; r++) {
    cs[r] = comm_signal();
    ms[r] = mpi_signal();
    fs[r] = floor_signal(fbase);
    fbase += iters;
    cf[r] = comm_fetch_add(cbase);
    cbase += iters;
    mf[r] = mpi_fetch_add(mbase);
    mbase += iters;
    unsigned char mark = (unsigned char)(r + 2);
    cb[r] = big(BIG_COMM, src, dst, reps, mark);
    bb[r] = big(BIG_MEMCPY, src, dst, reps, mark);
    mb[r] = big(BIG_MPI, src, dst, reps, mark);
    if (me == 0)
      printf("round %d: signal comm %.3f us mpi %.3f us floor %.3f us | fetch_add comm %.3f us mpi %.3f us | put 64M comm %.2f GB/s "
             "memcpy %.2f GB/s mpi %.2f GB/s\n",
             r, cs[r] * 1e6, ms[r] * 1e6, fs[r] * 1e6, cf[r] * 1e6, mf[r] * 1e6, cb[r], bb[r], mb[r]);
  }
  /* The big window's last put left `mark` everywhere at rank 1 (checked through a get). */
  if (me == 0) {
    unsigned char edge[2];
    NC(commWinGet(&edge[0], 1, ncclUint8, 1, cbig, 0, comm));
    NC(commWinGet(&edge[1], 1, ncclUint8, 1, cbig, BIG - 1, comm));
    CHECK(edge[0] == (unsigned char)(rounds + 1) && edge[1] == (unsigned char)(rounds + 1),
          "64 MiB put: the target holds %u..%u\n", edge[0], edge[1]);
    double s1 = median(cs, rounds), s2 = median(ms, rounds), f1 = median(cf, rounds), f2 = median(mf, rounds),
           b1 = median(cb, rounds), b2 = median(bb, rounds), b3 = median(mb, rounds);
    printf("\nmedians over %d rounds of %d iterations (2 processes, one host):\n", rounds, iters);
    printf("%-34s %12s %12s %8s\n", "measurement", "comm", "reference", "ratio");
    printf("%-34s %9.3f us %9.3f us %8.2f  (comm / MPI_Put+flush+notify)\n", "8 B put + signal + wait, one way", s1 * 1e6,
           s2 * 1e6, s1 / s2);
    double s3 = median(fs, rounds);
    printf("%-34s %9.3f us %9.3f us %8.2f  (floor / MPI_Put+flush+notify)\n", "  the same with no library (floor)", s3 * 1e6,
           s2 * 1e6, s3 / s2);
    printf("%-34s %9.3f us %9.3f us %8.2f  (comm / floor)\n", "  comm against the floor", s1 * 1e6, s3 * 1e6, s1 / s3);
    printf("%-34s %9.3f us %9.3f us %8.2f  (comm / MPI_Fetch_and_op+flush)\n", "fetch-add round trip", f1 * 1e6, f2 * 1e6,
           f1 / f2);
    printf("%-34s %7.2f GB/s %7.2f GB/s %8.2f  (comm / single-core memcpy)\n", "64 MiB put", b1, b2, b1 / b2);
    printf("%-34s %7.2f GB/s %7.2f GB/s %8.2f  (comm / MPI_Put+flush)\n", "64 MiB put vs MPI", b1, b3, b1 / b3);
    /* On a shared machine a round can lose the core to another job: the best round shows
     * what each side does when it has one. */
    printf("\nbest rounds (least time, most bandwidth):\n");
    printf("%-34s %9.3f us %9.3f us %8.2f\n", "8 B put + signal + wait, one way", best(cs, rounds, 1) * 1e6,
           best(ms, rounds, 1) * 1e6, best(cs, rounds, 1) / best(ms, rounds, 1));
    printf("%-34s %9.3f us %9.3f us %8.2f\n", "  floor vs MPI", best(fs, rounds, 1) * 1e6, best(ms, rounds, 1) * 1e6,
           best(fs, rounds, 1) / best(ms, rounds, 1));
    printf("%-34s %9.3f us %9.3f us %8.2f\n", "fetch-add round trip", best(cf, rounds, 1) * 1e6, best(mf, rounds, 1) * 1e6,
           best(cf, rounds, 1) / best(mf, rounds, 1));
    printf("%-34s %7.2f GB/s %7.2f GB/s %8.2f\n", "64 MiB put vs memcpy", best(cb, rounds, 0), best(bb, rounds, 0),
           best(cb, rounds, 0) / best(bb, rounds, 0));
    printf("%-34s %7.2f GB/s %7.2f GB/s %8.2f\n", "64 MiB put vs MPI", best(cb, rounds, 0), best(mb, rounds, 0),
           best(cb, rounds, 0) / best(mb, rounds, 0));
  }
  MPI_Win_unlock_all(mbig);
  MPI_Win_unlock_all(mwin);
  MPI_Win_free(&mbig);
  MPI_Win_free(&mwin);
  NC(ncclCommWindowDeregister(comm, cbig));
  NC(ncclCommWindowDeregister(comm, cwin));
  NC(ncclCommDestroy(comm));
  free(src);
  free(dst);
  MPI_Finalize();
  return 0;
}
