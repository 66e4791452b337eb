//! Stall assembly, a pure stage between decoding and symbolization: typed
//! kernel events in, in timestamp order; finished stalls (stacks still as
//! interned addresses) and loop-key decisions out. Loop identity (which
//! wait is a thread's park: `loops`) and the busy-period state machine
//! (`stall`) depend on the decoded events and the model only — no I/O, no
//! clock, no target reads — so live recording, replay and the unit tests
//! drive them the same way.
pub mod loops;
pub mod stall;
