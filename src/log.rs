//! `COMM_DEBUG` (or `NCCL_DEBUG`) logging: VERSION, WARN, INFO or TRACE. Lines go to stderr, or to
//! `COMM_DEBUG_FILE` (`%h` = host, `%p` = pid), prefixed with host, pid, thread and rank so that
//! interleaved output from many ranks can be told apart. `COMM_DEBUG_SUBSYS` keeps the INFO and
//! TRACE lines of some subsystems, as NCCL's mask does; a line's subsystem is its module's.

use once_cell::sync::Lazy;
use parking_lot::Mutex;
use std::cell::Cell;
use std::io::Write;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    None = 0,
    Version = 1,
    Warn = 2,
    Info = 3,
    Trace = 4,
}

pub(crate) struct Logger {
    pub level: Level,
    /// The subsystems whose INFO and TRACE lines are written (`SUBSYS` bits).
    mask: u32,
    host: String,
    sink: Mutex<Box<dyn Write + Send>>,
}

/// NCCL's subsystem names, a bit each.
const SUBSYS: &[&str] = &[
    "INIT",
    "COLL",
    "P2P",
    "SHM",
    "NET",
    "GRAPH",
    "TUNING",
    "ENV",
    "ALLOC",
    "REG",
    "BOOTSTRAP",
];

fn subsys_bit(name: &str) -> u32 {
    SUBSYS.iter().position(|s| *s == name).map_or(0, |i| 1 << i)
}

/// A `COMM_DEBUG_SUBSYS` value as a mask: names separated by commas, ALL for every one, a
/// leading ^ for all but those. Unknown names count for nothing.
fn parse_subsys(v: &str) -> u32 {
    let v = v.trim();
    let (invert, list) = match v.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, v),
    };
    let mut mask = 0;
    for name in list.split(',').map(|n| n.trim().to_ascii_uppercase()) {
        mask |= if name == "ALL" {
            u32::MAX
        } else {
            subsys_bit(&name)
        };
    }
    if invert {
        !mask
    } else {
        mask
    }
}

/// The subsystem of a line written from module `path` (`module_path!()`).
fn subsys_of(path: &str) -> u32 {
    let path = path.strip_prefix("comm::").unwrap_or(path);
    let name = [
        ("bootstrap", "BOOTSTRAP"),
        ("transport::net", "NET"),
        ("transport::shm", "SHM"),
        ("transport", "P2P"),
        ("algo::tuner", "TUNING"),
        ("algo", "COLL"),
        ("exec", "COLL"),
        ("reduce", "COLL"),
        ("group", "COLL"),
        ("ffi::coll", "COLL"),
        ("topo", "GRAPH"),
        ("window", "REG"),
        ("ffi::mem", "REG"),
        ("env", "ENV"),
        ("cuda", "ALLOC"),
    ]
    .iter()
    .find(|(prefix, _)| path.starts_with(prefix))
    .map_or("INIT", |(_, name)| name);
    subsys_bit(name)
}

fn parse_level(s: &str) -> Level {
    match s.trim().to_ascii_uppercase().as_str() {
        "VERSION" => Level::Version,
        "WARN" => Level::Warn,
        "INFO" => Level::Info,
        "TRACE" | "ABORT" => Level::Trace,
        _ => Level::None,
    }
}

/// The host name as the kernel reports it (std has no call for it).
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".to_string())
}

static LOGGER: Lazy<Logger> = Lazy::new(|| {
    let level = crate::env::DEBUG
        .text()
        .map(|v| parse_level(&v))
        .unwrap_or(Level::None);
    let host = hostname();
    let sink: Box<dyn Write + Send> = match crate::env::DEBUG_FILE.text() {
        Some(pattern) if level > Level::None => {
            let path = pattern
                .replace("%h", &host)
                .replace("%p", &std::process::id().to_string());
            match std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
            {
                Ok(f) => Box::new(f),
                Err(_) => Box::new(std::io::stderr()),
            }
        }
        _ => Box::new(std::io::stderr()),
    };
    let mask = crate::env::DEBUG_SUBSYS
        .text()
        .map_or(u32::MAX, |v| parse_subsys(&v));
    Logger {
        level,
        mask,
        host,
        sink: Mutex::new(sink),
    }
});

thread_local! {
    static RANK: Cell<Option<i32>> = const { Cell::new(None) };
}

/// Tags log lines written by this thread with `rank` until the guard is dropped.
pub(crate) struct RankScope(Option<i32>);

pub(crate) fn rank_scope(rank: i32) -> RankScope {
    RankScope(RANK.with(|r| r.replace(Some(rank))))
}

impl Drop for RankScope {
    fn drop(&mut self) {
        RANK.with(|r| r.set(self.0));
    }
}

pub(crate) fn enabled(level: Level) -> bool {
    LOGGER.level >= level
}

/// Whether a line of `level` from module `path` is written: warnings always (at WARN and
/// above), INFO and TRACE lines where their subsystem is in the mask.
pub(crate) fn enabled_in(level: Level, path: &str) -> bool {
    enabled(level) && (level <= Level::Warn || LOGGER.mask & subsys_of(path) != 0)
}

/// The library's version, once per process, when the level is VERSION or above (as NCCL's
/// "NCCL version" line at the first communicator's init).
pub(crate) fn version_once() {
    static SAID: std::sync::Once = std::sync::Once::new();
    if enabled(Level::Version) {
        SAID.call_once(|| {
            let v = crate::ffi::types::NCCL_VERSION_CODE;
            write(
                Level::Version,
                format_args!(
                    "comm {} (NCCL API {}.{}.{})",
                    env!("CARGO_PKG_VERSION"),
                    v / 10000,
                    v / 100 % 100,
                    v % 100
                ),
            )
        });
    }
}

fn thread_id() -> i64 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) }
}

pub(crate) fn write(level: Level, msg: std::fmt::Arguments<'_>) {
    let tag = match level {
        Level::Warn => "WARN",
        Level::Info => "INFO",
        Level::Trace => "TRACE",
        _ => "VERSION",
    };
    let rank = RANK
        .with(|r| r.get())
        .map(|r| format!(" [{r}]"))
        .unwrap_or_default();
    let line = format!(
        "{}:{}:{}{} COMM {} {}\n",
        LOGGER.host,
        std::process::id(),
        thread_id(),
        rank,
        tag,
        msg
    );
    let mut sink = LOGGER.sink.lock();
    let _ = sink.write_all(line.as_bytes());
    let _ = sink.flush();
}

#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { if $crate::log::enabled($crate::log::Level::Warn) { $crate::log::write($crate::log::Level::Warn, format_args!($($arg)*)) } };
}

#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { if $crate::log::enabled_in($crate::log::Level::Info, module_path!()) { $crate::log::write($crate::log::Level::Info, format_args!($($arg)*)) } };
}

#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => { if $crate::log::enabled_in($crate::log::Level::Trace, module_path!()) { $crate::log::write($crate::log::Level::Trace, format_args!($($arg)*)) } };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_case_insensitively() {
        assert_eq!(parse_level("warn"), Level::Warn);
        assert_eq!(parse_level("INFO"), Level::Info);
        assert_eq!(parse_level("Trace"), Level::Trace);
        assert_eq!(parse_level("bogus"), Level::None);
        assert!(Level::Trace > Level::Info && Level::Info > Level::Warn);
    }

    #[test]
    fn subsystems_select_lines_by_module() {
        let net = parse_subsys("NET,init");
        assert_ne!(net & subsys_of("comm::transport::net::socket"), 0);
        assert_ne!(net & subsys_of("comm::comm"), 0);
        assert_eq!(net & subsys_of("comm::transport::shm"), 0);
        assert_eq!(net & subsys_of("comm::exec::host"), 0);
        let not_init = parse_subsys("^INIT");
        assert_eq!(not_init & subsys_of("comm::ffi::init"), 0);
        assert_ne!(not_init & subsys_of("comm::bootstrap::root"), 0);
        assert_eq!(parse_subsys("ALL"), u32::MAX);
        assert_eq!(parse_subsys("BOGUS"), 0);
    }
}
