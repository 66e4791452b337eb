//! Issue 19, root integration test: Node on real code. tests/victims/express
//! is an express 5 service (an ES module importing CommonJS and ESM npm
//! packages, installed at the versions its package-lock.json pins by `cargo
//! xtask test`'s setup into target/express-victim), started with no Node
//! flags, whose handlers block the loop in different ways: `hashPassword`
//! (bcryptjs: pure-JS CPU in a library's hot, optimized code),
//! `parseConfig` (js-yaml: pure-JS CPU over many library functions),
//! `compressReport` (zlib.gzipSync: native code under node:zlib's
//! JavaScript) and `waitForLock` (Atomics.wait: off-CPU in a futex). A
//! client process drives the requests; the victim logs CLOCK_MONOTONIC
//! (process.hrtime.bigint) first and last thing in each handler.
//!
//! Checked, against the victim's own log:
//! - each handler call is one stall whose culprit (the summary's text with
//!   the most of its time) is the handler itself, `hashPassword (app.js:N)
//!   → bcryptjs … hashSync — on-CPU`: the app's function, not node_modules
//!   or `node:` internals; its entry point is the handler;
//! - the share of the stall blamed on the handler is within 5 points of the
//!   share the victim's clock gives the call;
//! - every handler appears by its own name among the summary's top culprit
//!   lines and its entry points;
//! - each handler call's stall carries the route express matched, as the
//!   victim logs it (`req.method`, `req.baseUrl + req.route.path`: `GET
//!   /api/report/:period` for a request of `/api/report/daily` through a
//!   router mounted on `/api`), in stalls.json and under the summary's by
//!   route, and no stall that served a request lacks its route (issue 36);
//! - JavaScript frames are read: `[js: unreadable]` frames (and the
//!   `js_frames_unreadable` counter) ≤ 1% of the JavaScript frames of the
//!   recording's stacks, and no more than 1% of the handlers' stall time
//!   sits on stacks whose JavaScript was left unnamed (V8's interpreter
//!   trampolines or `[anon]` JIT code with no JavaScript frame inner to
//!   them, as under libuv's `uv__read` when the unwinder stopped early).

//!
//! `record_express_traced_says_its_trace_is_not_read` (issue 36): the same
//! service's `traced.cjs`, instrumented with OpenTelemetry, whose trace
//! context stallprof does not read from Node: said and counted, never
//! guessed (see the test).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use stallprof::report;

const THRESHOLD: &str = "20ms";
const THRESHOLD_NS: u64 = 20 * MS;
/// Most unreadable JavaScript frames, in percent of all JavaScript frames.
const UNREADABLE_PCT: f64 = 1.0;
const APP: HandlerApp = HandlerApp {
    label: "express",
    file: "app.js",
    handlers: &[
        "hashPassword",
        "parseConfig",
        "compressReport",
        "waitForLock",
    ],
    // Measured share vs the victim's own share.
    share_points: 5.0,
};
const NODE: &str = "/usr/bin/node";

/// The victim's packages as `cargo xtask test` installs them (xtask/src/
/// main.rs `express_victim`).
fn express_node_modules() -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/express-victim/node_modules");
    assert!(
        dir.join("express/package.json").exists(),
        "{} is missing: run the tests with `cargo xtask test` (its setup installs express, \
         bcryptjs and js-yaml, pinned by tests/victims/express/package-lock.json, with `npm ci`), \
         or `cargo xtask setup --tests`",
        dir.display()
    );
    dir
}

/// The victim as deployed: its scripts and package.json in a directory of
/// their own, its packages in `node_modules` beside them.
fn deploy_victim(dir: &Path) -> PathBuf {
    let app = dir.join("app");
    std::fs::create_dir_all(&app).unwrap();
    let src = victims_dir().join("express");
    for f in ["app.js", "traced.cjs", "client.js", "package.json"] {
        std::fs::copy(src.join(f), app.join(f))
            .unwrap_or_else(|e| panic!("copying {f} of {}: {e}", src.display()));
    }
    std::os::unix::fs::symlink(express_node_modules(), app.join("node_modules")).unwrap();
    app
}

/// A recording of one of the victim's scripts, deployed in a scratch
/// directory of its own (kept there when the test fails).
struct Recorded {
    _dir: Scratch,
    run: RunOutput,
    log: PathBuf,
    out: PathBuf,
}

/// Deploy the victim and record `node SCRIPT LOG` with no Node flags.
fn record_victim(test: &str, script: &str) -> Recorded {
    assert!(
        Path::new(NODE).exists(),
        "{NODE} is missing: this test needs Node 20 there (`cargo xtask setup --tests` installs it)"
    );
    let dir = Scratch::new(test);
    let app_dir = deploy_victim(&dir.path);
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");
    let run = record_ok(
        Some(&app_dir),
        THRESHOLD,
        &[],
        &out,
        &[NODE.as_ref(), script.as_ref(), log.as_os_str()],
        Duration::from_secs(120),
    );
    Recorded {
        _dir: dir,
        run,
        log,
        out,
    }
}

/// Is frame `i` of a stack (outermost first) JavaScript code V8 runs, left
/// unnamed: the interpreter's trampoline, or anonymous JIT code — except
/// the regular-expression code a builtin with no script (`exec`) runs,
/// native code in anonymous memory that no JavaScript frame stands for.
fn unnamed_js(frames: &[Frame], i: usize) -> bool {
    let f = &frames[i];
    let regexp = i > 0 && frames[i - 1].kind == "js" && frames[i - 1].file.is_none();
    f.kind == "native"
        && ((f.name == "[anon]" && !regexp)
            || f.name.starts_with("Builtins_InterpreterEntryTrampoline"))
}

#[test]
fn record_express_culprits_are_the_apps_handlers() {
    let test = "record_express_culprits_are_the_apps_handlers";
    if !require_root_and_bpf(test) {
        return;
    }
    let _serial = serial();
    let Recorded {
        _dir,
        run,
        log,
        out,
    } = record_victim(test, "app.js");
    let (entries, truth) = APP.truth(&log, THRESHOLD_NS);

    let rec = report::read_json(&out).unwrap_or_else(|e| panic!("reading stalls.json: {e}"));
    let raw = read_stalls_json(&out.join("stalls.json"));
    let contract = load_recording(&out);
    let mut c = Checks::new(format!(
        "{}\n{}\nsummary:\n{}",
        truth_table(&truth),
        stalls_table(&contract),
        run.stdout
    ));
    check_contract(&mut c, &contract, THRESHOLD_NS);
    // Node maps its C library: the host-wide syscall tracepoints are no
    // fallback it needs (its first look once landed between the kernel
    // mapping its image and its loader).
    let (_, waits) = expected_probes();
    c.check(contract.probes["waits"] == waits, || {
        format!(
            "waits probed by {}, want {waits}: a fallback taxes every process on the host",
            contract.probes["waits"]
        )
    });

    APP.check_calls_and_routes(&mut c, &entries, &truth, &rec, &raw, &run.stdout);
    check_no_route_misses(&mut c, &rec, &truth);
    APP.check_summary(&mut c, &run.stdout);

    // JavaScript frames read: per stack part, as the outputs show them.
    let (mut js, mut unreadable) = (0u64, 0u64);
    let mut by_file: BTreeMap<String, u64> = BTreeMap::new();
    for s in &contract.stalls {
        for p in &s.stacks {
            for f in &p.frames {
                if f.kind == "js" {
                    js += 1;
                    let file = f.file.as_deref().unwrap_or("?");
                    let key = match file.rfind("/node_modules/") {
                        Some(i) => file[i + 14..].split('/').next().unwrap_or("?").to_string(),
                        None if file.starts_with("node:") => "node:".into(),
                        None => file.rsplit('/').next().unwrap_or(file).to_string(),
                    };
                    *by_file.entry(key).or_default() += 1;
                } else if f.name == "[js: unreadable]" {
                    unreadable += 1;
                }
            }
        }
    }
    let counter = contract
        .drops
        .get("js_frames_unreadable")
        .copied()
        .unwrap_or(0);
    let all = js + unreadable;
    let pct = |n: u64| 100.0 * n as f64 / all.max(1) as f64;
    println!(
        "JS express: {all} JavaScript frames in the stacks, {unreadable} unreadable ({:.2}%), \
         js_frames_unreadable={counter}; frames by script: {by_file:?}",
        pct(unreadable)
    );
    c.check(js > 0 && pct(unreadable) <= UNREADABLE_PCT, || {
        format!(
            "{unreadable} of {all} JavaScript frames unreadable ({:.2}%), want ≤ {UNREADABLE_PCT}%",
            pct(unreadable)
        )
    });
    c.check(pct(counter) <= UNREADABLE_PCT, || {
        format!(
            "js_frames_unreadable={counter}: {:.2}% of the {all} JavaScript frames, want ≤ {UNREADABLE_PCT}%",
            pct(counter)
        )
    });
    // Handlers' stall time on stacks whose JavaScript was left unnamed: JS
    // code (trampoline, JIT) with no JavaScript frame at or inner to it.
    let (mut total, mut unnamed) = (0u64, 0u64);
    let mut worst: BTreeMap<String, u64> = BTreeMap::new();
    for t in &truth {
        for s in overlapping(&contract, t) {
            for p in &s.stacks {
                total += p.weight_ns;
                let last_js = p.frames.iter().rposition(|f| f.kind == "js");
                let first_unnamed = (0..p.frames.len())
                    .rev()
                    .find(|&i| unnamed_js(&p.frames, i));
                if first_unnamed.is_some_and(|u| last_js.is_none_or(|j| u > j)) {
                    unnamed += p.weight_ns;
                    let tail: Vec<&str> = p
                        .frames
                        .iter()
                        .rev()
                        .take(6)
                        .map(|f| f.name.as_str())
                        .collect();
                    *worst.entry(tail.join(" < ")).or_default() += p.weight_ns;
                }
            }
        }
    }
    let unnamed_pct = 100.0 * unnamed as f64 / total.max(1) as f64;
    println!("JS express: {unnamed_pct:.2}% of the handlers' stall time with JavaScript unnamed");
    c.check(unnamed_pct <= UNREADABLE_PCT, || {
        let mut w: Vec<_> = worst.into_iter().collect();
        w.sort_by_key(|(_, ns)| std::cmp::Reverse(*ns));
        format!(
            "{unnamed_pct:.2}% of the handlers' stall time on stacks whose JavaScript is unnamed \
             (want ≤ {UNREADABLE_PCT}%); heaviest (innermost first): {:#?}",
            w.iter()
                .take(5)
                .map(|(k, ns)| format!("{:.1} ms {k}", ms(*ns)))
                .collect::<Vec<_>>()
        )
    });
    c.finish();
}

/// Issue 36: a Node service traced with OpenTelemetry the usual way
/// (tests/victims/express/traced.cjs: the SDK's tracer provider, the http
/// and express instrumentations, no Node flag), whose handler blocks in
/// `crypto.pbkdf2Sync` inside its request's span. stallprof reads no
/// trace context from a Node process (its AsyncLocalStorage lives where
/// V8's metadata does not say): checked that it says so and guesses
/// nothing, against the span ids the victim's own SDK logs:
/// - each call is one stall whose culprit and entry are the handler, with
///   the route express matched (`GET /digest/:n`);
/// - the victim saw a span active in every call (the instrumentation is
///   live), and no stall carries a trace id;
/// - every such stall is counted (`otel_span_unsupported`), and the
///   summary says why, once, for the process.
#[test]
fn record_express_traced_says_its_trace_is_not_read() {
    let test = "record_express_traced_says_its_trace_is_not_read";
    if !require_root_and_bpf(test) {
        return;
    }
    const TRACED: HandlerApp = HandlerApp {
        label: "express-otel",
        file: "traced.cjs",
        handlers: &["digest"],
        share_points: 5.0,
    };
    let _serial = serial();
    let Recorded {
        _dir,
        run,
        log,
        out,
    } = record_victim(test, "traced.cjs");
    let (entries, truth) = TRACED.truth(&log, THRESHOLD_NS);
    let rec = report::read_json(&out).unwrap_or_else(|e| panic!("reading stalls.json: {e}"));
    let raw = read_stalls_json(&out.join("stalls.json"));
    let mut c = Checks::new(format!("{}\nsummary:\n{}", truth_table(&truth), run.stdout));
    TRACED.check_calls_and_routes(&mut c, &entries, &truth, &rec, &raw, &run.stdout);
    check_no_route_misses(&mut c, &rec, &truth);
    TRACED.check_summary(&mut c, &run.stdout);
    let spans = call_fields(&entries, &["trace_id", "span_id"]);
    c.check(
        spans.iter().all(|s| s[0].len() == 32 && s[1].len() == 16),
        || format!("the victim's SDK had no active span in some call: {spans:?}"),
    );
    let traced: Vec<String> = rec
        .stalls
        .iter()
        .filter_map(|s| Some(s.trace()?.trace_id.clone()))
        .collect();
    c.check(traced.is_empty(), || {
        format!("stalls of a Node process carry trace ids it cannot have read: {traced:?}")
    });
    let counted = rec.drops.get("otel_span_unsupported").copied().unwrap_or(0);
    c.check(counted >= truth.len() as u64, || {
        format!(
            "otel_span_unsupported={counted}, want at least the {} traced calls' stalls",
            truth.len()
        )
    });
    let said: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| l.contains("OpenTelemetry trace ids not read"))
        .collect();
    c.check(said.len() == 1, || {
        format!("the summary should say once that the trace context is not read: {said:?}")
    });
    c.check(run.stdout.contains("AsyncLocalStorage"), || {
        "the summary does not say why (AsyncLocalStorage)".into()
    });
    c.finish();
}
