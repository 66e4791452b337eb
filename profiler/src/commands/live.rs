//! Driving the engine from the probes of one live target: the loop that
//! `record` and `top` share.
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
//! every 250 ms.
use std::{
    collections::{BTreeMap, HashSet},
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
    os::clock::monotonic_ns,
    pipeline::engine::{Engine, NoControl},
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
    pub pid: u32,
    pub engine: Engine,
    probes: Probes,
    ring: AsyncFd<RingBuf<MapData>>,
    sigint: Signal,
    sigterm: Signal,
    deadline: Option<Instant>,
    tick: Interval,
    ticks: u32,
    drain_tick: Interval,
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
    /// Load and attach the probes for `pid` and start an engine on them.
    /// Must run inside a tokio runtime with I/O, time and signals enabled.
    pub fn attach(
        pid: u32,
        threshold_ns: u64,
        tids: Option<HashSet<u32>>,
        sample_hz: u64,
        sample_after_ns: u64,
        choice: ProbeChoice,
    ) -> Result<Live> {
        let mut probes = Probes::attach(pid, sample_hz, sample_after_ns, choice)?;
        // The kernel's BTF, parsed for the load, is freed: give it back.
        crate::os::heap::release();
        // SAFETY: the ring buffer owns its map fd and keeps it open,
        // unchanged, for as long as the AsyncFd holds it.
        let ring = unsafe { AsyncFd::register(probes.take_events()?)? };
        Ok(Live {
            pid,
            engine: Engine::new(threshold_ns, tids),
            probes,
            ring,
            sigint: signal(SignalKind::interrupt())?,
            sigterm: signal(SignalKind::terminate())?,
            deadline: None,
            tick: interval(Duration::from_millis(50)),
            ticks: 0,
            drain_tick: interval(Duration::from_millis(20)),
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
            &[self.pid],
            &mut self.probes,
            self.ring.get_mut(),
            Duration::from_secs(2),
        );
    }

    /// The engine's `/proc` upkeep for the target now (runtimes, loop keys).
    pub fn upkeep(&mut self) {
        self.engine.tick(&[self.pid], &mut self.probes);
    }

    /// Drain, and run the engine's upkeep, until the next tick, a stop, or
    /// `other` finishes.
    pub async fn next<T>(&mut self, other: impl Future<Output = T>) -> Result<Step<T>> {
        tokio::pin!(other);
        loop {
            tokio::select! {
                guard = self.ring.readable_mut() => {
                    let mut guard = guard?;
                    self.engine.drain(guard.get_inner_mut(), &mut self.probes);
                    guard.clear_ready();
                }
                _ = self.sigint.recv() => return Ok(Step::Stop("Ctrl-C")),
                _ = self.sigterm.recv() => return Ok(Step::Stop("SIGTERM")),
                _ = async { tokio::time::sleep_until(self.deadline.unwrap()).await }, if self.deadline.is_some() => {
                    return Ok(Step::Stop("duration"));
                }
                t = &mut other => return Ok(Step::Other(t)),
                _ = self.drain_tick.tick() => {
                    self.engine.drain(self.ring.get_mut(), &mut self.probes);
                }
                _ = self.tick.tick() => {
                    self.ticks += 1;
                    if self.ticks == 40 {
                        self.tick = interval(Duration::from_millis(250));
                    }
                    self.upkeep();
                    return Ok(Step::Tick(self.ticks));
                }
            }
        }
    }

    /// Drain the last events and detach the probes, before anything slow.
    pub fn finish(mut self) -> Finished {
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
