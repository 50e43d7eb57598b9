/* comm-bench: the harness shared by the nccl-tests-style benchmark programs.
 *
 * A program names one collective and one way of running it (a backend): the NCCL API for the
 * <name>_perf binaries, MPI for mpi_perf. The harness does everything else: options, ranks
 * (threads, processes started by MPI or by a torchrun-style launcher), buffers on host or
 * device memory, input values and the element-by-element check, timing, the output table and
 * the JSON file. See bench/README.md. */
#ifndef COMM_BENCH_COMMON_H
#define COMM_BENCH_COMMON_H

#include <nccl.h>
#include <stddef.h>
#include <stdint.h>

/* Reduction ops in nccl-tests order; mulsum is ncclRedOpCreatePreMulSum. */
enum bench_op { BENCH_SUM, BENCH_PROD, BENCH_MAX, BENCH_MIN, BENCH_AVG, BENCH_MULSUM, BENCH_NUM_OPS };
#define BENCH_NO_OP (-1)

/* Exit status of every program (nccl-tests' testResult_t where one exists). */
enum bench_status {
  BENCH_OK = 0,
  BENCH_ERR_INTERNAL = 1, /* bad usage, system call failures */
  BENCH_ERR_CUDA = 2,
  BENCH_ERR_NCCL = 3,
  BENCH_ERR_TIMEOUT = 4,
  BENCH_ERR_UNSUPPORTED = 5, /* an option value this build or this machine cannot honour */
  BENCH_ERR_MPI = 6,
  BENCH_ERR_RESULTS = 7 /* wrong results, or the average bus bandwidth below NCCL_TESTS_MIN_BW */
};

/* One operation of one rank: what a backend's run function receives. */
typedef struct bench_call {
  const void* sendbuff;
  void* recvbuff;
  size_t count; /* the count argument of the NCCL call (per-rank for the gather/scatter family) */
  ncclDataType_t type;
  ncclRedOp_t op; /* for mulsum, the op made by ncclRedOpCreatePreMulSum for this communicator */
  int op_index;   /* enum bench_op, or BENCH_NO_OP */
  int root;       /* -1 for collectives without one */
  int rank, nranks;
  int in_place;
  ncclComm_t comm; /* NULL for backends that bring their own communication (MPI) */
  cudaStream_t stream;
  /* alltoallv: this rank's per-peer element counts and displacements; the pattern is symmetric,
   * so what a rank sends to p has the size of what it receives from p and both sides use the
   * same arrays. */
  const size_t* counts;
  const size_t* displs;
} bench_call;

/* Runs one operation; returns 0 or the backend's error code (ncclResult_t for NCCL). */
typedef int (*bench_run_fn)(const bench_call* call);

typedef struct bench_coll bench_coll; /* what a collective moves: colls.c */

extern const bench_coll bench_all_reduce, bench_all_gather, bench_reduce_scatter, bench_alltoall,
    bench_alltoallv, bench_broadcast, bench_reduce, bench_gather, bench_scatter, bench_sendrecv;

/* The collective called `name` ("all_reduce", ...), or NULL. */
const bench_coll* bench_coll_by_name(const char* name);
const char* bench_coll_name(const bench_coll* coll);

typedef struct bench_backend {
  const char* name; /* "nccl" or "mpi" */
  bench_run_fn run;
  int uses_nccl_comms;   /* 0: no NCCL communicators are made (MPI brings its own) */
  int inplace_unchecked; /* in-place has no defined result here: time it, print N/A for #wrong */
  /* Why this backend cannot run a datatype or op (NULL when it can). */
  const char* (*refuse)(const bench_coll* coll, ncclDataType_t type, int op_index);
  const char* (*error_string)(int rc);
  int max_agg_iters; /* 0: any -m; 1: -m must be 1 */
  int leading_args;  /* arguments the program itself takes before the options (mpi_perf: 1) */
} bench_backend;

/* The whole program: parses argv, runs, returns the exit status. */
int bench_main(int argc, char** argv, const char* program, const bench_coll* coll,
               const bench_backend* backend);

/* The same for the NCCL-API binaries: `run` makes the NCCL call(s) of one rank. */
int bench_nccl_main(int argc, char** argv, const bench_coll* coll, bench_run_fn run,
                    int inplace_unchecked);

/* Bytes per element of an NCCL datatype. */
size_t bench_type_size(ncclDataType_t type);

#endif
