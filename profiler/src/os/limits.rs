//! Bounds on what a target can make the agent read: capped reads of procfs
//! and of files under the target's root, and a named counter for every
//! limit hit.
//!
//! In: paths the target controls (its `/proc` files, files in its root, its
//! perf map). Out: bytes, at most a cap, from regular files opened without
//! following a symlink out of the target's root. Each time a cap or a check
//! refuses something, [`hit`] counts it under the limit's name; the engine
//! reports the counts in the recording's `drops` (a process-wide tally,
//! because the readers are spread over the symbolizer, the unwinder and the
//! Python reader, none of which owns the engine).

use std::{
    fs::File,
    io::{self, Read},
    os::fd::OwnedFd,
    sync::atomic::{AtomicU64, Ordering},
};

use profiler_common::Cost;
use rustix::fs::{FileType, Mode, OFlags, ResolveFlags, fstat, openat2};

/// A limit that refused or cut a read; its name is the `drops` key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// A `/proc` file longer than [`PROC_FILE_MAX`]: the rest was not read.
    ProcFileTruncated,
    /// A perf map past [`PERF_MAP_MAX_BYTES`] or [`PERF_MAP_MAX_LINES`]:
    /// later JIT names are not read.
    PerfMapCapped,
    /// A perf-map line longer than [`PERF_MAP_MAX_LINE`]: skipped.
    PerfMapLineTooLong,
    /// A file the target controls was a symlink, left its root, or was not
    /// a regular file: not opened.
    FileRefused,
    /// An ELF file or section over its cap: its unwind info or symbols are
    /// not read.
    ElfTooLarge,
    /// A Python thread-state or interpreter list that loops back on itself.
    PythonListCycle,
    /// A Python thread-state or interpreter list longer than its cap.
    PythonListTooLong,
    /// A Python line table over its cap, or the line-table cache over its
    /// budget (then emptied).
    PythonLineTableCapped,
    /// A symbolizer cache over its budget (files parsed, answers kept):
    /// emptied, its entries are recomputed when next needed.
    SymbolCacheReset,
    /// A mapped file that could not be opened as mapped: `map_files`
    /// refused, and the file at its path (in its root or ours) is another
    /// one (replaced, or an overlay's view). Its unwind info is not read.
    NotTheMappedFile,
}

const ALL: [Limit; 10] = [
    Limit::ProcFileTruncated,
    Limit::PerfMapCapped,
    Limit::PerfMapLineTooLong,
    Limit::FileRefused,
    Limit::ElfTooLarge,
    Limit::PythonListCycle,
    Limit::PythonListTooLong,
    Limit::PythonLineTableCapped,
    Limit::SymbolCacheReset,
    Limit::NotTheMappedFile,
];

impl Limit {
    pub fn name(self) -> &'static str {
        match self {
            Limit::ProcFileTruncated => "limit_proc_file_truncated",
            Limit::PerfMapCapped => "limit_perf_map_capped",
            Limit::PerfMapLineTooLong => "limit_perf_map_line_too_long",
            Limit::FileRefused => "limit_target_file_refused",
            Limit::ElfTooLarge => "limit_elf_too_large",
            Limit::PythonListCycle => "limit_python_list_cycle",
            Limit::PythonListTooLong => "limit_python_list_too_long",
            Limit::PythonLineTableCapped => "limit_python_linetable_capped",
            Limit::SymbolCacheReset => "limit_symbol_cache_reset",
            Limit::NotTheMappedFile => "limit_not_the_mapped_file",
        }
    }

    /// What one hit cost the recording.
    pub fn cost(self) -> Cost {
        match self {
            Limit::SymbolCacheReset => Cost::Harmless,
            _ => Cost::Frames,
        }
    }

    /// What one hit means and what it cost, in a phrase (the summary's
    /// counter lines, docs/format.md's table of counters).
    pub fn meaning(self) -> &'static str {
        match self {
            Limit::ProcFileTruncated => {
                "a /proc file past its cap: the rest was not read (frames in it unnamed)"
            }
            Limit::PerfMapCapped => "a perf map past its cap: later JIT frames are unnamed",
            Limit::PerfMapLineTooLong => {
                "a perf-map line too long to be one: its JIT frame is unnamed"
            }
            Limit::FileRefused => {
                "a target's file was a symlink out of its root, or not a regular file: not read"
            }
            Limit::ElfTooLarge => {
                "an ELF file or section over its cap: its unwind info or symbols are not read"
            }
            Limit::PythonListCycle => {
                "a Python thread or interpreter list looped: the threads past it are not read"
            }
            Limit::PythonListTooLong => {
                "a Python thread or interpreter list over its cap: the threads past it are not read"
            }
            Limit::PythonLineTableCapped => {
                "a Python line table over its cap: its frames have no line (or the cache was emptied)"
            }
            Limit::SymbolCacheReset => {
                "a symbolizer cache over its budget was emptied: its answers are recomputed"
            }
            Limit::NotTheMappedFile => {
                "a mapped file replaced on disk: its unwind info is not read, stacks end there"
            }
        }
    }
}

/// Every limit, in the order of [`counts`].
pub fn every() -> [Limit; ALL.len()] {
    ALL
}

static COUNTS: [AtomicU64; ALL.len()] = [const { AtomicU64::new(0) }; ALL.len()];

/// Count one hit of `limit`.
pub fn hit(limit: Limit) {
    let i = ALL
        .iter()
        .position(|&l| l == limit)
        .expect("every limit is in ALL");
    COUNTS[i].fetch_add(1, Ordering::Relaxed);
    log::debug!("read limit hit: {}", limit.name());
}

/// Every limit's count since the process started (zeros included); an
/// engine subtracts the counts it started with.
pub fn counts() -> Vec<(&'static str, u64)> {
    ALL.iter()
        .zip(&COUNTS)
        .map(|(l, c)| (l.name(), c.load(Ordering::Relaxed)))
        .collect()
}

/// The most read of one `/proc` file. `/proc/PID/maps` is the largest
/// stallprof reads: at most `vm.max_map_count` (65 530 by default) lines of
/// about 100 bytes plus a path; 32 MiB holds 65 530 lines with 400-byte paths.
pub const PROC_FILE_MAX: u64 = 32 << 20;

/// The most read of one perf map, over the recording; and its lines.
pub const PERF_MAP_MAX_BYTES: u64 = 64 << 20;
pub const PERF_MAP_MAX_LINES: usize = 1 << 20;
/// A longer perf-map line is not a `START SIZE NAME` line a runtime writes.
pub const PERF_MAP_MAX_LINE: usize = 4096;
/// Bytes of a perf map read per refresh: the time budget of one refresh
/// (about 10 ms); the rest is read at the next ones.
pub const PERF_MAP_READ_PER_REFRESH: u64 = 8 << 20;

/// The largest ELF file whose unwind info or symbols are read: larger than
/// any real executable or shared library with its DWARF.
pub const ELF_FILE_MAX: u64 = 2 << 30;
/// The largest `.eh_frame`/`.eh_frame_hdr`/`.debug_frame` section read:
/// real ones are a few MiB, tens for a browser.
pub const ELF_SECTION_MAX: u64 = 64 << 20;
/// Parsed unwind sections held at once, over every file of every process:
/// past it a new file's unwind info is not read (its frames end the walk).
pub const UNWIND_DATA_MAX: u64 = 512 << 20;

/// The largest symbol tables (`.symtab`+`.strtab`, `.dynsym`+`.dynstr`)
/// read while looking for a symbol by name: they are read whole.
pub const ELF_SYMBOLS_MAX: u64 = 256 << 20;

/// Whether symbol and string tables of `size` bytes together are over
/// [`ELF_SYMBOLS_MAX`] (counted): then their symbols are not read.
pub fn symbol_tables_too_large(size: u64) -> bool {
    let over = size > ELF_SYMBOLS_MAX;
    if over {
        hit(Limit::ElfTooLarge);
    }
    over
}

/// Opens a file the target maps (a path already checked to be the mapped
/// file, or a `map_files` entry) for reading its ELF headers: a regular file
/// no larger than [`ELF_FILE_MAX`], else refused and counted.
pub fn open_elf(path: &std::path::Path) -> io::Result<File> {
    sized_elf(regular(File::open(path)?)?)
}

/// `f` if it is no larger than [`ELF_FILE_MAX`], else counted and refused.
pub fn sized_elf(f: File) -> io::Result<File> {
    if f.metadata()?.len() > ELF_FILE_MAX {
        hit(Limit::ElfTooLarge);
        return Err(io::Error::other("ELF file over the size cap"));
    }
    Ok(f)
}

/// Reads a `/proc` file (or any file) as text, at most `cap` bytes; a
/// longer file is cut at its last whole line and counted.
pub fn read_capped(path: &str, cap: u64) -> io::Result<String> {
    let f = File::open(path)?;
    let mut buf = Vec::new();
    f.take(cap + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > cap {
        hit(Limit::ProcFileTruncated);
        buf.truncate(cap as usize);
        let keep = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        buf.truncate(keep);
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// [`read_capped`] with [`PROC_FILE_MAX`].
pub fn read_proc(path: &str) -> io::Result<String> {
    read_capped(path, PROC_FILE_MAX)
}

/// Opens `path` (absolute, as the target sees it) inside process `pid`'s
/// root: `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` relative to
/// `/proc/PID/root`, so no symlink resolves outside that root, the last
/// component must not be a symlink (`O_NOFOLLOW`), and the file must be a
/// regular file (a FIFO or device is opened `O_NONBLOCK` and then refused).
/// A refusal is counted as [`Limit::FileRefused`].
pub fn open_in_root(pid: u32, path: &str) -> io::Result<File> {
    let root = rustix::fs::open(
        format!("/proc/{pid}/root"),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let rel = path.trim_start_matches('/');
    let flags =
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let fd = openat2(
        &root,
        rel,
        flags,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    );
    let fd: OwnedFd = match fd {
        Ok(fd) => fd,
        Err(e) if e == rustix::io::Errno::LOOP || e == rustix::io::Errno::XDEV => {
            hit(Limit::FileRefused);
            return Err(e.into());
        }
        Err(e) => return Err(e.into()),
    };
    regular(File::from(fd))
}

/// `file` if it is a regular file, else counted and refused.
pub fn regular(file: File) -> io::Result<File> {
    let st = fstat(&file)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        hit(Limit::FileRefused);
        return Err(io::Error::other("not a regular file"));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_capped_cuts_at_a_line_and_counts() {
        let p = std::env::temp_dir().join(format!("sp-limits-{}", std::process::id()));
        std::fs::write(&p, "aaaa\nbbbb\ncccc\n").unwrap();
        let before = counts()[0].1;
        let text = read_capped(p.to_str().unwrap(), 12).unwrap();
        assert_eq!(text, "aaaa\nbbbb\n");
        assert!(counts()[0].1 > before);
        assert_eq!(read_capped(p.to_str().unwrap(), 100).unwrap().len(), 15);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn open_in_root_refuses_symlinks_and_fifos() {
        let me = std::process::id();
        let dir = std::env::temp_dir().join(format!("sp-limits-root-{me}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, "x").unwrap();
        let link = dir.join("l");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let fifo = dir.join("p");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(open_in_root(me, file.to_str().unwrap()).is_ok());
        assert!(open_in_root(me, link.to_str().unwrap()).is_err());
        assert!(open_in_root(me, fifo.to_str().unwrap()).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
