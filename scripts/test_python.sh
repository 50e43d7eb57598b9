#!/usr/bin/env bash
# The Python side: builds libcomm.so, makes sure a virtual environment with torch (from
# PyPI, reused between runs: the default Linux wheel and its CUDA libraries take about 5 GB),
# pytest, ruff and the comm-torch package exists, lints python/ with ruff, then runs
# python/tests. Every multi-process test has its own timeout (tests/launcher.py) and
# pytest-timeout bounds each test as well.
#
#   scripts/test_python.sh [pytest arguments]
#
# COMM_TORCH_VENV chooses the environment (default: $COMM_DEPS/torch-venv); COMM_TORCH_SPEC
# the torch requirement (default: torch). COMM_TEST_PERF=1 also checks the speed targets.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

# A separate environment from $COMM_DEPS/venv: torch's wheel pins its own CUDA toolkit
# packages, which would replace the CUDA 13.0 toolkit that environment holds for nvcc.
VENV=${COMM_TORCH_VENV:-$COMM_DEPS/torch-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
PY=$VENV/bin/python
# expecttest and numpy: torch's own test utilities import them (tests/test_torch_suite.py runs
# part of torch's distributed suite; scripts/torch_suite.sh runs all of it).
if ! "$PY" -c 'import torch.distributed, pytest, pytest_timeout, expecttest, numpy' 2>/dev/null; then
  echo "installing ${COMM_TORCH_SPEC:-torch} and pytest into $VENV (the first time takes a while)" >&2
  "$VENV/bin/pip" install -q "${COMM_TORCH_SPEC:-torch}" pytest pytest-timeout expecttest numpy "setuptools>=64" wheel
fi
# ruff at the version python/pyproject.toml pins (its test extra): each release adds rules.
RUFF_SPEC=$(grep -o '"ruff==[^"]*"' python/pyproject.toml | tr -d '"')
if [ "$("$PY" -m ruff --version 2>/dev/null)" != "ruff ${RUFF_SPEC#ruff==}" ]; then
  "$VENV/bin/pip" install -q "$RUFF_SPEC"
fi
# Before the build: a lint failure is reported in seconds.
"$PY" -m ruff check python
"$PY" -m ruff format --check python

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Editable, so the tests run the checkout's code; this also installs the entry points.
# COMM_TORCH_NO_LIBRARY: no library in the package (python/setup.py); COMM_LIBRARY points the
# tests at the fresh build below.
if ! COMM_TORCH_NO_LIBRARY=1 "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e python/ >"$work/pip.log" 2>&1; then
  cat "$work/pip.log" >&2
  exit 1
fi

cargo build --release
# The tests load a copy, so a rebuild while they run cannot change the library under them.
cp target/release/libcomm.so "$work/libcomm.so"
export COMM_LIBRARY=$work/libcomm.so

"$PY" -c 'import torch; print("torch", torch.__version__)'
"$PY" -m pytest python/tests -o cache_dir="$COMM_DEPS/pytest-cache" --timeout=300 -rs "$@"
echo "python tests passed"
