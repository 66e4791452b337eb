//! Reading a tracepoint's record.
//!
//! In: the context of a `#[tracepoint]` program and a field's offset. Out:
//! the field's value.
//!
//! Constraints: the offsets are the kernel's record layout (tracefs's
//! `events/<category>/<name>/format`); a load at the wrong offset reads
//! another field without any error, so they must match the running kernel.
use aya_ebpf::{EbpfContext, programs::TracePointContext};

/// A field of a tracepoint record, read straight from the context: the
/// verifier allows aligned loads from a tracepoint's record, and unlike
/// `read_at` (a `bpf_probe_read_kernel` call, fault handling included) this
/// is one load — it matters on paths that run at every context switch.
#[inline(always)]
pub(crate) fn tp_field<T: Copy>(ctx: &TracePointContext, offset: usize) -> T {
    unsafe { core::ptr::read((ctx.as_ptr() as *const u8).add(offset) as *const T) }
}
