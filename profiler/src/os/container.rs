//! A process's container, as its cgroup path shows it.
//!
//! In: the text of `/proc/PID/cgroup` (read capped, [`super::limits`]).
//! Out: a [`Container`] — the container id and the runtime that named its
//! cgroup, the Kubernetes pod uid when the path has one — or nothing when
//! the path shows neither (a process on the host, a runtime whose naming
//! this does not know).
//!
//! What runtimes create (systemd cgroup driver, then cgroupfs):
//!
//! | runtime | cgroup path (its last components) |
//! |---|---|
//! | Docker | `system.slice/docker-<64 hex>.scope`; `/docker/<64 hex>` |
//! | containerd (CRI) | `kubepods-besteffort-pod<uid, _ for ->.slice/cri-containerd-<64 hex>.scope`; `/kubepods/besteffort/pod<uid>/<64 hex>` |
//! | CRI-O | `kubepods-burstable-pod<uid>.slice/crio-<64 hex>.scope` |
//! | Podman | `machine.slice/libpod-<64 hex>.scope`; `/libpod_parent/libpod-<64 hex>` |
//!
//! The cgroup v2 line (`0::PATH`) is preferred; on a cgroup v1 host each
//! controller's line is looked at in turn. A reader in a cgroup namespace
//! of its own sees other containers' paths relative to its own
//! (`/../../kubepods.slice/...`): the components are matched wherever they
//! are, so that still names them. The innermost match wins (systemd in a
//! container: `docker-<id>.scope/init.scope`).

use serde::{Deserialize, Serialize};

/// The container a process runs in, as its cgroup path names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Container {
    /// The container id (64 hex digits as the runtime names it); absent for
    /// a pod's cgroup with no container below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `docker`, `containerd`, `cri-o`, `podman`, or `kubernetes` for a
    /// pod's cgroup whose runtime the path does not say.
    pub runtime: String,
    /// The Kubernetes pod uid (`8e1f...-...`), when the path is a pod's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The cgroup path it was found in (at most [`MAX_CGROUP_PATH`] bytes).
    pub cgroup: String,
}

/// Length of the short container id (`docker ps`).
pub const SHORT_ID: usize = 12;

/// A cgroup path kept longer than this is cut (the kernel allows 4 KiB
/// per component; real ones are ~200 bytes).
pub const MAX_CGROUP_PATH: usize = 512;

impl Container {
    /// The first 12 hex digits of the id, as `docker ps` shows it.
    pub fn short_id(&self) -> Option<&str> {
        self.id.as_deref().map(|id| &id[..id.len().min(SHORT_ID)])
    }

    /// `docker 3f2a9c0b1d4e`, `containerd 3f2a9c0b1d4e pod 8e1f...`: for
    /// titles and summaries.
    pub fn describe(&self) -> String {
        let mut s = self.runtime.clone();
        if let Some(id) = self.short_id() {
            s.push_str(&format!(" container {id}"));
        }
        if let Some(uid) = &self.pod_uid {
            s.push_str(&format!(" pod {uid}"));
        }
        s
    }
}

/// `pid`'s container, from `/proc/PID/cgroup`; None on the host or when it
/// cannot be read (the process is gone).
pub fn of_process(pid: u32) -> Option<Container> {
    let text = super::limits::read_proc(&format!("/proc/{pid}/cgroup")).ok()?;
    from_cgroup(&text)
}

/// The container named by a `/proc/PID/cgroup` text: its v2 line first,
/// then its v1 lines in order.
pub fn from_cgroup(text: &str) -> Option<Container> {
    let paths = text.lines().filter_map(|l| {
        let mut f = l.splitn(3, ':');
        let (hier, ctrls, path) = (f.next()?, f.next()?, f.next()?);
        Some((hier == "0" && ctrls.is_empty(), path))
    });
    let (v2, v1): (Vec<_>, Vec<_>) = paths.partition(|(v2, _)| *v2);
    v2.into_iter()
        .chain(v1)
        .find_map(|(_, path)| from_path(path))
}

/// The container named by one cgroup path.
pub fn from_path(path: &str) -> Option<Container> {
    let mut id: Option<(String, &str)> = None;
    let mut pod_uid = None;
    let mut parent = "";
    for comp in path.split('/') {
        if let Some(uid) = pod_of(comp) {
            pod_uid = Some(uid);
        } else if let Some(found) = container_of(comp, parent, pod_uid.is_some()) {
            id = Some(found);
        }
        parent = comp;
    }
    if id.is_none() && pod_uid.is_none() {
        return None;
    }
    let runtime = id.as_ref().map_or("kubernetes", |(_, r)| r).to_string();
    let mut cgroup = path.to_string();
    if cgroup.len() > MAX_CGROUP_PATH {
        let mut cut = MAX_CGROUP_PATH;
        while !cgroup.is_char_boundary(cut) {
            cut -= 1;
        }
        cgroup.truncate(cut);
    }
    Some(Container {
        id: id.map(|(i, _)| i),
        runtime,
        pod_uid,
        cgroup,
    })
}

/// A pod's cgroup component: `kubepods-<qos>-pod<uid with _>.slice`,
/// `kubepods-pod<uid>.slice` (guaranteed), or cgroupfs's `pod<uid>`.
fn pod_of(comp: &str) -> Option<String> {
    let uid = match comp.strip_suffix(".slice") {
        Some(slice) if slice.starts_with("kubepods") => slice.rsplit_once("-pod")?.1,
        Some(_) => return None,
        None => comp.strip_prefix("pod")?,
    };
    let uid = uid.replace('_', "-");
    is_uid(&uid).then_some(uid)
}

/// A UUID as Kubernetes writes pod uids: 8-4-4-4-12 hex digits.
fn is_uid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

fn is_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A container's cgroup component and the runtime that names it so;
/// `parent`: the component above it (cgroupfs names a container by its
/// bare id under `docker/` or a pod).
fn container_of(comp: &str, parent: &str, in_pod: bool) -> Option<(String, &'static str)> {
    if let Some(scope) = comp.strip_suffix(".scope") {
        const PREFIXES: [(&str, &str); 4] = [
            ("docker-", "docker"),
            ("cri-containerd-", "containerd"),
            ("crio-", "cri-o"),
            ("libpod-", "podman"),
        ];
        return PREFIXES.iter().find_map(|(prefix, runtime)| {
            let id = scope.strip_prefix(prefix)?;
            is_id(id).then(|| (id.to_ascii_lowercase(), *runtime))
        });
    }
    // cgroupfs: the bare id, or libpod's `libpod-<id>` directory.
    let (id, runtime) = match comp.strip_prefix("libpod-") {
        Some(id) => (id, "podman"),
        None if parent == "docker" => (comp, "docker"),
        None if in_pod => (comp, "kubernetes"),
        None => return None,
    };
    is_id(id).then(|| (id.to_ascii_lowercase(), runtime))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f2a9c0b1d4e5f60718293a4b5c6d7e8f90123456789abcdef0123456789abcd";

    fn c(path: &str) -> Option<(Option<String>, String, Option<String>)> {
        from_path(path).map(|c| (c.id, c.runtime, c.pod_uid))
    }

    #[test]
    fn runtimes_by_their_cgroup_paths() {
        let id = Some(ID.to_string());
        let uid = Some("8e1f0c2a-3b4d-4e5f-9a6b-7c8d9e0f1a2b".to_string());
        assert_eq!(
            c(&format!("/system.slice/docker-{ID}.scope")),
            Some((id.clone(), "docker".into(), None))
        );
        assert_eq!(
            c(&format!("/docker/{ID}")),
            Some((id.clone(), "docker".into(), None))
        );
        assert_eq!(
            c(&format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod8e1f0c2a_3b4d_4e5f_9a6b_7c8d9e0f1a2b.slice/cri-containerd-{ID}.scope"
            )),
            Some((id.clone(), "containerd".into(), uid.clone()))
        );
        assert_eq!(
            c(&format!(
                "/kubepods.slice/kubepods-pod8e1f0c2a_3b4d_4e5f_9a6b_7c8d9e0f1a2b.slice/crio-{ID}.scope"
            )),
            Some((id.clone(), "cri-o".into(), uid.clone()))
        );
        assert_eq!(
            c(&format!(
                "/kubepods/burstable/pod8e1f0c2a-3b4d-4e5f-9a6b-7c8d9e0f1a2b/{ID}"
            )),
            Some((id.clone(), "kubernetes".into(), uid.clone()))
        );
        assert_eq!(
            c(&format!("/machine.slice/libpod-{ID}.scope")),
            Some((id.clone(), "podman".into(), None))
        );
        assert_eq!(
            c(&format!("/libpod_parent/libpod-{ID}")),
            Some((id.clone(), "podman".into(), None))
        );
        // Seen from a cgroup namespace of its own, and systemd inside.
        assert_eq!(
            c(&format!("/../../system.slice/docker-{ID}.scope/init.scope")),
            Some((id.clone(), "docker".into(), None))
        );
        // A pod's sandbox cgroup without a container below it.
        assert_eq!(
            c("/kubepods.slice/kubepods-pod8e1f0c2a_3b4d_4e5f_9a6b_7c8d9e0f1a2b.slice"),
            Some((None, "kubernetes".into(), uid))
        );
        // Not containers: the host, conmon, a short id, a user session.
        for p in [
            "/",
            "/user.slice/user-1000.slice/session-2.scope",
            &format!("/machine.slice/libpod-conmon-{ID}.scope"),
            "/system.slice/docker-3f2a9c.scope",
            "/kubepods.slice/kubepods-podnot-a-uid.slice",
            &format!("/system.slice/{ID}"),
        ] {
            assert_eq!(c(p), None, "{p}");
        }
        let short = from_path(&format!("/docker/{ID}")).unwrap();
        assert_eq!(short.short_id(), Some("3f2a9c0b1d4e"));
        assert_eq!(short.describe(), "docker container 3f2a9c0b1d4e");
    }

    #[test]
    fn v2_line_first_then_v1() {
        let text = format!(
            "12:memory:/docker/{ID}\n0::/system.slice/docker-{}.scope\n",
            "a".repeat(64)
        );
        assert_eq!(from_cgroup(&text).unwrap().id, Some("a".repeat(64)));
        let v1 = format!("4:memory:/process_api/77\n3:cpu:/docker/{ID}\n0::/\n");
        let found = from_cgroup(&v1).unwrap();
        assert_eq!(found.id.as_deref(), Some(ID));
        assert_eq!(found.cgroup, format!("/docker/{ID}"));
        assert_eq!(from_cgroup("0::/\n"), None);
        assert_eq!(from_cgroup(""), None);
        let long = format!("0::/{}/docker-{ID}.scope", "x/".repeat(400));
        assert_eq!(from_cgroup(&long).unwrap().cgroup.len(), MAX_CGROUP_PATH);
    }
}
