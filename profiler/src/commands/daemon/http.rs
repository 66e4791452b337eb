//! The daemon's HTTP side (hyper, HTTP/1.1, one current-thread runtime):
//!
//! - `/metrics`: OpenMetrics text for Prometheus.
//! - `/debug/pprof/profile?seconds=N[&pid=P]` (also `/debug/pprof/stalls`):
//!   the stalls that end during the next N seconds (default 10, like Go's
//!   CPU profile endpoint, which is the shape Parca and Pyroscope scrape with
//!   `delta: true`), as a gzipped pprof; `seconds=0` answers at once with
//!   the recent stalls kept in memory.
//! - `/`: an index page of processes, recent stalls and report links.
//! - `/reports/<window>/<process>/<file>`: the files of the data directory.
//!
//! In: requests and the [`Shared`] state the collector publishes. Out:
//! responses. Reads only; the collector owns every change.
use std::{convert::Infallible, fmt::Write as _, path::Component, sync::Arc, time::Duration};

use http_body_util::Full;
use hyper::{
    Request, Response, StatusCode, body::Bytes, header, server::conn::http1, service::service_fn,
};
use hyper_util::rt::TokioIo;
use log::debug;
use tokio::{net::TcpListener, sync::watch};

use super::Shared;
use crate::{os::clock::monotonic_ns, os::units::fmt_ns, report::aggregate, report::pprof};

/// How long after a profile's interval the collector may still be handing
/// over stalls that ended in it (it drains every 100 ms).
const COLLECT_LAG: Duration = Duration::from_millis(400);
const MAX_PROFILE_SECONDS: u64 = 300;

type Resp = Response<Full<Bytes>>;

fn resp(status: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Resp {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, ctype)
        .body(Full::new(body.into()))
        .expect("static headers are valid")
}

fn text(status: StatusCode, msg: impl Into<String>) -> Resp {
    resp(status, "text/plain; charset=utf-8", msg.into())
}

fn query(req: &Request<hyper::body::Incoming>, key: &str) -> Option<String> {
    req.uri().query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == key).then(|| v.to_string())
    })
}

pub async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else { continue };
                let sh = shared.clone();
                let mut stop_conn = stop.clone();
                tokio::spawn(async move {
                    let conn = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service_fn(move |req| handle(req, sh.clone())));
                    tokio::pin!(conn);
                    tokio::select! {
                        r = conn.as_mut() => if let Err(e) = r { debug!("http connection from {peer}: {e}") },
                        _ = stop_conn.changed() => conn.as_mut().graceful_shutdown(),
                    }
                });
            }
            _ = stop.changed() => break,
        }
    }
}

async fn handle(req: Request<hyper::body::Incoming>, sh: Arc<Shared>) -> Result<Resp, Infallible> {
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n"));
    }
    let path = req.uri().path().to_string();
    Ok(match path.as_str() {
        "/metrics" => resp(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            sh.metrics.encode(),
        ),
        "/debug/pprof/profile" | "/debug/pprof/stalls" => profile(&req, &sh).await,
        "/" | "/index.html" => resp(StatusCode::OK, "text/html; charset=utf-8", index(&sh)),
        "/healthz" => text(StatusCode::OK, "ok\n"),
        p if p.starts_with("/reports/") => report_file(&sh, &p["/reports/".len()..]),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /, /metrics or /debug/pprof/profile?seconds=10\n",
        ),
    })
}

async fn profile(req: &Request<hyper::body::Incoming>, sh: &Shared) -> Resp {
    let seconds = match query(req, "seconds").map(|s| s.parse::<u64>()) {
        None => 10,
        Some(Ok(s)) if s <= MAX_PROFILE_SECONDS => s,
        _ => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("seconds must be a whole number from 0 to {MAX_PROFILE_SECONDS}\n"),
            );
        }
    };
    let pid = match query(req, "pid").map(|s| s.parse::<u32>()) {
        None => None,
        Some(Ok(p)) => Some(p),
        Some(Err(_)) => return text(StatusCode::BAD_REQUEST, "pid must be a process id\n"),
    };
    let wall0 = std::time::SystemTime::now();
    let t0 = monotonic_ns();
    let (from, to) = if seconds == 0 {
        (0, u64::MAX)
    } else {
        tokio::time::sleep(Duration::from_secs(seconds) + COLLECT_LAG).await;
        (t0, t0 + seconds * 1_000_000_000)
    };
    let recent = sh.recent.lock().unwrap_or_else(|p| p.into_inner());
    let picked: Vec<_> = recent
        .q
        .iter()
        .filter(|r| r.stall.end_ns >= from && r.stall.end_ns < to && pid.is_none_or(|p| p == r.pid))
        .collect();
    let time_nanos = if seconds == 0 {
        picked.first().map_or(0, |r| r.wall_ns)
    } else {
        wall0
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0)
    };
    let duration = if seconds == 0 {
        picked.last().map_or(0, |r| r.wall_ns - time_nanos)
    } else {
        (seconds * 1_000_000_000) as i64
    };
    let prof = pprof::profile(
        picked.iter().map(|r| {
            (
                pprof::ProcLabel {
                    pid: r.pid,
                    comm: &r.comm,
                    container: &r.container,
                },
                &*r.stall,
            )
        }),
        time_nanos,
        duration,
    );
    drop(recent);
    let mut r = resp(
        StatusCode::OK,
        "application/octet-stream",
        pprof::encode_gz(&prof),
    );
    r.headers_mut().insert(
        header::CONTENT_DISPOSITION,
        header::HeaderValue::from_static("attachment; filename=\"stalls.pb.gz\""),
    );
    r
}

fn report_file(sh: &Shared, rel: &str) -> Resp {
    let rel = std::path::Path::new(rel);
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) || rel.components().count() != 3
    {
        return text(StatusCode::NOT_FOUND, "no such report\n");
    }
    let path = sh.data_dir.join(rel);
    let ctype = match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => "image/svg+xml",
        Some("json") => "application/json",
        Some("folded") => "text/plain; charset=utf-8",
        Some("gz") => "application/octet-stream",
        _ => return text(StatusCode::NOT_FOUND, "no such report\n"),
    };
    match std::fs::read(&path) {
        Ok(bytes) => resp(StatusCode::OK, ctype, bytes),
        Err(_) => text(
            StatusCode::NOT_FOUND,
            "no such report (retention may have removed it)\n",
        ),
    }
}

pub fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn index(sh: &Shared) -> String {
    let mut h = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>stallprof daemon</title>\
         <style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}\
         td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}th{background:#eee}</style></head><body>\
         <h1>stallprof daemon</h1>",
    );
    let _ = write!(
        h,
        "<p>Stalls: event-loop busy periods of {} or more. <a href=\"/metrics\">metrics</a> · \
         <a href=\"/debug/pprof/stalls?seconds=0\">pprof of recent stalls</a></p>",
        fmt_ns(sh.threshold_ns)
    );
    let idx = sh.index.lock().unwrap_or_else(|p| p.into_inner());
    h.push_str("<h2>Processes</h2><table><tr><th>pid</th><th>comm</th><th>exe</th><th>container</th><th>runtime</th>\
                <th>loop threads</th><th>stalls</th><th>stall time</th><th>state</th><th>latest flamegraph</th></tr>");
    for p in &idx.procs {
        let link = match &p.last_report {
            Some(rel) if sh.data_dir.join(rel).exists() => {
                format!(
                    "<a href=\"/reports/{}\">{}</a>",
                    html_escape(rel),
                    html_escape(rel.split('/').next().unwrap_or(""))
                )
            }
            _ => "-".into(),
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            p.info.pid,
            html_escape(&p.info.comm),
            html_escape(&p.info.exe),
            html_escape(&p.info.container),
            html_escape(&p.info.runtime),
            p.loop_threads,
            p.stalls,
            fmt_ns(p.stall_ns),
            if p.exited { "exited" } else { "live" },
            link
        );
    }
    h.push_str("</table>");
    drop(idx);
    h.push_str("<h2>Recent stalls</h2><table><tr><th>ended (monotonic)</th><th>pid</th><th>comm</th><th>thread</th>\
                <th>duration</th><th>on-CPU</th><th>off-CPU</th><th>run queue</th><th>top culprit</th></tr>");
    let recent = sh.recent.lock().unwrap_or_else(|p| p.into_inner());
    for r in recent.q.iter().rev().take(50) {
        let s = &r.stall;
        let top = s.stacks.iter().max_by_key(|p| p.weight_ns).map(|p| {
            let who = aggregate::culprit(p)
                .map(|f| f.label())
                .unwrap_or_else(|| "[no user frame]".into());
            format!(
                "{who} ({})",
                p.syscall.as_deref().unwrap_or(p.kind.as_str())
            )
        });
        let _ = write!(
            h,
            "<tr><td>{:.3}s</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            s.end_ns as f64 / 1e9,
            r.pid,
            html_escape(&r.comm),
            html_escape(&s.thread_name),
            fmt_ns(s.duration_ns),
            fmt_ns(s.on_cpu_ns),
            fmt_ns(s.off_cpu_ns),
            fmt_ns(s.runqueue_ns),
            html_escape(&top.unwrap_or_default())
        );
    }
    h.push_str("</table></body></html>\n");
    h
}
