"""All-gather + matmul on CPU over symmetric memory: the matmul consumes each rank's chunk
of A as soon as that rank's signal arrives, reading it in place from the peer's memory.

``all_gather_matmul(a_shard, b, group)`` returns ``(A, A @ B)`` where ``A`` is the row-wise
concatenation of every rank's ``a_shard`` — the result of ``all_gather`` then ``matmul``,
without waiting for the whole gather before the first product. Each rank copies its shard
into a workspace in symmetric memory (one per shape, dtype and group, made once; skipped when
the shard is that workspace already, see ``shard_workspace``) and signals every peer on a
channel; then it multiplies its own chunk, and each peer's chunk once that peer's signal
arrives: in place (``get_buffer``) for peers on this host, through a one-sided get for peers
on other hosts. Between ranks of one host nothing is copied, so the only cost the two-step
version does not have is one signal and one wait per peer.

Once a rank has multiplied a peer's chunk it tells that peer so on a second channel; a rank
waits for those releases only at its next call on the same workspace, right before it
overwrites it. There is therefore no closing barrier: a rank that is done returns at once.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import _lib, symm_mem
from ._window import engine_of

__all__ = ["all_gather_matmul", "shard_workspace"]

_workspaces: dict[Any, _Workspace] = {}

_READY, _RELEASED = 0, 1  # channels


class _Workspace:
    """A shard-sized buffer in symmetric memory, its handle, and whether this rank's peers
    may still be reading the previous call's contents (their releases not yet waited for)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, group: Any) -> None:
        self.buf = symm_mem.empty(*shape, dtype=dtype)
        self.hdl = symm_mem.rendezvous(self.buf, group)
        self.lent = False

    def reclaim(self) -> None:
        """Waits until every peer has released the previous call's chunk."""
        if self.lent:
            hdl = self.hdl
            for step in range(1, hdl.world_size):
                hdl.wait_signal((hdl.rank + step) % hdl.world_size, _RELEASED)
            self.lent = False


def _workspace(shape: torch.Size, dtype: torch.dtype, group: Any) -> _Workspace:
    engine = engine_of(group)
    key = (id(engine), tuple(shape), dtype)
    found = _workspaces.get(key)
    if found is None or found.hdl._window.closed:
        found = _Workspace(shape, dtype, group)
        _workspaces[key] = found
    return found


def shard_workspace(shape: Any, dtype: torch.dtype, group: Any = None) -> torch.Tensor:
    """The symmetric buffer ``all_gather_matmul`` gathers from for shards of ``shape`` and
    ``dtype`` (collective the first time). Writing the shard there and passing that tensor
    as ``a_shard`` saves the copy into it. This call waits until the peers have released the
    previous call's contents, so the buffer may be written from its return until the next
    ``all_gather_matmul``."""
    ws = _workspace(torch.Size(shape), dtype, group)
    ws.reclaim()
    return ws.buf


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
    wsp = _workspace(a_shard.shape, a_shard.dtype, group)
    ws, hdl = wsp.buf, wsp.hdl
    m = a_shard.shape[0]
    rank, world = hdl.rank, hdl.world_size
    out = torch.empty((world * m, b.shape[1]), dtype=torch.result_type(a_shard, b))
    gathered = torch.empty((world * m, a_shard.shape[1]), dtype=a_shard.dtype) if return_a else None
    wsp.reclaim()  # a no-op after shard_workspace
    if a_shard.data_ptr() != ws.data_ptr() or a_shard.stride() != ws.stride():
        ws.copy_(a_shard)
    for step in range(1, world):
        hdl.put_signal((rank + step) % world, _READY)
    wsp.lent = world > 1
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
            hdl.put_signal(peer, _RELEASED)  # read already: the peer may overwrite it
        torch.matmul(chunk, b, out=out[peer * m : (peer + 1) * m])
        if gathered is not None:
            gathered[peer * m : (peer + 1) * m].copy_(chunk)
        if chunk is not staging:
            hdl.put_signal(peer, _RELEASED)
    return gathered, out
