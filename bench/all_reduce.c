/* all_reduce_perf: ncclAllReduce. In place: sendbuff == recvbuff. */
#include "common.h"

static int run(const bench_call* c) {
  return ncclAllReduce(c->sendbuff, c->recvbuff, c->count, c->type, c->op, c->comm, c->stream);
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_all_reduce, run, 0); }
