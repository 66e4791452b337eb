#!/bin/bash
# What the daemon spends on a busy event loop its rules leave out. Run as
# root on a quiet machine:
#   bench/daemon_left_out.sh OLD_STALLPROF NEW_STALLPROF [ROUNDS]
# Per round and binary: a Python asyncio loop on CPU 1 that spins 60 ms
# after each 10 ms sleep (a stall every iteration), then the daemon with
# one rule that matches nothing ([[include]] comm = "stallprof-matches-
# nothing"); after 4 s, the daemon's utime+stime over 10 s, its VmHWM, and
# the loop's median spin rate (iterations of its spin per second: what the
# loop got done).
set -euo pipefail
OLD=$1 NEW=$2 ROUNDS=${3:-3}
PY=${PY:-python3}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
cat > "$work/loop.py" <<'PY'
import asyncio, time
def spin(s):
    end, n = time.monotonic() + s, 0
    while time.monotonic() < end:
        n += 1
    return n
async def main():
    total, last = 0, time.monotonic()
    while True:
        await asyncio.sleep(0.01)
        total += spin(0.06)
        now = time.monotonic()
        if now - last >= 1.0:
            print(f"rate {total / (now - last):.0f}", flush=True)
            total, last = 0, now
asyncio.run(main())
PY
printf '[[include]]\ncomm = "stallprof-matches-nothing"\n' > "$work/config.toml"
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
once() {
  local bin=$1 label=$2
  taskset -c 1 "$PY" "$work/loop.py" > "$work/loop.log" &
  local loop=$!
  sleep 1
  "$bin" daemon --config "$work/config.toml" --data-dir "$work/data" \
    --listen 127.0.0.1:19437 > /dev/null 2>&1 &
  local d=$!
  sleep 4
  local t0 n0 t1 n1 rss
  t0=$(awk '{print $14+$15}' /proc/$d/stat); n0=$(wc -l < "$work/loop.log")
  sleep 10
  t1=$(awk '{print $14+$15}' /proc/$d/stat); n1=$(wc -l < "$work/loop.log")
  rss=$(awk '/VmHWM/ {print $2}' /proc/$d/status)
  kill -INT $d; wait $d || true
  kill $loop; wait $loop 2>/dev/null || true
  local rate
  rate=$(sed -n "$((n0 + 1)),${n1}p" "$work/loop.log" | awk '{print $2}' | median)
  echo "$label: daemon CPU $(( (t1 - t0) * 1000 / $(getconf CLK_TCK) )) ms per 10 s, VmHWM $((rss / 1024)) MiB; loop spin rate $rate/s"
}
for r in $(seq "$ROUNDS"); do
  once "$OLD" "round $r old"
  once "$NEW" "round $r new"
done
