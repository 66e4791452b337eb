//! The `stallprof` command: parse, validate, run, print errors with their remedy.
use std::process::ExitCode;

use clap::Parser;
use stallprof::{
    cli::{Cli, Command},
    commands::{
        daemon,
        record::{self, RecordConfig},
        report, top,
    },
    model::text::escape,
};

fn main() -> ExitCode {
    stallprof::os::heap::tune();
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or(format!("stallprof={level}")),
    )
    .format(|buf, record| {
        use std::io::Write;
        // Log lines carry names the target chose (threads, symbols, paths):
        // escaped, so a name cannot forge a line or drive the terminal.
        let ts = buf.timestamp_millis();
        writeln!(
            buf,
            "[{ts} {} {}] {}",
            record.level(),
            record.target(),
            escape(&record.args().to_string())
        )
    })
    .init();
    // `record --fail-on-stall`: a stall reached the limit.
    let mut gate_failed = false;
    let result = match cli.command {
        Command::Record(mut a) => {
            a.summary.verbose = cli.verbose > 0;
            RecordConfig::from_args(a).and_then(record::run).map(|r| {
                gate_failed = r.gate_failed;
                r.text
            })
        }
        Command::Report(mut a) => {
            a.summary.verbose = cli.verbose > 0;
            report::run(a)
        }
        Command::Top(a) => top::run(a),
        Command::Daemon(a) => daemon::run(a),
    };
    match result {
        Ok(summary) => {
            print!("{summary}");
            if gate_failed {
                ExitCode::from(record::GATE_FAILED)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("stallprof: error: {}", escape(&e.to_string()));
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {}", escape(&cause.to_string()));
            }
            ExitCode::FAILURE
        }
    }
}
