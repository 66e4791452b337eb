//! Shared helpers for the root integration tests: victims in, verdicts out.
//!
//! The tests run real victim programs (tests/victims/), record them with the
//! `stallprof` binary, and compare `stalls.json` / `stalls.folded` /
//! `stalls.svg` with the victim's own CLOCK_MONOTONIC log. Truth comes from the
//! victim: assertions are about function names, lines and durations, never
//! addresses.
//!
//! Constraints:
//! - Root and a working bpf(2) are required. Without them a test FAILS with a
//!   message saying why; `STALLPROF_SKIP_ROOT_TESTS=1` turns that into a loud
//!   SKIPPED line (for non-root dev machines only; CI runs as root).
//! - Every child process is killed in `Drop`, and every wait has a deadline, so
//!   a broken profiler fails a test instead of hanging it.
//! - Recording tests in one test binary run one at a time (`serial()`): two
//!   profilers at once on a 2-core machine would distort the durations under
//!   test, and the BPF-leak check must not see another run's programs.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;

pub const MS: u64 = 1_000_000;

pub fn stallprof_bin() -> &'static str {
    env!("CARGO_BIN_EXE_stallprof")
}

pub fn victims_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/victims")
}

/// One recording at a time per test binary (see module docs).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---------------------------------------------------------------------------
// Preconditions

/// Returns true if the test should run. Panics (fails the test) when not root
/// or when BPF is unusable, unless STALLPROF_SKIP_ROOT_TESTS=1.
pub fn require_root_and_bpf(test: &str) -> bool {
    let problem = root_and_bpf_problem();
    let Some(problem) = problem else { return true };
    if std::env::var("STALLPROF_SKIP_ROOT_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "\n!!!!!!!!!! SKIPPED {test}: {problem}\n!!!!!!!!!! (STALLPROF_SKIP_ROOT_TESTS=1; \
             this test did NOT run, CI must run it as root)\n"
        );
        return false;
    }
    panic!(
        "\n\n{test} CANNOT RUN: {problem}\n\
         These are root integration tests against real processes; they never pass silently.\n\
         Run them as root (e.g. `sudo -E cargo test -p profiler`), or on a non-root dev machine\n\
         set STALLPROF_SKIP_ROOT_TESTS=1 to skip them loudly.\n"
    );
}

fn root_and_bpf_problem() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Some(format!("not running as root (euid {euid})"));
    }
    // BPF_PROG_GET_NEXT_ID (cmd 11) from id 0: ENOENT or success means the
    // bpf(2) syscall works and we may use it; ENOSYS/EPERM say why not.
    let mut attr = [0u32; 4];
    // SAFETY: attr is a zeroed, 16-byte, 4-aligned buffer covering the
    // start_id/next_id/open_flags fields this command reads and writes.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            11 as libc::c_long,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ENOENT) => {}
            Some(libc::ENOSYS) => {
                return Some("the kernel has no bpf(2) syscall (CONFIG_BPF_SYSCALL off)".into());
            }
            Some(libc::EPERM) => {
                return Some(format!(
                    "bpf(2) is not permitted here ({err}); need CAP_BPF/CAP_SYS_ADMIN"
                ));
            }
            _ => return Some(format!("bpf(2) probe failed: {err}")),
        }
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Some("kernel BTF (/sys/kernel/btf/vmlinux) is missing".into());
    }
    None
}

// ---------------------------------------------------------------------------
// Scratch directories

/// A unique directory under the system temp dir. Removed on success, kept
/// (and its path printed) when the test panics, for post-mortems.
pub struct Scratch {
    pub path: PathBuf,
}

impl Scratch {
    pub fn new(test: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let path = std::env::temp_dir().join(format!(
            "stallprof-test-{test}-{}-{nanos}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        Scratch { path }
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test failed; its files are kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

// ---------------------------------------------------------------------------
// The C victim

pub fn c_loop_source() -> PathBuf {
    victims_dir().join("c_loop.c")
}

/// Compiles tests/victims/c_loop.c into `dir/c_loop` (the name becomes its
/// comm). `frame_pointers = false` builds the no-frame-pointer variant.
pub fn build_c_loop(dir: &Path, frame_pointers: bool) -> PathBuf {
    let out = dir.join("c_loop");
    let fp = if frame_pointers {
        "-fno-omit-frame-pointer"
    } else {
        "-fomit-frame-pointer"
    };
    let result = Command::new("cc")
        .args(["-O1", "-g", fp, "-pthread", "-o"])
        .arg(&out)
        .arg(c_loop_source())
        .output()
        .unwrap_or_else(|e| {
            panic!("running cc to build the C victim: {e} (is a C compiler installed?)")
        });
    assert!(
        result.status.success(),
        "cc failed to build {}:\n{}",
        c_loop_source().display(),
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

/// c_loop linked statically (`cc -static`: not position-independent, its
/// image at 0x400000), with its C library's symbols: its waits are found
/// in the image itself.
pub fn build_c_loop_static(dir: &Path) -> PathBuf {
    // Named c_loop too: the checks compare the process's name.
    let sub = dir.join("static");
    std::fs::create_dir_all(&sub).unwrap();
    let out = sub.join("c_loop");
    let result = Command::new("cc")
        .args([
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-pthread",
            "-static",
            "-o",
        ])
        .arg(&out)
        .arg(c_loop_source())
        .output()
        .unwrap_or_else(|e| panic!("running cc: {e} (is a C compiler installed?)"));
    assert!(
        result.status.success(),
        "cc -static failed to build {} (is libc6-dev's libc.a installed?):\n{}",
        c_loop_source().display(),
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

/// [`build_c_loop_static`] with the C library's wait functions' symbols
/// removed: a process whose waits no uprobe can find (as one making raw
/// syscalls), so stallprof must fall back to the syscall tracepoints.
pub fn build_c_loop_without_wait_symbols(dir: &Path) -> PathBuf {
    let out = build_c_loop_static(dir);
    let mut strip = Command::new("objcopy");
    for f in [
        "epoll_wait",
        "epoll_pwait",
        "epoll_pwait2",
        "poll",
        "__poll",
        "ppoll",
        "select",
        "__select",
        "pselect",
    ] {
        strip.arg(format!("--strip-symbol={f}"));
    }
    let result = strip
        .arg(&out)
        .output()
        .unwrap_or_else(|e| panic!("running objcopy: {e} (is binutils installed?)"));
    assert!(
        result.status.success(),
        "objcopy failed: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

/// Line range [first, last] of a top-level C function's definition in
/// c_loop.c: from the line naming it with an opening brace to the next line
/// that is exactly "}".
pub fn c_function_lines(source: &Path, func: &str) -> (u32, u32) {
    let text = std::fs::read_to_string(source).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let needle = format!(" {func}(");
    let start = lines
        .iter()
        .position(|l| !l.starts_with(' ') && l.contains(&needle) && l.trim_end().ends_with('{'))
        .unwrap_or_else(|| panic!("no definition of {func} in {}", source.display()));
    let end = lines[start..]
        .iter()
        .position(|l| *l == "}")
        .map(|i| start + i)
        .unwrap();
    (start as u32 + 1, end as u32 + 1)
}

// ---------------------------------------------------------------------------
// Processes

/// A victim process, killed (SIGKILL) and reaped when dropped.
pub struct Victim {
    pub child: Child,
    pub what: String,
}

impl Victim {
    pub fn spawn(cmd: &mut Command) -> Victim {
        let what = format!("{cmd:?}");
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning victim {what}: {e}"));
        Victim { child, what }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("victim {} exited early: {status}", self.what);
        }
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct RunOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl RunOutput {
    pub fn describe(&self) -> String {
        format!(
            "exit status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// A running `stallprof` with stdout/stderr drained in background threads (so
/// a chatty profiler cannot block on a full pipe). Killed when dropped.
pub struct Profiler {
    child: Option<Child>,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
    pub args: Vec<String>,
    /// Where `record` says it is recording (`STALLPROF_READY_FILE`, set
    /// for every stallprof started here): see [`wait_for_attach`].
    ready: PathBuf,
}

/// A path no other stallprof of any test process is told to write.
fn ready_file_path() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "stallprof-ready-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

impl Profiler {
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Profiler {
        Profiler::spawn_with(args, None)
    }

    /// Runs in `cwd`, and so does the command it starts after `--`: for
    /// targets that write into their current directory (Node with
    /// --perf-basic-prof writes isolate-*-v8.log there), a Scratch dir.
    pub fn spawn_in<S: AsRef<std::ffi::OsStr>>(cwd: &Path, args: &[S]) -> Profiler {
        Profiler::spawn_with(args, Some(cwd))
    }

    fn spawn_with<S: AsRef<std::ffi::OsStr>>(args: &[S], cwd: Option<&Path>) -> Profiler {
        let args_s: Vec<String> = args
            .iter()
            .map(|a| a.as_ref().to_string_lossy().into_owned())
            .collect();
        let mut cmd = Command::new(stallprof_bin());
        if let Some(cwd) = cwd {
            cmd.current_dir(cwd);
        }
        let ready = ready_file_path();
        let _ = std::fs::remove_file(&ready);
        let mut child = cmd
            .args(args)
            .env("STALLPROF_READY_FILE", &ready)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {} {args_s:?}: {e}", stallprof_bin()));
        let out = drain(child.stdout.take().unwrap());
        let err = drain(child.stderr.take().unwrap());
        Profiler {
            child: Some(child),
            out: Some(out),
            err: Some(err),
            args: args_s,
            ready,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Has it exited already? (Used to fail fast while waiting for attach.)
    pub fn try_finished(&mut self) -> Option<RunOutput> {
        let status = self.child.as_mut().unwrap().try_wait().unwrap()?;
        Some(self.collect(status))
    }

    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid() as libc::pid_t, sig) };
    }

    /// Waits for exit; on timeout kills it and panics with what it printed.
    pub fn wait(mut self, timeout: Duration) -> RunOutput {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                return self.collect(status);
            }
            if Instant::now() > deadline {
                let child = self.child.as_mut().unwrap();
                let _ = child.kill();
                let status = child.wait().unwrap();
                let out = self.collect(status);
                panic!(
                    "stallprof {:?} did not exit within {timeout:?}; killed it.\n{}",
                    self.args,
                    out.describe()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn collect(&mut self, status: ExitStatus) -> RunOutput {
        let _ = self.child.as_mut().map(|c| c.wait());
        self.child = None;
        RunOutput {
            status,
            stdout: self
                .out
                .take()
                .map(|h| h.join().unwrap_or_default())
                .unwrap_or_default(),
            stderr: self
                .err
                .take()
                .map(|h| h.join().unwrap_or_default())
                .unwrap_or_default(),
        }
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.ready);
    }
}

/// Runs stallprof to completion with a deadline.
pub fn run_stallprof<S: AsRef<std::ffi::OsStr>>(args: &[S], timeout: Duration) -> RunOutput {
    Profiler::spawn(args).wait(timeout)
}

/// `run_stallprof` in `cwd` (see `Profiler::spawn_in`).
pub fn run_stallprof_in<S: AsRef<std::ffi::OsStr>>(
    cwd: &Path,
    args: &[S],
    timeout: Duration,
) -> RunOutput {
    Profiler::spawn_in(cwd, args).wait(timeout)
}

// ---------------------------------------------------------------------------
// Interpreters: found on the machine, never assumed at a fixed path

/// pyenv's root: $PYENV_ROOT, else ~/.pyenv.
pub fn pyenv_root() -> PathBuf {
    std::env::var_os("PYENV_ROOT")
        .filter(|r| !r.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/root"))
                .join(".pyenv")
        })
}

/// CPython `major.minor` on this machine: the newest pyenv build
/// (`<pyenv root>/versions/M.m.P/bin/python3`, highest P; variants such as
/// free-threaded `3.13.0t` or `3.12-dev` are not candidates), else
/// `pythonM.m` on PATH that says it is that version (resolved to the
/// interpreter it runs, so a pyenv shim is never the victim).
pub fn find_python(major: u32, minor: u32) -> Option<PathBuf> {
    let prefix = format!("{major}.{minor}.");
    let newest = std::fs::read_dir(pyenv_root().join("versions"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let patch: u32 = name.strip_prefix(&prefix)?.parse().ok()?;
            let exe = e.path().join("bin/python3");
            exe.is_file().then_some((patch, exe))
        })
        .max_by_key(|(patch, _)| *patch);
    if let Some((_, exe)) = newest {
        return Some(exe);
    }
    let name = format!("python{major}.{minor}");
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(&name))
        .filter(|c| c.is_file())
        .find_map(|c| {
            let out = Command::new(&c)
                .args([
                    "-c",
                    "import sys; print('%d.%d' % sys.version_info[:2]); print(sys.executable)",
                ])
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output()
                .ok()?;
            let text = String::from_utf8(out.stdout).ok()?;
            let mut lines = text.lines();
            if !out.status.success() || lines.next()? != format!("{major}.{minor}") {
                return None;
            }
            let exe = PathBuf::from(lines.next()?);
            exe.is_file().then_some(exe)
        })
}

/// The python of the venv `cargo xtask test` prepares for the framework
/// victims (xtask/src/main.rs `asgi_venv`: CPython 3.11 with FastAPI,
/// uvicorn[standard], gunicorn, pypdf and requests, pinned); a missing one
/// FAILS the test, saying how to make it.
pub fn asgi_python() -> PathBuf {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/asgi-venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run the tests with `cargo xtask test` (its setup installs FastAPI, \
         uvicorn[standard], gunicorn, pypdf and requests, pinned, into target/asgi-venv), or \
         `cargo xtask setup --tests`",
        py.display()
    );
    py
}

/// Debian's CPython 3.11, /usr/bin/python3.11 (stripped, non-PIE, libpython
/// linked in statically), if installed.
pub fn debian_python311() -> Option<PathBuf> {
    let p = PathBuf::from("/usr/bin/python3.11");
    p.is_file().then_some(p)
}

/// `find_python`, or FAIL the test naming what is missing and how to get it.
pub fn require_python(major: u32, minor: u32) -> PathBuf {
    find_python(major, minor).unwrap_or_else(|| {
        panic!(
            "\n\nCPython {major}.{minor} is MISSING: this test needs it and found neither a pyenv build \
             ({}/versions/{major}.{minor}.*/bin/python3) nor python{major}.{minor} on PATH.\n\
             Install it: `pyenv install {major}.{minor}` (or the distribution's python{major}.{minor}).\n",
            pyenv_root().display()
        )
    })
}

/// `debian_python311`, or FAIL the test naming what is missing and how to get it.
pub fn require_debian_python311() -> PathBuf {
    debian_python311().unwrap_or_else(|| {
        panic!(
            "\n\n/usr/bin/python3.11 (Debian's stripped CPython 3.11) is MISSING: this test needs it.\n\
             `cargo xtask test` installs it when run as root; or: apt-get install -y python3.11\n"
        )
    })
}

// ---------------------------------------------------------------------------
// Victim logs

/// Reads a victim's JSON-lines log. A torn last line (the victim is still
/// writing) is ignored.
pub fn read_log(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

pub fn log_has_kind(path: &Path, kind: &str) -> bool {
    read_log(path).iter().any(|r| r["kind"] == kind)
}

/// Polls the log until a record of `kind` appears.
pub fn wait_for_log_kind(path: &Path, kind: &str, timeout: Duration) -> serde_json::Value {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(r) = read_log(path).into_iter().find(|r| r["kind"] == kind) {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "victim log {} has no {kind:?} record after {timeout:?}; it has:\n{}",
            path.display(),
            std::fs::read_to_string(path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One stalled call or loop iteration as the victim measured it.
#[derive(Debug, Clone)]
pub struct Truth {
    pub kind: String,
    pub func: String,
    pub tid: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    /// The loop thread's CPU time over [start_ns, end_ns].
    pub cpu_ns: u64,
}

impl Truth {
    /// Whether stall `s` overlaps this call, on the call's thread (the
    /// victim logs its own namespace's tid).
    pub fn covers(&self, s: &stallprof::model::Stall) -> bool {
        u64::from(s.ns_tid.unwrap_or(s.tid)) == self.tid
            && s.start_ns < self.end_ns
            && self.start_ns < s.end_ns
    }

    pub fn duration_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }

    /// The call as a failure names it: `func (12.3 ms at START)`.
    pub fn who(&self) -> String {
        format!(
            "{} ({:.1} ms at {})",
            self.func,
            ms(self.duration_ns()),
            self.start_ns
        )
    }
}

pub fn num(r: &serde_json::Value, key: &str) -> u64 {
    r[key]
        .as_u64()
        .unwrap_or_else(|| panic!("victim log record lacks numeric {key:?}: {r}"))
}

/// c_loop's stalled iterations: busy_start_ns..busy_end_ns.
pub fn c_loop_truth(log: &[serde_json::Value]) -> Vec<Truth> {
    log.iter()
        .filter(|r| matches!(r["kind"].as_str(), Some("spin" | "sleep" | "pipe")))
        .map(|r| Truth {
            kind: r["kind"].as_str().unwrap().into(),
            func: r["func"].as_str().unwrap().into(),
            tid: num(r, "tid"),
            start_ns: num(r, "busy_start_ns"),
            end_ns: num(r, "busy_end_ns"),
            cpu_ns: num(r, "busy_cpu_ns"),
        })
        .collect()
}

/// py_blocking_client's stalled calls: start_ns..end_ns around the call.
/// Every call of `truth` lasted at least `min_ns` (its planned length,
/// less a margin): else the victim misbehaved, and the failure says so
/// rather than blame the profiler.
pub fn assert_calls_as_planned(truth: &[Truth], min_ns: u64) {
    for t in truth {
        assert!(
            t.duration_ns() >= min_ns,
            "victim call shorter than planned (a victim problem, not stallprof's): {t:?}"
        );
    }
}

pub fn python_truth(log: &[serde_json::Value]) -> Vec<Truth> {
    log.iter()
        .filter(|r| {
            matches!(
                r["kind"].as_str(),
                Some("blocking_client" | "sleep" | "cpu")
            )
        })
        .map(|r| Truth {
            kind: r["kind"].as_str().unwrap().into(),
            func: r["func"].as_str().unwrap().into(),
            tid: num(r, "tid"),
            start_ns: num(r, "start_ns"),
            end_ns: num(r, "end_ns"),
            cpu_ns: num(r, "cpu_ns"),
        })
        .collect()
}

/// String fields `keys` of each handler call a Python victim logged, in
/// [`python_truth`]'s order (`?` for a field it did not log).
/// The outermost frame of a whole thread's stack: the process's entry or
/// a thread's start (a stack whose walk stopped early begins elsewhere).
pub fn is_thread_entry(name: &str) -> bool {
    matches!(
        name,
        "_start" | "start_thread" | "clone" | "clone3" | "__clone" | "__clone3"
    )
}

/// No route miss belongs to a victim's call. `check_calls_and_routes`
/// already says each call's stall carries its route; a miss counted here
/// must be a stall outside the calls, which may rightly have none: a cold
/// first request stalling in a middleware before routing
/// (`asgi_route_unrouted`, docs/asgi.md; CI met one, 22.9 ms in
/// express.json on a first request), or one whose frames moved before the
/// read (`asgi_route_unverified`). So the misses are at most those
/// stalls, and none is a reader that failed (`asgi_route_unreadable`).
pub fn check_no_route_misses(c: &mut Checks, rec: &stallprof::model::Recording, truth: &[Truth]) {
    let misses: Vec<(&String, &u64)> = rec
        .drops
        .iter()
        .filter(|(k, _)| k.starts_with("asgi_route_"))
        .collect();
    let outside: Vec<&stallprof::model::Stall> = rec
        .stalls
        .iter()
        .filter(|s| !truth.iter().any(|t| t.covers(s)))
        .collect();
    let missed: u64 = misses.iter().map(|(_, n)| **n).sum();
    c.check(
        missed <= outside.len() as u64
            && !misses
                .iter()
                .any(|(k, _)| k.as_str() == "asgi_route_unreadable"),
        || {
            format!(
                "route misses {misses:?}, but only {} stall(s) outside the victim's calls \
                 (routes there: {:?}), and none may be unreadable",
                outside.len(),
                outside.iter().map(|s| s.route.as_ref()).collect::<Vec<_>>()
            )
        },
    );
}

pub fn call_fields(log: &[serde_json::Value], keys: &[&str]) -> Vec<Vec<String>> {
    log.iter()
        .filter(|r| {
            matches!(
                r["kind"].as_str(),
                Some("blocking_client" | "sleep" | "cpu")
            )
        })
        .map(|r| {
            keys.iter()
                .map(|k| r[*k].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .collect()
}

// ---------------------------------------------------------------------------
// stalls.json, as the contract defines it

#[derive(Debug, Deserialize)]
pub struct Recording {
    pub pid: u32,
    pub comm: String,
    pub threshold_ns: u64,
    pub sample_hz: u64,
    pub clock: String,
    pub started_ns: u64,
    pub ended_ns: u64,
    pub lost_events: u64,
    pub drops: BTreeMap<String, u64>,
    /// The kernel's sampling gate (`--sample-after`), and what it saved.
    pub sample_after_ns: u64,
    #[serde(default)]
    pub kernel_filtered: BTreeMap<String, u64>,
    /// Version 3: the target's CPU quota and its cgroup's counters.
    #[serde(default)]
    pub cpu_quota: Option<serde_json::Value>,
    /// Which probes served (`{"scheduler", "waits", "notes"}`).
    #[serde(default)]
    pub probes: serde_json::Value,
    /// The target's pid in its own PID namespace, when that is not `pid`.
    #[serde(default)]
    pub ns_pid: Option<u32>,
    pub stalls: Vec<Stall>,
}

/// The probes this run's recordings must say they used: `cargo xtask test`
/// runs the accuracy tests a second time with `STALLPROF_PROBES=tracepoints`
/// (the classic tracepoints, the fallback), which every `stallprof` the
/// tests start inherits; on that pass every recording must say so
/// (`check_contract`). `(scheduler, waits)`.
pub fn expected_probes() -> (&'static str, &'static str) {
    match std::env::var("STALLPROF_PROBES").as_deref() {
        Ok("tracepoints") => ("tracepoints", "tracepoints"),
        _ => ("thread_perf_events", "uprobes"),
    }
}

#[derive(Debug, Deserialize, Clone)]
pub struct Stall {
    pub tid: u32,
    /// The tid in the target's PID namespace, when that is not `tid`.
    #[serde(default)]
    pub ns_tid: Option<u32>,
    pub thread_name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub duration_ns: u64,
    pub on_cpu_ns: u64,
    pub off_cpu_ns: u64,
    pub runqueue_ns: u64,
    /// Version 3: runnable but held off the CPU by its cgroup's quota.
    #[serde(default)]
    pub throttled_ns: u64,
    /// Version 3: who ran on the CPU it waited for.
    #[serde(default)]
    pub cpu_holders: Vec<CpuHolder>,
    pub incomplete: bool,
    /// The asyncio task running when the stall began.
    #[serde(default)]
    pub task: Option<Task>,
    /// With no task: the span of the thread's own context (issue 36).
    #[serde(default)]
    pub thread_context: Option<ContextTrace>,
    /// The ASGI request the stall served.
    #[serde(default)]
    pub route: Option<Route>,
    pub stacks: Vec<Stack>,
}

/// stalls.json `route`: the ASGI request a stall served.
#[derive(Debug, Deserialize, Clone)]
pub struct Route {
    pub method: String,
    pub template: String,
}

/// stalls.json `task`: the asyncio task running when a stall began.
#[derive(Debug, Deserialize, Clone)]
pub struct Task {
    pub name: String,
    #[serde(default)]
    pub coro: Option<String>,
    #[serde(default)]
    pub awaited_by: Vec<String>,
    /// The OpenTelemetry span current in the task's context.
    #[serde(default)]
    pub trace: Option<SpanIds>,
    #[serde(default)]
    pub trace_unreadable: Option<String>,
}

/// stalls.json `thread_context`: the span of the thread's own context.
#[derive(Debug, Deserialize, Clone)]
pub struct ContextTrace {
    #[serde(default)]
    pub trace: Option<SpanIds>,
    #[serde(default)]
    pub trace_unreadable: Option<String>,
}

/// stalls.json `task.trace`: W3C hex ids.
#[derive(Debug, Deserialize, Clone, PartialEq, Eq)]
pub struct SpanIds {
    pub trace_id: String,
    pub span_id: String,
}

impl SpanIds {
    /// (trace id, span id).
    pub fn pair(&self) -> (&str, &str) {
        (&self.trace_id, &self.span_id)
    }
}

/// A part's `gil_holder`: the thread that held the GIL, and its Python
/// frames when the wait began.
#[derive(Debug, Deserialize, Clone)]
pub struct GilHolder {
    pub tid: Option<u32>,
    #[serde(default)]
    pub ns_tid: Option<u32>,
    pub thread_name: Option<String>,
    pub frames: Vec<Frame>,
}

#[derive(Debug, Deserialize, Clone)]
pub struct CpuHolder {
    pub pid: u32,
    pub tgid: u32,
    pub comm: String,
    pub ns: u64,
    pub relation: String,
}

#[derive(Debug, Deserialize, Clone)]
pub struct Stack {
    pub frames: Vec<Frame>,
    pub weight_ns: u64,
    pub kind: String,
    pub syscall: Option<String>,
    #[serde(default)]
    pub woken: bool,
    #[serde(default)]
    pub gil_holder: Option<GilHolder>,
}

#[derive(Debug, Deserialize, Clone)]
pub struct Frame {
    pub name: String,
    #[serde(default)]
    pub file: Option<String>,
    #[serde(default)]
    pub line: Option<u32>,
    pub kind: String,
}

impl Frame {
    /// `name (file.py:12)`: the file's base name.
    pub fn label(&self) -> String {
        let base = self
            .file
            .as_deref()
            .map(|f| f.rsplit('/').next().unwrap_or(f));
        match (base, self.line) {
            (Some(b), Some(l)) => format!("{} ({b}:{l})", self.name),
            (Some(b), None) => format!("{} ({b})", self.name),
            _ => self.name.clone(),
        }
    }
}

impl Stack {
    pub fn has_frame(&self, name: &str) -> bool {
        self.frames.iter().any(|f| f.name == name)
    }

    /// The stack as a folded line, with its kind, syscall and weight.
    pub fn folded(&self) -> String {
        let mut s = self
            .frames
            .iter()
            .map(Frame::label)
            .collect::<Vec<_>>()
            .join(";");
        let _ = write!(
            s,
            " [{} {} {:.2} ms]",
            self.kind,
            self.syscall.as_deref().unwrap_or("-"),
            ms(self.weight_ns)
        );
        s
    }
}

impl Stall {
    /// The time the loop thread, woken from its park, waited for a CPU
    /// before its first instruction (the part issue 20 names "woken,
    /// waiting for a CPU"): the stall starts that much before the victim
    /// can see it start.
    pub fn woken_ns(&self) -> u64 {
        self.stacks
            .iter()
            .filter(|s| s.woken)
            .map(|s| s.weight_ns)
            .sum()
    }

    /// Weight of stacks that contain `func`, optionally only of one kind and
    /// with one of the given syscalls.
    pub fn weight_with(&self, func: &str, kind: Option<&str>, syscalls: Option<&[&str]>) -> u64 {
        self.stacks
            .iter()
            .filter(|s| s.has_frame(func))
            .filter(|s| kind.is_none_or(|k| s.kind == k))
            .filter(|s| {
                syscalls.is_none_or(|set| s.syscall.as_deref().is_some_and(|sc| set.contains(&sc)))
            })
            .map(|s| s.weight_ns)
            .sum()
    }

    /// Off-CPU weight whose syscall is one of `syscalls`, whatever the frames.
    pub fn off_cpu_weight_in(&self, syscalls: &[&str]) -> u64 {
        self.stacks
            .iter()
            .filter(|s| {
                s.kind == "off_cpu"
                    && s.syscall
                        .as_deref()
                        .is_some_and(|sc| syscalls.contains(&sc))
            })
            .map(|s| s.weight_ns)
            .sum()
    }

    pub fn overlaps(&self, start_ns: u64, end_ns: u64) -> bool {
        self.start_ns < end_ns && self.end_ns > start_ns
    }

    pub fn summary(&self) -> String {
        let mut by_kind: BTreeMap<(String, Option<String>), u64> = BTreeMap::new();
        for s in &self.stacks {
            *by_kind
                .entry((s.kind.clone(), s.syscall.clone()))
                .or_default() += s.weight_ns;
        }
        let heaviest = self.stacks.iter().max_by_key(|s| s.weight_ns).map(|s| {
            s.frames
                .iter()
                .map(|f| f.name.as_str())
                .collect::<Vec<_>>()
                .join(";")
        });
        format!(
            "tid {} [{} .. {}] {:.2} ms (on {:.2} / off {:.2} / rq {:.2} / throttled {:.2} ms){} weights {:?} heaviest stack: {}",
            self.tid,
            self.start_ns,
            self.end_ns,
            ms(self.duration_ns),
            ms(self.on_cpu_ns),
            ms(self.off_cpu_ns),
            ms(self.runqueue_ns),
            ms(self.throttled_ns),
            if self.incomplete { " INCOMPLETE" } else { "" },
            by_kind
                .iter()
                .map(|((k, sc), w)| format!("{k}/{}={:.1}ms", sc.as_deref().unwrap_or("-"), ms(*w)))
                .collect::<Vec<_>>(),
            heaviest.unwrap_or_default()
        )
    }
}

pub fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

pub fn load_recording(out_dir: &Path) -> Recording {
    let path = out_dir.join("stalls.json");
    if !path.exists() {
        let listing: Vec<_> = std::fs::read_dir(out_dir)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        panic!(
            "{} is missing; output dir holds {listing:?}",
            path.display()
        )
    }
    let v = read_stalls_json(&path);
    let text = v.to_string();
    serde_json::from_value(v).unwrap_or_else(|e| {
        panic!(
            "{} does not match the stalls.json contract: {e}\n{text:.2000}",
            path.display()
        )
    })
}

/// A `stalls.json` in the shape the tests' own structs parse: every
/// stall's `stacks` with whole frames (version 1). A version-2 file is
/// expanded here by docs/format.md, independently of stallprof's reader:
/// `frames` and `stacks` tables, each stall's `parts` naming a stack id,
/// a GIL holder's frames as a stack id. Dangling ids fail the test.
pub fn read_stalls_json(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    expand_stalls_json(v)
}

/// See [`read_stalls_json`].
pub fn expand_stalls_json(mut v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    let Some(format) = v.get("format") else {
        return v; // version 1
    };
    assert_eq!(format, "stallprof-recording", "unknown format");
    // Versions 3 and 4 only added fields (docs/format.md): expanded the
    // same way.
    assert!(
        v["version"] == 2 || v["version"] == 3 || v["version"] == 4,
        "a version these tests do not know: {}",
        v["version"]
    );
    let obj = v.as_object_mut().unwrap();
    let frames = obj
        .remove("frames")
        .expect("version 2 without a frame table");
    let frames = frames.as_array().expect("frames is not an array");
    let stacks: Vec<Value> = obj
        .remove("stacks")
        .expect("version 2 without a stack table")
        .as_array()
        .expect("stacks is not an array")
        .iter()
        .map(|ids| {
            Value::Array(
                ids.as_array()
                    .expect("a stack is not an array of frame ids")
                    .iter()
                    .map(|id| {
                        let i = id.as_u64().expect("a frame id is not a number") as usize;
                        frames
                            .get(i)
                            .unwrap_or_else(|| panic!("frame id {i} of {}", frames.len()))
                            .clone()
                    })
                    .collect(),
            )
        })
        .collect();
    let stack = |id: &Value| {
        let i = id.as_u64().expect("a stack id is not a number") as usize;
        stacks
            .get(i)
            .unwrap_or_else(|| panic!("stack id {i} of {}", stacks.len()))
            .clone()
    };
    obj.remove("format");
    obj.remove("version");
    for stall in obj["stalls"]
        .as_array_mut()
        .expect("stalls is not an array")
    {
        let s = stall.as_object_mut().unwrap();
        let parts = s.remove("parts").expect("a stall without parts");
        let expanded: Vec<Value> = parts
            .as_array()
            .expect("parts is not an array")
            .iter()
            .map(|p| {
                let mut p = p.as_object().unwrap().clone();
                let id = p.remove("stack").expect("a part without a stack id");
                p.insert("frames".into(), stack(&id));
                if let Some(h) = p.get_mut("gil_holder").and_then(Value::as_object_mut) {
                    let id = h.remove("stack").expect("a GIL holder without a stack id");
                    h.insert("frames".into(), stack(&id));
                }
                Value::Object(p)
            })
            .collect();
        s.insert("stacks".into(), Value::Array(expanded));
    }
    v
}

/// Sum of the weights (µs) of a folded file, and its line count.
pub fn folded_total_us(path: &Path) -> (u64, usize, String) {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut total = 0u64;
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (stack, w) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("folded line without a weight: {line:?}"));
        assert!(
            !stack.is_empty(),
            "folded line with an empty stack: {line:?}"
        );
        total += w
            .trim()
            .parse::<u64>()
            .unwrap_or_else(|e| panic!("folded weight {w:?} in {line:?}: {e}"));
        n += 1;
    }
    (total, n, text)
}

// ---------------------------------------------------------------------------
// pprof files, as an independent reader sees them

/// Test-only readers, installed by `cargo xtask test` (or on first use):
/// `py/` (prometheus-client), `node/` (pprof-format).
pub fn deps_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/daemon-test-deps")
}

/// Installs (once) DataDog's pure-JS `pprof-format`; panics with the
/// command to run when that fails, never skips.
pub fn ensure_pprof_reader() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let node = deps_dir().join("node");
        let probe_node = || node.join("node_modules/pprof-format/package.json").exists();
        if !probe_node() {
            let out = Command::new("npm")
                .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
                .arg(&node)
                .arg("pprof-format@2.3.2")
                .output();
            assert!(
                probe_node(),
                "the pprof reader (npm pprof-format) is needed and could not be installed: {:?}\n\
                 run: npm install --prefix {} pprof-format@2.3.2 (and install nodejs/npm if missing)",
                out.map(|o| String::from_utf8_lossy(&o.stderr).into_owned()),
                node.display()
            );
        }
    });
}

const PPROF_READ: &str = r#"
const fs = require('fs'), zlib = require('zlib');
const { Profile } = require('pprof-format');
const p = Profile.decode(zlib.gunzipSync(fs.readFileSync(process.argv[2])));
const strs = p.stringTable.strings;
const S = (i) => { const s = strs[Number(i)]; if (s === undefined) throw new Error('string index ' + i + ' out of range'); return s; };
if (strs[0] !== '') throw new Error('string_table[0] must be empty');
const fns = new Map(p.function.map((f) => [Number(f.id), f]));
const locs = new Map(p.location.map((l) => [Number(l.id), l]));
const out = { sample_types: p.sampleType.map((t) => [S(t.type), S(t.unit)]),
              time_nanos: Number(p.timeNanos), duration_nanos: Number(p.durationNanos), samples: [] };
for (const s of p.sample) {
  if (s.value.length !== p.sampleType.length) throw new Error('sample with ' + s.value.length + ' values');
  const frames = s.locationId.map((id) => {
    const l = locs.get(Number(id));
    if (!l) throw new Error('dangling location ' + id);
    return l.line.map((ln) => { const f = fns.get(Number(ln.functionId)); if (!f) throw new Error('dangling function'); return S(f.name); }).join('|');
  });
  const labels = {};
  for (const l of s.label) labels[S(l.key)] = Number(l.str) ? S(l.str) : Number(l.num);
  out.samples.push({ value: s.value.map(Number), frames, labels });
}
console.log(JSON.stringify(out));
"#;

/// A pprof file as the pprof-format decoder sees it: sample types, time,
/// and per sample its values, frames (leaf first) and labels (`{key: str or
/// num}`). `dir` is a scratch directory for the reader script.
pub fn read_pprof(dir: &Path, file: &Path) -> serde_json::Value {
    ensure_pprof_reader();
    let s = dir.join("pprof_read.js");
    std::fs::write(&s, PPROF_READ).unwrap();
    let out = Command::new("node")
        .arg(&s)
        .arg(file)
        .env("NODE_PATH", deps_dir().join("node/node_modules"))
        .output()
        .unwrap_or_else(|e| panic!("running node to read a pprof file: {e} (install nodejs)"));
    assert!(
        out.status.success(),
        "pprof-format could not read {}:\n{}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

// ---------------------------------------------------------------------------
// Collecting failures: report every broken expectation at once

/// Time a thread's CPU clock does not count although the thread is on a
/// CPU: what the hypervisor took from this VM's CPUs (steal) and what the
/// kernel spent in interrupts, summed over every CPU (`/proc/stat`). The
/// victim's own CPU clock is truth for how long it ran; stallprof sees the
/// thread on the CPU for that time too. On a shared VM a 100 ms burn has
/// measured 11 ms less thread CPU time than wall time with no run-queue
/// wait at all.
pub struct HostTime(u64);

impl HostTime {
    pub fn now() -> HostTime {
        HostTime(host_lost_ns())
    }

    /// Time lost to steal and interrupts on all CPUs since `now()`: an
    /// upper bound for any one thread's share of it.
    pub fn lost_ns(&self) -> u64 {
        host_lost_ns().saturating_sub(self.0)
    }
}

fn host_lost_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").expect("reading /proc/stat");
    let cpu = stat.lines().next().expect("/proc/stat's first line");
    // cpu user nice system idle iowait irq softirq steal ...
    let f: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let ticks = f.get(5).copied().unwrap_or(0)
        + f.get(6).copied().unwrap_or(0)
        + f.get(7).copied().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    ticks * (1_000_000_000 / hz)
}

pub struct Checks {
    context: String,
    failures: Vec<String>,
}

impl Checks {
    pub fn new(context: impl Into<String>) -> Checks {
        Checks {
            context: context.into(),
            failures: Vec::new(),
        }
    }

    pub fn check(&mut self, ok: bool, msg: impl FnOnce() -> String) {
        if !ok {
            self.failures.push(msg());
        }
    }

    pub fn fail(&mut self, msg: String) {
        self.failures.push(msg);
    }

    pub fn add_context(&mut self, more: &str) {
        self.context.push('\n');
        self.context.push_str(more);
    }

    pub fn finish(self) {
        if self.failures.is_empty() {
            return;
        }
        let mut msg = format!("\n{} expectation(s) failed:\n", self.failures.len());
        for f in &self.failures {
            let _ = writeln!(msg, "  - {f}");
        }
        let _ = write!(msg, "\n{}", self.context);
        panic!("{msg}");
    }
}

/// On the fallback pass (`STALLPROF_PROBES=tracepoints`), `probes` (a
/// recording's `probes` object) must say the classic tracepoints served:
/// the pass cannot silently run the default. (On the default pass the
/// tests that care assert the probes themselves: some choose them.)
pub fn check_probes(c: &mut Checks, probes: &serde_json::Value) {
    let (sched, waits) = expected_probes();
    c.check(
        sched == "thread_perf_events" || (probes["scheduler"] == sched && probes["waits"] == waits),
        || format!("probes are {probes}, want scheduler {sched}, waits {waits} (STALLPROF_PROBES)"),
    );
}

/// Checks that hold for every stall of every recording (the JSON contract).
pub fn check_contract(c: &mut Checks, rec: &Recording, threshold_ns: u64) {
    check_contract_at(c, rec, threshold_ns, 999)
}

/// [`check_contract`] for a recording made with `-F sample_hz`.
pub fn check_contract_at(c: &mut Checks, rec: &Recording, threshold_ns: u64, sample_hz: u64) {
    check_probes(c, &rec.probes);
    c.check(rec.clock == "monotonic", || {
        format!("clock is {:?}, want \"monotonic\"", rec.clock)
    });
    c.check(rec.threshold_ns == threshold_ns, || {
        format!("threshold_ns is {}, want {threshold_ns}", rec.threshold_ns)
    });
    c.check(rec.sample_hz == sample_hz, || {
        format!("sample_hz is {}, want {sample_hz}", rec.sample_hz)
    });
    c.check(rec.started_ns < rec.ended_ns, || {
        format!(
            "started_ns {} is not before ended_ns {}",
            rec.started_ns, rec.ended_ns
        )
    });
    c.check(rec.lost_events == 0, || {
        format!(
            "{} events lost (drops: {:?}) in a short, quiet recording",
            rec.lost_events, rec.drops
        )
    });
    for (i, s) in rec.stalls.iter().enumerate() {
        let who = format!("stall #{i} ({})", s.summary());
        check_stall_contract(c, &who, s, threshold_ns, (rec.started_ns, rec.ended_ns));
    }
}

/// The contract every stall of every recording keeps (docs/format.md),
/// `who` naming it in a failure: it lies inside the recording
/// (`[started_ns, ended_ns]`) and is at least `threshold_ns` long; its
/// split covers it exactly (on-CPU + off-CPU + run queue + throttled =
/// duration), and so do its parts' weights, kind by kind (a GIL wait counts
/// as off-CPU); its parts and frames are of the kinds the format names, none
/// without frames; a GIL wait names the thread that held the GIL, and only
/// a GIL wait or the run-queue time after one may.
pub fn check_stall_contract(
    c: &mut Checks,
    who: &str,
    s: &Stall,
    threshold_ns: u64,
    (started_ns, ended_ns): (u64, u64),
) {
    c.check(
        s.end_ns >= s.start_ns && s.end_ns - s.start_ns == s.duration_ns,
        || format!("{who}: end_ns - start_ns != duration_ns"),
    );
    c.check(
        s.on_cpu_ns + s.off_cpu_ns + s.runqueue_ns + s.throttled_ns == s.duration_ns,
        || format!("{who}: on_cpu + off_cpu + runqueue + throttled != duration"),
    );
    let w: u64 = s.stacks.iter().map(|st| st.weight_ns).sum();
    c.check(w == s.duration_ns, || {
        format!(
            "{who}: stack weights sum to {w}, not duration {}",
            s.duration_ns
        )
    });
    let weight_of = |kinds: &[&str]| -> u64 {
        s.stacks
            .iter()
            .filter(|st| kinds.contains(&st.kind.as_str()))
            .map(|st| st.weight_ns)
            .sum()
    };
    for (field, ns, kinds) in [
        ("on_cpu_ns", s.on_cpu_ns, &["on_cpu"][..]),
        ("off_cpu_ns", s.off_cpu_ns, &["off_cpu", "gil_wait"][..]),
        ("runqueue_ns", s.runqueue_ns, &["runqueue"][..]),
        ("throttled_ns", s.throttled_ns, &["throttled"][..]),
    ] {
        let w = weight_of(kinds);
        c.check(w == ns, || {
            format!("{who}: {field} {ns} != weight of {kinds:?} stacks {w}")
        });
    }
    c.check(s.duration_ns >= threshold_ns, || {
        format!("{who}: shorter than the threshold")
    });
    c.check(s.start_ns >= started_ns && s.end_ns <= ended_ns, || {
        format!("{who}: outside the recording [{started_ns}, {ended_ns}]")
    });
    for st in &s.stacks {
        c.check(
            matches!(
                st.kind.as_str(),
                "on_cpu" | "off_cpu" | "runqueue" | "throttled" | "gil_wait"
            ),
            || format!("{who}: stack kind {:?}", st.kind),
        );
        c.check(!st.frames.is_empty(), || {
            format!("{who}: a stack with no frames")
        });
        let holder_ok = match st.kind.as_str() {
            "gil_wait" => st.gil_holder.is_some(),
            "runqueue" => true,
            _ => st.gil_holder.is_none(),
        };
        c.check(holder_ok, || {
            format!(
                "{who}: {} stack with gil_holder {:?}: {}",
                st.kind,
                st.gil_holder,
                st.folded()
            )
        });
        for f in &st.frames {
            c.check(
                matches!(
                    f.kind.as_str(),
                    "native" | "kernel" | "python" | "js" | "marker"
                ),
                || format!("{who}: frame {:?} has kind {:?}", f.name, f.kind),
            );
        }
    }
}

/// The stalls that overlap a victim interval, on any thread.
pub fn overlapping<'a>(rec: &'a Recording, t: &Truth) -> Vec<&'a Stall> {
    rec.stalls
        .iter()
        .filter(|s| s.overlaps(t.start_ns, t.end_ns))
        .collect()
}

pub fn truth_table(truth: &[Truth]) -> String {
    let mut s = String::from("victim log:\n");
    for t in truth {
        let _ = writeln!(
            s,
            "  {:<16} {:<16} tid {} [{} .. {}] {:.2} ms (cpu {:.2} ms)",
            t.kind,
            t.func,
            t.tid,
            t.start_ns,
            t.end_ns,
            ms(t.duration_ns()),
            ms(t.cpu_ns)
        );
    }
    s
}

pub fn stalls_table(rec: &Recording) -> String {
    let mut s = format!(
        "stalls.json: pid {} comm {:?} [{} .. {}] lost {} drops {:?}, {} stalls:\n",
        rec.pid,
        rec.comm,
        rec.started_ns,
        rec.ended_ns,
        rec.lost_events,
        rec.drops,
        rec.stalls.len()
    );
    for st in &rec.stalls {
        let _ = writeln!(s, "  {}", st.summary());
    }
    s
}

// ---------------------------------------------------------------------------
// bpftool: which stallprof programs are loaded

pub fn bpftool_available() -> bool {
    Command::new("bpftool")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The loaded `sp_*` programs that `ours` picks, once a stallprof run has
/// ended: a program is freed asynchronously after its last fd closes (a raw
/// tracepoint's only after an RCU grace period), so this waits up to 3 s
/// for them to go and returns the ones still there.
pub fn sp_programs_left(ours: impl Fn(&(u64, String)) -> bool) -> Vec<(u64, String)> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left: Vec<_> = loaded_sp_programs().into_iter().filter(&ours).collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `bpftool -j ARGS`'s JSON; a missing bpftool or a failed run panics
/// with the remedy.
pub fn bpftool_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new("bpftool").arg("-j").args(args).output().unwrap_or_else(|e| {
        panic!(
            "bpftool is needed to look at stallprof's BPF programs and maps, and running it failed: {e}.\n\
             `cargo xtask test` installs it when run as root; or: apt-get install -y bpftool"
        )
    });
    assert!(
        out.status.success(),
        "bpftool -j {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bpftool -j {} printed non-JSON ({e})", args.join(" ")))
}

/// (id, name) of loaded BPF programs whose name starts with `sp_`.
pub fn loaded_sp_programs() -> Vec<(u64, String)> {
    let progs = bpftool_json(&["prog", "list"]);
    progs
        .as_array()
        .map(|a| a.as_slice())
        .unwrap_or_default()
        .iter()
        .filter_map(|p| {
            let name = p["name"].as_str()?;
            name.starts_with("sp_")
                .then(|| (p["id"].as_u64().unwrap_or(0), name.to_string()))
        })
        .collect()
}

/// After starting `stallprof record`, waits until it says it is recording:
/// it writes the file `STALLPROF_READY_FILE` names once its probes are in,
/// its journal is open and the command it started (if any) runs
/// (docs/testing.md). What happens in the target from then on is recorded.
/// Fails, with stallprof's output, if it exits first or is not recording
/// within `timeout` (then it is killed).
pub fn wait_for_attach(prof: &mut Profiler, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !prof.ready.exists() {
        if let Some(out) = prof.try_finished() {
            panic!(
                "stallprof {:?} exited before it was recording:\n{}",
                prof.args,
                out.describe()
            );
        }
        if Instant::now() >= deadline {
            prof.signal(libc::SIGKILL);
            let status = prof.child.as_mut().unwrap().wait().unwrap();
            let out = prof.collect(status);
            panic!(
                "stallprof {:?} did not say it was recording ({} written) within {timeout:?}; killed it.\n{}",
                prof.args,
                prof.ready.display(),
                out.describe()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A pid that no process has (counting down from pid_max).
pub fn unused_pid() -> u32 {
    let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(32768);
    (2..max)
        .rev()
        .find(|p| !Path::new(&format!("/proc/{p}")).exists())
        .unwrap()
}

// ---------------------------------------------------------------------------
// The container sandbox (docs/containers.md)

/// File a finished sandbox root carries (written last by `cargo xtask`).
const FORKY_STAMP: &str = ".stallprof-forky-root";

/// The sandbox root `cargo xtask test` builds: a Debian testing ("forky")
/// root filesystem with python3.13, 3.14, 3.15 and nodejs.
pub fn forky_root() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
        .join(".cache/stallprof/forky-root")
}

/// The sandbox root; a missing one FAILS the test, saying how to build it.
pub fn require_forky_root() -> PathBuf {
    let root = forky_root();
    assert!(
        root.join(FORKY_STAMP).is_file(),
        "the container sandbox {} is missing or incomplete: `cargo xtask test` \
         (or `cargo xtask setup --tests`) builds it, as root",
        root.display()
    );
    root
}

/// The tids of a process's threads, from each thread's `NSpid:` line:
/// innermost (its own PID namespace's) -> host's.
pub fn namespace_tids(host_pid: u32) -> BTreeMap<u32, u32> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{host_pid}/task")) else {
        return BTreeMap::new();
    };
    dir.filter_map(|e| {
        let host: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let status =
            std::fs::read_to_string(format!("/proc/{host_pid}/task/{host}/status")).ok()?;
        let ns = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))?
            .split_whitespace()
            .last()?
            .parse()
            .ok()?;
        Some((ns, host))
    })
    .collect()
}

/// A victim run "as in a container": `unshare --mount --pid --fork
/// --mount-proc=ROOT/proc chroot ROOT python3.X /victims/SCRIPT LOG ...`,
/// with the victims copied into ROOT/victims and its log under ROOT/tmp.
/// The interpreter waits for [`ContainerVictim::go`] before it runs the
/// script (so a profiler can attach with `--pid` first). Killed when
/// dropped (the python process by its host pid, then the wrappers).
pub struct ContainerVictim {
    wrapper: Victim,
    /// The python process's pid on the host (the wrappers are its parents).
    pub host_pid: u32,
    /// The victim's log, as the host sees it (ROOT/tmp/.../victim.jsonl).
    pub log: PathBuf,
    dir: PathBuf,
    go: PathBuf,
}

/// What the interpreter runs first: wait for the go file, then the script
/// as `__main__` with its own argv.
const GATE: &str = "import os, runpy, sys, time\n\
while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n\
sys.argv = sys.argv[2:]\n\
runpy.run_path(sys.argv[0], run_name='__main__')\n";

impl ContainerVictim {
    /// Starts `python` (a name on the sandbox's PATH, e.g. `python3.14`) on
    /// tests/victims/`script` with `args` after the log path; returns once
    /// the python process is found on the host (its /proc/PID/root is ROOT).
    pub fn spawn_python(test: &str, python: &str, script: &str, args: &[&str]) -> ContainerVictim {
        Self::spawn(test, script, |inside| {
            let mut argv: Vec<String> = vec![python.into(), "-c".into(), GATE.into()];
            argv.push(format!("{inside}/go"));
            argv.push(format!("/victims/{script}"));
            argv.push(format!("{inside}/victim.jsonl"));
            argv.extend(args.iter().map(|a| a.to_string()));
            argv
        })
    }

    /// Starts a shell command in the sandbox once [`ContainerVictim::go`]:
    /// `cmd` gets the victim's directory inside the sandbox (its cwd, where
    /// `victim.jsonl` goes) and tests/victims/`script` is at
    /// /victims/`script`. The shell execs the command, so the host pid found
    /// is the victim's.
    pub fn spawn_shell(
        test: &str,
        script: &str,
        cmd: impl FnOnce(&str) -> String,
    ) -> ContainerVictim {
        Self::spawn(test, script, |inside| {
            let gated = format!(
                "while [ ! -e {inside}/go ]; do sleep 0.01; done; cd {inside} && exec {}",
                cmd(inside)
            );
            vec!["sh".into(), "-c".into(), gated]
        })
    }

    fn spawn(test: &str, script: &str, argv: impl FnOnce(&str) -> Vec<String>) -> ContainerVictim {
        let root = require_forky_root();
        let victims = root.join("victims");
        std::fs::create_dir_all(&victims).unwrap();
        std::fs::copy(victims_dir().join(script), victims.join(script))
            .unwrap_or_else(|e| panic!("copying {script} into {}: {e}", victims.display()));
        // Every victim is pid 1 of its namespace: a perf map an earlier one
        // (Node) left in the shared /tmp would be taken for this one's.
        let _ = std::fs::remove_file(root.join("tmp/perf-1.map"));
        let name = format!("stallprof-{test}-{}", std::process::id());
        let dir = root.join("tmp").join(&name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let inside = format!("/tmp/{name}");
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--pid", "--fork", "--kill-child"])
            .arg(format!("--mount-proc={}", root.join("proc").display()))
            .arg("chroot")
            .arg(&root)
            .args(argv(&inside));
        let wrapper = Victim::spawn(&mut cmd);
        let deadline = Instant::now() + Duration::from_secs(10);
        let host_pid = loop {
            if let Some(p) = Self::find(&root, wrapper.pid()) {
                break p;
            }
            assert!(
                Instant::now() < deadline,
                "the victim did not start in the sandbox within 10 s ({})",
                wrapper.what
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        ContainerVictim {
            wrapper,
            host_pid,
            log: dir.join("victim.jsonl"),
            go: dir.join("go"),
            dir,
        }
    }

    /// The descendant of `ancestor` whose root is `root` and that runs no
    /// wrapper any more (unshare forks, chroot execs the interpreter).
    fn find(root: &Path, ancestor: u32) -> Option<u32> {
        let mut frontier = vec![ancestor];
        while let Some(p) = frontier.pop() {
            let children =
                std::fs::read_to_string(format!("/proc/{p}/task/{p}/children")).unwrap_or_default();
            for c in children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                let in_root =
                    std::fs::read_link(format!("/proc/{c}/root")).is_ok_and(|r| r == root);
                let comm = std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
                if in_root && comm.trim() != "chroot" {
                    return Some(c);
                }
                frontier.push(c);
            }
        }
        None
    }

    /// Lets the interpreter run the script.
    pub fn go(&self) {
        std::fs::write(&self.go, b"").unwrap();
    }

    /// Its threads: namespace tid -> host tid (while it runs).
    pub fn tids(&self) -> BTreeMap<u32, u32> {
        namespace_tids(self.host_pid)
    }

    /// Waits for the wrappers to exit (the victim ran to its end).
    pub fn wait(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.wrapper.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "the container victim did not exit within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ContainerVictim {
    fn drop(&mut self) {
        // The wrapper's kill does not reach the namespace's init (python).
        if self.wrapper.child.try_wait().ok().flatten().is_none() {
            unsafe { libc::kill(self.host_pid as libc::pid_t, libc::SIGKILL) };
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
            if let Some(root) = self.dir.parent() {
                let _ = std::fs::remove_file(root.join("perf-1.map"));
            }
        } else {
            eprintln!(
                "test failed; the victim's files are kept in {}",
                self.dir.display()
            );
        }
    }
}

/// A cgroup named as a container runtime names its containers', for a
/// container victim: the sandbox has namespaces but no cgroup of its own.
/// Created under a directory of this test's own in the cgroup v2
/// hierarchy (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid
/// host), so what `/proc/PID/cgroup` shows is
/// `0::/stallprof-test-PID.slice/` + the runtime's path. On drop every
/// process still in it goes back to the root cgroup and the directories
/// are removed.
pub struct FakeContainerCgroup {
    /// The test's own directory (removed with everything below it).
    top: PathBuf,
    /// The container's cgroup directory.
    pub dir: PathBuf,
    mount: PathBuf,
}

/// Container ids and pod uids for tests: 64 and 8-4-4-4-12 hex digits made
/// from `seed`, distinct per test process.
pub fn fake_container_id(seed: u32) -> String {
    // The seed first: two ids differ in their short (12-digit) form.
    format!("{seed:08x}5ea1{:052x}", u64::from(seed))
}

pub fn fake_pod_uid(seed: u32) -> String {
    let h = format!("{:08x}{:024x}", seed, 0xc0ffee_u64);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

impl FakeContainerCgroup {
    /// Moves process `pid` (all its threads) into cgroup `path` (e.g.
    /// `system.slice/docker-<id>.scope`) below this test's own directory.
    /// A host without a writable cgroup v2 hierarchy FAILS the test, naming it.
    pub fn enter(test: &str, path: &str, pid: u32) -> FakeContainerCgroup {
        let mount = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
            .iter()
            .map(PathBuf::from)
            .find(|m| m.join("cgroup.procs").exists() && m.join("cgroup.controllers").exists())
            .unwrap_or_else(|| {
                panic!("{test} needs a cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified (mount -t cgroup2 none /sys/fs/cgroup)")
            });
        let top = mount.join(format!("stallprof-test-{}.slice", std::process::id()));
        let dir = top.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("{test}: creating cgroup {}: {e}", dir.display()));
        let cg = FakeContainerCgroup { top, dir, mount };
        std::fs::write(cg.dir.join("cgroup.procs"), pid.to_string()).unwrap_or_else(|e| {
            panic!(
                "{test}: moving pid {pid} into cgroup {}: {e}",
                cg.dir.display()
            )
        });
        cg
    }

    /// The path `/proc/PID/cgroup` shows for it (`0::` + this).
    pub fn path(&self) -> String {
        format!("/{}", self.dir.strip_prefix(&self.mount).unwrap().display())
    }
}

impl Drop for FakeContainerCgroup {
    fn drop(&mut self) {
        // Deepest first: a cgroup with processes or children cannot go.
        let mut dirs = Vec::new();
        let mut stack = vec![self.top.clone()];
        while let Some(d) = stack.pop() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        stack.push(e.path());
                    }
                }
            }
            dirs.push(d);
        }
        for d in dirs.iter().rev() {
            for p in std::fs::read_to_string(d.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
            {
                let _ = std::fs::write(self.mount.join("cgroup.procs"), p);
            }
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// A copy of `src` whose `Py_Version` (`const unsigned long`, in the file's
/// read-only data) holds `hex` instead.
pub fn patch_py_version(src: &Path, dst: &Path, hex: u64) {
    use object::{Object, ObjectSegment, ObjectSymbol};
    let mut bytes = std::fs::read(src).unwrap();
    let file_off = {
        let obj = object::File::parse(&*bytes).unwrap();
        let addr = obj
            .dynamic_symbols()
            .find(|s| s.name() == Ok("Py_Version"))
            .unwrap_or_else(|| panic!("{} exports no Py_Version", src.display()))
            .address();
        let seg = obj
            .segments()
            .find(|s| s.address() <= addr && addr + 8 <= s.address() + s.file_range().1)
            .expect("Py_Version in a loaded segment");
        (seg.file_range().0 + addr - seg.address()) as usize
    };
    let old = u64::from_le_bytes(bytes[file_off..file_off + 8].try_into().unwrap());
    assert_eq!(old >> 24, 3, "{} Py_Version is {old:#x}", src.display());
    bytes[file_off..file_off + 8].copy_from_slice(&hex.to_le_bytes());
    std::fs::write(dst, &bytes).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Removes a directory when the test ends (kept when it failed).
pub struct RemoveOnDrop(pub std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// `VmHWM` (peak resident set) of a live process, in KiB.
pub fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// The lines of one section of `record`'s summary (`top culprits`, `by
/// entry point`): the indented lines after its title.
pub fn summary_section<'a>(stdout: &'a str, title: &str) -> Vec<&'a str> {
    // The title starts its line: a process named like it (a test thread
    // `routes::…` as a CPU holder: "CPU held by routes::…") is elsewhere.
    stdout
        .lines()
        .skip_while(|l| !l.trim_start().starts_with(title))
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .collect()
}

// ---------------------------------------------------------------------------
// Recording a command

/// `stallprof record --threshold THRESHOLD [flags] -o OUT -- CMD…` in `cwd`
/// (None: the test's own), which must succeed within `timeout`.
pub fn record_ok(
    cwd: Option<&Path>,
    threshold: &str,
    flags: &[&str],
    out: &Path,
    cmd: &[&std::ffi::OsStr],
    timeout: Duration,
) -> RunOutput {
    let mut argv: Vec<&std::ffi::OsStr> = vec![
        "record".as_ref(),
        "--threshold".as_ref(),
        threshold.as_ref(),
    ];
    argv.extend(flags.iter().map(std::ffi::OsStr::new));
    argv.extend(["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    argv.extend(cmd);
    let run = match cwd {
        Some(dir) => run_stallprof_in(dir, &argv, timeout),
        None => run_stallprof(&argv, timeout),
    };
    assert!(
        run.status.success(),
        "stallprof {} failed:\n{}",
        argv.iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" "),
        run.describe()
    );
    run
}

// ---------------------------------------------------------------------------
// Web app victims: a service whose request handlers each block differently

/// A web app victim (express, FastAPI) as its root tests check it: each
/// handler call is one stall whose culprit and entry point are the handler.
pub struct HandlerApp<'a> {
    /// Names the app in the `SHARE` lines.
    pub label: &'a str,
    /// The handlers' source file, as frames name it (`app.js`).
    pub file: &'a str,
    pub handlers: &'a [&'a str],
    /// How far apart the stall's share blamed on the handler and the call's
    /// share by the victim's clock may be, in percentage points.
    pub share_points: f64,
}

impl HandlerApp<'_> {
    /// The victim's log and its handler calls: it finished cleanly, ran
    /// each handler at least 3 times, each call 20 ms over `threshold_ns`.
    pub fn truth(&self, log: &Path, threshold_ns: u64) -> (Vec<serde_json::Value>, Vec<Truth>) {
        let entries = read_log(log);
        assert!(
            entries.iter().any(|r| r["kind"] == "done")
                && !entries.iter().any(|r| r["kind"] == "error"),
            "the victim did not finish cleanly; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        let truth = python_truth(&entries);
        for func in self.handlers {
            assert!(
                truth.iter().filter(|t| t.func == *func).count() >= 3,
                "the victim ran {func} fewer than 3 times:\n{}",
                truth_table(&truth)
            );
        }
        assert_calls_as_planned(&truth, threshold_ns + 20 * MS);
        (entries, truth)
    }

    /// The one stall of `rec` over handler call `t` on the victim's thread
    /// (another process of the tree, such as a client the victim started,
    /// may stall meanwhile), with its index (the same in `raw`, stalls.json
    /// as written), checked: its culprit and
    /// entry point are the handler, and the time blamed on the handler is
    /// the call's share of it by the victim's clock. None, a failure
    /// said, when not exactly one stall overlaps the call.
    pub fn check_call<'r>(
        &self,
        c: &mut Checks,
        rec: &'r stallprof::model::Recording,
        raw: &serde_json::Value,
        t: &Truth,
    ) -> Option<(usize, &'r stallprof::model::Stall)> {
        use stallprof::report::aggregate;
        let who = t.who();
        let found: Vec<(usize, &stallprof::model::Stall)> = rec
            .stalls
            .iter()
            .enumerate()
            .filter(|(_, s)| t.covers(s))
            .collect();
        let [(index, s)] = found[..] else {
            c.fail(format!("{who}: {} overlapping stalls, want 1", found.len()));
            return None;
        };
        let app = rec.app();
        let culprit = aggregate::stall_culprit(s, &app).unwrap_or_default();
        c.check(
            culprit.starts_with(&format!("{} ({}:", t.func, self.file)),
            || {
                format!(
                    "{who}: the stall's culprit is {culprit:?}, want the handler {}",
                    t.func
                )
            },
        );
        let want_entry = format!("{} ({})", t.func, self.file);
        let entry = raw["stalls"][index]["entry"].as_str().unwrap_or("");
        c.check(entry == want_entry, || {
            format!("{who}: stalls.json entry {entry:?}, want {want_entry:?}")
        });
        let blamed: u64 = s
            .stacks
            .iter()
            .filter(|p| aggregate::culprit(p, &app).is_some_and(|f| f.name == t.func))
            .map(|p| p.weight_ns)
            .sum();
        // Stacks whose walk stopped short of the thread's entry (counted
        // `unwind_failed`: V8's runtime under a GC, entered from JIT code)
        // and that name no handler may be the handler's or not: the
        // handler's share is between what is blamed on it and that plus
        // them.
        let unknown: u64 = s
            .stacks
            .iter()
            .filter(|p| !p.frames.first().is_some_and(|f| is_thread_entry(&f.name)))
            .filter(|p| aggregate::culprit(p, &app).is_none_or(|f| f.name != t.func))
            .map(|p| p.weight_ns)
            .sum();
        let ours = 100.0 * blamed as f64 / s.duration_ns as f64;
        let unknown_pct = 100.0 * unknown as f64 / s.duration_ns as f64;
        let theirs = 100.0 * t.duration_ns().min(s.duration_ns) as f64 / s.duration_ns as f64;
        let points = self.share_points;
        c.check(
            theirs >= ours - points && theirs <= ours + unknown_pct + points,
            || {
                format!(
                    "{who}: {ours:.1}% of the stall blamed on {} (and {unknown_pct:.1}% on stacks \
                     cut short, whose owner is unknown), the victim's clock says {theirs:.1}%: \
                     more than {points} points apart",
                    t.func
                )
            },
        );
        c.add_context(&format!(
            "{who}: culprit {culprit:?}; blamed {ours:.1}% vs victim {theirs:.1}% of a {:.1} ms stall",
            ms(s.duration_ns)
        ));
        println!(
            "SHARE {} {:<14} measured {ours:5.1}%  truth {theirs:5.1}%  culprit {culprit}",
            self.label, t.func
        );
        Some((index, s))
    }

    /// Every handler call checked ([`Self::check_call`]), and its stall's
    /// route the one the victim logged serving (its `method` and `route`
    /// fields, the template as the framework matched it): in the model and
    /// in stalls.json, and each route under the summary's by route. The
    /// handlers' routes, `(func, "METHOD /template")`, first seen first.
    pub fn check_calls_and_routes(
        &self,
        c: &mut Checks,
        entries: &[serde_json::Value],
        truth: &[Truth],
        rec: &stallprof::model::Recording,
        raw: &serde_json::Value,
        stdout: &str,
    ) -> Vec<(String, String)> {
        let served: Vec<String> = call_fields(entries, &["method", "route"])
            .into_iter()
            .map(|f| f.join(" "))
            .collect();
        assert_eq!(served.len(), truth.len(), "a call logged without its route");
        let mut routes: Vec<(String, String)> = Vec::new();
        for (t, want) in truth.iter().zip(&served) {
            if !routes.iter().any(|r| r.0 == t.func) {
                routes.push((t.func.clone(), want.clone()));
            }
            let Some((index, s)) = self.check_call(c, rec, raw, t) else {
                continue;
            };
            let who = t.who();
            let route = s.route.as_ref().map(|r| r.describe());
            c.check(route.as_deref() == Some(want.as_str()), || {
                format!("{who}: the stall's route is {route:?}, the victim served {want:?}")
            });
            let wire = &raw["stalls"][index]["route"];
            c.check(
                format!(
                    "{} {}",
                    wire["method"].as_str().unwrap_or("?"),
                    wire["template"].as_str().unwrap_or("?")
                ) == *want,
                || format!("{who}: stalls.json route {wire}, want {want:?}"),
            );
        }
        let by_route = summary_section(stdout, "by route (");
        for (func, route) in &routes {
            c.check(
                by_route.iter().any(|l| l.contains(&format!("  {route} ("))),
                || format!("{func}'s route {route:?} is not under the summary's by route: {by_route:#?}"),
            );
        }
        routes
    }

    /// `record`'s summary names every handler among its top culprits and
    /// its entry points.
    pub fn check_summary(&self, c: &mut Checks, stdout: &str) {
        let top = summary_section(stdout, "top culprits");
        let by_entry = summary_section(stdout, "by entry point");
        for func in self.handlers {
            let name = format!("  {func} ({}:", self.file);
            c.check(top.iter().any(|l| l.contains(&name)), || {
                format!("{func} is not among the summary's top culprit lines: {top:#?}")
            });
            let name = format!("  {func} ({}) (", self.file);
            c.check(by_entry.iter().any(|l| l.contains(&name)), || {
                format!("{func} is not among the summary's entry points: {by_entry:#?}")
            });
        }
    }
}

/// A loopback port nobody listens on now.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Waits until something listens on 127.0.0.1:`port`; panics naming
/// `what` when `child` exits first or nothing listens within 20 s.
pub fn wait_listening(port: u16, child: &mut Child, what: &str) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited ({st}) before listening on 127.0.0.1:{port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} did not listen on 127.0.0.1:{port} within 20 s");
}

/// oteltap (PyPI, pinned in target/asgi-venv by `cargo xtask setup
/// --tests`): an OTLP http/protobuf receiver that prints each span it
/// receives as a JSON line, here into a file of the test's scratch dir.
pub struct Oteltap {
    child: Child,
    pub port: u16,
    received: PathBuf,
}

impl Oteltap {
    /// Started on a free port, listening when this returns.
    pub fn start(dir: &Path) -> Oteltap {
        let port = free_port();
        let received = dir.join("oteltap.ndjson");
        let mut child = Command::new(asgi_python())
            .args(["-m", "oteltap", "--port", &port.to_string()])
            .stdout(std::fs::File::create(&received).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting oteltap (cargo xtask setup --tests installs it)");
        wait_listening(port, &mut child, "oteltap");
        Oteltap {
            child,
            port,
            received,
        }
    }

    /// What `--otlp-endpoint` (or daemon.toml's `[otlp] endpoint`) names.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops it, `settle` after the last send (it prints as it receives),
    /// and returns the stall spans it printed.
    pub fn stop_stall_spans(mut self, settle: Duration) -> Vec<serde_json::Value> {
        std::thread::sleep(settle);
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(&self.received)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|v: &serde_json::Value| v["name"] == "event loop stall")
            .collect()
    }
}
