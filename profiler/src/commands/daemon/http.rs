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
//!
//! The server itself — connection limits and timeouts, the accept loop,
//! files streamed from beneath a directory's descriptor — is
//! [`crate::commands::web`], which `report --serve` shares; what a hostile
//! client can cost is said there (docs/security.md). `/reports/` opens only
//! regular files three plain names beneath the data directory, never
//! through a symlink.
use std::{
    fmt::Write as _,
    fs::File,
    io::{self, Read as _},
    path::Path,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, Result};
use hyper::{Request, StatusCode, header};
use rustix::fs::{Mode, OFlags, openat};
use tokio::sync::watch;

use super::Shared;
use super::config::{HttpConfig, Listen};
use crate::{
    commands::web::{self, Listener, Resp, resp, text},
    model::text::html as html_escape,
    os::clock::monotonic_ns,
    os::outdir::OutDir,
    os::units::fmt_ns,
    report::aggregate,
    report::pprof,
};

/// What the HTTP side needs besides the collector's state.
pub struct Settings {
    pub http: HttpConfig,
    /// The bearer token, when `http.token_file` is set.
    pub token: Option<Vec<u8>>,
    /// The data directory, opened once: `/reports/` reads beneath it only.
    pub data: OutDir,
}

/// Binds the daemon's `listen`: TCP, or a Unix socket 0600 (0660 in
/// `group`).
pub async fn bind(listen: &Listen, group: Option<u32>) -> Result<Listener> {
    match listen {
        Listen::Tcp(addr) => {
            Listener::tcp(
                *addr,
                "(another stallprof daemon?) choose another with --listen",
            )
            .await
        }
        Listen::Unix(path) => Listener::unix(path, group),
    }
}

/// Serves the daemon's pages on `listener` until `stop` changes.
pub async fn serve(
    listener: Listener,
    shared: Arc<Shared>,
    settings: Arc<Settings>,
    stop: watch::Receiver<bool>,
) {
    let limits = web::Limits {
        max_connections: settings.http.max_connections,
        header_timeout: settings.http.header_timeout,
        idle_timeout: settings.http.idle_timeout,
    };
    let handler = move |req| handle(req, shared.clone(), settings.clone());
    web::serve(listener, limits, handler, stop).await
}

/// Reads the bearer token: the file must be root's and readable by no one
/// else (a token others can read protects nothing).
pub fn read_token(path: &Path) -> Result<Vec<u8>> {
    use std::os::unix::fs::MetadataExt;
    let fd = openat(
        rustix::fs::CWD,
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .map_err(io::Error::from)
    .with_context(|| {
        format!(
            "http.token_file: cannot open {} (a symlink is refused)",
            path.display()
        )
    })?;
    let mut f = File::from(fd);
    let m = f.metadata()?;
    if !m.is_file() || m.uid() != 0 || m.mode() & 0o077 != 0 {
        anyhow::bail!(
            "http.token_file {}: must be a regular file owned by root with mode 0600 or 0400 (found uid {}, mode {:o}): chown root and chmod 600 it",
            path.display(),
            m.uid(),
            m.mode() & 0o7777
        );
    }
    let mut text = String::new();
    f.by_ref().take(4096).read_to_string(&mut text)?;
    let token = text.trim();
    if token.len() < 16 {
        anyhow::bail!(
            "http.token_file {}: the token is shorter than 16 characters: write a long random one (e.g. `head -c 32 /dev/urandom | base64`)",
            path.display()
        );
    }
    Ok(token.as_bytes().to_vec())
}

/// Equal in time independent of where they differ (the length is not secret).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// How long after a profile's interval the collector may still be handing
/// over stalls that ended in it (it drains every 100 ms).
const COLLECT_LAG: Duration = Duration::from_millis(400);
const MAX_PROFILE_SECONDS: u64 = 300;

fn query(req: &Request<hyper::body::Incoming>, key: &str) -> Option<String> {
    req.uri().query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == key).then(|| v.to_string())
    })
}

async fn handle(req: Request<hyper::body::Incoming>, sh: Arc<Shared>, st: Arc<Settings>) -> Resp {
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
    }
    let path = req.uri().path().to_string();
    if let Some(token) = &st.token
        && path != "/healthz"
    {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
        if !given.is_some_and(|g| ct_eq(g, token)) {
            let mut r = text(
                StatusCode::UNAUTHORIZED,
                "this daemon requires a token: send Authorization: Bearer <the contents of http.token_file>\n",
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer realm=\"stallprof\""),
            );
            return r;
        }
    }
    match path.as_str() {
        "/metrics" => resp(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            sh.metrics.encode(),
        ),
        "/debug/pprof/profile" | "/debug/pprof/stalls" => profile(&req, &sh).await,
        "/" | "/index.html" => resp(StatusCode::OK, "text/html; charset=utf-8", index(&sh)),
        "/healthz" => text(StatusCode::OK, "ok\n"),
        p if p.starts_with("/reports/") => report_file(&st.data, &p["/reports/".len()..]),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /, /metrics or /debug/pprof/profile?seconds=10\n",
        ),
    }
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
                    process: None,
                },
                &*r.stall,
            )
        }),
        time_nanos,
        duration,
        &sh.app,
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

fn report_file(data: &OutDir, rel: &str) -> Resp {
    let rel = Path::new(rel);
    let report = matches!(
        rel.extension().and_then(|e| e.to_str()),
        Some("svg" | "json" | "folded" | "gz" | "pftrace")
    );
    if !report || rel.components().count() != 3 {
        return text(
            StatusCode::NOT_FOUND,
            "no such report
",
        );
    }
    web::file_beneath(
        data.dir_fd(),
        rel,
        "no such report (retention may have removed it)\n",
    )
}

/// The service groups among the processes (`services`): each with its
/// workers' stalls together, then each worker's. Nothing when no process
/// shares its parent and cgroup with another.
fn services_table(h: &mut String, procs: &[super::ProcRow]) {
    let rows: Vec<(u32, u32, &str, &str)> = procs
        .iter()
        .map(|p| {
            let i = &p.info;
            (i.pid, i.ppid, i.cgroup.as_str(), i.exe.as_str())
        })
        .collect();
    let groups = super::services::services(&rows);
    if groups.is_empty() {
        return;
    }
    h.push_str(
        "<h2>Services</h2><table><tr><th>service</th><th>cgroup</th><th>stalls</th><th>stall time</th>\
         <th>per worker: pid (comm) stalls, stall time</th></tr>",
    );
    for g in groups {
        let workers: Vec<&super::ProcRow> = procs
            .iter()
            .filter(|p| g.has(p.info.pid, p.info.ppid, &p.info.cgroup, &p.info.exe))
            .collect();
        let parent_comm = workers
            .iter()
            .map(|w| w.info.parent_comm.as_str())
            .find(|c| !c.is_empty())
            .unwrap_or("");
        let each: Vec<String> = workers
            .iter()
            .map(|w| {
                format!(
                    "{} ({}){}: {}, {}",
                    w.info.pid,
                    html_escape(&w.info.comm),
                    if w.exited { " exited" } else { "" },
                    w.stalls,
                    fmt_ns(w.stall_ns)
                )
            })
            .collect();
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            html_escape(&g.name(parent_comm)),
            html_escape(&g.cgroup),
            workers.iter().map(|w| w.stalls).sum::<u64>(),
            fmt_ns(workers.iter().map(|w| w.stall_ns).sum()),
            each.join("<br>")
        );
    }
    h.push_str("</table>");
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
    services_table(&mut h, &idx.procs);
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
            html_escape(&match p.info.pod() {
                "" => p.info.container().to_string(),
                pod => format!("{} (pod {pod})", p.info.container()),
            }),
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
            let who = aggregate::culprit_name(p, &sh.app);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(ct_eq(b"abcdef0123456789", b"abcdef0123456789"));
        assert!(!ct_eq(b"abcdef0123456789", b"abcdef0123456788"));
        assert!(!ct_eq(b"abc", b"abcd"));
    }
}
