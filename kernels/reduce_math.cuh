// Per-element reduction math, shared by the device kernels (reduce.cu) and a host test program
// (tests/cuda/reduce_math_test.cu): everything here is __host__ __device__.
//
// The rules are the host reducer's (src/reduce/kernels.rs), so that a device reduction and a host
// one give the same bytes:
//   - integers wrap; an integer scale is a wrapping multiply; division truncates toward zero;
//   - every op returns a value of the datatype: f16, bf16 and fp8 compute as if in f32 and round
//     once to nearest-even, so folding n sources rounds n-1 times, as n-1 host calls would;
//   - a scaled source is s * x rounded to the datatype, before it is combined;
//   - float max/min return the other operand when one is NaN (C fmax/fmin) and take -0 as below
//     +0, so that their result does not depend on the operands' order;
//   - fp8 rounding saturates to the largest finite value (+-448 e4m3, +-57344 e5m2, infinities
//     included), and NaN stays NaN (S.1111111, keeping the sign, like the host);
//   - a NaN result is NaN, but its payload may differ from the host's (the GPU's f16/bf16
//     arithmetic returns a canonical NaN); a copy (nsrc == 1, unscaled) moves bits unchanged.
//
// f16 and bf16 use the single-rounding half-precision instructions (add.rn, mul.rn): for + and * on
// these formats, rounding the exact result once is the same as computing in f32 and rounding
// again, because f32 carries more than twice their precision plus two bits. The "_rn" intrinsics
// are used (not plain + and *) so that the compiler cannot fuse a scale and a sum into one fma.

#ifndef COMM_REDUCE_MATH_CUH
#define COMM_REDUCE_MATH_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define COMM_HD __host__ __device__ __forceinline__

namespace comm {

template <typename To, typename From> COMM_HD To bit_cast(From x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
  To y;
  memcpy(&y, &x, sizeof(To));
  return y;
}

// IEEE f32/f64 arithmetic without contraction into fma (device) or excess precision (host).
COMM_HD float add_f32(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
COMM_HD float mul_f32(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
COMM_HD float div_f32(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
COMM_HD double add_f64(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
COMM_HD double mul_f64(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
COMM_HD double div_f64(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// max/min that return the other operand when one is NaN, signalling NaNs included: what the
// device instructions do, and not what a host libm's fmax does with a signalling NaN. The sign of
// a zero result is left open here (see below).
template <typename F> COMM_HD F host_max(F a, F b) { return a != a ? b : b != b ? a : a > b ? a : b; }
template <typename F> COMM_HD F host_min(F a, F b) { return a != a ? b : b != b ? a : a < b ? a : b; }
#ifdef __CUDA_ARCH__
COMM_HD float any_zero_max(float a, float b) { return fmaxf(a, b); }
COMM_HD float any_zero_min(float a, float b) { return fminf(a, b); }
COMM_HD double any_zero_max(double a, double b) { return fmax(a, b); }
COMM_HD double any_zero_min(double a, double b) { return fmin(a, b); }
#else
COMM_HD float any_zero_max(float a, float b) { return host_max(a, b); }
COMM_HD float any_zero_min(float a, float b) { return host_min(a, b); }
COMM_HD double any_zero_max(double a, double b) { return host_max(a, b); }
COMM_HD double any_zero_min(double a, double b) { return host_min(a, b); }
#endif

// Equal operands, zeros of both signs included, give +0 for max unless both are -0, and -0 for
// min unless both are +0 (-0 orders below +0, as on the host): the result does not depend on
// the operands' order, which fmax/fmin and the comparisons above leave to the instruction.
template <typename U, typename F> COMM_HD F signed_zero_max(F a, F b) {
  return a == b ? bit_cast<F>(bit_cast<U>(a) & bit_cast<U>(b)) : any_zero_max(a, b);
}
template <typename U, typename F> COMM_HD F signed_zero_min(F a, F b) {
  return a == b ? bit_cast<F>(bit_cast<U>(a) | bit_cast<U>(b)) : any_zero_min(a, b);
}
COMM_HD float max_ignoring_nan(float a, float b) { return signed_zero_max<uint32_t>(a, b); }
COMM_HD float min_ignoring_nan(float a, float b) { return signed_zero_min<uint32_t>(a, b); }
COMM_HD double max_ignoring_nan(double a, double b) { return signed_zero_max<uint64_t>(a, b); }
COMM_HD double min_ignoring_nan(double a, double b) { return signed_zero_min<uint64_t>(a, b); }

COMM_HD bool is_nan_bits(uint32_t f32_bits) { return (f32_bits & 0x7fffffffu) > 0x7f800000u; }

// ---------------------------------------------------------------------------------------------
// fp8 <-> f32
// ---------------------------------------------------------------------------------------------

// f32 to an fp8 format with MAN fraction bits and exponent bias BIAS, rounding to nearest-even,
// saturating from max_bits (the f32 encoding of the largest finite value) up to max_code. Integer
// arithmetic and selects, the same algorithm as the host's f32_to_fp8. Used on the host and on
// GPUs without fp8 conversion instructions (sm_80).
template <int MAN, int BIAS>
COMM_HD uint8_t f32_to_fp8_soft(float x, uint32_t max_bits, uint32_t max_code) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7fffffffu;

  // Normal: round the f32 significand at the last kept bit (half-minus-one plus the kept LSB sends
  // ties to even; a carry bumps the exponent), then rebias the exponent.
  const int shift = 23 - MAN;
  const uint32_t normal =
      ((abs + ((1u << (shift - 1)) - 1u) + ((abs >> shift) & 1u)) >> shift) -
      (uint32_t)((127 - BIAS) << MAN);

  // Subnormal: adding a power of two whose ulp is the fp8 subnormal step makes the FPU round to
  // nearest-even; the low bits of the sum count steps.
  const float magic = bit_cast<float>((uint32_t)(127 - BIAS + 23 - MAN + 1) << 23);
  const uint32_t subnormal =
      bit_cast<uint32_t>(add_f32(bit_cast<float>(abs), magic)) - bit_cast<uint32_t>(magic);

  const uint32_t min_normal = (uint32_t)(127 + 1 - BIAS) << 23;
  const uint32_t mag = abs > 0x7f800000u ? 0x7fu
                       : abs >= max_bits ? max_code
                       : abs < min_normal ? subnormal
                                          : normal;
  return (uint8_t)(sign | mag);
}

COMM_HD uint8_t f32_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // cvt.rn.satfinite: the same rounding and saturation; only a NaN's encoding is ours to choose.
  const uint32_t bits = bit_cast<uint32_t>(x);
  const uint8_t r = (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return is_nan_bits(bits) ? (uint8_t)(((bits >> 24) & 0x80u) | 0x7fu) : r;
#else
  return f32_to_fp8_soft<3, 7>(x, 0x43e00000u /* 448 */, 0x7eu);
#endif
}

COMM_HD uint8_t f32_to_e5m2(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint32_t bits = bit_cast<uint32_t>(x);
  const uint8_t r = (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
  return is_nan_bits(bits) ? (uint8_t)(((bits >> 24) & 0x80u) | 0x7fu) : r;
#else
  return f32_to_fp8_soft<2, 15>(x, 0x47600000u /* 57344 */, 0x7bu);
#endif
}

// E4M3 ("E4M3FN": bias 7, no infinities, S.1111.111 is NaN) to f32, exactly.
COMM_HD float e4m3_to_f32(uint8_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v, __NV_E4M3)));
#else
  const uint32_t sign = (uint32_t)(v & 0x80u) << 24;
  const uint32_t mag = v & 0x7fu;
  uint32_t bits;
  if (mag == 0x7fu) {
    bits = (mag << 20) | 0x7f800000u;
  } else if (mag < 8u) {
    bits = bit_cast<uint32_t>((float)mag * 0.001953125f /* 2^-9, the subnormal step */);
  } else {
    bits = (mag << 20) + (120u << 23);
  }
  return bit_cast<float>(sign | bits);
#endif
}

// E5M2 is the top byte of an IEEE binary16, infinities and NaNs included.
COMM_HD float e5m2_to_f32(uint8_t v) {
  return __half2float(__ushort_as_half((unsigned short)(v << 8)));
}

// ---------------------------------------------------------------------------------------------
// One struct per datatype: its storage type and the ops on it.
// ---------------------------------------------------------------------------------------------

// Truncating division by a positive count that may not fit T: the quotient of the exact values.
template <typename T> COMM_HD T divide_signed(T x, unsigned long long d) {
  const long long wide = (long long)x;
  if (d <= 0x7fffffffffffffffull) return (T)(wide / (long long)d);
  // d >= 2^63 > |x| except for x = INT64_MIN = -2^63, whose quotient by exactly 2^63 is -1.
  return (T)((d == 0x8000000000000000ull && wide == (long long)0x8000000000000000ull) ? -1 : 0);
}

template <typename T, typename U, bool SIGNED> struct IntMath {
  typedef T Bits;
  static COMM_HD T from_raw(unsigned long long raw) { return (T)(U)raw; }
  // Arithmetic in the unsigned twin: wrapping is defined there (and U*U for 8-bit U promotes to a
  // product that fits int).
  static COMM_HD T add(T a, T b) { return (T)(U)((U)a + (U)b); }
  static COMM_HD T mul(T a, T b) { return (T)(U)((U)a * (U)b); }
  static COMM_HD T max(T a, T b) { return a > b ? a : b; }
  static COMM_HD T min(T a, T b) { return a < b ? a : b; }
  static COMM_HD T band(T a, T b) { return (T)(a & b); }
  static COMM_HD T bor(T a, T b) { return (T)(a | b); }
  static COMM_HD T bxor(T a, T b) { return (T)(a ^ b); }
  static COMM_HD T divide(T x, unsigned long long d) {
    if (SIGNED) {
      // 32-bit division is much cheaper on the GPU than 64-bit; use it when both operands fit.
      if (sizeof(T) <= 4 && d <= 0x7fffffffull) return (T)((int)x / (int)d);
      return divide_signed<T>(x, d);
    }
    if (sizeof(T) <= 4 && d <= 0xffffffffull) return (T)((unsigned)x / (unsigned)d);
    return (T)((unsigned long long)x / d);
  }
};

struct Dt_i8 : IntMath<int8_t, uint8_t, true> {};
struct Dt_u8 : IntMath<uint8_t, uint8_t, false> {};
struct Dt_i32 : IntMath<int32_t, uint32_t, true> {};
struct Dt_u32 : IntMath<uint32_t, uint32_t, false> {};
struct Dt_i64 : IntMath<int64_t, uint64_t, true> {};
struct Dt_u64 : IntMath<uint64_t, uint64_t, false> {};

struct Dt_f32 {
  typedef float Bits;
  static COMM_HD float from_raw(unsigned long long raw) { return bit_cast<float>((uint32_t)raw); }
  static COMM_HD float add(float a, float b) { return add_f32(a, b); }
  static COMM_HD float mul(float a, float b) { return mul_f32(a, b); }
  static COMM_HD float max(float a, float b) { return max_ignoring_nan(a, b); }
  static COMM_HD float min(float a, float b) { return min_ignoring_nan(a, b); }
  static COMM_HD float divide(float x, unsigned long long d) { return div_f32(x, (float)d); }
};

struct Dt_f64 {
  typedef double Bits;
  static COMM_HD double from_raw(unsigned long long raw) { return bit_cast<double>(raw); }
  static COMM_HD double add(double a, double b) { return add_f64(a, b); }
  static COMM_HD double mul(double a, double b) { return mul_f64(a, b); }
  static COMM_HD double max(double a, double b) { return max_ignoring_nan(a, b); }
  static COMM_HD double min(double a, double b) { return min_ignoring_nan(a, b); }
  static COMM_HD double divide(double x, unsigned long long d) { return div_f64(x, (double)d); }
};

// Half-precision storage is the raw 16 bits, so that packs of them are plain integers.
struct Dt_f16 {
  typedef uint16_t Bits;
  static COMM_HD __half h(uint16_t b) { return __ushort_as_half(b); }
  static COMM_HD uint16_t b(__half x) { return __half_as_ushort(x); }
  static COMM_HD uint16_t from_raw(unsigned long long raw) { return (uint16_t)raw; }
  static COMM_HD uint16_t add(uint16_t x, uint16_t y) { return b(__hadd_rn(h(x), h(y))); }
  static COMM_HD uint16_t mul(uint16_t x, uint16_t y) { return b(__hmul_rn(h(x), h(y))); }
  // Equal operands: -0 below +0, as in max_ignoring_nan.
  static COMM_HD uint16_t max(uint16_t x, uint16_t y) {
    return __heq(h(x), h(y)) ? (uint16_t)(x & y) : b(__hmax(h(x), h(y)));
  }
  static COMM_HD uint16_t min(uint16_t x, uint16_t y) {
    return __heq(h(x), h(y)) ? (uint16_t)(x | y) : b(__hmin(h(x), h(y)));
  }
  static COMM_HD uint16_t divide(uint16_t x, unsigned long long d) {
    return b(__float2half_rn(div_f32(__half2float(h(x)), (float)d)));
  }
};

struct Dt_bf16 {
  typedef uint16_t Bits;
  static COMM_HD __nv_bfloat16 h(uint16_t b) { return __ushort_as_bfloat16(b); }
  static COMM_HD uint16_t b(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
  static COMM_HD uint16_t from_raw(unsigned long long raw) { return (uint16_t)raw; }
  static COMM_HD uint16_t add(uint16_t x, uint16_t y) { return b(__hadd_rn(h(x), h(y))); }
  static COMM_HD uint16_t mul(uint16_t x, uint16_t y) { return b(__hmul_rn(h(x), h(y))); }
  // Equal operands: -0 below +0, as in max_ignoring_nan.
  static COMM_HD uint16_t max(uint16_t x, uint16_t y) {
    return __heq(h(x), h(y)) ? (uint16_t)(x & y) : b(__hmax(h(x), h(y)));
  }
  static COMM_HD uint16_t min(uint16_t x, uint16_t y) {
    return __heq(h(x), h(y)) ? (uint16_t)(x | y) : b(__hmin(h(x), h(y)));
  }
  static COMM_HD uint16_t divide(uint16_t x, unsigned long long d) {
    return b(__float2bfloat16_rn(div_f32(__bfloat162float(h(x)), (float)d)));
  }
};

// fp8: widen to f32 (exact), one f32 operation, narrow once.
template <float (*WIDEN)(uint8_t), uint8_t (*NARROW)(float)> struct Fp8Math {
  typedef uint8_t Bits;
  static COMM_HD uint8_t from_raw(unsigned long long raw) { return (uint8_t)raw; }
  static COMM_HD uint8_t add(uint8_t x, uint8_t y) { return NARROW(add_f32(WIDEN(x), WIDEN(y))); }
  static COMM_HD uint8_t mul(uint8_t x, uint8_t y) { return NARROW(mul_f32(WIDEN(x), WIDEN(y))); }
  static COMM_HD uint8_t max(uint8_t x, uint8_t y) {
    return NARROW(max_ignoring_nan(WIDEN(x), WIDEN(y)));
  }
  static COMM_HD uint8_t min(uint8_t x, uint8_t y) {
    return NARROW(min_ignoring_nan(WIDEN(x), WIDEN(y)));
  }
  static COMM_HD uint8_t divide(uint8_t x, unsigned long long d) {
    return NARROW(div_f32(WIDEN(x), (float)d));
  }
};

struct Dt_e4m3 : Fp8Math<e4m3_to_f32, f32_to_e4m3> {};
struct Dt_e5m2 : Fp8Math<e5m2_to_f32, f32_to_e5m2> {};

// ---------------------------------------------------------------------------------------------
// Ops, and the fold every kernel performs per element
// ---------------------------------------------------------------------------------------------

#define COMM_DEFINE_OP(NAME)                                                                       \
  struct Op_##NAME {                                                                               \
    template <class D> static COMM_HD typename D::Bits apply(typename D::Bits a,                   \
                                                             typename D::Bits b) {                 \
      return D::NAME(a, b);                                                                        \
    }                                                                                              \
  };
// Op_sum is D::add and Op_prod is D::mul; the rest share their names with the D functions.
struct Op_sum {
  template <class D> static COMM_HD typename D::Bits apply(typename D::Bits a, typename D::Bits b) {
    return D::add(a, b);
  }
};
struct Op_prod {
  template <class D> static COMM_HD typename D::Bits apply(typename D::Bits a, typename D::Bits b) {
    return D::mul(a, b);
  }
};
COMM_DEFINE_OP(max)
COMM_DEFINE_OP(min)
COMM_DEFINE_OP(band)
COMM_DEFINE_OP(bor)
COMM_DEFINE_OP(bxor)
#undef COMM_DEFINE_OP

// Source i's value as it enters the fold: s * x rounded to the datatype when it is scaled.
template <class D>
COMM_HD typename D::Bits prescale(typename D::Bits x, bool scaled, typename D::Bits s) {
  return scaled ? D::mul(x, s) : x;
}

// The end of the fold: an integer average's division.
template <class D>
COMM_HD typename D::Bits finish(typename D::Bits acc, unsigned long long divide_by) {
  return divide_by ? D::divide(acc, divide_by) : acc;
}

// One element of a reduce launch, written straight (the kernels interleave the same steps with
// their loads): the reference the host test checks.
template <class D, class Op>
COMM_HD typename D::Bits reduce_element(const typename D::Bits *x, const unsigned long long *scale,
                                        unsigned has_scale, int nsrc,
                                        unsigned long long divide_by) {
  typename D::Bits acc = prescale<D>(x[0], has_scale & 1u, D::from_raw(scale[0]));
  for (int i = 1; i < nsrc; ++i) {
    acc = Op::template apply<D>(acc, prescale<D>(x[i], (has_scale >> i) & 1u, D::from_raw(scale[i])));
  }
  return finish<D>(acc, divide_by);
}

} // namespace comm

#endif // COMM_REDUCE_MATH_CUH
