//! stallprof's kernel side: thin probe shims that capture and filter, nothing more.
//!
//! In: wait-syscall tracepoints, scheduler tracepoints, a CPU-clock perf
//! event, uprobes on a runtime's park function, and what userspace writes
//! into the maps (loop keys, Python layouts). Out: typed records
//! (`profiler_common`) in the `EVENTS` ring buffer, and counters in `STATS`
//! (failures) and `FILTERED` (work the sampling gate saved).
//!
//! Constraints: O(1) work per event except the bounded stack copies and the
//! bounded Python walk; no decisions beyond "is this a thread of the
//! target, and is it parked?". What counts as a stall, attribution and
//! symbolization all happen in userspace. Every failure increments a named
//! counter (`profiler_common::Drop`). Userspace attaches programs and finds
//! maps by name (`sp_*`, the map statics' names).
//!
//! Modules, by what they handle:
//! - `maps`: every map userspace sees, the counters, the ring-buffer output;
//! - `tracepoint`: loading a field from a tracepoint's record;
//! - `waits`: the loop's wait — per-process uprobes on the C library's wait
//!   functions (`sp_uwait_enter`/`sp_uwait_exit`) or the syscall
//!   tracepoints (`sp_wait_enter`/`sp_wait_exit`, the fallback) — parked or
//!   not, the sampling gate;
//! - `runtime`: `sp_park_enter`/`sp_park_exit`, a runtime's park function;
//! - `sched`: a watched thread's switch-outs — per-thread perf events
//!   (`sp_thread_switch`, recording one process) or the scheduler's raw
//!   tracepoints (`sp_raw_sched_switch`, `sp_raw_sched_wakeup`; the
//!   daemon), classic ones as the fallback — its exit (`sp_raw_exit`),
//!   and `sp_sample`;
//! - `stack`: the `StackEvent` a switch-out or a sample captures;
//! - `python`: the Python frames and the GIL holder inside that event.
#![no_std]
#![no_main]
#![allow(internal_features)]
#![feature(core_intrinsics)]

use aya_ebpf::Global;

mod maps;
mod python;
mod runtime;
mod sched;
mod stack;
mod task;
mod throttle;
mod tracepoint;
mod waits;

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

/// Offset of `task_struct.pid` (`tgid` is the next `pid_t`), taken by
/// userspace from the kernel's BTF at load: the raw scheduler tracepoints
/// get `task_struct` pointers, and read a task's ids there.
#[unsafe(no_mangle)]
static TASK_PID_OFFSET: Global<u32> = Global::new(0);

/// How this kernel throttles a task whose cgroup's CFS quota ran out
/// (`profiler_common::throttle_model`), and where the fields that tell are:
/// `task_struct.throttled` (6.18+), `task_struct.se.cfs_rq`,
/// `cfs_rq.throttle_count`, `cfs_rq.throttled_clock_self_time` (0: absent).
/// Taken by userspace from the kernel's BTF at load; model 0 = unknown,
/// nothing is read.
#[unsafe(no_mangle)]
static THROTTLE_MODEL: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static TASK_THROTTLED_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static TASK_CFS_RQ_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static CFS_RQ_THROTTLE_COUNT_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static CFS_RQ_SELF_TIME_OFFSET: Global<u32> = Global::new(0);

/// 1 when the scheduler is seen through per-thread `context-switches` perf
/// events (`sched::sp_thread_switch`) instead of host-wide tracepoints: a
/// tracked thread's switch-in is then dated at its next event
/// (`sched::came_back`). Set at load, with the offsets it reads there,
/// from the kernel's BTF: `task_struct.__state`,
/// `task_struct.sched_info.last_arrival`, `cfs_rq.rq` and `rq.clock`
/// (`TASK_CFS_RQ_OFFSET` leads from the task to its cfs_rq).
#[unsafe(no_mangle)]
static THREAD_SWITCHES: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static TASK_STATE_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static TASK_LAST_ARRIVAL_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static CFS_RQ_RQ_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RQ_CLOCK_OFFSET: Global<u32> = Global::new(0);
/// With per-thread switch events, `rq.curr` and `task_struct.comm`: the
/// task that takes the CPU from a preempted loop thread, named as the one
/// holding it (`throttle::wait_here`).
#[unsafe(no_mangle)]
static RQ_CURR_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static TASK_COMM_OFFSET: Global<u32> = Global::new(0);

/// Offset of `task_struct.sched_info.run_delay` (the ns a task ever waited
/// runnable for a CPU; `CONFIG_SCHED_INFO`), from the kernel's BTF at load;
/// 0: absent, a loop thread's wait for a CPU after its wakeup in its park
/// is not measured.
#[unsafe(no_mangle)]
static TASK_RUN_DELAY_OFFSET: Global<u32> = Global::new(0);

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
