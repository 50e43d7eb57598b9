/* Output helpers: nccl-tests' number format and a small JSON writer.
 *
 * The JSON document follows the structure of nccl-tests' -J output (version 2): a top-level
 * object with start_time, args, env, nccl_version, config (with the devices), results (one
 * object per printed row), out_of_bounds, average_bus_bandwidth, errors and end_time. Like
 * nccl-tests, booleans are written as the strings "true"/"false" and NaN as "nan". The
 * writer keeps a stack of open containers so that a failing run can still close the file. */
#include "harness.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void bench_float_str(double value, int width, char* out) {
  /* digits before the decimal point decide how many after it fit */
  int digits = 0;
  double p = 1;
  while (value >= p && digits < 40) {
    digits++;
    p *= 10;
  }
  if (digits < width - 2)
    sprintf(out, "%*.2f", width, value);
  else if (digits < width - 1)
    sprintf(out, "%*.1f", width, value);
  else if (digits < width + 1)
    sprintf(out, "%*.0f", width, value);
  else if (width >= 7)
    sprintf(out, "%*.1e", width, value);
  else
    sprintf(out, "%*.0e", width, value);
}

void bench_timestamp(char* out, size_t len) {
  time_t now = time(NULL);
  struct tm tm;
  localtime_r(&now, &tm);
  strftime(out, len, "%Y-%m-%d %H:%M:%S", &tm);
}

/* ---- JSON ------------------------------------------------------------------------------------ */

enum { J_KEY, J_OBJECT_EMPTY, J_OBJECT, J_LIST_EMPTY, J_LIST };

static FILE* jf;
static int jstack[64];
static int jdepth;
static pthread_mutex_t jlock = PTHREAD_MUTEX_INITIALIZER;

int bench_json_active(void) { return jf != NULL; }

static void put_string(const char* s) {
  fputc('"', jf);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    switch (c) {
      case '"': fputs("\\\"", jf); break;
      case '\\': fputs("\\\\", jf); break;
      case '\n': fputs("\\n", jf); break;
      case '\t': fputs("\\t", jf); break;
      default:
        if (c < 0x20)
          fprintf(jf, "\\u%04x", c);
        else
          fputc(c, jf);
    }
  }
  fputc('"', jf);
}

/* Before a value: a comma inside a non-empty list, nothing after a key. */
static void before_value(void) {
  if (jdepth == 0) return;
  int* top = &jstack[jdepth - 1];
  if (*top == J_LIST_EMPTY)
    *top = J_LIST;
  else if (*top == J_LIST)
    fputc(',', jf);
  else if (*top == J_KEY)
    jdepth--;
}

static void j_key(const char* key) {
  if (!jf) return;
  int* top = &jstack[jdepth - 1];
  if (*top == J_OBJECT) fputc(',', jf);
  *top = J_OBJECT;
  put_string(key);
  fputc(':', jf);
  jstack[jdepth++] = J_KEY;
}

static void j_begin_object(void) {
  if (!jf) return;
  before_value();
  fputc('{', jf);
  jstack[jdepth++] = J_OBJECT_EMPTY;
}

static void j_begin_list(void) {
  if (!jf) return;
  before_value();
  fputc('[', jf);
  jstack[jdepth++] = J_LIST_EMPTY;
}

static void j_end(void) {
  if (!jf || jdepth == 0) return;
  int top = jstack[--jdepth];
  if (top == J_KEY) {
    fputs("null", jf);
    return;
  }
  fputc(top == J_OBJECT_EMPTY || top == J_OBJECT ? '}' : ']', jf);
}

static void j_str(const char* s) {
  if (!jf) return;
  before_value();
  put_string(s ? s : "");
}

static void j_int(long long v) {
  if (!jf) return;
  before_value();
  fprintf(jf, "%lld", v);
}

static void j_double(double v) {
  if (!jf) return;
  before_value();
  if (v != v)
    fputs("\"nan\"", jf);
  else if (v > 1e308 || v < -1e308)
    fputs(v > 0 ? "\"inf\"" : "\"-inf\"", jf);
  else
    fprintf(jf, "%lf", v);
}


static void j_null(void) {
  if (!jf) return;
  before_value();
  fputs("null", jf);
}


/* The public writers take the lock: a failing thread may close the document at any time. */
#define LOCKED(call)             \
  do {                           \
    pthread_mutex_lock(&jlock);  \
    call;                        \
    pthread_mutex_unlock(&jlock); \
  } while (0)
void bench_json_key(const char* key) { LOCKED(j_key(key)); }
void bench_json_begin_object(void) { LOCKED(j_begin_object()); }
void bench_json_begin_list(void) { LOCKED(j_begin_list()); }
void bench_json_end(void) { LOCKED(j_end()); }
void bench_json_str(const char* s) { LOCKED(j_str(s)); }
void bench_json_int(long long v) { LOCKED(j_int(v)); }
void bench_json_double(double v) { LOCKED(j_double(v)); }
void bench_json_null(void) { LOCKED(j_null()); }
void bench_json_bool_str(int v) { LOCKED(j_str(v ? "true" : "false")); }

/* Environment variables worth recording: the ones that steer NCCL, comm, CUDA and the
 * launchers. Anything that looks like a credential stays out. */
static int env_recorded(const char* e) {
  static const char* const prefixes[] = {"NCCL_", "COMM_", "CUDA_", "OMPI_COMM_WORLD_", "SLURM_",
                                         "RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=",
                                         "MASTER_ADDR=", "MASTER_PORT=", NULL};
  const char* eq = strchr(e, '=');
  size_t name_len = eq ? (size_t)(eq - e) : strlen(e);
  static const char* const secrets[] = {"SECRET", "TOKEN", "PASSW", "KEY", "CRED", NULL};
  for (int i = 0; secrets[i]; i++) {
    const char* hit = strstr(e, secrets[i]);
    if (hit && (size_t)(hit - e) < name_len) return 0;
  }
  for (int i = 0; prefixes[i]; i++)
    if (strncmp(e, prefixes[i], strlen(prefixes[i])) == 0) return 1;
  return 0;
}

extern char** environ;

int bench_json_open(const char* path, int argc, char** argv) {
  char* try_path = strdup(path);
  FILE* f = fopen(try_path, "wx");
  for (int i = 0; !f && errno == EEXIST && i < 1000; i++) {
    free(try_path);
    size_t len = strlen(path) + 16;
    try_path = malloc(len);
    snprintf(try_path, len, "%s.%d", path, i);
    f = fopen(try_path, "wx");
  }
  if (!f) {
    printf("# skipping json output; %s not accessible\n", try_path);
    free(try_path);
    return -1;
  }
  printf("# Writing JSON output to %s\n", try_path);
  free(try_path);
  jf = f;
  jdepth = 0;
  char ts[64];
  j_begin_object();
  j_key("version");
  j_int(2);
  j_key("start_time");
  bench_timestamp(ts, sizeof ts);
  j_str(ts);
  j_key("args");
  j_begin_list();
  for (int i = 0; i < argc; i++) j_str(argv[i]);
  j_end();
  j_key("env");
  j_begin_list();
  for (char** e = environ; e && *e; e++)
    if (env_recorded(*e)) j_str(*e);
  j_end();
  int version = 0;
  ncclGetVersion(&version);
  j_key("nccl_version");
  j_int(version);
  /* comm-bench additions: which library ran, beside the NCCL API level above. */
  const char *name, *lib_ver;
  const char* description = bench_library(&name, &lib_ver);
  j_key("library");
  j_str(name);
  j_key("library_version");
  j_str(lib_ver);
  j_key("library_description");
  j_str(description);
  return 0;
}

typedef ncclResult_t (*comm_get_version_fn)(int* version, const char** text);

static char lib_description[256], lib_version[32];
static const char* lib_name = "nccl";

static void find_library(void) {
  comm_get_version_fn comm_get_version = NULL;
  void* self = dlopen(NULL, RTLD_LAZY);
  if (self) *(void**)&comm_get_version = dlsym(self, "commGetVersion");
  int code = 0;
  const char* text = NULL;
  if (comm_get_version && comm_get_version(&code, &text) == ncclSuccess && text) {
    lib_name = "comm";
    snprintf(lib_version, sizeof lib_version, "%d.%d.%d", code / 10000, code / 100 % 100, code % 100);
    snprintf(lib_description, sizeof lib_description, "%s", text);
  } else {
    ncclGetVersion(&code);
    snprintf(lib_version, sizeof lib_version, "%d.%d.%d", code / 10000, code / 100 % 100, code % 100);
    snprintf(lib_description, sizeof lib_description, "NCCL %s", lib_version);
  }
  if (self) dlclose(self);
}

const char* bench_library(const char** name, const char** version) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, find_library);
  if (name) *name = lib_name;
  if (version) *version = lib_version;
  return lib_description;
}

/* Closes whatever is open down to the top-level object, adds the errors and the end time. */
void bench_json_close(const char* error) {
  pthread_mutex_lock(&jlock);
  if (jf) {
    while (jdepth > 1) j_end();
    if (jdepth == 1) {
      j_key("errors");
      j_begin_list();
      if (error && *error) j_str(error);
      j_end();
      char ts[64];
      bench_timestamp(ts, sizeof ts);
      j_key("end_time");
      j_str(ts);
      j_end();
    }
    fputc('\n', jf);
    fclose(jf);
    jf = NULL;
  }
  pthread_mutex_unlock(&jlock);
}
