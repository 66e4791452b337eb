//! Tier 2: golden tests. A recording saved by `record --save-events` (the
//! raw kernel records before unwinding, what the unwinder read, every
//! symbol answer) is replayed through the whole engine — decode, unwind,
//! stall assembly, symbolization — and aggregated; the folded output must
//! equal `expected.folded`, the `stalls.folded` that the live recording
//! wrote. So replay is checked to be the live pipeline, unwinding included.
//!
//! A case is made by recording a victim (see docs/testing.md, "Golden
//! recordings") with `--native all --lines` (the comparison is of every
//! frame, with its line and full name; the default view drops interpreter
//! frames and the loop's root, lines and generic arguments) and copying
//! `events.bin.gz`, `unwind.json.gz`, `symbols.json` and `stalls.folded`
//! (as `expected.folded`) here. The cases were recorded when an asyncio
//! recording's `stalls.folded` topped each stack with a `[task NAME]`
//! marker, from reads of the live process that the saved recording does
//! not keep: those were taken out of `expected.folded` (whose lines then
//! sort as the replay's do).
use std::{fs, path::PathBuf};

use stallprof::{assemble::stall::TrackerConfig, pipeline::replay, report::aggregate};

fn case(name: &str, threshold_ns: u64) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let stalls = replay::replay(
        &dir,
        TrackerConfig {
            threshold_ns,
            tids: None,
        },
        None,
    )
    .unwrap();
    assert!(!stalls.is_empty(), "{name}: no stalls replayed");
    for s in &stalls {
        assert_eq!(
            s.on_cpu_ns + s.off_cpu_ns + s.runqueue_ns,
            s.duration_ns,
            "{name}: time split of {s:?}"
        );
        assert_eq!(
            s.stacks.iter().map(|p| p.weight_ns).sum::<u64>(),
            s.duration_ns,
            "{name}: stack weights"
        );
        assert!(s.duration_ns >= threshold_ns);
    }
    let mut got = aggregate::folded_lines(&stalls).join("\n");
    got.push('\n');
    let expected = fs::read_to_string(dir.join("expected.folded")).unwrap();
    if got != expected {
        let out = std::env::temp_dir().join(format!("golden-{name}.folded"));
        fs::write(&out, &got).unwrap();
        panic!(
            "{name}: the replayed folded output differs from the live recording's \
             (replayed: {}; diff it against {})",
            out.display(),
            dir.join("expected.folded").display()
        );
    }
}

/// The C epoll victim: spin, nanosleep and pipe stalls, unwound from the
/// copied stacks by `.eh_frame` (built with frame pointers, which the
/// unwinder does not need).
#[test]
fn golden_c_loop() {
    case("c_loop", 40_000_000);
}

/// An asyncio victim on CPython: Python frames merged with native ones.
#[test]
fn golden_python_blocking_client() {
    case("py_blocking_client", 40_000_000);
}

/// The replay unwinds: without the recording's unwind bundle the same
/// records give other stacks (frame-pointer junk on this CPython).
#[test]
fn golden_replay_unwinds() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/py_blocking_client");
    let dir = std::env::temp_dir().join(format!("golden-no-unwind-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    for f in ["events.bin.gz", "symbols.json"] {
        fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut empty = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut empty, br#"{"maps":{},"files":{}}"#).unwrap();
    fs::write(dir.join("unwind.json.gz"), empty.finish().unwrap()).unwrap();
    let cfg = TrackerConfig {
        threshold_ns: 40_000_000,
        tids: None,
    };
    let stalls = replay::replay(&dir, cfg, None).unwrap();
    let _ = fs::remove_dir_all(&dir);
    let mut got = aggregate::folded_lines(&stalls).join("\n");
    got.push('\n');
    assert_ne!(
        got,
        fs::read_to_string(src.join("expected.folded")).unwrap()
    );
}
