/* reduce_scatter_perf: ncclReduceScatter, `count` result elements per rank. In place:
 * recvbuff == sendbuff + rank * count. */
#include "common.h"

static int run(const bench_call* c) {
  return ncclReduceScatter(c->sendbuff, c->recvbuff, c->count, c->type, c->op, c->comm, c->stream);
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_reduce_scatter, run, 0); }
