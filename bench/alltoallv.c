/* alltoallv_perf: all-to-all with per-peer counts that differ (see bench_a2av_count):
 * comm's commAlltoAllv, or, built against a library without it (NVIDIA's NCCL), grouped
 * ncclSend/ncclRecv with the same counts and displacements. commAlltoAllv defines in-place
 * use (sendbuff == recvbuff) and that column is checked; send/recv has no in-place form, so
 * there the column is timed only. */
#include "common.h"

#ifdef COMM_OP_BAND /* comm's header: it declares commAlltoAllv */
#define HAVE_COMM_ALLTOALLV 1
#else
#define HAVE_COMM_ALLTOALLV 0
#endif

static int run(const bench_call* c) {
#if HAVE_COMM_ALLTOALLV
  /* The pattern is symmetric: the same arrays describe what goes out and what comes in. */
  return commAlltoAllv(c->sendbuff, c->counts, c->displs, c->recvbuff, c->counts, c->displs, c->type, c->comm,
                       c->stream);
#else
  size_t ts = bench_type_size(c->type);
  ncclResult_t r = ncclGroupStart();
  for (int p = 0; p < c->nranks && r == ncclSuccess; p++) {
    r = ncclSend((const char*)c->sendbuff + c->displs[p] * ts, c->counts[p], c->type, p, c->comm, c->stream);
    if (r == ncclSuccess)
      r = ncclRecv((char*)c->recvbuff + c->displs[p] * ts, c->counts[p], c->type, p, c->comm, c->stream);
  }
  ncclResult_t e = ncclGroupEnd();
  return r != ncclSuccess ? r : e;
#endif
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_alltoallv, run, !HAVE_COMM_ALLTOALLV); }
