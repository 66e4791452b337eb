//! What a Node process's loop has waiting while a stall holds it: its
//! JavaScript timers (`setTimeout`, `setInterval`) with the time each
//! comes due, and the `setImmediate` callbacks queued, read from outside
//! the process with no flag and no change to it.
//!
//! In: the JavaScript frames of one stack event of the stall (a way into
//! the heap, and `processTimers`' argument when the stall is in a timer),
//! and libuv's default loop and Node's `Environment::RunTimers` from the
//! binary's symbols (a shared libuv's loop through `uv_default_loop`'s
//! code, [`super::LoopAt`]). Out: [`Queues`], each timer's due time on
//! CLOCK_MONOTONIC, or why not ([`QueuesMiss`]).
//!
//! How (Node's `lib/internal/timers.js`, the same in Node 18-24; every V8
//! offset and type from the binary's postmortem metadata, [`TimerMeta`],
//! except a `PropertyCell`'s name and value, which are checked by type):
//! 1. **The timers module.** A frame's function → its context → up its
//!    scopes (`previous`) to the native context → the global object (its
//!    extension slot) → the
//!    global dictionary's `setInterval` cell → that function's context
//!    (the scope of `lib/timers.js`) → by the `ScopeInfo`'s names of its
//!    locals, the context of a function it imported from
//!    `lib/internal/timers.js` (`insert`): that module's scope, which holds
//!    `nextExpiry`, `timerListQueue` and `immediateQueue`. Kept per
//!    process, checked at each read (its `ScopeInfo` still at its slot 0),
//!    found again when it moved.
//! 2. **The timers.** `timerListQueue` is a `PriorityQueue` whose private
//!    `#heap` array holds, at 1..=`#size`, one `TimersList` per duration
//!    (`msecs`): a circular list (`_idleNext`) of the `Timeout`s started
//!    with it, oldest first. A `Timeout` comes due at `_idleStart + msecs`,
//!    in milliseconds of libuv's loop clock counted from the Environment's
//!    timer base (`uv_now` when it was made). A timer whose callback is
//!    running is out of its list, and back in (a `setInterval`) only after.
//! 3. **The clock.** The base is kept by no variable JavaScript or the
//!    metadata reaches. Readings that each bound it from above anchor it;
//!    the least is kept per process ([`TimerState::base_ms`]):
//!    - the one libuv timer every JavaScript timer shares (`RunTimers`'
//!      handle, found in the default loop's handle queue) was armed for
//!      base + `nextExpiry` (both set together, by `insert` and by the
//!      return of `processTimers`; for later only when the loop clock had
//!      moved on). Taken only when no update is half done: the timer armed
//!      (a timer pass stops it, and `processTimers` sets `nextExpiry`
//!      before `RunTimers` arms it again), `nextExpiry` finite and not
//!      after the queue's first list's `expiry` (`insert` queues a new list
//!      and arms the timer before it sets `nextExpiry`), both read twice
//!      and the same;
//!    - in a timer pass, `processTimers(now)`'s `now` (from the stack copy)
//!      was the loop clock less the base when the pass began, and the loop
//!      clock (`uv_loop_t.time`) never goes back: clock − now ≥ base, equal
//!      unless a repeating timer ran earlier in that pass (its
//!      `getLibuvNow()` moves the clock to the time it began). Taken only
//!      when the timer that began the pass (stopped since) brackets it from
//!      below within [`MAX_BRACKET_MS`]: it was due at base + E, with E ≤
//!      now and E ≤ the queue's first list's expiry, so base ≥ its due
//!      time less either (a pass that began late and ran another list
//!      first, or ran long before the stall, gives no anchor: said, never
//!      guessed).
//!
//!    libuv's clock is CLOCK_MONOTONIC, or CLOCK_MONOTONIC_COARSE when its
//!    resolution is 1 ms or finer, in whole milliseconds: a due time is up
//!    to ~1 ms before BPF's clock would put it, a lateness up to ~1 ms
//!    over.
//! 4. **Ready work.** The `setImmediate` callbacks queued:
//!    `immediateQueue`'s list (`head`, `_idleNext`).
//!
//! Only the main thread's loop (libuv's default loop) is read: a worker
//! thread's stall says so. libuv's layout (x86-64, libuv 1.44-1.51: the
//! handle queue at [`UV_LOOP_HANDLE_QUEUE`], the clock at
//! [`UV_LOOP_TIME`], a timer's flags, callback and due time) is checked:
//! on every read, the handle must name the loop, be a timer and run
//! `RunTimers`; when it is found, the loop's timer heap must hold a timer
//! of the loop where the clock's neighbour is.
//! Every object is type-checked, every list bounded ([`MAX_HANDLES`]).
//!
//! Cost, per stall: the module is found once per process (~2 ms, most of
//! it the global dictionary's cells); a read is then ~200 µs of checks and
//! anchors plus one read of each `Timeout` (~2.5 µs a timer; the maps met
//! are learnt once per read, [`Shapes`]), docs/benchmarks.md.

use std::collections::HashMap;

use super::objects::{Property, Shapes};
use super::{JsResolver, LoopAt, smi, untag};
use crate::kernel::event::JsSlot;
use crate::os::memory::ReadMemory;
use crate::symbolize::queues::{MAX_HANDLES, Queues, QueuesMiss};

/// `uv_loop_t.handle_queue` (after `data` and `active_handles`).
pub const UV_LOOP_HANDLE_QUEUE: u64 = 16;
/// `uv_loop_t.timer_heap` (`min`, `nelts`), then `timer_counter`, `time`.
const UV_LOOP_TIMER_HEAP: u64 = 520;
/// `uv_loop_t.time`: the loop's clock, in ms.
pub const UV_LOOP_TIME: u64 = 544;
/// `uv_handle_t`: `loop`, `type`, `handle_queue`.
const UV_HANDLE_LOOP: u64 = 8;
const UV_HANDLE_TYPE: u64 = 16;
const UV_HANDLE_QUEUE: u64 = 32;
/// `uv_handle_t.flags` (unix: after `next_closing`) and its
/// `UV_HANDLE_ACTIVE` bit.
const UV_HANDLE_FLAGS: u64 = 88;
const UV_HANDLE_ACTIVE: u32 = 0x4;
/// `uv_timer_t` after the handle's fields: `timer_cb`, its heap node,
/// `timeout`.
const UV_TIMER_CB: u64 = 96;
const UV_TIMER_HEAP_NODE: u64 = 104;
const UV_TIMER_TIMEOUT: u64 = 128;
/// `UV_TIMER` in `uv_handle_type`.
const UV_TIMER: u32 = 13;
/// A `PropertyCell`: map, `name`, `property_details_raw`, `value`.
const PROPERTY_CELL_NAME: u64 = 8;
const PROPERTY_CELL_VALUE: u64 = 24;
/// Largest global dictionary scanned (Node's has ~130 of 256 entries).
const MAX_GLOBALS: u64 = 4096;
/// Most locals of a scope looked at (inline names stop at 75).
const MAX_LOCALS: u64 = 128;
/// Most functions of `lib/timers.js`'s scope whose context is tried.
const MAX_IMPORTS: usize = 64;
/// Most contexts followed from a function's to its native context.
const MAX_SCOPES: usize = 64;
/// Walks of the timer lists made for one read when one is torn.
const READ_TRIES: u32 = 3;
/// Widest bracket of the timer base a timer pass's anchor is taken with.
const MAX_BRACKET_MS: u64 = 3;
/// Most timer lists (one per duration).
const MAX_LISTS: u64 = 1024;

/// The V8 metadata a timers read needs beyond a frame's and an object's.
#[derive(Clone, Debug)]
pub struct TimerMeta {
    jsf_context: u64,
    context_prev: u64,
    first_context: u16,
    last_context: u16,
    context_min_slots: u64,
    t_global_object: u16,
    global_dictionary: u64,
    t_property_cell: u16,
    t_heap_number: u16,
    heap_number_value: u64,
    t_js_array: u16,
    elements: u64,
    t_oddball: u16,
}

impl TimerMeta {
    /// From the binary's `v8dbg_*` values. Err: the names it lacks.
    pub fn read(vals: &HashMap<String, i64>) -> Result<TimerMeta, String> {
        let mut values = super::Values::new(vals);
        let mut get = |names: &[&str]| values.get(names);
        let meta = TimerMeta {
            jsf_context: get(&[
                "class_JSFunction__context__Context",
                "class_JSFunction__context__Tagged_Context_",
            ]) as u64,
            context_prev: get(&["context_idx_prev"]) as u64,
            first_context: get(&["FirstContextType"]) as u16,
            last_context: get(&["LastContextType"]) as u16,
            context_min_slots: get(&["context_min_slots"]) as u64,
            t_global_object: get(&["type_JSGlobalObject__JS_GLOBAL_OBJECT_TYPE"]) as u16,
            global_dictionary: get(&[
                "class_JSGlobalObject__global_dictionary__GlobalDictionary",
                "class_JSGlobalObject__global_dictionary__Tagged_GlobalDictionary_",
            ]) as u64,
            t_property_cell: get(&["type_PropertyCell__PROPERTY_CELL_TYPE"]) as u16,
            t_heap_number: get(&["type_HeapNumber__HEAP_NUMBER_TYPE"]) as u16,
            heap_number_value: get(&["class_HeapNumber__value__double"]) as u64,
            t_js_array: get(&["type_JSArray__JS_ARRAY_TYPE"]) as u16,
            elements: get(&[
                "class_JSObject__elements__Object",
                "class_JSObject__elements__Tagged_FixedArrayBase_",
            ]) as u64,
            t_oddball: get(&["type_Oddball__ODDBALL_TYPE"]) as u16,
        };
        values
            .done()
            .map_err(|missing| format!("V8's postmortem metadata lacks {missing}"))?;
        Ok(meta)
    }
}

/// Where `lib/internal/timers.js`'s scope keeps what is read: its context
/// (tagged), the `ScopeInfo` at its slot 0 then, and the slots of
/// `nextExpiry`, `timerListQueue`, `immediateQueue`.
#[derive(Clone, Copy, Debug)]
struct Module {
    context: u64,
    scope_info: u64,
    next_expiry: u64,
    queue: u64,
    immediates: u64,
}

/// The timer lists as read.
#[derive(Debug, Default)]
struct Lists {
    /// Each timer's due time, ms from the timer base.
    due_ms: Vec<f64>,
    /// The queue's first list's `expiry` (the earliest).
    head_expiry: Option<f64>,
}

/// What the reads of one process's timers keep.
#[derive(Debug, Default)]
pub struct TimerState {
    module: Option<Module>,
    /// `RunTimers`' libuv timer handle.
    handle: Option<u64>,
    /// The Environment's timer base on the loop clock (ms), the least of
    /// the readings that bound it.
    pub base_ms: Option<u64>,
}

type Miss = QueuesMiss;

/// A libuv timer as read: armed or not, its callback, when it is (or was
/// last) due on the loop clock (ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UvTimer {
    active: bool,
    cb: u64,
    timeout: u64,
}

fn unreadable(why: impl Into<String>) -> Miss {
    QueuesMiss::Unreadable(why.into())
}

impl JsResolver {
    fn timer_meta(&self) -> Result<TimerMeta, Miss> {
        self.meta
            .timers
            .clone()
            .map_err(|e| QueuesMiss::Unsupported(format!("node: {e}")))
    }

    /// What the loop of the thread whose stack `slots` are (innermost
    /// first) has waiting now; `main`: it is the process's main thread.
    pub fn node_timers(&mut self, main: bool, slots: &[JsSlot]) -> Result<Queues, QueuesMiss> {
        if !main {
            return Err(QueuesMiss::NoLoop(
                "a worker thread: only the main thread's loop (libuv's default loop) is read",
            ));
        }
        let uv =
            self.meta.uv.clone().map_err(|why| {
                QueuesMiss::Unsupported(format!("node: libuv's default loop: {why}"))
            })?;
        let tm = self.timer_meta()?;
        self.object_meta()
            .map_err(|e| QueuesMiss::Unsupported(format!("node: {e}")))?;
        let module = self.timers_module(&tm, slots)?;
        let lp = match uv.default_loop {
            LoopAt::Struct(a) => a,
            LoopAt::Pointer(p) => self
                .u64_at(p)
                .filter(|&a| a != 0)
                .ok_or_else(|| unreadable("libuv's default_loop_ptr is not set"))?,
        };
        let handle = self.timer_handle(lp, uv.run_timers)?;
        // The target runs on (a stall in JavaScript allocates, and a
        // scavenge moves young objects under the walk): a torn walk is read
        // again, up to READ_TRIES times in all.
        let mut tries = 0;
        let (mut q, lists) = loop {
            tries += 1;
            let mut q = Queues::default();
            let mut shapes = Shapes::default();
            let read = self
                .timer_lists(&tm, module, &mut shapes, &mut q.truncated)
                .and_then(|lists| {
                    q.ready_handles =
                        self.immediates(&tm, module, &mut shapes, &mut q.truncated)?;
                    Ok(lists)
                });
            match read {
                Ok(lists) => break (q, lists),
                Err(QueuesMiss::Unreadable(_)) if tries < READ_TRIES => {}
                Err(e) => return Err(e),
            }
        };
        if lists.due_ms.is_empty() {
            // No timer pending: nothing to place on the clock.
            return Ok(q);
        }
        let timer = |r: &Self| {
            r.uv_timer(lp, handle)
                .ok_or_else(|| unreadable("libuv's timer moved"))
        };
        let clock = self
            .u64_at(lp.wrapping_add(UV_LOOP_TIME))
            .ok_or_else(|| unreadable("libuv's loop clock"))?;
        // The clock's anchors, each at least the base (see the module's doc).
        let mut anchors = Vec::with_capacity(2);
        // (1) The armed timer and `nextExpiry`, read twice (kept when both
        // readings agree; a mutable HeapNumber may change in place: its
        // value is compared), never mid-update: armed (a timer pass has it
        // stopped, its `nextExpiry` set before `RunTimers` arms it again),
        // and not after the queue's first list (`insert` puts a new list in
        // the queue, arms the timer, then sets `nextExpiry`).
        let next_expiry = |r: &Self| {
            r.slot_of(module.context, module.next_expiry)
                .and_then(|n| r.number(&tm, n))
                .map(f64::to_bits)
        };
        let (t1, n1) = (timer(self)?, next_expiry(self));
        let (t2, n2) = (timer(self)?, next_expiry(self));
        if t1 == t2
            && n1 == n2
            && t1.active
            && let Some(next) = n1
                .map(f64::from_bits)
                .filter(|n| n.is_finite() && *n >= 0.0)
            && lists.head_expiry.is_some_and(|h| next <= h)
            && let Some(c) = t1.timeout.checked_sub(next as u64)
        {
            anchors.push(c);
        }
        // (2) In a timer pass: the loop clock less `processTimers`' `now`,
        // taken when the base is bracketed from below within
        // MAX_BRACKET_MS. The timer that began the pass (stopped, not
        // armed again since) was due at base + E, where E was the least
        // expiry of any list then: E <= now (it had come due) and E <= the
        // queue's first list's expiry now (lists added since expire later,
        // lists run in this pass left or expire after now). So
        // base >= due - now and base >= due - first expiry.
        if let Some(now) = self.pass_began(&tm, slots)
            && !t2.active
            && let Some(upper) = clock.checked_sub(now)
        {
            let lower = [
                t2.timeout.checked_sub(now),
                lists
                    .head_expiry
                    .and_then(|h| t2.timeout.checked_sub(h as u64)),
            ]
            .into_iter()
            .flatten()
            .max();
            if let Some(lower) = lower
                && upper >= lower
                && upper - lower <= MAX_BRACKET_MS
            {
                anchors.push(upper);
            }
        }
        let state = &mut self.timers;
        for c in anchors {
            let least = state.base_ms.map_or(c, |b| b.min(c));
            if state.base_ms != Some(least) {
                log::debug!(
                    "node timers: the timer base anchored at {least} ms (was {:?})",
                    state.base_ms
                );
            }
            state.base_ms = Some(least);
        }
        let Some(base) = self.timers.base_ms else {
            return Err(unreadable(
                "Node's timer clock is not anchored yet: its timers were read while no \
                 timer was armed and outside a timer pass that began on time (the next \
                 stalls are read)",
            ));
        };
        if base > clock {
            self.timers.base_ms = None;
            return Err(unreadable(format!(
                "Node's timer clock anchor ({base} ms) is past the loop's clock ({clock} ms)"
            )));
        }
        q.timers_when_ns = lists
            .due_ms
            .into_iter()
            .map(|d| ((base as f64 + d) * 1e6) as u64)
            .collect();
        Ok(q)
    }

    /// The value in slot `i` of the context at tagged `ctx` (where it is
    /// now, if the GC moved it).
    fn slot_of(&self, ctx: u64, i: u64) -> Option<u64> {
        let m = &self.meta;
        let (addr, _) = self.typed(ctx)?;
        self.u64_at(addr.wrapping_add(m.fixed_data).wrapping_add(8 * i))
    }

    /// A number (a Smi or a `HeapNumber`).
    fn number(&self, tm: &TimerMeta, v: u64) -> Option<f64> {
        if let Some(i) = smi(v) {
            return Some(i as f64);
        }
        let (addr, t) = self.typed(v)?;
        (t == tm.t_heap_number)
            .then(|| self.u64_at(addr + tm.heap_number_value))
            .flatten()
            .map(f64::from_bits)
    }

    /// `lib/internal/timers.js`'s scope: kept, or found from `slots`.
    fn timers_module(&mut self, tm: &TimerMeta, slots: &[JsSlot]) -> Result<Module, Miss> {
        if let Some(m) = self.timers.module {
            // Still there: a context at the same address (not moved: a
            // forwarded copy is found again from the stack), its scope the
            // same.
            let unmoved = self
                .typed(m.context)
                .is_some_and(|(a, _)| Some(a) == untag(&self.meta, m.context));
            if unmoved
                && self.is_context(tm, m.context)
                && self.slot_of(m.context, 0) == Some(m.scope_info)
            {
                return Ok(m);
            }
            self.timers.module = None;
        }
        let mut last = unreadable("no JavaScript frame to reach the heap from");
        for slot in slots.iter().take(8) {
            match self.find_module(tm, slot.func) {
                Ok(m) => {
                    self.timers.module = Some(m);
                    return Ok(m);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn is_context(&self, tm: &TimerMeta, v: u64) -> bool {
        self.typed(v)
            .is_some_and(|(_, t)| (tm.first_context..=tm.last_context).contains(&t))
    }

    /// Find the module's scope from function `func`'s native context.
    fn find_module(&mut self, tm: &TimerMeta, func: u64) -> Result<Module, Miss> {
        let m = self.meta.clone();
        // A function's context chain (its scopes, the script's) ends at the
        // native context, whose `previous` is no context.
        let (f, t) = self
            .typed(func)
            .ok_or_else(|| unreadable("a frame's function is not there"))?;
        if t < m.t_jsf_first || t > m.t_jsf_last {
            return Err(unreadable("a frame's function is not a JSFunction"));
        }
        let mut native = self
            .u64_at(f + tm.jsf_context)
            .filter(|&c| self.is_context(tm, c))
            .ok_or_else(|| unreadable("a frame's function has no context"))?;
        let mut ended = false;
        for _ in 0..MAX_SCOPES {
            match self.slot_of(native, tm.context_prev) {
                Some(p) if self.is_context(tm, p) => native = p,
                _ => {
                    ended = true;
                    break;
                }
            }
        }
        if !ended {
            return Err(unreadable(format!(
                "a function's scopes run over {MAX_SCOPES} contexts"
            )));
        }
        let global = self
            .slot_of(native, tm.context_min_slots)
            .filter(|&g| self.typed(g).is_some_and(|(_, t)| t == tm.t_global_object))
            .ok_or_else(|| unreadable("the native context holds no global object"))?;
        let set_interval = self.global_function(tm, global, "setInterval")?;
        let timers_js = self
            .typed(set_interval)
            .and_then(|(a, _)| self.u64_at(a + tm.jsf_context))
            .filter(|&c| self.is_context(tm, c))
            .ok_or_else(|| unreadable("setInterval has no context"))?;
        let names = self.context_locals(timers_js)?;
        if let Some(found) = self.module_at(timers_js, &names) {
            return Ok(found);
        }
        // The module that defines the timers: the context of a function
        // `lib/timers.js` imported from it (`insert` first).
        let mut order: Vec<usize> = (0..names.len()).collect();
        order.sort_by_key(|&i| names[i] != "insert");
        for i in order.into_iter().take(MAX_IMPORTS) {
            let Some(v) = self.slot_of(timers_js, tm.context_min_slots + i as u64) else {
                continue;
            };
            let Some((a, t)) = self.typed(v) else {
                continue;
            };
            if t < m.t_jsf_first || t > m.t_jsf_last {
                continue;
            }
            let Some(ctx) = self
                .u64_at(a + tm.jsf_context)
                .filter(|&c| c != timers_js && self.is_context(tm, c))
            else {
                continue;
            };
            if let Ok(names) = self.context_locals(ctx)
                && let Some(found) = self.module_at(ctx, &names)
            {
                return Ok(found);
            }
        }
        Err(unreadable(
            "no scope reached from setInterval holds nextExpiry and timerListQueue \
             (lib/internal/timers.js changed?)",
        ))
    }

    /// The module's slots in context `ctx` whose locals are `names`, if
    /// they are all there.
    fn module_at(&self, ctx: u64, names: &[String]) -> Option<Module> {
        let min = self.meta.timers.as_ref().ok()?.context_min_slots;
        let at = |n: &str| names.iter().position(|x| x == n).map(|i| min + i as u64);
        Some(Module {
            context: ctx,
            scope_info: self.slot_of(ctx, 0)?,
            next_expiry: at("nextExpiry")?,
            queue: at("timerListQueue")?,
            immediates: at("immediateQueue")?,
        })
    }

    /// The names of the context locals of context `ctx`'s scope, in slot
    /// order.
    fn context_locals(&self, ctx: u64) -> Result<Vec<String>, Miss> {
        let m = &self.meta;
        let si = self
            .slot_of(ctx, 0)
            .and_then(|s| self.typed(s))
            .filter(|&(_, t)| t == m.t_scope_info)
            .map(|(a, _)| a)
            .ok_or_else(|| unreadable("a context has no ScopeInfo"))?;
        let word = |i: u64| self.u64_at(si + 8 + 8 * i);
        let n = word(m.scope_ncontextlocals)
            .and_then(smi)
            .filter(|&n| (0..=MAX_LOCALS as i64).contains(&n))
            .ok_or_else(|| unreadable("a scope's count of locals is unreadable"))?
            as u64;
        let raw = self
            .mem
            .read_bytes(si + 8 + 8 * m.scope_first_vars, 8 * n as usize)
            .map_err(|e| unreadable(format!("a scope's local names: {e}")))?;
        raw.chunks_exact(8)
            .map(|c| {
                let v = u64::from_le_bytes(c.try_into().unwrap());
                self.string(v, 64, super::MAX_STRING_DEPTH).ok_or_else(|| {
                    unreadable("a scope's local names are not inline strings (too many locals)")
                })
            })
            .collect()
    }

    /// The function the global object's property `name` holds.
    fn global_function(&self, tm: &TimerMeta, global: u64, name: &str) -> Result<u64, Miss> {
        let m = &self.meta;
        let (g, _) = self
            .typed(global)
            .ok_or_else(|| unreadable("the global object"))?;
        let (dict, _) = self
            .u64_at(g + tm.global_dictionary)
            .and_then(|d| self.typed(d))
            .ok_or_else(|| unreadable("the global object's dictionary"))?;
        let len = self
            .u64_at(dict + m.fixed_length)
            .and_then(smi)
            .filter(|&l| l > 3 && l as u64 <= MAX_GLOBALS)
            .ok_or_else(|| unreadable("the global dictionary's length"))? as u64;
        let raw = self
            .mem
            .read_bytes(dict + m.fixed_data, 8 * len as usize)
            .map_err(|e| unreadable(format!("the global dictionary: {e}")))?;
        for c in raw.chunks_exact(8).skip(3) {
            let v = u64::from_le_bytes(c.try_into().unwrap());
            let Some((cell, t)) = self.typed(v) else {
                continue;
            };
            if t != tm.t_property_cell {
                continue;
            }
            let key = self.u64_at(cell + PROPERTY_CELL_NAME);
            if key
                .and_then(|k| self.string(k, name.len() as u32, 1))
                .as_deref()
                != Some(name)
            {
                continue;
            }
            return self
                .u64_at(cell + PROPERTY_CELL_VALUE)
                .filter(|&f| {
                    self.typed(f)
                        .is_some_and(|(_, t)| t >= m.t_jsf_first && t <= m.t_jsf_last)
                })
                .ok_or_else(|| unreadable(format!("globalThis.{name} is not a function")));
        }
        Err(unreadable(format!("globalThis.{name} is not there")))
    }

    /// `RunTimers`' libuv timer handle: kept, or found in the loop's
    /// handle queue; checked either way.
    fn timer_handle(&mut self, lp: u64, run_timers: u64) -> Result<u64, Miss> {
        let is_it = |r: &Self, h: u64| r.uv_timer(lp, h).is_some_and(|t| t.cb == run_timers);
        if let Some(h) = self.timers.handle.filter(|&h| is_it(self, h)) {
            return Ok(h);
        }
        self.timers.handle = None;
        let head = lp.wrapping_add(UV_LOOP_HANDLE_QUEUE);
        let mut node = self
            .u64_at(head)
            .ok_or_else(|| unreadable("libuv's default loop is unreadable"))?;
        let mut found = None;
        for _ in 0..MAX_HANDLES {
            if node == head || node == 0 {
                break;
            }
            let h = node.wrapping_sub(UV_HANDLE_QUEUE);
            if is_it(self, h) {
                found = Some(h);
                break;
            }
            node = self
                .u64_at(node)
                .ok_or_else(|| unreadable("libuv's handle queue is unreadable"))?;
        }
        let h = found.ok_or_else(|| {
            QueuesMiss::Unsupported(format!(
                "node: no libuv timer running node::Environment::RunTimers in the default \
                 loop's first {MAX_HANDLES} handles (a libuv layout other than 1.44-1.51?)"
            ))
        })?;
        // The loop's timer heap holds the loop's timers only: the clock
        // next to it is where it is read (checked when the handle is found).
        let min = self
            .u64_at(lp.wrapping_add(UV_LOOP_TIMER_HEAP))
            .ok_or_else(|| unreadable("libuv's timer heap"))?;
        if min != 0
            && self
                .uv_timer(lp, min.wrapping_sub(UV_TIMER_HEAP_NODE))
                .is_none()
        {
            return Err(QueuesMiss::Unsupported(
                "node: libuv's default loop has no timer heap where libuv 1.44-1.51 keeps it"
                    .into(),
            ));
        }
        self.timers.handle = Some(h);
        Ok(h)
    }

    /// The libuv timer at `h`, if it is a timer of loop `lp`.
    fn uv_timer(&self, lp: u64, h: u64) -> Option<UvTimer> {
        let b = self
            .mem
            .read_bytes(h, (UV_TIMER_TIMEOUT + 8) as usize)
            .ok()?;
        let w = |o: u64| u64::from_le_bytes(b[o as usize..][..8].try_into().unwrap());
        (w(UV_HANDLE_LOOP) == lp && w(UV_HANDLE_TYPE) as u32 == UV_TIMER).then(|| UvTimer {
            active: w(UV_HANDLE_FLAGS) as u32 & UV_HANDLE_ACTIVE != 0,
            cb: w(UV_TIMER_CB),
            timeout: w(UV_TIMER_TIMEOUT),
        })
    }

    /// `processTimers(now)`'s `now` when a frame of the stack is it.
    fn pass_began(&mut self, tm: &TimerMeta, slots: &[JsSlot]) -> Option<u64> {
        for slot in slots {
            let Some(frame) = self.cached(slot).or_else(|| self.resolve(slot.func)) else {
                continue;
            };
            if frame.name == "processTimers"
                && frame
                    .file
                    .as_deref()
                    .is_some_and(|f| f.contains("internal/timers"))
            {
                let now = self.number(tm, slot.arg0)?;
                return (now.is_finite() && now >= 0.0).then_some(now as u64);
            }
        }
        None
    }

    /// The values of data properties `names` of the object at tagged `obj`.
    fn values<const N: usize>(
        &self,
        obj: u64,
        names: [&'static str; N],
        shapes: &mut Shapes,
    ) -> Result<[u64; N], Miss> {
        let props = self
            .properties(obj, names, shapes)
            .map_err(|e| unreadable(format!("{}: {e}", names.join(", "))))?;
        let mut out = [0u64; N];
        for ((o, p), name) in out.iter_mut().zip(props).zip(names) {
            match p {
                Property::Value(v) => *o = v,
                _ => return Err(unreadable(format!("no {name} where Node keeps it"))),
            }
        }
        Ok(out)
    }

    /// The due time of every timer in the module's lists, in ms from the
    /// timer base (at most [`MAX_HANDLES`]; more sets `truncated`).
    fn timer_lists(
        &self,
        tm: &TimerMeta,
        module: Module,
        shapes: &mut Shapes,
        truncated: &mut bool,
    ) -> Result<Lists, Miss> {
        let mut out = Lists::default();
        let m = &self.meta;
        let queue = self
            .slot_of(module.context, module.queue)
            .ok_or_else(|| unreadable("timerListQueue"))?;
        let [heap, size] = self.values(queue, ["#heap", "#size"], shapes)?;
        let size = smi(size)
            .filter(|&s| s >= 0)
            .ok_or_else(|| unreadable("timerListQueue's #size is not a count"))?
            as u64;
        if size > MAX_LISTS {
            return Err(unreadable(format!(
                "{size} timer lists, over the {MAX_LISTS} read"
            )));
        }
        let (arr, t) = self
            .typed(heap)
            .ok_or_else(|| unreadable("timerListQueue's #heap"))?;
        if t != tm.t_js_array {
            return Err(unreadable("timerListQueue's #heap is not an array"));
        }
        let (elems, et) = self
            .u64_at(arr + tm.elements)
            .and_then(|e| self.typed(e))
            .ok_or_else(|| unreadable("#heap's elements"))?;
        if et != m.t_fixed_array {
            return Err(unreadable(format!(
                "#heap's elements are not a FixedArray (type {et:#x})"
            )));
        }
        let len = self
            .u64_at(elems + m.fixed_length)
            .and_then(smi)
            .ok_or_else(|| unreadable("#heap's length"))? as u64;
        if size >= len {
            return Err(unreadable("#heap is shorter than #size"));
        }
        let lists = self
            .mem
            .read_bytes(elems + m.fixed_data + 8, 8 * size as usize)
            .map_err(|e| unreadable(format!("#heap: {e}")))?;
        for (i, c) in lists.chunks_exact(8).enumerate() {
            let list = u64::from_le_bytes(c.try_into().unwrap());
            let [msecs, expiry, mut t] =
                self.values(list, ["msecs", "expiry", "_idleNext"], shapes)?;
            let msecs = self
                .number(tm, msecs)
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| unreadable("a timer list's msecs"))?;
            if i == 0 {
                out.head_expiry = self.number(tm, expiry).filter(|v| v.is_finite());
            }
            // The list is circular: it ends back at the list, which a
            // scavenge during the read may have moved (its old address then
            // forwards to where `_idleNext` points now).
            let list_now = self.typed(list).map(|(a, _)| a);
            while t != list {
                if out.due_ms.len() >= MAX_HANDLES {
                    *truncated = true;
                    return Ok(out);
                }
                if self.typed(t).map(|(a, _)| a) == list_now {
                    break;
                }
                let [start, next] = self.values(t, ["_idleStart", "_idleNext"], shapes)?;
                let start = self
                    .number(tm, start)
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .ok_or_else(|| unreadable("a Timeout's _idleStart"))?;
                out.due_ms.push(start + msecs);
                t = next;
            }
        }
        Ok(out)
    }

    /// How many `setImmediate` callbacks are queued.
    fn immediates(
        &self,
        tm: &TimerMeta,
        module: Module,
        shapes: &mut Shapes,
        truncated: &mut bool,
    ) -> Result<u32, Miss> {
        let queue = self
            .slot_of(module.context, module.immediates)
            .ok_or_else(|| unreadable("immediateQueue"))?;
        let mut n = 0u32;
        let [mut item] = self.values(queue, ["head"], shapes)?;
        // The list ends at `null`; anything else but an Immediate is said.
        loop {
            match self.typed(item) {
                Some((_, t)) if t == tm.t_oddball => break,
                Some(_) if self.js_object(item).is_ok() => {}
                _ => return Err(unreadable("an item of immediateQueue is not an object")),
            }
            if n as usize >= MAX_HANDLES {
                *truncated = true;
                break;
            }
            n += 1;
            [item] = self.values(item, ["_idleNext"], shapes)?;
        }
        Ok(n)
    }
}
