//! Environment knobs. Every knob is read as `COMM_<NAME>` first and `NCCL_<NAME>` second, so
//! deployments tuned for NCCL keep working unchanged.

use std::time::Duration;

/// The value of `COMM_<name>`, else `NCCL_<name>`, ignoring empty values.
pub(crate) fn var(name: &str) -> Option<String> {
    ["COMM_", "NCCL_"].iter().find_map(|prefix| {
        std::env::var(format!("{prefix}{name}"))
            .ok()
            .filter(|v| !v.trim().is_empty())
    })
}

/// A knob parsed as an integer; an unparsable value is logged and ignored.
pub(crate) fn int(name: &str) -> Option<i64> {
    let raw = var(name)?;
    match raw.trim().parse::<i64>() {
        Ok(v) => Some(v),
        Err(_) => {
            crate::warn!("ignoring {name}={raw:?}: not an integer");
            None
        }
    }
}

/// A knob read as a boolean: 1/true/yes/on are true, 0/false/no/off are false.
pub(crate) fn flag(name: &str) -> Option<bool> {
    let raw = var(name)?;
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => {
            crate::warn!("ignoring {name}={raw:?}: not a boolean");
            None
        }
    }
}

/// A knob holding a byte size, with optional K/M/G suffix (binary units).
pub(crate) fn size(name: &str) -> Option<usize> {
    let raw = var(name)?;
    match parse_size(&raw) {
        Some(v) => Some(v),
        None => {
            crate::warn!("ignoring {name}={raw:?}: not a size");
            None
        }
    }
}

/// A knob holding seconds (fractions allowed). Zero or negative means "no limit" and gives None.
pub(crate) fn seconds(name: &str) -> Option<Option<Duration>> {
    let raw = var(name)?;
    match raw.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Some(Some(Duration::from_secs_f64(v))),
        Ok(_) => Some(None),
        Err(_) => {
            crate::warn!("ignoring {name}={raw:?}: not a number of seconds");
            None
        }
    }
}

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

/// A documented knob. `name` is read as COMM_<name> and, when `nccl` is set, NCCL_<name>.
pub(crate) struct Knob {
    pub name: &'static str,
    pub nccl: bool,
    pub default: &'static str,
    pub doc: &'static str,
}

/// Every knob the library reads (ncclParam* serves these, README documents them).
pub(crate) const KNOBS: &[Knob] = &[
    Knob {
        name: "DEBUG",
        nccl: true,
        default: "",
        doc: "log level: VERSION, WARN, INFO or TRACE",
    },
    Knob {
        name: "DEBUG_FILE",
        nccl: true,
        default: "",
        doc: "log to this file instead of stderr (%h host, %p pid)",
    },
    Knob {
        name: "ALGO",
        nccl: true,
        default: "",
        doc: "allowed algorithms, e.g. ring,tree or ^direct",
    },
    Knob {
        name: "COMM_ID",
        nccl: true,
        default: "",
        doc: "host:port of the bootstrap root, instead of a unique id",
    },
    Knob {
        name: "SOCKET_IFNAME",
        nccl: true,
        default: "",
        doc: "interfaces to use: prefixes, ^excluded, =exact",
    },
    Knob {
        name: "SOCKET_FAMILY",
        nccl: true,
        default: "",
        doc: "AF_INET or AF_INET6",
    },
    Knob {
        name: "COMM_BLOCKING",
        nccl: true,
        default: "1",
        doc: "default of ncclConfig_t.blocking",
    },
    Knob {
        name: "SHM_DISABLE",
        nccl: true,
        default: "0",
        doc: "1: ranks of one host talk over the network transport instead of shared memory",
    },
    Knob {
        name: "NET",
        nccl: true,
        default: "socket",
        doc: "network transport between hosts (socket, ib; default: ib where every rank has a device)",
    },
    Knob {
        name: "IB_HCA",
        nccl: true,
        default: "",
        doc: "InfiniBand devices and ports to use: mlx5_0:1,mlx5_1 (prefixes; ^ excludes, = exact)",
    },
    Knob {
        name: "IB_GID_INDEX",
        nccl: true,
        default: "",
        doc: "GID index for RoCE (default: the first RoCE v2 entry with an IPv4-mapped address)",
    },
    Knob {
        name: "IB_TIMEOUT",
        nccl: true,
        default: "20",
        doc: "InfiniBand ack timeout exponent (4.096 us x 2^value)",
    },
    Knob {
        name: "IB_RETRY_CNT",
        nccl: true,
        default: "7",
        doc: "InfiniBand transport retries before a queue pair fails",
    },
    Knob {
        name: "IB_SL",
        nccl: true,
        default: "0",
        doc: "InfiniBand service level",
    },
    Knob {
        name: "IB_TC",
        nccl: true,
        default: "0",
        doc: "InfiniBand traffic class (RoCE)",
    },
    Knob {
        name: "IB_QPS_PER_CONNECTION",
        nccl: true,
        default: "1",
        doc: "InfiniBand queue pairs per peer; message pieces alternate between them (1-16)",
    },
    Knob {
        name: "IB_SLOT_BYTES",
        nccl: false,
        default: "256K",
        doc: "InfiniBand: bytes of each of the 8 receive slots per peer",
    },
    Knob {
        name: "NSOCKS_PERTHREAD",
        nccl: true,
        default: "1",
        doc: "TCP sockets per peer (times SOCKET_NTHREADS, at most 64); large messages are cut across them",
    },
    Knob {
        name: "SOCKET_NTHREADS",
        nccl: true,
        default: "1",
        doc: "multiplies NSOCKS_PERTHREAD; no helper threads are started (the executor drives every socket)",
    },
    Knob {
        name: "HOSTID",
        nccl: true,
        default: "",
        doc: "host identity (default: boot id, hostname and network namespace)",
    },
    Knob {
        name: "RING_BY_HOST",
        nccl: false,
        default: "1",
        doc: "rings visit each host's ranks together, crossing each host boundary once (0: rank order)",
    },
    Knob {
        name: "HIER_DIRECT_MAX_BYTES",
        nccl: false,
        default: "",
        doc: "hierarchical all-reduce: largest part exchanged one-shot between hosts (default: any with 2 hosts, 64K with more)",
    },
    Knob {
        name: "LOCAL_REGISTER",
        nccl: true,
        default: "1",
        doc: "peers read registered device buffers in place (0: always staged)",
    },
    Knob {
        name: "INIT_TIMEOUT",
        nccl: false,
        default: "600",
        doc: "seconds an init waits for all ranks (0 = forever)",
    },
    Knob {
        name: "BOOTSTRAP_HANDSHAKE_TIMEOUT",
        nccl: false,
        default: "5",
        doc: "seconds a connecting peer has to authenticate",
    },
    Knob {
        name: "TIMEOUT",
        nccl: false,
        default: "0",
        doc: "seconds an operation may go without progress before ncclTimeout (0 = never)",
    },
    Knob {
        name: "WARN_AFTER",
        nccl: false,
        default: "60",
        doc: "seconds without progress before a warning names the ranks waited for",
    },
    Knob {
        name: "SPIN_US",
        nccl: false,
        default: "50",
        doc: "microseconds to spin before sleeping (1000 with peers across the network; 0 when ranks outnumber cores)",
    },
    Knob {
        name: "SLICE_BYTES",
        nccl: false,
        default: "524288",
        doc: "pipeline slice of ring and tree algorithms",
    },
    Knob {
        name: "DIRECT_MAX_BYTES",
        nccl: false,
        default: "65536",
        doc: "largest all-reduce done one-shot (depends on rank count)",
    },
    Knob {
        name: "TREE_MAX_BYTES",
        nccl: false,
        default: "262144",
        doc: "largest message that prefers the tree to the ring",
    },
    Knob {
        name: "SHM_SLOTS",
        nccl: false,
        default: "16",
        doc: "slots per shared-memory FIFO",
    },
    Knob {
        name: "SHM_SLOT_BYTES",
        nccl: false,
        default: "65536",
        doc: "bytes per shared-memory FIFO slot",
    },
    Knob {
        name: "SHM_PULL",
        nccl: false,
        default: "1",
        doc: "let receivers copy large messages straight from the sender",
    },
    Knob {
        name: "SHM_PULL_THRESHOLD",
        nccl: false,
        default: "32768",
        doc: "smallest message sent by pull",
    },
    Knob {
        name: "HOSTID",
        nccl: true,
        default: "",
        doc: "extra text mixed into the host identity",
    },
    Knob {
        name: "YIELD_US",
        nccl: false,
        default: "0",
        doc: "microseconds to yield the core before sleeping (200 when ranks outnumber cores)",
    },
    Knob {
        name: "SHM_HUGEPAGES",
        nccl: false,
        default: "1",
        doc: "move large buffers onto huge pages before other processes copy them",
    },
    Knob {
        name: "SHM_HUGEPAGES_FROM",
        nccl: false,
        default: "4194304",
        doc: "smallest buffer moved onto huge pages",
    },
    Knob {
        name: "DEVICE",
        nccl: false,
        default: "1",
        doc: "0 keeps every communicator on host memory",
    },
    Knob {
        name: "DEVICE_SLOT_BYTES",
        nccl: false,
        default: "8388608",
        doc: "device message slot size",
    },
    Knob {
        name: "DEVICE_ONESHOT_MAX",
        nccl: false,
        default: "262144",
        doc: "largest device all-reduce done one-shot",
    },
    Knob {
        name: "DEVICE_TWOSHOT_MAX",
        nccl: false,
        default: "67108864",
        doc: "largest device all-reduce done two-shot",
    },
];

pub(crate) fn knob(key: &str) -> Option<&'static Knob> {
    let bare = key
        .strip_prefix("COMM_")
        .or_else(|| key.strip_prefix("NCCL_"))?;
    KNOBS
        .iter()
        .find(|k| k.name == bare && (k.nccl || key.starts_with("COMM_")))
}

/// The value a knob has now: from the environment, else its default.
pub(crate) fn knob_value(k: &Knob) -> String {
    var(k.name)
        .filter(|_| k.nccl || std::env::var(format!("COMM_{}", k.name)).is_ok())
        .unwrap_or_else(|| k.default.to_string())
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

    #[test]
    fn comm_prefix_wins_over_nccl() {
        std::env::set_var("COMM_ENVTEST_A", "1");
        std::env::set_var("NCCL_ENVTEST_A", "2");
        std::env::set_var("NCCL_ENVTEST_B", "3");
        assert_eq!(var("ENVTEST_A").as_deref(), Some("1"));
        assert_eq!(var("ENVTEST_B").as_deref(), Some("3"));
        assert_eq!(var("ENVTEST_C"), None);
    }
}
