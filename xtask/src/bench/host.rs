//! The `host` section: what a process stallprof does *not* watch pays
//! while `record` or the daemon runs — per system call and per pipe round
//! trip — with the default probes, with the raw scheduler tracepoints
//! (`--probes raw-tracepoints`, the previous default) and with the classic
//! tracepoints (`--probes tracepoints`, the fallback), and, as the floor,
//! a bare `perf stat` of one per-thread event (the kernel's perf hooks
//! alone).
//!
//! In: the bench environment (the stallprof binary, a scratch dir). Out:
//! a Markdown section for docs/benchmarks.md.
//!
//! Each configuration is measured by `bench/host_alternate.py`: one long
//! `bench/host_cost.c` run while the agent is started and stopped around
//! it, each "on" phase compared with the "off" phases beside it (the
//! method, and why, is in the script's docstring). `host_cost` makes no
//! wait syscall, so no mode ever watches it; the watched process is a
//! Python asyncio loop ticking every 5 ms (a service idling between
//! requests).
use std::{fmt::Write as _, process::Command};

use anyhow::{Context, Result, bail};

use super::{Env, Glance, Plan};

/// One configuration: its label, and the script's AGENT argument (with
/// `{bin}` for the stallprof binary).
struct Cfg {
    label: &'static str,
    agent: &'static str,
}

const CFGS: [Cfg; 8] = [
    Cfg {
        label: "`record --pid` on another process (default probes)",
        agent: "record:{bin}",
    },
    Cfg {
        label: "`record --pid` on another process, `--probes raw-tracepoints`",
        agent: "record+raw-tracepoints:{bin}",
    },
    Cfg {
        label: "`record --pid` on another process, `--probes tracepoints`",
        agent: "record+tracepoints:{bin}",
    },
    Cfg {
        label: "`daemon` (default probes)",
        agent: "daemon:{bin}",
    },
    Cfg {
        label: "`daemon --probes raw-tracepoints`",
        agent: "daemon+raw-tracepoints:{bin}",
    },
    Cfg {
        label: "`daemon --probes tracepoints`",
        agent: "daemon+tracepoints:{bin}",
    },
    Cfg {
        label: "floor: `perf stat -e context-switches -t` on the watched thread (no stallprof)",
        agent: "perf-cs",
    },
    Cfg {
        label: "floor: `perf stat -e cpu-clock -t` on the watched thread (no stallprof)",
        agent: "perf-clock",
    },
];

/// One measure's result over the cycles: added % (median, min, max) and
/// how many cycles (bench/service_phases.py: the efficiency, as a ratio).
#[derive(Clone, Copy)]
pub(super) struct Added {
    pub(super) median: f64,
    pub(super) min: f64,
    pub(super) max: f64,
    pub(super) cycles: usize,
}

impl Added {
    fn cell(&self) -> String {
        format!(
            "{:+.1}% ({:+.1} .. {:+.1}, {})",
            self.median, self.min, self.max, self.cycles
        )
    }
}

/// Run a measuring script (`cmd`, named `what` in errors) to its end;
/// its standard output, or an error with all it printed.
pub(super) fn script_output(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{what}: {}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(text)
}

/// A script's "result MEASURE MEDIAN MIN MAX CYCLES" line for `measure`
/// (bench/host_alternate.py, bench/service_phases.py).
pub(super) fn result(text: &str, measure: &str) -> Result<Added> {
    let line = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("result ")?
                .strip_prefix(measure)?
                .strip_prefix(' ')
        })
        .with_context(|| format!("the script printed no result for {measure}:\n{text}"))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .map(|x| x.parse::<f64>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("a result line: {line}"))?;
    let [median, min, max, cycles] = v[..] else {
        bail!("a result line: {line}");
    };
    Ok(Added {
        median,
        min,
        max,
        cycles: cycles as usize,
    })
}

pub(super) fn host(env: &Env, plan: &Plan, glance: &mut Glance) -> Result<String> {
    let bin = env.work.join("host_cost");
    crate::run(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&bin)
            .arg(env.root.join("bench/host_cost.c")),
    )?;
    let (cycles, phase) = if plan.quick { (3, 3) } else { (6, 5) };
    let script = env.root.join("bench/host_alternate.py");
    let mut sys = Vec::new();
    let mut pipe = Vec::new();
    for cfg in &CFGS {
        let agent = cfg.agent.replace("{bin}", &env.bin.to_string_lossy());
        let text = script_output(
            Command::new(&env.python)
                .arg(&script)
                .arg(&bin)
                .arg("both")
                .arg(&agent)
                .args([cycles.to_string(), phase.to_string()]),
            &format!("{} {agent}", script.display()),
        )?;
        let (s, p) = (
            result(&text, "ns_per_syscall")?,
            result(&text, "us_per_round_trip")?,
        );
        eprintln!(
            "bench: host {}: {} per syscall, {} per round trip",
            cfg.label,
            s.cell(),
            p.cell()
        );
        sys.push(s);
        pipe.push(p);
    }
    // CFGS: 0 record, 1 record raw, 2 record classic, 3 daemon, 4 daemon
    // raw, 5 daemon classic, 6 and 7 the perf floors.
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
        let (r, d) = (v[0].median, v[3].median);
        glance.row(
            &format!(
                "{what}, median of {cycles} on/off cycles (raw tracepoints; classic tracepoints, in brackets; \
                 the kernel's floor for one per-thread `context-switches` event: {:+.1}%)",
                v[6].median
            ),
            format!("{r:+.1}% ({:+.1}%; {:+.1}%)", v[1].median, v[2].median),
            format!("{d:+.1}% ({:+.1}%; {:+.1}%)", v[4].median, v[5].median),
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
         two pipes on one CPU (a round trip is 2 context switches, 2 wakeups and 4 syscalls), 100 ms windows \
         of each in turn. It makes no wait syscall, so no mode watches it. The watched process is an asyncio \
         loop ticking every 5 ms.\n\n\
         The VM's speed drifts by 20–40% over tens of seconds (its neighbours' caches and memory bandwidth: \
         `host_cost`'s CPU clock moves with its wall clock, so it is not steal), so configurations measured \
         one after another compare different machines. `bench/host_alternate.py` runs **one** `host_cost` \
         while it starts and stops the agent around it: {cycles} cycles of {phase} s on, {phase} s off; each \
         phase is the 25th percentile of its windows (bursts from the neighbours add time to some windows; a \
         cost per context switch moves all of them), each \"on\" phase is divided by the mean of the \"off\" \
         phases beside it, and *added* is the median over cycles (min .. max, cycles). \"On\" counts from 1 s \
         after the agent's probes are attached; \"off\" from 1.5 s after it exited (perf turns its scheduler \
         hooks off 1 s after the last per-thread event closes). The two `perf stat` rows are the floor any \
         per-thread perf event puts on every context switch of the host, with no stallprof running.\n"
    );
    let _ = writeln!(
        s,
        "| configuration | added per syscall | added per pipe round trip |\n|---|---|---|"
    );
    for (i, cfg) in CFGS.iter().enumerate() {
        let _ = writeln!(
            s,
            "| {} | {} | {} |",
            cfg.label,
            sys[i].cell(),
            pipe[i].cell()
        );
    }
    let _ = writeln!(
        s,
        "\nThe default probes put nothing on a syscall path (the waits are uprobes in the watched processes' \
         own C library, so only their calls trap) and no program on another task's context switch or wakeup: \
         the scheduler is watched through a `context-switches` software perf event on each watched thread. \
         What is left is the kernel's perf hooks, which every switch on the host passes through once any \
         per-thread perf event exists (`perf_event_task_sched_out`/`_in` for any per-thread event; the \
         software-event lookup for `context-switches` on top) — the floor rows. `--probes raw-tracepoints` \
         (the previous default) runs a program at every switch and wakeup on the host, which returns after a \
         tgid compare and an array read for a task not watched. `--probes tracepoints` is the fallback: \
         enabling any syscall tracepoint sends every syscall of every task on the host through the tracing \
         slow path, and each classic scheduler tracepoint builds a record per context switch before the \
         program runs.\n\n\
         ```sh\ncc -O2 -o host_cost bench/host_cost.c\n\
         sudo python3 bench/host_alternate.py ./host_cost both record:$SP {cycles} {phase}   \
         # or daemon:$SP, record+tracepoints:$SP, perf-cs, perf-clock, …\n```\n"
    );
    Ok(s)
}
