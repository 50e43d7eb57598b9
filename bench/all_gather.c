/* all_gather_perf: ncclAllGather of `count` elements per rank. In place: sendbuff ==
 * recvbuff + rank * count. */
#include "common.h"

static int run(const bench_call* c) {
  return ncclAllGather(c->sendbuff, c->recvbuff, c->count, c->type, c->comm, c->stream);
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_all_gather, run, 0); }
