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

use anyhow::{Context, Result, bail};
use clap::Args;
use log::info;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};

use crate::{
    commands::StallArgs,
    kernel::probe::Probes,
    os::units::fmt_ns,
    os::units::parse_duration,
    os::{
        clock::monotonic_ns,
        proc::{is_own_fork, process_alive, read_comm},
    },
    pipeline::engine::{Engine, NoControl},
    report,
    report::model::{Recording, Stall},
};

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

/// Validated `record` settings.
#[derive(Debug, Clone)]
pub struct RecordConfig {
    pub target: Target,
    pub tids: Option<HashSet<u32>>,
    pub threshold_ns: u64,
    pub sample_hz: u64,
    /// The kernel's sampling gate (`--sample-after`).
    pub sample_after_ns: u64,
    pub duration: Option<Duration>,
    pub output: PathBuf,
    pub save_events: bool,
    pub live_status: bool,
}

#[derive(Debug, Clone)]
pub enum Target {
    Pid(u32),
    Command(Vec<String>),
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
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    bail!("no process with pid {pid}: check the pid (e.g. `pgrep -f yourapp`)");
                }
                Target::Pid(pid)
            }
            (None, false) => {
                if find_in_path(&a.command[0]).is_none() {
                    bail!(
                        "command not found: {} (give a path or put it on PATH)",
                        a.command[0]
                    );
                }
                Target::Command(a.command)
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
        let output = a.output.unwrap_or_else(|| {
            let who = match &target {
                Target::Pid(p) => p.to_string(),
                Target::Command(c) => Path::new(&c[0])
                    .file_name()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            };
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            PathBuf::from(format!("stallprof-{who}-{secs}"))
        });
        Ok(RecordConfig {
            target,
            tids: (!a.tids.is_empty()).then(|| a.tids.into_iter().collect()),
            threshold_ns,
            sample_hz: a.frequency,
            sample_after_ns,
            duration: a.duration.map(Duration::from_nanos),
            output,
            save_events: a.save_events,
            live_status: !a.quiet && std::io::stderr().is_terminal(),
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

impl Launched {
    fn spawn(argv: &[String]) -> Result<Launched> {
        use std::ffi::CString;
        // Everything the child needs is allocated before fork.
        let cargs: Vec<CString> = argv
            .iter()
            .map(|a| CString::new(a.as_bytes()).context("an argument contains a NUL byte"))
            .collect::<Result<_>>()?;
        let mut ptrs: Vec<*const libc::c_char> = cargs.iter().map(|c| c.as_ptr()).collect();
        ptrs.push(std::ptr::null());
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
                libc::execvp(ptrs[0], ptrs.as_ptr());
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

/// Run a recording to the end and write its outputs. Returns the summary text.
pub fn run(cfg: RecordConfig) -> Result<String> {
    report::prepare_dir(&cfg.output)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(record(cfg))
}

async fn record(cfg: RecordConfig) -> Result<String> {
    let mut launched = match &cfg.target {
        Target::Command(argv) => Some(Launched::spawn(argv)?),
        Target::Pid(_) => None,
    };
    let pid = match (&cfg.target, &launched) {
        (Target::Pid(p), _) => *p,
        (_, Some(l)) => l.pid,
        _ => unreachable!(),
    };
    let t0 = Instant::now();
    let mut probes = Probes::attach(pid, cfg.sample_hz, cfg.sample_after_ns)?;
    // SAFETY: the ring buffer owns its map fd and keeps it open, unchanged,
    // for as long as the AsyncFd holds it.
    let mut ring = unsafe { AsyncFd::register(probes.take_events()?)? };
    if let Some(l) = launched.as_mut() {
        l.release()?;
    } else if !process_alive(pid) {
        bail!("process {pid} exited while stallprof was attaching; nothing to record");
    }
    let attach_ms = t0.elapsed().as_secs_f64() * 1e3;
    info!("attached to {pid} in {attach_ms:.0} ms");
    let started_ns = monotonic_ns();

    let mut engine = Engine::new(cfg.threshold_ns, cfg.tids.clone());
    if cfg.save_events {
        engine.save_to(&cfg.output)?;
    }
    engine.tick(&[pid], &mut probes);
    let mut comm = read_comm(pid, pid).filter(|_| launched.is_none());

    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let deadline = cfg.duration.map(|d| tokio::time::Instant::now() + d);
    // Fast ticks for the first two seconds: a launched command's
    // interpreter or runtime should be found before its first stall.
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut ticks = 0u32;
    let mut drain_tick = tokio::time::interval(Duration::from_millis(20));
    let mut ended_by = "target exit";
    let mut status_shown = false;
    loop {
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                engine.drain(guard.get_inner_mut(), &mut probes);
                guard.clear_ready();
            }
            _ = sigint.recv() => { ended_by = "Ctrl-C"; break; }
            _ = sigterm.recv() => { ended_by = "SIGTERM"; break; }
            _ = async { tokio::time::sleep_until(deadline.unwrap()).await }, if deadline.is_some() => {
                ended_by = "duration"; break;
            }
            _ = drain_tick.tick() => {
                // Events are submitted without wakeups (see RINGBUF_WAKEUP_BYTES).
                engine.drain(ring.get_mut(), &mut probes);
            }
            _ = tick.tick() => {
                ticks += 1;
                if ticks == 40 {
                    tick = tokio::time::interval(Duration::from_millis(250));
                }
                let exited = launched.as_mut().is_some_and(|l| l.try_wait().is_some());
                if exited || !process_alive(pid) || engine.take_exited().contains(&pid) {
                    break;
                }
                // Every tick: a launcher (a pyenv shim, `env`) may exec again.
                if !is_own_fork(pid)
                    && let Some(c) = read_comm(pid, pid)
                {
                    comm = Some(c);
                }
                engine.tick(&[pid], &mut probes);
                if cfg.live_status {
                    let busy = engine.busy_now_ns(monotonic_ns());
                    let busy = if busy >= cfg.threshold_ns { format!(", stalled now {}", fmt_ns(busy)) } else { String::new() };
                    eprint!(
                        "\r\x1b[Krecording pid {pid}: {:.0}s, {} stalls, worst {}{busy}",
                        t0.elapsed().as_secs_f64(),
                        engine.stall_count(),
                        fmt_ns(engine.worst_ns())
                    );
                    status_shown = true;
                }
            }
        }
    }
    if status_shown {
        eprint!("\r\x1b[K");
    }
    // Last events, then detach before anything slow.
    engine.drain(ring.get_mut(), &mut NoControl);
    let ended_ns = monotonic_ns();
    let mut drops = probes.drops();
    let kernel_filtered = probes.filtered();
    drop(ring);
    drop(probes);
    info!("recording ended by {ended_by}; probes detached");

    engine.finish(ended_ns);
    if cfg.save_events {
        engine.finish_saving(&cfg.output)?;
    }
    for (k, v) in engine.agent_drops() {
        drops.insert(k.to_string(), v);
    }
    let lost_events = drops
        .get(profiler_common::Drop::RingbufFull.name())
        .copied()
        .unwrap_or(0);
    let comm = comm.unwrap_or_else(|| match &cfg.target {
        Target::Command(c) => Path::new(&c[0])
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        Target::Pid(_) => "?".into(),
    });
    let mut stalls: Vec<Stall> = engine.take_stalls().into_iter().map(|(_, s)| s).collect();
    stalls.sort_by_key(|s| (s.start_ns, s.tid));
    let rec = Recording {
        pid,
        comm,
        threshold_ns: cfg.threshold_ns,
        sample_hz: cfg.sample_hz,
        sample_after_ns: cfg.sample_after_ns,
        kernel_filtered,
        busy_periods: engine.busy_periods(),
        clock: "monotonic".into(),
        started_ns,
        ended_ns,
        lost_events,
        drops,
        executor_threads: engine.executors(pid),
        stallprof_version: env!("CARGO_PKG_VERSION").into(),
        stalls,
    };
    let files = report::write_all(&rec, &cfg.output)?;
    let mut text = report::summary::text(&rec, &files);
    if let Some(l) = launched.as_mut() {
        // The command may still run (duration/Ctrl-C): leave it be, but reap if done.
        match l.try_wait() {
            Some(st) if libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 127 => {
                text.push_str("  note: the command could not be executed (exit 127)\n")
            }
            Some(st) if libc::WIFEXITED(st) && libc::WEXITSTATUS(st) != 0 => {
                text.push_str(&format!(
                    "  note: the command exited with status {}\n",
                    libc::WEXITSTATUS(st)
                ))
            }
            Some(st) if libc::WIFSIGNALED(st) => text.push_str(&format!(
                "  note: the command was killed by signal {}\n",
                libc::WTERMSIG(st)
            )),
            _ => {}
        }
    }
    Ok(text)
}
