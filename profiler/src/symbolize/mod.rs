//! Symbolization: raw stalls (interned address stacks) -> [`Stall`]s with
//! named frames.
//!
//! In: [`RawStall`] + its stacks ([`Stacks`]). Out: [`Stall`] (outermost frame first).
//!
//! User addresses are *normalized* first — mapped to (file, file offset)
//! through a snapshot of `/proc/PID/maps` taken while the process lives —
//! then symbolized from the ELF file with blazesym (demangled, with file:line
//! and inlined functions where DWARF exists). The snapshot outlives the
//! process, so a command that exits right after its last stall still gets
//! names. Files are opened as mapped ([`maps::mapped_file`]: through the
//! target's root, a container's, when device and inode match the mapping;
//! else its `map_files` entry; never a host file that merely has the same
//! path). Results are cached per (device, inode, offset) and per kernel
//! address.
//! A [`Resolve`] trait lets golden tests replay recordings with a fixed table.

pub mod pyframes;
pub mod python;
pub mod queues;
pub mod request;
pub mod v8;
use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Kernel, Source},
};
use log::debug;

use crate::{
    assemble::stall::{RawStall, Stacks},
    classify::is_task_step,
    kernel::event::JsSlot,
    model::{
        CpuHolder, Frame, FrameKind, GilHolder, Holder, HolderRelation, PartKind, StackPart, Stall,
        ThreadInfo,
    },
    os::{
        limits,
        maps::{self, Mapping, mapped_file},
    },
    symbolize::pyframes::PyResolver,
};

/// Native and kernel symbols: what needs the target's ELF files and their
/// symbol tables and debug info, slow the first time a file is seen (the
/// engine's symbolizer thread). Frames come back outermost first.
pub trait ResolveNative {
    /// Frames for one user address (several when functions were inlined).
    fn user(&mut self, pid: u32, addr: u64) -> Vec<Frame>;
    fn kernel(&mut self, addr: u64) -> Frame;
}

/// What is read from the target's memory: valid only while the stack it
/// came from is current (the engine's drain thread, when a stack is first
/// seen and when its stall ends).
pub trait ResolveRuntime {
    /// Python frame from a code object address and instruction value.
    fn python(&mut self, pid: u32, code: u64, instr: u64) -> Frame;
    /// The thread id and name of the thread owning a `PyThreadState*`.
    fn python_thread(&mut self, pid: u32, tstate: u64) -> Option<(u32, String)>;
    /// Where a Node process's frames keep their `JSFunction` (`None`: not
    /// Node, or its V8 cannot be read).
    fn js_layout(&mut self, pid: u32) -> Option<v8::FrameLayout>;
    /// The JavaScript frame of a tagged `JSFunction` seen in a stack
    /// (`None`: it was not one when the stack was first seen).
    fn js(&mut self, pid: u32, slot: &JsSlot) -> Option<Frame>;
}

/// Turns addresses into frames: both halves.
pub trait Resolve: ResolveNative + ResolveRuntime {}
impl<T: ResolveNative + ResolveRuntime + ?Sized> Resolve for T {}

/// A snapshot of one process's file mappings.
#[derive(Debug)]
struct Maps {
    entries: Vec<Mapping>,
    taken: std::time::Instant,
}

impl Maps {
    fn read(pid: u32) -> Option<Maps> {
        Self::of(maps::read(pid).ok()?)
    }

    /// `/proc/PID/maps` text -> its mappings; `None` when there are none.
    fn parse(text: &str) -> Option<Maps> {
        Self::of(maps::parse(text))
    }

    fn of(entries: Vec<Mapping>) -> Option<Maps> {
        // An exiting process (a zombie) shows no mappings: keep the last
        // real snapshot rather than replace it with an empty one.
        (!entries.is_empty()).then(|| Maps {
            entries,
            taken: std::time::Instant::now(),
        })
    }

    fn find(&self, addr: u64) -> Option<&Mapping> {
        let i = self.entries.partition_point(|m| m.start <= addr);
        self.entries[..i].last().filter(|m| addr < m.end)
    }
}

/// JIT symbols a runtime writes to `/tmp/perf-PID.map` (`START SIZE NAME`
/// per line, hex; e.g. `node --perf-basic-prof`), read incrementally: each
/// refresh parses only the bytes appended since the last one (at most
/// [`limits::PERF_MAP_READ_PER_REFRESH`]), never the whole file again, and
/// the file is read up to [`limits::PERF_MAP_MAX_BYTES`] and
/// [`limits::PERF_MAP_MAX_LINES`] in all.
/// Code moves and addresses are reused, so ranges overlap: for an address,
/// the entry written last wins.
#[derive(Default, Debug)]
struct PerfMap {
    /// (device, inode) of the file read so far: another file at the path
    /// (the runtime restarted) is read from its start.
    file: Option<(u64, u64)>,
    /// Bytes of the file consumed so far.
    offset: u64,
    /// The last line, until its newline arrives.
    partial: Vec<u8>,
    /// Inside a line longer than [`limits::PERF_MAP_MAX_LINE`]: skipped to
    /// its newline.
    skipping: bool,
    /// Whole lines seen (the sequence number of the next).
    lines: usize,
    /// A cap was reached: nothing more is read from this file.
    capped: bool,
    /// (start, size, line number, name), sorted by start.
    entries: Vec<(u64, u64, usize, String)>,
    /// Largest entry size, bounding how far back a lookup looks.
    max_size: u64,
}

/// Where process `pid`'s perf map is: a runtime writes `/tmp/perf-<its
/// pid>.map` in its own root under the pid it sees (in a container, the
/// namespace's pid); a process already gone from our namespace's host view
/// is looked for at the host path.
pub fn perf_map_path(pid: u32) -> String {
    let ns_pid = crate::os::proc::namespace_id(pid, pid);
    let path = format!("/proc/{pid}/root/tmp/perf-{ns_pid}.map");
    if Path::new(&path).exists() || ns_pid != pid {
        path
    } else {
        format!("/tmp/perf-{pid}.map")
    }
}

/// Opens `pid`'s perf map as a regular file in its root, never through a
/// symlink out of it ([`limits::open_in_root`]); a process whose root is
/// gone has its map looked for at the host path, with `O_NOFOLLOW`.
fn open_perf_map(pid: u32) -> Option<fs::File> {
    let ns_pid = crate::os::proc::namespace_id(pid, pid);
    match limits::open_in_root(pid, &format!("/tmp/perf-{ns_pid}.map")) {
        Ok(f) => Some(f),
        Err(_) if ns_pid == pid && !Path::new(&format!("/proc/{pid}/root")).exists() => {
            use std::os::unix::fs::OpenOptionsExt;
            let f = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(format!("/tmp/perf-{pid}.map"))
                .ok()?;
            limits::regular(f).ok()
        }
        Err(_) => None,
    }
}

impl PerfMap {
    fn refresh(&mut self, pid: u32) {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let Some(file) = open_perf_map(pid) else {
            return;
        };
        let Ok(meta) = file.metadata() else {
            return;
        };
        let id = (meta.dev(), meta.ino());
        if self.file != Some(id) || meta.len() < self.offset {
            // A new file, or this one truncated and rewritten: start over.
            *self = PerfMap {
                file: Some(id),
                ..PerfMap::default()
            };
        }
        if self.capped || meta.len() == self.offset {
            return;
        }
        let end = meta
            .len()
            .min(self.offset + limits::PERF_MAP_READ_PER_REFRESH)
            .min(limits::PERF_MAP_MAX_BYTES);
        let before = self.entries.len();
        let mut buf = vec![0u8; 1 << 20];
        while self.offset < end && !self.capped {
            let want = ((end - self.offset) as usize).min(buf.len());
            let n = match file.read_at(&mut buf[..want], self.offset) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            self.offset += n as u64;
            self.feed(&buf[..n]);
        }
        if !self.capped && self.offset >= limits::PERF_MAP_MAX_BYTES && meta.len() > self.offset {
            self.capped = true;
            limits::hit(limits::Limit::PerfMapCapped);
        }
        if self.entries.len() != before {
            // The old entries are sorted and the new ones mostly ascending:
            // the stable sort merges the runs in about linear time.
            self.entries.sort_by_key(|e| (e.0, e.2));
            self.max_size = self.entries.iter().map(|e| e.1).max().unwrap_or(0);
        }
    }

    /// Parses the next bytes of the file; a line is used once its newline
    /// has been read.
    fn feed(&mut self, mut bytes: &[u8]) {
        while !self.capped {
            let Some(i) = bytes.iter().position(|&b| b == b'\n') else {
                break;
            };
            let piece = &bytes[..i];
            bytes = &bytes[i + 1..];
            if std::mem::take(&mut self.skipping) {
                continue;
            }
            if self.partial.len() + piece.len() > limits::PERF_MAP_MAX_LINE {
                limits::hit(limits::Limit::PerfMapLineTooLong);
                self.partial.clear();
                continue;
            }
            let line = if self.partial.is_empty() {
                piece.to_vec()
            } else {
                let mut l = std::mem::take(&mut self.partial);
                l.extend_from_slice(piece);
                l
            };
            self.line(&line);
        }
        if self.capped || self.skipping {
            return;
        }
        if self.partial.len() + bytes.len() > limits::PERF_MAP_MAX_LINE {
            limits::hit(limits::Limit::PerfMapLineTooLong);
            self.partial.clear();
            self.skipping = true;
        } else {
            self.partial.extend_from_slice(bytes);
        }
    }

    fn line(&mut self, line: &[u8]) {
        if self.lines >= limits::PERF_MAP_MAX_LINES {
            self.capped = true;
            limits::hit(limits::Limit::PerfMapCapped);
            return;
        }
        let seq = self.lines;
        self.lines += 1;
        let Ok(l) = std::str::from_utf8(line) else {
            return;
        };
        let mut it = l.splitn(3, ' ');
        let hex = |s: Option<&str>| u64::from_str_radix(s?.trim_start_matches("0x"), 16).ok();
        let (Some(start), Some(size), Some(name)) = (hex(it.next()), hex(it.next()), it.next())
        else {
            return;
        };
        self.entries.push((start, size, seq, name.to_string()));
    }

    /// Entries parsed so far (for tests and fuzzing).
    fn len(&self) -> usize {
        self.entries.len()
    }

    fn find(&self, addr: u64) -> Option<&str> {
        let end = self.entries.partition_point(|e| e.0 <= addr);
        let lowest = addr.saturating_sub(self.max_size);
        self.entries[..end]
            .iter()
            .rev()
            .take_while(|e| e.0 >= lowest)
            .filter(|e| addr < e.0.saturating_add(e.1))
            .max_by_key(|e| e.2)
            .map(|e| e.3.as_str())
    }
}

/// Fuzzing ([`crate::fuzzing`]): `/proc/PID/maps` text parsed as the
/// symbolizer does, and an address looked up.
pub(crate) fn fuzz_maps(text: &str, addr: u64) -> usize {
    Maps::parse(text).map_or(0, |m| m.find(addr).map_or(1, |_| 2))
}

/// Fuzzing: perf-map bytes fed in pieces of `piece` bytes, as a growing
/// file is read, then addresses looked up; the entries parsed.
pub(crate) fn fuzz_perf_map(bytes: &[u8], piece: usize, addrs: &[u64]) -> usize {
    let mut pm = PerfMap::default();
    for chunk in bytes.chunks(piece.max(1)) {
        pm.feed(chunk);
    }
    pm.entries.sort_by_key(|e| (e.0, e.2));
    pm.max_size = pm.entries.iter().map(|e| e.1).max().unwrap_or(0);
    for &a in addrs {
        let _ = pm.find(a);
    }
    pm.len()
}

/// The maps snapshots of every process, shared by the engine's drain
/// thread, which keeps them fresh while the processes live (a snapshot
/// outlives its process), and its symbolizer thread, which reads them and
/// refreshes one on a miss (a `dlopen` since). The lock is held for a
/// lookup or an insert, never while `/proc` is read.
#[derive(Clone, Default)]
pub struct SharedMaps(std::sync::Arc<std::sync::Mutex<HashMap<u32, std::sync::Arc<Maps>>>>);

impl SharedMaps {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, std::sync::Arc<Maps>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take (or refresh) the snapshot of a live process.
    pub fn refresh(&self, pid: u32) {
        if let Some(m) = Maps::read(pid) {
            self.lock().insert(pid, std::sync::Arc::new(m));
        }
    }

    /// [`refresh`](Self::refresh) when the snapshot is older than `age`:
    /// periodic upkeep, which must stay cheap (reading a large process's maps
    /// costs the kernel a walk of every mapping).
    pub fn refresh_if_older(&self, pid: u32, age: std::time::Duration) {
        let stale = self.get(pid).is_none_or(|m| m.taken.elapsed() >= age);
        if stale {
            self.refresh(pid);
        }
    }

    fn get(&self, pid: u32) -> Option<std::sync::Arc<Maps>> {
        self.lock().get(&pid).cloned()
    }

    pub fn forget(&self, pid: u32) {
        self.lock().remove(&pid);
    }

    /// Whether a snapshot of `pid` is held.
    pub fn holds(&self, pid: u32) -> bool {
        self.lock().contains_key(&pid)
    }
}

/// The native resolver: blazesym over ELF files and kallsyms, and perf maps
/// for JIT code. It runs on the engine's symbolizer thread: the first
/// lookup in a large binary (Node's symbol table, libpython's DWARF) takes
/// seconds.
pub struct BlazeResolver {
    perf_maps: HashMap<u32, PerfMap>,
    blaze: Symbolizer,
    maps: SharedMaps,
    /// By (device, inode, file offset): two containers' `/usr/bin/python3`
    /// are different files.
    user_cache: HashMap<((u32, u32), u64, u64), Vec<Frame>>,
    kernel_cache: HashMap<u64, Frame>,
    /// Files blazesym has opened (and keeps parsed and mapped for the life
    /// of `blaze`), by the process whose path (`/proc/PID/...`) named them,
    /// and whether their DWARF is read ([`dwarf_wanted`]).
    blaze_files: HashMap<PathBuf, (u32, bool)>,
    /// Of those, files of processes forgotten since `blaze` was built.
    blaze_stale: usize,
}

/// What is read from the targets' memory: Python code objects, thread
/// states and asyncio tasks, V8's functions. It runs on the engine's drain
/// thread, when a stack is first seen and when its stall ends, while what
/// the stack points at is still there.
#[derive(Default)]
pub struct RuntimeReader {
    /// Python frames resolved while their code objects were certainly alive
    /// (when a new stack was first seen), by (pid, code, instr).
    py_frames: HashMap<(u32, u64, u64), Frame>,
    python: HashMap<u32, Option<PyResolver>>,
    v8: HashMap<u32, v8::V8Watch>,
    /// The ring drain under way ([`RuntimeReader::next_drain`]).
    drain: u64,
}

/// Files blazesym may hold parsed at once. It caches every file it opened,
/// by path, for the life of its `Symbolizer`, and our paths are per process
/// (`/proc/PID/root/...`): a host where processes come and go would grow it
/// without end. Past this many (or [`BLAZE_STALE_MAX`] files of exited
/// processes) the symbolizer is rebuilt empty and the files of live
/// processes are parsed again when next needed (`symbol_cache_reset`).
const BLAZE_FILES_MAX: usize = 64;
const BLAZE_STALE_MAX: usize = 16;
/// Cached answers per cache (user addresses, kernel addresses) before that
/// cache is emptied (`symbol_cache_reset`): each is ~100 bytes.
const ANSWER_CACHE_MAX: usize = 1 << 18;

impl Default for BlazeResolver {
    fn default() -> Self {
        Self::new(SharedMaps::default())
    }
}

impl RuntimeReader {
    /// Resolve the JavaScript functions of a new stack now, while they are
    /// where the stack says (see [`v8`]).
    pub fn warm_js(&mut self, pid: u32, slots: &[JsSlot]) {
        if let Some(r) = self.v8.entry(pid).or_default().get(pid) {
            r.warm(slots, self.drain);
        }
    }

    /// A ring drain begins: what the warm-ups check is checked once in it.
    pub fn next_drain(&mut self) {
        self.drain += 1;
    }

    /// Start looking for V8 in `pid` on a thread of its own (its loop was
    /// just found): by its first stall its JavaScript frames can be read,
    /// and the drain never waits for Node's symbol table.
    pub fn start_js(&mut self, pid: u32) {
        self.v8.entry(pid).or_default().start(pid);
    }

    /// V8 in `pid` is still being looked for: a stack now gets no
    /// JavaScript frames.
    pub fn js_pending(&mut self, pid: u32) -> bool {
        self.v8.get_mut(&pid).is_some_and(|w| w.pending(pid))
    }

    /// The V8 version of each Node process whose metadata was read.
    pub fn js_versions(&self) -> HashMap<u32, (u32, u32, u32)> {
        self.v8
            .iter()
            .filter_map(|(&pid, w)| Some((pid, w.state.as_ref()?.as_ref().ok()?.meta.version)))
            .collect()
    }

    /// Why a Node process's JavaScript frames cannot be read, if so.
    pub fn js_problems(&self) -> Vec<crate::model::RuntimeProblem> {
        self.v8
            .values()
            .filter_map(|w| w.problem().cloned())
            .collect()
    }

    /// Resolve Python frames now, while the process and its code objects
    /// are alive (a stall is symbolized later, and the process may be gone
    /// by then). Each call re-validates the code objects (address reuse).
    ///
    /// A (code, instr) pair already resolved is not read again: re-checking
    /// every frame of every new stack costs a `pread` each, thousands a
    /// second for a busy interpreter. The check against a reused code-object
    /// address then only happens for pairs not seen before (for 3.11+, `instr`
    /// is an address inside the code object, so a new object at an old
    /// address rarely repeats a pair).
    pub fn warm_python(&mut self, pid: u32, frames: &[(u64, u64)]) {
        for &(code, instr) in frames {
            if code == 0 || self.py_frames.contains_key(&(pid, code, instr)) {
                continue;
            }
            let f = self.python_live(pid, code, instr);
            if f.kind == FrameKind::Python {
                if self.py_frames.len() >= ANSWER_CACHE_MAX {
                    // A target generating code without end: stalls symbolized
                    // later re-read their code objects (if still alive).
                    limits::hit(limits::Limit::SymbolCacheReset);
                    self.py_frames.clear();
                }
                self.py_frames.insert((pid, code, instr), f);
            }
        }
    }

    fn python_live(&mut self, pid: u32, code: u64, instr: u64) -> Frame {
        let resolver = self
            .python
            .entry(pid)
            .or_insert_with(|| PyResolver::for_pid(pid));
        match resolver.as_mut().and_then(|r| r.resolve(code, instr)) {
            Some(info) => Frame {
                file: Some(info.filename.into()),
                line: (info.line > 0).then_some(info.line),
                ..Frame::new(info.qualname, FrameKind::Python)
            },
            None => Frame::unknown_python(),
        }
    }

    /// The asyncio task thread `tid` of `pid` is running now, checked
    /// against `stack`, the Python frames of a stack event of the thread
    /// (see [`python::TaskReader`]). Live processes only.
    pub fn asyncio_task(
        &mut self,
        pid: u32,
        tid: u32,
        stack: &[(u64, u64)],
        captured: &python::Captured,
    ) -> Result<python::TaskFound, python::TaskRead> {
        let resolver = self
            .python
            .entry(pid)
            .or_insert_with(|| PyResolver::for_pid(pid));
        match resolver.as_mut() {
            Some(r) => r.asyncio_task(tid, stack, captured),
            None => Err(python::TaskRead::NoTask),
        }
    }

    /// The OpenTelemetry span of the current context of thread `tid` of
    /// `pid` (the callback's, when no asyncio task runs), checked against
    /// `stack` (see [`PyResolver::thread_trace`]). Live processes only;
    /// None for a process that is not a readable CPython.
    pub fn thread_trace(
        &mut self,
        pid: u32,
        tid: u32,
        stack: &[(u64, u64)],
    ) -> Option<python::TraceFound> {
        let resolver = self
            .python
            .entry(pid)
            .or_insert_with(|| PyResolver::for_pid(pid));
        Some(resolver.as_mut()?.thread_trace(tid, stack))
    }

    /// CPython 3.14+: where `pid`'s thread states hold their running
    /// asyncio task, and the task's layout, once a task read found them.
    pub fn kernel_task(&self, pid: u32) -> Option<(u64, profiler_common::python::TaskLayout)> {
        self.python.get(&pid)?.as_ref()?.kernel_task()
    }

    /// What the asyncio loop of thread `tid` of `pid` has waiting now (see
    /// [`python::QueueReader`]). Live processes only; a process that is not
    /// a readable CPython is [`queues::QueuesMiss::Unsupported`].
    pub fn loop_queues(
        &mut self,
        pid: u32,
        tid: u32,
    ) -> Result<queues::Queues, queues::QueuesMiss> {
        let resolver = self
            .python
            .entry(pid)
            .or_insert_with(|| PyResolver::for_pid(pid));
        match resolver.as_mut() {
            Some(r) => r.loop_queues(tid),
            None => Err(queues::QueuesMiss::Unsupported("not CPython".into())),
        }
    }

    /// The ASGI request thread `tid` of `pid` is serving now, checked
    /// against `stack` (see [`request::RouteReader`]). Live processes only.
    pub fn asgi_route(
        &mut self,
        pid: u32,
        tid: u32,
        stack: &[(u64, u64)],
    ) -> Result<crate::model::Route, request::RouteRead> {
        let resolver = self
            .python
            .entry(pid)
            .or_insert_with(|| PyResolver::for_pid(pid));
        match resolver.as_mut() {
            Some(r) => r.asgi_route(tid, stack),
            None => Err(request::RouteRead::NoRequest),
        }
    }

    /// The route of the express request thread `tid` of `pid` serves, from
    /// `slots`, the JavaScript frames of one of its stack events (see
    /// [`v8::JsResolver::express_route`]). Live processes only.
    pub fn express_route(
        &mut self,
        pid: u32,
        slots: &[JsSlot],
    ) -> Result<crate::model::Route, request::RouteRead> {
        match self.v8.entry(pid).or_default().get(pid) {
            Some(r) => r.express_route(slots),
            None => Err(request::RouteRead::NoRequest),
        }
    }

    /// What the loop of thread `tid` of Node process `pid` has waiting now
    /// (its timers and immediates), from `slots`, the JavaScript frames of
    /// one of its stack events (see [`v8::JsResolver::node_timers`]). Live
    /// processes only.
    pub fn node_timers(
        &mut self,
        pid: u32,
        tid: u32,
        slots: &[JsSlot],
    ) -> Result<queues::Queues, queues::QueuesMiss> {
        match self.v8.entry(pid).or_default().get(pid) {
            Some(r) => r.node_timers(tid == pid, slots),
            None => Err(queues::QueuesMiss::Unsupported(
                "V8 is not read in this process".into(),
            )),
        }
    }

    /// Whether `pid` is a Node process whose V8 is read.
    pub fn is_node(&self, pid: u32) -> bool {
        self.v8
            .get(&pid)
            .is_some_and(|w| matches!(w.state, Some(Ok(_))))
    }

    /// Forget everything read from a process (it exited or exec'd; its pid
    /// may be reused): Python and V8 state.
    pub fn forget(&mut self, pid: u32) {
        self.v8.remove(&pid);
        self.python.remove(&pid);
        self.py_frames.retain(|k, _| k.0 != pid);
    }
}

impl BlazeResolver {
    pub fn new(maps: SharedMaps) -> Self {
        let blaze = Self::symbolizer();
        BlazeResolver {
            perf_maps: HashMap::new(),
            blaze,
            maps,
            user_cache: HashMap::new(),
            kernel_cache: HashMap::new(),
            blaze_files: HashMap::new(),
            blaze_stale: 0,
        }
    }

    fn symbolizer() -> Symbolizer {
        Symbolizer::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            .build()
    }

    /// Forget everything held for a process (it exited or exec'd; its pid
    /// may be reused): its perf map; the files blazesym opened through its
    /// paths count towards a rebuild. (Its maps snapshot is the engine's to
    /// drop, once its last stall is named.)
    pub fn forget(&mut self, pid: u32) {
        self.perf_maps.remove(&pid);
        let before = self.blaze_files.len();
        self.blaze_files.retain(|_, (p, _)| *p != pid);
        self.blaze_stale += before - self.blaze_files.len();
        if self.blaze_stale > BLAZE_STALE_MAX {
            self.reset_blaze();
        }
    }

    fn reset_blaze(&mut self) {
        log::debug!(
            "symbolizer rebuilt: {} files held, {} of exited processes",
            self.blaze_files.len(),
            self.blaze_stale
        );
        limits::hit(limits::Limit::SymbolCacheReset);
        self.blaze = Self::symbolizer();
        self.blaze_files.clear();
        self.blaze_stale = 0;
    }

    /// Let go of every file blazesym parsed (their symbol tables, DWARF and
    /// mappings), keeping the answers: the symbolizer is idle. Freed heap is
    /// handed back to the kernel (glibc keeps it in its arenas otherwise).
    pub fn release_files(&mut self) {
        if self.blaze_files.is_empty() {
            return;
        }
        debug!(
            "symbolizer idle: releasing {} parsed files",
            self.blaze_files.len()
        );
        self.blaze = Self::symbolizer();
        self.blaze_files.clear();
        self.blaze_stale = 0;
        crate::os::heap::release();
    }

    /// Files blazesym holds now (tests, memory accounting).
    pub fn files_held(&self) -> usize {
        self.blaze_files.len()
    }

    /// Refresh the maps snapshot and the perf map of a live process: before
    /// stalls held back for JIT names are symbolized.
    pub fn refresh(&mut self, pid: u32) {
        self.maps.refresh(pid);
        if let Some(pm) = self.perf_maps.get_mut(&pid) {
            pm.refresh(pid);
        }
    }

    fn mapping(&mut self, pid: u32, addr: u64) -> Option<Mapping> {
        if let Some(m) = self.maps.get(pid).and_then(|m| m.find(addr).cloned()) {
            return Some(m);
        }
        // A mapping made after the last snapshot (dlopen): refresh once.
        self.maps.refresh(pid);
        self.maps.get(pid).and_then(|m| m.find(addr).cloned())
    }

    fn symbolize_file(&mut self, pid: u32, path: &Path, offset: u64) -> Vec<Frame> {
        let dwarf = match self.blaze_files.get(path) {
            Some(&(_, dwarf)) => dwarf,
            None => {
                if self.blaze_files.len() >= BLAZE_FILES_MAX {
                    self.reset_blaze();
                }
                let dwarf = dwarf_wanted(path);
                if !dwarf {
                    debug!(
                        "{}: a CPython interpreter, named from its symbol table",
                        path.display()
                    );
                }
                self.blaze_files.insert(path.to_path_buf(), (pid, dwarf));
                dwarf
            }
        };
        let mut elf = Elf::new(path);
        elf.debug_syms = dwarf;
        let src = Source::Elf(elf);
        let sym = match self.blaze.symbolize_single(&src, Input::FileOffset(offset)) {
            Ok(Symbolized::Sym(sym)) => sym,
            Ok(Symbolized::Unknown(reason)) => {
                debug!("no symbol at {}+{offset:#x}: {reason:?}", path.display());
                return Vec::new();
            }
            Err(err) => {
                debug!("symbolizing {}+{offset:#x}: {err}", path.display());
                return Vec::new();
            }
        };
        let loc = |ci: Option<&blazesym::symbolize::CodeInfo>| {
            ci.map(|c| {
                let file: crate::model::Name = match &c.dir {
                    Some(d) => d.join(&c.file).to_string_lossy().into_owned().into(),
                    None => c.file.to_string_lossy().into_owned().into(),
                };
                (Some(file), c.line)
            })
            .unwrap_or((None, None))
        };
        let (file, line) = loc(sym.code_info.as_deref());
        let mut frames = vec![Frame {
            name: sym.name.to_string().into(),
            file,
            line,
            kind: FrameKind::Native,
            module: None,
        }];
        for f in sym.inlined.iter() {
            let (file, line) = loc(f.code_info.as_ref());
            frames.push(Frame {
                name: f.name.to_string().into(),
                file,
                line,
                kind: FrameKind::Native,
                module: None,
            });
        }
        frames
    }
}

/// Whether a file's DWARF is worth reading: not for a CPython interpreter
/// (the ELF that defines `_PyRuntime`). Its frames that matter are the
/// Python frames read from its memory, which replace its eval loop; its
/// symbol table still names every C function in it. Its DWARF (libpython
/// 3.11 with debug info: 9 MiB of `.debug_info`) would add inlined helpers
/// and C lines at ~33 MiB of parsed and mapped memory, half the agent's
/// budget on the demo (docs/benchmarks.md §3).
fn dwarf_wanted(path: &Path) -> bool {
    !python::is_interpreter_file(path)
}

/// The mapping of a user address when it is a file's; else the frame it
/// gets: `[unknown 0x…]` outside every mapping, the mapping's own name for
/// `[vdso]`, `[heap]` and anonymous (JIT) memory.
fn unfiled(m: Option<Mapping>, addr: u64) -> Result<Mapping, Vec<Frame>> {
    let Some(m) = m else {
        return Err(vec![Frame::new(
            format!("[unknown {addr:#x}]"),
            FrameKind::Native,
        )]);
    };
    if m.path.starts_with('/') {
        return Ok(m);
    }
    let name = if m.path.is_empty() {
        "[anon]".to_string()
    } else {
        m.path.clone()
    };
    Err(vec![Frame {
        module: Some(name.as_str().into()),
        ..Frame::new(name, FrameKind::Native)
    }])
}

impl ResolveNative for BlazeResolver {
    fn user(&mut self, pid: u32, addr: u64) -> Vec<Frame> {
        let m = self.mapping(pid, addr);
        if m.as_ref().is_none_or(|m| !m.path.starts_with('/')) {
            // Anonymous executable memory: JIT code, named by a perf map if any.
            let pm = self.perf_maps.entry(pid).or_default();
            if pm.find(addr).is_none() {
                pm.refresh(pid);
            }
            if let Some(name) = pm.find(addr) {
                return vec![Frame {
                    module: Some("[jit]".into()),
                    ..Frame::new(name, FrameKind::Native)
                }];
            }
        }
        let m = match unfiled(m, addr) {
            Ok(m) => m,
            Err(frames) => return frames,
        };
        let offset = addr - m.start + m.offset;
        let key = (m.dev, m.inode, offset);
        if let Some(f) = self.user_cache.get(&key) {
            return f.clone();
        }
        let opened = mapped_file(pid, &m);
        // blazesym maps the whole file: only a regular file under the ELF
        // size cap (a target can map a sparse file of any size).
        let opened = opened.filter(|p| {
            let ok = fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() <= limits::ELF_FILE_MAX);
            if !ok {
                limits::hit(limits::Limit::ElfTooLarge);
            }
            ok
        });
        let mut frames = match &opened {
            Some(path) => self.symbolize_file(pid, path, offset),
            None => {
                debug!("pid {pid}: {} cannot be opened as mapped", m.path);
                Vec::new()
            }
        };
        let base = m.path.rsplit('/').next().unwrap_or(&m.path).to_string();
        if frames.is_empty() {
            frames.push(Frame::new(
                format!("[{base}+{offset:#x}]"),
                FrameKind::Native,
            ));
        }
        for f in frames.iter_mut() {
            f.module = Some(base.as_str().into());
        }
        // A file not opened now may open later (the snapshot outlives the
        // process, but a refresh may find it): only answers are kept.
        if opened.is_some() {
            if self.user_cache.len() >= ANSWER_CACHE_MAX {
                limits::hit(limits::Limit::SymbolCacheReset);
                self.user_cache.clear();
            }
            self.user_cache.insert(key, frames.clone());
        }
        frames
    }

    fn kernel(&mut self, addr: u64) -> Frame {
        if let Some(f) = self.kernel_cache.get(&addr) {
            return f.clone();
        }
        let src = Source::Kernel(Kernel::default());
        let name = match self.blaze.symbolize_single(&src, Input::AbsAddr(addr)) {
            Ok(Symbolized::Sym(sym)) => sym.name.to_string(),
            _ => format!("[kernel {addr:#x}]"),
        };
        let f = Frame::new(name, FrameKind::Kernel);
        if self.kernel_cache.len() >= ANSWER_CACHE_MAX {
            limits::hit(limits::Limit::SymbolCacheReset);
            self.kernel_cache.clear();
        }
        self.kernel_cache.insert(addr, f.clone());
        f
    }
}

impl ResolveRuntime for RuntimeReader {
    fn python(&mut self, pid: u32, code: u64, instr: u64) -> Frame {
        if let Some(f) = self.py_frames.get(&(pid, code, instr)) {
            return f.clone();
        }
        self.python_live(pid, code, instr)
    }

    fn python_thread(&mut self, pid: u32, tstate: u64) -> Option<(u32, String)> {
        let resolver = self
            .python
            .entry(pid)
            .or_insert_with(|| PyResolver::for_pid(pid));
        let tid = resolver.as_mut()?.thread_of(tstate)?;
        let name = limits::read_proc(&format!("/proc/{pid}/task/{tid}/comm"))
            .map(|s| s.trim_end().to_string());
        Some((tid, name.unwrap_or_else(|_| "?".into())))
    }

    fn js_layout(&mut self, pid: u32) -> Option<v8::FrameLayout> {
        Some(self.v8.entry(pid).or_default().get(pid)?.meta.layout)
    }

    fn js(&mut self, pid: u32, slot: &JsSlot) -> Option<Frame> {
        self.v8
            .get(&pid)?
            .state
            .as_ref()?
            .as_ref()
            .ok()?
            .cached(slot)
    }
}

/// x86-64 syscall name, e.g. 0 -> "read".
pub fn syscall_name(nr: u32) -> String {
    syscalls::Sysno::new(nr as usize)
        .map(|s| s.name().to_string())
        .unwrap_or_else(|| format!("syscall_{nr}"))
}

/// Frames of one raw stack, outermost first: user (with Python frames merged
/// in, see `python::merge`), then kernel.
pub fn frames_of(res: &mut dyn Resolve, pid: u32, stacks: &dyn Stacks, id: u32) -> Vec<Frame> {
    let raw = stacks.get(id);
    let mut user: Vec<Frame> = Vec::new();
    // Innermost first in the raw stack; return addresses (all but the
    // innermost) point after the call, so look up addr-1 to stay on its line.
    let mut js = raw.js.iter().rev().peekable();
    let mut in_gc = false;
    for (i, &a) in raw.user.iter().enumerate().rev() {
        let a = if i == 0 { a } else { a.saturating_sub(1) };
        let mut native = res.user(pid, a);
        // A JavaScript frame stands in for its native symbol (the
        // interpreter trampoline, anonymous JIT code), except where a perf
        // map named it.
        if js.peek().is_some_and(|s| s.frame as usize == i) {
            let slot = js.next().copied().unwrap_or_default();
            let func = slot.func;
            if !native.iter().any(v8::is_perf_map_frame) {
                match res.js(pid, &slot) {
                    Some(f) => {
                        v8::count_frame(v8::Tier::of(&native), true);
                        native = vec![f];
                    }
                    None if native.iter().any(v8::is_js_code) => {
                        log::debug!(
                            "js {func:#x} at {a:#x} ({}, bytecode {:#x}): unreadable",
                            native.first().map_or("?", |f| f.name.as_str()),
                            slot.bytecode
                        );
                        v8::count_frame(v8::Tier::of(&native), false);
                        v8::count_unreadable();
                        native = vec![Frame::marker("[js: unreadable]")];
                    }
                    None => {}
                }
            }
        }
        // V8's collector: `[gc]` above its outermost frame.
        if !in_gc
            && native
                .iter()
                .any(|f| f.kind == FrameKind::Native && v8::is_gc_entry(&f.name))
        {
            in_gc = true;
            user.push(Frame::marker("[gc]"));
        }
        user.extend(native);
    }
    if !raw.python.is_empty() {
        let walk = raw
            .python
            .iter()
            .map(|&(c, i)| (c != 0).then(|| res.python(pid, c, i)))
            .collect();
        user = crate::symbolize::pyframes::merge(
            user,
            crate::symbolize::pyframes::groups(walk),
            raw.py_status,
        );
    }
    let mut frames = user;
    for &a in raw.kernel.iter().rev() {
        frames.push(res.kernel(a));
    }
    frames
}

fn gil_holder(res: &mut dyn Resolve, pid: u32, stacks: &dyn Stacks, id: u32) -> GilHolder {
    let raw = stacks.get(id);
    let who = res.python_thread(pid, raw.gil_holder);
    GilHolder {
        tid: who.as_ref().map(|w| w.0),
        // The engine fills it in from the holder's descriptor.
        ns_tid: None,
        thread_name: who.map(|w| w.1),
        frames: raw
            .holder_python
            .iter()
            .rev()
            .filter(|f| f.0 != 0)
            .map(|&(c, i)| res.python(pid, c, i))
            .collect(),
    }
}

/// The coroutine an asyncio task step was running: the first Python frame
/// after the C task step (`task_step`) or the pure-Python `Task.__step`.
/// Handles (`Handle._run`) without a task have no coroutine.
fn asyncio_coroutine(frames: &[Frame]) -> Option<String> {
    let step = frames.iter().rposition(is_task_step)?;
    frames[step + 1..]
        .iter()
        .find(|f| f.kind == FrameKind::Python && !is_task_step(f))
        .map(Frame::label)
}

/// A CPU holder as the report shows it; whether it is in the same
/// container is the engine's to say (it knows the processes).
fn cpu_holder(tgid: u32, h: &Holder, ns: u64) -> CpuHolder {
    let relation = match h {
        Holder::OtherTasks => HolderRelation::Other,
        Holder::Idle { .. } => HolderRelation::Idle,
        Holder::Task { tgid: t, .. } if *t == tgid => HolderRelation::SameProcess,
        Holder::Task { .. } => HolderRelation::Other,
    };
    let (pid, tgid, comm) = h.ids();
    CpuHolder {
        pid,
        tgid,
        comm: comm.to_string(),
        ns,
        relation,
    }
}

/// Symbolize a finished stall.
pub fn to_stall(
    raw: &RawStall,
    stacks: &dyn Stacks,
    res: &mut dyn Resolve,
    thread: &ThreadInfo,
) -> Stall {
    let mut parts: Vec<StackPart> = raw
        .parts
        .iter()
        .map(|p| {
            let mut frames = match p.stack {
                Some(id) => frames_of(res, raw.tgid, stacks, id),
                None => Vec::new(),
            };
            let syscall = p.syscall.map(syscall_name);
            match p.kind {
                PartKind::OnCpu if p.stack.is_none() => {
                    frames.push(Frame::marker("[on-cpu: between samples]"))
                }
                PartKind::OnCpu => {}
                PartKind::OffCpu => frames.push(Frame::marker(format!(
                    "[off-cpu: {}]",
                    syscall.as_deref().unwrap_or("no syscall")
                ))),
                PartKind::Runqueue | PartKind::Throttled if p.woken => frames.push(Frame::marker(
                    format!("[woken from {}]", syscall.as_deref().unwrap_or("its wait")),
                )),
                PartKind::Runqueue => frames.push(Frame::marker("[runqueue]")),
                PartKind::Throttled => frames.push(Frame::marker("[cpu throttled]")),
                PartKind::GilWait => {} // marked below, with the holder
            }
            if p.woken && p.kind == PartKind::Throttled {
                frames.push(Frame::marker("[cpu throttled]"));
            }
            // Run-queue time after a timed GIL wait keeps the holder too:
            // the wait would not have been there without it.
            let gil_holder = match (p.kind, p.stack) {
                (PartKind::GilWait | PartKind::Runqueue, Some(id))
                    if stacks.get(id).gil_holder != 0 =>
                {
                    Some(gil_holder(res, raw.tgid, stacks, id))
                }
                _ => None,
            };
            if let (PartKind::GilWait, Some(h)) = (p.kind, &gil_holder) {
                frames.push(Frame::marker(format!(
                    "[gil wait: held by {}]",
                    h.describe()
                )));
            }
            StackPart {
                frames,
                weight_ns: p.weight_ns,
                kind: p.kind,
                syscall,
                waker_tid: p.waker,
                gil_holder,
                woken: p.woken,
            }
        })
        .collect();
    parts.sort_by_key(|p| std::cmp::Reverse(p.weight_ns));
    let coroutine = parts.first().and_then(|p| asyncio_coroutine(&p.frames));
    Stall {
        coroutine,
        task: None,           // the engine's: read while the stall ran
        thread_context: None, // the engine's too
        route: None,          // the engine's too
        held_up: None,        // the engine's too
        pid: raw.tgid,
        tid: raw.tid,
        ns_tid: thread.ns_tid,
        thread_name: thread.name.clone(),
        start_ns: raw.start_ns,
        end_ns: raw.end_ns,
        duration_ns: raw.duration_ns(),
        on_cpu_ns: raw.on_cpu_ns,
        off_cpu_ns: raw.off_cpu_ns,
        runqueue_ns: raw.runqueue_ns,
        throttled_ns: raw.throttled_ns,
        cpu_holders: raw
            .cpu_holders
            .iter()
            .map(|(h, ns)| cpu_holder(raw.tgid, h, *ns))
            .collect(),
        incomplete: raw.incomplete,
        stacks: parts,
    }
}

/// A fixed address table, for golden tests and replays without the target
/// (`symbols.json`, written by `record --save-events`). Keys are hex
/// addresses as the pipeline looks them up (user return addresses minus one).
#[derive(Default, Debug, serde::Deserialize, serde::Serialize)]
pub struct TableResolver {
    #[serde(default)]
    pub user: HashMap<String, Vec<Frame>>,
    #[serde(default)]
    pub kernel: HashMap<String, String>,
    /// `"code:instr"` in hex -> frame.
    #[serde(default)]
    pub python: HashMap<String, Frame>,
    /// tstate in hex -> (tid, thread name).
    #[serde(default)]
    pub python_threads: HashMap<String, (u32, String)>,
    /// `"tid:start_ns"` of a stall -> the asyncio task read while it ran.
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub tasks: HashMap<String, crate::model::Task>,
    /// `"tid:start_ns"` of a stall that ran no task -> the span of its
    /// thread's own context, read while it ran.
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub thread_contexts: HashMap<String, crate::model::ContextTrace>,
    /// `"tid:start_ns"` of a stall -> the ASGI route read while it ran.
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub routes: HashMap<String, crate::model::Route>,
    /// `"tid:start_ns"` of a stall -> what it held up (or why not read).
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub held_up: HashMap<String, crate::model::HeldUp>,
    /// pid -> where its V8 frames keep their function.
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub js_layouts: HashMap<String, v8::FrameLayout>,
    /// `"pid:JSFunction[:BytecodeArray:offset]"` in hex -> frame (the
    /// latest answer for that key: a function a GC moved into another's old
    /// address during the recording is named by the later one in a replay).
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub js: HashMap<String, Frame>,
}

/// Wraps a resolver and records every answer into a [`TableResolver`], so
/// a recording can be replayed later without the target.
pub struct Recorder<'a, R: ?Sized> {
    pub inner: &'a mut R,
    pub table: &'a mut TableResolver,
}

impl<R: ResolveNative + ?Sized> ResolveNative for Recorder<'_, R> {
    fn user(&mut self, pid: u32, addr: u64) -> Vec<Frame> {
        let f = self.inner.user(pid, addr);
        self.table.user.insert(format!("{addr:#x}"), f.clone());
        f
    }
    fn kernel(&mut self, addr: u64) -> Frame {
        let f = self.inner.kernel(addr);
        self.table
            .kernel
            .insert(format!("{addr:#x}"), f.name.to_string());
        f
    }
}

impl<R: ResolveRuntime + ?Sized> ResolveRuntime for Recorder<'_, R> {
    fn python(&mut self, pid: u32, code: u64, instr: u64) -> Frame {
        let f = self.inner.python(pid, code, instr);
        self.table
            .python
            .insert(format!("{code:#x}:{instr:#x}"), f.clone());
        f
    }
    fn python_thread(&mut self, pid: u32, tstate: u64) -> Option<(u32, String)> {
        let t = self.inner.python_thread(pid, tstate);
        if let Some(t) = &t {
            self.table
                .python_threads
                .insert(format!("{tstate:#x}"), t.clone());
        }
        t
    }
    fn js_layout(&mut self, pid: u32) -> Option<v8::FrameLayout> {
        let l = self.inner.js_layout(pid);
        if let Some(l) = l {
            self.table.js_layouts.insert(pid.to_string(), l);
        }
        l
    }
    fn js(&mut self, pid: u32, slot: &JsSlot) -> Option<Frame> {
        let f = self.inner.js(pid, slot);
        if let Some(f) = &f {
            self.table.js.insert(js_key(pid, slot), f.clone());
        }
        f
    }
}

impl TableResolver {
    /// Take the native half (user and kernel addresses) out of the table:
    /// a replay's symbolizer gets it, the drain keeps the rest.
    pub fn take_native(&mut self) -> TableResolver {
        TableResolver {
            user: std::mem::take(&mut self.user),
            kernel: std::mem::take(&mut self.kernel),
            ..TableResolver::default()
        }
    }

    /// Put a native half back (the symbolizer's recorded answers, at the end
    /// of a recording).
    pub fn merge_native(&mut self, native: TableResolver) {
        self.user.extend(native.user);
        self.kernel.extend(native.kernel);
    }
}

/// The answers read from the target's memory for one stall, taken on the
/// drain thread when the stall ends ([`Answers::read`]) so that the
/// symbolizer thread, later, needs nothing from the target but its files.
#[derive(Debug, Default)]
pub struct Answers {
    python: HashMap<(u64, u64), Frame>,
    threads: HashMap<u64, (u32, String)>,
    js: HashMap<JsSlot, Frame>,
    /// JavaScript frames with a bytecode that no answer named yet.
    js_missing: usize,
}

/// A JavaScript frame's key in `symbols.json`: `"pid:JSFunction"`, and
/// `":BytecodeArray:offset"` after it where the frame has them (hex).
fn js_key(pid: u32, slot: &JsSlot) -> String {
    if slot.bytecode == 0 && slot.offset == 0 {
        format!("{pid}:{:#x}", slot.func)
    } else {
        format!(
            "{pid}:{:#x}:{:#x}:{:#x}",
            slot.func, slot.bytecode, slot.offset
        )
    }
}

impl Answers {
    /// Everything [`to_stall`] will ask of the runtime half for `raw`, asked
    /// of `res` now, in the order `to_stall` would (a recording's table gets
    /// the same entries either way).
    pub fn read(raw: &RawStall, stacks: &dyn Stacks, res: &mut dyn ResolveRuntime) -> Answers {
        let pid = raw.tgid;
        let mut a = Answers::default();
        a.read_js(raw, stacks, res);
        for p in &raw.parts {
            let Some(id) = p.stack else { continue };
            let st = stacks.get(id);
            for &(c, i) in st.python.iter().chain(&st.holder_python) {
                if c != 0 && !a.python.contains_key(&(c, i)) {
                    a.python.insert((c, i), res.python(pid, c, i));
                }
            }
            if matches!(p.kind, PartKind::GilWait | PartKind::Runqueue)
                && st.gil_holder != 0
                && !a.threads.contains_key(&st.gil_holder)
                && let Some(t) = res.python_thread(pid, st.gil_holder)
            {
                a.threads.insert(st.gil_holder, t);
            }
        }
        a
    }

    /// The JavaScript frames' answers not taken yet (all of them, the
    /// first time); counts those with a bytecode still unnamed.
    fn read_js(&mut self, raw: &RawStall, stacks: &dyn Stacks, res: &mut dyn ResolveRuntime) {
        self.js_missing = 0;
        let mut missing = std::collections::HashSet::new();
        for p in &raw.parts {
            let Some(id) = p.stack else { continue };
            for slot in stacks.get(id).js.iter().rev() {
                let key = slot.identity();
                if self.js.contains_key(&key) || missing.contains(&key) {
                    continue;
                }
                match res.js(raw.tgid, slot) {
                    Some(f) => {
                        self.js.insert(key, f);
                    }
                    None => {
                        missing.insert(key);
                    }
                }
            }
        }
        self.js_missing = missing.iter().filter(|s| s.bytecode != 0).count();
    }

    /// Interpreted or baseline frames no answer named yet: the stall's
    /// own closures had moved before they were read (the agent's lag at
    /// its first stacks), and their bytecode was not seen with a function
    /// yet. A later request running the same code names them: ask again
    /// ([`Answers::retry_js`]) after a while.
    pub fn js_missing(&self) -> bool {
        self.js_missing > 0
    }

    /// Ask again for the JavaScript frames not named yet.
    pub fn retry_js(&mut self, raw: &RawStall, stacks: &dyn Stacks, res: &mut dyn ResolveRuntime) {
        self.read_js(raw, stacks, res);
    }

    /// The GIL holders' thread ids.
    pub fn holder_tids(&self) -> impl Iterator<Item = u32> + '_ {
        self.threads.values().map(|t| t.0)
    }
}

impl ResolveRuntime for Answers {
    fn python(&mut self, _pid: u32, code: u64, instr: u64) -> Frame {
        self.python
            .get(&(code, instr))
            .cloned()
            .unwrap_or_else(Frame::unknown_python)
    }
    fn python_thread(&mut self, _pid: u32, tstate: u64) -> Option<(u32, String)> {
        self.threads.get(&tstate).cloned()
    }
    fn js_layout(&mut self, _pid: u32) -> Option<v8::FrameLayout> {
        None
    }
    fn js(&mut self, _pid: u32, slot: &JsSlot) -> Option<Frame> {
        self.js.get(&slot.identity()).cloned()
    }
}

/// A native half and a runtime half as one [`Resolve`].
pub struct Joined<'a> {
    pub native: &'a mut dyn ResolveNative,
    pub runtime: &'a mut dyn ResolveRuntime,
}

impl ResolveNative for Joined<'_> {
    fn user(&mut self, pid: u32, addr: u64) -> Vec<Frame> {
        self.native.user(pid, addr)
    }
    fn kernel(&mut self, addr: u64) -> Frame {
        self.native.kernel(addr)
    }
}

impl ResolveRuntime for Joined<'_> {
    fn python(&mut self, pid: u32, code: u64, instr: u64) -> Frame {
        self.runtime.python(pid, code, instr)
    }
    fn python_thread(&mut self, pid: u32, tstate: u64) -> Option<(u32, String)> {
        self.runtime.python_thread(pid, tstate)
    }
    fn js_layout(&mut self, pid: u32) -> Option<v8::FrameLayout> {
        self.runtime.js_layout(pid)
    }
    fn js(&mut self, pid: u32, slot: &JsSlot) -> Option<Frame> {
        self.runtime.js(pid, slot)
    }
}

/// Native frames without symbols: `[libfoo.so+0x1234]` from the maps
/// snapshot, `[kernel 0x…]`. What a stall gets when the symbolizer thread
/// is too far behind to take it (`drops.symbolizer_behind`): its Python
/// and JavaScript frames, read on the drain thread, keep their names.
pub struct Unnamed<'a>(pub &'a SharedMaps);

impl ResolveNative for Unnamed<'_> {
    fn user(&mut self, pid: u32, addr: u64) -> Vec<Frame> {
        let m = match unfiled(self.0.get(pid).and_then(|m| m.find(addr).cloned()), addr) {
            Ok(m) => m,
            Err(frames) => return frames,
        };
        let offset = addr - m.start + m.offset;
        let base = m.path.rsplit('/').next().unwrap_or(&m.path).to_string();
        vec![Frame {
            module: Some(base.as_str().into()),
            ..Frame::new(format!("[{base}+{offset:#x}]"), FrameKind::Native)
        }]
    }
    fn kernel(&mut self, addr: u64) -> Frame {
        Frame::new(format!("[kernel {addr:#x}]"), FrameKind::Kernel)
    }
}

impl ResolveNative for TableResolver {
    fn user(&mut self, _pid: u32, addr: u64) -> Vec<Frame> {
        self.user
            .get(&format!("{addr:#x}"))
            .cloned()
            .unwrap_or_else(|| vec![Frame::marker(format!("[unknown {addr:#x}]"))])
    }
    fn kernel(&mut self, addr: u64) -> Frame {
        let name = self
            .kernel
            .get(&format!("{addr:#x}"))
            .cloned()
            .unwrap_or_else(|| format!("[kernel {addr:#x}]"));
        Frame::new(name, FrameKind::Kernel)
    }
}

impl ResolveRuntime for TableResolver {
    fn python(&mut self, _pid: u32, code: u64, instr: u64) -> Frame {
        self.python
            .get(&format!("{code:#x}:{instr:#x}"))
            .cloned()
            .unwrap_or_else(|| Frame::marker(format!("[python {code:#x}+{instr}]")))
    }
    fn python_thread(&mut self, _pid: u32, tstate: u64) -> Option<(u32, String)> {
        self.python_threads.get(&format!("{tstate:#x}")).cloned()
    }
    fn js_layout(&mut self, pid: u32) -> Option<v8::FrameLayout> {
        self.js_layouts.get(&pid.to_string()).copied()
    }
    fn js(&mut self, pid: u32, slot: &JsSlot) -> Option<Frame> {
        self.js.get(&js_key(pid, slot)).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assemble::stall::StackTable;
    use crate::kernel::event::RawStack;

    /// JavaScript frames replace their native symbol (not a perf map's
    /// name), an unreadable one in JIT code is said, V8's collector gets
    /// `[gc]` above it.
    #[test]
    fn javascript_frames_and_gc_in_native_stacks() {
        let mut t = TableResolver::default();
        let native = |name: &str, module: &str| Frame {
            module: Some(module.into()),
            ..Frame::new(name, FrameKind::Native)
        };
        // user[] is innermost first; addresses after the first are looked up minus one.
        let names = [
            (0x10, native("v8::internal::Scavenger::Process", "node")),
            (
                0x1f,
                native("v8::internal::Heap::CollectGarbage(int)", "node"),
            ),
            (0x2f, native("Builtins_InterpreterEntryTrampoline", "node")),
            (0x3f, native("[anon]", "[anon]")),
            (0x4f, native("JS:*main /a.js:1:1", "[jit]")),
            (0x5f, native("uv_run", "node")),
        ];
        for (a, f) in &names {
            t.user.insert(format!("{a:#x}"), vec![f.clone()]);
        }
        let churn = Frame {
            file: Some("/srv/app.js".into()),
            line: Some(9),
            ..Frame::new("churn", FrameKind::Js)
        };
        t.js.insert("7:0x1001".into(), churn.clone());
        let mut stacks = StackTable::default();
        let id = stacks.intern(RawStack {
            user: vec![0x10, 0x20, 0x30, 0x40, 0x50, 0x60],
            js: [(2, 0x1001), (3, 0x2001), (4, 0x1001)]
                .map(|(frame, func)| JsSlot {
                    frame,
                    func,
                    ..JsSlot::default()
                })
                .to_vec(),
            ..RawStack::default()
        });
        let before = v8::unreadable_count();
        let got: Vec<String> = frames_of(&mut t, 7, &stacks, id)
            .iter()
            .map(Frame::label)
            .collect();
        assert_eq!(
            got,
            [
                "uv_run",
                "JS:*main /a.js:1:1",
                "[js: unreadable]",
                "churn (app.js:9)",
                "[gc]",
                "v8::internal::Heap::CollectGarbage(int)",
                "v8::internal::Scavenger::Process",
            ]
        );
        assert!(v8::unreadable_count() > before);
    }

    /// blazesym keeps every file it opened; ours are per process paths. The
    /// held set stays under its cap as files of ever new processes come, and
    /// forgetting processes drops theirs.
    #[test]
    fn files_held_by_the_symbolizer_are_bounded() {
        let dir = crate::os::scratch_dir("blaze-files");
        let exe = Path::new("/bin/true");
        let mut r = BlazeResolver::default();
        let resets = || {
            limits::counts()
                .into_iter()
                .find(|(n, _)| *n == "limit_symbol_cache_reset")
                .unwrap()
                .1
        };
        let before = resets();
        for pid in 0..(BLAZE_FILES_MAX + BLAZE_STALE_MAX + 4) as u32 {
            let p = dir.join(format!("true-{pid}"));
            fs::copy(exe, &p).unwrap();
            r.symbolize_file(1000 + pid, &p, 0x100);
            assert!(r.files_held() <= BLAZE_FILES_MAX);
        }
        assert!(resets() > before, "past the cap the symbolizer is rebuilt");
        let held = r.files_held();
        assert!(held > BLAZE_STALE_MAX + 1, "{held} files held");
        let pids: Vec<u32> = r.blaze_files.values().map(|&(p, _)| p).collect();
        let mid = resets();
        for pid in pids.iter().take(BLAZE_STALE_MAX + 1) {
            r.forget(*pid);
        }
        assert_eq!(r.files_held(), 0, "files of exited processes are let go");
        assert!(resets() > mid);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn maps_lookup() {
        let maps = Maps {
            entries: vec![
                Mapping {
                    start: 0x1000,
                    end: 0x2000,
                    perms: *b"r-xp",
                    offset: 0,
                    dev: (8, 1),
                    inode: 1,
                    path: "/a".into(),
                },
                Mapping {
                    start: 0x3000,
                    end: 0x4000,
                    perms: *b"r-xp",
                    offset: 0x1000,
                    dev: (8, 1),
                    inode: 2,
                    path: "/b".into(),
                },
            ],
            taken: std::time::Instant::now(),
        };
        assert_eq!(maps.find(0x1800).unwrap().path, "/a");
        assert!(maps.find(0x2800).is_none());
        assert_eq!(maps.find(0x3000).unwrap().path, "/b");
        assert!(maps.find(0x500).is_none());
    }

    #[test]
    fn perf_map_latest_entry_wins() {
        let pm = PerfMap {
            entries: vec![
                (0x1000, 0x100, 0, "old".into()),
                (0x1040, 0x10, 2, "small".into()),
                (0x1080, 0x100, 1, "mid".into()),
            ],
            max_size: 0x100,
            ..PerfMap::default()
        };
        assert_eq!(pm.find(0x1045), Some("small"));
        assert_eq!(pm.find(0x1090), Some("mid"));
        assert_eq!(pm.find(0x1010), Some("old"));
        assert_eq!(pm.find(0x1300), None);
    }

    #[test]
    fn perf_map_read_in_pieces_skips_long_lines() {
        let text = format!(
            "1000 10 a\n{}\n2000 20 b c\nnot hex\n3000 30 last\n4000 10 ta",
            "x".repeat(limits::PERF_MAP_MAX_LINE + 1)
        );
        for piece in [1, 7, 4096, text.len()] {
            let mut pm = PerfMap::default();
            for chunk in text.as_bytes().chunks(piece) {
                pm.feed(chunk);
            }
            pm.entries.sort_by_key(|e| (e.0, e.2));
            pm.max_size = 0x30;
            assert_eq!(pm.len(), 3, "piece {piece}");
            assert_eq!(pm.find(0x1005), Some("a"));
            assert_eq!(pm.find(0x2010), Some("b c"));
            assert_eq!(pm.find(0x3000), Some("last"));
            // The unterminated last line waits for its newline.
            assert_eq!(pm.find(0x4000), None);
            pm.feed(b"il\n");
            pm.entries.sort_by_key(|e| (e.0, e.2));
            assert_eq!(pm.find(0x4005), Some("tail"));
        }
    }

    #[test]
    fn syscall_names() {
        assert_eq!(syscall_name(0), "read");
        assert_eq!(syscall_name(230), "clock_nanosleep");
        assert_eq!(syscall_name(232), "epoll_wait");
    }

    #[test]
    fn own_process_symbolizes() {
        #[inline(never)]
        fn marker_fn_for_symbolize_test() -> u64 {
            marker_fn_for_symbolize_test as *const () as u64
        }
        let addr = marker_fn_for_symbolize_test();
        let mut r = BlazeResolver::default();
        let frames = r.user(std::process::id(), addr);
        assert!(
            frames
                .iter()
                .any(|f| f.name.contains("marker_fn_for_symbolize_test")),
            "{frames:?}"
        );
    }
}
