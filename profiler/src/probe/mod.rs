//! Probes: load the eBPF object, set its globals, attach, and detach.
//!
//! The only module that owns `aya::Ebpf`. In: target tgid, sampling
//! frequency. Out: the ring buffer to read events from, loop-key updates in,
//! failure counters out. Dropping [`Probes`] detaches every program and
//! closes every map: nothing stays loaded after a recording, whatever route
//! it ended by.
use std::{collections::BTreeMap, io, num::NonZeroU32, path::Path};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf},
    programs::{
        PerfEvent, TracePoint, UProbe,
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
        uprobe::UProbeScope,
    },
    util::online_cpus,
};
use log::{debug, info};
use profiler_common::{Drop, Filtered, PyProc, sysno};
use thiserror::Error;

use crate::runtimes::ParkPoint;

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
    stats: PerCpuArray<MapData, u64>,
    filtered: PerCpuArray<MapData, u64>,
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

impl Probes {
    /// Load the programs for `tgid` (0 = every process) and attach them all.
    /// `sample_after_ns`: the sampling gate (0 = every sample, every busy period).
    pub fn attach(tgid: u32, sample_hz: u64, sample_after_ns: u64) -> Result<Probes, ProbeError> {
        if unsafe { libc::geteuid() } != 0 {
            // Capabilities may still be enough; only fail early on a clear no.
            debug!("not root; relying on capabilities");
        }
        ensure_tracefs()?;
        let mut ebpf = EbpfLoader::new()
            .override_global("TARGET_TGID", &tgid, true)
            .override_global("SAMPLE_AFTER_NS", &sample_after_ns, true)
            .load(EBPF_OBJECT)
            .map_err(|e| {
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
        let stats = take_map(&mut ebpf, "STATS", PerCpuArray::try_from)?;
        let filtered = take_map(&mut ebpf, "FILTERED", PerCpuArray::try_from)?;

        let tp = |ebpf: &mut Ebpf,
                  prog: &'static str,
                  targets: &[(&str, String)]|
         -> Result<(), ProbeError> {
            let p: &mut TracePoint = program(ebpf, prog)?;
            p.load().map_err(|source| load_error(prog, source))?;
            for (cat, name) in targets {
                p.attach(cat, name).map_err(|source| ProbeError::Attach {
                    what: format!("tracepoint {cat}:{name}"),
                    source,
                })?;
            }
            Ok(())
        };
        let enters: Vec<_> = sysno::WAITS
            .iter()
            .map(|(_, n)| ("syscalls", format!("sys_enter_{n}")))
            .collect();
        let exits: Vec<_> = sysno::WAITS
            .iter()
            .map(|(_, n)| ("syscalls", format!("sys_exit_{n}")))
            .collect();
        // Order matters a little: exits before enters, so that no thread is
        // seen entering a wait whose return we would miss.
        tp(&mut ebpf, "sp_wait_exit", &exits)?;
        tp(&mut ebpf, "sp_wait_enter", &enters)?;
        tp(
            &mut ebpf,
            "sp_sched_wakeup",
            &[("sched", "sched_wakeup".into())],
        )?;
        tp(
            &mut ebpf,
            "sp_sched_switch",
            &[("sched", "sched_switch".into())],
        )?;
        tp(
            &mut ebpf,
            "sp_exit",
            &[("sched", "sched_process_exit".into())],
        )?;

        // Loaded now, attached once a runtime's park function is found.
        for prog in ["sp_park_enter", "sp_park_exit"] {
            let p: &mut UProbe = program(&mut ebpf, prog)?;
            p.load().map_err(|source| load_error(prog, source))?;
        }

        let sample: &mut PerfEvent = program(&mut ebpf, "sp_sample")?;
        sample
            .load()
            .map_err(|source| load_error("sp_sample", source))?;
        let cpus = online_cpus().map_err(|(_, e)| ProbeError::Cpus(e))?;
        for cpu in cpus {
            sample
                .attach(
                    PerfEventConfig::Software(SoftwareEvent::CpuClock),
                    PerfEventScope::AllProcessesOneCpu { cpu },
                    SamplePolicy::Frequency(sample_hz),
                    false,
                )
                .map_err(|source| ProbeError::Attach {
                    what: format!("cpu-clock perf event on CPU {cpu}"),
                    source,
                })?;
        }
        info!("probes attached (tgid {tgid}, {sample_hz} Hz)");
        Ok(Probes {
            ebpf,
            loop_keys,
            loop_gen,
            generation: 0,
            py_procs,
            py_threads,
            stats,
            filtered,
        })
    }

    /// The event ring buffer (can be taken once).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        take_map(&mut self.ebpf, "EVENTS", RingBuf::try_from)
    }

    /// Tell the kernel side which wait is `tid`'s event-loop park.
    pub fn set_loop_key(&mut self, tid: u32, key: u64) {
        if let Err(e) = self.loop_keys.insert(tid, key, 0) {
            debug!("LOOP_KEYS insert for {tid}: {e}");
            return;
        }
        // After the insert: a thread that sees the new generation re-reads
        // LOOP_KEYS and finds the new key.
        self.generation += 1;
        if let Err(e) = self.loop_gen.set(0, self.generation, 0) {
            log::warn!("LOOP_GEN update: {e}; loop keys may be seen late");
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
            log::warn!("cannot enable Python stacks for {tgid}: {e}");
        }
    }

    /// Make `threads` (tid -> `PyThreadState*`) the Python threads BPF
    /// knows for one process, removing `gone` ones.
    /// A loop thread exited (or its process did): its `LOOP_KEYS` entry
    /// goes, so a reused tid starts undecided and the map does not fill.
    pub fn forget_loop_thread(&mut self, tid: u32) {
        if self.loop_keys.remove(&tid).is_ok() {
            self.generation += 1;
            if let Err(e) = self.loop_gen.set(0, self.generation, 0) {
                log::warn!("LOOP_GEN update: {e}; loop keys may be seen late");
            }
        }
    }

    pub fn set_python_threads(&mut self, threads: &[(u32, u64)], gone: &[u32]) {
        for &(tid, ts) in threads {
            if let Err(e) = self.py_threads.insert(tid, ts, 0) {
                debug!("PY_THREADS insert for {tid}: {e}");
            }
        }
        for tid in gone {
            let _ = self.py_threads.remove(tid);
        }
    }

    /// Non-zero failure counters, summed over CPUs, by name.
    pub fn drops(&self) -> BTreeMap<String, u64> {
        sum_counters(&self.stats, Drop::ALL.map(|d| (d as u32, d.name())))
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
