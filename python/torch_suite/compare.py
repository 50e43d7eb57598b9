"""Compares the outcomes run_suite.py wrote for gloo and comm, prints both pass counts and every
test that passes on gloo but not on comm, and exits non-zero when such a test is not one of the
known limits below (each with the torch source that keeps it from passing).

    python compare.py gloo.json comm.json [gloo.json comm.json ...]
"""

import json
import sys

_HOLDER = (
    "torch/csrc/distributed/c10d/py/PyProcessGroup.hpp (torch 2.15): WORK_OVERRIDE, which "
    "PyBackend uses for every operation a Python backend implements, wraps the Work that Python "
    "returns in PyProcessGroup::PyWorkHolder, and PyWorkHolder forwards only wait() and "
    "getFuture(). "
)
KNOWN_LIMITS = {
    # isend/irecv: the tests assert work.is_completed() after wait().
    "test_isend": _HOLDER
    + "is_completed() on it is Work::isCompleted() (Work.hpp), which reads the holder's own "
    "completed_, set only by the protected Work::finish() that nothing calls for a holder.",
    "test_isend_autograd_profiler": "as test_isend",
    "test_isend_torch_profiler": "as test_isend",
    "test_irecv": "as test_isend",
    # recv from any source: the tests call work._source_rank() (dist.recv does too).
    "test_send_recv_any_source": _HOLDER
    + "PyBackend::recvAnysource wraps the same way, and _source_rank() on the holder is "
    "Work::sourceRank(), which throws ('sourceRank() may only be called on work objects that "
    "correspond to a recv or recv-from-any call').",
    "test_send_recv_any_source_autograd_profiler": "as test_send_recv_any_source",
    "test_send_recv_any_source_torch_profiler": "as test_send_recv_any_source",
    # DDP logging: backend_name comes from the C++ ProcessGroup.
    "test_ddp_logging_data_cpu": "DDP's logger reads reducer_->process_group_->getBackendName(); "
    "for the ProcessGroup torch builds around a registered backend that is "
    "ProcessGroup::getBackendName() (ProcessGroup.hpp), backendTypeToString(backendType_), and "
    "distributed_c10d.py gives every plugin BackendType.CUSTOM, whose string is 'custom'.",
}


def load(path):
    with open(path) as f:
        return json.load(f)


def passed(report):
    return {name for name, o in report["tests"].items() if o["outcome"] == "passed"}


def main(paths):
    if not paths or len(paths) % 2:
        sys.exit("usage: compare.py gloo.json comm.json [gloo.json comm.json ...]")
    unexplained = 0
    for gloo_path, comm_path in zip(paths[::2], paths[1::2]):
        gloo, comm = load(gloo_path), load(comm_path)
        ws = comm["world_size"]
        if gloo["world_size"] != ws:
            sys.exit(f"{gloo_path} and {comm_path} are of different world sizes")
        print(
            f"world size {ws}: gloo passes {len(passed(gloo))}, comm passes {len(passed(comm))} "
            f"(of {len(comm['tests'])} tests; gloo {gloo['seconds']} s, comm {comm['seconds']} s; torch {comm['torch']})"
        )
        for name in sorted(passed(gloo) - passed(comm)):
            outcome = comm["tests"].get(name, {"outcome": "not run", "detail": ""})
            why = KNOWN_LIMITS.get(name)
            if why is None:
                unexplained += 1
                last = outcome["detail"].strip().splitlines()[-1:] or [""]
                print(f"  FAILS ON COMM ONLY: {name} ({outcome['outcome']}): {last[0][:300]}")
            else:
                print(f"  known limit: {name}: {why}")
        for name in sorted(passed(comm) - passed(gloo)):
            print(f"  passes on comm only: {name}")
    if unexplained:
        print(f"{unexplained} test(s) pass on gloo but not on comm, without a known reason")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
