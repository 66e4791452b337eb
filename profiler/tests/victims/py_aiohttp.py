"""py_aiohttp: an aiohttp web service (aiohttp's own server and router,
installed from PyPI at pinned versions: xtask test_setup, target/asgi-venv)
whose async handlers block the loop:

    POST /render/{doc_id}   render: a pure-Python CPU loop (on-CPU)
    GET  /users/{uid}       lookup_user: time.sleep, as a sync DB driver's
                            round trip would (off-CPU)
    GET  /health            health: time.sleep under a plain resource

Each handler logs time.monotonic_ns() (CLOCK_MONOTONIC) around its blocking
call, the request's method and the route template aiohttp matched
(`request.match_info.route.resource.canonical`): what stallprof reads.

Usage: python py_aiohttp.py LOG_PATH [--rounds N] [--subinterpreter]

--subinterpreter: before the loop starts, the loop thread creates a
sub-interpreter (CPython's own _xxsubinterpreters, as a plugin host does)
and runs a line in it; the sub-interpreter lives on, and with it a second
thread state stamped with the loop thread's id: which of a thread's states
is its own is what stallprof must tell apart (the same happens for a few
milliseconds each time CPython 3.10/3.11 start a thread).

Timeline: the server starts on 127.0.0.1 (a port of its own choosing),
~600 ms idle, then a client thread of this process sends N rounds
(default 3) of the three requests, one at a time, 250 ms apart, with
blocking sockets (no poll/epoll: the client is no loop); then the process
exits 0.

Log (JSON lines, flushed per line):
    {"kind":"ready","pid":P,"tid":T,"python":"3.11.7","port":N,"aiohttp":"3.14.5"}
    {"kind":"cpu"|"sleep","func":"render"|"lookup_user"|"health","seq":N,
     "tid":T,"start_ns":..,"end_ns":..,"cpu_ns":..,"path":"/users/1",
     "method":"GET","route":"/users/{uid}"}
    {"kind":"done"}
"""

import asyncio
import http.client
import json
import os
import socket
import sys
import threading
import time

import aiohttp
from aiohttp import web

LOG = open(sys.argv[1], "a", buffering=1)
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
BLOCK_S = 0.09


def log(**rec):
    LOG.write(json.dumps(rec) + "\n")


def record(kind, func, request, start, cpu0, seq=0):
    log(kind=kind, func=func, seq=seq, tid=threading.get_native_id(), start_ns=start,
        end_ns=time.monotonic_ns(), cpu_ns=time.thread_time_ns() - cpu0,
        path=request.path, method=request.method,
        route=request.match_info.route.resource.canonical)


async def render(request):
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    x = 0
    while time.monotonic_ns() - start < BLOCK_S * 1e9:
        x += 1
    record("cpu", "render", request, start, cpu0, int(request.match_info["doc_id"]))
    return web.json_response({"x": x})


async def lookup_user(request):
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    time.sleep(BLOCK_S)
    record("sleep", "lookup_user", request, start, cpu0, int(request.match_info["uid"]))
    return web.json_response({"uid": request.match_info["uid"]})


async def health(request):
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    time.sleep(BLOCK_S)
    record("sleep", "health", request, start, cpu0)
    return web.Response(text="ok")


def client(port, done):
    time.sleep(0.6)
    try:
        for i in range(ROUNDS):
            for method, path in (("POST", f"/render/{i}"), ("GET", f"/users/{i}"), ("GET", "/health")):
                conn = http.client.HTTPConnection("127.0.0.1", port)
                conn.request(method, path)
                resp = conn.getresponse()
                resp.read()
                conn.close()
                if resp.status != 200:
                    log(kind="error", path=path, status=resp.status)
                time.sleep(0.25)
        log(kind="done")
    finally:
        done.set()


async def main():
    app = web.Application()
    app.router.add_post("/render/{doc_id}", render)
    app.router.add_get("/users/{uid}", lookup_user)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    site = web.SockSite(runner, sock)
    await site.start()
    log(kind="ready", pid=os.getpid(), tid=threading.get_native_id(),
        python="%d.%d.%d" % sys.version_info[:3], port=port, aiohttp=aiohttp.__version__)
    done = threading.Event()
    threading.Thread(target=client, args=(port, done), name="client", daemon=True).start()
    while not done.is_set():
        await asyncio.sleep(0.05)
    await runner.cleanup()


if __name__ == "__main__":
    if "--subinterpreter" in sys.argv:
        import _xxsubinterpreters as subinterpreters

        PLUGIN = subinterpreters.create()
        subinterpreters.run_string(PLUGIN, "plugin_ready = True")
    asyncio.run(main())
