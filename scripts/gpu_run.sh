#!/usr/bin/env bash
# Runs the device-memory checks on a GPU machine from prebuilt artifacts (scripts/gpu_artifacts.sh
# copies this file into them as run.sh). Exit status: 0 every check passed, 1 a check failed,
# 77 there is no usable GPU (nothing was tested).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"

echo "== comm-gpu-suite (every collective x datatype x op on device memory)"
timeout 3600 "$here/comm-gpu-suite" ${COMM_GPU_SUITE_ARGS:-}
rc=$?
if [ $rc -eq 77 ]; then
  echo "no GPU: nothing was tested"
  exit 77
fi
[ $rc -eq 0 ] || status=1

echo "== benchmarks on device memory (correctness: -c 1)"
for b in "$here"/bench/*_perf; do
  [ -x "$b" ] || continue
  name=$(basename "$b")
  # MPI builds need mpirun and are not what this run checks.
  case "$name" in mpi_perf | *_mpi) continue ;; esac
  for layout in "-t 2" "-t 4"; do
    # shellcheck disable=SC2086
    if ! timeout 600 "$b" --memory device $layout -b 8 -e 64M -f 8 -n 2 -w 1 -c 1 >"/tmp/$name.log" 2>&1 \
        || grep -q "FAILED" "/tmp/$name.log"; then
      echo "FAIL $name $layout"; tail -20 "/tmp/$name.log"; status=1
    else
      echo "PASS $name $layout"
    fi
  done
done
echo "== result: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
