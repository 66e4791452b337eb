//! The live reads of each open busy period: its asyncio task (or, when no
//! task runs, the OpenTelemetry span of the thread's own context), its
//! ASGI request's route and its loop's queues (what it holds up), read
//! from the target while the period runs.
//!
//! In: the outcome of each read the engine makes of the live target
//! ([`crate::symbolize::RuntimeReader::asyncio_task`] and `asgi_route`, at
//! the period's stack events with Python frames), and the task BPF read
//! with a stack (`Event::Task`, [`BusyReads::capture`]). Out: a finished
//! stall's task and route, or why it has none ([`TaskMiss`], a route's
//! miss counter) and, for an unreadable one, the reason as a runtime
//! problem of the process. One table, keyed by busy period, serves both
//! kinds; when each kind is read again is [`TASK`] and [`ROUTE`], the one
//! place the retry schedule is set. No reads of its own, no clock: the
//! engine passes `now`. A replay reads nothing (the recording keeps what
//! the live reads found).
//!
//! A stall whose stack never showed an ASGI frame (`scope` local) is no
//! request: nothing to count.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::model::{Delayed, HeldUp, NotRead, NotReadReason, Route, RuntimeProblem};
use crate::pipeline::counters::Counter;
use crate::symbolize::python::{Captured, TaskFound, TaskRead, TraceFound};
use crate::symbolize::queues::{Queues, QueuesMiss};
use crate::symbolize::request::RouteRead;

/// A busy period: (tid, start).
pub type Period = (u32, u64);

/// When one kind of read is made again after a miss: up to `tries`
/// counted misses, the next read at least `first_wait` after the first
/// and twice as long after each further one, up to `max_wait`.
pub struct Schedule {
    pub tries: u32,
    pub first_wait: Duration,
    pub max_wait: Duration,
}

/// Tasks: read at every stack event with Python frames until one is
/// verified, up to 4 tries (BPF's own read of 3.14+ comes with each).
pub const TASK: Schedule = Schedule {
    tries: 4,
    first_wait: Duration::ZERO,
    max_wait: Duration::ZERO,
};

/// A read task's span: read again at each further stack event, up to this
/// many times, while not verified ([`TaskFound::span_unverified`]: a drain's
/// events come in a batch, read at one instant, and only the latest
/// capture may still match the thread's frames) and after (the span of a
/// later capture wins: the stall's blocking call may run in a child span
/// its handler opened after the first capture).
pub const TRACE_TRIES: u32 = 16;

/// Routes: up to 8 tries, at least 10 ms apart after the first miss and
/// twice as far after each further one, at most 640 ms: the stack events
/// of a drain come in a batch, and reads at one instant see one live
/// state. The tries so span 1.27 s of a stall, not its first tens of
/// milliseconds: a first request on a cold page cache spends hundreds of
/// milliseconds importing before and inside the endpoint, its frames
/// changing under every read (CI, 2026-12-03: six reads 10 ms apart all
/// missed a 616 ms stall whose stack named the endpoint for most of it).
pub const ROUTE: Schedule = Schedule {
    tries: 8,
    first_wait: Duration::from_millis(10),
    max_wait: Duration::from_millis(640),
};

/// Loop queues: read at the period's first stack events with Python
/// frames, again only after a miss that may not repeat, up to 3 reads. One read made while the
/// stall lasts is enough: the loop does not run its timers before the stall
/// ends, so its heap holds every timer that comes due during it.
pub const QUEUES_TRIES: u32 = 3;

/// Queue reads kept before those of periods no longer open go.
const MAX_QUEUE_READS: usize = 64;

/// Open busy periods remembered; past this, those no longer open go.
const MAX_PERIODS: usize = 4096;

impl Schedule {
    /// The wait after a period's `reads`-th counted miss before its next read.
    fn wait(&self, reads: u32) -> Duration {
        let doubled = self
            .first_wait
            .saturating_mul(1 << reads.saturating_sub(1).min(16));
        doubled.min(self.max_wait)
    }

    fn wants<T, M>(&self, slot: Option<&Slot<T, M>>, now: Instant) -> Want {
        match slot {
            Some(Slot::Read(_)) => Want::Never,
            Some(Slot::Tried { reads, .. }) if *reads >= self.tries => Want::Never,
            Some(Slot::Tried {
                reads, at: Some(t), ..
            }) if now.duration_since(*t) < self.wait(*reads) => Want::Later,
            _ => Want::Now,
        }
    }
}

/// What the reads of one kind found for one busy period.
#[derive(Clone, Debug)]
enum Slot<T, M> {
    Read(T),
    Tried {
        /// Counted misses.
        reads: u32,
        /// When the last counted read was made.
        at: Option<Instant>,
        /// The miss the stall keeps.
        last: M,
    },
}

impl<T, M> Slot<T, M> {
    /// The slot after a miss at `now`: `counted` uses up a try; `keep_old`
    /// says whether the earlier miss says more than the new one.
    fn missed(
        prev: Option<Slot<T, M>>,
        miss: M,
        counted: bool,
        now: Instant,
        keep_old: impl FnOnce(&M, &M) -> bool,
    ) -> Slot<T, M> {
        let (reads, at, last) = match prev {
            Some(Slot::Tried { reads, at, last }) => {
                let keep = if keep_old(&last, &miss) { last } else { miss };
                (reads, at, keep)
            }
            _ => (0, None, miss),
        };
        Slot::Tried {
            reads: reads + u32::from(counted),
            at: if counted { Some(now) } else { at },
            last,
        }
    }
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

/// One read of a loop's queues, with CLOCK_MONOTONIC just after it (it
/// counts only if the stall was still going on then).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueuesRead {
    pub read: Result<Queues, QueuesMiss>,
    pub after_ns: u64,
    pub tries: u32,
}

impl QueuesRead {
    /// What the stall ending at `end_ns` held up, from this read: the
    /// timers due by then, each late by `end_ns - when` (the loop runs
    /// them right after the stall; the read cannot see when they ran).
    pub fn held_up(&self, end_ns: u64) -> HeldUp {
        let not_read = |reason, detail: Option<String>| HeldUp::NotRead(NotRead { reason, detail });
        match &self.read {
            Err(QueuesMiss::Unsupported(ty)) => not_read(NotReadReason::Runtime, Some(ty.clone())),
            Err(QueuesMiss::NoLoop(why)) => {
                not_read(NotReadReason::Unreadable, Some((*why).to_string()))
            }
            Err(QueuesMiss::Unreadable(why)) => {
                not_read(NotReadReason::Unreadable, Some(why.clone()))
            }
            Ok(_) if self.after_ns >= end_ns => not_read(
                NotReadReason::AfterEnd,
                Some(format!(
                    "read {} µs after the stall's end",
                    (self.after_ns - end_ns) / 1000
                )),
            ),
            Ok(q) => {
                let mut late: Vec<u64> = q
                    .timers_when_ns
                    .iter()
                    .filter(|&&w| w <= end_ns)
                    .map(|&w| end_ns - w)
                    .collect();
                late.sort_unstable_by(|a, b| b.cmp(a));
                HeldUp::Read(Delayed {
                    timers_late_ns: late,
                    ready_handles: q.ready_handles,
                    truncated: q.truncated,
                })
            }
        }
    }
}

/// Every kind of one period.
#[derive(Default)]
struct Reads {
    task: Option<Slot<TaskFound, TaskMiss>>,
    /// Reads made for a read task's span, or the thread's
    /// ([`TRACE_TRIES`]).
    trace_reads: u32,
    /// The span of the thread's own context, read at each task read that
    /// found no task running: the stall's when no read found a task.
    thread: Option<TraceFound>,
    route: Option<Slot<Route, RouteRead>>,
    queues: Option<QueuesRead>,
}

/// A stack whose route read [`ROUTE`]'s wait held back: read at the next
/// drain once it is due, while its period is still open. A stall blocked
/// in one call (a sleep, a blocking client) shows one stack event; a read
/// held back at it would otherwise never come.
#[derive(Debug, PartialEq, Eq)]
pub struct Held {
    pub tgid: u32,
    pub python: Vec<(u64, u64)>,
}

/// Whether a stack event of an open period is read now.
#[derive(Debug, PartialEq, Eq)]
pub enum Want {
    Now,
    /// Too soon after the last read: kept, read when due ([`BusyReads::due`]).
    Later,
    Never,
}

/// The live reads of open busy periods.
#[derive(Default)]
pub struct BusyReads {
    periods: HashMap<Period, Reads>,
    /// The latest stack of each period whose route read was held back.
    held: HashMap<Period, Held>,
    /// tid -> the task BPF read with its next stack event (`Event::Task`
    /// comes just before it; taken by that stack event).
    captured: HashMap<u32, Captured>,
    /// Why a process's asyncio tasks could not be read (the latest reason,
    /// once a stall went without its name because of it).
    task_problems: BTreeMap<u32, String>,
    /// Why a process's routes could not be read (the latest reason).
    route_problems: BTreeMap<u32, String>,
    /// Why a process's loop queues could not be read (the latest reason).
    queue_problems: BTreeMap<u32, String>,
    /// Periods holding a queue read (about: make_room's purge is not
    /// counted, so this may be high until the next purge recounts).
    queue_reads: usize,
}

/// Which route miss a stall keeps: a read that saw the request
/// (unverified, unrouted) over one that could not read it (a torn read of
/// a running thread's frames), and either over "no request" (the stall
/// had ended).
fn rank(r: &RouteRead) -> u8 {
    match r {
        RouteRead::NoRequest => 0,
        RouteRead::Unreadable(_) => 1,
        _ => 2,
    }
}

impl BusyReads {
    /// What survives an engine rebuild: every period's reads (periods
    /// still open keep them); a task BPF read goes with the engine that
    /// drained it.
    pub fn rebuilt(self) -> BusyReads {
        BusyReads {
            captured: HashMap::new(),
            ..self
        }
    }

    /// Keep the task BPF read of `tid` for its next stack event.
    pub fn capture(&mut self, tid: u32, c: Captured) {
        self.captured.insert(tid, c);
    }

    /// What BPF sent of `task` just before this stack of `tid`, if it is
    /// this task's (task 0: none, read it now).
    pub fn take_captured(&mut self, tid: u32, task: u64) -> Captured {
        let memory = match self.captured.remove(&tid) {
            Some(c) if c.task == task => c.memory,
            _ => Vec::new(),
        };
        Captured {
            task,
            memory,
            on_cpu: false,
        }
    }

    /// Thread `tid` exited: its captured task goes.
    pub fn thread_exited(&mut self, tid: u32) {
        self.captured.remove(&tid);
    }

    /// Whether period `key` wants a task read at `now`.
    pub fn wants_task(&self, key: Period, now: Instant) -> Want {
        let reads = self.periods.get(&key);
        let slot = reads.and_then(|r| r.task.as_ref());
        // A span found or not yet verified, the task's or (no task read)
        // the thread's: read again at the next stack events, up to
        // TRACE_TRIES.
        let span = match slot {
            Some(Slot::Read(t)) => Some(t.span()),
            _ => reads.and_then(|r| r.thread.clone()),
        };
        if let (Some(span), Some(r)) = (span, reads)
            && span.wants_more()
            && r.trace_reads < TRACE_TRIES
        {
            return Want::Now;
        }
        TASK.wants(slot, now)
    }

    /// Whether period `key` wants a route read at `now`.
    pub fn wants_route(&self, key: Period, now: Instant) -> Want {
        let slot = self.periods.get(&key).and_then(|r| r.route.as_ref());
        ROUTE.wants(slot, now)
    }

    /// Whether period `key` wants its loop's queues read: none read yet,
    /// or only misses that a later read may not repeat (the loop not
    /// known yet, a torn read), fewer than [`QUEUES_TRIES`]. A loop of a
    /// runtime not read is final: a later read, after the task step, would
    /// only say less.
    pub fn wants_queues(&self, key: Period) -> bool {
        match self.periods.get(&key).and_then(|r| r.queues.as_ref()) {
            None => true,
            Some(q) => {
                matches!(
                    q.read,
                    Err(QueuesMiss::NoLoop(_) | QueuesMiss::Unreadable(_))
                ) && q.tries < QUEUES_TRIES
            }
        }
    }

    /// Keeps a read of period `key`'s loop queues, finished at `after_ns`.
    /// `open` lists the periods still open: past [`MAX_QUEUE_READS`] kept,
    /// those of periods that ended under the threshold (never taken by a
    /// stall) go — a read holds up to 4096 timers.
    pub fn queues_read(
        &mut self,
        key: Period,
        read: Result<Queues, QueuesMiss>,
        after_ns: u64,
        open: impl FnOnce() -> HashSet<Period>,
    ) {
        let tries = self
            .periods
            .get(&key)
            .and_then(|r| r.queues.as_ref())
            .map_or(0, |q| q.tries);
        let open = open();
        if self.queue_reads >= MAX_QUEUE_READS {
            for (k, r) in self.periods.iter_mut() {
                if !open.contains(k) {
                    r.queues = None;
                }
            }
            self.queue_reads = self.periods.values().filter(|r| r.queues.is_some()).count();
        }
        let reads = self.make_room(key, || open);
        let new = reads.queues.is_none();
        reads.queues = Some(QueuesRead {
            read,
            after_ns,
            tries: tries + 1,
        });
        self.queue_reads += usize::from(new);
    }

    /// What the finished stall `key` of `tgid`, ended at `end_ns`, held
    /// up; None when no read was made. Call before [`Self::finish_route`].
    /// An unreadable loop's reason becomes a runtime problem of the process.
    pub fn finish_queues(&mut self, tgid: u32, key: Period, end_ns: u64) -> Option<HeldUp> {
        let q = self.periods.get_mut(&key).and_then(|r| r.queues.take())?;
        self.queue_reads = self.queue_reads.saturating_sub(1);
        if let Err(QueuesMiss::Unreadable(why)) = &q.read {
            self.queue_problems.insert(tgid, why.clone());
        }
        Some(q.held_up(end_ns))
    }

    /// Whether no task read of period `key` was made yet.
    pub fn task_untried(&self, key: Period) -> bool {
        self.periods.get(&key).is_none_or(|r| r.task.is_none())
    }

    /// Keeps what a task read of period `key` at `now` found; `open` lists
    /// the periods still open (to forget the others when the table is full).
    pub fn task_read(
        &mut self,
        key: Period,
        read: Result<TaskFound, TaskRead>,
        now: Instant,
        open: impl FnOnce() -> HashSet<Period>,
    ) {
        let prev = self.periods.get_mut(&key).and_then(|r| r.task.take());
        if let Some(Slot::Read(mut old)) = prev {
            // Read already: a later read may only give its span (the same
            // task's, verified): a pending one, or the span at a later
            // capture of the stall (a handler's `with` may have opened a
            // child span around its blocking call since).
            if let Ok(t) = read
                && t.task.name == old.task.name
                && t.span().replaces(&old.span())
            {
                old.task.trace = t.task.trace;
                old.task.trace_unreadable = t.task.trace_unreadable;
                old.span_unverified = t.span_unverified;
                old.span_pending = t.span_pending;
            }
            let reads = self.make_room(key, open);
            reads.trace_reads += 1;
            reads.task = Some(Slot::Read(old));
            return;
        }
        let slot = match read {
            Ok(t) => Slot::Read(t),
            Err(miss) => {
                let miss = match miss {
                    TaskRead::Unverified => TaskMiss::Unverified,
                    TaskRead::Unreadable(why) => TaskMiss::Unreadable(why),
                    _ => TaskMiss::NoTask,
                };
                // Every read uses up a try; the latest says why.
                Slot::missed(prev, miss, true, now, |_, _| false)
            }
        };
        self.make_room(key, open).task = Some(slot);
    }

    /// Keeps what a read of the thread's own context found for period `key`
    /// (made where a task read found no task); `open` lists the periods
    /// still open. A later read replaces an earlier one as a task's span
    /// does ([`TraceFound::replaces`]).
    pub fn thread_read(
        &mut self,
        key: Period,
        found: TraceFound,
        open: impl FnOnce() -> HashSet<Period>,
    ) {
        let reads = self.make_room(key, open);
        if reads.thread.is_some() {
            reads.trace_reads += 1;
        }
        if reads.thread.as_ref().is_none_or(|old| found.replaces(old)) {
            reads.thread = Some(found);
        }
    }

    /// Keeps what a route read of period `key` at `now` found; `open` lists
    /// the periods still open (to forget the others when the table is full).
    pub fn route_read(
        &mut self,
        key: Period,
        read: Result<Route, RouteRead>,
        now: Instant,
        open: impl FnOnce() -> HashSet<Period>,
    ) {
        let prev = self.periods.get_mut(&key).and_then(|r| r.route.take());
        let slot = match read {
            Ok(r) => Slot::Read(r),
            Err(miss) => {
                // A stack without ASGI frames costs no read of the target
                // (the code objects' `scope` slots are cached): it does not
                // use up the tries.
                let counted = miss != RouteRead::NoRequest;
                Slot::missed(prev, miss, counted, now, |old, new| rank(old) > rank(new))
            }
        };
        self.make_room(key, open).route = Some(slot);
    }

    /// Period `key`'s entry, made room for when the table is full.
    fn make_room(&mut self, key: Period, open: impl FnOnce() -> HashSet<Period>) -> &mut Reads {
        if self.periods.len() >= MAX_PERIODS {
            let open = open();
            self.periods.retain(|k, _| open.contains(k));
        }
        self.periods.entry(key).or_default()
    }

    /// Keep `python`, a stack of period `key` of process `tgid`, for a
    /// route read when it is due (the latest stack replaces an earlier one).
    pub fn hold(&mut self, key: Period, tgid: u32, python: &[(u64, u64)]) {
        if self.held.len() >= MAX_PERIODS && !self.held.contains_key(&key) {
            return;
        }
        self.held.insert(
            key,
            Held {
                tgid,
                python: python.to_vec(),
            },
        );
    }

    /// The held stacks whose read is due at `now`, by period, of periods
    /// `open` still has. The rest of the held ones stay, those of closed
    /// periods go.
    pub fn due(&mut self, now: Instant, open: &HashSet<Period>) -> Vec<(Period, Held)> {
        self.held.retain(|k, _| open.contains(k));
        let due: Vec<Period> = self
            .held
            .keys()
            .filter(|k| self.wants_route(**k, now) == Want::Now)
            .copied()
            .collect();
        due.into_iter()
            .filter_map(|k| self.held.remove(&k).map(|h| (k, h)))
            .collect()
    }

    /// Whether any read is held back (the engine then looks at [`BusyReads::due`]).
    pub fn any_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// The task of the finished stall `key`, or why it has none.
    pub fn finish_task(&mut self, key: Period) -> Result<TaskFound, TaskMiss> {
        match self.periods.get_mut(&key).and_then(|r| r.task.take()) {
            Some(Slot::Read(t)) => Ok(t),
            Some(Slot::Tried { last, .. }) => Err(last),
            None => Err(TaskMiss::NoTask),
        }
    }

    /// The span of the thread's own context of the finished stall `key`
    /// (None when none was read). Call after [`Self::finish_task`], and
    /// keep it only when that found no task.
    pub fn finish_thread(&mut self, key: Period) -> Option<TraceFound> {
        self.periods.get_mut(&key).and_then(|r| r.thread.take())
    }

    /// The route of the finished stall `key` of `tgid`, and the counter of
    /// its miss. The period's reads are done with (its task's first).
    pub fn finish_route(&mut self, tgid: u32, key: Period) -> (Option<Route>, Option<Counter>) {
        self.held.remove(&key);
        let slot = self.periods.remove(&key).and_then(|r| r.route);
        match slot {
            Some(Slot::Read(r)) => (Some(r), None),
            Some(Slot::Tried { last, .. }) => (None, self.route_counter(tgid, last)),
            None => (None, None),
        }
    }

    fn route_counter(&mut self, tgid: u32, miss: RouteRead) -> Option<Counter> {
        match miss {
            RouteRead::Route { .. } | RouteRead::NoRequest => None,
            RouteRead::Unrouted => Some(Counter::AsgiRouteUnrouted),
            RouteRead::Unverified => Some(Counter::AsgiRouteUnverified),
            RouteRead::Unreadable(why) => {
                self.route_problems.insert(tgid, why);
                Some(Counter::AsgiRouteUnreadable)
            }
        }
    }

    /// The counter of a stall of `tgid` without a task name, by why: a
    /// task was seen (`asyncio_task_unverified`) or could not be read
    /// (`asyncio_task_unreadable`, and the reason becomes a runtime problem
    /// of the process), or its stack shows a task step (`coroutine`) but no
    /// read found a task (`asyncio_task_unknown`).
    pub fn task_counter(&mut self, tgid: u32, coroutine: bool, miss: TaskMiss) -> Option<Counter> {
        match miss {
            TaskMiss::Unverified => Some(Counter::AsyncioTaskUnverified),
            TaskMiss::Unreadable(why) => {
                self.task_problems.insert(tgid, why);
                Some(Counter::AsyncioTaskUnreadable)
            }
            TaskMiss::NoTask if coroutine => Some(Counter::AsyncioTaskUnknown),
            TaskMiss::NoTask => None,
        }
    }

    /// A runtime problem per process whose tasks, then per process whose
    /// routes, could not be read; `runtime`: a process's runtime as said
    /// (`cpython 3.12.1`, `node (V8 11.3.244)`) and the command that shows
    /// its version (`python -VV`).
    pub fn problems(
        &self,
        runtime_of: impl Fn(u32) -> (String, &'static str),
    ) -> Vec<RuntimeProblem> {
        let runtime = |pid| runtime_of(pid).0;
        let tasks = self.task_problems.iter().map(|(&pid, why)| RuntimeProblem {
            pid,
            runtime: runtime(pid),
            what: "asyncio task names unavailable: stalls that ran a task do not say which \
                   (drops: asyncio_task_unreadable)"
                .into(),
            why: why.clone(),
            remedy: "report it with the output of `python -VV`; stalls and their frames \
                     are still measured"
                .into(),
        });
        let routes = self
            .route_problems
            .iter()
            .map(|(&pid, why)| RuntimeProblem {
                pid,
                runtime: runtime(pid),
                what: "request routes unavailable: stalls that served a request do not say \
                   which route (drops: asgi_route_unreadable)"
                    .into(),
                why: why.clone(),
                remedy: format!(
                    "report it with the output of {} and the server's and framework's \
                     versions; stalls and their frames are still measured",
                    runtime_of(pid).1
                ),
            });
        let queues = self
            .queue_problems
            .iter()
            .map(|(&pid, why)| RuntimeProblem {
                pid,
                runtime: runtime(pid),
                what: "loop queues unavailable: stalls do not say which timers and \
                       callbacks they held up (drops: held_up_unread)"
                    .into(),
                why: why.clone(),
                remedy: format!(
                    "report it with the output of {}; stalls and their frames are still measured",
                    runtime_of(pid).1
                ),
            });
        tasks.chain(routes).chain(queues).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A finished stall's route, and its miss counter by name.
    fn finish(r: &mut BusyReads, tgid: u32, k: Period) -> (Option<Route>, Option<&'static str>) {
        let (route, miss) = r.finish_route(tgid, k);
        (route, miss.map(Counter::name))
    }

    /// ```text
    ///  timers due:   t1=100   t2=150        t3=400
    ///  stall:      [ 90 ······· read@200 ···· 300 ]
    /// ```
    /// A read made during the stall gives every timer due by its end its
    /// lateness (end - due), worst first; a timer due after it is not
    /// delayed. The same read finished after the end says so.
    #[test]
    fn a_read_during_the_stall_gives_each_due_timer_its_lateness() {
        let mut r = BusyReads::default();
        let k = (7, 90);
        assert!(r.wants_queues(k));
        let q = Queues {
            timers_when_ns: vec![150, 400, 100],
            ready_handles: 2,
            truncated: false,
        };
        r.queues_read(k, Ok(q.clone()), 200, HashSet::new);
        assert!(!r.wants_queues(k), "one read a stall");
        let want = HeldUp::Read(Delayed {
            timers_late_ns: vec![200, 150],
            ready_handles: 2,
            truncated: false,
        });
        assert_eq!(r.finish_queues(1, k, 300), Some(want));
        assert_eq!(r.finish_queues(1, k, 300), None, "taken once");
        r.queues_read(k, Ok(q), 301, HashSet::new);
        let Some(HeldUp::NotRead(n)) = r.finish_queues(1, k, 300) else {
            panic!("a read after the end is not read");
        };
        assert_eq!(n.reason, NotReadReason::AfterEnd);
    }

    /// Reads of periods that ended under the threshold (no stall took
    /// them) do not pile up: past [`MAX_QUEUE_READS`], only open periods'
    /// stay.
    #[test]
    fn queue_reads_of_periods_gone_are_let_go() {
        let mut r = BusyReads::default();
        let q = || Ok(Queues::default());
        for start in 0..(3 * MAX_QUEUE_READS as u64) {
            r.queues_read((7, start), q(), 1, || HashSet::from([(7, start)]));
        }
        let kept = r.periods.values().filter(|p| p.queues.is_some()).count();
        assert!(kept <= MAX_QUEUE_READS + 1, "{kept} kept");
        let last = (7, 3 * MAX_QUEUE_READS as u64 - 1);
        assert!(r.finish_queues(1, last, 10).is_some(), "the open one stays");
    }

    /// A loop not known yet is read again (up to the tries); a runtime not
    /// read is final, and the process's unreadable loop is said.
    #[test]
    fn queue_misses_are_retried_only_when_a_read_may_tell_more() {
        let mut r = BusyReads::default();
        let k = (7, 90);
        for _ in 0..QUEUES_TRIES {
            assert!(r.wants_queues(k));
            r.queues_read(k, Err(QueuesMiss::NoLoop("not yet")), 1, HashSet::new);
        }
        assert!(!r.wants_queues(k));
        r.queues_read(
            k,
            Err(QueuesMiss::Unsupported("uvloop.Loop".into())),
            1,
            HashSet::new,
        );
        assert!(!r.wants_queues((7, 90)));
        let Some(HeldUp::NotRead(n)) = r.finish_queues(1, k, 300) else {
            panic!("not read");
        };
        assert_eq!(
            (n.reason, n.detail.as_deref()),
            (NotReadReason::Runtime, Some("uvloop.Loop"))
        );
        r.queues_read(
            k,
            Err(QueuesMiss::Unreadable("torn".into())),
            1,
            HashSet::new,
        );
        assert!(r.finish_queues(4, k, 300).is_some());
        assert_eq!(r.problems(|_| ("cpython".into(), "`python -VV`"))[0].pid, 4);
    }

    /// A read held back by the spacing is made once it is due, with the
    /// latest stack, and only while its period is open.
    #[test]
    fn a_held_back_read_is_made_when_due() {
        let mut r = BusyReads::default();
        let (k, t0) = ((7, 100), Instant::now());
        r.route_read(k, Err(RouteRead::Unverified), t0, HashSet::new);
        assert_eq!(r.wants_route(k, t0), Want::Later);
        r.hold(k, 1, &[(10, 1)]);
        r.hold(k, 1, &[(20, 2)]);
        let open: HashSet<_> = [k].into();
        assert!(r.due(t0, &open).is_empty(), "not yet");
        let held = Held {
            tgid: 1,
            python: vec![(20, 2)],
        };
        assert_eq!(r.due(t0 + ROUTE.first_wait, &open), vec![(k, held)]);
        assert!(!r.any_held());
        r.hold(k, 1, &[(30, 3)]);
        assert!(
            r.due(t0 + ROUTE.first_wait, &HashSet::new()).is_empty(),
            "period closed"
        );
        assert!(!r.any_held());
    }

    /// ```text
    /// stack events:  e1      e2      e3      e4 ... e16      e17
    /// task read:     NoTask  NoTask  NoTask  NoTask (TASK's tries used up)
    /// thread span:   moved   moved   A       B  ... B        (no read)
    /// ```
    /// A plain callback's stall: its thread's context is read with each
    /// task read that finds no task, again while its span is unverified or
    /// found (a later capture's may be a child span), up to TRACE_TRIES;
    /// the latest verified span is the stall's.
    #[test]
    fn with_no_task_the_threads_span_is_read_until_verified() {
        use crate::symbolize::python::SpanRead;
        let span = |id: u64, still: bool| {
            let read = SpanRead::Span {
                trace_id: 1,
                span_id: id,
            };
            TraceFound::checked(Ok(read), still)
        };
        let mut r = BusyReads::default();
        let (k, now) = ((7, 100), Instant::now());
        let mut reads = 0;
        let mut read = |r: &mut BusyReads, found: TraceFound| {
            assert_eq!(r.wants_task(k, now), Want::Now, "read {reads}");
            r.task_read(k, Err(TaskRead::NoTask), now, HashSet::new);
            r.thread_read(k, found, HashSet::new);
            reads += 1;
        };
        read(&mut r, span(0xa, false));
        read(&mut r, span(0xa, false));
        read(&mut r, span(0xa, true));
        read(&mut r, span(0xa, false));
        for _ in 4..=TRACE_TRIES {
            read(&mut r, span(0xb, true));
        }
        assert_eq!(r.wants_task(k, now), Want::Never);
        assert_eq!(r.finish_task(k), Err(TaskMiss::NoTask));
        let got = r.finish_thread(k).expect("a thread read");
        assert_eq!(got.trace.trace, Some(crate::model::SpanIds::new(1, 0xb)));
        assert!(!got.span_unverified);

        // No span in the thread's context: TASK's tries only.
        let k = (8, 100);
        for _ in 0..TASK.tries {
            assert_eq!(r.wants_task(k, now), Want::Now);
            r.task_read(k, Err(TaskRead::NoTask), now, HashSet::new);
            r.thread_read(k, TraceFound::default(), HashSet::new);
        }
        assert_eq!(r.wants_task(k, now), Want::Never);
    }

    fn route() -> Route {
        Route {
            method: "POST".into(),
            template: "/resume/{rid}".into(),
        }
    }

    #[test]
    fn a_read_route_is_the_stalls_and_stops_the_reads() {
        let mut r = BusyReads::default();
        let (k, t0) = ((7, 100), Instant::now());
        assert_eq!(r.wants_route(k, t0), Want::Now);
        r.route_read(k, Err(RouteRead::Unverified), t0, HashSet::new);
        assert_eq!(r.wants_route(k, t0), Want::Later, "one read an instant");
        let t1 = t0 + ROUTE.first_wait;
        assert_eq!(r.wants_route(k, t1), Want::Now);
        r.route_read(k, Ok(route()), t1, HashSet::new);
        assert_eq!(r.wants_route(k, t1 + ROUTE.first_wait), Want::Never);
        assert_eq!(finish(&mut r, 1, k), (Some(route()), None));
        assert_eq!(finish(&mut r, 1, k), (None, None), "taken once");
    }

    /// Each counted miss doubles the wait before the next read, so the
    /// tries reach past a stall's first second.
    #[test]
    fn the_wait_doubles_after_each_miss() {
        let mut r = BusyReads::default();
        let (k, mut t) = ((7, 100), Instant::now());
        let mut span = Duration::ZERO;
        for n in 1..ROUTE.tries {
            r.route_read(k, Err(RouteRead::Unverified), t, HashSet::new);
            let wait = ROUTE.wait(n);
            assert_eq!(
                r.wants_route(k, t + wait / 2),
                Want::Later,
                "after miss {n}"
            );
            assert_eq!(r.wants_route(k, t + wait), Want::Now, "after miss {n}");
            t += wait;
            span += wait;
        }
        r.route_read(k, Err(RouteRead::Unverified), t, HashSet::new);
        assert_eq!(r.wants_route(k, t + ROUTE.max_wait), Want::Never);
        assert_eq!(span, Duration::from_millis(1270));
        assert_eq!(ROUTE.wait(40), ROUTE.max_wait);
    }

    #[test]
    fn misses_are_counted_by_why_and_the_most_telling_is_kept() {
        let mut r = BusyReads::default();
        let k = (7, 100);
        let mut t = Instant::now();
        let mut read = |r: &mut BusyReads, miss: RouteRead| {
            t += ROUTE.max_wait;
            r.route_read(k, Err(miss), t, HashSet::new);
            t
        };
        // Saw the request, then a torn read, then the stall was over.
        read(&mut r, RouteRead::Unverified);
        read(&mut r, RouteRead::Unreadable("torn".into()));
        read(&mut r, RouteRead::NoRequest);
        assert_eq!(finish(&mut r, 1, k), (None, Some("asgi_route_unverified")));
        assert!(
            r.problems(|_| ("cpython".into(), "`python -VV`"))
                .is_empty()
        );
        // Stacks without a request's frames use no tries.
        for _ in 0..2 * ROUTE.tries {
            read(&mut r, RouteRead::NoRequest);
        }
        let now = read(&mut r, RouteRead::NoRequest);
        assert_eq!(r.wants_route(k, now + ROUTE.first_wait), Want::Now);
        for _ in 0..ROUTE.tries {
            read(&mut r, RouteRead::Unreadable("bad dict".into()));
        }
        let now = read(&mut r, RouteRead::NoRequest);
        assert_eq!(r.wants_route(k, now + ROUTE.first_wait), Want::Never);
        assert_eq!(finish(&mut r, 1, k), (None, Some("asgi_route_unreadable")));
        assert_eq!(
            r.problems(|_| ("cpython".into(), "`python -VV`"))[0].why,
            "bad dict"
        );
        read(&mut r, RouteRead::NoRequest);
        assert_eq!(
            finish(&mut r, 1, k),
            (None, None),
            "not a request: nothing to count"
        );
        read(&mut r, RouteRead::Unrouted);
        assert_eq!(finish(&mut r, 1, k), (None, Some("asgi_route_unrouted")));
    }
}
