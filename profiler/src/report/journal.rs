//! `stalls.journal`: `record`'s stalls on disk as they are found, so a
//! recording killed with `kill -9`, by the OOM killer or a power cut keeps
//! every stall found up to its last second (docs/format.md).
//!
//! In (write): the recording's settings, then batches of finished stalls and,
//! now and then, what is known of the recording so far (with the target's
//! namespace pid and container). Out: JSON lines,
//! appended. In (read): those lines, possibly cut anywhere by a crash or a
//! full disk. Out: a [`Recording`] that every writer renders.
//!
//! Each line is one object with one key: `header` (first line: format,
//! version and the settings), `process` (version 2: what procfs said of a
//! watched process when it was first seen — parent, start time, comm,
//! Node cluster id, namespace pid, container — from which the reader
//! derives its role, [`crate::os::family`]: read while it ran, since it
//! may be gone at the end), `frames` (new frames, appended to the frame
//! table: ids continue), `stacks` (new stacks of frame ids), `stall` (a
//! finished stall in `stalls.json`'s shape, its parts naming stack ids)
//! and `meta` (the latest comm, loop threads, runtime problems, busy
//! periods and end time; the last one wins). A process's line is written
//! before its first stall, and a stall's frames and stacks before it, in
//! one `write`, so a cut leaves whole stalls and at
//! most one damaged last line, which the reader drops. Writes go to the
//! kernel on every batch (a killed process loses nothing written); fsync
//! runs at most once a second after stalls were written (a power cut loses
//! at most the last second of stalls), and every 10 s when only `meta`
//! changed (its end time: an idle recording does not wake the file
//! system's journal every second).
use std::{
    collections::HashMap,
    fs::File,
    io::{self, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::{
    model::{CpuQuota, Frame, Process, ProcessInfo, Recording, RuntimeProblem, Stall, ThreadInfo},
    os::{family::Facts, outdir::OutDir},
    report::json::{self, FormatError, WireStall},
};

pub const NAME: &str = "stalls.journal";
pub const FORMAT: &str = "stallprof-journal";
/// The version written; the reader takes it and every older one (1: no
/// `process` lines, its stalls no `pid`: the target's).
pub const VERSION: u64 = 2;
/// fsync at most this often: the power-cut window.
const SYNC_EVERY: Duration = Duration::from_secs(1);
/// Between fsyncs when no stall was written since the last.
const SYNC_IDLE_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug, Error)]
pub enum JournalError {
    #[error(
        "cannot write {path}: {source}; {written} bytes holding at least {stalls} stalls were written and are kept \
         (`stallprof report {dir}` renders them); free space there or record into another directory with -o DIR",
        dir = dir.display()
    )]
    Write {
        path: PathBuf,
        dir: PathBuf,
        source: io::Error,
        written: u64,
        stalls: usize,
    },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path} is not a stallprof journal: {why}")]
    NotJournal { path: PathBuf, why: String },
    #[error("{path}: {source}")]
    Format { path: PathBuf, source: FormatError },
}

/// The recording's settings, known at the start.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u64,
    pub pid: u32,
    pub comm: String,
    pub threshold_ns: u64,
    pub sample_hz: u64,
    pub sample_after_ns: u64,
    pub clock: String,
    pub started_ns: u64,
    pub stallprof_version: String,
    /// `--app-path` prefixes (`stalls.json`'s `app_paths`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub app_paths: Vec<String>,
}

/// What is known of the recording so far.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Meta {
    pub comm: String,
    /// The last time the recording was known to run (CLOCK_MONOTONIC ns).
    pub ended_ns: u64,
    pub busy_periods: u64,
    #[serde(default)]
    pub executor_threads: Vec<ThreadInfo>,
    #[serde(default)]
    pub runtime_problems: Vec<RuntimeProblem>,
    /// The target's namespace pid and container (`stalls.json`'s fields).
    #[serde(default, flatten)]
    pub process: ProcessInfo,
    /// The target's CPU quota and its cgroup's throttling counters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_quota: Option<CpuQuota>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Line {
    Header(Header),
    Process(Facts),
    Frames(Vec<Frame>),
    Stacks(Vec<Vec<u32>>),
    Stall(WireStall),
    Meta(Meta),
}

/// The journal being written.
pub struct JournalWriter {
    file: File,
    dir: PathBuf,
    frame_ids: HashMap<Frame, u32>,
    stack_ids: HashMap<Vec<u32>, u32>,
    written: u64,
    stalls: usize,
    /// `stalls` at the last fsync.
    stalls_synced: usize,
    last_sync: Instant,
}

impl JournalWriter {
    /// Creates `stalls.journal` in `dir` with its header line, under its
    /// final name at once (see [`OutDir::create_growing`]).
    pub fn create(dir: &OutDir, header: Header) -> Result<JournalWriter, JournalError> {
        let mut head = serde_json::to_vec(&Line::Header(header)).expect("serializable");
        head.push(b'\n');
        let err = |source| JournalError::Write {
            path: dir.join(NAME),
            dir: dir.path().to_path_buf(),
            source,
            written: 0,
            stalls: 0,
        };
        let file = dir.create_growing(NAME, &head).map_err(err)?;
        Ok(JournalWriter {
            file,
            dir: dir.path().to_path_buf(),
            frame_ids: HashMap::new(),
            stack_ids: HashMap::new(),
            written: head.len() as u64,
            stalls: 0,
            stalls_synced: 0,
            last_sync: Instant::now(),
        })
    }

    /// Stalls written so far.
    pub fn stalls(&self) -> usize {
        self.stalls
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    fn intern(
        &mut self,
        frames: &[Frame],
        new_frames: &mut Vec<Frame>,
        new_stacks: &mut Vec<Vec<u32>>,
    ) -> u32 {
        let ids: Vec<u32> = frames
            .iter()
            .map(|f| {
                if let Some(&id) = self.frame_ids.get(f) {
                    return id;
                }
                let id = self.frame_ids.len() as u32;
                self.frame_ids.insert(f.clone(), id);
                new_frames.push(f.clone());
                id
            })
            .collect();
        if let Some(&id) = self.stack_ids.get(&ids) {
            return id;
        }
        let id = self.stack_ids.len() as u32;
        self.stack_ids.insert(ids.clone(), id);
        new_stacks.push(ids);
        id
    }

    /// Appends `processes` (newly seen: before the stalls, which may be
    /// theirs), `stalls` (each with its new frames and stacks first) and,
    /// if given, `meta`; fsyncs if the last fsync is a second old.
    pub fn append<'a>(
        &mut self,
        processes: &[Facts],
        stalls: impl IntoIterator<Item = &'a Stall>,
        meta: Option<Meta>,
    ) -> Result<(), JournalError> {
        let mut buf = Vec::new();
        let mut n = 0;
        for p in processes {
            serde_json::to_writer(&mut buf, &Line::Process(p.clone())).expect("serializable");
            buf.push(b'\n');
        }
        for s in stalls {
            let (mut frames, mut stacks) = (Vec::new(), Vec::new());
            // Interned first (ids must exist before the stall names them),
            // then serialized in that order.
            let mut ids = Vec::new();
            for p in &s.stacks {
                ids.push(self.intern(&p.frames, &mut frames, &mut stacks));
                if let Some(h) = &p.gil_holder {
                    ids.push(self.intern(&h.frames, &mut frames, &mut stacks));
                }
            }
            let mut it = ids.into_iter();
            let wire =
                json::wire_stall(s, None, |_| it.next().expect("one id per stack, in order"));
            for line in [
                (!frames.is_empty()).then_some(Line::Frames(frames)),
                (!stacks.is_empty()).then_some(Line::Stacks(stacks)),
                Some(Line::Stall(wire)),
            ]
            .into_iter()
            .flatten()
            {
                serde_json::to_writer(&mut buf, &line).expect("serializable");
                buf.push(b'\n');
            }
            n += 1;
        }
        if let Some(m) = meta {
            serde_json::to_writer(&mut buf, &Line::Meta(m)).expect("serializable");
            buf.push(b'\n');
        }
        if !buf.is_empty() {
            self.write(&buf)?;
            self.stalls += n;
        }
        let every = if self.stalls > self.stalls_synced {
            SYNC_EVERY
        } else {
            SYNC_IDLE_EVERY
        };
        if self.last_sync.elapsed() >= every {
            self.sync()?;
        }
        Ok(())
    }

    fn write(&mut self, buf: &[u8]) -> Result<(), JournalError> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.write(&buf[done..]) {
                Ok(0) => return Err(self.error(io::ErrorKind::WriteZero.into())),
                Ok(k) => {
                    done += k;
                    self.written += k as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.error(e)),
            }
        }
        Ok(())
    }

    pub fn sync(&mut self) -> Result<(), JournalError> {
        self.last_sync = Instant::now();
        self.stalls_synced = self.stalls;
        self.file.sync_data().map_err(|e| self.error(e))
    }

    fn error(&self, source: io::Error) -> JournalError {
        JournalError::Write {
            path: self.dir.join(NAME),
            dir: self.dir.clone(),
            source,
            written: self.written,
            stalls: self.stalls,
        }
    }
}

/// A recording rebuilt from a journal, and what the reader had to drop.
pub struct Rebuilt {
    pub recording: Recording,
    /// Bytes at the end that were not a whole line (a cut write).
    pub damaged_tail: usize,
}

/// Reads `path` (a `stalls.journal`) into a [`Recording`], stalls in start
/// order. The counters only the end of a recording knows (kernel drops, lost
/// events) are absent.
pub fn read(path: &Path) -> Result<Rebuilt, JournalError> {
    let bytes = std::fs::read(path).map_err(|source| JournalError::Read {
        path: path.into(),
        source,
    })?;
    let not = |why: String| JournalError::NotJournal {
        path: path.into(),
        why,
    };
    let mut header: Option<Header> = None;
    let mut meta = Meta::default();
    let mut facts: Vec<Facts> = Vec::new();
    let mut frames: Vec<Frame> = Vec::new();
    let mut stacks: Vec<Vec<Frame>> = Vec::new();
    let mut stalls = Vec::new();
    let mut pos = 0;
    let mut damaged_tail = 0;
    while pos < bytes.len() {
        let end = bytes[pos..]
            .iter()
            .position(|&b| b == b'\n')
            .map(|i| pos + i);
        let line = &bytes[pos..end.unwrap_or(bytes.len())];
        let parsed = serde_json::from_slice::<Line>(line);
        let (Some(end), Ok(parsed)) = (end, parsed) else {
            // Only the last line may be cut; a bad line before it is damage.
            if end.is_some_and(|e| e + 1 < bytes.len()) {
                return Err(not(format!("line at byte {pos} is damaged")));
            }
            damaged_tail = bytes.len() - pos;
            break;
        };
        pos = end + 1;
        match parsed {
            Line::Header(h) => {
                if h.format != FORMAT {
                    return Err(not(format!("its format is {:?}", h.format)));
                }
                if h.version > VERSION {
                    return Err(not(format!(
                        "it is journal version {}, newer than this stallprof reads ({VERSION}); use a newer stallprof",
                        h.version
                    )));
                }
                meta.comm = h.comm.clone();
                meta.ended_ns = h.started_ns;
                header = Some(h);
            }
            _ if header.is_none() => return Err(not("it does not start with a header".into())),
            // A pid's first line wins (the process as first seen); a later
            // one can only add that it ran a loop.
            Line::Process(f) => match facts.iter_mut().find(|p| p.pid == f.pid) {
                Some(p) => p.ran_loop |= f.ran_loop,
                None => facts.push(f),
            },
            Line::Frames(f) => frames.extend(f),
            Line::Stacks(s) => {
                for ids in s {
                    let st = ids
                        .iter()
                        .map(|&id| {
                            frames.get(id as usize).cloned().ok_or(FormatError::BadId {
                                what: "frame",
                                id,
                                len: frames.len(),
                            })
                        })
                        .collect::<Result<_, _>>()
                        .map_err(|source| JournalError::Format {
                            path: path.into(),
                            source,
                        })?;
                    stacks.push(st);
                }
            }
            Line::Stall(w) => {
                let s = json::model_stall(w, |id| {
                    stacks.get(id as usize).cloned().ok_or(FormatError::BadId {
                        what: "stack",
                        id,
                        len: stacks.len(),
                    })
                })
                .map_err(|source| JournalError::Format {
                    path: path.into(),
                    source,
                })?;
                meta.ended_ns = meta.ended_ns.max(s.end_ns);
                stalls.push(s);
            }
            Line::Meta(m) => {
                let ended = meta.ended_ns.max(m.ended_ns);
                meta = m;
                meta.ended_ns = ended;
            }
        }
    }
    let h = header.ok_or_else(|| not("it is empty".into()))?;
    stalls.sort_by_key(|s: &Stall| (s.start_ns, s.tid));
    Ok(Rebuilt {
        recording: Recording {
            pid: h.pid,
            comm: meta.comm,
            process: meta.process,
            threshold_ns: h.threshold_ns,
            sample_hz: h.sample_hz,
            sample_after_ns: h.sample_after_ns,
            kernel_filtered: Default::default(),
            busy_periods: meta.busy_periods,
            clock: h.clock,
            started_ns: h.started_ns,
            ended_ns: meta.ended_ns,
            lost_events: 0,
            drops: Default::default(),
            executor_threads: meta.executor_threads,
            stallprof_version: h.stallprof_version,
            runtime_problems: meta.runtime_problems,
            probes: Default::default(),
            cpu_quota: meta.cpu_quota,
            app_paths: h.app_paths,
            processes: Process::from_facts(&facts),
            stalls,
        }
        .completed(),
        damaged_tail,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{FrameKind, PartKind};
    use crate::testing;

    /// The header of a journal of pid 1 (`c`), 50 ns threshold, started at
    /// 10 ns.
    pub(crate) fn header() -> Header {
        Header {
            format: FORMAT.into(),
            version: VERSION,
            pid: 1,
            comm: "c".into(),
            threshold_ns: 50,
            sample_hz: 999,
            sample_after_ns: 0,
            clock: "monotonic".into(),
            started_ns: 10,
            stallprof_version: "t".into(),
            app_paths: Vec::new(),
        }
    }

    pub(crate) fn stall(start: u64, f: &str) -> Stall {
        let frames = vec![
            Frame::new("main", FrameKind::Native),
            Frame::new(f, FrameKind::Native),
        ];
        Stall {
            tid: 7,
            ..testing::stall(start, vec![testing::part(PartKind::OnCpu, 100, frames)])
        }
    }

    #[test]
    fn round_trip_and_a_cut_tail() {
        let root = std::env::temp_dir().join(format!(
            "stallprof-journal-{}",
            crate::os::outdir::random_suffix()
        ));
        let dir = OutDir::create_new(&root).unwrap();
        let mut j = JournalWriter::create(&dir, header()).unwrap();
        let (a, b, c) = (stall(300, "spin"), stall(100, "spin"), stall(500, "sleep"));
        j.append(&[], [&a, &b], None).unwrap();
        j.append(
            &[],
            [&c],
            Some(Meta {
                comm: "victim".into(),
                ended_ns: 900,
                process: ProcessInfo {
                    ns_pid: Some(1),
                    container: crate::os::container::from_path(
                        "/system.slice/docker-3f2a9c0b1d4e5f60718293a4b5c6d7e8f90123456789abcdef0123456789abcd.scope",
                    ),
                },
                ..Default::default()
            }),
        )
        .unwrap();
        let path = root.join(NAME);
        let r = read(&path).unwrap();
        assert_eq!(r.recording.stalls, vec![b.clone(), a.clone(), c.clone()]);
        assert_eq!(
            (r.recording.comm.as_str(), r.recording.ended_ns),
            ("victim", 900)
        );
        // The target's namespace pid and container survive a crash too.
        assert_eq!(r.recording.process.ns_pid, Some(1));
        assert_eq!(
            r.recording
                .process
                .container
                .as_ref()
                .and_then(|c| c.short_id()),
            Some("3f2a9c0b1d4e")
        );
        assert_eq!(r.damaged_tail, 0);
        // A write cut in the middle of a line (kill -9, disk full).
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(b"{\"stall\":{\"tid\":7,\"thre");
        std::fs::write(&path, &bytes).unwrap();
        let r = read(&path).unwrap();
        assert_eq!(r.recording.stalls.len(), 3);
        assert!(r.damaged_tail > 0);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
