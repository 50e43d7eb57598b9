"""Drop-in: with LD_PRELOAD=libcomm.so, ``import torch`` works and every NCCL function
PyTorch imports binds to libcomm (PyTorch's own ProcessGroupNCCL then runs on comm)."""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

import launcher

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The NCCL functions a CUDA build of torch imports (nm -D --undefined-only over torch/lib/*.so),
# one a line; the C ABI test (tests/c_abi.rs) reads the same file. Kept in the repository so that
# this check runs on a CPU-only torch and without nm, where torch_nccl_imports() finds nothing.
REFERENCE = os.path.join(REPO, "tests", "data", "torch_nccl_symbols.txt")
NCCL_PREFIXES = ("nccl", "pnccl")


def torch_nccl_imports():
    """The NCCL C functions torch's shared libraries import (undefined dynamic symbols)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    names = set()
    for lib in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*.so*")):
        out = subprocess.run(
            [nm, "-D", "--undefined-only", lib], check=False, capture_output=True, text=True, timeout=120
        ).stdout
        for line in out.splitlines():
            name = line.split()[-1].split("@")[0]
            if name.startswith(NCCL_PREFIXES):
                names.add(name)
    if not names:
        pytest.skip("this torch build does not link NCCL (a CPU-only wheel)")
    return sorted(names)


def exported(path, names):
    import ctypes

    lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    return [n for n in names if not hasattr(lib, n)]


def test_libcomm_exports_what_torch_imports(libcomm_path):
    missing = exported(libcomm_path, torch_nccl_imports())
    assert not missing, f"libcomm.so lacks {missing}"


def test_libcomm_exports_reference_list(libcomm_path):
    with open(REFERENCE) as f:
        names = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert len(names) > 40
    missing = exported(libcomm_path, names)
    assert not missing, f"libcomm.so lacks {missing}"


PROBE = r"""
import ctypes, sys
import torch

class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

process = ctypes.CDLL(None)
process.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
owners = {}
for name in sys.argv[1:]:
    info = DlInfo()
    addr = ctypes.cast(getattr(process, name), ctypes.c_void_p).value
    assert process.dladdr(addr, ctypes.byref(info)), name
    owners.setdefault(info.fname.decode(), []).append(name)
print("OWNERS", {k: len(v) for k, v in owners.items()})
print("NCCL_VERSION", torch.cuda.nccl.version())
"""


def test_import_torch_with_ld_preload(libcomm_path):
    names = torch_nccl_imports()
    real = os.path.realpath(libcomm_path)
    out = launcher.run_command([sys.executable, "-c", PROBE, *names], 120, {"LD_PRELOAD": real})
    assert out.returncode == 0, out.stderr[-3000:]
    owners = eval(out.stdout.split("OWNERS", 1)[1].splitlines()[0])
    # Every NCCL function torch calls resolves in libcomm, none in NVIDIA's libnccl.
    assert owners == {real: len(names)}, owners
    # torch.cuda.nccl.version() is the NCCL_MAJOR/MINOR/PATCH torch was compiled with
    # (torch/csrc/cuda/nccl.cpp), not a call into the library, so it cannot show which
    # library answers; the dladdr check above does.
    print(out.stdout)
