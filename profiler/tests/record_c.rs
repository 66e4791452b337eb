//! Foundation issue, root integration tests: `stallprof record` against a C
//! epoll loop (tests/victims/c_loop.c) that stalls on a known schedule and logs
//! each stalled iteration with CLOCK_MONOTONIC. Truth comes from the victim.
//!
//! Also here: the CLI's error paths and the check that a recording leaves no
//! `sp_*` BPF program behind.
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

const THRESHOLD: &str = "40ms";
const THRESHOLD_NS: u64 = 40 * MS;
/// The victim's busy period and stallprof's stall must agree this closely.
const TOLERANCE_NS: u64 = 2 * MS;

struct Culprit {
    kind: &'static str,
    func: &'static str,
    /// syscalls the off-CPU part must be attributed to; None for on-CPU work.
    syscalls: Option<&'static [&'static str]>,
}

const CULPRITS: [Culprit; 3] = [
    Culprit {
        kind: "spin",
        func: "spin_for_ms",
        syscalls: None,
    },
    Culprit {
        kind: "sleep",
        func: "sleep_for_ms",
        syscalls: Some(&["nanosleep", "clock_nanosleep"]),
    },
    Culprit {
        kind: "pipe",
        func: "read_slow_pipe",
        syscalls: Some(&["read"]),
    },
];

fn culprit(kind: &str) -> &'static Culprit {
    CULPRITS.iter().find(|c| c.kind == kind).unwrap()
}

/// A folded frame is `func`, possibly followed by an annotation such as a
/// file:line or the line's trailing weight.
fn frame_is(folded_frame: &str, func: &str) -> bool {
    folded_frame
        .strip_prefix(func)
        .is_some_and(|rest| !rest.starts_with(|ch: char| ch.is_alphanumeric() || ch == '_'))
}

/// Everything we assert about a recording of the default c_loop schedule.
/// `gate_ns`: the `--sample-after` the recording ran with.
fn check_c_loop_recording(
    out_dir: &Path,
    log_path: &Path,
    victim_pid: u32,
    how: &str,
    gate_ns: u64,
    host: &HostTime,
) {
    let host_lost = host.lost_ns();
    let log = read_log(log_path);
    assert!(
        log.iter().any(|r| r["kind"] == "done"),
        "the victim did not finish its schedule; log:\n{}",
        std::fs::read_to_string(log_path).unwrap_or_default()
    );
    let truth = c_loop_truth(&log);
    assert_eq!(
        truth.len(),
        12,
        "the default schedule has 12 stalls; victim log:\n{}",
        truth_table(&truth)
    );
    assert_calls_as_planned(&truth, THRESHOLD_NS + 10 * MS);
    let rec = load_recording(out_dir);
    // The sampling gate: the victim's idle ticks (10 ms apart, microseconds
    // busy each) are busy periods the kernel never reports when it is on, and
    // all reach userspace when it is off. Either way the stalls must match.
    assert_eq!(rec.sample_after_ns, gate_ns, "{how}: sample_after_ns");
    let quiet = rec
        .kernel_filtered
        .get("short_busy_periods")
        .copied()
        .unwrap_or(0);
    if gate_ns > 0 {
        assert!(
            quiet >= 50,
            "{how}: the kernel filtered only {quiet} short busy periods (kernel_filtered {:?}); \
             the victim ticks idle every 10 ms for over a second",
            rec.kernel_filtered
        );
    } else {
        assert_eq!(
            quiet, 0,
            "{how}: --sample-after 0 must report every busy period"
        );
    }

    let mut c = Checks::new(format!(
        "recording via {how}\n{}\n{}",
        truth_table(&truth),
        stalls_table(&rec)
    ));
    check_contract(&mut c, &rec, THRESHOLD_NS);
    c.check(rec.pid == victim_pid, || {
        format!("pid is {}, want the victim's {victim_pid}", rec.pid)
    });
    c.check(rec.comm == "c_loop", || {
        format!("comm is {:?}, want \"c_loop\"", rec.comm)
    });
    let first = truth.iter().map(|t| t.start_ns).min().unwrap();
    let last = truth.iter().map(|t| t.end_ns).max().unwrap();
    c.check(rec.started_ns <= first && rec.ended_ns >= last, || {
        format!(
            "recording [{}, {}] does not cover the victim's stalls [{first}, {last}] \
             (are the timestamps CLOCK_MONOTONIC?)",
            rec.started_ns, rec.ended_ns
        )
    });

    // Every victim stall found, once, with the right times and causes.
    for t in &truth {
        let who = format!(
            "{} stall ({}, {:.2} ms at {})",
            t.kind,
            t.func,
            ms(t.duration_ns()),
            t.start_ns
        );
        let found = overlapping(&rec, t);
        if found.len() != 1 {
            c.fail(format!(
                "{who}: {} overlapping stalls, want exactly 1",
                found.len()
            ));
            continue;
        }
        let s = found[0];
        c.check(s.tid as u64 == t.tid, || {
            format!("{who}: reported on tid {}, want {}", s.tid, t.tid)
        });
        c.check(s.thread_name == "c_loop", || {
            format!("{who}: thread_name {:?}", s.thread_name)
        });
        c.check(!s.incomplete, || format!("{who}: marked incomplete"));
        // A loop woken from its wait that waited for a CPU (a loaded
        // machine) starts its stall there, before the victim's clock can.
        let woken = s.woken_ns();
        c.check(
            (s.start_ns + woken).abs_diff(t.start_ns) <= TOLERANCE_NS,
            || {
                format!(
                    "{who}: starts {:+.2} ms from the victim's busy_start ({:.2} ms of it woken, \
                     waiting for a CPU)",
                    (s.start_ns as f64 - t.start_ns as f64) / 1e6,
                    ms(woken)
                )
            },
        );
        c.check(s.end_ns.abs_diff(t.end_ns) <= TOLERANCE_NS, || {
            format!(
                "{who}: ends {:+.2} ms from the victim's busy_end",
                (s.end_ns as f64 - t.end_ns as f64) / 1e6
            )
        });
        c.check(
            (s.duration_ns - woken).abs_diff(t.duration_ns()) <= TOLERANCE_NS,
            || {
                format!(
                    "{who}: duration {:.2} ms ({:.2} ms woken, waiting for a CPU), victim \
                     measured {:.2} ms",
                    ms(s.duration_ns),
                    ms(woken),
                    ms(t.duration_ns())
                )
            },
        );
        // The victim's own thread CPU clock says how long it was really on-CPU.
        // Tolerance: on a loaded 2-vCPU VM the two clocks have disagreed by up
        // to ~7 ms in 60 ms in both directions (hypervisor steal and IRQ time
        // are wall time to us but not thread CPU time; an unexplained 7.4 ms of
        // run-queue once; 11.1 ms of a 60 ms spin on another run, with no
        // preemption seen) — kept loose enough not to flake, tight enough to
        // catch a split that is wrong by a whole sleep or spin. Plus what the
        // host took from the VM's CPUs (steal) and interrupts took during the
        // run, measured: on the CPU for stallprof, not in the thread's CPU
        // clock (a fresh-clone run lost 16-35 ms of 60-120 ms spins to it).
        let cpu_tol = (15 * MS).max(s.duration_ns * 20 / 100) + host_lost;
        c.check(s.on_cpu_ns.abs_diff(t.cpu_ns) <= cpu_tol, || {
            format!(
                "{who}: on_cpu {:.2} ms, victim's thread CPU time {:.2} ms (tolerance {:.2} ms, \
                 of which {:.2} ms steal and interrupts on the host's CPUs during the run)",
                ms(s.on_cpu_ns),
                ms(t.cpu_ns),
                ms(cpu_tol),
                ms(host_lost)
            )
        });

        let cul = culprit(&t.kind);
        // Shares of the victim's own part (the woken wait is not its doing).
        let share = |w: u64| w as f64 / (s.duration_ns - woken).max(1) as f64;
        match cul.syscalls {
            None => {
                // On-CPU work. A busy 2-core machine may preempt the spinner, so
                // "mostly on-CPU" is on_cpu + runqueue (wanting the CPU); the
                // CPU-clock check above pins on_cpu itself.
                c.check(share(s.on_cpu_ns + s.runqueue_ns) >= 0.90, || {
                    format!(
                        "{who}: on_cpu + runqueue is only {:.0}% of the stall",
                        100.0 * share(s.on_cpu_ns + s.runqueue_ns)
                    )
                });
                let w = s.weight_with(cul.func, Some("on_cpu"), None);
                c.check(w > 0 && w as f64 >= 0.9 * s.on_cpu_ns as f64, || {
                    format!(
                        "{who}: on-CPU stacks containing {} carry {:.2} of {:.2} on-CPU ms",
                        cul.func,
                        ms(w),
                        ms(s.on_cpu_ns)
                    )
                });
            }
            Some(syscalls) => {
                c.check(share(s.off_cpu_ns) >= 0.80, || {
                    format!(
                        "{who}: off_cpu is only {:.0}% of the stall",
                        100.0 * share(s.off_cpu_ns)
                    )
                });
                let w = s.weight_with(cul.func, Some("off_cpu"), Some(syscalls));
                c.check(share(w) >= 0.80, || {
                    format!(
                        "{who}: off-CPU stacks containing {} with syscall in {syscalls:?} carry only {:.0}% of the stall",
                        cul.func,
                        100.0 * share(w)
                    )
                });
            }
        }
    }

    // Nothing else: between and around the victim's stalls the loop only
    // handles 10 ms timer ticks in microseconds.
    // A stall that is all waiting for a CPU after a wakeup is the loaded
    // machine's, not the victim's (it cannot log it): allowed, and it must
    // say so (its woken part).
    for s in &rec.stalls {
        let machines = s.woken_ns() * 10 >= s.duration_ns * 9;
        if !machines && !truth.iter().any(|t| s.overlaps(t.start_ns, t.end_ns)) {
            c.fail(format!(
                "extra stall matching no victim stall: {}",
                s.summary()
            ));
        }
    }

    // Each culprit's share of all stall time matches the victim's.
    let true_total: u64 = truth.iter().map(|t| t.duration_ns()).sum();
    let total: u64 = rec.stalls.iter().map(|s| s.duration_ns).sum();
    for cul in &CULPRITS {
        let true_share = truth
            .iter()
            .filter(|t| t.kind == cul.kind)
            .map(|t| t.duration_ns())
            .sum::<u64>() as f64
            / true_total as f64;
        let w: u64 = rec
            .stalls
            .iter()
            .map(|s| s.weight_with(cul.func, None, None))
            .sum();
        let share = w as f64 / total.max(1) as f64;
        c.check((share - true_share).abs() <= 0.05, || {
            format!(
                "{}: {:.1}% of stall time in stallprof's stacks, {:.1}% by the victim's clock",
                cul.func,
                100.0 * share,
                100.0 * true_share
            )
        });
    }

    // Names and lines, from DWARF: a culprit frame points into its own body.
    for cul in &CULPRITS {
        let (lo, hi) = c_function_lines(&c_loop_source(), cul.func);
        let frames: Vec<&Frame> = rec
            .stalls
            .iter()
            .flat_map(|s| &s.stacks)
            .flat_map(|st| &st.frames)
            .filter(|f| f.name == cul.func)
            .collect();
        c.check(frames.iter().all(|f| f.kind == "native"), || {
            format!("{} frames not all of kind \"native\"", cul.func)
        });
        let located: Vec<&&Frame> = frames
            .iter()
            .filter(|f| {
                f.file.as_deref().is_some_and(|p| p.ends_with("c_loop.c")) && f.line.is_some()
            })
            .collect();
        c.check(!located.is_empty(), || {
            format!(
                "no {} frame with file c_loop.c and a line (saw {:?})",
                cul.func,
                frames.first()
            )
        });
        for f in located {
            let line = f.line.unwrap();
            c.check((lo..=hi).contains(&line), || {
                format!(
                    "{} frame at c_loop.c:{line}, outside its definition (lines {lo}..={hi})",
                    cul.func
                )
            });
        }
    }

    // stalls.folded: same stacks, weights in µs.
    let (folded_us, lines, folded) = folded_total_us(&out_dir.join("stalls.folded"));
    c.check(lines > 0, || "stalls.folded is empty".into());
    let total_us = total as f64 / 1000.0;
    c.check(
        (folded_us as f64 - total_us).abs() <= 0.01 * total_us,
        || {
            format!(
                "stalls.folded weights sum to {folded_us} µs, total stall time is {total_us:.0} µs"
            )
        },
    );
    for cul in &CULPRITS {
        c.check(
            folded
                .lines()
                .any(|l| l.split(';').any(|f| frame_is(f, cul.func))),
            || format!("stalls.folded has no line through {}", cul.func),
        );
    }

    // stalls.svg: a flame graph that names the culprits.
    let svg = std::fs::read_to_string(out_dir.join("stalls.svg")).unwrap_or_default();
    let head = svg.trim_start();
    c.check(
        head.starts_with("<?xml") || head.starts_with("<svg"),
        || {
            format!(
                "stalls.svg does not start with <?xml or <svg: {:?}",
                &head[..head.len().min(80)]
            )
        },
    );
    for cul in &CULPRITS {
        c.check(svg.contains(cul.func), || {
            format!("stalls.svg never mentions {}", cul.func)
        });
    }

    c.finish();
}

/// `stallprof record -- c_loop LOG`: stallprof starts the victim itself.
#[test]
fn record_command_c_loop_matches_victim_clock() {
    if !require_root_and_bpf("record_command_c_loop_matches_victim_clock") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("c-cmd");
    let exe = build_c_loop(&dir.path, true);
    let host = HostTime::now();
    let (run, out, pid) = record_c_loop(&dir, &exe, &[]);
    let log = dir.join("victim.jsonl");
    // The default gate: threshold / 20.
    check_c_loop_recording(
        &out,
        &log,
        pid,
        "record -- c_loop",
        THRESHOLD_NS / 20,
        &host,
    );
    // The default probes: nothing the rest of the host pays for (or the
    // fallback, on the pass that forces it everywhere).
    let (sched, waits, notes) = probes_of(&out);
    if expected_probes().0 == "thread_perf_events" {
        assert_eq!(
            (sched.as_str(), waits.as_str()),
            ("thread_perf_events", "uprobes"),
            "{notes:?}"
        );
        assert!(
            !run.stdout.clone().contains("probes:"),
            "no fallback, nothing to say:\n{}",
            run.describe()
        );
    } else {
        assert_eq!(
            (sched.as_str(), waits.as_str()),
            ("tracepoints", "tracepoints"),
            "STALLPROF_PROBES=tracepoints: {notes:?}"
        );
    }
}

/// The probes a recording ran on, from its stalls.json: (scheduler, waits,
/// notes).
fn probes_of(out: &Path) -> (String, String, Vec<String>) {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("stalls.json")).unwrap()).unwrap();
    let p = &v["probes"];
    let notes = p["notes"]
        .as_array()
        .map(|a| a.iter().map(|n| n.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    (
        p["scheduler"].as_str().unwrap_or("").into(),
        p["waits"].as_str().unwrap_or("").into(),
        notes,
    )
}

/// `record -- c_loop` with `args` before `--`: the run and its out dir.
fn record_c_loop(dir: &Scratch, exe: &Path, args: &[&str]) -> (RunOutput, std::path::PathBuf, u32) {
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");
    let run = record_ok(
        None,
        THRESHOLD,
        args,
        &out,
        &[exe.as_os_str(), log.as_os_str()],
        Duration::from_secs(90),
    );
    let ready = wait_for_log_kind(&log, "ready", Duration::from_secs(1));
    let pid = ready["pid"].as_u64().unwrap() as u32;
    (run, out, pid)
}

/// Issue 18: the default probes are per-thread switch events and uprobes
/// on the target's own wait functions; `--probes raw-tracepoints` puts the
/// scheduler on the host-wide raw tracepoints, `--probes tracepoints`
/// forces the classic tracepoints everywhere; each recording is as accurate
/// and says which served.
fn record_c_loop_on(test: &str, probes: &str, want: (&str, &str), said: &[&str]) {
    if !require_root_and_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new(test);
    let exe = build_c_loop(&dir.path, true);
    let host = HostTime::now();
    let (run, out, pid) = record_c_loop(&dir, &exe, &["--probes", probes]);
    check_c_loop_recording(
        &out,
        &dir.join("victim.jsonl"),
        pid,
        &format!("record --probes {probes}"),
        THRESHOLD_NS / 20,
        &host,
    );
    let (sched, waits, notes) = probes_of(&out);
    assert_eq!((sched.as_str(), waits.as_str()), want, "{notes:?}");
    let stdout = run.stdout.clone();
    assert!(
        said.iter().all(|s| stdout.contains(s)),
        "the summary must say {said:?}:\n{stdout}"
    );
}

#[test]
fn record_c_loop_on_forced_tracepoints_matches_victim_clock() {
    record_c_loop_on(
        "record_c_loop_on_forced_tracepoints_matches_victim_clock",
        "tracepoints",
        ("tracepoints", "tracepoints"),
        &[
            "probes: scheduler tracepoints, waits tracepoints",
            "every process on the host paid",
        ],
    );
}

#[test]
fn record_c_loop_on_raw_tracepoints_matches_victim_clock() {
    if expected_probes().0 != "thread_perf_events" {
        // The fallback pass asks every recording for the classic set
        // (check_contract); this one is the default pass's.
        eprintln!("the raw tracepoints are tested on the default pass");
        return;
    }
    record_c_loop_on(
        "record_c_loop_on_raw_tracepoints_matches_victim_clock",
        "raw-tracepoints",
        ("raw_tracepoints", "uprobes"),
        &["raw tracepoints, as asked (--probes raw-tracepoints)"],
    );
}

/// Issue 18: a process whose waits no uprobe can see (static, its wait
/// functions' symbols gone, as with raw syscalls) gets the syscall
/// tracepoints by itself, is recorded as accurately, and the summary says
/// why; the scheduler stays on per-thread switch events.
#[test]
fn record_c_loop_without_wait_symbols_falls_back_to_syscall_tracepoints() {
    if !require_root_and_bpf("record_c_loop_without_wait_symbols_falls_back_to_syscall_tracepoints")
    {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("c-static");
    let exe = build_c_loop_without_wait_symbols(&dir.path);
    let host = HostTime::now();
    let (run, out, pid) = record_c_loop(&dir, &exe, &[]);
    check_c_loop_recording(
        &out,
        &dir.join("victim.jsonl"),
        pid,
        "record -- static c_loop",
        THRESHOLD_NS / 20,
        &host,
    );
    let (sched, waits, notes) = probes_of(&out);
    if expected_probes().0 != "thread_perf_events" {
        // STALLPROF_PROBES=tracepoints: everything on the fallback already
        // (check_contract saw it); the automatic choice is the default
        // pass's to test.
        return;
    }
    assert_eq!(
        (sched.as_str(), waits.as_str()),
        ("thread_perf_events", "tracepoints"),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("maps no C library wait function")),
        "the reason must be noted: {notes:?}"
    );
    let stdout = run.stdout.clone();
    assert!(
        stdout.contains("maps no C library wait function"),
        "summary:\n{stdout}"
    );
}

/// A static binary that keeps its C library's symbols (`cc -static`, its
/// image at 0x400000, which `/proc/PID/map_files` names without the zero
/// padding of `/proc/PID/maps`): its own wait functions get the uprobes,
/// and no other process pays. (The padded name was never found: such a
/// binary, and a launched Node caught before its loader was mapped, fell
/// back to the host-wide syscall tracepoints.)
#[test]
fn record_c_loop_static_gets_its_own_wait_uprobes() {
    if !require_root_and_bpf("record_c_loop_static_gets_its_own_wait_uprobes") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("c-static-symbols");
    let exe = build_c_loop_static(&dir.path);
    let host = HostTime::now();
    let (_run, out, pid) = record_c_loop(&dir, &exe, &[]);
    check_c_loop_recording(
        &out,
        &dir.join("victim.jsonl"),
        pid,
        "record -- static c_loop with symbols",
        THRESHOLD_NS / 20,
        &host,
    );
    let (sched, waits, notes) = probes_of(&out);
    assert_eq!(
        (sched.as_str(), waits.as_str()),
        expected_probes(),
        "{notes:?}"
    );
}

/// `stallprof record --pid`: attach to a victim that is already running,
/// release it with its start file, stop the recording with SIGINT.
#[test]
fn record_pid_c_loop_matches_victim_clock() {
    if !require_root_and_bpf("record_pid_c_loop_matches_victim_clock") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("c-pid");
    let exe = build_c_loop(&dir.path, true);
    let log = dir.join("victim.jsonl");
    let start = dir.join("start");
    let out = dir.join("out");

    let mut victim = Victim::spawn(
        std::process::Command::new(&exe)
            .arg(&log)
            .arg("--start-file")
            .arg(&start)
            .arg("--linger"),
    );
    wait_for_log_kind(&log, "ready", Duration::from_secs(10));
    victim.assert_running();
    let pid = victim.pid();

    let mut prof = Profiler::spawn(&[
        "record".to_string(),
        "--threshold".into(),
        THRESHOLD.into(),
        "--duration".into(),
        "120s".into(), // a backstop only: the test stops it with SIGINT
        // The ungated kernel path: every sample, every busy period.
        "--sample-after".into(),
        "0".into(),
        "-o".into(),
        out.display().to_string(),
        "--pid".into(),
        pid.to_string(),
    ]);
    wait_for_attach(&mut prof, Duration::from_secs(20));
    let host = HostTime::now();
    std::fs::write(&start, b"go").unwrap();
    wait_for_log_kind(&log, "done", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(300));
    victim.assert_running(); // it lingers, ticking idle, until we kill it
    prof.signal(libc::SIGINT);
    let run = prof.wait(Duration::from_secs(30));
    assert!(
        run.status.success(),
        "stallprof record --pid, stopped by SIGINT, failed:\n{}",
        run.describe()
    );
    check_c_loop_recording(
        &out,
        &log,
        pid,
        "record --pid (stopped by SIGINT)",
        0,
        &host,
    );
}

/// A recording loads `sp_*` programs while it runs and leaves none behind.
#[test]
fn record_leaves_no_bpf_programs_loaded() {
    if !require_root_and_bpf("record_leaves_no_bpf_programs_loaded") {
        return;
    }
    assert!(
        bpftool_available(),
        "bpftool is not installed, so this test cannot check for leaked BPF programs. \
         Install it (`apt-get install bpftool`); the CI script does."
    );
    let _serial = serial();
    let before = loaded_sp_programs();
    let dir = Scratch::new("leak");
    let out = dir.join("out");
    let mut prof = Profiler::spawn(&[
        "record".to_string(),
        "--threshold".into(),
        THRESHOLD.into(),
        "-o".into(),
        out.display().to_string(),
        "--".into(),
        "sleep".into(),
        "3".into(),
    ]);
    // Once it is recording, every program it loads is in.
    wait_for_attach(&mut prof, Duration::from_secs(20));
    let seen: Vec<_> = loaded_sp_programs()
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    assert!(
        !seen.is_empty(),
        "no BPF program named sp_* was loaded while stallprof recorded (program names must start with sp_)"
    );
    let run = prof.wait(Duration::from_secs(60));
    assert!(
        run.status.success(),
        "stallprof record -- sleep 3 failed:\n{}",
        run.describe()
    );

    // Only this run's programs count: another stallprof (a developer's, a
    // parallel test binary's) may be running beside it.
    let left = sp_programs_left(|p| seen.contains(p));
    assert!(
        left.is_empty(),
        "BPF programs still loaded after stallprof exited: {left:?} (while recording: {seen:?}; \
         already loaded before the run: {before:?} -- another stallprof running?)"
    );

    // `sleep` never waits in an event loop, so it has no busy periods.
    let rec = load_recording(&out);
    assert!(
        rec.stalls.is_empty(),
        "stalls reported for `sleep 3`, which has no event loop:\n{}",
        stalls_table(&rec)
    );
}

#[test]
fn record_pid_that_does_not_exist_names_the_pid() {
    if !require_root_and_bpf("record_pid_that_does_not_exist_names_the_pid") {
        return;
    }
    let pid = unused_pid();
    let dir = Scratch::new("nopid");
    let out = dir.join("out");
    let run = run_stallprof(
        &[
            "record".to_string(),
            "-o".into(),
            out.display().to_string(),
            "--pid".into(),
            pid.to_string(),
        ],
        Duration::from_secs(30),
    );
    assert!(
        !run.status.success(),
        "stallprof record --pid {pid} (no such process) exited 0:\n{}",
        run.describe()
    );
    let text = format!("{}{}", run.stderr, run.stdout);
    assert!(
        text.contains(&pid.to_string()),
        "the error does not mention pid {pid}:\n{}",
        run.describe()
    );
}

#[test]
fn record_threshold_banana_names_the_format() {
    // Argument parsing happens before anything privileged: no root needed.
    let run = run_stallprof(
        &["record", "--threshold", "banana", "--", "true"],
        Duration::from_secs(30),
    );
    assert!(
        !run.status.success(),
        "`record --threshold banana` exited 0:\n{}",
        run.describe()
    );
    let err = run.stderr.to_lowercase();
    assert!(
        err.contains("threshold"),
        "the error does not name --threshold:\n{}",
        run.describe()
    );
    assert!(
        err.contains("banana"),
        "the error does not quote the bad value:\n{}",
        run.describe()
    );
    assert!(
        err.contains("ms"),
        "the error does not show the expected duration format (e.g. 50ms):\n{}",
        run.describe()
    );
}
