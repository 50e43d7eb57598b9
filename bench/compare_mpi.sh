#!/usr/bin/env bash
# comm against OpenMPI and MPICH, side by side in one run: every power-of-two size, in place
# and out of place, for several rank counts, with ranks unpinned (the torchrun way: no CPU
# binding) and pinned, round after round with the libraries alternating (the order rotates
# each round, so none always runs first). Writes one JSON file per run and prints, per cell,
# the speed of comm against the best MPI of the same round, with min and max across rounds.
#
#   bench/compare_mpi.sh <bench-build-dir> [rounds] [out-dir]
#
# <bench-build-dir> holds the binaries (build/bench after scripts/main_job.sh, or a CMake build
# of bench/): comm's <collective>_perf, mpi_perf (OpenMPI, the default MPI) and mpi_perf_mpich
# (built when Debian's libmpich-dev is installed; scripts/deps.sh installs it). A library whose
# binary or launcher is missing is left out with a message. Settings (environment):
#   COMPARE_RANKS    rank counts                  "2 4"
#   COMPARE_PINNING  unpinned and/or pinned       "unpinned pinned"
#   COMPARE_COLLS    collectives                  "all_reduce all_gather reduce_scatter alltoall broadcast"
#   COMPARE_MIN, COMPARE_MAX   sizes in bytes     8, 64M
#   COMPARE_ITERS, COMPARE_WARMUP                 20, 5
#   COMPARE_TIMEOUT  seconds per run              600
#   COMPARE_BASELINE a directory holding another libcomm.so (an older build): its runs, named
#                    "base", take turns with the others on the same benchmark binaries (loaded
#                    through LD_LIBRARY_PATH), and the summary adds a table of the new library
#                    against the old one and of each against the best MPI of the same round
# Pinned means rank r on CPU r mod ncpu: `taskset` for comm, `--bind-to core` for OpenMPI
# (overload allowed when ranks outnumber cores) and `-bind-to core` for MPICH. Unpinned means
# no binding at all (OpenMPI binds by default, so it gets `--bind-to none`).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:?usage: compare_mpi.sh <bench-build-dir> [rounds] [out-dir]}
bin=$(cd "$bin" && pwd)
rounds=${2:-3}
out=${3:-$(mktemp -d)}
mkdir -p "$out"
read -r -a ranks <<<"${COMPARE_RANKS:-2 4}"
read -r -a pinnings <<<"${COMPARE_PINNING:-unpinned pinned}"
read -r -a colls <<<"${COMPARE_COLLS:-all_reduce all_gather reduce_scatter alltoall broadcast}"
args=(-b "${COMPARE_MIN:-8}" -e "${COMPARE_MAX:-64M}" -f 2 -n "${COMPARE_ITERS:-20}"
  -w "${COMPARE_WARMUP:-5}" -c 1 -d float -o sum)
limit=${COMPARE_TIMEOUT:-600}
ncpu=$(nproc)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

for p in "${pinnings[@]}"; do
  [[ $p == pinned || $p == unpinned ]] || { echo "COMPARE_PINNING: '$p' is neither pinned nor unpinned" >&2; exit 2; }
done

libs=(comm)
base=${COMPARE_BASELINE:-}
if [ -n "$base" ]; then
  [ -f "$base/libcomm.so" ] || { echo "COMPARE_BASELINE: no libcomm.so in $base" >&2; exit 2; }
  # The benchmark binaries link libnccl.so.2, found through their RUNPATH when the directory
  # has no file of that name: a directory holding only libcomm.so would compare the build's
  # library with itself. The old build goes under both names in a directory of our own, and
  # the loader must be seen to pick it.
  given=$(cd "$base" && pwd)
  base=$(mktemp -d)
  trap 'rm -rf "$base"' EXIT
  ln -s "$given/libcomm.so" "$base/libcomm.so"
  ln -s "$given/libcomm.so" "$base/libnccl.so.2"
  LD_LIBRARY_PATH=$base ldd "$bin/all_reduce_perf" | grep "libnccl.so.2 => $base/" >/dev/null || {
    echo "COMPARE_BASELINE: $bin/all_reduce_perf does not load the library in $given" >&2
    exit 2
  }
  libs+=(base)
fi
if [ -x "$bin/mpi_perf" ] && command -v mpirun.openmpi >/dev/null; then
  libs+=(openmpi)
else
  echo "OpenMPI left out: no $bin/mpi_perf or no mpirun.openmpi" >&2
fi
if [ -x "$bin/mpi_perf_mpich" ] && command -v mpirun.mpich >/dev/null; then
  libs+=(mpich)
else
  echo "MPICH left out: no $bin/mpi_perf_mpich or no mpirun.mpich (apt-get install mpich libmpich-dev, then rebuild bench/)" >&2
fi
((${#libs[@]} > 1)) || { echo "no MPI to compare with" >&2; exit 1; }

# Rendezvous ports come from 20000-31999, below the kernel's ephemeral range (32768-60999 by
# default): a port in that range can be taken for a while as some connection's source port, and
# process 0 then cannot listen on it ("Address already in use"; seen once in some 300 runs).
port=$((20000 + RANDOM % 12000))
failures=0

# run <lib> <ranks> <pinning> <collective> <stem>: one run, its JSON at <stem>.json.
run() {
  local lib=$1 n=$2 pin=$3 c=$4 stem=$5 rc=0
  case $lib in
    comm | base)
      port=$((20000 + (port - 20000 + 1) % 12000))
      local pids=() r pre
      for ((r = 0; r < n; r++)); do
        pre=()
        [ "$pin" = pinned ] && pre=(taskset -c $((r % ncpu)))
        [ "$lib" = base ] && pre=(env LD_LIBRARY_PATH="$base" "${pre[@]}")
        RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
          timeout "$limit" "${pre[@]}" "$bin/${c}_perf" "${args[@]}" -J "$stem.json" >"$stem.$r.log" 2>&1 &
        pids+=($!)
      done
      for r in "${pids[@]}"; do wait "$r" || rc=$?; done
      ;;
    openmpi)
      local bind=(--bind-to none)
      [ "$pin" = pinned ] && bind=(--bind-to core:overload-allowed --map-by core)
      timeout "$limit" mpirun.openmpi --oversubscribe -np "$n" "${bind[@]}" \
        "$bin/mpi_perf" "$c" "${args[@]}" -J "$stem.json" >"$stem.log" 2>&1 || rc=$?
      ;;
    mpich)
      local bind=()
      [ "$pin" = pinned ] && bind=(-bind-to core)
      timeout "$limit" mpirun.mpich -np "$n" "${bind[@]}" \
        "$bin/mpi_perf_mpich" "$c" "${args[@]}" -J "$stem.json" >"$stem.log" 2>&1 || rc=$?
      ;;
  esac
  if [ "$rc" != 0 ] || [ ! -s "$stem.json" ]; then
    echo "FAILED (exit $rc): $lib $c, $n ranks $pin; logs at $stem*.log" >&2
    rm -f "$stem.json"
    failures=$((failures + 1))
  fi
}

echo "comparing ${libs[*]}: ${colls[*]}; ranks ${ranks[*]}; ${pinnings[*]}; $rounds rounds; ${args[*]}" >&2
for ((round = 0; round < rounds; round++)); do
  for n in "${ranks[@]}"; do
    for pin in "${pinnings[@]}"; do
      for c in "${colls[@]}"; do
        for ((i = 0; i < ${#libs[@]}; i++)); do
          lib=${libs[$(((i + round) % ${#libs[@]}))]}
          run "$lib" "$n" "$pin" "$c" "$out/$lib.$c.n$n.$pin.r$round"
        done
      done
    done
  done
  "$bin/membw" 2 256 10 >"$out/membw.r$round.txt"
  echo "round $((round + 1)) of $rounds done" >&2
done
python3 "$here/summarize.py" "$out"
echo "raw results in $out"
if ((failures)); then
  echo "$failures runs failed" >&2
  exit 1
fi
