//! Enqueueing a compiled program on a CUDA stream.

use super::program::{DevOp, Factor, Loc};
use crate::algo::Buf;
use crate::error::Result;
use crate::reduce::ReduceOp;
use crate::transport::p2p::Desc;

/// The device addresses of one operation's buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpBuffers {
    pub send: u64,
    pub recv: u64,
    pub scratch: u64,
}

impl OpBuffers {
    pub(crate) fn base(&self, buf: Buf) -> u64 {
        match buf {
            Buf::Send => self.send,
            Buf::Recv => self.recv,
            Buf::Scratch => self.scratch,
        }
    }
}

/// Enqueues a compiled program on `stream`. Nothing waits on the host: the program's own flag
/// waits hold the stream until the peers' programs have done their part.
pub(crate) fn enqueue(
    prog: &[DevOp],
    world: &crate::transport::p2p::DeviceWorld,
    bufs: &[OpBuffers],
    stream: crate::cuda::Stream,
) -> Result<()> {
    use crate::cuda::kernels::{reduce_kernel_name, ReduceArgs, MAX_SOURCES};
    use crate::reduce::DataType;
    // A location's address, and the descriptor cell to read first when it is a message that
    // may sit in the sender's registered buffer.
    let resolve = |loc: Loc| -> Result<(u64, u64)> {
        match loc {
            Loc::Buf { op, buf, offset } => Ok((bufs[op].base(buf) + offset as u64, 0)),
            Loc::Slot {
                owner,
                to,
                slot,
                offset,
            } => Ok((world.slot_addr(owner, to, slot, offset)?, 0)),
            Loc::Message { from, to, slot } => Ok((
                world.slot_addr(from, to, slot, 0)?,
                world.desc_addr(Desc {
                    owner: to,
                    from,
                    slot,
                })?,
            )),
        }
    };
    let _bound = world.device.bind()?;
    for op in prog {
        match op {
            DevOp::Copy { dst, src, len } => {
                let (s, via) = resolve(*src)?;
                let (d, _) = resolve(*dst)?;
                if via == 0 {
                    stream.copy(d, s, *len)?;
                } else {
                    // Where the bytes are is known only on the device: a byte copy kernel that
                    // reads the descriptor first.
                    let mut args = ReduceArgs {
                        dst: d as *mut std::ffi::c_void,
                        nsrc: 1,
                        count: *len as u64,
                        ..ReduceArgs::default()
                    };
                    args.src[0] = s as *const std::ffi::c_void;
                    args.via[0] = via as *const u64;
                    let name =
                        reduce_kernel_name(DataType::Uint8, ReduceOp::Sum).expect("u8 sum exists");
                    stream.reduce(&world.device, name, DataType::Uint8, &args)?;
                }
            }
            DevOp::Set { flag, value } => stream.set_flag(world.flag_addr(*flag)?, *value)?,
            DevOp::Wait { flag, value } => stream.wait_flag(world.flag_addr(*flag)?, *value)?,
            DevOp::Describe { desc, direct, .. } => {
                stream.set_u64(world.desc_addr(*desc)?, direct.map_or(0, |d| d.1))?
            }
            DevOp::Reduce {
                dst,
                srcs,
                count,
                reducer,
                divide_by,
            } => {
                if srcs.len() > MAX_SOURCES {
                    return crate::internal_err!("{} sources for one reduction", srcs.len());
                }
                let name = reduce_kernel_name(reducer.dtype, reducer.op).ok_or_else(|| {
                    crate::error::Error::new(
                        crate::error::ErrorKind::InvalidArgument,
                        format!(
                            "{} is not defined on {}",
                            reducer.op.name(),
                            reducer.dtype.name()
                        ),
                    )
                })?;
                let (dst_addr, _) = resolve(*dst)?;
                let mut resolved = srcs
                    .iter()
                    .map(|s| Ok((resolve(s.loc)?, s.scale)))
                    .collect::<Result<Vec<_>>>()?;
                // The kernels allow only the first source to be the destination itself; the
                // op is commutative, so put the aliased source first.
                if let Some(k) = resolved.iter().position(|((a, _), _)| *a == dst_addr) {
                    resolved.swap(0, k);
                }
                let mut args = ReduceArgs {
                    dst: dst_addr as *mut std::ffi::c_void,
                    nsrc: resolved.len() as i32,
                    count: *count as u64,
                    divide_by: divide_by.unwrap_or(0) as u64,
                    ..ReduceArgs::default()
                };
                for (i, ((a, via), scale)) in resolved.iter().enumerate() {
                    args.src[i] = *a as *const std::ffi::c_void;
                    if *via != 0 {
                        args.via[i] = *via as *const u64;
                    }
                    match scale {
                        Some(Factor::Value(s)) => args.scale[i] = u64::from_le_bytes(s.0),
                        Some(Factor::At(at)) => args.scale_at[i] = *at as *const std::ffi::c_void,
                        None => {}
                    }
                    if scale.is_some() {
                        args.has_scale |= 1 << i;
                    }
                }
                stream.reduce(&world.device, name, reducer.dtype, &args)?;
            }
        }
    }
    Ok(())
}
