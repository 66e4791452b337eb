//! The `host` section: what a process stallprof does *not* watch pays
//! while `record` or the daemon runs — per system call and per pipe round
//! trip — with the default probes, with the raw scheduler tracepoints
//! (`--probes raw-tracepoints`, the previous default) and with the classic
//! tracepoints (`--probes tracepoints`, the fallback), side by side in one
//! interleaved run.
//!
//! In: the bench environment (the stallprof binary, a scratch dir). Out:
//! a Markdown section for docs/benchmarks.md.
//!
//! `bench/host_cost.c` makes no wait syscall, so no mode ever watches it;
//! the watched process is a Python asyncio loop ticking every 5 ms (a
//! service idling between requests).
use std::{fmt::Write as _, fs, path::Path, process::Command, time::Duration};

use anyhow::{Result, bail};

use super::{Env, Glance, Plan, Proc, daemon_cmd, median, spread};

/// One configuration: its label, and how the agent runs (None: bare).
struct Cfg {
    label: &'static str,
    agent: Option<Agent>,
}

#[derive(Clone, Copy)]
enum Agent {
    Record(&'static str),
    Daemon(&'static str),
}

const CFGS: [Cfg; 7] = [
    Cfg {
        label: "nothing running (bare)",
        agent: None,
    },
    Cfg {
        label: "`record --pid` on another process (default probes)",
        agent: Some(Agent::Record("auto")),
    },
    Cfg {
        label: "`record --pid` on another process, `--probes raw-tracepoints`",
        agent: Some(Agent::Record("raw-tracepoints")),
    },
    Cfg {
        label: "`record --pid` on another process, `--probes tracepoints`",
        agent: Some(Agent::Record("tracepoints")),
    },
    Cfg {
        label: "`daemon` (default probes)",
        agent: Some(Agent::Daemon("auto")),
    },
    Cfg {
        label: "`daemon --probes raw-tracepoints`",
        agent: Some(Agent::Daemon("raw-tracepoints")),
    },
    Cfg {
        label: "`daemon --probes tracepoints`",
        agent: Some(Agent::Daemon("tracepoints")),
    },
];

/// A watched-but-idle asyncio service: a loop that ticks every 5 ms.
const TICKER: &str = "import asyncio\n\
async def main():\n\
\x20   while True:\n\
\x20       await asyncio.sleep(0.005)\n\
asyncio.run(main())\n";

/// Median of a host_cost run's windows for `key`, past the first two.
fn windows(text: &str, key: &str) -> Result<f64> {
    let v: Vec<f64> = text
        .lines()
        .filter_map(|l| l.strip_prefix(key))
        .filter_map(|x| x.trim().parse().ok())
        .skip(2)
        .collect();
    if v.is_empty() {
        bail!("host_cost printed no {key} windows:\n{text}");
    }
    Ok(median(&v))
}

/// Runs host_cost `mode` for `secs` on CPU 1 (the pipe's two processes
/// share it: every round trip is two context switches).
fn host_cost(bin: &Path, mode: &str, secs: u32) -> Result<String> {
    let mut p = Proc::spawn(
        Command::new("taskset")
            .args(["-c", "1"])
            .arg(bin)
            .args([mode, &secs.to_string()]),
    )?;
    p.wait_line("done", Duration::from_secs(secs as u64 + 30))?;
    Ok(p.text())
}

/// (ns per syscall, µs per round trip) with `cfg`'s agent running.
fn once(env: &Env, bin: &Path, cfg: &Cfg, dir: &Path, secs: u32) -> Result<(f64, f64)> {
    fs::create_dir_all(dir)?;
    let ticker = dir.join("ticker.py");
    fs::write(&ticker, TICKER)?;
    let target = Proc::spawn(Command::new(&env.python).arg(&ticker))?;
    let mut agent = match cfg.agent {
        None => None,
        Some(Agent::Record(probes)) => {
            let mut c = Command::new(&env.bin);
            c.args(["-v", "record", "-q", "--probes", probes, "--pid"])
                .arg(target.pid().to_string())
                .arg("-o")
                .arg(dir.join("out"));
            let mut a = Proc::spawn(&mut c)?;
            a.wait_line("attached to", Duration::from_secs(20))?;
            Some(a)
        }
        Some(Agent::Daemon(probes)) => {
            let mut c = daemon_cmd(env, &dir.join("data"));
            c.args(["--probes", probes]);
            let mut a = Proc::spawn(&mut c)?;
            a.wait_line("probes attached host-wide", Duration::from_secs(30))?;
            Some(a)
        }
    };
    // Let the agent's start-up (discovery, first symbolization) pass.
    std::thread::sleep(Duration::from_millis(700));
    let sys = windows(&host_cost(bin, "syscall", secs)?, "ns_per_syscall ")?;
    let pipe = windows(&host_cost(bin, "pipe", secs)?, "us_per_round_trip ")?;
    if let Some(a) = agent.as_mut() {
        a.stop(Duration::from_secs(30));
    }
    drop(target);
    Ok((sys, pipe))
}

pub(super) fn host(env: &Env, plan: &Plan, glance: &mut Glance) -> Result<String> {
    let bin = env.work.join("host_cost");
    super::super::run(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&bin)
            .arg(env.root.join("bench/host_cost.c")),
    )?;
    let reps = plan.ovh_rounds.min(5);
    let secs = if plan.quick { 2 } else { 3 };
    let mut sys: Vec<Vec<f64>> = vec![Vec::new(); CFGS.len()];
    let mut pipe: Vec<Vec<f64>> = vec![Vec::new(); CFGS.len()];
    for rep in 0..reps {
        for (i, cfg) in CFGS.iter().enumerate() {
            let dir = env.work.join(format!("host/{rep}-{i}"));
            let (s, p) = once(env, &bin, cfg, &dir, secs)?;
            eprintln!(
                "bench: host {rep} {}: {s:.1} ns/syscall, {p:.3} µs/round trip",
                cfg.label
            );
            sys[i].push(s);
            pipe[i].push(p);
        }
    }
    let added_at = |v: &[Vec<f64>], i: usize| -> f64 {
        let r: Vec<f64> = v[i]
            .iter()
            .zip(&v[0])
            .map(|(a, b)| (a / b - 1.0) * 100.0)
            .collect();
        median(&r)
    };
    // CFGS: 1 record, 2 record raw, 3 record classic, 4 daemon, 5 daemon
    // raw, 6 daemon classic.
    for (what, v) in [
        (
            "an unwatched process: added time per syscall (`getppid`)",
            &sys,
        ),
        (
            "an unwatched process: added time per pipe round trip",
            &pipe,
        ),
    ] {
        let (r, d) = (added_at(v, 1), added_at(v, 4));
        glance.row(
            &format!(
                "{what}, median of {reps} rounds (raw tracepoints; classic tracepoints, in brackets)"
            ),
            format!("{r:+.1}% ({:+.1}%; {:+.1}%)", added_at(v, 2), added_at(v, 3)),
            format!("{d:+.1}% ({:+.1}%; {:+.1}%)", added_at(v, 5), added_at(v, 6)),
            "—".into(),
            format!(
                "≤ 5%: record **{}**, daemon **{}**",
                if r <= 5.0 { "met" } else { "missed" },
                if d <= 5.0 { "met" } else { "missed" }
            ),
        );
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n## What the rest of the host pays\n\n\
         A process stallprof does **not** watch, while `record` (on another process) or the daemon runs: \
         `bench/host_cost.c` makes `getppid()` calls (a syscall that does nothing, so the tracing slow path a \
         syscall tracepoint puts every task on shows whole) and bounces a byte between two processes through \
         two pipes on one CPU (a round trip is 2 context switches, 2 wakeups and 4 syscalls). It makes no wait \
         syscall, so no mode watches it. The watched process is an asyncio loop ticking every 5 ms. \
         {reps} interleaved rounds of every configuration, {secs} s per measurement, each the median of its \
         100 ms windows; *added* is the median over rounds of each round's ratio to that round's bare run.\n"
    );
    let _ = writeln!(
        s,
        "| configuration | ns per syscall | added | µs per pipe round trip | added |\n|---|---|---|---|---|"
    );
    for (i, cfg) in CFGS.iter().enumerate() {
        let added = |v: &[Vec<f64>]| -> String {
            if i == 0 {
                return "—".into();
            }
            let r: Vec<f64> = v[i]
                .iter()
                .zip(&v[0])
                .map(|(a, b)| (a / b - 1.0) * 100.0)
                .collect();
            format!("{:+.1}%", median(&r))
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} |",
            cfg.label,
            spread(&sys[i], 1),
            added(&sys),
            spread(&pipe[i], 3),
            added(&pipe)
        );
    }
    let _ = writeln!(
        s,
        "\nThe default probes put nothing on a syscall path (the waits are uprobes in the watched processes' \
         own C library, so only their calls trap) and no program on another task's context switch or wakeup: \
         the scheduler is watched through a `context-switches` software perf event on each watched thread \
         (what is left is the kernel's perf hooks, which every switch passes through once any per-thread \
         perf event exists). `--probes raw-tracepoints` (the previous default) runs a program at every \
         switch and wakeup on the host, which returns after a tgid compare and an array read for a task not \
         watched. `--probes tracepoints` is the fallback: enabling any syscall tracepoint sends every syscall \
         of every task on the host through the tracing slow path, and each classic scheduler tracepoint \
         builds a record per context switch before the program runs.\n\n\
         ```sh\ncc -O2 -o host_cost bench/host_cost.c\n\
         taskset -c 1 ./host_cost syscall 3; taskset -c 1 ./host_cost pipe 3   # bare, then with:\n\
         $SP record -q --pid $WATCHED [--probes raw-tracepoints|tracepoints] &   # or: $SP daemon [--probes …] &\n```\n"
    );
    Ok(s)
}
