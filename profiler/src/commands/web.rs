//! The HTTP server the daemon and `report --serve` share (hyper, HTTP/1.1,
//! on the caller's current-thread Tokio runtime): listening sockets, the
//! accept loop with its connection limits, and the one way a file is sent.
//!
//! In: a [`Listener`], [`Limits`] and a handler (request -> response).
//! Out: responses until the stop channel says so. What to answer is the
//! caller's; this module only serves.
//!
//! Hostile or broken clients cost a bounded amount (docs/security.md):
//! headers must arrive within `header_timeout` (hyper's timeout, which needs
//! the Tokio timer set here), a connection with no request in flight is
//! closed after `idle_timeout`, at most `max_connections` are served at once
//! (beyond it a new one is closed at once, so the kernel's backlog never
//! fills), `accept` errors back off instead of spinning, files are streamed
//! in 64 KiB chunks, and [`file_beneath`] opens only regular files beneath a
//! directory's descriptor, never through a symlink.
use std::{
    fs::File,
    future::Future,
    io::{self, Read as _},
    net::SocketAddr,
    os::fd::{BorrowedFd, OwnedFd},
    path::{Component, Path, PathBuf},
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::{
    Request, Response, StatusCode,
    body::{Bytes, Frame, Incoming, SizeHint},
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

/// A file is sent in chunks this big; hyper asks for the next one only
/// when the previous one is written, so a slow reader holds one chunk.
const FILE_CHUNK: usize = 64 * 1024;
/// `accept` failing for lack of descriptors or memory is retried after a
/// pause doubling from the first to the last.
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(1));

pub type Body = BoxBody<Bytes, io::Error>;
pub type Resp = Response<Body>;

/// How much one client may hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once; beyond it new ones are closed at once.
    pub max_connections: usize,
    /// A request's headers must arrive within this.
    pub header_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
}

/// The listening socket: TCP, or a Unix socket removed again on drop.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Binds TCP `addr` (port 0: a free one the kernel picks; see
    /// [`Listener::local_addr`]). `remedy` ends the error when it fails.
    pub async fn tcp(addr: SocketAddr, remedy: &str) -> Result<Listener> {
        Ok(Listener::Tcp(TcpListener::bind(addr).await.with_context(
            || format!("cannot listen on {addr}: is the port in use? {remedy}"),
        )?))
    }

    /// Binds a Unix socket at `path`, created 0600 (0660 in `group`): the
    /// umask is narrowed around `bind`, so it is never reachable wider. A
    /// stale socket at the path is replaced; anything else there is refused.
    pub fn unix(path: &Path, group: Option<u32>) -> Result<Listener> {
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
            format!(
                "cannot listen on unix:{}: is its directory there and writable?",
                path.display()
            )
        })?;
        let owned = Listener::Unix(l, path.to_path_buf());
        if let Some(g) = group {
            std::os::unix::fs::chown(path, None, Some(g))
                .with_context(|| format!("cannot give {} to the data_group", path.display()))?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot chmod {}", path.display()))?;
        Ok(owned)
    }

    /// The address a TCP listener got (its port, when 0 was asked for).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match self {
            Listener::Tcp(l) => l.local_addr().ok(),
            Listener::Unix(..) => None,
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

pub fn resp(status: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Resp {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, ctype)
        .body(Full::new(body.into()).map_err(|e| match e {}).boxed())
        .expect("static headers are valid")
}

pub fn text(status: StatusCode, msg: impl Into<String>) -> Resp {
    resp(status, "text/plain; charset=utf-8", msg.into())
}

/// Serves connections on `listener`, each request answered by `handler`,
/// until `stop` changes.
pub async fn serve<H, F>(
    listener: Listener,
    limits: Limits,
    handler: H,
    mut stop: watch::Receiver<bool>,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Resp> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut backoff = Duration::ZERO;
    let mut refused = 0u64;
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
                    "http: accept failed ({e}); retrying in {backoff:?}: raise the open-file limit (LimitNOFILE) or lower http.max_connections"
                );
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => continue,
                    _ = stop.changed() => break,
                }
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            refused += 1;
            if refused.is_power_of_two() {
                warn!(
                    "http: {} connections open (http.max_connections): closed {refused} new ones so far",
                    limits.max_connections
                );
            }
            continue;
        };
        let (h, stop_conn) = (handler.clone(), stop.clone());
        match conn {
            Conn::Tcp(s, peer) => {
                tokio::spawn(connection(s, peer, limits, h, stop_conn, permit));
            }
            Conn::Unix(s) => {
                tokio::spawn(connection(
                    s,
                    "unix socket".into(),
                    limits,
                    h,
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

async fn connection<S, H, F>(
    stream: S,
    peer: String,
    limits: Limits,
    handler: H,
    mut stop: watch::Receiver<bool>,
    _slot: tokio::sync::OwnedSemaphorePermit,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Resp> + Send + 'static,
{
    let activity = Arc::new(Activity {
        in_flight: AtomicUsize::new(0),
        last: Mutex::new(Instant::now()),
    });
    let idle = limits.idle_timeout;
    let svc = {
        let activity = activity.clone();
        service_fn(move |req| {
            activity.in_flight.fetch_add(1, Ordering::SeqCst);
            let guard = InFlight(activity.clone());
            let answer = handler(req);
            async move {
                let r = answer.await;
                drop(guard);
                Ok::<_, std::convert::Infallible>(r)
            }
        })
    };
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
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

/// The content type of a file the servers send, by its name's extension;
/// None for a kind they do not serve.
pub fn content_type(name: &Path) -> Option<&'static str> {
    Some(match name.extension()?.to_str()? {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "svg" => "image/svg+xml",
        "json" => "application/json",
        "folded" | "txt" | "md" => "text/plain; charset=utf-8",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "woff2" => "font/woff2",
        "wasm" => "application/wasm",
        // stalls.pb.gz (pprof), stalls.pftrace (Perfetto): protobuf.
        "gz" | "pftrace" => "application/octet-stream",
        _ => return None,
    })
}

/// The regular file `rel` beneath `dir` as a response: 404 for a path
/// with anything but plain names in it (`..`, `/`, `.`), one whose kind
/// [`content_type`] does not know, or one that cannot be opened beneath
/// `dir` without a symlink ([`open_beneath`]); 403 for a non-regular file.
pub fn file_beneath(dir: BorrowedFd<'_>, rel: &Path, not_found: &'static str) -> Resp {
    if rel.as_os_str().is_empty() || rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return text(StatusCode::NOT_FOUND, not_found);
    }
    let Some(ctype) = content_type(rel) else {
        return text(StatusCode::NOT_FOUND, not_found);
    };
    let fd = match open_beneath(dir, rel) {
        Ok(fd) => fd,
        Err(e) => {
            debug!("{}: {e}", rel.display());
            return text(StatusCode::NOT_FOUND, not_found);
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
pub fn open_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
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
                    "file shrank while being sent",
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let status = |rel: &str| file_beneath(fd, Path::new(rel), "no\n").status();
        assert_eq!(status("w/p/stalls.json"), StatusCode::OK);
        assert_eq!(status("w/p/../p/stalls.json"), StatusCode::NOT_FOUND);
        assert_eq!(status("/etc/passwd"), StatusCode::NOT_FOUND);
        assert_eq!(status("w/p/stalls.svg"), StatusCode::NOT_FOUND);
        assert_eq!(status(""), StatusCode::NOT_FOUND);
        std::fs::write(tmp.join("w/p/key.pem"), b"x").unwrap();
        assert_eq!(status("w/p/key.pem"), StatusCode::NOT_FOUND);
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
