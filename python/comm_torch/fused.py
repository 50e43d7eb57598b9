"""All-gather + matmul on CPU over symmetric memory: the matmul consumes each rank's chunk
of A as soon as that rank's signal arrives, reading it in place from the peer's memory.

``all_gather_matmul(a_shard, b, group)`` returns ``(A, A @ B)`` where ``A`` is the row-wise
concatenation of every rank's ``a_shard`` — the result of ``all_gather`` then ``matmul``,
without waiting for the whole gather before the first product. Each rank copies its shard
into a workspace in symmetric memory (one per shape, dtype and group, made once) and signals
every peer on a channel; then it multiplies its own chunk, and each peer's chunk once that
peer's signal arrives: in place (``get_buffer``) for peers on this host, through a one-sided
get for peers on other hosts. A closing barrier keeps a rank from overwriting its workspace
while a peer still reads it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import _lib, symm_mem
from ._window import engine_of

__all__ = ["all_gather_matmul"]

_workspaces: dict[Any, tuple[torch.Tensor, symm_mem.SymmetricMemory]] = {}

_READY, _DONE = 0, 1  # channels


def _workspace(shape: torch.Size, dtype: torch.dtype, group: Any) -> tuple[torch.Tensor, symm_mem.SymmetricMemory]:
    engine = engine_of(group)
    key = (id(engine), tuple(shape), dtype)
    found = _workspaces.get(key)
    if found is None or found[1]._window.closed:
        buf = symm_mem.empty(*shape, dtype=dtype)
        found = (buf, symm_mem.rendezvous(buf, group))
        _workspaces[key] = found
    return found


def all_gather_matmul(
    a_shard: torch.Tensor,
    b: torch.Tensor,
    group: Any = None,
    *,
    return_a: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Collective over ``group`` (backend "comm"; the default group when None): every rank
    passes a shard ``(m, k)`` of the same shape and dtype and the same ``b`` ``(k, n)``.
    Returns ``(A, A @ B)`` with ``A`` of shape ``(world * m, k)`` (None unless ``return_a``)."""
    if a_shard.dim() != 2 or b.dim() != 2 or a_shard.shape[1] != b.shape[0]:
        raise ValueError(f"all_gather_matmul: shapes {tuple(a_shard.shape)} and {tuple(b.shape)} do not multiply")
    if a_shard.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError("all_gather_matmul: CPU tensors only")
    ws, hdl = _workspace(a_shard.shape, a_shard.dtype, group)
    m = a_shard.shape[0]
    rank, world = hdl.rank, hdl.world_size
    out = torch.empty((world * m, b.shape[1]), dtype=torch.result_type(a_shard, b))
    gathered = torch.empty((world * m, a_shard.shape[1]), dtype=a_shard.dtype) if return_a else None
    ws.copy_(a_shard)
    for step in range(1, world):
        hdl.put_signal((rank + step) % world, _READY)
    torch.matmul(ws, b, out=out[rank * m : (rank + 1) * m])
    if gathered is not None:
        gathered[rank * m : (rank + 1) * m].copy_(ws)
    staging = None
    for step in range(1, world):
        peer = (rank - step) % world
        hdl.wait_signal(peer, _READY)
        if hdl.buffer_ptrs[peer]:
            chunk = hdl.get_buffer(peer, ws.shape, ws.dtype)
        else:  # another host: one one-sided read of the chunk
            if staging is None:
                staging = torch.empty_like(ws)
            win = hdl._window
            win.check(
                win.lib.commWinGet(
                    ctypes.c_void_p(staging.data_ptr()),
                    ws.numel() * ws.element_size(),
                    _lib.UINT8,
                    peer,
                    win.handle,
                    hdl.offset,
                    win.engine.handle,
                ),
                "commWinGet",
            )
            chunk = staging
        torch.matmul(chunk, b, out=out[peer * m : (peer + 1) * m])
        if gathered is not None:
            gathered[peer * m : (peer + 1) * m].copy_(chunk)
    hdl.barrier(_DONE)
    return gathered, out
