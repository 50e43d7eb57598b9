"""comm_torch.symm_mem, allocate_symmetric_memory and comm_torch.rdma across processes
(see symm_scenarios.py); "hosts" runs the ranks as two simulated hosts."""

import pytest

import launcher


def _assert_ok(results, names):
    for name in names:
        bad = launcher.failed_checks(results, name)
        assert not bad, "\n".join(bad)


SYMM_MEM_CHECKS = [
    "basics",
    "peer_fills",
    "storage_offset_view",
    "two_threads",
    "wait_timeout",
    "module_functions",
    "ptrs_dev",
    "one_sided",
    "unequal_sizes",
]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_symm_mem(world):
    results = launcher.run("symm_scenarios:symm_mem", world, timeout=150)
    _assert_ok(results, SYMM_MEM_CHECKS)
    assert all(res["values"]["buffer_ptrs_nonzero"] == world for res in results)


@pytest.mark.parametrize("world", [2, 4])
def test_symm_mem_two_hosts(world):
    results = launcher.run("symm_scenarios:symm_mem", world, timeout=150, args=["hosts"])
    _assert_ok(results, SYMM_MEM_CHECKS)
    assert all(res["values"]["buffer_ptrs_nonzero"] == world // 2 for res in results)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_symmetric_allocation(world):
    results = launcher.run("symm_scenarios:symmetric_alloc", world, timeout=150)
    _assert_ok(results, ["equal_shapes", "unequal_shapes", "errors"])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rdma_buffer(world):
    # 100 000 fetch_adds on one counter, from every rank at once.
    results = launcher.run("symm_scenarios:rdma", world, timeout=240, args=["100000"])
    _assert_ok(results, ["reads_writes", "fetch_adds", "cas_lock", "validation"])


def test_rdma_buffer_two_hosts():
    # Neighbours on different simulated hosts: every operation goes over TCP to the target.
    results = launcher.run("symm_scenarios:rdma", 4, timeout=240, args=["hosts", "4000"])
    _assert_ok(results, ["reads_writes", "fetch_adds", "cas_lock", "validation"])


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("hosts", [False, True], ids=["one_host", "two_hosts"])
def test_all_gather_matmul(world, hosts):
    if hosts and world == 3:
        pytest.skip("two hosts are tested with 2 and 4 ranks")
    results = launcher.run("symm_scenarios:all_gather_matmul", world, timeout=240, args=["hosts"] if hosts else [])
    _assert_ok(results, ["matches", "back_to_back", "bench"])
    for res in results:
        assert all(res["values"][f"rel_err_{i}"] < 1e-12 for i in range(3))
    values = results[0]["values"]
    print(
        f"all_gather_matmul world {world}{' two hosts' if hosts else ''}: fused {values['fused_s'] * 1e3:.2f} ms, "
        f"all_gather then matmul {values['all_gather_then_matmul_s'] * 1e3:.2f} ms"
    )


def test_rdma_future_timeout():
    # An operation that never finishes: get() and await both give up after the timeout.
    import asyncio
    import concurrent.futures
    import time

    from comm_torch.rdma import Future

    fut = Future(concurrent.futures.Future(), 0.2)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        fut.get()
    assert 0.15 < time.monotonic() - start < 5

    async def wait():
        return await fut

    with pytest.raises(TimeoutError):
        asyncio.run(wait())
    done = concurrent.futures.Future()
    done.set_result(7)
    assert Future(done, 0.2).get() == 7
    assert asyncio.run(_await(Future(done, 0.2))) == 7


async def _await(fut):
    return await fut
