//! `stallprof report DIR`: re-render a saved recording without the target.
//!
//! In: `stalls.json`. Out: the same files as `record`, optionally for a
//! higher threshold, and the summary.
use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::{
    cli::{ReportArgs, fmt_ns},
    render,
};

pub fn run(a: ReportArgs) -> Result<String> {
    let mut rec = render::read_json(&a.input)?;
    if let Some(t) = a.threshold {
        if t < rec.threshold_ns {
            bail!(
                "--threshold {} is below the recording's {}: shorter busy periods were not kept; record again with a lower --threshold",
                fmt_ns(t),
                fmt_ns(rec.threshold_ns)
            );
        }
        rec.stalls.retain(|s| s.duration_ns >= t);
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
    render::prepare_dir(&out)?;
    let files = render::write_all(&rec, &out)?;
    Ok(render::summary::text(&rec, &files))
}
