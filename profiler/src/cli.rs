//! Command line: clap derive types, turned into validated configs before any
//! work starts (so bad input fails before a probe is loaded).
//!
//! In: argv. Out: `Command` with `RecordConfig` / `ReportConfig`.
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use thiserror::Error;

const EXAMPLES: &str = "\
EXAMPLES:
    # Find stalls over 50 ms in a running service for 30 seconds
    sudo stallprof record --pid 4242 --duration 30s

    # Start a command under the profiler, 20 ms threshold, outputs in ./out
    sudo stallprof record --threshold 20ms -o out -- python3 app.py

    # Re-render a recording with a higher threshold
    stallprof report out --threshold 100ms

    # Save the raw records too, then look at shorter stalls later
    sudo stallprof record --save-events -o out -- python3 app.py
    stallprof report out --threshold 10ms -o out-10ms
";

#[derive(Parser, Debug)]
#[command(
    name = "stallprof",
    version,
    about = "Who froze the event loop, and where did the whole stall go?",
    long_about = "stallprof finds every busy period of an event-loop thread (asyncio, uvloop, \
                  libuv, tokio, plain epoll loops) longer than a threshold, and splits its time \
                  into on-CPU, blocked (in which syscall) and run-queue wait, with stacks sampled \
                  across the whole stall. It attaches from outside with eBPF: no change to the \
                  target, no restart.",
    after_help = EXAMPLES
)]
pub struct Cli {
    /// More log output (-v: info, -vv: debug, -vvv: trace).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Record the stalls of a running process (--pid) or of a command (-- CMD).
    #[command(after_help = EXAMPLES)]
    Record(RecordArgs),
    /// Re-render a saved recording (stalls.json) without the target.
    #[command(after_help = EXAMPLES)]
    Report(ReportArgs),
    /// Watch every event-loop process on the host: Prometheus metrics and rolling reports.
    Daemon(crate::daemon::DaemonArgs),
}

#[derive(Args, Debug, Clone)]
pub struct StallArgs {
    /// Busy periods at least this long are stalls (e.g. 50ms, 0.2s, 1s).
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    pub threshold: u64,
}

#[derive(Args, Debug)]
pub struct RecordArgs {
    /// Process to attach to.
    #[arg(short, long, conflicts_with = "command")]
    pub pid: Option<u32>,
    /// Only these threads count as executors (repeatable). Default: every
    /// thread that parks in an event-loop wait.
    #[arg(long = "tid")]
    pub tids: Vec<u32>,
    #[command(flatten)]
    pub stall: StallArgs,
    /// CPU-clock sampling frequency in Hz for on-CPU stacks.
    #[arg(short = 'F', long, default_value_t = 999, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub frequency: u64,
    /// Skip CPU samples in the first DUR of every busy period, and do not
    /// report busy periods shorter than DUR at all, inside the kernel: the
    /// loop's short iterations then cost no stack copy. 0 takes every sample.
    /// Default: threshold/20, at most 2ms.
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    pub sample_after: Option<u64>,
    /// Stop after this long (e.g. 30s, 5m). Default: until Ctrl-C or the target exits.
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<u64>,
    /// Output directory (default ./stallprof-<pid>-<time>/).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Also save a recording that replays everything without the target:
    /// the kernel's raw records before unwinding (events.bin.gz), what the
    /// unwinder read (unwind.json.gz) and every symbol (symbols.json).
    /// `report --threshold` can then go below the recorded threshold.
    #[arg(long)]
    pub save_events: bool,
    /// No live status line.
    #[arg(short, long)]
    pub quiet: bool,
    /// Command to start and profile from its first instruction.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A directory written by `stallprof record` (or its stalls.json).
    pub input: PathBuf,
    /// Only stalls at least this long. Below the recording's threshold it
    /// replays the raw records of a `--save-events` recording.
    #[arg(long, value_parser = parse_duration)]
    pub threshold: Option<u64>,
    /// Where to write the re-rendered files (default: the input directory).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DurationError {
    #[error("'{0}' is not a duration: write a number with a unit, e.g. 50ms, 0.2s, 2s, 1m")]
    Malformed(String),
    #[error("'{0}' has an unknown unit: use ns, us, ms, s, m or h (e.g. 50ms)")]
    Unit(String),
}

/// Parse `50ms`, `0.2s`, `2s`, `1m`, `750us`, `100ns` into nanoseconds.
pub fn parse_duration(s: &str) -> Result<u64, DurationError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() || num.chars().filter(|&c| c == '.').count() > 1 {
        return Err(DurationError::Malformed(s.to_string()));
    }
    let value: f64 = num
        .parse()
        .map_err(|_| DurationError::Malformed(s.to_string()))?;
    let scale = match unit.trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "m" => 60e9,
        "h" => 3600e9,
        // Zero needs no unit.
        "" if value == 0.0 => 1.0,
        "" => return Err(DurationError::Malformed(s.to_string())),
        _ => return Err(DurationError::Unit(s.to_string())),
    };
    Ok((value * scale).round() as u64)
}

/// Human form of a nanosecond duration: `1.23s`, `85.0ms`, `420us`.
pub fn fmt_ns(ns: u64) -> String {
    if ns >= 1_000_000_000 {
        format!("{:.2}s", ns as f64 / 1e9)
    } else if ns >= 1_000_000 {
        format!("{:.1}ms", ns as f64 / 1e6)
    } else {
        format!("{}us", ns / 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("50ms"), Ok(50_000_000));
        assert_eq!(parse_duration("0.2s"), Ok(200_000_000));
        assert_eq!(parse_duration("2s"), Ok(2_000_000_000));
        assert_eq!(parse_duration("1m"), Ok(60_000_000_000));
        assert_eq!(parse_duration("750us"), Ok(750_000));
        assert_eq!(parse_duration("0"), Ok(0));
        assert!(matches!(
            parse_duration("banana"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            parse_duration("50"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            parse_duration("5 parsecs"),
            Err(DurationError::Unit(_))
        ));
        assert!(matches!(
            parse_duration("1.2.3s"),
            Err(DurationError::Malformed(_))
        ));
    }

    #[test]
    fn record_takes_command_after_dashes() {
        let cli = Cli::try_parse_from([
            "stallprof",
            "record",
            "--threshold",
            "10ms",
            "--",
            "python3",
            "-c",
            "pass",
        ])
        .unwrap();
        let Command::Record(r) = cli.command else {
            panic!()
        };
        assert_eq!(r.command, ["python3", "-c", "pass"]);
        assert_eq!(r.stall.threshold, 10_000_000);
    }

    #[test]
    fn bad_threshold_names_the_format() {
        let err =
            Cli::try_parse_from(["stallprof", "record", "--threshold", "banana", "--", "true"])
                .unwrap_err();
        assert!(err.to_string().contains("e.g. 50ms"), "{err}");
    }
}
