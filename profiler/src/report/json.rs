//! `stalls.json`: the recording on disk, compact and versioned
//! (docs/format.md is the schema).
//!
//! In: a [`Recording`] (write) or the bytes of a `stalls.json` (read). Out:
//! the other. The file interns what repeats: a frame table (each distinct
//! frame once), a stack table (each distinct stack once, as frame ids,
//! outermost first), and per stall its parts, each naming a stack id. The
//! in-memory model keeps whole frames; only the file is compact.
//!
//! Versions: `format: "stallprof-recording"`, `version: 4` is written.
//! Read: version 4 (a stall's `held_up`, added within it, is optional);
//! version 3 — the same without a stall's `pid` (read as
//! the recording's) and the `processes` list (read as the target alone);
//! version 2 — the same layout without the `throttled`
//! part kind, `throttled_ns`, `cpu_holders`, a part's `woken` and the
//! recording's `cpu_quota` (read as none of them); and version 1 — the
//! layout before it, with no `format` field and whole frames in every part
//! (the model's own serde shape). A newer version is refused by name. The wire types below are a contract of
//! their own, not the model: a change to the model does not silently change
//! the file.
use std::{
    collections::{BTreeMap, HashMap},
    io::{self, Write},
};

use serde::{Deserialize, Serialize};
use serde_json::ser::Formatter;
use thiserror::Error;

use crate::model::{
    Container, ContextTrace, CpuHolder, CpuQuota, Frame, GilHolder, HeldUp, HolderRelation,
    PartKind, ProbeSet, Process, ProcessInfo, Recording, Role, Route, RuntimeProblem, StackPart,
    Stall, Task, ThreadInfo,
};
use crate::report::aggregate;

/// The `format` field of every stallprof recording from version 2 on.
pub const FORMAT: &str = "stallprof-recording";
/// The version written; readers take this one and every older one.
pub const VERSION: u64 = 4;

#[derive(Debug, Error)]
pub enum FormatError {
    #[error(
        "it is format version {found}, newer than this stallprof reads (1 to {VERSION}); \
         read it with the stallprof that wrote it or a newer one"
    )]
    NewerVersion { found: u64 },
    #[error("its format is {found:?}, not {FORMAT:?}: give a stalls.json written by stallprof")]
    NotStallprof { found: String },
    #[error("it has format {FORMAT:?} but no version field; the file is damaged, record again")]
    NoVersion,
    #[error(
        "{what} id {id} is out of range ({len} in its table); the file is damaged, record again"
    )]
    BadId {
        what: &'static str,
        id: u32,
        len: usize,
    },
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// Versions 2 to 4 as they are on disk.
#[derive(Serialize, Deserialize)]
struct File {
    format: String,
    version: u64,
    pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ns_pid: Option<u32>,
    comm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    container: Option<Container>,
    threshold_ns: u64,
    sample_hz: u64,
    #[serde(default)]
    sample_after_ns: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    kernel_filtered: BTreeMap<String, u64>,
    #[serde(default)]
    busy_periods: u64,
    clock: String,
    started_ns: u64,
    ended_ns: u64,
    lost_events: u64,
    #[serde(default)]
    drops: BTreeMap<String, u64>,
    #[serde(default)]
    executor_threads: Vec<ThreadInfo>,
    #[serde(default)]
    stallprof_version: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    runtime_problems: Vec<RuntimeProblem>,
    #[serde(default)]
    probes: ProbeSet,
    /// Version 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cpu_quota: Option<CpuQuota>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    app_paths: Vec<String>,
    /// Version 4: the target first, then every other process watched or
    /// with stalls, by pid.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    processes: Vec<WireProcess>,
    /// Each distinct frame once; a frame's id is its index.
    frames: Vec<Frame>,
    /// Each distinct stack once, as frame ids, outermost first; a stack's
    /// id is its index.
    stacks: Vec<Vec<u32>>,
    stalls: Vec<WireStall>,
}

/// A process of the recording as on disk.
#[derive(Serialize, Deserialize)]
struct WireProcess {
    pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ns_pid: Option<u32>,
    comm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    parent: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    role: Option<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    container: Option<Container>,
    /// The service name its OpenTelemetry SDK reports, from its environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    service: Option<String>,
    /// Its stalls in this file, for readers; not read back (the stalls
    /// say it).
    #[serde(default)]
    stalls: usize,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct WireStall {
    /// Version 4: the host pid of its process.
    #[serde(default)]
    pid: u32,
    tid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ns_tid: Option<u32>,
    thread_name: String,
    start_ns: u64,
    end_ns: u64,
    duration_ns: u64,
    on_cpu_ns: u64,
    off_cpu_ns: u64,
    runqueue_ns: u64,
    /// Version 3.
    #[serde(default)]
    throttled_ns: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    cpu_holders: Vec<WireCpuHolder>,
    #[serde(default)]
    incomplete: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    coroutine: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    task: Option<Task>,
    /// Added within version 4 (optional): with no task, the span of the
    /// thread's own context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    thread_context: Option<ContextTrace>,
    /// ASGI: the request's method and route template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    route: Option<Route>,
    /// Added within version 4 (optional: an older reader ignores it and
    /// says nothing false): what the stall held up (its loop's late timers
    /// and queued callbacks), or why that was not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    held_up: Option<HeldUp>,
    /// Derived from the parts for readers of the file
    /// ([`crate::report::aggregate::stall_entry`]); not read back: a
    /// re-render derives it again with its own `--app-path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    entry: Option<String>,
    parts: Vec<WirePart>,
}

#[derive(Serialize, Deserialize)]
struct WirePart {
    stack: u32,
    weight_ns: u64,
    kind: PartKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    syscall: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    waker_tid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gil_holder: Option<WireHolder>,
    /// Version 3.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    woken: bool,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct WireCpuHolder {
    pid: u32,
    tgid: u32,
    comm: String,
    ns: u64,
    relation: HolderRelation,
}

#[derive(Serialize, Deserialize)]
struct WireHolder {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ns_tid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    thread_name: Option<String>,
    /// The holder's Python frames, as a stack id.
    stack: u32,
}

/// Interns frames and stacks in order of first use, so the same recording
/// always gives the same file.
#[derive(Default)]
struct Tables<'a> {
    frames: Vec<&'a Frame>,
    frame_ids: HashMap<&'a Frame, u32>,
    stacks: Vec<Vec<u32>>,
    stack_ids: HashMap<Vec<u32>, u32>,
}

impl<'a> Tables<'a> {
    fn stack(&mut self, frames: &'a [Frame]) -> u32 {
        let ids: Vec<u32> = frames
            .iter()
            .map(|f| {
                *self.frame_ids.entry(f).or_insert_with(|| {
                    self.frames.push(f);
                    (self.frames.len() - 1) as u32
                })
            })
            .collect();
        if let Some(&id) = self.stack_ids.get(&ids) {
            return id;
        }
        let id = self.stacks.len() as u32;
        self.stacks.push(ids.clone());
        self.stack_ids.insert(ids, id);
        id
    }
}

/// A stall as on disk, its stacks interned by `stack` (also the journal's,
/// [`crate::report::journal`]).
/// `entry`: the stall's entry point, when the writer derives it.
pub(crate) fn wire_stall<'a>(
    s: &'a Stall,
    entry: Option<String>,
    mut stack: impl FnMut(&'a [Frame]) -> u32,
) -> WireStall {
    WireStall {
        pid: s.pid,
        tid: s.tid,
        ns_tid: s.ns_tid,
        thread_name: s.thread_name.clone(),
        start_ns: s.start_ns,
        end_ns: s.end_ns,
        duration_ns: s.duration_ns,
        on_cpu_ns: s.on_cpu_ns,
        off_cpu_ns: s.off_cpu_ns,
        runqueue_ns: s.runqueue_ns,
        throttled_ns: s.throttled_ns,
        cpu_holders: s
            .cpu_holders
            .iter()
            .map(|h| WireCpuHolder {
                pid: h.pid,
                tgid: h.tgid,
                comm: h.comm.clone(),
                ns: h.ns,
                relation: h.relation,
            })
            .collect(),
        incomplete: s.incomplete,
        coroutine: s.coroutine.clone(),
        task: s.task.clone(),
        thread_context: s.thread_context.clone(),
        route: s.route.clone(),
        held_up: s.held_up.clone(),
        entry,
        parts: s
            .stacks
            .iter()
            .map(|p| WirePart {
                stack: stack(&p.frames),
                weight_ns: p.weight_ns,
                kind: p.kind,
                syscall: p.syscall.clone(),
                waker_tid: p.waker_tid,
                gil_holder: p.gil_holder.as_ref().map(|h| WireHolder {
                    tid: h.tid,
                    ns_tid: h.ns_tid,
                    thread_name: h.thread_name.clone(),
                    stack: stack(&h.frames),
                }),
                woken: p.woken,
            })
            .collect(),
    }
}

fn to_file(rec: &Recording) -> File {
    let mut t = Tables::default();
    let app = rec.app();
    let stalls = rec
        .stalls
        .iter()
        .map(|s| wire_stall(s, aggregate::stall_entry(s, &app), |f| t.stack(f)))
        .collect();
    File {
        format: FORMAT.into(),
        version: VERSION,
        pid: rec.pid,
        ns_pid: rec.process.ns_pid,
        comm: rec.comm.clone(),
        container: rec.process.container.clone(),
        threshold_ns: rec.threshold_ns,
        sample_hz: rec.sample_hz,
        sample_after_ns: rec.sample_after_ns,
        kernel_filtered: rec.kernel_filtered.clone(),
        busy_periods: rec.busy_periods,
        clock: rec.clock.clone(),
        started_ns: rec.started_ns,
        ended_ns: rec.ended_ns,
        lost_events: rec.lost_events,
        drops: rec.drops.clone(),
        executor_threads: rec.executor_threads.clone(),
        stallprof_version: rec.stallprof_version.clone(),
        runtime_problems: rec.runtime_problems.clone(),
        probes: rec.probes.clone(),
        cpu_quota: rec.cpu_quota.clone(),
        app_paths: rec.app_paths.clone(),
        processes: rec
            .processes
            .iter()
            .map(|p| WireProcess {
                pid: p.pid,
                ns_pid: p.info.ns_pid,
                comm: p.comm.clone(),
                parent: p.parent,
                role: p.role.clone(),
                container: p.info.container.clone(),
                service: p.service.clone(),
                stalls: rec.stalls.iter().filter(|s| s.pid == p.pid).count(),
            })
            .collect(),
        frames: t.frames.into_iter().cloned().collect(),
        stacks: t.stacks,
        stalls,
    }
}

fn from_file(f: File) -> Result<Recording, FormatError> {
    let frames = f.frames;
    let stacks: Vec<Vec<Frame>> = f
        .stacks
        .iter()
        .map(|ids| {
            ids.iter()
                .map(|&id| {
                    frames.get(id as usize).cloned().ok_or(FormatError::BadId {
                        what: "frame",
                        id,
                        len: frames.len(),
                    })
                })
                .collect()
        })
        .collect::<Result<_, _>>()?;
    let stack = |id: u32| {
        stacks.get(id as usize).cloned().ok_or(FormatError::BadId {
            what: "stack",
            id,
            len: stacks.len(),
        })
    };
    let stalls = f
        .stalls
        .into_iter()
        .map(|s| model_stall(s, stack))
        .collect::<Result<_, FormatError>>()?;
    Ok(Recording {
        pid: f.pid,
        comm: f.comm,
        process: ProcessInfo {
            ns_pid: f.ns_pid,
            container: f.container,
        },
        threshold_ns: f.threshold_ns,
        sample_hz: f.sample_hz,
        sample_after_ns: f.sample_after_ns,
        kernel_filtered: f.kernel_filtered,
        busy_periods: f.busy_periods,
        clock: f.clock,
        started_ns: f.started_ns,
        ended_ns: f.ended_ns,
        lost_events: f.lost_events,
        drops: f.drops,
        executor_threads: f.executor_threads,
        stallprof_version: f.stallprof_version,
        runtime_problems: f.runtime_problems,
        probes: f.probes,
        cpu_quota: f.cpu_quota,
        app_paths: f.app_paths,
        processes: f
            .processes
            .into_iter()
            .map(|p| Process {
                pid: p.pid,
                comm: p.comm,
                info: ProcessInfo {
                    ns_pid: p.ns_pid,
                    container: p.container,
                },
                parent: p.parent,
                role: p.role,
                service: p.service,
            })
            .collect(),
        stalls,
    }
    .completed())
}

/// A stall read from disk, its stack ids resolved by `stack`.
pub(crate) fn model_stall(
    s: WireStall,
    stack: impl Fn(u32) -> Result<Vec<Frame>, FormatError>,
) -> Result<Stall, FormatError> {
    Ok(Stall {
        pid: s.pid,
        tid: s.tid,
        thread_name: s.thread_name,
        ns_tid: s.ns_tid,
        start_ns: s.start_ns,
        end_ns: s.end_ns,
        duration_ns: s.duration_ns,
        on_cpu_ns: s.on_cpu_ns,
        off_cpu_ns: s.off_cpu_ns,
        runqueue_ns: s.runqueue_ns,
        throttled_ns: s.throttled_ns,
        cpu_holders: s
            .cpu_holders
            .into_iter()
            .map(|h| CpuHolder {
                pid: h.pid,
                tgid: h.tgid,
                comm: h.comm,
                ns: h.ns,
                relation: h.relation,
            })
            .collect(),
        incomplete: s.incomplete,
        coroutine: s.coroutine,
        task: s.task,
        thread_context: s.thread_context,
        route: s.route,
        held_up: s.held_up,
        stacks: s
            .parts
            .into_iter()
            .map(|p| {
                Ok(StackPart {
                    frames: stack(p.stack)?,
                    weight_ns: p.weight_ns,
                    kind: p.kind,
                    syscall: p.syscall,
                    waker_tid: p.waker_tid,
                    woken: p.woken,
                    gil_holder: match p.gil_holder {
                        Some(h) => Some(GilHolder {
                            tid: h.tid,
                            thread_name: h.thread_name,
                            ns_tid: h.ns_tid,
                            frames: stack(h.stack)?,
                        }),
                        None => None,
                    },
                })
            })
            .collect::<Result<_, FormatError>>()?,
    })
}

/// Compact JSON with one table row per line: every top-level field, frame,
/// stack and stall starts a line, so the file stays readable with `less`
/// and `grep` and diffs line by line, for ~1% over no whitespace at all.
struct Rows {
    depth: usize,
}

impl Formatter for Rows {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.depth += 1;
        w.write_all(b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.depth -= 1;
        w.write_all(b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(b",")?;
        }
        if self.depth == 2 {
            w.write_all(b"\n")?;
        }
        Ok(())
    }

    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.depth += 1;
        w.write_all(b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.depth -= 1;
        if self.depth == 0 {
            w.write_all(b"\n}\n")
        } else {
            w.write_all(b"}")
        }
    }

    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(b",")?;
        }
        if self.depth == 1 {
            w.write_all(b"\n")?;
        }
        Ok(())
    }
}

/// Write `rec` as the current version.
pub fn write(rec: &Recording, w: &mut dyn Write) -> io::Result<()> {
    let file = to_file(rec);
    let mut ser = serde_json::Serializer::with_formatter(w, Rows { depth: 0 });
    file.serialize(&mut ser).map_err(io::Error::other)
}

/// The current version as bytes.
pub fn to_vec(rec: &Recording) -> Vec<u8> {
    let mut out = Vec::new();
    write(rec, &mut out).expect("writing to a Vec cannot fail");
    out
}

/// Just the fields that tell the versions apart (the rest is skipped).
#[derive(Deserialize)]
struct Probe {
    #[serde(default)]
    format: Option<String>,
    #[serde(default)]
    version: Option<u64>,
}

/// Read any version this stallprof knows.
pub fn from_slice(bytes: &[u8]) -> Result<Recording, FormatError> {
    let probe: Probe = serde_json::from_slice(bytes)?;
    match (probe.format, probe.version) {
        // Version 1 had no format field: the model's own serde shape.
        (None, _) => Ok(serde_json::from_slice::<Recording>(bytes)?.completed()),
        (Some(f), _) if f != FORMAT => Err(FormatError::NotStallprof { found: f }),
        (Some(_), None) => Err(FormatError::NoVersion),
        (Some(_), Some(v)) if v > VERSION => Err(FormatError::NewerVersion { found: v }),
        // Versions 2..=VERSION: 3 and 4 only added fields (read as absent).
        (Some(_), Some(_)) => from_file(serde_json::from_slice(bytes)?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FrameKind, SchedulerProbes, WaitProbes};
    use crate::testing;

    fn frame(name: &str, file: Option<&str>, line: Option<u32>, kind: FrameKind) -> Frame {
        Frame {
            name: name.into(),
            file: file.map(Into::into),
            line,
            kind,
            module: (kind == FrameKind::Native).then(|| "python3.11".into()),
        }
    }

    /// Two stalls sharing a stack, a GIL wait whose holder has frames, a
    /// part with no frames and a frame that differs only by line.
    fn recording() -> Recording {
        let main = frame("main", None, None, FrameKind::Native);
        let run = frame(
            "Handle._run",
            Some("/usr/lib/python3.11/asyncio/events.py"),
            Some(80),
            FrameKind::Python,
        );
        let load = frame(
            "load_tokenizer",
            Some("/app/tok.py"),
            Some(41),
            FrameKind::Python,
        );
        let load2 = Frame {
            line: Some(42),
            ..load.clone()
        };
        let read = frame("read", None, None, FrameKind::Kernel);
        let part = |frames: Vec<Frame>, kind, ns| StackPart {
            woken: false,
            frames,
            weight_ns: ns,
            kind,
            syscall: (kind == PartKind::OffCpu).then(|| "read".into()),
            waker_tid: (kind == PartKind::OffCpu).then_some(9),
            gil_holder: None,
        };
        let stall = |start: u64, stacks: Vec<StackPart>| {
            let d = stacks.iter().map(|p| p.weight_ns).sum();
            Stall {
                pid: 42,
                tid: 7,
                thread_name: "MainThread".into(),
                ns_tid: Some(1),
                on_cpu_ns: d,
                off_cpu_ns: 0,
                incomplete: start == 0,
                coroutine: Some("handle".into()),
                ..testing::stall(start, stacks)
            }
        };
        let gil = StackPart {
            gil_holder: Some(GilHolder {
                tid: Some(12),
                thread_name: Some("worker".into()),
                ns_tid: Some(3),
                frames: vec![frame("hog", Some("/app/w.py"), Some(3), FrameKind::Python)],
            }),
            ..part(vec![main.clone(), run.clone()], PartKind::GilWait, 5)
        };
        Recording {
            cpu_quota: None,
            pid: 42,
            comm: "python3".into(),
            process: ProcessInfo {
                ns_pid: Some(1),
                container: crate::os::container::from_path(
                    "/kubepods.slice/kubepods-pod8e1f0c2a_3b4d_4e5f_9a6b_7c8d9e0f1a2b.slice/\
                     cri-containerd-3f2a9c0b1d4e5f60718293a4b5c6d7e8f90123456789abcdef0123456789abcd.scope",
                ),
            },
            threshold_ns: 20_000_000,
            sample_hz: 999,
            sample_after_ns: 1_000_000,
            kernel_filtered: [("short_busy_periods".to_string(), 3)].into(),
            busy_periods: 10,
            clock: "monotonic".into(),
            started_ns: 0,
            ended_ns: 1 << 40,
            lost_events: 0,
            drops: [("unwind_truncated".to_string(), 1)].into(),
            executor_threads: vec![ThreadInfo {
                tid: 7,
                name: "MainThread".into(),
                ns_tid: None,
            }],
            stallprof_version: "0.1.0".into(),
            probes: ProbeSet {
                scheduler: SchedulerProbes::RawTracepoints,
                waits: WaitProbes::UprobesThenTracepoints,
                notes: vec!["waits: syscall tracepoints, because pid 4 maps none".into()],
            },
            runtime_problems: vec![RuntimeProblem {
                pid: 42,
                runtime: "cpython 3.16.0".into(),
                what: "Python frames".into(),
                why: "unsupported version".into(),
                remedy: "upgrade stallprof".into(),
            }],
            app_paths: vec!["/srv/".into()],
            stalls: vec![
                stall(
                    0,
                    vec![
                        part(
                            vec![main.clone(), run.clone(), load.clone()],
                            PartKind::OnCpu,
                            30,
                        ),
                        part(
                            vec![main.clone(), run.clone(), load2.clone(), read.clone()],
                            PartKind::OffCpu,
                            20,
                        ),
                        part(vec![], PartKind::Runqueue, 1),
                        gil,
                    ],
                ),
                stall(1000, vec![part(vec![main, run, load], PartKind::OnCpu, 25)]),
            ],
            processes: Vec::new(),
        }
        .completed()
    }

    #[test]
    fn round_trip_interns_and_keeps_everything() {
        let rec = recording();
        let bytes = to_vec(&rec);
        assert_eq!(from_slice(&bytes).unwrap(), rec);
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["format"], FORMAT);
        assert_eq!(v["version"], VERSION);
        // main, run, load, load2, read, hog: each once.
        assert_eq!(v["frames"].as_array().unwrap().len(), 6);
        // [main run load], [.. load2 read], [], [main run], [hog]; the
        // second stall reuses the first stack.
        assert_eq!(v["stacks"].as_array().unwrap().len(), 5);
        assert_eq!(
            v["stalls"][1]["parts"][0]["stack"],
            v["stalls"][0]["parts"][0]["stack"]
        );
        assert_eq!(v["stalls"][0]["parts"][3]["gil_holder"]["stack"], 4);
        // Namespace ids next to the host's, and the container.
        assert_eq!(
            (v["pid"].as_u64(), v["ns_pid"].as_u64()),
            (Some(42), Some(1))
        );
        assert_eq!(v["stalls"][0]["ns_tid"], 1);
        assert_eq!(v["stalls"][0]["parts"][3]["gil_holder"]["ns_tid"], 3);
        assert_eq!(v["container"]["runtime"], "containerd");
        assert_eq!(
            v["container"]["pod_uid"],
            "8e1f0c2a-3b4d-4e5f-9a6b-7c8d9e0f1a2b"
        );
        // One row per line: a frame never spans lines.
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            text.lines()
                .any(|l| l.starts_with("{\"name\":\"load_tokenizer\"")),
            "{text}"
        );
    }

    /// Version 2 files (before the `throttled` kind, holders and quota)
    /// read as having none of them.
    #[test]
    fn reads_version_2() {
        let rec = recording();
        let mut v: serde_json::Value = serde_json::from_slice(&to_vec(&rec)).unwrap();
        v["version"] = 2.into();
        for s in v["stalls"].as_array_mut().unwrap() {
            s.as_object_mut().unwrap().remove("throttled_ns");
        }
        let back = from_slice(&serde_json::to_vec(&v).unwrap()).unwrap();
        assert_eq!(back, rec);
        assert_eq!(back.throttled_ns(), 0);
    }

    /// Throttled parts, a woken part, CPU holders and the quota survive
    /// the file.
    #[test]
    fn round_trips_throttling() {
        use crate::os::cpu_quota::{CgroupVersion, CpuQuota, Throttling};
        let mut rec = recording();
        let s = &mut rec.stalls[0];
        let mut woken = s.stacks[0].clone();
        woken.kind = PartKind::Throttled;
        woken.woken = true;
        woken.syscall = Some("epoll_wait".into());
        woken.frames = vec![Frame::marker("[woken from epoll_wait]")];
        s.stacks.push(woken);
        s.throttled_ns = s.stacks.last().unwrap().weight_ns;
        s.cpu_holders = vec![CpuHolder {
            pid: 0,
            tgid: 0,
            comm: "swapper/0".into(),
            ns: 7,
            relation: HolderRelation::Idle,
        }];
        rec.cpu_quota = Some(CpuQuota {
            cgroup_version: CgroupVersion::V1,
            cgroup: "/q".into(),
            quota_us: Some(10_000),
            period_us: 100_000,
            start: Throttling::default(),
            end: Some(Throttling {
                nr_periods: 3,
                nr_throttled: 2,
                throttled_ns: 150_000_000,
            }),
        });
        assert_eq!(from_slice(&to_vec(&rec)).unwrap(), rec);
    }

    /// A stall's process and the recording's processes survive the file,
    /// each process with its stall count; a version-3 file (neither) reads
    /// as the target's stalls and the target alone.
    #[test]
    fn processes_round_trip_and_version_3_reads_as_the_target() {
        let mut rec = recording();
        rec.processes.push(Process {
            pid: 43,
            comm: "python3".into(),
            info: ProcessInfo::default(),
            parent: Some(42),
            role: Some(Role::Worker {
                n: 1,
                of: "python3".into(),
            }),
            service: Some("gateway".into()),
        });
        rec.processes[0].role = Some(Role::Supervisor);
        rec.stalls[1].pid = 43;
        rec.stalls[1].tid = 43;
        let rec = rec.completed();
        let bytes = to_vec(&rec);
        assert_eq!(from_slice(&bytes).unwrap(), rec);
        let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["stalls"][1]["pid"], 43);
        let procs = &v["processes"];
        assert_eq!(
            (&procs[0]["pid"], &procs[0]["role"], &procs[0]["stalls"]),
            (&42.into(), &"supervisor".into(), &1.into())
        );
        assert_eq!(procs[0]["container"]["runtime"], "containerd");
        assert_eq!(
            (&procs[1]["role"], &procs[1]["parent"], &procs[1]["stalls"]),
            (&"worker 1 of python3".into(), &42.into(), &1.into())
        );
        // Version 3: no pids, no processes.
        v["version"] = 3.into();
        v.as_object_mut().unwrap().remove("processes");
        for s in v["stalls"].as_array_mut().unwrap() {
            s.as_object_mut().unwrap().remove("pid");
        }
        let back = from_slice(&serde_json::to_vec(&v).unwrap()).unwrap();
        assert!(back.stalls.iter().all(|s| s.pid == 42));
        assert_eq!(back.processes.len(), 1);
        assert_eq!(
            (back.processes[0].pid, back.processes[0].comm.as_str()),
            (42, "python3")
        );
        assert_eq!(back.processes[0].info, rec.process);
        // A role the reader does not know is a damaged file, said.
        let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        v["processes"][1]["role"] = "boss".into();
        let e = from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(
            e.to_string().contains("unknown process role \"boss\""),
            "{e}"
        );
    }

    #[test]
    fn reads_version_1() {
        let rec = recording();
        let v1 = serde_json::to_vec_pretty(&rec).unwrap();
        assert_eq!(from_slice(&v1).unwrap(), rec);
    }

    #[test]
    fn refuses_newer_versions_and_bad_ids() {
        let rec = recording();
        let mut v: serde_json::Value = serde_json::from_slice(&to_vec(&rec)).unwrap();
        v["version"] = (VERSION + 1).into();
        let e = from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(
            matches!(e, FormatError::NewerVersion { found } if found == VERSION + 1),
            "{e}"
        );
        v["version"] = VERSION.into();
        v["stalls"][0]["parts"][0]["stack"] = 99.into();
        let e = from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(
            matches!(
                e,
                FormatError::BadId {
                    what: "stack",
                    id: 99,
                    ..
                }
            ),
            "{e}"
        );
        v["format"] = "pprof".into();
        let e = from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(matches!(e, FormatError::NotStallprof { .. }), "{e}");
    }
}
