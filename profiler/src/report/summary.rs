//! The end-of-recording summary printed to the terminal. Every name in it
//! (command, frames, paths) goes through [`escape`]: a name cannot move the
//! cursor or forge a line.
//!
//! A recording of several processes (a supervisor and its workers) says
//! how many were watched and, one line each, which had stalls; the
//! culprits stay those of all stalls, and `--by-process` adds each
//! process's own. A recording of one process reads as it always has.
//!
//! Read in one pass: every line fits [`Options::width`] (the terminal's, or
//! [`DEFAULT_WIDTH`]; `-v`: no limit). A label too long has its middle
//! elided (`…`), keeping its app frame at the start and what kind of time
//! and which route at the end; prose wraps at spaces. Only a path is never
//! cut, so it can be copied. Each counter that cost something is a line
//! saying what (`missed: unwind_failed=1 — …`), the harmless ones only with
//! `-v`; after `wrote`, each file with what opens it ([`viewers`]).
use std::{collections::BTreeMap, fmt::Write, path::PathBuf};

use profiler_common::Cost;

use crate::{
    model::text::escape,
    model::{
        CgroupVersion, CpuHolder, Recording, Stall,
        text::{cpu_held_by, is_stallprof},
    },
    os::units::fmt_ns,
    report::{
        aggregate::{Summary, held_up_totals, stall_culprit, summarize, summarize_where},
        viewers,
    },
};

/// A line's width when stdout is not a terminal (a file, a pipe, a test).
pub const DEFAULT_WIDTH: usize = 120;
/// The narrowest a terminal's width is taken to be: below it a line keeps
/// too little of its label to say anything.
const NARROWEST: usize = 60;

/// What a counter of `drops` cost and means (`explain`'s answer).
pub type Explain = fn(&str) -> Option<(Cost, &'static str)>;

/// How the summary is said.
#[derive(Clone, Copy)]
pub struct Options {
    /// `--by-process`: each process's culprits too.
    pub by_process: bool,
    /// `-v`: the harmless counters said too.
    pub verbose: bool,
    /// The columns a line may take; None: any (`-v`).
    pub width: Option<usize>,
    /// What each counter of the recording's `drops` cost and means (the
    /// counters' owners are the kernel's and the agent's, past this room).
    pub explain: Explain,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            by_process: false,
            verbose: false,
            width: Some(DEFAULT_WIDTH),
            explain: |_| None,
        }
    }
}

impl Options {
    /// The width of a summary printed to stdout: full with `-v`, else the
    /// terminal's (at least [`NARROWEST`]), else [`DEFAULT_WIDTH`].
    pub fn width_for_stdout(verbose: bool) -> Option<usize> {
        if verbose {
            return None;
        }
        Some(crate::os::terminal::stdout_columns().map_or(DEFAULT_WIDTH, |c| c.max(NARROWEST)))
    }
}

/// The atoms of escaped text ([`escape`]): an escape (`\n`, `\x1b`) or
/// one character; text is cut only between them.
fn atoms(s: &str) -> Vec<&str> {
    let mut v = Vec::new();
    let mut rest = s;
    while let Some(c) = rest.chars().next() {
        let len = if c == '\\' {
            let b = rest.as_bytes();
            match b.get(1) {
                Some(b'n' | b'r' | b't') => 2,
                Some(b'x') if b.len() >= 4 && b[2..4].iter().all(u8::is_ascii_hexdigit) => 4,
                _ => 1,
            }
        } else {
            c.len_utf8()
        };
        v.push(&rest[..len]);
        rest = &rest[len..];
    }
    v
}

fn columns(s: &str) -> usize {
    s.chars().count()
}

/// `s` in at most `budget` columns: whole if it fits, else its middle
/// elided with `…`, keeping its first `head` columns (when they fit) and
/// as much of both ends as the budget holds. Never cuts an escape.
fn elide(s: &str, budget: usize, head: usize) -> String {
    if columns(s) <= budget {
        return s.to_string();
    }
    if budget == 0 {
        return String::new();
    }
    let atoms = atoms(s);
    let keep = budget - 1;
    let left_want = head.min(keep) + (keep - head.min(keep)).div_ceil(2);
    let right_want = keep - left_want;
    let (mut left, mut used) = (0, 0);
    while left < atoms.len() && used + columns(atoms[left]) <= left_want {
        used += columns(atoms[left]);
        left += 1;
    }
    let (mut right, mut used_right) = (atoms.len(), 0);
    while right > left && used_right + columns(atoms[right - 1]) <= right_want + (left_want - used)
    {
        used_right += columns(atoms[right - 1]);
        right -= 1;
    }
    format!("{}…{}", atoms[..left].concat(), atoms[right..].concat())
}

/// `prefix` + `body` + `tail` in `width` columns: the body's middle elided
/// first (its head, up to a first ` → `, kept: the app frame); when the
/// prefix and tail leave the body too little, the middle of body and tail
/// together.
fn fit(prefix: &str, body: &str, tail: &str, width: Option<usize>) -> String {
    let whole = || format!("{prefix}{body}{tail}");
    let Some(width) = width else {
        return whole();
    };
    let (p, b, t) = (columns(prefix), columns(body), columns(tail));
    if p + b + t <= width {
        return whole();
    }
    let room = width.saturating_sub(p);
    // At least this much of the body is worth keeping before the tail is cut.
    const BODY_MIN: usize = 24;
    if room >= t + BODY_MIN {
        let head = body.find(" → ").map_or(0, |i| columns(&body[..i]));
        format!("{prefix}{}{tail}", elide(body, room - t, head))
    } else {
        let both = format!("{body}{tail}");
        let head = body.find(" → ").map_or(0, |i| columns(&body[..i]));
        format!("{prefix}{}", elide(&both, room, head.min(room / 2)))
    }
}

/// `line` wrapped at spaces into lines of at most `width` columns, each
/// one after the first indented 4 more than it; a word longer than a
/// line has its middle elided.
fn wrap(line: &str, width: Option<usize>) -> Vec<String> {
    let Some(width) = width.filter(|&w| columns(line) > w) else {
        return vec![line.to_string()];
    };
    let indent = line.len() - line.trim_start_matches(' ').len();
    let more = " ".repeat(indent + 4);
    let mut lines = Vec::new();
    let mut cur = line[..indent].to_string();
    let mut empty = true;
    for word in line[indent..].split(' ') {
        if !empty && columns(&cur) + 1 + columns(word) > width {
            lines.push(std::mem::replace(&mut cur, more.clone()));
            empty = true;
        }
        if empty {
            let room = width.saturating_sub(columns(&cur)).max(1);
            cur.push_str(&elide(word, room, 0));
        } else {
            cur.push(' ');
            cur.push_str(word);
        }
        empty = false;
    }
    lines.push(cur);
    lines
}

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

/// The summary's lines, each fitted to the width as it is added.
struct Lines {
    text: String,
    width: Option<usize>,
}

impl Lines {
    /// Prose (each of its lines): wrapped at spaces.
    fn say(&mut self, line: impl AsRef<str>) {
        for part in line.as_ref().split('\n') {
            for l in wrap(part, self.width) {
                self.text.push_str(&l);
                self.text.push('\n');
            }
        }
    }

    /// `prefix` + `body` + `tail`, the body's middle elided ([`fit`]).
    fn label(&mut self, prefix: &str, body: &str, tail: &str) {
        self.text.push_str(&fit(prefix, body, tail, self.width));
        self.text.push('\n');
    }

    /// A line kept whole (it holds a path, to be copied).
    fn whole(&mut self, line: &str) {
        self.text.push_str(line);
        self.text.push('\n');
    }
}

/// The longest stalls that ran in an OpenTelemetry span, with its ids (to
/// paste into a tracing UI), and the stalls whose span could not be read.
fn trace_lines(out: &mut Lines, rec: &Recording) {
    const SHOWN: usize = 5;
    let mut traced: Vec<&Stall> = rec.stalls.iter().filter(|s| s.trace().is_some()).collect();
    let unreadable = rec
        .stalls
        .iter()
        .filter(|s| s.trace_unreadable().is_some())
        .count();
    if traced.is_empty() && unreadable == 0 {
        return;
    }
    traced.sort_by_key(|s| std::cmp::Reverse(s.duration_ns));
    out.say(format!(
        "  traced stalls ({} in an OpenTelemetry span; longest first):",
        traced.len()
    ));
    for s in traced.iter().take(SHOWN) {
        let Some(ids) = s.trace() else {
            continue;
        };
        let route = s.route.as_ref().map(|r| r.describe());
        out.say(format!(
            "    {:>9}  {}trace {} span {}",
            fmt_ns(s.duration_ns),
            route.map(|r| format!("{r}  ")).unwrap_or_default(),
            ids.trace_id,
            ids.span_id
        ));
    }
    if unreadable > 0 {
        out.say(format!(
            "    span not read for {unreadable} stall{} (its task's or thread's context could not \
             be read: see stalls.json task.trace_unreadable, thread_context.trace_unreadable)",
            if unreadable == 1 { "" } else { "s" }
        ));
    }
}

/// `    60.0%     1.2 s  parse_resume (app.py:31) — on-CPU — in POST /r`:
/// one line per culprit, indented by `indent`.
fn culprit_lines(out: &mut Lines, s: &Summary, indent: &str) {
    for c in &s.culprits {
        // On a web server the request's route says more than its
        // anonymous task (`Task-102` running the server's coroutine).
        let within = if c.routes.is_empty() {
            in_tasks(&c.tasks)
        } else {
            in_routes(&c.routes)
        };
        let label = escape(&c.label);
        // The frames, then what kind of time (` — on-CPU`) and where.
        let (frames, kind) = label.split_at(label.find(" — ").unwrap_or(label.len()));
        out.label(
            &format!("{indent}{:5.1}%  {:>9}  ", 100.0 * c.share, fmt_ns(c.ns)),
            frames,
            &format!("{kind}{}", escape(&within)),
        );
    }
}

/// Stalls listed under "held up", worst timer lateness first.
const HELD_UP_SHOWN: usize = 5;

/// The harm first, next to the stall count: how late the stalls made the
/// loop's timers run (worst, and the p99 over every delayed timer of the
/// recording), and the stalls whose queues were not read, per process.
fn held_up_headline(out: &mut Lines, rec: &Recording) {
    let t = held_up_totals(&rec.stalls);
    if t.timers > 0 {
        out.say(format!(
            "  timers ran up to {} late (p99 over the recording {}): {} timer{} delayed by {} of {} \
             stall{} read",
            fmt_ns(t.worst_ns),
            fmt_ns(t.p99_ns),
            t.timers,
            if t.timers == 1 { "" } else { "s" },
            t.delaying,
            t.read,
            if t.read == 1 { "" } else { "s" },
        ));
    } else if t.read > 0 {
        out.say(format!(
            "  no timers due during the {} stall{} whose loop was read",
            t.read,
            if t.read == 1 { "" } else { "s" }
        ));
    }
    for ((pid, reason, detail), n) in &t.not_read {
        out.say(format!(
            "  held up: {} for {n} stall{} of pid {pid}{}",
            reason.describe(),
            if *n == 1 { "" } else { "s" },
            detail
                .as_deref()
                .map(|d| format!(" ({})", escape(d)))
                .unwrap_or_default()
        ));
    }
}

/// Two lines per stall that held up work, worst first: the stall and its
/// top culprit, then `delayed 40 timers by up to 241ms (the latest-due
/// 221ms), 12 callbacks queued`.
fn held_up_lines(out: &mut Lines, rec: &Recording) {
    let app = rec.app();
    let mut read: Vec<(&crate::model::Stall, &crate::model::Delayed)> = rec
        .stalls
        .iter()
        .filter_map(|s| match &s.held_up {
            Some(crate::model::HeldUp::Read(d)) => Some((s, d)),
            _ => None,
        })
        .collect();
    if read.is_empty() {
        return;
    }
    read.sort_by_key(|(s, d)| (std::cmp::Reverse(d.worst_late_ns()), s.start_ns));
    out.say("  held up (stalls, worst timer lateness first):");
    let first = rec.first_ns();
    for (s, d) in read.iter().take(HELD_UP_SHOWN) {
        let culprit = stall_culprit(s, &app).unwrap_or_default();
        out.label(
            &format!(
                "    {} at +{} in ",
                fmt_ns(s.duration_ns),
                fmt_ns(s.start_ns.saturating_sub(first))
            ),
            &culprit,
            "",
        );
        out.say(format!("      {}", describe_delayed(d)));
    }
    if read.len() > HELD_UP_SHOWN {
        out.say(format!(
            "    {} more in stalls.json",
            read.len() - HELD_UP_SHOWN
        ));
    }
}

/// `delayed 40 timers by up to 241ms (the latest-due 221ms), 12 callbacks
/// queued`, or `no timers due, 2 callbacks queued`.
pub fn describe_delayed(d: &crate::model::Delayed) -> String {
    let more = if d.truncated { " or more" } else { "" };
    let timers = match (d.worst_late_ns(), d.latest_due_late_ns()) {
        (Some(worst), Some(latest)) => format!(
            "delayed {}{more} timer{} by up to {} (the latest-due {})",
            d.timers_late_ns.len(),
            if d.timers_late_ns.len() == 1 { "" } else { "s" },
            fmt_ns(worst),
            fmt_ns(latest)
        ),
        _ => "no timers due".to_string(),
    };
    format!(
        "{timers}, {}{more} callback{} queued",
        d.ready_handles,
        if d.ready_handles == 1 { "" } else { "s" }
    )
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
fn processes_lines(out: &mut Lines, rec: &Recording) {
    if rec.processes.len() <= 1 && !rec.stalls_in_several_processes() {
        return;
    }
    let with = processes_with_stalls(rec);
    out.say(format!(
        "  processes: {} watched, {} with stalls{}",
        rec.processes.len(),
        with.len(),
        if with.is_empty() { "" } else { ":" }
    ));
    for (_, name, n, ns) in &with {
        out.label("    ", name, &format!(": {}", stalls_and_time(*n, *ns)));
    }
}

/// `    43.6%    664.8ms  POST /resume/{rid} (3 stalls)`: an entry point's
/// or a route's line.
fn share_line(out: &mut Lines, share: f64, ns: u64, label: &str, stalls: usize) {
    out.label(
        &format!("    {:5.1}%  {:>9}  ", 100.0 * share, fmt_ns(ns)),
        &escape(label),
        &format!(" ({stalls} stall{})", if stalls == 1 { "" } else { "s" }),
    );
}

/// One line per counter of `drops` that cost something (`missed:`), and
/// with `verbose` one per harmless one (`counted, harmless:`), each with
/// what it means; the ring buffer's losses of a recording without that
/// counter as `ringbuf_full`. The routes' are said under `by route`.
fn counter_lines(out: &mut Lines, rec: &Recording, opts: &Options) {
    let ring = profiler_common::Drop::RingbufFull.name();
    let mut counts: Vec<(&str, u64)> = rec
        .drops
        .iter()
        .filter(|(k, _)| !k.starts_with("asgi_route_"))
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    if rec.lost_events > 0 && !rec.drops.contains_key(ring) {
        counts.push((ring, rec.lost_events));
        counts.sort_unstable();
    }
    for (name, n) in counts {
        let (said, what) = match (opts.explain)(name) {
            Some((Cost::Harmless, _)) if !opts.verbose => continue,
            Some((Cost::Harmless, what)) => ("counted, harmless", what.to_string()),
            Some((_, what)) => ("missed", what.to_string()),
            None => (
                "missed",
                format!(
                    "a counter this stallprof does not know (the recording is stallprof {}'s)",
                    escape(&rec.stallprof_version)
                ),
            ),
        };
        out.say(format!("  {said}: {}={n} — {what}", escape(name)));
    }
}

/// `  wrote, in DIR:` and each file with what opens it; files in
/// several directories by their paths.
fn wrote_lines(out: &mut Lines, files: &[PathBuf]) {
    let paths: Vec<String> = files
        .iter()
        .map(|f| escape(&f.to_string_lossy()).into_owned())
        .collect();
    let dirs: Vec<Option<&str>> = paths
        .iter()
        .map(|p| p.rsplit_once('/').map(|(d, _)| d))
        .collect();
    let one_dir = dirs
        .first()
        .copied()
        .flatten()
        .filter(|d| dirs.iter().all(|x| *x == Some(*d)));
    let names: Vec<&str> = match one_dir {
        Some(d) => {
            out.whole(&format!("  wrote, in {d}/:"));
            paths.iter().map(|p| &p[d.len() + 1..]).collect()
        }
        None => {
            out.whole("  wrote:");
            paths.iter().map(String::as_str).collect()
        }
    };
    let pad = names.iter().map(|n| columns(n)).max().unwrap_or(0);
    for (name, path) in names.iter().zip(&paths) {
        match viewers::open_with(path) {
            Some(how) => out.whole(&format!(
                "    {name}{} — {how}",
                " ".repeat(pad - columns(name))
            )),
            None => out.whole(&format!("    {name}")),
        }
    }
}

pub fn text(rec: &Recording, files: &[PathBuf], opts: &Options) -> String {
    let s = summarize(rec, CULPRITS);
    let mut out = Lines {
        text: String::new(),
        width: opts.width,
    };
    let span = rec.ended_ns.saturating_sub(rec.started_ns);
    out.say(format!(
        "stallprof: pid {} ({}), {} recorded, threshold {}",
        rec.pid,
        escape(&rec.comm),
        fmt_ns(span),
        fmt_ns(rec.threshold_ns)
    ));
    if let Some(c) = &rec.process.container {
        out.say(format!(
            "  container: {} (cgroup {})",
            escape(&c.describe()),
            escape(&c.cgroup)
        ));
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
        out.say(format!(
            "  in its PID namespace: pid {} = {pid}{}{}",
            rec.pid,
            if ns_tids.is_empty() { "" } else { "; tid " },
            ns_tids.join(", ")
        ));
    }
    if let Some(line) = quota_line(rec) {
        out.say(line);
    }
    processes_lines(&mut out, rec);
    if s.stalls == 0 {
        out.say(format!(
            "  no stalls: no executor thread stayed busy for {} or more",
            fmt_ns(rec.threshold_ns)
        ));
        if rec.executor_threads.is_empty() {
            out.say(
                "  note: no thread parked in an event-loop wait (epoll/poll/select) — is this an event-loop process?",
            );
        }
    } else {
        out.say(format!(
            "  {} stalls, {} in all ({:.1}% of the recording); p50 {}, p99 {}, max {}",
            s.stalls,
            fmt_ns(s.total_ns),
            pct(s.total_ns, span),
            fmt_ns(s.p50_ns),
            fmt_ns(s.p99_ns),
            fmt_ns(s.max_ns)
        ));
        held_up_headline(&mut out, rec);
        let throttled = if s.throttled_ns > 0 || has_quota(rec) {
            format!(", CPU throttled {:.1}%", pct(s.throttled_ns, s.total_ns))
        } else {
            String::new()
        };
        out.say(format!(
            "  time in stalls: on-CPU {:.1}%, off-CPU (blocked) {:.1}%, run-queue wait {:.1}%{throttled}",
            pct(s.on_cpu_ns, s.total_ns),
            pct(s.off_cpu_ns, s.total_ns),
            pct(s.runqueue_ns, s.total_ns)
        ));
        let holders = recording_holders(rec);
        if let Some(held) = cpu_held_by(&holders, 3) {
            out.say(format!(
                "  run queue ({} of stall time) — CPU held by {held}",
                fmt_ns(s.runqueue_ns)
            ));
            let own: u64 = holders
                .iter()
                .filter(|h| is_stallprof(h))
                .map(|h| h.ns)
                .sum();
            if own > 0 {
                out.say(format!(
                    "    stallprof is this profiler: its threads held the CPU {} of it \
                     ({:.1}% of the recording)",
                    fmt_ns(own),
                    pct(own, span)
                ));
            }
        }
        out.say("  top culprits (share of stall time):");
        culprit_lines(&mut out, &s, "    ");
        if opts.by_process && rec.stalls_in_several_processes() {
            out.say("  top culprits by process (share of the process's stall time):");
            for (pid, name, n, ns) in processes_with_stalls(rec) {
                out.label("    ", &name, &format!(" ({}):", stalls_and_time(n, ns)));
                let of = summarize_where(rec, CULPRITS, |st| st.pid == pid);
                culprit_lines(&mut out, &of, "      ");
            }
        }
        held_up_lines(&mut out, rec);
        // The same time grouped by request handler: what each entry point
        // (the outermost app frame past the loop's dispatch) cost.
        if !s.entries.is_empty() {
            out.say("  by entry point (share of stall time):");
            for e in &s.entries {
                share_line(&mut out, e.share, e.ns, &e.label, e.stalls);
            }
        }
    }
    // The same time by the request's route (ASGI servers), and the stalls
    // that served a request whose route was not read, said.
    let (missed, counters) = route_misses(rec);
    if !s.routes.is_empty() || missed > 0 {
        out.say("  by route (share of stall time):");
        for r in &s.routes {
            share_line(&mut out, r.share, r.ns, &r.label, r.stalls);
        }
        if missed > 0 {
            out.say(format!(
                "    route not read for {missed} stall{} that served a request ({}; docs/asgi.md)",
                if missed == 1 { "" } else { "s" },
                counters.join(", ")
            ));
        }
    }
    trace_lines(&mut out, rec);
    if rec.probes.host_wide() || !rec.probes.notes.is_empty() {
        out.say(format!(
            "  probes: scheduler {}, waits {}{}",
            rec.probes.scheduler.as_str(),
            rec.probes.waits.as_str(),
            if rec.probes.host_wide() {
                " — every process on the host paid for its syscalls or context switches \
                 while attached (docs/architecture.md, \"What runs in the kernel\")"
            } else {
                ""
            }
        ));
        for n in &rec.probes.notes {
            out.say(format!("    {}", escape(n)));
        }
    }
    for p in &rec.runtime_problems {
        out.say(format!(
            "  {} in pid {} could not be read: {}\n    why: {}\n    what to do: {}",
            escape(&p.runtime),
            p.pid,
            escape(&p.what),
            escape(&p.why),
            escape(&p.remedy)
        ));
    }
    counter_lines(&mut out, rec, opts);
    if !files.is_empty() {
        wrote_lines(&mut out, files);
    }
    out.text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frame, FrameKind, PartKind, Route, Stall};
    use crate::testing;

    const BY_PROCESS: Options = Options {
        by_process: true,
        verbose: false,
        width: Some(DEFAULT_WIDTH),
        explain: |_| None,
    };

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

    /// The harm leads, next to the stall count; each stall that held up
    /// work says what; the stalls not read are said per process and why.
    #[test]
    fn the_harm_leads_and_each_stall_says_what_it_held_up() {
        use crate::model::{Delayed, HeldUp, NotRead, NotReadReason};
        let ms = 1_000_000;
        let mut a = stall(0, 300, "handler", None);
        a.held_up = Some(HeldUp::Read(Delayed {
            timers_late_ns: vec![241 * ms, 230 * ms, 221 * ms],
            ready_handles: 12,
            truncated: false,
        }));
        let mut b = stall(1000, 100, "idle", None);
        b.held_up = Some(HeldUp::Read(Delayed::default()));
        let mut c = stall(2000, 100, "other", None);
        c.pid = 9;
        c.held_up = Some(HeldUp::NotRead(NotRead {
            reason: NotReadReason::Runtime,
            detail: Some("uvloop.Loop".into()),
        }));
        let rec = Recording::for_tests(vec![a, b, c]);
        let text = text(&rec, &[], &Options::default());
        let lines: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("  3 stalls"))
            .collect();
        assert!(lines.len() > 2, "{text}");
        assert_eq!(
            lines[1],
            "  timers ran up to 241.0ms late (p99 over the recording 241.0ms): 3 timers delayed by 1 of 2 stalls read",
            "{text}"
        );
        assert_eq!(
            lines[2],
            "  held up: not read for this runtime for 1 stall of pid 9 (uvloop.Loop)"
        );
        assert!(
            text.contains(
                "      delayed 3 timers by up to 241.0ms (the latest-due 221.0ms), 12 callbacks queued"
            ),
            "{text}"
        );
        assert!(
            text.contains("      no timers due, 0 callbacks queued"),
            "{text}"
        );
    }

    #[test]
    fn stall_time_by_route_and_the_misses_said() {
        let mut r = Recording::for_tests(vec![
            stall(0, 300, "parse_resume", Some(("POST", "/resume/{rid}"))),
            stall(1000, 100, "parse_resume", Some(("POST", "/resume/{rid}"))),
            stall(2000, 100, "nap", Some(("GET", "/nap"))),
            stall(3000, 100, "tick", None),
        ]);
        let text = text(&r, &[], &Options::default());
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
        let text = super::text(&r, &[], &Options::default());
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
            &Options::default(),
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
        let t = text(&Recording::for_tests(vec![st]), &[], &Options::default());
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
        let t = text(&rec, &[], &Options::default());
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
        let by = text(&rec, &[], &BY_PROCESS);
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
        assert_eq!(
            text(&one, &[], &BY_PROCESS),
            text(&one, &[], &Options::default())
        );
        assert!(!text(&one, &[], &BY_PROCESS).contains("processes"));
    }

    /// A culprit of 300 characters, in a task, on a route: every line fits
    /// 120 columns (characters, not bytes), the app frame still starts it,
    /// what kind of time and the route still end it; `-v` keeps it whole.
    #[test]
    fn a_long_culprit_fits_the_width_with_its_ends_kept() {
        let lib: String = "é".repeat(150) + &"x".repeat(150);
        let frames = vec![
            Frame {
                file: Some("/srv/app.py".into()),
                line: Some(3),
                ..Frame::new("handle", FrameKind::Python)
            },
            Frame {
                file: Some("/usr/lib/python3.11/site-packages/lib/mod.py".into()),
                line: Some(9),
                ..Frame::new(&lib, FrameKind::Python)
            },
        ];
        let st = Stall {
            route: Some(Route {
                method: "GET".into(),
                template: "/x".into(),
            }),
            ..testing::stall(0, vec![testing::part(PartKind::OnCpu, 100_000_000, frames)])
        };
        let rec = Recording::for_tests(vec![st]);
        let t = text(&rec, &[], &Options::default());
        for l in t.lines() {
            assert!(
                l.chars().count() <= DEFAULT_WIDTH,
                "{} columns: {l}",
                l.chars().count()
            );
        }
        let line = t.lines().find(|l| l.contains("handle")).unwrap();
        assert!(line.contains("  handle (app.py:3) → "), "{line}");
        assert!(line.contains('…'), "{line}");
        assert!(line.ends_with(" — on-CPU — in GET /x"), "{line}");
        let full = text(
            &rec,
            &[],
            &Options {
                verbose: true,
                width: None,
                ..Options::default()
            },
        );
        assert!(full.contains(&lib), "{full}");
    }

    /// An escape is one atom: never cut in two.
    #[test]
    fn elision_never_cuts_an_escape_or_a_character() {
        let s = format!("{}{}", "\\x1b".repeat(20), "é".repeat(20));
        for budget in 1..columns(&s) {
            let e = elide(&s, budget, 0);
            assert!(columns(&e) <= budget, "{budget}: {e}");
            let inner: String = e.replace('…', "");
            assert!(
                inner.replace("\\x1b", "").chars().all(|c| c == 'é'),
                "{budget}: {e}"
            );
        }
        assert_eq!(atoms("a\\nb\\x0"), ["a", "\\n", "b", "\\", "x", "0"]);
        assert_eq!(
            wrap("  one two three four", Some(12)),
            ["  one two", "      three", "      four"]
        );
    }

    /// Counters that cost something say what, one line each; the harmless
    /// ones only with -v; a name this version does not know is said too.
    #[test]
    fn costly_counters_explained_harmless_ones_on_request() {
        fn explain(name: &str) -> Option<(Cost, &'static str)> {
            match name {
                "unwind_failed" => Some((
                    Cost::Frames,
                    "a stack's unwinding stopped early: its outer frames are missing",
                )),
                "upkeep_deferred" => Some((Cost::Harmless, "the rest was done at the next")),
                _ => None,
            }
        }
        let mut rec = Recording::for_tests(vec![stall(0, 100, "tick", None)]);
        rec.drops.insert("unwind_failed".into(), 1);
        rec.drops.insert("upkeep_deferred".into(), 4);
        rec.drops.insert("from_the_future".into(), 2);
        rec.lost_events = 3;
        let opts = Options {
            explain,
            ..Options::default()
        };
        let t = text(&rec, &[], &opts);
        assert!(
            t.contains(
                "  missed: unwind_failed=1 — a stack's unwinding stopped early: its outer frames are missing\n"
            ),
            "{t}"
        );
        assert!(
            t.contains("  missed: from_the_future=2 — a counter this stallprof does not know"),
            "{t}"
        );
        // The ring buffer's losses without their counter: under its name.
        assert!(t.contains("  missed: ringbuf_full=3 — "), "{t}");
        assert!(!t.contains("upkeep_deferred"), "{t}");
        let v = text(
            &rec,
            &[],
            &Options {
                verbose: true,
                ..opts
            },
        );
        assert!(
            v.contains("  counted, harmless: upkeep_deferred=4 — the rest was done at the next\n"),
            "{v}"
        );
    }

    /// After `wrote`, each file with what opens it, by its name.
    #[test]
    fn each_file_written_with_what_opens_it() {
        let rec = Recording::for_tests(vec![stall(0, 100, "tick", None)]);
        let files: Vec<PathBuf> = [
            "stalls.json",
            "stalls.pb.gz",
            "stalls.speedscope.json",
            "events.bin.gz",
        ]
        .iter()
        .map(|f| PathBuf::from("out").join(f))
        .collect();
        let t = text(&rec, &files, &Options::default());
        let wrote: Vec<&str> = t
            .lines()
            .skip_while(|l| !l.starts_with("  wrote"))
            .collect();
        assert_eq!(
            wrote,
            [
                "  wrote, in out/:",
                "    stalls.json            — stallprof report out",
                "    stalls.pb.gz           — go tool pprof -http=127.0.0.1:8080 out/stalls.pb.gz",
                "    stalls.speedscope.json — https://www.speedscope.app",
                "    events.bin.gz",
            ],
            "{t}"
        );
    }
}
