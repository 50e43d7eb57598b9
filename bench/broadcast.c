/* broadcast_perf: ncclBroadcast from the root. In place: sendbuff == recvbuff. */
#include "common.h"

static int run(const bench_call* c) {
  return ncclBroadcast(c->sendbuff, c->recvbuff, c->count, c->type, c->root, c->comm, c->stream);
}

int main(int argc, char** argv) { return bench_nccl_main(argc, argv, &bench_broadcast, run, 0); }
