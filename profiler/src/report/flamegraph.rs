//! `stalls.svg`: an inferno flamegraph of stall time.
//!
//! Colours come from the frame kind, not from name heuristics: native code
//! warm (red/yellow), Python green, kernel orange, off-CPU markers blue,
//! run-queue purple, the asyncio task's `[task NAME]` on top of a stack
//! gold ([`view::with_tasks`]); with stalls in several processes, each
//! process a grey root frame ([`view::with_processes`]). Widths are
//! microseconds of stall time.
//! Stacks are drawn in a [`View`] (by default the user's code:
//! [`crate::report::view`]).
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
    model::{Frame, FrameKind, Recording},
    os::outdir::OutDir,
    os::units::fmt_ns,
    report::aggregate,
    report::view::{self, View},
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
        FrameKind::Js => Color {
            r: 200 + j / 2,
            g: 190 + j / 2,
            b: 50,
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
        FrameKind::Marker if f.name.starts_with("[cpu throttled") => Color {
            r: 215,
            g: 40 + j / 2,
            b: 90,
        },
        FrameKind::Marker if f.name.starts_with("[runqueue") || f.name.starts_with("[woken") => {
            Color {
                r: 160,
                g: 90,
                b: 210,
            }
        }
        FrameKind::Marker if f.name.starts_with("[gil") => Color {
            r: 40,
            g: 190 + j,
            b: 200,
        },
        FrameKind::Marker if f.name.starts_with("[task ") => Color {
            r: 235,
            g: 200 + j / 2,
            b: 60,
        },
        FrameKind::Marker => Color {
            r: 160,
            g: 160,
            b: 160,
        },
        FrameKind::EventLoop => Color {
            r: 190,
            g: 190,
            b: 200,
        },
        FrameKind::Process => Color {
            r: 150,
            g: 160,
            b: 175,
        },
    }
}

pub fn render(rec: &Recording, v: View) -> Result<Vec<u8>, std::io::Error> {
    let shown = view::shown(rec, v);
    let lines = aggregate::folded_lines(&shown);
    let mut palette = PaletteMap::default();
    let mut seen: HashMap<String, ()> = HashMap::new();
    for s in &shown {
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
    opts.title = rec.title();
    let mut subtitle = String::from(
        "width = stall time; blue = off-CPU (blocked), purple = run-queue wait, crimson = CPU throttled (cgroup quota), aqua = waiting for the GIL, gold = the asyncio task on top",
    );
    if rec.stalls_in_several_processes() {
        subtitle.push_str(", grey = the process at the root");
    }
    opts.subtitle = Some(subtitle);
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

/// `stalls.svg` in the default view.
pub fn write(rec: &Recording, dir: &OutDir) -> Result<PathBuf, RenderError> {
    write_view(rec, dir, View::default())
}

pub fn write_view(rec: &Recording, dir: &OutDir, v: View) -> Result<PathBuf, RenderError> {
    let svg = render(rec, v).map_err(|source| RenderError::Write {
        path: dir.join("stalls.svg"),
        source,
    })?;
    write_file(dir, "stalls.svg", &svg)
}

/// A differential flamegraph of two recordings (`report --diff`), in the
/// view given: each frame coloured by how its stall time changed from
/// BEFORE to AFTER (red: more, blue: less). One recording's weights are
/// first scaled so that both have the same total stall time (inferno's
/// normalization): the colours say where the stall time moved, not that
/// one recording was longer. Widths are AFTER's stall time, or BEFORE's
/// with `before_widths` (what shrank to nothing is only visible there).
pub fn render_diff(
    before: &Recording,
    after: &Recording,
    v: View,
    before_widths: bool,
) -> std::io::Result<Vec<u8>> {
    let folded = |r: &Recording| {
        let mut t = aggregate::folded_lines(&view::apply(&r.stalls, v, &r.app())).join("\n");
        t.push('\n');
        t
    };
    // inferno draws the second profile's widths, coloured by second - first.
    let (first, second) = if before_widths {
        (folded(after), folded(before))
    } else {
        (folded(before), folded(after))
    };
    let mut diff = Vec::new();
    let opts = inferno::differential::Options {
        normalize: true,
        ..Default::default()
    };
    inferno::differential::from_readers(opts, first.as_bytes(), second.as_bytes(), &mut diff)?;
    let diff = String::from_utf8_lossy(&diff).into_owned();
    let mut opts = Options::default();
    opts.title = format!(
        "stallprof diff: {} stalls ({}) → {} stalls ({})",
        before.stalls.len(),
        fmt_ns(before.total_stall_ns()),
        after.stalls.len(),
        fmt_ns(after.total_stall_ns())
    );
    opts.subtitle = Some(format!(
        "widths: {}'s stall time; red = more stall time in AFTER, blue = less (scaled to the same total stall time)",
        if before_widths { "BEFORE" } else { "AFTER" }
    ));
    opts.negate_differentials = before_widths;
    opts.count_name = "us".into();
    opts.name_type = "Frame:".into();
    opts.deterministic = true;
    let mut svg = Vec::new();
    let lines: Vec<&str> = diff.lines().collect();
    let none = ["[no stalls in either recording] 1 1"];
    let lines = if lines.is_empty() {
        &none[..]
    } else {
        &lines[..]
    };
    flamegraph::from_lines(&mut opts, lines.iter().copied(), &mut svg)
        .map_err(std::io::Error::other)?;
    Ok(svg)
}

/// The folded lines of [`render_diff`]: `stack before_us after_us`, BEFORE
/// not scaled.
pub fn diff_lines(before: &Recording, after: &Recording, v: View) -> Vec<String> {
    let b = aggregate::folded_ns(&view::apply(&before.stalls, v, &before.app()));
    let a = aggregate::folded_ns(&view::apply(&after.stalls, v, &after.app()));
    let mut keys: Vec<&String> = b.keys().chain(a.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .map(|k| {
            let us = |m: &std::collections::BTreeMap<String, u64>| {
                m.get(k).map_or(0, |ns| (ns + 500) / 1000)
            };
            format!("{k} {} {}", us(&b), us(&a))
        })
        .collect()
}
