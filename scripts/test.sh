#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what it needs, checks formatting and lints,
# builds libcomm.so, runs every Rust, C, packaging, benchmark and PyTorch test.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
# The kernels must build: a missing nvcc fails the build instead of leaving it host-only.
export COMM_REQUIRE_NVCC=1

cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
# No import cycle between the top-level modules of src/ (the layering ARCHITECTURE.md draws).
python3 scripts/module_cycles.py
cargo build --release
cargo test --release -- --test-threads="${COMM_TEST_THREADS:-2}"
scripts/test_softgpu.sh
scripts/test_package.sh
scripts/test_bench.sh
scripts/test_python.sh
echo "all tests passed"
