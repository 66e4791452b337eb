//! Project automation: `cargo xtask setup | build | demo | test | bench`.
//!
//! `setup` makes a fresh machine able to build the eBPF programs, and is
//! idempotent and fast when everything is present:
//! - the nightly toolchain's `rust-src` (for `-Z build-std=core`);
//! - `bpf-linker`, built against the nightly toolchain's own libLLVM (Debian's
//!   LLVM is too old), kept under ~/.cache/stallprof and rebuilt when the
//!   nightly changes;
//! - tracefs mounted at /sys/kernel/tracing.
//! Every other command runs `setup` first.
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod bench;

const BPF_LINKER_VERSION: &str = "0.13.0";

#[derive(Parser)]
#[command(name = "xtask", about = "stallprof project automation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building the eBPF programs needs (idempotent).
    Setup,
    /// Build everything (release).
    Build,
    /// Run the bundled asyncio demo under `stallprof record` and write its flamegraph.
    Demo {
        /// How long the demo service runs, in seconds.
        #[arg(long, default_value_t = 8)]
        seconds: u32,
        /// Output directory.
        #[arg(short, long, default_value = "demo-out")]
        output: PathBuf,
    },
    /// Run every test tier: unit, golden and root integration tests.
    Test {
        /// Extra arguments for `cargo test` (after --).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Measure accuracy, overhead, agent cost and scaling; writes docs/benchmarks.md.
    Bench {
        /// Fewer repetitions and shorter runs (a smoke run, ~5 min).
        #[arg(long)]
        quick: bool,
        /// Only this section (repeatable): accuracy, overhead, agent, scaling.
        /// A partial run writes target/bench/benchmarks-partial.md instead.
        #[arg(long, value_name = "SECTION")]
        only: Vec<String>,
    },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn cache_dir() -> PathBuf {
    let home = env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/stallprof")
}

fn linker_bin_dir() -> PathBuf {
    cache_dir().join("bpf-linker/bin")
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: running {cmd:?}");
    let st = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed with {st}");
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn setup() -> Result<()> {
    // 1. nightly + rust-src
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "nightly",
    ]))
    .context("no nightly toolchain: install it with `rustup toolchain install nightly`")?;
    if !installed.lines().any(|l| l.starts_with("rust-src")) {
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }

    // 2. bpf-linker against the nightly's libLLVM
    let sysroot = PathBuf::from(
        output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?.trim(),
    );
    let libdir = sysroot.join("lib");
    let libllvm = fs::read_dir(&libdir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so."))
        .with_context(|| {
            format!(
                "no libLLVM.so.* in {}: the nightly toolchain looks incomplete",
                libdir.display()
            )
        })?;
    // libLLVM.so.22.1-rust-1.97.0-nightly -> 22
    let major: String = libllvm["libLLVM.so.".len()..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    let stamp_want = format!("{BPF_LINKER_VERSION} {libllvm} {}", sysroot.display());
    let stamp = cache_dir().join("bpf-linker/STAMP");
    let linker = linker_bin_dir().join("bpf-linker");
    let fresh = linker.exists()
        && fs::read_to_string(&stamp)
            .map(|s| s.trim() == stamp_want)
            .unwrap_or(false)
        && Command::new(&linker)
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
    if !fresh {
        let prefix = cache_dir().join("llvm-prefix");
        let plib = prefix.join("lib");
        fs::create_dir_all(&plib)?;
        for name in ["libLLVM.so", libllvm.as_str()] {
            let link = plib.join(name);
            let _ = fs::remove_file(&link);
            std::os::unix::fs::symlink(libdir.join(&libllvm), &link)?;
        }
        eprintln!(
            "xtask: building bpf-linker {BPF_LINKER_VERSION} against {libllvm} (about a minute)"
        );
        run(Command::new("cargo")
            .args([
                "install",
                "--locked",
                "--force",
                &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            ])
            .args([
                "--no-default-features",
                "--features",
                &format!("llvm-{major}"),
            ])
            .arg("--root")
            .arg(cache_dir().join("bpf-linker"))
            .env("LLVM_PREFIX", &prefix))?;
        fs::write(&stamp, stamp_want)?;
    }

    // 3. tracefs (needs root; only warn otherwise, tests will say more)
    if !Path::new("/sys/kernel/tracing/events").exists() {
        let st = Command::new("mount")
            .args(["-t", "tracefs", "tracefs", "/sys/kernel/tracing"])
            .status();
        if !matches!(st, Ok(s) if s.success()) {
            eprintln!(
                "xtask: warning: tracefs is not mounted at /sys/kernel/tracing and mounting failed (are you root?)"
            );
        }
    }
    Ok(())
}

/// `cargo` with bpf-linker on PATH.
fn cargo() -> Command {
    let mut c = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    let path = env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![linker_bin_dir()];
    dirs.extend(env::split_paths(&path));
    c.env("PATH", env::join_paths(dirs).unwrap());
    c.current_dir(root());
    c
}

fn build() -> Result<PathBuf> {
    setup()?;
    run(cargo().args(["build", "--release"]))?;
    Ok(root().join("target/release/stallprof"))
}

fn demo(seconds: u32, out: &Path) -> Result<()> {
    let bin = build()?;
    let python = ["python3", "/usr/bin/python3"]
        .into_iter()
        .find(|p| {
            Command::new(p)
                .arg("-c")
                .arg("pass")
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        })
        .context("the demo needs python3 on PATH")?;
    let gateway = root().join("demo/gateway.py");
    let out = if out.is_absolute() {
        out.to_path_buf()
    } else {
        root().join(out)
    };
    let mut cmd = Command::new(&bin);
    cmd.args(["record", "--threshold", "20ms", "-o"])
        .arg(&out)
        .arg("--")
        .arg(python)
        .arg(&gateway)
        .arg(seconds.to_string());
    run(&mut cmd)?;
    eprintln!(
        "\nxtask: open {} in a browser for the stall flamegraph",
        out.join("stalls.svg").display()
    );
    Ok(())
}

fn test(args: &[String]) -> Result<()> {
    setup()?;
    if unsafe_geteuid() != 0 {
        eprintln!(
            "xtask: WARNING: not root — the integration tests need root (BPF) and will FAIL; \
             run as root, or set STALLPROF_SKIP_ROOT_TESTS=1 to skip them explicitly"
        );
    }
    // The root tests drive the release binary (closer to what users run,
    // and faster symbolization); build it first.
    run(cargo().args(["build", "--release"]))?;
    // One test at a time: the root tests measure real victims against
    // their own clocks, and two CPU-bound victims on two cores would turn
    // each other's stalls into run-queue time.
    let mut cmd = cargo();
    cmd.args(["test", "--release", "--no-fail-fast"]).args(args);
    if !args.iter().any(|a| a == "--") {
        cmd.args(["--", "--test-threads=1"]);
    }
    run(&mut cmd)
}

fn unsafe_geteuid() -> u32 {
    // Read it from /proc to stay free of libc here.
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2)?.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Setup => setup(),
        Cmd::Build => build().map(|_| ()),
        Cmd::Demo { seconds, output } => demo(seconds, &output),
        Cmd::Test { args } => test(&args),
        Cmd::Bench { quick, only } => bench::run(quick, &only),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
