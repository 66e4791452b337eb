//! Wait syscalls: a thread parks in its loop's wait and unparks; the
//! sampling gate.
//!
//! In: uprobes on the C library's wait functions in the watched process
//! (`sp_uwait_*`, the default), or `syscalls:sys_{enter,exit}_<wait>` for
//! the waits in `profiler_common::sysno::WAITS` (the fallback, for a
//! process whose waits no uprobe can see: raw syscalls, a static binary
//! without symbols); the loop keys userspace publishes
//! (`LOOP_KEYS`, `LOOP_GEN`); `SAMPLE_AFTER_NS`. Out: `WaitEvent`s
//! (`WAIT_ENTER`/`WAIT_EXIT`), the thread's wait and gate state in
//! `THREADS`, and the answers the other programs ask: is this thread
//! parked (`parked`), is this busy period still under the gate
//! (`before_gate`).
//!
//! Constraints: the uprobes fire only in the processes they were attached
//! for. The syscall tracepoints fire for every process's waits on the host
//! (a non-target costs one tgid compare), and enabling them puts every
//! syscall of every process on the kernel's tracing slow path. A
//! thread's loop key is cached in `THREADS` and re-read only when
//! `LOOP_GEN` moves. A `select` or `poll` with no fds is a sleep, not a
//! wait, and is ignored.
use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        generated::bpf_get_attach_cookie,
    },
    macros::{tracepoint, uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
};
use profiler_common::{Drop, Filtered, ThreadState, WaitEvent, kind, sysno, tracepoint, wait_key};

use crate::{
    SAMPLE_AFTER_NS,
    maps::{
        LOOP_GEN, LOOP_KEYS, THREADS, WAIT_TRACEPOINTS, count, current_target, current_tracked,
        emit, header, is_target, left_out, new_thread, note,
    },
    throttle,
    tracepoint::tp_field,
};

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
pub(crate) fn parked(tid: u32, st: &mut ThreadState) -> bool {
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

/// True when `key` is the published loop wait of `tid`.
#[inline(always)]
pub(crate) fn is_loop_key(tid: u32, st: &mut ThreadState, key: u64) -> bool {
    loop_key(tid, st) == key
}

/// Hold back the return from the loop's wait (see `SAMPLE_AFTER_NS`).
/// Returns false when the gate is off: report it now.
#[inline(always)]
pub(crate) fn defer_exit(st: &mut ThreadState, now: u64, nr: u32, fd: i32, ret: i64) -> bool {
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
pub(crate) fn quiet_busy(tid: u32, st: &mut ThreadState, key: u64) -> bool {
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

/// True while the thread's busy period is younger than the gate: a CPU
/// sample now is skipped (and counted).
#[inline(always)]
pub(crate) fn before_gate(st: &ThreadState) -> bool {
    let gate = SAMPLE_AFTER_NS.load();
    if gate != 0
        && st.busy_since != 0
        && unsafe { bpf_ktime_get_ns() }.wrapping_sub(st.busy_since) < gate
    {
        note(Filtered::YoungSamples);
        return true;
    }
    false
}

/// Report a held-back wait return before any other event of the thread, so
/// userspace sees the busy period open at its true start.
#[inline(always)]
pub(crate) fn flush_exit(tid: u32, tgid: u32, st: &mut ThreadState) {
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

/// A thread enters a wait that may be its loop's: `fd` names the wait
/// (the epoll fd, a poll set's first fd, select's nfds).
#[inline(always)]
fn on_wait_enter(nr: u32, fd: i32) -> u32 {
    let Some((tgid, tid)) = current_target() else {
        return 0;
    };
    if left_out(tgid, tid) {
        return 0;
    }
    let key = wait_key(nr, fd);
    match THREADS.get_ptr_mut(&tid) {
        Some(st) => {
            let st = unsafe { &mut *st };
            crate::sched::came_back(tid, tgid, st);
            if st.in_park != 0 {
                return 0; // the runtime's own wait inside its park function
            }
            st.wait_key = key;
            st.wait_nr = nr;
            throttle::wait_entered(st);
            if quiet_busy(tid, st, key) {
                return 0;
            }
            flush_exit(tid, tgid, st);
        }
        None => {
            let mut st = new_thread(tgid, key, 0);
            st.wait_nr = nr;
            if THREADS.insert(&tid, &st, 0).is_err() {
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

/// A thread returns from a wait `on_wait_enter` saw (`nr`: the syscall, or
/// `None` for the one it entered).
#[inline(always)]
fn on_wait_exit(nr: Option<u32>, ret: i64) -> u32 {
    let Some((tgid, tid, st)) = current_tracked() else {
        return 0;
    };
    crate::sched::came_back(tid, tgid, st);
    let key = st.wait_key;
    if key == 0 {
        return 0; // a sleep (see sp_wait_enter), or entered before attach
    }
    st.wait_key = 0;
    let nr = nr.unwrap_or(st.wait_nr);
    if is_loop_key(tid, st, key)
        && throttle::report_park_waits(tid, tgid, st, nr, key as u32 as i32, ret)
    {
        // The busy period began when it left the wait (woken, then
        // waiting for a CPU or throttled), reported with those waits.
        return 0;
    }
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

/// A wait with these arguments (its first two: the epoll fd, the poll set
/// and its size, or select's nfds): the fd that names it, or None for a
/// sleep (`select(0, …)` is CPython 3.10's `time.sleep`, `poll(NULL, 0, t)`
/// a sleep too).
#[inline(always)]
fn wait_fd(nr: u32, arg0: u64, arg1: u64) -> Option<i32> {
    if sysno::is_epoll(nr) {
        Some(arg0 as i32)
    } else if nr == sysno::POLL || nr == sysno::PPOLL {
        poll_fd(arg0, arg1)
    } else {
        (arg0 != 0).then_some(arg0 as i32)
    }
}

/// `syscalls:sys_enter_{epoll_wait,epoll_pwait,epoll_pwait2,poll,ppoll,select,pselect6}`
/// (the fallback: enabling any syscall tracepoint sends every syscall of
/// every process on the host through the kernel's tracing slow path).
#[tracepoint]
pub fn sp_wait_enter(ctx: TracePointContext) -> u32 {
    if !is_target((bpf_get_current_pid_tgid() >> 32) as u32) {
        return 0;
    }
    // The fields loaded per case are `tracepoint::sys_enter(nr)`'s.
    let nr = tp_field(&ctx, tracepoint::SYSCALL_NR) as u32;
    let (arg0, arg1) = if sysno::is_epoll(nr) {
        (tp_field(&ctx, tracepoint::EPOLL_EPFD), 0)
    } else if nr == sysno::POLL || nr == sysno::PPOLL {
        (
            tp_field(&ctx, tracepoint::POLL_UFDS),
            tp_field(&ctx, tracepoint::POLL_NFDS),
        )
    } else {
        (tp_field(&ctx, tracepoint::SELECT_N), 0)
    };
    match wait_fd(nr, arg0, arg1) {
        Some(fd) => on_wait_enter(nr, fd),
        None => 0,
    }
}

/// `syscalls:sys_exit_*` for the same wait syscalls (the fallback).
#[tracepoint]
pub fn sp_wait_exit(ctx: TracePointContext) -> u32 {
    let nr = tp_field(&ctx, tracepoint::SYSCALL_NR) as u32;
    let ret = tp_field(&ctx, tracepoint::SYSCALL_RET);
    on_wait_exit(Some(nr), ret)
}

/// True once the syscall tracepoints serve the waits (`WAIT_TRACEPOINTS`).
#[inline(always)]
fn tracepoints_serve() -> bool {
    WAIT_TRACEPOINTS.get(0).is_some_and(|v| *v != 0)
}

/// A uprobe on a C library wait function (`epoll_wait`, `poll`, `select`,
/// …) in the watched process only; the attach cookie is the syscall it
/// makes. Userspace places it on an instruction before the syscall that
/// the kernel emulates (the function's first branch, the arguments still
/// in their registers) rather than single-steps: on the bench VM a
/// single-stepped uprobe costs ~10 µs a hit, an emulated one ~0.7 µs.
#[uprobe]
pub fn sp_uwait_enter(ctx: ProbeContext) -> u32 {
    if current_target().is_none() || tracepoints_serve() {
        return 0;
    }
    let nr = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let arg0: u64 = ctx.arg(0).unwrap_or(0);
    let arg1: u64 = ctx.arg(1).unwrap_or(0);
    match wait_fd(nr, arg0, arg1) {
        Some(fd) => on_wait_enter(nr, fd),
        None => 0,
    }
}

/// The return of a wait function `sp_uwait_enter` saw (a uretprobe: on
/// x86-64 since 6.11 the return costs a system call, not a trap).
#[uretprobe]
pub fn sp_uwait_exit(ctx: RetProbeContext) -> u32 {
    if tracepoints_serve() {
        return 0;
    }
    let ret: i64 = ctx.ret();
    on_wait_exit(None, ret)
}
