#!/usr/bin/env bash
# ncclGroupSimulateEnd's predictions against measured times (bench/cost_model.c), and the
# tuner's picks for large synthetic layouts (examples/cost_model.rs).
#
#   scripts/cost_model_check.sh [-n "2 8 32 128"] [-m "shm hosts hosts:4"] [-s SIZES] [-l N]
#                               [-c COLLS] [-R ROUNDS] [-r REPS] [-t SECS] [-S]
#
# Modes as scripts/scale_bench.sh's: `shm` all ranks on one host (shared memory), `hosts` every
# rank its own simulated host (TCP over loopback), `hosts:K` K simulated hosts of N/K ranks.
# Sizes (bytes, nccl-tests' convention) default to 8 B, 64 KiB and 4 MiB, plus 64 MiB where
# N <= -l (default 8). Every configuration runs once per round, the configurations in turn,
# ROUNDS times (-R, default 3), so that the machine's load falls on all of them alike; a cell's
# measured time is the median over rounds of each round's median of REPS timed rounds (-r).
# Before each run, `nproc` busy probes measure the share of a core they get (other work on the
# machine takes the rest).
#
# Prints one markdown row per cell: the tuner's pick, ncclGroupSimulateEnd's prediction (the
# library's view: each simulated host has this machine's cores), the model told that all N
# processes share this machine's cores, and the same with only the cores the probes found free;
# the measured time; the ratios. Then the error: median and worst |ln(measured / predicted)|
# per mode, for each of the three predictions.
# With -S, only the synthetic tables (1024 and 8192 ranks on two-level topologies) are printed.
# Raw lines go to $COST_OUT (default target/cost_model).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ns="2 8 32 128"
modes="shm hosts hosts:4"
sizes="8 65536 4194304"
large_upto=8
colls="allreduce allgather reducescatter"
rounds=3
reps=5
limit=900
synthetic_only=""
while getopts "n:m:s:l:c:R:r:t:Sh" o; do
  case $o in
    n) ns=$OPTARG ;;
    m) modes=$OPTARG ;;
    s) sizes=$OPTARG ;;
    l) large_upto=$OPTARG ;;
    c) colls=$OPTARG ;;
    R) rounds=$OPTARG ;;
    r) reps=$OPTARG ;;
    t) limit=$OPTARG ;;
    S) synthetic_only=1 ;;
    h) sed -n '2,23p' "$0"; exit 0 ;;
    *) sed -n '2,23p' "$0" >&2; exit 64 ;;
  esac
done

if [ -n "$synthetic_only" ]; then
  exec cargo run --release --quiet --example cost_model -- synthetic
fi

lib=${COMM_LIB_DIR:-$ROOT/target/release}
[ -f "$lib/libcomm.so" ] || { echo "no $lib/libcomm.so: cargo build --release first" >&2; exit 1; }
out=${COST_OUT:-$ROOT/target/cost_model}
mkdir -p "$out"
bin=$out/cost_model
. "$ROOT/scripts/driver.sh"
build_driver "$ROOT/bench/cost_model.c" "$bin" "$lib"
raise_fd_limit "$(printf '%s\n' $ns | sort -n | tail -1)"

# Simulated hosts share this machine's cores, but each rank believes its host is its own and
# spins as long as a network round trip before sleeping (COMM_SPIN_US's default with network
# peers), which starves the rank it waits for. With more processes than cores, tell every rank
# what the library does on its own for an oversubscribed host (no spin, yield, then sleep), so
# the times measure the transports and the schedule, not that misunderstanding; COMM_SPIN_US or
# COMM_YIELD_US set by the caller win.
spin_env() {
  if [ "$1" -gt "$(nproc)" ]; then
    echo "COMM_SPIN_US=${COMM_SPIN_US:-0} COMM_YIELD_US=${COMM_YIELD_US:-200}"
  fi
}

# The share of a core each of nproc busy processes gets over 0.3 s.
probe() {
  python3 - "$(nproc)" <<'PY'
import multiprocessing as mp, sys, time
def spin(q):
    t0, c0 = time.monotonic(), time.process_time()
    while time.monotonic() - t0 < 0.3:
        pass
    q.put((time.process_time() - c0) / (time.monotonic() - t0))
k = int(sys.argv[1])
q = mp.Queue()
ps = [mp.Process(target=spin, args=(q,)) for _ in range(k)]
for p in ps: p.start()
shares = [q.get() for _ in ps]
for p in ps: p.join()
print(f"{min(1.0, sum(shares) / k):.3f}")
PY
}

raw=$out/cells.txt
: >"$raw"
for round in $(seq 1 "$rounds"); do
  for mode in $modes; do
    case $mode in
      hosts) hflag="" ;;
      shm) hflag="-H 1" ;;
      hosts:*) hflag="-H ${mode#hosts:}" ;;
      *) echo "unknown mode $mode" >&2; exit 64 ;;
    esac
    for n in $ns; do
      case $mode in hosts:*) [ "${mode#hosts:}" -le "$n" ] || continue ;; esac
      s=$sizes
      [ "$n" -le "$large_upto" ] && s="$s 67108864"
      log=$out/$mode-n$n-$round
      share=$(probe)
      echo "round $round: $mode N=$n (load $(cut -d' ' -f1 /proc/loadavg), probe share $share)" >&2
      rc=0
      # shellcheck disable=SC2086
      env $(spin_env "$n") timeout -k 10 "$limit" "$bin" -n "$n" $hflag -s "$s" -c "$colls" -r "$reps" \
        >"$log.out" 2>"$log.err" || rc=$?
      if [ "$rc" != 0 ]; then
        echo "  failed (rc $rc):" >&2
        tail -3 "$log.err" >&2
      fi
      sed "s/^cell /cell mode=$mode round=$round load=$(cut -d' ' -f1 /proc/loadavg) share=$share /" \
        "$log.out" >>"$raw"
    done
  done
done

# The tuner's pick and the model's other views of each cell, from examples/cost_model.rs.
picks=$out/picks.txt
cargo run --release --quiet --example cost_model -- cells "$raw" >"$picks" 2>"$out/picks.err" || {
  echo "the cost model example failed; its columns are left out" >&2
  cat "$out/picks.err" >&2
  : >"$picks"
}

python3 - "$raw" "$picks" <<'PY'
import collections, math, statistics, sys
raw, picks = sys.argv[1], sys.argv[2]
meas = collections.defaultdict(list)
pred, loads, shares = {}, [], []
for line in open(raw):
    if not line.startswith("cell "):
        continue
    kv = dict(w.split("=", 1) for w in line.split()[1:])
    key = (kv["mode"], int(kv["n"]), kv["coll"], int(kv["bytes"]))
    meas[key].append(float(kv["meas_us"]))
    pred[key] = float(kv["pred_us"])
    loads.append(float(kv["load"]))
    shares.append(float(kv.get("share", 1)))
algo, shared, loaded = {}, {}, collections.defaultdict(list)
for line in open(picks):
    w = line.split()
    if len(w) == 9 and w[0] == "pick":
        key = (w[1], int(w[2]), w[3], int(w[4]))
        algo[key], shared[key] = w[5], float(w[7])
        loaded[key].append(float(w[8]))
def size(b):
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f and b % f == 0:
            return f"{b // f} {unit}"
    return f"{b} B"
def us(x):
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"
print("| mode | N | collective | size | algorithm | predicted us: ncclGroupSimulateEnd / N on the cores / on the free cores | measured us, median (rounds) | measured / each prediction |")
print("|---|---|---|---|---|---|---|---|")
err = collections.defaultdict(lambda: ([], [], []))
order = {"shm": 0, "hosts": 1}
for key in sorted(meas, key=lambda k: (order.get(k[0], 2), k[0], k[1], k[2], k[3])):
    mode, n, coll, b = key
    m = statistics.median(meas[key])
    ps = [pred[key], shared.get(key, float("nan")), statistics.median(loaded[key]) if loaded[key] else float("nan")]
    ratios = [m / p if p > 0 else float("nan") for p in ps]
    for i, r in enumerate(ratios):
        if r > 0 and not math.isnan(r):
            for name in ("all", mode):
                err[name][i].append((abs(math.log(r)), key, r))
    runs = ", ".join(us(x) for x in meas[key])
    print(f"| {mode} | {n} | {coll} | {size(b)} | {algo.get(key, '?')} | "
          f"{' / '.join(us(p) for p in ps)} | {us(m)} ({runs}) | {' / '.join(f'{r:.2f}' for r in ratios)} |")
print()
if loads:
    print(f"load average during the runs: median {statistics.median(loads):.1f}, range {min(loads):.1f}-{max(loads):.1f}; "
          f"probe share of a core: median {statistics.median(shares):.2f}, range {min(shares):.2f}-{max(shares):.2f}")
print()
print("| cells | prediction | count | median abs(ln ratio) (factor) | worst abs(ln ratio) (factor), cell |")
print("|---|---|---|---|---|")
views = ["ncclGroupSimulateEnd", "N on the cores", "on the free cores"]
for name in ["all"] + sorted(k for k in err if k != "all"):
    for i, view in enumerate(views):
        v = sorted(err[name][i])
        if not v:
            continue
        med = statistics.median(e for e, _, _ in v)
        e, k, r = v[-1]
        print(f"| {name} | {view} | {len(v)} | {med:.2f} (x{math.exp(med):.2f}) | {e:.2f} (x{math.exp(e):.1f}), "
              f"{k[0]} N={k[1]} {k[2]} {size(k[3])}: measured/predicted {r:.2f} |")
PY
