#!/usr/bin/env bash
# Side by side: comm's benchmarks against the same measurements through OpenMPI (mpi_perf), on
# the same machine in the same run, alternating ours and MPI's round after round, 2 ranks as
# processes. Writes one JSON file per run and prints a table of median ratios.
#
#   bench/compare_mpi.sh <bench-build-dir> [rounds] [out-dir]
#
# <bench-build-dir> holds the binaries (e.g. build/bench after scripts/main_job.sh, or a CMake
# build of bench/); MPI's need mpirun (OpenMPI). Also measures the copy bandwidth bound (membw).
set -euo pipefail
bin=${1:?usage: compare_mpi.sh <bench-build-dir> [rounds] [out-dir]}
rounds=${2:-3}
out=${3:-$(mktemp -d)}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
colls=(all_reduce all_gather reduce_scatter alltoall broadcast)
args=(-b 8 -e 64M -f 2 -n 20 -w 5 -c 1 -d float -o sum)
port=$((30000 + RANDOM % 20000))
for ((r = 0; r < rounds; r++)); do
  for c in "${colls[@]}"; do
    port=$((port + 1))
    for rank in 0 1; do
      RANK=$rank WORLD_SIZE=2 MASTER_PORT=$port timeout 300 "$bin/${c}_perf" "${args[@]}" \
        -J "$out/comm.$c.$r.json" >"$out/comm.$c.$r.$rank.log" 2>&1 &
    done
    wait
    timeout 300 mpirun -np 2 "$bin/mpi_perf" "$c" "${args[@]}" -J "$out/mpi.$c.$r.json" >"$out/mpi.$c.$r.log" 2>&1
  done
  "$bin/membw" 2 256 10 >"$out/membw.$r.txt"
done
python3 "$(dirname "$0")/summarize.py" "$out"
echo "raw results in $out"
