#!/usr/bin/env bash
# Builds everything the GPU machine needs (it has CUDA and PyTorch but no Rust toolchain) into
# target/gpu-artifacts: libcomm.so with its kernels, the comm-gpu-suite binary, the benchmark
# binaries, and run.sh. Carry that directory to the GPU machine and run it there:
#     target/gpu-artifacts/run.sh            # exit 0 pass, 1 failure, 77 no GPU
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
export COMM_REQUIRE_NVCC=1
cargo build --release
out=target/gpu-artifacts
rm -rf "$out" && mkdir -p "$out/bench"
cmake -S . -B target/gpu-build -DCMAKE_BUILD_TYPE=Release -DCOMM_CARGO_TARGET_DIR="$PWD/target" >/dev/null
cmake --build target/gpu-build -j2 >/dev/null
cp target/release/libcomm.so target/release/comm-gpu-suite "$out/"
find target/gpu-build/bench -maxdepth 1 -type f -name '*_perf' -perm -u+x -exec cp {} "$out/bench/" \;
cp scripts/gpu_run.sh "$out/run.sh"
echo "GPU artifacts in $out ($(du -sh "$out" | cut -f1))"
