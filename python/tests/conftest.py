"""Test set-up: every multi-process test goes through launcher.run, which never waits past
its timeout; pytest-timeout (pyproject.toml) bounds each test as a second net.

libcomm.so is taken from COMM_LIBRARY (scripts/test_python.sh points it at the fresh build).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def pytest_configure(config):
    lib = os.environ.get("COMM_LIBRARY")
    if lib and not os.path.exists(lib):
        raise pytest.UsageError(f"COMM_LIBRARY={lib} does not exist; build it with cargo build --release")


@pytest.fixture(scope="session")
def libcomm_path():
    import comm_torch

    return comm_torch.library_path()
