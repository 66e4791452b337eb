//! Command line: the top-level clap parser. Each command's arguments are
//! defined beside the command (`commands::*::*Args`) and turned into a
//! validated config there before any work starts (so bad input fails
//! before a probe is loaded).
//!
//! In: argv. Out: a [`Command`] holding that command's arguments.
use clap::{Parser, Subcommand};

use crate::commands::{daemon::DaemonArgs, record::RecordArgs, report::ReportArgs, top::TopArgs};

/// The top level's examples: one of each command.
const EXAMPLES: &str = "\
EXAMPLES:
    # Find stalls over 50 ms in a running service (and its workers) for 30 s
    sudo stallprof record --pid 4242 --duration 30s

    # Re-render a recording with a higher threshold
    stallprof report out --threshold 100ms

    # Watch a running service live
    sudo stallprof top --pid 4242

    # Every event-loop process on the host, as a service
    sudo stallprof daemon --config /etc/stallprof/daemon.toml

    `stallprof <command> --help` shows each command's own examples.
";

const RECORD_EXAMPLES: &str = "\
EXAMPLES:
    # Find stalls over 50 ms in a running service for 30 seconds
    sudo stallprof record --pid 4242 --duration 30s

    # A supervisor's pid (gunicorn, uvicorn --workers, Node's cluster, pm2)
    # records its workers, and those it starts meanwhile; the master alone:
    sudo stallprof record --pid 4242 --no-subprocesses

    # Start a command under the profiler, 20 ms threshold, outputs in ./out
    # (the command runs as you, not root; the outputs are yours, mode 0600)
    sudo stallprof record --threshold 20ms -o out -- python3 app.py

    # ... or as the service's own account
    sudo stallprof record --user www-data -- python3 app.py

    # Save the raw records too, to look at shorter stalls later (stallprof report)
    sudo stallprof record --save-events -o out -- python3 app.py

    # CI: fail (exit 3) if any stall reached 200 ms
    sudo stallprof record --fail-on-stall 200ms -o out -- python3 load_test.py
";

const REPORT_EXAMPLES: &str = "\
EXAMPLES:
    # Re-render a recording with a higher threshold (into a new out-report-<random>/)
    stallprof report out --threshold 100ms

    # Shorter stalls than recorded (the recording was made with --save-events)
    stallprof report out --threshold 10ms -o out-10ms

    # Every native frame in the flamegraph (default: the user's code)
    stallprof report out --native all

    # What changed between two recordings: a differential flamegraph
    stallprof report --diff before after -o diff

    # Look at it in a browser: the outputs served on 127.0.0.1 until Ctrl-C
    stallprof report out --open
    stallprof report out --serve 127.0.0.1:8080
";

const TOP_EXAMPLES: &str = "\
EXAMPLES:
    # Watch a running service live: stalls/s, p99/max and culprits over 60 s
    sudo stallprof top --pid 4242

    # A supervisor's pid: a row per worker
    sudo stallprof top --pid 4242 --window 30s
";

const DAEMON_EXAMPLES: &str = "\
EXAMPLES:
    # Every event-loop process on the host: metrics on 127.0.0.1:9436, rolling
    # reports in /var/lib/stallprof
    sudo stallprof daemon

    # Check a configuration, then run with it
    stallprof daemon --config /etc/stallprof/daemon.toml --check-config
    sudo stallprof daemon --config /etc/stallprof/daemon.toml
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
    #[command(after_help = RECORD_EXAMPLES)]
    Record(RecordArgs),
    /// Re-render a saved recording (stalls.json) without the target.
    #[command(after_help = REPORT_EXAMPLES)]
    Report(ReportArgs),
    /// A live view of a running process's stalls, redrawn every second (q quits).
    #[command(after_help = TOP_EXAMPLES)]
    Top(TopArgs),
    /// Watch every event-loop process on the host: Prometheus metrics and rolling reports.
    #[command(after_help = DAEMON_EXAMPLES)]
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

    /// Each command's help shows its own examples, not the others'.
    #[test]
    fn each_command_shows_its_own_examples() {
        let mut cli = Cli::command();
        for verb in ["record", "report", "top", "daemon"] {
            let help = cli
                .find_subcommand_mut(verb)
                .unwrap()
                .render_long_help()
                .to_string();
            let examples = &help[help.find("EXAMPLES:").expect(verb)..];
            for other in ["record", "report", "top", "daemon"] {
                let used = examples.contains(&format!("stallprof {other} "));
                assert_eq!(
                    used,
                    other == verb,
                    "`{verb} --help` and `stallprof {other}`"
                );
            }
        }
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
