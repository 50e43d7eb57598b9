"""Patterns a training script uses that hung or gave wrong data on backend "comm" (see
scenarios.user_patterns): collectives from a future's callback (DDP's PowerSGD hook), an
isend with a collective on another group before its wait, uneven all_gather into
non-contiguous outputs, tagged point-to-point calls."""

import pytest

import launcher

CHECKS = [
    "collective_in_then",
    "powersgd_ddp",
    "isend_then_other_group",
    "uneven_all_gather_noncontiguous",
    "tags_warn",
    "any_source_then_send",
]


@pytest.mark.parametrize("world", [2, 3])
def test_user_patterns(world):
    results = launcher.run("user_patterns", world, timeout=180)
    for name in CHECKS:
        bad = launcher.failed_checks(results, name)
        assert not bad, "\n".join(bad)


def test_group_timeout_bounds_every_operation():
    results = launcher.run("group_timeout", 2, timeout=120)
    bad = launcher.failed_checks(results, "late_rank")
    assert not bad, "\n".join(bad)
