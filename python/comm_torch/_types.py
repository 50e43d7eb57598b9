"""The dtypes and reductions libcomm takes, as torch names them."""

from __future__ import annotations

import torch

from . import _lib


def _dtype_table():
    table = {
        torch.int8: _lib.INT8,
        torch.uint8: _lib.UINT8,
        torch.int32: _lib.INT32,
        torch.int64: _lib.INT64,
        torch.float16: _lib.FLOAT16,
        torch.float32: _lib.FLOAT32,
        torch.float64: _lib.FLOAT64,
        torch.bfloat16: _lib.BFLOAT16,
    }
    for name, code in (
        ("uint32", _lib.UINT32),
        ("uint64", _lib.UINT64),
        ("float8_e4m3fn", _lib.FLOAT8E4M3),
        ("float8_e5m2", _lib.FLOAT8E5M2),
    ):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            table[dtype] = code
    return table


_DTYPES = _dtype_table()

_OPS = {
    "sum": _lib.OP_SUM,
    "product": _lib.OP_PROD,
    "max": _lib.OP_MAX,
    "min": _lib.OP_MIN,
    "avg": _lib.OP_AVG,
    "band": _lib.OP_BAND,
    "bor": _lib.OP_BOR,
    "bxor": _lib.OP_BXOR,
}


class Reduction:
    """A reduction as the engine sees it: ``kind`` is one of the _OPS names or "premul_sum"."""

    __slots__ = ("factor", "kind")

    def __init__(self, kind: str, factor: float | torch.Tensor | None = None) -> None:
        self.kind = kind
        self.factor = factor

    def __repr__(self):
        return f"Reduction({self.kind!r})" if self.factor is None else f"Reduction(premul_sum, {self.factor})"


SUM = Reduction("sum")
