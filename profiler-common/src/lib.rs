//! The one definition of every type that crosses the kernel/user boundary.
//!
//! In: nothing. Out: `#[repr(C)]`, `Copy`, fixed-width types used by
//! `profiler-ebpf` (which writes them into the ring buffer and maps) and by
//! `profiler` (which reads them). Flags are integers, not `bool`; padding is
//! explicit so that both sides agree on every byte.
//!
//! The `user` feature implements `aya::Pod` so userspace can use the types as
//! map keys and values.
#![no_std]

pub mod python;

/// Frames kept from a kernel stack (`bpf_get_stack`, no `BPF_F_USER_STACK`).
/// Switch-out paths are ~15–25 frames deep; 48 leaves room for nesting.
pub const MAX_KSTACK: usize = 48;
/// Frames kept from a frame-pointer user stack. Deeper stacks are truncated
/// at the outermost end and counted (`Drop::UstackTruncated`).
pub const MAX_USTACK: usize = 96;

/// Bytes of user stack copied from the stack pointer up, for unwinding with
/// `.eh_frame` in userspace (binaries without frame pointers). 64 KiB: Node
/// running OpenSSL's SHA-512 under V8's entry frames needs more than 16 KiB
/// from the leaf to `uv_run`, and an express handler's scavenge under
/// js-yaml's recursive parser more than 32 KiB (a third of such stacks lost
/// their outer frames, the handler among them, at 32). Deeper stacks are
/// unwound as far as the copy goes (`unwind_truncated`). Only the bytes up
/// to the stack's top are copied and sent (`copy_user_stack`).
pub const USER_STACK_COPY: usize = 64 << 10;
/// Ring buffer size as compiled: the largest the agent asks for. At load
/// the agent sizes it to the sampling rate and CPU count
/// (`probe::ring_bytes`): 64 MiB holds ~1k stack events at their full
/// ~67 KiB (they are sent cut to their valid bytes: 6-12 KiB measured).
pub const RINGBUF_BYTES: u32 = 64 << 20;
/// Events are submitted without waking the reader until this much data is
/// waiting; the reader also drains on a short timer (`record`: 20 ms). A
/// wakeup per event would make the reader preempt the very loop thread it
/// watches, whose preemption is an event: a feedback loop.
pub const RINGBUF_WAKEUP_BYTES: u64 = 1 << 20;
/// Executor-thread table: threads of the target that ever entered a wait.
/// 16k covers thread pools far beyond any event-loop service.
pub const MAX_THREADS: u32 = 16384;

/// Event discriminants (`EventHeader::kind`).
pub mod kind {
    /// A thread entered an event-loop wait syscall (`WaitEvent`).
    pub const WAIT_ENTER: u32 = 1;
    /// A thread returned from an event-loop wait syscall (`WaitEvent`).
    pub const WAIT_EXIT: u32 = 2;
    /// A busy tracked thread was switched out (`StackEvent`).
    pub const SWITCH_OUT: u32 = 3;
    /// A tracked thread switched out while busy was switched back in (`SchedEvent`).
    pub const SWITCH_IN: u32 = 4;
    /// A tracked thread switched out while busy was woken (`SchedEvent`, arg = waker tid).
    pub const WAKEUP: u32 = 5;
    /// CPU-clock sample of a busy tracked thread (`StackEvent`).
    pub const SAMPLE: u32 = 6;
    /// A thread of the target exited (`SchedEvent`, arg = 1 when the whole process is gone).
    pub const EXIT: u32 = 7;
    /// A busy tracked thread was preempted (still runnable): no stack is
    /// copied, its run-queue time goes to its latest on-CPU sample's stack
    /// (`SchedEvent`). Preemptions of a busy loop are frequent under load,
    /// blocking switch-outs are not; this keeps the common case cheap.
    pub const PREEMPTED: u32 = 8;
    /// A task that held the CPU a watched loop thread was waiting for
    /// (`CpuHolderEvent`), reported at that thread's switch-in: up to
    /// [`MAX_CPU_HOLDERS`](super::MAX_CPU_HOLDERS) of them per wait.
    pub const CPU_HOLDER: u32 = 9;
    /// CPython 3.14+: the asyncio task a stack event's thread was running,
    /// read with that stack (`TaskEvent`), sent just before the stack event
    /// it belongs to: userspace names the task from it when the task is
    /// gone by the time it reads (a short-lived task freed after its block).
    pub const TASK: u32 = 10;
    /// A watched process started another (`SchedEvent`: `tgid` = `tid` =
    /// the new process, arg = its parent's tgid), already watched by the
    /// kernel side (`WATCHED`) when this is sent: recording a process tree.
    pub const FORK: u32 = 11;
}

/// `SchedEvent::arg` of a `PREEMPTED` event: what the kernel said about
/// the preemption.
pub mod preempt {
    /// The thread was taken off the CPU because its cgroup's CPU bandwidth
    /// (CFS quota) ran out: on 6.18+ its `task_struct.throttled` was set at
    /// the switch; before 6.18 its `se.cfs_rq->throttle_count` was non-zero
    /// (a task of a throttled hierarchy cannot stay on the CPU there).
    pub const THROTTLED: u32 = 1;
    /// Not a switch-out seen as it happened: the wait for a CPU (or the
    /// throttle) between the loop's park returning and its own code
    /// running, reported at the wait's return with the times it happened
    /// (`throttle::report_park_waits`). Only these are a busy period's
    /// `woken` parts; a preemption after its code began is not, stack or no
    /// stack yet.
    pub const WOKEN: u32 = 2;
}

/// `SchedEvent::arg` of a `SWITCH_IN` event after a throttled preemption:
/// how many ns of the time off the CPU the thread's run queue was throttled
/// (the growth of its `cfs_rq->throttled_clock_self_time`, saturated at
/// `u32::MAX - 1`); the rest was run-queue wait after the unthrottle. Or
/// this value when the kernel could not measure it (no such field, the
/// thread came back on another CPU's run queue): then the whole time off
/// the CPU counts as throttled.
pub const THROTTLE_NOT_MEASURED: u32 = u32::MAX;

/// How the running kernel takes a task off the CPU when its cgroup's CFS
/// bandwidth runs out, told from its BTF at load (a BPF global), and what
/// `sched_switch` must look at to tell a throttled preemption from any
/// other: both show `prev_state` = `TASK_REPORT_MAX` (measured on 6.18).
pub mod throttle_model {
    /// Neither field below is in the kernel's BTF: no preemption is
    /// flagged throttled (the agent says so at load).
    pub const UNKNOWN: u32 = 0;
    /// 6.18+ task-based throttling: a throttled task is dequeued on its way
    /// back to user space, with `task_struct.throttled` set. Its cfs_rq is
    /// marked throttled earlier, while the task may still run (and be
    /// preempted for other reasons) in the kernel, so the cfs_rq does not
    /// tell.
    pub const TASK: u32 = 1;
    /// Before 6.18: the whole cfs_rq is dequeued at once, so a runnable
    /// task switched out with `se.cfs_rq->throttle_count > 0` (its cfs_rq
    /// or an ancestor throttled) was throttled.
    pub const CFS_RQ: u32 = 2;

    /// The model of a kernel whose BTF has `task_struct.throttled`
    /// (`task_flag`) and `cfs_rq.throttle_count` (`cfs_rq_count`).
    pub const fn from_btf(task_flag: bool, cfs_rq_count: bool) -> u32 {
        if task_flag {
            TASK
        } else if cfs_rq_count {
            CFS_RQ
        } else {
            UNKNOWN
        }
    }

    /// Whether a switch-out of a still-runnable task is a throttle, given
    /// what BPF read of it at the switch: `task_throttled`
    /// (`task_struct.throttled`, 0 when the field is absent) and
    /// `throttle_count` (`se.cfs_rq->throttle_count`, 0 when absent).
    pub const fn is_throttled(model: u32, task_throttled: u8, throttle_count: i32) -> bool {
        match model {
            TASK => task_throttled != 0,
            CFS_RQ => throttle_count > 0,
            _ => false,
        }
    }

    /// The `SWITCH_IN` arg after a throttled preemption: the growth of the
    /// thread's cfs_rq's `throttled_clock_self_time` between the switch-out
    /// (`at_out`) and the switch-in (`at_in`), when it is still on the same
    /// cfs_rq (`same_rq`) and the field exists (`measurable`); else
    /// [`THROTTLE_NOT_MEASURED`](super::THROTTLE_NOT_MEASURED).
    pub const fn switch_in_arg(measurable: bool, same_rq: bool, at_out: u64, at_in: u64) -> u32 {
        if !measurable || !same_rq || at_in < at_out {
            return super::THROTTLE_NOT_MEASURED;
        }
        let d = at_in - at_out;
        if d >= super::THROTTLE_NOT_MEASURED as u64 {
            super::THROTTLE_NOT_MEASURED - 1
        } else {
            d as u32
        }
    }
}

/// CPU holders reported per wait of a loop thread (the rest of the wait is
/// left unnamed): a run-queue wait of a few ms rarely sees more than two.
pub const MAX_CPU_HOLDERS: usize = 4;
/// `TASK_COMM_LEN`.
pub const COMM_LEN: usize = 16;

/// Wait syscalls (x86-64 numbers) that may be an event loop's park point.
pub mod sysno {
    pub const READ: u32 = 0;
    pub const FUTEX: u32 = 202;
    pub const POLL: u32 = 7;
    pub const SELECT: u32 = 23;
    pub const EPOLL_WAIT: u32 = 232;
    pub const PSELECT6: u32 = 270;
    pub const PPOLL: u32 = 271;
    pub const EPOLL_PWAIT: u32 = 281;
    pub const EPOLL_PWAIT2: u32 = 441;

    /// The syscalls that can park an event loop, with their tracepoint names.
    pub const WAITS: [(u32, &str); 7] = [
        (EPOLL_WAIT, "epoll_wait"),
        (EPOLL_PWAIT, "epoll_pwait"),
        (EPOLL_PWAIT2, "epoll_pwait2"),
        (POLL, "poll"),
        (PPOLL, "ppoll"),
        (SELECT, "select"),
        (PSELECT6, "pselect6"),
    ];

    /// Not a syscall: a runtime's own park function (tokio's scheduler
    /// `park_internal`), reported through uprobes as a wait with this number.
    pub const RUNTIME_PARK: u32 = 1000;

    /// True for the epoll family: their first argument is the loop's epoll fd.
    pub const fn is_epoll(nr: u32) -> bool {
        matches!(nr, EPOLL_WAIT | EPOLL_PWAIT | EPOLL_PWAIT2)
    }
}

/// The tracepoint record fields the BPF programs load, and where.
///
/// Classic tracepoints have no BTF relocation: `profiler-ebpf` loads each
/// field at a fixed offset from the record, and a wrong offset reads another
/// field without any error. So every field is named here once, with the
/// offset BPF loads it from and the type it loads (whose size is the
/// field's), and userspace checks each against tracefs's
/// `events/<category>/<name>/format` (`offset:` and `size:`) before it
/// attaches (`profiler/src/probe`). The offsets are those of the x86-64
/// kernels stallprof runs on (read from the format files of 6.18).
pub mod tracepoint {
    use core::marker::PhantomData;

    use crate::sysno;

    /// A field of a tracepoint record, loaded in BPF as a `T`.
    #[derive(Clone, Copy, Debug)]
    pub struct Field<T> {
        /// The field's name in the `format` file.
        pub name: &'static str,
        /// Byte offset in the record.
        pub offset: usize,
        _load: PhantomData<T>,
    }

    impl<T> Field<T> {
        const fn new(name: &'static str, offset: usize) -> Self {
            Field {
                name,
                offset,
                _load: PhantomData,
            }
        }

        /// What userspace checks: name, offset and the size BPF loads.
        pub const fn layout(&self) -> Layout {
            Layout {
                name: self.name,
                offset: self.offset,
                size: core::mem::size_of::<T>(),
            }
        }
    }

    /// A field's place in the record, whatever its load type.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Layout {
        pub name: &'static str,
        pub offset: usize,
        pub size: usize,
    }

    // syscalls:sys_{enter,exit}_*: the syscall number, then each argument
    // (or the return value) as an 8-byte slot.

    /// The syscall number (`sys_enter_*` and `sys_exit_*`).
    pub const SYSCALL_NR: Field<i32> = Field::new("__syscall_nr", 8);
    /// `sys_exit_*`: the return value.
    pub const SYSCALL_RET: Field<i64> = Field::new("ret", 16);
    /// `sys_enter_epoll_wait`/`epoll_pwait`/`epoll_pwait2`: the epoll fd.
    pub const EPOLL_EPFD: Field<u64> = Field::new("epfd", 16);
    /// `sys_enter_poll`/`ppoll`: the `struct pollfd` array.
    pub const POLL_UFDS: Field<u64> = Field::new("ufds", 16);
    /// `sys_enter_poll`/`ppoll`: its length.
    pub const POLL_NFDS: Field<u64> = Field::new("nfds", 24);
    /// `sys_enter_select`/`pselect6`: nfds.
    pub const SELECT_N: Field<u64> = Field::new("n", 16);

    /// `sched:sched_switch`: the state the previous task leaves in.
    pub const SWITCH_PREV_STATE: Field<i64> = Field::new("prev_state", 32);
    /// `sched:sched_switch`: the task switched to.
    pub const SWITCH_NEXT_PID: Field<i32> = Field::new("next_pid", 56);
    /// `sched:sched_wakeup`: the task woken.
    pub const WAKEUP_PID: Field<i32> = Field::new("pid", 24);
    /// `sched:sched_process_exit`: the whole thread group is gone.
    pub const EXIT_GROUP_DEAD: Field<u8> = Field::new("group_dead", 32);

    /// Loaded by `sp_wait_exit` from every `sys_exit_<wait>`.
    pub const SYS_EXIT: &[Layout] = &[SYSCALL_NR.layout(), SYSCALL_RET.layout()];
    /// Loaded by `sp_sched_switch`.
    pub const SCHED_SWITCH: &[Layout] = &[SWITCH_PREV_STATE.layout(), SWITCH_NEXT_PID.layout()];
    /// Loaded by `sp_sched_wakeup`.
    pub const SCHED_WAKEUP: &[Layout] = &[WAKEUP_PID.layout()];
    /// Loaded by `sp_exit`.
    pub const SCHED_PROCESS_EXIT: &[Layout] = &[EXIT_GROUP_DEAD.layout()];

    const EPOLL_ENTER: &[Layout] = &[SYSCALL_NR.layout(), EPOLL_EPFD.layout()];
    const POLL_ENTER: &[Layout] = &[SYSCALL_NR.layout(), POLL_UFDS.layout(), POLL_NFDS.layout()];
    const SELECT_ENTER: &[Layout] = &[SYSCALL_NR.layout(), SELECT_N.layout()];

    /// Loaded by `sp_wait_enter` from `sys_enter_<wait>` of syscall `nr`
    /// (the same three cases it distinguishes).
    pub const fn sys_enter(nr: u32) -> &'static [Layout] {
        if sysno::is_epoll(nr) {
            EPOLL_ENTER
        } else if nr == sysno::POLL || nr == sysno::PPOLL {
            POLL_ENTER
        } else {
            SELECT_ENTER
        }
    }
}

/// What one count of a counter cost the recording: nothing
/// ([`Cost::Harmless`]: no stall, no part of a stall's time, no frame and
/// no detail lost), or which part of what it says. Every counter, the
/// kernel's ([`Drop`], [`Filtered`]) and the agent's, names one; the summary
/// says the costly ones always and the harmless ones with `-v`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cost {
    /// Nothing a stall says was lost.
    Harmless,
    /// A stall, or part of a stall's time, may be missing.
    Stalls,
    /// A stall's time is all there, but its split (on-CPU, blocked,
    /// run queue, throttled) may be off.
    Split,
    /// Frames are missing from a stack, or left unnamed.
    Frames,
    /// Who held the CPU during a run-queue wait is missing.
    Holders,
    /// A stall's detail is missing: its syscall, asyncio task or route.
    Detail,
    /// The saved raw events (`--save-events`) are cut short: a replay
    /// misses the rest.
    Saved,
    /// Stalls did not reach the tracing backend (OTLP); the local outputs
    /// have them.
    Exported,
}

impl Cost {
    /// The words docs/format.md's table of counters and the summary use.
    pub const fn as_str(self) -> &'static str {
        match self {
            Cost::Harmless => "harmless",
            Cost::Stalls => "stall time lost",
            Cost::Split => "time split off",
            Cost::Frames => "frames missing",
            Cost::Holders => "CPU holders missing",
            Cost::Detail => "detail missing",
            Cost::Saved => "saved events cut",
            Cost::Exported => "spans not exported",
        }
    }
}

/// Declares a counter enum whose discriminants index a per-CPU array of
/// `COUNT` slots (`STATS`, `FILTERED` in `profiler-ebpf`). The variants,
/// `ALL`, `COUNT`, `name()`, `cost()` and `meaning()` are generated from one
/// list, so none can miss a variant; a const assertion checks that the
/// discriminants are exactly `0..COUNT` in declaration order (every variant
/// has a slot in the array, every slot a variant) and that the names are
/// distinct (they are the keys of `drops`/`filtered` in `stalls.json` and
/// the metrics).
///
/// Each variant: `Var = index => "name", Cost, "what one count means",`.
/// The meaning is the one place it is said (the summary's counter lines,
/// docs/format.md's table, checked by a test); it reads after `name=N — `.
macro_rules! counters {
    (
        $(#[$meta:meta])*
        pub enum $ty:ident {
            $( $(#[$vmeta:meta])* $var:ident = $idx:literal => $name:literal, $cost:ident, $meaning:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $ty {
            $( $(#[$vmeta])* $var = $idx, )+
        }

        impl $ty {
            /// Every variant, in index order.
            pub const ALL: [$ty; [$($idx),+].len()] = [$($ty::$var),+];
            /// Slots of the per-CPU counter array: one per variant.
            pub const COUNT: u32 = $ty::ALL.len() as u32;

            /// Stable snake_case name used in `stalls.json` and metrics.
            pub const fn name(self) -> &'static str {
                match self {
                    $( $ty::$var => $name, )+
                }
            }

            /// What one count cost the recording.
            pub const fn cost(self) -> Cost {
                match self {
                    $( $ty::$var => Cost::$cost, )+
                }
            }

            /// What one count means and what it cost, in a phrase.
            pub const fn meaning(self) -> &'static str {
                match self {
                    $( $ty::$var => $meaning, )+
                }
            }
        }

        const _: () = {
            let all = $ty::ALL;
            let mut i = 0;
            while i < all.len() {
                assert!(
                    all[i] as u32 == i as u32,
                    concat!(
                        stringify!($ty),
                        ": discriminants must be 0..COUNT in declaration order \
                         (they index a per-CPU array of COUNT slots)"
                    )
                );
                let mut j = 0;
                while j < i {
                    assert!(
                        !str_eq(all[i].name(), all[j].name()),
                        concat!(stringify!($ty), ": two counters share a name")
                    );
                    j += 1;
                }
                i += 1;
            }
        };
    };
}

/// `a == b`, usable in const assertions.
const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

counters! {
    /// Per-CPU failure counters: every failed read, full map or dropped event
    /// in the BPF programs increments one of these. Index = discriminant.
    pub enum Drop {
        /// Ring buffer full: an event was lost.
        RingbufFull = 0 => "ringbuf_full", Stalls,
            "an event the ring buffer had no room for: a stall, or part of its time, may be missing",
        /// `bpf_get_stack` failed for a kernel stack.
        KstackFailed = 1 => "kernel_stack_failed", Frames,
            "a kernel stack could not be read: its kernel frames are missing",
        /// `bpf_get_stack` failed for a user stack.
        UstackFailed = 2 => "user_stack_failed", Frames,
            "a user stack could not be walked by its frame pointers: its native frames may be missing",
        /// The thread table was full: a new thread could not be tracked.
        ThreadTableFull = 3 => "thread_table_full", Stalls,
            "a thread found the thread table full: it is not tracked, its stalls are missing",
        /// No longer counted by the kernel side (recordings before
        /// 2026-12-03 have it): the agent counts `user_stack_truncated`
        /// where a full frame-pointer stack is kept, not replaced by the
        /// one it unwinds.
        UstackTruncated = 4 => "user_stack_truncated", Frames,
            "a frame-pointer user stack filled the kernel's buffer: its outer frames may be missing",
        /// Reading `pt_regs` to learn the blocking syscall failed.
        SyscallUnknown = 5 => "syscall_unknown", Detail,
            "a blocked part's syscall could not be read: it is not named",
        /// Reading the Python thread state or a frame failed.
        PyReadFailed = 6 => "python_read_failed", Frames,
            "a Python thread state or frame could not be read: that stack's Python frames are missing",
        /// The Python frame chain was longer than `python::PY_MAX_FRAMES`.
        PyTruncated = 7 => "python_stack_truncated", Frames,
            "a Python stack over 64 frames (all the kernel reads): its outer Python frames are missing",
        /// Copying the user stack failed (even the smallest window).
        StackCopyFailed = 8 => "user_stack_copy_failed", Frames,
            "a user stack could not be copied for unwinding: only its frame-pointer walk is left",
        /// Reading a task's ids at a raw scheduler tracepoint failed: that
        /// switch or wakeup was not seen.
        TaskReadFailed = 9 => "task_read_failed", Split,
            "a context switch or wakeup was not seen: a stall's split may be off",
        /// Reading a task's cfs_rq (throttling) failed.
        ThrottleReadFailed = 10 => "throttle_read_failed", Split,
            "a wait's CPU throttling could not be read: throttled time may show as run-queue wait",
        /// A loop thread waited for a CPU another loop thread already
        /// waited for: its CPU holders are not recorded.
        CpuWaitSlotBusy = 11 => "cpu_wait_slot_busy", Holders,
            "a loop thread waited for a CPU another one already waited for: who held it is missing",
        /// A CPU number past `MAX_CPUS`: no CPU holders recorded there.
        CpuWaitNoSlot = 12 => "cpu_wait_no_slot", Holders,
            "a CPU numbered past the ones sized for: who held it during a run-queue wait is missing",
        /// Reading a thread's run-queue clock or its last arrival on a CPU
        /// at a per-thread switch event failed: its time off the CPU is
        /// taken to end at its next event instead of its switch-in.
        SwitchClockFailed = 13 => "switch_clock_read_failed", Split,
            "a switch's run-queue clock could not be read: the thread's time off the CPU runs to its next event",
        /// No build slot for a stack event on this CPU (a CPU number past
        /// the ones the agent sized `STACK_SCRATCH` for): the event was lost.
        StackScratchMissing = 14 => "stack_scratch_missing", Stalls,
            "a CPU numbered past the ones sized for: a stack event (a sample or a switch) was lost",
        /// CPython 3.14+: a read of the running asyncio task's object, its
        /// name or its coroutine's frame failed with a stack event (or no
        /// scratch slot to build the `TaskEvent`): userspace reads the task
        /// itself later, which fails for a task freed by then.
        TaskSnapshotFailed = 15 => "asyncio_task_snapshot_failed", Detail,
            "the running asyncio task could not be read with a stack: read later, missing if it had ended",
        /// A process started under the recorded one found `WATCHED` full
        /// ([`MAX_WATCHED`](super::MAX_WATCHED)): it is not watched.
        WatchedFull = 16 => "watched_processes_full", Stalls,
            "a process started under the target found the watch table full: its stalls are missing",
    }
}

counters! {
    /// Per-CPU counters of work the kernel side saved by design (not
    /// failures): see `SAMPLE_AFTER_NS` in `profiler-ebpf`. Index =
    /// discriminant.
    pub enum Filtered {
        /// Busy periods of a known loop that ended quiet (no other event)
        /// before the sampling gate: neither their wait return nor their wait
        /// entry was reported.
        QuietBusy = 0 => "short_busy_periods", Harmless,
            "a busy period that ended before the sampling gate: not reported, by design",
        /// CPU samples skipped because the thread's busy period was younger
        /// than the sampling gate.
        YoungSamples = 1 => "samples_before_gate", Harmless,
            "a sample in a busy period's first --sample-after: skipped, by design",
        /// Daemon: waits (and runtime parks) of a process the rules leave
        /// out (`LEFT_OUT`), skipped before any record or thread state.
        LeftOutWaits = 2 => "left_out_waits", Harmless,
            "daemon: a wait of a process the rules leave out: skipped, by design",
    }
}

/// Common prefix of every ring-buffer record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventHeader {
    /// One of [`kind`].
    pub kind: u32,
    /// Thread id (kernel pid) the event is about.
    pub tid: u32,
    /// Thread-group id (process id).
    pub tgid: u32,
    /// CPU the event was recorded on.
    pub cpu: u32,
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC.
    pub ts_ns: u64,
}

/// Entry into or return from a wait syscall.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitEvent {
    pub hdr: EventHeader,
    /// Syscall number (one of [`sysno::WAITS`]).
    pub nr: u32,
    /// epoll: the epoll fd; poll/ppoll: the first pollfd's fd; select: nfds.
    pub fd: i32,
    /// Return value (exit only).
    pub ret: i64,
}

/// Scheduler event about a tracked thread: switch-in, wakeup, exit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedEvent {
    pub hdr: EventHeader,
    /// Wakeup: tid of the waker (the task current at wakeup, which in interrupt
    /// context may be unrelated). Exit: 1 when the whole process exited.
    /// Preempted: [`preempt`] flags. Switch-in: after a throttled
    /// preemption, the ns throttled ([`THROTTLE_NOT_MEASURED`]).
    pub arg: u32,
    pub _pad: u32,
}

/// A task that ran on the CPU a loop thread was waiting for (`hdr.tid`,
/// `hdr.tgid`: the waiting thread; `hdr.ts`: its switch-in; `hdr.cpu`: the
/// CPU it waited on).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuHolderEvent {
    pub hdr: EventHeader,
    /// The holder's thread id and process id (0: the idle task).
    pub pid: u32,
    pub tgid: u32,
    /// How long it ran on that CPU while the loop thread waited there.
    pub ns: u64,
    /// Its `comm`, NUL-padded.
    pub comm: [u8; COMM_LEN],
}

/// Bytes of a task object a `TaskEvent` carries (3.14's `TaskObj` is 168).
pub const TASK_OBJ_BYTES: usize = 256;
/// Bytes of a task's name object a `TaskEvent` carries: a compact ASCII
/// `str` header (40 bytes on 3.14) and up to 87 characters, or an `int`.
pub const TASK_NAME_BYTES: usize = 128;
/// Tasks a `TaskEvent` carries: the running one and the first tasks of its
/// await chain (each awaited by one task, not a set). Userspace follows a
/// longer chain in live memory.
pub const TASK_CHAIN: usize = 4;

/// One task of a `TaskEvent`: the object and its name, each with its
/// address. A length of 0: that read failed (counted).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TaskPart {
    /// The task object, and its name object (`task + task_name`).
    pub task: u64,
    pub name: u64,
    /// Where the name type's `tp_flags` is (0: not read), and its value.
    pub name_flags_at: u64,
    pub name_flags: u64,
    /// Valid bytes of `task_bytes` and `name_bytes`.
    pub task_len: u32,
    pub name_len: u32,
    pub task_bytes: [u8; TASK_OBJ_BYTES],
    pub name_bytes: [u8; TASK_NAME_BYTES],
}

/// The asyncio task running on a thread, read with one of its stack events
/// (`kind::TASK`, sent just before that `StackEvent`), so userspace can name
/// a task freed before it reads (a short-lived task, or the task awaiting
/// it). Each part is an address and the bytes read there; userspace parses
/// them as it parses live memory (`symbolize::python::tasks`). Sent cut
/// after its `parts_len` parts.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TaskEvent {
    pub hdr: EventHeader,
    /// The running task's coroutine frame: its code and instruction fields
    /// (`coro + gen_frame + PyOffsets::frame_code` / `frame_instr`; 0: not
    /// read) and their values.
    pub code_at: u64,
    pub code: u64,
    pub instr_at: u64,
    pub instr: u64,
    /// Valid entries of `parts`: the running task first, then the task
    /// awaiting it, and so on.
    pub parts_len: u32,
    pub _pad: u32,
    pub parts: [TaskPart; TASK_CHAIN],
}

/// An on-CPU sample or a switch-out, with the stacks at that moment.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct StackEvent {
    pub hdr: EventHeader,
    /// Switch-out: `prev_state` from `sched_switch` (0 or `TASK_REPORT_MAX`
    /// = still runnable, i.e. preempted). Samples: 0.
    pub state: i64,
    /// Switch-out: the syscall the thread was in (`orig_ax`), -1 if none or unknown.
    pub syscall: i64,
    /// Number of valid entries in `kstack` / `ustack`.
    pub kstack_len: u32,
    pub ustack_len: u32,
    /// Number of valid entries in `py`; `py_status` says why a walk stopped.
    pub py_len: u32,
    pub py_status: u32,
    /// Kernel return addresses, innermost first.
    pub kstack: [u64; MAX_KSTACK],
    /// User return addresses, innermost first.
    pub ustack: [u64; MAX_USTACK],
    /// Python frames, innermost first.
    pub py: [python::PyFrame; python::PY_MAX_FRAMES],
    /// Switch-out into a wait for the GIL: the `PyThreadState*` holding it
    /// (0 otherwise), and the holder's Python frames, innermost first.
    pub gil_holder: u64,
    /// CPython 3.14+: the asyncio task the thread was running when the
    /// event was captured (its `asyncio_running_task`; 0: none, or not
    /// read: see `PyProc::running_task`).
    pub task: u64,
    pub holder_py_len: u32,
    pub _pad3: u32,
    pub holder_py: [python::PyFrame; PY_HOLDER_FRAMES],
    /// User registers at the moment of the event (from `task_pt_regs`).
    pub regs: UserRegs,
    /// Valid bytes in `stack` (0 if the copy failed).
    pub stack_len: u32,
    pub _pad2: u32,
    /// User stack bytes from `regs.sp` upwards.
    pub stack: [u8; USER_STACK_COPY],
}

/// Python frames kept of a GIL holder's stack (its innermost ones).
pub const PY_HOLDER_FRAMES: usize = 32;
/// Python-using processes tracked at once (`PY_PROCS`).
pub const MAX_PY_PROCS: u32 = 1024;
/// Daemon: processes the rules leave out whose waits the kernel side skips
/// at once (`LEFT_OUT`). Past it, a left-out process is followed as before
/// its judgement (its stalls are still dropped in userspace), and
/// `left_out_full` counts it.
pub const MAX_LEFT_OUT: u32 = 4096;
/// `record`: processes of the recorded tree watched at once besides its
/// root (`WATCHED`): a supervisor's workers and what they start.
pub const MAX_WATCHED: u32 = 4096;

/// What BPF needs to walk one process's Python stacks and recognise waits
/// for its GIL (`PY_PROCS` map, keyed by tgid; set by userspace at attach).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyProc {
    pub offsets: python::PyOffsets,
    /// Address of the GIL's `locked` field; 0 = unknown (no GIL labelling).
    pub gil_locked: u64,
    /// Address of the GIL's `last_holder` field.
    pub gil_last_holder: u64,
    /// CPython 3.14+: offset of `_PyThreadStateImpl.asyncio_running_task`
    /// (from the `_asyncio` module's debug offsets, set once they are
    /// read); 0: the running task is not read with the stack.
    pub running_task: u64,
    /// With `running_task`: where the task's parts are, for the
    /// `TaskEvent` sent with each stack.
    pub task: python::TaskLayout,
}

/// A futex wait whose address lies within this many bytes after the GIL's
/// `locked` field (the GIL's mutex and condition variable follow it in
/// `struct _gil_runtime_state`) is a wait for the GIL.
pub const GIL_STRUCT_SPAN: u64 = 256;

/// The user registers an unwinder starts from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UserRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

/// `StackEvent::py_status`: how the Python frame walk ended.
pub mod py_status {
    /// No walk: not a Python thread, or Python support off.
    pub const NONE: u32 = 0;
    /// Walked to the outermost frame.
    pub const COMPLETE: u32 = 1;
    /// Stopped at `python::PY_MAX_FRAMES`: outer frames are missing.
    pub const TRUNCATED: u32 = 2;
    /// A read of interpreter memory failed part-way.
    pub const READ_FAILED: u32 = 3;
}

/// `sched_switch`'s `prev_state` for a preempted task (`TASK_REPORT_MAX`).
pub const TASK_REPORT_MAX: i64 = 0x100;

impl StackEvent {
    /// True when the thread was still runnable at switch-out (preempted or
    /// yielded): the time until it runs again is run-queue wait.
    pub const fn runnable(&self) -> bool {
        self.state == 0 || self.state & TASK_REPORT_MAX != 0
    }
}

/// Kernel-side per-thread state (`THREADS` map), written only by BPF.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadState {
    /// Key of the wait the thread is in now (see [`wait_key`]), 0 when running.
    pub wait_key: u64,
    /// Process the thread belongs to.
    pub tgid: u32,
    /// 1 when a switch-out was reported and the matching switch-in is pending.
    pub off_reported: u32,
    /// 1 while inside a runtime park function (tokio): parked whatever
    /// syscalls it makes meanwhile.
    pub in_park: u32,
    /// 1 while the return from the loop's wait (at `busy_since`) has not been
    /// reported yet: it is reported with the thread's next event, or never
    /// if the busy period ends quiet and shorter than `SAMPLE_AFTER_NS`.
    pub exit_pending: u32,
    /// When the thread last returned from its loop's wait (0: unknown).
    pub busy_since: u64,
    /// The deferred return: syscall number, fd of its key, return value.
    pub exit_nr: u32,
    pub exit_fd: i32,
    pub exit_ret: i64,
    /// The thread's `LOOP_KEYS` entry (0: none) as of publication
    /// generation `loop_gen` (`LOOP_GEN`): a hash lookup saved on every wait.
    pub loop_key: u64,
    pub loop_gen: u64,
    /// The syscall of the wait it is in (a uretprobe's return does not say).
    pub wait_nr: u32,
    /// The CPU whose `CPU_WAITS` slot holds this thread's wait for a CPU
    /// (valid while `off_reported`).
    pub wait_cpu: u32,
    /// A throttled preemption whose switch-in is pending: the thread's
    /// `task_struct`, its cfs_rq, and that cfs_rq's
    /// `throttled_clock_self_time` at the switch-out (`thr_rq` 0: none).
    pub thr_task: u64,
    pub thr_rq: u64,
    pub thr_self: u64,
    /// Leaving its park: the thread's `sched_info.run_delay` (ns it ever
    /// waited runnable for a CPU) when it last went to sleep there
    /// ([`NO_RUN_DELAY`]: it did not sleep, or the kernel does not keep it),
    /// and at a throttled switch-out there; when it was throttled on its way
    /// back to user space (6.18 throttles there, before a uretprobe on the
    /// wait sees the return; 0: not), back in after that, and that
    /// `SWITCH_IN` arg. The wait's return reports these as its busy
    /// period's first waits (`throttle::report_park_waits`): the run delay
    /// grown since the sleep is the wait from its wakeup to a CPU, measured
    /// without a program on the host's wakeups.
    pub park_rd: u64,
    pub park_rd_thr: u64,
    pub park_thr_out: u64,
    pub park_thr_in: u64,
    pub park_thr_arg: u32,
    /// 1 while counted in `OFF_CPU` for a switch-in still to come.
    pub park_off: u32,
    /// Per-thread switch events (no program runs when a thread comes back
    /// on a CPU): 1 when its last switch-out left it runnable; then, at
    /// that switch-out, the time (`bpf_ktime_get_ns`), its run queue's
    /// clock (`rq.clock`, the clock of `sched_info`; 0: unread) and its
    /// `sched_info.run_delay` ([`NO_RUN_DELAY`]: unread). Its next event
    /// dates its switch-in from `sched_info.last_arrival` against these,
    /// and its wakeup from the run delay grown meanwhile.
    pub out_runnable: u32,
    pub out_ns: u64,
    pub out_clock: u64,
    pub out_rd: u64,
}

/// A loop thread woken from its park that waits at least this long for a
/// CPU has the wait reported as its busy period's first part (shorter
/// ones are left out: two more events on every loop iteration of a busy
/// host would cost more than they say).
pub const WOKEN_WAIT_MIN_NS: u64 = 1_000_000;

/// `ThreadState::park_rd` when there is no run delay to compare with.
pub const NO_RUN_DELAY: u64 = u64::MAX;

/// A `WAKEUP` arg when the waker is not known: the wakeup was dated from
/// the thread's run delay at its next event (per-thread switch events),
/// no program ran at the wakeup itself.
pub const NO_WAKER: u32 = u32::MAX;

/// One task that held a CPU while a loop thread waited there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuHeld {
    pub pid: u32,
    pub tgid: u32,
    pub ns: u64,
    pub comm: [u8; COMM_LEN],
}

/// Per CPU (`CPU_WAITS`, indexed by CPU number): the loop thread waiting
/// for this CPU, if any, and who has held it since.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuWait {
    /// The waiting loop thread (0: none) and its process.
    pub tid: u32,
    pub tgid: u32,
    /// When the task now on the CPU got it (the last switch here).
    pub since: u64,
    /// Holders recorded in `held`.
    pub n: u32,
    pub _pad: u32,
    /// Time of the tasks past `MAX_CPU_HOLDERS`.
    pub others_ns: u64,
    pub held: [CpuHeld; MAX_CPU_HOLDERS],
}

/// Slots of `CPU_WAITS`: CPU numbers this many and above get no holders
/// (counted, `cpu_wait_no_slot`).
pub const MAX_CPUS: u32 = 1024;

/// `CpuHolderEvent::pid` of the summed time of the tasks past
/// `MAX_CPU_HOLDERS` (no comm).
pub const CPU_HOLDER_OTHERS: u32 = u32::MAX;

/// Wait-key class of a runtime park function (see [`wait_key`]).
pub const WAIT_CLASS_PARK: u64 = 3;

/// Identity of a wait: syscall class and fd. Userspace publishes the loop's
/// key per thread in `LOOP_KEYS`; BPF treats a wait with that key (or any
/// wait, before a key is known) as parked and stays quiet while parked.
///
/// Class 1 = epoll family (fd: the epoll fd), 2 = poll/ppoll (fd: the
/// first pollfd's), 3 = a runtime's park function, 4 = select/pselect6.
/// select's one identifying argument, nfds, changes whenever the program
/// opens a higher fd, so every select of a thread is one key (fd 0).
pub const fn wait_key(nr: u32, fd: i32) -> u64 {
    let (class, fd): (u64, i32) = if sysno::is_epoll(nr) {
        (1, fd)
    } else if nr == sysno::RUNTIME_PARK {
        (WAIT_CLASS_PARK, fd)
    } else if nr == sysno::SELECT || nr == sysno::PSELECT6 {
        (4, 0)
    } else {
        (2, fd)
    };
    (class << 32) | (fd as u32 as u64)
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for PyProc {}
    unsafe impl aya::Pod for TaskEvent {}
    unsafe impl aya::Pod for ThreadState {}
    unsafe impl aya::Pod for CpuWait {}
    unsafe impl aya::Pod for EventHeader {}
}
