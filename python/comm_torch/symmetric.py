"""nvmath-python's ``allocate_symmetric_memory`` / ``free_symmetric_memory`` on CPU tensors.

Both are collective over a group on backend "comm" (the default group unless ``group`` is
given). The allocation is shared host memory registered as a window of that group's
communicator, so ``comm_torch.symm_mem.rendezvous(tensor, group)`` gives its handle at once.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._window import Allocation, engine_of, typed_view

__all__ = ["allocate_symmetric_memory", "free_symmetric_memory"]


def _group_max(values: list[int], group: Any) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t]


def allocate_symmetric_memory(
    shape: int | Sequence[int],
    package: types.ModuleType,
    *,
    dtype: torch.dtype | None = None,
    axis_order: str = "C",
    make_symmetric: bool = False,
    skip_symmetric_check: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """Collective: an uninitialised CPU tensor of the local ``shape`` in symmetric memory.

    Every rank must ask for the same number of bytes (ValueError on every rank otherwise),
    unless ``make_symmetric=True``, which gives every rank a buffer of the largest size
    asked for, or ``skip_symmetric_check=True``, which does not compare. Free it with
    ``free_symmetric_memory`` on every rank; the garbage collector frees it only once no
    tensor over it is left."""
    if package is not torch and getattr(package, "__name__", package) != "torch":
        raise TypeError(f"comm_torch.allocate_symmetric_memory: only the torch package is supported, not {package!r}")
    if make_symmetric and skip_symmetric_check:
        raise ValueError(
            "comm_torch.allocate_symmetric_memory: make_symmetric and skip_symmetric_check exclude each other"
        )
    if axis_order not in ("C", "F"):
        raise ValueError(f"comm_torch.allocate_symmetric_memory: axis_order must be 'C' or 'F', not {axis_order!r}")
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    dtype = dtype or torch.get_default_dtype()
    engine = engine_of(group)  # before the first collective: a group not on comm fails everywhere
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    size = nbytes
    if not skip_symmetric_check:
        largest, neg_smallest = _group_max([nbytes, -nbytes], group)
        if largest != -neg_smallest and not make_symmetric:
            raise ValueError(
                "comm_torch.allocate_symmetric_memory: the ranks asked for different sizes "
                f"({-neg_smallest} to {largest} bytes; this rank {nbytes}); pass make_symmetric=True "
                "to give every rank the largest"
            )
        size = largest
    alloc, raw = Allocation.create(size)
    alloc.window(engine)
    alloc.symmetric = True
    if axis_order == "F":
        return typed_view(raw, shape[::-1], dtype).permute(*reversed(range(len(shape))))
    return typed_view(raw, shape, dtype)


def free_symmetric_memory(*tensors: torch.Tensor, group: Any = None) -> None:
    """Collective: frees the memory of tensors from ``allocate_symmetric_memory``; every rank
    passes the same number of tensors, in the same order. The tensors must not be used
    afterwards."""
    allocs = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise TypeError(f"comm_torch.free_symmetric_memory: expected CPU tensors, got {type(t).__name__}")
        alloc = Allocation.of(t)
        if alloc is None or not getattr(alloc, "symmetric", False):
            raise ValueError(
                "comm_torch.free_symmetric_memory: a tensor was not allocated with allocate_symmetric_memory "
                "(or was freed already)"
            )
        allocs.append(alloc)
    engine_of(group)
    # The same number on every rank, and nobody still reading a peer's memory when it goes.
    largest, neg_smallest = _group_max([len(allocs), -len(allocs)], group)
    if largest != -neg_smallest:
        raise ValueError(
            f"comm_torch.free_symmetric_memory: the ranks passed different numbers of tensors "
            f"({-neg_smallest} to {largest}; this rank {len(allocs)})"
        )
    for alloc in allocs:
        alloc.free()
