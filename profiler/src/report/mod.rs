//! Rendering: a [`Recording`] -> files and the terminal summary.
//!
//! In: [`Recording`]. Out: `stalls.json` (the recording itself, compact
//! and versioned, which `stallprof report` reads back: [`json`]),
//! `stalls.folded`, `stalls.svg`, `stalls.speedscope.json`, `stalls.pb.gz`
//! (pprof; the four in a [`view::View`]: by default the user's code; the
//! speedscope file the stall timeline for speedscope: [`speedscope`]),
//! `stalls.pftrace` (the Perfetto timeline: [`perfetto`]), and the summary text.
use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use thiserror::Error;

use crate::{model::Recording, os::outdir::OutDir};

pub mod aggregate;
pub mod flamegraph;
pub mod folded;
pub mod gate;
pub mod index;
pub mod journal;
pub mod json;
pub mod otlp;
pub mod perfetto;
pub mod pprof;
pub mod speedscope;
pub mod summary;
pub mod view;
pub mod viewers;

#[derive(Debug, Error)]
pub enum RenderError {
    #[error("cannot write {path}: {source}; choose a writable directory with -o DIR")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot read the recording {path}: {source}; give a directory written by `stallprof record` (it holds stalls.json)"
    )]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a stallprof recording: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path} cannot be read as a stallprof recording: {source}")]
    Format {
        path: PathBuf,
        source: json::FormatError,
    },
    #[error(transparent)]
    Journal(#[from] journal::JournalError),
}

/// Write `name` in `dir` whole (see [`write_file_with`]).
pub(crate) fn write_file(dir: &OutDir, name: &str, bytes: &[u8]) -> Result<PathBuf, RenderError> {
    write_file_with(dir, name, |w| w.write_all(bytes))
}

/// Write `name` in `dir` through a buffered writer (large outputs are
/// streamed, never held whole in memory), under a random temporary name
/// first, fsynced and renamed into place: an interrupted run never leaves
/// half a file, and a planted symlink is replaced, never followed
/// ([`OutDir`]).
pub(crate) fn write_file_with(
    dir: &OutDir,
    name: &str,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<PathBuf, RenderError> {
    dir.write_with(name, write)
        .map_err(|source| RenderError::Write {
            path: dir.join(name),
            source,
        })
}

pub fn write_json(rec: &Recording, dir: &OutDir) -> Result<PathBuf, RenderError> {
    write_file_with(dir, "stalls.json", |w| json::write(rec, w))
}

/// Reads a recording: `stalls.json`, or, when a recording did not finish
/// (`kill -9`, OOM, power cut, disk full) and left no `stalls.json`, its
/// `stalls.journal`, saying so on stderr.
pub fn read_json(path: &Path) -> Result<Recording, RenderError> {
    let file = if path.is_dir() {
        path.join("stalls.json")
    } else {
        path.to_path_buf()
    };
    let journal = if path.is_dir() {
        path.join(journal::NAME)
    } else {
        path.to_path_buf()
    };
    let is_journal = journal.file_name().is_some_and(|n| n == journal::NAME);
    if is_journal && (!path.is_dir() || (!file.exists() && journal.exists())) {
        let r = journal::read(&journal)?;
        log::warn!(
            "{}: rebuilding every output from {} ({} stalls up to +{:.1}s{}): the recording did not \
             finish, so kernel drop and lost-event counts are unknown",
            crate::model::text::escape(&path.to_string_lossy()),
            journal::NAME,
            r.recording.stalls.len(),
            r.recording.ended_ns.saturating_sub(r.recording.started_ns) as f64 / 1e9,
            if r.damaged_tail > 0 {
                format!(", a cut last line of {} bytes dropped", r.damaged_tail)
            } else {
                String::new()
            }
        );
        return Ok(r.recording);
    }
    let bytes = fs::read(&file).map_err(|source| RenderError::Read {
        path: file.clone(),
        source,
    })?;
    json::from_slice(&bytes).map_err(|e| match e {
        json::FormatError::Json(source) => RenderError::Parse { path: file, source },
        source => RenderError::Format { path: file, source },
    })
}

/// Write every output format; returns the paths written.
pub fn write_all(rec: &Recording, dir: &OutDir) -> Result<Vec<PathBuf>, RenderError> {
    write_all_view(rec, dir, view::View::default())
}

/// [`write_all`], with `stalls.folded`, `stalls.svg`, `stalls.speedscope.json`
/// and `stalls.pb.gz` in the view given (`--native`); the other outputs keep
/// every frame.
pub fn write_all_view(
    rec: &Recording,
    dir: &OutDir,
    v: view::View,
) -> Result<Vec<PathBuf>, RenderError> {
    Ok(vec![
        write_json(rec, dir)?,
        folded::write_view(rec, dir, v)?,
        flamegraph::write_view(rec, dir, v)?,
        pprof::write_view(rec, dir, v)?,
        perfetto::write(rec, dir)?,
        speedscope::write_view(rec, dir, v)?,
    ])
}
