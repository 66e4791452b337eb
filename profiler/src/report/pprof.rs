//! Stalls -> pprof: the gzipped `profile.proto` that `go tool pprof`, Parca
//! and Pyroscope read. One builder for every writer: `record` and `report`
//! (`stalls.pb.gz` beside `stalls.json`), the daemon's windows and its
//! `/debug/pprof/profile`.
//!
//! In: stalls, each with its process. Out: gzip(Profile) bytes. One sample
//! per distinct (stack, labels) within a stall, valued in nanoseconds of
//! stall time (sample type `stall/nanoseconds`), so a profile's total is
//! the stall time it covers. Labels: `stall` (the stall's index in the
//! order given: for a recording, its index in `stalls.json`), `kind`
//! (`on_cpu`, `off_cpu`, `runqueue`, `gil_wait`, `throttled`), `syscall`
//! (off-CPU; for a part `woken` from the loop's park, the park's wait),
//! `tid` and `thread` (name), `task` (the asyncio coroutine's qualified
//! name, `Gateway.handle_request`, when known), `task_name` (the asyncio
//! Task's name, when read), `culprit` (the part's culprit, as the summary
//! names it without the part kind: `parse_resume (app.py:31) → pypdf …
//! PageObject.extract_text`), `culprit_function` (the culprit frame's
//! function alone, `parse_resume`: `-tagfocus culprit_function=parse_resume`
//! as typed), `entry` (the stall's entry point, the handler:
//! `parse_resume (app.py)`), `route` (ASGI: the request's method and route
//! template, `POST /resume/{rid}`, when read), `pid` (the stall's process),
//! `comm`, `process` (with stalls in more than one process: `uvicorn
//! worker 2 (pid 1240)`, [`crate::model::Process::title`]), `container`
//! (daemon). `go tool pprof -tagfocus kind=gil_wait` or `-tags` slices by
//! them.
//!
//! Stacks are shown in the [`View`] of `stalls.folded` and `stalls.svg`
//! (by default the user's code, [`crate::report::view`]; `--native all`
//! every frame), so the three draw the same tree; the process (a root
//! frame there with stalls in several processes) and the `--group-by`
//! root are labels here (`-tagroot process`, `-tagroot task` put them
//! back as frames). Each location keeps its line: pprof merges them by
//! function unless asked (`-lines`). The labels are taken from
//! the whole stacks, as the summary's are; `stalls.json` keeps them whole.
//! Frames are already symbolized: every location carries its function,
//! file and line, and the one mapping says so (`has_functions`), so no
//! tool tries to symbolize again; every function is named, and has no
//! system name, so no tool rewrites its name ([`Builder::location`]).
//!
//! The messages are declared here with prost derive, field numbers from
//! <https://github.com/google/pprof/blob/4bf881d7fb0b/proto/profile.proto>
//! (no protoc at build time).
use std::{
    collections::{BTreeMap, HashMap},
    io::Write,
    path::PathBuf,
};

use flate2::{Compression, write::GzEncoder};

use crate::model::{Frame, FrameKind, Recording, Stall, text::escape};
use crate::{
    classify::AppPaths,
    os::outdir::OutDir,
    report::{
        RenderError, aggregate,
        view::{self, View},
        write_file,
    },
};

#[derive(Clone, PartialEq, prost::Message)]
pub struct Profile {
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    #[prost(int64, tag = "7")]
    pub drop_frames: i64,
    #[prost(int64, tag = "8")]
    pub keep_frames: i64,
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub period: i64,
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Label {
    #[prost(int64, tag = "1")]
    pub key: i64,
    #[prost(int64, tag = "2")]
    pub str: i64,
    #[prost(int64, tag = "3")]
    pub num: i64,
    #[prost(int64, tag = "4")]
    pub num_unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    #[prost(int64, tag = "5")]
    pub filename: i64,
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "3")]
    pub address: u64,
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
    #[prost(bool, tag = "5")]
    pub is_folded: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
    #[prost(int64, tag = "3")]
    pub column: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
    #[prost(int64, tag = "5")]
    pub start_line: i64,
}

/// The process a stall belongs to, as sample labels.
#[derive(Debug, Clone)]
pub struct ProcLabel<'a> {
    pub pid: u32,
    pub comm: &'a str,
    pub container: &'a str,
    /// Its name among several processes (the `process` label), if given.
    pub process: Option<&'a str>,
}

/// A sample's identity: its location ids (leaf first) and its labels as
/// (key, string, number) string-table indices and values.
type SampleKey = (Vec<u64>, Vec<(i64, i64, i64)>);

#[derive(Default)]
struct Builder {
    strings: Vec<String>,
    string_ix: HashMap<String, i64>,
    functions: Vec<Function>,
    function_ix: HashMap<(i64, i64), u64>,
    locations: Vec<Location>,
    location_ix: HashMap<(u64, i64), u64>,
    samples: Vec<Sample>,
    sample_ix: HashMap<SampleKey, usize>,
}

impl Builder {
    fn s(&mut self, text: &str) -> i64 {
        if let Some(&i) = self.string_ix.get(text) {
            return i;
        }
        let i = self.strings.len() as i64;
        self.strings.push(text.to_string());
        self.string_ix.insert(text.to_string(), i);
        i
    }

    /// A frame's location, with its function: named as the frame is
    /// ([`function_name`]), and with no system name. pprof takes a
    /// function whose system name equals its name as not yet demangled and
    /// "simplifies" it when it looks like C++ (any of `<>[]` or `::`):
    /// `removeMatching` drops every `<…>` and `(…)`, so `<module>` became
    /// empty and showed as the mapping's file, `[[stallprof: symbolized]]`,
    /// and `<u64>::wrapping_add` became `::wrapping_add`
    /// (<https://github.com/google/pprof/blob/05db19dad39e/internal/symbolizer/symbolizer.go>,
    /// `Demangle`). The names are final and no mangled name is known: an
    /// empty system name says both, and `-symbolize=demangle=…` then leaves
    /// the name alone too.
    fn location(&mut self, f: &Frame) -> u64 {
        let name = self.s(&function_name(f));
        let file = f.file.as_deref().or(f.module.as_deref()).unwrap_or("");
        let file = self.s(file);
        let fid = match self.function_ix.get(&(name, file)) {
            Some(&id) => id,
            None => {
                let id = self.functions.len() as u64 + 1;
                self.functions.push(Function {
                    id,
                    name,
                    system_name: 0,
                    filename: file,
                    start_line: 0,
                });
                self.function_ix.insert((name, file), id);
                id
            }
        };
        let line = f.line.unwrap_or(0) as i64;
        if let Some(&id) = self.location_ix.get(&(fid, line)) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        self.locations.push(Location {
            id,
            mapping_id: 1,
            address: 0,
            line: vec![Line {
                function_id: fid,
                line,
                column: 0,
            }],
            is_folded: false,
        });
        self.location_ix.insert((fid, line), id);
        id
    }
}

/// A location's function name: the frame's as the view says it (never
/// empty: [`view`] names an unnamed frame by its file or object), a
/// kernel frame's with ` [k]`.
fn function_name(f: &Frame) -> String {
    match f.kind {
        FrameKind::Kernel => format!("{} [k]", f.name),
        _ => f.name.to_string(),
    }
}

/// Build the profile of `stalls` in the default [`View`] (the view of the
/// flamegraph and `stalls.folded` the daemon writes beside it); see
/// [`profile_in`].
pub fn profile<'a>(
    stalls: impl IntoIterator<Item = (ProcLabel<'a>, &'a Stall)>,
    time_nanos: i64,
    duration_nanos: i64,
    app: &AppPaths,
) -> Profile {
    profile_in(View::default(), stalls, time_nanos, duration_nanos, app)
}

/// Build the profile of `stalls`, their stacks in `v`, covering
/// [`time_nanos`, +`duration_nanos`) of wall-clock time; `app` tells the
/// application's frames (the view, the `culprit` and `entry` labels).
pub fn profile_in<'a>(
    v: View,
    stalls: impl IntoIterator<Item = (ProcLabel<'a>, &'a Stall)>,
    time_nanos: i64,
    duration_nanos: i64,
    app: &AppPaths,
) -> Profile {
    let (procs, stalls): (Vec<ProcLabel>, Vec<&Stall>) = stalls.into_iter().unzip();
    // The view keeps every part, in order, with its weight: only frames
    // go. Lines stay in the locations whatever `--lines` says: a function
    // is one `Function` (by name and file) whatever its line, so pprof's
    // default granularity (functions) shows one frame per function, as
    // the other outputs do, and `-lines` shows the lines.
    let shown = view::apply(stalls.iter().copied(), View { lines: true, ..v }, app);
    let mut b = Builder::default();
    b.s("");
    let stall_t = b.s("stall");
    let ns = b.s("nanoseconds");
    let (k_kind, k_syscall, k_pid, k_comm, k_thread, k_container) = (
        b.s("kind"),
        b.s("syscall"),
        b.s("pid"),
        b.s("comm"),
        b.s("thread"),
        b.s("container"),
    );
    let (k_stall, k_tid, k_task) = (b.s("stall"), b.s("tid"), b.s("task"));
    let k_task_name = b.s("task_name");
    let (k_culprit, k_entry, k_route) = (b.s("culprit"), b.s("entry"), b.s("route"));
    let k_culprit_function = b.s("culprit_function");
    for (index, ((p, s), shown)) in procs.iter().zip(&stalls).zip(&shown).enumerate() {
        let entry = aggregate::stall_entry(s, app);
        let task = s.coroutine_name();
        for (part, frames) in s.stacks.iter().zip(shown.stacks.iter().map(|p| &p.frames)) {
            // pprof lists the leaf first; our frames are outermost first.
            let locs: Vec<u64> = frames.iter().rev().map(|f| b.location(f)).collect();
            let mut labels = vec![
                (k_stall, 0, index as i64),
                (k_kind, b.s(part.kind.as_str()), 0),
                (k_pid, 0, p.pid as i64),
                (k_comm, b.s(p.comm), 0),
                (k_tid, 0, s.tid as i64),
                (k_thread, b.s(&s.thread_name), 0),
            ];
            // Interned when first used: a profile without it is as before.
            if let Some(name) = p.process {
                labels.push((b.s("process"), b.s(name), 0));
            }
            if let Some(task) = &task {
                labels.push((k_task, b.s(task), 0));
            }
            if let Some(t) = &s.task {
                labels.push((k_task_name, b.s(&t.name), 0));
            }
            // Pyroscope's span-profile labels: a trace UI's link in.
            if let Some(ids) = s.trace() {
                labels.push((b.s("trace_id"), b.s(&ids.trace_id), 0));
                labels.push((b.s("span_id"), b.s(&ids.span_id), 0));
            }
            if let Some(r) = &s.route {
                labels.push((k_route, b.s(&r.describe()), 0));
            }
            if let Some(crate::model::HeldUp::Read(d)) = &s.held_up {
                // Numeric: `-tagfocus timer_worst_late_ms=100:` keeps the
                // stalls that made a timer run 100 ms late or more.
                labels.push((b.s("timers_delayed"), 0, d.timers_late_ns.len() as i64));
                if let Some(w) = d.worst_late_ns() {
                    labels.push((b.s("timer_worst_late_ms"), 0, (w / 1_000_000) as i64));
                }
            }
            if let Some(sc) = &part.syscall {
                labels.push((k_syscall, b.s(sc), 0));
            }
            let culprit = aggregate::culprit_name(part, app);
            labels.push((k_culprit, b.s(&culprit), 0));
            if let Some(f) = aggregate::culprit(part, app) {
                labels.push((k_culprit_function, b.s(&escape(&f.name)), 0));
            }
            if let Some(e) = &entry {
                labels.push((k_entry, b.s(e), 0));
            }
            if !p.container.is_empty() {
                labels.push((k_container, b.s(p.container), 0));
            }
            let key = (locs, labels);
            match b.sample_ix.get(&key) {
                Some(&i) => b.samples[i].value[0] += part.weight_ns as i64,
                None => {
                    let sample = Sample {
                        location_id: key.0.clone(),
                        value: vec![part.weight_ns as i64],
                        label: key
                            .1
                            .iter()
                            .map(|&(key, str, num)| Label {
                                key,
                                str,
                                num,
                                num_unit: 0,
                            })
                            .collect(),
                    };
                    b.sample_ix.insert(key, b.samples.len());
                    b.samples.push(sample);
                }
            }
        }
    }
    let filename = b.s("[stallprof: symbolized]");
    let comment = b.s(&format!(
        "stallprof {}: stall time of event-loop threads",
        env!("CARGO_PKG_VERSION")
    ));
    Profile {
        sample_type: vec![ValueType {
            r#type: stall_t,
            unit: ns,
        }],
        sample: b.samples,
        mapping: vec![Mapping {
            id: 1,
            memory_start: 0,
            memory_limit: 0,
            file_offset: 0,
            filename,
            build_id: 0,
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
        }],
        location: b.locations,
        function: b.functions,
        string_table: b.strings,
        drop_frames: 0,
        keep_frames: 0,
        time_nanos,
        duration_nanos,
        period_type: Some(ValueType {
            r#type: stall_t,
            unit: ns,
        }),
        period: 1,
        comment: vec![comment],
        default_sample_type: 0,
    }
}

/// gzip(protobuf), the form pprof tooling reads and serves.
pub fn encode_gz(p: &Profile) -> Vec<u8> {
    use prost::Message;
    let raw = p.encode_to_vec();
    let mut gz = GzEncoder::new(
        Vec::with_capacity(raw.len() / 3 + 64),
        Compression::default(),
    );
    gz.write_all(&raw).expect("writing to a Vec cannot fail");
    gz.finish().expect("writing to a Vec cannot fail")
}

/// The profile of a recording in `v`: every stall, labelled with its
/// index in `stalls.json` and its process (`process` only with stalls in
/// several). The recording keeps no wall-clock time, so the profile's
/// `time_nanos` is left unset (pprof then shows none) and its duration is
/// the recording's.
pub fn of_recording(rec: &Recording, v: View) -> Profile {
    let several = rec.stalls_in_several_processes();
    let names: BTreeMap<u32, (&str, Option<String>)> = rec
        .processes
        .iter()
        .map(|p| (p.pid, (p.comm.as_str(), several.then(|| p.title()))))
        .collect();
    let label = |s: &Stall| {
        let (comm, process) = names
            .get(&s.pid)
            .map_or((rec.comm.as_str(), None), |(c, t)| (*c, t.as_deref()));
        ProcLabel {
            pid: s.pid,
            comm,
            container: "",
            process,
        }
    };
    profile_in(
        v,
        rec.stalls.iter().map(|s| (label(s), s)),
        0,
        rec.ended_ns.saturating_sub(rec.started_ns) as i64,
        &rec.app(),
    )
}

/// `stalls.pb.gz` of a recording in `v` ([`of_recording`]).
pub fn write_view(rec: &Recording, dir: &OutDir, v: View) -> Result<PathBuf, RenderError> {
    write_file(dir, "stalls.pb.gz", &encode_gz(&of_recording(rec, v)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{PartKind, StackPart};
    use crate::testing;
    use prost::Message;

    #[test]
    fn round_trip_and_totals() {
        let part = |names: &[&str], kind, ns| StackPart {
            woken: false,
            frames: names
                .iter()
                .map(|n| Frame::new(*n, FrameKind::Native))
                .collect(),
            weight_ns: ns,
            kind,
            syscall: (kind == PartKind::OffCpu).then(|| "read".into()),
            waker_tid: None,
            gil_holder: None,
        };
        let s = Stall {
            tid: 7,
            thread_name: "loop".into(),
            coroutine: Some("handle".into()),
            task: Some(crate::model::Task {
                name: "conn-7".into(),
                coro: Some("handle".into()),
                awaited_by: vec![],
                trace: Some(crate::model::SpanIds::new(0x2a59 << 64 | 7, 0x86ab)),
                ..Default::default()
            }),
            ..testing::stall(
                0,
                vec![
                    part(&["main", "spin"], PartKind::OnCpu, 40),
                    part(&["main", "spin"], PartKind::OnCpu, 20),
                    part(&["main", "read"], PartKind::OffCpu, 30),
                ],
            )
        };
        // A plain callback's stall: no task, the thread's context's span.
        let second = Stall {
            tid: 8,
            coroutine: None,
            task: None,
            thread_context: Some(crate::model::ContextTrace {
                trace: Some(crate::model::SpanIds::new(0xbeef, 0x12)),
                trace_unreadable: None,
            }),
            ..s.clone()
        };
        let proc = ProcLabel {
            pid: 1,
            comm: "c",
            container: "",
            process: None,
        };
        let p = profile(
            [(proc.clone(), &s), (proc, &second)],
            0,
            1,
            &AppPaths::default(),
        );
        assert_eq!(p.string_table[0], "");
        assert_eq!(
            p.sample.len(),
            4,
            "identical stacks merge within a stall, not across stalls"
        );
        assert_eq!(p.sample.iter().map(|s| s.value[0]).sum::<i64>(), 180);
        let label = |s: &Sample, key: &str| {
            s.label
                .iter()
                .find(|l| p.string_table[l.key as usize] == key)
                .map(|l| (p.string_table[l.str as usize].clone(), l.num))
        };
        let first = &p.sample[0];
        assert_eq!(label(first, "stall"), Some((String::new(), 0)));
        assert_eq!(label(first, "tid"), Some((String::new(), 7)));
        assert_eq!(label(first, "thread"), Some(("loop".into(), 0)));
        assert_eq!(label(first, "kind"), Some(("on_cpu".into(), 0)));
        assert_eq!(label(first, "task"), Some(("handle".into(), 0)));
        assert_eq!(label(first, "task_name"), Some(("conn-7".into(), 0)));
        assert_eq!(
            label(first, "trace_id"),
            Some(("0000000000002a590000000000000007".into(), 0))
        );
        assert_eq!(
            label(first, "span_id"),
            Some(("00000000000086ab".into(), 0))
        );
        assert_eq!(label(&p.sample[1], "syscall"), Some(("read".into(), 0)));
        let last = &p.sample[3];
        assert_eq!(label(last, "stall"), Some((String::new(), 1)));
        assert_eq!(label(last, "task"), None, "no coroutine, no task label");
        assert_eq!(
            label(last, "task_name"),
            None,
            "no task, no task_name label"
        );
        assert_eq!(
            label(last, "span_id"),
            Some(("0000000000000012".into(), 0)),
            "no task: the thread's context's span"
        );
        let leaf = p.sample[0].location_id[0];
        let loc = &p.location[leaf as usize - 1];
        let f = &p.function[loc.line[0].function_id as usize - 1];
        assert_eq!(p.string_table[f.name as usize], "spin");
        let bytes = p.encode_to_vec();
        assert_eq!(Profile::decode(bytes.as_slice()).unwrap(), p);
    }

    /// `encode_gz`'s bytes read back, as a reader gets them.
    fn decoded(p: &Profile) -> Profile {
        use std::io::Read;
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(encode_gz(p).as_slice())
            .read_to_end(&mut raw)
            .unwrap();
        Profile::decode(raw.as_slice()).unwrap()
    }

    /// A sample's label `key`, as (string, number).
    fn label(p: &Profile, s: &Sample, key: &str) -> Option<(String, i64)> {
        s.label
            .iter()
            .find(|l| p.string_table[l.key as usize] == key)
            .map(|l| (p.string_table[l.str as usize].clone(), l.num))
    }

    /// A sample's functions (name, line), outermost first.
    fn stack(p: &Profile, s: &Sample) -> Vec<(String, i64)> {
        s.location_id
            .iter()
            .rev()
            .map(|&id| {
                let line = &p.location[id as usize - 1].line[0];
                let f = &p.function[line.function_id as usize - 1];
                (p.string_table[f.name as usize].clone(), line.line)
            })
            .collect()
    }

    fn native(name: &str, module: &str) -> Frame {
        Frame {
            module: Some(module.into()),
            ..Frame::new(name, FrameKind::Native)
        }
    }

    fn py(name: &str, line: u32) -> Frame {
        Frame {
            file: Some("/app/gateway.py".into()),
            line: Some(line),
            ..Frame::new(name, FrameKind::Python)
        }
    }

    /// The demo gateway's stall as recorded: `_start` … `<module>` → `main`
    /// → the loop → asyncio's C task step → `Gateway.handle_request` →
    /// `tail`, `Gateway.handle_request`'s line differing between parts.
    fn gateway_stall(tail: &[&[Frame]]) -> Stall {
        let root = |handler_line| {
            vec![
                native("_start", "python3.11"),
                native("__libc_start_main_impl", "libc.so.6"),
                native("Py_BytesMain", "python3.11"),
                native("PyEval_EvalCode", "python3.11"),
                py("<module>", 227),
                py("main", 220),
                Frame {
                    file: Some("/usr/lib/python3.11/asyncio/events.py".into()),
                    ..py("Handle._run", 80)
                },
                native("context_run", "python3.11"),
                native("task_step", "_asyncio.cpython-311-x86_64-linux-gnu.so"),
                native("task_step_impl", "_asyncio.cpython-311-x86_64-linux-gnu.so"),
                py("Gateway.handle_request", handler_line),
            ]
        };
        let parts = tail
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut frames = root(144 + i as u32);
                frames.extend(t.iter().cloned());
                testing::part(PartKind::OnCpu, 10 + i as u64, frames)
            })
            .collect();
        Stall {
            coroutine: Some("Gateway.handle_request (gateway.py:144)".into()),
            task: Some(crate::model::Task {
                name: "Task-13".into(),
                coro: Some("Gateway.handle_request".into()),
                awaited_by: vec![],
                ..Default::default()
            }),
            ..testing::stall(0, parts)
        }
    }

    fn gateway() -> Recording {
        let mut rec = testing::two_workers();
        let json = native("loads", "python3.11");
        rec.stalls = vec![gateway_stall(&[
            &[py("load_tokenizer", 72), json.clone()],
            &[
                py("load_tokenizer", 72),
                Frame {
                    file: Some("/usr/lib/python3.11/json/decoder.py".into()),
                    ..py("JSONDecoder.decode", 337)
                },
            ],
            &[
                py("compress_payload", 76),
                native("zlib_compress", "zlib.cpython-311-x86_64-linux-gnu.so"),
                Frame::new("do_syscall_64", FrameKind::Kernel),
            ],
        ])];
        rec
    }

    /// Issue 37: pprof showed `<module>` as `[[stallprof: symbolized]]`:
    /// its demangling heuristic emptied the name (see
    /// [`Builder::location`]). Every function has its name and no system
    /// name; a frame without a name is named by its file (by the view,
    /// in every view).
    #[test]
    fn every_function_is_named_and_keeps_its_name_issue_37() {
        let mut rec = gateway();
        rec.stalls[0].stacks[0].frames.push(Frame {
            file: Some("/app/gateway.py".into()),
            ..Frame::new("", FrameKind::Python)
        });
        let p = decoded(&of_recording(&rec, View::ALL));
        let names: Vec<&str> = p
            .function
            .iter()
            .map(|f| p.string_table[f.name as usize].as_str())
            .collect();
        assert!(names.iter().all(|n| !n.is_empty()), "{names:?}");
        assert!(p.function.iter().all(|f| f.system_name == 0));
        for want in ["<module>", "[gateway.py]", "do_syscall_64 [k]"] {
            assert!(names.contains(&want), "{want} not in {names:?}");
        }
    }

    /// Issue 37: `culprit_function` is the culprit's function as typed
    /// (`-tagfocus culprit_function=load_tokenizer`), beside `culprit`; the
    /// `task` label is the coroutine's name, not the line the stall's
    /// first stack was at (144, while a sample's stack says 145).
    #[test]
    fn culprit_function_and_task_are_plain_names_issue_37() {
        let p = decoded(&of_recording(&gateway(), View::default()));
        let got: Vec<(String, String, String)> = p
            .sample
            .iter()
            .map(|s| {
                (
                    label(&p, s, "culprit_function").unwrap().0,
                    label(&p, s, "culprit").unwrap().0,
                    label(&p, s, "task").unwrap().0,
                )
            })
            .collect();
        let task = || "Gateway.handle_request".to_string();
        assert_eq!(
            got,
            [
                (
                    "load_tokenizer".into(),
                    "load_tokenizer (gateway.py:72) → loads".into(),
                    task()
                ),
                (
                    "load_tokenizer".into(),
                    "load_tokenizer (gateway.py:72) → json … JSONDecoder.decode".into(),
                    task()
                ),
                (
                    "compress_payload".into(),
                    "compress_payload (gateway.py:76) → zlib … zlib_compress".into(),
                    task()
                ),
            ]
        );
        assert_eq!(
            label(&p, &p.sample[0], "task_name"),
            Some(("Task-13".into(), 0))
        );
    }

    /// Issue 37: pprof kept the `_start … task_step` prefix the SVG trims.
    /// Each sample's stack is its part's stack in `stalls.folded`'s view,
    /// by function (a location keeps its line: pprof merges lines by
    /// function); `--native all` keeps every frame; the labels come from
    /// the whole stack either way.
    #[test]
    fn samples_have_the_folded_views_stacks_issue_37() {
        let rec = gateway();
        for v in [View::default(), View::ALL] {
            let p = decoded(&of_recording(&rec, v));
            let shown = view::shown(&rec, v);
            let want: Vec<Vec<String>> = shown[0]
                .stacks
                .iter()
                .map(|part| part.frames.iter().map(function_name).collect())
                .collect();
            let got: Vec<Vec<String>> = p
                .sample
                .iter()
                .map(|s| stack(&p, s).into_iter().map(|f| f.0).collect())
                .collect();
            assert_eq!(got, want, "{v:?}");
            let culprits: Vec<String> = p
                .sample
                .iter()
                .map(|s| label(&p, s, "culprit_function").unwrap().0)
                .collect();
            assert_eq!(
                culprits,
                ["load_tokenizer", "load_tokenizer", "compress_payload"]
            );
        }
        let p = decoded(&of_recording(&rec, View::default()));
        let first: Vec<(String, i64)> = stack(&p, &p.sample[0]);
        assert_eq!(
            first,
            [
                ("Gateway.handle_request".to_string(), 144),
                ("load_tokenizer".to_string(), 72),
                ("loads".to_string(), 0)
            ]
        );
        // Lines 144, 145, 146 of one function: one function.
        let handle: Vec<&Function> = p
            .function
            .iter()
            .filter(|f| p.string_table[f.name as usize] == "Gateway.handle_request")
            .collect();
        assert_eq!(handle.len(), 1);
        let p = decoded(&of_recording(&rec, View::ALL));
        assert_eq!(stack(&p, &p.sample[0])[0].0, "_start");
    }

    /// Issue 37: one stall, the same frames in every output: the
    /// flamegraph's and `stalls.folded`'s stacks (one view), the speedscope
    /// file's stacks under the stall's frame, and pprof's samples, in the
    /// default view, with `--lines` and with `--native all`.
    #[test]
    fn every_output_shows_a_stall_with_the_same_frames_issue_37() {
        use std::collections::BTreeSet;
        let mut rec = gateway();
        // A Rust extension's generic name, shortened alike everywhere.
        rec.stalls[0].stacks[2].frames.push(native(
            "tokenizers::tokenizer::TokenizerImpl<M,N,PT,PP,D>::encode_batch",
            "tokenizers.abi3.so",
        ));
        let lines = View {
            lines: true,
            ..View::default()
        };
        for v in [View::default(), lines, View::ALL] {
            let folded: BTreeSet<String> = aggregate::folded_lines(&view::shown(&rec, v))
                .into_iter()
                .map(|l| l.rsplit_once(' ').unwrap().0.to_string())
                .collect();
            let svg =
                String::from_utf8(crate::report::flamegraph::render(&rec, v).unwrap()).unwrap();
            for stack in &folded {
                for frame in stack.split(';') {
                    let drawn = frame
                        .replace('&', "&amp;")
                        .replace('<', "&lt;")
                        .replace('>', "&gt;");
                    assert!(svg.contains(&drawn), "{frame} not in the SVG ({v:?})");
                }
            }
            // speedscope: each stack closed at its leaf, under the stall's frame.
            let f = serde_json::to_value(crate::report::speedscope::file(&rec, v)).unwrap();
            let names = f["shared"]["frames"].as_array().unwrap();
            let (mut open, mut leaves, mut last_open) = (Vec::new(), BTreeSet::new(), false);
            for e in f["profiles"][0]["events"].as_array().unwrap() {
                let name = names[e["frame"].as_u64().unwrap() as usize]["name"]
                    .as_str()
                    .unwrap()
                    .to_string();
                if e["type"] == "O" {
                    open.push(name);
                    last_open = true;
                } else {
                    if last_open {
                        leaves.insert(open[1..].join(";"));
                    }
                    open.pop();
                    last_open = false;
                }
            }
            assert_eq!(leaves, folded, "speedscope ({v:?})");
            // pprof: the same functions (its names carry no file).
            let p = decoded(&of_recording(&rec, v));
            let shown: BTreeSet<Vec<String>> = view::shown(&rec, v)
                .iter()
                .flat_map(|s| &s.stacks)
                .map(|part| part.frames.iter().map(function_name).collect())
                .collect();
            let samples: BTreeSet<Vec<String>> = p
                .sample
                .iter()
                .map(|s| stack(&p, s).into_iter().map(|f| f.0).collect())
                .collect();
            assert_eq!(samples, shown, "pprof ({v:?})");
        }
        let folded = aggregate::folded_lines(&view::shown(&rec, View::default())).join("\n");
        assert!(
            folded.contains(
                "Gateway.handle_request (gateway.py);compress_payload (gateway.py);zlib_compress;do_syscall_64;tokenizers::tokenizer::TokenizerImpl<…>::encode_batch"
            ),
            "{folded}"
        );
    }

    /// A recording's profile: each sample labelled with its stall's pid,
    /// and, with stalls in several processes, the process by role.
    #[test]
    fn samples_say_their_process() {
        let rec = crate::testing::two_workers();
        let p = of_recording(&rec, View::default());
        let label = |s: &Sample, key: &str| {
            s.label
                .iter()
                .find(|l| p.string_table[l.key as usize] == key)
                .map(|l| (p.string_table[l.str as usize].clone(), l.num))
        };
        let got: Vec<(i64, String, String)> = p
            .sample
            .iter()
            .map(|s| {
                (
                    label(s, "pid").unwrap().1,
                    label(s, "comm").unwrap().0,
                    label(s, "process").unwrap().0,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    1210,
                    "python3.12".into(),
                    "uvicorn worker 1 (pid 1210)".into()
                ),
                (
                    1220,
                    "python3.12".into(),
                    "uvicorn worker 2 (pid 1220)".into()
                ),
                (
                    1220,
                    "python3.12".into(),
                    "uvicorn worker 2 (pid 1220)".into()
                ),
            ]
        );
        // One process: no `process` label, not even its name in the table.
        let mut one = rec.clone();
        one.stalls.retain(|s| s.pid == 1220);
        let p = of_recording(&one, View::default());
        assert!(!p.string_table.iter().any(|s| s == "process"));
        assert!(
            p.sample
                .iter()
                .all(|s| label(s, "pid") == Some((String::new(), 1220)))
        );
    }
}
