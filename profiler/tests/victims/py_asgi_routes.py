"""py_asgi_routes: the shapes stallprof reads an ASGI request's route from,
with the standard library only, so they run on every CPython 3.10-3.15
(the FastAPI victim, py_fastapi.py, needs packages and runs on 3.11 only).

    Cycle.run_asgi     as uvicorn's RequestResponseCycle: the scope is an
                       attribute, the app is awaited with it
    Middleware         an ASGI middleware: __call__(self, scope, receive, send)
    Router.app         as Starlette's: scope["route"] = the matched route,
                       scope.update(endpoint=..., path_params=...)
    Route, WideRoute   route objects with a `path` attribute: Route has a
                       few attributes (shared keys / inline values on
                       3.11+), WideRoute 40 (a dict of its own)
    nap, crunch        async endpoints that block the loop: time.sleep
                       (off-CPU) and a pure-Python loop (on-CPU)
    later              an async endpoint that blocks nothing itself: it
                       schedules later_callback with loop.call_later, which
                       runs LATER_S after the request's task (a busy period
                       of its own), with no task running, under the context
                       call_later copied (the request's span in it), and
                       sleeps there (issue 36: the thread's own context)
    Tracing            an OpenTelemetry-style middleware, as opentelemetry-api
                       keeps the current span: a ContextVar named
                       "current_context" holding a Context (a dict) whose
                       "current-span-<uuid4>" key is the span, whose
                       `_context` is a SpanContext (a tuple subclass:
                       trace_id, span_id, ...); 24 other context variables
                       make the task's context a HAMT of several nodes

Each request runs in a task of its own, as a server's would, one at a time.

Usage: python3 py_asgi_routes.py LOG_PATH [--rounds N]

Log (JSON lines, flushed per line; times are time.monotonic_ns()):
    {"kind":"ready","pid":P,"tid":T,"python":"3.12.1"}
    {"kind":"call","func":"nap"|"crunch","method":"GET","route":"/nap/{n}",
     "path":"/nap/1","tid":T,"start_ns":..,"end_ns":..,
     "trace_id":"<32 hex>","span_id":"<16 hex>"}
    {"kind":"callback","func":"later_callback","tid":T,"start_ns":..,
     "end_ns":..,"trace_id":"<32 hex>","span_id":"<16 hex>"}
    {"kind":"done"}
`method` and `route` are the scope's, as the endpoint sees them.
"""

import asyncio
import contextvars
import json
import os
import random
import sys
import threading
import time
import uuid

BLOCK_S = 0.09
GAP_S = 0.2
LATER_S = 0.03
LOG = None


def log(**rec):
    LOG.write(json.dumps(rec) + "\n")
    LOG.flush()


# ---- the shapes of opentelemetry-api's context, standard library only ----

CURRENT_CONTEXT = contextvars.ContextVar("current_context", default={})
SPAN_KEY = "current-span-" + str(uuid.uuid4())
OTHER_VARS = [contextvars.ContextVar(f"app_var_{i}") for i in range(24)]


class Context(dict):
    pass


class SpanContext(tuple):
    def __new__(cls, trace_id, span_id):
        return tuple.__new__(cls, (trace_id, span_id, 1, None, False))


class Span:
    def __init__(self, name, context):
        self._name = name
        self._context = context


def current_span_ids():
    span = CURRENT_CONTEXT.get().get(SPAN_KEY)
    ctx = span._context
    return {"trace_id": "%032x" % ctx[0], "span_id": "%016x" % ctx[1]}


class Tracing:
    """Opens a span per request, as OpenTelemetry's ASGI middleware does."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        for i, var in enumerate(OTHER_VARS):
            var.set(i)
        # The top bit set: a trace id of five 30-bit digits.
        ids = SpanContext(random.getrandbits(127) | 1 << 127, random.getrandbits(63) | 1 << 63)
        token = CURRENT_CONTEXT.set(Context({SPAN_KEY: Span(scope["path"], ids)}))
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_CONTEXT.reset(token)


def record(func, scope, start):
    log(kind="call", func=func, method=scope["method"], route=scope["route"].path,
        path=scope["path"], tid=threading.get_native_id(), start_ns=start,
        end_ns=time.monotonic_ns(), **current_span_ids())


async def nap(scope):
    start = time.monotonic_ns()
    time.sleep(BLOCK_S)
    record("nap", scope, start)


async def crunch(scope):
    start = time.monotonic_ns()
    x = 0
    while time.monotonic_ns() - start < BLOCK_S * 1e9:
        x += 1
    record("crunch", scope, start)


async def later(scope):
    asyncio.get_running_loop().call_later(LATER_S, later_callback)


def later_callback():
    start = time.monotonic_ns()
    time.sleep(BLOCK_S)
    log(kind="callback", func="later_callback", tid=threading.get_native_id(),
        start_ns=start, end_ns=time.monotonic_ns(), running_task=asyncio.current_task() is not None,
        **current_span_ids())


class Route:
    def __init__(self, path, methods, endpoint):
        self.path = path
        self.methods = methods
        self.endpoint = endpoint

    def matches(self, scope):
        prefix = self.path.split("{")[0]
        return scope["method"] in self.methods and scope["path"].startswith(prefix)


class WideRoute(Route):
    def __init__(self, path, methods, endpoint):
        for i in range(40):
            setattr(self, f"option_{i}", i)
        super().__init__(path, methods, endpoint)


class Router:
    def __init__(self, routes):
        self.routes = routes

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)

    async def app(self, scope, receive, send):
        for route in self.routes:
            if route.matches(scope):
                scope["route"] = route
                scope.update({"endpoint": route.endpoint, "path_params": {}})
                await route.endpoint(scope)
                return
        raise LookupError(scope["path"])


class Middleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)


class Cycle:
    def __init__(self, scope):
        self.scope = scope

    async def run_asgi(self, app):
        await app(self.scope, None, None)


APP = Tracing(Middleware(Router([
    Route("/nap/{n}", {"GET"}, nap),
    WideRoute("/crunch/{job_id}", {"POST"}, crunch),
    Route("/later/{n}", {"GET"}, later),
])))


async def main(rounds):
    log(kind="ready", pid=os.getpid(), tid=threading.get_native_id(),
        python="%d.%d.%d" % sys.version_info[:3])
    await asyncio.sleep(0.6)
    loop = asyncio.get_running_loop()
    for i in range(rounds):
        for method, path in (("GET", f"/nap/{i}"), ("POST", f"/crunch/{i}"), ("GET", f"/later/{i}")):
            scope = {"type": "http", "asgi": {"version": "3.0"}, "method": method,
                     "path": path, "headers": []}
            await loop.create_task(Cycle(scope).run_asgi(APP))
            await asyncio.sleep(GAP_S)
    log(kind="done")


if __name__ == "__main__":
    LOG = open(sys.argv[1], "a")
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    asyncio.run(main(rounds))
