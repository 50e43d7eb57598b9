/* A rank of a multi-process job written only against nccl.h: every collective of the NCCL API
 * on host memory, each result checked. The launcher passes COMM_TEST_RANK, COMM_TEST_NRANKS and
 * the unique id as hex in COMM_TEST_ID (any out-of-band channel would do). */
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    ncclResult_t r_ = (call);                                                            \
    if (r_ != ncclSuccess) {                                                             \
      fprintf(stderr, "rank %d: %s failed: %s (%s)\n", rank, #call, ncclGetErrorString(r_), \
              ncclGetLastError(NULL));                                                   \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

#define EXPECT(cond, ...)                   \
  do {                                      \
    if (!(cond)) {                          \
      fprintf(stderr, "rank %d: ", rank);   \
      fprintf(stderr, __VA_ARGS__);         \
      fprintf(stderr, "\n");                \
      return 1;                             \
    }                                       \
  } while (0)

static int hexval(char c) { return c <= '9' ? c - '0' : (c | 32) - 'a' + 10; }

int main(void) {
  int rank = atoi(getenv("COMM_TEST_RANK"));
  int nranks = atoi(getenv("COMM_TEST_NRANKS"));
  const char* hex = getenv("COMM_TEST_ID");
  ncclUniqueId id;
  size_t i;
  int version = 0, count = 0, me = -1;
  for (i = 0; i < NCCL_UNIQUE_ID_BYTES; i++)
    id.internal[i] = (char)(hexval(hex[2 * i]) * 16 + hexval(hex[2 * i + 1]));

  CHECK(ncclGetVersion(&version));
  EXPECT(version >= NCCL_VERSION(2, 19, 0), "library version %d too old", version);

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.commName = "c-abi-test";
  ncclComm_t comm;
  CHECK(ncclCommInitRankConfig(&comm, nranks, id, rank, &config));
  CHECK(ncclCommCount(comm, &count));
  CHECK(ncclCommUserRank(comm, &me));
  EXPECT(count == nranks && me == rank, "count %d rank %d", count, me);

  const size_t n = 1000003; /* odd, not divisible by the rank count */
  float* send = (float*)malloc(n * sizeof(float) * nranks);
  float* recv = (float*)malloc(n * sizeof(float) * nranks);
  for (i = 0; i < n * nranks; i++) send[i] = (float)(rank + 1);

  CHECK(ncclAllReduce(send, recv, n, ncclFloat, ncclSum, comm, NULL));
  for (i = 0; i < n; i++) EXPECT(recv[i] == nranks * (nranks + 1) / 2.0f, "allreduce[%zu] = %f", i, recv[i]);

  CHECK(ncclAllReduce(send, recv, n, ncclFloat, ncclMax, comm, NULL));
  EXPECT(recv[n - 1] == (float)nranks, "max = %f", recv[n - 1]);

  CHECK(ncclBroadcast(send, recv, n, ncclFloat, nranks - 1, comm, NULL));
  EXPECT(recv[7] == (float)nranks, "broadcast = %f", recv[7]);

  CHECK(ncclAllGather(send, recv, n, ncclFloat, comm, NULL));
  for (i = 0; i < (size_t)nranks; i++) EXPECT(recv[i * n + 5] == (float)(i + 1), "allgather block %zu", i);

  CHECK(ncclReduceScatter(send, recv, n, ncclFloat, ncclSum, comm, NULL));
  EXPECT(recv[n / 2] == nranks * (nranks + 1) / 2.0f, "reducescatter = %f", recv[n / 2]);

  CHECK(ncclReduce(send, recv, n, ncclFloat, ncclSum, 0, comm, NULL));
  if (rank == 0) EXPECT(recv[3] == nranks * (nranks + 1) / 2.0f, "reduce = %f", recv[3]);

  CHECK(ncclAlltoAll(send, recv, n, ncclFloat, comm, NULL));
  for (i = 0; i < (size_t)nranks; i++) EXPECT(recv[i * n] == (float)(i + 1), "alltoall block %zu", i);

  CHECK(ncclGather(send, recv, n, ncclFloat, 1 % nranks, comm, NULL));
  if (rank == 1 % nranks)
    for (i = 0; i < (size_t)nranks; i++) EXPECT(recv[i * n + 1] == (float)(i + 1), "gather block %zu", i);

  CHECK(ncclScatter(send, recv, n, ncclFloat, 0, comm, NULL));
  EXPECT(recv[0] == 1.0f, "scatter = %f", recv[0]);

  /* Ring exchange with send/recv in a group. */
  CHECK(ncclGroupStart());
  CHECK(ncclSend(send, n, ncclFloat, (rank + 1) % nranks, comm, NULL));
  CHECK(ncclRecv(recv, n, ncclFloat, (rank + nranks - 1) % nranks, comm, NULL));
  CHECK(ncclGroupEnd());
  EXPECT(recv[n - 1] == (float)((rank + nranks - 1) % nranks + 1), "sendrecv = %f", recv[n - 1]);

  /* PreMulSum on doubles, with a host-immediate scalar. */
  double dsend[3] = {1, 2, 3}, drecv[3], scalar = 0.5;
  ncclRedOp_t premul;
  CHECK(ncclRedOpCreatePreMulSum(&premul, &scalar, ncclDouble, ncclScalarHostImmediate, comm));
  CHECK(ncclAllReduce(dsend, drecv, 3, ncclDouble, premul, comm, NULL));
  CHECK(ncclRedOpDestroy(premul, comm));
  EXPECT(drecv[2] == 1.5 * nranks, "premulsum = %f", drecv[2]);

  /* A bad argument is refused and the communicator keeps working. */
  EXPECT(ncclAllReduce(send, recv, n, (ncclDataType_t)42, ncclSum, comm, NULL) == ncclInvalidArgument,
         "bad datatype accepted");
  EXPECT(strstr(ncclGetLastError(comm), "datatype") != NULL, "last error: %s", ncclGetLastError(comm));
  CHECK(ncclAllReduce(send, recv, 1, ncclFloat, ncclSum, comm, NULL));

  ncclResult_t async;
  CHECK(ncclCommGetAsyncError(comm, &async));
  EXPECT(async == ncclSuccess, "async error %d", async);
  CHECK(ncclCommFinalize(comm));
  CHECK(ncclCommDestroy(comm));
  free(send);
  free(recv);
  printf("rank %d of %d: all checks passed\n", rank, nranks);
  return 0;
}
