//! Fault injection for the failure tests: `COMM_FAULT_INJECT=<point>[:stop]` makes this process
//! kill itself (SIGKILL), or stop itself (SIGSTOP) with `:stop`, the first time it reaches the
//! named point; `:fail` (where the point asks `fails`) makes that step return an error instead. The points sit between the steps of the bootstrap-level operations (init,
//! split, shrink, destroy), where a test cannot aim a signal from outside. Unset, a point costs
//! one comparison with a string read once.

use once_cell::sync::Lazy;
use std::sync::atomic::{AtomicBool, Ordering};

static TARGET: Lazy<Option<(String, libc::c_int)>> = Lazy::new(|| {
    let spec = std::env::var("COMM_FAULT_INJECT").ok()?;
    Some(match spec.strip_suffix(":stop") {
        Some(point) => (point.to_string(), libc::SIGSTOP),
        None => (spec, libc::SIGKILL),
    })
});

static FIRED: AtomicBool = AtomicBool::new(false);

/// Whether the process was told to fail (not die) at `name`: `COMM_FAULT_INJECT=<point>:fail`
/// makes the first pass there return an error while the process lives on.
pub(crate) fn fails(name: &str) -> bool {
    let Ok(spec) = std::env::var("COMM_FAULT_INJECT") else {
        return false;
    };
    spec.strip_suffix(":fail") == Some(name) && !FIRED.swap(true, Ordering::SeqCst)
}

/// Where the library may be told to die: see the module documentation.
pub(crate) fn point(name: &str) {
    let Some((target, signal)) = TARGET.as_ref() else {
        return;
    };
    if target == name && !FIRED.swap(true, Ordering::SeqCst) {
        crate::warn!("COMM_FAULT_INJECT: {name}: raising signal {signal}");
        // SAFETY: raise takes a signal number and affects only this process.
        unsafe { libc::raise(*signal) };
    }
}
