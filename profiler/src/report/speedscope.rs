//! Stalls -> `stalls.speedscope.json`: the stalls in speedscope's own file
//! format (<https://www.speedscope.app/file-format-schema.json>, as the
//! `speedscope` npm package 1.25.0 ships it), so <https://www.speedscope.app>
//! or `npx speedscope@1.25.0 stalls.speedscope.json` shows them on a
//! timeline (Time Order) as well as merged (Left Heavy, Sandwich).
//!
//! In: a [`Recording`] and a [`View`]. Out: one JSON file holding
//! - `shared.frames`: every distinct frame once, `name` as every output
//!   labels it ([`Frame::label`]: `load_tokenizer (tok.py:41)`), `file`
//!   (the source file, else the native frame's object file) and `line`;
//! - an **evented** profile per loop thread, in nanoseconds from the
//!   recording's start (`started_ns`), over the whole recording: each stall
//!   a synthetic root frame named by its duration and top culprit
//!   (`stall 180.0ms: load_tokenizer (tok.py:41) — on-CPU`, the asyncio
//!   task after it), open from its start to its end; inside it, its
//!   sampled stacks in the [`View`] (`stalls.folded`'s: by default the
//!   interpreter folded away and the loop's root trimmed), laid end to end
//!   in the order `stalls.json` stores them, each as long as its weight
//!   ([`EndToEnd`], the Perfetto timeline's layout): a layout, not a
//!   measurement, of where inside the stall each stack ran. Frames two
//!   consecutive stacks share stay open across them.
//!
//! The asyncio task is never a frame (it would split Left Heavy's towers
//! by task); the process is not either: each profile is one thread, named
//! `python (tid 4242)`, or with stalls in several processes
//! `uvicorn worker 2 (pid 1240) / python (tid 1240)`.
//!
//! speedscope rejects a profile whose events go back in time or leave a
//! frame that is not on top; every stall is closed before the next of its
//! thread opens, so neither can happen.
use std::{
    collections::{BTreeMap, HashMap},
    io,
    path::PathBuf,
};

use serde::Serialize;

use crate::{
    classify::AppPaths,
    model::{Frame, Recording, Stall, ThreadInfo, text::escape},
    os::{outdir::OutDir, units::fmt_ns},
    report::{
        RenderError, aggregate,
        perfetto::EndToEnd,
        view::{self, View},
        write_file_with,
    },
};

/// The output's file name.
pub const NAME: &str = "stalls.speedscope.json";

/// The schema the file follows (its `$schema`).
pub const SCHEMA: &str = "https://www.speedscope.app/file-format-schema.json";

/// speedscope's `FileFormat.File`.
#[derive(Debug, Serialize)]
pub struct File {
    #[serde(rename = "$schema")]
    pub schema: &'static str,
    pub name: String,
    pub exporter: String,
    #[serde(rename = "activeProfileIndex")]
    pub active_profile_index: usize,
    pub shared: Shared,
    pub profiles: Vec<Profile>,
}

#[derive(Debug, Serialize)]
pub struct Shared {
    pub frames: Vec<SharedFrame>,
}

/// speedscope's `FileFormat.Frame`.
#[derive(Debug, PartialEq, Eq, Hash, Clone, Serialize)]
pub struct SharedFrame {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
}

/// speedscope's `FileFormat.EventedProfile`.
#[derive(Debug, Serialize)]
pub struct Profile {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub name: String,
    pub unit: &'static str,
    #[serde(rename = "startValue")]
    pub start_value: u64,
    #[serde(rename = "endValue")]
    pub end_value: u64,
    pub events: Vec<Event>,
}

/// An `OpenFrameEvent` (`O`) or `CloseFrameEvent` (`C`) of frame `frame`
/// (an index into `shared.frames`) at `at` ns from the recording's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Event {
    #[serde(rename = "type")]
    pub kind: EventKind,
    pub frame: usize,
    pub at: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EventKind {
    #[serde(rename = "O")]
    Open,
    #[serde(rename = "C")]
    Close,
}

/// The shared frame table, each distinct frame once.
#[derive(Default)]
struct Frames {
    list: Vec<SharedFrame>,
    index: HashMap<SharedFrame, usize>,
}

impl Frames {
    fn id(&mut self, f: SharedFrame) -> usize {
        if let Some(&i) = self.index.get(&f) {
            return i;
        }
        self.list.push(f.clone());
        self.index.insert(f, self.list.len() - 1);
        self.list.len() - 1
    }

    fn of(&mut self, f: &Frame) -> usize {
        self.id(SharedFrame {
            name: f.label(),
            file: f
                .file
                .as_deref()
                .or(f.module.as_deref())
                .map(|s| escape(s).into_owned()),
            line: f.line.filter(|&l| l > 0),
        })
    }

    fn named(&mut self, name: String) -> usize {
        self.id(SharedFrame {
            name,
            file: None,
            line: None,
        })
    }
}

/// A stall's root frame: `stall 180.0ms: <top culprit>`, then the asyncio
/// task it ran in, `in task "conn-12" (handle_client)`.
fn stall_name(s: &Stall, app: &AppPaths) -> String {
    let mut name = format!("stall {}", fmt_ns(s.duration_ns));
    if let Some(c) = aggregate::stall_culprit(s, app) {
        name.push_str(&format!(": {c}"));
    }
    if let Some(t) = &s.task {
        name.push_str(&format!(", in task {}", t.describe()));
    }
    escape(&name).into_owned()
}

/// One loop thread's profile name: `python (tid 4242)`, `(tid 4242, 9 in
/// its namespace)` in a PID namespace of its own, after its process's
/// title when `several` processes stalled.
fn thread_name(rec: &Recording, pid: u32, t: &ThreadInfo, several: bool) -> String {
    let tid = match t.ns_tid {
        Some(ns) => format!("tid {}, {ns} in its namespace", t.tid),
        None => format!("tid {}", t.tid),
    };
    let thread = format!("{} ({tid})", escape(&t.name));
    if !several {
        return thread;
    }
    let process = match rec.process_of(pid) {
        Some(p) => p.title(),
        None => format!("pid {pid}"),
    };
    format!("{process} / {thread}")
}

/// The events of one stall, `shown` being it in the view, from `start` to
/// `end` (ns from the recording's start).
fn stall_events(
    frames: &mut Frames,
    root: usize,
    shown: &Stall,
    (start, end): (u64, u64),
    out: &mut Vec<Event>,
) {
    let ev = |kind, frame, at| Event { kind, frame, at };
    out.push(ev(EventKind::Open, root, start));
    let parts: Vec<_> = shown.stacks.iter().filter(|p| p.weight_ns > 0).collect();
    let lay = EndToEnd::new(start, end, parts.iter().map(|p| p.weight_ns).sum());
    let mut open: Vec<usize> = Vec::new();
    let mut cum = 0;
    for p in parts {
        let at = lay.at(cum);
        cum += p.weight_ns;
        let ids: Vec<usize> = if p.frames.is_empty() {
            vec![frames.named("[unknown]".into())]
        } else {
            p.frames.iter().map(|f| frames.of(f)).collect()
        };
        let shared = open.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        while open.len() > shared {
            let f = open.pop().expect("longer than shared");
            out.push(ev(EventKind::Close, f, at));
        }
        for &f in &ids[shared..] {
            out.push(ev(EventKind::Open, f, at));
            open.push(f);
        }
    }
    while let Some(f) = open.pop() {
        out.push(ev(EventKind::Close, f, end));
    }
    out.push(ev(EventKind::Close, root, end));
}

/// The speedscope file of `rec`, its stacks in view `v`.
pub fn file(rec: &Recording, v: View) -> File {
    let app = rec.app();
    let shown = view::apply(&rec.stalls, v, &app);
    let origin = rec.first_ns();
    let end_value = rec
        .stalls
        .iter()
        .map(|s| s.end_ns)
        .chain([rec.ended_ns, origin])
        .max()
        .unwrap_or(origin)
        - origin;
    let several = rec.stalls_in_several_processes();

    // Each loop thread's stalls in time order; the target's threads first.
    let mut threads: BTreeMap<(bool, u32, u32), Vec<usize>> = BTreeMap::new();
    for (i, s) in rec.stalls.iter().enumerate() {
        threads
            .entry((s.pid != rec.pid, s.pid, s.tid))
            .or_default()
            .push(i);
    }
    let mut frames = Frames::default();
    let mut profiles = Vec::new();
    let mut stall_ns = Vec::new();
    for stalls in threads.values_mut() {
        stalls.sort_by_key(|&i| (rec.stalls[i].start_ns, i));
        let mut events = Vec::new();
        let mut free_from = 0;
        for &i in stalls.iter() {
            let s = &rec.stalls[i];
            let root = frames.named(stall_name(s, &app));
            // A thread's stalls never overlap (each is one busy period);
            // were one to, it would start where the last ended, so the
            // events still only go forward.
            let start = (s.start_ns - origin).max(free_from);
            let end = (s.end_ns - origin).max(start);
            free_from = end;
            stall_events(&mut frames, root, &shown[i], (start, end), &mut events);
        }
        let first = &rec.stalls[stalls[0]];
        stall_ns.push(
            stalls
                .iter()
                .map(|&i| rec.stalls[i].duration_ns)
                .sum::<u64>(),
        );
        profiles.push(Profile {
            kind: "evented",
            name: thread_name(
                rec,
                first.pid,
                &ThreadInfo {
                    tid: first.tid,
                    name: first.thread_name.clone(),
                    ns_tid: first.ns_tid,
                },
                several,
            ),
            unit: "nanoseconds",
            start_value: 0,
            end_value,
            events,
        });
    }
    if profiles.is_empty() {
        // No stalls: the loop threads, empty, so the file says whose it is.
        let threads = rec.stall_threads();
        let names: Vec<String> = if threads.is_empty() {
            vec![escape(&rec.comm).into_owned()]
        } else {
            threads
                .iter()
                .map(|t| thread_name(rec, rec.pid, t, false))
                .collect()
        };
        profiles.extend(names.into_iter().map(|name| Profile {
            kind: "evented",
            name,
            unit: "nanoseconds",
            start_value: 0,
            end_value,
            events: Vec::new(),
        }));
    }
    // Open on the thread with the most stall time (the first of equals).
    let active = stall_ns
        .iter()
        .enumerate()
        .max_by_key(|&(i, ns)| (*ns, std::cmp::Reverse(i)))
        .map_or(0, |(i, _)| i);
    File {
        schema: SCHEMA,
        name: rec.title(),
        exporter: format!("stallprof {}", env!("CARGO_PKG_VERSION")),
        active_profile_index: active,
        shared: Shared {
            frames: frames.list,
        },
        profiles,
    }
}

/// The file's bytes.
pub fn encode(rec: &Recording, v: View, w: &mut dyn io::Write) -> io::Result<()> {
    serde_json::to_writer(&mut *w, &file(rec, v))?;
    w.write_all(b"\n")
}

/// `stalls.speedscope.json` in the default view.
pub fn write(rec: &Recording, dir: &OutDir) -> Result<PathBuf, RenderError> {
    write_view(rec, dir, View::default())
}

pub fn write_view(rec: &Recording, dir: &OutDir, v: View) -> Result<PathBuf, RenderError> {
    write_file_with(dir, NAME, |w| encode(rec, v, w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FrameKind, PartKind, StackPart, Task};
    use crate::testing;
    use serde_json::Value;

    /// speedscope's schema, vendored unchanged (tests/fixtures/speedscope).
    const SCHEMA_JSON: &str =
        include_str!("../../tests/fixtures/speedscope/file-format-schema.json");

    /// `value` against `schema` (a node of `root`), for the keywords
    /// speedscope's schema uses; any other keyword fails the test rather
    /// than pass unchecked.
    fn validate(root: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
        let obj = schema.as_object().expect("a schema is an object");
        for (k, rule) in obj {
            match k.as_str() {
                "$schema" | "title" | "definitions" => {}
                "$ref" => {
                    let name = rule
                        .as_str()
                        .and_then(|r| r.strip_prefix("#/definitions/"))
                        .unwrap_or_else(|| panic!("unsupported $ref {rule}"));
                    validate(root, &root["definitions"][name], value, at)?;
                }
                "type" => {
                    let ok = match rule.as_str().unwrap() {
                        "object" => value.is_object(),
                        "array" => value.is_array(),
                        "string" => value.is_string(),
                        "number" => value.is_number(),
                        t => panic!("unsupported type {t}"),
                    };
                    if !ok {
                        return Err(format!("{at}: {value} is not of type {rule}"));
                    }
                }
                "const" if value != rule => {
                    return Err(format!("{at}: {value} is not {rule}"));
                }
                "const" => {}
                "enum" if !rule.as_array().unwrap().contains(value) => {
                    return Err(format!("{at}: {value} is not one of {rule}"));
                }
                "enum" => {}
                "required" => {
                    for r in rule.as_array().unwrap() {
                        let r = r.as_str().unwrap();
                        if value.get(r).is_none() {
                            return Err(format!("{at}: no {r}"));
                        }
                    }
                }
                "properties" => {
                    for (name, s) in rule.as_object().unwrap() {
                        if let Some(v) = value.get(name) {
                            validate(root, s, v, &format!("{at}.{name}"))?;
                        }
                    }
                }
                "items" => {
                    for (i, v) in value.as_array().into_iter().flatten().enumerate() {
                        validate(root, rule, v, &format!("{at}[{i}]"))?;
                    }
                }
                "anyOf" => {
                    let errors: Vec<String> = rule
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter_map(|s| validate(root, s, value, at).err())
                        .collect();
                    if errors.len() == rule.as_array().unwrap().len() {
                        return Err(format!("{at}: matches none of anyOf: {errors:?}"));
                    }
                }
                k => panic!("the schema uses {k:?}, which this check does not know"),
            }
        }
        Ok(())
    }

    fn json(rec: &Recording, v: View) -> Value {
        let mut bytes = Vec::new();
        encode(rec, v, &mut bytes).unwrap();
        let value: Value = serde_json::from_slice(&bytes).unwrap();
        let schema: Value = serde_json::from_str(SCHEMA_JSON).unwrap();
        validate(&schema, &schema, &value, "$").unwrap_or_else(|e| panic!("{e}\n{value:#}"));
        value
    }

    /// A frame open from `open` to `close` at `depth` (0: a stall's root).
    #[derive(Debug, PartialEq)]
    struct Span {
        depth: usize,
        name: String,
        open: u64,
        close: u64,
    }

    /// Replays a profile's events as speedscope does, failing where it
    /// would refuse the file: an event before the one before it, a close
    /// of a frame not on top, a frame left open.
    fn replay(file: &Value, profile: &Value) -> Vec<Span> {
        replay_stacks(file, profile).0
    }

    /// [`replay`], with the time spent in each stack under the stalls'
    /// frames (`a;b;c`, as `stalls.folded` keys it).
    fn replay_stacks(file: &Value, profile: &Value) -> (Vec<Span>, BTreeMap<String, u64>) {
        let frames = file["shared"]["frames"].as_array().unwrap();
        let name = |i: usize| frames[i]["name"].as_str().unwrap().to_string();
        let mut stack: Vec<(usize, u64)> = Vec::new();
        let mut spans = Vec::new();
        let mut stacks: BTreeMap<String, u64> = BTreeMap::new();
        let mut last = 0;
        for e in profile["events"].as_array().unwrap() {
            let (frame, at) = (
                e["frame"].as_u64().unwrap() as usize,
                e["at"].as_u64().unwrap(),
            );
            assert!(frame < frames.len(), "{e}: no such frame");
            assert!(at >= last, "{e} goes back from {last}");
            assert!(
                at <= profile["endValue"].as_u64().unwrap(),
                "{e} past the end"
            );
            if stack.len() > 1 && at > last {
                let key: Vec<String> = stack[1..].iter().map(|&(f, _)| name(f)).collect();
                *stacks.entry(key.join(";")).or_default() += at - last;
            }
            last = at;
            match e["type"].as_str().unwrap() {
                "O" => stack.push((frame, at)),
                "C" => {
                    let (top, open) = stack.pop().unwrap_or_else(|| panic!("{e}: nothing open"));
                    assert_eq!(top, frame, "{e}: closes a frame not on top");
                    spans.push(Span {
                        depth: stack.len(),
                        name: name(frame),
                        open,
                        close: at,
                    });
                }
                t => panic!("event type {t}"),
            }
        }
        assert!(stack.is_empty(), "left open: {stack:?}");
        (spans, stacks)
    }

    fn n(name: &str, module: &str) -> Frame {
        Frame {
            module: Some(module.into()),
            ..Frame::new(name, FrameKind::Native)
        }
    }
    fn py(name: &str, line: u32) -> Frame {
        Frame {
            file: Some("/srv/app.py".into()),
            line: Some(line),
            ..Frame::new(name, FrameKind::Python)
        }
    }
    /// `_start -> eval -> handle -> eval -> <leaf>`: an interpreter's stack.
    fn stack(leaf: Frame) -> Vec<Frame> {
        vec![
            n("_start", "python3.11"),
            n("_PyEval_EvalFrameDefault", "python3.11"),
            py("handle", 10),
            n("_PyEval_EvalFrameDefault", "python3.11"),
            leaf,
        ]
    }

    /// tid 7 of pid 5 (`loop`), recording from 1 s to 3 s:
    /// ```text
    ///  1.1s         1.16s             1.5s      1.53s
    ///   |--A 60 ms--|                  |-B 30ms-|
    ///   crunch 40ms, read 10 ms,        crunch 30 ms
    ///   crunch 10 ms (in task "conn-7")
    /// ```
    /// stored B first, as a recording may (stalls.json is in end order
    /// per process; the test wants time order per thread regardless).
    fn recording() -> Recording {
        let ms = 1_000_000;
        let mut read = testing::part(
            PartKind::OffCpu,
            10 * ms,
            [
                stack(py("fetch", 20)),
                vec![Frame::marker("[off-cpu: read]")],
            ]
            .concat(),
        );
        read.syscall = Some("read".into());
        let crunch = |ns| testing::part(PartKind::OnCpu, ns, stack(py("crunch", 30)));
        let a = Stall {
            pid: 5,
            tid: 7,
            thread_name: "loop".into(),
            task: Some(Task {
                name: "conn-7".into(),
                coro: Some("handle".into()),
                awaited_by: vec![],
                ..Default::default()
            }),
            ..testing::stall(1_100 * ms, vec![crunch(40 * ms), read, crunch(10 * ms)])
        };
        let b = Stall {
            pid: 5,
            tid: 7,
            thread_name: "loop".into(),
            ..testing::stall(1_500 * ms, vec![crunch(30 * ms)])
        };
        Recording {
            pid: 5,
            comm: "python3".into(),
            started_ns: 1_000 * ms,
            ended_ns: 3_000 * ms,
            ..Recording::for_tests(vec![b, a])
        }
        .completed()
    }

    fn names(spans: &[Span], depth: usize) -> Vec<&str> {
        spans
            .iter()
            .filter(|s| s.depth == depth)
            .map(|s| s.name.as_str())
            .collect()
    }

    #[test]
    fn valid_by_speedscopes_schema_with_the_recordings_name_and_unit() {
        let rec = recording();
        for v in [View::default(), View::ALL] {
            let f = json(&rec, v);
            assert_eq!(f["$schema"], SCHEMA);
            assert_eq!(f["name"], rec.title());
            assert!(
                f["name"].as_str().unwrap().contains("pid 5 (python3)"),
                "{f}"
            );
            assert_eq!(
                f["exporter"],
                format!("stallprof {}", env!("CARGO_PKG_VERSION"))
            );
            let profiles = f["profiles"].as_array().unwrap();
            assert_eq!(profiles.len(), 1);
            let p = &profiles[0];
            assert_eq!(p["type"], "evented");
            assert_eq!(p["unit"], "nanoseconds");
            assert_eq!(p["name"], "loop (tid 7)");
            assert_eq!(p["startValue"], 0);
            assert_eq!(p["endValue"], 2_000_000_000u64, "the whole recording");
            for fr in f["shared"]["frames"].as_array().unwrap() {
                if fr["name"].as_str().unwrap().starts_with("crunch") {
                    assert_eq!(fr["file"], "/srv/app.py");
                    // A frame per function unless `--lines` (View::ALL's).
                    let line = if v.lines { 30.into() } else { Value::Null };
                    assert_eq!(fr["line"], line, "{v:?}");
                }
            }
        }
        // Two processes, and none at all, are valid too.
        json(&testing::two_workers(), View::default());
        let none = Recording::for_tests(vec![]);
        let f = json(&none, View::default());
        assert_eq!(f["profiles"][0]["events"], serde_json::json!([]));
    }

    #[test]
    fn the_schema_check_refuses_what_speedscope_would() {
        let schema: Value = serde_json::from_str(SCHEMA_JSON).unwrap();
        let mut f = serde_json::to_value(file(&recording(), View::default())).unwrap();
        assert_eq!(validate(&schema, &schema, &f, "$"), Ok(()));
        for (path, bad) in [
            ("/profiles/0/unit", serde_json::json!("ns")),
            ("/profiles/0/type", serde_json::json!("timed")),
            ("/profiles/0/events/0/type", serde_json::json!("B")),
            ("/shared/frames/0/name", serde_json::json!(30)),
        ] {
            let old = std::mem::replace(f.pointer_mut(path).unwrap(), bad);
            assert!(
                validate(&schema, &schema, &f, "$").is_err(),
                "{path} passed"
            );
            *f.pointer_mut(path).unwrap() = old;
        }
        f["profiles"][0].as_object_mut().unwrap().remove("events");
        assert!(validate(&schema, &schema, &f, "$").is_err());
    }

    #[test]
    fn stalls_in_time_order_from_the_recordings_start_with_their_durations() {
        let rec = recording();
        let f = json(&rec, View::default());
        let spans = replay(&f, &f["profiles"][0]);
        let stalls: Vec<(u64, u64)> = spans
            .iter()
            .filter(|s| s.depth == 0)
            .map(|s| (s.open, s.close - s.open))
            .collect();
        // A at +100 ms for 60 ms, then B at +500 ms for 30 ms.
        assert_eq!(
            stalls,
            [(100_000_000, 60_000_000), (500_000_000, 30_000_000)]
        );
        let mut by_start = rec.stalls.clone();
        by_start.sort_by_key(|s| s.start_ns);
        for (got, s) in stalls.iter().zip(&by_start) {
            assert_eq!(*got, (s.start_ns - rec.started_ns, s.duration_ns));
        }
        let roots = names(&spans, 0);
        assert_eq!(
            roots,
            [
                "stall 60.0ms: crunch (app.py:30) — on-CPU, in task \"conn-7\" (handle)",
                "stall 30.0ms: crunch (app.py:30) — on-CPU",
            ]
        );
    }

    #[test]
    fn parts_laid_end_to_end_in_stored_order_sized_by_weight() {
        let rec = recording();
        let f = json(&rec, View::ALL);
        let spans = replay(&f, &f["profiles"][0]);
        let ms = 1_000_000;
        // Stall A's leaves: crunch 40 ms, fetch's read 10 ms, crunch
        // 10 ms, one after the other from its start.
        let leaves: Vec<(&str, u64, u64)> = spans
            .iter()
            .filter(|s| s.close <= 160 * ms)
            .filter(|s| s.name.starts_with("crunch") || s.name.starts_with("[off-cpu"))
            .map(|s| (s.name.as_str(), s.open, s.close))
            .collect();
        assert_eq!(
            leaves,
            [
                ("crunch (app.py:30)", 100 * ms, 140 * ms),
                ("[off-cpu: read]", 140 * ms, 150 * ms),
                ("crunch (app.py:30)", 150 * ms, 160 * ms),
            ]
        );
        // `handle`, shared by every stack of the stall, stays open across
        // them: one bar in Time Order.
        let handle: Vec<(u64, u64)> = spans
            .iter()
            .filter(|s| s.depth == 3 && s.name == "handle (app.py:10)")
            .map(|s| (s.open, s.close))
            .collect();
        assert_eq!(handle, [(100 * ms, 160 * ms), (500 * ms, 530 * ms)]);
    }

    #[test]
    fn real_functions_in_the_default_view_never_the_task() {
        let rec = recording();
        for v in [View::default(), View::ALL] {
            let f = json(&rec, v);
            let frames = f["shared"]["frames"].to_string();
            assert!(!frames.contains("[task"), "{frames}");
            assert_eq!(frames.contains("_PyEval"), v == View::ALL, "{frames}");
            // Under the stalls' frames: exactly stalls.folded's stacks,
            // weighted alike (what Sandwich and Left Heavy merge).
            let (_, stacks) = replay_stacks(&f, &f["profiles"][0]);
            let folded = aggregate::folded_ns(&view::apply(&rec.stalls, v, &rec.app()));
            assert_eq!(stacks, folded);
        }
        let (_, stacks) = replay_stacks(
            &json(&rec, View::default()),
            &json(&rec, View::default())["profiles"][0],
        );
        assert_eq!(
            stacks.into_iter().collect::<Vec<_>>(),
            [
                ("crunch (app.py)".to_string(), 80_000_000),
                ("fetch (app.py);[off-cpu: read]".to_string(), 10_000_000),
            ]
        );
    }

    #[test]
    fn a_profile_per_loop_thread_named_by_its_process_among_several() {
        let rec = testing::two_workers();
        let f = json(&rec, View::ALL);
        let profiles = f["profiles"].as_array().unwrap();
        let got: Vec<(&str, Vec<(u64, u64)>)> = profiles
            .iter()
            .map(|p| {
                let spans = replay(&f, p);
                let stalls = spans
                    .iter()
                    .filter(|s| s.depth == 0)
                    .map(|s| (s.open / 1_000_000, (s.close - s.open) / 1_000_000))
                    .collect();
                (p["name"].as_str().unwrap(), stalls)
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "uvicorn worker 1 (pid 1210) / python3.12 (tid 1210)",
                    vec![(100, 30)]
                ),
                (
                    "uvicorn worker 2 (pid 1220) / python3.12 (tid 1220)",
                    vec![(200, 10), (300, 10)]
                ),
            ]
        );
        // The process is the profile, not a frame; it opens on the thread
        // with the most stall time.
        let frames = f["shared"]["frames"].to_string();
        assert!(!frames.contains("(pid 12"), "{frames}");
        assert_eq!(f["activeProfileIndex"], 0);
        // Total stall time is the recording's.
        let total: u64 = profiles
            .iter()
            .flat_map(|p| replay(&f, p))
            .filter(|s| s.depth == 0)
            .map(|s| s.close - s.open)
            .sum();
        assert_eq!(total, rec.total_stall_ns());
    }

    #[test]
    fn a_part_without_frames_is_unknown_and_empty_parts_take_no_time() {
        let ms = 1_000_000;
        let s = testing::stall(
            0,
            vec![
                testing::part(PartKind::OnCpu, 0, vec![py("never", 1)]),
                StackPart {
                    frames: vec![],
                    ..testing::part(PartKind::OnCpu, 5 * ms, vec![])
                },
                testing::part(PartKind::OnCpu, 5 * ms, vec![py("spin", 2)]),
            ],
        );
        let rec = Recording::for_tests(vec![s]);
        let f = json(&rec, View::ALL);
        let spans = replay(&f, &f["profiles"][0]);
        let leaves: Vec<(&str, u64, u64)> = spans
            .iter()
            .filter(|s| s.depth == 1)
            .map(|s| (s.name.as_str(), s.open, s.close))
            .collect();
        assert_eq!(
            leaves,
            [
                ("[unknown]", 0, 5 * ms),
                ("spin (app.py:2)", 5 * ms, 10 * ms)
            ]
        );
    }
}
