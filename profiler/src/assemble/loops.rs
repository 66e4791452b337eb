//! The registry of loop threads: which wait is each thread's event-loop
//! park. The one owner of that fact: the kernel's `LOOP_KEYS` map, the
//! executor lists in recordings and daemon metrics, and the daemon's
//! keep/drop decision for stack events are all derived from it.
//!
//! In: every wait a thread enters or leaves (syscall class + fd, see
//! `profiler_common::wait_key`), with its timestamp. Out: [`Decision`]s —
//! a thread's loop key was elected or moved — which the engine publishes
//! to the kernel.
//!
//! The rule (docs/architecture.md, "Loop identity"), resting on facts that
//! hold in the field:
//! * Event loops park in `epoll_wait`/`epoll_pwait` (asyncio's default
//!   selector, uvloop, libuv, tokio/mio); blocking clients wait in `poll`
//!   or `select` on one or two sockets (CPython's socket timeouts, libcurl
//!   easy, most sync SDKs).
//! * **Election**: an epoll fd waited on [`EPOLL_DECIDE`] times, or — for a
//!   thread that has not used epoll — one poll set (or `select`)
//!   [`POLL_DECIDE`] times in a row of waits that held the thread at least
//!   [`POLL_IDLE_SHARE`] of the time since the first of them. A runtime's
//!   park function (tokio, via uprobes) is the key at once and for good.
//! * **A loop idles in its wait**: a thread that polls one pipe or socket
//!   now and then but spends its time elsewhere — a supervisor that pings
//!   each worker (`Connection.poll`) between sleeps on a condition
//!   variable (uvicorn's `--workers` loop), a client polling a socket
//!   between its own sleeps — is not waiting for work in that poll: its
//!   time between polls is not a loop's busy period, and must never be
//!   reported as a stall. epoll is exempt: it is what event loops park in,
//!   not what blocking clients use, and a saturated epoll loop (no idle
//!   time at all) must still be found.
//! * **Established is sticky**: a wait on another key counts toward moving
//!   the loop only once the loop's own key has gone unused for
//!   [`LOOP_IDLE_NS`] (the loop was closed and a new one created, e.g. a
//!   second `asyncio.run`). Waits inside a busy period younger than that
//!   are part of the busy period, however many there are: a sync client
//!   that polls 200 times inside one stall never moves the loop.
//! * An epoll loop never moves to a poll/select key: those are what
//!   blocking clients wait in.
//! * An epoll key outranks a poll/select key: [`EPOLL_DECIDE`] waits on one
//!   epoll fd with no wait on the poll key between them take over at once
//!   (a poll key elected while attaching in the middle of a blocking
//!   client's call, before the loop's first epoll wait).
//! * A move throws away the busy period open on the old key (it spans the
//!   whole change-over; see `stall::Tracker`), counted as `loop_moves`.
//!
//! `select`'s only argument that names the wait, nfds, changes whenever the
//! program opens a higher fd, so all of a thread's `select` calls are one
//! key (`wait_key` gives them fd 0).
use std::collections::HashMap;

use profiler_common::{WAIT_CLASS_PARK, sysno, wait_key};

/// Waits on one poll/select key before a thread with no epoll use is taken
/// to be a poll-based loop.
pub const POLL_DECIDE: u32 = 8;
/// Waits on one epoll fd before it is taken to be the loop's.
pub const EPOLL_DECIDE: u32 = 2;
/// How long an established loop key must go unused before waits on
/// another key of its family count toward a move. Longer than any stall
/// worth reporting as one piece; short enough that a re-created loop is
/// measured again within seconds.
pub const LOOP_IDLE_NS: u64 = 10_000_000_000;
/// The least share of the time, from the first of [`POLL_DECIDE`] waits on
/// a poll/select key to the last, that the thread must have spent inside
/// them for the key to be its loop's park (see the module doc). A window
/// that falls short starts over from its last wait.
pub const POLL_IDLE_SHARE: f64 = 0.5;
/// Candidate keys remembered per thread before the tally starts over (a
/// thread that polls ever-new fds and never parks is not a loop).
const MAX_CANDIDATES: usize = 64;

const CLASS_EPOLL: u64 = wait_key(sysno::EPOLL_WAIT, 0) >> 32;

fn is_epoll_key(key: u64) -> bool {
    key >> 32 == CLASS_EPOLL
}

fn is_park_key(key: u64) -> bool {
    key >> 32 == WAIT_CLASS_PARK
}

/// What the registry decided about one thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// `key` is now the thread's loop wait; `moved`: it replaced another.
    Elected { tid: u32, key: u64, moved: bool },
}

#[derive(Debug, Default, Clone)]
struct LoopThread {
    tgid: u32,
    key: Option<u64>,
    /// Last time the thread entered or left a wait on `key`.
    used_ns: u64,
    /// Waits per key: before election, every key; after it, the candidates
    /// that may take over (see the module doc).
    tally: HashMap<u64, Candidate>,
}

/// One candidate key's waits since its window began.
#[derive(Debug, Default, Clone, Copy)]
struct Candidate {
    waits: u32,
    /// When the window's first wait began.
    since_ns: u64,
    /// Time inside the window's finished waits.
    waited_ns: u64,
    /// The wait on this key the thread is in, since when.
    entered_ns: Option<u64>,
}

impl Candidate {
    /// A wait on this key begins at `ts`: is the key now elected? An epoll
    /// key after `EPOLL_DECIDE` waits; a poll/select key after
    /// `POLL_DECIDE` waits that held the thread `POLL_IDLE_SHARE` of
    /// the window (else the window starts over here).
    fn enter(&mut self, epoll: bool, ts: u64) -> bool {
        if self.waits == 0 {
            self.since_ns = ts;
        }
        self.waits += 1;
        self.entered_ns = Some(ts);
        if epoll {
            return self.waits >= EPOLL_DECIDE;
        }
        if self.waits < POLL_DECIDE {
            return false;
        }
        let span = ts.saturating_sub(self.since_ns);
        if self.waited_ns as f64 >= POLL_IDLE_SHARE * span as f64 {
            return true;
        }
        *self = Candidate {
            waits: 1,
            since_ns: ts,
            waited_ns: 0,
            entered_ns: Some(ts),
        };
        false
    }

    fn exit(&mut self, ts: u64) {
        if let Some(t) = self.entered_ns.take() {
            self.waited_ns += ts.saturating_sub(t);
        }
    }
}

/// Loop-thread identity for every thread seen waiting.
#[derive(Debug, Default, Clone)]
pub struct LoopRegistry {
    threads: HashMap<u32, LoopThread>,
    /// Keys that moved (a loop re-created, or an epoll loop outranking a
    /// poll set elected at attach).
    pub moves: u64,
}

impl LoopRegistry {
    /// A wait of `tid` on `key` begins at `ts`. Returns a decision when
    /// this wait elects or moves the thread's loop key.
    pub fn wait_enter(
        &mut self,
        tid: u32,
        tgid: u32,
        nr: u32,
        fd: i32,
        ts: u64,
    ) -> Option<Decision> {
        let key = wait_key(nr, fd);
        let th = self.threads.entry(tid).or_default();
        th.tgid = tgid;
        let decided = |th: &mut LoopThread, moved: bool| {
            th.key = Some(key);
            th.used_ns = ts;
            th.tally.clear();
            Some(Decision::Elected { tid, key, moved })
        };
        if is_park_key(key) {
            return if th.key == Some(key) {
                None
            } else {
                let moved = th.key.is_some();
                decided(th, moved)
            };
        }
        let Some(loop_key) = th.key else {
            if th.tally.len() >= MAX_CANDIDATES && !th.tally.contains_key(&key) {
                th.tally.clear();
            }
            let epoll = is_epoll_key(key);
            let ready = th.tally.entry(key).or_default().enter(epoll, ts);
            let elect = ready && (epoll || !th.tally.keys().any(|&k| is_epoll_key(k)));
            return if elect { decided(th, false) } else { None };
        };
        if loop_key == key {
            th.used_ns = ts;
            th.tally.clear();
            return None;
        }
        let eligible = match (is_epoll_key(loop_key), is_epoll_key(key)) {
            _ if is_park_key(loop_key) => false,
            (false, true) => true,
            (true, false) => false,
            _ => ts.saturating_sub(th.used_ns) >= LOOP_IDLE_NS,
        };
        if !eligible {
            return None;
        }
        if th.tally.len() >= MAX_CANDIDATES && !th.tally.contains_key(&key) {
            th.tally.clear();
        }
        if th
            .tally
            .entry(key)
            .or_default()
            .enter(is_epoll_key(key), ts)
        {
            self.moves += 1;
            decided(th, true)
        } else {
            None
        }
    }

    /// A wait of `tid` on `key` returned at `ts`.
    pub fn wait_exit(&mut self, tid: u32, tgid: u32, key: u64, ts: u64) {
        let th = self.threads.entry(tid).or_default();
        th.tgid = tgid;
        if th.key == Some(key) {
            th.used_ns = ts;
        } else if let Some(c) = th.tally.get_mut(&key) {
            c.exit(ts);
        }
    }

    /// The thread's loop key, once elected.
    pub fn key(&self, tid: u32) -> Option<u64> {
        self.threads.get(&tid).and_then(|t| t.key)
    }

    pub fn is_loop_thread(&self, tid: u32) -> bool {
        self.key(tid).is_some()
    }

    /// Is a wait on `key` the thread's park? Until the thread's loop key is
    /// known, every wait is.
    pub fn is_park(&self, tid: u32, key: u64) -> bool {
        self.key(tid).is_none_or(|k| k == key)
    }

    /// The process a thread seen waiting belongs to.
    pub fn tgid_of(&self, tid: u32) -> Option<u32> {
        self.threads.get(&tid).map(|t| t.tgid)
    }

    /// Loop threads: (tid, tgid, key), by tid.
    pub fn loop_threads(&self) -> Vec<(u32, u32, u64)> {
        let mut v: Vec<_> = self
            .threads
            .iter()
            .filter_map(|(&tid, t)| t.key.map(|k| (tid, t.tgid, k)))
            .collect();
        v.sort_unstable();
        v
    }

    /// Loop threads of one process, ascending.
    pub fn loop_tids_of(&self, tgid: u32) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .threads
            .iter()
            .filter(|(_, t)| t.tgid == tgid && t.key.is_some())
            .map(|(&tid, _)| tid)
            .collect();
        v.sort_unstable();
        v
    }

    /// Processes with at least one loop thread, ascending.
    pub fn loop_processes(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .threads
            .values()
            .filter(|t| t.key.is_some())
            .map(|t| t.tgid)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// A thread exited: its tid may be reused by an unrelated thread.
    /// Returns whether it was a loop thread (its kernel entry must go).
    pub fn thread_exited(&mut self, tid: u32) -> bool {
        self.threads.remove(&tid).is_some_and(|t| t.key.is_some())
    }

    /// A process exited or exec'd: forget its threads. Returns the loop
    /// threads forgotten (their kernel entries must go).
    pub fn forget_process(&mut self, tgid: u32) -> Vec<u32> {
        let mut gone = Vec::new();
        self.threads.retain(|&tid, t| {
            if t.tgid != tgid {
                return true;
            }
            if t.key.is_some() {
                gone.push(tid);
            }
            false
        });
        gone.sort_unstable();
        gone
    }

    /// Threads known (loop or candidate).
    pub fn len(&self) -> usize {
        self.threads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::sysno::{EPOLL_WAIT, POLL, RUNTIME_PARK, SELECT};

    const MS: u64 = 1_000_000;

    /// Feed (enter_ms, exit_ms, nr, fd) waits of thread 1; the decisions.
    fn feed(r: &mut LoopRegistry, waits: &[(u64, u64, u32, i32)]) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        for &(a, b, nr, fd) in waits {
            if let Some(Decision::Elected { key, moved, .. }) = r.wait_enter(1, 1, nr, fd, a * MS) {
                out.push((key, moved));
            }
            r.wait_exit(1, 1, wait_key(nr, fd), b * MS);
        }
        out
    }

    #[test]
    fn epoll_elected_after_two_waits() {
        let mut r = LoopRegistry::default();
        let d = feed(&mut r, &[(0, 1, EPOLL_WAIT, 3), (2, 3, EPOLL_WAIT, 3)]);
        assert_eq!(d, [(wait_key(EPOLL_WAIT, 3), false)]);
    }

    /// A poll set elected at attach (a blocking client's polls came first)
    /// gives way to the loop's epoll fd at once.
    #[test]
    fn epoll_outranks_a_poll_set() {
        let mut r = LoopRegistry::default();
        let mut w: Vec<_> = (0..POLL_DECIDE as u64)
            .map(|i| (i * 10, i * 10 + 9, POLL, 9))
            .collect();
        w.extend([(200, 300, EPOLL_WAIT, 3), (301, 400, EPOLL_WAIT, 3)]);
        let d = feed(&mut r, &w);
        assert_eq!(
            d,
            [(wait_key(POLL, 9), false), (wait_key(EPOLL_WAIT, 3), true)]
        );
    }

    /// A tokio worker's park function wins over everything at once.
    #[test]
    fn runtime_park_is_final() {
        let mut r = LoopRegistry::default();
        let mut w = vec![
            (0, 1, EPOLL_WAIT, 3),
            (2, 3, EPOLL_WAIT, 3),
            (4, 5, RUNTIME_PARK, 0),
        ];
        w.extend((0..100).map(|i| (20_000 + i, 20_000 + i, EPOLL_WAIT, 9)));
        let d = feed(&mut r, &w);
        assert_eq!(d.last(), Some(&(wait_key(RUNTIME_PARK, 0), true)));
        assert_eq!(r.key(1), Some(wait_key(RUNTIME_PARK, 0)));
    }

    /// A long idle park, then a blocking client's polls: the park's return
    /// counts as use, so the polls are young and never count.
    #[test]
    fn idle_park_then_client_polls_keeps_the_loop() {
        let mut r = LoopRegistry::default();
        let mut w = vec![(0, 1, EPOLL_WAIT, 3), (2, 60_000, EPOLL_WAIT, 3)];
        w.extend((0..200).map(|i| (60_001 + i, 60_001 + i, POLL, 9)));
        feed(&mut r, &w);
        assert_eq!(r.key(1), Some(wait_key(EPOLL_WAIT, 3)));
        assert_eq!(r.moves, 0);
    }

    /// uvicorn's `--workers` supervisor: every 0.5 s it waits on a condition
    /// variable (futex, not a loop wait) and pings each worker, polling
    /// that worker's pipe for the answer (microseconds; drawn as a slow
    /// 1 ms here). Its polls hold it 0.4% of the time at most: never its
    /// loop, however many, so the futex sleeps between them are never
    /// busy periods.
    ///
    /// ```text
    /// t ms   0 1         500 501       1000 1001 ...
    /// poll   [A]         [A]           [A]           (fd A, 1 ms each)
    /// futex     [--------]   [---------]    [--      (not a wait here)
    /// ```
    #[test]
    fn a_supervisor_pinging_its_workers_is_not_a_loop() {
        let mut r = LoopRegistry::default();
        let w: Vec<_> = (0..200u64)
            .flat_map(|i| {
                [
                    (i * 500, i * 500 + 1, POLL, 9),
                    (i * 500 + 2, i * 500 + 3, POLL, 11),
                ]
            })
            .collect();
        assert!(feed(&mut r, &w).is_empty());
        assert!(!r.is_loop_thread(1));
        assert!(
            r.is_park(1, wait_key(POLL, 9)),
            "undecided: no busy period is reported"
        );
    }

    /// A poll-based loop idle between requests (gunicorn's arbiter sleeping
    /// in `select` 1 s at a time, a glib main loop) is elected once a
    /// window of its waits held it at least half the time; one busy window
    /// only delays that.
    #[test]
    fn a_poll_loop_that_idles_in_its_wait_is_elected() {
        let mut r = LoopRegistry::default();
        // 8 waits of 1 ms, 100 ms apart: busy, not yet.
        let mut w: Vec<_> = (0..8u64).map(|i| (i * 100, i * 100 + 1, POLL, 5)).collect();
        // Then idle: 8 waits of 90 ms each, 10 ms apart.
        w.extend((0..8u64).map(|i| (1_000 + i * 100, 1_090 + i * 100, POLL, 5)));
        let d = feed(&mut r, &w);
        assert_eq!(d, [(wait_key(POLL, 5), false)]);
        // Elected at the 8th wait of the idle window (the busy window's
        // last wait opened it).
        assert!(r.is_loop_thread(1));
    }

    #[test]
    fn select_calls_are_one_key_whatever_nfds() {
        let mut r = LoopRegistry::default();
        let w: Vec<_> = (0..POLL_DECIDE as u64)
            .map(|i| (i * 2, i * 2 + 1, SELECT, 5 + i as i32))
            .collect();
        let d = feed(&mut r, &w);
        assert_eq!(d, [(wait_key(SELECT, 0), false)]);
    }

    #[test]
    fn exited_threads_are_forgotten() {
        let mut r = LoopRegistry::default();
        feed(&mut r, &[(0, 1, EPOLL_WAIT, 3), (2, 3, EPOLL_WAIT, 3)]);
        assert_eq!(r.loop_processes(), [1]);
        assert!(r.thread_exited(1));
        assert!(r.is_empty());
    }
}
