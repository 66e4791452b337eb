//! Issue 13, root integration tests: stallprof runs as root, so the places
//! it writes, the names it prints and the processes it starts are attack
//! surface. Each test plays the attacker (or the careless user) and checks
//! that nothing outside stallprof's own files changes.
//!
//! - a symlink planted at every name stallprof writes (and at the fixed
//!   temporary names older versions used) points at a canary file: the
//!   canary stays untouched, the recording completes, nothing is left
//!   readable by others;
//! - an existing output directory owned by another user, or writable by
//!   others, or a symlink, is refused;
//! - the default output directory's name is random and private, and
//!   `report` writes a new directory and never overwrites its input;
//! - a Python function whose name holds a newline stays one frame on one
//!   line of stalls.folded and is escaped in the summary and the SVG;
//! - `record -- CMD` under a simulated sudo runs CMD as the invoking user;
//! - `--pid` of a kernel thread, a zombie or stallprof itself, and `--tid`
//!   not in the target, are refused with the reason.

mod common;

use common::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Every name `record --save-events` writes, and names an attacker would
/// guess for temporary files (the fixed ones earlier versions used).
const WRITTEN: &[&str] = &[
    "stalls.json",
    "stalls.folded",
    "stalls.svg",
    "stalls.pb.gz",
    "stalls.pftrace",
    "stalls.speedscope.json",
    "events.bin.gz",
    "unwind.json.gz",
    "symbols.json",
];
const GUESSED_TEMPORARIES: &[&str] = &[
    ".stallprof-write-test",
    "stalls.tmp",
    "stalls.json.tmp",
    "stalls.folded.tmp",
    "stalls.svg.tmp",
    "events.tmp",
    "events.bin.tmp",
    "unwind.json.tmp",
    "symbols.tmp",
    "symbols.json.tmp",
];

/// An asyncio loop frozen three times by a function whose name holds a
/// newline: `__qualname__` assigned at runtime, and the code object's
/// `co_name`/`co_qualname` (what a profiler reads from memory) replaced.
const EVIL_VICTIM: &str = r#"
import asyncio, os, sys, time

def evil():
    end = time.monotonic() + 0.15
    while time.monotonic() < end:
        pass

EVIL = "evil\nname"
evil.__qualname__ = EVIL
code = evil.__code__
if sys.version_info >= (3, 11):
    evil.__code__ = code.replace(co_name=EVIL, co_qualname=EVIL)
else:
    evil.__code__ = code.replace(co_name=EVIL)

async def main():
    for _ in range(4):
        await asyncio.sleep(0.1)
        evil()
    await asyncio.sleep(0.1)

asyncio.run(main())
"#;

fn write_victim(dir: &Scratch) -> PathBuf {
    let script = dir.join("evil_victim.py");
    std::fs::write(&script, EVIL_VICTIM).unwrap();
    script
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// Every entry of `dir` is a regular file or directory readable by no one
/// but its owner (0600 files, 0700 directories).
fn assert_private(dir: &Path) {
    assert_eq!(mode(dir), 0o700, "{} is not 0700", dir.display());
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let m = std::fs::symlink_metadata(&p).unwrap();
        if m.file_type().is_symlink() {
            continue; // planted by the test, never written by stallprof
        }
        assert_eq!(
            m.mode() & 0o077,
            0,
            "{} is readable or writable by others (mode {:o})",
            p.display(),
            m.mode() & 0o7777
        );
    }
}

fn record_evil(test: &str, dir: &Scratch, out: Option<&Path>, extra: &[&str]) -> RunOutput {
    let python = require_python(3, 11);
    let script = write_victim(dir);
    let mut args: Vec<std::ffi::OsString> =
        vec!["record".into(), "--threshold".into(), "50ms".into()];
    args.extend(extra.iter().map(|a| a.into()));
    if let Some(out) = out {
        args.push("-o".into());
        args.push(out.into());
    }
    args.push("--".into());
    args.push(python.into());
    args.push(script.into());
    let run = run_stallprof_in(&dir.path, &args, Duration::from_secs(90));
    assert!(
        run.status.success(),
        "{test}: stallprof record failed:\n{}",
        run.describe()
    );
    run
}

#[test]
fn security_planted_symlinks_never_followed() {
    if !require_root_and_bpf("security_planted_symlinks_never_followed") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("security_symlinks");
    let canary = dir.join("canary");
    std::fs::write(&canary, b"canary: must stay exactly this").unwrap();
    let before = std::fs::metadata(&canary).unwrap();
    let out = dir.join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o700)).unwrap();
    for name in WRITTEN.iter().chain(GUESSED_TEMPORARIES) {
        symlink(&canary, out.join(name)).unwrap();
    }

    let run = record_evil(
        "security_planted_symlinks_never_followed",
        &dir,
        Some(&out),
        &["--save-events"],
    );

    let after = std::fs::metadata(&canary).unwrap();
    assert_eq!(
        std::fs::read(&canary).unwrap(),
        b"canary: must stay exactly this",
        "the canary was written through a planted symlink:\n{}",
        run.describe()
    );
    assert_eq!(
        (after.len(), after.mtime(), after.mtime_nsec()),
        (before.len(), before.mtime(), before.mtime_nsec())
    );
    for name in WRITTEN {
        let m = std::fs::symlink_metadata(out.join(name)).unwrap();
        assert!(
            m.file_type().is_file(),
            "{name}: expected stallprof's own file in place of the planted symlink"
        );
    }
    for name in GUESSED_TEMPORARIES {
        assert!(
            std::fs::symlink_metadata(out.join(name))
                .unwrap()
                .file_type()
                .is_symlink(),
            "{name}: stallprof touched a name it does not write"
        );
    }
    let leftovers: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp") && !GUESSED_TEMPORARIES.contains(&n.as_str()))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    assert_private(&out);

    // The output directory itself as a symlink: refused, nothing written.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let link = dir.join("out-link");
    symlink(&elsewhere, &link).unwrap();
    let run = run_stallprof(
        &[
            "record".as_ref(),
            "-o".as_ref(),
            link.as_os_str(),
            "--".as_ref(),
            "/bin/true".as_ref(),
        ],
        Duration::from_secs(30),
    );
    assert!(
        !run.status.success() && run.stderr.contains("is a symlink"),
        "{}",
        run.describe()
    );
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
}

#[test]
fn security_refuses_foreign_or_writable_dirs() {
    if !require_root_and_bpf("security_refuses_foreign_or_writable_dirs") {
        return;
    }
    let dir = Scratch::new("security_dirs");
    let foreign = dir.join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
    let open = dir.join("world-writable");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
    for (d, says) in [
        (&foreign, "belongs to uid 65534"),
        (&open, "writable by others"),
    ] {
        let run = run_stallprof(
            &[
                "record".as_ref(),
                "-o".as_ref(),
                d.as_os_str(),
                "--".as_ref(),
                "/bin/true".as_ref(),
            ],
            Duration::from_secs(30),
        );
        assert!(
            !run.status.success() && run.stderr.contains(says) && run.stderr.contains("-o DIR"),
            "{}: expected a refusal saying {says:?}:\n{}",
            d.display(),
            run.describe()
        );
        assert_eq!(
            std::fs::read_dir(d).unwrap().count(),
            0,
            "{} was written",
            d.display()
        );
    }
    // The daemon's data directory: the same rule, checked before anything
    // is attached or bound.
    let run = run_stallprof(
        &[
            "daemon".as_ref(),
            "--listen".as_ref(),
            "127.0.0.1:1".as_ref(),
            "--data-dir".as_ref(),
            open.as_os_str(),
        ],
        Duration::from_secs(30),
    );
    assert!(
        !run.status.success() && run.stderr.contains("writable by others"),
        "the daemon took a world-writable data directory:\n{}",
        run.describe()
    );
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
}

#[test]
fn security_default_output_private_and_report_never_overwrites() {
    if !require_root_and_bpf("security_default_output_private_and_report_never_overwrites") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("security_default");
    record_evil("security_default_output", &dir, None, &[]);
    let made: Vec<PathBuf> = std::fs::read_dir(&dir.path)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(made.len(), 1, "expected one output directory: {made:?}");
    let rec = &made[0];
    let name = rec.file_name().unwrap().to_string_lossy().into_owned();
    let suffix = name.rsplit('-').next().unwrap();
    assert!(
        name.starts_with("stallprof-python3")
            && suffix.len() == 16
            && suffix.chars().all(|c| c.is_ascii_hexdigit()),
        "the default name {name} does not end in a random suffix"
    );
    assert_private(rec);

    let input = std::fs::read(rec.join("stalls.json")).unwrap();
    let run = run_stallprof(
        &[
            "report".as_ref(),
            rec.as_os_str(),
            "--threshold".as_ref(),
            "100ms".as_ref(),
        ],
        Duration::from_secs(30),
    );
    assert!(run.status.success(), "{}", run.describe());
    assert_eq!(
        std::fs::read(rec.join("stalls.json")).unwrap(),
        input,
        "report rewrote its input"
    );
    let reports: Vec<PathBuf> = std::fs::read_dir(&dir.path)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&format!("{name}-report-"))
        })
        .collect();
    assert_eq!(
        reports.len(),
        1,
        "expected one new report directory: {}",
        run.describe()
    );
    assert!(reports[0].join("stalls.folded").is_file());
    assert_private(&reports[0]);

    let run = run_stallprof(
        &[
            "report".as_ref(),
            rec.as_os_str(),
            "-o".as_ref(),
            rec.as_os_str(),
        ],
        Duration::from_secs(30),
    );
    assert!(
        !run.status.success() && run.stderr.contains("is the recording being read"),
        "{}",
        run.describe()
    );
    assert_eq!(std::fs::read(rec.join("stalls.json")).unwrap(), input);
}

#[test]
fn security_newline_in_python_qualname() {
    if !require_root_and_bpf("security_newline_in_python_qualname") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("security_newline");
    let out = dir.join("out");
    let run = record_evil("security_newline_in_python_qualname", &dir, Some(&out), &[]);
    let folded = std::fs::read_to_string(out.join("stalls.folded")).unwrap();
    for line in folded.lines() {
        let (stack, weight) = line.rsplit_once(' ').unwrap_or(("", ""));
        assert!(
            !stack.is_empty() && weight.parse::<u64>().is_ok(),
            "a stalls.folded line is not `stack weight`: {line:?}\n{folded}"
        );
    }
    assert!(
        folded.contains("evil\\nname"),
        "no escaped `evil\\nname` frame in stalls.folded:\n{folded}\n{}",
        run.describe()
    );
    assert!(!folded.contains("evil\nname"));
    assert!(
        run.stdout.contains("evil\\nname") && !run.stdout.contains("evil\nname"),
        "the summary does not show the escaped name:\n{}",
        run.describe()
    );
    let svg = std::fs::read_to_string(out.join("stalls.svg")).unwrap();
    assert!(svg.contains("evil\\nname") && !svg.contains("evil\nname"));
}

#[test]
fn security_command_runs_as_the_sudo_user() {
    if !require_root_and_bpf("security_command_runs_as_the_sudo_user") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("security_sudo");
    // Somewhere the command, as nobody, may write.
    let drop = dir.join("drop");
    std::fs::create_dir(&drop).unwrap();
    std::fs::set_permissions(&drop, std::fs::Permissions::from_mode(0o777)).unwrap();
    let who = drop.join("who");
    let out = dir.join("out");
    // /usr/bin: a nobody cannot reach root's pyenv under /root.
    let python = ["/usr/bin/python3", "/usr/bin/python3.11"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("no /usr/bin/python3 for the command run as nobody");
    let code = format!(
        "import os; open({:?}, 'w').write('%d %d %s %s %s' % (os.getuid(), os.getgid(), \
         os.getgroups(), os.environ.get('USER'), os.environ.get('HOME')))",
        who.to_str().unwrap()
    );
    let result = Command::new(stallprof_bin())
        .args(["record", "-o"])
        .arg(&out)
        .arg("--")
        .arg(&python)
        .args(["-c", &code])
        .env("SUDO_UID", "65534")
        .env("SUDO_GID", "65534")
        .env("SUDO_USER", "nobody")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let describe = format!(
        "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        result.status,
        String::from_utf8_lossy(&result.stdout),
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(result.status.success(), "{describe}");
    let seen = std::fs::read_to_string(&who)
        .unwrap_or_else(|e| panic!("the command wrote nothing ({e}):\n{describe}"));
    assert!(
        seen.starts_with("65534 65534 [65534] nobody "),
        "the command ran as {seen:?}, not as nobody with only its own groups\n{describe}"
    );
    // The recording belongs to the invoking user, and to no one else.
    assert_eq!(std::fs::metadata(&out).unwrap().uid(), 65534);
    assert_eq!(
        std::fs::metadata(out.join("stalls.json")).unwrap().uid(),
        65534
    );
    assert_private(&out);
}

#[test]
fn security_refuses_bad_targets() {
    let own = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "exec {} record --pid $$ --duration 1s",
            stallprof_bin()
        ))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&own.stderr);
    assert!(
        !own.status.success() && err.contains("stallprof itself"),
        "{err}"
    );

    let kthread = run_stallprof(
        &["record", "--pid", "2", "--duration", "1s"],
        Duration::from_secs(30),
    );
    assert!(
        !kthread.status.success() && kthread.stderr.contains("kernel thread"),
        "{}",
        kthread.describe()
    );

    // A child that exited and is not reaped yet: a zombie.
    let mut z = Command::new("true").stdin(Stdio::null()).spawn().unwrap();
    let zpid = z.id();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{zpid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "the child never became a zombie"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let zombie = run_stallprof(
        &[
            "record".to_string(),
            "--pid".into(),
            zpid.to_string(),
            "--duration".into(),
            "1s".into(),
        ],
        Duration::from_secs(30),
    );
    z.wait().unwrap();
    assert!(
        !zombie.status.success() && zombie.stderr.contains("zombie"),
        "{}",
        zombie.describe()
    );

    let sleeper = Victim::spawn(Command::new("sleep").arg("30"));
    let tid = run_stallprof(
        &[
            "record".to_string(),
            "--pid".into(),
            sleeper.pid().to_string(),
            "--tid".into(),
            "1".into(),
            "--duration".into(),
            "1s".into(),
        ],
        Duration::from_secs(30),
    );
    assert!(
        !tid.status.success() && tid.stderr.contains("--tid 1 is not a thread of pid"),
        "{}",
        tid.describe()
    );
}

/// The capability set docs/security.md states as enough, measured: with
/// only CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH (the
/// target's /proc/PID/mem is 0600 and its own) and CAP_SETUID/CAP_SETGID
/// (to start the command as nobody), a recording of a target owned by
/// another user still has its Python frames.
#[test]
fn security_documented_capabilities_suffice() {
    if !require_root_and_bpf("security_documented_capabilities_suffice") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("security_caps");
    std::fs::set_permissions(&dir.path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let script = write_victim(&dir);
    let out = dir.join("out");
    let python = PathBuf::from("/usr/bin/python3.11");
    assert!(
        python.is_file(),
        "/usr/bin/python3.11 is needed (a nobody cannot run root's pyenv): apt-get install -y python3.11"
    );
    let result = Command::new("setpriv")
        .args([
            "--bounding-set",
            "-all,+bpf,+perfmon,+sys_ptrace,+dac_read_search,+setuid,+setgid",
            "--inh-caps",
            "-all",
            "--",
            stallprof_bin(),
            "record",
            "--threshold",
            "50ms",
            "--user",
            "nobody",
            "-o",
        ])
        .arg(&out)
        .arg("--")
        .arg(&python)
        .arg(&script)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running setpriv (util-linux): {e}"));
    let describe = format!(
        "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        result.status,
        String::from_utf8_lossy(&result.stdout),
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(result.status.success(), "{describe}");
    let folded = std::fs::read_to_string(out.join("stalls.folded")).unwrap();
    assert!(
        folded.contains("evil\\nname"),
        "no Python frames with the documented capabilities:\n{describe}\n{folded}"
    );
}

/// The same target owned by another user, recorded by a root without
/// CAP_SYS_PTRACE (as in a container's default capability set): the
/// interpreter is there but may not be read. Never silent: the summary and
/// stalls.json's `runtime_problems` say so, name the capability, and the
/// stalls (whose time the kernel measures) are all still there, with
/// native frames.
#[test]
fn security_without_cap_sys_ptrace_says_so() {
    if !require_root_and_bpf("security_without_cap_sys_ptrace_says_so") {
        return;
    }
    let _serial = serial();
    let dir = Scratch::new("security_no_ptrace");
    std::fs::set_permissions(&dir.path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let script = write_victim(&dir);
    let out = dir.join("out");
    let python = PathBuf::from("/usr/bin/python3.11");
    assert!(
        python.is_file(),
        "/usr/bin/python3.11 is needed (a nobody cannot run root's pyenv): apt-get install -y python3.11"
    );
    let result = Command::new("setpriv")
        .args([
            "--bounding-set",
            "-all,+bpf,+perfmon,+dac_read_search,+setuid,+setgid",
            "--inh-caps",
            "-all",
            "--",
            stallprof_bin(),
            "record",
            "--threshold",
            "50ms",
            "--user",
            "nobody",
            "-o",
        ])
        .arg(&out)
        .arg("--")
        .arg(&python)
        .arg(&script)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running setpriv (util-linux): {e}"));
    let stdout = String::from_utf8_lossy(&result.stdout);
    let describe = format!(
        "{}\n--- stdout ---\n{stdout}\n--- stderr ---\n{}",
        result.status,
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(result.status.success(), "{describe}");
    assert!(
        stdout.contains("could not be read") && stdout.contains("CAP_SYS_PTRACE"),
        "the summary does not say that the interpreter could not be read for want of CAP_SYS_PTRACE:\n{describe}"
    );
    let v = read_stalls_json(&out.join("stalls.json"));
    let p = &v["runtime_problems"][0];
    assert!(
        p["runtime"] == "cpython 3.11"
            && p["why"]
                .as_str()
                .is_some_and(|w| w.contains("permission denied"))
            && p["remedy"]
                .as_str()
                .is_some_and(|r| r.contains("CAP_SYS_PTRACE")),
        "runtime_problems: {}\n{describe}",
        v["runtime_problems"]
    );
    // The four 150 ms spins are still stalls, without Python frames.
    let stalls = v["stalls"].as_array().unwrap();
    assert!(stalls.len() >= 4, "{} stalls:\n{describe}", stalls.len());
    let folded = std::fs::read_to_string(out.join("stalls.folded")).unwrap();
    assert!(
        !folded.contains("evil"),
        "Python frames without CAP_SYS_PTRACE?\n{folded}"
    );
    println!(
        "NO_PTRACE  {} stalls; runtime problem: {} — {}",
        stalls.len(),
        p["runtime"],
        p["why"]
    );
}
