#!/usr/bin/env bash
# The scale benchmark (bench/scale.c) on a few real simulated hosts: K network namespaces made
# by scripts/netns.sh (each with its own network, PID, IPC and mount namespace), the N ranks
# spread over them in blocks, so that ranks of one namespace share memory and reach the others
# only over the bridge, as on K machines. Needs root.
#
#   scripts/scale_netns.sh [-n "8 32 128"] [-k HOSTS] [-r REPS] [-c] [-t SECS]
#
# Rank 0's namespace runs the bootstrap root (NCCL_COMM_ID=<its address>:<port>, with a random
# COMM_SECRET); every namespace starts its block with `scale -b BASE:COUNT`. Prints the same
# markdown rows as scripts/scale_bench.sh (mode `netns:K`); raw lines go to $SCALE_OUT (default
# target/scale). The namespaces are removed on exit, failed or not.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
sizes="8 32 128"
hosts=4
reps=1
check=""
limit=600
while getopts "n:k:r:ct:" o; do
  case $o in
    n) sizes=$OPTARG ;;
    k) hosts=$OPTARG ;;
    r) reps=$OPTARG ;;
    c) check=-c ;;
    t) limit=$OPTARG ;;
    *) sed -n '2,12p' "$0" >&2; exit 64 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "scale_netns.sh: needs root (network namespaces)" >&2; exit 1; }

lib=${COMM_LIB_DIR:-$ROOT/target/release}
[ -f "$lib/libcomm.so" ] || { echo "no $lib/libcomm.so: cargo build --release first" >&2; exit 1; }
out=${SCALE_OUT:-$ROOT/target/scale}
mkdir -p "$out"
bin=$out/scale
. "$ROOT/scripts/driver.sh"
build_driver "$ROOT/bench/scale.c" "$bin" "$lib"
raise_fd_limit "$(printf '%s\n' $sizes | sort -n | tail -1)"

netns=$ROOT/scripts/netns.sh
prefix=csn$$
cleanup() { "$netns" down "$prefix" >/dev/null 2>&1 || true; }
trap cleanup EXIT INT TERM
"$netns" up "$prefix" "$hosts"
root_addr=$("$netns" addr "$prefix" 0)

echo "| mode | N | roots | init ms med/max | split ms med/max | 1st all-reduce ms med/max | 10th ms med/max | fds/rank med/max | threads/rank max | RSS MiB/rank max | connections | init CPU ms/rank med/max | job: init span ms, init CPU s | check |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
mode=netns:$hosts
for n in $sizes; do
  [ "$n" -ge "$hosts" ] || { echo "skipping N=$n: fewer ranks than hosts" >&2; continue; }
  for rep in $(seq 1 "$reps"); do
    log=$out/$mode-n$n-$rep
    port=$((20000 + RANDOM % 20000))
    secret=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
    pids=()
    for ((h = 0; h < hosts; h++)); do
      base=$((h * n / hosts))
      count=$(((h + 1) * n / hosts - base))
      # shellcheck disable=SC2086
      NCCL_COMM_ID=$root_addr:$port COMM_SECRET=$secret \
        timeout -k 10 "$limit" "$netns" exec "$prefix" "$h" "$bin" -n "$n" -b "$base:$count" \
        $check >"$log.h$h.out" 2>"$log.h$h.err" &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do
      wait "$p" || rc=$?
    done
    cat "$log".h*.out >"$log.out"
    python3 "$ROOT/scripts/scale_row.py" "$log.out" "$mode" "$n" 1 "$rc"
    [ "$rc" = 0 ] || tail -n 5 "$log".h*.err >&2
  done
done
