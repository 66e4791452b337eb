//! The live reads of a stack event's busy period, for the engine: each
//! stack event with Python frames of an open period reads the period's
//! asyncio task and its ASGI request's route from the running target,
//! while the stall is still going on; a finished stall takes what they
//! found (or, replayed, what the recording saved).
//!
//! In: decoded events, the live [`crate::symbolize::RuntimeReader`]. Out:
//! the table of [`crate::pipeline::reads`] kept current (it says when each
//! kind is read again), the task and route of a finished stall.
use std::time::Instant;

use log::debug;

use crate::{
    kernel::event::Event,
    model::{Route, Task},
    pipeline::{
        control::Control,
        reads::{Period, TaskMiss, Want},
    },
    symbolize::python::{Captured, RouteRead, TaskRead},
};

use super::{Engine, Symbols};

impl Engine {
    /// What a stack event's busy period needs read from the live target,
    /// read now: its asyncio task and its request's route (neither in a
    /// replay; [`super::reads`] says when each is read again). A `Task`
    /// event is kept for the stack event that follows it.
    pub(super) fn read_live(&mut self, ev: &Event, probes: &mut dyn Control) {
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
        if let Err(TaskRead::Unreadable(why)) = &found
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
    pub(super) fn read_held_routes(&mut self) {
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
    pub(super) fn stall_reads(
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
}
