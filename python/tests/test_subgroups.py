"""new_group and split_group on backend "comm" (see scenarios.subgroups)."""

import pytest
import torch

import launcher


def _splits():
    import comm_torch.backend

    return comm_torch.backend.backend_trampoline_available()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "device_id"])
def test_subgroups(world, bound):
    if bound and not _splits():
        pytest.skip(f"torch {torch.__version__} takes no CPU device_id and has no PyBackend trampoline")
    results = launcher.run("subgroups", world, timeout=150, args=["bound"] if bound else [])
    names = ("new_group", "split_group") if _splits() else ("new_group",)
    for name in names:
        assert not launcher.failed_checks(results, name), "\n".join(launcher.failed_checks(results, name))
    for res in results:
        values = res["values"]
        # split_group always splits the parent's communicator; new_group does when the
        # world has a bound device (torch then calls the backend on every rank).
        if _splits():
            assert values["split_group_origin"] == "split"
        if "new_group_origin" in values:
            assert values["new_group_origin"] == ("split" if bound else "init")
