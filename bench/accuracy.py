"""accuracy: score one recording of one victim against the victim's own
CLOCK_MONOTONIC log. Used by `cargo xtask bench` (section 1); runnable alone.

Usage:
  python3 accuracy.py VICTIM LOG THRESHOLD_MS TOOL OUTPUT
    VICTIM  c_loop | blocking_client | gateway | gil | tokio | node | node_noflags
    TOOL    stallprof (OUTPUT = stalls.json)
            watchdog  (OUTPUT = bench/watchdog.py's log)
            stallprof-native  (the same, but a culprit also matches its
                      native callee: NATIVE_ALIASES, for Node's interpreted JS)
            pyspy     (OUTPUT = py-spy raw output; shares only)

Prints `key<TAB>value` lines: truth, counted, detected, in_window, recall,
precision, dur_err_med_ms, dur_err_max_ms, tv_points, and share:CAUSE
lines (true:measured).

Definitions (docs/benchmarks.md repeats them):
- truth: the victim's stalled calls / iterations (per victim below), each
  with a cause. Counted for recall: truth intervals >= 1.5 x threshold (the
  loop's own bookkeeping makes borderline ones unreliable either way).
- recall: counted truth intervals that some reported stall overlaps.
- precision: reported stalls inside the evaluation window [first truth start
  - 200 ms, last truth end + 200 ms] that overlap some truth interval (of any
  length). Startup work before the window is not judged.
- duration error: |reported - true| for each counted truth interval and the
  reported stall that overlaps it most.
- shares: the true share of each cause in the counted truth time, against
  the tool's share of the matched stalls' time per cause (stallprof: stack
  weights by innermost culprit frame; watchdog: each stall's blocked time
  split evenly over the stacks it caught, "unknown" when it caught none;
  py-spy: see pyspy_shares.py). Time under no culprit is "other".
  tv_points = 100 x total-variation distance = 50 x sum |true - measured|.
"""
import json
import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))
import pyspy_shares  # noqa: E402


def read_log(path):
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


# ---- truth per victim: list of (start, end, {cause: ns}), the loop tid, culprit funcs

def truth_of(victim, log):
    tr = []
    funcs = []
    loop_tid = None
    for r in log:
        if r.get("kind") == "ready":
            loop_tid = r.get("tid")
    if victim == "c_loop":
        funcs = ["spin_for_ms", "sleep_for_ms", "read_slow_pipe"]
        for r in log:
            if r.get("kind") in ("spin", "sleep", "pipe"):
                s, e = r["busy_start_ns"], r["busy_end_ns"]
                tr.append((s, e, {r["func"]: e - s}))
    elif victim in ("blocking_client", "tokio", "node", "node_noflags"):
        kinds = {"blocking_client": ("blocking_client", "sleep", "cpu"),
                 "tokio": ("sleep", "spin"), "node": ("pbkdf2", "json"),
                 "node_noflags": ("pbkdf2", "json", "regex", "pipe")}[victim]
        funcs = {"blocking_client": ["fetch_blocking", "retry_with_sleep", "burn_cpu"],
                 "tokio": ["blocking_sleep", "cpu_spin"], "node": ["deriveKey", "parseBig"],
                 "node_noflags": ["deriveKey", "parseBig", "matchEvil", "readSlowPipe"]}[victim]
        for r in log:
            if r.get("kind") in kinds:
                s, e = int(r["start_ns"]), int(r["end_ns"])
                tr.append((s, e, {r["func"]: e - s}))
    elif victim == "gateway":
        funcs = ["make_tls_contexts", "load_tokenizer", "compress_payload", "score_candidates"]
        steps = {}
        for r in log:
            if r.get("kind") == "step":
                steps.setdefault(r["req"], {})[r["func"]] = r["end_ns"] - r["start_ns"]
        for r in log:
            if r.get("kind") == "request":
                s, e = r["start_ns"], r["end_ns"]
                causes = dict(steps.get(r["req"], {}))
                rest = (e - s) - sum(causes.values())
                if rest > 0:
                    causes["other"] = rest
                tr.append((s, e, causes))
    elif victim == "gil":
        # The loop's stall is a late heartbeat (due -> ran); the part of it
        # during which hog() held the GIL (the worker's regex records) is the
        # GIL wait, the rest (run-queue wait once the GIL is free, the
        # heartbeat itself, a GC pass) is "other".
        funcs = ["gil_wait"]
        held = [(r["start_ns"], r["end_ns"]) for r in log if r.get("kind") == "regex"]
        for r in log:
            if r.get("kind") == "late":
                s, e = r["start_ns"], r["end_ns"]
                g = sum(overlap(s, e, h0, h1) for h0, h1 in held)
                causes = {"gil_wait": g}
                if e - s - g > 0:
                    causes["other"] = e - s - g
                tr.append((s, e, causes))
    else:
        sys.exit(f"unknown victim {victim}")
    return tr, loop_tid, funcs


# ---- what the tools reported: list of (start, end, {cause: ns})

def frame_is(name, func):
    """stallprof frame name `name` is the culprit `func` (Python qualname,
    Rust path, C name, a JavaScript function read from V8's memory, or a
    V8 perf-map `JS:*func /path:line:col`)."""
    for p in ("JS:", "LazyCompile:", "Function:"):
        if name.startswith(p):
            name = name[len(p):].lstrip("~^+*").split(" ")[0]
            break
    base = name.split("(", 1)[0].strip()
    return base == func or base.endswith("::" + func) or base.endswith("." + func)


# The native code each culprit spends its time in, for "stallprof-native":
# a JS function run by V8's interpreter has no perf-map name of its own (only
# compiled code does), so its stacks show the callee, not the function.
NATIVE_ALIASES = {
    "deriveKey": ["PKCS5_PBKDF2_HMAC", "node::crypto::PBKDF2Traits::DeriveBits"],
    "parseBig": ["v8::internal::Builtin_JsonParse", "v8::internal::JsonParser<unsigned char>::ParseJson"],
}


def frame_is_alias(name, func):
    return any(name.startswith(a) for a in NATIVE_ALIASES.get(func, []))


def load_stallprof(path):
    """stalls.json with whole frames in every part (version 1's shape):
    version 2 (docs/format.md) names frames and stacks by id."""
    rec = json.load(open(path))
    if "format" not in rec:
        return rec
    if rec["format"] != "stallprof-recording" or rec["version"] != 2:
        sys.exit(f"{path}: unknown recording format {rec['format']} {rec.get('version')}")
    stacks = [[rec["frames"][i] for i in ids] for ids in rec["stacks"]]
    for s in rec["stalls"]:
        s["stacks"] = []
        for p in s.pop("parts"):
            p["frames"] = stacks[p.pop("stack")]
            holder = p.get("gil_holder")
            if holder:
                holder["frames"] = stacks[holder.pop("stack")]
            s["stacks"].append(p)
    return rec


def stallprof_stalls(path, victim, funcs, aliases=False):
    rec = load_stallprof(path)
    out = []
    for s in rec["stalls"]:
        causes = {}
        for st in s["stacks"]:
            cause = "other"
            if victim == "gil":
                holder = st.get("gil_holder") or {}
                # A GIL wait, or run-queue time between the waiter's timed
                # GIL waits, that names hog() as the holder.
                if st["kind"] in ("gil_wait", "runqueue") and any(frame_is(f["name"], "hog") for f in holder.get("frames", [])):
                    cause = "gil_wait"
            else:
                for f in reversed(st["frames"]):
                    hit = next((fn for fn in funcs if frame_is(f["name"], fn)
                                or (aliases and frame_is_alias(f["name"], fn))), None)
                    if hit:
                        cause = hit
                        break
            causes[cause] = causes.get(cause, 0) + st["weight_ns"]
        out.append((s["start_ns"], s["end_ns"], causes))
    return out, rec


def watchdog_stalls(path, victim, funcs):
    out = []
    for r in read_log(path):
        if r.get("kind") != "wd_stall":
            continue
        dur = r["end_ns"] - r["start_ns"]
        causes = {}
        stacks = r["stacks"]
        if not stacks:
            causes["unknown"] = dur
        for st in stacks:
            cause = "other"
            for name in reversed(st):
                hit = next((fn for fn in funcs if name == fn), None)
                if hit:
                    cause = hit
                    break
            causes[cause] = causes.get(cause, 0) + dur / len(stacks)
        out.append((r["start_ns"], r["end_ns"], causes))
    return out


def overlap(a0, a1, b0, b1):
    return max(0, min(a1, b1) - max(a0, b0))


def tv(p, q):
    keys = set(p) | set(q)
    return 50.0 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)


def normalize(d):
    t = sum(d.values())
    return {k: v / t for k, v in d.items()} if t > 0 else {}


def main():
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    victim, log_path, thr_ms, tool, output = sys.argv[1:]
    thr = float(thr_ms) * 1e6
    truth, loop_tid, funcs = truth_of(victim, read_log(log_path))
    counted = [t for t in truth if t[1] - t[0] >= 1.5 * thr]
    true_causes = {}
    for _, _, c in counted:
        for k, v in c.items():
            true_causes[k] = true_causes.get(k, 0) + v
    p_true = normalize(true_causes)
    print(f"truth\t{len(truth)}")
    print(f"counted\t{len(counted)}")

    if tool == "pyspy":
        if victim == "gil":
            # py-spy has no notion of a GIL wait: the loop's samples are in select().
            pass
        sh, n = pyspy_shares.shares(output, loop_tid, funcs)
        print(f"samples\t{n}")
        if n:
            print(f"tv_points\t{tv(p_true, sh):.1f}")
        for k in sorted(set(p_true) | set(sh)):
            print(f"share:{k}\t{p_true.get(k, 0):.3f}:{sh.get(k, 0):.3f}")
        return

    if tool in ("stallprof", "stallprof-native"):
        stalls, _ = stallprof_stalls(output, victim, funcs, aliases=tool == "stallprof-native")
    elif tool == "watchdog":
        stalls = watchdog_stalls(output, victim, funcs)
    else:
        sys.exit(f"unknown tool {tool}")

    if truth:
        w0 = min(t[0] for t in truth) - 200_000_000
        w1 = max(t[1] for t in truth) + 200_000_000
    else:
        w0 = w1 = 0
    in_window = [s for s in stalls if s[1] > w0 and s[0] < w1]
    good = [s for s in in_window if any(overlap(s[0], s[1], t[0], t[1]) > 0 for t in truth)]
    print(f"detected\t{len(stalls)}")
    print(f"in_window\t{len(in_window)}")
    if counted:
        found = 0
        errs = []
        matched = {}
        for t in counted:
            best = max(stalls, key=lambda s: overlap(s[0], s[1], t[0], t[1]), default=None)
            if best is not None and overlap(best[0], best[1], t[0], t[1]) > 0:
                found += 1
                errs.append(abs((best[1] - best[0]) - (t[1] - t[0])) / 1e6)
                matched[(best[0], best[1])] = best
        print(f"recall\t{found / len(counted):.3f}")
        if errs:
            errs.sort()
            print(f"dur_err_med_ms\t{errs[len(errs) // 2]:.1f}")
            print(f"dur_err_max_ms\t{errs[-1]:.1f}")
        meas = {}
        for s in matched.values():
            for k, v in s[2].items():
                meas[k] = meas.get(k, 0) + v
        p_meas = normalize(meas)
        if p_meas:
            print(f"tv_points\t{tv(p_true, p_meas):.1f}")
        for k in sorted(set(p_true) | set(p_meas)):
            print(f"share:{k}\t{p_true.get(k, 0):.3f}:{p_meas.get(k, 0):.3f}")
    if in_window:
        print(f"precision\t{len(good) / len(in_window):.3f}")


if __name__ == "__main__":
    main()
