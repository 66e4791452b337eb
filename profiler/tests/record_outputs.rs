//! What `record` writes and how it exits (issue 14), root integration tests
//! against real victims:
//!
//! - `gateway_stalls_json_round_trips_and_is_20x_smaller`: the demo's own
//!   service (demo/gateway.py, as `cargo xtask demo` runs it: threshold
//!   20 ms) recorded under Debian's python3.11. Its stalls.json is version 2;
//!   stallprof's reader, the tests' own expansion of docs/format.md and a
//!   write-read cycle all give the same recording; the version-1 form of that
//!   recording (whole frames in every part, as stallprof wrote before) reads
//!   back equal, is at least 20x larger, and `report` re-renders every output
//!   from it. The ratio is printed (`--nocapture`) as `SIZE v1 v2 ratio`.
//!   Its stalls.speedscope.json (issue 37) parses, has a profile per loop
//!   thread whose events speedscope would replay (in time order, each close
//!   the frame on top), and its stall frames add up to stalls.json's stall
//!   time within 1 ms.
//! - `gateway_pprof_reads_back_with_labels` (pyenv's 3.11, whose stalls name
//!   their asyncio coroutine): stalls.pb.gz read by DataDog's
//!   `pprof-format` (see tests/common): its total is the recording's stall
//!   time, each stall's samples (label `stall`) total that stall's duration,
//!   every sample carries `kind`, `tid`, `thread`, and `task` (the
//!   coroutine's name, no line) wherever the stall names its coroutine;
//!   issue 37: every frame is named, stacks are in the default view (no
//!   `_start`, no `[task …]` frame), and `culprit_function` is the plain
//!   function `culprit` starts with.
//! - `fail_on_stall_exit_codes`: the C victim with one 60 ms spin: exit 3
//!   with `--fail-on-stall 50ms` and a last line naming the count, the worst
//!   stall and `spin_for_ms`; exit 0 with `--fail-on-stall 200ms` and `gate:
//!   no stall >= 200.0ms`; every output written both times; an error (no such
//!   pid) still exits 1.
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use stallprof::{model::Recording, report};

const OUTPUTS: [&str; 6] = [
    "stalls.json",
    "stalls.folded",
    "stalls.svg",
    "stalls.pb.gz",
    "stalls.pftrace",
    "stalls.speedscope.json",
];

fn assert_outputs(out: &Path, what: &str) {
    for f in OUTPUTS {
        let len = std::fs::metadata(out.join(f)).map(|m| m.len()).unwrap_or(0);
        assert!(len > 0, "{what}: no {f} in {}", out.display());
    }
}

/// A `stalls.speedscope.json`'s profiles and the time its stall frames
/// (each profile's outermost frames) were open, replaying each profile's
/// events as speedscope does: in time order, each close matching the
/// frame on top, nothing left open.
fn speedscope_stalls(path: &Path) -> (usize, u64) {
    let f: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        f["$schema"],
        "https://www.speedscope.app/file-format-schema.json"
    );
    let profiles = f["profiles"].as_array().unwrap();
    let mut total = 0;
    for p in profiles {
        assert_eq!(p["type"], "evented");
        assert_eq!(p["unit"], "nanoseconds");
        let mut stack: Vec<(u64, u64)> = Vec::new();
        let mut last = 0;
        for e in p["events"].as_array().unwrap() {
            let (frame, at) = (e["frame"].as_u64().unwrap(), e["at"].as_u64().unwrap());
            assert!(at >= last, "{}: {e} goes back in time", p["name"]);
            last = at;
            if e["type"] == "O" {
                stack.push((frame, at));
                continue;
            }
            let (open, since) = stack.pop().expect("a close with nothing open");
            assert_eq!(open, frame, "{}: {e} closes a frame not on top", p["name"]);
            if stack.is_empty() {
                total += at - since;
            }
        }
        assert!(stack.is_empty(), "{}: frames left open", p["name"]);
    }
    (profiles.len(), total)
}

/// demo/gateway.py under `py` for `seconds`, with `record --threshold
/// 20ms` as the demo runs it; None when root tests are skipped.
fn record_gateway(
    test: &str,
    py: fn() -> PathBuf,
    seconds: u32,
) -> Option<(Scratch, PathBuf, Recording)> {
    if !require_root_and_bpf(test) {
        return None;
    }
    let py = py();
    let _serial = serial();
    let dir = Scratch::new(test);
    let out = dir.join("out");
    let gateway = Path::new(env!("CARGO_MANIFEST_DIR")).join("../demo/gateway.py");
    let run = run_stallprof(
        &[
            "record".as_ref(),
            "--threshold".as_ref(),
            "20ms".as_ref(),
            "-o".as_ref(),
            out.as_os_str(),
            "--".as_ref(),
            py.as_os_str(),
            gateway.as_os_str(),
            seconds.to_string().as_ref(),
        ],
        Duration::from_secs(120),
    );
    assert!(
        run.status.success(),
        "recording the gateway failed:\n{}",
        run.describe()
    );
    assert_outputs(&out, "record");
    let rec = report::read_json(&out).unwrap_or_else(|e| panic!("reading stalls.json: {e}"));
    assert!(
        rec.stalls.len() >= 5,
        "the gateway stalls about four times a second; {} stalls in {seconds} s:\n{}",
        rec.stalls.len(),
        run.describe()
    );
    Some((dir, out, rec))
}

#[test]
fn gateway_stalls_json_round_trips_and_is_20x_smaller() {
    let Some((dir, out, rec)) = record_gateway(
        "gateway_stalls_json_round_trips_and_is_20x_smaller",
        require_debian_python311,
        8,
    ) else {
        return;
    };
    let written = std::fs::read(out.join("stalls.json")).unwrap();
    let raw: serde_json::Value = serde_json::from_slice(&written).unwrap();
    assert_eq!(raw["format"], "stallprof-recording");
    assert_eq!(raw["version"], report::json::VERSION);

    // Version 2: written again from the model, byte for byte the same file,
    // and read back the same recording.
    let again = report::json::to_vec(&rec);
    assert!(
        again == written,
        "writing the recording read back gives another file"
    );
    assert_eq!(report::json::from_slice(&again).unwrap(), rec);
    // The schema as docs/format.md states it, expanded by the tests.
    let expanded: Recording =
        serde_json::from_value(read_stalls_json(&out.join("stalls.json"))).unwrap();
    assert_eq!(
        expanded, rec,
        "docs/format.md's expansion disagrees with stallprof's reader"
    );

    // stalls.speedscope.json: one evented profile per loop thread whose
    // stall frames (the outermost) add up to stalls.json's stall time.
    let (threads, stall_ns) = speedscope_stalls(&out.join("stalls.speedscope.json"));
    let loop_threads: std::collections::BTreeSet<(u32, u32)> =
        rec.stalls.iter().map(|s| (s.pid, s.tid)).collect();
    assert_eq!(threads, loop_threads.len(), "a profile per loop thread");
    assert!(
        stall_ns.abs_diff(rec.total_stall_ns()) <= 1_000_000,
        "stalls.speedscope.json holds {stall_ns} ns of stalls, stalls.json {} ns",
        rec.total_stall_ns()
    );

    // Version 1, exactly as stallprof wrote it before (pretty-printed
    // serde of the model): read back equal, and the size ratio.
    let v1 = serde_json::to_vec_pretty(&rec).unwrap();
    assert_eq!(report::json::from_slice(&v1).unwrap(), rec);
    let ratio = v1.len() as f64 / written.len() as f64;
    let parts: usize = rec.stalls.iter().map(|s| s.stacks.len()).sum();
    println!(
        "SIZE v1 {} bytes, v2 {} bytes, ratio {ratio:.1} ({} stalls, {parts} parts, {} frames, {} stacks)",
        v1.len(),
        written.len(),
        rec.stalls.len(),
        raw["frames"].as_array().unwrap().len(),
        raw["stacks"].as_array().unwrap().len()
    );
    assert!(
        ratio >= 20.0,
        "stalls.json is only {ratio:.1}x smaller than version 1 ({} vs {} bytes)",
        written.len(),
        v1.len()
    );

    // `report` of the version-1 form re-renders everything from it.
    let old = dir.join("v1");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join("stalls.json"), &v1).unwrap();
    let rendered = dir.join("rendered");
    let run = run_stallprof(
        &[
            "report".as_ref(),
            old.as_os_str(),
            "-o".as_ref(),
            rendered.as_os_str(),
        ],
        Duration::from_secs(120),
    );
    assert!(
        run.status.success(),
        "report of the version-1 form failed:\n{}",
        run.describe()
    );
    assert_outputs(&rendered, "report of version 1");
    assert_eq!(report::read_json(&rendered).unwrap(), rec);
    assert_eq!(
        std::fs::read(rendered.join("stalls.folded")).unwrap(),
        std::fs::read(out.join("stalls.folded")).unwrap(),
        "report of version 1 renders another stalls.folded than record did"
    );
}

#[test]
fn gateway_pprof_reads_back_with_labels() {
    // A pyenv build: its asyncio C module has symbols, so stalls name
    // their task's coroutine (Debian's stripped build does not).
    let Some((dir, out, rec)) = record_gateway(
        "gateway_pprof_reads_back_with_labels",
        || require_python(3, 11),
        4,
    ) else {
        return;
    };
    let prof = read_pprof(&dir.path, &out.join("stalls.pb.gz"));
    assert_eq!(
        prof["sample_types"][0],
        serde_json::json!(["stall", "nanoseconds"])
    );
    let samples = prof["samples"].as_array().unwrap();
    let mut per_stall: BTreeMap<u64, u64> = BTreeMap::new();
    let mut c = Checks::new(format!(
        "{} samples; recording:\n{}",
        samples.len(),
        brief(&rec)
    ));
    for s in samples {
        let l = &s["labels"];
        let value = s["value"][0].as_u64().unwrap();
        let Some(i) = l["stall"].as_u64() else {
            c.fail(format!("a sample without a numeric stall label: {s}"));
            continue;
        };
        *per_stall.entry(i).or_default() += value;
        let Some(stall) = rec.stalls.get(i as usize) else {
            c.fail(format!("stall label {i} of {} stalls", rec.stalls.len()));
            continue;
        };
        c.check(
            matches!(
                l["kind"].as_str(),
                Some("on_cpu" | "off_cpu" | "runqueue" | "gil_wait")
            ),
            || format!("sample kind {}", l["kind"]),
        );
        c.check(l["tid"].as_u64() == Some(stall.tid as u64), || {
            format!("sample of stall {i}: tid {}, want {}", l["tid"], stall.tid)
        });
        c.check(
            l["thread"].as_str() == Some(stall.thread_name.as_str()),
            || {
                format!(
                    "sample of stall {i}: thread {}, want {:?}",
                    l["thread"], stall.thread_name
                )
            },
        );
        // The coroutine's frame label, `Gateway.handle_request
        // (gateway.py:145)`: the task label is its name alone.
        let want_task = stall
            .coroutine
            .as_deref()
            .map(|c| c.split_once(" (").map_or(c, |(name, _)| name));
        c.check(l["task"].as_str() == want_task, || {
            format!(
                "sample of stall {i}: task {}, want {want_task:?} (coroutine {:?})",
                l["task"], stall.coroutine
            )
        });
        let frames: Vec<&str> = s["frames"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap())
            .collect();
        c.check(!frames.is_empty(), || {
            format!("sample of stall {i} without frames")
        });
        c.check(
            frames
                .iter()
                .all(|f| !f.is_empty() && *f != "_start" && !f.starts_with("[task ")),
            || format!("sample of stall {i}: an empty, `_start` or task frame in {frames:?}"),
        );
        let culprit = l["culprit"].as_str().unwrap_or("");
        match l["culprit_function"].as_str() {
            Some(f) => c.check(
                !f.is_empty()
                    && !f.contains(" (")
                    && (culprit == f || culprit.starts_with(&format!("{f} ("))),
                || format!("sample of stall {i}: culprit_function {f:?}, culprit {culprit:?}"),
            ),
            None => c.check(culprit == "[no user frame]", || {
                format!("sample of stall {i}: no culprit_function, culprit {culprit:?}")
            }),
        }
    }
    let total: u64 = per_stall.values().sum();
    c.check(total == rec.total_stall_ns(), || {
        format!(
            "pprof total {total} ns, the recording's stall time {} ns",
            rec.total_stall_ns()
        )
    });
    for (i, s) in rec.stalls.iter().enumerate() {
        let got = per_stall.get(&(i as u64)).copied().unwrap_or(0);
        c.check(got == s.duration_ns, || {
            format!(
                "stall {i}: samples total {got} ns, its duration {} ns",
                s.duration_ns
            )
        });
    }
    c.check(rec.stalls.iter().any(|s| s.coroutine.is_some()), || {
        "no stall names its asyncio coroutine: the task label went untested".into()
    });
    c.finish();
}

fn brief(rec: &Recording) -> String {
    rec.stalls
        .iter()
        .enumerate()
        .map(|(i, s)| {
            format!(
                "  #{i} tid {} {:?} {:.1} ms task {:?}\n",
                s.tid,
                s.thread_name,
                ms(s.duration_ns),
                s.coroutine
            )
        })
        .collect()
}

/// `record --fail-on-stall LIMIT -- c_loop` with one 60 ms spin.
fn gate_run(dir: &Scratch, c_loop: &Path, name: &str, limit: &str) -> (RunOutput, PathBuf) {
    let out = dir.join(name);
    let log = dir.join(&format!("{name}.jsonl"));
    let run = run_stallprof(
        &[
            "record".as_ref(),
            "--threshold".as_ref(),
            "20ms".as_ref(),
            "--fail-on-stall".as_ref(),
            limit.as_ref(),
            "-o".as_ref(),
            out.as_os_str(),
            "--".as_ref(),
            c_loop.as_os_str(),
            log.as_os_str(),
            "--schedule".as_ref(),
            "spin:60".as_ref(),
            "--repeat".as_ref(),
            "1".as_ref(),
        ],
        Duration::from_secs(60),
    );
    assert!(
        read_log(&log).iter().any(|r| r["kind"] == "done"),
        "the victim did not finish:\n{}",
        run.describe()
    );
    (run, out)
}

#[test]
fn fail_on_stall_exit_codes() {
    if !require_root_and_bpf("fail_on_stall_exit_codes") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("fail_on_stall");
    let c_loop = build_c_loop(&dir.path, true);

    let (run, out) = gate_run(&dir, &c_loop, "over", "50ms");
    assert_eq!(
        run.status.code(),
        Some(3),
        "a 60 ms stall >= 50ms:\n{}",
        run.describe()
    );
    assert_outputs(&out, "gate failed");
    let last = run.stdout.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("gate: 1 stall >= 50.0ms (worst 6") && last.contains("spin_for_ms"),
        "last line {last:?}:\n{}",
        run.describe()
    );
    let rec = report::read_json(&out).unwrap();
    assert_eq!(
        rec.stalls
            .iter()
            .filter(|s| s.duration_ns >= 50 * MS)
            .count(),
        1,
        "{}",
        brief(&rec)
    );

    let (run, out) = gate_run(&dir, &c_loop, "under", "200ms");
    assert_eq!(
        run.status.code(),
        Some(0),
        "no stall >= 200ms:\n{}",
        run.describe()
    );
    assert_outputs(&out, "gate passed");
    assert_eq!(
        run.stdout.lines().last(),
        Some("gate: no stall >= 200.0ms"),
        "{}",
        run.describe()
    );

    // An error is not a gate verdict.
    let run = run_stallprof(
        &[
            "record",
            "--fail-on-stall",
            "1ms",
            "--pid",
            &unused_pid().to_string(),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(run.status.code(), Some(1), "{}", run.describe());
}
