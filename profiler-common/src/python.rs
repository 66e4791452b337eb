//! CPython frame-walking layout shared by the BPF programs and userspace.
//!
//! In: a `PyThreadState*` of the target (userspace finds it per TID and hands
//! it to BPF in a map). Out: up to [`PY_MAX_FRAMES`] [`PyFrame`] records,
//! newest first. [`PyOffsets`] holds only what that walk needs; userspace
//! fills it from its per-version table (`stallprof::python`), checked at
//! attach, and sets it as a BPF global. Everything else (names, line numbers)
//! is resolved later in userspace from the code-object address.
//!
//! The walk, for both BPF and the userspace reference `walk_stack`:
//!
//! ```text
//! p = *(tstate + tstate_frame)
//! if cframe_current_frame != PY_OFFSET_NONE { p = *(p + cframe_current_frame) }
//! while p != 0 and n < PY_MAX_FRAMES:
//!     if frame_owner != PY_OFFSET_NONE and *(u8*)(p + frame_owner) >= owner_shim_min:
//!         emit PY_BOUNDARY (an eval-loop activation begins below)
//!     else emit PyFrame { code: *(p + frame_code) & !code_tag_mask,
//!                         instr: *(p + frame_instr) (frame_instr_size bytes) }
//!          and, if frame_is_entry != NONE and *(u8*)(p + frame_is_entry): PY_BOUNDARY
//!     p = *(p + frame_previous)
//! ```

/// Deepest Python stack a single walk records; deeper frames are dropped
/// (outermost first) and counted by the BPF stats.
pub const PY_MAX_FRAMES: usize = 64;

/// An offset field that does not apply to this version.
pub const PY_OFFSET_NONE: u16 = u16::MAX;
/// [`PyOffsets::owner_shim_min`] when the version has no C-stack shim frames (3.11).
pub const PY_OWNER_NONE: u16 = u16::MAX;

/// 3.10: `PyThreadState.frame` is a `PyFrameObject*` chain linked by
/// `f_back`; the instruction is `f_lasti` (an `int`, in code units).
pub const PY_FRAME_MODEL_FRAME_OBJECT: u16 = 1;
/// 3.11+: `_PyInterpreterFrame` chain linked by `previous`; the instruction
/// is the raw `prev_instr` (3.11, 3.12) / `instr_ptr` (3.13) address.
pub const PY_FRAME_MODEL_INTERPRETER_FRAME: u16 = 2;

/// Where to find frames in a CPython of one minor version (x86-64).
///
/// All offsets are byte offsets into the named C struct. 32 bytes, no
/// implicit padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyOffsets {
    /// `major << 8 | minor`, e.g. `0x030c` for 3.12.
    pub version: u16,
    /// `PY_FRAME_MODEL_*`.
    pub frame_model: u16,
    /// `PyThreadState` field holding the first hop: `frame` (3.10),
    /// `cframe` (3.11, 3.12), `current_frame` (3.13).
    pub tstate_frame: u16,
    /// `_PyCFrame.current_frame` when `tstate_frame` points at a `_PyCFrame`
    /// (3.11, 3.12); [`PY_OFFSET_NONE`] when it points at the frame itself.
    pub cframe_current_frame: u16,
    /// Frame field holding the code object: `f_code` (3.10-3.12),
    /// `f_executable` (3.13).
    pub frame_code: u16,
    /// Frame field linking to the caller: `f_back` (3.10), `previous` (3.11+).
    pub frame_previous: u16,
    /// Frame field holding the instruction: `f_lasti` (3.10),
    /// `prev_instr` (3.11, 3.12), `instr_ptr` (3.13).
    pub frame_instr: u16,
    /// Width in bytes of the `frame_instr` field: 4 (`int f_lasti`) or 8 (pointer).
    pub frame_instr_size: u16,
    /// `_PyInterpreterFrame.owner` (a `char`); [`PY_OFFSET_NONE`] for 3.10.
    pub frame_owner: u16,
    /// Lowest `owner` value of the frames that are no Python function's:
    /// the shim each eval-loop activation pushes on the C stack and the
    /// thread's base frame. Every such owner value is at or above the
    /// owned-by-thread/generator/frame-object ones: 3.12/3.13
    /// `FRAME_OWNED_BY_CSTACK` = 3; 3.14 `FRAME_OWNED_BY_INTERPRETER` = 3
    /// (the eval loop's entry frame) and `FRAME_OWNED_BY_CSTACK` = 4; 3.15
    /// `FRAME_OWNED_BY_INTERPRETER` = 3 only. Such frames are not emitted: each
    /// marks a boundary. [`PY_OWNER_NONE`] when the version has none.
    pub owner_shim_min: u16,
    /// `PyCodeObject.co_code_adaptive`: the bytecode starts at
    /// `code + code_adaptive`, so instruction byte offset =
    /// `instr - code - code_adaptive` (3.11+). 0 for 3.10 (unused).
    pub code_adaptive: u16,
    /// `_PyInterpreterFrame.is_entry` (3.11: the first frame an eval-loop
    /// activation runs); [`PY_OFFSET_NONE`] elsewhere (3.12+ mark
    /// activations with C-stack shim frames instead; 3.10 runs one frame
    /// per activation).
    pub frame_is_entry: u16,
    /// Low tag bits to clear from the `frame_code` value: `f_executable` is
    /// a tagged `_PyStackRef` from 3.14 on (3 there); 0 before.
    pub code_tag_mask: u64,
}

impl PyOffsets {
    /// `(major, minor)` from [`PyOffsets::version`].
    pub const fn major_minor(&self) -> (u8, u8) {
        ((self.version >> 8) as u8, self.version as u8)
    }
}

/// A [`PyFrame`] with `code == 0` separates the frames of two eval-loop
/// activations (`_PyEval_EvalFrameDefault` calls on the C stack): frames
/// before it (inner) ran in a later activation than frames after it. The
/// BPF walk emits it; userspace uses it to interleave Python and native
/// frames.
pub const PY_BOUNDARY: PyFrame = PyFrame { code: 0, instr: 0 };

/// One Python frame as the walk emits it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyFrame {
    /// `PyCodeObject*` of the frame (tag bits already cleared).
    pub code: u64,
    /// Instruction, as read from the frame, meaning depends on
    /// [`PyOffsets::frame_model`]:
    /// - `PY_FRAME_MODEL_FRAME_OBJECT` (3.10): `f_lasti` sign-extended from
    ///   `i32`, an index in 2-byte code units (-1 = not started);
    /// - `PY_FRAME_MODEL_INTERPRETER_FRAME` (3.11+): the raw address of the
    ///   current instruction; byte offset = `instr - code - code_adaptive`
    ///   (negative = not started).
    pub instr: u64,
}

/// `PyObject.ob_type` (every version, x86-64).
pub const OB_TYPE: u64 = 8;
/// `PyTypeObject.tp_flags` (the stable ABI's layout).
pub const TYPE_TP_FLAGS: u64 = 168;

/// CPython 3.14+: where the parts of an asyncio `TaskObj` that name it
/// are, for BPF to read them with a stack (`TaskEvent`). Offsets from the
/// `_asyncio` module's `.AsyncioDebug` section; all 0: not known yet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskLayout {
    /// `sizeof(TaskObj)` (the first `TASK_OBJ_BYTES` are read).
    pub size: u16,
    /// `TaskObj.task_name` and `TaskObj.task_coro`.
    pub name: u16,
    pub coro: u16,
    /// The coroutine object's embedded frame (`gi_iframe`).
    pub gen_frame: u16,
    /// `TaskObj.task_awaited_by` (the awaiting task, or a set of them) and
    /// `task_awaited_by_is_set`.
    pub awaited_by: u16,
    pub awaited_by_is_set: u16,
    pub _pad: u32,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for PyOffsets {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for PyFrame {}

// The BPF side reads these with fixed sizes; make a layout change loud.
const _: () = assert!(core::mem::size_of::<PyOffsets>() == 32);
const _: () = assert!(core::mem::size_of::<PyFrame>() == 16);
const _: () = assert!(core::mem::size_of::<TaskLayout>() == 16);
