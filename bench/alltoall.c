/* alltoall_perf: ncclAlltoAll, `count` elements to and from every rank. In place:
 * sendbuff == recvbuff. */
#include "common.h"

static int run(const bench_call* c) {
  return ncclAlltoAll(c->sendbuff, c->recvbuff, c->count, c->type, c->comm, c->stream);
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_alltoall, run, 0); }
