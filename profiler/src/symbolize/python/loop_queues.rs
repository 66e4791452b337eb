//! What an asyncio event loop has waiting while a stall holds it: the
//! timers of its scheduled heap and the handles of its ready queue, read
//! from outside the process (plain asyncio's `BaseEventLoop`, CPython
//! 3.10-3.15).
//!
//! In: the thread and the loops asyncio says are running a task step now
//! ([`super::TaskReader::running_loops`]: 3.14+ the thread state's
//! `asyncio_running_loop`, 3.10-3.13 the keys of `_current_tasks`). Out:
//! [`Queues`] — the due time (`TimerHandle._when`, `loop.time()` =
//! `time.monotonic()` = CLOCK_MONOTONIC, BPF's clock) of every live timer
//! in `loop._scheduled` (a list kept as a heap) and in `loop._ready` (the
//! deque of handles the loop runs in this iteration: timers already popped
//! as due wait there too, behind the running one), and the number of other
//! handles in `_ready` — or why not ([`QueuesMiss`]).
//!
//! Objects read: the loop's own attributes (an instance dict: `BaseEventLoop`
//! has no `__slots__`; [`Objects::attr`]); a `list`'s items; a
//! `collections.deque`'s blocks (`Modules/_collectionsmodule.c`: blocks of
//! [`DEQUE_BLOCK_LEN`] item pointers between a `leftlink` and a
//! `rightlink`; the deque's `leftblock`, `rightblock`, `leftindex`,
//! `rightindex` after its `PyObject_VAR_HEAD`, whose size is the length);
//! `TimerHandle`/`Handle` instances, `__slots__` classes whose `_when` and
//! `_cancelled` offsets are read from their types' `tp_members` (the
//! `PyMemberDef` table CPython builds for slots) at run time, not from a
//! table; a `float`'s value; `bool`s. Checked with `ctypes` on pyenv
//! 3.10.13-3.13.0 (`tp_members` at +240 and `tp_base` at +256 of a type,
//! a `PyMemberDef` of 40 bytes, `_when` at +88 on 3.10/3.11 and +80 on
//! 3.12/3.13, the deque and block layout). Cancelled handles are skipped.
//! Every read is bounded: [`MAX_HANDLES`] items of each queue (more is
//! `truncated`), [`MAX_MEMBERS`] members per type, [`MAX_BASES`] bases.
//!
//! Cost: one read of the loop's dict (two or three on 3.11+'s inline
//! values), one of the list's items, one per deque block (64 handles), and
//! two per timer (the handle, its `_when`): a loop with 40 timers costs
//! about 85 `pread`s of `/proc/PID/mem` (docs/benchmarks.md).

use std::collections::HashMap;
use std::sync::Arc;

use super::PythonError;
use super::objects::{
    Objects, TYPE_TP_BASE, TYPE_TP_BASICSIZE, TYPE_TP_DICT, TYPE_TP_FLAGS, TYPE_TP_WEAKLISTOFFSET,
};
use super::offsets::{Layout, OB_TYPE, VAR_OB_SIZE};
use crate::os::memory::{ProcessMemory, ReadMemory, le_u64};
use crate::symbolize::queues::{MAX_HANDLES, Queues, QueuesMiss};

/// `PyMemberDef` entries looked at per type.
pub const MAX_MEMBERS: u64 = 64;
/// Types followed up `tp_base` for a handle's members.
pub const MAX_BASES: usize = 8;
/// `PyTypeObject.tp_members` (3.10-3.15).
const TYPE_TP_MEMBERS: u64 = 240;
const TPFLAGS_HEAPTYPE: u64 = 1 << 9;
/// `PyMemberDef`: `name`, `type` (int), `offset` (Py_ssize_t), `flags`, `doc`.
const MEMBER_DEF_SIZE: u64 = 40;
/// `dequeobject` after `PyObject_VAR_HEAD`: `leftblock`, `rightblock`,
/// `leftindex`, `rightindex`.
const DEQUE_LEFTBLOCK: u64 = 24;
const DEQUE_HEADER: usize = 56;
/// `BLOCKLEN`: item pointers per deque block, after its `leftlink`; the
/// `rightlink` follows them.
pub const DEQUE_BLOCK_LEN: u64 = 64;
/// Bytes of a uvloop `Loop` before its `__weakref__` looked at, at most.
const UVLOOP_MAX_FIELDS: u64 = 1024;
/// `PyFloatObject.ob_fval`.
const FLOAT_OB_FVAL: u64 = 16;
/// A `bool`'s first word after the header: 3.10/3.11 `ob_size` (1 for
/// `True`), 3.12+ `lv_tag` (`ndigits << 3 | sign`: 8 for `True`, 1 for
/// `False`).
const BOOL_WORD: u64 = 16;

/// What a handle's type says of its instances.
#[derive(Clone, Copy, Debug)]
enum HandleKind {
    /// A `TimerHandle`: offsets of `_when` and `_cancelled`.
    Timer { when: u64, cancelled: u64 },
    /// A `Handle`: offset of `_cancelled`.
    Plain { cancelled: u64 },
    /// Anything else (counted as a ready handle).
    Other,
}

/// Where a uvloop `Loop` type keeps what is read (offsets in the object).
#[derive(Clone, Debug)]
struct UvLoopFields {
    /// `_ready`, the deque of handles `call_soon` queued.
    ready: u64,
    /// Every `set` field; `_timers` is the one that holds `TimerHandle`s.
    sets: Vec<u64>,
    /// `_timers`, once a set was seen holding a `TimerHandle`.
    timers: Option<u64>,
}

/// Reads the queues of one process's asyncio loops (keep it: it caches
/// the handle types and each thread's loop).
pub struct QueueReader {
    obj: Objects,
    /// tid -> the loop last found running on it.
    loops: HashMap<u32, u64>,
    types: HashMap<u64, HandleKind>,
    /// bool object -> its truth.
    bools: HashMap<u64, bool>,
    /// uvloop `Loop` type -> its fields.
    uv_loops: HashMap<u64, UvLoopFields>,
    /// uvloop `TimerHandle` type -> the offset of its `_when`.
    uv_timers: HashMap<u64, u64>,
    /// Type -> its `tp_name` (the types met in a uvloop loop's fields and
    /// sets; at most [`MAX_TYPE_NAMES`]).
    names: HashMap<u64, String>,
}

/// What an entry of a uvloop loop's set is.
enum SetItem {
    Timer(u64),
    Deleted,
    Other,
}

/// The type of the key a `set` leaves where an entry was deleted
/// (`Objects/setobject.c`'s `_PySetDummy_Type`, 3.10-3.15).
const SET_DUMMY_TYPE: &str = "<dummy key> type";

/// Types whose names are kept.
const MAX_TYPE_NAMES: usize = 256;

impl QueueReader {
    pub(crate) fn new(mem: Arc<ProcessMemory>, layout: Layout) -> Self {
        QueueReader {
            obj: Objects::new(mem, layout),
            loops: HashMap::new(),
            types: HashMap::new(),
            bools: HashMap::new(),
            uv_loops: HashMap::new(),
            uv_timers: HashMap::new(),
            names: HashMap::new(),
        }
    }

    /// The queues of the loop of thread `tid`, `running` being the loops
    /// asyncio says run a task step now. The loop is the thread's when it
    /// is the only one running (or, 3.14+, the thread's own); else the one
    /// last found on this thread, if it is among them or none is running
    /// (a stall in a plain callback: no task step).
    ///
    /// `thread_id`: the thread's `PyThreadState.thread_id` (its
    /// `pthread_t`), when known: the loop's `_thread_id` (set by
    /// `run_forever` to `threading.get_ident()`) must be it, so a loop
    /// another thread runs is never taken for this one's.
    pub fn read(
        &mut self,
        tid: u32,
        running: &[u64],
        thread_id: Option<u64>,
    ) -> Result<Queues, QueuesMiss> {
        let known = self.loops.get(&tid).copied();
        let lp = match (running, known) {
            ([only], _) => *only,
            (_, Some(k)) if running.is_empty() || running.contains(&k) => k,
            ([], None) => {
                return Err(QueuesMiss::NoLoop(
                    "no task step was seen on this thread yet (its loop is found through its running task)",
                ));
            }
            _ => {
                return Err(QueuesMiss::NoLoop(
                    "several loops run task steps and none is known as this thread's",
                ));
            }
        };
        match self.read_loop(lp, thread_id) {
            Ok(q) => {
                self.loops.insert(tid, lp);
                Ok(q)
            }
            Err(e) => {
                self.loops.remove(&tid);
                Err(e)
            }
        }
    }

    fn read_loop(&mut self, lp: u64, thread_id: Option<u64>) -> Result<Queues, QueuesMiss> {
        let unreadable = |e: PythonError| QueuesMiss::Unreadable(e.to_string());
        let ty = self.class_name(lp).map_err(unreadable)?;
        if ty.starts_with("uvloop.") {
            return self.read_uvloop(lp, &ty, thread_id);
        }
        if let Some(want) = thread_id {
            let runs_on = match self.obj.attr(lp, "_thread_id").map_err(unreadable)? {
                Some(id) => self.obj.small_int(id).map_err(unreadable)?,
                None => None,
            };
            if runs_on != Some(want) {
                return Err(QueuesMiss::NoLoop(
                    "the loop running a task step is not this thread's",
                ));
            }
        }
        let scheduled = self.obj.attr(lp, "_scheduled");
        let ready = self.obj.attr(lp, "_ready");
        let (Ok(Some(scheduled)), Ok(Some(ready))) = (scheduled, ready) else {
            // No such attributes, or no instance dict: another loop class.
            return Err(QueuesMiss::Unsupported(ty));
        };
        let mut q = Queues::default();
        let heap = self
            .list_items(scheduled, &mut q.truncated)
            .map_err(unreadable)?;
        let queued = self
            .deque_items(ready, &mut q.truncated)
            .map_err(unreadable)?;
        for (h, in_ready) in heap
            .into_iter()
            .map(|h| (h, false))
            .chain(queued.into_iter().map(|h| (h, true)))
        {
            match self.handle(h).map_err(unreadable)? {
                Some(Some(when)) => q.timers_when_ns.push(when),
                Some(None) if in_ready => q.ready_handles += 1,
                _ => {} // cancelled, or not a timer in the heap
            }
        }
        Ok(q)
    }

    /// A uvloop `Loop` (a Cython class: its fields are C struct members,
    /// not attributes). uvloop declares `_thread_id`, `_ready` (a deque)
    /// and `_timers` (the `set` of live `TimerHandle`s: `call_later` adds
    /// one, its run or cancel removes it) before the loop's `__weakref__`,
    /// so the words before `tp_weaklistoffset` are looked at (never the
    /// receive buffer after it, which holds peers' bytes): the loop
    /// runs on this thread when one of them is its `pthread_t`; the one
    /// deque among them is `_ready`; the set holding a `TimerHandle` is
    /// `_timers` — when no set holds one, no timer is pending.
    /// A `TimerHandle`'s `_when` (`loop.time()`: libuv's clock,
    /// CLOCK_MONOTONIC in whole ms) is its one `float` field.
    fn read_uvloop(
        &mut self,
        lp: u64,
        class: &str,
        thread_id: Option<u64>,
    ) -> Result<Queues, QueuesMiss> {
        let unreadable = |e: PythonError| QueuesMiss::Unreadable(e.to_string());
        let ty = self
            .obj
            .mem
            .read_u64(lp + OB_TYPE)
            .map_err(|e| unreadable(PythonError::from(e)))?;
        let weak = self
            .obj
            .mem
            .read_u64(ty + TYPE_TP_WEAKLISTOFFSET)
            .map_err(|e| unreadable(PythonError::from(e)))?;
        if !(24..=UVLOOP_MAX_FIELDS).contains(&weak) || !weak.is_multiple_of(8) {
            return Err(QueuesMiss::Unsupported(format!(
                "{class} (no __weakref__ where uvloop 0.17-0.23 has it)"
            )));
        }
        let words = self
            .obj
            .mem
            .read_bytes(lp, weak as usize)
            .map_err(|e| unreadable(PythonError::from(e)))?;
        let word = |off: u64| le_u64(&words, off as usize);
        if let Some(want) = thread_id
            && !(16..weak).step_by(8).any(|off| word(off) == want)
        {
            return Err(QueuesMiss::NoLoop(
                "the loop running a task step is not this thread's",
            ));
        }
        let fields = match self.uv_loops.get(&ty) {
            Some(f) => f.clone(),
            None => {
                let f = self.uv_loop_fields(&words, class)?;
                self.uv_loops.insert(ty, f.clone());
                f
            }
        };
        let mut q = Queues::default();
        q.ready_handles = self
            .deque_items(word(fields.ready), &mut q.truncated)
            .map_err(unreadable)?
            .len() as u32;
        let sets = match fields.timers {
            Some(t) => vec![t],
            None => fields.sets.clone(),
        };
        for off in sets {
            let items = self
                .obj
                .set_items(word(off), MAX_HANDLES, &mut q.truncated)
                .map_err(unreadable)?;
            let mut timers = Vec::with_capacity(items.len());
            for h in items {
                match self.uv_set_item(h).map_err(unreadable)? {
                    SetItem::Timer(when) => timers.push(when),
                    SetItem::Deleted => {}
                    // Not `_timers` (which holds only `TimerHandle`s).
                    SetItem::Other => break,
                }
            }
            if !timers.is_empty() {
                if let Some(f) = self.uv_loops.get_mut(&ty) {
                    f.timers = Some(off);
                }
                q.timers_when_ns = timers;
                break;
            }
        }
        Ok(q)
    }

    /// The `_ready` deque and the sets among a uvloop loop's fields.
    fn uv_loop_fields(&mut self, words: &[u8], class: &str) -> Result<UvLoopFields, QueuesMiss> {
        let (mut deques, mut sets) = (Vec::new(), Vec::new());
        for (off, name) in self.field_types(words) {
            match name.as_str() {
                "collections.deque" => deques.push(off),
                "set" => sets.push(off),
                _ => {}
            }
        }
        match (deques.as_slice(), sets.is_empty()) {
            ([ready], false) => Ok(UvLoopFields {
                ready: *ready,
                sets,
                timers: None,
            }),
            _ => Err(QueuesMiss::Unsupported(format!(
                "{class} ({} deques and {} sets among its fields, want one deque and a set)",
                deques.len(),
                sets.len()
            ))),
        }
    }

    /// An item of a set of a uvloop loop: a `TimerHandle` and its due
    /// time (CLOCK_MONOTONIC ns), a deleted entry, or another object.
    fn uv_set_item(&mut self, h: u64) -> Result<SetItem, PythonError> {
        // The usual case, one `TimerHandle` type known: its type and its
        // `_when` in one read.
        if let Some((&ty, &when)) = self.uv_timers.iter().next() {
            let b = self.obj.mem.read_bytes(h, (when + 8) as usize)?;
            if le_u64(&b, OB_TYPE as usize) == ty {
                let f = le_u64(&b, when as usize);
                return self
                    .float_secs_ns(f, "TimerHandle._when")
                    .map(SetItem::Timer);
            }
        }
        let ty = self.obj.mem.read_u64(h + OB_TYPE)?;
        let when = match self.uv_timers.get(&ty) {
            Some(&w) => w,
            None => match self.type_name_cached(ty).as_deref() {
                Some("uvloop.loop.TimerHandle") => {
                    let w = self.uv_when_offset(h, ty)?;
                    self.uv_timers.insert(ty, w);
                    w
                }
                // The set's dummy key, left where an entry was deleted.
                Some(SET_DUMMY_TYPE) => return Ok(SetItem::Deleted),
                _ => return Ok(SetItem::Other),
            },
        };
        let f = self.obj.mem.read_u64(h + when)?;
        self.float_secs_ns(f, "TimerHandle._when")
            .map(SetItem::Timer)
    }

    /// Where a `TimerHandle` type keeps `_when`: its one field that is a
    /// `float`, found on instance `h`.
    fn uv_when_offset(&mut self, h: u64, ty: u64) -> Result<u64, PythonError> {
        let size = self.obj.mem.read_u64(ty + TYPE_TP_BASICSIZE)?;
        if !(24..=512).contains(&size) {
            return Err(self.obj.bad("TimerHandle type (tp_basicsize)", ty));
        }
        let words = self.obj.mem.read_bytes(h, size as usize)?;
        let floats: Vec<u64> = self
            .field_types(&words)
            .into_iter()
            .filter(|(_, name)| name == "float")
            .map(|(off, _)| off)
            .collect();
        match floats.as_slice() {
            [one] => Ok(*one),
            _ => Err(self.obj.bad("TimerHandle (not one float field)", h)),
        }
    }

    /// The fields of an object (its `words`, from its head on) that point
    /// at objects, with their types' names: (offset, name).
    fn field_types(&mut self, words: &[u8]) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        for off in (16..words.len() as u64).step_by(8) {
            let v = le_u64(words, off as usize);
            // An object is 8-aligned and never in the first pages.
            if v < 1 << 16 || !v.is_multiple_of(8) {
                continue;
            }
            // A word that is not an object's address reads as no type.
            if let Ok(ty) = self.obj.mem.read_u64(v + OB_TYPE)
                && let Some(name) = self.type_name_cached(ty)
            {
                out.push((off, name));
            }
        }
        out
    }

    /// Type `ty`'s name, cached; None when it cannot be read.
    fn type_name_cached(&mut self, ty: u64) -> Option<String> {
        if let Some(n) = self.names.get(&ty) {
            return Some(n.clone());
        }
        let b = self.obj.type_name_of(ty, 64).ok()?;
        let n = String::from_utf8_lossy(&b).into_owned();
        if self.names.len() < MAX_TYPE_NAMES {
            self.names.insert(ty, n.clone());
        }
        Some(n)
    }

    /// A `float` object holding a CLOCK_MONOTONIC time in seconds, in ns.
    fn float_secs_ns(&self, f: u64, what: &'static str) -> Result<u64, PythonError> {
        let secs = f64::from_bits(self.obj.mem.read_u64(f + FLOAT_OB_FVAL)?);
        if !(secs.is_finite() && secs > 0.0 && secs < 1e10) {
            return Err(self.obj.bad(what, f));
        }
        Ok((secs * 1e9).round() as u64)
    }

    /// A handle: `Some(Some(when))` a live timer, `Some(None)` another
    /// live handle, `None` a cancelled one.
    fn handle(&mut self, h: u64) -> Result<Option<Option<u64>>, PythonError> {
        let ty = self.obj.mem.read_u64(h + OB_TYPE)?;
        let kind = match self.types.get(&ty) {
            Some(k) => *k,
            None => {
                let k = self.kind(ty)?;
                if self.types.len() < 64 {
                    self.types.insert(ty, k);
                }
                k
            }
        };
        let (when, cancelled) = match kind {
            HandleKind::Timer { when, cancelled } => (Some(when), cancelled),
            HandleKind::Plain { cancelled } => (None, cancelled),
            HandleKind::Other => return Ok(Some(None)),
        };
        let end = when.unwrap_or(0).max(cancelled) + 8;
        let b = self.obj.mem.read_bytes(h, end as usize)?;
        if self.truth(le_u64(&b, cancelled as usize))? {
            return Ok(None);
        }
        let Some(when) = when else {
            return Ok(Some(None));
        };
        let f = le_u64(&b, when as usize);
        self.float_secs_ns(f, "TimerHandle._when (not a time)")
            .map(|w| Some(Some(w)))
    }

    /// A `bool`'s truth (cached by object).
    fn truth(&mut self, b: u64) -> Result<bool, PythonError> {
        if let Some(&t) = self.bools.get(&b) {
            return Ok(t);
        }
        if self.type_name(b)? != "bool" {
            return Err(self.obj.bad("handle._cancelled (not a bool)", b));
        }
        let w = self.obj.mem.read_u64(b + BOOL_WORD)?;
        let t = if self.obj.minor >= 12 {
            w >> 3 != 0
        } else {
            w != 0
        };
        if self.bools.len() < 4 {
            self.bools.insert(b, t);
        }
        Ok(t)
    }

    /// What instances of type `ty` are, from the `__slots__` members of
    /// the type and its bases.
    fn kind(&self, ty: u64) -> Result<HandleKind, PythonError> {
        let (mut when, mut cancelled, mut t) = (None, None, ty);
        for _ in 0..MAX_BASES {
            if t == 0 {
                break;
            }
            let members = self.obj.mem.read_u64(t + TYPE_TP_MEMBERS)?;
            if members != 0 {
                for i in 0..MAX_MEMBERS {
                    let m = self.obj.mem.read_bytes(members + i * MEMBER_DEF_SIZE, 24)?;
                    let name = le_u64(&m, 0);
                    if name == 0 {
                        break;
                    }
                    let off = le_u64(&m, 16);
                    if !(16..4096).contains(&off) {
                        continue;
                    }
                    let n = self.obj.c_str(name, 16)?;
                    if n == b"_when" {
                        when = when.or(Some(off));
                    } else if n == b"_cancelled" {
                        cancelled = cancelled.or(Some(off));
                    }
                }
            }
            t = self.obj.mem.read_u64(t + TYPE_TP_BASE)?;
        }
        Ok(match (when, cancelled) {
            (Some(when), Some(cancelled)) => HandleKind::Timer { when, cancelled },
            (None, Some(cancelled)) => HandleKind::Plain { cancelled },
            _ => HandleKind::Other,
        })
    }

    /// The items of a `list`, at most [`MAX_HANDLES`].
    fn list_items(&self, list: u64, truncated: &mut bool) -> Result<Vec<u64>, PythonError> {
        if self.type_name(list)? != "list" {
            return Err(self.obj.bad("loop._scheduled (not a list)", list));
        }
        let h = self.obj.mem.read_bytes(list + VAR_OB_SIZE, 16)?;
        let (n, items) = (le_u64(&h, 0), le_u64(&h, 8));
        let n = self.cap(n, truncated);
        if n == 0 {
            return Ok(Vec::new());
        }
        let raw = self.obj.mem.read_bytes(items, 8 * n)?;
        Ok(raw.chunks_exact(8).map(|c| le_u64(c, 0)).collect())
    }

    /// The items of a `collections.deque`, left to right, at most
    /// [`MAX_HANDLES`].
    fn deque_items(&self, dq: u64, truncated: &mut bool) -> Result<Vec<u64>, PythonError> {
        if self.type_name(dq)? != "collections.deque" {
            return Err(self.obj.bad("loop._ready (not a collections.deque)", dq));
        }
        let h = self.obj.mem.read_bytes(dq, DEQUE_HEADER)?;
        let len = self.cap(le_u64(&h, VAR_OB_SIZE as usize), truncated);
        let (mut block, mut index) = (
            le_u64(&h, DEQUE_LEFTBLOCK as usize),
            le_u64(&h, DEQUE_LEFTBLOCK as usize + 16),
        );
        if index >= DEQUE_BLOCK_LEN {
            return Err(self.obj.bad("deque (leftindex)", dq));
        }
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            if block == 0 {
                return Err(self.obj.bad("deque (a block's rightlink)", dq));
            }
            let b = self
                .obj
                .mem
                .read_bytes(block, (8 * (DEQUE_BLOCK_LEN + 2)) as usize)?;
            while index < DEQUE_BLOCK_LEN && out.len() < len {
                out.push(le_u64(&b, (8 * (1 + index)) as usize));
                index += 1;
            }
            block = le_u64(&b, (8 * (1 + DEQUE_BLOCK_LEN)) as usize);
            index = 0;
        }
        Ok(out)
    }

    fn cap(&self, n: u64, truncated: &mut bool) -> usize {
        if n > MAX_HANDLES as u64 {
            *truncated = true;
            crate::os::limits::hit(crate::os::limits::Limit::PythonListTooLong);
        }
        n.min(MAX_HANDLES as u64) as usize
    }

    /// `obj`'s class as Python names it: `module.name` (a class defined in
    /// Python has its module in its dict, `__module__`, not in `tp_name`:
    /// uvloop's `Loop` is `uvloop.Loop`), else `tp_name`.
    fn class_name(&self, obj: u64) -> Result<String, PythonError> {
        let name = self.type_name(obj)?;
        let ty = self.obj.mem.read_u64(obj + OB_TYPE)?;
        let flags = self.obj.mem.read_u64(ty + TYPE_TP_FLAGS)?;
        if flags & TPFLAGS_HEAPTYPE == 0 || name.contains('.') {
            return Ok(name);
        }
        let dict = self.obj.mem.read_u64(ty + TYPE_TP_DICT)?;
        let module = match dict {
            0 => None,
            d => match self.obj.dict_get(d, "__module__")? {
                Some(m) => self.obj.str_value(m, 64)?,
                None => None,
            },
        };
        Ok(match module {
            Some(m) => format!("{m}.{name}"),
            None => name,
        })
    }

    /// The name of `obj`'s type (`tp_name`, at most 64 bytes).
    fn type_name(&self, obj: u64) -> Result<String, PythonError> {
        let b = self.obj.type_name(obj, 64)?;
        if b.is_empty() {
            return Err(self.obj.bad("type without a name", obj));
        }
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
}
