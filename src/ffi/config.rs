//! Reading a caller's `ncclConfig_t`: at most `size` bytes, the magic checked, and fields newer
//! than the caller's `version` treated as unset, so binaries built against any NCCL header since
//! 2.14 keep working.

use crate::comm::config::{version, RawConfig, UNDEF_INT};
use crate::error::Result;
use crate::ffi::input_cstr;
use crate::ffi::types::{ncclConfig_t, NCCL_API_MAGIC};
use std::os::raw::c_char;

/// What NCCL_CONFIG_INITIALIZER produces: every field unset, stamped with `version`.
fn initializer(version: u32) -> ncclConfig_t {
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version,
        blocking: UNDEF_INT,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
        graphStreamOrdering: UNDEF_INT,
    }
}

/// # Safety
/// `ptr` is null or points to at least `size_of::<usize>()` readable bytes, followed by as many
/// as the struct's own `size` field says.
pub(crate) unsafe fn read_raw(ptr: *const ncclConfig_t) -> Result<Option<RawConfig>> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: `ptr` is not NULL (checked above) and has at least `size_of::<usize>()` readable
    // bytes, the leading `size` field, by this function's contract; unaligned is allowed.
    let size = unsafe { std::ptr::read_unaligned(ptr as *const usize) };
    let min = std::mem::offset_of!(ncclConfig_t, blocking);
    if size < min + 4 {
        return crate::invalid_arg!(
            "config->size is {size}: not an ncclConfig_t initialized with NCCL_CONFIG_INITIALIZER"
        );
    }
    // Start from an initializer and copy what the caller's struct has of ours.
    let mut c = initializer(0);
    let n = size.min(std::mem::size_of::<ncclConfig_t>());
    // SAFETY: the caller's struct has `size >= n` readable bytes (this function's contract);
    // `c` is a local `ncclConfig_t` of at least `n` bytes, so the two cannot overlap, and every
    // field is an integer or a pointer, valid for any bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(ptr as *const u8, &mut c as *mut ncclConfig_t as *mut u8, n)
    };
    if c.magic != NCCL_API_MAGIC {
        return crate::invalid_arg!(
            "config->magic is {:#x}: ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER",
            c.magic
        );
    }
    let v = c.version;
    // Fields the caller's header did not have yet are unset, whatever the bytes say.
    let since = |x, y, z, value: i32| {
        if v < version(x, y, z) {
            UNDEF_INT
        } else {
            value
        }
    };
    let since_ptr = |x, y, z, p: *const c_char| {
        if v < version(x, y, z) {
            None
        } else {
            // SAFETY: a string field the caller's header has is NULL or NUL-terminated
            // (this function's contract covers the struct the caller passes).
            unsafe { input_cstr(p) }.map(|s| s.to_string_lossy().into_owned())
        }
    };
    Ok(Some(RawConfig {
        blocking: since(2, 14, 0, c.blocking),
        cga_cluster_size: since(2, 17, 0, c.cgaClusterSize),
        min_ctas: since(2, 17, 0, c.minCTAs),
        max_ctas: since(2, 17, 0, c.maxCTAs),
        net_name: since_ptr(2, 17, 0, c.netName),
        split_share: since(2, 18, 0, c.splitShare),
        traffic_class: since(2, 25, 0, c.trafficClass),
        comm_name: since_ptr(2, 27, 0, c.commName),
        collnet_enable: since(2, 27, 0, c.collnetEnable),
        cta_policy: since(2, 27, 0, c.CTAPolicy),
        shrink_share: since(2, 27, 0, c.shrinkShare),
        nvls_ctas: since(2, 27, 0, c.nvlsCTAs),
        n_channels_per_net_peer: since(2, 28, 0, c.nChannelsPerNetPeer),
        nvlink_centric_sched: since(2, 28, 0, c.nvlinkCentricSched),
        graph_usage_mode: since(2, 29, 0, c.graphUsageMode),
        num_rma_ctx: since(2, 29, 0, c.numRmaCtx),
        max_p2p_peers: since(2, 30, 0, c.maxP2pPeers),
        graph_stream_ordering: since(2, 30, 0, c.graphStreamOrdering),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn initializer() -> ncclConfig_t {
        super::initializer(23007)
    }

    #[test]
    fn the_initializer_reads_as_all_unset() {
        let c = initializer();
        // SAFETY: `c` is a whole ncclConfig_t whose `size` is its own.
        let raw = unsafe { read_raw(&c) }.unwrap().unwrap();
        assert_eq!(raw, RawConfig::default());
    }

    #[test]
    fn bad_magic_is_rejected() {
        let mut c = initializer();
        c.magic = 0;
        // SAFETY: `c` is a whole ncclConfig_t whose `size` is its own.
        let e = unsafe { read_raw(&c) }.unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::InvalidArgument);
        assert!(e.msg.contains("NCCL_CONFIG_INITIALIZER"));
    }

    #[test]
    fn fields_newer_than_the_callers_header_are_ignored() {
        // A 2.17 caller's struct: 48 bytes, and whatever follows is not its config.
        let mut c = initializer();
        c.version = 21700;
        c.size = 48;
        c.blocking = 0;
        c.commName = c"garbage".as_ptr();
        c.CTAPolicy = 77;
        // SAFETY: `c` is a whole ncclConfig_t; its `size` (48) is less, and `commName`, too new
        // for version 2.17 to be read, is a valid string anyway.
        let raw = unsafe { read_raw(&c) }.unwrap().unwrap();
        assert_eq!(raw.blocking, 0);
        assert_eq!(raw.comm_name, None);
        assert_eq!(raw.cta_policy, UNDEF_INT);
    }

    #[test]
    fn a_struct_larger_than_ours_is_read_up_to_our_size() {
        // A 2.32 caller passes 120 bytes; the first 96 are ours.
        let mut big = [0u8; 120];
        let mut c = initializer();
        c.size = 120;
        c.version = 23203;
        c.graphStreamOrdering = 1;
        // SAFETY: `big` has room for the whole struct `c`; the two are distinct locals.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &c as *const ncclConfig_t as *const u8,
                big.as_mut_ptr(),
                std::mem::size_of::<ncclConfig_t>(),
            )
        };
        // SAFETY: `big` holds the 120 bytes its `size` field says; `read_raw` reads it
        // unaligned and copies out at most our struct's size.
        let raw = unsafe { read_raw(big.as_ptr() as *const ncclConfig_t) }
            .unwrap()
            .unwrap();
        assert_eq!(raw.graph_stream_ordering, 1);
    }
}
