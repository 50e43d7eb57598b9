#!/usr/bin/env bash
# Builds the benchmarks (bench/) with CMake against this tree's libcomm and runs every one of
# them briefly as a correctness test, not a measurement: small sweeps on several rank layouts
# (threads, -t x -g, torchrun-style processes, mpirun), every datatype and op for two of them,
# mpi_perf, a JSON file through plot.py, and the failure paths (options that cannot be
# honoured, a corrupted result, -T). Also compiles them against NVIDIA's nccl.h.
#
# Fails when a run exits non-zero, prints a non-zero #wrong, or says FAILED. Every run is
# under `timeout` (COMM_BENCH_TEST_TIMEOUT seconds, default 120).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
limit=${COMM_BENCH_TEST_TIMEOUT:-120}

echo "building bench/ with CMake"
if ! { cmake -S . -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCOMM_CARGO_TARGET_DIR="$PWD/target" &&
       cmake --build "$work/build" -j2; } >"$work/build.log" 2>&1; then
  tail -40 "$work/build.log"
  echo "bench build failed" >&2
  exit 1
fi
bin=$work/build/bench
for p in all_reduce_perf_mpi mpi_perf mpi_perf_mpich; do
  [ -x "$bin/$p" ] || { echo "$p was not built: are OpenMPI (libopenmpi-dev) and MPICH (libmpich-dev) installed?" >&2; exit 1; }
done

if ! timeout "$limit" "$bin/comm_bench_selftest" >"$work/selftest.log" 2>&1; then
  cat "$work/selftest.log" >&2
  echo "harness selftest failed" >&2
  exit 1
fi

COLLS=(all_reduce all_gather reduce_scatter alltoall alltoallv broadcast reduce gather scatter sendrecv)
SWEEP=(-c 1 -n 2 -w 1 -b 8 -e 1M -f 4)
MPIRUN=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
failures=()
runs=0

# The table of a log is right: every #wrong column (found from the header) holds 0, or N/A
# where a column is not checked, and the footer says OK.
table_ok() {
  awk '
    /^#/ && /#wrong/ { n = 0; for (i = 2; i <= NF; i++) if ($i == "#wrong") col[++n] = i - 1; next }
    /^#/ { next }
    $1 ~ /^[0-9]+$/ && n > 0 {
      rows++
      for (k = 1; k <= n; k++) if ($(col[k]) != "0" && !(k > 1 && $(col[k]) == "N/A")) { print "wrong: " $0; bad = 1 }
    }
    END { exit (bad || rows == 0) }' "$1" &&
    grep -q "^# Out of bounds values : 0 OK" "$1" && ! grep -q FAILED "$1"
}

fail() {
  failures+=("$1")
  echo "FAIL: $1" >&2
  shift
  for log in "$@"; do
    echo "---- $log" >&2
    tail -30 "$log" >&2
  done
}

# run NAME COMMAND...: one process (or mpirun) whose output holds the table.
run() {
  local name=$1 log=$work/log.$runs rc=0
  shift
  runs=$((runs + 1))
  timeout "$limit" "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ] || ! table_ok "$log"; then fail "$name (exit $rc)" "$log"; fi
}

free_port() {
  "$COMM_DEPS/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# run_env NAME NPROCS COMMAND...: processes started the way torchrun does (RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR, MASTER_PORT); process 0 prints the table.
run_env() {
  local name=$1 n=$2 port pids=() rc=0 logs=() r
  shift 2
  port=$(free_port)
  for ((r = 0; r < n; r++)); do
    logs+=("$work/log.$runs.$r")
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout "$limit" "$@" >"${logs[r]}" 2>&1 &
    pids+=($!)
  done
  runs=$((runs + 1))
  for r in "${!pids[@]}"; do wait "${pids[r]}" || rc=$?; done
  if [ "$rc" != 0 ] || ! table_ok "${logs[0]}"; then fail "$name (exit $rc)" "${logs[@]}"; fi
}

# expect_fail NAME STATUS PATTERN COMMAND...: the run must end with STATUS and print PATTERN.
expect_fail() {
  local name=$1 want=$2 pattern=$3 log=$work/log.$runs rc=0
  shift 3
  runs=$((runs + 1))
  timeout "$limit" "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" != "$want" ] || ! grep -q -- "$pattern" "$log"; then fail "$name (exit $rc, want $want and '$pattern')" "$log"; fi
}

echo "every collective, every layout"
for c in "${COLLS[@]}"; do
  run "$c -t 3" "$bin/${c}_perf" -t 3 "${SWEEP[@]}"
  run "$c -t 2 -g 2" "$bin/${c}_perf" -t 2 -g 2 "${SWEEP[@]}"
  run_env "$c, 2 processes" 2 "$bin/${c}_perf" "${SWEEP[@]}"
  run_env "$c, 3 processes" 3 "$bin/${c}_perf" "${SWEEP[@]}"
  run "${c}_perf_mpi -np 3" "${MPIRUN[@]}" -np 3 "$bin/${c}_perf_mpi" "${SWEEP[@]}"
  run "mpi_perf $c -np 3" "${MPIRUN[@]}" -np 3 "$bin/mpi_perf" "$c" "${SWEEP[@]}"
done

echo "every datatype and op"
run "all_reduce -d all -o all" "$bin/all_reduce_perf" -t 3 -d all -o all -c 1 -n 1 -w 1 -b 8 -e 64K -f 8
run "reduce_scatter -d all -o all" "$bin/reduce_scatter_perf" -t 3 -d all -o all -c 1 -n 1 -w 1 -b 8 -e 64K -f 8
run "reduce -d all -o all -r -1" "$bin/reduce_perf" -t 2 -g 2 -d all -o all -r -1 -c 1 -n 1 -w 0 -b 8 -e 4K -f 16
run "mpi_perf reduce_scatter -d all -o all" "${MPIRUN[@]}" -np 3 "$bin/mpi_perf" reduce_scatter -d all -o all -c 1 -n 1 -b 8 -e 64K -f 8

echo "options"
run "all_reduce, many options" "$bin/all_reduce_perf" -t 2 -g 2 -m 2 -z 1 -I 1 -K 1 -S 1 -C 1 -a 3 -u 1 -R 1 -M 1 -N 2 \
  -p 1 -n 3 -c 2 -b 8 -e 256K -f 8
run "all_reduce -R 2 (windows), 2 threads x 2 comms" "$bin/all_reduce_perf" -t 2 -g 2 -R 2 -c 1 -n 2 -b 8 -e 256K -f 8
run "alltoallv -z 3 -a 0 -y 1" "$bin/alltoallv_perf" -t 3 -z 3 -a 0 -y 1 -x 1 -c 1 -n 2 -b 1K -e 256K -f 16
run_env "broadcast -r -1 -z 2, 2 processes x 2 threads" 2 "$bin/broadcast_perf" -t 2 -r -1 -z 2 -c 1 -n 2 -b 8 -e 64K -f 16
run "gather -i step" "$bin/gather_perf" -t 3 -r 2 -c 1 -n 1 -b 1K -e 9K -i 4K

echo "JSON and plot.py"
run "scatter -J" "$bin/scatter_perf" -t 3 -c 1 -n 2 -b 8 -e 1M -f 4 -J "$work/scatter.json"
run "mpi_perf scatter -J" "${MPIRUN[@]}" -np 3 "$bin/mpi_perf" scatter -c 1 -n 2 -b 8 -e 1M -f 4 -J "$work/scatter_mpi.json"
if ! timeout "$limit" "$COMM_DEPS/venv/bin/python" bench/plot.py -o "$work/plot.png" "comm=$work/scatter.json" \
      "mpi=$work/scatter_mpi.json" >"$work/plot.log" 2>&1 || [ ! -s "$work/plot.png" ]; then
  fail "plot.py" "$work/plot.log"
fi

echo "provenance"
# The header and the JSON name the library that ran (comm, its version), beside the NCCL API level.
runs=$((runs + 1))
log=$work/provenance.log
want=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
if ! timeout "$limit" "$bin/all_reduce_perf" -t 2 -b 8 -e 8 -n 1 -w 0 -c 1 >"$log" 2>&1 ||
  ! grep -q "^# Library: comm $want (git [0-9a-f]*, NCCL API [0-9.]*)$" "$log" ||
  ! "$COMM_DEPS/venv/bin/python" -c 'import json, sys
d = json.load(open(sys.argv[1]))
sys.exit(not (d["library"] == "comm" and d["library_version"] == sys.argv[2] and "nccl_version" in d))' \
    "$work/scatter.json" "$want"; then
  fail "the header and the JSON name comm and its version" "$log"
fi

echo "compare_mpi.sh (tiny sizes: a check that it runs and tabulates, not a measurement)"
# Every library, rank count and pinning must have run (each cell names the best MPI), and the
# tables must hold a row per collective and size: 8 B to 1 KiB is 8 all_reduce sizes, and 7
# alltoall sizes on 2 ranks (0 and 32 B up) and 6 on 3 (0, 48 B and up), twice each.
runs=$((runs + 1))
log=$work/compare.log
if ! COMPARE_RANKS="2 3" COMPARE_COLLS="all_reduce alltoall" COMPARE_MAX=1K COMPARE_ITERS=2 \
      COMPARE_WARMUP=1 COMPARE_TIMEOUT=$limit bash bench/compare_mpi.sh "$bin" 1 "$work/compare" >"$log" 2>&1 ||
    ! grep -q "^libraries: comm, mpich, openmpi; rounds: 1" "$log" ||
    [ "$(grep -c '^### ' "$log")" != 4 ] ||
    [ "$(grep -cE '^\| (all_reduce|alltoall) \| [0-9KM]+ \| [0-9.]+ \| [0-9.]+ (openmpi|mpich) \|' "$log")" != 58 ] ||
    [ "$(ls "$work"/compare/*.json | wc -l)" != 24 ]; then
  fail "compare_mpi.sh" "$log"
fi

echo "launchers"
# The plain binaries join one job under mpirun, as nccl-tests built with MPI do: one table
# with three ranks, not three one-rank tables.
log=$work/log.$runs
runs=$((runs + 1))
if ! timeout "$limit" "${MPIRUN[@]}" -np 3 "$bin/all_reduce_perf" "${SWEEP[@]}" >"$log" 2>&1 || ! table_ok "$log" ||
  [ "$(grep -c '^#  Rank  0 ' "$log")" != 1 ] || ! grep -q '^#  Rank  2 ' "$log"; then
  fail "all_reduce_perf under mpirun -np 3 (one job of 3 ranks)" "$log"
fi
# srun is not installed here: its variables, set as it sets them, make one job too, and so do
# the PMI variables without a launcher's descriptor (the port comes from the job id when
# MASTER_PORT is not set).
for vars in "SLURM_PROCID SLURM_STEP_NUM_TASKS SLURM_JOB_ID" "PMI_RANK PMI_SIZE PMI_KVSNAME"; do
  read -r rank_var size_var job_var <<<"$vars"
  job=$RANDOM$RANDOM
  logs=()
  pids=()
  for r in 0 1 2; do
    logs+=("$work/log.$runs.$r")
    env "$rank_var=$r" "$size_var=3" "$job_var=$job" timeout "$limit" "$bin/all_reduce_perf" "${SWEEP[@]}" \
      >"${logs[r]}" 2>&1 &
    pids+=($!)
  done
  runs=$((runs + 1))
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  if [ "$rc" != 0 ] || ! table_ok "${logs[0]}" || ! grep -q '^#  Rank  2 ' "${logs[0]}"; then
    fail "all_reduce_perf with $rank_var and $size_var (exit $rc)" "${logs[@]}"
  fi
done
# Two jobs at once on one node stay apart: MPICH's mpiexec sets no job variable (the harness
# asks its PMI descriptor for the job's name), and two srun steps of one allocation share
# SLURM_JOB_ID. One rank of each job starts late, so that without a port per job the early
# ranks would meet the other job's process 0; the jobs differ in datatype, so a mix fails.
both_jobs() { # NAME LOG_A LOG_B RC
  if [ "$4" != 0 ] || ! table_ok "$2" || ! table_ok "$3" || grep -q "another job" "$2" "$3"; then
    fail "$1 (exit $4)" "$2" "$3"
  fi
}
if command -v mpiexec.hydra >/dev/null; then
  rc=0
  for job in 0 1; do
    timeout "$limit" mpiexec.hydra -n 2 bash -c 'sleep $(( (PMI_RANK + '$job') % 2 * 2 )); exec "$@"' sh \
      "$bin/all_reduce_perf" -b 8 -e 1K -f 4 -n 2 -w 1 -c 1 -d "$([ $job = 0 ] && echo float || echo double)" \
      >"$work/hydra.$job" 2>&1 </dev/null &
    pids[job]=$!
    sleep 0.5
  done
  wait "${pids[0]}" || rc=$?
  wait "${pids[1]}" || rc=$?
  runs=$((runs + 1))
  both_jobs "two mpiexec.hydra jobs at once" "$work/hydra.0" "$work/hydra.1" "$rc"
fi
rc=0
for r in 0 1; do
  for step in 0 1; do
    [ "$r" = 1 ] && [ "$step" = 1 ] && sleep 2
    env SLURM_JOB_ID=$$ SLURM_STEP_ID=$step SLURM_PROCID=$r SLURM_STEP_NUM_TASKS=2 SLURM_LOCALID=$r \
      timeout "$limit" "$bin/all_reduce_perf" -b 8 -e 1K -f 4 -n 2 -w 1 -c 1 \
      -d "$([ $step = 0 ] && echo float || echo double)" >"$work/step.$step.$r" 2>&1 &
    spids+=($!)
  done
done
for p in "${spids[@]}"; do wait "$p" || rc=$?; done
runs=$((runs + 1))
both_jobs "two srun steps of one job at once" "$work/step.0.0" "$work/step.1.0" "$rc"

# A process that tries to reach process 0 before it listens can have its connect() meet itself
# when the port is in the ephemeral range, and then held the port process 0 must bind ("Address
# already in use"). In a network namespace of its own, the ephemeral range is narrowed to the
# rendezvous port and one more while process 1 tries alone, then widened for the job.
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null; then
  log=$work/log.$runs
  runs=$((runs + 1))
  if ! timeout "$limit" unshare --net bash -c '
      set -e
      ip link set lo up
      echo "40000 40001" >/proc/sys/net/ipv4/ip_local_port_range
      RANK=1 WORLD_SIZE=2 MASTER_PORT=40000 "$1" -b 8 -e 1K -f 4 -n 2 -w 1 -c 1 >/dev/null 2>&1 &
      sleep 2
      echo "40002 45000" >/proc/sys/net/ipv4/ip_local_port_range
      rc=0
      RANK=0 WORLD_SIZE=2 MASTER_PORT=40000 "$1" -b 8 -e 1K -f 4 -n 2 -w 1 -c 1 || rc=$?
      wait $! || rc=$?
      exit $rc' sh "$bin/all_reduce_perf" >"$log" 2>&1 || ! table_ok "$log"; then
    fail "rendezvous after a self-connected early connect()" "$log"
  fi
else
  echo "skipped the self-connect rendezvous test: needs root and unshare"
fi

echo "failure paths"
if [ ! -e /dev/nvidia0 ]; then
  expect_fail "--memory device without a GPU" 5 "not supported: --memory device" "$bin/all_reduce_perf" --memory device
fi
expect_fail "-G 1" 5 "not supported: -G" "$bin/all_reduce_perf" -G 1
expect_fail "mpi_perf -d half" 5 "not supported: -d half" "${MPIRUN[@]}" -np 2 "$bin/mpi_perf" all_reduce -d half
expect_fail "a corrupted result is caught" 7 "Out of bounds values : [1-9].* FAILED" \
  env COMM_BENCH_DEBUG_CORRUPT=2 "$bin/reduce_scatter_perf" -t 3 -c 1 -n 1 -b 1K -e 4K -f 4
if table_ok "$work/log.$((runs - 1))" >/dev/null; then fail "table_ok missed a corrupted result"; fi
# Every process of the job exits with the failure, not only process 0 (process 1 is the one
# that finds the wrong element here).
port=$(free_port)
for r in 0 1; do
  COMM_BENCH_DEBUG_CORRUPT=1 RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout "$limit" "$bin/all_reduce_perf" -b 8 -e 1K -f 4 -n 1 -c 1 >"$work/corrupt.$r" 2>&1 &
  cpids[r]=$!
done
for r in 0 1; do
  rc=0
  wait "${cpids[r]}" || rc=$?
  [ "$rc" = 7 ] || fail "process $r of a job with a wrong result exits 7 (exit $rc)" "$work/corrupt.$r"
done
runs=$((runs + 1))
expect_fail "-r -2" 1 "invalid -r -2" "$bin/broadcast_perf" -r -2 -b 8 -e 8
expect_fail "a size past 2^62" 1 "invalid size specified for 'maxbytes'" "$bin/all_reduce_perf" -e 99999999999999999999
expect_fail "MASTER_PORT that is not a port" 1 "MASTER_PORT=abc is not a TCP port" \
  env RANK=1 WORLD_SIZE=2 MASTER_PORT=abc "$bin/all_reduce_perf" -b 8 -e 8
expect_fail "-T on a stalled rank, on a line of its own" 4 "^[^ ]*: Test timeout (2s)" \
  env COMM_BENCH_DEBUG_STALL=1 "$bin/all_reduce_perf" -t 2 -T 2 -b 1K -e 1K

# Processes started for different job sizes: process 0 names the mismatch (it used to say only
# that it ignored "a connection that is not a new process of this job").
port=$(free_port)
COMM_BENCH_BOOTSTRAP_TIMEOUT=3 RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
  timeout "$limit" "$bin/all_reduce_perf" -b 8 -e 8 >"$work/ws.0" 2>&1 &
p0=$!
COMM_BENCH_BOOTSTRAP_TIMEOUT=3 RANK=1 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
  timeout "$limit" "$bin/all_reduce_perf" -b 8 -e 8 >"$work/ws.1" 2>&1 || true
wait "$p0" || true
runs=$((runs + 1))
if ! grep -q "every process needs the same WORLD_SIZE" "$work/ws.0"; then
  fail "WORLD_SIZE differing between processes is named" "$work/ws.0" "$work/ws.1"
fi

echo "compiling against NVIDIA's nccl.h"
mkdir -p "$work/nvidia/include"
cp "$COMM_TEST_NVIDIA_NCCL_INCLUDE/nccl.h" "$work/nvidia/include/"
if ! { cmake -S bench -B "$work/nv" -DCOMM_BENCH_NCCL_HOME="$work/nvidia" \
         -DCOMM_BENCH_CUDA_INCLUDE="$COMM_TEST_CUDA_INCLUDE" -DCMAKE_C_FLAGS=-Werror &&
       cmake --build "$work/nv" -j2; } >"$work/nv.log" 2>&1; then
  fail "build against NVIDIA's nccl.h" "$work/nv.log"
fi

echo "$runs runs in $(($(date +%s) - start)) s"
if ((${#failures[@]})); then
  printf 'failed: %s\n' "${failures[@]}" >&2
  exit 1
fi
echo "bench tests passed"
