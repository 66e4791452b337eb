#!/bin/bash
# What an idle watched target costs the host in agent activity: two
# stallprof binaries, interleaved rounds, each `record --pid` of a Python
# asyncio loop ticking every 5 ms (a service between requests; the same
# ticker as `cargo xtask bench --only host`); with MODE=daemon, the host
# daemon instead (which watches that ticker among everything else). Run as
# root on a quiet machine:
#   [MODE=daemon] bench/agent_wakeups.sh OLD_STALLPROF NEW_STALLPROF [ROUNDS] [SECONDS]
# Prints, per run, the agent's context switches per second (every thread's
# voluntary + involuntary, from /proc/PID/task/*/status: each one is a
# wake-up that lands on some CPU and delays what runs there) and its CPU
# (utime + stime, clock ticks of 10 ms) per second, measured over SECONDS
# after the first 5 s (attach and the 2 s of fast upkeep excluded).
set -euo pipefail
OLD=$1 NEW=$2 ROUNDS=${3:-3} SECS=${4:-10}
PY=${PY:-python3}
MODE=${MODE:-record}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
switches() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches/ { s += $2 } END { print s + 0 }'; }
ticks() { cat /proc/"$1"/task/*/stat 2>/dev/null | awk '{ s += $14 + $15 } END { print s + 0 }'; }
for _ in $(seq "$ROUNDS"); do
  for which in OLD NEW; do
    bin=${!which}
    "$PY" -c 'import asyncio
async def main():
    while True:
        await asyncio.sleep(0.005)
asyncio.run(main())' &
    target=$!
    sleep 1
    if [ "$MODE" = daemon ]; then
      "$bin" daemon --listen 127.0.0.1:0 --data-dir "$out/rec-$which" >/dev/null 2>&1 &
    else
      "$bin" record -q --pid "$target" --duration "$((SECS + 20))s" -o "$out/rec-$which" >/dev/null 2>&1 &
    fi
    agent=$!
    sleep 5
    s0=$(switches "$agent") t0=$(ticks "$agent")
    sleep "$SECS"
    s1=$(switches "$agent") t1=$(ticks "$agent")
    echo "$MODE $which wake-ups/s $(( (s1 - s0) / SECS )) cpu_ms/s $(( (t1 - t0) * 10 / SECS ))"
    kill -INT "$agent"
    wait "$agent" 2>/dev/null || true
    kill "$target"
    wait "$target" 2>/dev/null || true
    rm -rf "$out/rec-$which"
  done
done
