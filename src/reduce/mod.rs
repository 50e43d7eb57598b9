//! Element-wise reductions on host memory: every datatype x every op.
//!
//! Buffers are byte slices holding elements of one [`DataType`] in native byte order. They need not
//! be aligned to the element size (a misaligned buffer takes a slower path); lengths are always
//! whole multiples of the element size. Callers guarantee the slices of one call do not overlap,
//! except through the explicit in-place entry points.

mod copy;
mod kernels;
mod stream;

pub(crate) use copy::{copy_bytes, just_ahead};
// The float8 conversions, for the device kernels' test that checks against them (built only
// where nvcc compiled the kernels).
#[cfg(all(test, comm_kernels))]
pub(crate) use kernels::{f32_to_fp8e4m3, f32_to_fp8e5m2};
pub(crate) use stream::stream_copy;

/// The twelve NCCL datatypes, numbered as in `ncclDataType_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    Int8 = 0,
    Uint8 = 1,
    Int32 = 2,
    Uint32 = 3,
    Int64 = 4,
    Uint64 = 5,
    Float16 = 6,
    Float32 = 7,
    Float64 = 8,
    Bfloat16 = 9,
    Float8e4m3 = 10,
    Float8e5m2 = 11,
}

impl DataType {
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8e4m3,
        DataType::Float8e5m2,
    ];

    pub fn from_raw(raw: i32) -> Option<DataType> {
        usize::try_from(raw)
            .ok()
            .and_then(|i| DataType::ALL.get(i).copied())
    }

    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8e4m3 | DataType::Float8e5m2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            DataType::Float16
                | DataType::Float32
                | DataType::Float64
                | DataType::Bfloat16
                | DataType::Float8e4m3
                | DataType::Float8e5m2
        )
    }

    /// The name nccl-tests uses for this type (`-d` flag).
    pub fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "int8",
            DataType::Uint8 => "uint8",
            DataType::Int32 => "int32",
            DataType::Uint32 => "uint32",
            DataType::Int64 => "int64",
            DataType::Uint64 => "uint64",
            DataType::Float16 => "half",
            DataType::Float32 => "float",
            DataType::Float64 => "double",
            DataType::Bfloat16 => "bfloat16",
            DataType::Float8e4m3 => "f8e4m3",
            DataType::Float8e5m2 => "f8e5m2",
        }
    }
}

/// The element-wise combining functions. Avg and PreMulSum are not here: they are Sum plus a
/// [`Scale`] on each rank's input (floats) or a final [`Reducer::divide_in_place`] (integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
    /// Bitwise and/or/xor: integer types only (the caller rejects floats).
    BitAnd,
    BitOr,
    BitXor,
}

impl ReduceOp {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::BitAnd => "band",
            ReduceOp::BitOr => "bor",
            ReduceOp::BitXor => "bxor",
        }
    }
}

/// A multiplier held in the encoding of the datatype it applies to (little-endian, first
/// `dtype.size()` bytes used), as `ncclRedOpCreatePreMulSum` receives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Scale(pub [u8; 8]);

impl Scale {
    /// Reads a scalar of `dtype` from its native-endian bytes (`bytes.len() >= dtype.size()`).
    pub(crate) fn from_bytes(dtype: DataType, bytes: &[u8]) -> Scale {
        let mut v = [0u8; 8];
        v[..dtype.size()].copy_from_slice(&bytes[..dtype.size()]);
        Scale(v)
    }

    /// `1/n` in `dtype` (floats only): the multiplier that turns a sum into an average.
    pub(crate) fn reciprocal(dtype: DataType, n: usize) -> Scale {
        kernels::reciprocal(dtype, n)
    }
}

/// An element-wise reduction of one datatype and op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reducer {
    pub dtype: DataType,
    pub op: ReduceOp,
}

impl Reducer {
    pub(crate) fn new(dtype: DataType, op: ReduceOp) -> Reducer {
        Reducer { dtype, op }
    }

    /// `dst[i] = op(sa * a[i], sb * b[i])`. A scale is only given with `ReduceOp::Sum`.
    pub(crate) fn reduce(
        &self,
        dst: &mut [u8],
        a: &[u8],
        sa: Option<Scale>,
        b: &[u8],
        sb: Option<Scale>,
    ) {
        kernels::reduce(*self, dst, a, sa, b, sb)
    }

    /// `dst[i] = op(a[i], b[i])` for a few bytes (at most 64) of a type computed natively
    /// (integers, f32, f64), with an op that suits it; false, having done nothing, for
    /// anything else. What a small message's fold takes before the general kernels.
    ///
    /// # Safety
    /// `dst`, `a` and `b` cover `len` bytes, a whole number of elements; `dst` is `a`, is `b`
    /// or overlaps neither.
    #[inline]
    pub(crate) unsafe fn reduce_small(
        &self,
        dst: *mut u8,
        a: *const u8,
        b: *const u8,
        len: usize,
    ) -> bool {
        // SAFETY: `kernels::small` has this function's contract, which the caller upholds.
        unsafe { kernels::small(*self, dst, a, b, len) }
    }

    /// `acc[i] = op(sacc * acc[i], sb * b[i])`.
    pub(crate) fn reduce_in_place(
        &self,
        acc: &mut [u8],
        sacc: Option<Scale>,
        b: &[u8],
        sb: Option<Scale>,
    ) {
        kernels::reduce_in_place(*self, acc, sacc, b, sb)
    }

    /// `streamed[i] = also[i] = op(sa * a[i], sb * b[i])`, `streamed` written with
    /// non-temporal stores (`stream_copy`) and fenced at the end: for a result that goes to
    /// memory nothing will read soon and, through `also`, somewhere that will.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reduce_twice(
        &self,
        streamed: &mut [u8],
        also: &mut [u8],
        a: &[u8],
        sa: Option<Scale>,
        b: &[u8],
        sb: Option<Scale>,
    ) {
        kernels::reduce_twice(*self, streamed, also, a, sa, b, sb)
    }

    /// `dst[i] = s * src[i]`.
    pub(crate) fn scale(&self, dst: &mut [u8], src: &[u8], s: Scale) {
        kernels::scale(self.dtype, dst, src, s)
    }

    /// `buf[i] = s * buf[i]`.
    pub(crate) fn scale_in_place(&self, buf: &mut [u8], s: Scale) {
        kernels::scale_in_place(self.dtype, buf, s)
    }

    /// `buf[i] = buf[i] / n`: the end of an integer average (truncating toward zero).
    pub(crate) fn divide_in_place(&self, buf: &mut [u8], n: usize) {
        kernels::divide_in_place(self.dtype, buf, n)
    }
}
