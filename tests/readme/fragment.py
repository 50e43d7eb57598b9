"""Runs one Python block of a README as one rank of a torchrun job (scripts/test_readme.sh).

    torchrun --nproc-per-node N tests/readme/fragment.py BLOCK.py NAME [SETUP.py]

A block that calls both ``init_process_group`` and ``destroy_process_group`` is a complete
program and runs as it stands. Any other block is an example that the README says runs after a
setup block (python/README.md's first block: the process group on backend "comm", ``rank``,
``world``, ``nxt``, ``prv``): the setup runs first, then the block in the same namespace, then
every rank meets at a barrier (so a rank that leaves early cannot hide a peer's failure) and
the group is destroyed.

torchcomms is not installed by the project's scripts (it needs a matching PyTorch nightly): where
it cannot be imported, the stand-in of its Python-backend interface that python/tests uses
(python/tests/fake_torchcomms) takes its place, and the line printed says so;
COMM_README_REAL_TORCHCOMMS=1 makes a missing torchcomms an error instead.

Prints "<NAME>: OK on rank R of W" per rank; any exception fails the rank.
"""

import os
import sys


def read(path):
    with open(path) as f:
        return f.read()


block_path, name = sys.argv[1], sys.argv[2]
setup_path = sys.argv[3] if len(sys.argv) > 3 else None
source = read(block_path)

try:
    import torchcomms  # noqa: F401

    torchcomms_origin = "installed"
except ImportError:
    if os.environ.get("COMM_README_REAL_TORCHCOMMS") == "1":
        raise
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "python", "tests", "fake_torchcomms"))
    torchcomms_origin = "stand-in"

import comm_torch

want = os.environ.get("COMM_README_PACKAGE_DIR")
if want and not os.path.abspath(comm_torch.__file__).startswith(os.path.abspath(want) + os.sep):
    raise SystemExit(f"comm_torch came from {comm_torch.__file__}, not from {want}")
if torchcomms_origin == "stand-in":
    # An installed comm-torch registers its torchcomms backend through the "torchcomms.backends"
    # entry point; a checkout on PYTHONPATH has no entry points, so import it (it registers).
    import comm_torch.torchcomms_backend

names = {"__name__": "__main__"}
if "init_process_group" in source and "destroy_process_group" in source:
    exec(compile(source, name, "exec"), names)  # noqa: S102 (running the README's code is the point)
    print(f"{name}: OK (a complete program)", flush=True)
    sys.exit(0)
if setup_path is None:
    raise SystemExit(f"{name} is not a complete program, and no setup block was given")
exec(compile(read(setup_path), f"{name} (setup)", "exec"), names)  # noqa: S102
exec(compile(source, name, "exec"), names)  # noqa: S102
dist = names["dist"]
rank, world = dist.get_rank(), dist.get_world_size()
dist.barrier()
dist.destroy_process_group()
print(f"{name}: OK on rank {rank} of {world} (torchcomms: {torchcomms_origin})", flush=True)
