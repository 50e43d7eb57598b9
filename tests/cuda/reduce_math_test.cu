// Host-side checks of the device kernels' per-element math (kernels/reduce_math.cuh), compiled by
// nvcc as a host program: the __host__ __device__ functions run here on the CPU through the same
// code the sm_80 kernels use (fp8 conversions in integer arithmetic), and NVIDIA's own host model
// of the instructions the sm_90 kernels use (cvt.rn.satfinite to fp8, f16/bf16 add.rn/mul.rn).
//
//   reduce_math_test           known values, and the fp8 conversions against NVIDIA's models
//   reduce_math_test --eval    reads cases from stdin, one per line, and prints one result per line
//                              (used by a Rust unit test that compares with the host reducer):
//                              dtype op nsrc has_scale divide_by x[0..nsrc] scale[0..nsrc]
//                              with dtype and op as in kernel names and every number in hex; the
//                              values are raw bits of the datatype; the output is the raw result.
//
// Built and run by `cargo test --lib cuda::` when the build found nvcc.

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_kernels.cuh"
#include "reduce_math.cuh"

using namespace comm;

static int failures = 0;
static int checks = 0;

#define CHECK_EQ(got, want, what)                                                                  \
  do {                                                                                             \
    unsigned long long g_ = (unsigned long long)(got), w_ = (unsigned long long)(want);            \
    ++checks;                                                                                      \
    if (g_ != w_) {                                                                                \
      ++failures;                                                                                  \
      fprintf(stderr, "FAIL %s:%d %s: got %#llx, want %#llx\n", __FILE__, __LINE__, what, g_, w_); \
    }                                                                                              \
  } while (0)

static float f32(uint32_t bits) { return bit_cast<float>(bits); }
static uint32_t bits32(float x) { return bit_cast<uint32_t>(x); }
static float pow2f(int e) { return ldexpf(1.0f, e); }

// Value of an fp8 byte from its definition, in double: independent of the bit tricks under test.
static double fp8_value(uint8_t v, int man, int bias, bool ieee_specials) {
  const double sign = (v & 0x80) ? -1.0 : 1.0;
  const int e = (v & 0x7f) >> man, m = v & ((1 << man) - 1), emax = (1 << (7 - man)) - 1;
  if (ieee_specials && e == emax) return m ? NAN : sign * INFINITY;
  if (!ieee_specials && (v & 0x7f) == 0x7f) return NAN;
  if (e == 0) return sign * ldexp((double)m, 1 - bias - man);
  return sign * ldexp((double)((1 << man) + m), e - bias - man);
}

static void check_fp8_decoding() {
  for (int v = 0; v < 256; ++v) {
    const double want4 = fp8_value((uint8_t)v, 3, 7, false), got4 = e4m3_to_f32((uint8_t)v);
    const double want5 = fp8_value((uint8_t)v, 2, 15, true), got5 = e5m2_to_f32((uint8_t)v);
    ++checks;
    if (!(want4 == got4 || (isnan(want4) && isnan(got4))) ||
        !(want5 == got5 || (isnan(want5) && isnan(got5)))) {
      ++failures;
      fprintf(stderr, "FAIL fp8 decode %#04x: e4m3 %g (want %g), e5m2 %g (want %g)\n", v, got4,
              want4, got5, want5);
    }
    // Every finite value encodes back to itself; e5m2 infinities saturate.
    if (!isnan(want4)) CHECK_EQ(f32_to_e4m3((float)want4), v, "e4m3 round trip");
    if (isinf(want5)) {
      CHECK_EQ(f32_to_e5m2((float)want5), (v & 0x80) | 0x7b, "e5m2 infinity saturates");
    } else if (!isnan(want5)) {
      CHECK_EQ(f32_to_e5m2((float)want5), v, "e5m2 round trip");
    }
  }
}

static void check_fp8_rounding() {
  // Saturation, infinities included; NaN keeps its sign.
  const float big4[] = {448.0f, 448.5f, 464.0f, 479.9f, 480.0f, 1e10f, INFINITY};
  for (float x : big4) {
    CHECK_EQ(f32_to_e4m3(x), 0x7e, "e4m3 saturates");
    CHECK_EQ(f32_to_e4m3(-x), 0xfe, "e4m3 saturates (negative)");
  }
  const float big5[] = {57344.0f, 61439.0f, 61440.0f, 65536.0f, 1e10f, INFINITY};
  for (float x : big5) {
    CHECK_EQ(f32_to_e5m2(x), 0x7b, "e5m2 saturates");
    CHECK_EQ(f32_to_e5m2(-x), 0xfb, "e5m2 saturates (negative)");
  }
  CHECK_EQ(f32_to_e4m3(NAN), 0x7f, "e4m3 NaN");
  CHECK_EQ(f32_to_e4m3(-NAN), 0xff, "e4m3 -NaN");
  CHECK_EQ(f32_to_e5m2(NAN), 0x7f, "e5m2 NaN");
  CHECK_EQ(f32_to_e4m3(447.0f), 0x7e, "e4m3 447 rounds to 448");
  CHECK_EQ(f32_to_e4m3(431.0f), 0x7d, "e4m3 431 rounds to 416");

  // Ties to even, in the normal and subnormal ranges; just off a tie goes to the nearer value.
  CHECK_EQ(f32_to_e4m3(1.0f), 0x38, "e4m3 1");
  CHECK_EQ(f32_to_e4m3(1.0625f), 0x38, "e4m3 tie 1|1.125 -> 1");
  CHECK_EQ(f32_to_e4m3(1.1875f), 0x3a, "e4m3 tie 1.125|1.25 -> 1.25");
  CHECK_EQ(f32_to_e4m3(f32(bits32(1.0625f) + 1)), 0x39, "e4m3 above a tie");
  CHECK_EQ(f32_to_e4m3(pow2f(-9)), 0x01, "e4m3 smallest subnormal");
  CHECK_EQ(f32_to_e4m3(pow2f(-10)), 0x00, "e4m3 half the smallest subnormal -> 0");
  CHECK_EQ(f32_to_e4m3(-pow2f(-10)), 0x80, "e4m3 -half the smallest subnormal -> -0");
  CHECK_EQ(f32_to_e4m3(3 * pow2f(-10)), 0x02, "e4m3 subnormal tie to even");
  CHECK_EQ(f32_to_e4m3(pow2f(-6) - pow2f(-10)), 0x08, "e4m3 rounds up into the normal range");
  CHECK_EQ(f32_to_e4m3(f32(1)), 0x00, "e4m3 f32 subnormal");
  CHECK_EQ(f32_to_e5m2(1.0f), 0x3c, "e5m2 1");
  CHECK_EQ(f32_to_e5m2(1.125f), 0x3c, "e5m2 tie 1|1.25 -> 1");
  CHECK_EQ(f32_to_e5m2(1.375f), 0x3e, "e5m2 tie 1.25|1.5 -> 1.5");
  CHECK_EQ(f32_to_e5m2(pow2f(-16)), 0x01, "e5m2 smallest subnormal");
  CHECK_EQ(f32_to_e5m2(pow2f(-17)), 0x00, "e5m2 half the smallest subnormal -> 0");
  CHECK_EQ(f32_to_e5m2(3 * pow2f(-17)), 0x02, "e5m2 subnormal tie to even");
}

// The sm_90 kernels convert with cvt.rn.satfinite; NVIDIA's host implementation of the same
// intrinsic models it. Ours (integer arithmetic, used on sm_80) must agree everywhere but in
// the encoding of NaN, which the kernels set themselves on both paths.
static void check_fp8_against_nvidia() {
  int mismatches = 0;
  long compared = 0;
  for (uint64_t b = 0; b <= 0xffffffffull; b += 251) {
    const float x = f32((uint32_t)b);
    if (isnan(x)) continue;
    ++compared;
    const uint8_t ours4 = f32_to_e4m3(x), theirs4 = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    const uint8_t ours5 = f32_to_e5m2(x), theirs5 = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
    if (ours4 != theirs4 || ours5 != theirs5) {
      if (++mismatches <= 5) {
        fprintf(stderr, "FAIL fp8 of %a (%#x): e4m3 %#04x vs %#04x, e5m2 %#04x vs %#04x\n", x,
                (unsigned)b, ours4, theirs4, ours5, theirs5);
      }
    }
  }
  // Exactly at and beside every midpoint between neighbouring codes.
  for (int c = 0; c < 0x7e; ++c) {
    for (int fmt = 0; fmt < 2; ++fmt) {
      if (fmt == 1 && c >= 0x7b) continue;
      const float lo = fmt ? e5m2_to_f32((uint8_t)c) : e4m3_to_f32((uint8_t)c);
      const float hi = fmt ? e5m2_to_f32((uint8_t)(c + 1)) : e4m3_to_f32((uint8_t)(c + 1));
      const float mid = (lo + hi) / 2;
      for (int d = -1; d <= 1; ++d) {
        for (int sign = 0; sign < 2; ++sign) {
          const float x = f32((bits32(mid) + d) ^ (sign ? 0x80000000u : 0u));
          const __nv_fp8_interpretation_t kind = fmt ? __NV_E5M2 : __NV_E4M3;
          const uint8_t ours = fmt ? f32_to_e5m2(x) : f32_to_e4m3(x);
          const uint8_t theirs = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, kind);
          if (ours != theirs && ++mismatches <= 5) {
            fprintf(stderr, "FAIL fp8 midpoint %a: %#04x vs %#04x\n", x, ours, theirs);
          }
        }
      }
    }
  }
  ++checks;
  if (mismatches) ++failures;
  if (compared < 16000000) {
    ++failures;
    fprintf(stderr, "FAIL only %ld values compared with NVIDIA's fp8 conversion\n", compared);
  }
}

static void check_half_rounding() {
  // Inputs are f16 bit patterns; 0x3c00 = 1, 0x1000 = 2^-11, 0x1600 = 3 * 2^-11.
  CHECK_EQ(Dt_f16::add(0x3c00, 0x1000), 0x3c00, "f16 1 + 2^-11 ties to 1");
  CHECK_EQ(Dt_f16::add(0x3c00, 0x1600), 0x3c02, "f16 1 + 3*2^-11 ties up to even");
  CHECK_EQ(Dt_f16::add(0x7bff, 0x4c00), 0x7c00, "f16 65504 + 16 overflows to infinity");
  CHECK_EQ(Dt_f16::add(0x7bff, 0x4b00), 0x7bff, "f16 65504 + 14 stays finite");
  CHECK_EQ(Dt_f16::mul(0x0001, 0x3800), 0x0000, "f16 smallest subnormal / 2 ties to 0");
  CHECK_EQ(Dt_f16::mul(0x0003, 0x3800), 0x0002, "f16 3 subnormal steps / 2 ties to even");
  // bf16: 0x3f80 = 1, 0x3b80 = 2^-8, 0x3c40 = 3 * 2^-8.
  CHECK_EQ(Dt_bf16::add(0x3f80, 0x3b80), 0x3f80, "bf16 1 + 2^-8 ties to 1");
  CHECK_EQ(Dt_bf16::add(0x3f80, 0x3c40), 0x3f82, "bf16 1 + 3*2^-8 ties up to even");
  CHECK_EQ(Dt_bf16::mul(0x7f7f, 0x4000), 0x7f80, "bf16 max * 2 overflows to infinity");
  // A divide rounds f32(x) / d once: 1 / 3 in f16 is 0x3555.
  CHECK_EQ(Dt_f16::divide(0x3c00, 3), 0x3555, "f16 1 / 3");
  CHECK_EQ(Dt_bf16::divide(0x3f80, 3), 0x3eab, "bf16 1 / 3");
}

static void check_integers() {
  CHECK_EQ((uint8_t)Dt_i8::add(127, 1), 0x80, "i8 127 + 1 wraps");
  CHECK_EQ(Dt_u8::add(255, 1), 0, "u8 255 + 1 wraps");
  CHECK_EQ((uint8_t)Dt_i8::mul(-128, -1), 0x80, "i8 -128 * -1 wraps");
  CHECK_EQ((uint8_t)Dt_i8::mul(16, 16), 0, "i8 16 * 16 wraps");
  CHECK_EQ((uint32_t)Dt_i32::add(0x7fffffff, 1), 0x80000000u, "i32 max + 1 wraps");
  CHECK_EQ(Dt_u32::mul(0xffffffffu, 0xffffffffu), 1, "u32 (2^32-1)^2 wraps");
  CHECK_EQ((uint64_t)Dt_i64::mul(INT64_MIN, -1), (uint64_t)INT64_MIN, "i64 min * -1 wraps");
  CHECK_EQ(Dt_u64::add(~0ull, 2), 1, "u64 wraps");
  CHECK_EQ((uint8_t)Dt_i8::max(-1, 1), 1, "i8 max is signed");
  CHECK_EQ(Dt_u8::max(0xff, 1), 0xff, "u8 max is unsigned");
  CHECK_EQ((uint8_t)Dt_i8::bxor(0x55, -1), 0xaa, "i8 xor");

  // Division truncates toward zero, also when the divisor does not fit the type.
  CHECK_EQ((uint8_t)Dt_i8::divide(-7, 2), (uint8_t)-3, "i8 -7 / 2");
  CHECK_EQ((uint8_t)Dt_i8::divide(-128, 128), 0xff, "i8 -128 / 128");
  CHECK_EQ((uint8_t)Dt_i8::divide(-128, 1000), 0, "i8 -128 / 1000");
  CHECK_EQ(Dt_u8::divide(255, 256), 0, "u8 255 / 256");
  CHECK_EQ((uint32_t)Dt_i32::divide(INT32_MIN, 0x80000000ull), 0xffffffffu, "i32 min / 2^31");
  CHECK_EQ((uint32_t)Dt_i32::divide(-7, 0x100000000ull), 0, "i32 / 2^32");
  CHECK_EQ((uint64_t)Dt_i64::divide(INT64_MIN, 0x8000000000000000ull), ~0ull, "i64 min / 2^63");
  CHECK_EQ((uint64_t)Dt_i64::divide(INT64_MAX, 0x8000000000000000ull), 0, "i64 max / 2^63");
  CHECK_EQ((uint64_t)Dt_i64::divide(-9, 4), (uint64_t)-2, "i64 -9 / 4");
  CHECK_EQ(Dt_u64::divide(~0ull, ~0ull), 1, "u64 max / max");
  CHECK_EQ(Dt_u32::divide(0xffffffffu, 0x100000000ull), 0, "u32 max / 2^32");
}

static void check_max_min_nan() {
  CHECK_EQ(bits32(Dt_f32::max(NAN, 1.0f)), bits32(1.0f), "f32 max(NaN, 1)");
  CHECK_EQ(bits32(Dt_f32::max(1.0f, NAN)), bits32(1.0f), "f32 max(1, NaN)");
  CHECK_EQ(bits32(Dt_f32::min(NAN, -1.0f)), bits32(-1.0f), "f32 min(NaN, -1)");
  CHECK_EQ(bit_cast<uint64_t>(Dt_f64::max(NAN, 2.0)), bit_cast<uint64_t>(2.0), "f64 max(NaN, 2)");
  CHECK_EQ(Dt_f16::max(0x7e00, 0x3c00), 0x3c00, "f16 max(NaN, 1)");
  CHECK_EQ(Dt_f16::min(0x3c00, 0x7e00), 0x3c00, "f16 min(1, NaN)");
  CHECK_EQ(Dt_bf16::max(0x7fc0, 0x3f80), 0x3f80, "bf16 max(NaN, 1)");
  CHECK_EQ(Dt_e4m3::max(0x7f, 0x38), 0x38, "e4m3 max(NaN, 1)");
  CHECK_EQ(Dt_e5m2::min(0x38, 0x7e), 0x38, "e5m2 min(0.5, NaN)");
  // Zeros of both signs, in both orders: +0 for max, -0 for min.
  for (int flip = 0; flip < 2; ++flip) {
    const float pz = flip ? -0.0f : 0.0f, qz = flip ? 0.0f : -0.0f;
    CHECK_EQ(bits32(Dt_f32::max(pz, qz)), 0u, "f32 max(+0, -0)");
    CHECK_EQ(bits32(Dt_f32::min(pz, qz)), 0x80000000u, "f32 min(+0, -0)");
    const double pd = flip ? -0.0 : 0.0, qd = flip ? 0.0 : -0.0;
    CHECK_EQ(bit_cast<uint64_t>(Dt_f64::max(pd, qd)), 0ull, "f64 max(+0, -0)");
    CHECK_EQ(bit_cast<uint64_t>(Dt_f64::min(pd, qd)), 0x8000000000000000ull, "f64 min(+0, -0)");
    const uint16_t p16 = flip ? 0x8000 : 0, q16 = flip ? 0 : 0x8000;
    CHECK_EQ(Dt_f16::max(p16, q16), 0, "f16 max(+0, -0)");
    CHECK_EQ(Dt_f16::min(p16, q16), 0x8000, "f16 min(+0, -0)");
    CHECK_EQ(Dt_bf16::max(p16, q16), 0, "bf16 max(+0, -0)");
    CHECK_EQ(Dt_bf16::min(p16, q16), 0x8000, "bf16 min(+0, -0)");
    const uint8_t p8 = flip ? 0x80 : 0, q8 = flip ? 0 : 0x80;
    CHECK_EQ(Dt_e4m3::max(p8, q8), 0, "e4m3 max(+0, -0)");
    CHECK_EQ(Dt_e5m2::min(p8, q8), 0x80, "e5m2 min(+0, -0)");
  }
  ++checks;
  if (!isnan(Dt_f32::add(NAN, 1.0f))) {
    ++failures;
    fprintf(stderr, "FAIL f32 NaN + 1 is not NaN\n");
  }
}

static void check_folds() {
  // Every step rounds: 2048 + 1 + 1 in f16 is 2048 (2049 ties to 2048, twice), not 2050.
  const unsigned long long none[3] = {0, 0, 0};
  const uint16_t h[3] = {0x6800, 0x3c00, 0x3c00};
  CHECK_EQ((reduce_element<Dt_f16, Op_sum>(h, none, 0, 3, 0)), 0x6800, "f16 sum rounds per step");
  // A scaled source is rounded to the datatype before it is added. e4m3: 1.125 * 0.5 = 0.5625 is
  // exact; 0.5625 + 4 = 4.5625 lies between the e4m3 values 4.5 and 5 and rounds to 4.5 (0x49).
  const uint8_t q[2] = {0x39 /* 1.125 */, 0x48 /* 4 */};
  const unsigned long long qs[2] = {0x30 /* 0.5 */, 0};
  CHECK_EQ((reduce_element<Dt_e4m3, Op_sum>(q, qs, 1, 2, 0)), 0x49, "e4m3 scaled sum");
  // Integer average: (7 + 8 + -20) / 3 = -5 / 3 = -1.
  const int32_t v[3] = {7, 8, -20};
  CHECK_EQ((uint32_t)(reduce_element<Dt_i32, Op_sum>(v, none, 0, 3, 3)), 0xffffffffu, "i32 avg");
  // PreMulSum on f32 rounds s*x, then adds: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds (a tie, to
  // even) to 1 + 2^-11, so adding -1 gives 2^-11; a fused multiply-add would give 2^-11 + 2^-24.
  const float a[2] = {1.0f + pow2f(-12), -1.0f};
  const unsigned long long as[2] = {bits32(1.0f + pow2f(-12)), 0};
  CHECK_EQ(bits32(reduce_element<Dt_f32, Op_sum>(a, as, 1, 2, 0)), bits32(pow2f(-11)),
           "f32 premulsum rounds the product");
  // nsrc == 1 is a copy, bit for bit, NaN payloads included.
  const uint16_t nan[1] = {0x7d01};
  CHECK_EQ((reduce_element<Dt_f16, Op_max>(nan, none, 0, 1, 0)), 0x7d01, "f16 copy keeps NaN bits");
}

// ---------------------------------------------------------------------------------------------
// --eval
// ---------------------------------------------------------------------------------------------

template <class D> static unsigned long long to_raw(typename D::Bits x) {
  unsigned long long r = 0;
  memcpy(&r, &x, sizeof x);
  return r;
}

template <class D, class Op>
static unsigned long long eval_case(const unsigned long long *x, const unsigned long long *scale,
                                    unsigned has_scale, int nsrc, unsigned long long divide_by) {
  typename D::Bits v[COMM_MAX_SOURCES] = {};
  for (int i = 0; i < nsrc; ++i) v[i] = D::from_raw(x[i]);
  return to_raw<D>(reduce_element<D, Op>(v, scale, has_scale, nsrc, divide_by));
}

typedef unsigned long long (*EvalFn)(const unsigned long long *, const unsigned long long *,
                                     unsigned, int, unsigned long long);
struct Kernel {
  const char *dtype, *op;
  EvalFn fn;
};
#define COMM_TABLE_ENTRY(T, OP) {#T, #OP, eval_case<Dt_##T, Op_##OP>},
static const Kernel kKernels[] = {COMM_FOR_EACH_REDUCE_KERNEL(COMM_TABLE_ENTRY)};
#undef COMM_TABLE_ENTRY

static int eval() {
  char dtype[16], op[16];
  unsigned nsrc, has_scale;
  unsigned long long divide_by, x[COMM_MAX_SOURCES], scale[COMM_MAX_SOURCES];
  long line = 0;
  while (scanf("%15s %15s %x %x %llx", dtype, op, &nsrc, &has_scale, &divide_by) == 5) {
    ++line;
    if (nsrc < 1 || nsrc > COMM_MAX_SOURCES) {
      fprintf(stderr, "line %ld: nsrc %u out of range\n", line, nsrc);
      return 2;
    }
    for (unsigned i = 0; i < 2 * nsrc; ++i) {
      if (scanf("%llx", i < nsrc ? &x[i] : &scale[i - nsrc]) != 1) return 2;
    }
    const Kernel *k = NULL;
    for (const Kernel &c : kKernels) {
      if (!strcmp(c.dtype, dtype) && !strcmp(c.op, op)) k = &c;
    }
    if (!k) {
      fprintf(stderr, "line %ld: no kernel for %s %s\n", line, dtype, op);
      return 2;
    }
    printf("%llx\n", k->fn(x, scale, has_scale, (int)nsrc, divide_by));
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "--eval")) return eval();
  check_fp8_decoding();
  check_fp8_rounding();
  check_fp8_against_nvidia();
  check_half_rounding();
  check_integers();
  check_max_min_nan();
  check_folds();
  printf("%d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
