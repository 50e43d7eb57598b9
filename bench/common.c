/* The benchmark driver: options, set-up, the timing and checking loops, the output table.
 *
 * Shape of a run (nccl-tests' own): every process starts -t threads, each driving -g ranks
 * (communicators) inside ncclGroupStart/End; every thread sweeps sizes for each datatype, op
 * and root; for each size it times out-of-place and in-place, checks the results, and thread
 * 0 of process 0 prints one row. */
#define _GNU_SOURCE
#include "harness.h"

#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

bench_opts bench_opt;

static const bench_coll* g_coll;
static const bench_backend* g_be;
static const char* g_program;
static bench_thread* g_threads;
static size_t g_buf_bytes; /* usable bytes of each buffer: the largest size of the sweep */
static int g_types[BENCH_NUM_TYPES], g_ntypes;
static int g_ops[BENCH_NUM_OPS], g_nops;
static volatile int g_timed_out;
static double g_mem[3];        /* init bytes, buffer bytes, usage after buffers */
static double g_mem_report[3]; /* init, user-allocated, collective: max over processes */
static int64_t mem_used(void);
static double g_bw_sum;
static int g_bw_count, g_errors;

/* On softgpu's stand-in driver (device memory, softgpu_counters in every process): the work each
 * timed call gave the GPU, per call and rank, reported under each row. */
enum { GC_KERNELS, GC_WRITES, GC_WAITS, GC_COPIES, GC_COPY_BYTES, GC_MEMSETS, GC_HOST_FUNCS,
       GC_EVENT_RECORDS, GC_EVENT_WAITS, GC_GRAPH_LAUNCHES, GC_N };
static int g_gpu_counts;
static double g_row_counts[2][GC_N]; /* out-of-place, in-place: the row being printed */

double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int is_main(const bench_thread* t) { return bench_w.proc == 0 && t->thread == 0; }

/* A table row is half printed: a failure line must start on a line of its own. */
static volatile int g_row_open = 0;

static void end_open_row(void) {
  if (g_row_open) {
    g_row_open = 0;
    fputs("\n", stdout);
  }
}

/* ---- failures ---------------------------------------------------------------------------------- */

static const char* base_name(const char* path) {
  const char* s = strrchr(path, '/');
  return s ? s + 1 : path;
}

void bench_fail(int status, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  end_open_row();
  fputs(msg, stdout);
  bench_json_close(msg);
  bench_exit_now(g_timed_out ? BENCH_ERR_TIMEOUT : status);
}

void bench_fail_nccl(bench_thread* t, int rc, const char* file, int line) {
  if (g_timed_out) bench_exit_now(BENCH_ERR_TIMEOUT); /* the watchdog aborted the call */
  const char* last = g_be->uses_nccl_comms ? ncclGetLastError(t && t->comms ? t->comms[0] : NULL) : "";
  bench_fail(g_be->uses_nccl_comms ? BENCH_ERR_NCCL : BENCH_ERR_MPI, "%s: Test %s failure %s:%d '%s / %s'\n",
             bench_w.hostname, g_be->uses_nccl_comms ? "NCCL" : "MPI", base_name(file), line,
             g_be->error_string(rc), last ? last : "");
}

#define NCCLCHECK(t, call)                                                     \
  do {                                                                         \
    ncclResult_t r_ = (call);                                                  \
    if (r_ != ncclSuccess) bench_fail_nccl((t), (int)r_, __FILE__, __LINE__); \
  } while (0)

#define CUDACHECK(call)                                                                               \
  do {                                                                                                \
    int e_ = (call);                                                                                  \
    if (e_ != 0)                                                                                      \
      bench_fail(BENCH_ERR_CUDA, "%s: Test CUDA failure %s:%d '%s'\n", bench_w.hostname, base_name(__FILE__), \
                 __LINE__, bench_cu.GetErrorString(e_));                                              \
  } while (0)

/* ---- the -T watchdog ----------------------------------------------------------------------- */

void bench_watch_arm(bench_thread* t, const char* file, int line) {
  if (!bench_opt.timeout || !t) return;
  t->wait_file = file;
  t->wait_line = line;
  t->deadline = bench_now() + bench_opt.timeout;
}

void bench_watch_disarm(bench_thread* t) {
  if (t) t->deadline = 0;
}

static void* watchdog(void* arg) {
  (void)arg;
  for (;;) {
    usleep(50 * 1000);
    double now = bench_now();
    for (int i = 0; i < bench_w.nthreads; i++) {
      bench_thread* t = &g_threads[i];
      double d = t->deadline;
      if (d <= 0 || now <= d) continue;
      g_timed_out = 1;
      end_open_row();
      printf("%s: Test timeout (%ds) %s:%d\n", bench_w.hostname, bench_opt.timeout, base_name(t->wait_file),
             t->wait_line);
      fflush(stdout);
      /* Unblock the stuck calls (and let the other processes notice), then stop. */
      if (g_be->uses_nccl_comms)
        for (int k = 0; k < bench_w.nthreads; k++)
          for (int c = 0; c < g_threads[k].n; c++)
            if (g_threads[k].comms[c]) ncclCommAbort(g_threads[k].comms[c]);
      bench_json_close("Test timeout");
      bench_exit_now(BENCH_ERR_TIMEOUT);
    }
  }
  return NULL;
}

/* ---- options ------------------------------------------------------------------------------ */

static double parse_size(const char* s) {
  double v;
  char unit;
  int n = sscanf(s, "%lf %1c", &v, &unit);
  if (n == 2) {
    switch (unit) {
      case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
      case 'M': case 'm': v *= 1024.0 * 1024; break;
      case 'K': case 'k': v *= 1024.0; break;
      default: return -1;
    }
  } else if (n != 1) {
    return -1;
  }
  /* Beyond 2^62 bytes a size is a typing error (and would not fit a size_t sum). */
  return v >= 0 && v <= 4611686018427387904.0 ? v : -1;
}

enum { OPT_MEMORY = 1000 };

static const struct option long_options[] = {
    {"nthreads", required_argument, 0, 't'},
    {"ngpus", required_argument, 0, 'g'},
    {"minbytes", required_argument, 0, 'b'},
    {"maxbytes", required_argument, 0, 'e'},
    {"stepbytes", required_argument, 0, 'i'},
    {"stepfactor", required_argument, 0, 'f'},
    {"iters", required_argument, 0, 'n'},
    {"agg_iters", required_argument, 0, 'm'},
    {"warmup_iters", required_argument, 0, 'w'},
    {"run_cycles", required_argument, 0, 'N'},
    {"parallel_init", required_argument, 0, 'p'},
    {"check", required_argument, 0, 'c'},
    {"op", required_argument, 0, 'o'},
    {"datatype", required_argument, 0, 'd'},
    {"root", required_argument, 0, 'r'},
    {"blocking", required_argument, 0, 'z'},
    {"stream_null", required_argument, 0, 'y'},
    {"timeout", required_argument, 0, 'T'},
    {"cudagraph", required_argument, 0, 'G'},
    {"report_cputime", required_argument, 0, 'C'},
    {"report_timestamps", required_argument, 0, 'S'},
    {"output_file", required_argument, 0, 'J'},
    {"average", required_argument, 0, 'a'},
    {"local_register", required_argument, 0, 'R'},
    {"cta_policy", required_argument, 0, 'x'},
    {"device_implementation", required_argument, 0, 'D'},
    {"device_cta_count", required_argument, 0, 'V'},
    {"memory", required_argument, 0, OPT_MEMORY},
    {"memory_report", required_argument, 0, 'M'},
    {"unalign", required_argument, 0, 'u'},
    {"per_iter_timing", required_argument, 0, 'I'},
    {"per_iter_skip", required_argument, 0, 'K'},
    {"help", no_argument, 0, 'h'},
    {0, 0, 0, 0}};

static void usage(const char* prog) {
  printf("USAGE: %s \n\t"
         "[-t,--nthreads <num threads>] \n\t"
         "[-g,--ngpus <ranks per thread>] \n\t"
         "[-b,--minbytes <min size in bytes>] \n\t"
         "[-e,--maxbytes <max size in bytes>] \n\t"
         "[-i,--stepbytes <increment size>] \n\t"
         "[-f,--stepfactor <increment factor>] \n\t"
         "[-n,--iters <iteration count>] \n\t"
         "[-m,--agg_iters <aggregated iteration count>] \n\t"
         "[-w,--warmup_iters <warmup iteration count>] \n\t"
         "[-N,--run_cycles <cycle count> run & print each cycle (default: 1; 0=infinite)] \n\t"
         "[-p,--parallel_init <0/1>] \n\t"
         "[-c,--check <check iteration count>] \n\t"
         "[-o,--op <sum/prod/min/max/avg/mulsum/all>] \n\t"
         "[-d,--datatype <nccltype/all>] \n\t"
         "[-r,--root <root>/-1 for all roots] \n\t"
         "[-z,--blocking <0/1/2/3>] \n\t"
         "[-y,--stream_null <0/1>] \n\t"
         "[-T,--timeout <time in seconds>] \n\t"
         "[-G,--cudagraph <num graph launches>] \n\t"
         "[-C,--report_cputime <0/1>] \n\t"
         "[-S,--report_timestamps <0/1> report timestamps (default 0)] \n\t"
         "[-J,--output_file <file.json> write JSON output] \n\t"
         "[-a,--average <0/1/2/3> report average iteration time <0=RANK0/1=AVG/2=MIN/3=MAX>] \n\t"
         "[-R,--local_register <0/1/2> local (1) or symmetric (2) buffer registration] \n\t"
         "[-x,--cta_policy <0/1/2> set CTA policy] \n\t"
         "[-D,--device_implementation <implementation number>] \n\t"
         "[-V,--device_cta_count <number>] \n\t"
         "[-M,--memory_report <0/1> enable memory usage report (default: 0)] \n\t"
         "[--memory <host/device> buffer memory (default: device when usable, else host)] \n\t"
         "[-u,--unalign <elements> misalign buffers] \n\t"
         "[-I,--per_iter_timing <0/1> per-iteration statistics] \n\t"
         "[-K,--per_iter_skip <count> samples dropped from -I statistics] \n\t"
         "[-h,--help]\n",
         prog);
}

/* Parses argv into bench_opt; returns -1 to go on, else the exit status. */
static int parse_options(int argc, char** argv, int quiet) {
  bench_opts* o = &bench_opt;
  memset(o, 0, sizeof *o);
  o->nthreads = o->ngpus = 1;
  o->min_bytes = o->max_bytes = 32 << 20;
  o->step_bytes = 1 << 20;
  o->step_factor = 1;
  o->iters = 20;
  o->agg_iters = 1;
  o->warmup_iters = 1;
  o->run_cycles = 1;
  o->check = 1;
  o->op = BENCH_SUM;
  o->type = bench_type_index("float");
  o->average = 1;
  o->cta_policy = -1;
  o->device_cta_count = 16;
  o->memory = MEM_AUTO;
  optind = 1 + g_be->leading_args;
  int c, idx;
  double parsed;
  while ((c = getopt_long(argc, argv, "t:g:b:e:i:f:n:m:w:N:p:I:K:c:o:d:r:z:y:T:hG:C:a:R:x:D:V:J:S:M:u:",
                          long_options, &idx)) != -1) {
    switch (c) {
      case 't': o->nthreads = (int)strtol(optarg, NULL, 0); break;
      case 'g': o->ngpus = (int)strtol(optarg, NULL, 0); break;
      case 'b':
      case 'e':
      case 'i':
        parsed = parse_size(optarg);
        if (parsed < 0) {
          if (!quiet)
            fprintf(stderr, "invalid size specified for '%s'\n", c == 'b' ? "minbytes" : c == 'e' ? "maxbytes" : "stepbytes");
          return BENCH_ERR_INTERNAL;
        }
        if (c == 'b') o->min_bytes = (size_t)parsed;
        if (c == 'e') o->max_bytes = (size_t)parsed;
        if (c == 'i') o->step_bytes = (size_t)parsed;
        break;
      case 'f': o->step_factor = (size_t)strtol(optarg, NULL, 0); break;
      case 'n': o->iters = (int)strtol(optarg, NULL, 0); break;
      case 'm': o->agg_iters = (int)strtol(optarg, NULL, 0); break;
      case 'w': o->warmup_iters = (int)strtol(optarg, NULL, 0); break;
      case 'N': o->run_cycles = (int)strtol(optarg, NULL, 0); break;
      case 'p': o->parallel_init = (int)strtol(optarg, NULL, 0); break;
      case 'c': o->check = (int)strtol(optarg, NULL, 0); break;
      case 'o':
        o->op = bench_op_index(optarg);
        if (o->op == -2) {
          if (!quiet) printf("invalid op %s, defaulting to sum .. \n", optarg);
          o->op = BENCH_SUM;
        }
        break;
      case 'd':
        o->type = bench_type_index(optarg);
        if (o->type == -2) {
          if (!quiet) printf("invalid type %s, defaulting to float .. \n", optarg);
          o->type = bench_type_index("float");
        }
        break;
      case 'r': o->root = (int)strtol(optarg, NULL, 0); break;
      case 'z': o->blocking = (int)strtol(optarg, NULL, 0); break;
      case 'y': o->stream_null = (int)strtol(optarg, NULL, 0); break;
      case 'T': o->timeout = (int)strtol(optarg, NULL, 0); break;
      case 'G': o->cudagraph = (int)strtol(optarg, NULL, 0); break;
      case 'C': o->report_cputime = (int)strtol(optarg, NULL, 0); break;
      case 'S': o->report_timestamps = (int)strtol(optarg, NULL, 0); break;
      case 'J': o->json_path = optarg; break;
      case 'a': o->average = (int)strtol(optarg, NULL, 0); break;
      case 'R': o->local_register = (int)strtol(optarg, NULL, 0); break;
      case 'x': o->cta_policy = (int)strtol(optarg, NULL, 0); break;
      case 'D': o->device_impl = (int)strtol(optarg, NULL, 0); break;
      case 'V': o->device_cta_count = (int)strtol(optarg, NULL, 0); break;
      case 'M': o->memory_report = (int)strtol(optarg, NULL, 0); break;
      case 'u': o->unalign = (int)strtol(optarg, NULL, 0); break;
      case 'I': o->per_iter = (int)strtol(optarg, NULL, 0); break;
      case 'K': o->per_iter_skip = (int)strtol(optarg, NULL, 0); break;
      case OPT_MEMORY:
        /* --memory host|device picks the buffers; a number keeps nccl-tests' meaning of
         * --memory (the -M report). */
        if (strcmp(optarg, "host") == 0)
          o->memory = MEM_HOST;
        else if (strcmp(optarg, "device") == 0)
          o->memory = MEM_DEVICE;
        else if (strcmp(optarg, "auto") == 0)
          o->memory = MEM_AUTO;
        else {
          char* end;
          long v = strtol(optarg, &end, 0);
          if (*optarg == 0 || *end) {
            if (!quiet) fprintf(stderr, "invalid --memory '%s': host, device, or 0/1 for the memory report\n", optarg);
            return BENCH_ERR_INTERNAL;
          }
          o->memory_report = (int)v;
        }
        break;
      case 'h':
        if (!quiet) usage(basename(argv[0]));
        return BENCH_OK;
      default:
        if (!quiet) usage(basename(argv[0]));
        return BENCH_ERR_INTERNAL;
    }
  }
  if (optind < argc) {
    if (!quiet) fprintf(stderr, "unexpected argument '%s'\n", argv[optind]);
    return BENCH_ERR_INTERNAL;
  }
  return -1;
}

/* Checks values against what this program can do; returns -1 when all is well. */
static int check_options(int quiet) {
  bench_opts* o = &bench_opt;
#define BAD(status, ...)                              \
  do {                                                \
    if (!quiet) fprintf(stderr, __VA_ARGS__);         \
    return status;                                    \
  } while (0)
  if (o->nthreads < 1 || o->ngpus < 1) BAD(BENCH_ERR_INTERNAL, "invalid -t %d / -g %d: both must be at least 1\n", o->nthreads, o->ngpus);
  if (o->min_bytes > o->max_bytes)
    BAD(BENCH_ERR_INTERNAL, "invalid sizes for 'minbytes' and 'maxbytes': %zu > %zu\n", o->min_bytes, o->max_bytes);
  if (o->step_factor <= 1 && o->step_bytes == 0) BAD(BENCH_ERR_INTERNAL, "invalid -i 0 without -f: the sweep would not advance\n");
  if (o->iters < 1) BAD(BENCH_ERR_INTERNAL, "invalid -n %d: at least one iteration\n", o->iters);
  if (o->agg_iters < 1) BAD(BENCH_ERR_INTERNAL, "invalid -m %d: at least 1\n", o->agg_iters);
  if (o->warmup_iters < 0 || o->run_cycles < 0 || o->check < 0 || o->timeout < 0 || o->unalign < 0)
    BAD(BENCH_ERR_INTERNAL, "invalid negative -w/-N/-c/-T/-u value\n");
  if (o->root < -1) BAD(BENCH_ERR_INTERNAL, "invalid -r %d: a rank, or -1 for every root in turn\n", o->root);
  if (o->blocking < 0 || o->blocking > 3) BAD(BENCH_ERR_INTERNAL, "invalid -z %d: 0, 1, 2 or 3\n", o->blocking);
  if (o->average < 0 || o->average > 3) BAD(BENCH_ERR_INTERNAL, "invalid -a %d: 0, 1, 2 or 3\n", o->average);
  if (o->per_iter_skip < 0 || (o->per_iter && o->per_iter_skip >= o->iters))
    BAD(BENCH_ERR_INTERNAL, "invalid -K %d: must leave at least one of the %d iterations\n", o->per_iter_skip, o->iters);
  if (o->cta_policy < -1 || o->cta_policy > 2) BAD(BENCH_ERR_INTERNAL, "invalid -x %d: 0, 1 or 2\n", o->cta_policy);
  if (o->device_cta_count < 1 || o->device_cta_count > 128)
    BAD(BENCH_ERR_INTERNAL, "invalid -V %d: 1 to 128\n", o->device_cta_count);
  if (o->json_path) {
    size_t n = strlen(o->json_path);
    if (n < 5 || strcmp(o->json_path + n - 5, ".json") != 0)
      BAD(BENCH_ERR_UNSUPPORTED, "not supported: -J %s: only .json output files are written\n", o->json_path);
  }
  if (o->cudagraph > 0)
    BAD(BENCH_ERR_UNSUPPORTED,
        "not supported: -G %d: CUDA graph capture is not implemented by comm-bench (it needs device memory "
        "and a library that captures its work on the stream)\n",
        o->cudagraph);
  if (o->device_impl > 0)
    BAD(BENCH_ERR_UNSUPPORTED, "not supported: -D %d: device-API kernel implementations are not part of comm-bench\n",
        o->device_impl);
  if (o->local_register < 0 || o->local_register > 2) BAD(BENCH_ERR_INTERNAL, "invalid -R %d: 0, 1 or 2\n", o->local_register);
  if (o->local_register == 2) {
#ifdef COMM_FEATURE_WINDOWS
    int f = 0;
    commGetFeatures(&f);
    if (!(f & COMM_FEATURE_WINDOWS))
      BAD(BENCH_ERR_UNSUPPORTED,
          "not supported: -R 2: this libcomm build has no windows (commGetFeatures lacks COMM_FEATURE_WINDOWS)\n");
#endif
  }
  /* What the backend cannot do. */
  if (!g_be->uses_nccl_comms) {
    if (o->nthreads > 1 || o->ngpus > 1)
      BAD(BENCH_ERR_UNSUPPORTED, "not supported: -t %d -g %d with %s: one rank per process (start more processes)\n",
          o->nthreads, o->ngpus, g_be->name);
    if (o->local_register) BAD(BENCH_ERR_UNSUPPORTED, "not supported: -R %d with %s: no buffer registration\n", o->local_register, g_be->name);
    if (o->memory == MEM_DEVICE) BAD(BENCH_ERR_UNSUPPORTED, "not supported: --memory device with %s: host buffers only\n", g_be->name);
  }
  if (g_be->max_agg_iters && o->agg_iters > g_be->max_agg_iters)
    BAD(BENCH_ERR_UNSUPPORTED, "not supported: -m %d with %s: it has no way to aggregate operations\n", o->agg_iters, g_be->name);
  if (o->type >= 0) {
    const char* why = g_be->refuse(g_coll, bench_type_at(o->type)->type, BENCH_NO_OP);
    if (why) BAD(BENCH_ERR_UNSUPPORTED, "not supported: -d %s: %s\n", bench_type_at(o->type)->name, why);
  }
  if (g_coll->reduces && o->op >= 0) {
    const char* why = g_be->refuse(g_coll, ncclFloat32, o->op);
    if (why) BAD(BENCH_ERR_UNSUPPORTED, "not supported: -o %s: %s\n", bench_op_name(o->op), why);
  }
#undef BAD
  return -1;
}

/* ---- buffers and data ------------------------------------------------------------------- */

typedef struct test {
  const bench_type_info* ti;
  int op, root;
  size_t ts;
  bench_counts cnt;
  size_t total_bytes; /* max(send, recv) bytes: the size column */
} test;

static void set_size(bench_thread* t, test* x, size_t bytes) {
  bench_coll_counts(g_coll, bytes / x->ts, bench_w.nranks, x->ts, &x->cnt);
  x->total_bytes = (x->cnt.send > x->cnt.recv ? x->cnt.send : x->cnt.recv) * x->ts;
  if (g_coll->id == COLL_ALLTOALLV) {
    for (int i = 0; i < t->n; i++) {
      size_t off = 0;
      for (int p = 0; p < bench_w.nranks; p++) {
        t->counts[i][p] = bench_a2av_count(x->cnt.param, bench_w.nranks, t->first_rank + i, p);
        t->displs[i][p] = off;
        off += t->counts[i][p];
      }
    }
  }
}

static void make_data(const bench_thread* t, const test* x, int i, int in_place, uint64_t seed, bench_data* d) {
  memset(d, 0, sizeof *d);
  d->coll = g_coll;
  d->ti = x->ti;
  d->rank = t->first_rank + i;
  d->nranks = bench_w.nranks;
  d->root = x->root;
  d->in_place = in_place;
  d->cnt = x->cnt;
  if (g_coll->id == COLL_ALLTOALLV) {
    d->counts = t->counts[i];
    d->displs = t->displs[i];
  }
  bench_plan_make(&d->plan, x->ti, g_coll->reduces ? x->op : BENCH_NO_OP, bench_w.nranks, seed);
}

/* Fills element j of the send view (poison where nothing is sent). */
static void put_send(const bench_data* d, char* view, size_t j) {
  uint64_t g;
  char* dst = view + j * d->ti->size;
  if (bench_send_source(d, j, &g))
    bench_store(d->ti, dst, bench_value(&d->plan, d->rank, g));
  else
    bench_store_poison(d->ti, dst);
}

static void poison(const bench_type_info* ti, char* p, size_t n) {
  if (n == 0) return;
  bench_store_poison(ti, p);
  for (size_t j = 1; j < n; j++) memcpy(p + j * ti->size, p, ti->size);
}

/* Writes every rank's inputs (and poisons what it receives into) for one check or timing. */
static void init_data(bench_thread* t, const test* x, int in_place, uint64_t seed) {
  size_t ts = x->ts;
  for (int i = 0; i < t->n; i++) {
    bench_data d;
    make_data(t, x, i, in_place, seed, &d);
    size_t so = x->cnt.send_inplace * (size_t)d.rank, ro = x->cnt.recv_inplace * (size_t)d.rank;
    char* stage = bench_w.device_mode ? t->stage[i] : NULL;
    if (in_place) {
      size_t region = so + x->cnt.send;
      if (ro + x->cnt.recv > region) region = ro + x->cnt.recv;
      char* img = stage ? stage : t->recv[i];
      poison(x->ti, img, region);
      for (size_t j = 0; j < x->cnt.send; j++) put_send(&d, img + so * ts, j);
      if (stage && region) CUDACHECK(bench_cuda_upload(t->devs[i], t->recv[i], stage, region * ts));
    } else {
      char* img = stage ? stage : t->send[i];
      for (size_t j = 0; j < x->cnt.send; j++) put_send(&d, img, j);
      if (stage && x->cnt.send) CUDACHECK(bench_cuda_upload(t->devs[i], t->send[i], stage, x->cnt.send * ts));
      img = stage ? stage : t->recv[i];
      poison(x->ti, img, x->cnt.recv);
      if (stage && x->cnt.recv) CUDACHECK(bench_cuda_upload(t->devs[i], t->recv[i], stage, x->cnt.recv * ts));
    }
  }
}

/* Testing aids: COMM_BENCH_DEBUG_CORRUPT=<rank> flips a bit of that rank's result before the
 * check; COMM_BENCH_DEBUG_STALL=<rank> makes that rank stop answering (for -T). */
static int debug_rank(const char* name) {
  const char* s = getenv(name);
  return s && *s ? atoi(s) : -1;
}

/* Whether an element holds exactly the integer v. */
static int same_value(const bench_type_info* ti, const char* elem, int64_t v, double* want) {
  *want = (double)v;
  return ti->is_float ? bench_load_double(ti, elem) == *want : bench_load_int(ti, elem) == v;
}

/* Compares every element of each rank's result view with its expected value; returns the
 * number of wrong elements of this thread's ranks. */
static long long verify(bench_thread* t, const test* x, int in_place, uint64_t seed) {
  size_t ts = x->ts;
  long long wrong_total = 0;
  char poison_bytes[8];
  bench_store_poison(x->ti, poison_bytes);
  for (int i = 0; i < t->n; i++) {
    bench_data d;
    make_data(t, x, i, in_place, seed, &d);
    size_t so = x->cnt.send_inplace * (size_t)d.rank;
    size_t vo = in_place ? x->cnt.recv_inplace * (size_t)d.rank : 0;
    char* view = t->recv[i] + vo * ts;
    if (bench_w.device_mode) {
      if (x->cnt.recv) CUDACHECK(bench_cu.Memcpy(t->stage[i], view, x->cnt.recv * ts, BENCH_D2H));
      view = t->stage[i];
    }
    if (x->cnt.recv && d.rank == debug_rank("COMM_BENCH_DEBUG_CORRUPT")) view[0] ^= 1; /* testing aid */
    const bench_type_info* ti = x->ti;
    long long wrong = 0;
    size_t first = 0;
    double first_got = 0, first_want = 0;
    for (size_t j = 0; j < x->cnt.recv; j++) {
      const char* elem = view + j * ts;
      int src = 0;
      uint64_t g = 0;
      int kind = bench_expect(&d, j, &src, &g);
      int ok;
      double want = NAN;
      if (kind == EXPECT_UNCHANGED) {
        size_t b = vo + j; /* position in the buffer: in place, it may be one of the inputs */
        uint64_t gs;
        if (in_place && b >= so && b < so + x->cnt.send && bench_send_source(&d, b - so, &gs))
          ok = same_value(ti, elem, bench_value(&d.plan, d.rank, gs), &want);
        else
          ok = memcmp(elem, poison_bytes, ts) == 0;
      } else if (kind == EXPECT_FROM) {
        ok = same_value(ti, elem, bench_value(&d.plan, src, g), &want);
      } else if (x->op == BENCH_AVG && ti->is_float) {
        want = (double)bench_reduced(&d.plan, g) / d.nranks;
        ok = fabs(bench_load_double(ti, elem) - want) <= d.plan.tolerance;
      } else {
        int64_t v = bench_reduced(&d.plan, g);
        if (x->op == BENCH_AVG) v /= d.nranks; /* exact: integer inputs sum to a multiple of n */
        ok = same_value(ti, elem, v, &want);
      }
      if (!ok) {
        if (wrong == 0) {
          first = j;
          first_got = bench_load_double(ti, elem);
          first_want = want;
        }
        wrong++;
      }
    }
    if (wrong) {
      fprintf(stderr, "%s: rank=%d #wrong=%lld (%s %s %s%s, %zu bytes; first at element %zu: got %.9g, want %.9g)\n",
              bench_w.hostname, d.rank, wrong, g_coll->name, ti->name, bench_op_name(g_coll->reduces ? x->op : -1),
              in_place ? " in-place" : "", x->total_bytes, first, first_got, first_want);
    }
    wrong_total += wrong;
  }
  return wrong_total;
}

/* ---- launching operations --------------------------------------------------------------- */

static void launch(bench_thread* t, const test* x, int iter, int in_place) {
  size_t ts = x->ts;
  /* Successive iterations use successive slices of the buffers, as nccl-tests does. */
  size_t steps = x->total_bytes ? g_buf_bytes / x->total_bytes : 1;
  if (steps == 0) steps = 1;
  size_t shift = x->total_bytes * ((size_t)iter % steps);
  bench_watch_arm(t, __FILE__, __LINE__);
  int grouped = g_be->uses_nccl_comms && t->n > 1;
  if (grouped) NCCLCHECK(t, ncclGroupStart());
  for (int i = 0; i < t->n; i++) {
    bench_call call;
    memset(&call, 0, sizeof call);
    int rank = t->first_rank + i;
    char* sb = t->send[i] + shift;
    char* rb = t->recv[i] + shift;
    call.sendbuff = in_place ? rb + x->cnt.send_inplace * (size_t)rank * ts : sb;
    call.recvbuff = in_place ? rb + x->cnt.recv_inplace * (size_t)rank * ts : rb;
    call.count = x->cnt.param;
    call.type = x->ti->type;
    call.op = t->ops[i];
    call.op_index = g_coll->reduces ? x->op : BENCH_NO_OP;
    call.root = g_coll->rooted ? x->root : -1;
    call.rank = rank;
    call.nranks = bench_w.nranks;
    call.in_place = in_place;
    call.comm = t->comms ? t->comms[i] : NULL;
    call.stream = t->streams[i];
    if (g_coll->id == COLL_ALLTOALLV) {
      call.counts = t->counts[i];
      call.displs = t->displs[i];
    }
    int rc = g_be->run(&call);
    if (rc) bench_fail_nccl(t, rc, __FILE__, __LINE__);
  }
  if (grouped) NCCLCHECK(t, ncclGroupEnd());
}

/* Waits until this thread's operations are done: on host memory they are when the call returns. */
static void complete(bench_thread* t) {
  if (bench_w.device_mode)
    for (int i = 0; i < t->n; i++) CUDACHECK(bench_cuda_sync(t->devs[i], t->streams[i]));
  bench_watch_disarm(t);
}

static void make_ops(bench_thread* t, const test* x) {
  static const ncclRedOp_t builtin[] = {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg};
  for (int i = 0; i < t->n; i++) {
    t->ops[i] = ncclSum;
    if (!g_coll->reduces || !g_be->uses_nccl_comms) continue;
    if (x->op < BENCH_MULSUM) {
      t->ops[i] = builtin[x->op];
    } else {
      char scalar[8] = {0};
      bench_encode(x->ti, (double)bench_mulsum_scalar(t->first_rank + i), scalar);
      NCCLCHECK(t, ncclRedOpCreatePreMulSum(&t->ops[i], scalar, x->ti->type, ncclScalarHostImmediate, t->comms[i]));
    }
  }
}

static void free_ops(bench_thread* t, const test* x) {
  if (!g_coll->reduces || !g_be->uses_nccl_comms || x->op != BENCH_MULSUM) return;
  for (int i = 0; i < t->n; i++) NCCLCHECK(t, ncclRedOpDestroy(t->ops[i], t->comms[i]));
}

/* ---- the stand-in's counts ----------------------------------------------------------------- */

/* This process's counts, read by its thread 0 between two barriers of its threads: every thread
 * has given its earlier work and none has started the next. Barriers of this process only, as
 * the counts are the process's and the run-wide ones may be collectives themselves. */
static void gpu_counts_take(bench_thread* t, bench_softgpu_counts* out) {
  bench_local_barrier(t);
  if (t->thread == 0 && bench_cu.softgpu_counters(out) != 0) memset(out, 0, sizeof *out);
  bench_local_barrier(t);
}

/* The counts between two snapshots, summed over processes, per call (`calls` per rank) and rank:
 * the same result in every thread. */
static void gpu_counts_per_call(bench_thread* t, const bench_softgpu_counts* a, const bench_softgpu_counts* b,
                                double calls, double* out) {
  for (int k = 0; k < GC_N; k++) out[k] = 0;
  if (t->thread == 0) {
    out[GC_KERNELS] = (double)(b->kernel_launches - a->kernel_launches);
    out[GC_WRITES] = (double)(b->write_values - a->write_values);
    out[GC_WAITS] = (double)(b->wait_values - a->wait_values);
    out[GC_COPIES] = (double)(b->copies - a->copies);
    out[GC_COPY_BYTES] = (double)(b->copy_bytes - a->copy_bytes);
    out[GC_MEMSETS] = (double)(b->memsets - a->memsets);
    out[GC_HOST_FUNCS] = (double)(b->host_funcs - a->host_funcs);
    out[GC_EVENT_RECORDS] = (double)(b->event_records - a->event_records);
    out[GC_EVENT_WAITS] = (double)(b->event_waits - a->event_waits);
    out[GC_GRAPH_LAUNCHES] = (double)(b->graph_launches - a->graph_launches);
  }
  bench_sync_reduce(t, out, GC_N, SYNC_SUM);
  for (int k = 0; k < GC_N; k++) out[k] /= calls * bench_w.nranks;
}

static void gpu_counts_json(const double* c) {
  static const char* const keys[GC_N] = {"kernels", "write_values", "wait_values", "copies", "copy_bytes",
                                         "memsets", "host_funcs", "event_records", "event_waits",
                                         "graph_launches"};
  bench_json_key("softgpu_per_call_per_rank");
  bench_json_begin_object();
  for (int k = 0; k < GC_N; k++) {
    bench_json_key(keys[k]);
    bench_json_double(c[k]);
  }
  bench_json_key("memops");
  bench_json_double(c[GC_WRITES] + c[GC_WAITS]);
  bench_json_end();
}

/* One comment line under the row: the table itself stays nccl-tests'. */
static void gpu_counts_line(const test* x) {
  printf("# softgpu: size=%zu", x->total_bytes);
  for (int ip = 0; ip < 2; ip++) {
    const double* c = g_row_counts[ip];
    printf("%s kernels=%.10g memops=%.10g copies=%.10g copy_bytes=%.10g", ip ? " | in-place" : " out-of-place",
           c[GC_KERNELS], c[GC_WRITES] + c[GC_WAITS], c[GC_COPIES], c[GC_COPY_BYTES]);
  }
  printf("\n");
}

/* ---- output rows -------------------------------------------------------------------------- */

static void row_begin(const test* x) {
  char root[16];
  snprintf(root, sizeof root, "%6i", g_coll->rooted ? x->root : -1);
  const char* op = bench_op_name(g_coll->reduces ? x->op : BENCH_NO_OP);
  printf("%12li  %12li  %8s  %6s  %6s", (long)x->total_bytes, (long)x->cnt.param, x->ti->name, op, root);
  g_row_open = 1;
  bench_json_begin_object();
  bench_json_key("size");
  bench_json_int((long long)x->total_bytes);
  bench_json_key("count");
  bench_json_int((long long)x->cnt.param);
  bench_json_key("type");
  bench_json_str(x->ti->name);
  bench_json_key("redop");
  bench_json_str(op);
  bench_json_key("root");
  bench_json_str(root);
}

typedef struct iter_stats {
  double min, max, avg, p50, p95, p99, stdev;
} iter_stats;

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static void compute_stats(const double* times, int n, iter_stats* s) {
  double* v = malloc((size_t)n * sizeof(double));
  memcpy(v, times, (size_t)n * sizeof(double));
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  s->min = v[0];
  s->max = v[n - 1];
  s->p50 = v[n / 2];
  int i95 = (n * 95 + 99) / 100 - 1, i99 = (n * 99 + 99) / 100 - 1;
  s->p95 = v[i95 < n - 1 ? i95 : n - 1];
  s->p99 = v[i99 < n - 1 ? i99 : n - 1];
  double sum = 0, var = 0;
  for (int i = 0; i < n; i++) sum += v[i];
  s->avg = sum / n;
  for (int i = 0; i < n; i++) var += (v[i] - s->avg) * (v[i] - s->avg);
  s->stdev = sqrt(var / n);
  free(v);
}

static void row_body(int in_place, double time_us, double algbw, double busbw, int checked, double wrong,
                     const double* iter_times, const double* gpu_counts) {
  char ts[16], ab[16], bb[16];
  bench_float_str(time_us, 7, ts);
  bench_float_str(algbw, 6, ab);
  bench_float_str(busbw, 6, bb);
  if (checked)
    printf("  %7s  %6s  %6s  %6g", ts, ab, bb, wrong);
  else
    printf("  %7s  %6s  %6s    N/A", ts, ab, bb);
  bench_json_key(in_place ? "in_place" : "out_of_place");
  bench_json_begin_object();
  bench_json_key(bench_opt.report_cputime ? "cpu_time" : "time");
  bench_json_double(time_us);
  bench_json_key("alg_bw");
  bench_json_double(algbw);
  bench_json_key("bus_bw");
  bench_json_double(busbw);
  bench_json_key("nwrong");
  if (checked)
    bench_json_double(wrong);
  else
    bench_json_null();
  if (gpu_counts) gpu_counts_json(gpu_counts);
  bench_json_end();
  if (iter_times) {
    int skip = bench_opt.per_iter_skip, n = bench_opt.iters - skip;
    iter_stats s;
    compute_stats(iter_times + skip, n, &s);
    double cv = s.avg > 0 ? s.stdev / s.avg * 100.0 : 0.0;
    char a[16], b[16], c[16], d[16];
    bench_float_str(s.min * 1e6, 7, a);
    bench_float_str(s.max * 1e6, 7, b);
    bench_float_str(s.p99 * 1e6, 7, c);
    bench_float_str(cv, 7, d);
    printf("  %7s  %7s  %7s  %7s", a, b, c, d);
    bench_json_key(in_place ? "in_place_per_iter" : "out_of_place_per_iter");
    bench_json_begin_object();
    const char* keys[] = {"min_us", "max_us", "avg_us", "p50_us", "p95_us", "p99_us", "stdev_us"};
    double vals[] = {s.min, s.max, s.avg, s.p50, s.p95, s.p99, s.stdev};
    for (int k = 0; k < 7; k++) {
      bench_json_key(keys[k]);
      bench_json_double(vals[k] * 1e6);
    }
    bench_json_key("cv_pct");
    bench_json_double(cv);
    bench_json_key("times_us");
    bench_json_begin_list();
    for (int k = skip; k < bench_opt.iters; k++) bench_json_double(iter_times[k] * 1e6);
    bench_json_end();
    bench_json_end();
  }
}

static void row_end(void) {
  if (bench_opt.report_timestamps) {
    char stamp[64];
    bench_timestamp(stamp, sizeof stamp);
    printf("%21s", stamp);
  }
  printf("\n");
  g_row_open = 0;
  bench_json_key("actual_iterations");
  bench_json_int(bench_opt.iters);
  bench_json_key("experiment_name");
  bench_json_str("");
  bench_json_end();
}

/* ---- timing ------------------------------------------------------------------------------- */

/* Times one size, out-of-place or in-place, then checks it; prints the row's half. */
static void bench_time(bench_thread* t, const test* x, int in_place) {
  const bench_opts* o = &bench_opt;
  static __thread uint64_t rep = 0;
  if (o->check) init_data(t, x, in_place, 99);
  launch(t, x, 0, in_place);
  complete(t);
  bench_sync_barrier(t);

  int stall = debug_rank("COMM_BENCH_DEBUG_STALL");
  if (stall >= t->first_rank && stall < t->first_rank + t->n) {
    /* Testing aid for -T: this rank stops answering. */
    bench_watch_arm(t, __FILE__, __LINE__);
    for (;;) sleep(1);
  }

  bench_softgpu_counts c0, c1;
  if (g_gpu_counts) gpu_counts_take(t, &c0);
  int agg = o->agg_iters;
  int grouped = agg > 1 && g_be->uses_nccl_comms;
  double barrier_time = 0;
  double t0 = bench_now();
  for (int iter = 0; iter < o->iters; iter++) {
    double it0 = bench_now(), it_barrier = 0;
    if (grouped) NCCLCHECK(t, ncclGroupStart());
    for (int a = 0; a < agg; a++) {
      launch(t, x, iter * agg + a, in_place);
      if (!grouped && (o->blocking == 1 || o->blocking == 2)) {
        complete(t);
        if (o->blocking == 1) bench_sync_barrier(t);
      }
    }
    if (grouped) {
      NCCLCHECK(t, ncclGroupEnd());
      /* -z 1/2 act per group: a barrier cannot sit inside an open group */
      if (o->blocking == 1 || o->blocking == 2) {
        complete(t);
        if (o->blocking == 1) bench_sync_barrier(t);
      }
    }
    if (o->blocking == 3) {
      complete(t);
      double b0 = bench_now();
      bench_sync_barrier(t);
      it_barrier = bench_now() - b0;
      barrier_time += it_barrier;
    }
    if (o->per_iter) {
      if (bench_w.device_mode && o->blocking == 0) complete(t);
      t->iter_times[iter] = (bench_now() - it0 - it_barrier) / agg;
    }
  }
  double cputime = (bench_now() - t0) / ((double)o->iters * agg);
  complete(t);
  double delta = (bench_now() - t0 - barrier_time) / ((double)o->iters * agg);
  double gpu[GC_N];
  if (g_gpu_counts) {
    gpu_counts_take(t, &c1);
    gpu_counts_per_call(t, &c0, &c1, (double)o->iters * agg, gpu);
  }

  /* Combine across threads and processes per -a. */
  double v[2] = {delta, cputime};
  int nthr = bench_w.nprocs * bench_w.nthreads;
  switch (o->average) {
    case 0:
      if (!(bench_w.proc == 0 && t->thread == 0)) v[0] = v[1] = 0;
      bench_sync_reduce(t, v, 2, SYNC_SUM);
      break;
    case 1:
      bench_sync_reduce(t, v, 2, SYNC_SUM);
      v[0] /= nthr;
      v[1] /= nthr;
      break;
    case 2: bench_sync_reduce(t, v, 2, SYNC_MIN); break;
    default: bench_sync_reduce(t, v, 2, SYNC_MAX); break;
  }
  delta = v[0];
  cputime = v[1];
  if (o->per_iter) bench_sync_reduce(t, t->iter_times, o->iters, SYNC_MAX);

  double algbw = (double)(x->cnt.bw * x->ts) / 1e9 / delta;
  double busbw = algbw * bench_bw_factor(g_coll, bench_w.nranks);

  int checked = o->check > 0 && !(in_place && g_be->inplace_unchecked);
  double wrong = 0;
  if (checked) {
    for (int c = 0; c < o->check; c++) {
      uint64_t seed = ++rep;
      init_data(t, x, in_place, seed);
      launch(t, x, 0, in_place);
      complete(t);
      long long local = verify(t, x, in_place, seed);
      double w[2] = {(double)local, local ? 1.0 : 0.0};
      bench_sync_reduce(t, w, 2, SYNC_SUM);
      wrong = w[0];
      /* Threads that saw wrong elements, as nccl-tests counts; the sum is every process's, so
       * each process exits with the same status. */
      if (t->thread == 0) g_errors += (int)w[1];
      if (wrong) break;
    }
  }
  if (is_main(t)) {
    double time_us = (o->report_cputime ? cputime : delta) * 1e6;
    row_body(in_place, time_us, algbw, busbw, checked, wrong, o->per_iter ? t->iter_times : NULL,
             g_gpu_counts ? gpu : NULL);
    if (g_gpu_counts) memcpy(g_row_counts[in_place], gpu, sizeof gpu);
  }
  if (t->thread == 0) { /* busbw is every process's (delta is combined): so is the average */
    g_bw_sum += busbw;
    g_bw_count++;
  }
}

static size_t next_size(size_t size) {
  if (bench_opt.step_factor > 1) return size ? size * bench_opt.step_factor : 1;
  return size + bench_opt.step_bytes;
}

static void time_test(bench_thread* t, int type_index, int op, int root) {
  const bench_opts* o = &bench_opt;
  test x;
  memset(&x, 0, sizeof x);
  x.ti = bench_type_at(type_index);
  x.ts = x.ti->size;
  x.op = op;
  x.root = root;
  make_ops(t, &x);
  bench_sync_barrier(t);

  /* Warm-up: every size from min to max by factors of 2. */
  if (o->warmup_iters > 0) {
    for (size_t size = o->min_bytes;; size = size ? size * 2 : 1) {
      if (size > o->max_bytes) size = o->max_bytes;
      set_size(t, &x, size);
      for (int w = 0; w < o->warmup_iters; w++) launch(t, &x, w, 0);
      complete(t);
      if (size >= o->max_bytes) break;
    }
  }

  for (size_t size = o->min_bytes; size <= o->max_bytes; size = next_size(size)) {
    set_size(t, &x, size);
    if (is_main(t)) row_begin(&x);
    bench_time(t, &x, 0);
    bench_time(t, &x, 1);
    if (is_main(t)) {
      row_end();
      if (g_gpu_counts) gpu_counts_line(&x);
      fflush(stdout);
    }
  }
  free_ops(t, &x);
}

static void run_tests(bench_thread* t) {
  const bench_opts* o = &bench_opt;
  int nroots = g_coll->rooted ? (o->root < 0 ? bench_w.nranks : 1) : 1;
  for (int cycle = 0; o->run_cycles == 0 || cycle < o->run_cycles; cycle++)
    for (int ti = 0; ti < g_ntypes; ti++) {
      /* -u: misalign by that many elements of this type (the allocations have room for 8-byte ones) */
      size_t skew = (size_t)o->unalign * bench_type_at(g_types[ti])->size;
      for (int i = 0; i < t->n; i++) {
        t->send[i] = (char*)t->send_alloc[i] + skew;
        t->recv[i] = (char*)t->recv_alloc[i] + skew;
      }
      for (int oi = 0; oi < (g_coll->reduces ? g_nops : 1); oi++)
        for (int r = 0; r < nroots; r++)
          time_test(t, g_types[ti], g_coll->reduces ? g_ops[oi] : BENCH_NO_OP,
                    g_coll->rooted ? (o->root < 0 ? r : o->root) : -1);
    }
}

/* ---- communicators and buffers -------------------------------------------------------------- */

static ncclUniqueId g_id;

static void init_comms(bench_thread* first, int nthreads) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  if (bench_opt.cta_policy >= 0) config.CTAPolicy = bench_opt.cta_policy;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  config.nvlinkCentricSched = 1;
#endif
  NCCLCHECK(first, ncclGroupStart());
  for (int k = 0; k < nthreads; k++) {
    bench_thread* t = first + k;
    for (int i = 0; i < t->n; i++) {
      if (bench_w.device_mode) CUDACHECK(bench_cu.SetDevice(t->devs[i]));
      NCCLCHECK(t, ncclCommInitRankConfig(&t->comms[i], bench_w.nranks, g_id, t->first_rank + i, &config));
    }
  }
  NCCLCHECK(first, ncclGroupEnd());
}

static void register_buffers(bench_thread* t) {
  if (!bench_opt.local_register) return;
  size_t bytes = g_buf_bytes + (size_t)bench_opt.unalign * 8;
  NCCLCHECK(t, ncclGroupStart());
  for (int i = 0; i < t->n; i++) {
    if (bench_opt.local_register == 2) {
      NCCLCHECK(t, ncclCommWindowRegister(t->comms[i], t->send_alloc[i], bytes, (ncclWindow_t*)&t->reg_send[i],
                                          NCCL_WIN_COLL_SYMMETRIC));
      NCCLCHECK(t, ncclCommWindowRegister(t->comms[i], t->recv_alloc[i], bytes, (ncclWindow_t*)&t->reg_recv[i],
                                          NCCL_WIN_COLL_SYMMETRIC));
    } else {
      NCCLCHECK(t, ncclCommRegister(t->comms[i], t->send_alloc[i], bytes, &t->reg_send[i]));
      NCCLCHECK(t, ncclCommRegister(t->comms[i], t->recv_alloc[i], bytes, &t->reg_recv[i]));
    }
  }
  NCCLCHECK(t, ncclGroupEnd());
}

static void deregister_buffers(bench_thread* t) {
  if (!bench_opt.local_register) return;
  for (int i = 0; i < t->n; i++) {
    if (bench_opt.local_register == 2) {
      NCCLCHECK(t, ncclCommWindowDeregister(t->comms[i], (ncclWindow_t)t->reg_send[i]));
      NCCLCHECK(t, ncclCommWindowDeregister(t->comms[i], (ncclWindow_t)t->reg_recv[i]));
    } else {
      NCCLCHECK(t, ncclCommDeregister(t->comms[i], t->reg_send[i]));
      NCCLCHECK(t, ncclCommDeregister(t->comms[i], t->reg_recv[i]));
    }
  }
}

static void* host_alloc(size_t bytes) {
  void* p = NULL;
  if (posix_memalign(&p, 4096, bytes ? bytes : 1) != 0)
    bench_fail(BENCH_ERR_INTERNAL, "%s: out of host memory (%zu bytes)\n", bench_w.hostname, bytes);
  memset(p, 0, bytes); /* fault the pages in now, not during timing */
  return p;
}

static void alloc_thread(bench_thread* t, int sync_cap) {
  int n = t->n;
  size_t bytes = g_buf_bytes + (size_t)bench_opt.unalign * 8 + 64;
  t->send_alloc = calloc((size_t)n, sizeof(void*));
  t->recv_alloc = calloc((size_t)n, sizeof(void*));
  t->send = calloc((size_t)n, sizeof(char*));
  t->recv = calloc((size_t)n, sizeof(char*));
  t->stage = calloc((size_t)n, sizeof(char*));
  t->reg_send = calloc((size_t)n, sizeof(void*));
  t->reg_recv = calloc((size_t)n, sizeof(void*));
  t->counts = calloc((size_t)n, sizeof(size_t*));
  t->displs = calloc((size_t)n, sizeof(size_t*));
  t->ops = calloc((size_t)n, sizeof(ncclRedOp_t));
  t->sync_buf = calloc((size_t)n, sizeof(double*));
  t->sync_host = calloc((size_t)sync_cap, sizeof(double));
  t->iter_times = calloc((size_t)bench_opt.iters, sizeof(double));
  for (int i = 0; i < n; i++) {
    if (bench_w.device_mode) {
      CUDACHECK(bench_cu.SetDevice(t->devs[i]));
      CUDACHECK(bench_cu.Malloc(&t->send_alloc[i], bytes));
      CUDACHECK(bench_cu.Malloc(&t->recv_alloc[i], bytes));
      CUDACHECK(bench_cu.Malloc((void**)&t->sync_buf[i], (size_t)sync_cap * sizeof(double)));
      t->stage[i] = host_alloc(bytes);
    } else {
      t->send_alloc[i] = host_alloc(bytes);
      t->recv_alloc[i] = host_alloc(bytes);
      t->sync_buf[i] = calloc((size_t)sync_cap, sizeof(double));
    }
    t->send[i] = t->send_alloc[i];
    t->recv[i] = t->recv_alloc[i];
    t->counts[i] = calloc((size_t)bench_w.nranks, sizeof(size_t));
    t->displs[i] = calloc((size_t)bench_w.nranks, sizeof(size_t));
  }
}

static void free_thread(bench_thread* t) {
  for (int i = 0; i < t->n; i++) {
    if (bench_w.device_mode) {
      bench_cu.Free(t->send_alloc[i]);
      bench_cu.Free(t->recv_alloc[i]);
      bench_cu.Free(t->sync_buf[i]);
      free(t->stage[i]);
      if (t->streams[i]) bench_cu.StreamDestroy(t->streams[i]);
    } else {
      free(t->send_alloc[i]);
      free(t->recv_alloc[i]);
      free(t->sync_buf[i]);
    }
    free(t->counts[i]);
    free(t->displs[i]);
  }
}

static void* thread_main(void* arg) {
  bench_thread* t = arg;
  /* A new thread's device is 0 whatever the main thread chose: its synchronous copies and its
   * NULL stream would otherwise be GPU 0's, behind (and ahead of) rank 0's collectives. */
  if (bench_w.device_mode) CUDACHECK(bench_cu.SetDevice(t->devs[0]));
  if (bench_opt.parallel_init && g_be->uses_nccl_comms) {
    init_comms(t, 1);
    register_buffers(t);
  }
  run_tests(t);
  if (bench_opt.memory_report) {
    /* every thread takes part: the reduction is a synchronisation point */
    double m[3] = {g_mem[0], g_mem[1], (double)mem_used() - g_mem[2]};
    if (m[2] < 0) m[2] = 0;
    bench_sync_reduce(t, m, 3, SYNC_MAX);
    if (t->thread == 0) memcpy(g_mem_report, m, sizeof m);
  }
  return NULL;
}

/* ---- start-up information exchanged between processes --------------------------------------- */

typedef struct proc_info {
  uint64_t host_hash;
  int64_t mem_limit; /* largest -e this process can hold, bytes */
  int32_t pid;
  int32_t env_local_rank; /* LOCAL_RANK, or -1 */
  int32_t gpu_counts;     /* device memory on softgpu's stand-in: softgpu_counters answers */
} proc_info;

typedef struct rank_info {
  int32_t rank, pid, device;
  uint32_t pci[3];
  char host[64];
  char name[96];
} rank_info;

static uint64_t host_hash(const char* host) {
  /* Host name plus boot id, so that containers sharing a name stay apart. */
  char buf[512];
  snprintf(buf, sizeof buf, "%s", host);
  FILE* f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    size_t used = strlen(buf);
    if (fgets(buf + used, (int)(sizeof buf - used), f) == NULL) buf[used] = 0;
    fclose(f);
  }
  uint64_t h = 1469598103934665603ULL;
  for (const char* p = buf; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ULL;
  return h;
}

static int64_t mem_available(void) {
  FILE* f = fopen("/proc/meminfo", "r");
  long long kb = -1;
  char line[256];
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
  if (f) fclose(f);
  return kb < 0 ? -1 : (int64_t)kb * 1024;
}

static int64_t mem_used(void) {
  if (bench_w.device_mode && bench_cu.MemGetInfo) {
    size_t free_b = 0, total = 0;
    if (bench_cu.MemGetInfo(&free_b, &total) == 0) return (int64_t)(total - free_b);
    return 0;
  }
  long pages = 0, rss = 0;
  FILE* f = fopen("/proc/self/statm", "r");
  if (f) {
    if (fscanf(f, "%ld %ld", &pages, &rss) != 2) rss = 0;
    fclose(f);
  }
  return (int64_t)rss * sysconf(_SC_PAGESIZE);
}

static void mem_string(double v, char* out, size_t len) {
  const char* unit = " B";
  if (fabs(v) >= 1024.0 * 1024 * 1024) {
    unit = " GB";
    v /= 1024.0 * 1024 * 1024;
  } else if (fabs(v) >= 1024.0 * 1024) {
    unit = " MB";
    v /= 1024.0 * 1024;
  } else if (fabs(v) >= 1024.0) {
    unit = " KB";
    v /= 1024.0;
  }
  snprintf(out, len, "%.*f%s", fabs(v) < 10 ? 2 : fabs(v) < 100 ? 1 : 0, v, unit);
}

/* ---- the program ------------------------------------------------------------------------------ */

static int finish(int status) {
  bench_json_close(NULL);
  bench_launch_finish();
  return status;
}

static const char* nccl_refuse(const bench_coll* c, ncclDataType_t t, int op) {
  (void)c;
  (void)t;
  (void)op;
  return NULL;
}

static const char* nccl_error_string(int rc) { return ncclGetErrorString((ncclResult_t)rc); }

int bench_nccl_main(int argc, char** argv, const bench_coll* coll, bench_run_fn run, int inplace_unchecked) {
  static bench_backend be;
  be.name = "nccl";
  be.run = run;
  be.uses_nccl_comms = 1;
  be.inplace_unchecked = inplace_unchecked;
  be.refuse = nccl_refuse;
  be.error_string = nccl_error_string;
  be.max_agg_iters = 0;
  be.leading_args = 0;
  return bench_main(argc, argv, basename(argv[0]), coll, &be);
}

int bench_main(int argc, char** argv, const char* program, const bench_coll* coll, const bench_backend* be) {
  setlinebuf(stdout);
  g_coll = coll;
  g_be = be;
  g_program = program;
  int status = bench_launch_start(&argc, &argv);
  if (status != BENCH_OK) return status;
  int quiet = bench_w.proc != 0; /* every process reaches the same verdict on options */
  status = parse_options(argc, argv, quiet);
  if (status < 0) status = check_options(quiet);
  if (status >= 0) return finish(status);
  bench_opts* o = &bench_opt;

  bench_w.nthreads = o->nthreads;
  bench_w.ngpus = o->ngpus;
  bench_w.nranks = bench_w.nprocs * o->nthreads * o->ngpus;
  if (o->root >= bench_w.nranks && coll->rooted) {
    if (!quiet) fprintf(stderr, "invalid -r %d: there are %d ranks\n", o->root, bench_w.nranks);
    return finish(BENCH_ERR_INTERNAL);
  }

  /* Which types and ops run; the backend may skip some of "all". */
  char skipped[256] = "";
  for (int i = 0; i < BENCH_NUM_TYPES; i++) {
    if (o->type >= 0 && i != o->type) continue;
    if (o->type < 0 && be->refuse(coll, bench_type_at(i)->type, BENCH_NO_OP)) {
      snprintf(skipped + strlen(skipped), sizeof skipped - strlen(skipped), " %s", bench_type_at(i)->name);
      continue;
    }
    g_types[g_ntypes++] = i;
  }
  for (int i = 0; i < BENCH_NUM_OPS; i++) {
    if (o->op >= 0 && i != o->op) continue;
    if (o->op < 0 && coll->reduces && be->refuse(coll, ncclFloat32, i)) {
      snprintf(skipped + strlen(skipped), sizeof skipped - strlen(skipped), " %s", bench_op_name(i));
      continue;
    }
    g_ops[g_nops++] = i;
  }

  /* Memory: device when asked or when usable, host otherwise. */
  char why[512] = "";
  int ndev = -1;
  if (o->memory != MEM_HOST && be->uses_nccl_comms) {
    int lib_device = 1; /* NVIDIA's NCCL: device memory is what it takes */
#ifdef COMM_FEATURE_DEVICE_MEMORY
    int f = 0;
    commGetFeatures(&f);
    lib_device = (f & COMM_FEATURE_DEVICE_MEMORY) != 0;
#endif
    ndev = bench_cuda_load(why, sizeof why);
    if (ndev > 0 && !lib_device) {
      snprintf(why, sizeof why, "this libcomm build does not support device memory (commGetFeatures lacks COMM_FEATURE_DEVICE_MEMORY)");
      ndev = -1;
    }
    if (o->memory == MEM_DEVICE && ndev <= 0) {
      if (!quiet) fprintf(stderr, "not supported: --memory device: %s\n", why);
      return finish(BENCH_ERR_UNSUPPORTED);
    }
  }
  bench_w.device_mode = ndev > 0;
#ifndef COMM_FEATURE_DEVICE_MEMORY
  if (!bench_w.device_mode && be->uses_nccl_comms) {
    if (!quiet) fprintf(stderr, "not supported: host memory with NVIDIA's NCCL, which takes device buffers only (%s)\n", why);
    return finish(BENCH_ERR_UNSUPPORTED);
  }
#endif

  if (bench_w.proc == 0 && o->json_path && bench_json_open(o->json_path, argc, argv) != 0) {
    /* nccl-tests goes on without the file */
  }

  /* Round 1: hosts and memory. */
  proc_info me;
  memset(&me, 0, sizeof me);
  me.host_hash = host_hash(bench_w.hostname);
  me.pid = (int32_t)getpid();
  const char* local_rank = bench_w.launcher == LAUNCH_ENV && bench_w.local_rank_var ? getenv(bench_w.local_rank_var) : NULL;
  me.env_local_rank = local_rank && *local_rank ? atoi(local_rank) : -1;
  int local_ranks = o->nthreads * o->ngpus;
  proc_info* all = calloc((size_t)bench_w.nprocs, sizeof(proc_info));
  int procs_on_host = 0;
  bench_w.local_rank = 0;
  {
    int64_t avail;
    if (bench_w.device_mode && bench_cu.MemGetInfo) {
      size_t free_b = 0, total = 0;
      bench_cu.SetDevice(0);
      bench_cu.MemGetInfo(&free_b, &total);
      avail = (int64_t)total - (1LL << 30);
      me.mem_limit = avail / (o->check ? 3 : 2);
    } else {
      avail = mem_available();
      me.mem_limit = avail < 0 ? INT64_MAX : avail / 10 * 8;
    }
  }
  if (bench_w.device_mode && bench_cu.softgpu_counters) {
    bench_softgpu_counts c;
    me.gpu_counts = bench_cu.softgpu_counters(&c) == 0 && c.version == 1;
  }
  if (bench_oob_allgather(&me, all, sizeof me) != 0)
    bench_fail(BENCH_ERR_INTERNAL, "%s: start-up exchange between processes failed\n", bench_w.hostname);
  /* Counted only where every process can count: the snapshots are taken between barriers. */
  g_gpu_counts = 1;
  for (int p = 0; p < bench_w.nprocs; p++) g_gpu_counts &= all[p].gpu_counts != 0;
  for (int p = 0; p < bench_w.nprocs; p++) {
    if (all[p].host_hash != me.host_hash) continue;
    procs_on_host++;
    if (p < bench_w.proc) bench_w.local_rank++;
  }
  if (me.env_local_rank >= 0) bench_w.local_rank = me.env_local_rank;
  /* The unique id: process 0's, to everyone (MPI_Bcast under MPI). */
  if (bench_w.proc == 0 && be->uses_nccl_comms) {
    ncclResult_t r = ncclGetUniqueId(&g_id);
    if (r != ncclSuccess) bench_fail_nccl(NULL, r, __FILE__, __LINE__);
  }
  if (bench_oob_bcast(&g_id, sizeof g_id) != 0)
    bench_fail(BENCH_ERR_INTERNAL, "%s: could not share the unique id\n", bench_w.hostname);
  /* Host memory is shared by the processes of a host; each has its share. */
  int64_t limit = INT64_MAX;
  for (int p = 0; p < bench_w.nprocs; p++) {
    int64_t l = all[p].mem_limit;
    if (!bench_w.device_mode) {
      int n = 0;
      for (int q = 0; q < bench_w.nprocs; q++) n += all[q].host_hash == all[p].host_hash;
      l = l / n / local_ranks / 2;
    }
    if (l < limit) limit = l;
  }
  free(all);
  size_t requested_max = o->max_bytes;
  int reduced = 0;
  if (limit > 0 && (int64_t)o->max_bytes > limit) {
    o->max_bytes = (size_t)limit;
    if (o->min_bytes > o->max_bytes) o->min_bytes = o->max_bytes;
    reduced = 1;
  }
  g_buf_bytes = o->max_bytes;

  /* Threads and devices of this process. */
  g_threads = calloc((size_t)o->nthreads, sizeof(bench_thread));
  const char* dev_env = getenv("NCCL_TESTS_DEVICE");
  int gpu0 = dev_env ? atoi(dev_env) : -1;
  rank_info* mine = calloc((size_t)local_ranks, sizeof(rank_info));
  for (int k = 0; k < o->nthreads; k++) {
    bench_thread* t = &g_threads[k];
    t->thread = k;
    t->n = o->ngpus;
    t->first_rank = (bench_w.proc * o->nthreads + k) * o->ngpus;
    t->comms = calloc((size_t)t->n, sizeof(ncclComm_t));
    t->streams = calloc((size_t)t->n, sizeof(cudaStream_t));
    t->devs = calloc((size_t)t->n, sizeof(int));
    for (int i = 0; i < t->n; i++) {
      rank_info* ri = &mine[k * o->ngpus + i];
      ri->rank = t->first_rank + i;
      ri->pid = me.pid;
      snprintf(ri->host, sizeof ri->host, "%.63s", bench_w.hostname);
      if (bench_w.device_mode) {
        int dev = (gpu0 != -1 ? gpu0 : bench_w.local_rank * local_ranks) + k * o->ngpus + i;
        if (dev >= ndev) {
          fprintf(stderr, "Invalid number of GPUs: %d requested but only %d were found.\n",
                  (gpu0 != -1 ? gpu0 : bench_w.local_rank * local_ranks) + local_ranks, ndev);
          fprintf(stderr, "Please check the number of processes and GPUs per process.\n");
          bench_exit_now(BENCH_ERR_UNSUPPORTED);
        }
        t->devs[i] = dev;
        ri->device = dev;
        bench_cuda_describe(dev, &ri->pci[0], &ri->pci[1], &ri->pci[2], ri->name, sizeof ri->name);
        CUDACHECK(bench_cu.SetDevice(dev));
        /* Non-blocking, as nccl-tests makes them: ranks that are threads on one GPU must not be
           held up by the legacy stream (the harness's cudaMemcpy runs there). */
        if (!o->stream_null) CUDACHECK(bench_cu.StreamCreateWithFlags(&t->streams[i], 1));
      } else {
        t->devs[i] = -1;
        ri->device = -1;
        snprintf(ri->name, sizeof ri->name, "host memory");
      }
    }
  }
  /* Round 2: every rank's device, for the report. */
  rank_info* ranks = calloc((size_t)bench_w.nranks, sizeof(rank_info));
  if (bench_oob_allgather(mine, ranks, (size_t)local_ranks * sizeof(rank_info)) != 0)
    bench_fail(BENCH_ERR_INTERNAL, "%s: start-up exchange between processes failed\n", bench_w.hostname);
  bench_oob_close();
  free(mine);

  int lib_version = 0;
  ncclGetVersion(&lib_version);
  if (bench_w.proc == 0) {
    printf("# comm-bench version %s nccl-headers=%d nccl-library=%d\n", BENCH_VERSION, NCCL_VERSION_CODE, lib_version);
    printf("# Library: %s\n", bench_library(NULL, NULL));
    printf("# Collective test starting: %s\n", program);
    printf("# nThread %d nGpus %d minBytes %zu maxBytes %zu step: %zu(%s) warmup iters: %d iters: %d agg iters: %d "
           "validation: %d graph: %d unalign: %d\n",
           o->nthreads, o->ngpus, o->min_bytes, requested_max, o->step_factor > 1 ? o->step_factor : o->step_bytes,
           o->step_factor > 1 ? "factor" : "bytes", o->warmup_iters, o->iters, o->agg_iters, o->check, o->cudagraph,
           o->unalign);
    if (o->blocking == 1) printf("# Blocking Enabled: wait for completion and barrier after each collective \n");
    if (o->blocking == 2) printf("# Blocking Enabled: wait for completion after each collective (no barrier) \n");
    if (o->blocking == 3)
      printf("# Blocking Enabled: wait for completion and barrier after each iteration, barrier not timed \n");
    if (o->per_iter) printf("# Per-Iteration Report: wall-clock timing; i_* uses max over process rows \n");
    if (o->parallel_init) printf("# Parallel Init Enabled: threads call into NcclInitRank concurrently \n");
    if (skipped[0]) printf("# %s cannot run:%s (skipped)\n", be->name, skipped);
    printf("#\n");
    bench_json_key("config");
    bench_json_begin_object();
    bench_json_key("nthreads");
    bench_json_int(o->nthreads);
    bench_json_key("ngpus");
    bench_json_int(o->ngpus);
    bench_json_key("minimum_bytes");
    bench_json_int((long long)o->min_bytes);
    bench_json_key("maximum_bytes");
    bench_json_int((long long)requested_max);
    if (o->step_factor > 1) {
      bench_json_key("step_factor");
      bench_json_int((long long)o->step_factor);
    } else {
      bench_json_key("step_bytes");
      bench_json_int((long long)o->step_bytes);
    }
    bench_json_key("warmup_iters");
    bench_json_int(o->warmup_iters);
    bench_json_key("iterations");
    bench_json_int(o->iters);
    bench_json_key("aggregated_iterations");
    bench_json_int(o->agg_iters);
    bench_json_key("validation");
    bench_json_int(o->check);
    bench_json_key("graph");
    bench_json_int(o->cudagraph);
    bench_json_key("blocking_collectives");
    bench_json_bool_str(o->blocking);
    bench_json_key("per_iter_timing");
    bench_json_bool_str(o->per_iter);
    bench_json_key("parallel_init");
    bench_json_bool_str(o->parallel_init);
    /* comm-bench additions */
    bench_json_key("collective");
    bench_json_str(coll->name);
    bench_json_key("backend");
    bench_json_str(be->name);
    bench_json_key("memory");
    bench_json_str(bench_w.device_mode ? "device" : "host");
    bench_json_key("softgpu_counters");
    bench_json_bool_str(g_gpu_counts);
    bench_json_key("nranks");
    bench_json_int(bench_w.nranks);
    bench_json_key("nprocs");
    bench_json_int(bench_w.nprocs);
    printf("# Using devices\n");
    bench_json_key("devices");
    bench_json_begin_list();
    for (int r = 0; r < bench_w.nranks; r++) {
      rank_info* ri = &ranks[r];
      char hex[32];
      snprintf(hex, sizeof hex, "%04x:%02x:%02x", ri->pci[0], ri->pci[1], ri->pci[2]);
      printf("#  Rank %2d Group %2d Pid %6d on %10s device %2d [%s] %s\n", ri->rank, 0, ri->pid, ri->host, ri->device,
             hex, ri->name);
      bench_json_begin_object();
      bench_json_key("rank");
      bench_json_int(ri->rank);
      bench_json_key("group");
      bench_json_int(0);
      bench_json_key("pid");
      bench_json_int(ri->pid);
      bench_json_key("hostname");
      bench_json_str(ri->host);
      bench_json_key("device");
      bench_json_int(ri->device);
      bench_json_key("device_hex");
      bench_json_str(hex);
      bench_json_key("device_info");
      bench_json_str(ri->name);
      bench_json_end();
    }
    bench_json_end();
    bench_json_end();
    if (reduced) printf("#\n# Reducing maxBytes to %zu due to memory limitation\n", o->max_bytes);
  }
  free(ranks);

  /* Communicators (all at once from this thread, or each thread its own with -p 1), then buffers. */
  int sync_cap = o->iters > 16 ? o->iters : 16;
  bench_sync_init(sync_cap);
  int64_t mem0 = mem_used();
  if (be->uses_nccl_comms && !o->parallel_init) init_comms(g_threads, o->nthreads);
  int64_t mem1 = mem_used();
  for (int k = 0; k < o->nthreads; k++) alloc_thread(&g_threads[k], sync_cap);
  int64_t mem2 = mem_used();
  g_mem[0] = (double)(mem1 - mem0);
  g_mem[1] = (double)(mem2 - mem1);
  g_mem[2] = (double)mem2;
  /* One group around every thread's registrations: window registration (-R 2) is collective,
   * so one thread registering the threads' communicators one after the other would wait for
   * itself. */
  if (be->uses_nccl_comms && !o->parallel_init) {
    NCCLCHECK(&g_threads[0], ncclGroupStart());
    for (int k = 0; k < o->nthreads; k++) register_buffers(&g_threads[k]);
    NCCLCHECK(&g_threads[0], ncclGroupEnd());
  }

  if (bench_w.proc == 0) {
    const char* tlabel = o->report_cputime ? "cputime" : "time";
    const char* ts_label = o->report_timestamps ? "timestamp" : "";
    const char* ts_fmt = o->report_timestamps ? "%Y-%m-%d %H:%M:%S" : "";
    int ts_pad = o->report_timestamps ? 19 : 0;
    if (g_gpu_counts)
      printf("#\n# softgpu: under each row, what one timed call gave the GPU, per rank (the stand-in driver's\n"
             "#   softgpu_counters, summed over processes, divided by iterations and ranks): kernels launched,\n"
             "#   memops (stream write and wait value operations), copies and copy_bytes\n");
    printf("#\n");
    if (o->per_iter) {
      printf("# %10s  %12s  %8s  %6s  %6s              out-of-place (+ per-iteration)                                in-place (+ per-iteration)\n",
             "", "", "", "", "");
      printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s %*s\n",
             "size", "count", "type", "redop", "root", tlabel, "algbw", "busbw", "#wrong", "i_min", "i_max", "i_p99",
             "i_cv%", tlabel, "algbw", "busbw", "#wrong", "i_min", "i_max", "i_p99", "i_cv%", ts_pad, ts_label);
      printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s %*s\n",
             "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(%)", "(us)",
             "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(%)", ts_pad, ts_fmt);
    } else {
      printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n", "", "", "",
             "", "");
      printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s\n", "size", "count", "type",
             "redop", "root", tlabel, "algbw", "busbw", "#wrong", tlabel, "algbw", "busbw", "#wrong", ts_pad, ts_label);
      printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s\n", "(B)", "(elements)", "", "",
             "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", ts_pad, ts_fmt);
    }
    bench_json_key("results");
    bench_json_begin_list();
    fflush(stdout);
  }

  pthread_t dog;
  if (o->timeout > 0) pthread_create(&dog, NULL, watchdog, NULL);
  for (int k = 1; k < o->nthreads; k++) pthread_create(&g_threads[k].handle, NULL, thread_main, &g_threads[k]);
  thread_main(&g_threads[0]);
  for (int k = 1; k < o->nthreads; k++) pthread_join(g_threads[k].handle, NULL);

  /* Everything combined so far is the same in every process. */
  double avg_bw = g_bw_count ? g_bw_sum / g_bw_count : NAN;
  const char* min_env = getenv("NCCL_TESTS_MIN_BW");
  double min_bw = min_env ? atof(min_env) : -1;
  int bw_failed = min_bw >= 0 && !(avg_bw >= min_bw * 0.9);
  double* mem = g_mem_report;

  for (int k = 0; k < o->nthreads; k++) {
    bench_thread* t = &g_threads[k];
    if (be->uses_nccl_comms) {
      deregister_buffers(t);
      for (int i = 0; i < t->n; i++) NCCLCHECK(t, ncclCommDestroy(t->comms[i]));
    }
    free_thread(t);
  }

  if (bench_w.proc == 0) {
    bench_json_end(); /* results */
    printf("# %-20s : %d %s\n", "Out of bounds values", g_errors, g_errors ? "FAILED" : "OK");
    printf("# %-20s : %g %s\n", "Avg bus bandwidth", avg_bw, min_bw < 0 ? "" : bw_failed ? "FAILED" : "OK");
    printf("#\n");
    printf("# Collective test concluded: %s\n", program);
    bench_json_key("out_of_bounds");
    bench_json_begin_object();
    bench_json_key("count");
    bench_json_int(g_errors);
    bench_json_key("okay");
    bench_json_bool_str(g_errors == 0);
    bench_json_end();
    bench_json_key("average_bus_bandwidth");
    bench_json_begin_object();
    bench_json_key("bandwidth");
    bench_json_double(avg_bw);
    bench_json_key("okay");
    if (min_bw < 0)
      bench_json_str("unchecked");
    else
      bench_json_bool_str(!bw_failed);
    bench_json_end();
    if (o->memory_report) {
      char a[32], b[32], c[32], d[32];
      mem_string(mem[0], a, sizeof a);
      mem_string(mem[1], b, sizeof b);
      mem_string(mem[2], c, sizeof c);
      mem_string(mem[0] + mem[1] + mem[2], d, sizeof d);
      printf("# %-20s : Initialization %s | User-Allocated %s | Collective %s | Total  %s\n",
             bench_w.device_mode ? "GPU memory usage" : "Host memory usage", a, b, c, d);
    }
    printf("#\n");
    const char* err = be->uses_nccl_comms ? ncclGetLastError(NULL) : "";
    if (err && *err)
      printf("# error: %s\n", err);
    else
      printf("\n");
    bench_json_close(err);
  }
  return finish(g_errors || bw_failed ? BENCH_ERR_RESULTS : BENCH_OK);
}
