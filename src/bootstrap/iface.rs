//! Which local address the bootstrap listens on, chosen the way NCCL chooses its socket interface.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Iface {
    pub name: String,
    pub addr: IpAddr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    V4,
    V6,
}

impl Family {
    fn holds(self, a: &IpAddr) -> bool {
        matches!(
            (self, a),
            (Family::V4, IpAddr::V4(_)) | (Family::V6, IpAddr::V6(_))
        )
    }
}

/// NCCL_SOCKET_IFNAME syntax: comma-separated name prefixes; a leading '^' turns the list into
/// exclusions; a leading '=' (after any '^') makes the names exact rather than prefixes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IfSpec {
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl IfSpec {
    pub(crate) fn parse(spec: &str) -> IfSpec {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let names = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        IfSpec {
            exclude,
            exact,
            names,
        }
    }

    pub(crate) fn matches(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| {
            if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            }
        });
        listed != self.exclude
    }
}

/// NCCL's order when nothing is configured: InfiniBand (IPoIB) first, then anything but docker
/// bridges, loopback and libvirt bridges, then loopback.
const DEFAULT_PREFERENCE: [&str; 3] = ["ib", "^docker,lo,virbr", "lo"];

/// The address to use among `ifaces` (in the system's order): the first interface that `spec`
/// accepts, and within it an IPv4 address before an IPv6 one.
pub(crate) fn choose(
    ifaces: &[Iface],
    spec: Option<&str>,
    family: Option<Family>,
) -> Option<Iface> {
    let usable: Vec<&Iface> = ifaces
        .iter()
        .filter(|i| family.is_none_or(|f| f.holds(&i.addr)))
        .collect();
    let pick = |spec: &IfSpec| -> Option<Iface> {
        let name = &usable.iter().find(|i| spec.matches(&i.name))?.name;
        let same: Vec<&&Iface> = usable.iter().filter(|i| &i.name == name).collect();
        let best = same.iter().find(|i| i.addr.is_ipv4()).or(same.first())?;
        Some((**best).clone())
    };
    match spec {
        Some(s) => pick(&IfSpec::parse(s)),
        None => DEFAULT_PREFERENCE
            .iter()
            .find_map(|s| pick(&IfSpec::parse(s))),
    }
}

/// The address this host should listen on; see the `bootstrap` module documentation.
pub(crate) fn local_ip() -> Result<IpAddr> {
    let spec = crate::env::SOCKET_IFNAME.text();
    let family = match crate::env::SOCKET_FAMILY.text().as_deref().map(str::trim) {
        None => None,
        Some("AF_INET") | Some("inet") | Some("4") => Some(Family::V4),
        Some("AF_INET6") | Some("inet6") | Some("6") => Some(Family::V6),
        Some(other) => {
            crate::warn!("ignoring COMM_SOCKET_FAMILY={other:?}: expected AF_INET or AF_INET6");
            None
        }
    };
    let ifaces = interfaces()?;
    match choose(&ifaces, spec.as_deref(), family) {
        Some(i) => {
            crate::info!(
                "bootstrap: using interface {} address {}{}",
                i.name,
                i.addr,
                spec.as_deref()
                    .map(|s| format!(" (SOCKET_IFNAME={s})"))
                    .unwrap_or_default()
            );
            Ok(i.addr)
        }
        None => {
            let mut seen: Vec<String> = ifaces
                .iter()
                .map(|i| format!("{} {}", i.name, i.addr))
                .collect();
            seen.dedup();
            let seen = if seen.is_empty() {
                "none".to_string()
            } else {
                seen.join(", ")
            };
            match spec {
                Some(s) => crate::invalid_usage!(
                    "COMM_SOCKET_IFNAME / NCCL_SOCKET_IFNAME={s:?}{} matches no usable interface (up: {seen})",
                    family.map(|f| format!(" with family {f:?}")).unwrap_or_default()
                ),
                None => crate::system_err!(
                    "no usable network interface for the bootstrap{} (up: {seen})",
                    family.map(|f| format!(" with family {f:?}")).unwrap_or_default()
                ),
            }
        }
    }
}

/// The speed of the interface that holds `ip`, in bytes per microsecond, where the kernel
/// knows it (`/sys/class/net/NAME/speed`, in Mbit/s; loopback and some virtual links have none).
pub(crate) fn speed_of(ip: IpAddr) -> Option<f32> {
    let name = interfaces().ok()?.into_iter().find(|i| i.addr == ip)?.name;
    let mbit: i64 = std::fs::read_to_string(format!("/sys/class/net/{name}/speed"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (mbit > 0).then(|| mbit as f32 / 8.0)
}

/// Up interfaces with an address a peer could reach: IPv6 loopback and link-local addresses are
/// left out, as NCCL does (the latter would need a scope to be usable).
fn interfaces() -> Result<Vec<Iface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs stores the head of a list it allocates into `head`; the list is released
    // exactly once with freeifaddrs below and no reference into it outlives this function.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::last_os("getifaddrs"));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null()
            || ifa.ifa_name.is_null()
            || ifa.ifa_flags & libc::IFF_UP as u32 == 0
        {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points at a sockaddr owned by the list.
        let Some(addr) = (unsafe { sockaddr_ip(ifa.ifa_addr) }) else {
            continue;
        };
        if let IpAddr::V6(v6) = addr {
            if v6.is_loopback() || (v6.segments()[0] & 0xffc0) == 0xfe80 {
                continue;
            }
        }
        out.push(Iface { name, addr });
    }
    // SAFETY: `head` came from getifaddrs and is freed once; nothing borrowed from it is kept.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The IP of an AF_INET or AF_INET6 sockaddr.
///
/// # Safety
/// `sa` must point at a valid sockaddr whose real size matches its `sa_family`.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    // SAFETY: the caller guarantees `sa` is valid; the family tells which larger struct it is, and
    // we only reinterpret it as that struct.
    unsafe {
        match (*sa).sa_family as libc::c_int {
            libc::AF_INET => {
                let sin = &*(sa as *const libc::sockaddr_in);
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))))
            }
            libc::AF_INET6 => {
                let sin6 = &*(sa as *const libc::sockaddr_in6);
                Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
            }
            _ => None,
        }
    }
}
