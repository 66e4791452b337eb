#!/bin/bash
# The agent's CPU while it records an idle Node loop: two stallprof
# binaries, interleaved rounds. Run as root on a quiet machine:
#   bench/agent_cpu_idle_node.sh OLD_STALLPROF NEW_STALLPROF [ROUNDS] [SECONDS]
# Prints, per run, the binary and the agent's user and system seconds
# (/usr/bin/time) over the recording, attach and detach included.
set -euo pipefail
OLD=$1 NEW=$2 ROUNDS=${3:-3} SECS=${4:-20}
NODE=${NODE:-/usr/bin/node}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for _ in $(seq "$ROUNDS"); do
  for which in OLD NEW; do
    bin=${!which}
    "$NODE" -e 'setInterval(() => {}, 10)' &
    node_pid=$!
    sleep 0.5
    /usr/bin/time -f "$which user %U s, sys %S s" -o "$out/time" \
      "$bin" record --pid "$node_pid" --duration "${SECS}s" -o "$out/rec-$which" >/dev/null 2>&1 || true
    cat "$out/time"
    kill "$node_pid"
    wait "$node_pid" 2>/dev/null || true
  done
done
