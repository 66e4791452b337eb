//! `stalls.folded`: collapsed stacks, `frame;frame;…;frame weight_us`,
//! the input format of inferno, flamegraph.pl and speedscope.
use std::path::{Path, PathBuf};

use super::{RenderError, write_file};
use crate::{report::aggregate, report::model::Recording};

pub fn write(rec: &Recording, dir: &Path) -> Result<PathBuf, RenderError> {
    let path = dir.join("stalls.folded");
    let mut text = aggregate::folded_lines(&rec.stalls).join("\n");
    text.push('\n');
    write_file(&path, text.as_bytes())?;
    Ok(path)
}
