"""py_session: a voice-session handler (asyncio) whose every turn does three
synchronous things inside `async def`, as in the field report (一行同步代码拖垮
asyncio: a sync `Anthropic()` client streaming inside `async def`):

    SessionHandler.stream_completion()  a sync streaming HTTP client, as
                                        requests/httpx/vendor sync SDKs are:
                                        http.client POST with a socket
                                        timeout, then a server-sent-events
                                        stream (60 events, 3 ms apart, chunked
                                        transfer encoding) read line by line
                                        with resp.readline() (~200 ms)
    SessionHandler.send_webhook()       first attempt refused, time.sleep(0.1),
                                        second attempt delivered
    SessionHandler.parse_document()     pure-Python parsing of a résumé-like
                                        document (~40-80 ms)

The three run back-to-back in ONE task step per turn: one stall per turn.
Because the client has a timeout, CPython calls poll() on the socket before
every recv() (and every send()): each call makes one poll per event, 60+
polls on the client's socket inside one stall -- more than the 32 waits on
another key after which a loop-identity rule might take the client's poll for
a new event loop. time.sleep is clock_nanosleep on 3.11+ and select(0, ...)
on 3.10.

The upstreams are plain blocking server threads: blocking accept/recv/sendall
and time.sleep, no timeout, no selectors, no poll or epoll -- nothing that
looks like an event loop's wait.

Usage: python3 py_session.py LOG_PATH [--turns N]

Timeline: ~400 ms idle (attach), then N (default 4) turns 250 ms apart
(asyncio.sleep: the loop parks between them), ~200 ms idle, exit 0. A 10 ms
heartbeat runs throughout.

Log (JSON lines, flushed per line; time.monotonic_ns(), thread_time_ns()):
    {"kind":"ready","pid":P,"tid":T,"python":"3.11.7","file":ABS,"funcs":{NAME:{"name","qualname",
     "first_line","last_line","block_line","single_statement"}}}
    {"kind":"step","func":NAME,"qualname":QN,"turn":N,"tid":T,"start_ns","end_ns","cpu_ns","line"}
    {"kind":"retry_sleep","turn":N,"tid":T,"start_ns","end_ns","cpu_ns","line"}
    {"kind":"turn","turn":N,"tid":T,"start_ns","end_ns","cpu_ns"}
    {"kind":"done"}
block_line is the line carrying the "# BLOCKS" comment (checked to contain the
blocking call): the client's resp.readline() (where it waits in poll for each
event), the time.sleep() of the webhook, the parsing loop of parse_document.

Stdlib only; runs on pyenv 3.10-3.13 and Debian's /usr/bin/python3.11.
"""

import asyncio
import http.client
import inspect
import json
import os
import socket
import sys
import threading
import time

CHUNKS = 60
CHUNK_GAP_S = 0.003
RETRY_SLEEP_S = 0.1
DOC_SECTIONS = 2200


# ---- the slow upstreams: plain blocking server threads (blocking sockets
# without a timeout, no selector: they never call poll or epoll, so they are
# not event-loop threads) ----

def read_request(conn):
    """Reads one HTTP/1.1 request (headers, Content-Length body) off a
    blocking socket; returns (request line, body)."""
    f = conn.makefile("rb")
    request_line = f.readline()
    length = 0
    while True:
        line = f.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = f.read(length)
    f.close()
    return request_line, body


def llm_server(listener):
    """Answers each POST with a server-sent-events stream over chunked
    transfer encoding: CHUNKS events, CHUNK_GAP_S apart, one HTTP chunk (and
    one sendall, TCP_NODELAY) per event."""
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            read_request(conn)
            conn.sendall(b"HTTP/1.1 200 OK\r\n"
                         b"Content-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n")
            for i in range(CHUNKS):
                time.sleep(CHUNK_GAP_S)
                delta = json.dumps({"type": "text_delta", "index": i, "text": f"token-{i} "})
                event = f"event: delta\ndata: {delta}\n\n".encode()
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            conn.sendall(b"0\r\n\r\n")


def webhook_server(listener):
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)


def listen():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def refused_port():
    """A local port nobody listens on: connect() fails at once."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def make_document():
    parts = []
    for i in range(DOC_SECTIONS):
        parts.append(f"[section {i}]\n")
        parts.append(f"title: Experience item {i}\n")
        parts.append(f"company: Company {i % 37}; years: {i % 11}; skills: python, asyncio, c{i % 5}\n")
        parts.append("summary: " + " ".join(f"word{j}" for j in range(12)) + "\n")
    return "".join(parts)


class SessionHandler:
    def __init__(self, llm_addr, webhook_addr, dead_port, log):
        self.llm_addr = llm_addr
        self.webhook_addr = webhook_addr
        self.dead_port = dead_port
        self.document = make_document()
        self.log = log
        self.turn = 0

    def stream_completion(self):
        """The sync LLM client, as requests/httpx/vendor sync SDKs do it: POST
        over a connection with a socket timeout, then read the event stream
        line by line, one blocking read per event."""
        conn = http.client.HTTPConnection(*self.llm_addr, timeout=2)
        try:
            body = json.dumps({"model": "m", "max_tokens": 400, "stream": True,
                               "messages": [{"role": "user", "content": f"turn {self.turn}"}]})
            conn.request("POST", "/v1/messages", body=body.encode(),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"upstream answered {resp.status}")
            text = []
            while True:
                line = resp.readline()  # BLOCKS
                if not line:
                    break
                if line.startswith(b"data: "):
                    text.append(json.loads(line[6:])["text"])
            if len(text) != CHUNKS:
                raise RuntimeError(f"stream ended after {len(text)} of {CHUNKS} events")
            return "".join(text).encode()
        finally:
            conn.close()

    def send_webhook(self, body):
        """requests.post-like webhook with the utils retry helper's sleep."""
        for attempt, port in enumerate((self.dead_port, self.webhook_addr[1])):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(body)
                return attempt
            except ConnectionRefusedError:
                t0, c0 = time.monotonic_ns(), time.thread_time_ns()
                time.sleep(RETRY_SLEEP_S)  # BLOCKS
                t1, c1 = time.monotonic_ns(), time.thread_time_ns()
                self.log.pending.append(dict(kind="retry_sleep", turn=self.turn, tid=threading.get_native_id(),
                                             start_ns=t0, end_ns=t1, cpu_ns=c1 - c0))
        raise RuntimeError("webhook undeliverable")

    def parse_document(self):
        """A pure-Python parser: sections of `key: value; key: value` lines."""
        sections = []
        current = None
        for raw in self.document.splitlines():  # BLOCKS
            line = raw.strip()
            if line.startswith("[") and line.endswith("]"):
                current = {"name": line[1:-1], "fields": {}}
                sections.append(current)
                continue
            key, _, value = line.partition(": ")
            for item in value.split("; "):
                k, sep, v = item.partition(": ")
                if sep:
                    current["fields"][k] = v
                else:
                    words = []
                    for w in item.split(" "):
                        words.append(w.lower().capitalize())
                    current["fields"][key] = words
        return sections


STEPS = ["stream_completion", "send_webhook", "parse_document"]
BLOCKS = {
    "stream_completion": "resp.readline(",
    "send_webhook": "time.sleep(",
    "parse_document": "for raw in self.document.splitlines()",
}


def describe(fn, block_code):
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
        "single_statement": False,
    }


class Log:
    def __init__(self, path):
        self.f = open(path, "w")
        self.pending = []

    def write(self, **rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def flush_pending(self):
        for rec in self.pending:
            self.write(**rec)
        self.pending = []


def session_turn(h, log, turn, funcs):
    """One turn of one session: all three culprits, back-to-back."""
    tid = threading.get_native_id()
    h.turn = turn
    steps = []
    # thread_time_ns() is a real syscall (a preemption point): read it
    # outside the monotonic window of each step.
    rc0 = time.thread_time_ns()
    r0 = time.monotonic_ns()

    def timed(name, fn, *args):
        c0 = time.thread_time_ns()
        t0 = time.monotonic_ns()
        out = fn(*args)
        t1 = time.monotonic_ns()
        c1 = time.thread_time_ns()
        steps.append((name, t0, t1, c1 - c0))
        return out

    reply = timed("stream_completion", h.stream_completion)
    timed("send_webhook", h.send_webhook, b"POST /hook\n" + reply[:64])
    # Keep the parse result: freeing it is not parse_document's work.
    sections = timed("parse_document", h.parse_document)
    del sections, reply
    t1 = time.monotonic_ns()
    c1 = time.thread_time_ns()
    # Logged after the turn so the writes are not inside the steps.
    for name, a, b, cpu in steps:
        log.write(kind="step", func=name, qualname=funcs[name]["qualname"], turn=turn, tid=tid,
                  start_ns=a, end_ns=b, cpu_ns=cpu, line=funcs[name]["block_line"])
    for rec in log.pending:
        rec["line"] = funcs["send_webhook"]["block_line"]
    log.flush_pending()
    log.write(kind="turn", turn=turn, tid=tid, start_ns=r0, end_ns=t1, cpu_ns=c1 - rc0)


async def heartbeat():
    while True:
        await asyncio.sleep(0.010)


async def main(log, h, funcs, turns):
    # ts_ns: the loop has started and runs its first task step; the loop's
    # busy periods before it are the interpreter's start-up, not a turn's.
    log.write(kind="ready", ts_ns=time.monotonic_ns(), pid=os.getpid(), tid=threading.get_native_id(),
              python=".".join(map(str, sys.version_info[:3])), file=os.path.abspath(__file__), funcs=funcs)
    hb = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.4)
    for turn in range(turns):
        await asyncio.sleep(0.25)
        session_turn(h, log, turn, funcs)
    await asyncio.sleep(0.2)
    hb.cancel()
    log.write(kind="done")


def parse_args(argv):
    if len(argv) < 2 or argv[1].startswith("-"):
        sys.exit("usage: py_session.py LOG_PATH [--turns N]")
    log_path, turns = argv[1], 4
    rest = argv[2:]
    while rest:
        flag = rest.pop(0)
        if flag == "--turns" and rest:
            turns = int(rest.pop(0))
        else:
            sys.exit(f"py_session.py: unknown argument {flag!r}")
    return log_path, turns


if __name__ == "__main__":
    log_path, turns = parse_args(sys.argv)
    funcs = {name: describe(getattr(SessionHandler, name), BLOCKS[name]) for name in STEPS}
    llm, hook = listen(), listen()
    threading.Thread(target=llm_server, args=(llm,), name="llm_server", daemon=True).start()
    threading.Thread(target=webhook_server, args=(hook,), name="webhook_server", daemon=True).start()
    log = Log(log_path)
    h = SessionHandler(llm.getsockname(), hook.getsockname(), refused_port(), log)
    asyncio.run(main(log, h, funcs, turns))
