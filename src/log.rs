//! `COMM_DEBUG` (or `NCCL_DEBUG`) logging: VERSION, WARN, INFO or TRACE. Lines go to stderr, or to
//! `COMM_DEBUG_FILE` (`%h` = host, `%p` = pid), prefixed with host, pid, thread and rank so that
//! interleaved output from many ranks can be told apart. `COMM_DEBUG_SUBSYS` keeps the INFO and
//! TRACE lines of some subsystems, as NCCL's mask does; a line's subsystem is its module's.
//!
//! As NCCL's, a line is `[timestamp] host:pid:tid [rank] TAG LEVEL message`: the timestamp as
//! `NCCL_DEBUG_TIMESTAMP_FORMAT` writes it on the levels of `NCCL_DEBUG_TIMESTAMP_LEVELS` (WARN
//! by default), and TAG is COMM, or NCCL where the level came from `NCCL_DEBUG` (tools that
//! watch for "NCCL WARN" keep working); `COMM_DEBUG_TAG` chooses.

use parking_lot::Mutex;
use std::cell::Cell;
use std::io::Write;
use std::sync::LazyLock;

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
    /// COMM or NCCL.
    tag: &'static str,
    /// Which levels carry a timestamp (bit `1 << level`).
    stamped: u32,
    stamp_format: String,
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

/// The tag of log lines: `COMM_DEBUG_TAG` where it says COMM or NCCL, else NCCL when the level
/// was set through NCCL_DEBUG (`level_from`, the variable that set it), else COMM.
fn tag_of(chosen: Option<&str>, level_from: Option<&str>) -> &'static str {
    match chosen.map(|c| c.trim().to_ascii_uppercase()).as_deref() {
        Some("NCCL") => "NCCL",
        Some("COMM") => "COMM",
        _ if level_from == Some("NCCL_DEBUG") => "NCCL",
        _ => "COMM",
    }
}

/// A `COMM_DEBUG_TIMESTAMP_LEVELS` value as bits `1 << level`: level names separated by commas,
/// ALL for every one, NONE for none, a leading ^ for all but those.
fn parse_levels(v: &str) -> u32 {
    let v = v.trim();
    let (invert, list) = match v.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, v),
    };
    let mut bits = 0;
    for name in list.split(',').map(|n| n.trim().to_ascii_uppercase()) {
        bits |= match name.as_str() {
            "ALL" => u32::MAX,
            "NONE" | "" => 0,
            _ => match parse_level(&name) {
                Level::None => 0,
                level => 1 << level as u32,
            },
        };
    }
    if invert {
        !bits
    } else {
        bits
    }
}

/// The local time `now` (seconds and nanoseconds since the epoch) in a strftime `format`, where
/// `%1f` to `%9f` stand for that many digits of the fraction of the second (NCCL's extension).
fn timestamp(format: &str, secs: i64, nanos: u32) -> String {
    // The fraction goes in first, so strftime sees plain text there; "%%" stays for strftime.
    let mut pattern = String::with_capacity(format.len() + 8);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            pattern.push(c);
            continue;
        }
        match chars.peek().copied() {
            Some('%') => {
                chars.next();
                pattern.push_str("%%");
            }
            Some(d @ '1'..='9') => {
                let mut ahead = chars.clone();
                ahead.next();
                if ahead.peek() == Some(&'f') {
                    chars.next();
                    chars.next();
                    let digits = d as usize - '0' as usize;
                    let frac = format!("{nanos:09}");
                    pattern.push_str(&frac[..digits]);
                } else {
                    pattern.push('%');
                }
            }
            _ => pattern.push('%'),
        }
    }
    let Ok(pattern) = std::ffi::CString::new(pattern) else {
        return String::new();
    };
    // SAFETY: a zeroed tm is a valid out-parameter; localtime_r fills it from a valid time_t.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let t = secs as libc::time_t;
    // SAFETY: both pointers are to locals.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return String::new();
    }
    let mut buf = vec![0u8; 256];
    // SAFETY: buf holds buf.len() bytes, pattern is NUL-terminated and tm was filled above.
    let n = unsafe { libc::strftime(buf.as_mut_ptr().cast(), buf.len(), pattern.as_ptr(), &tm) };
    buf.truncate(n);
    String::from_utf8_lossy(&buf).into_owned()
}

fn now_stamp(format: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    timestamp(format, now.as_secs() as i64, now.subsec_nanos())
}

/// A duration as messages write it: "5 s", "0.25 s".
pub(crate) fn secs(d: std::time::Duration) -> String {
    format!("{} s", (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

/// A limit as messages write it: "5 s", or "no limit".
pub(crate) fn limit(d: Option<std::time::Duration>) -> String {
    d.map_or_else(|| "no limit".to_string(), secs)
}

/// The host name as the kernel reports it (std has no call for it).
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".to_string())
}

static LOGGER: LazyLock<Logger> = LazyLock::new(|| {
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
    let tag = tag_of(
        crate::env::DEBUG_TAG.text().as_deref(),
        crate::env::DEBUG.set_name(),
    );
    let stamped = crate::env::DEBUG_TIMESTAMP_LEVELS
        .text()
        .map_or(1 << Level::Warn as u32, |v| parse_levels(&v));
    Logger {
        level,
        tag,
        stamped,
        stamp_format: crate::env::DEBUG_TIMESTAMP_FORMAT.value(),
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
            write(
                Level::Version,
                format_args!("{}", crate::version::describe()),
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
    let stamp = if LOGGER.stamped & (1 << level as u32) != 0 {
        now_stamp(&LOGGER.stamp_format)
    } else {
        String::new()
    };
    let line = format!(
        "{stamp}{}:{}:{}{} {} {} {}\n",
        LOGGER.host,
        std::process::id(),
        thread_id(),
        rank,
        LOGGER.tag,
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

    #[test]
    fn durations_read_as_seconds() {
        use std::time::Duration;
        assert_eq!(limit(Some(Duration::from_secs(5))), "5 s");
        assert_eq!(limit(Some(Duration::from_millis(250))), "0.25 s");
        assert_eq!(limit(None), "no limit");
    }

    #[test]
    fn the_tag_follows_the_variable_that_set_the_level() {
        assert_eq!(tag_of(None, Some("NCCL_DEBUG")), "NCCL");
        assert_eq!(tag_of(None, Some("COMM_DEBUG")), "COMM");
        assert_eq!(tag_of(None, None), "COMM");
        assert_eq!(tag_of(Some("nccl"), Some("COMM_DEBUG")), "NCCL");
        assert_eq!(tag_of(Some("COMM"), Some("NCCL_DEBUG")), "COMM");
        assert_eq!(tag_of(Some("bogus"), Some("NCCL_DEBUG")), "NCCL");
    }

    #[test]
    fn timestamp_levels_parse_as_nccls() {
        let warn = 1 << Level::Warn as u32;
        let info = 1 << Level::Info as u32;
        assert_eq!(parse_levels("WARN"), warn);
        assert_eq!(parse_levels("warn,INFO"), warn | info);
        assert_eq!(parse_levels("NONE"), 0);
        assert_eq!(parse_levels("^ALL"), 0);
        assert_eq!(parse_levels("^WARN") & warn, 0);
        assert_ne!(parse_levels("^WARN") & info, 0);
        assert_eq!(parse_levels("ALL"), u32::MAX);
    }

    #[test]
    fn timestamps_follow_the_strftime_format_with_fractions() {
        // 2001-09-09 01:46:40 UTC; the local zone moves the hours, never the shape.
        let secs = 1_000_000_000;
        let t = timestamp("[%F %T] ", secs, 123_456_789);
        assert_eq!(t.len(), "[2001-09-09 01:46:40] ".len(), "{t}");
        assert!(t.starts_with("[2001-09-0") && t.ends_with(":40] "), "{t}");
        let t = timestamp("%S.%3f|%6f|%%3f|%9f", secs, 123_456_789);
        assert_eq!(t, "40.123|123456|%3f|123456789");
        assert_eq!(timestamp("%S.%1f", secs, 5), "40.0");
        assert_eq!(timestamp("", secs, 0), "");
    }
}
