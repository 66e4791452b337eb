//! The commands: thin drivers of the engine and the report writers.
pub mod daemon;
pub mod live;
pub mod record;
pub mod report;
pub mod top;

use clap::Args;

use crate::os::units::parse_duration;

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
