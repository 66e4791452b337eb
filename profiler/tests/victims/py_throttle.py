"""py_throttle: an asyncio loop whose callbacks burn CPU, for the CPU-quota
and CPU-contention tests. Run it in a cgroup with a small CFS quota and its
stalls are mostly the kernel throttling it; pin it to a CPU a
higher-priority busy process also runs on, and they are run-queue waits.

Usage: python3 py_throttle.py LOG_PATH GO_PATH [--rounds N] [--burn-ms MS] [--gap-ms MS]
                                                [--settle-ms MS]

Timeline: the loop runs a 10 ms heartbeat and waits (idle) until the file
GO_PATH exists (the test creates it once the profiler is attached), idles
--settle-ms more (default 200: the profiler finds the loop's wait), then N
(default 8) rounds of: burn() — spin until this thread has used MS
(default 30) ms of CPU — then asyncio.sleep(gap, default 150 ms). Then
"done" and exit 0.

Log (JSON lines, flushed per line; time.monotonic_ns()):
    {"kind":"ready","pid":P,"tid":T,"python":"3.11.7"}
    {"kind":"burn","round":R,"tid":T,"func":"burn","start_ns","end_ns","cpu_ns"}
    {"kind":"late","tid":T,"start_ns","end_ns","late_ns"}  a heartbeat that ran
        >= 2 ms after it was due: start_ns = when it was due, end_ns = when it ran
        (the lag an in-process lag monitor sees)
    {"kind":"done"}

Stdlib only.
"""

import asyncio
import json
import os
import sys
import threading
import time

HEARTBEAT_S = 0.010
LATE_NS = 2_000_000


class Log:
    def __init__(self, path):
        self.f = open(path, "w")

    def write(self, **rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def burn(cpu_ns):
    """Spins until this thread has used cpu_ns of CPU time."""
    t0 = time.thread_time_ns()
    x = 0
    while time.thread_time_ns() - t0 < cpu_ns:
        for _ in range(200):
            x += 1
    return x


async def heartbeat(log, tid, stop):
    due = time.monotonic_ns() + int(HEARTBEAT_S * 1e9)
    while not stop.is_set():
        await asyncio.sleep(max(0, due - time.monotonic_ns()) / 1e9)
        now = time.monotonic_ns()
        if now - due >= LATE_NS:
            log.write(kind="late", tid=tid, start_ns=due, end_ns=now, late_ns=now - due)
        # The next beat is due a period after this one ran: each lateness
        # is measured once.
        due = now + int(HEARTBEAT_S * 1e9)


async def main(log, go, rounds, burn_ms, gap_ms, settle_ms):
    tid = threading.get_native_id()
    log.write(kind="ready", pid=os.getpid(), tid=tid, python=sys.version.split()[0])
    stop = asyncio.Event()
    beat = asyncio.create_task(heartbeat(log, tid, stop))
    while not os.path.exists(go):
        await asyncio.sleep(0.02)
    await asyncio.sleep(settle_ms / 1000)
    for r in range(rounds):
        start = time.monotonic_ns()
        c0 = time.thread_time_ns()
        burn(burn_ms * 1_000_000)
        log.write(
            kind="burn",
            round=r,
            tid=tid,
            func="burn",
            start_ns=start,
            end_ns=time.monotonic_ns(),
            cpu_ns=time.thread_time_ns() - c0,
        )
        await asyncio.sleep(gap_ms / 1000)
    stop.set()
    await beat
    log.write(kind="done")


def arg(name, default):
    if name in sys.argv:
        return int(sys.argv[sys.argv.index(name) + 1])
    return default


if __name__ == "__main__":
    asyncio.run(
        main(
            Log(sys.argv[1]),
            sys.argv[2],
            arg("--rounds", 8),
            arg("--burn-ms", 30),
            arg("--gap-ms", 150),
            arg("--settle-ms", 200),
        )
    )
