//! The ASGI request of each open busy period, for the engine.
//!
//! In: reads of the live target ([`crate::symbolize::python::RouteReader`],
//! done by the engine at the period's first stack events with Python
//! frames, next to the asyncio task's) and, in a replay, the routes a
//! recording saved. Out: a finished stall's [`Route`], or the counter its
//! miss becomes (`asgi_route_unrouted`, `asgi_route_unverified`,
//! `asgi_route_unreadable`) and, for an unreadable one, the reason as a
//! runtime problem of the process. A stall whose stack never showed an
//! ASGI frame (`scope` local) is no request: nothing to count.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::model::{Route, RuntimeProblem};
use crate::symbolize::python::RouteRead;

/// Reads of a busy period's route before giving up on it.
const ROUTE_READS: u32 = 8;
/// Reads of one period at least this far apart after its first miss, and
/// twice as far after each further one ([`spacing`]): the stack events of a
/// drain come in a batch, and reads at one instant see one live state. The
/// tries so span 1.27 s of a stall, not its first tens of milliseconds: a
/// first request on a cold page cache spends hundreds of milliseconds
/// importing before and inside the endpoint, its frames changing under
/// every read (CI, 2026-12-03: six reads 10 ms apart all missed a 616 ms
/// stall whose stack named the endpoint for most of it).
const READ_SPACING: Duration = Duration::from_millis(10);
/// Longest wait between two reads of one period.
const MAX_SPACING: Duration = Duration::from_millis(640);
/// Open busy periods remembered; past this, those no longer open go.
const MAX_BUSY_ROUTES: usize = 4096;

/// What the reads of one busy period found.
#[derive(Clone, Debug)]
enum BusyRoute {
    Read(Route),
    Tried {
        reads: u32,
        /// When the last counted read was made.
        at: Option<Instant>,
        last: RouteRead,
    },
}

/// A stack whose read [`READ_SPACING`] held back: read at the next drain
/// once it is due, while its period is still open. A stall blocked in one
/// call (a sleep, a blocking client) shows one stack event; a read held
/// back at it would otherwise never come.
#[derive(Debug, PartialEq, Eq)]
pub struct Held {
    pub tgid: u32,
    pub python: Vec<(u64, u64)>,
}

/// Whether a stack event of an open period is read now.
#[derive(Debug, PartialEq, Eq)]
pub enum Want {
    Now,
    /// Too soon after the last read: kept, read when due ([`Routes::due`]).
    Later,
    Never,
}

/// Routes of open busy periods, by (tid, start).
#[derive(Default)]
pub struct Routes {
    busy: HashMap<(u32, u64), BusyRoute>,
    /// The latest stack of each period whose read was held back.
    held: HashMap<(u32, u64), Held>,
    /// Why a process's routes could not be read (the latest reason).
    problems: BTreeMap<u32, String>,
}

/// The wait after a period's `reads`-th counted miss before its next read.
fn spacing(reads: u32) -> Duration {
    let doubled = READ_SPACING.saturating_mul(1 << reads.saturating_sub(1).min(16));
    doubled.min(MAX_SPACING)
}

/// Which miss a stall keeps: a read that saw the request (unverified,
/// unrouted) over one that could not read it (a torn read of a running
/// thread's frames), and either over "no request" (the stall had ended).
fn rank(r: &RouteRead) -> u8 {
    match r {
        RouteRead::NotAsgi => 0,
        RouteRead::Unreadable(_) => 1,
        _ => 2,
    }
}

impl Routes {
    /// Whether the period `key` wants a read at `now`.
    pub fn wants_read(&self, key: (u32, u64), now: Instant) -> Want {
        match self.busy.get(&key) {
            Some(BusyRoute::Read(_)) => Want::Never,
            Some(BusyRoute::Tried { reads, .. }) if *reads >= ROUTE_READS => Want::Never,
            Some(BusyRoute::Tried {
                reads, at: Some(t), ..
            }) if now.duration_since(*t) < spacing(*reads) => Want::Later,
            _ => Want::Now,
        }
    }

    /// Keep `python`, a stack of period `key` of process `tgid`, for a read
    /// when it is due (the latest stack replaces an earlier one).
    pub fn hold(&mut self, key: (u32, u64), tgid: u32, python: &[(u64, u64)]) {
        if self.held.len() >= MAX_BUSY_ROUTES && !self.held.contains_key(&key) {
            return;
        }
        self.held.insert(
            key,
            Held {
                tgid,
                python: python.to_vec(),
            },
        );
    }

    /// The held stacks whose read is due at `now`, by period, of periods
    /// `open` still has. The rest of the held ones stay, those of closed
    /// periods go.
    pub fn due(&mut self, now: Instant, open: &HashSet<(u32, u64)>) -> Vec<((u32, u64), Held)> {
        self.held.retain(|k, _| open.contains(k));
        let due: Vec<(u32, u64)> = self
            .held
            .keys()
            .filter(|k| self.wants_read(**k, now) == Want::Now)
            .copied()
            .collect();
        due.into_iter()
            .filter_map(|k| self.held.remove(&k).map(|h| (k, h)))
            .collect()
    }

    /// Whether any read is held back (the engine then looks at [`Routes::due`]).
    pub fn any_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// Keeps what a read of period `key` at `now` found; `open` lists the
    /// periods still open (to forget the others when the table is full).
    pub fn record(
        &mut self,
        key: (u32, u64),
        read: Result<Route, RouteRead>,
        now: Instant,
        open: impl FnOnce() -> HashSet<(u32, u64)>,
    ) {
        let state = match read {
            Ok(r) => BusyRoute::Read(r),
            Err(miss) => {
                // A stack without ASGI frames costs no read of the target
                // (the code objects' `scope` slots are cached): it does not
                // use up the tries.
                let counted = miss != RouteRead::NotAsgi;
                let (reads, at, last) = match self.busy.remove(&key) {
                    Some(BusyRoute::Tried { reads, at, last }) => {
                        let keep = if rank(&last) > rank(&miss) {
                            last
                        } else {
                            miss
                        };
                        (reads, at, keep)
                    }
                    _ => (0, None, miss),
                };
                BusyRoute::Tried {
                    reads: reads + u32::from(counted),
                    at: if counted { Some(now) } else { at },
                    last,
                }
            }
        };
        if self.busy.len() >= MAX_BUSY_ROUTES {
            let open = open();
            self.busy.retain(|k, _| open.contains(k));
        }
        self.busy.insert(key, state);
    }

    /// The route of the finished stall `key`, and the counter of its miss.
    pub fn finish(&mut self, tgid: u32, key: (u32, u64)) -> (Option<Route>, Option<&'static str>) {
        self.held.remove(&key);
        match self.busy.remove(&key) {
            Some(BusyRoute::Read(r)) => (Some(r), None),
            Some(BusyRoute::Tried { last, .. }) => (None, counter(tgid, last, &mut self.problems)),
            None => (None, None),
        }
    }

    /// Carried into a rebuilt engine (periods still open keep their reads).
    pub fn take(&mut self) -> Routes {
        std::mem::take(self)
    }

    /// A runtime problem per process whose routes could not be read.
    pub fn problems(&self, version: impl Fn(u32) -> Option<String>) -> Vec<RuntimeProblem> {
        self.problems
            .iter()
            .map(|(&pid, why)| RuntimeProblem {
                pid,
                runtime: version(pid).map_or_else(|| "cpython".into(), |v| format!("cpython {v}")),
                what: "ASGI request routes unavailable: stalls that served a request do not \
                       say which route (drops: asgi_route_unreadable)"
                    .into(),
                why: why.clone(),
                remedy: "report it with the output of `python -VV` and the server's and \
                         framework's versions; stalls and their frames are still measured"
                    .into(),
            })
            .collect()
    }
}

fn counter(
    tgid: u32,
    miss: RouteRead,
    problems: &mut BTreeMap<u32, String>,
) -> Option<&'static str> {
    match miss {
        RouteRead::Route { .. } | RouteRead::NotAsgi => None,
        RouteRead::Unrouted => Some("asgi_route_unrouted"),
        RouteRead::Unverified => Some("asgi_route_unverified"),
        RouteRead::Unreadable(why) => {
            problems.insert(tgid, why);
            Some("asgi_route_unreadable")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read held back by the spacing is made once it is due, with the
    /// latest stack, and only while its period is open.
    #[test]
    fn a_held_back_read_is_made_when_due() {
        let mut r = Routes::default();
        let (k, t0) = ((7, 100), Instant::now());
        r.record(k, Err(RouteRead::Unverified), t0, HashSet::new);
        assert_eq!(r.wants_read(k, t0), Want::Later);
        r.hold(k, 1, &[(10, 1)]);
        r.hold(k, 1, &[(20, 2)]);
        let open: HashSet<_> = [k].into();
        assert!(r.due(t0, &open).is_empty(), "not yet");
        let held = Held {
            tgid: 1,
            python: vec![(20, 2)],
        };
        assert_eq!(r.due(t0 + READ_SPACING, &open), vec![(k, held)]);
        assert!(!r.any_held());
        r.hold(k, 1, &[(30, 3)]);
        assert!(
            r.due(t0 + READ_SPACING, &HashSet::new()).is_empty(),
            "period closed"
        );
        assert!(!r.any_held());
    }

    fn route() -> Route {
        Route {
            method: "POST".into(),
            template: "/resume/{rid}".into(),
        }
    }

    #[test]
    fn a_read_route_is_the_stalls_and_stops_the_reads() {
        let mut r = Routes::default();
        let (k, t0) = ((7, 100), Instant::now());
        assert_eq!(r.wants_read(k, t0), Want::Now);
        r.record(k, Err(RouteRead::Unverified), t0, HashSet::new);
        assert_eq!(r.wants_read(k, t0), Want::Later, "one read an instant");
        let t1 = t0 + READ_SPACING;
        assert_eq!(r.wants_read(k, t1), Want::Now);
        r.record(k, Ok(route()), t1, HashSet::new);
        assert_eq!(r.wants_read(k, t1 + READ_SPACING), Want::Never);
        assert_eq!(r.finish(1, k), (Some(route()), None));
        assert_eq!(r.finish(1, k), (None, None), "taken once");
    }

    /// Each counted miss doubles the wait before the next read, so the
    /// tries reach past a stall's first second.
    #[test]
    fn the_wait_doubles_after_each_miss() {
        let mut r = Routes::default();
        let (k, mut t) = ((7, 100), Instant::now());
        let mut span = Duration::ZERO;
        for n in 1..ROUTE_READS {
            r.record(k, Err(RouteRead::Unverified), t, HashSet::new);
            let wait = spacing(n);
            assert_eq!(r.wants_read(k, t + wait / 2), Want::Later, "after miss {n}");
            assert_eq!(r.wants_read(k, t + wait), Want::Now, "after miss {n}");
            t += wait;
            span += wait;
        }
        r.record(k, Err(RouteRead::Unverified), t, HashSet::new);
        assert_eq!(r.wants_read(k, t + MAX_SPACING), Want::Never);
        assert_eq!(span, Duration::from_millis(1270));
        assert_eq!(spacing(40), MAX_SPACING);
    }

    #[test]
    fn misses_are_counted_by_why_and_the_most_telling_is_kept() {
        let mut r = Routes::default();
        let k = (7, 100);
        let mut t = Instant::now();
        let mut read = |r: &mut Routes, miss: RouteRead| {
            t += MAX_SPACING;
            r.record(k, Err(miss), t, HashSet::new);
            t
        };
        // Saw the request, then a torn read, then the stall was over.
        read(&mut r, RouteRead::Unverified);
        read(&mut r, RouteRead::Unreadable("torn".into()));
        read(&mut r, RouteRead::NotAsgi);
        assert_eq!(r.finish(1, k), (None, Some("asgi_route_unverified")));
        assert!(r.problems(|_| None).is_empty());
        // Stacks without a request's frames use no tries.
        for _ in 0..2 * ROUTE_READS {
            read(&mut r, RouteRead::NotAsgi);
        }
        let now = read(&mut r, RouteRead::NotAsgi);
        assert_eq!(r.wants_read(k, now + READ_SPACING), Want::Now);
        for _ in 0..ROUTE_READS {
            read(&mut r, RouteRead::Unreadable("bad dict".into()));
        }
        let now = read(&mut r, RouteRead::NotAsgi);
        assert_eq!(r.wants_read(k, now + READ_SPACING), Want::Never);
        assert_eq!(r.finish(1, k), (None, Some("asgi_route_unreadable")));
        assert_eq!(r.problems(|_| None)[0].why, "bad dict");
        read(&mut r, RouteRead::NotAsgi);
        assert_eq!(
            r.finish(1, k),
            (None, None),
            "not a request: nothing to count"
        );
        read(&mut r, RouteRead::Unrouted);
        assert_eq!(r.finish(1, k), (None, Some("asgi_route_unrouted")));
    }
}
