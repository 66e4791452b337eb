#!/usr/bin/env python3
"""What an unwatched process pays while an agent runs, measured against a
drifting machine: ONE long `host_cost` run (bench/host_cost.c, pinned to
CPU 1) while the agent is started and stopped around it, phase after phase.

Usage (root):
  bench/host_alternate.py HOST_COST MODE AGENT [CYCLES] [PHASE_S]
    MODE:  pipe | syscall | both (host_cost's modes)
    AGENT: "record[+PROBES]:BIN" | "daemon[+PROBES]:BIN" | "perf-…"
           record:BIN  BIN record --pid TICKER (default probes; with
                       +PROBES, `--probes PROBES`)
           daemon:BIN  BIN daemon (host-wide, on a free port)
           perf-cs     perf stat -e context-switches -t TICKER_TID
                       (the kernel's perf hooks alone, no BPF, no agent)
           perf-clock  perf stat -e cpu-clock -t TICKER_TID
           perf-tp     perf stat -e sched:sched_switch -t TICKER_TID (a
                       per-thread tracepoint event, no BPF)
           perf-switch perf record --switch-events -e cpu-clock -t TICKER_TID
                       (PERF_RECORD_SWITCH side-band records)

Why: on a shared VM the host's speed drifts by 20-40% over tens of
seconds (neighbours' caches and memory bandwidth; host_cost's CPU clock
moves with its wall clock, so it is not steal). Runs of one configuration
after another compare different machines. Here each "on" phase is
compared with the "off" phases just before and after it, and each phase
is summarised by the 25th percentile of its 100 ms windows (the
neighbours' bursts add time to some windows; a cost per context switch
moves all of them).

Windows are used only while the state is settled: "on" from 1 s after the
agent says its probes are attached to the stop signal; "off" from 1.5 s
after the agent exited (perf switches its scheduler hooks off 1 s after
the last per-thread event closes) to the next start.

Prints, per measure, each cycle's on/off ratio, then a line
"result MEASURE MEDIAN MIN MAX CYCLES" (added %, over the cycles), which
`cargo xtask bench --only host` reads.
"""
import atexit
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

TICKER = """import asyncio
async def main():
    while True:
        await asyncio.sleep(0.005)
asyncio.run(main())
"""


def q25(v):
    v = sorted(v)
    return v[len(v) // 4]


def main():
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    host_cost, mode, agent = sys.argv[1:4]
    cycles = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    phase = float(sys.argv[5]) if len(sys.argv) > 5 else 5.0
    keys = {"pipe": ["us_per_round_trip"], "syscall": ["ns_per_syscall"],
            "both": ["ns_per_syscall", "us_per_round_trip"]}[mode]

    scratch = tempfile.mkdtemp(prefix="host_alternate.")
    # Whatever this script started goes with it, however it ends.
    started = []
    atexit.register(lambda: [x.kill() for x in started if x.poll() is None])
    atexit.register(shutil.rmtree, scratch, True)
    ticker = subprocess.Popen([sys.executable, "-c", TICKER])
    started.append(ticker)
    time.sleep(1.0)
    # Killed when the phases are done; long enough for slow starts.
    total = cycles * (2 * phase + 60) + 60
    hc = subprocess.Popen(
        ["taskset", "-c", "1", host_cost, mode, str(total)],
        stdout=subprocess.PIPE,
        text=True,
    )
    started.append(hc)
    windows = {k: [] for k in keys}  # key -> [(end time, value)]

    def read():
        for line in hc.stdout:
            k, _, v = line.partition(" ")
            if k in windows:
                windows[k].append((time.monotonic(), float(v)))

    threading.Thread(target=read, daemon=True).start()

    def start_agent():
        kind, _, binary = agent.partition(":")
        kind, _, probes = kind.partition("+")
        choice = ["--probes", probes] if probes else []
        if kind == "record":
            cmd = [binary, "-v", "record", "-q", *choice, "--pid", str(ticker.pid),
                   "-o", os.path.join(scratch, "out")]
            ready = "attached to"
        elif kind == "daemon":
            cmd = [binary, "-v", "daemon", *choice, "--listen", "127.0.0.1:0",
                   "--data-dir", os.path.join(scratch, "data")]
            ready = "probes attached host-wide"
        elif kind in ("perf-cs", "perf-clock", "perf-tp"):
            ev = {"perf-cs": "context-switches", "perf-clock": "cpu-clock",
                  "perf-tp": "sched:sched_switch"}[kind]
            cmd = ["perf", "stat", "-e", ev, "-t", str(ticker.pid)]
            ready = None
        elif kind == "perf-switch":
            cmd = ["perf", "record", "-q", "--switch-events", "-e", "cpu-clock",
                   "-F", "99", "-t", str(ticker.pid), "-o", os.path.join(scratch, "perf.data")]
            ready = None
        else:
            sys.exit(f"unknown agent {agent}")
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        started.append(p)
        if ready:
            for line in p.stderr:
                if ready in line:
                    break
            else:
                sys.exit(f"{agent}: exited before '{ready}'")
            threading.Thread(target=lambda: p.stderr.read(), daemon=True).start()
        else:
            time.sleep(0.5)
            if p.poll() is not None:
                sys.exit(f"{agent}: exited at start ({p.returncode}): {p.stderr.read()}")
            threading.Thread(target=lambda: p.stderr.read(), daemon=True).start()
        return p

    phases = []  # (state, start, end)
    time.sleep(2.0)  # host_cost's own start
    t = time.monotonic()
    time.sleep(phase)
    phases.append(("off", t, time.monotonic()))
    for n in range(cycles):
        print(f"cycle {n}: starting {agent}", file=sys.stderr, flush=True)
        p = start_agent()
        t = time.monotonic() + 1.0
        time.sleep(1.0 + phase)
        phases.append(("on", t, time.monotonic()))
        if p.poll() is not None:
            sys.exit(f"{agent}: exited during its phase ({p.returncode})")
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
        print(f"cycle {n}: {agent} exited", file=sys.stderr, flush=True)
        t = time.monotonic() + 1.5
        time.sleep(1.5 + phase)
        phases.append(("off", t, time.monotonic()))
    hc.kill()
    ticker.kill()

    def summary(key, start, end):
        v = [x for (at, x) in windows[key] if at - 0.1 >= start and at <= end]
        return q25(v) if len(v) >= 5 else None

    for key in keys:
        ratios = []
        for i in range(1, len(phases) - 1, 2):
            before = summary(key, *phases[i - 1][1:])
            on = summary(key, *phases[i][1:])
            after = summary(key, *phases[i + 1][1:])
            if None in (before, on, after):
                print(f"{key} cycle {i // 2}: too few windows")
                continue
            r = on / ((before + after) / 2)
            ratios.append(r)
            print(f"{key} cycle {i // 2}: off {before:.3f} on {on:.3f} off {after:.3f}  "
                  f"{100 * (r - 1):+.1f}%")
        if not ratios:
            sys.exit(f"{key}: no cycle had enough windows")
        added = [100 * (r - 1) for r in ratios]
        print(f"result {key} {statistics.median(added):+.2f} {min(added):+.2f} "
              f"{max(added):+.2f} {len(added)}")


if __name__ == "__main__":
    main()
