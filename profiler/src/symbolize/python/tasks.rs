//! asyncio task identity: which `Task` a loop thread is running, read from
//! outside the process, and checked against a stack BPF captured.
//!
//! In: the thread (its `PyThreadState*`) and the Python frames of a stack
//! event of its busy period. Out: a [`TaskRead`]: the running task's name
//! (`Task.get_name()`), its coroutine's code object, and on 3.14+ the tasks
//! awaiting it (the await chain `python -m asyncio pstree` prints) — or why
//! there is none.
//!
//! Where the running task is:
//! - 3.14+: `_PyThreadStateImpl.asyncio_running_task`, at the offset the
//!   `_asyncio` module exports in its `.AsyncioDebug` ELF section
//!   (`_Py_AsyncioModuleDebugOffsets`: the `TaskObj` fields `task_name`,
//!   `task_coro`, `task_awaited_by`, `task_awaited_by_is_set`,
//!   `task_is_task`, and the thread state's `asyncio_running_task`). The
//!   section is in `_asyncio.cpython-3XX-*.so` (Debian's 3.14) or in the
//!   interpreter itself when `_asyncio` is built in (Debian's 3.15).
//! - 3.10-3.13: `asyncio.tasks._current_tasks`, the C `_asyncio` module's
//!   dict `{loop: task}`, found once per process through the main
//!   interpreter's `sys.modules` (`modules`, `imports.modules`; 3.13 from
//!   `_Py_DebugOffsets`) -> `"asyncio.tasks"` -> its `__dict__`. The
//!   `TaskObj` and generator offsets of these versions are in [`FIXED`],
//!   measured on the builds here (see there).
//!
//! The read happens in userspace when a stack event of the busy period
//! arrives, so the task may have changed since the stack was captured. It
//! is kept only when its coroutine's frame is on the captured stack: the
//! coroutine's own frame (embedded in the coroutine object on 3.11+,
//! `gi_frame` on 3.10) must hold the same code object *and* instruction as
//! a frame of the stack — or the same code object as the stack's innermost
//! Python frame, when the coroutine body itself was running bytecode (its
//! instruction moves), and then the coroutine's frame must still be the
//! thread's innermost frame, by address (tasks of one coroutine function
//! share its code: a read that came after the block, with another such
//! task running, must not name it). Otherwise the read is
//! [`TaskRead::Unverified`].
//! Every read is bounded ([`MAX_TASKS`], [`MAX_DICT_ENTRIES`],
//! [`MAX_AWAIT_CHAIN`], string caps of [`super::code`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::PythonError;
use super::dict::{self, DICT_MA_KEYS};
use super::offsets::Layout;
use crate::kernel::event::MemoryRead;
use crate::os::maps::{self, mapped_file};
use crate::os::memory::{CapturedRead, Overlay, ProcessMemory, ReadMemory, le_u64};
use profiler_common::python::PY_FRAME_MODEL_FRAME_OBJECT;
use profiler_common::python::{OB_TYPE, TYPE_TP_FLAGS, TaskLayout};

/// Entries of `_current_tasks` considered (one per running event loop).
pub const MAX_TASKS: usize = 64;
/// Entries of `sys.modules` / a module's `__dict__` scanned for one key.
pub const MAX_DICT_ENTRIES: u64 = 1 << 14;
/// Awaiting tasks followed up the chain (3.14+), and awaiters per set.
pub const MAX_AWAIT_CHAIN: usize = 16;
const MAX_AWAITERS_SET: u64 = 1024;
/// How often a process whose asyncio is not (yet) found is looked at again
/// (`asyncio` is imported after the interpreter starts): after 1 s, then
/// twice as long each time up to 16 s (a Python loop without asyncio costs
/// one scan of `sys.modules` that often).
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(16);

/// The running task as BPF read it with a stack (3.14+): the object, and
/// the parts of memory that name it as they were then (`Event::Task`;
/// empty when not sent). `task == 0`: not read with the stack.
#[derive(Clone, Debug, Default)]
pub struct Captured {
    pub task: u64,
    pub memory: Vec<MemoryRead>,
    /// The stack was taken on the CPU (a sample), not as the thread
    /// blocked (a switch-out): only then may its innermost frame have run
    /// on within its own code by the read.
    pub on_cpu: bool,
}

/// What BPF read with the stack is served in place of the live memory
/// ([`Overlay`]).
impl CapturedRead for MemoryRead {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// A task read, named and checked against the stack: the model's task,
/// and whether its OpenTelemetry span is still unverified — the task was
/// in a span, but the thread had moved on from the captured stack when it
/// was read, so the span may not be the stall's (a later read of the stall
/// may verify one; `pipeline/reads.rs` keeps the flag, the model never
/// sees it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskFound {
    pub task: crate::model::Task,
    pub span_unverified: bool,
    /// Its context was OpenTelemetry's with no span yet
    /// ([`super::TraceFound::span_pending`]).
    pub span_pending: bool,
}

impl TaskFound {
    /// Its span read, as [`super::TraceFound`] weighs one against another.
    pub fn span(&self) -> super::TraceFound {
        super::TraceFound {
            trace: crate::model::ContextTrace {
                trace: self.task.trace.clone(),
                trace_unreadable: self.task.trace_unreadable.clone(),
            },
            span_unverified: self.span_unverified,
            span_pending: self.span_pending,
        }
    }
}

/// What one read found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskRead {
    /// The running task, checked against the stack.
    Task {
        name: String,
        /// The coroutine's frame: code object and instruction, as the walk
        /// emits them (resolve it for its qualified name).
        coro_code: u64,
        coro_instr: u64,
        awaited_by: Vec<String>,
        /// The task's `contextvars.Context` (`task_context`).
        context: u64,
    },
    /// No task is running on that thread now (a plain callback, or the
    /// task finished), or asyncio is not loaded.
    NoTask,
    /// A task runs, but its coroutine's frame is not on the captured stack:
    /// it may not be the stall's (the loop moved on before the read).
    Unverified,
    /// The task could not be read; the reason says what failed.
    Unreadable(String),
}

/// `TaskObj` and generator layout of one minor version without
/// `.AsyncioDebug` (3.10-3.13).
///
/// Provenance: `ctypes.string_at(id(task), n)` on a running task of each
/// build (pyenv 3.10.13, 3.11.7, 3.12.1, 3.13.0, Debian 3.11.2, Debian
/// forky 3.13.15), the word equal to `id(task.get_coro())` and to
/// `id(task.get_name())` (a named task; a default name is a `str` on
/// 3.10/3.11 and the counter `int` on 3.12+); for the coroutine, the word
/// equal to `id(coro.cr_code)` (3.11: the second one, the first is
/// `gi_code`), minus the frame's code offset. `modules`: gdb on the pyenv
/// builds (`print &((PyInterpreterState*)0)->modules`, `imports.modules`).
#[derive(Clone, Copy, Debug)]
struct Fixed {
    minor: u8,
    task_size: u64,
    task_name: u64,
    task_coro: u64,
    gen_frame: GenFrame,
    /// `PyInterpreterState.modules` (3.10, 3.11), `.imports.modules`
    /// (3.12); `None`: from `_Py_DebugOffsets` (3.13).
    interp_modules: Option<u64>,
}

/// Where a coroutine's frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GenFrame {
    /// 3.10: `gi_frame`, a `PyFrameObject*` (NULL once finished).
    Pointer(u64),
    /// 3.11+: `gi_iframe`, the `_PyInterpreterFrame` inside the object.
    Embedded(u64),
}

const FIXED: &[Fixed] = &[
    Fixed {
        minor: 10,
        task_size: 192,
        task_name: 168,
        task_coro: 160,
        gen_frame: GenFrame::Pointer(16),
        interp_modules: Some(856),
    },
    Fixed {
        minor: 11,
        task_size: 176,
        task_name: 144,
        task_coro: 136,
        gen_frame: GenFrame::Embedded(80),
        interp_modules: Some(888),
    },
    Fixed {
        minor: 12,
        task_size: 176,
        task_name: 144,
        task_coro: 136,
        gen_frame: GenFrame::Embedded(72),
        interp_modules: Some(944),
    },
    Fixed {
        minor: 13,
        task_size: 144,
        task_name: 128,
        task_coro: 120,
        gen_frame: GenFrame::Embedded(72),
        interp_modules: None,
    },
];

/// 3.14+ `gi_iframe` (`ctypes` as above on Debian's 3.14.8 and 3.15.0; the
/// debug offsets' generator section says the same).
const GI_IFRAME_314: u64 = 72;
/// `_Py_DebugOffsets.interpreter_state.imports_modules` (3.13: u64 #11).
const DEBUG_OFFSETS_IMPORTS_MODULES_313: u64 = 11;
/// `PyModuleObject.md_dict` (3.10-3.15).
const MODULE_MD_DICT: u64 = 16;
const TPFLAGS_LONG_SUBCLASS: u64 = 1 << 24;
const TPFLAGS_UNICODE_SUBCLASS: u64 = 1 << 28;
/// `PySetObject.mask`, followed by `.table` (3.14, `Include/cpython/setobject.h`),
/// `setentry` = {key, hash}.
const SET_MASK: u64 = 32;

/// `TaskObj` fields as used.
#[derive(Clone, Copy, Debug)]
struct TaskFields {
    size: u64,
    name: u64,
    coro: u64,
    /// `task_context`: the word after `task_name` on every version
    /// 3.10-3.15 (`ctypes`: the word equal to `id(task.get_context())` on
    /// 3.12+; on 3.10 and 3.11 the word whose `ctx_vars` is that of
    /// `contextvars.copy_context()` inside the task).
    context: u64,
    /// 3.14+: `task_awaited_by`, `task_awaited_by_is_set`, `task_is_task`.
    awaited_by: Option<(u64, u64, u64)>,
    gen_frame: GenFrame,
}

enum Source {
    /// Not found yet; look again after the instant.
    Pending(Instant),
    /// 3.10-3.13: the `_current_tasks` dict.
    CurrentTasks(u64),
    /// 3.14+: `_PyThreadStateImpl.asyncio_running_task`.
    RunningTask(u64),
}

/// Reads running tasks of one process. Keep it: it finds asyncio once.
pub struct TaskReader {
    mem: Arc<ProcessMemory>,
    layout: Layout,
    minor: u8,
    runtime: u64,
    fields: Option<TaskFields>,
    source: Source,
    /// 3.14+: `asyncio_running_loop`'s offset in a thread state.
    running_loop: Option<u64>,
    /// Why the last setup failed (said with every read until it works).
    setup_error: Option<String>,
    /// The wait before the next setup attempt.
    retry: Duration,
}

impl TaskReader {
    pub(crate) fn new(mem: Arc<ProcessMemory>, layout: Layout, runtime: u64) -> Self {
        TaskReader {
            mem,
            minor: layout.bpf.major_minor().1,
            layout,
            runtime,
            fields: None,
            source: Source::Pending(Instant::now()),
            running_loop: None,
            setup_error: None,
            retry: RETRY_FIRST,
        }
    }

    /// The task running on the thread of `tstate` (needed on 3.14+), checked
    /// against `stack`: the (code, instr) pairs of a stack event of that
    /// thread, innermost first, `code == 0` between activations.
    /// `captured` (3.14+): the task BPF read with that stack, the one
    /// running then rather than now, and what it read of it.
    pub fn current(
        &mut self,
        tstate: Option<u64>,
        stack: &[(u64, u64)],
        captured: &Captured,
        live_innermost: &dyn Fn() -> Option<u64>,
    ) -> TaskRead {
        if !self.found() {
            return self.not_found();
        }
        match self.read(tstate, stack, captured, live_innermost) {
            Ok(r) => r,
            Err(e) => TaskRead::Unreadable(e.to_string()),
        }
    }

    /// 3.14+, once found: the offset of `asyncio_running_task` in a
    /// thread state and the task's layout, for BPF to read the task with
    /// each stack (`PyProc::running_task`, `PyProc::task`).
    pub fn kernel_task(&self) -> Option<(u64, TaskLayout)> {
        let (Source::RunningTask(off), Some(f)) = (&self.source, &self.fields) else {
            return None;
        };
        let (GenFrame::Embedded(gen_frame), Some((by, is_set, _))) = (f.gen_frame, f.awaited_by)
        else {
            return None;
        };
        let small = |v: u64| u16::try_from(v).ok();
        Some((
            *off,
            TaskLayout {
                size: small(f.size)?,
                name: small(f.name)?,
                coro: small(f.coro)?,
                gen_frame: small(gen_frame)?,
                awaited_by: small(by)?,
                awaited_by_is_set: small(is_set)?,
                _pad: 0,
            },
        ))
    }

    /// Whether asyncio's running-task source is found, looked for again
    /// when due.
    fn found(&mut self) -> bool {
        self.found_when(false)
    }

    /// [`Self::found`]; with `now`, looked for now even before the
    /// back-off's time (once a stall: the queues' read has no later chance).
    fn found_when(&mut self, now: bool) -> bool {
        let Source::Pending(at) = self.source else {
            return true;
        };
        if !now && Instant::now() < at {
            return false;
        }
        match self.setup() {
            Ok(Some((fields, source, running_loop))) => {
                self.fields = Some(fields);
                self.source = source;
                self.running_loop = running_loop;
                self.setup_error = None;
                true
            }
            Ok(None) => {
                self.back_off();
                false
            }
            Err(e) => {
                self.back_off();
                self.setup_error = Some(e);
                false
            }
        }
    }

    /// The event loops that may be running on the thread of `tstate` now:
    /// 3.14+ the thread state's `asyncio_running_loop` (one, or none);
    /// 3.10-3.13 the keys of `_current_tasks`, every loop running a task
    /// step now (any thread; at most [`MAX_TASKS`]). `Err`: asyncio's state
    /// could not be read (why); `None`: asyncio is not loaded; an empty
    /// list: no loop is in a task step. Asyncio is looked for now if it was
    /// not found yet.
    pub fn running_loops(&mut self, tstate: Option<u64>) -> Result<Option<Vec<u64>>, String> {
        if !self.found_when(true) {
            return match &self.setup_error {
                Some(e) => Err(e.clone()),
                None => Ok(None),
            };
        }
        self.loops_now(tstate).map(Some)
    }

    fn loops_now(&mut self, tstate: Option<u64>) -> Result<Vec<u64>, String> {
        match self.source {
            Source::Pending(_) => Ok(Vec::new()),
            Source::RunningTask(_) => {
                let (Some(off), Some(ts)) = (self.running_loop, tstate) else {
                    return Err("the thread's PyThreadState is not known".into());
                };
                let l = self.mem.read_u64(ts + off).map_err(|e| e.to_string())?;
                Ok(if l == 0 { vec![] } else { vec![l] })
            }
            Source::CurrentTasks(dict) => Ok(self
                .dict_entries(dict, MAX_TASKS as u64)
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|(k, _)| k)
                .collect()),
        }
    }

    fn back_off(&mut self) {
        self.source = Source::Pending(Instant::now() + self.retry);
        self.retry = (self.retry * 2).min(RETRY_MAX);
    }

    fn not_found(&self) -> TaskRead {
        match &self.setup_error {
            Some(e) => TaskRead::Unreadable(e.clone()),
            None => TaskRead::NoTask,
        }
    }

    /// Finds the running-task source. `Ok(None)`: asyncio is not loaded
    /// (yet). `Err`: it is, but cannot be read (says why).
    /// With the source, 3.14+'s offset of `asyncio_running_loop` in a
    /// thread state.
    #[allow(clippy::type_complexity)]
    fn setup(&self) -> Result<Option<(TaskFields, Source, Option<u64>)>, String> {
        if self.minor >= 14 {
            return self.setup_debug_section();
        }
        let fixed = FIXED
            .iter()
            .find(|f| f.minor == self.minor)
            .ok_or_else(|| format!("no asyncio layout for CPython 3.{}", self.minor))?;
        fn e(e: impl std::fmt::Display) -> String {
            e.to_string()
        }
        let mem = &self.mem;
        let modules_off = match fixed.interp_modules {
            Some(off) => off,
            None => {
                let off = mem
                    .read_u64(self.runtime + 8 * DEBUG_OFFSETS_IMPORTS_MODULES_313)
                    .map_err(e)?;
                if !(16..1 << 20).contains(&off) {
                    return Err(format!(
                        "_Py_DebugOffsets.interpreter_state.imports_modules is {off}, not an offset"
                    ));
                }
                off
            }
        };
        let interp = mem
            .read_u64(self.runtime + u64::from(self.layout.runtime_interpreters_main))
            .map_err(e)?;
        if interp == 0 {
            return Ok(None);
        }
        let modules = mem.read_u64(interp + modules_off).map_err(e)?;
        if modules == 0 {
            return Ok(None);
        }
        let Some(module) = self.dict_get(modules, "asyncio.tasks").map_err(e)? else {
            return Ok(None); // asyncio not imported (yet)
        };
        let md_dict = mem.read_u64(module + MODULE_MD_DICT).map_err(e)?;
        let Some(current) = self.dict_get(md_dict, "_current_tasks").map_err(e)? else {
            return Ok(None); // module still initialising
        };
        let fields = TaskFields {
            size: fixed.task_size,
            name: fixed.task_name,
            coro: fixed.task_coro,
            context: fixed.task_name + 8,
            awaited_by: None,
            gen_frame: fixed.gen_frame,
        };
        Ok(Some((fields, Source::CurrentTasks(current), None)))
    }

    /// 3.14+: the `.AsyncioDebug` section of a mapped `_asyncio` module or
    /// of the interpreter's ELF.
    #[allow(clippy::type_complexity)]
    fn setup_debug_section(&self) -> Result<Option<(TaskFields, Source, Option<u64>)>, String> {
        let pid = self.mem.pid();
        let maps = maps::read(pid)
            .map_err(|e| format!("cannot read {}: {e}", maps::path(pid).display()))?;
        let mut seen = std::collections::HashSet::new();
        for m in maps.iter().filter(|m| m.is_file()) {
            let base = m.path.rsplit('/').next().unwrap_or("");
            let candidate = base.starts_with("_asyncio.")
                || base.starts_with("libpython")
                || base.starts_with("python");
            if !candidate || !seen.insert(m.path.clone()) {
                continue;
            }
            let Some(path) = mapped_file(pid, m) else {
                continue;
            };
            let Some(bytes) = super::discover::elf_section(&path, ".AsyncioDebug", 4096)
                .map_err(|e| e.to_string())?
            else {
                continue;
            };
            return parse_asyncio_debug(&bytes).map(|(f, running, running_loop)| {
                Some((f, Source::RunningTask(running), Some(running_loop)))
            });
        }
        Ok(None) // _asyncio not loaded yet
    }

    fn read(
        &mut self,
        tstate: Option<u64>,
        stack: &[(u64, u64)],
        captured: &Captured,
        live_innermost: &dyn Fn() -> Option<u64>,
    ) -> Result<TaskRead, PythonError> {
        let Some(fields) = self.fields else {
            return Ok(TaskRead::NoTask);
        };
        // Read with the stack: its coroutine may have run on since, so its
        // code object on the stack is check enough (against a task object
        // freed and reused meanwhile). What BPF read of the task then is
        // read in place of the live memory (the task may be gone now).
        let with_stack = captured.task != 0 && matches!(self.source, Source::RunningTask(_));
        let overlay = Overlay {
            live: &self.mem,
            reads: &captured.memory,
        };
        let mem: &dyn ReadMemory = if with_stack { &overlay } else { &*self.mem };
        let candidates: Vec<u64> = match self.source {
            Source::Pending(_) => return Ok(TaskRead::NoTask),
            Source::RunningTask(_) if with_stack => vec![captured.task],
            Source::RunningTask(off) => {
                let Some(ts) = tstate else {
                    return Ok(TaskRead::Unreadable(
                        "the thread's PyThreadState is not known".into(),
                    ));
                };
                let task = self.mem.read_u64(ts + off)?;
                if task == 0 { vec![] } else { vec![task] }
            }
            Source::CurrentTasks(dict) => self
                .dict_entries(dict, MAX_TASKS as u64)?
                .into_iter()
                .map(|(_, v)| v)
                .collect(),
        };
        if candidates.is_empty() {
            return Ok(TaskRead::NoTask);
        }
        let innermost = stack.iter().find(|f| f.0 != 0).map(|f| f.0);
        // The thread's innermost frame now, read once, when first needed.
        let mut live_frame: Option<Option<u64>> = None;
        for task in candidates {
            let t = mem.read_bytes(task, fields.size as usize)?;
            let coro = le_u64(&t, fields.coro as usize);
            let Some((frame, code, instr)) = self.coro_frame(mem, coro, fields.gen_frame)? else {
                continue;
            };
            // The coroutine body itself ran bytecode (its instruction
            // moves): the same code is not enough (tasks of one coroutine
            // function share it), its frame must be the thread's innermost
            // still. Only for a stack taken on the CPU: a thread that
            // blocked stays at its instruction while the stall lasts, so a
            // task of that code found running elsewhere in its body is
            // another's, after the stall (seen: a sleep in Task-6's body
            // named Task-8, whose own block was running by the read).
            let on_stack = stack.contains(&(code, instr))
                || (captured.on_cpu
                    && code != 0
                    && innermost == Some(code)
                    && *live_frame.get_or_insert_with(live_innermost) == Some(frame))
                || (with_stack && code != 0 && stack.iter().any(|f| f.0 == code));
            if !on_stack {
                continue;
            }
            let name = self.task_name(mem, le_u64(&t, fields.name as usize))?;
            let awaited_by = match fields.awaited_by {
                Some(_) => self.await_chain(mem, task, &t, &fields),
                None => Vec::new(),
            };
            return Ok(TaskRead::Task {
                name,
                coro_code: code,
                coro_instr: instr,
                awaited_by,
                context: le_u64(&t, fields.context as usize),
            });
        }
        Ok(TaskRead::Unverified)
    }

    /// A coroutine's frame: its address, and its code object and
    /// instruction as the BPF walk would emit them; `None` for a finished
    /// coroutine.
    fn coro_frame(
        &self,
        mem: &dyn ReadMemory,
        coro: u64,
        gen_frame: GenFrame,
    ) -> Result<Option<(u64, u64, u64)>, PythonError> {
        if coro == 0 {
            return Ok(None);
        }
        let b = &self.layout.bpf;
        let frame = match gen_frame {
            GenFrame::Pointer(off) => mem.read_u64(coro + off)?,
            GenFrame::Embedded(off) => coro + off,
        };
        if frame == 0 {
            return Ok(None);
        }
        let code = mem.read_u64(frame + u64::from(b.frame_code))? & !b.code_tag_mask;
        let instr = if b.frame_model == PY_FRAME_MODEL_FRAME_OBJECT {
            // f_lasti, an int, sign-extended as the walk does.
            mem.read_u32(frame + u64::from(b.frame_instr))? as i32 as i64 as u64
        } else {
            mem.read_u64(frame + u64::from(b.frame_instr))?
        };
        Ok(Some((frame, code, instr)))
    }

    /// `Task.get_name()`: the `str` it holds, or `Task-N` for the counter
    /// `int` 3.12+ keep until the name is asked for.
    fn task_name(&self, mem: &dyn ReadMemory, obj: u64) -> Result<String, PythonError> {
        let bad = |what| PythonError::BadData {
            pid: mem.pid(),
            what,
            addr: obj,
        };
        if obj == 0 {
            return Err(bad("task name (NULL)"));
        }
        let ty = mem.read_u64(obj + OB_TYPE)?;
        let flags = mem.read_u64(ty + TYPE_TP_FLAGS)?;
        if flags & TPFLAGS_UNICODE_SUBCLASS != 0 {
            return super::code::read_unicode(mem, &self.layout, obj);
        }
        if flags & TPFLAGS_LONG_SUBCLASS != 0 {
            let h = mem.read_bytes(obj + 16, 16)?;
            let tag = le_u64(&h, 0);
            let (digits, negative) = if self.minor >= 12 {
                (tag >> 3, tag & 3 == 2) // lv_tag: ndigits << 3 | sign
            } else {
                let size = tag as i64;
                (size.unsigned_abs(), size < 0)
            };
            if negative || digits > 2 {
                return Err(bad("task name counter (int)"));
            }
            let d0 = u64::from(u32::from_le_bytes(h[8..12].try_into().unwrap()));
            let d1 = u64::from(u32::from_le_bytes(h[12..16].try_into().unwrap()));
            let n = match digits {
                0 => 0,
                1 => d0,
                _ => d0 | d1 << 30,
            };
            return Ok(format!("Task-{n}"));
        }
        Err(bad("task name (neither str nor int)"))
    }

    /// 3.14+: the tasks awaiting `task`, nearest first, following the first
    /// awaiting task at each level; stops at a cycle, at [`MAX_AWAIT_CHAIN`],
    /// or at what cannot be read (the chain so far is kept).
    fn await_chain(
        &self,
        mem: &dyn ReadMemory,
        task: u64,
        t: &[u8],
        f: &TaskFields,
    ) -> Vec<String> {
        let Some((by_off, is_set_off, _)) = f.awaited_by else {
            return Vec::new();
        };
        let ty = le_u64(t, OB_TYPE as usize);
        let mut seen = std::collections::HashSet::from([task]);
        let mut out = Vec::new();
        let (mut by, mut is_set) = (le_u64(t, by_off as usize), t[is_set_off as usize] != 0);
        while by != 0 && out.len() < MAX_AWAIT_CHAIN {
            let next = if is_set {
                self.set_keys(mem, by).ok().and_then(|keys| {
                    keys.into_iter()
                        .find(|&k| self.is_task(mem, k, ty, f).unwrap_or(false))
                })
            } else {
                self.is_task(mem, by, ty, f).unwrap_or(false).then_some(by)
            };
            let Some(next) = next else { break };
            if !seen.insert(next) {
                crate::os::limits::hit(crate::os::limits::Limit::PythonListCycle);
                break;
            }
            let Ok(nt) = mem.read_bytes(next, f.size as usize) else {
                break;
            };
            match self.task_name(mem, le_u64(&nt, f.name as usize)) {
                Ok(n) => out.push(n),
                Err(_) => break,
            }
            by = le_u64(&nt, by_off as usize);
            is_set = nt[is_set_off as usize] != 0;
        }
        out
    }

    /// A task of the same type as the running one (`task_is_task` set): not
    /// a plain future, nor the set's dummy key.
    fn is_task(
        &self,
        mem: &dyn ReadMemory,
        obj: u64,
        ty: u64,
        f: &TaskFields,
    ) -> Result<bool, PythonError> {
        let Some((_, _, is_task_off)) = f.awaited_by else {
            return Ok(false);
        };
        if mem.read_u64(obj + OB_TYPE)? != ty {
            return Ok(false);
        }
        Ok(mem.read_u8(obj + is_task_off)? != 0)
    }

    /// Keys of a `set` (3.14 layout), at most [`MAX_AWAITERS_SET`] slots.
    fn set_keys(&self, mem: &dyn ReadMemory, set: u64) -> Result<Vec<u64>, PythonError> {
        let h = mem.read_bytes(set + SET_MASK, 16)?;
        let (mask, table) = (le_u64(&h, 0), le_u64(&h, 8));
        if mask >= MAX_AWAITERS_SET || table == 0 {
            crate::os::limits::hit(crate::os::limits::Limit::PythonListTooLong);
            return Ok(Vec::new());
        }
        let raw = mem.read_bytes(table, ((mask + 1) * 16) as usize)?;
        Ok(raw
            .chunks_exact(16)
            .map(|e| le_u64(e, 0))
            .filter(|&k| k != 0)
            .collect())
    }

    /// `(key, value)` of a combined-table dict (3.10-3.13), at most `cap`.
    fn dict_entries(&self, dict: u64, cap: u64) -> Result<Vec<(u64, u64)>, PythonError> {
        let bad = |what| PythonError::BadData {
            pid: self.mem.pid(),
            what,
            addr: dict,
        };
        let h = self.mem.read_bytes(dict + DICT_MA_KEYS, 16)?;
        let (keys, values) = (le_u64(&h, 0), le_u64(&h, 8));
        if keys == 0 || values != 0 {
            return Err(bad("dict (not a combined table)"));
        }
        Ok(dict::keys_entries(&self.mem, self.minor, keys, cap)?
            .into_iter()
            .filter(|&(k, v)| k != 0 && v != 0)
            .collect())
    }

    /// The value of the `str` key `want` in a dict.
    fn dict_get(&self, dict: u64, want: &str) -> Result<Option<u64>, PythonError> {
        // A key that cannot be read is not the one wanted.
        Ok(self
            .dict_entries(dict, MAX_DICT_ENTRIES)?
            .into_iter()
            .find(|&(k, _)| dict::ascii_eq(&self.mem, &self.layout, k, want).unwrap_or(false))
            .map(|(_, v)| v))
    }
}

/// `_Py_AsyncioModuleDebugOffsets` (13 u64s: the task object's size,
/// `task_name`, `task_awaited_by`, `task_is_task`, `task_awaited_by_is_set`,
/// `task_coro`, `task_node`; the interpreter state's size and
/// `asyncio_tasks_head`; the thread state's size, `asyncio_running_loop`,
/// `asyncio_running_task`, `asyncio_tasks_head`) -> the task fields and the
/// thread-state offset of the running task, each checked to lie inside its
/// struct.
fn parse_asyncio_debug(b: &[u8]) -> Result<(TaskFields, u64, u64), String> {
    if b.len() < 13 * 8 {
        return Err(format!(
            ".AsyncioDebug is {} bytes, want at least 104: not the layout stallprof reads",
            b.len()
        ));
    }
    let w = |i: usize| le_u64(b, 8 * i);
    let size = w(0);
    let (name, by, is_task, is_set, coro) = (w(1), w(2), w(3), w(4), w(5));
    let (ts_size, running_loop, running_task) = (w(9), w(10), w(11));
    let fits = (64..=1024).contains(&size)
        && [name, by, coro].iter().all(|&o| o >= 16 && o + 8 <= size)
        && [is_task, is_set].iter().all(|&o| o >= 16 && o < size)
        && (128..=1 << 16).contains(&ts_size)
        && running_task + 8 <= ts_size
        && running_loop + 8 <= ts_size;
    if !fits {
        return Err(format!(
            ".AsyncioDebug offsets do not fit their structs (task size {size}, \
             task_name {name}, task_coro {coro}, thread state size {ts_size}, \
             asyncio_running_task {running_task})"
        ));
    }
    Ok((
        TaskFields {
            size,
            name,
            coro,
            context: name + 8,
            awaited_by: Some((by, is_set, is_task)),
            gen_frame: GenFrame::Embedded(GI_IFRAME_314),
        },
        running_task,
        running_loop,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asyncio_debug_sections_of_debian_314_and_315_parse() {
        // `objcopy -O binary --only-section=.AsyncioDebug` of Debian's
        // _asyncio.cpython-314-x86_64-linux-gnu.so (3.14.8) and python3.15.
        let sec = |ts_size: u64, loop_: u64| -> Vec<u8> {
            [
                168,
                136,
                96,
                108,
                109,
                128,
                152,
                225864,
                10880,
                ts_size,
                loop_,
                loop_ + 8,
                loop_ + 16,
            ]
            .iter()
            .flat_map(|v: &u64| v.to_le_bytes())
            .collect()
        };
        let (f, running, running_loop) = parse_asyncio_debug(&sec(936, 864)).unwrap();
        assert_eq!(running_loop, 864);
        assert_eq!((f.size, f.name, f.coro), (168, 136, 128));
        assert_eq!(f.awaited_by, Some((96, 109, 108)));
        assert_eq!(running, 872);
        let (_, running, _) = parse_asyncio_debug(&sec(1104, 1024)).unwrap();
        assert_eq!(running, 1032);
        let mut bad = sec(936, 864);
        bad[8..16].copy_from_slice(&4000u64.to_le_bytes());
        assert!(parse_asyncio_debug(&bad).is_err());
        assert!(parse_asyncio_debug(&bad[..50]).is_err());
    }

    #[test]
    fn every_fixed_row_fits_its_task() {
        for f in FIXED {
            assert!(f.task_name + 8 <= f.task_size && f.task_coro + 8 <= f.task_size);
        }
        assert_eq!(
            FIXED.iter().map(|f| f.minor).collect::<Vec<_>>(),
            [10, 11, 12, 13]
        );
    }
}
