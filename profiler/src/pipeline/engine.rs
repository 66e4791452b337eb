//! The engine: one pipeline for `record`, `daemon` and replay.
//!
//! ```text
//! source ──bytes──> decode ──> unwind ──> assemble ──> symbolize ──> stalls
//! (ring buffer,     (event)    (unwind)   (stall,      (symbolize,    (taken by the
//!  or a recording)                         loops)       python)        command's sinks)
//!        ^                                   │
//!        └──────── Control (the probes; nothing when replaying) <── loop keys,
//!                                                   Python thread states, park probes
//! ```
//!
//! In: raw ring-buffer records ([`Engine::handle_record`]), from the kernel
//! or from a saved recording. Out: symbolized [`Stall`]s per process
//! ([`Engine::take_stalls`]), the loop threads found, failure counters.
//! Feedback to the kernel goes through [`Control`] only, so replay runs the
//! very same code with [`NoControl`].
//!
//! A live engine reads runtimes and symbols from `/proc` (upkeep in
//! [`Engine::tick`]); with [`Engine::save_to`] it also writes a recording
//! that replays everything: the raw records before unwinding
//! (`events.bin.gz`), what the unwinder read (`unwind.json.gz`) and every
//! symbol answer (`symbols.json`). [`Engine::replaying`] reads them back.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs,
    io::{BufRead, BufReader, BufWriter, Read, Write},
    path::Path,
    time::Duration,
};

use flate2::{Compression, read::GzDecoder, write::GzEncoder};

use anyhow::{Context, Result};
use log::{debug, info, warn};
use profiler_common::{MAX_USTACK, PyProc};

use crate::{
    assemble::stall::{Output, RawStall, Tracker, TrackerConfig},
    kernel::event::{self, Event},
    kernel::probe::{ProbeError, Probes},
    kernel::runtimes::ParkPoint,
    model::{Holder, ProcessInfo, Route, RuntimeProblem, Stall, Task, ThreadInfo},
    os::outdir::{OutDir, PendingFile},
    os::proc::{read_comm, read_namespace_id},
    os::units::fmt_ns,
    pipeline::discovery::{Answer, Discovery},
    pipeline::routes::{Routes, Want},
    pipeline::symbolizer::{self, Done, Job, Native, Symbolizer, Worker},
    pipeline::watch::{PythonWatch, RuntimeWatch},
    symbolize::python::{self, Captured},
    symbolize::{
        Answers, Recorder, ResolveRuntime, RuntimeReader, SharedMaps, TableResolver, Unnamed,
    },
    unwind::{UnwindBundle, UnwindOutcome, Unwinder, UserRegs},
};

/// Everything the engine tells the kernel side. The probes implement it;
/// a replay has no kernel to tell ([`NoControl`]).
pub trait Control {
    /// `tid`'s loop wait is `key` (`LOOP_KEYS`).
    fn set_loop_key(&mut self, tid: u32, key: u64);
    /// `tid` is no loop thread any more (exited).
    fn forget_loop_thread(&mut self, tid: u32);
    /// How to walk process `tgid`'s Python stacks.
    fn set_python_proc(&mut self, tgid: u32, p: PyProc);
    /// Process `tgid` (with Python threads `tids`) is gone.
    fn forget_python_proc(&mut self, tgid: u32, tids: &[u32]);
    /// Thread -> `PyThreadState*` updates.
    fn set_python_threads(&mut self, fresh: &[(u32, u64)], gone: &[u32]);
    /// A runtime's park function, for one process or all.
    fn attach_park(&mut self, point: &ParkPoint, pid: Option<u32>) -> Result<(), ProbeError>;
    /// Watch process `pid`'s loop waits (uprobes on its wait functions):
    /// false while it maps none yet; `last_try` falls back.
    fn watch_waits(&mut self, pid: u32, last_try: bool) -> bool;
}

impl Control for Probes {
    fn set_loop_key(&mut self, tid: u32, key: u64) {
        Probes::set_loop_key(self, tid, key)
    }
    fn forget_loop_thread(&mut self, tid: u32) {
        Probes::forget_loop_thread(self, tid)
    }
    fn set_python_proc(&mut self, tgid: u32, p: PyProc) {
        Probes::set_python_proc(self, tgid, p)
    }
    fn forget_python_proc(&mut self, tgid: u32, tids: &[u32]) {
        Probes::forget_python_proc(self, tgid, tids)
    }
    fn set_python_threads(&mut self, fresh: &[(u32, u64)], gone: &[u32]) {
        Probes::set_python_threads(self, fresh, gone)
    }
    fn attach_park(&mut self, point: &ParkPoint, pid: Option<u32>) -> Result<(), ProbeError> {
        Probes::attach_park(self, point, pid)
    }
    fn watch_waits(&mut self, pid: u32, last_try: bool) -> bool {
        Probes::watch_waits(self, pid, last_try)
    }
}

/// The control of a replay, and of a live engine's last drain after the
/// probes are gone: nothing to tell.
pub struct NoControl;

impl Control for NoControl {
    fn set_loop_key(&mut self, _: u32, _: u64) {}
    fn forget_loop_thread(&mut self, _: u32) {}
    fn set_python_proc(&mut self, _: u32, _: PyProc) {}
    fn forget_python_proc(&mut self, _: u32, _: &[u32]) {}
    fn set_python_threads(&mut self, _: &[(u32, u64)], _: &[u32]) {}
    fn watch_waits(&mut self, _: u32, _: bool) -> bool {
        true
    }
    fn attach_park(&mut self, _: &ParkPoint, _: Option<u32>) -> Result<(), ProbeError> {
        Ok(())
    }
}

/// Where the drain thread's answers from the target's memory come from
/// (Python frames, GIL holders, V8 functions, asyncio tasks).
enum Symbols {
    /// The live processes; `recorded`: every answer also kept for a
    /// recording (the symbolizer keeps its own, merged at the end).
    Live {
        reader: Box<RuntimeReader>,
        recorded: Option<TableResolver>,
    },
    /// A recording's symbol table (its runtime half).
    Saved(TableResolver),
}

impl Symbols {
    fn live(&mut self) -> Option<&mut RuntimeReader> {
        match self {
            Symbols::Live { reader, .. } => Some(reader),
            Symbols::Saved(_) => None,
        }
    }

    fn resolve<R>(&mut self, f: impl FnOnce(&mut dyn ResolveRuntime) -> R) -> R {
        match self {
            Symbols::Live {
                reader,
                recorded: Some(table),
            } => f(&mut Recorder {
                inner: reader.as_mut(),
                table,
            }),
            Symbols::Live { reader, .. } => f(reader.as_mut()),
            Symbols::Saved(t) => f(t),
        }
    }
}

/// Files of a saved recording, in its directory.
pub const EVENTS_FILE: &str = "events.bin.gz";
pub const UNWIND_FILE: &str = "unwind.json.gz";
pub const SYMBOLS_FILE: &str = "symbols.json";
/// How long [`Engine::first_tick`] waits for discovery between drains.
const FIRST_TICK_SLICE: Duration = Duration::from_millis(20);

/// Magic first line of `events.bin.gz`: format and version (2: stack
/// events carry the running asyncio task; preemptions the `WOKEN` flag).
const EVENTS_MAGIC: &[u8] = b"stallprof-events 2\n";
/// A recorded record longer than this is corrupt (the largest is a stack
/// event, at most ~67 KiB).
const MAX_RECORD: usize = 1 << 20;

/// Time one upkeep tick may take before the rest of the processes wait for
/// the next (see [`Engine::tick`]).
const UPKEEP_BUDGET: std::time::Duration = std::time::Duration::from_millis(30);

/// Age after which periodic upkeep re-reads a process's maps.
const MAPS_UPKEEP: std::time::Duration = std::time::Duration::from_secs(2);

/// How long stalls of a process with a perf map wait before symbolization.
const JIT_NAME_DELAY: std::time::Duration = std::time::Duration::from_secs(2);
/// Stalls held back for JIT names at most; past it the oldest goes now.
const MAX_PENDING: usize = 64;

/// The pipeline's state: one per recording, daemon (rebuilt now and then
/// to bound memory, see [`Engine::rebuild`]) or replay.
pub struct Engine {
    /// Stalls held back for JIT names: (due, job).
    pending: Vec<(std::time::Instant, Box<Job>)>,
    tracker: Tracker,
    symbols: Symbols,
    /// Native names, on the symbolizer thread (inline in a replay).
    symbolizer: Symbolizer,
    /// Maps snapshots, kept fresh here and read by the symbolizer.
    maps: SharedMaps,
    /// The last process upkeep reached (the next tick starts after it).
    upkeep_after: u32,
    /// Finds interpreters and runtimes off the drain thread.
    discovery: Discovery,
    unwinder: Unwinder,
    stalls: Vec<(u32, Stall)>,
    /// Every thread seen, by tid: read once ([`Engine::thread`]).
    threads: HashMap<u32, ThreadInfo>,
    /// Every process seen, by pid: read once ([`Engine::process`]).
    procs: HashMap<u32, ProcessInfo>,
    python: HashMap<u32, PythonWatch>,
    runtimes: HashMap<u32, RuntimeWatch>,
    /// With [`Engine::save_to`]: raw records as they came (`events.bin.gz`).
    events_out: Option<GzEncoder<BufWriter<PendingFile>>>,
    agent_drops: BTreeMap<&'static str, u64>,
    /// Stacks taken while V8 was still being looked for in their process,
    /// by pid: counted (`js_frames_v8_pending`) once it is found to be
    /// Node; a process that is not has no JavaScript frames to miss.
    js_pending_stacks: HashMap<u32, u64>,
    /// The read limits' counts when this engine started: its `drops` show
    /// the hits since ([`crate::os::limits`] keeps one process-wide tally).
    limits_base: Vec<(&'static str, u64)>,
    /// [`crate::symbolize::v8::unreadable_count`] when this engine started.
    js_unreadable_base: u64,
    exited: HashSet<u32>,
    /// Daemon: processes seen entering a wait, and those seen for the first
    /// time since the last [`Engine::take_new_waiting`] (the daemon judges
    /// them by its rules before any loop of theirs is elected).
    waiting: HashSet<u32>,
    new_waiting: Vec<u32>,
    /// The asyncio task of each open busy period, by (tid, start): read
    /// from the live process while it runs (see [`BusyTask`]).
    tasks: HashMap<(u32, u64), BusyTask>,
    /// Why a process's asyncio tasks could not be read (the latest reason,
    /// once a stall went without its name because of it).
    task_problems: BTreeMap<u32, String>,
    /// tid -> the task BPF read with its next stack event (`Event::Task`
    /// comes just before it; taken by that stack event).
    task_reads: HashMap<u32, Captured>,
    /// See [`Engine::ring_backlog_max`].
    ring_backlog_max: usize,
    /// The ASGI request of each open busy period, read next to its task.
    routes: Routes,
}

/// What the reads of one busy period's asyncio task found. The task is
/// read at the period's first stack events with Python frames (while the
/// stall is still going on) and kept only when its coroutine's frame is
/// on that stack; up to [`TASK_READS`] tries when it is not.
#[derive(Clone, Debug)]
enum BusyTask {
    Named(crate::model::Task),
    Tried { reads: u32, last: TaskMiss },
}

/// Why a busy period has no task name (the `drops` counter it becomes
/// when the period turns out to be a stall that ran a task step).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskMiss {
    /// No task was running at the reads (a plain callback).
    NoTask,
    /// A task ran, but its coroutine was not on the stall's stack.
    Unverified,
    /// The task (or asyncio's state) could not be read: why.
    Unreadable(String),
}

/// Reads of a busy period's task before giving up on it.
const TASK_READS: u32 = 4;
/// Open busy periods remembered; past this, those no longer open go.
const MAX_BUSY_TASKS: usize = 4096;

impl Engine {
    /// A live engine: runtimes, maps and symbols read from `/proc`.
    pub fn new(threshold_ns: u64, tids: Option<HashSet<u32>>) -> Engine {
        let maps = SharedMaps::default();
        let worker = Worker::new(Native::Blaze, maps.clone());
        Self::with(
            TrackerConfig { threshold_ns, tids },
            Symbols::Live {
                reader: Box::default(),
                recorded: None,
            },
            Symbolizer::threaded(worker),
            maps,
            Unwinder::new(),
        )
    }

    fn with(
        cfg: TrackerConfig,
        symbols: Symbols,
        symbolizer: Symbolizer,
        maps: SharedMaps,
        unwinder: Unwinder,
    ) -> Engine {
        Engine {
            pending: Vec::new(),
            tracker: Tracker::new(cfg),
            symbols,
            symbolizer,
            maps,
            upkeep_after: 0,
            discovery: Discovery::new(),
            unwinder,
            stalls: Vec::new(),
            threads: HashMap::new(),
            procs: HashMap::new(),
            python: HashMap::new(),
            runtimes: HashMap::new(),
            events_out: None,
            agent_drops: BTreeMap::new(),
            js_pending_stacks: HashMap::new(),
            limits_base: crate::os::limits::counts(),
            js_unreadable_base: crate::symbolize::v8::unreadable_count(),
            exited: HashSet::new(),
            waiting: HashSet::new(),
            new_waiting: Vec::new(),
            tasks: HashMap::new(),
            task_problems: BTreeMap::new(),
            task_reads: HashMap::new(),
            ring_backlog_max: 0,
            routes: Routes::default(),
        }
    }

    /// An engine that replays the recording saved in `dir` (see
    /// [`Engine::save_to`]): feed it [`read_recording`]'s records.
    pub fn replaying(dir: &Path, cfg: TrackerConfig) -> Result<Engine> {
        let path = dir.join(UNWIND_FILE);
        let f = fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let bundle: UnwindBundle = serde_json::from_reader(BufReader::new(GzDecoder::new(f)))
            .with_context(|| format!("{} is not an unwind bundle", path.display()))?;
        let path = dir.join(SYMBOLS_FILE);
        let bytes = fs::read(&path).with_context(|| format!("opening {}", path.display()))?;
        let mut table: TableResolver = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a symbol table", path.display()))?;
        let maps = SharedMaps::default();
        let worker = Worker::new(Native::Saved(Box::new(table.take_native())), maps.clone());
        Ok(Self::with(
            cfg,
            Symbols::Saved(table),
            Symbolizer::inline(worker),
            maps,
            Unwinder::replaying(bundle),
        ))
    }

    /// A fresh engine in place of this one (the daemon's memory bound: the
    /// stack table and per-process caches only grow while an engine lives).
    /// What must survive is carried over: the loop-thread registry (the
    /// kernel keeps using the published keys), the busy periods still open
    /// with the stacks they hold (nothing is cut), the thread and process
    /// descriptors and the runtime park probes already attached, the
    /// symbolizer thread with its queue (told to rebuild its caches), the
    /// discovery thread with its questions, the stalls not yet taken.
    pub fn rebuild(mut self) -> Engine {
        let cfg = self.tracker.config().clone();
        let mut next = Engine::new(cfg.threshold_ns, cfg.tids);
        self.symbolizer.reset();
        next.symbolizer = self.symbolizer;
        next.maps = self.maps;
        next.pending = self.pending;
        next.stalls = self.stalls;
        next.tracker = self.tracker.compacted();
        next.runtimes = self.runtimes;
        next.threads = self.threads;
        next.procs = self.procs;
        next.tasks = self.tasks;
        next.task_problems = self.task_problems;
        next.ring_backlog_max = self.ring_backlog_max;
        next.routes = self.routes.take();
        next.discovery = self.discovery;
        next.waiting = self.waiting;
        next.new_waiting = self.new_waiting;
        next
    }

    /// Also write a recording that replays everything into `dir`: the raw
    /// records from now on, and (on [`Engine::finish_saving`]) what the
    /// unwinder and the symbolizer read.
    pub fn save_to(&mut self, dir: &OutDir) -> Result<()> {
        let f = dir
            .create(EVENTS_FILE)
            .with_context(|| format!("creating {}", dir.join(EVENTS_FILE).display()))?;
        let mut w = GzEncoder::new(BufWriter::new(f), Compression::fast());
        w.write_all(EVENTS_MAGIC)?;
        self.events_out = Some(w);
        self.unwinder.start_saving();
        if let Symbols::Live { recorded, .. } = &mut self.symbols {
            *recorded = Some(TableResolver::default());
        }
        self.symbolizer.record();
        Ok(())
    }

    pub fn finish_saving(&mut self, dir: &OutDir) -> Result<()> {
        let persist = |w: GzEncoder<BufWriter<PendingFile>>, name: &str| -> Result<()> {
            w.finish()?
                .into_inner()
                .map_err(|e| e.into_error())?
                .persist()
                .with_context(|| format!("writing {}", dir.join(name).display()))
        };
        if let Some(w) = self.events_out.take() {
            persist(w, EVENTS_FILE)?;
        }
        if let Some(bundle) = self.unwinder.saved() {
            let f = dir
                .create(UNWIND_FILE)
                .with_context(|| format!("creating {}", dir.join(UNWIND_FILE).display()))?;
            let mut w = GzEncoder::new(BufWriter::new(f), Compression::default());
            serde_json::to_writer(&mut w, bundle)?;
            persist(w, UNWIND_FILE)?;
        }
        if let Symbols::Live {
            recorded: Some(table),
            ..
        } = &mut self.symbols
        {
            // The symbolizer's answers (after [`Engine::finish`], it has
            // stopped) over the drain's own unnamed ones.
            if let Some(native) = self.symbolizer.worker().and_then(|w| w.recorded()) {
                table.merge_native(TableResolver {
                    user: native.user.clone(),
                    kernel: native.kernel.clone(),
                    ..TableResolver::default()
                });
            }
            dir.write(SYMBOLS_FILE, &serde_json::to_vec(table)?)
                .with_context(|| format!("writing {}", dir.join(SYMBOLS_FILE).display()))?;
        }
        Ok(())
    }

    /// Thread `tid` of `tgid`, read from `/proc` the first time it is seen
    /// (its name, its id in its PID namespace); a replay knows only the
    /// names it was given.
    fn thread(&mut self, tgid: u32, tid: u32) -> ThreadInfo {
        if let Some(t) = self.threads.get(&tid) {
            return t.clone();
        }
        let t = match self.symbols {
            Symbols::Live { .. } => ThreadInfo {
                tid,
                name: read_comm(tgid, tid).unwrap_or_else(|| "?".into()),
                ns_tid: read_namespace_id(tgid, tid).filter(|&ns| ns != tid),
            },
            Symbols::Saved(_) => ThreadInfo {
                tid,
                name: "replayed".into(),
                ns_tid: None,
            },
        };
        self.threads.insert(tid, t.clone());
        t
    }

    /// Process `pid`'s identity beyond its host pid (its namespace pid, its
    /// container), read from `/proc` the first time it is seen; nothing in
    /// a replay.
    pub fn process(&mut self, pid: u32) -> ProcessInfo {
        if let Some(p) = self.procs.get(&pid) {
            return p.clone();
        }
        let p = match self.symbols {
            Symbols::Live { .. } => ProcessInfo {
                ns_pid: read_namespace_id(pid, pid).filter(|&ns| ns != pid),
                container: crate::os::container::of_process(pid),
            },
            Symbols::Saved(_) => ProcessInfo::default(),
        };
        self.procs.insert(pid, p.clone());
        p
    }

    /// Periodic upkeep for live processes: maps snapshots for symbolization
    /// and the Python thread tables BPF walks from, runtimes found.
    ///
    /// Bounded: it runs on the thread that drains the ring buffer, and a
    /// process seen for the first time costs ELF reads (its interpreter,
    /// its runtimes: tens of ms). Past [`UPKEEP_BUDGET`] the rest of `pids`
    /// waits for the next tick, which starts where this one stopped: under
    /// a churn of new processes, finding their runtimes is late, never the
    /// drain.
    pub fn tick(&mut self, pids: &[u32], probes: &mut dyn Control) {
        self.flush_pending(false);
        self.collect();
        let found = self.discovery.take();
        self.apply_found(found, probes);
        let started = std::time::Instant::now();
        let mut order: Vec<u32> = pids.to_vec();
        order.sort_unstable();
        let first = order.partition_point(|&p| p <= self.upkeep_after);
        order.rotate_left(first);
        for (i, pid) in order.into_iter().enumerate() {
            if i > 0 && started.elapsed() >= UPKEEP_BUDGET {
                *self.agent_drops.entry("upkeep_deferred").or_default() += 1;
                break;
            }
            self.upkeep_after = pid;
            // The symbolizer refreshes on an unknown address; this keeps a
            // recent snapshot for a process that exits mid-stall, or before
            // the symbolizer gets to its stalls.
            if self.symbols.live().is_some() {
                self.maps.refresh_if_older(pid, MAPS_UPKEEP);
            }
            self.process(pid);
            self.python
                .entry(pid)
                .or_insert_with(PythonWatch::new)
                .poll(pid, probes, &mut self.discovery);
            self.runtimes
                .entry(pid)
                .or_default()
                .poll(pid, probes, &mut self.discovery);
        }
    }

    /// [`Engine::tick`], then what it asked the discovery thread, waited
    /// for up to `limit`: the first upkeep of `record` and `top`, before
    /// the target is told the probes are in (its first stalls then have
    /// their Python frames, as they did when this ran on the drain). The
    /// ring is drained meanwhile, every [`FIRST_TICK_SLICE`]: a command
    /// starts running at attach, and a busy start (Node loading express, ~1 s
    /// busy) filled the 16 MiB ring while this waited on a discovery slowed
    /// by that start (events lost in the express test's fallback pass).
    pub fn first_tick(
        &mut self,
        pids: &[u32],
        probes: &mut dyn Control,
        ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
        limit: Duration,
    ) {
        self.tick(pids, probes);
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let found = self.discovery.take_all(left.min(FIRST_TICK_SLICE));
            self.apply_found(found, probes);
            self.drain(ring, probes);
            if !self.discovery.any_open() || left.is_zero() {
                return;
            }
        }
    }

    /// Apply the discovery thread's answers (to processes still watched).
    fn apply_found(&mut self, found: Vec<Answer>, probes: &mut dyn Control) {
        for a in found {
            match a {
                Answer::Python(pid, r) => {
                    if let Some(w) = self.python.get_mut(&pid) {
                        w.found(pid, r, probes);
                    }
                }
                Answer::Tokio(pid, points) => {
                    if let Some(w) = self.runtimes.get_mut(&pid) {
                        w.found(pid, &points, probes);
                    }
                }
            }
        }
    }

    pub fn python_version(&self, pid: u32) -> Option<String> {
        self.python.get(&pid).and_then(PythonWatch::version)
    }

    /// Runtimes found but not read (see [`PythonWatch`]), by pid.
    pub fn runtime_problems(&self) -> Vec<RuntimeProblem> {
        let mut v: Vec<RuntimeProblem> = self
            .python
            .values()
            .filter_map(|w| w.problem.clone())
            .collect();
        if let Symbols::Live { reader, .. } = &self.symbols {
            v.extend(reader.js_problems());
        }
        v.extend(self.task_problems.iter().map(|(&pid, why)| {
            RuntimeProblem {
                pid,
                runtime: self
                    .python_version(pid)
                    .map_or_else(|| "cpython".into(), |v| format!("cpython {v}")),
                what: "asyncio task names unavailable: stalls that ran a task do not say which \
                   (drops: asyncio_task_unreadable)"
                    .into(),
                why: why.clone(),
                remedy: "report it with the output of `python -VV`; stalls and their frames \
                     are still measured"
                    .into(),
            }
        }));
        v.extend(self.routes.problems(|pid| self.python_version(pid)));
        v.sort_by_key(|p| p.pid);
        v
    }

    /// Processes whose exit was seen since the last call.
    pub fn take_exited(&mut self) -> Vec<u32> {
        self.exited.drain().collect()
    }

    /// Daemon: the processes whose first wait was drained since the last
    /// call (again after [`Engine::forget`]).
    pub fn take_new_waiting(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.new_waiting)
    }

    /// Decode, unwind and track every record in the ring buffer; take the
    /// stalls the symbolizer has finished. Returns how many records.
    pub fn drain(
        &mut self,
        ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
        probes: &mut dyn Control,
    ) -> usize {
        let mut bytes = 0;
        let mut records = 0;
        if let Some(reader) = self.symbols.live() {
            reader.next_drain();
        }
        while let Some(item) = ring.next() {
            bytes += item.len();
            records += 1;
            self.handle_record(&item, probes);
        }
        self.ring_backlog_max = self.ring_backlog_max.max(bytes);
        self.collect();
        // An interpreter found since the last tick: its stacks walk
        // Python frames from now, not from the next tick.
        let found = self.discovery.take();
        self.apply_found(found, probes);
        records
    }

    /// Nothing waits on a drain: no busy period open, no stall held back
    /// or with the symbolizer, no request or runtime being read. The
    /// reader of an empty ring may then sleep until the kernel side wakes
    /// it with its next record.
    pub fn quiet(&self) -> bool {
        self.pending.is_empty()
            && self.symbolizer.idle()
            && !self.routes.any_held()
            && !self.discovery.any_open()
            && self.tracker.busy_threads().next().is_none()
    }

    /// The most bytes one drain found waiting in the ring buffer (its
    /// margin: the ring's size is what it may reach before events are lost).
    pub fn ring_backlog_max(&self) -> usize {
        self.ring_backlog_max
    }

    /// One record from the source: decode, unwind, assemble (and symbolize
    /// the stalls it ends).
    pub fn handle_record(&mut self, bytes: &[u8], probes: &mut dyn Control) {
        if self.events_out.is_some() {
            self.save_record(bytes);
        }
        match event::parse(bytes) {
            Ok(mut ev) => {
                // The live reads first: they look at the target as it is
                // now, and the unwinding of a process's first stacks parses
                // its modules' unwind tables (tens of ms for a large
                // extension), which could put them past the stall's end.
                self.read_live(&ev, probes);
                self.unwind_user(&mut ev, bytes);
                self.handle(ev, probes);
            }
            Err(e) => {
                let n = self.agent_drops.entry("unparsable_events").or_default();
                *n += 1;
                if *n == 1 {
                    warn!("{e}");
                }
            }
        }
    }

    /// Replace the frame-pointer user stack of a stack event with the one
    /// unwound from the copied stack bytes, unless that failed early. A
    /// frame-pointer stack that stays and fills the kernel's buffer
    /// ([`MAX_USTACK`] frames) may have lost its outer frames: counted
    /// (`user_stack_truncated`) here, where it is known to stay, not in the
    /// kernel, where most such stacks are then replaced by the unwound one.
    fn unwind_user(&mut self, ev: &mut Event, bytes: &[u8]) {
        let (Event::Sample { tgid, stack, .. } | Event::SwitchOut { tgid, stack, .. }) = ev else {
            return;
        };
        let fp_full = stack.user.len() >= MAX_USTACK;
        let Some((regs, copy)) = event::stack_copy(bytes) else {
            if fp_full {
                *self.agent_drops.entry("user_stack_truncated").or_default() += 1;
            }
            return;
        };
        let regs = UserRegs {
            ip: regs.ip,
            sp: regs.sp,
            bp: regs.bp,
        };
        let (addrs, fps, outcome) = self.unwinder.unwind_with_fp(*tgid, &regs, copy);
        match outcome {
            UnwindOutcome::Complete => {}
            UnwindOutcome::Truncated => {
                *self.agent_drops.entry("unwind_truncated").or_default() += 1
            }
            UnwindOutcome::Failed => *self.agent_drops.entry("unwind_failed").or_default() += 1,
        }
        // JavaScript frames: what identifies them is in the copy now.
        let pid = *tgid;
        let layout = self.symbols.resolve(|r| r.js_layout(pid));
        if layout.is_none() && self.symbols.live().is_some_and(|r| r.js_pending(pid)) {
            // Node's metadata is still being read on its own thread.
            *self.js_pending_stacks.entry(pid).or_default() += 1;
        } else if layout.is_some()
            && let Some(n) = self.js_pending_stacks.remove(&pid)
        {
            *self.agent_drops.entry("js_frames_v8_pending").or_default() += n;
        }
        if outcome != UnwindOutcome::Failed || addrs.len() >= stack.user.len() {
            if let Some(layout) = layout {
                stack.js = crate::symbolize::v8::js_slots(&layout, &fps, regs.sp, copy);
            }
            stack.user = addrs;
            return;
        }
        if fp_full {
            *self.agent_drops.entry("user_stack_truncated").or_default() += 1;
        }
        if let Some(layout) = layout {
            // The kernel's frame-pointer stack stays (JIT code in a mapping
            // not read yet): its frames' frame pointers are the same chain,
            // walked through the copy.
            let fps = crate::symbolize::v8::fp_chain(regs.bp, regs.sp, copy, stack.user.len());
            stack.js = crate::symbolize::v8::js_slots(&layout, &fps, regs.sp, copy);
        }
    }

    /// Append a record to `events.bin.gz`: length, then the bytes, a stack
    /// event's copy cut to its valid length.
    fn save_record(&mut self, bytes: &[u8]) {
        let bytes = &bytes[..event::saved_len(bytes)];
        let Some(w) = self.events_out.as_mut() else {
            return;
        };
        let ok = w
            .write_all(&(bytes.len() as u32).to_le_bytes())
            .and_then(|_| w.write_all(bytes));
        if let Err(e) = ok {
            warn!("writing {EVENTS_FILE}: {e}; the rest of the recording is not saved");
            self.events_out = None;
            *self.agent_drops.entry("events_not_saved").or_default() += 1;
        }
    }

    fn handle(&mut self, ev: Event, probes: &mut dyn Control) {
        if let Event::Exit {
            process, tgid, tid, ..
        } = ev
        {
            if process {
                self.exited.insert(tgid);
            }
            self.task_reads.remove(&tid);
        }
        if let Event::Sample { tgid, .. } | Event::SwitchOut { tgid, .. } = &ev
            && self.python.get(tgid).is_some_and(|w| w.problem.is_some())
        {
            // A stack of an interpreter that cannot be read: native only.
            *self
                .agent_drops
                .entry("python_frames_unavailable")
                .or_default() += 1;
        }
        if let Event::Sample { tgid, stack, .. } | Event::SwitchOut { tgid, stack, .. } = &ev
            && (!stack.python.is_empty() || !stack.holder_python.is_empty())
            && !self.tracker.stacks().contains(stack)
            && let Some(blaze) = self.symbols.live()
        {
            blaze.warm_python(*tgid, &stack.python);
            blaze.warm_python(*tgid, &stack.holder_python);
        }
        if let Event::Sample { tgid, stack, .. } | Event::SwitchOut { tgid, stack, .. } = &ev
            && !stack.js.is_empty()
            && !self.tracker.stacks().contains(stack)
            && let Some(blaze) = self.symbols.live()
        {
            blaze.warm_js(*tgid, &stack.js);
        }
        if let Event::Task { .. } = ev {
            return; // taken by read_live
        }
        let mut out = Vec::new();
        self.tracker.push(ev, &mut out);
        self.outputs(out, probes);
    }

    /// What a stack event's busy period needs read from the live target,
    /// read now: its asyncio task and its request's route (neither in a
    /// replay). A `Task` event is kept for the stack event that follows it.
    fn read_live(&mut self, ev: &Event, probes: &mut dyn Control) {
        if self.symbols.live().is_none() {
            return;
        }
        if let Event::Task {
            tid, task, memory, ..
        } = ev
        {
            self.task_reads.insert(
                *tid,
                Captured {
                    task: *task,
                    memory: memory.clone(),
                },
            );
            return;
        }
        let task_read = match ev {
            Event::Sample {
                tgid,
                tid,
                stack,
                task,
                ..
            }
            | Event::SwitchOut {
                tgid,
                tid,
                stack,
                task,
                ..
            } if !stack.python.is_empty() => {
                // What BPF sent of this task just before the stack, if it is
                // this task's.
                let memory = match self.task_reads.remove(tid) {
                    Some(c) if c.task == *task => c.memory,
                    _ => Vec::new(),
                };
                let captured = Captured {
                    task: *task,
                    memory,
                };
                Some((*tgid, *tid, stack.python.clone(), captured))
            }
            _ => None,
        };
        if let Some((tgid, tid, python, captured)) = task_read {
            self.read_task(tgid, tid, &python, &captured, probes);
            self.read_route(tgid, tid, &python);
        }
    }

    /// Reads the asyncio task of `tid`'s open busy period, unless it is
    /// known or was tried [`TASK_READS`] times; `captured`: the task BPF
    /// read with the stack (3.14+; task 0: none, read it now).
    fn read_task(
        &mut self,
        tgid: u32,
        tid: u32,
        python: &[(u64, u64)],
        captured: &Captured,
        probes: &mut dyn Control,
    ) {
        let Some(start) = self.tracker.open_period(tid) else {
            return;
        };
        let reads = match self.tasks.get(&(tid, start)) {
            Some(BusyTask::Named(_)) => return,
            Some(BusyTask::Tried { reads, .. }) if *reads >= TASK_READS => return,
            Some(BusyTask::Tried { reads, .. }) => *reads,
            None => 0,
        };
        let Some(blaze) = self.symbols.live() else {
            return;
        };
        let found = blaze.asyncio_task(tgid, tid, python, captured);
        if let Some(kernel) = blaze.kernel_task(tgid)
            && let Some(w) = self.python.get_mut(&tgid)
        {
            w.read_tasks_in_kernel(tgid, kernel, probes);
        }
        let state = match found {
            Ok(task) => BusyTask::Named(task),
            Err(miss) => BusyTask::Tried {
                reads: reads + 1,
                last: match miss {
                    crate::symbolize::python::TaskRead::Unverified => TaskMiss::Unverified,
                    crate::symbolize::python::TaskRead::Unreadable(why) => {
                        if reads == 0 {
                            debug!("pid {tgid} tid {tid}: asyncio task unreadable: {why}");
                        }
                        TaskMiss::Unreadable(why)
                    }
                    _ => TaskMiss::NoTask,
                },
            },
        };
        if self.tasks.len() >= MAX_BUSY_TASKS {
            let open = self.tracker.open_periods();
            self.tasks.retain(|k, _| open.contains(k));
        }
        self.tasks.insert((tid, start), state);
    }

    /// Reads the ASGI request of `tid`'s open busy period (see
    /// [`Routes`]), unless it is known or was tried enough.
    fn read_route(&mut self, tgid: u32, tid: u32, python: &[(u64, u64)]) {
        let Some(start) = self.tracker.open_period(tid) else {
            return;
        };
        let now = std::time::Instant::now();
        match self.routes.wants_read((tid, start), now) {
            Want::Now => self.route_read((tid, start), tgid, python, now),
            Want::Later => self.routes.hold((tid, start), tgid, python),
            Want::Never => {}
        }
    }

    /// The reads [`Engine::read_route`] held back that are due now.
    fn read_held_routes(&mut self) {
        if !self.routes.any_held() {
            return;
        }
        let now = std::time::Instant::now();
        let open = self.tracker.open_periods();
        for (key, held) in self.routes.due(now, &open) {
            self.route_read(key, held.tgid, &held.python, now);
        }
    }

    /// Read the ASGI request of period `key` (tid, start) of `tgid` now,
    /// checked against `python`, one of its stacks.
    fn route_read(
        &mut self,
        key: (u32, u64),
        tgid: u32,
        python: &[(u64, u64)],
        now: std::time::Instant,
    ) {
        let tid = key.0;
        let Some(blaze) = self.symbols.live() else {
            return;
        };
        let read = blaze.asgi_route(tgid, tid, python);
        if let Err(python::RouteRead::Unreadable(why)) = &read {
            debug!("pid {tgid} tid {tid}: ASGI route unreadable: {why}");
        }
        let tracker = &self.tracker;
        self.routes
            .record(key, read, now, || tracker.open_periods());
    }

    /// The route of a finished stall: the live reads' (also kept for a
    /// recording, their miss counted), or the recording's.
    fn stall_route(&mut self, tgid: u32, tid: u32, start_ns: u64) -> Option<Route> {
        let saved_key = format!("{tid}:{start_ns}");
        match &mut self.symbols {
            Symbols::Saved(table) => table.routes.get(&saved_key).cloned(),
            Symbols::Live { recorded, .. } => {
                let (route, miss) = self.routes.finish(tgid, (tid, start_ns));
                if let Some(c) = miss {
                    *self.agent_drops.entry(c).or_default() += 1;
                }
                if let (Some(table), Some(r)) = (recorded, &route) {
                    table.routes.insert(saved_key, r.clone());
                }
                route
            }
        }
    }

    /// The task of a finished stall: the live reads' (also kept for a
    /// recording), or the recording's; and, live, why it has none.
    fn stall_task(&mut self, tid: u32, start_ns: u64) -> (Option<Task>, Option<TaskMiss>) {
        let saved_key = format!("{tid}:{start_ns}");
        let state = self.tasks.remove(&(tid, start_ns));
        match &mut self.symbols {
            Symbols::Saved(table) => (table.tasks.get(&saved_key).cloned(), None),
            Symbols::Live { recorded, .. } => match state {
                Some(BusyTask::Named(t)) => {
                    if let Some(table) = recorded {
                        table.tasks.insert(saved_key, t.clone());
                    }
                    (Some(t), None)
                }
                Some(BusyTask::Tried { last, .. }) => (None, Some(last)),
                None => (None, Some(TaskMiss::NoTask)),
            },
        }
    }

    /// A stall without a task name is counted by why when a task was seen
    /// (`asyncio_task_unverified`) or could not be read
    /// (`asyncio_task_unreadable`, and the reason becomes a runtime problem
    /// of the process), or when its stack shows a task step (`coroutine`)
    /// but no read found a task (`asyncio_task_unknown`).
    fn count_task_miss(&mut self, tgid: u32, s: &Stall, miss: Option<TaskMiss>) {
        let counter = match miss {
            None => None,
            Some(TaskMiss::Unverified) => Some("asyncio_task_unverified"),
            Some(TaskMiss::Unreadable(why)) => {
                self.task_problems.insert(tgid, why);
                Some("asyncio_task_unreadable")
            }
            Some(TaskMiss::NoTask) if s.coroutine.is_some() => Some("asyncio_task_unknown"),
            Some(TaskMiss::NoTask) => None,
        };
        if let Some(c) = counter {
            *self.agent_drops.entry(c).or_default() += 1;
        }
    }

    fn outputs(&mut self, out: Vec<Output>, probes: &mut dyn Control) {
        for o in out {
            match o {
                Output::LoopKey { tid, key } => {
                    let tgid = self.tracker.loops().tgid_of(tid).unwrap_or(tid);
                    let name = self.thread(tgid, tid).name;
                    debug!("thread {tid} ({name}) of {tgid} parks on wait key {key:#x}");
                    probes.set_loop_key(tid, key);
                    // Before its first stall: find its runtime in the
                    // background (Node's symbol table takes ~0.2 s).
                    if let Some(reader) = self.symbols.live() {
                        reader.start_js(tgid);
                    }
                }
                Output::LoopGone { tid } => {
                    probes.forget_loop_thread(tid);
                }
                Output::Stall(raw) => {
                    let job = self.prepare(raw);
                    // A JIT runtime writes its perf map through a buffer:
                    // names of code compiled just before the stall may not
                    // be in the file yet. Give it a moment. Likewise
                    // JavaScript frames whose bytecode is not known yet:
                    // a later request running it names them.
                    if self.symbols.live().is_some()
                        && (job.answers.js_missing()
                            || Path::new(&crate::symbolize::perf_map_path(job.raw.tgid)).exists())
                    {
                        if self.pending.len() >= MAX_PENDING {
                            let (_, oldest) = self.pending.remove(0);
                            self.submit(oldest);
                        }
                        let due = std::time::Instant::now() + JIT_NAME_DELAY;
                        let mut job = job;
                        job.refresh = true;
                        self.pending.push((due, job));
                    } else {
                        self.submit(job);
                    }
                }
            }
        }
    }

    /// What a finished stall needs from the target, read now while the
    /// target holds it: Python frames, GIL holders (their thread
    /// descriptors too), V8 functions, the asyncio task. The native names
    /// are the symbolizer's.
    fn prepare(&mut self, raw: RawStall) -> Box<Job> {
        let thread = self.thread(raw.tgid, raw.tid);
        let stacks = self.tracker.stacks.of_stall(&raw);
        let answers = self.symbols.resolve(|r| Answers::read(&raw, &stacks, r));
        let holders: Vec<u32> = answers.holder_tids().collect();
        let holders = holders
            .into_iter()
            .map(|tid| (tid, self.thread(raw.tgid, tid).ns_tid))
            .collect();
        let (task, miss) = self.stall_task(raw.tid, raw.start_ns);
        let route = self.stall_route(raw.tgid, raw.tid, raw.start_ns);
        // CPU holders of another process in the stalled one's container
        // (only looked up when it is in one: on the host there is none).
        let mut same_container = Vec::new();
        if let Some(mine) = self.process(raw.tgid).container {
            for (h, _) in &raw.cpu_holders {
                if let Holder::Task { tgid, .. } = *h
                    && tgid != raw.tgid
                    && self.process(tgid).container.as_ref() == Some(&mine)
                {
                    same_container.push(tgid);
                }
            }
        }
        Box::new(Job {
            raw,
            stacks,
            answers,
            thread,
            holders,
            task,
            miss,
            route,
            same_container,
            refresh: false,
        })
    }

    /// Hand a stall to the symbolizer; if it is too far behind to take it,
    /// finish it here without native names (`symbolizer_behind`): the drain
    /// never waits.
    fn submit(&mut self, job: Box<Job>) {
        let Err(job) = self.symbolizer.submit(job) else {
            return;
        };
        let n = self.agent_drops.entry("symbolizer_behind").or_default();
        *n += 1;
        if *n == 1 {
            warn!(
                "the symbolizer is behind (a large binary's first symbolization, or more stalls than \
                 it names): stalls keep their native frames unnamed until it catches up \
                 (drops: symbolizer_behind); a higher --threshold makes fewer stalls"
            );
        }
        let done = match &mut self.symbols {
            Symbols::Live {
                recorded: Some(table),
                ..
            } => symbolizer::finish(
                *job,
                &mut Recorder {
                    inner: &mut Unnamed(&self.maps),
                    table,
                },
            ),
            _ => symbolizer::finish(*job, &mut Unnamed(&self.maps)),
        };
        self.done(done);
    }

    /// Take the stalls the symbolizer has finished.
    fn collect(&mut self) {
        self.read_held_routes();
        let mut out = Vec::new();
        self.symbolizer.take_done(&mut out);
        for d in out {
            self.done(d);
        }
    }

    fn done(&mut self, d: Done) {
        let Done { tgid, stall, miss } = d;
        self.count_task_miss(tgid, &stall, miss);
        info!(
            "stall on {} ({}) of {}: {}",
            stall.tid,
            stall.thread_name,
            tgid,
            fmt_ns(stall.duration_ns)
        );
        self.stalls.push((tgid, stall));
    }

    /// Symbolize held-back stalls that are due (all of them with `all`).
    fn flush_pending(&mut self, all: bool) {
        let now = std::time::Instant::now();
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| all || p.0 <= now);
        self.pending = keep;
        for (_, mut job) in due {
            if job.answers.js_missing() {
                let Job {
                    raw,
                    stacks,
                    answers,
                    ..
                } = &mut *job;
                self.symbols.resolve(|r| answers.retry_js(raw, stacks, r));
            }
            self.submit(job);
        }
    }

    /// Close busy periods still open (end of recording), and wait for the
    /// symbolizer to finish every stall.
    pub fn finish(&mut self, ts: u64) {
        let mut out = Vec::new();
        self.tracker.finish(ts, &mut out);
        self.outputs(out, &mut NoControl);
        self.flush_pending(true);
        let mut done = Vec::new();
        self.symbolizer.close(&mut done);
        for d in done {
            self.done(d);
        }
        info!(
            "ring buffer: at most {} KiB waiting at a drain",
            self.ring_backlog_max / 1024
        );
        info!(
            "memory: {} stacks interned ({} KiB), {} stalls held ({} frames, {} KiB of frame slots)",
            self.tracker.stacks.len(),
            self.tracker.stacks.bytes() / 1024,
            self.stalls.len(),
            self.frames_held(),
            self.frames_held() * std::mem::size_of::<crate::model::Frame>() / 1024
        );
        let [resolved, moved, by_bytecode, live, names_unread, reused] =
            crate::symbolize::v8::counts();
        if resolved > 0 {
            let ((i_ok, i_bad), (j_ok, j_bad)) = crate::symbolize::v8::tier_counts();
            info!(
                "JavaScript functions resolved from memory: {resolved} ({moved} found moved by V8's GC, followed; {by_bytecode} frames named through their bytecode, {live} read through the frame still on the stack, {names_unread} times a name unreadable when asked and asked again, {reused} bytecode addresses found reused by another function), {} frames unreadable; frames named/unreadable: interpreter {i_ok}/{i_bad}, JIT code {j_ok}/{j_bad}",
                crate::symbolize::v8::unreadable_count()
            );
        }
    }

    /// Frames in the stalls not yet taken (memory accounting).
    fn frames_held(&self) -> usize {
        self.stalls
            .iter()
            .flat_map(|(_, s)| &s.stacks)
            .map(|p| p.frames.len() + p.gil_holder.as_ref().map_or(0, |h| h.frames.len()))
            .sum()
    }

    /// Stalls finished since the last call, with their process id.
    pub fn take_stalls(&mut self) -> Vec<(u32, Stall)> {
        self.collect();
        std::mem::take(&mut self.stalls)
    }

    pub fn stall_count(&self) -> usize {
        self.stalls.len()
    }

    /// Stalls finished and not yet taken, from the `from`-th on (`record`'s
    /// journal appends them as they come).
    pub fn stalls_since(&self, from: usize) -> impl Iterator<Item = &Stall> {
        self.stalls.iter().skip(from).map(|(_, s)| s)
    }

    pub fn worst_ns(&self) -> u64 {
        self.stalls
            .iter()
            .map(|(_, s)| s.duration_ns)
            .max()
            .unwrap_or(0)
    }

    /// The longest busy period in progress right now, in ns.
    pub fn busy_now_ns(&self, now: u64) -> u64 {
        self.tracker
            .busy_threads()
            .map(|(_, s)| now.saturating_sub(s))
            .max()
            .unwrap_or(0)
    }

    /// Loop threads found in one process, named.
    pub fn executors(&self, pid: u32) -> Vec<ThreadInfo> {
        self.tracker
            .loops()
            .loop_tids_of(pid)
            .into_iter()
            .map(|tid| {
                self.threads.get(&tid).cloned().unwrap_or(ThreadInfo {
                    tid,
                    name: "?".into(),
                    ns_tid: None,
                })
            })
            .collect()
    }

    /// Busy periods of loop threads that reached userspace (the kernel's
    /// `short_busy_periods` never do).
    pub fn busy_periods(&self) -> u64 {
        self.tracker.stats.busy_periods
    }

    /// The agent's own failure counters (unwinding, decoding, switch-ins
    /// not seen, read limits hit: `limit_*`).
    pub fn agent_drops(&self) -> BTreeMap<&'static str, u64> {
        let mut d = self.agent_drops.clone();
        for ((name, now), (_, base)) in crate::os::limits::counts()
            .into_iter()
            .zip(&self.limits_base)
        {
            if now > *base {
                d.insert(name, now - base);
            }
        }
        if self.tracker.stats.switch_ins_missed > 0 {
            d.insert("switch_ins_missed", self.tracker.stats.switch_ins_missed);
        }
        let js = crate::symbolize::v8::unreadable_count().saturating_sub(self.js_unreadable_base);
        if js > 0 {
            d.insert("js_frames_unreadable", js);
        }
        d
    }

    /// Daemon: the processes that have loop threads, ascending.
    pub fn executor_pids(&self) -> Vec<u32> {
        self.tracker.loops().loop_processes()
    }

    /// Daemon: forget a process that exited or exec'd — its loop threads
    /// (here and in the kernel), their names, its caches — so that churn
    /// does not grow these tables.
    pub fn forget(&mut self, pid: u32, probes: &mut dyn Control) {
        self.js_pending_stacks.remove(&pid);
        for tid in self.tracker.forget_process(pid) {
            self.threads.remove(&tid);
            probes.forget_loop_thread(tid);
        }
        self.procs.remove(&pid);
        if let Some(w) = self.python.remove(&pid)
            && w.interp.is_some()
        {
            let tids: Vec<u32> = w.known.keys().copied().collect();
            probes.forget_python_proc(pid, &tids);
        }
        // A process that is gone writes no more JIT names: its held-back
        // stalls go to the symbolizer now, before its maps are let go (the
        // symbolizer forgets them after its last stall).
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| p.1.raw.tgid == pid);
        self.pending = others;
        for (_, job) in mine {
            self.submit(job);
        }
        if let Some(reader) = self.symbols.live() {
            reader.forget(pid);
        }
        if !self.symbolizer.forget(pid) {
            self.maps.forget(pid);
        }
        self.runtimes.remove(&pid);
        self.unwinder.forget(pid);
        self.exited.remove(&pid);
        self.waiting.remove(&pid);
    }

    /// Daemon: interned stacks held for stall assembly. The table only
    /// grows; the daemon rebuilds the engine when it gets large.
    pub fn stack_table_len(&self) -> usize {
        self.tracker.stacks.len()
    }

    /// Daemon: [`Engine::drain`], except that stack events (samples,
    /// switch-outs) of threads that are not executors are dropped before
    /// they are unwound. Host-wide, most threads that ever waited in
    /// poll/select are not event loops, and their stacks can never be part
    /// of a reported stall. Returns how many records the ring held, and
    /// how many stack events were dropped.
    pub fn drain_executors(
        &mut self,
        ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
        probes: &mut dyn Control,
    ) -> (usize, u64) {
        let mut skipped = 0;
        let mut bytes = 0;
        let mut records = 0;
        if let Some(reader) = self.symbols.live() {
            reader.next_drain();
        }
        while let Some(item) = ring.next() {
            bytes += item.len();
            records += 1;
            let ev = event::parse(&item);
            if let Ok(Event::WaitEnter { tgid, .. }) = ev
                && self.waiting.insert(tgid)
            {
                self.new_waiting.push(tgid);
            }
            if let Ok(ev) = ev
                && matches!(
                    ev,
                    Event::Sample { .. } | Event::SwitchOut { .. } | Event::Task { .. }
                )
                && !self.tracker.loops().is_loop_thread(ev.tid())
            {
                // A task read goes with a stack event: skipped with it.
                skipped += u64::from(!matches!(ev, Event::Task { .. }));
                continue;
            }
            self.handle_record(&item, probes);
        }
        self.ring_backlog_max = self.ring_backlog_max.max(bytes);
        self.collect();
        (records, skipped)
    }
}

/// The raw records of a recording saved by [`Engine::save_to`], in order.
pub fn read_recording(dir: &Path) -> Result<Vec<Vec<u8>>> {
    let path = dir.join(EVENTS_FILE);
    let f = fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mut r = BufReader::new(GzDecoder::new(f));
    let mut magic = Vec::new();
    r.read_until(b'\n', &mut magic)?;
    if magic != EVENTS_MAGIC {
        anyhow::bail!(
            "{} is not a stallprof recording of this version (it starts {:?})",
            path.display(),
            String::from_utf8_lossy(&magic[..magic.len().min(40)])
        );
    }
    let mut out = Vec::new();
    loop {
        let mut len = [0u8; 4];
        match r.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_RECORD {
            anyhow::bail!(
                "{}: record {} is {len} bytes long: corrupt",
                path.display(),
                out.len()
            );
        }
        let mut rec = vec![0u8; len];
        match r.read_exact(&mut rec) {
            Ok(()) => out.push(rec),
            // A recording cut short (the recorder was killed): keep what is whole.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }
    Ok(out)
}

/// Replay the recording in `dir` through the whole pipeline: the stalls it
/// finds, symbolized, ordered by start. `end_ns`: where to close busy
/// periods still open (default: the last record's time).
pub fn replay(dir: &Path, cfg: TrackerConfig, end_ns: Option<u64>) -> Result<Vec<Stall>> {
    replay_named(dir, cfg, end_ns, &[])
}

/// [`replay`], with the threads as the live recording saw them (names,
/// namespace ids; others are named "replayed").
pub fn replay_named(
    dir: &Path,
    cfg: TrackerConfig,
    end_ns: Option<u64>,
    threads: &[ThreadInfo],
) -> Result<Vec<Stall>> {
    let records = read_recording(dir)?;
    let mut engine = Engine::replaying(dir, cfg)?;
    engine.threads = threads.iter().map(|t| (t.tid, t.clone())).collect();
    let mut last = 0;
    for rec in &records {
        if let Ok(ev) = event::parse(rec) {
            last = last.max(ev.ts());
        }
        engine.handle_record(rec, &mut NoControl);
    }
    engine.finish(end_ns.unwrap_or(last));
    let mut stalls: Vec<Stall> = engine.take_stalls().into_iter().map(|(_, s)| s).collect();
    stalls.sort_by_key(|s| (s.start_ns, s.tid));
    Ok(stalls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::event::RawStack;
    use profiler_common::sysno::EPOLL_WAIT;

    const MS: u64 = 1_000_000;

    fn wait(enter: bool, ts_ms: u64) -> Event {
        if enter {
            Event::WaitEnter {
                tid: 7,
                tgid: 7,
                ts: ts_ms * MS,
                nr: EPOLL_WAIT,
                fd: 3,
            }
        } else {
            Event::WaitExit {
                tid: 7,
                tgid: 7,
                ts: ts_ms * MS,
                nr: EPOLL_WAIT,
                fd: 3,
                ret: 0,
            }
        }
    }

    /// An engine over saved symbols with `symbolizer`, a 10 ms threshold.
    fn saved_engine(symbolizer: Symbolizer, maps: SharedMaps) -> Engine {
        Engine::with(
            TrackerConfig {
                threshold_ns: 10 * MS,
                tids: None,
            },
            Symbols::Saved(TableResolver::default()),
            symbolizer,
            maps,
            Unwinder::new(),
        )
    }

    #[test]
    fn a_process_forgotten_without_stalls_lets_go_of_its_maps_at_once() {
        // The symbolizer thread never ran (as under a sustained CPU load,
        // at nice 19): a process it never had a stall of must not wait
        // for it to drop its maps snapshot.
        let maps = SharedMaps::default();
        let me = std::process::id();
        maps.refresh(me);
        assert!(maps.holds(me), "no maps snapshot of this process");
        let symbolizer =
            Symbolizer::threaded(Worker::new(Native::Saved(Box::default()), maps.clone()));
        let mut engine = saved_engine(symbolizer, maps.clone());
        engine.forget(me, &mut NoControl);
        assert!(!maps.holds(me), "the snapshot waited for the symbolizer");
    }

    /// A symbolizer that takes 200 ms a stall (the first symbolization of a
    /// large binary takes seconds) does not hold up the drain: 100 stalls
    /// are assembled in far less than the 20 s it would take to name them
    /// all, none is lost, and the ones the full queue would not take keep
    /// unnamed native frames, counted in `symbolizer_behind`.
    #[test]
    fn a_slow_symbolizer_does_not_block_the_drain() {
        const STALLS: u64 = 100;
        let mut table = TableResolver::default();
        table.user.insert(
            "0x10".into(),
            vec![crate::model::Frame::new(
                "handler",
                crate::model::FrameKind::Native,
            )],
        );
        let maps = SharedMaps::default();
        let mut symbolizer =
            Symbolizer::threaded(Worker::new(Native::Saved(Box::new(table)), maps.clone()));
        symbolizer.set_delay(std::time::Duration::from_millis(200));
        let mut engine = saved_engine(symbolizer, maps);
        let started = std::time::Instant::now();
        // Two waits on epoll fd 3 make it the loop; then a 30 ms busy period
        // with a sample, every 50 ms.
        for (i, enter) in [(0, true), (1, false), (2, true), (3, false), (4, true)] {
            engine.handle(wait(enter, i), &mut NoControl);
        }
        for i in 0..STALLS {
            let t = 100 + i * 50;
            engine.handle(wait(false, t), &mut NoControl);
            engine.handle(
                Event::Sample {
                    tid: 7,
                    tgid: 7,
                    ts: (t + 15) * MS,
                    stack: RawStack {
                        user: vec![0x10],
                        ..RawStack::default()
                    },
                    task: 0,
                },
                &mut NoControl,
            );
            engine.handle(wait(true, t + 30), &mut NoControl);
            engine.collect();
        }
        let drained = started.elapsed();
        assert!(
            drained < std::time::Duration::from_secs(3),
            "the drain waited for the symbolizer: {drained:?}"
        );
        let behind = engine
            .agent_drops()
            .get("symbolizer_behind")
            .copied()
            .unwrap_or(0);
        assert!(behind > 0, "the queue never filled");
        engine.finish((100 + STALLS * 50) * MS);
        let stalls = engine.take_stalls();
        assert_eq!(stalls.len() as u64, STALLS, "a stall was lost");
        let named = stalls
            .iter()
            .filter(|(_, s)| {
                s.stacks
                    .iter()
                    .any(|p| p.frames.iter().any(|f| f.name == "handler"))
            })
            .count() as u64;
        let unnamed = stalls
            .iter()
            .filter(|(_, s)| {
                s.stacks
                    .iter()
                    .any(|p| p.frames.iter().any(|f| f.name == "[unknown 0x10]"))
            })
            .count() as u64;
        assert_eq!(named + unnamed, STALLS);
        assert_eq!(unnamed, behind, "every unnamed stall is counted");
        assert!(
            named >= symbolizer::QUEUE as u64,
            "the symbolizer named {named}"
        );
    }
}
