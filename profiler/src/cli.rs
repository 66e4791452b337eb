//! Command line: the top-level clap parser. Each command's arguments are
//! defined beside the command (`commands::*::*Args`) and turned into a
//! validated config there before any work starts (so bad input fails
//! before a probe is loaded).
//!
//! In: argv. Out: a [`Command`] holding that command's arguments.
use clap::{Parser, Subcommand};

use crate::commands::{daemon::DaemonArgs, record::RecordArgs, report::ReportArgs, top::TopArgs};

const EXAMPLES: &str = "\
EXAMPLES:
    # Find stalls over 50 ms in a running service for 30 seconds
    sudo stallprof record --pid 4242 --duration 30s

    # Start a command under the profiler, 20 ms threshold, outputs in ./out
    # (the command runs as you, not root; the outputs are yours, mode 0600)
    sudo stallprof record --threshold 20ms -o out -- python3 app.py

    # ... or as the service's own account
    sudo stallprof record --user www-data -- python3 app.py

    # Re-render a recording with a higher threshold (into a new out-report-<random>/)
    stallprof report out --threshold 100ms

    # Save the raw records too, then look at shorter stalls later
    sudo stallprof record --save-events -o out -- python3 app.py
    stallprof report out --threshold 10ms -o out-10ms

    # Every native frame in the flamegraph (default: the user's code)
    stallprof report out --native all

    # What changed between two recordings: a differential flamegraph
    stallprof report --diff before after -o diff

    # Watch a running service live: stalls/s, p99/max and culprits over 60 s
    sudo stallprof top --pid 4242
";

/// `stallprof --version`: the release, the commit it was built from
/// (`unknown` from a source tarball) and the SHA-256 of the embedded eBPF
/// object (profiler/build.rs). The recording format has its own version
/// (stalls.json `version`, docs/format.md), independent of this one.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("STALLPROF_GIT_COMMIT"),
    ", eBPF object sha256:",
    env!("STALLPROF_BPF_SHA256"),
    ")"
);

#[derive(Parser, Debug)]
#[command(
    name = "stallprof",
    version = VERSION,
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
    /// A live view of a running process's stalls, redrawn every second (q quits).
    #[command(after_help = EXAMPLES)]
    Top(TopArgs),
    /// Watch every event-loop process on the host: Prometheus metrics and rolling reports.
    Daemon(DaemonArgs),
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
