"""watchdog: run an asyncio victim script with the in-process loop watchdog of
the field report "Who froze the event loop?" (/work/shared/seeds/
who-froze-the-event-loop.txt): a heartbeat task on the loop, and a watchdog
thread that, once the heartbeat is overdue, grabs the loop thread's stack
with sys._current_frames() (at most two stacks per stall), and when the loop
resumes reports the stall (gap - tick) with the stacks it caught.

Only the parameters differ from the article (tick 0.5 s, margin 0.1 s, poll
25 ms), scaled to the bench's stall threshold so that both tools look for the
same stalls: tick 10 ms, margin = the threshold, poll 5 ms.

Usage: python3 watchdog.py WD_LOG THRESHOLD_MS VICTIM.py [VICTIM ARGS...]

The victim runs as __main__ (runpy); asyncio.run is wrapped so the heartbeat
runs on the victim's loop. WD_LOG gets one JSON line per stall:
    {"kind":"wd_stall","start_ns":..,"end_ns":..,"blocked_ms":..,
     "stacks":[["outer", ..., "inner"], ...]}
start_ns = the previous beat + tick (when the next beat was due), end_ns = the
late beat (time.monotonic_ns(), CLOCK_MONOTONIC, comparable with the victims'
logs). Function names are FrameSummary.name (co_name).
"""
import asyncio
import json
import runpy
import sys
import threading
import time
import traceback


class LoopWatchdog:
    """The article's LoopWatchdog, logging to a file; created on the loop thread."""

    def __init__(self, loop, out, tick, margin, poll):
        self.loop, self.out = loop, out
        self.tick, self.limit, self.poll = tick, tick + margin, poll
        self.loop_thread = threading.get_ident()
        self.heartbeat = self.seen = time.monotonic()
        self.stacks = []
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    async def beat(self):
        while True:
            self.heartbeat = time.monotonic()
            await asyncio.sleep(self.tick)

    def report(self, seen, beat, stacks):
        rec = {
            "kind": "wd_stall",
            "start_ns": int((seen + self.tick) * 1e9),
            "end_ns": int(beat * 1e9),
            "blocked_ms": round((beat - seen - self.tick) * 1000, 3),
            "stacks": [[f.name for f in st] for st in stacks],
        }
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()

    def _watch(self):
        while True:
            time.sleep(self.poll)
            beat = self.heartbeat
            if beat != self.seen:  # the loop ticked
                gap, seen, self.seen = beat - self.seen, self.seen, beat
                stacks, self.stacks = self.stacks, []
                if gap > self.limit:
                    self.loop.call_soon_threadsafe(self.report, seen, beat, stacks)
                continue
            overdue = time.monotonic() - beat > self.limit
            if overdue and len(self.stacks) < 2:
                frame = sys._current_frames().get(self.loop_thread)
                if self.heartbeat == beat:  # still stuck: the stack is the culprit
                    self.stacks.append(traceback.extract_stack(frame, limit=15))


def main():
    if len(sys.argv) < 4:
        sys.exit("usage: watchdog.py WD_LOG THRESHOLD_MS VICTIM.py [ARGS...]")
    out = open(sys.argv[1], "w")
    margin = float(sys.argv[2]) / 1000
    victim = sys.argv[3]
    sys.argv = sys.argv[3:]
    orig_run = asyncio.run

    def run(coro, **kw):
        async def wrapped():
            wd = LoopWatchdog(asyncio.get_running_loop(), out, tick=0.010, margin=margin, poll=0.005)
            t = asyncio.ensure_future(wd.beat())
            try:
                return await coro
            finally:
                t.cancel()

        return orig_run(wrapped(), **kw)

    asyncio.run = run
    runpy.run_path(victim, run_name="__main__")


if __name__ == "__main__":
    main()
