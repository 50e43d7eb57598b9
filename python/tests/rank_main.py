"""One rank of a test scenario: ``rank_main.py SCENARIO RANK WORLD STORE OUT [ARGS...]``."""

import json
import os
import re
import sys
import traceback

import scenarios


class Context:
    def __init__(self, rank, world, store_path, args):
        self.rank = rank
        self.world = world
        self.store_path = store_path
        self.args = args
        self.checks = {}
        self.values = {}

    def store(self):
        import torch.distributed as dist

        # Ranks on simulated hosts meet over the network, as on real ones: a TCPStore on
        # rank 0's host (COMM_TEST_TCP_STORE=host:port).
        tcp = os.environ.get("COMM_TEST_TCP_STORE")
        if tcp:
            host, port = tcp.rsplit(":", 1)
            return dist.TCPStore(host, int(port), self.world, self.rank == 0)
        return dist.FileStore(self.store_path, self.world)

    def check(self, name, fn, *args):
        """Runs one named check; a failure is recorded, and the scenario goes on.
        COMM_TEST_ONLY (a regular expression) runs only the checks it matches."""
        only = os.environ.get("COMM_TEST_ONLY")
        if only and not re.search(only, name):
            return
        try:
            fn(*args)
            self.checks[name] = "ok"
        except Exception:  # noqa: BLE001  a failed check is recorded, and the next one runs
            self.checks[name] = traceback.format_exc()


def main():
    name, rank, world, store, out = sys.argv[1:6]
    ctx = Context(int(rank), int(world), store, sys.argv[6:])
    module = scenarios
    if ":" in name:  # "module:function", a scenario kept in a module of its own
        import importlib

        mod_name, name = name.split(":", 1)
        module = importlib.import_module(mod_name)
    getattr(module, name)(ctx)
    with open(out, "w") as f:
        json.dump({"checks": ctx.checks, "values": ctx.values}, f)
    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 15):
        # Older torch can deadlock tearing gloo groups down at exit (~ProcessGroupGloo joins
        # its threads holding the GIL while one of them needs it to free a tensor), which
        # has nothing to do with comm: leave without the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
