"""py_service: a FastAPI app for a multi-process server, whose async
handlers block the event loop of whichever worker serves them. Started by
the server, not run as a script:

    uvicorn py_service:app --workers 2 --loop uvloop
    gunicorn -w 2 -k uvicorn.workers.UvicornWorker py_service:app

with SERVICE_LOG=PATH in the environment (the packages: target/asgi-venv,
pinned by xtask).

    GET /hash?ms=N&seq=S   hash_password: hashlib.pbkdf2_hmac rounds on the
                           loop until N ms have passed (on-CPU; one round
                           at least)
    GET /nap?ms=N&seq=S    nap: time.sleep(N ms) on the loop (off-CPU)

Every worker appends to the one log (O_APPEND, one write per line, so the
workers' lines never tear each other), each line JSON:

    {"kind":"ready","pid":P,"ppid":Q,"tid":T}     the worker's app started
    {"kind":"begin","seq":S,"pid":P}              a handler begins request S
    {"kind":"cpu"|"sleep","func":"hash_password"|"nap","seq":S,"ms":N,
     "pid":P,"tid":T,"start_ns":..,"end_ns":..,"cpu_ns":..}

start_ns/end_ns are time.monotonic_ns() (CLOCK_MONOTONIC) around the
blocking section; cpu_ns is the loop thread's CPU time over it
(time.thread_time_ns()); tid is threading.get_native_id(), the thread's
id as the kernel and stallprof name it.
"""

import contextlib
import hashlib
import json
import os
import threading
import time

from fastapi import FastAPI

LOG_PATH = os.environ["SERVICE_LOG"]


def log(**rec):
    line = (json.dumps(rec) + "\n").encode()
    fd = os.open(LOG_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def lifespan(_app):
    log(kind="ready", pid=os.getpid(), ppid=os.getppid(), tid=threading.get_native_id())
    yield


app = FastAPI(lifespan=lifespan)


def section(kind, func, seq, ms, start, cpu0):
    log(kind=kind, func=func, seq=seq, ms=ms, pid=os.getpid(), tid=threading.get_native_id(),
        start_ns=start, end_ns=time.monotonic_ns(), cpu_ns=time.thread_time_ns() - cpu0)


@app.get("/hash")
async def hash_password(ms: int = 60, seq: int = 0):
    log(kind="begin", seq=seq, pid=os.getpid())
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    until = start + ms * 1_000_000
    while True:  # one round at least: ms=0 warms the handler up
        digest = hashlib.pbkdf2_hmac("sha256", b"correct horse", b"battery staple", 2000)
        if time.monotonic_ns() >= until:
            break
    section("cpu", "hash_password", seq, ms, start, cpu0)
    return {"digest": digest.hex(), "pid": os.getpid()}


@app.get("/nap")
async def nap(ms: int = 60, seq: int = 0):
    log(kind="begin", seq=seq, pid=os.getpid())
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    time.sleep(ms / 1000)
    section("sleep", "nap", seq, ms, start, cpu0)
    return {"slept_ms": ms, "pid": os.getpid()}
