//! Daemon settings: the TOML file (docs/daemon.md), overridden by flags,
//! validated into a [`DaemonConfig`] before any probe is loaded.
//!
//! In: `--config FILE` text and the command-line flags. Out: a
//! [`DaemonConfig`] with every duration and size parsed, or an error naming
//! the key and the expected form. Unknown keys are errors (a typo must not
//! silently widen what is monitored).
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;
use thiserror::Error;

use super::rules::{Rule, Rules};
use crate::os::units::parse_duration;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:9436";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/stallprof";
/// Lower than `record`'s 999 Hz: the perf timer fires on every CPU whether
/// or not a loop is busy, and idle cost is the daemon's budget (docs/daemon.md).
pub const DEFAULT_FREQUENCY: u64 = 199;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read the config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{key}: {message}")]
    Value { key: &'static str, message: String },
}

/// `[otlp]`: `endpoint = "http://127.0.0.1:4318"`, `protocol = "grpc"` or
/// `"http/protobuf"`, `headers = ["authorization=Bearer …"]`, `timeout = "10s"`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpFile {
    pub endpoint: Option<String>,
    pub protocol: Option<String>,
    #[serde(default)]
    pub headers: Vec<String>,
    pub timeout: Option<String>,
}

/// The file, as written. Every key is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    /// A group that may read the reports (files 0640, directories 0750);
    /// without it only root can.
    pub data_group: Option<String>,
    pub threshold: Option<String>,
    pub frequency: Option<u64>,
    pub window: Option<String>,
    /// `auto` (default), `raw-tracepoints` or `tracepoints` (see `record --probes`).
    pub probes: Option<String>,
    /// Path prefixes of the application's code (`record --app-path`);
    /// absent or empty: the guess.
    #[serde(default)]
    pub app_paths: Vec<String>,
    #[serde(default)]
    pub retention: RetentionFile,
    #[serde(default)]
    pub limits: LimitsFile,
    #[serde(default)]
    pub http: HttpFile,
    /// Stalls as spans to an OpenTelemetry collector (`[otlp]`); each key
    /// overrides its `OTEL_EXPORTER_OTLP_*` variable.
    #[serde(default)]
    pub otlp: OtlpFile,
    #[serde(default)]
    pub include: Vec<Rule>,
    #[serde(default)]
    pub exclude: Vec<Rule>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionFile {
    pub max_age: Option<String>,
    pub max_size: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsFile {
    pub max_processes: Option<usize>,
    pub forget_after: Option<String>,
    pub max_stacks: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpFile {
    pub max_connections: Option<usize>,
    pub header_timeout: Option<String>,
    pub idle_timeout: Option<String>,
    pub token_file: Option<PathBuf>,
}

/// Where the HTTP side listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    /// `unix:/run/stallprof.sock`: mode 0600, or 0660 in `data_group`.
    Unix(PathBuf),
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(a) => write!(f, "{a}"),
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// The HTTP side's limits and access control (`[http]`).
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Connections served at once; beyond it new ones are closed at once.
    pub max_connections: usize,
    /// A request's headers must arrive within this.
    pub header_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
    /// `token_file`: every request but `/healthz` must carry
    /// `Authorization: Bearer <its contents, trimmed>`.
    pub token_file: Option<PathBuf>,
}

pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// Flags that override the file.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub threshold: Option<String>,
    pub frequency: Option<u64>,
    pub window: Option<String>,
    pub probes: Option<crate::kernel::probe::ProbeChoice>,
}

/// Validated settings.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub listen: Listen,
    pub http: HttpConfig,
    pub data_dir: PathBuf,
    /// `data_group`: its name and gid.
    pub data_group: Option<(String, u32)>,
    pub threshold_ns: u64,
    pub sample_hz: u64,
    /// Which kernel probes (`probes`).
    pub probes: crate::kernel::probe::ProbeChoice,
    /// Length of one rolling report window.
    pub window: Duration,
    /// Report windows older than this are deleted.
    pub max_age: Duration,
    /// The data directory's report windows are kept under this many bytes.
    pub max_bytes: u64,
    /// Processes tracked at once (live, or exited and not yet forgotten).
    pub max_processes: usize,
    /// How long an exited process's metrics stay exported.
    pub forget_after: Duration,
    /// The engine is rebuilt past this many interned stacks (its memory
    /// bound; see `Engine::rebuild`).
    pub max_stacks: usize,
    pub rules: Rules,
    /// `app_paths`: where the application's code is (empty: the guess;
    /// [`crate::classify`]).
    pub app_paths: Vec<String>,
    /// Where stalls go as spans, if anywhere (`[otlp]`, `OTEL_EXPORTER_OTLP_*`).
    pub otlp: Option<crate::commands::otlp::OtlpConfig>,
}

fn duration(key: &'static str, s: &str) -> Result<Duration, ConfigError> {
    parse_duration(s)
        .map(Duration::from_nanos)
        .map_err(|e| ConfigError::Value {
            key,
            message: e.to_string(),
        })
}

/// `512MiB`, `1GiB`, `100MB`, `64KiB`, `1000000` (bytes).
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().ok()?;
    let scale = match unit.trim() {
        "" | "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some((v * scale).round() as u64)
}

impl DaemonConfig {
    pub fn load(file: Option<&Path>, o: &Overrides) -> Result<DaemonConfig, ConfigError> {
        let f = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.into(),
                    source,
                })?;
                toml::from_str::<FileConfig>(&text).map_err(|e| ConfigError::Parse {
                    path: path.into(),
                    message: e.to_string(),
                })?
            }
            None => FileConfig::default(),
        };
        Self::from_file(f, o)
    }

    pub fn from_file(f: FileConfig, o: &Overrides) -> Result<DaemonConfig, ConfigError> {
        let listen_s = o
            .listen
            .clone()
            .or(f.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.into());
        let listen = match listen_s.strip_prefix("unix:") {
            Some(p) if Path::new(p).is_absolute() => Listen::Unix(p.into()),
            Some(_) => {
                return Err(ConfigError::Value {
                    key: "listen",
                    message: format!(
                        "'{listen_s}': a Unix socket needs an absolute path (e.g. unix:/run/stallprof.sock)"
                    ),
                });
            }
            None => Listen::Tcp(listen_s.parse().map_err(|_| ConfigError::Value {
                key: "listen",
                message: format!(
                    "'{listen_s}' is not an IP:PORT address (e.g. 127.0.0.1:9436) or unix:/PATH"
                ),
            })?),
        };
        let max_connections = f.http.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS);
        if max_connections == 0 {
            return Err(ConfigError::Value {
                key: "http.max_connections",
                message: "must be at least 1".into(),
            });
        }
        let header_timeout = match f.http.header_timeout.as_deref() {
            Some(s) => duration("http.header_timeout", s)?,
            None => Duration::from_secs(10),
        };
        let idle_timeout = match f.http.idle_timeout.as_deref() {
            Some(s) => duration("http.idle_timeout", s)?,
            None => Duration::from_secs(60),
        };
        for (key, d) in [
            ("http.header_timeout", header_timeout),
            ("http.idle_timeout", idle_timeout),
        ] {
            if d < Duration::from_millis(100) {
                return Err(ConfigError::Value {
                    key,
                    message: "must be at least 100ms".into(),
                });
            }
        }
        if let Some(p) = &f.http.token_file
            && !p.is_absolute()
        {
            return Err(ConfigError::Value {
                key: "http.token_file",
                message: format!("'{}' must be an absolute path", p.display()),
            });
        }
        let http = HttpConfig {
            max_connections,
            header_timeout,
            idle_timeout,
            token_file: f.http.token_file,
        };
        let threshold_ns = match o.threshold.as_deref().or(f.threshold.as_deref()) {
            Some(s) => duration("threshold", s)?.as_nanos() as u64,
            None => 50_000_000,
        };
        if threshold_ns < 1_000_000 {
            return Err(ConfigError::Value {
                key: "threshold",
                message: "must be at least 1ms".into(),
            });
        }
        let sample_hz = o.frequency.or(f.frequency).unwrap_or(DEFAULT_FREQUENCY);
        if !(1..=10_000).contains(&sample_hz) {
            return Err(ConfigError::Value {
                key: "frequency",
                message: format!("{sample_hz} Hz is not in 1..=10000"),
            });
        }
        let probes = match (o.probes, f.probes.as_deref()) {
            (Some(p), _) => p,
            (None, None | Some("auto")) => crate::kernel::probe::ProbeChoice::Auto,
            (None, Some("raw-tracepoints")) => crate::kernel::probe::ProbeChoice::RawTracepoints,
            (None, Some("tracepoints")) => crate::kernel::probe::ProbeChoice::Tracepoints,
            (None, Some(other)) => {
                return Err(ConfigError::Value {
                    key: "probes",
                    message: format!(
                        "'{other}' is not \"auto\", \"raw-tracepoints\" or \"tracepoints\""
                    ),
                });
            }
        };
        let window = match o.window.as_deref().or(f.window.as_deref()) {
            Some(s) => duration("window", s)?,
            None => Duration::from_secs(60),
        };
        if window < Duration::from_secs(1) {
            return Err(ConfigError::Value {
                key: "window",
                message: "must be at least 1s".into(),
            });
        }
        let max_age = match f.retention.max_age.as_deref() {
            Some(s) => duration("retention.max_age", s)?,
            None => Duration::from_secs(24 * 3600),
        };
        let max_bytes = match f.retention.max_size.as_deref() {
            Some(s) => parse_size(s).ok_or_else(|| ConfigError::Value {
                key: "retention.max_size",
                message: format!(
                    "'{s}' is not a size: write e.g. 512MiB, 2GiB, 100MB or a byte count"
                ),
            })?,
            None => 1024 * 1024 * 1024,
        };
        let max_processes = f.limits.max_processes.unwrap_or(1000);
        if max_processes == 0 {
            return Err(ConfigError::Value {
                key: "limits.max_processes",
                message: "must be at least 1".into(),
            });
        }
        let forget_after = match f.limits.forget_after.as_deref() {
            Some(s) => duration("limits.forget_after", s)?,
            None => Duration::from_secs(300),
        };
        let max_stacks = f.limits.max_stacks.unwrap_or(super::MAX_STACKS);
        if max_stacks == 0 {
            return Err(ConfigError::Value {
                key: "limits.max_stacks",
                message: "must be at least 1".into(),
            });
        }
        let rules = Rules::new(f.include, f.exclude).map_err(|message| ConfigError::Value {
            key: "include/exclude",
            message,
        })?;
        let data_group = match f.data_group {
            Some(g) => {
                let gid = crate::os::user::group_id(&g).map_err(|e| ConfigError::Value {
                    key: "data_group",
                    message: e.to_string(),
                })?;
                Some((g, gid))
            }
            None => None,
        };
        let otlp_timeout = match &f.otlp.timeout {
            Some(t) => Some(duration("otlp.timeout", t)?.as_millis() as u64),
            None => None,
        };
        let otlp = crate::commands::otlp::OtlpConfig::resolve(
            &crate::commands::otlp::OtlpSettings {
                endpoint: f.otlp.endpoint.clone(),
                protocol: f.otlp.protocol.clone(),
                headers: f.otlp.headers.clone(),
                timeout_ms: otlp_timeout,
            },
            |k| std::env::var(k).ok(),
        )
        .map_err(|e| ConfigError::Value {
            key: "otlp",
            message: e.to_string(),
        })?;
        Ok(DaemonConfig {
            listen,
            http,
            data_group,
            data_dir: o
                .data_dir
                .clone()
                .or(f.data_dir)
                .unwrap_or_else(|| DEFAULT_DATA_DIR.into()),
            threshold_ns,
            sample_hz,
            probes,
            window,
            max_age,
            max_bytes,
            max_processes,
            forget_after,
            max_stacks,
            rules,
            app_paths: f.app_paths,
            otlp,
        })
    }

    /// The effective settings, as `--check-config` prints them.
    /// Include rules, and uprobes for the waits: each included process gets
    /// its own (up to `MAX_PROCESS_WAITS`), and nobody else pays.
    pub fn per_process_waits(&self) -> bool {
        self.rules.includes_some() && self.probes != crate::kernel::probe::ProbeChoice::Tracepoints
    }

    pub fn describe(&self) -> String {
        use crate::os::units::fmt_ns;
        let mut s = String::new();
        s.push_str("stallprof daemon: configuration is valid\n");
        s.push_str(&format!(
            "  listen        {}{}\n",
            self.listen,
            match &self.listen {
                Listen::Tcp(a) if !a.ip().is_loopback() =>
                    "  (NOT loopback: metrics and reports are reachable from the network)",
                Listen::Tcp(_) => "",
                Listen::Unix(_) if self.data_group.is_some() =>
                    "  (socket mode 0660, group data_group)",
                Listen::Unix(_) => "  (socket mode 0600, root only)",
            }
        ));
        s.push_str(&format!(
            "  http          max_connections {}, header_timeout {}, idle_timeout {}, token_file {}\n",
            self.http.max_connections,
            fmt_ns(self.http.header_timeout.as_nanos() as u64),
            fmt_ns(self.http.idle_timeout.as_nanos() as u64),
            match &self.http.token_file {
                Some(p) => p.display().to_string(),
                None => "none (no token required)".into(),
            }
        ));
        s.push_str(&format!(
            "  data_dir      {}{}\n",
            self.data_dir.display(),
            match &self.data_group {
                Some((name, gid)) => format!("  (readable by group {name}, gid {gid})"),
                None => "  (readable by root only)".into(),
            }
        ));
        s.push_str(&format!("  threshold     {}\n", fmt_ns(self.threshold_ns)));
        s.push_str(&format!("  frequency     {} Hz\n", self.sample_hz));
        s.push_str(&format!("  probes        {:?}\n", self.probes).to_lowercase());
        s.push_str(&format!(
            "  window        {}\n",
            fmt_ns(self.window.as_nanos() as u64)
        ));
        s.push_str(&format!(
            "  retention     max_age {}, max_size {} bytes\n",
            fmt_ns(self.max_age.as_nanos() as u64),
            self.max_bytes
        ));
        s.push_str(&format!(
            "  limits        max_processes {}, forget_after {}, max_stacks {}\n",
            self.max_processes,
            fmt_ns(self.forget_after.as_nanos() as u64),
            self.max_stacks
        ));
        s.push_str(&format!("  rules         {}\n", self.rules.describe()));
        s.push_str(&format!(
            "  wait probes   {}\n",
            if self.probes == crate::kernel::probe::ProbeChoice::Tracepoints {
                "the wait syscalls' tracepoints (every process on the host pays for its syscalls)"
                    .to_string()
            } else if self.per_process_waits() {
                format!(
                    "uprobes on each process the include rules take (no other process pays); \
                     on each C library file past {} of them",
                    super::MAX_PROCESS_WAITS
                )
            } else {
                "uprobes on each C library file, for every process (one the rules leave out \
                 still pays the trap of each wait call)"
                    .to_string()
            }
        ));
        s.push_str(&format!(
            "  app_paths     {}\n",
            if self.app_paths.is_empty() {
                "none (the guess: outside the standard library, site-packages, node_modules)".into()
            } else {
                self.app_paths.join(", ")
            }
        ));
        s.push_str(&format!(
            "  otlp          {}\n",
            match &self.otlp {
                None => "off (no [otlp] endpoint, no OTEL_EXPORTER_OTLP_ENDPOINT)".to_string(),
                Some(o) => format!(
                    "each stall as a span to {} ({})",
                    o.url,
                    o.protocol.as_str()
                ),
            }
        ));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64KiB"), Some(65536));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("100MB"), Some(100_000_000));
        assert_eq!(parse_size("123"), Some(123));
        assert_eq!(parse_size("12 parsecs"), None);
    }

    #[test]
    fn file_and_overrides() {
        let f: FileConfig = toml::from_str(
            r#"
            listen = "127.0.0.1:1234"
            threshold = "20ms"
            window = "10s"
            [retention]
            max_age = "1h"
            max_size = "10MiB"
            [[include]]
            comm = "python*"
            [[exclude]]
            cgroup = "*system.slice*"
            "#,
        )
        .unwrap();
        let o = Overrides {
            threshold: Some("30ms".into()),
            ..Default::default()
        };
        let c = DaemonConfig::from_file(f, &o).unwrap();
        assert_eq!(c.listen, Listen::Tcp("127.0.0.1:1234".parse().unwrap()));
        assert_eq!(c.http.max_connections, DEFAULT_MAX_CONNECTIONS);
        let f: FileConfig = toml::from_str(
            "listen = \"unix:/run/sp.sock\"\n[http]\nmax_connections = 8\ntoken_file = \"/etc/t\"\nheader_timeout = \"2s\"\n",
        )
        .unwrap();
        let u = DaemonConfig::from_file(f, &Overrides::default()).unwrap();
        assert_eq!(u.listen, Listen::Unix("/run/sp.sock".into()));
        assert_eq!(u.http.max_connections, 8);
        assert_eq!(u.http.header_timeout, Duration::from_secs(2));
        assert!(toml::from_str::<FileConfig>("[http]\nmax_conections = 1").is_err());
        assert_eq!(c.threshold_ns, 30_000_000);
        assert_eq!(c.window, Duration::from_secs(10));
        assert_eq!(c.max_bytes, 10 << 20);
        assert_eq!(c.max_age, Duration::from_secs(3600));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        assert!(toml::from_str::<FileConfig>("treshold = \"20ms\"").is_err());
        let f: FileConfig = toml::from_str("window = \"soon\"").unwrap();
        let e = DaemonConfig::from_file(f, &Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
    }

    #[test]
    fn app_paths_are_read_and_shown() {
        let f: FileConfig = toml::from_str("app_paths = [\"/srv/app/\", \"/opt/svc/\"]").unwrap();
        let c = DaemonConfig::from_file(f, &Overrides::default()).unwrap();
        assert_eq!(c.app_paths, ["/srv/app/", "/opt/svc/"]);
        assert!(c.describe().contains("app_paths     /srv/app/, /opt/svc/"));
        let none = DaemonConfig::from_file(FileConfig::default(), &Overrides::default()).unwrap();
        assert!(none.app_paths.is_empty() && none.describe().contains("the guess"));
    }
}
