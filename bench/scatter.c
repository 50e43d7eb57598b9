/* scatter_perf: ncclScatter of `count` elements per rank from the root. In place:
 * recvbuff == sendbuff + rank * count. */
#include "common.h"

static int run(const bench_call* c) {
  return ncclScatter(c->sendbuff, c->recvbuff, c->count, c->type, c->root, c->comm, c->stream);
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_scatter, run, 0); }
