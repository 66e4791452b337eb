//! The operating system as stallprof sees it: procfs, the clock, units, output
//! directories that cannot be redirected, the container a process runs in, a
//! watched process tree's roles ([`family`]), the invoking user, the bounds on
//! reads the target controls, the terminal's width; and the target as the OS
//! shows it: its mappings ([`maps`], the one `/proc/PID/maps` parser) and its memory
//! ([`memory`], the one `/proc/PID/mem` reader).
pub mod clock;
pub mod container;
pub mod cpu_quota;
pub mod elf_symbols;
pub mod family;
pub mod heap;
pub mod lacking;
pub mod limits;
pub mod maps;
pub mod memory;
pub mod outdir;
pub mod proc;
pub mod terminal;
pub mod units;
pub mod user;

/// Tests: a new, empty directory under the temp dir, named `stallprof-NAME-`
/// and a random suffix (never one a previous run left).
#[cfg(test)]
pub fn scratch_dir(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("stallprof-{name}-{}", outdir::random_suffix()));
    std::fs::create_dir(&p).unwrap();
    p
}
