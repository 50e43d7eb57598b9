//! Provenance: which library this is. `ncclGetVersion` reports the NCCL API level, as NVIDIA's
//! library does, so that programs that check it keep working; `commGetVersion` says that the
//! library is comm, which version, and which git revision it was built from.

use super::types::ncclResult_t;
use super::{guard, out, write_out};
use crate::version::describe;
use std::ffi::CStr;
use std::os::raw::{c_char, c_int};

/// comm extension: comm's major version.
pub const COMM_MAJOR: c_int = 0;
/// comm extension: comm's minor version.
pub const COMM_MINOR: c_int = 1;
/// comm extension: comm's patch level.
pub const COMM_PATCH: c_int = 0;
/// comm extension: comm's version as `commGetVersion` reports it, major * 10000 + minor * 100 +
/// patch.
pub const COMM_VERSION_CODE: c_int = COMM_MAJOR * 10000 + COMM_MINOR * 100 + COMM_PATCH;

/// "comm 0.1.0 (git 0123456789ab, NCCL API 2.30.7)", NUL-terminated for C.
fn description() -> &'static CStr {
    static TEXT: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        std::ffi::CString::new(describe()).expect("the version text has no NUL byte")
    })
}

/// comm extension: comm's own version, as COMM_VERSION_CODE is written, and, where
/// `versionString` is not NULL, a static string naming the library, its version, the git
/// revision it was built from and the NCCL API level it implements, e.g.
/// "comm 0.1.0 (git 0123456789ab, NCCL API 2.30.7)". ncclGetVersion reports the NCCL API level,
/// as NVIDIA's library does. A program that may run on either library looks this function up
/// with dlsym.
#[no_mangle]
pub unsafe extern "C" fn commGetVersion(
    version: *mut c_int,
    versionString: *mut *const c_char,
) -> ncclResult_t {
    guard("commGetVersion", || {
        out(version, "version")?;
        if !versionString.is_null() {
            // SAFETY: `versionString` is the C caller's out-parameter, checked non-null.
            unsafe { write_out(versionString, "versionString", description().as_ptr()) }?;
        }
        // SAFETY: `version` is the C caller's out-parameter.
        unsafe { write_out(version, "version", COMM_VERSION_CODE) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_constants_are_cargos() {
        let cargo = [
            env!("CARGO_PKG_VERSION_MAJOR"),
            env!("CARGO_PKG_VERSION_MINOR"),
            env!("CARGO_PKG_VERSION_PATCH"),
        ];
        let ours = [COMM_MAJOR, COMM_MINOR, COMM_PATCH].map(|v| v.to_string());
        assert_eq!(ours, cargo.map(String::from));
    }

    #[test]
    fn commgetversion_names_comm_its_version_and_the_api_level() {
        let mut v = 0;
        let mut s: *const c_char = std::ptr::null();
        assert_eq!(
            // SAFETY: both out-parameters point at locals.
            unsafe { commGetVersion(&mut v, &mut s) },
            ncclResult_t::ncclSuccess
        );
        assert_eq!(v, COMM_VERSION_CODE);
        // SAFETY: commGetVersion returned a static NUL-terminated string.
        let text = unsafe { CStr::from_ptr(s) }.to_str().unwrap();
        assert!(
            text.starts_with(&format!("comm {} (git ", env!("CARGO_PKG_VERSION"))),
            "{text}"
        );
        assert!(text.ends_with("NCCL API 2.30.7)"), "{text}");
        // The string is optional; the version is not.
        assert_eq!(
            // SAFETY: a valid out-parameter and a null one, which the function allows.
            unsafe { commGetVersion(&mut v, std::ptr::null_mut()) },
            ncclResult_t::ncclSuccess
        );
        assert_eq!(
            // SAFETY: a null version pointer, which the function must refuse.
            unsafe { commGetVersion(std::ptr::null_mut(), &mut s) },
            ncclResult_t::ncclInvalidArgument
        );
    }
}
