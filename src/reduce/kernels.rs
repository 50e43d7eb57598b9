//! The loops behind [`super::Reducer`].
//!
//! Dispatch on datatype, op and "scaled or not" happens once per call; what runs per element is a
//! function monomorphised for that combination, a plain loop over typed slices that LLVM
//! vectorises. The layers, top to bottom:
//!
//! - entry points (`reduce`, `scale`, ...) check lengths and pick a kernel for the datatype;
//! - `run_binary` / `run_unary` view the byte buffers as typed slices when every one of them is
//!   aligned, and otherwise stage blocks through aligned stack arrays (a byte copy, so the bytes are
//!   read exactly as `from_ne_bytes` would) and run the same kernel on those;
//! - kernels: native types (integers, f32, f64) compute in their own type; f16, bf16 and both fp8
//!   formats are widened block by block to f32, combined there and narrowed once with
//!   round-to-nearest-even. f32 carries more than twice the precision of those formats plus two
//!   bits, so one f32 operation followed by one rounding gives the correctly rounded result of the
//!   operation in the narrow format.
//!
//! Choices worth knowing:
//!
//! - Integers wrap; integer scales are a wrapping multiply; integer division truncates toward zero.
//! - Float max/min return the other operand when one is NaN, as C `fmax`/`fmin` do, and take
//!   -0 as below +0, so the result's bits do not depend on the operands' order (two NaNs
//!   aside) or on how a buffer is cut into pieces.
//! - fp8 narrowing saturates to the largest finite value (what NCCL gets from CUDA's
//!   `__NV_SATFINITE` conversions); NaN stays NaN. An e5m2 infinity therefore becomes ±57344 on the
//!   way out. f16 and bf16 keep IEEE overflow to infinity.
//! - PreMulSum on a narrow type rounds `s * x` to that type before the sum, so each rank's scaled
//!   contribution is a value of the datatype, as it would be if the rank had scaled its own buffer.
//!   A GPU kernel that multiplies and adds in wider precision may differ in the last bit.

use std::marker::PhantomData;

use bytemuck::{Pod, Zeroable};
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use super::{stream, DataType, ReduceOp, Reducer, Scale};

/// Elements per block when widening narrow floats or staging misaligned buffers: small enough
/// that the scratch arrays stay in L1, large enough to amortise the per-block bookkeeping.
const BLOCK: usize = 256;

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

pub(super) fn reduce(
    r: Reducer,
    dst: &mut [u8],
    a: &[u8],
    sa: Option<Scale>,
    b: &[u8],
    sb: Option<Scale>,
) {
    check_len(r.dtype, "reduce: dst", dst.len());
    assert_eq!(dst.len(), a.len(), "reduce: dst and a differ in length");
    assert_eq!(dst.len(), b.len(), "reduce: dst and b differ in length");
    binary(r, Operands::Separate { dst, src: a }, sa, b, sb);
}

pub(super) fn reduce_in_place(
    r: Reducer,
    acc: &mut [u8],
    sacc: Option<Scale>,
    b: &[u8],
    sb: Option<Scale>,
) {
    check_len(r.dtype, "reduce_in_place: acc", acc.len());
    assert_eq!(
        acc.len(),
        b.len(),
        "reduce_in_place: acc and b differ in length"
    );
    binary(r, Operands::InPlace(acc), sacc, b, sb);
}

pub(super) fn reduce_twice(
    r: Reducer,
    streamed: &mut [u8],
    also: &mut [u8],
    a: &[u8],
    sa: Option<Scale>,
    b: &[u8],
    sb: Option<Scale>,
) {
    check_len(r.dtype, "reduce_twice: streamed", streamed.len());
    assert_eq!(
        streamed.len(),
        also.len(),
        "reduce_twice: outputs differ in length"
    );
    assert_eq!(
        streamed.len(),
        a.len(),
        "reduce_twice: output and a differ in length"
    );
    assert_eq!(
        streamed.len(),
        b.len(),
        "reduce_twice: output and b differ in length"
    );
    let x = Operands::Twice {
        streamed,
        also,
        src: a,
    };
    binary(r, x, sa, b, sb);
}

pub(super) fn scale(dtype: DataType, dst: &mut [u8], src: &[u8], s: Scale) {
    check_len(dtype, "scale: dst", dst.len());
    assert_eq!(dst.len(), src.len(), "scale: dst and src differ in length");
    scale_by(dtype, Operands::Separate { dst, src }, s);
}

pub(super) fn scale_in_place(dtype: DataType, buf: &mut [u8], s: Scale) {
    check_len(dtype, "scale_in_place: buf", buf.len());
    scale_by(dtype, Operands::InPlace(buf), s);
}

pub(super) fn divide_in_place(dtype: DataType, buf: &mut [u8], n: usize) {
    check_len(dtype, "divide_in_place: buf", buf.len());
    assert!(n > 0, "divide_in_place: cannot divide by zero ranks");
    let buf = Operands::InPlace(buf);
    match dtype {
        DataType::Int8 => run_unary(&Map(int_divider::<i8>(n)), buf),
        DataType::Uint8 => run_unary(&Map(int_divider::<u8>(n)), buf),
        DataType::Int32 => run_unary(&Map(int_divider::<i32>(n)), buf),
        DataType::Uint32 => run_unary(&Map(int_divider::<u32>(n)), buf),
        DataType::Int64 => run_unary(&Map(int_divider::<i64>(n)), buf),
        DataType::Uint64 => run_unary(&Map(int_divider::<u64>(n)), buf),
        DataType::Float32 => {
            let d = n as f32;
            run_unary(&Map(move |x: f32| x / d), buf)
        }
        DataType::Float64 => {
            let d = n as f64;
            run_unary(&Map(move |x: f64| x / d), buf)
        }
        DataType::Float16 => divide_narrow::<Half>(buf, n),
        DataType::Bfloat16 => divide_narrow::<BFloat>(buf, n),
        DataType::Float8e4m3 => divide_narrow::<E4M3>(buf, n),
        DataType::Float8e5m2 => divide_narrow::<E5M2>(buf, n),
    }
}

pub(super) fn reciprocal(dtype: DataType, n: usize) -> Scale {
    assert!(n > 0, "reciprocal: the average of zero ranks is undefined");
    let mut out = [0u8; 8];
    // Every value below is exactly representable in its format, so these casts do not round.
    match dtype {
        DataType::Int8 | DataType::Uint8 => out[0] = 1,
        DataType::Int32 | DataType::Uint32 => out[..4].copy_from_slice(&1u32.to_ne_bytes()),
        DataType::Int64 | DataType::Uint64 => out.copy_from_slice(&1u64.to_ne_bytes()),
        DataType::Float32 => {
            let r = reciprocal_rounded(n, 23, -126) as f32;
            out[..4].copy_from_slice(&r.to_ne_bytes());
        }
        DataType::Float64 => out = reciprocal_rounded(n, 52, -1022).to_ne_bytes(),
        DataType::Float16 => {
            let r = f16::from_f32(reciprocal_rounded(n, 10, -14) as f32);
            out[..2].copy_from_slice(&r.to_bits().to_ne_bytes());
        }
        DataType::Bfloat16 => {
            let r = f32_to_bf16_bits(reciprocal_rounded(n, 7, -126) as f32);
            out[..2].copy_from_slice(&r.to_ne_bytes());
        }
        DataType::Float8e4m3 => out[0] = f32_to_fp8e4m3(reciprocal_rounded(n, 3, -6) as f32),
        DataType::Float8e5m2 => out[0] = f32_to_fp8e5m2(reciprocal_rounded(n, 2, -14) as f32),
    }
    Scale(out)
}

/// `1/n` rounded to nearest-even in a binary format with `man_bits` fraction bits and smallest
/// normal exponent `min_exp`. Integer division gives the exact remainder, so the rounding is
/// correct even where converting a rounded f64 quotient would round twice.
fn reciprocal_rounded(n: usize, man_bits: u32, min_exp: i32) -> f64 {
    let n = n as u128;
    // 2^e <= 1/n < 2^(e+1)
    let e = -((128 - (n - 1).leading_zeros()) as i32);
    // Weight of the last significand bit is 2^-k; below the normal range it stays fixed.
    let k = (man_bits as i32 - e.max(min_exp)) as u32;
    let (q, r) = ((1u128 << k) / n, (1u128 << k) % n);
    let q = if 2 * r > n || (2 * r == n && q & 1 == 1) {
        q + 1
    } else {
        q
    };
    q as f64 * f64::from_bits(u64::from(1023 - k) << 52)
}

fn check_len(dtype: DataType, what: &str, len: usize) {
    assert!(
        len % dtype.size() == 0,
        "{what}: {len} bytes is not a whole number of {} elements",
        dtype.name()
    );
}

// ---------------------------------------------------------------------------------------------
// Dispatch: datatype and op to a monomorphised kernel
// ---------------------------------------------------------------------------------------------

/// Where a kernel writes and what it reads besides `b`: a separate destination, an
/// accumulator that is both first input and output, or (binary kernels only) two
/// destinations, the first written with non-temporal stores (`stream::stream_copy`) a few lines
/// at a time as they are computed.
enum Operands<'a> {
    Separate {
        dst: &'a mut [u8],
        src: &'a [u8],
    },
    InPlace(&'a mut [u8]),
    Twice {
        streamed: &'a mut [u8],
        also: &'a mut [u8],
        src: &'a [u8],
    },
}

/// Bytes `Operands::Twice` computes at a time (into `also`, or into a staging buffer where
/// `also` is misaligned for the type) before it streams them on out of L1.
const TWICE_BYTES: usize = 256;

/// `x` is the first operand (with its scale `sx`) and says where the result goes.
fn binary(r: Reducer, x: Operands<'_>, sx: Option<Scale>, b: &[u8], sb: Option<Scale>) {
    match r.dtype {
        DataType::Int8 => binary_int::<i8>(r, x, sx, b, sb),
        DataType::Uint8 => binary_int::<u8>(r, x, sx, b, sb),
        DataType::Int32 => binary_int::<i32>(r, x, sx, b, sb),
        DataType::Uint32 => binary_int::<u32>(r, x, sx, b, sb),
        DataType::Int64 => binary_int::<i64>(r, x, sx, b, sb),
        DataType::Uint64 => binary_int::<u64>(r, x, sx, b, sb),
        DataType::Float32 => binary_arith::<f32>(r, x, sx, b, sb),
        DataType::Float64 => binary_arith::<f64>(r, x, sx, b, sb),
        DataType::Float16 => binary_narrow::<Half>(r, x, sx, b, sb),
        DataType::Bfloat16 => binary_narrow::<BFloat>(r, x, sx, b, sb),
        DataType::Float8e4m3 => binary_narrow::<E4M3>(r, x, sx, b, sb),
        DataType::Float8e5m2 => binary_narrow::<E5M2>(r, x, sx, b, sb),
    }
}

fn binary_int<T: Bitwise>(
    r: Reducer,
    x: Operands<'_>,
    sx: Option<Scale>,
    b: &[u8],
    sb: Option<Scale>,
) {
    match r.op {
        ReduceOp::BitAnd => binary_native::<T, And>(x, sx, b, sb),
        ReduceOp::BitOr => binary_native::<T, Or>(x, sx, b, sb),
        ReduceOp::BitXor => binary_native::<T, Xor>(x, sx, b, sb),
        _ => binary_arith::<T>(r, x, sx, b, sb),
    }
}

fn binary_arith<T: Element>(
    r: Reducer,
    x: Operands<'_>,
    sx: Option<Scale>,
    b: &[u8],
    sb: Option<Scale>,
) {
    match r.op {
        ReduceOp::Sum => binary_native::<T, Add>(x, sx, b, sb),
        ReduceOp::Prod => binary_native::<T, Mul>(x, sx, b, sb),
        ReduceOp::Max => binary_native::<T, Max>(x, sx, b, sb),
        ReduceOp::Min => binary_native::<T, Min>(x, sx, b, sb),
        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => no_bitwise(r),
    }
}

fn binary_native<T: Element, O: Op<T>>(
    x: Operands<'_>,
    sx: Option<Scale>,
    b: &[u8],
    sb: Option<Scale>,
) {
    if sx.is_none() && sb.is_none() {
        run_binary(&Plain::<O>(PhantomData), x, b);
    } else {
        // A missing scale is a multiply by one, exact for every type, so one scaled kernel serves
        // all three combinations.
        let scaled = Scaled::<T, O> {
            sx: sx.map_or(T::ONE, scalar::<T>),
            sb: sb.map_or(T::ONE, scalar::<T>),
            op: PhantomData,
        };
        run_binary(&scaled, x, b);
    }
}

fn binary_narrow<F: Narrow>(
    r: Reducer,
    x: Operands<'_>,
    sx: Option<Scale>,
    b: &[u8],
    sb: Option<Scale>,
) {
    let (sx, sb) = (sx.map(F::scalar), sb.map(F::scalar));
    match r.op {
        ReduceOp::Sum => run_binary(&NarrowCombine::<F, Add>::new(sx, sb), x, b),
        ReduceOp::Prod => run_binary(&NarrowCombine::<F, Mul>::new(sx, sb), x, b),
        ReduceOp::Max => run_binary(&NarrowCombine::<F, Max>::new(sx, sb), x, b),
        ReduceOp::Min => run_binary(&NarrowCombine::<F, Min>::new(sx, sb), x, b),
        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => no_bitwise(r),
    }
}

/// Unscaled inputs of at most this many bytes in a type computed natively take `small`.
const SMALL: usize = 64;

/// `dst = op(a, b)` element by element, straight on the bytes, when they are at most `SMALL`
/// bytes of a type computed natively and the op suits it; false, having done nothing,
/// otherwise. The views and dispatch of `binary` cost more than the reduction of the one 8-byte
/// message a small all-reduce folds per peer; the element operations are the same
/// (`Op::apply`), so the bits are too.
///
/// # Safety
/// `dst`, `a` and `b` cover `len` bytes, a whole number of elements; `dst` is `a`, is `b` or
/// overlaps neither (each element is read before it is written).
pub(super) unsafe fn small(
    r: Reducer,
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    len: usize,
) -> bool {
    if len > SMALL {
        return false;
    }
    let x = Raw { dst, a, b, len };
    // SAFETY: each helper has this function's contract, which the caller upholds; the element
    // type each one gets is `r.dtype`'s, so "a whole number of elements" still holds.
    unsafe {
        match r.dtype {
            DataType::Int8 => small_int::<i8>(r.op, x),
            DataType::Uint8 => small_int::<u8>(r.op, x),
            DataType::Int32 => small_int::<i32>(r.op, x),
            DataType::Uint32 => small_int::<u32>(r.op, x),
            DataType::Int64 => small_int::<i64>(r.op, x),
            DataType::Uint64 => small_int::<u64>(r.op, x),
            DataType::Float32 => small_arith::<f32>(r.op, x),
            DataType::Float64 => small_arith::<f64>(r.op, x),
            _ => false,
        }
    }
}

/// The operands of `small`: `len` bytes at each pointer.
#[derive(Clone, Copy)]
struct Raw {
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    len: usize,
}

/// `small` for an integer type: the bitwise ops, then the arithmetic ones.
///
/// # Safety
/// As `small`.
unsafe fn small_int<T: Bitwise>(op: ReduceOp, x: Raw) -> bool {
    // SAFETY: `small_loop` and `small_arith` have this function's contract, which the caller
    // upholds, for the same `T`.
    unsafe {
        match op {
            ReduceOp::BitAnd => small_loop::<T, And>(x),
            ReduceOp::BitOr => small_loop::<T, Or>(x),
            ReduceOp::BitXor => small_loop::<T, Xor>(x),
            _ => return small_arith::<T>(op, x),
        }
    }
    true
}

/// `small` for the arithmetic ops; false for a bitwise one (a float's: `binary` reports it).
///
/// # Safety
/// As `small`.
unsafe fn small_arith<T: Element>(op: ReduceOp, x: Raw) -> bool {
    // SAFETY: `small_loop` has this function's contract, which the caller upholds, for the
    // same `T`.
    unsafe {
        match op {
            ReduceOp::Sum => small_loop::<T, Add>(x),
            ReduceOp::Prod => small_loop::<T, Mul>(x),
            ReduceOp::Max => small_loop::<T, Max>(x),
            ReduceOp::Min => small_loop::<T, Min>(x),
            ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => return false,
        }
    }
    true
}

/// # Safety
/// As `small`.
unsafe fn small_loop<T: Pod, O: Op<T>>(x: Raw) {
    let w = std::mem::size_of::<T>();
    let mut i = 0;
    while i < x.len {
        // SAFETY: `x.len` is a whole number of `T`s (caller), so `[i, i + w)` lies inside
        // the `len` bytes each pointer covers; the accesses are unaligned ones, and `T: Pod`
        // makes any bytes a valid `T`. Both operands of element `i` are read before its one
        // write, so `dst` being `a` or `b` is fine.
        unsafe {
            let p = (x.a.add(i) as *const T).read_unaligned();
            let q = (x.b.add(i) as *const T).read_unaligned();
            (x.dst.add(i) as *mut T).write_unaligned(O::apply(p, q));
        }
        i += w;
    }
}

fn no_bitwise(r: Reducer) -> ! {
    panic!(
        "reduce: bitwise op {} is not defined for floating-point type {}",
        r.op.name(),
        r.dtype.name()
    )
}

fn scale_by(dtype: DataType, x: Operands<'_>, s: Scale) {
    match dtype {
        DataType::Int8 => scale_native::<i8>(x, s),
        DataType::Uint8 => scale_native::<u8>(x, s),
        DataType::Int32 => scale_native::<i32>(x, s),
        DataType::Uint32 => scale_native::<u32>(x, s),
        DataType::Int64 => scale_native::<i64>(x, s),
        DataType::Uint64 => scale_native::<u64>(x, s),
        DataType::Float32 => scale_native::<f32>(x, s),
        DataType::Float64 => scale_native::<f64>(x, s),
        DataType::Float16 => scale_narrow::<Half>(x, s),
        DataType::Bfloat16 => scale_narrow::<BFloat>(x, s),
        DataType::Float8e4m3 => scale_narrow::<E4M3>(x, s),
        DataType::Float8e5m2 => scale_narrow::<E5M2>(x, s),
    }
}

fn scale_native<T: Element>(x: Operands<'_>, s: Scale) {
    let s = scalar::<T>(s);
    run_unary(&Map(move |v: T| v.mul(s)), x);
}

fn scale_narrow<F: Narrow>(x: Operands<'_>, s: Scale) {
    let s = F::scalar(s);
    run_unary(&NarrowMap::<F, _>(move |v| v * s, PhantomData), x);
}

fn divide_narrow<F: Narrow>(x: Operands<'_>, n: usize) {
    let d = n as f32;
    run_unary(&NarrowMap::<F, _>(move |v| v / d, PhantomData), x);
}

/// Truncating division by a rank count. When `n` does not fit the type (an int8 average over
/// more than 127 ranks) the quotient is taken in i128, where every value and `n` fit.
fn int_divider<T: Bitwise>(n: usize) -> impl Fn(T) -> T {
    let narrow = T::try_from(n).ok();
    let wide = n as i128;
    move |x: T| match narrow {
        // n > 0, so neither division by zero nor MIN / -1 can occur.
        Some(d) => x / d,
        None => T::try_from(x.into() / wide).unwrap_or_default(),
    }
}

/// Reads a scale as a value of `T` from its native-endian bytes.
fn scalar<T: Pod>(s: Scale) -> T {
    bytemuck::pod_read_unaligned(&s.0[..std::mem::size_of::<T>()])
}

// ---------------------------------------------------------------------------------------------
// Byte buffers to typed slices
// ---------------------------------------------------------------------------------------------

/// An element-wise kernel of two inputs over typed slices of equal length.
trait Binary<T> {
    fn apply(&self, dst: &mut [T], a: &[T], b: &[T]);
    fn apply_in_place(&self, acc: &mut [T], b: &[T]);
}

/// An element-wise kernel of one input over typed slices of equal length.
trait Unary<T> {
    fn apply(&self, dst: &mut [T], src: &[T]);
    fn apply_in_place(&self, buf: &mut [T]);
}

fn run_binary<T: Pod, K: Binary<T>>(k: &K, x: Operands<'_>, b: &[u8]) {
    match x {
        Operands::Separate { dst, src } => {
            if let (Ok(src), Ok(b)) = (bytemuck::try_cast_slice(src), bytemuck::try_cast_slice(b)) {
                if let Ok(dst) = bytemuck::try_cast_slice_mut(dst) {
                    return k.apply(dst, src, b);
                }
            }
            let w = std::mem::size_of::<T>();
            let mut sd = [T::zeroed(); BLOCK];
            let (mut sa, mut sb) = ([T::zeroed(); BLOCK], [T::zeroed(); BLOCK]);
            for ((d, x), y) in dst
                .chunks_mut(BLOCK * w)
                .zip(src.chunks(BLOCK * w))
                .zip(b.chunks(BLOCK * w))
            {
                let n = d.len() / w;
                let (sd, sa, sb) = (&mut sd[..n], &mut sa[..n], &mut sb[..n]);
                bytemuck::cast_slice_mut(&mut *sa).copy_from_slice(x);
                bytemuck::cast_slice_mut(&mut *sb).copy_from_slice(y);
                k.apply(sd, sa, sb);
                d.copy_from_slice(bytemuck::cast_slice(sd));
            }
        }
        Operands::Twice {
            streamed,
            also,
            src,
        } => {
            let w = std::mem::size_of::<T>();
            let per = (TWICE_BYTES / w).clamp(1, BLOCK);
            let mut sd = [T::zeroed(); BLOCK];
            let wide = stream::wide();
            let chunks = streamed.chunks_mut(per * w).zip(also.chunks_mut(per * w));
            if let (Ok(x), Ok(y)) = (bytemuck::try_cast_slice(src), bytemuck::try_cast_slice(b)) {
                for ((s, d), (x, y)) in chunks.zip(x.chunks(per).zip(y.chunks(per))) {
                    if let Ok(dt) = bytemuck::try_cast_slice_mut::<u8, T>(d) {
                        k.apply(dt, x, y);
                        stream::stream_from(s, d, wide);
                        continue;
                    }
                    let sd = &mut sd[..x.len()];
                    k.apply(sd, x, y);
                    stream::emit_twice(s, d, bytemuck::cast_slice(sd), wide);
                }
            } else {
                let (mut sa, mut sb) = ([T::zeroed(); BLOCK], [T::zeroed(); BLOCK]);
                for ((s, d), (x, y)) in chunks.zip(src.chunks(per * w).zip(b.chunks(per * w))) {
                    let n = x.len() / w;
                    let (sd, sa, sb) = (&mut sd[..n], &mut sa[..n], &mut sb[..n]);
                    bytemuck::cast_slice_mut(&mut *sa).copy_from_slice(x);
                    bytemuck::cast_slice_mut(&mut *sb).copy_from_slice(y);
                    k.apply(sd, sa, sb);
                    stream::emit_twice(s, d, bytemuck::cast_slice(sd), wide);
                }
            }
            stream::stream_fence();
        }
        Operands::InPlace(acc) => {
            if let Ok(b) = bytemuck::try_cast_slice(b) {
                if let Ok(acc) = bytemuck::try_cast_slice_mut(acc) {
                    return k.apply_in_place(acc, b);
                }
            }
            let w = std::mem::size_of::<T>();
            let (mut sa, mut sb) = ([T::zeroed(); BLOCK], [T::zeroed(); BLOCK]);
            for (x, y) in acc.chunks_mut(BLOCK * w).zip(b.chunks(BLOCK * w)) {
                let n = x.len() / w;
                let (sa, sb) = (&mut sa[..n], &mut sb[..n]);
                bytemuck::cast_slice_mut(&mut *sa).copy_from_slice(x);
                bytemuck::cast_slice_mut(&mut *sb).copy_from_slice(y);
                k.apply_in_place(sa, sb);
                x.copy_from_slice(bytemuck::cast_slice(sa));
            }
        }
    }
}

fn run_unary<T: Pod, K: Unary<T>>(k: &K, x: Operands<'_>) {
    let w = std::mem::size_of::<T>();
    match x {
        Operands::Separate { dst, src } => {
            if let Ok(src) = bytemuck::try_cast_slice(src) {
                if let Ok(dst) = bytemuck::try_cast_slice_mut(dst) {
                    return k.apply(dst, src);
                }
            }
            let (mut sd, mut ss) = ([T::zeroed(); BLOCK], [T::zeroed(); BLOCK]);
            for (d, x) in dst.chunks_mut(BLOCK * w).zip(src.chunks(BLOCK * w)) {
                let n = d.len() / w;
                let (sd, ss) = (&mut sd[..n], &mut ss[..n]);
                bytemuck::cast_slice_mut(&mut *ss).copy_from_slice(x);
                k.apply(sd, ss);
                d.copy_from_slice(bytemuck::cast_slice(sd));
            }
        }
        Operands::Twice {
            streamed,
            also,
            src,
        } => {
            run_unary(k, Operands::Separate { dst: also, src });
            // SAFETY: distinct buffers of the same length.
            unsafe { stream::stream_copy(streamed.as_mut_ptr(), also.as_ptr(), also.len(), true) };
        }
        Operands::InPlace(buf) => {
            if let Ok(buf) = bytemuck::try_cast_slice_mut(buf) {
                return k.apply_in_place(buf);
            }
            let mut ss = [T::zeroed(); BLOCK];
            for x in buf.chunks_mut(BLOCK * w) {
                let ss = &mut ss[..x.len() / w];
                bytemuck::cast_slice_mut(&mut *ss).copy_from_slice(x);
                k.apply_in_place(ss);
                x.copy_from_slice(bytemuck::cast_slice(ss));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Element types and ops
// ---------------------------------------------------------------------------------------------

/// A type the kernels compute in directly.
trait Element: Pod {
    const ONE: Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn maximum(self, o: Self) -> Self;
    fn minimum(self, o: Self) -> Self;
}

/// Integer elements, which also have the bitwise ops.
trait Bitwise:
    Element + TryFrom<usize> + TryFrom<i128> + Into<i128> + std::ops::Div<Output = Self> + Default
{
    fn and(self, o: Self) -> Self;
    fn or(self, o: Self) -> Self;
    fn xor(self, o: Self) -> Self;
}

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const ONE: Self = 1;
            #[inline]
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline]
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline]
            fn maximum(self, o: Self) -> Self { Ord::max(self, o) }
            #[inline]
            fn minimum(self, o: Self) -> Self { Ord::min(self, o) }
        }
        impl Bitwise for $t {
            #[inline]
            fn and(self, o: Self) -> Self { self & o }
            #[inline]
            fn or(self, o: Self) -> Self { self | o }
            #[inline]
            fn xor(self, o: Self) -> Self { self ^ o }
        }
    )*};
}
int_element!(i8, u8, i32, u32, i64, u64);

macro_rules! float_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const ONE: Self = 1.0;
            #[inline]
            fn add(self, o: Self) -> Self { self + o }
            #[inline]
            fn mul(self, o: Self) -> Self { self * o }
            // Max and min return the other operand when one is NaN (as C fmax/fmin) and order
            // -0 below +0 (IEEE 754-2019 maximumNumber/minimumNumber), so that only two NaNs
            // depend on the operands' order. The std max/min leave a zero's sign to the
            // instruction: max(-0, +0) gave -0 in a scalar loop and +0 in a vectorised one,
            // and the other order flipped both, so ranks that fold the same values in pieces
            // of other lengths or in the other order got different bits.
            #[inline]
            fn maximum(self, o: Self) -> Self {
                // Equal (zeros of either sign included): +0 unless both are -0.
                if self == o {
                    <$t>::from_bits(self.to_bits() & o.to_bits())
                } else {
                    <$t>::max(self, o)
                }
            }
            #[inline]
            fn minimum(self, o: Self) -> Self {
                if self == o {
                    <$t>::from_bits(self.to_bits() | o.to_bits())
                } else {
                    <$t>::min(self, o)
                }
            }
        }
    )*};
}
float_element!(f32, f64);

/// A combining function, as a type so that each op gets its own compiled loop.
trait Op<T> {
    fn apply(a: T, b: T) -> T;
}

struct Add;
struct Mul;
struct Max;
struct Min;
struct And;
struct Or;
struct Xor;

impl<T: Element> Op<T> for Add {
    #[inline]
    fn apply(a: T, b: T) -> T {
        a.add(b)
    }
}
impl<T: Element> Op<T> for Mul {
    #[inline]
    fn apply(a: T, b: T) -> T {
        a.mul(b)
    }
}
impl<T: Element> Op<T> for Max {
    #[inline]
    fn apply(a: T, b: T) -> T {
        a.maximum(b)
    }
}
impl<T: Element> Op<T> for Min {
    #[inline]
    fn apply(a: T, b: T) -> T {
        a.minimum(b)
    }
}
impl<T: Bitwise> Op<T> for And {
    #[inline]
    fn apply(a: T, b: T) -> T {
        a.and(b)
    }
}
impl<T: Bitwise> Op<T> for Or {
    #[inline]
    fn apply(a: T, b: T) -> T {
        a.or(b)
    }
}
impl<T: Bitwise> Op<T> for Xor {
    #[inline]
    fn apply(a: T, b: T) -> T {
        a.xor(b)
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels on native types
// ---------------------------------------------------------------------------------------------

/// `op(a, b)`.
struct Plain<O>(PhantomData<O>);

impl<T: Copy, O: Op<T>> Binary<T> for Plain<O> {
    fn apply(&self, dst: &mut [T], a: &[T], b: &[T]) {
        for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
            *d = O::apply(x, y);
        }
    }

    fn apply_in_place(&self, acc: &mut [T], b: &[T]) {
        for (d, &y) in acc.iter_mut().zip(b) {
            *d = O::apply(*d, y);
        }
    }
}

/// `op(sx * a, sb * b)`.
struct Scaled<T, O> {
    sx: T,
    sb: T,
    op: PhantomData<O>,
}

impl<T: Element, O: Op<T>> Binary<T> for Scaled<T, O> {
    fn apply(&self, dst: &mut [T], a: &[T], b: &[T]) {
        let (sx, sb) = (self.sx, self.sb);
        for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
            *d = O::apply(x.mul(sx), y.mul(sb));
        }
    }

    fn apply_in_place(&self, acc: &mut [T], b: &[T]) {
        let (sx, sb) = (self.sx, self.sb);
        for (d, &y) in acc.iter_mut().zip(b) {
            *d = O::apply(d.mul(sx), y.mul(sb));
        }
    }
}

/// `f(x)` for each element.
struct Map<M>(M);

impl<T: Copy, M: Fn(T) -> T> Unary<T> for Map<M> {
    fn apply(&self, dst: &mut [T], src: &[T]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = (self.0)(x);
        }
    }

    fn apply_in_place(&self, buf: &mut [T]) {
        for d in buf.iter_mut() {
            *d = (self.0)(*d);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels on narrow floats: widen to f32, compute, narrow once
// ---------------------------------------------------------------------------------------------

/// A float format narrower than f32, stored as `Bits`.
trait Narrow {
    type Bits: Pod;
    /// `src` and `dst` have the same length.
    fn widen(src: &[Self::Bits], dst: &mut [f32]);
    /// Rounds to nearest-even; `src` and `dst` have the same length.
    fn narrow(src: &[f32], dst: &mut [Self::Bits]);

    fn scalar(s: Scale) -> f32 {
        let mut out = [0.0];
        Self::widen(&[scalar::<Self::Bits>(s)], &mut out);
        out[0]
    }

    /// Rounds f32 values to the nearest values of this format, in place.
    fn round(v: &mut [f32]) {
        let mut bits = [Self::Bits::zeroed(); BLOCK];
        for chunk in v.chunks_mut(BLOCK) {
            let bits = &mut bits[..chunk.len()];
            Self::narrow(chunk, bits);
            Self::widen(bits, chunk);
        }
    }
}

/// IEEE binary16, through `half`'s slice conversion (F16C where the CPU has it).
struct Half;

impl Narrow for Half {
    type Bits = u16;

    fn widen(src: &[u16], dst: &mut [f32]) {
        below_page_boundary(|| f16_to_f32_slice(src, dst));
    }

    fn narrow(src: &[f32], dst: &mut [u16]) {
        below_page_boundary(|| f32_to_f16_slice(src, dst));
    }
}

#[inline(never)]
fn f16_to_f32_slice(src: &[u16], dst: &mut [f32]) {
    src.reinterpret_cast::<f16>().convert_to_f32_slice(dst);
}

#[inline(never)]
fn f32_to_f16_slice(src: &[f32], dst: &mut [u16]) {
    dst.reinterpret_cast_mut::<f16>()
        .convert_from_f32_slice(src);
}

/// Page-sized and page-aligned: a local of this type puts its function's frame on a page
/// boundary.
#[repr(align(4096))]
struct PageAnchor(u8);

/// Calls `f`, which must call (not inline) the function doing the work, with the stack pointer
/// on a page boundary, so that the callee's frame lies inside the page below it.
///
/// Why: `half`'s F16C path hands every 8 values back through a 32-byte stack temporary. Where the
/// caller's stack depth happens to make that temporary straddle a page boundary, store-to-load
/// forwarding fails on every chunk and the conversion runs about 6x slower (measured: 0.3 GB/s
/// instead of 2.9 GB/s for an f16 sum). Which call paths hit it is an accident of stack layout;
/// anchoring the frame makes it impossible on every path.
#[inline(never)]
fn below_page_boundary<R>(f: impl FnOnce() -> R) -> R {
    let anchor = PageAnchor(0);
    std::hint::black_box(&anchor.0);
    f()
}

/// bfloat16: the top half of an f32. `half` converts bf16 slices one branchy element at a time;
/// these loops are plain bit arithmetic that vectorises.
struct BFloat;

impl Narrow for BFloat {
    type Bits = u16;

    fn widen(src: &[u16], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s) << 16);
        }
    }

    fn narrow(src: &[f32], dst: &mut [u16]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = f32_to_bf16_bits(x);
        }
    }
}

#[inline]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    // Adding just under half of the dropped part, plus the kept LSB, rounds to nearest-even; a
    // carry out of the mantissa correctly bumps the exponent (up to infinity).
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    // Truncating a NaN could clear every mantissa bit left; keep it a (quiet) NaN.
    let nan = (bits >> 16) | 0x40;
    (if x.is_nan() { nan } else { rounded }) as u16
}

/// fp8 E4M3 ("E4M3FN"): bias 7, no infinities, NaN = S.1111.111, largest finite 448.
struct E4M3;

impl Narrow for E4M3 {
    type Bits = u8;

    fn widen(src: &[u8], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = E4M3_TO_F32[usize::from(s)];
        }
    }

    fn narrow(src: &[f32], dst: &mut [u8]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = f32_to_fp8e4m3(x);
        }
    }
}

/// fp8 E5M2: bias 15, IEEE-like with infinities, largest finite 57344.
struct E5M2;

impl Narrow for E5M2 {
    type Bits = u8;

    fn widen(src: &[u8], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = E5M2_TO_F32[usize::from(s)];
        }
    }

    fn narrow(src: &[f32], dst: &mut [u8]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = f32_to_fp8e5m2(x);
        }
    }
}

/// `op(round(sx * a), round(sb * b))`, computed in f32 and rounded to `F` once at the end.
struct NarrowCombine<F, O> {
    sx: Option<f32>,
    sb: Option<f32>,
    types: PhantomData<(F, O)>,
}

impl<F: Narrow, O: Op<f32>> NarrowCombine<F, O> {
    fn new(sx: Option<f32>, sb: Option<f32>) -> Self {
        NarrowCombine {
            sx,
            sb,
            types: PhantomData,
        }
    }

    /// `x = op(x, y)` on one widened block.
    fn combine(&self, x: &mut [f32], y: &mut [f32]) {
        premultiply::<F>(x, self.sx);
        premultiply::<F>(y, self.sb);
        for (x, &y) in x.iter_mut().zip(y.iter()) {
            *x = O::apply(*x, y);
        }
    }
}

fn premultiply<F: Narrow>(v: &mut [f32], s: Option<f32>) {
    if let Some(s) = s {
        for x in v.iter_mut() {
            *x *= s;
        }
        F::round(v);
    }
}

impl<F: Narrow, O: Op<f32>> Binary<F::Bits> for NarrowCombine<F, O> {
    fn apply(&self, dst: &mut [F::Bits], a: &[F::Bits], b: &[F::Bits]) {
        let (mut wa, mut wb) = ([0f32; BLOCK], [0f32; BLOCK]);
        for ((d, x), y) in dst
            .chunks_mut(BLOCK)
            .zip(a.chunks(BLOCK))
            .zip(b.chunks(BLOCK))
        {
            let (wa, wb) = (&mut wa[..d.len()], &mut wb[..d.len()]);
            F::widen(x, wa);
            F::widen(y, wb);
            self.combine(wa, wb);
            F::narrow(wa, d);
        }
    }

    fn apply_in_place(&self, acc: &mut [F::Bits], b: &[F::Bits]) {
        let (mut wa, mut wb) = ([0f32; BLOCK], [0f32; BLOCK]);
        for (x, y) in acc.chunks_mut(BLOCK).zip(b.chunks(BLOCK)) {
            let (wa, wb) = (&mut wa[..x.len()], &mut wb[..x.len()]);
            F::widen(x, wa);
            F::widen(y, wb);
            self.combine(wa, wb);
            F::narrow(wa, x);
        }
    }
}

/// `f(x)` for each element, computed in f32 and rounded to `F` once.
struct NarrowMap<F, M>(M, PhantomData<F>);

impl<F: Narrow, M: Fn(f32) -> f32> Unary<F::Bits> for NarrowMap<F, M> {
    fn apply(&self, dst: &mut [F::Bits], src: &[F::Bits]) {
        let mut w = [0f32; BLOCK];
        for (d, x) in dst.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
            let w = &mut w[..d.len()];
            F::widen(x, w);
            w.iter_mut().for_each(|v| *v = (self.0)(*v));
            F::narrow(w, d);
        }
    }

    fn apply_in_place(&self, buf: &mut [F::Bits]) {
        let mut w = [0f32; BLOCK];
        for x in buf.chunks_mut(BLOCK) {
            let w = &mut w[..x.len()];
            F::widen(x, w);
            w.iter_mut().for_each(|v| *v = (self.0)(*v));
            F::narrow(w, x);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// fp8 conversions
// ---------------------------------------------------------------------------------------------

/// Decoding an fp8 byte is one load from a table computed at compile time: cheaper than the
/// arithmetic, which at SSE2 width vectorises only four lanes at a time.
static E4M3_TO_F32: [f32; 256] = fp8_table::<3, 7>(0x7f);
static E5M2_TO_F32: [f32; 256] = fp8_table::<2, 15>(0x7c);

const fn fp8_table<const MAN: u32, const BIAS: u32>(special_from: u32) -> [f32; 256] {
    let mut table = [0.0; 256];
    let mut v = 0;
    while v < 256 {
        table[v] = fp8_to_f32::<MAN, BIAS>(v as u32, special_from);
        v += 1;
    }
    table
}

/// The value of an fp8 byte with `MAN` fraction bits and exponent bias `BIAS`. Magnitudes from
/// `special_from` up are infinity (fraction zero) or NaN: 0x7c for E5M2, which is IEEE-like, and
/// 0x7f for E4M3FN, whose only special encoding is S.1111.111 = NaN.
const fn fp8_to_f32<const MAN: u32, const BIAS: u32>(v: u32, special_from: u32) -> f32 {
    let sign = (v & 0x80) << 24;
    let mag = v & 0x7f;
    let shifted = mag << (23 - MAN);
    let bits = if mag >= special_from {
        shifted | 0x7f80_0000
    } else if mag < (1 << MAN) {
        // Subnormal: fraction * 2^(1-BIAS-MAN), exact in f32.
        (mag as f32 * f32::from_bits((127 + 1 - BIAS - MAN) << 23)).to_bits()
    } else {
        shifted + ((127 - BIAS) << 23)
    };
    f32::from_bits(sign | bits)
}

/// Narrows f32 to fp8 with `MAN` fraction bits and exponent bias `BIAS`, rounding to
/// nearest-even. Magnitudes from `max` up (infinity included) saturate to `max`, encoded as
/// `max_code`; NaN becomes NaN (0x7f with the sign kept). Arithmetic plus selects, without early
/// returns, so that loops over it vectorise.
#[inline]
fn f32_to_fp8<const MAN: u32, const BIAS: u32>(x: f32, max: f32, max_code: u32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7fff_ffff;

    // Normal range: round the f32 mantissa at our last fraction bit (half-minus-one plus the
    // kept LSB makes ties go to even; a carry correctly bumps the exponent), then move the
    // exponent from f32's bias to ours.
    let shift = 23 - MAN;
    let normal = ((abs + ((1 << (shift - 1)) - 1) + ((abs >> shift) & 1)) >> shift)
        .wrapping_sub((127 - BIAS) << MAN);

    // Subnormal range: the step is a fixed 2^(1-BIAS-MAN). Adding a power of two whose f32 ulp
    // is exactly that step makes the FPU do the round-to-nearest-even; the low bits of the sum
    // then count steps (reaching the smallest normal encoding when it rounds up).
    let magic = f32::from_bits((127 - BIAS + 23 - MAN + 1) << 23);
    let subnormal = (f32::from_bits(abs) + magic)
        .to_bits()
        .wrapping_sub(magic.to_bits());

    let min_normal = (127 + 1 - BIAS) << 23;
    let mag = if abs > 0x7f80_0000 {
        0x7f
    } else if abs >= max.to_bits() {
        max_code
    } else if abs < min_normal {
        subnormal
    } else {
        normal
    };
    (sign | mag) as u8
}

/// f32 to fp8 E4M3 with round-to-nearest-even; beyond ±448 (infinities included) saturates to
/// ±448, NaN gives NaN.
#[inline]
pub(crate) fn f32_to_fp8e4m3(x: f32) -> u8 {
    f32_to_fp8::<3, 7>(x, 448.0, 0x7e)
}

/// fp8 E4M3 to f32 (exact).
#[cfg(test)]
#[inline]
pub(crate) fn fp8e4m3_to_f32(v: u8) -> f32 {
    E4M3_TO_F32[usize::from(v)]
}

/// f32 to fp8 E5M2 with round-to-nearest-even; beyond ±57344 (infinities included) saturates
/// to ±57344, NaN gives NaN.
#[inline]
pub(crate) fn f32_to_fp8e5m2(x: f32) -> u8 {
    f32_to_fp8::<2, 15>(x, 57344.0, 0x7b)
}

/// fp8 E5M2 to f32 (exact; the infinity encodings give infinities).
#[cfg(test)]
#[inline]
pub(crate) fn fp8e5m2_to_f32(v: u8) -> f32 {
    E5M2_TO_F32[usize::from(v)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    // ---- Independent references: formulas in f64, no bit tricks shared with the kernels ----

    fn pow2(e: i32) -> f64 {
        f64::from_bits(((1023 + e) as u64) << 52)
    }

    /// Value of an IEEE-style binary format (f16, bf16, e5m2) from its bits.
    fn ieee_value(bits: u64, exp_bits: u32, man_bits: u32) -> f64 {
        let sign = if (bits >> (exp_bits + man_bits)) & 1 == 1 {
            -1.0
        } else {
            1.0
        };
        let e = ((bits >> man_bits) & ((1 << exp_bits) - 1)) as i32;
        let m = (bits & ((1 << man_bits) - 1)) as f64;
        let bias = (1 << (exp_bits - 1)) - 1;
        let e_max = (1 << exp_bits) - 1;
        if e == e_max {
            return if m == 0.0 {
                sign * f64::INFINITY
            } else {
                f64::NAN
            };
        }
        if e == 0 {
            sign * m * pow2(1 - bias - man_bits as i32)
        } else {
            sign * (pow2(man_bits as i32) + m) * pow2(e - bias - man_bits as i32)
        }
    }

    /// Value of an E4M3FN byte: no infinities, only S.1111.111 is NaN.
    fn e4m3_value(v: u8) -> f64 {
        let sign = if v & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((v >> 3) & 0xf);
        let m = f64::from(v & 7);
        if v & 0x7f == 0x7f {
            f64::NAN
        } else if e == 0 {
            sign * m / 8.0 * pow2(-6)
        } else {
            sign * (1.0 + m / 8.0) * pow2(e - 7)
        }
    }

    /// Rounds `x` to nearest-even in a format with `man` fraction bits and smallest normal
    /// exponent `min_exp`; beyond `max` it saturates or overflows to infinity.
    fn round_to(x: f64, man: i32, min_exp: i32, max: f64, saturate: bool) -> f64 {
        if x.is_nan() || x == 0.0 {
            return x;
        }
        let beyond = if saturate { max } else { f64::INFINITY };
        if x.is_infinite() {
            return beyond.copysign(x);
        }
        let e = (((x.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(min_exp);
        let q = pow2(e - man);
        let r = (x / q).round_ties_even() * q;
        if r.abs() > max {
            beyond.copysign(x)
        } else {
            r
        }
    }

    fn round(dtype: DataType, x: f64) -> f64 {
        match dtype {
            DataType::Float32 => x as f32 as f64,
            DataType::Float64 => x,
            DataType::Float16 => round_to(x, 10, -14, 65504.0, false),
            DataType::Bfloat16 => round_to(x, 7, -126, (2.0 - pow2(-7)) * pow2(127), false),
            DataType::Float8e4m3 => round_to(x, 3, -6, 448.0, true),
            DataType::Float8e5m2 => round_to(x, 2, -14, 57344.0, true),
            _ => unreachable!("{} is not a float", dtype.name()),
        }
    }

    fn float_at(dtype: DataType, b: &[u8]) -> f64 {
        match dtype {
            DataType::Float32 => f64::from(f32::from_ne_bytes(b.try_into().unwrap())),
            DataType::Float64 => f64::from_ne_bytes(b.try_into().unwrap()),
            DataType::Float16 => {
                ieee_value(u16::from_ne_bytes(b.try_into().unwrap()).into(), 5, 10)
            }
            DataType::Bfloat16 => {
                ieee_value(u16::from_ne_bytes(b.try_into().unwrap()).into(), 8, 7)
            }
            DataType::Float8e4m3 => e4m3_value(b[0]),
            DataType::Float8e5m2 => ieee_value(b[0].into(), 5, 2),
            _ => unreachable!("{} is not a float", dtype.name()),
        }
    }

    /// Integers widened to i128 with their own signedness.
    fn int_at(dtype: DataType, b: &[u8]) -> i128 {
        match dtype {
            DataType::Int8 => i128::from(b[0] as i8),
            DataType::Uint8 => i128::from(b[0]),
            DataType::Int32 => i128::from(i32::from_ne_bytes(b.try_into().unwrap())),
            DataType::Uint32 => i128::from(u32::from_ne_bytes(b.try_into().unwrap())),
            DataType::Int64 => i128::from(i64::from_ne_bytes(b.try_into().unwrap())),
            DataType::Uint64 => i128::from(u64::from_ne_bytes(b.try_into().unwrap())),
            _ => unreachable!("{} is not an integer", dtype.name()),
        }
    }

    /// Reduces an i128 modulo the width of `dtype`, as the type would hold it.
    fn wrap(dtype: DataType, v: i128) -> i128 {
        match dtype {
            DataType::Int8 => i128::from(v as i8),
            DataType::Uint8 => i128::from(v as u8),
            DataType::Int32 => i128::from(v as i32),
            DataType::Uint32 => i128::from(v as u32),
            DataType::Int64 => i128::from(v as i64),
            DataType::Uint64 => i128::from(v as u64),
            _ => unreachable!(),
        }
    }

    fn int_bytes(dtype: DataType, v: i128) -> Vec<u8> {
        v.to_le_bytes()[..dtype.size()].to_vec()
    }

    fn float_bytes(dtype: DataType, x: f64) -> Vec<u8> {
        match dtype {
            DataType::Float32 => (x as f32).to_ne_bytes().to_vec(),
            DataType::Float64 => x.to_ne_bytes().to_vec(),
            DataType::Float16 => half::f16::from_f64(x).to_bits().to_ne_bytes().to_vec(),
            DataType::Bfloat16 => bf16::from_f64(x).to_bits().to_ne_bytes().to_vec(),
            DataType::Float8e4m3 => vec![f32_to_fp8e4m3(x as f32)],
            DataType::Float8e5m2 => vec![f32_to_fp8e5m2(x as f32)],
            _ => unreachable!(),
        }
    }

    #[derive(Clone, Copy, Debug)]
    enum Value {
        Int(i128),
        Float(f64),
    }

    fn ops(dtype: DataType) -> &'static [ReduceOp] {
        use ReduceOp::*;
        if dtype.is_float() {
            &[Sum, Prod, Max, Min]
        } else {
            &[Sum, Prod, Max, Min, BitAnd, BitOr, BitXor]
        }
    }

    fn reference_binary(
        dtype: DataType,
        op: ReduceOp,
        a: &[u8],
        sa: Option<Scale>,
        b: &[u8],
        sb: Option<Scale>,
    ) -> Vec<Value> {
        let w = dtype.size();
        let pairs = a.chunks(w).zip(b.chunks(w));
        if dtype.is_float() {
            let pre = |v: f64, s: Option<Scale>| match s {
                None => v,
                Some(s) => round(dtype, float_at(dtype, &s.0[..w]) * v),
            };
            pairs
                .map(|(x, y)| {
                    let x = pre(float_at(dtype, x), sa);
                    let y = pre(float_at(dtype, y), sb);
                    let r = match op {
                        ReduceOp::Sum => x + y,
                        ReduceOp::Prod => x * y,
                        // The non-NaN one; otherwise by the total order, where -0 < +0.
                        ReduceOp::Max if x.is_nan() || y.is_nan() => x.max(y),
                        ReduceOp::Min if x.is_nan() || y.is_nan() => x.min(y),
                        ReduceOp::Max => {
                            if x.total_cmp(&y).is_ge() {
                                x
                            } else {
                                y
                            }
                        }
                        ReduceOp::Min => {
                            if x.total_cmp(&y).is_le() {
                                x
                            } else {
                                y
                            }
                        }
                        _ => unreachable!(),
                    };
                    Value::Float(round(dtype, r))
                })
                .collect()
        } else {
            let pre = |v: i128, s: Option<Scale>| match s {
                None => v,
                Some(s) => wrap(dtype, int_at(dtype, &s.0[..w]).wrapping_mul(v)),
            };
            pairs
                .map(|(x, y)| {
                    let x = pre(int_at(dtype, x), sa);
                    let y = pre(int_at(dtype, y), sb);
                    let r = match op {
                        ReduceOp::Sum => x.wrapping_add(y),
                        ReduceOp::Prod => x.wrapping_mul(y),
                        ReduceOp::Max => x.max(y),
                        ReduceOp::Min => x.min(y),
                        ReduceOp::BitAnd => x & y,
                        ReduceOp::BitOr => x | y,
                        ReduceOp::BitXor => x ^ y,
                    };
                    Value::Int(wrap(dtype, r))
                })
                .collect()
        }
    }

    /// Checks `out` element by element, bit for bit but for a NaN's payload.
    fn check(dtype: DataType, out: &[u8], expect: &[Value], what: &str) {
        let w = dtype.size();
        assert_eq!(out.len(), expect.len() * w, "{what}: length");
        for (i, (o, e)) in out.chunks(w).zip(expect).enumerate() {
            match *e {
                Value::Int(e) => {
                    let got = int_at(dtype, o);
                    assert_eq!(got, e, "{what}: element {i}");
                }
                Value::Float(e) => {
                    let got = float_at(dtype, o);
                    let ok = (got.is_nan() && e.is_nan()) || got.to_bits() == e.to_bits();
                    assert!(
                        ok,
                        "{what}: element {i}: got {got:e} ({o:02x?}), expected {e:e}"
                    );
                }
            }
        }
    }

    // ---- Test data ----

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            // splitmix64
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        /// A float of moderate size with a few specials mixed in.
        fn float(&mut self) -> f64 {
            const SPECIAL: [f64; 8] = [
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                0.0,
                -0.0,
                1.0e-40,
                3.0e38,
                1.0,
            ];
            match self.below(16) {
                0 => SPECIAL[self.below(8) as usize],
                1 => self.below(20) as f64 - 10.0,
                _ => {
                    let m = 1.0 + (self.next() >> 11) as f64 * pow2(-53);
                    let sign = if self.below(2) == 0 { 1.0 } else { -1.0 };
                    sign * m * pow2(self.below(24) as i32 - 12)
                }
            }
        }
    }

    fn random_elements(dtype: DataType, n: usize, rng: &mut Rng) -> Vec<u8> {
        let w = dtype.size();
        let mut out = Vec::with_capacity(n * w);
        for _ in 0..n {
            let raw = rng.next().to_le_bytes();
            let bytes = match dtype {
                // Raw bits cover every encoding, NaNs and infinities included.
                DataType::Float8e4m3 | DataType::Float8e5m2 => raw[..1].to_vec(),
                DataType::Float16 | DataType::Bfloat16 if rng.below(2) == 0 => raw[..2].to_vec(),
                DataType::Float16 | DataType::Bfloat16 | DataType::Float32 | DataType::Float64 => {
                    float_bytes(dtype, rng.float())
                }
                _ if rng.below(4) == 0 => int_bytes(dtype, rng.below(9) as i128 - 4),
                _ => raw[..w].to_vec(),
            };
            out.extend_from_slice(&bytes);
        }
        out
    }

    fn random_scale(dtype: DataType, rng: &mut Rng) -> Scale {
        const FACTORS: [f64; 6] = [0.5, -1.25, 3.0, 0.1, 1.0 / 3.0, 7.5e-3];
        let bytes = if dtype.is_float() {
            float_bytes(dtype, FACTORS[rng.below(6) as usize])
        } else {
            random_elements(dtype, 1, rng)
        };
        Scale::from_bytes(dtype, &bytes)
    }

    /// Bytes starting `offset` bytes past an 8-byte boundary, so that offset 0 is aligned for
    /// every datatype and offset 1 for none wider than a byte.
    struct Buf {
        words: Vec<u64>,
        offset: usize,
        len: usize,
    }

    impl Buf {
        fn new(bytes: &[u8], offset: usize) -> Buf {
            let mut buf = Buf {
                words: vec![0; bytes.len() / 8 + 2],
                offset,
                len: bytes.len(),
            };
            buf.bytes_mut().copy_from_slice(bytes);
            buf
        }

        fn bytes(&self) -> &[u8] {
            &bytemuck::cast_slice(&self.words)[self.offset..self.offset + self.len]
        }

        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut bytemuck::cast_slice_mut(&mut self.words)[self.offset..self.offset + self.len]
        }
    }

    const LENGTHS: [usize; 5] = [0, 1, 7, 1000, 4099];

    fn scale_choices(dtype: DataType, rng: &mut Rng) -> [(Option<Scale>, Option<Scale>); 4] {
        let (s, t) = (random_scale(dtype, rng), random_scale(dtype, rng));
        [
            (None, None),
            (Some(s), None),
            (None, Some(t)),
            (Some(s), Some(t)),
        ]
    }

    // ---- Every datatype x every op ----

    /// Max and min of zeros of both signs, and of a NaN and a number, come out the same
    /// whatever the operands' order, the buffer's length (scalar loops, vectorised ones and
    /// their tails), its alignment and the kernel (separate, in place, twice, small): +0 for
    /// max, -0 for min, the number beside a NaN. Ranks fold their inputs in rank order but in
    /// pieces of lengths of their own, so anything else gives ranks different bits.
    #[test]
    fn max_and_min_of_signed_zeros_and_nans_do_not_depend_on_order_or_length() {
        let floats = DataType::ALL.into_iter().filter(|d| d.is_float());
        for dtype in floats {
            let w = dtype.size();
            // Pairs (x[i], y[i]) cycle through these, each order of each pair appearing.
            let pairs = [
                (-0.0, 0.0),
                (0.0, -0.0),
                (f64::NAN, 2.0),
                (2.0, f64::NAN),
                (-0.0, -0.0),
            ];
            let (max_of, min_of) = ([0.0, 0.0, 2.0, 2.0, -0.0], [-0.0, -0.0, 2.0, 2.0, -0.0]);
            for len in (1..=70).chain([255, 256, 257, 1000]) {
                let at = |v: &[f64], i: usize| float_bytes(dtype, v[i % v.len()]);
                let xs: Vec<f64> = pairs.iter().map(|p| p.0).collect();
                let ys: Vec<f64> = pairs.iter().map(|p| p.1).collect();
                let x: Vec<u8> = (0..len).flat_map(|i| at(&xs, i)).collect();
                let y: Vec<u8> = (0..len).flat_map(|i| at(&ys, i)).collect();
                for (op, want) in [(ReduceOp::Max, &max_of), (ReduceOp::Min, &min_of)] {
                    let r = Reducer::new(dtype, op);
                    let expect: Vec<Value> = (0..len)
                        .map(|i| Value::Float(want[i % want.len()]))
                        .collect();
                    let what = format!("{} {} of {len}", dtype.name(), op.name());
                    for (first, second) in [(&x, &y), (&y, &x)] {
                        for o in [0, 1] {
                            let (a, b) = (Buf::new(first, o), Buf::new(second, 1 - o));
                            let mut dst = Buf::new(&vec![0x77; len * w], o);
                            r.reduce(dst.bytes_mut(), a.bytes(), None, b.bytes(), None);
                            check(dtype, dst.bytes(), &expect, &format!("{what} reduce"));
                            let mut acc = Buf::new(first, o);
                            r.reduce_in_place(acc.bytes_mut(), None, b.bytes(), None);
                            check(dtype, acc.bytes(), &expect, &format!("{what} in place"));
                            let mut also = Buf::new(&vec![0x77; len * w], 1 - o);
                            r.reduce_twice(
                                dst.bytes_mut(),
                                also.bytes_mut(),
                                a.bytes(),
                                None,
                                b.bytes(),
                                None,
                            );
                            check(dtype, dst.bytes(), &expect, &format!("{what} twice"));
                            check(dtype, also.bytes(), &expect, &format!("{what} also"));
                            let d = dst.bytes_mut().as_mut_ptr();
                            let (pa, pb) = (a.bytes().as_ptr(), b.bytes().as_ptr());
                            // SAFETY: all three hold len elements; dst is apart from a and b.
                            if unsafe { small(r, d, pa, pb, len * w) } {
                                check(dtype, dst.bytes(), &expect, &format!("{what} small"));
                            }
                        }
                    }
                }
            }
        }
    }

    /// The small path gives the general kernels' bits for every native type and op at every
    /// length it takes, separate and in place, and declines what it does not take: longer
    /// inputs, narrow floats, bitwise ops on floats.
    #[test]
    fn small_reductions_match_the_general_kernels() {
        let mut rng = Rng(9);
        for dtype in DataType::ALL {
            let w = dtype.size();
            for &op in ops(dtype) {
                let r = Reducer::new(dtype, op);
                for n in 1..=SMALL / w + 1 {
                    let (a, b) = (
                        random_elements(dtype, n, &mut rng),
                        random_elements(dtype, n, &mut rng),
                    );
                    let mut general = vec![0u8; n * w];
                    binary(
                        r,
                        Operands::Separate {
                            dst: &mut general,
                            src: &a,
                        },
                        None,
                        &b,
                        None,
                    );
                    let mut out = vec![0x5au8; n * w];
                    // SAFETY: all three hold n elements; out is apart from a and b.
                    let took = unsafe { small(r, out.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n * w) };
                    let native = !matches!(
                        dtype,
                        DataType::Float16
                            | DataType::Bfloat16
                            | DataType::Float8e4m3
                            | DataType::Float8e5m2
                    );
                    let what = format!("{} {} of {n}", dtype.name(), op.name());
                    assert_eq!(took, native && n * w <= SMALL, "{what}: taken");
                    if !took {
                        continue;
                    }
                    assert_eq!(out, general, "{what}: separate");
                    let mut acc = a.clone();
                    let at = acc.as_mut_ptr();
                    // SAFETY: acc and b hold n elements; acc is both input and output.
                    assert!(unsafe { small(r, at, at, b.as_ptr(), n * w) });
                    assert_eq!(acc, general, "{what}: in place");
                }
            }
        }
        let f = Reducer::new(DataType::Float32, ReduceOp::BitAnd);
        let (x, mut y) = ([0u8; 8], [0u8; 8]);
        // SAFETY: two f32 each.
        assert!(!unsafe { small(f, y.as_mut_ptr(), x.as_ptr(), x.as_ptr(), 8) });
    }

    #[test]
    fn reduce_matches_reference() {
        let mut rng = Rng(1);
        for dtype in DataType::ALL {
            for &op in ops(dtype) {
                let r = Reducer::new(dtype, op);
                for len in LENGTHS {
                    let a = random_elements(dtype, len, &mut rng);
                    let b = random_elements(dtype, len, &mut rng);
                    for (sa, sb) in scale_choices(dtype, &mut rng) {
                        let expect = reference_binary(dtype, op, &a, sa, &b, sb);
                        let what = format!(
                            "{}/{} len {len} scales {sa:?} {sb:?}",
                            dtype.name(),
                            op.name()
                        );
                        for (od, oa, ob) in [(0, 0, 0), (1, 1, 1), (0, 1, 0), (1, 0, 1)] {
                            let mut dst = Buf::new(&vec![0xa5; a.len()], od);
                            let (ba, bb) = (Buf::new(&a, oa), Buf::new(&b, ob));
                            r.reduce(dst.bytes_mut(), ba.bytes(), sa, bb.bytes(), sb);
                            let what = format!("{what} reduce offsets {od}{oa}{ob}");
                            check(dtype, dst.bytes(), &expect, &what);
                            let mut also = Buf::new(&vec![0x3c; a.len()], 1 - od);
                            dst = Buf::new(&vec![0xa5; a.len()], od);
                            r.reduce_twice(
                                dst.bytes_mut(),
                                also.bytes_mut(),
                                ba.bytes(),
                                sa,
                                bb.bytes(),
                                sb,
                            );
                            let what = format!("{what} reduce_twice");
                            check(dtype, dst.bytes(), &expect, &format!("{what} streamed"));
                            check(dtype, also.bytes(), &expect, &format!("{what} also"));
                        }
                        for (oa, ob) in [(0, 0), (1, 1), (0, 1), (1, 0)] {
                            let (mut acc, bb) = (Buf::new(&a, oa), Buf::new(&b, ob));
                            r.reduce_in_place(acc.bytes_mut(), sa, bb.bytes(), sb);
                            let what = format!("{what} reduce_in_place offsets {oa}{ob}");
                            check(dtype, acc.bytes(), &expect, &what);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn scale_matches_reference() {
        let mut rng = Rng(2);
        for dtype in DataType::ALL {
            let r = Reducer::new(dtype, ReduceOp::Sum);
            let w = dtype.size();
            for len in LENGTHS {
                let src = random_elements(dtype, len, &mut rng);
                let s = random_scale(dtype, &mut rng);
                let expect: Vec<Value> = src
                    .chunks(w)
                    .map(|x| {
                        if dtype.is_float() {
                            Value::Float(round(
                                dtype,
                                float_at(dtype, &s.0[..w]) * float_at(dtype, x),
                            ))
                        } else {
                            let p = int_at(dtype, &s.0[..w]).wrapping_mul(int_at(dtype, x));
                            Value::Int(wrap(dtype, p))
                        }
                    })
                    .collect();
                let what = format!("{} len {len} scale {s:?}", dtype.name());
                for (od, os) in [(0, 0), (1, 1), (0, 1), (1, 0)] {
                    let mut dst = Buf::new(&vec![0x5a; src.len()], od);
                    r.scale(dst.bytes_mut(), Buf::new(&src, os).bytes(), s);
                    check(
                        dtype,
                        dst.bytes(),
                        &expect,
                        &format!("{what} scale {od}{os}"),
                    );
                }
                for o in [0, 1] {
                    let mut buf = Buf::new(&src, o);
                    r.scale_in_place(buf.bytes_mut(), s);
                    check(
                        dtype,
                        buf.bytes(),
                        &expect,
                        &format!("{what} scale_in_place {o}"),
                    );
                }
            }
        }
    }

    #[test]
    fn divide_matches_reference() {
        let mut rng = Rng(3);
        for dtype in DataType::ALL {
            let r = Reducer::new(dtype, ReduceOp::Sum);
            let w = dtype.size();
            for len in LENGTHS {
                let src = random_elements(dtype, len, &mut rng);
                for n in [1, 2, 3, 7, 128, 200, 1000] {
                    let expect: Vec<Value> = src
                        .chunks(w)
                        .map(|x| {
                            if dtype.is_float() {
                                Value::Float(round(dtype, float_at(dtype, x) / n as f64))
                            } else {
                                Value::Int(int_at(dtype, x) / n as i128)
                            }
                        })
                        .collect();
                    for o in [0, 1] {
                        let mut buf = Buf::new(&src, o);
                        r.divide_in_place(buf.bytes_mut(), n);
                        let what = format!("{} len {len} / {n} offset {o}", dtype.name());
                        check(dtype, buf.bytes(), &expect, &what);
                    }
                }
            }
        }
    }

    // ---- Hand-checked cases ----

    fn reduce_ints<T: Pod>(dtype: DataType, op: ReduceOp, a: &[T], b: &[T]) -> Vec<T> {
        let mut out = vec![T::zeroed(); a.len()];
        Reducer::new(dtype, op).reduce(
            bytemuck::cast_slice_mut(&mut out),
            bytemuck::cast_slice(a),
            None,
            bytemuck::cast_slice(b),
            None,
        );
        out
    }

    #[test]
    fn integer_overflow_wraps() {
        use DataType::*;
        use ReduceOp::*;
        assert_eq!(
            reduce_ints::<i8>(Int8, Sum, &[127, -128], &[1, -1]),
            [-128, 127]
        );
        assert_eq!(reduce_ints::<u8>(Uint8, Sum, &[200, 0], &[100, 0]), [44, 0]);
        assert_eq!(reduce_ints::<u8>(Uint8, Prod, &[16], &[16]), [0]);
        assert_eq!(reduce_ints::<u32>(Uint32, Sum, &[u32::MAX], &[2]), [1]);
        assert_eq!(
            reduce_ints::<i32>(Int32, Prod, &[65536, -65537], &[65536, 65537]),
            [0, -131073]
        );
        assert_eq!(
            reduce_ints::<i64>(Int64, Sum, &[i64::MAX], &[1]),
            [i64::MIN]
        );
        assert_eq!(reduce_ints::<i64>(Int64, Prod, &[i64::MAX], &[2]), [-2]);
        assert_eq!(
            reduce_ints::<u64>(Uint64, Prod, &[u64::MAX], &[u64::MAX]),
            [1]
        );
        assert_eq!(reduce_ints::<i8>(Int8, Max, &[-1, 5], &[1, -128]), [1, 5]);
        assert_eq!(
            reduce_ints::<u8>(Uint8, Max, &[255, 5], &[1, 128]),
            [255, 128]
        );

        let mut buf = [100i8, -100];
        Reducer::new(Int8, Sum).scale_in_place(
            bytemuck::cast_slice_mut(&mut buf),
            Scale([2, 0, 0, 0, 0, 0, 0, 0]),
        );
        assert_eq!(buf, [-56, 56]);
    }

    #[test]
    fn integer_divide_truncates_toward_zero() {
        let mut v = [-7i32, 7, -1, i32::MIN, 6];
        Reducer::new(DataType::Int32, ReduceOp::Sum)
            .divide_in_place(bytemuck::cast_slice_mut(&mut v), 2);
        assert_eq!(v, [-3, 3, 0, -(1 << 30), 3]);

        // Rank counts too large for the type itself.
        let r = Reducer::new(DataType::Int8, ReduceOp::Sum);
        let mut v = [-128i8, 127, -100];
        r.divide_in_place(bytemuck::cast_slice_mut(&mut v), 128);
        assert_eq!(v, [-1, 0, 0]);
        let mut v = [-128i8, 127];
        r.divide_in_place(bytemuck::cast_slice_mut(&mut v), 1000);
        assert_eq!(v, [0, 0]);

        let mut v = [i64::MIN, -9];
        Reducer::new(DataType::Int64, ReduceOp::Sum)
            .divide_in_place(bytemuck::cast_slice_mut(&mut v), 4);
        assert_eq!(v, [i64::MIN / 4, -2]);
    }

    #[test]
    fn float_max_min_ignore_nan() {
        for dtype in DataType::ALL.into_iter().filter(|d| d.is_float()) {
            let nan = float_bytes(dtype, f64::NAN);
            let one = float_bytes(dtype, 1.0);
            let a = [nan.clone(), one.clone(), nan.clone()].concat();
            let b = [one.clone(), nan.clone(), nan.clone()].concat();
            for op in [ReduceOp::Max, ReduceOp::Min] {
                let mut out = vec![0u8; a.len()];
                Reducer::new(dtype, op).reduce(&mut out, &a, None, &b, None);
                let got: Vec<f64> = out
                    .chunks(dtype.size())
                    .map(|x| float_at(dtype, x))
                    .collect();
                let what = format!("{} {}", dtype.name(), op.name());
                assert_eq!(&got[..2], &[1.0, 1.0], "{what}");
                assert!(got[2].is_nan(), "{what}: max/min of two NaNs");
            }
            // A NaN still poisons a sum.
            let mut out = vec![0u8; nan.len()];
            Reducer::new(dtype, ReduceOp::Sum).reduce(&mut out, &nan, None, &one, None);
            assert!(
                float_at(dtype, &out).is_nan(),
                "{} sum with NaN",
                dtype.name()
            );
        }
    }

    #[test]
    #[should_panic(expected = "bitwise op band is not defined for floating-point type float")]
    fn bitwise_on_float_panics() {
        let mut out = [0u8; 4];
        Reducer::new(DataType::Float32, ReduceOp::BitAnd)
            .reduce(&mut out, &[0; 4], None, &[0; 4], None);
    }

    #[test]
    fn reciprocal_is_correctly_rounded() {
        for n in 1..=5000usize {
            let f = Scale::reciprocal(DataType::Float32, n);
            assert_eq!(scalar::<f32>(f), 1.0 / n as f32, "f32 1/{n}");
            let d = Scale::reciprocal(DataType::Float64, n);
            assert_eq!(scalar::<f64>(d), 1.0 / n as f64, "f64 1/{n}");
        }
        for dtype in [DataType::Int8, DataType::Uint32, DataType::Int64] {
            assert_eq!(
                Scale::reciprocal(dtype, 7),
                Scale([1, 0, 0, 0, 0, 0, 0, 0]),
                "{}",
                dtype.name()
            );
        }
        // For narrow formats: no neighbouring value is nearer to 1/n (|c*n - 1| is exact in
        // f64), and on a tie the result has the even encoding.
        let narrow: [(DataType, usize); 4] = [
            (DataType::Float16, 70000),
            (DataType::Bfloat16, 5000),
            (DataType::Float8e4m3, 2000),
            (DataType::Float8e5m2, 200000),
        ];
        for (dtype, max_n) in narrow {
            let w = dtype.size();
            for n in (1..=max_n).filter(|n| *n < 3000 || n % 97 == 0) {
                let s = Scale::reciprocal(dtype, n);
                let code = u16::from_le_bytes([s.0[0], if w == 2 { s.0[1] } else { 0 }]);
                let value_of = |c: u16| float_at(dtype, &c.to_le_bytes()[..w]);
                let err = |c: u16| (value_of(c) * n as f64 - 1.0).abs();
                let what = format!("{} 1/{n}: code {code:#x}", dtype.name());
                let below = code.checked_sub(1).map_or(f64::INFINITY, err);
                let above = err(code + 1);
                assert!(err(code) <= below && err(code) <= above, "{what}");
                if err(code) == below || err(code) == above {
                    assert_eq!(code & 1, 0, "{what}: tie not to even");
                }
            }
        }
    }

    // ---- fp8 ----

    #[test]
    fn fp8_decodes_every_pattern() {
        for v in 0..=255u8 {
            let (got, want) = (f64::from(fp8e4m3_to_f32(v)), e4m3_value(v));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "e4m3 {v:#04x}: {got} vs {want}"
            );
            let (got, want) = (f64::from(fp8e5m2_to_f32(v)), ieee_value(v.into(), 5, 2));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "e5m2 {v:#04x}: {got} vs {want}"
            );
        }
        // Spot checks of the formula itself.
        assert_eq!(e4m3_value(0x7e), 448.0);
        assert_eq!(e4m3_value(0x01), pow2(-9));
        assert_eq!(e4m3_value(0x08), pow2(-6));
        assert_eq!(ieee_value(0x7b, 5, 2), 57344.0);
        assert_eq!(ieee_value(0x01, 5, 2), pow2(-16));
        assert_eq!(ieee_value(0xfc, 5, 2), f64::NEG_INFINITY);
    }

    #[test]
    fn fp8_reencodes_every_pattern() {
        for v in 0..=255u8 {
            let x = fp8e4m3_to_f32(v);
            if x.is_nan() {
                assert!(fp8e4m3_to_f32(f32_to_fp8e4m3(x)).is_nan(), "e4m3 {v:#04x}");
            } else {
                assert_eq!(f32_to_fp8e4m3(x), v, "e4m3 {v:#04x}");
            }
            let x = fp8e5m2_to_f32(v);
            if x.is_nan() {
                assert!(fp8e5m2_to_f32(f32_to_fp8e5m2(x)).is_nan(), "e5m2 {v:#04x}");
            } else if x.is_infinite() {
                assert_eq!(
                    f32_to_fp8e5m2(x),
                    (v & 0x80) | 0x7b,
                    "e5m2 {v:#04x} saturates"
                );
            } else {
                assert_eq!(f32_to_fp8e5m2(x), v, "e5m2 {v:#04x}");
            }
        }
    }

    #[test]
    fn fp8_rounds_midpoints_to_even() {
        type Codec = (fn(u8) -> f32, fn(f32) -> u8, u8, &'static str);
        let formats: [Codec; 2] = [
            (fp8e4m3_to_f32, f32_to_fp8e4m3, 0x7e, "e4m3"),
            (fp8e5m2_to_f32, f32_to_fp8e5m2, 0x7b, "e5m2"),
        ];
        for (decode, encode, max_code, name) in formats {
            for c in 0..max_code {
                let (lo, hi) = (decode(c), decode(c + 1));
                let mid = (lo + hi) / 2.0;
                assert!(
                    lo < mid && mid < hi,
                    "{name}: midpoint of {c:#04x} is exact in f32"
                );
                let even = if c % 2 == 0 { c } else { c + 1 };
                let what = format!("{name}: between {c:#04x} and {:#04x}", c + 1);
                assert_eq!(encode(mid), even, "{what}");
                assert_eq!(encode(-mid), even | 0x80, "{what}, negative");
                assert_eq!(
                    encode(f32::from_bits(mid.to_bits() - 1)),
                    c,
                    "{what}, just below"
                );
                assert_eq!(
                    encode(f32::from_bits(mid.to_bits() + 1)),
                    c + 1,
                    "{what}, just above"
                );
                assert_eq!(
                    encode(-f32::from_bits(mid.to_bits() + 1)),
                    (c + 1) | 0x80,
                    "{what}"
                );
            }
        }
    }

    #[test]
    fn fp8_saturates_and_keeps_nan() {
        for x in [
            448.0,
            448.001,
            464.0,
            479.9,
            480.0,
            512.0,
            1e10,
            f32::MAX,
            f32::INFINITY,
        ] {
            assert_eq!(f32_to_fp8e4m3(x), 0x7e, "e4m3 {x}");
            assert_eq!(f32_to_fp8e4m3(-x), 0xfe, "e4m3 -{x}");
        }
        for x in [
            57344.0,
            57345.0,
            61440.0,
            65535.0,
            65536.0,
            1e10,
            f32::MAX,
            f32::INFINITY,
        ] {
            assert_eq!(f32_to_fp8e5m2(x), 0x7b, "e5m2 {x}");
            assert_eq!(f32_to_fp8e5m2(-x), 0xfb, "e5m2 -{x}");
        }
        assert_eq!(f32_to_fp8e4m3(447.0), 0x7e);
        assert_eq!(f32_to_fp8e4m3(431.0), 0x7d);
        for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001)] {
            assert!(fp8e4m3_to_f32(f32_to_fp8e4m3(nan)).is_nan());
            assert!(fp8e5m2_to_f32(f32_to_fp8e5m2(nan)).is_nan());
        }
    }

    #[test]
    fn fp8_rounds_tiny_values() {
        let p = |e: i32| pow2(e) as f32;
        // e4m3: the smallest subnormal is 2^-9; half of it is a tie that goes to (even) zero.
        assert_eq!(f32_to_fp8e4m3(p(-9)), 0x01);
        assert_eq!(f32_to_fp8e4m3(p(-10)), 0x00);
        assert_eq!(f32_to_fp8e4m3(-p(-10)), 0x80);
        assert_eq!(f32_to_fp8e4m3(p(-10) * 1.001), 0x01);
        assert_eq!(f32_to_fp8e4m3(3.0 * p(-10)), 0x02);
        assert_eq!(
            f32_to_fp8e4m3(p(-6) - p(-10)),
            0x08,
            "rounds up into the normal range"
        );
        assert_eq!(f32_to_fp8e4m3(p(-6) - p(-10) * 1.001), 0x07);
        assert_eq!(f32_to_fp8e4m3(f32::MIN_POSITIVE), 0x00);
        assert_eq!(f32_to_fp8e4m3(f32::from_bits(1)), 0x00);
        assert_eq!(f32_to_fp8e4m3(-f32::from_bits(1)), 0x80);
        assert_eq!(f32_to_fp8e4m3(0.0), 0x00);
        assert_eq!(f32_to_fp8e4m3(-0.0), 0x80);
        // e5m2: the smallest subnormal is 2^-16.
        assert_eq!(f32_to_fp8e5m2(p(-16)), 0x01);
        assert_eq!(f32_to_fp8e5m2(p(-17)), 0x00);
        assert_eq!(f32_to_fp8e5m2(p(-17) * 1.001), 0x01);
        assert_eq!(f32_to_fp8e5m2(3.0 * p(-17)), 0x02);
        assert_eq!(f32_to_fp8e5m2(p(-14) - p(-17)), 0x04);
        assert_eq!(f32_to_fp8e5m2(f32::from_bits(1)), 0x00);
        assert_eq!(f32_to_fp8e5m2(-0.0), 0x80);
    }

    // ---- f16 / bf16 ----

    fn narrow_bits<F: Narrow<Bits = u16>>(x: f32) -> u16 {
        let mut out = [0u16];
        F::narrow(&[x], &mut out);
        out[0]
    }

    #[test]
    fn half_and_bfloat_round_trip() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut wide = vec![0f32; all.len()];
        let mut back = vec![0u16; all.len()];
        for (name, exp_bits, man_bits, is_bf) in [("f16", 5, 10, false), ("bf16", 8, 7, true)] {
            if is_bf {
                BFloat::widen(&all, &mut wide);
                BFloat::narrow(&wide, &mut back);
            } else {
                Half::widen(&all, &mut wide);
                Half::narrow(&wide, &mut back);
            }
            for ((&v, &x), &r) in all.iter().zip(&wide).zip(&back) {
                let want = ieee_value(v.into(), exp_bits, man_bits);
                let x = f64::from(x);
                if want.is_nan() {
                    assert!(x.is_nan(), "{name} {v:#06x} widens to NaN");
                    assert!(
                        ieee_value(r.into(), exp_bits, man_bits).is_nan(),
                        "{name} {v:#06x} stays NaN"
                    );
                } else {
                    assert_eq!(x.to_bits(), want.to_bits(), "{name} {v:#06x} widens");
                    assert_eq!(r, v, "{name} {v:#06x} narrows back");
                }
            }
        }
    }

    #[test]
    fn half_and_bfloat_round_to_nearest_even() {
        let p = |e: i32| pow2(e) as f32;
        assert_eq!(narrow_bits::<Half>(1.0 + p(-11)), 0x3c00);
        assert_eq!(narrow_bits::<Half>(1.0 + 3.0 * p(-11)), 0x3c02);
        assert_eq!(narrow_bits::<Half>(1.0 + p(-11) + p(-20)), 0x3c01);
        assert_eq!(narrow_bits::<Half>(65519.0), 0x7bff);
        assert_eq!(narrow_bits::<Half>(65520.0), 0x7c00);
        assert_eq!(narrow_bits::<Half>(p(-25)), 0x0000);
        assert_eq!(narrow_bits::<Half>(3.0 * p(-25)), 0x0002);
        assert_eq!(narrow_bits::<Half>(-p(-26)), 0x8000);

        assert_eq!(narrow_bits::<BFloat>(1.0 + p(-8)), 0x3f80);
        assert_eq!(narrow_bits::<BFloat>(1.0 + 3.0 * p(-8)), 0x3f82);
        assert_eq!(narrow_bits::<BFloat>(1.0 + p(-8) + p(-20)), 0x3f81);
        assert_eq!(narrow_bits::<BFloat>(f32::MAX), 0x7f80);
        assert_eq!(narrow_bits::<BFloat>(-f32::from_bits(1)), 0x8000);
        assert_eq!(narrow_bits::<BFloat>(f32::from_bits(0x0000_8001)), 0x0001);
        let nan = narrow_bits::<BFloat>(f32::from_bits(0x7f80_0001));
        assert!(
            nan & 0x7f80 == 0x7f80 && nan & 0x7f != 0,
            "NaN with only low bits set stays NaN"
        );

        // Against `half`'s own scalar conversion on arbitrary bit patterns.
        let mut rng = Rng(4);
        for _ in 0..200_000 {
            let x = f32::from_bits(rng.next() as u32);
            let (ours, theirs) = (narrow_bits::<BFloat>(x), bf16::from_f32(x).to_bits());
            if x.is_nan() {
                assert!(bf16::from_bits(ours).is_nan(), "{x:e}");
            } else {
                assert_eq!(ours, theirs, "bf16 of {x:e}");
            }
        }
    }

    #[inline(never)]
    fn stack_address() -> usize {
        let probe = [0u8; 32];
        std::hint::black_box(&probe).as_ptr() as usize
    }

    #[inline(never)]
    fn anchored_at_depth<const PAD: usize>() -> usize {
        let pad = [0u8; PAD];
        std::hint::black_box(&pad);
        below_page_boundary(stack_address)
    }

    #[test]
    fn f16_conversions_run_just_below_a_page_boundary() {
        // Whatever the caller's depth, the anchored callee's locals sit within a small distance
        // under a page boundary, so none of them can straddle one.
        let addrs = [
            anchored_at_depth::<0>(),
            anchored_at_depth::<700>(),
            anchored_at_depth::<1500>(),
            anchored_at_depth::<2300>(),
            anchored_at_depth::<3100>(),
            anchored_at_depth::<3900>(),
        ];
        for a in addrs {
            let to_boundary = 4096 - a % 4096;
            assert!(
                (32..512).contains(&to_boundary),
                "local at {a:#x}, {to_boundary} below a page boundary"
            );
        }
    }

    // ---- Throughput (run by hand: cargo test --release -- --ignored --nocapture) ----

    #[test]
    #[ignore = "prints throughput; run in release by hand"]
    fn throughput() {
        use std::time::Instant;
        const BYTES: usize = 32 << 20;
        let a = vec![1u64; BYTES / 8];
        let b = vec![2u64; BYTES / 8];
        let mut dst = vec![0u64; BYTES / 8];
        let (a, b) = (
            bytemuck::cast_slice::<u64, u8>(&a),
            bytemuck::cast_slice::<u64, u8>(&b),
        );
        let cases = [
            (DataType::Float32, ReduceOp::Sum),
            (DataType::Float64, ReduceOp::Sum),
            (DataType::Int32, ReduceOp::Max),
            (DataType::Float16, ReduceOp::Sum),
            (DataType::Bfloat16, ReduceOp::Sum),
            (DataType::Float8e4m3, ReduceOp::Sum),
        ];
        for (dtype, op) in cases {
            let r = Reducer::new(dtype, op);
            let dst = bytemuck::cast_slice_mut::<u64, u8>(&mut dst);
            r.reduce(dst, a, None, b, None);
            let iters = 20;
            let t = Instant::now();
            for _ in 0..iters {
                r.reduce(dst, a, None, b, None);
            }
            let out = t.elapsed().as_secs_f64() / iters as f64;
            let t = Instant::now();
            for _ in 0..iters {
                r.reduce_in_place(dst, None, b, None);
            }
            let inplace = t.elapsed().as_secs_f64() / iters as f64;
            println!(
                "{:>8} {:<4} 32 MiB: dst=a+b {:6.2} GB/s of output ({:6.2} GB/s moved); acc+=b {:6.2} GB/s of output",
                dtype.name(),
                op.name(),
                BYTES as f64 / out / 1e9,
                3.0 * BYTES as f64 / out / 1e9,
                BYTES as f64 / inplace / 1e9,
            );
        }
        // Buffers one byte off their alignment take the staged path.
        let r = Reducer::new(DataType::Float32, ReduceOp::Sum);
        let (a1, b1) = (&a[1..BYTES - 3], &b[1..BYTES - 3]);
        let d1 = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut dst)[1..BYTES - 3];
        let t = Instant::now();
        for _ in 0..5 {
            r.reduce(d1, a1, None, b1, None);
        }
        let staged = t.elapsed().as_secs_f64() / 5.0;
        println!(
            "   float sum  32 MiB misaligned: {:6.2} GB/s of output",
            BYTES as f64 / staged / 1e9
        );
        let t = Instant::now();
        for _ in 0..20 {
            bytemuck::cast_slice_mut::<u64, u8>(&mut dst).copy_from_slice(std::hint::black_box(a));
            std::hint::black_box(&mut dst);
        }
        let copy = t.elapsed().as_secs_f64() / 20.0;
        println!("memcpy 32 MiB: {:6.2} GB/s", BYTES as f64 / copy / 1e9);
    }
}
