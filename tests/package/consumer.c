/* A program written against the NCCL API only: a one-rank communicator sums a buffer in host
 * memory and prints which library it ran on. Built by scripts/test_package.sh against an
 * installed comm in three ways (find_package(NCCL), pkg-config nccl, plain -lnccl), and against a
 * stand-in for NVIDIA's libnccl.so.2 that it then runs without, on comm. */
#include <nccl.h>
#include <stdio.h>

#define CHECK(call)                                                        \
  do {                                                                     \
    ncclResult_t r_ = (call);                                              \
    if (r_ != ncclSuccess) {                                               \
      fprintf(stderr, "%s failed: %s\n", #call, ncclGetErrorString(r_));   \
      return 1;                                                            \
    }                                                                      \
  } while (0)

int main(void) {
  int version = 0;
  CHECK(ncclGetVersion(&version));
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, 1, id, 0));
  float buf[4] = {1, 2, 3, 4};
  CHECK(ncclAllReduce(buf, buf, 4, ncclFloat, ncclSum, comm, NULL));
  CHECK(ncclCommDestroy(comm));
  if (buf[3] != 4) {
    fprintf(stderr, "wrong result %g\n", buf[3]);
    return 1;
  }
  printf("NCCL API %d: all-reduce OK\n", version);
  return 0;
}
