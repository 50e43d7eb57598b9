/* Processes and the synchronisation between ranks.
 *
 * Three ways to run: one process (ranks are its threads, -t x -g), processes started by MPI
 * (the _mpi binaries and mpi_perf), and processes started by any launcher that says which
 * process each is: torchrun-style RANK and WORLD_SIZE, Open MPI's mpirun, an MPICH-style PMI
 * launcher, or Slurm's srun (so `mpirun -np 2 all_reduce_perf` is one job of two processes, as
 * with nccl-tests built with MPI). In the last case process 0 serves a small TCP rendezvous on
 * MASTER_ADDR:MASTER_PORT through which the processes exchange start-up information (host,
 * devices, the unique id) before the communicators exist. Without MASTER_PORT, the port is
 * derived from the launcher's job id, so that two jobs on one node do not meet.
 *
 * During the run, barriers and the combination of times and error counts go through threads'
 * shared memory inside a process, then MPI between processes when MPI started them; without
 * MPI they are ncclAllReduce calls on the benchmark's own communicators (host buffers in host
 * mode, a small device buffer in device mode). */
#define _GNU_SOURCE
#include "harness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#ifdef BENCH_WITH_MPI
#include <mpi.h>
#endif

bench_world bench_w;

static void hostname_short(char* out, size_t len) {
  if (gethostname(out, len) != 0) snprintf(out, len, "unknown");
  out[len - 1] = 0;
  char* dot = strchr(out, '.');
  if (dot) *dot = 0;
}

static __attribute__((unused)) int env_int(const char* name, int dflt) {
  const char* v = getenv(name);
  return v && *v ? atoi(v) : dflt;
}

#ifndef BENCH_WITH_MPI
/* The launchers whose variables name the process, in the order they are believed. */
static const struct {
  const char *name, *rank, *size, *local_rank, *job;
} launchers[] = {
    {"RANK and WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", NULL},
    {"Open MPI's mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_NAMESPACE"},
    {"a PMI launcher (MPICH's mpiexec)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "PMI_KVSNAME"},
    {"Slurm's srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_JOB_ID"},
};

/* A PMI-1 exchange on the launcher's descriptor: sends `cmd`, reads one reply line into
 * `reply`. 0 on success. Bounded by two seconds, so a launcher that does not answer costs
 * no more than that. */
static int pmi_ask(int fd, const char* cmd, char* reply, size_t len) {
  size_t n = strlen(cmd), got = 0;
  if (send(fd, cmd, n, MSG_NOSIGNAL) != (ssize_t)n && write(fd, cmd, n) != (ssize_t)n) return -1;
  while (got + 1 < len) {
    struct pollfd pfd = {fd, POLLIN, 0};
    if (poll(&pfd, 1, 2000) <= 0) return -1;
    ssize_t r = read(fd, reply + got, 1);
    if (r <= 0) return -1;
    if (reply[got] == '\n') break;
    got++;
  }
  reply[got] = 0;
  return 0;
}

/* The job's name as an MPICH-style PMI launcher knows it: PMI_KVSNAME where set, else asked
 * for over PMI_FD (MPICH's hydra sets only the descriptor). Concurrent jobs have different
 * names; without one they would all meet on one port. */
static const char* pmi_job_name(void) {
  static char name[256];
  const char* kvs = getenv("PMI_KVSNAME");
  if (kvs && *kvs) return kvs;
  const char* fd_s = getenv("PMI_FD");
  if (!fd_s || !*fd_s) return NULL;
  int fd = atoi(fd_s);
  char reply[512];
  const char* found = NULL;
  if (pmi_ask(fd, "cmd=init pmi_version=1 pmi_subversion=1\n", reply, sizeof reply) == 0 &&
      strstr(reply, "rc=0") && pmi_ask(fd, "cmd=get_my_kvsname\n", reply, sizeof reply) == 0) {
    const char* k = strstr(reply, "kvsname=");
    if (k) {
      k += strlen("kvsname=");
      size_t n = strcspn(k, " \n");
      if (n > 0 && n < sizeof name) {
        memcpy(name, k, n);
        name[n] = 0;
        found = name;
      }
    }
    pmi_ask(fd, "cmd=finalize\n", reply, sizeof reply);
  }
  return found;
}

/* What tells this job from another of the same launcher on the node: its id, and for Slurm
 * the step too (the steps of one allocation share the job id). NULL when the launcher gives
 * none (torchrun: MASTER_PORT tells jobs apart). */
static const char* job_key(size_t launcher) {
  static char key[320];
  const char* var = launchers[launcher].job;
  if (!var) return NULL;
  if (strcmp(var, "PMI_KVSNAME") == 0) return pmi_job_name();
  const char* id = getenv(var);
  if (!id || !*id) return NULL;
  const char* step = strcmp(var, "SLURM_JOB_ID") == 0 ? getenv("SLURM_STEP_ID") : NULL;
  snprintf(key, sizeof key, "%s%s%s", id, step ? "." : "", step ? step : "");
  return key;
}

static int parse_nonneg(const char* s, int* out) {
  char* end;
  long v = strtol(s, &end, 10);
  if (!*s || *end || v < 0 || v > 1 << 30) return -1;
  *out = (int)v;
  return 0;
}
#endif

int bench_launch_start(int* argc, char*** argv) {
  hostname_short(bench_w.hostname, sizeof bench_w.hostname);
  bench_w.proc = 0;
  bench_w.nprocs = 1;
  bench_w.launcher = LAUNCH_SINGLE;
#ifdef BENCH_WITH_MPI
  int provided = 0;
  /* Only the main thread (rank-driving thread 0) calls MPI. */
  if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    fprintf(stderr, "MPI_Init_thread failed\n");
    return BENCH_ERR_MPI;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &bench_w.proc);
  MPI_Comm_size(MPI_COMM_WORLD, &bench_w.nprocs);
  bench_w.launcher = LAUNCH_MPI;
#else
  (void)argc;
  (void)argv;
  for (size_t i = 0; i < sizeof launchers / sizeof launchers[0]; i++) {
    const char* rank = getenv(launchers[i].rank);
    const char* size = getenv(launchers[i].size);
    if (!rank || !size || !*rank || !*size) continue;
    if (parse_nonneg(rank, &bench_w.proc) != 0 || parse_nonneg(size, &bench_w.nprocs) != 0 || bench_w.nprocs < 1 ||
        bench_w.proc >= bench_w.nprocs) {
      fprintf(stderr, "%s=%s and %s=%s (from %s) do not describe a process of the job\n", launchers[i].rank, rank,
              launchers[i].size, size, launchers[i].name);
      return BENCH_ERR_INTERNAL;
    }
    bench_w.launcher = LAUNCH_ENV;
    bench_w.launcher_name = launchers[i].name;
    bench_w.local_rank_var = launchers[i].local_rank;
    bench_w.job_key = job_key(i);
    break;
  }
#endif
  return BENCH_OK;
}

/* ---- the TCP rendezvous of launcher ENV -------------------------------------------------- */
#ifndef BENCH_WITH_MPI

static int oob_fds[4096]; /* process 0: one connection per process; others: [0] = to process 0 */
static int oob_ready;
static const char OOB_MAGIC[8] = "cbench2";

static double oob_deadline(void) {
  return bench_now() + env_int("COMM_BENCH_BOOTSTRAP_TIMEOUT", 120);
}

/* Reads or writes all of buf before the deadline. */
static int io_all(int fd, void* buf, size_t len, int writing, double deadline) {
  char* p = buf;
  while (len > 0) {
    int ms = (int)((deadline - bench_now()) * 1000);
    if (ms <= 0) return -ETIMEDOUT;
    struct pollfd pfd = {fd, (short)(writing ? POLLOUT : POLLIN), 0};
    int r = poll(&pfd, 1, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return r == 0 ? -ETIMEDOUT : -errno;
    ssize_t n = writing ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return n == 0 ? -ECONNRESET : -errno;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

struct oob_hello {
  char magic[8];
  int32_t proc, nprocs;
  uint64_t job; /* job_hash(): processes of another job are refused */
};

static uint64_t job_hash(void) {
  uint64_t h = 1469598103934665603ull;
  if (bench_w.job_key)
    for (const char* c = bench_w.job_key; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
  return h;
}

/* A port from the variable `name`, or `dflt` where it is unset; -1 (said) where it is not one. */
static int port_var(const char* name, int dflt) {
  const char* v = getenv(name);
  if (!v || !*v) return dflt;
  char* end;
  long p = strtol(v, &end, 10);
  if (*end || p < 1 || p > 65535) {
    fprintf(stderr, "%s: %s=%s is not a TCP port (1-65535)\n", bench_w.hostname, name, v);
    return -1;
  }
  return (int)p;
}

static int oob_endpoint(const char** host, char* port, size_t len) {
  *host = getenv("MASTER_ADDR");
  if (!*host || !**host) *host = "127.0.0.1";
  /* Without MASTER_PORT, a port in 20000-29999 from the launcher's job id (job_key): two jobs
   * started at once on one node by mpirun, mpiexec or srun get different ports. */
  int p = 29500;
  if (bench_w.job_key && *bench_w.job_key) {
    uint32_t h = 2166136261u;
    for (const char* c = bench_w.job_key; *c; c++) h = (h ^ (uint8_t)*c) * 16777619u;
    p = 20000 + (int)(h % 10000);
  }
  p = port_var("MASTER_PORT", p);
  /* Under torchrun the agent's own store listens on MASTER_PORT; take the next one. */
  const char* agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
  if (p > 0 && agent && strcmp(agent, "True") == 0) p += 1;
  if (p > 0) p = port_var("COMM_BENCH_PORT", p > 65535 ? 65535 : p);
  if (p < 0) return -1;
  snprintf(port, len, "%d", p);
  return 0;
}

static int oob_serve(double deadline) {
  const char* host;
  char port[16];
  if (oob_endpoint(&host, port, sizeof port) != 0) return -1;
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  int lfd = -1, err = 0;
  /* The port may be held for a moment by a process of this job whose early connect() met
   * itself (see oob_join), which lets go at once, or by a job that is ending: retry a while. */
  double bind_until = bench_now() + 10;
  do {
    /* Listen on MASTER_ADDR's own address; when it is not one of ours, on every address. */
    for (int attempt = 0; attempt < 2 && lfd < 0; attempt++) {
      if (getaddrinfo(attempt == 0 ? host : NULL, port, &hints, &res) != 0) continue;
      for (struct addrinfo* a = res; a && lfd < 0; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) {
          lfd = fd;
        } else {
          err = errno;
          close(fd);
        }
      }
      freeaddrinfo(res);
    }
    if (lfd < 0 && err == EADDRINUSE) usleep(50 * 1000);
  } while (lfd < 0 && err == EADDRINUSE && bench_now() < bind_until);
  if (lfd < 0) {
    fprintf(stderr, "%s: cannot listen on %s:%s for the other processes: %s%s\n", bench_w.hostname,
            host, port, strerror(err),
            err == EADDRINUSE ? " (another program holds the port: choose a free one with MASTER_PORT or COMM_BENCH_PORT)"
                              : "");
    return -1;
  }
  int joined = 1;
  for (int p = 0; p < bench_w.nprocs; p++) oob_fds[p] = -1;
  while (joined < bench_w.nprocs) {
    int ms = (int)((deadline - bench_now()) * 1000);
    struct pollfd pfd = {lfd, POLLIN, 0};
    if (ms <= 0 || poll(&pfd, 1, ms) == 0) {
      fprintf(stderr, "%s: only %d of %d processes connected to %s:%s in time; missing:", bench_w.hostname,
              joined, bench_w.nprocs, host, port);
      for (int p = 1; p < bench_w.nprocs; p++)
        if (oob_fds[p] < 0) fprintf(stderr, " %d", p);
      fprintf(stderr, "\n");
      close(lfd);
      return -1;
    }
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) continue;
    struct oob_hello h;
    double hello_deadline = bench_now() + 10;
    if (io_all(fd, &h, sizeof h, 0, hello_deadline) != 0 || memcmp(h.magic, OOB_MAGIC, 8) != 0) {
      fprintf(stderr, "%s: ignoring a connection that is not a new process of this job\n", bench_w.hostname);
      close(fd);
      continue;
    }
    if (h.job != job_hash()) {
      fprintf(stderr, "%s: ignoring process %d of another job (its launcher's job id differs from this one's), which came to port %s\n",
              bench_w.hostname, h.proc, port);
      close(fd);
      continue;
    }
    if (h.nprocs != bench_w.nprocs || h.proc <= 0 || h.proc >= bench_w.nprocs || oob_fds[h.proc] >= 0) {
      /* A process of this job started with another size or rank: say which, here and (by
       * closing) there, rather than wait for it. */
      if (h.nprocs != bench_w.nprocs)
        fprintf(stderr, "%s: ignoring process %d, which was started for %d processes where this one has %d: every process needs the same WORLD_SIZE\n",
                bench_w.hostname, h.proc, h.nprocs, bench_w.nprocs);
      else
        fprintf(stderr, "%s: ignoring a process that claims rank %d, %s\n", bench_w.hostname, h.proc,
                h.proc <= 0 || h.proc >= bench_w.nprocs ? "out of range" : "which another process has: every process needs its own RANK");
      close(fd);
      continue;
    }
    oob_fds[h.proc] = fd;
    joined++;
  }
  close(lfd);
  return 0;
}

/* Before process 0 listens, a connect() to a port in the ephemeral range can be given that
 * same port as its source and meet itself (TCP simultaneous open): it then "succeeds", talks
 * to itself, and keeps process 0 from binding the port ("Address already in use"). */
static int connected_to_itself(int fd) {
  struct sockaddr_storage me, peer;
  socklen_t ml = sizeof me, pl = sizeof peer;
  if (getsockname(fd, (struct sockaddr*)&me, &ml) != 0 || getpeername(fd, (struct sockaddr*)&peer, &pl) != 0)
    return 0;
  return ml == pl && memcmp(&me, &peer, ml) == 0;
}

static int oob_join(double deadline) {
  const char* host;
  char port[16];
  if (oob_endpoint(&host, port, sizeof port) != 0) return -1;
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_socktype = SOCK_STREAM;
  int fd = -1;
  /* Process 0 may not be listening yet: retry until the deadline. */
  while (fd < 0 && bench_now() < deadline) {
    if (getaddrinfo(host, port, &hints, &res) == 0) {
      for (struct addrinfo* a = res; a && fd < 0; a = a->ai_next) {
        int s = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (s < 0) continue;
        if (connect(s, a->ai_addr, a->ai_addrlen) == 0 && !connected_to_itself(s)) {
          fd = s;
        } else {
          /* A self-connected socket holds the port process 0 must bind: let go at once (a
           * reset, not a close that would leave it in TIME_WAIT for a minute). */
          struct linger now = {1, 0};
          setsockopt(s, SOL_SOCKET, SO_LINGER, &now, sizeof now);
          close(s);
        }
      }
      freeaddrinfo(res);
    }
    if (fd < 0) usleep(100 * 1000);
  }
  if (fd < 0) {
    int local = strncmp(host, "127.", 4) == 0 || strcmp(host, "localhost") == 0 || strcmp(host, "::1") == 0;
    fprintf(stderr, "%s: process %d could not reach process 0 at %s:%s%s\n", bench_w.hostname, bench_w.proc, host,
            port, local ? " (a loopback address: with processes on several hosts, set MASTER_ADDR to process 0's host)" : "");
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct oob_hello h;
  memcpy(h.magic, OOB_MAGIC, 8);
  h.proc = bench_w.proc;
  h.nprocs = bench_w.nprocs;
  h.job = job_hash();
  if (io_all(fd, &h, sizeof h, 1, deadline) != 0) {
    close(fd);
    return -1;
  }
  oob_fds[0] = fd;
  return 0;
}

#endif /* !BENCH_WITH_MPI */

int bench_oob_allgather(const void* mine, void* all, size_t bytes) {
  char* out = all;
  memcpy(out + (size_t)bench_w.proc * bytes, mine, bytes);
  if (bench_w.nprocs == 1) return 0;
#ifdef BENCH_WITH_MPI
  return MPI_Allgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, MPI_COMM_WORLD) == MPI_SUCCESS ? 0 : -1;
#else
  if (bench_w.nprocs > (int)(sizeof oob_fds / sizeof oob_fds[0])) {
    fprintf(stderr, "at most %zu processes are supported\n", sizeof oob_fds / sizeof oob_fds[0]);
    return -1;
  }
  double deadline = oob_deadline();
  if (!oob_ready) {
    if ((bench_w.proc == 0 ? oob_serve(deadline) : oob_join(deadline)) != 0) return -1;
    oob_ready = 1;
  }
  uint64_t len = bytes;
  if (bench_w.proc == 0) {
    for (int p = 1; p < bench_w.nprocs; p++) {
      uint64_t theirs = 0;
      if (io_all(oob_fds[p], &theirs, 8, 0, deadline) != 0 || theirs != len ||
          io_all(oob_fds[p], out + (size_t)p * bytes, bytes, 0, deadline) != 0) {
        fprintf(stderr, "%s: lost process %d during start-up\n", bench_w.hostname, p);
        return -1;
      }
    }
    for (int p = 1; p < bench_w.nprocs; p++)
      if (io_all(oob_fds[p], out, bytes * (size_t)bench_w.nprocs, 1, deadline) != 0) {
        fprintf(stderr, "%s: lost process %d during start-up\n", bench_w.hostname, p);
        return -1;
      }
  } else {
    if (io_all(oob_fds[0], &len, 8, 1, deadline) != 0 || io_all(oob_fds[0], (void*)mine, bytes, 1, deadline) != 0 ||
        io_all(oob_fds[0], out, bytes * (size_t)bench_w.nprocs, 0, deadline) != 0) {
      fprintf(stderr, "%s: process %d lost process 0 during start-up (did it refuse this process? every process needs the same WORLD_SIZE and its own RANK)\n",
              bench_w.hostname, bench_w.proc);
      return -1;
    }
  }
  return 0;
#endif
}

int bench_oob_bcast(void* buf, size_t bytes) {
  if (bench_w.nprocs == 1) return 0;
#ifdef BENCH_WITH_MPI
  return MPI_Bcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD) == MPI_SUCCESS ? 0 : -1;
#else
  /* Over the rendezvous: an allgather of which everyone keeps process 0's part. */
  char* all = malloc(bytes * (size_t)bench_w.nprocs);
  int rc = all ? bench_oob_allgather(buf, all, bytes) : -1;
  if (rc == 0) memcpy(buf, all, bytes);
  free(all);
  return rc;
#endif
}

void bench_oob_close(void) {
#ifndef BENCH_WITH_MPI
  if (!oob_ready) return;
  for (int p = 0; p < bench_w.nprocs; p++)
    if ((bench_w.proc == 0 ? p > 0 : p == 0) && oob_fds[p] >= 0) close(oob_fds[p]);
  oob_ready = 0;
#endif
}

void bench_launch_finish(void) {
  bench_oob_close();
#ifdef BENCH_WITH_MPI
  MPI_Finalize();
#endif
}

void bench_exit_now(int status) {
  fflush(stdout);
  fflush(stderr);
#ifdef BENCH_WITH_MPI
  if (bench_w.nprocs > 1) MPI_Abort(MPI_COMM_WORLD, status);
#endif
  _exit(status);
}

/* ---- synchronisation during the run ------------------------------------------------------ */

/* Threads of one process meet here; thread 0 (the main thread, the only one that calls MPI)
 * waits for all, adds the other processes' values through MPI, and publishes the result. */
static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived;
  unsigned long generation;
  int cap;
  double* acc;
  double* result[2];
} rv = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL, {NULL, NULL}};

void bench_sync_init(int max_values) {
  rv.cap = max_values < 1 ? 1 : max_values;
  rv.acc = calloc((size_t)rv.cap, sizeof(double));
  rv.result[0] = calloc((size_t)rv.cap, sizeof(double));
  rv.result[1] = calloc((size_t)rv.cap, sizeof(double));
}

static void combine(double* acc, const double* v, int n, int op) {
  for (int i = 0; i < n; i++) {
    if (op == SYNC_MIN)
      acc[i] = v[i] < acc[i] ? v[i] : acc[i];
    else if (op == SYNC_MAX)
      acc[i] = v[i] > acc[i] ? v[i] : acc[i];
    else
      acc[i] += v[i];
  }
}

static void nccl_sync(bench_thread* t, double* vals, int n, int op) {
  int m = n > 0 ? n : 1;
  size_t bytes = (size_t)m * sizeof(double);
  ncclRedOp_t rop = op == SYNC_MIN ? ncclMin : op == SYNC_MAX ? ncclMax : ncclSum;
  for (int i = 0; i < t->n; i++) {
    /* Values are per thread: its first communicator carries them, the others add nothing. */
    double* src = t->sync_host;
    for (int k = 0; k < m; k++) src[k] = n == 0 ? 0 : (i == 0 || op != SYNC_SUM) ? vals[k] : 0;
    if (bench_w.device_mode) {
      int e = bench_cuda_upload(t->devs[i], t->sync_buf[i], src, bytes);
      if (e) bench_fail(BENCH_ERR_CUDA, "%s: Test CUDA failure %s:%d '%s'\n", bench_w.hostname, __FILE__, __LINE__, bench_cu.GetErrorString(e));
    } else {
      memcpy(t->sync_buf[i], src, bytes);
    }
  }
  bench_watch_arm(t, __FILE__, __LINE__);
  int rc = 0;
  if (t->n > 1) rc = ncclGroupStart();
  for (int i = 0; i < t->n && rc == 0; i++)
    rc = ncclAllReduce(t->sync_buf[i], t->sync_buf[i], (size_t)m, ncclFloat64, rop, t->comms[i], t->streams[i]);
  if (t->n > 1 && rc == 0) rc = ncclGroupEnd();
  if (rc) bench_fail_nccl(t, rc, __FILE__, __LINE__);
  if (bench_w.device_mode) {
    for (int i = 0; i < t->n; i++) {
      int e = bench_cuda_sync(t->devs[i], t->streams[i]);
      if (e) bench_fail(BENCH_ERR_CUDA, "%s: Test CUDA failure %s:%d '%s'\n", bench_w.hostname, __FILE__, __LINE__, bench_cu.GetErrorString(e));
    }
    bench_cu.Memcpy(t->sync_host, t->sync_buf[0], bytes, BENCH_D2H);
  } else {
    memcpy(t->sync_host, t->sync_buf[0], bytes);
  }
  bench_watch_disarm(t);
  if (n > 0) memcpy(vals, t->sync_host, (size_t)n * sizeof(double));
}

void bench_sync_reduce(bench_thread* t, double* vals, int n, int op) {
  if (bench_w.launcher == LAUNCH_ENV && bench_w.nprocs > 1) {
    nccl_sync(t, vals, n, op);
    return;
  }
  if (n > rv.cap) bench_fail(BENCH_ERR_INTERNAL, "internal error: %d values exceed the sync capacity %d\n", n, rv.cap);
  pthread_mutex_lock(&rv.mu);
  if (rv.arrived == 0)
    memcpy(rv.acc, vals, (size_t)n * sizeof(double));
  else
    combine(rv.acc, vals, n, op);
  rv.arrived++;
  unsigned long gen = rv.generation;
  if (t->thread == 0) {
    while (rv.arrived < bench_w.nthreads) pthread_cond_wait(&rv.cv, &rv.mu);
#ifdef BENCH_WITH_MPI
    if (bench_w.nprocs > 1) {
      bench_watch_arm(t, __FILE__, __LINE__);
      int rc = n == 0 ? MPI_Barrier(MPI_COMM_WORLD)
                      : MPI_Allreduce(MPI_IN_PLACE, rv.acc, n, MPI_DOUBLE,
                                      op == SYNC_MIN ? MPI_MIN : op == SYNC_MAX ? MPI_MAX : MPI_SUM,
                                      MPI_COMM_WORLD);
      bench_watch_disarm(t);
      if (rc != MPI_SUCCESS) bench_fail(BENCH_ERR_MPI, "%s: Test MPI failure %s:%d\n", bench_w.hostname, __FILE__, __LINE__);
    }
#endif
    memcpy(rv.result[gen & 1], rv.acc, (size_t)n * sizeof(double));
    rv.arrived = 0;
    rv.generation++;
    pthread_cond_broadcast(&rv.cv);
  } else {
    if (rv.arrived == bench_w.nthreads) pthread_cond_broadcast(&rv.cv);
    while (rv.generation == gen) pthread_cond_wait(&rv.cv, &rv.mu);
  }
  memcpy(vals, rv.result[gen & 1], (size_t)n * sizeof(double));
  pthread_mutex_unlock(&rv.mu);
}

void bench_sync_barrier(bench_thread* t) { bench_sync_reduce(t, NULL, 0, SYNC_SUM); }

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived;
  unsigned long generation;
} lb = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};

void bench_local_barrier(bench_thread* t) {
  (void)t;
  pthread_mutex_lock(&lb.mu);
  unsigned long gen = lb.generation;
  if (++lb.arrived == bench_w.nthreads) {
    lb.arrived = 0;
    lb.generation++;
    pthread_cond_broadcast(&lb.cv);
  } else {
    while (lb.generation == gen) pthread_cond_wait(&lb.cv, &lb.mu);
  }
  pthread_mutex_unlock(&lb.mu);
}
