//! The end-of-recording summary printed to the terminal. Every name in it
//! (command, frames, paths) goes through [`escape`]: a name cannot move the
//! cursor or forge a line.
//!
//! A recording of several processes (a supervisor and its workers) says
//! how many were watched and, one line each, which had stalls; the
//! culprits stay those of all stalls, and `--by-process` adds each
//! process's own. A recording of one process reads as it always has.
use std::{collections::BTreeMap, fmt::Write, path::PathBuf};

use crate::{
    model::text::escape,
    model::{
        CgroupVersion, CpuHolder, Recording,
        text::{cpu_held_by, is_stallprof},
    },
    os::units::fmt_ns,
    report::aggregate::{Summary, summarize, summarize_where},
};

fn pct(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * part as f64 / total as f64
    }
}

/// Tasks shown per culprit line; the rest are counted.
const TASKS_SHOWN: usize = 3;

/// ` — in task "conn-7" (handle)`, ` — in tasks "a" (f), "b" (g) and 2 more`,
/// ` — in 30 tasks, all Gateway.handle_request` (more than shown, one
/// coroutine: the tasks' names say nothing more); empty without tasks.
fn in_tasks(tasks: &[String]) -> String {
    match tasks {
        [] => String::new(),
        [one] => format!(" — in task {one}"),
        _ => {
            let more = tasks.len().saturating_sub(TASKS_SHOWN);
            if more > 0
                && let Some(coro) = one_coroutine(tasks)
            {
                return format!(" — in {} tasks, all {coro}", tasks.len());
            }
            let shown = tasks[..tasks.len().min(TASKS_SHOWN)].join(", ");
            match more {
                0 => format!(" — in tasks {shown}"),
                more => format!(" — in tasks {shown} and {more} more"),
            }
        }
    }
}

/// The coroutine every task of `tasks` runs, when they all name the same
/// one (`"Task-36" (Gateway.handle_request)`: the part in parentheses).
fn one_coroutine(tasks: &[String]) -> Option<&str> {
    fn coro(t: &str) -> Option<&str> {
        t.rsplit_once(" (").map(|(_, c)| c.trim_end_matches(')'))
    }
    let first = coro(&tasks[0])?;
    tasks[1..]
        .iter()
        .all(|t| coro(t) == Some(first))
        .then_some(first)
}

/// ` — in POST /resume/{rid}`, ` — in GET /a, POST /b and 2 more`.
fn in_routes(routes: &[String]) -> String {
    let shown = routes[..routes.len().min(TASKS_SHOWN)].join(", ");
    match routes.len().saturating_sub(TASKS_SHOWN) {
        0 => format!(" — in {shown}"),
        more => format!(" — in {shown} and {more} more"),
    }
}

/// The counters of stalls that served a request whose route was not read
/// (`asgi_route_*`), as `name=N`, and their sum.
fn route_misses(rec: &Recording) -> (u64, Vec<String>) {
    let misses: Vec<(&String, &u64)> = rec
        .drops
        .iter()
        .filter(|(k, _)| k.starts_with("asgi_route_"))
        .collect();
    (
        misses.iter().map(|(_, n)| **n).sum(),
        misses.iter().map(|(k, n)| format!("{k}={n}")).collect(),
    )
}

fn has_quota(rec: &Recording) -> bool {
    rec.cpu_quota.as_ref().is_some_and(|q| q.quota_us.is_some())
}

/// The stalls' CPU holders summed by task, for the summary.
fn recording_holders(rec: &Recording) -> Vec<CpuHolder> {
    let mut by: BTreeMap<(u32, u32, &str), CpuHolder> = BTreeMap::new();
    for h in rec.stalls.iter().flat_map(|s| &s.cpu_holders) {
        by.entry((h.pid, h.tgid, h.comm.as_str()))
            .and_modify(|e| e.ns += h.ns)
            .or_insert_with(|| h.clone());
    }
    by.into_values().collect()
}

/// `  CPU quota: 10ms/100ms (cgroup v1 /svc): throttled in 14 of 15
/// periods, 1.2s in all while recording; the stalls' throttled parts
/// 1.1s (95% of it)`. None without a quota.
fn quota_line(rec: &Recording) -> Option<String> {
    let q = rec.cpu_quota.as_ref().filter(|q| q.quota_us.is_some())?;
    let version = match q.cgroup_version {
        CgroupVersion::V1 => "v1",
        CgroupVersion::V2 => "v2",
    };
    let mut line = format!(
        "  CPU quota: {} (cgroup {version} {})",
        q.describe(),
        escape(&q.cgroup)
    );
    match q.during() {
        Some(d) => {
            let _ = write!(
                line,
                ": throttled in {} of {} periods, {} in all while recording; the stalls' \
                 throttled parts {} ({:.0}% of it)",
                d.nr_throttled,
                d.nr_periods,
                fmt_ns(d.throttled_ns),
                fmt_ns(rec.throttled_ns()),
                pct(rec.throttled_ns(), d.throttled_ns)
            );
        }
        None => line.push_str(": its counters could not be read at the end"),
    }
    Some(line)
}

/// Culprits shown, over all stalls and (`--by-process`) per process.
const CULPRITS: usize = 8;

/// `    60.0%     1.2 s  parse_resume (app.py:31) — on-CPU — in POST /r`:
/// one line per culprit, indented by `indent`.
fn culprit_lines(out: &mut String, s: &Summary, indent: &str) {
    for c in &s.culprits {
        // On a web server the request's route says more than its
        // anonymous task (`Task-102` running the server's coroutine).
        let within = if c.routes.is_empty() {
            in_tasks(&c.tasks)
        } else {
            in_routes(&c.routes)
        };
        let _ = writeln!(
            out,
            "{indent}{:5.1}%  {:>9}  {}{}",
            100.0 * c.share,
            fmt_ns(c.ns),
            escape(&c.label),
            escape(&within)
        );
    }
}

/// `5 stalls, 1.2 s`.
fn stalls_and_time(n: usize, ns: u64) -> String {
    format!("{n} stall{}, {}", if n == 1 { "" } else { "s" }, fmt_ns(ns))
}

/// The processes with stalls, heaviest first (the pid breaks ties): each
/// as the summary names it, with its stall count and time.
fn processes_with_stalls(rec: &Recording) -> Vec<(u32, String, usize, u64)> {
    let mut by: BTreeMap<u32, (usize, u64)> = BTreeMap::new();
    for s in &rec.stalls {
        let e = by.entry(s.pid).or_default();
        e.0 += 1;
        e.1 += s.duration_ns;
    }
    let mut v: Vec<(u32, String, usize, u64)> = by
        .into_iter()
        .map(|(pid, (n, ns))| {
            let name = rec
                .process_of(pid)
                .map_or_else(|| format!("pid {pid}"), |p| p.describe());
            (pid, name, n, ns)
        })
        .collect();
    v.sort_by(|a, b| b.3.cmp(&a.3).then(a.0.cmp(&b.0)));
    v
}

/// `  processes: 5 watched, 2 with stalls:` and a line for each with
/// stalls; nothing for a recording of one process.
fn processes_lines(out: &mut String, rec: &Recording) {
    if rec.processes.len() <= 1 && !rec.stalls_in_several_processes() {
        return;
    }
    let with = processes_with_stalls(rec);
    let _ = writeln!(
        out,
        "  processes: {} watched, {} with stalls{}",
        rec.processes.len(),
        with.len(),
        if with.is_empty() { "" } else { ":" }
    );
    for (_, name, n, ns) in &with {
        let _ = writeln!(out, "    {name}: {}", stalls_and_time(*n, *ns));
    }
}

pub fn text(rec: &Recording, files: &[PathBuf], by_process: bool) -> String {
    let s = summarize(rec, CULPRITS);
    let mut out = String::new();
    let span = rec.ended_ns.saturating_sub(rec.started_ns);
    let _ = writeln!(
        out,
        "stallprof: pid {} ({}), {} recorded, threshold {}",
        rec.pid,
        escape(&rec.comm),
        fmt_ns(span),
        fmt_ns(rec.threshold_ns)
    );
    if let Some(c) = &rec.process.container {
        let _ = writeln!(
            out,
            "  container: {} (cgroup {})",
            escape(&c.describe()),
            escape(&c.cgroup)
        );
    }
    // The ids the application's own logs show (gettid(), its pid) in its
    // PID namespace, next to the host's.
    let ns_tids: Vec<String> = rec
        .stall_threads()
        .iter()
        .filter_map(|t| {
            t.ns_tid
                .map(|ns| format!("{} ({}) = {ns}", t.tid, escape(&t.name)))
        })
        .collect();
    if rec.process.ns_pid.is_some() || !ns_tids.is_empty() {
        let pid = rec
            .process
            .ns_pid
            .map_or_else(|| "?".to_string(), |p| p.to_string());
        let _ = writeln!(
            out,
            "  in its PID namespace: pid {} = {pid}{}{}",
            rec.pid,
            if ns_tids.is_empty() { "" } else { "; tid " },
            ns_tids.join(", ")
        );
    }
    if let Some(line) = quota_line(rec) {
        let _ = writeln!(out, "{line}");
    }
    processes_lines(&mut out, rec);
    if s.stalls == 0 {
        let _ = writeln!(
            out,
            "  no stalls: no executor thread stayed busy for {} or more",
            fmt_ns(rec.threshold_ns)
        );
        if rec.executor_threads.is_empty() {
            let _ = writeln!(
                out,
                "  note: no thread parked in an event-loop wait (epoll/poll/select) — is this an event-loop process?"
            );
        }
    } else {
        let _ = writeln!(
            out,
            "  {} stalls, {} in all ({:.1}% of the recording); p50 {}, p99 {}, max {}",
            s.stalls,
            fmt_ns(s.total_ns),
            pct(s.total_ns, span),
            fmt_ns(s.p50_ns),
            fmt_ns(s.p99_ns),
            fmt_ns(s.max_ns)
        );
        let throttled = if s.throttled_ns > 0 || has_quota(rec) {
            format!(", CPU throttled {:.1}%", pct(s.throttled_ns, s.total_ns))
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "  time in stalls: on-CPU {:.1}%, off-CPU (blocked) {:.1}%, run-queue wait {:.1}%{throttled}",
            pct(s.on_cpu_ns, s.total_ns),
            pct(s.off_cpu_ns, s.total_ns),
            pct(s.runqueue_ns, s.total_ns)
        );
        let holders = recording_holders(rec);
        if let Some(held) = cpu_held_by(&holders, 3) {
            let _ = writeln!(
                out,
                "  run queue ({} of stall time) — CPU held by {held}",
                fmt_ns(s.runqueue_ns)
            );
            let own: u64 = holders
                .iter()
                .filter(|h| is_stallprof(h))
                .map(|h| h.ns)
                .sum();
            if own > 0 {
                let _ = writeln!(
                    out,
                    "    stallprof is this profiler: its threads held the CPU {} of it \
                     ({:.1}% of the recording)",
                    fmt_ns(own),
                    pct(own, span)
                );
            }
        }
        let _ = writeln!(out, "  top culprits (share of stall time):");
        culprit_lines(&mut out, &s, "    ");
        if by_process && rec.stalls_in_several_processes() {
            let _ = writeln!(
                out,
                "  top culprits by process (share of the process's stall time):"
            );
            for (pid, name, n, ns) in processes_with_stalls(rec) {
                let _ = writeln!(out, "    {name} ({}):", stalls_and_time(n, ns));
                let of = summarize_where(rec, CULPRITS, |st| st.pid == pid);
                culprit_lines(&mut out, &of, "      ");
            }
        }
        // The same time grouped by request handler: what each entry point
        // (the outermost app frame past the loop's dispatch) cost.
        if !s.entries.is_empty() {
            let _ = writeln!(out, "  by entry point (share of stall time):");
            for e in &s.entries {
                let _ = writeln!(
                    out,
                    "    {:5.1}%  {:>9}  {} ({} stall{})",
                    100.0 * e.share,
                    fmt_ns(e.ns),
                    escape(&e.label),
                    e.stalls,
                    if e.stalls == 1 { "" } else { "s" }
                );
            }
        }
    }
    // The same time by the request's route (ASGI servers), and the stalls
    // that served a request whose route was not read, said.
    let (missed, counters) = route_misses(rec);
    if !s.routes.is_empty() || missed > 0 {
        let _ = writeln!(out, "  by route (share of stall time):");
        for r in &s.routes {
            let _ = writeln!(
                out,
                "    {:5.1}%  {:>9}  {} ({} stall{})",
                100.0 * r.share,
                fmt_ns(r.ns),
                escape(&r.label),
                r.stalls,
                if r.stalls == 1 { "" } else { "s" }
            );
        }
        if missed > 0 {
            let _ = writeln!(
                out,
                "    route not read for {missed} stall{} that served a request ({}; docs/asgi.md)",
                if missed == 1 { "" } else { "s" },
                counters.join(", ")
            );
        }
    }
    if rec.probes.host_wide() || !rec.probes.notes.is_empty() {
        let _ = writeln!(
            out,
            "  probes: scheduler {}, waits {}{}",
            rec.probes.scheduler.as_str(),
            rec.probes.waits.as_str(),
            if rec.probes.host_wide() {
                " — every process on the host paid for its syscalls or context switches \
                 while attached (docs/architecture.md, \"What runs in the kernel\")"
            } else {
                ""
            }
        );
        for n in &rec.probes.notes {
            let _ = writeln!(out, "    {}", escape(n));
        }
    }
    for p in &rec.runtime_problems {
        let _ = writeln!(
            out,
            "  {} in pid {} could not be read: {}\n    why: {}\n    what to do: {}",
            escape(&p.runtime),
            p.pid,
            escape(&p.what),
            escape(&p.why),
            escape(&p.remedy)
        );
    }
    if rec.lost_events > 0 || !rec.drops.is_empty() {
        let drops: Vec<String> = rec.drops.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(
            out,
            "  lost events: {}; counters: {}",
            rec.lost_events,
            drops.join(", ")
        );
    }
    if !files.is_empty() {
        let _ = writeln!(out, "  wrote:");
        for f in files {
            let _ = writeln!(out, "    {}", escape(&f.to_string_lossy()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frame, FrameKind, PartKind, Route, Stall};
    use crate::testing;

    fn stall(start_ms: u64, ms: u64, handler: &str, route: Option<(&str, &str)>) -> Stall {
        let ns = ms * 1_000_000;
        let frames = vec![Frame {
            file: Some("/srv/app.py".into()),
            line: Some(3),
            ..Frame::new(handler, FrameKind::Python)
        }];
        Stall {
            route: route.map(|(m, t)| Route {
                method: m.into(),
                template: t.into(),
            }),
            tid: 7,
            thread_name: "MainThread".into(),
            ..testing::stall(
                start_ms * 1_000_000,
                vec![testing::part(PartKind::OnCpu, ns, frames)],
            )
        }
    }

    #[test]
    fn stall_time_by_route_and_the_misses_said() {
        let mut r = Recording::for_tests(vec![
            stall(0, 300, "parse_resume", Some(("POST", "/resume/{rid}"))),
            stall(1000, 100, "parse_resume", Some(("POST", "/resume/{rid}"))),
            stall(2000, 100, "nap", Some(("GET", "/nap"))),
            stall(3000, 100, "tick", None),
        ]);
        let text = text(&r, &[], false);
        let by_route: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.contains("by route"))
            .skip(1)
            .take_while(|l| l.starts_with("    "))
            .collect();
        assert_eq!(by_route.len(), 2, "{text}");
        assert!(
            by_route[0].ends_with("POST /resume/{rid} (2 stalls)"),
            "{text}"
        );
        assert!(by_route[0].contains("66.7%"), "{text}");
        assert!(by_route[1].ends_with("GET /nap (1 stall)"), "{text}");
        assert!(
            text.contains("parse_resume (app.py:3) — on-CPU — in POST /resume/{rid}\n"),
            "{text}"
        );
        assert!(text.contains("tick (app.py:3) — on-CPU\n"), "{text}");
        // Stalls that served a request without a route read: said.
        r.drops.insert("asgi_route_unverified".into(), 2);
        let text = super::text(&r, &[], false);
        assert!(
            text.contains(
                "    route not read for 2 stalls that served a request \
                 (asgi_route_unverified=2; docs/asgi.md)"
            ),
            "{text}"
        );
        // No request anywhere: no section.
        let none = super::text(
            &Recording::for_tests(vec![stall(0, 100, "tick", None)]),
            &[],
            false,
        );
        assert!(!none.contains("by route"), "{none}");
    }

    /// Many tasks of one coroutine are one phrase; tasks of several
    /// coroutines are listed.
    #[test]
    fn tasks_of_one_coroutine_are_counted_not_listed() {
        let same: Vec<String> = (1..=30)
            .map(|i| format!("\"Task-{i}\" (Gateway.handle_request)"))
            .collect();
        assert_eq!(
            in_tasks(&same),
            " — in 30 tasks, all Gateway.handle_request"
        );
        let mut mixed = same.clone();
        mixed.push("\"janitor\" (janitor)".into());
        assert!(
            in_tasks(&mixed).ends_with("and 28 more"),
            "{}",
            in_tasks(&mixed)
        );
        assert_eq!(
            in_tasks(&same[..2]),
            " — in tasks \"Task-1\" (Gateway.handle_request), \"Task-2\" (Gateway.handle_request)"
        );
    }

    /// Who held the CPU comes with how long, and stallprof's own threads
    /// are said to be the profiler.
    #[test]
    fn cpu_holders_with_their_time_and_the_profiler_said() {
        use crate::model::{CpuHolder, HolderRelation};
        let mut st = stall(0, 100, "tick", None);
        st.cpu_holders = vec![
            CpuHolder {
                pid: 900,
                tgid: 900,
                comm: "stallprof".into(),
                ns: 30_000_000,
                relation: HolderRelation::Other,
            },
            CpuHolder {
                pid: 42,
                tgid: 42,
                comm: "cpuhog".into(),
                ns: 10_000_000,
                relation: HolderRelation::Other,
            },
        ];
        let t = text(&Recording::for_tests(vec![st]), &[], false);
        assert!(
            t.contains(
                "— CPU held by stallprof (pid 900) 30.0ms 75%, cpuhog (pid 42) 10.0ms 25%\n"
            ),
            "{t}"
        );
        assert!(
            t.contains("    stallprof is this profiler: its threads held the CPU 30.0ms of it"),
            "{t}"
        );
    }

    /// A supervisor and two workers: the processes watched, a line for
    /// each with stalls (heaviest first), the culprits over all, and each
    /// process's own on request; one process reads as before.
    #[test]
    fn processes_with_stalls_and_their_culprits_on_request() {
        let rec = testing::two_workers();
        let t = text(&rec, &[], false);
        assert!(
            t.contains(
                "  processes: 3 watched, 2 with stalls:\n\
                 \x20   pid 1210 worker 1 of uvicorn: 1 stall, 30.0ms\n\
                 \x20   pid 1220 worker 2 of uvicorn: 2 stalls, 20.0ms\n"
            ),
            "{t}"
        );
        assert!(t.contains("  3 stalls, 50.0ms in all"), "{t}");
        assert!(!t.contains("by process"), "{t}");
        let by = text(&rec, &[], true);
        let section: Vec<&str> = by
            .lines()
            .skip_while(|l| !l.contains("top culprits by process"))
            .skip(1)
            .take_while(|l| l.starts_with("    "))
            .collect();
        assert_eq!(section.len(), 4, "{by}");
        assert_eq!(
            section[0],
            "    pid 1210 worker 1 of uvicorn (1 stall, 30.0ms):"
        );
        assert!(section[1].starts_with("      100.0%"), "{by}");
        assert!(section[1].contains("spin"), "{by}");
        assert_eq!(
            section[2],
            "    pid 1220 worker 2 of uvicorn (2 stalls, 20.0ms):"
        );
        assert!(section[3].contains("nap"), "{by}");
        // One process, by process or not: as it always read.
        let one = Recording::for_tests(vec![stall(0, 100, "tick", None)]);
        assert_eq!(text(&one, &[], true), text(&one, &[], false));
        assert!(!text(&one, &[], true).contains("processes"));
    }
}
