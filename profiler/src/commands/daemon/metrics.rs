//! Prometheus metrics: per-process stall histograms and time by kind, and
//! the daemon's own health, encoded in the OpenMetrics text format by
//! `prometheus-client`.
//!
//! In: stalls with their process labels; counters and gauges from the
//! collector. Out: the `/metrics` body. Names follow the Prometheus
//! conventions: base units (seconds, bytes), `_total` on counters, `_info`
//! with value 1 for build information, standard `process_*` names for the
//! daemon's own CPU and memory. An exited process's series are removed
//! after `forget_after` (bounded cardinality under churn).
use std::{collections::BTreeMap, sync::atomic::AtomicU64};

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram, info::Info},
    registry::{Registry, Unit},
};

use crate::model::{HeldUp, PartKind, Stall};

/// Label pairs of one process: pid, comm, exe, cgroup, container, pod,
/// runtime. Each is a function of the process, so a process has one set:
/// the series are bounded by `limits.max_processes` like the processes.
/// `container` is the short id ("" outside one), `pod` the Kubernetes pod
/// uid ("" outside one).
pub type Labels = Vec<(&'static str, String)>;

/// Stall-duration buckets, seconds: from a fast threshold to "the loop was
/// gone for a minute".
const BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// `held_up.not_read.reason` values (the model's, as stalls.json spells them).
const NOT_READ_REASONS: [&str; 4] = ["runtime", "after_end", "no_read", "unreadable"];

pub const KINDS: [PartKind; 5] = [
    PartKind::OnCpu,
    PartKind::OffCpu,
    PartKind::Runqueue,
    PartKind::GilWait,
    PartKind::Throttled,
];

pub struct Metrics {
    pub registry: Registry,
    stall_duration: Family<Labels, Histogram, fn() -> Histogram>,
    stall_seconds: Family<Labels, Counter<f64, AtomicU64>>,
    timer_lateness: Family<Labels, Histogram, fn() -> Histogram>,
    held_up_not_read: Family<Labels, Counter>,
    incomplete: Family<Labels, Counter>,
    loop_threads: Family<Labels, Gauge>,
    runtime_problems: Family<Labels, Gauge>,
    probes: Family<Labels, Gauge>,
    lost_events: Counter,
    probe_drops: Family<Labels, Counter>,
    agent_drops: Family<Labels, Counter>,
    kernel_filtered: Family<Labels, Counter>,
    pub tracked_processes: Gauge,
    pub tracked_threads: Gauge,
    pub watched_threads: Gauge,
    pub over_limit: Counter,
    pub excluded: Gauge,
    pub wait_probed: Gauge,
    pub window_stalls_dropped: Counter,
    pub reports_written: Counter,
    pub report_write_failures: Counter,
    pub reports_dropped: Counter,
    pub reports_bytes: Gauge,
    pub session_resets: Counter,
    pub non_loop_stack_events: Counter,
    otlp_spans: Family<Labels, Counter>,
    cpu: Counter<f64, AtomicU64>,
    rss: Gauge,
    last: std::sync::Mutex<Last>,
}

#[derive(Default)]
struct Last {
    cpu_s: f64,
    probe: BTreeMap<String, u64>,
    agent: BTreeMap<String, u64>,
    filtered: BTreeMap<String, u64>,
    otlp: BTreeMap<String, u64>,
}

/// Absolute counters in, increments of `family{label=name}` out; returns
/// the increments, `last` keeps the absolutes.
fn add_deltas(
    family: &Family<Labels, Counter>,
    label: &'static str,
    last: &mut BTreeMap<String, u64>,
    now: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    let mut added = BTreeMap::new();
    for (k, &v) in now {
        let before = last.get(k).copied().unwrap_or(0);
        if v > before {
            family
                .get_or_create(&vec![(label, k.clone())])
                .inc_by(v - before);
            added.insert(k.clone(), v - before);
        }
        last.insert(k.clone(), v.max(before));
    }
    added
}

fn with(labels: &Labels, k: &'static str, v: &str) -> Labels {
    let mut l = labels.clone();
    l.push((k, v.to_string()));
    l
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::default();
        let stall_duration = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(
            histogram as fn() -> Histogram,
        );
        r.register_with_unit(
            "stallprof_stall_duration",
            "Stalls of a process's event-loop threads (busy periods over the threshold), by duration",
            Unit::Seconds,
            stall_duration.clone(),
        );
        let stall_seconds = Family::<Labels, Counter<f64, AtomicU64>>::default();
        r.register_with_unit(
            "stallprof_stall",
            "Time spent in stalls, by where it went: kind=on_cpu|off_cpu|runqueue|gil_wait|throttled",
            Unit::Seconds,
            stall_seconds.clone(),
        );
        let timer_lateness = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(
            histogram as fn() -> Histogram,
        );
        r.register_with_unit(
            "stallprof_timer_lateness",
            "How late the event loop's timers ran because a stall held the loop: one observation per \
             timer that came due during a stall (plain asyncio; stallprof_held_up_not_read counts \
             the stalls whose loop was not read)",
            Unit::Seconds,
            timer_lateness.clone(),
        );
        let held_up_not_read = Family::<Labels, Counter>::default();
        r.register(
            "stallprof_held_up_not_read",
            "Stalls whose loop queues (timers, callbacks held up) were not read, by reason: \
             runtime (Node/libuv, tokio, C: not read for this runtime), after_end, no_read, \
             unreadable",
            held_up_not_read.clone(),
        );
        let incomplete = Family::<Labels, Counter>::default();
        r.register(
            "stallprof_stalls_incomplete",
            "Stalls cut short by the thread's or the daemon's exit",
            incomplete.clone(),
        );
        let loop_threads = Family::<Labels, Gauge>::default();
        r.register(
            "stallprof_loop_threads",
            "Event-loop threads found in the process",
            loop_threads.clone(),
        );
        let runtime_problems = Family::<Labels, Gauge>::default();
        r.register(
            "stallprof_runtime_problems",
            "Runtimes found in the process that could not be read (e.g. an unsupported CPython): \
             its stalls show native frames only; what, why and what to do are in its reports' \
             runtime_problems and the daemon's log",
            runtime_problems.clone(),
        );
        let probes = Family::<Labels, Gauge>::default();
        r.register(
            "stallprof_probes",
            "Which kernel probes serve (1 per part): part=scheduler mode=thread_perf_events|raw_tracepoints|tracepoints, \
             part=waits mode=uprobes|tracepoints|uprobes+tracepoints. A tracepoints mode costs every \
             process on the host its syscalls or context switches; the reason is in the daemon's log",
            probes.clone(),
        );
        let lost_events = Counter::default();
        r.register(
            "stallprof_lost_events",
            "Events the kernel could not deliver (ring buffer full); host-wide: the kernel side does not know the process",
            lost_events.clone(),
        );
        let probe_drops = Family::<Labels, Counter>::default();
        r.register(
            "stallprof_probe_drops",
            "Failures counted by the eBPF programs, by reason",
            probe_drops.clone(),
        );
        let agent_drops = Family::<Labels, Counter>::default();
        r.register(
            "stallprof_agent_drops",
            "Failures counted by the daemon (unwinding, decoding), by reason",
            agent_drops.clone(),
        );
        let kernel_filtered = Family::<Labels, Counter>::default();
        r.register(
            "stallprof_kernel_filtered",
            "Work the kernel side saved by design (not failures): short_busy_periods never reported, \
             samples_before_gate skipped, left_out_waits of processes the rules leave out",
            kernel_filtered.clone(),
        );
        let tracked_processes = Gauge::default();
        r.register(
            "stallprof_tracked_processes",
            "Processes with event-loop threads being reported on",
            tracked_processes.clone(),
        );
        let tracked_threads = Gauge::default();
        r.register(
            "stallprof_tracked_threads",
            "Event-loop threads of the reported processes",
            tracked_threads.clone(),
        );
        let watched_threads = Gauge::default();
        r.register(
            "stallprof_watched_threads",
            "Threads carrying their own switch and sampling events (the elected loop threads of reported \
             processes; 0 with the tracepoint scheduler)",
            watched_threads.clone(),
        );
        let excluded = Gauge::default();
        r.register(
            "stallprof_excluded_processes",
            "Live processes left out (by the include/exclude rules, over max_processes, or the daemon itself), event loops or not: with include rules every process they do not take, judged as it appears; without, those judged at their first wait",
            excluded.clone(),
        );
        let wait_probed = Gauge::default();
        r.register(
            "stallprof_wait_probed_processes",
            "Processes whose wait functions carry their own uprobes: with include rules, the included \
             processes that map a C library (no other process pays a trap); 0 without, when the uprobes \
             are on each C library file for every process that maps it",
            wait_probed.clone(),
        );
        let over_limit = Counter::default();
        r.register(
            "stallprof_processes_over_limit",
            "Processes not reported because limits.max_processes was reached",
            over_limit.clone(),
        );
        let window_stalls_dropped = Counter::default();
        r.register(
            "stallprof_window_stalls_dropped",
            "Stalls counted in the metrics but left out of a report window that was over its memory budget",
            window_stalls_dropped.clone(),
        );
        let reports_written = Counter::default();
        r.register(
            "stallprof_reports_written",
            "Per-process window reports written to the data directory",
            reports_written.clone(),
        );
        let report_write_failures = Counter::default();
        r.register(
            "stallprof_report_write_failures",
            "Window writes that failed (disk full, I/O error); their reports stay in memory and are retried at the next window",
            report_write_failures.clone(),
        );
        let reports_dropped = Counter::default();
        r.register(
            "stallprof_reports_dropped",
            "Per-process window reports given up after their window failed to write three windows in a row",
            reports_dropped.clone(),
        );
        let reports_bytes = Gauge::default();
        r.register_with_unit(
            "stallprof_reports",
            "Size of the report windows kept in the data directory",
            Unit::Bytes,
            reports_bytes.clone(),
        );
        let session_resets = Counter::default();
        r.register(
            "stallprof_session_resets",
            "Times the stall-assembly state was rebuilt to bound its memory",
            session_resets.clone(),
        );
        let non_loop_stack_events = Counter::default();
        r.register(
            "stallprof_non_loop_stack_events",
            "Stack events of threads that are not event loops, dropped before unwinding (work the kernel side did for nothing)",
            non_loop_stack_events.clone(),
        );
        let otlp_spans = Family::<Labels, Counter>::default();
        r.register(
            "stallprof_otlp_spans",
            "Stalls sent as spans to the OTLP collector, by outcome (exported, failed: the reports still have them)",
            otlp_spans.clone(),
        );
        let cpu = Counter::<f64, AtomicU64>::default();
        r.register_with_unit(
            "process_cpu",
            "Total user and system CPU time spent by the daemon",
            Unit::Seconds,
            cpu.clone(),
        );
        let rss = Gauge::default();
        r.register_with_unit(
            "process_resident_memory",
            "Resident memory size of the daemon",
            Unit::Bytes,
            rss.clone(),
        );
        let start_time = Gauge::<f64, AtomicU64>::default();
        r.register_with_unit(
            "process_start_time",
            "Start time of the daemon since the Unix epoch",
            Unit::Seconds,
            start_time.clone(),
        );
        start_time.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
        );
        r.register(
            "stallprof_build",
            "stallprof build information",
            // What `stallprof --version` says: a fleet's builds told apart.
            Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("commit", env!("STALLPROF_GIT_COMMIT").to_string()),
                ("bpf_sha256", env!("STALLPROF_BPF_SHA256").to_string()),
            ]),
        );
        Metrics {
            registry: r,
            stall_duration,
            stall_seconds,
            timer_lateness,
            held_up_not_read,
            incomplete,
            loop_threads,
            runtime_problems,
            probes,
            lost_events,
            probe_drops,
            agent_drops,
            kernel_filtered,
            tracked_processes,
            tracked_threads,
            watched_threads,
            over_limit,
            excluded,
            wait_probed,
            window_stalls_dropped,
            reports_written,
            report_write_failures,
            reports_dropped,
            reports_bytes,
            session_resets,
            non_loop_stack_events,
            otlp_spans,
            cpu,
            rss,
            last: std::sync::Mutex::new(Last::default()),
        }
    }

    /// Make a new process's series exist (at zero) so that dashboards see it
    /// before its first stall.
    pub fn add_process(&self, labels: &Labels) {
        let _ = self.stall_duration.get_or_create(labels);
        let _ = self.timer_lateness.get_or_create(labels);
        for k in KINDS {
            let _ = self
                .stall_seconds
                .get_or_create(&with(labels, "kind", k.as_str()));
        }
        let _ = self.incomplete.get_or_create(labels);
    }

    pub fn observe(&self, labels: &Labels, s: &Stall) {
        self.stall_duration
            .get_or_create(labels)
            .observe(s.duration_ns as f64 / 1e9);
        let mut by_kind = [0u64; KINDS.len()];
        for p in &s.stacks {
            let i = KINDS.iter().position(|k| *k == p.kind).unwrap_or(0);
            by_kind[i] += p.weight_ns;
        }
        for (k, ns) in KINDS.iter().zip(by_kind) {
            self.stall_seconds
                .get_or_create(&with(labels, "kind", k.as_str()))
                .inc_by(ns as f64 / 1e9);
        }
        if s.incomplete {
            self.incomplete.get_or_create(labels).inc();
        }
        match &s.held_up {
            Some(HeldUp::Read(d)) => {
                let h = self.timer_lateness.get_or_create(labels);
                for &late in &d.timers_late_ns {
                    h.observe(late as f64 / 1e9);
                }
            }
            Some(HeldUp::NotRead(n)) => {
                let reason = serde_json::to_value(n.reason)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default();
                self.held_up_not_read
                    .get_or_create(&with(labels, "reason", &reason))
                    .inc();
            }
            None => {}
        }
    }

    pub fn set_loop_threads(&self, labels: &Labels, n: usize) {
        self.loop_threads.get_or_create(labels).set(n as i64);
    }

    /// Which probes serve now (a part can fall back while the daemon runs).
    /// Which probes serve; `per_process_waits`: the wait uprobes are each
    /// included process's own (else on each C library file).
    /// The exporter's totals so far: spans exported and failed.
    pub fn set_otlp(&self, exported: u64, failed: u64) {
        let now = BTreeMap::from([
            ("exported".to_string(), exported),
            ("failed".to_string(), failed),
        ]);
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        add_deltas(&self.otlp_spans, "outcome", &mut last.otlp, &now);
    }

    pub fn set_probes(&self, set: &crate::model::ProbeSet, per_process_waits: bool) {
        self.probes.clear();
        let scope = if set.waits == crate::model::WaitProbes::Uprobes {
            Some(if per_process_waits {
                "per_process"
            } else {
                "per_file"
            })
        } else {
            None
        };
        for (part, mode) in [
            ("scheduler", set.scheduler.as_str()),
            ("waits", set.waits.as_str()),
        ]
        .into_iter()
        .chain(scope.map(|s| ("wait_uprobes", s)))
        {
            self.probes
                .get_or_create(&vec![
                    ("part", part.to_string()),
                    ("mode", mode.to_string()),
                ])
                .set(1);
        }
    }

    pub fn set_runtime_problems(&self, labels: &Labels, n: usize) {
        self.runtime_problems.get_or_create(labels).set(n as i64);
    }

    /// Drop every series of a process (it exited long enough ago, or its
    /// pid now belongs to another process with the same labels).
    pub fn remove_process(&self, labels: &Labels) {
        self.stall_duration.remove(labels);
        for k in KINDS {
            self.stall_seconds.remove(&with(labels, "kind", k.as_str()));
        }
        self.timer_lateness.remove(labels);
        for r in NOT_READ_REASONS {
            self.held_up_not_read.remove(&with(labels, "reason", r));
        }
        self.incomplete.remove(labels);
        self.loop_threads.remove(labels);
        self.runtime_problems.remove(labels);
    }

    /// Absolute failure counters in; counter increments out.
    pub fn set_drops(&self, probe: &BTreeMap<String, u64>, agent: &BTreeMap<String, u64>) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let added = add_deltas(&self.probe_drops, "reason", &mut last.probe, probe);
        if let Some(&n) = added.get(profiler_common::Drop::RingbufFull.name()) {
            self.lost_events.inc_by(n);
        }
        add_deltas(&self.agent_drops, "reason", &mut last.agent, agent);
    }

    /// Absolute sampling-gate counters (`Probes::filtered`) in.
    pub fn set_filtered(&self, filtered: &BTreeMap<String, u64>) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        add_deltas(&self.kernel_filtered, "what", &mut last.filtered, filtered);
    }

    /// The daemon's own CPU time and resident memory, read at scrape time.
    pub fn update_self(&self) {
        let (cpu_s, rss) = self_usage();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if cpu_s > last.cpu_s {
            self.cpu.inc_by(cpu_s - last.cpu_s);
            last.cpu_s = cpu_s;
        }
        self.rss.set(rss as i64);
    }

    pub fn encode(&self) -> String {
        self.update_self();
        let mut s = String::new();
        encode(&mut s, &self.registry).expect("writing to a String cannot fail");
        s
    }
}

/// (CPU seconds, resident bytes) of this process, from /proc/self.
pub fn self_usage() -> (f64, u64) {
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    let cpu = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let (_, rest) = s.rsplit_once(')')?;
            let f: Vec<&str> = rest.split_ascii_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / tck)
        })
        .unwrap_or(0.0);
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_ascii_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * page;
    (cpu, rss)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Frame;
    use crate::testing;

    #[test]
    fn names_follow_conventions() {
        let m = Metrics::new();
        let labels: Labels = vec![("pid", "1".into()), ("comm", "x".into())];
        m.add_process(&labels);
        let part = |kind, ns| testing::part(kind, ns, vec![Frame::marker("[x]")]);
        let s = Stall {
            thread_name: "x".into(),
            ..testing::stall(
                0,
                vec![
                    part(PartKind::OnCpu, 60_000_000),
                    part(PartKind::OffCpu, 40_000_000),
                ],
            )
        };
        m.observe(&labels, &s);
        let mut held = s.clone();
        held.held_up = Some(HeldUp::Read(crate::model::Delayed {
            timers_late_ns: vec![240_000_000, 20_000_000],
            ready_handles: 0,
            truncated: false,
        }));
        m.observe(&labels, &held);
        held.held_up = Some(HeldUp::NotRead(crate::model::NotRead {
            reason: crate::model::NotReadReason::Runtime,
            detail: None,
        }));
        m.observe(&labels, &held);
        let text = m.encode();
        assert!(
            text.contains("stallprof_timer_lateness_seconds_count{pid=\"1\",comm=\"x\"} 2"),
            "{text}"
        );
        assert!(
            text.contains(
                "stallprof_held_up_not_read_total{pid=\"1\",comm=\"x\",reason=\"runtime\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("# TYPE stallprof_stall_duration_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains("stallprof_stall_duration_seconds_count{pid=\"1\",comm=\"x\"} 3"),
            "{text}"
        );
        assert!(
            text.contains(
                "stallprof_stall_seconds_total{pid=\"1\",comm=\"x\",kind=\"on_cpu\"} 0.18"
            ),
            "{text}"
        );
        assert!(text.contains("process_cpu_seconds_total"), "{text}");
        assert!(text.ends_with("# EOF\n"));
        m.remove_process(&labels);
        assert!(!m.encode().contains("pid=\"1\""));
    }
}
