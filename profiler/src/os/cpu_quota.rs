//! A process's CPU bandwidth limit (its cgroup's CFS quota) and the
//! cgroup's own throttling counters.
//!
//! In: `/proc/PID/cgroup` and `/proc/self/mountinfo` (capped reads,
//! [`super::limits`]), then the cgroup's files: on cgroup v2 `cpu.max`
//! (`QUOTA PERIOD`, or `max PERIOD`) and `cpu.stat` (`nr_periods`,
//! `nr_throttled`, `throttled_usec`); on cgroup v1's cpu controller
//! `cpu.cfs_quota_us` (-1 = none), `cpu.cfs_period_us` and `cpu.stat`
//! (`nr_periods`, `nr_throttled`, `throttled_time` in ns). Out: a
//! [`CpuQuota`] — the cgroup that limits the process (its own, or the
//! nearest ancestor with a quota: a limit set on a pod's cgroup throttles
//! its containers) and a [`Throttling`] snapshot of its counters — or
//! nothing when no cgroup on the way up sets a quota.
//!
//! Read twice by `record` (at attach and at the end), so the recording
//! says how often and how long the kernel throttled that cgroup while it
//! ran; the per-stall `throttled` parts are cross-checked against it. The
//! cgroup's counters are the whole group's (every thread, every CPU, idle
//! loop time included), the stalls' only their loop threads': the two agree
//! when the loop thread is what uses the quota.
//!
//! The v2 line (`0::PATH`) of `/proc/PID/cgroup` is used when the unified
//! hierarchy has the cpu controller (its root's `cgroup.controllers` lists
//! `cpu`); else the v1 line whose controller list has `cpu`. Paths are taken below the mount
//! whose root they start with (`/proc/self/mountinfo`), never outside it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Ancestors walked up from the process's own cgroup looking for a quota.
/// Real hierarchies are under 10 deep (`kubepods/burstable/pod…/…`).
const MAX_DEPTH: usize = 32;
/// A cgroup file we read is one line or a few (`cpu.stat`: ~10 lines).
const CGROUP_FILE_MAX: usize = 4096;

/// Which cgroup hierarchy the limit is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupVersion {
    V1,
    V2,
}

/// The throttling counters of a cgroup at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Throttling {
    /// Enforcement periods that have elapsed with the group runnable.
    pub nr_periods: u64,
    /// Periods in which the group was throttled.
    pub nr_throttled: u64,
    /// Total time the group's run queues spent throttled (summed over CPUs).
    pub throttled_ns: u64,
}

impl Throttling {
    /// What happened between `self` (earlier) and `later`.
    pub fn since(&self, later: &Throttling) -> Throttling {
        Throttling {
            nr_periods: later.nr_periods.saturating_sub(self.nr_periods),
            nr_throttled: later.nr_throttled.saturating_sub(self.nr_throttled),
            throttled_ns: later.throttled_ns.saturating_sub(self.throttled_ns),
        }
    }
}

/// The CPU bandwidth limit of a process, as its cgroup sets it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuQuota {
    pub cgroup_version: CgroupVersion,
    /// The cgroup the limit is set on (relative to its hierarchy's root).
    pub cgroup: String,
    /// CPU time the group may use per period; None = no limit (`max`, -1).
    pub quota_us: Option<u64>,
    pub period_us: u64,
    /// The counters when the recording began.
    pub start: Throttling,
    /// The counters when it ended (None until then, or when the cgroup
    /// could not be read at the end: it was removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<Throttling>,
}

impl CpuQuota {
    /// The counters over the recording, once it ended.
    pub fn during(&self) -> Option<Throttling> {
        self.end.map(|e| self.start.since(&e))
    }

    /// `10ms/100ms` (quota per period), or `none`.
    pub fn describe(&self) -> String {
        match self.quota_us {
            Some(q) => format!("{}/{}", fmt_us(q), fmt_us(self.period_us)),
            None => "none".to_string(),
        }
    }

    /// Read the counters again (the recording's end) from the same cgroup.
    pub fn read_end(&mut self, fs: &CgroupFs) {
        let dir = fs.dir(self.cgroup_version, &self.cgroup);
        self.end = dir.and_then(|d| read_throttling(&d, self.cgroup_version).ok());
    }
}

fn fmt_us(us: u64) -> String {
    if us.is_multiple_of(1000) {
        format!("{}ms", us / 1000)
    } else {
        format!("{}.{:03}ms", us / 1000, us % 1000)
    }
}

#[derive(Debug, Error)]
pub enum QuotaError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not in the expected format ({what}); this kernel's cgroup files differ")]
    Format { path: String, what: &'static str },
}

/// Where the cgroup hierarchies are mounted (`/proc/self/mountinfo`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupFs {
    /// The unified (v2) hierarchy: (mount root, mount point).
    pub v2: Option<(String, PathBuf)>,
    /// The v1 hierarchy that has the cpu controller: (mount root, mount point).
    pub v1_cpu: Option<(String, PathBuf)>,
}

impl CgroupFs {
    /// This host's mounts.
    pub fn of_host() -> CgroupFs {
        super::limits::read_proc("/proc/self/mountinfo")
            .map(|t| CgroupFs::parse(&t))
            .unwrap_or_default()
    }

    /// From the text of `/proc/self/mountinfo`: `ID PARENT MAJ:MIN ROOT
    /// MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS`.
    pub fn parse(mountinfo: &str) -> CgroupFs {
        let mut fs = CgroupFs::default();
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            if l.len() < 5 || r.len() < 3 {
                continue;
            }
            let (root, point) = (unescape(l[3]), PathBuf::from(unescape(l[4])));
            match r[0] {
                "cgroup2" if fs.v2.is_none() => fs.v2 = Some((root, point)),
                "cgroup" if fs.v1_cpu.is_none() && r[2].split(',').any(|o| o == "cpu") => {
                    fs.v1_cpu = Some((root, point))
                }
                _ => {}
            }
        }
        fs
    }

    /// The unified hierarchy has the cpu controller (its root's
    /// `cgroup.controllers` lists `cpu`).
    pub fn v2_has_cpu(&self) -> bool {
        self.v2.as_ref().is_some_and(|(_, point)| {
            std::fs::read_to_string(point.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|w| w == "cpu"))
        })
    }

    /// The directory of `cgroup` (a path as `/proc/PID/cgroup` gives it) in
    /// the hierarchy of `version`; None when it is not under that mount's
    /// root or not mounted.
    pub fn dir(&self, version: CgroupVersion, cgroup: &str) -> Option<PathBuf> {
        let (root, point) = match version {
            CgroupVersion::V1 => self.v1_cpu.as_ref()?,
            CgroupVersion::V2 => self.v2.as_ref()?,
        };
        let rel = cgroup.strip_prefix(root.trim_end_matches('/'))?;
        if !(rel.is_empty() || rel.starts_with('/')) || rel.split('/').any(|c| c == "..") {
            return None;
        }
        Some(point.join(rel.trim_start_matches('/')))
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup paths of a `/proc/PID/cgroup` text: (v2 path, v1 cpu path).
pub fn paths(text: &str) -> (Option<String>, Option<String>) {
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if id == "0" && ctrl.is_empty() {
            v2 = Some(path.to_string());
        } else if ctrl.split(',').any(|c| c == "cpu") {
            v1 = Some(path.to_string());
        }
    }
    (v2, v1)
}

/// `cpu.max`: `QUOTA PERIOD` or `max PERIOD` -> (quota, period) in µs.
pub fn parse_cpu_max(text: &str) -> Option<(Option<u64>, u64)> {
    let mut f = text.split_whitespace();
    let quota = match f.next()? {
        "max" => None,
        q => Some(q.parse().ok()?),
    };
    Some((quota, f.next()?.parse().ok()?))
}

/// `cpu.stat` of either version: v2 gives `throttled_usec`, v1
/// `throttled_time` (ns).
pub fn parse_cpu_stat(text: &str, version: CgroupVersion) -> Option<Throttling> {
    let mut t = Throttling::default();
    let mut seen = 0;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(' ') else {
            continue;
        };
        let Ok(v) = v.trim().parse::<u64>() else {
            continue;
        };
        match (k, version) {
            ("nr_periods", _) => t.nr_periods = v,
            ("nr_throttled", _) => t.nr_throttled = v,
            ("throttled_usec", CgroupVersion::V2) => t.throttled_ns = v.saturating_mul(1000),
            ("throttled_time", CgroupVersion::V1) => t.throttled_ns = v,
            _ => continue,
        }
        seen += 1;
    }
    (seen == 3).then_some(t)
}

fn read_small(path: &Path) -> Result<String, QuotaError> {
    use std::io::Read;
    let mut s = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(CGROUP_FILE_MAX as u64).read_to_string(&mut s))
        .map_err(|source| QuotaError::Read {
            path: path.display().to_string(),
            source,
        })?;
    Ok(s)
}

fn read_throttling(dir: &Path, version: CgroupVersion) -> Result<Throttling, QuotaError> {
    let path = dir.join("cpu.stat");
    parse_cpu_stat(&read_small(&path)?, version).ok_or(QuotaError::Format {
        path: path.display().to_string(),
        what: "nr_periods, nr_throttled and the throttled time",
    })
}

/// `path` and its ancestors up to the root, innermost first, at most
/// [`MAX_DEPTH`].
fn ancestors(path: &str) -> Vec<String> {
    let mut out = vec![path.to_string()];
    let mut p = path.trim_end_matches('/');
    while let Some((parent, _)) = p.rsplit_once('/') {
        if out.len() >= MAX_DEPTH {
            break;
        }
        out.push(if parent.is_empty() { "/" } else { parent }.to_string());
        p = parent;
    }
    out.dedup();
    out
}

/// (quota, period) set on the cgroup at `dir`.
fn read_limit(dir: &Path, version: CgroupVersion) -> Result<(Option<u64>, u64), QuotaError> {
    match version {
        CgroupVersion::V2 => {
            let path = dir.join("cpu.max");
            parse_cpu_max(&read_small(&path)?).ok_or(QuotaError::Format {
                path: path.display().to_string(),
                what: "`QUOTA PERIOD` or `max PERIOD`",
            })
        }
        CgroupVersion::V1 => {
            let num = |name: &str| -> Result<i64, QuotaError> {
                let path = dir.join(name);
                read_small(&path)?
                    .trim()
                    .parse()
                    .map_err(|_| QuotaError::Format {
                        path: path.display().to_string(),
                        what: "one integer",
                    })
            };
            let quota = num("cpu.cfs_quota_us")?;
            let period = num("cpu.cfs_period_us")?;
            Ok(((quota >= 0).then_some(quota as u64), period.max(0) as u64))
        }
    }
}

/// The CPU limit of `pid`: the innermost cgroup from its own up that has a
/// quota, with its counters. Ok(None) when none has one, or the process
/// has no cpu-controlled cgroup we can see (no cpu controller mounted, or
/// it is gone).
pub fn of_process(pid: u32, fs: &CgroupFs) -> Result<Option<CpuQuota>, QuotaError> {
    let Ok(text) = super::limits::read_proc(&format!("/proc/{pid}/cgroup")) else {
        return Ok(None);
    };
    let (v2, v1) = paths(&text);
    let candidates = [(CgroupVersion::V2, v2), (CgroupVersion::V1, v1)];
    for (version, path) in candidates {
        let Some(path) = path else { continue };
        if fs.dir(version, &path).is_none() {
            continue;
        }
        let probe = match version {
            CgroupVersion::V2 => "cpu.max",
            CgroupVersion::V1 => "cpu.cfs_quota_us",
        };
        // The unified hierarchy without the cpu controller (a hybrid
        // host's /sys/fs/cgroup/unified: its root lists other controllers)
        // has a `cpu.stat` of usage only and no quota files: try v1.
        if version == CgroupVersion::V2 && !fs.v2_has_cpu() {
            continue;
        }
        let mut limited = None;
        for cgroup in ancestors(&path) {
            if let Some(dir) = fs.dir(version, &cgroup)
                && dir.join(probe).exists()
                && let (Some(quota), period) = read_limit(&dir, version)?
            {
                limited = Some((cgroup, dir, Some(quota), period));
                break;
            }
        }
        // No quota on the way up: nothing limits it (the root cgroup's
        // counters, if any, are not a limit's).
        let Some((cgroup, dir, quota, period)) = limited else {
            return Ok(None);
        };
        let start = read_throttling(&dir, version)?;
        return Ok(Some(CpuQuota {
            cgroup_version: version,
            cgroup,
            quota_us: quota,
            period_us: period,
            start,
            end: None,
        }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
25 30 0:23 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate
33 25 0:31 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu
34 25 0:32 / /sys/fs/cgroup/cpuacct rw,nosuid - cgroup cgroup rw,cpuacct
";

    #[test]
    fn finds_the_v1_cpu_and_v2_mounts() {
        let fs = CgroupFs::parse(MOUNTINFO);
        assert_eq!(
            fs.v1_cpu,
            Some(("/".into(), PathBuf::from("/sys/fs/cgroup/cpu")))
        );
        assert_eq!(
            fs.dir(CgroupVersion::V1, "/svc/a"),
            Some(PathBuf::from("/sys/fs/cgroup/cpu/svc/a"))
        );
        assert_eq!(
            fs.dir(CgroupVersion::V2, "/"),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        // `cpuacct` is not `cpu`.
        let only_acct = CgroupFs::parse(&MOUNTINFO.replace("rw,cpu\n", "rw,x\n"));
        assert_eq!(only_acct.v1_cpu, None);
    }

    /// A mount of a sub-hierarchy (a container's view) only reaches paths
    /// under its root; `..` never leaves it.
    #[test]
    fn paths_stay_under_their_mount_root() {
        let fs = CgroupFs {
            v2: Some(("/kubepods".into(), PathBuf::from("/sys/fs/cgroup"))),
            v1_cpu: None,
        };
        assert_eq!(
            fs.dir(CgroupVersion::V2, "/kubepods/pod1/c"),
            Some(PathBuf::from("/sys/fs/cgroup/pod1/c"))
        );
        assert_eq!(fs.dir(CgroupVersion::V2, "/other/x"), None);
        assert_eq!(fs.dir(CgroupVersion::V2, "/kubepodsX"), None);
        assert_eq!(fs.dir(CgroupVersion::V2, "/kubepods/../etc"), None);
        assert_eq!(fs.dir(CgroupVersion::V1, "/"), None);
    }

    #[test]
    fn reads_both_cgroup_lines() {
        let text = "12:cpu,cpuacct:/docker/ab\n4:memory:/m\n0::/system.slice/x.service\n";
        assert_eq!(
            paths(text),
            (
                Some("/system.slice/x.service".into()),
                Some("/docker/ab".into())
            )
        );
        assert_eq!(paths("1:cpuacct:/a\n"), (None, None));
    }

    #[test]
    fn parses_cpu_max() {
        assert_eq!(parse_cpu_max("10000 100000\n"), Some((Some(10000), 100000)));
        assert_eq!(parse_cpu_max("max 100000\n"), Some((None, 100000)));
        assert_eq!(parse_cpu_max("garbage\n"), None);
    }

    /// v1 counts throttled time in ns, v2 in µs; both name the periods.
    #[test]
    fn parses_cpu_stat_of_both_versions() {
        let v1 = "nr_periods 15\nnr_throttled 14\nthrottled_time 1160811944\nnr_bursts 0\nburst_time 0\n";
        assert_eq!(
            parse_cpu_stat(v1, CgroupVersion::V1),
            Some(Throttling {
                nr_periods: 15,
                nr_throttled: 14,
                throttled_ns: 1_160_811_944
            })
        );
        let v2 = "usage_usec 5\nuser_usec 3\nsystem_usec 2\nnr_periods 7\nnr_throttled 2\nthrottled_usec 1500\nnr_bursts 0\n";
        assert_eq!(
            parse_cpu_stat(v2, CgroupVersion::V2),
            Some(Throttling {
                nr_periods: 7,
                nr_throttled: 2,
                throttled_ns: 1_500_000
            })
        );
        // A v2 file read as v1 lacks `throttled_time`: refused, not zero.
        assert_eq!(parse_cpu_stat(v2, CgroupVersion::V1), None);
    }

    #[test]
    fn describes_the_quota_and_the_counters_over_the_recording() {
        let q = CpuQuota {
            cgroup_version: CgroupVersion::V1,
            cgroup: "/a".into(),
            quota_us: Some(10_000),
            period_us: 100_000,
            start: Throttling {
                nr_periods: 10,
                nr_throttled: 4,
                throttled_ns: 100,
            },
            end: Some(Throttling {
                nr_periods: 30,
                nr_throttled: 20,
                throttled_ns: 1100,
            }),
        };
        assert_eq!(q.describe(), "10ms/100ms");
        assert_eq!(
            q.during(),
            Some(Throttling {
                nr_periods: 20,
                nr_throttled: 16,
                throttled_ns: 1000
            })
        );
        let half = CpuQuota {
            quota_us: Some(2_500),
            ..q
        };
        assert_eq!(half.describe(), "2.500ms/100ms");
    }

    #[test]
    fn walks_up_to_the_root() {
        assert_eq!(ancestors("/a/b"), ["/a/b", "/a", "/"]);
        assert_eq!(ancestors("/"), ["/"]);
    }

    #[test]
    fn unescapes_mount_points() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/plain"), "/plain");
    }
}
