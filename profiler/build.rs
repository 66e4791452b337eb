//! Builds the eBPF object (profiler-ebpf) with nightly + bpf-linker and
//! places it in OUT_DIR, where `probe` embeds it with `include_bytes!`.
//!
//! `cargo xtask setup` installs bpf-linker under ~/.cache/stallprof; we look
//! there too so a plain `cargo build` works after setup.
use std::{env, path::PathBuf};

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
}
