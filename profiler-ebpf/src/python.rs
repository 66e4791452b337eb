//! The Python frame walk and the GIL holder.
//!
//! In: the current thread's `PyThreadState*` (`PY_THREADS`) and its
//! process's interpreter layout (`PY_PROCS`: `PyOffsets` for its CPython
//! version, the GIL's addresses), both written by userspace; for a
//! switch-out in `futex`, the futex address. Out: the `py` frames of a
//! `StackEvent` — (code object, instruction) pairs and activation
//! boundaries, innermost first, with `py_status` — and, for a wait on the
//! GIL while another thread holds it, `gil_holder` and the holder's frames;
//! on CPython 3.14+, the asyncio task running (`task`, and its parts in a
//! `TaskEvent` sent first: `task::emit_task`).
//!
//! Constraints: nothing is resolved here (names and lines are userspace's);
//! every read of interpreter memory can fail and is counted
//! (`PyReadFailed`, `PyTruncated`). The walk is a `bpf_loop` callback over
//! per-CPU scratch so the verifier checks one step, not every frame count.
//! The layout rules are described in `profiler_common::python`.
use aya_ebpf::{
    helpers::{bpf_probe_read_user, generated::bpf_loop},
    macros::map,
    maps::PerCpuArray,
};
use profiler_common::{
    Drop, GIL_STRUCT_SPAN, PY_HOLDER_FRAMES, StackEvent, py_status,
    python::{
        PY_BOUNDARY, PY_FRAME_MODEL_FRAME_OBJECT, PY_MAX_FRAMES, PY_OFFSET_NONE, PyFrame, PyOffsets,
    },
};

use crate::maps::{PY_PROCS, PY_THREADS, count};

/// A `u64` of target memory; `None` when the read fails.
#[inline(always)]
pub(crate) fn read_u64(addr: u64) -> Option<u64> {
    unsafe { bpf_probe_read_user(addr as *const u64) }.ok()
}

/// Python walk scratch, per CPU: slot 0 = the thread's own walk, slot 1 =
/// the GIL holder's. The walk runs in a `bpf_loop` callback (verified once,
/// however many frames). Its state lives here, in map memory, rather than
/// on the stack: the verifier then sees unknown scalars each step and
/// converges, instead of exploring every value of the frame counter.
#[repr(C)]
#[derive(Clone, Copy)]
struct PyScratch {
    frames: [PyFrame; PY_MAX_FRAMES],
    o: PyOffsets,
    p: u64,
    n: u32,
    max: u32,
    status: u32,
    /// Bytes of each frame the walk reads ([`frame_span`]).
    span: u32,
    /// The current frame's first `span` bytes, read at once; the slack
    /// past [`FRAME_WINDOW`] lets a field be read at any masked offset.
    frame: [u8; FRAME_WINDOW + 8],
}

/// Most bytes of a frame read in one go: every version's fields end by
/// byte 100 (3.10's `f_lasti`; 3.11+ by 72).
const FRAME_WINDOW: usize = 128;

/// The bytes of a frame that hold every field the walk uses, from its
/// start: one read per frame instead of one per field (each
/// `bpf_probe_read_user` costs about as much for 128 bytes as for 1).
/// Never past the last field, so the read stays inside the frame's own
/// struct whatever follows it. 0 when a field ends past [`FRAME_WINDOW`]
/// (a layout no CPython has): then each field is read on its own.
#[inline(always)]
fn frame_span(o: &PyOffsets) -> u32 {
    let end = |off: u16, size: u32| {
        if off == PY_OFFSET_NONE {
            0
        } else {
            u32::from(off) + size
        }
    };
    let instr = if instr_is_int(o) { 4 } else { 8 };
    let span = end(o.frame_code, 8)
        .max(end(o.frame_previous, 8))
        .max(end(o.frame_instr, instr))
        .max(end(o.frame_owner, 1))
        .max(end(o.frame_is_entry, 1));
    if span as usize > FRAME_WINDOW {
        0
    } else {
        span
    }
}

/// Whether the frame's instruction is an `int` (3.10's `f_lasti`, a
/// 4-byte `frame_instr`) rather than a pointer.
#[inline(always)]
fn instr_is_int(o: &PyOffsets) -> bool {
    o.frame_model == PY_FRAME_MODEL_FRAME_OBJECT || o.frame_instr_size == 4
}

/// A field of the frame at `p`: from the window read by [`walk_step`], or
/// from the target when the layout does not fit one.
#[inline(always)]
fn field<T: Copy>(w: &PyScratch, p: u64, off: u16) -> Option<T> {
    if w.span == 0 {
        return unsafe { bpf_probe_read_user((p + off as u64) as *const T) }.ok();
    }
    let i = off as usize & (FRAME_WINDOW - 1);
    Some(unsafe { core::ptr::read_unaligned(w.frame.as_ptr().add(i).cast::<T>()) })
}

#[map]
static PY_SCRATCH: PerCpuArray<PyScratch> = PerCpuArray::with_max_entries(2, 0);

/// Store one frame at the walk's next slot. The slot index is re-read
/// volatile and masked, so the compiler cannot drop the mask on the
/// strength of an earlier comparison the verifier does not connect to it.
#[inline(always)]
fn push_frame(w: &mut PyScratch, code: u64, instr: u64) {
    let n = unsafe { core::ptr::read_volatile(&w.n) };
    let i = n as usize & (PY_MAX_FRAMES - 1);
    w.frames[i].code = code;
    w.frames[i].instr = instr;
    w.n = n + 1;
}

/// One step of the walk described in `profiler_common::python`; `ctx`
/// points at the scratch slot number. Returns 1 to stop the loop.
extern "C" fn walk_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let slot = unsafe { *(ctx as *const u32) };
    let Some(w) = PY_SCRATCH.get_ptr_mut(slot) else {
        return 1;
    };
    let w = unsafe { &mut *w };
    let p = w.p;
    if p == 0 {
        w.status = py_status::COMPLETE;
        return 1;
    }
    if w.n >= w.max || w.n as usize >= PY_MAX_FRAMES {
        w.status = py_status::TRUNCATED;
        return 1;
    }
    let o = w.o;
    // The frame's fields in one read (see `frame_span`); the length is
    // re-read volatile and masked so the verifier bounds it.
    let span = unsafe { core::ptr::read_volatile(&w.span) } as usize & (2 * FRAME_WINDOW - 1);
    if span != 0 {
        let len = span.min(FRAME_WINDOW);
        let r = unsafe {
            aya_ebpf::helpers::generated::bpf_probe_read_user(
                w.frame.as_mut_ptr().cast(),
                len as u32,
                p as *const core::ffi::c_void,
            )
        };
        if r != 0 {
            w.status = py_status::READ_FAILED;
            return 1;
        }
    }
    let shim = o.frame_owner != PY_OFFSET_NONE
        && field::<u8>(w, p, o.frame_owner).unwrap_or(0) as u16 >= o.owner_shim_min;
    if shim {
        // 3.12+: a C-stack shim sits below each eval-loop activation
        // (3.15: also the thread's base frame, at the very bottom).
        push_frame(w, PY_BOUNDARY.code, PY_BOUNDARY.instr);
    } else {
        let Some(code) = field::<u64>(w, p, o.frame_code) else {
            w.status = py_status::READ_FAILED;
            return 1;
        };
        let instr = if instr_is_int(&o) {
            field::<i32>(w, p, o.frame_instr).unwrap_or(-1) as i64 as u64
        } else {
            field::<u64>(w, p, o.frame_instr).unwrap_or(0)
        };
        push_frame(w, code & !o.code_tag_mask, instr);
        // 3.10 runs one frame per activation; in 3.11 the first frame of
        // an activation carries is_entry.
        let entry = o.frame_model == PY_FRAME_MODEL_FRAME_OBJECT
            || (o.frame_is_entry != PY_OFFSET_NONE
                && field::<u8>(w, p, o.frame_is_entry).unwrap_or(0) != 0);
        if entry && w.n < w.max && (w.n as usize) < PY_MAX_FRAMES {
            push_frame(w, PY_BOUNDARY.code, PY_BOUNDARY.instr);
        }
    }
    match field::<u64>(w, p, o.frame_previous) {
        Some(prev) => {
            w.p = prev;
            0
        }
        None => {
            w.status = py_status::READ_FAILED;
            1
        }
    }
}

/// Walk `tstate`'s frames into scratch `slot`, at most `max` frames.
/// Returns (frames, `py_status`).
#[inline(always)]
fn walk_python(o: &PyOffsets, tstate: u64, slot: u32, max: u32) -> (u32, u32) {
    let Some(mut p) = read_u64(tstate + o.tstate_frame as u64) else {
        return (0, py_status::READ_FAILED);
    };
    if o.cframe_current_frame != PY_OFFSET_NONE && p != 0 {
        match read_u64(p + o.cframe_current_frame as u64) {
            Some(f) => p = f,
            None => return (0, py_status::READ_FAILED),
        }
    }
    let Some(w) = PY_SCRATCH.get_ptr_mut(slot) else {
        return (0, py_status::READ_FAILED);
    };
    unsafe {
        (*w).o = *o;
        (*w).p = p;
        (*w).n = 0;
        (*w).max = max;
        (*w).status = py_status::TRUNCATED;
        (*w).span = frame_span(o);
    }
    let mut ctx: u32 = slot;
    // Boundaries take slots too; the step budget allows for them.
    unsafe {
        bpf_loop(
            (2 * PY_MAX_FRAMES) as u32,
            walk_step as *mut _,
            (&mut ctx as *mut u32).cast(),
            0,
        );
        ((*w).n, (*w).status)
    }
}

/// Copy scratch `slot` into `dst` (a frames array inside the ring-buffer event).
#[inline(always)]
fn copy_scratch(slot: u32, dst: *mut PyFrame, frames: usize) {
    if let Some(buf) = PY_SCRATCH.get_ptr(slot) {
        unsafe {
            let _ = aya_ebpf::helpers::generated::bpf_probe_read_kernel(
                dst.cast(),
                (frames * size_of::<PyFrame>()) as u32,
                (&(*buf).frames as *const PyFrame).cast(),
            );
        }
    }
}

/// Fill the Python parts of a stack event: the thread's own frames and, for
/// a switch-out into a wait for the GIL, the holder and its frames.
#[inline(always)]
pub(crate) fn fill_python(
    ev: *mut StackEvent,
    tid: u32,
    tgid: u32,
    futex_addr: u64,
    switch_out: bool,
) {
    let Some(tstate) = (unsafe { PY_THREADS.get(&tid) }).copied() else {
        return;
    };
    let Some(proc_) = (unsafe { PY_PROCS.get(&tgid) }) else {
        return;
    };
    let o = &proc_.offsets;
    if proc_.running_task != 0 {
        // The task running now, not when userspace gets to read it.
        let task = read_u64(tstate + proc_.running_task).unwrap_or(0);
        unsafe { (*ev).task = task };
        if task != 0 {
            crate::task::emit_task(task, tid, tgid, proc_, switch_out as u32);
        }
    }
    let (n, status) = walk_python(o, tstate, 0, PY_MAX_FRAMES as u32);
    copy_scratch(0, unsafe { (*ev).py.as_mut_ptr() }, PY_MAX_FRAMES);
    unsafe {
        (*ev).py_len = n;
        (*ev).py_status = status;
    }
    match status {
        py_status::READ_FAILED => count(Drop::PyReadFailed),
        py_status::TRUNCATED => count(Drop::PyTruncated),
        _ => {}
    }
    if futex_addr == 0 || proc_.gil_locked == 0 {
        return;
    }
    // Waiting on the GIL's mutex or condition variable while another thread holds it.
    if futex_addr < proc_.gil_locked || futex_addr >= proc_.gil_locked + GIL_STRUCT_SPAN {
        return;
    }
    let locked = unsafe { bpf_probe_read_user(proc_.gil_locked as *const i32) }.unwrap_or(0);
    let Some(holder) = read_u64(proc_.gil_last_holder) else {
        return;
    };
    if locked == 0 || holder == 0 || holder == tstate {
        return;
    }
    let (hn, _) = walk_python(o, holder, 1, PY_HOLDER_FRAMES as u32);
    copy_scratch(1, unsafe { (*ev).holder_py.as_mut_ptr() }, PY_HOLDER_FRAMES);
    unsafe {
        (*ev).gil_holder = holder;
        (*ev).holder_py_len = hn;
    }
}
