"""PyTorch's own distributed test suite, configured to run on one backend
(COMM_SUITE_BACKEND: comm or gloo) the way PyTorch's test/distributed/test_distributed_spawn.py
drives it (BACKEND, WORLD_SIZE, INIT_METHOD and TEMP_DIR as that file expects them).

The suite is ``DistributedTest._DistTestBase`` from
``torch.testing._internal.distributed.distributed_test`` (part of the torch wheel), on CPU
tensors. Each test starts WORLD_SIZE processes (``MultiProcessTestCase``); each imports this
module before it runs its rank, so the configuration below applies to them as well.

How comm is put in gloo's place (these are the harness's only changes to torch's tests):

* distributed_test.py picks its tests at import time from the environment variable BACKEND:
  decorators such as ``skip_but_pass_in_sandcastle_if(BACKEND != "gloo", ...)`` and
  ``require_backend_is_available({"gloo"})`` are evaluated then. The module is imported with
  BACKEND=gloo for both backends, so comm is given exactly the tests gloo is given: comm
  claims gloo's CPU feature set.
* The module's global ``BACKEND`` is then set to the backend under test, so that
  ``init_process_group(backend=BACKEND)`` and checks such as ``dist.get_backend() == BACKEND``
  see "comm". For comm it is the string "comm" that also compares equal to "gloo"
  (``_ClaimsGloo``): test bodies choose their code path at run time with checks like
  ``if BACKEND == "mpi" or BACKEND == "gloo":`` (DDP's CPU module set-up), and comm takes
  gloo's path there as well. Set membership (``BACKEND in {...}``) hashes the plain "comm".
* ``DistTestCases`` (torch.testing._internal.common_distributed) lists which backends have
  which feature. comm joins every set that holds gloo and names a CPU feature: "ddp" and
  "subgroup". It does not join "gpu" and "cuda" (GPU features; these tests need GPUs and
  skip here either way), nor leaves "skip_collective" sets (gloo is in none of them).
* The profiler allow-lists (PROFILING_SUPPORTED_BACKENDS and friends) are left alone: they
  say for which backends a test expects torch's profiler to have recorded the collective,
  and comm's Python backend records no profiler events of its own.

Nothing else is changed: the tests, their timeouts and their assertions are torch's.
"""

import json
import os
import sys

SUITE_BACKEND = os.environ.get("COMM_SUITE_BACKEND", "comm")
os.environ["BACKEND"] = "gloo"  # the test selection: see the module docstring
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# Imported only now: torch's test modules read the environment above when they are imported.
import torch
import torch.distributed as dist
from torch.testing._internal import common_distributed

CPU_FEATURES_OF_GLOO = ("ddp", "subgroup")
for _feature in CPU_FEATURES_OF_GLOO:
    common_distributed.DistTestCases.backend_feature[_feature].add("comm")

# After comm joined the feature sets: distributed_test's decorators read them at import.
from torch.testing._internal.distributed import distributed_test


class _ClaimsGloo(str):
    """ "comm", equal to "gloo" as well (see the module docstring)."""

    def __eq__(self, other):
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


distributed_test.BACKEND = _ClaimsGloo(SUITE_BACKEND) if SUITE_BACKEND == "comm" else SUITE_BACKEND
if SUITE_BACKEND == "comm":
    import comm_torch  # noqa: F401  registers backend "comm" (also done by the entry point)

if not dist.is_available():  # pragma: no cover
    sys.exit("torch.distributed is not available in this torch build")


# Set by setUp for each test (initialize_temp_directories); the ranks must see this test's.
_PER_TEST_ENV = ("TEMP_DIR", "INIT_METHOD")


class TestDistBackendWithSpawn(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    """What test_distributed_spawn.py builds, under a name that says which backend runs."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def _spawn_processes(self):
        # "spawn" (torch's choice) starts every rank of every test from an empty interpreter,
        # which spends most of a test importing torch and this module again. "forkserver"
        # forks each rank from one server process that imported them once: still a fresh
        # process with none of the test runner's state, in a fraction of the time.
        method = os.environ.get("COMM_SUITE_START_METHOD", "forkserver")
        if method == "spawn":
            return super()._spawn_processes()
        ctx = torch.multiprocessing.get_context(method)
        if method == "forkserver":
            # By name: Python 3.11's forkserver ignores a preload of "__main__".
            ctx.set_forkserver_preload([__name__])
            # A forkserver's children inherit the server's environment, not this process's,
            # and setUp points TEMP_DIR and INIT_METHOD at a fresh directory for every test.
            with open(self.file_name + ".env", "w") as f:
                json.dump({k: os.environ[k] for k in _PER_TEST_ENV if k in os.environ}, f)
        self._start_processes(ctx.Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        try:
            with open(file_name + ".env") as f:
                os.environ.update(json.load(f))
        except FileNotFoundError:
            pass
        super()._run(rank, test_name, file_name, pipe, **kwargs)

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name + ".env")
        except (FileNotFoundError, AttributeError):
            pass
