//! The request an ASGI server was serving at a stall: its method and route
//! template (`POST /resume/{rid}`), read from the request's `scope` dict in
//! the target's memory.
//!
//! In: a thread (its `PyThreadState*`) and the Python frames of a stack
//! event of its busy period, as BPF captured them (`(code, instr)`,
//! innermost first). Out: a [`RouteRead`]: the route, or why there is none.
//!
//! Where the scope is: every ASGI callable is `app(scope, receive, send)`,
//! so the frames of a request's chain (uvicorn's `run_asgi`, each
//! middleware, Starlette's `Router.app`, `Route.handle`, the endpoint
//! wrapper) have a local named `scope`. The innermost such frame of the
//! thread's live frame chain holds the dict after routing: Starlette and
//! FastAPI set `scope["route"]` (the matched `Route`, whose `path` is the
//! template) and `scope["endpoint"]` (the handler function); uvicorn and
//! hypercorn set `scope["type"]` (`http`/`websocket`) and `scope["method"]`.
//!
//! The read happens in userspace when a stack event of the busy period
//! arrives (the same moment as the asyncio task's, [`super::TaskReader`]),
//! so the loop may have moved on to another request. A route is kept only
//! when it is provably the stall's: the endpoint's code object
//! (`scope["endpoint"].__code__`) is a frame of the captured stack, or the
//! live frame chain equals the captured one frame for frame (code and
//! instruction). Otherwise [`RouteRead::Unverified`]. A stall whose stack
//! has no frame with a `scope` local is not a request ([`RouteRead::NotAsgi`],
//! not counted).
//!
//! Objects read (per version, x86-64, see [`ObjectModel`]): frames'
//! `localsplus` and code objects' local names ([`Layout`]); dicts (combined
//! and split tables); an instance's attribute (3.10 `tp_dictoffset`, 3.11
//! and 3.12 managed dicts and values, 3.13+ inline values); `str`. Every
//! object's type is checked through its `tp_flags` before it is read as
//! that type; every length and loop is capped ([`MAX_FRAMES`],
//! [`MAX_LOCALS`], [`MAX_DICT_ENTRIES`], [`MAX_METHOD_CHARS`],
//! [`MAX_TEMPLATE_CHARS`]).

use std::collections::HashMap;
use std::sync::Arc;

use profiler_common::python::{PY_OFFSET_NONE, PY_OWNER_NONE};

use super::PythonError;
use super::dict::{self, DICT_MA_KEYS, DICT_MA_VALUES};
use super::offsets::{Layout, OB_TYPE, VAR_OB_SIZE};
use crate::os::memory::{ProcessMemory, ReadMemory, le_u64};

/// Frames of the live chain followed (shims included).
pub const MAX_FRAMES: usize = 512;
/// Local names of one code object looked at for `scope`.
pub const MAX_LOCALS: u64 = 512;
/// Entries of a dict (or a type's shared keys) scanned for one key.
pub const MAX_DICT_ENTRIES: u64 = 1024;
/// An HTTP method longer than this is not one.
pub const MAX_METHOD_CHARS: u64 = 32;
/// Route templates are cut here (the rest is `…`).
pub const MAX_TEMPLATE_CHARS: u64 = 256;
/// Code objects whose `scope` slot is remembered; past this the cache is
/// emptied.
const MAX_CACHED_CODES: usize = 1 << 14;

/// `PyTypeObject` fields (the same offsets 3.10-3.15: `ctypes` on each
/// build here, gdb on pyenv's 3.10-3.13).
const TYPE_TP_NAME: u64 = 24;
const TYPE_TP_BASICSIZE: u64 = 32;
const TYPE_TP_FLAGS: u64 = 168;
const TYPE_TP_DICTOFFSET: u64 = 288;
const TPFLAGS_INLINE_VALUES: u64 = 1 << 2; // 3.13+
const TPFLAGS_MANAGED_DICT: u64 = 1 << 4; // 3.11+
const TPFLAGS_TUPLE_SUBCLASS: u64 = 1 << 26;
const TPFLAGS_UNICODE_SUBCLASS: u64 = 1 << 28;
const TPFLAGS_DICT_SUBCLASS: u64 = 1 << 29;
/// `PyFunctionObject.func_code` (3.10-3.15: `ctypes`, the word equal to
/// `id(f.__code__)`).
const FUNC_CODE: u64 = 48;
/// `PyCellObject.ob_ref`.
const CELL_OB_REF: u64 = 16;
/// A managed dict (3.11+) sits three words before the object; 3.11 keeps
/// the values pointer in the fourth.
const MANAGED_DICT: u64 = 24;
const MANAGED_VALUES_311: u64 = 32;

/// What differs between minor versions in the objects read here.
///
/// Provenance: `ctypes` on pyenv 3.10.13-3.13.0, Debian 3.11.2 and
/// Debian testing's 3.13.15, 3.14.8, 3.15.0 — `ht_cached_keys` is the word
/// after `ht_qualname` (found as the word equal to `id(T.__qualname__)`,
/// its second occurrence after `ht_name`); gdb `print
/// &((PyHeapTypeObject*)0)->ht_cached_keys` agrees on 3.10-3.13. The
/// object pre-header and inline values as `Include/internal/pycore_object.h`
/// and `pycore_dict.h` of each version lay them out, checked with `ctypes`
/// on an instance (its attribute's `id` at the expected word); a tuple's
/// first item: the word equal to `id(t[0])`.
#[derive(Clone, Copy, Debug)]
struct ObjectModel {
    /// `PyHeapTypeObject.ht_cached_keys`: the shared keys of instances'
    /// split dicts / values.
    ht_cached_keys: u64,
    /// Where the values array starts in a `PyDictValues` (3.13+: after
    /// `capacity, size, embedded, valid`).
    values_start: u64,
    /// `PyTupleObject.ob_item` (3.14 added the cached `ob_hash` before it).
    tuple_ob_item: u64,
}

fn object_model(minor: u8) -> Option<ObjectModel> {
    let (ht_cached_keys, values_start, tuple_ob_item) = match minor {
        10 | 11 => (872, 0, 24),
        12 => (880, 0, 24),
        13 => (880, 8, 24),
        14 => (880, 8, 32),
        15 => (888, 8, 32),
        _ => return None,
    };
    Some(ObjectModel {
        ht_cached_keys,
        values_start,
        tuple_ob_item,
    })
}

/// What one read found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteRead {
    /// The request's method (`WEBSOCKET` for a websocket) and route
    /// template, checked against the stack.
    Route { method: String, template: String },
    /// No frame of the captured stack has a `scope` local: not an ASGI
    /// request.
    NotAsgi,
    /// The request's scope was read, but it has no `route` (not routed yet,
    /// or no route matched).
    Unrouted,
    /// A request ran, but the one read is not provably the stall's (the
    /// loop had moved on, or the stall had ended, before the read).
    Unverified,
    /// The scope or route could not be read; says why.
    Unreadable(String),
}

/// Reads ASGI routes of one process (keep it: it caches code objects'
/// `scope` slots).
pub struct RouteReader {
    mem: Arc<ProcessMemory>,
    layout: Layout,
    minor: u8,
    model: Option<ObjectModel>,
    /// Code object -> index of its `scope` local (`None`: it has none).
    slots: HashMap<u64, Option<u64>>,
}

/// A live frame: its address and what BPF would record for it.
struct LiveFrame {
    addr: u64,
    code: u64,
    instr: u64,
}

impl RouteReader {
    pub(crate) fn new(mem: Arc<ProcessMemory>, layout: Layout) -> Self {
        let minor = layout.bpf.major_minor().1;
        RouteReader {
            mem,
            layout,
            minor,
            model: object_model(minor),
            slots: HashMap::new(),
        }
    }

    /// The route of the request thread `tstate` is serving, checked against
    /// `stack` (the `(code, instr)` pairs of a stack event of that thread,
    /// innermost first, `code == 0` between activations).
    pub fn current(&mut self, tstate: Option<u64>, stack: &[(u64, u64)]) -> RouteRead {
        let captured: Vec<u64> = stack.iter().map(|f| f.0).filter(|&c| c != 0).collect();
        if !captured.iter().any(|&c| self.scope_slot(c).is_some()) {
            return RouteRead::NotAsgi;
        }
        let Some(model) = self.model else {
            return RouteRead::Unreadable(format!("no object layout for CPython 3.{}", self.minor));
        };
        let Some(tstate) = tstate else {
            return RouteRead::Unreadable("the thread's PyThreadState is not known".into());
        };
        match self.read(model, tstate, stack, &captured) {
            Ok(r) => r,
            Err(e) => RouteRead::Unreadable(e.to_string()),
        }
    }

    fn read(
        &mut self,
        model: ObjectModel,
        tstate: u64,
        stack: &[(u64, u64)],
        captured: &[u64],
    ) -> Result<RouteRead, PythonError> {
        let live = self.live_frames(tstate)?;
        // The innermost frame whose `scope` local is an ASGI scope dict.
        let mut scope = None;
        for f in &live {
            let Some(slot) = self.scope_slot(f.code) else {
                continue;
            };
            let at = f.addr + u64::from(self.layout.frame_localsplus) + 8 * slot;
            let mut obj = self.mem.read_u64(at)? & !self.layout.bpf.code_tag_mask;
            if obj != 0 && self.type_name_is(obj, b"cell")? {
                // A local an inner function closes over: the cell's content.
                obj = self.mem.read_u64(obj + CELL_OB_REF)?;
            }
            if obj == 0 || !self.has_flag(obj, TPFLAGS_DICT_SUBCLASS)? {
                continue;
            }
            let kind = match self.dict_get(model, obj, "type")? {
                Some(t) => self.str_value(t, 16)?,
                None => None,
            };
            match kind {
                Some(k) if k == "http" || k == "websocket" => {
                    scope = Some((obj, k));
                    break;
                }
                // `lifespan` (the app's startup and shutdown): ASGI, but
                // no request.
                Some(_) => return Ok(RouteRead::NotAsgi),
                None => {}
            }
        }
        let Some((scope, kind)) = scope else {
            log::debug!(
                "pid {}: ASGI route unverified: none of {} live frames holds a request's scope",
                self.mem.pid(),
                live.len()
            );
            return Ok(RouteRead::Unverified);
        };
        if !self.verified(model, scope, &live, stack, captured)? {
            log::debug!(
                "pid {}: ASGI route unverified: the endpoint is not on the captured stack \
                 ({} frames) and the live chain ({} frames) does not run it",
                self.mem.pid(),
                captured.len(),
                live.len()
            );
            return Ok(RouteRead::Unverified);
        }
        let method = if kind == "websocket" {
            "WEBSOCKET".to_string()
        } else {
            match self.dict_get(model, scope, "method")? {
                Some(m) => self
                    .str_value(m, MAX_METHOD_CHARS)?
                    .ok_or_else(|| self.bad("scope[\"method\"] (not a str)", m))?,
                None => return Err(self.bad("http scope without \"method\"", scope)),
            }
        };
        let Some(route) = self.dict_get(model, scope, "route")? else {
            return Ok(RouteRead::Unrouted);
        };
        let Some(path) = self.attr(model, route, "path")? else {
            return Err(self.bad("scope[\"route\"] without a path attribute", route));
        };
        let template = self
            .str_value(path, u64::MAX)?
            .ok_or_else(|| self.bad("scope[\"route\"].path (not a str)", path))?;
        Ok(RouteRead::Route { method, template })
    }

    /// The scope read is the stall's: its endpoint's code is on the
    /// captured stack, or the live chain still runs the captured one (the
    /// same frames, code and instruction, from the outermost in; only the
    /// captured innermost frame may have moved on, or called deeper).
    fn verified(
        &self,
        model: ObjectModel,
        scope: u64,
        live: &[LiveFrame],
        stack: &[(u64, u64)],
        captured: &[u64],
    ) -> Result<bool, PythonError> {
        if let Some(endpoint) = self.dict_get(model, scope, "endpoint")?
            && self.type_name_is(endpoint, b"function")?
        {
            let code = self.mem.read_u64(endpoint + FUNC_CODE)?;
            if captured.contains(&code) {
                return Ok(true);
            }
        }
        let want: Vec<(u64, u64)> = stack.iter().filter(|f| f.0 != 0).copied().collect();
        Ok(extends(live, &want))
    }

    /// The thread's frames now, innermost first, shims skipped (as
    /// [`super::walk`] and BPF walk them, with each frame's address).
    fn live_frames(&self, tstate: u64) -> Result<Vec<LiveFrame>, PythonError> {
        let off = &self.layout.bpf;
        let mut frame = self.mem.read_u64(tstate + u64::from(off.tstate_frame))?;
        if off.cframe_current_frame != PY_OFFSET_NONE && frame != 0 {
            frame = self
                .mem
                .read_u64(frame + u64::from(off.cframe_current_frame))?;
        }
        let mut out = Vec::new();
        for _ in 0..MAX_FRAMES {
            if frame == 0 {
                break;
            }
            let shim = off.frame_owner != PY_OFFSET_NONE
                && off.owner_shim_min != PY_OWNER_NONE
                && u16::from(self.mem.read_u8(frame + u64::from(off.frame_owner))?)
                    >= off.owner_shim_min;
            if !shim {
                let code =
                    self.mem.read_u64(frame + u64::from(off.frame_code))? & !off.code_tag_mask;
                let at = frame + u64::from(off.frame_instr);
                let instr = if off.frame_instr_size == 4 {
                    self.mem.read_u32(at)? as i32 as i64 as u64
                } else {
                    self.mem.read_u64(at)?
                };
                out.push(LiveFrame {
                    addr: frame,
                    code,
                    instr,
                });
            }
            frame = self.mem.read_u64(frame + u64::from(off.frame_previous))?;
        }
        Ok(out)
    }

    /// The index of code object `code`'s local named `scope`, cached; None
    /// when it has none or its names cannot be read.
    fn scope_slot(&mut self, code: u64) -> Option<u64> {
        if let Some(&s) = self.slots.get(&code) {
            return s;
        }
        let slot = self.find_local(code, "scope").unwrap_or(None);
        if self.slots.len() >= MAX_CACHED_CODES {
            self.slots.clear();
        }
        self.slots.insert(code, slot);
        slot
    }

    fn find_local(&self, code: u64, want: &str) -> Result<Option<u64>, PythonError> {
        if code == 0 {
            return Ok(None);
        }
        let names = self
            .mem
            .read_u64(code + u64::from(self.layout.code_localsplusnames))?;
        if names == 0 || !self.has_flag(names, TPFLAGS_TUPLE_SUBCLASS)? {
            return Ok(None);
        }
        let n = self.mem.read_u64(names + VAR_OB_SIZE)?.min(MAX_LOCALS);
        let Some(model) = self.model else {
            return Ok(None);
        };
        let items = self
            .mem
            .read_bytes(names + model.tuple_ob_item, (8 * n) as usize)?;
        for i in 0..n {
            let name = le_u64(&items, 8 * i as usize);
            if self.ascii_eq(name, want).unwrap_or(false) {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// The value of `str` key `want` in a dict (combined or split table).
    fn dict_get(
        &self,
        model: ObjectModel,
        dict: u64,
        want: &str,
    ) -> Result<Option<u64>, PythonError> {
        let h = self.mem.read_bytes(dict + DICT_MA_KEYS, 16)?;
        let (keys, values) = (
            le_u64(&h, 0),
            le_u64(&h, (DICT_MA_VALUES - DICT_MA_KEYS) as usize),
        );
        if keys == 0 {
            return Err(self.bad("dict without keys", dict));
        }
        let split = (values != 0).then_some((values + model.values_start, u64::MAX));
        self.keys_get(keys, split, want)
    }

    /// Looks `want` up in a keys object: each entry's value, or with
    /// `split = (values array, capacity)` the value at the entry's index.
    fn keys_get(
        &self,
        keys: u64,
        split: Option<(u64, u64)>,
        want: &str,
    ) -> Result<Option<u64>, PythonError> {
        let entries = dict::keys_entries(&self.mem, self.minor, keys, MAX_DICT_ENTRIES)?;
        for (i, &(key, value)) in entries.iter().enumerate() {
            // A key that cannot be read is not the one wanted.
            if key == 0 || !self.ascii_eq(key, want).unwrap_or(false) {
                continue;
            }
            let value = match split {
                None => value,
                Some((_, capacity)) if i as u64 >= capacity => return Ok(None),
                Some((values, _)) => self.mem.read_u64(values + 8 * i as u64)?,
            };
            return Ok((value != 0).then_some(value));
        }
        Ok(None)
    }

    /// `obj.name` from the instance's own attributes (its `__dict__`,
    /// managed dict or inline values); None when it has no such attribute.
    fn attr(&self, model: ObjectModel, obj: u64, name: &str) -> Result<Option<u64>, PythonError> {
        let ty = self.mem.read_u64(obj + OB_TYPE)?;
        let flags = self.mem.read_u64(ty + TYPE_TP_FLAGS)?;
        let shared = || self.mem.read_u64(ty + model.ht_cached_keys);
        let dict = if self.minor >= 13 && flags & TPFLAGS_INLINE_VALUES != 0 {
            let basic = self.mem.read_u64(ty + TYPE_TP_BASICSIZE)?;
            if !(16..1 << 16).contains(&basic) {
                return Err(self.bad("type (tp_basicsize)", ty));
            }
            let values = obj + basic;
            let head = self.mem.read_bytes(values, 4)?; // capacity, size, embedded, valid
            if head[3] != 0 {
                let keys = shared()?;
                return self.keys_get(
                    keys,
                    Some((values + model.values_start, u64::from(head[0]))),
                    name,
                );
            }
            self.mem.read_u64(obj - MANAGED_DICT)?
        } else if self.minor >= 11 && flags & TPFLAGS_MANAGED_DICT != 0 {
            if self.minor == 11 {
                let values = self.mem.read_u64(obj - MANAGED_VALUES_311)?;
                if values != 0 {
                    return self.keys_get(shared()?, Some((values, u64::MAX)), name);
                }
                self.mem.read_u64(obj - MANAGED_DICT)?
            } else {
                let dorv = self.mem.read_u64(obj - MANAGED_DICT)?;
                if self.minor == 12 && dorv & 1 != 0 {
                    // `PyDictOrValues`: values pointer minus one.
                    return self.keys_get(shared()?, Some((dorv + 1, u64::MAX)), name);
                }
                dorv
            }
        } else {
            let off = self.mem.read_u64(ty + TYPE_TP_DICTOFFSET)? as i64;
            if off <= 0 || off >= 1 << 16 {
                return Err(self.bad("instance without a __dict__ at a fixed offset", obj));
            }
            self.mem.read_u64(obj + off as u64)?
        };
        if dict == 0 {
            return Ok(None);
        }
        if !self.has_flag(dict, TPFLAGS_DICT_SUBCLASS)? {
            return Err(self.bad("instance __dict__ (not a dict)", dict));
        }
        self.dict_get(model, dict, name)
    }

    fn has_flag(&self, obj: u64, flag: u64) -> Result<bool, PythonError> {
        let ty = self.mem.read_u64(obj + OB_TYPE)?;
        if ty == 0 {
            return Ok(false);
        }
        Ok(self.mem.read_u64(ty + TYPE_TP_FLAGS)? & flag != 0)
    }

    /// The object's type is named `name` (`tp_name`, a C string).
    fn type_name_is(&self, obj: u64, name: &[u8]) -> Result<bool, PythonError> {
        let ty = self.mem.read_u64(obj + OB_TYPE)?;
        let tp_name = self.mem.read_u64(ty + TYPE_TP_NAME)?;
        if tp_name == 0 {
            return Ok(false);
        }
        let b = self.mem.read_bytes(tp_name, name.len() + 1)?;
        Ok(&b[..name.len()] == name && b[name.len()] == 0)
    }

    /// A `str` object's text, cut to `cap` characters (with `…`); None when
    /// `obj` is not a `str`.
    fn str_value(&self, obj: u64, cap: u64) -> Result<Option<String>, PythonError> {
        if !self.has_flag(obj, TPFLAGS_UNICODE_SUBCLASS)? {
            return Ok(None);
        }
        let mut s = super::code::read_unicode(&*self.mem, &self.layout, obj)?;
        let cap = cap.min(MAX_TEMPLATE_CHARS) as usize;
        if s.chars().count() > cap {
            s = s.chars().take(cap).collect::<String>() + "…";
        }
        Ok(Some(s))
    }

    /// `obj` is a compact ASCII `str` equal to `want`.
    fn ascii_eq(&self, obj: u64, want: &str) -> Result<bool, PythonError> {
        dict::ascii_eq(&self.mem, &self.layout, obj, want)
    }

    fn bad(&self, what: &'static str, addr: u64) -> PythonError {
        PythonError::BadData {
            pid: self.mem.pid(),
            what,
            addr,
        }
    }
}

/// The live chain (innermost first) runs the captured one: both agree
/// from the outermost frame in on every captured frame but the innermost,
/// whose code must match at its depth (its instruction may have moved).
fn extends(live: &[LiveFrame], captured: &[(u64, u64)]) -> bool {
    let Some((innermost, outer)) = captured.split_first() else {
        return false;
    };
    if live.len() < captured.len() {
        return false;
    }
    let mut from_out = live.iter().rev();
    outer
        .iter()
        .rev()
        .all(|c| from_out.next().is_some_and(|l| (l.code, l.instr) == *c))
        && from_out.next().is_some_and(|l| l.code == innermost.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(frames: &[(u64, u64)]) -> Vec<LiveFrame> {
        frames
            .iter()
            .map(|&(code, instr)| LiveFrame {
                addr: 0,
                code,
                instr,
            })
            .collect()
    }

    /// captured: `run_asgi@1 -> app@2 -> handler@3` (innermost first below)
    #[test]
    fn the_live_chain_extends_the_captured_one() {
        let captured = [(30, 3), (20, 2), (10, 1)];
        // The same call, the handler further on and deeper.
        assert!(extends(
            &live(&[(40, 9), (30, 5), (20, 2), (10, 1)]),
            &captured
        ));
        assert!(extends(&live(&captured), &captured));
        // Another request awaiting elsewhere in the app, or back at the loop.
        assert!(!extends(&live(&[(30, 3), (20, 7), (10, 1)]), &captured));
        assert!(!extends(&live(&[(50, 1), (10, 1)]), &captured));
        assert!(!extends(&live(&[(10, 1)]), &captured));
        assert!(!extends(&live(&captured), &[]));
    }

    #[test]
    fn every_supported_version_has_an_object_model() {
        for &(_, minor) in super::super::offsets::SUPPORTED {
            assert!(object_model(minor).is_some(), "3.{minor}");
        }
        assert!(object_model(9).is_none());
    }
}
