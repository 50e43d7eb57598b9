#!/usr/bin/env bash
# How init, split and the first all-reduces grow with the number of ranks (bench/scale.c).
#
#   scripts/scale_bench.sh [-n "2 8 32 128"] [-m "hosts shm"] [-r REPS] [-R ROOTS] [-c] [-t SECS]
#                          [-a "DRIVER ARGS"]
#
# Modes: `hosts` gives every rank its own COMM_HOSTID (every pair of ranks talks TCP over
# loopback, as across hosts); `shm` puts all ranks on one host (shared memory); `hosts:K` puts
# the ranks on K simulated hosts. ROOTS > 1 uses ncclCommInitRankScalable with that many roots
# (at most N). -c checks every collective once (small counts). Each run is under `timeout`
# (-t, default 600 s); a run that fails leaves no child behind (the driver kills its ranks, and
# they die with it). -a passes more arguments to bench/scale.c (-S: no split, an all-reduce-only
# job; -I: init and destroy only). The ranks inherit the environment (NCCL_RUNTIME_CONNECT, COMM_ALGO, ...). Prints one
# markdown row per (mode, N, repetition): median and max over the ranks; the raw lines go to
# $SCALE_OUT (default target/scale) for later study. With COMM_DEBUG=INFO COMM_DEBUG_SUBSYS=INIT
# each rank logs where its init's time went: `python3 scripts/scale_phases.py $SCALE_OUT/*.err`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
sizes="2 8 32 64 128"
modes="hosts shm"
reps=2
roots=1
check=""
limit=600
extra=""
while getopts "n:m:r:R:ct:a:" o; do
  case $o in
    n) sizes=$OPTARG ;;
    m) modes=$OPTARG ;;
    r) reps=$OPTARG ;;
    R) roots=$OPTARG ;;
    c) check=-c ;;
    t) limit=$OPTARG ;;
    a) extra=$OPTARG ;;
    *) sed -n '2,17p' "$0" >&2; exit 64 ;;
  esac
done

lib=${COMM_LIB_DIR:-$ROOT/target/release}
[ -f "$lib/libcomm.so" ] || { echo "no $lib/libcomm.so: cargo build --release first" >&2; exit 1; }
out=${SCALE_OUT:-$ROOT/target/scale}
mkdir -p "$out"
bin=$out/scale
. "$ROOT/scripts/driver.sh"
build_driver "$ROOT/bench/scale.c" "$bin" "$lib"

# A job of 1024 ranks needs more than the usual limits: raise what we may, say what we cannot.
max=$(printf '%s\n' $sizes | sort -n | tail -1)
raise_fd_limit "$max"
ulimit -u unlimited 2>/dev/null || true
pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 0)
threads_max=$(cat /proc/sys/kernel/threads-max 2>/dev/null || echo 0)
if [ "$pid_max" -lt $((max * 16)) ] || [ "$threads_max" -lt $((max * 16)) ]; then
  echo "warning: pid_max $pid_max / threads-max $threads_max may be short for $max ranks" >&2
fi
read -r lo hi < /proc/sys/net/ipv4/ip_local_port_range || true
if [ -n "${hi:-}" ] && [ $((hi - lo)) -lt $((max * 4)) ]; then
  echo "warning: ephemeral ports $lo-$hi may be short for $max ranks" >&2
fi

echo "| mode | N | roots | init ms med/max | split ms med/max | 1st all-reduce ms med/max | 10th ms med/max | fds/rank med/max | threads/rank max | RSS MiB/rank max | connections | init CPU ms/rank med/max | job: init span ms, init CPU s | check |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for mode in $modes; do
  case $mode in
    hosts) hflag="" ;;
    shm) hflag="-H 1" ;;
    hosts:*) hflag="-H ${mode#hosts:}" ;;
    *) echo "unknown mode $mode" >&2; exit 64 ;;
  esac
  for n in $sizes; do
    r=$roots
    [ "$r" -gt "$n" ] && r=$n
    for rep in $(seq 1 "$reps"); do
      log=$out/$mode-n$n-r$r-$rep
      rc=0
      # shellcheck disable=SC2086
      timeout -k 10 "$limit" "$bin" -n "$n" -r "$r" $hflag $check $extra >"$log.out" 2>"$log.err" || rc=$?
      python3 "$ROOT/scripts/scale_row.py" "$log.out" "$mode" "$n" "$r" "$rc"
      [ "$rc" = 0 ] || tail -5 "$log.err" >&2
    done
  done
done
