#!/usr/bin/env bash
# comm across simulated hosts, side by side with what the same link gives to others: iperf3
# (one stream, and both directions at once), OpenMPI over TCP (bench/mpi_perf) and torch's gloo
# (bench/hosts_gloo.py). Hosts are network namespaces made by scripts/netns.sh, removed when the
# script ends, however it ends. Every round runs each measurement once, in an order that is
# reversed every other round, so that a change in the machine's load falls on all of them;
# the tables give medians over the rounds, with the lowest and highest round.
#
#   scripts/bench_hosts.sh [options]
#     --hosts N          simulated hosts (2)
#     --per-host K       ranks per host (1); rank r runs on host r / K
#     --rate RATE        limit every host's outgoing link (tc tbf, e.g. 1gbit)
#     --rounds R         rounds (3)
#     --max SIZE         largest message (256M); sweeps: 8 B alone for latency (all_reduce),
#                        16 B to 1 MiB by 4 with 40 iterations, 4 MiB to SIZE by 4 with 5
#     --colls LIST       collectives, comma-separated (all_reduce,all_gather)
#     --env A=x[,B=y]    one more comm variant run with these variables (repeatable); comm's
#                        default is always run, and the variants alternate with it
#     --bin DIR          the benchmark binaries (build/bench; see bench/README.md)
#     --out DIR          where the JSON files, logs and tables go (a new temporary directory)
#     --no-mpi, --no-gloo, --no-iperf   leave one out
#     --timeout S        limit on each launch (600)
#     --report DIR       only print the tables again from the files of an earlier --out DIR
#
# How each runs: comm's plain <coll>_perf binaries, one process per rank joined to its host's
# namespaces, with torchrun-style RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (host 0) and
# MASTER_PORT, NCCL_SOCKET_IFNAME=eth0. OpenMPI: mpirun starts in the namespace of the hosts'
# switch (its bridge gets address .254) and reaches each host through an rsh agent that enters
# that host's namespaces instead of ssh; --mca btl tcp,self (tcp,vader,self with several ranks
# per host, MPI's own path inside a host as comm uses its own), TCP on eth0, and
# mpi_yield_when_idle 1: between namespaces a packet crosses two veth pairs and a bridge, work
# the kernel may leave to ksoftirqd, and a rank that polls without ever yielding keeps that
# thread off its core until the next scheduler tick; on the 2-core machine this made every
# MPI message take 4 ms (32 us with the yield). gloo: the same
# torchrun-style variables, GLOO_SOCKET_IFNAME=eth0, OMP_NUM_THREADS=1 (torchrun's default).
#
# Needs root, iproute2, util-linux, OpenMPI (mpirun) and iperf3 (installed with apt-get when
# missing), and torch in $COMM_TORCH_VENV (default $COMM_DEPS/torch-venv, installed with pip
# when missing, as scripts/test_python.sh does).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
netns=$root/scripts/netns.sh

hosts=2 per_host=1 rate="" rounds=3 max=256M colls=all_reduce,all_gather
bin=${COMM_BENCH_BIN:-$root/build/bench} out="" limit=600
do_mpi=1 do_gloo=1 do_iperf=1 report_only=0
variants=("")
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }
while (($#)); do
  case "$1" in
    --hosts) hosts=$2; shift 2 ;;
    --per-host) per_host=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --max) max=$2; shift 2 ;;
    --colls) colls=$2; shift 2 ;;
    --env) variants+=("$2"); shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --report) out=$2; report_only=1; shift 2 ;;
    --no-mpi) do_mpi=0; shift ;;
    --no-gloo) do_gloo=0; shift ;;
    --no-iperf) do_iperf=0; shift ;;
    -h | --help) usage 0 ;;
    *) echo "bench_hosts.sh: unknown argument $1" >&2; usage ;;
  esac
done
((hosts >= 2 && per_host >= 1 && rounds >= 1)) || { echo "bench_hosts.sh: need --hosts >= 2, --per-host >= 1, --rounds >= 1" >&2; exit 2; }
nranks=$((hosts * per_host))
# A variant that loads another library through LD_LIBRARY_PATH must hold it as libnccl.so.2,
# the name the binaries link: otherwise the loader finds the build's own through RUNPATH and
# the variant runs the same library as the default.
for v in "${variants[@]}"; do
  IFS=, read -r -a kv <<<"$v"
  for e in "${kv[@]}"; do
    [[ $e == LD_LIBRARY_PATH=* ]] || continue
    dir=${e#LD_LIBRARY_PATH=}
    LD_LIBRARY_PATH=$dir ldd "$bin/all_reduce_perf" 2>/dev/null | grep "libnccl.so.2 => $dir/" >/dev/null || {
      echo "bench_hosts.sh: --env $v: $bin/all_reduce_perf does not load libnccl.so.2 from $dir (link the old libcomm.so there under that name)" >&2
      exit 2
    }
  done
done

# The tables, from the JSON files of --out: busbw medians over rounds with the lowest and highest
# round, ratios per round (then their median and range), iperf3's rate.
summarize() {
  python3 - "$out" "${coll_list[@]}" <<'PY' | tee "$out/tables.md"
import glob, json, os, statistics, sys

out, colls = sys.argv[1], sys.argv[2:]
labels = dict(l.rstrip("\n").split("\t") for l in open(os.path.join(out, "variants.txt")) if l.strip())
variants = sorted(labels)
setup = open(os.path.join(out, "setup.txt")).read()
print("```\n" + setup.strip() + "\n```\n")
# placement compared: gloo's all_reduce works in place, its all_gather_into_tensor out of place
place = {"all_reduce": "in_place", "all_gather": "out_of_place"}


def rounds():
    return sorted({int(os.path.basename(p).split(".")[0][1:]) for p in glob.glob(os.path.join(out, "r*.json"))})


def load(rnd, impl, coll):
    rows = {}
    for p in glob.glob(os.path.join(out, f"r{rnd}.{impl}.{coll}.*.json")):
        try:
            doc = json.load(open(p))
        except (OSError, ValueError):
            continue
        for row in doc.get("results", []):
            rows[row["size"]] = row
    return rows


def med(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, None
    return statistics.median(xs), min(xs), max(xs)


def fmt(t, digits=2, unit=""):
    m, lo, hi = t
    if m is None:
        return "-"
    return f"{m:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


R = rounds()
# iperf3: Gbit/s received, single stream and each direction of --bidir
single, fwd, rev = [], [], []
for r in R:
    try:
        d = json.load(open(os.path.join(out, f"r{r}.iperf.json")))["end"]
        single.append(d["sum_received"]["bits_per_second"] / 1e9)
    except (OSError, ValueError, KeyError):
        pass
    try:
        d = json.load(open(os.path.join(out, f"r{r}.iperf-bidir.json")))["end"]
        fwd.append(d["sum_received"]["bits_per_second"] / 1e9)
        rev.append(d["sum_received_bidir_reverse"]["bits_per_second"] / 1e9)
    except (OSError, ValueError, KeyError):
        pass
per_dir = [(a + b) / 2 for a, b in zip(fwd, rev)]
if single:
    print(f"iperf3 one stream: {fmt(med(single))} Gbit/s; --bidir host 0 -> 1: {fmt(med(fwd))}, "
          f"1 -> 0: {fmt(med(rev))} Gbit/s; per direction (mean of the two) {fmt(med(per_dir))} Gbit/s "
          f"= {fmt(med([x / 8 for x in per_dir]), digits=3)} GB/s\n")
link = statistics.median(per_dir) / 8 if per_dir else None


def busbw(rnd, impl, coll, size, pl):
    row = load(rnd, impl, coll).get(size)
    if not row or pl not in row:
        return None
    return row[pl]["bus_bw"]


def time_us(rnd, impl, coll, size, pl):
    row = load(rnd, impl, coll).get(size)
    if not row or pl not in row:
        return None
    return row[pl]["time"]


def ratio(a, b):
    return a / b if a is not None and b else None


cache = {}
for coll in colls:
    pl = place.get(coll, "out_of_place")
    data = {impl: {r: load(r, impl, coll) for r in R} for impl in variants + ["mpi", "gloo"]}
    sizes = sorted({s for r in R for s in data[variants[0]][r]} - {8} if coll == "all_reduce" else
                   {s for r in R for s in data[variants[0]][r]})

    def bw(impl, r, s):
        row = data[impl][r].get(s)
        return row[pl]["bus_bw"] if row and pl in row else None

    have = [i for i in ("mpi", "gloo") if any(data[i][r] for r in R)]
    print(f"### {coll}, {pl.replace('_', ' ')}: busbw in GB/s, median of {len(R)} rounds (min-max)\n")
    head = ["size"] + [labels[v] for v in variants] + [{"mpi": "MPI-TCP", "gloo": "gloo"}[i] for i in have]
    for v in variants:
        for i in have:
            head.append(f"{labels[v]} / {'MPI' if i == 'mpi' else 'gloo'}")
    for v in variants[1:]:
        head.append(f"{labels[v]} / {labels[variants[0]]}")
    if link:
        head += [f"{labels[v]} / link" for v in variants]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for s in sizes:
        cells = [str(s)]
        for i in variants + have:
            cells.append(fmt(med([bw(i, r, s) for r in R]), digits=3))
        for v in variants:
            for i in have:
                cells.append(fmt(med([ratio(bw(v, r, s), bw(i, r, s)) for r in R]), unit="x"))
        for v in variants[1:]:
            cells.append(fmt(med([ratio(bw(v, r, s), bw(variants[0], r, s)) for r in R]), unit="x"))
        if link:
            for v in variants:
                m = med([bw(v, r, s) for r in R])
                cells.append(f"{100 * m[0] / link:.0f} %" if m[0] is not None else "-")
        print("| " + " | ".join(cells) + " |")
    print()
    if coll == "all_reduce":
        print("### all_reduce 8 B: time in us, median (min-max)\n")
        print("| placement | " + " | ".join(labels[v] for v in variants) + " | " +
              " | ".join({"mpi": "MPI-TCP", "gloo": "gloo"}[i] for i in have) + " | " +
              " | ".join(f"{'MPI' if i == 'mpi' else 'gloo'} time / {labels[v]} time" for v in variants for i in have) + " |")
        print("|---|" + "---:|" * (len(variants) + len(have) + len(variants) * len(have)))
        for p in ("out_of_place", "in_place"):
            def t(impl, r):
                row = data[impl][r].get(8)
                return row[p]["time"] if row and p in row else None
            cells = [p.replace("_", " ")]
            for i in variants + have:
                cells.append(fmt(med([t(i, r) for r in R])))
            for v in variants:
                for i in have:
                    cells.append(fmt(med([ratio(t(i, r), t(v, r)) for r in R]), unit="x"))
            print("| " + " | ".join(cells) + " |")
        print()
fails = open(os.path.join(out, "failures.txt")).read().strip()
if fails:
    print("Failures:\n\n```\n" + fails + "\n```")
PY
}
IFS=, read -r -a coll_list <<<"$colls"
if ((report_only)); then
  summarize
  exit 0
fi
for c in "${coll_list[@]}"; do
  [ -x "$bin/${c}_perf" ] || { echo "bench_hosts.sh: $bin/${c}_perf missing (build with cmake, see bench/README.md, or pass --bin)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "bench_hosts.sh: network namespaces need root" >&2; exit 2; }

# What the measurements need, installed the way scripts/deps.sh installs its tools.
apt_missing=()
((do_iperf)) && ! command -v iperf3 >/dev/null 2>&1 && apt_missing+=(iperf3)
((do_mpi)) && ! command -v mpirun >/dev/null 2>&1 && apt_missing+=(openmpi-bin)
for tool in ip:iproute2 tc:iproute2 nsenter:util-linux unshare:util-linux pgrep:procps; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || apt_missing+=("${tool##*:}")
done
if ((${#apt_missing[@]})); then
  echo "installing ${apt_missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${apt_missing[@]}" >/dev/null
fi
if ((do_mpi)) && [ ! -x "$bin/mpi_perf" ]; then
  echo "bench_hosts.sh: $bin/mpi_perf missing (CMake builds it when it finds MPI); use --no-mpi to go without" >&2
  exit 2
fi
if ((do_gloo)); then
  venv=${COMM_TORCH_VENV:-${COMM_DEPS:-$root/.deps}/torch-venv}
  if ! "$venv/bin/python" -c 'import torch.distributed' 2>/dev/null; then
    echo "installing ${COMM_TORCH_SPEC:-torch} into $venv (the first time takes a while)" >&2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install -q "${COMM_TORCH_SPEC:-torch}"
  fi
  py=$venv/bin/python
fi

out=${out:-$(mktemp -d -t comm-bench-hosts.XXXXXX)}
mkdir -p "$out"
work=$(mktemp -d -t comm-bench-hosts-work.XXXXXX)
prefix=cbh$$
addr() { echo "10.77.0.$(($1 + 1))"; }

# Always remove the namespaces (and so every process still running in them). Long commands
# run in the background with `wait`, which a signal interrupts, so that Ctrl-C acts at once
# (a foreground `timeout` would keep it from the command and bash would wait for it).
cleanup() {
  set +e
  local pids
  pids=$(jobs -p)
  [ -n "$pids" ] && kill $pids 2>/dev/null
  "$netns" down "$prefix" >/dev/null 2>&1
  rm -rf "$work" /dev/shm/"$prefix"-*
}
trap cleanup EXIT
trap 'echo "bench_hosts.sh: interrupted" >&2; exit 130' INT TERM HUP

"$netns" up "$prefix" "$hosts"
if [ -n "$rate" ]; then
  for ((h = 0; h < hosts; h++)); do "$netns" rate "$prefix" "$h" "$rate"; done
fi
# mpirun lives on the switch; its agent enters the host named by the address it is given.
ip -n "$prefix-sw" addr add 10.77.0.254/24 dev br0
# The simulated hosts share one hostname and one /dev/shm, so OpenMPI's shared-memory segments
# (named after the host and the job) would be the same files on every host: each host's get a
# directory of its own.
cat >"$work/agent.sh" <<EOF
#!/usr/bin/env bash
# rsh agent for mpirun: <host address> <command...>, run inside that simulated host.
h=\$1; shift
case "\$h" in 10.77.0.*) ;; *) echo "agent: unknown host \$h" >&2; exit 1 ;; esac
i=\$(( \${h##*.} - 1 ))
mkdir -p "/dev/shm/$prefix-\$i"
export OMPI_MCA_btl_vader_backing_directory="/dev/shm/$prefix-\$i"
exec "$netns" exec "$prefix" "\$i" /bin/sh -c "\$*"
EOF
chmod +x "$work/agent.sh"
for ((h = 0; h < hosts; h++)); do echo "$(addr "$h") slots=$per_host"; done >"$work/hostfile"
btl=tcp,self
((per_host > 1)) && btl=tcp,vader,self
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

{
  echo "date $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "hosts $hosts per_host $per_host rate ${rate:-none} rounds $rounds max $max"
  echo "commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "mpi_btl $btl"
} >"$out/setup.txt"
: >"$out/variants.txt"
for ((v = 0; v < ${#variants[@]}; v++)); do
  printf 'c%d\t%s\n' "$v" "comm${variants[v]:+ ${variants[v]}}" >>"$out/variants.txt"
done
: >"$out/failures.txt"

# Rendezvous ports come from 20000-31999, below the kernel's ephemeral range (32768-60999 by
# default): a port in that range can be taken for a while as some connection's source port, and
# process 0 then cannot listen on it ("Address already in use"; seen once in some 300 runs).
port=$((20000 + RANDOM % 12000))
next_port() { port=$((20000 + (port - 20000 + 1) % 12000)); }

fail() {
  echo "FAILED: $*" | tee -a "$out/failures.txt" >&2
}

# ranks_run NAME ENV... -- CMD...: one process per rank on its host; waits for all of them.
ranks_run() {
  local name=$1 envs=() pids=() r rc=0
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  next_port
  for ((r = 0; r < nranks; r++)); do
    "$netns" exec "$prefix" $((r / per_host)) env "${envs[@]}" RANK=$r WORLD_SIZE=$nranks \
      LOCAL_RANK=$((r % per_host)) MASTER_ADDR="$(addr 0)" MASTER_PORT=$port \
      timeout "$limit" "$@" >"$out/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}

run_comm() { # variant coll tag json args...
  local v=$1 coll=$2 tag=$3 json=$4 envs=()
  shift 4
  [ -n "${variants[v]}" ] && IFS=, read -r -a envs <<<"${variants[v]}"
  ranks_run "$tag" "${envs[@]}" NCCL_SOCKET_IFNAME=eth0 -- "$bin/${coll}_perf" "$@" -J "$json" ||
    fail "$tag (see $out/$tag.*.log)"
}

run_mpi() { # coll tag json args...
  local coll=$1 tag=$2 json=$3
  shift 3
  # Tree spawn stays on (mpirun starts every orted itself up to 64 hosts): without it mpirun
  # asks the orteds to daemonize, and one in a few launches never reported back.
  ip netns exec "$prefix-sw" timeout "$limit" mpirun --hostfile "$work/hostfile" -np "$nranks" \
    --map-by slot --oversubscribe --mca plm_rsh_agent "$work/agent.sh" \
    --mca oob_tcp_if_include 10.77.0.0/24 --mca btl "$btl" --mca btl_tcp_if_include eth0 --mca mpi_yield_when_idle 1 \
    "$bin/mpi_perf" "$coll" "$@" -J "$json" >"$out/$tag.log" 2>&1 &
  wait $! || fail "$tag (see $out/$tag.log)"
}

run_gloo() { # coll tag json args...
  local coll=$1 tag=$2 json=$3
  shift 3
  ranks_run "$tag" GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 -- "$py" "$root/bench/hosts_gloo.py" "$coll" "$@" \
    -J "$json" || fail "$tag (see $out/$tag.*.log)"
}

run_iperf() { # tag extra-args...
  local tag=$1 srv=$((hosts - 1)) try
  shift
  for try in 1 2 3; do
    next_port
    "$netns" exec "$prefix" "$srv" timeout 60 iperf3 -s -1 -p $port >"$out/$tag.server.log" 2>&1 &
    local spid=$!
    sleep 0.5
    "$netns" exec "$prefix" 0 timeout 60 iperf3 -c "$(addr "$srv")" -p $port -t 5 -J "$@" \
      >"$out/$tag.json" 2>"$out/$tag.err" &
    if wait $!; then
      wait $spid || true
      return 0
    fi
    kill $spid 2>/dev/null || true
    wait $spid 2>/dev/null || true
  done
  fail "$tag (see $out/$tag.json)"
}

# The sweeps: name, collectives it applies to, arguments.
seg_names=(lat small large)
seg_args=("-b 8 -e 8 -n 500 -w 50 -c 1" "-b 16 -e 1M -f 4 -n 40 -w 5 -c 1" "-b 4M -e $max -f 4 -n 5 -w 1 -c 1")
impls=()
for ((v = 0; v < ${#variants[@]}; v++)); do impls+=("c$v"); done
((do_mpi)) && impls+=(mpi)
((do_gloo)) && impls+=(gloo)

start=$(date +%s)
for ((round = 0; round < rounds; round++)); do
  order=("${impls[@]}")
  if ((round % 2)); then # reversed every other round
    order=()
    for ((i = ${#impls[@]} - 1; i >= 0; i--)); do order+=("${impls[i]}"); done
  fi
  # The machine may be shared: note how busy it was when each round began.
  echo "round $((round + 1)) load average $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/setup.txt"
  if ((do_iperf)); then
    echo "[round $((round + 1))/$rounds] iperf3" >&2
    run_iperf "r$round.iperf"
    run_iperf "r$round.iperf-bidir" --bidir
  fi
  for coll in "${coll_list[@]}"; do
    for s in 0 1 2; do
      seg=${seg_names[s]}
      [ "$seg" = lat ] && [ "$coll" != all_reduce ] && continue
      read -r -a args <<<"${seg_args[s]}"
      for impl in "${order[@]}"; do
        [ "$impl" = gloo ] && [ "$coll" != all_reduce ] && [ "$coll" != all_gather ] && continue
        tag=r$round.$impl.$coll.$seg
        t0=$(date +%s)
        case "$impl" in
          c*) run_comm "${impl#c}" "$coll" "$tag" "$out/$tag.json" "${args[@]}" ;;
          mpi) run_mpi "$coll" "$tag" "$out/$tag.json" "${args[@]}" ;;
          gloo) run_gloo "$coll" "$tag" "$out/$tag.json" "${args[@]}" ;;
        esac
        echo "[round $((round + 1))/$rounds] $coll $seg $impl: $(($(date +%s) - t0)) s" >&2
      done
    done
  done
done
echo "total $(($(date +%s) - start)) s" >>"$out/setup.txt"

summarize
echo "results in $out" >&2
