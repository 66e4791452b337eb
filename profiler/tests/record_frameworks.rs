//! Issue 19, root integration test: answers in the app's terms on a real
//! framework with real packages. tests/victims/py_fastapi.py is a FastAPI
//! service on uvicorn[standard] (uvloop + httptools), installed from PyPI
//! at pinned versions by `cargo xtask test`'s setup (target/asgi-venv, a
//! CPython 3.11 venv), whose async handlers block the loop through real
//! libraries: `parse_resume` (pypdf parsing a PDF: pure-Python CPU),
//! `fetch_profile` (`requests`, sync, to a slow server on 127.0.0.1) and
//! `nap` (time.sleep). The victim logs CLOCK_MONOTONIC around each call.
//!
//! Checked, against the victim's own log:
//! - each handler call is one stall, whose culprit (the summary's text with
//!   the most of its time) is the handler itself, `parse_resume
//!   (py_fastapi.py:N) → pypdf … PageObject.extract_text — on-CPU`, and
//!   whose entry point (stalls.json `entry`) is the handler;
//! - the share of the stall blamed on the handler is within 5 points of
//!   the share the victim's clock gives the call;
//! - every handler appears by its own name among the summary's top culprit
//!   lines and under `by entry point`;
//! - each handler's stall carries the request's route (issue 19 item 2),
//!   the method and route template the victim logs it served
//!   (`request.method`, `request.scope["route"].path`): in the model, in
//!   stalls.json's `route`, as the `route` label of the pprof samples of
//!   that handler (read with pprof-format), and under the summary's `by
//!   route`;
//! - the default view (stalls.folded) of this uvloop service starts at the
//!   app's code: every stack through a handler starts with it, and no
//!   default-view stack holds uvloop's dispatch (`uv_run`, `Handle__run`,
//!   `run_forever`), which `--native all` does hold.
//!
//! And the span of the thread's own context in plain asyncio callbacks
//! (`record_callback_stalls_carry_the_threads_span`:
//! tests/victims/py_callback_spans.py, the OpenTelemetry SDK, no task).
//!
//! And the route on the host's other CPythons, without packages
//! (`asgi_routes_pyenv_*`: tests/victims/py_asgi_routes.py, the shapes of
//! uvicorn and Starlette in the standard library; pyrecord `check_routes`;
//! the sandbox's 3.13-3.15 in record_container.rs `routes::*`).

mod common;
mod pyrecord;

use std::time::Duration;

use common::*;
use stallprof::report;

const THRESHOLD: &str = "20ms";
const THRESHOLD_NS: u64 = 20 * MS;
const APP: HandlerApp = HandlerApp {
    label: "fastapi-uvloop",
    file: "py_fastapi.py",
    handlers: &["parse_resume", "fetch_profile", "nap"],
    // Measured share vs the victim's own share.
    share_points: 5.0,
};

/// A handler app's recording, read back and checked against the contract.
struct AppRecording {
    dir: Scratch,
    run: RunOutput,
    out: std::path::PathBuf,
    entries: Vec<serde_json::Value>,
    truth: Vec<Truth>,
    rec: stallprof::model::Recording,
    raw: serde_json::Value,
    checks: Checks,
    /// Recordings one at a time (tests/common `serial`).
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// Record `script` (with `args` after its log path) under the test venv's
/// Python, until it exits; its log and truth per `app`. None (the test
/// skipped) without root and BPF.
fn record_app(test: &str, app: &HandlerApp, script: &str, args: &[&str]) -> Option<AppRecording> {
    if !require_root_and_bpf(test) {
        return None;
    }
    let _serial = serial();
    let python = asgi_python();
    let dir = Scratch::new(test);
    let script = victims_dir().join(script);
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");
    let mut cmd: Vec<&std::ffi::OsStr> =
        vec![python.as_os_str(), script.as_os_str(), log.as_os_str()];
    cmd.extend(args.iter().map(std::ffi::OsStr::new));
    let run = record_ok(None, THRESHOLD, &[], &out, &cmd, Duration::from_secs(120));
    let (entries, truth) = app.truth(&log, THRESHOLD_NS);
    let rec = report::read_json(&out).unwrap_or_else(|e| panic!("reading stalls.json: {e}"));
    let raw = read_stalls_json(&out.join("stalls.json"));
    let contract = load_recording(&out);
    let mut checks = Checks::new(format!(
        "{}\n{}\nsummary:\n{}",
        truth_table(&truth),
        stalls_table(&contract),
        run.stdout
    ));
    check_contract(&mut checks, &contract, THRESHOLD_NS);
    Some(AppRecording {
        dir,
        run,
        out,
        entries,
        truth,
        rec,
        raw,
        checks,
        _serial,
    })
}

#[test]
fn record_fastapi_uvloop_culprits_are_the_apps_handlers() {
    let test = "record_fastapi_uvloop_culprits_are_the_apps_handlers";
    let Some(AppRecording {
        dir,
        run,
        out,
        entries,
        truth,
        rec,
        raw,
        checks: mut c,
        ..
    }) = record_app(test, &APP, "py_fastapi.py", &[])
    else {
        return;
    };
    // Each call's stall and its route, as the victim served it.
    let handler_routes =
        APP.check_calls_and_routes(&mut c, &entries, &truth, &rec, &raw, &run.stdout);
    // The summary: every handler by its own name among the top culprits
    // and the entry points.
    APP.check_summary(&mut c, &run.stdout);
    // pprof: every sample of a handler's stall is labelled with its route.
    let prof = read_pprof(&dir.path, &out.join("stalls.pb.gz"));
    for (func, route) in &handler_routes {
        let entry = format!("{func} (py_fastapi.py)");
        let samples: Vec<&serde_json::Value> = prof["samples"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter(|s| s["labels"]["entry"] == entry.as_str())
                    .collect()
            })
            .unwrap_or_default();
        c.check(!samples.is_empty(), || {
            format!("no pprof sample with entry {entry:?}")
        });
        let wrong: Vec<&serde_json::Value> = samples
            .iter()
            .filter(|s| s["labels"]["route"] != route.as_str())
            .copied()
            .collect();
        c.check(wrong.is_empty(), || {
            format!(
                "{} of {} pprof samples of {func} lack the route label {route:?}: first {}",
                wrong.len(),
                samples.len(),
                wrong[0]["labels"]
            )
        });
    }
    // The default view starts at the app's code.
    let folded = std::fs::read_to_string(out.join("stalls.folded")).unwrap();
    let dispatch = ["uv_run", "Handle__run", "run_forever", "Handle._run"];
    let mut through_handler = 0;
    for line in folded.lines() {
        let stack = line.rsplit_once(' ').map_or(line, |(s, _)| s);
        let frames: Vec<&str> = stack.split(';').collect();
        if let Some(i) = frames.iter().position(|f| {
            APP.handlers
                .iter()
                .any(|h| f.starts_with(&format!("{h} (py_fastapi.py")))
        }) {
            through_handler += 1;
            c.check(i == 0, || {
                format!("a default-view stack through a handler does not start with it: {stack}")
            });
        }
        c.check(!dispatch.iter().any(|d| stack.contains(d)), || {
            format!("uvloop's dispatch left in the default view: {stack}")
        });
    }
    c.check(through_handler > 0, || {
        "no default-view stack through a handler".into()
    });
    let all = {
        let dst = dir.join("all");
        let r = run_stallprof(
            &[
                "report".as_ref(),
                out.as_os_str(),
                "--native".as_ref(),
                "all".as_ref(),
                "-o".as_ref(),
                dst.as_os_str(),
            ],
            Duration::from_secs(60),
        );
        assert!(r.status.success(), "report --native all: {}", r.describe());
        std::fs::read_to_string(dst.join("stalls.folded")).unwrap()
    };
    c.check(
        all.contains("uv_run") && all.contains("Handle__run"),
        || "--native all shows no uvloop dispatch: was the victim really on uvloop?".into(),
    );
    c.finish();
}

/// Issue 36 item 2: the same service instrumented with OpenTelemetry the
/// usual way (`py_fastapi.py --otel`: the SDK's TracerProvider and batch
/// processor, opentelemetry-instrumentation-fastapi's server span per
/// request, a child span around `nap`'s sleep). Each handler call's stall
/// carries the trace id and span id the service's own SDK reported for
/// that step (the victim logs them): at least 95% of the calls, none
/// wrong; as stalls.json `task.trace`, as the pprof samples' `trace_id`
/// and `span_id` labels, and in the summary's traced stalls.
#[test]
fn record_fastapi_otel_stalls_carry_their_spans() {
    let test = "record_fastapi_otel_stalls_carry_their_spans";
    let Some(AppRecording {
        dir,
        run,
        out,
        entries,
        truth,
        rec,
        raw,
        checks: mut c,
        ..
    }) = record_app(test, &APP, "py_fastapi.py", &["--otel", "--rounds", "7"])
    else {
        return;
    };
    // The span each call ran in, as the SDK reported it (python_truth's order).
    let spans = call_fields(&entries, &["trace_id", "span_id"]);
    assert_eq!(spans.len(), truth.len());
    let prof = read_pprof(&dir.path, &out.join("stalls.pb.gz"));
    let mut matched = 0;
    for (t, ids) in truth.iter().zip(&spans) {
        let (trace_id, span_id) = (&ids[0], &ids[1]);
        let Some((index, s)) = APP.check_call(&mut c, &rec, &raw, t) else {
            continue;
        };
        let who = t.who();
        let got = s.task.as_ref().and_then(|t| t.trace.as_ref());
        let want = (trace_id.as_str(), span_id.as_str());
        match got {
            Some(ids) if (ids.trace_id.as_str(), ids.span_id.as_str()) == want => matched += 1,
            Some(ids) => c.fail(format!(
                "{who}: the stall's span is {}/{}, the SDK reported {trace_id}/{span_id}",
                ids.trace_id, ids.span_id
            )),
            None => c.add_context(&format!("{who}: no span read (task {:?})", s.task)),
        }
        let wire = &raw["stalls"][index]["task"]["trace"];
        if got.is_some() {
            c.check(
                wire["trace_id"] == trace_id.as_str() && wire["span_id"] == span_id.as_str(),
                || format!("{who}: stalls.json task.trace {wire}, want {trace_id}/{span_id}"),
            );
            check_pprof_labelled(&mut c, &who, &prof, &ids[..]);
        }
    }
    let need = (truth.len() * 95).div_ceil(100);
    c.check(matched >= need, || {
        format!(
            "{matched} of {} calls' stalls carry the SDK's span, want at least {need} (95%)",
            truth.len()
        )
    });
    // (nap's stalls are checked against the child span the victim opened
    // around its sleep, not the request's server span.)
    check_summary_traced(&mut c, &run.stdout, &spans);
    c.finish();
}

/// A stall's pprof samples carry its span's labels, `ids` = [trace id,
/// span id] as the victim logged them.
fn check_pprof_labelled(c: &mut Checks, who: &str, prof: &serde_json::Value, ids: &[String]) {
    let labelled = prof["samples"].as_array().is_some_and(|v| {
        v.iter().any(|p| {
            p["labels"]["trace_id"] == ids[0].as_str() && p["labels"]["span_id"] == ids[1].as_str()
        })
    });
    c.check(labelled, || {
        format!(
            "{who}: no pprof sample labelled trace_id={} span_id={}",
            ids[0], ids[1]
        )
    });
}

/// The summary's traced stalls name at least one of the victim's `spans`.
fn check_summary_traced(c: &mut Checks, stdout: &str, spans: &[Vec<String>]) {
    let traced = summary_section(stdout, "traced stalls (");
    c.check(
        traced.iter().any(|l| {
            spans
                .iter()
                .any(|ids| l.contains(&format!("trace {} span {}", ids[0], ids[1])))
        }),
        || format!("the summary's traced stalls name none of the victim's spans: {traced:#?}"),
    );
}

/// Issue 36, the thread's context when no task runs: tests/victims/
/// py_callback_spans.py, plain asyncio with the OpenTelemetry SDK
/// (target/asgi-venv, pinned), schedules callbacks with `loop.call_soon`
/// from inside `tracer.start_as_current_span(...)` (a `time.sleep` and a
/// CPU loop, 100 ms each) and one outside any span; each logs the span
/// current inside it. Each callback's stall runs no task and carries the
/// trace id and span id the victim logged (at least 95% of the spanned
/// calls, none wrong), from the thread's own context: in the model
/// (`Stall::trace`), stalls.json `thread_context.trace`, the pprof samples'
/// `trace_id`/`span_id` labels and the summary's traced stalls; the
/// spanless callback's stall carries none. `stallprof report` replays the
/// same spans from the recording.
#[test]
fn record_callback_stalls_carry_the_threads_span() {
    let test = "record_callback_stalls_carry_the_threads_span";
    const CALLBACKS: HandlerApp = HandlerApp {
        label: "asyncio-callbacks",
        file: "py_callback_spans.py",
        handlers: &["nap_callback", "crunch_callback", "plain_callback"],
        share_points: 5.0,
    };
    let Some(AppRecording {
        dir,
        run,
        out,
        entries,
        truth,
        rec,
        raw,
        checks: mut c,
        ..
    }) = record_app(test, &CALLBACKS, "py_callback_spans.py", &["--rounds", "8"])
    else {
        return;
    };
    let spans = call_fields(&entries, &["trace_id", "span_id"]);
    assert_eq!(spans.len(), truth.len());
    let prof = read_pprof(&dir.path, &out.join("stalls.pb.gz"));
    let (mut spanned, mut matched) = (0usize, 0usize);
    for (t, ids) in truth.iter().zip(&spans) {
        let (trace_id, span_id) = (&ids[0], &ids[1]);
        let Some((index, s)) = CALLBACKS.check_call(&mut c, &rec, &raw, t) else {
            continue;
        };
        let who = t.who();
        c.check(s.task.is_none(), || {
            format!("{who}: a callback's stall names task {:?}", s.task)
        });
        let wire = &raw["stalls"][index]["thread_context"];
        if trace_id.is_empty() {
            c.check(s.trace().is_none() && wire.is_null(), || {
                format!("{who}: a callback outside any span has span {wire}")
            });
            continue;
        }
        spanned += 1;
        match s.trace() {
            Some(got) if got.trace_id == *trace_id && got.span_id == *span_id => matched += 1,
            Some(got) => c.fail(format!(
                "{who}: the stall's span is {}/{}, the victim's {trace_id}/{span_id}",
                got.trace_id, got.span_id
            )),
            None => c.add_context(&format!("{who}: no span read ({:?})", s.thread_context)),
        }
        if s.trace().is_some() {
            c.check(
                wire["trace"]["trace_id"] == trace_id.as_str()
                    && wire["trace"]["span_id"] == span_id.as_str(),
                || format!("{who}: stalls.json thread_context {wire}, want {trace_id}/{span_id}"),
            );
            check_pprof_labelled(&mut c, &who, &prof, &ids[..]);
        }
    }
    let need = (spanned * 95).div_ceil(100);
    c.check(spanned > 0 && matched >= need, || {
        format!(
            "{matched} of {spanned} spanned callbacks' stalls carry the victim's span, want at \
             least {need} (95%); drops {:?}",
            rec.drops
        )
    });
    check_summary_traced(&mut c, &run.stdout, &spans);
    // Replayed from the recording: the same spans, stall for stall.
    let replay = dir.join("replay");
    let r = run_stallprof(
        &[
            "report".as_ref(),
            out.as_os_str(),
            "-o".as_ref(),
            replay.as_os_str(),
        ],
        Duration::from_secs(60),
    );
    assert!(r.status.success(), "report: {}", r.describe());
    let again = report::read_json(&replay).unwrap_or_else(|e| panic!("the replay: {e}"));
    let traces = |r: &stallprof::model::Recording| -> Vec<(u64, Option<String>)> {
        r.stalls
            .iter()
            .map(|s| (s.start_ns, s.trace().map(|t| t.span_id.clone())))
            .collect()
    };
    c.check(traces(&again) == traces(&rec), || {
        format!(
            "the replay's spans differ:\n{:?}\nrecorded:\n{:?}",
            traces(&again),
            traces(&rec)
        )
    });
    c.finish();
}

/// tests/victims/py_aiohttp.py, an aiohttp service (aiohttp's own server
/// and router, pinned) whose handlers block the loop.
const AIOHTTP: HandlerApp = HandlerApp {
    label: "aiohttp",
    file: "py_aiohttp.py",
    handlers: &["render", "lookup_user", "health"],
    share_points: 5.0,
};

/// Records the aiohttp service (`args`: the victim's options) and checks
/// each handler call's stall and route, and that no call's route was
/// missed; the recording, for more checks.
fn record_aiohttp(test: &str, args: &[&str]) -> Option<AppRecording> {
    let mut r = record_app(test, &AIOHTTP, "py_aiohttp.py", args)?;
    AIOHTTP.check_calls_and_routes(
        &mut r.checks,
        &r.entries,
        &r.truth,
        &r.rec,
        &r.raw,
        &r.run.stdout,
    );
    check_no_route_misses(&mut r.checks, &r.rec, &r.truth);
    Some(r)
}

/// Issue 36 item 1: the route beyond ASGI. The aiohttp service's handlers
/// block the loop (a CPU loop, time.sleep under a dynamic and under a
/// plain resource). Each handler call is one stall whose culprit is the
/// handler, carrying the method and route template aiohttp matched (the
/// victim logs `request.match_info.route.resource.canonical`), in
/// stalls.json and under the summary's by route; no call's route missed.
#[test]
fn record_aiohttp_stalls_carry_their_routes() {
    let Some(AppRecording {
        run, checks: mut c, ..
    }) = record_aiohttp("record_aiohttp_stalls_carry_their_routes", &[])
    else {
        return;
    };
    AIOHTTP.check_summary(&mut c, &run.stdout);
    c.finish();
}

/// The loop thread owns a second thread state: it created a
/// sub-interpreter (CPython's `_xxsubinterpreters`, as a plugin host does)
/// before serving, the same aiohttp service as above. A thread's own state
/// is its oldest; reading the route and queues through the other found
/// nothing for every stall of a CI run, where a thread being started made
/// the second state for a few milliseconds.
#[test]
fn record_aiohttp_loop_with_a_subinterpreter() {
    let Some(AppRecording {
        truth,
        rec,
        checks: mut c,
        ..
    }) = record_aiohttp(
        "record_aiohttp_loop_with_a_subinterpreter",
        &["--subinterpreter"],
    )
    else {
        return;
    };
    // The task and the loop's queues are read through the thread's state
    // too: each handler's stall names its task and says what it held up.
    for t in &truth {
        let Some(s) = rec.stalls.iter().find(|s| t.covers(s)) else {
            continue; // said by check_calls_and_routes
        };
        let who = t.who();
        c.check(s.task.is_some(), || {
            format!("{who}: the stall names no task")
        });
        c.check(
            matches!(s.held_up, Some(stallprof::model::HeldUp::Read(_))),
            || {
                format!(
                    "{who}: what the stall held up was not read: {:?}",
                    s.held_up
                )
            },
        );
    }
    c.finish();
}

#[test]
fn asgi_routes_pyenv_3_10() {
    pyrecord::check_routes("asgi_routes_pyenv_3_10", pyrecord::found_python(10));
}

#[test]
fn asgi_routes_pyenv_3_11() {
    pyrecord::check_routes("asgi_routes_pyenv_3_11", pyrecord::found_python(11));
}

#[test]
fn asgi_routes_pyenv_3_12() {
    pyrecord::check_routes("asgi_routes_pyenv_3_12", pyrecord::found_python(12));
}

#[test]
fn asgi_routes_pyenv_3_13() {
    pyrecord::check_routes("asgi_routes_pyenv_3_13", pyrecord::found_python(13));
}
