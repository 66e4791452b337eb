//! The Perfetto timeline `stalls.pftrace` (issue 14, item 2), root
//! integration tests against real victims. The trace is decoded with
//! Perfetto's own protos (`perfetto_trace_pb2` from the `perfetto` package on
//! PyPI, installed pinned under target/test-deps/perfetto-py by the first
//! test that needs it), never with stallprof's own message definitions, and
//! checked against the recording's stalls.json:
//!
//! - `gateway_trace_matches_stalls_json` (demo/gateway.py under pyenv's
//!   3.11, `--threshold 20ms` as the demo runs it): a process track and a
//!   thread track per loop thread with pid, tid and name; exactly one
//!   top-level slice per stall on its thread's track, from `start_ns` to
//!   `end_ns`, named by the stall's top culprit (the summary's text) and
//!   annotated with its index and, when known, its asyncio task; inside it
//!   child slices, one per part group, that fill the stall exactly, named
//!   after the parts' kinds (`blocked in <syscall>` for each syscall the
//!   stall blocked in); samples on the thread inside the stall, every one
//!   referencing an interned callstack whose frames and names are interned,
//!   and whose leaves are the stall's parts' leaves; `report` writes the
//!   same trace again from stalls.json.
//! - `gil_trace_has_flows_to_the_holder` (tests/victims/py_gil.py): GIL-wait
//!   child slices carry a flow that ends on the holder thread's track
//!   ("gil-hog", its tid as the victim logs it).
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;
use stallprof::{
    model::Recording,
    report::{self, aggregate},
};

/// The `perfetto` PyPI package (its `perfetto_trace_pb2`) and the protobuf
/// runtime it needs, pinned.
const PERFETTO_PY: &str = "perfetto==0.59.1";
const PROTOBUF_PY: &str = "protobuf==7.36.2";

/// Perfetto's protos, installed once into target/test-deps/perfetto-py.
fn perfetto_py(python: &Path) -> PathBuf {
    let deps = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-deps/perfetto-py");
    if !deps.join("perfetto-0.59.1.dist-info").exists() {
        eprintln!(
            "installing {PERFETTO_PY} and {PROTOBUF_PY} from PyPI (Perfetto's own protos) into {}",
            deps.display()
        );
        let st = Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--target",
            ])
            .arg(&deps)
            .args([PERFETTO_PY, PROTOBUF_PY])
            .status()
            .unwrap_or_else(|e| panic!("running {} -m pip: {e}", python.display()));
        assert!(
            st.success(),
            "installing {PERFETTO_PY} from PyPI into {} failed (needs network access to pypi.org)",
            deps.display()
        );
    }
    deps
}

/// Decodes a trace with `perfetto_trace_pb2.Trace` and prints what the
/// checks need as JSON: events, track descriptors, samples, interned data.
const DECODE: &str = r#"
import json, sys
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
t = pb.Trace()
t.ParseFromString(open(sys.argv[1], "rb").read())
out = {"events": [], "tracks": [], "samples": [], "names": {}, "frames": {},
       "callstacks": {}, "clocks": [], "packet_clocks": set()}
for p in t.packet:
    out["packet_clocks"].add(p.timestamp_clock_id)
    if p.HasField("interned_data"):
        d = p.interned_data
        for s in d.function_names: out["names"][s.iid] = s.str.decode()
        for f in d.frames: out["frames"][f.iid] = f.function_name_id
        for c in d.callstacks: out["callstacks"][c.iid] = list(c.frame_ids)
    if p.HasField("clock_snapshot"):
        out["clocks"].append(p.clock_snapshot.primary_trace_clock)
    if p.HasField("track_descriptor"):
        d = p.track_descriptor
        out["tracks"].append({
            "uuid": d.uuid, "parent": d.parent_uuid,
            "pid": d.thread.pid if d.HasField("thread") else d.process.pid,
            "tid": d.thread.tid if d.HasField("thread") else None,
            "name": d.thread.thread_name if d.HasField("thread") else d.process.process_name})
    if p.HasField("track_event"):
        e = p.track_event
        notes = {}
        for a in e.debug_annotations:
            notes[a.name] = a.string_value if a.HasField("string_value") else (
                a.uint_value if a.HasField("uint_value") else a.bool_value)
        out["events"].append({
            "ts": p.timestamp, "type": pb.TrackEvent.Type.Name(e.type),
            "track": e.track_uuid, "name": e.name, "cat": list(e.categories),
            "flows": list(e.flow_ids), "ends_flows": list(e.terminating_flow_ids),
            "notes": notes})
    if p.HasField("perf_sample"):
        s = p.perf_sample
        out["samples"].append({"ts": p.timestamp, "pid": s.pid, "tid": s.tid,
                               "callstack": s.callstack_iid})
out["packet_clocks"] = sorted(out["packet_clocks"])
json.dump(out, sys.stdout)
"#;

fn decode(python: &Path, trace: &Path) -> Value {
    let deps = perfetto_py(python);
    let out = Command::new(python)
        .env("PYTHONPATH", &deps)
        .args(["-c", DECODE])
        .arg(trace)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "perfetto_trace_pb2 cannot decode {}:\n{}",
        trace.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the decoder prints JSON")
}

/// A slice rebuilt from BEGIN/END pairs on one track.
#[derive(Debug, Clone)]
struct Slice {
    track: u64,
    depth: usize,
    start: u64,
    end: u64,
    name: String,
    cat: String,
    flows: Vec<u64>,
    ends_flows: Vec<u64>,
    notes: Value,
}

/// Slices per track, nested as Perfetto nests them: events in time order,
/// ties in file order, an END closing the innermost open slice. Instants
/// come back as zero-length slices.
fn slices(t: &Value) -> Vec<Slice> {
    let mut ev: Vec<(usize, &Value)> = t["events"].as_array().unwrap().iter().enumerate().collect();
    ev.sort_by_key(|(i, e)| (e["ts"].as_u64().unwrap(), *i));
    let mut open: HashMap<u64, Vec<Slice>> = HashMap::new();
    let mut done = Vec::new();
    for (_, e) in ev {
        let track = e["track"].as_u64().unwrap();
        let ts = e["ts"].as_u64().unwrap();
        let stack = open.entry(track).or_default();
        let slice = || Slice {
            track,
            depth: stack.len(),
            start: ts,
            end: ts,
            name: e["name"].as_str().unwrap_or("").to_string(),
            cat: e["cat"][0].as_str().unwrap_or("").to_string(),
            flows: serde_json::from_value(e["flows"].clone()).unwrap(),
            ends_flows: serde_json::from_value(e["ends_flows"].clone()).unwrap(),
            notes: e["notes"].clone(),
        };
        match e["type"].as_str().unwrap() {
            "TYPE_SLICE_BEGIN" => {
                let s = slice();
                stack.push(s);
            }
            "TYPE_INSTANT" => done.push(slice()),
            "TYPE_SLICE_END" => {
                let mut s = stack.pop().unwrap_or_else(|| {
                    panic!("an END at {ts} on track {track} with no open slice")
                });
                s.end = ts;
                done.push(s);
            }
            other => panic!("unexpected track event type {other}"),
        }
    }
    for (track, s) in open {
        assert!(s.is_empty(), "track {track}: slices never ended: {s:?}");
    }
    done.sort_by_key(|s| (s.track, s.start, s.depth));
    done
}

/// tid -> (track uuid, pid, name) from the thread track descriptors.
fn thread_tracks(t: &Value) -> BTreeMap<u64, (u64, u64, String)> {
    t["tracks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| !d["tid"].is_null())
        .map(|d| {
            (
                d["tid"].as_u64().unwrap(),
                (
                    d["uuid"].as_u64().unwrap(),
                    d["pid"].as_u64().unwrap(),
                    d["name"].as_str().unwrap().to_string(),
                ),
            )
        })
        .collect()
}

/// The leaf name of a sample's callstack, following every interned id.
fn sample_leaf(t: &Value, sample: &Value) -> Result<String, String> {
    let cs = sample["callstack"].as_u64().unwrap();
    let frames = t["callstacks"][cs.to_string()]
        .as_array()
        .ok_or(format!("callstack {cs} not interned"))?;
    let mut leaf = None;
    for f in frames {
        let name_id = t["frames"][f.as_u64().unwrap().to_string()]
            .as_u64()
            .ok_or(format!("frame {f} of callstack {cs} not interned"))?;
        leaf = Some(
            t["names"][name_id.to_string()]
                .as_str()
                .ok_or(format!("function name {name_id} not interned"))?
                .to_string(),
        );
    }
    leaf.ok_or(format!("callstack {cs} is empty"))
}

fn check_against(c: &mut Checks, t: &Value, rec: &Recording) {
    c.check(t["clocks"] == serde_json::json!([3]), || {
        format!(
            "want one clock snapshot making MONOTONIC (3) primary: {}",
            t["clocks"]
        )
    });
    c.check(t["packet_clocks"] == serde_json::json!([3]), || {
        format!("every packet should name clock 3: {}", t["packet_clocks"])
    });
    let threads = thread_tracks(t);
    let process = t["tracks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["tid"].is_null())
        .cloned()
        .unwrap_or_default();
    c.check(
        process["pid"].as_u64() == Some(rec.pid as u64) && process["name"] == rec.comm.as_str(),
        || {
            format!(
                "process track {process}, want pid {} ({})",
                rec.pid, rec.comm
            )
        },
    );
    let all = slices(t);
    let top: Vec<&Slice> = all.iter().filter(|s| s.cat == "stall").collect();
    c.check(top.len() == rec.stalls.len(), || {
        format!("{} stall slices for {} stalls", top.len(), rec.stalls.len())
    });
    let samples = t["samples"].as_array().unwrap();
    let frame_label = |f: &stallprof::model::Frame| match f.kind {
        stallprof::model::FrameKind::Kernel => format!("{} [k]", f.label()),
        _ => f.label(),
    };
    for (i, s) in rec.stalls.iter().enumerate() {
        let who = format!(
            "stall {i} (tid {}, {} ns at {})",
            s.tid, s.duration_ns, s.start_ns
        );
        let Some((track, pid, name)) = threads.get(&(s.tid as u64)) else {
            c.fail(format!("{who}: no thread track for tid {}", s.tid));
            continue;
        };
        c.check(*pid == rec.pid as u64 && *name == s.thread_name, || {
            format!(
                "{who}: thread track pid {pid} name {name:?}, want {} {:?}",
                rec.pid, s.thread_name
            )
        });
        let found: Vec<&&Slice> = top
            .iter()
            .filter(|x| x.track == *track && x.notes["stall"].as_u64() == Some(i as u64))
            .collect();
        let [slice] = found[..] else {
            c.fail(format!(
                "{who}: {} slices annotated stall={i}, want 1",
                found.len()
            ));
            continue;
        };
        c.check(
            slice.depth == 0 && slice.start == s.start_ns && slice.end == s.end_ns,
            || {
                format!(
                    "{who}: slice at depth {} [{}, {}]",
                    slice.depth, slice.start, slice.end
                )
            },
        );
        let culprit = aggregate::stall_culprit(s, &rec.app()).unwrap_or_else(|| "stall".into());
        c.check(slice.name == culprit, || {
            format!(
                "{who}: named {:?}, want the summary's culprit {culprit:?}",
                slice.name
            )
        });
        c.check(
            slice.notes["task"].as_str() == s.coroutine.as_deref(),
            || {
                format!(
                    "{who}: task {}, want {:?}",
                    slice.notes["task"], s.coroutine
                )
            },
        );
        // Children: inside the stall, end to end, covering it exactly.
        let kids: Vec<&Slice> = all
            .iter()
            .filter(|x| {
                x.track == *track && x.depth == 1 && x.start >= s.start_ns && x.end <= s.end_ns
            })
            .collect();
        let covered: u64 = kids.iter().map(|k| k.end - k.start).sum();
        c.check(covered == s.duration_ns, || {
            format!(
                "{who}: child slices cover {covered} ns of {}",
                s.duration_ns
            )
        });
        let want: BTreeSet<String> = s
            .stacks
            .iter()
            .filter(|p| p.weight_ns > 0)
            // The part's own words (`woken from epoll_wait, waiting for
            // a CPU` for a part woken from the park).
            .map(|p| p.kind_text())
            .collect();
        let got: BTreeSet<String> = kids
            .iter()
            .map(|k| {
                let name = k
                    .name
                    .split_once(" (held by")
                    .map_or(k.name.as_str(), |(n, _)| n);
                name.split_once(" (quota")
                    .map_or(name, |(n, _)| n)
                    .to_string()
            })
            .collect();
        c.check(got == want, || {
            format!("{who}: child slices {got:?}, want {want:?}")
        });
        // Samples: on this thread, inside the stall, leaves = the parts' leaves.
        let mine: Vec<&Value> = samples
            .iter()
            .filter(|x| {
                x["tid"].as_u64() == Some(s.tid as u64)
                    && (s.start_ns..s.end_ns).contains(&x["ts"].as_u64().unwrap())
            })
            .collect();
        let mut leaves = BTreeSet::new();
        for x in &mine {
            match sample_leaf(t, x) {
                Ok(l) => {
                    leaves.insert(l);
                }
                Err(e) => c.fail(format!("{who}: {e}")),
            }
        }
        let want_leaves: BTreeSet<String> = s
            .stacks
            .iter()
            .filter(|p| p.weight_ns > 0)
            .map(|p| {
                p.frames
                    .last()
                    .map(frame_label)
                    .unwrap_or_else(|| "[unknown]".into())
            })
            .collect();
        c.check(!mine.is_empty() && leaves == want_leaves, || {
            format!(
                "{who}: {} samples with leaves {leaves:?}, want {want_leaves:?}",
                mine.len()
            )
        });
    }
    let outside = samples
        .iter()
        .filter(|x| {
            let ts = x["ts"].as_u64().unwrap();
            !rec.stalls.iter().any(|s| {
                s.tid as u64 == x["tid"].as_u64().unwrap() && (s.start_ns..s.end_ns).contains(&ts)
            })
        })
        .count();
    c.check(outside == 0, || {
        format!("{outside} samples outside every stall of their thread")
    });
}

/// `record` (or `--pid`) of a Python victim; the recording directory.
fn record(dir: &Scratch, python: &Path, args: &[&std::ffi::OsStr], threshold: &str) -> PathBuf {
    let out = dir.join("out");
    let mut argv: Vec<&std::ffi::OsStr> = vec![
        "record".as_ref(),
        "--threshold".as_ref(),
        threshold.as_ref(),
        "-o".as_ref(),
        out.as_os_str(),
        "--".as_ref(),
        python.as_os_str(),
    ];
    argv.extend_from_slice(args);
    let run = run_stallprof(&argv, Duration::from_secs(120));
    assert!(
        run.status.success(),
        "stallprof record failed:\n{}",
        run.describe()
    );
    for f in ["stalls.json", "stalls.pftrace"] {
        assert!(
            out.join(f).exists(),
            "no {f} in {}:\n{}",
            out.display(),
            run.describe()
        );
    }
    out
}

#[test]
fn gateway_trace_matches_stalls_json() {
    if !require_root_and_bpf("gateway_trace_matches_stalls_json") {
        return;
    }
    let python = require_python(3, 11);
    let _serial = serial();
    let dir = Scratch::new("gateway_trace_matches_stalls_json");
    let gateway = Path::new(env!("CARGO_MANIFEST_DIR")).join("../demo/gateway.py");
    let out = record(&dir, &python, &[gateway.as_os_str(), "6".as_ref()], "20ms");
    let rec = report::read_json(&out).unwrap_or_else(|e| panic!("reading stalls.json: {e}"));
    assert!(
        rec.stalls.len() >= 5,
        "the gateway stalls about four times a second; {} stalls",
        rec.stalls.len()
    );
    let t = decode(&python, &out.join("stalls.pftrace"));
    let mut c = Checks::new(stalls_table_of(&rec));
    check_against(&mut c, &t, &rec);
    c.check(rec.stalls.iter().any(|s| s.coroutine.is_some()), || {
        "no stall names its asyncio task: the task annotation went unchecked".into()
    });
    c.finish();

    // `report` re-renders the same trace from stalls.json.
    let again = dir.join("again");
    let run = run_stallprof(
        &[
            "report".as_ref(),
            out.as_os_str(),
            "-o".as_ref(),
            again.as_os_str(),
        ],
        Duration::from_secs(60),
    );
    assert!(
        run.status.success(),
        "stallprof report failed:\n{}",
        run.describe()
    );
    assert!(
        std::fs::read(again.join("stalls.pftrace")).unwrap()
            == std::fs::read(out.join("stalls.pftrace")).unwrap(),
        "report wrote another stalls.pftrace from the same stalls.json"
    );
}

#[test]
fn gil_trace_has_flows_to_the_holder() {
    if !require_root_and_bpf("gil_trace_has_flows_to_the_holder") {
        return;
    }
    let python = require_python(3, 11);
    let _serial = serial();
    let dir = Scratch::new("gil_trace_has_flows_to_the_holder");
    let script = victims_dir().join("py_gil.py");
    let log = dir.join("victim.jsonl");
    let out = record(
        &dir,
        &python,
        &[script.as_os_str(), log.as_os_str()],
        "40ms",
    );
    let entries = read_log(&log);
    let ready = entries
        .iter()
        .find(|r| r["kind"] == "ready")
        .expect("no ready record");
    let hog_tid = ready["hog_tid"].as_u64().unwrap();
    let rec = report::read_json(&out).unwrap_or_else(|e| panic!("reading stalls.json: {e}"));
    let t = decode(&python, &out.join("stalls.pftrace"));
    let mut c = Checks::new(stalls_table_of(&rec));
    check_against(&mut c, &t, &rec);

    let threads = thread_tracks(&t);
    let hog = threads.get(&hog_tid);
    c.check(hog.is_some_and(|h| h.2 == "gil-hog"), || {
        format!("no thread track for the holder gil-hog (tid {hog_tid}): {threads:?}")
    });
    let all = slices(&t);
    let waits: Vec<&Slice> = all
        .iter()
        .filter(|s| s.name.starts_with("GIL wait (held by gil-hog"))
        .collect();
    c.check(!waits.is_empty(), || {
        "no GIL-wait child slice names gil-hog".into()
    });
    for w in &waits {
        let ends: Vec<&Slice> = all
            .iter()
            .filter(|s| w.flows.iter().any(|f| s.ends_flows.contains(f)))
            .collect();
        c.check(
            w.flows.len() == 1
                && ends.len() == 1
                && Some(ends[0].track) == hog.map(|h| h.0)
                && ends[0].start == w.start
                && ends[0].name.starts_with("holds the GIL: hog"),
            || format!("GIL wait at {} (flows {:?}) should lead to one 'holds the GIL: hog' on gil-hog's track: {ends:?}", w.start, w.flows),
        );
    }
    c.finish();
}

fn stalls_table_of(rec: &Recording) -> String {
    rec.stalls
        .iter()
        .enumerate()
        .map(|(i, s)| {
            format!(
                "  {i}: tid {} [{}, {}] {} parts, culprit {:?}",
                s.tid,
                s.start_ns,
                s.end_ns,
                s.stacks.len(),
                aggregate::stall_culprit(s, &rec.app())
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
