//! Stack capture: one `StackEvent` with everything userspace needs to name
//! where a thread is.
//!
//! In: the program context (a `sched_switch` tracepoint or a CPU-clock perf
//! event) of the current task. Out: a `StackEvent` written in place in the
//! ring buffer: kernel stack, frame-pointer user stack, user registers from
//! `task_pt_regs`, the syscall the thread is in (`orig_ax`), a copy of up
//! to `USER_STACK_COPY` bytes of user stack from `sp`, and the Python
//! frames (`python::fill_python`).
//!
//! Constraints: the event (~67 KiB) is far larger than the 512-byte BPF
//! stack, so it is built in a per-CPU scratch slot and sent cut to its
//! valid bytes (`emit_stack_event`). Native
//! frames are not unwound here: the registers and the stack copy go to
//! userspace, which unwinds with `.eh_frame` (the targets are built
//! without frame pointers). Each failed read is counted.
use aya_ebpf::{
    EbpfContext,
    bindings::BPF_F_USER_STACK,
    helpers::{
        bpf_get_smp_processor_id, bpf_probe_read_kernel, bpf_probe_read_user,
        generated::{
            bpf_get_current_task_btf, bpf_get_stack, bpf_probe_read_user as read_user_raw,
            bpf_task_pt_regs,
        },
    },
};
use profiler_common::{
    Drop, MAX_KSTACK, MAX_USTACK, StackEvent, USER_STACK_COPY, UserRegs, kind, sysno,
};

use crate::{
    maps::{EVENTS, STACK_SCRATCH, count, header, wakeup_flags},
    python::fill_python,
};

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
        // A full stack (`MAX_USTACK` frames) may be truncated: userspace
        // counts it where it keeps this stack instead of the one it
        // unwinds from the copy (`user_stack_truncated`).
        (*ev).py_len = 0;
        (*ev).py_status = 0;
        copy_user_stack(ev);
    }
}

/// Copy the user stack window starting at the user stack pointer into the
/// event (its `stack_len`: 0 when nothing could be copied, counted).
///
/// A read fails as a whole if any page of it cannot be read without a
/// fault, so the window ends on a page boundary above `sp`, before the
/// first page that cannot: at most `USER_STACK_COPY` bytes. A main thread
/// near its top (Node's `uv_run` is a few KiB below it) keeps every frame;
/// a thread deep in its stack gets the full window.
///
/// Each page above `sp`'s own is probed, one byte, in order, until one
/// fails: at most `USER_STACK_COPY / 4096 - 1` probes and then one copy.
/// Every page must be probed, not only the window's last: a readable page
/// can lie beyond one that is not (past the stack's top, whatever is
/// mapped there; inside it, most likely a page an outer frame reserved and
/// never touched, which a nofault read cannot fault in), and a binary
/// search of last-byte probes then picked windows whose copy failed: Node
/// 24's main thread in the container tests lost most of its stacks to
/// one-page copies in 1 of 2 runs. A failed read of a whole window would
/// also zero it (a cost per byte), which the probes avoid. Should the copy
/// still fail (a page went away between probe and copy), the first page is
/// copied.
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
        // Bytes from sp to the next page boundary: 1..=PAGE.
        let head = PAGE - (sp & (PAGE - 1));
        let window = |pages: u64| head + (pages - 1) * PAGE;
        // sp's own page is readable; each further page while it is.
        let mut pages = 1u64;
        while pages < PAGES {
            let first = (sp + window(pages)) as *const u8;
            if bpf_probe_read_user(first).is_err() {
                break;
            }
            pages += 1;
        }
        let dst = (*ev).stack.as_mut_ptr().cast();
        let src = sp as *const core::ffi::c_void;
        for pages in [pages, 1] {
            // The bound is for the verifier: at most USER_STACK_COPY.
            let n = window(pages) as u32;
            if n as usize <= USER_STACK_COPY && read_user_raw(dst, n, src) == 0 {
                (*ev).stack_len = n;
                return;
            }
        }
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

/// Capture the current task into a new `StackEvent` of `kind` (`SAMPLE` or
/// `SWITCH_OUT`; `state` is `sched_switch`'s `prev_state`, 0 for samples)
/// and submit it. Only a switch-out records its syscall and can be a wait
/// for the GIL (a `futex` on it).
///
/// The event is built in this CPU's `STACK_SCRATCH` slot and copied into the
/// ring cut after its valid user-stack bytes (a reservation must be of a
/// constant size): a main thread's copy is often a few KiB of the 64, so
/// the ring holds several times as many events as when each took the full
/// size. The price is one copy of the valid bytes.
#[inline(always)]
pub(crate) fn emit_stack_event<C: EbpfContext>(
    ctx: &C,
    kind: u32,
    tid: u32,
    tgid: u32,
    state: i64,
) {
    let switch_out = kind == kind::SWITCH_OUT;
    let slot = 2 * unsafe { bpf_get_smp_processor_id() } + switch_out as u32;
    let Some(ev) = STACK_SCRATCH.get_ptr_mut(slot) else {
        count(Drop::StackScratchMissing);
        return;
    };
    let (regs, orig_ax, arg0) = user_regs();
    unsafe {
        (*ev).hdr = header(kind, tid, tgid);
        (*ev).state = state;
        (*ev).syscall = if switch_out { orig_ax } else { -1 };
        (*ev).regs = regs;
        (*ev).gil_holder = 0;
        (*ev).task = 0;
        (*ev).holder_py_len = 0;
    }
    fill_stacks(ctx, ev, switch_out);
    let futex_addr = if switch_out && orig_ax == sysno::FUTEX as i64 {
        arg0
    } else {
        0
    };
    fill_python(ev, tid, tgid, futex_addr, switch_out);
    // The copy's length is read back from the map, not carried in a
    // register: the verifier then explores what follows once, not once per
    // window size. The bound is for the verifier.
    let copied = unsafe { core::ptr::read_volatile(&raw const (*ev).stack_len) } as usize;
    let len = STACK_AT + copied.min(USER_STACK_COPY);
    // SAFETY: `ev` is a map value of size_of::<StackEvent>() >= len bytes.
    let bytes = unsafe { core::slice::from_raw_parts(ev.cast::<u8>(), len) };
    if EVENTS.output::<[u8]>(bytes, wakeup_flags()).is_err() {
        count(Drop::RingbufFull);
    }
}

/// Offset of the user-stack copy: every byte before it is always sent.
const STACK_AT: usize = core::mem::offset_of!(StackEvent, stack);
