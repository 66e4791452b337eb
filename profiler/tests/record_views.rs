//! The views of a recording, root integration tests (issue 14, items 5
//! and 6):
//!
//! - `python_default_view_shows_the_users_code`: `stallprof record` of the
//!   asyncio gateway (victims/py_gateway.py) on CPython 3.11. Its
//!   stalls.folded (and so stalls.svg, drawn from the same view) holds no
//!   interpreter frame (`_PyEval_EvalFrameDefault`, `Py_RunMain`, …) and no
//!   loop root (`BaseEventLoop.run_forever`), yet keeps the C extensions
//!   under their Python caller: zlib under `Gateway.compress_payload`,
//!   `_ssl`/libssl under `Gateway.make_tls_contexts`. `report --native all`
//!   of the same recording keeps every frame, with the same total. Its
//!   frames are one per function (`handle_request (py_gateway.py)`), a
//!   line each with `report --lines`; no task frame, unless `report
//!   --group-by task`, which roots every stack in its task.
//! - `report_diff_names_what_changed`: `report --diff` of a recording with
//!   itself is all zero; against a copy whose compress step was fixed
//!   (its stacks removed), diff.folded has `Gateway.compress_payload` only
//!   in BEFORE and diff-before.svg (BEFORE's widths) names it.
//! - `top_in_tmux_shows_the_culprit`: `stallprof top --pid` in a real
//!   terminal (tmux) against a running gateway shows the culprit and a
//!   non-zero stall rate; `q` quits it and no `sp_` program stays loaded.
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).
mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::*;

/// A gateway recording: (scratch dir, output dir).
fn record_gateway(test: &str, requests: &str) -> Option<(Scratch, PathBuf)> {
    if !require_root_and_bpf(test) {
        return None;
    }
    let python = require_python(3, 11);
    let _serial = serial();
    let dir = Scratch::new(test);
    let out = dir.join("out");
    let log = dir.join("victim.jsonl");
    let script = victims_dir().join("py_gateway.py");
    let run = run_stallprof(
        &[
            "record".as_ref(),
            "--threshold".as_ref(),
            "40ms".as_ref(),
            "-o".as_ref(),
            out.as_os_str(),
            "--".as_ref(),
            python.as_os_str(),
            script.as_os_str(),
            log.as_os_str(),
            "--requests".as_ref(),
            requests.as_ref(),
        ],
        Duration::from_secs(90),
    );
    assert!(
        run.status.success(),
        "stallprof record of the gateway failed:\n{}",
        run.describe()
    );
    Some((dir, out))
}

/// The frames of each folded line, with its weight.
fn stacks(folded: &str) -> Vec<(Vec<&str>, u64)> {
    folded
        .lines()
        .filter_map(|l| {
            let (stack, w) = l.rsplit_once(' ')?;
            Some((stack.split(';').collect(), w.parse().ok()?))
        })
        .collect()
}

/// Is there a stack where a frame starting with `caller` has, above it, a
/// frame for which `callee` holds?
fn called_under(folded: &str, caller: &str, callee: impl Fn(&str) -> bool) -> bool {
    stacks(folded).iter().any(|(frames, _)| {
        frames
            .iter()
            .position(|f| f.starts_with(caller))
            .is_some_and(|i| frames[i + 1..].iter().any(|f| callee(f)))
    })
}

/// A native frame: its label has no `.py` file.
fn native(f: &str) -> bool {
    !f.contains(".py:") && !f.contains(".py)") && !f.starts_with('[')
}

fn render(test: &str, rec: &Path, args: &[&str]) -> String {
    let out = Scratch::new(test);
    let dst = out.join("r");
    let mut argv: Vec<&std::ffi::OsStr> = vec!["report".as_ref(), rec.as_os_str()];
    argv.extend(args.iter().map(|a| std::ffi::OsStr::new(*a)));
    argv.extend(["-o".as_ref(), dst.as_os_str()]);
    let run = run_stallprof(&argv, Duration::from_secs(60));
    assert!(
        run.status.success(),
        "stallprof report {args:?} failed:\n{}",
        run.describe()
    );
    std::fs::read_to_string(dst.join("stalls.folded")).unwrap()
}

#[test]
fn python_default_view_shows_the_users_code() {
    let Some((_dir, out)) = record_gateway("views-python", "4") else {
        return;
    };
    let folded = std::fs::read_to_string(out.join("stalls.folded")).unwrap();
    let all = render("views-python-all", &out, &["--native", "all"]);
    let ctx = || {
        format!(
            "default view:\n{folded}\n--native all (first lines):\n{}",
            all.lines().take(5).collect::<Vec<_>>().join("\n")
        )
    };
    // The recording itself has the interpreter's frames (each
    // `_PyEval_EvalFrameDefault` activation is already replaced by the
    // Python frames it ran, see pyframes.rs): the view removed the rest.
    // (Named from libpython's symbol table: its inlined helpers, such as
    // `_PyObject_VectorcallTstate`, are not read, see symbolize::dwarf_wanted.)
    for kept in ["_PyEval_Vector", "Py_RunMain"] {
        assert!(all.contains(kept), "--native all lost {kept}\n{}", ctx());
    }
    assert!(
        all.contains("BaseEventLoop.run_forever"),
        "--native all lost the loop root\n{}",
        ctx()
    );
    for gone in [
        "_PyEval_",
        "Py_RunMain",
        "_PyObject_Vectorcall",
        "pymain_",
        "__libc_start",
        "BaseEventLoop.run_forever",
        "Handle._run",
    ] {
        assert!(
            !folded.contains(gone),
            "the default view still shows {gone}\n{}",
            ctx()
        );
    }
    assert!(
        called_under(&folded, "Gateway.compress_payload", |f| native(f)
            && (f.contains("zlib") || f.contains("deflate"))),
        "no zlib frame under Gateway.compress_payload\n{}",
        ctx()
    );
    assert!(
        called_under(&folded, "Gateway.make_tls_contexts", |f| native(f)
            && (f.contains("_ssl") || f.contains("SSL") || f.contains("X509"))),
        "no _ssl/libssl frame under Gateway.make_tls_contexts\n{}",
        ctx()
    );
    let total = |f: &str| stacks(f).iter().map(|(_, w)| w).sum::<u64>();
    let (t, ta) = (total(&folded), total(&all));
    assert!(
        t.abs_diff(ta) <= 50,
        "the view moved time: {t} us against {ta} us with --native all"
    );
    assert!(
        !std::fs::read_to_string(out.join("stalls.svg"))
            .unwrap()
            .contains("_PyEval_EvalFrameDefault")
    );
    // Issue 37: a frame per function (no line), the task no frame; with
    // `--lines` a frame per line; with `--group-by task` every stack
    // rooted in its task, and the same total.
    assert!(
        !folded.contains("(py_gateway.py:") && folded.contains("handle_request (py_gateway.py)"),
        "the default view is not by function\n{}",
        ctx()
    );
    assert!(!folded.contains("[task "), "a task frame\n{}", ctx());
    let lines = render("views-python-lines", &out, &["--lines"]);
    assert!(
        lines.contains("handle_request (py_gateway.py:"),
        "--lines shows no line:\n{lines}"
    );
    let grouped = render("views-python-grouped", &out, &["--group-by", "task"]);
    for (frames, _) in stacks(&grouped) {
        assert!(
            frames[0].starts_with("task ") || frames[0] == "[no task]",
            "--group-by task: a stack not rooted in its task: {frames:?}"
        );
    }
    assert!(
        stacks(&folded)
            .iter()
            .all(|(f, _)| !f[0].starts_with("task ") && f[0] != "[no task]")
    );
    for other in [&lines, &grouped] {
        assert!(
            total(other).abs_diff(t) <= 50,
            "a view moved time: {} us against {t} us",
            total(other)
        );
    }
}

#[test]
fn report_diff_names_what_changed() {
    let Some((dir, before)) = record_gateway("views-diff", "3") else {
        return;
    };
    let diff = |after: &Path, name: &str| -> (String, String) {
        let out = dir.join(name);
        let run = run_stallprof(
            &[
                "report".as_ref(),
                "--diff".as_ref(),
                before.as_os_str(),
                after.as_os_str(),
                "-o".as_ref(),
                out.as_os_str(),
            ],
            Duration::from_secs(60),
        );
        assert!(
            run.status.success(),
            "report --diff failed:\n{}",
            run.describe()
        );
        (
            std::fs::read_to_string(out.join("diff.folded")).unwrap(),
            std::fs::read_to_string(out.join("diff-before.svg")).unwrap(),
        )
    };
    // The same recording twice: nothing changed.
    let (same, svg) = diff(&before, "same");
    assert!(
        svg.starts_with("<?xml") || svg.starts_with("<svg"),
        "diff.svg is no SVG"
    );
    assert!(!same.is_empty());
    for l in same.lines() {
        let v: Vec<&str> = l.rsplitn(3, ' ').collect();
        assert_eq!(v[0], v[1], "a recording against itself differs: {l}");
    }
    // AFTER: the compress step fixed.
    let mut rec = stallprof::report::read_json(&before).unwrap();
    for s in rec.stalls.iter_mut() {
        s.stacks.retain(|p| {
            !p.frames
                .iter()
                .any(|f| f.name == "Gateway.compress_payload")
        });
    }
    let after = dir.join("after");
    std::fs::create_dir(&after).unwrap();
    std::fs::write(
        after.join("stalls.json"),
        stallprof::report::json::to_vec(&rec),
    )
    .unwrap();
    let (changed, svg) = diff(&after, "changed");
    let through: Vec<&str> = changed
        .lines()
        .filter(|l| l.contains("Gateway.compress_payload"))
        .collect();
    assert!(
        !through.is_empty(),
        "diff.folded never names Gateway.compress_payload:\n{changed}"
    );
    for l in through {
        let v: Vec<&str> = l.rsplitn(3, ' ').collect();
        assert!(
            v[0] == "0" && v[1] != "0",
            "Gateway.compress_payload is not gone in AFTER: {l}"
        );
    }
    // What went away is drawn at BEFORE's widths.
    assert!(
        svg.contains("Gateway.compress_payload"),
        "diff-before.svg does not name the changed culprit"
    );
}

/// `tmux` with a private server socket, so the test never touches a
/// user's sessions.
fn tmux(sock: &Path, args: &[&str]) -> std::process::Output {
    Command::new("tmux")
        .arg("-S")
        .arg(sock)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("tmux is needed for this test and did not run ({e}); `cargo xtask test` installs it, or: apt-get install -y tmux"))
}

#[test]
fn top_in_tmux_shows_the_culprit() {
    if !require_root_and_bpf("views-top") {
        return;
    }
    let python = require_python(3, 11);
    let _serial = serial();
    let dir = Scratch::new("views-top");
    let mut victim = Victim::spawn(
        Command::new(&python)
            .arg(victims_dir().join("py_gateway.py"))
            .arg(dir.join("victim.jsonl"))
            .args(["--requests", "200"]),
    );
    std::thread::sleep(Duration::from_millis(300));
    victim.assert_running();
    let sock = dir.join("tmux.sock");
    let rc = dir.join("top.rc");
    let cmd = format!(
        "{} top --pid {} --threshold 40ms; echo $? > {}",
        stallprof_bin(),
        victim.pid(),
        rc.display()
    );
    let started = tmux(
        &sock,
        &[
            "new-session",
            "-d",
            "-x",
            "160",
            "-y",
            "40",
            "sh",
            "-c",
            &cmd,
        ],
    );
    assert!(
        started.status.success(),
        "tmux new-session failed: {}",
        String::from_utf8_lossy(&started.stderr)
    );
    struct Kill<'a>(&'a Path);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = Command::new("tmux")
                .arg("-S")
                .arg(self.0)
                .arg("kill-server")
                .output();
        }
    }
    let _kill = Kill(&sock);
    // Until the screen shows a stall rate above zero and a gateway step.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut screen;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        screen = String::from_utf8_lossy(&tmux(&sock, &["capture-pane", "-p"]).stdout).into_owned();
        let rate = screen
            .lines()
            .find_map(|l| l.strip_prefix("stalls/s: "))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|r| r.parse::<f64>().ok())
            .unwrap_or(0.0);
        if rate > 0.0 && screen.contains("Gateway.") {
            break;
        }
        assert!(
            Instant::now() < deadline && !rc.exists(),
            "after 30 s the screen of stallprof top shows no stall rate above 0 and no Gateway culprit:\n{screen}\nexit: {:?}",
            std::fs::read_to_string(&rc).ok()
        );
    }
    assert!(
        screen.contains("CULPRIT") && screen.contains("GIL"),
        "no culprit table:\n{screen}"
    );
    eprintln!("stallprof top in tmux:\n{screen}");
    tmux(&sock, &["send-keys", "q"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !rc.exists() {
        assert!(
            Instant::now() < deadline,
            "stallprof top did not quit on q within 10 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(100));
    let code = std::fs::read_to_string(&rc).unwrap();
    assert_eq!(code.trim(), "0", "stallprof top exited with {code}");
    let left = sp_programs_left(|_| true);
    assert!(
        left.is_empty(),
        "BPF programs left loaded after top quit: {left:?}"
    );
    victim.assert_running();
}
