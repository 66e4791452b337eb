//! The threads and processes stalls are told about: read once each from
//! `/proc` (a thread's name and its id in its PID namespace, a process's
//! namespace pid and container) the first time the engine sees them.
//!
//! In: host ids, and whether the target is live (a replay has no `/proc`
//! to read: threads are named as the recording saw them, or "replayed").
//! Out: [`ThreadInfo`]s and [`ProcessInfo`]s, kept until the process is
//! forgotten (the daemon's churn must not grow these tables).
use std::collections::HashMap;

use crate::{
    model::{ProcessInfo, ThreadInfo},
    os::proc::{read_comm, read_namespace_id},
};

#[derive(Default)]
pub struct Identities {
    /// Every thread seen, by tid.
    threads: HashMap<u32, ThreadInfo>,
    /// Every process seen, by pid.
    procs: HashMap<u32, ProcessInfo>,
}

impl Identities {
    /// Threads as a live recording saw them (a replay's names).
    pub fn named(threads: &[ThreadInfo]) -> Identities {
        Identities {
            threads: threads.iter().map(|t| (t.tid, t.clone())).collect(),
            procs: HashMap::new(),
        }
    }

    /// Thread `tid` of `tgid`, read from `/proc` when `live` and first seen.
    pub fn thread(&mut self, tgid: u32, tid: u32, live: bool) -> ThreadInfo {
        if let Some(t) = self.threads.get(&tid) {
            return t.clone();
        }
        let t = if live {
            ThreadInfo {
                tid,
                name: read_comm(tgid, tid).unwrap_or_else(|| "?".into()),
                ns_tid: read_namespace_id(tgid, tid).filter(|&ns| ns != tid),
            }
        } else {
            ThreadInfo {
                tid,
                name: "replayed".into(),
                ns_tid: None,
            }
        };
        self.threads.insert(tid, t.clone());
        t
    }

    /// Thread `tid` if it was seen ("?" if not), without reading.
    pub fn known_thread(&self, tid: u32) -> ThreadInfo {
        self.threads.get(&tid).cloned().unwrap_or(ThreadInfo {
            tid,
            name: "?".into(),
            ns_tid: None,
        })
    }

    /// Process `pid`, read from `/proc` when `live` and first seen
    /// (nothing in a replay).
    pub fn process(&mut self, pid: u32, live: bool) -> ProcessInfo {
        if let Some(p) = self.procs.get(&pid) {
            return p.clone();
        }
        let p = if live {
            ProcessInfo {
                ns_pid: read_namespace_id(pid, pid).filter(|&ns| ns != pid),
                container: crate::os::container::of_process(pid),
            }
        } else {
            ProcessInfo::default()
        };
        self.procs.insert(pid, p.clone());
        p
    }

    pub fn forget_thread(&mut self, tid: u32) {
        self.threads.remove(&tid);
    }

    pub fn forget_process(&mut self, pid: u32) {
        self.procs.remove(&pid);
    }
}
