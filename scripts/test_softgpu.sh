#!/usr/bin/env bash
# The device path on the software GPU (softgpu/, a CPU stand-in for the CUDA driver): the unit
# tests that need a device, comm-gpu-suite in ordinary and adversarial mode and on two virtual
# GPUs, softgpu's CUDA runtime and an application written against NVIDIA's nccl.h
# (scripts/test_cuda_example.sh), and every benchmark on device memory. Needs a release build
# made with nvcc (COMM_REQUIRE_NVCC=1), as scripts/test.sh makes; builds one if missing.
# COMM_SOFTGPU_SUITE_ARGS replaces the suite's arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
export COMM_REQUIRE_NVCC=1
[ -x target/release/comm-gpu-suite ] || cargo build --release
cargo test --release --lib --no-run
cargo test --release --test ib --no-run
scripts/softgpu.sh --build >/dev/null

args=${COMM_SOFTGPU_SUITE_ARGS:---ranks 1,2,4 --max-mib 4 --quick}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run() {
  local what=$1
  shift
  echo "== softgpu: $what"
  local t0=$SECONDS
  # SOFTGPU_LOG_DIR keeps the workers' diagnostics (watchdog) for a failure report.
  # shellcheck disable=SC2086
  if ! env SOFTGPU_LOG_DIR="$logs" "$@"; then
    echo "FAILED: $what"
    for f in "$logs"/*.log; do [ -s "$f" ] && { echo "-- $f"; tail -20 "$f"; }; done
    exit 1
  fi
  echo "   ($((SECONDS - t0)) s)"
}

# Copies that CUDA lets land late: the unit test fails unless the library waits for them.
run "device unit tests, adversarial" SOFTGPU_ADVERSARIAL=1 \
  scripts/softgpu.sh cargo test --release --lib -- cuda:: --test-threads=1
# shellcheck disable=SC2086
run "comm-gpu-suite $args" SOFTGPU_LEAKS=1 scripts/softgpu.sh target/release/comm-gpu-suite $args
# Every process gave back all device memory (SOFTGPU_LEAKS reports it at exit).
no_leak="at exit: 0 mappings (0 bytes) and 0 VMM handles still held$"
if grep -hs "at exit:" "$logs"/*.log | grep -v "$no_leak"; then
  echo "FAILED: device memory still allocated at exit (above)"
  grep -h "leak:" "$logs"/*.log | head -20
  exit 1
fi
if ! grep -qs "at exit:" "$logs"/*.log; then
  echo "FAILED: no process reported its device memory at exit (SOFTGPU_LEAKS)"
  exit 1
fi
rm -f "$logs"/*.log
# Failures on request (SOFTGPU_FAIL's API): allocations and IPC opens that fail make the calls
# that needed them fail naming the driver call, take nothing with them, and the next
# communicator works.
run "comm-gpu-suite --faults (failed allocations and IPC opens)" SOFTGPU_LEAKS=1 \
  scripts/softgpu.sh target/release/comm-gpu-suite --faults --ranks 2
if grep -hs "at exit:" "$logs"/*.log | grep -v "$no_leak"; then
  echo "FAILED: a failed allocation or IPC open left device memory held (above)"
  grep -h "leak:" "$logs"/*.log | head -20
  exit 1
fi
rm -f "$logs"/*.log
# shellcheck disable=SC2086
run "comm-gpu-suite $args, adversarial" SOFTGPU_ADVERSARIAL=1 \
  scripts/softgpu.sh target/release/comm-gpu-suite $args
# Streams sharing CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8, CUDA's default): thread
# ranks sharing one GPU must still progress.
run "comm-gpu-suite --ranks 1 with shared hardware queues (thread ranks on one GPU)" \
  SOFTGPU_HW_QUEUES=1 scripts/softgpu.sh target/release/comm-gpu-suite --ranks 1 --max-mib 4 --quick
# GPUDirect RDMA on device memory: inner ranges exported as dmabufs, registered with the verbs
# model at their offsets.
run "dmabuf registration of device memory through the verbs model" \
  scripts/softgpu.sh cargo test --release --test ib -- software_gpu --test-threads=1
# shellcheck disable=SC2086
run "comm-gpu-suite --ranks 2 --quick on 2 virtual GPUs (thread ranks across GPUs: peer access)" SOFTGPU_DEVICES=2 \
  scripts/softgpu.sh target/release/comm-gpu-suite --ranks 2 --max-mib 4 --quick
# The stand-in and the CPU kernels under AddressSanitizer and UndefinedBehaviorSanitizer: a
# separate build, loaded into the (uninstrumented) suite with libasan preloaded, as ASan must
# come first among the libraries of a process. One quick rank configuration.
asan=$(${CXX:-g++} -print-file-name=libasan.so)
if [ -f "$asan" ]; then
  COMM_SOFTGPU_DIR=target/softgpu-asan \
    SOFTGPU_CXXFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
    scripts/softgpu.sh --build >/dev/null
  # detect_leaks=0: the suite is not instrumented, and its allocations are not ours to judge
  # (SOFTGPU_LEAKS checks device memory). halt_on_error: a report fails the run.
  run "comm-gpu-suite --ranks 2 under ASan and UBSan (the stand-in and its CPU kernels)" \
    COMM_SOFTGPU_DIR=target/softgpu-asan LD_PRELOAD="$asan" \
    ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$logs/asan" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan" \
    scripts/softgpu.sh target/release/comm-gpu-suite --ranks 2 --max-mib 1 --quick
  if cat "$logs"/asan.* "$logs"/ubsan.* 2>/dev/null | grep -E "ERROR: AddressSanitizer|runtime error:"; then
    echo "FAILED: a sanitizer reported an error (above)"
    exit 1
  fi
else
  echo "== softgpu: no libasan for ${CXX:-g++}: the sanitizer run is skipped"
fi

# NVIDIA's nccl.h and the driver API in an application of their own, and the CUDA runtime.
run "tests/cuda: cudart checks and the nccl.h example (2 and 3 processes)" scripts/test_cuda_example.sh

# Every benchmark on device memory through softgpu's libcudart, one GPU per thread as nccl-tests
# wants, results checked (-c 1): small sweeps, each under a timeout.
bench=target/softgpu-bench
colls=(all_reduce all_gather reduce_scatter alltoall alltoallv broadcast reduce gather scatter sendrecv)
echo "== softgpu: building the benchmarks ($bench)"
if ! { cmake -S . -B "$bench" -DCMAKE_BUILD_TYPE=Release -DCOMM_CARGO_TARGET_DIR="$PWD/target" &&
       cmake --build "$bench" -j2 --target "${colls[@]/%/_perf}"; } >"$logs/bench-build.txt" 2>&1; then
  tail -30 "$logs/bench-build.txt"
  echo "FAILED: building the benchmarks"
  exit 1
fi
# bench_ok LOG: the table has rows, every #wrong column is 0 (the in-place one may be N/A, where
# a collective has no in-place form to check), and the footer says OK.
bench_ok() {
  awk '
    /^#/ && /#wrong/ { n = 0; for (i = 2; i <= NF; i++) if ($i == "#wrong") col[++n] = i - 1; next }
    /^#/ { next }
    $1 ~ /^[0-9]+$/ && n > 0 { rows++; for (k = 1; k <= n; k++) if ($(col[k]) != "0" && !(k > 1 && $(col[k]) == "N/A")) bad = 1 }
    END { exit (bad || rows == 0) }' "$1" && grep -q "^# Out of bounds values : 0 OK" "$1"
}
bench_run() {
  local log=$logs/bench.txt
  if ! SOFTGPU_DEVICES=4 timeout 120 scripts/softgpu.sh "$@" >"$log" 2>&1 || ! bench_ok "$log"; then
    echo "FAILED: $*"
    tail -20 "$log"
    exit 1
  fi
}
t0=$SECONDS
for coll in "${colls[@]}"; do
  for t in 2 4; do
    bench_run "$bench/bench/${coll}_perf" --memory device -t "$t" -b 8 -e 1M -f 32 -c 1 -n 1 -w 1
  done
done
# Every datatype and op; registered buffers. With copies that land late: the inputs must have
# landed before the non-blocking streams start (-t 2 -g 2, aggregated); each thread on the legacy
# stream of its own GPU (-t 4 -y 1: the threads must make their GPU current); one thread driving
# four GPUs' legacy streams in one group (-t 1 -g 4 -y 1).
bench_run "$bench/bench/all_reduce_perf" --memory device -t 2 -b 8 -e 64K -f 64 -c 1 -n 1 -w 1 -d all -o all
bench_run "$bench/bench/reduce_scatter_perf" --memory device -t 4 -b 8 -e 4M -f 16 -c 1 -n 1 -w 1 -R 1
SOFTGPU_ADVERSARIAL=1 bench_run "$bench/bench/sendrecv_perf" --memory device -t 2 -g 2 -b 8 -e 1M -f 32 -c 1 -n 2 -w 1 -m 2
SOFTGPU_ADVERSARIAL=1 bench_run "$bench/bench/all_reduce_perf" --memory device -t 4 -b 8 -e 1M -f 32 -c 1 -n 1 -w 1 -y 1
SOFTGPU_ADVERSARIAL=1 bench_run "$bench/bench/all_reduce_perf" --memory device -t 1 -g 4 -b 8 -e 1M -f 32 -c 1 -n 1 -w 1 -y 1
# On the stand-in, a "# softgpu:" line under each row gives the work one timed call gave the GPU
# per rank (softgpu_counters), and the JSON output the same: all_reduce on two thread ranks gives
# every call at least one stream memory operation, and a handful at most (the counts are divided
# by the 10 iterations and the 2 ranks).
bench_run "$bench/bench/all_reduce_perf" --memory device -t 2 -b 8 -e 8K -f 32 -c 1 -n 10 -w 1 -J "$logs/counts.json"
if ! awk '
    /^# softgpu: size=/ {
      lines++
      for (i = 1; i <= NF; i++) {
        split($i, kv, "=")
        if (kv[1] == "memops") { halves++; if (kv[2] < 1 || kv[2] > 32) bad = 1 }
        if (kv[1] == "kernels" && kv[2] > 4) bad = 1
      }
    }
    $1 ~ /^[0-9]+$/ { rows++ }
    END { exit (bad || rows == 0 || lines != rows || halves != 2 * rows) }' "$logs/bench.txt" ||
   ! grep -q '"softgpu_per_call_per_rank"' "$logs/counts.json"; then
  echo "FAILED: the benchmark's per-call GPU work (# softgpu: lines, softgpu_per_call_per_rank) is missing or implausible"
  cat "$logs/bench.txt"
  exit 1
fi
grep "^# softgpu: size=8 " "$logs/bench.txt"
echo "   benchmarks on device memory: $((SECONDS - t0)) s"
echo "softgpu: all device runs passed"
