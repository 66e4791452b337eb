//! What every section measures with: a child process whose output is
//! collected ([`Proc`]), a process's CPU time and peak RSS from /proc, and
//! the medians and spreads the tables quote.
use std::{
    fs,
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// A child whose stderr (and optionally stdout) lines are collected with
/// their arrival time. Killed (SIGKILL) when dropped.
pub(super) struct Proc {
    pub(super) child: Child,
    pub(super) started: Instant,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    what: String,
}

impl Proc {
    pub(super) fn spawn(cmd: &mut Command) -> Result<Proc> {
        let what = format!("{cmd:?}");
        let started = Instant::now();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        for r in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            thread::spawn(move || {
                for line in BufReader::new(r).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push((Instant::now(), line));
                }
            });
        }
        Ok(Proc {
            child,
            started,
            lines,
            what,
        })
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a line containing `needle`; its arrival time.
    pub(super) fn wait_line(&mut self, needle: &str, timeout: Duration) -> Result<Instant> {
        let deadline = Instant::now() + timeout;
        // An exit is final only once the reader thread had time to store
        // the last lines: they are looked at once more after it.
        let mut exited = None;
        loop {
            if let Some((t, _)) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(_, l)| l.contains(needle))
            {
                return Ok(*t);
            }
            if let Some(st) = exited {
                bail!(
                    "{} exited ({st}) before printing {needle:?}:\n{}",
                    self.what,
                    self.text()
                );
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                thread::sleep(Duration::from_millis(100));
                exited = Some(st);
                continue;
            }
            if Instant::now() > deadline {
                bail!(
                    "{} printed no {needle:?} within {timeout:?}:\n{}",
                    self.what,
                    self.text()
                );
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    pub(super) fn text(&self) -> String {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub(super) fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status();
    }

    /// Waits for exit; kills after `timeout`. True if it exited by itself.
    pub(super) fn wait(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                thread::sleep(Duration::from_millis(50)); // let the readers drain
                return true;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return false;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGINT, then wait (SIGKILL after `timeout`).
    pub(super) fn stop(&mut self, timeout: Duration) -> bool {
        self.signal("INT");
        self.wait(timeout)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// utime + stime of a process (all its threads), in seconds.
pub(super) fn cpu_secs(pid: u32, clk_tck: f64) -> Option<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm: state(0) ppid(1) ... utime(11) stime(12)
    let ut: f64 = f.get(11)?.parse().ok()?;
    let st: f64 = f.get(12)?.parse().ok()?;
    Some((ut + st) / clk_tck)
}

/// CPU time of every thread of `pid` (`sum_exec_runtime` from each
/// thread's schedstat: ns, where utime+stime counts 10 ms ticks), in s.
pub(super) fn task_cpu_secs(pid: u32) -> Option<f64> {
    let mut ns = 0u64;
    for t in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let s = fs::read_to_string(t.path().join("schedstat")).ok()?;
        ns += s.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e9)
}

/// Peak RSS (VmHWM) in MiB.
pub(super) fn vm_hwm_mib(pid: u32) -> Option<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = l.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

pub(super) fn wait_file(path: &Path, timeout: Duration) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(s) = fs::read_to_string(path)
            && !s.trim().is_empty()
        {
            return Ok(s);
        }
        if Instant::now() > deadline {
            bail!("{} did not appear within {timeout:?}", path.display());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------
// Statistics and formatting

pub(super) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

pub(super) fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// `median (min–max)` with `prec` decimals, or `—`.
pub(super) fn spread(v: &[f64], prec: usize) -> String {
    let v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return "—".into();
    }
    let m = median(&v);
    if v.len() == 1 {
        return format!("{m:.prec$}");
    }
    let (lo, hi) = min_max(&v);
    format!("{m:.prec$} ({lo:.prec$}–{hi:.prec$})")
}

pub(super) fn rel(p: &Path, root: &Path) -> String {
    p.strip_prefix(root)
        .map(|r| r.display().to_string())
        .unwrap_or_else(|_| p.display().to_string())
}

// ---------------------------------------------------------------------------
// Header

/// A report's commands: `title` (a leading newline kept), then `lines` in
/// a shell block, then a blank line.
pub(super) fn commands_block(s: &mut String, title: &str, lines: &[String]) {
    use std::fmt::Write;
    let _ = writeln!(s, "{title}\n\n```sh");
    for l in lines {
        let _ = writeln!(s, "{l}");
    }
    let _ = writeln!(s, "```\n");
}
