"""DistributedDataParallel on "comm" ends with the same weights as on gloo."""

import pytest

import launcher


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_gloo(world):
    results = launcher.run("ddp", world, timeout=180, args=["6"])
    failures = launcher.failed_checks(results, "ddp_matches_gloo")
    assert not failures, "\n".join(failures)
