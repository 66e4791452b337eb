//! Finding a process's runtimes off the drain thread.
//!
//! In: questions about a process ([`Ask`]): which CPython interpreter it
//! runs, which tokio park functions its files define. Out: their answers
//! ([`Answer`]), taken by the engine between drains and applied there (it
//! owns the probes). Each answer reads the process's ELF files' symbol
//! tables: tens of ms for a libpython, ~0.2 s for Node's executable (for
//! nothing: it has neither), seconds on a loaded machine. On the drain
//! thread that held the ring buffer while the target filled it.
//!
//! One worker thread, behind a bounded queue ([`QUEUE`]): a question that
//! does not fit is asked again at the next upkeep tick. A question already
//! asked and not yet answered is not asked twice. Without a thread (spawn
//! refused), questions are answered inline, as before.

use std::{
    collections::HashSet,
    sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, channel, sync_channel},
    time::{Duration, Instant},
};

use crate::{
    kernel::runtimes::{self, ParkPoint},
    symbolize::python::{self, Interpreter, PythonError},
};

/// Questions waiting for the worker at most.
const QUEUE: usize = 64;

/// A question about process `pid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ask {
    /// Its CPython interpreter ([`python::detect`]).
    Python(u32),
    /// tokio's park functions in its files ([`runtimes::tokio_park_points`]).
    Tokio(u32),
}

/// The answer to an [`Ask`]. A Python answer is boxed: an interpreter
/// (its layout tables) is some 240 bytes, a tokio answer some 30.
pub enum Answer {
    Python(u32, Box<Result<Option<Interpreter>, PythonError>>),
    Tokio(u32, Vec<ParkPoint>),
}

impl Answer {
    fn ask(&self) -> Ask {
        match self {
            Answer::Python(pid, _) => Ask::Python(*pid),
            Answer::Tokio(pid, _) => Ask::Tokio(*pid),
        }
    }
}

fn answer(ask: Ask) -> Answer {
    match ask {
        Ask::Python(pid) => Answer::Python(pid, Box::new(python::detect(pid))),
        Ask::Tokio(pid) => Answer::Tokio(pid, runtimes::tokio_park_points(pid)),
    }
}

/// The worker and what was asked of it.
pub struct Discovery {
    /// `None`: no worker thread, answered inline.
    asks: Option<SyncSender<Ask>>,
    answers: Receiver<Answer>,
    /// Asked, not answered yet.
    open: HashSet<Ask>,
    /// Answered inline (no worker), not taken yet.
    inline: Vec<Answer>,
}

impl Discovery {
    pub fn new() -> Self {
        let (asks, queue) = sync_channel::<Ask>(QUEUE);
        let (done, answers) = channel();
        let spawned = std::thread::Builder::new()
            .name("stallprof-discover".into())
            .spawn(move || {
                for ask in queue {
                    if done.send(answer(ask)).is_err() {
                        return;
                    }
                }
            });
        let asks = match spawned {
            Ok(_) => Some(asks),
            Err(e) => {
                log::warn!("no thread to find runtimes on ({e}): found on the drain thread");
                None
            }
        };
        Discovery {
            asks,
            answers,
            open: HashSet::new(),
            inline: Vec::new(),
        }
    }

    /// Ask `ask` unless it is open. False when the queue is full: ask again
    /// later.
    pub fn ask(&mut self, ask: Ask) -> bool {
        if self.open.contains(&ask) {
            return true;
        }
        match &self.asks {
            Some(tx) => match tx.try_send(ask) {
                Ok(()) => {
                    self.open.insert(ask);
                    true
                }
                Err(TrySendError::Full(_)) => false,
                Err(TrySendError::Disconnected(_)) => {
                    // The worker is gone (it panicked): answer here from now on.
                    log::warn!("the runtime finder's thread ended: finding on the drain thread");
                    self.asks = None;
                    self.inline.push(answer(ask));
                    true
                }
            },
            None => {
                self.inline.push(answer(ask));
                true
            }
        }
    }

    /// `ask` was asked and is not answered yet.
    pub fn is_open(&self, ask: Ask) -> bool {
        self.open.contains(&ask)
    }

    /// Some question is not answered yet.
    pub fn any_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// The answers ready now.
    pub fn take(&mut self) -> Vec<Answer> {
        let mut out = std::mem::take(&mut self.inline);
        while let Ok(a) = self.answers.try_recv() {
            out.push(a);
        }
        for a in &out {
            self.open.remove(&a.ask());
        }
        out
    }

    /// The answers, waiting up to `limit` for every open question (the
    /// first upkeep, before the target is told to go on).
    pub fn take_all(&mut self, limit: Duration) -> Vec<Answer> {
        let deadline = Instant::now() + limit;
        let mut out = self.take();
        while !self.open.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.answers.recv_timeout(left) {
                Ok(a) => {
                    self.open.remove(&a.ask());
                    out.push(a);
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
            }
        }
        out
    }
}

impl Default for Discovery {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_come_back_once_each() {
        let mut d = Discovery::new();
        let me = std::process::id();
        assert!(d.ask(Ask::Python(me)));
        assert!(d.ask(Ask::Tokio(me)));
        // Asked again while open: not queued twice.
        assert!(d.ask(Ask::Python(me)));
        assert!(d.is_open(Ask::Python(me)));
        let got = d.take_all(Duration::from_secs(30));
        assert_eq!(got.len(), 2);
        assert!(!d.is_open(Ask::Python(me)));
        // This test binary is no Python (its tokio is the agent's own).
        for a in got {
            match a {
                Answer::Python(pid, r) => {
                    assert_eq!(pid, me);
                    assert!(matches!(*r, Ok(None)), "{:?}", r.err());
                }
                Answer::Tokio(pid, _) => assert_eq!(pid, me),
            }
        }
        assert!(d.take().is_empty());
    }
}
