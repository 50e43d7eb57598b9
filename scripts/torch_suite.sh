#!/usr/bin/env bash
# PyTorch's own distributed test suite on backend "comm" and, side by side, on gloo: builds
# libcomm.so, runs torch.testing._internal.distributed.distributed_test (DistributedTest.
# _DistTestBase, CPU tensors) the way torch's test/distributed/test_distributed_spawn.py does,
# for each world size and backend, then prints both pass counts and every test that passes on
# gloo but not on comm. Exits 1 when such a test is not a known limit (python/torch_suite/
# compare.py lists those, each with the torch source that keeps it from passing).
#
#   scripts/torch_suite.sh [-w "2 3"] [-k PATTERN]... [TEST_NAME]...
#
# The harness's changes to torch's test configuration (comm is given gloo's test selection and
# joins DistTestCases' CPU feature sets "ddp" and "subgroup") are written down in
# python/torch_suite/dist_suite.py. Results are kept in $COMM_SUITE_OUT (default: a temporary
# directory), one JSON file per backend and world size.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

WORLD_SIZES="2 3"
SELECT=()
while (($#)); do
  case "$1" in
    -w) WORLD_SIZES=$2; shift 2 ;;
    -k) SELECT+=(-k "$2"); shift 2 ;;
    *) SELECT+=("$1"); shift ;;
  esac
done

VENV=${COMM_TORCH_VENV:-$COMM_DEPS/torch-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
PY=$VENV/bin/python
# torch's test utilities import expecttest and numpy, which torch's wheel does not require.
if ! "$PY" -c 'import torch.distributed, expecttest, numpy' 2>/dev/null; then
  "$VENV/bin/pip" install -q "${COMM_TORCH_SPEC:-torch}" expecttest numpy
fi

cargo build --release
OUT=${COMM_SUITE_OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# The ranks load a copy, so a rebuild meanwhile cannot change the library under them.
cp target/release/libcomm.so "$OUT/libcomm.so"
export COMM_LIBRARY=$OUT/libcomm.so
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
# Bounds: torch's per-test limit (MultiProcessTestCase kills the ranks past it), and the
# library's own limit on an operation that makes no progress.
export DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=${DISTRIBUTED_TESTS_DEFAULT_TIMEOUT:-120}
export COMM_TIMEOUT=${COMM_TIMEOUT:-120}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}

pairs=()
for ws in $WORLD_SIZES; do
  for backend in gloo comm; do
    echo "== $backend, world size $ws" >&2
    COMM_SUITE_BACKEND=$backend WORLD_SIZE=$ws timeout 3600 \
      "$PY" python/torch_suite/run_suite.py --out "$OUT/$backend-$ws.json" "${SELECT[@]}" \
      >"$OUT/$backend-$ws.log" 2>&1 || true
    if [ ! -f "$OUT/$backend-$ws.json" ]; then
      tail -50 "$OUT/$backend-$ws.log" >&2
      echo "the suite did not finish on $backend at world size $ws (log: $OUT/$backend-$ws.log)" >&2
      exit 1
    fi
    pairs+=("$OUT/$backend-$ws.json")
  done
done
echo "results and logs in $OUT"
"$PY" python/torch_suite/compare.py "${pairs[@]}"
