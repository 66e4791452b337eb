#!/bin/bash
# How long `stallprof daemon` takes to stop (SIGTERM to exit) with N
# processes carrying their own wait uprobes: each process's 14 links take
# ~1.3 s to detach, one link at a time in the kernel (docs/daemon.md).
# Run as root on a quiet machine:
#   bench/daemon_stop_time.sh STALLPROF N [N ...]
# Per N: N copies of `sleep` named `sp-sleeper`, a daemon whose only rule
# includes them, 4 s to probe them, then SIGTERM; seconds to exit.
set -euo pipefail
SP=$1; shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp /bin/sleep "$work/sp-sleeper"
printf '[[include]]\ncomm = "sp-sleeper"\n' > "$work/config.toml"
for n in "$@"; do
  pids=()
  for _ in $(seq "$n"); do "$work/sp-sleeper" 600 & pids+=($!); done
  "$SP" daemon --config "$work/config.toml" --data-dir "$work/data" --listen 127.0.0.1:19438 >/dev/null 2>&1 &
  daemon=$!
  sleep 4
  t0=$(date +%s%N)
  kill -TERM "$daemon"
  wait "$daemon" || true
  t1=$(date +%s%N)
  echo "$n probed processes: stopped in $(( (t1 - t0) / 1000000 )) ms"
  [ "$n" -gt 0 ] && kill "${pids[@]}"
  wait 2>/dev/null || true
done
