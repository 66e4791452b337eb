//! Bad input: one clear message naming the fix, a non-zero exit, nothing
//! left behind. (The root/BPF cases live in record_c.rs.)
use std::process::Command;

fn stallprof(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stallprof"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("stallprof-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn help_ends_with_examples() {
    let out = Command::new(env!("CARGO_BIN_EXE_stallprof"))
        .args(["record", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("EXAMPLES:") && text.contains("stallprof record --pid"),
        "{text}"
    );
}

#[test]
fn nothing_to_record_says_how() {
    let (code, err) = stallprof(&["record"]);
    assert_ne!(code, 0);
    assert!(err.contains("--pid PID") && err.contains("--"), "{err}");
}

#[test]
fn unknown_command_is_named() {
    let (code, err) = stallprof(&["record", "--", "/nonexistent/stallprof-no-such-cmd"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("command not found") && err.contains("stallprof-no-such-cmd"),
        "{err}"
    );
}

#[test]
fn sampling_gate_above_threshold_names_the_fix() {
    let (code, err) = stallprof(&[
        "record",
        "--threshold",
        "50ms",
        "--sample-after",
        "60ms",
        "--",
        "true",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--sample-after 60.0ms") && err.contains("below the threshold"),
        "{err}"
    );
}

#[test]
fn unwritable_output_names_the_flag() {
    // A path under a regular file can never be created, root or not.
    let file = tmp("file");
    std::fs::write(&file, b"x").unwrap();
    let out = file.join("sub");
    let (code, err) = stallprof(&["record", "-o", out.to_str().unwrap(), "--", "true"]);
    let _ = std::fs::remove_file(&file);
    assert_ne!(code, 0);
    assert!(err.contains("-o DIR") && err.contains("sub"), "{err}");
}

#[test]
fn report_of_a_missing_recording() {
    let (code, err) = stallprof(&["report", "/nonexistent/stallprof-rec"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("cannot read the recording") && err.contains("stalls.json"),
        "{err}"
    );
}

/// Not root: the message says to use sudo or grant capabilities; nothing is
/// loaded. Runs the binary as `nobody` (needs root to switch; fails loudly
/// otherwise, unless STALLPROF_SKIP_ROOT_TESTS is set).
#[test]
fn not_root_names_the_remedy() {
    if unsafe { libc::geteuid() } != 0 {
        if std::env::var_os("STALLPROF_SKIP_ROOT_TESTS").is_some() {
            eprintln!("SKIPPED not_root_names_the_remedy: needs root to switch to nobody");
            return;
        }
        panic!(
            "not_root_names_the_remedy needs root (to run stallprof as nobody); run the tests as root"
        );
    }
    let dir = tmp("nobody");
    std::fs::create_dir_all(&dir).unwrap();
    let _ = Command::new("chmod")
        .args(["777", dir.to_str().unwrap()])
        .status();
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(env!("CARGO_BIN_EXE_stallprof"))
        .args([
            "record",
            "-o",
            dir.join("out").to_str().unwrap(),
            "--",
            "true",
        ])
        .output()
        .expect("setpriv (util-linux) is needed for this test");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("root") && err.contains("CAP_BPF"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
