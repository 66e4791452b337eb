//! Issue 34, root integration tests: the whole service. Real multi-process
//! servers are the victims, recorded by the supervisor's pid alone:
//!
//! - `uvicorn py_service:app --workers 2 --loop uvloop` (a master that
//!   spawns its workers, plus multiprocessing's resource tracker);
//! - `gunicorn -w 2 -k uvicorn.workers.UvicornWorker py_service:app` (an
//!   arbiter that forks its workers);
//! - tests/victims/node_cluster.js: a Node `cluster` primary forking two
//!   http workers.
//!
//! The apps' handlers block the loop of the worker that serves them: one
//! on-CPU (pbkdf2 rounds), one off-CPU (a sleep), each section logged by
//! the worker with its pid, tid, CLOCK_MONOTONIC start and end and the
//! thread's CPU time. The test starts the server, waits until every worker
//! says it is ready, runs `stallprof record --pid <supervisor>`, and sends
//! requests in pairs, the second once the first's handler has begun (so
//! the second goes to another worker, and every section is a stall of its
//! own), until the log shows enough sections in every worker: the server,
//! not the test, picks which worker serves.
//! For uvicorn and gunicorn it then SIGKILLs one worker mid-recording, waits
//! until the supervisor has started another (it logs ready with a new pid)
//! and sends blocking requests until the new worker served its share too.
//!
//! Checked, from stalls.json against the workers' log:
//! - ≥ 95% of the sections recorded are matched by a stall with the same
//!   pid and tid overlapping them in time;
//! - each matched stall of a planned block (60 ms) has an on-CPU share
//!   within 5 points (Node: 10) of the share the section's CPU time (the victim's thread CPU clock) is
//!   of the stall;
//! - there are stalls in every worker, the respawned one included, and
//!   none in any other process of the tree: none in uvicorn's master, whose
//!   waits with a timeout are no event loop, nor in its resource tracker;
//!   in gunicorn's arbiter and Node's primary, which run loops of their own
//!   (gunicorn's control server, an asyncio loop in a thread; the primary's
//!   libuv loop), only stalls that are a wait for a CPU the workers hold;
//! - stalls.json's `processes` gives the supervisor the role `supervisor`
//!   and each worker a worker's role of its own (`worker N of COMM`, Node:
//!   `cluster worker K`; the respawned one a new N); `record`'s summary
//!   names every worker by its pid.
//!
//! And `stallprof top --pid <master>` of the uvicorn service shows a row
//! for each worker pid.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use stallprof::os::clock::monotonic_ns;

const THRESHOLD: &str = "20ms";
const THRESHOLD_NS: u64 = 20 * MS;
/// How long each handler blocks its loop.
const SECTION_MS: u64 = 60;
/// Sections of each kind (on-CPU, off-CPU) every worker must serve.
const PER_WORKER: usize = 3;
/// Requests of each kind every worker serves without blocking before its
/// blocking ones: its first request's one-time work (a fresh worker's lazy
/// imports) is then in no section's stall, and stallprof has seen the
/// loop's waits it elects the loop by (assemble/loops.rs: `EPOLL_DECIDE`
/// waits on one epoll fd) — a worker idle since before the recording began
/// has shown it none. With one of each, the first blocking section of a
/// worker that was running at attach went unrecorded in about half the
/// runs.
const WARM_UPS: usize = 3;
/// Of the sections recorded, the share stallprof must find.
const MATCHED_PERCENT: f64 = 95.0;

/// A TCP port on 127.0.0.1 that nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 for a free port")
}

/// The servers under test.
#[derive(Clone, Copy, Debug)]
enum Server {
    Uvicorn,
    Gunicorn,
    NodeCluster,
}

impl Server {
    /// The supervisor's role in failures.
    fn supervisor(self) -> &'static str {
        match self {
            Server::Uvicorn => "uvicorn's master",
            Server::Gunicorn => "gunicorn's arbiter",
            Server::NodeCluster => "the cluster primary",
        }
    }

    /// Whether the supervisor runs an event loop of its own: Node's
    /// cluster primary is a libuv loop, gunicorn's arbiter runs its control
    /// server's asyncio loop in a thread; uvicorn's master has none (it
    /// sleeps on a timed futex and pings its workers' pipes).
    fn supervisor_has_a_loop(self) -> bool {
        !matches!(self, Server::Uvicorn)
    }

    /// Each handler's name (the log's `func`) by section kind.
    fn funcs(self) -> [(&'static str, &'static str); 2] {
        match self {
            Server::NodeCluster => [("cpu", "hashPassword"), ("sleep", "nap")],
            _ => [("cpu", "hash_password"), ("sleep", "nap")],
        }
    }

    /// How far apart a stall's on-CPU share and the victim's may be.
    fn share_points(self) -> f64 {
        match self {
            Server::NodeCluster => 10.0,
            _ => 5.0,
        }
    }

    fn command(self, log: &Path, port: u16) -> Command {
        let victims = victims_dir();
        let mut cmd;
        match self {
            Server::Uvicorn => {
                cmd = Command::new(asgi_python());
                cmd.args(["-m", "uvicorn", "py_service:app", "--app-dir"])
                    .arg(&victims)
                    .args(["--workers", "2", "--loop", "uvloop", "--http", "httptools"])
                    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--log-level", "warning"]);
            }
            Server::Gunicorn => {
                cmd = Command::new(asgi_python());
                cmd.args([
                    "-m",
                    "gunicorn",
                    "-w",
                    "2",
                    "-k",
                    "uvicorn.workers.UvicornWorker",
                ])
                .arg("--chdir")
                .arg(&victims)
                .args(["-b", &format!("127.0.0.1:{port}")])
                .args(["--log-level", "warning", "py_service:app"]);
            }
            Server::NodeCluster => {
                cmd = Command::new("node");
                cmd.arg(victims.join("node_cluster.js"))
                    .arg(log)
                    .arg(port.to_string());
            }
        }
        cmd.env("SERVICE_LOG", log);
        cmd
    }
}

/// A running server: its supervisor is the child, its workers share its
/// process group, and dropping it kills the whole group (a worker left
/// behind would hold the port).
struct Service {
    server: Server,
    victim: Victim,
    log: PathBuf,
    port: u16,
    seq: AtomicU64,
}

impl Service {
    fn start(server: Server, dir: &Scratch) -> Service {
        let log = dir.join("victim.jsonl");
        let port = free_port();
        let mut cmd = server.command(&log, port);
        cmd.process_group(0).stdout(Stdio::null());
        let victim = Victim::spawn(&mut cmd);
        Service {
            server,
            victim,
            log,
            port,
            seq: AtomicU64::new(0),
        }
    }

    fn supervisor_pid(&self) -> u32 {
        self.victim.pid()
    }

    /// The workers that said they are ready, in the order they did.
    fn ready_workers(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for r in read_log(&self.log) {
            if r["kind"] == "ready" {
                let pid = r["pid"].as_u64().expect("a ready record without a pid") as u32;
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// Waits until `n` workers not in `known` said they are ready (each a
    /// child of the supervisor); returns them.
    fn wait_for_new_workers(&mut self, known: &[u32], n: usize, timeout: Duration) -> Vec<u32> {
        let deadline = Instant::now() + timeout;
        loop {
            let new: Vec<u32> = self
                .ready_workers()
                .into_iter()
                .filter(|p| !known.contains(p))
                .collect();
            if new.len() >= n {
                for p in &new {
                    let ppid = parent_of(*p);
                    assert!(
                        ppid.is_none_or(|pp| pp == self.supervisor_pid()),
                        "worker {p}'s parent is {ppid:?}, not the supervisor {}",
                        self.supervisor_pid()
                    );
                }
                return new;
            }
            self.victim.assert_running();
            assert!(
                Instant::now() < deadline,
                "{:?}: {n} new worker(s) did not say ready within {timeout:?} (known {known:?}); log:\n{}",
                self.server,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The next request's number (its `seq`, logged by the worker).
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Request `seq` (`/hash` or `/nap`) blocking for `ms`, its response
    /// read to the end; the status must be 200.
    fn request(&self, path: &str, ms: u64, seq: u64) {
        let addr = ("127.0.0.1", self.port);
        let mut s = TcpStream::connect(addr).unwrap_or_else(|e| {
            panic!(
                "{:?}: connecting to 127.0.0.1:{}: {e}",
                self.server, self.port
            )
        });
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let req = format!(
            "GET {path}?ms={ms}&seq={seq} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut resp = Vec::new();
        s.read_to_end(&mut resp)
            .unwrap_or_else(|e| panic!("{:?}: reading the response to {path}: {e}", self.server));
        let head = String::from_utf8_lossy(&resp[..resp.len().min(64)]).into_owned();
        assert!(
            head.starts_with("HTTP/1.1 200"),
            "{:?}: {path} answered {head:?}",
            self.server
        );
    }

    /// Waits until a worker logged that it began serving request `seq`.
    fn wait_for_begin(&self, seq: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !read_log(&self.log)
            .iter()
            .any(|r| r["kind"] == "begin" && r["seq"] == seq)
        {
            assert!(
                Instant::now() < deadline,
                "{:?}: no worker began request {seq} within 10 s",
                self.server
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Sends requests in pairs, one on-CPU and one off-CPU, until each of
    /// `workers` logged `per_worker` sections of each kind, `ms` long, that
    /// started after `since_ns`. The second of a pair goes out once the
    /// first's handler has begun: its worker's loop is blocked then, so
    /// another worker takes the second (on a shared socket only an idle
    /// loop accepts; Node's primary hands connections round-robin), and no
    /// loop serves two sections in one stall. Bounded: 100 pairs.
    fn serve(&self, workers: &[u32], since_ns: u64, ms: u64, per_worker: usize) {
        let counts = || {
            let mut n: BTreeMap<(u32, String), usize> = BTreeMap::new();
            for s in sections(&self.log) {
                let long = s.truth.duration_ns() >= THRESHOLD_NS;
                if s.truth.start_ns >= since_ns && long == (ms * MS >= THRESHOLD_NS) {
                    *n.entry((s.pid, s.truth.kind.clone())).or_default() += 1;
                }
            }
            n
        };
        let done = |n: &BTreeMap<(u32, String), usize>| {
            workers.iter().all(|w| {
                ["cpu", "sleep"]
                    .iter()
                    .all(|k| n.get(&(*w, k.to_string())).copied().unwrap_or(0) >= per_worker)
            })
        };
        for i in 0..100 {
            if done(&counts()) {
                return;
            }
            // The kinds change places every pair: each worker gets both.
            let (a, b) = if i % 2 == 0 {
                ("/hash", "/nap")
            } else {
                ("/nap", "/hash")
            };
            let first = self.next_seq();
            std::thread::scope(|scope| {
                let h = scope.spawn(|| self.request(a, ms, first));
                self.wait_for_begin(first);
                self.request(b, ms, self.next_seq());
                if let Err(e) = h.join() {
                    std::panic::resume_unwind(e);
                }
            });
        }
        let n = counts();
        assert!(
            done(&n),
            "{:?}: after 100 pairs of requests the workers {workers:?} did not each serve \
             {per_worker} of each kind, {ms} ms long (a victim problem, not stallprof's): {n:?}",
            self.server
        );
    }

    /// Each of `workers` first serves each handler [`WARM_UPS`] times
    /// without blocking, then [`PER_WORKER`] blocking sections of each kind
    /// after `since_ns`.
    fn drive(&self, workers: &[u32], since_ns: u64) {
        self.serve(workers, since_ns, 0, WARM_UPS);
        self.serve(workers, since_ns, SECTION_MS, PER_WORKER);
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group this test made.
        unsafe { libc::kill(-(self.victim.pid() as libc::pid_t), libc::SIGKILL) };
    }
}

/// A process's parent, from /proc/PID/stat (None once it is gone).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the comm's closing parenthesis: state, then ppid.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// One blocking section as a worker logged it.
#[derive(Debug, Clone)]
struct Section {
    pid: u32,
    /// How long the request asked it to block (0: a warm-up).
    planned_ms: u64,
    truth: Truth,
}

/// The sections of the workers' log, in the order written.
fn sections(log: &Path) -> Vec<Section> {
    let entries = read_log(log);
    let kinds: Vec<&serde_json::Value> = entries
        .iter()
        .filter(|r| matches!(r["kind"].as_str(), Some("cpu" | "sleep")))
        .collect();
    let truth = python_truth(&entries);
    assert_eq!(kinds.len(), truth.len(), "sections and truth out of step");
    kinds
        .iter()
        .zip(truth)
        .map(|(r, truth)| Section {
            pid: r["pid"].as_u64().expect("a section without a pid") as u32,
            planned_ms: r["ms"].as_u64().expect("a section without its ms"),
            truth,
        })
        .collect()
}

/// `pid` as a whole word of `text` (not a part of a longer number).
fn names_pid(text: &str, pid: u32) -> bool {
    let p = pid.to_string();
    text.match_indices(&p).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + p.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_digit()) && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

/// Records `server` by its supervisor's pid while its workers serve
/// blocking requests (one killed and respawned when `kill_one`), then
/// checks the recording against the workers' log (module docs).
fn record_service(test: &str, server: Server, kill_one: bool) {
    if !require_root_and_bpf(test) {
        return;
    }
    if !matches!(server, Server::NodeCluster) {
        asgi_python();
    }
    let _serial = serial();
    let dir = Scratch::new(test);
    let out = dir.join("out");
    let mut svc = Service::start(server, &dir);
    let mut workers = svc.wait_for_new_workers(&[], 2, Duration::from_secs(30));
    let supervisor = svc.supervisor_pid();
    // Every process of the tree now, before the recording: the supervisor
    // and whatever else is not a worker (uvicorn's resource tracker).
    let others: BTreeSet<u32> = descendants(supervisor)
        .into_iter()
        .chain([supervisor])
        .filter(|p| !workers.contains(p))
        .collect();

    let mut prof = Profiler::spawn(&[
        "record".to_string(),
        "--threshold".into(),
        THRESHOLD.into(),
        "--duration".into(),
        "120s".into(), // a backstop only: the test stops it with SIGINT
        "-o".into(),
        out.display().to_string(),
        "--pid".into(),
        supervisor.to_string(),
    ]);
    wait_for_attach(&mut prof, Duration::from_secs(30));
    let attached_ns = monotonic_ns();
    svc.drive(&workers, attached_ns);
    if kill_one {
        let victim = workers[0];
        // SAFETY: kill(2) on a worker of the service this test started.
        unsafe { libc::kill(victim as libc::pid_t, libc::SIGKILL) };
        let known: Vec<u32> = workers.clone();
        let new = svc.wait_for_new_workers(&known, 1, Duration::from_secs(30));
        let killed_at = monotonic_ns();
        svc.drive(&new, killed_at);
        workers.extend(new);
    }
    let stopped_ns = monotonic_ns();
    prof.signal(libc::SIGINT);
    let run = prof.wait(Duration::from_secs(60));
    assert!(
        run.status.success(),
        "stallprof record --pid {supervisor} ({}), stopped by SIGINT, failed:\n{}",
        server.supervisor(),
        run.describe()
    );
    svc.victim.assert_running();

    // The sections recorded: whole, between attach and stop.
    let all = sections(&svc.log);
    let recorded: Vec<&Section> = all
        .iter()
        .filter(|s| s.truth.start_ns >= attached_ns && s.truth.end_ns <= stopped_ns)
        .filter(|s| s.truth.duration_ns() >= THRESHOLD_NS)
        .collect();
    for s in &recorded {
        assert!(
            workers.contains(&s.pid),
            "a section logged by {}, not a worker that said ready ({workers:?})",
            s.pid
        );
    }

    let rec = load_recording(&out);
    let raw = read_stalls_json(&out.join("stalls.json"));
    let stall_pid = |i: usize| raw["stalls"][i]["pid"].as_u64().map(|p| p as u32);
    let mut table = String::from("workers' log (recorded sections):\n");
    for s in &recorded {
        table.push_str(&format!(
            "  pid {} {:<6} {:<14} tid {} [{} .. {}] {:.2} ms (cpu {:.2} ms)\n",
            s.pid,
            s.truth.kind,
            s.truth.func,
            s.truth.tid,
            s.truth.start_ns,
            s.truth.end_ns,
            ms(s.truth.duration_ns()),
            ms(s.truth.cpu_ns)
        ));
    }
    let mut stalls_text = stalls_table(&rec);
    for (i, _) in rec.stalls.iter().enumerate() {
        stalls_text.push_str(&format!("  stall #{i} pid {:?}\n", stall_pid(i)));
    }
    let mut c = Checks::new(format!(
        "{server:?}: supervisor {supervisor}, workers {workers:?}, other processes {others:?}\n\
         {table}\n{stalls_text}\nsummary:\n{}",
        run.stdout
    ));
    check_contract(&mut c, &rec, THRESHOLD_NS);
    c.check(rec.pid == supervisor, || {
        format!(
            "stalls.json pid is {}, want the supervisor {supervisor}",
            rec.pid
        )
    });

    // Every section found, in its own process and thread.
    let mut matched = 0;
    for s in &recorded {
        let t = &s.truth;
        let best = rec
            .stalls
            .iter()
            .enumerate()
            .filter(|(i, st)| {
                stall_pid(*i) == Some(s.pid)
                    && u64::from(st.tid) == t.tid
                    && st.overlaps(t.start_ns, t.end_ns)
            })
            .max_by_key(|(_, st)| st.end_ns.min(t.end_ns) - st.start_ns.max(t.start_ns));
        let Some((_, st)) = best else { continue };
        matched += 1;
        // The shares of the planned blocks only: a warm-up request pushed
        // over the threshold by a wait for a CPU is matched above, but its
        // stall holds the worker's one-time work on its first requests
        // (the reason for warming up) around a section of about no CPU.
        if s.planned_ms != SECTION_MS {
            continue;
        }
        // Both as shares of the stall: it also holds what the section does
        // not see (the request's parsing, and on a busy machine the wait
        // for a CPU once woken), so the victim's CPU time is put over the
        // stall's length too.
        let ours = 100.0 * st.on_cpu_ns as f64 / st.duration_ns as f64;
        let theirs = 100.0 * t.cpu_ns.min(st.duration_ns) as f64 / st.duration_ns as f64;
        let points = server.share_points();
        c.check((ours - theirs).abs() <= points, || {
            format!(
                "pid {} {}: the stall is {ours:.1}% on-CPU, the victim's clock says {theirs:.1}%: \
                 more than {points} points apart ({})",
                s.pid,
                t.who(),
                st.summary()
            )
        });
        println!(
            "SHARE {server:?} pid {} {:<14} measured {ours:5.1}% on-CPU, truth {theirs:5.1}%",
            s.pid, t.func
        );
    }
    let percent = 100.0 * matched as f64 / recorded.len().max(1) as f64;
    println!(
        "MATCHED {server:?}: {matched} of {} sections ({percent:.1}%)",
        recorded.len()
    );
    c.check(!recorded.is_empty(), || "no section was recorded".into());
    c.check(percent >= MATCHED_PERCENT, || {
        format!(
            "{matched} of {} sections matched by a stall in the same pid and tid \
             ({percent:.1}%, want ≥ {MATCHED_PERCENT}%)",
            recorded.len()
        )
    });
    for (kind, func) in server.funcs() {
        c.check(
            recorded
                .iter()
                .any(|s| s.truth.kind == kind && s.truth.func == func),
            || format!("no {kind} section of {func} was recorded"),
        );
    }

    // Stalls in every worker, the respawned one too; none elsewhere.
    let by_pid: BTreeMap<Option<u32>, usize> =
        (0..rec.stalls.len()).fold(BTreeMap::new(), |mut m, i| {
            *m.entry(stall_pid(i)).or_default() += 1;
            m
        });
    for w in &workers {
        c.check(by_pid.contains_key(&Some(*w)), || {
            format!("no stall in worker {w} (stalls by pid: {by_pid:?})")
        });
    }
    for (pid, n) in &by_pid {
        match pid {
            None => c.fail(format!("{n} stall(s) in stalls.json carry no pid")),
            Some(p) if *p == supervisor => {
                // A loop of the supervisor's own (Node's primary; gunicorn's
                // control server, an asyncio loop in a thread) may wait for
                // a CPU the workers hold: that alone is a stall. Its waits
                // and work never are, and uvicorn's master has no loop.
                let own: Vec<String> = rec
                    .stalls
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| stall_pid(*i) == Some(*p))
                    .filter(|(_, st)| {
                        !server.supervisor_has_a_loop()
                            || st.off_cpu_ns > 0
                            || st.runqueue_ns * 10 < st.duration_ns * 9
                    })
                    .map(|(_, st)| st.summary())
                    .collect();
                c.check(own.is_empty(), || {
                    format!(
                        "{} of {n} stall(s) in the supervisor {p} ({}) are not a loop of its own \
                         waiting for a CPU: {own:#?}",
                        own.len(),
                        server.supervisor()
                    )
                });
            }
            Some(p) if !workers.contains(p) => c.fail(format!(
                "{n} stall(s) in pid {p}, not a worker{}",
                if others.contains(p) {
                    " (a helper process of the server)"
                } else {
                    ""
                }
            )),
            _ => {}
        }
    }

    // The processes, by role (docs/format.md): the target is the
    // supervisor, each worker a worker of its own number (a respawned one
    // takes the next, not its predecessor's); the summary names them.
    let processes = raw["processes"].as_array().cloned().unwrap_or_default();
    let role_of = |pid: u32| {
        processes
            .iter()
            .find(|p| p["pid"].as_u64() == Some(u64::from(pid)))
            .map(|p| p["role"].as_str().unwrap_or("").to_string())
    };
    c.check(raw["processes"].is_array(), || {
        "stalls.json has no `processes` array".into()
    });
    let sup_role = role_of(supervisor);
    c.check(sup_role.as_deref() == Some("supervisor"), || {
        format!(
            "the supervisor {supervisor} ({}) has role {sup_role:?} in stalls.json's processes, \
             want \"supervisor\": {processes:?}",
            server.supervisor()
        )
    });
    let mut roles: BTreeMap<String, u32> = BTreeMap::new();
    for w in &workers {
        let role = role_of(*w).unwrap_or_default();
        let ok = match server {
            Server::NodeCluster => role.starts_with("cluster worker "),
            _ => role.starts_with("worker ") && role.contains(" of "),
        };
        c.check(ok, || {
            format!("worker {w} has role {role:?} in stalls.json's processes: {processes:?}")
        });
        if let Some(other) = roles.insert(role.clone(), *w) {
            c.fail(format!(
                "workers {other} and {w} have the same role {role:?}"
            ));
        }
        c.check(names_pid(&run.stdout, *w), || {
            format!("record's summary does not name worker {w}")
        });
    }
    c.finish();
}

/// Every descendant of `pid` now (children first).
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}

#[test]
fn record_uvicorn_workers_by_the_masters_pid() {
    record_service(
        "record_uvicorn_workers_by_the_masters_pid",
        Server::Uvicorn,
        true,
    );
}

#[test]
fn record_gunicorn_workers_by_the_arbiters_pid() {
    record_service(
        "record_gunicorn_workers_by_the_arbiters_pid",
        Server::Gunicorn,
        true,
    );
}

#[test]
fn record_node_cluster_workers_by_the_primarys_pid() {
    record_service(
        "record_node_cluster_workers_by_the_primarys_pid",
        Server::NodeCluster,
        false,
    );
}

/// `stallprof top --pid <uvicorn master>`, its screens written to a file
/// (stdout not a terminal: it draws every second until a signal), shows a
/// row for each worker while both serve blocking requests.
#[test]
fn top_uvicorn_shows_each_worker() {
    let test = "top_uvicorn_shows_each_worker";
    if !require_root_and_bpf(test) {
        return;
    }
    asgi_python();
    let _serial = serial();
    let dir = Scratch::new(test);
    let mut svc = Service::start(Server::Uvicorn, &dir);
    let workers = svc.wait_for_new_workers(&[], 2, Duration::from_secs(30));
    let supervisor = svc.supervisor_pid();
    let screens = dir.join("top.out");
    let mut top = Victim::spawn(
        Command::new(stallprof_bin())
            .args(["top", "--threshold", THRESHOLD, "--pid"])
            .arg(supervisor.to_string())
            .stdout(std::fs::File::create(&screens).unwrap())
            .stderr(std::fs::File::create(dir.join("top.err")).unwrap()),
    );
    let read = || std::fs::read_to_string(&screens).unwrap_or_default();
    let err = || std::fs::read_to_string(dir.join("top.err")).unwrap_or_default();
    // Its first screen: the probes are in.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !read().contains("stallprof top") {
        top.assert_running();
        assert!(
            Instant::now() < deadline,
            "stallprof top drew no screen within 30 s; stderr:\n{}",
            err()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    svc.drive(&workers, monotonic_ns());
    // The last screen drawn (each starts by clearing the terminal).
    let last = |text: &str| text.rsplit("\x1b[2J").next().unwrap_or("").to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    let screen = loop {
        let screen = last(&read());
        if workers.iter().all(|w| names_pid(&screen, *w)) || Instant::now() >= deadline {
            break screen;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // SAFETY: kill(2) on the stallprof this test started.
    unsafe { libc::kill(top.pid() as libc::pid_t, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = top.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "stallprof top did not exit within 30 s of SIGINT"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let screen = screen.replace('\r', "");
    eprintln!("stallprof top's last screen:\n{screen}");
    assert!(
        status.success(),
        "stallprof top exited {status}; stderr:\n{}",
        err()
    );
    for w in &workers {
        assert!(
            screen.lines().any(|l| names_pid(l, *w)),
            "stallprof top --pid {supervisor} (uvicorn's master) shows no row for worker {w} \
             (workers {workers:?}):\n{screen}"
        );
    }
}
