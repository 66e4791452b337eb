//! The engine between records: what the live commands call on it around
//! the ring buffer — draining it ([`Engine::drain`], the daemon's
//! [`Engine::drain_executors`]), periodic upkeep of the watched processes
//! ([`Engine::tick`], bounded by [`UPKEEP_BUDGET`]; the discovery thread's
//! answers applied), and the daemon's [`Engine::forget`] of a process gone.
//!
//! In: the ring, the pids to keep up, the [`Control`] port. Out: records
//! handed to [`Engine::handle_record`], probes told what discovery found.
//! A replay calls none of this.
use std::time::Duration;

use crate::{
    kernel::event::{self, Event},
    pipeline::{control::Control, counters::Counter, discovery::Answer, watch::PythonWatch},
};

use super::Engine;

/// How long [`Engine::first_tick`] waits for discovery between drains.
const FIRST_TICK_SLICE: Duration = Duration::from_millis(20);

/// Time one upkeep tick may take before the rest of the processes wait for
/// the next (see [`Engine::tick`]).
const UPKEEP_BUDGET: Duration = Duration::from_millis(30);

/// Age after which periodic upkeep re-reads a process's maps.
const MAPS_UPKEEP: Duration = Duration::from_secs(2);

impl Engine {
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
                        w.found(pid, *r, probes);
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

    /// Daemon: forget a process that exited or exec'd — its loop threads
    /// (here and in the kernel), their names, its caches — so that churn
    /// does not grow these tables.
    pub fn forget(&mut self, pid: u32, probes: &mut dyn Control) {
        self.js_pending_stacks.remove(&pid);
        self.otel_unread.remove(&pid);
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
