//! Tier 3: the demo's recording, opened in the viewers people use, in a
//! real browser (issue 37). The demo gateway (demo/gateway.py) is recorded
//! as `cargo xtask demo` does; then, in headless Chromium driven by
//! playwright (tests/browser/viewers.py, which writes what each page shows
//! as JSON):
//! - speedscope 1.25 (npm) opens `stalls.speedscope.json` from `file://`
//!   through a loader script (`#localProfilePath=`, as speedscope's own CLI
//!   does) with no request beyond `file://`; hovering each stall's middle
//!   on its Time Order view shows a root frame named `stall …` lasting as
//!   long as the stall (speedscope's tooltip, DOM); its Sandwich table
//!   (DOM) ranks the top culprit functions near the top by total time,
//!   their total within 1% of the stall time of the summary's share, and
//!   no `[task …]` frame;
//! - inferno's Search in `stalls.svg` reports, for each top culprit, a
//!   "Matched: X%" within 1 point of the summary's share, with no console
//!   error;
//! - Go's `pprof -http` serves a flame graph whose tree (the page's `data`)
//!   names the culprit and holds no `[[…]]` frame, and `-tagfocus
//!   culprit_function=NAME`, as typed, selects that culprit's share;
//! - `stallprof report DIR --serve` listens on 127.0.0.1 only
//!   (/proc/net/tcp), serves the page of stalls, the SVG and speedscope
//!   with the recording loaded, with no request beyond it, refuses paths
//!   out of its directories, and stops on SIGINT with status 0;
//! - no line of the summary is wider than 120 columns at the default
//!   width (stdout not a terminal), the output directory's path (kept
//!   whole, to be copied) counted as `DIR`.
//!
//! The summary's shares are computed here by the owner of the summary's
//! words, `report::aggregate::blame`, by culprit function. Everything this
//! needs is installed by `cargo xtask setup --tests` (Debian chromium,
//! golang-1.19-go; playwright in target/asgi-venv; npm speedscope under
//! target/viewer-test-deps); a missing piece FAILS the test, naming it.
mod common;

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use common::*;
use stallprof::{model::Recording, report::aggregate};

const CHROMIUM: &str = "/usr/bin/chromium";
const PPROF: &str = "/usr/lib/go-1.19/pkg/tool/linux_amd64/pprof";
const WIDEST: usize = 120;

fn driver() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/viewers.py")
}

fn speedscope_package() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/viewer-test-deps/node/node_modules/speedscope")
}

/// What the test needs, each checked; FAILS naming every missing piece and
/// what installs it (never a silent pass).
fn require_viewers() -> PathBuf {
    let python = asgi_python();
    let mut missing = Vec::new();
    if !Path::new(CHROMIUM).exists() {
        missing.push("Debian's chromium (apt-get install chromium chromium-driver)".to_string());
    }
    if !Path::new(PPROF).exists() {
        missing.push("Go's pprof (apt-get install golang-1.19-go graphviz)".to_string());
    }
    let playwright = Command::new(&python)
        .args(["-c", "import playwright.sync_api"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !playwright {
        missing.push(format!(
            "playwright in {} (pip install playwright, pinned in xtask)",
            python.display()
        ));
    }
    if !speedscope_package()
        .join("dist/release/index.html")
        .is_file()
    {
        missing.push(format!(
            "npm speedscope@1.25.0 under {}",
            speedscope_package().display()
        ));
    }
    assert!(
        missing.is_empty(),
        "\n\nthe viewer test CANNOT RUN: missing {}.\n`cargo xtask setup --tests` (as root) installs \
         all of them, pinned; it never passes without them.\n",
        missing.join("; ")
    );
    python
}

/// Runs the browser driver on one view; its JSON.
fn drive(
    python: &Path,
    scratch: &Scratch,
    view: &str,
    url: &str,
    input: Option<String>,
) -> serde_json::Value {
    let out = scratch.join(&format!("{view}.json"));
    let mut cmd = Command::new(python);
    cmd.arg(driver()).args([view, url]).arg(&out);
    if let Some(i) = input {
        let p = scratch.join(&format!("{view}-in.json"));
        std::fs::write(&p, i).unwrap();
        cmd.arg(p);
    }
    let t = Instant::now();
    let o = cmd.output().expect("running the browser driver");
    assert!(
        o.status.success(),
        "the browser driver on {view} ({url}) failed: {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    eprintln!("viewers: {view} took {:.1}s", t.elapsed().as_secs_f64());
    serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap()
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Stall time by culprit function (the summary's owner of blame), as a
/// share of all stall time, heaviest first.
fn culprit_shares(rec: &Recording) -> Vec<(String, f64)> {
    let app = rec.app();
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for s in &rec.stalls {
        for p in &s.stacks {
            if let Some(b) = aggregate::blame(p, &app) {
                *by.entry(b.frame.name.to_string()).or_default() += p.weight_ns;
            }
        }
    }
    let total = rec.total_stall_ns() as f64;
    let mut v: Vec<(String, f64)> = by
        .into_iter()
        .map(|(f, ns)| (f, ns as f64 / total))
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// speedscope's duration text (`422.13ms`, `1.79s`) in ns.
fn speedscope_ns(text: &str) -> Option<f64> {
    let t = text.trim();
    let num_end = t.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let n: f64 = t[..num_end].parse().ok()?;
    let unit = t[num_end..].split_whitespace().next()?;
    Some(match unit {
        "ns" => n,
        "µs" => n * 1e3,
        "ms" => n * 1e6,
        "s" => n * 1e9,
        "min" => n * 60e9,
        _ => return None,
    })
}

/// A JavaScript regular expression matching `name` alone as a frame's
/// function (its label: the name, then ` (file:line)` or nothing).
fn frame_regex(name: &str) -> String {
    let mut r = String::from("^");
    for c in name.chars() {
        if "\\^$.|?*+()[]{}/".contains(c) {
            r.push('\\');
        }
        r.push(c);
    }
    r.push_str("( \\(|$)");
    r
}

fn is_function(symbol: &str, name: &str) -> bool {
    symbol == name || symbol.starts_with(&format!("{name} ("))
}

/// Standard base64 with padding (what speedscope's loader decodes).
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A child killed when dropped (pprof's server, `report --serve`).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} never listened on 127.0.0.1:{port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The status of a raw `GET target` (sent as typed: no client cleans `..`).
fn raw_status(port: u16, target: &str) -> u16 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut head = String::new();
    let _ = s.read_to_string(&mut head);
    head.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// The TCP sockets listening on `port` (/proc/net/tcp and tcp6), as
/// their local addresses in the kernel's hex.
fn listeners_on(port: u16) -> Vec<String> {
    let mut v = Vec::new();
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state)) = (cols.get(1), cols.get(3)) else {
                continue;
            };
            let Some((addr, p)) = local.split_once(':') else {
                continue;
            };
            if *state == "0A" && u16::from_str_radix(p, 16).ok() == Some(port) {
                v.push(addr.to_string());
            }
        }
    }
    v
}

/// No line wider than [`WIDEST`] columns, counting the scratch directory's
/// path (which the summary keeps whole, to be copied: `wrote, in DIR/:`,
/// the pprof command) as the three columns of `DIR`.
fn assert_lines_fit(what: &str, text: &str, dir: &Path) {
    let dir = dir.to_string_lossy();
    for line in text.lines() {
        let cols = line.replace(&*dir, "DIR").chars().count();
        assert!(
            cols <= WIDEST,
            "{what}: a summary line of {cols} columns (the default width is {WIDEST}):\n{line}"
        );
    }
}

#[test]
fn the_demo_reads_right_in_speedscope_the_svg_pprof_and_report_serve() {
    if !require_root_and_bpf("viewers") {
        return;
    }
    let _serial = serial();
    let python = require_viewers();
    let scratch = Scratch::new("viewers");
    let rec_dir = scratch.join("rec");
    let gateway = Path::new(env!("CARGO_MANIFEST_DIR")).join("../demo/gateway.py");

    // The demo, recorded as `cargo xtask demo` records it.
    let t = Instant::now();
    let out = run_stallprof(
        &[
            "record".as_ref(),
            "--threshold".as_ref(),
            "20ms".as_ref(),
            "-o".as_ref(),
            rec_dir.as_os_str(),
            "--".as_ref(),
            "python3".as_ref(),
            gateway.as_os_str(),
            "4".as_ref(),
        ],
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "record failed:\n{}", out.describe());
    eprintln!(
        "viewers: recording the demo took {:.1}s",
        t.elapsed().as_secs_f64()
    );
    assert_lines_fit("record", &out.stdout, &scratch.path);
    let report = run_stallprof(
        &[
            "report".as_ref(),
            rec_dir.as_os_str(),
            "-o".as_ref(),
            scratch.join("rep").as_os_str(),
        ],
        Duration::from_secs(60),
    );
    assert!(report.status.success(), "{}", report.describe());
    assert_lines_fit("report", &report.stdout, &scratch.path);

    let rec = stallprof::report::read_json(&rec_dir).unwrap();
    assert!(
        rec.stalls.len() >= 3,
        "the demo made {} stalls",
        rec.stalls.len()
    );
    let shares = culprit_shares(&rec);
    let top: Vec<(String, f64)> = shares
        .iter()
        .filter(|(_, s)| *s >= 0.05)
        .take(3)
        .cloned()
        .collect();
    assert!(
        !top.is_empty(),
        "no culprit with 5% of the stall time: {shares:?}"
    );
    assert!(
        top.iter()
            .any(|(f, _)| f == "load_tokenizer" || f.starts_with("build_tls_contexts")),
        "the demo's top culprits are its setup functions: {shares:?}"
    );
    let total_ns = rec.total_stall_ns() as f64;

    // speedscope from file://, through a loader script as its CLI writes it.
    let app = speedscope_package().join("dist/release");
    let ss_file = rec_dir.join("stalls.speedscope.json");
    let ss: serde_json::Value = serde_json::from_slice(&std::fs::read(&ss_file).unwrap()).unwrap();
    assert_eq!(
        ss["profiles"].as_array().map(Vec::len),
        Some(1),
        "one loop thread in the demo"
    );
    let (start, end) = (
        ss["profiles"][0]["startValue"].as_f64().unwrap(),
        ss["profiles"][0]["endValue"].as_f64().unwrap(),
    );
    let first = rec.first_ns();
    let fractions: Vec<f64> = rec
        .stalls
        .iter()
        .map(|s| (((s.start_ns + s.end_ns) / 2 - first) as f64 - start) / (end - start))
        .collect();
    let loader = scratch.join("loader.js");
    {
        let b64 = base64(&std::fs::read(&ss_file).unwrap());
        std::fs::write(
            &loader,
            format!("speedscope.loadFileFromBase64(\"stalls.speedscope.json\", \"{b64}\")"),
        )
        .unwrap();
    }
    let url = format!(
        "file://{}/index.html#localProfilePath={}&view=time-ordered",
        app.display(),
        loader.display()
    );
    let r = drive(
        &python,
        &scratch,
        "speedscope",
        &url,
        Some(serde_json::to_string(&fractions).unwrap()),
    );
    let requests = strings(&r["requests"]);
    assert!(
        requests.iter().all(|u| u.starts_with("file://")),
        "speedscope made a network request: {requests:?}"
    );
    assert_eq!(
        strings(&r["console_errors"]),
        Vec::<String>::new(),
        "speedscope's console"
    );
    assert!(
        r["title"].as_str().unwrap_or("").starts_with(&rec.title()),
        "speedscope did not load the recording: title {:?}",
        r["title"]
    );
    let hovers = r["hovers"].as_array().unwrap();
    for (s, h) in rec.stalls.iter().zip(hovers) {
        let h = h.as_str().unwrap_or_else(|| {
            panic!(
                "Time Order: nothing under the middle of the stall at {} ns: {r:#}",
                s.start_ns
            )
        });
        let (dur, name) = h.split_once(") ").unwrap_or(("", h));
        let ns = speedscope_ns(dur).unwrap_or(f64::NAN);
        assert!(
            name.starts_with("stall ") && (ns - s.duration_ns as f64).abs() <= 0.01e6,
            "Time Order: the stall of {} ns shows as {h:?}",
            s.duration_ns
        );
    }
    let rows = |key: &str| -> Vec<(f64, String)> {
        r[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| {
                let cells = strings(row);
                (speedscope_ns(&cells[0]).unwrap_or(0.0), cells[2].clone())
            })
            .collect()
    };
    let (by_self, by_total) = (rows("sandwich_by_self"), rows("sandwich_by_total"));
    assert!(!by_total.is_empty(), "an empty Sandwich table: {r:#}");
    for (_, sym) in by_self.iter().chain(&by_total) {
        assert!(
            !sym.starts_with("[task"),
            "a task frame in speedscope's Sandwich view: {sym}"
        );
    }
    // The culprits holding a fifth of the stall time or more (the top one
    // always) rank in the first 12 rows by total time: above them only
    // their callers and what they called.
    for (i, (f, share)) in top.iter().enumerate() {
        if i > 0 && *share < 0.2 {
            continue;
        }
        let rank = by_total.iter().position(|(_, sym)| is_function(sym, f));
        let Some(rank) = rank.filter(|&i| i < 12) else {
            panic!("Sandwich by total time: {f} is not among the first 12 rows: {by_total:#?}")
        };
        let ns: f64 = by_total
            .iter()
            .filter(|(_, sym)| is_function(sym, f))
            .map(|(ns, _)| ns)
            .sum();
        assert!(
            (ns - share * total_ns).abs() <= 0.01 * total_ns,
            "Sandwich: {f} (row {rank}) totals {:.1}ms, the summary's share is {:.1}ms",
            ns / 1e6,
            share * total_ns / 1e6
        );
    }

    // The SVG: inferno's Search, each top culprit's "Matched: X%".
    let terms: Vec<String> = top.iter().map(|(f, _)| frame_regex(f)).collect();
    let svg_url = format!("file://{}", rec_dir.join("stalls.svg").display());
    let r = drive(
        &python,
        &scratch,
        "svg",
        &svg_url,
        Some(serde_json::to_string(&terms).unwrap()),
    );
    assert_eq!(
        strings(&r["console_errors"]),
        Vec::<String>::new(),
        "the SVG's console"
    );
    assert!(
        strings(&r["requests"])
            .iter()
            .all(|u| u.starts_with("file://"))
    );
    for ((f, share), term) in top.iter().zip(&terms) {
        let text = r["matched"][term].as_str().unwrap_or("");
        let pct: f64 = text
            .trim_start_matches("Matched: ")
            .trim_end_matches('%')
            .parse()
            .unwrap_or_else(|_| panic!("search for {term}: {text:?}"));
        assert!(
            (pct - share * 100.0).abs() <= 1.0,
            "the SVG's search for {f} matched {pct}%, the summary's share is {:.1}%",
            share * 100.0
        );
    }

    // pprof's web UI, and -tagfocus on the plain culprit label.
    let pb = rec_dir.join("stalls.pb.gz");
    let port = free_port();
    let _pprof = Killed(
        Command::new(PPROF)
            .arg(format!("-http=127.0.0.1:{port}"))
            .arg("-no_browser")
            .arg(&pb)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting pprof"),
    );
    wait_for_port(port, "pprof -http");
    let r = drive(
        &python,
        &scratch,
        "pprof",
        &format!("http://127.0.0.1:{port}/ui/flamegraph"),
        None,
    );
    let names = strings(&r["names"]);
    assert!(names.len() > 10, "pprof's flame graph has no tree: {r:#}");
    let bracketed: Vec<&String> = names.iter().filter(|n| n.contains("[[")).collect();
    assert!(
        bracketed.is_empty(),
        "pprof's flame graph has [[…]] frames: {bracketed:?}"
    );
    assert!(
        names.iter().any(|n| is_function(n, &top[0].0)),
        "pprof's flame graph lacks {}",
        top[0].0
    );
    assert!(
        strings(&r["requests"])
            .iter()
            .all(|u| u.starts_with(&format!("http://127.0.0.1:{port}/"))),
        "pprof's page asked for more than its server: {:?}",
        r["requests"]
    );
    for (f, share) in &top {
        let o = Command::new(PPROF)
            .args(["-top", "-nodefraction=0", "-nodecount=0"])
            .arg(format!("-tagfocus=culprit_function={f}"))
            .arg(&pb)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        let pct: f64 = text
            .lines()
            .find_map(|l| {
                let rest = l.trim().strip_prefix("Showing nodes accounting for ")?;
                rest.split(", ").nth(1)?.split('%').next()?.parse().ok()
            })
            .unwrap_or_else(|| panic!("pprof -top -tagfocus culprit_function={f}:\n{text}"));
        assert!(
            (pct - share * 100.0).abs() <= 1.0,
            "-tagfocus culprit_function={f} selects {pct}%, the summary's share is {:.1}%",
            share * 100.0
        );
    }

    // report --serve: 127.0.0.1 only, the page, the SVG and speedscope.
    let mut child = Command::new(stallprof_bin())
        .arg("report")
        .arg(&rec_dir)
        .arg("-o")
        .arg(scratch.join("served"))
        .arg("--serve")
        .arg("--speedscope")
        .arg(speedscope_package())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let pid = child.id();
    let mut serving = Killed(child);
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let url = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("report --serve never printed its URL");
        if let Some(i) = line.find("http://") {
            break line[i..].split_whitespace().next().unwrap().to_string();
        }
    };
    let port: u16 = url
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        url.starts_with("http://127.0.0.1:"),
        "report --serve printed {url}"
    );
    assert_eq!(
        listeners_on(port),
        vec!["0100007F".to_string()],
        "report --serve must listen on 127.0.0.1 only"
    );
    let r = drive(&python, &scratch, "served", &url, None);
    assert!(
        r["index_title"]
            .as_str()
            .unwrap_or("")
            .starts_with(&rec.title()),
        "the page: {r:#}"
    );
    assert_eq!(
        r["rows"].as_array().map(Vec::len),
        Some(rec.stalls.len()),
        "the page lists every stall: {r:#}"
    );
    let links: Vec<String> = r["links"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l[1].as_str().map(String::from))
        .collect();
    for f in [
        "/stalls.svg",
        "/stalls.speedscope.json",
        "/stalls.pftrace",
        "/stalls.json",
        "/stalls.pb.gz",
    ] {
        assert!(
            links.iter().any(|l| l == f),
            "the page links {f}: {links:?}"
        );
    }
    assert_eq!(r["svg"][0].as_u64(), Some(200), "the SVG: {:?}", r["svg"]);
    assert!(
        r["speedscope_title"]
            .as_str()
            .unwrap_or("")
            .starts_with(&rec.title()),
        "speedscope from the page did not load the recording: {r:#}"
    );
    let requests = strings(&r["requests"]);
    assert!(
        requests.iter().all(|u| u.starts_with(&url)),
        "the served pages asked for more than the server: {requests:?}"
    );
    for target in [
        "/../stalls.json",
        "/speedscope/../../package.json",
        "/speedscope/../../../../../../etc/passwd",
        "/%2e%2e/stalls.json",
        "//etc/passwd",
        "/events.bin.gz",
    ] {
        assert_eq!(raw_status(port, target), 404, "GET {target}");
    }
    assert_eq!(raw_status(port, "/stalls.json"), 200);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = serving.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "report --serve did not stop on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "report --serve stopped by SIGINT: {status}"
    );
    let printed = reader.join().unwrap();
    assert!(printed.contains("stopped serving"), "{printed}");
    assert_lines_fit("report --serve", &printed, &scratch.path);
}
