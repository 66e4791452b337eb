//! CPython 3.13+ layouts from the target's own `_Py_DebugOffsets`.
//!
//! In: the bytes at the start of the target's `_PyRuntime` (the struct
//! `_Py_DebugOffsets`: the cookie `xdebugpy`, `PY_VERSION_HEX`, the
//! free-threaded flag, then one section of `uint64_t` offsets per struct:
//! runtime state, interpreter state, thread state, interpreter frame, code
//! object, ..., bytes, unicode) and the version `Py_Version` says. Out: a
//! [`Layout`] whose every offset comes from the target, or an error that
//! says what did not fit.
//!
//! What is kept per version ([`Version`]) is only what the struct lacks:
//! - where each field sits *in `_Py_DebugOffsets`* (sections grow between
//!   minor versions: 3.14 adds `threads_main`, `code_object_generation`,
//!   `tlbc_generation`, the frame's `stackpointer`/`tlbc_index`, `co_tlbc`
//!   and whole sections; 3.15 adds six thread-state fields and two
//!   type-object fields);
//! - the frame owners that mark a shim (`FRAME_OWNED_BY_*`), the
//!   `_PyStackRef` tag bits on `f_executable`, the line-table format,
//!   `_PyRuntimeState.interpreters.main` (right after `.head`), and
//!   `PyThreadState.context` (checked to lie inside the target's thread
//!   state).
//!
//! Provenance of the positions: CPython's
//! `Include/internal/pycore_debug_offsets.h` (3.13 and 3.14 field lists),
//! then each position checked on the real builds: pyenv 3.13.0 and
//! Debian's 3.13.15, 3.14.8 and 3.15.0 (Debian testing, see
//! docs/containers.md). For each, the u64s of `_PyRuntime`'s initializer
//! were dumped (the fixtures in the tests below) and, on live 3.14.8 and
//! 3.15.0 processes, every field used here was followed by hand through
//! `/proc/PID/mem`: the thread list to the thread state whose
//! `native_thread_id` is the thread's (namespace) tid and whose `thread_id`
//! is its `pthread_t`, `current_frame` down the frame chain to code objects
//! whose `ob_type` is `PyCode_Type` and whose qualname, filename and first
//! line are the victim's, the GIL's `locked`/`last_holder`. 3.15's thread
//! section was laid out that way (no 3.15 header was at hand): `thread_id`
//! and `native_thread_id` are its 9th and 10th fields.
//!
//! The check at attach ([`layout`]): the cookie, the version against
//! `Py_Version`, not free-threaded, each section's size plausible, every
//! field used inside its struct, and the object-header offsets that code
//! resolution takes as constants equal to the target's.

use profiler_common::python::{PY_FRAME_MODEL_INTERPRETER_FRAME, PY_OFFSET_NONE, PyOffsets};

use super::PythonError;
use super::linetable::LineTableFormat;
use super::offsets::{
    BYTES_OB_SVAL, GilFields, Layout, OB_TYPE, UNICODE_LENGTH, UNICODE_STATE, VAR_OB_SIZE,
    hex_version,
};

pub const COOKIE: &[u8; 8] = b"xdebugpy";
/// Bytes read from `_PyRuntime`: more than the largest known struct (3.14:
/// 760), less than `_PyRuntime` itself (280 KiB and more).
pub const READ_LEN: usize = 1024;

/// Index (in `u64`s from the start of `_Py_DebugOffsets`) of each field
/// used, for one minor version.
#[derive(Clone, Copy, Debug)]
struct Positions {
    runtime_interpreters_head: usize,
    interp_size: usize,
    interp_next: usize,
    interp_threads_head: usize,
    interp_ceval_gil: usize,
    interp_gil_runtime_state: usize,
    interp_gil_locked: usize,
    interp_gil_holder: usize,
    tstate_size: usize,
    tstate_next: usize,
    tstate_current_frame: usize,
    tstate_thread_id: usize,
    tstate_native_thread_id: usize,
    frame_size: usize,
    frame_previous: usize,
    frame_executable: usize,
    frame_instr_ptr: usize,
    frame_owner: usize,
    frame_localsplus: usize,
    code_size: usize,
    code_filename: usize,
    code_name: usize,
    code_qualname: usize,
    code_linetable: usize,
    code_firstlineno: usize,
    code_adaptive: usize,
    code_localsplusnames: usize,
    pyobject_size: usize,
    pyobject_ob_type: usize,
    bytes_size: usize,
    bytes_ob_size: usize,
    bytes_ob_sval: usize,
    unicode_size: usize,
    unicode_state: usize,
    unicode_length: usize,
    unicode_ascii_size: usize,
}

/// What one minor version needs beyond its `_Py_DebugOffsets`.
#[derive(Clone, Copy, Debug)]
struct Version {
    minor: u8,
    at: Positions,
    /// [`PyOffsets::owner_shim_min`]: 3.13 `FRAME_OWNED_BY_CSTACK` = 3;
    /// 3.14 `FRAME_OWNED_BY_INTERPRETER` = 3 (seen live: the eval loop's
    /// entry frame, `f_executable` = tagged `Py_None`), `_CSTACK` = 4;
    /// 3.15 `FRAME_OWNED_BY_INTERPRETER` = 3 (seen live on the entry frame
    /// and on the thread's base frame).
    owner_shim_min: u16,
    /// [`PyOffsets::code_tag_mask`]: 3.14+ `f_executable` is a
    /// `_PyStackRef` (`Py_TAG_BITS` = 3 covers the refcount and int tags;
    /// seen live: code objects untagged, `Py_None` with bit 0 set).
    code_tag_mask: u64,
    /// `PyThreadState.context` (`_Py_DebugOffsets` has no such field):
    /// gdb on pyenv 3.13.0 (`print &((PyThreadState*)0)->context`), and on
    /// each build (pyenv 3.13.0, Debian's 3.13.15, 3.14.8, 3.15.0) a live
    /// interpreter scanning its own thread state
    /// (`ctypes.pythonapi.PyThreadState_Get()`, 1200 bytes) inside
    /// `ctx.run(...)` of a fresh `contextvars.Context` for the word equal to
    /// `id(ctx)`: exactly one word, this one, for two contexts in turn, and
    /// none once `run` returned. 3.15's thread state grew before it (232).
    tstate_context: u32,
}

/// 3.13: `pycore_debug_offsets.h` v3.13.0; 73 u64s (584 bytes).
const V3_13: Version = Version {
    minor: 13,
    at: Positions {
        runtime_interpreters_head: 5,
        interp_size: 6,
        interp_next: 8,
        interp_threads_head: 9,
        interp_ceval_gil: 14,
        interp_gil_runtime_state: 15,
        interp_gil_locked: 17,
        interp_gil_holder: 18,
        tstate_size: 19,
        tstate_next: 21,
        tstate_current_frame: 23,
        tstate_thread_id: 24,
        tstate_native_thread_id: 25,
        frame_size: 28,
        frame_previous: 29,
        frame_executable: 30,
        frame_instr_ptr: 31,
        frame_owner: 33,
        frame_localsplus: 32,
        code_size: 34,
        code_filename: 35,
        code_name: 36,
        code_qualname: 37,
        code_linetable: 38,
        code_firstlineno: 39,
        code_adaptive: 43,
        code_localsplusnames: 41,
        pyobject_size: 44,
        pyobject_ob_type: 45,
        bytes_size: 64,
        bytes_ob_size: 65,
        bytes_ob_sval: 66,
        unicode_size: 67,
        unicode_state: 68,
        unicode_length: 69,
        unicode_ascii_size: 70,
    },
    owner_shim_min: 3,
    code_tag_mask: 0,
    tstate_context: 208,
};

/// 3.14: interpreter state gains `threads_main` (after `threads_head`) and
/// two generation counters; the frame `stackpointer`, `tlbc_index`; code
/// `co_tlbc`; a set section before dict; gen, llist and debugger sections
/// at the end. 95 u64s (760 bytes).
const V3_14: Version = Version {
    minor: 14,
    at: Positions {
        runtime_interpreters_head: 5,
        interp_size: 6,
        interp_next: 8,
        interp_threads_head: 9,
        interp_ceval_gil: 15,
        interp_gil_runtime_state: 16,
        interp_gil_locked: 18,
        interp_gil_holder: 19,
        tstate_size: 22,
        tstate_next: 24,
        tstate_current_frame: 26,
        tstate_thread_id: 27,
        tstate_native_thread_id: 28,
        frame_size: 31,
        frame_previous: 32,
        frame_executable: 33,
        frame_instr_ptr: 34,
        frame_owner: 36,
        frame_localsplus: 35,
        code_size: 39,
        code_filename: 40,
        code_name: 41,
        code_qualname: 42,
        code_linetable: 43,
        code_firstlineno: 44,
        code_adaptive: 48,
        code_localsplusnames: 46,
        pyobject_size: 50,
        pyobject_ob_type: 51,
        bytes_size: 74,
        bytes_ob_size: 75,
        bytes_ob_sval: 76,
        unicode_size: 77,
        unicode_state: 78,
        unicode_length: 79,
        unicode_ascii_size: 80,
    },
    owner_shim_min: 3,
    code_tag_mask: 3,
    tstate_context: 208,
};

/// 3.15: the thread-state section has 17 fields (`thread_id` 9th,
/// `native_thread_id` 10th), so every later section moves by 8; the type
/// section has 8 fields (4 more).
const V3_15: Version = Version {
    minor: 15,
    at: Positions {
        tstate_thread_id: 30,
        tstate_native_thread_id: 31,
        frame_size: 39,
        frame_previous: 40,
        frame_executable: 41,
        frame_instr_ptr: 42,
        frame_owner: 44,
        frame_localsplus: 43,
        code_size: 47,
        code_filename: 48,
        code_name: 49,
        code_qualname: 50,
        code_linetable: 51,
        code_firstlineno: 52,
        code_adaptive: 56,
        code_localsplusnames: 54,
        pyobject_size: 58,
        pyobject_ob_type: 59,
        bytes_size: 86,
        bytes_ob_size: 87,
        bytes_ob_sval: 88,
        unicode_size: 89,
        unicode_state: 90,
        unicode_length: 91,
        unicode_ascii_size: 92,
        ..V3_14.at
    },
    owner_shim_min: 3,
    code_tag_mask: 3,
    tstate_context: 232,
};

const VERSIONS: &[Version] = &[V3_13, V3_14, V3_15];

/// Minor versions of CPython 3 this module reads.
pub fn minors() -> impl Iterator<Item = u8> {
    VERSIONS.iter().map(|v| v.minor)
}

/// `_PyRuntimeState.interpreters.main` follows `.head` (`struct
/// pyinterpreters { PyMutex mutex; head; main; next_id }`): gdb 3.13.0
/// head 632, main 640; live 3.14.8 and 3.15.0 read `main == head` with one
/// interpreter.
const INTERPRETERS_MAIN_AFTER_HEAD: u64 = 8;

/// The layout of a CPython 3.`minor` (`py_version`: its `Py_Version`) from
/// `buf`, the first [`READ_LEN`] bytes of its `_PyRuntime`.
pub fn layout(buf: &[u8], py_version: u32) -> Result<Layout, PythonError> {
    let found = hex_version(py_version);
    let minor = (py_version >> 16) as u8;
    let v = VERSIONS
        .iter()
        .find(|v| v.minor == minor && py_version >> 24 == 3)
        .ok_or_else(|| PythonError::Unsupported {
            found: found.clone(),
        })?;
    let mismatch = |field: &'static str, table: u64, target: u64| PythonError::LayoutMismatch {
        version: found.clone(),
        field,
        table,
        target,
    };
    if buf.len() < READ_LEN || &buf[..8] != COOKIE {
        return Err(mismatch(
            "_Py_DebugOffsets.cookie (\"xdebugpy\")",
            u64::from_le_bytes(*COOKIE),
            buf.get(..8)
                .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap())),
        ));
    }
    let word = |i: usize| u64::from_le_bytes(buf[8 * i..8 * i + 8].try_into().unwrap());
    let version = word(1);
    if version >> 16 != u64::from(py_version >> 16) {
        return Err(mismatch(
            "_Py_DebugOffsets.version (major.minor of Py_Version)",
            u64::from(py_version),
            version,
        ));
    }
    if word(2) != 0 {
        return Err(PythonError::Unsupported {
            found: format!("{found} (free-threaded build)"),
        });
    }
    let a = v.at;
    // (struct, its size position, plausible size range)
    let sections: &[(&'static str, usize, u64, u64)] = &[
        ("interpreter_state.size", a.interp_size, 1024, 1 << 20),
        ("thread_state.size", a.tstate_size, 128, 1 << 16),
        ("interpreter_frame.size", a.frame_size, 64, 256),
        ("code_object.size", a.code_size, 128, 1024),
        ("pyobject.size", a.pyobject_size, 16, 16),
        ("bytes_object.size", a.bytes_size, 33, 64),
        ("unicode_object.size", a.unicode_size, 48, 128),
    ];
    for &(field, at, lo, hi) in sections {
        let size = word(at);
        if !(lo..=hi).contains(&size) {
            return Err(mismatch(field, lo, size));
        }
    }
    // Every field used lies inside its struct (a field read from the wrong
    // position of a reordered section almost never does).
    let inside: &[(&'static str, usize, usize, u64)] = &[
        ("interpreter_state.next", a.interp_next, a.interp_size, 8),
        (
            "interpreter_state.threads_head",
            a.interp_threads_head,
            a.interp_size,
            8,
        ),
        (
            "interpreter_state.ceval_gil",
            a.interp_ceval_gil,
            a.interp_size,
            8,
        ),
        (
            "interpreter_state.gil_runtime_state_locked",
            a.interp_gil_locked,
            a.interp_size,
            4,
        ),
        (
            "interpreter_state.gil_runtime_state_holder",
            a.interp_gil_holder,
            a.interp_size,
            8,
        ),
        ("thread_state.next", a.tstate_next, a.tstate_size, 8),
        (
            "thread_state.current_frame",
            a.tstate_current_frame,
            a.tstate_size,
            8,
        ),
        (
            "thread_state.thread_id",
            a.tstate_thread_id,
            a.tstate_size,
            8,
        ),
        (
            "thread_state.native_thread_id",
            a.tstate_native_thread_id,
            a.tstate_size,
            8,
        ),
        (
            "interpreter_frame.previous",
            a.frame_previous,
            a.frame_size,
            8,
        ),
        (
            "interpreter_frame.executable",
            a.frame_executable,
            a.frame_size,
            8,
        ),
        (
            "interpreter_frame.instr_ptr",
            a.frame_instr_ptr,
            a.frame_size,
            8,
        ),
        ("interpreter_frame.owner", a.frame_owner, a.frame_size, 1),
        (
            "interpreter_frame.localsplus",
            a.frame_localsplus,
            a.frame_size,
            0,
        ),
        (
            "code_object.localsplusnames",
            a.code_localsplusnames,
            a.code_size,
            8,
        ),
        ("code_object.filename", a.code_filename, a.code_size, 8),
        ("code_object.name", a.code_name, a.code_size, 8),
        ("code_object.qualname", a.code_qualname, a.code_size, 8),
        ("code_object.linetable", a.code_linetable, a.code_size, 8),
        (
            "code_object.firstlineno",
            a.code_firstlineno,
            a.code_size,
            4,
        ),
        (
            "code_object.co_code_adaptive",
            a.code_adaptive,
            a.code_size,
            0,
        ),
        (
            "unicode_object.asciiobject_size",
            a.unicode_ascii_size,
            a.unicode_size,
            0,
        ),
    ];
    for &(field, at, size_at, width) in inside {
        let (off, size) = (word(at), word(size_at));
        if off + width > size {
            return Err(mismatch(field, size, off));
        }
    }
    if u64::from(v.tstate_context) + 8 > word(a.tstate_size) {
        return Err(mismatch(
            "thread_state.size (holding context)",
            u64::from(v.tstate_context) + 8,
            word(a.tstate_size),
        ));
    }
    // Code resolution reads object headers at fixed offsets: the target's
    // must be those.
    let fixed: &[(&'static str, usize, u64)] = &[
        ("pyobject.ob_type", a.pyobject_ob_type, OB_TYPE),
        ("bytes_object.ob_size", a.bytes_ob_size, VAR_OB_SIZE),
        ("bytes_object.ob_sval", a.bytes_ob_sval, BYTES_OB_SVAL),
        ("unicode_object.state", a.unicode_state, UNICODE_STATE),
        ("unicode_object.length", a.unicode_length, UNICODE_LENGTH),
    ];
    for &(field, at, table) in fixed {
        if word(at) != table {
            return Err(mismatch(field, table, word(at)));
        }
    }
    let u16_of = |field: &'static str, at: usize| {
        u16::try_from(word(at)).map_err(|_| mismatch(field, u64::from(u16::MAX), word(at)))
    };
    let u32_of = |field: &'static str, v: u64| {
        u32::try_from(v).map_err(|_| mismatch(field, u64::from(u32::MAX), v))
    };
    let gil_base = word(a.interp_gil_runtime_state);
    let gil_field = |field: &'static str, at: usize| {
        let off = word(at).wrapping_sub(gil_base);
        if off >= 256 {
            return Err(mismatch(field, gil_base, word(at)));
        }
        Ok(off as u32)
    };
    let head = word(a.runtime_interpreters_head);
    Ok(Layout {
        bpf: PyOffsets {
            version: 0x0300 | u16::from(v.minor),
            frame_model: PY_FRAME_MODEL_INTERPRETER_FRAME,
            tstate_frame: u16_of("thread_state.current_frame", a.tstate_current_frame)?,
            cframe_current_frame: PY_OFFSET_NONE,
            frame_code: u16_of("interpreter_frame.executable", a.frame_executable)?,
            frame_previous: u16_of("interpreter_frame.previous", a.frame_previous)?,
            frame_instr: u16_of("interpreter_frame.instr_ptr", a.frame_instr_ptr)?,
            frame_instr_size: 8,
            frame_owner: u16_of("interpreter_frame.owner", a.frame_owner)?,
            owner_shim_min: v.owner_shim_min,
            code_adaptive: u16_of("code_object.co_code_adaptive", a.code_adaptive)?,
            frame_is_entry: PY_OFFSET_NONE,
            code_tag_mask: v.code_tag_mask,
        },
        runtime_interpreters_head: u32_of("runtime_state.interpreters_head", head)?,
        runtime_interpreters_main: u32_of(
            "runtime_state.interpreters_head",
            head + INTERPRETERS_MAIN_AFTER_HEAD,
        )?,
        runtime_gil: None,
        interp_next: u32_of("interpreter_state.next", word(a.interp_next))?,
        interp_threads_head: u32_of(
            "interpreter_state.threads_head",
            word(a.interp_threads_head),
        )?,
        interp_gil_ptr: Some((
            u32_of("interpreter_state.ceval_gil", word(a.interp_ceval_gil))?,
            GilFields {
                locked: gil_field(
                    "interpreter_state.gil_runtime_state_locked",
                    a.interp_gil_locked,
                )?,
                last_holder: gil_field(
                    "interpreter_state.gil_runtime_state_holder",
                    a.interp_gil_holder,
                )?,
            },
        )),
        tstate_next: u32_of("thread_state.next", word(a.tstate_next))?,
        tstate_thread_id: u32_of("thread_state.thread_id", word(a.tstate_thread_id))?,
        tstate_native_thread_id: Some(u32_of(
            "thread_state.native_thread_id",
            word(a.tstate_native_thread_id),
        )?),
        tstate_context: v.tstate_context,
        code_filename: u32_of("code_object.filename", word(a.code_filename))?,
        code_name: u32_of("code_object.name", word(a.code_name))?,
        code_qualname: Some(u32_of("code_object.qualname", word(a.code_qualname))?),
        code_firstlineno: u32_of("code_object.firstlineno", word(a.code_firstlineno))?,
        code_linetable: u32_of("code_object.linetable", word(a.code_linetable))?,
        // co_linetable: the 3.11 location table, unchanged through 3.15
        // (linetable/cases_314.rs, cases_315.rs).
        linetable_format: LineTableFormat::Locations,
        unicode_ascii_data: u32_of(
            "unicode_object.asciiobject_size",
            word(a.unicode_ascii_size),
        )?,
        // sizeof(PyUnicodeObject) = sizeof(PyCompactUnicodeObject) + the
        // `data` pointer: gdb 3.13.0 56 = 64 - 8.
        unicode_compact_data: u32_of("unicode_object.size", word(a.unicode_size) - 8)?,
        frame_localsplus: u32_of("interpreter_frame.localsplus", word(a.frame_localsplus))?,
        code_localsplusnames: u32_of("code_object.localsplusnames", word(a.code_localsplusnames))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first u64s of `_PyRuntime`'s initializer (`_Py_DebugOffsets`),
    /// read from each ELF file's data segment (the same bytes the live
    /// processes showed through /proc/PID/mem).
    const PYENV_3_13_0: &[u64] = &[
        8750607829840520312,
        51183856,
        0,
        283320,
        608,
        632,
        194968,
        7272,
        7264,
        7344,
        7400,
        7656,
        7640,
        7648,
        16,
        7752,
        0,
        7768,
        7760,
        304,
        0,
        8,
        16,
        72,
        152,
        160,
        232,
        32,
        80,
        8,
        0,
        56,
        72,
        70,
        208,
        112,
        120,
        128,
        136,
        68,
        52,
        96,
        104,
        200,
        16,
        8,
        416,
        24,
        88,
        168,
        32,
        24,
        16,
        40,
        24,
        16,
        48,
        32,
        40,
        24,
        16,
        32,
        16,
        24,
        40,
        16,
        32,
        64,
        32,
        16,
        40,
        240,
        200,
    ];
    const DEBIAN_3_13_15: &[u64] = &[
        8750607829840520312,
        51187696,
        0,
        283408,
        608,
        632,
        194984,
        7272,
        7264,
        7344,
        7400,
        7656,
        7640,
        7648,
        16,
        7752,
        0,
        7768,
        7760,
        312,
        0,
        8,
        16,
        72,
        152,
        160,
        232,
        32,
        80,
        8,
        0,
        56,
        72,
        70,
        208,
        112,
        120,
        128,
        136,
        68,
        52,
        96,
        104,
        200,
        16,
        8,
        416,
        24,
        88,
        168,
        32,
        24,
        16,
        40,
        24,
        16,
        48,
        32,
        40,
        24,
        16,
        32,
        16,
        24,
        40,
        16,
        32,
        64,
        32,
        16,
        40,
        240,
        200,
    ];
    const DEBIAN_3_14_8: &[u64] = &[
        8750607829840520312,
        51251440,
        0,
        316616,
        784,
        808,
        225864,
        7280,
        7272,
        7344,
        7360,
        7408,
        7688,
        7672,
        7680,
        16,
        7784,
        0,
        7800,
        7792,
        7992,
        0,
        832,
        0,
        8,
        16,
        72,
        152,
        160,
        232,
        32,
        88,
        8,
        0,
        56,
        80,
        74,
        64,
        0,
        216,
        112,
        120,
        128,
        136,
        68,
        52,
        96,
        104,
        208,
        0,
        16,
        8,
        416,
        24,
        88,
        168,
        40,
        32,
        16,
        40,
        24,
        16,
        200,
        24,
        40,
        32,
        48,
        32,
        40,
        24,
        16,
        32,
        16,
        24,
        40,
        16,
        32,
        64,
        32,
        16,
        40,
        264,
        192,
        160,
        24,
        72,
        67,
        0,
        8,
        24,
        304,
        8076,
        0,
        4,
        512,
    ];
    const DEBIAN_3_15_0: &[u64] = &[
        8750607829840520312,
        51314928,
        0,
        346568,
        912,
        936,
        226240,
        7272,
        7264,
        7336,
        7352,
        7400,
        7592,
        7576,
        7584,
        16,
        7736,
        0,
        7752,
        7744,
        7944,
        0,
        888,
        0,
        8,
        16,
        72,
        80,
        88,
        96,
        176,
        184,
        256,
        32,
        36,
        40,
        136,
        288,
        0,
        88,
        8,
        0,
        56,
        80,
        74,
        64,
        0,
        216,
        112,
        120,
        128,
        136,
        68,
        52,
        96,
        104,
        208,
        0,
        16,
        8,
        424,
        24,
        88,
        168,
        32,
        288,
        944,
        888,
        40,
        32,
        16,
        40,
        24,
        16,
        200,
        24,
        40,
        32,
        48,
        32,
        40,
        24,
        16,
        32,
        16,
        24,
        40,
        16,
        32,
        64,
        32,
        16,
        40,
    ];

    fn bytes(words: &[u64]) -> Vec<u8> {
        let mut b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        b.resize(READ_LEN, 0);
        b
    }

    #[test]
    fn pyenv_3_13_0_gives_the_gdb_row() {
        let got = layout(&bytes(PYENV_3_13_0), 0x030d00f0).unwrap();
        let want = super::super::offsets::gdb_3_13();
        assert_eq!(format!("{got:?}"), format!("{want:?}"));
    }

    #[test]
    fn debian_builds_read() {
        let l13 = layout(&bytes(DEBIAN_3_13_15), 0x030d0ff0).unwrap();
        assert_eq!(l13.tstate_native_thread_id, Some(160));
        let l14 = layout(&bytes(DEBIAN_3_14_8), 0x030e08f0).unwrap();
        // Checked live on 3.14.8 (see the module docs).
        assert_eq!(
            (
                l14.bpf.tstate_frame,
                l14.bpf.frame_owner,
                l14.bpf.frame_instr
            ),
            (72, 74, 56)
        );
        assert_eq!((l14.bpf.code_adaptive, l14.bpf.code_tag_mask), (208, 3));
        // ctypes on live 3.14.8 / 3.15.0: the words of _PyRuntime at these
        // positions (docs/asgi.md).
        assert_eq!((l14.frame_localsplus, l14.code_localsplusnames), (80, 96));
        assert_eq!(
            (l14.runtime_interpreters_head, l14.interp_threads_head),
            (808, 7344)
        );
        assert_eq!(
            l14.interp_gil_ptr,
            Some((
                16,
                GilFields {
                    locked: 16,
                    last_holder: 8
                }
            ))
        );
        let l15 = layout(&bytes(DEBIAN_3_15_0), 0x030f00f0).unwrap();
        assert_eq!((l15.frame_localsplus, l15.code_localsplusnames), (80, 96));
        assert_eq!(
            (l15.tstate_thread_id, l15.tstate_native_thread_id),
            (176, Some(184))
        );
        assert_eq!((l15.bpf.tstate_frame, l15.bpf.frame_owner), (72, 74));
        assert_eq!(
            (l15.runtime_interpreters_head, l15.interp_next),
            (936, 7264)
        );
        assert_eq!((l15.unicode_ascii_data, l15.unicode_compact_data), (40, 56));
        // The thread's context: not in _Py_DebugOffsets (the table's).
        assert_eq!(
            (l13.tstate_context, l14.tstate_context, l15.tstate_context),
            (208, 208, 232)
        );
    }

    #[test]
    fn wrong_version_cookie_or_free_threaded_is_refused() {
        // 3.14's struct read as 3.15's: positions do not fit.
        let err = layout(&bytes(DEBIAN_3_14_8), 0x030f00f0).unwrap_err();
        assert!(matches!(err, PythonError::LayoutMismatch { .. }), "{err}");
        // A future version: no positions known.
        let err = layout(&bytes(DEBIAN_3_15_0), 0x031000f0).unwrap_err();
        assert!(err.to_string().contains("3.16.0"), "{err}");
        let mut b = bytes(DEBIAN_3_14_8);
        b[0] = b'y';
        assert!(layout(&b, 0x030e08f0).is_err());
        let mut b = bytes(DEBIAN_3_14_8);
        b[16] = 1;
        let err = layout(&b, 0x030e08f0).unwrap_err();
        assert!(err.to_string().contains("free-threaded"), "{err}");
    }

    #[test]
    fn a_shifted_section_fails_the_check() {
        // 3.15's struct with 3.14's positions: the frame section is read
        // from inside the thread section.
        let mut w = DEBIAN_3_15_0.to_vec();
        w[1] = DEBIAN_3_14_8[1];
        assert!(layout(&bytes(&w), 0x030e08f0).is_err());
    }
}
