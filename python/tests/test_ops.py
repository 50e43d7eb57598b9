"""Every torch.distributed operation on backend "comm" (the default group) against gloo on
the same ranks, with 2, 3 and 4 processes and CPU tensors (see scenarios.ops)."""

import re

import pytest

import launcher

WORLDS = [2, 3, 4]

# Patterns over the check names of scenarios.ops, one test each.
GROUPS = [
    r"^all_reduce/SUM/",
    r"^all_reduce/PRODUCT/",
    r"^all_reduce/MIN/",
    r"^all_reduce/MAX/",
    r"^all_reduce/AVG/",
    r"^all_reduce/PREMUL_SUM/",
    r"^all_reduce/BAND/",
    r"^all_reduce/BOR/",
    r"^all_reduce/BXOR/",
    r"^all_reduce/(complex64|bool)$",
    r"^all_reduce/(noncontiguous|empty)$",
    r"^all_reduce_coalesced$",
    r"^coalescing_manager$",
    r"^broadcast/",
    r"^reduce/",
    r"^all_gather/",
    r"^all_gather_into_tensor$",
    r"^all_gather_coalesced$",
    r"^reduce_scatter/",
    r"^reduce_scatter_tensor/",
    r"^all_to_all(/uneven)?$",
    r"^all_to_all_single(/|$)",
    r"^gather/",
    r"^scatter/",
    r"^send_recv$",
    r"^isend_irecv(/|$)",
    r"^batch_isend_irecv$",
    r"^barrier$",
    r"^async/",
    r"^library_error$",
]

_cache = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w}ranks")
def ops_run(request):
    world = request.param
    if world not in _cache:
        _cache[world] = launcher.run("ops", world, timeout=240)
    return world, _cache[world]


@pytest.mark.parametrize("pattern", GROUPS, ids=lambda p: p.strip("^$/").replace("/", "-"))
def test_matches_gloo(ops_run, pattern):
    _, results = ops_run
    names = sorted({name for r in results for name in r["checks"] if re.search(pattern, name)})
    assert names, f"no check matching {pattern} ran"
    failures = []
    for name in names:
        failures += launcher.failed_checks(results, name)
    assert not failures, "\n".join(failures)


def test_library_message_reaches_python(ops_run):
    _, results = ops_run
    text = results[0]["values"]["library_error"]
    # ncclGetLastError's own words, after the call and result names.
    assert "integer" in text, text
