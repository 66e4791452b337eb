//! `stallprof record`: wire the pipeline together for one target.
//!
//! probe -> event -> stall -> symbolize -> (aggregate, render). Stalls are
//! symbolized as soon as they end, while the target is alive; the recording
//! is written whatever way it ends (duration, Ctrl-C/SIGTERM, target exit,
//! error after attach), and the probes are dropped — detached — before the
//! outputs are written.
use std::{
    collections::HashSet,
    io::{IsTerminal, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{
    commands::live::{Finished, Live, Step},
    commands::{AppArgs, StallArgs, SummaryArgs},
    model::text::escape,
    model::{Process, Recording, Stall},
    os::units::fmt_ns,
    os::units::parse_duration,
    os::{
        clock::monotonic_ns,
        cpu_quota::{self, CgroupFs, CpuQuota},
        family::Facts,
        outdir::{OutDir, random_suffix},
        proc::{is_own_fork, process_alive, read_comm, refuse_target, refuse_thread},
        user::{self, User},
    },
    pipeline::engine::Engine,
    report,
    report::journal::{self, JournalWriter},
    report::view::View,
};
use anyhow::{Context, Result, bail};
use clap::Args;
use log::{info, warn};

#[derive(Args, Debug)]
pub struct RecordArgs {
    /// Process to attach to.
    #[arg(short, long, conflicts_with = "command")]
    pub pid: Option<u32>,
    #[command(flatten)]
    pub stall: StallArgs,
    #[command(flatten)]
    pub app: AppArgs,
    #[command(flatten)]
    pub summary: SummaryArgs,
    /// Skip CPU samples in the first DUR of every busy period, and do not
    /// report busy periods shorter than DUR at all, inside the kernel: the
    /// loop's short iterations then cost no stack copy. 0 takes every sample.
    /// Default: threshold/20, at most 2ms.
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    pub sample_after: Option<u64>,
    /// Stop after this long (e.g. 30s, 5m). Default: until Ctrl-C or the target exits.
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<u64>,
    /// Output directory (default ./stallprof-<target>-<random>/, new). An
    /// existing one must be yours and writable by no one else.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Run the command after -- as this user (name or uid). Default under
    /// sudo: the user who ran sudo (SUDO_UID); stallprof alone keeps root.
    #[arg(long, value_name = "USER", requires = "command")]
    pub user: Option<String>,
    /// Also save a recording that replays everything without the target:
    /// the kernel's raw records before unwinding (events.bin.gz), what the
    /// unwinder read (unwind.json.gz) and every symbol (symbols.json).
    /// `report --threshold` can then go below the recorded threshold.
    #[arg(long)]
    pub save_events: bool,
    /// No live status line.
    #[arg(short, long)]
    pub quiet: bool,
    #[command(flatten)]
    pub view: super::ViewArgs,
    #[command(flatten)]
    pub otlp: super::OtlpArgs,
    /// For CI and load tests: write every output as usual, then exit with
    /// status 3 if any stall lasted at least DUR, 0 if none did (errors
    /// exit with 1). The summary's last line says which and how many.
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    pub fail_on_stall: Option<u64>,
    /// Command to start and profile from its first instruction.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Validated `record` settings.
#[derive(Debug, Clone)]
pub struct RecordConfig {
    pub target: Target,
    pub tids: Option<HashSet<u32>>,
    pub threshold_ns: u64,
    pub sample_hz: u64,
    /// The kernel's sampling gate (`--sample-after`).
    pub sample_after_ns: u64,
    /// `--probes`.
    pub probes: crate::kernel::probe::ProbeChoice,
    /// The processes under the target too (not `--no-subprocesses`).
    pub subprocesses: bool,
    pub duration: Option<Duration>,
    pub output: PathBuf,
    /// The output directory is stallprof's own random name: it must be new.
    pub output_is_new: bool,
    pub save_events: bool,
    pub live_status: bool,
    /// `--fail-on-stall`: the CI gate's limit.
    pub fail_on_stall_ns: Option<u64>,
    /// How stalls.folded, stalls.svg, stalls.speedscope.json and stalls.pb.gz show stacks
    /// (`--native`, `--lines`, `--group-by`).
    pub view: View,
    /// `--app-path` prefixes (the recording's `app_paths`).
    pub app_paths: Vec<String>,
    /// What the summary says (`--by-process`, `-v`).
    pub summary: super::SummaryArgs,
    /// Where each stall goes as a span, if anywhere (`--otlp-endpoint`,
    /// `OTEL_EXPORTER_OTLP_*`).
    pub otlp: Option<super::otlp::OtlpConfig>,
}

/// Exit status of `record --fail-on-stall` when a stall reached the
/// limit: neither success (0) nor an error (1) nor a usage error (2).
pub const GATE_FAILED: u8 = 3;

/// What a finished recording hands back to `main`.
#[derive(Debug)]
pub struct Recorded {
    /// The summary; with `--fail-on-stall`, the gate's line last.
    pub text: String,
    /// `--fail-on-stall` was given and a stall reached it: exit with
    /// [`GATE_FAILED`].
    pub gate_failed: bool,
}

#[derive(Debug, Clone)]
pub enum Target {
    Pid(u32),
    /// The command, the executable it resolves to, and the user it runs as
    /// (`None`: as stallprof's own user, root).
    Command(Vec<String>, PathBuf, Option<User>),
}

impl Target {
    /// The pid given (0 for a command: its pid is known once launched).
    fn pid(&self) -> u32 {
        match self {
            Target::Pid(p) => *p,
            Target::Command(..) => 0,
        }
    }

    /// The name a recording has before the target's comm is read: the
    /// command's file name, or "?".
    fn name(&self) -> String {
        match self {
            Target::Command(c, ..) => Path::new(&c[0])
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            Target::Pid(_) => "?".into(),
        }
    }
}

fn find_in_path(cmd: &str) -> Option<PathBuf> {
    if cmd.contains('/') {
        let p = PathBuf::from(cmd);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(cmd))
                .find(|p| p.is_file())
        })
        .unwrap_or(None)
}

impl RecordConfig {
    pub fn from_args(a: RecordArgs) -> Result<RecordConfig> {
        let target = match (a.pid, a.command.is_empty()) {
            (Some(pid), true) => {
                if let Some(why) = refuse_target(pid) {
                    bail!("{why}");
                }
                for &tid in &a.stall.tids {
                    if let Some(why) = refuse_thread(pid, tid) {
                        bail!("{why}");
                    }
                }
                Target::Pid(pid)
            }
            (None, false) => {
                let Some(exe) = find_in_path(&a.command[0]) else {
                    bail!(
                        "command not found: {} (give a path or put it on PATH)",
                        a.command[0]
                    );
                };
                let user = match &a.user {
                    Some(name) => Some(user::by_name(name)?),
                    None => user::sudo_invoker(),
                };
                Target::Command(a.command, exe, user)
            }
            (Some(_), false) => bail!("give either --pid PID or -- CMD, not both"),
            (None, true) => bail!(
                "nothing to record: give --pid PID, or a command after --, e.g. stallprof record -- python3 app.py"
            ),
        };
        let threshold_ns = a.stall.threshold;
        let sample_after_ns = a
            .sample_after
            .unwrap_or_else(|| crate::kernel::probe::default_sample_after(threshold_ns));
        if sample_after_ns > threshold_ns {
            bail!(
                "--sample-after {} is longer than --threshold {}: stalls would lose their first samples; \
                 give a --sample-after below the threshold (default: threshold/20)",
                fmt_ns(sample_after_ns),
                fmt_ns(threshold_ns)
            );
        }
        let output_is_new = a.output.is_none();
        let output = a.output.unwrap_or_else(|| {
            let who = match &target {
                Target::Pid(p) => p.to_string(),
                Target::Command(c, ..) => Path::new(&c[0])
                    .file_name()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            };
            // Unguessable, so no one can plant it before stallprof creates it.
            PathBuf::from(format!("stallprof-{who}-{}", random_suffix()))
        });
        Ok(RecordConfig {
            target,
            tids: (!a.stall.tids.is_empty()).then(|| a.stall.tids.into_iter().collect()),
            threshold_ns,
            sample_hz: a.stall.frequency,
            sample_after_ns,
            probes: a.stall.probes,
            subprocesses: !a.stall.no_subprocesses,
            duration: a.duration.map(Duration::from_nanos),
            output,
            output_is_new,
            save_events: a.save_events,
            live_status: !a.quiet && std::io::stderr().is_terminal(),
            fail_on_stall_ns: a.fail_on_stall,
            view: a.view.view(),
            otlp: super::otlp::OtlpConfig::resolve(&a.otlp.settings(), |k| std::env::var(k).ok())?,
            app_paths: a.app.app_paths,
            summary: a.summary,
        })
    }
}

/// A command forked but held before `execvp`: the child blocks reading a
/// pipe until [`Launched::release`], so probes see it from its first
/// instruction. (`std::process::Command` cannot do this: `spawn` waits for
/// the exec.)
struct Launched {
    pid: u32,
    go: Option<std::fs::File>,
    status: Option<i32>,
}

/// What the child of [`Launched::spawn`] exits with when it cannot become
/// the command's user (setgroups/setgid/setuid failed).
const EXIT_NO_USER: i32 = 125;

impl Launched {
    /// Fork; the child waits for [`Launched::release`], drops to `user`
    /// (supplementary groups, gid, uid, in that order: each step needs the
    /// privilege the next one gives up) and execs `exe`.
    fn spawn(argv: &[String], exe: &Path, user: Option<&User>) -> Result<Launched> {
        use std::{ffi::CString, os::unix::ffi::OsStrExt};
        if let Some(u) = user {
            info!(
                "the command runs as uid {} gid {} ({})",
                u.uid,
                u.gid,
                u.name.as_deref().map(escape).unwrap_or_default()
            );
        }
        // Everything the child needs is allocated before fork: between fork
        // and exec only async-signal-safe calls are allowed.
        let cargs: Vec<CString> = argv
            .iter()
            .map(|a| CString::new(a.as_bytes()).context("an argument contains a NUL byte"))
            .collect::<Result<_>>()?;
        let mut ptrs: Vec<*const libc::c_char> = cargs.iter().map(|c| c.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        let cexe = CString::new(exe.as_os_str().as_bytes())
            .context("the command path contains a NUL byte")?;
        // The environment as it is, with the identity variables of the user
        // the command runs as.
        let mut env: Vec<(Vec<u8>, Vec<u8>)> = std::env::vars_os()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect();
        if let Some(u) = user {
            let mut set = |k: &str, v: Option<&str>| {
                env.retain(|(key, _)| key != k.as_bytes());
                if let Some(v) = v {
                    env.push((k.as_bytes().to_vec(), v.as_bytes().to_vec()));
                }
            };
            set("HOME", u.home.as_deref());
            set("USER", u.name.as_deref());
            set("LOGNAME", u.name.as_deref());
        }
        let cenv: Vec<CString> = env
            .into_iter()
            .filter_map(|(k, v)| CString::new([k, b"=".to_vec(), v].concat()).ok())
            .collect();
        let mut envp: Vec<*const libc::c_char> = cenv.iter().map(|c| c.as_ptr()).collect();
        envp.push(std::ptr::null());
        let groups: Vec<libc::gid_t> = user.map(|u| u.groups.clone()).unwrap_or_default();
        let ids = user.map(|u| (u.uid, u.gid));
        let mut fds = [0i32; 2];
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            bail!("pipe2: {}", std::io::Error::last_os_error());
        }
        let (rd, wr) = (fds[0], fds[1]);
        match unsafe { libc::fork() } {
            -1 => bail!("fork: {}", std::io::Error::last_os_error()),
            0 => unsafe {
                // Child: only async-signal-safe calls from here on.
                libc::close(wr);
                let mut b = 0u8;
                let n = libc::read(rd, (&mut b as *mut u8).cast(), 1);
                if n != 1 {
                    libc::_exit(111); // the recorder gave up before attaching
                }
                if let Some((uid, gid)) = ids
                    && (libc::setgroups(groups.len(), groups.as_ptr()) != 0
                        || libc::setgid(gid) != 0
                        || libc::setuid(uid) != 0)
                {
                    libc::_exit(EXIT_NO_USER);
                }
                libc::execve(cexe.as_ptr(), ptrs.as_ptr(), envp.as_ptr());
                libc::_exit(127);
            },
            pid => {
                unsafe { libc::close(rd) };
                let go = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(wr) };
                Ok(Launched {
                    pid: pid as u32,
                    go: Some(go),
                    status: None,
                })
            }
        }
    }

    fn release(&mut self) -> Result<()> {
        if let Some(mut go) = self.go.take() {
            go.write_all(b"g").context("releasing the command")?;
        }
        Ok(())
    }

    /// Reap the child if it has exited; its wait status.
    fn try_wait(&mut self) -> Option<i32> {
        if self.status.is_none() {
            let mut st = 0;
            if unsafe { libc::waitpid(self.pid as i32, &mut st, libc::WNOHANG) } == self.pid as i32
            {
                self.status = Some(st);
            }
        }
        self.status
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        // Never released: closing the pipe makes the child exit(111).
        self.go.take();
    }
}

/// Run a recording to the end and write its outputs. Returns the summary
/// text and the gate's verdict.
pub fn run(cfg: RecordConfig) -> Result<Recorded> {
    let out = if cfg.output_is_new {
        OutDir::create_new(&cfg.output)?
    } else {
        OutDir::open_or_create(&cfg.output)?
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(record(cfg, out))
}

async fn record(cfg: RecordConfig, out: OutDir) -> Result<Recorded> {
    let mut session = Session::attach(&cfg, &out)?;
    announce_ready(session.pid);
    let ended_by = session.watch(&cfg).await?;
    session.conclude(&cfg, &out, ended_by)
}

/// Names the file [`announce_ready`] writes: opt-in, for a harness that
/// must not start the target's work before the recording has begun.
const READY_FILE_ENV: &str = "STALLPROF_READY_FILE";

/// Once the probes are in, the journal open and the command (if any)
/// released, writes the target's pid to `$STALLPROF_READY_FILE` when that
/// is set: a temporary file renamed into place, so a reader polling for
/// the path never sees it half-written, and made new (`O_EXCL |
/// O_NOFOLLOW`), so a link planted at its name cannot send root's write
/// elsewhere. A failure is only warned about: the recording itself is
/// fine, and the waiting harness times out saying so.
fn announce_ready(pid: u32) {
    use std::os::unix::fs::OpenOptionsExt;
    let Some(path) = std::env::var_os(READY_FILE_ENV).map(PathBuf::from) else {
        return;
    };
    let mut tmp = path.clone().into_os_string();
    tmp.push(format!(".{}", random_suffix()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| f.write_all(format!("{pid}\n").as_bytes()))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        warn!("{READY_FILE_ENV}: writing {}: {e}", path.display());
    }
}

/// A recording under way: the target, its probes (inside `live`) and the
/// journal its stalls go to as they end.
struct Session {
    launched: Option<Launched>,
    pid: u32,
    /// When attaching began (the attach time, the status line's clock).
    t0: Instant,
    started_ns: u64,
    live: Live,
    cgroups: CgroupFs,
    cpu_quota: Option<CpuQuota>,
    target_name: String,
    /// The target's comm, re-read each tick (a launcher may exec again);
    /// None for a command not yet exec'd.
    comm: Option<String>,
    journal: Journaled,
    /// Stalls as spans to a collector, as they finish (`--otlp-endpoint`).
    export: Option<Export>,
}

/// The exporter of a recording and what it needs to make spans.
struct Export {
    exporter: super::otlp::Exporter,
    clock: report::otlp::SpanClock,
    app: crate::classify::AppPaths,
}

impl Export {
    fn start(cfg: &RecordConfig) -> Result<Option<Export>> {
        let Some(config) = cfg.otlp.clone() else {
            return Ok(None);
        };
        info!(
            "exporting each stall as a span to {} ({})",
            config.url,
            config.protocol.as_str()
        );
        Ok(Some(Export {
            exporter: super::otlp::Exporter::start(config)?,
            clock: report::otlp::SpanClock {
                wall_offset_ns: crate::os::clock::wall_offset_ns(),
                random: crate::os::outdir::fill_random,
            },
            app: crate::classify::AppPaths::new(&cfg.app_paths),
        }))
    }

    /// Queue `stalls` (never blocks: see [`super::otlp::Exporter::send`]).
    fn send(&mut self, stalls: &[Stall], facts: &[crate::os::family::Facts]) {
        if stalls.is_empty() {
            return;
        }
        let processes = Process::from_facts(facts);
        let req = report::otlp::request(stalls, &processes, &self.app, &self.clock);
        self.exporter.send(req, stalls.len() as u64);
    }
}

/// The summary's line on the export: how many spans went where, and why
/// any did not.
fn export_note(
    url: &str,
    protocol: super::otlp::Protocol,
    r: &super::otlp::ExportReport,
) -> String {
    let mut line = format!(
        "  otlp: {} stall span{} exported to {url} ({})",
        r.exported,
        if r.exported == 1 { "" } else { "s" },
        protocol.as_str()
    );
    if r.failed > 0 {
        line.push_str(&format!(
            "; {} failed ({}): the local outputs have them",
            r.failed,
            r.last_error.as_deref().unwrap_or("unknown error")
        ));
    }
    line.push('\n');
    line
}

/// How long the end of a recording waits for the collector, at most.
const EXPORT_DEADLINE: Duration = Duration::from_secs(3);

impl Session {
    /// Start the command (held before exec) or find the pid, attach the
    /// probes, release the command, open the journal.
    fn attach(cfg: &RecordConfig, out: &OutDir) -> Result<Session> {
        let mut launched = match &cfg.target {
            Target::Command(argv, exe, user) => Some(Launched::spawn(argv, exe, user.as_ref())?),
            Target::Pid(_) => None,
        };
        let pid = launched
            .as_ref()
            .map_or_else(|| cfg.target.pid(), |l| l.pid);
        let t0 = Instant::now();
        let mut live = Live::attach(
            pid,
            cfg.threshold_ns,
            cfg.tids.clone(),
            cfg.sample_hz,
            cfg.sample_after_ns,
            cfg.probes,
            cfg.subprocesses,
        )?;
        if let Some(l) = launched.as_mut() {
            l.release()?;
        } else if !process_alive(pid) {
            bail!("process {pid} exited while stallprof was attaching; nothing to record");
        }
        let attach_ms = t0.elapsed().as_secs_f64() * 1e3;
        info!("attached to {pid} in {attach_ms:.0} ms");
        let started_ns = monotonic_ns();
        // The target's CPU limit and its cgroup's throttling counters, now and
        // at the end: the recording says how much the kernel throttled it.
        let cgroups = CgroupFs::of_host();
        let cpu_quota = match cpu_quota::of_process(pid, &cgroups) {
            Ok(q) => q,
            Err(e) => {
                warn!("the target's CPU quota is not reported: {e}");
                None
            }
        };

        if cfg.save_events {
            live.engine.save_to(out)?;
        }
        live.first_upkeep();
        let target_name = cfg.target.name();
        let comm = read_comm(pid, pid).filter(|_| launched.is_none());
        let journal = Journaled::create(
            out,
            journal::Header {
                format: journal::FORMAT.into(),
                version: journal::VERSION,
                pid,
                comm: comm.clone().unwrap_or_else(|| target_name.clone()),
                threshold_ns: cfg.threshold_ns,
                sample_hz: cfg.sample_hz,
                sample_after_ns: cfg.sample_after_ns,
                clock: "monotonic".into(),
                started_ns,
                stallprof_version: env!("CARGO_PKG_VERSION").into(),
                app_paths: cfg.app_paths.clone(),
            },
        )?;
        if let Some(d) = cfg.duration {
            live.stop_after(d);
        }
        Ok(Session {
            launched,
            pid,
            t0,
            started_ns,
            live,
            cgroups,
            cpu_quota,
            target_name,
            comm,
            journal,
            export: Export::start(cfg)?,
        })
    }

    /// Until the end (duration, a signal, the target's exit, a failed
    /// journal write): each tick, the stalls that ended go to the journal.
    /// Returns what ended it.
    async fn watch(&mut self, cfg: &RecordConfig) -> Result<&'static str> {
        let pid = self.pid;
        let mut ended_by = "target exit";
        let mut status_shown = false;
        loop {
            match self.live.next(std::future::pending::<()>()).await? {
                Step::Stop(why) => {
                    ended_by = why;
                    break;
                }
                Step::Other(()) => {}
                Step::Tick(_) => {
                    // Each process read while it runs (a worker may be gone
                    // at the end), and whether it ran a loop (its role).
                    self.journal.watched(&self.live.ever);
                    self.journal.ran_loops(self.live.looped());
                    let engine = &mut self.live.engine;
                    let fresh: Vec<Stall> =
                        engine.take_stalls().into_iter().map(|(_, s)| s).collect();
                    // Exported after the journal has seen (and named) their
                    // processes.
                    let to_export = self.export.is_some().then(|| fresh.clone());
                    let name = self.comm.as_ref().unwrap_or(&self.target_name);
                    let meta = || meta_of(engine, pid, name, monotonic_ns(), &self.cpu_quota);
                    let written = self.journal.tick(fresh, meta);
                    if let (Some(x), Some(stalls)) = (self.export.as_mut(), to_export) {
                        x.send(&stalls, &self.journal.facts);
                    }
                    if !written {
                        ended_by = "a failed write to the output directory";
                        break;
                    }
                    let exited = self
                        .launched
                        .as_mut()
                        .is_some_and(|l| l.try_wait().is_some());
                    if exited || !process_alive(pid) || self.live.root_gone() {
                        break;
                    }
                    // Every tick: a launcher (a pyenv shim, `env`) may exec again.
                    if !is_own_fork(pid)
                        && let Some(c) = read_comm(pid, pid)
                    {
                        self.comm = Some(c);
                    }
                    if cfg.live_status {
                        let busy = self.live.engine.busy_now_ns(monotonic_ns());
                        let line = status_line(
                            pid,
                            self.t0.elapsed(),
                            &self.journal,
                            busy,
                            cfg.threshold_ns,
                        );
                        eprint!("\r\x1b[K{line}");
                        status_shown = true;
                    }
                }
            }
        }
        if status_shown {
            eprint!("\r\x1b[K");
        }
        Ok(ended_by)
    }

    /// Detach first, then close the last stalls, bring every stall back
    /// from the journal and write the outputs; the summary, and last the
    /// gate's verdict.
    fn conclude(self, cfg: &RecordConfig, out: &OutDir, ended_by: &str) -> Result<Recorded> {
        let Session {
            mut launched,
            pid,
            started_ns,
            live,
            cgroups,
            mut cpu_quota,
            target_name,
            comm,
            mut journal,
            mut export,
            ..
        } = self;
        // Every process watched that the journal has not seen (no stall
        // yet), read while the probes still hold the tree: their roles
        // number the workers.
        journal.watched(&live.ever);
        journal.ran_loops(live.looped());
        // Last events, then detach before anything slow.
        let Finished {
            mut engine,
            ended_ns,
            mut drops,
            kernel_filtered,
            probes,
        } = live.finish();
        info!("recording ended by {ended_by}; probes detached");
        if let Some(q) = cpu_quota.as_mut() {
            q.read_end(&cgroups);
            if q.end.is_none() {
                warn!(
                    "the CPU counters of cgroup {} could not be read at the end (removed?): \
                     the recording has their start only",
                    q.cgroup
                );
            }
        }

        engine.finish(ended_ns);
        if cfg.save_events {
            engine.finish_saving(out)?;
        }
        for (k, v) in engine.agent_drops() {
            drops.insert(k.to_string(), v);
        }
        let lost_events = drops
            .get(profiler_common::Drop::RingbufFull.name())
            .copied()
            .unwrap_or(0);
        let comm = comm.unwrap_or(target_name);
        // The rest of the stalls (those the end closed) into the journal too,
        // and to disk, before the slower outputs.
        let meta = meta_of(&mut engine, pid, &comm, ended_ns, &cpu_quota);
        let last: Vec<Stall> = engine.take_stalls().into_iter().map(|(_, s)| s).collect();
        let to_export = export.is_some().then(|| last.clone());
        journal.finish(last.into_iter(), &meta);
        if let (Some(x), Some(stalls)) = (export.as_mut(), to_export) {
            x.send(&stalls, &journal.facts);
        }
        // What the collector took, waited for a bounded time: the journal
        // is on disk already, a collector that is down holds nothing up.
        let exported = export.map(|x| {
            let url = x.exporter.config().url.clone();
            let protocol = x.exporter.config().protocol;
            (url, protocol, x.exporter.finish(EXPORT_DEADLINE))
        });
        if let Some((_, _, r)) = &exported
            && r.failed > 0
        {
            drops.insert(
                crate::pipeline::counters::Counter::OtlpSpansFailed
                    .name()
                    .to_string(),
                r.failed,
            );
        }
        // The engine's tables and the symbolizer's parsed files go before the
        // stalls come back from the journal.
        drop(engine);
        crate::os::heap::release();
        let stalls = stalls_back(
            out,
            journal.failed.is_some(),
            std::mem::take(&mut journal.unjournaled),
        )?;
        let processes = Process::from_facts(&journal.facts);
        let journal::Meta {
            busy_periods,
            executor_threads,
            runtime_problems,
            process,
            ..
        } = meta;
        let rec = Recording {
            pid,
            process,
            comm,
            threshold_ns: cfg.threshold_ns,
            sample_hz: cfg.sample_hz,
            sample_after_ns: cfg.sample_after_ns,
            kernel_filtered,
            busy_periods,
            clock: "monotonic".into(),
            started_ns,
            ended_ns,
            lost_events,
            drops,
            executor_threads,
            stallprof_version: env!("CARGO_PKG_VERSION").into(),
            runtime_problems,
            probes,
            cpu_quota,
            app_paths: cfg.app_paths.clone(),
            processes,
            stalls,
        }
        .completed();
        let files = write_outputs(&rec, out, cfg.view, journal)?;
        let mut text = report::summary::text(&rec, &files, &cfg.summary.options());
        if let Some((url, protocol, r)) = &exported {
            text.push_str(&export_note(url, *protocol, r));
        }
        // The command may still run (duration/Ctrl-C): leave it be, but reap if done.
        if let Some(note) = launched.as_mut().and_then(|l| command_note(l.try_wait()?)) {
            text.push_str(&note);
        }
        // Last, after every output is written: the gate's verdict.
        let gate = cfg
            .fail_on_stall_ns
            .map(|limit| report::gate::check(&rec, limit));
        if let Some(g) = &gate {
            text.push_str(&g.line);
            text.push('\n');
        }
        Ok(Recorded {
            text,
            gate_failed: gate.is_some_and(|g| g.failed),
        })
    }
}

/// The live status line: how long, how many stalls, the worst, and the
/// stall under way if the loop is stalled now (busy past the threshold).
fn status_line(
    pid: u32,
    elapsed: Duration,
    j: &Journaled,
    busy_ns: u64,
    threshold_ns: u64,
) -> String {
    let now = if busy_ns >= threshold_ns {
        format!(", stalled now {}", fmt_ns(busy_ns))
    } else {
        String::new()
    };
    format!(
        "recording pid {pid}: {:.0}s, {} stalls, worst {}{now}",
        elapsed.as_secs_f64(),
        j.count,
        fmt_ns(j.worst_ns)
    )
}

/// The recording's metadata as the engine has it now (the journal's
/// metadata records, and the recording's own at the end).
fn meta_of(
    engine: &mut Engine,
    pid: u32,
    comm: &str,
    ended_ns: u64,
    cpu_quota: &Option<cpu_quota::CpuQuota>,
) -> journal::Meta {
    journal::Meta {
        comm: comm.to_string(),
        ended_ns,
        busy_periods: engine.busy_periods(),
        executor_threads: engine.executors(pid),
        runtime_problems: engine.runtime_problems(),
        process: engine.process(pid),
        cpu_quota: cpu_quota.clone(),
    }
}

/// The recording's stalls on their way to disk. Every stall goes to
/// stalls.journal as it is found (report::journal): a recording killed
/// before its end still holds them. They are not held once the journal has
/// them: the end reads them back (after the probes and the engine's caches
/// are gone), so a long recording's memory does not grow with its stalls.
/// Those a failed journal write may not have taken stay in `unjournaled`.
///
/// Each process is read from procfs once, when first seen (watched, or
/// its first stall: the target first), while it runs, and journaled
/// before its stalls: its role is derived from those facts at the end
/// ([`crate::os::family`]), when workers may be gone.
struct Journaled {
    writer: JournalWriter,
    failed: Option<journal::JournalError>,
    meta_at: Instant,
    unjournaled: Vec<Stall>,
    /// Stalls so far, and the longest (the live status line).
    count: usize,
    worst_ns: u64,
    /// The target's pid and the name it had at the start.
    target: (u32, String),
    /// Every process seen, as first read (small: one per process).
    facts: Vec<Facts>,
    /// How many of `facts` the journal has.
    facts_journaled: usize,
    /// Facts journaled already, written again because they changed (a
    /// process was found to run a loop).
    facts_again: Vec<Facts>,
}

impl Journaled {
    fn create(out: &OutDir, header: journal::Header) -> Result<Journaled> {
        let target = (header.pid, header.comm.clone());
        Ok(Journaled {
            writer: JournalWriter::create(out, header)?,
            failed: None,
            meta_at: Instant::now(),
            unjournaled: Vec::new(),
            count: 0,
            worst_ns: 0,
            target,
            facts: Vec::new(),
            facts_journaled: 0,
            facts_again: Vec::new(),
        })
    }

    /// Processes being watched, each with the parent it was found under
    /// ([`Live::ever`]): each not seen before is read now (while it runs:
    /// its role needs its start time, and a worker may be gone at the end)
    /// and goes to the journal with the next write. The target is always
    /// seen first.
    fn watched(&mut self, procs: &[(u32, Option<u32>)]) {
        for &(pid, parent) in procs {
            self.see(pid, None, parent);
        }
    }

    /// Processes in which a loop thread was elected ([`Live::looped`]): a
    /// process's role needs it; said in the journal with the next write.
    fn ran_loops(&mut self, pids: &std::collections::BTreeSet<u32>) {
        for (i, f) in self.facts.iter_mut().enumerate() {
            if !f.ran_loop && pids.contains(&f.pid) {
                f.ran_loop = true;
                if i < self.facts_journaled {
                    self.facts_again.push(f.clone());
                }
            }
        }
    }

    /// The facts the next write carries: those new, those changed.
    fn facts_to_write(&self) -> Vec<Facts> {
        let mut v = self.facts[self.facts_journaled..].to_vec();
        v.extend(self.facts_again.iter().cloned());
        v
    }

    /// `pid` read now if not seen before; `name` and `parent` are what is
    /// known if procfs no longer has it (the thread name of a stall on its
    /// main thread; the parent it was found under).
    fn see(&mut self, pid: u32, name: Option<&str>, parent: Option<u32>) {
        if self.facts.is_empty() && pid != self.target.0 {
            let (target, name) = self.target.clone();
            self.see(target, Some(&name), None);
        }
        if !self.facts.iter().any(|f| f.pid == pid) {
            let mut f = Facts::read(pid, name.unwrap_or("?"));
            f.parent = f.parent.or(parent);
            self.facts.push(f);
        }
    }

    /// The processes of `stalls` (each seen, the target first).
    fn see_stalls(&mut self, stalls: &[Stall]) {
        for s in stalls {
            let name = (s.tid == s.pid).then_some(s.thread_name.as_str());
            self.see(s.pid, name, None);
        }
    }

    /// A tick's new stalls, with the recording's metadata at most once a
    /// second (`meta` is asked only then). False when the write failed:
    /// the recording ends.
    fn tick(&mut self, fresh: Vec<Stall>, meta: impl FnOnce() -> journal::Meta) -> bool {
        let meta = (self.meta_at.elapsed() >= Duration::from_secs(1)).then(|| {
            self.meta_at = Instant::now();
            meta()
        });
        self.count += fresh.len();
        self.worst_ns = fresh
            .iter()
            .map(|s| s.duration_ns)
            .fold(self.worst_ns, u64::max);
        self.see_stalls(&fresh);
        if let Err(e) = self.writer.append(&self.facts_to_write(), &fresh, meta) {
            self.failed = Some(e);
            self.unjournaled = fresh;
            return false;
        }
        self.facts_journaled = self.facts.len();
        self.facts_again.clear();
        true
    }

    /// The stalls the end closed, with the final metadata, and the journal
    /// synced to disk (unless a write failed before).
    fn finish(&mut self, rest: impl Iterator<Item = Stall>, meta: &journal::Meta) {
        let rest: Vec<Stall> = rest.collect();
        self.target.1.clone_from(&meta.comm);
        self.watched(&[(self.target.0, None)]);
        self.see_stalls(&rest);
        if self.failed.is_some() {
            self.unjournaled.extend(rest);
            return;
        }
        if let Err(e) = self
            .writer
            .append(&self.facts_to_write(), &rest, Some(meta.clone()))
            .and_then(|()| self.writer.sync())
        {
            self.failed = Some(e);
            self.unjournaled.extend(rest);
        }
    }
}

/// Write every output of the recording. Once they are all written,
/// stalls.json holds everything the journal did and the journal goes; if
/// one cannot be written, the journal stays and the error says so.
fn write_outputs(
    rec: &Recording,
    out: &OutDir,
    view: View,
    journal: Journaled,
) -> Result<Vec<PathBuf>> {
    match (report::write_all_view(rec, out, view), journal.failed) {
        (Ok(files), None) => {
            drop(journal.writer);
            if let Err(e) = out.remove(journal::NAME) {
                log::warn!("cannot remove {}: {e}", out.join(journal::NAME).display());
            }
            Ok(files)
        }
        (Ok(_), Some(e)) => Err(e.into()),
        (Err(e), failed) => {
            let kept = match failed {
                Some(j) => j.to_string(),
                None => format!(
                    "{} ({} bytes) holds all {} stalls: `stallprof report {}` renders them once there is room",
                    out.join(journal::NAME).display(),
                    journal.writer.written(),
                    journal.writer.stalls(),
                    out.path().display()
                ),
            };
            Err(anyhow::Error::new(e).context(format!(
                "the outputs could not all be written to {} (probes detached); {kept}",
                out.path().display()
            )))
        }
    }
}

/// The summary's note on how a launched command ended (its wait status),
/// if that needs saying.
fn command_note(st: i32) -> Option<String> {
    if libc::WIFEXITED(st) {
        return match libc::WEXITSTATUS(st) {
            0 => None,
            127 => Some("  note: the command could not be executed (exit 127)\n".into()),
            EXIT_NO_USER => Some(
                "  note: the command could not switch to its user (setgroups/setgid/setuid failed); \
                 is stallprof running as root?\n"
                    .into(),
            ),
            code => Some(format!("  note: the command exited with status {code}\n")),
        };
    }
    libc::WIFSIGNALED(st).then(|| {
        format!(
            "  note: the command was killed by signal {}\n",
            libc::WTERMSIG(st)
        )
    })
}

/// Every stall of the recording, in start order: those in the journal and
/// those a failed journal write may not have taken (`unjournaled`, kept
/// once: a write cut in the middle leaves some of them in the journal).
/// With the journal intact (`journal_failed` false), a journal that cannot
/// be read back is an error.
fn stalls_back(out: &OutDir, journal_failed: bool, unjournaled: Vec<Stall>) -> Result<Vec<Stall>> {
    let mut stalls = match journal::read(&out.join(journal::NAME)) {
        Ok(r) => r.recording.stalls,
        Err(e) if journal_failed => {
            log::warn!("{e}");
            Vec::new()
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context("reading back the recording's stalls"));
        }
    };
    let seen: std::collections::HashSet<(u32, u64)> =
        stalls.iter().map(|s| (s.tid, s.start_ns)).collect();
    stalls.extend(
        unjournaled
            .into_iter()
            .filter(|s| !seen.contains(&(s.tid, s.start_ns))),
    );
    stalls.sort_by_key(|s| (s.start_ns, s.tid));
    Ok(stalls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::journal::{
        JournalWriter,
        tests::{header, stall},
    };

    /// How a launched command ended, said in the summary only when it
    /// needs saying (wait statuses: exit code << 8, or the signal).
    #[test]
    fn command_notes() {
        assert_eq!(command_note(0), None);
        assert!(
            command_note(127 << 8)
                .unwrap()
                .contains("could not be executed")
        );
        assert!(
            command_note(EXIT_NO_USER << 8)
                .unwrap()
                .contains("switch to its user")
        );
        assert!(
            command_note(3 << 8)
                .unwrap()
                .contains("exited with status 3")
        );
        assert!(
            command_note(libc::SIGKILL)
                .unwrap()
                .contains("killed by signal 9")
        );
    }

    /// A journal write that failed part way: the stalls it may or may not
    /// have taken come back once, with those the journal holds, in order.
    #[test]
    fn stalls_come_back_from_the_journal_once() {
        let root = std::env::temp_dir().join(format!("stallprof-back-{}", random_suffix()));
        let dir = OutDir::create_new(&root).unwrap();
        let mut j = JournalWriter::create(&dir, header()).unwrap();
        let (a, b, c) = (stall(300, "spin"), stall(100, "spin"), stall(500, "sleep"));
        j.append(&[], [&a, &b], None).unwrap();
        drop(j);
        let starts = |v: &[Stall]| v.iter().map(|s| s.start_ns).collect::<Vec<_>>();
        let back = stalls_back(&dir, true, vec![a.clone(), c.clone()]).unwrap();
        assert_eq!(starts(&back), [100, 300, 500]);
        assert_eq!(back[2], c);
        // An intact journal is the only source.
        let back = stalls_back(&dir, false, Vec::new()).unwrap();
        assert_eq!(starts(&back), [100, 300]);
        std::fs::remove_dir_all(&root).unwrap();
        // A journal that cannot be read back is an error, unless its
        // writes had failed (then what is in memory is what there is).
        assert!(stalls_back(&dir, false, Vec::new()).is_err());
    }
}
