"""Builds the wheel's native part: libcomm.so, compiled by cargo through setuptools-rust and
placed in the package as comm_torch/lib/libcomm.abi3.so, where comm_torch finds it without
COMM_LIBRARY. The library has no Python bindings (the package reaches it through ctypes), so one
wheel serves every CPython from 3.9 on (tag cp39-abi3).

COMM_TORCH_NO_LIBRARY=1 leaves the library out: a development install whose tests point
COMM_LIBRARY at a fresh build (scripts/test_python.sh) needs no second copy.
"""

import os

from setuptools import setup

if os.environ.get("COMM_TORCH_NO_LIBRARY") == "1":
    setup()
else:
    from setuptools_rust import Binding, RustExtension

    setup(
        rust_extensions=[
            RustExtension(
                "comm_torch.lib.libcomm",
                path="../Cargo.toml",
                binding=Binding.NoBinding,
                py_limited_api=True,
                debug=False,
                # The library's CUDA kernels need nvcc at build time (scripts/deps.sh provides
                # one); without it the library is built for host memory only.
                args=["--package", "comm"],
            )
        ],
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
    )
