#!/usr/bin/env bash
# Runs the shell lines of README.md's Quickstart as a user would, in a scratch directory with
# HOME pointing there (so "$HOME/comm" is a fresh install prefix), and fails on any line it does
# not know: a Quickstart line cannot change without this script noticing. Each line runs as
# written, apart from these changes, made here only and printed as they are made:
#   - `cmake -S .` names the checkout, and reuses its cargo target directory
#     (-DCOMM_CARGO_TARGET_DIR); `cmake --build -j` is -j2; the build directory `build` is
#     CMAKE_BUILD_DIR (below) or one in the scratch directory;
#   - the fixed rendezvous port 29500 is a random free-looking one (other jobs may share this
#     machine), and benchmark sweeps end at 1 MiB instead of 64 MiB or 1 GiB;
#   - `mpirun -np 8 -H node0:4,node1:4` is 4 ranks on localhost (--allow-run-as-root
#     --oversubscribe), node0 is 127.0.0.1;
#   - `prog.c` is tests/package/consumer.c, and the CMake consumer's `...` is tests/package;
#   - `pip install ./python` and `scripts/main_job.sh` are not run: scripts/test_wheel.sh builds
#     and installs that package (as a wheel, with the same build backend), and main_job.sh is
#     the next two lines after a CMake build in the checkout's build/.
# The Slurm job (the ```bash block) runs under fake srun and scontrol (tests/readme/slurm) as a
# job of 2 nodes x 2 tasks (the script asks for 4 per node), each node a network namespace
# (scripts/netns.sh) where that works, else this host; hello_comm is the README's own C program.
# Every run is under `timeout`.
#
# Usage: scripts/test_quickstart.sh [CMAKE_BUILD_DIR]
#   CMAKE_BUILD_DIR: a CMake build of this checkout to reuse (scripts/test_package.sh passes its
#   own); without it the README's cmake lines build one in the scratch directory.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d)
netns_prefix=""
cleanup() {
  [ -z "$netns_prefix" ] || "$repo/scripts/netns.sh" down "$netns_prefix" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
start=$(date +%s)

fail() {
  echo "FAIL: $*" >&2
  exit 1
}
command -v mpirun >/dev/null || fail "no mpirun (scripts/deps.sh installs OpenMPI)"

# The Quickstart's indented lines ($work/lines), its ```bash block ($work/job.sh) and the
# README's hello_comm.c.
python3 - README.md "$work" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
start = text.index("\n## Quickstart\n")
section = text[start:text.index("\n## ", start + 1)]
lines, fenced = [], False
for line in section.splitlines():
    if line.startswith("```"):
        fenced = not fenced
    elif not fenced and line.startswith("    ") and line.strip():
        lines.append(line[4:])
open(f"{sys.argv[2]}/lines", "w").write("\n".join(lines) + "\n")
(job,) = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
open(f"{sys.argv[2]}/job.sh", "w").write(job)
(prog,) = re.findall(r"^```c\n(/\* hello_comm\.c:.*?)^```", text, re.S | re.M)
open(f"{sys.argv[2]}/hello_comm.c", "w").write(prog)
PY

# A user's shell: HOME is the scratch directory (cargo and rustup keep their own homes).
export CARGO_HOME=${CARGO_HOME:-$HOME/.cargo} RUSTUP_HOME=${RUSTUP_HOME:-$HOME/.rustup}
export HOME=$work/home
mkdir -p "$HOME"
cd "$work"
if [ -n "${1:-}" ]; then
  bdir=$(cd "$repo" && cd "$1" && pwd)
else
  bdir=$work/build
fi
cp "$repo/tests/package/consumer.c" prog.c
port=$((20000 + RANDOM % 12000))

# Runs $1 with bash under a time limit of $2 seconds, with no input (mpirun would read the
# lines still to come), output in $work/out; prints it on failure.
run() {
  echo "  \$ $1"
  if ! timeout "$2" bash -euo pipefail -c "$1" </dev/null >"$work/out" 2>&1; then
    cat "$work/out" >&2
    fail "README line: $1"
  fi
}
# Fails unless $work/out has at least $2 lines matching $1.
expect() {
  local n
  n=$(grep -c -- "$1" "$work/out" || true)
  [ "$n" -ge "$2" ] || { cat "$work/out" >&2; fail "expected $2 lines matching '$1', found $n"; }
}
small() {
  local c=${1//-e 64M/-e 1M}
  echo "${c//-e 1G/-e 1M}"
}
# The README's build directory `build` (a word of its own, or build/...) is $bdir.
# shellcheck disable=SC2001 # a pattern with alternatives and anchors: sed's, not bash's
b() { sed -e "s#\(^\|[ =]\)build\([/ ]\|\$\)#\1$bdir\2#g" <<<"$1"; }

echo "Quickstart lines:"
seen=0
while IFS= read -r line; do
  cmd=${line%%  #*}  # a comment follows two spaces or more
  cmd=${cmd%"${cmd##*[! ]}"}
  seen=$((seen + 1))
  case $cmd in
    "cmake -S . -B build")
      run "$(b "cmake -S \"$repo\" -B build") -DCOMM_CARGO_TARGET_DIR=\"$repo/target\"" 300
      grep -q "^CMAKE_BUILD_TYPE:STRING=Release$" "$bdir/CMakeCache.txt" || fail "the build type is not Release"
      ;;
    "cmake --build build -j")
      run "$(b "cmake --build build -j2")" 1800
      ;;
    "cmake --install build --prefix \"\$HOME/comm\"")
      run "$(b "$cmd")" 300
      if [ ! -f "$HOME/comm/lib/libnccl.so.2" ] || [ ! -f "$HOME/comm/include/nccl.h" ]; then
        fail "nothing installed in \$HOME/comm"
      fi
      ;;
    "gcc prog.c "*)
      run "$cmd" 120
      run "env -u LD_LIBRARY_PATH ./a.out" 60
      expect "all-reduce OK" 1
      ;;
    *"pkg-config --cflags --libs nccl")
      run "$cmd" 60
      expect "-lnccl" 1
      # The flags it prints build a program that runs without a library path.
      run "gcc -std=c99 prog.c -o pc.out $(cat "$work/out") && env -u LD_LIBRARY_PATH ./pc.out" 120
      expect "all-reduce OK" 1
      ;;
    "cmake -DCMAKE_PREFIX_PATH=\"\$HOME/comm\" ...")
      run "${cmd/.../-S \"$repo/tests/package\" -B consumer} && cmake --build consumer" 300
      run "env -u LD_LIBRARY_PATH consumer/consumer_package" 60
      expect "all-reduce OK" 1
      ;;
    "gcc -std=c99 hello_comm.c -o hello_comm "*)
      run "$cmd" 120
      ;;
    "export NCCL_COMM_ID=127.0.0.1:29500 "*)
      cmd=${cmd//:29500/:$port}
      echo "  \$ $cmd"
      eval "$cmd"
      ;;
    "RANK=0 WORLD_SIZE=2 ./hello_comm & RANK=1 WORLD_SIZE=2 ./hello_comm; wait")
      run "$cmd" 120
      # `wait` hides rank 0's exit status: its line is the proof.
      expect "^rank [01] of 2: sum 1 (expected 1)$" 2
      ;;
    "pip install ./python")
      echo "  (not run: $cmd; scripts/test_wheel.sh builds and installs this package)"
      ;;
    "scripts/main_job.sh")
      echo "  (not run: $cmd; it builds in the checkout, then runs the benchmark as the next lines do)"
      ;;
    "build/bench/all_reduce_perf -t 4 "*)
      run "$(b "$(small "$cmd")")" 300
      expect "Out of bounds values : 0 OK" 1
      ;;
    "for r in 0 1 2 3; do RANK=\$r WORLD_SIZE=4 build/bench/all_reduce_perf "*)
      run "export MASTER_PORT=$((port + 1)); $(b "$(small "$cmd")")" 300
      # `wait` hides the exit statuses: rank 0's table is the proof.
      expect "Out of bounds values : 0 OK" 1
      ;;
    "mpirun -np 8 -H node0:4,node1:4 "*)
      cmd=$(b "$(small "$cmd")")
      cmd=${cmd/-np 8 -H node0:4,node1:4/-np 4 -H localhost:4 --allow-run-as-root --oversubscribe}
      cmd=${cmd//node0:29500/127.0.0.1:$port}
      cmd=${cmd//=node0/=127.0.0.1}
      run "$cmd" 300
      case $cmd in
        *hello_comm) expect "^rank [0-3] of 4: sum 6 (expected 6)$" 4 ;;
        *all_reduce_perf*) expect "Out of bounds values : 0 OK" 1 ;;
        *) fail "no check for: $cmd" ;;
      esac
      ;;
    *)
      fail "a Quickstart line this test does not know (teach scripts/test_quickstart.sh): $line"
      ;;
  esac
done <"$work/lines"
[ "$seen" -ge 15 ] || fail "only $seen Quickstart lines found"

echo "the Slurm job (2 nodes x 2 tasks, fake srun and scontrol):"
export SLURM_JOB_ID=$((port + 2)) SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2 SLURM_NTASKS_PER_NODE=2 \
  SLURM_NTASKS=4 SLURM_JOB_NODELIST="node[0-1]" FAKE_SLURM_TIMEOUT=120
export PATH=$repo/tests/readme/slurm:$PATH
b "$(small "$(cat job.sh)")" >job_small.sh
prefix=rdme$$
if "$repo/scripts/netns.sh" up "$prefix" 2 >"$work/netns.log" 2>&1; then
  netns_prefix=$prefix
  export FAKE_SLURM_NETNS=$prefix FAKE_SLURM_NETNS_SH=$repo/scripts/netns.sh
  FAKE_SLURM_HOSTS="$("$repo/scripts/netns.sh" addr "$prefix" 0) $("$repo/scripts/netns.sh" addr "$prefix" 1)"
  echo "  nodes: network namespaces $FAKE_SLURM_HOSTS"
else
  cat "$work/netns.log"
  echo "  nodes: both on this host (no network namespaces here)"
  FAKE_SLURM_HOSTS="localhost localhost"
  sed -i "s/:29500/:$port/" job_small.sh
fi
export FAKE_SLURM_HOSTS
run "bash job_small.sh" 600
expect "^rank [0-3] of 4: sum 6 (expected 6)$" 4
expect "Out of bounds values : 0 OK" 1
expect "#  Rank  [0-3] Group  0 Pid" 4
grep -E "^rank |#  Rank |Out of bounds" "$work/out" | sed 's/^/    /'

echo "Quickstart passed in $(($(date +%s) - start)) s"
