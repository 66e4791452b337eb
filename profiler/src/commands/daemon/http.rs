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
//! Hostile or broken clients cost a bounded amount (docs/security.md):
//! headers must arrive within `http.header_timeout` (hyper's timeout, which
//! needs the Tokio timer set here), a connection with no request in flight
//! is closed after `http.idle_timeout`, at most `http.max_connections` are
//! served at once (beyond it a new one is closed at once, so the kernel's
//! backlog never fills), `accept` errors back off instead of spinning, report
//! files are streamed in 64 KiB chunks, and `/reports/` opens only regular
//! files beneath the data directory's descriptor, never through a symlink.
use std::{
    convert::Infallible,
    fmt::Write as _,
    fs::File,
    io::{self, Read as _},
    os::fd::{BorrowedFd, OwnedFd},
    path::{Component, Path, PathBuf},
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::{
    Request, Response, StatusCode,
    body::{Bytes, Frame, SizeHint},
    header,
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use log::{debug, warn};
use rustix::fs::{FileType, Mode, OFlags, ResolveFlags, fstat, openat, openat2};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, UnixListener},
    sync::{Semaphore, watch},
};

use super::Shared;
use super::config::{HttpConfig, Listen};
use crate::{
    os::clock::monotonic_ns, os::outdir::OutDir, os::units::fmt_ns, report::aggregate,
    report::pprof,
};

/// A report file is sent in chunks this big; hyper asks for the next one
/// only when the previous one is written, so a slow reader holds one chunk.
const FILE_CHUNK: usize = 64 * 1024;
/// `accept` failing for lack of descriptors or memory is retried after a
/// pause doubling from the first to the last.
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(1));

/// What the HTTP side needs besides the collector's state.
pub struct Settings {
    pub http: HttpConfig,
    /// The bearer token, when `http.token_file` is set.
    pub token: Option<Vec<u8>>,
    /// The data directory, opened once: `/reports/` reads beneath it only.
    pub data: OutDir,
    /// Connections closed at once because `max_connections` were open.
    pub refused: AtomicU64,
}

/// The listening socket: TCP, or a Unix socket removed again on drop.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Binds `listen`. A Unix socket is created 0600 (0660 in `group`): the
    /// umask is narrowed around `bind`, so it is never reachable wider. A
    /// stale socket at the path is replaced; anything else there is refused.
    pub async fn bind(listen: &Listen, group: Option<u32>) -> Result<Listener> {
        match listen {
            Listen::Tcp(addr) => Ok(Listener::Tcp(TcpListener::bind(addr).await.with_context(|| {
                format!("cannot listen on {addr}: is the port in use (another stallprof daemon)? choose another with --listen")
            })?)),
            Listen::Unix(path) => {
                use std::os::unix::fs::{FileTypeExt, PermissionsExt};
                match std::fs::symlink_metadata(path) {
                    Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
                        .with_context(|| format!("cannot remove the stale socket {}", path.display()))?,
                    Ok(_) => anyhow::bail!(
                        "{} exists and is not a socket: remove it or choose another listen = \"unix:PATH\"",
                        path.display()
                    ),
                    Err(_) => {}
                }
                let mode = if group.is_some() { 0o660 } else { 0o600 };
                let old = rustix::process::umask(Mode::from_raw_mode(0o777 & !mode));
                let bound = UnixListener::bind(path);
                rustix::process::umask(old);
                let l = bound.with_context(|| {
                    format!("cannot listen on unix:{}: is its directory there and writable?", path.display())
                })?;
                let owned = Listener::Unix(l, path.clone());
                if let Some(g) = group {
                    std::os::unix::fs::chown(path, None, Some(g))
                        .with_context(|| format!("cannot give {} to the data_group", path.display()))?;
                }
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                    .with_context(|| format!("cannot chmod {}", path.display()))?;
                Ok(owned)
            }
        }
    }

    async fn accept(&self) -> io::Result<Conn> {
        match self {
            Listener::Tcp(l) => l
                .accept()
                .await
                .map(|(s, peer)| Conn::Tcp(s, peer.to_string())),
            Listener::Unix(l, _) => l.accept().await.map(|(s, _)| Conn::Unix(s)),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

enum Conn {
    Tcp(tokio::net::TcpStream, String),
    Unix(tokio::net::UnixStream),
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

type Body = BoxBody<Bytes, io::Error>;
type Resp = Response<Body>;

fn resp(status: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Resp {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, ctype)
        .body(Full::new(body.into()).map_err(|e| match e {}).boxed())
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

pub async fn serve(
    listener: Listener,
    shared: Arc<Shared>,
    settings: Arc<Settings>,
    mut stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(settings.http.max_connections));
    let mut backoff = Duration::ZERO;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => break,
        };
        let conn = match accepted {
            Ok(c) => {
                backoff = Duration::ZERO;
                c
            }
            // The peer gave up before we accepted: nothing to wait for.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ECONNABORTED | libc::EPROTO | libc::ECONNRESET | libc::EINTR)
                ) =>
            {
                continue;
            }
            Err(e) => {
                backoff = (backoff * 2).clamp(ACCEPT_BACKOFF.0, ACCEPT_BACKOFF.1);
                warn!(
                    "http: accept failed ({e}); retrying in {backoff:?}: raise the daemon's open-file limit (LimitNOFILE) or lower http.max_connections"
                );
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => continue,
                    _ = stop.changed() => break,
                }
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            let n = settings.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                warn!(
                    "http: {} connections open (http.max_connections): closed {n} new ones so far",
                    settings.http.max_connections
                );
            }
            continue;
        };
        let (sh, st, stop_conn) = (shared.clone(), settings.clone(), stop.clone());
        match conn {
            Conn::Tcp(s, peer) => {
                tokio::spawn(connection(s, peer, sh, st, stop_conn, permit));
            }
            Conn::Unix(s) => {
                tokio::spawn(connection(
                    s,
                    "unix socket".into(),
                    sh,
                    st,
                    stop_conn,
                    permit,
                ));
            }
        }
    }
}

/// Requests in flight on one connection and when the last one ended: a
/// connection is idle when none is in flight.
struct Activity {
    in_flight: AtomicUsize,
    last: Mutex<Instant>,
}

struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn connection<S>(
    stream: S,
    peer: String,
    sh: Arc<Shared>,
    st: Arc<Settings>,
    mut stop: watch::Receiver<bool>,
    _slot: tokio::sync::OwnedSemaphorePermit,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity {
        in_flight: AtomicUsize::new(0),
        last: Mutex::new(Instant::now()),
    });
    let idle = st.http.idle_timeout;
    let svc = {
        let (activity, st) = (activity.clone(), st.clone());
        service_fn(move |req| {
            activity.in_flight.fetch_add(1, Ordering::SeqCst);
            let guard = InFlight(activity.clone());
            let (sh, st) = (sh.clone(), st.clone());
            async move {
                let r = handle(req, sh, st).await;
                drop(guard);
                r
            }
        })
    };
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(st.http.header_timeout)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    loop {
        let idle_at = *activity.last.lock().unwrap_or_else(|p| p.into_inner()) + idle;
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    debug!("http connection from {peer}: {e}");
                }
                return;
            }
            _ = stop.changed() => break,
            _ = tokio::time::sleep_until(idle_at.into()) => {
                let last = *activity.last.lock().unwrap_or_else(|p| p.into_inner());
                if activity.in_flight.load(Ordering::SeqCst) == 0 && last.elapsed() >= idle {
                    debug!("http connection from {peer}: idle for {idle:?}, closed");
                    break;
                }
                if activity.in_flight.load(Ordering::SeqCst) > 0 {
                    // Re-armed from now: a long profile request is not idle.
                    *activity.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
                }
            }
        }
    }
    // Idle connections close at once; a request in flight is answered first.
    conn.as_mut().graceful_shutdown();
    if let Err(e) = conn.await {
        debug!("http connection from {peer}: {e}");
    }
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    sh: Arc<Shared>,
    st: Arc<Settings>,
) -> Result<Resp, Infallible> {
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n"));
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
            return Ok(r);
        }
    }
    Ok(match path.as_str() {
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
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) || rel.components().count() != 3
    {
        return text(StatusCode::NOT_FOUND, "no such report\n");
    }
    let ctype = match rel.extension().and_then(|e| e.to_str()) {
        Some("svg") => "image/svg+xml",
        Some("json") => "application/json",
        Some("folded") => "text/plain; charset=utf-8",
        // stalls.pb.gz (pprof), stalls.pftrace (Perfetto): protobuf.
        Some("gz" | "pftrace") => "application/octet-stream",
        _ => return text(StatusCode::NOT_FOUND, "no such report\n"),
    };
    let fd = match open_beneath(data.dir_fd(), rel) {
        Ok(fd) => fd,
        Err(e) => {
            debug!("/reports/{}: {e}", rel.display());
            return text(
                StatusCode::NOT_FOUND,
                "no such report (retention may have removed it)\n",
            );
        }
    };
    let len = match fstat(&fd) {
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile => st.st_size as u64,
        _ => return text(StatusCode::FORBIDDEN, "not a regular file\n"),
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, ctype)
        .header(header::CONTENT_LENGTH, len)
        .body(
            FileBody {
                file: Some(File::from(fd)),
                remaining: len,
            }
            .boxed(),
        )
        .expect("static headers are valid")
}

/// Opens `rel` (only normal components) beneath `dir` without following a
/// symlink anywhere on the way and without blocking on a FIFO: openat2's
/// `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, or on kernels before 5.6 one
/// `O_NOFOLLOW` openat per component. The caller checks the file type.
fn open_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    let flags =
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    match openat2(
        dir,
        rel,
        flags,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    ) {
        Err(rustix::io::Errno::NOSYS) => {}
        r => return r.map_err(Into::into),
    }
    let mut parts: Vec<_> = rel.components().map(|c| c.as_os_str()).collect();
    let last = parts
        .pop()
        .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
    let mut cur: Option<OwnedFd> = None;
    for p in parts {
        let at = cur
            .as_ref()
            .map(|f| rustix::fd::AsFd::as_fd(f))
            .unwrap_or(dir);
        cur = Some(openat(
            at,
            p,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?);
    }
    let at = cur
        .as_ref()
        .map(|f| rustix::fd::AsFd::as_fd(f))
        .unwrap_or(dir);
    Ok(openat(at, last, flags, Mode::empty())?)
}

/// A regular file's bytes, read a chunk at a time as hyper asks for them.
/// Reads are synchronous: the file is regular (checked), so a read returns
/// at the speed of the disk, never waits on a writer.
struct FileBody {
    file: Option<File>,
    remaining: u64,
}

impl hyper::body::Body for FileBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let want = (self.remaining as usize).min(FILE_CHUNK);
        let Some(f) = self.file.as_mut().filter(|_| want > 0) else {
            return Poll::Ready(None);
        };
        let mut buf = vec![0u8; want];
        match f.read(&mut buf) {
            Ok(0) => {
                self.file = None;
                Poll::Ready(Some(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "report file shrank while being sent",
                ))))
            }
            Ok(n) => {
                buf.truncate(n);
                self.remaining -= n as u64;
                if self.remaining == 0 {
                    self.file = None;
                }
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(buf)))))
            }
            Err(e) => {
                self.file = None;
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

pub fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
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

    #[test]
    fn open_beneath_refuses_symlinks_and_escapes() {
        let tmp = std::env::temp_dir().join(format!("sp-http-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(tmp.join("w/p")).unwrap();
        std::fs::write(tmp.join("w/p/stalls.json"), b"{}").unwrap();
        std::fs::write(tmp.join("outside"), b"secret").unwrap();
        std::os::unix::fs::symlink(tmp.join("outside"), tmp.join("w/p/stalls.svg")).unwrap();
        std::os::unix::fs::symlink(tmp.join("w/p"), tmp.join("w/q")).unwrap();
        let dir = File::open(&tmp).unwrap();
        let fd = rustix::fd::AsFd::as_fd(&dir);
        assert!(open_beneath(fd, Path::new("w/p/stalls.json")).is_ok());
        assert!(open_beneath(fd, Path::new("w/p/stalls.svg")).is_err());
        assert!(open_beneath(fd, Path::new("w/q/stalls.json")).is_err());
        assert!(open_beneath(fd, Path::new("../outside")).is_err());
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
