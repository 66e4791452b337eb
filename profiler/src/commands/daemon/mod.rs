//! `stallprof daemon`: host-wide, continuous stall monitoring.
//!
//! In: every process's wait/sched/sample events (probes attached for tgid 0)
//! and the config. Out: Prometheus metrics per process, rolling per-process
//! reports (folded, SVG, pprof) in the data directory, with a service's
//! workers grouped (`services`), pprof over HTTP, an index page; on SIGTERM/SIGINT the current window is flushed and every
//! probe detached.
//!
//! Two threads:
//! - the *collector* owns the probes and the [`Engine`] (the same stall
//!   model and symbolization as `record`). It drains the ring buffer every
//!   100 ms on a timer (batching bounds its wakeups on a busy host). On a
//!   quiet one — five empty drains in a row with nothing waiting on a drain
//!   ([`Engine::quiet`]) — it sets `READER_ASLEEP` and waits on the ring's
//!   fd until its next tick instead: the kernel side's next record wakes
//!   it. That wait is a raw `poll` system call (rustix), not the C
//!   library's, so the daemon's own wait uprobes never see it and the
//!   daemon does not watch itself; with the syscall-tracepoint waits
//!   (`--probes tracepoints`) they would, and the timer is kept.
//!   Every 250 ms it ticks the engine for the monitored processes; every
//!   second it follows exits, exec and pid reuse, publishes counters, and
//!   enforces the memory bounds; at each window's end it writes reports and
//!   applies retention.
//! - the *main* thread runs the HTTP server (`http`) and waits for signals.
//!
//! They share [`Shared`]: the metrics registry (internally synchronized),
//! and two small mutex-guarded views (recent stalls, process rows) that
//! the collector updates and the HTTP side reads.
//!
//! Memory is bounded (docs/daemon.md): tracked processes ≤
//! `limits.max_processes`, exited ones forgotten after `forget_after`, recent
//! stalls ≤ [`RECENT_BUDGET`] bytes, a window's stalls ≤
//! [`reports::WINDOW_BUDGET`], and the engine (interned stacks,
//! per-process caches) rebuilt past `limits.max_stacks` (default
//! [`MAX_STACKS`]) stacks or [`MAX_FORGOTTEN`] forgotten processes.
pub mod config;
pub mod export;
pub mod http;
pub mod metrics;
pub mod procs;
pub mod reports;
pub mod rules;
pub mod services;

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use clap::Args;
use log::{debug, info, warn};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::{oneshot, watch},
};

use self::{
    config::{DaemonConfig, Overrides},
    metrics::{Labels, Metrics},
    procs::ProcInfo,
    reports::Window,
};
use crate::{
    commands::live::ReaderSleep, kernel::probe::Probes, model::Stall, os::clock::monotonic_ns,
    os::outdir::OutDir, os::units::fmt_ns, pipeline::engine::Engine,
};

const EXAMPLES: &str = "\
EXAMPLES:
    # Watch every event-loop process; metrics on 127.0.0.1:9436, reports in /var/lib/stallprof
    sudo stallprof daemon

    # With a config file (see docs/daemon.md); check it first
    stallprof daemon --config /etc/stallprof/daemon.toml --check-config
    sudo stallprof daemon --config /etc/stallprof/daemon.toml

    # Scrape it
    curl -s 127.0.0.1:9436/metrics | grep stallprof_stall
    curl -so stalls.pb.gz '127.0.0.1:9436/debug/pprof/profile?seconds=30' && go tool pprof -top stalls.pb.gz
";

#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct DaemonArgs {
    /// Configuration file (TOML; see docs/daemon.md). Flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address for /metrics, /debug/pprof/profile and the index page:
    /// IP:PORT, or unix:/PATH for a Unix socket (mode 0600)
    /// [default: 127.0.0.1:9436, loopback only].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Directory for the rolling reports [default: /var/lib/stallprof].
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Busy periods at least this long are stalls [default: 50ms].
    #[arg(long, value_name = "DURATION")]
    pub threshold: Option<String>,
    /// CPU-clock sampling frequency in Hz for on-CPU stacks [default: 199].
    #[arg(short = 'F', long, value_name = "HZ")]
    pub frequency: Option<u64>,
    /// Length of one report window [default: 60s].
    #[arg(long, value_name = "DURATION")]
    pub window: Option<String>,
    /// Which kernel probes [default: auto] (see `record --probes`).
    #[arg(long, value_enum)]
    pub probes: Option<crate::kernel::probe::ProbeChoice>,
    /// Validate the configuration, print the effective settings and exit.
    #[arg(long)]
    pub check_config: bool,
}

/// Drain period of the ring buffer.
const DRAIN_EVERY: Duration = Duration::from_millis(100);
/// The reader never sleeps in the daemon's first seconds (start-up scans).
const SLEEP_NOT_BEFORE: Duration = Duration::from_secs(2);
/// A loop iteration this long is logged (`-vv`) with where its time went:
/// the ring buffer waits that long for its next drain.
const SLOW_LOOP: Duration = Duration::from_millis(50);
/// Engine upkeep (maps snapshots, CPython thread tables).
const TICK_EVERY: Duration = Duration::from_millis(250);
/// Exits, exec, pid reuse, counters, memory bounds.
const HOUSEKEEP_EVERY: Duration = Duration::from_secs(1);
/// Default of `limits.max_stacks`: the engine is rebuilt past this many
/// interned stacks (~1 KiB each with their index entry): the table only
/// grows while it lives.
pub const MAX_STACKS: usize = 50_000;
/// ... or after this many processes were forgotten (its symbolizer keeps a
/// maps snapshot and caches per process it has seen).
pub const MAX_FORGOTTEN: usize = 256;
/// Recent stalls kept for `/debug/pprof/profile` and the index page.
pub const RECENT_BUDGET: usize = 16 << 20;
pub const RECENT_MAX: usize = 10_000;
pub const RECENT_AGE: Duration = Duration::from_secs(600);

pub struct RecentStall {
    pub pid: u32,
    pub comm: String,
    pub container: String,
    /// Wall clock (ns since the epoch) when the daemon got it.
    pub wall_ns: i64,
    pub bytes: usize,
    pub stall: Arc<Stall>,
}

#[derive(Default)]
pub struct Recent {
    pub q: VecDeque<RecentStall>,
    bytes: usize,
}

impl Recent {
    fn push(&mut self, r: RecentStall) {
        self.bytes += r.bytes;
        self.q.push_back(r);
        let oldest_ok = wall_ns() - RECENT_AGE.as_nanos() as i64;
        while self.bytes > RECENT_BUDGET
            || self.q.len() > RECENT_MAX
            || self.q.front().is_some_and(|f| f.wall_ns < oldest_ok)
        {
            let Some(f) = self.q.pop_front() else { break };
            self.bytes -= f.bytes;
        }
    }
}

/// One row of the index page.
#[derive(Clone)]
pub struct ProcRow {
    pub info: Arc<ProcInfo>,
    pub loop_threads: usize,
    pub stalls: u64,
    pub stall_ns: u64,
    pub exited: bool,
    /// `window/proc/stalls.svg`, relative to the data directory.
    pub last_report: Option<String>,
}

#[derive(Default)]
pub struct Index {
    pub procs: Vec<ProcRow>,
}

pub struct Shared {
    pub metrics: Metrics,
    pub data_dir: PathBuf,
    pub threshold_ns: u64,
    /// Which frames are the application's (`app_paths`).
    pub app: crate::classify::AppPaths,
    pub recent: Mutex<Recent>,
    pub index: Mutex<Index>,
}

fn wall_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

pub fn run(a: DaemonArgs) -> Result<String> {
    let o = Overrides {
        listen: a.listen,
        data_dir: a.data_dir,
        threshold: a.threshold,
        frequency: a.frequency,
        window: a.window,
        probes: a.probes,
    };
    let cfg =
        DaemonConfig::load(a.config.as_deref(), &o).context("invalid daemon configuration")?;
    if a.check_config {
        return Ok(cfg.describe());
    }
    let data = OutDir::open_or_create_shared(&cfg.data_dir, cfg.data_group.as_ref().map(|g| g.1))
        .with_context(|| {
        format!(
            "the data directory {} cannot be used (set data_dir or --data-dir)",
            cfg.data_dir.display()
        )
    })?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(daemon(cfg, data))
}

async fn daemon(cfg: DaemonConfig, data: OutDir) -> Result<String> {
    let token = match &cfg.http.token_file {
        Some(p) => Some(http::read_token(p)?),
        None => None,
    };
    raise_nofile_limit();
    let listener = http::bind(&cfg.listen, cfg.data_group.as_ref().map(|g| g.1)).await?;
    let settings = Arc::new(http::Settings {
        http: cfg.http.clone(),
        token,
        data: data.clone(),
    });
    let shared = Arc::new(Shared {
        metrics: Metrics::new(),
        data_dir: cfg.data_dir.clone(),
        threshold_ns: cfg.threshold_ns,
        app: crate::classify::AppPaths::new(&cfg.app_paths),
        recent: Mutex::new(Recent::default()),
        index: Mutex::new(Index::default()),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = oneshot::channel::<()>();
    let (done_tx, mut done_rx) = oneshot::channel::<Result<String>>();
    let listen = match &cfg.listen {
        config::Listen::Tcp(a) => format!("http://{a}/metrics"),
        config::Listen::Unix(p) => format!("/metrics on unix:{}", p.display()),
    };
    let data_dir = cfg.data_dir.clone();
    {
        let (shared, stop) = (shared.clone(), stop.clone());
        std::thread::Builder::new()
            .name("stallprof-collect".into())
            .spawn(move || {
                let r = Collector::start(cfg, shared, data).and_then(|c| {
                    let _ = ready_tx.send(());
                    c.run(&stop)
                });
                let _ = done_tx.send(r);
            })
            .context("starting the collector thread")?;
    }
    if ready_rx.await.is_err() {
        // The collector ended before attaching: its error says why.
        return done_rx
            .await
            .context("the collector thread died")?
            .context("attaching the probes");
    }
    eprintln!(
        "stallprof daemon: probes attached host-wide; metrics at {listen}, reports in {}",
        data_dir.display()
    );
    let (stop_http, stop_rx) = watch::channel(false);
    let server = tokio::spawn(http::serve(listener, shared.clone(), settings, stop_rx));
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let ended_by = tokio::select! {
        _ = sigint.recv() => "SIGINT",
        _ = sigterm.recv() => "SIGTERM",
        r = &mut done_rx => {
            let _ = stop_http.send(true);
            let _ = server.await;
            return match r {
                Ok(Ok(_)) => anyhow::bail!("the collector stopped unexpectedly"),
                Ok(Err(e)) => Err(e),
                Err(_) => anyhow::bail!("the collector thread died"),
            };
        }
    };
    info!("{ended_by}: flushing the current window and detaching");
    stop.store(true, Ordering::SeqCst);
    let summary = done_rx.await.context("the collector thread died")??;
    let _ = stop_http.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    Ok(format!(
        "stallprof daemon: stopped by {ended_by}; {summary}"
    ))
}

/// Each HTTP connection is a descriptor: the soft open-file limit (often
/// 1024) is raised to the hard one so `http.max_connections` is reachable;
/// `accept` backs off if it is hit anyway.
fn raise_nofile_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    if l.current < l.maximum {
        l.current = l.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, l) {
            warn!("cannot raise the open-file limit: {e}");
        }
    }
}

/// A monitored process.
struct Tracked {
    info: Arc<ProcInfo>,
    labels: Labels,
    stalls: u64,
    stall_ns: u64,
    last_report: Option<String>,
    /// Its runtime problems when it exited (the engine forgets them then):
    /// a stall of it delivered after its exit still carries them.
    problems_at_exit: Vec<crate::model::RuntimeProblem>,
}

impl Tracked {
    /// `loop_threads`: from the engine's registry (0 once it exited).
    fn row(&self, exited: bool, loop_threads: usize) -> ProcRow {
        ProcRow {
            info: self.info.clone(),
            loop_threads,
            stalls: self.stalls,
            stall_ns: self.stall_ns,
            exited,
            last_report: self.last_report.clone(),
        }
    }
}

fn labels_of(p: &ProcInfo) -> Labels {
    vec![
        ("pid", p.pid.to_string()),
        ("comm", p.comm.clone()),
        ("exe", p.exe.clone()),
        ("cgroup", p.cgroup.clone()),
        ("container", p.container().to_string()),
        ("pod", p.pod().to_string()),
        ("runtime", p.runtime.clone()),
    ]
}

/// Included processes given their own wait uprobes (live, or exited and
/// still being detached) before they go on the C library files instead
/// ([`Collector::move_waits_to_files`]). Each process's uprobes are a consumer
/// the kernel walks at every hit of every probed process: on the test VM
/// an included process's `poll` cost 2.5 µs with one probed process and
/// 5.0–6.9 µs with 31 (~85 ns a call for each other; bare 0.39 µs;
/// docs/daemon.md), so at 8 it pays ~0.6 µs more. And a process's links
/// take 1.3 s to detach, one link at a time host-wide: included processes
/// that come and go faster than that would pile up.
pub const MAX_PROCESS_WAITS: usize = 8;

/// How long the daemon's exit waits for the collector, at most.
const EXPORT_DEADLINE: Duration = Duration::from_secs(3);

struct Collector {
    cfg: DaemonConfig,
    /// The data directory, opened once (reports are written relative to it).
    data: OutDir,
    sh: Arc<Shared>,
    // Field order = drop order: the ring before the probes that own its map.
    ring: RingBuf<MapData>,
    probes: Probes,
    engine: Engine,
    /// Monitored live processes, by pid.
    procs: HashMap<u32, Tracked>,
    /// Live processes left out (rules, the daemon itself, over the limit),
    /// and what they were judged on: one that changed is judged again. The
    /// kernel side skips their waits (`Probes::leave_out`).
    excluded: HashMap<u32, procs::Judged>,
    /// The left-out process [`Collector::housekeep`] looked at last.
    judged_cursor: u32,
    /// Processes not looked at yet for their wait functions.
    new_procs: procs::NewProcesses,
    /// Include rules: each included process gets its own wait uprobes,
    /// judged when it appears; without, the uprobes are on each C library
    /// file, for every process, judged at its first wait.
    per_process_waits: bool,
    /// Included processes carrying their own wait uprobes, and what they
    /// were judged on: one that changed (an exec, a cgroup move, its pid
    /// reused) is looked at again, as the left-out ones are.
    included: HashMap<u32, procs::Judged>,
    /// Included processes to probe once the detaches are done.
    deferred: HashMap<u32, procs::Judged>,
    /// Exited processes whose series are still exported, oldest first.
    gone: VecDeque<(Instant, Tracked)>,
    window: Window,
    /// Closed windows whose reports failed to write, oldest first: retried
    /// at each roll, at most [`MAX_UNWRITTEN`] kept.
    unwritten: VecDeque<Window>,
    next_roll_mono: u64,
    agent_base: BTreeMap<String, u64>,
    forgotten_since_reset: usize,
    self_pid: u32,
    started: Instant,
    total_stalls: u64,
    total_reports: u64,
    processes_seen: u64,
    /// Stalls as spans to a collector (`[otlp]`).
    export: Option<export::DaemonExport>,
}

impl Collector {
    fn start(cfg: DaemonConfig, sh: Arc<Shared>, data: OutDir) -> Result<Collector> {
        let mut probes = Probes::attach(
            0,
            cfg.sample_hz,
            crate::kernel::probe::default_sample_after(cfg.threshold_ns),
            cfg.probes,
            false,
        )?;
        // Its own waits (the HTTP side's runtime calls the C library's
        // epoll_wait) are none of its business.
        probes.leave_out(std::process::id());
        // The kernel's BTF, parsed for the load, is freed: give it back.
        crate::os::heap::release();
        let ring = probes.take_events()?;
        let engine = Engine::new(cfg.threshold_ns, None);
        let now = monotonic_ns();
        let next_roll_mono = now + until_boundary(cfg.window);
        let per_process_waits = cfg.per_process_waits();
        info!(
            "probes attached host-wide ({} Hz), threshold {}; wait uprobes {}",
            cfg.sample_hz,
            fmt_ns(cfg.threshold_ns),
            if per_process_waits {
                "on each included process"
            } else {
                "on each C library file, for every process"
            }
        );
        let mut c = Collector {
            window: Window::new(SystemTime::now(), now),
            unwritten: VecDeque::new(),
            next_roll_mono,
            cfg,
            data,
            sh,
            ring,
            probes,
            engine,
            procs: HashMap::new(),
            excluded: HashMap::new(),
            judged_cursor: 0,
            new_procs: procs::NewProcesses::default(),
            per_process_waits,
            included: HashMap::new(),
            deferred: HashMap::new(),
            gone: VecDeque::new(),
            agent_base: BTreeMap::new(),
            forgotten_since_reset: 0,
            self_pid: std::process::id(),
            started: Instant::now(),
            total_stalls: 0,
            total_reports: 0,
            processes_seen: 0,
            export: None,
        };
        if let Some(o) = &c.cfg.otlp {
            c.export = Some(export::DaemonExport::start(o, &c.cfg.app_paths)?);
        }
        c.look_at_new_processes();
        Ok(c)
    }

    fn run(mut self, stop: &AtomicBool) -> Result<String> {
        let mut last_tick = Instant::now() - TICK_EVERY;
        let mut last_house = Instant::now();
        let mut reader = ReaderSleep::default();
        // The reader may sleep only where its own wait is invisible to the
        // probes (see the module doc).
        let may_sleep = !self.probes.probe_set().waits.on_tracepoints();
        while !stop.load(Ordering::SeqCst) {
            let t0 = Instant::now();
            if self.drain() > 0 {
                reader.woke();
            } else if may_sleep
                && reader.empty_drain()
                && self.started.elapsed() >= SLEEP_NOT_BEFORE
                && self.engine.quiet()
                && self.probes.set_reader_asleep()
            {
                reader.slept();
                // A record submitted before the flag was set woke no one.
                if self.drain() > 0 {
                    reader.woke();
                }
            }
            let t1 = Instant::now();
            if last_tick.elapsed() >= TICK_EVERY {
                last_tick = Instant::now();
                self.tick();
            }
            let t2 = Instant::now();
            if last_house.elapsed() >= HOUSEKEEP_EVERY {
                last_house = Instant::now();
                self.housekeep();
            }
            let t3 = Instant::now();
            if monotonic_ns() >= self.next_roll_mono {
                self.roll();
            }
            let busy = t0.elapsed();
            if busy >= SLOW_LOOP {
                debug!(
                    "slow loop: {busy:?} (drain {:?}, upkeep {:?}, housekeeping {:?}, reports {:?})",
                    t1 - t0,
                    t2 - t1,
                    t3 - t2,
                    t3.elapsed()
                );
            }
            if reader.asleep() && !self.engine.quiet() {
                // The upkeep started something a drain finishes.
                reader.woke();
            }
            if reader.asleep() {
                let next_tick = TICK_EVERY.saturating_sub(last_tick.elapsed());
                self.wait_for_record(next_tick.max(Duration::from_millis(1)));
            } else {
                std::thread::sleep(DRAIN_EVERY);
            }
        }
        reader.log();
        // Last events, close busy periods still open, flush, detach.
        self.drain();
        self.engine.finish(monotonic_ns());
        let stalls = self.engine.take_stalls();
        for (pid, s) in stalls {
            self.on_stall(pid, s);
        }
        self.roll();
        self.housekeep();
        let export = self.export.take().map(|x| x.finish(EXPORT_DEADLINE));
        if let Some(r) = &export {
            self.sh.metrics.set_otlp(r.exported, r.failed);
            match &r.last_error {
                Some(e) if r.failed > 0 => warn!(
                    "OTLP: {} stall spans exported, {} failed ({e}); the reports have them",
                    r.exported, r.failed
                ),
                _ => info!("OTLP: {} stall spans exported", r.exported),
            }
        }
        let summary = format!(
            "{:.0}s, {} stalls in {} processes, {} reports written; probes detached\n",
            self.started.elapsed().as_secs_f64(),
            self.total_stalls,
            self.processes_seen,
            self.total_reports
        );
        info!(
            "ring buffer: at most {} KiB waiting at a drain",
            self.engine.ring_backlog_max() / 1024
        );
        let Collector { ring, probes, .. } = self;
        drop(ring);
        drop(probes);
        info!("probes detached");
        Ok(summary)
    }

    /// Drain the ring; returns how many records it held.
    fn drain(&mut self) -> usize {
        let (records, skipped) = self
            .engine
            .drain_executors(&mut self.ring, &mut self.probes);
        self.sh.metrics.non_loop_stack_events.inc_by(skipped);
        for pid in self.engine.take_new_waiting() {
            self.judge_early(pid);
        }
        for (pid, s) in self.engine.take_stalls() {
            self.on_stall(pid, s);
        }
        for pid in self.engine.take_exited() {
            self.exited(pid);
        }
        records
    }

    /// Sleep until the ring's fd is readable (the kernel side woke its
    /// reader) or `timeout` passes. A failed poll sleeps the timeout.
    fn wait_for_record(&self, timeout: Duration) {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        let mut fds = [PollFd::new(&self.ring, PollFlags::IN)];
        let t = Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        if let Err(e) = poll(&mut fds, Some(&t))
            && e != rustix::io::Errno::INTR
        {
            debug!("poll on the ring buffer: {e}; sleeping instead");
            std::thread::sleep(timeout);
        }
    }

    /// The monitored process `pid`, read from /proc and judged by the rules
    /// the first time; None if it is left out or gone.
    fn observe(&mut self, pid: u32) -> Option<&mut Tracked> {
        if self.procs.contains_key(&pid) {
            return self.procs.get_mut(&pid);
        }
        if self.excluded.contains_key(&pid) {
            return None;
        }
        let info = self.judge(pid)?;
        while self.procs.len() + self.gone.len() >= self.cfg.max_processes {
            // Room first from the exited ones still exported, oldest first.
            let Some((_, old)) = self.gone.pop_front() else {
                self.sh.metrics.over_limit.inc();
                warn!(
                    "limits.max_processes ({}) reached: not reporting pid {pid} ({})",
                    self.cfg.max_processes, info.comm
                );
                self.leave_out(&info);
                return None;
            };
            self.sh.metrics.remove_process(&old.labels);
        }
        Some(self.track(info))
    }

    /// A process's first wait: one the rules leave out is left out at once,
    /// before any loop of it is elected and whether or not it has one, so
    /// its waits stop reaching the ring. One they take is tracked at its
    /// loop's election ([`Collector::observe`]).
    fn judge_early(&mut self, pid: u32) {
        if !self.procs.contains_key(&pid) && !self.excluded.contains_key(&pid) {
            self.judge(pid);
        }
    }

    /// `pid` read from /proc and judged by the rules: its info when they
    /// take it; None when it is gone, or left out (the daemon itself too).
    fn judge(&mut self, pid: u32) -> Option<ProcInfo> {
        let process = self.engine.process(pid);
        let info = ProcInfo::read(pid, process)?;
        if pid == self.self_pid || !self.cfg.rules.monitored(&info) {
            debug!("pid {pid} ({}) is left out by the rules", info.comm);
            self.leave_out(&info);
            return None;
        }
        Some(info)
    }

    /// A process is not reported: from now it costs the host what any
    /// process the daemon does not watch costs — nothing with include
    /// rules (its own wait uprobes, if it had them, go), else the trap of
    /// its wait calls. The kernel side skips its waits (with include
    /// rules, only one that had wait uprobes: records of it may be in
    /// flight); the loop threads already elected lose their switch and
    /// sampling events, and the engine forgets what it learnt of it.
    fn leave_out(&mut self, info: &ProcInfo) {
        self.excluded.insert(info.pid, procs::Judged::of(info));
        self.included.remove(&info.pid);
        self.deferred.remove(&info.pid);
        let probed = self.probes.unwatch_waits(info.pid, "left out");
        if !self.per_process_waits || probed {
            self.probes.leave_out(info.pid);
        }
        self.engine.forget(info.pid, &mut self.probes);
    }

    /// A left-out process is gone, exec'd or moved to another cgroup:
    /// followed again (its pid may be reused). Without include rules what
    /// it is now is judged at its next wait; with them, no wait of it is
    /// seen until it is judged, so it is judged now.
    fn take_back(&mut self, pid: u32) {
        if self.release(pid)
            && self.per_process_waits
            && let Some(info) = self.judge(pid)
        {
            self.probe_included(&info);
        }
    }

    /// [`Collector::take_back`] without judging it again; true if it was
    /// left out.
    fn release(&mut self, pid: u32) -> bool {
        if self.excluded.remove(&pid).is_none() {
            return false;
        }
        self.probes.take_back(pid);
        // What records of it were in flight when it was left out.
        self.engine.forget(pid, &mut self.probes);
        true
    }

    /// Processes that appeared since the last upkeep (and young ones to
    /// look at again, [`procs::NewProcesses`]): with include rules, one
    /// they take gets its own wait uprobes; without, a C library file no
    /// process mapped before gets them for every process. A gone process's
    /// own uprobes go.
    fn look_at_new_processes(&mut self) {
        let (looks, gone) = self.new_procs.scan();
        for pid in gone {
            self.probes.unwatch_waits(pid, "exited");
            self.included.remove(&pid);
            self.deferred.remove(&pid);
            if !self.procs.contains_key(&pid) {
                // What the engine read of it when it was judged (an
                // included process that never waited has no exit event).
                self.engine.forget(pid, &mut self.probes);
            }
            // A left-out process that exited: with include rules every
            // process on the host is judged, so under churn (a build
            // spawning hundreds a second) this is what keeps `excluded`
            // to the live ones, not the upkeep's 64 looks a second.
            self.release(pid);
        }
        for look in looks {
            let c_library = if !self.per_process_waits {
                self.probes.watch_file_waits(look.pid)
            } else {
                self.watch_if_included(&look)
            };
            self.new_procs.looked(look, c_library);
        }
    }

    /// With include rules: a new process (or one that exec'd young) is
    /// judged, and one they take gets its own wait uprobes. True when no
    /// look again is needed (left out, a kernel thread, gone, or its C
    /// library probed).
    fn watch_if_included(&mut self, look: &procs::Look) -> bool {
        let pid = look.pid;
        if look.exe.is_none()
            && (crate::os::proc::is_kernel_thread(pid) || !crate::os::proc::process_alive(pid))
        {
            return true;
        }
        if look.exec {
            self.release(pid);
        } else if self.excluded.contains_key(&pid) {
            return true;
        }
        let info = match self.procs.get(&pid) {
            Some(t) => Some(t.info.as_ref().clone()),
            None => self.judge(pid),
        };
        match info {
            Some(info) => self.probe_included(&info),
            None => true, // left out, or gone
        }
    }

    /// An included process's own wait uprobes, or, past
    /// [`MAX_PROCESS_WAITS`], every process's on its C library file. True
    /// when no look again is needed: it maps a C library (probed, or its
    /// probing deferred), or it is gone.
    fn probe_included(&mut self, info: &ProcInfo) -> bool {
        let pid = info.pid;
        if !self.per_process_waits {
            return self.probes.watch_file_waits(pid);
        }
        if !self.probes.has_own_waits(pid) {
            if !crate::kernel::waits::maps_c_library(pid) {
                return !crate::os::proc::process_alive(pid); // its loader may map it yet
            }
            let detaching = self.probes.wait_probes_detaching();
            if self.probes.wait_probed_processes() + detaching >= MAX_PROCESS_WAITS {
                self.move_waits_to_files();
                return self.probes.watch_file_waits(pid);
            }
            if detaching > 0 {
                // Each detach holds the kernel's trace-event lock through
                // its grace periods (~90 ms a link), and an attach takes
                // it too: attached once the detaches are done, at an
                // upkeep, so the drain does not wait behind them.
                self.deferred.insert(pid, procs::Judged::of(info));
                return true;
            }
        }
        let done = self.probes.watch_included_waits(pid);
        if self.probes.has_own_waits(pid) {
            self.included.insert(pid, procs::Judged::of(info));
        }
        done
    }

    /// With include rules: what `pid` was judged on has changed (or it is
    /// gone): its own wait uprobes go and it is looked at again at the
    /// next upkeep, as a new process (the uprobes of an exec'd process
    /// would stay on the files its old image mapped).
    fn look_again(&mut self, pid: u32, why: &str) {
        self.new_procs.forget(pid);
        if self.per_process_waits {
            self.probes.unwatch_waits(pid, why);
            self.included.remove(&pid);
            self.deferred.remove(&pid);
        }
    }

    /// Included processes whose probing waited for detaches to finish
    /// ([`Collector::probe_included`]): probed now if they are done.
    fn probe_deferred(&mut self) {
        if self.deferred.is_empty() || self.probes.wait_probes_detaching() > 0 {
            return;
        }
        for (pid, judged) in std::mem::take(&mut self.deferred) {
            if judged.changed(pid) || self.excluded.contains_key(&pid) {
                // Gone, or to be judged again: a new look.
                self.new_procs.forget(pid);
                continue;
            }
            if let Some(info) = self.judge(pid) {
                self.probe_included(&info);
            }
        }
    }

    /// More included processes than [`MAX_PROCESS_WAITS`]: the wait
    /// uprobes go on each C library file instead, for every process, from
    /// now to the daemon's end; a process the rules leave out is judged
    /// again at its first wait and skipped by the kernel side from then,
    /// as without include rules.
    fn move_waits_to_files(&mut self) {
        warn!(
            "more than {MAX_PROCESS_WAITS} included processes wait in a C library: each one's \
             own wait uprobes would make every probed wait call dearer (each is a consumer the \
             kernel walks at every hit), so the wait uprobes go on each C library file instead, \
             for every process; from now a process the rules leave out pays the trap of its \
             wait calls (~2 µs each), as without include rules"
        );
        self.per_process_waits = false;
        self.included.clear();
        // Each process's own links go to the detach thread; until they
        // are detached a wait of an included process is seen by both
        // sets, its entry reported twice (the engine takes the second for
        // the same park again: no busy period lies between).
        let probed = self.probes.wait_probed_pids();
        for &pid in &probed {
            self.probes
                .unwatch_waits(pid, "moved to the C library files");
        }
        let deferred: Vec<u32> = std::mem::take(&mut self.deferred).into_keys().collect();
        for pid in probed.into_iter().chain(deferred) {
            self.probes.watch_file_waits(pid);
        }
        // Every process left out so far never had uprobes (or had its
        // own, then LEFT_OUT): each is judged again at its first wait
        // rather than filling LEFT_OUT with the whole host.
        let left_out: Vec<u32> = self.excluded.keys().copied().collect();
        for pid in left_out {
            if pid != self.self_pid {
                self.release(pid);
            }
        }
    }

    fn track(&mut self, info: ProcInfo) -> &mut Tracked {
        let pid = info.pid;
        let t = self.new_tracked(info);
        self.procs.insert(pid, t);
        self.procs.get_mut(&pid).expect("just inserted")
    }

    fn new_tracked(&mut self, info: ProcInfo) -> Tracked {
        let labels = labels_of(&info);
        // A reused pid running the same program has the same labels: its
        // predecessor's series end here (a counter reset for Prometheus).
        if let Some(i) = self.gone.iter().position(|(_, g)| g.labels == labels) {
            self.gone.remove(i);
        }
        self.sh.metrics.remove_process(&labels);
        self.sh.metrics.add_process(&labels);
        info!(
            "monitoring pid {} ({}, {}, {})",
            info.pid, info.comm, info.runtime, info.exe
        );
        self.processes_seen += 1;
        Tracked {
            info: Arc::new(info),
            labels,
            stalls: 0,
            stall_ns: 0,
            last_report: None,
            problems_at_exit: Vec::new(),
        }
    }

    fn on_stall(&mut self, pid: u32, s: Stall) {
        let gone_ix = if self.observe(pid).is_some() {
            None
        } else if self.excluded.contains_key(&pid) {
            return;
        } else {
            // Gone before it was ever read: the exited entry with this pid,
            // or a new one named after the thread.
            match self.gone.iter().rposition(|(_, g)| g.info.pid == pid) {
                Some(i) => Some(i),
                None => {
                    let info = ProcInfo::gone(pid, &s.thread_name);
                    if !self.cfg.rules.monitored(&info) {
                        return;
                    }
                    if self.procs.len() + self.gone.len() >= self.cfg.max_processes
                        && let Some((_, old)) = self.gone.pop_front()
                    {
                        self.sh.metrics.remove_process(&old.labels);
                    }
                    let t = self.new_tracked(info);
                    self.gone.push_back((Instant::now(), t));
                    Some(self.gone.len() - 1)
                }
            }
        };
        let t = match gone_ix {
            None => self.procs.get_mut(&pid).expect("observed"),
            Some(i) => &mut self.gone[i].1,
        };
        t.stalls += 1;
        t.stall_ns += s.duration_ns;
        self.sh.metrics.observe(&t.labels, &s);
        let info = t.info.clone();
        self.total_stalls += 1;
        let bytes = reports::stall_bytes(&s);
        let stall = Arc::new(s);
        self.sh
            .recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(RecentStall {
                pid,
                comm: info.comm.clone(),
                container: info.container().to_string(),
                wall_ns: wall_ns(),
                bytes,
                stall: stall.clone(),
            });
        let mut problems: Vec<_> = self
            .engine
            .runtime_problems()
            .into_iter()
            .filter(|p| p.pid == pid)
            .collect();
        if problems.is_empty()
            && let Some(i) = gone_ix
        {
            // Delivered after its exit (the engine forgot it then).
            problems = self.gone[i].1.problems_at_exit.clone();
        }
        if let Some(x) = self.export.as_mut() {
            x.add(&stall, info.start_ticks, &info.comm, &info.process);
        }
        if !self.window.add(&info, stall, problems) {
            self.sh.metrics.window_stalls_dropped.inc();
        }
    }

    /// A monitored process exited (or exec'd): stop its upkeep, keep its
    /// series for `forget_after`.
    fn exited(&mut self, pid: u32) {
        // Its runtime problems go with it from the engine: its report in
        // this window keeps them (a problem found after its stalls, e.g.
        // an interpreter refused while the host was busy, is in no stall's
        // copy).
        let problems: Vec<_> = self
            .engine
            .runtime_problems()
            .into_iter()
            .filter(|p| p.pid == pid)
            .collect();
        if !problems.is_empty() {
            self.window.note_problems(&problems);
        }
        self.engine.forget(pid, &mut self.probes);
        self.forgotten_since_reset += 1;
        if let Some(mut t) = self.procs.remove(&pid) {
            info!("pid {pid} ({}) is gone", t.info.comm);
            t.problems_at_exit = problems;
            self.gone.push_back((Instant::now(), t));
        }
        self.take_back(pid);
    }

    fn tick(&mut self) {
        // New processes' wait functions (a container brings its own C
        // library): each new pid once, at the tick after it appears.
        self.look_at_new_processes();
        self.sh
            .metrics
            .set_probes(self.probes.probe_set(), self.per_process_waits);
        for pid in self.engine.executor_pids() {
            if self.excluded.contains_key(&pid) {
                // Elected from records already in flight when it was left
                // out: its loop threads' events are closed again.
                self.engine.forget(pid, &mut self.probes);
            } else {
                self.observe(pid);
            }
        }
        let pids: Vec<u32> = self.procs.keys().copied().collect();
        self.engine.tick(&pids, &mut self.probes);
        if let Some(x) = self.export.as_mut() {
            x.flush();
            let (exported, failed) = x.counts();
            self.sh.metrics.set_otlp(exported, failed);
        }
    }

    fn housekeep(&mut self) {
        // Exits whose event we did not see, exec, pid reuse.
        let pids: Vec<u32> = self.procs.keys().copied().collect();
        for pid in pids {
            let t = &self.procs[&pid];
            match procs::start_ticks(pid) {
                Some(st) if st == t.info.start_ticks => {
                    if !t.info.exe.is_empty() && procs::exe_of(pid) != t.info.exe {
                        info!("pid {pid} exec'd {}", procs::exe_of(pid));
                        self.exited(pid);
                        self.look_again(pid, "exec'd");
                    }
                }
                _ => {
                    self.exited(pid);
                    self.look_again(pid, "gone, or its pid reused");
                }
            }
        }
        // Left-out processes, and included ones carrying their own wait
        // uprobes, that exec'd, moved or whose pid was reused.
        let looks = procs::next_checks(
            self.excluded
                .keys()
                .chain(self.included.keys())
                .copied()
                .collect(),
            self.judged_cursor,
            procs::JUDGED_CHECKS,
        );
        self.judged_cursor = looks.last().copied().unwrap_or(0);
        for pid in looks {
            if self.excluded.get(&pid).is_some_and(|j| j.changed(pid)) {
                self.take_back(pid);
            } else if self.included.get(&pid).is_some_and(|j| j.changed(pid)) {
                self.look_again(pid, "exec'd, moved or its pid reused");
            }
        }
        self.probe_deferred();
        let forget_after = self.cfg.forget_after;
        while self
            .gone
            .front()
            .is_some_and(|(at, _)| at.elapsed() >= forget_after)
        {
            let (_, t) = self.gone.pop_front().expect("checked");
            self.sh.metrics.remove_process(&t.labels);
        }
        // Gauges and counters.
        let mut threads = 0;
        let mut problems: HashMap<u32, usize> = HashMap::new();
        for p in self.engine.runtime_problems() {
            *problems.entry(p.pid).or_default() += 1;
        }
        for t in self.procs.values() {
            let n = self.engine.executors(t.info.pid).len();
            threads += n;
            self.sh.metrics.set_loop_threads(&t.labels, n);
            let problems = problems.get(&t.info.pid).copied().unwrap_or(0);
            self.sh.metrics.set_runtime_problems(&t.labels, problems);
        }
        let m = &self.sh.metrics;
        m.tracked_processes.set(self.procs.len() as i64);
        m.tracked_threads.set(threads as i64);
        m.excluded.set(self.excluded.len() as i64);
        m.watched_threads.set(self.probes.watched_threads() as i64);
        m.wait_probed
            .set(self.probes.wait_probed_processes() as i64);
        let mut agent = self.agent_base.clone();
        for (k, v) in self.engine.agent_drops() {
            *agent.entry(k.to_string()).or_default() += v;
        }
        m.set_drops(&self.probes.drops(), &agent);
        m.set_filtered(&self.probes.filtered());
        // The index page's rows.
        let mut rows: Vec<ProcRow> = self
            .procs
            .values()
            .map(|t| t.row(false, self.engine.executors(t.info.pid).len()))
            .collect();
        rows.extend(self.gone.iter().map(|(_, t)| t.row(true, 0)));
        rows.sort_by_key(|r| (r.exited, std::cmp::Reverse(r.stall_ns), r.info.pid));
        self.sh
            .index
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .procs = rows;
        // Memory bound of the stall-assembly state. A rebuild cuts nothing
        // (open busy periods and loop identities carry over).
        if self.engine.stack_table_len() > self.cfg.max_stacks
            || self.forgotten_since_reset > MAX_FORGOTTEN
        {
            self.rebuild_engine();
        }
    }

    fn rebuild_engine(&mut self) {
        info!(
            "rebuilding the engine ({} stacks, {} processes forgotten) to bound memory",
            self.engine.stack_table_len(),
            self.forgotten_since_reset
        );
        for (k, v) in self.engine.agent_drops() {
            *self.agent_base.entry(k.to_string()).or_default() += v;
        }
        let old = std::mem::replace(&mut self.engine, Engine::new(self.cfg.threshold_ns, None));
        self.engine = old.rebuild();
        self.forgotten_since_reset = 0;
        self.sh.metrics.session_resets.inc();
        // Hand the freed caches back to the kernel: glibc keeps freed heap
        // in its arenas, and RSS is what the bound is judged by.
        crate::os::heap::release();
    }

    /// Close the window: write its reports, apply retention.
    fn roll(&mut self) {
        let now = monotonic_ns();
        let next = Window::new(SystemTime::now(), now);
        let mut w = std::mem::replace(&mut self.window, next);
        w.note_problems(&self.engine.runtime_problems());
        self.next_roll_mono = now + until_boundary(self.cfg.window);
        // A closed window is never dropped on a failed write: it is kept
        // (its stalls are already in memory, within the window budget) and
        // retried, oldest first, at each roll.
        self.unwritten.push_back(w);
        let known: Vec<Arc<ProcInfo>> = self
            .procs
            .values()
            .map(|t| t.info.clone())
            .chain(self.gone.iter().map(|(_, t)| t.info.clone()))
            .collect();
        let mut failed = VecDeque::new();
        while let Some(mut w) = self.unwritten.pop_front() {
            let (written, r) = w.write(
                &self.data,
                now,
                &reports::Made {
                    threshold_ns: self.cfg.threshold_ns,
                    sample_hz: self.cfg.sample_hz,
                    probes: self.probes.probe_set(),
                    app_paths: &self.cfg.app_paths,
                    known: &known,
                },
            );
            self.note_written(written);
            if let Err(e) = r {
                self.sh.metrics.report_write_failures.inc();
                warn!(
                    "writing the window's reports to {}: {e:#}; {} process report(s) kept in memory, retried at the next window \
                     (free space in the data directory)",
                    self.cfg.data_dir.display(),
                    w.pending()
                );
                failed.push_back(w);
            }
        }
        while failed.len() > MAX_UNWRITTEN {
            let w = failed.pop_front().expect("non-empty");
            self.sh.metrics.reports_dropped.inc_by(w.pending() as u64);
            log::error!(
                "gave up on {} process report(s) of a window after {MAX_UNWRITTEN} failed retries: the data directory {} \
                 still cannot be written (their stalls remain in the metrics)",
                w.pending(),
                self.cfg.data_dir.display()
            );
        }
        self.unwritten = failed;
        let (bytes, removed) = reports::sweep(
            &self.cfg.data_dir,
            self.cfg.max_age,
            self.cfg.max_bytes,
            SystemTime::now(),
        );
        if !removed.is_empty() {
            info!("retention removed {} window(s)", removed.len());
        }
        self.sh.metrics.reports_bytes.set(bytes as i64);
    }

    fn note_written(&mut self, written: Vec<reports::Written>) {
        self.sh.metrics.reports_written.inc_by(written.len() as u64);
        self.total_reports += written.len() as u64;
        for wr in written {
            let rel = format!(
                "{}/{}/stalls.svg",
                wr.window,
                wr.dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            );
            if let Some(t) = self.procs.get_mut(&wr.info.pid) {
                t.last_report = Some(rel);
            } else if let Some((_, t)) = self
                .gone
                .iter_mut()
                .rev()
                .find(|(_, g)| g.info.pid == wr.info.pid)
            {
                t.last_report = Some(rel);
            }
        }
    }
}

/// Closed windows kept for a retry when the data directory cannot be
/// written; past it the oldest is given up (`stallprof_reports_dropped`).
/// Each holds at most the window budget (32 MiB).
const MAX_UNWRITTEN: usize = 3;

/// Time until the next wall-clock multiple of `window` (windows line up
/// with the clock: a 60 s window starts on the minute).
fn until_boundary(window: Duration) -> u64 {
    let w = window.as_nanos().max(1);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let rem = (w - now % w) as u64;
    // A window shorter than a fifth of its length is folded into the next.
    if rem < (w / 5) as u64 {
        rem + w as u64
    } else {
        rem
    }
}
