//! The daemon's stalls as spans to an OpenTelemetry collector (`[otlp]`):
//! batched per tick into one request, sent by [`crate::commands::otlp`]'s
//! thread, counted in the metrics (`stallprof_otlp_spans_total`).
//!
//! In: each stall the daemon keeps, with its process. Out: a request per
//! tick with stalls; the process's resource names it by its own
//! OpenTelemetry service name when its environment has one (read once per
//! process, when its first stall is exported), else its command.

use std::collections::HashMap;
use std::time::Duration;

use crate::classify::AppPaths;
use crate::commands::otlp::{ExportReport, Exporter, OtlpConfig};
use crate::model::{Process, ProcessInfo, Stall};
use crate::report::otlp::{SpanClock, request};

/// Stalls held for the next tick at most; past it, the oldest tick's batch
/// is sent early.
const MAX_PENDING: usize = 512;
/// Service names remembered (pid, start time) at most.
const MAX_SERVICES: usize = 4096;

pub struct DaemonExport {
    exporter: Exporter,
    clock: SpanClock,
    app: AppPaths,
    pending: Vec<Stall>,
    processes: HashMap<u32, Process>,
    services: HashMap<(u32, u64), Option<String>>,
}

impl DaemonExport {
    pub fn start(config: &OtlpConfig, app_paths: &[String]) -> anyhow::Result<DaemonExport> {
        log::info!(
            "exporting each stall as a span to {} ({})",
            config.url,
            config.protocol.as_str()
        );
        Ok(DaemonExport {
            exporter: Exporter::start(config.clone())?,
            clock: SpanClock {
                wall_offset_ns: crate::os::clock::wall_offset_ns(),
                random: crate::os::outdir::fill_random,
            },
            app: AppPaths::new(app_paths),
            pending: Vec::new(),
            processes: HashMap::new(),
            services: HashMap::new(),
        })
    }

    /// Hold `stall` of process (`pid`, `start_ticks`, `comm`, `info`) for
    /// the next [`flush`](Self::flush).
    pub fn add(&mut self, stall: &Stall, start_ticks: u64, comm: &str, info: &ProcessInfo) {
        let pid = stall.pid;
        if self.services.len() >= MAX_SERVICES {
            self.services.clear();
        }
        let service = self
            .services
            .entry((pid, start_ticks))
            .or_insert_with(|| crate::os::family::service_of(pid))
            .clone();
        self.processes.insert(
            pid,
            Process {
                pid,
                comm: comm.to_string(),
                info: info.clone(),
                parent: None,
                role: None,
                service,
            },
        );
        self.pending.push(stall.clone());
        if self.pending.len() >= MAX_PENDING {
            self.flush();
        }
    }

    /// Send what is held as one request (never blocks).
    pub fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let processes: Vec<Process> = self.processes.drain().map(|(_, p)| p).collect();
        let req = request(&self.pending, &processes, &self.app, &self.clock);
        let n = self.pending.len() as u64;
        self.pending.clear();
        self.exporter.send(req, n);
    }

    /// Spans exported and failed so far.
    pub fn counts(&self) -> (u64, u64) {
        self.exporter.counts()
    }

    /// The last batch, waited for at most `deadline`.
    pub fn finish(mut self, deadline: Duration) -> ExportReport {
        self.flush();
        self.exporter.finish(deadline)
    }
}
