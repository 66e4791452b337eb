//! The asyncio task a stack was captured in, read with it (CPython 3.14+).
//!
//! In: the task object (`asyncio_running_task`, read by `python::fill_python`
//! with the stack) and its process's `TaskLayout` (`PyProc::task`, set by
//! userspace from the `_asyncio` module's debug offsets). Out: a
//! `TaskEvent` in the ring buffer, just before the stack event: the
//! running task's coroutine frame fields, then for it and up to
//! `TASK_CHAIN - 1` tasks awaiting it (one awaiter each, not a set) the
//! task object's bytes, its name object's and the name type's flags, each
//! with its address.
//!
//! Why in the kernel: userspace reads a stack event some milliseconds after
//! it was captured; a task that finished meanwhile (`await
//! create_task(...)` of a short block), or the task awaiting it, is freed
//! by then and its memory reused, so the read is refused or the chain cut.
//! These bytes are the tasks as they were with the stack. Nothing is
//! parsed here.
//!
//! Constraints: at most `TASK_CHAIN` tasks of five or six reads each, plus
//! two for the frame; each read can fail and is counted
//! (`TaskSnapshotFailed`). The event is built in a per-CPU slot (larger
//! than the BPF stack), one slot per kind of caller as for
//! `STACK_SCRATCH`, and sent cut after its valid parts.
use aya_ebpf::{
    helpers::{bpf_probe_read_user, generated::bpf_probe_read_user as read_user_raw},
    macros::map,
    maps::PerCpuArray,
};
use profiler_common::{
    Drop, PyProc, TASK_CHAIN, TASK_NAME_BYTES, TASK_OBJ_BYTES, TaskEvent, TaskPart, kind,
    python::{OB_TYPE, TYPE_TP_FLAGS, TaskLayout},
};

use crate::{
    maps::{EVENTS, count, header, wakeup_flags},
    python::read_u64,
};

/// Build slots: 0 for a sample (CPU-clock interrupt), 1 for a switch-out
/// (scheduler, interrupts off).
#[map]
static TASK_SCRATCH: PerCpuArray<TaskEvent> = PerCpuArray::with_max_entries(2, 0);

/// Read `len` bytes at `src` into `dst`; true on success.
#[inline(always)]
fn read_into(dst: *mut u8, len: u32, src: u64) -> bool {
    unsafe { read_user_raw(dst.cast(), len, src as *const _) == 0 }
}

/// Fill `p` with task `task`; returns the task awaiting it when that is
/// one task (0: none, a set, or unreadable), and whether a read failed.
#[inline(always)]
fn read_part(p: &mut TaskPart, task: u64, l: &TaskLayout) -> (u64, bool) {
    let mut failed = false;
    p.task = task;
    // The object: its whole size, at most TASK_OBJ_BYTES (the bound is
    // for the verifier).
    let n = if l.size as usize >= TASK_OBJ_BYTES {
        TASK_OBJ_BYTES as u32
    } else {
        l.size as u32 & (TASK_OBJ_BYTES as u32 - 1)
    };
    p.task_len = if read_into(p.task_bytes.as_mut_ptr(), n, task) {
        n
    } else {
        failed = true;
        0
    };
    // The name: a str (header and characters) or the counter int 3.12+
    // keep until the name is asked for. A read near the end of a mapping
    // fails whole: then a shorter one.
    p.name = read_u64(task + l.name as u64).unwrap_or(0);
    p.name_len = 0;
    if p.name != 0 {
        for len in [TASK_NAME_BYTES as u32, 64, 48] {
            if read_into(p.name_bytes.as_mut_ptr(), len, p.name) {
                p.name_len = len;
                break;
            }
        }
    }
    let ty = if p.name_len != 0 {
        read_u64(p.name + OB_TYPE).unwrap_or(0)
    } else {
        0
    };
    p.name_flags_at = 0;
    if ty != 0
        && let Some(f) = read_u64(ty + TYPE_TP_FLAGS)
    {
        p.name_flags_at = ty + TYPE_TP_FLAGS;
        p.name_flags = f;
    } else {
        failed = true;
    }
    let by = read_u64(task + l.awaited_by as u64).unwrap_or(0);
    let is_set = unsafe { bpf_probe_read_user((task + l.awaited_by_is_set as u64) as *const u8) }
        .unwrap_or(1);
    (if is_set == 0 { by } else { 0 }, failed)
}

/// Send the `TaskEvent` of `task`, running on `tid` of `tgid` with the stack
/// being captured (`slot`: 1 for a switch-out, 0 for a sample).
#[inline(always)]
pub(crate) fn emit_task(task: u64, tid: u32, tgid: u32, proc_: &PyProc, slot: u32) {
    let l = proc_.task;
    if l.size == 0 {
        return; // the layout is not known yet
    }
    let Some(ev) = TASK_SCRATCH.get_ptr_mut(slot) else {
        count(Drop::TaskSnapshotFailed);
        return;
    };
    let ev = unsafe { &mut *ev };
    ev.hdr = header(kind::TASK, tid, tgid);
    // The running task's coroutine frame, embedded in the coroutine object.
    let o = &proc_.offsets;
    let mut failed = false;
    let frame = read_u64(task + l.coro as u64).unwrap_or(0) + l.gen_frame as u64;
    ev.code_at = frame + o.frame_code as u64;
    ev.instr_at = frame + o.frame_instr as u64;
    match (read_u64(ev.code_at), read_u64(ev.instr_at)) {
        (Some(c), Some(i)) if frame != l.gen_frame as u64 => {
            ev.code = c;
            ev.instr = i;
        }
        _ => {
            ev.code_at = 0;
            ev.instr_at = 0;
            failed = true;
        }
    }
    // The task, then the tasks awaiting it (unrolled: TASK_CHAIN is small).
    let mut next = task;
    let mut n = 0usize;
    for i in 0..TASK_CHAIN {
        if next == 0 {
            break;
        }
        let (by, part_failed) = read_part(&mut ev.parts[i], next, &l);
        failed |= part_failed;
        n = i + 1;
        next = if by == task { 0 } else { by };
    }
    ev.parts_len = n as u32;
    if failed {
        count(Drop::TaskSnapshotFailed);
    }
    // Cut after the valid parts (the bound is for the verifier).
    let len = PARTS_AT + n.min(TASK_CHAIN) * size_of::<TaskPart>();
    // SAFETY: `ev` is a map value of size_of::<TaskEvent>() >= len bytes.
    let bytes = unsafe { core::slice::from_raw_parts((ev as *const TaskEvent).cast::<u8>(), len) };
    if EVENTS.output::<[u8]>(bytes, wakeup_flags()).is_err() {
        count(Drop::RingbufFull);
    }
}

/// Offset of the tasks: every byte before it is always sent.
const PARTS_AT: usize = core::mem::offset_of!(TaskEvent, parts);
