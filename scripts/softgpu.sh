#!/usr/bin/env bash
# shellcheck disable=SC2086,SC2206 # SOFTGPU_CXXFLAGS and SOFTGPU_LDFLAGS are split into words on purpose
# Runs a command on the software GPU: softgpu/ (a CPU stand-in for the CUDA driver) is built if
# needed, and its directory, holding libcuda.so and libcuda.so.1 as links to one library (and
# libcudart.so.13 / libcudart.so, its CUDA runtime), goes first on LD_LIBRARY_PATH, so that
# cudarc (and any program that opens libcuda or libcudart by name) finds it before a real
# driver. Only the command run here sees a GPU.
#
#   scripts/softgpu.sh CMD [ARGS...]       e.g. scripts/softgpu.sh target/release/comm-gpu-suite
#   scripts/softgpu.sh --build             only build; prints the library's directory
#
# The stand-in's own settings (SOFTGPU_DEVICES, SOFTGPU_SMS, SOFTGPU_TRACE, ...) are described in
# softgpu/README.md. COMM_SOFTGPU_DIR chooses where it is built (default target/softgpu).
set -euo pipefail
COMM_ROOT=${COMM_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
out=${COMM_SOFTGPU_DIR:-$COMM_ROOT/target/softgpu}
lib=$out/libsoftgpu.so

sources=("$COMM_ROOT"/softgpu/*.cpp "$COMM_ROOT"/softgpu/*.h "$COMM_ROOT"/kernels/*.cu "$COMM_ROOT"/kernels/*.cuh)
stale=0
if [ ! -f "$lib" ]; then
  stale=1
else
  for f in "${sources[@]}" "$COMM_ROOT/scripts/softgpu.sh"; do
    [ "$f" -nt "$lib" ] && stale=1 && break
  done
fi

if [ "$stale" = 1 ]; then
  # The CUDA headers (types and enums of the driver API, fp16/bf16 host code for the kernels)
  # come from the project's pip toolkit.
  if [ -z "${COMM_TEST_CUDA_INCLUDE:-}" ] || [ ! -f "$COMM_TEST_CUDA_INCLUDE/cuda.h" ]; then
    # shellcheck source=scripts/deps.sh
    source "$COMM_ROOT/scripts/deps.sh" >&2
  fi
  mkdir -p "$out"
  cxx=${CXX:-g++}
  # -ffp-contract=off: no fused multiply-add, so a scaled sum rounds as the host reducer's does.
  flags=(-std=c++17 -O2 -g -fPIC -Wall -Wextra -Werror -Wno-unknown-pragmas -Wno-format-zero-length
    -ffp-contract=off -fvisibility=hidden -I"$COMM_TEST_CUDA_INCLUDE" -I"$COMM_ROOT/kernels"
    ${SOFTGPU_CXXFLAGS:-})
  echo "softgpu: building $lib" >&2
  objs=()
  for src in "$COMM_ROOT"/softgpu/*.cpp; do
    obj=$out/$(basename "$src" .cpp).o
    "$cxx" "${flags[@]}" -c "$src" -o "$obj"
    objs+=("$obj")
  done
  # shellcheck disable=SC2086
  "$cxx" ${SOFTGPU_CXXFLAGS:-} -shared -Wl,-soname,libcuda.so.1 -o "$lib.tmp" "${objs[@]}" \
    -lpthread ${SOFTGPU_LDFLAGS:-}
  # The runtime (libcudart.so.13) is a library of its own over the driver above: it finds the
  # driver by its soname, so both share one set of devices, contexts, streams and memory.
  "$cxx" "${flags[@]}" -c "$COMM_ROOT/softgpu/runtime.cpp" -o "$out/runtime.o"
  "$cxx" -shared -Wl,-soname,libcudart.so.13 -o "$out/libsoftgpu_cudart.so.tmp" "$out/runtime.o" \
    "$lib.tmp" -Wl,-rpath,"\$ORIGIN" -lpthread ${SOFTGPU_LDFLAGS:-}
  mv "$out/libsoftgpu_cudart.so.tmp" "$out/libsoftgpu_cudart.so"
  mv "$lib.tmp" "$lib"
  ln -sf libsoftgpu.so "$out/libcuda.so"
  ln -sf libsoftgpu.so "$out/libcuda.so.1"
  ln -sf libsoftgpu_cudart.so "$out/libcudart.so.13"
  ln -sf libsoftgpu_cudart.so "$out/libcudart.so"
fi

if [ "${1:-}" = "--build" ]; then
  echo "$out"
  exit 0
fi
if [ $# -eq 0 ]; then
  echo "usage: scripts/softgpu.sh CMD [ARGS...] | --build" >&2
  exit 2
fi
export LD_LIBRARY_PATH="$out${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
