//! Stalls held back before symbolization, for names not written yet: a JIT
//! runtime writes its perf map through a buffer (code compiled just before
//! the stall may not be named in the file yet), and JavaScript frames
//! whose bytecode is not known yet may be named by a later request.
//!
//! In: prepared [`Job`]s. Out: the jobs due ([`JIT_NAME_DELAY`] after
//! they came), of a process that is gone, or pushed out by the cap.
use std::time::{Duration, Instant};

use crate::pipeline::symbolizer::Job;

/// How long a held-back stall waits before symbolization.
const JIT_NAME_DELAY: Duration = Duration::from_secs(2);
/// Stalls held back at most; past it the oldest goes now.
const MAX_PENDING: usize = 64;

#[derive(Default)]
pub struct Pending(Vec<(Instant, Box<Job>)>);

impl Pending {
    /// Hold `job` back (marked to refresh its process's names); the oldest
    /// job if the cap pushed it out, to symbolize now.
    pub fn hold(&mut self, mut job: Box<Job>) -> Option<Box<Job>> {
        let oldest = (self.0.len() >= MAX_PENDING).then(|| self.0.remove(0).1);
        job.refresh = true;
        self.0.push((Instant::now() + JIT_NAME_DELAY, job));
        oldest
    }

    /// The jobs due now (all of them with `all`), in order.
    pub fn due(&mut self, all: bool) -> impl Iterator<Item = Box<Job>> + use<> {
        let now = Instant::now();
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|p| all || p.0 <= now);
        self.0 = keep;
        due.into_iter().map(|(_, j)| j)
    }

    /// The jobs of process `pid`, in order.
    pub fn take_process(&mut self, pid: u32) -> impl Iterator<Item = Box<Job>> + use<> {
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|p| p.1.raw.tgid == pid);
        self.0 = others;
        mine.into_iter().map(|(_, j)| j)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
