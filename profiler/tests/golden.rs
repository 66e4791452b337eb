//! Tier 2: golden tests. A recorded event stream (`record --save-events`)
//! is replayed through stall assembly, symbolization (from the recorded
//! symbol table) and aggregation; the folded output must match the
//! checked-in one exactly. Regenerate with STALLPROF_BLESS=1 after an
//! intended change, and review the diff.
use std::{fs, path::PathBuf};

use stallprof::{aggregate, replay, stall::TrackerConfig};

fn case(name: &str, threshold_ns: u64) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let events = replay::read_events(&dir.join("events.jsonl")).unwrap();
    let mut symbols = replay::read_symbols(&dir.join("symbols.json")).unwrap();
    let stalls = replay::replay(
        events,
        TrackerConfig {
            threshold_ns,
            tids: None,
        },
        &mut symbols,
        None,
    );
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
    let summary = format!(
        "stalls {}\n{}",
        stalls.len(),
        stalls
            .iter()
            .map(|s| format!("{} {} {}\n", s.start_ns, s.duration_ns, s.on_cpu_ns))
            .collect::<String>()
    );
    let expected_path = dir.join("expected.folded");
    let summary_path = dir.join("expected.stalls");
    if std::env::var_os("STALLPROF_BLESS").is_some() {
        fs::write(&expected_path, &got).unwrap();
        fs::write(&summary_path, &summary).unwrap();
        return;
    }
    let expected =
        fs::read_to_string(&expected_path).expect("expected.folded (bless with STALLPROF_BLESS=1)");
    assert_eq!(got, expected, "{name}: folded output changed");
    assert_eq!(
        summary,
        fs::read_to_string(&summary_path).unwrap(),
        "{name}: stall timings changed"
    );
}

/// The C epoll victim: spin, nanosleep and pipe stalls.
#[test]
fn golden_c_loop() {
    case("c_loop", 40_000_000);
}

/// An asyncio victim on CPython 3.11: Python frames merged with native ones.
#[test]
fn golden_python_blocking_client() {
    case("py_blocking_client", 40_000_000);
}
