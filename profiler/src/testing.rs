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
use crate::model::{Frame, FrameKind, PartKind, Process, Recording, StackPart, Stall};
use crate::os::family::Facts;

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
        thread_context: None,
        route: None,
        held_up: None,
        stacks,
    }
}

/// A recording of a supervisor and two workers, as `record --pid` of
/// uvicorn's master gives it: uvicorn (pid 1200, no stalls) forked
/// python3.12 workers 1210 (worker 1: one 30 ms on-CPU stall in `spin`)
/// and 1220 (worker 2, started later: two 10 ms stalls blocked in `nap`),
/// each stall on its process's main thread. Roles come from the facts
/// table, as `record` derives them.
pub fn two_workers() -> Recording {
    let facts = |pid, parent, start, comm: &str| Facts {
        pid,
        comm: comm.into(),
        parent: Some(parent),
        start_ticks: Some(start),
        // The workers ran their loops.
        ran_loop: parent != 1,
        ..Default::default()
    };
    let table = [
        facts(1200, 1, 100, "uvicorn"),
        facts(1220, 1200, 300, "python3.12"),
        facts(1210, 1200, 200, "python3.12"),
    ];
    let on = |pid: u32, start_ms: u64, kind, ms: u64, f: &str| {
        let frames = vec![
            Frame::new("main", FrameKind::Native),
            Frame::new(f, FrameKind::Native),
        ];
        Stall {
            pid,
            tid: pid,
            thread_name: "python3.12".into(),
            ..stall(
                start_ms * 1_000_000,
                vec![part(kind, ms * 1_000_000, frames)],
            )
        }
    };
    Recording {
        pid: 1200,
        comm: "uvicorn".into(),
        processes: Process::from_facts(&table),
        ..Recording::for_tests(vec![
            on(1210, 100, PartKind::OnCpu, 30, "spin"),
            on(1220, 200, PartKind::OffCpu, 10, "nap"),
            on(1220, 300, PartKind::OffCpu, 10, "nap"),
        ])
    }
    .completed()
}
