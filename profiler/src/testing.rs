//! Test-only builders of the model's values, so a unit test writes only the
//! fields it looks at.
//!
//! In: what a test stall is made of (its start and its parts). Out: a
//! [`Stall`] whose span and split follow from its parts — it ends at the
//! start plus the parts' weights; on-CPU, off-CPU (GIL waits included, as
//! the pipeline counts them), run queue and throttled are the weights of
//! those kinds — on tid 1, thread `main`, with nothing else to say. A test
//! overrides the rest with struct update syntax, as with
//! `Recording::for_tests`: `Stall { tid: 7, ..stall(0, parts) }`.
//!
//! Compiled only for tests (`#[cfg(test)]` in lib.rs); nothing outside a
//! test module may use it.
use crate::model::{Frame, PartKind, StackPart, Stall};

/// A part of `weight_ns` of `kind` with these frames (outermost first), and
/// no syscall, waker, GIL holder or wakeup.
pub fn part(kind: PartKind, weight_ns: u64, frames: Vec<Frame>) -> StackPart {
    StackPart {
        frames,
        weight_ns,
        kind,
        syscall: None,
        waker_tid: None,
        gil_holder: None,
        woken: false,
    }
}

/// A complete stall of tid 1 (`main`) of pid 1 made of `stacks`, from `start_ns` for
/// as long as their weights add up to, split as they are.
pub fn stall(start_ns: u64, stacks: Vec<StackPart>) -> Stall {
    let of = |kinds: &[PartKind]| -> u64 {
        stacks
            .iter()
            .filter(|p| kinds.contains(&p.kind))
            .map(|p| p.weight_ns)
            .sum()
    };
    let duration_ns: u64 = stacks.iter().map(|p| p.weight_ns).sum();
    Stall {
        pid: 1,
        tid: 1,
        ns_tid: None,
        thread_name: "main".into(),
        start_ns,
        end_ns: start_ns + duration_ns,
        duration_ns,
        on_cpu_ns: of(&[PartKind::OnCpu]),
        off_cpu_ns: of(&[PartKind::OffCpu, PartKind::GilWait]),
        runqueue_ns: of(&[PartKind::Runqueue]),
        throttled_ns: of(&[PartKind::Throttled]),
        cpu_holders: Vec::new(),
        incomplete: false,
        coroutine: None,
        task: None,
        route: None,
        stacks,
    }
}
