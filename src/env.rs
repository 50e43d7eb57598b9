//! Environment knobs, each declared once below: the variable it is read from, the NCCL name it
//! is also read from (where NCCL has the same knob, so deployments tuned for NCCL keep working),
//! its type, its default and a line of documentation. Users read a knob through its
//! declaration (`env::SLICE_BYTES.size()`); `ncclParam*` and `ncclParamDumpAll` serve the same
//! declarations, so what they report is what the library uses.
//!
//! A knob whose default depends on the communicator (rank count, oversubscription, the
//! network) declares none: its user computes it, and its documentation says how.

use std::time::Duration;

/// How a knob's value is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Free text.
    Text,
    /// Free text that reports never show (a shared secret).
    Secret,
    /// An integer.
    Int,
    /// 1/true/yes/on or 0/false/no/off.
    Flag,
    /// Bytes, with an optional K/M/G suffix (binary units).
    Size,
    /// Seconds, fractions allowed; zero or negative means no limit.
    Seconds,
}

/// One environment knob.
pub(crate) struct Knob {
    /// The variable it is read from.
    pub(crate) env: &'static str,
    /// NCCL's name for the same knob, read when `env` is unset.
    pub(crate) nccl: Option<&'static str>,
    pub(crate) kind: Kind,
    /// The value when unset; empty where the user computes it (see `doc`).
    pub(crate) default: &'static str,
    pub(crate) doc: &'static str,
}

macro_rules! knobs {
    ($($id:ident: $kind:ident $env:literal $(or $nccl:literal)? = $default:literal, $doc:literal;)*) => {
        $(pub(crate) static $id: Knob = Knob {
            env: $env,
            nccl: knobs!(@nccl $($nccl)?),
            kind: Kind::$kind,
            default: $default,
            doc: $doc,
        };)*
        /// Every knob, in the order ncclParamDumpAll lists them.
        pub(crate) static KNOBS: &[&Knob] = &[$(&$id),*];
    };
    (@nccl) => { None };
    (@nccl $nccl:literal) => { Some($nccl) };
}

knobs! {
    DEBUG: Text "COMM_DEBUG" or "NCCL_DEBUG" = "",
        "log level: VERSION, WARN, INFO or TRACE";
    DEBUG_SUBSYS: Text "COMM_DEBUG_SUBSYS" or "NCCL_DEBUG_SUBSYS" = "",
        "INFO and TRACE lines of these subsystems only (INIT, COLL, P2P, SHM, NET, GRAPH, TUNING, ENV, ALLOC, REG, BOOTSTRAP, ALL; ^ leaves them out); unset: all";
    DEBUG_FILE: Text "COMM_DEBUG_FILE" or "NCCL_DEBUG_FILE" = "",
        "log to this file instead of stderr (%h host, %p pid)";
    DEBUG_TAG: Text "COMM_DEBUG_TAG" = "",
        "the word log lines begin their level with, COMM (COMM WARN ...) or NCCL (NCCL WARN ..., for tools that read NCCL's logs); unset: NCCL when the level came from NCCL_DEBUG, else COMM";
    DEBUG_TIMESTAMP_FORMAT: Text "COMM_DEBUG_TIMESTAMP_FORMAT" or "NCCL_DEBUG_TIMESTAMP_FORMAT" = "[%F %T] ",
        "strftime format of the timestamp that begins a log line; %1f to %9f: that many digits of the second's fraction";
    DEBUG_TIMESTAMP_LEVELS: Text "COMM_DEBUG_TIMESTAMP_LEVELS" or "NCCL_DEBUG_TIMESTAMP_LEVELS" = "WARN",
        "levels whose lines carry a timestamp: VERSION, WARN, INFO, TRACE, ALL or NONE, separated by commas; ^ for all but those";
    ALGO: Text "COMM_ALGO" or "NCCL_ALGO" = "",
        "allowed algorithms, e.g. ring,tree or ^direct";
    COMM_ID: Text "COMM_COMM_ID" or "NCCL_COMM_ID" = "",
        "host:port of the bootstrap root, instead of a unique id";
    SECRET: Secret "COMM_SECRET" = "",
        "with NCCL_COMM_ID: the secret every rank shares, from which the unique id is derived";
    SOCKET_IFNAME: Text "COMM_SOCKET_IFNAME" or "NCCL_SOCKET_IFNAME" = "",
        "interfaces to use: prefixes, ^excluded, =exact";
    SOCKET_FAMILY: Text "COMM_SOCKET_FAMILY" or "NCCL_SOCKET_FAMILY" = "",
        "AF_INET or AF_INET6";
    COMM_BLOCKING: Flag "COMM_COMM_BLOCKING" or "NCCL_COMM_BLOCKING" = "1",
        "default of ncclConfig_t.blocking";
    SHM_DISABLE: Flag "COMM_SHM_DISABLE" or "NCCL_SHM_DISABLE" = "0",
        "1: ranks of one host talk over the network transport instead of shared memory";
    RUNTIME_CONNECT: Flag "COMM_RUNTIME_CONNECT" or "NCCL_RUNTIME_CONNECT" = "1",
        "1: connect to a peer when a schedule first needs it; 0: connect every peer at init";
    NET: Text "COMM_NET" or "NCCL_NET" = "",
        "network transport between hosts: socket or ib (unset: ib where every rank has a device, else socket)";
    IB_DISABLE: Flag "COMM_IB_DISABLE" or "NCCL_IB_DISABLE" = "0",
        "1: never use InfiniBand, the network transport is TCP sockets";
    IB_HCA: Text "COMM_IB_HCA" or "NCCL_IB_HCA" = "",
        "InfiniBand devices and ports to use: mlx5_0:1,mlx5_1 (prefixes; ^ excludes, = exact)";
    IB_GID_INDEX: Int "COMM_IB_GID_INDEX" or "NCCL_IB_GID_INDEX" = "",
        "GID index for RoCE (default: the first RoCE v2 entry with an IPv4-mapped address)";
    IB_TIMEOUT: Int "COMM_IB_TIMEOUT" or "NCCL_IB_TIMEOUT" = "20",
        "InfiniBand ack timeout exponent (4.096 us x 2^value)";
    IB_RETRY_CNT: Int "COMM_IB_RETRY_CNT" or "NCCL_IB_RETRY_CNT" = "7",
        "InfiniBand transport retries before a queue pair fails";
    IB_SL: Int "COMM_IB_SL" or "NCCL_IB_SL" = "0",
        "InfiniBand service level";
    IB_TC: Int "COMM_IB_TC" or "NCCL_IB_TC" = "0",
        "InfiniBand traffic class (RoCE)";
    IB_QPS_PER_CONNECTION: Int "COMM_IB_QPS_PER_CONNECTION" or "NCCL_IB_QPS_PER_CONNECTION" = "1",
        "InfiniBand queue pairs per peer; message pieces alternate between them (1-16)";
    IB_SLOT_BYTES: Size "COMM_IB_SLOT_BYTES" = "256K",
        "InfiniBand: bytes of each of the 8 receive slots per peer";
    // One socket per peer by default: 2 and 4 measured no faster between network namespaces
    // (bench/RESULTS.md, "Sockets per peer across network namespaces").
    NSOCKS_PERTHREAD: Int "COMM_NSOCKS_PERTHREAD" or "NCCL_NSOCKS_PERTHREAD" = "1",
        "TCP sockets per peer (times SOCKET_NTHREADS, at most 64); large messages are cut across them";
    SOCKET_NTHREADS: Int "COMM_SOCKET_NTHREADS" or "NCCL_SOCKET_NTHREADS" = "1",
        "multiplies NSOCKS_PERTHREAD; no helper threads are started (the executor drives every socket)";
    HOSTID: Text "COMM_HOSTID" or "NCCL_HOSTID" = "",
        "host identity (default: boot id, hostname and network namespace)";
    RING_BY_HOST: Flag "COMM_RING_BY_HOST" = "1",
        "rings visit each host's ranks together, crossing each host boundary once (0: rank order)";
    HIER_DIRECT_MAX_BYTES: Size "COMM_HIER_DIRECT_MAX_BYTES" = "",
        "hierarchical all-reduce: largest part exchanged one-shot between hosts (default: any with 2 hosts, 64K with 3-16, none with more)";
    LOCAL_REGISTER: Flag "COMM_LOCAL_REGISTER" or "NCCL_LOCAL_REGISTER" = "1",
        "peers read registered device buffers in place (0: always staged)";
    INIT_TIMEOUT: Seconds "COMM_INIT_TIMEOUT" = "600",
        "seconds an init waits for all ranks (0 = forever)";
    BOOTSTRAP_HANDSHAKE_TIMEOUT: Seconds "COMM_BOOTSTRAP_HANDSHAKE_TIMEOUT" = "5",
        "seconds a connecting peer has to authenticate";
    TIMEOUT: Seconds "COMM_TIMEOUT" = "0",
        "seconds an operation may go without progress before ncclTimeout (0 = never)";
    WARN_AFTER: Seconds "COMM_WARN_AFTER" = "60",
        "seconds without progress before a warning names the ranks waited for (0: the default)";
    SPIN_US: Int "COMM_SPIN_US" = "",
        "microseconds to spin before sleeping (default 50; 1000 with peers across the network; 0 when ranks outnumber cores)";
    SLICE_BYTES: Size "COMM_SLICE_BYTES" = "524288",
        "pipeline slice of ring and tree algorithms";
    DIRECT_MAX_BYTES: Size "COMM_DIRECT_MAX_BYTES" = "",
        "largest all-reduce done one-shot (default 64K up to 2 ranks, 32K up to 4, 8K up to 16, none beyond; set, at any rank count)";
    TREE_MAX_BYTES: Size "COMM_TREE_MAX_BYTES" = "262144",
        "largest message that prefers the tree to the ring (past 16 hosts, times hosts/16)";
    SHM_SLOTS: Int "COMM_SHM_SLOTS" = "16",
        "slots per shared-memory FIFO (2-1024)";
    SHM_SLOT_BYTES: Size "COMM_SHM_SLOT_BYTES" = "65536",
        "bytes per shared-memory FIFO slot (4K-64M)";
    SHM_PULL: Flag "COMM_SHM_PULL" = "1",
        "let receivers copy large messages straight from the sender";
    SHM_PULL_THRESHOLD: Size "COMM_SHM_PULL_THRESHOLD" = "",
        "smallest message sent by pull (default 32K between ranks of one process, 1M between processes)";
    YIELD_US: Int "COMM_YIELD_US" = "",
        "microseconds to yield the core before sleeping (default 0; 200 when ranks outnumber cores)";
    SHM_HUGEPAGES: Flag "COMM_SHM_HUGEPAGES" = "1",
        "move large buffers onto huge pages before other processes copy them";
    SHM_HUGEPAGES_FROM: Size "COMM_SHM_HUGEPAGES_FROM" = "4194304",
        "smallest buffer moved onto huge pages";
    SHM_REPLY: Text "COMM_SHM_REPLY" = "auto",
        "two-rank all-reduce of 32 MiB or more out of place on one host: folded bytes go back forwarded through the slots (forward), into the peer's buffer (writeback), or whichever measured faster lately (auto)";
    DEVICE: Flag "COMM_DEVICE" = "1",
        "0 keeps every communicator on host memory";
    DEVICE_SLOT_BYTES: Size "COMM_DEVICE_SLOT_BYTES" = "8388608",
        "device message slot size";
    DEVICE_ONESHOT_MAX: Size "COMM_DEVICE_ONESHOT_MAX" = "262144",
        "largest device all-reduce done one-shot";
    DEVICE_TWOSHOT_MAX: Size "COMM_DEVICE_TWOSHOT_MAX" = "67108864",
        "largest device all-reduce done two-shot";
    WIN_CHANNELS: Int "COMM_WIN_CHANNELS" or "NCCL_WIN_CHANNELS" = "32",
        "signal-pad channels per window, 1-4096 (rank 0's value applies)";
    WIN_NET: Flag "COMM_WIN_NET" = "0",
        "1: windows reach every other rank over the network transport, as if it were on another host (to test that path on one host)";
    CUDA_DEVICE_MAX_CONNECTIONS: Int "CUDA_DEVICE_MAX_CONNECTIONS" = "8",
        "CUDA's own: hardware queues per GPU context; read to warn when ranks that are threads of one process on one GPU outnumber them";
}

impl Knob {
    /// The value set in the environment: `env`, else the NCCL name; empty values count as unset.
    pub(crate) fn set_value(&self) -> Option<String> {
        std::iter::once(self.env)
            .chain(self.nccl)
            .find_map(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()))
    }

    /// Which of the knob's variables is set (the comm name first), for messages.
    pub(crate) fn set_name(&self) -> Option<&'static str> {
        std::iter::once(self.env)
            .chain(self.nccl)
            .find(|name| std::env::var(name).is_ok_and(|v| !v.trim().is_empty()))
    }

    /// The value in effect as text: the environment's, else the default (empty: none).
    pub(crate) fn value(&self) -> String {
        self.set_value().unwrap_or_else(|| self.default.to_string())
    }

    /// The value as reports show it: a secret is only said to be set.
    pub(crate) fn shown_value(&self) -> String {
        match (self.kind, self.set_value()) {
            (Kind::Secret, Some(_)) => "(set)".to_string(),
            (Kind::Secret, None) => String::new(),
            _ => self.value(),
        }
    }

    /// The environment's value parsed with `parse`; a value it rejects is logged and ignored.
    fn parsed<T>(&self, kind: Kind, what: &str, parse: impl Fn(&str) -> Option<T>) -> Option<T> {
        debug_assert_eq!(self.kind, kind, "{} is declared {:?}", self.env, self.kind);
        let raw = self.set_value()?;
        let v = parse(&raw);
        if v.is_none() {
            crate::warn!("ignoring {}={raw:?}: not {what}", self.env);
        }
        v
    }

    /// The declared default parsed with `parse` (the tests check that every default parses).
    fn declared<T>(&self, parse: impl Fn(&str) -> Option<T>) -> T {
        parse(self.default).unwrap_or_else(|| panic!("{} declares no usable default", self.env))
    }

    /// Text set in the environment.
    pub(crate) fn text(&self) -> Option<String> {
        debug_assert!(matches!(self.kind, Kind::Text | Kind::Secret));
        self.set_value()
    }

    /// An integer set in the environment.
    pub(crate) fn int_if_set(&self) -> Option<i64> {
        self.parsed(Kind::Int, "an integer", parse_int)
    }

    /// The declared default of an integer knob.
    pub(crate) fn default_int(&self) -> i64 {
        self.declared(parse_int)
    }

    /// An integer knob's value: the environment's, else the default.
    pub(crate) fn int(&self) -> i64 {
        self.int_if_set().unwrap_or_else(|| self.default_int())
    }

    /// A flag knob's value: the environment's, else the default.
    pub(crate) fn flag(&self) -> bool {
        self.parsed(Kind::Flag, "a boolean", parse_flag)
            .unwrap_or_else(|| self.declared(parse_flag))
    }

    /// A size set in the environment.
    pub(crate) fn size_if_set(&self) -> Option<usize> {
        self.parsed(Kind::Size, "a size", parse_size)
    }

    /// The declared default of a size knob.
    pub(crate) fn default_size(&self) -> usize {
        self.declared(parse_size)
    }

    /// A size knob's value: the environment's, else the default.
    pub(crate) fn size(&self) -> usize {
        self.size_if_set().unwrap_or_else(|| self.default_size())
    }

    /// A seconds knob set in the environment: `Some(None)` for no limit.
    pub(crate) fn seconds_if_set(&self) -> Option<Option<Duration>> {
        self.parsed(Kind::Seconds, "a number of seconds", parse_seconds)
    }

    /// The declared default of a seconds knob: `None` for no limit.
    pub(crate) fn default_seconds(&self) -> Option<Duration> {
        self.declared(parse_seconds)
    }

    /// A seconds knob's value, the environment's else the default: `None` for no limit.
    pub(crate) fn seconds(&self) -> Option<Duration> {
        self.seconds_if_set()
            .unwrap_or_else(|| self.default_seconds())
    }
}

/// The knob a C caller names, by its variable or its NCCL name.
pub(crate) fn knob(key: &str) -> Option<&'static Knob> {
    KNOBS
        .iter()
        .copied()
        .find(|k| k.env == key || k.nccl == Some(key))
}

fn parse_int(raw: &str) -> Option<i64> {
    raw.trim().parse::<i64>().ok()
}

fn parse_flag(raw: &str) -> Option<bool> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Seconds, fractions allowed; zero or negative gives `Some(None)`, no limit.
fn parse_seconds(raw: &str) -> Option<Option<Duration>> {
    match raw.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Some(Some(Duration::from_secs_f64(v))),
        Ok(_) => Some(None),
        Err(_) => None,
    }
}

/// A byte size with an optional K/M/G suffix (binary units).
pub(crate) fn parse_size(raw: &str) -> Option<usize> {
    let s = raw.trim();
    let (digits, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1usize << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.trim().parse::<usize>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("8"), Some(8));
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("2m"), Some(2 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
    }

    /// Every declared default parses as its knob's type; names are unique and NCCL names are
    /// NCCL's.
    #[test]
    fn declarations_are_consistent() {
        let mut names = std::collections::HashSet::new();
        for k in KNOBS {
            assert!(names.insert(k.env), "{} declared twice", k.env);
            if let Some(n) = k.nccl {
                assert!(names.insert(n), "{n} declared twice");
                assert!(n.starts_with("NCCL_"), "{n}");
            }
            assert!(!k.doc.is_empty(), "{} has no doc", k.env);
            if k.default.is_empty() {
                continue;
            }
            let parses = match k.kind {
                Kind::Text | Kind::Secret => true,
                Kind::Int => parse_int(k.default).is_some(),
                Kind::Flag => parse_flag(k.default).is_some(),
                Kind::Size => parse_size(k.default).is_some(),
                Kind::Seconds => parse_seconds(k.default).is_some(),
            };
            assert!(
                parses,
                "{}'s default {:?} is not a {:?}",
                k.env, k.default, k.kind
            );
        }
    }

    #[test]
    fn comm_name_wins_and_nccl_name_is_read_only_where_declared() {
        static BOTH: Knob = Knob {
            env: "COMM_ENVTEST_A",
            nccl: Some("NCCL_ENVTEST_A"),
            kind: Kind::Int,
            default: "5",
            doc: "test",
        };
        static ALIASED: Knob = Knob {
            env: "COMM_ENVTEST_B",
            nccl: Some("NCCL_ENVTEST_B"),
            kind: Kind::Int,
            default: "5",
            doc: "test",
        };
        static COMM_ONLY: Knob = Knob {
            env: "COMM_ENVTEST_C",
            nccl: None,
            kind: Kind::Int,
            default: "5",
            doc: "test",
        };
        std::env::set_var("COMM_ENVTEST_A", "1");
        std::env::set_var("NCCL_ENVTEST_A", "2");
        std::env::set_var("NCCL_ENVTEST_B", "3");
        std::env::set_var("NCCL_ENVTEST_C", "4");
        assert_eq!(BOTH.int(), 1);
        assert_eq!(ALIASED.int(), 3);
        assert_eq!(COMM_ONLY.int(), 5);
        assert_eq!(COMM_ONLY.int_if_set(), None);
        std::env::set_var("COMM_ENVTEST_C", " ");
        assert_eq!(COMM_ONLY.int(), 5, "an empty value counts as unset");
    }

    #[test]
    fn secrets_are_not_shown() {
        static S: Knob = Knob {
            env: "COMM_ENVTEST_SECRET",
            nccl: None,
            kind: Kind::Secret,
            default: "",
            doc: "test",
        };
        assert_eq!(S.shown_value(), "");
        std::env::set_var("COMM_ENVTEST_SECRET", "hunter2");
        assert_eq!(S.text().as_deref(), Some("hunter2"));
        assert_eq!(S.shown_value(), "(set)");
    }
}
