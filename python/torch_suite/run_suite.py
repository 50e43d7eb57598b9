"""Runs PyTorch's own distributed test suite (see dist_suite.py for how) on one backend and
writes each test's outcome as JSON.

    COMM_SUITE_BACKEND=comm WORLD_SIZE=2 python run_suite.py --out results.json [-k PATTERN] [TEST ...]

scripts/torch_suite.sh runs it for comm and gloo side by side and compares.
"""

import argparse
import json
import os
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The ranks' forkserver (dist_suite.py) imports dist_suite by name, and Python 3.11's forkserver
# does not pass sys.path on to the server: the environment must carry this directory.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)

# Imported late, and dist_suite before torch: it configures torch's test module first.
import dist_suite
from dist_suite import SUITE_BACKEND, TestDistBackendWithSpawn

# isort: split
import torch


class _Recorder(unittest.TextTestResult):
    """Keeps each test's outcome, duration and (for failures) the end of the message."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}
        self._started = {}

    @staticmethod
    def _name(test):
        return test.id().rsplit(".", 1)[-1]

    def startTest(self, test):
        self._started[self._name(test)] = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, detail=""):
        name = self._name(test)
        took = time.monotonic() - self._started.get(name, time.monotonic())
        self.outcomes[name] = {"outcome": outcome, "seconds": round(took, 2), "detail": detail[-3000:]}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "xfail")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "failed", "unexpected success")


def main():
    parser = argparse.ArgumentParser(description=dist_suite.__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the outcomes (JSON)")
    parser.add_argument("-k", dest="patterns", action="append", default=[], help="substring of test names to run")
    parser.add_argument("tests", nargs="*", help="exact test names to run (default: all)")
    args = parser.parse_args()

    loader = unittest.TestLoader()
    names = loader.getTestCaseNames(TestDistBackendWithSpawn)
    if args.tests:
        unknown = sorted(set(args.tests) - set(names))
        if unknown:
            sys.exit(f"no such tests in distributed_test: {', '.join(unknown)}")
        names = [n for n in names if n in set(args.tests)]
    if args.patterns:
        names = [n for n in names if any(p in n for p in args.patterns)]
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(verbosity=2, resultclass=_Recorder, stream=sys.stderr)
    started = time.monotonic()
    result = runner.run(suite)
    counts = {}
    for o in result.outcomes.values():
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    report = {
        "backend": SUITE_BACKEND,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "torch": torch.__version__,
        "seconds": round(time.monotonic() - started, 1),
        "counts": counts,
        "tests": result.outcomes,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    print(f"{SUITE_BACKEND} world size {report['world_size']}: {counts}", file=sys.stderr)


if __name__ == "__main__":
    main()
