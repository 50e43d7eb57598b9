//! Buffers registered with ncclCommRegister. Device memory is published to the peers on this
//! host, which then read it in place instead of having it staged (`transport::reg`); host
//! memory is registered with the InfiniBand device where the network links use one, so that
//! they send from it without a copy, and needs nothing for the other transports. Handles are
//! tracked so that deregistration is checked.

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
    /// The InfiniBand registration the network links send from.
    net: Option<u64>,
}

static REGISTRATIONS: LazyLock<Mutex<HashMap<usize, Registration>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static NEXT_REG: AtomicUsize = AtomicUsize::new(1);

impl Comm {
    /// Registers `size` bytes at `buff` (the caller checked that it is not NULL unless `size`
    /// is 0) and returns the handle that deregisters them.
    pub(crate) fn register_buffer(self: &Arc<Self>, buff: *mut u8, size: usize) -> Result<usize> {
        let (mut entry, mut net) = (None, None);
        match crate::cuda::classify(buff as *const std::ffi::c_void) {
            crate::cuda::MemKind::Device(ordinal) if size > 0 => {
                match (&self.device, &self.shm, &self.registry) {
                    (Some(w), _, _) if w.device.ordinal != ordinal => {
                        return crate::invalid_arg!(
                            "buff is memory of GPU {ordinal} but this communicator was created on GPU {}",
                            w.device.ordinal
                        )
                    }
                    (Some(w), Some(shm), Some(reg)) => {
                        entry = reg.export(shm, &w.device, buff as u64, size)?;
                    }
                    _ => crate::info!(
                        "registered {size} bytes of device memory at {buff:p}; no peer on this host reads it in place (no device path, no local peers, or NCCL_LOCAL_REGISTER=0)"
                    ),
                }
            }
            // Host memory, with peers over InfiniBand: the links send from it without a copy.
            crate::cuda::MemKind::Host if size > 0 => {
                if let Some(w) = &self.net {
                    net = w.register(buff, size)?;
                }
                match net {
                    Some(_) => crate::info!(
                        "registered {size} bytes at {buff:p} with the InfiniBand device: sends from it skip the copy"
                    ),
                    None => crate::info!(
                        "registered {size} bytes at {buff:p} (host memory, no InfiniBand peers: nothing to pin)"
                    ),
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
                net,
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
                if let (Some(i), Some(shm), Some(reg)) = (r.entry, &self.shm, &self.registry) {
                    reg.unexport(shm, i);
                }
                if let (Some(id), Some(w)) = (r.net, &self.net) {
                    w.deregister(id);
                }
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
