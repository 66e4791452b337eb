//! CPython interpreter state, read from outside the process.
//!
//! In: a pid. Out: an [`Interpreter`] (version, the [`PyOffsets`] for BPF,
//! TID -> `PyThreadState*` pairs, the GIL holder), a userspace frame walk
//! ([`Interpreter::walk_stack`]) and a [`CodeResolver`] that turns frame
//! records into qualified names, files and lines.
//!
//! Constraints: read-only and without ptrace, through `/proc/PID/maps` and
//! `/proc/PID/mem` (root or `CAP_SYS_PTRACE`); the target keeps running, so
//! every read may be stale or torn, and loops and sizes are bounded. The
//! version comes from the target's own `Py_Version` (3.11+) or its file
//! name (3.10); layouts from one table ([`offsets`], 3.10-3.12) or, for
//! 3.13+, from the interpreter's own `_Py_DebugOffsets`
//! ([`debug_offsets`], checked at attach). An unknown version is an
//! error, never a guess. A target in its own PID namespace (a container)
//! reports namespace thread ids: they are mapped to the host's through
//! `NSpid:`. x86-64 Linux with glibc only (3.10's thread mapping reads
//! glibc's `struct pthread`).

mod asgi;
mod code;
mod debug_offsets;
mod dict;
mod discover;
mod linetable;
mod loop_queues;
mod objects;
pub mod offsets;
mod otel;
mod tasks;
mod walk;

use std::collections::{HashMap, HashSet};
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use crate::os::memory::{MemoryError, ProcessMemory, ReadMemory};

pub use asgi::RouteReader;
pub use code::{CodeResolver, PyFrameInfo};
pub use discover::is_interpreter_file;
pub use linetable::{LineRange, LineTableFormat};
pub use loop_queues::QueueReader;
pub use offsets::{GilFields, Layout};
pub use otel::{SpanRead, SpanReader, TraceFound};
pub use profiler_common::python::{PY_MAX_FRAMES, PyFrame, PyOffsets};
pub use tasks::{Captured, TaskFound, TaskRead, TaskReader};

/// Interpreters per process, and thread states over all of them, followed
/// before we assume a torn or hostile list: each thread state costs two or
/// three `pread`s, so one walk costs at most about 50 000 reads.
const MAX_INTERPRETERS: usize = 256;
const MAX_THREADS: usize = 1 << 14;

/// Follows a linked list in the target from `head`, `next(node)` reading a
/// node's successor, and returns its nodes in order. It stops at a null
/// pointer, at a node already seen (the list loops: torn by a race, or
/// hostile; counted as [`Limit::PythonListCycle`]), or after `cap` nodes
/// (counted as [`Limit::PythonListTooLong`]).
///
/// [`Limit::PythonListCycle`]: crate::os::limits::Limit::PythonListCycle
/// [`Limit::PythonListTooLong`]: crate::os::limits::Limit::PythonListTooLong
pub(crate) fn follow_list<E>(
    head: u64,
    cap: usize,
    mut next: impl FnMut(u64) -> Result<u64, E>,
) -> Result<Vec<u64>, E> {
    use crate::os::limits::{Limit, hit};
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut node = head;
    while node != 0 {
        if out.len() >= cap {
            hit(Limit::PythonListTooLong);
            break;
        }
        if !seen.insert(node) {
            hit(Limit::PythonListCycle);
            break;
        }
        out.push(node);
        node = next(node)?;
    }
    Ok(out)
}

/// Why reading a Python process failed; each message names the remedy.
#[derive(Debug, thiserror::Error)]
pub enum PythonError {
    #[error("process {pid} not found: it exited, or the pid is wrong")]
    NoSuchProcess { pid: u32 },
    #[error(
        "permission denied reading {} of process {pid}{}: reading another user's process needs CAP_SYS_PTRACE (and kernel.yama.ptrace_scope below 3)",
        path.display(),
        interpreter.as_ref().map(|i| format!(" (CPython {i})")).unwrap_or_default()
    )]
    PermissionDenied {
        pid: u32,
        path: PathBuf,
        /// The interpreter found before the read was refused, as `3.11
        /// (/usr/bin/python3.11)`, when known.
        interpreter: Option<String>,
    },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot read {len} bytes at {addr:#x} in process {pid}: {source} \
         (the process exited or unmapped that memory; retry while it runs)"
    )]
    Read {
        pid: u32,
        addr: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("cannot use ELF file {}: {reason}", path.display())]
    Elf { path: PathBuf, reason: String },
    #[error(
        "unsupported Python {found}: stallprof reads CPython {supported}; \
         run the target under one of those",
        supported = SUPPORTED_DISPLAY
    )]
    Unsupported { found: String },
    #[error(
        "CPython {version} does not match stallprof's layout table at {field} \
         (table {table}, target {target}): this build is not supported yet; \
         report it with the output of `python -VV`"
    )]
    LayoutMismatch {
        version: String,
        field: &'static str,
        table: u64,
        target: u64,
    },
    #[error(
        "cannot map the Python threads of process {pid} to kernel thread ids ({detail}); \
         Python 3.10 support needs glibc on x86-64: use Python 3.11+ otherwise"
    )]
    ThreadMapping { pid: u32, detail: String },
    #[error(
        "unexpected {what} at {addr:#x} in process {pid}: it changed while we read it, \
         or the layout table is wrong for this build; retry, and report it if it persists"
    )]
    BadData {
        pid: u32,
        what: &'static str,
        addr: u64,
    },
}

/// Kept in sync with [`offsets::SUPPORTED`] by a test.
const SUPPORTED_DISPLAY: &str = "3.10, 3.11, 3.12, 3.13, 3.14 and 3.15";

/// The reader's errors, as the Python reader always named them.
impl From<MemoryError> for PythonError {
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::NoSuchProcess { pid } => PythonError::NoSuchProcess { pid },
            MemoryError::PermissionDenied { pid, path } => PythonError::PermissionDenied {
                pid,
                path,
                interpreter: None,
            },
            MemoryError::Open { path, source } => PythonError::Io { path, source },
            MemoryError::Read {
                pid,
                addr,
                len,
                source,
            } => PythonError::Read {
                pid,
                addr,
                len,
                source,
            },
        }
    }
}

impl PythonError {
    fn open(pid: u32, path: PathBuf, e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::NotFound => PythonError::NoSuchProcess { pid },
            io::ErrorKind::PermissionDenied => PythonError::PermissionDenied {
                pid,
                path,
                interpreter: None,
            },
            _ => PythonError::Io { path, source: e },
        }
    }
}

/// Addresses of the GIL's fields in the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GilAddrs {
    /// `int locked`: 1 while some thread holds the GIL.
    pub locked: u64,
    /// `PyThreadState* last_holder`: the holder while `locked` is 1.
    pub last_holder: u64,
}

/// A CPython interpreter found in a live process.
#[derive(Debug)]
pub struct Interpreter {
    pid: u32,
    path: String,
    version: (u8, u8),
    version_string: String,
    runtime: u64,
    code_type: Option<u64>,
    layout: Layout,
    mem: Arc<ProcessMemory>,
    /// The target runs in a PID namespace below ours: the thread ids it
    /// stores are that namespace's.
    own_pid_namespace: bool,
}

/// Finds the CPython interpreter in process `pid`. `Ok(None)`: not a Python
/// process (no mapped ELF exports `_PyRuntime`).
pub fn detect(pid: u32) -> Result<Option<Interpreter>, PythonError> {
    let Some(found) = discover::find(pid)? else {
        return Ok(None);
    };
    let mem = ProcessMemory::open(pid).map_err(|e| match e {
        // Say which interpreter could not be read: its version from the
        // file name when it has one (its memory is what holds Py_Version).
        MemoryError::PermissionDenied { pid, path } => PythonError::PermissionDenied {
            pid,
            path,
            interpreter: Some(match found.name_version {
                Some((major, minor)) => format!("{major}.{minor} ({})", found.path),
                None => found.path.clone(),
            }),
        },
        e => e.into(),
    })?;
    let (version, version_string) = match (found.py_version, found.name_version) {
        (Some(addr), _) => {
            // `const unsigned long Py_Version = PY_VERSION_HEX;`
            let hex = mem.read_u64(addr)? as u32;
            (
                (((hex >> 24) as u8), ((hex >> 16) & 0xff) as u8),
                offsets::hex_version(hex),
            )
        }
        (None, Some((major, minor))) => ((major, minor), format!("{major}.{minor}")),
        (None, None) => {
            return Err(PythonError::Unsupported {
                found: format!(
                    "of unknown version in {} (no Py_Version symbol, no version in the file name)",
                    found.path
                ),
            });
        }
    };
    let unsupported = || PythonError::Unsupported {
        found: format!("{version_string} ({})", found.path),
    };
    let layout = match (version, found.py_version) {
        ((3, minor), Some(addr)) if minor >= 13 => {
            let hex = mem.read_u64(addr)? as u32;
            if !debug_offsets::minors().any(|m| m == minor) {
                return Err(unsupported());
            }
            let buf = mem.read_bytes(found.runtime, debug_offsets::READ_LEN)?;
            debug_offsets::layout(&buf, hex)?
        }
        _ => offsets::layout(version.0, version.1).ok_or_else(unsupported)?,
    };
    log::debug!(
        "pid {pid}: CPython {version_string} in {}, _PyRuntime at {:#x}",
        found.path,
        found.runtime
    );
    Ok(Some(Interpreter {
        pid,
        path: found.path,
        version,
        version_string,
        runtime: found.runtime,
        code_type: found.code_type,
        layout,
        mem: Arc::new(mem),
        own_pid_namespace: ns_depth(&format!("/proc/{pid}/status")) > ns_depth("/proc/self/status"),
    }))
}

/// Number of PID namespaces a process is seen in from ours (`NSpid:` fields).
fn ns_depth(status_path: &str) -> usize {
    crate::os::limits::read_proc(status_path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .map(|l| l.split_whitespace().count())
        })
        .unwrap_or(1)
}

impl Interpreter {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// `(major, minor)`, e.g. `(3, 12)`.
    pub fn version(&self) -> (u8, u8) {
        self.version
    }

    /// Full version when the target says it (`3.11.7`), else `3.10`.
    pub fn version_string(&self) -> &str {
        &self.version_string
    }

    /// The ELF (libpython or the executable) that holds the interpreter.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What BPF needs to walk frames of this interpreter.
    pub fn offsets(&self) -> PyOffsets {
        self.layout.bpf
    }

    /// The full layout row (userspace offsets included).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Address of `_PyRuntime` in the target.
    pub fn runtime_addr(&self) -> u64 {
        self.runtime
    }

    pub fn memory(&self) -> &ProcessMemory {
        &self.mem
    }

    /// `(TID, PyThreadState*)` of every live thread, one thread state each.
    /// Call again as threads come and go.
    ///
    /// A thread may own several thread states at once, and then the oldest
    /// is its own: CPython 3.10 and 3.11 create a new thread's state in the
    /// thread that starts it, stamped with the *starter's* ids and pushed
    /// at the head of the list, until the new thread runs and stamps its
    /// own (under load, milliseconds); `PyThreadState_New` called by an
    /// extension on a thread that has a state adds another, never run. The
    /// list runs newest first, interpreters too, so the last state seen for
    /// a thread is kept. (Keeping any other once read a service's loop
    /// through a started thread's state: no route and no loop queues for
    /// a whole recording; CI, 2026-12-05.)
    pub fn thread_states(&self) -> Result<Vec<(u32, u64)>, PythonError> {
        let l = &self.layout;
        let mem = &self.mem;
        let live = self.live_tids()?;
        let (mut seen, mut unmapped) = (0usize, Vec::new());
        // Thread -> its state; a later (older) state of a thread replaces.
        let mut own: HashMap<u32, u64> = HashMap::new();
        let mut shadowed = 0usize;
        let head = mem.read_u64(self.runtime + u64::from(l.runtime_interpreters_head))?;
        let interps = follow_list(head, MAX_INTERPRETERS, |i| {
            mem.read_u64(i + u64::from(l.interp_next))
        })?;
        for interp in interps {
            let head = mem.read_u64(interp + u64::from(l.interp_threads_head))?;
            let states = follow_list(head, MAX_THREADS - seen, |ts| {
                mem.read_u64(ts + u64::from(l.tstate_next))
            })?;
            for ts in states {
                seen += 1;
                let tid = self.tid_of(ts)?;
                if let Some(&host_tid) = live.get(&tid) {
                    if own.insert(host_tid, ts).is_some() {
                        shadowed += 1;
                    }
                } else {
                    unmapped.push(tid); // exited thread, or a wrong mapping (checked below)
                }
            }
            if seen >= MAX_THREADS {
                break;
            }
        }
        if shadowed > 0 {
            log::trace!(
                "pid {}: {shadowed} newer thread state(s) share a thread with an older one \
                 (a thread being started, or an extension's extra state): the oldest kept",
                self.pid
            );
        }
        if seen > 0 && own.is_empty() {
            return Err(PythonError::ThreadMapping {
                pid: self.pid,
                detail: format!(
                    "{seen} thread states, none maps to a live task; got tids {unmapped:?}"
                ),
            });
        }
        Ok(own.into_iter().collect())
    }

    /// The TID of the thread owning a thread state.
    fn tid_of(&self, tstate: u64) -> Result<u32, PythonError> {
        let l = &self.layout;
        match l.tstate_native_thread_id {
            Some(off) => Ok(self.mem.read_u64(tstate + u64::from(off))? as u32),
            None => {
                // 3.10: thread_id is the pthread_t, i.e. glibc's struct pthread*.
                let pthread = self.mem.read_u64(tstate + u64::from(l.tstate_thread_id))?;
                if pthread == 0 {
                    return Ok(0);
                }
                Ok(self.mem.read_u32(pthread + offsets::GLIBC_PTHREAD_TID)?)
            }
        }
    }

    /// Live threads: the tid the interpreter stores (its own namespace's)
    /// -> the host's.
    fn live_tids(&self) -> Result<HashMap<u32, u32>, PythonError> {
        let dir = PathBuf::from(format!("/proc/{}/task", self.pid));
        let entries =
            std::fs::read_dir(&dir).map_err(|e| PythonError::open(self.pid, dir.clone(), e))?;
        let host = entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok());
        if !self.own_pid_namespace {
            return Ok(host.map(|t| (t, t)).collect());
        }
        Ok(host
            .map(|t| (crate::os::proc::namespace_id(self.pid, t), t))
            .collect())
    }

    /// Where the GIL of the main interpreter lives. 3.10/3.11 keep it in
    /// `_PyRuntime.ceval.gil`; 3.12+ in `*interp->ceval.gil`, read now (it is
    /// set once at interpreter start).
    pub fn gil_addrs(&self) -> Result<GilAddrs, PythonError> {
        let l = &self.layout;
        let (base, fields) = match (l.runtime_gil, l.interp_gil_ptr) {
            (Some(f), _) => (self.runtime, f),
            (None, Some((ptr_off, f))) => {
                let interp = self
                    .mem
                    .read_u64(self.runtime + u64::from(l.runtime_interpreters_main))?;
                if interp == 0 {
                    return Err(self.bad(
                        "main interpreter pointer (interpreter not initialised)",
                        self.runtime,
                    ));
                }
                let at = interp
                    .checked_add(u64::from(ptr_off))
                    .ok_or_else(|| self.bad("main interpreter pointer", interp))?;
                let gil = self.mem.read_u64(at)?;
                if gil == 0 {
                    return Err(self.bad("GIL pointer (interp->ceval.gil)", interp));
                }
                (gil, f)
            }
            (None, None) => unreachable!("every layout row locates the GIL"),
        };
        // Pointers the target wrote: an address past the end is a bad read.
        let field = |off: u32| {
            base.checked_add(u64::from(off))
                .ok_or_else(|| self.bad("GIL pointer (interp->ceval.gil)", base))
        };
        Ok(GilAddrs {
            locked: field(fields.locked)?,
            last_holder: field(fields.last_holder)?,
        })
    }

    /// The `PyThreadState*` holding the GIL now, `None` if it is free.
    pub fn gil_holder(&self) -> Result<Option<u64>, PythonError> {
        let a = self.gil_addrs()?;
        if self.mem.read_u32(a.locked)? == 0 {
            return Ok(None);
        }
        Ok(Some(self.mem.read_u64(a.last_holder)?).filter(|&t| t != 0))
    }

    /// The frames of a thread state, newest first, as BPF would record them.
    pub fn walk_stack(&self, tstate: u64) -> Result<Vec<PyFrame>, PythonError> {
        walk::walk_stack(&self.mem, &self.layout.bpf, tstate)
    }

    /// A reader of the running asyncio task of this process's threads
    /// (keep it: it finds asyncio once).
    pub fn task_reader(&self) -> TaskReader {
        TaskReader::new(Arc::clone(&self.mem), self.layout, self.runtime)
    }

    /// A reader of the ASGI request (method, route) its threads serve
    /// (keep it: it caches code objects' `scope` slots).
    pub fn queue_reader(&self) -> QueueReader {
        QueueReader::new(Arc::clone(&self.mem), self.layout)
    }

    pub fn route_reader(&self) -> RouteReader {
        RouteReader::new(Arc::clone(&self.mem), self.layout)
    }

    /// A reader of the OpenTelemetry span in a task's context.
    pub fn span_reader(&self) -> SpanReader {
        SpanReader::new(Arc::clone(&self.mem), self.layout)
    }

    /// A resolver for frames of this process (keep it: it caches).
    pub fn code_resolver(&self) -> CodeResolver {
        CodeResolver::new(Arc::clone(&self.mem), self.layout, self.code_type)
    }

    fn bad(&self, what: &'static str, addr: u64) -> PythonError {
        PythonError::BadData {
            pid: self.pid,
            what,
            addr,
        }
    }
}

/// Fuzzing ([`crate::fuzzing`]): `table` decoded as a 3.10 and as a 3.11+
/// line table, and the line of a few addresses looked up; the ranges found.
pub(crate) fn fuzz_line_table(table: &[u8], first_line: u32, addrs: &[u32]) -> usize {
    let mut n = 0;
    for format in [LineTableFormat::Pep626, LineTableFormat::Locations] {
        let ranges = linetable::decode(format, table, first_line);
        for &a in addrs {
            let _ = linetable::line_near(&ranges, a);
        }
        n += ranges.len();
    }
    n
}

/// Fuzzing: `buf` as the `_Py_DebugOffsets` block a 3.13+ interpreter
/// holds, for each supported minor version.
pub(crate) fn fuzz_debug_offsets(buf: &[u8]) {
    for minor in debug_offsets::minors() {
        let hex = (3 << 24) | (u32::from(minor) << 16);
        let _ = debug_offsets::layout(buf, hex);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_names_found_and_supported_versions() {
        let msg = PythonError::Unsupported {
            found: "3.9.18 (/usr/lib/libpython3.9.so)".into(),
        }
        .to_string();
        assert!(msg.contains("3.9.18"), "{msg}");
        for (major, minor) in offsets::SUPPORTED {
            assert!(
                msg.contains(&format!("{major}.{minor}")),
                "{msg} lacks {major}.{minor}"
            );
        }
    }

    #[test]
    fn not_python_is_none() {
        // This test binary is a Rust program without libpython.
        assert!(detect(std::process::id()).unwrap().is_none());
    }

    /// A fake target memory: `tstate -> tstate->next`.
    fn fake_next(links: &[(u64, u64)]) -> impl FnMut(u64) -> Result<u64, PythonError> + '_ {
        |node| {
            links
                .iter()
                .find(|l| l.0 == node)
                .map(|l| l.1)
                .ok_or(PythonError::NoSuchProcess { pid: 0 })
        }
    }

    fn count(name: &str) -> u64 {
        crate::os::limits::counts()
            .into_iter()
            .find(|c| c.0 == name)
            .unwrap()
            .1
    }

    #[test]
    fn thread_list_cycles_stop_and_are_counted() {
        let cycles = count("limit_python_list_cycle");
        // tstate->next points at itself.
        let own = follow_list(0x100, MAX_THREADS, fake_next(&[(0x100, 0x100)])).unwrap();
        assert_eq!(own, [0x100]);
        // 0x100 -> 0x200 -> 0x300 -> back to 0x200.
        let links = [(0x100, 0x200), (0x200, 0x300), (0x300, 0x200)];
        let back = follow_list(0x100, MAX_THREADS, fake_next(&links)).unwrap();
        assert_eq!(back, [0x100, 0x200, 0x300]);
        assert!(count("limit_python_list_cycle") >= cycles + 2);
        // A proper list ends at null, uncounted.
        let links = [(0x100, 0x200), (0x200, 0)];
        assert_eq!(
            follow_list(0x100, 4, fake_next(&links)).unwrap(),
            [0x100, 0x200]
        );
        assert_eq!(
            follow_list(0, 4, fake_next(&links)).unwrap(),
            Vec::<u64>::new()
        );
    }

    #[test]
    fn thread_list_too_long_stops_at_the_cap() {
        let long = count("limit_python_list_too_long");
        // An endless list of distinct nodes (each points at the next).
        let nodes = follow_list(8, 1000, |n| Ok::<_, PythonError>(n + 8)).unwrap();
        assert_eq!(nodes.len(), 1000);
        assert!(count("limit_python_list_too_long") > long);
        // A read error ends the walk with the error.
        assert!(follow_list(0x100, 4, fake_next(&[])).is_err());
    }

    #[test]
    fn missing_process_names_the_pid() {
        let err = detect(u32::MAX - 1).unwrap_err();
        assert!(matches!(err, PythonError::NoSuchProcess { .. }), "{err}");
    }
}
