//! `stallprof report DIR`: re-render a saved recording without the target.
//!
//! In: `stalls.json` (and, for a lower threshold, the raw records of a
//! `--save-events` recording, replayed through the engine). Out: the same
//! files as `record`, optionally for another threshold, and the summary.
use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;

use crate::{
    os::units::fmt_ns, os::units::parse_duration, pipeline::engine, pipeline::stall::TrackerConfig,
    report,
};

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A directory written by `stallprof record` (or its stalls.json).
    pub input: PathBuf,
    /// Only stalls at least this long. Below the recording's threshold it
    /// replays the raw records of a `--save-events` recording.
    #[arg(long, value_parser = parse_duration)]
    pub threshold: Option<u64>,
    /// Where to write the re-rendered files (default: the input directory).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

pub fn run(a: ReportArgs) -> Result<String> {
    let mut rec = report::read_json(&a.input)?;
    if let Some(t) = a.threshold {
        if t < rec.threshold_ns {
            let dir = if a.input.is_dir() {
                a.input.clone()
            } else {
                a.input.parent().map(PathBuf::from).unwrap_or_default()
            };
            if !dir.join(engine::EVENTS_FILE).exists() {
                bail!(
                    "--threshold {} is below the recording's {}: shorter busy periods are only in a \
                     recording made with --save-events; record again with --save-events or a lower --threshold",
                    fmt_ns(t),
                    fmt_ns(rec.threshold_ns)
                );
            }
            if t < rec.sample_after_ns {
                bail!(
                    "--threshold {} is below the recording's --sample-after {}: the kernel never reported \
                     busy periods that short; record again with a lower --sample-after",
                    fmt_ns(t),
                    fmt_ns(rec.sample_after_ns)
                );
            }
            // The raw records hold every busy period past the gate: run
            // them through the engine again at the lower threshold.
            let names = rec
                .executor_threads
                .iter()
                .map(|t| (t.tid, t.name.clone()))
                .collect();
            let cfg = TrackerConfig {
                threshold_ns: t,
                tids: None,
            };
            rec.stalls = engine::replay_named(&dir, cfg, Some(rec.ended_ns), names)?;
        } else {
            rec.stalls.retain(|s| s.duration_ns >= t);
        }
        rec.threshold_ns = t;
    }
    let out: PathBuf = a.output.unwrap_or_else(|| {
        if a.input.is_dir() {
            a.input.clone()
        } else {
            a.input
                .parent()
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("."))
        }
    });
    report::prepare_dir(&out)?;
    let files = report::write_all(&rec, &out)?;
    Ok(report::summary::text(&rec, &files))
}
