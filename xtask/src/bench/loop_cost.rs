//! What one event-loop iteration costs the watched loop
//! (bench/loop_cost.c, bare and under `record`), and what each BPF program
//! costs per run under the service's load (`kernel.bpf_stats_enabled`):
//! the parts the `overhead` section's ratios are made of.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{
    Env,
    measure::{Proc, cpu_secs, median, spread},
    overhead::{parse_wrk, start_http_service, wrk},
};

/// One bench/loop_cost run (2 s on CPU 0): the median ns per iteration over
/// its 100 ms windows (the first two dropped), with `profile` = Some(args)
/// running `stallprof record ARGS` (`--pid` added when `on_target`).
fn loop_cost_once(env: &Env, dir: &Path, profile: Option<(&[&str], bool)>) -> Result<f64> {
    fs::create_dir_all(dir)?;
    let ready = dir.join("ready");
    let _ = fs::remove_file(&ready);
    let mut victim = Proc::spawn(
        Command::new("taskset")
            .args(["-c", "0"])
            .arg(&env.loop_cost)
            .args(["2", "0"])
            .arg(&ready),
    )?;
    let mut other = None;
    let mut agent = match profile {
        None => None,
        Some((args, on_target)) => {
            let pid = if on_target {
                victim.pid()
            } else {
                let p = Proc::spawn(Command::new("sleep").arg("60"))?;
                let pid = p.pid();
                other = Some(p);
                pid
            };
            let mut c = Command::new(&env.bin);
            c.args(["-v", "record", "-q", "--pid", &pid.to_string(), "-o"])
                .arg(dir.join("out"))
                .args(args);
            let mut a = Proc::spawn(&mut c)?;
            a.wait_line("attached to", Duration::from_secs(20))?;
            Some(a)
        }
    };
    fs::write(&ready, b"go")?;
    victim.wait_line("done", Duration::from_secs(30))?;
    if let Some(a) = agent.as_mut() {
        a.stop(Duration::from_secs(30));
    }
    drop(other);
    let v: Vec<f64> = victim
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("ns_per_iter "))
        .filter_map(|x| x.trim().parse().ok())
        .skip(2)
        .collect();
    if v.is_empty() {
        bail!("loop_cost printed no windows");
    }
    Ok(median(&v))
}

/// A row of the iteration-cost table: its label, and (extra record args,
/// whether to attach by --pid) or None for the bare loop.
type IterationCfg<'a> = (&'a str, Option<(&'a [&'a str], bool)>);

/// What the profiler adds to one event-loop iteration (bench/loop_cost.c:
/// epoll_wait on an always-ready eventfd, nothing else), interleaved runs.
pub(super) fn iteration_cost(env: &Env, reps: usize, load: Option<&LoopLoad>) -> Result<String> {
    let cfgs: [IterationCfg; 4] = [
        ("bare", None),
        ("`record --pid` on it (defaults)", Some((&[], true))),
        (
            "`record --pid` on it, `--sample-after 0`",
            Some((&["--sample-after", "0"], true)),
        ),
        (
            "`record --pid` on *another* process (the host-wide part)",
            Some((&[], false)),
        ),
    ];
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); cfgs.len()];
    for rep in 0..reps {
        for (i, (_, prof)) in cfgs.iter().enumerate() {
            let dir = env.work.join(format!("overhead/loop-cost-{rep}-{i}"));
            ns[i].push(loop_cost_once(env, &dir, *prof)?);
        }
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n**Cost per loop iteration.** `bench/loop_cost.c` is an epoll loop on an always-ready eventfd on CPU 0: \
         every iteration is one `epoll_wait` that returns at once and nothing else, so its time per iteration \
         prices what watching a loop's waits costs it. {reps} interleaved runs of 2 s per configuration; each run's \
         figure is the median of its 100 ms windows; *added* is the median of each run's difference to the bare \
         run of the same repetition.\n"
    );
    let _ = writeln!(
        s,
        "| configuration | ns per iteration | added ns per iteration |\n|---|---|---|"
    );
    let mut added_default = None;
    let mut added_other = None;
    for (i, (name, _)) in cfgs.iter().enumerate() {
        let d: Vec<f64> = ns[i].iter().zip(&ns[0]).map(|(a, b)| a - b).collect();
        if i == 1 {
            added_default = Some(median(&d));
        }
        if i == 3 {
            added_other = Some(median(&d));
        }
        let _ = writeln!(
            s,
            "| {name} | {} | {} |",
            spread(&ns[i], 0),
            if i == 0 { "—".into() } else { spread(&d, 0) }
        );
    }
    if let (Some(a), Some(o)) = (added_default, added_other) {
        let _ = writeln!(
            s,
            "\nA loop pays about {a:.0} ns per iteration while recorded, so a loop that wakes N times a second \
             loses N × {a:.0} ns of its core: {:.2}% at 1 000 iterations/s, {:.1}% at 10 000. Another process's \
             loop pays {o:.0} ns of it (the *another process* row: within the noise; the wait uprobes are placed in \
             the recorded process's memory only). Most of the rest is the uprobe's trap and the uretprobe's return \
             (the kernel's cost of a uprobe, ~1 µs here), the BPF programs' bodies a few hundred ns (two hash \
             lookups, two clock reads; see the table above).\n",
            a * 1000.0 / 1e9 * 100.0,
            a * 10000.0 / 1e9 * 100.0
        );
    }
    if let (Some(l), Some(a)) = (load, added_default) {
        let iter_pct = l.iters_per_s * a / 1e9 * 100.0;
        let sample_pct = l.sample_us_per_s / 1e6 * 100.0;
        let low = iter_pct + sample_pct;
        let high = low + l.agent_cpu_pct;
        let _ = writeln!(
            s,
            "**The service's loss, priced.** Under `record` (defaults) the service's loop ran {:.0} iterations/s \
             (`busy_periods` + `kernel_filtered.short_busy_periods` over the recording): × {a:.0} ns = {iter_pct:.2}% \
             of its core; CPU samples (`sp_sample`, both CPUs, an upper bound for its context) {sample_pct:.2}%; \
             together **{low:.2}%**, plus whatever part of the agent's own {:.1}% of a core the scheduler put on the \
             service's core rather than wrk's (at most **{high:.2}%** in all). Target ≥ 99.5% of throughput: **{}** \
             by this accounting{}; the throughput ratios above cannot resolve it on this VM (see their noise floor).\n",
            l.iters_per_s,
            l.agent_cpu_pct,
            if high <= 0.5 {
                "met"
            } else if low <= 0.5 {
                "met for the target's own context"
            } else {
                "missed"
            },
            if high > 0.5 && low <= 0.5 {
                " (the agent's CPU, if it shares the service's core, would take it over)"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(
        s,
        "```sh\ncc -O2 -o loop_cost bench/loop_cost.c\ntaskset -c 0 ./loop_cost 2 0 ready &   # idles until ./ready exists\n\
         $SP -v record -q --pid $! -o out [--sample-after 0]; touch ready\n```\n"
    );
    Ok(s)
}

/// Run time and run count of every loaded `sp_*` program (needs
/// kernel.bpf_stats_enabled=1).
fn bpf_prog_stats() -> Result<BTreeMap<String, (u64, u64)>> {
    let out = Command::new("bpftool")
        .args(["-j", "prog", "show"])
        .output()
        .context("running bpftool (apt-get install bpftool)")?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("bpftool -j output")?;
    let mut m = BTreeMap::new();
    for p in v.as_array().into_iter().flatten() {
        let name = p["name"].as_str().unwrap_or("");
        if name.starts_with("sp_") {
            let e = m.entry(name.to_string()).or_insert((0, 0));
            e.0 += p["run_time_ns"].as_u64().unwrap_or(0);
            e.1 += p["run_cnt"].as_u64().unwrap_or(0);
        }
    }
    Ok(m)
}

/// What the service's loop did under `record` (default gate), for pricing.
pub(super) struct LoopLoad {
    /// Loop iterations per second (busy periods, reported or not).
    iters_per_s: f64,
    /// `sp_sample` CPU, all CPUs, µs per second (an upper bound of its
    /// share in the loop's context).
    sample_us_per_s: f64,
    /// The agent's own CPU, % of one core.
    agent_cpu_pct: f64,
}

/// Where the time goes: per-program BPF run time (kernel.bpf_stats_enabled)
/// while the HTTP service is under load, with and without the gate.
pub(super) fn bpf_cost(env: &Env, secs: u32) -> Result<(String, Option<LoopLoad>)> {
    const STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let old = fs::read_to_string(STATS).unwrap_or_else(|_| "0".into());
    fs::write(STATS, "1").context("enabling kernel.bpf_stats_enabled")?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n**Where the target's time goes.** The same service and load, one `record` run per gate setting with \
         `kernel.bpf_stats_enabled=1` (which itself adds two clock reads per program run), {secs} s of wrk: \
         every `sp_*` program's runs per second and mean run time, summed over both CPUs and every context (the \
         scheduler and syscall programs also run, and return early, for wrk and everything else). *per request* \
         divides the total BPF time by the requests served. The service's loop thread saturates its core, so \
         BPF time spent in its context is throughput lost one for one; the rest lands on wrk's core.\n"
    );
    let _ = writeln!(
        s,
        "| gate | requests/s | program | runs/s | ns/run | µs of CPU per s |\n|---|---|---|---|---|---|"
    );
    let mut totals = Vec::new();
    let mut load = None;
    let result = (|| -> Result<()> {
        for gate in ["2ms (default)", "0 (every sample)"] {
            let dir = env.work.join(format!("overhead/bpf-cost-{}", &gate[..1]));
            fs::create_dir_all(&dir)?;
            let (_server, pid, url) = start_http_service(env, &dir.join("port"))?;
            let mut c = Command::new(&env.bin);
            c.args(["-v", "record", "-q", "--pid", &pid.to_string(), "-o"])
                .arg(dir.join("out"));
            if gate.starts_with('0') {
                c.args(["--sample-after", "0"]);
            }
            let mut agent = Proc::spawn(&mut c)?;
            agent.wait_line("attached to", Duration::from_secs(20))?;
            let _ = wrk().args(["-t1", "-c32", "-d1s", &url]).output();
            let before = bpf_prog_stats()?;
            let cpu0 = cpu_secs(agent.pid(), env.clk_tck);
            let t0 = Instant::now();
            let out = wrk()
                .args(["-t1", "-c32", &format!("-d{secs}s"), "--latency", &url])
                .output()?;
            let wall = t0.elapsed().as_secs_f64();
            let after = bpf_prog_stats()?;
            let agent_cpu_pct = cpu_secs(agent.pid(), env.clk_tck)
                .zip(cpu0)
                .map_or(0.0, |(b, a)| (b - a) / wall * 100.0);
            agent.stop(Duration::from_secs(30));
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let (rps, _) = parse_wrk(&text).context("unparsable wrk output")?;
            // The loop's own iterations: busy periods the gate kept from
            // userspace (with the gate on), from the recording's counters.
            let rec: serde_json::Value = fs::read(dir.join("out/stalls.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            let quiet = rec["kernel_filtered"]["short_busy_periods"].as_f64();
            let rec_secs = (rec["ended_ns"].as_f64().unwrap_or(0.0)
                - rec["started_ns"].as_f64().unwrap_or(0.0))
                / 1e9;
            let busy = rec["busy_periods"].as_f64().unwrap_or(0.0);
            let mut wait_ns_per_call = 0.0;
            let mut sample_us_per_s = 0.0;
            let mut total_ns = 0u64;
            for (name, &(ns, n)) in &after {
                let (ns0, n0) = before.get(name).copied().unwrap_or((0, 0));
                let (dns, dn) = (ns.saturating_sub(ns0), n.saturating_sub(n0));
                total_ns += dns;
                if dn == 0 {
                    continue;
                }
                if name.starts_with("sp_wait_") {
                    wait_ns_per_call += dns as f64 / dn as f64;
                }
                if name == "sp_sample" {
                    sample_us_per_s = dns as f64 / wall / 1e3;
                }
                let _ = writeln!(
                    s,
                    "| {gate} | {rps:.0} | `{name}` | {:.0} | {:.0} | {:.0} |",
                    dn as f64 / wall,
                    dns as f64 / dn as f64,
                    dns as f64 / wall / 1e3
                );
            }
            let per_req = total_ns as f64 / (rps * wall);
            let _ = writeln!(
                s,
                "| {gate} | {rps:.0} | **all** | | | **{:.0}** ({:.2}% of one core; {per_req:.0} ns per request) |",
                total_ns as f64 / wall / 1e3,
                total_ns as f64 / wall / 1e9 * 100.0
            );
            if !gate.starts_with('0') && rec_secs > 0.0 {
                load = Some(LoopLoad {
                    iters_per_s: (quiet.unwrap_or(0.0) + busy) / rec_secs,
                    sample_us_per_s,
                    agent_cpu_pct,
                });
            }
            if let Some(q) = quiet.filter(|_| rec_secs > 0.0) {
                let iters = q / rec_secs;
                let _ = writeln!(
                    s,
                    "| {gate} | {rps:.0} | *the loop's own quiet iterations* | {iters:.0} | {wait_ns_per_call:.0} (enter + exit) | ≈ {:.0} (≈ {:.2}% of its core) |",
                    iters * wait_ns_per_call / 1e3,
                    iters * wait_ns_per_call / 1e9 * 100.0
                );
            }
            totals.push((gate, per_req));
        }
        Ok(())
    })();
    let _ = fs::write(STATS, old.trim());
    result?;
    if let [(_, on), (_, off)] = totals[..] {
        let _ = writeln!(
            s,
            "\nThe gate cuts the BPF time per request from {off:.0} ns to {on:.0} ns. What remains is the \
             scheduler and wait-syscall programs, which run at every context switch and every `epoll_wait` \
             on the host, the target's or not — most of these runs are wrk's, on the other core. The row \
             *the loop's own quiet iterations* counts the service's loop iterations the gate kept from \
             userspace (`kernel_filtered.short_busy_periods` over the recording) and prices each at the \
             two wait programs' mean run time: an estimate of the BPF time spent in the loop's own context, \
             leaving out its (gated, sub-µs) samples.\n"
        );
    }
    Ok((s, load))
}

pub(super) fn verdict_ratio(r: Option<f64>) -> String {
    match r {
        Some(r) => format!(
            "{:.1}% — **{}**",
            r * 100.0,
            if r >= 0.995 { "met" } else { "missed" }
        ),
        None => "not measured".into(),
    }
}
