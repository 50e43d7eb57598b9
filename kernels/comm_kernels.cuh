/* The interface between libcomm's Rust code and its device kernels.
 *
 * Rust mirrors ReduceArgs as `cuda::kernels::ReduceArgs` (#[repr(C)]); the build compiles a probe
 * against this header and the Rust side asserts at compile time that sizes and offsets agree.
 * Keep this header plain C: the probe and any C tooling include it without CUDA.
 */
#ifndef COMM_KERNELS_CUH
#define COMM_KERNELS_CUH

/* Most inputs one reduce launch combines. */
#define COMM_MAX_SOURCES 16

/* The one parameter of every comm_reduce_<dtype>_<op> kernel.
 *
 * dst[j] = divide(fold(op, scale(src[0][j]), ..., scale(src[nsrc-1][j]))) for j < count, where the
 * fold is left to right and every intermediate result is a value of the datatype, so a launch
 * gives exactly what the host reducer gives when it folds the same sources in the same order.
 */
typedef struct {
  void *dst;                                  /* count elements; may be src[0] itself (in place) */
  const void *src[COMM_MAX_SOURCES];          /* inputs; none partially overlaps dst */
  unsigned long long scale[COMM_MAX_SOURCES]; /* raw bits of a value of the datatype, low bytes */
  unsigned int has_scale;                     /* bit i: multiply src[i] by scale[i] (sum only) */
  int nsrc;                                   /* 1..COMM_MAX_SOURCES; 1 is a (scaled) copy */
  unsigned long long count;                   /* elements */
  unsigned long long divide_by;               /* 0, or divide every result by it (averages) */
  /* Per source: null, or a descriptor cell read at the start of the launch; when the cell holds a
   * non-zero address, the source is read from there instead of src[i] (a peer's message in its
   * registered buffer rather than in the slot it would have been staged into). */
  const unsigned long long *via[COMM_MAX_SOURCES];
  /* Per source: null, or the address of a value of the datatype that replaces scale[i] (a
   * PreMulSum scalar in device memory, read when the launch runs). */
  const void *scale_at[COMM_MAX_SOURCES];
} ReduceArgs;

/* Every reduce kernel, as X(dtype, op). Bitwise ops exist for the integer types only. The Rust
 * table in src/cuda/kernels.rs lists the same names; a unit test finds each in the fatbin. */
#define COMM_ARITH_OPS(X, T) X(T, sum) X(T, prod) X(T, max) X(T, min)
#define COMM_INTEGER_OPS(X, T) COMM_ARITH_OPS(X, T) X(T, band) X(T, bor) X(T, bxor)
#define COMM_FOR_EACH_REDUCE_KERNEL(X)                                                             \
  COMM_INTEGER_OPS(X, i8)                                                                          \
  COMM_INTEGER_OPS(X, u8)                                                                          \
  COMM_INTEGER_OPS(X, i32)                                                                         \
  COMM_INTEGER_OPS(X, u32)                                                                         \
  COMM_INTEGER_OPS(X, i64)                                                                         \
  COMM_INTEGER_OPS(X, u64)                                                                         \
  COMM_ARITH_OPS(X, f16)                                                                           \
  COMM_ARITH_OPS(X, f32)                                                                           \
  COMM_ARITH_OPS(X, f64)                                                                           \
  COMM_ARITH_OPS(X, bf16)                                                                          \
  COMM_ARITH_OPS(X, e4m3)                                                                          \
  COMM_ARITH_OPS(X, e5m2)

#endif /* COMM_KERNELS_CUH */
