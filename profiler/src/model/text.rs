//! How the vocabulary is said in text: the one escape every name goes
//! through, and the words each model value is shown in (frame labels,
//! holder and task descriptions, a part's kind, the target's ids).
//!
//! In: model values, whose names the target controls (a Python qualname,
//! a symbol, a thread name, a file path, a command name). Out: text with
//! control characters spelled out: `\n`, `\r`, `\t` as those two
//! characters, every other C0 control, DEL and C1 control as `\xNN`
//! (`\u{NN}` above 0xff is not needed: only these code points move a cursor
//! or end a line). A newline in a qualname thus stays one line of
//! `stalls.folded`, and a name cannot rewrite the terminal. Backslashes are
//! left alone so that ordinary names print unchanged.
//!
//! Kept beside the model, below every stage, and apart from its data: the
//! symbolizer names a GIL wait's marker frame with these words
//! (`[gil wait: held by …]`), and every output says a frame the same way.
use std::borrow::Cow;

use super::{
    CpuHolder, Frame, FrameKind, GilHolder, HolderRelation, PartKind, Process, ProcessInfo,
    Recording, Role, Route, StackPart, Stall, Task,
};

fn is_control(c: char) -> bool {
    c.is_control() // C0, DEL and C1 (U+0080–U+009F)
}

/// `s` for HTML text or a quoted attribute: `&`, `<`, `>` and `"` as
/// entities (the daemon's and `report --serve`'s pages). Control
/// characters are the caller's: pass [`escape`]d text.
pub fn html(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `s` with its control characters escaped; borrowed when there are none.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if is_control(c) => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

impl Frame {
    /// Folded-stack text: the plain name first, then `(file:line)` with the
    /// file's base name, e.g. `load_tokenizer (tok.py:41)`. Control
    /// characters are escaped ([`escape`]) and `;`,
    /// the folded format's separator, becomes `:`, so a label is always one
    /// frame on one line.
    pub fn label(&self) -> String {
        let mut s = self.name.to_string();
        if let Some(file) = &self.file {
            let base = file.rsplit('/').next().unwrap_or(file);
            match self.line {
                Some(l) if l > 0 => s.push_str(&format!(" ({base}:{l})")),
                _ => s.push_str(&format!(" ({base})")),
            }
        }
        escape(&s).replace(';', ":")
    }

    /// The function without the line: `parse_resume (app.py)`, escaped as
    /// [`Frame::label`]. One function is one entry point whichever line
    /// of it was running.
    pub fn function_label(&self) -> String {
        Frame {
            line: None,
            ..self.clone()
        }
        .label()
    }
}

impl FrameKind {
    /// Its name in `stalls.json`: `native`, `python`, `js`, …
    pub fn as_str(self) -> &'static str {
        match self {
            FrameKind::Native => "native",
            FrameKind::Kernel => "kernel",
            FrameKind::Python => "python",
            FrameKind::Js => "js",
            FrameKind::Marker => "marker",
            FrameKind::EventLoop => "event_loop",
            FrameKind::Process => "process",
            FrameKind::Group => "group",
        }
    }
}

impl Stall {
    /// The qualified name of the stall's coroutine, without a line
    /// (`Gateway.handle_request`): pprof's `task` label, `--group-by
    /// task`'s root. [`Stall::coroutine`] is its frame's label, whose line
    /// is where the task's coroutine was when the task was read
    /// (`Gateway.handle_request (gateway.py:145)`), not where each sample
    /// was: the frame of that function and file in the stall's stacks
    /// gives the name alone; should none be there, the label's name.
    pub fn coroutine_name(&self) -> Option<String> {
        let label = self.coroutine.as_deref()?;
        let function = without_line(label);
        let frame = self
            .stacks
            .iter()
            .flat_map(|p| &p.frames)
            .find(|f| f.kind == FrameKind::Python && f.function_label() == function);
        Some(match frame {
            Some(f) => escape(&f.name).into_owned(),
            None => function
                .strip_suffix(')')
                .and_then(|l| l.rsplit_once(" ("))
                .map_or(function.as_str(), |(name, _)| name)
                .to_string(),
        })
    }
}

/// A frame label without its line: `f (app.py:12)` → `f (app.py)`.
fn without_line(label: &str) -> String {
    if let Some(inner) = label.strip_suffix(')')
        && let Some((head, line)) = inner.rsplit_once(':')
        && !line.is_empty()
        && line.bytes().all(|b| b.is_ascii_digit())
    {
        return format!("{head})");
    }
    label.to_string()
}

impl StackPart {
    /// What this part's time was, in words: `on-CPU`, `blocked in read`,
    /// `run queue`, `CPU throttled`, `woken from epoll_wait, waiting for a
    /// CPU`, `GIL wait`.
    pub fn kind_text(&self) -> String {
        let syscall = self.syscall.as_deref().unwrap_or("?");
        match (self.kind, self.woken) {
            (PartKind::OnCpu, _) => "on-CPU".into(),
            (PartKind::OffCpu, _) => format!("blocked in {syscall}"),
            (PartKind::GilWait, _) => "GIL wait".into(),
            (PartKind::Runqueue, false) => "run queue".into(),
            (PartKind::Runqueue, true) => format!("woken from {syscall}, waiting for a CPU"),
            (PartKind::Throttled, false) => "CPU throttled".into(),
            (PartKind::Throttled, true) => format!("woken from {syscall}, CPU throttled"),
        }
    }
}

/// `cpuhog (pid 4242) 1.1s 92%, idle CPU 96.0ms 8%`: the `top` heaviest
/// holders with the time each held the CPU and their share of the time
/// it was held (all holders' time); None when there are none.
pub fn cpu_held_by(holders: &[CpuHolder], top: usize) -> Option<String> {
    let total: u64 = holders.iter().map(|h| h.ns).sum();
    if total == 0 {
        return None;
    }
    let mut v: Vec<&CpuHolder> = holders.iter().collect();
    v.sort_by(|a, b| b.ns.cmp(&a.ns).then_with(|| a.pid.cmp(&b.pid)));
    let mut parts: Vec<String> = v
        .iter()
        .take(top)
        .map(|h| {
            format!(
                "{} {} {:.0}%",
                h.describe(),
                crate::os::units::fmt_ns(h.ns),
                100.0 * h.ns as f64 / total as f64
            )
        })
        .collect();
    if v.len() > top {
        let rest: u64 = v[top..].iter().map(|h| h.ns).sum();
        parts.push(format!(
            "{} more {}",
            v.len() - top,
            crate::os::units::fmt_ns(rest)
        ));
    }
    Some(parts.join(", "))
}

/// The profiler's own threads among CPU holders: said as such, so that
/// "CPU held by stallprof" reads as the cost it is, not as a culprit.
pub fn is_stallprof(h: &CpuHolder) -> bool {
    h.comm == "stallprof" || h.comm.starts_with("stallprof-")
}

impl CpuHolder {
    /// `cpuhog (pid 4242)`, `python3 (tid 12, same process)`, `idle CPU`.
    pub fn describe(&self) -> String {
        let comm = escape(&self.comm);
        match self.relation {
            HolderRelation::Idle => "idle CPU".into(),
            HolderRelation::SameProcess => format!("{comm} (tid {}, same process)", self.pid),
            HolderRelation::SameContainer => {
                format!("{comm} (pid {}, same container)", self.tgid)
            }
            HolderRelation::Other if self.pid == 0 => comm.into_owned(),
            HolderRelation::Other => format!("{comm} (pid {})", self.tgid),
        }
    }
}

impl GilHolder {
    /// `worker (tid 12) in match_all (w.py:12)`; in a container
    /// `worker (tid 12, 3 in its namespace) in ...`.
    pub fn describe(&self) -> String {
        let tid = self.tid.map(|t| match self.ns_tid {
            Some(ns) => format!("tid {t}, {ns} in its namespace"),
            None => format!("tid {t}"),
        });
        let who = match (&self.thread_name, tid) {
            (Some(n), Some(t)) => format!("{n} ({t})"),
            (None, Some(t)) => t,
            _ => "another thread".to_string(),
        };
        match self.frames.last() {
            Some(f) => format!("{who} in {}", f.label()),
            None => who,
        }
    }
}

impl Route {
    /// `POST /resume/{rid}`: the label every output shows.
    pub fn describe(&self) -> String {
        format!("{} {}", self.method, self.template)
    }
}

impl Task {
    /// `"conn-12" (handle_client)`, with the await chain when known:
    /// `"batch-3" (run_batch) ← "main-server"`.
    pub fn describe(&self) -> String {
        let mut s = format!("{:?}", self.name);
        if let Some(c) = &self.coro {
            s.push_str(&format!(" ({c})"));
        }
        for a in &self.awaited_by {
            s.push_str(&format!(" ← {a:?}"));
        }
        s
    }
}

impl ProcessInfo {
    /// `pid 4242` with what else identifies it: `pid 4242 (1 in its
    /// namespace, docker container 3f2a9c0b1d4e)`.
    pub fn describe(&self, pid: u32) -> String {
        let mut more = Vec::new();
        if let Some(ns) = self.ns_pid {
            more.push(format!("{ns} in its namespace"));
        }
        if let Some(c) = &self.container {
            more.push(c.describe());
        }
        if more.is_empty() {
            format!("pid {pid}")
        } else {
            format!("pid {pid} ({})", more.join(", "))
        }
    }
}

impl Process {
    /// Its name among the recording's processes: `uvicorn worker 2 (pid
    /// 1240)`, `uvicorn supervisor (pid 1200)`, `node cluster worker 3
    /// (pid 77)`, `python3 (pid 42)` — the flamegraph's root frame, the
    /// pprof `process` label, the Perfetto process track. Escaped.
    pub fn title(&self) -> String {
        let name = match &self.role {
            Some(Role::Worker { n, of }) => format!("{of} worker {n}"),
            Some(r) => format!("{} {r}", self.comm),
            None => self.comm.clone(),
        };
        escape(&format!("{name} (pid {})", self.pid)).into_owned()
    }

    /// `pid 1240 worker 1 of uvicorn`, `pid 42 python3` (no role): the
    /// summary's words. Escaped.
    pub fn describe(&self) -> String {
        match &self.role {
            Some(r) => escape(&format!("pid {} {r}", self.pid)).into_owned(),
            None => escape(&format!("pid {} {}", self.pid, self.comm)).into_owned(),
        }
    }
}

impl Recording {
    /// The recording's title, as the flamegraph and speedscope show it:
    /// `stallprof: pid 4242 (python3) — 12 stalls ≥ 20.0ms, 1.43s of stall
    /// time`.
    pub fn title(&self) -> String {
        format!(
            "stallprof: {} — {} stalls ≥ {}, {} of stall time",
            self.target(),
            self.stalls.len(),
            crate::os::units::fmt_ns(self.threshold_ns),
            crate::os::units::fmt_ns(self.total_stall_ns())
        )
    }

    /// The target for titles: `pid 4242 (python3)`, and in a container
    /// `pid 4242 (python3; pid 1 in its namespace, docker container
    /// 3f2a9c0b1d4e; tid 4242 = 1, 4250 = 9 in its namespace)`: the ids the
    /// application's own logs show next to the host's. Names escaped.
    pub fn target(&self) -> String {
        let mut more = vec![escape(&self.comm).into_owned()];
        let mut ids = Vec::new();
        if let Some(ns) = self.process.ns_pid {
            ids.push(format!("pid {ns} in its namespace"));
        }
        if let Some(c) = &self.process.container {
            ids.push(escape(&c.describe()).into_owned());
        }
        if !ids.is_empty() {
            more.push(ids.join(", "));
        }
        let tids: Vec<String> = self
            .stall_threads()
            .iter()
            .filter_map(|t| t.ns_tid.map(|ns| format!("{} = {ns}", t.tid)))
            .collect();
        const SHOWN: usize = 4;
        if !tids.is_empty() {
            let rest = tids.len().saturating_sub(SHOWN);
            let mut s = format!("tid {}", tids[..tids.len().min(SHOWN)].join(", "));
            if rest > 0 {
                s.push_str(&format!(" (+{rest} more)"));
            }
            more.push(format!("{s} in its namespace"));
        }
        format!("pid {} ({})", self.pid, more.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn controls_are_spelled_out() {
        assert_eq!(escape("plain name (a.py:3)"), "plain name (a.py:3)");
        assert_eq!(escape("evil\nname"), "evil\\nname");
        assert_eq!(escape("a\rb\tc"), "a\\rb\\tc");
        assert_eq!(escape("\x1b[2Jx\x7f"), "\\x1b[2Jx\\x7f");
        assert_eq!(escape("\u{85}"), "\\x85");
        assert_eq!(escape("ünïcode ✓"), "ünïcode ✓");
    }
}
