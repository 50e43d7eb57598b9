// The reduce kernels: comm_reduce_<dtype>_<op>(ReduceArgs), one per entry of
// COMM_FOR_EACH_REDUCE_KERNEL. What they compute is in comm_kernels.cuh and reduce_math.cuh; this
// file is how they move memory.
//
// Each launch splits the range into a scalar head (elements before the first 16-byte boundary),
// a body of 16-byte vectors, and a scalar tail, when dst and every source sit at the same offset
// from a 16-byte boundary (the usual case: the same chunk of buffers allocated alike). Otherwise
// the whole range goes through the scalar path, which is correct for any element-aligned pointers.
// Both paths are grid-stride loops, so any grid and block size covers any count (0 included).

#include "comm_kernels.cuh"
#include "reduce_math.cuh"

namespace comm {

// 16-byte vectors each thread loads per source and round: with the next source's loads issued
// before the current one is combined, a thread has up to 64 bytes in flight. Mirrored by
// BYTES_PER_THREAD in src/cuda/kernels.rs, which sizes the caller's grid.
constexpr int kVectorsPerThread = 2;
// Elements per thread and round on the scalar path (misaligned buffers, heads and tails).
constexpr int kScalarsPerThread = 4;

template <class D> union Pack {
  uint4 v;
  typename D::Bits e[16 / sizeof(typename D::Bits)];
};

// An "item" is what one load moves: one element, or a Pack of them. The overloads below apply a
// step of the fold to every element of an item.
template <class D> struct Items {
  typedef typename D::Bits T;
  static constexpr int kPerPack = 16 / sizeof(T);

  static __device__ __forceinline__ T load(const T *p) { return *p; }
  static __device__ __forceinline__ Pack<D> load(const Pack<D> *p) {
    Pack<D> x;
    x.v = *reinterpret_cast<const uint4 *>(p);
    return x;
  }
  static __device__ __forceinline__ void store(T *p, T x) { *p = x; }
  static __device__ __forceinline__ void store(Pack<D> *p, Pack<D> x) {
    *reinterpret_cast<uint4 *>(p) = x.v;
  }

  static __device__ __forceinline__ T scale(T x, T s) { return D::mul(x, s); }
  static __device__ __forceinline__ Pack<D> scale(Pack<D> x, T s) {
#pragma unroll
    for (int j = 0; j < kPerPack; ++j) x.e[j] = D::mul(x.e[j], s);
    return x;
  }

  template <class Op> static __device__ __forceinline__ T combine(T a, T b) {
    return Op::template apply<D>(a, b);
  }
  template <class Op> static __device__ __forceinline__ Pack<D> combine(Pack<D> a, Pack<D> b) {
#pragma unroll
    for (int j = 0; j < kPerPack; ++j) a.e[j] = Op::template apply<D>(a.e[j], b.e[j]);
    return a;
  }

  // Division is the rare last step of an integer average and expands to a lot of code per
  // element, so it is one out-of-line loop per kernel rather than unrolled into every path.
  static __device__ __noinline__ void divide(T *e, int n, unsigned long long d) {
#pragma unroll 1
    for (int j = 0; j < n; ++j) e[j] = D::divide(e[j], d);
  }
  static __device__ __forceinline__ T finish(T x, unsigned long long d) {
    divide(&x, 1, d);
    return x;
  }
  static __device__ __forceinline__ Pack<D> finish(Pack<D> x, unsigned long long d) {
    divide(x.e, kPerPack, d);
    return x;
  }
};

// The buffers' items [0, n), where item i lives at byte `lo_offset` + i * sizeof(Item) for
// i < split and at `hi_offset` + (i - split) * sizeof(Item) beyond (so that one loop covers a head
// and a tail). Thread t of block b handles, per round, items base + k * blockDim.x for k < U: a
// warp's loads of one k are contiguous.
template <class D, class Op, class Item, int U>
__device__ __forceinline__ void fold_items(const ReduceArgs &args, unsigned long long n,
                                           unsigned long long split, unsigned long long lo_offset,
                                           unsigned long long hi_offset) {
  typedef Items<D> I;
  const int nsrc = args.nsrc;
  const unsigned has_scale = args.has_scale;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x * U;

  for (unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x * U + threadIdx.x;
       base < n; base += stride) {
    unsigned long long at[U]; // byte offset of each of this thread's items
    bool live[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const unsigned long long i = base + (unsigned long long)k * blockDim.x;
      live[k] = i < n;
      at[k] = i < split ? lo_offset + i * sizeof(Item) : hi_offset + (i - split) * sizeof(Item);
    }
    auto load_source = [&](int s, Item *out) {
      const char *src = static_cast<const char *>(args.src[s]);
#pragma unroll
      for (int k = 0; k < U; ++k) {
        if (live[k]) out[k] = I::load(reinterpret_cast<const Item *>(src + at[k]));
      }
    };

    // Source s + 1 loads while source s is scaled and combined. Source 0 goes through the same
    // loop (it is the accumulator's start rather than an operand), so that the scaling code,
    // large for fp8 without conversion instructions, exists once.
    Item acc[U], cur[U];
    load_source(0, cur);
#pragma unroll 1
    for (int s = 0; s < nsrc; ++s) {
      Item next[U];
      if (s + 1 < nsrc) load_source(s + 1, next);
      if ((has_scale >> s) & 1u) {
        const typename D::Bits sc = D::from_raw(args.scale[s]);
#pragma unroll
        for (int k = 0; k < U; ++k) cur[k] = I::scale(cur[k], sc);
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        acc[k] = s == 0 ? cur[k] : I::template combine<Op>(acc[k], cur[k]);
        cur[k] = next[k];
      }
    }

    char *dst = static_cast<char *>(args.dst);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (!live[k]) continue;
      if (args.divide_by) acc[k] = I::finish(acc[k], args.divide_by);
      I::store(reinterpret_cast<Item *>(dst + at[k]), acc[k]);
    }
  }
}

// Sources with a descriptor cell are read wherever the cell points (when it is set); the cells
// were written before the flag the stream waited on ahead of this launch, so every thread reads
// the same value. Multipliers kept in device memory are read the same way.
template <class D> __device__ __forceinline__ void resolve_sources(ReduceArgs &args) {
  for (int s = 0; s < args.nsrc; ++s) {
    if (args.via[s] != nullptr) {
      const unsigned long long at = *static_cast<const volatile unsigned long long *>(args.via[s]);
      if (at != 0) args.src[s] = reinterpret_cast<const void *>(at);
    }
    if (args.scale_at[s] != nullptr) {
      unsigned long long raw = 0;
      memcpy(&raw, args.scale_at[s], sizeof(typename D::Bits));
      args.scale[s] = raw;
    }
  }
}

template <class D, class Op> __device__ __forceinline__ void reduce_resolved(const ReduceArgs &args) {
  typedef typename D::Bits T;
  const unsigned long long count = args.count;
  const int nsrc = args.nsrc;

  const unsigned misalign = (unsigned)(reinterpret_cast<uintptr_t>(args.dst) & 15u);
  bool together = true;
  for (int s = 0; s < nsrc; ++s) {
    together &= (unsigned)(reinterpret_cast<uintptr_t>(args.src[s]) & 15u) == misalign;
  }
  // Elements before the first 16-byte boundary, whole packs, and what is left after them; or,
  // when the buffers disagree on that boundary, every element one at a time.
  unsigned long long head = count, packs = 0, body_end = count;
  if (together) {
    head = ((16u - misalign) & 15u) / sizeof(T);
    if (head > count) head = count;
    packs = (count - head) / Items<D>::kPerPack;
    body_end = head + packs * Items<D>::kPerPack;
    fold_items<D, Op, Pack<D>, kVectorsPerThread>(args, packs, packs, head * sizeof(T), 0);
  }
  fold_items<D, Op, T, kScalarsPerThread>(args, head + (count - body_end), head, 0,
                                          body_end * sizeof(T));
}

// Launches without descriptors or multipliers in device memory (nearly all) read the parameters
// where they are; the others work on a copy with those resolved.
template <class D, class Op> __device__ __forceinline__ void reduce(const ReduceArgs &args) {
  if (args.count == 0 || args.nsrc < 1 || args.nsrc > COMM_MAX_SOURCES) return;
  bool indirect = false;
  for (int s = 0; s < args.nsrc; ++s) {
    indirect |= args.via[s] != nullptr || args.scale_at[s] != nullptr;
  }
  if (!indirect) {
    reduce_resolved<D, Op>(args);
    return;
  }
  ReduceArgs copy = args;
  resolve_sources<D>(copy);
  reduce_resolved<D, Op>(copy);
}

} // namespace comm

#define COMM_DEFINE_REDUCE_KERNEL(T, OP)                                                           \
  extern "C" __global__ void comm_reduce_##T##_##OP(ReduceArgs args) {                             \
    comm::reduce<comm::Dt_##T, comm::Op_##OP>(args);                                               \
  }
COMM_FOR_EACH_REDUCE_KERNEL(COMM_DEFINE_REDUCE_KERNEL)
#undef COMM_DEFINE_REDUCE_KERNEL
