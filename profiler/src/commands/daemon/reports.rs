//! Rolling reports: one window of stalls per process -> files in the data
//! directory, and the retention sweep that bounds them.
//!
//! In: stalls with their process, added as they end. Out, when a window
//! closes: `DATA/<window start, UTC>/<comm>-<pid>/` holding `stalls.json`
//! (readable by `stallprof report`), `stalls.folded`, `stalls.svg`,
//! `stalls.pb.gz` (pprof), `stalls.pftrace` (the Perfetto timeline) and
//! `stalls.speedscope.json` (the same timeline for speedscope), for
//! every process that stalled in the window; and, when a service's workers
//! stalled, `DATA/<window>/services.json`: each service group (`services`)
//! with its workers' stalls together and per worker.
//! The sweep deletes whole windows: older than `max_age`, then the oldest
//! until the total is under `max_bytes`. It only touches directories named
//! like windows, never anything else in the data directory.
use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};

use super::{procs::ProcInfo, services};
use crate::{
    model::{ProbeSet, Recording, RuntimeProblem, Stall},
    os::outdir::OutDir,
    report::{self, flamegraph, pprof},
};

/// How the daemon records: what each window's recordings say of it.
#[derive(Clone, Copy)]
pub struct Made<'a> {
    pub threshold_ns: u64,
    pub sample_hz: u64,
    pub probes: &'a ProbeSet,
    /// Where the application's code is (`app_paths`; empty: the guess).
    pub app_paths: &'a [String],
    /// Every process reported on (live and recently exited): the service
    /// groups are drawn from them, not only from those that stalled.
    pub known: &'a [Arc<ProcInfo>],
}

/// Memory budget of one window's buffered stalls (approximate bytes); past
/// it, stalls still count in the metrics but are left out of the reports.
pub const WINDOW_BUDGET: usize = 32 << 20;

/// Approximate heap bytes of a stall, for the budgets.
pub fn stall_bytes(s: &Stall) -> usize {
    256 + s
        .stacks
        .iter()
        .map(|p| {
            128 + p
                .frames
                .iter()
                .map(|f| 96 + f.name.len() + f.file.as_ref().map_or(0, |x| x.len()))
                .sum::<usize>()
        })
        .sum::<usize>()
}

/// `20250102T030405Z`.
pub fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The inverse of [`utc_stamp`] (with an optional `-N` suffix), or None for
/// a name that is not a window's.
pub fn parse_stamp(name: &str) -> Option<u64> {
    let base = name.split_once('-').map_or(name, |(b, _)| b);
    let b = base.as_bytes();
    if b.len() != 16
        || b[8] != b'T'
        || b[15] != b'Z'
        || !b[..8].iter().chain(&b[9..15]).all(u8::is_ascii_digit)
    {
        return None;
    }
    let n = |r: std::ops::Range<usize>| base[r].parse::<i64>().ok();
    let (y, m, d) = (n(0..4)?, n(4..6)?, n(6..8)?);
    let (hh, mm, ss) = (n(9..11)?, n(11..13)?, n(13..15)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    // days_from_civil
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86400 + hh * 3600 + mm * 60 + ss) as u64)
}

pub struct ProcWindow {
    pub info: Arc<ProcInfo>,
    /// Shared with the daemon's recent-stall view (`/debug/pprof`), not
    /// copied: one stall in memory for both.
    pub stalls: Vec<Arc<Stall>>,
    /// Its runtimes that could not be read, as of its latest stall and the
    /// window's close.
    pub problems: Vec<RuntimeProblem>,
}

impl ProcWindow {
    fn merge_problems(&mut self, found: impl IntoIterator<Item = RuntimeProblem>) {
        for f in found {
            if !self.problems.contains(&f) {
                self.problems.push(f);
            }
        }
    }
}

/// The window being filled.
pub struct Window {
    pub start_wall: SystemTime,
    pub start_mono: u64,
    /// Keyed by (pid, start ticks): a reused pid is another process.
    pub procs: HashMap<(u32, u64), ProcWindow>,
    pub bytes: usize,
    /// Once its writing began: the window's directory and end, which a
    /// retried write reuses (the processes written are gone from `procs`).
    written_to: Option<(String, OutDir, u64)>,
    /// The reports written so far, for `services.json` once all are.
    done: Vec<Written>,
    /// `services.json` is written (or was not needed).
    services_done: bool,
}

/// One per-process report written.
#[derive(Debug, Clone)]
pub struct Written {
    pub window: String,
    pub dir: PathBuf,
    pub info: Arc<ProcInfo>,
    pub stalls: usize,
    pub stall_ns: u64,
    pub worst_ns: u64,
}

impl Window {
    pub fn new(start_wall: SystemTime, start_mono: u64) -> Window {
        Window {
            start_wall,
            start_mono,
            procs: HashMap::new(),
            bytes: 0,
            written_to: None,
            done: Vec::new(),
            services_done: false,
        }
    }

    /// Processes whose reports are not written yet.
    pub fn pending(&self) -> usize {
        self.procs.len()
    }

    /// After every process's report: the service groups' `services.json`
    /// in the window directory, when a group stalled.
    fn write_services(&mut self, wdir: &OutDir, known: &[Arc<ProcInfo>]) -> Result<()> {
        let dir_of = |w: &Written| {
            w.dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let dirs: Vec<String> = self.done.iter().map(dir_of).collect();
        let mut rows: Vec<services::Known> = self
            .done
            .iter()
            .zip(&dirs)
            .map(|(w, dir)| services::Known {
                pid: w.info.pid,
                ppid: w.info.ppid,
                cgroup: &w.info.cgroup,
                exe: &w.info.exe,
                comm: &w.info.comm,
                parent_comm: &w.info.parent_comm,
                report: Some((dir.as_str(), w.stalls, w.stall_ns, w.worst_ns)),
            })
            .collect();
        // Those that did not stall in the window (a written one is not
        // listed twice).
        rows.extend(
            known
                .iter()
                .filter(|k| {
                    !self
                        .done
                        .iter()
                        .any(|w| (w.info.pid, w.info.start_ticks) == (k.pid, k.start_ticks))
                })
                .map(|k| services::Known {
                    pid: k.pid,
                    ppid: k.ppid,
                    cgroup: &k.cgroup,
                    exe: &k.exe,
                    comm: &k.comm,
                    parent_comm: &k.parent_comm,
                    report: None,
                }),
        );
        let file = services::window_services(&rows);
        if !file.services.is_empty() {
            let json = serde_json::to_vec_pretty(&file).context("encoding services.json")?;
            wdir.write("services.json", &json)
                .with_context(|| format!("writing {}", wdir.join("services.json").display()))?;
        }
        self.services_done = true;
        self.done = Vec::new();
        Ok(())
    }

    /// Add a stall, with its process's runtime problems now; false if the
    /// window is over its budget (not added).
    pub fn add(
        &mut self,
        info: &Arc<ProcInfo>,
        s: Arc<Stall>,
        problems: Vec<RuntimeProblem>,
    ) -> bool {
        let b = stall_bytes(&s);
        if self.bytes + b > WINDOW_BUDGET {
            return false;
        }
        self.bytes += b;
        let p = self
            .procs
            .entry((info.pid, info.start_ticks))
            .or_insert_with(|| ProcWindow {
                info: info.clone(),
                stalls: Vec::new(),
                problems: Vec::new(),
            });
        p.stalls.push(s);
        p.merge_problems(problems);
        true
    }

    /// The runtime problems known when the window closes, for each of its
    /// processes: one found after a process's stalls (its discovery waited
    /// behind a busy host) is in that process's report all the same.
    pub fn note_problems(&mut self, known: &[RuntimeProblem]) {
        for ((pid, _), p) in &mut self.procs {
            p.merge_problems(known.iter().filter(|k| k.pid == *pid).cloned());
        }
    }

    /// Write every process's report for this window, ending at `end_mono`
    /// (on a retry, the end of the first attempt). Each process written
    /// leaves the window; on an error the rest stay, for
    /// [`Window::write`] again. Returns what was written, and the error.
    pub fn write(
        &mut self,
        data_dir: &OutDir,
        end_mono: u64,
        how: &Made,
    ) -> (Vec<Written>, Result<()>) {
        let mut out = Vec::new();
        let r = self.write_procs(data_dir, end_mono, how, &mut out);
        (out, r)
    }

    fn write_procs(
        &mut self,
        data_dir: &OutDir,
        end_mono: u64,
        how: &Made,
        out: &mut Vec<Written>,
    ) -> Result<()> {
        let Made {
            threshold_ns,
            sample_hz,
            probes,
            app_paths,
            known,
        } = *how;
        if self.procs.is_empty() && self.written_to.is_none() {
            return Ok(());
        }
        let start_secs = self
            .start_wall
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let (name, wdir, end_mono) = match &self.written_to {
            Some(w) => w.clone(),
            None => {
                let (name, wdir) = new_subdir(data_dir, &utc_stamp(start_secs))?;
                self.written_to = Some((name.clone(), wdir.clone(), end_mono));
                (name, wdir, end_mono)
            }
        };
        let mut keys: Vec<(u32, u64)> = self.procs.keys().copied().collect();
        keys.sort();
        let time_nanos = self
            .start_wall
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0);
        let duration_nanos = end_mono.saturating_sub(self.start_mono) as i64;
        for key in keys {
            let p = self.procs.get_mut(&key).expect("a key of procs");
            p.stalls.sort_by_key(|s| (s.start_ns, s.tid));
            // The same comm and pid twice in a window: a reused pid.
            let (_, dir) = new_subdir(&wdir, &p.info.dir_name())?;
            let rec = Recording {
                pid: p.info.pid,
                comm: p.info.comm.clone(),
                process: p.info.process.clone(),
                threshold_ns,
                sample_hz,
                sample_after_ns: crate::kernel::probe::default_sample_after(threshold_ns),
                kernel_filtered: Default::default(),
                busy_periods: 0,
                clock: "monotonic".into(),
                started_ns: self.start_mono.min(
                    p.stalls
                        .iter()
                        .map(|s| s.start_ns)
                        .min()
                        .unwrap_or(u64::MAX),
                ),
                ended_ns: end_mono.max(p.stalls.iter().map(|s| s.end_ns).max().unwrap_or(0)),
                lost_events: 0,
                probes: probes.clone(),
                drops: Default::default(),
                executor_threads: Vec::new(),
                stallprof_version: env!("CARGO_PKG_VERSION").into(),
                runtime_problems: p.problems.clone(),
                // The daemon does not read quotas: its metrics count the
                // throttled time per stall.
                cpu_quota: None,
                app_paths: app_paths.to_vec(),
                // Moved where the recent view let go of them, else copied
                // for this write only.
                processes: Vec::new(),
                stalls: std::mem::take(&mut p.stalls)
                    .into_iter()
                    .map(Arc::unwrap_or_clone)
                    .collect(),
            }
            .completed();
            let wrote = (|| -> Result<()> {
                report::write_json(&rec, &dir)?;
                report::folded::write(&rec, &dir)?;
                flamegraph::write(&rec, &dir)?;
                let label = pprof::ProcLabel {
                    pid: rec.pid,
                    comm: &rec.comm,
                    container: p.info.container(),
                    process: None,
                };
                let prof = pprof::profile(
                    rec.stalls.iter().map(|s| (label.clone(), s)),
                    time_nanos,
                    duration_nanos,
                    &rec.app(),
                );
                report::write_file(&dir, "stalls.pb.gz", &pprof::encode_gz(&prof))?;
                report::perfetto::write(&rec, &dir)?;
                report::speedscope::write(&rec, &dir)?;
                Ok(())
            })();
            if let Err(e) = wrote {
                // Kept for the retry; the half-written directory stays
                // (the retry writes a new `<comm>-<pid>-2`).
                p.stalls = rec.stalls.into_iter().map(Arc::new).collect();
                return Err(e);
            }
            let info = p.info.clone();
            self.procs.remove(&key);
            let wr = Written {
                window: name.clone(),
                dir: dir.path().to_path_buf(),
                info,
                stalls: rec.stalls.len(),
                stall_ns: rec.total_stall_ns(),
                worst_ns: rec.stalls.iter().map(|s| s.duration_ns).max().unwrap_or(0),
            };
            self.done.push(wr.clone());
            out.push(wr);
        }
        if !self.services_done {
            self.write_services(&wdir, known)?;
        }
        Ok(())
    }
}

/// A new directory `base` (or `base-2`, `base-3`, … when taken) in `parent`.
fn new_subdir(parent: &OutDir, base: &str) -> Result<(String, OutDir)> {
    for n in 1..10_000 {
        let name = if n == 1 {
            base.to_string()
        } else {
            format!("{base}-{n}")
        };
        let made = parent
            .subdir_new(&name)
            .with_context(|| format!("creating {}", parent.join(&name).display()))?;
        if let Some(dir) = made {
            return Ok((name, dir));
        }
    }
    anyhow::bail!("{}: no free name {base}-N", parent.path().display())
}

fn dir_size(p: &Path) -> u64 {
    let Ok(rd) = fs::read_dir(p) else { return 0 };
    rd.filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            Ok(_) => e.metadata().map(|m| m.len()).unwrap_or(0),
            Err(_) => 0,
        })
        .sum()
}

/// Window directories in the data directory, oldest first: (name, start, bytes).
pub fn windows(data_dir: &Path) -> Vec<(String, u64, u64)> {
    let Ok(rd) = fs::read_dir(data_dir) else {
        return Vec::new();
    };
    let mut v: Vec<(String, u64, u64)> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let start = parse_stamp(&name)?;
            Some((name, start, dir_size(&e.path())))
        })
        .collect();
    v.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    v
}

/// Apply retention; returns (bytes kept, windows removed).
pub fn sweep(
    data_dir: &Path,
    max_age: Duration,
    max_bytes: u64,
    now: SystemTime,
) -> (u64, Vec<String>) {
    let now_s = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut ws = windows(data_dir);
    let mut removed = Vec::new();
    let mut total: u64 = ws.iter().map(|w| w.2).sum();
    ws.retain(|(name, start, bytes)| {
        let too_old = now_s.saturating_sub(*start) > max_age.as_secs();
        if too_old {
            if fs::remove_dir_all(data_dir.join(name)).is_ok() {
                total -= bytes;
                removed.push(name.clone());
            }
            return false;
        }
        true
    });
    for (name, _, bytes) in ws {
        if total <= max_bytes {
            break;
        }
        if fs::remove_dir_all(data_dir.join(&name)).is_ok() {
            total -= bytes;
            removed.push(name);
        }
    }
    (total, removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

    /// Issue 13: a window whose write fails keeps its stalls for a retry;
    /// the retry writes them into the same window directory.
    #[test]
    fn failed_window_write_is_kept_and_retried() {
        use crate::model::{Frame, FrameKind, PartKind};
        let root = std::env::temp_dir().join(format!(
            "stallprof-window-{}",
            crate::os::outdir::random_suffix()
        ));
        let data = OutDir::create_new(&root).unwrap();
        let mut w = Window::new(SystemTime::now(), 1_000);
        let info = Arc::new(ProcInfo {
            pid: 42,
            start_ticks: 7,
            comm: "victim".into(),
            exe: "/bin/victim".into(),
            cgroup: String::new(),
            ppid: 0,
            parent_comm: String::new(),
            process: Default::default(),
            runtime: "native".into(),
        });
        let spin = vec![Frame::new("spin", FrameKind::Native)];
        let stall = Stall {
            tid: 42,
            thread_name: "victim".into(),
            ..testing::stall(
                2_000,
                vec![testing::part(PartKind::OnCpu, 59_998_000, spin)],
            )
        };
        let probes = ProbeSet::default();
        let how = Made {
            threshold_ns: 50_000_000,
            sample_hz: 199,
            probes: &probes,
            app_paths: &[],
            known: &[],
        };
        assert!(w.add(&info, Arc::new(stall), Vec::new()));
        // The data directory is gone: the write fails, the stalls stay.
        fs::remove_dir(&root).unwrap();
        let (written, r) = w.write(&data, 70_000_000, &how);
        assert!(r.is_err() && written.is_empty());
        assert_eq!(w.pending(), 1);
        // Back: the retry writes them.
        let data = OutDir::create_new(&root).unwrap();
        let (written, r) = w.write(&data, 80_000_000, &how);
        r.unwrap();
        assert_eq!((written.len(), w.pending()), (1, 0));
        assert!(written[0].dir.join("stalls.json").is_file());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn stamps_round_trip() {
        for secs in [
            0u64,
            951_782_400,
            1_700_000_000,
            1_735_689_599,
            4_102_444_800,
        ] {
            let s = utc_stamp(secs);
            assert_eq!(parse_stamp(&s), Some(secs), "{s}");
            assert_eq!(parse_stamp(&format!("{s}-2")), Some(secs));
        }
        assert_eq!(utc_stamp(1_700_000_000), "20231114T221320Z");
        assert_eq!(parse_stamp("lost+found"), None);
        assert_eq!(parse_stamp("20231314T221320Z"), None);
    }

    #[test]
    fn sweep_removes_old_then_oldest() {
        let dir = crate::os::scratch_dir("sweep");
        let now = 1_700_000_000u64;
        for (age, bytes) in [(7200u64, 10usize), (300, 100), (200, 100), (100, 100)] {
            let w = dir.join(utc_stamp(now - age)).join("p-1");
            fs::create_dir_all(&w).unwrap();
            fs::write(w.join("f"), vec![0u8; bytes]).unwrap();
        }
        fs::create_dir_all(dir.join("keep-me")).unwrap();
        let (total, removed) = sweep(
            &dir,
            Duration::from_secs(3600),
            250,
            UNIX_EPOCH + Duration::from_secs(now),
        );
        assert_eq!(removed, vec![utc_stamp(now - 7200), utc_stamp(now - 300)]);
        assert_eq!(total, 200);
        assert!(dir.join("keep-me").exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
