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
//! ([`Engine::take_stalls`]), the loop threads found, failure counters
//! ([`super::counters`]). Feedback to the kernel goes through [`Control`]
//! only, so a replay (`replay.rs`) runs the very same code with
//! [`NoControl`].
//!
//! A live engine reads runtimes and symbols from `/proc` (upkeep in
//! [`Engine::tick`]) and, while a busy period runs, its asyncio task and
//! request ([`super::reads`]); with [`Engine::save_to`] it also writes a
//! recording that replays everything ([`super::recording`]). What survives
//! the daemon's [`Engine::rebuild`] is one value, [`Kept`].
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Result;
use log::{debug, info, warn};
use profiler_common::MAX_USTACK;

use crate::{
    assemble::stall::{Output, RawStall, Tracker, TrackerConfig},
    kernel::event::{self, Event},
    model::{Holder, ProcessInfo, Route, RuntimeProblem, Stall, Task, ThreadInfo},
    os::outdir::OutDir,
    os::units::fmt_ns,
    pipeline::control::{Control, NoControl},
    pipeline::counters::{Counter, Counters},
    pipeline::discovery::{Answer, Discovery},
    pipeline::identities::Identities,
    pipeline::pending::Pending,
    pipeline::reads::{BusyReads, Period, TaskMiss, Want},
    pipeline::recording::{self, EVENTS_FILE, EventsWriter},
    pipeline::symbolizer::{self, Done, Job, Native, Symbolizer, Worker},
    pipeline::watch::{PythonWatch, RuntimeWatch},
    symbolize::python::{Captured, RouteRead},
    symbolize::{
        Answers, Recorder, ResolveRuntime, RuntimeReader, SharedMaps, TableResolver, Unnamed,
    },
    unwind::{UnwindOutcome, Unwinder, UserRegs},
};

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
    fn fresh() -> Symbols {
        Symbols::Live {
            reader: Box::default(),
            recorded: None,
        }
    }

    fn is_live(&self) -> bool {
        matches!(self, Symbols::Live { .. })
    }

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

/// How long [`Engine::first_tick`] waits for discovery between drains.
const FIRST_TICK_SLICE: Duration = Duration::from_millis(20);

/// Time one upkeep tick may take before the rest of the processes wait for
/// the next (see [`Engine::tick`]).
const UPKEEP_BUDGET: Duration = Duration::from_millis(30);

/// Age after which periodic upkeep re-reads a process's maps.
const MAPS_UPKEEP: Duration = Duration::from_secs(2);

/// The pipeline's state: one per recording, daemon (rebuilt now and then
/// to bound memory, see [`Engine::rebuild`]) or replay.
pub struct Engine {
    /// What a rebuild carries over, whole.
    kept: Kept,
    symbols: Symbols,
    unwinder: Unwinder,
    python: HashMap<u32, PythonWatch>,
    /// The last process upkeep reached (the next tick starts after it).
    upkeep_after: u32,
    /// With [`Engine::save_to`]: raw records as they came.
    events_out: Option<EventsWriter>,
    counters: Counters,
    /// Stacks taken while V8 was still being looked for in their process,
    /// by pid: counted (`js_frames_v8_pending`) once it is found to be
    /// Node; a process that is not has no JavaScript frames to miss.
    js_pending_stacks: HashMap<u32, u64>,
    exited: HashSet<u32>,
}

/// What survives [`Engine::rebuild`]: the loop-thread registry (the kernel
/// keeps using the published keys) and the busy periods still open with
/// the stacks they hold and their live reads (nothing is cut), the thread
/// and process descriptors, the runtime park probes already attached, the
/// symbolizer thread with its queue and the maps it reads, the discovery
/// thread with its questions, the stalls held back or not yet taken. A
/// field added here is carried by construction; one added to [`Engine`]
/// starts afresh with each engine.
pub struct Kept {
    tracker: Tracker,
    /// Native names, on the symbolizer thread (inline in a replay).
    symbolizer: Symbolizer,
    /// Maps snapshots, kept fresh here and read by the symbolizer.
    maps: SharedMaps,
    pending: Pending,
    stalls: Vec<(u32, Stall)>,
    ids: Identities,
    runtimes: HashMap<u32, RuntimeWatch>,
    /// Finds interpreters and runtimes off the drain thread.
    discovery: Discovery,
    /// The asyncio task and ASGI request of each open busy period.
    reads: BusyReads,
    /// Daemon: processes seen entering a wait, and those seen for the first
    /// time since the last [`Engine::take_new_waiting`] (the daemon judges
    /// them by its rules before any loop of theirs is elected).
    waiting: HashSet<u32>,
    new_waiting: Vec<u32>,
    /// See [`Engine::ring_backlog_max`].
    ring_backlog_max: usize,
}

impl Kept {
    fn new(cfg: TrackerConfig, symbolizer: Symbolizer, maps: SharedMaps) -> Kept {
        Kept {
            tracker: Tracker::new(cfg),
            symbolizer,
            maps,
            pending: Pending::default(),
            stalls: Vec::new(),
            ids: Identities::default(),
            runtimes: HashMap::new(),
            discovery: Discovery::new(),
            reads: BusyReads::default(),
            waiting: HashSet::new(),
            new_waiting: Vec::new(),
            ring_backlog_max: 0,
        }
    }
}

impl Engine {
    /// A live engine: runtimes, maps and symbols read from `/proc`.
    pub fn new(threshold_ns: u64, tids: Option<HashSet<u32>>) -> Engine {
        let maps = SharedMaps::default();
        let worker = Worker::new(Native::Blaze, maps.clone());
        let kept = Kept::new(
            TrackerConfig { threshold_ns, tids },
            Symbolizer::threaded(worker),
            maps,
        );
        Self::with(kept, Symbols::fresh(), Unwinder::new())
    }

    fn with(kept: Kept, symbols: Symbols, unwinder: Unwinder) -> Engine {
        Engine {
            kept,
            symbols,
            unwinder,
            python: HashMap::new(),
            upkeep_after: 0,
            events_out: None,
            counters: Counters::default(),
            js_pending_stacks: HashMap::new(),
            exited: HashSet::new(),
        }
    }

    /// An engine that replays the recording saved in `dir` (see
    /// [`Engine::save_to`]; `replay` feeds it the records).
    pub fn replaying(dir: &Path, cfg: TrackerConfig) -> Result<Engine> {
        let (bundle, mut table) = recording::load(dir)?;
        let maps = SharedMaps::default();
        let worker = Worker::new(Native::Saved(Box::new(table.take_native())), maps.clone());
        let kept = Kept::new(cfg, Symbolizer::inline(worker), maps);
        Ok(Self::with(
            kept,
            Symbols::Saved(table),
            Unwinder::replaying(bundle),
        ))
    }

    /// A replay's threads as the live recording saw them.
    pub(super) fn name_threads(&mut self, threads: &[ThreadInfo]) {
        self.kept.ids = Identities::named(threads);
    }

    /// A fresh engine in place of this one (the daemon's memory bound: the
    /// stack table and per-process caches only grow while an engine lives).
    /// [`Kept`] goes over whole, its stack table compacted to the stacks
    /// still held and the symbolizer told to rebuild its caches; the rest
    /// starts afresh (the daemon has added this engine's counters to its
    /// totals).
    pub fn rebuild(self) -> Engine {
        let mut kept = self.kept;
        kept.tracker = kept.tracker.compacted();
        kept.symbolizer.reset();
        kept.reads = std::mem::take(&mut kept.reads).rebuilt();
        Self::with(kept, Symbols::fresh(), Unwinder::new())
    }

    /// Also write a recording that replays everything into `dir`: the raw
    /// records from now on, and (on [`Engine::finish_saving`]) what the
    /// unwinder and the symbolizer read.
    pub fn save_to(&mut self, dir: &OutDir) -> Result<()> {
        self.events_out = Some(EventsWriter::create(dir)?);
        self.unwinder.start_saving();
        if let Symbols::Live { recorded, .. } = &mut self.symbols {
            *recorded = Some(TableResolver::default());
        }
        self.kept.symbolizer.record();
        Ok(())
    }

    pub fn finish_saving(&mut self, dir: &OutDir) -> Result<()> {
        if let Some(w) = self.events_out.take() {
            w.finish(dir)?;
        }
        if let Some(bundle) = self.unwinder.saved() {
            recording::save_unwind(dir, bundle)?;
        }
        if let Symbols::Live {
            recorded: Some(table),
            ..
        } = &mut self.symbols
        {
            // The symbolizer's answers (after [`Engine::finish`], it has
            // stopped) over the drain's own unnamed ones.
            if let Some(native) = self.kept.symbolizer.worker().and_then(|w| w.recorded()) {
                table.merge_native(TableResolver {
                    user: native.user.clone(),
                    kernel: native.kernel.clone(),
                    ..TableResolver::default()
                });
            }
            recording::save_symbols(dir, table)?;
        }
        Ok(())
    }

    /// Thread `tid` of `tgid`, read from `/proc` the first time it is seen
    /// (its name, its id in its PID namespace); a replay knows only the
    /// names it was given.
    fn thread(&mut self, tgid: u32, tid: u32) -> ThreadInfo {
        self.kept.ids.thread(tgid, tid, self.symbols.is_live())
    }

    /// Process `pid`'s identity beyond its host pid (its namespace pid, its
    /// container), read from `/proc` the first time it is seen; nothing in
    /// a replay.
    pub fn process(&mut self, pid: u32) -> ProcessInfo {
        self.kept.ids.process(pid, self.symbols.is_live())
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
        let found = self.kept.discovery.take();
        self.apply_found(found, probes);
        let started = std::time::Instant::now();
        let mut order: Vec<u32> = pids.to_vec();
        order.sort_unstable();
        let first = order.partition_point(|&p| p <= self.upkeep_after);
        order.rotate_left(first);
        for (i, pid) in order.into_iter().enumerate() {
            if i > 0 && started.elapsed() >= UPKEEP_BUDGET {
                self.counters.add(Counter::UpkeepDeferred, 1);
                break;
            }
            self.upkeep_after = pid;
            // The symbolizer refreshes on an unknown address; this keeps a
            // recent snapshot for a process that exits mid-stall, or before
            // the symbolizer gets to its stalls.
            if self.symbols.live().is_some() {
                self.kept.maps.refresh_if_older(pid, MAPS_UPKEEP);
            }
            self.process(pid);
            self.python
                .entry(pid)
                .or_insert_with(PythonWatch::new)
                .poll(pid, probes, &mut self.kept.discovery);
            self.kept
                .runtimes
                .entry(pid)
                .or_default()
                .poll(pid, probes, &mut self.kept.discovery);
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
            let found = self.kept.discovery.take_all(left.min(FIRST_TICK_SLICE));
            self.apply_found(found, probes);
            self.drain(ring, probes);
            if !self.kept.discovery.any_open() || left.is_zero() {
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
                    if let Some(w) = self.kept.runtimes.get_mut(&pid) {
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
        v.extend(self.kept.reads.problems(|pid| self.python_version(pid)));
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
        std::mem::take(&mut self.kept.new_waiting)
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
        self.kept.ring_backlog_max = self.kept.ring_backlog_max.max(bytes);
        self.collect();
        // An interpreter found since the last tick: its stacks walk
        // Python frames from now, not from the next tick.
        let found = self.kept.discovery.take();
        self.apply_found(found, probes);
        records
    }

    /// Nothing waits on a drain: no busy period open, no stall held back
    /// or with the symbolizer, no request or runtime being read. The
    /// reader of an empty ring may then sleep until the kernel side wakes
    /// it with its next record.
    pub fn quiet(&self) -> bool {
        self.kept.pending.is_empty()
            && self.kept.symbolizer.idle()
            && !self.kept.reads.any_held()
            && !self.kept.discovery.any_open()
            && self.kept.tracker.busy_threads().next().is_none()
    }

    /// The most bytes one drain found waiting in the ring buffer (its
    /// margin: the ring's size is what it may reach before events are lost).
    pub fn ring_backlog_max(&self) -> usize {
        self.kept.ring_backlog_max
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
                if self.counters.add(Counter::UnparsableEvents, 1) == 1 {
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
                self.counters.add(Counter::UserStackTruncated, 1);
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
                self.counters.add(Counter::UnwindTruncated, 1);
            }
            UnwindOutcome::Failed => {
                self.counters.add(Counter::UnwindFailed, 1);
            }
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
            self.counters.add(Counter::JsFramesV8Pending, n);
        }
        if outcome != UnwindOutcome::Failed || addrs.len() >= stack.user.len() {
            if let Some(layout) = layout {
                stack.js = crate::symbolize::v8::js_slots(&layout, &fps, regs.sp, copy);
            }
            stack.user = addrs;
            return;
        }
        if fp_full {
            self.counters.add(Counter::UserStackTruncated, 1);
        }
        if let Some(layout) = layout {
            // The kernel's frame-pointer stack stays (JIT code in a mapping
            // not read yet): its frames' frame pointers are the same chain,
            // walked through the copy.
            let fps = crate::symbolize::v8::fp_chain(regs.bp, regs.sp, copy, stack.user.len());
            stack.js = crate::symbolize::v8::js_slots(&layout, &fps, regs.sp, copy);
        }
    }

    /// Append a record to the recording's events.
    fn save_record(&mut self, bytes: &[u8]) {
        let Some(w) = self.events_out.as_mut() else {
            return;
        };
        if let Err(e) = w.write(bytes) {
            warn!("writing {EVENTS_FILE}: {e}; the rest of the recording is not saved");
            self.events_out = None;
            self.counters.add(Counter::EventsNotSaved, 1);
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
            self.kept.reads.thread_exited(tid);
        }
        if let Event::Sample { tgid, .. } | Event::SwitchOut { tgid, .. } = &ev
            && self.python.get(tgid).is_some_and(|w| w.problem.is_some())
        {
            // A stack of an interpreter that cannot be read: native only.
            self.counters.add(Counter::PythonFramesUnavailable, 1);
        }
        if let Event::Sample { tgid, stack, .. } | Event::SwitchOut { tgid, stack, .. } = &ev
            && (!stack.python.is_empty() || !stack.holder_python.is_empty())
            && !self.kept.tracker.stacks().contains(stack)
            && let Some(blaze) = self.symbols.live()
        {
            blaze.warm_python(*tgid, &stack.python);
            blaze.warm_python(*tgid, &stack.holder_python);
        }
        if let Event::Sample { tgid, stack, .. } | Event::SwitchOut { tgid, stack, .. } = &ev
            && !stack.js.is_empty()
            && !self.kept.tracker.stacks().contains(stack)
            && let Some(blaze) = self.symbols.live()
        {
            blaze.warm_js(*tgid, &stack.js);
        }
        if let Event::Task { .. } = ev {
            return; // taken by read_live
        }
        let mut out = Vec::new();
        self.kept.tracker.push(ev, &mut out);
        self.outputs(out, probes);
    }

    /// What a stack event's busy period needs read from the live target,
    /// read now: its asyncio task and its request's route (neither in a
    /// replay; [`super::reads`] says when each is read again). A `Task`
    /// event is kept for the stack event that follows it.
    fn read_live(&mut self, ev: &Event, probes: &mut dyn Control) {
        if !self.symbols.is_live() {
            return;
        }
        let (tgid, tid, python, task) = match ev {
            Event::Task {
                tid, task, memory, ..
            } => {
                let captured = Captured {
                    task: *task,
                    memory: memory.clone(),
                };
                self.kept.reads.capture(*tid, captured);
                return;
            }
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
            } if !stack.python.is_empty() => (*tgid, *tid, &stack.python, *task),
            _ => return,
        };
        let captured = self.kept.reads.take_captured(tid, task);
        let Some(start) = self.kept.tracker.open_period(tid) else {
            return;
        };
        self.read_task((tid, start), tgid, python, &captured, probes);
        let now = Instant::now();
        match self.kept.reads.wants_route((tid, start), now) {
            Want::Now => self.read_route((tid, start), tgid, python, now),
            Want::Later => self.kept.reads.hold((tid, start), tgid, python),
            Want::Never => {}
        }
    }

    /// Read the asyncio task of period `key` of `tgid` now, if it wants a
    /// read; `captured`: the task BPF read with the stack (3.14+).
    fn read_task(
        &mut self,
        key: Period,
        tgid: u32,
        python: &[(u64, u64)],
        captured: &Captured,
        probes: &mut dyn Control,
    ) {
        let now = Instant::now();
        if self.kept.reads.wants_task(key, now) != Want::Now {
            return;
        }
        let Some(reader) = self.symbols.live() else {
            return;
        };
        let found = reader.asyncio_task(tgid, key.0, python, captured);
        if let Some(kernel) = reader.kernel_task(tgid)
            && let Some(w) = self.python.get_mut(&tgid)
        {
            w.read_tasks_in_kernel(tgid, kernel, probes);
        }
        if let Err(crate::symbolize::python::TaskRead::Unreadable(why)) = &found
            && self.kept.reads.task_untried(key)
        {
            debug!("pid {tgid} tid {}: asyncio task unreadable: {why}", key.0);
        }
        let tracker = &self.kept.tracker;
        self.kept
            .reads
            .task_read(key, found, now, || tracker.open_periods());
    }

    /// The route reads held back that are due now.
    fn read_held_routes(&mut self) {
        if !self.kept.reads.any_held() {
            return;
        }
        let now = Instant::now();
        let open = self.kept.tracker.open_periods();
        for (key, held) in self.kept.reads.due(now, &open) {
            self.read_route(key, held.tgid, &held.python, now);
        }
    }

    /// Read the ASGI request of period `key` of `tgid` now, checked
    /// against `python`, one of its stacks.
    fn read_route(&mut self, key: Period, tgid: u32, python: &[(u64, u64)], now: Instant) {
        let tid = key.0;
        let Some(reader) = self.symbols.live() else {
            return;
        };
        let read = reader.asgi_route(tgid, tid, python);
        if let Err(RouteRead::Unreadable(why)) = &read {
            debug!("pid {tgid} tid {tid}: ASGI route unreadable: {why}");
        }
        let tracker = &self.kept.tracker;
        self.kept
            .reads
            .route_read(key, read, now, || tracker.open_periods());
    }

    /// The task and route of a finished stall: the live reads' (also kept
    /// for a recording, a route's miss counted), or the recording's; and,
    /// live, why it has no task.
    fn stall_reads(
        &mut self,
        tgid: u32,
        key: Period,
    ) -> (Option<Task>, Option<TaskMiss>, Option<Route>) {
        let saved_key = format!("{}:{}", key.0, key.1);
        let task = self.kept.reads.finish_task(key);
        match &mut self.symbols {
            Symbols::Saved(table) => (
                table.tasks.get(&saved_key).cloned(),
                None,
                table.routes.get(&saved_key).cloned(),
            ),
            Symbols::Live { recorded, .. } => {
                let (route, miss) = self.kept.reads.finish_route(tgid, key);
                if let Some(c) = miss {
                    self.counters.add(c, 1);
                }
                if let Some(table) = recorded {
                    if let Ok(t) = &task {
                        table.tasks.insert(saved_key.clone(), t.clone());
                    }
                    if let Some(r) = &route {
                        table.routes.insert(saved_key, r.clone());
                    }
                }
                let (task, miss) = match task {
                    Ok(t) => (Some(t), None),
                    Err(m) => (None, Some(m)),
                };
                (task, miss, route)
            }
        }
    }

    fn outputs(&mut self, out: Vec<Output>, probes: &mut dyn Control) {
        for o in out {
            match o {
                Output::LoopKey { tid, key } => {
                    let tgid = self.kept.tracker.loops().tgid_of(tid).unwrap_or(tid);
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
                        if let Some(oldest) = self.kept.pending.hold(job) {
                            self.submit(oldest);
                        }
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
        let stacks = self.kept.tracker.stacks.of_stall(&raw);
        let answers = self.symbols.resolve(|r| Answers::read(&raw, &stacks, r));
        let holders: Vec<u32> = answers.holder_tids().collect();
        let holders = holders
            .into_iter()
            .map(|tid| (tid, self.thread(raw.tgid, tid).ns_tid))
            .collect();
        let (task, miss, route) = self.stall_reads(raw.tgid, (raw.tid, raw.start_ns));
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
        let Err(job) = self.kept.symbolizer.submit(job) else {
            return;
        };
        if self.counters.add(Counter::SymbolizerBehind, 1) == 1 {
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
                    inner: &mut Unnamed(&self.kept.maps),
                    table,
                },
            ),
            _ => symbolizer::finish(*job, &mut Unnamed(&self.kept.maps)),
        };
        self.done(done);
    }

    /// Take the stalls the symbolizer has finished.
    fn collect(&mut self) {
        self.read_held_routes();
        let mut out = Vec::new();
        self.kept.symbolizer.take_done(&mut out);
        for d in out {
            self.done(d);
        }
    }

    fn done(&mut self, d: Done) {
        let Done { tgid, stall, miss } = d;
        if let Some(miss) = miss
            && let Some(c) = self
                .kept
                .reads
                .task_counter(tgid, stall.coroutine.is_some(), miss)
        {
            self.counters.add(c, 1);
        }
        info!(
            "stall on {} ({}) of {}: {}",
            stall.tid,
            stall.thread_name,
            tgid,
            fmt_ns(stall.duration_ns)
        );
        self.kept.stalls.push((tgid, stall));
    }

    /// Symbolize held-back stalls that are due (all of them with `all`).
    fn flush_pending(&mut self, all: bool) {
        for mut job in self.kept.pending.due(all) {
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
        self.kept.tracker.finish(ts, &mut out);
        self.outputs(out, &mut NoControl);
        self.flush_pending(true);
        let mut done = Vec::new();
        self.kept.symbolizer.close(&mut done);
        for d in done {
            self.done(d);
        }
        info!(
            "ring buffer: at most {} KiB waiting at a drain",
            self.kept.ring_backlog_max / 1024
        );
        info!(
            "memory: {} stacks interned ({} KiB), {} stalls held ({} frames, {} KiB of frame slots)",
            self.kept.tracker.stacks.len(),
            self.kept.tracker.stacks.bytes() / 1024,
            self.kept.stalls.len(),
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
        self.kept
            .stalls
            .iter()
            .flat_map(|(_, s)| &s.stacks)
            .map(|p| p.frames.len() + p.gil_holder.as_ref().map_or(0, |h| h.frames.len()))
            .sum()
    }

    /// Stalls finished since the last call, with their process id.
    pub fn take_stalls(&mut self) -> Vec<(u32, Stall)> {
        self.collect();
        std::mem::take(&mut self.kept.stalls)
    }

    pub fn stall_count(&self) -> usize {
        self.kept.stalls.len()
    }

    /// Stalls finished and not yet taken, from the `from`-th on (`record`'s
    /// journal appends them as they come).
    pub fn stalls_since(&self, from: usize) -> impl Iterator<Item = &Stall> {
        self.kept.stalls.iter().skip(from).map(|(_, s)| s)
    }

    pub fn worst_ns(&self) -> u64 {
        self.kept
            .stalls
            .iter()
            .map(|(_, s)| s.duration_ns)
            .max()
            .unwrap_or(0)
    }

    /// The longest busy period in progress right now, in ns.
    pub fn busy_now_ns(&self, now: u64) -> u64 {
        self.kept
            .tracker
            .busy_threads()
            .map(|(_, s)| now.saturating_sub(s))
            .max()
            .unwrap_or(0)
    }

    /// Loop threads found in one process, named.
    pub fn executors(&self, pid: u32) -> Vec<ThreadInfo> {
        self.kept
            .tracker
            .loops()
            .loop_tids_of(pid)
            .into_iter()
            .map(|tid| self.kept.ids.known_thread(tid))
            .collect()
    }

    /// Busy periods of loop threads that reached userspace (the kernel's
    /// `short_busy_periods` never do).
    pub fn busy_periods(&self) -> u64 {
        self.kept.tracker.stats.busy_periods
    }

    /// The agent's own failure counters (unwinding, decoding, switch-ins
    /// not seen, read limits hit: `limit_*`).
    pub fn agent_drops(&self) -> BTreeMap<&'static str, u64> {
        self.counters
            .snapshot(self.kept.tracker.stats.switch_ins_missed)
    }

    /// Daemon: the processes that have loop threads, ascending.
    pub fn executor_pids(&self) -> Vec<u32> {
        self.kept.tracker.loops().loop_processes()
    }

    /// Daemon: forget a process that exited or exec'd — its loop threads
    /// (here and in the kernel), their names, its caches — so that churn
    /// does not grow these tables.
    pub fn forget(&mut self, pid: u32, probes: &mut dyn Control) {
        self.js_pending_stacks.remove(&pid);
        for tid in self.kept.tracker.forget_process(pid) {
            self.kept.ids.forget_thread(tid);
            probes.forget_loop_thread(tid);
        }
        self.kept.ids.forget_process(pid);
        if let Some(w) = self.python.remove(&pid)
            && w.interp.is_some()
        {
            let tids: Vec<u32> = w.known.keys().copied().collect();
            probes.forget_python_proc(pid, &tids);
        }
        // A process that is gone writes no more JIT names: its held-back
        // stalls go to the symbolizer now, before its maps are let go (the
        // symbolizer forgets them after its last stall).
        for job in self.kept.pending.take_process(pid) {
            self.submit(job);
        }
        if let Some(reader) = self.symbols.live() {
            reader.forget(pid);
        }
        if !self.kept.symbolizer.forget(pid) {
            self.kept.maps.forget(pid);
        }
        self.kept.runtimes.remove(&pid);
        self.unwinder.forget(pid);
        self.exited.remove(&pid);
        self.kept.waiting.remove(&pid);
    }

    /// Daemon: interned stacks held for stall assembly. The table only
    /// grows; the daemon rebuilds the engine when it gets large.
    pub fn stack_table_len(&self) -> usize {
        self.kept.tracker.stacks.len()
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
                && self.kept.waiting.insert(tgid)
            {
                self.kept.new_waiting.push(tgid);
            }
            if let Ok(ev) = ev
                && matches!(
                    ev,
                    Event::Sample { .. } | Event::SwitchOut { .. } | Event::Task { .. }
                )
                && !self.kept.tracker.loops().is_loop_thread(ev.tid())
            {
                // A task read goes with a stack event: skipped with it.
                skipped += u64::from(!matches!(ev, Event::Task { .. }));
                continue;
            }
            self.handle_record(&item, probes);
        }
        self.kept.ring_backlog_max = self.kept.ring_backlog_max.max(bytes);
        self.collect();
        (records, skipped)
    }
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
        let cfg = TrackerConfig {
            threshold_ns: 10 * MS,
            tids: None,
        };
        Engine::with(
            Kept::new(cfg, symbolizer, maps),
            Symbols::Saved(TableResolver::default()),
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
