//! What stallprof reads of a process from procfs by name: its threads'
//! names, whether it is still our own fork, whether it still runs.
use std::fs;

/// A thread's name (`comm`).
pub fn read_comm(pid: u32, tid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// A launched command before its exec is still an image of this program:
/// nothing to discover in it yet.
pub fn is_own_fork(pid: u32) -> bool {
    let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
    exe.is_none() || exe == std::env::current_exe().ok()
}

/// A process that still runs: zombies count as gone (their threads no
/// longer run).
pub fn process_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}
