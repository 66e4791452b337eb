"""service_phases: what a saturated asyncio HTTP service pays per request
while an agent runs, measured on ONE service in alternating phases.

Separate runs of a saturated service (the overhead bench's rounds) spread
±15-30% in CPU per request on a shared VM, between runs alone: how many
requests each epoll_wait returns settles differently each time, and the
VM's neighbours move the host's speed by 20-40% over tens of seconds.
Here one bench/http_service.py (pinned to CPU 0) is loaded by one wrk
(CPU 1) for the whole run, and bare phases alternate with the agent's:
bare, A, bare, B, bare, A, bare, B, ..., bare. In each agent phase the
agent is started and given SETTLE (3 s) to attach and settle before the
phase's PHASE seconds are measured; then it is stopped, and the next bare
phase starts SETTLE later (its probes are gone and the kernel's perf hooks
off). Each phase's CPU per request is the median of its 100 ms windows,
from the service's own log (requests served and the loop thread's CPU
clock every 100 ms); each agent phase is compared with the bare phases
just before and after it: efficiency = mean(bare before, bare after) ÷
agent phase.

Usage (root): python3 bench/service_phases.py ROUNDS CONFIG...
  rec [ARGS]      SP record --pid SERVICE [ARGS] (e.g. `rec -F 199`)
  daemon [ARGS]   SP daemon (host-wide; it finds the service's loop)
  pyspy [ARGS]    PYSPY record -r 999 --pid SERVICE [ARGS] (the anchor;
                  `pyspy --nonblocking`)
  other [ARGS]    SP record --pid of an idle sleeper instead: what a
                  process stallprof does NOT watch pays while it runs
  old [ARGS]      as rec, with the binary SP_OLD (a build to compare)
  stop [ARGS]     as rec, the agent SIGSTOPped once attached: the probes'
                  cost without the agent's own CPU use
Environment: SP (default target/release/stallprof), SP_OLD, PYSPY, PY
(default python3), PHASE (seconds, default 3).

Prints each phase's comparison, then per CONFIG a line
"result CONFIG MEDIAN MIN MAX N" (efficiency over the N rounds), which
`cargo xtask bench --only overhead` reads. Everything it started is killed
however it ends.
"""
import atexit
import os
import shutil
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
    target = sleeper_pid if kind == "other" else service_pid
    if kind == "daemon":
        cmd = [SP, "daemon", "--listen", "127.0.0.1:0", "--data-dir", out] + args
    elif kind == "pyspy":
        pyspy = os.environ.get("PYSPY") or sys.exit("pyspy: set PYSPY to py-spy's path")
        cmd = [pyspy, "record", "-r", "999", "-f", "raw", "-o", os.path.join(out, "raw.txt"),
               "--pid", str(target)] + args
        os.makedirs(out, exist_ok=True)
    elif kind in ("rec", "other", "old", "stop"):
        binary = os.environ["SP_OLD"] if kind == "old" else SP
        cmd = [binary, "record", "-q", "--pid", str(target), "-o", out] + args
    else:
        sys.exit(f"unknown configuration {cfg!r}")
    agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if kind == "stop":
        time.sleep(SETTLE - 0.5)
        agent.send_signal(signal.SIGSTOP)
    return agent


def stop_agent(agent, cfg):
    if agent.poll() is not None:
        sys.exit(f"{cfg}: the agent exited during its phase ({agent.returncode})")
    if cfg.split()[0] == "stop":
        agent.send_signal(signal.SIGCONT)
    agent.send_signal(signal.SIGINT)
    agent.wait(timeout=60)


def per_request(rows, t0, t1):
    """Median over the 100 ms windows in [t0, t1] of µs of loop-thread CPU
    per request, and the phase's requests/s."""
    pts = [r for r in rows if t0 <= r[0] <= t1]
    windows = [
        (c1 - c0) / (n1 - n0) / 1000
        for (_, n0, c0), (_, n1, c1) in zip(pts, pts[1:])
        if n1 > n0
    ]
    if len(windows) < 5:
        sys.exit(f"too few windows with requests in a phase ({len(windows)}): did wrk stop?")
    (a0, n0, _), (a1, n1, _) = pts[0], pts[-1]
    return statistics.median(windows), (n1 - n0) / ((a1 - a0) / 1e9)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rounds, cfgs = int(sys.argv[1]), sys.argv[2:]
    work = tempfile.mkdtemp(prefix="service_phases.")
    started = []
    atexit.register(shutil.rmtree, work, True)
    atexit.register(lambda: [p.kill() for p in started if p.poll() is None])
    port_file, log, out = (os.path.join(work, n) for n in ("port", "log", "out"))
    service = subprocess.Popen(
        ["taskset", "-c", "0", PY, os.path.join(ROOT, "bench/http_service.py"), port_file, log]
    )
    started.append(service)
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        if service.poll() is not None:
            sys.exit("bench/http_service.py exited at start")
        time.sleep(0.1)
    port, pid, _tid = open(port_file).read().split()
    sleeper = subprocess.Popen([PY, "-c", "import time\nwhile True: time.sleep(0.01)"])
    started.append(sleeper)
    budget = int((rounds * len(cfgs) * 2 + 1) * (PHASE + SETTLE + 3) + 60)
    wrk = subprocess.Popen(
        ["taskset", "-c", "1", "wrk", "-t1", "-c32", f"-d{budget}s", f"http://127.0.0.1:{port}/"],
        stdout=subprocess.DEVNULL,
    )
    started.append(wrk)
    time.sleep(2)

    def bare_phase():
        time.sleep(SETTLE)
        t0 = time.monotonic_ns()
        time.sleep(PHASE)
        return t0, time.monotonic_ns()

    phases = [("bare", *bare_phase())]
    for _ in range(rounds):
        for cfg in cfgs:
            agent = start_agent(cfg, pid, sleeper.pid, out)
            started.append(agent)
            time.sleep(SETTLE)
            t0 = time.monotonic_ns()
            time.sleep(PHASE)
            phases.append((cfg, t0, time.monotonic_ns()))
            stop_agent(agent, cfg)
            shutil.rmtree(out, True)
            phases.append(("bare", *bare_phase()))
    for p in (wrk, service, sleeper):
        p.kill()
    rows = [tuple(map(int, line.split())) for line in open(log) if len(line.split()) == 3]
    eff = {c: [] for c in cfgs}
    for i in range(1, len(phases) - 1, 2):
        cfg = phases[i][0]
        before, on, after = (per_request(rows, *phases[j][1:]) for j in (i - 1, i, i + 1))
        e = (before[0] + after[0]) / 2 / on[0]
        eff[cfg].append(e)
        print(f"{cfg:24} bare {before[0]:6.2f} | {on[0]:6.2f} | bare {after[0]:6.2f} µs/request "
              f"({on[1]:.0f}/s)  efficiency {e:.3f}")
    for c in cfgs:
        v = eff[c]
        print(f"result {c.replace(' ', '_')} {statistics.median(v):.4f} {min(v):.4f} "
              f"{max(v):.4f} {len(v)}")


if __name__ == "__main__":
    main()
