//! Test values for every datatype, encoded independently of the library (so a conversion bug
//! in the library is not mirrored by the reference), and the reference results of every op.

/// (ncclDataType_t value, name, size)
pub const DTYPES: [(i32, &str, usize); 12] = [
    (0, "int8", 1),
    (1, "uint8", 1),
    (2, "int32", 4),
    (3, "uint32", 4),
    (4, "int64", 8),
    (5, "uint64", 8),
    (6, "half", 2),
    (7, "float", 4),
    (8, "double", 8),
    (9, "bfloat16", 2),
    (10, "f8e4m3", 1),
    (11, "f8e5m2", 1),
];

/// ncclRedOp_t values of the built-in ops, and a marker for PreMulSum.
pub const SUM: i32 = 0;
pub const PROD: i32 = 1;
pub const MAX: i32 = 2;
pub const MIN: i32 = 3;
pub const AVG: i32 = 4;
pub const PREMULSUM: i32 = -1;
pub const OPS: [(i32, &str); 6] = [
    (SUM, "sum"),
    (PROD, "prod"),
    (MAX, "max"),
    (MIN, "min"),
    (AVG, "avg"),
    (PREMULSUM, "premulsum"),
];

pub fn size_of(dt: i32) -> usize {
    DTYPES[dt as usize].2
}

pub fn name_of(dt: i32) -> &'static str {
    DTYPES[dt as usize].1
}

pub fn is_float(dt: i32) -> bool {
    dt >= 6
}

fn signed(dt: i32) -> bool {
    matches!(dt, 0 | 2 | 4)
}

/// Decodes an fp8 byte: `exp_bits` exponent bits, `man_bits` mantissa bits; e4m3 has no
/// infinities and one NaN pattern per sign.
fn fp8_decode(b: u8, exp_bits: u32, man_bits: u32) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> man_bits) & ((1 << exp_bits) - 1) as u8) as i32;
    let m = (b & ((1 << man_bits) - 1) as u8) as f64;
    let bias = (1 << (exp_bits - 1)) - 1;
    let emax = (1 << exp_bits) - 1;
    if exp_bits == 4 && e == emax && m as u32 == (1 << man_bits) - 1 {
        return f64::NAN;
    }
    if exp_bits == 5 && e == emax {
        return if m == 0.0 {
            sign * f64::INFINITY
        } else {
            f64::NAN
        };
    }
    let scale = (1u64 << man_bits) as f64;
    if e == 0 {
        sign * (m / scale) * 2f64.powi(1 - bias)
    } else {
        sign * (1.0 + m / scale) * 2f64.powi(e - bias)
    }
}

/// The byte of the first code (in code order) that decodes to `v`. A search of all 256 codes
/// per element made filling a few MiB of fp8 take tens of seconds on a loaded 2-core machine
/// (the soak then timed its fill as a 40 s operation): each format's codes are decoded once
/// into a table. Zero's two codes both equal 0.0, so a zero of either sign gives +0's code.
fn fp8_encode_exact(v: f64, exp_bits: u32, man_bits: u32) -> u8 {
    use std::collections::HashMap;
    use std::sync::OnceLock;
    static TABLES: [OnceLock<HashMap<u64, u8>>; 2] = [OnceLock::new(), OnceLock::new()];
    let key = |x: f64| if x == 0.0 { 0u64 } else { x.to_bits() };
    let format = match (exp_bits, man_bits) {
        (4, 3) => 0,
        (5, 2) => 1,
        _ => unreachable!("no fp8 format e{exp_bits}m{man_bits}"),
    };
    let table = TABLES[format].get_or_init(|| {
        let mut t = HashMap::new();
        for b in 0..=255u8 {
            let x = fp8_decode(b, exp_bits, man_bits);
            if !x.is_nan() {
                t.entry(key(x)).or_insert(b);
            }
        }
        t
    });
    *table
        .get(&key(v))
        .unwrap_or_else(|| panic!("{v} is not exactly representable in fp8 e{exp_bits}m{man_bits}"))
}

/// Writes `v` (exactly representable) in `dt` into `out`.
pub fn encode(dt: i32, v: f64, out: &mut [u8]) {
    match dt {
        0 => out[0] = (v as i64 as i8) as u8,
        1 => out[0] = v as i64 as u8,
        2 => out.copy_from_slice(&(v as i64 as i32).to_ne_bytes()),
        3 => out.copy_from_slice(&(v as i64 as u32).to_ne_bytes()),
        4 => out.copy_from_slice(&(v as i64).to_ne_bytes()),
        5 => out.copy_from_slice(&(v as i128 as u64).to_ne_bytes()),
        6 => out.copy_from_slice(&half::f16::from_f64(v).to_ne_bytes()),
        7 => out.copy_from_slice(&(v as f32).to_ne_bytes()),
        8 => out.copy_from_slice(&v.to_ne_bytes()),
        9 => out.copy_from_slice(&half::bf16::from_f64(v).to_ne_bytes()),
        10 => out[0] = fp8_encode_exact(v, 4, 3),
        11 => out[0] = fp8_encode_exact(v, 5, 2),
        _ => unreachable!(),
    }
}

pub fn decode(dt: i32, b: &[u8]) -> f64 {
    match dt {
        0 => b[0] as i8 as f64,
        1 => b[0] as f64,
        2 => i32::from_ne_bytes(b.try_into().unwrap()) as f64,
        3 => u32::from_ne_bytes(b.try_into().unwrap()) as f64,
        4 => i64::from_ne_bytes(b.try_into().unwrap()) as f64,
        5 => u64::from_ne_bytes(b.try_into().unwrap()) as f64,
        6 => half::f16::from_ne_bytes(b.try_into().unwrap()).to_f64(),
        7 => f32::from_ne_bytes(b.try_into().unwrap()) as f64,
        8 => f64::from_ne_bytes(b.try_into().unwrap()),
        9 => half::bf16::from_ne_bytes(b.try_into().unwrap()).to_f64(),
        10 => fp8_decode(b[0], 4, 3),
        11 => fp8_decode(b[0], 5, 2),
        _ => unreachable!(),
    }
}

/// The value rank `r` contributes at element `j` of its send buffer, for `op`. Chosen so every
/// exact result is representable in every datatype.
pub fn input(dt: i32, op: i32, r: usize, j: usize) -> f64 {
    let k = r * 7 + j * 3;
    match op {
        PROD => 1.0 + (k % 2) as f64,
        MAX | MIN => {
            let v = (k % 11) as f64;
            if signed(dt) || is_float(dt) {
                v - 5.0
            } else {
                v
            }
        }
        _ => (k % 3) as f64,
    }
}

/// Value that a non-reducing collective moves (any representable pattern works).
pub fn payload(dt: i32, r: usize, j: usize) -> f64 {
    let v = ((r * 31 + j * 7) % 13) as f64;
    if signed(dt) || is_float(dt) {
        v - 6.0
    } else {
        v
    }
}

/// The PreMulSum multiplier used in tests.
pub fn scalar(dt: i32) -> f64 {
    if is_float(dt) {
        2.0
    } else {
        3.0
    }
}

/// Wraps an exact integer result to the datatype's width, like two's-complement hardware.
fn wrap(dt: i32, v: i128) -> f64 {
    match dt {
        0 => v as i8 as f64,
        1 => v as u8 as f64,
        2 => v as i32 as f64,
        3 => v as u32 as f64,
        4 => v as i64 as f64,
        5 => v as u64 as f64,
        _ => unreachable!(),
    }
}

/// The reference result of reducing `vals` with `op` in `dt`.
pub fn reduce(dt: i32, op: i32, vals: &[f64]) -> f64 {
    let n = vals.len();
    if !is_float(dt) {
        let iv: Vec<i128> = vals.iter().map(|v| *v as i128).collect();
        let s: i128 = iv.iter().sum();
        return match op {
            SUM => wrap(dt, s),
            PROD => wrap(dt, iv.iter().product()),
            MAX => *iv.iter().max().unwrap() as f64,
            MIN => *iv.iter().min().unwrap() as f64,
            AVG => wrap(dt, s / n as i128),
            PREMULSUM => wrap(dt, s * scalar(dt) as i128),
            _ => unreachable!(),
        };
    }
    match op {
        SUM => vals.iter().sum(),
        PROD => vals.iter().product(),
        MAX => vals.iter().cloned().fold(f64::MIN, f64::max),
        MIN => vals.iter().cloned().fold(f64::MAX, f64::min),
        AVG => vals.iter().sum::<f64>() / n as f64,
        PREMULSUM => vals.iter().sum::<f64>() * scalar(dt),
        _ => unreachable!(),
    }
}

/// Mantissa bits of a float type.
fn mantissa_bits(dt: i32) -> i32 {
    match dt {
        6 => 10,
        7 => 23,
        8 => 52,
        9 => 7,
        10 => 3,
        11 => 2,
        _ => 60,
    }
}

/// How far a correct implementation may be from the exact result. Integer results and small
/// integer float results are exact; fp8 partial sums and float averages round along the way.
pub fn tolerance(dt: i32, op: i32, n: usize, expected: f64) -> f64 {
    if !is_float(dt) {
        return 0.0;
    }
    let eps = 2f64.powi(-mantissa_bits(dt));
    let exact_limit = 2f64.powi(mantissa_bits(dt) + 1);
    let bound = expected.abs().max(1.0);
    match op {
        AVG => (n as f64 + 2.0) * eps * bound * 2.0,
        _ if bound * scalar(dt) <= exact_limit => 0.0,
        _ => (n as f64 + 1.0) * eps * bound,
    }
}

/// Compares `got` against the reference, element by element; describes the first mismatch.
pub fn check(
    dt: i32,
    op: i32,
    n: usize,
    what: &str,
    got: &[u8],
    expect: impl Fn(usize) -> f64,
) -> Result<(), String> {
    let size = size_of(dt);
    for (i, b) in got.chunks_exact(size).enumerate() {
        let g = decode(dt, b);
        let e = expect(i);
        let tol = tolerance(dt, op, n, e);
        if !((g - e).abs() <= tol || (g.is_nan() && e.is_nan())) {
            return Err(format!(
                "{what} {}: element {i} is {g}, expected {e} (tolerance {tol})",
                name_of(dt)
            ));
        }
    }
    Ok(())
}

#[test]
fn fp8_decoder_matches_known_values() {
    assert_eq!(fp8_decode(0x38, 4, 3), 1.0);
    assert_eq!(fp8_decode(0x7e, 4, 3), 448.0);
    assert!(fp8_decode(0x7f, 4, 3).is_nan());
    assert_eq!(fp8_decode(0x01, 4, 3), 2f64.powi(-9));
    assert_eq!(fp8_decode(0x3c, 5, 2), 1.0);
    assert_eq!(fp8_decode(0x7b, 5, 2), 57344.0);
    assert_eq!(fp8_decode(0x7c, 5, 2), f64::INFINITY);
}

/// The table gives every representable value the code a search in code order finds first.
#[test]
fn fp8_encoder_gives_the_first_code_of_each_value() {
    for (e, m) in [(4, 3), (5, 2)] {
        for b in 0..=255u8 {
            let v = fp8_decode(b, e, m);
            if v.is_nan() {
                continue;
            }
            let first = (0..=255u8).find(|&c| fp8_decode(c, e, m) == v).unwrap();
            assert_eq!(
                fp8_encode_exact(v, e, m),
                first,
                "code {b:#04x} of e{e}m{m}"
            );
        }
    }
    assert_eq!(fp8_encode_exact(-0.0, 4, 3), 0x00);
}
