//! What stallprof reads of a process from procfs by name: its threads'
//! names, whether it is still our own fork, whether it still runs, its
//! parent and the processes under it.
use std::fs;

/// A thread's name (`comm`).
pub fn read_comm(pid: u32, tid: u32) -> Option<String> {
    super::limits::read_proc(&format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// The executable `pid` runs (its `/proc/PID/exe` link), None when it
/// cannot be read (gone, a kernel thread, another user's without
/// CAP_SYS_PTRACE).
pub fn exe(pid: u32) -> Option<std::path::PathBuf> {
    fs::read_link(format!("/proc/{pid}/exe")).ok()
}

/// A launched command before its exec is still an image of this program:
/// nothing to discover in it yet. A process whose exe we may not read
/// (another user's, without CAP_SYS_PTRACE) is not ours: what cannot be
/// read in it is for the readers to report.
pub fn is_own_fork(pid: u32) -> bool {
    // Our own executable, read once (the upkeep asks several times a tick).
    static ME: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    match fs::read_link(format!("/proc/{pid}/exe")) {
        Ok(exe) => ME
            .get_or_init(|| std::env::current_exe().ok())
            .as_ref()
            .is_some_and(|me| *me == exe),
        Err(e) => e.kind() != std::io::ErrorKind::PermissionDenied,
    }
}

/// A process that still runs: zombies count as gone (their threads no
/// longer run).
/// The threads of process `pid` now (host tids, from /proc/PID/task).
pub fn threads(pid: u32) -> std::io::Result<Vec<u32>> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/task"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect())
}

pub fn process_alive(pid: u32) -> bool {
    match super::limits::read_proc(&format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// `PF_KTHREAD` in the flags field of `/proc/PID/stat` (include/linux/sched.h).
const PF_KTHREAD: u64 = 0x0020_0000;

/// The flags of `/proc/PID/stat` (field 9), if it can be read.
fn stat_flags(stat: &str) -> Option<u64> {
    // Fields after the command name, which may itself hold ") ".
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(6)?.parse().ok()
}

/// `pid` is a kernel thread (false if gone or unreadable).
pub fn is_kernel_thread(pid: u32) -> bool {
    super::limits::read_proc(&format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| stat_flags(&s))
        .is_some_and(|f| f & PF_KTHREAD != 0)
}

/// Why `pid` cannot be a recording target, if it cannot: a kernel thread
/// (no user stack, no executable), a zombie (nothing runs), or stallprof
/// itself (it would record its own reading of the ring buffer).
pub fn refuse_target(pid: u32) -> Option<String> {
    let Ok(stat) = super::limits::read_proc(&format!("/proc/{pid}/stat")) else {
        return Some(format!(
            "no process with pid {pid}: check the pid (e.g. `pgrep -f yourapp`)"
        ));
    };
    let own = std::process::id();
    let tgid = super::limits::read_proc(&format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Tgid:"))
                .and_then(|v| v.trim().parse::<u32>().ok())
        });
    if pid == own || tgid == Some(own) {
        return Some(format!(
            "pid {pid} is this stallprof itself: give the pid of the process to record"
        ));
    }
    // Fields after the command name, which may itself hold ") ".
    let rest: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    // rest[0] is field 3 (state), rest[6] field 9 (flags).
    // A zombie has no exe either: say which it is first.
    if rest.first() == Some(&"Z") {
        return Some(format!(
            "pid {pid} is a zombie (it has exited and waits for its parent to reap it): nothing runs to record"
        ));
    }
    let flags = stat_flags(&stat).unwrap_or(0);
    if flags & PF_KTHREAD != 0
        || fs::read_link(format!("/proc/{pid}/exe"))
            .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    {
        return Some(format!(
            "pid {pid} is a kernel thread: it has no user-space stack or event loop to record; \
             give the pid of a user process"
        ));
    }
    None
}

/// A thread's id in its own (innermost) PID namespace: what it sees as its
/// pid/tid and writes in its own files and logs (in a container, not the
/// host's id). The last `NSpid:` field of its status; `tid` when procfs
/// does not say.
pub fn namespace_id(pid: u32, tid: u32) -> u32 {
    read_namespace_id(pid, tid).unwrap_or(tid)
}

/// [`namespace_id`], None when procfs does not say (the thread is gone).
pub fn read_namespace_id(pid: u32, tid: u32) -> Option<u32> {
    super::limits::read_proc(&format!("/proc/{pid}/task/{tid}/status"))
        .ok()
        .and_then(|s| innermost_nspid(&s))
}

/// The last `NSpid:` field of a `/proc/.../status` text.
pub fn innermost_nspid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Why `tid` cannot be a loop thread of `pid`, if it cannot.
pub fn refuse_thread(pid: u32, tid: u32) -> Option<String> {
    (!std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()).then(|| {
        format!(
            "--tid {tid} is not a thread of pid {pid} (no /proc/{pid}/task/{tid}): \
             list its threads with `ls /proc/{pid}/task`"
        )
    })
}

/// The fields of `/proc/PID/stat` after the command name (which may
/// itself hold ") "): field 3 (state) is the first.
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_ascii_whitespace().collect())
}

/// The parent of process `pid` (field 4 of `/proc/PID/stat`), None when
/// gone or unreadable.
pub fn parent_pid(pid: u32) -> Option<u32> {
    let stat = crate::os::limits::read_proc(&format!("/proc/{pid}/stat")).ok()?;
    stat_fields(&stat)?.get(1)?.parse().ok()
}

/// The processes under `root` now (children, their children, ...), in
/// the order found, `root` not included: one walk of `/proc` (a kernel
/// without `CONFIG_PROC_CHILDREN` has no per-task child lists). Later
/// forks are reported by the kernel (`sp_raw_fork`), not by walking again.
pub fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, parent_pid(pid)?)))
        .collect();
    tree_under(root, &parents)
}

/// The pids under `root` in a (pid, parent) table, nearest first.
fn tree_under(root: u32, parents: &[(u32, u32)]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![root];
    while let Some(p) = next.pop() {
        for &(pid, _) in parents.iter().filter(|&&(pid, pp)| pp == p && pid != root) {
            if !out.contains(&pid) {
                out.push(pid);
                next.push(pid);
            }
        }
    }
    out
}

/// Start time (clock ticks after boot) of a live process, or None if gone
/// (or a zombie).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = crate::os::limits::read_proc(&format!("/proc/{pid}/stat")).ok()?;
    let fields = stat_fields(&stat)?;
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_ids_from_status() {
        let status = "Name:\tpython3.14\nTgid:\t21316\nNSpid:\t21318\t3\nNSsid:\t1\n";
        assert_eq!(innermost_nspid(status), Some(3));
        assert_eq!(innermost_nspid("NSpid:\t42\n"), Some(42));
        assert_eq!(innermost_nspid("Name:\tx\n"), None);
        let me = std::process::id();
        assert_eq!(namespace_id(me, me), me);
    }

    #[test]
    fn a_tree_is_every_process_under_its_root() {
        // 1 -> 10 -> {11, 12 -> 13}; 20 elsewhere.
        let t = [(10, 1), (11, 10), (12, 10), (13, 12), (20, 1)];
        let mut under = tree_under(10, &t);
        under.sort_unstable();
        assert_eq!(under, [11, 12, 13]);
        assert!(tree_under(13, &t).is_empty());
        let me = std::process::id();
        assert_eq!(parent_pid(me), Some(std::os::unix::process::parent_id()));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        assert!(descendants(me).contains(&child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
