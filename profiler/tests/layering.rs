//! The house's order, held by a test: the rooms of `profiler/src` follow
//! the data flow, and an import may only point down it.
//!
//! Read from the source as text: every `crate::…` and `super::…` path
//! outside comments and `#[cfg(test)]` modules, `use` trees expanded, is
//! resolved to the module file it names. Two checks:
//! - **rooms**: each top-level module (a room) names the rooms it may use
//!   ([`ROOMS`]); an import of any other is an arrow pointing up, and the
//!   test names the file, the path and the rule it breaks;
//! - **circles**: among files, no import cycle (a room's files may use each
//!   other, but one way), named file by file.
//!
//! A new room must be added to [`ROOMS`] (the test fails on an unknown
//! one), which is where its place in the order is decided.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

/// Each room and the rooms it may import, in dependency order: a room
/// may use only rooms listed before it, and `report` only the vocabulary
/// (it renders a recording, live or loaded from disk, and knows nothing
/// of how it was made).
const ROOMS: &[(&str, &[&str])] = &[
    ("os", &[]),
    ("model", &["os"]),
    ("classify", &["os", "model"]),
    ("kernel", &["os", "model"]),
    ("assemble", &["os", "model", "kernel"]),
    ("unwind", &["os", "model", "kernel"]),
    (
        "symbolize",
        &["os", "model", "classify", "kernel", "assemble", "unwind"],
    ),
    (
        "pipeline",
        &[
            "os",
            "model",
            "classify",
            "kernel",
            "assemble",
            "unwind",
            "symbolize",
        ],
    ),
    ("report", &["os", "model", "classify"]),
    ("fuzzing", &["os", "model", "kernel", "unwind", "symbolize"]),
    (
        "commands",
        &[
            "os",
            "model",
            "classify",
            "kernel",
            "assemble",
            "unwind",
            "symbolize",
            "pipeline",
            "report",
        ],
    ),
    ("cli", &["commands", "os", "model", "kernel", "report"]),
    // Unit tests' builders of model values (compiled for tests only).
    ("testing", &["os", "model"]),
];

/// One module file: its path as a module (`report::view`) and its text.
struct Module {
    path: Vec<String>,
    text: String,
}

/// `a/b.rs` -> `a::b`; `a/mod.rs` -> `a`; `lib.rs` -> the crate root.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" && stem != "main" {
        parts.push(stem.to_string());
    }
    parts
}

fn read_tree(dir: &Path, root: &Path, out: &mut Vec<Module>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            read_tree(&p, root, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let rel = p.strip_prefix(root).unwrap();
            // The binary is its own crate: it uses the library by name.
            if rel == Path::new("main.rs") {
                continue;
            }
            out.push(Module {
                path: module_path(rel),
                text: std::fs::read_to_string(&p).unwrap(),
            });
        }
    }
}

/// The text without comments, string literals' contents, and
/// `#[cfg(test)]` items (a test may reach anywhere; what it imports is not
/// the house's structure).
fn code_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if text[i..].starts_with("//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if text[i..].starts_with("/*") {
            i += text[i..].find("*/").map_or(b.len() - i, |n| n + 2);
        } else if b[i] == b'\'' {
            // A char literal (`'{'`, `'\''`, `'\u{7f}'`) or a lifetime (`'a`).
            let rest = &text[i + 1..];
            let mut cs = rest.char_indices();
            match (cs.next(), cs.next()) {
                (Some((_, '\\')), _) => {
                    i += 1 + rest[1..].find('\'').map_or(rest.len(), |n| n + 2);
                    out.push_str("' '");
                }
                (Some(_), Some((n, '\''))) => {
                    i += 1 + n + 1;
                    out.push_str("' '");
                }
                _ => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else if b[i] == b'"' {
            out.push_str("\"\"");
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if text[i..].starts_with("#[cfg(test)]") {
            // Skip the attribute and the item it guards: up to its `;` or
            // through its balanced braces.
            i += "#[cfg(test)]".len();
            let mut depth = 0usize;
            while i < b.len() {
                match b[i] {
                    b'{' => depth += 1,
                    b'}' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            i += 1;
                            break;
                        }
                    }
                    b';' if depth == 0 => {
                        i += 1;
                        break;
                    }
                    _ => {}
                }
                i += 1;
            }
        } else {
            let ch = text[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// The paths a `use` tree names, expanded: `a::{b, c::{d, e}}` ->
/// `a::b`, `a::c::d`, `a::c::e`.
fn expand(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let t = tree.split(" as ").next().unwrap_or("").trim();
        let t = t.trim_end_matches("::*").trim_end_matches("::self");
        if !t.is_empty() && t != "self" && t != "*" {
            out.push(format!("{prefix}{t}"));
        } else if !prefix.is_empty() {
            out.push(prefix.trim_end_matches("::").to_string());
        }
        return;
    };
    let head = &tree[..open];
    let body = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand(&format!("{prefix}{head}"), &body[start..i], out);
                start = i + 1;
            }
            _ => {}
        }
    }
    expand(&format!("{prefix}{head}"), &body[start..], out);
}

/// Every module path a file's code refers to, as written (`crate::x::y`,
/// `super::z`).
fn references(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let before = rest[..i].chars().last();
        let stmt_end = rest[i..].find(';').map_or(rest.len(), |n| i + n);
        if before.is_none_or(|c| !c.is_alphanumeric() && c != '_') {
            expand("", &rest[i + 4..stmt_end], &mut out);
        }
        rest = &rest[(i + 4).min(rest.len())..];
    }
    // Inline paths: `crate::a::b::f(...)`, `super::x::Y`.
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            let before = code[..at].chars().last();
            let end = code[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |n| at + n);
            if before.is_none_or(|c| !c.is_alphanumeric() && c != '_') {
                out.push(code[at..end].trim_end_matches(':').to_string());
            }
            from = end.max(at + start.len());
        }
    }
    out.retain(|p| p.starts_with("crate::") || p.starts_with("super::"));
    out
}

/// The module file a path names: its longest prefix that is a module.
fn resolve(from: &[String], path: &str, modules: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let mut base: Vec<String> = Vec::new();
    match segs.first() {
        Some(&"crate") => {
            segs.remove(0);
        }
        Some(&"super") => {
            // A module's `super` is its parent (`a/b.rs` and `a/b/mod.rs`
            // alike are `a::b`, whose parent is `a`).
            base = from.to_vec();
            while segs.first() == Some(&"super") {
                segs.remove(0);
                base.pop();
            }
        }
        _ => return None,
    }
    let full: Vec<String> = base
        .into_iter()
        .chain(segs.iter().map(|s| s.to_string()))
        .collect();
    (1..=full.len())
        .rev()
        .map(|n| full[..n].to_vec())
        .find(|p| modules.contains(p))
}

/// Every arrow between module files: (from, to) -> the paths that made it.
type Arrows = BTreeMap<(Vec<String>, Vec<String>), Vec<String>>;

fn arrows(mods: &[Module]) -> Arrows {
    let known: BTreeSet<Vec<String>> = mods.iter().map(|m| m.path.clone()).collect();
    let mut out = Arrows::new();
    for m in mods {
        for r in references(&code_of(&m.text)) {
            if let Some(to) = resolve(&m.path, &r, &known)
                && to != m.path
                && !to.is_empty()
            {
                out.entry((m.path.clone(), to)).or_default().push(r);
            }
        }
    }
    out
}

fn show(p: &[String]) -> String {
    if p.is_empty() {
        "crate".into()
    } else {
        p.join("::")
    }
}

/// The arrows that break the rooms' order, in words.
fn upward(arrows: &Arrows) -> Vec<String> {
    let rooms: BTreeMap<&str, &[&str]> = ROOMS.iter().copied().collect();
    let mut bad = Vec::new();
    for ((from, to), paths) in arrows {
        let (Some(a), Some(b)) = (from.first(), to.first()) else {
            continue;
        };
        if a == b {
            continue;
        }
        match rooms.get(a.as_str()) {
            None => bad.push(format!(
                "room `{a}` is not in tests/layering.rs's ROOMS: give it its place in the order"
            )),
            Some(allowed) if !allowed.contains(&b.as_str()) => bad.push(format!(
                "`{}` -> `{}` ({}) points up: `{a}` may use only {:?}",
                show(from),
                show(to),
                paths[0],
                allowed
            )),
            _ => {}
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

/// The import cycles among files (each as a list of modules), by Tarjan's
/// strongly connected components.
fn circles(arrows: &Arrows) -> Vec<Vec<String>> {
    let mut next: BTreeMap<&Vec<String>, Vec<&Vec<String>>> = BTreeMap::new();
    for (from, to) in arrows.keys() {
        next.entry(from).or_default().push(to);
        next.entry(to).or_default();
    }
    struct St<'a> {
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on: BTreeSet<&'a Vec<String>>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(
        v: &'a Vec<String>,
        next: &BTreeMap<&'a Vec<String>, Vec<&'a Vec<String>>>,
        s: &mut St<'a>,
    ) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        for &w in &next[v] {
            if !s.index.contains_key(w) {
                visit(w, next, s);
                let l = s.low[w].min(s.low[v]);
                s.low.insert(v, l);
            } else if s.on.contains(w) {
                let l = s.index[w].min(s.low[v]);
                s.low.insert(v, l);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(show(w));
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = St {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    let nodes: Vec<&Vec<String>> = next.keys().copied().collect();
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(v, &next, &mut s);
        }
    }
    s.out
}

fn house() -> Vec<Module> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut mods = Vec::new();
    read_tree(&src, &src, &mut mods);
    mods
}

#[test]
fn no_import_points_up_the_data_flow() {
    let mods = house();
    assert!(mods.len() > 50, "read only {} files of src/", mods.len());
    let a = arrows(&mods);
    assert!(
        a.keys()
            .any(|(f, t)| f.first().map(String::as_str) == Some("pipeline")
                && t.first().map(String::as_str) == Some("assemble")),
        "the checker found no arrow pipeline -> assemble: it reads nothing"
    );
    let bad = upward(&a);
    assert!(
        bad.is_empty(),
        "imports that point up:\n  {}",
        bad.join("\n  ")
    );
}

#[test]
fn no_import_circle_among_files() {
    let c = circles(&arrows(&house()));
    assert!(
        c.is_empty(),
        "import circles (each a set of modules that reach each other):\n  {}",
        c.iter()
            .map(|c| c.join(" <-> "))
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

/// The checker itself, on a made-up house: a deliberately wrong edge (the
/// model rendering through report) and a circle are found and named.
#[test]
fn the_checker_names_a_wrong_edge_and_a_circle() {
    let m = |file: &str, text: &str| Module {
        path: module_path(Path::new(file)),
        text: text.into(),
    };
    let mods = vec![
        m(
            "model/mod.rs",
            "pub mod text;\nuse crate::report::label::escape; // up!\n",
        ),
        m(
            "model/text.rs",
            "use super::Frame;\n// use crate::pipeline::x;\n",
        ),
        m("report/mod.rs", "pub mod label;\npub mod view;\n"),
        m("report/label.rs", "pub fn escape() {}\n"),
        m(
            "report/view.rs",
            "use crate::{model::{self, text::X}, report::aggregate::culprit};\n",
        ),
        m(
            "report/aggregate.rs",
            "fn f() { crate::report::view::apply(); }\n",
        ),
        m(
            "os/mod.rs",
            "#[cfg(test)]\nmod tests { use crate::pipeline::engine; }\nfn s() -> &'static str { \"crate::report\" }\n",
        ),
        m("pipeline/engine.rs", ""),
    ];
    let a = arrows(&mods);
    let bad = upward(&a);
    assert_eq!(bad.len(), 1, "{bad:#?}");
    assert!(
        bad[0].starts_with("`model` -> `report::label` (crate::report::label::escape) points up"),
        "{}",
        bad[0]
    );
    let c = circles(&a);
    assert_eq!(
        c,
        [vec![
            "report::aggregate".to_string(),
            "report::view".to_string()
        ]]
    );
    // Neither the comment, the string nor the test module made an arrow.
    assert!(
        !a.keys()
            .any(|(f, _)| f.first().map(String::as_str) == Some("os"))
    );
    assert!(a.contains_key(&(vec!["model".into(), "text".into()], vec!["model".into()])));
}
