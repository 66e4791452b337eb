//! The OpenTelemetry span active in a `contextvars.Context` of another
//! process: the trace id and span id the service's own SDK reports for the
//! request a stall served, read without the SDK's help.
//!
//! In: a `PyContext*`: an asyncio Task's `task_context`
//! ([`super::TaskReader`]), or, when no task runs, the thread's own current
//! context (`PyThreadState.context`, [`SpanReader::in_thread`]: asyncio's
//! `Handle._run` runs a plain callback under `self._context.run(...)`, the
//! context copied when it was scheduled). Out: a [`SpanRead`]: the span's
//! ids, or that the context holds no span, or why it could not be read.
//!
//! Where the span is (opentelemetry-api 1.x, checked on 1.45):
//! - the current OTel `Context` is the value of a `ContextVar` named
//!   `"current_context"` (`opentelemetry/context/contextvars_context.py`);
//!   a context's variables are a HAMT (`Objects/hamt.c`: bitmap, array
//!   and collision nodes, told apart by their type's `tp_name`), walked
//!   whole ([`MAX_HAMT_NODES`]): its keys are the variables, compared by
//!   type (`_contextvars.ContextVar`) and name (`var_name`);
//! - that `Context` is a `dict`; the active span is under the `str` key
//!   `"current-span-<uuid4>"` (`create_key("current-span")`,
//!   `opentelemetry/trace/propagation/__init__.py`);
//! - a span's `SpanContext` is its `_context` attribute (the SDK's `_Span`
//!   and the API's `NonRecordingSpan` both keep it there), a `tuple`
//!   subclass whose first two items are `trace_id` and `span_id` (`int`s).
//!
//! Layouts (3.10-3.15, x86-64; `ctypes` on pyenv 3.10.13-3.13.0 and Debian
//! testing's 3.14.8, 3.15.0): `PyContext.ctx_vars` at 24, `PyHamtObject.h_root`
//! at 16; a bitmap node's `ob_size` counts the words of its array at 32 (a
//! key and a value each; a NULL key: the value is a sub-node), a
//! collision node's too; an array node holds 32 sub-nodes at 16;
//! `PyContextVar.var_name` at 16. A trace id of zero is OpenTelemetry's
//! invalid span (no span): [`SpanRead::NoSpan`].

use super::PythonError;
use super::objects::{Objects, TPFLAGS_DICT_SUBCLASS};
use crate::model::{ContextTrace, SpanIds};
use crate::os::memory::{ReadMemory, le_u64};

/// HAMT nodes visited in one context (a context holds a handful of
/// variables; a node holds up to 32 entries).
pub const MAX_HAMT_NODES: usize = 256;
/// A HAMT is at most this deep (7 levels of 5 hash bits, and collisions).
const MAX_HAMT_DEPTH: usize = 8;

const CONTEXT_CTX_VARS: u64 = 24;
const HAMT_ROOT: u64 = 16;
const NODE_OB_SIZE: u64 = 16;
const NODE_ITEMS: u64 = 32;
const ARRAY_NODE_ITEMS: u64 = 16;
const ARRAY_NODE_SLOTS: usize = 32;
const CONTEXTVAR_NAME: u64 = 16;

/// The `ContextVar` OpenTelemetry keeps its current `Context` in.
const OTEL_VAR: &str = "current_context";
/// The prefix of the key the active span is under.
const SPAN_KEY: &str = "current-span-";

/// What one read of a context found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpanRead {
    /// The active span's ids: 128-bit trace id, 64-bit span id.
    Span { trace_id: u128, span_id: u64 },
    /// The context is OpenTelemetry's (its `current_context` variable is
    /// set) but holds no span now: a request's task before its server span
    /// opens (the framework's routing, the instrumentation's own code) or
    /// after it closes. A later capture of the stall may be inside one.
    Empty,
    /// The context holds no OpenTelemetry span (no SDK, or no span active).
    NoSpan,
}

/// Reads spans of one process.
pub struct SpanReader {
    obj: Objects,
}

impl SpanReader {
    pub(crate) fn new(
        mem: std::sync::Arc<crate::os::memory::ProcessMemory>,
        layout: super::Layout,
    ) -> Self {
        SpanReader {
            obj: Objects::new(mem, layout),
        }
    }

    /// The span active in context `ctx` (a `PyContext*`; 0: none), or why
    /// it could not be read.
    pub fn read(&self, ctx: u64) -> Result<SpanRead, String> {
        span_in_context(&self.obj, ctx).map_err(|e| e.to_string())
    }

    /// The span active in the current context of thread state `tstate`
    /// (`PyThreadState.context`; NULL, a thread that never entered one: no
    /// span), or why it could not be read.
    pub fn in_thread(&self, tstate: u64) -> Result<SpanRead, String> {
        let at = tstate + u64::from(self.obj.layout.tstate_context);
        let ctx =
            self.obj.mem.read_u64(at).map_err(|e| {
                format!("the thread's context (PyThreadState.context at {at:#x}): {e}")
            })?;
        self.read(ctx)
    }
}

/// A span read from a context and checked against the stall's stack: what
/// the stall keeps (the model's [`ContextTrace`]) and whether the span is
/// still unverified — the context held one, but the thread had moved on
/// from the captured stack when it was read, so it may not be the stall's
/// (a later read of the stall may verify one; `pipeline/reads.rs` keeps
/// the flag, the model never sees it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceFound {
    pub trace: ContextTrace,
    pub span_unverified: bool,
    /// The context was OpenTelemetry's with no span in it when read
    /// ([`SpanRead::Empty`]): read again at the stall's later stack
    /// events, not counted as a miss.
    pub span_pending: bool,
}

impl TraceFound {
    /// What `read` found, kept as the stall's when `still` (the thread
    /// still ran the captured stack at the read).
    pub fn checked(read: Result<SpanRead, String>, still: bool) -> TraceFound {
        let span_pending = read == Ok(SpanRead::Empty);
        let (trace, trace_unreadable, span_unverified) = match read {
            Ok(SpanRead::Span { trace_id, span_id }) if still => {
                (Some(SpanIds::new(trace_id, span_id)), None, false)
            }
            Ok(SpanRead::Span { .. }) => (None, None, true),
            Ok(SpanRead::NoSpan | SpanRead::Empty) => (None, None, false),
            Err(why) => (None, Some(why), false),
        };
        TraceFound {
            trace: ContextTrace {
                trace,
                trace_unreadable,
            },
            span_unverified,
            span_pending,
        }
    }

    /// Whether `self`, a later read of the same task or thread, replaces
    /// `old` as the stall's: a verified span wins (the span at a later
    /// capture: the stall's blocking call may run in a child span opened
    /// after the first), any verified read wins over an unverified one, and
    /// an unverified span over a context that held none yet (so it is
    /// counted).
    pub fn replaces(&self, old: &TraceFound) -> bool {
        self.trace.trace.is_some()
            || (old.span_unverified && !self.span_unverified)
            || (old.span_pending && self.span_unverified)
    }

    /// Whether the stall's later stack events should read it again: a span
    /// unverified, or one found (a later capture's may be a child span), or
    /// an OpenTelemetry context with no span yet (the first capture may
    /// precede the request's span).
    pub fn wants_more(&self) -> bool {
        self.span_unverified || self.span_pending || self.trace.trace.is_some()
    }
}

/// The span active in context `ctx` (a `PyContext*`; 0: none).
fn span_in_context(objs: &Objects, ctx: u64) -> Result<SpanRead, PythonError> {
    if ctx == 0 {
        return Ok(SpanRead::NoSpan);
    }
    let vars = objs.mem.read_u64(ctx + CONTEXT_CTX_VARS)?;
    if vars == 0 || objs.type_name(vars, 8)? != b"hamt" {
        return Err(objs.bad("context variables (not a hamt)", vars));
    }
    let root = objs.mem.read_u64(vars + HAMT_ROOT)?;
    let Some(otel) = find_var(objs, root)? else {
        return Ok(SpanRead::NoSpan);
    };
    if !objs.has_flag(otel, TPFLAGS_DICT_SUBCLASS)? {
        return Err(objs.bad("OpenTelemetry context (not a dict)", otel));
    }
    let span = objs
        .dict_items(otel)?
        .into_iter()
        .find(|&(k, _)| is_span_key(objs, k).unwrap_or(false))
        .map(|(_, v)| v);
    let Some(span) = span else {
        return Ok(SpanRead::Empty);
    };
    span_ids(objs, span)
}

/// The value of the `current_context` variable in the HAMT under `root`.
fn find_var(objs: &Objects, root: u64) -> Result<Option<u64>, PythonError> {
    let mut todo = vec![(root, 0usize)];
    let mut visited = 0;
    while let Some((node, depth)) = todo.pop() {
        if node == 0 {
            continue;
        }
        visited += 1;
        if visited > MAX_HAMT_NODES || depth > MAX_HAMT_DEPTH {
            crate::os::limits::hit(crate::os::limits::Limit::PythonListTooLong);
            return Err(objs.bad("context variables (HAMT too large)", root));
        }
        let kind = objs.type_name(node, 24)?;
        if kind == b"hamt_array_node" {
            let raw = objs
                .mem
                .read_bytes(node + ARRAY_NODE_ITEMS, 8 * ARRAY_NODE_SLOTS)?;
            for i in 0..ARRAY_NODE_SLOTS {
                todo.push((le_u64(&raw, 8 * i), depth + 1));
            }
            continue;
        }
        let bitmap = kind == b"hamt_bitmap_node";
        if !bitmap && kind != b"hamt_collision_node" {
            return Err(objs.bad("context variables (unknown HAMT node)", node));
        }
        let words = objs.mem.read_u64(node + NODE_OB_SIZE)?;
        if words > 2 * ARRAY_NODE_SLOTS as u64 || words % 2 != 0 {
            return Err(objs.bad("context variables (HAMT node size)", node));
        }
        let raw = objs.mem.read_bytes(node + NODE_ITEMS, 8 * words as usize)?;
        for pair in raw.chunks_exact(16) {
            let (key, value) = (le_u64(pair, 0), le_u64(pair, 8));
            if key == 0 {
                if bitmap {
                    todo.push((value, depth + 1));
                }
                continue;
            }
            if is_otel_var(objs, key)? {
                return Ok((value != 0).then_some(value));
            }
        }
    }
    Ok(None)
}

fn is_otel_var(objs: &Objects, key: u64) -> Result<bool, PythonError> {
    if objs.type_name(key, 32)? != b"_contextvars.ContextVar" {
        return Ok(false);
    }
    let name = objs.mem.read_u64(key + CONTEXTVAR_NAME)?;
    objs.ascii_eq(name, OTEL_VAR)
}

fn is_span_key(objs: &Objects, key: u64) -> Result<bool, PythonError> {
    Ok(objs
        .str_value(key, 64)?
        .is_some_and(|k| k.starts_with(SPAN_KEY)))
}

/// A span's `_context`: `(trace_id, span_id, …)`.
fn span_ids(objs: &Objects, span: u64) -> Result<SpanRead, PythonError> {
    let Some(ctx) = objs.attr(span, "_context")? else {
        return Err(objs.bad("span without _context", span));
    };
    let item = |i| {
        objs.tuple_item(ctx, i)?
            .ok_or_else(|| objs.bad("SpanContext (too short)", ctx))
    };
    let trace_id = objs.int_u128(item(0)?)?;
    let span_id = u64::try_from(objs.int_u128(item(1)?)?)
        .map_err(|_| objs.bad("span id (over 64 bits)", ctx))?;
    if trace_id == 0 || span_id == 0 {
        return Ok(SpanRead::NoSpan);
    }
    Ok(SpanRead::Span { trace_id, span_id })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPAN: SpanRead = SpanRead::Span {
        trace_id: 0x2a59,
        span_id: 0x86ab,
    };

    #[test]
    fn a_span_is_kept_only_while_the_thread_runs_the_captured_stack() {
        let kept = TraceFound::checked(Ok(SPAN), true);
        assert_eq!(kept.trace.trace, Some(SpanIds::new(0x2a59, 0x86ab)));
        assert!(!kept.span_unverified);
        let moved = TraceFound::checked(Ok(SPAN), false);
        assert!(moved.trace.is_empty() && moved.span_unverified);
        let none = TraceFound::checked(Ok(SpanRead::NoSpan), false);
        assert!(none.trace.is_empty() && !none.span_unverified);
        let bad = TraceFound::checked(Err("torn".into()), true);
        assert_eq!(bad.trace.trace_unreadable.as_deref(), Some("torn"));
    }

    /// A verified span replaces any earlier read (a later capture's span
    /// may be a child span); a verified read of no span replaces only an
    /// unverified one; an unverified read replaces nothing.
    #[test]
    fn later_verified_reads_win() {
        let kept = TraceFound::checked(Ok(SPAN), true);
        let moved = TraceFound::checked(Ok(SPAN), false);
        let none = TraceFound::checked(Ok(SpanRead::NoSpan), true);
        assert!(kept.replaces(&moved) && kept.replaces(&kept));
        assert!(none.replaces(&moved));
        assert!(!none.replaces(&kept));
        assert!(!moved.replaces(&none) && !moved.replaces(&kept));
        assert!(kept.wants_more() && moved.wants_more() && !none.wants_more());
    }

    /// A request's task read before its server span opened (the first
    /// capture of a stall in FastAPI's routing): read again, not counted;
    /// the span of a later capture replaces it, verified or not (then it
    /// is counted as unverified).
    #[test]
    fn a_context_with_no_span_yet_is_read_again() {
        let empty = TraceFound::checked(Ok(SpanRead::Empty), true);
        assert!(empty.trace.is_empty() && !empty.span_unverified && empty.span_pending);
        assert!(empty.wants_more());
        let kept = TraceFound::checked(Ok(SPAN), true);
        let moved = TraceFound::checked(Ok(SPAN), false);
        assert!(kept.replaces(&empty) && moved.replaces(&empty));
        assert!(!empty.replaces(&kept));
        assert!(!TraceFound::checked(Ok(SpanRead::NoSpan), true).span_pending);
    }
}
