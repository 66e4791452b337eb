//! The agent's own failure counters (the `drops` of a recording's summary
//! and `stalls.json`, the daemon's `stallprof_agent_drops_total{reason}`).
//!
//! In: one [`Counter`] per failure, counted where it happens (decoding,
//! unwinding, upkeep, the symbolizer queue, the live reads); the read
//! limits' and V8's process-wide tallies. Out: [`Counters::snapshot`], the
//! non-zero counts by their user-facing name. [`Counter::name`] is the one
//! place those names are spelled: they are a file format (docs/format.md)
//! and metric labels, so they never change. [`Counter::meaning`] and
//! [`Counter::cost`] say what a count cost (the summary's lines);
//! [`explain`] answers for every name `drops` can hold, the kernel's and the
//! read limits' too.
use std::collections::BTreeMap;

pub use profiler_common::Cost;

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
    OtelSpanUnreadable,
    OtelSpanUnverified,
    OtelSpanUnsupported,
    /// Kept by the OTLP exporter (`record`, the daemon); reported here.
    OtlpSpansFailed,
    HeldUpUnread,
    /// Kept by stall assembly; reported here.
    SwitchInsMissed,
    /// Kept by the V8 reader, process-wide; reported here.
    JsFramesUnreadable,
}

impl Counter {
    const ALL: [Counter; 22] = [
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
        Counter::OtelSpanUnreadable,
        Counter::OtelSpanUnverified,
        Counter::OtelSpanUnsupported,
        Counter::OtlpSpansFailed,
        Counter::HeldUpUnread,
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
            Counter::OtelSpanUnreadable => "otel_span_unreadable",
            Counter::OtelSpanUnverified => "otel_span_unverified",
            Counter::OtelSpanUnsupported => "otel_span_unsupported",
            Counter::OtlpSpansFailed => "otlp_spans_failed",
            Counter::HeldUpUnread => "held_up_unread",
            Counter::SwitchInsMissed => "switch_ins_missed",
            Counter::JsFramesUnreadable => "js_frames_unreadable",
        }
    }

    /// What one count cost the recording.
    pub fn cost(self) -> Cost {
        match self {
            Counter::UpkeepDeferred => Cost::Harmless,
            Counter::UnparsableEvents => Cost::Stalls,
            Counter::SwitchInsMissed => Cost::Split,
            Counter::UserStackTruncated
            | Counter::UnwindTruncated
            | Counter::UnwindFailed
            | Counter::JsFramesV8Pending
            | Counter::PythonFramesUnavailable
            | Counter::SymbolizerBehind
            | Counter::JsFramesUnreadable => Cost::Frames,
            Counter::AsyncioTaskUnverified
            | Counter::AsyncioTaskUnreadable
            | Counter::AsyncioTaskUnknown
            | Counter::AsgiRouteUnrouted
            | Counter::AsgiRouteUnverified
            | Counter::AsgiRouteUnreadable
            | Counter::OtelSpanUnreadable
            | Counter::OtelSpanUnverified
            | Counter::OtelSpanUnsupported
            | Counter::HeldUpUnread => Cost::Detail,
            Counter::EventsNotSaved => Cost::Saved,
            Counter::OtlpSpansFailed => Cost::Exported,
        }
    }

    /// What one count means and what it cost, in a phrase (read after
    /// `name=N — ` in the summary; docs/format.md's table of counters).
    pub fn meaning(self) -> &'static str {
        match self {
            Counter::UnparsableEvents => {
                "a kernel event could not be parsed: a stall, or part of its time, may be missing"
            }
            Counter::UpkeepDeferred => {
                "a tick's process upkeep ran out of its time budget: the rest was done at the next"
            }
            // The kernel counted it under this name before the agent did.
            Counter::UserStackTruncated => profiler_common::Drop::UstackTruncated.meaning(),
            Counter::UnwindTruncated => {
                "a stack's unwinding ran past the copied stack: its outer frames are missing"
            }
            Counter::UnwindFailed => {
                "a stack's unwinding stopped early: its outer frames are missing"
            }
            Counter::JsFramesV8Pending => {
                "a Node stack taken before V8's layout was read: its JavaScript frames are missing"
            }
            Counter::EventsNotSaved => {
                "events.bin.gz could not be written on: a replay of it misses the rest"
            }
            Counter::PythonFramesUnavailable => {
                "a stack of an interpreter that could not be read: native frames only (the summary says why)"
            }
            Counter::SymbolizerBehind => {
                "a stall finished while the symbolizer was behind: its native frames are unnamed"
            }
            Counter::AsyncioTaskUnverified => {
                "a stall's running task was not on its stack (the loop moved on): no task named"
            }
            Counter::AsyncioTaskUnreadable => {
                "asyncio's state or the running task could not be read: a stall has no task named"
            }
            Counter::AsyncioTaskUnknown => {
                "a stack shows a task step, but no read found a running task: no task named"
            }
            Counter::AsgiRouteUnrouted => {
                "a stall served a request before routing, or no route matched: no route named"
            }
            Counter::AsgiRouteUnverified => {
                "a stall's request was not provably the one read: no route named"
            }
            Counter::AsgiRouteUnreadable => {
                "a stall's request could not be read: no route named (docs/asgi.md)"
            }
            Counter::OtelSpanUnreadable => {
                "a stall's task or thread context could not be read: no trace or span id named \
                 (stalls.json task.trace_unreadable or thread_context.trace_unreadable says why)"
            }
            Counter::OtelSpanUnsupported => {
                "a stall ran OpenTelemetry's instrumentation in a Node process, whose context \
                 stallprof does not read: no trace or span id named \
                 (docs/architecture.md#node-trace-context)"
            }
            Counter::OtelSpanUnverified => {
                "a stall's task (with none, its thread's context) was in an OpenTelemetry span, \
                 but had moved on from the stall's stack at every read: no trace or span id named"
            }
            Counter::OtlpSpansFailed => {
                "a stall's span did not reach the OTLP collector (down, refused, or past the \
                 end's deadline): the local outputs have the stall"
            }
            Counter::HeldUpUnread => {
                "a Python or Node loop's stall whose timers and callbacks were not read in time, or could not be: what it held up is not said"
            }
            Counter::SwitchInsMissed => {
                "a thread ran with its switch-in unseen: its off-CPU time ends at that sample"
            }
            Counter::JsFramesUnreadable => {
                "a JavaScript frame of JIT code or a V8 builtin could not be read: it is unnamed"
            }
        }
    }
}

/// Every counter a recording's `drops` can hold, by name: the kernel's,
/// the agent's and the read limits', each with its cost and meaning. A
/// name two of them share (`user_stack_truncated`, the kernel's before the
/// agent counted it) is the agent's.
pub fn every_counter() -> Vec<(&'static str, Cost, &'static str)> {
    let mut all: Vec<(&'static str, Cost, &'static str)> = Counter::ALL
        .iter()
        .map(|c| (c.name(), c.cost(), c.meaning()))
        .collect();
    let kernel = profiler_common::Drop::ALL
        .iter()
        .map(|d| (d.name(), d.cost(), d.meaning()));
    let limits = crate::os::limits::every()
        .into_iter()
        .map(|l| (l.name(), l.cost(), l.meaning()));
    for c in kernel.chain(limits) {
        if !all.iter().any(|a| a.0 == c.0) {
            all.push(c);
        }
    }
    all
}

/// What the counter `name` of a recording's `drops` cost and means; None
/// for a name this version does not know (a recording from another).
pub fn explain(name: &str) -> Option<(Cost, &'static str)> {
    every_counter()
        .into_iter()
        .find(|c| c.0 == name)
        .map(|(_, cost, what)| (cost, what))
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

    /// docs/format.md's table of counters, as it must read: every counter
    /// `drops` can hold, then the kernel's `kernel_filtered`, each with its
    /// cost and meaning from its owner.
    fn doc_table() -> String {
        let filtered = profiler_common::Filtered::ALL
            .iter()
            .map(|f| (f.name(), f.cost(), f.meaning()));
        let mut t = String::from("| counter | cost | one count means |\n|---|---|---|\n");
        for (name, cost, meaning) in every_counter().into_iter().chain(filtered) {
            t.push_str(&format!("| `{name}` | {} | {meaning} |\n", cost.as_str()));
        }
        t
    }

    /// The table in docs/format.md is the one the owners say, so it cannot
    /// drift from them: a new counter, or a changed meaning, fails here with
    /// the table to paste.
    #[test]
    fn the_docs_table_of_counters_is_the_owners() {
        let doc = include_str!("../../../docs/format.md");
        let want = doc_table();
        assert!(
            doc.contains(&want),
            "docs/format.md's table of counters must read:\n{want}"
        );
    }

    /// The one meaning that names a kernel limit says the limit's value.
    #[test]
    fn the_python_depth_said_is_the_kernels() {
        let said = format!("over {} frames", profiler_common::python::PY_MAX_FRAMES);
        assert!(
            profiler_common::Drop::PyTruncated.meaning().contains(&said),
            "{said}"
        );
    }

    #[test]
    fn every_name_is_explained_and_the_agents_is_kept() {
        assert_eq!(
            explain("upkeep_deferred"),
            Some((Cost::Harmless, Counter::UpkeepDeferred.meaning()))
        );
        assert_eq!(
            explain("cpu_wait_slot_busy").map(|e| e.0),
            Some(Cost::Holders)
        );
        assert_eq!(
            explain("limit_elf_too_large").map(|e| e.0),
            Some(Cost::Frames)
        );
        assert_eq!(explain("no_such_counter"), None);
        let names: Vec<&str> = every_counter().iter().map(|c| c.0).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        for (name, _, meaning) in every_counter() {
            assert!(
                !meaning.is_empty() && !meaning.ends_with('.'),
                "{name}: {meaning:?}"
            );
        }
    }

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
