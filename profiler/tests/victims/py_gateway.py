"""py_gateway: a streaming asyncio gateway whose new requests do synchronous
setup ON the loop, as in the field report "Who froze the event loop?":

    Gateway.make_tls_contexts()   3x ssl.create_default_context()
    Gateway.load_tokenizer()      json.loads of a ~200k-entry JSON string
                                  (entries are [id, rank] lists: GC-tracked)
    Gateway.compress_payload()    zlib.compress of 1 MB of os.urandom
    Gateway.score_candidates()    pure-Python scoring of 400 candidates

Each request runs the four steps back-to-back in ONE loop callback (one task
step, no await in between), so one stall = the four steps. A few client
coroutines expect a chunk every 20 ms and log how late their worst chunk was.

Usage: python3 py_gateway.py LOG_PATH [--requests N] [--entries N]

The tokenizer's entry count (200k in the field report) is calibrated at
startup so that its json.loads takes ~55 ms here; --entries overrides it.

Timeline: ~400 ms idle (attach), then N (default 6) requests 250 ms apart
(asyncio.sleep, so the loop parks between them), ~200 ms idle, exit 0.

Log (JSON lines, flushed per line; times are time.monotonic_ns(), CPU times
time.thread_time_ns() of the loop thread):
    {"kind":"ready","pid":P,"tid":T,"python":"3.11.7","file":"/abs/py_gateway.py",
     "tokenizer_entries":N,
     "funcs":{"make_tls_contexts":{"name":..,"qualname":..,"first_line":..,
              "last_line":..,"block_line":..,"single_statement":bool},...}}
    {"kind":"step","func":NAME,"qualname":QN,"req":R,"tid":T,"start_ns":..,
     "end_ns":..,"cpu_ns":..,"line":BLOCK_LINE}
    {"kind":"release","req":R,"tid":T,"start_ns":..,"end_ns":..}  freeing the steps' results
    {"kind":"request","req":R,"tid":T,"start_ns":..,"end_ns":..,"cpu_ns":..}
    {"kind":"clients","worst_late_ms":[..]}
    {"kind":"done"}
first_line..last_line is the function's definition (def line to last line);
block_line is the line of the statement that blocks, found in the source by
its "# BLOCKS" comment and checked against the code it must contain.

Stdlib only; runs on pyenv 3.10-3.13 and Debian's /usr/bin/python3.11.
"""

import asyncio
import inspect
import json
import os
import ssl
import sys
import threading
import time
import zlib

N_CANDIDATES = 400
DIM = 160
TOKENIZER_TARGET_MS = 55.0


class Gateway:
    def __init__(self, entries):
        # Built once at startup; parsed again by every request (the bug).
        # Each entry is [token id, merge rank]: 200k small lists are 200k
        # GC-tracked allocations, so loading it triggers collections.
        self.tokenizer_json = json.dumps({f"tok{i:07d}": [i, i % 97] for i in range(entries)})
        self.payload = os.urandom(1 << 20)
        self.query = [((i * 37) % 101) / 101.0 for i in range(DIM)]
        self.candidates = [[((c * 131 + i * 17) % 97) / 97.0 for i in range(DIM)] for c in range(N_CANDIDATES)]

    def make_tls_contexts(self):
        llm = ssl.create_default_context()  # BLOCKS
        moderation = ssl.create_default_context()
        tracing = ssl.create_default_context()
        return [llm, moderation, tracing]

    def load_tokenizer(self):
        return json.loads(self.tokenizer_json)  # BLOCKS

    def compress_payload(self):
        return zlib.compress(self.payload)  # BLOCKS

    def score_candidates(self):
        best, best_score = -1, float("-inf")
        for c, vec in enumerate(self.candidates):  # BLOCKS
            dot = 0.0
            norm = 0.0
            for q, v in zip(self.query, vec):
                dot += q * v
                norm += v * v
            score = dot / (norm ** 0.5 + 1e-9) + (c % 7) * 1e-3
            if score > best_score:
                best, best_score = c, score
        return best


STEPS = ["make_tls_contexts", "load_tokenizer", "compress_payload", "score_candidates"]
# The code each step's "# BLOCKS" line must contain (the self-check).
BLOCKS = {
    "make_tls_contexts": "ssl.create_default_context()",
    "load_tokenizer": "json.loads(",
    "compress_payload": "zlib.compress(",
    "score_candidates": "for c, vec in enumerate(",
}
SINGLE_STATEMENT = {"load_tokenizer", "compress_payload"}


def describe(fn, block_code, single):
    lines, first = inspect.getsourcelines(fn)
    hits = [first + i for i, text in enumerate(lines) if text.rstrip().endswith("# BLOCKS")]
    assert len(hits) == 1, f"{fn.__qualname__}: want exactly one '# BLOCKS' line, found {hits}"
    assert block_code in lines[hits[0] - first], f"{fn.__qualname__}: line {hits[0]} lacks {block_code!r}"
    return {
        "name": fn.__name__,
        "qualname": fn.__qualname__,
        "first_line": first,
        "last_line": first + len(lines) - 1,
        "block_line": hits[0],
        "single_statement": single,
    }


def calibrate_entries(target_ms):
    """Entries for a tokenizer whose json.loads takes ~target_ms on this
    machine now (the field report's 200k took 35 ms on a fast laptop; a
    loaded 2-core VM is several times slower). Clamped to 10k..400k."""
    probe = 20_000
    text = json.dumps({f"tok{i:07d}": [i, i % 97] for i in range(probe)})
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        json.loads(text)
        best = min(best, time.perf_counter() - t0)
    return max(10_000, min(400_000, int(probe * target_ms / 1000 / best)))


class Log:
    def __init__(self, path):
        self.f = open(path, "w")

    def write(self, **rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def handle_request(gw, log, req, funcs):
    """One new request: the four setup steps, back-to-back, on the loop."""
    tid = threading.get_native_id()
    steps = []
    results = []
    # thread_time_ns() is a real syscall (a preemption point): read it
    # outside the monotonic window of each step.
    rc0 = time.thread_time_ns()
    r0 = time.monotonic_ns()
    for name in STEPS:
        fn = getattr(gw, name)
        c0 = time.thread_time_ns()
        t0 = time.monotonic_ns()
        # Keep the result: freeing it (the tokenizer dict, the SSL contexts)
        # is not the step's work and happens below, outside the steps.
        results.append(fn())
        t1 = time.monotonic_ns()
        c1 = time.thread_time_ns()
        steps.append(dict(kind="step", func=name, qualname=fn.__qualname__, req=req, tid=tid,
                          start_ns=t0, end_ns=t1, cpu_ns=c1 - c0, line=funcs[name]["block_line"]))
    t0 = time.monotonic_ns()
    results.clear()
    r1 = time.monotonic_ns()
    rc1 = time.thread_time_ns()
    steps.append(dict(kind="release", req=req, tid=tid, start_ns=t0, end_ns=r1))
    # Logged after the request so the writes are not inside the steps.
    for s in steps:
        log.write(**s)
    log.write(kind="request", req=req, tid=tid, start_ns=r0, end_ns=r1, cpu_ns=rc1 - rc0)


async def client(worst, i):
    """A token stream: expects a chunk every 20 ms."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + 0.020
        await asyncio.sleep(0.020)
        worst[i] = max(worst[i], (loop.time() - due) * 1000)


async def heartbeat():
    while True:
        await asyncio.sleep(0.010)


async def main(log, gw, funcs, n_requests, entries):
    log.write(kind="ready", pid=os.getpid(), tid=threading.get_native_id(),
              python=".".join(map(str, sys.version_info[:3])), file=os.path.abspath(__file__), funcs=funcs,
              tokenizer_entries=entries)
    worst = [0.0] * 4
    tasks = [asyncio.create_task(client(worst, i)) for i in range(len(worst))]
    tasks.append(asyncio.create_task(heartbeat()))
    await asyncio.sleep(0.4)
    for req in range(n_requests):
        await asyncio.sleep(0.25)
        handle_request(gw, log, req, funcs)
    await asyncio.sleep(0.2)
    for t in tasks:
        t.cancel()
    log.write(kind="clients", worst_late_ms=[round(w, 2) for w in worst])
    log.write(kind="done")


def parse_args(argv):
    if len(argv) < 2 or argv[1].startswith("-"):
        sys.exit("usage: py_gateway.py LOG_PATH [--requests N] [--entries N]")
    log_path, n_requests, entries = argv[1], 6, None
    rest = argv[2:]
    while rest:
        flag = rest.pop(0)
        if flag == "--requests" and rest:
            n_requests = int(rest.pop(0))
        elif flag == "--entries" and rest:
            entries = int(rest.pop(0))
        else:
            sys.exit(f"py_gateway.py: unknown argument {flag!r}")
    return log_path, n_requests, entries


if __name__ == "__main__":
    log_path, n_requests, entries = parse_args(sys.argv)
    funcs = {name: describe(getattr(Gateway, name), BLOCKS[name], name in SINGLE_STATEMENT) for name in STEPS}
    entries = entries or calibrate_entries(TOKENIZER_TARGET_MS)
    gw = Gateway(entries)
    asyncio.run(main(Log(log_path), gw, funcs, n_requests, entries))
