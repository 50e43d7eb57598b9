//! The 128-byte ncclUniqueId: where the root listens and the secret of the job.
//!
//! Layout (version 1):
//! ```text
//!   0..4    magic "CMID"
//!   4       version
//!   5       flags (bit 0: the root is started by the first rank at init, NCCL_COMM_ID mode)
//!   6..8    zero
//!   8..31   root address (family, 16 address bytes, port, IPv6 scope)
//!  31..63   secret
//!  63..120  zero
//! 120..128  first 8 bytes of SHA-256 over bytes 0..120, to catch an id mangled in transit
//! ```

use std::fmt;
use std::net::ToSocketAddrs;

use sha2::{Digest, Sha256};

use super::net::{self, ADDR_BYTES};
use super::root;
use super::{iface, UNIQUE_ID_BYTES};
use crate::error::Result;

const MAGIC: &[u8; 4] = b"CMID";
const VERSION: u8 = 1;
const FLAG_ROOT_AT_INIT: u8 = 1;
const ADDR_AT: usize = 8;
const SECRET_AT: usize = ADDR_AT + ADDR_BYTES;
const SUM_AT: usize = UNIQUE_ID_BYTES - 8;

/// What the 128-byte ncclUniqueId carries.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct UniqueId {
    /// Where the bootstrap root listens.
    pub root: std::net::SocketAddr,
    /// Proves membership of the job on every bootstrap and transport connection.
    pub secret: [u8; 32],
    /// NCCL_COMM_ID mode: nobody started a root when the id was made; the first rank served by it
    /// starts it inside `Bootstrap::init`.
    pub root_at_init: bool,
}

/// Never prints the secret, only a fingerprint that tells two ids apart in a log.
impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("root", &self.root)
            .field(
                "secret",
                &format_args!("<fingerprint {}>", self.fingerprint()),
            )
            .field("root_at_init", &self.root_at_init)
            .finish()
    }
}

impl UniqueId {
    /// Tells ids apart in a log (ids of one process share the root address) and reveals nothing
    /// of the secret.
    pub(crate) fn fingerprint(&self) -> String {
        let fp = Sha256::digest(self.secret);
        format!("{:02x}{:02x}{:02x}{:02x}", fp[0], fp[1], fp[2], fp[3])
    }

    pub(crate) fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        b[5] = if self.root_at_init {
            FLAG_ROOT_AT_INIT
        } else {
            0
        };
        b[ADDR_AT..SECRET_AT].copy_from_slice(&net::encode_addr(&self.root));
        b[SECRET_AT..SECRET_AT + 32].copy_from_slice(&self.secret);
        let sum = Sha256::digest(&b[..SUM_AT]);
        b[SUM_AT..].copy_from_slice(&sum[..8]);
        b
    }

    pub(crate) fn from_bytes(b: &[u8; UNIQUE_ID_BYTES]) -> Result<UniqueId> {
        if &b[..4] != MAGIC {
            return crate::invalid_arg!(
                "unique id is not one of this library's (bad magic {:02x?}): it must come from ncclGetUniqueId and reach every rank unchanged",
                &b[..4]
            );
        }
        if b[4] != VERSION {
            return crate::invalid_arg!(
                "unique id has format version {}, this library understands version {VERSION}: do all ranks use the same library?",
                b[4]
            );
        }
        let sum = Sha256::digest(&b[..SUM_AT]);
        if b[SUM_AT..] != sum[..8] {
            return crate::invalid_arg!(
                "unique id is corrupted (checksum mismatch): it must reach every rank unchanged"
            );
        }
        if b[5] & !FLAG_ROOT_AT_INIT != 0 {
            return crate::invalid_arg!("unique id has unknown flags {:#04x}", b[5]);
        }
        let Some(root) = net::decode_addr(&b[ADDR_AT..SECRET_AT]) else {
            return crate::invalid_arg!("unique id holds a malformed root address");
        };
        if root.port() == 0 || root.ip().is_unspecified() {
            return crate::invalid_arg!("unique id holds an unusable root address {root}");
        }
        let mut secret = [0u8; 32];
        secret.copy_from_slice(&b[SECRET_AT..SECRET_AT + 32]);
        Ok(UniqueId {
            root,
            secret,
            root_at_init: b[5] & FLAG_ROOT_AT_INIT != 0,
        })
    }
}

/// ncclGetUniqueId; see the module documentation of `bootstrap`.
pub(crate) fn new_unique_id() -> Result<UniqueId> {
    if let Some(spec) = crate::env::COMM_ID.text() {
        let secret = crate::env::SECRET.text();
        let id = id_from_comm_id(&spec, secret.as_deref())?;
        crate::info!(
            "bootstrap: NCCL_COMM_ID={spec}: root {} is started by rank 0 at init",
            id.root
        );
        return Ok(id);
    }
    // A session of this process's root service, which serves every id made here through one
    // listener per address; its state goes when the rendezvous completes or COMM_INIT_TIMEOUT
    // passes unused.
    let id = root::new_id(iface::local_ip()?)?;
    crate::info!(
        "bootstrap: unique id {} created, root at {}",
        id.fingerprint(),
        id.root
    );
    Ok(id)
}

/// The id every process derives on its own from NCCL_COMM_ID=host:port.
///
/// Nobody can hand out a random secret in this mode, so the secret is a hash of COMM_SECRET when
/// set, else of the NCCL_COMM_ID string itself. The latter is no protection against anyone who
/// knows the address; it only keeps a rank of another job, pointed at the same address by
/// mistake, from joining. Set COMM_SECRET to the same private value on every rank for more.
pub(crate) fn id_from_comm_id(spec: &str, secret: Option<&str>) -> Result<UniqueId> {
    let trimmed = spec.trim();
    let mut addrs = match trimmed.to_socket_addrs() {
        Ok(a) => a.collect::<Vec<_>>(),
        Err(e) => {
            return crate::invalid_arg!(
                "NCCL_COMM_ID={spec:?} is not a usable host:port ({e}); IPv6 addresses go in brackets, [::1]:port"
            )
        }
    };
    // The same choice on every process: IPv4 first, as getaddrinfo ordering may differ by host.
    addrs.sort_by_key(|a| (a.is_ipv6(), *a));
    let Some(root) = addrs.first().copied() else {
        return crate::invalid_arg!("NCCL_COMM_ID={spec:?} resolves to no address");
    };
    if root.port() == 0 {
        return crate::invalid_arg!("NCCL_COMM_ID={spec:?} needs a port other than 0");
    }
    let digest = match secret {
        Some(s) => Sha256::new()
            .chain_update(b"comm-secret-from-COMM_SECRET-v1")
            .chain_update(s.as_bytes())
            .finalize(),
        None => Sha256::new()
            .chain_update(b"comm-secret-from-NCCL_COMM_ID-v1")
            .chain_update(trimmed.as_bytes())
            .finalize(),
    };
    Ok(UniqueId {
        root,
        secret: digest.into(),
        root_at_init: true,
    })
}
