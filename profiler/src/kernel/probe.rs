//! Probes: load the eBPF object, set its globals, attach, and detach.
//!
//! The only module that owns `aya::Ebpf`. In: target tgid, sampling
//! frequency, `--probes`. Out: the ring buffer to read events from, loop-key
//! updates in, failure counters out. [`Probes::attach`] reads what the host
//! offers, lets `kernel::plan` decide everything (scheduler mode, globals,
//! programs), then loads and attaches what the plan lists, in its order.
//! Dropping [`Probes`] detaches every program and closes every map: nothing
//! stays loaded after a recording, whatever route it ended by.
//!
//! Before loading anything, every tracepoint record field the programs load
//! at a fixed offset (`profiler_common::tracepoint`) is checked against the
//! kernel's tracefs `format` file: a kernel whose layout differs is refused
//! by name rather than recorded wrong.
use std::{
    collections::{BTreeMap, HashSet},
    fs, io,
    num::NonZeroU32,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf},
    programs::{
        PerfEvent, RawTracePoint, TracePoint, UProbe,
        perf_event::{
            PerfEventConfig, PerfEventLinkId, PerfEventScope, SamplePolicy, SoftwareEvent,
        },
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeLinkId, UProbeScope},
    },
    util::{nr_cpus, online_cpus},
};
use log::{debug, info, warn};
use profiler_common::{
    Drop, Filtered, PyProc, sysno,
    tracepoint::{self, Layout},
};
use thiserror::Error;

// The CLI and the daemon's config name it here, beside `Probes::attach`.
pub use crate::kernel::plan::ProbeChoice;
use crate::{
    kernel::{
        btf,
        plan::{Attach, AttachPlan, GlobalValue, Host, Load, ProgramKind, Request},
        runtimes::ParkPoint,
        waits,
    },
    model::{ProbeSet, SchedulerProbes, WaitProbes},
};

/// The eBPF object built by build.rs from `profiler-ebpf`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler"));

const TRACEFS: &str = "/sys/kernel/tracing";

#[derive(Debug, Error)]
pub enum ProbeError {
    #[error(
        "permission denied loading eBPF programs: run stallprof as root (sudo), or grant it \
         CAP_BPF, CAP_PERFMON and CAP_SYS_RESOURCE (plus CAP_SYS_PTRACE to read the target's memory)"
    )]
    Permission,
    #[error("loading the eBPF programs failed: {0}")]
    Load(#[source] aya::EbpfError),
    #[error(
        "loading program {program} failed (the kernel verifier or a missing kernel feature): {source}"
    )]
    Program {
        program: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error(
        "attaching to {what} failed: {source}. stallprof needs tracepoints (tracefs at {TRACEFS}) \
         and software perf events; check that the kernel has CONFIG_FTRACE_SYSCALLS and CONFIG_PERF_EVENTS"
    )]
    Attach {
        what: String,
        source: aya::programs::ProgramError,
    },
    #[error(
        "tracefs is not mounted at {TRACEFS} and mounting it failed ({0}); mount it: mount -t tracefs tracefs {TRACEFS}"
    )]
    Tracefs(io::Error),
    #[error(
        "tracepoint {tracepoint} is not available: cannot read {}: {source}. stallprof needs it; \
         check that the kernel has CONFIG_FTRACE_SYSCALLS (for syscalls:*) and CONFIG_TRACEPOINTS",
        format.display()
    )]
    TracepointFormat {
        tracepoint: String,
        format: PathBuf,
        source: io::Error,
    },
    #[error(
        "tracepoint {tracepoint}: field `{field}` is at offset {found_offset} (size {found_size}) \
         in this kernel, but stallprof's eBPF programs read it at offset {expected_offset} \
         (size {expected_size}). This kernel's tracepoint layout differs from the one stallprof \
         was built for and would be recorded wrong; please report it with the contents of {}",
        format.display()
    )]
    TracepointLayout {
        tracepoint: String,
        field: &'static str,
        expected_offset: usize,
        expected_size: usize,
        found_offset: usize,
        found_size: usize,
        format: PathBuf,
    },
    #[error(
        "tracepoint {tracepoint} has no field `{field}` in this kernel (stallprof's eBPF \
         programs read it at offset {expected_offset}, size {expected_size}). This kernel's \
         tracepoint layout differs from the one stallprof was built for; please report it with \
         the contents of {}",
        format.display()
    )]
    TracepointFieldMissing {
        tracepoint: String,
        field: &'static str,
        expected_offset: usize,
        expected_size: usize,
        format: PathBuf,
    },
    #[error(
        "eBPF map {0} missing from the object: the agent and the eBPF programs are out of sync; rebuild"
    )]
    MissingMap(&'static str),
    #[error("eBPF map {name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("cannot list online CPUs: {0}")]
    Cpus(io::Error),
    #[error(
        "cannot list the target's threads to watch their context switches: {0}. \
         Retry, or use --probes raw-tracepoints"
    )]
    Threads(io::Error),
}

fn is_eperm(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>()
            && io.raw_os_error() == Some(libc::EPERM)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Mount tracefs if it is not there (a fresh container often lacks it).
fn ensure_tracefs() -> Result<(), ProbeError> {
    if Path::new(TRACEFS).join("events").exists() {
        return Ok(());
    }
    let rc = unsafe {
        libc::mount(
            c"tracefs".as_ptr(),
            c"/sys/kernel/tracing".as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EPERM) {
            return Err(ProbeError::Permission);
        }
        return Err(ProbeError::Tracefs(err));
    }
    info!("mounted tracefs at {TRACEFS}");
    Ok(())
}

/// A tracepoint a program attaches to, and the record fields it loads.
struct Tracepoint {
    program: &'static str,
    category: &'static str,
    name: String,
    fields: &'static [Layout],
}

impl Tracepoint {
    fn new(
        program: &'static str,
        category: &'static str,
        name: String,
        fields: &'static [Layout],
    ) -> Self {
        Tracepoint {
            program,
            category,
            name,
            fields,
        }
    }

    /// `category:name`, as `perf list` and error messages spell it.
    fn id(&self) -> String {
        format!("{}:{}", self.category, self.name)
    }

    fn format_path(&self, tracefs: &Path) -> PathBuf {
        tracefs
            .join("events")
            .join(self.category)
            .join(&self.name)
            .join("format")
    }
}

/// Every classic tracepoint the programs may attach to, in attach order.
/// Order matters a little: exits before enters, so that no thread is seen
/// entering a wait whose return we would miss.
fn tracepoints() -> Vec<Tracepoint> {
    let exits = sysno::WAITS.iter().map(|&(_, n)| {
        Tracepoint::new(
            "sp_wait_exit",
            "syscalls",
            format!("sys_exit_{n}"),
            tracepoint::SYS_EXIT,
        )
    });
    let enters = sysno::WAITS.iter().map(|&(nr, n)| {
        Tracepoint::new(
            "sp_wait_enter",
            "syscalls",
            format!("sys_enter_{n}"),
            tracepoint::sys_enter(nr),
        )
    });
    let sched = [
        ("sp_sched_wakeup", "sched_wakeup", tracepoint::SCHED_WAKEUP),
        ("sp_sched_switch", "sched_switch", tracepoint::SCHED_SWITCH),
        (
            "sp_exit",
            "sched_process_exit",
            tracepoint::SCHED_PROCESS_EXIT,
        ),
    ]
    .map(|(program, name, fields)| Tracepoint::new(program, "sched", name.into(), fields));
    exits.chain(enters).chain(sched).collect()
}

/// One `field:` line of a tracefs `format` file.
#[derive(Debug, PartialEq, Eq)]
struct FormatField {
    name: String,
    offset: usize,
    size: usize,
}

/// The fields of a tracefs `format` file, from its lines of the form
/// `field:<declaration>;\toffset:<n>;\tsize:<n>;\tsigned:<n>;`. The name is
/// the declaration's last word without an array suffix (`prev_comm[16]`).
fn parse_format(text: &str) -> Vec<FormatField> {
    let mut fields = Vec::new();
    for line in text.lines() {
        let (mut name, mut offset, mut size) = (None, None, None);
        for part in line.split(';').map(str::trim) {
            if let Some(decl) = part.strip_prefix("field:") {
                name = decl
                    .split_whitespace()
                    .last()
                    .map(|w| w.trim_start_matches('*'))
                    .map(|w| w.split('[').next().unwrap_or(w).to_string());
            } else if let Some(n) = part.strip_prefix("offset:") {
                offset = n.trim().parse().ok();
            } else if let Some(n) = part.strip_prefix("size:") {
                size = n.trim().parse().ok();
            }
        }
        if let (Some(name), Some(offset), Some(size)) = (name, offset, size) {
            fields.push(FormatField { name, offset, size });
        }
    }
    fields
}

/// Check that `format` (the text of `tp`'s format file at `path`) has every
/// field the program loads, at the offset and with the size it loads.
fn check_layout(tp: &Tracepoint, path: &Path, format: &str) -> Result<(), ProbeError> {
    let found = parse_format(format);
    for want in tp.fields {
        match found.iter().find(|f| f.name == want.name) {
            Some(f) if f.offset == want.offset && f.size == want.size => {}
            Some(f) => {
                return Err(ProbeError::TracepointLayout {
                    tracepoint: tp.id(),
                    field: want.name,
                    expected_offset: want.offset,
                    expected_size: want.size,
                    found_offset: f.offset,
                    found_size: f.size,
                    format: path.to_path_buf(),
                });
            }
            None => {
                return Err(ProbeError::TracepointFieldMissing {
                    tracepoint: tp.id(),
                    field: want.name,
                    expected_offset: want.offset,
                    expected_size: want.size,
                    format: path.to_path_buf(),
                });
            }
        }
    }
    Ok(())
}

/// Check every tracepoint's record layout against this kernel's tracefs.
fn check_layouts(tracepoints: &[Tracepoint]) -> Result<(), ProbeError> {
    for tp in tracepoints {
        let path = tp.format_path(Path::new(TRACEFS));
        let text = fs::read_to_string(&path).map_err(|source| ProbeError::TracepointFormat {
            tracepoint: tp.id(),
            format: path.clone(),
            source,
        })?;
        check_layout(tp, &path, &text)?;
    }
    debug!(
        "tracepoint layouts match ({} tracepoints)",
        tracepoints.len()
    );
    Ok(())
}

/// A program of the object, as its concrete type.
fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, ProbeError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(ProbeError::MissingMap(name))?
        .try_into()
        .map_err(|source| ProbeError::Program {
            program: name,
            source,
        })
}

/// Loading failed: lacking privilege, or the verifier said no.
fn load_error(program: &'static str, source: aya::programs::ProgramError) -> ProbeError {
    if is_eperm(&source) {
        ProbeError::Permission
    } else {
        ProbeError::Program { program, source }
    }
}

/// Take a map out of the object, as its concrete type.
fn take_map<T>(
    ebpf: &mut Ebpf,
    name: &'static str,
    convert: impl FnOnce(aya::maps::Map) -> Result<T, aya::maps::MapError>,
) -> Result<T, ProbeError> {
    let map = ebpf.take_map(name).ok_or(ProbeError::MissingMap(name))?;
    convert(map).map_err(|source| ProbeError::Map { name, source })
}

pub struct Probes {
    ebpf: Ebpf,
    loop_keys: BpfHashMap<MapData, u32, u64>,
    /// `LOOP_GEN`: bumped after every `loop_keys` change (BPF caches keys).
    loop_gen: Array<MapData, u64>,
    generation: u64,
    py_procs: BpfHashMap<MapData, u32, PyProc>,
    py_threads: BpfHashMap<MapData, u32, u64>,
    /// Daemon: `LEFT_OUT`, the processes the rules leave out.
    left_out: BpfHashMap<MapData, u32, u8>,
    /// `record` of a process tree: `WATCHED`, its processes besides the root.
    watched: BpfHashMap<MapData, u32, u8>,
    stats: PerCpuArray<MapData, u64>,
    filtered: PerCpuArray<MapData, u64>,
    /// Userspace's failed map updates (full maps), by counter name; shown
    /// with the kernel's counters in `drops`.
    update_failures: BTreeMap<String, u64>,
    /// The process watched (0: every process, the daemon).
    tgid: u32,
    /// `WAIT_TRACEPOINTS`: 1 once the syscall tracepoints serve the waits.
    wait_tracepoints: Array<MapData, u32>,
    /// `READER_ASLEEP`: set while the ring's reader sleeps (the next
    /// record wakes it).
    reader_asleep: Array<MapData, u32>,
    /// Which probes serve, and why any fallback.
    set: ProbeSet,
    /// Wait functions probed, as (pid, file, offset): per process in a
    /// recording, pid 0 (every process mapping the file) in the daemon.
    waits_done: HashSet<(u32, (u64, u64), u64)>,
    /// Daemon with per-thread switch events: each elected loop thread's
    /// switch and sampling events (opened at its election, closed at its
    /// exit).
    thread_links: std::collections::HashMap<u32, ThreadLinks>,
    /// `--frequency`: the sampling events' rate.
    sample_hz: u64,
    /// Daemon without include rules: the files (device, inode) read for
    /// wait functions (their uprobes serve every process mapping them).
    host_files: HashSet<(u64, u64)>,
    /// Daemon with include rules: each included process's own wait
    /// uprobes (two links per probed function), detached when it is left
    /// out or gone.
    process_waits: std::collections::HashMap<u32, Vec<(&'static str, UProbeLinkId)>>,
    /// Detaches taken links off the caller's thread ([`LinkReaper`]).
    reaper: LinkReaper,
}

/// Detaching a uprobe link waits for the kernel's grace periods, one link
/// at a time host-wide (the trace events' mutex is held through them):
/// ~90 ms a link on the test VM, 1.3 s for one process's 14 wait links,
/// also when several threads detach at once. So links are handed to a
/// thread that drops them, off the thread that drains the ring buffer;
/// dropping the reaper waits for what it was handed.
#[derive(Default)]
struct LinkReaper {
    queue: Option<std::sync::mpsc::Sender<Vec<UProbeLink>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Batches handed over and not yet detached.
    pending: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl LinkReaper {
    fn reap(&mut self, links: Vec<UProbeLink>) {
        use std::sync::atomic::Ordering::Relaxed;
        if links.is_empty() {
            return;
        }
        if self.queue.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<Vec<UProbeLink>>();
            let pending = self.pending.clone();
            match std::thread::Builder::new()
                .name("stallprof-detach".into())
                .spawn(move || {
                    for batch in rx {
                        detach_all(batch);
                        pending.fetch_sub(1, Relaxed);
                    }
                }) {
                Ok(t) => {
                    self.queue = Some(tx);
                    self.thread = Some(t);
                }
                Err(e) => {
                    debug!("no detach thread ({e}): detaching here");
                    detach_all(links);
                    return;
                }
            }
        }
        self.pending.fetch_add(1, Relaxed);
        if let Some(Err(e)) = self.queue.as_ref().map(|q| q.send(links)) {
            self.pending.fetch_sub(1, Relaxed);
            detach_all(e.0);
        }
    }

    fn pending(&self) -> usize {
        self.pending.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl std::ops::Drop for LinkReaper {
    fn drop(&mut self) {
        self.queue = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn detach_all(links: Vec<UProbeLink>) {
    let (n, t0) = (links.len(), std::time::Instant::now());
    drop(links);
    debug!("{n} uprobe links detached in {:?}", t0.elapsed());
}

/// What the host offers the plan: the kernel's BTF layouts (one read of
/// its BTF) and its CPU counts.
fn read_host() -> Result<Host, ProbeError> {
    let layouts = btf::KernelLayouts::running_kernel();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let possible_cpus = nr_cpus().map_err(|(_, e)| ProbeError::Cpus(e))? as u32;
    Ok(Host {
        layouts,
        cpus,
        possible_cpus,
    })
}

/// The default sampling gate for a stall threshold (see `SAMPLE_AFTER_NS` in
/// `profiler-ebpf`): a twentieth of the threshold, at most 2 ms. Samples are
/// skipped only in the first `gate` of a busy period, so at most
/// `gate / threshold` (5%) of a stall's on-CPU time is spread over the
/// stacks sampled after it instead of its own; busy periods shorter than the
/// gate, which under load are nearly all of them, cost no stack copy.
pub fn default_sample_after(threshold_ns: u64) -> u64 {
    (threshold_ns / 20).min(2_000_000)
}

/// One watched thread's per-thread events (the daemon's elected loops).
struct ThreadLinks {
    switches: PerfEventLinkId,
    samples: PerfEventLinkId,
}

impl Probes {
    /// Load the programs for `tgid` (0 = every process) and attach the
    /// scheduler and sampling ones; the waits are attached per process as
    /// they are found ([`Probes::watch_waits`], [`Probes::watch_included_waits`], [`Probes::watch_file_waits`])
    /// unless `choice` asks for the syscall tracepoints.
    /// `sample_after_ns`: the sampling gate (0 = every sample, every busy period).
    pub fn attach(
        tgid: u32,
        sample_hz: u64,
        sample_after_ns: u64,
        choice: ProbeChoice,
        subprocesses: bool,
    ) -> Result<Probes, ProbeError> {
        if unsafe { libc::geteuid() } != 0 {
            // Capabilities may still be enough; only fail early on a clear no.
            debug!("not root; relying on capabilities");
        }
        ensure_tracefs()?;
        check_layouts(&tracepoints())?;
        let request = Request {
            tgid,
            sample_hz,
            sample_after_ns,
            choice,
            subprocesses,
        };
        let plan = AttachPlan::new(request, &read_host()?);
        debug!("ring buffer: {} MiB", plan.maps.events >> 20);
        let mut probes = Probes::load(&plan)?;
        for step in &plan.attach {
            probes.attach_step(step)?;
        }
        info!(
            "probes attached (tgid {tgid}, {sample_hz} Hz; scheduler: {}, waits: {})",
            probes.set.scheduler.as_str(),
            probes.set.waits.as_str()
        );
        Ok(probes)
    }

    /// The object loaded with the plan's globals and map sizes, its maps
    /// taken and the plan's programs loaded; nothing attached yet.
    fn load(plan: &AttachPlan) -> Result<Probes, ProbeError> {
        let globals = plan.globals.each();
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries("EVENTS", plan.maps.events)
            .map_max_entries("STACK_SCRATCH", plan.maps.stack_scratch);
        for (name, value) in &globals {
            match value {
                GlobalValue::U32(v) => loader.override_global(name, v, true),
                GlobalValue::U64(v) => loader.override_global(name, v, true),
            };
        }
        let mut ebpf = loader.load(EBPF_OBJECT).map_err(|e| {
            if is_eperm(&e) {
                ProbeError::Permission
            } else {
                ProbeError::Load(e)
            }
        })?;
        let loop_keys = take_map(&mut ebpf, "LOOP_KEYS", BpfHashMap::try_from)?;
        let loop_gen = take_map(&mut ebpf, "LOOP_GEN", Array::try_from)?;
        let py_procs = take_map(&mut ebpf, "PY_PROCS", BpfHashMap::try_from)?;
        let py_threads = take_map(&mut ebpf, "PY_THREADS", BpfHashMap::try_from)?;
        let left_out = take_map(&mut ebpf, "LEFT_OUT", BpfHashMap::try_from)?;
        let watched = take_map(&mut ebpf, "WATCHED", BpfHashMap::try_from)?;
        let stats = take_map(&mut ebpf, "STATS", PerCpuArray::try_from)?;
        let filtered = take_map(&mut ebpf, "FILTERED", PerCpuArray::try_from)?;
        let mut wait_tracepoints = take_map(&mut ebpf, "WAIT_TRACEPOINTS", Array::try_from)?;
        let reader_asleep = take_map(&mut ebpf, "READER_ASLEEP", Array::try_from)?;
        if plan.wait_tracepoints {
            wait_tracepoints
                .set(0, 1, 0)
                .map_err(|source| ProbeError::Map {
                    name: "WAIT_TRACEPOINTS",
                    source,
                })?;
        }
        for &Load {
            program: name,
            kind,
        } in &plan.load
        {
            match kind {
                ProgramKind::UProbe => program::<UProbe>(&mut ebpf, name)?.load(),
                ProgramKind::PerfEvent => program::<PerfEvent>(&mut ebpf, name)?.load(),
                ProgramKind::RawTracePoint => program::<RawTracePoint>(&mut ebpf, name)?.load(),
            }
            .map_err(|source| load_error(name, source))?;
        }
        Ok(Probes {
            ebpf,
            loop_keys,
            loop_gen,
            generation: 0,
            py_procs,
            py_threads,
            left_out,
            watched,
            stats,
            filtered,
            update_failures: BTreeMap::new(),
            tgid: plan.request.tgid,
            wait_tracepoints,
            reader_asleep,
            set: plan.probes.clone(),
            waits_done: HashSet::new(),
            thread_links: Default::default(),
            sample_hz: plan.request.sample_hz,
            host_files: HashSet::new(),
            process_waits: Default::default(),
            reaper: LinkReaper::default(),
        })
    }

    /// Attach one step of the plan (its programs are loaded).
    fn attach_step(&mut self, step: &Attach) -> Result<(), ProbeError> {
        match *step {
            Attach::WaitTracepoints => self.attach_tracepoints_of("syscalls"),
            Attach::ThreadEvents { tgid } => self.attach_thread_events(tgid),
            Attach::SchedTracepoints => self.attach_tracepoints_of("sched"),
            Attach::RawTracepoint {
                program: prog,
                tracepoint,
            } => {
                let p: &mut RawTracePoint = program(&mut self.ebpf, prog)?;
                p.attach(tracepoint).map_err(|source| ProbeError::Attach {
                    what: format!("raw tracepoint {tracepoint}"),
                    source,
                })?;
                Ok(())
            }
            Attach::SampleEveryCpu { hz } => {
                let sample: &mut PerfEvent = program(&mut self.ebpf, "sp_sample")?;
                let cpus = online_cpus().map_err(|(_, e)| ProbeError::Cpus(e))?;
                for cpu in cpus {
                    sample
                        .attach(
                            PerfEventConfig::Software(SoftwareEvent::CpuClock),
                            PerfEventScope::AllProcessesOneCpu { cpu },
                            SamplePolicy::Frequency(hz),
                            false,
                        )
                        .map_err(|source| ProbeError::Attach {
                            what: format!("cpu-clock perf event on CPU {cpu}"),
                            source,
                        })?;
                }
                Ok(())
            }
        }
    }

    /// The per-thread events ([`Probes::open_thread_events`]) on every
    /// thread of `tgid`, inherited by the threads (and children) they
    /// start; the threads are listed again until a listing finds none new
    /// (a thread started meanwhile by one not yet covered). A thread gone
    /// before its events opened is skipped.
    fn attach_thread_events(&mut self, tgid: u32) -> Result<(), ProbeError> {
        const ROUNDS: usize = 50;
        let mut covered = HashSet::new();
        for _ in 0..ROUNDS {
            let tids = crate::os::proc::threads(tgid).map_err(ProbeError::Threads)?;
            let new: Vec<u32> = tids.into_iter().filter(|t| !covered.contains(t)).collect();
            if new.is_empty() {
                return Ok(());
            }
            for tid in new {
                if let Err((what, source)) = self.open_thread_events(tid, true)
                    && Path::new(&format!("/proc/{tgid}/task/{tid}")).exists()
                {
                    return Err(ProbeError::Attach {
                        what: format!("{what} perf event on thread {tid} of {tgid}"),
                        source,
                    });
                }
                covered.insert(tid);
            }
        }
        Err(ProbeError::Threads(io::Error::other(format!(
            "process {tgid} started new threads through {ROUNDS} listings of /proc/{tgid}/task"
        ))))
    }

    /// Thread `tid`'s events: `context-switches` into `sp_thread_switch`,
    /// sampling every switch, and `cpu-clock` into `sp_sample` at
    /// `--frequency` (a per-thread clock runs only while the thread does);
    /// `inherit`: the threads and processes it starts get them too. Both
    /// or neither: the first is closed again when the second fails.
    fn open_thread_events(
        &mut self,
        tid: u32,
        inherit: bool,
    ) -> Result<ThreadLinks, (&'static str, aya::programs::ProgramError)> {
        let scope = || PerfEventScope::OneProcess {
            pid: tid,
            cpu: None,
        };
        let switches = program::<PerfEvent>(&mut self.ebpf, "sp_thread_switch")
            .map_err(|_| ("context-switches", aya::programs::ProgramError::NotLoaded))?
            .attach(
                PerfEventConfig::Software(SoftwareEvent::ContextSwitches),
                scope(),
                SamplePolicy::Period(1),
                inherit,
            )
            .map_err(|e| ("context-switches", e))?;
        let hz = self.sample_hz;
        let samples = program::<PerfEvent>(&mut self.ebpf, "sp_sample")
            .map_err(|_| aya::programs::ProgramError::NotLoaded)
            .and_then(|p| {
                p.attach(
                    PerfEventConfig::Software(SoftwareEvent::CpuClock),
                    scope(),
                    SamplePolicy::Frequency(hz),
                    inherit,
                )
            });
        match samples {
            Ok(samples) => Ok(ThreadLinks { switches, samples }),
            Err(e) => {
                self.close_perf_event("sp_thread_switch", switches);
                Err(("cpu-clock", e))
            }
        }
    }

    /// Close one per-thread event of perf program `prog` (loaded).
    fn close_perf_event(&mut self, prog: &'static str, link: PerfEventLinkId) {
        if let Ok(p) = program::<PerfEvent>(&mut self.ebpf, prog) {
            let _ = p.detach(link);
        }
    }

    /// Load (once) and attach the classic tracepoints of `category`
    /// (`syscalls`: the waits; `sched`).
    fn attach_tracepoints_of(&mut self, category: &str) -> Result<(), ProbeError> {
        for tp in tracepoints().iter().filter(|t| t.category == category) {
            let p: &mut TracePoint = program(&mut self.ebpf, tp.program)?;
            if p.fd().is_err() {
                p.load().map_err(|source| load_error(tp.program, source))?;
            }
            p.attach(tp.category, &tp.name)
                .map_err(|source| ProbeError::Attach {
                    what: format!("tracepoint {}", tp.id()),
                    source,
                })?;
        }
        Ok(())
    }

    /// The wait syscalls' tracepoints, host-wide: the fallback for waits no
    /// uprobe sees. Once.
    fn attach_wait_tracepoints(&mut self) -> Result<(), ProbeError> {
        if self.set.waits.on_tracepoints() {
            return Ok(());
        }
        self.attach_tracepoints_of("syscalls")?;
        // Uprobes already serving some process stand down now (see
        // `WAIT_TRACEPOINTS`), but they did serve until here.
        self.set.waits = if self.waits_done.is_empty() {
            WaitProbes::Tracepoints
        } else {
            WaitProbes::UprobesThenTracepoints
        };
        Ok(())
    }

    /// Which probes serve, and why any fallback.
    pub fn probe_set(&self) -> &ProbeSet {
        &self.set
    }

    /// Put uprobes on the wait functions process `pid` maps (per process:
    /// no other process hits them), once per (process, file). True when
    /// done; false when it maps no wait function yet (a command that has
    /// just exec'd maps its C library a moment later). With `last_try`, a
    /// process whose waits no uprobe can see (a static binary without
    /// symbols, raw syscalls) gets the syscall tracepoints, host-wide, and
    /// the reason is noted.
    pub fn watch_waits(&mut self, pid: u32, last_try: bool) -> bool {
        // The daemon chooses per process ([`Probes::watch_included_waits`])
        // or per file ([`Probes::watch_file_waits`]).
        if self.set.waits.on_tracepoints() || self.tgid == 0 {
            return true;
        }
        let waits::WaitPoints {
            points,
            more_may_come,
            unreadable,
        } = waits::wait_points(pid);
        if points.is_empty() {
            if last_try || !more_may_come {
                let why = if !unreadable.is_empty() {
                    format!(
                        "pid {pid}'s C library could not be read for its wait functions: {}",
                        unreadable.join("; ")
                    )
                } else if crate::os::maps::map_files_hidden(pid) {
                    format!(
                        "pid {pid}'s mappings cannot be read (another user's process: \
                         stallprof lacks CAP_SYS_PTRACE, or CAP_SYS_ADMIN for map_files)"
                    )
                } else {
                    format!(
                        "pid {pid} maps no C library wait function (a static binary without \
                         symbols, or raw syscalls)"
                    )
                };
                self.wait_fallback(why);
            }
            return last_try || !more_may_come;
        }
        match self.attach_process_waits(pid, &points) {
            Ok(()) => true,
            // A command that has just exec'd is still mapping its
            // libraries (a mapping read a moment ago may be gone): again
            // at the next upkeep, unless this was the last try.
            Err(why) if last_try => {
                self.wait_fallback(format!("pid {pid}: {why}"));
                true
            }
            Err(why) => {
                debug!("pid {pid}: {why}; trying again");
                false
            }
        }
    }

    /// `points` of process `pid` not probed yet, probed for it alone; the
    /// links kept under its pid. Stops at the first that fails.
    fn attach_process_waits(
        &mut self,
        pid: u32,
        points: &[waits::WaitPoint],
    ) -> Result<(), String> {
        let scope = NonZeroU32::new(pid).map_or(UProbeScope::AllProcesses, UProbeScope::OneProcess);
        for p in points {
            if self.waits_done.contains(&(pid, p.file, p.offset)) {
                continue;
            }
            let links = self.attach_wait_point(p, scope)?;
            self.waits_done.insert((pid, p.file, p.offset));
            self.process_waits.entry(pid).or_default().extend(links);
        }
        Ok(())
    }

    /// The daemon with include rules: uprobes on the wait functions of
    /// included process `pid`, for it alone (a process the rules leave out
    /// pays nothing). True when it maps a C library (probed, or refused and
    /// logged); false when it maps none yet (its loader may not have mapped
    /// it) or the attach failed (tried again at the next look). A static
    /// binary's own waits are not seen (as without include rules).
    pub fn watch_included_waits(&mut self, pid: u32) -> bool {
        if self.set.waits.on_tracepoints() {
            return true;
        }
        let found = waits::wait_points(pid);
        if found.points.is_empty() {
            if !found.unreadable.is_empty() {
                warn!(
                    "pid {pid} maps a C library stallprof cannot read for its wait functions: {}; \
                     its event loops are not watched (run with --probes tracepoints to watch \
                     them through the syscall tracepoints)",
                    found.unreadable.join("; ")
                );
                return true;
            }
            return false;
        }
        let had = self.process_waits.contains_key(&pid);
        match self.attach_process_waits(pid, &found.points) {
            Ok(()) => {
                if !had {
                    info!("pid {pid}: wait uprobes of its own");
                }
                true
            }
            Err(why) => {
                warn!(
                    "pid {pid}: its wait functions could not be probed: {why}; its event loops \
                     are not watched until it is looked at again"
                );
                false
            }
        }
    }

    /// The daemon: process `pid` is left out or gone: its own wait
    /// uprobes go. False if it had none.
    pub fn unwatch_waits(&mut self, pid: u32, why: &str) -> bool {
        let Some(links) = self.process_waits.remove(&pid) else {
            return false;
        };
        info!("pid {pid}: its wait uprobes detached ({why})");
        self.waits_done.retain(|(p, _, _)| *p != pid);
        let mut taken = Vec::with_capacity(links.len());
        for (prog, link) in links {
            match program::<UProbe>(&mut self.ebpf, prog).and_then(|u| {
                u.take_link(link).map_err(|source| ProbeError::Attach {
                    what: format!("detaching {prog} from pid {pid}"),
                    source,
                })
            }) {
                Ok(link) => taken.push(link),
                Err(e) => debug!("{e}"),
            }
        }
        self.reaper.reap(taken);
        true
    }

    /// Processes carrying their own wait uprobes (the daemon with include
    /// rules; `record`'s target).
    pub fn wait_probed_processes(&self) -> usize {
        self.process_waits.len()
    }

    /// Processes whose own wait uprobes are still being detached (each is
    /// a consumer the kernel walks at every hit until then).
    pub fn wait_probes_detaching(&self) -> usize {
        self.reaper.pending()
    }

    /// Does `pid` carry its own wait uprobes?
    pub fn has_own_waits(&self, pid: u32) -> bool {
        self.process_waits.contains_key(&pid)
    }

    /// Their pids.
    pub fn wait_probed_pids(&self) -> Vec<u32> {
        self.process_waits.keys().copied().collect()
    }

    /// The daemon without include rules: uprobes on the wait functions of
    /// every C library file process `pid` maps that no earlier process
    /// mapped, for every process mapping that file (so one read of the
    /// host's C library covers every process started later; a container
    /// brings its own). True when it maps a C library.
    pub fn watch_file_waits(&mut self, pid: u32) -> bool {
        if self.set.waits.on_tracepoints() {
            return true;
        }
        let mut c_library = false;
        for (path, file, seen_as) in waits::mapped_files(pid) {
            // Each C library is read once, whoever maps it. (A static
            // binary's own waits are served by the fallback only when
            // recorded by pid.)
            if !waits::is_c_library(&seen_as) {
                continue;
            }
            c_library = true;
            if !self.host_files.insert(file) {
                continue;
            }
            let points = match waits::points_in(&path, file) {
                Ok(points) => points,
                // Gone while it was read: the next process mapping
                // the library reads it again.
                Err(why) if !crate::os::proc::process_alive(pid) => {
                    debug!("pid {pid} exited while its C library was read: {why}");
                    self.host_files.remove(&file);
                    continue;
                }
                Err(why) => {
                    warn!(
                        "pid {pid} maps a C library stallprof cannot read for its wait functions: {why}; \
                         event loops on it are not watched (run with --probes tracepoints to watch them \
                         through the syscall tracepoints)"
                    );
                    continue;
                }
            };
            info!(
                "pid {pid} maps a C library not seen before, {seen_as}: its {} wait functions probed for every process mapping it",
                points.len()
            );
            for p in points {
                match self.attach_wait_point(&p, UProbeScope::AllProcesses) {
                    Ok(_) => {
                        self.waits_done.insert((0, p.file, p.offset));
                    }
                    // Looked at again with the next process mapping it.
                    Err(why) => {
                        debug!("pid {pid}: {why}");
                        self.host_files.remove(&file);
                    }
                }
            }
        }
        c_library
    }

    /// One wait function's uretprobe, then its uprobe (cookie: the
    /// syscall): their links, or why not (neither attached).
    fn attach_wait_point(
        &mut self,
        p: &waits::WaitPoint,
        scope: UProbeScope,
    ) -> Result<[(&'static str, UProbeLinkId); 2], String> {
        if !p.emulated {
            let note = format!(
                "{} in {} is probed at its entry (single-stepped: ~10x the cost of an emulated \
                 probe on each call)",
                p.function, p.path
            );
            if !self.set.notes.contains(&note) {
                self.set.notes.push(note);
            }
        }
        let point = || UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(p.offset),
            cookie: Some(p.nr as u64),
        };
        let attach = |ebpf: &mut Ebpf, prog: &'static str| {
            program::<UProbe>(ebpf, prog)
                .and_then(|u| {
                    u.attach(point(), &p.path, scope)
                        .map_err(|source| ProbeError::Attach {
                            what: format!("uprobe on {} in {}", p.function, p.path),
                            source,
                        })
                })
                .map_err(|e| {
                    let mut why = e.to_string();
                    let mut src = std::error::Error::source(&e);
                    while let Some(s) = src {
                        why.push_str(&format!(": {s}"));
                        src = s.source();
                    }
                    why
                })
        };
        let exit = attach(&mut self.ebpf, "sp_uwait_exit")?;
        let enter = match attach(&mut self.ebpf, "sp_uwait_enter") {
            Ok(link) => link,
            Err(why) => {
                if let Ok(u) = program::<UProbe>(&mut self.ebpf, "sp_uwait_exit") {
                    let _ = u.detach(exit);
                }
                return Err(why);
            }
        };
        debug!(
            "wait probes on {} (+{:#x}) in {}",
            p.function, p.delta, p.path
        );
        Ok([("sp_uwait_exit", exit), ("sp_uwait_enter", enter)])
    }

    /// Waits some process makes cannot be seen by uprobes: the syscall
    /// tracepoints serve from now on, and the reason is noted.
    fn wait_fallback(&mut self, why: String) {
        if self.set.waits.on_tracepoints() {
            return;
        }
        log::warn!(
            "{why}; falling back to the wait syscalls' tracepoints (every process on the host \
             pays for its syscalls while attached)"
        );
        self.set
            .notes
            .push(format!("waits: syscall tracepoints, because {why}"));
        // The tracepoints see every wait: the uprobes stand down, so no
        // wait is reported twice.
        if let Err(e) = self.wait_tracepoints.set(0, 1, 0) {
            log::warn!("WAIT_TRACEPOINTS update: {e}");
        }
        if let Err(e) = self.attach_wait_tracepoints() {
            log::warn!("wait tracepoints unavailable too: {e}");
            self.set.notes.push(format!("wait tracepoints failed: {e}"));
        }
    }

    /// Count a failed map update (`what`: the counter's name); warn once.
    fn update_failed(&mut self, what: &str, e: &dyn std::fmt::Display) {
        let n = self.update_failures.entry(what.to_string()).or_default();
        *n += 1;
        if *n == 1 {
            log::warn!("{what}: {e} (counted in drops; further failures are not logged)");
        }
    }

    /// The event ring buffer (can be taken once).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        take_map(&mut self.ebpf, "EVENTS", RingBuf::try_from)
    }

    /// The ring's reader goes to sleep: the kernel side wakes it with its
    /// next record. False if the flag could not be set (counted in `drops`
    /// as `reader_flag_failed`): the reader keeps its drain timer.
    pub fn set_reader_asleep(&mut self) -> bool {
        match self.reader_asleep.set(0, 1, 0) {
            Ok(()) => true,
            Err(e) => {
                self.update_failed("reader_flag_failed", &e);
                false
            }
        }
    }

    /// Tell the kernel side which wait is `tid`'s event-loop park.
    pub fn set_loop_key(&mut self, tid: u32, key: u64) {
        if let Err(e) = self.loop_keys.insert(tid, key, 0) {
            self.update_failed("loop_keys_full", &e);
            return;
        }
        // After the insert: a thread that sees the new generation re-reads
        // LOOP_KEYS and finds the new key.
        self.generation += 1;
        if let Err(e) = self.loop_gen.set(0, self.generation, 0) {
            log::warn!("LOOP_GEN update: {e}; loop keys may be seen late");
        }
        // The daemon watches an elected loop thread's switches and samples
        // it from now (a recording's threads are watched from attach).
        if self.tgid == 0
            && self.set.scheduler == SchedulerProbes::ThreadEvents
            && !self.thread_links.contains_key(&tid)
        {
            match self.open_thread_events(tid, false) {
                Ok(links) => {
                    self.thread_links.insert(tid, links);
                }
                // Gone already: its exit will be seen.
                Err(_) if !Path::new(&format!("/proc/{tid}")).exists() => {}
                Err((_, e)) => self.update_failed("loop_switch_events_failed", &e),
            }
        }
    }

    /// Put the park uprobes (entry and return) on a runtime's park function,
    /// for process `pid` (None: every process running that binary).
    pub fn attach_park(&mut self, point: &ParkPoint, pid: Option<u32>) -> Result<(), ProbeError> {
        let scope = match pid.and_then(NonZeroU32::new) {
            Some(p) => UProbeScope::OneProcess(p),
            None => UProbeScope::AllProcesses,
        };
        for prog in ["sp_park_enter", "sp_park_exit"] {
            let p: &mut UProbe = program(&mut self.ebpf, prog)?;
            p.attach(point.symbol.as_str(), &point.binary, scope)
                .map_err(|source| ProbeError::Attach {
                    what: format!(
                        "uprobe on {} in {}",
                        point.demangled,
                        point.binary.display()
                    ),
                    source,
                })?;
        }
        info!(
            "park probes on {} ({})",
            point.demangled,
            point.binary.display()
        );
        Ok(())
    }

    /// Let BPF walk the Python stacks of process `tgid`.
    pub fn set_python_proc(&mut self, tgid: u32, p: PyProc) {
        if let Err(e) = self.py_procs.insert(tgid, p, 0) {
            self.update_failed("py_procs_full", &e);
        }
    }

    /// A process exited or exec'd: BPF stops walking its Python stacks, and
    /// its threads' `PY_THREADS` entries go (the maps would fill with the
    /// dead after ~1k Python processes under the daemon).
    pub fn forget_python_proc(&mut self, tgid: u32, tids: &[u32]) {
        let _ = self.py_procs.remove(&tgid);
        for tid in tids {
            let _ = self.py_threads.remove(tid);
        }
    }

    /// Daemon: the rules leave process `tgid` out. The kernel side skips
    /// its waits and runtime parks from now and forgets a thread of it it
    /// tracked, so no record, loop election, switch or sampling event of
    /// it follows; the caller closes the per-thread events of any loop
    /// thread of it already elected ([`Probes::forget_loop_thread`]).
    /// What it still pays is the trap of each wait uprobe (they sit on the
    /// C library host-wide).
    pub fn leave_out(&mut self, tgid: u32) {
        if let Err(e) = self.left_out.insert(tgid, 1, 0) {
            self.update_failed("left_out_full", &e);
        }
    }

    /// `record` of a process tree: watch process `tgid` (under the target
    /// at attach; one started later is in `WATCHED` already, put there by
    /// `sp_raw_fork`, and inherited its per-thread events): its threads get
    /// the per-thread events when they serve the scheduler. Its waits and
    /// runtimes are found by the engine's upkeep, as the root's are.
    pub fn watch_process(&mut self, tgid: u32) -> Result<(), ProbeError> {
        if let Err(e) = self.watched.insert(tgid, 1, 0) {
            self.update_failed("watched_processes_full", &e);
            return Err(ProbeError::Map {
                name: "WATCHED",
                source: e,
            });
        }
        if self.set.scheduler == SchedulerProbes::ThreadEvents {
            self.attach_thread_events(tgid)?;
        }
        Ok(())
    }

    /// `record` of a process tree: process `tgid` exited (the kernel side
    /// has let it go already): its own wait uprobes go.
    pub fn unwatch_process(&mut self, tgid: u32) {
        let _ = self.watched.remove(&tgid);
        self.unwatch_waits(tgid, "exited");
    }

    /// Daemon: a left-out process is gone (or must be judged again): a
    /// reused pid starts followed.
    pub fn take_back(&mut self, tgid: u32) {
        let _ = self.left_out.remove(&tgid);
    }

    /// Threads carrying their own switch and sampling events (the
    /// daemon's elected loop threads; 0 with the tracepoints).
    pub fn watched_threads(&self) -> usize {
        self.thread_links.len()
    }

    /// A loop thread exited (or its process did): its `LOOP_KEYS` entry
    /// goes, so a reused tid starts undecided and the map does not fill.
    pub fn forget_loop_thread(&mut self, tid: u32) {
        if let Some(links) = self.thread_links.remove(&tid) {
            self.close_perf_event("sp_thread_switch", links.switches);
            self.close_perf_event("sp_sample", links.samples);
        }
        if self.loop_keys.remove(&tid).is_ok() {
            self.generation += 1;
            if let Err(e) = self.loop_gen.set(0, self.generation, 0) {
                log::warn!("LOOP_GEN update: {e}; loop keys may be seen late");
            }
        }
    }

    /// Make `threads` (tid -> `PyThreadState*`) the Python threads BPF
    /// knows for one process, removing `gone` ones.
    pub fn set_python_threads(&mut self, threads: &[(u32, u64)], gone: &[u32]) {
        for &(tid, ts) in threads {
            if let Err(e) = self.py_threads.insert(tid, ts, 0) {
                self.update_failed("py_threads_full", &e);
            }
        }
        for tid in gone {
            let _ = self.py_threads.remove(tid);
        }
    }

    /// Non-zero failure counters, summed over CPUs, by name.
    pub fn drops(&self) -> BTreeMap<String, u64> {
        let mut d = sum_counters(&self.stats, Drop::ALL.map(|d| (d as u32, d.name())));
        d.extend(self.update_failures.clone());
        d
    }

    /// Work the sampling gate saved (not failures), summed over CPUs, by name.
    pub fn filtered(&self) -> BTreeMap<String, u64> {
        sum_counters(&self.filtered, Filtered::ALL.map(|f| (f as u32, f.name())))
    }
}

fn sum_counters<const N: usize>(
    map: &PerCpuArray<MapData, u64>,
    names: [(u32, &'static str); N],
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (i, name) in names {
        if let Ok(v) = map.get(&i, 0) {
            let n: u64 = v.iter().sum();
            if n > 0 {
                out.insert(name.to_string(), n);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `events/sched/sched_switch/format` of x86-64 Linux 6.18.
    const SCHED_SWITCH_FORMAT: &str = "\
name: sched_switch
ID: 372
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char prev_comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:pid_t prev_pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:int prev_prio;\toffset:28;\tsize:4;\tsigned:1;
\tfield:long prev_state;\toffset:32;\tsize:8;\tsigned:1;
\tfield:char next_comm[16];\toffset:40;\tsize:16;\tsigned:0;
\tfield:pid_t next_pid;\toffset:56;\tsize:4;\tsigned:1;
\tfield:int next_prio;\toffset:60;\tsize:4;\tsigned:1;

print fmt: \"prev_comm=%s prev_pid=%d prev_prio=%d prev_state=%s%s ==> next_comm=%s next_pid=%d next_prio=%d\", REC->prev_comm, REC->prev_pid
";

    /// `events/syscalls/sys_enter_poll/format` of x86-64 Linux 6.18.
    const SYS_ENTER_POLL_FORMAT: &str = "\
name: sys_enter_poll
ID: 906
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;
\tfield:struct pollfd * ufds;\toffset:16;\tsize:8;\tsigned:0;
\tfield:unsigned int nfds;\toffset:24;\tsize:8;\tsigned:0;
\tfield:int timeout_msecs;\toffset:32;\tsize:8;\tsigned:0;

print fmt: \"ufds: 0x%08lx, nfds: 0x%08lx, timeout_msecs: 0x%08lx\", ((unsigned long)(REC->ufds))
";

    fn find<'a>(tps: &'a [Tracepoint], name: &str) -> &'a Tracepoint {
        tps.iter().find(|t| t.name == name).unwrap()
    }

    #[test]
    fn parse_format_reads_every_field() {
        let fields = parse_format(SCHED_SWITCH_FORMAT);
        assert_eq!(fields.len(), 11);
        let field = |name: &str| fields.iter().find(|f| f.name == name).unwrap();
        assert_eq!(
            field("prev_comm"),
            &FormatField {
                name: "prev_comm".into(),
                offset: 8,
                size: 16
            }
        );
        assert_eq!(
            (field("prev_state").offset, field("prev_state").size),
            (32, 8)
        );
        assert_eq!((field("next_pid").offset, field("next_pid").size), (56, 4));
        // A pointer's `*` is not part of its name.
        let poll = parse_format(SYS_ENTER_POLL_FORMAT);
        assert!(poll.iter().any(|f| f.name == "ufds" && f.offset == 16));
    }

    #[test]
    fn the_layouts_bpf_loads_match_this_sample() {
        let tps = tracepoints();
        let path = Path::new("format");
        check_layout(find(&tps, "sched_switch"), path, SCHED_SWITCH_FORMAT).unwrap();
        check_layout(find(&tps, "sys_enter_poll"), path, SYS_ENTER_POLL_FORMAT).unwrap();
        check_layout(find(&tps, "sys_enter_ppoll"), path, SYS_ENTER_POLL_FORMAT).unwrap();
    }

    #[test]
    fn a_moved_field_is_refused_by_name_with_both_offsets() {
        // A kernel whose prev_state is an int before prev_prio.
        let moved = SCHED_SWITCH_FORMAT.replace(
            "long prev_state;\toffset:32;\tsize:8",
            "int prev_state;\toffset:28;\tsize:4",
        );
        let tps = tracepoints();
        let err =
            check_layout(find(&tps, "sched_switch"), Path::new("/t/format"), &moved).unwrap_err();
        assert!(matches!(
            err,
            ProbeError::TracepointLayout {
                field: "prev_state",
                expected_offset: 32,
                expected_size: 8,
                found_offset: 28,
                found_size: 4,
                ..
            }
        ));
        let msg = err.to_string();
        for part in [
            "sched:sched_switch",
            "prev_state",
            "offset 28",
            "offset 32",
            "report",
            "/t/format",
        ] {
            assert!(msg.contains(part), "{part:?} missing from: {msg}");
        }
    }

    #[test]
    fn a_missing_field_is_refused_by_name() {
        let missing = SYS_ENTER_POLL_FORMAT.replace("nfds;", "count;");
        let tps = tracepoints();
        let err =
            check_layout(find(&tps, "sys_enter_poll"), Path::new("format"), &missing).unwrap_err();
        assert!(matches!(
            err,
            ProbeError::TracepointFieldMissing {
                field: "nfds",
                expected_offset: 24,
                ..
            }
        ));
        assert!(err.to_string().contains("syscalls:sys_enter_poll"));
    }

    #[test]
    fn every_wait_is_attached_on_entry_and_return_exits_first() {
        let tps = tracepoints();
        for (_, name) in sysno::WAITS {
            assert!(tps.iter().any(|t| t.name == format!("sys_enter_{name}")));
            assert!(tps.iter().any(|t| t.name == format!("sys_exit_{name}")));
        }
        let first_enter = tps
            .iter()
            .position(|t| t.program == "sp_wait_enter")
            .unwrap();
        let last_exit = tps
            .iter()
            .rposition(|t| t.program == "sp_wait_exit")
            .unwrap();
        assert!(last_exit < first_enter);
    }
}
