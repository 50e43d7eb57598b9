#!/usr/bin/env bash
# Builds and installs comm with CMake, then builds the example against the installed package
# twice (find_package and pkg-config) and runs it briefly.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake -S . -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCOMM_CARGO_TARGET_DIR="$PWD/target" >/dev/null
cmake --build "$work/build" -j2 >/dev/null
cmake --install "$work/build" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/include/nccl.h" && test -f "$work/prefix/lib/libcomm.so"
# An outside project finds the installed package.
cmake -S bench -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/consumer" >/dev/null
"$work/consumer/allreduce_example" 3 4096 2 | grep -q "wrong elements: 0 OK"
# And through pkg-config.
PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig" gcc -std=c99 bench/allreduce_example.c -o "$work/ex_pc" \
  $(PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig" pkg-config --cflags --libs comm)
"$work/ex_pc" 2 1000 2 | grep -q "wrong elements: 0 OK"
echo "package tests passed"
