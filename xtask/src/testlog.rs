//! `cargo test` with its failures kept for the end of the run.
//!
//! A whole `cargo xtask test` prints for half an hour, and a CI log often
//! keeps only its tail (the fuzz phase): without this, a failed run says
//! "cargo test failed with exit status 101" and names no test. The test
//! binaries' output still streams through as it comes; each failed test's
//! name and the start of its panic message are kept and printed again by
//! [`Failures::print`] as the run's last words.

use std::{
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

/// Lines of a failed test's output kept for the summary.
const KEPT_LINES: usize = 12;

/// The failed tests of one or more `cargo test` runs.
#[derive(Default)]
pub struct Failures {
    /// (pass, test name, the start of its captured output).
    tests: Vec<(String, String, Vec<String>)>,
}

impl Failures {
    /// Run `cmd` (a `cargo test`), streaming its output, and keep what
    /// failed under the name `pass`. An error when it fails.
    pub fn run(&mut self, pass: &str, cmd: &mut Command) -> Result<()> {
        self.run_to(pass, cmd, &mut std::io::stdout().lock())
    }

    /// [`Failures::run`], its output streamed to `echo`.
    fn run_to(&mut self, pass: &str, cmd: &mut Command, echo: &mut dyn Write) -> Result<()> {
        eprintln!("xtask: running {cmd:?}");
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        let out = child.stdout.take().expect("stdout is piped");
        let mut parser = Parser::default();
        // Bytes, not `lines()`: a test may print invalid UTF-8, and a read
        // that stopped there would leave the pipe full and the tests stuck.
        let mut reader = BufReader::new(out);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) => break,
                Ok(_) => {
                    let _ = echo.write_all(&buf);
                    let line = String::from_utf8_lossy(&buf);
                    parser.line(line.trim_end_matches(['\n', '\r']));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Keep draining is impossible; say so and let the
                    // exit status decide.
                    eprintln!("xtask: reading the tests' output: {e}");
                    break;
                }
            }
        }
        let _ = echo.flush();
        // Closed before the wait: a child still writing gets EPIPE, not a
        // pipe nobody reads.
        drop(reader);
        let st = child
            .wait()
            .with_context(|| format!("waiting for {cmd:?}"))?;
        for (name, lines) in parser.finish() {
            self.tests.push((pass.to_string(), name, lines));
        }
        if !st.success() {
            bail!("{cmd:?} failed with {st}");
        }
        Ok(())
    }

    /// Print every failed test again, with the start of its output: the
    /// last thing a failed run says.
    pub fn print(&self) {
        if self.tests.is_empty() {
            return;
        }
        eprintln!("\nxtask: {} test(s) FAILED:", self.tests.len());
        for (pass, name, lines) in &self.tests {
            eprintln!("  [{pass}] {name}");
            for l in lines {
                eprintln!("      {l}");
            }
        }
    }
}

/// Reads libtest's output: `test NAME ... FAILED` lines name the failures;
/// the `---- NAME stdout ----` blocks after them hold their output.
#[derive(Default)]
struct Parser {
    failed: Vec<(String, Vec<String>)>,
    /// The failure whose output block is being read.
    block: Option<usize>,
}

impl Parser {
    fn line(&mut self, line: &str) {
        if let Some(rest) = line.strip_prefix("test ")
            && let Some(name) = rest.strip_suffix(" ... FAILED")
        {
            self.failed.push((name.to_string(), Vec::new()));
            self.block = None;
            return;
        }
        if let Some(rest) = line.strip_prefix("---- ")
            && let Some(name) = rest.strip_suffix(" stdout ----")
        {
            self.block = self.failed.iter().position(|(n, _)| n == name);
            return;
        }
        // The list of names after the blocks, or the next binary's output.
        if line == "failures:" || line.starts_with("test result:") || line.starts_with("running ") {
            self.block = None;
            return;
        }
        if let Some(i) = self.block {
            let kept = &mut self.failed[i].1;
            // The panic message is what names the cause; the test's own
            // progress output before it is in the full log.
            let keep = !kept.is_empty() || line.contains("panicked at");
            if keep && kept.len() < KEPT_LINES && !line.trim().is_empty() {
                kept.push(line.chars().take(300).collect());
            }
        }
    }

    fn finish(self) -> Vec<(String, Vec<String>)> {
        self.failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_reads_past_invalid_utf8_and_keeps_its_failures() {
        let mut f = Failures::default();
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "printf 'bytes \\377\\376\\n'; printf 'test t::x ... FAILED\\n'; \
             printf -- '---- t::x stdout ----\\n'; \
             printf \"thread 't::x' panicked at a.rs:1:1:\\nboom\\n\"; exit 101",
        ]);
        // Not echoed: this binary's own output is read by `cargo xtask
        // test`, which would take the child's lines for its own tests'.
        let r = f.run_to("pass", &mut cmd, &mut std::io::sink());
        assert!(r.is_err());
        assert_eq!(f.tests.len(), 1);
        assert_eq!(f.tests[0].1, "t::x");
        assert_eq!(
            f.tests[0].2,
            ["thread 't::x' panicked at a.rs:1:1:", "boom"]
        );
    }

    #[test]
    fn failures_are_named_with_their_panic() {
        let log = "\
running 2 tests
test routes::debian_3_14 ... FAILED
test other ... ok

failures:

---- routes::debian_3_14 stdout ----
victim: started
stallprof: 3 stalls

thread 'routes::debian_3_14' panicked at profiler/tests/record_container.rs:10:5:
no route for /upload
note: run with `RUST_BACKTRACE=1`

failures:
    routes::debian_3_14

test result: FAILED. 1 passed; 1 failed
";
        let mut p = Parser::default();
        for l in log.lines() {
            p.line(l);
        }
        let f = p.finish();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].0, "routes::debian_3_14");
        assert_eq!(
            f[0].1,
            [
                "thread 'routes::debian_3_14' panicked at profiler/tests/record_container.rs:10:5:",
                "no route for /upload",
                "note: run with `RUST_BACKTRACE=1`",
            ]
        );
    }
}
