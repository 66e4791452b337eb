//! Builds the eBPF object (profiler-ebpf) with nightly + bpf-linker and
//! places it in OUT_DIR, where `probe` embeds it with `include_bytes!`.
//!
//! `cargo xtask setup` installs bpf-linker under ~/.cache/stallprof; we look
//! there too so a plain `cargo build` works after setup.
//!
//! It also gives `stallprof --version` what identifies a build: the git
//! commit (`STALLPROF_GIT_COMMIT`; `unknown` when built from a source
//! tarball without .git, or set it in the environment) and the SHA-256 of
//! the embedded eBPF object (`STALLPROF_BPF_SHA256`).
use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use sha2::{Digest, Sha256};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap();
    let ebpf = root.join("profiler-ebpf");
    let common = root.join("profiler-common");
    println!("cargo:rerun-if-changed={}", common.display());

    if let Some(home) = env::var_os("HOME") {
        let bin = PathBuf::from(home).join(".cache/stallprof/bpf-linker/bin");
        if bin.join("bpf-linker").exists() {
            let path = env::var_os("PATH").unwrap_or_default();
            let mut dirs = vec![bin];
            dirs.extend(env::split_paths(&path));
            // SAFETY: build scripts are single-threaded at this point.
            unsafe { env::set_var("PATH", env::join_paths(dirs).unwrap()) };
        }
    }
    let have_linker = env::split_paths(&env::var_os("PATH").unwrap_or_default())
        .any(|d| d.join("bpf-linker").exists());
    if !have_linker && env::var_os("AYA_BUILD_SKIP").is_none() {
        panic!(
            "bpf-linker not found: run `cargo xtask setup` once (it installs rust-src for \
             nightly and builds bpf-linker against the toolchain's LLVM), then build again"
        );
    }
    let ebpf_dir = ebpf.to_str().expect("utf-8 path");
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "profiler-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::Nightly,
    )
    .expect("building the eBPF programs failed (see the warnings above)");

    let object = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("profiler");
    let bytes = std::fs::read(&object)
        .unwrap_or_else(|e| panic!("reading the eBPF object {}: {e}", object.display()));
    let digest = Sha256::digest(&bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    println!("cargo:rustc-env=STALLPROF_BPF_SHA256={hex}");
    println!("cargo:rustc-env=STALLPROF_GIT_COMMIT={}", git_commit(root));
}

/// The commit HEAD names, and the files whose change moves it (so a new
/// commit re-runs this script). `STALLPROF_GIT_COMMIT` in the environment
/// wins (a packager building from an exported tree); no git or no
/// repository gives `unknown`.
fn git_commit(root: &Path) -> String {
    println!("cargo:rerun-if-env-changed=STALLPROF_GIT_COMMIT");
    if let Some(c) = env::var("STALLPROF_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
    {
        return c;
    }
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let Some(commit) = git(&["rev-parse", "--verify", "-q", "HEAD"]) else {
        return "unknown".into();
    };
    // HEAD, the branch it points at (loose or packed): where a commit or a
    // checkout lands.
    let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(branch);
    }
    for w in watch {
        if let Some(p) = git(&["rev-parse", "--path-format=absolute", "--git-path", &w])
            && Path::new(&p).exists()
        {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    commit
}
