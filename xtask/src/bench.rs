//! `cargo xtask bench`: the benchmark behind docs/benchmarks.md.
//!
//! Not a test: nothing here passes or fails on a number. It measures, on the
//! machine it runs on, and writes what it measured (medians, spreads, the
//! exact commands) into docs/benchmarks.md:
//!
//! One module per section, in the order they run; each says what it
//! measures and how:
//!
//! 1. [`accuracy`] — stalls found and their causes, against each victim's
//!    own log; py-spy and the field report's watchdog beside stallprof.
//! 2. [`overhead`] — a saturated asyncio HTTP service under wrk, bare and
//!    profiled; [`service`] the same service by alternating phases, and
//!    [`loop_cost`] the parts: one loop iteration, one BPF program run.
//! 3. [`host`] — what a process stallprof does not watch pays.
//! 4. [`agent`] — stallprof's own CPU, memory, attach time, event rate.
//! 5. [`scaling`] — those with many threads and many processes.
//!
//! [`measure`] holds what they measure with (child processes, /proc CPU
//! time and peak RSS, medians and spreads); this file the plan, the
//! environment and the page's header.
//!
//! It installs what it needs: py-spy from PyPI into target/bench-venv, wrk
//! and perf from Debian's packages, and builds stallprof (release) and the tokio
//! victim. Raw outputs stay in target/bench/run-<unix time>/.
use std::{
    fmt::Write as _,
    fs,
    path::PathBuf,
    process::Command,
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};

mod accuracy;
mod agent;
mod host;
mod loop_cost;
mod measure;
mod overhead;
mod scaling;
mod service;

const SECTIONS: &[&str] = &["accuracy", "overhead", "host", "agent", "scaling"];
/// Threshold for the accuracy section (the tests' and victims' scale).
const ACC_THRESHOLD_MS: u32 = 20;
/// py-spy's rate in the accuracy section (its default).
const PYSPY_ACC_RATE: u32 = 100;
/// stallprof record's default sampling rate; py-spy runs at it in `overhead`.
const STALLPROF_DEFAULT_HZ: u32 = 999;
const DAEMON_PORT: u16 = 19_437;

struct Plan {
    quick: bool,
    acc_reps: usize,
    ovh_rounds: usize,
    ovh_secs: u32,
    attach_reps: usize,
    scale_reps: usize,
    scale_secs: u32,
}

struct Env {
    root: PathBuf,
    commit: String,
    bin: PathBuf,
    python: String,
    python_version: String,
    pyspy: PathBuf,
    work: PathBuf,
    event_storm: PathBuf,
    loop_cost: PathBuf,
    c_loop: PathBuf,
    tokio_victim: Option<PathBuf>,
    node: Option<String>,
    clk_tck: f64,
}

/// Issue 18's figures from this run, side by side, with py-spy as the
/// anchor: each section adds its rows, [`run`] writes them first.
#[derive(Default)]
struct Glance {
    /// what, `record`, `daemon`, py-spy, target and verdict.
    rows: Vec<[String; 5]>,
}

impl Glance {
    fn row(&mut self, what: &str, record: String, daemon: String, pyspy: String, target: String) {
        self.rows
            .push([what.to_string(), record, daemon, pyspy, target]);
    }

    fn text(&self) -> String {
        if self.rows.is_empty() {
            return String::new();
        }
        let mut s = String::from(
            "## At a glance: the agent's cost (issue 18)\n\nFrom the sections below, this run; medians of interleaved rounds.\n\n\
             | what | stallprof record | stallprof daemon | py-spy (anchor) | target |\n|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                r[0], r[1], r[2], r[3], r[4]
            );
        }
        s.push('\n');
        s
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("—".into(), |r| format!("{:.1}%", r * 100.0))
}

pub fn run(quick: bool, only: &[String]) -> Result<()> {
    for s in only {
        if !SECTIONS.contains(&s.as_str()) {
            bail!("--only {s}: sections are {}", SECTIONS.join(", "));
        }
    }
    let want = |s: &str| only.is_empty() || only.iter().any(|o| o == s);
    if super::unsafe_geteuid() != 0 {
        bail!("the bench needs root (BPF); run it as root");
    }
    let plan = if quick {
        Plan {
            quick,
            acc_reps: 1,
            // Issue 18 judges the service's efficiency on 5 interleaved rounds.
            ovh_rounds: 5,
            ovh_secs: 4,
            attach_reps: 2,
            scale_reps: 1,
            scale_secs: 3,
        }
    } else {
        Plan {
            quick,
            acc_reps: 3,
            ovh_rounds: 8,
            ovh_secs: 5,
            attach_reps: 5,
            scale_reps: 3,
            scale_secs: 5,
        }
    };
    let started = Instant::now();
    let env = prepare()?;
    eprintln!("bench: outputs in {}", env.work.display());

    let mut doc = String::new();
    let mut glance = Glance::default();
    if want("accuracy") {
        doc.push_str(&accuracy::accuracy(&env, &plan)?);
    }
    if want("overhead") {
        doc.push_str(&overhead::overhead(&env, &plan, &mut glance)?);
        doc.push_str(&service::phases(&env, &plan, &mut glance)?);
    }
    if want("host") {
        doc.push_str(&host::host(&env, &plan, &mut glance)?);
    }
    if want("agent") {
        doc.push_str(&agent::agent(&env, &plan, &mut glance)?);
    }
    if want("scaling") {
        doc.push_str(&scaling::scaling(&env, &plan)?);
    }
    let full = header(&env, &plan, only, started.elapsed()) + &glance.text() + &doc;
    fs::write(env.work.join("benchmarks.md"), &full)?;
    let target = env.root.join(if only.is_empty() {
        "target/bench/benchmarks.md"
    } else {
        "target/bench/benchmarks-partial.md"
    });
    fs::write(&target, &full)?;
    eprintln!(
        "bench: wrote {} ({:.0} s)",
        target.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Setup: tools, builds

fn prepare() -> Result<Env> {
    let root = super::root();
    let built = super::build()?;
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let work = root.join(format!("target/bench/run-{stamp}"));
    fs::create_dir_all(&work)?;
    // target/ may be shared with other builds: measure one fixed copy.
    let bin = work.join("stallprof");
    fs::copy(&built, &bin).context("copying the stallprof binary")?;
    let commit = Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(&root)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();

    // The interpreter itself, not a pyenv shim (a shell script that execs it).
    let python =
        super::output(Command::new("python3").args(["-c", "import sys; print(sys.executable)"]))
            .context("the bench needs python3")?
            .trim()
            .to_string();
    let python_version = super::output(Command::new(&python).arg("--version"))?
        .trim()
        .to_string();

    // py-spy from PyPI, in a venv of its own.
    let venv = root.join("target/bench-venv");
    let pyspy = venv.join("bin/py-spy");
    if !pyspy.exists() {
        super::run(Command::new(&python).args(["-m", "venv"]).arg(&venv))?;
        super::run(Command::new(venv.join("bin/pip")).args(["install", "-q", "py-spy"]))?;
    }
    // wrk, and perf (the host section's floor: `perf stat` on one
    // thread), from Debian.
    for (tool, package) in [("wrk", "wrk"), ("perf", "linux-perf")] {
        if Command::new(tool).arg("--version").output().is_err() {
            let ok = Command::new("apt-get")
                .args(["install", "-y", package])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                super::run(Command::new("apt-get").arg("update"))?;
                super::run(Command::new("apt-get").args(["install", "-y", package]))?;
            }
        }
    }
    let event_storm = work.join("event_storm");
    super::run(
        Command::new("cc")
            .args(["-O2", "-pthread", "-o"])
            .arg(&event_storm)
            .arg(root.join("bench/event_storm.c")),
    )?;
    let loop_cost = work.join("loop_cost");
    super::run(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&loop_cost)
            .arg(root.join("bench/loop_cost.c")),
    )?;
    // The C victim as services ship: no frame pointers (the harder unwind).
    let c_loop = work.join("c_loop");
    super::run(
        Command::new("cc")
            .args(["-O1", "-g", "-fomit-frame-pointer", "-pthread", "-o"])
            .arg(&c_loop)
            .arg(root.join("profiler/tests/victims/c_loop.c")),
    )?;
    let tokio_manifest = root.join("profiler/tests/victims/tokio-victim/Cargo.toml");
    let tokio_victim = if tokio_manifest.exists() {
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args(["build", "--release", "--locked", "--manifest-path"])
            .arg(&tokio_manifest)
            .arg("--target-dir")
            .arg(root.join("target/victims"));
        for var in [
            "RUSTFLAGS",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_BUILD_RUSTFLAGS",
            "CARGO_TARGET_DIR",
        ] {
            cmd.env_remove(var);
        }
        match super::run(&mut cmd) {
            Ok(()) => Some(root.join("target/victims/release/tokio-victim")),
            Err(e) => {
                eprintln!("bench: tokio victim not built ({e:#}); its row is skipped");
                None
            }
        }
    } else {
        None
    };
    let node = ["/usr/bin/node", "node"]
        .into_iter()
        .find(|n| {
            Command::new(n)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .map(String::from);
    let clk_tck = super::output(Command::new("getconf").arg("CLK_TCK"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0);
    Ok(Env {
        root,
        commit,
        bin,
        python,
        python_version,
        pyspy,
        work,
        event_storm,
        loop_cost,
        c_loop,
        tokio_victim,
        node,
        clk_tck,
    })
}

// ---------------------------------------------------------------------------
// Processes

fn header(env: &Env, plan: &Plan, only: &[String], took: Duration) -> String {
    let cpus = thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let model = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = super::output(Command::new("uname").arg("-r")).unwrap_or_default();
    let date =
        super::output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"])).unwrap_or_default();
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let pyspy_v = super::output(Command::new(&env.pyspy).arg("--version")).unwrap_or_default();
    let wrk_v = Command::new("wrk")
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_default();
    let node_v = env
        .node
        .as_ref()
        .and_then(|n| super::output(Command::new(n).arg("--version")).ok())
        .unwrap_or_else(|| "not installed".into());
    let mut s = String::new();
    let _ = writeln!(s, "# Benchmarks\n");
    let _ = writeln!(
        s,
        "Generated by `cargo xtask bench{}{}` (xtask/src/bench.rs and a module a section in xtask/src/bench/, helpers in bench/). \
         Every figure below is a measurement from that run, not a target; the targets from the \
         issue are listed next to them with whether this run met them.\n",
        if plan.quick { " --quick" } else { "" },
        only.iter()
            .map(|o| format!(" --only {o}"))
            .collect::<String>()
    );
    let _ = writeln!(
        s,
        "- date: {}; stallprof built from `{}` (release)",
        date.trim(),
        env.commit
    );
    let _ = writeln!(
        s,
        "- machine: {cpus} vCPUs ({model}), kernel {}; a **shared, noisy** VM: other engineers' builds and \
         test suites were running during the bench (load average at the end: {}). Absolute numbers are \
         therefore low and spread wide; ratios come from interleaved runs to cancel some of the drift.",
        kernel.trim(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let _ = writeln!(
        s,
        "- {} ({}); {}; wrk {}; node {}",
        env.python_version,
        env.python,
        pyspy_v.trim(),
        wrk_v.trim(),
        node_v.trim()
    );
    let run = format!(
        "{}: {} repetition(s) per accuracy cell, {} overhead rounds of {} s, {} attach runs, {} scaling run(s){}",
        if plan.quick { "`--quick`" } else { "full" },
        plan.acc_reps,
        plan.ovh_rounds,
        plan.ovh_secs,
        plan.attach_reps,
        plan.scale_reps,
        if plan.quick {
            " — a smoke run; treat spreads as indicative"
        } else {
            ""
        }
    );
    let _ = writeln!(
        s,
        "- run: {run} ({:.0} s); raw outputs were in `{}` (not kept in git)",
        took.as_secs_f64(),
        measure::rel(&env.work, &env.root)
    );
    let _ = writeln!(
        s,
        "\nReproduce everything with `sudo cargo xtask bench` (full run, estimated ~25 min; `--quick` ~10 min) or one section with \
         `cargo xtask bench --only accuracy|overhead|host|agent|scaling`; the commands each figure comes from \
         are given in its section. `$SP` is `target/release/stallprof`, `$PY` the Python above, \
         `$PYSPY` `target/bench-venv/bin/py-spy`, `V` `profiler/tests/victims`.\n"
    );
    s
}
