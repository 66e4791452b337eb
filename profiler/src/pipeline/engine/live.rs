//! The live reads of a stack event's busy period, for the engine: each
//! stack event with Python frames of an open period reads the period's
//! asyncio task (with none, its thread's context's span) and its ASGI
//! request's route from the running target,
//! while the stall is still going on; a finished stall takes what they
//! found (or, replayed, what the recording saved).
//!
//! In: decoded events, the live [`crate::symbolize::RuntimeReader`]. Out:
//! the table of [`crate::pipeline::reads`] kept current (it says when each
//! kind is read again), the task and route of a finished stall.
use std::time::Instant;

use log::debug;

use crate::{
    kernel::event::{Event, JsSlot},
    model::{ContextTrace, HeldUp, NotRead, NotReadReason, Route, Task},
    pipeline::{
        control::Control,
        counters::Counter,
        reads::{Period, TaskMiss, Want},
    },
    symbolize::python::{Captured, TaskRead},
    symbolize::queues::QueuesMiss,
    symbolize::request::RouteRead,
};

use super::{Engine, Symbols};

/// What the live reads found for a finished stall.
pub(super) struct StallReads {
    pub task: Option<Task>,
    /// With no task, the span of the thread's own context.
    pub thread_context: Option<ContextTrace>,
    /// Why it has no task (live only).
    pub miss: Option<TaskMiss>,
    pub route: Option<Route>,
    pub held_up: Option<HeldUp>,
}

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
                    on_cpu: false,
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
        let captured = Captured {
            on_cpu: matches!(ev, Event::Sample { .. }),
            ..self.kept.reads.take_captured(tid, task)
        };
        let Some(start) = self.kept.tracker.open_period(tid) else {
            return;
        };
        self.read_task((tid, start), tgid, python, &captured, probes);
        if self.kept.reads.wants_queues((tid, start)) {
            self.read_queues((tid, start), tgid);
        }
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
        // No task runs (a plain callback, another loop): the span is the
        // thread's own context's.
        let thread = match found {
            Err(TaskRead::NoTask) => reader.thread_trace(tgid, key.0, python),
            _ => None,
        };
        let tracker = &self.kept.tracker;
        self.kept
            .reads
            .task_read(key, found, now, || tracker.open_periods());
        if let Some(thread) = thread {
            self.kept
                .reads
                .thread_read(key, thread, || tracker.open_periods());
        }
    }

    /// Read what the loop of period `key` of `tgid` holds up now: its
    /// timers and ready callbacks (kept with the time the read finished:
    /// it counts only if the stall was still going on then).
    fn read_queues(&mut self, key: Period, tgid: u32) {
        let Some(reader) = self.symbols.live() else {
            return;
        };
        let before_ns = crate::os::clock::monotonic_ns();
        let read = reader.loop_queues(tgid, key.0);
        let after_ns = crate::os::clock::monotonic_ns();
        match &read {
            Ok(q) => debug!(
                "pid {tgid} tid {}: loop queues read in {} µs: {} timers, {} ready handles",
                key.0,
                (after_ns - before_ns) / 1000,
                q.timers_when_ns.len(),
                q.ready_handles
            ),
            Err(QueuesMiss::Unreadable(why)) => {
                debug!("pid {tgid} tid {}: loop queues unreadable: {why}", key.0);
            }
            Err(e) => debug!("pid {tgid} tid {}: loop queues not read: {e:?}", key.0),
        }
        let tracker = &self.kept.tracker;
        self.kept
            .reads
            .queues_read(key, read, after_ns, || tracker.open_periods());
    }

    /// A stack event with JavaScript frames of an open busy period: its
    /// process, thread, frames and period.
    fn js_stack<'e>(&self, ev: &'e Event) -> Option<(u32, u32, &'e [JsSlot], Period)> {
        let (Event::Sample {
            tgid, tid, stack, ..
        }
        | Event::SwitchOut {
            tgid, tid, stack, ..
        }) = ev
        else {
            return None;
        };
        if stack.js.is_empty() {
            return None;
        }
        let start = self.kept.tracker.open_period(*tid)?;
        Some((*tgid, *tid, &stack.js, (*tid, start)))
    }

    /// Read the express route of a stack event's busy period from its
    /// JavaScript frames, now, when the period wants one: the objects are
    /// found through the stack copy's words (the request moves with the
    /// young generation; the next stack event has its new address), so a
    /// read is never held back for later.
    pub(super) fn read_js_route(&mut self, ev: &Event) {
        let Some((tgid, tid, js, key)) = self.js_stack(ev) else {
            return;
        };
        let now = Instant::now();
        if self.kept.reads.wants_route(key, now) != Want::Now {
            return;
        }
        let Some(reader) = self.symbols.live() else {
            return;
        };
        let read = reader.express_route(tgid, js);
        match &read {
            Ok(r) => debug!(
                "pid {tgid} tid {tid}: express route {} {}",
                r.method, r.template
            ),
            Err(RouteRead::Unreadable(why)) => {
                debug!("pid {tgid} tid {tid}: express route unreadable: {why}")
            }
            Err(_) => {}
        }
        let tracker = &self.kept.tracker;
        self.kept
            .reads
            .route_read(key, read, now, || tracker.open_periods());
    }

    /// Read what the Node loop of a stack event's busy period holds up
    /// (its timers and immediates), when the period wants it read: from
    /// its JavaScript frames, the way into the heap.
    pub(super) fn read_js_queues(&mut self, ev: &Event) {
        let Some((tgid, tid, js, key)) = self.js_stack(ev) else {
            return;
        };
        if !self.kept.reads.wants_queues(key) {
            return;
        }
        let Some(reader) = self.symbols.live() else {
            return;
        };
        let before_ns = crate::os::clock::monotonic_ns();
        let read = reader.node_timers(tgid, tid, js);
        let after_ns = crate::os::clock::monotonic_ns();
        match &read {
            Ok(q) => debug!(
                "pid {tgid} tid {tid}: node timers read in {} µs: {} timers, {} immediates",
                (after_ns - before_ns) / 1000,
                q.timers_when_ns.len(),
                q.ready_handles
            ),
            Err(QueuesMiss::Unreadable(why)) => {
                debug!("pid {tgid} tid {tid}: node timers unreadable: {why}")
            }
            Err(e) => debug!("pid {tgid} tid {tid}: node timers not read: {e:?}"),
        }
        let tracker = &self.kept.tracker;
        self.kept
            .reads
            .queues_read(key, read, after_ns, || tracker.open_periods());
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
        match &read {
            Ok(r) => debug!("pid {tgid} tid {tid}: route {} {}", r.method, r.template),
            Err(RouteRead::Unreadable(why)) => {
                debug!("pid {tgid} tid {tid}: ASGI route unreadable: {why}")
            }
            Err(e) => debug!("pid {tgid} tid {tid}: route not read: {e:?}"),
        }
        let tracker = &self.kept.tracker;
        self.kept
            .reads
            .route_read(key, read, now, || tracker.open_periods());
    }

    /// The task, route and held-up work of a finished stall (ended at
    /// `end_ns`): the live reads' (also kept for a recording, a route's
    /// and the queues' misses counted), or the recording's; and, live, why
    /// it has no task.
    pub(super) fn stall_reads(&mut self, tgid: u32, key: Period, end_ns: u64) -> StallReads {
        let saved_key = format!("{}:{}", key.0, key.1);
        let task = self.kept.reads.finish_task(key);
        // The thread's context is the stall's only when no task was read.
        let thread = self.kept.reads.finish_thread(key).filter(|_| task.is_err());
        let span_unverified = match &task {
            Ok(found) => found.span_unverified,
            Err(_) => thread.as_ref().is_some_and(|t| t.span_unverified),
        };
        if span_unverified {
            self.counters.add(Counter::OtelSpanUnverified, 1);
        }
        let task = task.map(|found| found.task);
        let thread_context = thread.map(|t| t.trace).filter(|t| !t.is_empty());
        let queues = self.kept.reads.finish_queues(tgid, key, end_ns);
        let is_node = self.symbols.live().is_some_and(|r| r.is_node(tgid));
        match &mut self.symbols {
            Symbols::Saved(table) => StallReads {
                task: table.tasks.get(&saved_key).cloned(),
                thread_context: table.thread_contexts.get(&saved_key).cloned(),
                miss: None,
                route: table.routes.get(&saved_key).cloned(),
                held_up: table.held_up.get(&saved_key).cloned(),
            },
            Symbols::Live { recorded, .. } => {
                let (route, miss) = self.kept.reads.finish_route(tgid, key);
                if let Some(c) = miss {
                    self.counters.add(c, 1);
                }
                let held_up = queues.unwrap_or_else(|| {
                    // A Python or Node loop's stall whose stacks came too
                    // late for a read; any other runtime's queues are not
                    // read.
                    let reason = if self.python.contains_key(&tgid) || is_node {
                        NotReadReason::NoRead
                    } else {
                        NotReadReason::Runtime
                    };
                    HeldUp::NotRead(NotRead {
                        reason,
                        detail: None,
                    })
                });
                if let HeldUp::NotRead(n) = &held_up
                    && n.reason != NotReadReason::Runtime
                {
                    self.counters.add(Counter::HeldUpUnread, 1);
                }
                if let Some(table) = recorded {
                    if let Ok(t) = &task {
                        table.tasks.insert(saved_key.clone(), t.clone());
                    }
                    if let Some(t) = &thread_context {
                        table.thread_contexts.insert(saved_key.clone(), t.clone());
                    }
                    if let Some(r) = &route {
                        table.routes.insert(saved_key.clone(), r.clone());
                    }
                    table.held_up.insert(saved_key, held_up.clone());
                }
                let (task, miss) = match task {
                    Ok(t) => (Some(t), None),
                    Err(m) => (None, Some(m)),
                };
                StallReads {
                    task,
                    thread_context,
                    miss,
                    route,
                    held_up: Some(held_up),
                }
            }
        }
    }
}
