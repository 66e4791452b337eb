//! stallprof's kernel side: thin probe shims that capture and filter, nothing more.
//!
//! In: scheduler tracepoints, wait-syscall tracepoints and a CPU-clock perf
//! event. Out: typed records (`profiler_common`) in the `EVENTS` ring buffer,
//! and failure counters in `STATS`.
//!
//! Constraints: O(1) work per event except the bounded stack copies; no
//! decisions beyond "is this a thread of the target, and is it parked?". What
//! counts as a stall, attribution and symbolization all happen in userspace.
//! Every failure increments a named counter (`profiler_common::Drop`).
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext, Global,
    bindings::{BPF_F_USER_STACK, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_probe_read_user,
        generated::{
            bpf_get_current_task_btf, bpf_get_stack, bpf_loop,
            bpf_probe_read_user as read_user_raw, bpf_task_pt_regs,
        },
    },
    macros::{map, perf_event, tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::{PerfEventContext, ProbeContext, RetProbeContext, TracePointContext},
};
use profiler_common::{
    Drop, EventHeader, Filtered, GIL_STRUCT_SPAN, MAX_KSTACK, MAX_PY_PROCS, MAX_THREADS,
    MAX_USTACK, PY_HOLDER_FRAMES, PyProc, RINGBUF_BYTES, RINGBUF_WAKEUP_BYTES, SchedEvent,
    StackEvent, TASK_REPORT_MAX, ThreadState, USER_STACK_COPY, UserRegs, WaitEvent, kind,
    py_status,
    python::{
        PY_BOUNDARY, PY_FRAME_MODEL_FRAME_OBJECT, PY_MAX_FRAMES, PY_OFFSET_NONE, PyFrame, PyOffsets,
    },
    sysno, wait_key,
};

/// Process to watch; 0 = every process (daemon mode). Set at load.
#[unsafe(no_mangle)]
static TARGET_TGID: Global<u32> = Global::new(0);

/// The sampling gate, in ns (set at load; 0 = off). For a thread whose loop
/// wait is known: CPU samples in the first `SAMPLE_AFTER_NS` of a busy period
/// are skipped, and a busy period that ends before it with nothing else to
/// report is not reported at all (its wait return is held back until the
/// thread's next event). Under load an event loop runs thousands of busy
/// periods of microseconds each; none can be a stall, and this keeps them
/// from costing a stack copy or a ring-buffer record.
#[unsafe(no_mangle)]
static SAMPLE_AFTER_NS: Global<u64> = Global::new(0);

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(RINGBUF_BYTES, 0);

/// Threads of the target seen in a wait syscall: the executor candidates.
#[map]
static THREADS: HashMap<u32, ThreadState> = HashMap::with_max_entries(MAX_THREADS, 0);

/// tid -> wait key of the thread's event-loop wait, published by userspace
/// once it has seen which wait the loop returns to.
#[map]
static LOOP_KEYS: HashMap<u32, u64> = HashMap::with_max_entries(MAX_THREADS, 0);

/// Publication generation of `LOOP_KEYS`: userspace bumps slot 0 after every
/// change, so a thread's cached key (`ThreadState::loop_key`) is re-read
/// only then.
#[map]
static LOOP_GEN: Array<u64> = Array::with_max_entries(1, 0);

/// tgid -> how to walk that process's Python stacks (set by userspace).
#[map]
static PY_PROCS: HashMap<u32, PyProc> = HashMap::with_max_entries(MAX_PY_PROCS, 0);

/// tid -> `PyThreadState*` of that thread (kept current by userspace).
#[map]
static PY_THREADS: HashMap<u32, u64> = HashMap::with_max_entries(MAX_THREADS, 0);

/// Failure counters, indexed by `profiler_common::Drop`.
#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Drop::COUNT, 0);

/// Work saved by the sampling gate, indexed by `profiler_common::Filtered`.
#[map]
static FILTERED: PerCpuArray<u64> = PerCpuArray::with_max_entries(Filtered::COUNT, 0);

#[inline(always)]
fn bump(counters: &PerCpuArray<u64>, index: u32) {
    if let Some(p) = counters.get_ptr_mut(index) {
        unsafe { *p += 1 };
    }
}

#[inline(always)]
fn count(what: Drop) {
    bump(&STATS, what as u32);
}

#[inline(always)]
fn note(what: Filtered) {
    bump(&FILTERED, what as u32);
}

#[inline(always)]
fn is_target(tgid: u32) -> bool {
    let t = TARGET_TGID.load();
    t == 0 || t == tgid
}

#[inline(always)]
fn header(kind: u32, tid: u32, tgid: u32) -> EventHeader {
    EventHeader {
        kind,
        tid,
        tgid,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: unsafe { bpf_ktime_get_ns() },
    }
}

/// The published loop key of `tid` (0: none yet), from the thread's cache
/// unless `LOOP_GEN` moved since it was filled.
#[inline(always)]
fn loop_key(tid: u32, st: &mut ThreadState) -> u64 {
    let generation = LOOP_GEN.get(0).copied().unwrap_or(0);
    if st.loop_gen != generation {
        st.loop_key = unsafe { LOOP_KEYS.get(&tid) }.copied().unwrap_or(0);
        st.loop_gen = generation;
    }
    st.loop_key
}

/// Parked = inside the loop's own wait (or inside any wait while the loop's
/// key is not yet known). Parked threads are idle, so we stay quiet.
#[inline(always)]
fn parked(tid: u32, st: &mut ThreadState) -> bool {
    if st.in_park != 0 {
        return true;
    }
    if st.wait_key == 0 {
        return false;
    }
    match loop_key(tid, st) {
        0 => true,
        k => k == st.wait_key,
    }
}

/// Submit flags: wake the reader only once a batch has built up (see
/// `RINGBUF_WAKEUP_BYTES`).
#[inline(always)]
fn wakeup_flags() -> u64 {
    if EVENTS.query(BPF_RB_AVAIL_DATA as u64) >= RINGBUF_WAKEUP_BYTES {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}

/// True when `key` is the published loop wait of `tid`.
#[inline(always)]
fn is_loop_key(tid: u32, st: &mut ThreadState, key: u64) -> bool {
    loop_key(tid, st) == key
}

/// Hold back the return from the loop's wait (see `SAMPLE_AFTER_NS`).
/// Returns false when the gate is off: report it now.
#[inline(always)]
fn defer_exit(st: &mut ThreadState, now: u64, nr: u32, fd: i32, ret: i64) -> bool {
    st.busy_since = now;
    if SAMPLE_AFTER_NS.load() == 0 {
        return false;
    }
    st.exit_pending = 1;
    st.exit_nr = nr;
    st.exit_fd = fd;
    st.exit_ret = ret;
    true
}

/// The thread is back in its loop's wait: true when the busy period that
/// ends here was quiet and shorter than the gate, so neither end of it is
/// reported.
#[inline(always)]
fn quiet_busy(tid: u32, st: &mut ThreadState, key: u64) -> bool {
    if st.exit_pending == 0 || !is_loop_key(tid, st, key) {
        return false;
    }
    let age = unsafe { bpf_ktime_get_ns() }.wrapping_sub(st.busy_since);
    if age >= SAMPLE_AFTER_NS.load() {
        return false;
    }
    st.exit_pending = 0;
    note(Filtered::QuietBusy);
    true
}

/// Report a held-back wait return before any other event of the thread, so
/// userspace sees the busy period open at its true start.
#[inline(always)]
fn flush_exit(tid: u32, tgid: u32, st: &mut ThreadState) {
    if st.exit_pending == 0 {
        return;
    }
    st.exit_pending = 0;
    let mut hdr = header(kind::WAIT_EXIT, tid, tgid);
    hdr.ts_ns = st.busy_since;
    emit(WaitEvent {
        hdr,
        nr: st.exit_nr,
        fd: st.exit_fd,
        ret: st.exit_ret,
    });
}

#[inline(always)]
fn new_thread(tgid: u32, wait_key: u64, in_park: u32) -> ThreadState {
    ThreadState {
        wait_key,
        tgid,
        off_reported: 0,
        in_park,
        exit_pending: 0,
        busy_since: 0,
        exit_nr: 0,
        exit_fd: 0,
        exit_ret: 0,
        loop_key: 0,
        loop_gen: u64::MAX, // never a real generation: read LOOP_KEYS first
    }
}

#[inline(always)]
fn emit<T: 'static>(ev: T) {
    match EVENTS.reserve::<T>(0) {
        Some(mut slot) => {
            slot.write(ev);
            slot.submit(wakeup_flags());
        }
        None => count(Drop::RingbufFull),
    }
}

// ---- wait syscalls: park and unpark ------------------------------------

/// A thread enters a wait that may be its loop's: `fd` names the wait
/// (the epoll fd, a poll set's first fd, select's nfds).
#[inline(always)]
fn on_wait_enter(nr: u32, fd: i32) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !is_target(tgid) {
        return 0;
    }
    let key = wait_key(nr, fd);
    match THREADS.get_ptr_mut(&tid) {
        Some(st) => {
            let st = unsafe { &mut *st };
            if st.in_park != 0 {
                return 0; // the runtime's own wait inside its park function
            }
            st.wait_key = key;
            if quiet_busy(tid, st, key) {
                return 0;
            }
            flush_exit(tid, tgid, st);
        }
        None => {
            if THREADS.insert(&tid, &new_thread(tgid, key, 0), 0).is_err() {
                count(Drop::ThreadTableFull);
            }
        }
    }
    emit(WaitEvent {
        hdr: header(kind::WAIT_ENTER, tid, tgid),
        nr,
        fd,
        ret: 0,
    });
    0
}

/// A thread returns from a wait `on_wait_enter` saw.
#[inline(always)]
fn on_wait_exit(nr: u32, ret: i64) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !is_target(tgid) {
        return 0;
    }
    let Some(st) = THREADS.get_ptr_mut(&tid) else {
        return 0;
    };
    let st = unsafe { &mut *st };
    let key = st.wait_key;
    if key == 0 {
        return 0; // a sleep (see sp_wait_enter), or entered before attach
    }
    st.wait_key = 0;
    if is_loop_key(tid, st, key) {
        if defer_exit(
            st,
            unsafe { bpf_ktime_get_ns() },
            nr,
            key as u32 as i32,
            ret,
        ) {
            return 0;
        }
    } else {
        flush_exit(tid, tgid, st);
    }
    emit(WaitEvent {
        hdr: header(kind::WAIT_EXIT, tid, tgid),
        nr,
        fd: key as u32 as i32,
        ret,
    });
    0
}

/// The first fd of a poll set; None for `poll(NULL, 0, t)`, a sleep.
#[inline(always)]
fn poll_fd(fds: u64, nfds: u64) -> Option<i32> {
    if nfds == 0 {
        return None;
    }
    // struct pollfd { int fd; ... }: the first watched fd names the wait.
    Some(unsafe { bpf_probe_read_user(fds as *const i32) }.unwrap_or(-1))
}

/// A field of a tracepoint record, read straight from the context: the
/// verifier allows aligned loads from a tracepoint's record, and unlike
/// `read_at` (a `bpf_probe_read_kernel` call, fault handling included) this
/// is one load — it matters on paths that run at every context switch.
#[inline(always)]
fn tp_field<T: Copy>(ctx: &TracePointContext, offset: usize) -> T {
    unsafe { core::ptr::read((ctx.as_ptr() as *const u8).add(offset) as *const T) }
}

/// `syscalls:sys_enter_{epoll_wait,epoll_pwait,epoll_pwait2,poll,ppoll,select,pselect6}`.
#[tracepoint]
pub fn sp_wait_enter(ctx: TracePointContext) -> u32 {
    if !is_target((bpf_get_current_pid_tgid() >> 32) as u32) {
        return 0;
    }
    // Common syscall tracepoint layout: __syscall_nr at 8, args from 16.
    let nr = tp_field::<i32>(&ctx, 8) as u32;
    let arg0 = tp_field::<u64>(&ctx, 16);
    let fd = if sysno::is_epoll(nr) {
        arg0 as i32
    } else if nr == sysno::POLL || nr == sysno::PPOLL {
        let nfds = tp_field::<u64>(&ctx, 24);
        match poll_fd(arg0, nfds) {
            Some(fd) => fd,
            None => return 0,
        }
    } else {
        // select(0, NULL, NULL, NULL, &t) is a sleep (CPython 3.10's time.sleep).
        if arg0 == 0 {
            return 0;
        }
        arg0 as i32 // nfds
    };
    on_wait_enter(nr, fd)
}

/// `syscalls:sys_exit_*` for the same wait syscalls.
#[tracepoint]
pub fn sp_wait_exit(ctx: TracePointContext) -> u32 {
    let nr = tp_field::<i32>(&ctx, 8) as u32;
    let ret = tp_field::<i64>(&ctx, 16);
    on_wait_exit(nr, ret)
}

// ---- Python frames ------------------------------------------------------

#[inline(always)]
fn read_u64(addr: u64) -> Option<u64> {
    unsafe { bpf_probe_read_user(addr as *const u64) }.ok()
}

/// Python walk scratch, per CPU: slot 0 = the thread's own walk, slot 1 =
/// the GIL holder's. The walk runs in a `bpf_loop` callback (verified once,
/// however many frames). Its state lives here, in map memory, rather than
/// on the stack: the verifier then sees unknown scalars each step and
/// converges, instead of exploring every value of the frame counter.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PyScratch {
    frames: [PyFrame; PY_MAX_FRAMES],
    o: PyOffsets,
    p: u64,
    n: u32,
    max: u32,
    status: u32,
    _pad: u32,
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
    let shim = o.frame_owner != PY_OFFSET_NONE
        && unsafe { bpf_probe_read_user((p + o.frame_owner as u64) as *const u8) }.unwrap_or(0)
            as u16
            == o.owner_cstack;
    if shim {
        // 3.12+: a C-stack shim sits below each eval-loop activation.
        push_frame(w, PY_BOUNDARY.code, PY_BOUNDARY.instr);
    } else {
        let Some(code) = read_u64(p + o.frame_code as u64) else {
            w.status = py_status::READ_FAILED;
            return 1;
        };
        let instr = if o.frame_model == PY_FRAME_MODEL_FRAME_OBJECT || o.frame_instr_size == 4 {
            unsafe { bpf_probe_read_user((p + o.frame_instr as u64) as *const i32) }.unwrap_or(-1)
                as i64 as u64
        } else {
            read_u64(p + o.frame_instr as u64).unwrap_or(0)
        };
        push_frame(w, code & !o.code_tag_mask, instr);
        // 3.10 runs one frame per activation; in 3.11 the first frame of
        // an activation carries is_entry.
        let entry = o.frame_model == PY_FRAME_MODEL_FRAME_OBJECT
            || (o.frame_is_entry != PY_OFFSET_NONE
                && unsafe { bpf_probe_read_user((p + o.frame_is_entry as u64) as *const u8) }
                    .unwrap_or(0)
                    != 0);
        if entry && w.n < w.max && (w.n as usize) < PY_MAX_FRAMES {
            push_frame(w, PY_BOUNDARY.code, PY_BOUNDARY.instr);
        }
    }
    match read_u64(p + o.frame_previous as u64) {
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
fn fill_python(ev: *mut StackEvent, tid: u32, tgid: u32, futex_addr: u64) {
    let Some(tstate) = (unsafe { PY_THREADS.get(&tid) }).copied() else {
        return;
    };
    let Some(proc_) = (unsafe { PY_PROCS.get(&tgid) }) else {
        return;
    };
    let o = &proc_.offsets;
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

/// Entry to / return from a runtime's park function (tokio's scheduler
/// `park_internal`): reported as a wait with `sysno::RUNTIME_PARK`.
#[inline(always)]
fn runtime_park(enter: bool) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !is_target(tgid) {
        return 0;
    }
    let key = wait_key(sysno::RUNTIME_PARK, 0);
    match THREADS.get_ptr_mut(&tid) {
        Some(st) => {
            let st = unsafe { &mut *st };
            st.in_park = enter as u32;
            if enter {
                if quiet_busy(tid, st, key) {
                    return 0;
                }
                flush_exit(tid, tgid, st);
            } else if is_loop_key(tid, st, key)
                && defer_exit(st, unsafe { bpf_ktime_get_ns() }, sysno::RUNTIME_PARK, 0, 0)
            {
                return 0;
            }
        }
        None => {
            if THREADS
                .insert(&tid, &new_thread(tgid, 0, enter as u32), 0)
                .is_err()
            {
                count(Drop::ThreadTableFull);
            }
        }
    }
    let kind = if enter {
        kind::WAIT_ENTER
    } else {
        kind::WAIT_EXIT
    };
    emit(WaitEvent {
        hdr: header(kind, tid, tgid),
        nr: sysno::RUNTIME_PARK,
        fd: 0,
        ret: 0,
    });
    0
}

#[uprobe]
pub fn sp_park_enter(_ctx: ProbeContext) -> u32 {
    runtime_park(true)
}

#[uretprobe]
pub fn sp_park_exit(_ctx: RetProbeContext) -> u32 {
    runtime_park(false)
}

// ---- scheduler ----------------------------------------------------------

/// Fill the stacks of a reserved `StackEvent` in place (it is too large for
/// the BPF stack): kernel and frame-pointer user stacks from
/// `bpf_get_stack`, plus user registers and a copy of the user stack for
/// unwinding in userspace.
#[inline(always)]
fn fill_stacks<C: EbpfContext>(ctx: &C, ev: *mut StackEvent, kernel_expected: bool) {
    unsafe {
        let k = bpf_get_stack(
            ctx.as_ptr(),
            (*ev).kstack.as_mut_ptr().cast(),
            (MAX_KSTACK * 8) as u32,
            0,
        );
        (*ev).kstack_len = if k > 0 {
            (k as u32) / 8
        } else {
            // A sample taken in user mode has no kernel stack: not a failure.
            if kernel_expected {
                count(Drop::KstackFailed);
            }
            0
        };
        let u = bpf_get_stack(
            ctx.as_ptr(),
            (*ev).ustack.as_mut_ptr().cast(),
            (MAX_USTACK * 8) as u32,
            BPF_F_USER_STACK as u64,
        );
        (*ev).ustack_len = if u > 0 {
            (u as u32) / 8
        } else {
            count(Drop::UstackFailed);
            0
        };
        if (*ev).ustack_len as usize == MAX_USTACK {
            count(Drop::UstackTruncated);
        }
        (*ev).py_len = 0;
        (*ev).py_status = 0;
        copy_user_stack(ev);
    }
}

/// Copy the user stack window starting at the user stack pointer. The read
/// fails as a whole if it runs past the top of the stack mapping, and that
/// top is page-aligned: so try windows that end on successive page
/// boundaries above `sp`, the largest (up to `USER_STACK_COPY`) first. The
/// first that succeeds reaches either the full size or the very top of the
/// stack — a main thread near its top (Node's `uv_run` is a few KiB below
/// it) keeps every frame, where halving the window used to drop up to half.
#[inline(always)]
unsafe fn copy_user_stack(ev: *mut StackEvent) {
    const PAGE: u64 = 4096;
    const PAGES: u64 = USER_STACK_COPY as u64 / PAGE;
    unsafe {
        (*ev).stack_len = 0;
        let sp = (*ev).regs.sp;
        if sp == 0 {
            count(Drop::StackCopyFailed);
            return;
        }
        let dst = (*ev).stack.as_mut_ptr().cast();
        let src = sp as *const core::ffi::c_void;
        // Bytes from sp to the next page boundary: 1..=PAGE.
        let head = PAGE - (sp & (PAGE - 1));
        macro_rules! attempt {
            ($pages:expr) => {
                // head + (pages - 1) pages: at most USER_STACK_COPY.
                let n = (head + ($pages - 1) * PAGE) as u32;
                if n as usize <= USER_STACK_COPY && read_user_raw(dst, n, src) == 0 {
                    (*ev).stack_len = n;
                    return;
                }
            };
        }
        attempt!(PAGES);
        attempt!(PAGES - 1);
        attempt!(PAGES - 2);
        attempt!(PAGES - 3);
        attempt!(PAGES - 4);
        attempt!(PAGES - 5);
        attempt!(PAGES - 6);
        attempt!(PAGES - 7);
        count(Drop::StackCopyFailed);
    }
}

/// User registers of the current task (saved at kernel entry), the
/// syscall it is in (`orig_ax`, -1 outside a syscall) and that syscall's
/// first argument (`di`).
#[inline(always)]
fn user_regs() -> (UserRegs, i64, u64) {
    // x86-64 `struct pt_regs` offsets.
    const BP: usize = 4 * 8;
    const DI: usize = 14 * 8;
    const ORIG_AX: usize = 15 * 8;
    const IP: usize = 16 * 8;
    const SP: usize = 19 * 8;
    unsafe {
        let task = bpf_get_current_task_btf();
        let regs = bpf_task_pt_regs(task) as usize;
        if regs == 0 {
            count(Drop::SyscallUnknown);
            return (UserRegs::default(), -1, 0);
        }
        let rd = |off: usize| bpf_probe_read_kernel((regs + off) as *const u64).unwrap_or(0);
        let r = UserRegs {
            ip: rd(IP),
            sp: rd(SP),
            bp: rd(BP),
        };
        (r, rd(ORIG_AX) as i64, rd(DI))
    }
}

#[inline(always)]
fn emit_stack_event<C: EbpfContext>(ctx: &C, kind: u32, tid: u32, tgid: u32, state: i64) {
    let Some(mut slot) = EVENTS.reserve::<StackEvent>(0) else {
        count(Drop::RingbufFull);
        return;
    };
    let ev = slot.as_mut_ptr();
    let (regs, orig_ax, arg0) = user_regs();
    let switch_out = kind == kind::SWITCH_OUT;
    unsafe {
        (*ev).hdr = header(kind, tid, tgid);
        (*ev).state = state;
        (*ev).syscall = if switch_out { orig_ax } else { -1 };
        (*ev).regs = regs;
        (*ev).gil_holder = 0;
        (*ev).holder_py_len = 0;
    }
    fill_stacks(ctx, ev, switch_out);
    let futex_addr = if switch_out && orig_ax == sysno::FUTEX as i64 {
        arg0
    } else {
        0
    };
    fill_python(ev, tid, tgid, futex_addr);
    slot.submit(wakeup_flags());
}

/// `sched:sched_switch`: a busy tracked thread leaving the CPU (with its
/// stacks and the syscall it blocks in), and its return to the CPU.
#[tracepoint]
pub fn sp_sched_switch(ctx: TracePointContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, prev) = ((id >> 32) as u32, id as u32);
    if is_target(tgid)
        && let Some(st) = THREADS.get_ptr_mut(&prev)
    {
        let st = unsafe { &mut *st };
        if !parked(prev, st) {
            flush_exit(prev, tgid, st);
            let state = tp_field::<i64>(&ctx, 32);
            if state == 0 || state & TASK_REPORT_MAX != 0 {
                emit(SchedEvent {
                    hdr: header(kind::PREEMPTED, prev, tgid),
                    arg: 0,
                    _pad: 0,
                });
            } else {
                emit_stack_event(&ctx, kind::SWITCH_OUT, prev, tgid, state);
            }
            st.off_reported = 1;
        }
    }
    let next = tp_field::<i32>(&ctx, 56) as u32;
    if let Some(st) = THREADS.get_ptr_mut(&next) {
        let st = unsafe { &mut *st };
        if st.off_reported != 0 {
            st.off_reported = 0;
            emit(SchedEvent {
                hdr: header(kind::SWITCH_IN, next, st.tgid),
                arg: 0,
                _pad: 0,
            });
        }
    }
    0
}

/// `sched:sched_wakeup`: when a blocked busy thread became runnable; the rest
/// of its time off-CPU is run-queue wait.
#[tracepoint]
pub fn sp_sched_wakeup(ctx: TracePointContext) -> u32 {
    let tid = tp_field::<i32>(&ctx, 24) as u32;
    if let Some(st) = THREADS.get_ptr_mut(&tid) {
        let st = unsafe { &*st };
        if st.off_reported != 0 {
            let waker = bpf_get_current_pid_tgid() as u32;
            emit(SchedEvent {
                hdr: header(kind::WAKEUP, tid, st.tgid),
                arg: waker,
                _pad: 0,
            });
        }
    }
    0
}

/// `sched:sched_process_exit`: a thread of the target is gone.
#[tracepoint]
pub fn sp_exit(ctx: TracePointContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !is_target(tgid) {
        return 0;
    }
    let tracked = match THREADS.get_ptr_mut(&tid) {
        Some(st) => {
            flush_exit(tid, tgid, unsafe { &mut *st });
            true
        }
        None => false,
    };
    let group_dead = tp_field::<u8>(&ctx, 32) as u32;
    let _ = THREADS.remove(&tid);
    let _ = LOOP_KEYS.remove(&tid);
    // In daemon mode only tracked threads matter; a targeted process always
    // reports so that the recorder learns the target is gone.
    if tracked || TARGET_TGID.load() != 0 {
        emit(SchedEvent {
            hdr: header(kind::EXIT, tid, tgid),
            arg: group_dead,
            _pad: 0,
        });
    }
    0
}

// ---- sampling -----------------------------------------------------------

/// CPU-clock sample: the stacks of a busy tracked thread that is on-CPU.
#[perf_event]
pub fn sp_sample(ctx: PerfEventContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !is_target(tgid) {
        return 0;
    }
    let Some(st) = THREADS.get_ptr_mut(&tid) else {
        return 0;
    };
    let st = unsafe { &mut *st };
    if parked(tid, st) {
        return 0;
    }
    let gate = SAMPLE_AFTER_NS.load();
    if gate != 0
        && st.busy_since != 0
        && unsafe { bpf_ktime_get_ns() }.wrapping_sub(st.busy_since) < gate
    {
        note(Filtered::YoungSamples);
        return 0;
    }
    flush_exit(tid, tgid, st);
    emit_stack_event(&ctx, kind::SAMPLE, tid, tgid, 0);
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
