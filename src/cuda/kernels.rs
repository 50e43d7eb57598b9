//! What the embedded kernel image holds, and the parameter block its reduce kernels take.
//!
//! build.rs compiles `kernels/*.cu` into one fatbin (SASS for sm_80 and sm_90, PTX for compute_90)
//! and sets `cfg(comm_kernels)` when nvcc was found; without it [`FATBIN`] is empty and the library
//! has no device path. The image is meant for `cuModuleLoadData`; kernels are looked up by the
//! unmangled names [`reduce_kernel_name`] and [`FILL_U32`] give.
//!
//! Every reduce kernel takes one [`ReduceArgs`] and computes, for each element j < count,
//! `dst[j] = fold(op, s0 * src[0][j], s1 * src[1][j], ...) / divide_by` exactly as the host
//! reducer (`crate::reduce`) folds the same sources left to right: each step's result is rounded
//! to the datatype, a scaled source is rounded before it is combined, integers wrap, fp8 saturates.
//! Any grid and block size is correct; [`launch_grid`] gives the one the kernels are tuned for.

use crate::reduce::{DataType, ReduceOp};

/// Most inputs one reduce launch combines (`COMM_MAX_SOURCES` in kernels/comm_kernels.cuh).
pub(crate) const MAX_SOURCES: usize = 16;

/// `comm_fill_u32(unsigned *dst, unsigned value, unsigned long long count)`: `dst[i] = value`.
pub(crate) const FILL_U32: &str = "comm_fill_u32";

/// Threads per block the reduce kernels are written for (any block size is correct).
pub(crate) const BLOCK_THREADS: u32 = 256;

/// Bytes of each source a thread loads per round of a reduce kernel's main loop: two 16-byte
/// vectors (`kVectorsPerThread` in kernels/reduce.cu).
pub(crate) const BYTES_PER_THREAD: usize = 32;

/// Elements of `dtype` a thread handles per round of a reduce kernel's main loop.
pub(crate) fn elems_per_thread(dtype: DataType) -> usize {
    BYTES_PER_THREAD / dtype.size()
}

/// Blocks of [`BLOCK_THREADS`] for a reduce of `count` elements on a GPU with `sms`
/// multiprocessors: enough for one round per thread, at most four blocks per SM (the kernels loop
/// over the rest). Zero elements still get one block, which returns at once.
pub(crate) fn launch_grid(dtype: DataType, count: u64, sms: u32) -> u32 {
    let per_block = BLOCK_THREADS as u64 * elems_per_thread(dtype) as u64;
    let wanted = count.div_ceil(per_block).max(1);
    wanted.min(4 * u64::from(sms.max(1))) as u32
}

/// The parameter of every `comm_reduce_<dtype>_<op>` kernel: `ReduceArgs` of
/// kernels/comm_kernels.cuh, field for field (checked at build time when the kernels are built).
///
/// `dst` may be `src[0]` itself (an in-place accumulate); no source may otherwise overlap `dst`.
/// Pointers need only be aligned to the element size; when `dst` and every source share their
/// offset from a 16-byte boundary the kernels move 16 bytes per load.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReduceArgs {
    /// Output, `count` elements.
    pub dst: *mut std::ffi::c_void,
    /// Inputs `0..nsrc`, combined in index order.
    pub src: [*const std::ffi::c_void; MAX_SOURCES],
    /// Per-source multiplier: the raw little-endian bits of a value of the datatype in the low
    /// bytes. Read only where `has_scale` has the source's bit set (op sum only).
    pub scale: [u64; MAX_SOURCES],
    /// Bit i: multiply `src[i]` by `scale[i]` (rounded to the datatype) before combining it.
    pub has_scale: u32,
    /// Number of sources, 1 to [`MAX_SOURCES`]; 1 is a copy (scaled or divided, if asked).
    pub nsrc: i32,
    /// Elements.
    pub count: u64,
    /// 0, or divide every result by this (the end of an integer average; truncates toward 0).
    pub divide_by: u64,
    /// Per source: null, or a device descriptor cell; a non-zero value in it replaces `src[i]`
    /// (a peer's message read in place from its registered buffer).
    pub via: [*const u64; MAX_SOURCES],
    /// Per source: null, or the device address of a value of the datatype that replaces
    /// `scale[i]` when the launch runs (a PreMulSum scalar in device memory).
    pub scale_at: [*const std::ffi::c_void; MAX_SOURCES],
}

impl Default for ReduceArgs {
    fn default() -> Self {
        ReduceArgs {
            dst: std::ptr::null_mut(),
            src: [std::ptr::null(); MAX_SOURCES],
            scale: [0; MAX_SOURCES],
            has_scale: 0,
            nsrc: 0,
            count: 0,
            divide_by: 0,
            via: [std::ptr::null(); MAX_SOURCES],
            scale_at: [std::ptr::null(); MAX_SOURCES],
        }
    }
}

/// The C layout as build.rs measured it from kernels/comm_kernels.cuh (its constants are
/// `pub` for the check below).
#[cfg(comm_kernels)]
#[allow(unreachable_pub)]
mod c_layout {
    include!(env!("COMM_REDUCE_ARGS_LAYOUT"));
}

// A drift between the C struct and its mirror fails the build.
#[cfg(comm_kernels)]
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ReduceArgs>() == c_layout::SIZE);
    assert!(MAX_SOURCES == c_layout::MAX_SOURCES);
    assert!(offset_of!(ReduceArgs, dst) == c_layout::DST);
    assert!(offset_of!(ReduceArgs, src) == c_layout::SRC);
    assert!(offset_of!(ReduceArgs, scale) == c_layout::SCALE);
    assert!(offset_of!(ReduceArgs, has_scale) == c_layout::HAS_SCALE);
    assert!(offset_of!(ReduceArgs, nsrc) == c_layout::NSRC);
    assert!(offset_of!(ReduceArgs, count) == c_layout::COUNT);
    assert!(offset_of!(ReduceArgs, divide_by) == c_layout::DIVIDE_BY);
    assert!(offset_of!(ReduceArgs, via) == c_layout::VIA);
    assert!(offset_of!(ReduceArgs, scale_at) == c_layout::SCALE_AT);
};

/// Keeps the embedded image 64-byte aligned: the driver parses it in place.
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

#[cfg(comm_kernels)]
static IMAGE: &Aligned<[u8]> = &Aligned(*include_bytes!(env!("COMM_FATBIN")));
#[cfg(not(comm_kernels))]
static IMAGE: &Aligned<[u8]> = &Aligned([]);

/// The kernels' fatbin, for `cuModuleLoadData`; empty in a build without nvcc.
pub(crate) static FATBIN: &[u8] = &IMAGE.0;

/// The kernel for a reduction, or None for a bitwise op on a floating-point type (which the
/// library rejects before it gets here).
pub(crate) fn reduce_kernel_name(dtype: DataType, op: ReduceOp) -> Option<&'static str> {
    REDUCE_KERNELS[dtype as usize][op_index(op)]
}

/// Every reduce kernel's name.
pub(crate) fn reduce_kernel_names() -> impl Iterator<Item = &'static str> {
    REDUCE_KERNELS.iter().flatten().flatten().copied()
}

fn op_index(op: ReduceOp) -> usize {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::BitAnd => 4,
        ReduceOp::BitOr => 5,
        ReduceOp::BitXor => 6,
    }
}

macro_rules! integer_kernels {
    ($t:literal) => {
        [
            Some(concat!("comm_reduce_", $t, "_sum")),
            Some(concat!("comm_reduce_", $t, "_prod")),
            Some(concat!("comm_reduce_", $t, "_max")),
            Some(concat!("comm_reduce_", $t, "_min")),
            Some(concat!("comm_reduce_", $t, "_band")),
            Some(concat!("comm_reduce_", $t, "_bor")),
            Some(concat!("comm_reduce_", $t, "_bxor")),
        ]
    };
}

macro_rules! float_kernels {
    ($t:literal) => {
        [
            Some(concat!("comm_reduce_", $t, "_sum")),
            Some(concat!("comm_reduce_", $t, "_prod")),
            Some(concat!("comm_reduce_", $t, "_max")),
            Some(concat!("comm_reduce_", $t, "_min")),
            None,
            None,
            None,
        ]
    };
}

/// Indexed by `DataType as usize` (the NCCL numbering) and [`op_index`]; the names are those
/// COMM_FOR_EACH_REDUCE_KERNEL in kernels/comm_kernels.cuh defines.
static REDUCE_KERNELS: [[Option<&str>; 7]; 12] = [
    integer_kernels!("i8"),
    integer_kernels!("u8"),
    integer_kernels!("i32"),
    integer_kernels!("u32"),
    integer_kernels!("i64"),
    integer_kernels!("u64"),
    float_kernels!("f16"),
    float_kernels!("f32"),
    float_kernels!("f64"),
    float_kernels!("bf16"),
    float_kernels!("e4m3"),
    float_kernels!("e5m2"),
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const OPS: [ReduceOp; 7] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
    ];

    fn is_bitwise(op: ReduceOp) -> bool {
        matches!(op, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor)
    }

    #[test]
    fn every_reduction_has_one_kernel() {
        let mut seen = HashSet::new();
        for dtype in DataType::ALL {
            for op in OPS {
                let name = reduce_kernel_name(dtype, op);
                if dtype.is_float() && is_bitwise(op) {
                    assert_eq!(name, None, "{} {}", dtype.name(), op.name());
                    continue;
                }
                let name = name.unwrap_or_else(|| panic!("{} {}", dtype.name(), op.name()));
                assert!(seen.insert(name), "{name} named twice");
                assert!(
                    name.starts_with("comm_reduce_") && name.ends_with(&format!("_{}", op.name())),
                    "{name} for {} {}",
                    dtype.name(),
                    op.name()
                );
            }
        }
        assert_eq!(seen.len(), 6 * 7 + 6 * 4);
        assert_eq!(reduce_kernel_names().count(), seen.len());
        // The table follows the NCCL numbering DataType uses.
        assert_eq!(
            reduce_kernel_name(DataType::Bfloat16, ReduceOp::Max),
            Some("comm_reduce_bf16_max")
        );
        assert_eq!(
            reduce_kernel_name(DataType::Float8e5m2, ReduceOp::Sum),
            Some("comm_reduce_e5m2_sum")
        );
        assert_eq!(
            reduce_kernel_name(DataType::Uint64, ReduceOp::BitXor),
            Some("comm_reduce_u64_bxor")
        );
    }

    #[test]
    fn launch_grid_covers_the_count_and_caps_at_four_blocks_per_sm() {
        assert_eq!(launch_grid(DataType::Float32, 0, 132), 1);
        assert_eq!(launch_grid(DataType::Float32, 1, 132), 1);
        // 256 threads x 8 floats per block.
        assert_eq!(launch_grid(DataType::Float32, 2048, 132), 1);
        assert_eq!(launch_grid(DataType::Float32, 2049, 132), 2);
        assert_eq!(launch_grid(DataType::Float8e4m3, 1 << 30, 132), 528);
        assert_eq!(elems_per_thread(DataType::Float64), 4);
        assert_eq!(elems_per_thread(DataType::Int8), 32);
    }

    #[test]
    fn fatbin_is_aligned() {
        assert_eq!(FATBIN.as_ptr() as usize % 64, 0);
        #[cfg(not(comm_kernels))]
        assert!(FATBIN.is_empty());
    }

    /// The fatbin's ELF images carry each kernel's symbol name as plain NUL-terminated bytes.
    #[cfg(comm_kernels)]
    #[test]
    fn fatbin_holds_every_kernel() {
        // The fatbin container's magic number, little-endian.
        assert_eq!(FATBIN.get(..4), Some(&[0x50, 0xed, 0x55, 0xba][..]));
        let holds = |name: &str| {
            let needle = [name.as_bytes(), b"\0"].concat();
            FATBIN.windows(needle.len()).any(|w| w == needle)
        };
        let missing: Vec<&str> = reduce_kernel_names()
            .chain([FILL_U32])
            .filter(|name| !holds(name))
            .collect();
        assert!(missing.is_empty(), "not in the fatbin: {missing:?}");
        assert!(
            !holds("comm_reduce_f32_band"),
            "a float bitwise kernel exists"
        );
    }

    #[cfg(comm_kernels)]
    mod device_math {
        //! Runs tests/cuda/reduce_math_test.cu, a host program that exercises the kernels'
        //! per-element math: its own known-value checks, then random folds compared bit for bit
        //! with the host reducer.

        use super::*;
        use crate::reduce::{Reducer, Scale};
        use std::fmt::Write as _;
        use std::path::{Path, PathBuf};
        use std::process::{Command, Stdio};

        /// A scratch directory removed when dropped.
        struct Scratch(PathBuf);
        impl Drop for Scratch {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }

        fn build_program() -> (Scratch, PathBuf) {
            let root = Path::new(env!("CARGO_MANIFEST_DIR"));
            let dir = std::env::temp_dir().join(format!(
                "comm-reduce-math-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let scratch = Scratch(dir);
            let program = scratch.0.join("reduce_math_test");
            let flags = env!("COMM_NVCC_FLAGS");
            let out = Command::new(env!("COMM_NVCC"))
                .arg("-std=c++17")
                .arg("-O2")
                .arg(format!("-I{}", root.join("kernels").display()))
                .args(flags.split('\u{1f}').filter(|f| !f.is_empty()))
                .arg("-o")
                .arg(&program)
                .arg(root.join("tests/cuda/reduce_math_test.cu"))
                .output()
                .expect("run nvcc");
            assert!(
                out.status.success(),
                "nvcc failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            (scratch, program)
        }

        /// xorshift64*: reproducible cases without a dependency.
        struct Rng(u64);
        impl Rng {
            fn next(&mut self) -> u64 {
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
            }
            fn below(&mut self, n: u64) -> u64 {
                self.next() % n
            }
        }

        fn mask(dtype: DataType) -> u64 {
            match dtype.size() {
                8 => u64::MAX,
                w => (1u64 << (8 * w)) - 1,
            }
        }

        /// A value of `dtype` as raw bits: often a special or a small number, otherwise any bits.
        fn value(rng: &mut Rng, dtype: DataType) -> u64 {
            let special: &[u64] = match dtype {
                DataType::Float16 => &[
                    0x0000, 0x8000, 0x3c00, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0x0001, 0x6800,
                ],
                DataType::Bfloat16 => &[
                    0x0000, 0x8000, 0x3f80, 0x7f7f, 0x7f80, 0xff80, 0x7fc0, 0x0001,
                ],
                DataType::Float8e4m3 => &[0x00, 0x80, 0x38, 0x7e, 0xfe, 0x7f, 0x01, 0x08],
                DataType::Float8e5m2 => &[0x00, 0x80, 0x3c, 0x7b, 0x7c, 0xfc, 0x7e, 0x01],
                DataType::Float32 => &[
                    0,
                    0x8000_0000,
                    0x3f80_0000,
                    0x7f7f_ffff,
                    0x7f80_0000,
                    0x7fc0_0000,
                    1,
                ],
                DataType::Float64 => &[0, 1 << 63, 0x3ff0 << 48, 0x7ff0 << 48, 0x7ff8 << 48, 1],
                _ => &[
                    0,
                    1,
                    u64::MAX,
                    1 << (8 * dtype.size() - 1),
                    (1 << (8 * dtype.size() - 1)) - 1,
                ],
            };
            match rng.below(4) {
                0 => special[rng.below(special.len() as u64) as usize] & mask(dtype),
                // Values near one: sums and products that round rather than overflow.
                1 if dtype.is_float() => {
                    let x = 1.0 + (rng.below(1 << 20) as f64) / f64::from(1 << 20);
                    let x = if rng.below(2) == 0 { x } else { -x };
                    encode(dtype, x)
                }
                1 => rng.below(300).wrapping_sub(150) & mask(dtype),
                _ => rng.next() & mask(dtype),
            }
        }

        /// The nearest value of `dtype` to `x`, via the host reducer's own conversions.
        fn encode(dtype: DataType, x: f64) -> u64 {
            let f = x as f32;
            match dtype {
                DataType::Float16 => u64::from(half::f16::from_f32(f).to_bits()),
                DataType::Bfloat16 => u64::from(half::bf16::from_f32(f).to_bits()),
                DataType::Float8e4m3 => u64::from(crate::reduce::f32_to_fp8e4m3(f)),
                DataType::Float8e5m2 => u64::from(crate::reduce::f32_to_fp8e5m2(f)),
                DataType::Float32 => u64::from(f.to_bits()),
                _ => x.to_bits(),
            }
        }

        fn is_nan(dtype: DataType, bits: u64) -> bool {
            match dtype {
                DataType::Float16 => half::f16::from_bits(bits as u16).is_nan(),
                DataType::Bfloat16 => half::bf16::from_bits(bits as u16).is_nan(),
                DataType::Float8e4m3 => bits & 0x7f == 0x7f,
                DataType::Float8e5m2 => bits & 0x7f > 0x7c,
                DataType::Float32 => f32::from_bits(bits as u32).is_nan(),
                DataType::Float64 => f64::from_bits(bits).is_nan(),
                _ => false,
            }
        }

        struct Case {
            dtype: DataType,
            op: ReduceOp,
            x: Vec<u64>,
            scale: Vec<Option<u64>>,
            divide_by: u64,
        }

        /// What the host reducer makes of a case: the same fold, one host call per step.
        fn host_result(c: &Case) -> u64 {
            let w = c.dtype.size();
            let bytes = |v: u64| v.to_le_bytes()[..w].to_vec();
            let scale = |s: Option<u64>| s.map(|s| Scale::from_bytes(c.dtype, &s.to_le_bytes()));
            let r = Reducer::new(c.dtype, c.op);
            let mut acc = bytes(c.x[0]);
            if let Some(s) = scale(c.scale[0]) {
                r.scale(&mut acc, &bytes(c.x[0]), s);
            }
            for (x, s) in c.x.iter().zip(&c.scale).skip(1) {
                r.reduce_in_place(&mut acc, None, &bytes(*x), scale(*s));
            }
            if c.divide_by > 0 {
                r.divide_in_place(&mut acc, c.divide_by as usize);
            }
            let mut out = [0u8; 8];
            out[..w].copy_from_slice(&acc);
            u64::from_le_bytes(out)
        }

        #[test]
        fn device_math_passes_its_checks_and_matches_the_host_reducer() {
            let (scratch, program) = build_program();
            let out = Command::new(&program)
                .output()
                .expect("run reduce_math_test");
            assert!(
                out.status.success(),
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );

            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let mut cases = Vec::new();
            for dtype in DataType::ALL {
                for op in OPS {
                    if reduce_kernel_name(dtype, op).is_none() {
                        continue;
                    }
                    for _ in 0..400 {
                        let most = if rng.below(4) == 0 { MAX_SOURCES } else { 4 };
                        let nsrc = 1 + rng.below(most as u64) as usize;
                        let x = (0..nsrc).map(|_| value(&mut rng, dtype)).collect();
                        // Scales come with sum only, as PreMulSum and float averages use them.
                        let scale = (0..nsrc)
                            .map(|_| {
                                (op == ReduceOp::Sum && rng.below(3) == 0)
                                    .then(|| value(&mut rng, dtype))
                            })
                            .collect();
                        let divide_by = match rng.below(8) {
                            0 => 1 + rng.below(20),
                            1 if !dtype.is_float() => 1 + rng.below(1 << 40),
                            _ => 0,
                        };
                        cases.push(Case {
                            dtype,
                            op,
                            x,
                            scale,
                            divide_by,
                        });
                    }
                }
            }

            let mut input = String::new();
            for c in &cases {
                let (name, _) = reduce_kernel_name(c.dtype, c.op)
                    .unwrap()
                    .trim_start_matches("comm_reduce_")
                    .split_once('_')
                    .unwrap();
                let has_scale = c
                    .scale
                    .iter()
                    .enumerate()
                    .fold(0u32, |m, (i, s)| m | (u32::from(s.is_some()) << i));
                write!(
                    input,
                    "{name} {} {:x} {has_scale:x} {:x}",
                    c.op.name(),
                    c.x.len(),
                    c.divide_by
                )
                .unwrap();
                for x in &c.x {
                    write!(input, " {x:x}").unwrap();
                }
                for s in &c.scale {
                    write!(input, " {:x}", s.unwrap_or(0)).unwrap();
                }
                input.push('\n');
            }
            let input_path = scratch.0.join("cases.txt");
            std::fs::write(&input_path, input).unwrap();
            let out = Command::new(&program)
                .arg("--eval")
                .stdin(std::fs::File::open(&input_path).unwrap())
                .stderr(Stdio::inherit())
                .output()
                .expect("run reduce_math_test --eval");
            assert!(out.status.success(), "reduce_math_test --eval failed");
            let results: Vec<u64> = String::from_utf8(out.stdout)
                .unwrap()
                .lines()
                .map(|l| u64::from_str_radix(l, 16).unwrap())
                .collect();
            assert_eq!(results.len(), cases.len());

            let mut failures = Vec::new();
            for (c, &got) in cases.iter().zip(&results) {
                let want = host_result(c);
                let same = got == want || (is_nan(c.dtype, got) && is_nan(c.dtype, want));
                if !same {
                    failures.push(format!(
                        "{} {}: x {:x?} scale {:x?} / {}: device math {got:#x}, host {want:#x}",
                        c.dtype.name(),
                        c.op.name(),
                        c.x,
                        c.scale,
                        c.divide_by
                    ));
                }
            }
            assert!(
                failures.is_empty(),
                "{} of {} cases differ:\n{}",
                failures.len(),
                cases.len(),
                failures[..failures.len().min(20)].join("\n")
            );
        }
    }
}
