//! Stall assembly: a pure state machine from events to stall records.
//!
//! In: [`Event`]s in timestamp order. Out: [`Output`]s — finished stalls
//! ([`RawStall`], stacks still as interned addresses) and loop-key decisions
//! the probe layer publishes back to BPF.
//!
//! Model, per thread:
//! ```text
//!   park (loop wait)   busy period                      park
//! ───────────────────┤return ··· switch-out ··· in ···├enter──────
//!                     ^start                          ^end
//! ```
//! * A *park* is a wait on the thread's *loop key* (syscall class + fd,
//!   e.g. epoll on fd 3), which the [`LoopRegistry`] (`loops`) elects and
//!   keeps: a blocking client's `poll()` on its socket inside a stall is not
//!   a park and does not end the stall, however often it polls. Until a
//!   thread's key is known every wait counts as a park, but its busy
//!   periods are not reported. When the key moves (a re-created loop), the
//!   busy period open on the old key spans the change-over and is dropped.
//! * Busy time splits exactly into on-CPU, off-CPU blocked (switch-out to
//!   wakeup), run-queue wait (wakeup, or preemption, to switch-in) and
//!   CPU-throttled (a preemption the kernel flagged as its cgroup's quota
//!   running out, to switch-in: as much of it as the kernel measured as
//!   throttled, the rest after the unthrottle is run-queue wait).
//! * A preemption the kernel side reported at the park's return
//!   (`preempt::WOKEN`) is the loop being woken from its park and waiting
//!   for a CPU (or throttled) before it ran its own code: its part carries
//!   the park's wait (`woken`, with its syscall) instead of an empty stack.
//!   A preemption after the loop's code began is plain run-queue wait, even
//!   before its first stack (samples wait for the gate): telling the two
//!   apart by "no stack yet" put a preemption under load at the stall's
//!   start, before the victim's own clock began.
//! * The tasks that held the CPU while the thread waited for it (the
//!   kernel names them at its switch-in) are summed per stall.
//!   Blocked time in a wait for a CPython GIL held by another thread (the
//!   BPF side names the holder) is its own kind, `GilWait`; it counts in
//!   `off_cpu_ns`.
//! * On-CPU time is spread over the CPU-clock samples taken in the period in
//!   proportion to their counts; off-CPU and run-queue time go to the stack
//!   at switch-out. So a stall's part weights sum to its duration.
//! * Busy periods shorter than the threshold are dropped with their samples,
//!   and so are busy periods of a thread whose loop key is not known yet
//!   (a thread that waited once is not yet an event loop).
use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use profiler_common::wait_key;
use serde::Serialize;

use crate::{
    assemble::loops::{Decision, LoopRegistry},
    kernel::event::{Event, RawStack},
    model::{Holder, PartKind},
};

pub type StackId = u32;

/// Interns stacks: a busy period holds counts per stack id, not copies.
/// Each stack is stored once, shared by the index and the list (and by the
/// stalls handed to the symbolizer, [`StallStacks`]).
#[derive(Default, Debug)]
pub struct StackTable {
    stacks: Vec<Arc<RawStack>>,
    index: HashMap<Arc<RawStack>, StackId>,
}

impl StackTable {
    pub fn intern(&mut self, s: RawStack) -> StackId {
        if let Some(&id) = self.index.get(&s) {
            return id;
        }
        let id = self.stacks.len() as StackId;
        let s = Arc::new(s);
        self.stacks.push(s.clone());
        self.index.insert(s, id);
        id
    }

    pub fn contains(&self, s: &RawStack) -> bool {
        self.index.contains_key(s)
    }

    pub fn get(&self, id: StackId) -> &RawStack {
        &self.stacks[id as usize]
    }

    /// The stacks one stall uses, shared (no copy), for the symbolizer.
    pub fn of_stall(&self, raw: &RawStall) -> StallStacks {
        StallStacks(
            raw.parts
                .iter()
                .filter_map(|p| p.stack)
                .map(|id| (id, self.stacks[id as usize].clone()))
                .collect(),
        )
    }

    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Bytes the interned stacks hold (their address lists and the table's
    /// own entries), for the memory accounting at the end of a recording.
    pub fn bytes(&self) -> usize {
        let per = std::mem::size_of::<RawStack>() + 2 * std::mem::size_of::<usize>();
        self.stacks
            .iter()
            .map(|s| {
                per + 8 * (s.kernel.len() + s.user.len())
                    + std::mem::size_of::<crate::kernel::event::JsSlot>() * s.js.len()
                    + 16 * (s.python.len() + s.holder_python.len())
            })
            .sum::<usize>()
            + self.index.capacity() * (std::mem::size_of::<(Arc<RawStack>, StackId)>() + 1)
            + self.stacks.capacity() * std::mem::size_of::<Arc<RawStack>>()
    }
}

/// Stacks by id: the tracker's whole table, or one stall's share of it.
pub trait Stacks {
    fn get(&self, id: StackId) -> &RawStack;
}

impl Stacks for StackTable {
    fn get(&self, id: StackId) -> &RawStack {
        StackTable::get(self, id)
    }
}

/// The stacks of one stall ([`StackTable::of_stall`]).
#[derive(Debug, Default)]
pub struct StallStacks(HashMap<StackId, Arc<RawStack>>);

impl Stacks for StallStacks {
    fn get(&self, id: StackId) -> &RawStack {
        &self.0[&id]
    }
}

/// A slice of a stall's time attributed to one stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawPart {
    /// None: on-CPU time with no sample in it (shorter than a sample period).
    pub stack: Option<StackId>,
    pub weight_ns: u64,
    pub kind: PartKind,
    pub syscall: Option<u32>,
    /// Off-CPU: the thread that woke this one (the task current at wakeup).
    pub waker: Option<u32>,
    /// Run-queue or throttled time right after the loop's park returned,
    /// before its own code ran: `syscall` is the park's wait.
    pub woken: bool,
}

/// Distinct CPU holders kept per busy period; later ones are summed under
/// one `[other tasks]` entry. A stall on a busy host sees a handful.
pub const MAX_HOLDERS: usize = 32;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawStall {
    pub tid: u32,
    pub tgid: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub on_cpu_ns: u64,
    pub off_cpu_ns: u64,
    pub runqueue_ns: u64,
    /// Of the off-CPU time, what was CPU-throttled (not in `off_cpu_ns` or
    /// `runqueue_ns`).
    pub throttled_ns: u64,
    pub parts: Vec<RawPart>,
    /// Who held the CPU while the thread waited for it, heaviest first.
    pub cpu_holders: Vec<(Holder, u64)>,
    /// The recording ended (or the thread exited) before the loop parked again.
    pub incomplete: bool,
}

impl RawStall {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Output {
    Stall(RawStall),
    /// The loop's wait for `tid` is now `key` (see `profiler_common::wait_key`).
    LoopKey {
        tid: u32,
        key: u64,
    },
    /// `tid`, a loop thread, exited: its kernel entry can go.
    LoopGone {
        tid: u32,
    },
}

#[derive(Clone, Debug)]
pub struct TrackerConfig {
    pub threshold_ns: u64,
    /// Only these threads (`--tid`); None = every thread that parks.
    pub tids: Option<HashSet<u32>>,
}

#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct TrackerStats {
    pub busy_periods: u64,
    pub stalls: u64,
    pub samples: u64,
    /// Scheduler events that arrived for a thread with no busy period open
    /// (normal right after attach).
    pub events_outside_busy: u64,
    /// A sample (or the park) showed the thread running while a switch-out
    /// was still open: its switch-in was not seen.
    pub switch_ins_missed: u64,
    /// Busy periods dropped because the thread's loop key moved during them.
    pub busy_dropped_on_move: u64,
}

#[derive(Debug)]
struct Pending {
    out: u64,
    runnable: bool,
    /// A preemption because the cgroup's quota ran out.
    throttled: bool,
    /// A preemption before the busy period's first stack: `syscall` is the
    /// park's wait.
    woken: bool,
    syscall: Option<u32>,
    stack: StackId,
    wake: Option<(u64, Option<u32>)>,
}

/// An off-CPU part's key: (stack, syscall, waker, woken).
type OffKey = (StackId, Option<u32>, Option<u32>, bool);

/// Time of one off-CPU key, by kind.
#[derive(Debug, Default, Clone, Copy)]
struct OffTime {
    blocked: u64,
    runq: u64,
    throttled: u64,
}

#[derive(Debug, Default)]
struct Busy {
    start: u64,
    /// The wait the busy period began by returning from (its syscall).
    park: Option<u32>,
    /// The latest on-CPU sample's stack: where a preempted thread was.
    last_sample: Option<StackId>,
    samples: HashMap<StackId, u64>,
    offs: HashMap<OffKey, OffTime>,
    pending: Option<Pending>,
    holders: HashMap<Holder, u64>,
}

impl Busy {
    /// The thread runs again at `ts`: split the time since its switch-out
    /// into blocked (until wakeup), throttled (as much as the kernel
    /// measured, `throttled_ns`; all of it when it could not) and run-queue
    /// wait.
    fn back_on_cpu(&mut self, ts: u64, throttled_ns: Option<u64>) {
        let Some(p) = self.pending.take() else { return };
        let end = ts.max(p.out);
        let (blocked, waiting, waker) = if p.runnable {
            (0, end - p.out, None)
        } else {
            let (w, waker) = p
                .wake
                .map_or((end, None), |(w, who)| (w.clamp(p.out, end), who));
            (w - p.out, end - w, waker)
        };
        let throttled = if p.throttled {
            throttled_ns.map_or(waiting, |t| t.min(waiting))
        } else {
            0
        };
        let e = self
            .offs
            .entry((p.stack, p.syscall, waker, p.woken))
            .or_default();
        e.blocked += blocked;
        e.throttled += throttled;
        e.runq += waiting - throttled;
    }

    fn add_holder(&mut self, h: Holder, ns: u64) {
        let h = if self.holders.len() >= MAX_HOLDERS && !self.holders.contains_key(&h) {
            Holder::OtherTasks
        } else {
            h
        };
        *self.holders.entry(h).or_default() += ns;
    }
}

/// Stall-assembly state of one thread (its loop identity is in the registry).
#[derive(Debug, Default)]
struct Thread {
    tgid: u32,
    busy: Option<Busy>,
}

pub struct Tracker {
    cfg: TrackerConfig,
    /// Which wait is each thread's loop park: the one owner of that fact.
    loops: LoopRegistry,
    threads: HashMap<u32, Thread>,
    pub stacks: StackTable,
    pub stats: TrackerStats,
}

impl Tracker {
    pub fn new(cfg: TrackerConfig) -> Self {
        let loops = LoopRegistry::default();
        Tracker {
            cfg,
            loops,
            threads: HashMap::new(),
            stacks: StackTable::default(),
            stats: TrackerStats::default(),
        }
    }

    pub fn stacks(&self) -> &StackTable {
        &self.stacks
    }

    pub fn config(&self) -> &TrackerConfig {
        &self.cfg
    }

    pub fn threshold_ns(&self) -> u64 {
        self.cfg.threshold_ns
    }

    /// The loop-thread registry.
    pub fn loops(&self) -> &LoopRegistry {
        &self.loops
    }

    /// The same tracker with a stack table holding only what the busy
    /// periods still open refer to (the daemon's memory bound: the table
    /// only grows). Loop identities and open busy periods carry over, so
    /// nothing is cut; the counters start again.
    pub fn compacted(self) -> Tracker {
        let Tracker {
            cfg,
            loops,
            mut threads,
            stacks: old,
            ..
        } = self;
        let mut stacks = StackTable::default();
        let mut keep = |id: StackId| stacks.intern(old.get(id).clone());
        for b in threads.values_mut().filter_map(|t| t.busy.as_mut()) {
            b.last_sample = b.last_sample.map(&mut keep);
            b.samples = b.samples.drain().map(|(id, n)| (keep(id), n)).collect();
            b.offs = b
                .offs
                .drain()
                .map(|((id, sys, waker, woken), v)| ((keep(id), sys, waker, woken), v))
                .collect();
            if let Some(p) = b.pending.as_mut() {
                p.stack = keep(p.stack);
            }
        }
        Tracker {
            cfg,
            loops,
            threads,
            stacks,
            stats: TrackerStats::default(),
        }
    }

    /// Forget a process that exited or exec'd; its loop threads (whose
    /// kernel entries must go).
    pub fn forget_process(&mut self, tgid: u32) -> Vec<u32> {
        self.threads.retain(|_, t| t.tgid != tgid);
        self.loops.forget_process(tgid)
    }

    /// Threads currently inside a busy period: (tid, start).
    pub fn busy_threads(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.threads
            .iter()
            .filter_map(|(&t, th)| th.busy.as_ref().map(|b| (t, b.start)))
    }

    /// The start of `tid`'s busy period, while it is inside one.
    pub fn open_period(&self, tid: u32) -> Option<u64> {
        self.threads.get(&tid)?.busy.as_ref().map(|b| b.start)
    }

    /// The busy periods open now, by (tid, start): what a table kept per
    /// open period prunes down to.
    pub fn open_periods(&self) -> HashSet<(u32, u64)> {
        self.busy_threads().collect()
    }

    /// Feed one event; finished stalls and loop-key decisions go to `out`.
    pub fn push(&mut self, ev: Event, out: &mut Vec<Output>) {
        let tid = ev.tid();
        if let Some(only) = &self.cfg.tids
            && !only.contains(&tid)
        {
            return;
        }
        match ev {
            Event::WaitEnter {
                tgid, ts, nr, fd, ..
            } => {
                let key = wait_key(nr, fd);
                let decision = self.loops.wait_enter(tid, tgid, nr, fd, ts);
                let th = self.threads.entry(tid).or_default();
                th.tgid = tgid;
                if let Some(Decision::Elected { key, moved, .. }) = decision {
                    out.push(Output::LoopKey { tid, key });
                    if moved && th.busy.take().is_some() {
                        self.stats.busy_dropped_on_move += 1;
                    }
                }
                if self.loops.is_park(tid, key)
                    && let Some(b) = th.busy.take()
                    && self.loops.is_loop_thread(tid)
                {
                    self.close(tid, tgid, b, ts, false, out);
                }
            }
            Event::WaitExit {
                tgid, ts, nr, fd, ..
            } => {
                let key = wait_key(nr, fd);
                self.loops.wait_exit(tid, tgid, key, ts);
                let th = self.threads.entry(tid).or_default();
                th.tgid = tgid;
                if self.loops.is_park(tid, key) && th.busy.is_none() {
                    th.busy = Some(Busy {
                        start: ts,
                        park: Some(nr),
                        ..Default::default()
                    });
                    self.stats.busy_periods += 1;
                }
            }
            Event::SwitchOut {
                ts,
                runnable,
                syscall,
                stack,
                ..
            } => match self.threads.get_mut(&tid).and_then(|t| t.busy.as_mut()) {
                Some(b) => {
                    let stack = self.stacks.intern(stack);
                    b.pending = Some(Pending {
                        out: ts.max(b.start),
                        runnable,
                        throttled: false,
                        woken: false,
                        syscall,
                        stack,
                        wake: None,
                    });
                }
                None => self.stats.events_outside_busy += 1,
            },
            Event::Preempted {
                ts,
                throttled,
                woken,
                ..
            } => match self.threads.get_mut(&tid).and_then(|t| t.busy.as_mut()) {
                Some(b) => {
                    let stack = match b.last_sample {
                        Some(s) => s,
                        None => self.stacks.intern(RawStack::default()),
                    };
                    b.pending = Some(Pending {
                        out: ts.max(b.start),
                        runnable: true,
                        throttled,
                        woken,
                        syscall: if woken { b.park } else { None },
                        stack,
                        wake: None,
                    });
                }
                None => self.stats.events_outside_busy += 1,
            },
            Event::Wakeup { ts, waker, .. } => {
                if let Some(p) = self
                    .threads
                    .get_mut(&tid)
                    .and_then(|t| t.busy.as_mut())
                    .and_then(|b| b.pending.as_mut())
                    && p.wake.is_none()
                {
                    p.wake = Some((ts, waker));
                }
            }
            Event::SwitchIn {
                ts, throttled_ns, ..
            } => {
                if let Some(b) = self.threads.get_mut(&tid).and_then(|t| t.busy.as_mut()) {
                    b.back_on_cpu(ts, throttled_ns);
                }
            }
            Event::CpuHolder { holder, ns, .. } => {
                match self.threads.get_mut(&tid).and_then(|t| t.busy.as_mut()) {
                    Some(b) => b.add_holder(holder, ns),
                    None => self.stats.events_outside_busy += 1,
                }
            }
            Event::Sample { ts, stack, .. } => {
                if let Some(b) = self.threads.get_mut(&tid).and_then(|t| t.busy.as_mut()) {
                    // A sample means the thread runs: a switch-in we did not
                    // see happened by now. Close the gap here rather than let
                    // run-queue time run on until the stall's end.
                    if b.pending.is_some() {
                        self.stats.switch_ins_missed += 1;
                        b.back_on_cpu(ts, None);
                    }
                    let id = self.stacks.intern(stack);
                    *b.samples.entry(id).or_default() += 1;
                    b.last_sample = Some(id);
                    self.stats.samples += 1;
                }
            }
            Event::Exit { ts, .. } => {
                let was_loop = self.loops.thread_exited(tid);
                if let Some(mut th) = self.threads.remove(&tid)
                    && was_loop
                    && let Some(b) = th.busy.take()
                {
                    self.close(tid, th.tgid, b, ts, true, out);
                }
                if was_loop {
                    out.push(Output::LoopGone { tid });
                }
            }
            // What names a stack's task, and which processes are watched:
            // the engine's, not the timeline's.
            Event::Task { .. } | Event::Fork { .. } => {}
        }
    }

    /// End of recording: busy periods still open become incomplete stalls
    /// when they are already over the threshold.
    pub fn finish(&mut self, ts: u64, out: &mut Vec<Output>) {
        let loops = &self.loops;
        let mut open: Vec<(u32, u32, Busy)> = self
            .threads
            .iter_mut()
            .filter(|(tid, _)| loops.is_loop_thread(**tid))
            .filter_map(|(&tid, th)| th.busy.take().map(|b| (tid, th.tgid, b)))
            .collect();
        open.sort_by_key(|(_, _, b)| b.start);
        for (tid, tgid, b) in open {
            self.close(tid, tgid, b, ts, true, out);
        }
    }

    fn close(
        &mut self,
        tid: u32,
        tgid: u32,
        mut b: Busy,
        end: u64,
        incomplete: bool,
        out: &mut Vec<Output>,
    ) {
        let end = end.max(b.start);
        let duration = end - b.start;
        if duration < self.cfg.threshold_ns {
            return;
        }
        // Still off-CPU at the end: real when the recording or the thread
        // ended mid-stall; after a park, the switch-in was missed.
        if b.pending.is_some() {
            if !incomplete {
                self.stats.switch_ins_missed += 1;
            }
            b.back_on_cpu(end, None);
        }
        let mut parts = Vec::new();
        let (mut off, mut runq, mut throttled) = (0u64, 0u64, 0u64);
        let mut offs: Vec<_> = b.offs.into_iter().collect();
        offs.sort_by_key(|(k, _)| *k);
        for ((stack, syscall, waker, woken), t) in offs {
            let OffTime {
                blocked,
                runq: rq,
                throttled: thr,
            } = t;
            off += blocked;
            runq += rq;
            throttled += thr;
            if blocked > 0 {
                let kind = if self.stacks.get(stack).gil_holder != 0 {
                    PartKind::GilWait
                } else {
                    PartKind::OffCpu
                };
                parts.push(RawPart {
                    stack: Some(stack),
                    weight_ns: blocked,
                    kind,
                    syscall,
                    waker,
                    woken: false,
                });
            }
            for (kind, ns) in [(PartKind::Runqueue, rq), (PartKind::Throttled, thr)] {
                if ns > 0 {
                    parts.push(RawPart {
                        stack: Some(stack),
                        weight_ns: ns,
                        kind,
                        syscall: if woken { syscall } else { None },
                        waker: None,
                        woken,
                    });
                }
            }
        }
        // Clock skew between CPUs can make the parts exceed the wall time by
        // a hair; on-CPU takes the remainder and never goes negative.
        let on_cpu = duration.saturating_sub(off + runq + throttled);
        let mut cpu_holders: Vec<(Holder, u64)> = b.holders.into_iter().collect();
        cpu_holders.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        parts.extend(spread(on_cpu, b.samples));
        self.stats.stalls += 1;
        out.push(Output::Stall(RawStall {
            tid,
            tgid,
            start_ns: b.start,
            end_ns: end,
            on_cpu_ns: on_cpu,
            off_cpu_ns: off,
            runqueue_ns: runq,
            throttled_ns: throttled,
            parts,
            cpu_holders,
            incomplete,
        }));
    }
}

/// Spread `total` ns over sampled stacks in proportion to their counts,
/// exactly (largest remainders get the leftover nanoseconds).
fn spread(total: u64, samples: HashMap<StackId, u64>) -> Vec<RawPart> {
    let part = |stack, weight_ns| RawPart {
        stack,
        weight_ns,
        kind: PartKind::OnCpu,
        syscall: None,
        waker: None,
        woken: false,
    };
    if total == 0 {
        return Vec::new();
    }
    let n: u64 = samples.values().sum();
    if n == 0 {
        return vec![part(None, total)];
    }
    let mut v: Vec<(StackId, u64, u64)> = samples
        .into_iter()
        .map(|(s, c)| {
            let exact = total as u128 * c as u128;
            (s, (exact / n as u128) as u64, (exact % n as u128) as u64)
        })
        .collect();
    let mut left = total - v.iter().map(|x| x.1).sum::<u64>();
    v.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
    for x in v.iter_mut() {
        if left == 0 {
            break;
        }
        x.1 += 1;
        left -= 1;
    }
    v.sort_by_key(|x| x.0);
    v.into_iter()
        .filter(|x| x.1 > 0)
        .map(|(s, w, _)| part(Some(s), w))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assemble::loops::POLL_DECIDE;
    use profiler_common::sysno::{EPOLL_WAIT, POLL};

    const MS: u64 = 1_000_000;

    fn tracker(threshold_ms: u64) -> Tracker {
        Tracker::new(TrackerConfig {
            threshold_ns: threshold_ms * MS,
            tids: None,
        })
    }

    fn stack(user: u64) -> RawStack {
        RawStack {
            user: vec![user],
            ..Default::default()
        }
    }

    fn enter(ts: u64, nr: u32, fd: i32) -> Event {
        Event::WaitEnter {
            tid: 1,
            tgid: 1,
            ts: ts * MS,
            nr,
            fd,
        }
    }
    fn exit(ts: u64, nr: u32, fd: i32) -> Event {
        Event::WaitExit {
            tid: 1,
            tgid: 1,
            ts: ts * MS,
            nr,
            fd,
            ret: 0,
        }
    }
    fn sample(ts: u64, user: u64) -> Event {
        Event::Sample {
            tid: 1,
            tgid: 1,
            ts: ts * MS,
            stack: stack(user),
            task: 0,
        }
    }

    /// Two parks on epoll fd 3 at t=0: the loop key is known from then on.
    fn warmed(threshold_ms: u64) -> Tracker {
        let mut t = tracker(threshold_ms);
        let mut out = Vec::new();
        for e in [
            enter(0, EPOLL_WAIT, 3),
            exit(0, EPOLL_WAIT, 3),
            enter(0, EPOLL_WAIT, 3),
        ] {
            t.push(e, &mut out);
        }
        t
    }

    fn run(t: &mut Tracker, evs: Vec<Event>) -> Vec<RawStall> {
        let mut out = Vec::new();
        for e in evs {
            t.push(e, &mut out);
        }
        out.into_iter()
            .filter_map(|o| match o {
                Output::Stall(s) => Some(s),
                _ => None,
            })
            .collect()
    }

    /// Idle ticks, then one 100 ms spin:
    /// ```text
    /// epoll(3) |0-1|  |1-2|  busy 2..102 (samples A×3, B×1)  |102-
    /// ```
    #[test]
    fn spin_stall_spreads_on_cpu_over_samples() {
        let mut t = tracker(50);
        let s = run(
            &mut t,
            vec![
                enter(0, EPOLL_WAIT, 3),
                exit(1, EPOLL_WAIT, 3),
                enter(1, EPOLL_WAIT, 3),
                exit(2, EPOLL_WAIT, 3),
                sample(10, 0xA),
                sample(40, 0xA),
                sample(70, 0xA),
                sample(90, 0xB),
                enter(102, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!(s.len(), 1);
        let s = &s[0];
        assert_eq!((s.start_ns, s.end_ns), (2 * MS, 102 * MS));
        assert_eq!((s.on_cpu_ns, s.off_cpu_ns, s.runqueue_ns), (100 * MS, 0, 0));
        let w: Vec<u64> = s.parts.iter().map(|p| p.weight_ns).collect();
        assert_eq!(w, [75 * MS, 25 * MS]);
    }

    /// A thread that waited once is not a loop yet: no stall from it.
    #[test]
    fn undecided_thread_makes_no_stalls() {
        let mut t = tracker(50);
        let s = run(&mut t, vec![exit(0, POLL, 4), enter(500, EPOLL_WAIT, 9)]);
        assert!(s.is_empty());
    }

    /// Short busy periods are dropped with their samples.
    #[test]
    fn short_busy_is_not_a_stall() {
        let mut t = warmed(50);
        let s = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                sample(10, 1),
                enter(20, EPOLL_WAIT, 3),
            ],
        );
        assert!(s.is_empty());
        assert_eq!(t.stats.busy_periods, 2); // the warm-up one and this one
    }

    /// A blocking client polls its socket inside the stall; once the loop's
    /// epoll fd is known, that poll does not end the stall:
    /// ```text
    /// epoll(5) ×2 | busy 10 ──poll(fd 9) 20..80── 90 | epoll(5)
    ///                    switch-out 20, wakeup 80, switch-in 85
    /// ```
    #[test]
    fn inner_poll_does_not_split_and_time_splits_exactly() {
        let mut t = tracker(50);
        let mut out = Vec::new();
        for e in [
            enter(0, EPOLL_WAIT, 5),
            exit(1, EPOLL_WAIT, 5),
            enter(2, EPOLL_WAIT, 5),
        ] {
            t.push(e, &mut out);
        }
        assert_eq!(
            out,
            vec![Output::LoopKey {
                tid: 1,
                key: wait_key(EPOLL_WAIT, 5)
            }]
        );
        let s = run(
            &mut t,
            vec![
                exit(10, EPOLL_WAIT, 5),
                enter(20, POLL, 9),
                Event::SwitchOut {
                    tid: 1,
                    tgid: 1,
                    ts: 20 * MS,
                    runnable: false,
                    syscall: Some(POLL),
                    stack: stack(0xC),
                    task: 0,
                },
                Event::Wakeup {
                    tid: 1,
                    tgid: 1,
                    ts: 80 * MS,
                    waker: Some(77),
                },
                Event::SwitchIn {
                    tid: 1,
                    tgid: 1,
                    ts: 85 * MS,
                    throttled_ns: Some(0),
                },
                exit(85, POLL, 9),
                sample(87, 0xD),
                enter(90, EPOLL_WAIT, 5),
            ],
        );
        assert_eq!(s.len(), 1);
        let s = &s[0];
        assert_eq!(s.end_ns - s.start_ns, 80 * MS);
        assert_eq!(
            (s.on_cpu_ns, s.off_cpu_ns, s.runqueue_ns),
            (15 * MS, 60 * MS, 5 * MS)
        );
        let total: u64 = s.parts.iter().map(|p| p.weight_ns).sum();
        assert_eq!(total, 80 * MS);
        let off = s.parts.iter().find(|p| p.kind == PartKind::OffCpu).unwrap();
        assert_eq!((off.syscall, off.waker), (Some(POLL), Some(77)));
    }

    /// Preempted (runnable) switch-outs are run-queue time, no wakeup needed.
    #[test]
    fn preemption_is_runqueue() {
        let mut t = warmed(10);
        let s = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                Event::SwitchOut {
                    tid: 1,
                    tgid: 1,
                    ts: 5 * MS,
                    runnable: true,
                    syscall: None,
                    stack: stack(1),
                    task: 0,
                },
                Event::SwitchIn {
                    tid: 1,
                    tgid: 1,
                    ts: 25 * MS,
                    throttled_ns: Some(0),
                },
                enter(30, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!(
            (s[0].on_cpu_ns, s[0].off_cpu_ns, s[0].runqueue_ns),
            (10 * MS, 0, 20 * MS)
        );
        // No samples: the on-CPU part is present but has no stack.
        assert!(
            s[0].parts
                .iter()
                .any(|p| p.kind == PartKind::OnCpu && p.stack.is_none())
        );
    }

    /// A thread that never uses epoll parks in poll once the same set repeats.
    #[test]
    fn poll_loop_is_recognized() {
        let mut t = tracker(50);
        let mut out = Vec::new();
        for i in 0..POLL_DECIDE as u64 {
            t.push(enter(i * 2, POLL, 4), &mut out);
            t.push(exit(i * 2 + 1, POLL, 4), &mut out);
        }
        assert!(out.contains(&Output::LoopKey {
            tid: 1,
            key: wait_key(POLL, 4)
        }));
    }

    /// tokio: the park function is the loop's wait; the epoll_wait the I/O
    /// driver makes inside it is not, and does not split anything.
    /// ```text
    /// park{ epoll(5) } | busy 10..70 | park{ futex… }
    /// ```
    #[test]
    fn runtime_park_wins_over_epoll() {
        use profiler_common::sysno::RUNTIME_PARK;
        let mut t = tracker(50);
        let s = run(
            &mut t,
            vec![
                enter(0, EPOLL_WAIT, 5),
                exit(1, EPOLL_WAIT, 5),
                enter(2, EPOLL_WAIT, 5),
                exit(3, EPOLL_WAIT, 5),
                enter(4, RUNTIME_PARK, 0),
                enter(4, EPOLL_WAIT, 5),
                exit(9, EPOLL_WAIT, 5),
                exit(10, RUNTIME_PARK, 0),
                sample(40, 0xA),
                enter(70, RUNTIME_PARK, 0),
                enter(70, EPOLL_WAIT, 5),
                exit(80, EPOLL_WAIT, 5),
                exit(81, RUNTIME_PARK, 0),
                enter(85, RUNTIME_PARK, 0),
            ],
        );
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].start_ns, s[0].end_ns), (10 * MS, 70 * MS));
    }

    fn on(tid: u32, e: Event) -> Event {
        let mut e = e;
        match &mut e {
            Event::WaitEnter { tid: t, tgid, .. }
            | Event::WaitExit { tid: t, tgid, .. }
            | Event::Sample { tid: t, tgid, .. } => {
                *t = tid;
                *tgid = 1;
            }
            _ => unreachable!(),
        }
        e
    }

    /// `n` blocking-client polls on `fd`, 2 ms apart, from `from` ms.
    fn polls(from: u64, n: u64, fd: i32) -> Vec<Event> {
        (0..n)
            .flat_map(|i| {
                [
                    enter(from + 2 * i, POLL, fd),
                    exit(from + 2 * i + 1, POLL, fd),
                ]
            })
            .collect()
    }

    fn loop_keys(out: &[Output]) -> Vec<u64> {
        out.iter()
            .filter_map(|o| match o {
                Output::LoopKey { key, .. } => Some(*key),
                _ => None,
            })
            .collect()
    }

    fn spans(s: &[RawStall]) -> Vec<(u32, u64, u64)> {
        s.iter()
            .map(|s| (s.tid, s.start_ns / MS, s.end_ns / MS))
            .collect()
    }

    /// A sync streaming client with a socket timeout polls before every
    /// recv: 200 polls inside one stall. The loop keeps its key and the
    /// stall keeps all of its time; the loop's next park is idle time.
    /// ```text
    /// epoll(3) ×2 | busy 10 ─ poll(9) ×200 ─ 420 |epoll(3) 420-430| busy 430 ─ 500 | epoll(3)
    /// ```
    #[test]
    fn sync_client_polling_200_times_is_one_stall() {
        let mut t = warmed(50);
        let mut ev = vec![exit(10, EPOLL_WAIT, 3)];
        ev.extend(polls(11, 200, 9));
        ev.extend([
            enter(420, EPOLL_WAIT, 3),
            exit(430, EPOLL_WAIT, 3),
            sample(450, 0xA),
            enter(500, EPOLL_WAIT, 3),
        ]);
        let mut out = Vec::new();
        for e in ev {
            t.push(e, &mut out);
        }
        assert!(loop_keys(&out).is_empty(), "the loop key moved: {out:?}");
        let s: Vec<RawStall> = out
            .into_iter()
            .filter_map(|o| match o {
                Output::Stall(s) => Some(s),
                _ => None,
            })
            .collect();
        assert_eq!(spans(&s), [(1, 10, 420), (1, 430, 500)]);
    }

    /// asyncio on a SelectSelector (select's nfds grows as connections
    /// open) whose handler uses a poll-based client:
    /// ```text
    /// select(nfds 5..12) ×8 | busy 100 ─ poll(9) ×100 ─ 320 | select(nfds 13)
    /// ```
    #[test]
    fn select_loop_with_a_poll_client() {
        use profiler_common::sysno::SELECT;
        let mut t = tracker(50);
        let mut ev = Vec::new();
        for i in 0..POLL_DECIDE as u64 {
            ev.extend([
                enter(i * 10, SELECT, 5 + i as i32),
                exit(i * 10 + 9, SELECT, 5 + i as i32),
            ]);
        }
        ev.extend([enter(90, SELECT, 12), exit(100, SELECT, 12)]);
        ev.extend(polls(101, 100, 9));
        ev.push(enter(320, SELECT, 13));
        let s = run(&mut t, ev);
        assert_eq!(spans(&s), [(1, 100, 320)]);
    }

    /// A program closes its event loop and starts another (a second
    /// `asyncio.run`): the new epoll fd takes over once the old one has gone
    /// unused for LOOP_IDLE_NS; the busy period that spans the change-over
    /// is dropped, and the new loop's stalls are reported.
    /// ```text
    /// epoll(3) ×2 |0── epoll(7) every 100 ms ·········· 10 s: key → 7 ··· busy 13000 ─ 13100
    /// ```
    #[test]
    fn loop_that_recreates_its_epoll_fd() {
        use crate::assemble::loops::LOOP_IDLE_NS;
        let mut t = warmed(50);
        let mut ev = vec![exit(0, EPOLL_WAIT, 3)];
        let idle_ms = LOOP_IDLE_NS / MS;
        let mut ts = 1;
        while ts < idle_ms + 1000 {
            ev.extend([enter(ts, EPOLL_WAIT, 7), exit(ts + 95, EPOLL_WAIT, 7)]);
            ts += 100;
        }
        ev.extend([sample(ts + 50, 0xB), enter(ts + 100, EPOLL_WAIT, 7)]);
        let mut out = Vec::new();
        for e in ev {
            t.push(e, &mut out);
        }
        assert_eq!(
            loop_keys(&out),
            [wait_key(EPOLL_WAIT, 7)],
            "one move, to the new loop"
        );
        assert_eq!(t.stats.busy_dropped_on_move, 1);
        let stalls: Vec<_> = out
            .iter()
            .filter_map(|o| match o {
                Output::Stall(s) => Some((s.start_ns / MS, s.end_ns / MS)),
                _ => None,
            })
            .collect();
        assert_eq!(stalls, [(ts - 5, ts + 100)]);
    }

    /// A loop that only ever polls (selectors.PollSelector): its poll set is
    /// the key, and its stalls are reported.
    #[test]
    fn poll_only_loop() {
        let mut t = tracker(50);
        let mut ev = polls(0, POLL_DECIDE as u64, 4);
        ev.extend([
            enter(16, POLL, 4),
            exit(100, POLL, 4),
            sample(120, 0xC),
            enter(170, POLL, 4),
        ]);
        let s = run(&mut t, ev);
        assert_eq!(spans(&s), [(1, 100, 170)]);
    }

    /// Two loops in one process, one per thread; thread 2's handler runs a
    /// blocking client (50 polls) while thread 1 spins. Each keeps its key.
    /// ```text
    /// t1 epoll(3): busy 100 ─ spin ─ 180
    /// t2 epoll(5): busy 110 ─ poll(9) ×50 ─ 250
    /// ```
    #[test]
    fn two_loops_in_one_process() {
        let mut t = tracker(50);
        let mut ev = Vec::new();
        for (tid, fd) in [(1, 3), (2, 5)] {
            for i in 0..2 {
                ev.push(on(tid, enter(i * 10, EPOLL_WAIT, fd)));
                ev.push(on(tid, exit(i * 10 + 5, EPOLL_WAIT, fd)));
            }
            ev.push(on(tid, enter(20, EPOLL_WAIT, fd)));
        }
        ev.push(on(1, exit(100, EPOLL_WAIT, 3)));
        ev.push(on(2, exit(110, EPOLL_WAIT, 5)));
        ev.extend(polls(111, 50, 9).into_iter().map(|e| on(2, e)));
        ev.push(on(1, sample(150, 0xD)));
        ev.push(on(1, enter(180, EPOLL_WAIT, 3)));
        ev.push(on(2, enter(250, EPOLL_WAIT, 5)));
        let s = run(&mut t, ev);
        assert_eq!(spans(&s), [(1, 100, 180), (2, 110, 250)]);
        assert_eq!(t.loops().loop_tids_of(1), [1, 2]);
    }

    /// Attached in the middle of a blocking client's call: its poll set is
    /// elected first, then the loop's epoll fd outranks it, and the next
    /// stall (with 60 polls inside) is reported whole.
    #[test]
    fn attach_during_a_client_call() {
        let mut t = tracker(50);
        let mut ev = polls(0, 20, 9);
        ev.extend([
            enter(50, EPOLL_WAIT, 3),
            exit(60, EPOLL_WAIT, 3),
            enter(61, EPOLL_WAIT, 3),
            exit(100, EPOLL_WAIT, 3),
        ]);
        ev.extend(polls(101, 60, 9));
        ev.push(enter(300, EPOLL_WAIT, 3));
        let mut out = Vec::new();
        for e in ev {
            t.push(e, &mut out);
        }
        assert_eq!(
            loop_keys(&out),
            [wait_key(POLL, 9), wait_key(EPOLL_WAIT, 3)]
        );
        let s: Vec<(u64, u64)> = out
            .iter()
            .filter_map(|o| match o {
                Output::Stall(s) => Some((s.start_ns / MS, s.end_ns / MS)),
                _ => None,
            })
            .collect();
        assert_eq!(s, [(100, 300)]);
    }

    /// A switch-in that never arrives is closed by the next sample, not by
    /// the end of the stall:
    /// ```text
    /// busy 0 ── preempted 10 ·· (switch-in lost) ·· sample 12 ── park 60
    /// ```
    #[test]
    fn missed_switch_in_is_closed_by_a_sample() {
        let mut t = warmed(50);
        let s = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                Event::Preempted {
                    tid: 1,
                    tgid: 1,
                    ts: 10 * MS,
                    throttled: false,
                    woken: false,
                },
                sample(12, 0xA),
                enter(60, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!((s[0].on_cpu_ns, s[0].runqueue_ns), (58 * MS, 2 * MS));
        assert_eq!(t.stats.switch_ins_missed, 1);
    }

    /// After a compaction (the daemon's rebuild) no new election is
    /// needed: the kernel held back the loop's quiet iterations, and the
    /// first busy period it sees is reported.
    #[test]
    fn a_compacted_tracker_needs_no_election() {
        let mut t = warmed(10).compacted();
        assert_eq!(t.loops().loop_threads().len(), 1);
        let s = run(
            &mut t,
            vec![
                exit(100, EPOLL_WAIT, 3),
                sample(105, 0xAAA),
                enter(130, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!(s[0].duration_ns(), 30 * MS);
    }

    /// Compacting the stack table in the middle of a stall (the daemon's
    /// memory bound) cuts nothing: the stall comes out whole, its stacks
    /// intact, and the table keeps only what the open stall refers to.
    /// ```text
    /// epoll(3) ×2 | busy 0 ─ A×2 ─ [compact] ─ B ─ switch-out(C) 60..70 ─ 90
    /// ```
    #[test]
    fn compaction_keeps_open_stalls_whole() {
        let mut t = warmed(50);
        let _ = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                sample(10, 0xA),
                sample(20, 0xA),
                enter(25, EPOLL_WAIT, 3),
                exit(30, EPOLL_WAIT, 3),
                sample(40, 0xA),
            ],
        );
        let mut t = t.compacted();
        assert_eq!(t.stacks.len(), 1);
        let s = run(
            &mut t,
            vec![
                sample(50, 0xB),
                Event::SwitchOut {
                    tid: 1,
                    tgid: 1,
                    ts: 60 * MS,
                    runnable: false,
                    syscall: Some(7),
                    stack: stack(0xC),
                    task: 0,
                },
                Event::SwitchIn {
                    tid: 1,
                    tgid: 1,
                    ts: 70 * MS,
                    throttled_ns: Some(0),
                },
                enter(90, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!(spans(&s), [(1, 30, 90)]);
        let users: Vec<u64> = s[0]
            .parts
            .iter()
            .map(|p| t.stacks.get(p.stack.unwrap()).user[0])
            .collect();
        assert_eq!(users, [0xC, 0xA, 0xB]);
    }

    /// Recording ends mid-stall: reported as incomplete.
    #[test]
    fn finish_closes_open_stalls() {
        let mut t = warmed(50);
        let mut out = Vec::new();
        t.push(exit(0, EPOLL_WAIT, 3), &mut out);
        t.push(
            Event::SwitchOut {
                tid: 1,
                tgid: 1,
                ts: MS,
                runnable: false,
                syscall: Some(35),
                stack: stack(2),
                task: 0,
            },
            &mut out,
        );
        t.finish(200 * MS, &mut out);
        let Output::Stall(s) = &out[0] else { panic!() };
        assert!(s.incomplete);
        assert_eq!((s.on_cpu_ns, s.off_cpu_ns), (MS, 199 * MS));
    }

    fn preempted(ts: u64, throttled: bool) -> Event {
        Event::Preempted {
            tid: 1,
            tgid: 1,
            ts: ts * MS,
            throttled,
            woken: false,
        }
    }
    /// The wait between the park's return and the loop's code, as the
    /// park's return reports it.
    fn woken_at(ts: u64, throttled: bool) -> Event {
        Event::Preempted {
            tid: 1,
            tgid: 1,
            ts: ts * MS,
            throttled,
            woken: true,
        }
    }
    fn switch_in(ts: u64, throttled_ms: Option<u64>) -> Event {
        Event::SwitchIn {
            tid: 1,
            tgid: 1,
            ts: ts * MS,
            throttled_ns: throttled_ms.map(|t| t * MS),
        }
    }
    fn held_by(ts: u64, pid: u32, comm: &str, ms: u64) -> Event {
        Event::CpuHolder {
            tid: 1,
            tgid: 1,
            ts: ts * MS,
            holder: Holder::Task {
                pid,
                tgid: pid,
                comm: comm.into(),
            },
            ns: ms * MS,
        }
    }
    fn kinds(s: &RawStall) -> Vec<(PartKind, u64, bool)> {
        let mut v: Vec<_> = s
            .parts
            .iter()
            .map(|p| (p.kind, p.weight_ns / MS, p.woken))
            .collect();
        v.sort();
        v
    }

    /// The quota runs out mid-stall: the kernel flags the preemption as
    /// throttled and measures 75 ms of throttling; the 5 ms after the
    /// unthrottle are run-queue wait.
    /// ```text
    /// busy 0 ── A ── preempted(throttled) 20 ·· throttled 75 ·· runq 5 ·· in 100 ── A ── park 120
    /// ```
    #[test]
    fn throttled_preemption_is_split_as_the_kernel_measured() {
        let mut t = warmed(50);
        let s = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                sample(10, 0xA),
                preempted(20, true),
                held_by(100, 0, "swapper/1", 80),
                switch_in(100, Some(75)),
                sample(110, 0xA),
                enter(120, EPOLL_WAIT, 3),
            ],
        );
        let s = &s[0];
        assert_eq!(
            (
                s.on_cpu_ns / MS,
                s.off_cpu_ns,
                s.runqueue_ns / MS,
                s.throttled_ns / MS
            ),
            (40, 0, 5, 75)
        );
        assert_eq!(
            kinds(s),
            [
                (PartKind::OnCpu, 40, false),
                (PartKind::Runqueue, 5, false),
                (PartKind::Throttled, 75, false)
            ]
        );
        let total: u64 = s.parts.iter().map(|p| p.weight_ns).sum();
        assert_eq!(total, s.duration_ns());
        // The throttled time is at the stack the thread was running.
        let thr = s.parts.iter().find(|p| p.kind == PartKind::Throttled);
        assert_eq!(t.stacks.get(thr.unwrap().stack.unwrap()).user, [0xA]);
        assert_eq!(s.cpu_holders[0].0.ids().2, "swapper/1");
    }

    /// A kernel that cannot measure the throttled share (no
    /// `throttled_clock_self_time`, or the thread came back on another
    /// CPU): the whole wait counts as throttled, never as run queue.
    #[test]
    fn unmeasured_throttling_takes_the_whole_wait() {
        let mut t = warmed(50);
        let s = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                sample(5, 0xA),
                preempted(10, true),
                switch_in(90, None),
                enter(100, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!((s[0].runqueue_ns, s[0].throttled_ns), (0, 80 * MS));
        // The measure never exceeds the wait.
        let mut t = warmed(50);
        let s = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                preempted(10, true),
                switch_in(20, Some(500)),
                enter(100, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!((s[0].runqueue_ns, s[0].throttled_ns), (0, 10 * MS));
    }

    /// Without the kernel's flag a preemption is run queue, whatever the
    /// switch-in says: a process without a quota never shows `throttled`.
    #[test]
    fn unflagged_preemption_is_never_throttled() {
        let mut t = warmed(50);
        let s = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                sample(5, 0xA),
                preempted(10, false),
                held_by(60, 77, "cpuhog", 50),
                switch_in(60, Some(40)),
                enter(100, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!((s[0].runqueue_ns, s[0].throttled_ns), (50 * MS, 0));
        assert!(s[0].parts.iter().all(|p| p.kind != PartKind::Throttled));
        assert_eq!(
            s[0].cpu_holders,
            [(
                Holder::Task {
                    pid: 77,
                    tgid: 77,
                    comm: "cpuhog".into()
                },
                50 * MS
            )]
        );
    }

    /// The loop returns from its park and is throttled before its own code
    /// runs (6.18 throttles on the way back to user space), then waits for
    /// a CPU once more after its first sample. The first wait carries the
    /// park's wait, not an empty stack; the second, the sampled stack.
    /// ```text
    /// epoll(3) ret 0 · preempted(throttled) 0 ·· in 60 ── A ── preempted 70 ·· in 80 ── park 100
    /// ```
    #[test]
    fn wait_before_the_first_stack_is_woken_from_the_park() {
        let mut t = warmed(50);
        let s = run(
            &mut t,
            vec![
                exit(0, EPOLL_WAIT, 3),
                woken_at(0, true),
                switch_in(60, Some(60)),
                sample(65, 0xA),
                preempted(70, false),
                switch_in(80, Some(0)),
                enter(100, EPOLL_WAIT, 3),
            ],
        );
        let s = &s[0];
        assert_eq!(
            kinds(s),
            [
                (PartKind::OnCpu, 30, false),
                (PartKind::Runqueue, 10, false),
                (PartKind::Throttled, 60, true)
            ]
        );
        let woken = s.parts.iter().find(|p| p.woken).unwrap();
        assert_eq!(woken.syscall, Some(EPOLL_WAIT));
        assert_eq!(t.stacks.get(woken.stack.unwrap()), &RawStack::default());
        let rq = s.parts.iter().find(|p| p.kind == PartKind::Runqueue);
        assert_eq!(t.stacks.get(rq.unwrap().stack.unwrap()).user, [0xA]);
    }

    /// Holders past the cap are summed under one entry: the work per stall
    /// is bounded, the time is all there.
    #[test]
    fn cpu_holders_are_bounded_per_stall() {
        let mut t = warmed(50);
        let mut ev = vec![exit(0, EPOLL_WAIT, 3), preempted(1, false)];
        for pid in 0..(MAX_HOLDERS as u32 + 10) {
            ev.push(held_by(2, 1000 + pid, "w", 1));
        }
        ev.extend([switch_in(60, Some(0)), enter(100, EPOLL_WAIT, 3)]);
        let s = run(&mut t, ev);
        let h = &s[0].cpu_holders;
        assert_eq!(h.len(), MAX_HOLDERS + 1);
        assert_eq!(h[0].0, Holder::OtherTasks);
        assert_eq!(h[0].1, 10 * MS);
        assert_eq!(
            h.iter().map(|x| x.1).sum::<u64>(),
            (MAX_HOLDERS as u64 + 10) * MS
        );
    }

    /// The kernel-side decision (`profiler_common::throttle_model`), on
    /// both throttle models. This machine runs only the 6.18 one; the
    /// pre-6.18 rows are the kernel's documented behaviour, untested here.
    #[test]
    fn throttle_decision_on_both_kernel_models() {
        use profiler_common::{THROTTLE_NOT_MEASURED, throttle_model as m};
        assert_eq!(m::from_btf(true, true), m::TASK);
        assert_eq!(m::from_btf(false, true), m::CFS_RQ);
        assert_eq!(m::from_btf(false, false), m::UNKNOWN);
        // 6.18, measured: the throttled switch-out has the task's flag set.
        assert!(m::is_throttled(m::TASK, 1, 1));
        // 6.18, measured: a preemption while the cfs_rq is already
        // throttled but the task still runs in the kernel is not one.
        assert!(!m::is_throttled(m::TASK, 0, 1));
        // Before 6.18: the cfs_rq (or an ancestor) being throttled is.
        assert!(m::is_throttled(m::CFS_RQ, 0, 1));
        assert!(m::is_throttled(m::CFS_RQ, 0, 2));
        assert!(!m::is_throttled(m::CFS_RQ, 0, 0));
        assert!(!m::is_throttled(m::UNKNOWN, 1, 1));
        // The measured share, and when it cannot be measured.
        assert_eq!(m::switch_in_arg(true, true, 100, 75_100), 75_000);
        assert_eq!(
            m::switch_in_arg(true, false, 100, 200),
            THROTTLE_NOT_MEASURED
        );
        assert_eq!(
            m::switch_in_arg(false, true, 100, 200),
            THROTTLE_NOT_MEASURED
        );
        assert_eq!(
            m::switch_in_arg(true, true, 300, 200),
            THROTTLE_NOT_MEASURED
        );
        assert_eq!(
            m::switch_in_arg(true, true, 0, 1 << 40),
            THROTTLE_NOT_MEASURED - 1
        );
    }

    #[test]
    fn spread_is_exact() {
        let parts = spread(10, HashMap::from([(0, 1), (1, 1), (2, 1)]));
        assert_eq!(parts.iter().map(|p| p.weight_ns).sum::<u64>(), 10);
    }
}
