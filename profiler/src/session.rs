//! A live session: ring-buffer records in, symbolized stalls out, for one
//! process (`record`) or many (`daemon`).
//!
//! In: raw ring-buffer records. Out: [`Stall`]s per process, the executor
//! threads found, and failure counters. Per record: decode (`event`),
//! unwind the copied user stack (`unwind`), feed stall assembly (`stall`);
//! per finished stall: symbolize at once, while the process lives.
//! Loop-key decisions and Python thread states flow back to the probes.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use log::{debug, info, warn};
use profiler_common::PyProc;

use crate::{
    cli::fmt_ns,
    event::{self, Event},
    model::{Stall, ThreadInfo},
    probe::Probes,
    python::{self, Interpreter, PythonError},
    runtimes,
    stall::{Output, Tracker, TrackerConfig},
    symbolize::{BlazeResolver, Recorder, TableResolver, to_stall},
    unwind::{UnwindOutcome, Unwinder, UserRegs},
};

pub fn read_comm(pid: u32, tid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// A launched command before its exec is still an image of this program:
/// nothing to discover in it yet.
pub fn is_own_fork(pid: u32) -> bool {
    let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
    exe.is_none() || exe == std::env::current_exe().ok()
}

/// Keeps BPF's view of one process's CPython current: interpreter offsets
/// once found, and the thread -> `PyThreadState*` table as threads come and
/// go. Detection is retried (a launched command execs its interpreter after
/// attach), every tick for the first 5 s, then every 5 s.
struct PythonWatch {
    interp: Option<Interpreter>,
    known: HashMap<u32, u64>,
    attempts: u32,
    given_up: bool,
}

impl PythonWatch {
    fn new() -> Self {
        PythonWatch {
            interp: None,
            known: HashMap::new(),
            attempts: 0,
            given_up: false,
        }
    }

    fn poll(&mut self, pid: u32, probes: &mut Probes) {
        if self.interp.is_none() && !self.given_up && !is_own_fork(pid) {
            self.attempts += 1;
            if self.attempts <= 20 || self.attempts % 20 == 0 {
                match python::detect(pid) {
                    Ok(Some(interp)) => {
                        let gil = interp.gil_addrs().ok();
                        let proc_ = PyProc {
                            offsets: interp.offsets(),
                            gil_locked: gil.map_or(0, |g| g.locked),
                            gil_last_holder: gil.map_or(0, |g| g.last_holder),
                        };
                        info!(
                            "pid {pid}: CPython {} ({}); Python stacks on",
                            interp.version_string(),
                            interp.path()
                        );
                        if gil.is_none() {
                            warn!(
                                "pid {pid}: GIL not found; GIL waits will show as plain off-CPU time"
                            );
                        }
                        probes.set_python_proc(pid, proc_);
                        self.interp = Some(interp);
                    }
                    Ok(None) => {}
                    Err(e @ PythonError::Unsupported { .. }) => {
                        warn!("{e}");
                        self.given_up = true;
                    }
                    Err(e) => debug!("python detection in {pid}: {e}"),
                }
            }
        }
        let Some(interp) = &self.interp else { return };
        match interp.thread_states() {
            Ok(now) => {
                let now: HashMap<u32, u64> = now.into_iter().collect();
                let fresh: Vec<(u32, u64)> = now
                    .iter()
                    .filter(|(t, s)| self.known.get(t) != Some(s))
                    .map(|(&t, &s)| (t, s))
                    .collect();
                let gone: Vec<u32> = self
                    .known
                    .keys()
                    .filter(|t| !now.contains_key(t))
                    .copied()
                    .collect();
                if !fresh.is_empty() || !gone.is_empty() {
                    probes.set_python_threads(&fresh, &gone);
                }
                self.known = now;
            }
            Err(e) => debug!("python thread states of {pid}: {e}"),
        }
    }

    fn version(&self) -> Option<String> {
        self.interp.as_ref().map(|i| i.version_string().to_string())
    }
}

/// Finds a process's runtime park functions (tokio) and puts uprobes on
/// them, retried for the first seconds (a launched command execs after
/// attach; a runtime may be loaded late).
#[derive(Default)]
struct RuntimeWatch {
    attempts: u32,
    done: bool,
    scanned_exe: Option<PathBuf>,
}

impl RuntimeWatch {
    fn poll(&mut self, pid: u32, probes: &mut Probes, per_process: bool) {
        if self.done {
            return;
        }
        // Scan once per executable image: a launched command is still our
        // own fork until it execs.
        let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
        if is_own_fork(pid) || exe == self.scanned_exe {
            self.attempts += 1;
            // Libraries loaded later (dlopen) get a look now and then.
            if self.attempts % 40 != 0 || self.scanned_exe.is_none() {
                return;
            }
        }
        self.scanned_exe = exe;
        let points = runtimes::tokio_park_points(pid);
        for p in &points {
            match probes.attach_park(p, per_process.then_some(pid)) {
                Ok(()) => self.done = true,
                Err(e) => warn!(
                    "pid {pid}: tokio park probes unavailable, its workers are tracked by epoll only: {e}"
                ),
            }
        }
        if !points.is_empty() {
            self.done = true;
        }
    }
}

/// Age after which periodic upkeep re-reads a process's maps.
const MAPS_UPKEEP: std::time::Duration = std::time::Duration::from_secs(2);

/// How long stalls of a process with a perf map wait before symbolization.
const JIT_NAME_DELAY: std::time::Duration = std::time::Duration::from_secs(2);

/// Everything a live session accumulates.
pub struct Session {
    /// Stalls held back for JIT names: (due, thread name, stall).
    pending: Vec<(std::time::Instant, String, crate::stall::RawStall)>,
    tracker: Tracker,
    resolver: BlazeResolver,
    unwinder: Unwinder,
    stalls: Vec<(u32, Stall)>,
    names: HashMap<u32, String>,
    python: HashMap<u32, PythonWatch>,
    runtimes: HashMap<u32, RuntimeWatch>,
    events_out: Option<std::io::BufWriter<fs::File>>,
    /// With --save-events: every symbol answer, for replay (symbols.json).
    symbols: Option<TableResolver>,
    agent_drops: BTreeMap<&'static str, u64>,
    exited: HashSet<u32>,
}

impl Session {
    pub fn new(threshold_ns: u64, tids: Option<HashSet<u32>>) -> Session {
        Session {
            pending: Vec::new(),
            tracker: Tracker::new(TrackerConfig { threshold_ns, tids }),
            resolver: BlazeResolver::new(),
            unwinder: Unwinder::new(),
            stalls: Vec::new(),
            names: HashMap::new(),
            python: HashMap::new(),
            runtimes: HashMap::new(),
            events_out: None,
            symbols: None,
            agent_drops: BTreeMap::new(),
            exited: HashSet::new(),
        }
    }

    /// A fresh session in place of this one (the daemon's memory bound:
    /// the stack table and per-process caches only grow while a session
    /// lives). What must survive is carried over: the loop-thread registry
    /// (the kernel keeps using the published keys) and the runtime park
    /// probes already attached. Busy periods still open are cut.
    pub fn rebuild(self) -> Session {
        let cfg = self.tracker.config().clone();
        let mut next = Session::new(cfg.threshold_ns, cfg.tids.clone());
        next.tracker = Tracker::with_loops(cfg, self.tracker.into_loops());
        next.runtimes = self.runtimes;
        next
    }

    /// Save every event (events.jsonl) and symbol answer (symbols.json, on
    /// [`Session::finish_saving`]) under `dir`.
    pub fn save_events(&mut self, dir: &Path) -> Result<()> {
        let f = fs::File::create(dir.join("events.jsonl")).context("creating events.jsonl")?;
        self.events_out = Some(std::io::BufWriter::new(f));
        self.symbols = Some(TableResolver::default());
        Ok(())
    }

    pub fn finish_saving(&mut self, dir: &Path) -> Result<()> {
        if let Some(w) = self.events_out.as_mut() {
            w.flush()?;
        }
        if let Some(table) = &self.symbols {
            let path = dir.join("symbols.json");
            fs::write(&path, serde_json::to_vec(table)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    fn thread_name(&mut self, tgid: u32, tid: u32) -> String {
        if let Some(n) = self.names.get(&tid) {
            return n.clone();
        }
        let n = read_comm(tgid, tid).unwrap_or_else(|| "?".into());
        self.names.insert(tid, n.clone());
        n
    }

    /// Periodic upkeep for live processes: maps snapshots for symbolization
    /// and the Python thread tables BPF walks from.
    pub fn tick(&mut self, pids: &[u32], probes: &mut Probes) {
        self.flush_pending(false);
        for &pid in pids {
            // Symbolization refreshes on its own (and on an unknown address);
            // this keeps a recent snapshot for a process that exits mid-stall.
            self.resolver.refresh_if_older(pid, MAPS_UPKEEP);
            self.python
                .entry(pid)
                .or_insert_with(PythonWatch::new)
                .poll(pid, probes);
            self.runtimes
                .entry(pid)
                .or_default()
                .poll(pid, probes, true);
        }
    }

    pub fn python_version(&self, pid: u32) -> Option<String> {
        self.python.get(&pid).and_then(PythonWatch::version)
    }

    /// Processes whose exit was seen since the last call.
    pub fn take_exited(&mut self) -> Vec<u32> {
        self.exited.drain().collect()
    }

    /// Decode, unwind and track every record in the ring buffer.
    pub fn drain(
        &mut self,
        ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
        mut probes: Option<&mut Probes>,
    ) {
        while let Some(item) = ring.next() {
            self.handle_record(&item, probes.as_deref_mut());
        }
    }

    pub fn handle_record(&mut self, bytes: &[u8], probes: Option<&mut Probes>) {
        match event::parse(bytes) {
            Ok(mut ev) => {
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
    /// unwound from the copied stack bytes, unless that failed early.
    fn unwind_user(&mut self, ev: &mut Event, bytes: &[u8]) {
        let (Event::Sample { tgid, stack, .. } | Event::SwitchOut { tgid, stack, .. }) = ev else {
            return;
        };
        let Some((regs, copy)) = event::stack_copy(bytes) else {
            return;
        };
        let regs = UserRegs {
            ip: regs.ip,
            sp: regs.sp,
            bp: regs.bp,
        };
        let (addrs, outcome) = self.unwinder.unwind(*tgid, &regs, copy);
        match outcome {
            UnwindOutcome::Complete => {}
            UnwindOutcome::Truncated => {
                *self.agent_drops.entry("unwind_truncated").or_default() += 1
            }
            UnwindOutcome::Failed => *self.agent_drops.entry("unwind_failed").or_default() += 1,
        }
        if outcome != UnwindOutcome::Failed || addrs.len() >= stack.user.len() {
            stack.user = addrs;
        }
    }

    fn handle(&mut self, ev: Event, probes: Option<&mut Probes>) {
        if let Some(w) = self.events_out.as_mut() {
            let _ = serde_json::to_writer(&mut *w, &ev);
            let _ = w.write_all(b"\n");
        }
        if let Event::Exit {
            process: true,
            tgid,
            ..
        } = ev
        {
            self.exited.insert(tgid);
        }
        if let Event::Sample { tgid, stack, .. } | Event::SwitchOut { tgid, stack, .. } = &ev
            && (!stack.python.is_empty() || !stack.holder_python.is_empty())
            && !self.tracker.stacks().contains(stack)
        {
            self.resolver.warm_python(*tgid, &stack.python);
            self.resolver.warm_python(*tgid, &stack.holder_python);
        }
        let mut out = Vec::new();
        self.tracker.push(ev, &mut out);
        self.outputs(out, probes);
    }

    fn outputs(&mut self, out: Vec<Output>, mut probes: Option<&mut Probes>) {
        for o in out {
            match o {
                Output::LoopKey { tid, key } => {
                    let tgid = self.tracker.loops().tgid_of(tid).unwrap_or(tid);
                    let name = self.thread_name(tgid, tid);
                    debug!("thread {tid} ({name}) of {tgid} parks on wait key {key:#x}");
                    if let Some(p) = probes.as_deref_mut() {
                        p.set_loop_key(tid, key);
                    }
                }
                Output::LoopGone { tid } => {
                    if let Some(p) = probes.as_deref_mut() {
                        p.forget_loop_thread(tid);
                    }
                }
                Output::Stall(raw) => {
                    let name = self.thread_name(raw.tgid, raw.tid);
                    // A JIT runtime writes its perf map through a buffer:
                    // names of code compiled just before the stall may not
                    // be in the file yet. Give it a moment.
                    if Path::new(&format!("/tmp/perf-{}.map", raw.tgid)).exists() {
                        let due = std::time::Instant::now() + JIT_NAME_DELAY;
                        self.pending.push((due, name, raw));
                    } else {
                        self.symbolize(raw, &name);
                    }
                }
            }
        }
    }

    fn symbolize(&mut self, raw: crate::stall::RawStall, name: &str) {
        let s = match self.symbols.as_mut() {
            Some(table) => {
                let mut rec = Recorder {
                    inner: &mut self.resolver,
                    table: std::mem::take(table),
                };
                let s = to_stall(&raw, &self.tracker.stacks, &mut rec, name);
                *table = rec.table;
                s
            }
            None => to_stall(&raw, &self.tracker.stacks, &mut self.resolver, name),
        };
        info!(
            "stall on {} ({}) of {}: {}",
            raw.tid,
            name,
            raw.tgid,
            fmt_ns(s.duration_ns)
        );
        self.stalls.push((raw.tgid, s));
    }

    /// Symbolize held-back stalls that are due (all of them with `all`).
    fn flush_pending(&mut self, all: bool) {
        let now = std::time::Instant::now();
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| all || p.0 <= now);
        self.pending = keep;
        for (_, name, raw) in due {
            self.resolver.refresh(raw.tgid);
            self.symbolize(raw, &name);
        }
    }

    /// Close busy periods still open (end of recording).
    pub fn finish(&mut self, ts: u64) {
        let mut out = Vec::new();
        self.tracker.finish(ts, &mut out);
        self.outputs(out, None);
        self.flush_pending(true);
    }

    /// Stalls finished since the last call, with their process id.
    pub fn take_stalls(&mut self) -> Vec<(u32, Stall)> {
        std::mem::take(&mut self.stalls)
    }

    pub fn stall_count(&self) -> usize {
        self.stalls.len()
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
            .map(|tid| ThreadInfo {
                tid,
                name: self.names.get(&tid).cloned().unwrap_or_else(|| "?".into()),
            })
            .collect()
    }

    /// Busy periods of loop threads that reached userspace (the kernel's
    /// `short_busy_periods` never do).
    pub fn busy_periods(&self) -> u64 {
        self.tracker.stats.busy_periods
    }

    /// The agent's own failure counters (unwinding, decoding, switch-ins
    /// not seen).
    pub fn agent_drops(&self) -> BTreeMap<&'static str, u64> {
        let mut d = self.agent_drops.clone();
        if self.tracker.stats.switch_ins_missed > 0 {
            d.insert("switch_ins_missed", self.tracker.stats.switch_ins_missed);
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
    pub fn forget(&mut self, pid: u32, probes: &mut Probes) {
        for tid in self.tracker.forget_process(pid) {
            self.names.remove(&tid);
            probes.forget_loop_thread(tid);
        }
        self.python.remove(&pid);
        self.resolver.forget_python(pid);
        self.runtimes.remove(&pid);
        self.unwinder.forget(pid);
        self.exited.remove(&pid);
    }

    /// Daemon: interned stacks held for stall assembly. The table only
    /// grows; the daemon replaces the session when it gets large.
    pub fn stack_table_len(&self) -> usize {
        self.tracker.stacks.len()
    }

    /// Daemon: whether an executor thread is inside a busy period now.
    pub fn executor_busy(&self) -> bool {
        self.tracker
            .busy_threads()
            .any(|(tid, _)| self.tracker.loops().is_loop_thread(tid))
    }

    /// Daemon: [`Session::drain`], except that stack events (samples,
    /// switch-outs) of threads that are not executors are dropped before
    /// they are unwound. Host-wide, most threads that ever waited in
    /// poll/select are not event loops, and their stacks can never be part
    /// of a reported stall. Returns how many were dropped.
    pub fn drain_executors(
        &mut self,
        ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
        probes: &mut Probes,
    ) -> u64 {
        let mut skipped = 0;
        while let Some(item) = ring.next() {
            if let Ok(ev) = event::parse(&item)
                && matches!(ev, Event::Sample { .. } | Event::SwitchOut { .. })
                && !self.tracker.loops().is_loop_thread(ev.tid())
            {
                skipped += 1;
                continue;
            }
            self.handle_record(&item, Some(&mut *probes));
        }
        skipped
    }
}
