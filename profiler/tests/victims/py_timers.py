"""py_timers: an asyncio loop serving STREAMS streams on a fixed chunk
schedule (one chunk every PERIOD ms each, staggered), held up by planned
blocking sections, as in the field report's streaming gateway ("40 clients
hold open token streams, each expecting a chunk every 20 ms").

Each stream waits for its next chunk with
    await asyncio.sleep(due - time.monotonic())
so while it waits, its next chunk is one TimerHandle in the loop's
scheduled heap, due at `due`. When a blocking section holds the loop, the
timers due during it fire late; each chunk logs its due time and the time
its stream actually resumed, both on CLOCK_MONOTONIC (time.monotonic_ns()).
A chunk whose due time had already passed when its stream got to it had no
timer (asyncio.sleep of <= 0 yields without one): it is logged with
"timer": false.

Usage: python3 py_timers.py LOG_PATH [--uvloop] [--streams N] [--period-ms N]

Timeline: ~700 ms of streaming (the loop is found), then the 12 blocks below,
each followed by ~250 ms of streaming; one block runs with every stream
paused (awaiting an asyncio.Event: no timer pending); ~200 ms, exit 0.

Blocks (the driver task, between awaits):
    sleep  time.sleep of 120, 300, 150, 90, 200, 100 ms
    burn   a pure-Python CPU loop of 80, 200, 100, 120, 150 ms
    idle   time.sleep(0.12) while every stream is paused: no timer is due

Log (JSON lines; times are time.monotonic_ns()):
    {"kind":"ready","pid":P,"tid":T,"python":"3.11.7","loop":"asyncio"|"uvloop",
     "streams":N,"period_ns":..}
    {"kind":"block","how":"sleep"|"burn"|"idle","planned_ms":..,"start_ns":..,"end_ns":..}
    {"kind":"chunk","stream":I,"due_ns":..,"at_ns":..,"timer":bool}  (after the run)
    {"kind":"done"}

Stdlib only (uvloop with --uvloop); runs on CPython 3.10-3.15.
"""

import asyncio
import json
import os
import sys
import threading
import time


def arg(name, default):
    if name in sys.argv:
        return int(sys.argv[sys.argv.index(name) + 1])
    return default


LOG_PATH = sys.argv[1]
USE_UVLOOP = "--uvloop" in sys.argv
STREAMS = arg("--streams", 40)
PERIOD = arg("--period-ms", 20) / 1000.0

# Eleven blocks that delay chunks (a 90th percentile over them tolerates
# one whose chunks were also held up after it: the loop waiting for a CPU
# or busy right after a stall is no part of the stall) and the paused one.
BLOCKS = [
    ("sleep", 120),
    ("burn", 80),
    ("sleep", 300),
    ("burn", 200),
    ("idle", 120),
    ("sleep", 150),
    ("burn", 100),
    ("sleep", 90),
    ("burn", 120),
    ("sleep", 200),
    ("burn", 150),
    ("sleep", 100),
]

log_file = open(LOG_PATH, "w")


def log(rec):
    log_file.write(json.dumps(rec) + "\n")
    log_file.flush()


def burn(seconds):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


async def stream(i, chunks, running, stop):
    # Staggered over one period, so chunks come due all the time.
    due = time.monotonic() + PERIOD * (1 + i / STREAMS)
    while not stop.is_set():
        if not running.is_set():
            await running.wait()
            now = time.monotonic()
            due = now + PERIOD * (1 + i / STREAMS)  # resume on a fresh schedule
        delay = due - time.monotonic()
        await asyncio.sleep(delay)
        chunks.append((i, int(due * 1e9), time.monotonic_ns(), delay > 0))
        due += PERIOD


async def main():
    chunks = []
    running, stop = asyncio.Event(), asyncio.Event()
    running.set()
    loop = asyncio.get_running_loop()
    tasks = [
        asyncio.create_task(stream(i, chunks, running, stop), name=f"stream-{i}")
        for i in range(STREAMS)
    ]
    log(
        {
            "kind": "ready",
            "pid": os.getpid(),
            "tid": threading.get_native_id(),
            "python": sys.version.split()[0],
            "loop": type(loop).__module__.split(".")[0],
            "streams": STREAMS,
            "period_ns": int(PERIOD * 1e9),
        }
    )
    await asyncio.sleep(0.7)
    for how, ms in BLOCKS:
        if how == "idle":
            running.clear()
            await asyncio.sleep(4 * PERIOD)  # every stream parks on the Event
        t0 = time.monotonic_ns()
        if how == "burn":
            burn(ms / 1000.0)
        else:
            time.sleep(ms / 1000.0)
        t1 = time.monotonic_ns()
        log({"kind": "block", "how": how, "planned_ms": ms, "start_ns": t0, "end_ns": t1})
        running.set()
        await asyncio.sleep(0.25)
    stop.set()
    running.set()
    await asyncio.gather(*tasks)
    await asyncio.sleep(0.2)
    return chunks


if USE_UVLOOP:
    import uvloop

    chunks = uvloop.run(main())
else:
    chunks = asyncio.run(main())
for i, due, at, timer in chunks:
    log_file.write(
        json.dumps({"kind": "chunk", "stream": i, "due_ns": due, "at_ns": at, "timer": timer})
        + "\n"
    )
log({"kind": "done"})
