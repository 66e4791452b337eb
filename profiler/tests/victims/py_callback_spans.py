"""py_callback_spans: plain asyncio callbacks that block the loop, some of
them scheduled inside an OpenTelemetry span (issue 36: the thread's own
context when no task runs).

main() (a task) opens a span with `tracer.start_as_current_span(...)` and,
inside it, schedules a callback with `loop.call_soon`. The callback runs
after main's step has ended, with no task running, under the context
`call_soon` copied (asyncio's `Handle._run`: `self._context.run(...)`): the
thread's current context holds the span. Each round, one at a time:

    nap_callback     time.sleep(BLOCK_S), scheduled inside a span (off-CPU)
    crunch_callback  a pure-Python loop for BLOCK_S, scheduled inside a span
                     (on-CPU)
    plain_callback   time.sleep(BLOCK_S), scheduled outside any span: no span

Usage: python py_callback_spans.py LOG_PATH [--rounds N]

Log (JSON lines, flushed per line; times are CLOCK_MONOTONIC ns):
    {"kind":"sleep"|"cpu","func":NAME,"tid":T,"start_ns":..,"end_ns":..,
     "cpu_ns":..,"trace_id":HEX32|"","span_id":HEX16|""}
    {"kind":"done"}    or    {"kind":"error","what":...}
The ids are those of the span current inside the callback
(`opentelemetry.trace.get_current_span()`), "" when none is.

Needs opentelemetry-sdk (target/asgi-venv, pinned by xtask).
"""

import asyncio
import json
import sys
import threading
import time

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

LOG = open(sys.argv[1], "w", buffering=1)
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 6
BLOCK_S = 0.1
GAP_S = 0.15

trace.set_tracer_provider(TracerProvider())
tracer = trace.get_tracer("py_callback_spans")


def log(**rec):
    LOG.write(json.dumps(rec) + "\n")


def begin(func):
    """The span current now (its ids, "" for none) and the clocks, at the
    start of callback `func`'s block."""
    if asyncio.current_task() is not None:
        log(kind="error", what=f"{func} ran inside a task")
    ctx = trace.get_current_span().get_span_context()
    ids = (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")) if ctx.is_valid else ("", "")
    return ids, time.monotonic_ns(), time.thread_time_ns()


def end(func, kind, begun):
    ids, start, cpu0 = begun
    end_ns, cpu1 = time.monotonic_ns(), time.thread_time_ns()
    log(kind=kind, func=func, tid=threading.get_native_id(), start_ns=start,
        end_ns=end_ns, cpu_ns=cpu1 - cpu0, trace_id=ids[0], span_id=ids[1])


# Each callback blocks in its own body: it is the stall's culprit and entry.
def nap_callback():
    begun = begin("nap_callback")
    time.sleep(BLOCK_S)
    end("nap_callback", "sleep", begun)


def crunch_callback():
    begun = begin("crunch_callback")
    deadline = begun[1] + BLOCK_S * 1e9
    n = 0
    while time.monotonic_ns() < deadline:
        n += 1
    end("crunch_callback", "cpu", begun)


def plain_callback():
    begun = begin("plain_callback")
    time.sleep(BLOCK_S)
    end("plain_callback", "sleep", begun)


async def main():
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0.5)  # the profiler attaches
    for i in range(ROUNDS):
        for callback in (nap_callback, crunch_callback):
            with tracer.start_as_current_span(f"{callback.__name__}-{i}"):
                loop.call_soon(callback)
            await asyncio.sleep(GAP_S)
        loop.call_soon(plain_callback)
        await asyncio.sleep(GAP_S)
    log(kind="done")


asyncio.run(main())
