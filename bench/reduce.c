/* reduce_perf: ncclReduce to the root. In place: sendbuff == recvbuff (the receive buffer
 * of a non-root rank is left alone, which the check verifies). */
#include "common.h"

static int run(const bench_call* c) {
  return ncclReduce(c->sendbuff, c->recvbuff, c->count, c->type, c->op, c->root, c->comm, c->stream);
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_reduce, run, 0); }
