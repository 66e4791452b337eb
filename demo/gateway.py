#!/usr/bin/env python3
"""A streaming gateway that freezes its own event loop -- stallprof's demo.

Ten client streams each expect a chunk every 20 ms. New requests arrive about
every 250 ms, and each one does innocent-looking synchronous setup *on the
loop* before it streams, as in the field reports:

    build_tls_contexts()   3 x ssl.create_default_context() (re-reads the CA bundle)
    load_tokenizer()       json.loads of a ~200k-entry vocabulary built at startup
    compress_payload()     zlib level 9 over 1 MB of os.urandom bytes
    score_candidates()     400 retrieval candidates scored in pure Python
    retry_with_backoff()   every 4th request: a time.sleep(0.1) "retry"

While any of that runs, every stream stops. At exit the gateway prints how
late the slowest chunks were.

Stdlib only, so it runs on a fresh machine without pip:

    python3 demo/gateway.py [SECONDS] [--log PATH] [--fixed] [--seed N] [--tokenizer-entries N]
    sudo stallprof record -o out -- python3 demo/gateway.py 8

  SECONDS  how long to serve (default 8)
  --log    write JSON lines, one per setup step, with time.monotonic_ns():
           {"kind":"setup","func":"load_tokenizer","request":N,"start_ns":..,"end_ns":..}
           plus {"kind":"summary",...} and {"kind":"done"}
  --tokenizer-entries N  vocabulary size (default 200000; shrink on slow machines)
  --fixed  the fix: build TLS contexts, the tokenizer and the payload once at
           startup, and retry with `await asyncio.sleep`. Compare the lateness.
"""

import asyncio
import json
import os
import random
import ssl
import sys
import time
import zlib

STREAMS = 10
CHUNK_INTERVAL_S = 0.020
ARRIVAL_MEAN_S = 0.250
TOKENIZER_ENTRIES = 200_000
PAYLOAD_BYTES = 1 << 20
CANDIDATES = 400


class StepLog:
    def __init__(self, path):
        self.f = open(path, "w") if path else None

    def write(self, **rec):
        if self.f:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()

    def step(self, request, fn, *args):
        t0 = time.monotonic_ns()
        out = fn(*args)
        t1 = time.monotonic_ns()
        self.write(kind="setup", func=fn.__name__, request=request, start_ns=t0, end_ns=t1)
        return out


# ---- the setup steps (synchronous: each one blocks the loop) ----

def build_tls_contexts():
    return [ssl.create_default_context() for _ in ("llm", "moderation", "tracing")]


def load_tokenizer(vocab_json):
    return json.loads(vocab_json)


def compress_payload(payload):
    return zlib.compress(payload, 9)


def score_candidates(query, candidates):
    q = set(query.split())
    scored = []
    for doc in candidates:
        words = doc.split()
        overlap = sum(1 for w in words if w in q)
        length_penalty = 1.0 / (1.0 + abs(len(words) - 40) / 40.0)
        bigrams = sum(1 for a, b in zip(words, words[1:]) if a in q and b in q)
        scored.append((overlap * length_penalty + 0.5 * bigrams, doc))
    scored.sort(reverse=True)
    return scored[:10]


def retry_with_backoff():
    time.sleep(0.1)  # the retry helper hidden in a "utils" module


# ---- startup data ----

def build_world(rng, entries):
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {}
    while len(vocab) < entries:
        vocab["".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))] = len(vocab)
    vocab_json = json.dumps(vocab)
    words = [f"w{i}" for i in range(2000)]
    candidates = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(CANDIDATES)]
    query = " ".join(rng.choice(words) for _ in range(12))
    return vocab_json, candidates, query


# ---- the gateway ----

class Gateway:
    def __init__(self, args, log):
        self.args, self.log = args, log
        self.rng = random.Random(args["seed"])
        self.vocab_json, self.candidates, self.query = build_world(self.rng, args["tokenizer_entries"])
        self.lateness = []  # seconds late, one per chunk
        self.requests = 0
        if args["fixed"]:
            self.tls = build_tls_contexts()
            self.tokenizer = load_tokenizer(self.vocab_json)
            self.payload = compress_payload(os.urandom(PAYLOAD_BYTES))

    async def stream(self, deadline):
        """A client holding a token stream open: one chunk due every 20 ms."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while due < deadline:
            due += CHUNK_INTERVAL_S
            await asyncio.sleep(max(0.0, due - loop.time()))
            now = loop.time()
            self.lateness.append(max(0.0, now - due))
            if now - due > CHUNK_INTERVAL_S:
                # Live audio/token streams skip what they missed rather than
                # replaying a backlog: the next chunk is due one interval on.
                due = now

    async def handle_request(self, n):
        log = self.log
        if self.args["fixed"]:
            tls, tok = self.tls, self.tokenizer
            payload = self.payload
        else:
            tls = log.step(n, build_tls_contexts)
            tok = log.step(n, load_tokenizer, self.vocab_json)
            payload = log.step(n, compress_payload, os.urandom(PAYLOAD_BYTES))
        top = log.step(n, score_candidates, self.query, self.candidates)
        if n % 4 == 3:
            if self.args["fixed"]:
                t0 = time.monotonic_ns()
                await asyncio.sleep(0.1)
                log.write(kind="retry_async", request=n, start_ns=t0, end_ns=time.monotonic_ns())
            else:
                log.step(n, retry_with_backoff)
        del tls, tok, payload, top
        for _ in range(10):  # the reply streams without blocking anyone
            await asyncio.sleep(CHUNK_INTERVAL_S)

    async def arrivals(self, deadline):
        loop = asyncio.get_running_loop()
        tasks = []
        while True:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * ARRIVAL_MEAN_S)
            if loop.time() >= deadline:
                break
            tasks.append(asyncio.create_task(self.handle_request(self.requests)))
            self.requests += 1
        await asyncio.gather(*tasks)

    async def run(self, seconds):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        self.log.write(kind="ready", pid=os.getpid(), fixed=self.args["fixed"])
        await asyncio.gather(self.arrivals(deadline), *(self.stream(deadline) for _ in range(STREAMS)))

    def report(self):
        late = sorted(self.lateness, reverse=True)
        if not late:
            print("no chunks sent")
            return
        ms = [x * 1000 for x in late]
        p99 = ms[max(0, len(ms) // 100 - 1)]
        p50 = ms[len(ms) // 2]
        mode = "fixed" if self.args["fixed"] else "naive"
        print(f"gateway ({mode}): {self.requests} requests, {STREAMS} streams, {len(ms)} chunks")
        print(f"  chunk lateness: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {ms[0]:.1f} ms")
        print("  slowest chunks (ms late): " + ", ".join(f"{x:.0f}" for x in ms[:10]))
        self.log.write(kind="summary", requests=self.requests, chunks=len(ms),
                       p50_ms=p50, p99_ms=p99, max_ms=ms[0])


def parse_args(argv):
    args = {"seconds": 8.0, "log": None, "fixed": False, "seed": 1,
            "tokenizer_entries": TOKENIZER_ENTRIES}
    rest = list(argv[1:])
    while rest:
        a = rest.pop(0)
        if a == "--log" and rest:
            args["log"] = rest.pop(0)
        elif a == "--tokenizer-entries" and rest:
            args["tokenizer_entries"] = int(rest.pop(0))
        elif a == "--seed" and rest:
            args["seed"] = int(rest.pop(0))
        elif a == "--fixed":
            args["fixed"] = True
        elif a in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        else:
            try:
                args["seconds"] = float(a)
            except ValueError:
                sys.exit(f"gateway.py: unexpected argument {a!r} (try --help)")
    return args


def main():
    args = parse_args(sys.argv)
    log = StepLog(args["log"])
    gw = Gateway(args, log)
    asyncio.run(gw.run(args["seconds"]))
    gw.report()
    log.write(kind="done")


if __name__ == "__main__":
    main()
