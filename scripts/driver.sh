# Sourced by the scripts that fork ranks from a C driver in bench/ (scale_bench.sh,
# scale_netns.sh, cost_model_check.sh).

# build_driver SRC BIN LIB: compiles bench/SRC into BIN against LIB/libcomm.so, found at run time
# through the rpath. Rebuilt when the source is newer or the library directory is another one
# (a driver left from a run on another build would load that build).
build_driver() {
  local src=$1 bin=$2 lib=$3
  if [ ! -x "$bin" ] || [ "$src" -nt "$bin" ] || [ "$(cat "$bin.lib" 2>/dev/null)" != "$lib" ]; then
    cc -O2 -Wall -Wextra -o "$bin" "$src" -I"$ROOT/include" -L"$lib" -lcomm -Wl,-rpath,"$lib"
    echo "$lib" >"$bin.lib"
  fi
}

# raise_fd_limit MAX_RANKS: each rank holds a few descriptors per peer (sockets, memfds,
# pidfds) when it connects eagerly; a job of 1024 ranks needs more than the usual limit. Raises
# what it may and says what it cannot.
raise_fd_limit() {
  local want=$(($1 * 8 + 1024))
  if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt "$want" ]; then
    ulimit -n "$want" 2>/dev/null || ulimit -n "$(ulimit -Hn)" ||
      echo "warning: ulimit -n is $(ulimit -n), ranks may need $want" >&2
  fi
}
