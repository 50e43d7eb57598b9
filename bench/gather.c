/* gather_perf: ncclGather of `count` elements per rank to the root. In place: sendbuff ==
 * recvbuff + rank * count. */
#include "common.h"

static int run(const bench_call* c) {
  return ncclGather(c->sendbuff, c->recvbuff, c->count, c->type, c->root, c->comm, c->stream);
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_gather, run, 0); }
