//! The symbolizer thread: names the native and kernel frames of finished
//! stalls, off the thread that drains the ring buffer.
//!
//! In: [`Job`]s — a finished stall, the stacks it uses (shared with the
//! tracker's table, not copied), and the answers read from the target's
//! memory when it ended ([`Answers`]: Python frames, GIL holders, V8
//! functions, the asyncio task). Out: [`Done`] stalls, in the order their
//! jobs were sent.
//!
//! What is slow happens here: blazesym's first lookup in a large binary
//! (parsing Node's symbol table, libpython's DWARF: seconds), kallsyms,
//! perf-map reads. What must happen while the target still holds what a
//! stack points at stays on the drain thread (see the engine).
//!
//! Between the drain and this thread is a bounded queue of [`QUEUE`] jobs,
//! and a bounded queue of [`DONE_QUEUE`] results back. The drain never
//! waits on either: when the job queue is full, the engine finishes the
//! stall itself without native names ([`crate::symbolize::Unnamed`]) and
//! counts it (`symbolizer_behind`) — fewer named frames, never a lost
//! event. Control messages (forget a process, rebuild the caches) that
//! find the queue full wait in a small list and go first next time. A
//! replay runs the very same steps inline, in order.
use std::{
    collections::{HashSet, VecDeque},
    sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError},
    thread::JoinHandle,
};

use log::warn;

use crate::{
    assemble::stall::{RawStall, StallStacks},
    model::{ContextTrace, HeldUp, HolderRelation, Route, Stall, Task, ThreadInfo},
    pipeline::reads::TaskMiss,
    symbolize::{
        Answers, BlazeResolver, Joined, Recorder, ResolveNative, SharedMaps, TableResolver,
        to_stall,
    },
};

/// Finished stalls waiting for the symbolizer. Each holds its stacks
/// (shared with the tracker's table) and its answers: a few hundred KiB at
/// most. A second's worth of stalls of a busy service at a 10 ms threshold
/// is less than this; more than that waiting means the symbolizer is
/// seconds behind.
pub const QUEUE: usize = 32;
/// Symbolized stalls waiting for the drain thread to take them (it does at
/// every drain, every 20-100 ms). The symbolizer waits when it is full.
const DONE_QUEUE: usize = 64;
/// After this long without work, the symbolizer lets go of the files it
/// parsed (blazesym's symbol tables and DWARF: ~17 MiB for a libpython
/// with debug info); a daemon watching quiet services holds none of it.
const IDLE_RELEASE: std::time::Duration = std::time::Duration::from_secs(3);

/// A finished stall, ready for symbolization.
pub struct Job {
    pub raw: RawStall,
    pub stacks: StallStacks,
    pub answers: Answers,
    pub thread: ThreadInfo,
    /// GIL holders' thread ids and their namespace ids.
    pub holders: Vec<(u32, Option<u32>)>,
    /// The asyncio task read while the stall ran.
    pub task: Option<Task>,
    /// With no task, the span of the thread's own context.
    pub thread_context: Option<ContextTrace>,
    /// Why there is no task, for the engine's counters (live only).
    pub miss: Option<TaskMiss>,
    /// The ASGI request read while the stall ran.
    pub route: Option<Route>,
    /// What the stall held up (or why not read).
    pub held_up: Option<HeldUp>,
    /// Processes holding the CPU that are in the stalled one's container.
    pub same_container: Vec<u32>,
    /// Re-read the maps and perf map first (a stall held back for JIT names).
    pub refresh: bool,
}

/// A symbolized stall.
pub struct Done {
    pub tgid: u32,
    pub stall: Stall,
    pub miss: Option<TaskMiss>,
}

/// Symbolize `job` with `native` for its native and kernel frames.
pub fn finish(job: Job, native: &mut dyn ResolveNative) -> Done {
    let Job {
        raw,
        stacks,
        mut answers,
        thread,
        holders,
        task,
        thread_context,
        miss,
        route,
        held_up,
        same_container,
        ..
    } = job;
    let mut s = to_stall(
        &raw,
        &stacks,
        &mut Joined {
            native,
            runtime: &mut answers,
        },
        &thread,
    );
    // GIL holders: their namespace ids from their descriptors too.
    for h in s.stacks.iter_mut().filter_map(|p| p.gil_holder.as_mut()) {
        if let Some(tid) = h.tid {
            h.ns_tid = holders.iter().find(|x| x.0 == tid).and_then(|x| x.1);
        }
    }
    for h in s
        .cpu_holders
        .iter_mut()
        .filter(|h| h.relation == HolderRelation::Other && same_container.contains(&h.tgid))
    {
        h.relation = HolderRelation::SameContainer;
    }
    s.task = task;
    s.thread_context = thread_context;
    s.route = route;
    s.held_up = held_up;
    Done {
        tgid: raw.tgid,
        stall: s,
        miss,
    }
}

/// Where native names come from.
pub enum Native {
    /// blazesym over the live processes' files. Its resolver cannot move
    /// between threads: it is built on the thread that uses it.
    Blaze,
    /// A recording's table (its native half).
    Saved(Box<TableResolver>),
}

enum Msg {
    Stall(Box<Job>),
    /// A process is gone: its caches and maps snapshot go, after its last
    /// stalls (queued before this).
    Forget(u32),
    /// Rebuild the caches (the daemon's memory bound).
    Reset,
    /// Keep every answer for a recording from now on.
    Record,
}

/// The symbolizer's state: its resolver, and what it recorded.
pub struct Worker {
    native: Native,
    maps: SharedMaps,
    recorded: Option<TableResolver>,
    /// Tests: each stall takes at least this long.
    #[cfg(test)]
    pub delay: std::time::Duration,
}

impl Worker {
    pub fn new(native: Native, maps: SharedMaps) -> Worker {
        Worker {
            native,
            maps,
            recorded: None,
            #[cfg(test)]
            delay: std::time::Duration::ZERO,
        }
    }

    /// Do what `msg` says; `blaze`: this thread's resolver, built at first
    /// use.
    fn handle(&mut self, msg: Msg, blaze: &mut Option<Box<BlazeResolver>>) -> Option<Done> {
        match msg {
            Msg::Stall(job) => {
                #[cfg(test)]
                std::thread::sleep(self.delay);
                let native: &mut dyn ResolveNative = match &mut self.native {
                    Native::Blaze => {
                        let b = blaze
                            .get_or_insert_with(|| Box::new(BlazeResolver::new(self.maps.clone())));
                        if job.refresh {
                            b.refresh(job.raw.tgid);
                        }
                        b.as_mut()
                    }
                    Native::Saved(t) => t.as_mut(),
                };
                Some(match &mut self.recorded {
                    Some(table) => finish(
                        *job,
                        &mut Recorder {
                            inner: native,
                            table,
                        },
                    ),
                    None => finish(*job, native),
                })
            }
            Msg::Forget(pid) => {
                if let Some(b) = blaze {
                    b.forget(pid);
                }
                self.maps.forget(pid);
                None
            }
            Msg::Reset => {
                *blaze = None;
                None
            }
            Msg::Record => {
                self.recorded.get_or_insert_with(TableResolver::default);
                None
            }
        }
    }

    fn run(mut self: Box<Self>, jobs: Receiver<Msg>, done: SyncSender<Done>) -> Box<Worker> {
        let mut blaze: Option<Box<BlazeResolver>> = None;
        loop {
            let msg = match blaze.as_mut().filter(|b| b.files_held() > 0) {
                // Idle with files parsed: let them go after a while (their
                // answers stay cached).
                Some(b) => match jobs.recv_timeout(IDLE_RELEASE) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => {
                        b.release_files();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                },
                None => match jobs.recv() {
                    Ok(m) => m,
                    Err(_) => break,
                },
            };
            if let Some(d) = self.handle(msg, &mut blaze)
                && done.send(d).is_err()
            {
                break;
            }
        }
        self
    }

    /// The answers recorded (see [`Symbolizer::record`]).
    pub fn recorded(&self) -> Option<&TableResolver> {
        self.recorded.as_ref()
    }
}

enum State {
    /// Not started (a live engine starts its thread at the first job), or
    /// stopped ([`Symbolizer::close`]); a replay's, always.
    Idle(Box<Worker>),
    Running {
        jobs: SyncSender<Msg>,
        done: Receiver<Done>,
        thread: JoinHandle<Box<Worker>>,
    },
    /// Its thread panicked: the engine finishes every stall itself.
    Lost,
}

/// The engine's handle on its symbolizer: a thread (live) or inline
/// (replay).
pub struct Symbolizer {
    state: State,
    threaded: bool,
    /// Control messages the full queue did not take yet, oldest first
    /// (bounded by the processes forgotten meanwhile that had stalls).
    deferred: VecDeque<Msg>,
    /// Processes with a stall given to the worker since they were last
    /// forgotten: only the worker's caches of these need a `Forget`.
    sent: HashSet<u32>,
    /// Results of inline work, until taken.
    ready: Vec<Done>,
    /// Stalls queued and not yet taken back finished.
    in_flight: usize,
    /// The resolver of inline work on a live engine.
    blaze: Option<Box<BlazeResolver>>,
}

impl Symbolizer {
    /// A symbolizer on its own thread, started at the first job.
    pub fn threaded(w: Worker) -> Symbolizer {
        Symbolizer {
            state: State::Idle(Box::new(w)),
            threaded: true,
            deferred: VecDeque::new(),
            sent: HashSet::new(),
            ready: Vec::new(),
            in_flight: 0,
            blaze: None,
        }
    }

    /// A symbolizer that works as it is given work (a replay: the same
    /// order, the same output, every time).
    pub fn inline(w: Worker) -> Symbolizer {
        Symbolizer {
            threaded: false,
            ..Symbolizer::threaded(w)
        }
    }

    fn start(&mut self) {
        if !self.threaded || !matches!(self.state, State::Idle(_)) {
            return;
        }
        let State::Idle(w) = std::mem::replace(&mut self.state, State::Lost) else {
            unreachable!()
        };
        let (jobs, rx) = mpsc::sync_channel(QUEUE);
        let (tx, done) = mpsc::sync_channel(DONE_QUEUE);
        let spawned = std::thread::Builder::new()
            .name("stallprof-sym".into())
            .spawn(move || {
                // Background work: on a small machine the drain (and the
                // target) must win the CPU over a first parse of a large
                // binary, or the ring buffer fills while both run.
                // SAFETY: setpriority on this thread's own id.
                unsafe {
                    libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
                }
                w.run(rx, tx)
            });
        match spawned {
            Ok(thread) => {
                self.state = State::Running { jobs, done, thread };
            }
            Err(e) => {
                warn!(
                    "cannot start the symbolizer thread ({e}): stalls keep their native frames unnamed \
                     (drops: symbolizer_behind); raise the process's thread limit"
                );
            }
        }
    }

    /// Send `msg`, or give it back when the queue is full (or the thread is
    /// gone).
    fn try_send(&mut self, msg: Msg) -> Result<(), Msg> {
        self.start();
        match &mut self.state {
            State::Idle(w) => {
                if let Some(d) = w.handle(msg, &mut self.blaze) {
                    self.ready.push(d);
                }
                Ok(())
            }
            State::Running { jobs, .. } => match jobs.try_send(msg) {
                Ok(()) => Ok(()),
                Err(TrySendError::Full(m)) => Err(m),
                Err(TrySendError::Disconnected(m)) => {
                    warn!(
                        "the symbolizer thread stopped: stalls from now on keep their native frames \
                         unnamed (drops: symbolizer_behind); report it with the log above"
                    );
                    self.state = State::Lost;
                    self.in_flight = 0;
                    Err(m)
                }
            },
            State::Lost => Err(msg),
        }
    }

    /// Control messages that waited, oldest first, while there is room.
    fn flush_deferred(&mut self) -> bool {
        while let Some(m) = self.deferred.pop_front() {
            if let Err(m) = self.try_send(m) {
                if matches!(self.state, State::Lost) {
                    self.deferred.clear();
                    return true;
                }
                self.deferred.push_front(m);
                return false;
            }
        }
        true
    }

    fn control(&mut self, msg: Msg) {
        if !self.flush_deferred() {
            self.deferred.push_back(msg);
        } else if let Err(m) = self.try_send(msg)
            && !matches!(self.state, State::Lost)
        {
            self.deferred.push_back(m);
        }
    }

    /// Queue a stall; `Err` gives it back when the queue is full: the
    /// caller finishes it without native names. Never waits.
    pub fn submit(&mut self, job: Box<Job>) -> Result<(), Box<Job>> {
        if !self.flush_deferred() {
            return Err(job);
        }
        let pid = job.raw.tgid;
        self.try_send(Msg::Stall(job)).map_err(|m| match m {
            Msg::Stall(j) => j,
            _ => unreachable!("a stall comes back as a stall"),
        })?;
        self.sent.insert(pid);
        self.in_flight += 1;
        Ok(())
    }

    /// No stall queued or finished and not yet taken.
    pub fn idle(&self) -> bool {
        self.in_flight == 0
    }

    /// Process `pid` is gone: after its stalls already queued, the worker's
    /// caches of it go. False when the worker never had one of its stalls,
    /// so holds nothing of it: the caller lets go of its maps snapshot
    /// itself. (Under a sustained CPU load the worker, at nice 19, may not
    /// run for a long time; a churn of processes without stalls must not
    /// pile up behind it.)
    pub fn forget(&mut self, pid: u32) -> bool {
        if !self.sent.remove(&pid) {
            return false;
        }
        self.control(Msg::Forget(pid));
        true
    }

    /// Rebuild the native caches (blazesym's parsed files, answers).
    pub fn reset(&mut self) {
        self.control(Msg::Reset);
    }

    /// Record every native answer from now on (`record --save-events`).
    pub fn record(&mut self) {
        self.control(Msg::Record);
    }

    /// Stalls symbolized since the last call, in order.
    pub fn take_done(&mut self, out: &mut Vec<Done>) {
        let before = out.len();
        self.take_finished(out);
        self.in_flight = self.in_flight.saturating_sub(out.len() - before);
    }

    fn take_finished(&mut self, out: &mut Vec<Done>) {
        out.append(&mut self.ready);
        if let State::Running { done, .. } = &self.state {
            loop {
                match done.try_recv() {
                    Ok(d) => out.push(d),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.stopped();
                        break;
                    }
                }
            }
        }
    }

    /// The thread ended on its own: it panicked.
    fn stopped(&mut self) {
        if let State::Running { .. } = &self.state {
            let State::Running { thread, .. } = std::mem::replace(&mut self.state, State::Lost)
            else {
                unreachable!()
            };
            // What it had queued will not come back.
            self.in_flight = 0;
            match thread.join() {
                Ok(w) => self.state = State::Idle(w),
                Err(_) => warn!(
                    "the symbolizer thread panicked: stalls from now on keep their native frames \
                     unnamed (drops: symbolizer_behind); report it with the log above"
                ),
            }
        }
    }

    /// Finish every queued job (this waits: the end of a recording), then
    /// stop the thread; the results go to `out`. A later job starts it
    /// again.
    pub fn close(&mut self, out: &mut Vec<Done>) {
        self.in_flight = 0;
        out.append(&mut self.ready);
        if !matches!(self.state, State::Running { .. }) {
            for m in std::mem::take(&mut self.deferred) {
                if let State::Idle(w) = &mut self.state
                    && let Some(d) = w.handle(m, &mut self.blaze)
                {
                    out.push(d);
                }
            }
            return;
        }
        let State::Running { jobs, done, thread } = std::mem::replace(&mut self.state, State::Lost)
        else {
            unreachable!()
        };
        // The thread may be waiting for room for a result: take results
        // while the last control messages go in.
        for m in std::mem::take(&mut self.deferred) {
            let mut m = m;
            loop {
                match jobs.try_send(m) {
                    Ok(()) => break,
                    Err(TrySendError::Full(back)) => {
                        m = back;
                        out.extend(done.try_iter());
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    Err(TrySendError::Disconnected(_)) => break,
                }
            }
        }
        drop(jobs);
        out.extend(done.iter());
        match thread.join() {
            Ok(w) => self.state = State::Idle(w),
            Err(_) => warn!(
                "the symbolizer thread panicked: the last stalls keep their native frames unnamed"
            ),
        }
    }

    /// The worker, when stopped.
    pub fn worker(&self) -> Option<&Worker> {
        match &self.state {
            State::Idle(w) => Some(w),
            _ => None,
        }
    }

    /// Tests: make each stall take `d` in the symbolizer.
    #[cfg(test)]
    pub fn set_delay(&mut self, d: std::time::Duration) {
        if let State::Idle(w) = &mut self.state {
            w.delay = d;
        }
    }
}
