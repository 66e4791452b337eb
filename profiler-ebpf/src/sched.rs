//! The scheduler's view of a busy thread: switch-out and back in, wakeup,
//! exit, and CPU-clock samples while it runs.
//!
//! In: for the switches, either a `context-switches` software perf event
//! on each thread of the recorded process (`sp_thread_switch`, inherited
//! by the threads it starts: `record` and `top`, the default), or the
//! `sched_switch` and `sched_wakeup` tracepoints — raw (`sp_raw_*`: the
//! daemon, which watches every process) or classic (the fallback, for a
//! kernel whose BTF or prototypes stallprof cannot check);
//! `sched_process_exit` (raw or classic); a `cpu-clock` perf event on each
//! watched thread with the per-thread switch events (no other task is
//! interrupted), else on every CPU; the thread's state in `THREADS`
//! (`waits` decides whether it is parked).
//! Out: `SchedEvent`s (`PREEMPTED`, `SWITCH_IN`, `WAKEUP`, `EXIT`) and
//! `StackEvent`s (`SWITCH_OUT`, `SAMPLE`, built by `stack`); a thread's
//! `THREADS` and `LOOP_KEYS` entries go when it exits.
//!
//! Constraints: with per-thread events no program runs for any other
//! task's switch or wakeup (the kernel's perf hooks cost them a few tens of
//! ns); a watched thread's switch-in, seen by no program, is dated at its
//! next event from `sched_info.last_arrival` and its wakeup from the run
//! delay it accrued (`came_back`; the waker is not known), and who held a
//! CPU it waited for is the task that took it at the preemption
//! (`throttle::wait_here`).
//! `sched_switch` and `sched_wakeup` run at every context switch and wakeup
//! on the host. The raw tracepoints build no record: a task that is not the
//! target's costs a tgid compare when it leaves a CPU (daemon mode: a hash
//! lookup), and one array read when it takes a CPU or is woken (plus one
//! 8-byte read of its ids while a tracked thread is off its CPU mid-stall,
//! `OFF_CPU`). A classic tracepoint's record is built before the program
//! runs, whatever it decides. Parked threads report nothing. A preemption
//! (still runnable) is a small event without stacks; only a blocking
//! switch-out copies stacks. Samples in a busy period's first
//! `SAMPLE_AFTER_NS` are skipped (`waits::before_gate`); switch-outs are
//! not, so a stall that blocks at once still gets its stack.
use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task, bpf_ktime_get_ns, bpf_probe_read_kernel,
    },
    macros::{perf_event, raw_tracepoint, tracepoint},
    programs::{PerfEventContext, RawTracePointContext, TracePointContext},
};
use core::intrinsics::AtomicOrdering;

use profiler_common::{
    Drop, NO_RUN_DELAY, NO_WAKER, SchedEvent, TASK_REPORT_MAX, ThreadState, kind, tracepoint,
};

use crate::{
    CFS_RQ_RQ_OFFSET, RQ_CLOCK_OFFSET, TARGET_TGID, TASK_CFS_RQ_OFFSET, TASK_LAST_ARRIVAL_OFFSET,
    TASK_PID_OFFSET, TASK_STATE_OFFSET, THREAD_SWITCHES,
    maps::{
        LOOP_KEYS, OFF_CPU, THREADS, WATCHED, count, current_target, current_tracked, emit, header,
        is_target,
    },
    stack::emit_stack_event,
    throttle,
    tracepoint::tp_field,
    waits::{before_gate, flush_exit, parked},
};

/// A context switch: `prev` (the current task) leaves the CPU, `runnable`
/// when it is still runnable (preempted, yielded), else blocked with the
/// kernel's `state`; `next` (its tid, or `None` when it cannot be a tracked
/// thread, or no program sees it: per-thread switch events) takes the CPU.
#[inline(always)]
fn on_switch<C: EbpfContext>(ctx: &C, runnable: bool, state: i64, next: Option<u32>) {
    let id = bpf_get_current_pid_tgid();
    let (tgid, prev) = ((id >> 32) as u32, id as u32);
    if is_target(tgid)
        && let Some(st) = THREADS.get_ptr_mut(&prev)
    {
        let st = unsafe { &mut *st };
        // It ran since its last switch-out: that switch-in comes first.
        came_back(prev, tgid, st);
        throttle::cpu_switch(prev, tgid);
        left_cpu(ctx, prev, tgid, st, runnable, state);
    } else {
        throttle::cpu_switch(prev, tgid);
    }
    let Some(next) = next else { return };
    if let Some(st) = THREADS.get_ptr_mut(&next) {
        let st = unsafe { &mut *st };
        back_on_cpu(next, st.tgid, st, unsafe { bpf_ktime_get_ns() });
    }
}

/// A tracked thread (the current task) leaves its CPU.
#[inline(always)]
fn left_cpu<C: EbpfContext>(
    ctx: &C,
    prev: u32,
    tgid: u32,
    st: &mut ThreadState,
    runnable: bool,
    state: i64,
) {
    if parked(prev, st) {
        if runnable {
            throttle::parked_preempted(st);
        } else {
            throttle::parked_slept(st);
        }
    } else {
        flush_exit(prev, tgid, st);
        if runnable {
            let arg = throttle::preempted(st);
            emit(SchedEvent {
                hdr: header(kind::PREEMPTED, prev, tgid),
                arg,
                _pad: 0,
            });
            // Who holds the CPU matters to a run-queue wait; a
            // throttled one is the quota's, whoever runs meanwhile.
            if arg == 0 {
                throttle::wait_here(prev, tgid, st);
            }
        } else {
            emit_stack_event(ctx, kind::SWITCH_OUT, prev, tgid, state);
        }
        if st.off_reported == 0 {
            off_cpu_add(1);
        }
        st.off_reported = 1;
    }
    if THREAD_SWITCHES.load() != 0 && (st.off_reported != 0 || st.park_off != 0) {
        // No program will see it come back: what dates that is noted now.
        st.out_runnable = runnable as u32;
        st.out_ns = unsafe { bpf_ktime_get_ns() };
        st.out_clock = rq_clock();
        st.out_rd = throttle::run_delay();
    }
}

/// A tracked thread (`tid` of `tgid`) is back on a CPU since `ts`.
#[inline(always)]
fn back_on_cpu(tid: u32, tgid: u32, st: &mut ThreadState, ts: u64) {
    // A parked loop thread back on a CPU after its wakeup or a throttle
    // is noted there (it leaves `OFF_CPU` itself); it reports nothing yet.
    if throttle::parked_switched_in(st, ts) || st.off_reported == 0 {
        return;
    }
    st.off_reported = 0;
    off_cpu_add(-1);
    throttle::report_holders(tid, tgid, st, ts);
    let mut hdr = header(kind::SWITCH_IN, tid, tgid);
    hdr.ts_ns = ts;
    emit(SchedEvent {
        hdr,
        arg: throttle::switched_in(st),
        _pad: 0,
    });
}

/// Per-thread switch events: a tracked thread (the current task, `tid` of
/// `tgid`) is seen running — at a sample, a wait, its next switch-out or
/// its exit — so a switch-in pending since its last switch-out happened:
/// reported now, dated from `sched_info.last_arrival`, with its wakeup
/// (after a blocking switch-out) dated from the run delay it accrued.
/// Every program that handles a tracked thread's event calls this first;
/// with host-wide scheduler tracepoints it does nothing.
#[inline(always)]
pub(crate) fn came_back(tid: u32, tgid: u32, st: &mut ThreadState) {
    if THREAD_SWITCHES.load() == 0 || (st.off_reported == 0 && st.park_off == 0) {
        return;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let at = arrived(st, now);
    if st.off_reported != 0 && st.out_runnable == 0 && st.out_rd != NO_RUN_DELAY {
        let rd = throttle::run_delay();
        if rd != NO_RUN_DELAY && rd >= st.out_rd {
            let mut hdr = header(kind::WAKEUP, tid, tgid);
            hdr.ts_ns = at.saturating_sub(rd - st.out_rd).max(st.out_ns);
            emit(SchedEvent {
                hdr,
                arg: NO_WAKER,
                _pad: 0,
            });
        }
    }
    back_on_cpu(tid, tgid, st, at);
}

/// When the current task (a tracked thread switched out at `st.out_ns`)
/// last took a CPU: its `sched_info.last_arrival` is in its run queue's
/// clock, read at the switch-out too (`st.out_clock`), so the time between
/// the two lands on `st.out_ns`. `now` when unread (counted).
#[inline(always)]
fn arrived(st: &ThreadState, now: u64) -> u64 {
    if st.out_clock == 0 {
        return now;
    }
    let task = unsafe { bpf_get_current_task() };
    match kernel_u64(task, TASK_LAST_ARRIVAL_OFFSET.load()) {
        Some(a) if a >= st.out_clock => st.out_ns.saturating_add(a - st.out_clock).min(now),
        // Arrived "before" it left: another CPU's clock a little behind.
        Some(_) => st.out_ns,
        None => now,
    }
}

/// The current CPU's run-queue clock (`rq.clock`, updated by the scheduler
/// just before a switch), through the current task's cfs_rq; 0 when
/// unread (counted).
#[inline(always)]
fn rq_clock() -> u64 {
    let task = unsafe { bpf_get_current_task() };
    kernel_u64(task, TASK_CFS_RQ_OFFSET.load())
        .and_then(|cfs_rq| kernel_u64(cfs_rq, CFS_RQ_RQ_OFFSET.load()))
        .and_then(|rq| kernel_u64(rq, RQ_CLOCK_OFFSET.load()))
        .unwrap_or(0)
}

/// The u64 at `base + off` in kernel memory; a failed read (or a null
/// base) is counted (`switch_clock_read_failed`).
#[inline(always)]
fn kernel_u64(base: u64, off: u32) -> Option<u64> {
    if base != 0
        && let Ok(v) = unsafe { bpf_probe_read_kernel((base + off as u64) as *const u64) }
    {
        return Some(v);
    }
    count(Drop::SwitchClockFailed);
    None
}

/// A blocked busy thread became runnable (woken by the current task); the
/// rest of its time off-CPU is run-queue wait. (A parked loop thread's
/// wakeup is not needed: its wait for a CPU is read from its run delay.)
#[inline(always)]
fn on_wakeup(tid: u32) {
    if let Some(st) = THREADS.get_ptr_mut(&tid) {
        let st = unsafe { &mut *st };
        if st.off_reported != 0 {
            let waker = bpf_get_current_pid_tgid() as u32;
            emit(SchedEvent {
                hdr: header(kind::WAKEUP, tid, st.tgid),
                arg: waker,
                _pad: 0,
            });
        }
    }
}

/// A tracked thread is let go (its exit, or its process left out by the
/// daemon's rules): a CPU slot it still waits in is freed, and it no longer
/// counts off the CPU. The caller removes its `THREADS` entry.
#[inline(always)]
pub(crate) fn forget_thread(tid: u32, st: &mut ThreadState) {
    throttle::forget(tid, st);
    if st.off_reported != 0 {
        st.off_reported = 0;
        off_cpu_add(-1);
    }
}

/// A thread of the target (the current task) exits; `group_dead` when it
/// was the last of its process.
#[inline(always)]
fn on_exit(group_dead: u32) {
    let Some((tgid, tid)) = current_target() else {
        return;
    };
    let tracked = match THREADS.get_ptr_mut(&tid) {
        Some(st) => {
            let st = unsafe { &mut *st };
            came_back(tid, tgid, st);
            flush_exit(tid, tgid, st);
            forget_thread(tid, st);
            true
        }
        None => false,
    };
    let _ = THREADS.remove(&tid);
    let _ = LOOP_KEYS.remove(&tid);
    if group_dead != 0 {
        // A pid the kernel gives out again is not the recorded tree's.
        let _ = WATCHED.remove(&tgid);
    }
    // In daemon mode only tracked threads matter; a targeted process always
    // reports so that the recorder learns the target is gone.
    if tracked || TARGET_TGID.load() != 0 {
        emit(SchedEvent {
            hdr: header(kind::EXIT, tid, tgid),
            arg: group_dead,
            _pad: 0,
        });
    }
}

/// Tracked threads switched out in a busy period, or throttled in their
/// park, and not back yet (`OFF_CPU`): while there are none, no other
/// task's switch-in or wakeup can be one the programs report, and they
/// cost one array read.
#[inline(always)]
fn any_off_cpu() -> bool {
    OFF_CPU.get(0).is_some_and(|n| *n != 0)
}

#[inline(always)]
pub(crate) fn off_cpu_add(d: i64) {
    if let Some(p) = OFF_CPU.get_ptr_mut(0) {
        // Switch-outs and switch-ins of different threads run on different
        // CPUs at once: an atomic add.
        // (The BPF target has no `AtomicI64::fetch_add`; the intrinsic is
        // one BPF atomic add.)
        unsafe {
            core::intrinsics::atomic_xadd::<i64, i64, { AtomicOrdering::Relaxed }>(p, d);
        }
    }
}

/// `(tid, tgid)` of a task the kernel passed a raw tracepoint, read at the
/// offset of `task_struct.pid` that userspace took from the kernel's BTF
/// (`tgid` follows `pid`, checked there). A failed read is counted.
#[inline(always)]
fn task_ids(task: u64) -> Option<(u32, u32)> {
    let at = task.wrapping_add(TASK_PID_OFFSET.load() as u64) as *const u64;
    match unsafe { bpf_probe_read_kernel(at) } {
        Ok(v) => Some((v as u32, (v >> 32) as u32)),
        Err(_) => {
            count(Drop::TaskReadFailed);
            None
        }
    }
}

/// The tid of `task` when it may be a tracked thread: in a recording of one
/// process, only that process's threads are (one read and a compare is
/// the whole cost of every other task's switch).
#[inline(always)]
fn candidate(task: u64) -> Option<u32> {
    let (tid, tgid) = task_ids(task)?;
    is_target(tgid).then_some(tid)
}

/// `sched:sched_switch`, classic tracepoint (the fallback): the record is
/// built for every switch on the host before this runs.
#[tracepoint]
pub fn sp_sched_switch(ctx: TracePointContext) -> u32 {
    let state = tp_field(&ctx, tracepoint::SWITCH_PREV_STATE);
    let runnable = state == 0 || state & TASK_REPORT_MAX != 0;
    let next = tp_field(&ctx, tracepoint::SWITCH_NEXT_PID) as u32;
    on_switch(&ctx, runnable, state, Some(next));
    0
}

/// `sched_switch`, raw tracepoint: `(bool preempt, struct task_struct
/// *prev, struct task_struct *next, unsigned int prev_state)` (the
/// prototype is checked against the kernel's BTF before loading). No record
/// is built; `prev` is the current task, and `next` is read only as far as
/// its ids.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn sp_raw_sched_switch(ctx: RawTracePointContext) -> u32 {
    let preempt: u64 = ctx.arg(0);
    let next: u64 = ctx.arg(2);
    let prev_state: u64 = ctx.arg(3);
    // The raw state is the task's `__state`, not the classic record's
    // report bit: blocked is any non-zero state of a task not preempted.
    let runnable = preempt as u8 != 0 || prev_state as u32 == 0;
    let state = if prev_state & 2 != 0 { 2 } else { 1 }; // D, else S
    // `next` matters only while some tracked thread waits to come back.
    let next = if any_off_cpu() { candidate(next) } else { None };
    on_switch(&ctx, runnable, state, next);
    0
}

/// `sched:sched_wakeup`, classic tracepoint (the fallback).
#[tracepoint]
pub fn sp_sched_wakeup(ctx: TracePointContext) -> u32 {
    if any_off_cpu() {
        on_wakeup(tp_field(&ctx, tracepoint::WAKEUP_PID) as u32);
    }
    0
}

/// `sched_wakeup`, raw tracepoint: `(struct task_struct *p)`. Only a
/// tracked thread switched out mid-busy (`OFF_CPU`) has a wakeup to
/// report: while none is, every other wakeup on the host costs one array
/// read.
#[raw_tracepoint(tracepoint = "sched_wakeup")]
pub fn sp_raw_sched_wakeup(ctx: RawTracePointContext) -> u32 {
    if !any_off_cpu() {
        return 0;
    }
    let task: u64 = ctx.arg(0);
    if let Some(tid) = candidate(task) {
        on_wakeup(tid);
    }
    0
}

/// `sched:sched_process_exit`, classic tracepoint (the fallback).
#[tracepoint]
pub fn sp_exit(ctx: TracePointContext) -> u32 {
    on_exit(tp_field(&ctx, tracepoint::EXIT_GROUP_DEAD) as u32);
    0
}

/// `sched_process_exit`, raw tracepoint: `(struct task_struct *p, bool
/// group_dead)`; `p` is the current task.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn sp_raw_exit(ctx: RawTracePointContext) -> u32 {
    let group_dead: u64 = ctx.arg(1);
    on_exit(group_dead as u8 as u32);
    0
}

/// `sched_process_fork`, raw tracepoint: `(struct task_struct *parent,
/// struct task_struct *child)`, in the parent's context. `record` of a
/// process tree: a new process started by a watched one is watched from
/// its first instruction (the per-thread events it inherited now pass
/// `is_target`), and userspace is told to find its runtimes. A new thread
/// (same tgid) needs nothing: its process is watched already.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn sp_raw_fork(ctx: RawTracePointContext) -> u32 {
    let parent = (bpf_get_current_pid_tgid() >> 32) as u32;
    if TARGET_TGID.load() == 0 || !is_target(parent) {
        return 0;
    }
    let child: u64 = ctx.arg(1);
    let Some((pid, tgid)) = task_ids(child) else {
        return 0;
    };
    if tgid == parent {
        return 0;
    }
    if WATCHED.insert(&tgid, &1, 0).is_err() {
        count(Drop::WatchedFull);
        return 0;
    }
    emit(SchedEvent {
        hdr: header(kind::FORK, pid, tgid),
        arg: parent,
        _pad: 0,
    });
    0
}

/// `context-switches` of one thread of the recorded process (a software
/// perf event per thread, sampling every switch, inherited by the threads
/// it starts): the current task leaves its CPU. Nothing runs for any other
/// task's switches or wakeups; its switch-in is dated at its next event
/// (`came_back`). Blocked when its `__state` is not `TASK_RUNNING`.
#[perf_event]
pub fn sp_thread_switch(ctx: PerfEventContext) -> u32 {
    let task = unsafe { bpf_get_current_task() };
    let at = task.wrapping_add(TASK_STATE_OFFSET.load() as u64) as *const u32;
    let Ok(state) = (unsafe { bpf_probe_read_kernel(at) }) else {
        count(Drop::TaskReadFailed);
        return 0;
    };
    let code = if state & 2 != 0 { 2 } else { 1 }; // D, else S
    on_switch(&ctx, state == 0, code, None);
    0
}

/// CPU-clock sample: the stacks of a busy tracked thread that is on-CPU
/// (per-thread events: only the watched threads are sampled).
#[perf_event]
pub fn sp_sample(ctx: PerfEventContext) -> u32 {
    let Some((tgid, tid, st)) = current_tracked() else {
        return 0;
    };
    came_back(tid, tgid, st);
    if parked(tid, st) {
        return 0;
    }
    if before_gate(st) {
        return 0;
    }
    flush_exit(tid, tgid, st);
    emit_stack_event(&ctx, kind::SAMPLE, tid, tgid, 0);
    0
}
