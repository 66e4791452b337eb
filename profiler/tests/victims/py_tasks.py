"""py_tasks: an asyncio server whose tasks block the loop, each block
logged with the name of the task that ran it.

    server     asyncio.start_server: one task per connection, asyncio's
               default names (Task-N), coroutine handle_client
    driver     main(): opens CONNECTIONS connections and sends requests one
               at a time (never two blocks in one loop iteration); each
               request makes handle_client block for BLOCK_MS:
                 cpu     crunch(): a pure-Python loop in a sync function
                 sleep   time.sleep() (off-CPU)
                 inline  a busy loop in handle_client's own body
    janitor    a task created with create_task(name="janitor"): on cue,
               time.sleep() in janitor_sweep()
    batches    main awaits a task named "batch-runner", which awaits
               tasks "batch-0", "batch-1" (run_batch: crunch()); the await
               chain of a batch is batch-N <- batch-runner <- main's task

Usage: python3 py_tasks.py LOG_PATH [--rounds N] [--block-ms MS] [--hide-current-tasks]

--hide-current-tasks replaces asyncio.tasks._current_tasks (the dict a
profiler reads on 3.10-3.13; asyncio's C tasks keep their own reference)
with a list: the running task can no longer be read from outside, which
the profiler must say.

Log (JSON lines, flushed per line; times are time.monotonic_ns()):
    {"kind":"ready","pid":P,"tid":T,"python":"3.12.1","file":"/abs/py_tasks.py","main_task":NAME}
    {"kind":"block","how":"cpu|sleep|inline","task":NAME,"coro":QUALNAME,
     "awaited_by":[NAME,...],"tid":T,"start_ns":..,"end_ns":..}
    {"kind":"done"}
`task` is asyncio.current_task().get_name() inside the block; `coro` the
qualified name of that task's coroutine function; `awaited_by` the chain
this victim built (the batch tasks only; [] for the others).

Stdlib only; runs on CPython 3.10-3.15.
"""

import asyncio
import json
import os
import sys
import threading
import time

BLOCK_MS = 70
GAP_S = 0.15
CONNECTIONS = 3


class Log:
    def __init__(self, path):
        self.f = open(path, "w")

    def write(self, **rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


LOG = None


def crunch(ms):
    """Pure-Python work for about `ms` milliseconds."""
    end = time.monotonic_ns() + ms * 1_000_000
    n = 0
    while time.monotonic_ns() < end:
        for i in range(200):
            n += i * i
    return n


def log_block(how, coro, t0, t1, awaited_by=()):
    LOG.write(kind="block", how=how, task=asyncio.current_task().get_name(), coro=coro,
              awaited_by=list(awaited_by), tid=threading.get_native_id(), start_ns=t0, end_ns=t1)


async def handle_client(reader, writer):
    while True:
        line = await reader.readline()
        if not line:
            break
        how = line.decode().strip()
        t0 = time.monotonic_ns()
        if how == "cpu":
            crunch(BLOCK_MS)
        elif how == "sleep":
            time.sleep(BLOCK_MS / 1000)
        else:  # inline: the coroutine body itself runs
            end = t0 + BLOCK_MS * 1_000_000
            while time.monotonic_ns() < end:
                pass
        t1 = time.monotonic_ns()
        log_block(how, "handle_client", t0, t1)
        writer.write(b"ok\n")
        await writer.drain()
    writer.close()


def janitor_sweep():
    time.sleep(BLOCK_MS / 1000)


async def janitor(cue, finished):
    while True:
        await cue.get()
        t0 = time.monotonic_ns()
        janitor_sweep()
        log_block("sleep", "janitor", t0, time.monotonic_ns())
        finished.set()


async def run_batch(chain):
    t0 = time.monotonic_ns()
    crunch(BLOCK_MS)
    log_block("cpu", "run_batch", t0, time.monotonic_ns(), chain)


async def batch_runner(main_name):
    me = asyncio.current_task().get_name()
    for i in range(2):
        await asyncio.sleep(GAP_S)
        await asyncio.create_task(run_batch([me, main_name]), name=f"batch-{i}")


async def main(log, rounds):
    global LOG
    LOG = log
    me = asyncio.current_task().get_name()
    server = await asyncio.start_server(handle_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    log.write(kind="ready", pid=os.getpid(), tid=threading.get_native_id(),
              python=".".join(map(str, sys.version_info[:3])), file=os.path.abspath(__file__),
              main_task=me)
    cue, finished = asyncio.Queue(), asyncio.Event()
    jan = asyncio.create_task(janitor(cue, finished), name="janitor")
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CONNECTIONS)]
    await asyncio.sleep(0.4)
    hows = ["cpu", "sleep", "inline"]
    for r in range(rounds):
        for i, (reader, writer) in enumerate(conns):
            await asyncio.sleep(GAP_S)
            writer.write(f"{hows[(r + i) % 3]}\n".encode())
            await writer.drain()
            assert await reader.readline() == b"ok\n"
        await asyncio.sleep(GAP_S)
        finished.clear()
        cue.put_nowait(r)
        await finished.wait()
    await asyncio.create_task(batch_runner(me), name="batch-runner")
    await asyncio.sleep(GAP_S)
    for _, writer in conns:
        writer.close()
    jan.cancel()
    server.close()
    await asyncio.sleep(0.2)
    log.write(kind="done")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: py_tasks.py LOG_PATH [--rounds N] [--block-ms MS] [--hide-current-tasks]")
    rounds, rest = 4, sys.argv[2:]
    while rest:
        flag = rest.pop(0)
        if flag == "--rounds" and rest:
            rounds = int(rest.pop(0))
        elif flag == "--block-ms" and rest:
            BLOCK_MS = int(rest.pop(0))
        elif flag == "--hide-current-tasks":
            import asyncio.tasks
            asyncio.tasks._current_tasks = []
        else:
            sys.exit(f"py_tasks.py: unknown argument {flag!r}")
    asyncio.run(main(Log(sys.argv[1]), rounds))
