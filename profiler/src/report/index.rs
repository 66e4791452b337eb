//! The page `stallprof report DIR --serve` answers `/` with: the
//! recording's stalls in time order and a link to each output in the
//! viewer that opens it.
//!
//! In: a [`Recording`], the output files present, where the served
//! speedscope app is (if any) and the outputs' directory on disk. Out: one
//! HTML page, self-contained (no script, no outside URL is loaded: a link to
//! ui.perfetto.dev is only a link). Every name the target chose is
//! [`escape`]d, then [`html`]-escaped.
use std::fmt::Write as _;

use crate::{
    model::{
        Recording, Stall,
        text::{escape, html},
    },
    os::units::fmt_ns,
    report::{aggregate, viewers},
};

/// Where the page finds speedscope: its app served at `url_path`
/// (`/speedscope/`), or the words saying how to install it.
pub enum Speedscope<'a> {
    Served { url_path: &'a str },
    Missing { install: &'a str },
}

/// The hash that makes speedscope fetch `file` from this server and
/// show it under `title` (speedscope's `#profileURL=…&title=…`).
pub fn speedscope_hash(file: &str, title: &str) -> String {
    format!(
        "#profileURL={}&title={}",
        percent_encode(&format!("/{file}")),
        percent_encode(title)
    )
}

/// `s` with every byte but unreserved ones (RFC 3986) as `%XX`: safe in a
/// URL fragment's `key=value` and in an HTML attribute.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The share of `part` in `whole`, as `40%`.
fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "0%".into();
    }
    format!("{:.0}%", part as f64 * 100.0 / whole as f64)
}

/// How a stall's time split: the kinds it had, `on-CPU 40% · run queue 60%`.
fn split(s: &Stall) -> String {
    let gil: u64 = s
        .stacks
        .iter()
        .filter(|p| p.kind == crate::model::PartKind::GilWait)
        .map(|p| p.weight_ns)
        .sum();
    [
        ("on-CPU", s.on_cpu_ns),
        ("off-CPU", s.off_cpu_ns.saturating_sub(gil)),
        ("GIL wait", gil),
        ("run queue", s.runqueue_ns),
        ("throttled", s.throttled_ns),
    ]
    .iter()
    .filter(|(_, ns)| *ns > 0)
    .map(|(k, ns)| format!("{k} {}", pct(*ns, s.duration_ns)))
    .collect::<Vec<_>>()
    .join(" · ")
}

/// The page. `files`: the names of the outputs present in `dir` (the
/// outputs' directory, shown in the commands to run).
pub fn page(rec: &Recording, files: &[String], dir: &str, speedscope: Speedscope<'_>) -> String {
    let title = html(&rec.title());
    let mut h = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title>\
         <style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left;vertical-align:top}}\
         th{{background:#eee}}td.n{{text-align:right}}code{{background:#f4f4f4}}</style></head><body>\
         <h1>{title}</h1>"
    );
    let has = |f: &str| files.iter().any(|x| x == f);
    h.push_str("<h2>Open the recording</h2><ul id=\"viewers\">");
    if has("stalls.svg") {
        h.push_str(
            "<li><a id=\"svg\" href=\"/stalls.svg\">stalls.svg</a>: the stall flamegraph \
             (search with Ctrl-F or the Search button, click to zoom)</li>",
        );
    }
    if has(crate::report::speedscope::NAME) {
        let name = crate::report::speedscope::NAME;
        match speedscope {
            Speedscope::Served { url_path } => {
                let _ = write!(
                    h,
                    "<li><a id=\"speedscope\" href=\"{}index.html{}\">speedscope</a>: the stalls \
                     on a timeline (Time Order), merged (Left Heavy) and by function (Sandwich), \
                     served from the speedscope package installed here (<a href=\"/{name}\">{name}</a>)</li>",
                    html(url_path),
                    html(&speedscope_hash(name, &rec.title()))
                );
            }
            Speedscope::Missing { install } => {
                let _ = write!(
                    h,
                    "<li id=\"speedscope-missing\"><a href=\"/{name}\">{name}</a>: no speedscope \
                     package found here to open it with; {}</li>",
                    html(install)
                );
            }
        }
    }
    if has("stalls.pb.gz") {
        let _ = write!(
            h,
            "<li><a href=\"/stalls.pb.gz\">stalls.pb.gz</a>: pprof, <code>{}</code></li>",
            html(&viewers::open_with(&format!("{dir}/stalls.pb.gz")).unwrap_or_default())
        );
    }
    if has("stalls.pftrace") {
        h.push_str(
            "<li><a href=\"/stalls.pftrace\">stalls.pftrace</a>: the Perfetto timeline; \
             download it, then open it at <a href=\"https://ui.perfetto.dev\">ui.perfetto.dev</a> \
             (read in the browser, not uploaded)</li>",
        );
    }
    if has("stalls.json") {
        h.push_str(
            "<li><a href=\"/stalls.json\">stalls.json</a>: the recording, every stall in full \
             (docs/format.md)</li>",
        );
    }
    if has("stalls.folded") {
        h.push_str(
            "<li><a href=\"/stalls.folded\">stalls.folded</a>: collapsed stacks (inferno, \
             flamegraph.pl, speedscope)</li>",
        );
    }
    h.push_str("</ul>");

    let app = rec.app();
    let several = rec.stalls_in_several_processes();
    let first = rec.first_ns();
    let mut stalls: Vec<&Stall> = rec.stalls.iter().collect();
    stalls.sort_by_key(|s| (s.start_ns, s.tid));
    let _ = write!(
        h,
        "<h2>Stalls</h2><p>{} stalls of {} or more, {} in all; times from the recording's start.</p>\
         <table id=\"stalls\"><tr><th>#</th><th>at</th><th>duration</th><th>top culprit</th>\
         <th>split</th><th>task / route</th><th>{}</th></tr>",
        stalls.len(),
        fmt_ns(rec.threshold_ns),
        fmt_ns(rec.total_stall_ns()),
        if several {
            "process / thread"
        } else {
            "thread"
        }
    );
    for (i, s) in stalls.iter().enumerate() {
        let culprit = aggregate::stall_culprit(s, &app).unwrap_or_default();
        let task = s
            .task
            .as_ref()
            .map(|t| escape(&t.describe()).into_owned())
            .or_else(|| s.coroutine.as_deref().map(|c| escape(c).into_owned()));
        let route = s.route.as_ref().map(|r| escape(&r.describe()).into_owned());
        let where_ = [task, route].into_iter().flatten().collect::<Vec<_>>();
        let thread = format!("{} (tid {})", escape(&s.thread_name), s.tid);
        let who = match rec.process_of(s.pid).filter(|_| several) {
            Some(p) => format!("{} / {thread}", p.title()),
            None => thread,
        };
        let _ = write!(
            h,
            "<tr class=\"stall\"><td class=\"n\">{}</td><td class=\"n\">{:.3}s</td><td class=\"n\">{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            i + 1,
            s.start_ns.saturating_sub(first) as f64 / 1e9,
            fmt_ns(s.duration_ns),
            html(&culprit),
            split(s),
            html(&where_.join(", ")),
            html(&who)
        );
    }
    h.push_str("</table></body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_encoded_for_speedscope_and_html() {
        assert_eq!(
            speedscope_hash("stalls.speedscope.json", "a <b> & \"c\" 5%"),
            "#profileURL=/stalls.speedscope.json&title=a%20%3Cb%3E%20%26%20%22c%22%205%25"
        );
    }

    #[test]
    fn page_lists_each_stall_and_says_how_to_get_speedscope() {
        use crate::model::{Frame, FrameKind, PartKind};
        use crate::testing::{part, stall};
        let on = |start_ms: u64, ms: u64| {
            let frames = vec![Frame::new("spin", FrameKind::Native)];
            stall(
                start_ms * 1_000_000,
                vec![part(PartKind::OnCpu, ms * 1_000_000, frames)],
            )
        };
        let mut rec = Recording::for_tests(vec![on(2000, 120), on(1000, 60)]);
        rec.stalls[0].thread_name = "<script>".into();
        let files = vec![
            "stalls.svg".to_string(),
            "stalls.speedscope.json".to_string(),
        ];
        let p = page(
            &rec,
            &files,
            "/tmp/out",
            Speedscope::Missing {
                install: "npm install -g speedscope@1.25.0",
            },
        );
        assert_eq!(p.matches("<tr class=\"stall\">").count(), 2);
        assert!(
            p.find("60.0ms").unwrap() < p.find("120.0ms").unwrap(),
            "{p}"
        );
        assert!(p.contains("npm install -g speedscope@1.25.0"));
        assert!(!p.contains("<script>"), "{p}");
        assert!(p.contains("&lt;script&gt;"));
        assert!(!p.contains("stalls.pb.gz"), "only the files present: {p}");
    }
}
