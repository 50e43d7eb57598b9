//! Fault injection for the failure tests: `COMM_FAULT_INJECT=<point>[:stop|:fail]` makes this
//! process kill itself (SIGKILL), stop itself (SIGSTOP) with `:stop`, or, with `:fail` at a point
//! that asks `fails`, fail that step with an error while it lives on, the first time it reaches
//! the named point. The points sit between the steps of the bootstrap-level operations (init,
//! split, shrink, destroy), where a test cannot aim a signal from outside. Unset, a point costs
//! one comparison with a string read once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::LazyLock;

/// What happens at the point named: a signal raised, or an error returned.
#[derive(PartialEq, Eq)]
enum Action {
    Raise(libc::c_int),
    Fail,
}

static TARGET: LazyLock<Option<(String, Action)>> = LazyLock::new(|| {
    let spec = std::env::var("COMM_FAULT_INJECT").ok()?;
    Some(if let Some(point) = spec.strip_suffix(":stop") {
        (point.to_string(), Action::Raise(libc::SIGSTOP))
    } else if let Some(point) = spec.strip_suffix(":fail") {
        (point.to_string(), Action::Fail)
    } else {
        (spec, Action::Raise(libc::SIGKILL))
    })
});

static FIRED: AtomicBool = AtomicBool::new(false);

/// Whether the first pass at `name` takes `action`.
fn fires(name: &str, action: impl Fn(&Action) -> bool) -> Option<&'static Action> {
    let (target, what) = TARGET.as_ref()?;
    (target == name && action(what) && !FIRED.swap(true, Ordering::SeqCst)).then_some(what)
}

/// Whether the process was told to fail (not die) at `name` (`<point>:fail`): the caller then
/// returns an error from that step.
pub(crate) fn fails(name: &str) -> bool {
    fires(name, |a| *a == Action::Fail).is_some()
}

/// Where the library may be told to die: see the module documentation.
pub(crate) fn point(name: &str) {
    if let Some(Action::Raise(signal)) = fires(name, |a| matches!(a, Action::Raise(_))) {
        crate::warn!("COMM_FAULT_INJECT: {name}: raising signal {signal}");
        // SAFETY: raise takes a signal number and affects only this process.
        unsafe { libc::raise(*signal) };
    }
}
