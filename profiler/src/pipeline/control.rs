//! The kernel control port: the one interface through which the engine
//! (and `watch`, on its behalf) feeds its decisions back to the
//! BPF side — loop keys, Python thread states, park and wait probes.
//!
//! In: the engine's decisions. Out: map writes and attaches, done by
//! [`Probes`]. A replay has no kernel to tell: [`NoControl`] takes every
//! call and does nothing, so it runs the very same engine code. Knows no
//! other pipeline module (they all point here).
use profiler_common::PyProc;

use crate::kernel::{
    probe::{ProbeError, Probes},
    runtimes::ParkPoint,
};

/// Everything the engine tells the kernel side. The probes implement it;
/// a replay has no kernel to tell ([`NoControl`]).
pub trait Control {
    /// `tid`'s loop wait is `key` (`LOOP_KEYS`).
    fn set_loop_key(&mut self, tid: u32, key: u64);
    /// `tid` is no loop thread any more (exited).
    fn forget_loop_thread(&mut self, tid: u32);
    /// How to walk process `tgid`'s Python stacks.
    fn set_python_proc(&mut self, tgid: u32, p: PyProc);
    /// Process `tgid` (with Python threads `tids`) is gone.
    fn forget_python_proc(&mut self, tgid: u32, tids: &[u32]);
    /// Thread -> `PyThreadState*` updates.
    fn set_python_threads(&mut self, fresh: &[(u32, u64)], gone: &[u32]);
    /// A runtime's park function, for one process or all.
    fn attach_park(&mut self, point: &ParkPoint, pid: Option<u32>) -> Result<(), ProbeError>;
    /// Watch process `pid`'s loop waits (uprobes on its wait functions):
    /// false while it maps none yet; `last_try` falls back.
    fn watch_waits(&mut self, pid: u32, last_try: bool) -> bool;
}

impl Control for Probes {
    fn set_loop_key(&mut self, tid: u32, key: u64) {
        Probes::set_loop_key(self, tid, key)
    }
    fn forget_loop_thread(&mut self, tid: u32) {
        Probes::forget_loop_thread(self, tid)
    }
    fn set_python_proc(&mut self, tgid: u32, p: PyProc) {
        Probes::set_python_proc(self, tgid, p)
    }
    fn forget_python_proc(&mut self, tgid: u32, tids: &[u32]) {
        Probes::forget_python_proc(self, tgid, tids)
    }
    fn set_python_threads(&mut self, fresh: &[(u32, u64)], gone: &[u32]) {
        Probes::set_python_threads(self, fresh, gone)
    }
    fn attach_park(&mut self, point: &ParkPoint, pid: Option<u32>) -> Result<(), ProbeError> {
        Probes::attach_park(self, point, pid)
    }
    fn watch_waits(&mut self, pid: u32, last_try: bool) -> bool {
        Probes::watch_waits(self, pid, last_try)
    }
}

/// The control of a replay, and of a live engine's last drain after the
/// probes are gone: nothing to tell.
pub struct NoControl;

impl Control for NoControl {
    fn set_loop_key(&mut self, _: u32, _: u64) {}
    fn forget_loop_thread(&mut self, _: u32) {}
    fn set_python_proc(&mut self, _: u32, _: PyProc) {}
    fn forget_python_proc(&mut self, _: u32, _: &[u32]) {}
    fn set_python_threads(&mut self, _: &[(u32, u64)], _: &[u32]) {}
    fn watch_waits(&mut self, _: u32, _: bool) -> bool {
        true
    }
    fn attach_park(&mut self, _: &ParkPoint, _: Option<u32>) -> Result<(), ProbeError> {
        Ok(())
    }
}
