#!/usr/bin/env bash
# The device path on the software GPU (softgpu/, a CPU stand-in for the CUDA driver): the unit
# tests that need a device, and comm-gpu-suite, in ordinary and adversarial mode and on two
# virtual GPUs. Needs a release build made with nvcc (COMM_REQUIRE_NVCC=1), as scripts/test.sh
# makes; builds one if missing. COMM_SOFTGPU_SUITE_ARGS replaces the suite's arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
export COMM_REQUIRE_NVCC=1
[ -x target/release/comm-gpu-suite ] || cargo build --release
cargo test --release --lib --no-run
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
if grep -hs "at exit:" "$logs"/*.log | grep -v "at exit: 0 mappings (0 bytes) and 0 VMM"; then
  echo "FAILED: device memory still allocated at exit (above)"
  grep -h "leak:" "$logs"/*.log | head -20
  exit 1
fi
if ! grep -qs "at exit:" "$logs"/*.log; then
  echo "FAILED: no process reported its device memory at exit (SOFTGPU_LEAKS)"
  exit 1
fi
rm -f "$logs"/*.log
# shellcheck disable=SC2086
run "comm-gpu-suite $args, adversarial" SOFTGPU_ADVERSARIAL=1 \
  scripts/softgpu.sh target/release/comm-gpu-suite $args
# shellcheck disable=SC2086
run "comm-gpu-suite --ranks 2 --quick on 2 virtual GPUs (thread ranks across GPUs: peer access)" SOFTGPU_DEVICES=2 \
  scripts/softgpu.sh target/release/comm-gpu-suite --ranks 2 --max-mib 4 --quick
echo "softgpu: all device runs passed"
