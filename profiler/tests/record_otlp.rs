//! Issue 36 item 3, root integration tests: stalls exported as spans over
//! OTLP to a real receiver, installed by the README's test command from
//! PyPI (target/asgi-venv, pinned): oteltap for http/protobuf (it prints
//! each span it receives as JSON) and rotel, an OTLP collector, for grpc
//! (its debug log prints each span). The target is the FastAPI service
//! instrumented with OpenTelemetry (`py_fastapi.py --otel`), which logs the
//! trace and span ids its SDK reported for each blocking call.
//!
//! Checked:
//! - http/protobuf: the receiver gets one span per stall of stalls.json,
//!   each as long as its stall, each stall that ran in a request's span
//!   linked to that span (the ids the victim logged), and the summary
//!   says how many went where;
//! - grpc, the receiver killed mid-recording: every handler call still has
//!   its stall in stalls.json (the local outputs are complete), the spans
//!   the receiver logged before it died are linked to the SDK's ids, and
//!   the spans that did not go are counted (`otlp_spans_failed`, in
//!   `drops` and the summary), exported + failed = the stalls.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const THRESHOLD: &str = "20ms";
const THRESHOLD_NS: u64 = 20 * MS;
/// What rotel's detailed debug log prints for each stall span.
const ROTEL_STALL_SPAN: &str = "Name           : event loop stall";

fn venv_bin(python: &Path) -> PathBuf {
    python.parent().unwrap().to_path_buf()
}

/// The victim's calls: (trace_id, span_id) of each, in log order.
fn sdk_spans(log: &Path) -> Vec<(String, String)> {
    call_fields(&read_log(log), &["trace_id", "span_id"])
        .into_iter()
        .map(|f| (f[0].clone(), f[1].clone()))
        .collect()
}

fn victim_cmd(python: &Path, log: &Path, rounds: &str) -> Vec<std::ffi::OsString> {
    vec![
        "env".into(),
        "OTEL_SERVICE_NAME=fastapi-otel-victim".into(),
        python.into(),
        victims_dir().join("py_fastapi.py").into(),
        log.into(),
        "--otel".into(),
        "--rounds".into(),
        rounds.into(),
    ]
}

/// `otlp: N stall spans exported to URL (PROTOCOL)[; M failed (why)…]`.
fn export_line(stdout: &str) -> Option<(u64, u64)> {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("otlp: "))?;
    let exported = line.trim_start()["otlp: ".len()..]
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    let failed = match line.split_once("; ") {
        Some((_, rest)) => rest.split(' ').next()?.parse().ok()?,
        None => 0,
    };
    Some((exported, failed))
}

#[test]
fn otlp_http_spans_reach_the_collector_linked_to_the_requests() {
    let test = "otlp_http_spans_reach_the_collector_linked_to_the_requests";
    if !require_root_and_bpf(test) {
        return;
    }
    let python = asgi_python();
    let _serial = serial();
    let dir = Scratch::new(test);
    let tap = Oteltap::start(&dir.path);
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");
    let endpoint = tap.endpoint();
    // 7 rounds of 3 calls: the 95% bar then allows one stall whose span
    // could not be verified (a read that came after the stall's end).
    let cmd = victim_cmd(&python, &log, "7");
    let argv: Vec<&std::ffi::OsStr> = cmd.iter().map(|a| a.as_os_str()).collect();
    let run = record_ok(
        None,
        THRESHOLD,
        &["--otlp-endpoint", &endpoint],
        &out,
        &argv,
        Duration::from_secs(120),
    );
    let spans = tap.stop_stall_spans(Duration::from_millis(500));
    let contract = load_recording(&out);
    let raw = read_stalls_json(&out.join("stalls.json"));
    let mut c = Checks::new(format!(
        "{}\nsummary:\n{}\nreceived {} spans",
        stalls_table(&contract),
        run.stdout,
        spans.len()
    ));
    check_contract(&mut c, &contract, THRESHOLD_NS);
    let stalls = raw["stalls"].as_array().cloned().unwrap_or_default();
    c.check(spans.len() == stalls.len(), || {
        format!(
            "the collector received {} stall spans, stalls.json has {} stalls",
            spans.len(),
            stalls.len()
        )
    });
    c.check(
        export_line(&run.stdout) == Some((stalls.len() as u64, 0)),
        || {
            format!(
                "the summary's otlp line says {:?}",
                export_line(&run.stdout)
            )
        },
    );
    // Each stall's span: as long as the stall; linked to its request's span.
    let num = |v: &serde_json::Value| {
        v.as_str()
            .and_then(|s| s.parse::<u64>().ok())
            .or_else(|| v.as_u64())
            .unwrap_or(0)
    };
    let mut durations: Vec<u64> = spans
        .iter()
        .map(|s| num(&s["endTimeUnixNano"]) - num(&s["startTimeUnixNano"]))
        .collect();
    let mut want: Vec<u64> = stalls
        .iter()
        .map(|s| s["duration_ns"].as_u64().unwrap_or(0))
        .collect();
    durations.sort();
    want.sort();
    c.check(durations == want, || {
        format!("span durations {durations:?}, stall durations {want:?}")
    });
    let sdk = sdk_spans(&log);
    let linked = |trace: &str, span: &str| {
        spans.iter().any(|s| {
            s["links"].as_array().is_some_and(|l| {
                l.iter()
                    .any(|l| l["traceId"] == trace && l["spanId"] == span)
            })
        })
    };
    let mut traced = 0;
    for s in &stalls {
        let t = &s["task"]["trace"];
        let (Some(trace), Some(span)) = (t["trace_id"].as_str(), t["span_id"].as_str()) else {
            continue;
        };
        traced += 1;
        c.check(sdk.iter().any(|(a, b)| a == trace && b == span), || {
            format!("stall's span {trace}/{span} is none the SDK reported")
        });
        c.check(linked(trace, span), || {
            format!("no span received links to the stalled request's span {trace}/{span}")
        });
    }
    c.check(traced * 100 >= sdk.len() * 95, || {
        format!(
            "{traced} stalls carry a span, the victim made {} calls",
            sdk.len()
        )
    });
    c.finish();
}

#[test]
fn otlp_grpc_collector_stopped_mid_recording_loses_nothing_local() {
    let test = "otlp_grpc_collector_stopped_mid_recording_loses_nothing_local";
    if !require_root_and_bpf(test) {
        return;
    }
    let python = asgi_python();
    let _serial = serial();
    let dir = Scratch::new(test);
    let (grpc, http) = (free_port(), free_port());
    let received = dir.join("rotel.log");
    let rotel = venv_bin(&python).join("../lib/python3.11/site-packages/rotel/rotel-agent");
    assert!(
        rotel.exists(),
        "{} is missing: run `cargo xtask setup --tests` (it installs rotel, pinned)",
        rotel.display()
    );
    let mut collector = Command::new(&rotel)
        .args([
            "start",
            "--otlp-grpc-endpoint",
            &format!("127.0.0.1:{grpc}"),
            "--otlp-http-endpoint",
            &format!("127.0.0.1:{http}"),
            "--exporter",
            "blackhole",
            "--debug-log",
            "traces",
            "--debug-log-verbosity",
            "detailed",
        ])
        .stdout(std::fs::File::create(&received).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting rotel");
    wait_listening(grpc, &mut collector, "rotel");
    let log = dir.join("victim.jsonl");
    let out = dir.join("out");
    let endpoint = format!("http://127.0.0.1:{grpc}");
    // The collector dies after the victim's 4th blocking call, once it
    // has logged a stall's span (a span goes when its stall is finished,
    // symbols and all: on a busy machine, a second or more after the call).
    let killer = {
        let log = log.clone();
        let received = received.clone();
        let mut collector = collector;
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(90) {
                let calls = std::fs::File::open(&log)
                    .map(|f| {
                        BufReader::new(f)
                            .lines()
                            .map_while(Result::ok)
                            .filter(|l| l.contains("\"start_ns\""))
                            .count()
                    })
                    .unwrap_or(0);
                let spans = std::fs::read_to_string(&received)
                    .unwrap_or_default()
                    .matches(ROTEL_STALL_SPAN)
                    .count();
                if calls >= 4 && spans >= 1 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = collector.kill();
            let _ = collector.wait();
        })
    };
    let cmd = victim_cmd(&python, &log, "4");
    let argv: Vec<&std::ffi::OsStr> = cmd.iter().map(|a| a.as_os_str()).collect();
    let run = record_ok(
        None,
        THRESHOLD,
        &["--otlp-endpoint", &endpoint, "--otlp-protocol", "grpc"],
        &out,
        &argv,
        Duration::from_secs(120),
    );
    killer.join().unwrap();
    let contract = load_recording(&out);
    let raw = read_stalls_json(&out.join("stalls.json"));
    let text = std::fs::read_to_string(&received).unwrap_or_default();
    let got = text.matches(ROTEL_STALL_SPAN).count() as u64;
    let mut c = Checks::new(format!(
        "{}\nsummary:\n{}\nrotel logged {got} stall spans",
        stalls_table(&contract),
        run.stdout
    ));
    check_contract(&mut c, &contract, THRESHOLD_NS);
    // Every call of the victim has its stall on disk.
    let calls = read_log(&log)
        .into_iter()
        .filter(|r| r["start_ns"].is_u64())
        .collect::<Vec<_>>();
    c.check(calls.len() >= 12, || {
        format!("the victim logged {} calls, want 12", calls.len())
    });
    for r in &calls {
        let (t0, t1) = (num(r, "start_ns"), num(r, "end_ns"));
        let n = contract
            .stalls
            .iter()
            .filter(|s| s.start_ns < t1 && t0 < s.end_ns)
            .count();
        c.check(n == 1, || {
            format!(
                "{} [{t0}..{t1}]: {n} stalls in stalls.json, want 1",
                r["func"]
            )
        });
    }
    let stalls = raw["stalls"].as_array().map_or(0, |v| v.len()) as u64;
    let said = export_line(&run.stdout);
    c.check(
        said.is_some_and(|(e, f)| e + f == stalls && f >= 1 && e == got),
        || {
            format!(
                "the summary's otlp line says {said:?} (exported, failed); {stalls} stalls, the \
                 collector logged {got} before it was stopped"
            )
        },
    );
    let failed = contract
        .drops
        .get("otlp_spans_failed")
        .copied()
        .unwrap_or(0);
    c.check(
        said.is_some_and(|(_, f)| f == failed) && failed >= 1,
        || format!("drops otlp_spans_failed={failed}, the summary says {said:?}"),
    );
    c.check(run.stdout.contains("otlp_spans_failed="), || {
        "the summary does not count the failed exports".into()
    });
    // What the collector got before it died is linked to the SDK's spans.
    let sdk = sdk_spans(&log);
    let links: Vec<(&str, &str)> = text
        .split("SpanLink #")
        .skip(1)
        .filter_map(|b| {
            let trace = b.split("-> Trace ID: ").nth(1)?.lines().next()?.trim();
            let span = b.split("-> ID: ").nth(1)?.lines().next()?.trim();
            Some((trace, span))
        })
        .collect();
    c.check(!links.is_empty(), || {
        "no span the collector logged has a link".into()
    });
    for (t, s) in &links {
        c.check(sdk.iter().any(|(a, b)| a == t && b == s), || {
            format!("a link to {t}/{s}, which the SDK never reported")
        });
    }
    c.check(
        text.contains("service.name: Str(fastapi-otel-victim)"),
        || "the spans' resource is not named by the victim's OTEL_SERVICE_NAME".into(),
    );
    c.finish();
}
