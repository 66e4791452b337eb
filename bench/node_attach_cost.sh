#!/bin/bash
# What attaching to a Node process costs, and how soon its stacks get
# JavaScript frames: two stallprof binaries, interleaved rounds. Run as
# root on a quiet machine:
#   bench/node_attach_cost.sh OLD_STALLPROF NEW_STALLPROF [ROUNDS] [SECONDS]
# The target: Node that spins 100 ms every 300 ms (a stall each time),
# started 1 s before the attach. Per run it prints the binary; the attach
# time (its "attached to" line); how long after the attach V8's metadata
# was read ("JavaScript frames from memory": until then a stack gets no
# JavaScript frames); the stacks that missed them (js_frames_v8_pending);
# and the agent's user and system seconds over the recording (/usr/bin/time).
set -euo pipefail
OLD=$1 NEW=$2 ROUNDS=${3:-3} SECS=${4:-3}
NODE=${NODE:-/usr/bin/node}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
cat > "$work/spin.js" <<'JS'
function spin(ms) { const t = Date.now(); while (Date.now() - t < ms) {} }
setInterval(() => spin(100), 300);
JS
# Seconds since midnight of a log line's UTC timestamp.
stamp() { grep -o 'T[0-9:.]*Z' | head -1 | tr -d 'TZ' | awk -F: '{printf "%.3f\n", $1*3600+$2*60+$3}'; }
for r in $(seq "$ROUNDS"); do
  for which in OLD NEW; do
    bin=${!which}
    "$NODE" "$work/spin.js" &
    pid=$!
    sleep 1
    /usr/bin/time -f "%U %S" -o "$work/time" \
      "$bin" -v record --pid "$pid" --duration "${SECS}s" -o "$work/rec-$r-$which" >"$work/log" 2>&1 || true
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    attach_ms=$(grep -o 'attached to [0-9]* in [0-9]* ms' "$work/log" | awk '{print $5}')
    t_attach=$(grep 'attached to' "$work/log" | stamp)
    t_v8=$(grep 'JavaScript frames from memory' "$work/log" | stamp || true)
    v8_ms=$(awk -v a="$t_attach" -v b="$t_v8" 'BEGIN { if (b == "") print "never"; else printf "%.0f", (b - a) * 1000 }')
    pending=$(grep -o 'js_frames_v8_pending=[0-9]*' "$work/log" | cut -d= -f2 || true)
    read -r user sys < <(tail -1 "$work/time")
    echo "$which attach ${attach_ms} ms, V8 read ${v8_ms} ms after it, stacks without JS frames ${pending:-0}, agent user ${user} s sys ${sys} s"
  done
done
