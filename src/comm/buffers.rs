//! Buffers registered with ncclCommRegister. Device memory is published to the peers on this
//! host, which then read it in place instead of having it staged (`transport::reg`); host
//! memory is registered with every transport that wants to know of it (`Transport::register`:
//! InfiniBand, so that its links send from it without a copy; the others need nothing).
//! Handles are tracked so that deregistration is checked.

use super::Comm;
use crate::error::Result;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Weak};

struct Registration {
    /// The communicator it was made on: another one may not deregister it. Weak, so that the
    /// registration does not keep it alive, and its address is not reused while it is here.
    comm: Weak<Comm>,
    /// The communicator's registry entry, for device memory published to the peers.
    entry: Option<usize>,
    /// The transports' registrations of host memory.
    host: crate::transport::list::Registered,
}

static REGISTRATIONS: LazyLock<Mutex<HashMap<usize, Registration>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static NEXT_REG: AtomicUsize = AtomicUsize::new(1);

impl Comm {
    /// Registers `size` bytes at `buff` (the caller checked that it is not NULL unless `size`
    /// is 0) and returns the handle that deregisters them.
    pub(crate) fn register_buffer(self: &Arc<Self>, buff: *mut u8, size: usize) -> Result<usize> {
        let (mut entry, mut host) = (None, Default::default());
        match crate::cuda::classify(buff as *const std::ffi::c_void) {
            crate::cuda::MemKind::Device(ordinal) if size > 0 => {
                match (&self.device, &self.registry) {
                    (Some(w), _) if w.device.ordinal != ordinal => {
                        return crate::invalid_arg!(
                            "buff is memory of GPU {ordinal} but this communicator was created on GPU {}",
                            w.device.ordinal
                        )
                    }
                    (Some(w), Some(reg)) => {
                        entry = reg.export(&self.transports, &w.device, buff as u64, size)?;
                    }
                    _ => crate::info!(
                        "registered {size} bytes of device memory at {buff:p}; no peer on this host reads it in place (no device path, no local peers, or NCCL_LOCAL_REGISTER=0)"
                    ),
                }
            }
            // Host memory: the transports that send from it without a copy (InfiniBand).
            crate::cuda::MemKind::Host if size > 0 => {
                host = self.transports.register(buff, size)?;
                if host.is_empty() {
                    crate::info!(
                        "registered {size} bytes at {buff:p} (host memory, no InfiniBand peers: nothing to pin)"
                    )
                } else {
                    crate::info!(
                        "registered {size} bytes at {buff:p} with {}: sends from it skip the copy",
                        self.transports.registered_with(&host).join(", ")
                    )
                }
            }
            _ => {}
        }
        let h = 0x5e60_0000_0000 + 0x40 * NEXT_REG.fetch_add(1, Ordering::SeqCst);
        REGISTRATIONS.lock().insert(
            h,
            Registration {
                comm: Arc::downgrade(self),
                entry,
                host,
            },
        );
        Ok(h)
    }

    /// Undoes `register_buffer` of `handle`, which must be a live registration of this
    /// communicator.
    pub(crate) fn deregister_buffer(self: &Arc<Self>, handle: usize) -> Result<()> {
        let mut regs = REGISTRATIONS.lock();
        match regs.get(&handle) {
            Some(r) if std::ptr::eq(r.comm.as_ptr(), Arc::as_ptr(self)) => {
                if let (Some(i), Some(reg)) = (r.entry, &self.registry) {
                    reg.unexport(&self.transports, i);
                }
                self.transports.deregister(&r.host);
                regs.remove(&handle);
                Ok(())
            }
            Some(_) => crate::invalid_arg!(
                "handle {:p} was registered on another communicator",
                handle as *const u8
            ),
            None => crate::invalid_arg!(
                "handle {:p} is not a live registration (never registered, or already deregistered)",
                handle as *const u8
            ),
        }
    }
}
