/* Declarations shared by the harness's own files (not by the benchmark programs). */
#ifndef COMM_BENCH_HARNESS_H
#define COMM_BENCH_HARNESS_H

#include "common.h"

#include <pthread.h>
#include <stdio.h>

#define BENCH_VERSION "0.1"

/* ---- datatypes and values (values.c) ---------------------------------------------------- */

typedef struct bench_type_info {
  const char* name; /* nccl-tests' spelling */
  ncclDataType_t type;
  size_t size;
  int is_float;
  int is_signed;
  int precision;     /* significand bits, hidden bit included (floats) */
  int64_t exact_max; /* every integer in [-exact_max, exact_max] (or [0, ..] unsigned) is exact */
  int max_pow2;      /* largest k with 2^k exact and in range */
} bench_type_info;

#define BENCH_NUM_TYPES 12
const bench_type_info* bench_type_at(int index);
const bench_type_info* bench_type_of(ncclDataType_t type);
int bench_type_index(const char* name); /* -1: "all"; -2: unknown */
const char* bench_op_name(int op);      /* "sum" .. "mulsum"; "none" for BENCH_NO_OP */
int bench_op_index(const char* name);   /* -1: "all"; -2: unknown */

/* Stores small integers (any datatype) and reads elements back. */
void bench_store(const bench_type_info* t, void* dst, int64_t v);
void bench_store_poison(const bench_type_info* t, void* dst);
double bench_load_double(const bench_type_info* t, const void* src);
int64_t bench_load_int(const bench_type_info* t, const void* src);
/* Encodes a double in a datatype, rounding to nearest even (the mulsum scalar, tests). */
void bench_encode(const bench_type_info* t, double v, void* dst);

/* How the input values of one test are made: chosen per (datatype, op, ranks) so that every
 * partial result of the reduction, in any order, is exactly representable (see README). */
enum bench_plan_kind { PLAN_SPREAD, PLAN_SPARSE, PLAN_PROD, PLAN_AVG };
typedef struct bench_plan {
  int kind;
  int op;     /* enum bench_op, or BENCH_NO_OP for collectives that only move data */
  int nranks;
  int64_t lo, hi;  /* SPREAD: values in [lo, hi]; AVG: the common part k in [lo, hi] */
  int ones;        /* SPARSE: ranks holding a 1 per element; PROD: ranks holding a 2 */
  int with_neg;    /* PROD: signed types also multiply by -1 now and then; AVG: +-1 offsets */
  uint64_t seed;
  double tolerance; /* 0: exact comparison */
} bench_plan;

void bench_plan_make(bench_plan* p, const bench_type_info* t, int op, int nranks, uint64_t seed);
int64_t bench_value(const bench_plan* p, int rank, uint64_t index);
/* The reduction over all ranks at `index`: sum for sum/avg (avg divides later), sum of scaled
 * values for mulsum, product, max, min. */
int64_t bench_reduced(const bench_plan* p, uint64_t index);
int64_t bench_mulsum_scalar(int rank);

/* ---- collectives (colls.c) -------------------------------------------------------------- */

typedef struct bench_counts {
  size_t send, recv, param;          /* elements */
  size_t send_inplace, recv_inplace; /* in-place view offsets in elements, times the rank */
  size_t bw;                         /* elements counted by algbw */
} bench_counts;

enum bench_bw_factor { BW_ONE, BW_ALLREDUCE, BW_NM1_N };

struct bench_coll {
  const char* name;
  int id;
  int reduces; /* takes an op */
  int rooted;  /* takes a root */
  enum bench_bw_factor factor;
};

enum { COLL_ALL_REDUCE, COLL_ALL_GATHER, COLL_REDUCE_SCATTER, COLL_ALLTOALL, COLL_ALLTOALLV,
       COLL_BROADCAST, COLL_REDUCE, COLL_GATHER, COLL_SCATTER, COLL_SENDRECV };

void bench_coll_counts(const bench_coll* c, size_t count, int nranks, size_t eltsize,
                       bench_counts* out);
double bench_bw_factor(const bench_coll* c, int nranks);
/* alltoallv: the count exchanged between ranks a and b (symmetric), for a mean of `base`. */
size_t bench_a2av_count(size_t base, int nranks, int a, int b);

/* One rank's view of one test: what it sends and what it must end up with. */
typedef struct bench_data {
  const bench_coll* coll;
  const bench_type_info* ti;
  int rank, nranks, root, in_place;
  bench_counts cnt;
  const size_t* counts; /* alltoallv */
  const size_t* displs;
  bench_plan plan;
} bench_data;

enum bench_expect_kind { EXPECT_FROM, EXPECT_REDUCED, EXPECT_UNCHANGED };
/* Element j of the send view: returns 0 when the element is not sent (filled with poison). */
int bench_send_source(const bench_data* d, size_t j, uint64_t* index);
/* Element j of the result view: EXPECT_FROM (rank *src's value at *index), EXPECT_REDUCED
 * (the reduction at *index) or EXPECT_UNCHANGED (what the buffer held before the call). */
int bench_expect(const bench_data* d, size_t j, int* src, uint64_t* index);

/* ---- CUDA, loaded at run time (cudart.c) --------------------------------------------------- */

enum { BENCH_H2D = 1, BENCH_D2H = 2 };
/* softgpu_counters()'s layout, version 1 (struct softgpu_counters in softgpu/counts.cpp). */
typedef struct bench_softgpu_counts {
  uint64_t version;
  uint64_t kernel_launches, write_values, wait_values, copies, memsets, host_funcs, event_records,
      event_waits, graph_launches, copy_bytes, captured;
  uint64_t copy_sizes[40];
} bench_softgpu_counts;
typedef struct bench_cuda {
  int (*GetDeviceCount)(int*);
  int (*SetDevice)(int);
  int (*Malloc)(void**, size_t);
  int (*Free)(void*);
  int (*Memcpy)(void*, const void*, size_t, int);
  int (*StreamCreateWithFlags)(cudaStream_t*, unsigned int);
  int (*StreamDestroy)(cudaStream_t);
  int (*StreamSynchronize)(cudaStream_t);
  int (*DeviceGetPCIBusId)(char*, int, int);
  const char* (*GetErrorString)(int);
  int (*MemGetInfo)(size_t*, size_t*); /* may be NULL */
  int (*cuInit)(unsigned);
  int (*cuDeviceGet)(int*, int);
  int (*cuDeviceGetName)(char*, int, int);
  /* softgpu's stand-in driver (softgpu/counts.cpp) only: the work its streams were given so far
   * in this process. NULL on a real driver. */
  int (*softgpu_counters)(struct bench_softgpu_counts*);
} bench_cuda;
extern bench_cuda bench_cu;
/* Loads libcudart (13, 12, unversioned) and libcuda; returns the device count, or -1 with the
 * reason in `why`. */
int bench_cuda_load(char* why, size_t len);
/* Copies n bytes of pageable host memory to device memory of GPU `dev` and waits until they
 * have landed: a synchronous cudaMemcpy from pageable memory may return once the source is
 * staged, and the benchmarks' non-blocking streams are not ordered after it; the device's
 * legacy stream is. Leaves `dev` current. Returns a cudaError_t. */
int bench_cuda_upload(int dev, void* dst, const void* src, size_t n);
/* Waits for stream `s` of GPU `dev`: the NULL stream is the legacy stream of the current
 * device, so `dev` is made current first. Returns a cudaError_t. */
int bench_cuda_sync(int dev, cudaStream_t s);
/* "[0000:18:00] NVIDIA H100 ..." parts of a device line. */
void bench_cuda_describe(int dev, unsigned* domain, unsigned* bus, unsigned* device, char* name,
                         size_t len);

/* ---- options and run-wide state (common.c) ---------------------------------------------- */

enum { MEM_AUTO, MEM_HOST, MEM_DEVICE };

typedef struct bench_opts {
  int nthreads, ngpus;
  size_t min_bytes, max_bytes, step_bytes, step_factor;
  int iters, agg_iters, warmup_iters, run_cycles;
  int parallel_init, check;
  int op;   /* enum bench_op, -1 all */
  int type; /* type index, -1 all */
  int root; /* -1 all */
  int blocking, stream_null, timeout, cudagraph, report_cputime, report_timestamps;
  int average, local_register, cta_policy, device_impl, device_cta_count, memory_report;
  int unalign, per_iter, per_iter_skip;
  const char* json_path;
  int memory;
} bench_opts;

extern bench_opts bench_opt;

/* ---- processes and synchronisation (launch.c) ------------------------------------------- */

enum { LAUNCH_SINGLE, LAUNCH_ENV, LAUNCH_MPI };

typedef struct bench_world {
  int launcher;
  /* Launcher ENV: which launcher's variables named this process, its job's identity (picks a
   * rendezvous port when MASTER_PORT is not set; NULL: none) and its local rank variable. */
  const char *launcher_name, *job_key, *local_rank_var;
  int proc, nprocs;
  int local_rank;
  int nthreads, ngpus, nranks;
  int device_mode;
  char hostname[256];
} bench_world;

extern bench_world bench_w;

typedef struct bench_thread bench_thread;

/* Starts MPI or reads RANK/WORLD_SIZE; fills proc/nprocs/launcher. */
int bench_launch_start(int* argc, char*** argv);
/* Out-of-band allgather of a fixed-size block per process (start-up only: before the
 * communicators exist). */
int bench_oob_allgather(const void* mine, void* all, size_t bytes);
int bench_oob_bcast(void* buf, size_t bytes); /* from process 0 */
void bench_oob_close(void);
void bench_launch_finish(void);
/* Ends the whole job now (every process when MPI runs it). */
void bench_exit_now(int status) __attribute__((noreturn));

enum { SYNC_SUM, SYNC_MIN, SYNC_MAX };
/* Every rank-driving thread of every process calls these at the same point. Values are per
 * thread; the result is the same everywhere. */
void bench_sync_reduce(bench_thread* t, double* vals, int n, int op);
void bench_sync_barrier(bench_thread* t);
/* The threads of this process only: unlike bench_sync_barrier, never a collective on a GPU (the
 * launcher ENV's processes meet through NCCL). */
void bench_local_barrier(bench_thread* t);
void bench_sync_init(int max_values);

/* ---- per-thread state (common.c) ---------------------------------------------------------- */

struct bench_thread {
  int thread;     /* index within the process */
  int first_rank; /* rank of its first communicator */
  int n;          /* communicators driven: -g */
  ncclComm_t* comms;
  cudaStream_t* streams;
  int* devs;
  char** send; /* buffers, unalign applied */
  char** recv;
  void** send_alloc;
  void** recv_alloc;
  void** reg_send;
  void** reg_recv;
  char** stage;     /* device mode: host staging of one buffer */
  size_t** counts;  /* alltoallv, per communicator */
  size_t** displs;
  ncclRedOp_t* ops; /* the op of the current test, per communicator */
  double** sync_buf; /* launcher ENV: per communicator, for the NCCL-based reductions */
  double* sync_host;
  double* iter_times;
  int status;
  pthread_t handle;
  /* timeout watchdog */
  volatile double deadline;
  const char* wait_file;
  int wait_line;
};

/* Fails the run: prints like nccl-tests and ends every process. */
void bench_fail_nccl(bench_thread* t, int rc, const char* file, int line) __attribute__((noreturn));
void bench_fail(int status, const char* fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
double bench_now(void);
void bench_watch_arm(bench_thread* t, const char* file, int line);
void bench_watch_disarm(bench_thread* t);

/* ---- output (report.c) -------------------------------------------------------------------- */

/* nccl-tests' number format: fits `value` in `width` characters. */
void bench_float_str(double value, int width, char* out);
int bench_json_open(const char* path, int argc, char** argv); /* 0, or -1: not written */
int bench_json_active(void);
void bench_json_begin_object(void);
void bench_json_end(void);
void bench_json_begin_list(void);
void bench_json_key(const char* key);
void bench_json_str(const char* s);
void bench_json_int(long long v);
void bench_json_double(double v);
void bench_json_bool_str(int v);
void bench_json_null(void);
void bench_json_close(const char* error);
void bench_timestamp(char* out, size_t len);
/* The library the program runs on: comm names itself, its version and git revision (commGetVersion,
 * looked up at run time so that the programs build and run against NVIDIA's NCCL as well); any
 * other is named by its NCCL version. `name` gets "comm" or "nccl", `version` its version. */
const char* bench_library(const char** name, const char** version);

#endif
