//! Stalls exported as spans over OTLP, to the tracing backend a service
//! already sends its own traces to.
//!
//! In: the exporter's configuration, read the way every OpenTelemetry
//! exporter reads it (`OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL` —
//! `grpc` or `http/protobuf`, the default —, `OTEL_EXPORTER_OTLP_HEADERS`,
//! `OTEL_EXPORTER_OTLP_TIMEOUT`), flags overriding them; and requests
//! ([`crate::report::otlp`]) as stalls finish. Out: the requests POSTed to
//! the collector by a thread of its own, and what became of them
//! ([`ExportReport`]).
//!
//! Never in the way: [`Exporter::send`] only queues (a bounded queue of
//! [`QUEUE`] requests; a full queue drops the request and counts its
//! spans), the thread retries a failed request at most [`TRIES`] times
//! with a doubling wait, each attempt bounded by the timeout, and
//! [`Exporter::finish`] waits at most its deadline for what is queued:
//! a collector that is down or slow costs the recording nothing but those
//! spans, which are counted (`otlp_spans_failed`) and said. One
//! connection carries the requests ([`Conn`]: an HTTP/1.1 keep-alive
//! connection, or a gRPC channel) and is made anew only after it fails:
//! the collector's host pays one accept per recording, not one per stall.
//! Plain
//! `http://` endpoints only (no TLS here: an `https://` endpoint is
//! refused with a message).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, trace_service_client::TraceServiceClient,
};
use prost::Message;

/// Requests queued for the exporter thread at most.
pub const QUEUE: usize = 64;
/// Attempts of one request.
pub const TRIES: u32 = 3;
/// The wait before the second attempt (doubled before each further one).
const FIRST_RETRY: Duration = Duration::from_millis(250);
/// The default timeout of one attempt (the spec's `OTEL_EXPORTER_OTLP_TIMEOUT`
/// default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    HttpProtobuf,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Grpc => "grpc",
            Protocol::HttpProtobuf => "http/protobuf",
        }
    }

    fn parse(s: &str) -> Result<Protocol> {
        match s.trim() {
            "grpc" => Ok(Protocol::Grpc),
            "http/protobuf" => Ok(Protocol::HttpProtobuf),
            other => bail!(
                "OTLP protocol {other:?} is not supported: use grpc or http/protobuf \
                 (http/json is not implemented)"
            ),
        }
    }
}

/// Where and how spans go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpConfig {
    /// The URL requests go to: `http://host:4318/v1/traces` (http/protobuf)
    /// or `http://host:4317` (grpc).
    pub url: String,
    pub protocol: Protocol,
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
}

/// What the flags (or daemon.toml) say; each overrides its variable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OtlpSettings {
    pub endpoint: Option<String>,
    pub protocol: Option<String>,
    pub headers: Vec<String>,
    pub timeout_ms: Option<u64>,
}

impl OtlpConfig {
    /// The configuration from `settings` over the environment (`env`: a
    /// variable's value); None when no endpoint is given anywhere (no
    /// export). Bad values are an error naming the fix.
    pub fn resolve(
        settings: &OtlpSettings,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<OtlpConfig>> {
        let protocol = match settings
            .protocol
            .clone()
            .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
            .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
        {
            Some(p) => Protocol::parse(&p)?,
            None => Protocol::HttpProtobuf,
        };
        // A traces endpoint is used as given; a base endpoint gets the
        // signal's path (http/protobuf), as the spec says.
        let url = if let Some(e) = &settings.endpoint {
            Some(with_path(e, protocol))
        } else if let Some(e) = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            Some(e)
        } else {
            env("OTEL_EXPORTER_OTLP_ENDPOINT").map(|e| with_path(&e, protocol))
        };
        let Some(url) = url.map(|u| u.trim().to_string()).filter(|u| !u.is_empty()) else {
            return Ok(None);
        };
        if url.starts_with("https://") {
            bail!(
                "OTLP endpoint {url}: https is not supported by stallprof's exporter; \
                 send to a local collector over http:// (it can forward over TLS)"
            );
        }
        if !url.starts_with("http://") {
            bail!("OTLP endpoint {url:?} is not an http:// URL (e.g. http://127.0.0.1:4318)");
        }
        let mut headers = Vec::new();
        let from_env = env("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
            .or_else(|| env("OTEL_EXPORTER_OTLP_HEADERS"))
            .unwrap_or_default();
        for kv in from_env
            .split(',')
            .map(str::to_string)
            .chain(settings.headers.iter().cloned())
            .filter(|kv| !kv.trim().is_empty())
        {
            let Some((k, v)) = kv.split_once('=') else {
                bail!("OTLP header {kv:?} is not KEY=VALUE");
            };
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
            if k.is_empty()
                || !k
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                bail!("OTLP header name {k:?} is not a valid header name");
            }
            if v.bytes().any(|b| b.is_ascii_control()) {
                bail!("OTLP header {k}'s value holds a control character");
            }
            headers.retain(|(old, _): &(String, String)| *old != k);
            headers.push((k, v));
        }
        let timeout = match settings.timeout_ms.or_else(|| {
            env("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
                .or_else(|| env("OTEL_EXPORTER_OTLP_TIMEOUT"))
                .and_then(|t| t.trim().parse().ok())
        }) {
            Some(0) | None => DEFAULT_TIMEOUT,
            Some(ms) => Duration::from_millis(ms),
        };
        Ok(Some(OtlpConfig {
            url,
            protocol,
            headers,
            timeout,
        }))
    }
}

fn with_path(base: &str, protocol: Protocol) -> String {
    let base = base.trim().trim_end_matches('/');
    match protocol {
        Protocol::HttpProtobuf => format!("{base}/v1/traces"),
        Protocol::Grpc => base.to_string(),
    }
}

/// What became of the spans sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportReport {
    pub exported: u64,
    pub failed: u64,
    /// The last failure, said once.
    pub last_error: Option<String>,
}

enum Msg {
    Request(ExportTraceServiceRequest, u64),
    Finish(Instant),
}

/// Spans exported and failed so far, as the thread counts them (a
/// daemon's metrics read them while it runs).
#[derive(Debug, Default)]
pub struct Counts {
    pub exported: AtomicU64,
    pub failed: AtomicU64,
}

/// The exporter thread and its queue.
pub struct Exporter {
    config: OtlpConfig,
    tx: SyncSender<Msg>,
    thread: Option<JoinHandle<ExportReport>>,
    /// Spans dropped on a full queue (the thread never saw them).
    dropped: u64,
    counts: Arc<Counts>,
}

impl Exporter {
    pub fn start(config: OtlpConfig) -> Result<Exporter> {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let c = config.clone();
        let counts = Arc::new(Counts::default());
        let thread_counts = Arc::clone(&counts);
        let thread = std::thread::Builder::new()
            .name("stallprof-otlp".into())
            .spawn(move || run(c, rx, &thread_counts))
            .context("starting the OTLP exporter thread")?;
        Ok(Exporter {
            config,
            tx,
            thread: Some(thread),
            dropped: 0,
            counts,
        })
    }

    /// Spans exported, and failed (dropped on a full queue included), so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.counts.exported.load(Ordering::Relaxed),
            self.counts.failed.load(Ordering::Relaxed) + self.dropped,
        )
    }

    pub fn config(&self) -> &OtlpConfig {
        &self.config
    }

    /// Queue `req` (`spans` spans); never blocks.
    pub fn send(&mut self, req: ExportTraceServiceRequest, spans: u64) {
        if spans == 0 {
            return;
        }
        match self.tx.try_send(Msg::Request(req, spans)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped += spans;
            }
        }
    }

    /// Send what is queued, waiting at most `deadline` for it; what is
    /// still unsent then is failed.
    pub fn finish(mut self, deadline: Duration) -> ExportReport {
        let until = Instant::now() + deadline;
        // The queue may be full: the finish message waits its turn, as
        // long as the deadline allows.
        let mut msg = Msg::Finish(until);
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if Instant::now() < until => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(_) => break,
            }
        }
        let mut report = match self.thread.take() {
            Some(t) => {
                // The thread returns by the deadline (each attempt is
                // bounded by it); a thread that does not is left behind.
                while !t.is_finished() && Instant::now() < until + Duration::from_millis(500) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if t.is_finished() {
                    t.join().unwrap_or_default()
                } else {
                    ExportReport {
                        last_error: Some("the collector did not answer by the deadline".into()),
                        ..Default::default()
                    }
                }
            }
            None => ExportReport::default(),
        };
        report.failed += self.dropped;
        if self.dropped > 0 && report.last_error.is_none() {
            report.last_error = Some(format!("the export queue ({QUEUE} requests) was full"));
        }
        report
    }
}

/// The exporter thread: sends each request in turn until told to finish.
fn run(config: OtlpConfig, rx: Receiver<Msg>, counts: &Counts) -> ExportReport {
    let mut report = ExportReport::default();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            report.last_error = Some(format!("no runtime for the exporter: {e}"));
            // Count everything that comes as failed.
            while let Ok(m) = rx.recv() {
                match m {
                    Msg::Request(_, n) => report.failed += n,
                    Msg::Finish(_) => break,
                }
            }
            return report;
        }
    };
    let mut deadline: Option<Instant> = None;
    let mut conn = Conn::default();
    loop {
        let msg = match deadline {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            // Finishing: what is still queued, as long as the deadline allows.
            Some(_) => rx.recv_timeout(Duration::ZERO),
        };
        match msg {
            Ok(Msg::Request(req, n)) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    report.failed += n;
                    counts.failed.fetch_add(n, Ordering::Relaxed);
                    continue;
                }
                match rt.block_on(send_with_retries(&config, &mut conn, &req, deadline)) {
                    Ok(()) => {
                        report.exported += n;
                        counts.exported.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => {
                        log::warn!("OTLP export to {} failed: {e}", config.url);
                        report.failed += n;
                        counts.failed.fetch_add(n, Ordering::Relaxed);
                        report.last_error = Some(e);
                    }
                }
            }
            Ok(Msg::Finish(d)) => deadline = Some(d),
            Err(_) => break,
        }
    }
    report
}

async fn send_with_retries(
    config: &OtlpConfig,
    conn: &mut Conn,
    req: &ExportTraceServiceRequest,
    deadline: Option<Instant>,
) -> Result<(), String> {
    let mut wait = FIRST_RETRY;
    let mut last = String::new();
    for attempt in 1..=TRIES {
        let mut timeout = config.timeout;
        if let Some(d) = deadline {
            timeout = timeout.min(d.saturating_duration_since(Instant::now()));
            if timeout.is_zero() {
                break;
            }
        }
        let sent = tokio::time::timeout(timeout, send_once(config, conn, req)).await;
        match sent {
            Ok(Ok(())) => return Ok(()),
            Ok(Err((e, retryable))) => {
                // The connection may be what failed: the next try makes one.
                *conn = Conn::default();
                last = e;
                if !retryable {
                    break;
                }
            }
            Err(_) => {
                *conn = Conn::default();
                last = format!("no answer within {} ms", timeout.as_millis());
            }
        }
        if attempt < TRIES {
            if deadline.is_some_and(|d| Instant::now() + wait >= d) {
                break;
            }
            tokio::time::sleep(wait).await;
            wait *= 2;
        }
    }
    Err(last)
}

/// The exporter's connection to the collector, kept between requests;
/// none until the first request, and again after a failure.
#[derive(Default)]
struct Conn {
    http: Option<hyper::client::conn::http1::SendRequest<Full<hyper::body::Bytes>>>,
    grpc: Option<TraceServiceClient<tonic::transport::Channel>>,
}

/// One attempt: Ok, or the error and whether another attempt may help.
async fn send_once(
    config: &OtlpConfig,
    conn: &mut Conn,
    req: &ExportTraceServiceRequest,
) -> Result<(), (String, bool)> {
    match config.protocol {
        Protocol::HttpProtobuf => send_http(config, conn, req).await,
        Protocol::Grpc => send_grpc(config, conn, req).await,
    }
}

async fn send_http(
    config: &OtlpConfig,
    conn: &mut Conn,
    req: &ExportTraceServiceRequest,
) -> Result<(), (String, bool)> {
    let uri: hyper::Uri = config
        .url
        .parse()
        .map_err(|e| (format!("bad URL {}: {e}", config.url), false))?;
    let host = uri.host().unwrap_or("127.0.0.1").to_string();
    let port = uri.port_u16().unwrap_or(80);
    // The kept connection, when the collector has not closed it.
    let mut kept = conn.http.take();
    if let Some(s) = &mut kept
        && s.ready().await.is_err()
    {
        kept = None;
    }
    let mut sender = match kept {
        Some(s) => s,
        None => {
            let stream = tokio::net::TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|e| (format!("connecting to {host}:{port}: {e}"), true))?;
            let io = hyper_util::rt::TokioIo::new(stream);
            let (sender, connection) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| (format!("HTTP handshake with {host}:{port}: {e}"), true))?;
            tokio::spawn(connection);
            sender
        }
    };
    let authority = uri
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_else(|| host.clone());
    let mut builder = hyper::Request::post(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header("host", authority)
        .header("content-type", "application/x-protobuf")
        .header(
            "user-agent",
            concat!("stallprof/", env!("CARGO_PKG_VERSION")),
        );
    for (k, v) in &config.headers {
        builder = builder.header(k.as_str(), v.as_str());
    }
    let body = Full::new(bytes_of(req));
    let request = builder
        .body(body)
        .map_err(|e| (format!("building the request: {e}"), false))?;
    let resp = sender
        .send_request(request)
        .await
        .map_err(|e| (format!("sending to {}: {e}", config.url), true))?;
    let status = resp.status();
    // Read the answer out, so the connection can carry the next request.
    if resp.into_body().collect().await.is_ok() {
        conn.http = Some(sender);
    }
    if status.is_success() {
        return Ok(());
    }
    let retryable = matches!(status.as_u16(), 429 | 502 | 503 | 504);
    Err((format!("{} answered {status}", config.url), retryable))
}

async fn send_grpc(
    config: &OtlpConfig,
    conn: &mut Conn,
    req: &ExportTraceServiceRequest,
) -> Result<(), (String, bool)> {
    let mut client = match conn.grpc.take() {
        Some(c) => c,
        None => {
            let endpoint = tonic::transport::Endpoint::from_shared(config.url.clone())
                .map_err(|e| (format!("bad URL {}: {e}", config.url), false))?
                .timeout(config.timeout);
            let channel = endpoint
                .connect()
                .await
                .map_err(|e| (format!("connecting to {}: {e}", config.url), true))?;
            TraceServiceClient::new(channel)
        }
    };
    let mut request = tonic::Request::new(req.clone());
    for (k, v) in &config.headers {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(k.as_bytes()),
            tonic::metadata::MetadataValue::try_from(v.as_str()),
        ) {
            request.metadata_mut().insert(k, v);
        }
    }
    let answer = client.export(request).await;
    conn.grpc = Some(client);
    match answer {
        Ok(_) => Ok(()),
        Err(status) => {
            let retryable = matches!(
                status.code(),
                tonic::Code::Unavailable
                    | tonic::Code::ResourceExhausted
                    | tonic::Code::DeadlineExceeded
                    | tonic::Code::Aborted
            );
            Err((
                format!(
                    "{} answered {:?}: {}",
                    config.url,
                    status.code(),
                    status.message()
                ),
                retryable,
            ))
        }
    }
}

fn bytes_of(req: &ExportTraceServiceRequest) -> hyper::body::Bytes {
    hyper::body::Bytes::from(req.encode_to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn configured_as_every_otel_exporter_is() {
        let none = OtlpConfig::resolve(&OtlpSettings::default(), env(&[])).unwrap();
        assert_eq!(none, None, "no endpoint, no export");
        let c = OtlpConfig::resolve(
            &OtlpSettings::default(),
            env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318/"),
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    "Authorization=Bearer x, x-team=a",
                ),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.url, "http://127.0.0.1:4318/v1/traces");
        assert_eq!(c.protocol, Protocol::HttpProtobuf);
        assert_eq!(
            c.headers,
            vec![
                ("authorization".to_string(), "Bearer x".to_string()),
                ("x-team".to_string(), "a".to_string())
            ]
        );
        let g = OtlpConfig::resolve(
            &OtlpSettings {
                endpoint: Some("http://127.0.0.1:4317".into()),
                protocol: Some("grpc".into()),
                ..Default::default()
            },
            env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (g.url.as_str(), g.protocol),
            ("http://127.0.0.1:4317", Protocol::Grpc)
        );
        // A traces endpoint is used as given.
        let t = OtlpConfig::resolve(
            &OtlpSettings::default(),
            env(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:9/custom")]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.url, "http://c:9/custom");
        for bad in [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "novalue"),
        ] {
            let e = OtlpConfig::resolve(
                &OtlpSettings {
                    endpoint: Some("http://127.0.0.1:1".into()),
                    ..Default::default()
                },
                env(&[bad]),
            );
            assert!(e.is_err(), "{bad:?}");
        }
        let e = OtlpConfig::resolve(
            &OtlpSettings {
                endpoint: Some("https://collector:4318".into()),
                ..Default::default()
            },
            env(&[]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("local collector"), "{e}");
    }

    /// A collector that is down: every span is counted failed, and the
    /// finish returns within its deadline.
    #[test]
    fn a_collector_that_is_down_costs_its_spans_not_the_time() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener); // nobody listens there now
        let config = OtlpConfig {
            url: format!("http://127.0.0.1:{port}/v1/traces"),
            protocol: Protocol::HttpProtobuf,
            headers: vec![],
            timeout: Duration::from_secs(1),
        };
        let mut ex = Exporter::start(config).unwrap();
        for _ in 0..3 {
            ex.send(ExportTraceServiceRequest::default(), 2);
        }
        let t0 = Instant::now();
        let r = ex.finish(Duration::from_secs(2));
        assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
        assert_eq!(r.exported, 0);
        assert_eq!(r.failed, 6);
        assert!(r.last_error.is_some());
    }
}
