//! Python frames in stall stacks: resolving the (code object, instruction)
//! pairs the BPF walker ships, and merging them into the native stack.
//!
//! In: native frames (outermost first) and Python frames (outermost first).
//! Out: one stack where each run of interpreter eval-loop frames is replaced
//! by the Python frames it was executing, so C-extension frames stay below
//! the Python function that called them.
use std::collections::HashMap;

use crate::{
    classify::{is_eval_frame, is_gc_frame},
    model::{Frame, Route, Task},
    symbolize::python::{
        Captured, CodeResolver, Interpreter, PyFrameInfo, QueueReader, RouteReader, SpanRead,
        SpanReader, TaskFound, TaskRead, TaskReader, TraceFound,
    },
    symbolize::queues::{Queues, QueuesMiss},
    symbolize::request::RouteRead,
};
use profiler_common::python::TaskLayout;

/// Split the walked Python frames (innermost first, `None` = boundary
/// between eval-loop activations) into groups, outermost group first, each
/// outermost frame first.
pub fn groups(walk: Vec<Option<Frame>>) -> Vec<Vec<Frame>> {
    let mut groups: Vec<Vec<Frame>> = vec![Vec::new()];
    for f in walk {
        match f {
            Some(f) => groups.last_mut().unwrap().push(f),
            None => groups.push(Vec::new()),
        }
    }
    groups.retain(|g| !g.is_empty());
    for g in groups.iter_mut() {
        g.reverse();
    }
    groups.reverse();
    groups
}

/// Merge Python frames into a native stack (both outermost first).
///
/// Each eval-loop activation on the native stack is replaced by the Python
/// frames it was running, matched from the innermost outwards (the outer
/// end is where either side may be cut short). Native frames between
/// activations stay where they are, so a C extension sits below the Python
/// function that called it. Python frames beyond the activations found go
/// at the outermost one; with no activation at all (no native unwinding
/// through the interpreter), they go on top of the native frames. A `[gc]`
/// marker goes above the collector's entry frame.
pub fn merge(native: Vec<Frame>, mut groups: Vec<Vec<Frame>>, py_status: u32) -> Vec<Frame> {
    let truncated = py_status == profiler_common::py_status::TRUNCATED;
    let evals: Vec<usize> = native
        .iter()
        .enumerate()
        .filter(|(_, f)| is_eval_frame(f))
        .map(|(i, _)| i)
        .collect();
    let mut out = Vec::with_capacity(native.len() + groups.iter().map(Vec::len).sum::<usize>() + 2);
    if truncated {
        groups.insert(0, vec![Frame::marker("[truncated]")]);
    }
    // Assign groups to evals, innermost first.
    let mut at: Vec<Vec<Frame>> = vec![Vec::new(); evals.len()];
    let mut rest: Vec<Frame> = Vec::new();
    let mut gi = groups.into_iter().rev();
    for slot in at.iter_mut().rev() {
        match gi.next() {
            Some(g) => *slot = g,
            None => break,
        }
    }
    // Outer groups left over: before the outermost activation's frames.
    let leftover: Vec<Vec<Frame>> = gi.collect();
    for g in leftover.into_iter().rev() {
        rest.extend(g);
    }
    let mut gc_marked = false;
    if evals.is_empty() {
        for f in native {
            if !gc_marked && is_gc_frame(&f) {
                out.push(Frame::marker("[gc]"));
                gc_marked = true;
            }
            out.push(f);
        }
        out.extend(rest);
        return out;
    }
    let mut k = 0;
    for (i, f) in native.into_iter().enumerate() {
        if k < evals.len() && evals[k] == i {
            if k == 0 {
                out.append(&mut rest);
            }
            out.append(&mut at[k]);
            k += 1;
        } else {
            if !gc_marked && is_gc_frame(&f) {
                out.push(Frame::marker("[gc]"));
                gc_marked = true;
            }
            out.push(f);
        }
    }
    out
}

/// Resolves one process's Python frames and GIL holders, reading its
/// memory (through `crate::symbolize::python`). Created on first need, kept for the
/// recording: code objects are cached by address (with a reuse check).
pub struct PyResolver {
    interp: Interpreter,
    code: CodeResolver,
    /// `PyThreadState*` -> tid, refreshed when an unknown one shows up.
    threads: HashMap<u64, u32>,
    /// The running asyncio task of its threads.
    tasks: TaskReader,
    /// The ASGI request its threads serve.
    routes: RouteReader,
    /// The OpenTelemetry span of a task's or a thread's context.
    spans: SpanReader,
    /// What its asyncio loops have waiting.
    queues: QueueReader,
}

impl PyResolver {
    /// None when `pid` is not a supported CPython (or is gone).
    pub fn for_pid(pid: u32) -> Option<PyResolver> {
        match crate::symbolize::python::detect(pid) {
            Ok(Some(interp)) => {
                let code = interp.code_resolver();
                let tasks = interp.task_reader();
                let routes = interp.route_reader();
                let spans = interp.span_reader();
                let queues = interp.queue_reader();
                Some(PyResolver {
                    queues,
                    interp,
                    code,
                    threads: HashMap::new(),
                    tasks,
                    routes,
                    spans,
                })
            }
            Ok(None) => None,
            Err(e) => {
                log::warn!("pid {pid}: Python frames unavailable: {e}");
                None
            }
        }
    }

    pub fn resolve(&mut self, code: u64, instr: u64) -> Option<PyFrameInfo> {
        self.code.resolve(code, instr).ok()
    }

    /// The thread that owns a `PyThreadState*`.
    pub fn thread_of(&mut self, tstate: u64) -> Option<u32> {
        if !self.threads.contains_key(&tstate)
            && let Ok(all) = self.interp.thread_states()
        {
            self.threads = all.into_iter().map(|(tid, ts)| (ts, tid)).collect();
        }
        self.threads.get(&tstate).copied()
    }

    /// The `PyThreadState*` of thread `tid` (the thread list is read again
    /// when it is not known).
    fn tstate_of(&mut self, tid: u32) -> Option<u64> {
        let find = |t: &HashMap<u64, u32>| t.iter().find(|e| *e.1 == tid).map(|e| *e.0);
        if let Some(ts) = find(&self.threads) {
            return Some(ts);
        }
        if let Ok(all) = self.interp.thread_states() {
            self.threads = all.into_iter().map(|(tid, ts)| (ts, tid)).collect();
        }
        find(&self.threads)
    }

    /// The asyncio task thread `tid` is running, checked against `stack`
    /// (its Python frames in a stack event, innermost first): see
    /// [`TaskReader`]. The coroutine is named by its code object.
    pub fn asyncio_task(
        &mut self,
        tid: u32,
        stack: &[(u64, u64)],
        captured: &Captured,
    ) -> Result<TaskFound, TaskRead> {
        let ts = self.tstate_of(tid);
        // The running task hangs off the thread state from 3.14.
        let tstate = ts.filter(|_| self.interp.version().1 >= 14);
        // Read only when a task's coroutine body is the captured innermost
        // frame (about 3 reads).
        let routes = &self.routes;
        let live_innermost = || ts.and_then(|ts| routes.innermost_frame(ts).ok().flatten());
        let mut read = self.tasks.current(tstate, stack, captured, &live_innermost);
        // A stack cut short of its outermost frames (over the kernel's 64
        // Python frames: a deep framework and client stack) lacks the
        // task's coroutine frame. While the thread is still inside the
        // captured call, its live frames are that stack and its callers:
        // the task is checked against them.
        if read == TaskRead::Unverified
            && let Some(ts) = ts
        {
            let live = self.routes.still_in(ts, stack);
            let captured_frames = stack.iter().filter(|f| f.0 != 0).count();
            log::debug!(
                "tid {tid}: task unverified on {captured_frames} captured Python frames; \
                 live frames beginning with them: {:?}",
                live.as_ref().map(|l| l.as_ref().map(Vec::len))
            );
            if let Ok(Some(live)) = live
                && live.len() > captured_frames
            {
                read = self.tasks.current(tstate, &live, captured, &live_innermost);
            }
        }
        match read {
            TaskRead::Task {
                name,
                coro_code,
                coro_instr,
                awaited_by,
                context,
            } => {
                let span = self.spans.read(context);
                log::debug!("tid {tid}: the task's span (context {context:#x}): {span:?}");
                let found = self.checked_span(tid, stack, span);
                Ok(TaskFound {
                    task: Task {
                        name,
                        coro: self.resolve(coro_code, coro_instr).map(|i| i.qualname),
                        awaited_by,
                        trace: found.trace.trace,
                        trace_unreadable: found.trace.trace_unreadable,
                    },
                    span_unverified: found.span_unverified,
                    span_pending: found.span_pending,
                })
            }
            other => Err(other),
        }
    }

    /// The OpenTelemetry span of thread `tid`'s own current context
    /// (`PyThreadState.context`: under asyncio's `Handle._run`, the
    /// context the running callback was scheduled in), checked against
    /// `stack` as a task's span is. For a stall that runs no task.
    pub fn thread_trace(&mut self, tid: u32, stack: &[(u64, u64)]) -> TraceFound {
        let span = match self.tstate_of(tid) {
            Some(ts) => self.spans.in_thread(ts),
            None => Err(format!("thread {tid}: no Python thread state found")),
        };
        log::debug!("tid {tid}: the thread's span: {span:?}");
        self.checked_span(tid, stack, span)
    }

    /// A span read from a context of thread `tid`, kept only while the
    /// thread still runs the captured `stack` (innermost first): a `with`
    /// opening a child span, or leaving it, changes the context as the code
    /// runs. Checked from the outermost frame through the innermost app
    /// frame, instruction and all: a span is entered and left by code (a
    /// `with` in the handler) whose frame then moves; a library's frames
    /// deeper may run on.
    fn checked_span(
        &mut self,
        tid: u32,
        stack: &[(u64, u64)],
        span: Result<SpanRead, String>,
    ) -> TraceFound {
        let still = matches!(span, Ok(SpanRead::Span { .. })) && {
            let outer = self.through_app_frame(stack);
            self.tstate_of(tid)
                .is_some_and(|ts| self.routes.runs_captured(ts, &outer).unwrap_or(false))
        };
        log::debug!("tid {tid}: span still the stall's: {still}");
        TraceFound::checked(span, still)
    }

    /// The captured `stack` (innermost first) from its innermost app frame
    /// (by the default guess of [`AppPaths`]) outward; the whole stack when
    /// no frame is the app's.
    fn through_app_frame(&mut self, stack: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let app = crate::classify::AppPaths::default();
        for (i, &(code, instr)) in stack.iter().enumerate() {
            if code == 0 {
                continue;
            }
            let Some(info) = self.resolve(code, instr) else {
                continue;
            };
            let f = Frame {
                name: info.qualname.into(),
                file: Some(info.filename.into()),
                line: Some(info.line),
                kind: crate::model::FrameKind::Python,
                module: None,
            };
            if app.is_app(&f) {
                return stack[i..].to_vec();
            }
        }
        stack.to_vec()
    }

    /// 3.14+: where a thread state holds its running asyncio task and the
    /// task's layout, once found (see [`TaskReader::kernel_task`]).
    pub fn kernel_task(&self) -> Option<(u64, TaskLayout)> {
        self.tasks.kernel_task()
    }

    /// The ASGI request (method, route template) thread `tid` is serving,
    /// checked against `stack`: see [`RouteReader`].
    /// What the asyncio loop of thread `tid` has waiting now: its timers
    /// and ready handles (see [`QueueReader`]).
    pub fn loop_queues(&mut self, tid: u32) -> Result<Queues, QueuesMiss> {
        let tstate = self.tstate_of(tid);
        let thread_id = tstate.and_then(|ts| {
            let off = u64::from(self.interp.layout().tstate_thread_id);
            crate::os::memory::ReadMemory::read_u64(self.interp.memory(), ts + off).ok()
        });
        match self.tasks.running_loops(tstate) {
            Ok(Some(running)) => self.queues.read(tid, &running, thread_id),
            Ok(None) => Err(QueuesMiss::Unsupported("asyncio not loaded".into())),
            Err(why) => Err(QueuesMiss::Unreadable(why)),
        }
    }

    pub fn asgi_route(&mut self, tid: u32, stack: &[(u64, u64)]) -> Result<Route, RouteRead> {
        let tstate = self.tstate_of(tid);
        let outer = self.through_app_frame(stack);
        match self.routes.current(tstate, stack, &outer) {
            RouteRead::Route { method, template } => Ok(Route { method, template }),
            other => Err(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::FrameKind;

    fn n(name: &str) -> Frame {
        Frame::new(name, FrameKind::Native)
    }
    fn p(name: &str) -> Frame {
        Frame::new(name, FrameKind::Python)
    }
    fn names(v: &[Frame]) -> Vec<&str> {
        v.iter().map(|f| f.name.as_str()).collect()
    }

    /// `main -> eval[a, b] -> builtin_exec -> eval[c] -> zlib_compress`
    #[test]
    fn c_frames_stay_between_their_python_callers() {
        let native = vec![
            n("main"),
            n("_PyEval_EvalFrameDefault"),
            n("builtin_exec"),
            n("_PyEval_EvalFrameDefault"),
            n("deflate"),
        ];
        // Walk order: innermost first, boundary after each activation's entry.
        let walk = vec![Some(p("c")), None, Some(p("b")), Some(p("a")), None];
        let merged = merge(native, groups(walk), profiler_common::py_status::COMPLETE);
        assert_eq!(
            names(&merged),
            ["main", "a", "b", "builtin_exec", "c", "deflate"]
        );
    }

    #[test]
    fn without_native_eval_frames_python_goes_on_top() {
        let merged = merge(
            vec![n("start"), n("read")],
            groups(vec![Some(p("inner")), Some(p("outer"))]),
            1,
        );
        assert_eq!(names(&merged), ["start", "read", "outer", "inner"]);
    }

    #[test]
    fn gc_is_marked_under_the_allocating_frame() {
        let native = vec![
            n("_PyEval_EvalFrameDefault"),
            n("_Py_HandlePending"),
            n("_Py_RunGC"),
            n("gc_collect_main"),
        ];
        let merged = merge(native, groups(vec![Some(p("load_tokenizer"))]), 1);
        assert_eq!(
            names(&merged),
            [
                "load_tokenizer",
                "_Py_HandlePending",
                "[gc]",
                "_Py_RunGC",
                "gc_collect_main"
            ]
        );
    }

    #[test]
    fn extra_outer_groups_and_truncation() {
        let native = vec![n("_PyEval_EvalFrameDefault"), n("x")];
        let walk = vec![Some(p("in")), None, Some(p("out"))];
        let merged = merge(native, groups(walk), profiler_common::py_status::TRUNCATED);
        assert_eq!(names(&merged), ["[truncated]", "out", "in", "x"]);
    }
}
