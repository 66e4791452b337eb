//! `stalls.svg`: an inferno flamegraph of stall time.
//!
//! Colours come from the frame kind, not from name heuristics ([`Swatch`]):
//! Python green, JavaScript yellow, native user-space code red, the kernel
//! orange, and one colour per kind of stall time on its marker frame:
//! off-CPU (blocked) blue, run-queue wait purple, CPU throttled magenta,
//! GIL wait aqua, the event loop's own dispatch (`[event loop]`) light
//! steel blue; with `--group-by`, each stack's task or route root tan;
//! with stalls in several processes, each process a slate root frame
//! ([`view::with_processes`]); other markers (`[gc]`, an unreadable
//! frame) grey. Under the title, a legend of swatches names the colours
//! of the kinds this graph holds, no others. Widths are microseconds of
//! stall time. Stacks are drawn in a [`View`] (by default the user's
//! code: [`crate::report::view`]).
use std::{
    collections::BTreeSet,
    hash::{DefaultHasher, Hash, Hasher},
    path::PathBuf,
};

use inferno::flamegraph::{
    self, Options,
    color::{Color, PaletteMap},
};

use super::{RenderError, write_file};
use crate::{
    classify::is_perf_map_js,
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

/// A colour of the flamegraph, and what it means: one per kind of code
/// and per kind of stall time. In legend order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Swatch {
    Python,
    Js,
    Native,
    Kernel,
    OffCpu,
    Runqueue,
    Throttled,
    Gil,
    EventLoop,
    Group,
    Process,
    Other,
}

impl Swatch {
    /// The colour a frame is drawn in. Markers are told by the prefixes
    /// the symbolizer names them with (`[off-cpu: read]`, `[runqueue]`,
    /// `[woken from epoll_wait]`, `[cpu throttled]`, `[gil wait: …]`).
    pub fn of(f: &Frame) -> Swatch {
        let marker = |p: &[&str]| p.iter().any(|p| f.name.starts_with(p));
        match f.kind {
            FrameKind::Python => Swatch::Python,
            FrameKind::Js => Swatch::Js,
            FrameKind::Native if is_perf_map_js(f) => Swatch::Js,
            FrameKind::Native => Swatch::Native,
            FrameKind::Kernel => Swatch::Kernel,
            FrameKind::Marker if marker(&["[off-cpu"]) => Swatch::OffCpu,
            FrameKind::Marker if marker(&["[runqueue", "[woken"]) => Swatch::Runqueue,
            FrameKind::Marker if marker(&["[cpu throttled"]) => Swatch::Throttled,
            FrameKind::Marker if marker(&["[gil"]) => Swatch::Gil,
            FrameKind::Marker => Swatch::Other,
            FrameKind::EventLoop => Swatch::EventLoop,
            FrameKind::Group => Swatch::Group,
            FrameKind::Process => Swatch::Process,
        }
    }

    /// The legend's words for it.
    pub fn meaning(self) -> &'static str {
        match self {
            Swatch::Python => "Python",
            Swatch::Js => "JavaScript",
            Swatch::Native => "native (user space)",
            Swatch::Kernel => "kernel",
            Swatch::OffCpu => "off-CPU (blocked)",
            Swatch::Runqueue => "run queue",
            Swatch::Throttled => "CPU throttled",
            Swatch::Gil => "GIL wait",
            Swatch::EventLoop => "event loop",
            Swatch::Group => "task / route",
            Swatch::Process => "process",
            Swatch::Other => "other marker",
        }
    }

    /// Its colour, varied a little by `j` (0..50) so neighbours differ.
    fn color(self, j: u8) -> Color {
        let (r, g, b) = match self {
            Swatch::Python => (80 + j, 190 + j / 2, 80),
            Swatch::Js => (215 + j / 2, 205 + j / 2, 60),
            Swatch::Native => (215 + j / 2, 70 + j / 2, 60 + j / 3),
            Swatch::Kernel => (245, 140 + j / 3, 30),
            Swatch::OffCpu => (70, 120 + j, 230),
            Swatch::Runqueue => (150 + j / 3, 90, 210),
            Swatch::Throttled => (225, 60 + j / 3, 175),
            Swatch::Gil => (40, 190 + j, 200),
            Swatch::EventLoop => (175, 196, 222),
            Swatch::Group => (205 + j / 3, 180, 140),
            Swatch::Process => (120, 135, 160),
            Swatch::Other => (170, 170, 170),
        };
        Color { r, g, b }
    }
}

/// The legend drawn in place of inferno's subtitle: a swatch and its
/// meaning for each of `present`, left to right after "width = stall
/// time", on the subtitle's line (y: its baseline), scaled down to fit
/// the graph's default width (1200 px) when every kind is there. SVG
/// elements only, no id that inferno's script looks up, so search and
/// zoom work as before.
fn legend(present: &BTreeSet<Swatch>, y: f64) -> String {
    // inferno's text is 12 px Verdana: ~7 px a character is enough room.
    const CHAR_PX: f64 = 7.0;
    const ROOM_PX: f64 = 1180.0;
    let mut x = 0.0;
    let mut items = String::new();
    let lead = "width = stall time:";
    items.push_str(&format!(
        "<text x=\"0\" y=\"0\" fill=\"rgb(90,90,90)\">{lead}</text>"
    ));
    x += lead.len() as f64 * CHAR_PX + 12.0;
    for s in present {
        let c = s.color(25);
        items.push_str(&format!(
            "<rect x=\"{x:.0}\" y=\"-10\" width=\"11\" height=\"11\" fill=\"rgb({},{},{})\" stroke=\"rgb(90,90,90)\" stroke-width=\"0.5\"/>\
             <text x=\"{:.0}\" y=\"0\">{}</text>",
            c.r,
            c.g,
            c.b,
            x + 15.0,
            s.meaning()
        ));
        x += 15.0 + s.meaning().len() as f64 * CHAR_PX + 14.0;
    }
    let scale = if x > ROOM_PX { ROOM_PX / x } else { 1.0 };
    format!("<g id=\"legend\" transform=\"translate(10 {y:.2}) scale({scale:.3})\">{items}</g>")
}

/// `svg` with inferno's subtitle text element replaced by `legend`;
/// unchanged if it has none.
fn with_legend(svg: Vec<u8>, present: &BTreeSet<Swatch>) -> Vec<u8> {
    let text = String::from_utf8_lossy(&svg);
    let Some(at) = text.find("id=\"subtitle\"") else {
        return svg;
    };
    let (Some(start), Some(end)) = (text[..at].rfind("<text"), text[at..].find("</text>")) else {
        return svg;
    };
    let end = at + end + "</text>".len();
    let y = text[start..end]
        .split("y=\"")
        .nth(1)
        .and_then(|v| v.split('"').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(48.0);
    let mut out = String::with_capacity(text.len() + 2048);
    out.push_str(&text[..start]);
    out.push_str(&legend(present, y));
    out.push_str(&text[end..]);
    out.into_bytes()
}

pub fn render(rec: &Recording, v: View) -> Result<Vec<u8>, std::io::Error> {
    let shown = view::shown(rec, v);
    let lines = aggregate::folded_lines(&shown);
    let mut palette = PaletteMap::default();
    let mut present = BTreeSet::new();
    for f in shown.iter().flat_map(|s| &s.stacks).flat_map(|p| &p.frames) {
        let label = f.label();
        if palette.get(&label).is_none() {
            let swatch = Swatch::of(f);
            present.insert(swatch);
            palette.insert(&label, swatch.color(jitter(&label, 50)));
        }
    }
    let mut opts = Options::default();
    opts.title = rec.title();
    // Replaced by the legend once drawn ([`with_legend`]).
    opts.subtitle = Some("width = stall time".into());
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
    Ok(with_legend(svg, &present))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::PartKind;
    use crate::testing;

    const ALL: [Swatch; 12] = [
        Swatch::Python,
        Swatch::Js,
        Swatch::Native,
        Swatch::Kernel,
        Swatch::OffCpu,
        Swatch::Runqueue,
        Swatch::Throttled,
        Swatch::Gil,
        Swatch::EventLoop,
        Swatch::Group,
        Swatch::Process,
        Swatch::Other,
    ];

    /// Issue 37: kernel and native user-space frames were both orange-red.
    /// Every swatch is far from every other, whatever the jitter.
    #[test]
    fn every_kind_has_its_own_colour_issue_37() {
        for (i, a) in ALL.iter().enumerate() {
            for b in &ALL[i + 1..] {
                for (ja, jb) in [(0, 0), (0, 49), (49, 0), (49, 49), (25, 25)] {
                    let (x, y) = (a.color(ja), b.color(jb));
                    let d = |p: u8, q: u8| (p as f64 - q as f64).powi(2);
                    let dist = (d(x.r, y.r) + d(x.g, y.g) + d(x.b, y.b)).sqrt();
                    assert!(dist >= 40.0, "{a:?} and {b:?} too close: {dist:.0}");
                }
            }
        }
    }

    /// The SVG stays valid XML with inferno's script, and its legend names
    /// the kinds this recording holds, no others.
    #[test]
    fn a_swatch_legend_of_the_kinds_present_issue_37() {
        let py = |name: &str| Frame {
            file: Some("/srv/app.py".into()),
            line: Some(3),
            ..Frame::new(name, FrameKind::Python)
        };
        let native = |name: &str| Frame {
            module: Some("libz.so.1".into()),
            ..Frame::new(name, FrameKind::Native)
        };
        let stall = testing::stall(
            0,
            vec![
                testing::part(
                    PartKind::OnCpu,
                    60_000_000,
                    vec![py("handle"), native("deflate")],
                ),
                testing::part(
                    PartKind::OffCpu,
                    40_000_000,
                    vec![
                        py("handle"),
                        Frame::new("do_syscall_64", FrameKind::Kernel),
                        Frame::marker("[off-cpu: read]"),
                    ],
                ),
            ],
        );
        let rec = Recording::for_tests(vec![stall]);
        let svg = String::from_utf8(render(&rec, View::default()).unwrap()).unwrap();
        let mut reader = quick_xml::Reader::from_str(&svg);
        loop {
            match reader.read_event() {
                Ok(quick_xml::events::Event::Eof) => break,
                Ok(_) => {}
                Err(e) => panic!("not XML at {}: {e}", reader.buffer_position()),
            }
        }
        let legend = &svg[svg.find("<g id=\"legend\"").expect("a legend")..];
        let legend = &legend[..legend.find("</g>").unwrap()];
        for want in [
            "Python",
            "native (user space)",
            "kernel",
            "off-CPU (blocked)",
        ] {
            assert!(legend.contains(&format!(">{want}<")), "{want}: {legend}");
        }
        for absent in [
            "JavaScript",
            "run queue",
            "GIL wait",
            "CPU throttled",
            "event loop",
        ] {
            assert!(!legend.contains(absent), "{absent}: {legend}");
        }
        assert!(!svg.contains("id=\"subtitle\""));
        for id in ["frames", "search", "matched", "details", "unzoom"] {
            assert!(svg.contains(&format!("id=\"{id}\"")), "inferno's {id} lost");
        }
        // The task is no frame of the default view.
        assert!(!svg.contains("[task "));
        // Every kind at once still fits the default width.
        let all = super::legend(&ALL.into_iter().collect(), 48.0);
        let scale: f64 = all
            .split("scale(")
            .nth(1)
            .unwrap()
            .split(')')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(scale < 1.0 && scale > 0.7, "{all}");
    }
}
