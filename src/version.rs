//! Which library this is, for logs and `commGetVersion`: comm's version, the git revision it
//! was built from, and the NCCL API level it implements (`ffi::types` checks that level
//! against the header's NCCL_VERSION_CODE at compile time).

/// The NCCL API level, as NCCL_VERSION_CODE writes it (major * 10000 + minor * 100 + patch).
pub(crate) const NCCL_API_LEVEL: i32 = 23007;

/// The git revision the library was built from (build.rs), or "unknown".
pub(crate) const GIT_REVISION: &str = env!("COMM_GIT_REVISION");

/// The library's name, version, git revision and NCCL API level, e.g.
/// "comm 0.1.0 (git 0123456789ab, NCCL API 2.30.7)".
pub(crate) fn describe() -> String {
    let v = NCCL_API_LEVEL;
    format!(
        "comm {} (git {GIT_REVISION}, NCCL API {}.{}.{})",
        env!("CARGO_PKG_VERSION"),
        v / 10000,
        v / 100 % 100,
        v % 100
    )
}
