//! stallprof: an eBPF stall profiler for event-loop runtimes.
//!
//! The tree follows the data flow (docs/architecture.md):
//! `kernel` (BPF programs, their maps, decoding their records) ->
//! `pipeline` (the engine: loop identity, stall assembly) with `unwind`
//! (native stacks) and `symbolize` (frames; CPython) -> `report`
//! (aggregation, every output writer). `model` is the vocabulary they all
//! speak: the recording, its stalls and frames. `commands` are thin
//! drivers (`record`, `report`, `daemon`); `cli` turns argv into their
//! configs; `os` is procfs, the clock and units.
pub mod assemble;
pub mod classify;
pub mod cli;
pub mod commands;
pub mod fuzzing;
pub mod kernel;
pub mod model;
pub mod os;
pub mod pipeline;
pub mod report;
pub mod symbolize;
#[cfg(test)]
pub mod testing;
pub mod unwind;
