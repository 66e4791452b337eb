//! `stalls.folded`: collapsed stacks, `frame;frame;…;frame weight_us`,
//! the input format of inferno, flamegraph.pl and speedscope, in the
//! [`View`] given (by default the user's code, a frame per function:
//! [`crate::report::view`]), with `--group-by` each stack rooted in its
//! task or route ([`view::grouped`]) and, with stalls in several
//! processes, rooted in its process (`uvicorn worker 2 (pid 1240)`,
//! [`view::with_processes`]). The asyncio task is no frame otherwise: the
//! stacks are the stall's code, so speedscope's Sandwich view ranks
//! functions.
use std::path::PathBuf;

use super::{RenderError, write_file};
use crate::{
    model::Recording,
    os::outdir::OutDir,
    report::aggregate,
    report::view::{self, View},
};

/// `stalls.folded` in the default view.
pub fn write(rec: &Recording, dir: &OutDir) -> Result<PathBuf, RenderError> {
    write_view(rec, dir, View::default())
}

pub fn write_view(rec: &Recording, dir: &OutDir, v: View) -> Result<PathBuf, RenderError> {
    let mut text = aggregate::folded_lines(&view::shown(rec, v)).join("\n");
    text.push('\n');
    write_file(dir, "stalls.folded", text.as_bytes())
}
