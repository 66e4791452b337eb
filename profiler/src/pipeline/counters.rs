//! The agent's own failure counters (the `drops` of a recording's summary
//! and `stalls.json`, the daemon's `stallprof_agent_drops_total{reason}`).
//!
//! In: one [`Counter`] per failure, counted where it happens (decoding,
//! unwinding, upkeep, the symbolizer queue, the live reads); the read
//! limits' and V8's process-wide tallies. Out: [`Counters::snapshot`], the
//! non-zero counts by their user-facing name. [`Counter::name`] is the one
//! place those names are spelled: they are a file format (docs/format.md)
//! and metric labels, so they never change.
use std::collections::BTreeMap;

/// One failure the agent counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    UnparsableEvents,
    UpkeepDeferred,
    UserStackTruncated,
    UnwindTruncated,
    UnwindFailed,
    JsFramesV8Pending,
    EventsNotSaved,
    PythonFramesUnavailable,
    SymbolizerBehind,
    AsyncioTaskUnverified,
    AsyncioTaskUnreadable,
    AsyncioTaskUnknown,
    AsgiRouteUnrouted,
    AsgiRouteUnverified,
    AsgiRouteUnreadable,
    /// Kept by stall assembly; reported here.
    SwitchInsMissed,
    /// Kept by the V8 reader, process-wide; reported here.
    JsFramesUnreadable,
}

impl Counter {
    const ALL: [Counter; 17] = [
        Counter::UnparsableEvents,
        Counter::UpkeepDeferred,
        Counter::UserStackTruncated,
        Counter::UnwindTruncated,
        Counter::UnwindFailed,
        Counter::JsFramesV8Pending,
        Counter::EventsNotSaved,
        Counter::PythonFramesUnavailable,
        Counter::SymbolizerBehind,
        Counter::AsyncioTaskUnverified,
        Counter::AsyncioTaskUnreadable,
        Counter::AsyncioTaskUnknown,
        Counter::AsgiRouteUnrouted,
        Counter::AsgiRouteUnverified,
        Counter::AsgiRouteUnreadable,
        Counter::SwitchInsMissed,
        Counter::JsFramesUnreadable,
    ];

    /// The name users see (summary, `stalls.json`, metrics labels).
    pub fn name(self) -> &'static str {
        match self {
            Counter::UnparsableEvents => "unparsable_events",
            Counter::UpkeepDeferred => "upkeep_deferred",
            Counter::UserStackTruncated => "user_stack_truncated",
            Counter::UnwindTruncated => "unwind_truncated",
            Counter::UnwindFailed => "unwind_failed",
            Counter::JsFramesV8Pending => "js_frames_v8_pending",
            Counter::EventsNotSaved => "events_not_saved",
            Counter::PythonFramesUnavailable => "python_frames_unavailable",
            Counter::SymbolizerBehind => "symbolizer_behind",
            Counter::AsyncioTaskUnverified => "asyncio_task_unverified",
            Counter::AsyncioTaskUnreadable => "asyncio_task_unreadable",
            Counter::AsyncioTaskUnknown => "asyncio_task_unknown",
            Counter::AsgiRouteUnrouted => "asgi_route_unrouted",
            Counter::AsgiRouteUnverified => "asgi_route_unverified",
            Counter::AsgiRouteUnreadable => "asgi_route_unreadable",
            Counter::SwitchInsMissed => "switch_ins_missed",
            Counter::JsFramesUnreadable => "js_frames_unreadable",
        }
    }
}

/// One engine's counts, from its start: the process-wide tallies are kept
/// as they were then, and only what came since is its own.
pub struct Counters {
    counts: [u64; Counter::ALL.len()],
    /// The read limits' counts when this engine started
    /// ([`crate::os::limits`] keeps one process-wide tally).
    limits_base: Vec<(&'static str, u64)>,
    /// [`crate::symbolize::v8::unreadable_count`] when this engine started.
    js_unreadable_base: u64,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            counts: [0; Counter::ALL.len()],
            limits_base: crate::os::limits::counts(),
            js_unreadable_base: crate::symbolize::v8::unreadable_count(),
        }
    }
}

impl Counters {
    /// Count `n` more of `c`; returns the new count (a first one is
    /// worth a warning).
    pub fn add(&mut self, c: Counter, n: u64) -> u64 {
        let slot = &mut self.counts[c as usize];
        *slot += n;
        *slot
    }

    pub fn get(&self, c: Counter) -> u64 {
        self.counts[c as usize]
    }

    /// The non-zero counts by name, with the read limits hit since this
    /// engine started (`limit_*`) and `switch_ins_missed`, assembly's.
    pub fn snapshot(&self, switch_ins_missed: u64) -> BTreeMap<&'static str, u64> {
        let mut d = BTreeMap::new();
        for c in Counter::ALL {
            let n = match c {
                Counter::SwitchInsMissed => switch_ins_missed,
                Counter::JsFramesUnreadable => {
                    crate::symbolize::v8::unreadable_count().saturating_sub(self.js_unreadable_base)
                }
                _ => self.get(c),
            };
            if n > 0 {
                d.insert(c.name(), n);
            }
        }
        for ((name, now), (_, base)) in crate::os::limits::counts()
            .into_iter()
            .zip(&self.limits_base)
        {
            if now > *base {
                d.insert(name, now - base);
            }
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_is_listed_once_at_its_index() {
        for (i, c) in Counter::ALL.into_iter().enumerate() {
            assert_eq!(c as usize, i, "{c:?}");
        }
        let mut names: Vec<_> = Counter::ALL.iter().map(|c| c.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Counter::ALL.len());
    }
}
