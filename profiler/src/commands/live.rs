//! Driving the engine from the probes of one live target: the loop that
//! `record` and `top` share.
//!
//! The target is a process tree unless asked otherwise
//! (`--no-subprocesses`): the processes under it at attach and those it
//! (or they) start later, each through the same loop election; a process
//! of the tree that exits is let go; the tree's root exiting ends it.
//!
//! In: a target pid and the probe settings. Out: [`Step`]s — an upkeep
//! tick (the engine has drained the ring buffer and done its `/proc`
//! upkeep; the command takes its stalls or draws), a stop (signal,
//! deadline), or the command's own event — and, at [`Live::finish`], the
//! engine with the last events drained and the probes detached.
//!
//! The ring buffer is drained on its readiness and on a 20 ms timer
//! (events are submitted without wakeups, see `RINGBUF_WAKEUP_BYTES`);
//! upkeep runs every 50 ms for the first two seconds (a launched command's
//! interpreter or runtime should be found before its first stall), then
//! every 250 ms. After the first two seconds, a reader that found the ring
//! empty [`EMPTY_DRAINS_TO_SLEEP`] times in a row, with nothing waiting on
//! a drain ([`Engine::quiet`]), stops its drain timer and sets
//! `READER_ASLEEP`: the kernel side wakes it with its next record. An idle
//! target then costs the host 4 agent wake-ups a second (the upkeep), not
//! 54; a busy one is drained as before.
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    future::Future,
    time::Duration,
};

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{Signal, SignalKind, signal},
    time::{Instant, Interval, interval},
};

use crate::{
    kernel::probe::{ProbeChoice, Probes},
    model::ProbeSet,
    os::{clock::monotonic_ns, proc},
    pipeline::{control::NoControl, engine::Engine},
};

/// What [`Live::next`] returned on.
pub enum Step<T> {
    /// Upkeep done: `n`-th tick since attach.
    Tick(u32),
    /// Ctrl-C, SIGTERM or the deadline: the recording should end, for this reason.
    Stop(&'static str),
    /// The command's own future finished first.
    Other(T),
}

/// The probes on one target, their ring buffer and the engine they feed.
pub struct Live {
    /// The target: the root of the watched tree.
    pub pid: u32,
    pub engine: Engine,
    /// The processes watched now, the root first.
    watched: Vec<u32>,
    /// Every process watched at some point, in the order first watched,
    /// with the parent it was found under (the root's: None).
    pub ever: Vec<(u32, Option<u32>)>,
    /// The root has exited.
    root_gone: bool,
    /// Processes in which a loop thread was elected, gone ones too.
    looped: BTreeSet<u32>,
    probes: Probes,
    ring: AsyncFd<RingBuf<MapData>>,
    sigint: Signal,
    sigterm: Signal,
    deadline: Option<Instant>,
    tick: Interval,
    ticks: u32,
    drain_tick: Interval,
    /// Asleep: the drain timer is stopped; the kernel side wakes the reader.
    reader: ReaderSleep,
}

/// Drain period while records come.
const DRAIN_EVERY: Duration = Duration::from_millis(20);
/// Upkeeps 50 ms apart at first (then 250 ms); the reader never sleeps
/// during them.
const FAST_TICKS: u32 = 40;
/// Empty drains in a row before the reader may sleep (100 ms here, 0.5 s
/// in the daemon).
const EMPTY_DRAINS_TO_SLEEP: u32 = 5;

/// Whether a ring's reader sleeps until the kernel side's next record
/// (`READER_ASLEEP`) or drains on its timer, and how often it slept: the
/// state `record`/`top` ([`Live`]) and the daemon's collector share. The
/// caller decides whether nothing waits on a drain and sets the flag.
#[derive(Default)]
pub struct ReaderSleep {
    asleep: bool,
    /// Drains in a row that found the ring empty.
    empty_drains: u32,
    sleeps: u64,
    wakes: u64,
}

impl ReaderSleep {
    pub fn asleep(&self) -> bool {
        self.asleep
    }

    /// A drain found the ring empty: true when, awake, enough empty drains
    /// came in a row for the reader to sleep.
    pub fn empty_drain(&mut self) -> bool {
        if self.asleep {
            return false;
        }
        self.empty_drains += 1;
        self.empty_drains >= EMPTY_DRAINS_TO_SLEEP
    }

    /// The flag is set: the reader sleeps.
    pub fn slept(&mut self) {
        self.asleep = true;
        self.sleeps += 1;
    }

    /// Records came, or work a drain finishes: drain on the timer again.
    /// True if the reader was asleep.
    pub fn woke(&mut self) -> bool {
        let was = self.asleep;
        self.wakes += u64::from(was);
        self.asleep = false;
        self.empty_drains = 0;
        was
    }

    /// `-vv`: how often the reader slept.
    pub fn log(&self) {
        log::debug!(
            "ring reader: slept {} times while the ring was empty, woken {} times",
            self.sleeps,
            self.wakes
        );
    }
}

/// A finished [`Live`]: the probes are detached.
pub struct Finished {
    pub engine: Engine,
    pub ended_ns: u64,
    /// The kernel's failure counters.
    pub drops: BTreeMap<String, u64>,
    /// What the sampling gate saved.
    pub kernel_filtered: BTreeMap<String, u64>,
    /// Which probes served.
    pub probes: ProbeSet,
}

impl Live {
    /// Load and attach the probes for `pid` (and, with `subprocesses`, the
    /// processes under it) and start an engine on them. Must run inside a
    /// tokio runtime with I/O, time and signals enabled.
    pub fn attach(
        pid: u32,
        threshold_ns: u64,
        tids: Option<HashSet<u32>>,
        sample_hz: u64,
        sample_after_ns: u64,
        choice: ProbeChoice,
        subprocesses: bool,
    ) -> Result<Live> {
        let mut probes = Probes::attach(pid, sample_hz, sample_after_ns, choice, subprocesses)?;
        let mut watched = vec![pid];
        let mut ever = vec![(pid, None)];
        if subprocesses {
            // The fork probe is in: a process started from now on is
            // reported; those started before are found under the root (a
            // second walk: one started while the first ran).
            for _ in 0..2 {
                for child in proc::descendants(pid) {
                    // Not stallprof itself, when run under its own target
                    // (`--pid` of the shell that started it).
                    if watched.contains(&child) || child == std::process::id() {
                        continue;
                    }
                    match probes.watch_process(child) {
                        Ok(()) => {
                            watched.push(child);
                            ever.push((child, proc::parent_pid(child)));
                        }
                        Err(e) if proc::process_alive(child) => {
                            log::warn!(
                                "pid {child} (under {pid}) is not watched: {e}; its stalls are \
                                 not recorded (record it on its own with --pid {child})"
                            );
                        }
                        Err(_) => {}
                    }
                }
            }
            if watched.len() > 1 {
                log::info!(
                    "watching {} processes under {pid} too: {:?}",
                    watched.len() - 1,
                    &watched[1..]
                );
            }
        }
        // The kernel's BTF, parsed for the load, is freed: give it back.
        crate::os::heap::release();
        // SAFETY: the ring buffer owns its map fd and keeps it open,
        // unchanged, for as long as the AsyncFd holds it.
        let ring = unsafe { AsyncFd::register(probes.take_events()?)? };
        Ok(Live {
            pid,
            engine: Engine::new(threshold_ns, tids),
            watched,
            ever,
            root_gone: false,
            looped: BTreeSet::new(),
            probes,
            ring,
            sigint: signal(SignalKind::interrupt())?,
            sigterm: signal(SignalKind::terminate())?,
            deadline: None,
            tick: interval(Duration::from_millis(50)),
            ticks: 0,
            drain_tick: interval(DRAIN_EVERY),
            reader: ReaderSleep::default(),
        })
    }

    /// Stop with `Step::Stop("duration")` after `d`.
    pub fn stop_after(&mut self, d: Duration) {
        self.deadline = Some(Instant::now() + d);
    }

    /// The first upkeep, right after attach: the target's runtimes found
    /// (waited for up to 2 s) before anyone is told the probes are in.
    pub fn first_upkeep(&mut self) {
        self.engine.first_tick(
            &self.watched,
            &mut self.probes,
            self.ring.get_mut(),
            Duration::from_secs(2),
        );
    }

    /// The engine's `/proc` upkeep for the target now (runtimes, loop
    /// keys), after the tree's changes: processes started are watched,
    /// those gone let go.
    pub fn upkeep(&mut self) {
        for (child, parent) in self.engine.take_forked() {
            if !self.watched.contains(&child) {
                log::info!("pid {child} started by {parent}: watched");
                self.watched.push(child);
                self.ever.push((child, Some(parent)));
            }
        }
        // Before a process gone is forgotten with its loop threads.
        self.looped.extend(self.engine.executor_pids());
        for gone in self.engine.take_exited() {
            if gone == self.pid {
                self.root_gone = true;
            } else if let Some(i) = self.watched.iter().position(|&p| p == gone) {
                log::info!("pid {gone} exited: let go");
                self.watched.remove(i);
                self.probes.unwatch_process(gone);
                self.engine.forget(gone, &mut self.probes);
            }
        }
        self.engine.tick(&self.watched, &mut self.probes);
    }

    /// The processes watched now, the root first.
    pub fn watched(&self) -> &[u32] {
        &self.watched
    }

    /// The processes in which a loop thread was elected so far.
    pub fn looped(&self) -> &BTreeSet<u32> {
        &self.looped
    }

    /// The root of the tree has exited (seen by the kernel side).
    pub fn root_gone(&self) -> bool {
        self.root_gone
    }

    /// Drain, and run the engine's upkeep, until the next tick, a stop, or
    /// `other` finishes.
    pub async fn next<T>(&mut self, other: impl Future<Output = T>) -> Result<Step<T>> {
        tokio::pin!(other);
        loop {
            tokio::select! {
                guard = self.ring.readable_mut() => {
                    let mut guard = guard?;
                    let records = self.engine.drain(guard.get_inner_mut(), &mut self.probes);
                    guard.clear_ready();
                    self.drained(records);
                }
                _ = self.sigint.recv() => return Ok(Step::Stop("Ctrl-C")),
                _ = self.sigterm.recv() => return Ok(Step::Stop("SIGTERM")),
                _ = async { tokio::time::sleep_until(self.deadline.unwrap()).await }, if self.deadline.is_some() => {
                    return Ok(Step::Stop("duration"));
                }
                t = &mut other => return Ok(Step::Other(t)),
                _ = self.drain_tick.tick(), if !self.reader.asleep() => {
                    let records = self.engine.drain(self.ring.get_mut(), &mut self.probes);
                    self.drained(records);
                }
                _ = self.tick.tick() => {
                    self.ticks += 1;
                    if self.ticks == FAST_TICKS {
                        self.tick = interval(Duration::from_millis(250));
                    }
                    if self.reader.asleep() {
                        // What the symbolizer or discovery finished since,
                        // and a wake-up the flag missed, are taken here.
                        let records = self.engine.drain(self.ring.get_mut(), &mut self.probes);
                        self.drained(records);
                    }
                    self.upkeep();
                    return Ok(Step::Tick(self.ticks));
                }
            }
        }
    }

    /// After a drain that took `records`: wake up, or go to sleep after
    /// enough empty drains with nothing waiting on one.
    fn drained(&mut self, records: usize) {
        if records > 0 {
            self.awake();
            return;
        }
        if self.reader.empty_drain()
            && self.ticks >= FAST_TICKS
            && self.engine.quiet()
            && self.probes.set_reader_asleep()
        {
            self.reader.slept();
            // A record submitted before the flag was set woke no one.
            if self.engine.drain(self.ring.get_mut(), &mut self.probes) > 0 {
                self.awake();
            }
        }
    }

    /// Records came: drain on the timer again, from now.
    fn awake(&mut self) {
        if self.reader.woke() {
            self.drain_tick.reset();
        }
    }

    /// Drain the last events and detach the probes, before anything slow.
    pub fn finish(mut self) -> Finished {
        self.reader.log();
        self.engine.drain(self.ring.get_mut(), &mut NoControl);
        let ended_ns = monotonic_ns();
        let drops = self.probes.drops();
        let kernel_filtered = self.probes.filtered();
        let probe_set = self.probes.probe_set().clone();
        let Live {
            engine,
            probes,
            ring,
            ..
        } = self;
        drop(ring);
        drop(probes);
        Finished {
            engine,
            ended_ns,
            drops,
            kernel_filtered,
            probes: probe_set,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_sleeps_after_empty_drains_and_wakes_on_records() {
        let mut r = ReaderSleep::default();
        for _ in 1..EMPTY_DRAINS_TO_SLEEP {
            assert!(!r.empty_drain());
        }
        assert!(r.empty_drain(), "the fifth empty drain in a row may sleep");
        r.slept();
        assert!(r.asleep());
        assert!(!r.empty_drain(), "asleep: nothing more to decide");
        assert!(r.woke(), "woken from sleep");
        assert!(!r.asleep());
        assert!(!r.woke(), "already awake");
        // The count starts again after a wake.
        for _ in 1..EMPTY_DRAINS_TO_SLEEP {
            assert!(!r.empty_drain());
        }
        assert!(r.empty_drain());
        assert_eq!((r.sleeps, r.wakes), (1, 1));
    }
}
