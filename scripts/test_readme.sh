#!/usr/bin/env bash
# Compiles and runs the README's C code blocks, so that an example can be neither stale nor racy:
#   - a block whose first line is a comment naming a file (`/* name.c: ...`) is a complete
#     program: it is compiled as it stands and run as 2 and 3 processes on this host;
#   - any other C block is a fragment that uses `comm`, `rank` and `nranks`: it is compiled inside
#     a main() that makes them and run as 3 processes, 10 times (a missing barrier shows);
#   - the ```python block, when torch is installed (.deps/torch-venv), runs under torchrun on 2.
# Each run must exit 0 on every rank and print no WARN line. Needs target/release/libcomm.so.
# Usage: scripts/test_readme.sh [markdown file, default README.md]
set -euo pipefail
cd "$(dirname "$0")/.."
lib=$PWD/target/release
[ -f "$lib/libcomm.so" ] || { echo "FAIL: no $lib/libcomm.so (cargo build --release first)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# Blocks into $work/block<N>.<lang>, in README order.
python3 - "${1:-README.md}" "$work" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
for n, (lang, body) in enumerate(re.findall(r"^```(\w+)\n(.*?)^```", text, re.S | re.M)):
    open(f"{sys.argv[2]}/block{n}.{lang}", "w").write(body)
PY

# Runs $1 as $2 processes on this host with a fresh rendezvous port; $3 names it in messages.
run_ranks() {
  local prog=$1 n=$2 what=$3 port pids=() r status=0
  port=$((20000 + RANDOM % 12000))
  for ((r = 0; r < n; r++)); do
    NCCL_COMM_ID=127.0.0.1:$port COMM_SECRET=readme COMM_TIMEOUT=30 RANK=$r WORLD_SIZE=$n \
      timeout 60 "$prog" >"$work/out.$r" 2>&1 &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do wait "${pids[$r]}" || status=1; done
  if [ $status != 0 ] || grep -q "WARN" "$work"/out.*; then
    cat "$work"/out.* >&2
    fail "$what on $n ranks"
  fi
  rm -f "$work"/out.*
}

cc() { gcc -std=c99 -Wall -Werror -I include "$@" -L"$lib" -lcomm -Wl,-rpath,"$lib"; }

programs=0 fragments=0
for f in "$work"/block*.c; do
  [ -e "$f" ] || continue
  if head -1 "$f" | grep -q '^/\* [A-Za-z0-9_]*\.c:'; then
    name=$(head -1 "$f" | sed 's|^/\* \([A-Za-z0-9_]*\)\.c:.*|\1|')
    cc "$f" -o "$work/$name" || fail "README program $name.c does not compile"
    run_ranks "$work/$name" 2 "README program $name.c"
    run_ranks "$work/$name" 3 "README program $name.c"
    programs=$((programs + 1))
  else
    {
      printf '#include <nccl.h>\n#include <stdint.h>\n#include <stdio.h>\n#include <stdlib.h>\n'
      printf 'int main(void) {\n  int rank = atoi(getenv("RANK")), nranks = atoi(getenv("WORLD_SIZE"));\n'
      printf '  ncclUniqueId id;\n  ncclGetUniqueId(&id);\n  ncclComm_t comm;\n'
      printf '  if (ncclCommInitRank(&comm, nranks, id, rank) != ncclSuccess) return 1;\n'
      printf '  commSetTimeout(comm, 30);\n#line 1 "README fragment"\n'
      cat "$f"
      # Every call of the fragment must have succeeded: the communicator has no error to report.
      printf '\n  ncclResult_t async;\n  if (ncclCommGetAsyncError(comm, &async) != ncclSuccess || async != ncclSuccess) return 1;\n'
      printf '  const char* e = ncclGetLastError(comm);\n  if (e && *e) { fprintf(stderr, "rank %%d: %%s\\n", rank, e); return 1; }\n'
      printf '  return ncclCommDestroy(comm) == ncclSuccess ? 0 : 1;\n}\n'
    } >"$work/frag$fragments.c"
    cc -Wno-unused-variable "$work/frag$fragments.c" -o "$work/frag$fragments" ||
      fail "README fragment $(basename "$f") does not compile"
    for _ in $(seq 10); do run_ranks "$work/frag$fragments" 3 "README fragment $(head -1 "$f")"; done
    fragments=$((fragments + 1))
  fi
done
[ $programs -ge 1 ] || fail "the README has no complete C program"

pythons=0
torchrun=.deps/torch-venv/bin/torchrun
if [ -x "$torchrun" ]; then
  for f in "$work"/block*.python; do
    [ -e "$f" ] || continue
    PYTHONPATH=$PWD/python COMM_LIBRARY=$lib/libcomm.so timeout 120 "$torchrun" --nproc-per-node 2 \
      --master-port $((20000 + RANDOM % 12000)) "$f" >"$work/py.log" 2>&1 || { cat "$work/py.log" >&2; fail "README Python block"; }
    pythons=$((pythons + 1))
  done
else
  echo "no $torchrun: the README's Python blocks were not run"
fi
echo "README examples passed: $programs programs, $fragments fragments, $pythons Python blocks"
