"""In-process checks of the pieces that need no communicator."""

import ctypes
import os
import re

import pytest
import torch
import torch.distributed as dist

import comm_torch
from comm_torch import _lib, bench
from comm_torch._core import _DTYPES, Reduction
from comm_torch.backend import reduction


def test_struct_layouts():
    assert ctypes.sizeof(_lib.Config) == 96  # ncclConfig_t at NCCL 2.30
    assert ctypes.sizeof(_lib.UniqueId) == 128
    cfg = _lib.Config.new("x")
    assert cfg.magic == 0xCAFEBEEF and cfg.blocking == -(2**31) and cfg.commName == b"x"


def test_library(libcomm_path):
    assert comm_torch.version() == 23007
    assert isinstance(comm_torch.features(), int)


def test_version_is_the_projects():
    # pyproject.toml is the one place the version is written; the package reads its metadata.
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")) as f:
        declared = re.search(r'^version = "([^"]+)"', f.read(), re.MULTILINE).group(1)
    assert comm_torch.__version__ == declared


def test_error_type():
    assert issubclass(comm_torch.CommError, RuntimeError)
    if hasattr(dist, "DistBackendError"):
        assert issubclass(comm_torch.CommError, dist.DistBackendError)
    e = comm_torch.CommError("comm: x failed", result=6, call="x")
    assert e.result_name == "ncclRemoteError" and str(e) == "comm: x failed"


def test_failed_call_carries_the_library_message(libcomm_path):
    lib = _lib.load_library()
    handle = ctypes.c_void_p()
    uid = _lib.UniqueId()
    r = lib.ncclCommInitRankConfig(ctypes.byref(handle), 2, uid, 5, None)  # rank 5 of 2
    with pytest.raises(comm_torch.CommError) as info:
        lib.check(r, "ncclCommInitRankConfig")
    assert "ncclInvalidArgument" in str(info.value) and len(str(info.value)) > 60, str(info.value)


@pytest.mark.parametrize(
    "op, kind",
    [
        (dist.ReduceOp.SUM, "sum"),
        (dist.ReduceOp.PRODUCT, "product"),
        (dist.ReduceOp.MIN, "min"),
        (dist.ReduceOp.MAX, "max"),
        (dist.ReduceOp.AVG, "avg"),
        (dist.ReduceOp.BAND, "band"),
        (dist.ReduceOp.BOR, "bor"),
        (dist.ReduceOp.BXOR, "bxor"),
    ],
)
def test_reduce_ops(op, kind):
    assert reduction(op).kind == kind
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    assert reduction(opts.reduceOp).kind == kind


def test_premul_sum():
    if not hasattr(dist._make_nccl_premul_sum(1.0), "factor"):
        pytest.skip("this torch does not expose ReduceOp.factor to Python backends")
    r = reduction(dist._make_nccl_premul_sum(2.5))
    assert r.kind == "premul_sum" and r.factor == 2.5
    t = torch.tensor([3.0])
    assert torch.equal(reduction(dist._make_nccl_premul_sum(t)).factor, t)


def test_dtypes():
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
    ):
        assert dtype in _DTYPES
    assert isinstance(Reduction("sum").kind, str)


def test_bench_helpers():
    assert bench.parse_size("64M") == 64 << 20 and bench.parse_size("8") == 8 and bench.parse_size("4KB") == 4096
    text = bench.report(2, [(8, 100e-6, 5e-6), (64 << 20, 0.06, 0.02)], "x")
    assert "8 B time <= gloo / 10: 20.00x -> met" in text
    assert "64 MiB busbw >= 3x gloo: 3.00x -> met" in text
