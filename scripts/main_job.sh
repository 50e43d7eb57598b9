#!/usr/bin/env bash
# The main job: builds comm and its benchmarks, then runs all_reduce_perf over 4 local ranks
# (processes, launched torchrun-style) on host memory from 8 B to 64 MiB and prints the table.
# Extra arguments go to all_reduce_perf (e.g. -d all -o all, or -J out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2 >/dev/null
ranks=${COMM_MAIN_RANKS:-4}
# Rendezvous ports come from 20000-31999, below the kernel's ephemeral range (32768-60999 by
# default): a port in that range can be taken for a while as some connection's source port, and
# process 0 then cannot listen on it ("Address already in use"; seen once in some 300 runs).
port=$((20000 + RANDOM % 12000))
pids=()
for ((r = 1; r < ranks; r++)); do
  RANK=$r WORLD_SIZE=$ranks MASTER_PORT=$port build/bench/all_reduce_perf --memory host -b 8 -e 64M -f 2 "$@" >/dev/null &
  pids+=($!)
done
RANK=0 WORLD_SIZE=$ranks MASTER_PORT=$port build/bench/all_reduce_perf --memory host -b 8 -e 64M -f 2 "$@"
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
