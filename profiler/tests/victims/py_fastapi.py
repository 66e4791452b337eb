"""py_fastapi: a FastAPI service on uvicorn[standard] (uvloop + httptools),
installed from PyPI at pinned versions (xtask test_setup: target/asgi-venv),
whose async handlers block the loop in three ways, each through a real
library:

    POST /resume/{rid}   parse_resume: pypdf parses a PDF (made here, in
                         memory) and extracts its text -- pure-Python CPU
    GET  /profile/{pid}  fetch_profile: `requests` (sync) GETs a slow local
                         server (127.0.0.1 only, a thread of this process)
    GET  /nap            nap: time.sleep()

Each handler logs time.monotonic_ns() (CLOCK_MONOTONIC) around its blocking
call: the ground truth the test compares stallprof with.

Usage: python py_fastapi.py LOG_PATH [--rounds N] [--otel]

With --otel the service is instrumented the usual OpenTelemetry way: the
SDK's TracerProvider with its BatchSpanProcessor (exporting to /dev/null),
and opentelemetry-instrumentation-fastapi's FastAPIInstrumentor, which
opens a server span per request; `nap` opens a child span around its
sleep. Each blocking call then also logs the trace id and span id of the
span current in it (`trace_id`, `span_id`, W3C hex), as the SDK reports
them: what stallprof reads from the task's context.

Timeline: the server starts on 127.0.0.1 (a port of its own choosing),
~600 ms idle (attach; the loop parks), then a client thread of this process
sends, N times (default 3), POST /resume/i, GET /profile/i, GET /nap, one
at a time, 250 ms apart; then the server is told to exit and the process
exits 0. The client and the slow server use blocking sockets without
timeouts (recv/accept, never poll/epoll), so neither looks like a loop.

Log (JSON lines, flushed per line):
    {"kind":"ready","pid":P,"tid":T,"python":"3.11.7","port":N}
    {"kind":"cpu"|"blocking_client"|"sleep",
     "func":"parse_resume"|"fetch_profile"|"nap",
     "seq":N,"tid":T,"start_ns":..,"end_ns":..,"cpu_ns":..,"path":"/resume/1",
     "method":"POST","route":"/resume/{rid}"}
    {"kind":"done"}
cpu_ns is the loop thread's CPU time in the call (time.thread_time_ns());
method and route are what the framework routed the request to
(request.method, request.scope["route"].path): the route stallprof reads.
"""

import io
import json
import os
import socket
import sys
import threading
import time
import http.client

import pypdf
import requests
import uvicorn
from fastapi import FastAPI, Request

LOG = open(sys.argv[1], "a", buffering=1)
OTEL = "--otel" in sys.argv
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
SLOW_UPSTREAM_S = 0.12
NAP_S = 0.09
PDF_PAGES = 48
PDF_LINES = 45


def log(**rec):
    LOG.write(json.dumps(rec) + "\n")


def make_pdf(pages, lines):
    """A text PDF, written by hand: catalog, page tree, one font, and per
    page a content stream of `lines` text lines."""
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        None,  # the page tree, once the pages' numbers are known
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    kids = []
    for p in range(pages):
        ops = [b"BT /F1 9 Tf 11 TL 36 800 Td"]
        for i in range(lines):
            ops.append(b"(Resume %d line %d: shipped the billing service, on call, 7 years of Python) Tj T*" % (p, i))
        ops.append(b"ET")
        stream = b"\n".join(ops)
        objs.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
        content = len(objs)
        objs.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 842] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % content
        )
        kids.append(len(objs))
    objs[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % k for k in kids),
        pages,
    )
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for n, body in enumerate(objs, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (n, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1))
    for off in offsets:
        out.write(b"%010d 00000 n \n" % off)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref))
    return out.getvalue()


PDF = make_pdf(PDF_PAGES, PDF_LINES)


# ---- the slow upstream: a plain blocking server thread on 127.0.0.1 ----

def slow_upstream(listener):
    while True:
        conn, _ = listener.accept()
        with conn:
            req = b""
            while b"\r\n\r\n" not in req:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                req += chunk
            time.sleep(SLOW_UPSTREAM_S)
            body = b'{"name": "Ada", "skills": ["python"]}'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
            )


def start_upstream():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    threading.Thread(target=slow_upstream, args=(listener,), name="slow_upstream", daemon=True).start()
    return listener.getsockname()[1]


UPSTREAM_PORT = start_upstream()


# ---- the service: async handlers that block the loop ----

app = FastAPI()

if OTEL:
    from opentelemetry import trace
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=open(os.devnull, "w"))))
    trace.set_tracer_provider(provider)
    FastAPIInstrumentor.instrument_app(app)
    TRACER = trace.get_tracer("py_fastapi")


def current_span_ids():
    """The current span's ids as the SDK reports them (W3C hex)."""
    if not OTEL:
        return {}
    ctx = trace.get_current_span().get_span_context()
    return {"trace_id": "%032x" % ctx.trace_id, "span_id": "%016x" % ctx.span_id}


def record(kind, func, seq, request, start, cpu0, ids=None):
    end = time.monotonic_ns()
    log(kind=kind, func=func, seq=seq, tid=threading.get_native_id(), start_ns=start,
        end_ns=end, cpu_ns=time.thread_time_ns() - cpu0, path=request.url.path,
        method=request.method, route=request.scope["route"].path,
        **(current_span_ids() if ids is None else ids))


@app.post("/resume/{rid}")
async def parse_resume(rid: int, request: Request):
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    reader = pypdf.PdfReader(io.BytesIO(PDF))
    chars = 0
    for page in reader.pages:
        chars += len(page.extract_text())
    record("cpu", "parse_resume", rid, request, start, cpu0)
    return {"chars": chars}


@app.get("/profile/{pid}")
async def fetch_profile(pid: int, request: Request):
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    r = requests.get(f"http://127.0.0.1:{UPSTREAM_PORT}/profile/{pid}", timeout=5)
    record("blocking_client", "fetch_profile", pid, request, start, cpu0)
    return r.json()


@app.get("/nap")
async def nap(request: Request, seq: int = 0):
    if OTEL:
        # A child span of the request's, current during the sleep.
        with TRACER.start_as_current_span("nap.sleep"):
            ids = current_span_ids()
            start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
            time.sleep(NAP_S)
    else:
        ids = None
        start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
        time.sleep(NAP_S)
    record("sleep", "nap", seq, request, start, cpu0, ids)
    return {"slept": NAP_S}


# ---- the client: this process's own thread, blocking sockets ----

def client(server, port):
    while not server.started:
        time.sleep(0.01)
    time.sleep(0.6)
    try:
        for i in range(ROUNDS):
            for method, path in (("POST", f"/resume/{i}"), ("GET", f"/profile/{i}"), ("GET", f"/nap?seq={i}")):
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
        server.should_exit = True


def main():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, loop="uvloop", http="httptools", log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    log(kind="ready", pid=os.getpid(), tid=threading.get_native_id(),
        python="%d.%d.%d" % sys.version_info[:3], port=port,
        versions={m.__name__: getattr(m, "__version__", "?") for m in (pypdf, requests, uvicorn)},
        otel=OTEL)
    threading.Thread(target=client, args=(server, port), name="client", daemon=True).start()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
