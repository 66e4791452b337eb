"""py_gil: an asyncio loop that does nothing blocking itself, frozen by a
worker thread ("gil-hog") that holds the GIL in ONE long C call: re.match of a
catastrophic-backtracking pattern. CPython's regex engine (_sre) never
releases the GIL while matching, so whenever the loop thread wakes up from
epoll_wait during a match it waits for the GIL until the match ends. The
loop's stalls are then GIL waits, and the holder is hog() in this file.

Usage: python3 py_gil.py LOG_PATH [--rounds N] [--target-ms MS]

Timeline: calibrate the subject length so one match takes ~target (default
220 ms, kept within 100-300 ms), ~400 ms idle (attach), then N (default 6)
rounds of: hog() (one re.match), time.sleep(0.15) (GIL released, the loop
catches up). Meanwhile the loop runs a 10 ms heartbeat. ~200 ms idle, exit 0.

Log (JSON lines, flushed per line, written under a lock; time.monotonic_ns()):
    {"kind":"ready","pid":P,"tid":T,"python":"3.11.7","file":ABS,"hog_tid":H,
     "hog":{"name":"hog","qualname":"hog","first_line":..,"last_line":..,"block_line":..},
     "subject_len":N,"calibrated_ms":..}
    {"kind":"regex","round":R,"tid":H,"start_ns","end_ns","cpu_ns","line"}   (the worker)
    {"kind":"late","tid":T,"start_ns","end_ns","late_ns"}  a heartbeat that woke
        >= 20 ms late: start_ns = when it was due, end_ns = when it ran (the loop)
    {"kind":"done"}

Stdlib only; runs on pyenv 3.10-3.13 and Debian's /usr/bin/python3.11.
"""

import asyncio
import ctypes
import inspect
import json
import os
import re
import sys
import threading
import time

PATTERN = re.compile(r"(a+)+$")
HEARTBEAT_S = 0.010
PAUSE_S = 0.15


class Log:
    def __init__(self, path):
        self.f = open(path, "w")
        self.lock = threading.Lock()

    def write(self, **rec):
        with self.lock:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()


def hog(subject):
    """Holds the GIL for the whole match: _sre does not release it."""
    return PATTERN.match(subject)  # BLOCKS


def describe_hog():
    lines, first = inspect.getsourcelines(hog)
    hits = [first + i for i, text in enumerate(lines) if text.rstrip().endswith("# BLOCKS")]
    assert len(hits) == 1 and "PATTERN.match(" in lines[hits[0] - first], "hog's # BLOCKS line moved"
    return {"name": hog.__name__, "qualname": hog.__qualname__, "first_line": first,
            "last_line": first + len(lines) - 1, "block_line": hits[0]}


def calibrate(target_ms):
    """Each extra 'a' doubles the backtracking: time one length, scale.
    Timed in thread CPU time, which a loaded machine inflates far less than
    wall time."""
    def cost(n):
        best = float("inf")
        for _ in range(2):
            c0 = time.thread_time_ns()
            hog("a" * n + "b")
            best = min(best, (time.thread_time_ns() - c0) / 1e6)
        return best

    n = 14
    ms = cost(n)
    while ms < 15 and n < 40:
        n += 1
        ms = cost(n)
    while ms * 2 <= target_ms and n < 40:
        n, ms = n + 1, ms * 2
    while ms > 300 * 0.8 and n > 10:
        n, ms = n - 1, ms / 2
    return n, ms


def set_os_thread_name(name):
    """CPython < 3.14 names threads only in `threading`; name the OS thread
    (its /proc comm) too, as threadpool libraries do, so tools see it."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(15, name.encode()[:15], 0, 0, 0) == 0, "prctl(PR_SET_NAME) failed"  # 15 = PR_SET_NAME


def worker(log, subject, rounds, hog_info, started):
    set_os_thread_name(threading.current_thread().name)
    log.hog_tid = threading.get_native_id()
    started.set()
    time.sleep(0.4)
    for r in range(rounds):
        t0, c0 = time.monotonic_ns(), time.thread_time_ns()
        m = hog(subject)
        t1, c1 = time.monotonic_ns(), time.thread_time_ns()
        assert m is None
        log.write(kind="regex", round=r, tid=threading.get_native_id(), start_ns=t0, end_ns=t1,
                  cpu_ns=c1 - c0, line=hog_info["block_line"])
        time.sleep(PAUSE_S)


async def heartbeat(log):
    loop = asyncio.get_running_loop()
    tid = threading.get_native_id()
    while True:
        due = time.monotonic_ns() + int(HEARTBEAT_S * 1e9)
        await asyncio.sleep(HEARTBEAT_S)
        now = time.monotonic_ns()
        if now - due >= 20_000_000:
            log.write(kind="late", tid=tid, start_ns=due, end_ns=now, late_ns=now - due)


async def main(log, t):
    hb = asyncio.create_task(heartbeat(log))
    while t.is_alive():
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    hb.cancel()
    log.write(kind="done")


def parse_args(argv):
    if len(argv) < 2 or argv[1].startswith("-"):
        sys.exit("usage: py_gil.py LOG_PATH [--rounds N] [--target-ms MS]")
    log_path, rounds, target = argv[1], 6, 220.0
    rest = argv[2:]
    while rest:
        flag = rest.pop(0)
        if flag == "--rounds" and rest:
            rounds = int(rest.pop(0))
        elif flag == "--target-ms" and rest:
            target = float(rest.pop(0))
        else:
            sys.exit(f"py_gil.py: unknown argument {flag!r}")
    return log_path, rounds, target


if __name__ == "__main__":
    log_path, rounds, target = parse_args(sys.argv)
    hog_info = describe_hog()
    n, ms = calibrate(target)
    log = Log(log_path)
    started = threading.Event()
    t = threading.Thread(target=worker, args=(log, "a" * n + "b", rounds, hog_info, started), name="gil-hog")
    t.start()
    started.wait()
    log.write(kind="ready", pid=os.getpid(), tid=threading.get_native_id(),
              python=".".join(map(str, sys.version_info[:3])), file=os.path.abspath(__file__),
              hog_tid=log.hog_tid, hog=hog_info, subject_len=n, calibrated_ms=round(ms, 2))
    asyncio.run(main(log, t))
