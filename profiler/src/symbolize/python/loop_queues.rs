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
use super::objects::{Objects, TYPE_TP_FLAGS, TYPE_TP_NAME};
use super::offsets::{Layout, OB_TYPE, VAR_OB_SIZE};
use crate::os::memory::{ProcessMemory, ReadMemory, le_u64};

/// Handles read from each queue; past this the read is `truncated`.
pub const MAX_HANDLES: usize = 4096;
/// `PyMemberDef` entries looked at per type.
pub const MAX_MEMBERS: u64 = 64;
/// Types followed up `tp_base` for a handle's members.
pub const MAX_BASES: usize = 8;
/// `PyTypeObject.tp_members`, `.tp_base`, `.tp_dict` (3.10-3.15).
const TYPE_TP_MEMBERS: u64 = 240;
const TYPE_TP_BASE: u64 = 256;
const TYPE_TP_DICT: u64 = 264;
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
/// `PyFloatObject.ob_fval`.
const FLOAT_OB_FVAL: u64 = 16;
/// A `bool`'s first word after the header: 3.10/3.11 `ob_size` (1 for
/// `True`), 3.12+ `lv_tag` (`ndigits << 3 | sign`: 8 for `True`, 1 for
/// `False`).
const BOOL_WORD: u64 = 16;

/// What one read of a loop found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Queues {
    /// The due time (`_when`, CLOCK_MONOTONIC ns) of each live timer in
    /// the scheduled heap and in the ready queue.
    pub timers_when_ns: Vec<u64>,
    /// Other live handles in the ready queue (callbacks, task steps).
    pub ready_handles: u32,
    /// A queue held more than [`MAX_HANDLES`]: only that many were read.
    pub truncated: bool,
}

/// Why a loop's queues were not read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueuesMiss {
    /// The loop is not asyncio's own `BaseEventLoop` (uvloop's `Loop`):
    /// its type's name.
    Unsupported(String),
    /// The thread's loop is not known (why).
    NoLoop(&'static str),
    /// The loop or its queues could not be read (why).
    Unreadable(String),
}

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

/// Reads the queues of one process's asyncio loops (keep it: it caches
/// the handle types and each thread's loop).
pub struct QueueReader {
    obj: Objects,
    /// tid -> the loop last found running on it.
    loops: HashMap<u32, u64>,
    types: HashMap<u64, HandleKind>,
    /// bool object -> its truth.
    bools: HashMap<u64, bool>,
}

impl QueueReader {
    pub(crate) fn new(mem: Arc<ProcessMemory>, layout: Layout) -> Self {
        QueueReader {
            obj: Objects::new(mem, layout),
            loops: HashMap::new(),
            types: HashMap::new(),
            bools: HashMap::new(),
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
            return Err(QueuesMiss::Unsupported(ty));
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
        let secs = f64::from_bits(self.obj.mem.read_u64(f + FLOAT_OB_FVAL)?);
        if !(secs.is_finite() && secs > 0.0 && secs < 1e10) {
            return Err(self.obj.bad("TimerHandle._when (not a time)", f));
        }
        Ok(Some(Some((secs * 1e9).round() as u64)))
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
                    let n = read_c_str(&self.obj.mem, name, 16)?;
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
        let ty = self.obj.mem.read_u64(obj + OB_TYPE)?;
        let name = self.obj.mem.read_u64(ty + TYPE_TP_NAME)?;
        if name == 0 {
            return Err(self.obj.bad("type without a name", ty));
        }
        let b = read_c_str(&self.obj.mem, name, 64)?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
}

/// A C string of at most `cap` bytes (read in one go, up to the end of
/// its page so a short string at a page's end does not fail).
fn read_c_str(mem: &ProcessMemory, addr: u64, cap: u64) -> Result<Vec<u8>, PythonError> {
    let to_page_end = 4096 - (addr % 4096);
    let b = mem.read_bytes(addr, cap.min(to_page_end) as usize)?;
    Ok(b.split(|&c| c == 0).next().unwrap_or(&[]).to_vec())
}
