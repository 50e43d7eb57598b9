//! The library's error type. Every fallible internal function returns [`Result`]; the C boundary
//! turns an [`Error`] into an `ncclResult_t` and remembers its message for `ncclGetLastError`.

use std::fmt;

/// The failure classes of the NCCL ABI (`ncclResult_t` values 1..=8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    UnhandledCuda = 1,
    System = 2,
    Internal = 3,
    InvalidArgument = 4,
    InvalidUsage = 5,
    Remote = 6,
    InProgress = 7,
    Timeout = 8,
}

impl ErrorKind {
    pub fn code(self) -> i32 {
        self as i32
    }

    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::UnhandledCuda => "unhandled cuda error",
            ErrorKind::System => "system error",
            ErrorKind::Internal => "internal error",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::InvalidUsage => "invalid usage",
            ErrorKind::Remote => "remote error",
            ErrorKind::InProgress => "in progress",
            ErrorKind::Timeout => "timeout",
        }
    }
}

/// An error with its class and a message that says what went wrong in the caller's terms
/// (which argument, which rule, which rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub msg: String,
    /// The rank whose loss caused this error, when a peer was lost (the first one known: a
    /// peer that failed because it lost another names that other).
    pub lost: Option<usize>,
    /// Where ranks were found to call different operations: the tag this rank expected and
    /// the tag a peer's message carried (`crate::tag`), so the peers told of the failure can
    /// name both operations too.
    pub disagreed: Option<(u64, u64)>,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Error {
        Error {
            kind,
            msg: msg.into(),
            lost: None,
            disagreed: None,
        }
    }

    /// ncclRemoteError: rank `lost` is gone (exited, aborted, unreachable).
    pub fn lost_peer(lost: usize, msg: impl Into<String>) -> Error {
        Error {
            kind: ErrorKind::Remote,
            msg: msg.into(),
            lost: Some(lost),
            disagreed: None,
        }
    }

    /// The same error with `context` prepended, e.g. "AllReduce: " + "rank 3 exited".
    pub fn context(self, context: impl fmt::Display) -> Error {
        Error {
            kind: self.kind,
            msg: format!("{context}: {}", self.msg),
            lost: self.lost,
            disagreed: self.disagreed,
        }
    }

    /// A system error from the current `errno`, naming the call that failed.
    pub fn last_os(what: impl fmt::Display) -> Error {
        Error::from_io(what, std::io::Error::last_os_error())
    }

    pub fn from_io(what: impl fmt::Display, e: std::io::Error) -> Error {
        let kind = match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => ErrorKind::Timeout,
            std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof => ErrorKind::Remote,
            _ => ErrorKind::System,
        };
        Error::new(kind, format!("{what}: {e}"))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.msg, self.kind.name())
    }
}

impl std::error::Error for Error {}

/// `Err(Error)` of kind `InvalidArgument` with a formatted message.
#[macro_export]
macro_rules! invalid_arg {
    ($($arg:tt)*) => { Err($crate::error::Error::new($crate::error::ErrorKind::InvalidArgument, format!($($arg)*))) };
}

/// `Err(Error)` of kind `InvalidUsage` with a formatted message.
#[macro_export]
macro_rules! invalid_usage {
    ($($arg:tt)*) => { Err($crate::error::Error::new($crate::error::ErrorKind::InvalidUsage, format!($($arg)*))) };
}

/// `Err(Error)` of kind `Internal` with a formatted message.
#[macro_export]
macro_rules! internal_err {
    ($($arg:tt)*) => { Err($crate::error::Error::new($crate::error::ErrorKind::Internal, format!($($arg)*))) };
}

/// `Err(Error)` of kind `Remote` with a formatted message.
#[macro_export]
macro_rules! remote_err {
    ($($arg:tt)*) => { Err($crate::error::Error::new($crate::error::ErrorKind::Remote, format!($($arg)*))) };
}

/// `Err(Error)` of kind `System` with a formatted message.
#[macro_export]
macro_rules! system_err {
    ($($arg:tt)*) => { Err($crate::error::Error::new($crate::error::ErrorKind::System, format!($($arg)*))) };
}

/// `Err(Error)` of kind `Timeout` with a formatted message.
#[macro_export]
macro_rules! timeout_err {
    ($($arg:tt)*) => { Err($crate::error::Error::new($crate::error::ErrorKind::Timeout, format!($($arg)*))) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_the_nccl_abi() {
        assert_eq!(ErrorKind::UnhandledCuda.code(), 1);
        assert_eq!(ErrorKind::InvalidArgument.code(), 4);
        assert_eq!(ErrorKind::InvalidUsage.code(), 5);
        assert_eq!(ErrorKind::Remote.code(), 6);
        assert_eq!(ErrorKind::Timeout.code(), 8);
    }

    #[test]
    fn context_keeps_kind_and_prefixes_message() {
        let e: Result<()> = invalid_arg!("count {} too large", 7);
        let e = e.unwrap_err().context("AllReduce");
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert_eq!(e.msg, "AllReduce: count 7 too large");
    }

    #[test]
    fn io_errors_map_to_remote_or_system() {
        let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        assert_eq!(Error::from_io("read", eof).kind, ErrorKind::Remote);
        let other = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert_eq!(Error::from_io("open", other).kind, ErrorKind::System);
    }
}
