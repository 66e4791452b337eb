"""http_service: the overhead bench's target, a small asyncio HTTP/1.1 service
(stdlib only) on 127.0.0.1. Each request does a little real work on the loop
(builds and JSON-encodes a ~40-field response) and keeps the connection alive,
so under a load generator the loop thread wakes from epoll_wait thousands of
times a second: the worst case for a profiler that watches every wait.

Usage: python3 http_service.py PORT_FILE [LOG]
Binds 127.0.0.1:0, writes "PORT PID TID\n" to PORT_FILE once listening, serves
until killed. With LOG, appends "MONOTONIC_NS REQUESTS THREAD_CPU_NS\n" to it
every 100 ms (the loop thread's own clocks: bench/service_phases.py divides
one by the other per phase).
"""
import asyncio
import json
import os
import sys
import threading
import time

COUNTER = 0


def body():
    global COUNTER
    COUNTER += 1
    doc = {f"field{i}": (i * COUNTER) % 997 for i in range(40)}
    doc["n"] = COUNTER
    return json.dumps(doc).encode()


async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if not head:
                break
            b = body()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(b)).encode() + b"\r\n\r\n" + b)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def log_progress(path):
    with open(path, "a", buffering=1) as out:
        while True:
            await asyncio.sleep(0.1)
            out.write(f"{time.monotonic_ns()} {COUNTER} {time.thread_time_ns()}\n")


async def main(port_file, log=None):
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
    port = server.sockets[0].getsockname()[1]
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{port} {os.getpid()} {threading.get_native_id()}\n")
    os.rename(tmp, port_file)
    if log:
        asyncio.get_running_loop().create_task(log_progress(log))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: http_service.py PORT_FILE [LOG]")
    asyncio.run(main(*sys.argv[1:]))
