//! The watched service's CPU efficiency by alternation: one saturated
//! asyncio HTTP service and one wrk for the whole run, bare phases between
//! the agents' phases, each agent phase against the bare phases beside it
//! (`bench/service_phases.py`; its docstring has the method and why).
//! Beside the overhead section's rounds (a fresh service per run), whose
//! run-to-run spread on a shared VM is wider than the effect.
//!
//! In: the bench environment (stallprof, py-spy, the Python). Out: a glance
//! row and a Markdown subsection for docs/benchmarks.md.
use std::{fmt::Write as _, process::Command};

use anyhow::Result;

use super::{
    Env, Glance, Plan,
    host::{result, script_output},
};

/// The script's configurations: its argument, and the label.
const CFGS: [(&str, &str); 3] = [
    ("rec", "`record --pid` (defaults: 999 Hz, gate 2 ms)"),
    ("daemon", "`daemon` (defaults: 199 Hz, host-wide)"),
    ("pyspy --nonblocking", "py-spy record -r 999 --nonblocking"),
];

pub(super) fn phases(env: &Env, plan: &Plan, glance: &mut Glance) -> Result<String> {
    let (rounds, phase) = if plan.quick { (5, 2) } else { (10, 3) };
    eprintln!("bench: the service's efficiency by alternation, {rounds} rounds");
    let script = env.root.join("bench/service_phases.py");
    let text = script_output(
        Command::new(&env.python)
            .arg(&script)
            .arg(rounds.to_string())
            .args(CFGS.map(|c| c.0))
            .env("SP", &env.bin)
            .env("PYSPY", &env.pyspy)
            .env("PY", &env.python)
            .env("PHASE", phase.to_string())
            .current_dir(&env.root),
        &script.display().to_string(),
    )?;
    let res = CFGS
        .iter()
        .map(|(arg, _)| result(&text, &arg.replace(' ', "_")))
        .collect::<Result<Vec<_>>>()?;
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    let cell = |i: usize| {
        let r = &res[i];
        format!("{} ({} .. {})", pct(r.median), pct(r.min), pct(r.max))
    };
    let verdict = |i: usize| {
        if res[i].median >= 0.98 {
            "met"
        } else {
            "missed"
        }
    };
    glance.row(
        &format!(
            "the same service by alternation: CPU efficiency (one service and one wrk throughout; each agent \
             phase against the bare phases beside it; median of {rounds} (min .. max))"
        ),
        cell(0),
        cell(1),
        cell(2),
        format!(
            "≥ 98%: record **{}**, daemon **{}**",
            verdict(0),
            verdict(1)
        ),
    );
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n### The service's efficiency by alternation\n\n\
         The rounds above start a fresh service per run, and on this VM two bare runs a minute apart differ \
         by more than the effect. `bench/service_phases.py` keeps **one** service (CPU 0) and **one** wrk \
         (CPU 1) for the whole run and alternates: bare, A, bare, B, bare, C, bare, … ({rounds} rounds, \
         {phase} s measured per phase after 3 s to attach and settle). A phase's CPU per request is the \
         median of its 100 ms windows from the service's own log (requests served and the loop thread's CPU \
         clock); an agent phase's efficiency is the mean of the bare phases just before and after it divided \
         by its own.\n\n\
         | configuration | CPU efficiency, median (min .. max) | rounds |\n|---|---|---|"
    );
    for (i, (_, label)) in CFGS.iter().enumerate() {
        let _ = writeln!(s, "| {label} | {} | {} |", cell(i), res[i].cycles);
    }
    let _ = writeln!(
        s,
        "\n```sh\nsudo SP=$SP PYSPY=$PYSPY PHASE={phase} python3 bench/service_phases.py {rounds} rec daemon \
         'pyspy --nonblocking'\n```\n"
    );
    Ok(s)
}
