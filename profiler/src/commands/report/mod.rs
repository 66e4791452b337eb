//! `stallprof report DIR`: re-render a saved recording without the target.
//!
//! In: `stalls.json` (and, for a lower threshold, the raw records of a
//! `--save-events` recording, replayed through the engine). Out: the same
//! files as `record`, optionally for another threshold, and the summary;
//! with `--serve`/`--open`, those files served to a browser ([`serve`]).
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;

pub mod serve;

use crate::{
    assemble::stall::TrackerConfig,
    commands::{AppArgs, SummaryArgs},
    os::outdir::{OutDir, random_suffix},
    os::units::fmt_ns,
    os::units::parse_duration,
    pipeline::{recording, replay},
    report,
    report::view::View,
};

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A directory written by `stallprof record` (or its stalls.json).
    #[arg(required_unless_present = "diff")]
    pub input: Option<PathBuf>,
    /// Only stalls at least this long. Below the recording's threshold it
    /// replays the raw records of a `--save-events` recording.
    #[arg(long, value_parser = parse_duration)]
    pub threshold: Option<u64>,
    /// Where to write the re-rendered files (default: a new directory
    /// `<input>-report-<random>` beside the input; never the input itself,
    /// whose stalls.json holds stalls a higher threshold would drop).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub view: super::ViewArgs,
    /// Replaces the recording's `--app-path` prefixes (and the guess, when
    /// it had none).
    #[command(flatten)]
    pub app: AppArgs,
    #[command(flatten)]
    pub summary: SummaryArgs,
    #[command(flatten)]
    pub serve: serve::ServeArgs,
    /// A differential flamegraph of two recordings into -o DIR: diff.svg
    /// (AFTER's stacks, red where stall time grew, blue where it shrank),
    /// diff-before.svg (BEFORE's stacks, same colours: what went away) and
    /// diff.folded (`stack before_us after_us`). Weights are scaled to the
    /// same total stall time before colouring.
    #[arg(long, num_args = 2, value_names = ["BEFORE", "AFTER"], conflicts_with_all = ["input", "threshold", "serve", "open"], requires = "output")]
    pub diff: Option<Vec<PathBuf>>,
}

/// Do `a` and `b` name one directory (symlinks and `..` resolved)?
fn same_dir(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

pub fn run(a: ReportArgs) -> Result<String> {
    let view = a.view.view();
    if let (Some(d), Some(o)) = (&a.diff, &a.output) {
        return diff(&d[0], &d[1], o, view, &a.app.app_paths);
    }
    let Some(input) = a.input.clone() else {
        bail!(
            "give a recording to re-render (stallprof report DIR) or two with --diff BEFORE AFTER -o OUT"
        );
    };
    let mut rec = report::read_json(&input)?;
    if !a.app.app_paths.is_empty() {
        rec.app_paths = a.app.app_paths.clone();
    }
    if let Some(t) = a.threshold {
        if t < rec.threshold_ns {
            let dir = if input.is_dir() {
                input.clone()
            } else {
                input.parent().map(PathBuf::from).unwrap_or_default()
            };
            if !dir.join(recording::EVENTS_FILE).exists() {
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
            let cfg = TrackerConfig {
                threshold_ns: t,
                tids: None,
            };
            rec.stalls =
                replay::replay_named(&dir, cfg, Some(rec.ended_ns), &rec.executor_threads)?;
            rec.complete();
        } else {
            rec.stalls.retain(|s| s.duration_ns >= t);
        }
        rec.threshold_ns = t;
    }
    let input_dir = if input.is_dir() {
        input.clone()
    } else {
        input
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."))
    };
    let out = match &a.output {
        Some(o) => {
            if same_dir(o, &input_dir) {
                bail!(
                    "-o {} is the recording being read: rewriting it would lose what it holds; \
                     give a new directory with -o DIR (or leave -o out for <input>-report-<random>)",
                    o.display()
                );
            }
            OutDir::open_or_create(o)?
        }
        None => {
            let base = input_dir
                .canonicalize()
                .unwrap_or_else(|_| input_dir.clone());
            let name = format!(
                "{}-report-{}",
                base.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "stallprof".into()),
                random_suffix()
            );
            OutDir::create_new(&base.with_file_name(name))?
        }
    };
    let files = report::write_all_view(&rec, &out, view)?;
    let summary = report::summary::text(&rec, &files, &a.summary.options());
    if a.serve.wanted() {
        return serve::run(&a.serve, &rec, &out, &files, &summary);
    }
    Ok(summary)
}

/// `report --diff BEFORE AFTER -o OUT`: diff.svg, diff-before.svg and
/// diff.folded (`stack before_us after_us`, unscaled), and a line with
/// each recording's count and stall time.
fn diff(
    before: &Path,
    after: &Path,
    out: &Path,
    view: View,
    app_paths: &[String],
) -> Result<String> {
    let (mut b, mut a) = (report::read_json(before)?, report::read_json(after)?);
    if !app_paths.is_empty() {
        b.app_paths = app_paths.to_vec();
        a.app_paths = app_paths.to_vec();
    }
    if same_dir(out, before) || same_dir(out, after) {
        bail!(
            "-o {} is one of the recordings being compared; give a new directory with -o DIR",
            out.display()
        );
    }
    let dir = OutDir::open_or_create(out)?;
    let svg = |before_widths: bool, name: &str| {
        report::flamegraph::render_diff(&b, &a, view, before_widths).map_err(|source| {
            report::RenderError::Write {
                path: dir.join(name),
                source,
            }
        })
    };
    let (svg_after, svg_before) = (svg(false, "diff.svg")?, svg(true, "diff-before.svg")?);
    let mut folded = report::flamegraph::diff_lines(&b, &a, view).join("\n");
    folded.push('\n');
    let files = [
        report::write_file(&dir, "diff.svg", &svg_after)?,
        report::write_file(&dir, "diff-before.svg", &svg_before)?,
        report::write_file(&dir, "diff.folded", folded.as_bytes())?,
    ];
    let mut text = format!(
        "stallprof diff: BEFORE {} stalls, {} of stall time; AFTER {} stalls, {}\n  wrote:\n",
        b.stalls.len(),
        fmt_ns(b.total_stall_ns()),
        a.stalls.len(),
        fmt_ns(a.total_stall_ns())
    );
    for f in files {
        text.push_str(&format!(
            "    {}\n",
            crate::model::text::escape(&f.to_string_lossy())
        ));
    }
    Ok(text)
}
