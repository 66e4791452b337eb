//! The userspace frame walk: `PyThreadState*` -> [`PyFrame`]s, newest first.
//!
//! In: a thread state address and the [`PyOffsets`] BPF also gets. Out: the
//! same records the BPF program emits. This is the reference for the BPF
//! implementation (same reads in the same order, same limits, see the
//! pseudo-code in `profiler_common::python`) and lets tests check the offsets
//! without loading BPF.

use profiler_common::python::{
    PY_FRAME_MODEL_FRAME_OBJECT, PY_MAX_FRAMES, PY_OFFSET_NONE, PY_OWNER_NONE, PyFrame, PyOffsets,
};

use super::PythonError;
use crate::os::memory::{ProcessMemory, ReadMemory};

/// Frames followed per walk, shims included: a bound for racy (or cyclic)
/// chains. BPF uses the same bound for its loop.
pub const MAX_HOPS: usize = 2 * PY_MAX_FRAMES;

pub fn walk_stack(
    mem: &ProcessMemory,
    off: &PyOffsets,
    tstate: u64,
) -> Result<Vec<PyFrame>, PythonError> {
    let mut frame = mem.read_u64(tstate + u64::from(off.tstate_frame))?;
    if off.cframe_current_frame != PY_OFFSET_NONE && frame != 0 {
        frame = mem.read_u64(frame + u64::from(off.cframe_current_frame))?;
    }
    let mut out = Vec::new();
    for _ in 0..MAX_HOPS {
        if frame == 0 || out.len() == PY_MAX_FRAMES {
            break;
        }
        let shim = off.frame_owner != PY_OFFSET_NONE
            && off.owner_shim_min != PY_OWNER_NONE
            && u16::from(mem.read_u8(frame + u64::from(off.frame_owner))?) >= off.owner_shim_min;
        if !shim {
            let code = mem.read_u64(frame + u64::from(off.frame_code))? & !off.code_tag_mask;
            let instr_addr = frame + u64::from(off.frame_instr);
            let instr = if off.frame_instr_size == 4 {
                // f_lasti is an int; keep -1 ("not started") as -1.
                mem.read_u32(instr_addr)? as i32 as i64 as u64
            } else {
                mem.read_u64(instr_addr)?
            };
            out.push(PyFrame { code, instr });
        }
        frame = mem.read_u64(frame + u64::from(off.frame_previous))?;
    }
    debug_assert!(off.frame_model != PY_FRAME_MODEL_FRAME_OBJECT || off.frame_instr_size == 4);
    Ok(out)
}
