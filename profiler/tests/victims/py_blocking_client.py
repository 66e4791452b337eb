"""py_blocking_client: an asyncio loop frozen by synchronous calls made inside
`async def` -- a blocking socket client, a time.sleep() retry, and pure-Python
CPU work -- with the victim's own time.monotonic_ns() log as the ground truth.

The blocking client is the interesting one: socket.create_connection(...,
timeout=2) + recv() make CPython wait with poll() on that one socket, inside
the stall. A profiler must not mistake that poll() for the loop parking; the
whole call is ONE stall.

Usage: python3 py_blocking_client.py LOG_PATH [--start-file PATH] [--rounds N] [--linger]

Timeline: ~300 ms idle (attach), [wait for --start-file], then every 300 ms
(asyncio.sleep, so the loop parks between stalls):
    fetch_blocking() x N (default 4), then retry_with_sleep() (time.sleep(0.12)),
    then burn_cpu(0.1) (pure Python), then ~200 ms idle and exit 0. With
    --linger it stays, idle (the loop parked), after "done" until killed: a
    profiler that fell behind on a loaded machine still reads the code objects
    of its last stalls from its memory.
A heartbeat task ticks every 10 ms, as an event loop with other work would.

Log (JSON lines, flushed per line):
    {"kind":"ready","pid":P,"tid":T,"python":"3.11.7"}
    {"kind":"blocking_client"|"sleep"|"cpu","func":"fetch_blocking"|"retry_with_sleep"|"burn_cpu",
     "seq":N,"tid":T,"start_ns":..,"end_ns":..,"cpu_ns":..,"bytes":B}
    {"kind":"done"}
start_ns/end_ns are time.monotonic_ns() right around the call (CLOCK_MONOTONIC);
cpu_ns is the loop thread's CPU time spent in the call (time.thread_time_ns()).

Stdlib only; runs on pyenv 3.10-3.13 and Debian's /usr/bin/python3.11.
"""

import asyncio
import json
import os
import socket
import sys
import threading
import time

CHUNKS = 4
CHUNK_GAP_S = 0.040
CHUNK = b"x" * 512


# ---- the slow upstream: a plain blocking server thread (no selector, so it
# never calls epoll and is not an event-loop thread) ----

def slow_server(listener):
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)  # the request line
            for _ in range(CHUNKS):
                time.sleep(CHUNK_GAP_S)
                conn.sendall(CHUNK)


def start_server():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    threading.Thread(target=slow_server, args=(listener,), name="slow_server", daemon=True).start()
    return listener.getsockname()


# ---- the culprits: synchronous code that runs on the loop thread ----

def fetch_blocking(addr):
    """A sync client with a timeout: connect, send, recv until EOF."""
    total = 0
    with socket.create_connection(addr, timeout=2) as s:
        s.sendall(b"GET /completion\n")
        while True:
            data = s.recv(4096)
            if not data:
                break
            total += len(data)
    return total


def retry_with_sleep():
    time.sleep(0.12)  # the "utils" retry helper from the field report
    return 0


def burn_cpu(seconds):
    """Pure-Python work: no syscalls, the GIL held throughout."""
    end = time.monotonic_ns() + int(seconds * 1e9)
    acc = 0
    while time.monotonic_ns() < end:
        for i in range(2000):
            acc = (acc * 31 + i) % 1000003
    return acc


# ---- the loop ----

class Log:
    def __init__(self, path):
        self.f = open(path, "w")
        self.seq = 0

    def write(self, **rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def timed(self, kind, fn, *args):
        t0, c0 = time.monotonic_ns(), time.thread_time_ns()
        out = fn(*args)
        t1, c1 = time.monotonic_ns(), time.thread_time_ns()
        self.write(kind=kind, func=fn.__name__, seq=self.seq, tid=threading.get_native_id(),
                   start_ns=t0, end_ns=t1, cpu_ns=c1 - c0, bytes=out if kind == "blocking_client" else 0)
        self.seq += 1


async def heartbeat():
    while True:
        await asyncio.sleep(0.010)


async def session(log, addr, rounds, start_file):
    await asyncio.sleep(0.3)
    if start_file:
        while not os.path.exists(start_file):
            await asyncio.sleep(0.010)
        await asyncio.sleep(0.3)
    for _ in range(rounds):
        await asyncio.sleep(0.3)
        log.timed("blocking_client", fetch_blocking, addr)
    await asyncio.sleep(0.3)
    log.timed("sleep", retry_with_sleep)
    await asyncio.sleep(0.3)
    log.timed("cpu", burn_cpu, 0.1)
    await asyncio.sleep(0.2)


async def main(log, addr, rounds, start_file):
    log.write(kind="ready", pid=os.getpid(), tid=threading.get_native_id(),
              python=".".join(map(str, sys.version_info[:3])))
    hb = asyncio.create_task(heartbeat())
    await session(log, addr, rounds, start_file)
    hb.cancel()
    log.write(kind="done")
    if LINGER:
        await asyncio.Event().wait()


def parse_args(argv):
    if len(argv) < 2 or argv[1].startswith("-"):
        sys.exit("usage: py_blocking_client.py LOG_PATH [--start-file PATH] [--rounds N] "
                 "[--loop asyncio|uvloop|select] [--path DIR]")
    log_path, start_file, rounds = argv[1], None, 4
    global LOOP, LINGER

    rest = argv[2:]
    while rest:
        flag = rest.pop(0)
        if flag == "--start-file" and rest:
            start_file = rest.pop(0)
        elif flag == "--rounds" and rest:
            rounds = int(rest.pop(0))
        elif flag == "--loop" and rest:
            LOOP = rest.pop(0)
        elif flag == "--path" and rest:
            sys.path.insert(0, rest.pop(0))
        elif flag == "--linger":
            LINGER = True
        else:
            sys.exit(f"py_blocking_client.py: unknown argument {flag!r}")
    return log_path, start_file, rounds


# Which event loop parks the thread: asyncio's default (epoll), uvloop
# (libuv's epoll, from PyPI), or asyncio on a select()-based selector.
LOOP = "asyncio"
# Stay alive, idle, after "done" (--linger).
LINGER = False


if __name__ == "__main__":
    log_path, start_file, rounds = parse_args(sys.argv)
    addr = start_server()
    coro = main(Log(log_path), addr, rounds, start_file)
    if LOOP == "uvloop":
        import uvloop
        uvloop.run(coro)
    elif LOOP == "select":
        import selectors
        loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        loop.run_until_complete(coro)
        loop.close()
    else:
        asyncio.run(coro)
