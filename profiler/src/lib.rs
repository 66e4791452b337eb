//! stallprof: an eBPF stall profiler for event-loop runtimes.
//!
//! The modules follow the data flow:
//! `probe` (kernel programs) -> `event` (typed records) -> `stall` (busy
//! periods, time split) -> `symbolize` (frames; `pyframes`/`python` for
//! CPython) -> `aggregate` (weighted stacks, summary) -> `render` (files).
//! `record` and `report` wire them for the two commands.
pub mod aggregate;
pub mod cli;
pub mod daemon;
pub mod engine;
pub mod event;
pub mod loops;
pub mod model;
pub mod probe;
pub mod pyframes;
pub mod python;
pub mod record;
pub mod render;
pub mod report;
pub mod runtimes;

pub mod stall;
pub mod symbolize;
pub mod unwind;
