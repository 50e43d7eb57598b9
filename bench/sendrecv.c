/* sendrecv_perf: a ring, every rank sends to rank+1 and receives from rank-1 in one group.
 * Sending from and receiving into the same buffer has no defined result in NCCL, so the
 * in-place column is timed but not checked (N/A), as in nccl-tests. */
#include "common.h"

static int run(const bench_call* c) {
  int next = (c->rank + 1) % c->nranks, prev = (c->rank - 1 + c->nranks) % c->nranks;
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) r = ncclSend(c->sendbuff, c->count, c->type, next, c->comm, c->stream);
  if (r == ncclSuccess) r = ncclRecv(c->recvbuff, c->count, c->type, prev, c->comm, c->stream);
  ncclResult_t e = ncclGroupEnd();
  return r != ncclSuccess ? r : e;
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_sendrecv, run, 1); }
