//! Reading a tracepoint's record.
//!
//! In: the context of a `#[tracepoint]` program and one of the fields named
//! in `profiler_common::tracepoint`. Out: the field's value.
//!
//! Constraints: a classic tracepoint's record has no BTF relocation, so a
//! field is loaded at a fixed offset, and a wrong offset reads another
//! field without any error. Only fields named in
//! `profiler_common::tracepoint` are read: userspace checks each one's
//! offset and size against the running kernel's tracefs `format` file
//! before attaching.
use aya_ebpf::{EbpfContext, programs::TracePointContext};
use profiler_common::tracepoint::Field;

/// A field of a tracepoint record, read straight from the context: the
/// verifier allows aligned loads from a tracepoint's record, and unlike
/// `read_at` (a `bpf_probe_read_kernel` call, fault handling included) this
/// is one load — it matters on paths that run at every context switch.
#[inline(always)]
pub(crate) fn tp_field<T: Copy>(ctx: &TracePointContext, field: Field<T>) -> T {
    unsafe { core::ptr::read((ctx.as_ptr() as *const u8).add(field.offset) as *const T) }
}
