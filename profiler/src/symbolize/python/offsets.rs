//! Per-version CPython struct layouts (x86-64) for 3.10-3.12, one table,
//! each row with its provenance.
//!
//! In: `(major, minor)` of the target. Out: a [`Layout`]: the
//! [`PyOffsets`] handed to BPF plus the offsets only userspace needs
//! (thread discovery, GIL, code objects, strings). A version without a row
//! is an error, never a guess. 3.13 and later carry their own layout in
//! `_Py_DebugOffsets` at the start of `_PyRuntime`: their [`Layout`] is
//! read from the target by [`super::debug_offsets`], which keeps the few
//! per-version facts that struct lacks.
//!
//! Provenance key: "gdb X.Y.Z" = `gdb -batch -ex 'print (unsigned
//! long)&((T*)0)->field'` / `ptype /o T` on
//! `/root/.pyenv/versions/X.Y.Z/lib/libpythonX.Y.so.1.0` (full DWARF), run
//! while writing this table; "runtime" = the root integration test
//! `tests/python_frames.rs` walking a live victim of that build. For
//! `tstate_context`, "runtime" = a live interpreter of that build scanning
//! its own thread state (`ctypes.pythonapi.PyThreadState_Get()`) inside
//! `ctx.run(...)` of a fresh `contextvars.Context` for the word equal to
//! `id(ctx)`: one word, at the gdb offset, for two contexts in turn.

use profiler_common::python::{
    PY_FRAME_MODEL_FRAME_OBJECT, PY_FRAME_MODEL_INTERPRETER_FRAME, PY_OFFSET_NONE, PY_OWNER_NONE,
    PyOffsets,
};

use super::linetable::LineTableFormat;

/// Versions stallprof reads: a row here (3.10-3.12) or a reader of their
/// `_Py_DebugOffsets` (3.13-3.15).
pub const SUPPORTED: &[(u8, u8)] = &[(3, 10), (3, 11), (3, 12), (3, 13), (3, 14), (3, 15)];

/// Everything userspace reads in a target of one minor version.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// The frame walk, shared with BPF.
    pub bpf: PyOffsets,

    /// `_PyRuntimeState.interpreters.head` / `.main`.
    pub runtime_interpreters_head: u32,
    pub runtime_interpreters_main: u32,
    /// `_PyRuntimeState.ceval.gil.{locked,last_holder}` (3.10, 3.11: one GIL
    /// in the runtime); `None` when the GIL hangs off the interpreter.
    pub runtime_gil: Option<GilFields>,

    /// `PyInterpreterState.next` / `threads.head` (3.10: `tstate_head`).
    pub interp_next: u32,
    pub interp_threads_head: u32,
    /// `PyInterpreterState.ceval.gil`, a `struct _gil_runtime_state*` (3.12+),
    /// and the fields inside it.
    pub interp_gil_ptr: Option<(u32, GilFields)>,

    /// `PyThreadState.next`.
    pub tstate_next: u32,
    /// `PyThreadState.thread_id` (the `pthread_t`).
    pub tstate_thread_id: u32,
    /// `PyThreadState.native_thread_id` (3.11+); 3.10 maps `thread_id`
    /// through glibc's `struct pthread` instead.
    pub tstate_native_thread_id: Option<u32>,
    /// `PyThreadState.context`: the thread's current `contextvars.Context`
    /// (a `PyContext*`, NULL until the thread first used one; asyncio runs
    /// each callback under its handle's context there).
    pub tstate_context: u32,

    /// `PyCodeObject` fields.
    pub code_filename: u32,
    pub code_name: u32,
    /// `co_qualname` (3.11+); 3.10 names frames by `co_name`.
    pub code_qualname: Option<u32>,
    pub code_firstlineno: u32,
    pub code_linetable: u32,
    pub linetable_format: LineTableFormat,

    /// `PyUnicodeObject`: data of a compact ASCII string starts right after
    /// `PyASCIIObject`, of any other compact string after
    /// `PyCompactUnicodeObject`.
    pub unicode_ascii_data: u32,
    pub unicode_compact_data: u32,

    /// A frame's local variables: `_PyInterpreterFrame.localsplus` (3.11+;
    /// 3.10 `PyFrameObject.f_localsplus`), and the code object's tuple of
    /// their names (`co_localsplusnames`; 3.10 `co_varnames`, the
    /// arguments and plain locals first, as in `f_localsplus`).
    pub frame_localsplus: u32,
    pub code_localsplusnames: u32,
}

/// Fields of `struct _gil_runtime_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GilFields {
    /// `locked` (an `int` / `_Py_atomic_int`).
    pub locked: u32,
    /// `last_holder` (a `PyThreadState*`): the holder while `locked` is 1.
    pub last_holder: u32,
}

/// Version-independent (gdb 3.10.13..3.13.0; checked against the target's
/// `_Py_DebugOffsets` for 3.13+).
pub use profiler_common::python::OB_TYPE; // PyObject.ob_type
pub const VAR_OB_SIZE: u64 = 16; // PyVarObject.ob_size
pub const BYTES_OB_SVAL: u64 = 32; // PyBytesObject.ob_sval
pub const UNICODE_LENGTH: u64 = 16; // PyASCIIObject.length
pub const UNICODE_STATE: u64 = 32; // PyASCIIObject.state: interned:2 kind:3 compact:1 ascii:1
/// glibc x86-64 `struct pthread.tid` (`pthread_t` is the `struct pthread*`).
/// Checked on glibc 2.36 (Debian 12): `*(int*)(pthread_self() + 720) ==
/// gettid()` for the main and a second thread; each mapped TID is also
/// checked against /proc/PID/task at use.
pub const GLIBC_PTHREAD_TID: u64 = 720;

/// The table. One row per minor version; patch releases of a minor version
/// share struct layouts (CPython's ABI rule for these internals in practice,
/// and checked for Debian's 3.11.2 against pyenv's 3.11.7 at runtime).
pub fn layout(major: u8, minor: u8) -> Option<Layout> {
    let gil = GilFields {
        locked: 16,
        last_holder: 8,
    }; // gdb 3.10.13..3.13.0: ptype /o struct _gil_runtime_state
    let row = match (major, minor) {
        // 3.10: gdb 3.10.13; runtime 3.10.13.
        (3, 10) => Layout {
            bpf: PyOffsets {
                version: 0x030a,
                frame_model: PY_FRAME_MODEL_FRAME_OBJECT,
                tstate_frame: 24, // PyThreadState.frame
                cframe_current_frame: PY_OFFSET_NONE,
                frame_code: 32,     // PyFrameObject.f_code
                frame_previous: 24, // PyFrameObject.f_back
                frame_instr: 96,    // PyFrameObject.f_lasti (int)
                frame_instr_size: 4,
                frame_owner: PY_OFFSET_NONE,
                owner_shim_min: PY_OWNER_NONE,
                code_adaptive: 0,
                frame_is_entry: PY_OFFSET_NONE,
                code_tag_mask: 0,
            },
            runtime_interpreters_head: 32,
            runtime_interpreters_main: 40,
            runtime_gil: Some(GilFields {
                locked: 352 + 16,
                last_holder: 352 + 8,
            }), // ceval.gil.locked 368, last_holder 360
            interp_next: 0,
            interp_threads_head: 8, // tstate_head
            interp_gil_ptr: None,
            tstate_next: 8,
            tstate_thread_id: 176,
            tstate_native_thread_id: None,
            tstate_context: 240, // gdb 3.10.13; runtime 3.10.13
            code_filename: 104,
            code_name: 112,
            code_qualname: None,
            code_firstlineno: 40,
            code_linetable: 120,
            linetable_format: LineTableFormat::Pep626,
            unicode_ascii_data: 48,   // sizeof(PyASCIIObject)
            unicode_compact_data: 72, // sizeof(PyCompactUnicodeObject)
            frame_localsplus: 352,    // PyFrameObject.f_localsplus
            code_localsplusnames: 72, // PyCodeObject.co_varnames
        },
        // 3.11: gdb 3.11.7; runtime 3.11.7 and Debian /usr/bin/python3.11 (3.11.2).
        (3, 11) => Layout {
            bpf: PyOffsets {
                version: 0x030b,
                frame_model: PY_FRAME_MODEL_INTERPRETER_FRAME,
                tstate_frame: 56,        // PyThreadState.cframe
                cframe_current_frame: 8, // _PyCFrame.current_frame
                frame_code: 32,          // _PyInterpreterFrame.f_code
                frame_previous: 48,      // _PyInterpreterFrame.previous
                frame_instr: 56,         // _PyInterpreterFrame.prev_instr
                frame_instr_size: 8,
                frame_owner: 69,               // _PyInterpreterFrame.owner (char)
                owner_shim_min: PY_OWNER_NONE, // enum _frameowner has no FRAME_OWNED_BY_CSTACK
                code_adaptive: 184,            // PyCodeObject.co_code_adaptive
                frame_is_entry: 68, // _PyInterpreterFrame.is_entry (gdb ptype /o, 3.11.7)
                code_tag_mask: 0,
            },
            runtime_interpreters_head: 40,
            runtime_interpreters_main: 48,
            runtime_gil: Some(GilFields {
                locked: 360 + 16,
                last_holder: 360 + 8,
            }), // ceval.gil.locked 376, last_holder 368
            interp_next: 0,
            interp_threads_head: 16,
            interp_gil_ptr: None,
            tstate_next: 8,
            tstate_thread_id: 152,
            tstate_native_thread_id: Some(160),
            tstate_context: 224, // gdb 3.11.7; runtime 3.11.7
            code_filename: 112,
            code_name: 120,
            code_qualname: Some(128),
            code_firstlineno: 72,
            code_linetable: 136,
            linetable_format: LineTableFormat::Locations,
            unicode_ascii_data: 48,
            unicode_compact_data: 72,
            frame_localsplus: 72,     // _PyInterpreterFrame.localsplus
            code_localsplusnames: 96, // PyCodeObject.co_localsplusnames
        },
        // 3.12: gdb 3.12.1; runtime 3.12.1.
        (3, 12) => Layout {
            bpf: PyOffsets {
                version: 0x030c,
                frame_model: PY_FRAME_MODEL_INTERPRETER_FRAME,
                tstate_frame: 56,        // PyThreadState.cframe
                cframe_current_frame: 0, // _PyCFrame.current_frame
                frame_code: 0,           // _PyInterpreterFrame.f_code
                frame_previous: 8,       // _PyInterpreterFrame.previous
                frame_instr: 56,         // _PyInterpreterFrame.prev_instr
                frame_instr_size: 8,
                frame_owner: 70,    // _PyInterpreterFrame.owner (char)
                owner_shim_min: 3,  // FRAME_OWNED_BY_CSTACK
                code_adaptive: 192, // PyCodeObject.co_code_adaptive
                frame_is_entry: PY_OFFSET_NONE,
                code_tag_mask: 0,
            },
            runtime_interpreters_head: 40,
            runtime_interpreters_main: 48,
            runtime_gil: None,
            interp_next: 0,
            interp_threads_head: 72,
            interp_gil_ptr: Some((384, gil)), // PyInterpreterState.ceval.gil
            tstate_next: 8,
            tstate_thread_id: 136,
            tstate_native_thread_id: Some(144),
            tstate_context: 208, // gdb 3.12.1; runtime 3.12.1
            code_filename: 112,
            code_name: 120,
            code_qualname: Some(128),
            code_firstlineno: 68,
            code_linetable: 136,
            linetable_format: LineTableFormat::Locations,
            unicode_ascii_data: 40,   // sizeof(PyASCIIObject): wstr is gone
            unicode_compact_data: 56, // sizeof(PyCompactUnicodeObject)
            frame_localsplus: 72,     // _PyInterpreterFrame.localsplus
            code_localsplusnames: 96, // PyCodeObject.co_localsplusnames
        },
        _ => return None,
    };
    Some(row)
}

/// `PY_VERSION_HEX` (e.g. `0x030b07f0`) -> "3.11.7" (+ "a1"/"b2"/"rc1").
pub fn hex_version(hex: u32) -> String {
    let (major, minor, micro) = (hex >> 24, (hex >> 16) & 0xff, (hex >> 8) & 0xff);
    let level = match (hex >> 4) & 0xf {
        0xa => "a",
        0xb => "b",
        0xc => "rc",
        _ => "",
    };
    let serial = hex & 0xf;
    if level.is_empty() {
        format!("{major}.{minor}.{micro}")
    } else {
        format!("{major}.{minor}.{micro}{level}{serial}")
    }
}

/// The 3.13 row as gdb printed it on pyenv 3.13.0 (DWARF), before 3.13+
/// layouts came from the target's own `_Py_DebugOffsets`
/// ([`super::debug_offsets`]); a test checks that reader against it.
#[cfg(test)]
pub fn gdb_3_13() -> Layout {
    let gil = GilFields {
        locked: 16,
        last_holder: 8,
    };
    // gdb 3.13.0; runtime 3.13.0.
    Layout {
        bpf: PyOffsets {
            version: 0x030d,
            frame_model: PY_FRAME_MODEL_INTERPRETER_FRAME,
            tstate_frame: 72,                     // PyThreadState.current_frame
            cframe_current_frame: PY_OFFSET_NONE, // _PyCFrame is gone
            frame_code: 0,                        // _PyInterpreterFrame.f_executable
            frame_previous: 8,                    // _PyInterpreterFrame.previous
            frame_instr: 56,                      // _PyInterpreterFrame.instr_ptr
            frame_instr_size: 8,
            frame_owner: 70,    // _PyInterpreterFrame.owner (char)
            owner_shim_min: 3,  // FRAME_OWNED_BY_CSTACK (f_executable is Py_None)
            code_adaptive: 200, // PyCodeObject.co_code_adaptive
            frame_is_entry: PY_OFFSET_NONE,
            code_tag_mask: 0,
        },
        runtime_interpreters_head: 632,
        runtime_interpreters_main: 640,
        runtime_gil: None,
        interp_next: 7264,
        interp_threads_head: 7344,
        interp_gil_ptr: Some((16, gil)), // PyInterpreterState.ceval.gil
        tstate_next: 8,
        tstate_thread_id: 152,
        tstate_native_thread_id: Some(160),
        tstate_context: 208,
        code_filename: 112,
        code_name: 120,
        code_qualname: Some(128),
        code_firstlineno: 68,
        code_linetable: 136,
        linetable_format: LineTableFormat::Locations,
        unicode_ascii_data: 40,
        unicode_compact_data: 56,
        frame_localsplus: 72,
        code_localsplusnames: 96,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_versions_render() {
        assert_eq!(hex_version(0x030b07f0), "3.11.7");
        assert_eq!(hex_version(0x030d00a3), "3.13.0a3");
        assert_eq!(hex_version(0x030e00c1), "3.14.0rc1");
    }

    #[test]
    fn every_supported_version_has_a_consistent_row() {
        let rows = SUPPORTED
            .iter()
            .filter_map(|&(ma, mi)| layout(ma, mi).map(|r| (ma, mi, r)));
        let gdb = std::iter::once((3, 13, gdb_3_13()));
        for (major, minor, row) in rows.chain(gdb) {
            assert_eq!(row.bpf.major_minor(), (major, minor));
            let interp_frames = row.bpf.frame_model == PY_FRAME_MODEL_INTERPRETER_FRAME;
            assert_eq!(interp_frames, row.bpf.frame_instr_size == 8);
            assert_eq!(interp_frames, row.bpf.code_adaptive != 0);
            assert_eq!(interp_frames, row.tstate_native_thread_id.is_some());
            assert_eq!(row.runtime_gil.is_some(), row.interp_gil_ptr.is_none());
        }
        assert!(layout(3, 9).is_none());
        assert!(layout(3, 13).is_none(), "3.13+ come from _Py_DebugOffsets");
    }
}
