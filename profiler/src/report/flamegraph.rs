//! `stalls.svg`: an inferno flamegraph of stall time.
//!
//! Colours come from the frame kind, not from name heuristics: native code
//! warm (red/yellow), Python green, kernel orange, off-CPU markers blue,
//! run-queue purple. Widths are microseconds of stall time.
use std::{
    collections::HashMap,
    hash::{DefaultHasher, Hash, Hasher},
    path::PathBuf,
};

use inferno::flamegraph::{
    self, Options,
    color::{Color, PaletteMap},
};

use super::{RenderError, write_file};
use crate::{
    os::outdir::OutDir,
    os::units::fmt_ns,
    report::aggregate,
    report::model::{Frame, FrameKind, Recording},
};

fn jitter(label: &str, span: u8) -> u8 {
    let mut h = DefaultHasher::new();
    label.hash(&mut h);
    (h.finish() % span as u64) as u8
}

fn color(f: &Frame, label: &str) -> Color {
    let j = jitter(label, 50);
    match f.kind {
        FrameKind::Native => Color {
            r: 205 + j / 2,
            g: 80 + j * 2,
            b: 40,
        },
        FrameKind::Python => Color {
            r: 80 + j,
            g: 190 + j / 2,
            b: 80,
        },
        FrameKind::Kernel => Color {
            r: 230,
            g: 140 + j,
            b: 30,
        },
        FrameKind::Marker if f.name.starts_with("[off-cpu") => Color {
            r: 70,
            g: 120 + j,
            b: 230,
        },
        FrameKind::Marker if f.name.starts_with("[runqueue") => Color {
            r: 160,
            g: 90,
            b: 210,
        },
        FrameKind::Marker if f.name.starts_with("[gil") => Color {
            r: 40,
            g: 190 + j,
            b: 200,
        },
        FrameKind::Marker => Color {
            r: 160,
            g: 160,
            b: 160,
        },
    }
}

pub fn render(rec: &Recording) -> Result<Vec<u8>, std::io::Error> {
    let lines = aggregate::folded_lines(&rec.stalls);
    let mut palette = PaletteMap::default();
    let mut seen: HashMap<String, ()> = HashMap::new();
    for s in &rec.stalls {
        for p in &s.stacks {
            for f in &p.frames {
                let label = f.label();
                if seen.insert(label.clone(), ()).is_none() {
                    palette.insert(&label, color(f, &label));
                }
            }
        }
    }
    let mut opts = Options::default();
    opts.title = format!(
        "stallprof: pid {} ({}) — {} stalls ≥ {}, {} of stall time",
        rec.pid,
        crate::report::label::escape(&rec.comm),
        rec.stalls.len(),
        fmt_ns(rec.threshold_ns),
        fmt_ns(rec.total_stall_ns())
    );
    opts.subtitle = Some("width = stall time; blue = off-CPU (blocked), purple = run-queue wait, aqua = waiting for the GIL".into());
    opts.count_name = "us".into();
    opts.name_type = "Frame:".into();
    opts.palette_map = Some(&mut palette);
    opts.hash = true;
    opts.deterministic = true;
    let mut svg = Vec::new();
    if lines.is_empty() {
        // inferno refuses empty input; draw a graph that says so.
        let none = ["[no stalls over the threshold] 1".to_string()];
        flamegraph::from_lines(&mut opts, none.iter().map(String::as_str), &mut svg)
            .map_err(std::io::Error::other)?;
    } else {
        flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut svg)
            .map_err(std::io::Error::other)?;
    }
    Ok(svg)
}

pub fn write(rec: &Recording, dir: &OutDir) -> Result<PathBuf, RenderError> {
    let svg = render(rec).map_err(|source| RenderError::Write {
        path: dir.join("stalls.svg"),
        source,
    })?;
    write_file(dir, "stalls.svg", &svg)
}
