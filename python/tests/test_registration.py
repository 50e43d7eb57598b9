"""How "comm" reaches torch: the entry point (torch >= 2.15), import comm_torch, and the
ProcessGroup plumbing kept for torch without the PyBackend trampoline."""

import sys

import pytest

import launcher


def _torch_has_entry_points():
    import torch.distributed.distributed_c10d as c10d

    return hasattr(c10d.Backend, "_ensure_backend_registered")


@pytest.mark.skipif(
    not _torch_has_entry_points(), reason="this torch predates the torch.distributed.backends entry point"
)
def test_init_process_group_without_import():
    results = launcher.run("entry_point", 2, timeout=90)
    assert not launcher.failed_checks(results, "entry_point"), "\n".join(launcher.failed_checks(results, "entry_point"))


def test_entry_points_declared():
    from importlib.metadata import entry_points

    eps = {
        (e.group, e.name): e.value
        for g in ("torch.distributed.backends", "torchcomms.backends")
        for e in entry_points(group=g)
    }
    assert eps[("torch.distributed.backends", "comm")] == "comm_torch.backend:register"
    assert eps[("torchcomms.backends", "comm")] == "comm_torch.torchcomms_backend"


def _python(code, env=None):
    return launcher.run_command([sys.executable, "-c", code], 120, env)


def test_import_registers():
    out = _python(
        "import torch.distributed as dist, comm_torch\n"
        "assert 'COMM' in dist.Backend._plugins\n"
        "assert dist.Backend.backend_capability['comm'] == ['cpu', 'cuda']\n"
        "comm_torch.register(); comm_torch.register()\n"
        "print('ok')"
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_missing_library_is_explained():
    out = _python(
        "import torch.distributed as dist, comm_torch\n"
        "dist.init_process_group('comm', store=dist.HashStore(), rank=0, world_size=1)",
        env={"COMM_LIBRARY": "/nonexistent/libcomm.so"},
    )
    assert out.returncode != 0
    assert "cannot load libcomm.so" in out.stderr and "COMM_LIBRARY" in out.stderr, out.stderr[-2000:]


def test_process_group_fallback():
    results = launcher.run("process_group_fallback", 2, timeout=120, env={"COMM_TORCH_PROCESS_GROUP": "1"})
    for name in ("is_fallback", "collectives", "ddp"):
        assert not launcher.failed_checks(results, name), "\n".join(launcher.failed_checks(results, name))


def test_work_handles_and_group_name():
    # torch's trampoline turns every Work a Python backend returns into a holder that loses
    # is_completed() and _source_rank(); CommGroup gives callers the backend's own work.
    if not _trampoline():
        pytest.skip("this torch has no PyBackend trampoline: the group is CommProcessGroup already")
    results = launcher.run("work_handles", 3, timeout=120)
    for check in (
        "group_is_comms",
        "completion_after_wait",
        "any_source_names_sender",
        "ddp_logs_comm",
        "mixed_group_is_torchs",
    ):
        assert not launcher.failed_checks(results, check), "\n".join(launcher.failed_checks(results, check))


def _trampoline():
    import comm_torch.backend

    return comm_torch.backend.backend_trampoline_available()
