//! What the engine keeps per watched process about its runtime, between
//! the discovery thread's answers and the kernel side (through
//! [`Control`]): a CPython interpreter's offsets and thread states
//! ([`PythonWatch`]), and the probes on a process's waits and on its
//! runtime's park functions ([`RuntimeWatch`]). The engine polls them at
//! each upkeep and hands them what discovery found.
use std::{collections::HashMap, fs, path::PathBuf};

use log::{debug, info, warn};
use profiler_common::{PyProc, python::TaskLayout};

use crate::{
    kernel::runtimes::ParkPoint,
    model::RuntimeProblem,
    os::proc::{is_own_fork, process_alive},
    pipeline::control::Control,
    pipeline::discovery::{Ask, Discovery},
    symbolize::python::{Interpreter, PythonError},
};

/// Keeps BPF's view of one process's CPython current: interpreter offsets
/// once found, and the thread -> `PyThreadState*` table as threads come and
/// go. Detection is retried (a launched command execs its interpreter after
/// attach), every tick for the first 5 s, then every 5 s.
///
/// Never silent: an interpreter that is there but cannot be read (a version
/// or build stallprof does not read, offsets that fail the check, memory or
/// threads it cannot read) is kept as a [`RuntimeProblem`] for the
/// recording, and its stall records keep their native frames.
pub(super) struct PythonWatch {
    pub(super) interp: Option<Interpreter>,
    pub(super) known: HashMap<u32, u64>,
    attempts: u32,
    given_up: bool,
    /// The latest reason Python frames are unavailable (cleared once they
    /// are): a refusal at once, a failure that may pass after it persisted.
    pub(super) problem: Option<RuntimeProblem>,
    /// Consecutive failed attempts of the same kind (detection or threads).
    failures: u32,
    /// What BPF was told about this process (`PY_PROCS`), once found.
    bpf: Option<PyProc>,
    /// Polls since the interpreter was found without its GIL.
    gil_misses: u32,
}

/// Failed attempts in a row after which a failure that may be transient
/// (a read racing with the target's start) is reported as a problem.
const PYTHON_FAILURES_REPORTED: u32 = 8;
/// Polls of an interpreter found without its GIL (3.12+ before it made
/// it) after which that is logged as a warning.
const GIL_MISSES_REPORTED: u32 = 8;

/// The problem to report for a failed read of `pid`'s interpreter: what it
/// costs, why, and what the user can do.
pub(super) fn python_problem(pid: u32, runtime: Option<&str>, e: &PythonError) -> RuntimeProblem {
    let runtime = match (runtime, e) {
        (Some(r), _) => format!("cpython {r}"),
        (None, PythonError::Unsupported { found }) => {
            format!("cpython {}", found.split(' ').next().unwrap_or(found))
        }
        (None, PythonError::LayoutMismatch { version, .. }) => format!("cpython {version}"),
        (
            None,
            PythonError::PermissionDenied {
                interpreter: Some(i),
                ..
            },
        ) if i.starts_with(|c: char| c.is_ascii_digit()) => {
            format!("cpython {}", i.split(' ').next().unwrap_or(i))
        }
        _ => "cpython".into(),
    };
    let remedy = match e {
        PythonError::Unsupported { found } if found.contains("free-threaded") => {
            "run the service on the GIL build of its CPython (python3.X, not python3.Xt); \
             stallprof does not read free-threaded interpreters"
                .to_string()
        }
        PythonError::Unsupported { .. } => {
            "run the service on CPython 3.10-3.15, or report the version with `python -VV`".into()
        }
        PythonError::LayoutMismatch { .. } | PythonError::BadData { .. } => {
            "report it with the output of `python -VV`; stalls are still measured".into()
        }
        PythonError::PermissionDenied { .. } => {
            "grant stallprof CAP_SYS_PTRACE (root without it, as in a container's default \
             capability set, may not read another user's process; setcap, systemd's \
             CapabilityBoundingSet or the pod's capabilities.add), and keep \
             kernel.yama.ptrace_scope below 3"
                .into()
        }
        PythonError::ThreadMapping { .. } => {
            "report it with the output of `python -VV` and /proc/PID/status; \
             stalls are still measured"
                .into()
        }
        _ => "retry while the target runs; report it if it persists".into(),
    };
    RuntimeProblem {
        pid,
        runtime,
        what: "Python frames unavailable: stalls show native frames only".into(),
        why: e.to_string(),
        remedy,
    }
}

impl PythonWatch {
    pub(super) fn new() -> Self {
        PythonWatch {
            interp: None,
            known: HashMap::new(),
            attempts: 0,
            given_up: false,
            problem: None,
            failures: 0,
            bpf: None,
            gil_misses: 0,
        }
    }

    /// 3.14+: BPF reads the running asyncio task with every stack from now
    /// (`PyProc::running_task`, and its parts: `PyProc::task`), once a task
    /// read found where it is.
    pub(super) fn read_tasks_in_kernel(
        &mut self,
        pid: u32,
        (offset, layout): (u64, TaskLayout),
        probes: &mut dyn Control,
    ) {
        if let Some(p) = self.bpf.as_mut()
            && (p.running_task, p.task) != (offset, layout)
        {
            p.running_task = offset;
            p.task = layout;
            probes.set_python_proc(pid, *p);
            debug!("pid {pid}: the running asyncio task is read with each stack");
        }
    }

    /// A failed attempt: a refusal is reported at once, anything else once
    /// it persisted.
    pub(super) fn failed(&mut self, pid: u32, e: &PythonError, refused: bool) {
        self.failures += 1;
        if self.problem.is_none() && (refused || self.failures >= PYTHON_FAILURES_REPORTED) {
            let runtime = self.interp.as_ref().map(|i| i.version_string().to_string());
            let p = python_problem(pid, runtime.as_deref(), e);
            warn!("pid {pid}: {}: {} ({})", p.what, p.why, p.remedy);
            self.problem = Some(p);
        } else if let Some(p) = &mut self.problem {
            p.why = e.to_string();
        }
    }

    /// Ask for `pid`'s interpreter (on the discovery thread) when due;
    /// then, once known, its threads.
    pub(super) fn poll(&mut self, pid: u32, probes: &mut dyn Control, discovery: &mut Discovery) {
        if self.interp.is_none()
            && !self.given_up
            && !is_own_fork(pid)
            && !discovery.is_open(Ask::Python(pid))
        {
            self.attempts += 1;
            if (self.attempts <= 20 || self.attempts.is_multiple_of(20))
                && !discovery.ask(Ask::Python(pid))
            {
                // The queue is full: this attempt comes again.
                self.attempts -= 1;
            }
        }
        self.gil_again(pid, probes);
        self.threads(pid, probes);
    }

    /// A 3.12+ interpreter found before it made its GIL (`interp->ceval.gil`
    /// still NULL: discovery can land in the first milliseconds of a
    /// command's start): look again at each poll, and tell the probes once
    /// it is there. Two reads of the target's memory a poll until then.
    pub(super) fn gil_again(&mut self, pid: u32, probes: &mut dyn Control) {
        let (Some(interp), Some(bpf)) = (&self.interp, self.bpf.as_mut()) else {
            return;
        };
        if bpf.gil_locked != 0 {
            return;
        }
        match interp.gil_addrs() {
            Ok(g) => {
                bpf.gil_locked = g.locked;
                bpf.gil_last_holder = g.last_holder;
                probes.set_python_proc(pid, *bpf);
                debug!("pid {pid}: GIL found; GIL waits are told apart from now on");
            }
            Err(e) => {
                self.gil_misses += 1;
                if self.gil_misses == GIL_MISSES_REPORTED {
                    warn!(
                        "pid {pid}: GIL not found ({e}); GIL waits show as plain off-CPU time \
                         until it is (looking again at each upkeep)"
                    );
                }
            }
        }
    }

    /// The discovery thread's answer for `pid`'s interpreter.
    pub(super) fn found(
        &mut self,
        pid: u32,
        found: Result<Option<Interpreter>, PythonError>,
        probes: &mut dyn Control,
    ) {
        if self.interp.is_some() {
            return;
        }
        match found {
            Ok(Some(interp)) => {
                let gil = interp.gil_addrs();
                if let Err(e) = &gil {
                    debug!("pid {pid}: GIL not found yet ({e}); looking again at each upkeep");
                }
                let gil = gil.ok();
                let proc_ = PyProc {
                    offsets: interp.offsets(),
                    gil_locked: gil.map_or(0, |g| g.locked),
                    gil_last_holder: gil.map_or(0, |g| g.last_holder),
                    running_task: 0,
                    task: TaskLayout::default(),
                };
                info!(
                    "pid {pid}: CPython {} ({}); Python stacks on",
                    interp.version_string(),
                    interp.path()
                );
                probes.set_python_proc(pid, proc_);
                self.bpf = Some(proc_);
                self.interp = Some(interp);
                self.failures = 0;
                self.problem = None;
            }
            Ok(None) => {}
            Err(e) => {
                debug!("python detection in {pid}: {e}");
                let refused = matches!(
                    e,
                    PythonError::Unsupported { .. }
                        | PythonError::LayoutMismatch { .. }
                        | PythonError::PermissionDenied { .. }
                );
                self.given_up = refused;
                self.failed(pid, &e, refused);
            }
        }
        self.threads(pid, probes);
    }

    /// Tell the probes which thread states are which threads.
    pub(super) fn threads(&mut self, pid: u32, probes: &mut dyn Control) {
        let Some(interp) = &self.interp else { return };
        match interp.thread_states() {
            Ok(now) => {
                let now: HashMap<u32, u64> = now.into_iter().collect();
                let fresh: Vec<(u32, u64)> = now
                    .iter()
                    .filter(|(t, s)| self.known.get(t) != Some(s))
                    .map(|(&t, &s)| (t, s))
                    .collect();
                let gone: Vec<u32> = self
                    .known
                    .keys()
                    .filter(|t| !now.contains_key(t))
                    .copied()
                    .collect();
                if !fresh.is_empty() || !gone.is_empty() {
                    probes.set_python_threads(&fresh, &gone);
                }
                self.known = now;
                self.failures = 0;
                self.problem = None;
            }
            Err(e) => {
                debug!("python thread states of {pid}: {e}");
                if self.known.is_empty() {
                    let refused = matches!(e, PythonError::ThreadMapping { .. });
                    self.failed(pid, &e, refused);
                }
            }
        }
    }

    pub(super) fn version(&self) -> Option<String> {
        self.interp.as_ref().map(|i| i.version_string().to_string())
    }
}

/// Finds a process's runtime park functions (tokio) and puts uprobes on
/// them, retried for the first seconds (a launched command execs after
/// attach; a runtime may be loaded late).
#[derive(Default)]
pub(super) struct RuntimeWatch {
    attempts: u32,
    done: bool,
    scanned_exe: Option<PathBuf>,
    /// The image whose wait functions were probed.
    waits_exe: Option<PathBuf>,
    /// Looks at an image that mapped no wait function yet.
    waits_tries: u32,
}

/// Upkeeps (50 ms apart at first) before a process that maps no wait
/// function is given the syscall tracepoints.
const WAITS_TRIES: u32 = 20;

impl RuntimeWatch {
    pub(super) fn poll(&mut self, pid: u32, probes: &mut dyn Control, discovery: &mut Discovery) {
        // The loop's waits, once per executable image (a launched command
        // is still our own fork until it execs).
        if !is_own_fork(pid) && process_alive(pid) {
            // An image we may not read (another user's process without
            // CAP_SYS_PTRACE) is looked at once too: its waits then need
            // the fallback, which does not read the process.
            let exe = Some(
                fs::read_link(format!("/proc/{pid}/exe"))
                    .unwrap_or_else(|_| PathBuf::from("[unreadable]")),
            );
            if exe != self.waits_exe {
                self.waits_tries += 1;
                if probes.watch_waits(pid, self.waits_tries >= WAITS_TRIES) {
                    self.waits_exe = exe;
                    self.waits_tries = 0;
                }
            }
        }
        if self.done || discovery.is_open(Ask::Tokio(pid)) {
            return;
        }
        // Scan once per executable image: a launched command is still our
        // own fork until it execs.
        let exe = crate::os::proc::exe(pid);
        if is_own_fork(pid) || exe == self.scanned_exe {
            self.attempts += 1;
            // Libraries loaded later (dlopen) get a look now and then.
            if !self.attempts.is_multiple_of(40) || self.scanned_exe.is_none() {
                return;
            }
        }
        if discovery.ask(Ask::Tokio(pid)) {
            self.scanned_exe = exe;
        }
    }

    /// The discovery thread's answer: tokio's park functions in `pid`'s
    /// files, probed for `pid` only.
    pub(super) fn found(&mut self, pid: u32, points: &[ParkPoint], probes: &mut dyn Control) {
        for p in points {
            match probes.attach_park(p, Some(pid)) {
                Ok(()) => self.done = true,
                Err(e) => warn!(
                    "pid {pid}: tokio park probes unavailable, its workers are tracked by epoll only: {e}"
                ),
            }
        }
        if !points.is_empty() {
            self.done = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_interpreters_are_said_plainly() {
        let p = python_problem(
            7,
            None,
            &PythonError::Unsupported {
                found: "3.16.0 (/usr/bin/python3.16)".into(),
            },
        );
        assert_eq!((p.pid, p.runtime.as_str()), (7, "cpython 3.16.0"));
        assert!(p.what.contains("native frames only"), "{p:?}");
        assert!(p.why.contains("3.16.0") && p.why.contains("3.15"), "{p:?}");
        assert!(p.remedy.contains("3.10-3.15"), "{p:?}");
        let ft = python_problem(
            7,
            None,
            &PythonError::Unsupported {
                found: "3.14.0 (free-threaded build)".into(),
            },
        );
        assert!(ft.remedy.contains("GIL build"), "{ft:?}");
        let read = python_problem(
            7,
            Some("3.14.8"),
            &PythonError::ThreadMapping {
                pid: 7,
                detail: "none maps".into(),
            },
        );
        assert_eq!(read.runtime, "cpython 3.14.8");
        let denied = python_problem(
            7,
            None,
            &PythonError::PermissionDenied {
                pid: 7,
                path: "/proc/7/mem".into(),
                interpreter: Some("3.11 (/usr/bin/python3.11)".into()),
            },
        );
        assert_eq!(denied.runtime, "cpython 3.11");
        assert!(denied.why.contains("/usr/bin/python3.11"), "{denied:?}");
        assert!(denied.remedy.contains("CAP_SYS_PTRACE"), "{denied:?}");
    }
}
