//! The scheduler's view of a busy thread: switch-out and back in, wakeup,
//! exit, and CPU-clock samples while it runs.
//!
//! In: `sched_switch`, `sched_wakeup` and `sched_process_exit` — as raw
//! tracepoints (`sp_raw_*`, the default) or as classic ones (the fallback,
//! for a kernel whose BTF or prototypes stallprof cannot check) — and a
//! `cpu-clock` perf event on every CPU;
//! the thread's state in `THREADS` (`waits` decides whether it is parked).
//! Out: `SchedEvent`s (`PREEMPTED`, `SWITCH_IN`, `WAKEUP`, `EXIT`) and
//! `StackEvent`s (`SWITCH_OUT`, `SAMPLE`, built by `stack`); a thread's
//! `THREADS` and `LOOP_KEYS` entries go when it exits.
//!
//! Constraints: `sched_switch` and `sched_wakeup` run at every context
//! switch and wakeup on the host. The raw tracepoints build no record: a
//! task that is not the target's costs a tgid compare when it leaves a CPU
//! (daemon mode: a hash lookup), and one array read when it takes a CPU or
//! is woken (plus one 8-byte read of its ids while a tracked thread is off
//! its CPU mid-stall, `OFF_CPU`). A classic tracepoint's record is
//! built before the program runs, whatever it decides. Parked threads report
//! nothing. A preemption (still runnable) is a small event without stacks;
//! only a blocking switch-out copies stacks. Samples in a busy period's
//! first `SAMPLE_AFTER_NS` are skipped (`waits::before_gate`); switch-outs
//! are not, so a stall that blocks at once still gets its stack.
use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_kernel},
    macros::{perf_event, raw_tracepoint, tracepoint},
    programs::{PerfEventContext, RawTracePointContext, TracePointContext},
};
use core::intrinsics::AtomicOrdering;

use profiler_common::{Drop, SchedEvent, TASK_REPORT_MAX, kind, tracepoint};

use crate::{
    TARGET_TGID, TASK_PID_OFFSET,
    maps::{
        LOOP_KEYS, OFF_CPU, THREADS, count, current_target, current_tracked, emit, header,
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
/// thread) takes the CPU.
#[inline(always)]
fn on_switch<C: EbpfContext>(ctx: &C, runnable: bool, state: i64, next: Option<u32>) {
    let id = bpf_get_current_pid_tgid();
    let (tgid, prev) = ((id >> 32) as u32, id as u32);
    throttle::cpu_switch(prev, tgid);
    if is_target(tgid)
        && let Some(st) = THREADS.get_ptr_mut(&prev)
    {
        let st = unsafe { &mut *st };
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
    }
    let Some(next) = next else { return };
    if let Some(st) = THREADS.get_ptr_mut(&next) {
        let st = unsafe { &mut *st };
        // A parked loop thread back on a CPU after its wakeup or a throttle
        // is noted there (it leaves `OFF_CPU` itself); it reports nothing yet.
        if !throttle::parked_switched_in(st) && st.off_reported != 0 {
            st.off_reported = 0;
            off_cpu_add(-1);
            throttle::report_holders(next, st.tgid, st);
            emit(SchedEvent {
                hdr: header(kind::SWITCH_IN, next, st.tgid),
                arg: throttle::switched_in(st),
                _pad: 0,
            });
        }
    }
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
            flush_exit(tid, tgid, st);
            throttle::forget(tid, st);
            if st.off_reported != 0 {
                st.off_reported = 0;
                off_cpu_add(-1);
            }
            true
        }
        None => false,
    };
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

/// CPU-clock sample: the stacks of a busy tracked thread that is on-CPU.
#[perf_event]
pub fn sp_sample(ctx: PerfEventContext) -> u32 {
    let Some((tgid, tid, st)) = current_tracked() else {
        return 0;
    };
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
