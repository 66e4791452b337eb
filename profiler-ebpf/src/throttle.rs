//! The CPU taken away from a busy loop thread: whether a preemption was its
//! cgroup's CFS quota running out (and for how long it was throttled), and
//! who held the CPU while it waited there.
//!
//! In: the task switching out (the current task), `THROTTLE_MODEL` and the
//! field offsets userspace took from the kernel's BTF, the thread's
//! `THREADS` entry, `CPU_WAITS`. Out: the `PREEMPTED` arg's
//! `preempt::THROTTLED` flag, the `SWITCH_IN` arg (ns throttled, from the
//! cfs_rq's `throttled_clock_self_time`), `CPU_HOLDER` events at a waiting
//! loop thread's switch-in.
//!
//! Constraints: `cpu_switch` runs at every context switch the scheduler
//! programs see (host-wide tracepoints: every switch on the host; per-thread
//! switch events: the watched threads' own): one array lookup and a compare
//! while no loop thread waits on that CPU. With per-thread switch events no
//! program sees that CPU's other switches, so the holder is the task the
//! scheduler picked at the preemption (`rq.curr`, read there), charged the
//! whole wait.
//! Everything else runs per preemption or switch-in of a busy loop thread:
//! at most three kernel reads, `MAX_CPU_HOLDERS` compares, and
//! `MAX_CPU_HOLDERS + 1` small events. A failed read is counted
//! (`throttle_read_failed`) and the preemption stays a run-queue wait.
//! The decision itself is `profiler_common::throttle_model`, shared with
//! userspace's unit tests.
use aya_ebpf::helpers::{
    bpf_get_current_comm, bpf_get_current_task, bpf_get_smp_processor_id, bpf_ktime_get_ns,
    bpf_probe_read_kernel,
};
use profiler_common::{
    CPU_HOLDER_OTHERS, CpuHolderEvent, CpuWait, Drop, MAX_CPU_HOLDERS, NO_RUN_DELAY, SchedEvent,
    ThreadState, WOKEN_WAIT_MIN_NS, WaitEvent, kind, preempt, throttle_model,
};

use crate::{
    CFS_RQ_RQ_OFFSET, CFS_RQ_SELF_TIME_OFFSET, CFS_RQ_THROTTLE_COUNT_OFFSET, RQ_CURR_OFFSET,
    TASK_CFS_RQ_OFFSET, TASK_COMM_OFFSET, TASK_PID_OFFSET, TASK_RUN_DELAY_OFFSET,
    TASK_THROTTLED_OFFSET, THREAD_SWITCHES, THROTTLE_MODEL,
    maps::{CPU_WAITS, count, emit, header},
};

/// `thr_self` when the cfs_rq's throttled time could not be read.
const NO_SELF_TIME: u64 = u64::MAX;

#[inline(always)]
fn read<T>(at: u64) -> Option<T> {
    match unsafe { bpf_probe_read_kernel(at as *const T) } {
        Ok(v) => Some(v),
        Err(_) => {
            count(Drop::ThrottleReadFailed);
            None
        }
    }
}

/// `cfs_rq.throttled_clock_self_time` of `rq`, when this kernel has it.
#[inline(always)]
fn self_time(rq: u64) -> Option<u64> {
    match CFS_RQ_SELF_TIME_OFFSET.load() {
        0 => None,
        off => read::<u64>(rq + off as u64),
    }
}

/// The current task (a busy loop thread, `st`) is switched out still
/// runnable: the `PREEMPTED` arg. When it was throttled, `st` remembers
/// its cfs_rq and that cfs_rq's throttled time for its switch-in.
#[inline(always)]
pub(crate) fn preempted(st: &mut ThreadState) -> u32 {
    st.thr_rq = 0;
    let model = THROTTLE_MODEL.load();
    if model == throttle_model::UNKNOWN {
        return 0;
    }
    let task = unsafe { bpf_get_current_task() };
    let Some(rq) = read::<u64>(task + TASK_CFS_RQ_OFFSET.load() as u64) else {
        return 0;
    };
    let flag = if model == throttle_model::TASK {
        match read::<u8>(task + TASK_THROTTLED_OFFSET.load() as u64) {
            Some(f) => f,
            None => return 0,
        }
    } else {
        0
    };
    let throttle_count = if model == throttle_model::CFS_RQ {
        match read::<i32>(rq + CFS_RQ_THROTTLE_COUNT_OFFSET.load() as u64) {
            Some(c) => c,
            None => return 0,
        }
    } else {
        0
    };
    if !throttle_model::is_throttled(model, flag, throttle_count) {
        return 0;
    }
    st.thr_task = task;
    st.thr_rq = rq;
    st.thr_self = self_time(rq).unwrap_or(NO_SELF_TIME);
    preempt::THROTTLED
}

/// A busy loop thread (`st`) is back on a CPU: the `SWITCH_IN` arg, the ns
/// its cfs_rq was throttled since its throttled preemption (0 after any
/// other switch-out).
#[inline(always)]
pub(crate) fn switched_in(st: &mut ThreadState) -> u32 {
    if st.thr_rq == 0 {
        return 0;
    }
    let (rq0, at_out) = (st.thr_rq, st.thr_self);
    st.thr_rq = 0;
    let rq = read::<u64>(st.thr_task + TASK_CFS_RQ_OFFSET.load() as u64);
    let at_in = if at_out == NO_SELF_TIME {
        None
    } else {
        self_time(rq0)
    };
    match (rq, at_in) {
        (Some(rq), Some(at_in)) => throttle_model::switch_in_arg(true, rq == rq0, at_out, at_in),
        _ => throttle_model::switch_in_arg(false, false, 0, 0),
    }
}

/// Every context switch on this CPU: the task leaving it (`pid`, `tgid`:
/// the current task) held it since the last switch; charge it to the loop
/// thread waiting here, if one is.
#[inline(always)]
pub(crate) fn cpu_switch(pid: u32, tgid: u32) {
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let Some(w) = CPU_WAITS.get_ptr_mut(cpu) else {
        return;
    };
    // SAFETY: a map value stays valid for the program's run.
    let w = unsafe { &mut *w };
    if w.tid == 0 {
        return;
    }
    if w.tid == pid {
        // The waiting thread itself is leaving: its switch-in was not
        // seen (it is reported by the switch-in that is).
        w.tid = 0;
        return;
    }
    held_until_now(w, pid, tgid);
}

#[inline(always)]
fn held_until_now(w: &mut CpuWait, pid: u32, tgid: u32) {
    let now = unsafe { bpf_ktime_get_ns() };
    charge(w, pid, tgid, now.saturating_sub(w.since));
    w.since = now;
}

#[inline(always)]
fn charge(w: &mut CpuWait, pid: u32, tgid: u32, ns: u64) {
    charge_named(w, pid, tgid, ns, || {
        bpf_get_current_comm().unwrap_or_default()
    });
}

#[inline(always)]
fn charge_named(
    w: &mut CpuWait,
    pid: u32,
    tgid: u32,
    ns: u64,
    comm: impl FnOnce() -> [u8; profiler_common::COMM_LEN],
) {
    let n = w.n as usize;
    for i in 0..MAX_CPU_HOLDERS {
        if i < n && w.held[i].pid == pid {
            w.held[i].ns += ns;
            return;
        }
    }
    match w.held.get_mut(n) {
        Some(h) => {
            h.pid = pid;
            h.tgid = tgid;
            h.ns = ns;
            h.comm = comm();
            w.n += 1;
        }
        None => w.others_ns += ns,
    }
}

/// A busy loop thread (`tid` of `tgid`) was preempted on this CPU: it waits
/// here from now.
#[inline(always)]
pub(crate) fn wait_here(tid: u32, tgid: u32, st: &mut ThreadState) {
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let Some(w) = CPU_WAITS.get_ptr_mut(cpu) else {
        count(Drop::CpuWaitNoSlot);
        return;
    };
    let w = unsafe { &mut *w };
    if w.tid != 0 && w.tid != tid {
        count(Drop::CpuWaitSlotBusy);
        return;
    }
    w.tid = tid;
    w.tgid = tgid;
    w.since = unsafe { bpf_ktime_get_ns() };
    w.n = 0;
    w.others_ns = 0;
    st.wait_cpu = cpu;
    if THREAD_SWITCHES.load() != 0 {
        took_the_cpu(w);
    }
}

/// Per-thread switch events: the task the scheduler picked to run instead
/// of the preempted current task (`rq.curr` is already the next one when
/// the switch-out's perf event runs) becomes the wait's holder, with no
/// time yet (`report_holders` charges it the wait). A failed read is
/// counted and leaves the wait without a holder.
#[inline(always)]
fn took_the_cpu(w: &mut CpuWait) {
    let task = unsafe { bpf_get_current_task() };
    let Some(cfs_rq) = read::<u64>(task + TASK_CFS_RQ_OFFSET.load() as u64) else {
        return;
    };
    let Some(rq) = read::<u64>(cfs_rq + CFS_RQ_RQ_OFFSET.load() as u64) else {
        return;
    };
    let Some(next) = read::<u64>(rq + RQ_CURR_OFFSET.load() as u64) else {
        return;
    };
    // task_struct.pid, then tgid.
    let Some(ids) = read::<u64>(next + TASK_PID_OFFSET.load() as u64) else {
        return;
    };
    let comm = read::<[u8; profiler_common::COMM_LEN]>(next + TASK_COMM_OFFSET.load() as u64)
        .unwrap_or_default();
    charge_named(w, ids as u32, (ids >> 32) as u32, 0, || comm);
}

/// A busy loop thread (`tid` of `tgid`) is back on a CPU since `ts`:
/// report who held the CPU it waited for (wherever it runs now), and free
/// that slot.
#[inline(always)]
pub(crate) fn report_holders(tid: u32, tgid: u32, st: &ThreadState, ts: u64) {
    let Some(w) = CPU_WAITS.get_ptr_mut(st.wait_cpu) else {
        return;
    };
    let w = unsafe { &mut *w };
    if w.tid != tid {
        return;
    }
    if THREAD_SWITCHES.load() != 0 && w.n > 0 {
        // The task that took the CPU held it until the switch-in, as far
        // as any program saw (another watched thread's switch-out there
        // charged itself and moved `since`).
        w.held[0].ns += ts.saturating_sub(w.since);
    }
    let n = w.n as usize;
    for i in 0..MAX_CPU_HOLDERS {
        if i < n {
            let h = w.held[i];
            emit(CpuHolderEvent {
                hdr: header(kind::CPU_HOLDER, tid, tgid),
                pid: h.pid,
                tgid: h.tgid,
                ns: h.ns,
                comm: h.comm,
            });
        }
    }
    if w.others_ns > 0 {
        emit(CpuHolderEvent {
            hdr: header(kind::CPU_HOLDER, tid, tgid),
            pid: CPU_HOLDER_OTHERS,
            tgid: 0,
            ns: w.others_ns,
            comm: [0; profiler_common::COMM_LEN],
        });
    }
    w.tid = 0;
}

/// A loop thread exits: a CPU slot it still waits in is freed, and it no
/// longer counts off the CPU.
#[inline(always)]
pub(crate) fn forget(tid: u32, st: &mut ThreadState) {
    park_on(st);
    if let Some(w) = CPU_WAITS.get_ptr_mut(st.wait_cpu) {
        let w = unsafe { &mut *w };
        if w.tid == tid {
            w.tid = 0;
        }
    }
}

/// Count a parked thread off the CPU (once) until its switch-in is seen.
#[inline(always)]
fn park_off(st: &mut ThreadState) {
    if st.park_off == 0 {
        st.park_off = 1;
        crate::sched::off_cpu_add(1);
    }
}

#[inline(always)]
fn park_on(st: &mut ThreadState) {
    if st.park_off != 0 {
        st.park_off = 0;
        crate::sched::off_cpu_add(-1);
    }
}

/// The current task's `sched_info.run_delay`: the ns it ever waited
/// runnable for a CPU (`NO_RUN_DELAY` when this kernel does not keep it or
/// the read failed, counted).
#[inline(always)]
pub(crate) fn run_delay() -> u64 {
    match TASK_RUN_DELAY_OFFSET.load() {
        0 => NO_RUN_DELAY,
        off => {
            let task = unsafe { bpf_get_current_task() };
            read::<u64>(task + off as u64).unwrap_or(NO_RUN_DELAY)
        }
    }
}

/// A loop thread in its park (the current task) goes to sleep there: what
/// was noted of leaving it is void, and its wait for a CPU once woken is
/// the run delay it accrues from now (read at the wait's return, so no
/// program has to run on the host's wakeups).
#[inline(always)]
pub(crate) fn parked_slept(st: &mut ThreadState) {
    st.park_thr_out = 0;
    park_on(st);
    // A runtime's park function (tokio) returns through its own probe.
    st.park_rd = if st.in_park != 0 {
        NO_RUN_DELAY
    } else {
        run_delay()
    };
}

/// The thread enters a wait: nothing of a previous one carries over.
#[inline(always)]
pub(crate) fn wait_entered(st: &mut ThreadState) {
    st.park_rd = NO_RUN_DELAY;
    st.park_thr_out = 0;
}

/// A loop thread still in its park is switched out runnable: if throttled,
/// it is on its way back to user space from the wait (where 6.18
/// throttles), before a uretprobe on the wait can see the return.
#[inline(always)]
pub(crate) fn parked_preempted(st: &mut ThreadState) {
    // A runtime's park function (tokio) returns through its own probe.
    if st.in_park != 0 || st.park_thr_out != 0 || preempted(st) == 0 {
        return;
    }
    st.park_thr_out = unsafe { bpf_ktime_get_ns() };
    st.park_thr_in = 0;
    st.park_rd_thr = run_delay();
    park_off(st);
}

/// A parked loop thread throttled on its way back is switched in (at
/// `ts`): when, and the measured throttled share. True when it was one.
#[inline(always)]
pub(crate) fn parked_switched_in(st: &mut ThreadState, ts: u64) -> bool {
    if st.park_off == 0 {
        return false;
    }
    if st.park_thr_out != 0 && st.park_thr_in == 0 {
        st.park_thr_in = ts;
        st.park_thr_arg = switched_in(st);
    }
    park_on(st);
    true
}

/// The wait for a CPU of a loop thread woken in its park, from the run
/// delay it accrued since it slept there, up to `end`'s (the wait's
/// return, or a throttled switch-out on the way): `(woken, back)`, the
/// second approximated by the time that run delay was read (the kernel's
/// return path lies between). None when it did not sleep there, the
/// kernel keeps no run delay, or the wait was shorter than
/// `WOKEN_WAIT_MIN_NS`.
#[inline(always)]
fn woken_wait(slept_rd: u64, end_rd: u64, end: u64) -> Option<(u64, u64)> {
    if slept_rd == NO_RUN_DELAY || end_rd == NO_RUN_DELAY || end_rd < slept_rd {
        return None;
    }
    let waited = end_rd - slept_rd;
    (waited >= WOKEN_WAIT_MIN_NS && waited < end).then(|| (end - waited, end))
}

/// The loop's wait returns (`nr`, `fd`, `ret`). When the thread was woken
/// and then waited for a CPU at least `WOKEN_WAIT_MIN_NS`, or was throttled
/// on its way back: the busy period starts when it left the wait, with
/// those waits as its first parts (`WAIT_EXIT` then `PREEMPTED`/`SWITCH_IN`
/// pairs, stamped when they happened). True when reported so.
#[inline(always)]
pub(crate) fn report_park_waits(
    tid: u32,
    tgid: u32,
    st: &mut ThreadState,
    nr: u32,
    fd: i32,
    ret: i64,
) -> bool {
    let (slept_rd, thr_rd) = (st.park_rd, st.park_rd_thr);
    let (thr_out, thr_in) = (st.park_thr_out, st.park_thr_in);
    st.park_rd = NO_RUN_DELAY;
    st.park_thr_out = 0;
    park_on(st);
    let woken = if slept_rd == NO_RUN_DELAY {
        None
    } else if thr_out != 0 {
        woken_wait(slept_rd, thr_rd, thr_out)
    } else {
        woken_wait(slept_rd, run_delay(), unsafe { bpf_ktime_get_ns() })
    };
    let waited = woken.is_some();
    if !waited && thr_out == 0 {
        return false;
    }
    let (woke, back) = woken.unwrap_or((0, 0));
    let start = if waited { woke } else { thr_out };
    st.busy_since = start;
    st.exit_pending = 0;
    let mut hdr = header(kind::WAIT_EXIT, tid, tgid);
    hdr.ts_ns = start;
    emit(WaitEvent { hdr, nr, fd, ret });
    if waited {
        sched_at(kind::PREEMPTED, tid, tgid, woke, preempt::WOKEN);
        sched_at(kind::SWITCH_IN, tid, tgid, back, 0);
    }
    if thr_out != 0 {
        let arg = preempt::THROTTLED | preempt::WOKEN;
        sched_at(kind::PREEMPTED, tid, tgid, thr_out, arg);
        if thr_in != 0 {
            sched_at(kind::SWITCH_IN, tid, tgid, thr_in, st.park_thr_arg);
        }
    }
    true
}

#[inline(always)]
fn sched_at(kind: u32, tid: u32, tgid: u32, ts: u64, arg: u32) {
    let mut hdr = header(kind, tid, tgid);
    hdr.ts_ns = ts;
    emit(SchedEvent { hdr, arg, _pad: 0 });
}
