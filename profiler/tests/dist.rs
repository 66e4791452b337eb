//! The release artifacts (issue 21), as users get them: what `cargo xtask
//! dist` left in target/dist (`cargo xtask test` builds it first, packing
//! twice to check it is reproducible; a stale or missing target/dist FAILS,
//! naming the command).
//!
//! - `checksums_and_static_binary`: SHA256SUMS matches the files; the
//!   tarball holds the binary, README, CHANGELOG, both licenses and docs;
//!   the binary is static (no interpreter, no shared library) and says the
//!   same `--version` (commit, eBPF object hash) as the tested build.
//! - `wheel_installs_in_a_fresh_venv_and_records`: the wheel's RECORD is
//!   checked by Python's zipfile and hashlib; pip installs it (no index)
//!   into a new venv; the venv's `stallprof` records a C victim's stalls,
//!   each matched to the victim's own clock.
//! - `static_binary_records_in_the_sandbox_root`: the tarball's binary,
//!   copied into the container sandbox's root filesystem (Debian testing,
//!   ~/.cache/stallprof/forky-root) and run there chrooted — none of the
//!   host's files but /proc and /sys — records a victim there.
//! - `deb_contents_scripts_and_scratch_install`: the .deb's control,
//!   conffiles, file list (owners root, modes) and maintainer scripts (no
//!   enable, no start; systemd touched only where it runs); installed,
//!   removed and purged with `dpkg --root` in a scratch root; the installed
//!   daemon.toml is exactly the daemon's defaults.
//! - `oci_image_runs_and_the_daemonset_names_it`: podman has the image, its
//!   entrypoint prints the version, docs/deploy/daemonset.yaml runs it.
//! - `promtool_tests_the_rules`: `promtool check rules` and `promtool test
//!   rules` on docs/deploy/prometheus.
//! - `prometheus_scrapes_the_daemon`: Debian's Prometheus server (127.0.0.1,
//!   a random port, a temp dir), with the shipped rules, scrapes a running
//!   `stallprof daemon` while a victim stalls, and answers queries for the
//!   victim's stall series and for the recording rules over them.
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS),
//! podman, python3 with venv, dpkg, and Debian's prometheus unpacked under
//! target/dist-test-deps (all installed by `cargo xtask test`).

mod common;

use common::*;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

const THRESHOLD: &str = "40ms";
/// Three stalls, one of each cause, well over the threshold.
const SCHEDULE: &str = "spin:150,sleep:150,pipe:150";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"))
}

/// target/dist/dist.json, checked to be from this build: its binary's
/// `--version` (version, commit, eBPF object hash) is the tested binary's.
struct Dist {
    dir: PathBuf,
    manifest: Value,
}

impl Dist {
    fn load() -> Dist {
        let dir = target_dir().join("dist");
        let path = dir.join("dist.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}: the release artifacts are missing; `cargo xtask test --test dist` \
                 (or `cargo xtask dist`) builds them",
                path.display()
            )
        });
        let manifest: Value = serde_json::from_str(&text).unwrap();
        let ours = ok(
            Command::new(stallprof_bin()).arg("--version"),
            "stallprof --version",
        );
        assert_eq!(
            manifest["version_line"].as_str().unwrap_or_default(),
            ours.trim(),
            "target/dist was built from another commit or eBPF object than the binary under \
             test: run `cargo xtask dist` (or `cargo xtask test --test dist`)"
        );
        Dist { dir, manifest }
    }

    fn artifact(&self, key: &str) -> PathBuf {
        let name = self.manifest["artifacts"][key]
            .as_str()
            .unwrap_or_else(|| panic!("dist.json names no {key} artifact: {}", self.manifest));
        self.dir.join(name)
    }

    fn version(&self) -> &str {
        self.manifest["version"].as_str().unwrap()
    }

    fn version_line(&self) -> &str {
        self.manifest["version_line"].as_str().unwrap()
    }
}

/// Runs a command that must succeed; its stdout.
fn ok(cmd: &mut Command, what: &str) -> String {
    let out = run_out(cmd, what);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run_out(cmd: &mut Command, what: &str) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("starting {what} ({cmd:?}): {e}"))
}

fn sha256_hex(path: &Path) -> String {
    let out = ok(Command::new("sha256sum").arg(path), "sha256sum");
    out.split_whitespace().next().unwrap().to_string()
}

/// A recording of c_loop running SCHEDULE: every stall the victim logged
/// found once, its duration within 15% (+5 ms) of the victim's clock, and
/// most of its weight in the culprit function.
fn check_c_recording(out: &Path, log: &Path, how: &str) {
    let victim_log = read_log(log);
    assert!(
        victim_log.iter().any(|r| r["kind"] == "done"),
        "{how}: the victim did not finish its schedule; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    let truth = c_loop_truth(&victim_log);
    assert_eq!(truth.len(), 3, "{how}: {}", truth_table(&truth));
    let rec = load_recording(out);
    let mut c = Checks::new(format!(
        "{how}\n{}\n{}",
        truth_table(&truth),
        stalls_table(&rec)
    ));
    for t in &truth {
        let found = overlapping(&rec, t);
        c.check(found.len() == 1, || {
            format!(
                "{} stall: {} recorded stalls overlap it, want 1",
                t.kind,
                found.len()
            )
        });
        let Some(s) = found.first() else { continue };
        let (want, got) = (t.duration_ns() as f64, s.duration_ns as f64);
        c.check((got - want).abs() <= want * 0.15 + 5e6, || {
            format!(
                "{} stall: {:.1} ms recorded, the victim measured {:.1} ms",
                t.kind,
                got / 1e6,
                want / 1e6
            )
        });
        let in_culprit = s.weight_with(&t.func, None, None) as f64;
        c.check(in_culprit >= got * 0.5, || {
            format!(
                "{} stall: only {:.1} of {:.1} ms under {}",
                t.kind,
                in_culprit / 1e6,
                got / 1e6,
                t.func
            )
        });
    }
    c.finish();
}

// ---------------------------------------------------------------------------

#[test]
fn checksums_and_static_binary() {
    let d = Dist::load();
    // SHA256SUMS covers every artifact, and each matches.
    let sums = std::fs::read_to_string(d.dir.join("SHA256SUMS")).unwrap();
    let listed: BTreeMap<String, String> = sums
        .lines()
        .map(|l| {
            let (h, n) = l.split_once("  ").expect("sha256sum format: HASH  NAME");
            (n.to_string(), h.to_string())
        })
        .collect();
    for (key, name) in d.manifest["artifacts"].as_object().unwrap() {
        let name = name.as_str().unwrap();
        let want = listed
            .get(name)
            .unwrap_or_else(|| panic!("SHA256SUMS does not list the {key} {name}"));
        assert_eq!(&sha256_hex(&d.dir.join(name)), want, "{name}: checksum");
    }
    ok(
        Command::new("sha256sum")
            .args(["--check", "--strict", "SHA256SUMS"])
            .current_dir(&d.dir),
        "sha256sum --check SHA256SUMS",
    );

    // The tarball: one top directory with the binary, texts and docs.
    let tarball = d.artifact("tarball");
    let listing = ok(
        Command::new("tar")
            .arg("tvzf")
            .arg(&tarball)
            .env("TZ", "UTC"),
        "tar tvzf",
    );
    let top = format!("stallprof-{}-x86_64-linux", d.version());
    for want in [
        "stallprof",
        "README.md",
        "CHANGELOG.md",
        "LICENSE-MIT",
        "LICENSE-APACHE",
        "THIRD-PARTY.md",
        "docs/install.md",
        "docs/daemon.md",
        "docs/deploy/daemonset.yaml",
        "docs/deploy/prometheus/stallprof.rules.yml",
    ] {
        let path = format!("{top}/{want}");
        let line = listing
            .lines()
            .find(|l| l.ends_with(&format!(" {path}")))
            .unwrap_or_else(|| panic!("the tarball has no {path}:\n{listing}"));
        assert!(line.contains(" 0/0 "), "{path} not owned by 0/0: {line}");
    }
    let bin_line = listing
        .lines()
        .find(|l| l.ends_with(&format!(" {top}/stallprof")))
        .unwrap();
    assert!(bin_line.starts_with("-rwxr-xr-x"), "{bin_line}");
    let epoch = d.manifest["source_date_epoch"].as_u64().unwrap();
    assert!(
        !listing
            .lines()
            .any(|l| l.contains(" 0/0 ") && !l.contains(&date_of(epoch))),
        "a member's mtime is not SOURCE_DATE_EPOCH ({}):\n{listing}",
        date_of(epoch)
    );

    // Unpacked: static, and the same build as the one under test.
    let scratch = Scratch::new("dist-tar");
    ok(
        Command::new("tar")
            .arg("xzf")
            .arg(&tarball)
            .arg("-C")
            .arg(&scratch.path),
        "tar xzf",
    );
    let bin = scratch.path.join(&top).join("stallprof");
    // What is linked in, with licenses: the crates the binary is made of.
    let third = std::fs::read_to_string(scratch.path.join(&top).join("THIRD-PARTY.md")).unwrap();
    for want in [
        "| tokio |",
        "| aya |",
        "| inferno | ",
        "CDDL-1.0",
        "| blazesym |",
    ] {
        assert!(
            third.contains(want),
            "THIRD-PARTY.md lacks {want:?}:\n{third}"
        );
    }
    let libc_row = match d.manifest["target"].as_str() {
        Some("x86_64-unknown-linux-musl") => "musl libc",
        _ => "GNU C Library",
    };
    assert!(
        third.contains(libc_row),
        "THIRD-PARTY.md names no {libc_row}"
    );
    let headers = ok(Command::new("readelf").arg("-lW").arg(&bin), "readelf -l");
    assert!(
        !headers.contains("INTERP"),
        "the shipped binary asks for a program interpreter:\n{headers}"
    );
    let dynamic = ok(Command::new("readelf").arg("-dW").arg(&bin), "readelf -d");
    assert!(
        !dynamic.contains("(NEEDED)"),
        "the shipped binary needs shared libraries:\n{dynamic}"
    );
    let version = ok(Command::new(&bin).arg("--version"), "stallprof --version");
    assert_eq!(version.trim(), d.version_line());
    let ours = ok(Command::new(stallprof_bin()).arg("--version"), "--version");
    assert!(
        version.contains("eBPF object sha256:") && version.contains(" (commit "),
        "--version names no commit or eBPF hash: {version}"
    );
    assert_eq!(
        version, ours,
        "the static binary is another build than the tested one"
    );
}

/// `tar tv`'s date for an epoch (tar runs with TZ=UTC).
fn date_of(epoch: u64) -> String {
    let out = Command::new("date")
        .args(["-u", "-d"])
        .arg(format!("@{epoch}"))
        .arg("+%Y-%m-%d %H:%M")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn wheel_installs_in_a_fresh_venv_and_records() {
    if !require_root_and_bpf("wheel_installs_in_a_fresh_venv_and_records") {
        return;
    }
    let d = Dist::load();
    let wheel = d.artifact("wheel");
    let name = wheel.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.ends_with(
            "-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.musllinux_1_1_x86_64.whl"
        ),
        "{name}: the wheel's tags"
    );
    // RECORD, read by Python: every member listed with its sha256 and size.
    let check = r#"
import base64, hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
assert z.testzip() is None
names = z.namelist()
record = [n for n in names if n.endswith(".dist-info/RECORD")]
assert len(record) == 1, names
rows = [l.split(",") for l in z.read(record[0]).decode().splitlines()]
listed = {r[0] for r in rows}
assert listed == set(names), (listed ^ set(names))
for path, h, size in rows:
    if path == record[0]:
        assert h == "" and size == "", (path, h, size)
        continue
    data = z.read(path)
    algo, digest = h.split("=", 1)
    assert algo == "sha256", h
    assert digest == base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode(), path
    assert int(size) == len(data), path
script = [n for n in names if n.endswith(".data/scripts/stallprof")]
assert len(script) == 1, names
mode = z.getinfo(script[0]).external_attr >> 16
assert mode & 0o777 == 0o755, oct(mode)
wheel = z.read([n for n in names if n.endswith(".dist-info/WHEEL")][0]).decode()
assert "Root-Is-Purelib: false" in wheel, wheel
assert "Tag: py3-none-musllinux_1_1_x86_64" in wheel, wheel
assert "Tag: py3-none-manylinux_2_17_x86_64" in wheel, wheel
assert not [n for n in names if n.endswith(".py")], names
assert [n for n in names if n.endswith(".dist-info/licenses/THIRD-PARTY.md")], names
print("ok")
"#;
    let scratch = Scratch::new("dist-wheel");
    let script = scratch.join("check_wheel.py");
    std::fs::write(&script, check).unwrap();
    ok(
        Command::new("python3").arg(&script).arg(&wheel),
        "checking the wheel's RECORD with Python's zipfile",
    );

    // A fresh venv; pip from the wheel file only (no index).
    let venv = scratch.join("venv");
    ok(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        "python3 -m venv (Debian: apt-get install python3-venv)",
    );
    ok(
        Command::new(venv.join("bin/pip"))
            .args([
                "install",
                "--no-index",
                "--disable-pip-version-check",
                "--quiet",
            ])
            .arg(&wheel),
        "pip install the wheel into a fresh venv",
    );
    let installed = venv.join("bin/stallprof");
    let version = ok(
        Command::new(&installed).arg("--version"),
        "venv stallprof --version",
    );
    assert_eq!(version.trim(), d.version_line());
    let show = ok(
        Command::new(venv.join("bin/pip")).args(["show", "-f", "stallprof"]),
        "pip show -f stallprof",
    );
    assert!(
        show.contains("Version: ") && show.contains("bin/stallprof"),
        "pip show:\n{show}"
    );

    // It records.
    let _serial = serial();
    let exe = build_c_loop(&scratch.path, true);
    let log = scratch.join("victim.jsonl");
    let out = scratch.join("out");
    let run = run_out(
        Command::new(&installed)
            .args(["record", "-q", "--threshold", THRESHOLD, "-o"])
            .arg(&out)
            .arg("--")
            .arg(&exe)
            .arg(&log)
            .args(["--schedule", SCHEDULE, "--repeat", "1"]),
        "the venv's stallprof record",
    );
    assert!(
        run.status.success(),
        "the venv's stallprof record failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    check_c_recording(&out, &log, "record by the wheel's stallprof");
}

#[test]
fn static_binary_records_in_the_sandbox_root() {
    if !require_root_and_bpf("static_binary_records_in_the_sandbox_root") {
        return;
    }
    let d = Dist::load();
    let root = require_forky_root();
    let scratch = Scratch::new("dist-sandbox");
    ok(
        Command::new("tar")
            .arg("xzf")
            .arg(d.artifact("tarball"))
            .arg("-C")
            .arg(&scratch.path),
        "tar xzf",
    );
    let top = format!("stallprof-{}-x86_64-linux", d.version());
    // Our own directory in the sandbox root, removed at the end.
    let name = format!("stallprof-dist-{}", std::process::id());
    let inside = format!("/opt/{name}");
    let dir = root.join("opt").join(&name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = RemoveOnDrop(dir.clone());
    std::fs::copy(
        scratch.path.join(&top).join("stallprof"),
        dir.join("stallprof"),
    )
    .unwrap();
    // The victim, built on the host, runs on the sandbox's own libc.
    let _serial = serial();
    build_c_loop(&dir, true);

    // A mount namespace of its own: /proc and /sys (tracefs, BTF) in the
    // sandbox root, nothing else of the host; gone when it exits.
    let r = root.display().to_string();
    let script = format!(
        "set -e; mount --make-rprivate /; mount -t proc proc '{r}/proc'; \
         mount --rbind /sys '{r}/sys'; \
         exec chroot '{r}' {inside}/stallprof record -q --threshold {THRESHOLD} \
         -o {inside}/out -- {inside}/c_loop {inside}/victim.jsonl \
         --schedule {SCHEDULE} --repeat 1"
    );
    let run = run_out(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .env_clear()
            .env("PATH", "/usr/bin:/bin:/usr/sbin:/sbin"),
        "stallprof record chrooted into the sandbox root",
    );
    assert!(
        run.status.success(),
        "the static stallprof failed in the sandbox root {r}:\n--- stdout ---\n{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    check_c_recording(
        &dir.join("out"),
        &dir.join("victim.jsonl"),
        "the static binary in the sandbox root",
    );
}

#[test]
fn deb_contents_scripts_and_scratch_install() {
    let d = Dist::load();
    let deb = d.artifact("deb");
    let field = |name: &str| {
        ok(
            Command::new("dpkg-deb")
                .args(["--field"])
                .arg(&deb)
                .arg(name),
            "dpkg-deb --field",
        )
        .trim()
        .to_string()
    };
    assert_eq!(field("Package"), "stallprof");
    assert_eq!(field("Version"), d.version());
    assert_eq!(field("Architecture"), "amd64");
    assert_eq!(field("Depends"), "", "a static binary depends on nothing");

    // Files: owners root, modes, and what must be there.
    let listing = ok(
        Command::new("dpkg-deb").arg("--contents").arg(&deb),
        "dpkg-deb -c",
    );
    let mut files = BTreeMap::new();
    for l in listing.lines() {
        let cols: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(cols[1], "root/root", "not owned by root: {l}");
        files.insert(
            cols[5].trim_start_matches('.').to_string(),
            cols[0].to_string(),
        );
    }
    for (path, mode) in [
        ("/usr/bin/stallprof", "-rwxr-xr-x"),
        ("/usr/lib/systemd/system/stallprof.service", "-rw-r--r--"),
        ("/etc/stallprof/daemon.toml", "-rw-r--r--"),
        ("/usr/share/man/man1/stallprof.1.gz", "-rw-r--r--"),
        ("/usr/share/doc/stallprof/copyright", "-rw-r--r--"),
        ("/usr/share/doc/stallprof/THIRD-PARTY.md", "-rw-r--r--"),
        ("/usr/share/doc/stallprof/changelog.gz", "-rw-r--r--"),
        ("/usr/share/doc/stallprof/README.md", "-rw-r--r--"),
        ("/usr/share/doc/stallprof/docs/daemon.md", "-rw-r--r--"),
        (
            "/usr/share/doc/stallprof/docs/deploy/prometheus/stallprof.rules.yml",
            "-rw-r--r--",
        ),
    ] {
        assert_eq!(
            files.get(path).map(String::as_str),
            Some(mode),
            "{path} in the .deb:\n{listing}"
        );
    }
    assert!(
        !files.values().any(|m| m[5..].contains('w')),
        "a group- or world-writable file in the .deb:\n{listing}"
    );

    // Control area: conffiles, scripts that never enable or start.
    let scratch = Scratch::new("dist-deb");
    let control = scratch.join("control");
    ok(
        Command::new("dpkg-deb")
            .arg("--control")
            .arg(&deb)
            .arg(&control),
        "dpkg-deb --control",
    );
    assert_eq!(
        std::fs::read_to_string(control.join("conffiles")).unwrap(),
        "/etc/stallprof/daemon.toml\n"
    );
    for script in ["postinst", "prerm", "postrm"] {
        let p = control.join(script);
        let text =
            std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("the .deb has no {script}: {e}"));
        ok(
            Command::new("sh").arg("-n").arg(&p),
            &format!("sh -n {script}"),
        );
        // What runs: the script without its comments.
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect();
        for forbidden in [
            "systemctl enable",
            "systemctl start",
            "systemctl restart",
            "--now",
        ] {
            assert!(
                !code.contains(forbidden),
                "{script} must not {forbidden:?} the daemon:\n{text}"
            );
        }
        if code.contains("systemctl") {
            assert!(
                code.contains("[ -d /run/systemd/system ]") && code.contains("DPKG_ROOT"),
                "{script} calls systemctl without checking that systemd runs here \
                 (and not in a dpkg --root install):\n{text}"
            );
        }
    }
    let postinst = std::fs::read_to_string(control.join("postinst")).unwrap();
    assert!(postinst.contains("systemctl daemon-reload"), "{postinst}");

    // The unit runs the packaged binary with the packaged config.
    let unit_text = ok(
        Command::new("sh").arg("-c").arg(format!(
            "dpkg-deb --fsys-tarfile '{}' | tar xOf - ./usr/lib/systemd/system/stallprof.service",
            deb.display()
        )),
        "reading the unit from the .deb",
    );
    assert!(
        unit_text
            .contains("ExecStart=/usr/bin/stallprof daemon --config /etc/stallprof/daemon.toml"),
        "{unit_text}"
    );
    assert!(!unit_text.contains("/usr/local/bin"), "{unit_text}");

    // Installed into a scratch root (its own dpkg database; the scripts run
    // chrootless with DPKG_ROOT set, so they touch nothing of this host).
    let root = scratch.join("root");
    let admin = root.join("var/lib/dpkg");
    for d in ["updates", "info", "triggers"] {
        std::fs::create_dir_all(admin.join(d)).unwrap();
    }
    std::fs::write(admin.join("status"), "").unwrap();
    std::fs::write(admin.join("available"), "").unwrap();
    let dpkg = |args: &[&str]| {
        let mut c = Command::new("dpkg");
        c.arg(format!("--root={}", root.display()))
            .args(["--force-script-chrootless", "--force-not-root"])
            .args(args);
        c
    };
    ok(dpkg(&["--install"]).arg(&deb), "dpkg --root --install");
    let status = ok(&mut dpkg(&["--status", "stallprof"]), "dpkg --status");
    assert!(status.contains("Status: install ok installed"), "{status}");
    assert!(
        status.contains("/etc/stallprof/daemon.toml"),
        "conffile not registered:\n{status}"
    );
    let bin = root.join("usr/bin/stallprof");
    assert_eq!(
        ok(
            Command::new(&bin).arg("--version"),
            "installed stallprof --version"
        )
        .trim(),
        d.version_line()
    );
    // The packaged config parses, and is exactly the daemon's defaults.
    let with_file = ok(
        Command::new(&bin)
            .args(["daemon", "--check-config", "--config"])
            .arg(root.join("etc/stallprof/daemon.toml")),
        "stallprof daemon --check-config with the packaged daemon.toml",
    );
    let defaults = ok(
        Command::new(&bin).args(["daemon", "--check-config"]),
        "stallprof daemon --check-config",
    );
    assert_eq!(
        with_file, defaults,
        "the packaged daemon.toml is not the daemon's defaults"
    );
    // The man page is there and is troff.
    let man = ok(
        Command::new("gzip")
            .arg("-dc")
            .arg(root.join("usr/share/man/man1/stallprof.1.gz")),
        "gzip -dc stallprof.1.gz",
    );
    assert!(man.starts_with(".TH STALLPROF 1"), "{man:.300}");
    for sub in ["RECORD", "REPORT", "TOP", "DAEMON"] {
        assert!(
            man.contains(&format!(".SH \"STALLPROF {sub}\"")),
            "man page lacks {sub}"
        );
    }
    // Remove keeps the conffile; purge removes it.
    ok(
        &mut dpkg(&["--remove", "stallprof"]),
        "dpkg --root --remove",
    );
    assert!(!bin.exists(), "dpkg --remove left /usr/bin/stallprof");
    assert!(
        root.join("etc/stallprof/daemon.toml").exists(),
        "remove must keep the conffile"
    );
    ok(&mut dpkg(&["--purge", "stallprof"]), "dpkg --root --purge");
    assert!(
        !root.join("etc/stallprof/daemon.toml").exists(),
        "purge must remove the conffile"
    );
}

#[test]
fn oci_image_runs_and_the_daemonset_names_it() {
    let d = Dist::load();
    assert!(
        Command::new("podman")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "podman is needed (apt-get install podman; `cargo xtask test` installs it)"
    );
    let image = d.manifest["image"].as_str().unwrap_or_else(|| {
        panic!("dist.json names no image: `cargo xtask dist` found neither podman nor buildah")
    });
    assert_eq!(image, format!("localhost/stallprof:{}", d.version()));
    ok(
        Command::new("podman").args(["image", "exists", image]),
        "podman image exists",
    );
    // The archive is an OCI layout naming the image.
    let index = ok(
        Command::new("tar")
            .arg("xOf")
            .arg(d.artifact("image_archive"))
            .arg("./index.json"),
        "reading index.json from the OCI archive",
    );
    assert!(
        index.contains(image),
        "the OCI archive's index names no {image}: {index}"
    );
    let inspect: Value = serde_json::from_str(&ok(
        Command::new("podman").args(["image", "inspect", image]),
        "podman image inspect",
    ))
    .unwrap();
    let config = &inspect[0]["Config"];
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!(["/usr/bin/stallprof"]),
        "{config}"
    );
    assert_eq!(
        config["Labels"]["org.opencontainers.image.version"].as_str(),
        Some(d.version())
    );
    // FROM scratch: the binary and the default config, nothing else.
    let mnt = ok(
        Command::new("podman").args(["image", "mount", image]),
        "podman image mount",
    );
    let mnt = PathBuf::from(mnt.trim());
    let mut found = Vec::new();
    let mut stack = vec![mnt.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                found.push(e.path().strip_prefix(&mnt).unwrap().display().to_string());
            }
        }
    }
    let _ = Command::new("podman")
        .args(["image", "unmount", image])
        .output();
    found.sort();
    assert_eq!(
        found,
        [
            "etc/stallprof/daemon.toml",
            "usr/bin/stallprof",
            "usr/share/doc/stallprof/THIRD-PARTY.md"
        ],
        "the image's files"
    );

    // Runs: `podman run IMAGE --version`.
    let run = run_out(
        Command::new("podman").args(["run", "--rm", "--network", "none", image, "--version"]),
        "podman run",
    );
    let printed = if run.status.success() {
        String::from_utf8_lossy(&run.stdout).into_owned()
    } else {
        // Some sandboxes (this project's development machines among them:
        // hybrid cgroups, no CAP_SYS_RESOURCE) cannot start any container
        // with crun. Only those known refusals of the runtime itself fall
        // back to running the image's entrypoint on its own root
        // filesystem, chrooted, said loudly; any other failure is the
        // image's and fails the test.
        let why = String::from_utf8_lossy(&run.stderr).into_owned();
        let sandbox_refusal = why.contains("OCI permission denied")
            || why.contains("cgroups in hybrid mode not supported");
        assert!(
            sandbox_refusal,
            "`podman run --rm --network none {image} --version` failed ({}): {why}",
            run.status
        );
        eprintln!(
            "\n!!!!!!!!!! `podman run {image}` failed on this machine: {}\
             !!!!!!!!!! running the image's entrypoint chrooted into its mounted root instead\n",
            why
        );
        let mnt = ok(
            Command::new("podman").args(["image", "mount", image]),
            "podman image mount",
        );
        let mnt = mnt.trim().to_string();
        let out = run_out(
            Command::new("chroot")
                .arg(&mnt)
                .args(["/usr/bin/stallprof", "--version"])
                .env_clear()
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "the image's entrypoint, chrooted",
        );
        let _ = Command::new("podman")
            .args(["image", "unmount", image])
            .output();
        assert!(
            out.status.success(),
            "the image's /usr/bin/stallprof --version failed in its own root: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(printed.trim(), d.version_line());

    // The DaemonSet runs this image, in both of its containers.
    let manifest = std::fs::read_to_string(workspace().join("docs/deploy/daemonset.yaml")).unwrap();
    let images: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.trim().strip_prefix("image:"))
        .map(str::trim)
        .collect();
    assert_eq!(
        images,
        [image, image],
        "docs/deploy/daemonset.yaml must run the image `cargo xtask dist` builds"
    );
    // Its config map's daemon.toml passes the image's own --check-config.
    let toml: String = manifest
        .split("daemon.toml: |\n")
        .nth(1)
        .unwrap()
        .lines()
        .take_while(|l| l.starts_with("    ") || l.is_empty())
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    let scratch = Scratch::new("dist-image");
    let cfg = scratch.join("daemon.toml");
    std::fs::write(&cfg, toml).unwrap();
    ok(
        Command::new(stallprof_bin())
            .args(["daemon", "--check-config", "--config"])
            .arg(&cfg),
        "the DaemonSet's daemon.toml through --check-config",
    );
}

fn prometheus_dir() -> PathBuf {
    target_dir().join("dist-test-deps/prometheus/usr/bin")
}

fn prometheus_tool(name: &str) -> PathBuf {
    let p = prometheus_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: `cargo xtask test` (or `cargo xtask setup --tests`, as root) unpacks \
         Debian's prometheus package there",
        p.display()
    );
    p
}

#[test]
fn promtool_tests_the_rules() {
    let promtool = prometheus_tool("promtool");
    let dir = workspace().join("docs/deploy/prometheus");
    let check = ok(
        Command::new(&promtool)
            .args(["check", "rules", "stallprof.rules.yml"])
            .current_dir(&dir),
        "promtool check rules",
    );
    assert!(check.contains("SUCCESS"), "{check}");
    let test = ok(
        Command::new(&promtool)
            .args(["test", "rules", "stallprof.rules.test.yml"])
            .current_dir(&dir),
        "promtool test rules",
    );
    assert!(test.contains("SUCCESS"), "{test}");
    ok(
        Command::new(&promtool)
            .args(["check", "config", "prometheus.yml"])
            .current_dir(&dir),
        "promtool check config (the example scrape configuration)",
    );
}

fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    // Prometheus answers small bodies whole; a chunked one is de-chunked here.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&after[..n.min(after.len())]);
            rest = after.get(n + 2..).unwrap_or("");
        }
        out
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A child process killed when dropped, its output in a file.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn prometheus_scrapes_the_daemon() {
    if !require_root_and_bpf("prometheus_scrapes_the_daemon") {
        return;
    }
    let prometheus = prometheus_tool("prometheus");
    let _serial = serial();
    let scratch = Scratch::new("dist-prometheus");
    let (dport, pport) = (free_port(), free_port());

    // The daemon, as the daemon tests start it.
    let cfg = scratch.join("daemon.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:{dport}\"\ndata_dir = \"{}\"\nthreshold = \"{THRESHOLD}\"\n",
            scratch.join("data").display()
        ),
    )
    .unwrap();
    let mut daemon = Profiler::spawn(&[
        "daemon".to_string(),
        "--config".into(),
        cfg.display().to_string(),
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http_get(dport, "/healthz").is_ok_and(|(s, _)| s == 200) {
        if let Some(out) = daemon.try_finished() {
            panic!(
                "stallprof daemon exited while starting:\n{}",
                out.describe()
            );
        }
        assert!(
            Instant::now() < deadline,
            "the daemon did not answer within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Prometheus: loopback, a random port, its data in the scratch dir,
    // scraping every second, with the shipped rules evaluated every second.
    let rules = workspace().join("docs/deploy/prometheus/stallprof.rules.yml");
    let pcfg = scratch.join("prometheus.yml");
    std::fs::write(
        &pcfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files: [\"{}\"]\n\
             scrape_configs:\n  - job_name: stallprof\n    static_configs:\n      - targets: [\"127.0.0.1:{dport}\"]\n",
            rules.display()
        ),
    )
    .unwrap();
    let plog = std::fs::File::create(scratch.join("prometheus.log")).unwrap();
    let _prom = Child(
        Command::new(&prometheus)
            .arg(format!("--config.file={}", pcfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                scratch.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{pport}"))
            .arg(format!(
                "--web.console.templates={}",
                scratch.path.display()
            ))
            .arg(format!(
                "--web.console.libraries={}",
                scratch.path.display()
            ))
            .stdout(plog.try_clone().unwrap())
            .stderr(plog)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", prometheus.display())),
    );

    // A victim that stalls again and again while we wait.
    let exe = build_c_loop(&scratch.path, true);
    let log = scratch.join("victim.jsonl");
    let victim = Victim::spawn(Command::new(&exe).arg(&log).args([
        "--schedule",
        "spin:120,idle:20,sleep:120,idle:20",
        "--repeat",
        "60",
    ]));
    let pid = victim.pid().to_string();

    let query = |q: &str| -> Option<Value> {
        let (status, body) =
            http_get(pport, &format!("/api/v1/query?query={}", urlencode(q))).ok()?;
        let v: Value = serde_json::from_str(&body).ok()?;
        (status == 200 && v["status"] == "success").then_some(v)
    };
    let plog_text = || std::fs::read_to_string(scratch.join("prometheus.log")).unwrap_or_default();
    // Waits until the query returns a series with a value > 0.
    let wait = |q: &str, timeout: Duration| -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = query(q) {
                let result = &v["data"]["result"];
                let positive = result.as_array().is_some_and(|r| {
                    r.iter().any(|s| {
                        s["value"][1]
                            .as_str()
                            .and_then(|x| x.parse::<f64>().ok())
                            .is_some_and(|x| x > 0.0)
                    })
                });
                if positive {
                    return v;
                }
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus (127.0.0.1:{pport}) did not answer `{q}` with a value > 0 within \
                 {timeout:?}; its targets: {:?}\n--- prometheus log ---\n{}",
                http_get(pport, "/api/v1/targets").map(|(_, b)| b),
                plog_text()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    let stalls = wait(
        &format!("stallprof_stall_duration_seconds_count{{job=\"stallprof\",pid=\"{pid}\"}}"),
        Duration::from_secs(90),
    );
    let series = &stalls["data"]["result"][0]["metric"];
    assert_eq!(series["comm"], "c_loop", "{stalls}");
    assert_eq!(series["instance"], format!("127.0.0.1:{dport}"), "{stalls}");
    // Time by kind, and the recording rules computed from the real series.
    wait(
        &format!("stallprof_stall_seconds_total{{pid=\"{pid}\",kind=\"on_cpu\"}}"),
        Duration::from_secs(30),
    );
    wait(
        &format!("stallprof:stalls:rate5m{{pid=\"{pid}\"}}"),
        Duration::from_secs(60),
    );
    wait(
        &format!("stallprof:stall_time_ratio:rate5m{{pid=\"{pid}\"}}"),
        Duration::from_secs(30),
    );
    wait(
        &format!("stallprof:stall_duration_seconds:p99_5m{{pid=\"{pid}\"}}"),
        Duration::from_secs(30),
    );
    wait("stallprof_build_info", Duration::from_secs(10));
    // Every rule evaluates without error against the real series.
    let (_, rules_body) = http_get(pport, "/api/v1/rules").unwrap();
    let rules: Value = serde_json::from_str(&rules_body).unwrap();
    for g in rules["data"]["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "rule {} is unhealthy: {r}", r["name"]);
        }
    }
    drop(victim);
    daemon.signal(libc::SIGTERM);
    let out = daemon.wait(Duration::from_secs(30));
    assert!(
        out.status.success(),
        "the daemon's exit:\n{}",
        out.describe()
    );
}
