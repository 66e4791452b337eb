//! The maps, the failure counters and the one way out (the ring buffer).
//!
//! In: nothing but what userspace writes (`LOOP_KEYS`, `LOOP_GEN`,
//! `PY_PROCS`, `PY_THREADS`, `READER_ASLEEP`, `LEFT_OUT`) and the program context (`is_target`, current
//! CPU and time for `header`). Out: records in `EVENTS`, thread state in
//! `THREADS`, counters in `STATS` and `FILTERED`.
//!
//! Constraints: userspace finds every map here by its name (the static's
//! name), so renaming one is an ABI change with `profiler/src/probe`. Map
//! sizes come from `profiler_common`, where each has its reason. Counter
//! indices are `profiler_common::Drop` / `Filtered` discriminants, the same
//! on both sides.
use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::map,
    maps::{Array, HashMap, PerCpuArray, RingBuf},
};
use profiler_common::{
    CpuWait, Drop, EventHeader, Filtered, MAX_CPUS, MAX_LEFT_OUT, MAX_PY_PROCS, MAX_THREADS,
    MAX_WATCHED, NO_RUN_DELAY, PyProc, RINGBUF_BYTES, RINGBUF_WAKEUP_BYTES, StackEvent,
    ThreadState,
};

use crate::TARGET_TGID;

#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(RINGBUF_BYTES, 0);

/// Where a `StackEvent` is built before it is copied into `EVENTS` cut to
/// its valid bytes (`stack::emit_stack_event`): a reservation must have a
/// constant size, so building in place took the whole ~67 KiB of ring for
/// every event however little of the user-stack copy was valid. Two slots
/// per CPU, `2 * cpu + (kind == SWITCH_OUT)`: a switch-out is built with
/// interrupts off (in the scheduler) and a sample in the CPU-clock
/// interrupt, so neither can overwrite the other's slot half-built.
/// Userspace sets the size (twice the possible CPUs); a value this large
/// cannot be per-CPU (32 KiB limit).
#[map]
pub(crate) static STACK_SCRATCH: Array<StackEvent> = Array::with_max_entries(2 * MAX_CPUS, 0);

/// Threads of the target seen in a wait syscall: the executor candidates.
#[map]
pub(crate) static THREADS: HashMap<u32, ThreadState> = HashMap::with_max_entries(MAX_THREADS, 0);

/// tid -> wait key of the thread's event-loop wait, published by userspace
/// once it has seen which wait the loop returns to.
#[map]
pub(crate) static LOOP_KEYS: HashMap<u32, u64> = HashMap::with_max_entries(MAX_THREADS, 0);

/// Publication generation of `LOOP_KEYS`: userspace bumps slot 0 after every
/// change, so a thread's cached key (`ThreadState::loop_key`) is re-read
/// only then.
#[map]
pub(crate) static LOOP_GEN: Array<u64> = Array::with_max_entries(1, 0);

/// Slot 0: how many tracked threads were switched out in a busy period and
/// have not run since (their `off_reported`). While 0, the scheduler
/// programs skip every other task's switch-in and wakeup.
#[map]
pub(crate) static OFF_CPU: Array<i64> = Array::with_max_entries(1, 0);

/// CPU number -> the loop thread waiting for that CPU and who has held it
/// since (`throttle::cpu_switch`). One slot per CPU: looked at by every
/// switch on that CPU, written only while a loop thread waits there.
#[map]
pub(crate) static CPU_WAITS: Array<CpuWait> = Array::with_max_entries(MAX_CPUS, 0);

/// Slot 0: 1 once the wait syscalls' tracepoints serve the waits (the
/// fallback): the wait uprobes then stand down, so no wait counts twice.
#[map]
pub(crate) static WAIT_TRACEPOINTS: Array<u32> = Array::with_max_entries(1, 0);

/// tgid -> how to walk that process's Python stacks (set by userspace).
#[map]
pub(crate) static PY_PROCS: HashMap<u32, PyProc> = HashMap::with_max_entries(MAX_PY_PROCS, 0);

/// tid -> `PyThreadState*` of that thread (kept current by userspace).
#[map]
pub(crate) static PY_THREADS: HashMap<u32, u64> = HashMap::with_max_entries(MAX_THREADS, 0);

/// Daemon: tgid -> 1 for a process the rules leave out, set once userspace
/// has judged it (`left_out`).
#[map]
pub(crate) static LEFT_OUT: HashMap<u32, u8> = HashMap::with_max_entries(MAX_LEFT_OUT, 0);

/// `record`: tgid -> 1 for each process of the recorded tree besides its
/// root (`TARGET_TGID`): those under it at attach (userspace) and those
/// started since (`sched::sp_raw_fork`); a process's entry goes at its exit.
#[map]
pub(crate) static WATCHED: HashMap<u32, u8> = HashMap::with_max_entries(MAX_WATCHED, 0);

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

/// Count a failure: no failure in BPF is silent.
#[inline(always)]
pub(crate) fn count(what: Drop) {
    bump(&STATS, what as u32);
}

/// Count work the sampling gate saved.
#[inline(always)]
pub(crate) fn note(what: Filtered) {
    bump(&FILTERED, what as u32);
}

/// True for a thread of the process tree being watched (every process in
/// daemon mode, `TARGET_TGID` = 0): the root, or a process in `WATCHED`.
#[inline(always)]
pub(crate) fn is_target(tgid: u32) -> bool {
    let t = TARGET_TGID.load();
    t == 0 || t == tgid || unsafe { WATCHED.get(&tgid) }.is_some()
}

/// The current task as (tgid, tid) when it belongs to the target.
#[inline(always)]
pub(crate) fn current_target() -> Option<(u32, u32)> {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    is_target(tgid).then_some((tgid, tid))
}

/// Daemon: true when the rules leave process `tgid` out (`LEFT_OUT`). Its
/// thread `tid` is then forgotten here (a thread tracked before the
/// judgement: the next events of a thread with no `THREADS` entry cost a
/// lookup and nothing else), and the wait is counted, not reported. Asked
/// at a wait's entry and a runtime park, where a thread's tracking begins;
/// never in `record` (`TARGET_TGID` set).
#[inline(always)]
pub(crate) fn left_out(tgid: u32, tid: u32) -> bool {
    if TARGET_TGID.load() != 0 || unsafe { LEFT_OUT.get(&tgid) }.is_none() {
        return false;
    }
    if let Some(st) = THREADS.get_ptr_mut(&tid) {
        crate::sched::forget_thread(tid, unsafe { &mut *st });
        let _ = THREADS.remove(&tid);
    }
    note(Filtered::LeftOutWaits);
    true
}

/// The current task as (tgid, tid, its `THREADS` entry) when it is a thread
/// of the target that has been seen waiting.
#[inline(always)]
pub(crate) fn current_tracked() -> Option<(u32, u32, &'static mut ThreadState)> {
    let (tgid, tid) = current_target()?;
    let st = THREADS.get_ptr_mut(&tid)?;
    // SAFETY: a map value stays valid for the program's run; only this
    // thread's own events write its entry.
    Some((tgid, tid, unsafe { &mut *st }))
}

#[inline(always)]
pub(crate) fn header(kind: u32, tid: u32, tgid: u32) -> EventHeader {
    EventHeader {
        kind,
        tid,
        tgid,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: unsafe { bpf_ktime_get_ns() },
    }
}

/// A fresh `THREADS` entry for a thread first seen in a wait (`wait_key`)
/// or in a runtime's park function (`in_park`).
#[inline(always)]
pub(crate) fn new_thread(tgid: u32, wait_key: u64, in_park: u32) -> ThreadState {
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
        wait_nr: 0,
        wait_cpu: 0,
        thr_task: 0,
        thr_rq: 0,
        thr_self: 0,
        park_rd: NO_RUN_DELAY,
        park_rd_thr: NO_RUN_DELAY,
        park_thr_out: 0,
        park_thr_in: 0,
        park_thr_arg: 0,
        park_off: 0,
        out_runnable: 0,
        out_ns: 0,
        out_clock: 0,
        out_rd: NO_RUN_DELAY,
    }
}

/// Slot 0: non-zero while the reader sleeps (userspace sets it after a run
/// of empty drains and stops its drain timer): the next record wakes it,
/// and clears this. Two CPUs racing here wake it twice, no harm.
#[map]
pub(crate) static READER_ASLEEP: Array<u32> = Array::with_max_entries(1, 0);

/// Submit flags: wake the reader once a batch has built up (see
/// `RINGBUF_WAKEUP_BYTES`), or at the first record after it went to sleep;
/// otherwise its drain timer takes the records.
#[inline(always)]
pub(crate) fn wakeup_flags() -> u64 {
    if EVENTS.query(BPF_RB_AVAIL_DATA as u64) >= RINGBUF_WAKEUP_BYTES {
        return BPF_RB_FORCE_WAKEUP as u64;
    }
    if let Some(asleep) = READER_ASLEEP.get_ptr_mut(0) {
        // SAFETY: a map value pointer, valid for this program's run.
        unsafe {
            if core::ptr::read_volatile(asleep) != 0 {
                core::ptr::write_volatile(asleep, 0);
                return BPF_RB_FORCE_WAKEUP as u64;
            }
        }
    }
    BPF_RB_NO_WAKEUP as u64
}

/// Put a small record in the ring buffer (a full buffer is counted).
#[inline(always)]
pub(crate) fn emit<T: 'static>(ev: T) {
    match EVENTS.reserve::<T>(0) {
        Some(mut slot) => {
            slot.write(ev);
            slot.submit(wakeup_flags());
        }
        None => count(Drop::RingbufFull),
    }
}
