//! A watched process tree as its members' roles: which process is the
//! supervisor, which the workers, and each worker's number.
//!
//! In: what procfs says of each watched process while it runs
//! ([`Facts::read`]: its parent, start time, command name, and whether it
//! is a Node cluster worker), collected as processes are first seen (a
//! recording's journal keeps them, [`crate::report::journal`]). Out: each
//! process's [`Role`], derived in one place ([`roles`]) from the whole
//! table, so a worker's number does not depend on when it was first seen.
//!
//! A worker is a process that ran an event loop (a loop thread was
//! elected in it, [`Facts::ran_loop`]): a supervisor's other children —
//! `multiprocessing`'s resource tracker, a launcher's short-lived helpers —
//! are watched, but are nobody's worker and take no worker's number.
//!
//! The rules, first that applies:
//! - a Node cluster worker (its environment holds `NODE_UNIQUE_ID=k`, which
//!   Node's `cluster.fork` sets) is `cluster worker k`;
//! - a process with a worker among its watched children (the process a
//!   server forks its workers from: uvicorn, gunicorn — whose arbiter runs
//!   a `select` loop of its own —, a Node cluster primary), or the top of
//!   the tree with watched children, is `supervisor`;
//! - a child of a watched process that ran a loop is `worker N of
//!   <parent's comm>`, N its rank by start time among its watched siblings
//!   that ran one (1 the oldest; a respawned worker gets the next number,
//!   not its predecessor's); one whose start time is unknown (it had
//!   exited before it could be read) has no number, and no role;
//! - anything else (the target alone, a helper process) has no role.
use std::{collections::BTreeMap, fmt, io::Read};

use serde::{Deserialize, Serialize};

use super::container::Container;

/// What a process is in its watched tree.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Role {
    /// It forked watched processes.
    Supervisor,
    /// The `n`th (by start time, from 1) watched child of a process whose
    /// command name is `of`.
    Worker { n: u32, of: String },
    /// A Node cluster worker, `NODE_UNIQUE_ID=id`.
    ClusterWorker { id: u32 },
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Supervisor => f.write_str("supervisor"),
            Role::Worker { n, of } => write!(f, "worker {n} of {of}"),
            Role::ClusterWorker { id } => write!(f, "cluster worker {id}"),
        }
    }
}

impl From<Role> for String {
    fn from(r: Role) -> String {
        r.to_string()
    }
}

impl TryFrom<String> for Role {
    type Error = String;
    fn try_from(s: String) -> Result<Role, String> {
        let number = |n: &str| n.parse::<u32>().ok();
        if s == "supervisor" {
            return Ok(Role::Supervisor);
        }
        if let Some(id) = s.strip_prefix("cluster worker ").and_then(number) {
            return Ok(Role::ClusterWorker { id });
        }
        if let Some((n, of)) = s
            .strip_prefix("worker ")
            .and_then(|rest| rest.split_once(" of "))
            && let Some(n) = number(n)
        {
            return Ok(Role::Worker { n, of: of.into() });
        }
        Err(format!(
            "unknown process role {s:?} (known: \"supervisor\", \"worker N of COMM\", \"cluster worker K\")"
        ))
    }
}

/// What procfs said of a watched process when it was first seen: enough
/// to place it in its tree ([`roles`]) and to name it after it exits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Facts {
    pub pid: u32,
    /// Its command name (`comm`).
    pub comm: String,
    /// Its parent's pid, None when unknown (it had exited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<u32>,
    /// Its start time, clock ticks after boot (`/proc/PID/stat` field 22).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_ticks: Option<u64>,
    /// `NODE_UNIQUE_ID` in its environment: a Node cluster worker's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_worker: Option<u32>,
    /// Its pid in its own PID namespace, when that is not the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_pid: Option<u32>,
    /// The container its cgroup path names, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<Container>,
    /// A loop thread was elected in it while watched (learned after its
    /// first sight: a later `process` line of the journal sets it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ran_loop: bool,
    /// The service name its own OpenTelemetry SDK reports
    /// (`OTEL_SERVICE_NAME`, else `service.name` in
    /// `OTEL_RESOURCE_ATTRIBUTES`, from its environment), when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

/// At most this much of `/proc/PID/environ` is read: the kernel caps a
/// process's arguments and environment together near 2 MiB (`ARG_MAX`
/// with the default stack limit); a real one is a few KiB.
const ENVIRON_MAX: u64 = 2 << 20;

impl Facts {
    /// `pid` as procfs shows it now; a field it no longer shows (the
    /// process exited) is None, and `comm` then `fallback_comm`.
    pub fn read(pid: u32, fallback_comm: &str) -> Facts {
        let environ = read_environ(pid);
        Facts {
            pid,
            comm: super::proc::read_comm(pid, pid).unwrap_or_else(|| fallback_comm.to_string()),
            parent: super::proc::parent_pid(pid),
            start_ticks: super::proc::start_ticks(pid),
            cluster_worker: environ.as_deref().and_then(node_unique_id),
            ns_pid: super::proc::read_namespace_id(pid, pid).filter(|&ns| ns != pid),
            container: super::container::of_process(pid),
            ran_loop: false,
            service: environ.as_deref().and_then(otel_service_name),
        }
    }
}

/// `/proc/PID/environ`, at most [`ENVIRON_MAX`] bytes; None when it cannot
/// be read (gone, or another user's without CAP_SYS_PTRACE).
fn read_environ(pid: u32) -> Option<Vec<u8>> {
    let f = std::fs::File::open(format!("/proc/{pid}/environ")).ok()?;
    let mut buf = Vec::new();
    f.take(ENVIRON_MAX).read_to_end(&mut buf).ok()?;
    Some(buf)
}

/// `NODE_UNIQUE_ID`'s value in an environ block (NUL-separated `K=V`).
fn node_unique_id(environ: &[u8]) -> Option<u32> {
    environ
        .split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"NODE_UNIQUE_ID="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

/// The service name `pid`'s own OpenTelemetry SDK would report, read from
/// its environment now ([`otel_service_name`]).
pub fn service_of(pid: u32) -> Option<String> {
    read_environ(pid).as_deref().and_then(otel_service_name)
}

/// The longest service name taken from a target's environment.
const SERVICE_NAME_MAX: usize = 256;

/// The service name an OpenTelemetry SDK in a process with this environ
/// block would report: `OTEL_SERVICE_NAME`, else the `service.name` of
/// `OTEL_RESOURCE_ATTRIBUTES` (`k=v,k2=v2`, values percent-encoded as the
/// W3C baggage format the spec names); control characters dropped, at
/// most [`SERVICE_NAME_MAX`] bytes. None when neither is set.
pub fn otel_service_name(environ: &[u8]) -> Option<String> {
    let var = |name: &[u8]| {
        environ.split(|&b| b == 0).find_map(|kv| {
            kv.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(b"="))
                .map(String::from_utf8_lossy)
        })
    };
    let name = var(b"OTEL_SERVICE_NAME")
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .or_else(|| {
            let attrs = var(b"OTEL_RESOURCE_ATTRIBUTES")?;
            attrs.split(',').find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                (k.trim() == "service.name").then(|| percent_decode(v.trim()))
            })
        })?;
    let mut clean: String = name.chars().filter(|c| !c.is_control()).collect();
    if clean.len() > SERVICE_NAME_MAX {
        let mut end = SERVICE_NAME_MAX;
        while !clean.is_char_boundary(end) {
            end -= 1;
        }
        clean.truncate(end);
    }
    (!clean.is_empty()).then_some(clean)
}

fn percent_decode(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The role of every member of `table` that has one (see the module's
/// rules). Only the table is consulted: a parent or sibling not in it is
/// not watched.
pub fn roles(table: &[Facts]) -> BTreeMap<u32, Role> {
    let by_pid: BTreeMap<u32, &Facts> = table.iter().map(|f| (f.pid, f)).collect();
    let watched_parent = |f: &Facts| f.parent.and_then(|p| by_pid.get(&p).copied());
    let mut out = BTreeMap::new();
    let is_worker = |c: &Facts| c.ran_loop || c.cluster_worker.is_some();
    for f in table {
        let children = || table.iter().filter(|c| c.parent == Some(f.pid));
        let role = if let Some(id) = f.cluster_worker {
            Role::ClusterWorker { id }
        } else if children().any(is_worker)
            || (watched_parent(f).is_none() && children().next().is_some())
        {
            Role::Supervisor
        } else if let Some(parent) = watched_parent(f)
            && f.ran_loop
            && f.start_ticks.is_some()
        {
            // Oldest first (an unknown start is no older than any); the pid
            // breaks ties.
            let key = |s: &Facts| (s.start_ticks.is_none(), s.start_ticks, s.pid);
            let n = table
                .iter()
                .filter(|s| s.parent == Some(parent.pid) && s.ran_loop && key(s) < key(f))
                .count() as u32
                + 1;
            Role::Worker {
                n,
                of: parent.comm.clone(),
            }
        } else {
            continue;
        };
        out.insert(f.pid, role);
    }
    out
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_service_name_its_sdk_would_report() {
        let env = |s: &str| s.replace(' ', "\0").into_bytes();
        assert_eq!(
            otel_service_name(&env("PATH=/bin OTEL_SERVICE_NAME=gateway")),
            Some("gateway".into())
        );
        assert_eq!(
            otel_service_name(&env(
                "OTEL_RESOURCE_ATTRIBUTES=deployment.environment=prod,service.name=chat%20api"
            )),
            Some("chat api".into())
        );
        // OTEL_SERVICE_NAME wins over the attributes.
        assert_eq!(
            otel_service_name(&env(
                "OTEL_RESOURCE_ATTRIBUTES=service.name=b OTEL_SERVICE_NAME=a"
            )),
            Some("a".into())
        );
        assert_eq!(
            otel_service_name(&env("PATH=/bin OTEL_SERVICE_NAMEX=z")),
            None
        );
        assert_eq!(
            otel_service_name(b"OTEL_SERVICE_NAME=a\x1bb"),
            Some("ab".into())
        );
    }

    use super::*;

    /// (pid, parent, start ticks, comm, NODE_UNIQUE_ID).
    fn table(rows: &[(u32, u32, u64, &str, Option<u32>)]) -> Vec<Facts> {
        rows.iter()
            .map(|&(pid, parent, start, comm, node)| Facts {
                pid,
                comm: comm.into(),
                parent: Some(parent),
                start_ticks: Some(start),
                cluster_worker: node,
                ran_loop: pid != parent,
                ..Default::default()
            })
            .collect()
    }

    fn said(table: &[Facts]) -> Vec<(u32, String)> {
        roles(table)
            .into_iter()
            .map(|(pid, r)| (pid, r.to_string()))
            .collect()
    }

    #[test]
    fn uvicorn_workers_are_numbered_by_start_time() {
        // uvicorn (1200) forked four workers; listed out of start order,
        // and 1240 started before 1230.
        let t = table(&[
            (1200, 1, 100, "uvicorn", None),
            (1230, 1200, 160, "python3.12", None),
            (1210, 1200, 120, "python3.12", None),
            (1240, 1200, 150, "python3.12", None),
            (1220, 1200, 130, "python3.12", None),
        ]);
        assert_eq!(
            said(&t),
            [
                (1200, "supervisor".to_string()),
                (1210, "worker 1 of uvicorn".to_string()),
                (1220, "worker 2 of uvicorn".to_string()),
                (1230, "worker 4 of uvicorn".to_string()),
                (1240, "worker 3 of uvicorn".to_string()),
            ]
        );
    }

    #[test]
    fn a_respawned_worker_takes_the_next_number() {
        // Worker 1210 died; 1250 replaced it later: both stay in the table
        // (both were watched), so the new one is worker 3, not worker 1.
        let t = table(&[
            (1200, 1, 100, "gunicorn", None),
            (1210, 1200, 120, "gunicorn", None),
            (1220, 1200, 130, "gunicorn", None),
            (1250, 1200, 900, "gunicorn", None),
        ]);
        assert_eq!(roles(&t)[&1250].to_string(), "worker 3 of gunicorn");
        // Same start tick: the lower pid is older.
        let t = table(&[
            (10, 1, 5, "srv", None),
            (12, 10, 7, "srv", None),
            (11, 10, 7, "srv", None),
        ]);
        assert_eq!(
            said(&t)[1..],
            [
                (11, "worker 1 of srv".into()),
                (12, "worker 2 of srv".into())
            ]
        );
    }

    #[test]
    fn node_cluster_workers_say_their_id() {
        let t = table(&[
            (500, 1, 10, "node", None),
            (510, 500, 20, "node", Some(2)),
            (520, 500, 30, "node", Some(1)),
        ]);
        assert_eq!(
            said(&t),
            [
                (500, "supervisor".into()),
                (510, "cluster worker 2".into()),
                (520, "cluster worker 1".into()),
            ]
        );
    }

    #[test]
    fn a_lone_target_and_an_unwatched_parent_have_no_role() {
        let t = table(&[(42, 1, 10, "python3", None)]);
        assert!(roles(&t).is_empty());
        // A child whose start time is unknown (it had exited when first
        // seen) has no number: no role, and it does not move the others;
        // a process with workers is their supervisor, whatever it is under
        // (gunicorn's arbiter runs a select loop of its own, under a shell).
        let mut t = table(&[
            (1, 0, 1, "sh", None),
            (2, 1, 5, "gunicorn", None),
            (3, 2, 9, "gunicorn", None),
        ]);
        t.insert(
            2,
            Facts {
                pid: 4,
                comm: "?".into(),
                parent: Some(2),
                ..Default::default()
            },
        );
        assert_eq!(
            said(&t),
            [
                (1, "supervisor".into()),
                (2, "supervisor".into()),
                (3, "worker 1 of gunicorn".into()),
            ]
        );
    }

    /// uvicorn `--workers` under `spawn` starts multiprocessing's resource
    /// tracker before its workers: watched, but no loop, so no worker and
    /// no number taken from the workers.
    #[test]
    fn a_child_that_runs_no_loop_is_nobodys_worker() {
        let mut t = table(&[
            (1200, 1, 100, "uvicorn", None),
            (1201, 1200, 110, "python3.11", None),
            (1202, 1200, 120, "python3.11", None),
            (1203, 1200, 130, "python3.11", None),
        ]);
        t[1].ran_loop = false;
        assert_eq!(
            said(&t),
            [
                (1200, "supervisor".into()),
                (1202, "worker 1 of uvicorn".into()),
                (1203, "worker 2 of uvicorn".into()),
            ]
        );
    }

    #[test]
    fn roles_read_back_from_their_words() {
        for r in [
            Role::Supervisor,
            Role::Worker {
                n: 12,
                of: "uvicorn of x".into(),
            },
            Role::ClusterWorker { id: 3 },
        ] {
            assert_eq!(Role::try_from(r.to_string()), Ok(r));
        }
        assert!(Role::try_from("boss".to_string()).is_err());
        assert_eq!(node_unique_id(b"A=1\0NODE_UNIQUE_ID=4\0B=2\0"), Some(4));
        assert_eq!(node_unique_id(b"NODE_UNIQUE_IDX=4\0"), None);
        // This process is no cluster worker, and its facts are read.
        let me = std::process::id();
        let f = Facts::read(me, "?");
        assert_eq!(f.parent, Some(std::os::unix::process::parent_id()));
        assert!(f.start_ticks.is_some());
        assert_eq!(Facts::read(u32::MAX, "gone").comm, "gone");
    }
}
