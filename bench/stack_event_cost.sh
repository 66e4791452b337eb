#!/bin/bash
# What a stack event costs in the watched thread: the mean run time of the
# sampling (sp_sample) and switch-out (sp_thread_switch) programs, from
# kernel.bpf_stats_enabled, OLD vs NEW, interleaved. Run as root on a quiet
# machine, after `cargo xtask setup --tests` (the express victim's packages):
#   bench/stack_event_cost.sh OLD_STALLPROF NEW_STALLPROF [ROUNDS]
# Per round and binary, `record --threshold 20ms` of two victims, stats read
# 6 s in: a Python asyncio loop whose 100 ms CPU stalls run 40 Python calls
# deep (shallow C stack, 40 Python frames to read), and the express victim
# (profiler/tests/victims/express: Node's deep stacks, 20–60 KiB of them).
set -euo pipefail
OLD=$1 NEW=$2 ROUNDS=${3:-3}
PY=${PY:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
modules=$root/target/express-victim/node_modules
[ -d "$modules/express" ] || { echo "$modules is missing: run cargo xtask setup --tests" >&2; exit 1; }
work=$(mktemp -d)
stats_was=$(cat /proc/sys/kernel/bpf_stats_enabled)
trap 'kill $(jobs -p) 2>/dev/null; sysctl -q kernel.bpf_stats_enabled=$stats_was; rm -rf "$work"' EXIT
mkdir "$work/app"
cp "$root"/profiler/tests/victims/express/{app.js,client.js,package.json} "$work/app/"
ln -s "$modules" "$work/app/node_modules"
cat > "$work/loop.py" <<'PY'
import asyncio, time
def deep(n):
    if n == 0:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.1:
            pass
        return
    return deep(n - 1)
async def main():
    end = time.time() + 8
    while time.time() < end:
        deep(40)
        await asyncio.sleep(0.1)
asyncio.run(main())
PY
sysctl -q kernel.bpf_stats_enabled=1
stats() {
    bpftool -j prog show | python3 -c '
import json, sys
for p in json.load(sys.stdin):
    n = p.get("name", "")
    if n.startswith(("sp_sample", "sp_thread_swi")) and p.get("run_cnt", 0):
        print(n, p["run_cnt"], p["run_time_ns"])'
}
for r in $(seq "$ROUNDS"); do
    for which in OLD NEW; do
        bin=$OLD; [ "$which" = NEW ] && bin=$NEW
        for victim in python node; do
            if [ "$victim" = python ]; then
                (cd "$work" && "$bin" record --threshold 20ms -o "$work/out" -- "$PY" loop.py >/dev/null 2>&1) &
            else
                (cd "$work/app" && "$bin" record --threshold 20ms -o "$work/out" -- node app.js "$work/log.jsonl" >/dev/null 2>&1) &
            fi
            rec=$!
            sleep 6
            stats > "$work/stats"
            wait $rec
            while read -r prog runs ns; do
                printf 'round %d %s %-6s %-16s runs %6d  %6.0f ns/run\n' "$r" "$which" "$victim" "$prog" "$runs" "$(echo "$ns / $runs" | bc -l)"
            done < "$work/stats"
        done
    done
done
