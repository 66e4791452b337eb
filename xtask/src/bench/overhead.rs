//! Section 2, `overhead`: an asyncio HTTP service (bench/http_service.py)
//! under wrk on loopback — requests/s, p99 and CPU per request bare, under
//! `stallprof record`, under the daemon and under py-spy at the same rate;
//! configurations interleaved round by round, ratios to the same round's
//! bare run. The per-iteration and per-program costs behind those ratios
//! are in [`super::loop_cost`].
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{
    DAEMON_PORT, Env, Glance, Plan, STALLPROF_DEFAULT_HZ,
    loop_cost::{bpf_cost, iteration_cost, verdict_ratio},
    measure::{
        Proc, commands_block, cpu_secs, median, spread, task_cpu_secs, vm_hwm_mib, wait_file,
    },
    pct,
};

#[derive(Clone, Copy, PartialEq)]
enum Cfg {
    Bare,
    Record,
    RecordUngated,
    Daemon,
    PySpy,
    PySpyNb,
    /// Bare again at the end of the round: the noise floor of a ratio.
    BareAgain,
}

impl Cfg {
    fn name(self) -> &'static str {
        match self {
            Cfg::Bare => "bare",
            Cfg::BareAgain => "bare again, end of round (noise floor)",
            Cfg::Record => "stallprof record (defaults: 999 Hz, 50 ms, gate 2 ms)",
            Cfg::RecordUngated => "stallprof record --sample-after 0 (no gate: every sample)",
            Cfg::Daemon => "stallprof daemon (defaults: 199 Hz, 50 ms, host-wide)",
            Cfg::PySpy => "py-spy record -r 999 (blocking)",
            Cfg::PySpyNb => "py-spy record -r 999 --nonblocking",
        }
    }
}

struct OvhRun {
    rps: f64,
    p99_ms: f64,
    /// The service's own CPU time (utime+stime, BPF run in its context
    /// included) per request served during the measurement, in µs.
    svc_us_per_req: Option<f64>,
    agent_cpu_pct: Option<f64>,
    agent_rss_mib: Option<f64>,
}

/// Requests wrk completed: its "N requests in T" line.
fn wrk_requests(text: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.contains(" requests in "))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub(super) fn parse_wrk(text: &str) -> Option<(f64, f64)> {
    let rps = text
        .lines()
        .find(|l| l.starts_with("Requests/sec:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let p99 = text
        .lines()
        .find(|l| l.trim_start().starts_with("99%"))?
        .split_whitespace()
        .nth(1)?;
    let p99_ms = if let Some(x) = p99.strip_suffix("us") {
        x.parse::<f64>().ok()? / 1000.0
    } else if let Some(x) = p99.strip_suffix("ms") {
        x.parse().ok()?
    } else if let Some(x) = p99.strip_suffix('s') {
        x.parse::<f64>().ok()? * 1000.0
    } else {
        return None;
    };
    Some((rps, p99_ms))
}

pub(super) fn daemon_cmd(env: &Env, data: &Path) -> Command {
    let mut c = Command::new(&env.bin);
    c.args([
        "-v",
        "daemon",
        "--listen",
        &format!("127.0.0.1:{DAEMON_PORT}"),
        "--data-dir",
    ])
    .arg(data);
    c
}

fn overhead_once(env: &Env, cfg: Cfg, secs: u32, dir: &Path) -> Result<OvhRun> {
    fs::create_dir_all(dir)?;
    let port_file = dir.join("port");
    let _ = fs::remove_file(&port_file);
    let (_server, pid, url) = start_http_service(env, &port_file)?;

    let mut agent = match cfg {
        Cfg::Bare | Cfg::BareAgain => None,
        Cfg::Record | Cfg::RecordUngated => {
            let mut c = Command::new(&env.bin);
            c.args(["-v", "record", "-q", "--pid", &pid.to_string(), "-o"])
                .arg(dir.join("out"));
            if cfg == Cfg::RecordUngated {
                c.args(["--sample-after", "0"]);
            }
            let mut p = Proc::spawn(&mut c)?;
            p.wait_line("attached to", Duration::from_secs(20))?;
            Some(p)
        }
        Cfg::Daemon => {
            // An idle asyncio server parks in one endless epoll_wait: the
            // daemon finds it once traffic makes it loop (after the warm-up).
            let mut p = Proc::spawn(&mut daemon_cmd(env, &dir.join("daemon-data")))?;
            p.wait_line("probes attached host-wide", Duration::from_secs(30))?;
            Some(p)
        }
        Cfg::PySpy | Cfg::PySpyNb => {
            let mut c = Command::new(&env.pyspy);
            c.args([
                "record",
                "-r",
                &STALLPROF_DEFAULT_HZ.to_string(),
                "-f",
                "raw",
                "-o",
            ])
            .arg(dir.join("pyspy.raw"));
            if cfg == Cfg::PySpyNb {
                c.arg("--nonblocking");
            }
            c.args(["--pid", &pid.to_string()]);
            let p = Proc::spawn(&mut c)?;
            thread::sleep(Duration::from_millis(500));
            Some(p)
        }
    };
    // Warm-up (connections, the agent's first-seen work), then the measurement.
    let _ = wrk().args(["-t1", "-c32", "-d1s", &url]).output();
    if cfg == Cfg::Daemon {
        let a = agent.as_mut().unwrap();
        a.wait_line(&format!("monitoring pid {pid} "), Duration::from_secs(10))?;
    }
    let pre = agent.as_ref().and_then(|a| cpu_secs(a.pid(), env.clk_tck));
    let svc_pre = task_cpu_secs(pid);
    let t0 = Instant::now();
    let out = wrk()
        .args(["-t1", "-c32", &format!("-d{secs}s"), "--latency", &url])
        .output()?;
    let wall = t0.elapsed().as_secs_f64();
    let svc_post = task_cpu_secs(pid);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let svc_us_per_req = match (svc_pre, svc_post, wrk_requests(&text)) {
        (Some(a), Some(b), Some(n)) if n > 0.0 => Some((b - a) * 1e6 / n),
        _ => None,
    };
    fs::write(dir.join("wrk.txt"), &text)?;
    let (agent_cpu_pct, agent_rss_mib) = match &agent {
        Some(a) => (
            cpu_secs(a.pid(), env.clk_tck)
                .zip(pre)
                .map(|(b, a0)| (b - a0) / wall * 100.0),
            vm_hwm_mib(a.pid()),
        ),
        None => (None, None),
    };
    if let Some(a) = agent.as_mut() {
        a.stop(Duration::from_secs(30));
        fs::write(dir.join("agent.log"), a.text())?;
    }
    let (rps, p99_ms) =
        parse_wrk(&text).with_context(|| format!("unparsable wrk output:\n{text}"))?;
    Ok(OvhRun {
        rps,
        p99_ms,
        svc_us_per_req,
        agent_cpu_pct,
        agent_rss_mib,
    })
}

/// The load generator, pinned to CPU 1 (the service runs on CPU 0).
pub(super) fn wrk() -> Command {
    let mut c = Command::new("taskset");
    c.args(["-c", "1", "wrk"]);
    c
}

/// Start bench/http_service.py pinned to CPU 0: (process, pid, url).
pub(super) fn start_http_service(env: &Env, port_file: &Path) -> Result<(Proc, u32, String)> {
    let _ = fs::remove_file(port_file);
    let server = Proc::spawn(
        Command::new("taskset")
            .args(["-c", "0"])
            .arg(&env.python)
            .arg(env.root.join("bench/http_service.py"))
            .arg(port_file),
    )?;
    let info = wait_file(port_file, Duration::from_secs(10))?;
    let mut it = info.split_whitespace();
    let port: u16 = it.next().context("port file")?.parse()?;
    let pid: u32 = it.next().context("port file")?.parse()?;
    Ok((server, pid, format!("http://127.0.0.1:{port}/")))
}

pub(super) fn overhead(env: &Env, plan: &Plan, glance: &mut Glance) -> Result<String> {
    eprintln!("bench: section 2, overhead on the target");
    let cfgs = [
        Cfg::Bare,
        Cfg::Record,
        Cfg::RecordUngated,
        Cfg::Daemon,
        Cfg::PySpy,
        Cfg::PySpyNb,
        Cfg::BareAgain,
    ];
    let mut runs: Vec<Vec<Option<OvhRun>>> = (0..cfgs.len()).map(|_| Vec::new()).collect();
    let mut errors = Vec::new();
    for round in 0..plan.ovh_rounds {
        // Bare first in every round, the profiled configurations rotated,
        // bare again last: each configuration sits next to a bare run of
        // the same minute, and the two bare runs show the noise.
        let last = cfgs.len() - 1;
        let mut order: Vec<usize> = (1..last).collect();
        order.rotate_left(round % (last - 1));
        order.insert(0, 0);
        order.push(last);
        for &i in &order {
            let dir = env.work.join(format!("overhead/{round}-{i}"));
            eprintln!("bench: overhead round {round} {}", cfgs[i].name());
            match overhead_once(env, cfgs[i], plan.ovh_secs, &dir) {
                Ok(r) => runs[i].push(Some(r)),
                Err(e) => {
                    eprintln!("bench: {e:#}");
                    errors.push(format!(
                        "- round {round}, {}: {}",
                        cfgs[i].name(),
                        format!("{e:#}").lines().next().unwrap_or("")
                    ));
                    runs[i].push(None);
                }
            }
        }
    }
    let mut s = String::new();
    let _ = writeln!(s, "## 2. Overhead on the target\n");
    let _ = writeln!(
        s,
        "Target: `bench/http_service.py`, an asyncio HTTP/1.1 keep-alive service on 127.0.0.1 (each request \
         JSON-encodes a 40-field object on the loop), loaded by `wrk -t1 -c32 -d{}s --latency` after a 1 s \
         warm-up, with a fresh server per run. {} rounds; each round runs bare first, then the profiled \
         configurations in a rotated order, then bare again. Ratios are each run divided by the same \
         round's first bare run: median (min–max). The service is pinned to CPU 0 (it saturates it: \
         one loop thread) and wrk to CPU 1; the agents are not pinned, so their CPU is taken from wrk's \
         core or the service's, as the scheduler decides. The *bare again* row is the noise floor: \
         on this shared VM, two bare runs a minute apart differ by as much as the spread shown there, \
         so a ratio within that spread of 1 is no measurable overhead, not a proof of none.\n",
        plan.ovh_secs, plan.ovh_rounds
    );
    let _ = writeln!(
        s,
        "| configuration | requests/s | p99 (ms) | throughput ratio | p99 ratio | service CPU per request (µs) | service CPU efficiency | agent CPU % of one core | agent peak RSS (MiB) |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    let mut tp_ratio: BTreeMap<usize, f64> = BTreeMap::new();
    let mut efficiency: BTreeMap<usize, f64> = BTreeMap::new();
    for (i, cfg) in cfgs.iter().enumerate() {
        let ok: Vec<&OvhRun> = runs[i].iter().flatten().collect();
        let rps: Vec<f64> = ok.iter().map(|r| r.rps).collect();
        let p99: Vec<f64> = ok.iter().map(|r| r.p99_ms).collect();
        let mut rr = Vec::new();
        let mut pr = Vec::new();
        let mut er = Vec::new();
        for (a, b) in runs[i].iter().zip(runs[0].iter()) {
            if let (Some(a), Some(b)) = (a, b) {
                rr.push(a.rps / b.rps);
                pr.push(a.p99_ms / b.p99_ms);
                if let (Some(x), Some(y)) = (a.svc_us_per_req, b.svc_us_per_req) {
                    er.push(y / x);
                }
            }
        }
        if !rr.is_empty() {
            tp_ratio.insert(i, median(&rr));
        }
        if !er.is_empty() {
            efficiency.insert(i, median(&er));
        }
        let svc: Vec<f64> = ok.iter().filter_map(|r| r.svc_us_per_req).collect();
        let cpu: Vec<f64> = ok.iter().filter_map(|r| r.agent_cpu_pct).collect();
        let rss: Vec<f64> = ok.iter().filter_map(|r| r.agent_rss_mib).collect();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cfg.name(),
            spread(&rps, 0),
            spread(&p99, 2),
            if i == 0 { "1".into() } else { spread(&rr, 3) },
            if i == 0 { "1".into() } else { spread(&pr, 2) },
            if svc.is_empty() {
                "—".into()
            } else {
                spread(&svc, 1)
            },
            if i == 0 {
                "1".into()
            } else if er.is_empty() {
                "—".into()
            } else {
                spread(&er, 3)
            },
            if cpu.is_empty() {
                "—".into()
            } else {
                spread(&cpu, 1)
            },
            if rss.is_empty() {
                "—".into()
            } else {
                spread(&rss, 0)
            },
        );
    }
    if !errors.is_empty() {
        let _ = writeln!(s, "\nRuns that failed:\n\n{}", errors.join("\n"));
    }
    let med = |i: usize, f: fn(&OvhRun) -> Option<f64>| {
        let v: Vec<f64> = runs[i].iter().flatten().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let verdict = |v: Option<f64>, ok: fn(f64) -> bool| match v {
        Some(x) if ok(x) => "met",
        Some(_) => "missed",
        None => "not measured",
    };
    let rounds = plan.ovh_rounds;
    glance.row(
        &format!(
            "saturated asyncio service: CPU efficiency (bare ÷ attached CPU time per request, median of {rounds} rounds)"
        ),
        pct(efficiency.get(&1).copied()),
        pct(efficiency.get(&3).copied()),
        format!(
            "{} / {} (blocking / --nonblocking)",
            pct(efficiency.get(&4).copied()),
            pct(efficiency.get(&5).copied())
        ),
        format!(
            "≥ 98%: record **{}**, daemon **{}** (noise floor, bare again: {})",
            verdict(efficiency.get(&1).copied(), |x| x >= 0.98),
            verdict(efficiency.get(&3).copied(), |x| x >= 0.98),
            pct(efficiency.get(&(cfgs.len() - 1)).copied())
        ),
    );
    let one = |v: Option<f64>| v.map_or("—".into(), |c| format!("{c:.1}"));
    glance.row(
        "agent CPU while it watches that service (% of one core)",
        one(med(1, |r| r.agent_cpu_pct)),
        one(med(3, |r| r.agent_cpu_pct)),
        format!(
            "{} / {}",
            one(med(4, |r| r.agent_cpu_pct)),
            one(med(5, |r| r.agent_cpu_pct))
        ),
        format!(
            "≤ 2: record **{}**, daemon **{}**",
            verdict(med(1, |r| r.agent_cpu_pct), |x| x <= 2.0),
            verdict(med(3, |r| r.agent_cpu_pct), |x| x <= 2.0)
        ),
    );
    let mib = |v: Option<f64>| v.map_or("—".into(), |c| format!("{c:.0}"));
    glance.row(
        "agent peak RSS while it watches that service (MiB)",
        mib(med(1, |r| r.agent_rss_mib)),
        mib(med(3, |r| r.agent_rss_mib)),
        format!(
            "{} / {}",
            mib(med(4, |r| r.agent_rss_mib)),
            mib(med(5, |r| r.agent_rss_mib))
        ),
        "≤ 64".into(),
    );
    glance.row(
        "that service's throughput (attached ÷ bare requests/s)",
        pct(tp_ratio.get(&1).copied()),
        pct(tp_ratio.get(&3).copied()),
        format!(
            "{} / {}",
            pct(tp_ratio.get(&4).copied()),
            pct(tp_ratio.get(&5).copied())
        ),
        format!(
            "noise floor (bare again): {}",
            pct(tp_ratio.get(&(cfgs.len() - 1)).copied())
        ),
    );
    let rec = tp_ratio.get(&1).copied();
    let dmn = tp_ratio.get(&3).copied();
    let pys = [tp_ratio.get(&4).copied(), tp_ratio.get(&5).copied()];
    let _ = writeln!(s, "\nTargets:\n");
    let _ = writeln!(
        s,
        "- ≥ 99.5% of bare throughput at default settings: `record` {}, daemon {}; the noise floor \
         (bare again / bare) was {} in the same rounds.",
        verdict_ratio(rec),
        verdict_ratio(dmn),
        tp_ratio
            .get(&(cfgs.len() - 1))
            .map_or("not measured".into(), |r| format!("{:.1}%", r * 100.0))
    );
    let best_pyspy = pys
        .iter()
        .flatten()
        .copied()
        .fold(f64::NEG_INFINITY, f64::max);
    let agent_cpu = |i: usize| {
        let v: Vec<f64> = runs[i]
            .iter()
            .flatten()
            .filter_map(|r| r.agent_cpu_pct)
            .collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let _ = writeln!(
        s,
        "- overhead lower than py-spy's at equal sampling rate (999 Hz): throughput: {}; the agent's own CPU: \
         stallprof {} vs py-spy {} / {} (blocking / --nonblocking), % of one core.",
        match rec {
            Some(r) if best_pyspy.is_finite() => format!(
                "stallprof keeps {:.1}% vs py-spy's best {:.1}% — **{}** (within the noise floor above)",
                r * 100.0,
                best_pyspy * 100.0,
                if r > best_pyspy { "met" } else { "missed" }
            ),
            _ => "not measured (runs failed)".into(),
        },
        agent_cpu(1).map_or("—".into(), |c| format!("{c:.1}")),
        agent_cpu(4).map_or("—".into(), |c| format!("{c:.1}")),
        agent_cpu(5).map_or("—".into(), |c| format!("{c:.1}")),
    );
    let _ = writeln!(
        s,
        "\nThe daemon watches every event-loop process on the host, here including wrk itself and whatever \
         the other users of the machine ran; its CPU is its whole cost, not the part due to the service.\n"
    );
    commands_block(
        &mut s,
        "Commands (one round):",
        &[
            "taskset -c 0 $PY bench/http_service.py port.txt &   # writes \"PORT PID TID\"".to_string(),
            "taskset -c 1 wrk -t1 -c32 -d1s http://127.0.0.1:$PORT/        # warm-up".to_string(),
            format!(
                "taskset -c 1 wrk -t1 -c32 -d{}s --latency http://127.0.0.1:$PORT/",
                plan.ovh_secs
            ),
            "# the same, with one of these running (started after the server, stopped with SIGINT after wrk):".to_string(),
            "$SP -v record -q --pid $PID -o out [--sample-after 0]   # measured from its \"attached to\" line".to_string(),
            format!(
                "$SP -v daemon --listen 127.0.0.1:{DAEMON_PORT} --data-dir d   # from its \"monitoring pid $PID\" line"
            ),
            format!("$PYSPY record -r {STALLPROF_DEFAULT_HZ} -f raw -o raw.txt --pid $PID"),
            format!(
                "$PYSPY record -r {STALLPROF_DEFAULT_HZ} -f raw -o raw.txt --nonblocking --pid $PID"
            ),
            "# agent CPU: utime+stime from /proc/$AGENT/stat across the wrk run; RSS: VmHWM from /proc/$AGENT/status".to_string(),
        ],
    );
    let load = match bpf_cost(env, plan.ovh_secs) {
        Ok((t, load)) => {
            s.push_str(&t);
            load
        }
        Err(e) => {
            let _ = writeln!(s, "\nBPF cost accounting failed: {e:#}\n");
            None
        }
    };
    match iteration_cost(env, if plan.quick { 3 } else { 7 }, load.as_ref()) {
        Ok(t) => s.push_str(&t),
        Err(e) => {
            let _ = writeln!(s, "\nPer-iteration cost failed: {e:#}\n");
        }
    }
    Ok(s)
}
