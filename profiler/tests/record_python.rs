//! Foundation issue, root integration tests: `stallprof record` against an
//! asyncio loop (tests/victims/py_blocking_client.py) frozen by a blocking
//! socket client, a time.sleep() retry and pure-Python CPU work, as in the
//! field report. The victim logs time.monotonic_ns() around each call.
//!
//! The point of the blocking client: CPython waits for its socket with poll()
//! on that one fd, inside the stall. That poll() is not the loop parking, so
//! each call must come out as ONE stall covering the whole call.
//!
//! These assertions are about stall detection and timing only; Python frame
//! names are another issue's tests.

mod common;

use common::*;
use std::path::PathBuf;
use std::time::Duration;

const THRESHOLD: &str = "40ms";
const THRESHOLD_NS: u64 = 40 * MS;

/// `python` finds the interpreter (tests/common: `require_python`,
/// `require_debian_python311`), failing the test when it is missing.
fn record_python_victim(test: &str, python: fn() -> PathBuf) {
    record_python_victim_with(test, python, &[]);
}

/// `extra`: more victim arguments (`--loop uvloop --path DIR`, `--loop select`).
fn record_python_victim_with(test: &str, python: fn() -> PathBuf, extra: &[&std::ffi::OsStr]) {
    if !require_root_and_bpf(test) {
        return;
    }
    let python = python();
    let _serial = serial();
    let dir = Scratch::new(test);
    let script = victims_dir().join("py_blocking_client.py");
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");

    let host = HostTime::now();
    let run = run_stallprof(
        &[
            "record".as_ref(),
            "--threshold".as_ref(),
            THRESHOLD.as_ref(),
            "-o".as_ref(),
            out.as_os_str(),
            "--".as_ref(),
            python.as_os_str(),
            script.as_os_str(),
            log.as_os_str(),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect::<Vec<_>>(),
        Duration::from_secs(90),
    );
    assert!(
        run.status.success(),
        "stallprof record -- {} victim failed:\n{}",
        python.display(),
        run.describe()
    );
    let entries = read_log(&log);
    assert!(
        entries.iter().any(|r| r["kind"] == "done"),
        "the victim did not finish; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let pid = entries.iter().find(|r| r["kind"] == "ready").unwrap()["pid"]
        .as_u64()
        .unwrap() as u32;
    let truth = python_truth(&entries);
    let count = |k: &str| truth.iter().filter(|t| t.kind == k).count();
    assert!(
        count("blocking_client") >= 3 && count("sleep") == 1 && count("cpu") == 1,
        "unexpected victim schedule:\n{}",
        truth_table(&truth)
    );
    assert_calls_as_planned(&truth, THRESHOLD_NS + 20 * MS);

    let host_lost = host.lost_ns();
    let rec = load_recording(&out);
    let mut c = Checks::new(format!(
        "{}\n{}\n{}",
        python.display(),
        truth_table(&truth),
        stalls_table(&rec)
    ));
    check_contract(&mut c, &rec, THRESHOLD_NS);
    c.check(rec.pid == pid, || {
        format!("pid is {}, want the victim's {pid}", rec.pid)
    });

    for t in &truth {
        let who = format!(
            "{} ({}, {:.2} ms at {})",
            t.kind,
            t.func,
            ms(t.duration_ns()),
            t.start_ns
        );
        let found: Vec<&Stall> = overlapping(&rec, t);
        if found.len() != 1 {
            let hint = if t.kind == "blocking_client" && found.len() > 1 {
                " -- split at the client's poll() on its socket, which is not a loop park"
            } else {
                ""
            };
            c.fail(format!(
                "{who}: {} overlapping stalls, want exactly 1{hint}",
                found.len()
            ));
            continue;
        }
        let s = found[0];
        c.check(s.tid as u64 == t.tid, || {
            format!(
                "{who}: reported on tid {}, want the loop's {}",
                s.tid, t.tid
            )
        });
        c.check(!s.incomplete, || format!("{who}: marked incomplete"));
        // The busy period encloses the call: it starts before and ends after,
        // by at most the few Python statements around it.
        c.check(
            s.start_ns <= t.start_ns + MS && s.end_ns + MS >= t.end_ns,
            || {
                format!(
                    "{who}: stall [{}, {}] does not cover the call",
                    s.start_ns, s.end_ns
                )
            },
        );
        c.check(
            s.duration_ns + MS >= t.duration_ns() && s.duration_ns <= t.duration_ns() + 10 * MS,
            || {
                format!(
                    "{who}: stall lasts {:.2} ms, the call {:.2} ms (want call-1ms ..= call+10ms)",
                    ms(s.duration_ns),
                    ms(t.duration_ns())
                )
            },
        );
        let share = |w: u64| w as f64 / s.duration_ns.max(1) as f64;
        match t.kind.as_str() {
            "blocking_client" => {
                c.check(share(s.off_cpu_ns) >= 0.70, || {
                    format!(
                        "{who}: off_cpu is only {:.0}% of the stall",
                        100.0 * share(s.off_cpu_ns)
                    )
                });
                let polled = s.off_cpu_weight_in(&["poll", "ppoll"]);
                c.check(share(polled) >= 0.50, || {
                    format!(
                        "{who}: only {:.0}% of the stall is off-CPU in poll/ppoll",
                        100.0 * share(polled)
                    )
                });
            }
            "sleep" => {
                c.check(share(s.off_cpu_ns) >= 0.80, || {
                    format!(
                        "{who}: off_cpu is only {:.0}% of the stall",
                        100.0 * share(s.off_cpu_ns)
                    )
                });
                let slept = s.off_cpu_weight_in(&["clock_nanosleep", "nanosleep"]);
                c.check(share(slept) >= 0.80, || {
                    format!(
                        "{who}: only {:.0}% of the stall is off-CPU in (clock_)nanosleep",
                        100.0 * share(slept)
                    )
                });
            }
            "cpu" => {
                // On a busy machine the thread may wait in the runqueue; the
                // victim's thread CPU clock pins how much it really ran.
                c.check(share(s.on_cpu_ns + s.runqueue_ns) >= 0.90, || {
                    format!(
                        "{who}: on_cpu + runqueue is only {:.0}% of the stall",
                        100.0 * share(s.on_cpu_ns + s.runqueue_ns)
                    )
                });
                // Plus what the host took from the VM's CPUs (steal) or
                // interrupts took during the run: on the CPU for stallprof,
                // not in the thread's CPU clock.
                let lost = host_lost;
                let slack = s.duration_ns.saturating_sub(t.duration_ns()) + 5 * MS + lost;
                c.check(s.on_cpu_ns.abs_diff(t.cpu_ns) <= slack, || {
                    format!(
                        "{who}: on_cpu {:.2} ms, the victim's thread CPU time {:.2} ms \
                         (slack {:.2} ms, of which {:.2} ms steal and interrupts on the host's CPUs \
                         during the run)",
                        ms(s.on_cpu_ns),
                        ms(t.cpu_ns),
                        ms(slack),
                        ms(lost)
                    )
                });
            }
            _ => unreachable!(),
        }
    }

    // From the first stalled call to the last, the loop otherwise only runs
    // asyncio.sleep wake-ups and a 10 ms heartbeat: no other stall belongs there.
    let first = truth.iter().map(|t| t.start_ns).min().unwrap();
    let last = truth.iter().map(|t| t.end_ns).max().unwrap();
    for s in rec.stalls.iter().filter(|s| s.overlaps(first, last)) {
        if !truth.iter().any(|t| s.overlaps(t.start_ns, t.end_ns)) {
            c.fail(format!(
                "extra stall between the victim's calls: {}",
                s.summary()
            ));
        }
    }
    c.finish();
}

#[test]
fn record_python_blocking_client_pyenv_311() {
    record_python_victim("record_python_blocking_client_pyenv_311", || {
        require_python(3, 11)
    });
}

/// Debian's interpreter: static libpython, non-PIE, stripped. Stall detection
/// must not depend on any of that.
#[test]
fn record_python_blocking_client_debian_311() {
    record_python_victim(
        "record_python_blocking_client_debian_311",
        require_debian_python311,
    );
}

/// uvloop (libuv's epoll loop, from PyPI) parks the same way: same checks.
#[test]
fn record_python_blocking_client_uvloop_311() {
    if !require_root_and_bpf("record_python_blocking_client_uvloop_311") {
        return;
    }
    let python = require_python(3, 11);
    let deps = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-deps/uvloop-py311");
    if !deps.join("uvloop").exists() {
        let st = std::process::Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--target",
            ])
            .arg(&deps)
            .arg("uvloop==0.21.0")
            .status()
            .unwrap_or_else(|e| panic!("running {} -m pip: {e}", python.display()));
        assert!(
            st.success(),
            "installing uvloop from PyPI into {} failed",
            deps.display()
        );
    }
    record_python_victim_with(
        "record_python_blocking_client_uvloop_311",
        || require_python(3, 11),
        &[
            "--loop".as_ref(),
            "uvloop".as_ref(),
            "--path".as_ref(),
            deps.as_os_str(),
        ],
    );
}

/// A loop parked in select() (asyncio on a SelectSelector), not epoll: the
/// client's poll() on its socket still does not end the stall.
#[test]
fn record_python_blocking_client_select_loop_311() {
    record_python_victim_with(
        "record_python_blocking_client_select_loop_311",
        || require_python(3, 11),
        &["--loop".as_ref(), "select".as_ref()],
    );
}
