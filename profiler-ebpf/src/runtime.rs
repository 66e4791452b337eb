//! A runtime's own park function as the loop wait (tokio's scheduler
//! `park_internal`).
//!
//! In: a uprobe and a uretprobe on the park function, attached by userspace
//! once it has found the symbol (`profiler/src/runtimes.rs`). Out:
//! `WaitEvent`s with the pseudo syscall `sysno::RUNTIME_PARK`, and the
//! thread's `in_park` flag in `THREADS`, which keeps the syscalls made
//! inside the park (tokio's own `epoll_wait`) from counting as waits.
//!
//! Constraints: one uprobe pair per park, not per task poll. A worker
//! already parked when the probes attach is first seen at its next park.
use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{Drop, WaitEvent, kind, sysno, wait_key};

use crate::{
    maps::{THREADS, count, current_target, emit, header, left_out, new_thread},
    waits::{defer_exit, flush_exit, is_loop_key, quiet_busy},
};

/// Entry to / return from a runtime's park function (tokio's scheduler
/// `park_internal`): reported as a wait with `sysno::RUNTIME_PARK`.
#[inline(always)]
fn runtime_park(enter: bool) -> u32 {
    let Some((tgid, tid)) = current_target() else {
        return 0;
    };
    if left_out(tgid, tid) {
        return 0;
    }
    let key = wait_key(sysno::RUNTIME_PARK, 0);
    match THREADS.get_ptr_mut(&tid) {
        Some(st) => {
            let st = unsafe { &mut *st };
            crate::sched::came_back(tid, tgid, st);
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
