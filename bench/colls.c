/* The ten collectives: how many elements each rank sends and receives for a requested size,
 * what algbw counts, the bus-bandwidth factor, and where every element comes from.
 *
 * Every input element has a logical index; rank r's value at index g is
 * bench_value(plan, r, g). A collective says which index each element of the send view
 * carries, and what each element of the result view must hold: a value of one rank (data
 * movement), the reduction over all ranks (reductions), or its content before the call
 * (non-roots of reduce and gather, whose receive buffers NCCL does not touch). */
#include "harness.h"

#include <string.h>

const bench_coll bench_all_reduce = {"all_reduce", COLL_ALL_REDUCE, 1, 0, BW_ALLREDUCE};
const bench_coll bench_all_gather = {"all_gather", COLL_ALL_GATHER, 0, 0, BW_NM1_N};
const bench_coll bench_reduce_scatter = {"reduce_scatter", COLL_REDUCE_SCATTER, 1, 0, BW_NM1_N};
const bench_coll bench_alltoall = {"alltoall", COLL_ALLTOALL, 0, 0, BW_NM1_N};
const bench_coll bench_alltoallv = {"alltoallv", COLL_ALLTOALLV, 0, 0, BW_NM1_N};
const bench_coll bench_broadcast = {"broadcast", COLL_BROADCAST, 0, 1, BW_ONE};
const bench_coll bench_reduce = {"reduce", COLL_REDUCE, 1, 1, BW_ONE};
const bench_coll bench_gather = {"gather", COLL_GATHER, 0, 1, BW_NM1_N};
const bench_coll bench_scatter = {"scatter", COLL_SCATTER, 0, 1, BW_NM1_N};
const bench_coll bench_sendrecv = {"sendrecv", COLL_SENDRECV, 0, 0, BW_ONE};

static const bench_coll* all_colls[] = {&bench_all_reduce, &bench_all_gather, &bench_reduce_scatter,
                                        &bench_alltoall,   &bench_alltoallv,  &bench_broadcast,
                                        &bench_reduce,     &bench_gather,     &bench_scatter,
                                        &bench_sendrecv};

const bench_coll* bench_coll_by_name(const char* name) {
  for (size_t i = 0; i < sizeof all_colls / sizeof all_colls[0]; i++)
    if (strcmp(all_colls[i]->name, name) == 0) return all_colls[i];
  return NULL;
}

const char* bench_coll_name(const bench_coll* coll) { return coll->name; }

double bench_bw_factor(const bench_coll* c, int n) {
  switch (c->factor) {
    case BW_ALLREDUCE: return 2.0 * (n - 1) / n;
    case BW_NM1_N: return (double)(n - 1) / n;
    default: return 1.0;
  }
}

/* Block a and b exchange floor(base * (2k + 1) / n) elements, k = (a + b) mod n: sizes run
 * from about base/n to 2*base, every rank sends (and receives) the same total, at most
 * n*base, and the pattern is symmetric, which in-place all-to-all-v needs. */
size_t bench_a2av_count(size_t base, int n, int a, int b) {
  size_t k = (size_t)((a + b) % n);
  return base * (2 * k + 1) / (size_t)n;
}

void bench_coll_counts(const bench_coll* c, size_t count, int n, size_t eltsize, bench_counts* o) {
  memset(o, 0, sizeof *o);
  /* The per-rank chunk of the gather/scatter family is aligned to 16 bytes, as nccl-tests
   * does, so the printed size can fall slightly below the requested one. */
  size_t chunk = (count / (size_t)n) & ~(16 / eltsize - 1);
  switch (c->id) {
    case COLL_ALL_GATHER:
    case COLL_GATHER:
      o->send = chunk;
      o->recv = chunk * n;
      o->param = chunk;
      o->send_inplace = chunk;
      o->bw = chunk * n;
      break;
    case COLL_REDUCE_SCATTER:
    case COLL_SCATTER:
      o->send = chunk * n;
      o->recv = chunk;
      o->param = chunk;
      o->recv_inplace = chunk;
      o->bw = chunk * n;
      break;
    case COLL_ALLTOALL:
      o->send = o->recv = chunk * n;
      o->param = chunk;
      o->bw = chunk * n;
      break;
    case COLL_ALLTOALLV: {
      size_t base = count / (size_t)n, total = 0;
      for (int p = 0; p < n; p++) total += bench_a2av_count(base, n, 0, p);
      o->send = o->recv = total; /* the same on every rank, so also the busiest rank's */
      o->param = base;
      o->bw = total;
      break;
    }
    default: /* all_reduce, broadcast, reduce, sendrecv */
      o->send = o->recv = o->param = o->bw = count;
      break;
  }
}

/* The alltoallv block (peer) holding element j, by binary search over the displacements. */
static int a2av_block(const bench_data* d, size_t j, size_t* offset) {
  int lo = 0, hi = d->nranks - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (d->displs[mid] <= j)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (j < d->displs[lo] || j >= d->displs[lo] + d->counts[lo]) return -1;
  *offset = j - d->displs[lo];
  return lo;
}

/* Logical index of the k-th element of the alltoallv block from `from` to `to`: blocks are
 * spaced by more than the largest block size. */
static uint64_t a2av_index(const bench_data* d, int to, size_t k) {
  return (uint64_t)to * (2 * d->cnt.param + 1) + k;
}

int bench_send_source(const bench_data* d, size_t j, uint64_t* index) {
  size_t c = d->cnt.param;
  switch (d->coll->id) {
    case COLL_ALL_GATHER:
    case COLL_GATHER: *index = (uint64_t)d->rank * c + j; return 1;
    case COLL_ALLTOALLV: {
      size_t k;
      int to = a2av_block(d, j, &k);
      if (to < 0) return 0;
      *index = a2av_index(d, to, k);
      return 1;
    }
    default: *index = j; return 1;
  }
}

int bench_expect(const bench_data* d, size_t j, int* src, uint64_t* index) {
  size_t c = d->cnt.param;
  int me = d->rank, n = d->nranks;
  switch (d->coll->id) {
    case COLL_ALL_REDUCE: *index = j; return EXPECT_REDUCED;
    case COLL_REDUCE:
      if (me != d->root) return EXPECT_UNCHANGED;
      *index = j;
      return EXPECT_REDUCED;
    case COLL_REDUCE_SCATTER: *index = (uint64_t)me * c + j; return EXPECT_REDUCED;
    case COLL_BROADCAST:
      *src = d->root;
      *index = j;
      return EXPECT_FROM;
    case COLL_GATHER:
      if (me != d->root) return EXPECT_UNCHANGED;
      /* fall through */
    case COLL_ALL_GATHER:
      *src = (int)(j / c);
      *index = j;
      return EXPECT_FROM;
    case COLL_SCATTER:
      *src = d->root;
      *index = (uint64_t)me * c + j;
      return EXPECT_FROM;
    case COLL_ALLTOALL:
      *src = (int)(j / c);
      *index = (uint64_t)me * c + j % c;
      return EXPECT_FROM;
    case COLL_ALLTOALLV: {
      size_t k;
      int from = a2av_block(d, j, &k);
      if (from < 0) return EXPECT_UNCHANGED;
      *src = from;
      *index = a2av_index(d, me, k);
      return EXPECT_FROM;
    }
    case COLL_SENDRECV:
      *src = (me - 1 + n) % n;
      *index = j;
      return EXPECT_FROM;
  }
  return EXPECT_UNCHANGED;
}
