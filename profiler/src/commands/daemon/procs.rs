//! What the daemon knows of a process: identity and labels, read from /proc.
//!
//! In: a pid and the engine's descriptor of it (namespace pid, container:
//! [`ProcessInfo`], the one reading of its container). Out: [`ProcInfo`] —
//! comm, exe, cgroup (v2 path), its parent (pid and comm: a service's
//! workers share both, see `services`), the container and pod it runs in,
//! and a runtime guess. A process is identified by (pid, start time): a reused
//! pid has a new start time, an exec'd one a new exe.
use std::{
    collections::{HashMap, HashSet},
    fs,
    path::PathBuf,
};

use crate::model::ProcessInfo;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    /// Field 22 of /proc/PID/stat (clock ticks since boot): with the pid,
    /// a process's identity across pid reuse.
    pub start_ticks: u64,
    pub comm: String,
    pub exe: String,
    pub cgroup: String,
    /// The parent's pid when the process was read (0: unknown).
    pub ppid: u32,
    /// The parent's comm when the process was read ("" when unknown).
    pub parent_comm: String,
    /// Its namespace pid and container, from the engine.
    pub process: ProcessInfo,
    /// `cpython`, `node`, `libuv` or `native`.
    pub runtime: String,
}

pub use crate::os::proc::start_ticks;

pub fn exe_of(pid: u32) -> String {
    fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The cgroup v2 path (`0::/…`), or the first v1 line's path.
fn cgroup_of(pid: u32) -> String {
    let text = crate::os::limits::read_proc(&format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let pick = text
        .lines()
        .find(|l| l.starts_with("0::"))
        .or_else(|| text.lines().next())
        .unwrap_or("");
    pick.splitn(3, ':').nth(2).unwrap_or("").to_string()
}

fn runtime_of(pid: u32, exe: &str, comm: &str) -> String {
    let base = exe.rsplit('/').next().unwrap_or(exe);
    if base.starts_with("python") || comm.starts_with("python") {
        return "cpython".into();
    }
    if base == "node" || base == "nodejs" {
        return "node".into();
    }
    let maps = crate::os::maps::read_text(pid).unwrap_or_default();
    if maps.contains("/libpython3") {
        "cpython".into()
    } else if maps.contains("/libuv.so") {
        "libuv".into()
    } else {
        "native".into()
    }
}

/// What a left-out process was judged on that can change while it lives:
/// when any of it has, it is judged again (a reused pid has a new start
/// time, an exec'd process a new exe, a process a runtime moves into a
/// container's cgroup after its first wait a new cgroup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judged {
    start_ticks: u64,
    exe: String,
    cgroup: String,
}

impl Judged {
    pub fn of(info: &ProcInfo) -> Judged {
        Judged {
            start_ticks: info.start_ticks,
            exe: info.exe.clone(),
            cgroup: info.cgroup.clone(),
        }
    }

    /// Has `pid` changed since (or gone)? Three small /proc reads.
    pub fn changed(&self, pid: u32) -> bool {
        start_ticks(pid) != Some(self.start_ticks)
            || (!self.exe.is_empty() && exe_of(pid) != self.exe)
            || cgroup_of(pid) != self.cgroup
    }
}

/// Left-out processes [`Judged::changed`] looks at per second: three /proc
/// reads each (24–41 µs on the test VM, docs/daemon.md), so with hundreds
/// left out (every process that waits, under an include rule) the look
/// goes round them over several seconds instead of costing a share of a
/// core.
pub const JUDGED_CHECKS: usize = 64;

/// The next at most `n` of `pids` to look at after `after`, the last one
/// looked at: in pid order, from the first above it, wrapping round.
pub fn next_checks(mut pids: Vec<u32>, after: u32, n: usize) -> Vec<u32> {
    pids.sort_unstable();
    let from = pids.partition_point(|&p| p <= after);
    pids.rotate_left(from);
    pids.truncate(n);
    pids
}

/// Upkeeps (250 ms apart) during which a new process is looked at again
/// (see [`NewProcesses`]).
const YOUNG_TICKS: u32 = 8;

/// The processes on the host the daemon has not looked at yet, from a
/// readdir of /proc at each upkeep: each new pid once, then again during
/// its first [`YOUNG_TICKS`] upkeeps when its executable has changed since
/// the look (a launcher such as chroot, unshare or a container runtime's
/// init exec'd the program) or the look found no C library (the program
/// has exec'd but its loader has not mapped its libraries yet: on a cold
/// page cache that takes long enough for an upkeep to fall in it). An old
/// process costs no system call here.
#[derive(Default)]
pub struct NewProcesses {
    scanned: HashSet<u32>,
    young: HashMap<u32, Young>,
}

struct Young {
    exe: Option<PathBuf>,
    ticks: u32,
    c_library: bool,
}

/// A process to look at: its pid, and its executable as the scan read it
/// (handed back with the look's outcome, [`NewProcesses::looked`]).
#[derive(Debug, PartialEq, Eq)]
pub struct Look {
    pub pid: u32,
    pub exe: Option<PathBuf>,
    /// A look after its executable changed (an exec): judged again.
    pub exec: bool,
    ticks: u32,
}

impl NewProcesses {
    /// The processes to look at now, and the pids gone since the last scan.
    pub fn scan(&mut self) -> (Vec<Look>, Vec<u32>) {
        let Ok(dir) = fs::read_dir("/proc") else {
            return (Vec::new(), Vec::new());
        };
        let live = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok());
        self.step(live, crate::os::proc::exe)
    }

    /// [`NewProcesses::scan`] of the `live` pids, reading an executable
    /// with `exe_of`.
    fn step(
        &mut self,
        live: impl Iterator<Item = u32>,
        exe_of: impl Fn(u32) -> Option<PathBuf>,
    ) -> (Vec<Look>, Vec<u32>) {
        let mut looks = Vec::new();
        let mut now = HashSet::new();
        for pid in live {
            now.insert(pid);
            if !self.scanned.contains(&pid) {
                looks.push(Look {
                    pid,
                    exe: exe_of(pid),
                    exec: false,
                    ticks: 0,
                });
                continue;
            }
            let Some(y) = self.young.get_mut(&pid) else {
                continue;
            };
            let exe = exe_of(pid);
            if y.exe != exe {
                log::debug!("pid {pid} exec'd {exe:?} since it was looked at: looking again");
                looks.push(Look {
                    pid,
                    exe,
                    exec: true,
                    ticks: 0,
                });
                continue;
            }
            y.ticks += 1;
            if y.ticks >= YOUNG_TICKS {
                self.young.remove(&pid);
            } else if !y.c_library {
                looks.push(Look {
                    pid,
                    exe,
                    exec: false,
                    ticks: y.ticks,
                });
            }
        }
        let gone: Vec<u32> = self.scanned.difference(&now).copied().collect();
        self.young.retain(|pid, _| now.contains(pid));
        self.scanned = now;
        (looks, gone)
    }

    /// What a look found: whether `look.pid` maps a C library (or needs no
    /// look again for another reason).
    pub fn looked(&mut self, look: Look, c_library: bool) {
        self.young.insert(
            look.pid,
            Young {
                exe: look.exe,
                ticks: look.ticks,
                c_library,
            },
        );
    }

    /// Look at `pid` again at the next scan, as a new process (an exited
    /// process's pid whose reuse the scan cannot tell apart).
    pub fn forget(&mut self, pid: u32) {
        self.scanned.remove(&pid);
        self.young.remove(&pid);
    }
}

impl ProcInfo {
    /// Read a live process (`process`: the engine's descriptor of it);
    /// None if it is gone.
    pub fn read(pid: u32, process: ProcessInfo) -> Option<ProcInfo> {
        let start_ticks = start_ticks(pid)?;
        let comm = crate::os::limits::read_proc(&format!("/proc/{pid}/comm"))
            .ok()?
            .trim_end()
            .to_string();
        let exe = exe_of(pid);
        let cgroup = cgroup_of(pid);
        let runtime = runtime_of(pid, &exe, &comm);
        let ppid = crate::os::proc::parent_pid(pid).unwrap_or(0);
        let parent_comm = match ppid {
            0 => None,
            p => crate::os::proc::read_comm(p, p),
        };
        Some(ProcInfo {
            pid,
            start_ticks,
            comm,
            exe,
            cgroup,
            ppid,
            parent_comm: parent_comm.unwrap_or_default(),
            process,
            runtime,
        })
    }

    /// A process that was gone before it could be read: named after the
    /// thread the stall came from.
    pub fn gone(pid: u32, thread_name: &str) -> ProcInfo {
        ProcInfo {
            pid,
            start_ticks: 0,
            comm: thread_name.to_string(),
            exe: String::new(),
            cgroup: String::new(),
            ppid: 0,
            parent_comm: String::new(),
            process: ProcessInfo::default(),
            runtime: "unknown".into(),
        }
    }

    /// The short (12 hex digit) container id, or "" outside a container.
    pub fn container(&self) -> &str {
        self.process
            .container
            .as_ref()
            .and_then(|c| c.short_id())
            .unwrap_or("")
    }

    /// The full container id, or "".
    pub fn container_id(&self) -> &str {
        self.process
            .container
            .as_ref()
            .and_then(|c| c.id.as_deref())
            .unwrap_or("")
    }

    /// The Kubernetes pod uid, or "" outside a pod.
    pub fn pod(&self) -> &str {
        self.process
            .container
            .as_ref()
            .and_then(|c| c.pod_uid.as_deref())
            .unwrap_or("")
    }

    /// A file-system-safe name for its report directory: `comm-pid`.
    pub fn dir_name(&self) -> String {
        let comm: String = self
            .comm
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("{comm}-{}", self.pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_and_pod() {
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let mut p = ProcInfo::gone(1, "x");
        assert_eq!((p.container(), p.container_id(), p.pod()), ("", "", ""));
        p.process.container = crate::os::container::from_path(&format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod8e1f0c2a_3b4d_4e5f_9a6b_7c8d9e0f1a2b.slice/cri-containerd-{id}.scope"
        ));
        assert_eq!(p.container(), "0123456789ab");
        assert_eq!(p.container_id(), id);
        assert_eq!(p.pod(), "8e1f0c2a-3b4d-4e5f-9a6b-7c8d9e0f1a2b");
    }

    #[test]
    fn reads_itself() {
        let me = ProcInfo::read(std::process::id(), ProcessInfo::default()).unwrap();
        assert!(me.start_ticks > 0);
        assert!(!me.comm.is_empty());
        assert!(me.exe.starts_with('/'));
    }

    /// The looks go round every left-out process, a budget a second.
    #[test]
    fn checks_go_round_the_left_out() {
        let pids = vec![40, 10, 30, 20, 50];
        assert_eq!(next_checks(pids.clone(), 0, 2), [10, 20]);
        assert_eq!(next_checks(pids.clone(), 20, 2), [30, 40]);
        assert_eq!(next_checks(pids.clone(), 40, 2), [50, 10]);
        assert_eq!(next_checks(pids.clone(), 25, 9), [30, 40, 50, 10, 20]);
        assert_eq!(next_checks(pids, 99, 1), [10], "past the last: round again");
        assert!(next_checks(Vec::new(), 7, 3).is_empty());
    }

    /// Each new pid is looked at once; a young one again while it shows
    /// no C library, and after an exec; an old one never; gone ones are
    /// said.
    #[test]
    fn new_processes_are_looked_at_while_young() {
        let mut n = NewProcesses::default();
        let exe = |name: &str| Some(PathBuf::from(name));
        let pids = |looks: &[Look]| looks.iter().map(|l| l.pid).collect::<Vec<_>>();
        let (looks, gone) = n.step([1, 2].into_iter(), |_| exe("/bin/sh"));
        assert_eq!((pids(&looks), gone), (vec![1, 2], vec![]));
        let mut it = looks.into_iter();
        n.looked(it.next().unwrap(), true);
        n.looked(it.next().unwrap(), false); // its loader has not mapped libc yet
        let (looks, _) = n.step([1, 2].into_iter(), |_| exe("/bin/sh"));
        assert_eq!(pids(&looks), [2], "only the one without a C library");
        n.looked(looks.into_iter().next().unwrap(), true);
        let (looks, _) = n.step([1, 2].into_iter(), |p| {
            exe(if p == 1 { "/srv/app" } else { "/bin/sh" })
        });
        assert_eq!(pids(&looks), [1]);
        assert!(looks[0].exec, "an exec is judged again");
        n.looked(looks.into_iter().next().unwrap(), true);
        let same = |p: u32| exe(if p == 1 { "/srv/app" } else { "/bin/sh" });
        for _ in 0..YOUNG_TICKS {
            assert!(n.step([1, 2].into_iter(), same).0.is_empty());
        }
        // Past its young ticks, an exec is for the monitored and left-out
        // processes' own checks.
        let (looks, gone) = n.step([1].into_iter(), |_| exe("/usr/bin/other"));
        assert!(looks.is_empty(), "{looks:?}");
        assert_eq!(gone, [2]);
        n.forget(1);
        assert_eq!(pids(&n.step([1].into_iter(), |_| None).0), [1]);
    }

    #[test]
    fn judged_again_when_it_changed() {
        let me = ProcInfo::read(std::process::id(), ProcessInfo::default()).unwrap();
        assert!(!Judged::of(&me).changed(me.pid));
        for (what, changed) in [
            (
                "start time (a reused pid)",
                ProcInfo {
                    start_ticks: me.start_ticks + 1,
                    ..me.clone()
                },
            ),
            (
                "exe (an exec)",
                ProcInfo {
                    exe: "/bin/other".into(),
                    ..me.clone()
                },
            ),
            (
                "cgroup (a move)",
                ProcInfo {
                    cgroup: "/elsewhere".into(),
                    ..me.clone()
                },
            ),
        ] {
            assert!(Judged::of(&changed).changed(me.pid), "{what}");
        }
        // Gone: its start time cannot be read.
        assert!(Judged::of(&me).changed(u32::MAX));
    }
}
