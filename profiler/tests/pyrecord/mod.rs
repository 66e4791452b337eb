//! The Python stall-stack scenarios and their checks, shared by the host
//! tests (record_python_frames.rs: pyenv 3.10-3.13, Debian's 3.11) and the
//! container tests (record_container.rs: Debian's 3.13, 3.14 and 3.15 in
//! the sandbox of docs/containers.md). What each scenario checks is told in
//! record_python_frames.rs's module docs.
#![allow(dead_code)]

use crate::common::*;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

const THRESHOLD_MS: u64 = 40;
const THRESHOLD_NS: u64 = THRESHOLD_MS * MS;
/// Measured share vs the victim's own share, in share points (0..1).
const SHARE_TOLERANCE: f64 = 0.05;
/// Stall time a single-statement cause may show on its `def` line: two
/// samples at the default 999 Hz (see `check_cause`).
const ENTRY_LINE_NS: u64 = 2_100_000;

// ---------------------------------------------------------------------------
// The interpreters

pub struct Python {
    /// The interpreter: a host path, or for a container one the name on
    /// the sandbox's PATH (`python3.14`).
    path: &'static str,
    /// (major, minor)
    version: (u32, u32),
    /// Has symbols, so `[gc]` can be placed (pyenv builds; Debian's is stripped).
    symbols: bool,
    /// Runs in the container sandbox (tests/common `ContainerVictim`).
    container: bool,
}

impl Python {
    /// The name a Python frame of `func` must carry: co_qualname on 3.11+,
    /// co_name on 3.10.
    fn frame_name<'a>(&self, f: &'a Func) -> &'a str {
        if self.version >= (3, 11) {
            &f.qualname
        } else {
            &f.name
        }
    }

    /// Syscalls time.sleep() blocks in.
    fn sleep_syscalls(&self) -> &'static [&'static str] {
        if self.version >= (3, 11) {
            &["clock_nanosleep", "nanosleep"]
        } else {
            &["select", "pselect6"]
        }
    }
}

/// CPython 3.`minor` as found on this machine (tests/common `require_python`:
/// the newest pyenv build, else python3.X on PATH); a missing one FAILS the
/// test, naming it and how to install it.
pub fn found_python(minor: u32) -> &'static Python {
    let path = require_python(3, minor);
    let symbols = path.starts_with(pyenv_root());
    leak_python(path, (3, minor), symbols)
}

/// Debian's /usr/bin/python3.11 (tests/common `require_debian_python311`).
pub fn debian_python() -> &'static Python {
    leak_python(require_debian_python311(), (3, 11), false)
}

/// A found interpreter, kept for the test's lifetime (one per test).
fn leak_python(path: std::path::PathBuf, version: (u32, u32), symbols: bool) -> &'static Python {
    let path = path
        .into_os_string()
        .into_string()
        .unwrap_or_else(|p| panic!("interpreter path {p:?} is not UTF-8"));
    Box::leak(Box::new(Python {
        path: Box::leak(path.into_boxed_str()),
        version,
        symbols,
        container: false,
    }))
}

/// Debian's python3.`minor` in the container sandbox (tests/common
/// `require_forky_root`: a missing sandbox FAILS the test).
pub fn sandbox_python(minor: u32) -> &'static Python {
    let name = format!("python3.{minor}");
    let bin = require_forky_root().join("usr/bin").join(&name);
    assert!(
        bin.is_file(),
        "the container sandbox has no {}",
        bin.display()
    );
    Box::leak(Box::new(Python {
        path: Box::leak(name.into_boxed_str()),
        version: (3, minor),
        symbols: false,
        container: true,
    }))
}

// ---------------------------------------------------------------------------
// Running a victim under `stallprof record`

/// A victim function, as the victim describes it in its "ready" record.
#[derive(Debug, Clone)]
struct Func {
    name: String,
    qualname: String,
    first_line: u32,
    last_line: u32,
    block_line: u32,
    single_statement: bool,
}

impl Func {
    fn from_log(v: &serde_json::Value) -> Func {
        let n = |k: &str| {
            v[k].as_u64()
                .unwrap_or_else(|| panic!("victim func record lacks {k:?}: {v}")) as u32
        };
        Func {
            name: v["name"].as_str().unwrap().into(),
            qualname: v["qualname"].as_str().unwrap().into(),
            first_line: n("first_line"),
            last_line: n("last_line"),
            block_line: n("block_line"),
            single_statement: v["single_statement"].as_bool().unwrap_or(false),
        }
    }
}

struct Run {
    /// The scratch directory; the recording is in its `out`.
    dir: Scratch,
    log: Vec<serde_json::Value>,
    ready: serde_json::Value,
    rec: Recording,
    folded: String,
    /// The victim's file name, which Python frames' files must end with.
    file_name: &'static str,
    py: &'static Python,
    /// What `stallprof record` printed (the summary is on stderr).
    output: String,
    /// The recording's `--threshold`.
    threshold_ns: u64,
}

/// Records `victim` under `py`; None when root tests are skipped.
fn record(test: &str, py: &'static Python, file_name: &'static str, args: &[&str]) -> Option<Run> {
    record_at(test, py, file_name, args, THRESHOLD_MS)
}

/// [`record`] with `--threshold {threshold_ms}ms`.
fn record_at(
    test: &str,
    py: &'static Python,
    file_name: &'static str,
    args: &[&str],
    threshold_ms: u64,
) -> Option<Run> {
    let threshold = format!("{threshold_ms}ms");
    if !require_root_and_bpf(test) {
        return None;
    }
    assert!(
        py.container || Path::new(py.path).exists(),
        "{} is missing: this test needs that interpreter (pyenv 3.10.13/3.11.7/3.12.1/3.13.0 and Debian's python3.11)",
        py.path
    );
    let _serial = serial();
    let dir = Scratch::new(test);
    let out = dir.join("out");
    let (run, log, ns_tids) = if py.container {
        let (run, log, tids) = record_in_container(py, file_name, args, test, &out, &threshold);
        (run, log, Some(tids))
    } else {
        let script = victims_dir().join(file_name);
        let log_path = dir.join("victim.jsonl");
        let mut argv: Vec<std::ffi::OsString> = vec![
            "record".into(),
            "--threshold".into(),
            threshold.into(),
            "-o".into(),
            out.clone().into(),
            "--".into(),
            py.path.into(),
            script.into(),
            log_path.clone().into(),
        ];
        argv.extend(args.iter().map(Into::into));
        let run = run_stallprof(&argv, Duration::from_secs(60));
        (run, (read_log(&log_path), log_path), None)
    };
    let (log, log_path) = log;
    assert!(
        run.status.success(),
        "stallprof record -- {} {file_name} failed:\n{}",
        py.path,
        run.describe()
    );
    assert!(
        log.iter().any(|r| r["kind"] == "done"),
        "the victim did not finish; log:\n{}",
        std::fs::read_to_string(&log_path).unwrap_or_default()
    );
    let ready = log
        .iter()
        .find(|r| r["kind"] == "ready")
        .expect("no ready record")
        .clone();
    let version = ready["python"].as_str().unwrap().to_string();
    assert!(
        version.starts_with(&format!("{}.{}.", py.version.0, py.version.1)),
        "{} runs Python {version}, want {}.{}",
        py.path,
        py.version.0,
        py.version.1
    );
    let mut rec: Recording = serde_json::from_value(read_stalls_json(&out.join("stalls.json")))
        .unwrap_or_else(|e| panic!("stalls.json does not match the contract: {e}"));
    if let Some(tids) = ns_tids {
        in_namespace_ids(&mut rec, &tids);
    }
    let (_, _, folded) = folded_total_us(&out.join("stalls.folded"));
    Some(Run {
        dir,
        log,
        ready,
        rec,
        folded,
        file_name,
        py,
        output: format!("{}{}", run.stdout, run.stderr),
        threshold_ns: threshold_ms * MS,
    })
}

/// Runs `file_name` in the container sandbox and records it with `--pid`:
/// the victim waits until the probes are in. Its log keeps the namespace
/// pid and tids it wrote (`os.getpid()`, `threading.get_native_id()`); the
/// checks compare them with stalls.json's namespace ids
/// ([`in_namespace_ids`]). Returns the profiler's run, (the log, the log's
/// path) and the victim's threads as `NSpid:` showed them while it ran
/// (namespace tid -> host tid).
fn record_in_container(
    py: &'static Python,
    file_name: &'static str,
    args: &[&str],
    test: &str,
    out: &Path,
    threshold: &str,
) -> (
    RunOutput,
    (Vec<serde_json::Value>, std::path::PathBuf),
    BTreeMap<u32, u32>,
) {
    let mut victim = ContainerVictim::spawn_python(test, py.path, file_name, args);
    let mut prof = Profiler::spawn(&[
        "record".to_string(),
        "--pid".into(),
        victim.host_pid.to_string(),
        "--threshold".into(),
        threshold.into(),
        "-o".into(),
        out.display().to_string(),
    ]);
    wait_for_attach(&mut prof, Duration::from_secs(30));
    victim.go();
    wait_for_log_kind(&victim.log, "ready", Duration::from_secs(30));
    let tids = victim.tids();
    let run = prof.wait(Duration::from_secs(90));
    victim.wait(Duration::from_secs(10));
    let log = read_log(&victim.log);
    (run, (log, victim.log.clone()), tids)
}

/// stalls.json of a victim in its own PID namespace, seen with the ids the
/// victim logs: its `ns_pid` as the pid, each stall's and GIL holder's
/// `ns_tid` as the tid. Each namespace id must be there, and be the one
/// `NSpid:` gave for that host tid while the victim ran (`tids`: namespace
/// tid -> host tid).
fn in_namespace_ids(rec: &mut Recording, tids: &BTreeMap<u32, u32>) {
    let host_to_ns: BTreeMap<u32, u32> = tids.iter().map(|(&ns, &host)| (host, ns)).collect();
    let ns_of = |what: &str, host: u32, ns: Option<u32>| -> u32 {
        let ns = ns.unwrap_or_else(|| {
            panic!("stalls.json: {what} (host tid {host}) has no ns_tid; the victim's threads (namespace -> host): {tids:?}")
        });
        if let Some(&want) = host_to_ns.get(&host) {
            assert_eq!(
                ns, want,
                "stalls.json: {what} (host tid {host}) has ns_tid {ns}, NSpid: says {want}"
            );
        }
        ns
    };
    let ns_pid = rec.ns_pid.unwrap_or_else(|| {
        panic!(
            "stalls.json has no ns_pid for pid {} in its own PID namespace",
            rec.pid
        )
    });
    assert_eq!(
        Some(&rec.pid),
        tids.get(&ns_pid),
        "stalls.json: ns_pid {ns_pid} is not host pid {} by NSpid: ({tids:?})",
        rec.pid
    );
    rec.pid = ns_pid;
    for s in &mut rec.stalls {
        s.tid = ns_of("a stall", s.tid, s.ns_tid);
        for p in &mut s.stacks {
            if let Some(h) = &mut p.gil_holder
                && let Some(t) = h.tid
            {
                h.tid = Some(ns_of("a GIL holder", t, h.ns_tid));
            }
        }
    }
}

impl Run {
    fn func(&self, name: &str) -> Func {
        Func::from_log(&self.ready["funcs"][name])
    }

    fn loop_tid(&self) -> u32 {
        self.ready["tid"].as_u64().unwrap() as u32
    }

    fn records(&self, kind: &str) -> Vec<&serde_json::Value> {
        self.log.iter().filter(|r| r["kind"] == kind).collect()
    }

    /// Is `f` the Python frame of `func` in this victim?
    fn is_frame_of(&self, f: &Frame, func: &Func) -> bool {
        f.kind == "python"
            && f.name == self.py.frame_name(func)
            && f.file
                .as_deref()
                .is_some_and(|p| p.ends_with(&format!("/{}", self.file_name)))
    }

    /// Checks whose failures show the run's context and stallprof's output.
    fn checks(&self) -> Checks {
        Checks::new(format!(
            "{}\nstallprof output:\n{}",
            self.context(),
            self.output
        ))
    }

    /// The one stall over [t0, t1] (`who`, in a failure); None, a failure
    /// said, when not exactly one overlaps it.
    fn only_stall(&self, c: &mut Checks, who: &str, t0: u64, t1: u64) -> Option<&Stall> {
        let found: Vec<&Stall> = self
            .rec
            .stalls
            .iter()
            .filter(|s| s.overlaps(t0, t1))
            .collect();
        let [s] = found[..] else {
            c.fail(format!(
                "{who}: {} overlapping stalls, want exactly 1",
                found.len()
            ));
            return None;
        };
        Some(s)
    }

    /// Context for failure messages: the victim's log and every stall with
    /// its stacks as folded lines.
    fn context(&self) -> String {
        let mut s = format!("interpreter {}\nvictim log:\n", self.py.path);
        for r in &self.log {
            if r["kind"] != "ready" {
                let _ = writeln!(s, "  {r}");
            }
        }
        let _ = writeln!(
            s,
            "stalls.json: pid {} [{} .. {}] lost {} drops {:?}, {} stalls:",
            self.rec.pid,
            self.rec.started_ns,
            self.rec.ended_ns,
            self.rec.lost_events,
            self.rec.drops,
            self.rec.stalls.len()
        );
        for st in &self.rec.stalls {
            let _ = writeln!(s, "  {}", st.summary());
            let mut stacks: Vec<&Stack> = st.stacks.iter().collect();
            stacks.sort_by_key(|p| std::cmp::Reverse(p.weight_ns));
            for p in stacks.iter().take(12) {
                let _ = writeln!(s, "      {}", p.folded());
            }
            if stacks.len() > 12 {
                let _ = writeln!(s, "      ... {} more stacks", stacks.len() - 12);
            }
        }
        let _ = writeln!(s, "stalls.folded:\n{}", self.folded);
        s
    }
}

/// The JSON contract (tests/common's `check_contract`), and what holds for
/// every recording of a Python victim beside it: the victim's pid, no
/// JavaScript frames, a file for every Python frame.
fn check_python_contract(c: &mut Checks, run: &Run) {
    let rec = &run.rec;
    check_contract(c, rec, run.threshold_ns);
    let pid = run.ready["pid"].as_u64().unwrap() as u32;
    c.check(rec.pid == pid, || {
        format!("pid is {}, want the victim's {pid}", rec.pid)
    });
    for (i, s) in rec.stalls.iter().enumerate() {
        let who = format!("stall #{i} ({})", s.summary());
        for f in s.stacks.iter().flat_map(|p| &p.frames) {
            c.check(f.kind != "js", || {
                format!("{who}: a JavaScript frame in a Python victim: {f:?}")
            });
            if f.kind == "python" {
                // Every Python frame names its file. A line is asserted
                // where it matters (each cause, above); elsewhere a rare
                // frame resolves without one (deep-frozen stdlib code,
                // an unreadable line table) and must not fail the run.
                c.check(f.file.is_some(), || {
                    format!("{who}: python frame without a file: {f:?}")
                });
            }
        }
    }
}

/// One logged unit of stall (a request or a turn): [start, end].
struct Unit {
    start_ns: u64,
    end_ns: u64,
}

fn num(r: &serde_json::Value, k: &str) -> u64 {
    r[k].as_u64()
        .unwrap_or_else(|| panic!("victim record lacks numeric {k:?}: {r}"))
}

/// Matches each logged unit to exactly one stall of the loop thread that
/// covers it; returns the matched stalls (deduplicated, in order). Also
/// fails on stalls between the first and last unit that match none.
fn match_units<'a>(c: &mut Checks, run: &'a Run, units: &[Unit], what: &str) -> Vec<&'a Stall> {
    let tid = run.loop_tid();
    let mut matched: Vec<&Stall> = Vec::new();
    for (i, u) in units.iter().enumerate() {
        let who = format!(
            "{what} #{i} ({:.2} ms at {})",
            ms(u.end_ns - u.start_ns),
            u.start_ns
        );
        let found: Vec<&Stall> = run
            .rec
            .stalls
            .iter()
            .filter(|s| s.overlaps(u.start_ns, u.end_ns))
            .collect();
        // Only the loop thread parks in epoll; another thread's stall here
        // means a thread that is no event loop was taken for one.
        for s in found.iter().filter(|s| s.tid != tid) {
            c.fail(format!(
                "{who}: overlapped by a stall of tid {} ({}), which is not the loop thread {tid}: {}; heaviest stack: {}",
                s.tid,
                s.thread_name,
                s.summary(),
                s.stacks.iter().max_by_key(|p| p.weight_ns).map(Stack::folded).unwrap_or_default()
            ));
        }
        let mine: Vec<&Stall> = found.iter().copied().filter(|s| s.tid == tid).collect();
        if mine.len() != 1 {
            c.fail(format!(
                "{who}: {} overlapping stalls of the loop thread, want exactly 1",
                mine.len()
            ));
            matched.extend(mine);
            continue;
        }
        let s = mine[0];
        c.check(!s.incomplete, || format!("{who}: marked incomplete"));
        c.check(
            s.start_ns <= u.start_ns + MS && s.end_ns + MS >= u.end_ns,
            || {
                format!(
                    "{who}: stall [{}, {}] does not cover it",
                    s.start_ns, s.end_ns
                )
            },
        );
        matched.push(s);
    }
    matched.dedup_by_key(|s| s.start_ns);
    let first = units.iter().map(|u| u.start_ns).min().unwrap();
    let last = units.iter().map(|u| u.end_ns).max().unwrap();
    for s in run.rec.stalls.iter().filter(|s| s.overlaps(first, last)) {
        if !units.iter().any(|u| s.overlaps(u.start_ns, u.end_ns)) {
            c.fail(format!(
                "extra stall between the victim's {what}s: {}",
                s.summary()
            ));
        }
    }
    matched
}

/// What the profiler says about one cause over the matched stalls.
struct CauseMeasure {
    /// Weight of stacks containing the cause's Python frame.
    weight_ns: u64,
    /// Of that, off-CPU with one of the given syscalls.
    syscall_ns: u64,
    /// Of `weight_ns`, stacks whose cause frame is on the blocking line.
    block_line_ns: u64,
    /// Of `weight_ns`, stacks whose cause frame is on its `def` line: the
    /// function's entry (3.11+ `RESUME`), before its first statement.
    entry_line_ns: u64,
    /// Lines of the cause frame outside the function.
    bad_lines: Vec<(u32, String)>,
}

fn measure(run: &Run, stalls: &[&Stall], func: &Func, syscalls: &[&str]) -> CauseMeasure {
    let mut m = CauseMeasure {
        weight_ns: 0,
        syscall_ns: 0,
        block_line_ns: 0,
        entry_line_ns: 0,
        bad_lines: Vec::new(),
    };
    for s in stalls {
        for p in &s.stacks {
            let Some(f) = p.frames.iter().find(|f| run.is_frame_of(f, func)) else {
                continue;
            };
            m.weight_ns += p.weight_ns;
            if p.kind == "off_cpu"
                && p.syscall
                    .as_deref()
                    .is_some_and(|sc| syscalls.contains(&sc))
            {
                m.syscall_ns += p.weight_ns;
            }
            let line = f.line.unwrap_or(0);
            if line == func.block_line {
                m.block_line_ns += p.weight_ns;
            } else if line == func.first_line {
                m.entry_line_ns += p.weight_ns;
            }
            if !(func.first_line..=func.last_line).contains(&line) {
                m.bad_lines.push((line, p.folded()));
            }
        }
    }
    m
}

fn share(part: u64, total: u64) -> f64 {
    part as f64 / total.max(1) as f64
}

/// Name, line and share checks for one cause; returns (measured, truth).
#[allow(clippy::too_many_arguments)]
fn check_cause(
    c: &mut Checks,
    run: &Run,
    victim: &str,
    stalls: &[&Stall],
    func: &Func,
    truth_ns: u64,
    truth_total_ns: u64,
    stall_total_ns: u64,
) -> CauseMeasure {
    let m = measure(run, stalls, func, &[]);
    let name = run.py.frame_name(func);
    let who = format!(
        "{name} ({}:{}-{})",
        run.file_name, func.first_line, func.last_line
    );
    c.check(m.weight_ns > 0, || {
        format!(
            "{who}: no stack has a python frame named {name:?} in a file ending in /{}",
            run.file_name
        )
    });
    c.check(m.bad_lines.is_empty(), || {
        format!(
            "{who}: the frame's line is outside the function in {} stacks, e.g. line {} in {}",
            m.bad_lines.len(),
            m.bad_lines[0].0,
            m.bad_lines[0].1
        )
    });
    if func.single_statement {
        // A sample now and then lands on the function's entry, its `def`
        // line (CPython 3.11's `RESUME`): one 1 ms on-CPU sample in about 1
        // of 7 runs of gateway::pyenv_3_11 (2026-12-03, with the BPF Python
        // walk before and after it read each frame at once). Why samples
        // land there that often is not known; any other line still fails.
        c.check(
            m.block_line_ns + m.entry_line_ns == m.weight_ns && m.entry_line_ns <= ENTRY_LINE_NS,
            || {
                format!(
                    "{who}: a single statement (line {}), but only {:.1} of its {:.1} ms are on that line ({:.1} ms on its def line {}, at most {:.1} allowed)",
                    func.block_line,
                    ms(m.block_line_ns),
                    ms(m.weight_ns),
                    ms(m.entry_line_ns),
                    func.first_line,
                    ms(ENTRY_LINE_NS)
                )
            },
        );
    }
    let measured = share(m.weight_ns, stall_total_ns);
    let truth = share(truth_ns, truth_total_ns);
    println!(
        "SHARE {victim:<8} {:<40} {:<34} measured {:5.1}%  truth {:5.1}%  ({:.1} of {:.1} ms; victim {:.1} of {:.1} ms)",
        run.py.path,
        name,
        100.0 * measured,
        100.0 * truth,
        ms(m.weight_ns),
        ms(stall_total_ns),
        ms(truth_ns),
        ms(truth_total_ns)
    );
    c.check((measured - truth).abs() <= SHARE_TOLERANCE, || {
        format!(
            "{who}: {:.1}% of stall time, the victim measured {:.1}% (tolerance {:.0} points)",
            100.0 * measured,
            100.0 * truth,
            100.0 * SHARE_TOLERANCE
        )
    });
    m
}

// ---------------------------------------------------------------------------
// (a) the streaming gateway

pub fn check_gateway(test: &str, py: &'static Python) {
    let Some(run) = record(test, py, "py_gateway.py", &[]) else {
        return;
    };
    let steps = [
        "make_tls_contexts",
        "load_tokenizer",
        "compress_payload",
        "score_candidates",
    ];
    let requests: Vec<Unit> = run
        .records("request")
        .iter()
        .map(|r| Unit {
            start_ns: num(r, "start_ns"),
            end_ns: num(r, "end_ns"),
        })
        .collect();
    let mut c = Checks::new(run.context());
    assert!(
        requests.len() >= 5,
        "victim logged {} requests, want 6:\n{}",
        requests.len(),
        run.context()
    );
    for u in &requests {
        assert!(
            u.end_ns - u.start_ns >= THRESHOLD_NS + 20 * MS,
            "a request shorter than planned:\n{}",
            run.context()
        );
    }
    check_python_contract(&mut c, &run);
    let stalls = match_units(&mut c, &run, &requests, "request");
    let stall_total: u64 = stalls.iter().map(|s| s.duration_ns).sum();
    let truth_total: u64 = requests.iter().map(|u| u.end_ns - u.start_ns).sum();
    for step in steps {
        let func = run.func(step);
        let truth: u64 = run
            .records("step")
            .iter()
            .filter(|r| r["func"] == step)
            .map(|r| num(r, "end_ns") - num(r, "start_ns"))
            .sum();
        check_cause(
            &mut c,
            &run,
            "gateway",
            &stalls,
            &func,
            truth,
            truth_total,
            stall_total,
        );
    }
    if py.symbols {
        let gc: u64 = stalls
            .iter()
            .flat_map(|s| &s.stacks)
            .filter(|p| {
                p.frames
                    .iter()
                    .any(|f| f.kind == "marker" && f.name == "[gc]")
            })
            .map(|p| p.weight_ns)
            .sum();
        println!(
            "GC    gateway  {:<40} [gc] {:5.1}% of stall time ({:.1} of {:.1} ms) -- reported, not asserted",
            py.path,
            100.0 * share(gc, stall_total),
            ms(gc),
            ms(stall_total)
        );
    }
    c.finish();
}

// ---------------------------------------------------------------------------
// (b) the session handler

pub fn check_session(test: &str, py: &'static Python) {
    let Some(run) = record(test, py, "py_session.py", &[]) else {
        return;
    };
    let turns: Vec<Unit> = run
        .records("turn")
        .iter()
        .map(|r| Unit {
            start_ns: num(r, "start_ns"),
            end_ns: num(r, "end_ns"),
        })
        .collect();
    assert!(
        turns.len() >= 3,
        "victim logged {} turns, want 4:\n{}",
        turns.len(),
        run.context()
    );
    let mut c = Checks::new(run.context());
    check_python_contract(&mut c, &run);
    let stalls = match_units(&mut c, &run, &turns, "turn");
    let stall_total: u64 = stalls.iter().map(|s| s.duration_ns).sum();
    let truth_total: u64 = turns.iter().map(|u| u.end_ns - u.start_ns).sum();
    let step_ns = |step: &str| -> u64 {
        run.records("step")
            .iter()
            .filter(|r| r["func"] == step)
            .map(|r| num(r, "end_ns") - num(r, "start_ns"))
            .sum()
    };

    // The streaming client: with a socket timeout CPython polls the socket
    // before each recv, so its off-CPU time is poll (one per event), on the
    // resp.readline() line.
    let client = run.func("stream_completion");
    check_cause(
        &mut c,
        &run,
        "session",
        &stalls,
        &client,
        step_ns("stream_completion"),
        truth_total,
        stall_total,
    );
    let m = measure(&run, &stalls, &client, &["poll", "ppoll"]);
    let name = py.frame_name(&client);
    c.check(share(m.syscall_ns, m.weight_ns) >= 0.70, || {
        format!(
            "{name}: only {:.1} of its {:.1} ms are off-CPU in poll/ppoll (the socket wait before each event)",
            ms(m.syscall_ns),
            ms(m.weight_ns)
        )
    });
    let polled_on_read = polled_on_line(&run, &stalls, &client, &["poll", "ppoll"]);
    c.check(share(polled_on_read, m.syscall_ns) >= 0.90, || {
        format!(
            "{name}: only {:.1} of {:.1} ms in poll are on the resp.readline() line {}",
            ms(polled_on_read),
            ms(m.syscall_ns),
            client.block_line
        )
    });

    // The webhook: the time.sleep(0.1) retry shows as the sleep syscall, on
    // the sleep's line, for as long as the victim slept.
    let hook = run.func("send_webhook");
    check_cause(
        &mut c,
        &run,
        "session",
        &stalls,
        &hook,
        step_ns("send_webhook"),
        truth_total,
        stall_total,
    );
    let sleeps = py.sleep_syscalls();
    let m = measure(&run, &stalls, &hook, sleeps);
    let slept_on_line = polled_on_line(&run, &stalls, &hook, sleeps);
    let name = py.frame_name(&hook);
    let slept_truth: u64 = run
        .records("retry_sleep")
        .iter()
        .map(|r| num(r, "end_ns") - num(r, "start_ns"))
        .sum();
    let (measured, truth) = (
        share(m.syscall_ns, stall_total),
        share(slept_truth, truth_total),
    );
    println!(
        "SHARE session  {:<40} {:<34} measured {:5.1}%  truth {:5.1}%  (off-CPU in {sleeps:?} under it)",
        py.path,
        format!("{name} time.sleep"),
        100.0 * measured,
        100.0 * truth
    );
    c.check((measured - truth).abs() <= SHARE_TOLERANCE, || {
        format!(
            "{name}: off-CPU in {sleeps:?} is {:.1}% of stall time, the victim slept {:.1}%",
            100.0 * measured,
            100.0 * truth
        )
    });
    c.check(share(slept_on_line, m.syscall_ns) >= 0.90, || {
        format!(
            "{name}: only {:.1} of {:.1} ms asleep are on the time.sleep line {}",
            ms(slept_on_line),
            ms(m.syscall_ns),
            hook.block_line
        )
    });

    // The parser: pure Python.
    let parser = run.func("parse_document");
    check_cause(
        &mut c,
        &run,
        "session",
        &stalls,
        &parser,
        step_ns("parse_document"),
        truth_total,
        stall_total,
    );

    check_loop_identity(&mut c, &run, &turns);
    c.finish();
}

/// The syscalls of asyncio's own idle wait (EpollSelector.select).
const LOOP_WAITS: &[&str] = &["epoll_wait", "epoll_pwait", "epoll_pwait2"];
/// Stall time a stall of the loop may have outside the turns: the task step
/// before the turn's first timestamp and the log writes after its last, plus
/// scheduling noise on a shared machine. A false stall is the loop's idle
/// time between turns (~250 ms).
const OUTSIDE_TURNS_NS: u64 = 10 * MS;
/// Share of each turn's logged time that the loop's stalls must cover.
const TURN_COVERED: f64 = 0.95;
/// The victim idles 200 ms after its last turn, then exits; interpreter
/// shutdown never parks in the loop's wait, so a stall that starts later
/// than this after the last turn is shutdown, not a turn's business.
const SHUTDOWN_AFTER_NS: u64 = 150 * MS;

fn overlap_ns(s: &Stall, u: &Unit) -> u64 {
    s.end_ns
        .min(u.end_ns)
        .saturating_sub(s.start_ns.max(u.start_ns))
}

/// Issue 10: the streaming client polls its socket 60+ times inside one
/// stall; the loop's identity must stay the loop's epoll fd throughout.
/// Taken for a new loop, the client's poll would end the stall mid-stream
/// (the rest of the turn vanishes) and the loop's own epoll_wait would become
/// stall time between turns (a false stall).
fn check_loop_identity(c: &mut Checks, run: &Run, turns: &[Unit]) {
    let tid = run.loop_tid();
    let last = turns.iter().map(|u| u.end_ns).max().unwrap();
    // Likewise start-up: a stall of the loop that ends before the victim's
    // "ready" (logged from its first task step) is the loop's first
    // iteration, the interpreter loading modules; on a cold page cache that
    // is a real stall of ~180 ms (a fresh-clone run, CPython 3.13), and
    // reported as one, but no turn's.
    let ready = num(run.records("ready")[0], "ts_ns");
    let loop_stalls: Vec<&Stall> = run.rec.stalls.iter().filter(|s| s.tid == tid).collect();

    // No stall time is the loop's own idle wait.
    for s in &loop_stalls {
        let idle: Vec<&Stack> = s
            .stacks
            .iter()
            .filter(|p| {
                matches!(p.kind.as_str(), "off_cpu" | "gil_wait")
                    && p.syscall
                        .as_deref()
                        .is_some_and(|sc| LOOP_WAITS.contains(&sc))
            })
            .collect();
        let idle_ns: u64 = idle.iter().map(|p| p.weight_ns).sum();
        c.check(idle_ns == 0, || {
            format!(
                "the loop's own idle wait was reported as stall time: {:.1} of the {:.1} ms of stall {} are off-CPU in {LOOP_WAITS:?} on the loop thread; heaviest such stack: {}",
                ms(idle_ns),
                ms(s.duration_ns),
                s.summary(),
                idle.iter().max_by_key(|p| p.weight_ns).map(|p| p.folded()).unwrap_or_default()
            )
        });
    }

    // No false stalls: every stall of the loop overlaps a turn and has at
    // most OUTSIDE_TURNS_NS outside the turns.
    let mut outside_total = 0;
    for s in loop_stalls
        .iter()
        .filter(|s| s.start_ns <= last + SHUTDOWN_AFTER_NS && s.end_ns > ready)
    {
        let inside: u64 = turns.iter().map(|u| overlap_ns(s, u)).sum();
        let outside = s.duration_ns.saturating_sub(inside);
        outside_total += outside;
        if inside == 0 {
            c.fail(format!(
                "a false stall: a stall of the loop thread that overlaps no turn ({:.1} ms): {}",
                ms(s.duration_ns),
                s.summary()
            ));
        } else {
            c.check(outside <= OUTSIDE_TURNS_NS, || {
                format!(
                    "false stall time: {:.1} of the {:.1} ms of a stall of the loop thread lie outside the victim's turns (at most {:.0} ms allowed): {}",
                    ms(outside),
                    ms(s.duration_ns),
                    ms(OUTSIDE_TURNS_NS),
                    s.summary()
                )
            });
        }
    }

    // No vanished time: each turn is covered by the loop's stalls.
    let mut covered_total = 0;
    let mut turn_total = 0;
    for (i, u) in turns.iter().enumerate() {
        let dur = u.end_ns - u.start_ns;
        let covered: u64 = loop_stalls.iter().map(|s| overlap_ns(s, u)).sum();
        covered_total += covered;
        turn_total += dur;
        c.check(share(covered, dur) >= TURN_COVERED, || {
            format!(
                "turn #{i} ({:.1} ms at {}): the loop's stalls cover only {:.1} ms ({:.1}%, want >= {:.0}%): {:.1} ms of the turn vanished",
                ms(dur),
                u.start_ns,
                ms(covered),
                100.0 * share(covered, dur),
                100.0 * TURN_COVERED,
                ms(dur - covered)
            )
        });
    }
    println!(
        "LOOP  session  {:<40} turns covered {:5.1}% ({:.1} of {:.1} ms); stall time outside turns {:.1} ms; {} stalls of the loop thread",
        run.py.path,
        100.0 * share(covered_total, turn_total),
        ms(covered_total),
        ms(turn_total),
        ms(outside_total),
        loop_stalls.len()
    );
}

/// Off-CPU weight in `syscalls` whose cause frame is on the blocking line.
fn polled_on_line(run: &Run, stalls: &[&Stall], func: &Func, syscalls: &[&str]) -> u64 {
    stalls
        .iter()
        .flat_map(|s| &s.stacks)
        .filter(|p| {
            p.kind == "off_cpu"
                && p.syscall
                    .as_deref()
                    .is_some_and(|sc| syscalls.contains(&sc))
        })
        .filter(|p| {
            p.frames
                .iter()
                .any(|f| run.is_frame_of(f, func) && f.line == Some(func.block_line))
        })
        .map(|p| p.weight_ns)
        .sum()
}

// ---------------------------------------------------------------------------
// (c) the GIL hog

pub fn check_gil(test: &str, py: &'static Python) {
    let Some(run) = record(test, py, "py_gil.py", &[]) else {
        return;
    };
    let hog_tid = run.ready["hog_tid"].as_u64().unwrap() as u32;
    let hog = Func::from_log(&run.ready["hog"]);
    let regexes: Vec<Unit> = run
        .records("regex")
        .iter()
        .map(|r| Unit {
            start_ns: num(r, "start_ns"),
            end_ns: num(r, "end_ns"),
        })
        .collect();
    let late = run.records("late");
    assert!(
        regexes.len() >= 5,
        "victim logged {} regex rounds, want 6:\n{}",
        regexes.len(),
        run.context()
    );
    for r in run.records("regex") {
        // CPU time: on a loaded machine the wall time of a match is longer.
        let cpu = num(r, "cpu_ns");
        assert!(
            (60 * MS..=450 * MS).contains(&cpu),
            "a re.match ran {:.1} ms on CPU, want ~100-300 ms (calibration off?):\n{}",
            ms(cpu),
            run.context()
        );
    }
    // The victim's own evidence that the match holds the GIL: the loop's
    // 10 ms heartbeat is late by most of a match, during matches.
    assert!(
        late.len() >= regexes.len() - 1 && late.iter().all(|r| num(r, "late_ns") >= 20 * MS),
        "the loop's heartbeat was late only {} times over {} matches: does re.match still hold the GIL?\n{}",
        late.len(),
        regexes.len(),
        run.context()
    );

    let mut c = Checks::new(run.context());
    check_python_contract(&mut c, &run);
    let tid = run.loop_tid();
    let last = regexes.iter().map(|u| u.end_ns).max().unwrap();
    // The loop's stalls during the matches. (Interpreter shutdown, after the
    // last match, is a stall too -- the loop thread never parks again -- and
    // is none of this test's business.)
    let during = |s: &&Stall| s.tid == tid && s.start_ns < last + 50 * MS;
    let stalls: Vec<&Stall> = run.rec.stalls.iter().filter(during).collect();
    let in_a_match = |a: u64, b: u64| regexes.iter().any(|u| a < u.end_ns && u.start_ns < b);
    // Every time the loop noticed a match (a heartbeat late by more than the
    // threshold, plus margin, while a match ran) falls in a stall. A late
    // heartbeat outside every match is the host's, not the GIL's: the hog
    // sleeps then, with the GIL released. A CI machine's vCPU held back by
    // its hypervisor for 60 ms, with the loop parked, wakes the loop's timer
    // 60 ms late and is no stall at all (seen: two such lates, 44 and 64
    // ms, in the idle before the first match).
    for r in late.iter().filter(|r| {
        num(r, "late_ns") >= THRESHOLD_NS + 10 * MS
            && in_a_match(num(r, "start_ns"), num(r, "end_ns"))
    }) {
        let (a, b) = (num(r, "start_ns"), num(r, "end_ns"));
        c.check(stalls.iter().any(|s| s.overlaps(a, b)), || {
            format!(
                "the loop's heartbeat was {:.1} ms late at {b}, and no stall of the loop covers it",
                ms(b - a)
            )
        });
    }
    for s in run.rec.stalls.iter().filter(|s| s.tid != tid) {
        c.fail(format!(
            "a stall on tid {} ({}), not the loop thread: {}",
            s.tid,
            s.thread_name,
            s.summary()
        ));
    }
    // A stall of the loop outside the matches is false unless the machine
    // made it: one spent (>= 90%) waiting for a CPU is the host's load, a
    // true stall the victim's heartbeat sees too (no GIL is involved: a GIL
    // waiter sleeps off-CPU). The loop's idle wait taken for a stall would
    // be off-CPU time in epoll_wait, and still fails here.
    for s in stalls.iter().filter(|s| !in_a_match(s.start_ns, s.end_ns)) {
        if s.runqueue_ns * 10 >= s.duration_ns * 9 {
            println!(
                "NOTE gil: a stall of the loop outside the matches spent waiting for a CPU (the host's load): {}",
                s.summary()
            );
            continue;
        }
        c.fail(format!(
            "a stall of the loop outside the matches, not the host's load (< 90% run queue): {}",
            s.summary()
        ));
    }
    let total: u64 = stalls.iter().map(|s| s.duration_ns).sum();
    let gil: Vec<&Stack> = stalls
        .iter()
        .flat_map(|s| &s.stacks)
        .filter(|p| p.kind == "gil_wait")
        .collect();
    let gil_ns: u64 = gil.iter().map(|p| p.weight_ns).sum();
    let by_hog = |p: &Stack| {
        p.gil_holder.as_ref().is_some_and(|h| {
            h.tid == Some(hog_tid)
                && h.thread_name.as_deref() == Some("gil-hog")
                && h.frames.iter().any(|f| {
                    f.kind == "python"
                        && f.name == "hog"
                        && f.file.as_deref().is_some_and(|p| p.ends_with("/py_gil.py"))
                })
        })
    };
    let hog_ns: u64 = gil.iter().filter(|p| by_hog(p)).map(|p| p.weight_ns).sum();
    let on_line_ns: u64 = gil
        .iter()
        .filter(|p| by_hog(p))
        .filter(|p| {
            p.gil_holder
                .as_ref()
                .unwrap()
                .frames
                .iter()
                .any(|f| f.name == "hog" && f.line == Some(hog.block_line))
        })
        .map(|p| p.weight_ns)
        .sum();
    let marked_ns: u64 = gil
        .iter()
        .filter(|p| {
            p.frames.iter().any(|f| {
                f.kind == "marker" && f.name.starts_with("[gil wait: held by gil-hog (tid ")
            })
        })
        .map(|p| p.weight_ns)
        .sum();
    let truth: u64 = late.iter().map(|r| num(r, "late_ns")).sum();
    // Run-queue time is the machine's load, not the GIL: a GIL waiter wakes
    // every 5 ms (the switch interval) to re-request the GIL, and on a busy
    // 2-core machine each wake-up waits for a CPU. So the >= 70% is of the
    // stall time the loop thread did not spend waiting for a CPU; on an idle
    // machine the two are the same.
    let runq: u64 = stalls.iter().map(|s| s.runqueue_ns).sum();
    let not_runq = total - runq;
    println!(
        "SHARE gil      {:<40} {:<34} measured {:5.1}% of stall time, {:5.1}% of it outside the run queue (>= 70% required); \
         held by gil-hog in hog: {:.1}%; loop stalls {:.1} ms, victim's late heartbeats {:.1} ms",
        py.path,
        "gil_wait",
        100.0 * share(gil_ns, total),
        100.0 * share(gil_ns, not_runq),
        100.0 * share(hog_ns, gil_ns),
        ms(total),
        ms(truth)
    );
    c.check(stalls.len() >= regexes.len() - 1, || {
        format!(
            "{} stalls of the loop over {} matches",
            stalls.len(),
            regexes.len()
        )
    });
    c.check(share(gil_ns, not_runq) >= 0.70, || {
        format!(
            "gil_wait stacks carry {:.1} ms: {:.1}% of the loop's {:.1} ms of stalls outside the run queue ({:.1} ms in all), want >= 70%",
            ms(gil_ns),
            100.0 * share(gil_ns, not_runq),
            ms(not_runq),
            ms(total)
        )
    });
    c.check(share(hog_ns, gil_ns) >= 0.90, || {
        let other = gil.iter().find(|p| !by_hog(p)).map(|p| format!("{:?} in {}", p.gil_holder, p.folded()));
        format!(
            "only {:.1} of {:.1} ms of GIL wait name the holder gil-hog (tid {hog_tid}) with hog (py_gil.py) in its frames; e.g. {}",
            ms(hog_ns),
            ms(gil_ns),
            other.unwrap_or_default()
        )
    });
    c.check(share(on_line_ns, hog_ns) >= 0.90, || {
        format!(
            "only {:.1} of {:.1} ms have the holder's hog on its re.match line {}",
            ms(on_line_ns),
            ms(hog_ns),
            hog.block_line
        )
    });
    c.check(share(marked_ns, gil_ns) >= 0.90, || {
        format!("only {:.1} of {:.1} ms of GIL wait carry a [gil wait: held by gil-hog (tid ...)] marker", ms(marked_ns), ms(gil_ns))
    });
    c.finish();
}

// ---------------------------------------------------------------------------
// asyncio task identity (tests/victims/py_tasks.py)

/// Share of the victim's blocks whose stall must name its task (on
/// 3.10-3.13, blocks of long-lived tasks; see [`SHORT_LIVED`]).
const TASK_NAMED_SHARE: f64 = 0.9;

/// Coroutines of the victim whose task is let go as its block ends
/// (`await asyncio.create_task(run_batch(...))`: freed at once). On
/// 3.10-3.13 userspace reads the task after the stack, by which time the
/// object may be freed and its memory reused: the read is then refused and
/// counted (`asyncio_task_unverified`/`_unreadable`), never a wrong name;
/// their names are checked when given and left out of the share there. On
/// 3.14+ BPF sends the task's name and coroutine with each stack
/// (`Event::Task`), so every block counts (before that, 2026-12-02 on 3.15
/// in the container, a batch block went unnamed in 3 of 8 runs).
const SHORT_LIVED: &[&str] = &["run_batch"];

/// py_tasks: every block of the victim is one stall; at least 90% of them
/// carry the task the victim logged (`asyncio.current_task().get_name()`),
/// and every name given is exactly that task's, with its coroutine; on
/// 3.14+ the batch tasks' await chain is the one the victim built; the
/// summary's culprit line of the janitor's sweep names the janitor task;
/// stalls.folded has no task frame (issue 37: the task is a label), and
/// `--group-by task` roots the sweep's stacks in `task janitor`.
pub fn check_tasks(test: &str, py: &'static Python) {
    tasks_named(test, py, &[], THRESHOLD_MS);
}

/// Issue 19 item 5, CPython 3.14+: blocks of 16 ms under a 12 ms
/// threshold, each followed at once by other tasks' work. The task, its
/// name and its coroutine are read in the kernel with the stack
/// (`Event::Task`), not by userspace milliseconds later when another task
/// runs or the task is freed: each block still names its own, the
/// short-lived batch tasks' included.
pub fn check_short_tasks(test: &str, py: &'static Python) {
    assert!(
        py.version >= (3, 14),
        "the task is read in the kernel on 3.14+ only"
    );
    tasks_named(test, py, &["--block-ms", "16"], 12);
}

fn tasks_named(test: &str, py: &'static Python, args: &[&str], threshold_ms: u64) {
    let Some(run) = record_at(test, py, "py_tasks.py", args, threshold_ms) else {
        return;
    };
    let mut c = run.checks();
    check_python_contract(&mut c, &run);
    let blocks = run.records("block");
    c.check(blocks.len() >= 15, || {
        format!("the victim logged {} blocks, want 15 or more", blocks.len())
    });
    let mut named = 0usize;
    let (mut counted, mut short_missed) = (0usize, 0usize);
    for b in &blocks {
        let (t0, t1) = (num(b, "start_ns"), num(b, "end_ns"));
        let want = b["task"].as_str().unwrap_or_default();
        let who = format!("block {} in task {want:?} [{t0} .. {t1}]", b["how"]);
        let short =
            py.version < (3, 14) && SHORT_LIVED.contains(&b["coro"].as_str().unwrap_or_default());
        counted += usize::from(!short);
        let Some(s) = run.only_stall(&mut c, &who, t0, t1) else {
            continue;
        };
        let Some(t) = &s.task else {
            short_missed += usize::from(short);
            continue; // counted below
        };
        named += usize::from(!short);
        c.check(t.name == want, || {
            format!("{who}: the stall names task {:?}", t.name)
        });
        let coro = b["coro"].as_str().unwrap_or_default();
        c.check(t.coro.as_deref() == Some(coro), || {
            format!(
                "{who}: the stall names coroutine {:?}, want {coro:?}",
                t.coro
            )
        });
        let chain: Vec<String> = if py.version >= (3, 14) {
            serde_json::from_value(b["awaited_by"].clone()).unwrap_or_default()
        } else {
            Vec::new() // no await chain before 3.14
        };
        c.check(t.awaited_by == chain, || {
            format!("{who}: awaited by {:?}, want {chain:?}", t.awaited_by)
        });
    }
    let share = named as f64 / counted.max(1) as f64;
    eprintln!(
        "{test}: {named} of {counted} counted blocks named their task ({:.0}%), \
         {short_missed} of {} short-lived ones unnamed; drops {:?}",
        100.0 * share,
        blocks.len() - counted,
        run.rec.drops
    );
    c.check(share >= TASK_NAMED_SHARE, || {
        format!(
            "{named} of {counted} counted blocks have their task named ({:.0}%), \
             want {:.0}% or more",
            100.0 * share,
            100.0 * TASK_NAMED_SHARE
        )
    });
    // An unnamed short-lived task is said, never silent: by whichever of
    // the task-miss counters fits (docs/format.md). On 3.10-3.13 a task
    // finished by the late read leaves no `_current_tasks` entry:
    // `asyncio_task_unknown` (a fallback-pass run on pyenv 3.10).
    let missed_counted: u64 = [
        "asyncio_task_unverified",
        "asyncio_task_unreadable",
        "asyncio_task_unknown",
    ]
    .iter()
    .filter_map(|k| run.rec.drops.get(*k))
    .sum();
    c.check(missed_counted >= short_missed as u64, || {
        format!(
            "{short_missed} short-lived tasks unnamed, but the drops count {missed_counted} \
             task reads refused: {:?}",
            run.rec.drops
        )
    });
    c.check(
        run.output.lines().any(|l| {
            l.contains("janitor_sweep (py_tasks.py:") && l.ends_with(" — in task \"janitor\" (janitor)")
        }),
        || "the summary's culprit line for janitor_sweep does not say `— in task \"janitor\" (janitor)`".into(),
    );
    // Issue 37: the task is no frame of the default view; grouped by
    // task, the sweep's stacks are rooted in its coroutine.
    c.check(!run.folded.contains("[task "), || {
        "stalls.folded has a `[task …]` frame in the default view".into()
    });
    let rec = stallprof::report::read_json(&run.dir.join("out")).unwrap();
    let grouped = stallprof::report::aggregate::folded_lines(&stallprof::report::view::shown(
        &rec,
        stallprof::report::view::View {
            group_by: Some(stallprof::report::view::GroupBy::Task),
            ..Default::default()
        },
    ));
    c.check(
        grouped
            .iter()
            .any(|l| l.starts_with("task janitor;") && l.contains(";janitor_sweep (py_tasks.py)")),
        || "--group-by task roots no janitor_sweep stack in `task janitor`".into(),
    );
    c.finish();
}

/// py_tasks with `asyncio.tasks._current_tasks` replaced by a list (what
/// stallprof reads on 3.10-3.13): no stall names a task, each stall that
/// ran one is counted (`asyncio_task_unreadable`), and the recording says
/// why in `runtime_problems` and the summary.
pub fn check_tasks_unreadable(test: &str, py: &'static Python) {
    let Some(run) = record(test, py, "py_tasks.py", &["--hide-current-tasks"]) else {
        return;
    };
    let mut c = run.checks();
    let blocks = run.records("block").len() as u64;
    c.check(run.rec.stalls.iter().all(|s| s.task.is_none()), || {
        "a stall names a task although the task could not be read".into()
    });
    let counted = run
        .rec
        .drops
        .get("asyncio_task_unreadable")
        .copied()
        .unwrap_or(0);
    eprintln!("{test}: {blocks} blocks, asyncio_task_unreadable {counted}");
    c.check(counted >= blocks, || {
        format!("drops asyncio_task_unreadable is {counted}, want one per block ({blocks})")
    });
    let said = run
        .output
        .lines()
        .any(|l| l.contains("could not be read: asyncio task names unavailable"));
    c.check(said, || {
        "the summary does not say that task names are unavailable".into()
    });
    c.finish();
}

/// Issue 19 item 2 on every CPython: tests/victims/py_asgi_routes.py serves
/// requests through the shapes of uvicorn and Starlette (a cycle holding
/// the scope, a middleware, a router that sets `scope["route"]`), with the
/// standard library only; each endpoint call logs the scope's method and
/// route template. Each call must be one stall that carries that route
/// (in stalls.json), the two routes must be under the summary's `by
/// route`, and no stall that served a request may go without its route
/// (no `asgi_route_*` counter).
/// The span a victim's log record names: (trace id, span id).
fn logged_span(r: &serde_json::Value) -> (&str, &str) {
    (
        r["trace_id"].as_str().unwrap_or_default(),
        r["span_id"].as_str().unwrap_or_default(),
    )
}

pub fn check_routes(test: &str, py: &'static Python) {
    let Some(run) = record(test, py, "py_asgi_routes.py", &[]) else {
        return;
    };
    let mut c = run.checks();
    check_python_contract(&mut c, &run);
    let calls = run.records("call");
    c.check(calls.len() >= 6, || {
        format!("the victim logged {} calls, want 6 or more", calls.len())
    });
    let mut routes: Vec<String> = Vec::new();
    for call in &calls {
        let (t0, t1) = (num(call, "start_ns"), num(call, "end_ns"));
        let method = call["method"].as_str().unwrap_or_default();
        let template = call["route"].as_str().unwrap_or_default();
        let want = format!("{method} {template}");
        if !routes.contains(&want) {
            routes.push(want.clone());
        }
        let who = format!("{} {} [{t0} .. {t1}]", call["func"], call["path"]);
        let Some(s) = run.only_stall(&mut c, &who, t0, t1) else {
            continue;
        };
        let got = s
            .route
            .as_ref()
            .map(|r| format!("{} {}", r.method, r.template));
        c.check(got.as_deref() == Some(want.as_str()), || {
            format!("{who}: the stall's route is {got:?}, the victim served {want:?}")
        });
        // The span current in the request's task, as the victim's
        // OpenTelemetry-shaped context holds it.
        let want_ids = logged_span(call);
        let task = s.task.as_ref();
        let ids = task.and_then(|t| t.trace.as_ref()).map(SpanIds::pair);
        c.check(ids == Some(want_ids), || {
            format!(
                "{who}: the stall's span is {ids:?} (unreadable: {:?}), the victim's is {want_ids:?}",
                task.and_then(|t| t.trace_unreadable.as_deref())
            )
        });
    }
    let misses: Vec<(&String, &u64)> = run
        .rec
        .drops
        .iter()
        .filter(|(k, _)| k.starts_with("asgi_route_") || k.starts_with("otel_span_"))
        .collect();
    c.check(misses.is_empty(), || {
        format!("stalls that served a request without their route or span: {misses:?}")
    });
    // Issue 36: a callback the request scheduled (`call_later`) runs with
    // no task, under the request's context: its stall's span is the
    // thread's own context's.
    let callbacks = run.records("callback");
    c.check(!callbacks.is_empty(), || {
        "the victim logged no callback".into()
    });
    for cb in &callbacks {
        let (t0, t1) = (num(cb, "start_ns"), num(cb, "end_ns"));
        let who = format!("later_callback [{t0} .. {t1}]");
        c.check(cb["running_task"] == false, || {
            format!("{who}: the victim ran it inside a task")
        });
        let Some(s) = run.only_stall(&mut c, &who, t0, t1) else {
            continue;
        };
        let want = logged_span(cb);
        let thread = s.thread_context.as_ref();
        let ids = thread.and_then(|t| t.trace.as_ref()).map(SpanIds::pair);
        c.check(s.task.is_none() && ids == Some(want), || {
            format!(
                "{who}: the stall's task {:?}, thread span {ids:?} (unreadable: {:?}), the \
                 victim's {want:?}",
                s.task.as_ref().map(|t| &t.name),
                thread.and_then(|t| t.trace_unreadable.as_deref())
            )
        });
    }
    let by_route = summary_section(&run.output, "by route (");
    for r in &routes {
        c.check(
            by_route.iter().any(|l| l.contains(&format!("  {r} ("))),
            || format!("{r:?} is not under the summary's by route: {by_route:#?}"),
        );
    }
    c.finish();
}
