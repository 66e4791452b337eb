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
//! `tid` and `thread` (name), `task` (the asyncio coroutine, when known),
//! `task_name` (the asyncio Task's name, when read), `culprit` (the
//! part's culprit, as the summary names it without the part kind:
//! `parse_resume (app.py:31) → pypdf … PageObject.extract_text`), `entry`
//! (the stall's entry point, the handler: `parse_resume (app.py)`), `route`
//! (ASGI: the request's method and route template, `POST /resume/{rid}`,
//! when read), `pid` (the stall's process), `comm`, `process` (with stalls
//! in more than one process: `uvicorn worker 2 (pid 1240)`,
//! [`crate::model::Process::title`]), `container` (daemon). `go tool pprof -tagfocus
//! kind=gil_wait` or `-tags` slices by them. Frames are already
//! symbolized: every location carries its function, file and line, and the
//! one mapping says so (`has_functions`), so no tool tries to symbolize again.
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

use crate::model::{Frame, FrameKind, Recording, Stall};
use crate::{
    classify::AppPaths,
    os::outdir::OutDir,
    report::{RenderError, aggregate, write_file},
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

    fn location(&mut self, f: &Frame) -> u64 {
        let name = match f.kind {
            FrameKind::Kernel => format!("{} [k]", f.name),
            _ => f.name.to_string(),
        };
        let name = self.s(&name);
        let file = f.file.as_deref().or(f.module.as_deref()).unwrap_or("");
        let file = self.s(file);
        let fid = match self.function_ix.get(&(name, file)) {
            Some(&id) => id,
            None => {
                let id = self.functions.len() as u64 + 1;
                let system_name = name;
                self.functions.push(Function {
                    id,
                    name,
                    system_name,
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

/// Build the profile of `stalls`, covering [`time_nanos`, +`duration_nanos`)
/// of wall-clock time; `app` tells the application's frames (the
/// `culprit` and `entry` labels).
pub fn profile<'a>(
    stalls: impl IntoIterator<Item = (ProcLabel<'a>, &'a Stall)>,
    time_nanos: i64,
    duration_nanos: i64,
    app: &AppPaths,
) -> Profile {
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
    for (index, (p, s)) in stalls.into_iter().enumerate() {
        let entry = aggregate::stall_entry(s, app);
        for part in &s.stacks {
            // pprof lists the leaf first; our frames are outermost first.
            let locs: Vec<u64> = part.frames.iter().rev().map(|f| b.location(f)).collect();
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
            if let Some(task) = &s.coroutine {
                labels.push((k_task, b.s(task), 0));
            }
            if let Some(t) = &s.task {
                labels.push((k_task_name, b.s(&t.name), 0));
            }
            if let Some(r) = &s.route {
                labels.push((k_route, b.s(&r.describe()), 0));
            }
            if let Some(sc) = &part.syscall {
                labels.push((k_syscall, b.s(sc), 0));
            }
            let culprit = aggregate::culprit_name(part, app);
            labels.push((k_culprit, b.s(&culprit), 0));
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

/// The profile of a recording: every stall, labelled with its index in
/// `stalls.json` and its process (`process` only with stalls in several).
/// The recording keeps no wall-clock time, so the profile's `time_nanos`
/// is left unset (pprof then shows none) and its duration is the
/// recording's.
pub fn of_recording(rec: &Recording) -> Profile {
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
    profile(
        rec.stalls.iter().map(|s| (label(s), s)),
        0,
        rec.ended_ns.saturating_sub(rec.started_ns) as i64,
        &rec.app(),
    )
}

/// `stalls.pb.gz` of a recording ([`of_recording`]).
pub fn write(rec: &Recording, dir: &OutDir) -> Result<PathBuf, RenderError> {
    write_file(dir, "stalls.pb.gz", &encode_gz(&of_recording(rec)))
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
        let second = Stall {
            tid: 8,
            coroutine: None,
            task: None,
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
        assert_eq!(label(&p.sample[1], "syscall"), Some(("read".into(), 0)));
        let last = &p.sample[3];
        assert_eq!(label(last, "stall"), Some((String::new(), 1)));
        assert_eq!(label(last, "task"), None, "no coroutine, no task label");
        assert_eq!(
            label(last, "task_name"),
            None,
            "no task, no task_name label"
        );
        let leaf = p.sample[0].location_id[0];
        let loc = &p.location[leaf as usize - 1];
        let f = &p.function[loc.line[0].function_id as usize - 1];
        assert_eq!(p.string_table[f.name as usize], "spin");
        let bytes = p.encode_to_vec();
        assert_eq!(Profile::decode(bytes.as_slice()).unwrap(), p);
    }

    /// A recording's profile: each sample labelled with its stall's pid,
    /// and, with stalls in several processes, the process by role.
    #[test]
    fn samples_say_their_process() {
        let rec = crate::testing::two_workers();
        let p = of_recording(&rec);
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
        let p = of_recording(&one);
        assert!(!p.string_table.iter().any(|s| s == "process"));
        assert!(
            p.sample
                .iter()
                .all(|s| label(s, "pid") == Some((String::new(), 1220)))
        );
    }
}
