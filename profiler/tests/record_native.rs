//! Native-runtime issue, root integration tests: stalls of programs built the
//! way they ship, attributed through stacks that need no frame pointers.
//!
//! - tokio (tests/victims/tokio-victim, release, no frame pointers): tasks that
//!   block a worker with `std::thread::sleep` (`blocking_sleep`) and with a
//!   CPU-bound loop (`cpu_spin`), on the multi-thread runtime (2 workers) and
//!   on the current-thread runtime;
//! - Node (tests/victims/node_loop.js under `node --perf-basic-prof`): the loop
//!   blocked by `crypto.pbkdf2Sync` (`deriveKey`) and a big `JSON.parse`
//!   (`parseBig`), whose JS frames are named from /tmp/perf-PID.map;
//! - Node started with NO flags (tests/victims/node_noflags.js): pbkdf2Sync,
//!   a big JSON.parse, a catastrophic regex and a readFileSync of a slow
//!   FIFO, each named `func (node_noflags.js:LINE)` from V8's memory; and a
//!   victim that allocates until V8 scavenges and mark-compacts, whose
//!   stacks show `[gc]` under the allocating function;
//! - the C epoll victim (tests/victims/c_loop.c) built without frame pointers
//!   must be attributed like the same victim built with them.
//!
//! For tokio and Node, per victim stall: found (overlap, on the logged tid),
//! timed like the victim's own CLOCK_MONOTONIC log, ≥ 90% of its time on
//! stacks that contain the culprit frame AND, outer to it, the runtime's poll
//! loop — `multi_thread::worker::Context::run`, `current_thread::CoreGuard::
//! block_on`, libuv's `uv_run` — so the whole stack was unwound, not just
//! its leaf.
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS), cargo
//! with crates.io (to build the tokio victim once into
//! <target>/victims), /usr/bin/node (20), cc and objdump.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const THRESHOLD: &str = "40ms";
const THRESHOLD_NS: u64 = 40 * MS;
/// Share of a stall's time that must be on stacks through the culprit.
const CULPRIT_SHARE: f64 = 0.90;
/// The victims start stalling this long after they start (the profiler's
/// runtime-specific probes go in within ~250 ms of exec).
const FIRST_STALL_AFTER_NS: u64 = 500 * MS;
const NODE: &str = "/usr/bin/node";
/// Exactly how the issue runs Node. (`--interpreted-frames-native-stack` is
/// deliberately NOT added: the test is about what --perf-basic-prof gives.)
/// `--perf-basic-prof` writes /tmp/perf-PID.map; without
/// `--interpreted-frames-native-stack` every interpreted JS function runs in
/// the one shared `InterpreterEntryTrampoline` and cannot be told apart
/// (Node's own guidance for Linux perf uses both).
const NODE_FLAGS: &[&str] = &["--perf-basic-prof", "--interpreted-frames-native-stack"];

// ---------------------------------------------------------------------------
// Frame matching

/// A native frame is `func` itself: `func`, or a path ending in `::func`
/// (Rust names are demangled with their crate path, C++ ones may carry a
/// parameter list).
fn native_is(name: &str, func: &str) -> bool {
    let base = name.split_once('(').map_or(name, |(b, _)| b);
    base == func || base.ends_with(&format!("::{func}"))
}

/// The JS function a perf-map frame names, e.g. `deriveKey` for
/// `JS:*deriveKey /path/node_loop.js:55:19` (`~` interpreted, `^` Sparkplug,
/// `+` Maglev, `*` TurboFan; older V8 says `LazyCompile:` or `Function:`).
fn js_function(name: &str) -> Option<&str> {
    let rest = ["JS:", "LazyCompile:", "Function:"]
        .iter()
        .find_map(|p| name.strip_prefix(p))?;
    let rest = rest.trim_start_matches(['~', '^', '+', '*']);
    Some(rest.split(' ').next().unwrap_or(""))
}

/// Index (outermost = 0) of the first frame matching `pred`.
fn position(st: &Stack, pred: impl Fn(&Frame) -> bool) -> Option<usize> {
    st.frames.iter().position(pred)
}

/// Weight of the stall's stacks that contain the culprit, and of those that
/// also have a poll-loop frame outer to the culprit.
fn culprit_weights(
    s: &Stall,
    is_culprit: &dyn Fn(&Frame) -> bool,
    is_loop: &dyn Fn(&Frame) -> bool,
) -> (u64, u64) {
    let mut with_culprit = 0;
    let mut through_loop = 0;
    for st in &s.stacks {
        // The innermost culprit frame: with recursion the outermost would do too.
        let Some(ci) = st.frames.iter().rposition(is_culprit) else {
            continue;
        };
        with_culprit += st.weight_ns;
        if st.frames[..ci].iter().any(is_loop) {
            through_loop += st.weight_ns;
        }
    }
    (with_culprit, through_loop)
}

fn pct(part: u64, whole: u64) -> f64 {
    100.0 * part as f64 / whole.max(1) as f64
}

/// The heaviest stacks not through the culprit, innermost frames first: the
/// evidence when a share is too low.
fn missing_evidence(s: &Stall, is_culprit: &dyn Fn(&Frame) -> bool, n: usize) -> String {
    let mut rest: Vec<&Stack> = s
        .stacks
        .iter()
        .filter(|st| !st.frames.iter().any(is_culprit))
        .collect();
    rest.sort_by_key(|st| std::cmp::Reverse(st.weight_ns));
    let mut out = String::new();
    for st in rest.into_iter().take(n) {
        let inner: Vec<&str> = st
            .frames
            .iter()
            .rev()
            .take(14)
            .map(|f| f.name.as_str())
            .collect();
        let _ = write!(
            out,
            "\n        {:.2} ms {}{}: [innermost first] {}",
            ms(st.weight_ns),
            st.kind,
            st.syscall
                .as_deref()
                .map(|s| format!("/{s}"))
                .unwrap_or_default(),
            inner.join(" <- ")
        );
    }
    out
}

/// One line per stall, with the innermost frames of its heaviest stack (the
/// full `Stall::summary` of a 60-frame tokio stack buries the table).
fn brief_stalls_table(rec: &Recording) -> String {
    let mut s = format!(
        "stalls.json: pid {} comm {:?} lost {} drops {:?}, {} stalls:\n",
        rec.pid,
        rec.comm,
        rec.lost_events,
        rec.drops,
        rec.stalls.len()
    );
    for st in &rec.stalls {
        let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
        for k in &st.stacks {
            *by_kind
                .entry(format!(
                    "{}/{}",
                    k.kind,
                    k.syscall.as_deref().unwrap_or("-")
                ))
                .or_default() += k.weight_ns;
        }
        let heavy = st.stacks.iter().max_by_key(|k| k.weight_ns).map(|k| {
            k.frames
                .iter()
                .rev()
                .filter(|f| f.kind != "kernel")
                .take(5)
                .map(|f| f.name.as_str())
                .collect::<Vec<_>>()
                .join(" <- ")
        });
        let _ = writeln!(
            s,
            "  tid {} {:?} [{} .. {}] {:.2} ms (on {:.2} / off {:.2} / rq {:.2}){} {:?} heaviest (innermost first): {}",
            st.tid,
            st.thread_name,
            st.start_ns,
            st.end_ns,
            ms(st.duration_ns),
            ms(st.on_cpu_ns),
            ms(st.off_cpu_ns),
            ms(st.runqueue_ns),
            if st.incomplete { " INCOMPLETE" } else { "" },
            by_kind
                .iter()
                .map(|(k, w)| format!("{k}={:.1}", ms(*w)))
                .collect::<Vec<_>>(),
            heavy.unwrap_or_default()
        );
    }
    s
}

/// The folded file's heaviest lines through `needle` (or all), for context.
fn folded_excerpt(folded: &str, needle: Option<&str>, n: usize) -> String {
    let mut lines: Vec<(u64, &str)> = folded
        .lines()
        .filter(|l| needle.is_none_or(|x| l.contains(x)))
        .filter_map(|l| {
            l.rsplit_once(' ')
                .map(|(st, w)| (w.trim().parse().unwrap_or(0), st))
        })
        .collect();
    lines.sort_by_key(|(w, _)| std::cmp::Reverse(*w));
    let mut out = String::new();
    for (w, st) in lines.into_iter().take(n) {
        let frames: Vec<&str> = st.split(';').collect();
        let tail = &frames[frames.len().saturating_sub(12)..];
        let _ = writeln!(out, "  {w} µs  …;{}", tail.join(";"));
    }
    out
}

// ---------------------------------------------------------------------------
// Victims and their logs

/// Records with start_ns/end_ns around the culprit call (tokio, Node).
fn call_truth(log: &[serde_json::Value], kinds: &[&str]) -> Vec<Truth> {
    let num = |r: &serde_json::Value, k: &str| {
        r[k].as_u64()
            .unwrap_or_else(|| panic!("victim log record lacks numeric {k:?}: {r}"))
    };
    log.iter()
        .filter(|r| r["kind"].as_str().is_some_and(|k| kinds.contains(&k)))
        .map(|r| Truth {
            kind: r["kind"].as_str().unwrap().into(),
            func: r["func"]
                .as_str()
                .unwrap_or_else(|| panic!("victim log record lacks func: {r}"))
                .into(),
            tid: num(r, "tid"),
            start_ns: num(r, "start_ns"),
            end_ns: num(r, "end_ns"),
            cpu_ns: r["cpu_ns"].as_u64().unwrap_or(0),
        })
        .collect()
}

/// Runs a command to completion with a deadline (killing it on timeout).
fn run_with_deadline(cmd: &mut Command, timeout: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {what}: {e}"));
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let t_out = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut out, &mut b);
        b
    });
    let t_err = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut err, &mut b);
        b
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} did not finish within {timeout:?}; killed it.\nstderr:\n{}",
                String::from_utf8_lossy(&t_err.join().unwrap_or_default())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    }
}

/// The workspace's target directory: stallprof is <target>/<profile>/stallprof.
fn target_dir() -> PathBuf {
    Path::new(stallprof_bin())
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf()
}

/// Builds tests/victims/tokio-victim (release, its own Cargo.lock) into
/// <target>/victims once per test binary, and checks that its code keeps no
/// frame-pointer chain.
fn tokio_victim() -> PathBuf {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = built.as_ref() {
        return p.clone();
    }
    let manifest = victims_dir().join("tokio-victim/Cargo.toml");
    let target = target_dir().join("victims");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["build", "--release", "--locked", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target);
    // Built exactly as its Cargo.toml says: no flags from the outer build
    // (e.g. -C force-frame-pointers) may leak in.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
    ] {
        cmd.env_remove(var);
    }
    let out = run_with_deadline(&mut cmd, Duration::from_secs(600));
    assert!(
        out.status.success(),
        "building the tokio victim ({} build --release --locked --manifest-path {}) failed \
         (it needs crates.io or a warm ~/.cargo registry):\n{}",
        Path::new(&cargo).display(),
        manifest.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let exe = target.join("release/tokio-victim");
    assert!(
        exe.exists(),
        "cargo built the tokio victim but {} is missing",
        exe.display()
    );
    assert_no_frame_pointer_chain(&exe);
    *built = Some(exe.clone());
    exe
}

/// The victim's own functions and tokio's worker loop must not set up a
/// frame-pointer chain (`mov %rsp,%rbp`): otherwise the test would not show
/// that stacks are unwound from .eh_frame. (rbp may still be pushed and used
/// as an ordinary callee-saved register.)
fn assert_no_frame_pointer_chain(exe: &Path) {
    let out = run_with_deadline(
        Command::new("objdump")
            .args(["-d", "-C", "--no-show-raw-insn"])
            .arg(exe),
        Duration::from_secs(120),
    );
    assert!(
        out.status.success(),
        "objdump -d {} failed: {}",
        exe.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let watched = |f: &str| {
        f.contains("<tokio_victim::")
            || f.contains("<tokio::runtime::scheduler::multi_thread::worker::Context::run")
            || f.contains("<tokio::runtime::scheduler::current_thread::CoreGuard::block_on")
    };
    let mut func = "";
    let mut seen = 0;
    let mut with_fp = Vec::new();
    for line in text.lines() {
        if line.ends_with(">:") {
            func = line;
            if watched(func) {
                seen += 1;
            }
        } else if watched(func)
            && line.contains("mov    %rsp,%rbp")
            && with_fp.last() != Some(&func)
        {
            with_fp.push(func);
        }
    }
    assert!(
        seen >= 4,
        "objdump of {} shows {seen} tokio_victim/tokio worker functions; symbols missing?",
        exe.display()
    );
    assert!(
        with_fp.is_empty(),
        "the tokio victim keeps frame pointers in {with_fp:?}: it must be built without them \
         (no force-frame-pointers in its Cargo.toml or RUSTFLAGS)"
    );
}

/// `stallprof record --threshold 40ms -o OUT -- ARGV…`, which must succeed,
/// run in the test's scratch directory `cwd`: the victim inherits it, and
/// whatever it writes there (Node's isolate-*-v8.log) stays out of the tree.
fn record(cwd: &Path, argv: &[&OsStr], out: &Path, timeout: Duration) -> RunOutput {
    record_with(cwd, &[], argv, out, timeout)
}

/// [`record`] with extra `stallprof record` options.
fn record_with(
    cwd: &Path,
    options: &[&str],
    argv: &[&OsStr],
    out: &Path,
    timeout: Duration,
) -> RunOutput {
    let mut args: Vec<&OsStr> = vec![
        "record".as_ref(),
        "--threshold".as_ref(),
        THRESHOLD.as_ref(),
    ];
    args.extend(options.iter().map(OsStr::new));
    args.push("-o".as_ref());
    args.push(out.as_os_str());
    args.push("--".as_ref());
    args.extend_from_slice(argv);
    let run = run_stallprof_in(cwd, &args, timeout);
    assert!(
        run.status.success(),
        "stallprof {args:?} failed:\n{}",
        run.describe()
    );
    run
}

/// The victim finished, and its log says it stalled as planned: `per_kind`
/// calls of each kind, each well over the threshold, the first one well after
/// start.
fn victim_truth(
    log_path: &Path,
    kinds: &[&str],
    per_kind: usize,
) -> (serde_json::Value, Vec<Truth>) {
    let log = read_log(log_path);
    let raw = || std::fs::read_to_string(log_path).unwrap_or_default();
    assert!(
        log.iter().any(|r| r["kind"] == "done"),
        "the victim did not finish its schedule; log:\n{}",
        raw()
    );
    let ready = log
        .iter()
        .find(|r| r["kind"] == "ready")
        .cloned()
        .unwrap_or_else(|| panic!("no ready record:\n{}", raw()));
    let truth = call_truth(&log, kinds);
    for k in kinds {
        assert_eq!(
            truth.iter().filter(|t| t.kind == *k).count(),
            per_kind,
            "the victim's schedule has {per_kind} {k:?} calls; its log:\n{}",
            truth_table(&truth)
        );
    }
    assert_calls_as_planned(&truth, THRESHOLD_NS + 20 * MS);
    let first = truth.iter().map(|t| t.start_ns).min().unwrap();
    let t0 = ready["mono_ns"]
        .as_u64()
        .unwrap_or_else(|| panic!("ready record lacks mono_ns: {ready}"));
    assert!(
        first >= t0 + FIRST_STALL_AFTER_NS,
        "the victim's first stall comes {:.0} ms after it started, want ≥ {} ms",
        ms(first - t0),
        FIRST_STALL_AFTER_NS / MS
    );
    (ready, truth)
}

/// How one runtime's victim is judged.
struct Runtime<'a> {
    /// Name the stalled thread must have.
    thread_name: &'a str,
    /// Is this frame the culprit of a victim call `func`?
    is_culprit: &'a dyn Fn(&Frame, &str) -> bool,
    /// Is this frame the runtime's poll loop (must be outer to the culprit)?
    is_loop: &'a dyn Fn(&Frame) -> bool,
    loop_desc: &'a str,
    /// How far the stall may extend beyond the call, before and after (the
    /// loop iteration's own work around the call), on top of the stall's
    /// run-queue time outside the culprit.
    slack_before_ns: u64,
    slack_after_ns: u64,
    /// Fail on stalls, between the first and last call, that match no call.
    no_extra_stalls: bool,
}

/// Every victim call found as exactly one stall on its thread, timed like the
/// victim's log, with ≥ 90% of its time on stacks through the culprit and,
/// outer to it, the runtime's poll loop.
fn check_calls(c: &mut Checks, rec: &Recording, truth: &[Truth], rt: &Runtime) {
    for t in truth {
        let who = format!(
            "{} ({}, {:.2} ms at {}, tid {})",
            t.kind,
            t.func,
            ms(t.duration_ns()),
            t.start_ns,
            t.tid
        );
        let all = overlapping(rec, t);
        let found: Vec<&&Stall> = all.iter().filter(|s| s.tid as u64 == t.tid).collect();
        if found.len() != 1 {
            c.fail(format!(
                "{who}: {} overlapping stalls on its thread, want exactly 1 (on any thread: {:?})",
                found.len(),
                all.iter()
                    .map(|s| (s.tid, ms(s.duration_ns)))
                    .collect::<Vec<_>>()
            ));
            continue;
        }
        let s = found[0];
        c.check(s.thread_name == rt.thread_name, || {
            format!(
                "{who}: thread_name {:?}, want {:?}",
                s.thread_name, rt.thread_name
            )
        });
        c.check(!s.incomplete, || format!("{who}: marked incomplete"));
        let is_culprit = |f: &Frame| (rt.is_culprit)(f, &t.func);
        // The busy period encloses the call, plus the little work around it
        // in the same loop iteration — and, on a busy machine, the time that
        // work waited for a CPU. A preemption carries no stack: its run-queue
        // time goes to the thread's latest sample, or, before the busy
        // period's first one (the gate holds samples back for its first
        // 2 ms), to the first — inside the call when the call began meanwhile
        // (a fallback-pass run: preempted ~11 ms between the loop's wakeup and
        // `deriveKey`, charged to `deriveKey`'s first sample). So any of the
        // stall's run-queue time may lie outside the call.
        let rq_outside: u64 = s.runqueue_ns;
        let before = t.start_ns as i64 - s.start_ns as i64;
        let after = s.end_ns as i64 - t.end_ns as i64;
        let (max_before, max_after) = (
            rt.slack_before_ns + rq_outside,
            rt.slack_after_ns + rq_outside,
        );
        c.check(before >= -(MS as i64) && before <= max_before as i64, || {
            format!(
                "{who}: the stall starts {:+.2} ms before the call (want -1 ..= {:.2} ms: {:.0} ms + {:.2} ms run-queue, wherever it was, around {})",
                ms_i(before),
                ms(max_before),
                ms(rt.slack_before_ns),
                ms(rq_outside),
                t.func
            )
        });
        c.check(after >= -(MS as i64) && after <= max_after as i64, || {
            format!(
                "{who}: the stall ends {:+.2} ms after the call (want -1 ..= {:.2} ms: {:.0} ms + {:.2} ms run-queue, wherever it was, around {})",
                ms_i(after),
                ms(max_after),
                ms(rt.slack_after_ns),
                ms(rq_outside),
                t.func
            )
        });

        let (w_culprit, w_loop) = culprit_weights(s, &is_culprit, rt.is_loop);
        let d = s.duration_ns;
        c.check(w_culprit as f64 >= CULPRIT_SHARE * d as f64, || {
            format!(
                "{who}: stacks containing {} carry {:.1}% of the stall ({:.2} of {:.2} ms); heaviest others:{}",
                t.func,
                pct(w_culprit, d),
                ms(w_culprit),
                ms(d),
                missing_evidence(s, &is_culprit, 4)
            )
        });
        c.check(w_loop as f64 >= CULPRIT_SHARE * d as f64, || {
            format!(
                "{who}: stacks through {} with {} outer to it carry {:.1}% of the stall ({:.1}% contain {} at all)",
                t.func,
                rt.loop_desc,
                pct(w_loop, d),
                pct(w_culprit, d),
                t.func
            )
        });
    }
    if rt.no_extra_stalls {
        let first = truth.iter().map(|t| t.start_ns).min().unwrap();
        let last = truth.iter().map(|t| t.end_ns).max().unwrap();
        for s in rec.stalls.iter().filter(|s| s.overlaps(first, last)) {
            if !truth
                .iter()
                .any(|t| s.tid as u64 == t.tid && s.overlaps(t.start_ns, t.end_ns))
            {
                c.fail(format!(
                    "extra stall between the victim's calls, matching none: {}",
                    s.summary()
                ));
            }
        }
    }
}

fn ms_i(ns: i64) -> f64 {
    ns as f64 / 1e6
}

// ---------------------------------------------------------------------------
// tokio

const TOKIO_KINDS: [&str; 2] = ["sleep", "spin"];

fn record_tokio(test: &str, flavor: &str) {
    if !require_root_and_bpf(test) {
        return;
    }
    // Build under the lock too: a cargo build on 2 cores would distort
    // another test's recording.
    let _serial = serial();
    let exe = tokio_victim();
    let dir = Scratch::new(test);
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");
    record(
        &dir.path,
        &[
            exe.as_os_str(),
            log.as_os_str(),
            "--flavor".as_ref(),
            flavor.as_ref(),
        ],
        &out,
        Duration::from_secs(60),
    );
    let (ready, truth) = victim_truth(&log, &TOKIO_KINDS, 4);
    let pid = ready["pid"].as_u64().unwrap() as u32;
    let rec = load_recording(&out);
    let folded = std::fs::read_to_string(out.join("stalls.folded")).unwrap_or_default();

    let mut c = Checks::new(format!(
        "tokio victim, --flavor {flavor}\n{}\n{}\nstalls.folded, heaviest lines (innermost 12 frames):\n{}",
        truth_table(&truth),
        brief_stalls_table(&rec),
        folded_excerpt(&folded, None, 8)
    ));
    check_contract(&mut c, &rec, THRESHOLD_NS);
    c.check(rec.pid == pid, || {
        format!("pid is {}, want the victim's {pid}", rec.pid)
    });
    c.check(rec.comm == "tokio-victim", || {
        format!("comm is {:?}, want \"tokio-victim\"", rec.comm)
    });

    // The poll loop: the worker's run loop, or block_on's loop on the
    // current-thread runtime. Both call Context::run_task, which polls the task.
    let loop_frame = match flavor {
        "multi" => "tokio::runtime::scheduler::multi_thread::worker::Context::run",
        _ => "tokio::runtime::scheduler::current_thread::CoreGuard::block_on",
    };
    let is_loop = |f: &Frame| f.name == loop_frame;
    let is_culprit = |f: &Frame, func: &str| f.kind == "native" && native_is(&f.name, func);
    let rt = Runtime {
        thread_name: if flavor == "multi" {
            "tokio-rt-worker"
        } else {
            "tokio-victim"
        },
        is_culprit: &is_culprit,
        is_loop: &is_loop,
        loop_desc: loop_frame,
        // The task's own bookkeeping: a clock read before, a log write after.
        slack_before_ns: 3 * MS,
        slack_after_ns: 3 * MS,
        no_extra_stalls: true,
    };
    check_calls(&mut c, &rec, &truth, &rt);

    // The time split follows the culprit: blocked in (clock_)nanosleep, or
    // on-CPU (on a busy machine: on-CPU or waiting for a CPU).
    for t in &truth {
        let Some(s) = rec
            .stalls
            .iter()
            .find(|s| s.tid as u64 == t.tid && s.overlaps(t.start_ns, t.end_ns))
        else {
            continue;
        };
        let who = format!(
            "{} ({:.2} ms at {})",
            t.func,
            ms(t.duration_ns()),
            t.start_ns
        );
        if t.kind == "sleep" {
            let slept = s.off_cpu_weight_in(&["clock_nanosleep", "nanosleep"]);
            c.check(pct(slept, s.duration_ns) >= 80.0, || {
                format!(
                    "{who}: only {:.0}% of the stall is off-CPU in (clock_)nanosleep",
                    pct(slept, s.duration_ns)
                )
            });
        } else {
            c.check(
                pct(s.on_cpu_ns + s.runqueue_ns, s.duration_ns) >= 90.0,
                || {
                    format!(
                        "{who}: on_cpu + runqueue is only {:.0}% of the stall",
                        pct(s.on_cpu_ns + s.runqueue_ns, s.duration_ns)
                    )
                },
            );
        }
    }

    for func in ["blocking_sleep", "cpu_spin"] {
        c.check(
            folded.lines().any(|l| {
                l.split(';')
                    .any(|f| f.starts_with(&format!("tokio_victim::{func}")))
            }),
            || format!("stalls.folded has no line through tokio_victim::{func}"),
        );
    }
    c.finish();
}

/// Multi-thread runtime, 2 workers: the task blocks whichever worker ran it.
#[test]
fn record_tokio_multi_thread_release_no_frame_pointers() {
    record_tokio(
        "record_tokio_multi_thread_release_no_frame_pointers",
        "multi",
    );
}

/// Current-thread runtime: the task blocks the thread inside block_on.
#[test]
fn record_tokio_current_thread_release_no_frame_pointers() {
    record_tokio(
        "record_tokio_current_thread_release_no_frame_pointers",
        "current",
    );
}

// ---------------------------------------------------------------------------
// Node

/// Native parts of the Node culprits: only for the evidence in messages.
fn node_native_part(func: &str) -> &'static [&'static str] {
    match func {
        "deriveKey" => &["PBKDF2", "pbkdf2", "sha512_block"],
        _ => &["JsonParser"],
    }
}

#[test]
fn record_node_perf_basic_prof_pbkdf2_and_json_parse() {
    let test = "record_node_perf_basic_prof_pbkdf2_and_json_parse";
    if !require_root_and_bpf(test) {
        return;
    }
    assert!(
        Path::new(NODE).exists(),
        "{NODE} is missing: this test needs Node 20 there (see docs/testing.md)"
    );
    let _serial = serial();
    let dir = Scratch::new("node");
    let script = victims_dir().join("node_loop.js");
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");
    let mut argv: Vec<&OsStr> = vec![NODE.as_ref()];
    argv.extend(NODE_FLAGS.iter().map(OsStr::new));
    argv.push(script.as_os_str());
    argv.push(log.as_os_str());
    // In the scratch dir: --perf-basic-prof makes Node write
    // isolate-*-v8.log into its current directory.
    record(&dir.path, &argv, &out, Duration::from_secs(60));

    let (ready, truth) = victim_truth(&log, &["pbkdf2", "json"], 4);
    let pid = ready["pid"].as_u64().unwrap() as u32;
    let rec = load_recording(&out);
    let folded = std::fs::read_to_string(out.join("stalls.folded")).unwrap_or_default();
    let raw = read_stalls_json(&out.join("stalls.json"));

    let mut c = Checks::new(format!(
        "node {NODE_FLAGS:?} node_loop.js\n{}\n{}\nstalls.folded, heaviest lines through pbkdf2 (innermost 12 frames):\n{}\
         stalls.folded, heaviest lines through JsonParser:\n{}",
        truth_table(&truth),
        brief_stalls_table(&rec),
        folded_excerpt(&folded, Some("PBKDF2"), 4),
        folded_excerpt(&folded, Some("JsonParser"), 4)
    ));
    check_contract(&mut c, &rec, THRESHOLD_NS);
    c.check(rec.pid == pid, || {
        format!("pid is {}, want the victim's {pid}", rec.pid)
    });
    c.check(rec.comm == "node", || {
        format!("comm is {:?}, want \"node\"", rec.comm)
    });

    let is_culprit =
        |f: &Frame, func: &str| f.kind == "native" && js_function(&f.name) == Some(func);
    let is_loop = |f: &Frame| f.name == "uv_run";
    let rt = Runtime {
        thread_name: "node",
        is_culprit: &is_culprit,
        is_loop: &is_loop,
        loop_desc: "libuv's uv_run",
        slack_before_ns: 3 * MS,
        // After the call the same timer callback logs, re-arms its timeout,
        // and V8 may finish a scavenge it started on the parse's garbage.
        slack_after_ns: 15 * MS,
        // A GC of the parses' garbage may be a stall of its own: not ours to forbid.
        no_extra_stalls: false,
    };
    check_calls(&mut c, &rec, &truth, &rt);

    // Evidence for a too-low share: how much of each stall the native part
    // of the culprit, and the trampolines of interpreted frames, account for.
    for t in &truth {
        let Some(s) = rec
            .stalls
            .iter()
            .find(|s| s.tid as u64 == t.tid && s.overlaps(t.start_ns, t.end_ns))
        else {
            continue;
        };
        let parts = node_native_part(&t.func);
        let native: u64 = s
            .stacks
            .iter()
            .filter(|st| {
                st.frames
                    .iter()
                    .any(|f| parts.iter().any(|p| f.name.contains(p)))
            })
            .map(|st| st.weight_ns)
            .sum();
        let trampoline: u64 = s
            .stacks
            .iter()
            .filter(|st| {
                st.frames
                    .iter()
                    .any(|f| f.name.ends_with("InterpreterEntryTrampoline"))
            })
            .map(|st| st.weight_ns)
            .sum();
        c.add_context(&format!(
            "{} at {}: {:.0}% of the stall on stacks with {parts:?}, {:.0}% through V8's InterpreterEntryTrampoline (interpreted JS)",
            t.func,
            t.start_ns,
            pct(native, s.duration_ns),
            pct(trampoline, s.duration_ns)
        ));
    }

    // JS frames come from the perf map: kind native, module "[jit]", and name
    // the script's file.
    let mut js_frames = 0;
    for f in raw["stalls"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["stacks"].as_array().unwrap())
        .flat_map(|st| st["frames"].as_array().unwrap())
    {
        let name = f["name"].as_str().unwrap_or("");
        if !matches!(js_function(name), Some("deriveKey" | "parseBig")) {
            continue;
        }
        js_frames += 1;
        let ok = f["kind"] == "native" && f["module"] == "[jit]" && name.contains("node_loop.js");
        c.check(ok, || {
            format!(
                "JS culprit frame {f}: want kind native, module \"[jit]\", a name with node_loop.js"
            )
        });
        if !ok {
            break;
        }
    }
    c.check(js_frames > 0, || {
        let map = format!("/tmp/perf-{pid}.map");
        let entries: Vec<String> = std::fs::read_to_string(&map)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("deriveKey") || l.contains("parseBig"))
            .map(String::from)
            .collect();
        format!("no frame names deriveKey or parseBig; {map} has for them: {entries:?}")
    });
    c.finish();
}

// ---------------------------------------------------------------------------
// Node without flags: JS frames read from V8's memory

/// The line `function NAME(` is on in a victim's source (1-based).
fn js_function_line(source: &Path, func: &str) -> u32 {
    let text = std::fs::read_to_string(source)
        .unwrap_or_else(|e| panic!("reading {}: {e}", source.display()));
    let want = format!("function {func}(");
    text.lines()
        .position(|l| l.starts_with(&want))
        .unwrap_or_else(|| panic!("{} has no line starting {want:?}", source.display())) as u32
        + 1
}

/// A FIFO at `path` (the slow-pipe culprit reads it).
fn make_fifo(path: &Path) {
    let out = Command::new("mkfifo")
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("running mkfifo: {e} (coreutils is needed)"));
    assert!(out.status.success(), "mkfifo {}: {out:?}", path.display());
}

/// Every call of a Node victim started without flags: one stall, timed like
/// the call, ≥ 90% of it on stacks through the function's JS frame (kind
/// `js`, the script's file and the function's definition line) with
/// `uv_run` outer to it, a share within 10 points of the call's share of
/// the stall by the victim's own clock; and the summary's culprit lines
/// name the functions, not libuv.
pub(crate) fn check_node_no_flags(
    c: &mut Checks,
    rec: &Recording,
    truth: &[Truth],
    script: &Path,
    summary: &str,
) {
    let file = script.file_name().unwrap().to_str().unwrap().to_string();
    let lines: BTreeMap<String, u32> = truth
        .iter()
        .map(|t| (t.func.clone(), js_function_line(script, &t.func)))
        .collect();
    let is_culprit = |f: &Frame, func: &str| {
        f.kind == "js"
            && f.name == func
            && f.file.as_deref().is_some_and(|p| p.ends_with(&file))
            && f.line == lines.get(func).copied()
    };
    let is_loop = |f: &Frame| f.name == "uv_run";
    let rt = Runtime {
        thread_name: "node",
        is_culprit: &is_culprit,
        is_loop: &is_loop,
        loop_desc: "libuv's uv_run",
        slack_before_ns: 3 * MS,
        slack_after_ns: 15 * MS,
        no_extra_stalls: false,
    };
    check_calls(c, rec, truth, &rt);
    for t in truth {
        let Some(s) = rec
            .stalls
            .iter()
            .find(|s| s.tid as u64 == t.tid && s.overlaps(t.start_ns, t.end_ns))
        else {
            continue;
        };
        let (w, _) = culprit_weights(s, &|f| is_culprit(f, &t.func), &is_loop);
        let ours = pct(w, s.duration_ns);
        let theirs = pct(t.duration_ns(), s.duration_ns);
        c.check((ours - theirs).abs() <= 10.0, || {
            format!(
                "{} at {}: stallprof puts {ours:.1}% of the stall under {}, the victim's clock {theirs:.1}%: more than 10 points apart",
                t.kind, t.start_ns, t.func
            )
        });
        c.add_context(&format!(
            "{} ({}): stallprof {ours:.1}% vs victim {theirs:.1}% of a {:.1} ms stall",
            t.kind,
            t.func,
            ms(s.duration_ns)
        ));
    }
    for (func, line) in &lines {
        // `deriveKey (node_loop.js:11) — on-CPU`, or with the library call
        // it went through: `deriveKey (node_loop.js:11) → node:… … pbkdf2Sync — …`.
        let label = format!("{func} ({file}:{line}) ");
        c.check(
            summary.contains(&format!("{label}— ")) || summary.contains(&format!("{label}→ ")),
            || format!("the summary has no culprit line {label:?}"),
        );
    }
    let top = summary
        .lines()
        .skip_while(|l| !l.contains("top culprits"))
        .nth(1)
        .unwrap_or("");
    c.check(!top.contains("uv__run_timers"), || {
        format!("the top culprit is libuv's timer loop: {top:?}")
    });
}

/// Runs node_noflags.js (`mode`: "" or "gc") under `record` with no Node
/// flags; returns the truth, the recording, stalls.folded and the summary.
fn record_node_no_flags(
    name: &str,
    mode: &str,
    kinds: &[&str],
    per_kind: usize,
) -> (Vec<Truth>, Recording, String, String, PathBuf) {
    assert!(
        Path::new(NODE).exists(),
        "{NODE} is missing: this test needs Node 20 there (see docs/testing.md)"
    );
    let dir = Scratch::new(name);
    let script = victims_dir().join("node_noflags.js");
    let log = dir.join("victim.jsonl");
    let fifo = dir.join("slow.fifo");
    make_fifo(&fifo);
    let out = dir.join("out");
    let mut argv: Vec<&OsStr> = vec![NODE.as_ref(), script.as_os_str()];
    argv.push(log.as_os_str());
    argv.push(fifo.as_os_str());
    if !mode.is_empty() {
        argv.push(mode.as_ref());
    }
    // The collector's stalls are long and every sample in them is a new
    // stack: at 999 Hz on this 2-CPU box (the collector's helper threads
    // compete with the agent) the ring buffer overflows, with or without
    // JavaScript frames. 250 Hz still gives hundreds of samples per stall.
    // Otherwise the raw events are saved, for the replay check below.
    let options: &[&str] = if mode == "gc" {
        &["-F", "250"]
    } else {
        &["--save-events"]
    };
    let run = record_with(&dir.path, options, &argv, &out, Duration::from_secs(90));
    let (_, truth) = victim_truth(&log, kinds, per_kind);
    let rec = load_recording(&out);
    let folded = std::fs::read_to_string(out.join("stalls.folded")).unwrap_or_default();
    if mode.is_empty() {
        check_js_replay(&out, &dir.join("replay"), &truth, &script);
    }
    (truth, rec, folded, run.stdout, script)
}

/// A replay below the recorded threshold (raw events, unwind bundle and
/// symbols.json) names the same JavaScript functions, without the target.
fn check_js_replay(out: &Path, replay: &Path, truth: &[Truth], script: &Path) {
    let run = run_stallprof(
        &[
            "report".as_ref(),
            out.as_os_str(),
            "--threshold".as_ref(),
            "30ms".as_ref(),
            // Frames by line, to check each function's line.
            "--lines".as_ref(),
            "-o".as_ref(),
            replay.as_os_str(),
        ],
        Duration::from_secs(60),
    );
    assert!(
        run.status.success(),
        "report replay failed:\n{}",
        run.describe()
    );
    let folded = std::fs::read_to_string(replay.join("stalls.folded")).unwrap_or_default();
    for t in truth {
        let label = format!(
            "{} (node_noflags.js:{})",
            t.func,
            js_function_line(script, &t.func)
        );
        assert!(
            folded.contains(&label),
            "the replay (report --threshold 30ms) has no frame {label:?}:\n{}",
            folded_excerpt(&folded, None, 6)
        );
    }
}

#[test]
fn record_node_no_flags_four_culprits() {
    let test = "record_node_no_flags_four_culprits";
    if !require_root_and_bpf(test) {
        return;
    }
    let _serial = serial();
    let (truth, rec, folded, summary, script) =
        record_node_no_flags("node-noflags", "", &["pbkdf2", "json", "regex", "pipe"], 2);
    let mut c = Checks::new(format!(
        "node node_noflags.js (no flags)\n{}\n{}\nsummary:\n{summary}\nstalls.folded, heaviest lines:\n{}",
        truth_table(&truth),
        brief_stalls_table(&rec),
        folded_excerpt(&folded, None, 6)
    ));
    check_contract(&mut c, &rec, THRESHOLD_NS);
    check_node_no_flags(&mut c, &rec, &truth, &script, &summary);
    c.finish();
}

#[test]
fn record_node_no_flags_gc_under_the_allocating_function() {
    let test = "record_node_no_flags_gc_under_the_allocating_function";
    if !require_root_and_bpf(test) {
        return;
    }
    let _serial = serial();
    let (truth, rec, folded, summary, script) =
        record_node_no_flags("node-noflags-gc", "gc", &["gc"], 4);
    let mut c = Checks::new(format!(
        "node node_noflags.js gc (no flags)\n{}\n{}\nsummary:\n{summary}\nstalls.folded, heaviest lines through [gc]:\n{}",
        truth_table(&truth),
        brief_stalls_table(&rec),
        folded_excerpt(&folded, Some("[gc]"), 6)
    ));
    check_contract_at(&mut c, &rec, THRESHOLD_NS, 250);
    let line = js_function_line(&script, "churn");
    // Time under churn's JS frame with a [gc] marker inner to it, and which
    // collectors ran there (by the native frames under the marker).
    let (mut gc_ns, mut scavenge_ns, mut major_ns, mut churn_ns) = (0, 0, 0, 0);
    for t in &truth {
        for s in rec
            .stalls
            .iter()
            .filter(|s| s.tid as u64 == t.tid && s.overlaps(t.start_ns, t.end_ns))
        {
            for st in &s.stacks {
                let Some(ci) = st
                    .frames
                    .iter()
                    .position(|f| f.kind == "js" && f.name == "churn" && f.line == Some(line))
                else {
                    continue;
                };
                churn_ns += st.weight_ns;
                let Some(gi) = st.frames[ci..]
                    .iter()
                    .position(|f| f.kind == "marker" && f.name == "[gc]")
                else {
                    continue;
                };
                gc_ns += st.weight_ns;
                let under = &st.frames[ci + gi..];
                if under.iter().any(|f| f.name.contains("Scavenge")) {
                    scavenge_ns += st.weight_ns;
                }
                if under.iter().any(|f| {
                    f.name.contains("MarkCompact") || f.name.contains("IncrementalMarking")
                }) {
                    major_ns += st.weight_ns;
                }
            }
        }
    }
    c.add_context(&format!(
        "under churn: {:.1} ms, of which [gc] {:.1} ms (scavenge {:.1} ms, mark-compact/marking {:.1} ms)",
        ms(churn_ns),
        ms(gc_ns),
        ms(scavenge_ns),
        ms(major_ns)
    ));
    c.check(churn_ns > 0, || "no stack through churn's JS frame".into());
    c.check(scavenge_ns > 0, || {
        "no [gc] with V8's scavenger under churn's JS frame".into()
    });
    c.check(major_ns > 0, || {
        "no [gc] with V8's mark-compact (or incremental marking) under churn's JS frame".into()
    });
    c.finish();
}

// ---------------------------------------------------------------------------
// C without frame pointers

const C_CULPRITS: [(&str, &str); 3] = [
    ("spin", "spin_for_ms"),
    ("sleep", "sleep_for_ms"),
    ("pipe", "read_slow_pipe"),
];

fn build_c_loop_with(dir: &Path, flags: &[&str]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let out = dir.join("c_loop"); // the name is its comm
    let result = Command::new("cc")
        .args(flags)
        .args(["-pthread", "-o"])
        .arg(&out)
        .arg(c_loop_source())
        .output()
        .unwrap_or_else(|e| {
            panic!("running cc to build the C victim: {e} (is a C compiler installed?)")
        });
    assert!(
        result.status.success(),
        "cc {flags:?} c_loop.c failed:\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

struct CRun {
    how: String,
    truth: Vec<Truth>,
    rec: Recording,
    folded: String,
}

fn record_c_loop(dir: &Scratch, name: &str, flags: &[&str]) -> CRun {
    let exe = build_c_loop_with(&dir.join(name), flags);
    let log = dir.join(&format!("{name}.jsonl"));
    let out = dir.join(&format!("{name}-out"));
    record(
        &dir.path,
        &[exe.as_os_str(), log.as_os_str()],
        &out,
        Duration::from_secs(60),
    );
    let entries = read_log(&log);
    assert!(
        entries.iter().any(|r| r["kind"] == "done"),
        "c_loop ({flags:?}) did not finish; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let truth = c_loop_truth(&entries);
    assert_eq!(
        truth.len(),
        12,
        "the default c_loop schedule has 12 stalls:\n{}",
        truth_table(&truth)
    );
    CRun {
        how: format!("cc {}", flags.join(" ")),
        truth,
        rec: load_recording(&out),
        folded: std::fs::read_to_string(out.join("stalls.folded")).unwrap_or_default(),
    }
}

/// Each culprit's share of all stall time in a recording.
fn c_shares(run: &CRun) -> BTreeMap<&'static str, f64> {
    let total: u64 = run.rec.stalls.iter().map(|s| s.duration_ns).sum();
    C_CULPRITS
        .iter()
        .map(|(_, func)| {
            let w: u64 = run
                .rec
                .stalls
                .iter()
                .map(|s| s.weight_with(func, None, None))
                .sum();
            (*func, w as f64 / total.max(1) as f64)
        })
        .collect()
}

#[test]
fn record_c_loop_without_frame_pointers_attributes_like_with_them() {
    let test = "record_c_loop_without_frame_pointers_attributes_like_with_them";
    if !require_root_and_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("c-nofp");
    let nofp = record_c_loop(&dir, "nofp", &["-O2", "-g", "-fomit-frame-pointer"]);
    let fp = record_c_loop(&dir, "fp", &["-O1", "-g", "-fno-omit-frame-pointer"]);
    let (s_nofp, s_fp) = (c_shares(&nofp), c_shares(&fp));

    let mut ctx = String::new();
    for run in [&nofp, &fp] {
        let true_total: u64 = run.truth.iter().map(|t| t.duration_ns()).sum();
        let _ = writeln!(
            ctx,
            "== {}\n{}{}",
            run.how,
            truth_table(&run.truth),
            brief_stalls_table(&run.rec)
        );
        for (kind, func) in C_CULPRITS {
            let true_share = run
                .truth
                .iter()
                .filter(|t| t.kind == kind)
                .map(|t| t.duration_ns())
                .sum::<u64>();
            let _ = writeln!(
                ctx,
                "  {func}: {:.1}% of stall time by the victim's clock",
                pct(true_share, true_total)
            );
        }
        let _ = write!(
            ctx,
            "  stalls.folded, heaviest lines:\n{}",
            folded_excerpt(&run.folded, None, 6)
        );
    }
    let _ = writeln!(
        ctx,
        "shares without / with frame pointers: {s_nofp:.3?} / {s_fp:.3?}"
    );
    eprintln!(
        "c_loop culprit shares of stall time, without / with frame pointers: {s_nofp:.3?} / {s_fp:.3?}"
    );
    let mut c = Checks::new(ctx);

    for run in [&nofp, &fp] {
        check_contract(&mut c, &run.rec, THRESHOLD_NS);
        for t in &run.truth {
            let found = overlapping(&run.rec, t);
            c.check(found.len() == 1 && found[0].tid as u64 == t.tid, || {
                format!(
                    "{}: {} stall at {} found as {} stalls, want 1 on tid {}",
                    run.how,
                    t.func,
                    t.start_ns,
                    found.len(),
                    t.tid
                )
            });
        }
        for (_, func) in C_CULPRITS {
            // Found, and unwound all the way out: the culprit's stacks reach main.
            let mut w = 0;
            let mut w_main = 0;
            for st in run.rec.stalls.iter().flat_map(|s| &s.stacks) {
                if let Some(ci) = position(st, |f| f.name == func) {
                    w += st.weight_ns;
                    if st.frames[..ci].iter().any(|f| f.name == "main") {
                        w_main += st.weight_ns;
                    }
                }
            }
            c.check(w > 0, || format!("{}: no stack contains {func}", run.how));
            c.check(w_main as f64 >= 0.9 * w as f64, || {
                format!(
                    "{}: only {:.1}% of {func}'s weight is on stacks that reach main",
                    run.how,
                    pct(w_main, w)
                )
            });
        }
    }
    for (_, func) in C_CULPRITS {
        let (a, b) = (s_nofp[func], s_fp[func]);
        c.check((a - b).abs() <= 0.05, || {
            format!(
                "{func}: {:.1}% of stall time without frame pointers, {:.1}% with them (> 5 points apart)",
                100.0 * a,
                100.0 * b
            )
        });
    }
    c.finish();
}
