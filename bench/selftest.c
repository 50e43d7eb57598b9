/* Checks of the harness's own pieces, without any communication: the half/bfloat16/fp8
 * codecs against known encodings and round trips, nccl-tests' number format, and the value
 * plans (every partial reduction stays exactly representable). Run by scripts/test_bench.sh. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"

static int failures;

#define EXPECT(cond, ...)              \
  do {                                 \
    if (!(cond)) {                     \
      printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      printf(__VA_ARGS__);             \
      printf("\n");                    \
      failures++;                      \
    }                                  \
  } while (0)

static unsigned bits_of(const bench_type_info* t, double v) {
  unsigned char b[8] = {0};
  bench_encode(t, v, b);
  return t->size == 1 ? b[0] : (unsigned)(b[0] | b[1] << 8);
}

static void known_encodings(void) {
  const bench_type_info* h = bench_type_at(bench_type_index("half"));
  const bench_type_info* bf = bench_type_at(bench_type_index("bfloat16"));
  const bench_type_info* e4 = bench_type_at(bench_type_index("f8e4m3"));
  const bench_type_info* e5 = bench_type_at(bench_type_index("f8e5m2"));
  struct {
    const bench_type_info* t;
    double v;
    unsigned bits;
  } cases[] = {
      {h, 1.0, 0x3c00},        {h, -2.0, 0xc000},      {h, 65504, 0x7bff},   {h, 2048, 0x6800},
      {h, 1.0 / 3, 0x3555},    {h, ldexp(1, -24), 0x0001}, {h, 1e6, 0x7c00},  {h, 2049, 0x6800} /* tie to even */,
      {bf, 1.0, 0x3f80},       {bf, 256, 0x4380},      {bf, 1.0 / 3, 0x3eab}, {bf, -0.0, 0x8000},
      {e4, 1.0, 0x38},         {e4, 448, 0x7e},        {e4, 16, 0x58},       {e4, -0.5, 0xb0},
      {e4, 1000, 0x7e} /* saturates */, {e4, ldexp(1, -9), 0x01},
      {e5, 1.0, 0x3c},         {e5, 57344, 0x7b},      {e5, 8, 0x48},        {e5, 1e6, 0x7c},
      {e5, ldexp(1, -16), 0x01},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    unsigned got = bits_of(cases[i].t, cases[i].v);
    EXPECT(got == cases[i].bits, "%s encode(%g) = 0x%x, want 0x%x", cases[i].t->name, cases[i].v, got, cases[i].bits);
  }
  EXPECT(isnan(bench_load_double(e4, "\x7f")), "e4m3 0x7f is NaN");
  EXPECT(bench_load_double(e4, "\x7e") == 448, "e4m3 0x7e is 448");
  EXPECT(isinf(bench_load_double(e5, "\x7c")), "e5m2 0x7c is inf");
}

/* Every non-NaN encoding decodes and encodes back to itself. */
static void round_trips(void) {
  const char* names[] = {"half", "bfloat16", "f8e4m3", "f8e5m2"};
  for (int k = 0; k < 4; k++) {
    const bench_type_info* t = bench_type_at(bench_type_index(names[k]));
    unsigned n = 1u << (8 * t->size), bad = 0;
    for (unsigned b = 0; b < n; b++) {
      unsigned char in[2] = {(unsigned char)b, (unsigned char)(b >> 8)}, out[2] = {0, 0};
      double v = bench_load_double(t, in);
      if (isnan(v)) continue;
      bench_encode(t, v, out);
      if (memcmp(in, out, t->size) != 0) bad++;
    }
    EXPECT(bad == 0, "%s: %u encodings do not round-trip", t->name, bad);
  }
}

static void number_format(void) {
  struct {
    double v;
    int w;
    const char* s;
  } cases[] = {{12.5, 7, "  12.50"},     {0, 6, "  0.00"},      {31234.0, 7, "31234.0"}, {275.02, 6, "275.02"},
               {1234567, 7, "1234567"},  {12345678, 7, "1.2e+07"}, {123456, 6, "123456"}, {1234567, 6, " 1e+06"},
               {999.99, 6, "999.99"},    {1000, 6, "1000.0"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char out[32];
    bench_float_str(cases[i].v, cases[i].w, out);
    EXPECT(strcmp(out, cases[i].s) == 0, "float_str(%g, %d) = '%s', want '%s'", cases[i].v, cases[i].w, out, cases[i].s);
  }
}

/* For every type, op and rank count: inputs and every prefix of the reduction (in rank order
 * and in reverse) are exact in the type, and the avg inputs sum to a multiple of n. */
static void plans(void) {
  for (int ti = 0; ti < BENCH_NUM_TYPES; ti++) {
    const bench_type_info* t = bench_type_at(ti);
    double lim = (double)t->exact_max;
    for (int op = BENCH_NO_OP; op < BENCH_NUM_OPS; op++) {
      for (int n = 1; n <= 40; n += (n < 10 ? 1 : 7)) {
        bench_plan p;
        bench_plan_make(&p, t, op, n, 7);
        for (uint64_t g = 0; g < 200; g++) {
          for (int dir = 0; dir < 2; dir++) {
            double acc = 0;
            int bad = 0;
            for (int k = 0; k < n; k++) {
              int r = dir ? n - 1 - k : k;
              double v = (double)bench_value(&p, r, g);
              if (op == BENCH_MULSUM) v *= (double)bench_mulsum_scalar(r);
              if (!t->is_signed && v < 0) bad = 1;
              if (k == 0)
                acc = v;
              else if (op == BENCH_PROD)
                acc *= v;
              else if (op == BENCH_MAX)
                acc = fmax(acc, v);
              else if (op == BENCH_MIN)
                acc = fmin(acc, v);
              else
                acc += v;
              /* data-moving plans never add; products are powers of two, exact up to 2^max_pow2 */
              double bound = op == BENCH_PROD ? ldexp(1, t->max_pow2) + 1 : lim;
              if (fabs(v) >= lim || (op != BENCH_NO_OP && fabs(acc) >= bound)) bad = 1;
            }
            if (op == BENCH_AVG && fmod(acc, n) != 0) bad = 1;
            if (op == BENCH_PROD && acc != (double)bench_reduced(&p, g)) bad = 1;
            EXPECT(!bad, "%s %s n=%d index %llu: a partial result leaves the exact range", t->name, bench_op_name(op), n,
                   (unsigned long long)g);
            if (bad) return;
          }
        }
      }
    }
  }
}

int main(void) {
  known_encodings();
  round_trips();
  number_format();
  plans();
  printf(failures ? "selftest: %d failures\n" : "selftest passed\n", failures);
  return failures ? 1 : 0;
}
