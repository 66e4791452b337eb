//! Project automation: `cargo xtask setup | build | demo | test | bench | dist`.
//!
//! `setup` makes a fresh machine able to build the eBPF programs, and is
//! idempotent and fast when everything is present:
//! - the nightly toolchain's `rust-src` (for `-Z build-std=core`);
//! - `bpf-linker`, built against the nightly toolchain's own libLLVM (Debian's
//!   LLVM is too old), kept under ~/.cache/stallprof and rebuilt when the
//!   nightly changes;
//! - tracefs mounted at /sys/kernel/tracing.
//!
//! Every other command runs `setup` first.
//!
//! `test` (and `setup --tests`) also installs what the tests need, the same
//! way (idempotent; no network when everything is present): the system tools
//! the root tests run (bpftool, cc, objdump, tmux, Debian's /usr/bin/python3.11,
//! /usr/bin/node, npm, pip) with apt-get, and the daemon tests' readers at
//! pinned versions under target/daemon-test-deps, the FastAPI victim's
//! packages (pinned) in a CPython 3.11 venv at target/asgi-venv (with
//! playwright, pinned, for the viewer test), the viewer test's browser and
//! viewers (Debian chromium, chromium-driver, golang-1.19-go's pprof,
//! graphviz; npm speedscope, pinned, under target/viewer-test-deps), the express
//! victim's npm packages (pinned by its package-lock.json) by `npm ci` into
//! target/express-victim, and (as root) the
//! container sandbox: a Debian testing root filesystem with python3.13,
//! 3.14, 3.15 and nodejs under ~/.cache/stallprof/forky-root, built once by
//! debootstrap (docs/containers.md); for `dist` and tests/dist.rs, podman,
//! python3-venv and dpkg with apt-get, and Debian's prometheus package
//! fetched with `apt-get download` and unpacked (never installed) under
//! target/dist-test-deps/prometheus. The README's test command
//! alone prepares a fresh machine; CI's `.ci/run` adds nothing to it.
//! A whole `test` run (no test named) then runs each fuzz target in
//! profiler/fuzz/ for 15 s with `cargo +nightly fuzz` (cargo-fuzz installed
//! under ~/.cache/stallprof/cargo-fuzz when missing) and fails if one
//! crashes.
//!
//! `dist` builds the release artifacts into target/dist (dist.rs); `test`
//! builds them first when its tests include profiler/tests/dist.rs (a whole
//! run, or `--test dist`), twice, and fails when the second packing differs.
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod bench;
mod dist;
mod testlog;

const BPF_LINKER_VERSION: &str = "0.13.0";
/// The daemon tests parse /metrics with Python's prometheus_client and read
/// pprof files with npm's pprof-format (target/daemon-test-deps/{py,node}).
const PROMETHEUS_CLIENT_VERSION: &str = "0.26.0";
const PPROF_FORMAT_VERSION: &str = "2.3.2";
/// The FastAPI victims' packages (tests/record_frameworks.rs,
/// tests/record_service.rs), every one pinned, installed with `--no-deps`
/// into a CPython 3.11 venv at target/asgi-venv: uvicorn[standard] (uvloop,
/// httptools), FastAPI, the libraries its handlers block in (pypdf,
/// requests), gunicorn, the pre-fork supervisor the service tests run
/// uvicorn's workers under (it needs nothing beyond the standard library),
/// OpenTelemetry's SDK and FastAPI instrumentation, and aiohttp, with
/// their dependencies.
const ASGI_PACKAGES: &[&str] = &[
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "annotated-types==0.8.0",
    "annotated-doc==0.0.7",
    "typing_extensions==4.16.0",
    "typing-inspection==0.4.5",
    "anyio==4.16.0",
    "idna==3.20",
    "uvicorn==0.54.0",
    "click==8.5.1",
    "h11==0.16.0",
    "uvloop==0.23.0",
    "httptools==0.9.0",
    "python-dotenv==1.2.4",
    "PyYAML==6.0.4",
    "watchfiles==1.3.0",
    "websockets==17.4",
    "opentelemetry-api==1.45.2",
    "pypdf==7.1.1",
    "requests==2.34.2",
    "urllib3==2.8.0",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
    "gunicorn==27.0.1",
    // OpenTelemetry as a service uses it (the SDK's batch processor, the
    // FastAPI instrumentation's server spans): py_fastapi.py --otel.
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-instrumentation==0.66b2",
    "opentelemetry-instrumentation-asgi==0.66b2",
    "opentelemetry-instrumentation-fastapi==0.66b2",
    "opentelemetry-util-http==0.66b2",
    "asgiref==3.13.0",
    "packaging==26.4",
    "wrapt==2.5.2",
    // aiohttp, the other asyncio web server: py_aiohttp.py.
    "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "attrs==26.1.0",
    "frozenlist==1.8.0",
    "multidict==7.2.1",
    "propcache==0.5.4",
    "yarl==1.25.1",
];
/// The viewer test's browser driver (tests/viewers.rs), in the same venv:
/// playwright drives Debian's /usr/bin/chromium (never `playwright
/// install`: no browser is downloaded), with its two dependencies.
const BROWSER_PACKAGES: &[&str] = &["playwright==1.65.3", "greenlet==3.5.6", "pyee==13.0.1"];
/// The OTLP receivers the export test sends stalls to (tests/record_otlp.rs),
/// in the same venv: oteltap (OTLP over HTTP/protobuf, loopback, prints
/// each span as JSON) and rotel (an OTLP collector, gRPC and HTTP, a Rust
/// binary in its wheel, logging each span it receives): two receivers
/// written by others, one per protocol.
const OTLP_RECEIVER_PACKAGES: &[&str] = &[
    "oteltap==1.0.0",
    "opentelemetry-proto==1.45.2",
    "protobuf==7.36.2",
    "rotel==0.0.1a15",
];
/// speedscope's npm release whose static app the viewer test opens
/// (under target/viewer-test-deps/node).
const SPEEDSCOPE_VERSION: &str = "1.25.0";

#[derive(Parser)]
#[command(name = "xtask", about = "stallprof project automation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building the eBPF programs needs (idempotent).
    Setup {
        /// Also install what the tests need (what `test` installs first).
        #[arg(long)]
        tests: bool,
    },
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
        /// Only this section (repeatable): accuracy, overhead, host, agent, scaling.
        /// A partial run writes target/bench/benchmarks-partial.md instead.
        #[arg(long, value_name = "SECTION")]
        only: Vec<String>,
    },
    /// Build the release artifacts into target/dist: static binary tarball,
    /// Python wheel, .deb, OCI image (podman/buildah), SHA256SUMS.
    Dist,
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
    let target =
        env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from);
    Ok(target.join("release/stallprof"))
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

/// A system tool the tests run, and the Debian package that provides it.
struct Tool {
    package: &'static str,
    /// What needs it, for the "installing" line.
    purpose: &'static str,
    present: fn() -> bool,
}

const TEST_TOOLS: &[Tool] = &[
    Tool {
        package: "bpftool",
        purpose: "the root tests (they check that stallprof unloads its BPF programs)",
        present: || succeeds(Command::new("bpftool").arg("version")),
    },
    Tool {
        package: "gcc",
        purpose: "the C victims (cc)",
        present: || on_path("cc"),
    },
    Tool {
        package: "binutils",
        purpose: "the tokio victim's frame-pointer check (objdump)",
        present: || on_path("objdump"),
    },
    Tool {
        package: "python3.11",
        purpose: "the Python tests (Debian's stripped /usr/bin/python3.11)",
        present: || Path::new("/usr/bin/python3.11").exists(),
    },
    Tool {
        package: "nodejs",
        purpose: "the Node test (/usr/bin/node) and the daemon tests' pprof reader",
        present: || Path::new("/usr/bin/node").exists(),
    },
    Tool {
        package: "npm",
        purpose: "the daemon tests (installs their pprof reader)",
        present: || on_path("npm"),
    },
    Tool {
        package: "tmux",
        purpose: "the `stallprof top` test (a real terminal: send-keys, capture-pane)",
        present: || on_path("tmux"),
    },
    Tool {
        package: "python3-pip",
        purpose: "the daemon tests (`python3 -m pip` installs their Prometheus parser)",
        present: || succeeds(Command::new("python3").args(["-m", "pip", "--version"])),
    },
    Tool {
        package: "python3-venv",
        purpose: "the dist tests (the wheel is pip-installed into a fresh venv)",
        present: python3_makes_venvs,
    },
    Tool {
        package: "podman",
        purpose: "`cargo xtask dist` (builds the OCI image) and the dist tests (run it)",
        present: || succeeds(Command::new("podman").arg("--version")),
    },
    Tool {
        package: "chromium",
        purpose: "the viewer test (headless Chromium opens speedscope, the SVG and pprof's UI)",
        present: || Path::new("/usr/bin/chromium").exists(),
    },
    Tool {
        package: "chromium-driver",
        purpose: "the viewer test (chromedriver, for drivers that want it)",
        present: || Path::new("/usr/bin/chromedriver").exists(),
    },
    Tool {
        package: "golang-1.19-go",
        purpose: "the viewer test (Go's pprof tool and its web UI)",
        present: || Path::new("/usr/lib/go-1.19/pkg/tool/linux_amd64/pprof").exists(),
    },
    Tool {
        package: "graphviz",
        purpose: "the viewer test (pprof's graph view needs dot)",
        present: || on_path("dot"),
    },
    Tool {
        package: "dpkg",
        purpose: "`cargo xtask dist` (dpkg-deb builds the .deb) and the dist tests (dpkg installs it into a scratch root)",
        present: || on_path("dpkg-deb") && on_path("dpkg"),
    },
];

/// `python3 -m venv` with pip works (Debian's python3 needs python3-venv
/// for ensurepip).
fn python3_makes_venvs() -> bool {
    let dir = env::temp_dir().join(format!("stallprof-venv-probe-{}", std::process::id()));
    let ok = succeeds(Command::new("python3").args(["-m", "venv"]).arg(&dir))
        && dir.join("bin/pip").exists();
    let _ = fs::remove_dir_all(&dir);
    ok
}

/// Debian's Prometheus server and promtool for the dist tests, unpacked
/// (never installed: installing the package would start a Prometheus
/// service on the host) under target/dist-test-deps/prometheus.
fn prometheus_for_tests() -> Result<()> {
    let dir = root().join("target/dist-test-deps");
    let tree = dir.join("prometheus");
    let ready = |t: &Path| {
        ["usr/bin/prometheus", "usr/bin/promtool"]
            .iter()
            .all(|b| succeeds(Command::new(t.join(b)).arg("--version")))
    };
    if ready(&tree) {
        return Ok(());
    }
    if unsafe_geteuid() != 0 {
        bail!(
            "the dist tests need Debian's prometheus package unpacked under {} and only root \
             can fetch it here (`apt-get update`): run `cargo xtask setup --tests` as root",
            tree.display()
        );
    }
    eprintln!(
        "xtask: fetching Debian's prometheus package (the Prometheus server and promtool for \
         the dist tests) and unpacking it into {} (not installed: no service is started)",
        tree.display()
    );
    fs::create_dir_all(&dir)?;
    let download = || {
        Command::new("apt-get")
            .args(["download", "-qq", "prometheus"])
            .current_dir(&dir)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !download() {
        run(Command::new("apt-get")
            .args(["update", "-qq"])
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
        if !download() {
            bail!("`apt-get download prometheus` failed (see above): the dist tests need it");
        }
    }
    let deb = fs::read_dir(&dir)?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("prometheus_"))
        })
        .max()
        .context("apt-get download left no prometheus_*.deb")?;
    let tmp = dir.join("prometheus.tmp");
    let _ = fs::remove_dir_all(&tmp);
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tmp))?;
    let _ = fs::remove_dir_all(&tree);
    fs::rename(&tmp, &tree)?;
    fs::remove_file(&deb)?;
    if !ready(&tree) {
        bail!(
            "{} holds no working usr/bin/prometheus and usr/bin/promtool",
            tree.display()
        );
    }
    Ok(())
}

/// Installs what the tests need beyond the build: missing system tools with
/// apt-get (`apt-get update` only then), and the daemon tests' readers at
/// their pinned versions. Idempotent; a few stats and process runs when
/// everything is present.
fn test_setup() -> Result<()> {
    let missing: Vec<&Tool> = TEST_TOOLS.iter().filter(|t| !(t.present)()).collect();
    if !missing.is_empty() {
        let packages: Vec<&str> = missing.iter().map(|t| t.package).collect();
        if unsafe_geteuid() != 0 {
            eprintln!(
                "xtask: WARNING: the tests need {} and only root can install them \
                 (`apt-get install -y {}`); the tests that need them will FAIL",
                packages.join(", "),
                packages.join(" ")
            );
        } else {
            apt_install(&missing)?;
        }
    }

    let deps = root().join("target/daemon-test-deps");
    let py = deps.join("py");
    let dist_info = py.join(format!(
        "prometheus_client-{PROMETHEUS_CLIENT_VERSION}.dist-info"
    ));
    if !dist_info.is_dir() {
        eprintln!(
            "xtask: installing prometheus-client {PROMETHEUS_CLIENT_VERSION} for the daemon tests (their Prometheus parser) into {}",
            py.display()
        );
        run(pip_install("python3")
            .args(["--root-user-action", "ignore", "--upgrade"])
            .arg("--target")
            .arg(&py)
            .arg(format!("prometheus-client=={PROMETHEUS_CLIENT_VERSION}")))?;
    }
    let node = deps.join("node");
    let package_json = node.join("node_modules/pprof-format/package.json");
    let have = fs::read_to_string(&package_json)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["version"].as_str().map(String::from));
    if have.as_deref() != Some(PPROF_FORMAT_VERSION) {
        eprintln!(
            "xtask: installing pprof-format {PPROF_FORMAT_VERSION} for the daemon tests (their pprof reader) into {}",
            node.display()
        );
        run(Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
            .arg(&node)
            .arg(format!("pprof-format@{PPROF_FORMAT_VERSION}")))?;
    }
    let viewer = root().join("target/viewer-test-deps/node");
    let package_json = viewer.join("node_modules/speedscope/package.json");
    let have = fs::read_to_string(&package_json)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["version"].as_str().map(String::from));
    if have.as_deref() != Some(SPEEDSCOPE_VERSION) {
        eprintln!(
            "xtask: installing speedscope {SPEEDSCOPE_VERSION} for the viewer test (its static app) into {}",
            viewer.display()
        );
        run(Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
            .arg(&viewer)
            .arg(format!("speedscope@{SPEEDSCOPE_VERSION}")))?;
    }
    prometheus_for_tests()?;
    asgi_venv()?;
    express_victim()?;
    if unsafe_geteuid() == 0 {
        forky_root()?;
    }
    Ok(())
}

/// `PYTHON -m pip install --quiet --disable-pip-version-check`, for more
/// arguments.
fn pip_install(python: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(python);
    c.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ]);
    c
}

/// CPython 3.11 as the tests find it (tests/common `find_python`): the
/// newest pyenv 3.11.x, else `python3.11` on PATH.
fn python311() -> Option<PathBuf> {
    let pyenv = env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".pyenv")))?;
    let newest = fs::read_dir(pyenv.join("versions"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let patch: u32 = name.strip_prefix("3.11.")?.parse().ok()?;
            let exe = e.path().join("bin/python3");
            exe.is_file().then_some((patch, exe))
        })
        .max_by_key(|(patch, _)| *patch)
        .map(|(_, exe)| exe);
    newest.or_else(|| {
        env::split_paths(&env::var_os("PATH")?)
            .map(|d| d.join("python3.11"))
            .find(|p| p.is_file())
    })
}

/// target/asgi-venv: a CPython 3.11 venv with [`ASGI_PACKAGES`] (the
/// FastAPI victim's) and [`BROWSER_PACKAGES`] (the viewer test's driver),
/// made again when the pins change. A venv, not
/// `--target`: the packages must sit in a real `site-packages`, as in a
/// deployed service, for stallprof's guess of the app's code.
fn asgi_venv() -> Result<()> {
    let venv = root().join("target/asgi-venv");
    let stamp = venv.join("stallprof-pins.txt");
    let want = [ASGI_PACKAGES, BROWSER_PACKAGES, OTLP_RECEIVER_PACKAGES]
        .concat()
        .join("\n");
    if fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(());
    }
    let Some(python) = python311() else {
        eprintln!(
            "xtask: WARNING: no CPython 3.11 (pyenv 3.11.x or python3.11 on PATH) for the FastAPI \
             victim's venv; install one (`pyenv install 3.11`) or the tests that need it will FAIL"
        );
        return Ok(());
    };
    eprintln!(
        "xtask: installing FastAPI, uvicorn[standard], gunicorn, pypdf, requests, OpenTelemetry and aiohttp (pinned) for the framework and service tests, playwright for the viewer test and two OTLP receivers for the export test (all pinned), into {}",
        venv.display()
    );
    if venv.exists() {
        fs::remove_dir_all(&venv).with_context(|| format!("removing {}", venv.display()))?;
    }
    run(Command::new(&python).args(["-m", "venv"]).arg(&venv)).with_context(|| {
        format!(
            "{} -m venv failed: on Debian install python3.11-venv",
            python.display()
        )
    })?;
    run(pip_install(venv.join("bin/python"))
        .arg("--no-deps")
        .args(ASGI_PACKAGES)
        .args(BROWSER_PACKAGES)
        .args(OTLP_RECEIVER_PACKAGES))?;
    fs::write(&stamp, want).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(())
}

/// target/express-victim: the express victim's packages
/// (profiler/tests/victims/express: package.json and package-lock.json,
/// every version exact, with integrity hashes) installed by `npm ci`, done
/// again when the lock file changes. The test runs the victim's scripts
/// from a scratch directory whose `node_modules` links here, so the
/// packages sit in a real `node_modules`, as in a deployed service.
fn express_victim() -> Result<()> {
    let src = root().join("profiler/tests/victims/express");
    let dst = root().join("target/express-victim");
    let stamp = dst.join("stallprof-lock.json");
    let lock = fs::read_to_string(src.join("package-lock.json"))
        .with_context(|| format!("reading {}/package-lock.json", src.display()))?;
    if fs::read_to_string(&stamp).is_ok_and(|s| s == lock) {
        return Ok(());
    }
    eprintln!(
        "xtask: installing express, bcryptjs, js-yaml and OpenTelemetry (pinned by {}/package-lock.json) for the express victim into {}",
        src.display(),
        dst.display()
    );
    if dst.exists() {
        fs::remove_dir_all(&dst).with_context(|| format!("removing {}", dst.display()))?;
    }
    fs::create_dir_all(&dst)?;
    for f in ["package.json", "package-lock.json"] {
        fs::copy(src.join(f), dst.join(f)).with_context(|| format!("copying {f}"))?;
    }
    run(Command::new("npm")
        .args(["ci", "--silent", "--no-audit", "--no-fund"])
        .current_dir(&dst))?;
    fs::write(&stamp, lock).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(())
}

/// What the container sandbox holds (docs/containers.md): the runtimes the
/// host lacks, from Debian testing.
const FORKY_PACKAGES: &[&str] = &[
    "python3.13",
    "python3.14",
    "python3.15",
    "nodejs",
    // As in service images: ssl.create_default_context() loads the CA
    // bundle (the gateway victim's first step).
    "ca-certificates",
];
const FORKY_BINARIES: &[&str] = &[
    "usr/bin/python3.13",
    "usr/bin/python3.14",
    "usr/bin/python3.15",
    "usr/bin/node",
];
/// Written last into a finished root: the packages it was built with.
const FORKY_STAMP: &str = ".stallprof-forky-root";

/// The container sandbox's root filesystem (tests/record_container.rs).
fn forky_root_dir() -> PathBuf {
    cache_dir().join("forky-root")
}

/// Builds the container sandbox once: a Debian testing ("forky") root with
/// python3.13, 3.14, 3.15 and nodejs, by debootstrap from the Debian mirror
/// apt already uses, under ~/.cache/stallprof/forky-root. Rebuilt when
/// missing or incomplete (no stamp, other packages, a binary gone); a few
/// stats otherwise.
fn forky_root() -> Result<()> {
    let root = forky_root_dir();
    let want = FORKY_PACKAGES.join(",");
    let complete = fs::read_to_string(root.join(FORKY_STAMP)).is_ok_and(|s| s.trim() == want)
        && FORKY_BINARIES.iter().all(|b| root.join(b).is_file());
    if complete {
        return Ok(());
    }
    if !Path::new("/usr/sbin/debootstrap").exists() {
        apt_install(&[&Tool {
            package: "debootstrap",
            purpose: "the container sandbox (a Debian root filesystem for tests/record_container.rs)",
            present: || Path::new("/usr/sbin/debootstrap").exists(),
        }])?;
    }
    let mirror = debian_mirror()?;
    let tmp = cache_dir().join("forky-root.tmp");
    for dir in [&tmp, &root] {
        if dir.exists() {
            refuse_if_mounted_under(dir)?;
            fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
    }
    eprintln!(
        "xtask: building the container sandbox for tests/record_container.rs: a Debian testing \
         (forky) root with {} in {} (debootstrap from {mirror}; about a minute and 500 MB, once)",
        FORKY_PACKAGES.join(", "),
        root.display()
    );
    // Debian 12's debootstrap has no forky script; sid's builds testing.
    run(Command::new("debootstrap")
        .arg("--variant=minbase")
        .arg(format!("--include={want}"))
        .arg("forky")
        .arg(&tmp)
        .arg(&mirror)
        .arg("/usr/share/debootstrap/scripts/sid"))?;
    for b in FORKY_BINARIES {
        if !tmp.join(b).is_file() {
            bail!("debootstrap finished but {} has no {b}", tmp.display());
        }
    }
    fs::write(tmp.join(FORKY_STAMP), &want)?;
    fs::rename(&tmp, &root)?;
    eprintln!("xtask: container sandbox ready in {}", root.display());
    Ok(())
}

/// The Debian archive apt uses here (deb822 `URIs:` or one-line `deb`
/// entries in /etc/apt/sources.list*), not its security archive.
fn debian_mirror() -> Result<String> {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir.filter_map(|e| Some(e.ok()?.path())).collect();
        more.sort();
        files.extend(more);
    }
    for f in files {
        let Ok(text) = fs::read_to_string(&f) else {
            continue;
        };
        for line in text.lines().map(str::trim) {
            let uri = if let Some(rest) = line.strip_prefix("URIs:") {
                rest.split_whitespace().next()
            } else if let Some(rest) = line.strip_prefix("deb ") {
                rest.split_whitespace().find(|w| w.contains("://"))
            } else {
                None
            };
            if let Some(uri) = uri
                && uri.trim_end_matches('/').ends_with("/debian")
            {
                return Ok(uri.trim_end_matches('/').to_string());
            }
        }
    }
    bail!(
        "no Debian archive in /etc/apt/sources.list*: the container sandbox is built by \
         debootstrap from the Debian mirror apt uses"
    )
}

/// A sandbox root must not be removed while something is mounted in it
/// (a victim's /proc): say so instead.
fn refuse_if_mounted_under(dir: &Path) -> Result<()> {
    let dir = fs::canonicalize(dir)?;
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    if let Some(m) = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .find(|m| Path::new(m).starts_with(&dir))
    {
        bail!(
            "{m} is mounted inside {}: unmount it (`umount {m}`) before the sandbox is rebuilt",
            dir.display()
        );
    }
    Ok(())
}

/// Installs the packages of `missing` with apt-get (root), and checks that
/// each tool is there afterwards.
fn apt_install(missing: &[&Tool]) -> Result<()> {
    let packages: Vec<&str> = missing.iter().map(|t| t.package).collect();
    if !on_path("apt-get") {
        bail!(
            "the tests need {} and this machine has no apt-get: install them (Debian package names)",
            packages.join(", ")
        );
    }
    for t in missing {
        eprintln!("xtask: installing {} for {}", t.package, t.purpose);
    }
    run(Command::new("apt-get")
        .args(["update", "-qq"])
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    // --reinstall: also brings back a tool whose package dpkg still lists as
    // installed (a fresh machine's missing packages just install).
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--reinstall"])
        .args(&packages)
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    let still: Vec<&str> = missing
        .iter()
        .filter(|t| !(t.present)())
        .map(|t| t.package)
        .collect();
    if !still.is_empty() {
        bail!(
            "apt-get installed {} but the tests still cannot use {}",
            packages.join(" "),
            still.join(", ")
        );
    }
    Ok(())
}

/// Runs and exits 0 (output discarded).
fn succeeds(cmd: &mut Command) -> bool {
    cmd.output().is_ok_and(|o| o.status.success())
}

/// An executable file named `name` in a PATH directory.
fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    env::var_os("PATH").is_some_and(|path| {
        env::split_paths(&path).any(|d| {
            fs::metadata(d.join(name))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

fn test(args: &[String]) -> Result<()> {
    setup()?;
    let root_user = unsafe_geteuid() == 0;
    if let Err(e) = test_setup() {
        if root_user {
            return Err(e.context("installing what the tests need"));
        }
        eprintln!("xtask: WARNING: {e:#}; the tests that need it will FAIL");
    }
    if !root_user {
        eprintln!(
            "xtask: WARNING: not root — the integration tests need root (BPF) and will FAIL; \
             run as root, or set STALLPROF_SKIP_ROOT_TESTS=1 to skip them explicitly"
        );
    }
    // The root tests drive the release binary (closer to what users run,
    // and faster symbolization); build it first.
    run(cargo().args(["build", "--release"]))?;
    // tests/dist.rs checks the release artifacts: build them (one static
    // build, reused by every artifact), then pack them again and require
    // the same bytes (reproducibility).
    // A failure here fails the run but not the other tests: target/dist is
    // removed, so tests/dist.rs fails on it too instead of testing an old one.
    let dist = if args.is_empty() || args.iter().any(|a| a == "dist") {
        let r = dist_twice();
        if let Err(e) = &r {
            eprintln!("xtask: ERROR: cargo xtask dist: {e:#}");
            let _ = fs::remove_dir_all(dist::dist_dir());
        }
        r
    } else {
        Ok(())
    };
    // One test at a time: the root tests measure real victims against
    // their own clocks, and two CPU-bound victims on two cores would turn
    // each other's stalls into run-queue time.
    let mut cmd = cargo();
    cmd.args(["test", "--release", "--no-fail-fast"]).args(args);
    if !args.iter().any(|a| a == "--") {
        cmd.args(["--", "--test-threads=1"]);
    }
    let mut failures = testlog::Failures::default();
    let tests = failures.run("default probes", &mut cmd);
    // A whole run (no test named) also runs the accuracy tests on the
    // fallback probes, and the fuzz targets, whatever the tests gave: every
    // result decides the exit status.
    let fallback = if args.is_empty() {
        fallback_pass(&mut failures)
    } else {
        Ok(())
    };
    let fuzz = if args.is_empty() { fuzz() } else { Ok(()) };
    // The failed tests, named again where a log's tail shows them.
    failures.print();
    tests.and(fallback).and(fuzz).and(dist)
}

/// The test files that compare recordings with their victims' own clocks,
/// run again on the fallback probes: every one of them. (record_native,
/// record_container and record_express joined once the drain stopped
/// waiting on Node's symbol table: on the classic tracepoints, which see
/// every wait of Node's helper threads, that wait overflowed the ring.)
const ACCURACY_TESTS: &[&str] = &[
    "record_c",
    "record_python",
    "record_python_frames",
    "record_frameworks",
    "record_tasks",
    "record_throttle",
    "record_native",
    "record_container",
    "record_express",
    "record_service",
    "record_held_up",
];

/// The accuracy tests again with `STALLPROF_PROBES=tracepoints`: the
/// classic tracepoints a kernel without BTF (or a process whose waits no
/// uprobe sees) falls back to must be as accurate as the default probes.
/// Every recording on this pass must say it used them (tests/common's
/// `check_contract`). Run it alone with
/// `STALLPROF_PROBES=tracepoints cargo xtask test -- --test record_c`.
fn fallback_pass(failures: &mut testlog::Failures) -> Result<()> {
    eprintln!(
        "xtask: the accuracy tests again on the fallback probes (STALLPROF_PROBES=tracepoints)"
    );
    let mut cmd = cargo();
    cmd.args(["test", "--release", "--no-fail-fast"]);
    for t in ACCURACY_TESTS {
        cmd.args(["--test", t]);
    }
    cmd.args(["--", "--test-threads=1"])
        .env("STALLPROF_PROBES", "tracepoints");
    failures
        .run("fallback probes", &mut cmd)
        .context("the accuracy tests on the fallback probes (STALLPROF_PROBES=tracepoints)")
}

/// `cargo xtask dist`, then its packing again: the same SHA256SUMS, or an
/// error (not reproducible).
fn dist_twice() -> Result<()> {
    let first = dist::run_dist()?;
    let sums = fs::read_to_string(first.dir.join("SHA256SUMS"))?;
    let again = dist::run_dist()?;
    let sums_again = fs::read_to_string(again.dir.join("SHA256SUMS"))?;
    if sums != sums_again {
        bail!(
            "`cargo xtask dist` is not reproducible: packing twice gave\n{sums}and then\n{sums_again}"
        );
    }
    eprintln!("xtask: dist: packing twice gave the same SHA256SUMS (reproducible)");
    Ok(())
}

/// The fuzz targets in profiler/fuzz/ (every parser of bytes the target
/// process controls: docs/security.md), each for [`FUZZ_SECONDS`].
const FUZZ_TARGETS: &[&str] = &[
    "line_table",
    "perf_map",
    "elf_unwind",
    "event",
    "proc_text",
    "debug_offsets",
];
const FUZZ_SECONDS: u32 = 15;
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// Runs every fuzz target for a bounded time with `cargo +nightly fuzz`
/// (installed under ~/.cache/stallprof/cargo-fuzz when missing); an error
/// when one finds a crash (its input is kept under profiler/fuzz/artifacts/).
fn fuzz() -> Result<()> {
    let bin = cache_dir().join("cargo-fuzz/bin");
    let path = env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin.clone(), linker_bin_dir()];
    dirs.extend(env::split_paths(&path));
    let path = env::join_paths(dirs)?;
    // The rustup proxy with `+nightly`, not the stable cargo that runs xtask.
    let nightly_cargo = || {
        let mut c = Command::new("cargo");
        c.arg("+nightly")
            .env("PATH", &path)
            .env_remove("CARGO")
            .env_remove("RUSTC")
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("CARGO_TARGET_DIR")
            .current_dir(root().join("profiler"));
        c
    };
    if !bin.join("cargo-fuzz").exists() {
        eprintln!("xtask: installing cargo-fuzz {CARGO_FUZZ_VERSION} (about a minute, once)");
        run(nightly_cargo()
            .args([
                "install",
                "--locked",
                &format!("cargo-fuzz@{CARGO_FUZZ_VERSION}"),
            ])
            .arg("--root")
            .arg(cache_dir().join("cargo-fuzz")))?;
    }
    run(nightly_cargo().args(["fuzz", "build", "-O"]))
        .map_err(|e| e.context("building the fuzz targets (profiler/fuzz)"))?;
    // Real inputs to start from (random bytes seldom make an ELF file or a
    // maps line): a small executable, and this process's maps, status and
    // cgroup.
    let corpus = root().join("profiler/fuzz/corpus");
    for (target, seed, from) in [
        ("elf_unwind", "true", "/bin/true"),
        ("proc_text", "maps", "/proc/self/maps"),
        ("proc_text", "status", "/proc/self/status"),
        ("proc_text", "cgroup", "/proc/self/cgroup"),
    ] {
        let dir = corpus.join(target);
        fs::create_dir_all(&dir)?;
        if let Ok(bytes) = fs::read(from) {
            fs::write(dir.join(format!("seed-{seed}")), bytes)?;
        }
    }
    let mut crashed = Vec::new();
    for t in FUZZ_TARGETS {
        eprintln!("xtask: fuzzing {t} for {FUZZ_SECONDS} s");
        let max = format!("-max_total_time={FUZZ_SECONDS}");
        if run(nightly_cargo().args(["fuzz", "run", "-O", t, "--", &max])).is_err() {
            crashed.push(*t);
        }
    }
    if crashed.is_empty() {
        Ok(())
    } else {
        Err(anyhow::anyhow!(
            "fuzz targets crashed: {crashed:?}; reproduce with `cargo +nightly fuzz run {} \
             profiler/fuzz/artifacts/<target>/<file>` in profiler/",
            crashed[0]
        ))
    }
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
        Cmd::Setup { tests } => setup().and_then(|()| if tests { test_setup() } else { Ok(()) }),
        Cmd::Build => build().map(|_| ()),
        Cmd::Demo { seconds, output } => demo(seconds, &output),
        Cmd::Test { args } => test(&args),
        Cmd::Bench { quick, only } => bench::run(quick, &only),
        Cmd::Dist => dist::run_dist().map(|_| ()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
