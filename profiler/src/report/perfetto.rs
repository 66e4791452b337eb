//! Stalls -> a Perfetto trace (`stalls.pftrace`): the stall timeline that
//! opens offline in <https://ui.perfetto.dev>.
//!
//! In: a [`Recording`]. Out: a stream of `TracePacket`s, i.e. the bytes of a
//! `perfetto.protos.Trace` (each packet is field 1 of `Trace`, so packets
//! are written one at a time and the trace is never held whole). What it
//! holds (docs/format.md, "stalls.pftrace"):
//!
//! - a process track for the target and for every other process with
//!   stalls (each then named by its role, `uvicorn worker 2 (pid 1240)`),
//!   and under its process a thread track for every loop thread (and
//!   every thread that held a GIL a loop thread waited for), carrying pid,
//!   tid and names;
//! - each stall as a slice on its thread's track from `start_ns` to
//!   `end_ns`, named by its top culprit (the summary's culprit text,
//!   [`aggregate::stall_culprit`]), with debug annotations (`stall`: its
//!   index in `stalls.json`, `task`: the asyncio coroutine, `task_name`
//!   and `awaited_by`: the asyncio Task and, 3.14+, its await chain,
//!   `entry`: the handler it ran in, [`aggregate::stall_entry`], `route`:
//!   the ASGI request's `POST /resume/{rid}` when read, what it held up:
//!   `timers_delayed`, `timer_worst_late_ns`, `timer_latest_due_late_ns`,
//!   `ready_callbacks`, or `held_up` saying why not read; the time split);
//! - inside it, one child slice per part group: on-CPU, blocked in each
//!   syscall, run queue, GIL wait per holder. `stalls.json` keeps parts as
//!   aggregated weights, not intervals, so the children are laid end to end
//!   in the order each group first occurs among the stall's parts, each as
//!   long as its weight: they fill the stall exactly, but their placement
//!   inside it is a layout, not a measurement;
//! - a flow from each GIL-wait child slice to a "holds the GIL" slice on the
//!   holder thread's track over the same interval (an instant when that
//!   would overlap another slice there);
//! - the sampled stacks as interned callstacks with `PerfSample`s on the
//!   thread: each part gets one sample per sampling period of its weight
//!   (at least one), evenly spread over its share of its child slice, so an
//!   area selection in the UI shows the flamegraph of exactly those parts,
//!   weighted like `stalls.folded`.
//!
//! Timestamps are CLOCK_MONOTONIC nanoseconds, declared as such: every
//! packet names clock 3 (`BUILTIN_CLOCK_MONOTONIC`) and the first packet is
//! a clock snapshot making it the trace's primary clock.
//!
//! The messages are the subset of Perfetto's protos used here, declared
//! with prost derive (no protoc at build time). Field numbers are taken from
//! Perfetto's protos at commit ec5d16b14b743ba6063d720956d6d6af6610fd72
//! (`protos/perfetto/trace/…`, file named on each message). Repeated scalars
//! are proto2 fields there, not packed: they are written unpacked, which
//! Perfetto's own (pbzero) decoder requires.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io::{self, Write},
    path::PathBuf,
};

use prost::Message;

use crate::model::{
    FrameKind, GilHolder, HeldUp, PartKind, Recording, StackPart, Stall, text::cpu_held_by,
};
use crate::{
    os::outdir::OutDir,
    report::{RenderError, aggregate, write_file_with},
};

/// trace_packet.proto `TracePacket`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TracePacket {
    #[prost(uint64, optional, tag = "8")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "58")]
    pub timestamp_clock_id: Option<u32>,
    #[prost(uint32, optional, tag = "10")]
    pub trusted_packet_sequence_id: Option<u32>,
    /// `SEQ_INCREMENTAL_STATE_CLEARED` = 1, `SEQ_NEEDS_INCREMENTAL_STATE` = 2.
    #[prost(uint32, optional, tag = "13")]
    pub sequence_flags: Option<u32>,
    #[prost(message, optional, tag = "12")]
    pub interned_data: Option<InternedData>,
    #[prost(oneof = "Data", tags = "6, 11, 60, 66")]
    pub data: Option<Data>,
}

/// trace_packet.proto: the `data` oneof members used here.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Data {
    #[prost(message, tag = "6")]
    ClockSnapshot(ClockSnapshot),
    #[prost(message, tag = "11")]
    TrackEvent(TrackEvent),
    #[prost(message, tag = "60")]
    TrackDescriptor(TrackDescriptor),
    #[prost(message, tag = "66")]
    PerfSample(PerfSample),
}

/// clock_snapshot.proto `ClockSnapshot`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ClockSnapshot {
    #[prost(message, repeated, tag = "1")]
    pub clocks: Vec<Clock>,
    /// A `BuiltinClock` (common/builtin_clock.proto).
    #[prost(int32, optional, tag = "2")]
    pub primary_trace_clock: Option<i32>,
}

/// clock_snapshot.proto `ClockSnapshot.Clock`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Clock {
    #[prost(uint32, optional, tag = "1")]
    pub clock_id: Option<u32>,
    #[prost(uint64, optional, tag = "2")]
    pub timestamp: Option<u64>,
}

/// track_event/track_descriptor.proto `TrackDescriptor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrackDescriptor {
    #[prost(uint64, optional, tag = "1")]
    pub uuid: Option<u64>,
    #[prost(uint64, optional, tag = "5")]
    pub parent_uuid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
    #[prost(message, optional, tag = "3")]
    pub process: Option<ProcessDescriptor>,
    #[prost(message, optional, tag = "4")]
    pub thread: Option<ThreadDescriptor>,
}

/// track_event/process_descriptor.proto `ProcessDescriptor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessDescriptor {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    #[prost(string, optional, tag = "6")]
    pub process_name: Option<String>,
}

/// track_event/thread_descriptor.proto `ThreadDescriptor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ThreadDescriptor {
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    #[prost(int64, optional, tag = "2")]
    pub tid: Option<i64>,
    #[prost(string, optional, tag = "5")]
    pub thread_name: Option<String>,
}

/// track_event/track_event.proto `TrackEvent`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrackEvent {
    #[prost(string, repeated, tag = "22")]
    pub categories: Vec<String>,
    #[prost(string, optional, tag = "23")]
    pub name: Option<String>,
    /// `TYPE_SLICE_BEGIN` = 1, `TYPE_SLICE_END` = 2, `TYPE_INSTANT` = 3.
    #[prost(int32, optional, tag = "9")]
    pub r#type: Option<i32>,
    #[prost(uint64, optional, tag = "11")]
    pub track_uuid: Option<u64>,
    #[prost(message, repeated, tag = "4")]
    pub debug_annotations: Vec<DebugAnnotation>,
    #[prost(fixed64, repeated, packed = "false", tag = "47")]
    pub flow_ids: Vec<u64>,
    #[prost(fixed64, repeated, packed = "false", tag = "48")]
    pub terminating_flow_ids: Vec<u64>,
}

pub const TYPE_SLICE_BEGIN: i32 = 1;
pub const TYPE_SLICE_END: i32 = 2;
pub const TYPE_INSTANT: i32 = 3;

/// track_event/debug_annotation.proto `DebugAnnotation` (one value set).
#[derive(Clone, PartialEq, prost::Message)]
pub struct DebugAnnotation {
    #[prost(string, optional, tag = "10")]
    pub name: Option<String>,
    #[prost(bool, optional, tag = "2")]
    pub bool_value: Option<bool>,
    #[prost(uint64, optional, tag = "3")]
    pub uint_value: Option<u64>,
    #[prost(string, optional, tag = "6")]
    pub string_value: Option<String>,
}

/// interned_data/interned_data.proto `InternedData`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InternedData {
    #[prost(message, repeated, tag = "5")]
    pub function_names: Vec<InternedString>,
    #[prost(message, repeated, tag = "6")]
    pub frames: Vec<InternedFrame>,
    #[prost(message, repeated, tag = "7")]
    pub callstacks: Vec<Callstack>,
}

/// profiling/profile_common.proto `InternedString`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InternedString {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(bytes = "vec", optional, tag = "2")]
    pub str: Option<Vec<u8>>,
}

/// profiling/profile_common.proto `Frame`. No mapping (`mapping_id` 0):
/// the frames are already symbolized, and Perfetto gives such frames a
/// placeholder mapping.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InternedFrame {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(uint64, optional, tag = "2")]
    pub function_name_id: Option<u64>,
}

/// profiling/profile_common.proto `Callstack`: frames outermost first
/// ("bottom frame first").
#[derive(Clone, PartialEq, prost::Message)]
pub struct Callstack {
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    #[prost(uint64, repeated, packed = "false", tag = "2")]
    pub frame_ids: Vec<u64>,
}

/// profiling/profile_packet.proto `PerfSample`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PerfSample {
    #[prost(uint32, optional, tag = "2")]
    pub pid: Option<u32>,
    #[prost(uint32, optional, tag = "3")]
    pub tid: Option<u32>,
    #[prost(uint64, optional, tag = "4")]
    pub callstack_iid: Option<u64>,
}

/// common/builtin_clock.proto `BUILTIN_CLOCK_MONOTONIC`.
const CLOCK_MONOTONIC: u32 = 3;
/// The one packet sequence this writer produces.
const SEQUENCE: u32 = 1;
const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;
const SEQ_NEEDS_INCREMENTAL_STATE: u32 = 2;
/// The sampling rate assumed when a recording does not say (`sample_hz` 0).
const DEFAULT_HZ: u64 = 999;

/// Track uuids: the process's, and one per thread (tids are at most 2^22
/// on Linux, so the two ranges cannot meet).
fn process_uuid(pid: u32) -> u64 {
    (1 << 40) | pid as u64
}
fn thread_uuid(tid: u32) -> u64 {
    (2 << 40) | tid as u64
}

fn annotation_str(name: &str, v: &str) -> DebugAnnotation {
    DebugAnnotation {
        name: Some(name.into()),
        string_value: Some(v.into()),
        ..Default::default()
    }
}
fn annotation_uint(name: &str, v: u64) -> DebugAnnotation {
    DebugAnnotation {
        name: Some(name.into()),
        uint_value: Some(v),
        ..Default::default()
    }
}

/// The packets of a recording, in order, handed to `out` one at a time.
struct Writer<'a> {
    out: &'a mut dyn FnMut(TracePacket) -> io::Result<()>,
    names: HashMap<String, u64>,
    frames: HashMap<u64, u64>,
    callstacks: HashMap<Vec<u64>, u64>,
    next_flow: u64,
}

impl Writer<'_> {
    fn packet(&mut self, ts: u64, data: Data) -> io::Result<()> {
        (self.out)(TracePacket {
            timestamp: Some(ts),
            timestamp_clock_id: Some(CLOCK_MONOTONIC),
            trusted_packet_sequence_id: Some(SEQUENCE),
            sequence_flags: None,
            interned_data: None,
            data: Some(data),
        })
    }

    fn event(&mut self, ts: u64, ev: TrackEvent) -> io::Result<()> {
        self.packet(ts, Data::TrackEvent(ev))
    }

    fn end(&mut self, ts: u64, track: u64) -> io::Result<()> {
        self.event(
            ts,
            TrackEvent {
                r#type: Some(TYPE_SLICE_END),
                track_uuid: Some(track),
                ..Default::default()
            },
        )
    }

    /// The callstack id of `part`, adding to `new` whatever the sequence
    /// has not interned yet.
    fn callstack(&mut self, part: &StackPart, new: &mut InternedData) -> u64 {
        let labels: Vec<String> = if part.frames.is_empty() {
            vec!["[unknown]".to_string()]
        } else {
            part.frames
                .iter()
                .map(|f| match f.kind {
                    FrameKind::Kernel => format!("{} [k]", f.label()),
                    _ => f.label(),
                })
                .collect()
        };
        let mut ids = Vec::with_capacity(labels.len());
        for label in labels {
            let next = self.names.len() as u64 + 1;
            let name = *self.names.entry(label).or_insert_with_key(|label| {
                new.function_names.push(InternedString {
                    iid: Some(next),
                    str: Some(label.clone().into_bytes()),
                });
                next
            });
            let next = self.frames.len() as u64 + 1;
            let frame = *self.frames.entry(name).or_insert_with(|| {
                new.frames.push(InternedFrame {
                    iid: Some(next),
                    function_name_id: Some(name),
                });
                next
            });
            ids.push(frame);
        }
        let next = self.callstacks.len() as u64 + 1;
        *self.callstacks.entry(ids).or_insert_with_key(|ids| {
            new.callstacks.push(Callstack {
                iid: Some(next),
                frame_ids: ids.clone(),
            });
            next
        })
    }

    /// `count` samples of `part` evenly spread over [start, end).
    fn samples(
        &mut self,
        pid: u32,
        tid: u32,
        part: &StackPart,
        (start, end): (u64, u64),
        count: u64,
    ) -> io::Result<()> {
        let mut new = InternedData::default();
        let callstack = self.callstack(part, &mut new);
        let mut new = Some(new).filter(|n| !n.callstacks.is_empty());
        for i in 0..count {
            let ts = start + mul_div(end - start, 2 * i + 1, 2 * count);
            (self.out)(TracePacket {
                timestamp: Some(ts),
                timestamp_clock_id: Some(CLOCK_MONOTONIC),
                trusted_packet_sequence_id: Some(SEQUENCE),
                sequence_flags: Some(SEQ_NEEDS_INCREMENTAL_STATE),
                interned_data: new.take(),
                data: Some(Data::PerfSample(PerfSample {
                    pid: Some(pid),
                    tid: Some(tid),
                    callstack_iid: Some(callstack),
                })),
            })?;
        }
        Ok(())
    }
}

/// `a * b / c` without overflow (c > 0).
fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    (a as u128 * b as u128 / c as u128) as u64
}

/// Weights laid end to end over `[start, end]`, scaled to fill it
/// exactly: what begins `cum` ns of weight into `total` begins at
/// [`EndToEnd::at`]. A stall's parts are aggregated weights, not
/// intervals; this is the one layout every timeline output gives them
/// (here and `stalls.speedscope.json`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct EndToEnd {
    start: u64,
    span: u64,
    total: u64,
}

impl EndToEnd {
    pub(crate) fn new(start: u64, end: u64, total: u64) -> EndToEnd {
        EndToEnd {
            start,
            span: end.saturating_sub(start),
            total: total.max(1),
        }
    }

    pub(crate) fn at(&self, cum: u64) -> u64 {
        self.start + mul_div(self.span, cum.min(self.total), self.total)
    }
}

/// A child slice: the parts of one kind (and syscall, and GIL holder).
struct Group<'a> {
    kind: PartKind,
    syscall: Option<&'a str>,
    holder: Option<&'a GilHolder>,
    parts: Vec<&'a StackPart>,
    weight_ns: u64,
}

impl Group<'_> {
    /// `quota`: the target's CPU quota (`10ms/100ms`), when it has one.
    fn name(&self, quota: Option<&str>) -> String {
        let base = match self.parts.first() {
            Some(p) => p.kind_text(),
            None => String::new(),
        };
        match self.kind {
            PartKind::GilWait => match self.holder {
                Some(h) => format!("GIL wait (held by {})", h.describe()),
                None => "GIL wait".into(),
            },
            PartKind::Throttled => match quota {
                Some(q) => format!("{base} (quota {q})"),
                None => base,
            },
            _ => base,
        }
    }
}

/// The stall's parts grouped into child slices, in order of first occurrence.
fn groups(s: &Stall) -> Vec<Group<'_>> {
    let mut out: Vec<Group> = Vec::new();
    for p in s.stacks.iter().filter(|p| p.weight_ns > 0) {
        let holder = p
            .gil_holder
            .as_ref()
            .filter(|_| p.kind == PartKind::GilWait);
        let same = |g: &Group| {
            g.kind == p.kind
                && g.parts.first().is_none_or(|f| f.woken == p.woken)
                && g.syscall == p.syscall.as_deref()
                && g.holder.map(|h| h.tid) == holder.map(|h| h.tid)
        };
        match out.iter_mut().find(|g| same(g)) {
            Some(g) => {
                g.parts.push(p);
                g.weight_ns += p.weight_ns;
            }
            None => out.push(Group {
                kind: p.kind,
                syscall: p.syscall.as_deref(),
                holder,
                parts: vec![p],
                weight_ns: p.weight_ns,
            }),
        }
    }
    out
}

/// A GIL-wait interval and the flow that leads from it to its holder.
struct GilLink {
    holder_tid: u32,
    start: u64,
    end: u64,
    flow: u64,
    what: String,
}

/// Every packet of `rec`, in order, to `out`.
pub fn packets(
    rec: &Recording,
    out: &mut dyn FnMut(TracePacket) -> io::Result<()>,
) -> io::Result<()> {
    let quota = rec
        .cpu_quota
        .as_ref()
        .filter(|q| q.quota_us.is_some())
        .map(|q| q.describe());
    let mut w = Writer {
        out,
        names: HashMap::new(),
        frames: HashMap::new(),
        callstacks: HashMap::new(),
        next_flow: 1,
    };
    let first_ts = rec.first_ns();
    (w.out)(TracePacket {
        timestamp: Some(first_ts),
        timestamp_clock_id: Some(CLOCK_MONOTONIC),
        trusted_packet_sequence_id: Some(SEQUENCE),
        sequence_flags: Some(SEQ_INCREMENTAL_STATE_CLEARED),
        interned_data: None,
        data: Some(Data::ClockSnapshot(ClockSnapshot {
            clocks: vec![Clock {
                clock_id: Some(CLOCK_MONOTONIC),
                timestamp: Some(first_ts),
            }],
            primary_trace_clock: Some(CLOCK_MONOTONIC as i32),
        })),
    })?;

    // Tracks: the process, its loop threads, the GIL holders. In a PID
    // namespace of its own, names carry the ids the application logs.
    let in_ns = |name: &str, ns: Option<u32>| match ns {
        Some(ns) => format!("{name} [tid {ns} in its namespace]"),
        None => name.to_string(),
    };
    // Each thread under its process: a stall's thread and the GIL holders
    // it waited for are in the stall's process; a loop thread without a
    // stall, in the target's (the recording lists the target's loop
    // threads).
    let mut threads: BTreeMap<u32, (u32, String)> = BTreeMap::new();
    let stall_pids: BTreeMap<u32, u32> = rec.stalls.iter().map(|s| (s.tid, s.pid)).collect();
    for t in rec.stall_threads() {
        let pid = stall_pids.get(&t.tid).copied().unwrap_or(rec.pid);
        threads.insert(t.tid, (pid, in_ns(&t.name, t.ns_tid)));
    }
    let loop_tids: BTreeSet<u32> = threads.keys().copied().collect();
    for s in &rec.stalls {
        for p in &s.stacks {
            if let Some(h) = &p.gil_holder
                && let Some(tid) = h.tid
            {
                let name = h
                    .thread_name
                    .clone()
                    .unwrap_or_else(|| format!("tid {tid}"));
                threads
                    .entry(tid)
                    .or_insert_with(|| (s.pid, in_ns(&name, h.ns_tid)));
            }
        }
    }
    // One process track per process with a thread here, the target's
    // first (and always: a recording without stalls still names it).
    let mut pids: Vec<u32> = vec![rec.pid];
    pids.extend(
        threads
            .values()
            .map(|&(pid, _)| pid)
            .filter(|&pid| pid != rec.pid)
            .collect::<BTreeSet<u32>>(),
    );
    let several = pids.len() > 1;
    for &pid in &pids {
        let name = match rec.process_of(pid) {
            // Among several: each by its role (`uvicorn worker 2 (pid 1240)`).
            Some(p) if several => p.title(),
            _ if pid == rec.pid => match (rec.process.ns_pid, &rec.process.container) {
                (None, None) => rec.comm.clone(),
                _ => rec.target(),
            },
            _ => format!("pid {pid}"),
        };
        w.packet(
            first_ts,
            Data::TrackDescriptor(TrackDescriptor {
                uuid: Some(process_uuid(pid)),
                process: Some(ProcessDescriptor {
                    pid: Some(pid as i32),
                    process_name: Some(name),
                }),
                ..Default::default()
            }),
        )?;
    }
    for (&tid, (pid, name)) in &threads {
        w.packet(
            first_ts,
            Data::TrackDescriptor(TrackDescriptor {
                uuid: Some(thread_uuid(tid)),
                parent_uuid: Some(process_uuid(*pid)),
                thread: Some(ThreadDescriptor {
                    pid: Some(*pid as i32),
                    tid: Some(tid as i64),
                    thread_name: Some(name.clone()),
                }),
                ..Default::default()
            }),
        )?;
    }

    let hz = if rec.sample_hz > 0 {
        rec.sample_hz
    } else {
        DEFAULT_HZ
    };
    let mut links: Vec<GilLink> = Vec::new();
    let app = rec.app();
    for (index, s) in rec.stalls.iter().enumerate() {
        let track = thread_uuid(s.tid);
        let mut notes = vec![
            annotation_uint("stall", index as u64),
            annotation_uint("duration_ns", s.duration_ns),
            annotation_uint("on_cpu_ns", s.on_cpu_ns),
            annotation_uint("off_cpu_ns", s.off_cpu_ns),
            annotation_uint("runqueue_ns", s.runqueue_ns),
            annotation_uint("throttled_ns", s.throttled_ns),
        ];
        if let Some(held) = cpu_held_by(&s.cpu_holders, 3) {
            notes.push(annotation_str("cpu_held_by", &held));
        }
        if let Some(task) = &s.coroutine {
            notes.push(annotation_str("task", task));
        }
        if let Some(t) = &s.task {
            notes.push(annotation_str("task_name", &t.name));
            if !t.awaited_by.is_empty() {
                notes.push(annotation_str("awaited_by", &t.awaited_by.join(" ← ")));
            }
        }
        if let Some(ids) = s.trace() {
            notes.push(annotation_str("trace_id", &ids.trace_id));
            notes.push(annotation_str("span_id", &ids.span_id));
        }
        if let Some(e) = aggregate::stall_entry(s, &app) {
            notes.push(annotation_str("entry", &e));
        }
        if let Some(r) = &s.route {
            notes.push(annotation_str("route", &r.describe()));
        }
        match &s.held_up {
            Some(HeldUp::Read(d)) => {
                notes.push(annotation_uint(
                    "timers_delayed",
                    d.timers_late_ns.len() as u64,
                ));
                if let (Some(worst), Some(latest)) = (d.worst_late_ns(), d.latest_due_late_ns()) {
                    notes.push(annotation_uint("timer_worst_late_ns", worst));
                    notes.push(annotation_uint("timer_latest_due_late_ns", latest));
                }
                notes.push(annotation_uint(
                    "ready_callbacks",
                    u64::from(d.ready_handles),
                ));
            }
            Some(HeldUp::NotRead(n)) => {
                notes.push(annotation_str("held_up", n.reason.describe()));
            }
            None => {}
        }
        if s.incomplete {
            notes.push(DebugAnnotation {
                name: Some("incomplete".into()),
                bool_value: Some(true),
                ..Default::default()
            });
        }
        w.event(
            s.start_ns,
            TrackEvent {
                categories: vec!["stall".into()],
                name: Some(aggregate::stall_culprit(s, &app).unwrap_or_else(|| "stall".into())),
                r#type: Some(TYPE_SLICE_BEGIN),
                track_uuid: Some(track),
                debug_annotations: notes,
                ..Default::default()
            },
        )?;
        let groups = groups(s);
        let total: u64 = groups.iter().map(|g| g.weight_ns).sum();
        let lay = EndToEnd::new(s.start_ns, s.end_ns, total);
        let at = |cum: u64| lay.at(cum);
        let mut cum = 0;
        for g in &groups {
            let (g_start, g_end) = (at(cum), at(cum + g.weight_ns));
            let mut part_cum = cum;
            cum += g.weight_ns;
            if g_end <= g_start {
                continue;
            }
            let mut notes = vec![annotation_uint("weight_ns", g.weight_ns)];
            if let Some(sc) = g.syscall {
                notes.push(annotation_str("syscall", sc));
            }
            let mut flow_ids = Vec::new();
            if let Some(h) = g.holder {
                notes.push(annotation_str("gil_holder", &h.describe()));
                if let Some(holder_tid) = h.tid {
                    let flow = w.next_flow;
                    w.next_flow += 1;
                    flow_ids.push(flow);
                    links.push(GilLink {
                        holder_tid,
                        start: g_start,
                        end: g_end,
                        flow,
                        what: match h.frames.last() {
                            Some(f) => format!("holds the GIL: {}", f.label()),
                            None => "holds the GIL".into(),
                        },
                    });
                }
            }
            w.event(
                g_start,
                TrackEvent {
                    categories: vec!["stall_part".into()],
                    name: Some(g.name(quota.as_deref())),
                    r#type: Some(TYPE_SLICE_BEGIN),
                    track_uuid: Some(track),
                    debug_annotations: notes,
                    flow_ids,
                    ..Default::default()
                },
            )?;
            for p in &g.parts {
                let (p_start, p_end) = (at(part_cum), at(part_cum + p.weight_ns));
                part_cum += p.weight_ns;
                let count = mul_div(p.weight_ns, hz, 1_000_000_000).max(1);
                w.samples(s.pid, s.tid, p, (p_start, p_end.max(p_start + 1)), count)?;
            }
            w.end(g_end, track)?;
        }
        w.end(s.end_ns, track)?;
    }

    // The holder's side of each GIL wait: a slice where the holder's track
    // is free (a thread that is not a loop thread, not already showing a
    // hold then), else an instant, so slices on a track always nest.
    links.sort_by_key(|l| (l.start, l.flow));
    let mut free_from: HashMap<u32, u64> = HashMap::new();
    for l in links {
        let track = thread_uuid(l.holder_tid);
        let free = free_from.entry(l.holder_tid).or_insert(0);
        let slice = !loop_tids.contains(&l.holder_tid) && l.start >= *free;
        w.event(
            l.start,
            TrackEvent {
                categories: vec!["gil".into()],
                name: Some(l.what),
                r#type: Some(if slice {
                    TYPE_SLICE_BEGIN
                } else {
                    TYPE_INSTANT
                }),
                track_uuid: Some(track),
                terminating_flow_ids: vec![l.flow],
                ..Default::default()
            },
        )?;
        if slice {
            *free = l.end;
            w.end(l.end, track)?;
        }
    }
    Ok(())
}

/// The trace's bytes: each packet as field 1 (`packet`) of `Trace`.
pub fn encode(rec: &Recording, w: &mut dyn Write) -> io::Result<()> {
    let mut buf = Vec::new();
    packets(rec, &mut |p| {
        buf.clear();
        buf.push(0x0a); // field 1, length-delimited
        p.encode_length_delimited(&mut buf)
            .expect("encoding into a Vec cannot fail");
        w.write_all(&buf)
    })
}

/// `stalls.pftrace` of a recording.
pub fn write(rec: &Recording, dir: &OutDir) -> Result<PathBuf, RenderError> {
    write_file_with(dir, "stalls.pftrace", |w| encode(rec, w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frame, ThreadInfo};
    use crate::testing;

    fn part(names: &[&str], kind: PartKind, ns: u64) -> StackPart {
        StackPart {
            woken: false,
            frames: names
                .iter()
                .map(|n| Frame::new(*n, FrameKind::Native))
                .collect(),
            weight_ns: ns,
            kind,
            syscall: (kind == PartKind::OffCpu).then(|| "read".into()),
            waker_tid: None,
            gil_holder: (kind == PartKind::GilWait).then(|| GilHolder {
                tid: Some(9),
                thread_name: Some("hog".into()),
                ns_tid: None,
                frames: vec![Frame::new("match", FrameKind::Python)],
            }),
        }
    }

    fn recording() -> Recording {
        // One stall on tid 7, 1000 µs to 1010 µs (10 ms):
        //   |--on-CPU 4 ms (spin, 2 parts)--|--blocked in read 2 ms--|--GIL wait 4 ms--|
        let s = Stall {
            pid: 5,
            tid: 7,
            thread_name: "loop".into(),
            coroutine: Some("handle (app.py:3)".into()),
            task: Some(crate::model::Task {
                name: "batch-3".into(),
                coro: Some("handle".into()),
                awaited_by: vec!["runner".into(), "Task-1".into()],
                ..Default::default()
            }),
            ..testing::stall(
                1_000_000,
                vec![
                    part(&["main", "spin"], PartKind::OnCpu, 3_000_000),
                    part(&["main", "read"], PartKind::OffCpu, 2_000_000),
                    part(&["main", "spin"], PartKind::OnCpu, 1_000_000),
                    part(&["main", "take_gil"], PartKind::GilWait, 4_000_000),
                ],
            )
        };
        Recording {
            pid: 5,
            comm: "app".into(),
            threshold_ns: 1,
            sample_hz: 1000,
            busy_periods: 1,
            ended_ns: 20_000_000,
            executor_threads: vec![ThreadInfo {
                tid: 7,
                name: "loop".into(),
                ns_tid: None,
            }],
            processes: Vec::new(),
            ..Recording::for_tests(vec![s])
        }
        .completed()
    }

    fn events(ps: &[TracePacket]) -> Vec<(u64, &TrackEvent)> {
        ps.iter()
            .filter_map(|p| match &p.data {
                Some(Data::TrackEvent(e)) => Some((p.timestamp.unwrap(), e)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn slices_children_samples_and_flow() {
        let rec = recording();
        let mut ps = Vec::new();
        packets(&rec, &mut |p| {
            ps.push(p);
            Ok(())
        })
        .unwrap();
        assert!(matches!(ps[0].data, Some(Data::ClockSnapshot(_))));
        assert_eq!(ps[0].sequence_flags, Some(SEQ_INCREMENTAL_STATE_CLEARED));
        assert!(
            ps.iter()
                .all(|p| p.timestamp_clock_id == Some(CLOCK_MONOTONIC))
        );

        let ev = events(&ps);
        let begins: Vec<(u64, &str)> = ev
            .iter()
            .filter(|(_, e)| e.r#type == Some(TYPE_SLICE_BEGIN))
            .map(|(t, e)| (*t, e.name.as_deref().unwrap()))
            .collect();
        assert_eq!(
            begins,
            vec![
                (1_000_000, "spin — on-CPU"),
                (1_000_000, "on-CPU"),
                (5_000_000, "blocked in read"),
                (7_000_000, "GIL wait (held by hog (tid 9) in match)"),
                (7_000_000, "holds the GIL: match"),
            ],
            "on-CPU parts merge into one child, laid out in order of first occurrence"
        );
        let ends: Vec<u64> = ev
            .iter()
            .filter(|(_, e)| e.r#type == Some(TYPE_SLICE_END))
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(
            ends,
            vec![5_000_000, 7_000_000, 11_000_000, 11_000_000, 11_000_000]
        );
        let stall = ev[0].1;
        assert!(
            stall
                .debug_annotations
                .iter()
                .any(|a| a.name.as_deref() == Some("task")
                    && a.string_value.as_deref() == Some("handle (app.py:3)"))
        );
        let note = |name: &str| {
            stall
                .debug_annotations
                .iter()
                .find(|a| a.name.as_deref() == Some(name))
                .and_then(|a| a.string_value.clone())
        };
        assert_eq!(note("task_name").as_deref(), Some("batch-3"));
        assert_eq!(note("awaited_by").as_deref(), Some("runner ← Task-1"));
        let gil = ev.iter().find(|(_, e)| !e.flow_ids.is_empty()).unwrap().1;
        let holder = ev
            .iter()
            .find(|(_, e)| !e.terminating_flow_ids.is_empty())
            .unwrap()
            .1;
        assert_eq!(gil.flow_ids, holder.terminating_flow_ids);
        assert_eq!(holder.track_uuid, Some(thread_uuid(9)));
        assert_eq!(gil.track_uuid, Some(thread_uuid(7)));

        // 10 ms at 1000 Hz: ten samples, each inside its part's share.
        let samples: Vec<(u64, u64)> = ps
            .iter()
            .filter_map(|p| match &p.data {
                Some(Data::PerfSample(s)) => Some((p.timestamp.unwrap(), s.callstack_iid.unwrap())),
                _ => None,
            })
            .collect();
        assert_eq!(samples.len(), 10);
        assert!(
            samples
                .iter()
                .all(|&(t, _)| (1_000_000..11_000_000).contains(&t))
        );
        let interned: Vec<&InternedData> =
            ps.iter().filter_map(|p| p.interned_data.as_ref()).collect();
        let callstacks: Vec<&Callstack> = interned.iter().flat_map(|i| &i.callstacks).collect();
        assert_eq!(
            callstacks.len(),
            3,
            "spin, read, take_gil, each interned once"
        );
        let names: Vec<&[u8]> = interned
            .iter()
            .flat_map(|i| &i.function_names)
            .map(|s| s.str.as_deref().unwrap())
            .collect();
        assert_eq!(names, [&b"main"[..], b"spin", b"read", b"take_gil"]);
        assert_eq!(callstacks[0].frame_ids, [1, 2], "outermost first");
    }

    /// Two loop threads wait for the same holder at once:
    ///   tid 7  |--GIL wait 4 ms--|...          (from 7 ms)
    ///   tid 8      |--GIL wait--|              (from 8 ms, inside it)
    ///   tid 9  |==holds the GIL==|  + an instant at 8 ms, never a second,
    ///                                 overlapping slice on 9's track
    /// Throttled time is its own child slice, named with the quota; a wait
    /// woken from the park is named for it; the CPU holders annotate the
    /// stall.
    #[test]
    fn throttled_and_woken_children_name_the_quota_and_the_park() {
        use crate::model::{CpuHolder, HolderRelation};
        use crate::os::cpu_quota::{CgroupVersion, CpuQuota, Throttling};
        let mut rec = recording();
        rec.cpu_quota = Some(CpuQuota {
            cgroup_version: CgroupVersion::V1,
            cgroup: "/svc".into(),
            quota_us: Some(10_000),
            period_us: 100_000,
            start: Throttling::default(),
            end: None,
        });
        let s = &mut rec.stalls[0];
        s.stacks = vec![
            part(&["main", "spin"], PartKind::OnCpu, 5_000_000),
            part(&["main", "spin"], PartKind::Throttled, 3_000_000),
            StackPart {
                woken: true,
                syscall: Some("epoll_wait".into()),
                ..part(&["[woken from epoll_wait]"], PartKind::Runqueue, 2_000_000)
            },
        ];
        s.cpu_holders = vec![CpuHolder {
            pid: 42,
            tgid: 42,
            comm: "cpuhog".into(),
            ns: 2_000_000,
            relation: HolderRelation::Other,
        }];
        let mut ps = Vec::new();
        packets(&rec, &mut |p| {
            ps.push(p);
            Ok(())
        })
        .unwrap();
        let ev = events(&ps);
        let names: Vec<&str> = ev
            .iter()
            .filter(|(_, e)| e.r#type == Some(TYPE_SLICE_BEGIN))
            .map(|(_, e)| e.name.as_deref().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "spin — on-CPU",
                "on-CPU",
                "CPU throttled (quota 10ms/100ms)",
                "woken from epoll_wait, waiting for a CPU"
            ]
        );
        let held = ev[0]
            .1
            .debug_annotations
            .iter()
            .find(|a| a.name.as_deref() == Some("cpu_held_by"))
            .and_then(|a| a.string_value.clone());
        assert_eq!(held.as_deref(), Some("cpuhog (pid 42) 2.0ms 100%"));
    }

    #[test]
    fn overlapping_holds_become_instants() {
        let mut rec = recording();
        let mut second = rec.stalls[0].clone();
        second.tid = 8;
        second.thread_name = "loop2".into();
        second.start_ns += 1_000_000;
        second.end_ns += 1_000_000;
        rec.stalls.push(second);
        let mut ps = Vec::new();
        packets(&rec, &mut |p| {
            ps.push(p);
            Ok(())
        })
        .unwrap();
        let on_holder: Vec<(u64, i32)> = events(&ps)
            .into_iter()
            .filter(|(_, e)| e.track_uuid == Some(thread_uuid(9)))
            .map(|(t, e)| (t, e.r#type.unwrap()))
            .collect();
        assert_eq!(
            on_holder,
            vec![
                (7_000_000, TYPE_SLICE_BEGIN),
                (11_000_000, TYPE_SLICE_END),
                (8_000_000, TYPE_INSTANT),
            ]
        );
        let flows: Vec<u64> = events(&ps)
            .iter()
            .flat_map(|(_, e)| e.flow_ids.clone())
            .collect();
        assert_eq!(flows, [1, 2], "one flow per GIL wait, ids unique");
    }

    #[test]
    fn encoding_is_a_trace_and_repeated_fields_unpacked() {
        let rec = recording();
        let mut bytes = Vec::new();
        encode(&rec, &mut bytes).unwrap();
        // Trace { repeated TracePacket packet = 1; }
        #[derive(Clone, PartialEq, prost::Message)]
        struct Trace {
            #[prost(message, repeated, tag = "1")]
            packet: Vec<TracePacket>,
        }
        let t = Trace::decode(bytes.as_slice()).unwrap();
        let mut direct = Vec::new();
        packets(&rec, &mut |p| {
            direct.push(p);
            Ok(())
        })
        .unwrap();
        assert_eq!(t.packet, direct);
        // flow_ids (47, fixed64) written unpacked: tag (47 << 3) | 1.
        let ev = TrackEvent {
            flow_ids: vec![1, 2],
            ..Default::default()
        };
        assert_eq!(ev.encode_to_vec()[..2], [0xf9, 0x02]);
    }

    /// Stalls in two workers of a supervisor: a process track each (and
    /// the target's), named by role, each thread under its own process and
    /// its samples carrying its pid.
    #[test]
    fn each_process_its_own_track() {
        let rec = testing::two_workers();
        let mut ps = Vec::new();
        packets(&rec, &mut |p| {
            ps.push(p);
            Ok(())
        })
        .unwrap();
        let tracks: Vec<&TrackDescriptor> = ps
            .iter()
            .filter_map(|p| match &p.data {
                Some(Data::TrackDescriptor(t)) => Some(t),
                _ => None,
            })
            .collect();
        let processes: Vec<(i32, &str)> = tracks
            .iter()
            .filter_map(|t| t.process.as_ref())
            .map(|p| (p.pid.unwrap(), p.process_name.as_deref().unwrap()))
            .collect();
        assert_eq!(
            processes,
            [
                (1200, "uvicorn supervisor (pid 1200)"),
                (1210, "uvicorn worker 1 (pid 1210)"),
                (1220, "uvicorn worker 2 (pid 1220)"),
            ]
        );
        for t in tracks.iter().filter(|t| t.thread.is_some()) {
            let th = t.thread.as_ref().unwrap();
            // Each worker's loop is its main thread.
            assert_eq!(th.pid.map(|p| p as i64), th.tid, "{t:?}");
            assert_eq!(t.parent_uuid, Some(process_uuid(th.pid.unwrap() as u32)));
        }
        let sample_pids: BTreeSet<u32> = ps
            .iter()
            .filter_map(|p| match &p.data {
                Some(Data::PerfSample(s)) => s.pid,
                _ => None,
            })
            .collect();
        assert_eq!(sample_pids, [1210, 1220].into());
        // One process: one track, named as before.
        let one = recording();
        let mut ps = Vec::new();
        packets(&one, &mut |p| {
            ps.push(p);
            Ok(())
        })
        .unwrap();
        let names: Vec<String> = ps
            .iter()
            .filter_map(|p| match &p.data {
                Some(Data::TrackDescriptor(TrackDescriptor {
                    process: Some(p), ..
                })) => p.process_name.clone(),
                _ => None,
            })
            .collect();
        assert_eq!(names, ["app"]);
    }
}
