//! The engine against a slow or absent symbolizer, over saved symbols.
use super::*;
use crate::kernel::event::RawStack;
use profiler_common::sysno::EPOLL_WAIT;

const MS: u64 = 1_000_000;

fn wait(enter: bool, ts_ms: u64) -> Event {
    if enter {
        Event::WaitEnter {
            tid: 7,
            tgid: 7,
            ts: ts_ms * MS,
            nr: EPOLL_WAIT,
            fd: 3,
        }
    } else {
        Event::WaitExit {
            tid: 7,
            tgid: 7,
            ts: ts_ms * MS,
            nr: EPOLL_WAIT,
            fd: 3,
            ret: 0,
        }
    }
}

/// An engine over saved symbols with `symbolizer`, a 10 ms threshold.
fn saved_engine(symbolizer: Symbolizer, maps: SharedMaps) -> Engine {
    let cfg = TrackerConfig {
        threshold_ns: 10 * MS,
        tids: None,
    };
    Engine::with(
        Kept::new(cfg, symbolizer, maps),
        Symbols::Saved(TableResolver::default()),
        Unwinder::new(),
    )
}

#[test]
fn a_process_forgotten_without_stalls_lets_go_of_its_maps_at_once() {
    // The symbolizer thread never ran (as under a sustained CPU load,
    // at nice 19): a process it never had a stall of must not wait
    // for it to drop its maps snapshot.
    let maps = SharedMaps::default();
    let me = std::process::id();
    maps.refresh(me);
    assert!(maps.holds(me), "no maps snapshot of this process");
    let symbolizer = Symbolizer::threaded(Worker::new(Native::Saved(Box::default()), maps.clone()));
    let mut engine = saved_engine(symbolizer, maps.clone());
    engine.forget(me, &mut NoControl);
    assert!(!maps.holds(me), "the snapshot waited for the symbolizer");
}

/// A symbolizer that takes 200 ms a stall (the first symbolization of a
/// large binary takes seconds) does not hold up the drain: 100 stalls
/// are assembled in far less than the 20 s it would take to name them
/// all, none is lost, and the ones the full queue would not take keep
/// unnamed native frames, counted in `symbolizer_behind`.
#[test]
fn a_slow_symbolizer_does_not_block_the_drain() {
    const STALLS: u64 = 100;
    let mut table = TableResolver::default();
    table.user.insert(
        "0x10".into(),
        vec![crate::model::Frame::new(
            "handler",
            crate::model::FrameKind::Native,
        )],
    );
    let maps = SharedMaps::default();
    let mut symbolizer =
        Symbolizer::threaded(Worker::new(Native::Saved(Box::new(table)), maps.clone()));
    symbolizer.set_delay(std::time::Duration::from_millis(200));
    let mut engine = saved_engine(symbolizer, maps);
    let started = std::time::Instant::now();
    // Two waits on epoll fd 3 make it the loop; then a 30 ms busy period
    // with a sample, every 50 ms.
    for (i, enter) in [(0, true), (1, false), (2, true), (3, false), (4, true)] {
        engine.handle(wait(enter, i), &mut NoControl);
    }
    for i in 0..STALLS {
        let t = 100 + i * 50;
        engine.handle(wait(false, t), &mut NoControl);
        engine.handle(
            Event::Sample {
                tid: 7,
                tgid: 7,
                ts: (t + 15) * MS,
                stack: RawStack {
                    user: vec![0x10],
                    ..RawStack::default()
                },
                task: 0,
            },
            &mut NoControl,
        );
        engine.handle(wait(true, t + 30), &mut NoControl);
        engine.collect();
    }
    let drained = started.elapsed();
    assert!(
        drained < std::time::Duration::from_secs(3),
        "the drain waited for the symbolizer: {drained:?}"
    );
    let behind = engine
        .agent_drops()
        .get("symbolizer_behind")
        .copied()
        .unwrap_or(0);
    assert!(behind > 0, "the queue never filled");
    engine.finish((100 + STALLS * 50) * MS);
    let stalls = engine.take_stalls();
    assert_eq!(stalls.len() as u64, STALLS, "a stall was lost");
    let named = stalls
        .iter()
        .filter(|(_, s)| {
            s.stacks
                .iter()
                .any(|p| p.frames.iter().any(|f| f.name == "handler"))
        })
        .count() as u64;
    let unnamed = stalls
        .iter()
        .filter(|(_, s)| {
            s.stacks
                .iter()
                .any(|p| p.frames.iter().any(|f| f.name == "[unknown 0x10]"))
        })
        .count() as u64;
    assert_eq!(named + unnamed, STALLS);
    assert_eq!(unnamed, behind, "every unnamed stall is counted");
    assert!(
        named >= symbolizer::QUEUE as u64,
        "the symbolizer named {named}"
    );
}
