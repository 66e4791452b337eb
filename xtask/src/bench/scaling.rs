//! Section 4, `scaling`: the agent's costs with 1/10/100 executor threads,
//! and the daemon's with 1–20 monitored processes.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs, thread,
    time::{Duration, Instant},
};

use anyhow::Result;

use super::{
    DAEMON_PORT, Env, Plan,
    agent::{AgentRun, record_for, storm},
    measure::{Proc, commands_block, cpu_secs, spread, vm_hwm_mib},
    overhead::daemon_cmd,
};

pub(super) fn scaling(env: &Env, plan: &Plan) -> Result<String> {
    eprintln!("bench: section 4, scaling");
    let mut s = String::new();
    let _ = writeln!(s, "## 4. Scaling\n");
    let _ = writeln!(
        s,
        "**Executor threads.** `event_storm N 100 200 0`: N epoll loops each ticking at 100 Hz with 200 µs \
         of work per tick (2% busy each; 100 threads ≈ 2 cores, the whole machine, and 20 000 waits/s). \
         `stallprof -v record -q --pid PID`, measured for {} s after attach; {} run(s) per N, interleaved. \
         At 100 threads the machine is saturated by the target: the agent's attach (a few hundred syscalls, \
         the 64 MiB ring buffer's allocation) waits its turn behind 100 runnable threads, which is what its \
         attach time shows.\n",
        plan.scale_secs, plan.scale_reps
    );
    let _ = writeln!(
        s,
        "| executor threads | attach, logged (ms) | attach, wall (ms) | CPU % of one core | peak RSS (MiB) | executors found | lost events |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    let ns = [1u32, 10, 100];
    let mut res: BTreeMap<u32, Vec<AgentRun>> = BTreeMap::new();
    for rep in 0..plan.scale_reps {
        for &n in &ns {
            let dir = env.work.join(format!("scaling/threads-{n}-{rep}"));
            fs::create_dir_all(&dir)?;
            let target = storm(env, n, 100, 200, 0, &dir.join("storm.txt"))?;
            thread::sleep(Duration::from_millis(500));
            match record_for(env, target.pid(), plan.scale_secs, &[], &dir, false) {
                Ok(r) => res.entry(n).or_default().push(r),
                Err(e) => eprintln!("bench: scaling run failed: {e:#}"),
            }
            drop(target);
        }
    }
    for &n in &ns {
        let rs = res.get(&n).map(|v| v.as_slice()).unwrap_or(&[]);
        let f =
            |g: &dyn Fn(&AgentRun) -> Option<f64>| rs.iter().filter_map(g).collect::<Vec<f64>>();
        let _ = writeln!(
            s,
            "| {n} | {} | {} | {} | {} | {} | {} |",
            spread(&f(&|r| r.attach_log_ms), 0),
            spread(&f(&|r| Some(r.attach_wall_ms)), 0),
            spread(&f(&|r| Some(r.cpu_pct)), 1),
            spread(&f(&|r| Some(r.rss_mib)), 0),
            spread(&f(&|r| r.executors.map(|x| x as f64)), 0),
            spread(&f(&|r| r.lost.map(|x| x as f64)), 0),
        );
    }

    // Daemon: 1..20 monitored processes.
    let _ = writeln!(
        s,
        "\n**Monitored processes (daemon).** `stallprof -v daemon` (defaults) with K copies of \
         `event_storm 1 100 200 0` started after it; once it logs \"monitoring pid\" for all K, its CPU \
         is measured for {} s, then its peak RSS. A fresh daemon per K. The daemon is host-wide: it also \
         monitors any other event-loop process on the machine (the \"monitored in all\" column counts its \
         \"monitoring pid\" lines during the run).\n",
        plan.scale_secs
    );
    let _ = writeln!(
        s,
        "| K bench processes | monitored in all | CPU % of one core | peak RSS (MiB) | ready after (ms, wall) |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|");
    let ks: &[usize] = &[1, 5, 10, 20];
    for &k in ks {
        let mut cpu = Vec::new();
        let mut rss = Vec::new();
        let mut mon = Vec::new();
        let mut ready = Vec::new();
        for rep in 0..plan.scale_reps {
            let dir = env.work.join(format!("scaling/daemon-{k}-{rep}"));
            fs::create_dir_all(&dir)?;
            let r = (|| -> Result<(f64, f64, f64, f64)> {
                let mut d = Proc::spawn(&mut daemon_cmd(env, &dir.join("data")))?;
                let t_ready = d.wait_line("probes attached host-wide", Duration::from_secs(30))?;
                let ready_ms = t_ready.duration_since(d.started).as_secs_f64() * 1e3;
                let mut targets = Vec::new();
                for i in 0..k {
                    targets.push(storm(
                        env,
                        1,
                        100,
                        200,
                        0,
                        &dir.join(format!("storm-{i}.txt")),
                    )?);
                }
                for t in &targets {
                    d.wait_line(
                        &format!("monitoring pid {} ", t.pid()),
                        Duration::from_secs(30),
                    )?;
                }
                thread::sleep(Duration::from_millis(500));
                let c0 = cpu_secs(d.pid(), env.clk_tck).unwrap_or(0.0);
                let t0 = Instant::now();
                thread::sleep(Duration::from_secs(plan.scale_secs as u64));
                let cpu = (cpu_secs(d.pid(), env.clk_tck).unwrap_or(c0) - c0)
                    / t0.elapsed().as_secs_f64()
                    * 100.0;
                let rss = vm_hwm_mib(d.pid()).unwrap_or(f64::NAN);
                let monitored = d
                    .text()
                    .lines()
                    .filter(|l| l.contains("monitoring pid"))
                    .count() as f64;
                drop(targets);
                d.stop(Duration::from_secs(60));
                fs::write(dir.join("daemon.log"), d.text())?;
                Ok((cpu, rss, monitored, ready_ms))
            })();
            match r {
                Ok((c, m, n, rd)) => {
                    cpu.push(c);
                    rss.push(m);
                    mon.push(n);
                    ready.push(rd);
                }
                Err(e) => eprintln!("bench: daemon scaling run failed: {e:#}"),
            }
        }
        let _ = writeln!(
            s,
            "| {k} | {} | {} | {} | {} |",
            spread(&mon, 0),
            spread(&cpu, 1),
            spread(&rss, 0),
            spread(&ready, 0)
        );
    }
    commands_block(
        &mut s,
        "\nCommands:",
        &[
            "./event_storm $N 100 200 0 & $SP -v record -q --pid $! -o out      # N = 1, 10, 100".to_string(),
            format!("$SP -v daemon --listen 127.0.0.1:{DAEMON_PORT} --data-dir d &"),
            "for i in $(seq $K); do ./event_storm 1 100 200 0 & done                 # K = 1, 5, 10, 20".to_string(),
        ],
    );
    Ok(s)
}
