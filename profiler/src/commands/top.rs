//! `stallprof top --pid PID`: a live terminal view of a running target's
//! stalls, redrawn every second — what `py-spy top` gives for CPU, for
//! stalls.
//!
//! In: the stalls the engine finishes ([`Live`], the same driving loop as
//! `record`). Out: the screen: stalls per second, p99 and max over a
//! sliding window, the stall now in progress, and the culprits ranked by
//! stall time in the window with its split (on-CPU, blocked, run-queue,
//! GIL wait). Plain ANSI (clear and redraw): no TUI library for one table.
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
    model::{PartKind, Stall},
    os::clock::monotonic_ns,
    os::proc::{process_alive, read_comm, refuse_target, refuse_thread},
    os::units::{fmt_ns, parse_duration},
    report::aggregate::culprit_name,
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

/// The stalls that ended within the last `window_ns`.
struct Window {
    window_ns: u64,
    stalls: VecDeque<Stall>,
    /// When watching began: the rate's denominator until a window has passed.
    since_ns: u64,
    /// Which frames are the application's (`--app-path`).
    app: AppPaths,
}

impl Window {
    fn push(&mut self, s: Stall) {
        self.stalls.push_back(s);
    }

    fn expire(&mut self, now_ns: u64) {
        let from = now_ns.saturating_sub(self.window_ns);
        self.stalls.retain(|s| s.end_ns >= from);
    }

    /// Stalls per second over the window (or since watching began).
    fn rate(&self, now_ns: u64) -> f64 {
        let span = now_ns
            .saturating_sub(self.since_ns)
            .min(self.window_ns)
            .max(1);
        self.stalls.len() as f64 * 1e9 / span as f64
    }

    /// Culprits by stall time, heaviest first, with their split and the
    /// ASGI routes their stalls served (heaviest first).
    fn culprits(&self) -> Vec<(String, Split, Vec<String>)> {
        let mut by: HashMap<String, (Split, HashMap<String, u64>)> = HashMap::new();
        for s in &self.stalls {
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
fn screen(
    w: &Window,
    head: &str,
    busy_now_ns: u64,
    threshold_ns: u64,
    now_ns: u64,
    top: usize,
) -> String {
    let mut d: Vec<u64> = w.stalls.iter().map(|s| s.duration_ns).collect();
    d.sort_unstable();
    let mut all = Split::default();
    for s in &w.stalls {
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
    let _ = writeln!(out);
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
                for (_, s) in live.engine.take_stalls() {
                    window.push(s);
                }
                window.expire(now);
                if drawn.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    let text = screen(
                        &window,
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
        w.push(stall(5 * s, 100_000_000, "old", PartKind::OnCpu));
        w.push(stall(70 * s, 200_000_000, "load", PartKind::OnCpu));
        w.push(stall(71 * s, 300_000_000, "load", PartKind::OffCpu));
        w.push(stall(72 * s, 100_000_000, "gil", PartKind::GilWait));
        w.expire(80 * s);
        assert_eq!(w.stalls.len(), 3);
        let c = w.culprits();
        assert_eq!(c[0].0, "load");
        assert_eq!((c[0].1.on_cpu, c[0].1.blocked), (200_000_000, 300_000_000));
        assert_eq!(c[1].0, "gil");
        assert!((w.rate(80 * s) - 3.0 / 60.0).abs() < 1e-9);
        let text = screen(&w, "head", 0, 50_000_000, 80 * s, 10);
        assert!(text.contains("stalls/s: 0.05"), "{text}");
        assert!(
            text.contains("max: 300.0ms") || text.contains("max: 300ms"),
            "{text}"
        );
        assert!(!text.contains('\n') || text.contains("\r\n"));
    }
}
