//! Rendering: a [`Recording`] -> files and the terminal summary.
//!
//! In: [`Recording`]. Out: `stalls.json` (the recording itself, which
//! `stallprof report` reads back), `stalls.folded`, `stalls.svg`, and the
//! summary text.
use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use thiserror::Error;

use crate::report::model::Recording;

pub mod aggregate;
pub mod flamegraph;
pub mod folded;
pub mod model;
pub mod summary;

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
}

pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), RenderError> {
    write_file_with(path, |w| w.write_all(bytes))
}

/// Write `path` through a buffered writer (large outputs are streamed, never
/// held whole in memory), to a temporary name first and renamed into place,
/// so an interrupted run never leaves half a file.
pub(crate) fn write_file_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), RenderError> {
    let tmp = path.with_extension("tmp");
    let run = || -> std::io::Result<()> {
        let mut w = std::io::BufWriter::new(fs::File::create(&tmp)?);
        write(&mut w)?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        fs::rename(&tmp, path)
    };
    run().map_err(|source| RenderError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Create the output directory (and check it is writable) before recording.
pub fn prepare_dir(dir: &Path) -> Result<(), RenderError> {
    fs::create_dir_all(dir).map_err(|source| RenderError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let probe = dir.join(".stallprof-write-test");
    fs::write(&probe, b"").map_err(|source| RenderError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let _ = fs::remove_file(probe);
    Ok(())
}

pub fn write_json(rec: &Recording, dir: &Path) -> Result<PathBuf, RenderError> {
    let path = dir.join("stalls.json");
    write_file_with(&path, |w| {
        serde_json::to_writer_pretty(w, rec).map_err(std::io::Error::other)
    })?;
    Ok(path)
}

pub fn read_json(path: &Path) -> Result<Recording, RenderError> {
    let file = if path.is_dir() {
        path.join("stalls.json")
    } else {
        path.to_path_buf()
    };
    let bytes = fs::read(&file).map_err(|source| RenderError::Read {
        path: file.clone(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| RenderError::Parse { path: file, source })
}

/// Write every output format; returns the paths written.
pub fn write_all(rec: &Recording, dir: &Path) -> Result<Vec<PathBuf>, RenderError> {
    Ok(vec![
        write_json(rec, dir)?,
        folded::write(rec, dir)?,
        flamegraph::write(rec, dir)?,
    ])
}
