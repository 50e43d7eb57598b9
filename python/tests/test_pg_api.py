"""The ProcessGroup API of backend "comm" next to gloo, on 2, 3 and 4 ranks (see
pg_scenarios.py): every collective with one tensor and several per rank, coalesced calls
over aliased tensors, futures and their values, sparse tensors, uneven splits, inference and
no-grad modes, the error each invalid argument raises, timeouts, and the fixes that keep a
receive from any source and a locally synchronised new_group from holding or hanging a
group."""

import re

import pytest

import launcher

WORLDS = [2, 3, 4]

# Patterns over the check names of pg_scenarios.api, one test each.
GROUPS = [
    r"^all_reduce/",
    r"^all_reduce_joint/",
    r"^all_reduce_coalesced/",
    r"^broadcast(_joint)?/",
    r"^reduce/",
    r"^all_gather",
    r"^gather/|^scatter/|^gather_scatter/",
    r"^reduce_scatter",
    r"^all_to_all",
    r"^send_recv/|^recv_any_source$|^p2p/",
    r"^barrier$",
    r"^inference_mode/|^grad_mode$",
    r"^reductions/",
]

_cache = {}


def failures(results, pattern):
    names = sorted({name for r in results for name in r["checks"] if re.search(pattern, name)})
    assert names, f"no check matching {pattern} ran"
    bad = []
    for name in names:
        bad += launcher.failed_checks(results, name)
    return bad


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w}ranks")
def api_run(request):
    world = request.param
    if world not in _cache:
        _cache[world] = launcher.run("pg_scenarios:api", world, timeout=180)
    return _cache[world]


@pytest.mark.parametrize("pattern", GROUPS, ids=lambda p: p.split("/")[0].strip("^$"))
def test_api_matches_gloo(api_run, pattern):
    bad = failures(api_run, pattern)
    assert not bad, "\n".join(bad)


def test_any_source_receive_holds_no_collective():
    # A group timeout of 30 s in the scenario: held, the collectives failed after it.
    results = launcher.run("pg_scenarios:any_source_then_collectives", 3, timeout=90)
    bad = failures(results, ".")
    assert not bad, "\n".join(bad)


def test_local_new_group_with_bound_device():
    # The split that waited for ranks that never come fails after COMM_INIT_TIMEOUT.
    results = launcher.run(
        "pg_scenarios:local_new_group", 3, timeout=90, env={"COMM_INIT_TIMEOUT": "20", "COMM_TIMEOUT": "20"}
    )
    bad = failures(results, ".")
    assert not bad, "\n".join(bad)
    for rank, res in enumerate(results[:-1]):
        assert res["values"]["local_origin"] == "init", (rank, res["values"])
        assert res["values"]["whole_origin"] == "split", (rank, res["values"])


def test_timeouts():
    results = launcher.run("pg_scenarios:timeouts", 2, timeout=90)
    bad = failures(results, ".")
    assert not bad, "\n".join(bad)
