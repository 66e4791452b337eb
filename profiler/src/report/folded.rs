//! `stalls.folded`: collapsed stacks, `frame;frame;…;frame weight_us`,
//! the input format of inferno, flamegraph.pl and speedscope.
use std::path::PathBuf;

use super::{RenderError, write_file};
use crate::{os::outdir::OutDir, report::aggregate, report::model::Recording};

pub fn write(rec: &Recording, dir: &OutDir) -> Result<PathBuf, RenderError> {
    let mut text = aggregate::folded_lines(&rec.stalls).join("\n");
    text.push('\n');
    write_file(dir, "stalls.folded", text.as_bytes())
}
