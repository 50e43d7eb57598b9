#!/usr/bin/env bash
# What comm's device path gives the GPU per collective, seen without a GPU: runs
# `comm-gpu-suite --cost` on the software GPU (softgpu/), which counts per rank and per call the
# kernel launches, stream memory operations (write/wait value), copies and their bytes, memsets,
# host functions and events of eager calls on device buffers, and prints a Markdown table with
# an ESTIMATE of what that costs on a real GPU (the per-operation costs below, with their
# sources in bench/RESULTS.md), beside NCCL's one kernel launch per collective.
#
#   scripts/softgpu_cost.sh [RANKS]        RANKS: comma-separated rank counts (default 2,4)
#
# Needs a release build made with nvcc (COMM_REQUIRE_NVCC=1 cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-2,4}
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
timeout 900 scripts/softgpu.sh target/release/comm-gpu-suite --cost --ranks "$ranks" >"$raw"
python3 - "$raw" <<'PY'
import sys
from collections import defaultdict

# Assumed cost of one operation on a real GPU, in microseconds (see bench/RESULTS.md).
KERNEL_US = 3.0   # a short kernel issued back to back on a stream
MEMOP_US = 1.0    # cuStreamWriteValue / a satisfied cuStreamWaitValue
COPY_US = 3.0     # a copy-engine copy's fixed latency
EVENT_US = 0.5    # an event record or stream-wait-event
MEMSET_US = 3.0   # a small memset
BYTES_PER_US = 400e3  # copy-engine bandwidth to a peer GPU over NVLink 4 (400 GB/s)

rows = defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    if not f or f[0] != "COST":
        continue
    coll, size, n = f[1], int(f[2]), int(f[3])
    rows[(coll, size, n)].append([float(x) for x in f[5:]])
if not rows:
    sys.exit("no COST lines: did comm-gpu-suite --cost run on the software GPU?")

def human(b):
    for unit in ["B", "KiB", "MiB", "GiB"]:
        if b < 1024:
            return f"{b:g} {unit}"
        b /= 1024
    return f"{b:g} TiB"

order = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll", "SendRecv"]
print("| collective | bytes/rank | ranks | kernels | write value | wait value | copies | copied/rank | memsets | host fns | events | est. fixed us | est. copy us | NCCL kernels |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for (coll, size, n) in sorted(rows, key=lambda k: (order.index(k[0]) if k[0] in order else 99, k[2], k[1])):
    per = rows[(coll, size, n)]
    m = [sum(r[i] for r in per) / len(per) for i in range(len(per[0]))]
    k, w, wt, c, cb, ms, hf, er, ew = m
    fixed = KERNEL_US * k + MEMOP_US * (w + wt) + COPY_US * c + EVENT_US * (er + ew) + MEMSET_US * ms
    move = cb / BYTES_PER_US
    print(f"| {coll} | {human(size)} | {n} | {k:g} | {w:g} | {wt:g} | {c:g} | {human(round(cb))} | {ms:g} | {hf:g} | {er + ew:g} | {fixed:.0f} | {move:.1f} | 1 |")
PY
