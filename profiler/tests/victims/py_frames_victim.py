"""Victim for tests/python_frames.rs: spins in known functions, in the main
thread and in a thread named "py-spinner", after printing one line that tells
the test where (pid, TIDs, file, the spin loop's lines). Runs on 3.10-3.13.

Main thread:   <module> -> main -> outer -> middle -> spin_here
"py-spinner":  ... Thread.run -> Worker.run -> wörker_ēntry -> café -> 入口_𠀀
               -> outer -> middle -> spin_here
(Non-ASCII names on purpose, one per str kind: café is 1-byte Latin-1,
wörker_ēntry 2-byte, 入口_𠀀 4-byte.)
"""
import os
import sys
import threading


def spin_here():
    x = 0
    while True:  # spin-start
        x += 1
        if x > 1000:
            x = 0  # spin-end


def middle():
    spin_here()


def outer():
    middle()


def 入口_𠀀():
    outer()


def café():
    入口_𠀀()


def wörker_ēntry():
    café()


class Worker:
    def run(self):
        wörker_ēntry()


def marker_line(src, marker):
    return next(i for i, line in enumerate(src, 1) if line.rstrip().endswith(marker))


def main():
    # Never outlive a test that failed to kill us.
    threading.Timer(120, os._exit, (3,)).start()
    with open(__file__, encoding="utf-8") as f:
        src = f.read().splitlines()
    t = threading.Thread(target=Worker().run, name="py-spinner", daemon=True)
    t.start()  # returns once the thread runs, so native_id is set
    print(
        "pid=%d main_tid=%d thread_tid=%d spin_start=%d spin_end=%d version=%d.%d file=%s"
        % (
            os.getpid(),
            threading.get_native_id(),
            t.native_id,
            marker_line(src, "# spin-start"),
            marker_line(src, "# spin-end"),
            sys.version_info[0],
            sys.version_info[1],
            os.path.abspath(__file__),
        ),
        flush=True,
    )
    outer()


main()
