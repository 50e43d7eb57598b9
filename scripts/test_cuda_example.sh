#!/usr/bin/env bash
# The example application of tests/cuda/ (written against NVIDIA's nccl.h and the CUDA driver
# API) and the runtime checks, on the software GPU: tests/cuda/cudart_check.c over softgpu's
# libcudart on one and two virtual GPUs, then nccl_driver_example.c as 2 and as 3 processes on
# one virtual GPU, as 2 processes on two, and as 3 again with CUDA's worst cases
# (SOFTGPU_ADVERSARIAL=1), linked against this tree's libnccl.so.2. Every
# process runs under `timeout` (COMM_EXAMPLE_TIMEOUT seconds, default 120). Called by
# scripts/test_softgpu.sh; needs a release build made with nvcc (COMM_REQUIRE_NVCC=1).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
[ -f target/release/libnccl.so ] || { echo "target/release/libnccl.so is missing: run COMM_REQUIRE_NVCC=1 cargo build --release" >&2; exit 1; }
sg=$(scripts/softgpu.sh --build)
limit=${COMM_EXAMPLE_TIMEOUT:-120}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cc=${CC:-gcc}
# NVIDIA's nccl.h includes the CUDA runtime's headers; the program itself calls only the driver
# and NCCL. libnccl.so.2 is this tree's library under NCCL's name.
ln -s "$PWD/target/release/libnccl.so" "$work/libnccl.so.2"
"$cc" -std=c11 -O1 -Wall -Wextra -Werror -I"$COMM_TEST_NVIDIA_NCCL_INCLUDE" -I"$COMM_TEST_CUDA_INCLUDE" \
  tests/cuda/nccl_driver_example.c -o "$work/nccl_driver_example" \
  "$work/libnccl.so.2" -L"$sg" -lcuda -Wl,-rpath,"$work"
"$cc" -std=c11 -O1 -Wall -Wextra -Werror -I"$COMM_TEST_CUDA_INCLUDE" tests/cuda/cudart_check.c \
  -o "$work/cudart_check" -L"$sg" -lcudart -lcuda -lpthread

for gpus in 1 2; do
  echo "== cudart_check on $gpus virtual GPU(s)"
  SOFTGPU_DEVICES=$gpus timeout "$limit" scripts/softgpu.sh "$work/cudart_check"
done

# run_example NRANKS GPUS: NRANKS processes; every one must exit 0 and say it passed.
run_example() {
  local n=$1 gpus=$2 pids=() failed=0
  echo "== nccl_driver_example: $n processes on $gpus virtual GPU(s)${SOFTGPU_ADVERSARIAL:+, adversarial}"
  rm -f "$work/id"
  for ((r = 0; r < n; r++)); do
    SOFTGPU_DEVICES=$gpus timeout "$limit" scripts/softgpu.sh "$work/nccl_driver_example" "$r" "$n" \
      "$work/id" >"$work/out.$r" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < n; r++)); do
    if ! wait "${pids[$r]}" || ! grep -q "rank $r of $n: every check passed" "$work/out.$r"; then
      failed=1
      echo "-- rank $r:"
      tail -20 "$work/out.$r"
    fi
  done
  if [ "$failed" = 1 ]; then
    echo "FAILED: nccl_driver_example, $n processes on $gpus GPU(s)"
    exit 1
  fi
  grep -h "right" "$work/out.0"
}
run_example 2 1
run_example 3 1
run_example 2 2
SOFTGPU_ADVERSARIAL=1 run_example 3 1
echo "cuda example: all runs passed"
