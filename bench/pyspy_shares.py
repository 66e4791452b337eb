"""pyspy_shares: per-cause shares of a loop thread's non-idle samples in
py-spy's raw (collapsed) output.

py-spy's raw format has no timestamps (its speedscope output neither; its
chrometrace output merges identical consecutive stacks and, without --idle,
keeps a stack "open" across the idle samples it drops), so the shares are
over every non-idle sample of the loop thread during the whole run, not over
the victim's stall intervals. In the bench victims the loop thread does
nothing but park and run the culprits (plus ~microsecond heartbeats), so its
non-idle samples are its stall time; the doc says so.

Only samples taken inside the event loop (a BaseEventLoop._run_once frame)
count: startup imports and calibration are not stall time.

A sample is *idle* when its innermost frame is the selector's select() (the
loop parked in epoll_wait: with --idle py-spy keeps those samples; without it
py-spy drops every sample it deems idle, including a thread blocked in a
culprit's recv()/sleep(), which is the point of comparing the two).

Usage (CLI): python3 pyspy_shares.py RAW LOOP_TID FUNC [FUNC...]
prints cause<TAB>share lines and samples<TAB>N.
"""
import sys


def frame_func(frame):
    """'Gateway.load_tokenizer (py_gateway.py:66)' -> 'Gateway.load_tokenizer'."""
    return frame.split(" (", 1)[0].strip()


def name_is(name, func):
    return name == func or name.endswith("." + func)


def parse(raw_path, loop_tid):
    """[(frames outermost-first, count)] of the loop thread."""
    out = []
    prefix = f"thread ({loop_tid})"
    with open(raw_path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.startswith(prefix):
                continue
            stack, _, count = line.rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue
            frames = stack.split(";")[1:]  # drop "thread (T): NAME"
            out.append((frames, n))
    return out


def is_idle(frames):
    if not frames:
        return True
    leaf = frame_func(frames[-1])
    return leaf.endswith(".select") and "selectors.py" in frames[-1]


def shares(raw_path, loop_tid, funcs):
    """{cause: share} over the loop thread's non-idle samples; 'other' for
    samples under none of funcs. Innermost matching culprit wins."""
    counts = {}
    total = 0
    for frames, n in parse(raw_path, loop_tid):
        if is_idle(frames):
            continue
        if not any(frame_func(fr).endswith("._run_once") for fr in frames):
            continue  # not inside the event loop (imports, calibration, shutdown)
        cause = "other"
        for fr in reversed(frames):
            name = frame_func(fr)
            hit = next((f for f in funcs if name_is(name, f)), None)
            if hit:
                cause = hit
                break
        counts[cause] = counts.get(cause, 0) + n
        total += n
    if total == 0:
        return {}, 0
    return {k: v / total for k, v in counts.items()}, total


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: pyspy_shares.py RAW LOOP_TID FUNC [FUNC...]")
    sh, n = shares(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    for k, v in sorted(sh.items()):
        print(f"{k}\t{v:.4f}")
    print(f"samples\t{n}")
