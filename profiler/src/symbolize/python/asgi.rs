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
//! has no frame with a `scope` local is not a request ([`RouteRead::NoRequest`],
//! not counted).
//!
//! aiohttp, no ASGI server, is read the same way through its handlers'
//! `request` local: the request's `_method` and its match info's route's
//! resource template (`_formatter`, `_path` or `_prefix`); see
//! [`RouteReader::read_aiohttp`] and docs/asgi.md.
//!
//! Objects read (per version, x86-64, see [`ObjectModel`]): frames'
//! `localsplus` and code objects' local names ([`Layout`]); dicts (combined
//! and split tables); an instance's attribute (3.10 `tp_dictoffset`, 3.11
//! and 3.12 managed dicts and values, 3.13+ inline values); `str`. Every
//! object's type is checked through its `tp_flags` before it is read as
//! that type; every length and loop is capped ([`MAX_FRAMES`],
//! [`MAX_LOCALS`], [`super::objects::MAX_DICT_ENTRIES`], [`MAX_METHOD_CHARS`],
//! [`MAX_TEMPLATE_CHARS`]).

use std::collections::HashMap;
use std::sync::Arc;

use profiler_common::python::{PY_OFFSET_NONE, PY_OWNER_NONE};

use super::PythonError;
use super::objects::{FUNC_CODE, Objects, TPFLAGS_DICT_SUBCLASS, TPFLAGS_TUPLE_SUBCLASS};
use super::offsets::Layout;
use super::offsets::VAR_OB_SIZE;
use crate::os::memory::{ProcessMemory, ReadMemory, le_u64};
use crate::symbolize::request::RouteRead;

/// Frames of the live chain followed (shims included).
pub const MAX_FRAMES: usize = 512;
/// Local names of one code object looked at for `scope`.
pub const MAX_LOCALS: u64 = 512;
/// An HTTP method longer than this is not one.
pub const MAX_METHOD_CHARS: u64 = 32;
/// Route templates are cut here (the rest is `…`).
pub const MAX_TEMPLATE_CHARS: u64 = 256;
/// Code objects whose `scope` slot is remembered; past this the cache is
/// emptied.
const MAX_CACHED_CODES: usize = 1 << 14;

/// Reads ASGI routes of one process (keep it: it caches code objects'
/// `scope` slots).
pub struct RouteReader {
    obj: Objects,
    /// (Code object, local) -> index of that local (`None`: it has none).
    slots: HashMap<(u64, Local), Option<u64>>,
}

/// The locals a request is found through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Local {
    /// ASGI: `app(scope, receive, send)`.
    Scope,
    /// aiohttp: `handler(request)`, `_handle_request(self, request, …)`.
    Request,
}

impl Local {
    fn name(self) -> &'static str {
        match self {
            Local::Scope => "scope",
            Local::Request => "request",
        }
    }
}

/// A live frame: its address and what BPF would record for it.
struct LiveFrame {
    addr: u64,
    code: u64,
    instr: u64,
}

impl RouteReader {
    pub(crate) fn new(mem: Arc<ProcessMemory>, layout: Layout) -> Self {
        RouteReader {
            obj: Objects::new(mem, layout),
            slots: HashMap::new(),
        }
    }

    /// The route of the request thread `tstate` is serving, checked against
    /// `stack` (the `(code, instr)` pairs of a stack event of that thread,
    /// innermost first, `code == 0` between activations); `outer`: its
    /// frames from the innermost app frame outward (see
    /// [`Self::verified`]).
    pub fn current(
        &mut self,
        tstate: Option<u64>,
        stack: &[(u64, u64)],
        outer: &[(u64, u64)],
    ) -> RouteRead {
        let captured: Vec<u64> = stack.iter().map(|f| f.0).filter(|&c| c != 0).collect();
        let asgi = captured.iter().any(|&c| self.scope_slot(c).is_some());
        let aiohttp = !asgi
            && captured
                .iter()
                .any(|&c| self.local_slot(c, Local::Request).is_some());
        if !asgi && !aiohttp {
            return RouteRead::NoRequest;
        }
        if self.obj.model.is_none() {
            return RouteRead::Unreadable(format!(
                "no object layout for CPython 3.{}",
                self.obj.minor
            ));
        }
        let Some(tstate) = tstate else {
            return RouteRead::Unreadable("the thread's PyThreadState is not known".into());
        };
        let read = if asgi {
            self.read(tstate, stack, outer, &captured)
        } else {
            self.read_aiohttp(tstate, stack, &captured)
        };
        match read {
            Ok(r) => r,
            Err(e) => RouteRead::Unreadable(e.to_string()),
        }
    }

    fn read(
        &mut self,
        tstate: u64,
        stack: &[(u64, u64)],
        outer: &[(u64, u64)],
        captured: &[u64],
    ) -> Result<RouteRead, PythonError> {
        let live = self.live_frames(tstate)?;
        // The innermost frame whose `scope` local is an ASGI scope dict.
        let scope = self.innermost_local(&live, Local::Scope, |me, obj| {
            if !me.obj.has_flag(obj, TPFLAGS_DICT_SUBCLASS)? {
                return Ok(None);
            }
            Ok(match me.obj.dict_get(obj, "type")? {
                Some(t) => me.obj.str_value(t, 16)?.map(|k| (obj, k)),
                None => None,
            })
        })?;
        // `lifespan` (the app's startup and shutdown): ASGI, but no request.
        if let Some((_, k)) = &scope
            && k != "http"
            && k != "websocket"
        {
            return Ok(RouteRead::NoRequest);
        }
        let Some((scope, kind)) = scope else {
            log::debug!(
                "pid {}: ASGI route unverified: none of {} live frames holds a request's scope",
                self.obj.mem.pid(),
                live.len()
            );
            return Ok(RouteRead::Unverified);
        };
        if !self.verified(scope, &live, stack, outer, captured)? {
            log::debug!(
                "pid {}: ASGI route unverified: the endpoint is not on the captured stack \
                 ({} frames) and the live chain ({} frames) does not run it",
                self.obj.mem.pid(),
                captured.len(),
                live.len()
            );
            return Ok(RouteRead::Unverified);
        }
        let method = if kind == "websocket" {
            "WEBSOCKET".to_string()
        } else {
            match self.obj.dict_get(scope, "method")? {
                Some(m) => self
                    .obj
                    .str_value(m, MAX_METHOD_CHARS)?
                    .ok_or_else(|| self.obj.bad("scope[\"method\"] (not a str)", m))?,
                None => return Err(self.obj.bad("http scope without \"method\"", scope)),
            }
        };
        let Some(route) = self.obj.dict_get(scope, "route")? else {
            return Ok(RouteRead::Unrouted);
        };
        let Some(path) = self.obj.attr(route, "path")? else {
            return Err(self
                .obj
                .bad("scope[\"route\"] without a path attribute", route));
        };
        let template = self
            .obj
            .str_value(path, MAX_TEMPLATE_CHARS)?
            .ok_or_else(|| self.obj.bad("scope[\"route\"].path (not a str)", path))?;
        Ok(RouteRead::Route { method, template })
    }

    /// The scope read is the stall's: its endpoint's code is on the
    /// captured stack, or the live chain still runs the captured one (the
    /// same frames, code and instruction, from the outermost in; only the
    /// captured innermost frame may have moved on, or called deeper), or —
    /// a capture cut short of its outermost frames (a deep framework and
    /// library stack over the kernel's 64 Python frames), whose endpoint
    /// frame may be past its end — the live chain still runs `outer`, the
    /// captured app frame and its captured callers, instruction and all
    /// (the handler blocked in the same call of the same request; another
    /// request of that handler would be the same route).
    fn verified(
        &self,
        scope: u64,
        live: &[LiveFrame],
        stack: &[(u64, u64)],
        outer: &[(u64, u64)],
        captured: &[u64],
    ) -> Result<bool, PythonError> {
        if let Some(endpoint) = self.obj.dict_get(scope, "endpoint")?
            && self.obj.type_name_is(endpoint, b"function")?
        {
            let code = self.obj.mem.read_u64(endpoint + FUNC_CODE)?;
            if captured.contains(&code) {
                return Ok(true);
            }
        }
        let want: Vec<(u64, u64)> = stack.iter().filter(|f| f.0 != 0).copied().collect();
        Ok(extends(live, &want) || runs(live, outer))
    }

    /// The thread's frames now, innermost first, shims skipped (as
    /// [`super::walk`] and BPF walk them, with each frame's address).
    /// The thread of `tstate` still runs `outer`, the outer part of a
    /// captured stack (innermost first): the same frames, code and
    /// instruction, in a row; what it runs deeper may differ.
    pub fn runs_captured(&self, tstate: u64, outer: &[(u64, u64)]) -> Result<bool, PythonError> {
        Ok(runs(&self.live_frames(tstate)?, outer))
    }

    /// The thread's frames now (code, instruction; innermost first) when
    /// they begin with the whole captured `stack` (innermost first), frame
    /// for frame, instruction and all: the thread is still inside the
    /// captured call (blocked in it), and the frames past the capture's
    /// end (a stack cut short of its outermost frames) are that call's
    /// callers. None when the thread has moved on.
    pub fn still_in(
        &self,
        tstate: u64,
        stack: &[(u64, u64)],
    ) -> Result<Option<Vec<(u64, u64)>>, PythonError> {
        let live = self.live_frames(tstate)?;
        Ok(begins_with(&live, stack).then(|| live.iter().map(|l| (l.code, l.instr)).collect()))
    }

    /// The address of the thread's innermost Python frame now (shims
    /// skipped); None when it runs none.
    pub fn innermost_frame(&self, tstate: u64) -> Result<Option<u64>, PythonError> {
        Ok(self.frames_upto(tstate, 1)?.first().map(|f| f.addr))
    }

    fn live_frames(&self, tstate: u64) -> Result<Vec<LiveFrame>, PythonError> {
        self.frames_upto(tstate, MAX_FRAMES)
    }

    /// The thread's innermost `max` frames now (at most [`MAX_FRAMES`]).
    fn frames_upto(&self, tstate: u64, max: usize) -> Result<Vec<LiveFrame>, PythonError> {
        let off = &self.obj.layout.bpf;
        let mut frame = self
            .obj
            .mem
            .read_u64(tstate + u64::from(off.tstate_frame))?;
        if off.cframe_current_frame != PY_OFFSET_NONE && frame != 0 {
            frame = self
                .obj
                .mem
                .read_u64(frame + u64::from(off.cframe_current_frame))?;
        }
        let mut out = Vec::new();
        for _ in 0..MAX_FRAMES {
            if frame == 0 || out.len() >= max {
                break;
            }
            let shim = off.frame_owner != PY_OFFSET_NONE
                && off.owner_shim_min != PY_OWNER_NONE
                && u16::from(self.obj.mem.read_u8(frame + u64::from(off.frame_owner))?)
                    >= off.owner_shim_min;
            if !shim {
                let code =
                    self.obj.mem.read_u64(frame + u64::from(off.frame_code))? & !off.code_tag_mask;
                let at = frame + u64::from(off.frame_instr);
                let instr = if off.frame_instr_size == 4 {
                    self.obj.mem.read_u32(at)? as i32 as i64 as u64
                } else {
                    self.obj.mem.read_u64(at)?
                };
                out.push(LiveFrame {
                    addr: frame,
                    code,
                    instr,
                });
            }
            frame = self
                .obj
                .mem
                .read_u64(frame + u64::from(off.frame_previous))?;
        }
        Ok(out)
    }

    /// The index of code object `code`'s local named `scope`, cached; None
    /// when it has none or its names cannot be read.
    fn scope_slot(&mut self, code: u64) -> Option<u64> {
        self.local_slot(code, Local::Scope)
    }

    /// The index of code object `code`'s local `which`, cached.
    fn local_slot(&mut self, code: u64, which: Local) -> Option<u64> {
        if let Some(&s) = self.slots.get(&(code, which)) {
            return s;
        }
        let slot = self.find_local(code, which.name()).unwrap_or(None);
        if self.slots.len() >= MAX_CACHED_CODES {
            self.slots.clear();
        }
        self.slots.insert((code, which), slot);
        slot
    }

    /// The innermost of the `live` frames whose local `which` holds an
    /// object `accept` takes: what `accept` made of it.
    fn innermost_local<T>(
        &mut self,
        live: &[LiveFrame],
        which: Local,
        accept: impl Fn(&Self, u64) -> Result<Option<T>, PythonError>,
    ) -> Result<Option<T>, PythonError> {
        for f in live {
            let Some(slot) = self.local_slot(f.code, which) else {
                continue;
            };
            let obj = self.local_value(f, slot)?;
            if obj != 0
                && let Some(t) = accept(self, obj)?
            {
                return Ok(Some(t));
            }
        }
        Ok(None)
    }

    /// The object in frame `f`'s local slot `slot` (a cell's content for a
    /// local an inner function closes over); 0 when unset.
    fn local_value(&self, f: &LiveFrame, slot: u64) -> Result<u64, PythonError> {
        let at = f.addr + u64::from(self.obj.layout.frame_localsplus) + 8 * slot;
        let mut obj = self.obj.mem.read_u64(at)? & !self.obj.layout.bpf.code_tag_mask;
        if obj != 0 && self.obj.type_name_is(obj, b"cell")? {
            obj = self.obj.mem.read_u64(obj + super::objects::CELL_OB_REF)?;
        }
        Ok(obj)
    }

    /// aiohttp: the innermost live frame whose `request` local is an
    /// aiohttp request (its `_match_info` set by the router) gives the
    /// route: `request._method`, and the matched route's resource's
    /// template (`_formatter` of a `DynamicResource`, `_path` of a
    /// `PlainResource`, `_prefix` of a prefix resource: what its
    /// `canonical` returns). Kept when the route's handler's code is on the
    /// captured stack, or the live chain still runs the captured one.
    fn read_aiohttp(
        &mut self,
        tstate: u64,
        stack: &[(u64, u64)],
        captured: &[u64],
    ) -> Result<RouteRead, PythonError> {
        let live = self.live_frames(tstate)?;
        // Any other object named `request` (a client library's) is not
        // one: it has no `_match_info` attribute, or no `__dict__`.
        let found = self.innermost_local(&live, Local::Request, |me, request| {
            Ok(me
                .obj
                .attr(request, "_match_info")
                .ok()
                .flatten()
                .map(|m| (request, m)))
        })?;
        let Some((request, match_info)) = found else {
            return Ok(RouteRead::NoRequest);
        };
        if self.obj.type_name_is(match_info, b"NoneType")? {
            return Ok(RouteRead::Unrouted);
        }
        let Some(route) = self.obj.slot(match_info, "_route")? else {
            return Ok(RouteRead::Unrouted);
        };
        let handler = self.obj.attr(route, "_handler")?;
        let on_stack = match handler {
            Some(h) if self.obj.type_name_is(h, b"function")? => {
                captured.contains(&self.obj.mem.read_u64(h + FUNC_CODE)?)
            }
            _ => false,
        };
        let want: Vec<(u64, u64)> = stack.iter().filter(|f| f.0 != 0).copied().collect();
        if !on_stack && !extends(&live, &want) {
            return Ok(RouteRead::Unverified);
        }
        let method = match self.obj.attr(request, "_method")? {
            Some(m) => self
                .obj
                .str_value(m, MAX_METHOD_CHARS)?
                .ok_or_else(|| self.obj.bad("request._method (not a str)", m))?,
            None => return Err(self.obj.bad("aiohttp request without _method", request)),
        };
        let Some(resource) = self.obj.attr(route, "_resource")? else {
            return Err(self.obj.bad("aiohttp route without _resource", route));
        };
        for key in ["_formatter", "_path", "_prefix"] {
            if let Some(t) = self.obj.attr(resource, key)?
                && let Some(template) = self.obj.str_value(t, MAX_TEMPLATE_CHARS)?
            {
                return Ok(RouteRead::Route { method, template });
            }
        }
        Err(self.obj.bad(
            "aiohttp resource without _formatter, _path or _prefix",
            resource,
        ))
    }

    fn find_local(&self, code: u64, want: &str) -> Result<Option<u64>, PythonError> {
        if code == 0 {
            return Ok(None);
        }
        let names = self
            .obj
            .mem
            .read_u64(code + u64::from(self.obj.layout.code_localsplusnames))?;
        if names == 0 || !self.obj.has_flag(names, TPFLAGS_TUPLE_SUBCLASS)? {
            return Ok(None);
        }
        let n = self.obj.mem.read_u64(names + VAR_OB_SIZE)?.min(MAX_LOCALS);
        let Some(model) = self.obj.model else {
            return Ok(None);
        };
        let items = self
            .obj
            .mem
            .read_bytes(names + model.tuple_ob_item, (8 * n) as usize)?;
        for i in 0..n {
            let name = le_u64(&items, 8 * i as usize);
            if self.obj.ascii_eq(name, want).unwrap_or(false) {
                return Ok(Some(i));
            }
        }
        Ok(None)
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

/// The live chain (innermost first) holds `outer` (innermost first) as a
/// run: at its outer end when the capture held the whole stack, anywhere
/// when the capture was cut short of the outermost frames. The run's
/// innermost frame may have moved on within its own code when it is still
/// the thread's innermost (a loop in the handler itself); a frame that
/// called deeper since must be where it was.
fn runs(live: &[LiveFrame], outer: &[(u64, u64)]) -> bool {
    let want: Vec<(u64, u64)> = outer.iter().filter(|f| f.0 != 0).copied().collect();
    !want.is_empty()
        && live.windows(want.len()).enumerate().any(|(j, run)| {
            run.iter().zip(&want).enumerate().all(|(k, (l, w))| {
                if j == 0 && k == 0 {
                    l.code == w.0
                } else {
                    (l.code, l.instr) == *w
                }
            })
        })
}

/// `live` (innermost first) begins with every frame of `stack`, code and
/// instruction, frame for frame; the walk's activation boundaries in
/// `stack` (code 0: BPF marks each eval-loop activation, the live walk
/// has none) are no frames.
fn begins_with(live: &[LiveFrame], stack: &[(u64, u64)]) -> bool {
    let want: Vec<&(u64, u64)> = stack.iter().filter(|f| f.0 != 0).collect();
    !want.is_empty()
        && live.len() >= want.len()
        && want.iter().zip(live).all(|(w, l)| (l.code, l.instr) == **w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_is_still_in_the_captured_call() {
        // Innermost first, with an activation boundary (code 0) between.
        let captured = [(40, 9), (0, 0), (30, 5)];
        // Blocked where it was: the capture and its callers.
        assert!(begins_with(
            &live(&[(40, 9), (30, 5), (20, 2), (10, 1)]),
            &captured
        ));
        assert!(begins_with(&live(&[(40, 9), (30, 5)]), &captured));
        // Moved on: a frame returned, or the innermost runs elsewhere.
        assert!(!begins_with(&live(&[(30, 5), (20, 2)]), &captured));
        assert!(!begins_with(&live(&[(40, 8), (30, 5), (20, 2)]), &captured));
        assert!(!begins_with(&live(&[(40, 9), (35, 1), (30, 5)]), &captured));
        assert!(!begins_with(&live(&[(40, 9)]), &captured));
        assert!(!begins_with(&live(&[(40, 9)]), &[(0, 0)]));
    }

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
            assert!(
                super::super::objects::object_model(minor).is_some(),
                "3.{minor}"
            );
        }
        assert!(super::super::objects::object_model(9).is_none());
    }
}
