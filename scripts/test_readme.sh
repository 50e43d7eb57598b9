#!/usr/bin/env bash
# Compiles and runs the code blocks of README.md and python/README.md, so that an example can be
# neither stale nor racy:
#   - a C block whose first line is a comment naming a file (`/* name.c: ...`) is a complete
#     program: it is compiled as it stands and run as 2 and 3 processes on this host;
#   - any other C block is a fragment that uses `comm`, `rank` and `nranks`: it is compiled inside
#     a main() that makes them and run as 3 processes, 10 times (a missing barrier shows);
#   - a ```python block runs under torchrun on 2 and on 3 ranks through tests/readme/fragment.py:
#     as it stands where it calls init_process_group and destroy_process_group, else after its
#     file's setup block (the one ```python block that calls only init_process_group), which
#     the README names as the setup of the examples that follow it. The torch environment
#     (COMM_TORCH_VENV, default $COMM_DEPS/torch-venv) must exist under CI (CI=true); elsewhere
#     its absence skips the Python blocks with a message;
#   - the ```bash block (the Slurm job) and the indented shell lines of the Quickstart run in
#     scripts/test_quickstart.sh, which needs a CMake build (scripts/test_package.sh runs it).
# Each run must exit 0 on every rank and print no WARN line. Needs target/release/libcomm.so.
# Usage: scripts/test_readme.sh [markdown file...] (default README.md python/README.md)
set -euo pipefail
cd "$(dirname "$0")/.."
lib=$PWD/target/release
[ -f "$lib/libcomm.so" ] || { echo "FAIL: no $lib/libcomm.so (cargo build --release first)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The runs load a copy, so that a rebuild meanwhile cannot change the library under them.
cp "$lib/libcomm.so" "$work/libcomm.so"

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# Blocks into $work/<file>/block<NN>.<lang>, in each file's order.
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(README.md python/README.md)
python3 - "$work" "${files[@]}" <<'PY'
import os, re, sys
for path in sys.argv[2:]:
    text = open(path).read()
    out = os.path.join(sys.argv[1], path.replace("/", "_"))
    os.makedirs(out)
    for n, (lang, body) in enumerate(re.findall(r"^```(\w+)\n(.*?)^```", text, re.S | re.M)):
        open(f"{out}/block{n:02d}.{lang}", "w").write(body)
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
for f in "$work"/*/block*.c; do
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
case " ${files[*]} " in
  *" README.md "*) [ $programs -ge 1 ] || fail "README.md has no complete C program" ;;
esac

pythons=0
venv=${COMM_TORCH_VENV:-${COMM_DEPS:-$PWD/.deps}/torch-venv}
if [ -x "$venv/bin/torchrun" ]; then
  for dir in "$work"/*/; do
    setup=()
    for f in "$dir"block*.python; do
      [ -e "$f" ] || continue
      what="$(basename "$dir" | tr _ /) $(basename "$f" .python)"
      if grep -q init_process_group "$f" && ! grep -q destroy_process_group "$f"; then
        [ ${#setup[@]} = 0 ] || fail "$what: a second setup block"
        setup=("$f")
        continue
      fi
      for n in 2 3; do
        PYTHONPATH=$PWD/python COMM_LIBRARY=$work/libcomm.so COMM_TIMEOUT=30 COMM_README_PACKAGE_DIR=$PWD/python \
          timeout 180 "$venv/bin/torchrun" --nproc-per-node $n --master-port $((20000 + RANDOM % 12000)) \
          tests/readme/fragment.py "$f" "$what" "${setup[@]}" >"$work/py.log" 2>&1 ||
          { cat "$work/py.log" >&2; fail "$what on $n ranks"; }
        if ! grep -q "^$what: OK" "$work/py.log" || grep -q WARN "$work/py.log"; then
          cat "$work/py.log" >&2
          fail "$what on $n ranks: no OK line, or a WARN line"
        fi
      done
      grep "^$what: OK" "$work/py.log" | head -1
      pythons=$((pythons + 1))
    done
  done
elif [ "${CI:-}" = true ]; then
  fail "no $venv/bin/torchrun under CI: the README's Python blocks cannot run (scripts/test_python.sh makes it)"
else
  echo "no $venv/bin/torchrun: the README's Python blocks were not run"
fi
echo "README examples passed: $programs programs, $fragments fragments, $pythons Python blocks"
