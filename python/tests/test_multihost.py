"""The torch.distributed backend across hosts: every operation of ``scenarios.ops`` against gloo,
with two simulated hosts of two ranks each (network namespaces, ``scripts/netns.sh``), so that
ranks of one host talk over shared memory and ranks of different hosts over TCP. The ranks
rendezvous through a TCPStore on the first host; gloo runs over the hosts' own interface."""

import os

import pytest

import launcher

PER_HOST = 2
HOSTS = 2


@pytest.fixture(scope="module")
def results():
    why = launcher.Hosts.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    hosts = launcher.Hosts(HOSTS)
    try:
        world = HOSTS * PER_HOST
        port = 20000 + os.getpid() % 20000
        env = {
            "COMM_TEST_TCP_STORE": f"{hosts.addr(0)}:{port}",
            "GLOO_SOCKET_IFNAME": "eth0",
            "COMM_SOCKET_IFNAME": "eth0",
        }
        host_of = [r // PER_HOST for r in range(world)]
        yield launcher.run("ops", world, timeout=280, env=env, hosts=(hosts, host_of))
    finally:
        hosts.close()


def test_every_operation_matches_gloo_across_hosts(results):
    names = sorted({name for r in results for name in r["checks"]})
    assert len(names) > 50, f"only {len(names)} checks ran"
    bad = [f"{name}: {b}" for name in names for b in launcher.failed_checks(results, name)]
    assert not bad, "\n".join(bad[:10])
