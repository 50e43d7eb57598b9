//! The verbs interface over `libibverbs.so.1`, opened at run time with versioned symbol
//! look-ups (`IBVERBS_1.1` for the base set, `IBVERBS_1.0` for the completion channel, as NCCL
//! does), so that the library has no load-time dependency on rdma-core and works where it is
//! absent. Structure layouts and constants are those of rdma-core's `verbs.h` (checked with
//! `offsetof` against the installed header when this was written); `post_send`, `post_recv`,
//! `poll_cq` and `req_notify_cq` are inline functions there, called here the same way, through
//! the context's operation table.
//!
//! `ibv_reg_dmabuf_mr` (GPUDirect RDMA through a dmabuf, `IBVERBS_1.12`, rdma-core v34 and
//! later) is looked up on its own: where it is missing the library loads all the same and
//! device memory is simply not registered with the HCA (an INFO line says so).
//!
//! **Not run on RDMA hardware**: no machine this was written on had a device. See the README
//! for what a first run on a fabric must check.
//!
//! Device selection: `NCCL_IB_HCA` (`mlx5_0:1,mlx5_1`; a leading `^` excludes the listed
//! devices, `=` makes names exact instead of prefixes), the first active port of the first
//! device that matches. RoCE needs a GID: `NCCL_IB_GID_INDEX`, or the first RoCE v2 entry with
//! an IPv4-mapped address the kernel lists. `NCCL_IB_TIMEOUT`, `NCCL_IB_RETRY_CNT`,
//! `NCCL_IB_SL` and `NCCL_IB_TC` tune the queue pairs as in NCCL.

use super::verbs::{Completed, Completion, Device, Mr, Op, Provider, Qp, QpAddr, SendWr};
use crate::error::{Error, ErrorKind, Result};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The verbs library of this machine.
pub(super) struct Library;

type P = *mut c_void;

/// The functions used, looked up once.
struct Syms {
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut P,
    free_device_list: unsafe extern "C" fn(*mut P),
    get_device_name: unsafe extern "C" fn(P) -> *const c_char,
    open_device: unsafe extern "C" fn(P) -> P,
    close_device: unsafe extern "C" fn(P) -> c_int,
    query_port: unsafe extern "C" fn(P, u8, *mut u8) -> c_int,
    query_gid: unsafe extern "C" fn(P, u8, c_int, *mut [u8; 16]) -> c_int,
    alloc_pd: unsafe extern "C" fn(P) -> P,
    dealloc_pd: unsafe extern "C" fn(P) -> c_int,
    reg_mr: unsafe extern "C" fn(P, P, usize, c_int) -> P,
    dereg_mr: unsafe extern "C" fn(P) -> c_int,
    create_comp_channel: unsafe extern "C" fn(P) -> P,
    destroy_comp_channel: unsafe extern "C" fn(P) -> c_int,
    create_cq: unsafe extern "C" fn(P, c_int, P, P, c_int) -> P,
    destroy_cq: unsafe extern "C" fn(P) -> c_int,
    create_qp: unsafe extern "C" fn(P, *mut QpInitAttr) -> P,
    destroy_qp: unsafe extern "C" fn(P) -> c_int,
    modify_qp: unsafe extern "C" fn(P, *mut QpAttr, c_int) -> c_int,
    get_cq_event: unsafe extern "C" fn(P, *mut P, *mut P) -> c_int,
    ack_cq_events: unsafe extern "C" fn(P, c_uint),
    wc_status_str: unsafe extern "C" fn(c_int) -> *const c_char,
    /// `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)`, or why there is none.
    reg_dmabuf_mr: std::result::Result<RegDmabufMr, String>,
}

type RegDmabufMr = unsafe extern "C" fn(P, u64, usize, u64, c_int, c_int) -> P;

// SAFETY: plain function pointers into a library that stays loaded.
unsafe impl Send for Syms {}
// SAFETY: as above.
unsafe impl Sync for Syms {}

static SYMS: std::sync::OnceLock<std::result::Result<Syms, String>> = std::sync::OnceLock::new();

/// `name@version` from the library `h`, as a function pointer of type `T`.
///
/// # Safety
/// `T` must be a function pointer type matching the symbol's C signature.
unsafe fn sym<T: Copy>(h: P, name: &CStr, version: &CStr) -> std::result::Result<T, String> {
    // SAFETY: a valid handle and NUL-terminated names.
    let p = unsafe { libc::dlvsym(h, name.as_ptr(), version.as_ptr()) };
    if p.is_null() {
        return Err(format!(
            "libibverbs.so.1 has no {}@{}",
            name.to_string_lossy(),
            version.to_string_lossy()
        ));
    }
    // SAFETY: the caller guarantees T is the symbol's function pointer type.
    Ok(unsafe { std::mem::transmute_copy::<P, T>(&p) })
}

/// The symbol version of `ibv_reg_dmabuf_mr`.
const DMABUF_VERSION: &CStr = c"IBVERBS_1.12";

/// `ibv_reg_dmabuf_mr@version` from the library `h`, or why it is unavailable (with an INFO
/// line). Newer than the rest and optional: an older rdma-core still carries host memory.
fn dmabuf_sym(h: P, version: &CStr) -> std::result::Result<RegDmabufMr, String> {
    // SAFETY: RegDmabufMr is ibv_reg_dmabuf_mr's C signature (verbs.h).
    unsafe { sym::<RegDmabufMr>(h, c"ibv_reg_dmabuf_mr", version) }.map_err(|why| {
        crate::info!(
            "{why} (rdma-core older than v34): GPUDirect RDMA through dmabuf is unavailable, device memory cannot be registered with the HCA"
        );
        format!("{why} (rdma-core older than v34; GPUDirect RDMA needs v34 or later)")
    })
}

fn load() -> std::result::Result<&'static Syms, String> {
    SYMS.get_or_init(|| {
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life.
        let h = unsafe {
            libc::dlopen(
                c"libibverbs.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_LOCAL,
            )
        };
        if h.is_null() {
            return Err("libibverbs.so.1 is not installed (rdma-core)".to_string());
        }
        let v = c"IBVERBS_1.1";
        let v0 = c"IBVERBS_1.0";
        let reg_dmabuf_mr = dmabuf_sym(h, DMABUF_VERSION);
        // SAFETY: each symbol has the C signature of its field (verbs.h).
        unsafe {
            Ok(Syms {
                get_device_list: sym(h, c"ibv_get_device_list", v)?,
                free_device_list: sym(h, c"ibv_free_device_list", v)?,
                get_device_name: sym(h, c"ibv_get_device_name", v)?,
                open_device: sym(h, c"ibv_open_device", v)?,
                close_device: sym(h, c"ibv_close_device", v)?,
                query_port: sym(h, c"ibv_query_port", v)?,
                query_gid: sym(h, c"ibv_query_gid", v)?,
                alloc_pd: sym(h, c"ibv_alloc_pd", v)?,
                dealloc_pd: sym(h, c"ibv_dealloc_pd", v)?,
                reg_mr: sym(h, c"ibv_reg_mr", v)?,
                dereg_mr: sym(h, c"ibv_dereg_mr", v)?,
                create_comp_channel: sym(h, c"ibv_create_comp_channel", v0)?,
                destroy_comp_channel: sym(h, c"ibv_destroy_comp_channel", v0)?,
                create_cq: sym(h, c"ibv_create_cq", v)?,
                destroy_cq: sym(h, c"ibv_destroy_cq", v)?,
                create_qp: sym(h, c"ibv_create_qp", v)?,
                destroy_qp: sym(h, c"ibv_destroy_qp", v)?,
                modify_qp: sym(h, c"ibv_modify_qp", v)?,
                get_cq_event: sym(h, c"ibv_get_cq_event", v)?,
                ack_cq_events: sym(h, c"ibv_ack_cq_events", v)?,
                wc_status_str: sym(h, c"ibv_wc_status_str", v)?,
                reg_dmabuf_mr,
            })
        }
    })
    .as_ref()
    .map_err(|e| e.clone())
}

// verbs.h layouts and constants.
const CTX_OPS_POLL_CQ: usize = 96;
const CTX_OPS_REQ_NOTIFY_CQ: usize = 104;
const CTX_OPS_POST_SEND: usize = 208;
const CTX_OPS_POST_RECV: usize = 216;
const QP_NUM: usize = 52;
const MR_LKEY: usize = 36;
const MR_RKEY: usize = 40;
const CHANNEL_FD: usize = 8;
const PORT_STATE: usize = 0;
const PORT_ACTIVE_MTU: usize = 8;
const PORT_LID: usize = 34;
const PORT_LINK_LAYER: usize = 46;
const PORT_ACTIVE: u32 = 4;
const LINK_LAYER_ETHERNET: u8 = 2;
const QPT_RC: u32 = 2;
const QPS_INIT: u32 = 1;
const QPS_RTR: u32 = 2;
const QPS_RTS: u32 = 3;
const ACCESS: c_int = 1 | 2 | 4 | 8; // local write, remote write, read and atomics
const WR_RDMA_WRITE: u32 = 0;
const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
const WR_RDMA_READ: u32 = 4;
const WR_ATOMIC_CMP_AND_SWP: u32 = 5;
const WR_ATOMIC_FETCH_AND_ADD: u32 = 6;
const SEND_SIGNALED: u32 = 2;
const WC_RECV_RDMA_WITH_IMM: u32 = 129;
const QP_STATE: c_int = 1;
const QP_PKEY_INDEX: c_int = 16;
const QP_PORT: c_int = 32;
const QP_ACCESS_FLAGS: c_int = 8;
const QP_AV: c_int = 128;
const QP_PATH_MTU: c_int = 256;
const QP_TIMEOUT: c_int = 512;
const QP_RETRY_CNT: c_int = 1024;
const QP_RNR_RETRY: c_int = 2048;
const QP_RQ_PSN: c_int = 4096;
const QP_MAX_QP_RD_ATOMIC: c_int = 8192;
const QP_MIN_RNR_TIMER: c_int = 32768;
const QP_SQ_PSN: c_int = 65536;
const QP_MAX_DEST_RD_ATOMIC: c_int = 131072;
const QP_DEST_QPN: c_int = 1048576;

#[repr(C)]
#[derive(Default)]
struct QpCap {
    max_send_wr: u32,
    max_recv_wr: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline_data: u32,
}

#[repr(C)]
struct QpInitAttr {
    qp_context: P,
    send_cq: P,
    recv_cq: P,
    srq: P,
    cap: QpCap,
    qp_type: u32,
    sq_sig_all: c_int,
}

/// `struct ibv_qp_attr`, 144 bytes, written through the offsets verbs.h gives its fields.
#[repr(C, align(8))]
struct QpAttr([u8; 144]);

impl QpAttr {
    fn new() -> QpAttr {
        QpAttr([0; 144])
    }
    fn u32_at(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u16_at(&mut self, off: usize, v: u16) -> &mut Self {
        self.0[off..off + 2].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u8_at(&mut self, off: usize, v: u8) -> &mut Self {
        self.0[off] = v;
        self
    }
}

#[repr(C)]
struct Sge {
    addr: u64,
    length: u32,
    lkey: u32,
}

/// `struct ibv_send_wr`, 128 bytes.
#[repr(C, align(8))]
struct SendWrRaw([u8; 128]);

#[repr(C)]
struct RecvWrRaw {
    wr_id: u64,
    next: P,
    sg_list: P,
    num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Wc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    vendor_err: u32,
    byte_len: u32,
    imm_data: u32,
    qp_num: u32,
    src_qp: u32,
    wc_flags: u32,
    pkey_index: u16,
    slid: u16,
    sl: u8,
    dlid_path_bits: u8,
}

/// `*(base + off)` read as `T`.
///
/// # Safety
/// `base + off` must hold a valid `T`.
unsafe fn at<T: Copy>(base: P, off: usize) -> T {
    // SAFETY: the caller guarantees the location.
    unsafe { std::ptr::read_unaligned((base as *const u8).add(off) as *const T) }
}

/// NCCL_IB_HCA: which devices and ports may be used.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct HcaSpec {
    exclude: bool,
    exact: bool,
    entries: Vec<(String, Option<u8>)>,
}

impl HcaSpec {
    pub(super) fn parse(s: &str) -> HcaSpec {
        let mut s = s.trim();
        let mut spec = HcaSpec::default();
        if let Some(rest) = s.strip_prefix('^') {
            spec.exclude = true;
            s = rest;
        }
        if let Some(rest) = s.strip_prefix('=') {
            spec.exact = true;
            s = rest;
        }
        for e in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (name, port) = match e.split_once(':') {
                Some((n, p)) => (n, p.trim().parse().ok()),
                None => (e, None),
            };
            spec.entries.push((name.to_string(), port));
        }
        spec
    }

    pub(super) fn allows(&self, device: &str, port: u8) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        let hit = self.entries.iter().any(|(n, p)| {
            let name_ok = if self.exact {
                device == n
            } else {
                device.starts_with(n.as_str())
            };
            name_ok && p.is_none_or(|p| p == port)
        });
        hit != self.exclude
    }
}

/// The first RoCE v2 GID with an IPv4-mapped address the kernel lists for a port, else 0.
fn roce_gid_index(device: &str, port: u8) -> c_int {
    let dir = format!("/sys/class/infiniband/{device}/ports/{port}");
    for i in 0..256 {
        let ty = std::fs::read_to_string(format!("{dir}/gid_attrs/types/{i}")).unwrap_or_default();
        let gid = std::fs::read_to_string(format!("{dir}/gids/{i}")).unwrap_or_default();
        if ty.trim().eq_ignore_ascii_case("RoCE v2")
            && gid.starts_with("0000:0000:0000:0000:0000:ffff")
        {
            return i;
        }
    }
    0
}

/// An opened device: its context, protection domain, port, and the thread that turns
/// completion events into calls of each queue pair's `notify`.
struct Opened {
    syms: &'static Syms,
    name: String,
    ctx: P,
    pd: P,
    channel: P,
    port: u8,
    lid: u16,
    gid: [u8; 16],
    gid_index: c_int,
    roce: bool,
    mtu: u8,
    /// Whether device memory can be registered through a dmabuf here, or why not.
    dmabuf: std::result::Result<RegDmabufMr, String>,
    stop: AtomicBool,
}

// SAFETY: verbs objects may be used from any thread; the library locks what needs locking.
unsafe impl Send for Opened {}
// SAFETY: as above.
unsafe impl Sync for Opened {}

impl Drop for Opened {
    fn drop(&mut self) {
        // SAFETY: every queue pair and registration holds an Arc of this, so all are gone;
        // the objects were created by this device and are released once.
        unsafe {
            (self.syms.destroy_comp_channel)(self.channel);
            (self.syms.dealloc_pd)(self.pd);
            (self.syms.close_device)(self.ctx);
        }
    }
}

struct HwDevice {
    dev: Arc<Opened>,
}

impl HwDevice {
    /// Waits for completion events and rings the queue pair they belong to.
    fn events(dev: Arc<Opened>) {
        // SAFETY: the channel is valid while `dev` lives.
        let fd: c_int = unsafe { at(dev.channel, CHANNEL_FD) };
        while !dev.stop.load(Ordering::Acquire) {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut p, 1, 200) } <= 0 {
                continue;
            }
            let (mut cq, mut cq_ctx): (P, P) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: the channel is readable, so this does not block; out-pointers are valid.
            if unsafe { (dev.syms.get_cq_event)(dev.channel, &mut cq, &mut cq_ctx) } != 0 {
                continue;
            }
            // SAFETY: the event came from `cq`, which it acknowledges.
            unsafe { (dev.syms.ack_cq_events)(cq, 1) };
            if !cq_ctx.is_null() {
                // SAFETY: cq_context is the `Notify` box of a queue pair, freed only after its
                // completion queue is destroyed.
                let n = unsafe { &*(cq_ctx as *const Notify) };
                (n.0)();
            }
        }
    }
}

struct Notify(Arc<dyn Fn() + Send + Sync>);

struct HwMr {
    dev: Arc<Opened>,
    mr: P,
}

// SAFETY: as for Opened.
unsafe impl Send for HwMr {}
// SAFETY: as above.
unsafe impl Sync for HwMr {}

impl Mr for HwMr {
    fn lkey(&self) -> u32 {
        // SAFETY: a registration alive while self is.
        unsafe { at(self.mr, MR_LKEY) }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { at(self.mr, MR_RKEY) }
    }
}

impl Drop for HwMr {
    fn drop(&mut self) {
        // SAFETY: registered by this device, released once.
        unsafe { (self.dev.syms.dereg_mr)(self.mr) };
    }
}

struct HwQp {
    dev: Arc<Opened>,
    qp: P,
    cq: P,
    notify: *mut Notify,
    psn: u32,
}

// SAFETY: as for Opened.
unsafe impl Send for HwQp {}
// SAFETY: as above.
unsafe impl Sync for HwQp {}

impl HwQp {
    fn failed(&self, what: &str, rc: c_int) -> Error {
        Error::new(
            ErrorKind::System,
            format!(
                "{} on {}: {}",
                what,
                self.dev.name,
                std::io::Error::from_raw_os_error(rc.abs())
            ),
        )
    }

    fn modify(&self, attr: &mut QpAttr, mask: c_int, what: &str) -> Result<()> {
        // SAFETY: a valid queue pair and a full ibv_qp_attr.
        let rc = unsafe { (self.dev.syms.modify_qp)(self.qp, attr, mask) };
        if rc != 0 {
            return Err(self.failed(what, rc));
        }
        Ok(())
    }

    /// The context's operation `off`, as a function pointer of type `T`.
    ///
    /// # Safety
    /// `T` must match the operation's signature.
    unsafe fn op<T: Copy>(&self, off: usize) -> T {
        // SAFETY: the context's operation table holds function pointers at these offsets.
        unsafe { std::mem::transmute_copy::<P, T>(&at::<P>(self.dev.ctx, off)) }
    }
}

impl Qp for HwQp {
    fn addr(&self) -> QpAddr {
        QpAddr {
            // SAFETY: a queue pair alive while self is.
            qpn: unsafe { at(self.qp, QP_NUM) },
            psn: self.psn,
            lid: self.dev.lid,
            gid: self.dev.gid,
            mtu: self.dev.mtu,
        }
    }

    fn connect(&self, remote: &QpAddr) -> Result<()> {
        let d = &self.dev;
        let mut rtr = QpAttr::new();
        rtr.u32_at(0, QPS_RTR)
            .u32_at(8, u32::from(d.mtu.min(remote.mtu)))
            .u32_at(20, remote.psn)
            .u32_at(28, remote.qpn)
            .u16_at(80, remote.lid)
            .u8_at(82, crate::env::IB_SL.int() as u8)
            .u8_at(86, d.port)
            .u8_at(127, 16) // max_dest_rd_atomic
            .u8_at(128, 12); // min_rnr_timer
        if d.roce || remote.lid == 0 {
            rtr.0[56..72].copy_from_slice(&remote.gid);
            rtr.u8_at(76, d.gid_index as u8)
                .u8_at(77, 255)
                .u8_at(78, crate::env::IB_TC.int() as u8)
                .u8_at(85, 1);
        }
        self.modify(
            &mut rtr,
            QP_STATE
                | QP_AV
                | QP_PATH_MTU
                | QP_DEST_QPN
                | QP_RQ_PSN
                | QP_MAX_DEST_RD_ATOMIC
                | QP_MIN_RNR_TIMER,
            "moving a queue pair to ready-to-receive",
        )?;
        let mut rts = QpAttr::new();
        rts.u32_at(0, QPS_RTS)
            .u32_at(24, self.psn)
            .u8_at(126, 16) // max_rd_atomic
            .u8_at(130, crate::env::IB_TIMEOUT.int() as u8)
            .u8_at(131, crate::env::IB_RETRY_CNT.int() as u8)
            .u8_at(132, 7); // rnr_retry: unlimited
        self.modify(
            &mut rts,
            QP_STATE | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_SQ_PSN | QP_MAX_QP_RD_ATOMIC,
            "moving a queue pair to ready-to-send",
        )
    }

    fn post_send(&self, wr: &SendWr) -> Result<()> {
        let mut sge = Sge {
            addr: wr.local.addr,
            length: wr.local.len,
            lkey: wr.local.lkey,
        };
        let mut raw = SendWrRaw([0; 128]);
        let put64 = |raw: &mut SendWrRaw, off: usize, v: u64| {
            raw.0[off..off + 8].copy_from_slice(&v.to_ne_bytes())
        };
        let put32 = |raw: &mut SendWrRaw, off: usize, v: u32| {
            raw.0[off..off + 4].copy_from_slice(&v.to_ne_bytes())
        };
        put64(&mut raw, 0, wr.wr_id);
        put64(&mut raw, 16, &mut sge as *mut Sge as u64);
        put32(
            &mut raw,
            24,
            u32::from(wr.local.len > 0 || !matches!(wr.op, Op::WriteImm(_))),
        );
        let (opcode, imm) = match wr.op {
            Op::Write => (WR_RDMA_WRITE, 0),
            Op::WriteImm(imm) => (WR_RDMA_WRITE_WITH_IMM, imm.to_be()),
            Op::Read => (WR_RDMA_READ, 0),
            Op::FetchAdd(_) => (WR_ATOMIC_FETCH_AND_ADD, 0),
            Op::CompareSwap(..) => (WR_ATOMIC_CMP_AND_SWP, 0),
        };
        put32(&mut raw, 28, opcode);
        put32(&mut raw, 32, if wr.signaled { SEND_SIGNALED } else { 0 });
        put32(&mut raw, 36, imm);
        put64(&mut raw, 40, wr.remote.addr);
        match wr.op {
            Op::FetchAdd(add) => {
                put64(&mut raw, 48, add);
                put32(&mut raw, 64, wr.remote.rkey);
            }
            Op::CompareSwap(cmp, swap) => {
                put64(&mut raw, 48, cmp);
                put64(&mut raw, 56, swap);
                put32(&mut raw, 64, wr.remote.rkey);
            }
            _ => put32(&mut raw, 48, wr.remote.rkey),
        }
        let mut bad: P = std::ptr::null_mut();
        // SAFETY: the operation's signature; the work request and its sge outlive the call
        // (the library copies them into the send queue).
        let rc = unsafe {
            let post: unsafe extern "C" fn(P, *mut SendWrRaw, *mut P) -> c_int =
                self.op(CTX_OPS_POST_SEND);
            post(self.qp, &mut raw, &mut bad)
        };
        if rc != 0 {
            return Err(self.failed("ibv_post_send", rc));
        }
        Ok(())
    }

    fn post_recv(&self, wr_id: u64) -> Result<()> {
        let mut wr = RecvWrRaw {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: P = std::ptr::null_mut();
        // SAFETY: as for post_send.
        let rc = unsafe {
            let post: unsafe extern "C" fn(P, *mut RecvWrRaw, *mut P) -> c_int =
                self.op(CTX_OPS_POST_RECV);
            post(self.qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(self.failed("ibv_post_recv", rc));
        }
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<()> {
        let mut wc = [Wc {
            wr_id: 0,
            status: 0,
            opcode: 0,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num: 0,
            src_qp: 0,
            wc_flags: 0,
            pkey_index: 0,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
        }; 16];
        let want = max.min(wc.len()) as c_int;
        // SAFETY: the operation's signature; `wc` has room for `want` entries.
        let n = unsafe {
            let poll: unsafe extern "C" fn(P, c_int, *mut Wc) -> c_int = self.op(CTX_OPS_POLL_CQ);
            poll(self.cq, want, wc.as_mut_ptr())
        };
        if n < 0 {
            return Err(self.failed("ibv_poll_cq", n));
        }
        for w in &wc[..n as usize] {
            let error = (w.status != 0).then(|| {
                // SAFETY: returns a static string for any status.
                let s = unsafe { CStr::from_ptr((self.dev.syms.wc_status_str)(w.status as c_int)) };
                format!(
                    "{} ({}, vendor error {:#x})",
                    s.to_string_lossy(),
                    w.status,
                    w.vendor_err
                )
            });
            let what = if w.opcode == WC_RECV_RDMA_WITH_IMM || (w.opcode & 128 != 0) {
                Completed::RecvImm(u32::from_be(w.imm_data))
            } else {
                Completed::Send
            };
            out.push(Completion {
                wr_id: w.wr_id,
                what,
                error,
            });
        }
        Ok(())
    }

    fn arm(&self) -> Result<()> {
        // SAFETY: the operation's signature.
        let rc = unsafe {
            let notify: unsafe extern "C" fn(P, c_int) -> c_int = self.op(CTX_OPS_REQ_NOTIFY_CQ);
            notify(self.cq, 0)
        };
        if rc != 0 {
            return Err(self.failed("ibv_req_notify_cq", rc));
        }
        Ok(())
    }
}

impl Drop for HwQp {
    fn drop(&mut self) {
        // SAFETY: created by this device, destroyed once, the queue pair before its queue;
        // the notify box outlives the completion queue that carried it.
        unsafe {
            (self.dev.syms.destroy_qp)(self.qp);
            (self.dev.syms.destroy_cq)(self.cq);
            drop(Box::from_raw(self.notify));
        }
    }
}

impl HwDevice {
    /// What a registration call returned: the registration, owned until dropped, or (NULL)
    /// the error, `what` naming the call, with errno.
    fn registered(&self, mr: P, what: impl FnOnce() -> String) -> Result<Arc<dyn Mr>> {
        if mr.is_null() {
            // Read before building the message, which allocates.
            let errno = std::io::Error::last_os_error();
            return Err(Error::new(
                ErrorKind::System,
                format!("{} on {}: {errno}", what(), self.dev.name),
            ));
        }
        Ok(Arc::new(HwMr {
            dev: self.dev.clone(),
            mr,
        }))
    }
}

impl Device for HwDevice {
    fn name(&self) -> String {
        format!("{}:{}", self.dev.name, self.dev.port)
    }

    fn register(&self, addr: *mut u8, len: usize) -> Result<Arc<dyn Mr>> {
        // SAFETY: the caller keeps `len` bytes at `addr` alive while registered.
        let mr = unsafe { (self.dev.syms.reg_mr)(self.dev.pd, addr.cast(), len, ACCESS) };
        self.registered(mr, || format!("ibv_reg_mr of {len} bytes"))
    }

    fn dmabuf_support(&self) -> std::result::Result<(), String> {
        self.dev
            .dmabuf
            .as_ref()
            .map(|_| ())
            .map_err(|why| why.clone())
    }

    fn register_dmabuf(
        &self,
        fd: std::os::fd::RawFd,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<Arc<dyn Mr>> {
        let reg = match &self.dev.dmabuf {
            Ok(reg) => *reg,
            Err(why) => {
                return Err(Error::new(
                    ErrorKind::InvalidUsage,
                    format!("{}: no dmabuf registration: {why}", self.name()),
                ))
            }
        };
        // SAFETY: a valid protection domain; the library checks the descriptor and range.
        let mr = unsafe { reg(self.dev.pd, offset, len, iova, fd, ACCESS) };
        self.registered(mr, || {
            format!("ibv_reg_dmabuf_mr of {len} bytes at offset {offset} of dmabuf fd {fd}")
        })
    }

    fn create_qp(&self, depth: u32, notify: Arc<dyn Fn() + Send + Sync>) -> Result<Arc<dyn Qp>> {
        let d = &self.dev;
        let boxed = Box::into_raw(Box::new(Notify(notify)));
        // SAFETY: valid context and channel; the box lives until the queue is destroyed.
        let cq =
            unsafe { (d.syms.create_cq)(d.ctx, 2 * depth as c_int, boxed.cast(), d.channel, 0) };
        if cq.is_null() {
            // SAFETY: not handed to anything.
            drop(unsafe { Box::from_raw(boxed) });
            return crate::system_err!(
                "ibv_create_cq on {}: {}",
                d.name,
                std::io::Error::last_os_error()
            );
        }
        let mut init = QpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: std::ptr::null_mut(),
            cap: QpCap {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: a valid protection domain and attributes.
        let qp = unsafe { (d.syms.create_qp)(d.pd, &mut init) };
        if qp.is_null() {
            // SAFETY: created above, not used by anything else.
            unsafe {
                (d.syms.destroy_cq)(cq);
                drop(Box::from_raw(boxed));
            }
            return crate::system_err!(
                "ibv_create_qp on {}: {}",
                d.name,
                std::io::Error::last_os_error()
            );
        }
        let psn = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|t| t.subsec_nanos())
            .unwrap_or(1))
            & 0xff_ffff;
        let q = HwQp {
            dev: d.clone(),
            qp,
            cq,
            notify: boxed,
            psn,
        };
        let mut attr = QpAttr::new();
        attr.u32_at(0, QPS_INIT)
            .u32_at(32, ACCESS as u32)
            .u16_at(120, 0)
            .u8_at(129, d.port);
        q.modify(
            &mut attr,
            QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS,
            "moving a queue pair to init",
        )?;
        Ok(Arc::new(q))
    }
}

impl Drop for HwDevice {
    fn drop(&mut self) {
        self.dev.stop.store(true, Ordering::Release);
    }
}

/// Opens `name` and returns it with its first active port allowed by `spec`.
fn open_port(
    s: &'static Syms,
    dev: P,
    name: &str,
    spec: &HcaSpec,
) -> std::result::Result<Opened, String> {
    // SAFETY: a device of the current list.
    let ctx = unsafe { (s.open_device)(dev) };
    if ctx.is_null() {
        return Err(format!("{name}: ibv_open_device failed"));
    }
    let close = |why: String| {
        // SAFETY: opened above.
        unsafe { (s.close_device)(ctx) };
        Err(why)
    };
    let mut found = None;
    for port in 1..=8u8 {
        if !spec.allows(name, port) {
            continue;
        }
        let mut attr = [0u8; 64];
        // SAFETY: a buffer larger than the port attributes the library fills.
        if unsafe { (s.query_port)(ctx, port, attr.as_mut_ptr()) } != 0 {
            break;
        }
        let state = u32::from_ne_bytes(attr[PORT_STATE..PORT_STATE + 4].try_into().unwrap());
        if state == PORT_ACTIVE {
            found = Some((port, attr));
            break;
        }
    }
    let Some((port, attr)) = found else {
        return close(format!("{name}: no active port"));
    };
    let mtu = u32::from_ne_bytes(
        attr[PORT_ACTIVE_MTU..PORT_ACTIVE_MTU + 4]
            .try_into()
            .unwrap(),
    ) as u8;
    let lid = u16::from_ne_bytes(attr[PORT_LID..PORT_LID + 2].try_into().unwrap());
    let roce = attr[PORT_LINK_LAYER] == LINK_LAYER_ETHERNET;
    let gid_index = crate::env::IB_GID_INDEX
        .set_value()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| if roce { roce_gid_index(name, port) } else { 0 });
    let mut gid = [0u8; 16];
    // SAFETY: a valid context and out-pointer.
    if unsafe { (s.query_gid)(ctx, port, gid_index, &mut gid) } != 0 && roce {
        return close(format!("{name}:{port}: no GID at index {gid_index}"));
    }
    // SAFETY: a valid context.
    let pd = unsafe { (s.alloc_pd)(ctx) };
    if pd.is_null() {
        return close(format!("{name}: ibv_alloc_pd failed"));
    }
    // SAFETY: a valid context.
    let channel = unsafe { (s.create_comp_channel)(ctx) };
    if channel.is_null() {
        // SAFETY: allocated above.
        unsafe { (s.dealloc_pd)(pd) };
        return close(format!("{name}: ibv_create_comp_channel failed"));
    }
    let dmabuf = dmabuf_support(s, pd, name);
    match &dmabuf {
        Ok(_) => crate::info!("{name}:{port}: GPUDirect RDMA through dmabuf is available"),
        Err(why) => {
            crate::info!("{name}:{port}: GPUDirect RDMA through dmabuf is unavailable: {why}")
        }
    }
    Ok(Opened {
        syms: s,
        name: name.to_string(),
        ctx,
        pd,
        channel,
        port,
        lid,
        gid,
        gid_index,
        roce,
        mtu,
        dmabuf,
        stop: AtomicBool::new(false),
    })
}

/// Whether `pd`'s device registers dmabufs, as NCCL finds out: a registration of no file
/// fails with EBADF where the kernel and the driver support dmabuf, with EOPNOTSUPP or
/// EPROTONOSUPPORT where they do not.
fn dmabuf_support(s: &Syms, pd: P, name: &str) -> std::result::Result<RegDmabufMr, String> {
    let reg = s.reg_dmabuf_mr.clone()?;
    // SAFETY: errno is this thread's; a valid protection domain and an invalid fd, which the
    // library rejects (a registration it made anyway is released at once).
    let err = unsafe {
        *libc::__errno_location() = 0;
        let mr = reg(pd, 0, 0, 0, -1, 0);
        let err = *libc::__errno_location();
        if !mr.is_null() {
            (s.dereg_mr)(mr);
        }
        err
    };
    if err == libc::EOPNOTSUPP || err == libc::EPROTONOSUPPORT {
        return Err(format!(
            "{name} or this kernel does not register dmabufs (ibv_reg_dmabuf_mr: {}; needs Linux 5.12 or later and a driver with dmabuf support)",
            std::io::Error::from_raw_os_error(err)
        ));
    }
    Ok(reg)
}

impl Provider for Library {
    fn open(&self) -> Result<std::result::Result<Arc<dyn Device>, String>> {
        let s = match load() {
            Ok(s) => s,
            Err(why) => return Ok(Err(why)),
        };
        let spec = HcaSpec::parse(&crate::env::IB_HCA.value());
        let mut n: c_int = 0;
        // SAFETY: the out-pointer is valid; the list is freed below.
        let list = unsafe { (s.get_device_list)(&mut n) };
        if list.is_null() || n <= 0 {
            if !list.is_null() {
                // SAFETY: from get_device_list.
                unsafe { (s.free_device_list)(list) };
            }
            return Ok(Err("libibverbs lists no RDMA device".to_string()));
        }
        let mut reasons = Vec::new();
        let mut opened = None;
        for i in 0..n as usize {
            // SAFETY: the list holds `n` devices, each with a NUL-terminated name.
            let (dev, name) = unsafe {
                let d = *list.add(i);
                (
                    d,
                    CStr::from_ptr((s.get_device_name)(d))
                        .to_string_lossy()
                        .into_owned(),
                )
            };
            if !(1..=8).any(|p| spec.allows(&name, p)) {
                reasons.push(format!("{name}: excluded by NCCL_IB_HCA"));
                continue;
            }
            match open_port(s, dev, &name, &spec) {
                Ok(o) => {
                    opened = Some(o);
                    break;
                }
                Err(why) => reasons.push(why),
            }
        }
        // SAFETY: from get_device_list; opened contexts stay valid after the list is freed.
        unsafe { (s.free_device_list)(list) };
        let Some(o) = opened else {
            return Ok(Err(format!(
                "no usable RDMA device ({})",
                reasons.join("; ")
            )));
        };
        let dev = Arc::new(o);
        let events = dev.clone();
        std::thread::Builder::new()
            .name("comm-ib-events".into())
            .spawn(move || HwDevice::events(events))
            .map_err(|e| Error::from_io("start the InfiniBand event thread", e))?;
        Ok(Ok(Arc::new(HwDevice { dev })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The offsets and constants above against rdma-core's header, where it is installed
    /// (scripts/deps.sh installs it): a C program prints them with offsetof.
    #[test]
    fn layouts_match_the_installed_verbs_header() {
        if !std::path::Path::new("/usr/include/infiniband/verbs.h").exists() {
            assert!(std::env::var("CI").is_err(), "CI needs libibverbs-dev");
            eprintln!("skipped: no infiniband/verbs.h");
            return;
        }
        let dir = std::env::temp_dir().join(format!("comm-verbs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("layout.c");
        let checks: &[(&str, usize)] = &[
            ("offsetof(struct ibv_context, ops.poll_cq)", CTX_OPS_POLL_CQ),
            ("offsetof(struct ibv_context, ops.req_notify_cq)", CTX_OPS_REQ_NOTIFY_CQ),
            ("offsetof(struct ibv_context, ops.post_send)", CTX_OPS_POST_SEND),
            ("offsetof(struct ibv_context, ops.post_recv)", CTX_OPS_POST_RECV),
            ("offsetof(struct ibv_qp, qp_num)", QP_NUM),
            ("offsetof(struct ibv_mr, lkey)", MR_LKEY),
            ("offsetof(struct ibv_mr, rkey)", MR_RKEY),
            ("offsetof(struct ibv_comp_channel, fd)", CHANNEL_FD),
            ("offsetof(struct ibv_port_attr, state)", PORT_STATE),
            ("offsetof(struct ibv_port_attr, active_mtu)", PORT_ACTIVE_MTU),
            ("offsetof(struct ibv_port_attr, lid)", PORT_LID),
            ("offsetof(struct ibv_port_attr, link_layer)", PORT_LINK_LAYER),
            ("sizeof(struct ibv_qp_attr)", std::mem::size_of::<QpAttr>()),
            ("offsetof(struct ibv_qp_attr, path_mtu)", 8),
            ("offsetof(struct ibv_qp_attr, rq_psn)", 20),
            ("offsetof(struct ibv_qp_attr, sq_psn)", 24),
            ("offsetof(struct ibv_qp_attr, dest_qp_num)", 28),
            ("offsetof(struct ibv_qp_attr, qp_access_flags)", 32),
            ("offsetof(struct ibv_qp_attr, ah_attr.grh.dgid)", 56),
            ("offsetof(struct ibv_qp_attr, ah_attr.grh.sgid_index)", 76),
            ("offsetof(struct ibv_qp_attr, ah_attr.grh.hop_limit)", 77),
            ("offsetof(struct ibv_qp_attr, ah_attr.grh.traffic_class)", 78),
            ("offsetof(struct ibv_qp_attr, ah_attr.dlid)", 80),
            ("offsetof(struct ibv_qp_attr, ah_attr.sl)", 82),
            ("offsetof(struct ibv_qp_attr, ah_attr.is_global)", 85),
            ("offsetof(struct ibv_qp_attr, ah_attr.port_num)", 86),
            ("offsetof(struct ibv_qp_attr, pkey_index)", 120),
            ("offsetof(struct ibv_qp_attr, max_rd_atomic)", 126),
            ("offsetof(struct ibv_qp_attr, max_dest_rd_atomic)", 127),
            ("offsetof(struct ibv_qp_attr, min_rnr_timer)", 128),
            ("offsetof(struct ibv_qp_attr, port_num)", 129),
            ("offsetof(struct ibv_qp_attr, timeout)", 130),
            ("offsetof(struct ibv_qp_attr, retry_cnt)", 131),
            ("offsetof(struct ibv_qp_attr, rnr_retry)", 132),
            ("sizeof(struct ibv_send_wr)", std::mem::size_of::<SendWrRaw>()),
            ("offsetof(struct ibv_send_wr, sg_list)", 16),
            ("offsetof(struct ibv_send_wr, num_sge)", 24),
            ("offsetof(struct ibv_send_wr, opcode)", 28),
            ("offsetof(struct ibv_send_wr, send_flags)", 32),
            ("offsetof(struct ibv_send_wr, imm_data)", 36),
            ("offsetof(struct ibv_send_wr, wr.rdma.remote_addr)", 40),
            ("offsetof(struct ibv_send_wr, wr.rdma.rkey)", 48),
            ("offsetof(struct ibv_send_wr, wr.atomic.compare_add)", 48),
            ("offsetof(struct ibv_send_wr, wr.atomic.swap)", 56),
            ("offsetof(struct ibv_send_wr, wr.atomic.rkey)", 64),
            ("sizeof(struct ibv_recv_wr)", std::mem::size_of::<RecvWrRaw>()),
            ("sizeof(struct ibv_wc)", std::mem::size_of::<Wc>()),
            ("offsetof(struct ibv_wc, imm_data)", std::mem::offset_of!(Wc, imm_data)),
            ("offsetof(struct ibv_wc, vendor_err)", std::mem::offset_of!(Wc, vendor_err)),
            ("sizeof(struct ibv_qp_init_attr)", std::mem::size_of::<QpInitAttr>()),
            ("offsetof(struct ibv_qp_init_attr, cap)", std::mem::offset_of!(QpInitAttr, cap)),
            ("offsetof(struct ibv_qp_init_attr, qp_type)", std::mem::offset_of!(QpInitAttr, qp_type)),
            ("sizeof(struct ibv_sge)", std::mem::size_of::<Sge>()),
            ("IBV_PORT_ACTIVE", PORT_ACTIVE as usize),
            ("IBV_LINK_LAYER_ETHERNET", LINK_LAYER_ETHERNET as usize),
            ("IBV_QPT_RC", QPT_RC as usize),
            ("IBV_QPS_INIT", QPS_INIT as usize),
            ("IBV_QPS_RTR", QPS_RTR as usize),
            ("IBV_QPS_RTS", QPS_RTS as usize),
            ("IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC", ACCESS as usize),
            ("IBV_WR_RDMA_WRITE", WR_RDMA_WRITE as usize),
            ("IBV_WR_RDMA_WRITE_WITH_IMM", WR_RDMA_WRITE_WITH_IMM as usize),
            ("IBV_WR_RDMA_READ", WR_RDMA_READ as usize),
            ("IBV_WR_ATOMIC_CMP_AND_SWP", WR_ATOMIC_CMP_AND_SWP as usize),
            ("IBV_WR_ATOMIC_FETCH_AND_ADD", WR_ATOMIC_FETCH_AND_ADD as usize),
            ("IBV_SEND_SIGNALED", SEND_SIGNALED as usize),
            ("IBV_WC_RECV_RDMA_WITH_IMM", WC_RECV_RDMA_WITH_IMM as usize),
            ("IBV_QP_STATE", QP_STATE as usize),
            ("IBV_QP_PKEY_INDEX", QP_PKEY_INDEX as usize),
            ("IBV_QP_PORT", QP_PORT as usize),
            ("IBV_QP_ACCESS_FLAGS", QP_ACCESS_FLAGS as usize),
            ("IBV_QP_AV", QP_AV as usize),
            ("IBV_QP_PATH_MTU", QP_PATH_MTU as usize),
            ("IBV_QP_TIMEOUT", QP_TIMEOUT as usize),
            ("IBV_QP_RETRY_CNT", QP_RETRY_CNT as usize),
            ("IBV_QP_RNR_RETRY", QP_RNR_RETRY as usize),
            ("IBV_QP_RQ_PSN", QP_RQ_PSN as usize),
            ("IBV_QP_MAX_QP_RD_ATOMIC", QP_MAX_QP_RD_ATOMIC as usize),
            ("IBV_QP_MIN_RNR_TIMER", QP_MIN_RNR_TIMER as usize),
            ("IBV_QP_SQ_PSN", QP_SQ_PSN as usize),
            ("IBV_QP_MAX_DEST_RD_ATOMIC", QP_MAX_DEST_RD_ATOMIC as usize),
            ("IBV_QP_DEST_QPN", QP_DEST_QPN as usize),
        ];
        let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n");
        for (expr, _) in checks {
            c.push_str(&format!("  printf(\"%zu\\n\", (size_t)({expr}));\n"));
        }
        c.push_str("  return 0;\n}\n");
        std::fs::write(&src, c).unwrap();
        let exe = dir.join("layout");
        let built = std::process::Command::new("cc")
            .arg(&src)
            .arg("-o")
            .arg(&exe)
            .status()
            .expect("run cc");
        assert!(built.success(), "compiling the layout check failed");
        let out = std::process::Command::new(&exe).output().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let got: Vec<usize> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect();
        assert_eq!(got.len(), checks.len());
        for ((expr, ours), theirs) in checks.iter().zip(got) {
            assert_eq!(*ours, theirs, "{expr}: ours {ours}, verbs.h {theirs}");
        }
    }

    /// ibv_reg_dmabuf_mr is found where this rdma-core has it, and a library without it (a
    /// version it does not define stands in for an older rdma-core) is reported, not fatal.
    #[test]
    fn dmabuf_registration_is_probed_on_its_own() {
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept.
        let h = unsafe {
            libc::dlopen(
                c"libibverbs.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_LOCAL,
            )
        };
        if h.is_null() {
            assert!(std::env::var("CI").is_err(), "CI needs rdma-core");
            eprintln!("skipped: no libibverbs.so.1");
            return;
        }
        let missing = dmabuf_sym(h, c"IBVERBS_0.9").expect_err("no such version");
        assert!(
            missing.contains("ibv_reg_dmabuf_mr@IBVERBS_0.9") && missing.contains("v34"),
            "{missing}"
        );
        let syms = load().expect("the base symbols load");
        if std::fs::read_to_string("/usr/include/infiniband/verbs.h")
            .is_ok_and(|h| h.contains("ibv_reg_dmabuf_mr"))
        {
            assert!(
                syms.reg_dmabuf_mr.is_ok(),
                "{:?}",
                syms.reg_dmabuf_mr.as_ref().err()
            );
        }
    }

    #[test]
    fn nccl_ib_hca_selects_like_nccl() {
        let any = HcaSpec::parse("");
        assert!(any.allows("mlx5_3", 2));
        let some = HcaSpec::parse("mlx5_0:1,mlx5_1");
        assert!(some.allows("mlx5_0", 1));
        assert!(!some.allows("mlx5_0", 2));
        assert!(some.allows("mlx5_1", 2));
        assert!(some.allows("mlx5_10", 1), "names are prefixes");
        assert!(!some.allows("mlx4_0", 1));
        let exact = HcaSpec::parse("=mlx5_1");
        assert!(exact.allows("mlx5_1", 1));
        assert!(!exact.allows("mlx5_10", 1));
        let not = HcaSpec::parse("^mlx5_0");
        assert!(!not.allows("mlx5_0", 1));
        assert!(not.allows("mlx5_2", 1));
        let not_exact = HcaSpec::parse("^=mlx5_1:1");
        assert!(!not_exact.allows("mlx5_1", 1));
        assert!(not_exact.allows("mlx5_1", 2));
        assert!(not_exact.allows("mlx5_10", 1));
    }
}
