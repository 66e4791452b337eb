//! `stalls.json` versions (docs/format.md), no root needed: a recording
//! written in version 1 (tests/fixtures/v1-c_loop: a real c_loop recording
//! made by stallprof before version 2, three stalls: spin, sleep, pipe) is
//! read by `stallprof report`, every output is re-rendered from it, and the
//! stalls.json it writes is version 2 holding the same recording.
mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use stallprof::{model::Recording, report};

fn fixture() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1-c_loop/stalls.json")
}

#[test]
fn report_reads_version_1_and_writes_version_2() {
    let dir = Scratch::new("format-v1");
    let v1 = report::read_json(&fixture()).unwrap_or_else(|e| panic!("reading the fixture: {e}"));
    assert_eq!(v1.stalls.len(), 3, "the fixture holds spin, sleep and pipe");
    let old_raw: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture()).unwrap()).unwrap();
    assert!(
        old_raw.get("format").is_none() && old_raw["stalls"][0]["stacks"][0]["frames"].is_array(),
        "the fixture must stay in the version-1 layout"
    );

    let input = dir.join("in");
    std::fs::create_dir_all(&input).unwrap();
    std::fs::copy(fixture(), input.join("stalls.json")).unwrap();
    let out = dir.join("out");
    let run = run_stallprof(
        &[
            "report".as_ref(),
            input.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
        ],
        Duration::from_secs(60),
    );
    assert!(
        run.status.success(),
        "report of a version-1 recording failed:\n{}",
        run.describe()
    );
    assert!(run.stdout.contains("3 stalls"), "{}", run.describe());
    for f in [
        "stalls.json",
        "stalls.folded",
        "stalls.svg",
        "stalls.pb.gz",
        "stalls.pftrace",
        "stalls.speedscope.json",
    ] {
        let len = std::fs::metadata(out.join(f)).map(|m| m.len()).unwrap_or(0);
        assert!(len > 0, "report wrote no {f}:\n{}", run.describe());
    }

    let new_raw: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("stalls.json")).unwrap()).unwrap();
    assert_eq!(new_raw["format"], "stallprof-recording");
    assert_eq!(new_raw["version"], report::json::VERSION);
    let v2 = report::read_json(&out).unwrap();
    assert_eq!(
        v2, v1,
        "version 2 written by report holds another recording"
    );
    // The schema as docs/format.md states it, expanded by the tests' own
    // reader, gives the same recording too.
    let expanded: Recording =
        serde_json::from_value(read_stalls_json(&out.join("stalls.json"))).unwrap();
    assert_eq!(expanded, v1);

    let (total_us, _, _) = folded_total_us(&out.join("stalls.folded"));
    let want_us = v1.total_stall_ns() / 1000;
    assert!(
        total_us.abs_diff(want_us) <= 50,
        "stalls.folded holds {total_us} us, the recording {want_us} us"
    );
}

#[test]
fn a_newer_version_is_refused_by_name() {
    let dir = Scratch::new("format-newer");
    let mut v: serde_json::Value = serde_json::from_slice(&report::json::to_vec(
        &report::read_json(&fixture()).unwrap(),
    ))
    .unwrap();
    let newer = report::json::VERSION + 1;
    v["version"] = newer.into();
    std::fs::write(dir.join("stalls.json"), serde_json::to_vec(&v).unwrap()).unwrap();
    let run = run_stallprof(
        &["report".as_ref(), dir.path.as_os_str()],
        Duration::from_secs(60),
    );
    assert_eq!(run.status.code(), Some(1), "{}", run.describe());
    assert!(
        run.stderr.contains(&format!("format version {newer}")) && run.stderr.contains("newer"),
        "{}",
        run.describe()
    );
}
