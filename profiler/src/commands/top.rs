//! `stallprof top --pid PID`: a live terminal view of a running target's
//! stalls, redrawn every second — what `py-spy top` gives for CPU, for
//! stalls.
//!
//! In: the stalls the engine finishes ([`Live`], the same driving loop as
//! `record`). Out: the screen: stalls per second, p99 and max over a
//! sliding window, the stall now in progress, and the culprits ranked by
//! stall time in the window with its split (on-CPU, blocked, run-queue,
//! GIL wait). When more than one process is watched or stalled (a
//! supervisor and its workers), a processes table above the culprits
//! gives each its own stall rate, p99, max and worst culprit; a
//! single-process target's screen has no such table.
//! Plain ANSI (clear and redraw): no TUI library for two tables.
//! `q` or Ctrl-C quits; the probes are detached whichever way it ends.
use std::{
    collections::{HashMap, HashSet, VecDeque},
    fmt::Write as _,
    io::{IsTerminal, Read, Write},
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use clap::Args;

use crate::{
    classify::AppPaths,
    commands::live::{Live, Step},
    commands::{AppArgs, StallArgs},
    model::text::escape,
    model::{PartKind, Process, Stall},
    os::clock::monotonic_ns,
    os::family::Facts,
    os::proc::{process_alive, read_comm, refuse_target, refuse_thread},
    os::units::{fmt_ns, parse_duration},
    report::aggregate::{culprit_name, held_up_totals},
};

#[derive(Args, Debug)]
pub struct TopArgs {
    /// Process to watch.
    #[arg(short, long)]
    pub pid: u32,
    #[command(flatten)]
    pub stall: StallArgs,
    #[command(flatten)]
    pub app: AppArgs,
    /// Rates, percentiles and culprits cover the stalls that ended in this
    /// last stretch of time.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub window: u64,
    /// How many culprits to list.
    #[arg(short = 'n', long, default_value_t = 15)]
    pub top: usize,
}

/// Stall time of one culprit in the window, by part kind.
#[derive(Default, Clone, Copy)]
struct Split {
    on_cpu: u64,
    blocked: u64,
    runqueue: u64,
    gil: u64,
    throttled: u64,
}

impl Split {
    fn add(&mut self, kind: PartKind, ns: u64) {
        match kind {
            PartKind::OnCpu => self.on_cpu += ns,
            PartKind::OffCpu => self.blocked += ns,
            PartKind::Runqueue => self.runqueue += ns,
            PartKind::GilWait => self.gil += ns,
            PartKind::Throttled => self.throttled += ns,
        }
    }
    fn total(&self) -> u64 {
        self.on_cpu + self.blocked + self.runqueue + self.gil + self.throttled
    }
}

/// The stalls that ended within the last `window_ns`, with their process.
struct Window {
    window_ns: u64,
    stalls: VecDeque<(u32, Stall)>,
    /// When watching began: the rate's denominator until a window has passed.
    since_ns: u64,
    /// Which frames are the application's (`--app-path`).
    app: AppPaths,
}

impl Window {
    fn push(&mut self, pid: u32, s: Stall) {
        self.stalls.push_back((pid, s));
    }

    fn expire(&mut self, now_ns: u64) {
        let from = now_ns.saturating_sub(self.window_ns);
        self.stalls.retain(|(_, s)| s.end_ns >= from);
    }

    /// Stalls per second over the window (or since watching began).
    fn rate(&self, now_ns: u64) -> f64 {
        self.rate_of(self.stalls.len(), now_ns)
    }

    /// `n` stalls as a rate over the window (or since watching began).
    fn rate_of(&self, n: usize, now_ns: u64) -> f64 {
        let span = now_ns
            .saturating_sub(self.since_ns)
            .min(self.window_ns)
            .max(1);
        n as f64 * 1e9 / span as f64
    }

    /// Culprits by stall time, heaviest first, with their split and the
    /// ASGI routes their stalls served (heaviest first).
    fn culprits(&self) -> Vec<(String, Split, Vec<String>)> {
        self.rank(self.stalls.iter().map(|(_, s)| s))
    }

    /// [`Window::culprits`] of some of the window's stalls.
    fn rank<'a>(
        &self,
        stalls: impl Iterator<Item = &'a Stall>,
    ) -> Vec<(String, Split, Vec<String>)> {
        let mut by: HashMap<String, (Split, HashMap<String, u64>)> = HashMap::new();
        for s in stalls {
            let route = s.route.as_ref().map(|r| r.describe());
            for p in &s.stacks {
                let label = culprit_name(p, &self.app);
                let e = by.entry(label).or_default();
                e.0.add(p.kind, p.weight_ns);
                if let Some(r) = &route {
                    *e.1.entry(r.clone()).or_default() += p.weight_ns;
                }
            }
        }
        let mut v: Vec<(String, Split, Vec<String>)> = by
            .into_iter()
            .map(|(label, (split, routes))| {
                let mut r: Vec<(String, u64)> = routes.into_iter().collect();
                r.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                (label, split, r.into_iter().map(|x| x.0).collect())
            })
            .collect();
        v.sort_by(|a, b| b.1.total().cmp(&a.1.total()).then_with(|| a.0.cmp(&b.0)));
        v
    }

    /// One row per process that is watched or stalled in the window,
    /// heaviest stall time first.
    fn processes(&self, watched: &[Watched], now_ns: u64) -> Vec<ProcRow> {
        let mut pids: Vec<u32> = watched.iter().map(|w| w.pid).collect();
        pids.extend(self.stalls.iter().map(|(pid, _)| *pid));
        pids.sort_unstable();
        pids.dedup();
        let mut rows: Vec<ProcRow> = pids
            .into_iter()
            .map(|pid| {
                let w = watched.iter().find(|w| w.pid == pid);
                let mine = || {
                    self.stalls
                        .iter()
                        .filter(|(p, _)| *p == pid)
                        .map(|(_, s)| s)
                };
                let mut d: Vec<u64> = mine().map(|s| s.duration_ns).collect();
                d.sort_unstable();
                ProcRow {
                    label: w.map_or_else(|| format!("pid {pid}"), |w| w.label.clone()),
                    loops: w.map_or(0, |w| w.loops),
                    exited: w.is_some_and(|w| w.exited),
                    rate: self.rate_of(d.len(), now_ns),
                    stall_ns: d.iter().sum(),
                    p99: percentile(&d, 0.99),
                    max: d.last().copied().unwrap_or(0),
                    worst: self.rank(mine()).into_iter().next().map(|c| c.0),
                    pid,
                }
            })
            .collect();
        rows.sort_by(|a, b| b.stall_ns.cmp(&a.stall_ns).then(a.pid.cmp(&b.pid)));
        rows
    }
}

/// A process of the target's tree as the driver found it: its label
/// ([`process_label`], read once), its loop threads, whether it exited.
struct Watched {
    pid: u32,
    label: String,
    loops: usize,
    exited: bool,
}

/// One row of the processes table.
struct ProcRow {
    pid: u32,
    label: String,
    loops: usize,
    exited: bool,
    rate: f64,
    stall_ns: u64,
    p99: u64,
    max: u64,
    /// The culprit with the most stall time in its stalls in the window.
    worst: Option<String>,
}

/// The names the processes go by on the screen, by their roles in the
/// watched tree (`uvicorn worker 2 (pid 1240)`), as the recording's
/// outputs name them ([`Process::title`]): from facts read once each,
/// while the process runs, and which of them ran a loop.
fn process_labels(facts: &[Facts]) -> HashMap<u32, String> {
    Process::from_facts(facts)
        .into_iter()
        .map(|p| (p.pid, p.title()))
        .collect()
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn pct(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * part as f64 / total as f64
    }
}

/// One screen, lines separated by `\r\n` (the terminal is in raw mode).
/// `watched`: the processes of the target's tree known to the engine.
fn screen(
    w: &Window,
    watched: &[Watched],
    head: &str,
    busy_now_ns: u64,
    threshold_ns: u64,
    now_ns: u64,
    top: usize,
) -> String {
    let mut d: Vec<u64> = w.stalls.iter().map(|(_, s)| s.duration_ns).collect();
    d.sort_unstable();
    let mut all = Split::default();
    for (_, s) in &w.stalls {
        for p in &s.stacks {
            all.add(p.kind, p.weight_ns);
        }
    }
    let mut out = String::new();
    let _ = writeln!(out, "{head}");
    let _ = writeln!(
        out,
        "stalls/s: {:.2}   in window: {}   p99: {}   max: {}{}",
        w.rate(now_ns),
        d.len(),
        fmt_ns(percentile(&d, 0.99)),
        fmt_ns(d.last().copied().unwrap_or(0)),
        if busy_now_ns >= threshold_ns {
            format!("   STALLED NOW: {}", fmt_ns(busy_now_ns))
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        out,
        "time in stalls: on-CPU {:.0}%, blocked {:.0}%, run-queue {:.0}%, GIL wait {:.0}%, CPU throttled {:.0}%",
        pct(all.on_cpu, all.total()),
        pct(all.blocked, all.total()),
        pct(all.runqueue, all.total()),
        pct(all.gil, all.total()),
        pct(all.throttled, all.total())
    );
    let held = held_up_totals(w.stalls.iter().map(|(_, s)| s));
    let not_read: usize = held.not_read.values().sum();
    if held.timers > 0 || not_read > 0 {
        let timers = if held.timers > 0 {
            format!(
                "timers up to {} late (p99 {}), {} timers in {} stalls",
                fmt_ns(held.worst_ns),
                fmt_ns(held.p99_ns),
                held.timers,
                held.delaying
            )
        } else {
            "no timers delayed".to_string()
        };
        let unread = if not_read > 0 {
            format!("; not read for {not_read} stalls")
        } else {
            String::new()
        };
        let _ = writeln!(out, "held up: {timers}{unread}");
    }
    // The latest stall that ran in an OpenTelemetry span: its ids, to look
    // the request up in a tracing UI.
    if let Some((s, ids)) = w
        .stalls
        .iter()
        .rev()
        .find_map(|(_, s)| Some((s, s.trace()?)))
    {
        let route = s
            .route
            .as_ref()
            .map(|r| format!("{}  ", escape(&r.describe())))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "last traced stall: {}  {route}trace {} span {}",
            fmt_ns(s.duration_ns),
            escape(&ids.trace_id),
            escape(&ids.span_id)
        );
    }
    let _ = writeln!(out);
    let procs = w.processes(watched, now_ns);
    if procs.len() > 1 {
        processes_table(&mut out, &procs);
        let _ = writeln!(out);
    }
    let _ = writeln!(
        out,
        "{:>10} {:>6} {:>7} {:>8} {:>6} {:>6} {:>6}  CULPRIT",
        "STALL TIME", "SHARE", "ON-CPU", "BLOCKED", "RUNQ", "GIL", "THROT"
    );
    let total = all.total();
    for (label, s, routes) in w.culprits().into_iter().take(top) {
        let t = s.total();
        let label = match routes.split_first() {
            None => label,
            Some((r, [])) => format!("{label} — in {r}"),
            Some((r, more)) => format!("{label} — in {r} and {} more", more.len()),
        };
        let _ = writeln!(
            out,
            "{:>10} {:>5.1}% {:>6.0}% {:>7.0}% {:>5.0}% {:>5.0}% {:>5.0}%  {}",
            fmt_ns(t),
            pct(t, total),
            pct(s.on_cpu, t),
            pct(s.blocked, t),
            pct(s.runqueue, t),
            pct(s.gil, t),
            pct(s.throttled, t),
            escape(&label)
        );
    }
    if w.stalls.is_empty() {
        let _ = writeln!(out, "  (no stall of {} or more yet)", fmt_ns(threshold_ns));
    }
    out.replace('\n', "\r\n")
}

/// The processes table: who stalls, how often, how long, on what.
fn processes_table(out: &mut String, rows: &[ProcRow]) {
    let labels: Vec<String> = rows
        .iter()
        .map(|r| {
            let l = escape(&r.label);
            if r.exited {
                format!("{l} exited")
            } else {
                l.into_owned()
            }
        })
        .collect();
    let width = labels
        .iter()
        .map(|l| l.chars().count())
        .max()
        .unwrap_or(0)
        .clamp(7, 40);
    let _ = writeln!(
        out,
        "{:<width$} {:>5} {:>9} {:>9} {:>9}  WORST CULPRIT",
        "PROCESS", "LOOPS", "STALLS/S", "P99", "MAX"
    );
    // A process with no stall in the window has no p99 or max.
    let dur = |ns: u64| if ns == 0 { "-".into() } else { fmt_ns(ns) };
    for (r, label) in rows.iter().zip(labels) {
        let _ = writeln!(
            out,
            "{label:<width$} {:>5} {:>9.2} {:>9} {:>9}  {}",
            r.loops,
            r.rate,
            dur(r.p99),
            dur(r.max),
            r.worst.as_deref().map_or("-".into(), escape)
        );
    }
}

/// The terminal in non-canonical mode without echo (a key press arrives at
/// once, Ctrl-C still signals), restored on drop.
struct RawTerm {
    saved: Option<libc::termios>,
}

impl RawTerm {
    fn new() -> RawTerm {
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        if !std::io::stdin().is_terminal() || unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return RawTerm { saved: None };
        }
        let saved = t;
        t.c_lflag &= !(libc::ICANON | libc::ECHO);
        t.c_cc[libc::VMIN] = 1;
        t.c_cc[libc::VTIME] = 0;
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        RawTerm { saved: Some(saved) }
    }
}

impl Drop for RawTerm {
    fn drop(&mut self) {
        if let Some(t) = self.saved {
            unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        }
    }
}

/// Key presses, read by a thread of their own (a blocking read of stdin
/// that ends with the process).
fn keys() -> tokio::sync::mpsc::UnboundedReceiver<u8> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        let mut stdin = std::io::stdin();
        while let Ok(1) = stdin.read(&mut b) {
            if tx.send(b[0]).is_err() {
                break;
            }
        }
    });
    rx
}

pub fn run(a: TopArgs) -> Result<String> {
    if let Some(why) = refuse_target(a.pid) {
        bail!("{why}");
    }
    for &tid in &a.stall.tids {
        if let Some(why) = refuse_thread(a.pid, tid) {
            bail!("{why}");
        }
    }
    if a.window == 0 {
        bail!("--window must be longer than 0, e.g. --window 60s");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(top(a))
}

async fn top(a: TopArgs) -> Result<String> {
    let pid = a.pid;
    let threshold_ns = a.stall.threshold;
    let tids: Option<HashSet<u32>> =
        (!a.stall.tids.is_empty()).then(|| a.stall.tids.iter().copied().collect());
    let mut live = Live::attach(
        pid,
        threshold_ns,
        tids,
        a.stall.frequency,
        crate::kernel::probe::default_sample_after(threshold_ns),
        a.stall.probes,
        !a.stall.no_subprocesses,
    )?;
    live.first_upkeep();
    let comm = read_comm(pid, pid).unwrap_or_else(|| "?".into());
    let head = format!(
        "stallprof top — pid {pid} ({}), stalls ≥ {}, window {}   (q quits)",
        escape(&comm),
        fmt_ns(threshold_ns),
        fmt_ns(a.window)
    );
    let mut window = Window {
        window_ns: a.window,
        stalls: VecDeque::new(),
        since_ns: monotonic_ns(),
        app: AppPaths::new(&a.app.app_paths),
    };
    let term = RawTerm::new();
    let mut keys = keys();
    let mut stdin_open = true;
    let mut stdout = std::io::stdout();
    let mut drawn: Option<Instant> = None;
    // The target's processes: pid -> exited, each read once when first
    // seen (an exited one keeps its facts, and its name).
    let mut seen: HashMap<u32, bool> = HashMap::new();
    let mut facts: Vec<Facts> = Vec::new();
    let ended_by = loop {
        let key = async {
            if stdin_open {
                keys.recv().await
            } else {
                std::future::pending().await
            }
        };
        match live.next(key).await? {
            Step::Stop(why) => break why,
            Step::Other(Some(b'q' | b'Q')) => break "q",
            // stdin closed: no key will come; keep drawing until a signal.
            Step::Other(None) => stdin_open = false,
            Step::Other(_) => {}
            Step::Tick(_) => {
                if !process_alive(pid) || live.root_gone() {
                    break "target exit";
                }
                let now = monotonic_ns();
                let mut new: Vec<u32> = std::iter::once(pid)
                    .chain(live.engine.executor_pids())
                    .collect();
                for (p, s) in live.engine.take_stalls() {
                    new.push(p);
                    window.push(p, s);
                }
                for p in new {
                    seen.entry(p).or_insert_with(|| {
                        facts.push(Facts::read(p, "?"));
                        false
                    });
                }
                for f in facts.iter_mut() {
                    f.ran_loop |= live.looped().contains(&f.pid);
                }
                // Gone: no longer in the watched tree.
                for (p, gone) in seen.iter_mut() {
                    *gone = !live.watched().contains(p);
                }
                window.expire(now);
                // An exited process leaves the screen with its last stall.
                seen.retain(|p, gone| !*gone || window.stalls.iter().any(|(q, _)| q == p));
                facts.retain(|f| seen.contains_key(&f.pid));
                if drawn.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    let labels = process_labels(&facts);
                    let watched: Vec<Watched> = seen
                        .iter()
                        .map(|(&p, &exited)| Watched {
                            pid: p,
                            label: labels
                                .get(&p)
                                .cloned()
                                .unwrap_or_else(|| format!("pid {p}")),
                            loops: live.engine.executors(p).len(),
                            exited,
                        })
                        .collect();
                    let text = screen(
                        &window,
                        &watched,
                        &head,
                        live.engine.busy_now_ns(now),
                        threshold_ns,
                        now,
                        a.top,
                    );
                    // Home, draw, clear what the last screen left below.
                    let _ = write!(stdout, "\x1b[H\x1b[2J{text}");
                    let _ = stdout.flush();
                    drawn = Some(Instant::now());
                }
            }
        }
    };
    drop(term);
    let fin = live.finish();
    drop(fin);
    Ok(format!(
        "stallprof top: pid {pid} watched until {ended_by}; probes detached\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frame, FrameKind};
    use crate::testing;

    fn stall(end_ns: u64, dur: u64, name: &str, kind: PartKind) -> Stall {
        let frames = vec![Frame::new(name, FrameKind::Python)];
        // The window reads the parts only: the split stays zero.
        Stall {
            on_cpu_ns: 0,
            off_cpu_ns: 0,
            runqueue_ns: 0,
            throttled_ns: 0,
            ..testing::stall(end_ns - dur, vec![testing::part(kind, dur, frames)])
        }
    }

    #[test]
    fn window_ranks_culprits_and_forgets_old_stalls() {
        let s = 1_000_000_000u64;
        let mut w = Window {
            window_ns: 60 * s,
            stalls: VecDeque::new(),
            since_ns: 0,
            app: AppPaths::default(),
        };
        w.push(1, stall(5 * s, 100_000_000, "old", PartKind::OnCpu));
        w.push(1, stall(70 * s, 200_000_000, "load", PartKind::OnCpu));
        w.push(1, stall(71 * s, 300_000_000, "load", PartKind::OffCpu));
        w.push(1, stall(72 * s, 100_000_000, "gil", PartKind::GilWait));
        w.expire(80 * s);
        assert_eq!(w.stalls.len(), 3);
        let c = w.culprits();
        assert_eq!(c[0].0, "load");
        assert_eq!((c[0].1.on_cpu, c[0].1.blocked), (200_000_000, 300_000_000));
        assert_eq!(c[1].0, "gil");
        assert!((w.rate(80 * s) - 3.0 / 60.0).abs() < 1e-9);
        let text = screen(&w, &[], "head", 0, 50_000_000, 80 * s, 10);
        assert!(text.contains("stalls/s: 0.05"), "{text}");
        assert!(
            !text.contains("PROCESS"),
            "one process: no processes table\n{text}"
        );
        assert!(
            text.contains("max: 300.0ms") || text.contains("max: 300ms"),
            "{text}"
        );
        assert!(!text.contains('\n') || text.contains("\r\n"));
        assert!(
            !text.contains("held up"),
            "nothing read: nothing said\n{text}"
        );
        let mut held = stall(73 * s, 100_000_000, "load", PartKind::OnCpu);
        held.held_up = Some(crate::model::HeldUp::Read(crate::model::Delayed {
            timers_late_ns: vec![99_000_000, 80_000_000],
            ready_handles: 1,
            truncated: false,
        }));
        w.push(1, held);
        let text = screen(&w, &[], "head", 0, 50_000_000, 80 * s, 10);
        assert!(
            text.contains("held up: timers up to 99.0ms late (p99 99.0ms), 2 timers in 1 stalls"),
            "{text}"
        );
        assert!(!text.contains("traced"), "{text}");
        let mut traced = stall(74 * s, 120_000_000, "load", PartKind::OnCpu);
        traced.task = Some(crate::model::Task {
            name: "Task-9".into(),
            trace: Some(crate::model::SpanIds::new(0xabc, 0xdef)),
            ..Default::default()
        });
        w.push(1, traced);
        let text = screen(&w, &[], "head", 0, 50_000_000, 80 * s, 10);
        assert!(
            text.contains(
                "last traced stall: 120.0ms  trace 00000000000000000000000000000abc span 0000000000000def"
            ),
            "{text}"
        );
    }

    /// A supervisor and two workers (issue 34): a row per process, each
    /// with its own rate, max and worst culprit; the supervisor, watched
    /// but never stalling, has a row with no stall.
    #[test]
    fn processes_table_has_a_row_per_process() {
        let s = 1_000_000_000u64;
        let ms = 1_000_000u64;
        let mut w = Window {
            window_ns: 10 * s,
            stalls: VecDeque::new(),
            since_ns: 0,
            app: AppPaths::default(),
        };
        w.push(1201, stall(20 * s, 300 * ms, "render", PartKind::OnCpu));
        w.push(1201, stall(21 * s, 100 * ms, "tokenize", PartKind::OnCpu));
        w.push(1202, stall(22 * s, 80 * ms, "bcrypt", PartKind::OnCpu));
        w.expire(25 * s);
        let watched = [
            Watched {
                pid: 1200,
                label: "uvicorn (1200)".into(),
                loops: 0,
                exited: false,
            },
            Watched {
                pid: 1201,
                label: "python3 (1201)".into(),
                loops: 1,
                exited: false,
            },
            Watched {
                pid: 1202,
                label: "python3 (1202)".into(),
                loops: 1,
                exited: true,
            },
        ];
        let rows = w.processes(&watched, 25 * s);
        let pids: Vec<u32> = rows.iter().map(|r| r.pid).collect();
        assert_eq!(pids, [1201, 1202, 1200], "heaviest stall time first");
        assert_eq!((rows[0].max, rows[0].p99), (300 * ms, 300 * ms));
        assert_eq!(rows[0].worst.as_deref(), Some("render"));
        assert_eq!(rows[1].worst.as_deref(), Some("bcrypt"));
        assert_eq!((rows[2].max, rows[2].worst.as_deref()), (0, None));
        assert!((rows[0].rate - 0.2).abs() < 1e-9, "2 stalls in 10 s");
        let text = screen(&w, &watched, "head", 0, 50 * ms, 25 * s, 10);
        let lines: Vec<&str> = text.split("\r\n").collect();
        let head = lines
            .iter()
            .position(|l| l.starts_with("PROCESS"))
            .unwrap_or_else(|| panic!("no processes table:\n{text}"));
        let row = |i: usize| lines[head + i].split_whitespace().collect::<Vec<_>>();
        assert_eq!(
            row(1),
            [
                "python3", "(1201)", "1", "0.20", "300.0ms", "300.0ms", "render"
            ],
            "{text}"
        );
        assert_eq!(
            row(2),
            [
                "python3", "(1202)", "exited", "1", "0.10", "80.0ms", "80.0ms", "bcrypt"
            ],
            "{text}"
        );
        assert_eq!(
            row(3),
            ["uvicorn", "(1200)", "0", "0.00", "-", "-", "-"],
            "{text}"
        );
        let culprits = lines
            .iter()
            .position(|l| l.contains("CULPRIT") && !l.starts_with("PROCESS"));
        assert!(
            culprits.is_some_and(|c| c > head + 3),
            "the culprits below the processes:\n{text}"
        );
        // Stalls from two processes, none watched: two rows all the same.
        let text = screen(&w, &[], "head", 0, 50 * ms, 25 * s, 10);
        assert!(
            text.contains("pid 1201") && text.contains("pid 1202"),
            "{text}"
        );
    }
}
