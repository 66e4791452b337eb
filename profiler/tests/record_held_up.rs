//! Issue 35 ("Who waited"), root integration tests: what each stall held
//! up. tests/victims/py_timers.py serves 40 streams on a fixed 20 ms chunk
//! schedule (each chunk a timer of the loop: `asyncio.sleep(due - now)`)
//! and blocks its loop as planned (time.sleep and CPU burns of 80-300 ms,
//! one with every stream paused: no timer pending); it logs each chunk's
//! due time and when its stream resumed, on its own CLOCK_MONOTONIC.
//!
//! Plain asyncio (the venv's 3.11, pyenv 3.10, 3.12, 3.13, the container
//! sandbox's 3.14 and 3.15, attached by pid in its own namespaces): for each
//! planned block that delayed chunks, the stall over it says how many
//! timers it delayed (the victim's chunks with a timer due inside the
//! stall, within 10%; one due before the blocking call's first
//! millisecond may have had its timer run just before the call, one due
//! just before the stall may still be waiting as a timer, and each counts
//! either way) and how late the worst ran (the victim's worst
//! chunk lateness among them, within 5 ms at the 90th percentile over the
//! 11 blocks: one whose chunks were also held up after it — the loop
//! waiting for a CPU or busy right after the stall, no part of the stall,
//! seen once as 12.5 ms on a machine shared with builds — does not fail
//! it); the paused block's stall says no timer was due; the summary's
//! headline p99 is the victim's own p99, defined the same way (nearest
//! rank, over every chunk with a timer due inside a stall whose loop was
//! read), within 5 ms.
//!
//! uvloop (0.23, the venv's 3.11): the same checks, its loop's `_timers`
//! set and `_ready` deque read instead of asyncio's heap and deque (its
//! `loop.time()` counts whole milliseconds: within the same bounds).
//!
//! Node (the host's Node 20, tests/victims/node_timers.js): the same
//! checks, each stream a `setInterval` and each block in a `setTimeout`
//! callback; its timers read from V8's heap (`timerListQueue`'s lists of
//! `Timeout`s), their clock anchored on libuv's; the worst lateness within
//! 10 ms at the 90th percentile.
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

const THRESHOLD_MS: u64 = 50;

#[test]
fn held_up_asyncio_venv_3_11() {
    check_asyncio("held_up_asyncio_venv_3_11", &asgi_python());
}

#[test]
fn held_up_asyncio_pyenv_3_10() {
    check_asyncio("held_up_asyncio_pyenv_3_10", &require_python(3, 10));
}

#[test]
fn held_up_asyncio_pyenv_3_12() {
    check_asyncio("held_up_asyncio_pyenv_3_12", &require_python(3, 12));
}

#[test]
fn held_up_asyncio_pyenv_3_13() {
    check_asyncio("held_up_asyncio_pyenv_3_13", &require_python(3, 13));
}

/// CPython 3.14 and 3.15 (Debian's, in the container sandbox): the loop
/// found through the thread state's `asyncio_running_loop`.
#[test]
fn held_up_asyncio_container_3_14() {
    check_asyncio_in_container("held_up_asyncio_container_3_14", "python3.14");
}

#[test]
fn held_up_asyncio_container_3_15() {
    check_asyncio_in_container("held_up_asyncio_container_3_15", "python3.15");
}

/// uvloop 0.23 (the venv's 3.11): its loop's `_timers` set and `_ready`
/// deque, read the same way the victim's chunks are checked.
#[test]
fn held_up_uvloop_venv_3_11() {
    let test = "held_up_uvloop_venv_3_11";
    let Some(run) = record(test, &asgi_python(), &["--uvloop"]) else {
        return;
    };
    check_loop_run(test, run, "uvloop", 5 * MS);
}

/// Node's timers (Node 20, the host's): the same checks, each stream a
/// `setInterval` (tests/victims/node_timers.js), the blocks in a
/// `setTimeout` callback (a timer pass, the loop's timer clock anchored
/// from `processTimers`' argument); the worst lateness within 10 ms at the
/// 90th percentile, as the issue asks of Node.
#[test]
fn held_up_node_timers() {
    let test = "held_up_node_timers";
    let Some(run) = record_victim(test, "node".as_ref(), "node_timers.js", &[]) else {
        return;
    };
    check_loop_run(test, run, "node", 10 * MS);
}

/// Node 24 as Debian ships it, in the container sandbox (`libnode.so.137`
/// on a shared `libuv.so.1` whose static symbols are stripped: the default
/// loop is found through `uv_default_loop`'s code), attached by host pid.
#[test]
fn held_up_node_timers_container_24() {
    let test = "held_up_node_timers_container_24";
    let Some(run) = record_victim_in_container(test, "node", || {
        ContainerVictim::spawn_shell(test, "node_timers.js", |dir| {
            format!("node /victims/node_timers.js {dir}/victim.jsonl")
        })
    }) else {
        return;
    };
    check_loop_run(test, run, "node", 10 * MS);
}

fn check_asyncio(test: &str, python: &Path) {
    let Some(run) = record(test, python, &[]) else {
        return;
    };
    check_loop_run(test, run, "asyncio", 5 * MS);
}

fn check_asyncio_in_container(test: &str, python: &str) {
    let Some(run) = record_in_container(test, python) else {
        return;
    };
    check_loop_run(test, run, "asyncio", 5 * MS);
}

/// The checks of one recording of a timers victim; `worst_within`: how far
/// stallprof's worst lateness of a stall may be from the victim's at the
/// 90th percentile.
fn check_loop_run(test: &str, run: Run, want_loop: &str, worst_within: u64) {
    let mut c = Checks::new(run.context());
    check_probes(&mut c, &run.rec["probes"]);
    c.check(run.ready["loop"] == want_loop, || {
        format!(
            "the victim ran loop {}, want {want_loop}",
            run.ready["loop"]
        )
    });
    let chunks = run.timer_chunks();
    let blocks = run.blocks();
    c.check(blocks.len() == 12, || {
        format!("the victim logged {} blocks, want 12", blocks.len())
    });
    let mut worst_diffs: Vec<u64> = Vec::new();
    let mut table = String::new();
    for b in &blocks {
        let Some(s) = run.stall_over(&mut c, b) else {
            continue;
        };
        let (start, end) = (num(s, "start_ns"), num(s, "end_ns"));
        let Some(read) = s["held_up"].get("read") else {
            c.fail(format!(
                "{}: held_up {}, want it read",
                who(b),
                s["held_up"]
            ));
            continue;
        };
        let sp: Vec<u64> = read["timers_late_ns"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_u64().unwrap()).collect())
            .unwrap_or_default();
        // The victim's chunks whose timer came due inside the stall.
        let mut late: Vec<u64> = chunks
            .iter()
            .filter(|&&(due, _)| due >= start && due <= end)
            .map(|&(due, at)| at.saturating_sub(due))
            .collect();
        late.sort_unstable();
        table += &format!(
            "  {:5} {:>4} ms  stall {:7.1} ms: stallprof {:3} timers, worst {:7.1} ms | victim {:3} chunks, worst {:7.1} ms\n",
            b["how"].as_str().unwrap_or("?"),
            b["planned_ms"],
            ms(end - start),
            sp.len(),
            ms(sp.first().copied().unwrap_or(0)),
            late.len(),
            ms(late.last().copied().unwrap_or(0)),
        );
        if b["how"] == "idle" {
            c.check(sp.is_empty() && late.is_empty(), || {
                format!(
                    "{}: every stream was paused, want no timer due: stallprof {} timers, the victim {} chunks",
                    who(b),
                    sp.len(),
                    late.len()
                )
            });
            continue;
        }
        c.check(!late.is_empty(), || {
            format!(
                "{}: no chunk of the victim was due inside the stall",
                who(b)
            )
        });
        // A chunk due before the blocking call began (or in its first
        // millisecond: uvloop runs every timer of the current millisecond)
        // may have had its timer run just before it: its stream's step
        // then waits in the ready queue, no longer a timer. And a chunk due
        // before the stall began whose timer had not run yet (the loop
        // late already: a busy machine) waits through it as a timer. So
        // the victim's count is a range: from the chunks due after the
        // call's first millisecond to every chunk due by the stall's end
        // that resumed after the call.
        let (t0, t1) = (num(b, "start_ns"), num(b, "end_ns"));
        let firm = chunks
            .iter()
            .filter(|&&(due, _)| due >= t0.max(start) + MS && due <= end)
            .count();
        let held = chunks
            .iter()
            .filter(|&&(due, at)| due <= end && at >= t1)
            .count()
            .max(late.len());
        let (n_sp, n_firm, n_held) = (sp.len() as f64, firm as f64, held as f64);
        c.check(n_sp >= 0.9 * n_firm && n_sp <= 1.1 * n_held, || {
            format!(
                "{}: stallprof counts {} delayed timers; the victim {} chunks due inside the stall, \
                 {} of them after the blocking call's first millisecond, {} due by its end and resumed \
                 after the call (want within 10% of {}..{})",
                who(b),
                sp.len(),
                late.len(),
                firm,
                held,
                firm,
                held
            )
        });
        if let (Some(&w_sp), Some(&w_v)) = (sp.first(), late.last()) {
            worst_diffs.push(w_sp.abs_diff(w_v));
        }
    }
    worst_diffs.sort_unstable();
    let p90 = nearest_rank(&worst_diffs, 0.90);
    c.check(!worst_diffs.is_empty() && p90 <= worst_within, || {
        format!(
            "stallprof's worst timer lateness differs from the victim's by {:.1} ms at the 90th percentile \
             over {} stalls (want at most {:.0} ms): {:?} ms",
            ms(p90),
            worst_diffs.len(),
            ms(worst_within),
            worst_diffs.iter().map(|&d| ms(d)).collect::<Vec<_>>()
        )
    });
    // The headline: p99 over every delayed timer of the stalls read, the
    // victim's the same way over its chunks.
    let mut all_late: Vec<u64> = Vec::new();
    for s in run.stalls() {
        if s["held_up"].get("read").is_none() {
            continue;
        }
        let (start, end) = (num(s, "start_ns"), num(s, "end_ns"));
        all_late.extend(
            chunks
                .iter()
                .filter(|&&(due, _)| due >= start && due <= end)
                .map(|&(due, at)| at.saturating_sub(due)),
        );
    }
    all_late.sort_unstable();
    let victim_p99 = nearest_rank(&all_late, 0.99);
    match headline_p99(&run.summary) {
        Some(p99) => c.check(p99.abs_diff(victim_p99) <= 5 * MS, || {
            format!(
                "the summary's p99 timer lateness is {:.1} ms, the victim's p99 chunk lateness {:.1} ms \
                 (over {} chunks; want within 5 ms)",
                ms(p99),
                ms(victim_p99),
                all_late.len()
            )
        }),
        None => c.fail("the summary has no \"timers ran up to … (p99 over the recording …)\" headline".into()),
    }
    eprintln!(
        "{test}: victim p99 {:.1} ms over {} chunks; per block:\n{table}",
        ms(victim_p99),
        all_late.len()
    );
    c.add_context(&table);
    c.finish();
}

struct Run {
    _dir: Scratch,
    log: Vec<Value>,
    ready: Value,
    rec: Value,
    summary: String,
}

impl Run {
    /// The victim's log (it must have finished) and the recording in `out`.
    fn read(dir: Scratch, log_path: &Path, out: &Path, summary: String) -> Run {
        let log = read_log(log_path);
        assert!(
            log.iter().any(|r| r["kind"] == "done"),
            "the victim did not finish; log:\n{}",
            std::fs::read_to_string(log_path).unwrap_or_default()
        );
        let ready = log
            .iter()
            .find(|r| r["kind"] == "ready")
            .expect("no ready record")
            .clone();
        let rec = read_stalls_json(&out.join("stalls.json"));
        Run {
            _dir: dir,
            log,
            ready,
            rec,
            summary,
        }
    }

    fn context(&self) -> String {
        format!("summary:\n{}", self.summary)
    }

    fn blocks(&self) -> Vec<&Value> {
        self.log.iter().filter(|r| r["kind"] == "block").collect()
    }

    fn stalls(&self) -> &Vec<Value> {
        self.rec["stalls"].as_array().expect("stalls")
    }

    /// (due, resumed) of every chunk that waited on a timer.
    fn timer_chunks(&self) -> Vec<(u64, u64)> {
        self.log
            .iter()
            .filter(|r| r["kind"] == "chunk" && r["timer"] == true)
            .map(|r| (num(r, "due_ns"), num(r, "at_ns")))
            .collect()
    }

    /// The one stall of the loop thread covering block `b` (the victim
    /// logs its tid as its PID namespace has it: a stall's `ns_tid` when
    /// it has one).
    fn stall_over(&self, c: &mut Checks, b: &Value) -> Option<&Value> {
        let (t0, t1) = (num(b, "start_ns"), num(b, "end_ns"));
        let tid = self.ready["tid"].as_u64().unwrap();
        let over: Vec<&Value> = self
            .stalls()
            .iter()
            .filter(|s| s.get("ns_tid").unwrap_or(&s["tid"]).as_u64() == Some(tid))
            .filter(|s| num(s, "start_ns") <= t0 && num(s, "end_ns") >= t1)
            .collect();
        if over.len() != 1 {
            c.fail(format!(
                "{}: {} stalls cover it, want one",
                who(b),
                over.len()
            ));
            return None;
        }
        Some(over[0])
    }
}

fn record(test: &str, python: &Path, args: &[&str]) -> Option<Run> {
    record_victim(test, python.as_os_str(), "py_timers.py", args)
}

/// `stallprof record -- RUNTIME VICTIM LOG ARGS…` of a victim of
/// tests/victims, and its log.
fn record_victim(
    test: &str,
    runtime: &std::ffi::OsStr,
    victim: &str,
    args: &[&str],
) -> Option<Run> {
    if !require_root_and_bpf(test) {
        return None;
    }
    let _serial = serial();
    let dir = Scratch::new(test);
    let out = dir.join("out");
    let log_path = dir.join("victim.jsonl");
    let mut argv: Vec<std::ffi::OsString> = vec![
        "record".into(),
        "--threshold".into(),
        format!("{THRESHOLD_MS}ms").into(),
        "-o".into(),
        out.clone().into(),
        "--".into(),
        runtime.into(),
        victims_dir().join(victim).into(),
        log_path.clone().into(),
    ];
    argv.extend(args.iter().map(Into::into));
    let run = run_stallprof(&argv, Duration::from_secs(90));
    assert!(
        run.status.success(),
        "stallprof record -- {} {victim} failed:\n{}",
        runtime.to_string_lossy(),
        run.describe()
    );
    Some(Run::read(dir, &log_path, &out, run.stdout))
}

/// [`record`] of the victim in the container sandbox (its own PID and
/// mount namespaces, Debian testing's `python`), attached by host pid.
fn record_in_container(test: &str, python: &str) -> Option<Run> {
    record_victim_in_container(test, python, || {
        ContainerVictim::spawn_python(test, python, "py_timers.py", &[])
    })
}

/// [`record`] of a victim `spawn` starts in the container sandbox (running
/// `runtime`), attached by host pid.
fn record_victim_in_container(
    test: &str,
    runtime: &str,
    spawn: impl FnOnce() -> ContainerVictim,
) -> Option<Run> {
    if !require_root_and_bpf(test) {
        return None;
    }
    let _serial = serial();
    let dir = Scratch::new(test);
    let out = dir.join("out");
    let mut victim = spawn();
    let mut prof = Profiler::spawn(&[
        "record".to_string(),
        "--pid".into(),
        victim.host_pid.to_string(),
        "--threshold".into(),
        format!("{THRESHOLD_MS}ms"),
        "-o".into(),
        out.display().to_string(),
    ]);
    wait_for_attach(&mut prof, Duration::from_secs(30));
    victim.go();
    let run = prof.wait(Duration::from_secs(90));
    victim.wait(Duration::from_secs(10));
    assert!(
        run.status.success(),
        "stallprof record --pid (the sandbox's {runtime} victim) failed:\n{}",
        run.describe()
    );
    Some(Run::read(dir, &victim.log, &out, run.stdout))
}

fn num(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

fn who(b: &Value) -> String {
    format!(
        "block {} of {} ms [{} .. {}]",
        b["how"], b["planned_ms"], b["start_ns"], b["end_ns"]
    )
}

/// The nearest-rank percentile `q` of `sorted` (0 when empty): the one
/// definition stallprof's headline uses (docs/format.md).
fn nearest_rank(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The p99 of the summary's headline `timers ran up to X late (p99 over
/// the recording Y)`, in ns.
fn headline_p99(summary: &str) -> Option<u64> {
    let line = summary.lines().find(|l| l.contains("timers ran up to"))?;
    let rest = line.split("(p99 over the recording ").nth(1)?;
    parse_duration(rest.split(')').next()?)
}

/// `299.3ms`, `1.20s`, `850us` as the summary writes durations (fmt_ns).
fn parse_duration(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, unit) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e6)
    } else if let Some(n) = s.strip_suffix("us") {
        (n, 1e3)
    } else if let Some(n) = s.strip_suffix("ns") {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1e9)
    } else {
        return None;
    };
    Some((num.trim().parse::<f64>().ok()? * unit).round() as u64)
}
