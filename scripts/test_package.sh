#!/usr/bin/env bash
# Builds and installs comm with CMake as a user would (no build type given: Release is the
# default), then checks the installed tree the way NCCL's users use NCCL:
#   - the library is libnccl.so.2 (SONAME libnccl.so.2) with libnccl.so and libcomm.so beside it;
#   - every installed program starts with no library path set (install RPATH);
#   - consumers find it by NCCL's names: CMake find_package(NCCL) and find_library(NAMES nccl),
#     pkg-config nccl, plain -lnccl; and by comm's (find_package(comm), pkg-config comm);
#   - a program linked against another libnccl.so.2 runs unchanged on comm's lib/;
# then scripts/test_wheel.sh checks the Python wheel (and makes the torch environment where it is
# missing), scripts/test_readme.sh runs the READMEs' C and Python examples, and
# scripts/test_quickstart.sh the README's Quickstart shell lines and Slurm job on this build
# (the checks above are the thorough ones; those run the lines as a user reads them).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

cmake -S . -B "$work/build" -DCOMM_CARGO_TARGET_DIR="$PWD/target" >"$work/configure.log"
grep -q "^CMAKE_BUILD_TYPE:STRING=Release$" "$work/build/CMakeCache.txt" || fail "the default build type is not Release"
cmake --build "$work/build" -j2 >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; fail "build"; }
cmake --install "$work/build" --prefix "$work/prefix" >/dev/null
# A prefix with no "lib" in its path: nothing below can pass by a search-path accident.
prefix=$work/prefix
lib=$prefix/lib

echo "library names"
test -f "$prefix/include/nccl.h" || fail "no include/nccl.h"
if [ ! -f "$lib/libnccl.so.2" ] || [ -L "$lib/libnccl.so.2" ]; then
  fail "lib/libnccl.so.2 is not the library file"
fi
for link in libnccl.so libcomm.so; do
  [ "$(readlink "$lib/$link")" = libnccl.so.2 ] || fail "lib/$link is not a link to libnccl.so.2"
done
readelf -d "$lib/libnccl.so.2" | grep -q "SONAME.*\[libnccl\.so\.2\]" || fail "the SONAME is not libnccl.so.2"
for f in "$lib/cmake/NCCL/NCCLConfig.cmake" "$lib/cmake/comm/commConfig.cmake" "$lib/pkgconfig/nccl.pc" \
  "$lib/pkgconfig/comm.pc"; do
  test -f "$f" || fail "no ${f#"$prefix"/}"
done

echo "installed programs start"
programs=$(find "$prefix/bin" -type f -perm -u+x)
[ "$(echo "$programs" | wc -l)" -ge 10 ] || fail "too few programs installed: $programs"
for p in $programs; do
  # The loader's own report of what it would load (as ldd), with no library path set.
  if ! out=$(env -u LD_LIBRARY_PATH LD_TRACE_LOADED_OBJECTS=1 "$p" 2>&1) || grep -q "not found" <<<"$out"; then
    echo "$out" >&2
    fail "${p#"$prefix"/} does not find its libraries"
  fi
  if readelf -d "$p" | grep -q "NEEDED.*libnccl"; then
    # shellcheck disable=SC2016 # $ORIGIN is the loader's, not the shell's
    readelf -d "$p" | grep -q 'R.*PATH.*\$ORIGIN/\.\./lib' || fail "${p#"$prefix"/} has no \$ORIGIN RPATH"
  fi
done
env -u LD_LIBRARY_PATH "$prefix/bin/all_reduce_perf" -t 2 -b 8 -e 1K -f 4 -n 1 -w 0 -c 1 >"$work/perf.log" 2>&1 ||
  { cat "$work/perf.log"; fail "installed all_reduce_perf"; }
grep -q "Out of bounds values : 0 OK" "$work/perf.log" || { cat "$work/perf.log"; fail "installed all_reduce_perf result"; }
env -u LD_LIBRARY_PATH "$prefix/bin/allreduce_example" 2 4096 2 | grep -q "wrong elements: 0 OK" ||
  fail "installed allreduce_example"

echo "consumers, by NCCL's names"
cmake -S tests/package -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" >"$work/consumer.log" ||
  fail "find_package(NCCL) / find_library(nccl)"
cmake --build "$work/consumer" >>"$work/consumer.log" 2>&1 || { cat "$work/consumer.log"; fail "the CMake consumer build"; }
export PKG_CONFIG_PATH=$lib/pkgconfig
[ "$(pkg-config --modversion nccl)" = "$(sed -n 's/^#define NCCL_MAJOR \([0-9]*\).*/\1/p;' include/nccl.h).$(
  sed -n 's/^#define NCCL_MINOR \([0-9]*\).*/\1/p' include/nccl.h).$(sed -n 's/^#define NCCL_PATCH \([0-9]*\).*/\1/p' include/nccl.h)" ] ||
  fail "nccl.pc's version is not the NCCL API level of nccl.h"
# shellcheck disable=SC2046
gcc -std=c99 tests/package/consumer.c -o "$work/consumer_pkgconfig" $(pkg-config --cflags --libs nccl)
gcc -std=c99 -I"$prefix/include" tests/package/consumer.c -o "$work/consumer_plain" -L"$lib" -lnccl
for p in "$work/consumer/consumer_package" "$work/consumer/consumer_find_library" "$work/consumer_pkgconfig"; do
  readelf -d "$p" | grep -q "NEEDED.*\[libnccl\.so\.2\]" || fail "$(basename "$p") does not need libnccl.so.2"
  env -u LD_LIBRARY_PATH "$p" | grep -q "all-reduce OK" || fail "$(basename "$p") did not run"
done
LD_LIBRARY_PATH=$lib "$work/consumer_plain" | grep -q "all-reduce OK" || fail "consumer_plain (-lnccl) did not run"

echo "consumers, by comm's names"
cmake -S bench -B "$work/bench_consumer" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/bench_consumer" --target allreduce_example >/dev/null
"$work/bench_consumer/allreduce_example" 3 4096 2 | grep -q "wrong elements: 0 OK" || fail "find_package(comm)"
# shellcheck disable=SC2046
gcc -std=c99 bench/allreduce_example.c -o "$work/ex_pc" $(pkg-config --cflags --libs comm)
"$work/ex_pc" 2 1000 2 | grep -q "wrong elements: 0 OK" || fail "pkg-config comm"

echo "a program built against another libnccl.so.2 runs on comm"
mkdir -p "$work/other"
gcc -shared -fPIC -Wl,-soname,libnccl.so.2 tests/package/nvidia_stub.c -o "$work/other/libnccl.so.2"
ln -s libnccl.so.2 "$work/other/libnccl.so"
gcc -std=c99 -I"$prefix/include" tests/package/consumer.c -o "$work/foreign" -L"$work/other" -lnccl
if LD_LIBRARY_PATH=$work/other "$work/foreign" >/dev/null 2>&1; then
  fail "the stand-in library was not the one the program was linked against"
fi
out=$(LD_LIBRARY_PATH=$lib NCCL_DEBUG=VERSION "$work/foreign" 2>&1) || { echo "$out" >&2; fail "foreign program on comm"; }
grep -q "all-reduce OK" <<<"$out" || fail "foreign program: $out"
grep -q "NCCL VERSION comm $(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1) (git " <<<"$out" ||
  { echo "$out" >&2; fail "the foreign program's log does not name comm and its version"; }

echo "package tests passed in $(($(date +%s) - start)) s"

# The Python wheel, which carries the library; first, as it makes the torch environment that
# the READMEs' Python examples run in where it is missing.
scripts/test_wheel.sh

# The READMEs' C and Python examples, compiled and run.
scripts/test_readme.sh

# The README's Quickstart lines and Slurm job, on the build above.
scripts/test_quickstart.sh "$work/build"
