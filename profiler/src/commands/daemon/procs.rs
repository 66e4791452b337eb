//! What the daemon knows of a process: identity and labels, read from /proc.
//!
//! In: a pid. Out: [`ProcInfo`] — comm, exe, cgroup (v2 path), container id
//! (from the cgroup path, as docker/containerd/CRI-O/podman name their
//! scopes) and a runtime guess. A process is identified by (pid, start
//! time): a reused pid has a new start time, an exec'd one a new exe.
use std::fs;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    /// Field 22 of /proc/PID/stat (clock ticks since boot): with the pid,
    /// a process's identity across pid reuse.
    pub start_ticks: u64,
    pub comm: String,
    pub exe: String,
    pub cgroup: String,
    /// Short (12 hex digit) container id, or empty.
    pub container: String,
    /// `cpython`, `node`, `libuv` or `native`.
    pub runtime: String,
}

/// Start time (clock ticks after boot) of a live process, or None if gone
/// (or a zombie).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = crate::os::limits::read_proc(&format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

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

/// A container id in a cgroup path: a run of 64 hex digits in one path
/// segment (`docker-<id>.scope`, `cri-containerd-<id>.scope`, `/docker/<id>`,
/// `crio-<id>`, `libpod-<id>`), shortened to 12 like `docker ps`.
pub fn container_id(cgroup: &str) -> String {
    for seg in cgroup.rsplit('/') {
        let bytes = seg.as_bytes();
        let mut run = 0;
        for (i, b) in bytes.iter().enumerate() {
            if b.is_ascii_hexdigit() && !b.is_ascii_uppercase() {
                run += 1;
                if run == 64 && bytes.get(i + 1).is_none_or(|c| !c.is_ascii_hexdigit()) {
                    return seg[i + 1 - 64..i + 1 - 52].to_string();
                }
            } else {
                run = 0;
            }
        }
    }
    String::new()
}

fn runtime_of(pid: u32, exe: &str, comm: &str) -> String {
    let base = exe.rsplit('/').next().unwrap_or(exe);
    if base.starts_with("python") || comm.starts_with("python") {
        return "cpython".into();
    }
    if base == "node" || base == "nodejs" {
        return "node".into();
    }
    let maps = crate::os::limits::read_proc(&format!("/proc/{pid}/maps")).unwrap_or_default();
    if maps.contains("/libpython3") {
        "cpython".into()
    } else if maps.contains("/libuv.so") {
        "libuv".into()
    } else {
        "native".into()
    }
}

impl ProcInfo {
    /// Read a live process; None if it is gone.
    pub fn read(pid: u32) -> Option<ProcInfo> {
        let start_ticks = start_ticks(pid)?;
        let comm = crate::os::limits::read_proc(&format!("/proc/{pid}/comm"))
            .ok()?
            .trim_end()
            .to_string();
        let exe = exe_of(pid);
        let cgroup = cgroup_of(pid);
        let container = container_id(&cgroup);
        let runtime = runtime_of(pid, &exe, &comm);
        Some(ProcInfo {
            pid,
            start_ticks,
            comm,
            exe,
            cgroup,
            container,
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
            container: String::new(),
            runtime: "unknown".into(),
        }
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
    fn container_ids() {
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert_eq!(
            container_id(&format!("/system.slice/docker-{id}.scope")),
            "0123456789ab"
        );
        assert_eq!(
            container_id(&format!(
                "/kubepods.slice/kubepods-burstable.slice/cri-containerd-{id}.scope"
            )),
            "0123456789ab"
        );
        assert_eq!(container_id(&format!("/docker/{id}")), "0123456789ab");
        assert_eq!(container_id("/user.slice/user-0.slice/session-1.scope"), "");
    }

    #[test]
    fn reads_itself() {
        let me = ProcInfo::read(std::process::id()).unwrap();
        assert!(me.start_ticks > 0);
        assert!(!me.comm.is_empty());
        assert!(me.exe.starts_with('/'));
    }
}
