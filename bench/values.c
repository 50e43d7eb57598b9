/* Datatypes, the input values of every test and their expected reductions.
 *
 * Inputs are small integers. For each (datatype, op, number of ranks) the range is chosen so
 * that every partial result of the reduction, in whatever order the library combines ranks,
 * is an integer the datatype represents exactly; the expected result is then exact, and the
 * check compares element by element with ==. The one exception is avg on floating-point
 * types: NCCL (and comm) multiply each input by 1/n before summing, and 1/n is rarely exact,
 * so that case compares with a tolerance (see bench_plan_make).
 *
 * half, bfloat16 and the two fp8 formats are encoded and decoded here, without CUDA. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const bench_type_info types[BENCH_NUM_TYPES] = {
    /* name, type, size, float, signed, precision, exact_max, max_pow2 */
    {"int8", ncclInt8, 1, 0, 1, 0, 127, 6},
    {"uint8", ncclUint8, 1, 0, 0, 0, 255, 7},
    {"int32", ncclInt32, 4, 0, 1, 0, INT32_MAX, 30},
    {"uint32", ncclUint32, 4, 0, 0, 0, UINT32_MAX, 31},
    {"int64", ncclInt64, 8, 0, 1, 0, INT64_MAX, 62},
    {"uint64", ncclUint64, 8, 0, 0, 0, INT64_MAX, 62},
    {"half", ncclFloat16, 2, 1, 1, 11, 2048, 15},
    {"float", ncclFloat32, 4, 1, 1, 24, 1 << 24, 127},
    {"double", ncclFloat64, 8, 1, 1, 53, 1LL << 53, 1023},
    {"bfloat16", ncclBfloat16, 2, 1, 1, 8, 256, 127},
    {"f8e4m3", ncclFloat8e4m3, 1, 1, 1, 4, 16, 8},
    {"f8e5m2", ncclFloat8e5m2, 1, 1, 1, 3, 8, 15},
};

static const char* op_names[BENCH_NUM_OPS] = {"sum", "prod", "max", "min", "avg", "mulsum"};

const bench_type_info* bench_type_at(int index) { return &types[index]; }

const bench_type_info* bench_type_of(ncclDataType_t type) {
  for (int i = 0; i < BENCH_NUM_TYPES; i++)
    if (types[i].type == type) return &types[i];
  return NULL;
}

size_t bench_type_size(ncclDataType_t type) {
  const bench_type_info* t = bench_type_of(type);
  return t ? t->size : 0;
}

int bench_type_index(const char* name) {
  for (int i = 0; i < BENCH_NUM_TYPES; i++)
    if (strcmp(name, types[i].name) == 0) return i;
  return strcmp(name, "all") == 0 ? -1 : -2;
}

const char* bench_op_name(int op) { return op >= 0 && op < BENCH_NUM_OPS ? op_names[op] : "none"; }

int bench_op_index(const char* name) {
  for (int i = 0; i < BENCH_NUM_OPS; i++)
    if (strcmp(name, op_names[i]) == 0) return i;
  return strcmp(name, "all") == 0 ? -1 : -2;
}

/* ---- small floating-point formats ---------------------------------------------------------
 * A format has `ebits` exponent bits and `mbits` stored mantissa bits. IEEE-like formats
 * (half, bfloat16, e5m2) keep the top exponent for inf/NaN; e4m3 ("fn") has no infinities and
 * only S.1111.111 is NaN, so its largest finite value is 448. */

typedef struct {
  int ebits, mbits, finite_only;
} minifloat;

static const minifloat F16 = {5, 10, 0}, BF16 = {8, 7, 0}, E4M3 = {4, 3, 1}, E5M2 = {5, 2, 0};

static double minifloat_decode(minifloat f, uint32_t bits) {
  uint32_t emask = (1u << f.ebits) - 1, mmask = (1u << f.mbits) - 1;
  int sign = (bits >> (f.ebits + f.mbits)) & 1;
  uint32_t e = (bits >> f.mbits) & emask, m = bits & mmask;
  int bias = (1 << (f.ebits - 1)) - 1;
  double v;
  if (!f.finite_only && e == emask) {
    v = m ? NAN : INFINITY;
  } else if (f.finite_only && e == emask && m == mmask) {
    v = NAN;
  } else if (e == 0) {
    v = ldexp((double)m, 1 - bias - f.mbits);
  } else {
    v = ldexp((double)(m + (1u << f.mbits)), (int)e - bias - f.mbits);
  }
  return sign ? -v : v;
}

static uint32_t minifloat_encode(minifloat f, double x) {
  uint32_t emask = (1u << f.ebits) - 1, mmask = (1u << f.mbits) - 1;
  uint32_t sign = signbit(x) ? 1u << (f.ebits + f.mbits) : 0;
  int bias = (1 << (f.ebits - 1)) - 1;
  if (isnan(x)) return sign | (emask << f.mbits) | (f.finite_only ? mmask : 1u << (f.mbits - 1));
  double a = fabs(x);
  if (a == 0) return sign;
  if (isinf(a)) return f.finite_only ? sign | (emask << f.mbits) | (mmask - 1) : sign | (emask << f.mbits);
  /* Largest exponent field of a finite value, and the mantissa limit there. */
  uint32_t top_e = f.finite_only ? emask : emask - 1;
  uint32_t top_m = f.finite_only ? mmask - 1 : mmask;
  int e2;
  frexp(a, &e2);
  int exp = e2 - 1; /* a in [2^exp, 2^(exp+1)) */
  int emin = 1 - bias;
  if (exp < emin) exp = emin; /* subnormal: fixed quantum */
  double r = nearbyint(ldexp(a, f.mbits - exp)); /* round to nearest even */
  if (r >= ldexp(1, f.mbits + 1)) {
    r = ldexp(1, f.mbits);
    exp++;
  }
  uint32_t efield, mfield;
  if (r < ldexp(1, f.mbits)) {
    efield = 0;
    mfield = (uint32_t)r;
  } else {
    efield = (uint32_t)(exp + bias);
    mfield = (uint32_t)r - (1u << f.mbits);
  }
  if (efield > top_e || (efield == top_e && mfield > top_m)) {
    if (f.finite_only) return sign | (top_e << f.mbits) | top_m; /* saturate */
    return sign | (emask << f.mbits);                            /* infinity */
  }
  return sign | (efield << f.mbits) | mfield;
}

static const minifloat* minifloat_of(ncclDataType_t t) {
  switch (t) {
    case ncclFloat16: return &F16;
    case ncclBfloat16: return &BF16;
    case ncclFloat8e4m3: return &E4M3;
    case ncclFloat8e5m2: return &E5M2;
    default: return NULL;
  }
}

/* Tables for the 8- and 16-bit formats: every element of every buffer is written and read,
 * and inputs are small integers. */
#define ENC_RANGE 4096 /* integers in [-ENC_RANGE, ENC_RANGE] have a precomputed encoding */
static double* decode_table[BENCH_NUM_TYPES];
static uint16_t* encode_table[BENCH_NUM_TYPES];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_tables(void) {
  for (int i = 0; i < BENCH_NUM_TYPES; i++) {
    const minifloat* f = minifloat_of(types[i].type);
    if (!f) continue;
    size_t n = (size_t)1 << (8 * types[i].size);
    double* tab = malloc(n * sizeof(double));
    for (size_t b = 0; b < n; b++) tab[b] = minifloat_decode(*f, (uint32_t)b);
    decode_table[i] = tab;
    uint16_t* enc = malloc((2 * ENC_RANGE + 1) * sizeof(uint16_t));
    for (int v = -ENC_RANGE; v <= ENC_RANGE; v++) enc[v + ENC_RANGE] = (uint16_t)minifloat_encode(*f, v);
    encode_table[i] = enc;
  }
}

void bench_encode(const bench_type_info* t, double v, void* dst) {
  const minifloat* f = minifloat_of(t->type);
  if (f) {
    uint32_t bits = minifloat_encode(*f, v);
    if (t->size == 1) {
      *(uint8_t*)dst = (uint8_t)bits;
    } else {
      uint16_t b16 = (uint16_t)bits;
      memcpy(dst, &b16, 2);
    }
    return;
  }
  switch (t->type) {
    case ncclFloat32: {
      float x = (float)v;
      memcpy(dst, &x, 4);
      break;
    }
    case ncclFloat64: memcpy(dst, &v, 8); break;
    default: bench_store(t, dst, (int64_t)v); break;
  }
}

void bench_store(const bench_type_info* t, void* dst, int64_t v) {
  switch (t->type) {
    case ncclInt8: *(int8_t*)dst = (int8_t)v; break;
    case ncclUint8: *(uint8_t*)dst = (uint8_t)v; break;
    case ncclInt32: {
      int32_t x = (int32_t)v;
      memcpy(dst, &x, 4);
      break;
    }
    case ncclUint32: {
      uint32_t x = (uint32_t)v;
      memcpy(dst, &x, 4);
      break;
    }
    case ncclInt64: memcpy(dst, &v, 8); break;
    case ncclUint64: {
      uint64_t x = (uint64_t)v;
      memcpy(dst, &x, 8);
      break;
    }
    case ncclFloat32: {
      float x = (float)v;
      memcpy(dst, &x, 4);
      break;
    }
    case ncclFloat64: {
      double x = (double)v;
      memcpy(dst, &x, 8);
      break;
    }
    default:
      if (v >= -ENC_RANGE && v <= ENC_RANGE) {
        pthread_once(&tables_once, build_tables);
        uint16_t b = encode_table[t - types][v + ENC_RANGE];
        if (t->size == 1)
          *(uint8_t*)dst = (uint8_t)b;
        else
          memcpy(dst, &b, 2);
      } else {
        bench_encode(t, (double)v, dst);
      }
      break;
  }
}

/* A value no test ever produces: NaN for floating types, the most negative value for signed
 * integers (inputs stay within +-exact_max), the largest for unsigned ones (sums stay below). */
void bench_store_poison(const bench_type_info* t, void* dst) {
  if (t->is_float) {
    memset(dst, 0xff, t->size);
  } else if (t->is_signed) {
    memset(dst, 0, t->size);
    ((uint8_t*)dst)[t->size - 1] = 0x80; /* little-endian sign bit */
  } else {
    memset(dst, 0xff, t->size);
  }
}

double bench_load_double(const bench_type_info* t, const void* src) {
  switch (t->type) {
    case ncclFloat32: {
      float x;
      memcpy(&x, src, 4);
      return x;
    }
    case ncclFloat64: {
      double x;
      memcpy(&x, src, 8);
      return x;
    }
    case ncclFloat16:
    case ncclBfloat16: {
      pthread_once(&tables_once, build_tables);
      uint16_t b;
      memcpy(&b, src, 2);
      return decode_table[t - types][b];
    }
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      pthread_once(&tables_once, build_tables);
      return decode_table[t - types][*(const uint8_t*)src];
    default: return (double)bench_load_int(t, src);
  }
}

int64_t bench_load_int(const bench_type_info* t, const void* src) {
  switch (t->type) {
    case ncclInt8: return *(const int8_t*)src;
    case ncclUint8: return *(const uint8_t*)src;
    case ncclInt32: {
      int32_t x;
      memcpy(&x, src, 4);
      return x;
    }
    case ncclUint32: {
      uint32_t x;
      memcpy(&x, src, 4);
      return x;
    }
    case ncclInt64:
    case ncclUint64: {
      int64_t x; /* unsigned values above INT64_MAX only come from poison: they read negative */
      memcpy(&x, src, 8);
      return x;
    }
    default: return (int64_t)bench_load_double(t, src);
  }
}

/* ---- value plans ---------------------------------------------------------------------------- */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

int64_t bench_mulsum_scalar(int rank) { return 1 + (rank & 1); }

void bench_plan_make(bench_plan* p, const bench_type_info* t, int op, int nranks, uint64_t seed) {
  memset(p, 0, sizeof *p);
  p->op = op;
  p->nranks = nranks;
  p->seed = seed;
  /* Keep every partial result strictly inside the exact range: the unsigned poison (the
   * type's maximum) can then never be a correct result. */
  int64_t room = t->exact_max - 1;
  int64_t n = nranks;
  int64_t cap;
  switch (op) {
    case BENCH_SUM:
    case BENCH_MULSUM:
      /* |sum of n values scaled by at most 2| <= room */
      cap = room / (op == BENCH_MULSUM ? 2 * n : n);
      if (cap >= 1) {
        cap = min64(cap, 100);
        p->kind = PLAN_SPREAD;
        p->lo = t->is_signed ? -cap : 0;
        p->hi = cap;
      } else {
        /* More ranks than exact integers: a 1 from a few ranks per element, 0 elsewhere. */
        p->kind = PLAN_SPARSE;
        p->ones = (int)(room / (op == BENCH_MULSUM ? 2 : 1));
        if (p->ones < 1) p->ones = 1;
      }
      break;
    case BENCH_PROD: {
      /* Factors of 1 and 2 (and -1 for signed types): at most `ones` twos per element. */
      int k = t->max_pow2 < 8 ? t->max_pow2 : 8;
      p->kind = PLAN_PROD;
      p->ones = nranks < k ? nranks : k;
      p->with_neg = t->is_signed;
      break;
    }
    case BENCH_AVG: {
      /* Rank r holds k + e_r with sum(e_r) = 0, so the sum is n*k and the average is exactly k
       * for integer types (NCCL sums, then divides). */
      p->kind = PLAN_AVG;
      int64_t k = room / n - 1;
      if (k >= 1) {
        k = min64(k, 100);
        p->lo = t->is_signed ? -k : 1;
        p->hi = k;
      }
      p->with_neg = t->is_signed || k >= 1; /* the -1 offsets must stay >= 0 when unsigned */
      if (t->is_float) {
        /* Floats average as sum(x_r * (1/n)): 1/n and each product round once (relative
         * error <= u), the n-term sum adds at most (n-1)u of the magnitude, the result rounds
         * once more: |error| <= (n + 2) u max|x_r|, u = 2^-precision. */
        double maxabs = (double)(k >= 1 ? k + 1 : 1);
        p->tolerance = (double)(n + 2) * ldexp(1.0, -t->precision) * maxabs;
      }
      break;
    }
    default: { /* max, min, and collectives that only move data */
      int64_t r = min64(room, 100);
      p->kind = PLAN_SPREAD;
      p->lo = t->is_signed ? -r : 0;
      p->hi = r;
      break;
    }
  }
}

static inline uint64_t mix64(uint64_t x) {
  x ^= x >> 31;
  x *= 0x7fb5d329728ea185ULL;
  x ^= x >> 27;
  x *= 0x81dadef4bc2dd44dULL;
  x ^= x >> 33;
  return x;
}

/* A pseudo-random number in [0, span) for (rank, index). */
static inline uint64_t pick(const bench_plan* p, int rank, uint64_t index, uint64_t span) {
  uint64_t h = mix64(index * 0x9e3779b97f4a7c15ULL + (uint64_t)(rank + 1) * 0xd1b54a32d192ed03ULL +
                     p->seed * 0xaef17502108ef2d9ULL);
  return (uint64_t)(((unsigned __int128)h * span) >> 64);
}

int64_t bench_value(const bench_plan* p, int rank, uint64_t index) {
  int n = p->nranks;
  switch (p->kind) {
    case PLAN_SPREAD: return p->lo + (int64_t)pick(p, rank, index, (uint64_t)(p->hi - p->lo + 1));
    case PLAN_SPARSE: return (int)((index + (uint64_t)rank) % (uint64_t)n) < p->ones ? 1 : 0;
    case PLAN_PROD:
      if ((int)((index + (uint64_t)rank) % (uint64_t)n) < p->ones) return 2;
      return p->with_neg && pick(p, rank, index, 4) == 0 ? -1 : 1;
    case PLAN_AVG: {
      /* the common part is drawn once per element (rank -1), the offsets per rank */
      int64_t k = p->hi >= 1 ? p->lo + (int64_t)pick(p, -1, index, (uint64_t)(p->hi - p->lo + 1)) : 0;
      if (n < 2 || !p->with_neg) return k;
      int pos = (int)((index + (uint64_t)rank) % (uint64_t)n);
      return k + (pos == 0 ? 1 : pos == n - 1 ? -1 : 0);
    }
  }
  return 0;
}

int64_t bench_reduced(const bench_plan* p, uint64_t index) {
  int64_t acc = bench_value(p, 0, index);
  if (p->op == BENCH_MULSUM) acc *= bench_mulsum_scalar(0);
  for (int r = 1; r < p->nranks; r++) {
    int64_t v = bench_value(p, r, index);
    switch (p->op) {
      case BENCH_PROD: acc *= v; break;
      case BENCH_MAX: acc = v > acc ? v : acc; break;
      case BENCH_MIN: acc = v < acc ? v : acc; break;
      case BENCH_MULSUM: acc += v * bench_mulsum_scalar(r); break;
      default: acc += v; break; /* sum, avg */
    }
  }
  return acc;
}
