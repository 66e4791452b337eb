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
//! * A *park* is a wait syscall on the thread's *loop key* (syscall class +
//!   fd, e.g. epoll on fd 3). Until the key is known every wait counts; the
//!   key becomes the first epoll fd waited on twice (or, for a thread that
//!   never uses epoll, a poll/select set waited on [`POLL_DECIDE`] times),
//!   and moves to another fd when the loop stops using the old one (a new
//!   event loop). So a blocking client's `poll()` on its socket inside a
//!   stall does not end the stall. A runtime park function (tokio, via
//!   uprobes) is the loop key at once and for good.
//! * Busy time splits exactly into on-CPU, off-CPU blocked (switch-out to
//!   wakeup) and run-queue wait (wakeup, or preemption, to switch-in).
//!   Blocked time in a wait for a CPython GIL held by another thread (the
//!   BPF side names the holder) is its own kind, `GilWait`; it counts in
//!   `off_cpu_ns`.
//! * On-CPU time is spread over the CPU-clock samples taken in the period in
//!   proportion to their counts; off-CPU and run-queue time go to the stack
//!   at switch-out. So a stall's part weights sum to its duration.
//! * Busy periods shorter than the threshold are dropped with their samples,
//!   and so are busy periods of a thread whose loop key is not known yet
//!   (a thread that waited once is not yet an event loop).
use std::collections::{HashMap, HashSet};

use profiler_common::{WAIT_CLASS_PARK, sysno, wait_key};
use serde::{Deserialize, Serialize};

use crate::event::{Event, RawStack};

/// Waits on one poll/select set before a thread with no epoll use is taken
/// to be a poll-based loop.
pub const POLL_DECIDE: u32 = 8;
/// Waits on one epoll fd before it is taken to be the loop's.
pub const EPOLL_DECIDE: u32 = 2;
/// Waits on another key, with none on the loop key meanwhile, before the
/// loop key moves (the program started a new event loop).
pub const LOOP_MOVE: u32 = 32;

pub type StackId = u32;

/// Interns stacks: a busy period holds counts per stack id, not copies.
#[derive(Default, Debug)]
pub struct StackTable {
    stacks: Vec<RawStack>,
    index: HashMap<RawStack, StackId>,
}

impl StackTable {
    pub fn intern(&mut self, s: RawStack) -> StackId {
        if let Some(&id) = self.index.get(&s) {
            return id;
        }
        let id = self.stacks.len() as StackId;
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

    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum PartKind {
    OnCpu,
    OffCpu,
    Runqueue,
    /// Off-CPU waiting for a CPython GIL another thread holds.
    GilWait,
}

impl PartKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PartKind::OnCpu => "on_cpu",
            PartKind::OffCpu => "off_cpu",
            PartKind::Runqueue => "runqueue",
            PartKind::GilWait => "gil_wait",
        }
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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawStall {
    pub tid: u32,
    pub tgid: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub on_cpu_ns: u64,
    pub off_cpu_ns: u64,
    pub runqueue_ns: u64,
    pub parts: Vec<RawPart>,
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
    /// The loop's wait for `tid` is `key` (see `profiler_common::wait_key`).
    LoopKey {
        tid: u32,
        key: u64,
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
}

#[derive(Debug)]
struct Pending {
    out: u64,
    runnable: bool,
    syscall: Option<u32>,
    stack: StackId,
    wake: Option<(u64, u32)>,
}

#[derive(Debug, Default)]
struct Busy {
    start: u64,
    /// The latest on-CPU sample's stack: where a preempted thread was.
    last_sample: Option<StackId>,
    samples: HashMap<StackId, u64>,
    /// (stack, syscall, waker) -> (blocked ns, run-queue ns)
    offs: HashMap<(StackId, Option<u32>, Option<u32>), (u64, u64)>,
    pending: Option<Pending>,
}

impl Busy {
    /// The thread runs again at `ts`: split the time since its switch-out
    /// into blocked (until wakeup) and run-queue wait.
    fn back_on_cpu(&mut self, ts: u64) {
        let Some(p) = self.pending.take() else { return };
        let end = ts.max(p.out);
        let (blocked, runq, waker) = if p.runnable {
            (0, end - p.out, None)
        } else {
            let (w, waker) = p
                .wake
                .map_or((end, None), |(w, who)| (w.clamp(p.out, end), Some(who)));
            (w - p.out, end - w, waker)
        };
        let e = self.offs.entry((p.stack, p.syscall, waker)).or_default();
        e.0 += blocked;
        e.1 += runq;
    }
}

#[derive(Debug, Default)]
struct Thread {
    tgid: u32,
    loop_key: Option<u64>,
    counts: HashMap<u64, u32>,
    /// Waits per key since the loop key was last waited on.
    since_loop: HashMap<u64, u32>,
    busy: Option<Busy>,
}

impl Thread {
    /// Count a wait on `key`; returns a new loop key if this decides one.
    fn observe_wait(&mut self, nr: u32, key: u64) -> Option<u64> {
        // A runtime's park function is the loop's wait by definition, at
        // once and for good; the syscalls it makes inside are not parks.
        if key >> 32 == WAIT_CLASS_PARK {
            if self.loop_key == Some(key) {
                return None;
            }
            self.loop_key = Some(key);
            return Some(key);
        }
        if self.loop_key.is_some_and(|k| k >> 32 == WAIT_CLASS_PARK) {
            return None;
        }
        let n = self.counts.entry(key).or_default();
        *n += 1;
        let n = *n;
        match self.loop_key {
            None => {
                let decide = if sysno::is_epoll(nr) {
                    n >= EPOLL_DECIDE
                } else {
                    n >= POLL_DECIDE && !self.counts.keys().any(|k| k >> 32 == 1)
                };
                decide.then(|| {
                    self.loop_key = Some(key);
                    key
                })
            }
            Some(k) if k == key => {
                self.since_loop.clear();
                None
            }
            Some(_) => {
                let m = self.since_loop.entry(key).or_default();
                *m += 1;
                (*m >= LOOP_MOVE).then(|| {
                    self.since_loop.clear();
                    self.loop_key = Some(key);
                    key
                })
            }
        }
    }

    fn is_park(&self, key: u64) -> bool {
        self.loop_key.is_none_or(|k| k == key)
    }
}

pub struct Tracker {
    cfg: TrackerConfig,
    threads: HashMap<u32, Thread>,
    pub stacks: StackTable,
    pub stats: TrackerStats,
}

impl Tracker {
    pub fn new(cfg: TrackerConfig) -> Self {
        Tracker {
            cfg,
            threads: HashMap::new(),
            stacks: StackTable::default(),
            stats: TrackerStats::default(),
        }
    }

    pub fn stacks(&self) -> &StackTable {
        &self.stacks
    }

    pub fn threshold_ns(&self) -> u64 {
        self.cfg.threshold_ns
    }

    /// The process a tracked thread belongs to.
    pub fn tgid_of(&self, tid: u32) -> Option<u32> {
        self.threads.get(&tid).map(|t| t.tgid)
    }

    /// Loop keys decided so far: (tid, tgid, key).
    pub fn loop_keys(&self) -> Vec<(u32, u32, u64)> {
        self.threads
            .iter()
            .filter_map(|(&tid, th)| th.loop_key.map(|k| (tid, th.tgid, k)))
            .collect()
    }

    /// Start from loop keys an earlier tracker decided. The kernel keeps
    /// using published keys, and with the sampling gate it no longer reports
    /// a loop's quiet iterations, so a fresh tracker could not re-decide them
    /// from waits it never sees.
    pub fn seed_loop_keys(&mut self, keys: &[(u32, u32, u64)]) {
        for &(tid, tgid, key) in keys {
            let th = self.threads.entry(tid).or_default();
            th.tgid = tgid;
            th.loop_key = Some(key);
        }
    }

    /// Threads currently inside a busy period: (tid, start).
    pub fn busy_threads(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.threads
            .iter()
            .filter_map(|(&t, th)| th.busy.as_ref().map(|b| (t, b.start)))
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
                let th = self.threads.entry(tid).or_default();
                th.tgid = tgid;
                let key = wait_key(nr, fd);
                if let Some(key) = th.observe_wait(nr, key) {
                    out.push(Output::LoopKey { tid, key });
                }
                if th.is_park(key)
                    && let Some(b) = th.busy.take()
                    && th.loop_key.is_some()
                {
                    let tgid = th.tgid;
                    self.close(tid, tgid, b, ts, false, out);
                }
            }
            Event::WaitExit {
                tgid, ts, nr, fd, ..
            } => {
                let th = self.threads.entry(tid).or_default();
                th.tgid = tgid;
                if th.is_park(wait_key(nr, fd)) && th.busy.is_none() {
                    th.busy = Some(Busy {
                        start: ts,
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
                        syscall,
                        stack,
                        wake: None,
                    });
                }
                None => self.stats.events_outside_busy += 1,
            },
            Event::Preempted { ts, .. } => {
                match self.threads.get_mut(&tid).and_then(|t| t.busy.as_mut()) {
                    Some(b) => {
                        let stack = match b.last_sample {
                            Some(s) => s,
                            None => self.stacks.intern(RawStack::default()),
                        };
                        b.pending = Some(Pending {
                            out: ts.max(b.start),
                            runnable: true,
                            syscall: None,
                            stack,
                            wake: None,
                        });
                    }
                    None => self.stats.events_outside_busy += 1,
                }
            }
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
            Event::SwitchIn { ts, .. } => {
                if let Some(b) = self.threads.get_mut(&tid).and_then(|t| t.busy.as_mut()) {
                    b.back_on_cpu(ts);
                }
            }
            Event::Sample { ts, stack, .. } => {
                if let Some(b) = self.threads.get_mut(&tid).and_then(|t| t.busy.as_mut()) {
                    // A sample means the thread runs: a switch-in we did not
                    // see happened by now. Close the gap here rather than let
                    // run-queue time run on until the stall's end.
                    if b.pending.is_some() {
                        self.stats.switch_ins_missed += 1;
                        b.back_on_cpu(ts);
                    }
                    let id = self.stacks.intern(stack);
                    *b.samples.entry(id).or_default() += 1;
                    b.last_sample = Some(id);
                    self.stats.samples += 1;
                }
            }
            Event::Exit { ts, .. } => {
                if let Some(mut th) = self.threads.remove(&tid)
                    && th.loop_key.is_some()
                    && let Some(b) = th.busy.take()
                {
                    self.close(tid, th.tgid, b, ts, true, out);
                }
            }
        }
    }

    /// End of recording: busy periods still open become incomplete stalls
    /// when they are already over the threshold.
    pub fn finish(&mut self, ts: u64, out: &mut Vec<Output>) {
        let mut open: Vec<(u32, u32, Busy)> = self
            .threads
            .iter_mut()
            .filter(|(_, th)| th.loop_key.is_some())
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
            b.back_on_cpu(end);
        }
        let mut parts = Vec::new();
        let (mut off, mut runq) = (0u64, 0u64);
        let mut offs: Vec<_> = b.offs.into_iter().collect();
        offs.sort();
        for ((stack, syscall, waker), (blocked, rq)) in offs {
            off += blocked;
            runq += rq;
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
                });
            }
            if rq > 0 {
                parts.push(RawPart {
                    stack: Some(stack),
                    weight_ns: rq,
                    kind: PartKind::Runqueue,
                    syscall: None,
                    waker: None,
                });
            }
        }
        // Clock skew between CPUs can make the parts exceed the wall time by
        // a hair; on-CPU takes the remainder and never goes negative.
        let on_cpu = duration.saturating_sub(off + runq);
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
            parts,
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
                },
                Event::Wakeup {
                    tid: 1,
                    tgid: 1,
                    ts: 80 * MS,
                    waker: 77,
                },
                Event::SwitchIn {
                    tid: 1,
                    tgid: 1,
                    ts: 85 * MS,
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
                },
                Event::SwitchIn {
                    tid: 1,
                    tgid: 1,
                    ts: 25 * MS,
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

    /// A new event loop (new epoll fd) takes over after LOOP_MOVE waits.
    #[test]
    fn loop_key_moves_to_a_new_loop() {
        let mut t = tracker(50);
        let mut out = Vec::new();
        let mut ts = 0;
        for fd in [3, 7] {
            for _ in 0..LOOP_MOVE + 1 {
                t.push(enter(ts, EPOLL_WAIT, fd), &mut out);
                t.push(exit(ts + 1, EPOLL_WAIT, fd), &mut out);
                ts += 2;
            }
        }
        let keys: Vec<_> = out
            .iter()
            .filter_map(|o| match o {
                Output::LoopKey { key, .. } => Some(*key as u32),
                _ => None,
            })
            .collect();
        assert_eq!(keys, [3, 7]);
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
                },
                sample(12, 0xA),
                enter(60, EPOLL_WAIT, 3),
            ],
        );
        assert_eq!((s[0].on_cpu_ns, s[0].runqueue_ns), (58 * MS, 2 * MS));
        assert_eq!(t.stats.switch_ins_missed, 1);
    }

    /// Recording ends mid-stall: reported as incomplete.
    #[test]
    fn seeded_loop_key_needs_no_decision() {
        let mut old = warmed(10);
        let keys = old.loop_keys();
        assert_eq!(keys.len(), 1);
        let _ = run(&mut old, vec![]);
        // A fresh tracker that only ever sees one busy period of the loop
        // (the kernel held back the quiet ones) still reports it.
        let mut t = tracker(10);
        t.seed_loop_keys(&keys);
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
            },
            &mut out,
        );
        t.finish(200 * MS, &mut out);
        let Output::Stall(s) = &out[0] else { panic!() };
        assert!(s.incomplete);
        assert_eq!((s.on_cpu_ns, s.off_cpu_ns), (MS, 199 * MS));
    }

    #[test]
    fn spread_is_exact() {
        let parts = spread(10, HashMap::from([(0, 1), (1, 1), (2, 1)]));
        assert_eq!(parts.iter().map(|p| p.weight_ns).sum::<u64>(), 10);
    }
}
