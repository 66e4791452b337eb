//! Replay of a saved recording through the whole engine (`report` of a
//! recording with its events, and the golden tests).
//!
//! In: a recording's directory ([`super::recording`]'s files) and the
//! stall threshold. Out: the stalls it finds, symbolized, ordered by start
//! — the very code a live recording runs, fed from the file, with
//! [`NoControl`] for the kernel it no longer has.
use std::path::Path;

use anyhow::Result;

use crate::{
    assemble::stall::TrackerConfig,
    kernel::event,
    model::{Stall, ThreadInfo},
    pipeline::{control::NoControl, engine::Engine, recording},
};

/// Replay the recording in `dir` through the whole pipeline: the stalls it
/// finds, symbolized, ordered by start. `end_ns`: where to close busy
/// periods still open (default: the last record's time).
pub fn replay(dir: &Path, cfg: TrackerConfig, end_ns: Option<u64>) -> Result<Vec<Stall>> {
    replay_named(dir, cfg, end_ns, &[])
}

/// [`replay`], with the threads as the live recording saw them (names,
/// namespace ids; others are named "replayed").
pub fn replay_named(
    dir: &Path,
    cfg: TrackerConfig,
    end_ns: Option<u64>,
    threads: &[ThreadInfo],
) -> Result<Vec<Stall>> {
    let records = recording::read_events(dir)?;
    let mut engine = Engine::replaying(dir, cfg)?;
    engine.name_threads(threads);
    let mut last = 0;
    for rec in &records {
        if let Ok(ev) = event::parse(rec) {
            last = last.max(ev.ts());
        }
        engine.handle_record(rec, &mut NoControl);
    }
    engine.finish(end_ns.unwrap_or(last));
    let mut stalls: Vec<Stall> = engine.take_stalls().into_iter().map(|(_, s)| s).collect();
    stalls.sort_by_key(|s| (s.start_ns, s.tid));
    Ok(stalls)
}
