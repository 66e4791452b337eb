//! Service groups: a service's workers, reported together.
//!
//! In: the processes the daemon reports on, as (pid, parent pid, cgroup,
//! executable) rows. Out: [`Service`]s — two or more processes with the
//! same parent, the same cgroup and the same executable (a pre-fork
//! server's workers: uvicorn's, gunicorn's, a Node cluster's, all run the
//! interpreter their parent forked or spawned them with; a C program and a
//! Python one started by one shell are not one service), named after the
//! parent. A process alone under its
//! parent is no group, and neither are children of pid 1 (or of an
//! unknown parent): init adopts orphans and starts the host's services,
//! which are not one service's workers. The grouping is a pure function of
//! the rows; what a process's parent is called is read once, with the
//! process ([`super::procs::ProcInfo`]).
//!
//! The window's reports list each group's stalls together and per worker
//! in `<window>/services.json`; the index page has a services table. The
//! metrics stay per process.
use std::collections::BTreeMap;

use serde::Serialize;

/// Processes with the same parent and cgroup: one service's workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub parent: u32,
    pub cgroup: String,
    pub exe: String,
    /// Ascending.
    pub workers: Vec<u32>,
}

impl Service {
    /// `uvicorn (pid 1200): 2 workers`.
    pub fn name(&self, parent_comm: &str) -> String {
        format!(
            "{} (pid {}): {} workers",
            if parent_comm.is_empty() {
                "?"
            } else {
                parent_comm
            },
            self.parent,
            self.workers.len()
        )
    }
}

/// The service groups among `rows` of (pid, parent pid, cgroup,
/// executable), by parent pid, cgroup, executable. A pid listed twice
/// (reused within a window) counts once.
pub fn services(rows: &[(u32, u32, &str, &str)]) -> Vec<Service> {
    let mut by: BTreeMap<(u32, &str, &str), Vec<u32>> = BTreeMap::new();
    for &(pid, ppid, cgroup, exe) in rows {
        if ppid > 1 {
            by.entry((ppid, cgroup, exe)).or_default().push(pid);
        }
    }
    by.into_iter()
        .filter_map(|((parent, cgroup, exe), mut workers)| {
            workers.sort_unstable();
            workers.dedup();
            (workers.len() >= 2).then(|| Service {
                parent,
                cgroup: cgroup.to_string(),
                exe: exe.to_string(),
                workers,
            })
        })
        .collect()
}

impl Service {
    /// Is this one of its workers?
    pub fn has(&self, pid: u32, ppid: u32, cgroup: &str, exe: &str) -> bool {
        ppid == self.parent
            && cgroup == self.cgroup
            && exe == self.exe
            && self.workers.contains(&pid)
    }
}

/// One worker's stalls in a window, as `services.json` lists them.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerStalls {
    pub pid: u32,
    pub comm: String,
    /// Its report directory in the window; absent when it did not stall.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<String>,
    pub stalls: usize,
    pub stall_ns: u64,
    pub worst_ns: u64,
}

/// One service group in a window: its workers' stalls together, then each
/// worker's.
#[derive(Debug, Clone, Serialize)]
pub struct ServiceStalls {
    /// `uvicorn (pid 1200): 2 workers`.
    pub name: String,
    pub parent_pid: u32,
    pub parent_comm: String,
    /// The parent's own report directory in the window, when it stalled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_dir: Option<String>,
    pub cgroup: String,
    pub stalls: usize,
    pub stall_ns: u64,
    pub worst_ns: u64,
    pub workers: Vec<WorkerStalls>,
}

/// `services.json`: the window's service groups that stalled.
#[derive(Debug, Clone, Serialize)]
pub struct ServicesFile {
    pub services: Vec<ServiceStalls>,
}

/// A process as [`window_services`] needs it: who it is, and its report
/// in the window when it stalled.
pub struct Known<'a> {
    pub pid: u32,
    pub ppid: u32,
    pub cgroup: &'a str,
    pub exe: &'a str,
    pub comm: &'a str,
    pub parent_comm: &'a str,
    /// (report directory, stalls, stall time, worst stall) in the window.
    pub report: Option<(&'a str, usize, u64, u64)>,
}

/// The window's groups with at least one stall, from every process the
/// daemon reports on (a worker that did not stall in the window is listed
/// with none): heaviest stall time first.
pub fn window_services(known: &[Known]) -> ServicesFile {
    let rows: Vec<(u32, u32, &str, &str)> = known
        .iter()
        .map(|k| (k.pid, k.ppid, k.cgroup, k.exe))
        .collect();
    let of = |pid: u32| known.iter().filter(move |k| k.pid == pid);
    let mut out: Vec<ServiceStalls> = services(&rows)
        .into_iter()
        .filter_map(|svc| {
            let workers: Vec<WorkerStalls> = svc
                .workers
                .iter()
                .map(|&pid| {
                    // A reused pid: its processes' stalls together.
                    let mut w = WorkerStalls {
                        pid,
                        comm: String::new(),
                        dir: None,
                        stalls: 0,
                        stall_ns: 0,
                        worst_ns: 0,
                    };
                    for k in of(pid).filter(|k| svc.has(k.pid, k.ppid, k.cgroup, k.exe)) {
                        if w.comm.is_empty() {
                            w.comm = k.comm.to_string();
                        }
                        if let Some((dir, n, ns, worst)) = k.report {
                            w.dir.get_or_insert_with(|| dir.to_string());
                            w.stalls += n;
                            w.stall_ns += ns;
                            w.worst_ns = w.worst_ns.max(worst);
                        }
                    }
                    w
                })
                .collect();
            if workers.iter().all(|w| w.stalls == 0) {
                return None;
            }
            let parent_comm = of(svc.workers[0])
                .map(|k| k.parent_comm)
                .find(|c| !c.is_empty())
                .unwrap_or("")
                .to_string();
            Some(ServiceStalls {
                name: svc.name(&parent_comm),
                parent_pid: svc.parent,
                parent_dir: of(svc.parent).find_map(|k| k.report.map(|r| r.0.to_string())),
                parent_comm,
                cgroup: svc.cgroup.clone(),
                stalls: workers.iter().map(|w| w.stalls).sum(),
                stall_ns: workers.iter().map(|w| w.stall_ns).sum(),
                worst_ns: workers.iter().map(|w| w.worst_ns).max().unwrap_or(0),
                workers,
            })
        })
        .collect();
    out.sort_by(|a, b| {
        b.stall_ns
            .cmp(&a.stall_ns)
            .then(a.parent_pid.cmp(&b.parent_pid))
    });
    ServicesFile { services: out }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// uvicorn (1200) with two workers in its cgroup; a sidecar forked by
    /// the same parent into another cgroup, and a helper running another
    /// program in the same; a lone child; two orphans adopted by init; a
    /// pid listed twice.
    #[test]
    fn workers_of_one_parent_and_cgroup_are_one_service() {
        let (app, py) = ("/system.slice/app.service", "/usr/bin/python3.11");
        let rows = [
            (1200, 1, app, py),
            (1201, 1200, app, py),
            (1202, 1200, app, py),
            (1202, 1200, app, py),
            (1203, 1200, "/system.slice/sidecar.service", py),
            (1204, 1200, app, "/usr/bin/redis-server"),
            (1300, 1299, app, py),
            (2001, 1, "/user.slice", py),
            (2002, 1, "/user.slice", py),
            (2100, 0, "", ""),
            (2101, 0, "", ""),
        ];
        let s = services(&rows);
        assert_eq!(
            s,
            [Service {
                parent: 1200,
                cgroup: app.into(),
                exe: py.into(),
                workers: vec![1201, 1202],
            }]
        );
        assert!(s[0].has(1201, 1200, app, py));
        assert!(!s[0].has(1204, 1200, app, "/usr/bin/redis-server"));
        assert_eq!(s[0].name("uvicorn"), "uvicorn (pid 1200): 2 workers");
        assert_eq!(s[0].name(""), "? (pid 1200): 2 workers");
        // Two services under one parent, split by cgroup.
        let rows = [
            (11, 10, "/a", "node"),
            (12, 10, "/a", "node"),
            (13, 10, "/b", "node"),
            (14, 10, "/b", "node"),
        ];
        let s = services(&rows);
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].cgroup.as_str(), &s[0].workers[..]),
            ("/a", &[11, 12][..])
        );
        assert_eq!(
            (s[1].cgroup.as_str(), &s[1].workers[..]),
            ("/b", &[13, 14][..])
        );
    }

    /// A window's groups: the workers' stalls together and each worker's,
    /// one worker without a stall listed all the same; a group with no
    /// stall in the window is left out.
    #[test]
    fn window_lists_groups_that_stalled() {
        let k = |pid, ppid, comm, parent_comm, report| Known {
            pid,
            ppid,
            cgroup: "/app",
            exe: "/usr/bin/python3.11",
            comm,
            parent_comm,
            report,
        };
        let known = [
            k(
                1200,
                1,
                "uvicorn",
                "systemd",
                Some(("uvicorn-1200", 1, 60, 60)),
            ),
            k(
                1201,
                1200,
                "python3",
                "uvicorn",
                Some(("python3-1201", 3, 900, 500)),
            ),
            k(1202, 1200, "python3", "uvicorn", None),
            k(
                1203,
                1200,
                "python3",
                "uvicorn",
                Some(("python3-1203", 1, 100, 100)),
            ),
            k(1401, 1400, "node", "node", None),
            k(1402, 1400, "node", "node", None),
        ];
        let f = window_services(&known);
        assert_eq!(f.services.len(), 1, "{f:?}");
        let s = &f.services[0];
        assert_eq!(s.name, "uvicorn (pid 1200): 3 workers");
        assert_eq!((s.stalls, s.stall_ns, s.worst_ns), (4, 1000, 500));
        assert_eq!(s.parent_dir.as_deref(), Some("uvicorn-1200"));
        let w: Vec<(u32, Option<&str>, usize)> = s
            .workers
            .iter()
            .map(|w| (w.pid, w.dir.as_deref(), w.stalls))
            .collect();
        assert_eq!(
            w,
            [
                (1201, Some("python3-1201"), 3),
                (1202, None, 0),
                (1203, Some("python3-1203"), 1)
            ]
        );
        let json = serde_json::to_string(&f).unwrap();
        assert!(
            json.contains(r#""name":"uvicorn (pid 1200): 3 workers""#),
            "{json}"
        );
    }
}
