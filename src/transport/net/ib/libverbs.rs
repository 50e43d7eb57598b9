//! The verbs interface over `libibverbs.so.1`, opened at run time with versioned symbol
//! look-ups (`IBVERBS_1.1` for the base set, as NCCL does), so that the library has no
//! load-time dependency on rdma-core and works where it is absent.

use super::verbs::{Device, Provider};
use crate::error::Result;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

/// The verbs library of this machine.
pub(super) struct Library;

/// The functions looked up so far.
struct Syms {
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    free_device_list: unsafe extern "C" fn(*mut *mut c_void),
    get_device_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
}

// SAFETY: plain function pointers into a library that stays loaded.
unsafe impl Send for Syms {}
// SAFETY: as above.
unsafe impl Sync for Syms {}

static SYMS: once_cell::sync::OnceCell<std::result::Result<Syms, String>> =
    once_cell::sync::OnceCell::new();

/// `name@IBVERBS_1.1` from the library `h`, as a function pointer of type `T`.
///
/// # Safety
/// `T` must be a function pointer type matching the symbol's C signature.
unsafe fn sym<T: Copy>(h: *mut c_void, name: &CStr) -> std::result::Result<T, String> {
    // SAFETY: a valid handle and NUL-terminated names.
    let p = unsafe { libc::dlvsym(h, name.as_ptr(), c"IBVERBS_1.1".as_ptr()) };
    if p.is_null() {
        return Err(format!(
            "libibverbs.so.1 has no {}@IBVERBS_1.1",
            name.to_string_lossy()
        ));
    }
    // SAFETY: the caller guarantees T is the symbol's function pointer type.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

fn load() -> std::result::Result<&'static Syms, String> {
    SYMS.get_or_init(|| {
        let name = c"libibverbs.so.1";
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err("libibverbs.so.1 is not installed (rdma-core)".to_string());
        }
        // SAFETY: the symbols have these C signatures (verbs.h).
        unsafe {
            Ok(Syms {
                get_device_list: sym(h, c"ibv_get_device_list")?,
                free_device_list: sym(h, c"ibv_free_device_list")?,
                get_device_name: sym(h, c"ibv_get_device_name")?,
            })
        }
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// The names of the RDMA devices the verbs library lists.
fn device_names(s: &Syms) -> Vec<String> {
    let mut n: c_int = 0;
    // SAFETY: the out-pointer is valid; the list is freed below.
    let list = unsafe { (s.get_device_list)(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let names = (0..n.max(0) as usize)
        .filter_map(|i| {
            // SAFETY: the list holds `n` device pointers.
            let d = unsafe { *list.add(i) };
            // SAFETY: a device of the list; the name is a NUL-terminated string it owns.
            let name = unsafe { (s.get_device_name)(d) };
            // SAFETY: as above.
            (!name.is_null()).then(|| {
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned()
            })
        })
        .collect();
    // SAFETY: the list came from get_device_list.
    unsafe { (s.free_device_list)(list) };
    names
}

impl Provider for Library {
    fn open(&self) -> Result<std::result::Result<Arc<dyn Device>, String>> {
        let syms = match load() {
            Ok(s) => s,
            Err(why) => return Ok(Err(why)),
        };
        let names = device_names(syms);
        if names.is_empty() {
            return Ok(Err("libibverbs lists no RDMA device".to_string()));
        }
        Ok(Err(format!(
            "RDMA devices {} found, but this build drives verbs only through its test model: the hardware path is not written yet",
            names.join(", ")
        )))
    }
}
