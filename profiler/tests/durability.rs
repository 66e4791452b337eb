//! Issue 13, item 3, "nothing lost": `record` writes every stall to
//! `stalls.journal` as it is found, so a recording killed with SIGKILL keeps
//! them and `report` rebuilds every output from it; an output directory
//! that fills up gives a clear error, a non-zero exit, detached probes, and
//! keeps what fits.
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).

mod common;

use common::*;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const THRESHOLD: &str = "40ms";

/// Waits until the victim's log holds `n` stalls.
fn wait_for_stalls(log: &Path, n: usize, timeout: Duration) -> Vec<Truth> {
    let deadline = Instant::now() + timeout;
    loop {
        let truth = if log.exists() {
            c_loop_truth(&read_log(log))
        } else {
            Vec::new()
        };
        if truth.len() >= n {
            return truth;
        }
        assert!(
            Instant::now() < deadline,
            "the victim logged {} of {n} stalls in {timeout:?}",
            truth.len()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `out`'s `stalls.journal` holds `n` stall lines: the stalls
/// the victim logged were drained, assembled, symbolized and written at a
/// journal tick.
fn wait_for_journal_stalls(out: &Path, n: usize, timeout: Duration) {
    let path = out.join("stalls.journal");
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let found = text
            .lines()
            .filter(|l| l.starts_with("{\"stall\":"))
            .count();
        if found >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "waited {timeout:?} for {n} stalls in {}: {found} there",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `report IN -o OUT` must succeed, say it rebuilt from the journal when
/// IN has no stalls.json, and write every output; returns the recording.
fn report_from_journal(c: &mut Checks, input: &Path, out: &Path) -> Option<Recording> {
    let from_journal = !input.join("stalls.json").exists();
    let run = run_stallprof(
        &[
            "report".as_ref(),
            input.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
        ],
        Duration::from_secs(60),
    );
    c.check(run.status.success(), || {
        format!("report of the journal failed:\n{}", run.describe())
    });
    c.check(
        !from_journal || run.stderr.contains("stalls.journal"),
        || {
            format!(
                "report does not say it rebuilt from the journal:\n{}",
                run.describe()
            )
        },
    );
    let files = listing(out);
    for want in ["stalls.json", "stalls.folded", "stalls.svg", "stalls.pb.gz"] {
        c.check(files.iter().any(|f| f == want), || {
            format!("report wrote no {want}: {files:?}")
        });
    }
    run.status.success().then(|| load_recording(out))
}

/// SIGKILL of `record --pid` after N stalls of the C victim (plus a second)
/// leaves those N stalls, each overlapping the victim's own record of it,
/// and `report` turns them into every output.
#[test]
fn durability_kill_9_keeps_every_stall_found() {
    if !require_root_and_bpf("durability_kill_9_keeps_every_stall_found") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("kill9");
    let exe = build_c_loop(&dir.path, true);
    let log = dir.join("victim.jsonl");
    let start = dir.join("start");
    let out = dir.join("out");
    // Four stalls, then ten quiet seconds: nothing stalls around the kill.
    let mut victim = Victim::spawn(
        Command::new(&exe)
            .arg(&log)
            .args([
                "--schedule",
                "spin:120,idle:5,sleep:100,idle:5,pipe:90,idle:5,spin:80,idle:1000",
            ])
            .args(["--repeat", "1"])
            .arg("--start-file")
            .arg(&start)
            .arg("--linger"),
    );
    wait_for_log_kind(&log, "ready", Duration::from_secs(10));
    let pid = victim.pid();
    let mut prof = Profiler::spawn(&[
        "record".to_string(),
        "--threshold".into(),
        THRESHOLD.into(),
        "-q".into(),
        "-o".into(),
        out.display().to_string(),
        "--pid".into(),
        pid.to_string(),
    ]);
    wait_for_attach(&mut prof, Duration::from_secs(20));
    std::fs::write(&start, b"go").unwrap();
    let truth = wait_for_stalls(&log, 4, Duration::from_secs(30));
    wait_for_journal_stalls(&out, 4, Duration::from_secs(10));
    victim.assert_running();
    prof.signal(libc::SIGKILL);
    let run = prof.wait(Duration::from_secs(10));
    let mut c = Checks::new("record killed with SIGKILL after 4 stalls");
    c.check(run.status.code().is_none(), || {
        format!("record was not killed: {}", run.describe())
    });
    let files = listing(&out);
    c.check(
        files.iter().any(|f| f == "stalls.journal") && !files.iter().any(|f| f == "stalls.json"),
        || {
            format!(
                "after SIGKILL the output holds {files:?}, want stalls.journal and no stalls.json"
            )
        },
    );
    if let Some(rec) = report_from_journal(&mut c, &out, &dir.join("rebuilt")) {
        c.add_context(&format!(
            "victim:\n{}\nrebuilt:\n{}",
            truth_table(&truth),
            stalls_table(&rec)
        ));
        c.check(rec.stalls.len() == 4, || {
            format!("{} stalls rebuilt, want 4", rec.stalls.len())
        });
        for t in &truth {
            c.check(overlapping(&rec, t).len() == 1, || {
                format!(
                    "victim stall {} at +{:.3}s: {} rebuilt stalls overlap it, want 1",
                    t.func,
                    ms(t.start_ns.saturating_sub(truth[0].start_ns)) / 1e3,
                    overlapping(&rec, t).len()
                )
            });
            c.check(
                overlapping(&rec, t)
                    .iter()
                    .any(|s| s.stacks.iter().any(|st| st.has_frame(&t.func))),
                || format!("the rebuilt stall of {} lacks its frame", t.func),
            );
        }
    }
    c.finish();
}

/// A tmpfs mounted for the test, unmounted in Drop.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        let st = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .status()
            .expect("running mount");
        assert!(st.success(), "mount -t tmpfs on {} failed", at.display());
        Tmpfs(at.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A 64 KiB tmpfs as the output directory: `record` ends with a non-zero
/// exit and an error naming the directory, the lack of space and how much
/// was written; no probe stays loaded; the journal keeps what fit, and
/// `report` renders it.
#[test]
fn durability_full_disk_is_a_clear_error() {
    if !require_root_and_bpf("durability_full_disk_is_a_clear_error") {
        return;
    }
    let _serial = serial();
    let before = loaded_sp_programs();
    let dir = Scratch::new("full");
    let exe = build_c_loop(&dir.path, true);
    let log = dir.join("victim.jsonl");
    let tiny = Tmpfs::mount(&dir.join("tiny"), "64k");
    let out = tiny.0.join("out");
    let run = run_stallprof(
        &[
            "record".as_ref(),
            "--threshold".as_ref(),
            THRESHOLD.as_ref(),
            "-q".as_ref(),
            "-o".as_ref(),
            out.as_os_str(),
            "--".as_ref(),
            exe.as_os_str(),
            log.as_os_str(),
            "--repeat".as_ref(),
            "8".as_ref(),
        ],
        Duration::from_secs(120),
    );
    let mut c = Checks::new("record into a 64 KiB tmpfs");
    c.add_context(&run.describe());
    c.check(!run.status.success() && run.status.code().is_some(), || {
        "record succeeded (or was killed) writing into a 64 KiB tmpfs".into()
    });
    let err = run.stderr.to_lowercase();
    c.check(err.contains("no space left"), || {
        "the error does not say the disk is full".into()
    });
    c.check(run.stderr.contains(&out.display().to_string()), || {
        "the error does not name the output directory".into()
    });
    c.check(err.contains("bytes"), || {
        "the error does not say how much was written".into()
    });
    let leaked = sp_programs_left(|p| !before.contains(p));
    c.check(leaked.is_empty(), || {
        format!("probes left loaded: {leaked:?}")
    });
    let files = listing(&out);
    c.check(!files.iter().any(|f| f.ends_with(".tmp")), || {
        format!("temporary files left in the full directory: {files:?}")
    });
    // stalls.json is written first: when it fit, it is whole and the
    // journal stays beside it; when it did not, the journal holds the stalls.
    if files.iter().any(|f| f == "stalls.journal") {
        if let Some(rec) = report_from_journal(&mut c, &out, &dir.join("rebuilt")) {
            c.check(!rec.stalls.is_empty(), || {
                "the kept journal holds no stall".into()
            });
        }
    } else {
        c.fail(format!("no stalls.journal kept: {files:?}"));
    }
    drop(tiny);
    c.finish();
}
