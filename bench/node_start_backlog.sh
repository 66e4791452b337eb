#!/bin/bash
# How far the ring buffer's reader falls behind a busy Node start: two
# stallprof binaries, interleaved rounds. Run as root on a quiet machine,
# after `cargo xtask setup --tests` (it installs the express victim's
# pinned node_modules in target/express-victim):
#   bench/node_start_backlog.sh OLD_STALLPROF NEW_STALLPROF [ROUNDS]
# The target: the express test's victim (tests/victims/express/app.js,
# ~1 s of busy start loading express, then stalls), launched by `record`.
# Per run it prints the binary; the largest backlog one drain found ("ring
# buffer: at most ... KiB waiting", `-v`; the ring is 8 MiB on 2 CPUs);
# events lost; JavaScript frames unreadable; stacks that got no JavaScript
# frames because V8 was still being looked for; and whether the waits fell
# back to the host-wide syscall tracepoints.
set -euo pipefail
OLD=$(realpath "$1") NEW=$(realpath "$2") ROUNDS=${3:-8}
NODE=${NODE:-/usr/bin/node}
root=$(cd "$(dirname "$0")/.." && pwd)
modules=$root/target/express-victim/node_modules
[ -d "$modules/express" ] || { echo "$modules is missing: run cargo xtask setup --tests" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$root"/profiler/tests/victims/express/{app.js,client.js,package.json} "$work/"
ln -s "$modules" "$work/node_modules"
cd "$work"
counter() { grep -o "$1=[0-9]*" "$2" | cut -d= -f2 || echo 0; }
for r in $(seq "$ROUNDS"); do
  for which in OLD NEW; do
    bin=${!which}
    "$bin" -v record --threshold 20ms -o "rec-$r-$which" -- "$NODE" app.js "victim-$r-$which.jsonl" >log 2>&1
    backlog=$(grep -o 'at most [0-9]* KiB' log | awk '{print $3}')
    lost=$(counter ringbuf_full log)
    fallback=$(grep -c 'falling back to the wait syscalls' log || true)
    echo "$which backlog ${backlog} KiB, lost ${lost}, js_frames_unreadable $(counter js_frames_unreadable log), js_frames_v8_pending $(counter js_frames_v8_pending log), waits fell back ${fallback}"
  done
done
