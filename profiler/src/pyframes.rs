//! Python frames in stall stacks: resolving the (code object, instruction)
//! pairs the BPF walker ships, and merging them into the native stack.
//!
//! In: native frames (outermost first) and Python frames (outermost first).
//! Out: one stack where each run of interpreter eval-loop frames is replaced
//! by the Python frames it was executing, so C-extension frames stay below
//! the Python function that called them.
use std::collections::HashMap;

use crate::{
    model::{Frame, FrameKind},
    python::{CodeResolver, Interpreter, PyFrameInfo},
};

/// Native functions that execute Python bytecode: each activation runs one
/// or more Python frames.
fn is_eval_frame(name: &str) -> bool {
    name == "_PyEval_EvalFrameDefault" || name == "_PyEval_EvalFrame" || name.starts_with("_PyEval_Vector")
}

/// Merge Python frames into a native stack. Python frames go where the
/// outermost eval-loop frame was; eval-loop frames are dropped. Without
/// eval frames in the native stack (no unwinding through the interpreter),
/// Python frames go on top of the native ones, before the kernel.
pub fn merge(native: Vec<Frame>, python: Vec<Frame>, py_status: u32) -> Vec<Frame> {
    let mut out = Vec::with_capacity(native.len() + python.len() + 1);
    let truncated = py_status == profiler_common::py_status::TRUNCATED;
    let first_eval = native.iter().position(|f| f.kind == FrameKind::Native && is_eval_frame(&f.name));
    let mut py = Some(python);
    let emit_py = |out: &mut Vec<Frame>, py: &mut Option<Vec<Frame>>| {
        if let Some(p) = py.take() {
            if truncated {
                out.push(Frame::marker("[truncated]"));
            }
            out.extend(p);
        }
    };
    match first_eval {
        Some(_) => {
            for f in native {
                if f.kind == FrameKind::Native && is_eval_frame(&f.name) {
                    emit_py(&mut out, &mut py);
                } else {
                    out.push(f);
                }
            }
        }
        None => {
            out.extend(native);
            emit_py(&mut out, &mut py);
        }
    }
    out
}

/// Resolves one process's Python frames and GIL holders, reading its
/// memory (through `crate::python`). Created on first need, kept for the
/// recording: code objects are cached by address (with a reuse check).
pub struct PyResolver {
    interp: Interpreter,
    code: CodeResolver,
    /// `PyThreadState*` -> tid, refreshed when an unknown one shows up.
    threads: HashMap<u64, u32>,
}

impl PyResolver {
    /// None when `pid` is not a supported CPython (or is gone).
    pub fn for_pid(pid: u32) -> Option<PyResolver> {
        match crate::python::detect(pid) {
            Ok(Some(interp)) => {
                let code = interp.code_resolver();
                Some(PyResolver { interp, code, threads: HashMap::new() })
            }
            Ok(None) => None,
            Err(e) => {
                log::warn!("pid {pid}: Python frames unavailable: {e}");
                None
            }
        }
    }

    pub fn resolve(&mut self, code: u64, instr: u64) -> Option<PyFrameInfo> {
        self.code.resolve(code, instr).ok()
    }

    /// The thread that owns a `PyThreadState*`.
    pub fn thread_of(&mut self, tstate: u64) -> Option<u32> {
        if !self.threads.contains_key(&tstate)
            && let Ok(all) = self.interp.thread_states()
        {
            self.threads = all.into_iter().map(|(tid, ts)| (ts, tid)).collect();
        }
        self.threads.get(&tstate).copied()
    }
}
