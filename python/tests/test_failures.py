"""A rank that dies makes the others raise instead of hanging."""

import pytest

import launcher


@pytest.mark.parametrize("world", [2, 3])
def test_dead_rank_raises(world):
    victim = world - 1
    results = launcher.run("dead_rank", world, timeout=90, expect_exit={victim: 17})
    for name in ("blocked_collective_fails", "later_calls_fail"):
        failures = launcher.failed_checks(results[:victim], name)
        assert not failures, "\n".join(failures)
    for res in results[:victim]:
        # The library notices a dead peer quickly; COMM_TIMEOUT (60 s here) is only a net.
        assert res["values"]["seconds"] < 30, res["values"]


def test_single_rank_semantics():
    results = launcher.run("single_rank", 1, timeout=60)
    for name in results[0]["checks"]:
        failures = launcher.failed_checks(results, name)
        assert not failures, "\n".join(failures)
    assert len(results[0]["checks"]) >= 4


def test_recv_from_any_source_three_ranks():
    # Two senders at once; rank 0 must get every message, each attributed to its sender.
    results = launcher.run("any_source", 3, timeout=90)
    failures = launcher.failed_checks(results, "receives_name_their_sender")
    assert not failures, "\n".join(failures)
