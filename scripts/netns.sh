#!/usr/bin/env bash
# Simulated hosts on one machine: network namespaces joined by veth pairs to a bridge that
# lives in a namespace of its own (nothing is added to the machine's own network). Host i gets
# address 10.77.<net>.<i+1>/24 on interface "eth0". Each host also has a PID, an IPC and a
# mount namespace of its own, held open by a sleeping process; ranks join all four with
# nsenter, so ranks of one host share them (and see each other's pids) and only the network
# links hosts.
#
#   scripts/netns.sh up PREFIX N [NET]     create PREFIX-sw and hosts PREFIX-0 .. PREFIX-(N-1)
#   scripts/netns.sh down PREFIX           remove every namespace named PREFIX-*
#   scripts/netns.sh exec PREFIX I CMD...  run CMD as a process of host I
#   scripts/netns.sh addr PREFIX I [NET]   print host I's address
#   scripts/netns.sh rate PREFIX I RATE    limit host I's link (tc tbf), e.g. 1gbit
#   scripts/netns.sh link PREFIX I up|down cut or restore host I's link
#
# Needs root (CI runs as root), iproute2 and util-linux's unshare.
set -euo pipefail

cmd=${1:?usage: netns.sh up|down|exec|addr|rate|link PREFIX ...}
prefix=${2:?PREFIX missing}

addr() { echo "10.77.${2:-0}.$(( $1 + 1 ))"; }
holder_file() { echo "${TMPDIR:-/tmp}/comm-netns-$1.pid"; }

case "$cmd" in
  up)
    n=${3:?N missing}
    net=${4:-0}
    sw="$prefix-sw"
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for ((i = 0; i < n; i++)); do
      h="$prefix-$i"
      ip netns add "$h"
      ip -n "$h" link set lo up
      # Created inside the host, so neither end ever appears in the machine's namespace.
      ip -n "$h" link add eth0 type veth peer name "p$i" netns "$sw"
      ip -n "$sw" link set "p$i" master br0
      ip -n "$sw" link set "p$i" up
      ip -n "$h" addr add "$(addr "$i" "$net")/24" dev eth0
      ip -n "$h" link set eth0 up
      # The host's PID, IPC and mount namespaces, held by a process that sleeps in them.
      ip netns exec "$h" unshare --pid --ipc --mount --fork --mount-proc sleep infinity \
        </dev/null >/dev/null 2>&1 &
      holder=""
      for _ in $(seq 100); do
        holder=$(pgrep -P $! 2>/dev/null | head -n 1 || true)
        [ -n "$holder" ] && break
        sleep 0.02
      done
      [ -n "$holder" ] || { echo "netns.sh: host $i's namespaces did not start" >&2; exit 1; }
      echo "$holder" > "$(holder_file "$h")"
    done
    ;;
  down)
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^${prefix}-" || true); do
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
      ip netns del "$ns" || true
      rm -f "$(holder_file "$ns")"
    done
    ;;
  exec)
    i=${3:?I missing}
    shift 3
    holder=$(cat "$(holder_file "$prefix-$i")")
    exec nsenter --target "$holder" --net --pid --ipc --mount --wd="$PWD" "$@"
    ;;
  addr)
    addr "${3:?I missing}" "${4:-0}"
    ;;
  rate)
    i=${3:?I missing}
    rate=${4:?RATE missing}
    tc -n "$prefix-$i" qdisc replace dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
    ;;
  link)
    i=${3:?I missing}
    ip -n "$prefix-$i" link set eth0 "${4:?up or down}"
    ;;
  *)
    echo "netns.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
