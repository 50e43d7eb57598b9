#!/usr/bin/env bash
# Installs what building and testing comm needs on a fresh machine (idempotent; sourced by the
# other scripts). Exports COMM_DEPS (a cache directory), NVCC, COMM_TEST_CUDA_INCLUDE and
# COMM_TEST_NVIDIA_NCCL_INCLUDE.
set -euo pipefail
COMM_ROOT=${COMM_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export COMM_DEPS=${COMM_DEPS:-$COMM_ROOT/.deps}
mkdir -p "$COMM_DEPS"

apt_missing=()
# ip, tc, nsenter, unshare and pgrep run the multi-host tests (network namespaces).
for tool in cmake:cmake gcc:gcc g++:g++ nm:binutils pkg-config:pkg-config mpirun:openmpi-bin \
  ip:iproute2 tc:iproute2 nsenter:util-linux unshare:util-linux pgrep:procps; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || apt_missing+=("${tool##*:}")
done
# MPI's headers and libraries, for the benchmarks' _mpi variants and mpi_perf.
# MPICH beside it (bench/compare_mpi.sh measures both); OpenMPI stays the default `mpi`.
for pkg in libopenmpi-dev mpich libmpich-dev; do
  if command -v dpkg >/dev/null 2>&1 && ! dpkg -s "$pkg" >/dev/null 2>&1; then
    apt_missing+=("$pkg")
  fi
done
# rdma-core without a device: the InfiniBand transport must load it, find nothing and fall
# back; its header lets a test check the verbs structure layouts the transport uses.
for pkg in libibverbs-dev ibverbs-providers; do
  if command -v dpkg >/dev/null 2>&1 && ! dpkg -s "$pkg" >/dev/null 2>&1; then
    apt_missing+=("$pkg")
  fi
done
if ((${#apt_missing[@]})); then
  echo "installing ${apt_missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${apt_missing[@]}" >/dev/null
fi
# mpicc and mpirun mean OpenMPI, whichever MPI was installed last.
for alt in mpi:mpicc mpirun:mpirun; do
  target=/usr/bin/${alt##*:}.openmpi
  if [ -x "$target" ] && [ "$(readlink -f "/usr/bin/${alt##*:}")" != "$(readlink -f "$target")" ]; then
    update-alternatives --quiet --set "${alt%%:*}" "$target"
  fi
done

# A Python environment of the project's own, with CUDA 13.0's toolkit (nvcc and headers).
VENV=$COMM_DEPS/venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -f "$SITE/nvidia/cu13/include/cuda_runtime.h" ]; then
  "$VENV/bin/pip" install -q "cuda-toolkit[nvcc,cccl,cudart]==13.0.*"
fi
export COMM_TEST_CUDA_INCLUDE=$SITE/nvidia/cu13/include
# build.rs compiles kernels/*.cu with this nvcc.
export NVCC=$SITE/nvidia/cu13/bin/nvcc
# matplotlib, for bench/plot.py.
if ! "$VENV/bin/python" -c 'import matplotlib' >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q matplotlib
fi

# NVIDIA's own nccl.h (API level 2.30.7), to compare ABIs and to build programs against it.
NCCL_H=$COMM_DEPS/nvidia-nccl-2.30.7/include
if [ ! -f "$NCCL_H/nccl.h" ]; then
  tmp=$(mktemp -d)
  "$VENV/bin/pip" download -q --no-deps --dest "$tmp" "nvidia-nccl-cu12==2.30.7"
  mkdir -p "$NCCL_H"
  "$VENV/bin/python" - "$tmp" "$NCCL_H" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    with open(sys.argv[2] + "/nccl.h", "wb") as f:
        f.write(z.read("nvidia/nccl/include/nccl.h"))
PY
  rm -rf "$tmp"
fi
export COMM_TEST_NVIDIA_NCCL_INCLUDE=$NCCL_H
