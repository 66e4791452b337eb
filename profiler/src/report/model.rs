//! The recording as users see it: symbolized stalls, serialized as
//! `stalls.json`. Everything after symbolization (aggregation, rendering,
//! `stallprof report`) works from these types alone.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::pipeline::stall::PartKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrameKind {
    /// Machine code of the target (C, C++, Rust, the interpreter itself).
    Native,
    Kernel,
    Python,
    /// Not a function: `[off-cpu: read]`, `[runqueue]`, `[unknown]`, ...
    Marker,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
    pub kind: FrameKind,
    /// Native frames: base name of the object file (`libc.so.6`, `python3.11`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<String>,
}

impl Frame {
    pub fn new(name: impl Into<String>, kind: FrameKind) -> Frame {
        Frame {
            name: name.into(),
            file: None,
            line: None,
            kind,
            module: None,
        }
    }

    pub fn marker(name: impl Into<String>) -> Frame {
        Frame {
            name: name.into(),
            file: None,
            line: None,
            kind: FrameKind::Marker,
            module: None,
        }
    }

    /// Folded-stack text: the plain name first, then `(file:line)` with the
    /// file's base name, e.g. `load_tokenizer (tok.py:41)`. Control
    /// characters are escaped ([`crate::report::label::escape`]) and `;`,
    /// the folded format's separator, becomes `:`, so a label is always one
    /// frame on one line.
    pub fn label(&self) -> String {
        let mut s = self.name.clone();
        if let Some(file) = &self.file {
            let base = file.rsplit('/').next().unwrap_or(file);
            match self.line {
                Some(l) if l > 0 => s.push_str(&format!(" ({base}:{l})")),
                _ => s.push_str(&format!(" ({base})")),
            }
        }
        crate::report::label::escape(&s).replace(';', ":")
    }
}

/// Stall time attributed to one stack.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StackPart {
    /// Outermost frame first.
    pub frames: Vec<Frame>,
    pub weight_ns: u64,
    pub kind: PartKind,
    /// Off-CPU: the syscall the thread blocked in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub syscall: Option<String>,
    /// Off-CPU: the thread that woke it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waker_tid: Option<u32>,
    /// `gil_wait`: who held the GIL, and what it was running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gil_holder: Option<GilHolder>,
}

/// The thread holding a CPython GIL that an executor thread waited for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GilHolder {
    pub tid: Option<u32>,
    pub thread_name: Option<String>,
    /// The holder's Python frames when the wait began, outermost first.
    pub frames: Vec<Frame>,
}

impl GilHolder {
    /// `worker (tid 12) in match_all (w.py:12)`.
    pub fn describe(&self) -> String {
        let who = match (&self.thread_name, self.tid) {
            (Some(n), Some(t)) => format!("{n} (tid {t})"),
            (None, Some(t)) => format!("tid {t}"),
            _ => "another thread".to_string(),
        };
        match self.frames.last() {
            Some(f) => format!("{who} in {}", f.label()),
            None => who,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stall {
    pub tid: u32,
    pub thread_name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub duration_ns: u64,
    pub on_cpu_ns: u64,
    pub off_cpu_ns: u64,
    pub runqueue_ns: u64,
    #[serde(default)]
    pub incomplete: bool,
    /// asyncio: the coroutine the task running at the stall was started
    /// from (outermost Python frame under the task step), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coroutine: Option<String>,
    pub stacks: Vec<StackPart>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recording {
    pub pid: u32,
    pub comm: String,
    pub threshold_ns: u64,
    pub sample_hz: u64,
    /// The kernel's sampling gate: CPU samples in the first this-many ns of
    /// each busy period were skipped (their on-CPU time is spread over the
    /// later samples); 0 for every sample.
    #[serde(default)]
    pub sample_after_ns: u64,
    /// Work the sampling gate saved, by name (`short_busy_periods`: busy
    /// periods never reported; `samples_before_gate`: samples skipped).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kernel_filtered: BTreeMap<String, u64>,
    /// Busy periods of loop threads that reached userspace (each loop
    /// iteration is one; add `kernel_filtered.short_busy_periods` for all).
    #[serde(default)]
    pub busy_periods: u64,
    /// Always "monotonic": timestamps are CLOCK_MONOTONIC nanoseconds.
    pub clock: String,
    pub started_ns: u64,
    pub ended_ns: u64,
    /// Events the kernel could not deliver (ring buffer full).
    pub lost_events: u64,
    /// Every non-zero failure counter of the BPF programs and the agent.
    pub drops: BTreeMap<String, u64>,
    /// Threads seen parking in an event-loop wait.
    #[serde(default)]
    pub executor_threads: Vec<ThreadInfo>,
    #[serde(default)]
    pub stallprof_version: String,
    /// Runtimes found in the target that could not be read (e.g. an
    /// unsupported CPython): their stalls carry native frames only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runtime_problems: Vec<RuntimeProblem>,
    pub stalls: Vec<Stall>,
}

/// A runtime stallprof found but could not read, said plainly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeProblem {
    pub pid: u32,
    /// e.g. `cpython 3.16.0`.
    pub runtime: String,
    /// What is missing because of it.
    pub what: String,
    /// The reason, as found.
    pub why: String,
    /// What the user can do.
    pub remedy: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadInfo {
    pub tid: u32,
    pub name: String,
}

impl Recording {
    pub fn total_stall_ns(&self) -> u64 {
        self.stalls.iter().map(|s| s.duration_ns).sum()
    }
}
