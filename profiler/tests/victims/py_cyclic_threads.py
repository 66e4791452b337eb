"""py_cyclic_threads: an asyncio loop whose interpreter's thread-state list
loops back on itself, as a hostile (or memory-corrupted) target can make it.

At start the victim points its own PyThreadState's `next` at itself (ctypes,
its own memory): a profiler that walks `interp->threads` without a cycle
check never ends. CPython itself walks that list only at thread creation and
exit and at finalization, which this single-threaded victim avoids: on
SIGTERM it restores `next` before exiting.

Usage: python3 py_cyclic_threads.py LOG_PATH

Every 300 ms (asyncio.sleep, so the loop parks between stalls) it freezes the
loop with burn_cpu(0.1) (pure Python) then retry_with_sleep() (time.sleep(0.12)).
Log (JSON lines, flushed per line), as py_blocking_client's:
    {"kind":"ready","pid":P,"tid":T,"python":"3.12.x","cyclic":true}
    {"kind":"cpu"|"sleep","func":"burn_cpu"|"retry_with_sleep","seq":N,"tid":T,
     "start_ns":..,"end_ns":..,"cpu_ns":..}
start_ns/end_ns: time.monotonic_ns() around the call; cpu_ns: time.thread_time_ns().
Stdlib only; CPython 3.10-3.13 (PyThreadState starts with prev, next).
"""

import asyncio
import ctypes
import json
import signal
import sys
import threading
import time

log = open(sys.argv[1], "a", buffering=1)


def emit(**rec):
    log.write(json.dumps(rec) + "\n")


get_ts = ctypes.pythonapi.PyThreadState_Get
get_ts.restype = ctypes.c_void_p
TSTATE = get_ts()
NEXT = ctypes.c_void_p.from_address(TSTATE + 8)  # PyThreadState.next
ORIGINAL_NEXT = NEXT.value


def make_cycle():
    assert ORIGINAL_NEXT is None, "single-threaded: this thread state is the list's only node"
    NEXT.value = TSTATE


def restore_and_exit(*_):
    NEXT.value = ORIGINAL_NEXT
    emit(kind="done")
    log.flush()
    # os._exit skips nothing that needs the list (it is restored anyway).
    sys.exit(0)


def burn_cpu(seconds):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += sum(i * i for i in range(200))
    return n


def retry_with_sleep():
    time.sleep(0.12)


def timed(kind, func, seq, fn, *args):
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    fn(*args)
    end, cpu1 = time.monotonic_ns(), time.thread_time_ns()
    emit(kind=kind, func=func, seq=seq, tid=threading.get_native_id(),
         start_ns=start, end_ns=end, cpu_ns=cpu1 - cpu0)


async def main():
    make_cycle()
    emit(kind="ready", pid=__import__("os").getpid(), tid=threading.get_native_id(),
         python=sys.version.split()[0], cyclic=True)
    seq = 0
    while True:
        await asyncio.sleep(0.3)
        timed("cpu", "burn_cpu", seq, burn_cpu, 0.1)
        await asyncio.sleep(0.05)
        timed("sleep", "retry_with_sleep", seq, retry_with_sleep)
        seq += 1


signal.signal(signal.SIGTERM, restore_and_exit)
asyncio.run(main())
