//! The commands: thin drivers of the engine and the report writers.
pub mod daemon;
pub mod live;
pub mod otlp;
pub mod record;
pub mod report;
pub mod top;
pub mod web;

use clap::Args;

use crate::{
    os::units::parse_duration,
    report::view::{GroupBy, Native, View},
};

/// What to watch and how: shared by `record` and `top` (flattened).
#[derive(Args, Debug, Clone)]
pub struct StallArgs {
    /// Busy periods at least this long are stalls (e.g. 50ms, 0.2s, 1s).
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    pub threshold: u64,
    /// Only these threads count as executors (repeatable). Default: every
    /// thread that parks in an event-loop wait.
    #[arg(long = "tid")]
    pub tids: Vec<u32>,
    /// CPU-clock sampling frequency in Hz for on-CPU stacks.
    #[arg(short = 'F', long, default_value_t = 999, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub frequency: u64,
    /// Which kernel probes: `auto` watches the target's own threads —
    /// their context switches and CPU-clock samples on per-thread perf
    /// events (the daemon: each loop thread it elects) — and puts uprobes on
    /// its own wait functions, so no other process runs a program or takes
    /// an interrupt, falling back per part where those cannot serve;
    /// `raw-tracepoints` puts the scheduler on raw tracepoints (every
    /// context switch on the host runs a program) and the sampling on every
    /// CPU; `tracepoints` forces the classic tracepoints, which every
    /// process on the host pays for (its syscalls and context switches)
    /// while attached.
    #[arg(long, env = "STALLPROF_PROBES", value_enum, default_value_t = crate::kernel::probe::ProbeChoice::Auto)]
    pub probes: crate::kernel::probe::ProbeChoice,
    /// Watch the target process alone. By default its whole process tree
    /// is watched: the workers a supervisor runs (gunicorn, `uvicorn
    /// --workers`, Node's cluster, pm2) and those started later, each
    /// through its own loop election.
    #[arg(long)]
    pub no_subprocesses: bool,
    /// The default (py-spy's flag, accepted as such): the processes under
    /// the target are watched too.
    #[arg(long, conflicts_with = "no_subprocesses")]
    pub subprocesses: bool,
}

/// Which code is the application's: shared by `record`, `report` and `top`
/// (flattened).
#[derive(Args, Debug, Clone, Default)]
pub struct AppArgs {
    /// The application's code is under this path prefix (repeatable): its
    /// innermost frame is a stall's culprit and its outermost the entry
    /// point. Default: a guess — every Python/JavaScript file outside the
    /// runtime's standard library, site-packages/dist-packages and
    /// node_modules. Given, the prefixes replace the guess.
    #[arg(long = "app-path", value_name = "PREFIX")]
    pub app_paths: Vec<String>,
}

/// Stalls as spans to an OpenTelemetry collector (flattened into
/// `record`): each flag overrides the `OTEL_EXPORTER_OTLP_*` variable every
/// OpenTelemetry exporter reads.
#[derive(Args, Debug, Clone, Default)]
pub struct OtlpArgs {
    /// Send each stall as a span to this OTLP collector
    /// (`OTEL_EXPORTER_OTLP_ENDPOINT`): `http://127.0.0.1:4318` for
    /// http/protobuf (`/v1/traces` is added), `http://127.0.0.1:4317` for
    /// grpc. The local outputs are written whatever the collector does.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// `grpc` or `http/protobuf` (`OTEL_EXPORTER_OTLP_PROTOCOL`; default
    /// http/protobuf).
    #[arg(long, value_name = "PROTOCOL")]
    pub otlp_protocol: Option<String>,
    /// A header sent with each export, `KEY=VALUE`, repeatable (added to
    /// `OTEL_EXPORTER_OTLP_HEADERS`).
    #[arg(long = "otlp-header", value_name = "KEY=VALUE")]
    pub otlp_headers: Vec<String>,
}

impl OtlpArgs {
    pub fn settings(&self) -> otlp::OtlpSettings {
        otlp::OtlpSettings {
            endpoint: self.otlp_endpoint.clone(),
            protocol: self.otlp_protocol.clone(),
            headers: self.otlp_headers.clone(),
            timeout_ms: None,
        }
    }
}

/// How stalls.folded, stalls.svg, stalls.speedscope.json and stalls.pb.gz
/// show stacks: shared by `record` and `report` (flattened).
#[derive(Args, Debug, Clone, Default)]
pub struct ViewArgs {
    /// Native frames in stalls.folded, stalls.svg, stalls.speedscope.json and stalls.pb.gz:
    /// `user` folds the interpreter's eval and start-up frames away, trims
    /// the loop's common root and shortens native names (Rust/C++ generic
    /// arguments elided: `Harness<…>::poll`); `all` keeps every frame with
    /// its full name (stalls.json always does).
    #[arg(long, value_enum, default_value_t = Native::User)]
    pub native: Native,
    /// A frame per source line (`handle (app.py:144)`, `handle
    /// (app.py:145)`) in stalls.folded, stalls.svg and
    /// stalls.speedscope.json. Default: a frame per function, `handle
    /// (app.py)`. stalls.pb.gz always keeps lines (`go tool pprof -lines`).
    #[arg(long)]
    pub lines: bool,
    /// Root each stack of stalls.folded and stalls.svg in its asyncio task's
    /// coroutine (`task Gateway.handle_request`) or its ASGI route (`route
    /// POST /resume/{rid}`). Default: no such root; the task and route are
    /// labels in stalls.pb.gz (`-tagroot task`) and attributes in the
    /// timelines.
    #[arg(long, value_enum, value_name = "BY")]
    pub group_by: Option<GroupBy>,
}

impl ViewArgs {
    pub fn view(&self) -> View {
        View {
            native: self.native,
            lines: self.lines,
            group_by: self.group_by,
        }
    }
}

/// What the summary says: shared by `record` and `report` (flattened).
#[derive(Args, Debug, Clone, Default)]
pub struct SummaryArgs {
    /// With stalls in more than one process (a supervisor and its
    /// workers): the top culprits of each process too, after those of all.
    #[arg(long)]
    pub by_process: bool,
    /// `-v` (the global flag, set by `main`): the harmless counters too,
    /// and lines at full width.
    #[arg(skip)]
    pub verbose: bool,
}

impl SummaryArgs {
    /// How the summary printed to stdout is said: the counters explained
    /// by their owners, lines as wide as the terminal (or `-v`: any).
    pub fn options(&self) -> crate::report::summary::Options {
        crate::report::summary::Options {
            by_process: self.by_process,
            verbose: self.verbose,
            width: crate::report::summary::Options::width_for_stdout(self.verbose),
            explain: crate::pipeline::counters::explain,
        }
    }
}
