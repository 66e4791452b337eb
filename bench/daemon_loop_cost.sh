#!/bin/bash
# What an epoll loop pays per iteration while the daemon runs on the host,
# watched or left out by its rules. Run as root on a quiet machine:
#   [LEFT_OUT=include|exclude] bench/daemon_loop_cost.sh STALLPROF [ROUNDS]
# Per round: bench/loop_cost (2 s on CPU 0, median of its 100 ms windows)
# bare, then with `stallprof daemon` running; ns per iteration. With
# LEFT_OUT the daemon's rules leave the loop out: `include`, an
# [[include]] that matches nothing (the wait uprobes go on the included
# processes only); `exclude`, an [[exclude]] of its comm (the uprobes on
# each C library file, for every process). (LEFT_OUT=1 is `include`.)
set -euo pipefail
SP=$1 ROUNDS=${2:-5}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -o "$work/loop_cost" "$here/loop_cost.c"
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
once() { taskset -c 0 "$work/loop_cost" 2 | awk '/ns_per_iter/ {print $2}' | median; }
config=()
case "${LEFT_OUT:-}" in
  1|include) printf '[[include]]\ncomm = "stallprof-matches-nothing"\n' > "$work/config.toml" ;;
  exclude) printf '[[exclude]]\ncomm = "loop_cost"\n' > "$work/config.toml" ;;
  "") ;;
  *) echo "LEFT_OUT must be include or exclude, not ${LEFT_OUT}" >&2; exit 2 ;;
esac
[ -f "$work/config.toml" ] && config=(--config "$work/config.toml")
for r in $(seq "$ROUNDS"); do
  bare=$(once)
  "$SP" daemon "${config[@]}" --data-dir "$work/data" --listen 127.0.0.1:19436 >/dev/null 2>&1 &
  daemon=$!
  sleep 3
  watched=$(once)
  kill -INT "$daemon"
  wait "$daemon" || true
  echo "round $r: bare $bare ns, daemon running $watched ns per iteration"
done
