/* mpi_perf: the same collectives through MPI, for comparison.
 *
 *   mpi_perf <all_reduce|all_gather|reduce_scatter|alltoall|alltoallv|broadcast|reduce|gather|
 *             scatter|sendrecv> [the flags of the _perf binaries]
 *
 * Buffers, sizes, input values, the check, the table and the JSON file are the harness's, so
 * rows line up with the NCCL binaries'. One rank per process (no -t/-g), host memory, -m 1.
 * MPI has no datatype for half, bfloat16 or the fp8 formats and no avg or pre-multiplied sum,
 * so those are refused (and skipped under -d all / -o all).
 *
 * Where MPI's semantics differ from NCCL's, the call is adapted and the adaptation is timed:
 * an out-of-place broadcast copies the root's send buffer into its receive buffer (MPI_Bcast
 * has one buffer), and an in-place reduce-scatter (MPI puts the result at the start of the
 * buffer, NCCL at the rank's own block) moves the block to where NCCL leaves it. */
#include <mpi.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

static MPI_Datatype mpi_type(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return MPI_INT8_T;
    case ncclUint8: return MPI_UINT8_T;
    case ncclInt32: return MPI_INT32_T;
    case ncclUint32: return MPI_UINT32_T;
    case ncclInt64: return MPI_INT64_T;
    case ncclUint64: return MPI_UINT64_T;
    case ncclFloat32: return MPI_FLOAT;
    case ncclFloat64: return MPI_DOUBLE;
    default: return MPI_DATATYPE_NULL;
  }
}

static MPI_Op mpi_op(int op) {
  switch (op) {
    case BENCH_SUM: return MPI_SUM;
    case BENCH_PROD: return MPI_PROD;
    case BENCH_MAX: return MPI_MAX;
    case BENCH_MIN: return MPI_MIN;
    default: return MPI_OP_NULL;
  }
}

static const char* refuse(const bench_coll* coll, ncclDataType_t type, int op) {
  (void)coll;
  if (mpi_type(type) == MPI_DATATYPE_NULL) return "MPI has no datatype for it";
  if (op == BENCH_AVG) return "MPI has no average reduction";
  if (op == BENCH_MULSUM) return "MPI has no pre-multiplied sum";
  return NULL;
}

static const char* error_string(int rc) {
  static char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "MPI error %d", rc);
  return msg;
}

static const bench_coll* g_coll;

/* MPI counts are ints: larger calls cannot be expressed. */
static int fits(size_t n) { return n <= (size_t)0x7fffffff; }

static int run(const bench_call* c) {
  MPI_Datatype dt = mpi_type(c->type);
  MPI_Comm w = MPI_COMM_WORLD;
  int n = c->nranks, me = c->rank;
  size_t ts = bench_type_size(c->type);
  const void* in = c->in_place ? MPI_IN_PLACE : c->sendbuff;
  if (!fits(c->count * (size_t)n)) return MPI_ERR_COUNT;
  int count = (int)c->count;
  const char* name = bench_coll_name(g_coll);
  if (strcmp(name, "all_reduce") == 0) return MPI_Allreduce(in, c->recvbuff, count, dt, mpi_op(c->op_index), w);
  if (strcmp(name, "all_gather") == 0) return MPI_Allgather(in, count, dt, c->recvbuff, count, dt, w);
  if (strcmp(name, "reduce_scatter") == 0) {
    if (!c->in_place) return MPI_Reduce_scatter_block(c->sendbuff, c->recvbuff, count, dt, mpi_op(c->op_index), w);
    /* NCCL in place: recvbuff == sendbuff + rank*count; MPI leaves the block at the start. */
    void* base = (void*)c->sendbuff;
    int rc = MPI_Reduce_scatter_block(MPI_IN_PLACE, base, count, dt, mpi_op(c->op_index), w);
    if (rc == MPI_SUCCESS && me != 0) memmove(c->recvbuff, base, c->count * ts);
    return rc;
  }
  if (strcmp(name, "alltoall") == 0) return MPI_Alltoall(in, count, dt, c->recvbuff, count, dt, w);
  if (strcmp(name, "alltoallv") == 0) {
    int counts[n], displs[n];
    for (int p = 0; p < n; p++) {
      if (!fits(c->displs[p] + c->counts[p])) return MPI_ERR_COUNT;
      counts[p] = (int)c->counts[p];
      displs[p] = (int)c->displs[p];
    }
    /* The pattern is symmetric, which MPI_IN_PLACE requires: one layout for both directions. */
    return MPI_Alltoallv(in, counts, displs, dt, c->recvbuff, counts, displs, dt, w);
  }
  if (strcmp(name, "broadcast") == 0) {
    if (c->in_place || me != c->root) return MPI_Bcast(c->recvbuff, count, dt, c->root, w);
    int rc = MPI_Bcast((void*)c->sendbuff, count, dt, c->root, w);
    if (rc == MPI_SUCCESS) memcpy(c->recvbuff, c->sendbuff, c->count * ts);
    return rc;
  }
  if (strcmp(name, "reduce") == 0) {
    /* In place, only the root passes MPI_IN_PLACE; other ranks' sendbuff is their input. */
    const void* s = c->in_place && me == c->root ? MPI_IN_PLACE : c->sendbuff;
    return MPI_Reduce(s, c->recvbuff, count, dt, mpi_op(c->op_index), c->root, w);
  }
  if (strcmp(name, "gather") == 0) {
    const void* s = c->in_place && me == c->root ? MPI_IN_PLACE : c->sendbuff;
    return MPI_Gather(s, count, dt, c->recvbuff, count, dt, c->root, w);
  }
  if (strcmp(name, "scatter") == 0) {
    void* r = c->in_place && me == c->root ? MPI_IN_PLACE : c->recvbuff;
    return MPI_Scatter(c->sendbuff, count, dt, r, count, dt, c->root, w);
  }
  if (strcmp(name, "sendrecv") == 0) {
    int next = (me + 1) % n, prev = (me - 1 + n) % n;
    if (c->in_place) return MPI_Sendrecv_replace(c->recvbuff, count, dt, next, 0, prev, 0, w, MPI_STATUS_IGNORE);
    return MPI_Sendrecv(c->sendbuff, count, dt, next, 0, c->recvbuff, count, dt, prev, 0, w, MPI_STATUS_IGNORE);
  }
  return MPI_ERR_OTHER;
}

int main(int argc, char** argv) {
  g_coll = argc > 1 ? bench_coll_by_name(argv[1]) : NULL;
  if (!g_coll) {
    fprintf(stderr,
            "usage: %s <all_reduce|all_gather|reduce_scatter|alltoall|alltoallv|broadcast|reduce|gather|scatter|"
            "sendrecv> [options of the _perf binaries; -h lists them]\n",
            argv[0]);
    return 1;
  }
  static bench_backend be;
  be.name = "mpi";
  be.run = run;
  be.uses_nccl_comms = 0;
  be.inplace_unchecked = 0;
  be.refuse = refuse;
  be.error_string = error_string;
  be.max_agg_iters = 1;
  be.leading_args = 1; /* the collective */
  char program[64];
  snprintf(program, sizeof program, "mpi_perf %s", argv[1]);
  return bench_main(argc, argv, program, g_coll, &be);
}
