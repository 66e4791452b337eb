//! `cargo xtask dist`: the release artifacts, from one static build, into
//! `target/dist/`:
//!
//! - `stallprof-VER-x86_64-linux.tar.gz`: the static binary with README,
//!   CHANGELOG, the licenses and docs/ (deploy examples included);
//! - `stallprof-VER-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.musllinux_1_1_x86_64.whl`:
//!   the binary as the `stallprof` script (the py-spy way: no Python code);
//! - `stallprof_VER_amd64.deb`: /usr/bin/stallprof, the systemd unit,
//!   /etc/stallprof/daemon.toml (a conffile), the man page, the docs;
//! - the OCI image `localhost/stallprof:VER` (FROM scratch), built with
//!   podman or buildah when one is installed, saved as
//!   `stallprof-VER-oci.tar` (an OCI archive);
//! - `SHA256SUMS` over the files, and `dist.json` (what was built, for the
//!   tests in profiler/tests/dist.rs).
//!
//! The binary: `x86_64-unknown-linux-musl` (static by default; the target
//! is added with rustup when missing); when rustup cannot add it (no access
//! to its dist server), a fully static glibc build (`-C
//! target-feature=+crt-static`), said loudly. Either is checked: no program
//! interpreter, no DT_NEEDED, and the eBPF object the build embedded found
//! byte for byte inside it.
//!
//! Reproducible: SOURCE_DATE_EPOCH (from the environment, else the last
//! commit's time) is every file's mtime, owners are root (0/0), archive
//! members are sorted, gzip carries no name or time, the zip has fixed
//! times and modes, source paths in the binary are remapped
//! (`--remap-path-prefix`). Packing twice gives the same bytes (`cargo
//! xtask test` checks it for the tarball, wheel and .deb).
use std::{
    collections::BTreeMap,
    env, fs,
    io::Write,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use crate::{cargo, output, root, run, setup};

const MUSL: &str = "x86_64-unknown-linux-musl";
const GNU: &str = "x86_64-unknown-linux-gnu";
/// The wheel's platform tags: a static binary needs neither glibc nor musl
/// of any version, so both families are honest; `manylinux2014` is the
/// legacy alias of `manylinux_2_17` for pip before 20.3.
const WHEEL_PLATFORM: &str = "manylinux_2_17_x86_64.manylinux2014_x86_64.musllinux_1_1_x86_64";
/// The licenses of what the static binary contains besides stallprof.
const THIRD_PARTY: &str = "THIRD-PARTY.md";
/// The image, as docs/deploy/daemonset.yaml names it (with the version).
pub const IMAGE_NAME: &str = "localhost/stallprof";

/// What `dist` built (also written as target/dist/dist.json).
pub struct Built {
    pub dir: PathBuf,
}

pub fn dist_dir() -> PathBuf {
    target_dir().join("dist")
}

fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

/// The release version: profiler/Cargo.toml's `[package] version`.
pub fn version() -> Result<String> {
    let toml = fs::read_to_string(root().join("profiler/Cargo.toml"))?;
    toml.lines()
        .skip_while(|l| l.trim() != "[package]")
        .find_map(|l| {
            let v = l.strip_prefix("version")?.trim_start().strip_prefix('=')?;
            Some(v.trim().trim_matches('"').to_string())
        })
        .context("no version in profiler/Cargo.toml [package]")
}

/// SOURCE_DATE_EPOCH from the environment, else the last commit's time.
fn source_date_epoch() -> Result<u64> {
    if let Ok(s) = env::var("SOURCE_DATE_EPOCH") {
        return s
            .trim()
            .parse()
            .with_context(|| format!("SOURCE_DATE_EPOCH={s:?} is not a number of seconds"));
    }
    let out = output(
        Command::new("git")
            .arg("-C")
            .arg(root())
            .args(["log", "-1", "--format=%ct"]),
    )
    .context(
        "no SOURCE_DATE_EPOCH and no git history to take it from: set SOURCE_DATE_EPOCH \
         (seconds since 1970) to build the artifacts from a source tarball",
    )?;
    out.trim()
        .parse()
        .with_context(|| format!("git log gave {out:?} for the last commit's time"))
}

fn git_commit() -> String {
    output(
        Command::new("git")
            .arg("-C")
            .arg(root())
            .args(["rev-parse", "HEAD"]),
    )
    .map(|s| s.trim().to_string())
    .unwrap_or_else(|_| "unknown".into())
}

/// The static target: musl when rustup has or can add it, else static glibc.
fn static_target() -> Result<&'static str> {
    // A packager's (or a test's) choice: STALLPROF_DIST_TARGET=x86_64-unknown-linux-gnu
    // builds the static glibc fallback on purpose.
    match env::var("STALLPROF_DIST_TARGET").ok().as_deref() {
        None | Some("") => {}
        Some(MUSL) => {}
        Some(GNU) => {
            eprintln!("xtask: STALLPROF_DIST_TARGET={GNU}: a fully static glibc build");
            return Ok(GNU);
        }
        Some(other) => bail!(
            "STALLPROF_DIST_TARGET={other:?}: the static builds are {MUSL} (the default) and {GNU}"
        ),
    }
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"]))
        .context("rustup is needed to pick the static target (rustup target list)")?;
    if installed.lines().any(|l| l.trim() == MUSL) {
        return Ok(MUSL);
    }
    eprintln!("xtask: adding the {MUSL} target (rustup target add {MUSL})");
    if run(Command::new("rustup").args(["target", "add", MUSL])).is_ok() {
        return Ok(MUSL);
    }
    eprintln!(
        "xtask: WARNING: rustup could not add {MUSL} (no access to its dist server?): \
         building a fully static glibc binary instead (-C target-feature=+crt-static). \
         Its `--user USER` name lookups read /etc/passwd and /etc/group through glibc's \
         built-in files backend only (no NSS modules: LDAP/sssd users are not found)"
    );
    Ok(GNU)
}

/// Builds the static binary once; checks it is static and carries the eBPF
/// object; returns its path.
fn build_static(triple: &str, epoch: u64) -> Result<PathBuf> {
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"));
    // Paths in panic messages and debug info: the same from any checkout.
    let mut flags = vec![
        format!("--remap-path-prefix={}=/stallprof", root().display()),
        format!("--remap-path-prefix={}=/cargo", cargo_home.display()),
    ];
    if triple == GNU {
        flags.push("-Ctarget-feature=+crt-static".into());
    }
    run(cargo()
        .args(["build", "--release", "--target", triple])
        .args(["-p", "profiler", "--bin", "stallprof"])
        // With --target these apply to the binary's crates only, not to
        // build scripts (nor to the eBPF build, which sets its own flags).
        .env("CARGO_ENCODED_RUSTFLAGS", flags.join("\x1f"))
        .env_remove("RUSTFLAGS")
        .env("SOURCE_DATE_EPOCH", epoch.to_string()))?;
    let bin = target_dir().join(triple).join("release/stallprof");
    check_static(&bin)?;
    check_embedded_bpf(&bin, triple)?;
    Ok(bin)
}

/// No program interpreter and no shared library: runs on any x86-64 Linux
/// root filesystem, or none.
fn check_static(bin: &Path) -> Result<()> {
    let headers = output(Command::new("readelf").arg("-lW").arg(bin))
        .context("readelf (binutils) checks that the binary is static: apt-get install binutils")?;
    if headers.contains("INTERP") {
        bail!(
            "{} asks for a program interpreter (dynamically linked): the static build failed",
            bin.display()
        );
    }
    let dynamic = output(Command::new("readelf").arg("-dW").arg(bin))?;
    if let Some(l) = dynamic.lines().find(|l| l.contains("(NEEDED)")) {
        bail!(
            "{} needs a shared library ({}): the static build failed",
            bin.display(),
            l.trim()
        );
    }
    Ok(())
}

/// `--version` names the eBPF object's SHA-256; the object with that hash
/// in the build's OUT_DIR must be inside the binary, byte for byte.
fn check_embedded_bpf(bin: &Path, triple: &str) -> Result<()> {
    let line = output(Command::new(bin).arg("--version"))
        .with_context(|| format!("running {} --version", bin.display()))?;
    let want = line
        .split("sha256:")
        .nth(1)
        .map(|s| s.trim().trim_end_matches(')').to_string())
        .with_context(|| format!("`stallprof --version` names no eBPF object hash: {line:?}"))?;
    let build = target_dir().join(triple).join("release/build");
    let mut object = None;
    for e in fs::read_dir(&build)?.flatten() {
        if !e.file_name().to_string_lossy().starts_with("profiler-") {
            continue;
        }
        let p = e.path().join("out/profiler");
        if let Ok(bytes) = fs::read(&p)
            && sha256_hex(&bytes) == want
        {
            object = Some(bytes);
            break;
        }
    }
    let object = object.with_context(|| {
        format!(
            "no eBPF object with sha256 {want} under {}/profiler-*/out: the binary's \
             --version does not match its build",
            build.display()
        )
    })?;
    let image = fs::read(bin)?;
    if !contains(&image, &object) {
        bail!(
            "the eBPF object (sha256 {want}) is not embedded in {}",
            bin.display()
        );
    }
    eprintln!(
        "xtask: {} is static and embeds the eBPF object (sha256 {want}, {} bytes)",
        bin.display(),
        object.len()
    );
    Ok(())
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    let Some(&first) = needle.first() else {
        return true;
    };
    hay.iter()
        .enumerate()
        .filter(|&(_, &b)| b == first)
        .any(|(i, _)| hay[i..].starts_with(needle))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes a file with an explicit mode (never the umask's), creating its
/// parents 0755; refuses to follow a symlink at the path.
fn put(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(parent) = path.parent() {
        mkdirs(parent)?;
    }
    let _ = fs::remove_file(path);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc_o_nofollow())
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// O_NOFOLLOW on Linux (xtask stays free of libc).
const fn libc_o_nofollow() -> i32 {
    0o400000
}

fn mkdirs(dir: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let mut d = dir;
    while !d.exists() {
        missing.push(d.to_path_buf());
        match d.parent() {
            Some(p) => d = p,
            None => break,
        }
    }
    for m in missing.into_iter().rev() {
        fs::create_dir(&m).with_context(|| format!("creating {}", m.display()))?;
        fs::set_permissions(&m, fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

fn copy(from: &Path, to: &Path, mode: u32) -> Result<()> {
    let bytes = fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    put(to, &bytes, mode)
}

/// Every file and directory under `dir` gets mtime `epoch`.
fn set_mtimes(dir: &Path, epoch: u64) -> Result<()> {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(epoch);
    let mut stack = vec![dir.to_path_buf()];
    let mut dirs = Vec::new();
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                fs::File::options()
                    .write(true)
                    .open(e.path())?
                    .set_modified(t)?;
            }
        }
        dirs.push(d);
    }
    // Directories last (writing into one moves its mtime).
    for d in dirs {
        fs::File::open(&d)?.set_modified(t)?;
    }
    Ok(())
}

fn gzip_n(bytes: &[u8]) -> Result<Vec<u8>> {
    // flate2's header has no name and mtime 0 unless asked: reproducible.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(bytes)?;
    Ok(gz.finish()?)
}

/// docs/*.md and docs/deploy/**: what the tarball and the .deb carry.
fn doc_files() -> Result<Vec<PathBuf>> {
    let docs = root().join("docs");
    let mut files = Vec::new();
    let mut stack = vec![docs.clone()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                stack.push(e.path());
            } else if e.file_type()?.is_file() {
                files.push(e.path().strip_prefix(&docs)?.to_path_buf());
            }
        }
    }
    files.sort();
    Ok(files)
}

pub fn run_dist() -> Result<Built> {
    setup()?;
    let version = version()?;
    let epoch = source_date_epoch()?;
    let commit = git_commit();
    let triple = static_target()?;
    let built = build_static(triple, epoch)?;

    let dir = dist_dir();
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    mkdirs(&dir)?;
    let stage = target_dir().join("dist-stage");
    if stage.exists() {
        fs::remove_dir_all(&stage)?;
    }
    mkdirs(&stage)?;

    // The shipped binary: debug info stripped (symbols kept, so a panic's
    // backtrace still names functions); the build's own copy is untouched.
    let bin = stage.join("stallprof");
    copy(&built, &bin, 0o755)?;
    run(Command::new("strip").arg("--strip-debug").arg(&bin))
        .context("strip (binutils) removes the debug info: apt-get install binutils")?;
    let version_line = output(Command::new(&bin).arg("--version"))?
        .trim()
        .to_string();
    let bin_bytes = fs::read(&bin)?;

    // What else is in the binary, crate by crate, for every artifact.
    put(
        &stage.join(THIRD_PARTY),
        third_party(triple)?.as_bytes(),
        0o644,
    )?;

    let mut artifacts: BTreeMap<&str, String> = BTreeMap::new();
    let tarball = tarball(&stage, &bin, &version, epoch)?;
    artifacts.insert("tarball", tarball);
    let wheel = wheel(&stage, &bin_bytes, &version, epoch)?;
    artifacts.insert("wheel", wheel);
    let deb = deb(&stage, &bin, &version, epoch)?;
    artifacts.insert("deb", deb);
    let image = match image(&stage, &bin, &version, &commit, epoch)? {
        Some((name, archive)) => {
            artifacts.insert("image_archive", archive);
            Some(name)
        }
        None => None,
    };

    // SHA256SUMS over every artifact, sorted, in sha256sum's format.
    let mut sums = String::new();
    for name in artifacts
        .values()
        .collect::<std::collections::BTreeSet<_>>()
    {
        let bytes = fs::read(dir.join(name))?;
        sums.push_str(&format!("{}  {name}\n", sha256_hex(&bytes)));
    }
    put(&dir.join("SHA256SUMS"), sums.as_bytes(), 0o644)?;

    let manifest = serde_json::json!({
        "version": version,
        "commit": commit,
        "source_date_epoch": epoch,
        "target": triple,
        "version_line": version_line,
        "image": image,
        "artifacts": artifacts,
    });
    put(
        &dir.join("dist.json"),
        serde_json::to_string_pretty(&manifest)?.as_bytes(),
        0o644,
    )?;
    fs::remove_dir_all(&stage)?;
    eprintln!("xtask: dist: {} ({triple})", dir.display());
    for l in sums.lines() {
        eprintln!("  {l}");
    }
    if image.is_none() {
        eprintln!(
            "xtask: WARNING: no OCI image: neither podman nor buildah is installed \
             (apt-get install podman), so {IMAGE_NAME}:{version} was NOT built"
        );
    }
    Ok(Built { dir })
}

/// THIRD-PARTY.md: every crate linked into the binary (the normal
/// dependencies of `profiler` for `triple`, from `cargo metadata`) with its
/// version, license and source, and the C library the target links in.
fn third_party(triple: &str) -> Result<String> {
    let out = output_bytes(
        cargo()
            .args(["metadata", "--format-version", "1", "--locked"])
            .args(["--filter-platform", triple]),
    )?;
    let meta: serde_json::Value = serde_json::from_slice(&out)?;
    let packages: BTreeMap<&str, &serde_json::Value> = meta["packages"]
        .as_array()
        .context("cargo metadata: no packages")?
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let nodes: BTreeMap<&str, &serde_json::Value> = meta["resolve"]["nodes"]
        .as_array()
        .context("cargo metadata: no resolve graph")?
        .iter()
        .filter_map(|n| Some((n["id"].as_str()?, n)))
        .collect();
    let profiler = packages
        .iter()
        .find(|(_, p)| p["name"] == "profiler")
        .map(|(id, _)| *id)
        .context("cargo metadata: no profiler package")?;
    // Normal dependencies only (kind null): what is linked into the binary.
    let mut seen = std::collections::BTreeSet::new();
    let mut todo = vec![profiler];
    while let Some(id) = todo.pop() {
        if !seen.insert(id) {
            continue;
        }
        for d in nodes[id]["deps"].as_array().into_iter().flatten() {
            let normal = d["dep_kinds"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k["kind"].is_null()));
            if normal && let Some(pkg) = d["pkg"].as_str() {
                todo.push(pkg);
            }
        }
    }
    let mut rows: Vec<(String, String, String, String)> = seen
        .iter()
        .map(|id| packages[id])
        .filter(|p| p["source"].is_string()) // the workspace's own crates are stallprof
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap_or("").to_string();
            let source = match s("repository") {
                r if !r.is_empty() => r,
                _ => format!("https://crates.io/crates/{}", s("name")),
            };
            let license = match s("license") {
                l if !l.is_empty() => l,
                _ => format!("see its license file ({})", s("license_file")),
            };
            (s("name"), s("version"), license, source)
        })
        .collect();
    rows.sort();
    let libc = if triple == MUSL {
        "| musl libc (Rust's self-contained x86_64-unknown-linux-musl target) | as shipped by rustup | MIT | https://musl.libc.org |\n"
    } else {
        "| GNU C Library, linked statically (`+crt-static`) | the build machine's | LGPL-2.1-or-later (linked statically: whoever distributes this binary must also offer what is needed to relink it against another glibc; the musl build has no such duty) | https://www.gnu.org/software/libc/ |\n"
    };
    let mut text = format!(
        "# Third-party software in the stallprof binary\n\n\
         stallprof is statically linked: besides its own code (MIT OR Apache-2.0,\n\
         LICENSE-MIT and LICENSE-APACHE), the binary contains the crates below,\n\
         each under its own license, whose full text and copyright notices are\n\
         in its source at the address given (crates.io keeps every version), and\n\
         the C library its target links in. Generated by `cargo xtask dist` from\n\
         `cargo metadata` for {triple}: {} crates.\n\n\
         | crate | version | license | source |\n|---|---|---|---|\n{libc}",
        rows.len()
    );
    for (name, version, license, source) in rows {
        text.push_str(&format!("| {name} | {version} | {license} | {source} |\n"));
    }
    Ok(text)
}

/// stallprof-VER-x86_64-linux.tar.gz: stallprof-VER-x86_64-linux/{stallprof,
/// README.md, CHANGELOG.md, LICENSE-*, docs/}.
fn tarball(stage: &Path, bin: &Path, version: &str, epoch: u64) -> Result<String> {
    let top = format!("stallprof-{version}-x86_64-linux");
    let t = stage.join("tar").join(&top);
    copy(bin, &t.join("stallprof"), 0o755)?;
    for f in ["README.md", "CHANGELOG.md", "LICENSE-MIT", "LICENSE-APACHE"] {
        copy(&root().join(f), &t.join(f), 0o644)?;
    }
    copy(&stage.join(THIRD_PARTY), &t.join(THIRD_PARTY), 0o644)?;
    for f in doc_files()? {
        copy(
            &root().join("docs").join(&f),
            &t.join("docs").join(&f),
            0o644,
        )?;
    }
    set_mtimes(&stage.join("tar"), epoch)?;
    let name = format!("{top}.tar.gz");
    let tar = output_bytes(
        Command::new("tar")
            .args([
                "--sort=name",
                "--owner=0",
                "--group=0",
                "--numeric-owner",
                "--format=gnu",
            ])
            .arg(format!("--mtime=@{epoch}"))
            .arg("-C")
            .arg(stage.join("tar"))
            .args(["-cf", "-", &top]),
    )
    .context("GNU tar packs the tarball (--sort=name needs tar 1.28+)")?;
    put(&dist_dir().join(&name), &gzip_n(&tar)?, 0o644)?;
    Ok(name)
}

fn output_bytes(cmd: &mut Command) -> Result<Vec<u8>> {
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

// ---------------------------------------------------------------------------
// The wheel

/// The wheel: `stallprof-VER.data/scripts/stallprof` (pip puts it on the
/// environment's PATH, executable), METADATA, WHEEL, the licenses, RECORD.
fn wheel(stage: &Path, bin: &[u8], version: &str, epoch: u64) -> Result<String> {
    let dist_info = format!("stallprof-{version}.dist-info");
    let readme = fs::read_to_string(root().join("README.md"))?;
    let metadata = format!(
        "Metadata-Version: 2.1\n\
         Name: stallprof\n\
         Version: {version}\n\
         Summary: Who froze the event loop, and where did the whole stall go? An eBPF stall profiler for asyncio, uvloop, libuv/Node, tokio and C event loops.\n\
         License: MIT OR Apache-2.0\n\
         Keywords: profiler,asyncio,event-loop,ebpf,latency\n\
         Classifier: Development Status :: 4 - Beta\n\
         Classifier: Environment :: Console\n\
         Classifier: Intended Audience :: Developers\n\
         Classifier: License :: OSI Approved :: MIT License\n\
         Classifier: License :: OSI Approved :: Apache Software License\n\
         Classifier: Operating System :: POSIX :: Linux\n\
         Classifier: Programming Language :: Rust\n\
         Classifier: Topic :: Software Development :: Debuggers\n\
         Classifier: Topic :: System :: Monitoring\n\
         Requires-Python: >=3.7\n\
         Description-Content-Type: text/markdown; charset=UTF-8\n\
         \n\
         {readme}"
    );
    let tags: Vec<String> = WHEEL_PLATFORM
        .split('.')
        .map(|p| format!("Tag: py3-none-{p}\n"))
        .collect();
    let wheel_meta = format!(
        "Wheel-Version: 1.0\nGenerator: stallprof cargo xtask dist\nRoot-Is-Purelib: false\n{}",
        tags.concat()
    );
    let mut files: Vec<(String, Vec<u8>, u32)> = vec![
        (
            format!("stallprof-{version}.data/scripts/stallprof"),
            bin.to_vec(),
            0o755,
        ),
        (
            format!("{dist_info}/METADATA"),
            metadata.into_bytes(),
            0o644,
        ),
        (format!("{dist_info}/WHEEL"), wheel_meta.into_bytes(), 0o644),
    ];
    for l in ["LICENSE-MIT", "LICENSE-APACHE"] {
        files.push((
            format!("{dist_info}/licenses/{l}"),
            fs::read(root().join(l))?,
            0o644,
        ));
    }
    files.push((
        format!("{dist_info}/licenses/{THIRD_PARTY}"),
        fs::read(stage.join(THIRD_PARTY))?,
        0o644,
    ));
    files.sort_by(|a, b| a.0.cmp(&b.0));
    let mut record = String::new();
    for (name, bytes, _) in &files {
        record.push_str(&format!(
            "{name},sha256={},{}\n",
            base64_urlsafe_nopad(&Sha256::digest(bytes)),
            bytes.len()
        ));
    }
    record.push_str(&format!("{dist_info}/RECORD,,\n"));
    // RECORD last, as the spec recommends (the .dist-info at the end).
    files.push((format!("{dist_info}/RECORD"), record.into_bytes(), 0o644));
    let name = format!("stallprof-{version}-py3-none-{WHEEL_PLATFORM}.whl");
    put(&dist_dir().join(&name), &zip(&files, epoch)?, 0o644)?;
    Ok(name)
}

fn base64_urlsafe_nopad(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut s = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    s
}

/// A zip archive (deflate, or stored when that is smaller), with the given
/// order, fixed times (the epoch's, in MS-DOS format) and Unix modes.
fn zip(files: &[(String, Vec<u8>, u32)], epoch: u64) -> Result<Vec<u8>> {
    let (time, date) = dos_time(epoch);
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, bytes, mode) in files {
        let crc = crc32fast::hash(bytes);
        let mut deflated =
            flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
        deflated.write_all(bytes)?;
        let deflated = deflated.finish()?;
        let (method, data): (u16, &[u8]) = if deflated.len() < bytes.len() {
            (8, &deflated)
        } else {
            (0, bytes)
        };
        let offset = u32::try_from(out.len()).context("wheel over 4 GiB")?;
        let (csize, usize_) = (u32::try_from(data.len())?, u32::try_from(bytes.len())?);
        // Local file header.
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        out.extend_from_slice(&20u16.to_le_bytes()); // version needed: 2.0
        out.extend_from_slice(&0u16.to_le_bytes()); // flags
        out.extend_from_slice(&method.to_le_bytes());
        out.extend_from_slice(&time.to_le_bytes());
        out.extend_from_slice(&date.to_le_bytes());
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&csize.to_le_bytes());
        out.extend_from_slice(&usize_.to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes()); // extra
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(data);
        // Its central directory entry.
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&(3u16 << 8 | 20).to_le_bytes()); // made by: Unix, 2.0
        central.extend_from_slice(&20u16.to_le_bytes());
        central.extend_from_slice(&0u16.to_le_bytes());
        central.extend_from_slice(&method.to_le_bytes());
        central.extend_from_slice(&time.to_le_bytes());
        central.extend_from_slice(&date.to_le_bytes());
        central.extend_from_slice(&crc.to_le_bytes());
        central.extend_from_slice(&csize.to_le_bytes());
        central.extend_from_slice(&usize_.to_le_bytes());
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0; 8]); // extra, comment, disk, internal attrs
        // External attributes: a regular file (S_IFREG) with its mode.
        central.extend_from_slice(&((0o100000 | mode) << 16).to_le_bytes());
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(name.as_bytes());
    }
    let cd_offset = u32::try_from(out.len())?;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0; 4]); // this disk, the central directory's disk
    let n = u16::try_from(files.len())?;
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&u32::try_from(central.len())?.to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes()); // comment
    Ok(out)
}

/// Seconds since 1970 (UTC) as MS-DOS (time, date); 1980 at the earliest.
fn dos_time(epoch: u64) -> (u16, u16) {
    let days = (epoch / 86400) as i64;
    let secs = epoch % 86400;
    let (y, m, d) = civil_from_days(days);
    if y < 1980 {
        return (0, 1 << 5 | 1);
    }
    let time = ((secs / 3600) << 11) | ((secs % 3600 / 60) << 5) | ((secs % 60) / 2);
    let date = ((y - 1980) as u64) << 9 | (m as u64) << 5 | d as u64;
    (time as u16, date as u16)
}

/// Days since 1970-01-01 -> (year, month, day), proleptic Gregorian
/// (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

// ---------------------------------------------------------------------------
// The Debian package

/// What the package's maintainer scripts do: a daemon-reload where systemd
/// runs (never in a `dpkg --root` install: DPKG_ROOT), never an enable or a
/// start; a stop before removal; a purge drops a dangling enable link and
/// keeps the reports in /var/lib/stallprof (the daemon's data, not the
/// package's).
const POSTINST: &str = r#"#!/bin/sh
# stallprof: make systemd see the unit. The daemon is never enabled or
# started by the package: `systemctl enable --now stallprof` when you want it.
set -e
if [ "$1" = "configure" ] && [ -z "${DPKG_ROOT:-}" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null || true
fi
exit 0
"#;
const PRERM: &str = r#"#!/bin/sh
# stallprof: stop a running daemon before its binary goes away (remove only,
# not on upgrade: a running daemon keeps running until you restart it).
set -e
if [ "$1" = "remove" ] && [ -z "${DPKG_ROOT:-}" ] && [ -d /run/systemd/system ]; then
    systemctl stop stallprof.service >/dev/null 2>&1 || true
fi
exit 0
"#;
const POSTRM: &str = r#"#!/bin/sh
# stallprof: forget the unit. A purge also removes the link `systemctl
# enable` made; the reports in /var/lib/stallprof stay (remove them yourself).
set -e
if [ "$1" = "purge" ]; then
    rm -f "${DPKG_ROOT:-}/etc/systemd/system/multi-user.target.wants/stallprof.service"
fi
if { [ "$1" = "remove" ] || [ "$1" = "purge" ]; } && [ -z "${DPKG_ROOT:-}" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null || true
fi
exit 0
"#;

/// The unit as the package installs it: the binary at /usr/bin.
pub fn packaged_unit() -> Result<String> {
    let unit = fs::read_to_string(root().join("docs/deploy/stallprof.service"))?;
    if !unit.contains("/usr/local/bin/stallprof") {
        bail!(
            "docs/deploy/stallprof.service no longer runs /usr/local/bin/stallprof: update xtask/src/dist.rs"
        );
    }
    let body: String = unit
        .lines()
        .skip_while(|l| l.starts_with('#'))
        .map(|l| {
            format!(
                "{}\n",
                l.replace("/usr/local/bin/stallprof", "/usr/bin/stallprof")
            )
        })
        .collect();
    Ok(format!(
        "# stallprof daemon (installed by the stallprof package; docs in\n\
         # /usr/share/doc/stallprof/docs/daemon.md). Not enabled by the package:\n\
         #   stallprof daemon --config /etc/stallprof/daemon.toml --check-config\n\
         #   systemctl enable --now stallprof\n\
         # Changes: `systemctl edit stallprof` (a drop-in), not this file.\n{body}"
    ))
}

fn deb(stage: &Path, bin: &Path, version: &str, epoch: u64) -> Result<String> {
    let r = stage.join("deb");
    let doc = r.join("usr/share/doc/stallprof");
    copy(bin, &r.join("usr/bin/stallprof"), 0o755)?;
    put(
        &r.join("usr/lib/systemd/system/stallprof.service"),
        packaged_unit()?.as_bytes(),
        0o644,
    )?;
    copy(
        &root().join("docs/deploy/daemon.toml"),
        &r.join("etc/stallprof/daemon.toml"),
        0o644,
    )?;
    put(
        &r.join("usr/share/man/man1/stallprof.1.gz"),
        &gzip_n(man_page(bin, version, epoch)?.as_bytes())?,
        0o644,
    )?;
    put(&doc.join("copyright"), copyright()?.as_bytes(), 0o644)?;
    copy(&stage.join(THIRD_PARTY), &doc.join(THIRD_PARTY), 0o644)?;
    copy(&root().join("README.md"), &doc.join("README.md"), 0o644)?;
    put(
        &doc.join("changelog.gz"),
        &gzip_n(&fs::read(root().join("CHANGELOG.md"))?)?,
        0o644,
    )?;
    for f in doc_files()? {
        copy(
            &root().join("docs").join(&f),
            &doc.join("docs").join(&f),
            0o644,
        )?;
    }

    // md5sums of every file but the conffile (dpkg's own format).
    let mut md5sums = String::new();
    let mut files = Vec::new();
    let mut stack = vec![r.clone()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                stack.push(e.path());
            } else {
                files.push(e.path().strip_prefix(&r)?.to_path_buf());
            }
        }
    }
    files.sort();
    for f in files.iter().filter(|f| !f.starts_with("etc")) {
        let sum = output(Command::new("md5sum").arg(r.join(f)))?;
        let hash = sum.split_whitespace().next().unwrap_or_default();
        md5sums.push_str(&format!("{hash}  {}\n", f.display()));
    }
    let installed_kib = files
        .iter()
        .map(|f| fs::metadata(r.join(f)).map(|m| m.len().div_ceil(1024)))
        .sum::<std::io::Result<u64>>()?;
    let control = format!(
        "Package: stallprof\n\
         Version: {version}\n\
         Architecture: amd64\n\
         Maintainer: The stallprof developers <stallprof@example.invalid>\n\
         Installed-Size: {installed_kib}\n\
         Section: devel\n\
         Priority: optional\n\
         Homepage: https://example.invalid/stallprof\n\
         Description: stall profiler for event-loop runtimes (eBPF)\n \
         Who froze the event loop, and where did the whole stall go? stallprof\n \
         attaches to a running asyncio/uvloop, Node/libuv, tokio or C epoll service\n \
         with eBPF, finds every stall (a loop iteration over a threshold) and splits\n \
         its time into on-CPU, blocked (in which syscall), run-queue and GIL wait,\n \
         with Python, JavaScript, native and kernel stacks.\n \
         .\n \
         The package also has the host-wide daemon (Prometheus metrics, pprof,\n \
         rolling reports) as a systemd unit, not enabled: see\n \
         /usr/share/doc/stallprof/docs/daemon.md. A static binary: no dependencies.\n"
    );
    let debian = r.join("DEBIAN");
    put(&debian.join("control"), control.as_bytes(), 0o644)?;
    put(
        &debian.join("conffiles"),
        b"/etc/stallprof/daemon.toml\n",
        0o644,
    )?;
    put(&debian.join("md5sums"), md5sums.as_bytes(), 0o644)?;
    put(&debian.join("postinst"), POSTINST.as_bytes(), 0o755)?;
    put(&debian.join("prerm"), PRERM.as_bytes(), 0o755)?;
    put(&debian.join("postrm"), POSTRM.as_bytes(), 0o755)?;
    set_mtimes(&r, epoch)?;
    let name = format!("stallprof_{version}_amd64.deb");
    run(Command::new("dpkg-deb")
        .args(["--build", "--root-owner-group", "-Zxz"])
        .arg(&r)
        .arg(dist_dir().join(&name))
        .env("SOURCE_DATE_EPOCH", epoch.to_string()))
    .context("dpkg-deb (package dpkg) builds the .deb")?;
    fs::set_permissions(dist_dir().join(&name), fs::Permissions::from_mode(0o644))?;
    Ok(name)
}

/// debian/copyright (machine-readable format 1.0).
fn copyright() -> Result<String> {
    let mit = fs::read_to_string(root().join("LICENSE-MIT"))?;
    let mit: String = mit
        .lines()
        .map(|l| {
            if l.is_empty() {
                " .\n".to_string()
            } else {
                format!(" {l}\n")
            }
        })
        .collect();
    Ok(format!(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\
         Upstream-Name: stallprof\n\
         Upstream-Contact: The stallprof developers <stallprof@example.invalid>\n\
         Source: https://example.invalid/stallprof\n\
         Comment: The binary is statically linked. It contains Rust crates and\n \
         a C library under their own licenses, each listed with its version,\n \
         license and source in /usr/share/doc/stallprof/THIRD-PARTY.md (among\n \
         them inferno, CDDL-1.0, whose source is at the address listed there).\n \
         The embedded eBPF programs declare the license \"GPL\" to the kernel,\n \
         which reserves some BPF helpers for GPL programs; their source is under\n \
         the terms below like the rest.\n\
         \n\
         Files: *\n\
         Copyright: The stallprof developers\n\
         License: MIT or Apache-2.0\n\
         \n\
         License: MIT\n\
         {mit}\
         \n\
         License: Apache-2.0\n \
         Licensed under the Apache License, Version 2.0 (the \"License\"); you may\n \
         not use this file except in compliance with the License.\n \
         .\n \
         On Debian systems, the complete text of the Apache License, Version 2.0\n \
         can be found in /usr/share/common-licenses/Apache-2.0.\n"
    ))
}

/// A man page from the binary's own --help texts (so it cannot drift).
fn man_page(bin: &Path, version: &str, epoch: u64) -> Result<String> {
    let (y, m, d) = civil_from_days((epoch / 86400) as i64);
    let esc = |text: &str| -> String {
        text.lines()
            .map(|l| {
                let l = l.replace('\\', "\\e");
                if l.starts_with('.') || l.starts_with('\'') {
                    format!("\\&{l}\n")
                } else {
                    format!("{l}\n")
                }
            })
            .collect()
    };
    let mut page = format!(
        ".TH STALLPROF 1 \"{y}-{m:02}-{d:02}\" \"stallprof {version}\" \"User Commands\"\n\
         .SH NAME\n\
         stallprof \\- who froze the event loop, and where did the whole stall go?\n\
         .SH SYNOPSIS\n\
         .B stallprof record\n\
         [\\fIOPTIONS\\fR] (\\fB\\-\\-pid\\fR \\fIPID\\fR | \\fB\\-\\-\\fR \\fICOMMAND\\fR...)\n\
         .br\n\
         .B stallprof report\n\
         [\\fIOPTIONS\\fR] \\fIDIR\\fR\n\
         .br\n\
         .B stallprof top\n\
         \\fB\\-\\-pid\\fR \\fIPID\\fR [\\fIOPTIONS\\fR]\n\
         .br\n\
         .B stallprof daemon\n\
         [\\fIOPTIONS\\fR]\n\
         .SH DESCRIPTION\n\
         .nf\n"
    );
    page.push_str(&esc(&output(Command::new(bin).arg("--help"))?));
    page.push_str(".fi\n");
    for sub in ["record", "report", "top", "daemon"] {
        page.push_str(&format!(".SH \"STALLPROF {}\"\n.nf\n", sub.to_uppercase()));
        page.push_str(&esc(&output(Command::new(bin).args([sub, "--help"]))?));
        page.push_str(".fi\n");
    }
    page.push_str(
        ".SH FILES\n\
         .TP\n\
         .I /etc/stallprof/daemon.toml\n\
         the daemon's configuration (stallprof daemon \\-\\-config)\n\
         .TP\n\
         .I /var/lib/stallprof\n\
         the daemon's rolling reports\n\
         .SH SEE ALSO\n\
         /usr/share/doc/stallprof/README.md, /usr/share/doc/stallprof/docs/\n",
    );
    Ok(page)
}

// ---------------------------------------------------------------------------
// The OCI image

/// Builds `localhost/stallprof:VER` FROM scratch with podman (or buildah),
/// saves it as an OCI archive; None when neither is installed.
fn image(
    stage: &Path,
    bin: &Path,
    version: &str,
    commit: &str,
    epoch: u64,
) -> Result<Option<(String, String)>> {
    let tool = ["podman", "buildah"].into_iter().find(|t| {
        Command::new(t)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let Some(tool) = tool else {
        return Ok(None);
    };
    let ctx = stage.join("image");
    copy(bin, &ctx.join("stallprof"), 0o755)?;
    copy(
        &root().join("docs/deploy/daemon.toml"),
        &ctx.join("daemon.toml"),
        0o644,
    )?;
    copy(&stage.join(THIRD_PARTY), &ctx.join(THIRD_PARTY), 0o644)?;
    let containerfile = format!(
        "# stallprof {version}: the static binary and nothing else (built by `cargo xtask dist`).\n\
         FROM scratch\n\
         LABEL org.opencontainers.image.title=\"stallprof\" \\\n\
         \x20     org.opencontainers.image.description=\"eBPF stall profiler for event-loop runtimes; the daemon: docs/daemon.md\" \\\n\
         \x20     org.opencontainers.image.version=\"{version}\" \\\n\
         \x20     org.opencontainers.image.revision=\"{commit}\" \\\n\
         \x20     org.opencontainers.image.licenses=\"MIT OR Apache-2.0\" \\\n\
         \x20     org.opencontainers.image.source=\"https://example.invalid/stallprof\"\n\
         COPY stallprof /usr/bin/stallprof\n\
         COPY daemon.toml /etc/stallprof/daemon.toml\n\
         COPY {THIRD_PARTY} /usr/share/doc/stallprof/{THIRD_PARTY}\n\
         ENTRYPOINT [\"/usr/bin/stallprof\"]\n\
         CMD [\"daemon\", \"--config\", \"/etc/stallprof/daemon.toml\"]\n"
    );
    put(&ctx.join("Containerfile"), containerfile.as_bytes(), 0o644)?;
    set_mtimes(&ctx, epoch)?;
    let name = format!("{IMAGE_NAME}:{version}");
    let mut build = Command::new(tool);
    build
        .args(["build", "--format", "oci", "--layers=false", "--pull=never"])
        .arg(format!("--timestamp={epoch}"))
        .args(["-t", &name, "-f"])
        .arg(ctx.join("Containerfile"))
        .arg(&ctx);
    let previous = image_id(tool, &name);
    run(&mut build).with_context(|| format!("building the image {name} with {tool}"))?;
    // The build this one replaces would stay behind as an untagged image.
    if let Some(old) = previous
        && image_id(tool, &name).as_deref() != Some(old.as_str())
    {
        let _ = Command::new(tool).args(["rmi", &old]).output();
    }
    // Saved as an OCI layout directory, then packed like the tarball (sorted,
    // fixed times and owners): the archive is as reproducible as the image.
    let archive = format!("stallprof-{version}-oci.tar");
    let layout = stage.join("oci-layout");
    let mut save = Command::new(tool);
    if tool == "podman" {
        save.args(["save", "--format", "oci-dir", "-o"])
            .arg(&layout)
            .arg(&name);
    } else {
        save.arg("push")
            .arg(&name)
            .arg(format!("oci:{}:{name}", layout.display()));
    }
    run(&mut save).with_context(|| format!("saving {name} to {}", layout.display()))?;
    set_mtimes(&layout, epoch)?;
    let tar = output_bytes(
        Command::new("tar")
            .args([
                "--sort=name",
                "--owner=0",
                "--group=0",
                "--numeric-owner",
                "--format=gnu",
            ])
            .arg(format!("--mtime=@{epoch}"))
            .arg("-C")
            .arg(&layout)
            .args(["-cf", "-", "."]),
    )?;
    put(&dist_dir().join(&archive), &tar, 0o644)?;
    Ok(Some((name, archive)))
}

/// The id of a local image, None when there is none by that name.
fn image_id(tool: &str, name: &str) -> Option<String> {
    let out = Command::new(tool)
        .args(["image", "inspect", "--format", "{{.Id}}", name])
        .output()
        .ok()?;
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !id.is_empty()).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_python() {
        // base64.urlsafe_b64encode(hashlib.sha256(b"").digest()).rstrip(b"=")
        assert_eq!(
            base64_urlsafe_nopad(&Sha256::digest(b"")),
            "47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"
        );
        assert_eq!(base64_urlsafe_nopad(b"ab"), "YWI");
        assert_eq!(base64_urlsafe_nopad(b"abcd"), "YWJjZA");
    }

    #[test]
    fn dos_times() {
        // 2026-12-01 10:55:58 UTC
        assert_eq!(civil_from_days(1_796_122_558 / 86400), (2026, 12, 1));
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        let (t, d) = dos_time(1_796_122_558);
        assert_eq!((d >> 9) + 1980, 2026);
        assert_eq!(t >> 11, 10);
    }
}
