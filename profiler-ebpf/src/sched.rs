//! The scheduler's view of a busy thread: switch-out and back in, wakeup,
//! exit, and CPU-clock samples while it runs.
//!
//! In: `sched:sched_switch`, `sched:sched_wakeup`,
//! `sched:sched_process_exit` and a `cpu-clock` perf event on every CPU;
//! the thread's state in `THREADS` (`waits` decides whether it is parked).
//! Out: `SchedEvent`s (`PREEMPTED`, `SWITCH_IN`, `WAKEUP`, `EXIT`) and
//! `StackEvent`s (`SWITCH_OUT`, `SAMPLE`, built by `stack`); a thread's
//! `THREADS` and `LOOP_KEYS` entries go when it exits.
//!
//! Constraints: `sched_switch` runs at every context switch on the host,
//! so a switch between untracked threads costs at most two hash lookups,
//! and fields are loaded straight from the record. Parked threads report
//! nothing. A preemption (still runnable) is a small event without stacks;
//! only a blocking switch-out copies stacks. Samples in a busy period's
//! first `SAMPLE_AFTER_NS` are skipped (`waits::before_gate`); switch-outs
//! are not, so a stall that blocks at once still gets its stack.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{perf_event, tracepoint},
    programs::{PerfEventContext, TracePointContext},
};
use profiler_common::{SchedEvent, TASK_REPORT_MAX, kind, tracepoint};

use crate::{
    TARGET_TGID,
    maps::{LOOP_KEYS, THREADS, current_target, current_tracked, emit, header, is_target},
    stack::emit_stack_event,
    tracepoint::tp_field,
    waits::{before_gate, flush_exit, parked},
};

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
            let state = tp_field(&ctx, tracepoint::SWITCH_PREV_STATE);
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
    let next = tp_field(&ctx, tracepoint::SWITCH_NEXT_PID) as u32;
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
    let tid = tp_field(&ctx, tracepoint::WAKEUP_PID) as u32;
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
    let Some((tgid, tid)) = current_target() else {
        return 0;
    };
    let tracked = match THREADS.get_ptr_mut(&tid) {
        Some(st) => {
            flush_exit(tid, tgid, unsafe { &mut *st });
            true
        }
        None => false,
    };
    let group_dead = tp_field(&ctx, tracepoint::EXIT_GROUP_DEAD) as u32;
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
