//! The ncclParam* API (NCCL 2.30.4): read access to the library's knobs by name.

use super::types::*;
use super::{guard, input_cstr, out, write_out};
use crate::env::{knob, Knob, KNOBS};
use crate::error::Result;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int};
use std::sync::LazyLock;

/// Handles point at the knobs' declarations; string values are interned so returned pointers
/// live on.
static INTERNED: LazyLock<Mutex<HashMap<String, &'static CStr>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static KEYS: LazyLock<Vec<CString>> =
    LazyLock::new(|| KNOBS.iter().map(|k| CString::new(k.env).unwrap()).collect());
static KEY_PTRS: LazyLock<Vec<usize>> =
    LazyLock::new(|| KEYS.iter().map(|k| k.as_ptr() as usize).collect());

fn intern(s: String) -> &'static CStr {
    let mut m = INTERNED.lock();
    if let Some(c) = m.get(&s) {
        return c;
    }
    let c: &'static CStr = Box::leak(
        CString::new(s.replace('\0', " "))
            .unwrap()
            .into_boxed_c_str(),
    );
    m.insert(s, c);
    c
}

/// # Safety
/// `key` is NULL or a NUL-terminated string.
unsafe fn key_of(key: *const c_char) -> Result<&'static Knob> {
    // SAFETY: this function's contract.
    let Some(k) = (unsafe { input_cstr(key) }) else {
        return crate::invalid_arg!("key is NULL");
    };
    let k = k.to_string_lossy();
    knob(&k).map_or_else(
        || crate::invalid_arg!("{k} is not a parameter of this library"),
        Ok,
    )
}

fn knob_of(h: ncclParamHandle_t) -> Result<&'static Knob> {
    let at = h as *const Knob;
    KNOBS
        .iter()
        .copied()
        .find(|k| std::ptr::eq(*k, at))
        .map_or_else(
            || crate::invalid_arg!("{h:p} is not a parameter handle from ncclParamBind"),
            Ok,
        )
}

fn integer<T: TryFrom<i128>>(h: ncclParamHandle_t, ty: &str) -> Result<T> {
    let k = knob_of(h)?;
    let v = k.shown_value();
    let n: i128 = match crate::env::parse_size(&v) {
        Some(n) => n as i128,
        None => v.trim().parse::<i128>().map_or_else(
            |_| crate::invalid_arg!("{} = {v:?} is not an integer", k.env),
            Ok,
        )?,
    };
    T::try_from(n).map_or_else(
        |_| crate::invalid_arg!("{} = {n} does not fit in {ty}", k.env),
        Ok,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamBind(
    out_h: *mut ncclParamHandle_t,
    key: *const c_char,
) -> ncclResult_t {
    guard("ncclParamBind", || {
        out(out_h, "out")?;
        // SAFETY: `key` is the C caller's string.
        let k = unsafe { key_of(key) }?;
        // SAFETY: `out_h` is the C caller's out-parameter.
        unsafe { write_out(out_h, "out", k as *const Knob as ncclParamHandle_t) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetI8(h: ncclParamHandle_t, out_v: *mut i8) -> ncclResult_t {
    guard("ncclParamGetI8", || {
        out(out_v, "out")?;
        let v = integer::<i8>(h, "i8")?;
        // SAFETY: `out_v` is the C caller's out-parameter.
        unsafe { write_out(out_v, "out", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetI16(h: ncclParamHandle_t, out_v: *mut i16) -> ncclResult_t {
    guard("ncclParamGetI16", || {
        out(out_v, "out")?;
        let v = integer::<i16>(h, "i16")?;
        // SAFETY: `out_v` is the C caller's out-parameter.
        unsafe { write_out(out_v, "out", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetI32(h: ncclParamHandle_t, out_v: *mut i32) -> ncclResult_t {
    guard("ncclParamGetI32", || {
        out(out_v, "out")?;
        let v = integer::<i32>(h, "i32")?;
        // SAFETY: `out_v` is the C caller's out-parameter.
        unsafe { write_out(out_v, "out", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetI64(h: ncclParamHandle_t, out_v: *mut i64) -> ncclResult_t {
    guard("ncclParamGetI64", || {
        out(out_v, "out")?;
        let v = integer::<i64>(h, "i64")?;
        // SAFETY: `out_v` is the C caller's out-parameter.
        unsafe { write_out(out_v, "out", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetU8(h: ncclParamHandle_t, out_v: *mut u8) -> ncclResult_t {
    guard("ncclParamGetU8", || {
        out(out_v, "out")?;
        let v = integer::<u8>(h, "u8")?;
        // SAFETY: `out_v` is the C caller's out-parameter.
        unsafe { write_out(out_v, "out", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetU16(h: ncclParamHandle_t, out_v: *mut u16) -> ncclResult_t {
    guard("ncclParamGetU16", || {
        out(out_v, "out")?;
        let v = integer::<u16>(h, "u16")?;
        // SAFETY: `out_v` is the C caller's out-parameter.
        unsafe { write_out(out_v, "out", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetU32(h: ncclParamHandle_t, out_v: *mut u32) -> ncclResult_t {
    guard("ncclParamGetU32", || {
        out(out_v, "out")?;
        let v = integer::<u32>(h, "u32")?;
        // SAFETY: `out_v` is the C caller's out-parameter.
        unsafe { write_out(out_v, "out", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetU64(h: ncclParamHandle_t, out_v: *mut u64) -> ncclResult_t {
    guard("ncclParamGetU64", || {
        out(out_v, "out")?;
        let v = integer::<u64>(h, "u64")?;
        // SAFETY: `out_v` is the C caller's out-parameter.
        unsafe { write_out(out_v, "out", v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetStr(
    h: ncclParamHandle_t,
    out_s: *mut *const c_char,
) -> ncclResult_t {
    guard("ncclParamGetStr", || {
        out(out_s, "out")?;
        let v = intern(knob_of(h)?.shown_value()).as_ptr();
        // SAFETY: `out_s` is the C caller's out-parameter.
        unsafe { write_out(out_s, "out", v) }
    })
}

/// Copies the value as a NUL-terminated string into `out` (at most `maxLen` bytes) and stores
/// the full length, NUL included, in `len`.
#[no_mangle]
pub unsafe extern "C" fn ncclParamGet(
    h: ncclParamHandle_t,
    out_v: *mut std::os::raw::c_void,
    maxLen: c_int,
    len: *mut c_int,
) -> ncclResult_t {
    guard("ncclParamGet", || {
        let v = knob_of(h)?.shown_value();
        let bytes = v.as_bytes();
        if !len.is_null() {
            // SAFETY: `len` is the C caller's out-parameter (optional: it was not NULL).
            unsafe { write_out(len, "len", bytes.len() as c_int + 1) }?;
        }
        if maxLen > 0 {
            out(out_v, "out")?;
            let n = bytes.len().min(maxLen as usize - 1);
            // SAFETY: `out_v` is not NULL (checked) and the caller's buffer of `maxLen` bytes;
            // `n + 1 <= maxLen` bytes are written, and a C buffer cannot overlap `v`.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), out_v as *mut u8, n);
                *(out_v as *mut u8).add(n) = 0;
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetParameter(
    key: *const c_char,
    value: *mut *const c_char,
    valueLen: *mut c_int,
) -> ncclResult_t {
    guard("ncclParamGetParameter", || {
        out(value, "value")?;
        // SAFETY: `key` is the C caller's string.
        let v = unsafe { key_of(key) }?.shown_value();
        if !valueLen.is_null() {
            // SAFETY: `valueLen` is the C caller's out-parameter (optional: it was not NULL).
            unsafe { write_out(valueLen, "valueLen", v.len() as c_int) }?;
        }
        // SAFETY: `value` is the C caller's out-parameter.
        unsafe { write_out(value, "value", intern(v).as_ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetAllParameterKeys(
    table: *mut *mut *const c_char,
    tableLen: *mut c_int,
) -> ncclResult_t {
    guard("ncclParamGetAllParameterKeys", || {
        out(table, "table")?;
        out(tableLen, "tableLen")?;
        // SAFETY: `table` and `tableLen` are the C caller's out-parameters.
        unsafe {
            write_out(table, "table", KEY_PTRS.as_ptr() as *mut *const c_char)?;
            write_out(tableLen, "tableLen", KEY_PTRS.len() as c_int)
        }
    })
}

#[no_mangle]
pub extern "C" fn ncclParamDumpAll() {
    for k in KNOBS {
        println!("{}={}    # {}", k.env, k.shown_value(), k.doc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys are the declared names, a knob's NCCL name only where it declares one; values come
    /// from the declarations' defaults; a handle must be one ncclParamBind gave.
    #[test]
    fn parameters_are_the_declared_knobs() {
        let ok = ncclResult_t::ncclSuccess;
        let mut h: ncclParamHandle_t = std::ptr::null_mut();
        // SAFETY: NUL-terminated keys and valid out-pointers.
        unsafe {
            assert_eq!(ncclParamBind(&mut h, c"COMM_TREE_MAX_BYTES".as_ptr()), ok);
            let mut v = 0i64;
            assert_eq!(ncclParamGetI64(h, &mut v), ok);
            assert_eq!(v, 256 << 10);
            assert_ne!(ncclParamBind(&mut h, c"NCCL_TREE_MAX_BYTES".as_ptr()), ok);
            assert_eq!(ncclParamBind(&mut h, c"NCCL_IB_RETRY_CNT".as_ptr()), ok);
            assert_eq!(ncclParamGetI64(h, &mut v), ok);
            assert_eq!(v, 7);
            assert_ne!(ncclParamGetI64(0x10 as ncclParamHandle_t, &mut v), ok);
        }
    }
}
