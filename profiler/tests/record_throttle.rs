//! Issue 20, root integration tests: the CPU taken away from a loop, said
//! per stall. An asyncio victim (tests/victims/py_throttle.py) whose
//! callbacks burn CPU, recorded three ways:
//!
//! - in a cgroup with a CFS quota of 10 ms per 100 ms (cgroup v1's cpu
//!   controller on this host, made by the test and removed in `Drop`): its
//!   stalls cover its own lag log, their `throttled` parts add up to the
//!   cgroup's own throttled time over the recording (`cpu.stat`), and the
//!   recording reports the quota;
//! - pinned (taskset) to the CPU a higher-priority (nice -10) busy process
//!   runs on: its run-queue time names that process, nothing is throttled;
//! - with neither: nothing is throttled, and no quota is reported.
//!
//! The victim's log (time.monotonic_ns()) is the truth: its late
//! heartbeats are the lag an in-process lag monitor sees.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const THRESHOLD: &str = "20ms";
const THRESHOLD_NS: u64 = 20 * MS;
/// Heartbeat lateness the lag checks look at: well over the threshold, so
/// a late beat is a stall the loop could not have hidden under it.
const LAG_NS: u64 = 50 * MS;

/// A cgroup v1 cpu-controller cgroup with a CFS quota, removed on drop
/// (its processes moved back to the root cgroup first).
struct QuotaCgroup {
    dir: PathBuf,
    root: PathBuf,
}

impl QuotaCgroup {
    fn new(test: &str, quota_us: u64, period_us: u64) -> QuotaCgroup {
        let root = PathBuf::from("/sys/fs/cgroup/cpu");
        assert!(
            root.join("cpu.cfs_quota_us").exists(),
            "{test} needs cgroup v1's cpu controller at {} (this host's layout); \
             on a cgroup v2 host the test must be ported to cpu.max",
            root.display()
        );
        let dir = root.join(format!("stallprof-test-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("{test}: creating cgroup {}: {e}", dir.display()));
        let cg = QuotaCgroup { dir, root };
        cg.write("cpu.cfs_period_us", period_us);
        cg.write("cpu.cfs_quota_us", quota_us);
        cg
    }

    fn write(&self, file: &str, v: impl ToString) {
        let path = self.dir.join(file);
        std::fs::write(&path, v.to_string())
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }

    fn enter(&self, pid: u32) {
        self.write("cgroup.procs", pid);
    }

    /// The path `/proc/PID/cgroup` shows for it.
    fn path(&self) -> String {
        format!("/{}", self.dir.strip_prefix(&self.root).unwrap().display())
    }
}

impl Drop for QuotaCgroup {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines() {
            let _ = std::fs::write(self.root.join("cgroup.procs"), pid);
        }
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!("could not remove cgroup {}: {e}", self.dir.display());
        }
    }
}

/// A process spinning at nice -10 on `cpu`, named `cpuhog`.
fn cpu_hog(python: &Path, cpu: u32) -> Victim {
    Victim::spawn(
        Command::new("nice")
            .args(["-n", "-10", "taskset", "-c", &cpu.to_string()])
            .arg(python)
            .args([
                "-c",
                "import ctypes\nctypes.CDLL(None).prctl(15, b'cpuhog', 0, 0, 0)\nwhile True: pass",
            ]),
    )
}

struct Recorded {
    out: PathBuf,
    log: Vec<serde_json::Value>,
    rec: Recording,
    tid: u64,
    summary: String,
}

/// Runs the victim through `wrap` (a command prefix such as `taskset -c
/// 1`), lets `setup` place it (a cgroup), records it with `--pid` from
/// before its first burn to after its last, and loads the recording.
fn record(
    test: &str,
    dir: &Scratch,
    wrap: &[&str],
    setup: impl FnOnce(u32),
    rounds: u32,
    settle_ms: u32,
) -> Recorded {
    let python = require_python(3, 11);
    let log_path = dir.join("victim.jsonl");
    let go = dir.join("go");
    let out = dir.join("out");
    let mut cmd = match wrap.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(&python);
            c
        }
        None => Command::new(&python),
    };
    cmd.arg(victims_dir().join("py_throttle.py"))
        .arg(&log_path)
        .arg(&go)
        .args(["--rounds", &rounds.to_string()])
        .args(["--settle-ms", &settle_ms.to_string()]);
    let mut victim = Victim::spawn(&mut cmd);
    setup(victim.pid());
    let ready = wait_for_log_kind(&log_path, "ready", Duration::from_secs(20));
    victim.assert_running();
    let pid = ready["pid"].as_u64().unwrap() as u32;
    let mut prof = Profiler::spawn(&[
        "record".to_string(),
        "--threshold".into(),
        THRESHOLD.into(),
        "--duration".into(),
        "120s".into(), // a backstop only: the victim's exit ends it
        "-o".into(),
        out.display().to_string(),
        "--pid".into(),
        pid.to_string(),
    ]);
    wait_for_attach(&mut prof, Duration::from_secs(30));
    std::fs::write(&go, b"go").unwrap();
    wait_for_log_kind(&log_path, "done", Duration::from_secs(90));
    let run = prof.wait(Duration::from_secs(60));
    assert!(
        run.status.success(),
        "{test}: stallprof record failed:\n{}",
        run.describe()
    );
    let rec = load_recording(&out);
    let mut c = Checks::new(format!("{test}\n{}", run.describe()));
    check_contract(&mut c, &rec, THRESHOLD_NS);
    c.finish();
    Recorded {
        out,
        log: read_log(&log_path),
        rec,
        tid: ready["tid"].as_u64().unwrap(),
        summary: run.stdout,
    }
}

/// Of the victim's late heartbeats (>= LAG_NS) while it was recorded, the
/// share of their lateness that the loop thread's stalls cover. (Lag
/// before the recording began — a victim in a small quota is throttled
/// while Python starts — is no stall's.)
fn lag_coverage(r: &Recorded) -> (f64, u64) {
    let (mut lag, mut covered) = (0u64, 0u64);
    for l in r.log.iter().filter(|l| l["kind"] == "late") {
        let (s, e) = (
            l["start_ns"].as_u64().unwrap(),
            l["end_ns"].as_u64().unwrap(),
        );
        if e - s < LAG_NS || s < r.rec.started_ns {
            continue;
        }
        lag += e - s;
        covered += r
            .rec
            .stalls
            .iter()
            .filter(|st| u64::from(st.tid) == r.tid)
            .map(|st| e.min(st.end_ns).saturating_sub(s.max(st.start_ns)))
            .sum::<u64>();
    }
    (covered as f64 / lag.max(1) as f64, lag)
}

fn throttled_parts(rec: &Recording) -> u64 {
    rec.stalls
        .iter()
        .flat_map(|s| &s.stacks)
        .filter(|p| p.kind == "throttled")
        .map(|p| p.weight_ns)
        .sum()
}

#[test]
fn throttled_by_its_own_quota() {
    let test = "throttled_by_its_own_quota";
    if !require_root_and_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new(test);
    let cg = QuotaCgroup::new("quota", 10_000, 100_000);
    let r = record(test, &dir, &[], |pid| cg.enter(pid), 6, 200);
    let ctx = format!("{}\n{}", stalls_table(&r.rec), r.summary);

    let (coverage, lag) = lag_coverage(&r);
    assert!(lag > 0, "the victim saw no lag: was it throttled?\n{ctx}");
    assert!(
        coverage >= 0.95,
        "stalls cover {:.1}% of the victim's {:.0} ms of lag, want >= 95%\n{ctx}",
        100.0 * coverage,
        ms(lag)
    );

    let q = r
        .rec
        .cpu_quota
        .as_ref()
        .unwrap_or_else(|| panic!("no cpu_quota\n{ctx}"));
    assert_eq!(q["cgroup_version"], "v1", "{q}");
    assert_eq!(q["cgroup"], cg.path(), "{q}");
    assert_eq!(
        (q["quota_us"].as_u64(), q["period_us"].as_u64()),
        (Some(10_000), Some(100_000))
    );
    let cgroup_ns =
        q["end"]["throttled_ns"].as_u64().unwrap() - q["start"]["throttled_ns"].as_u64().unwrap();
    let stalls_ns: u64 = r.rec.stalls.iter().map(|s| s.throttled_ns).sum();
    assert_eq!(
        stalls_ns,
        throttled_parts(&r.rec),
        "throttled_ns vs the parts"
    );
    assert!(
        cgroup_ns > 500 * MS,
        "the cgroup was throttled only {:.0} ms while recording\n{ctx}",
        ms(cgroup_ns)
    );
    let off = (stalls_ns as f64 - cgroup_ns as f64).abs() / cgroup_ns as f64;
    assert!(
        off <= 0.10,
        "the stalls' throttled parts ({:.0} ms) differ from the cgroup's throttled time \
         over the recording ({:.0} ms) by {:.1}%, want <= 10%\n{ctx}",
        ms(stalls_ns),
        ms(cgroup_ns),
        100.0 * off
    );
    assert!(
        r.summary.contains("CPU throttled") && r.summary.contains("CPU quota: 10ms/100ms"),
        "the summary does not say it:\n{}",
        r.summary
    );
    let trace = std::fs::read(r.out.join("stalls.pftrace")).unwrap();
    assert!(
        trace
            .windows(b"CPU throttled (quota 10ms/100ms)".len())
            .any(|w| w == b"CPU throttled (quota 10ms/100ms)"),
        "no `CPU throttled (quota 10ms/100ms)` slice in stalls.pftrace"
    );
}

#[test]
fn run_queue_names_the_cpu_holder() {
    let test = "run_queue_names_the_cpu_holder";
    if !require_root_and_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new(test);
    let python = require_python(3, 11);
    let hog = cpu_hog(&python, 1);
    // Starved by the hog, the loop parks seldom: a longer settle lets the
    // profiler find its wait before the first burn.
    let r = record(test, &dir, &["taskset", "-c", "1"], |_| {}, 4, 1500);
    let ctx = format!("{}\n{}", stalls_table(&r.rec), r.summary);
    let (coverage, lag) = lag_coverage(&r);
    assert!(
        lag > 0 && coverage >= 0.95,
        "stalls cover {:.1}% of {:.0} ms of lag\n{ctx}",
        100.0 * coverage,
        ms(lag)
    );
    let runq: u64 = r.rec.stalls.iter().map(|s| s.runqueue_ns).sum();
    let total: u64 = r.rec.stalls.iter().map(|s| s.duration_ns).sum();
    assert!(
        runq * 2 > total,
        "run queue is {:.0} of {:.0} ms of stall time: the hog did not take the CPU\n{ctx}",
        ms(runq),
        ms(total)
    );
    let held: u64 = r
        .rec
        .stalls
        .iter()
        .flat_map(|s| &s.cpu_holders)
        .filter(|h| h.comm == "cpuhog")
        .map(|h| h.ns)
        .sum();
    // Other tasks may run on that CPU too (a build on a shared machine):
    // the hog must be the heaviest holder, and hold at least half.
    let mut by: std::collections::BTreeMap<&str, u64> = Default::default();
    for h in r.rec.stalls.iter().flat_map(|s| &s.cpu_holders) {
        *by.entry(h.comm.as_str()).or_default() += h.ns;
    }
    let top = by.iter().max_by_key(|(_, ns)| **ns).map(|(c, _)| *c);
    assert!(
        top == Some("cpuhog") && held * 2 >= runq,
        "cpuhog is named for {:.0} ms of {:.0} ms of run-queue time (heaviest: {top:?})\n{ctx}",
        ms(held),
        ms(runq)
    );
    assert!(
        r.summary.contains("CPU held by cpuhog"),
        "the summary does not name the hog:\n{}",
        r.summary
    );
    assert_eq!(
        throttled_parts(&r.rec),
        0,
        "throttled without a quota\n{ctx}"
    );
    drop(hog);
}

#[test]
fn no_quota_is_never_throttled() {
    let test = "no_quota_is_never_throttled";
    if !require_root_and_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new(test);
    let r = record(test, &dir, &[], |_| {}, 4, 200);
    let ctx = format!("{}\n{}", stalls_table(&r.rec), r.summary);
    assert!(!r.rec.stalls.is_empty(), "no stalls\n{ctx}");
    assert_eq!(
        throttled_parts(&r.rec),
        0,
        "throttled without a quota\n{ctx}"
    );
    assert!(
        r.rec.stalls.iter().all(|s| s.throttled_ns == 0),
        "throttled_ns without a quota\n{ctx}"
    );
    if let Some(q) = &r.rec.cpu_quota {
        assert!(q["quota_us"].is_null(), "a quota where none was set: {q}");
    }
    assert!(!r.summary.contains("CPU throttled"), "{}", r.summary);
}
