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

#[test]
fn record_fastapi_uvloop_culprits_are_the_apps_handlers() {
    let test = "record_fastapi_uvloop_culprits_are_the_apps_handlers";
    if !require_root_and_bpf(test) {
        return;
    }
    let python = asgi_python();
    let _serial = serial();
    let dir = Scratch::new(test);
    let script = victims_dir().join("py_fastapi.py");
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");
    let run = record_ok(
        None,
        THRESHOLD,
        &[],
        &out,
        &[python.as_os_str(), script.as_os_str(), log.as_os_str()],
        Duration::from_secs(120),
    );
    let (entries, truth) = APP.truth(&log, THRESHOLD_NS);
    // What the victim says it served, call for call (python_truth's order).
    let served: Vec<(String, String)> = entries
        .iter()
        .filter(|r| {
            matches!(
                r["kind"].as_str(),
                Some("blocking_client" | "sleep" | "cpu")
            )
        })
        .map(|r| {
            (
                r["method"].as_str().unwrap_or("?").to_string(),
                r["route"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    assert_eq!(served.len(), truth.len());

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

    let mut handler_routes: Vec<(String, String)> = Vec::new();
    for (t, (method, template)) in truth.iter().zip(&served) {
        let want_route = format!("{method} {template}");
        if !handler_routes.iter().any(|h| h.0 == t.func) {
            handler_routes.push((t.func.clone(), want_route.clone()));
        }
        let Some((index, s)) = APP.check_call(&mut c, &rec, &raw, t) else {
            continue;
        };
        let who = t.who();
        // The request's route, as the victim served it.
        let route = s.route.as_ref().map(|r| r.describe());
        c.check(route.as_deref() == Some(want_route.as_str()), || {
            format!("{who}: the stall's route is {route:?}, the victim served {want_route:?}")
        });
        let wire = &raw["stalls"][index]["route"];
        c.check(
            wire["method"] == method.as_str() && wire["template"] == template.as_str(),
            || format!("{who}: stalls.json route {wire}, want {want_route:?}"),
        );
    }

    // The summary: every handler by its own name among the top culprits
    // and the entry points, and its route.
    APP.check_summary(&mut c, &run.stdout);
    let by_route = summary_section(&run.stdout, "by route (");
    for (func, route) in &handler_routes {
        let line = format!("  {route} (");
        c.check(by_route.iter().any(|l| l.contains(&line)), || {
            format!("{func}'s route {route:?} is not under the summary's by route: {by_route:#?}")
        });
    }
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
                .any(|h| f.starts_with(&format!("{h} (py_fastapi.py:")))
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
