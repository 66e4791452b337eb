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
};

use anyhow::Result;
use log::{debug, info, warn};
use profiler_common::MAX_USTACK;

mod live;
mod upkeep;

use crate::{
    assemble::stall::{Output, RawStall, Tracker, TrackerConfig},
    kernel::event::{self, Event},
    model::{Holder, ProcessInfo, RuntimeProblem, Stall, ThreadInfo},
    os::outdir::OutDir,
    os::units::fmt_ns,
    pipeline::control::{Control, NoControl},
    pipeline::counters::{Counter, Counters},
    pipeline::discovery::Discovery,
    pipeline::identities::Identities,
    pipeline::pending::Pending,
    pipeline::reads::BusyReads,
    pipeline::recording::{self, EVENTS_FILE, EventsWriter},
    pipeline::symbolizer::{self, Done, Job, Native, Symbolizer, Worker},
    pipeline::watch::{PythonWatch, RuntimeWatch},
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
    /// Node processes with a stall that ran OpenTelemetry's JavaScript: a
    /// trace context not read, said once per process.
    otel_unread: std::collections::BTreeSet<u32>,
    /// Processes the kernel side started watching at their fork (a
    /// recorded process tree), since the last [`Engine::take_forked`].
    forked: Vec<(u32, u32)>,
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
            otel_unread: Default::default(),
            exited: HashSet::new(),
            forked: Vec::new(),
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
        let mut v8 = std::collections::HashMap::new();
        if let Symbols::Live { reader, .. } = &self.symbols {
            v.extend(reader.js_problems());
            v8 = reader.js_versions();
        }
        let runtime = |pid| match (self.python_version(pid), v8.get(&pid)) {
            (None, Some((a, b, c))) => (format!("node (V8 {a}.{b}.{c})"), "`node --version`"),
            (v, _) => (
                v.map_or_else(|| "cpython".into(), |v| format!("cpython {v}")),
                "`python -VV`",
            ),
        };
        v.extend(self.kept.reads.problems(runtime));
        v.extend(self.otel_unread.iter().map(|&pid| {
            RuntimeProblem {
                pid,
                runtime: runtime(pid).0,
                what: "OpenTelemetry trace ids not read: stalls that ran the OpenTelemetry SDK's \
                   instrumentation carry no trace or span id (drops: otel_span_unsupported)"
                    .into(),
                why: "Node keeps the active span in an AsyncLocalStorage, held by Node's async \
                  hooks (Node 20) or V8's isolate (Node 22+), whose layout Node's postmortem \
                  metadata does not describe"
                    .into(),
                remedy: "find the stall's request in your traces by its route and time; see \
                     docs/architecture.md#node-trace-context"
                    .into(),
            }
        }));
        v.sort_by_key(|p| p.pid);
        v
    }

    /// Processes whose exit was seen since the last call.
    pub fn take_exited(&mut self) -> Vec<u32> {
        self.exited.drain().collect()
    }

    /// A recorded process tree: the (process, parent) pairs started under
    /// it since the last call, in order.
    pub fn take_forked(&mut self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.forked)
    }

    /// Daemon: the processes whose first wait was drained since the last
    /// call (again after [`Engine::forget`]).
    pub fn take_new_waiting(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.kept.new_waiting)
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
                // JavaScript frames are known once unwound.
                self.read_js_route(&ev);
                self.read_js_queues(&ev);
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
        if let Event::Fork { tgid, parent, .. } = ev {
            self.forked.push((tgid, parent));
        }
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
        let live::StallReads {
            task,
            thread_context,
            miss,
            route,
            held_up,
        } = self.stall_reads(raw.tgid, (raw.tid, raw.start_ns), raw.end_ns);
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
            thread_context,
            miss,
            route,
            held_up,
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
        if let Some(why) = stall.trace_unreadable() {
            debug!("pid {tgid}: OpenTelemetry span unreadable: {why}");
            self.counters.add(Counter::OtelSpanUnreadable, 1);
        }
        if stall.task.is_none()
            && stall
                .stacks
                .iter()
                .any(|p| p.frames.iter().any(crate::classify::is_otel_js))
        {
            self.counters.add(Counter::OtelSpanUnsupported, 1);
            self.otel_unread.insert(tgid);
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

    /// Daemon: interned stacks held for stall assembly. The table only
    /// grows; the daemon rebuilds the engine when it gets large.
    pub fn stack_table_len(&self) -> usize {
        self.kept.tracker.stacks.len()
    }
}

#[cfg(test)]
mod tests;
