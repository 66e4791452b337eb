//! Replay: a saved event stream (`events.jsonl`) and symbol table
//! (`symbols.json`) -> the same stalls `record` produced, without the target
//! or the kernel. The pipeline after `event` is fed exactly as when
//! recording, so golden tests and bug reports exercise the real code.
use std::{
    fs,
    io::{BufRead, BufReader},
    path::Path,
};

use anyhow::{Context, Result};

use crate::{
    event::Event,
    model::Stall,
    stall::{Output, Tracker, TrackerConfig},
    symbolize::{Resolve, TableResolver, to_stall},
};

/// Read `events.jsonl`.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let f = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    BufReader::new(f)
        .lines()
        .enumerate()
        .map(|(i, line)| {
            let line = line?;
            serde_json::from_str(&line)
                .with_context(|| format!("{}:{}: not an event", path.display(), i + 1))
        })
        .collect()
}

/// Read `symbols.json` written by `record --save-events`.
pub fn read_symbols(path: &Path) -> Result<TableResolver> {
    let bytes = fs::read(path).with_context(|| format!("opening {}", path.display()))?;
    serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a symbol table", path.display()))
}

/// Run events through stall assembly and symbolization.
pub fn replay(
    events: Vec<Event>,
    cfg: TrackerConfig,
    res: &mut dyn Resolve,
    end_ns: Option<u64>,
) -> Vec<Stall> {
    let mut tracker = Tracker::new(cfg);
    let mut out = Vec::new();
    let mut last = 0;
    for ev in events {
        last = last.max(ev.ts());
        tracker.push(ev, &mut out);
    }
    tracker.finish(end_ns.unwrap_or(last), &mut out);
    out.into_iter()
        .filter_map(|o| match o {
            Output::Stall(raw) => Some(to_stall(&raw, &tracker.stacks, res, "replayed")),
            Output::LoopKey { .. } | Output::LoopGone { .. } => None,
        })
        .collect()
}
