//! Which processes the daemon reports on: include/exclude rules over a
//! process's comm, exe, cgroup, container id, Kubernetes pod uid and pid.
//!
//! In: [`ProcInfo`](super::procs::ProcInfo). Out: monitored or not. A rule
//! matches when every field it sets matches (`*` is a wildcard; `container`
//! also matches a prefix of the full 64-digit id, so the 12-digit short id
//! works; `container` and `pod` never match a process outside a container
//! or pod). A process is monitored when no include rule is given or one
//! matches, and no exclude rule matches.
use serde::Deserialize;

use super::procs::ProcInfo;

#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub comm: Option<String>,
    pub exe: Option<String>,
    pub cgroup: Option<String>,
    pub container: Option<String>,
    pub pod: Option<String>,
    pub pid: Option<u32>,
}

/// `*` matches any run of characters; everything else literally.
pub fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && p[pi] != '*' && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

impl Rule {
    fn is_empty(&self) -> bool {
        self == &Rule::default()
    }

    pub fn matches(&self, p: &ProcInfo) -> bool {
        self.comm.as_deref().is_none_or(|g| glob(g, &p.comm))
            && self.exe.as_deref().is_none_or(|g| glob(g, &p.exe))
            && self.cgroup.as_deref().is_none_or(|g| glob(g, &p.cgroup))
            && self.container.as_deref().is_none_or(|g| {
                let id = p.container_id();
                !id.is_empty() && (id.starts_with(g) || glob(g, id))
            })
            && self
                .pod
                .as_deref()
                .is_none_or(|g| !p.pod().is_empty() && glob(g, p.pod()))
            && self.pid.is_none_or(|pid| pid == p.pid)
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(v) = &self.comm {
            parts.push(format!("comm={v}"));
        }
        if let Some(v) = &self.exe {
            parts.push(format!("exe={v}"));
        }
        if let Some(v) = &self.cgroup {
            parts.push(format!("cgroup={v}"));
        }
        if let Some(v) = &self.container {
            parts.push(format!("container={v}"));
        }
        if let Some(v) = &self.pod {
            parts.push(format!("pod={v}"));
        }
        if let Some(v) = self.pid {
            parts.push(format!("pid={v}"));
        }
        format!("[{}]", parts.join(" "))
    }
}

#[derive(Debug, Default, Clone)]
pub struct Rules {
    include: Vec<Rule>,
    exclude: Vec<Rule>,
}

impl Rules {
    pub fn new(include: Vec<Rule>, exclude: Vec<Rule>) -> Result<Rules, String> {
        if include.iter().chain(&exclude).any(Rule::is_empty) {
            return Err("a rule with no field would match every process: give comm, exe, cgroup, container, pod or pid".into());
        }
        Ok(Rules { include, exclude })
    }

    /// Some include rule is given: only the processes it matches are
    /// reported (and pay for their waits).
    pub fn includes_some(&self) -> bool {
        !self.include.is_empty()
    }

    pub fn monitored(&self, p: &ProcInfo) -> bool {
        (self.include.is_empty() || self.include.iter().any(|r| r.matches(p)))
            && !self.exclude.iter().any(|r| r.matches(p))
    }

    pub fn describe(&self) -> String {
        let inc = if self.include.is_empty() {
            "include every process".to_string()
        } else {
            format!(
                "include {}",
                self.include
                    .iter()
                    .map(Rule::describe)
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        };
        if self.exclude.is_empty() {
            inc
        } else {
            format!(
                "{inc}; exclude {}",
                self.exclude
                    .iter()
                    .map(Rule::describe)
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process whose container is what `cgroup` names.
    fn proc_(comm: &str, exe: &str, cgroup: &str) -> ProcInfo {
        ProcInfo {
            pid: 42,
            start_ticks: 1,
            comm: comm.into(),
            exe: exe.into(),
            cgroup: cgroup.into(),
            ppid: 0,
            parent_comm: String::new(),
            process: crate::model::ProcessInfo {
                ns_pid: None,
                container: crate::os::container::from_path(cgroup),
            },
            runtime: "native".into(),
        }
    }

    const ID: &str = "abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789";
    const POD: &str = "/kubepods/besteffort/pod8e1f0c2a-3b4d-4e5f-9a6b-7c8d9e0f1a2b/";

    #[test]
    fn globs() {
        assert!(glob("python*", "python3.11"));
        assert!(glob("*docker*", "/system.slice/docker-abc.scope"));
        assert!(glob("a*b*c", "axxbyyc"));
        assert!(!glob("a*b", "axxc"));
        assert!(glob("*", ""));
        assert!(!glob("node", "nodejs"));
    }

    #[test]
    fn include_then_exclude() {
        let r = Rules::new(
            vec![
                Rule {
                    comm: Some("python*".into()),
                    ..Default::default()
                },
                Rule {
                    container: Some("abc".into()),
                    ..Default::default()
                },
            ],
            vec![Rule {
                exe: Some("/usr/lib/*".into()),
                ..Default::default()
            }],
        )
        .unwrap();
        assert!(r.monitored(&proc_("python3", "/usr/bin/python3", "/")));
        assert!(!r.monitored(&proc_("python3", "/usr/lib/x/python3", "/")));
        let in_pod = format!("{POD}{ID}");
        assert!(r.monitored(&proc_("nginx", "/usr/sbin/nginx", &in_pod)));
        assert!(!r.monitored(&proc_("nginx", "/usr/sbin/nginx", "/")));
        assert!(Rules::new(vec![Rule::default()], vec![]).is_err());
        assert!(Rules::default().monitored(&proc_("x", "/x", "/")));
    }

    #[test]
    fn containers_and_pods() {
        let rule = |container: Option<&str>, pod: Option<&str>| {
            Rules::new(
                vec![Rule {
                    container: container.map(Into::into),
                    pod: pod.map(Into::into),
                    ..Default::default()
                }],
                vec![],
            )
            .unwrap()
        };
        let docker = proc_("app", "/app", &format!("/system.slice/docker-{ID}.scope"));
        let pod = proc_("app", "/app", &format!("{POD}{ID}"));
        let host = proc_("app", "/app", "/user.slice");
        // The short id, the full id, a glob.
        for g in ["abcdef012345", ID, "abc*789"] {
            assert!(rule(Some(g), None).monitored(&docker), "{g}");
        }
        assert!(!rule(Some("abcdef012346"), None).monitored(&docker));
        assert!(!rule(Some("*"), None).monitored(&host));
        assert!(rule(Some("*"), None).monitored(&pod));
        // Pods: by uid or glob; a container outside a pod is not in one.
        assert!(rule(None, Some("8e1f0c2a-3b4d-4e5f-9a6b-7c8d9e0f1a2b")).monitored(&pod));
        assert!(rule(None, Some("8e1f0c2a-*")).monitored(&pod));
        assert!(!rule(None, Some("*")).monitored(&docker));
        assert!(!rule(None, Some("*")).monitored(&host));
        let ex = Rules::new(
            vec![],
            vec![Rule {
                pod: Some("8e1f*".into()),
                ..Default::default()
            }],
        )
        .unwrap();
        assert!(!ex.monitored(&pod) && ex.monitored(&docker) && ex.monitored(&host));
        assert!(ex.describe().contains("pod=8e1f*"), "{}", ex.describe());
    }
}
