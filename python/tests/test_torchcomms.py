"""The torchcomms backend "comm", driven through tests/fake_torchcomms.

torchcomms is not on PyPI, so these tests stand in for it with a fake of its registration
and factory that follows torchcomms' documented Python-backend interface (entry-point
loading, register_backend, init/finalize, the collective argument lists, split)."""

import pytest

import launcher


@pytest.mark.parametrize("world", [2, 3, 4])
def test_torchcomms_backend(world):
    results = launcher.run("torchcomms_backend", world, timeout=120)
    for name in ("identity", "all_reduce", "collectives", "split", "windows"):
        failures = launcher.failed_checks(results, name)
        assert not failures, "\n".join(failures)


def test_torchcomms_timeouts_bound_init_and_operations():
    results = launcher.run("torchcomms_timeouts", 3, timeout=120)
    for name in ("init", "operation"):
        failures = launcher.failed_checks(results, name)
        assert not failures, "\n".join(failures)


def test_torchcomms_abort_process_on_failure():
    # The last rank leaves; the others' all-reduce fails and ends their processes (SIGABRT).
    launcher.run("torchcomms_abort", 3, timeout=120, expect_exit={0: -6, 1: -6})
