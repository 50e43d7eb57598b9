#!/usr/bin/env bash
# The main job: builds comm and runs all_reduce over 4 local ranks on host memory.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2 >/dev/null
exec build/bench/allreduce_example "${@:-4}"
