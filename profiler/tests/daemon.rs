//! `stallprof daemon`, root integration tests: a daemon started by the test
//! finds the stalls of C and Python victims started after it, exports them
//! per process as Prometheus metrics (parsed by the official Python client's
//! OpenMetrics parser), keeps working while victims exit and restart (a
//! reused pid included), writes pprof files that an independent pprof
//! decoder reads (DataDog's pure-JS `pprof-format`), holds its retention
//! limits, and on SIGTERM flushes the current window and leaves none of its
//! BPF programs loaded.
//!
//! Test-only tools, installed under target/daemon-test-deps on first use
//! (CI installs them up front, see `ensure_tools`):
//!   python3 -m pip install --target target/daemon-test-deps/py prometheus-client==0.26.0
//!   npm install --prefix target/daemon-test-deps/node pprof-format@2.3.2
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).

mod common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

const PY: &str = "/usr/bin/python3.11";

// ---------------------------------------------------------------------------
// Test tools: a real Prometheus parser and a real pprof reader

/// Installs (once) and checks the two readers; panics with the command to
/// run when that fails, never skips.
fn ensure_tools() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let d = deps_dir();
        let py = d.join("py");
        let probe_py = || {
            Command::new("python3")
                .args(["-c", "import prometheus_client.openmetrics.parser"])
                .env("PYTHONPATH", &py)
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if !probe_py() {
            let out = Command::new("python3")
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
                .arg(&py)
                .arg("prometheus-client==0.26.0")
                .output();
            assert!(
                probe_py(),
                "the Prometheus parser (PyPI prometheus-client) is needed and could not be installed: {:?}\n\
                 run: python3 -m pip install --target {} prometheus-client==0.26.0",
                out.map(|o| String::from_utf8_lossy(&o.stderr).into_owned()),
                py.display()
            );
        }
    });
    ensure_pprof_reader();
}

const PROM_PARSE: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = []
for fam in text_string_to_metric_families(open(sys.argv[1]).read()):
    out.append({"name": fam.name, "type": fam.type, "unit": fam.unit,
                "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in fam.samples]})
print(json.dumps(out))
"#;

/// Metric families as the Python OpenMetrics parser sees them.
fn parse_metrics(dir: &Path, text: &str) -> Vec<Value> {
    let (m, s) = (dir.join("metrics.txt"), dir.join("prom_parse.py"));
    std::fs::write(&m, text).unwrap();
    std::fs::write(&s, PROM_PARSE).unwrap();
    let out = Command::new("python3")
        .arg(&s)
        .arg(&m)
        .env("PYTHONPATH", deps_dir().join("py"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the Prometheus OpenMetrics parser rejected /metrics:\n{}\n--- exposition ---\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Value of the sample `name` whose labels include `want`.
fn sample(fams: &[Value], name: &str, want: &[(&str, &str)]) -> Option<f64> {
    fams.iter()
        .flat_map(|f| f["samples"].as_array().unwrap().iter())
        .find(|s| {
            s["name"] == name
                && want
                    .iter()
                    .all(|(k, v)| s["labels"][*k].as_str() == Some(*v))
        })
        .map(|s| s["value"].as_f64().unwrap())
}

fn family<'a>(fams: &'a [Value], name: &str) -> Option<&'a Value> {
    fams.iter().find(|f| f["name"] == name)
}

// ---------------------------------------------------------------------------
// HTTP (loopback only) and the daemon process

/// GET over loopback: (status, body).
fn http_get(port: u16, path: &str, timeout: Duration) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, buf[split + 4..].to_vec()))
}

fn metrics_text(port: u16) -> String {
    let (st, body) = http_get(port, "/metrics", Duration::from_secs(10)).expect("GET /metrics");
    assert_eq!(st, 200, "GET /metrics: {}", String::from_utf8_lossy(&body));
    String::from_utf8(body).unwrap()
}

struct Daemon {
    prof: Profiler,
    port: u16,
}

fn start_daemon(config: &Path, port: u16) -> Daemon {
    let mut prof = Profiler::spawn(&[
        "daemon".to_string(),
        "--config".into(),
        config.display().to_string(),
        "-v".into(),
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(out) = prof.try_finished() {
            panic!(
                "stallprof daemon exited while starting:\n{}",
                out.describe()
            );
        }
        if http_get(port, "/healthz", Duration::from_secs(2)).is_ok_and(|(s, _)| s == 200) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stallprof daemon did not answer on 127.0.0.1:{port} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Daemon { prof, port }
}

/// BPF program ids held open by a process (its fds' fdinfo).
fn prog_ids_of(pid: u32) -> BTreeSet<u64> {
    bpf_ids_of(pid, "prog_id:")
}

/// The ids after `field` (`prog_id:`, `map_id:`) in a process's fdinfo.
fn bpf_ids_of(pid: u32, field: &str) -> BTreeSet<u64> {
    let mut ids = BTreeSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        for l in text.lines() {
            if let Some(v) = l.strip_prefix(field) {
                ids.insert(v.trim().parse().unwrap_or(0));
            }
        }
    }
    ids
}

/// The tgids in the `LEFT_OUT` map the daemon `pid` holds (bpftool).
fn left_out_tgids(pid: u32) -> BTreeSet<u32> {
    let mut tgids = BTreeSet::new();
    for id in bpf_ids_of(pid, "map_id:") {
        let id = id.to_string();
        if bpftool_json(&["map", "show", "id", &id])["name"] != "LEFT_OUT" {
            continue;
        }
        for e in bpftool_json(&["map", "dump", "id", &id])
            .as_array()
            .into_iter()
            .flatten()
        {
            // Without BTF the key is its bytes, as hex strings.
            let bytes: Vec<u8> = e["key"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
                .collect();
            match (e["key"].as_u64(), <[u8; 4]>::try_from(bytes.as_slice())) {
                (Some(k), _) => tgids.insert(k as u32),
                (None, Ok(b)) => tgids.insert(u32::from_le_bytes(b)),
                _ => panic!("LEFT_OUT entry of an unexpected shape: {e}"),
            };
        }
    }
    tgids
}

/// Waits until `pred(metrics)` holds.
fn wait_metrics(
    d: &mut Daemon,
    dir: &Path,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(out) = d.prof.try_finished() {
            panic!(
                "stallprof daemon exited while waiting for {what}:\n{}",
                out.describe()
            );
        }
        let text = metrics_text(d.port);
        let fams = parse_metrics(dir, &text);
        if pred(&fams) {
            return fams;
        }
        if Instant::now() >= deadline {
            // What the daemon found and probed is in its log: stop it.
            d.prof.signal(libc::SIGTERM);
            let stopped = Instant::now() + Duration::from_secs(20);
            let log = loop {
                if let Some(out) = d.prof.try_finished() {
                    break out.describe();
                }
                if Instant::now() >= stopped {
                    break "(the daemon did not stop within 20 s of SIGTERM)".to_string();
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            panic!("waited {timeout:?} for {what}; /metrics:\n{text}\nthe daemon:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn loop_threads(fams: &[Value], pid: u32) -> f64 {
    sample(fams, "stallprof_loop_threads", &[("pid", &pid.to_string())]).unwrap_or(0.0)
}

/// Stalls of `pid` the daemon has counted, less those cut short.
fn complete_stalls(fams: &[Value], pid: u32) -> f64 {
    let pid = pid.to_string();
    let count = sample(
        fams,
        "stallprof_stall_duration_seconds_count",
        &[("pid", &pid)],
    );
    let incomplete = sample(fams, "stallprof_stalls_incomplete_total", &[("pid", &pid)]);
    count.unwrap_or(0.0) - incomplete.unwrap_or(0.0)
}

/// Waits until the daemon has counted at least `n` complete stalls of each
/// `(pid, n)`: the stalls a victim logged before its `done` have come
/// through the daemon's drain and upkeep. Returns the metrics then.
fn wait_stalls_counted(d: &mut Daemon, dir: &Path, victims: &[(u32, usize)]) -> Vec<Value> {
    let what: Vec<String> = victims
        .iter()
        .map(|(pid, n)| format!("{n} complete stalls of pid {pid}"))
        .collect();
    wait_metrics(
        d,
        dir,
        &format!("the daemon to count {}", what.join(", ")),
        Duration::from_secs(15),
        |f| {
            victims
                .iter()
                .all(|&(pid, n)| complete_stalls(f, pid) >= n as f64)
        },
    )
}

/// Waits until the daemon's index page lists `pid` as exited: its exit
/// check has seen the process go.
fn wait_listed_exited(d: &mut Daemon, pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let row_start = format!("<tr><td>{pid}</td>");
    loop {
        if let Some(out) = d.prof.try_finished() {
            panic!(
                "stallprof daemon exited while waiting for pid {pid} to be listed as exited:\n{}",
                out.describe()
            );
        }
        let index = http_get(d.port, "/", Duration::from_secs(5))
            .map(|(_, body)| String::from_utf8_lossy(&body).into_owned())
            .unwrap_or_default();
        let row = index
            .split("</tr>")
            .find_map(|r| r.split_once(&row_start).map(|(_, rest)| rest));
        if row.is_some_and(|r| r.contains("<td>exited</td>")) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "waited 15 s for the daemon's index page to list pid {pid} as exited:\n{index:.3000}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ---------------------------------------------------------------------------
// Victims

fn spawn_c_loop(bin: &Path, log: &Path, start: &Path, schedule: Option<&str>) -> Victim {
    let mut cmd = Command::new(bin);
    cmd.arg(log).arg("--start-file").arg(start).arg("--linger");
    if let Some(s) = schedule {
        cmd.args(["--schedule", s, "--repeat", "1"]);
    }
    Victim::spawn(&mut cmd)
}

/// Spawns a c_loop with a given pid, by setting the kernel's last-pid
/// counter just below it (root, initial pid namespace). Retries when
/// another process takes the pid first.
fn spawn_c_loop_with_pid(
    want: u32,
    bin: &Path,
    log: &Path,
    start: &Path,
    schedule: &str,
) -> Victim {
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (want - 1).to_string()).expect(
            "writing /proc/sys/kernel/ns_last_pid (needs root in the initial pid namespace)",
        );
        let v = spawn_c_loop(bin, log, start, Some(schedule));
        if v.pid() == want {
            return v;
        }
        drop(v);
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("could not start a victim with the reused pid {want} in 50 tries");
}

fn spawn_python(log: &Path, start: &Path, rounds: u32) -> Victim {
    spawn_python_with(log, start, rounds, &[])
}

/// [`spawn_python`] with more of the victim's arguments (`--linger`).
fn spawn_python_with(log: &Path, start: &Path, rounds: u32, more: &[&str]) -> Victim {
    assert!(
        Path::new(PY).exists(),
        "{PY} is needed (apt-get install python3.11)"
    );
    Victim::spawn(
        Command::new(PY)
            .arg(victims_dir().join("py_blocking_client.py"))
            .arg(log)
            .arg("--start-file")
            .arg(start)
            .arg("--rounds")
            .arg(rounds.to_string())
            .args(more),
    )
}

/// Reports in the data directory: every stalls.json of a process dir `comm-pid[-n]`.
fn report_stalls(data: &Path, comm: &str, pid: u32) -> Vec<Value> {
    let mut all = Vec::new();
    for w in std::fs::read_dir(data).into_iter().flatten().flatten() {
        for p in std::fs::read_dir(w.path()).into_iter().flatten().flatten() {
            let name = p.file_name().to_string_lossy().into_owned();
            let base = format!("{comm}-{pid}");
            if name == base || name.starts_with(&format!("{base}-")) {
                let rec = read_stalls_json(&p.path().join("stalls.json"));
                all.extend(rec["stalls"].as_array().unwrap().iter().cloned());
            }
        }
    }
    all
}

/// What every daemon test begins with: root and BPF (`None` when they are
/// missing, said loudly by `require_root_and_bpf`, which fails under CI),
/// the readers, the suite's lock (one daemon at a time: they would share
/// the kernel's probes and the host's processes), a scratch directory and
/// a free loopback port.
struct Case {
    dir: Scratch,
    port: u16,
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Case {
    fn begin(test: &str, scratch: &str) -> Option<Case> {
        if !require_root_and_bpf(test) {
            return None;
        }
        ensure_tools();
        let serial = serial();
        Some(Case {
            dir: Scratch::new(scratch),
            port: free_port(),
            _serial: serial,
        })
    }

    /// daemon.toml in the scratch directory: the port, a data directory
    /// inside it and a 40 ms threshold, then `extra`.
    fn config(&self, extra: &str) -> PathBuf {
        let cfg = self.dir.join("daemon.toml");
        std::fs::write(
            &cfg,
            format!(
                "listen = \"127.0.0.1:{}\"\ndata_dir = \"{}\"\nthreshold = \"40ms\"\n{extra}",
                self.port,
                self.dir.join("data").display()
            ),
        )
        .unwrap();
        cfg
    }
}

/// Per-process metric checks against a C victim's own log.
/// `host`: taken before the victim's first stall; the on-CPU check allows
/// what the host took from the VM's CPUs meanwhile (steal and interrupts:
/// wall time to the scheduler and to stallprof, not thread CPU time to the
/// victim), as record_c's does.
fn check_c_metrics(
    c: &mut Checks,
    fams: &[Value],
    pid: u32,
    exe: &Path,
    truth: &[Truth],
    host: &HostTime,
) {
    let p = pid.to_string();
    let l = [("pid", p.as_str())];
    let count = sample(fams, "stallprof_stall_duration_seconds_count", &l).unwrap_or(-1.0);
    c.check(count == truth.len() as f64, || {
        format!(
            "pid {pid}: stall count {count}, the victim logged {}",
            truth.len()
        )
    });
    let sum = sample(fams, "stallprof_stall_duration_seconds_sum", &l).unwrap_or(-1.0);
    let want: u64 = truth.iter().map(Truth::duration_ns).sum();
    let tol = 3 * MS * truth.len() as u64;
    c.check((sum * 1e9 - want as f64).abs() <= tol as f64, || {
        format!(
            "pid {pid}: stall seconds sum {sum:.4}, the victim's busy periods sum to {:.4}",
            want as f64 / 1e9
        )
    });
    let inf = sample(
        fams,
        "stallprof_stall_duration_seconds_bucket",
        &[("pid", &p), ("le", "+Inf")],
    )
    .unwrap_or(-1.0);
    c.check(inf == count, || {
        format!("pid {pid}: +Inf bucket {inf} != count {count}")
    });
    for le in ["0.05", "0.1", "0.25"] {
        let bound = (le.parse::<f64>().unwrap() * 1e9) as u64;
        let got = sample(
            fams,
            "stallprof_stall_duration_seconds_bucket",
            &[("pid", &p), ("le", le)],
        )
        .unwrap_or(-1.0);
        let lo = truth
            .iter()
            .filter(|t| t.duration_ns() + 3 * MS <= bound)
            .count() as f64;
        let hi = truth
            .iter()
            .filter(|t| t.duration_ns() <= bound + 3 * MS)
            .count() as f64;
        c.check(got >= lo && got <= hi, || {
            format!("pid {pid}: bucket le={le} holds {got}, want {lo}..={hi}")
        });
    }
    let kind = |k: &str| {
        sample(
            fams,
            "stallprof_stall_seconds_total",
            &[("pid", &p), ("kind", k)],
        )
        .unwrap_or(-1.0)
    };
    let (on, off, rq, gil) = (
        kind("on_cpu"),
        kind("off_cpu"),
        kind("runqueue"),
        kind("gil_wait"),
    );
    c.check(
        (on + off + rq + gil - sum).abs() < 1e-6 * truth.len() as f64 + 1e-9,
        || format!("pid {pid}: on {on} + off {off} + runqueue {rq} + gil {gil} != sum {sum}"),
    );
    c.check(gil == 0.0, || {
        format!("pid {pid}: a C program waited {gil} s for a GIL")
    });
    let cpu: u64 = truth.iter().map(|t| t.cpu_ns).sum();
    let lost = host.lost_ns();
    c.check(
        (on * 1e9 - cpu as f64).abs() <= (tol + cpu / 20 + lost) as f64,
        || {
            format!(
                "pid {pid}: on_cpu {on:.4} s, the victim's thread CPU time in its stalls {:.4} s \
                 (allowed {:.4} s, of which the host's steal and interrupts during the run {:.4} s)",
                cpu as f64 / 1e9,
                (tol + cpu / 20 + lost) as f64 / 1e9,
                lost as f64 / 1e9
            )
        },
    );
    let blocked: u64 = truth
        .iter()
        .filter(|t| t.kind != "spin")
        .map(Truth::duration_ns)
        .sum();
    c.check(off * 1e9 >= blocked as f64 * 0.9, || {
        format!(
            "pid {pid}: off_cpu {off:.4} s, the victim slept/read for {:.4} s",
            blocked as f64 / 1e9
        )
    });
    let labels = fams
        .iter()
        .flat_map(|f| f["samples"].as_array().unwrap().iter())
        .find(|s| {
            s["name"] == "stallprof_stall_duration_seconds_count"
                && s["labels"]["pid"] == p.as_str()
        })
        .map(|s| s["labels"].clone())
        .unwrap_or_default();
    c.check(labels["comm"] == "c_loop", || {
        format!("pid {pid}: labels {labels}")
    });
    c.check(
        labels["exe"].as_str() == Some(&*exe.display().to_string()),
        || {
            format!(
                "pid {pid}: exe label {}, want {}",
                labels["exe"],
                exe.display()
            )
        },
    );
    c.check(labels["runtime"] == "native", || {
        format!("pid {pid}: runtime label {}", labels["runtime"])
    });
    c.check(
        labels.get("cgroup").is_some() && labels.get("container").is_some(),
        || format!("pid {pid}: labels {labels}"),
    );
}

fn c_truth(log: &Path) -> Vec<Truth> {
    c_loop_truth(&read_log(log))
}

// ---------------------------------------------------------------------------

/// The issue's "done when", end to end with one daemon: C and Python
/// victims started after it, per-process metrics against the victims' own
/// clocks, exit and restart with a reused pid, pprof over HTTP and on disk,
/// the index page, SIGTERM flushing the window and unloading every program.
#[test]
fn daemon_end_to_end_c_python_restart_pid_reuse_sigterm() {
    let Some(case) = Case::begin(
        "daemon_end_to_end_c_python_restart_pid_reuse_sigterm",
        "daemon-e2e",
    ) else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    // A one-hour window: nothing is written before SIGTERM, so every report
    // on disk afterwards was flushed by it.
    let cfg = case.config("window = \"1h\"\n[limits]\nforget_after = \"5m\"\n");
    let c_bin = build_c_loop(&dir.path, false);
    let mut d = start_daemon(&cfg, port);
    let daemon_progs = prog_ids_of(d.prof.pid());
    assert!(
        daemon_progs.len() >= 5,
        "the daemon holds only {daemon_progs:?} BPF programs"
    );

    // --- victims started after the daemon
    let (log_a, start_a) = (dir.join("a.log"), dir.join("a.start"));
    let (log_p, start_p) = (dir.join("p.log"), dir.join("p.start"));
    let mut a = spawn_c_loop(&c_bin, &log_a, &start_a, None);
    let p1 = spawn_python(&log_p, &start_p, 2);
    let (pid_a, pid_p1) = (a.pid(), p1.pid());
    wait_metrics(
        &mut d,
        &dir.path,
        "both victims' loop threads",
        Duration::from_secs(15),
        |f| loop_threads(f, pid_a) >= 1.0 && loop_threads(f, pid_p1) >= 1.0,
    );
    std::thread::sleep(Duration::from_millis(1000)); // CPython detection (ticks every 250 ms)

    // pprof over HTTP, the way Parca scrapes: the stalls of the next 5 s.
    let pprof_http = std::thread::spawn(move || {
        http_get(
            port,
            &format!("/debug/pprof/profile?seconds=5&pid={pid_a}"),
            Duration::from_secs(30),
        )
    });
    std::thread::sleep(Duration::from_millis(100));
    let host_a = HostTime::now();
    std::fs::write(&start_a, b"go").unwrap();
    std::fs::write(&start_p, b"go").unwrap();
    wait_for_log_kind(&log_a, "done", Duration::from_secs(30));
    wait_for_log_kind(&log_p, "done", Duration::from_secs(30));
    a.assert_running();

    let truth_a = c_truth(&log_a);
    assert_eq!(
        truth_a.len(),
        12,
        "c_loop's default schedule has 12 stalls:\n{}",
        truth_table(&truth_a)
    );
    let py_truth = python_truth(&read_log(&log_p));
    assert_eq!(
        py_truth.len(),
        4,
        "py_blocking_client --rounds 2 makes 4 stalled calls:\n{}",
        truth_table(&py_truth)
    );
    let fams = wait_stalls_counted(&mut d, &dir.path, &[(pid_a, 12), (pid_p1, 4)]);
    let mut c = Checks::new(format!(
        "C victim:\n{}\nPython victim:\n{}",
        truth_table(&truth_a),
        truth_table(&py_truth)
    ));
    check_c_metrics(&mut c, &fams, pid_a, &c_bin, &truth_a, &host_a);

    // Python: every stalled call counted; an extra, incomplete stall may
    // close the loop at interpreter exit.
    let pp = pid_p1.to_string();
    let py_count = sample(
        &fams,
        "stallprof_stall_duration_seconds_count",
        &[("pid", &pp)],
    )
    .unwrap_or(-1.0);
    let py_incomplete =
        sample(&fams, "stallprof_stalls_incomplete_total", &[("pid", &pp)]).unwrap_or(0.0);
    c.check(py_count - py_incomplete == 4.0, || {
        format!("python pid {pid_p1}: {py_count} stalls ({py_incomplete} incomplete), want 4")
    });
    let py_sum = sample(
        &fams,
        "stallprof_stall_duration_seconds_sum",
        &[("pid", &pp)],
    )
    .unwrap_or(0.0);
    let py_want: u64 = py_truth.iter().map(Truth::duration_ns).sum();
    c.check(py_sum * 1e9 >= py_want as f64 - 2e6, || {
        format!(
            "python: stall sum {py_sum:.4} s < the calls' {:.4} s",
            py_want as f64 / 1e9
        )
    });
    let py_off = sample(
        &fams,
        "stallprof_stall_seconds_total",
        &[("pid", &pp), ("kind", "off_cpu")],
    )
    .unwrap_or(0.0);
    c.check(py_off >= 0.12, || {
        format!("python: off_cpu {py_off} s, but time.sleep(0.12) alone blocks 0.12 s")
    });
    c.check(
        fams.iter()
            .flat_map(|f| f["samples"].as_array().unwrap().iter())
            .any(|s| s["labels"]["pid"] == pp.as_str() && s["labels"]["runtime"] == "cpython"),
        || format!("python pid {pid_p1}: no series with runtime=\"cpython\""),
    );

    // The daemon's own metrics, by Prometheus conventions.
    for (name, ty, unit) in [
        ("stallprof_stall_duration_seconds", "histogram", "seconds"),
        ("stallprof_stall_seconds", "counter", "seconds"),
        ("stallprof_lost_events", "counter", ""),
        ("stallprof_kernel_filtered", "counter", ""),
        ("stallprof_tracked_threads", "gauge", ""),
        ("stallprof_tracked_processes", "gauge", ""),
        ("process_cpu_seconds", "counter", "seconds"),
        ("process_resident_memory_bytes", "gauge", "bytes"),
    ] {
        match family(&fams, name) {
            Some(f) => c.check(f["type"] == ty && f["unit"] == unit, || {
                format!("{name}: type {} unit {:?}", f["type"], f["unit"])
            }),
            None => c.fail(format!("no metric family {name}")),
        }
    }
    // The victims' idle ticks (microseconds busy, every 10 ms) are loop
    // iterations the kernel's sampling gate keeps from the daemon.
    let quiet = sample(
        &fams,
        "stallprof_kernel_filtered_total",
        &[("what", "short_busy_periods")],
    )
    .unwrap_or(0.0);
    c.check(quiet >= 50.0, || {
        format!("stallprof_kernel_filtered_total{{what=\"short_busy_periods\"}} is {quiet}")
    });
    let threads = sample(&fams, "stallprof_tracked_threads", &[]).unwrap_or(0.0);
    c.check(threads >= 1.0, || {
        format!("stallprof_tracked_threads is {threads}")
    });
    let rss = sample(&fams, "process_resident_memory_bytes", &[]).unwrap_or(0.0);
    c.check(rss > 1e6, || {
        format!("process_resident_memory_bytes is {rss}")
    });

    // pprof over HTTP.
    match pprof_http.join().unwrap() {
        Ok((200, body)) => {
            let f = dir.join("http.pb.gz");
            std::fs::write(&f, &body).unwrap();
            let prof = read_pprof(&dir.path, &f);
            c.check(
                prof["sample_types"] == serde_json::json!([["stall", "nanoseconds"]]),
                || format!("sample types {}", prof["sample_types"]),
            );
            let total: f64 = prof["samples"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["value"][0].as_f64().unwrap())
                .sum();
            let want: u64 = truth_a.iter().map(Truth::duration_ns).sum();
            c.check((total - want as f64).abs() <= (3 * MS * 12) as f64, || {
                format!(
                    "HTTP pprof holds {:.4} s of stalls, the victim's 12 stalls {:.4} s",
                    total / 1e9,
                    want as f64 / 1e9
                )
            });
            for func in ["spin_for_ms", "sleep_for_ms", "read_slow_pipe"] {
                c.check(
                    prof["samples"].as_array().unwrap().iter().any(|s| {
                        s["frames"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .any(|f| f.as_str().unwrap().split('|').any(|n| n == func))
                    }),
                    || format!("HTTP pprof has no {func} frame"),
                );
            }
            c.check(
                prof["samples"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|s| s["labels"]["pid"] == pid_a as u64),
                || "HTTP pprof (?pid=) has samples of other processes".into(),
            );
        }
        other => c.fail(format!("GET /debug/pprof/profile: {other:?}")),
    }

    // Index page.
    let (st, idx) = http_get(port, "/", Duration::from_secs(5)).unwrap();
    let idx = String::from_utf8_lossy(&idx);
    c.check(
        st == 200 && idx.contains("c_loop") && idx.contains(&pid_a.to_string()),
        || format!("index page ({st}):\n{idx:.3000}"),
    );

    // --- exit and restart: the C victim with its own pid again, Python anew.
    drop(a);
    wait_listed_exited(&mut d, pid_a);
    let (log_b, start_b) = (dir.join("b.log"), dir.join("b.start"));
    let b = spawn_c_loop_with_pid(pid_a, &c_bin, &log_b, &start_b, "spin:60,idle:5,sleep:70");
    let (log_q, start_q) = (dir.join("q.log"), dir.join("q.start"));
    let p2 = spawn_python(&log_q, &start_q, 1);
    let pid_p2 = p2.pid();
    let fams = wait_metrics(
        &mut d,
        &dir.path,
        "the restarted victims' loop threads",
        Duration::from_secs(15),
        |f| loop_threads(f, pid_a) >= 1.0 && loop_threads(f, pid_p2) >= 1.0,
    );
    let fresh = sample(
        &fams,
        "stallprof_stall_duration_seconds_count",
        &[("pid", &pid_a.to_string())],
    );
    c.check(fresh == Some(0.0), || {
        format!("pid {pid_a} reused: its new process starts with {fresh:?} stalls, want 0")
    });
    std::thread::sleep(Duration::from_millis(1000));
    let host_b = HostTime::now();
    std::fs::write(&start_b, b"go").unwrap();
    std::fs::write(&start_q, b"go").unwrap();
    wait_for_log_kind(&log_b, "done", Duration::from_secs(30));
    wait_for_log_kind(&log_q, "done", Duration::from_secs(30));
    let truth_b = c_truth(&log_b);
    assert_eq!(truth_b.len(), 2, "{}", truth_table(&truth_b));
    let fams = wait_stalls_counted(&mut d, &dir.path, &[(pid_a, 2), (pid_p2, 3)]);
    let mut cb = Checks::new(format!(
        "restarted C victim (pid {pid_a} reused):\n{}",
        truth_table(&truth_b)
    ));
    check_c_metrics(&mut cb, &fams, pid_a, &c_bin, &truth_b, &host_b);
    let q = pid_p2.to_string();
    let q_count = sample(
        &fams,
        "stallprof_stall_duration_seconds_count",
        &[("pid", &q)],
    )
    .unwrap_or(-1.0);
    let q_inc = sample(&fams, "stallprof_stalls_incomplete_total", &[("pid", &q)]).unwrap_or(0.0);
    cb.check(q_count - q_inc == 3.0, || {
        format!("second python pid {pid_p2}: {q_count} stalls ({q_inc} incomplete), want 3")
    });
    // The first Python process exited; its series stay for forget_after.
    let p1_count = sample(
        &fams,
        "stallprof_stall_duration_seconds_count",
        &[("pid", &pp)],
    );
    cb.check(p1_count == Some(py_count), || {
        format!("exited python pid {pid_p1}: count {p1_count:?}, was {py_count}")
    });

    // --- SIGTERM: flush the window, detach.
    d.prof.signal(libc::SIGTERM);
    let Daemon { prof, .. } = d;
    let run = prof.wait(Duration::from_secs(30));
    cb.check(
        run.status.success() && run.stdout.contains("stopped by SIGTERM"),
        || format!("daemon after SIGTERM:\n{}", run.describe()),
    );
    let left = sp_programs_left(|p| daemon_progs.contains(&p.0));
    cb.check(left.is_empty(), || {
        format!("BPF programs of the daemon still loaded after it exited: {left:?}")
    });

    // Every stall of both C processes (same pid, same comm) is in the flushed reports.
    let data = dir.join("data");
    let on_disk = report_stalls(&data, "c_loop", pid_a);
    for t in truth_a.iter().chain(&truth_b) {
        let n = on_disk
            .iter()
            .filter(|s| {
                s["start_ns"].as_u64().unwrap() < t.end_ns
                    && s["end_ns"].as_u64().unwrap() > t.start_ns
            })
            .count();
        cb.check(n == 1, || {
            format!(
                "{} stall at {} is in the flushed reports {n} times, want 1",
                t.kind, t.start_ns
            )
        });
    }
    cb.check(on_disk.len() == 14, || {
        format!("{} C stalls on disk, want 14", on_disk.len())
    });
    // The flushed pprof files read back, and hold the same stall time as the JSON.
    let mut pb_files = 0;
    for w in std::fs::read_dir(&data).unwrap().flatten() {
        // A window's process directories (services.json is the window's).
        for p in std::fs::read_dir(w.path()).unwrap().flatten() {
            if !p.file_type().unwrap().is_dir() {
                continue;
            }
            let rec = read_stalls_json(&p.path().join("stalls.json"));
            let want: u64 = rec["stalls"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["duration_ns"].as_u64().unwrap())
                .sum();
            let pftrace = std::fs::metadata(p.path().join("stalls.pftrace"));
            cb.check(pftrace.is_ok_and(|m| m.len() > 0), || {
                format!("{}: no stalls.pftrace", p.path().display())
            });
            let speedscope = std::fs::read(p.path().join("stalls.speedscope.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
            cb.check(
                speedscope.is_some_and(|f| f["profiles"].as_array().is_some_and(|p| !p.is_empty())),
                || {
                    format!(
                        "{}: no stalls.speedscope.json with a profile",
                        p.path().display()
                    )
                },
            );
            let prof = read_pprof(&dir.path, &p.path().join("stalls.pb.gz"));
            let total: u64 = prof["samples"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["value"][0].as_u64().unwrap())
                .sum();
            cb.check(total == want, || {
                format!(
                    "{}: pprof total {total} ns, stalls.json {want} ns",
                    p.path().display()
                )
            });
            let svg = std::fs::read_to_string(p.path().join("stalls.svg")).unwrap_or_default();
            cb.check(svg.contains("<svg"), || {
                format!("{}: no SVG flamegraph", p.path().display())
            });
            pb_files += 1;
        }
    }
    cb.check(pb_files >= 4, || {
        format!("{pb_files} process reports flushed, want the 2 C and 2 Python processes")
    });
    drop(b);
    drop(p1);
    drop(p2);
    c.finish();
    cb.add_context(&format!(
        "daemon stderr:\n{}",
        run.stderr
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    ));
    cb.finish();
}

/// Rolling 1 s windows under a size and an age limit: the data directory
/// never holds more than the limits allow (beyond the window being swept),
/// old windows go, the index page links to flamegraphs that are served, and
/// every pprof file written reads back.
#[test]
fn daemon_retention_limits_hold() {
    let Some(case) = Case::begin("daemon_retention_limits_hold", "daemon-retention") else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    const MAX_BYTES: u64 = 300 * 1024;
    const MAX_AGE_S: u64 = 4;
    // Only the victim (an include rule on its exe): other processes of the
    // host must not fill the budget.
    let cfg = case.config(&format!(
            "window = \"1s\"\n[retention]\nmax_age = \"{MAX_AGE_S}s\"\nmax_size = \"{MAX_BYTES}\"\n[[include]]\nexe = \"{}/*\"\n",
            dir.path.display()
        ),
    );
    let c_bin = build_c_loop(&dir.path, false);
    let mut d = start_daemon(&cfg, port);
    let (log, start) = (dir.join("r.log"), dir.join("r.start"));
    let v = spawn_c_loop(
        &c_bin,
        &log,
        &start,
        // ~8 s of stalls: twice max_age, so windows age out whatever their
        // size (the compact stalls.json keeps a window far under MAX_BYTES).
        Some(&"spin:50,idle:3,sleep:50,idle:3,".repeat(50)),
    );
    let pid = v.pid();
    wait_metrics(
        &mut d,
        &dir.path,
        "the victim's loop thread",
        Duration::from_secs(15),
        |f| loop_threads(f, pid) >= 1.0,
    );
    std::fs::write(&start, b"go").unwrap();
    let data = dir.join("data");
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut c = Checks::new(String::new());
    let mut max_seen = 0u64;
    let mut pprof_checked = 0;
    let t0 = Instant::now();
    while !log_has_kind(&log, "done") && t0.elapsed() < Duration::from_secs(40) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let mut sizes: BTreeMap<String, u64> = BTreeMap::new();
        for w in std::fs::read_dir(&data).unwrap().flatten() {
            let name = w.file_name().to_string_lossy().into_owned();
            let size: u64 = std::fs::read_dir(w.path())
                .into_iter()
                .flatten()
                .flatten()
                .flat_map(|p| std::fs::read_dir(p.path()).into_iter().flatten().flatten())
                .map(|f| f.metadata().map(|m| m.len()).unwrap_or(0))
                .sum();
            sizes.insert(name, size);
        }
        let total: u64 = sizes.values().sum();
        let newest = sizes.values().last().copied().unwrap_or(0);
        max_seen = max_seen.max(total);
        // Between a window's write and its sweep the newest may be extra.
        c.check(total <= MAX_BYTES + newest, || {
            format!(
                "data dir holds {total} bytes over {} windows, limit {MAX_BYTES}",
                sizes.len()
            )
        });
        for name in sizes.keys() {
            let start_s = windows_start(name);
            c.check(now.saturating_sub(start_s) <= MAX_AGE_S + 3, || {
                format!(
                    "window {name} is {} s old, max_age {MAX_AGE_S} s",
                    now - start_s
                )
            });
            seen.insert(name.clone());
        }
        // Read a pprof file of a finished window.
        if pprof_checked < 3
            && let Some(name) = sizes.keys().next()
        {
            let pdir = data.join(name).join(format!("c_loop-{pid}"));
            if let (Ok(json), true) = (
                std::fs::read(pdir.join("stalls.json")),
                pdir.join("stalls.pb.gz").exists(),
            ) {
                let rec = expand_stalls_json(serde_json::from_slice(&json).unwrap());
                let want: u64 = rec["stalls"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s["duration_ns"].as_u64().unwrap())
                    .sum();
                let copy = dir.join("w.pb.gz");
                if std::fs::copy(pdir.join("stalls.pb.gz"), &copy).is_ok() {
                    let prof = read_pprof(&dir.path, &copy);
                    let total: u64 = prof["samples"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|s| s["value"][0].as_u64().unwrap())
                        .sum();
                    c.check(total == want, || {
                        format!("{name}: pprof total {total} ns, stalls.json {want} ns")
                    });
                    pprof_checked += 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    c.check(log_has_kind(&log, "done"), || {
        "the victim did not finish its schedule in 40 s".into()
    });
    c.check(pprof_checked > 0, || {
        "no window's pprof file could be read while the daemon ran".into()
    });
    let kept_now = std::fs::read_dir(&data).unwrap().count();
    // Retention must have removed at least one window (how many windows the
    // victim spans depends on the machine's speed).
    c.check(seen.len() > kept_now && seen.len() >= 3, || {
        format!(
            "{} windows seen, {kept_now} kept: retention removed none",
            seen.len()
        )
    });
    // The index links to a flamegraph that is served.
    let (st, idx) = http_get(port, "/", Duration::from_secs(5)).unwrap();
    let idx = String::from_utf8_lossy(&idx).into_owned();
    let link = idx
        .split("href=\"")
        .skip(1)
        .filter_map(|s| s.split('"').next())
        .find(|h| h.starts_with("/reports/") && h.ends_with(".svg"));
    match link {
        Some(l) => {
            let (st2, svg) = http_get(port, l, Duration::from_secs(5)).unwrap();
            c.check(
                st2 == 200 && String::from_utf8_lossy(&svg).contains("<svg"),
                || format!("GET {l}: {st2}"),
            );
        }
        None => c.fail(format!(
            "index page ({st}) links no flamegraph:\n{idx:.3000}"
        )),
    }
    let fams = parse_metrics(&dir.path, &metrics_text(port));
    let reported = sample(&fams, "stallprof_reports_bytes", &[]).unwrap_or(-1.0);
    c.check(reported >= 0.0 && reported <= MAX_BYTES as f64, || {
        format!("stallprof_reports_bytes {reported} over the limit {MAX_BYTES}")
    });
    d.prof.signal(libc::SIGTERM);
    let run = d.prof.wait(Duration::from_secs(30));
    c.check(run.status.success(), || {
        format!("daemon after SIGTERM:\n{}", run.describe())
    });
    let total: u64 = walk_size(&data);
    c.check(total <= MAX_BYTES, || {
        format!("after exit the data dir holds {total} bytes, limit {MAX_BYTES}")
    });
    drop(v);
    c.add_context(&format!("max seen {max_seen} bytes; windows seen {seen:?}"));
    c.finish();
}

fn walk_size(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            if e.file_type().unwrap().is_dir() {
                walk_size(&e.path())
            } else {
                e.metadata().map(|m| m.len()).unwrap_or(0)
            }
        })
        .sum()
}

/// Seconds since the epoch of a window directory named `YYYYMMDDTHHMMSSZ[-n]`.
fn windows_start(name: &str) -> u64 {
    let out = Command::new("date")
        .args(["-u", "-d"])
        .arg(format!(
            "{}-{}-{} {}:{}:{}",
            &name[0..4],
            &name[4..6],
            &name[6..8],
            &name[9..11],
            &name[11..13],
            &name[13..15]
        ))
        .arg("+%s")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("window dir name {name:?}"))
}

/// `stallprof daemon --config PATH --check-config`.
fn check_config(path: &Path) -> RunOutput {
    run_stallprof(
        &[
            "daemon".to_string(),
            "--config".into(),
            path.display().to_string(),
            "--check-config".into(),
        ],
        Duration::from_secs(10),
    )
}
/// Issue 18: with include rules each included process carries its own wait
/// uprobes, up to `MAX_PROCESS_WAITS` (8); past that the uprobes go on the
/// C library file for every process, and a process the rules leave out is
/// skipped by the kernel side from its first wait, as without include
/// rules. Nine included sleepers and an included C loop pass the limit; a
/// second C loop, not included, runs the same schedule. Checked: the switch
/// is logged and no process keeps its own uprobes; the included loop's
/// every scheduled stall is reported; the left-out loop has no series, is
/// in `LEFT_OUT`, and its waits were skipped.
#[test]
fn daemon_many_included_processes_share_file_probes() {
    let Some(case) = Case::begin(
        "daemon_many_included_processes_share_file_probes",
        "daemon-many-included",
    ) else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    let (inc, out) = (dir.join("in"), dir.join("out"));
    std::fs::create_dir_all(&inc).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    let c_bin = build_c_loop(&dir.path, false);
    std::fs::copy(&c_bin, inc.join("c_loop")).unwrap();
    std::fs::copy(&c_bin, out.join("c_loop")).unwrap();
    std::fs::copy("/bin/sleep", inc.join("sleeper")).unwrap();
    let cfg = case.config(&format!(
        "window = \"1h\"\n[[include]]\nexe = \"{}/*\"\n",
        inc.display()
    ));
    let mut d = start_daemon(&cfg, port);
    let sleepers: Vec<Victim> = (0..9)
        .map(|_| Victim::spawn(Command::new(inc.join("sleeper")).arg("600")))
        .collect();
    wait_metrics(
        &mut d,
        &dir.path,
        "the switch to per-file wait uprobes",
        Duration::from_secs(15),
        |f| {
            sample(
                f,
                "stallprof_probes",
                &[("part", "wait_uprobes"), ("mode", "per_file")],
            ) == Some(1.0)
                && sample(f, "stallprof_wait_probed_processes", &[]) == Some(0.0)
        },
    );
    const SCHEDULE: &str = "spin:80,idle:5,sleep:90,idle:5,spin:70,idle:5,";
    let spawn = |bin: PathBuf, name: &str| {
        let (log, start) = (
            dir.join(&format!("{name}.log")),
            dir.join(&format!("{name}.start")),
        );
        (spawn_c_loop(&bin, &log, &start, Some(SCHEDULE)), log, start)
    };
    let (v_in, log_in, start_in) = spawn(inc.join("c_loop"), "in");
    let (v_out, log_out, start_out) = spawn(out.join("c_loop"), "out");
    wait_metrics(
        &mut d,
        &dir.path,
        "the included loop's thread",
        Duration::from_secs(15),
        |f| loop_threads(f, v_in.pid()) >= 1.0,
    );
    std::fs::write(&start_in, b"go").unwrap();
    std::fs::write(&start_out, b"go").unwrap();
    let t0 = Instant::now();
    while !(log_has_kind(&log_in, "done") && log_has_kind(&log_out, "done"))
        && t0.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let scheduled = read_log(&log_in)
        .iter()
        .filter(|r| r["kind"] == "spin" || r["kind"] == "sleep")
        .count();
    let pid_in = v_in.pid().to_string();
    let fams = wait_metrics(
        &mut d,
        &dir.path,
        "the included loop's stalls",
        Duration::from_secs(10),
        |f| {
            sample(
                f,
                "stallprof_stall_duration_seconds_count",
                &[("pid", &pid_in)],
            )
            .unwrap_or(0.0)
                >= scheduled as f64
        },
    );
    let mut c = Checks::new(format!(
        "included loop {pid_in}, left-out loop {}",
        v_out.pid()
    ));
    c.check(scheduled == 3, || {
        format!("the included loop logged {scheduled} stalls, not its schedule's 3")
    });
    c.check(
        sample(
            &fams,
            "stallprof_stall_duration_seconds_count",
            &[("pid", &v_out.pid().to_string())],
        )
        .is_none(),
        || "the left-out loop has series".into(),
    );
    let left_out_waits = sample(
        &fams,
        "stallprof_kernel_filtered_total",
        &[("what", "left_out_waits")],
    )
    .unwrap_or(0.0);
    c.check(left_out_waits > 0.0, || {
        "no wait of the left-out loop was skipped by the kernel side".into()
    });
    let left_out = left_out_tgids(d.prof.pid());
    c.check(left_out.contains(&v_out.pid()), || {
        format!(
            "the left-out loop {} is not in LEFT_OUT: {left_out:?}",
            v_out.pid()
        )
    });
    c.check(!left_out.contains(&v_in.pid()), || {
        format!("the included loop is in LEFT_OUT: {left_out:?}")
    });
    d.prof.signal(libc::SIGTERM);
    let run = d.prof.wait(Duration::from_secs(30));
    c.check(run.status.success(), || {
        format!("daemon after SIGTERM:\n{}", run.describe())
    });
    c.check(
        run.stderr
            .contains("more than 8 included processes wait in a C library"),
        || {
            format!(
                "the switch to per-file uprobes is not logged:\n{}",
                run.stderr
            )
        },
    );
    // Before it, eight had their own, and the switch detached them.
    let own = run.stderr.matches("wait uprobes of its own").count();
    let moved = run
        .stderr
        .matches("its wait uprobes detached (moved to the C library files)")
        .count();
    c.check(own >= 8 && moved == own, || {
        format!(
            "{own} processes got their own wait uprobes and {moved} were moved to the files, \
             not 8 and 8:\n{}",
            run.stderr
        )
    });
    drop(sleepers);
    c.finish();
}

/// `--check-config` validates without root and without loading anything;
/// bad configs fail naming the key.
#[test]
fn daemon_check_config() {
    let dir = Scratch::new("daemon-config");
    let good = dir.join("good.toml");
    std::fs::write(
        &good,
        "listen = \"127.0.0.1:9999\"\nthreshold = \"25ms\"\nwindow = \"30s\"\ndata_group = \"nogroup\"\n[retention]\nmax_age = \"2h\"\nmax_size = \"64MiB\"\n\
         [limits]\nmax_processes = 50\n[[include]]\ncomm = \"python*\"\n[[exclude]]\ncgroup = \"*system.slice*\"\n",
    )
    .unwrap();
    let out = check_config(&good);
    assert!(out.status.success(), "{}", out.describe());
    for want in [
        "127.0.0.1:9999",
        "25.0ms",
        "max_processes 50",
        "comm=python*",
        "cgroup=*system.slice*",
        "readable by group nogroup",
    ] {
        assert!(
            out.stdout.contains(want),
            "--check-config output lacks {want:?}:\n{}",
            out.stdout
        );
    }
    for (text, key) in [
        ("treshold = \"25ms\"\n", "treshold"),
        ("window = \"soon\"\n", "window"),
        ("listen = \"localhost\"\n", "listen"),
        ("[retention]\nmax_size = \"lots\"\n", "max_size"),
        ("[[include]]\n", "rule"),
        ("data_group = \"no-such-group-stallprof\"\n", "data_group"),
    ] {
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, text).unwrap();
        let out = check_config(&bad);
        assert!(
            !out.status.success() && out.stderr.contains(key),
            "config {text:?} should fail naming {key:?}:\n{}",
            out.describe()
        );
    }
}

/// Issue 10: the daemon's memory bound rebuilds its engine; the loop-thread
/// registry must survive the rebuild (the kernel holds back a known loop's
/// quiet iterations, so a fresh registry could never re-learn it). With
/// `limits.max_stacks = 1` the daemon rebuilds every second while a Python
/// victim stalls; each of its stalled calls must still be reported, with
/// the culprit's Python frame on the stack.
#[test]
fn daemon_rebuild_keeps_loops_and_full_stacks() {
    let Some(case) = Case::begin(
        "daemon_rebuild_keeps_loops_and_full_stacks",
        "daemon-rebuild",
    ) else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    let cfg = case.config("window = \"1h\"\n[limits]\nmax_stacks = 1\n");
    let mut d = start_daemon(&cfg, port);
    let (log, start) = (dir.join("p.log"), dir.join("p.start"));
    let p = spawn_python(&log, &start, 3);
    let pid = p.pid();
    wait_metrics(
        &mut d,
        &dir.path,
        "the victim's loop thread",
        Duration::from_secs(15),
        |f| loop_threads(f, pid) >= 1.0,
    );
    std::thread::sleep(Duration::from_millis(1000)); // CPython detection
    // A first victim's stalls intern stacks past `max_stacks`: the next
    // housekeeping rebuilds. Go only after a rebuild, so every stall of
    // the victim is assembled by a rebuilt engine. (Nothing else on the
    // host may be relied on for stacks: this test's own thread, polling
    // /metrics between sleeps, was once taken for a poll loop and did.)
    let (warm_log, warm_start) = (dir.join("w.log"), dir.join("w.start"));
    let warm = spawn_python(&warm_log, &warm_start, 1);
    wait_for_log_kind(&warm_log, "ready", Duration::from_secs(15));
    std::fs::write(&warm_start, b"go").unwrap();
    wait_for_log_kind(&warm_log, "done", Duration::from_secs(30));
    drop(warm);
    let resets = |f: &[Value]| sample(f, "stallprof_session_resets_total", &[]).unwrap_or(0.0);
    let before = wait_metrics(
        &mut d,
        &dir.path,
        "an engine rebuild",
        Duration::from_secs(15),
        |f| resets(f) >= 1.0,
    );
    std::fs::write(&start, b"go").unwrap();
    wait_for_log_kind(&log, "done", Duration::from_secs(30));
    let truth = python_truth(&read_log(&log));
    let after = wait_stalls_counted(&mut d, &dir.path, &[(pid, truth.len())]);
    let mut c = Checks::new(format!("Python victim:\n{}", truth_table(&truth)));
    c.check(truth.len() >= 4, || {
        format!(
            "py_blocking_client --rounds 3 logged only {} stalled calls",
            truth.len()
        )
    });
    c.check(resets(&after) > resets(&before), || {
        format!(
            "no rebuild while the victim stalled (resets {} -> {})",
            resets(&before),
            resets(&after)
        )
    });
    c.check(loop_threads(&after, pid) >= 1.0, || {
        "the loop thread is gone from stallprof_loop_threads after rebuilds".into()
    });
    d.prof.signal(libc::SIGTERM);
    let run = d.prof.wait(Duration::from_secs(30));
    c.check(run.status.success(), || {
        format!("daemon after SIGTERM:\n{}", run.describe())
    });
    drop(p);
    let stalls = report_stalls(&dir.path.join("data"), "python3.11", pid);
    for t in &truth {
        let hit = stalls.iter().find(|s| {
            s["start_ns"].as_u64().unwrap_or(0) < t.end_ns
                && s["end_ns"].as_u64().unwrap_or(0) > t.start_ns
        });
        match hit {
            None => c.fail(format!(
                "{} at {}: no stall reported after the rebuilds ({} on disk)",
                t.func,
                t.start_ns,
                stalls.len()
            )),
            Some(s) => {
                let named = s["stacks"].as_array().into_iter().flatten().any(|st| {
                    st["frames"].as_array().into_iter().flatten().any(|f| {
                        f["kind"] == "python" && f["name"].as_str() == Some(t.func.as_str())
                    })
                });
                c.check(named, || {
                    format!(
                        "{}: the stall after the rebuilds has no Python frame {:?}",
                        t.func, t.func
                    )
                });
            }
        }
    }
    c.finish();
}

/// CPU hogs, killed when dropped: they load the machine the daemon runs on.
struct Busy(Vec<std::process::Child>);

impl Busy {
    /// `per_core` busy-looping shells per online CPU.
    fn per_core(per_core: usize) -> Busy {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Busy(
            (0..cores * per_core)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("starting a busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Issue 13: BPF map entries of exited processes are removed. `PY_PROCS`
/// holds 1,024 processes; 1,100 short-lived asyncio processes come and go
/// under the daemon, then one more Python victim stalls: its stalls must
/// still carry Python frames, and no map may have filled.
///
/// Issue 18: all of it with 2 busy processes per core running alongside
/// (the drain must keep up on a loaded machine: no `ringbuf_full`); the
/// daemon's peak RSS is printed.
#[test]
fn daemon_python_churn_keeps_python_stacks() {
    let Some(case) = Case::begin("daemon_python_churn_keeps_python_stacks", "daemon-churn") else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    let cfg = case.config("window = \"1h\"\n[limits]\nforget_after = \"1s\"\n");
    let mut d = start_daemon(&cfg, port);
    let busy = Busy::per_core(2);
    // Each child runs an asyncio loop for ~1.2 s: long enough to be found
    // as a loop thread and as CPython, then exits.
    let churn = dir.join("churn.py");
    std::fs::write(
        &churn,
        "import asyncio\n\
         async def main():\n\
         \x20   for _ in range(30):\n\
         \x20       await asyncio.sleep(0.04)\n\
         asyncio.run(main())\n",
    )
    .unwrap();
    const CHURN: usize = 1100;
    const AT_ONCE: usize = 40;
    let mut running: Vec<std::process::Child> = Vec::new();
    let mut churned = BTreeSet::new();
    let started = Instant::now();
    for _ in 0..CHURN {
        while running.len() >= AT_ONCE {
            running.retain_mut(|c| c.try_wait().map(|s| s.is_none()).unwrap_or(false));
            std::thread::sleep(Duration::from_millis(20));
        }
        running.push(
            Command::new(PY)
                .arg(&churn)
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("starting a churn process"),
        );
        churned.insert(running.last().unwrap().id().to_string());
    }
    for mut c in running {
        let _ = c.wait();
    }
    let churn_time = started.elapsed();
    // Exits seen and, after forget_after, the series forgotten.
    wait_metrics(
        &mut d,
        &dir.path,
        "no series of a churn process left",
        Duration::from_secs(15),
        |f| {
            !f.iter()
                .flat_map(|fam| fam["samples"].as_array().unwrap().iter())
                .any(|s| {
                    s["labels"]["pid"]
                        .as_str()
                        .is_some_and(|p| churned.contains(p))
                })
        },
    );
    let (log, start) = (dir.join("p.log"), dir.join("p.start"));
    // It lingers after its last stall until dropped (after the daemon's
    // last report): with 2 busy processes per core the daemon's reads of
    // its last stalls' code objects may come after a victim that exits
    // 200 ms later is gone ("[python ?]", said in runtime_problems) -- a
    // fresh-clone run met that. What this test is after is Python stacks
    // still read after 1,100 processes came and went.
    let p = spawn_python_with(&log, &start, 2, &["--linger"]);
    let pid = p.pid();
    wait_metrics(
        &mut d,
        &dir.path,
        "the last victim's loop thread",
        Duration::from_secs(15),
        |f| loop_threads(f, pid) >= 1.0,
    );
    std::thread::sleep(Duration::from_millis(1000)); // CPython detection
    std::fs::write(&start, b"go").unwrap();
    wait_for_log_kind(&log, "done", Duration::from_secs(30));
    let truth = python_truth(&read_log(&log));
    // The load goes before the wait: the daemon counts a stall once its
    // symbolizer thread (nice 19) has named it, and under two busy
    // processes per core that thread may not run for longer than the wait
    // (a fresh-clone run counted 0 of 4 in 15 s). The stalls themselves
    // happened under the load.
    drop(busy);
    wait_stalls_counted(&mut d, &dir.path, &[(pid, truth.len())]);
    let metrics = metrics_text(port);
    let rss = vm_hwm_kib(d.prof.pid()).map(|k| k as f64 / 1024.0);
    let mut c = Checks::new(format!(
        "{CHURN} churn processes in {churn_time:?}, 2 busy processes per core; \
         daemon peak RSS {rss:?} MiB; last victim:\n{}",
        truth_table(&truth)
    ));
    // The issue's target is 64 MiB; measured here, not asserted yet (67 MiB
    // in a hand run of this load: docs/benchmarks.md).
    eprintln!("daemon peak RSS under churn: {rss:?} MiB (target 64)");
    c.check(!metrics.contains("_full\""), || {
        format!(
            "a BPF map filled up:\n{}",
            metrics
                .lines()
                .filter(|l| l.contains("_full\""))
                .collect::<Vec<_>>()
                .join("\n")
        )
    });
    d.prof.signal(libc::SIGTERM);
    let run = d.prof.wait(Duration::from_secs(30));
    c.check(run.status.success(), || {
        format!("daemon after SIGTERM:\n{}", run.describe())
    });
    drop(p);
    let stalls = report_stalls(&dir.path.join("data"), "python3.11", pid);
    c.check(!truth.is_empty(), || {
        "the victim logged no stalled call".into()
    });
    for t in &truth {
        let hit = stalls.iter().find(|s| {
            s["start_ns"].as_u64().unwrap_or(0) < t.end_ns
                && s["end_ns"].as_u64().unwrap_or(0) > t.start_ns
        });
        let named =
            hit.is_some_and(|s| {
                s["stacks"].as_array().into_iter().flatten().any(|st| {
                    st["frames"].as_array().into_iter().flatten().any(|f| {
                        f["kind"] == "python" && f["name"].as_str() == Some(t.func.as_str())
                    })
                })
            });
        c.check(named, || {
            format!(
                "{} after {CHURN} Python processes: {}",
                t.func,
                if hit.is_some() {
                    "its stall has no Python frame (PY_PROCS full?)"
                } else {
                    "no stall reported"
                }
            )
        });
    }
    c.finish();
}

/// Every report (stalls.json) the daemon wrote for process `comm-pid`.
fn reports_of(data: &Path, comm: &str, pid: u32) -> Vec<Value> {
    let mut all = Vec::new();
    for w in std::fs::read_dir(data).into_iter().flatten().flatten() {
        for p in std::fs::read_dir(w.path()).into_iter().flatten().flatten() {
            let name = p.file_name().to_string_lossy().into_owned();
            let base = format!("{comm}-{pid}");
            if name == base || name.starts_with(&format!("{base}-")) {
                all.push(read_stalls_json(&p.path().join("stalls.json")));
            }
        }
    }
    all
}

/// Issue 11, items 1 and 4: containerized victims started after the
/// daemon are found, symbolized and labelled. Two victims in the container
/// sandbox (own mount and PID namespaces), each in a cgroup named as a
/// runtime names its containers': the gateway on python3.14 in a
/// Kubernetes pod's containerd container, and the same on a python3.15
/// whose `Py_Version` says 3.16.0 in a Docker container. The rules include
/// the pod (by uid) and the Docker container (by short id) only; a third
/// asyncio process on the host is left out, and with it every other
/// process: only the two victims carry wait uprobes. Checked: the labels
/// (`container`, `pod`), the runtime-problem gauge of the unreadable
/// interpreter, Python frames of the readable one, and in the reports the
/// container, the namespace pid and each request's stall under the tid the
/// victim logged.
#[test]
fn daemon_labels_containerized_victims() {
    let test = "daemon_labels_containerized_victims";
    let Some(case) = Case::begin(test, "daemon-containers") else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    let root = require_forky_root();
    let (pod_id, docker_id) = (
        fake_container_id(std::process::id()),
        fake_container_id(std::process::id() ^ 0xffff),
    );
    let uid = fake_pod_uid(std::process::id());
    assert_ne!(
        pod_id[..12],
        docker_id[..12],
        "the two short ids must differ"
    );
    let cfg = case.config(&format!(
        "window = \"1h\"\n[[include]]\npod = \"{uid}\"\n[[include]]\ncontainer = \"{}\"\n",
        &docker_id[..12]
    ));
    let mut d = start_daemon(&cfg, port);

    // An interpreter stallprof must refuse, in the sandbox's /tmp.
    let bin_name = format!("stallprof-{test}-bin-{}", std::process::id());
    let bin_dir = root.join("tmp").join(&bin_name);
    std::fs::create_dir_all(&bin_dir).unwrap();
    let _cleanup = RemoveOnDrop(bin_dir.clone());
    patch_py_version(
        &root.join("usr/bin/python3.15"),
        &bin_dir.join("python3.16"),
        0x0310_00f0,
    );
    let mut pod = ContainerVictim::spawn_python(
        &format!("{test}-pod"),
        "python3.14",
        "py_gateway.py",
        &["--requests", "4"],
    );
    let _pod_cg = FakeContainerCgroup::enter(
        test,
        &format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{pod_id}.scope",
            uid.replace('-', "_")
        ),
        pod.host_pid,
    );
    let mut docker = ContainerVictim::spawn_python(
        &format!("{test}-docker"),
        &format!("/tmp/{bin_name}/python3.16"),
        "py_gateway.py",
        &["--requests", "4"],
    );
    let _docker_cg = FakeContainerCgroup::enter(
        test,
        &format!("system.slice/docker-{docker_id}.scope"),
        docker.host_pid,
    );
    // On the host, in no container: left out by the rules. It runs until
    // the end of the test (killed there): it must be a live loop when the
    // metrics are read.
    let host_script = dir.join("host_loop.py");
    std::fs::write(
        &host_script,
        "import asyncio, time\n\
         async def main():\n\
         \x20   for _ in range(1000):\n\
         \x20       await asyncio.sleep(0.05)\n\
         \x20       time.sleep(0.06)\n\
         asyncio.run(main())\n",
    )
    .unwrap();
    let host = Victim::spawn(Command::new(PY).arg(&host_script));
    let host_pid = host.pid();
    // On the host too, and no loop: three waits in `poll` on a pipe (fewer
    // than a poll-based loop's election takes; `select` with no fds would
    // be a sleep, not a wait), then a long sleep. Left out when it
    // appears, its waits must not reach the kernel side at all.
    let idle = Victim::spawn(Command::new(PY).args([
        "-c",
        "import os, select, time\nr, w = os.pipe()\np = select.poll()\np.register(r)\n\
         for _ in range(3):\n    p.poll(50)\ntime.sleep(600)\n",
    ]));
    // Include rules: each included process gets its own wait uprobes when
    // the daemon sees it match: the victims once the upkeep's round of the
    // left-out processes (64 a second) sees their move into the
    // containers' cgroups; their stalls start after.
    let probed = sample(
        &wait_metrics(
            &mut d,
            &dir.path,
            "the two containerized victims' own wait uprobes",
            Duration::from_secs(15),
            |f| sample(f, "stallprof_wait_probed_processes", &[]).unwrap_or(0.0) >= 2.0,
        ),
        "stallprof_wait_probed_processes",
        &[],
    );
    pod.go();
    docker.go();
    pod.wait(Duration::from_secs(60));
    docker.wait(Duration::from_secs(60));
    let (pod_pid, docker_pid) = (pod.host_pid.to_string(), docker.host_pid.to_string());
    let fams = wait_metrics(
        &mut d,
        &dir.path,
        "both containerized victims' stalls, the refused interpreter's problem and the host loop left out",
        Duration::from_secs(20),
        |f| {
            sample(
                f,
                "stallprof_stall_duration_seconds_count",
                &[("pid", &pod_pid)],
            )
            .unwrap_or(0.0)
                >= 4.0
                && sample(
                    f,
                    "stallprof_stall_duration_seconds_count",
                    &[("pid", &docker_pid)],
                )
                .unwrap_or(0.0)
                    >= 4.0
                && sample(f, "stallprof_runtime_problems", &[("pid", &docker_pid)]).unwrap_or(0.0)
                    >= 1.0
                && sample(f, "stallprof_excluded_processes", &[]).unwrap_or(0.0) >= 1.0
        },
    );
    let labels_of = |pid: &str| {
        fams.iter()
            .flat_map(|f| f["samples"].as_array().unwrap().iter())
            .find(|s| {
                s["name"] == "stallprof_stall_duration_seconds_count" && s["labels"]["pid"] == pid
            })
            .map(|s| s["labels"].clone())
            .unwrap_or_default()
    };
    let (pod_labels, docker_labels) = (labels_of(&pod_pid), labels_of(&docker_pid));
    let pod_log = read_log(&pod.log);
    let docker_log = read_log(&docker.log);
    let mut c = Checks::new(format!(
        "pod victim {pod_pid}: labels {pod_labels}\ndocker victim {docker_pid}: labels {docker_labels}"
    ));
    c.check(pod_labels["container"] == pod_id[..12], || {
        "pod victim's container label".into()
    });
    c.check(pod_labels["pod"] == uid.as_str(), || {
        "pod victim's pod label".into()
    });
    c.check(pod_labels["comm"] == "python3.14", || {
        "pod victim's comm".into()
    });
    c.check(docker_labels["container"] == docker_id[..12], || {
        "docker victim's container label".into()
    });
    c.check(docker_labels["pod"] == "", || {
        "docker victim has a pod label".into()
    });
    c.check(
        sample(&fams, "stallprof_runtime_problems", &[("pid", &pod_pid)]) == Some(0.0),
        || "the readable interpreter has a runtime problem".into(),
    );
    let host_series = sample(
        &fams,
        "stallprof_stall_duration_seconds_count",
        &[("pid", &host_pid.to_string())],
    );
    c.check(host_series.is_none(), || {
        format!(
            "the host process {host_pid} is not in the included pod or container, yet it has series"
        )
    });
    // Left out, it must not pay for being watched: no switch or sampling
    // events on its loop thread (every thread carrying them is a reported
    // process's loop thread), and the kernel side skips its waits.
    let watched = sample(&fams, "stallprof_watched_threads", &[]).unwrap_or(-1.0);
    let tracked = sample(&fams, "stallprof_tracked_threads", &[]).unwrap_or(-1.0);
    c.check(watched >= 0.0 && watched <= tracked, || {
        format!(
            "{watched} threads carry switch/sampling events but only {tracked} loop threads are reported: \
             the left-out host loop {host_pid} is still watched"
        )
    });
    // With include rules the uprobes are on the included processes only:
    // no wait of the left-out host loop, nor of the process that polled
    // three times, reached the kernel side (not even to be skipped).
    let left_out_waits = sample(
        &fams,
        "stallprof_kernel_filtered_total",
        &[("what", "left_out_waits")],
    )
    .unwrap_or(0.0);
    c.check(left_out_waits == 0.0, || {
        format!(
            "stallprof_kernel_filtered_total{{what=\"left_out_waits\"}} is {left_out_waits}: waits of \
             left-out processes ({host_pid}, {}) reached the kernel side, so they carry wait uprobes",
            idle.pid()
        )
    });
    // Read before the victims ran (they have exited since).
    c.check(probed == Some(2.0), || {
        format!("{probed:?} processes carried their own wait uprobes, not the two included victims")
    });
    c.check(
        sample(
            &fams,
            "stallprof_probes",
            &[("part", "wait_uprobes"), ("mode", "per_process")],
        ) == Some(1.0),
        || "stallprof_probes does not say the wait uprobes are per process".into(),
    );
    let left_out = left_out_tgids(d.prof.pid());
    c.check(
        !left_out.contains(&pod.host_pid) && !left_out.contains(&docker.host_pid),
        || format!("an included victim is in LEFT_OUT: {left_out:?}"),
    );
    println!(
        "DAEMON  containers: pod victim {pod_pid} container={} pod={} stalls={:?}; docker victim {docker_pid} container={} stalls={:?} runtime_problems={:?}; host {host_pid} series={host_series:?}",
        pod_labels["container"],
        pod_labels["pod"],
        sample(
            &fams,
            "stallprof_stall_duration_seconds_count",
            &[("pid", &pod_pid)]
        ),
        docker_labels["container"],
        sample(
            &fams,
            "stallprof_stall_duration_seconds_count",
            &[("pid", &docker_pid)]
        ),
        sample(&fams, "stallprof_runtime_problems", &[("pid", &docker_pid)])
    );

    d.prof.signal(libc::SIGTERM);
    let run = d.prof.wait(Duration::from_secs(30));
    c.check(run.status.success(), || {
        format!("daemon after SIGTERM:\n{}", run.describe())
    });
    drop(host);
    let data = dir.path.join("data");

    // The pod victim's report: container, namespace ids, Python frames.
    let reports = reports_of(&data, "python3.14", pod.host_pid);
    c.check(!reports.is_empty(), || "no report of the pod victim".into());
    let ready = pod_log
        .iter()
        .find(|r| r["kind"] == "ready")
        .expect("ready");
    for r in &reports {
        c.check(r["container"]["id"] == pod_id.as_str(), || {
            format!("report container {}", r["container"])
        });
        c.check(r["container"]["pod_uid"] == uid.as_str(), || {
            format!("report container {}", r["container"])
        });
        c.check(r["container"]["runtime"] == "containerd", || {
            format!("report container {}", r["container"])
        });
        c.check(r["ns_pid"] == ready["pid"], || {
            format!("report ns_pid {}, logged pid {}", r["ns_pid"], ready["pid"])
        });
    }
    let stalls: Vec<&Value> = reports
        .iter()
        .flat_map(|r| r["stalls"].as_array().unwrap())
        .collect();
    let requests: Vec<&Value> = pod_log.iter().filter(|r| r["kind"] == "request").collect();
    c.check(requests.len() == 4, || {
        format!("pod victim log: {pod_log:?}")
    });
    for q in &requests {
        let (start, end) = (
            q["start_ns"].as_u64().unwrap(),
            q["end_ns"].as_u64().unwrap(),
        );
        let hit = stalls.iter().find(|s| {
            s["ns_tid"] == q["tid"]
                && s["start_ns"].as_u64().unwrap() <= start
                && end <= s["end_ns"].as_u64().unwrap()
        });
        let named = hit.is_some_and(|s| {
            s["stacks"].as_array().into_iter().flatten().any(|st| {
                st["frames"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|f| f["kind"] == "python" && f["name"] == "Gateway.load_tokenizer")
            })
        });
        c.check(named, || {
            format!(
                "request {} (tid {} in its namespace): {}",
                q["req"],
                q["tid"],
                if hit.is_some() {
                    "its stall has no Gateway.load_tokenizer frame"
                } else {
                    "no stall with that ns_tid covers it"
                }
            )
        });
    }

    // The refused interpreter's report says so plainly, its stalls native.
    let reports = reports_of(&data, "python3.16", docker.host_pid);
    c.check(!reports.is_empty(), || {
        "no report of the docker victim".into()
    });
    for r in &reports {
        c.check(r["container"]["runtime"] == "docker", || {
            format!("report container {}", r["container"])
        });
        let p = &r["runtime_problems"][0];
        c.check(p["runtime"] == "cpython 3.16.0", || {
            format!("runtime_problems {}", r["runtime_problems"])
        });
        c.check(
            p["remedy"]
                .as_str()
                .is_some_and(|s| s.contains("3.10-3.15")),
            || format!("runtime_problems {}", r["runtime_problems"]),
        );
    }
    let docker_requests = docker_log.iter().filter(|r| r["kind"] == "request").count();
    c.check(docker_requests == 4, || {
        format!("docker victim log: {docker_log:?}")
    });
    c.finish();
}

// ---------------------------------------------------------------------------
// Issue 13, item 5: the HTTP side under hostile clients

/// Raises this test process's open-file limit (each held connection is one).
fn raise_nofile(want: u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: l is a valid rlimit for getrlimit/setrlimit to fill and read.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        if l.rlim_cur < want {
            l.rlim_cur = want;
            l.rlim_max = l.rlim_max.max(want);
            assert_eq!(
                libc::setrlimit(libc::RLIMIT_NOFILE, &l),
                0,
                "raising RLIMIT_NOFILE to {want}"
            );
        }
    }
}

/// One GET over any stream, with optional extra header lines: (status, body).
fn raw_get(mut s: impl Read + Write, path: &str, extra: &str) -> std::io::Result<(u16, Vec<u8>)> {
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{extra}\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let status = String::from_utf8_lossy(&buf[..split])
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, buf[split + 4..].to_vec()))
}

/// Issue 13: 500 idle and 50 slow-header connections held open do not stop
/// `/metrics` (each answer under a second); the header and idle timeouts
/// close them; `/reports/` serves a planted regular file, streamed whole,
/// but not a symlink (to a file outside or a directory), a FIFO, `..`, and
/// nothing blocks on the FIFO.
#[test]
fn daemon_http_held_connections_and_planted_files() {
    let Some(case) = Case::begin(
        "daemon_http_held_connections_and_planted_files",
        "daemon-http",
    ) else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    raise_nofile(4096);
    let cfg = case.config("window = \"1h\"\n[http]\nheader_timeout = \"3s\"\nidle_timeout = \"5s\"\nmax_connections = 2000\n",
    );
    let d = start_daemon(&cfg, port);
    let mut c = Checks::new("daemon HTTP under held connections");

    // --- Planted files in the data directory.
    let data = dir.join("data");
    let proc_dir = data.join("20250101T000000Z/victim-1");
    std::fs::create_dir_all(&proc_dir).unwrap();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(proc_dir.join("stalls.json"), &big).unwrap();
    let canary = dir.join("canary.json");
    std::fs::write(&canary, b"canary: must not be served").unwrap();
    std::os::unix::fs::symlink(&canary, proc_dir.join("stalls.svg")).unwrap();
    std::os::unix::fs::symlink(&proc_dir, data.join("20250101T000000Z/link-1")).unwrap();
    let fifo = std::ffi::CString::new(proc_dir.join("stalls.folded").to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    for (path, want) in [
        ("/reports/20250101T000000Z/victim-1/stalls.json", 200),
        ("/reports/20250101T000000Z/victim-1/stalls.svg", 404),
        ("/reports/20250101T000000Z/link-1/stalls.json", 404),
        ("/reports/20250101T000000Z/victim-1/stalls.folded", 403),
        ("/reports/20250101T000000Z/../../canary.json", 404),
    ] {
        let t0 = Instant::now();
        let got = http_get(port, path, Duration::from_secs(5));
        let took = t0.elapsed();
        match got {
            Ok((st, body)) => {
                c.check(st == want, || {
                    format!("GET {path}: status {st}, want {want}")
                });
                if want == 200 {
                    c.check(body == big, || {
                        format!("GET {path}: {} bytes, want the planted 3 MB", body.len())
                    });
                } else {
                    c.check(!body.windows(6).any(|w| w == b"canary"), || {
                        format!("GET {path} served the canary")
                    });
                }
            }
            Err(e) => c.fail(format!("GET {path}: {e} after {took:?} (blocked?)")),
        }
        c.check(took < Duration::from_secs(2), || {
            format!("GET {path} took {took:?}")
        });
    }

    // --- 500 idle connections and 50 that send half a request's headers.
    let mut idle = Vec::new();
    for _ in 0..500 {
        idle.push(TcpStream::connect(("127.0.0.1", port)).unwrap());
    }
    let mut slow = Vec::new();
    for _ in 0..50 {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: loc").unwrap();
        slow.push(s);
    }
    let held_at = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..5 {
        let t0 = Instant::now();
        let r = http_get(port, "/metrics", Duration::from_secs(5));
        let took = t0.elapsed();
        c.check(
            r.as_ref().is_ok_and(|(st, b)| *st == 200 && !b.is_empty()),
            || format!("/metrics #{i} with 550 connections held: {r:?}"),
        );
        c.check(took < Duration::from_secs(1), || {
            format!("/metrics #{i} with 550 connections held took {took:?}")
        });
        std::thread::sleep(Duration::from_millis(100));
    }
    c.check(held_at.elapsed() < Duration::from_secs(3), || {
        "the /metrics checks ran past the header timeout".into()
    });

    // --- The timeouts close them: slow headers after 3 s, idle after 5 s.
    let closed_by = |mut s: &TcpStream, by: Duration| -> bool {
        let left = by
            .saturating_sub(held_at.elapsed())
            .max(Duration::from_millis(10));
        s.set_read_timeout(Some(left)).unwrap();
        let mut b = [0u8; 512];
        loop {
            match s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue, // a 408 before the close is fine
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    };
    let slow_open = slow
        .iter()
        .filter(|s| !closed_by(s, Duration::from_secs(6)))
        .count();
    c.check(slow_open == 0, || {
        format!("{slow_open} of 50 slow-header connections still open 6 s in (header_timeout 3s)")
    });
    let idle_open = idle
        .iter()
        .filter(|s| !closed_by(s, Duration::from_secs(9)))
        .count();
    c.check(idle_open == 0, || {
        format!("{idle_open} of 500 idle connections still open 9 s in (idle_timeout 5s)")
    });
    c.check(metrics_text(port).contains("stallprof_build_info"), || {
        "/metrics after the held connections closed".into()
    });

    d.prof.signal(libc::SIGTERM);
    let Daemon { prof, .. } = d;
    let run = prof.wait(Duration::from_secs(30));
    c.check(run.status.success(), || {
        format!("SIGTERM: {}", run.describe())
    });
    c.finish();
}

/// Issue 13: `http.token_file` and `listen = "unix:PATH"`: the socket is
/// 0600 and root's, every request but `/healthz` needs the bearer token
/// (401 without it, or with a wrong one), and the socket is removed on exit;
/// `max_connections` closes connections beyond it at once.
#[test]
fn daemon_http_token_and_unix_socket() {
    let Some(case) = Case::begin("daemon_http_token_and_unix_socket", "daemon-token") else {
        return;
    };
    let dir = &case.dir;
    let sock = dir.join("sp.sock");
    let token = dir.join("token");
    std::fs::write(&token, "s3cret-token-0123456789abcdef\n").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let cfg = dir.join("daemon.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"unix:{}\"\ndata_dir = \"{}\"\n[http]\ntoken_file = \"{}\"\nmax_connections = 4\n",
            sock.display(),
            dir.join("data").display(),
            token.display()
        ),
    )
    .unwrap();
    let mut prof = Profiler::spawn(&[
        "daemon".to_string(),
        "--config".into(),
        cfg.display().to_string(),
    ]);
    let connect = || std::os::unix::net::UnixStream::connect(&sock);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(out) = prof.try_finished() {
            panic!(
                "stallprof daemon exited while starting:\n{}",
                out.describe()
            );
        }
        if connect()
            .and_then(|s| raw_get(s, "/healthz", ""))
            .is_ok_and(|(st, _)| st == 200)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no answer on {} within 30 s",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut c = Checks::new("daemon token and unix socket");
    let m = std::fs::symlink_metadata(&sock).unwrap();
    use std::os::unix::fs::MetadataExt;
    c.check(m.mode() & 0o777 == 0o600 && m.uid() == 0, || {
        format!(
            "socket mode {:o} uid {}, want 0600 root",
            m.mode() & 0o777,
            m.uid()
        )
    });
    for (auth, want) in [
        ("", 401),
        ("Authorization: Bearer wrong-token-0123456789abcde\r\n", 401),
        (
            "Authorization: Bearer s3cret-token-0123456789abcdef\r\n",
            200,
        ),
    ] {
        let r = connect().and_then(|s| raw_get(s, "/metrics", auth));
        c.check(r.as_ref().is_ok_and(|(st, _)| *st == want), || {
            format!("/metrics with {auth:?}: {r:?}, want {want}")
        });
    }
    let r = connect().and_then(|s| raw_get(s, "/reports/a/b/stalls.json", ""));
    c.check(r.as_ref().is_ok_and(|(st, _)| *st == 401), || {
        format!("/reports without the token: {r:?}")
    });
    // Four held connections fill max_connections = 4: a fifth is closed at
    // once, and once they go, requests are served again.
    let held: Vec<_> = (0..4).map(|_| connect().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let r = connect().and_then(|s| {
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        raw_get(s, "/healthz", "")
    });
    c.check(r.is_err() && t0.elapsed() < Duration::from_secs(2), || {
        format!(
            "a fifth connection over max_connections = 4: {r:?} after {:?}",
            t0.elapsed()
        )
    });
    drop(held);
    // Served again once the daemon has seen them close: asked until then.
    let deadline = Instant::now() + Duration::from_secs(5);
    let r = loop {
        let r = connect().and_then(|s| raw_get(s, "/healthz", ""));
        if r.as_ref().is_ok_and(|(st, _)| *st == 200) || Instant::now() >= deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    c.check(r.as_ref().is_ok_and(|(st, _)| *st == 200), || {
        format!("/healthz after the held connections closed: {r:?}")
    });

    prof.signal(libc::SIGTERM);
    let run = prof.wait(Duration::from_secs(30));
    c.check(run.status.success(), || {
        format!("SIGTERM: {}", run.describe())
    });
    c.check(!sock.exists(), || "the socket is left after exit".into());
    c.finish();
}

/// Issue 34: a service's workers are one group in the daemon's reports.
/// A Python parent (waiting on its children, as a pre-fork server's
/// supervisor does) starts two workers, each an asyncio loop frozen by
/// blocking calls (victims/py_blocking_client.py), in the parent's cgroup.
/// After SIGTERM flushes the window, its services.json lists one group
/// named after the parent, `python3.11 (pid P): 2 workers`, with both
/// workers, each with its own stalls and report directory, and the group's
/// stalls their sum.
#[test]
fn daemon_groups_a_services_workers() {
    let Some(case) = Case::begin("daemon_groups_a_services_workers", "daemon-service") else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    // A one-hour window: everything lands in the window SIGTERM flushes.
    let cfg = case.config("window = \"1h\"\n");
    let mut d = start_daemon(&cfg, port);
    let parent = dir.join("service.py");
    // Each worker dies with the parent (PR_SET_PDEATHSIG), so dropping the
    // parent ends the service.
    std::fs::write(
        &parent,
        "import ctypes, signal, subprocess, sys\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         def die_with_parent():\n\
         \x20   libc.prctl(1, signal.SIGKILL)\n\
         client, start = sys.argv[1], sys.argv[2]\n\
         workers = [subprocess.Popen([sys.executable, client, log, '--start-file', start,\n\
         \x20                           '--rounds', '2', '--linger'], preexec_fn=die_with_parent)\n\
         \x20          for log in sys.argv[3:]]\n\
         for w in workers:\n\
         \x20   w.wait()\n",
    )
    .unwrap();
    let start = dir.join("start");
    let logs = [dir.join("w1.log"), dir.join("w2.log")];
    assert!(
        Path::new(PY).exists(),
        "{PY} is needed (apt-get install python3.11)"
    );
    let mut service = Victim::spawn(
        Command::new(PY)
            .arg(&parent)
            .arg(victims_dir().join("py_blocking_client.py"))
            .arg(&start)
            .args(&logs),
    );
    let supervisor = service.pid();
    let workers: Vec<u32> = logs
        .iter()
        .map(|l| {
            wait_for_log_kind(l, "ready", Duration::from_secs(20))["pid"]
                .as_u64()
                .unwrap() as u32
        })
        .collect();
    wait_metrics(
        &mut d,
        &dir.path,
        "both workers' loop threads",
        Duration::from_secs(15),
        |f| workers.iter().all(|&w| loop_threads(f, w) >= 1.0),
    );
    std::thread::sleep(Duration::from_millis(1000)); // CPython detection
    std::fs::write(&start, b"go").unwrap();
    let truths: Vec<Vec<Truth>> = logs
        .iter()
        .map(|l| {
            wait_for_log_kind(l, "done", Duration::from_secs(30));
            python_truth(&read_log(l))
        })
        .collect();
    let counted: Vec<(u32, usize)> = workers
        .iter()
        .zip(&truths)
        .map(|(&w, t)| (w, t.len()))
        .collect();
    wait_stalls_counted(&mut d, &dir.path, &counted);
    service.assert_running();
    d.prof.signal(libc::SIGTERM);
    let run = d.prof.wait(Duration::from_secs(30));
    drop(service);
    let mut c = Checks::new(format!(
        "supervisor {supervisor}, workers {workers:?}; daemon:\n{}",
        run.describe()
    ));
    c.check(run.status.success(), || {
        "the daemon failed after SIGTERM".into()
    });
    let data = dir.join("data");
    let files: Vec<PathBuf> = std::fs::read_dir(&data)
        .into_iter()
        .flatten()
        .flatten()
        .map(|w| w.path().join("services.json"))
        .filter(|p| p.is_file())
        .collect();
    assert_eq!(
        files.len(),
        1,
        "one window with services.json in {}: {files:?}",
        data.display()
    );
    let text = std::fs::read_to_string(&files[0]).unwrap();
    eprintln!("{}:\n{text}", files[0].display());
    let v: Value = serde_json::from_str(&text).unwrap();
    let ours: Vec<&Value> = v["services"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["parent_pid"] == supervisor)
        .collect();
    assert_eq!(ours.len(), 1, "one group under the supervisor:\n{text}");
    let s = ours[0];
    c.check(
        s["name"].as_str() == Some(&format!("python3.11 (pid {supervisor}): 2 workers")),
        || format!("the group's name:\n{text}"),
    );
    let listed: Vec<u32> = s["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["pid"].as_u64().unwrap() as u32)
        .collect();
    let mut want = workers.clone();
    want.sort_unstable();
    c.check(listed == want, || {
        format!("the group's workers {listed:?}, want {want:?}:\n{text}")
    });
    let mut sum = 0;
    for w in s["workers"].as_array().unwrap() {
        let pid = w["pid"].as_u64().unwrap() as u32;
        let n = w["stalls"].as_u64().unwrap();
        sum += n;
        let reported = report_stalls(&data, "python3.11", pid).len() as u64;
        c.check(n >= 1 && n == reported, || {
            format!("worker {pid}: {n} stalls in services.json, {reported} in its report:\n{text}")
        });
        c.check(
            w["dir"].as_str() == Some(&format!("python3.11-{pid}")),
            || format!("worker {pid}'s report directory:\n{text}"),
        );
    }
    c.check(s["stalls"].as_u64() == Some(sum), || {
        format!("the group's stalls are not its workers' sum:\n{text}")
    });
    c.finish();
}

/// Issue 36 item 3: the daemon sends each stall it keeps as a span to the
/// collector `[otlp]` names (oteltap, http/protobuf, pinned in the test
/// venv), one span per stall of the victim, each as long as the victim's
/// call, and counts them (`stallprof_otlp_spans_total{outcome}`).
#[test]
fn daemon_exports_stalls_over_otlp() {
    let Some(case) = Case::begin("daemon_exports_stalls_over_otlp", "daemon-otlp") else {
        return;
    };
    let (dir, port) = (&case.dir, case.port);
    let tap = Oteltap::start(&dir.path);
    let cfg = case.config(&format!(
        "window = \"1h\"\n[otlp]\nendpoint = \"{}\"\n",
        tap.endpoint()
    ));
    let mut d = start_daemon(&cfg, port);
    let (log, start) = (dir.join("p.log"), dir.join("p.start"));
    let p = spawn_python(&log, &start, 2);
    let pid = p.pid();
    wait_metrics(
        &mut d,
        &dir.path,
        "the victim's loop thread",
        Duration::from_secs(15),
        |f| loop_threads(f, pid) >= 1.0,
    );
    std::thread::sleep(Duration::from_millis(1000)); // CPython detection
    std::fs::write(&start, b"go").unwrap();
    wait_for_log_kind(&log, "done", Duration::from_secs(30));
    let truth = python_truth(&read_log(&log));
    wait_stalls_counted(&mut d, &dir.path, &[(pid, truth.len())]);
    let exported = |f: &[Value]| {
        sample(f, "stallprof_otlp_spans_total", &[("outcome", "exported")]).unwrap_or(0.0)
    };
    let fams = wait_metrics(
        &mut d,
        &dir.path,
        "the victim's stalls exported",
        Duration::from_secs(15),
        |f| exported(f) >= truth.len() as f64,
    );
    let spans = tap.stop_stall_spans(Duration::from_millis(300));
    let mut c = Checks::new(format!(
        "Python victim:\n{}\nreceived {} spans",
        truth_table(&truth),
        spans.len()
    ));
    let tid = |s: &Value| {
        s["attributes"].as_array().and_then(|a| {
            a.iter()
                .find(|kv| kv["key"] == "thread.id")
                .and_then(|kv| kv["value"]["intValue"].as_str()?.parse::<u64>().ok())
        })
    };
    let nanos = |v: &Value| v.as_str().and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    // Wall-clock spans: as long as the victim's calls (its own clock), each
    // call's within 15 ms (a stall also holds the loop's own work around it).
    let victim: Vec<&Value> = spans
        .iter()
        .filter(|s| tid(s) == Some(truth[0].tid))
        .collect();
    c.check(victim.len() == truth.len(), || {
        format!(
            "{} spans of the victim's thread, {} calls",
            victim.len(),
            truth.len()
        )
    });
    for t in &truth {
        let want = t.end_ns - t.start_ns;
        c.check(
            victim.iter().any(|s| {
                let got = nanos(&s["endTimeUnixNano"]) - nanos(&s["startTimeUnixNano"]);
                got + 2 * MS >= want && got <= want + 15 * MS
            }),
            || format!("no span as long as {} ({} ms)", t.who(), ms(want)),
        );
    }
    c.check(
        sample(
            &fams,
            "stallprof_otlp_spans_total",
            &[("outcome", "failed")],
        )
        .unwrap_or(0.0)
            == 0.0,
        || "spans counted failed with the collector up".into(),
    );
    drop(p);
    d.prof.signal(libc::SIGTERM);
    let run = d.prof.wait(Duration::from_secs(30));
    c.check(run.status.success(), || {
        format!("the daemon's exit: {}", run.describe())
    });
    c.finish();
}
