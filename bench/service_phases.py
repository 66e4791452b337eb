"""service_phases: what a saturated asyncio HTTP service pays per request
while stallprof runs, measured on ONE service in alternating phases.

Separate runs of a saturated service (the overhead bench's method) spread
±15-30% in CPU per request on a shared VM, between runs alone: how many
requests each epoll_wait returns settles differently each time. Here one
bench/http_service.py (pinned to CPU 0) is loaded by one wrk (CPU 1) for
the whole run, and the configurations take turns: per phase the agent is
started, left 3 s to attach and settle, then the phase's PHASE seconds are
measured from the service's own log (requests and the loop thread's CPU
clock every 100 ms), and the agent is stopped. A round is one phase of each
configuration; each configuration's efficiency is bare ÷ its CPU per
request in the same round; the median over rounds is printed.

Usage (root): python3 bench/service_phases.py ROUNDS CONFIG...
  bare            nothing attached
  rec [ARGS]      SP record --pid SERVICE [ARGS] (e.g. `rec -F 199`)
  other [ARGS]    SP record --pid of an idle sleeper instead: what a process
                  stallprof does NOT watch pays while it runs
  old [ARGS]      as rec, with the binary SP_OLD (a build to compare)
  stop [ARGS]     as rec, the agent SIGSTOPped once attached: the probes'
                  cost without the agent's own CPU use
Environment: SP (default target/release/stallprof), SP_OLD, PY (default
python3), PHASE (seconds, default 3).
"""
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP = os.environ.get("SP", os.path.join(ROOT, "target/release/stallprof"))
PY = os.environ.get("PY", "python3")
PHASE = float(os.environ.get("PHASE", "3"))
SETTLE = 3.0


def start_agent(cfg, service_pid, sleeper_pid, out):
    words = cfg.split()
    kind, args = words[0], words[1:]
    if kind == "bare":
        return None
    binary = os.environ["SP_OLD"] if kind == "old" else SP
    target = sleeper_pid if kind == "other" else service_pid
    agent = subprocess.Popen(
        [binary, "record", "-q", "--pid", str(target), "-o", out] + args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if kind == "stop":
        time.sleep(SETTLE - 0.5)
        agent.send_signal(signal.SIGSTOP)
    return agent


def stop_agent(agent, cfg):
    if agent is None:
        return
    if cfg.split()[0] == "stop":
        agent.send_signal(signal.SIGCONT)
    agent.send_signal(signal.SIGINT)
    agent.wait()


def per_request(rows, t0, t1):
    """(µs of loop-thread CPU per request, requests/s) between t0 and t1."""
    pts = [r for r in rows if t0 <= r[0] <= t1]
    if len(pts) < 2 or pts[-1][1] == pts[0][1]:
        sys.exit(f"no requests served in a phase ({len(pts)} log lines): did wrk stop?")
    (a0, n0, c0), (a1, n1, c1) = pts[0], pts[-1]
    return (c1 - c0) / (n1 - n0) / 1000, (n1 - n0) / ((a1 - a0) / 1e9)


def main():
    if len(sys.argv) < 3 or "bare" not in sys.argv[2:]:
        sys.exit(__doc__)
    rounds, cfgs = int(sys.argv[1]), sys.argv[2:]
    work = tempfile.mkdtemp(prefix="service_phases.")
    port_file, log, out = (os.path.join(work, n) for n in ("port", "log", "out"))
    service = subprocess.Popen(
        ["taskset", "-c", "0", PY, os.path.join(ROOT, "bench/http_service.py"), port_file, log]
    )
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        time.sleep(0.1)
    port, pid, _tid = open(port_file).read().split()
    sleeper = subprocess.Popen([PY, "-c", "import time\nwhile True: time.sleep(0.01)"])
    budget = int(rounds * len(cfgs) * (PHASE + SETTLE + 3) + 30)
    wrk = subprocess.Popen(
        ["taskset", "-c", "1", "wrk", "-t1", "-c32", f"-d{budget}s", f"http://127.0.0.1:{port}/"],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(2)
    phases = []
    try:
        for r in range(rounds):
            for cfg in cfgs:
                agent = start_agent(cfg, pid, sleeper.pid, out)
                time.sleep(SETTLE)
                t0 = time.monotonic_ns()
                time.sleep(PHASE)
                phases.append((r, cfg, t0, time.monotonic_ns()))
                stop_agent(agent, cfg)
                subprocess.run(["rm", "-rf", out])
    finally:
        for p in (wrk, service, sleeper):
            p.kill()
    rows = [tuple(map(int, line.split())) for line in open(log) if len(line.split()) == 3]
    res = {}
    for r, cfg, t0, t1 in phases:
        res.setdefault(cfg, []).append(per_request(rows, t0, t1))
    for r in range(rounds):
        print(f"round {r}: " + "  ".join(f"{c}={res[c][r][0]:.2f}µs ({res[c][r][1]:.0f}/s)" for c in cfgs))
    for c in cfgs:
        eff = [res["bare"][i][0] / res[c][i][0] for i in range(rounds)]
        print(
            f"{c:18} µs/request median {statistics.median(x[0] for x in res[c]):6.2f}   "
            f"efficiency median {statistics.median(eff):.3f}   per round {[round(e, 3) for e in eff]}"
        )
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
