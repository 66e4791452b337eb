//! The recording as users see it: symbolized stalls, serialized as
//! `stalls.json`. Everything after symbolization (aggregation, rendering,
//! `stallprof report`) works from these types alone.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub mod text;

pub use crate::os::container::Container;
pub use crate::os::cpu_quota::{CgroupVersion, CpuQuota, Throttling};
pub use crate::os::family::Role;

/// What a loop thread was doing in a slice of a stall: the five kinds
/// every nanosecond of a stall is exactly one of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum PartKind {
    OnCpu,
    OffCpu,
    Runqueue,
    /// Off-CPU waiting for a CPython GIL another thread holds.
    GilWait,
    /// Runnable, but its cgroup's CPU bandwidth (CFS quota) was used up.
    Throttled,
}

impl PartKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PartKind::OnCpu => "on_cpu",
            PartKind::OffCpu => "off_cpu",
            PartKind::Runqueue => "runqueue",
            PartKind::GilWait => "gil_wait",
            PartKind::Throttled => "throttled",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrameKind {
    /// Machine code of the target (C, C++, Rust, the interpreter itself).
    Native,
    Kernel,
    Python,
    /// A JavaScript function of a Node (V8) process, read from its memory.
    Js,
    /// Not a function: `[off-cpu: read]`, `[runqueue]`, `[unknown]`, ...
    Marker,
    /// The event loop's own dispatch, folded to one frame `[event loop]` by
    /// the default view ([`crate::report::view`]) for a sample taken inside
    /// it; never in `stalls.json`.
    EventLoop,
    /// The process a stall ran in (`uvicorn worker 2 (pid 1240)`): the
    /// root frame the flamegraph gives each stack of a recording with
    /// stalls in more than one process ([`crate::report::view`]); never in
    /// `stalls.json`.
    Process,
    /// The asyncio task or ASGI route a stack is grouped under
    /// (`--group-by`): its root frame in `stalls.folded` and `stalls.svg`,
    /// `task Gateway.handle_request`; never in `stalls.json`.
    Group,
}

/// A frame's name, file or module: one shared string, not a copy per frame.
/// A stall holds tens of thousands of frames, most of them the same few
/// thousand (every stack of a stall repeats the loop's outer frames, and
/// the symbolizer's caches hand out the same answer each time): with a
/// `String` each, the demo's 38 stalls held ~60 MiB of copies. A thin
/// pointer (to a `String`): a frame is 40 bytes, not 64.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Name(std::sync::Arc<String>);

impl Name {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl From<String> for Name {
    fn from(s: String) -> Name {
        Name(std::sync::Arc::new(s))
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Name {
        Name(std::sync::Arc::new(s.to_string()))
    }
}

impl From<&String> for Name {
    fn from(s: &String) -> Name {
        Name(std::sync::Arc::new(s.clone()))
    }
}

impl From<Name> for String {
    fn from(n: Name) -> String {
        std::sync::Arc::unwrap_or_clone(n.0)
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, o: &str) -> bool {
        self.0.as_str() == o
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, o: &&str) -> bool {
        self.0.as_str() == *o
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, o: &String) -> bool {
        *self.0 == *o
    }
}

impl Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Name, D::Error> {
        String::deserialize(d).map(Name::from)
    }
}

/// A stall holds one per frame of each of its stacks: keep it small.
const _: () = assert!(std::mem::size_of::<Frame>() <= 40);

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    pub name: Name,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<Name>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
    pub kind: FrameKind,
    /// Native frames: base name of the object file (`libc.so.6`, `python3.11`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<Name>,
}

/// The name of a Python frame whose code could not be read (its code
/// object was freed or moved before the read, or the read failed).
pub const UNKNOWN_PYTHON: &str = "[python: unreadable frame]";

/// [`UNKNOWN_PYTHON`]'s name in recordings written before it was renamed.
const UNKNOWN_PYTHON_BEFORE: &str = "[python ?]";

impl Frame {
    pub fn new(name: impl Into<Name>, kind: FrameKind) -> Frame {
        Frame {
            name: name.into(),
            file: None,
            line: None,
            kind,
            module: None,
        }
    }

    pub fn marker(name: impl Into<Name>) -> Frame {
        Frame {
            name: name.into(),
            file: None,
            line: None,
            kind: FrameKind::Marker,
            module: None,
        }
    }

    /// A Python frame whose code could not be read (counted where the read
    /// failed): a marker, since it names nothing.
    pub fn unknown_python() -> Frame {
        Frame::marker(UNKNOWN_PYTHON)
    }

    /// A frame the interpreter ran, named or not ([`Frame::unknown_python`]).
    pub fn is_interpreted(&self) -> bool {
        self.kind == FrameKind::Python
            || (self.kind == FrameKind::Marker
                && matches!(self.name.as_ref(), UNKNOWN_PYTHON | UNKNOWN_PYTHON_BEFORE))
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
    /// `runqueue`/`throttled` right after the loop's park returned, before
    /// its own code ran: woken from the wait `syscall`, then waiting for a
    /// CPU (or throttled). Its frames end in a `[woken from …]` marker.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub woken: bool,
}

/// Who ran on the CPU a loop thread waited for, as the kernel side names
/// it: a task, the CPU's idle task, or the tasks past the per-stall cap
/// summed as one (`[other tasks]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Holder {
    Task {
        pid: u32,
        tgid: u32,
        comm: String,
    },
    /// pid 0: the CPU was free (the wait was the loop's own throttling).
    Idle {
        comm: String,
    },
    /// The holders past the per-stall cap, summed.
    OtherTasks,
}

/// The name a [`CpuHolder`] carries for [`Holder::OtherTasks`] (its `comm`
/// in `stalls.json`).
pub const OTHER_TASKS: &str = "[other tasks]";

impl Holder {
    /// (pid, tgid, comm) as `stalls.json` carries them.
    pub fn ids(&self) -> (u32, u32, &str) {
        match self {
            Holder::Task { pid, tgid, comm } => (*pid, *tgid, comm),
            Holder::Idle { comm } => (0, 0, comm),
            Holder::OtherTasks => (0, 0, OTHER_TASKS),
        }
    }
}

/// Holders are ordered by (pid, tgid, comm): the tie-break of holders
/// that held a CPU equally long.
impl Ord for Holder {
    fn cmp(&self, o: &Holder) -> std::cmp::Ordering {
        self.ids().cmp(&o.ids())
    }
}

impl PartialOrd for Holder {
    fn partial_cmp(&self, o: &Holder) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// A task that held the CPU a loop thread waited for during a stall.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuHolder {
    /// Thread id and process id; 0 for the idle task (the CPU was free:
    /// the wait was the loop's own throttling) and for `[other tasks]`.
    pub pid: u32,
    pub tgid: u32,
    pub comm: String,
    /// How long it held the CPU while the loop thread waited.
    pub ns: u64,
    pub relation: HolderRelation,
}

/// Whose task held the CPU, seen from the stalled process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HolderRelation {
    /// Another thread of the stalled process.
    SameProcess,
    /// A process in the same container (its cgroup path names the same one).
    SameContainer,
    /// Anything else on the host.
    Other,
    /// The idle task: nobody; the CPU was free.
    Idle,
}

/// The thread holding a CPython GIL that an executor thread waited for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GilHolder {
    pub tid: Option<u32>,
    /// Its id in the target's PID namespace, when that is not the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_tid: Option<u32>,
    pub thread_name: Option<String>,
    /// The holder's Python frames when the wait began, outermost first.
    pub frames: Vec<Frame>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stall {
    /// The host pid of the stall's process. A recording from before it
    /// was recorded has 0 here on disk, read as the recording's `pid`
    /// ([`Recording::complete`]).
    #[serde(default)]
    pub pid: u32,
    pub tid: u32,
    /// The thread's id in the target's PID namespace (what the application
    /// logs in a container), when that is not `tid`: from the engine's
    /// thread descriptor ([`ThreadInfo`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_tid: Option<u32>,
    pub thread_name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub duration_ns: u64,
    pub on_cpu_ns: u64,
    pub off_cpu_ns: u64,
    pub runqueue_ns: u64,
    /// Runnable but held off the CPU by its cgroup's quota (CFS
    /// throttling); `on_cpu_ns + off_cpu_ns + runqueue_ns + throttled_ns ==
    /// duration_ns`.
    #[serde(default)]
    pub throttled_ns: u64,
    /// Who held the CPU while the thread waited for it, heaviest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cpu_holders: Vec<CpuHolder>,
    #[serde(default)]
    pub incomplete: bool,
    /// asyncio: the coroutine the task running at the stall was started
    /// from (outermost Python frame under the task step), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coroutine: Option<String>,
    /// asyncio: the Task that was running when the stall began, when it
    /// could be read and checked against the stall's stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<Task>,
    /// Python, when no asyncio task ran (a plain `call_soon`/`call_later`
    /// callback, an I/O callback, a loop other than asyncio's): the
    /// OpenTelemetry span of the thread's own current context
    /// (`PyThreadState.context`, the callback's), or why it could not be
    /// read. None when a task ran (its context is [`Task::trace`]), or the
    /// context held no span. Read [`Stall::trace`], not this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_context: Option<ContextTrace>,
    /// ASGI: the request the stall served (uvicorn/hypercorn running
    /// Starlette/FastAPI), read from its scope and checked against the
    /// stall's stack; None when not a request or not read (the miss is
    /// counted, `asgi_route_*`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<Route>,
    /// What the stall held up: the loop's timers that came due during it
    /// and the callbacks queued behind it, or why that was not read. None
    /// in a recording from before it was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_up: Option<HeldUp>,
    pub stacks: Vec<StackPart>,
}

impl Stall {
    /// The OpenTelemetry span the stall ran in: its task's context's, or,
    /// with no task, its thread's own context's. The one accessor every
    /// output uses.
    pub fn trace(&self) -> Option<&SpanIds> {
        match &self.task {
            Some(t) => t.trace.as_ref(),
            None => self.thread_context.as_ref()?.trace.as_ref(),
        }
    }

    /// Why the context [`Stall::trace`] comes from could not be read.
    pub fn trace_unreadable(&self) -> Option<&str> {
        match &self.task {
            Some(t) => t.trace_unreadable.as_deref(),
            None => self.thread_context.as_ref()?.trace_unreadable.as_deref(),
        }
    }
}

/// What a stall held up, read from its event loop's own queues while the
/// stall held it (asyncio: `_scheduled` and `_ready`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeldUp {
    Read(Delayed),
    NotRead(NotRead),
}

/// The loop's work a stall delayed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delayed {
    /// How late each timer that came due by the stall's end ran, worst
    /// first: the stall's end minus the timer's due time (it runs right
    /// after the stall). The last is the latest-due timer's. Empty: no
    /// timer came due.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timers_late_ns: Vec<u64>,
    /// Callbacks (task steps, I/O callbacks) queued behind the running one.
    #[serde(default)]
    pub ready_handles: u32,
    /// A queue was longer than the reader's cap: the counts are lower bounds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

impl Delayed {
    /// How late the worst delayed timer ran.
    pub fn worst_late_ns(&self) -> Option<u64> {
        self.timers_late_ns.first().copied()
    }

    /// How late the latest-due delayed timer ran.
    pub fn latest_due_late_ns(&self) -> Option<u64> {
        self.timers_late_ns.last().copied()
    }
}

/// Why a stall's held-up work was not read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotRead {
    pub reason: NotReadReason,
    /// What was found (the loop's type, the error), when there is more to say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NotReadReason {
    /// Not read for this runtime (Node/libuv, tokio, C, a Python loop that
    /// is neither asyncio's nor uvloop's).
    Runtime,
    /// The read finished after the stall had ended: the loop had run the
    /// due timers by then.
    AfterEnd,
    /// No read was made while the stall lasted (no stack with Python
    /// frames came in time).
    NoRead,
    /// The thread's loop was not known, or its queues could not be read.
    Unreadable,
}

impl NotReadReason {
    /// The phrase after "held up: not read — ".
    pub fn describe(self) -> &'static str {
        match self {
            NotReadReason::Runtime => "not read for this runtime",
            NotReadReason::AfterEnd => "the read came after the stall ended",
            NotReadReason::NoRead => "no read while the stall lasted",
            NotReadReason::Unreadable => "the loop could not be read",
        }
    }
}

/// An ASGI request's method and route template, as the application
/// declared it (`/resume/{rid}`), not the requested path.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Route {
    /// `GET`, `POST`, ...; `WEBSOCKET` for a websocket.
    pub method: String,
    /// The matched route's `path`: `/resume/{rid}`.
    pub template: String,
}

/// An asyncio Task, as read from the target.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// `Task.get_name()`: what `create_task(..., name=...)` gave, else
    /// asyncio's default `Task-N`.
    pub name: String,
    /// Qualified name of the task's coroutine (`Server.handle_client`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coro: Option<String>,
    /// CPython 3.14+: the tasks awaiting this one, nearest first (who
    /// awaits it, who awaits that, ...), as `python -m asyncio pstree`
    /// shows them. Empty when none does, or before 3.14.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub awaited_by: Vec<String>,
    /// The OpenTelemetry span current in the task's context when it was
    /// read (the request's span, or a child span its code opened), as the
    /// service's own SDK reports it. None: no span, or not readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<SpanIds>,
    /// Why the task's OpenTelemetry context could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_unreadable: Option<String>,
}

/// The OpenTelemetry span of a `contextvars.Context` as read: its ids,
/// or why they could not be read (neither: the context held no span).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextTrace {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<SpanIds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_unreadable: Option<String>,
}

impl ContextTrace {
    /// Whether it says anything (a span, or why none was read).
    pub fn is_empty(&self) -> bool {
        self.trace.is_none() && self.trace_unreadable.is_none()
    }
}

/// A span's ids in W3C trace-context form: 32 and 16 lowercase hex digits
/// (what OTLP, `traceparent` headers and tracing UIs show).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SpanIds {
    pub trace_id: String,
    pub span_id: String,
}

impl SpanIds {
    pub fn new(trace_id: u128, span_id: u64) -> Self {
        SpanIds {
            trace_id: format!("{trace_id:032x}"),
            span_id: format!("{span_id:016x}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recording {
    pub pid: u32,
    pub comm: String,
    /// Who the process is beyond its host pid: its namespace pid, its
    /// container.
    #[serde(flatten, default)]
    pub process: ProcessInfo,
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
    /// Which kernel probes the recording ran on (empty: a recording from
    /// before they were recorded).
    #[serde(default)]
    pub probes: ProbeSet,
    /// The target's CPU limit (its cgroup's quota) and that cgroup's
    /// throttling counters at the start and end of the recording.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_quota: Option<CpuQuota>,
    /// `--app-path` prefixes: where the application's code is; empty for
    /// the guess ([`crate::classify`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub app_paths: Vec<String>,
    /// Every process the recording watched or found a stall in, the
    /// target (`pid`) first, then by pid ([`Recording::complete`] keeps it
    /// so).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<Process>,
    pub stalls: Vec<Stall>,
}

/// A process of a recording: the target, or one under it. Its role
/// (`supervisor`, `worker 2 of uvicorn`) is derived from the whole watched
/// tree ([`crate::os::family::roles`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    pub pid: u32,
    pub comm: String,
    /// Its namespace pid and container.
    #[serde(flatten, default)]
    pub info: ProcessInfo,
    /// Its parent's pid, when it was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// The service name its own OpenTelemetry SDK reports, from its
    /// environment (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

impl Process {
    /// The processes of a table of facts read while they ran, each with
    /// its role, in the table's order.
    pub fn from_facts(table: &[crate::os::family::Facts]) -> Vec<Process> {
        let mut roles = crate::os::family::roles(table);
        table
            .iter()
            .map(|f| Process {
                pid: f.pid,
                comm: f.comm.clone(),
                info: ProcessInfo {
                    ns_pid: f.ns_pid,
                    container: f.container.clone(),
                },
                parent: f.parent,
                role: roles.remove(&f.pid),
                service: f.service.clone(),
            })
            .collect()
    }
}

/// Which kernel probes a recording ran on, and why any part fell back:
/// the summary says it, since the fallbacks cost every process on the host.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeSet {
    pub scheduler: SchedulerProbes,
    pub waits: WaitProbes,
    /// Why any part fell back, and wait functions probed at their entry
    /// (single-stepped: dearer), one line each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl ProbeSet {
    /// True when some part runs a program for every process on the host:
    /// the scheduler on tracepoints (raw or classic: every context switch),
    /// the waits on the syscall tracepoints (every syscall).
    pub fn host_wide(&self) -> bool {
        self.scheduler.host_wide() || self.waits.on_tracepoints()
    }
}

/// The scheduler's probes in a [`ProbeSet`]. Its name ([`Self::as_str`])
/// is what `stalls.json`, the summary and the daemon's `mode` label say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "&'static str", try_from = "String")]
pub enum SchedulerProbes {
    /// A recording from before the probes were recorded (`""`).
    #[default]
    Unrecorded,
    /// A `context-switches` perf event on each watched thread (the default).
    ThreadEvents,
    /// The raw `sched_switch` and `sched_wakeup` tracepoints.
    RawTracepoints,
    /// The classic ones (the fallback).
    Tracepoints,
}

impl SchedulerProbes {
    const ALL: [SchedulerProbes; 4] = [
        Self::Unrecorded,
        Self::ThreadEvents,
        Self::RawTracepoints,
        Self::Tracepoints,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unrecorded => "",
            Self::ThreadEvents => "thread_perf_events",
            Self::RawTracepoints => "raw_tracepoints",
            Self::Tracepoints => "tracepoints",
        }
    }

    /// A program runs at every context switch on the host.
    pub fn host_wide(self) -> bool {
        matches!(self, Self::RawTracepoints | Self::Tracepoints)
    }
}

impl From<SchedulerProbes> for &'static str {
    fn from(s: SchedulerProbes) -> &'static str {
        s.as_str()
    }
}

impl TryFrom<String> for SchedulerProbes {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown scheduler probes {s:?}"))
    }
}

/// The wait probes in a [`ProbeSet`], named as [`SchedulerProbes`] are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "&'static str", try_from = "String")]
pub enum WaitProbes {
    /// A recording from before the probes were recorded (`""`).
    #[default]
    Unrecorded,
    /// Uprobes on the watched processes' C library wait functions.
    Uprobes,
    /// The wait syscalls' tracepoints, host-wide.
    Tracepoints,
    /// Uprobes first, the tracepoints once some process needed them.
    UprobesThenTracepoints,
}

impl WaitProbes {
    const ALL: [WaitProbes; 4] = [
        Self::Unrecorded,
        Self::Uprobes,
        Self::Tracepoints,
        Self::UprobesThenTracepoints,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unrecorded => "",
            Self::Uprobes => "uprobes",
            Self::Tracepoints => "tracepoints",
            Self::UprobesThenTracepoints => "uprobes+tracepoints",
        }
    }

    /// The syscall tracepoints serve (a program runs at every syscall on
    /// the host); the uprobes, if any, stood down.
    pub fn on_tracepoints(self) -> bool {
        matches!(self, Self::Tracepoints | Self::UprobesThenTracepoints)
    }
}

impl From<WaitProbes> for &'static str {
    fn from(w: WaitProbes) -> &'static str {
        w.as_str()
    }
}

impl TryFrom<String> for WaitProbes {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown wait probes {s:?}"))
    }
}

#[cfg(test)]
mod probe_set_tests {
    use super::*;

    /// The names stalls.json has always carried (docs/format.md), each read
    /// back as the mode it names.
    #[test]
    fn probe_modes_keep_their_names_on_the_wire() {
        let names = |json: String| json.trim_matches('"').to_string();
        for (m, want) in SchedulerProbes::ALL.into_iter().zip([
            "",
            "thread_perf_events",
            "raw_tracepoints",
            "tracepoints",
        ]) {
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(names(json.clone()), want);
            assert_eq!(serde_json::from_str::<SchedulerProbes>(&json).unwrap(), m);
        }
        for (m, want) in
            WaitProbes::ALL
                .into_iter()
                .zip(["", "uprobes", "tracepoints", "uprobes+tracepoints"])
        {
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(names(json.clone()), want);
            assert_eq!(serde_json::from_str::<WaitProbes>(&json).unwrap(), m);
        }
        assert!(serde_json::from_str::<WaitProbes>("\"kprobes\"").is_err());
        let set: ProbeSet = serde_json::from_str(r#"{"scheduler":"","waits":""}"#).unwrap();
        assert_eq!(set, ProbeSet::default());
    }
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

/// A process's identity beyond its host pid, read once when the engine
/// first sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// Its pid in its own PID namespace, when that is not the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_pid: Option<u32>,
    /// The container its cgroup path names, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<Container>,
}

/// A thread as the engine first saw it: the one place its name and
/// namespace id are read; stalls and GIL holders take them from here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadInfo {
    pub tid: u32,
    pub name: String,
    /// Its id in its own PID namespace, when that is not `tid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_tid: Option<u32>,
}

#[cfg(test)]
impl Recording {
    /// A 10 s recording of `stalls` in pid 1 (`python3`, 20 ms threshold,
    /// 999 Hz) with nothing else to say: tests override what they look at
    /// (`Recording { threshold_ns, ..Recording::for_tests(stalls) }`).
    pub(crate) fn for_tests(stalls: Vec<Stall>) -> Recording {
        Recording {
            cpu_quota: None,
            pid: 1,
            comm: "python3".into(),
            process: Default::default(),
            threshold_ns: 20_000_000,
            sample_hz: 999,
            sample_after_ns: 0,
            kernel_filtered: Default::default(),
            busy_periods: 0,
            clock: "monotonic".into(),
            started_ns: 0,
            ended_ns: 10_000_000_000,
            lost_events: 0,
            drops: Default::default(),
            executor_threads: Vec::new(),
            stallprof_version: String::new(),
            runtime_problems: Vec::new(),
            probes: Default::default(),
            app_paths: Vec::new(),
            processes: Vec::new(),
            stalls,
        }
        .completed()
    }
}

impl Recording {
    /// What a recording from before processes were recorded (or one whose
    /// facts were partly lost) lacks, from what it has: a stall's process
    /// is the target's when not recorded (0); the target's entry in
    /// `processes` is its own top-level `pid`, `comm` and `process`
    /// (those are its one owner), first; a process with stalls but no
    /// entry gets one that knows only its pid (`comm` `?`). Idempotent.
    pub fn complete(&mut self) {
        for s in &mut self.stalls {
            if s.pid == 0 {
                s.pid = self.pid;
            }
        }
        let target = match self.processes.iter().position(|p| p.pid == self.pid) {
            Some(i) => self.processes.remove(i),
            None => Process {
                pid: self.pid,
                comm: String::new(),
                info: ProcessInfo::default(),
                parent: None,
                role: None,
                service: None,
            },
        };
        let mut by_pid: BTreeMap<u32, Process> = std::mem::take(&mut self.processes)
            .into_iter()
            .map(|p| (p.pid, p))
            .collect();
        for s in &self.stalls {
            if s.pid != self.pid {
                by_pid.entry(s.pid).or_insert_with(|| Process {
                    pid: s.pid,
                    comm: "?".into(),
                    info: ProcessInfo::default(),
                    parent: None,
                    role: None,
                    service: None,
                });
            }
        }
        self.processes = std::iter::once(Process {
            comm: self.comm.clone(),
            info: self.process.clone(),
            ..target
        })
        .chain(by_pid.into_values())
        .collect();
    }

    /// [`Recording::complete`], by value.
    pub fn completed(mut self) -> Recording {
        self.complete();
        self
    }

    /// The process `pid` of the recording, if it has it.
    pub fn process_of(&self, pid: u32) -> Option<&Process> {
        self.processes.iter().find(|p| p.pid == pid)
    }

    /// The pids of the processes that had stalls, each once, ascending.
    pub fn stall_pids(&self) -> std::collections::BTreeSet<u32> {
        self.stalls.iter().map(|s| s.pid).collect()
    }

    /// Stalls in more than one process: the outputs then say each stall's
    /// process (a root frame per process, a `process` label).
    pub fn stalls_in_several_processes(&self) -> bool {
        let mut pids = self.stalls.iter().map(|s| s.pid);
        pids.next().is_some_and(|first| pids.any(|p| p != first))
    }

    pub fn total_stall_ns(&self) -> u64 {
        self.stalls.iter().map(|s| s.duration_ns).sum()
    }

    /// Where the timelines (Perfetto, speedscope) start: the recording's
    /// start, or a stall's from before it (none is) rather than cut it.
    pub fn first_ns(&self) -> u64 {
        self.stalls
            .iter()
            .map(|s| s.start_ns)
            .chain([self.started_ns])
            .min()
            .unwrap_or(0)
    }

    /// The stalls' CPU-throttled time, summed.
    pub fn throttled_ns(&self) -> u64 {
        self.stalls.iter().map(|s| s.throttled_ns).sum()
    }

    /// The threads of the stalls (and the loop threads), each once, by
    /// tid: what the recording knows of their ids.
    pub fn stall_threads(&self) -> Vec<ThreadInfo> {
        let mut by_tid: BTreeMap<u32, ThreadInfo> = self
            .executor_threads
            .iter()
            .map(|t| (t.tid, t.clone()))
            .collect();
        for s in &self.stalls {
            by_tid.entry(s.tid).or_insert_with(|| ThreadInfo {
                tid: s.tid,
                name: s.thread_name.clone(),
                ns_tid: s.ns_tid,
            });
        }
        by_tid.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stall's span has one owner: its task's context when a task ran
    /// (even one without a span), else its thread's context.
    #[test]
    fn a_stalls_trace_is_its_tasks_else_its_threads() {
        let thread = ContextTrace {
            trace: Some(SpanIds::new(1, 2)),
            trace_unreadable: None,
        };
        let mut s = crate::testing::stall(0, vec![]);
        assert_eq!(s.trace(), None);
        s.thread_context = Some(thread.clone());
        assert_eq!(s.trace(), thread.trace.as_ref());
        s.task = Some(Task {
            name: "Task-1".into(),
            trace_unreadable: Some("torn".into()),
            ..Default::default()
        });
        assert_eq!(s.trace(), None, "a task ran: its context, not the thread's");
        assert_eq!(s.trace_unreadable(), Some("torn"));
        s.task = None;
        s.thread_context = Some(ContextTrace {
            trace: None,
            trace_unreadable: Some("bad hamt".into()),
        });
        assert_eq!(s.trace_unreadable(), Some("bad hamt"));
        let json = serde_json::to_value(&s.thread_context).unwrap();
        assert_eq!(json, serde_json::json!({"trace_unreadable": "bad hamt"}));
    }
}
