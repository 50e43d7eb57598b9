//! `COMM_DEBUG` (or `NCCL_DEBUG`) logging: VERSION, WARN, INFO or TRACE. Lines go to stderr, or to
//! `COMM_DEBUG_FILE` (`%h` = host, `%p` = pid), prefixed with host, pid, thread and rank so that
//! interleaved output from many ranks can be told apart.

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
    host: String,
    sink: Mutex<Box<dyn Write + Send>>,
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
    Logger {
        level,
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
    ($($arg:tt)*) => { if $crate::log::enabled($crate::log::Level::Info) { $crate::log::write($crate::log::Level::Info, format_args!($($arg)*)) } };
}

#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => { if $crate::log::enabled($crate::log::Level::Trace) { $crate::log::write($crate::log::Level::Trace, format_args!($($arg)*)) } };
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
}
