//! Node.js (V8) JavaScript frames from the running process, without flags.
//!
//! In: a Node process's pid, and per sampled stack each frame's frame
//! pointer (from the unwinder) and the copied stack bytes. Out: for each
//! frame that is a JavaScript frame, a [`Frame`] of kind `js`:
//! `parseBig (app.js:11)`, the function's name, its script and the line it
//! is defined on.
//!
//! How. V8 code keeps frame pointers, and a JavaScript frame (interpreted,
//! baseline, optimized) holds its `JSFunction` at a fixed offset from its
//! frame pointer, with a context (a tagged pointer) in the slot where other
//! frames keep a frame-type marker (a Smi). Every Node binary exports the
//! offsets and object layouts as postmortem metadata (`v8dbg_*` symbols,
//! in `node` or Debian's `libnode.so.N`), read here from the ELF file found
//! through `/proc/PID/root`. So:
//!
//! 1. at sample time (the engine, as it unwinds a stack event):
//!    [`js_slots`] takes, from the stack copy, the `JSFunction` pointer of
//!    every frame whose two slots look like a JavaScript frame's, with its
//!    `BytecodeArray` and bytecode-offset slots ([`JsSlot`]) — no read of
//!    the target, so it also runs on a replay. Where the unwinder stopped
//!    early and the kernel's frame-pointer stack stands, [`fp_chain`] gives
//!    its frames' frame pointers;
//! 2. promptly after (the engine, when it first sees the stack, ~20 ms
//!    later): [`JsResolver::warm`] follows `JSFunction` → `SharedFunctionInfo`
//!    → name (`ScopeInfo` or `String`) and `Script` → file name and line
//!    ends, each object's type checked through its map, every read bounded;
//!    answers are cached by `JSFunction` address and re-validated on each
//!    new stack (the function's map type and its `shared` pointer, the
//!    shared info's header words): a GC that moved or freed the object
//!    fails the check and the frame is resolved again or counted, never
//!    misnamed from a stale cache. A frame's `BytecodeArray` (old space,
//!    stays put) is remembered with the function read from that frame, and
//!    names the frames whose closure (young, made per request) moved out
//!    of reach before the read; one not seen before is read through the
//!    frame itself when it is still on the stack, running that bytecode;
//! 3. at symbolization: the frame's native symbol (the interpreter
//!    trampoline, anonymous JIT code) is replaced by the JavaScript frame,
//!    unless a perf map named it (`--perf-basic-prof` stays a source of
//!    names). A frame in JIT code or a V8 interpreter/baseline builtin that
//!    looked like a JavaScript frame but could not be read becomes
//!    `[js: unreadable]` and is counted (`js_frames_unreadable`).
//!
//! Inlined functions in optimized code show as their outer function.
//! Only the function's definition line is given (not the line executing:
//! V8 builds source position tables lazily; docs/architecture.md).

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc::{Receiver, TryRecvError, sync_channel},
    },
    time::{Duration, Instant},
};

mod express;
mod objects;
mod timers;

use crate::{
    kernel::event::JsSlot,
    model::{Frame, FrameKind, RuntimeProblem},
    os::{
        elf_symbols::ElfSymbols,
        maps::{self, Mapping, mapped_file},
        memory::{ProcessMemory, ReadMemory},
    },
};

/// Longest string read for a function or file name.
const MAX_NAME: u32 = 1024;
/// Longest script source read (UTF-16 units) to find line ends when V8
/// has none yet.
pub const MAX_SOURCE: u32 = 16 << 20;
/// Most line ends kept for one script.
const MAX_LINE_ENDS: u32 = 1 << 20;
/// Deepest ConsString / ThinString chain followed.
const MAX_STRING_DEPTH: u32 = 16;
/// Scripts whose line ends are cached, per process; past it the cache is
/// emptied.
const MAX_SCRIPTS: usize = 4096;
/// `ScopeInfo` words read (after its map) to find the name and position.
const SCOPE_SLOTS: usize = 24;
/// How often a process with no Node binary mapped (yet) is looked at again.
const RETRY: Duration = Duration::from_secs(1);
/// Tries after which a process is taken not to be Node.
const MAX_TRIES: u32 = 10;

static UNREADABLE: AtomicU64 = AtomicU64::new(0);
static RESOLVED: AtomicU64 = AtomicU64::new(0);
/// Objects found moved (a forwarding address followed), since start.
static FORWARDED: AtomicU64 = AtomicU64::new(0);
/// Frames whose function could not be read, named through their bytecode.
static BY_BYTECODE: AtomicU64 = AtomicU64::new(0);
/// Frames whose function had moved, named through the frame still on the
/// stack ([`JsResolver::live_function`]).
static LIVE: AtomicU64 = AtomicU64::new(0);
/// Bytecode addresses remembered for one function and found running
/// another (the first freed, the address reused): the answer replaced.
static BYTECODE_REUSED: AtomicU64 = AtomicU64::new(0);
/// Functions whose name (or the ScopeInfo holding it) could not be read
/// when asked: left unnamed then, and read again with a later stack.
static NAME_UNREAD: AtomicU64 = AtomicU64::new(0);

/// JavaScript-looking frames of JIT code or a V8 builtin that could not be
/// read (`drops.js_frames_unreadable`), since start.
pub fn unreadable_count() -> u64 {
    UNREADABLE.load(Ordering::Relaxed)
}

/// Functions resolved from memory, objects found moved (forwarding
/// addresses followed), frames named through their bytecode, frames read
/// through the live frame, names unreadable when asked, and bytecode
/// answers replaced (their address reused), since start (logged at the end
/// of a recording).
pub fn counts() -> [u64; 6] {
    [
        &RESOLVED,
        &FORWARDED,
        &BY_BYTECODE,
        &LIVE,
        &NAME_UNREAD,
        &BYTECODE_REUSED,
    ]
    .map(|c| c.load(Ordering::Relaxed))
}

pub fn count_unreadable() {
    UNREADABLE.fetch_add(1, Ordering::Relaxed);
}

/// The tier of V8 code a JavaScript frame ran in, by its native frame:
/// the interpreter (Ignition's trampolines, in the Node binary), or JIT
/// code (Sparkplug baseline, Maglev or Turbofan: anonymous memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Interpreter,
    Jit,
}

impl Tier {
    pub fn of(native: &[Frame]) -> Tier {
        if native
            .iter()
            .any(|f| f.kind == FrameKind::Native && f.name.starts_with("Builtins_Interpreter"))
        {
            Tier::Interpreter
        } else {
            Tier::Jit
        }
    }
}

/// JavaScript frames named and left unreadable, per tier, since start:
/// [interpreter named, JIT named, interpreter unreadable, JIT unreadable].
static BY_TIER: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Counts one JavaScript frame of `tier`, named or not.
pub fn count_frame(tier: Tier, named: bool) {
    let i = (tier == Tier::Jit) as usize + if named { 0 } else { 2 };
    BY_TIER[i].fetch_add(1, Ordering::Relaxed);
}

/// [`count_frame`]'s counts: ((interpreter named, unreadable), (JIT named,
/// unreadable)).
pub fn tier_counts() -> ((u64, u64), (u64, u64)) {
    let c = |i: usize| BY_TIER[i].load(Ordering::Relaxed);
    ((c(0), c(2)), (c(1), c(3)))
}

/// Where a frame keeps what identifies it, and the tag rules: all a stack
/// copy needs to find JavaScript frames (saved in `symbols.json` so a
/// replay finds them too).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FrameLayout {
    /// `v8dbg_off_fp_function` (-16 on x86-64).
    pub fp_function: i32,
    /// `v8dbg_off_fp_context_or_frame_type` (else `off_fp_context`): a
    /// tagged pointer in a JavaScript frame, a Smi marker in others.
    pub fp_context: i32,
    pub heap_tag_mask: u64,
    pub heap_tag: u64,
    /// `v8dbg_off_fp_bytecode_array` (-32 on x86-64 since V8 9.x): an
    /// interpreted or baseline frame's `BytecodeArray`, an old-space object
    /// that outlives the moves of a young closure. 0: not known (a
    /// recording made before it was read).
    #[serde(default)]
    pub fp_bytecode_array: i32,
    /// `v8dbg_off_fp_bytecode_offset`: an interpreted frame's bytecode
    /// offset (a Smi) as of its last call out. 0: not known.
    #[serde(default)]
    pub fp_bytecode_offset: i32,
    /// `v8dbg_off_fp_args` (16 on x86-64): the caller's stack pointer,
    /// where the receiver lies and the arguments follow it, first to last
    /// (V8 9.0 on). 0: not known.
    #[serde(default)]
    pub fp_args: i32,
}

impl FrameLayout {
    fn is_heap(&self, v: u64) -> bool {
        v & self.heap_tag_mask == self.heap_tag && v > 0x10000
    }
}

/// Frame pointers of a frame-pointer walk through a stack copy, as the
/// kernel's user stack walk makes it: `bp` for the sampled frame, then each
/// saved frame pointer in turn (`n` at most; 0 past the copy or where the
/// chain stops going up). Lines up with a stack the kernel walked by frame
/// pointers, for when the unwinder could not walk it.
pub fn fp_chain(bp: u64, sp: u64, stack: &[u8], n: usize) -> Vec<u64> {
    let read = |addr: u64| -> Option<u64> {
        let off = usize::try_from(addr.checked_sub(sp)?).ok()?;
        let b = stack.get(off..off.checked_add(8)?)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    };
    let mut out = Vec::with_capacity(n);
    let mut fp = bp;
    while out.len() < n {
        out.push(fp);
        match read(fp) {
            Some(next) if fp != 0 && next > fp => fp = next,
            _ => fp = 0,
        }
    }
    out
}

/// For each frame (innermost first) whose frame pointer is in the copy and
/// whose slots look like a JavaScript frame's: (frame index, tagged
/// `JSFunction`). A frame whose frame pointer equals its caller's (a
/// function in its prologue, before it set up its own) is left out: the
/// slots are the caller's.
pub fn js_slots(layout: &FrameLayout, fps: &[u64], sp: u64, stack: &[u8]) -> Vec<JsSlot> {
    let read = |addr: u64| -> Option<u64> {
        let off = usize::try_from(addr.checked_sub(sp)?).ok()?;
        let b = stack.get(off..off.checked_add(8)?)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    };
    let mut out = Vec::new();
    for (i, &fp) in fps.iter().enumerate() {
        if fp == 0 || fps.get(i + 1) == Some(&fp) {
            continue;
        }
        let (Some(ctx), Some(func)) = (
            read(fp.wrapping_add_signed(layout.fp_context as i64)),
            read(fp.wrapping_add_signed(layout.fp_function as i64)),
        ) else {
            continue;
        };
        if layout.is_heap(ctx) && layout.is_heap(func) {
            let slot = |off: i32| {
                (off != 0)
                    .then(|| read(fp.wrapping_add_signed(off as i64)))
                    .flatten()
                    .unwrap_or(0)
            };
            let bytecode = slot(layout.fp_bytecode_array);
            let passed = |i: i32| {
                if layout.fp_args > 0 {
                    slot(layout.fp_args + 8 * i)
                } else {
                    0
                }
            };
            out.push(JsSlot {
                frame: i as u32,
                func,
                bytecode: if layout.is_heap(bytecode) {
                    bytecode
                } else {
                    0
                },
                offset: slot(layout.fp_bytecode_offset),
                fp,
                this: passed(0),
                arg0: passed(1),
            });
        }
    }
    out
}

/// V8's postmortem metadata: the offsets and type numbers the walk uses.
#[derive(Clone, Debug)]
pub struct V8Meta {
    pub layout: FrameLayout,
    pub version: (u32, u32, u32),
    /// The file it was read from, as the target maps it.
    pub path: String,
    map: u64,
    map_instance_type: u64,
    jsf_shared: u64,
    sfi_name: u64,
    sfi_script: u64,
    script_name: u64,
    script_source: u64,
    script_line_ends: u64,
    string_length: u64,
    seq_one_byte_chars: u64,
    seq_two_byte_chars: u64,
    cons_first: u64,
    cons_second: u64,
    thin_actual: u64,
    fixed_length: u64,
    fixed_data: u64,
    t_jsf_first: u16,
    t_jsf_last: u16,
    t_sfi: u16,
    t_scope_info: u16,
    t_script: u16,
    t_fixed_array: u16,
    /// `BYTECODE_ARRAY_TYPE`; 0: not exported (frames are then named by
    /// their `JSFunction` only).
    t_bytecode_array: u16,
    first_nonstring: u16,
    repr_mask: u16,
    seq_tag: u16,
    cons_tag: u16,
    thin_tag: u16,
    enc_mask: u16,
    one_byte_tag: u16,
    scope_first_vars: u64,
    scope_ncontextlocals: u64,
    /// Where objects keep their properties (a request's route); Err: why
    /// this binary's metadata does not say (frames are read all the same).
    objects: Result<objects::ObjectMeta, String>,
    /// What Node's timers are read with ([`timers`]); Err: why this
    /// binary's metadata does not say.
    timers: Result<timers::TimerMeta, String>,
    /// libuv's default loop (`default_loop_struct`, in a binary that
    /// links libuv in) and Node's timer callback at their link-time
    /// addresses (None: not in the binary's symbols), and the binary's
    /// PT_LOAD segments, for [`discover`] to place them.
    default_loop_link: Option<u64>,
    run_timers_link: Option<u64>,
    load_segments: Vec<(u64, u64)>,
    /// The same at their addresses in the target, once [`discover`] has
    /// placed them (the loop found in a shared libuv when the binary has
    /// none); Err: why not.
    pub uv: Result<UvSymbols, String>,
}

/// libuv's default loop (the loop of Node's main thread) and
/// `node::Environment::RunTimers` (the callback of the one libuv timer
/// Node's JavaScript timers share), in the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UvSymbols {
    pub default_loop: LoopAt,
    pub run_timers: u64,
}

/// Where libuv's default loop is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopAt {
    /// `default_loop_struct`, linked into Node's binary (nodejs.org's
    /// builds).
    Struct(u64),
    /// The address of `default_loop_ptr`, the pointer a shared libuv sets
    /// when the loop is first asked for (Debian's `libuv.so.1`, whose
    /// static symbols are stripped): found in `uv_default_loop`'s first
    /// instruction ([`loop_pointer_of`]).
    Pointer(u64),
}

const UV_DEFAULT_LOOP: &str = "default_loop_struct";
const NODE_RUN_TIMERS: &str = "_ZN4node11Environment9RunTimersEP10uv_timer_s";

/// Why a binary's metadata cannot be used.
#[derive(Debug)]
pub struct MetaError(pub String);

/// What discovery reads of an ELF file's symbols.
struct FileSymbols {
    /// The `int` held by each defined symbol whose name starts with one of
    /// the prefixes asked for (the first of a name, from `.dynsym` before
    /// `.symtab`).
    values: HashMap<String, i64>,
    /// The link-time address of each symbol named exactly as asked.
    addrs: HashMap<String, u64>,
    /// The first 16 bytes of each of those the file holds (a function's
    /// first instructions).
    code: HashMap<String, [u8; 16]>,
    /// (p_vaddr, p_offset) of its PT_LOAD segments.
    load_segments: Vec<(u64, u64)>,
}

/// The symbols of the ELF file at `path` that start with one of `prefixes`
/// (their values) or are named one of `exact` (their addresses).
fn file_symbols(path: &Path, prefixes: &[&str], exact: &[&str]) -> Result<FileSymbols, String> {
    let file = crate::os::limits::open_elf(path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    let elf = ElfSymbols::open(&file).map_err(|e| format!("{}: {e}", path.display()))?;
    if crate::os::limits::symbol_tables_too_large(elf.tables_size()) {
        return Err(format!(
            "{}: symbol tables over the size cap",
            path.display()
        ));
    }
    let needles: Vec<&str> = prefixes.iter().chain(exact).copied().collect();
    let found = elf
        .find(&needles, &|n| {
            prefixes.iter().any(|p| n.starts_with(p)) || exact.contains(&n)
        })
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(FileSymbols {
        values: found
            .iter()
            .filter(|sym| prefixes.iter().any(|p| sym.name.starts_with(p)))
            .filter_map(|sym| Some((sym.name.clone(), i64::from(elf.read_i32(sym)?))))
            .collect(),
        addrs: found
            .iter()
            .filter(|sym| exact.contains(&sym.name.as_str()) && sym.value != 0)
            .map(|sym| (sym.name.clone(), sym.value))
            .collect(),
        code: found
            .iter()
            .filter(|sym| exact.contains(&sym.name.as_str()))
            .filter_map(|sym| {
                use std::os::unix::fs::FileExt;
                let mut b = [0u8; 16];
                file.read_exact_at(&mut b, elf.file_offset(sym, 16)?).ok()?;
                Some((sym.name.clone(), b))
            })
            .collect(),
        load_segments: elf.load_segments().to_vec(),
    })
}

/// The `v8dbg_*` values of a binary, asked for by name; the first name of
/// each value missing is kept for the error.
pub(crate) struct Values<'a> {
    vals: &'a HashMap<String, i64>,
    missing: Vec<String>,
}

impl<'a> Values<'a> {
    pub(crate) fn new(vals: &'a HashMap<String, i64>) -> Self {
        Values {
            vals,
            missing: Vec::new(),
        }
    }

    /// The value of the first of `names` (spellings of one value across V8
    /// versions, without `v8dbg_`) the binary has; 0 when none is.
    pub(crate) fn get(&mut self, names: &[&str]) -> i64 {
        for n in names {
            if let Some(v) = self.vals.get(&format!("v8dbg_{n}")) {
                return *v;
            }
        }
        self.missing.push(names[0].to_string());
        0
    }

    /// Err: the values asked for and missing, `v8dbg_a, v8dbg_b`.
    pub(crate) fn done(self) -> Result<(), String> {
        if self.missing.is_empty() {
            Ok(())
        } else {
            Err(format!("v8dbg_{}", self.missing.join(", v8dbg_")))
        }
    }
}

impl V8Meta {
    /// Reads the metadata from `file` (opened as `mapped_as` in the
    /// target). `Ok(None)`: the file has no V8 metadata at all.
    pub fn read(file: &Path, mapped_as: &str) -> Result<Option<V8Meta>, MetaError> {
        let syms = file_symbols(
            file,
            &["v8dbg_", "_ZN2v88internal7Version6"],
            &[UV_DEFAULT_LOOP, NODE_RUN_TIMERS],
        )
        .map_err(MetaError)?;
        let vals = syms.values;
        if !vals.keys().any(|k| k.starts_with("v8dbg_")) {
            return Ok(None);
        }
        let mut values = Values::new(&vals);
        let mut get = |names: &[&str]| values.get(names);
        let fp_function = get(&["off_fp_function"]) as i32;
        let fp_context = get(&["off_fp_context_or_frame_type", "off_fp_context"]) as i32;
        let heap_tag_mask = get(&["HeapObjectTagMask"]) as u64;
        let heap_tag = get(&["HeapObjectTag"]) as u64;
        let map = get(&["class_HeapObject__map__Map"]) as u64;
        let map_instance_type = get(&["class_Map__instance_type__uint16_t"]) as u64;
        let jsf_shared = get(&["class_JSFunction__shared__SharedFunctionInfo"]) as u64;
        let sfi_name = get(&[
            "class_SharedFunctionInfo__name_or_scope_info__Object",
            "class_SharedFunctionInfo__name_or_scope_info__Tagged_NameOrScopeInfoT_",
            "class_SharedFunctionInfo__name_or_scope_info__Tagged_Object_",
        ]) as u64;
        let sfi_script = get(&[
            "class_SharedFunctionInfo__script_or_debug_info__HeapObject",
            "class_SharedFunctionInfo__script__Tagged_HeapObject_",
            "class_SharedFunctionInfo__raw_script__Tagged_Object_",
        ]) as u64;
        let script_name = get(&["class_Script__name__Object"]) as u64;
        let script_source = get(&["class_Script__source__Object"]) as u64;
        let script_line_ends = get(&["class_Script__line_ends__Object"]) as u64;
        let string_length = get(&["class_String__length__int32_t"]) as u64;
        let seq_one_byte_chars = get(&["class_SeqOneByteString__chars__char"]) as u64;
        let seq_two_byte_chars = get(&["class_SeqTwoByteString__chars__char"]) as u64;
        let cons_first = get(&["class_ConsString__first__String"]) as u64;
        let cons_second = get(&["class_ConsString__second__String"]) as u64;
        let thin_actual = get(&["class_ThinString__actual__String"]) as u64;
        let fixed_length = get(&["class_FixedArrayBase__length__SMI"]) as u64;
        let fixed_data = get(&["class_FixedArray__data__uintptr_t"]) as u64;
        let t_jsf = get(&["type_JSFunction__JS_FUNCTION_TYPE"]) as u16;
        let t_sfi = get(&["type_SharedFunctionInfo__SHARED_FUNCTION_INFO_TYPE"]) as u16;
        let t_scope_info = get(&["type_ScopeInfo__SCOPE_INFO_TYPE"]) as u16;
        let t_script = get(&["type_Script__SCRIPT_TYPE"]) as u16;
        let t_fixed_array = get(&["type_FixedArray__FIXED_ARRAY_TYPE"]) as u16;
        let first_nonstring = get(&["FirstNonstringType"]) as u16;
        let repr_mask = get(&["StringRepresentationMask"]) as u16;
        let seq_tag = get(&["SeqStringTag"]) as u16;
        let cons_tag = get(&["ConsStringTag"]) as u16;
        let thin_tag = get(&["ThinStringTag"]) as u16;
        let enc_mask = get(&["StringEncodingMask"]) as u16;
        let one_byte_tag = get(&["OneByteStringTag"]) as u16;
        let opt = |n: &str| vals.get(&format!("v8dbg_{n}")).copied();
        let t_bytecode_array = opt("type_BytecodeArray__BYTECODE_ARRAY_TYPE").unwrap_or(0) as u16;
        let (fp_bytecode_array, fp_bytecode_offset) =
            match (opt("off_fp_bytecode_array"), opt("off_fp_bytecode_offset")) {
                (Some(a), Some(o)) if a < 0 && o < 0 && t_bytecode_array != 0 => {
                    (a as i32, o as i32)
                }
                _ => (0, 0),
            };
        let fp_args = opt("off_fp_args").filter(|&a| a > 0).unwrap_or(0) as i32;
        let scope_first_vars = get(&["scopeinfo_idx_first_vars"]) as u64;
        let scope_ncontextlocals = get(&["scopeinfo_idx_ncontextlocals"]) as u64;
        if let Err(missing) = values.done() {
            return Err(MetaError(format!(
                "{mapped_as} lacks V8 postmortem metadata stallprof needs: {missing}"
            )));
        }
        let ver = |n: &str| vals.get(&format!("_ZN2v88internal7Version6{n}_E")).copied();
        let version = match (ver("major"), ver("minor"), ver("build")) {
            (Some(a), Some(b), Some(c)) => (a as u32, b as u32, c as u32),
            _ => {
                return Err(MetaError(format!(
                    "{mapped_as}: V8's version (v8::internal::Version) is not in its symbols"
                )));
            }
        };
        // Since V8 9.6 a range of instance types are JSFunctions (class
        // constructors and the like); newer V8 exports the range.
        let (t_jsf_first, t_jsf_last) = match (
            vals.get("v8dbg_FirstJSFunctionType"),
            vals.get("v8dbg_LastJSFunctionType"),
        ) {
            (Some(&a), Some(&b)) => (a as u16, b as u16),
            _ => (t_jsf, t_jsf + 14),
        };
        if version < (9, 6, 0) || heap_tag_mask == 0 || fp_function >= 0 || fp_context >= 0 {
            return Err(MetaError(format!(
                "{mapped_as}: V8 {}.{}.{} is older than stallprof reads (9.6, Node 18+) or its frame layout is unexpected",
                version.0, version.1, version.2
            )));
        }
        Ok(Some(V8Meta {
            layout: FrameLayout {
                fp_function,
                fp_context,
                heap_tag_mask,
                heap_tag,
                fp_bytecode_array,
                fp_bytecode_offset,
                fp_args,
            },
            version,
            path: mapped_as.to_string(),
            map,
            map_instance_type,
            jsf_shared,
            sfi_name,
            sfi_script,
            script_name,
            script_source,
            script_line_ends,
            string_length,
            seq_one_byte_chars,
            seq_two_byte_chars,
            cons_first,
            cons_second,
            thin_actual,
            fixed_length,
            fixed_data,
            t_jsf_first,
            t_jsf_last,
            t_sfi,
            t_scope_info,
            t_script,
            t_fixed_array,
            t_bytecode_array,
            first_nonstring,
            repr_mask,
            seq_tag,
            cons_tag,
            thin_tag,
            enc_mask,
            one_byte_tag,
            scope_first_vars,
            scope_ncontextlocals,
            objects: objects::ObjectMeta::read(&vals),
            timers: timers::TimerMeta::read(&vals),
            default_loop_link: syms.addrs.get(UV_DEFAULT_LOOP).copied(),
            run_timers_link: syms.addrs.get(NODE_RUN_TIMERS).copied(),
            load_segments: syms.load_segments,
            uv: Err("not looked for".into()),
        }))
    }
}

/// A mapped file that may carry V8: `node`, `nodejs`, `libnode.so.N`.
fn may_be_v8(path: &str) -> bool {
    let base = path.rsplit('/').next().unwrap_or(path);
    base == "node" || base == "nodejs" || base.starts_with("libnode.so")
}

/// Finds the V8 metadata of process `pid`. `Ok(None)`: no Node binary is
/// mapped.
pub fn discover(pid: u32) -> Result<Option<V8Meta>, MetaError> {
    let maps = match maps::read(pid) {
        Ok(m) => m,
        // Gone (an upkeep that raced the target's exit): nothing to read,
        // and nothing to report as a runtime problem.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(MetaError(format!(
                "reading {}: {e}",
                maps::path(pid).display()
            )));
        }
    };
    let mut seen: Vec<&Mapping> = Vec::new();
    for m in maps.iter().filter(|m| m.is_file()) {
        if !may_be_v8(&m.path) || seen.iter().any(|s| s.inode == m.inode && s.dev == m.dev) {
            continue;
        }
        seen.push(m);
        let Some(file) = mapped_file(pid, m) else {
            return Err(MetaError(format!(
                "{} is mapped but cannot be opened through /proc/{pid}/root",
                m.path
            )));
        };
        if let Some(mut meta) = V8Meta::read(&file, &m.path)? {
            meta.uv = place_uv(pid, &maps, m, &meta);
            return Ok(Some(meta));
        }
    }
    Ok(None)
}

/// The mappings of the file `m` maps.
fn mappings_of<'a>(maps: &'a [Mapping], m: &Mapping) -> Vec<&'a Mapping> {
    maps.iter()
        .filter(|x| x.inode == m.inode && x.dev == m.dev)
        .collect()
}

/// libuv's default loop and `RunTimers` in process `pid`, whose V8 binary
/// (`meta` read from it) maps as `node`: the loop from the binary's own
/// symbols, else from a shared `libuv.so.N` it maps. Err: why not.
fn place_uv(
    pid: u32,
    maps: &[Mapping],
    node: &Mapping,
    meta: &V8Meta,
) -> Result<UvSymbols, String> {
    let bias = maps::load_bias(&mappings_of(maps, node), &meta.load_segments)
        .ok_or_else(|| format!("{}: no mapping of its first PT_LOAD segment", node.path))?;
    let run_timers = meta
        .run_timers_link
        .ok_or_else(|| format!("{} has no symbol node::Environment::RunTimers", node.path))?
        .wrapping_add(bias);
    let default_loop = match meta.default_loop_link {
        Some(l) => LoopAt::Struct(l.wrapping_add(bias)),
        None => {
            let uv = maps
                .iter()
                .find(|m| {
                    m.is_file()
                        && m.path
                            .rsplit('/')
                            .next()
                            .is_some_and(|b| b.starts_with("libuv.so"))
                })
                .ok_or_else(|| {
                    format!(
                        "{} has no default_loop_struct symbol and no shared libuv is mapped",
                        node.path
                    )
                })?;
            let file = mapped_file(pid, uv)
                .ok_or_else(|| format!("{} cannot be opened as mapped", uv.path))?;
            let syms = file_symbols(&file, &[], &["uv_default_loop"])?;
            let func = syms
                .addrs
                .get("uv_default_loop")
                .copied()
                .ok_or_else(|| format!("{} has no uv_default_loop", uv.path))?;
            let ptr = syms
                .code
                .get("uv_default_loop")
                .and_then(|code| loop_pointer_of(func, code))
                .ok_or_else(|| {
                    format!(
                        "{}: uv_default_loop does not begin with the load of its loop pointer",
                        uv.path
                    )
                })?;
            let bias = maps::load_bias(&mappings_of(maps, uv), &syms.load_segments)
                .ok_or_else(|| format!("{}: no mapping of its first PT_LOAD segment", uv.path))?;
            LoopAt::Pointer(ptr.wrapping_add(bias))
        }
    };
    Ok(UvSymbols {
        default_loop,
        run_timers,
    })
}

/// `default_loop_ptr`'s link-time address, from `uv_default_loop`'s first
/// instruction (at link-time address `func`): libuv's x86-64 build
/// begins it (after an `endbr64`) with `mov reg, [rip + disp32]`, the load
/// of that pointer. None: other code (checked again at each read: the
/// loop found must hold `RunTimers`' timer, which names it).
fn loop_pointer_of(func: u64, code: &[u8; 16]) -> Option<u64> {
    let start = if code[..4] == [0xf3, 0x0f, 0x1e, 0xfa] {
        4
    } else {
        0
    };
    let i = &code[start..];
    // REX.W (any register), MOV r64, r/m64, ModRM mod 00 r/m 101: RIP + disp32.
    if i[0] & 0xf8 != 0x48 || i[1] != 0x8b || i[2] & 0xc7 != 0x05 {
        return None;
    }
    let disp = i32::from_le_bytes(i[3..7].try_into().unwrap());
    let next = func + start as u64 + 7;
    Some(next.wrapping_add(disp as i64 as u64))
}

/// A script's file name and line ends (positions of its line breaks).
#[derive(Clone, Debug)]
struct Script {
    name: Option<String>,
    line_ends: Vec<u32>,
}

/// What a `SharedFunctionInfo` resolved to, with the header words it was
/// read from (a changed word means another object is there now).
#[derive(Clone, Debug)]
struct SfiEntry {
    header: [u64; 2],
    frame: Frame,
}

/// A resolved `JSFunction`: its map and `shared` words as read then (the
/// same two words at the same address later: still that function), and
/// the frame.
#[derive(Clone, Debug)]
struct FuncEntry {
    map: u64,
    shared: u64,
    frame: Frame,
}

/// A `BytecodeArray` seen in a frame whose function was read: its map and
/// length words then (the same words later: still that array), and the
/// function's frame.
#[derive(Clone, Debug)]
struct CodeEntry {
    header: [u64; 2],
    frame: Frame,
}

/// Bytecode arrays remembered per process; past it the table is emptied.
const MAX_BYTECODES: usize = 1 << 16;

/// Reads JavaScript frames of one process.
pub struct JsResolver {
    pub meta: V8Meta,
    mem: ProcessMemory,
    /// JSFunction address -> what it resolved to.
    funcs: HashMap<u64, FuncEntry>,
    sfis: HashMap<u64, SfiEntry>,
    scripts: HashMap<u64, Script>,
    /// BytecodeArray address -> its function. An interpreted frame's
    /// closure is often young (a callback made per request) and moved by a
    /// scavenge or two before the stack is read, ~20 ms later; its bytecode
    /// is in old space and stays put, so the frame is named through it.
    bytecodes: HashMap<u64, CodeEntry>,
    /// The (function, bytecode) pairs [`warm`](Self::warm) checked in the
    /// drain numbered `warmed_in`: each is read once a drain, not once a
    /// stack (a busy start's stacks share most of their frames, and a check
    /// is ~5 reads of the target; a drain of them took 0.5 ms a stack).
    warmed: HashSet<(u64, u64)>,
    warmed_in: u64,
    /// What reads of the process's timers keep ([`timers`]).
    timers: timers::TimerState,
}

fn untag(meta: &V8Meta, v: u64) -> Option<u64> {
    meta.layout
        .is_heap(v)
        .then_some(v & !meta.layout.heap_tag_mask)
}

/// Read `buf` at `addr`. When the whole range cannot be read (it runs past
/// the object into an unmapped page: a small object at the end of a heap
/// page with no mapping after it; a PROT_NONE reservation still reads, as
/// zeros, through /proc/PID/mem), what lies in `addr`'s own 4 KiB page is
/// read and the rest zeroed (Smi 0: no pointer, no position). `None`: not
/// even that.
fn read_in_page(mem: &impl ReadMemory, addr: u64, buf: &mut [u8]) -> Option<()> {
    if mem.read_into(addr, buf).is_ok() {
        return Some(());
    }
    let in_page = (4096 - addr % 4096) as usize;
    if in_page >= buf.len() {
        return None;
    }
    let (head, tail) = buf.split_at_mut(in_page);
    mem.read_into(addr, head).ok()?;
    tail.fill(0);
    Some(())
}

fn smi(v: u64) -> Option<i64> {
    (v & 1 == 0).then_some((v as i64) >> 32)
}

impl JsResolver {
    pub fn new(pid: u32, meta: V8Meta) -> Result<Self, String> {
        let mem = ProcessMemory::open(pid).map_err(|e| e.to_string())?;
        Ok(JsResolver {
            meta,
            mem,
            funcs: HashMap::new(),
            sfis: HashMap::new(),
            scripts: HashMap::new(),
            bytecodes: HashMap::new(),
            warmed: HashSet::new(),
            warmed_in: 0,
            timers: timers::TimerState::default(),
        })
    }

    fn u64_at(&self, addr: u64) -> Option<u64> {
        self.mem.read_u64(addr).ok()
    }

    /// The instance type of the object at tagged `v`, and its address.
    ///
    /// An object the scavenger moved leaves its new address in its old
    /// map word (a forwarding address: untagged, so the word is not a heap
    /// pointer) until that semispace is reused; it is followed (twice at
    /// most), and the object found there is checked like any other.
    fn typed(&self, v: u64) -> Option<(u64, u16)> {
        let m = &self.meta;
        let mut addr = untag(m, v)?;
        let mut word = self.u64_at(addr + m.map)?;
        for _ in 0..2 {
            if word & m.layout.heap_tag_mask != 0 || word < 0x10000 || word % 8 != 0 {
                break;
            }
            FORWARDED.fetch_add(1, Ordering::Relaxed);
            addr = word;
            word = self.u64_at(addr + m.map)?;
        }
        let map = untag(m, word)?;
        let mut b = [0u8; 2];
        self.mem.read_into(map + m.map_instance_type, &mut b).ok()?;
        Some((addr, u16::from_le_bytes(b)))
    }

    /// A V8 string's text, at most `cap` UTF-16 units (sequential strings,
    /// and cons and thin strings of them; an external string gives `None`:
    /// its text is outside V8's heap).
    fn string(&self, v: u64, cap: u32, depth: u32) -> Option<String> {
        Some(String::from_utf16_lossy(&self.units(v, cap, depth)?))
    }

    /// A string's UTF-16 code units (V8's source positions count these).
    fn units(&self, v: u64, cap: u32, depth: u32) -> Option<Vec<u16>> {
        let mut out = Vec::new();
        self.string_into(v, cap, depth, &mut out)?;
        Some(out)
    }

    fn string_into(&self, v: u64, cap: u32, depth: u32, out: &mut Vec<u16>) -> Option<()> {
        let m = &self.meta;
        if depth == 0 {
            return None;
        }
        let (addr, t) = self.typed(v)?;
        if t >= m.first_nonstring {
            return None;
        }
        let repr = t & m.repr_mask;
        if repr == m.seq_tag {
            let len = self.mem.read_u32(addr + m.string_length).ok()? as usize;
            if len + out.len() > cap as usize {
                return None;
            }
            if t & m.enc_mask == m.one_byte_tag {
                let b = self.mem.read_bytes(addr + m.seq_one_byte_chars, len).ok()?;
                out.extend(b.iter().map(|&c| c as u16));
            } else {
                let b = self
                    .mem
                    .read_bytes(addr + m.seq_two_byte_chars, len * 2)
                    .ok()?;
                out.extend(b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])));
            }
            Some(())
        } else if repr == m.cons_tag {
            let first = self.u64_at(addr + m.cons_first)?;
            let second = self.u64_at(addr + m.cons_second)?;
            self.string_into(first, cap, depth - 1, out)?;
            self.string_into(second, cap, depth - 1, out)
        } else if repr == m.thin_tag {
            let actual = self.u64_at(addr + m.thin_actual)?;
            self.string_into(actual, cap, depth - 1, out)
        } else {
            None
        }
    }

    /// Name and start position from a `ScopeInfo`: the first string after
    /// the context locals' names and infos is the function's name; the
    /// start/end positions follow it as two Smis (V8 before 12.8) or sit
    /// at fixed slots 3 and 4 (12.8 on).
    /// `None`: its words could not be read.
    fn scope_info(&self, addr: u64) -> Option<(Option<String>, Option<i64>)> {
        let m = &self.meta;
        let mut buf = [0u8; SCOPE_SLOTS * 8];
        read_in_page(&self.mem, addr + 8, &mut buf)?;
        let slot =
            |i: usize| -> u64 { u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap()) };
        let new_layout = m.version >= (12, 8, 44);
        let mut start = None;
        if new_layout
            && let (Some(a), Some(b)) = (smi(slot(3)), smi(slot(4)))
            && a >= 0
            && a <= b
        {
            start = Some(a);
        }
        let locals = smi(slot(m.scope_ncontextlocals as usize))
            .unwrap_or(0)
            .clamp(0, 1 << 16) as usize;
        let mut name = None;
        let mut prev = 1u64; // not a Smi
        let mut i = m.scope_first_vars as usize + 2 * locals;
        while i < SCOPE_SLOTS {
            let cur = slot(i);
            if name.is_none() && untag(m, cur).is_some() {
                name = self
                    .string(cur, MAX_NAME, MAX_STRING_DEPTH)
                    .filter(|s| !s.is_empty());
            }
            if new_layout && name.is_some() {
                break;
            }
            if !new_layout
                && let (Some(a), Some(b)) = (smi(prev), smi(cur))
                && a >= 0
                && a < b
            {
                start = Some(a);
                break;
            }
            prev = cur;
            i += 1;
        }
        Some((name, start))
    }

    fn script(&mut self, v: u64) -> Option<Script> {
        let m = self.meta.clone();
        let (addr, t) = self.typed(v)?;
        if t != m.t_script {
            return None;
        }
        if let Some(s) = self.scripts.get(&addr) {
            return Some(s.clone());
        }
        let name = self
            .u64_at(addr + m.script_name)
            .and_then(|n| self.string(n, MAX_NAME, MAX_STRING_DEPTH));
        let mut line_ends = Vec::new();
        // V8's own line ends, when something (a stack trace) made it compute them.
        if let Some(le) = self.u64_at(addr + m.script_line_ends)
            && let Some((le_addr, lt)) = self.typed(le)
            && lt == m.t_fixed_array
            && let Some(n) = self.u64_at(le_addr + m.fixed_length).and_then(smi)
            && n > 0
            && n <= MAX_LINE_ENDS as i64
            && let Ok(b) = self.mem.read_bytes(le_addr + m.fixed_data, n as usize * 8)
        {
            line_ends = b
                .chunks_exact(8)
                .filter_map(|c| smi(u64::from_le_bytes(c.try_into().unwrap())))
                .map(|x| x as u32)
                .collect();
        }
        if line_ends.is_empty()
            && let Some(src) = self.u64_at(addr + m.script_source)
            && let Some(text) = self.units(src, MAX_SOURCE, MAX_STRING_DEPTH)
        {
            line_ends = text
                .iter()
                .enumerate()
                .filter(|(_, c)| **c == u16::from(b'\n'))
                .map(|(i, _)| i as u32)
                .take(MAX_LINE_ENDS as usize)
                .collect();
        }
        let s = Script { name, line_ends };
        if self.scripts.len() >= MAX_SCRIPTS {
            self.scripts.clear();
        }
        self.scripts.insert(addr, s.clone());
        Some(s)
    }

    /// Resolve a `SharedFunctionInfo` (its address) to a frame.
    fn sfi(&mut self, addr: u64) -> Option<Frame> {
        let m = self.meta.clone();
        let header = [
            self.u64_at(addr + m.sfi_name)?,
            self.u64_at(addr + m.sfi_script)?,
        ];
        if let Some(e) = self.sfis.get(&addr)
            && e.header == header
        {
            return Some(e.frame.clone());
        }
        let (mut name, mut start) = (None, None);
        // The name (a String), or the ScopeInfo that holds it and the
        // position, once compiled. One that cannot be read now is no
        // answer, not "(anonymous)": nothing is cached, the frame is left
        // unnamed for now (counted, asked again, see `warm`) and the next
        // stack reads it again. (A Smi there is a function with no name.)
        if untag(&m, header[0]).is_some() {
            let unread = || {
                NAME_UNREAD.fetch_add(1, Ordering::Relaxed);
                log::debug!(
                    "js shared info {addr:#x}: its name {:#x} unreadable",
                    header[0]
                );
            };
            let Some((nos, t)) = self.typed(header[0]) else {
                unread();
                return None;
            };
            if t == m.t_scope_info {
                let Some(found) = self.scope_info(nos) else {
                    unread();
                    return None;
                };
                (name, start) = found;
            } else if t < m.first_nonstring {
                let Some(n) = self.string(header[0], MAX_NAME, MAX_STRING_DEPTH) else {
                    unread();
                    return None;
                };
                name = Some(n);
            }
        }
        let script = self.script(header[1]);
        let line = match (&script, start) {
            (Some(s), Some(pos)) if !s.line_ends.is_empty() => {
                let i = s.line_ends.partition_point(|&e| (e as i64) < pos);
                Some(i as u32 + 1)
            }
            _ => None,
        };
        let name = name
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "(anonymous)".into());
        let frame = Frame {
            file: script
                .and_then(|s| s.name)
                .filter(|n| !n.is_empty())
                .map(Into::into),
            line,
            module: None,
            ..Frame::new(name, FrameKind::Js)
        };
        self.sfis.insert(
            addr,
            SfiEntry {
                header,
                frame: frame.clone(),
            },
        );
        Some(frame)
    }

    /// Resolve a tagged `JSFunction` now. `None`: not (or no longer) a
    /// function.
    pub fn resolve(&mut self, func: u64) -> Option<Frame> {
        let m = self.meta.clone();
        let Some((addr, t)) = self.typed(func) else {
            log::debug!("js {func:#x}: no object there");
            return None;
        };
        if t < m.t_jsf_first || t > m.t_jsf_last {
            log::debug!("js {func:#x}: instance type {t:#x}, not a JSFunction");
            return None;
        }
        let map = self.u64_at(addr + m.map)?;
        let shared = self.u64_at(addr + m.jsf_shared)?;
        let (sfi, st) = self.typed(shared)?;
        if st != m.t_sfi {
            log::debug!(
                "js {func:#x}: shared {shared:#x} has type {st:#x}, not a SharedFunctionInfo"
            );
            return None;
        }
        let Some(frame) = self.sfi(sfi) else {
            log::debug!("js {func:#x}: shared info {sfi:#x} unreadable");
            return None;
        };
        self.funcs.insert(
            func,
            FuncEntry {
                map,
                shared,
                frame: frame.clone(),
            },
        );
        RESOLVED.fetch_add(1, Ordering::Relaxed);
        Some(frame)
    }

    /// The latest answer for a frame (from [`warm`](Self::warm)): through
    /// its bytecode where it has some that was read, else its function.
    pub fn cached(&self, slot: &JsSlot) -> Option<Frame> {
        if slot.bytecode != 0
            && let Some(e) = self.bytecodes.get(&slot.bytecode)
        {
            return Some(e.frame.clone());
        }
        self.funcs.get(&slot.func).map(|e| e.frame.clone())
    }

    /// The map and length words of the `BytecodeArray` at tagged `v`, if
    /// it is one.
    fn bytecode_header(&self, v: u64) -> Option<[u64; 2]> {
        let m = &self.meta;
        if m.t_bytecode_array == 0 {
            return None;
        }
        let (addr, t) = self.typed(v)?;
        if t != m.t_bytecode_array || addr != untag(m, v)? {
            return None;
        }
        Some([
            self.u64_at(addr + m.map)?,
            self.u64_at(addr + m.fixed_length)?,
        ])
    }

    /// The function of a frame still on the target's stack whose closure
    /// moved since the sample (the first request's per-request callbacks,
    /// before any was read): the frame's slots now, when they still hold
    /// the same `BytecodeArray` — so the function there now runs that
    /// bytecode: the same `SharedFunctionInfo`, the same name — and another
    /// function pointer (the moved closure, or another closure of it).
    fn live_function(&self, slot: &JsSlot) -> Option<u64> {
        let l = &self.meta.layout;
        if slot.bytecode == 0 || slot.fp == 0 || l.fp_bytecode_array == 0 {
            return None;
        }
        self.bytecode_header(slot.bytecode)?;
        let bytecode = self.u64_at(slot.fp.wrapping_add_signed(l.fp_bytecode_array as i64))?;
        let func = self.u64_at(slot.fp.wrapping_add_signed(l.fp_function as i64))?;
        (bytecode == slot.bytecode && func != slot.func && l.is_heap(func)).then_some(func)
    }

    /// Is the bytecode remembered for tagged `v` still there?
    fn bytecode_there(&self, v: u64) -> bool {
        self.bytecodes
            .get(&v)
            .is_some_and(|e| self.bytecode_header(v) == Some(e.header))
    }

    /// Remember that the frame's bytecode is its function's (read from the
    /// same frame of the same stack copy). The function, read now, is the
    /// authority: an answer remembered for that address is replaced when it
    /// differs — a `BytecodeArray` freed (its function's bytecode flushed,
    /// or the function collected) and another of the same length allocated
    /// there has the same map and length words, and would otherwise be
    /// named as the old one (seen: a lazily compiled function named
    /// "(anonymous)" in every stall).
    fn remember_bytecode(&mut self, slot: &JsSlot) {
        if slot.bytecode == 0 {
            return;
        }
        let (Some(header), Some(f)) = (
            self.bytecode_header(slot.bytecode),
            self.funcs.get(&slot.func),
        ) else {
            return;
        };
        match self.bytecodes.get(&slot.bytecode) {
            Some(e) if e.header == header && e.frame == f.frame => return,
            Some(e) if e.header == header => {
                BYTECODE_REUSED.fetch_add(1, Ordering::Relaxed);
                log::debug!(
                    "js bytecode {:#x}: remembered as {}, now {}'s",
                    slot.bytecode,
                    e.frame.name,
                    f.frame.name
                );
            }
            _ => {}
        }
        let frame = f.frame.clone();
        if self.bytecodes.len() >= MAX_BYTECODES {
            self.bytecodes.clear();
        }
        self.bytecodes
            .insert(slot.bytecode, CodeEntry { header, frame });
    }

    /// Is the function cached for `func` still there? One read: its map
    /// and `shared` words, unchanged.
    fn still_there(&self, func: u64) -> bool {
        let m = &self.meta;
        let (Some(e), Some(addr)) = (self.funcs.get(&func), untag(m, func)) else {
            return false;
        };
        let len = (m.map.max(m.jsf_shared) + 8) as usize;
        if len > 256 {
            return false;
        }
        let mut b = [0u8; 256];
        if self.mem.read_into(addr, &mut b[..len]).is_err() {
            return false;
        }
        let word = |o: u64| u64::from_le_bytes(b[o as usize..o as usize + 8].try_into().unwrap());
        word(m.map) == e.map && word(m.jsf_shared) == e.shared
    }

    /// Resolve (or re-validate) the functions of a new stack while they
    /// are where the stack says. A function that fails is forgotten —
    /// unless the process is gone (the agent fell behind its exit): then
    /// nothing can have moved since the last check, and the answer from
    /// that check stands.
    ///
    /// A frame whose function cannot be read (a closure moved since the
    /// sample) but whose bytecode was seen with its function before, and is
    /// still there, is named through its bytecode.
    ///
    /// `drain` numbers the ring drain the stack came in: a frame checked
    /// earlier in the same drain is not read again. The check says where
    /// things are at the drain, not at the sample, either way; its stacks
    /// are at most one drain apart.
    pub fn warm(&mut self, slots: &[JsSlot], drain: u64) {
        if drain != self.warmed_in {
            self.warmed.clear();
            self.warmed_in = drain;
        }
        let mut gone = None;
        for slot in slots {
            let f = slot.func;
            if !self.warmed.insert((f, slot.bytecode)) {
                continue;
            }
            if self.still_there(f) || self.resolve(f).is_some() {
                self.remember_bytecode(slot);
                continue;
            }
            if slot.bytecode != 0 && self.bytecode_there(slot.bytecode) {
                BY_BYTECODE.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Some(live) = self.live_function(slot)
                && self.resolve(live).is_some()
            {
                self.remember_bytecode(&JsSlot {
                    func: live,
                    ..*slot
                });
                LIVE.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            log::debug!(
                "js {f:#x}: unreadable, bytecode {:#x} ({})",
                slot.bytecode,
                if slot.bytecode == 0 {
                    "none"
                } else if self.bytecode_header(slot.bytecode).is_some() {
                    "a bytecode array not seen with its function"
                } else {
                    "not a bytecode array"
                }
            );
            if !*gone.get_or_insert_with(|| !crate::os::proc::process_alive(self.mem.pid())) {
                self.funcs.remove(&f);
            }
        }
    }
}

/// Per-process V8 state of the live symbolizer: found once, retried for a
/// while if the process has no Node binary mapped yet (a launcher).
///
/// Finding it reads Node's symbol table (~0.2 s for Node 20 here), so it
/// runs on a thread of its own ([`V8Watch::start`], called when the
/// engine first sees the process's loop): the drain that asks for it
/// never waits. Stacks taken before it is known have no JavaScript frames
/// (the engine counts them: `js_frames_v8_pending`).
pub struct V8Watch {
    pub state: Option<Result<JsResolver, RuntimeProblem>>,
    tries: u32,
    last: Option<Instant>,
    /// A discovery under way on its own thread.
    pending: Option<Receiver<Result<Option<V8Meta>, MetaError>>>,
}

impl V8Watch {
    pub fn new() -> Self {
        V8Watch {
            state: None,
            tries: 0,
            last: None,
            pending: None,
        }
    }

    /// Start finding V8 in `pid` on a thread of its own, if due.
    pub fn start(&mut self, pid: u32) {
        if self.state.is_some()
            || self.pending.is_some()
            || self.tries >= MAX_TRIES
            || self.last.is_some_and(|t| t.elapsed() < RETRY)
        {
            return;
        }
        self.tries += 1;
        self.last = Some(Instant::now());
        let (tx, rx) = sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("stallprof-v8".into())
            .spawn(move || {
                let _ = tx.send(discover(pid));
            });
        match spawned {
            Ok(_) => self.pending = Some(rx),
            // No thread to be had: find it here, once.
            Err(e) => {
                log::warn!(
                    "pid {pid}: no thread to read V8's metadata on ({e}); reading it inline"
                );
                self.state = Self::found(pid, discover(pid));
            }
        }
    }

    /// A discovery is under way: the resolver is not known yet (one that
    /// finished is taken first: a process found not to be Node is not
    /// pending).
    pub fn pending(&mut self, pid: u32) -> bool {
        self.take(pid);
        self.pending.is_some()
    }

    /// The resolver, once found (starting or taking a discovery if due).
    pub fn get(&mut self, pid: u32) -> Option<&mut JsResolver> {
        self.start(pid);
        self.take(pid);
        match &mut self.state {
            Some(Ok(r)) => Some(r),
            _ => None,
        }
    }

    /// Take the outcome of a finished discovery, if any.
    fn take(&mut self, pid: u32) {
        if let Some(rx) = &self.pending {
            match rx.try_recv() {
                Ok(r) => {
                    self.pending = None;
                    self.state = Self::found(pid, r);
                }
                Err(TryRecvError::Empty) => {}
                Err(TryRecvError::Disconnected) => {
                    self.pending = None;
                    self.state = Self::found(
                        pid,
                        Err(MetaError(
                            "reading V8's metadata failed (its thread ended)".into(),
                        )),
                    );
                }
            }
        }
    }

    /// The state a discovery's outcome leaves (`None`: not Node yet).
    fn found(
        pid: u32,
        r: Result<Option<V8Meta>, MetaError>,
    ) -> Option<Result<JsResolver, RuntimeProblem>> {
        match r {
            Ok(Some(meta)) => {
                log::info!(
                    "pid {pid}: V8 {}.{}.{} in {}: JavaScript frames from memory",
                    meta.version.0,
                    meta.version.1,
                    meta.version.2,
                    meta.path
                );
                let path = meta.path.clone();
                Some(JsResolver::new(pid, meta).map_err(|e| RuntimeProblem {
                    pid,
                    runtime: "node".into(),
                    what: "JavaScript function names".into(),
                    why: format!("{path}: {e}"),
                    remedy: "run stallprof as root (it reads the target's memory)".into(),
                }))
            }
            Ok(None) => None,
            Err(MetaError(why)) => Some(Err(RuntimeProblem {
                pid,
                runtime: "node".into(),
                what: "JavaScript function names (frames show as V8 builtins or [anon] JIT code)".into(),
                why,
                remedy: "use a Node build with V8 postmortem metadata (Node 18+ from nodejs.org or Debian), or start node with --perf-basic-prof".into(),
            })),
        }
    }

    pub fn problem(&self) -> Option<&RuntimeProblem> {
        match &self.state {
            Some(Err(p)) => Some(p),
            _ => None,
        }
    }
}

impl Default for V8Watch {
    fn default() -> Self {
        Self::new()
    }
}

/// The outermost frame of V8's garbage collector in a native stack, by
/// name: where a `[gc]` marker goes.
pub fn is_gc_entry(name: &str) -> bool {
    let n = name.strip_prefix("v8::internal::").unwrap_or("");
    [
        "Heap::CollectGarbage",
        "Heap::CollectAllGarbage",
        "Heap::CollectAllAvailableGarbage",
        "Heap::PerformGarbageCollection",
        "Heap::FinalizeIncrementalMarkingAtomically",
        "Heap::HandleGCRequest",
        "IncrementalMarking::",
        "ScavengerCollector::",
        "MarkCompactCollector::",
        "MinorMarkCompactCollector::",
        "MinorMarkSweepCollector::",
        "Heap::CollectGarbageShared",
        "HeapAllocator::CollectGarbage",
        "Heap::StartIncrementalMarking",
    ]
    .iter()
    .any(|p| n.starts_with(p))
}

/// Native frames a JavaScript frame stands in for: anonymous JIT code and
/// the interpreter's and baseline code's builtins. A JavaScript-looking
/// frame there that cannot be read is said (`[js: unreadable]`).
pub fn is_js_code(f: &Frame) -> bool {
    f.kind == FrameKind::Native
        && (f.module.as_deref() == Some("[anon]")
            || f.name == "[anon]"
            || f.name.starts_with("Builtins_Interpreter")
            || f.name.starts_with("Builtins_Baseline"))
}

/// Frames named by a perf map (`--perf-basic-prof`): kept as they are.
pub fn is_perf_map_frame(f: &Frame) -> bool {
    f.module.as_deref() == Some("[jit]")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> FrameLayout {
        FrameLayout {
            fp_function: -16,
            fp_context: -8,
            heap_tag_mask: 3,
            heap_tag: 1,
            fp_bytecode_array: -32,
            fp_bytecode_offset: -40,
            fp_args: 0,
        }
    }

    fn slot(frame: u32, func: u64, bytecode: u64, offset: u64, fp: u64) -> JsSlot {
        JsSlot {
            frame,
            func,
            bytecode,
            offset,
            fp,
            ..JsSlot::default()
        }
    }

    /// A read that runs into a page the process cannot read gives what
    /// lies in its first page, the rest zeroed; one that starts there, none.
    #[test]
    fn read_in_page_stops_at_an_unreadable_page() {
        // SAFETY: a private anonymous mapping of two pages, the second
        // unmapped (a PROT_NONE page would still read, as zeros, through
        // /proc/PID/mem); the first unmapped at the end.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let page = unsafe { std::slice::from_raw_parts_mut(base.cast::<u8>(), 4096) };
        page[4096 - 16..].copy_from_slice(&[7u8; 16]);
        assert_eq!(unsafe { libc::munmap(base.add(4096), 4096) }, 0);
        let mem = ProcessMemory::open(std::process::id()).unwrap();
        let at = base as u64 + 4096 - 16;
        let mut buf = [0xffu8; 64];
        assert_eq!(read_in_page(&mem, at, &mut buf), Some(()));
        assert_eq!(&buf[..16], &[7u8; 16]);
        assert!(buf[16..].iter().all(|&b| b == 0));
        let mut whole = [0u8; 16];
        assert_eq!(read_in_page(&mem, at, &mut whole), Some(()));
        assert_eq!(whole, [7u8; 16]);
        assert_eq!(read_in_page(&mem, base as u64 + 4096, &mut buf), None);
        unsafe { libc::munmap(base, 4096) };
    }

    #[test]
    fn slots_of_js_frames_only() {
        let sp = 0x7000_0000u64;
        let mut stack = vec![0u8; 256];
        let put = |s: &mut Vec<u8>, at: u64, v: u64| {
            let o = (at - sp) as usize;
            s[o..o + 8].copy_from_slice(&v.to_le_bytes());
        };
        // Frame 0: an interpreted frame at fp = sp+64 (context tagged,
        // function tagged, its bytecode array and offset).
        put(&mut stack, sp + 64 - 8, 0x1234_5679);
        put(&mut stack, sp + 64 - 16, 0x2000_0001);
        put(&mut stack, sp + 64 - 32, 0x3000_0001);
        put(&mut stack, sp + 64 - 40, 0x36 << 32);
        // Frame 1: a stub frame at sp+128: a Smi marker in the context slot.
        put(&mut stack, sp + 128 - 8, 0x0000_0022);
        put(&mut stack, sp + 128 - 16, 0x2000_0001);
        // Frame 2: fp out of the copy. Frame 3 = frame 4's fp (prologue).
        let fps = [sp + 64, sp + 128, sp + 4096, sp + 64, sp + 64];
        let got = js_slots(&layout(), &fps, sp, &stack);
        assert_eq!(
            got,
            vec![
                slot(0, 0x2000_0001, 0x3000_0001, 0x36 << 32, sp + 64),
                slot(4, 0x2000_0001, 0x3000_0001, 0x36 << 32, sp + 64)
            ]
        );
        // A layout that does not say where the bytecode is: none read.
        let old = FrameLayout {
            fp_bytecode_array: 0,
            fp_bytecode_offset: 0,
            ..layout()
        };
        assert_eq!(
            js_slots(&old, &fps[..1], sp, &stack),
            vec![slot(0, 0x2000_0001, 0, 0, sp + 64)]
        );
    }

    /// The frame pointers of a frame-pointer walk, as the kernel's: the
    /// sampled bp, then each saved one while the chain goes up and stays in
    /// the copy; bounded by the stack's length.
    #[test]
    fn fp_chain_as_the_kernel_walks() {
        let sp = 0x7000_0000u64;
        let mut stack = vec![0u8; 256];
        let put = |s: &mut Vec<u8>, at: u64, v: u64| {
            let o = (at - sp) as usize;
            s[o..o + 8].copy_from_slice(&v.to_le_bytes());
        };
        put(&mut stack, sp + 32, sp + 96);
        put(&mut stack, sp + 96, sp + 200);
        put(&mut stack, sp + 200, sp + 8); // goes down: the chain ends
        assert_eq!(
            fp_chain(sp + 32, sp, &stack, 5),
            vec![sp + 32, sp + 96, sp + 200, 0, 0]
        );
        assert_eq!(fp_chain(sp + 32, sp, &stack, 2), vec![sp + 32, sp + 96]);
        // A bp outside the copy: nothing past it.
        assert_eq!(fp_chain(sp + 4096, sp, &stack, 3), vec![sp + 4096, 0, 0]);
    }

    #[test]
    fn gc_entries() {
        assert!(is_gc_entry(
            "v8::internal::Heap::CollectGarbage(v8::internal::AllocationSpace)"
        ));
        assert!(is_gc_entry(
            "v8::internal::ScavengerCollector::CollectGarbage()"
        ));
        assert!(!is_gc_entry("v8::internal::Heap::AllocateRaw"));
        assert!(!is_gc_entry("uv_run"));
    }

    /// The host's Node (if any) carries metadata stallprof reads.
    #[test]
    fn reads_host_node_metadata() {
        let p = Path::new("/usr/bin/node");
        assert!(
            p.exists(),
            "/usr/bin/node is missing: this test needs Node 20 there"
        );
        let m = V8Meta::read(p, "/usr/bin/node").unwrap().unwrap();
        assert_eq!(m.layout.fp_function, -16);
        assert_eq!(m.layout.heap_tag_mask, 3);
        assert!(m.version >= (9, 6, 0));
        // What Node's timers are read with: the metadata, and libuv's
        // default loop and the timer callback from its symbols.
        assert!(m.objects.is_ok(), "{:?}", m.objects);
        assert!(m.timers.is_ok(), "{:?}", m.timers);
        assert!(
            m.default_loop_link.is_some() && m.run_timers_link.is_some(),
            "default_loop_struct and RunTimers in node's symbols"
        );
    }

    #[test]
    fn the_loop_pointer_from_uv_default_loops_first_instruction() {
        // Debian's libuv.so.1 (1.51): endbr64; mov 0x27c4d(%rip),%rdx.
        let code = [
            0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8b, 0x15, 0x4d, 0x7c, 0x02, 0x00, 0x48, 0x85, 0xd2,
            0x74, 0x08,
        ];
        assert_eq!(loop_pointer_of(0x11fb0, &code), Some(0x39c08));
        // Without endbr64, to %rax.
        let mut plain = [0u8; 16];
        plain[..7].copy_from_slice(&[0x48, 0x8b, 0x05, 0x10, 0x00, 0x00, 0x00]);
        assert_eq!(loop_pointer_of(0x1000, &plain), Some(0x1017));
        // Other code: no answer.
        let mut other = code;
        other[5] = 0x8d; // lea, not a load
        assert_eq!(loop_pointer_of(0x11fb0, &other), None);
    }
}
