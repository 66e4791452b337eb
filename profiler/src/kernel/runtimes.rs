//! Runtime park points that are not syscalls: where a runtime's scheduler
//! parks a worker, found by symbol in the target's binaries.
//!
//! In: a pid. Out: (binary, mangled symbol) pairs to put uprobes on. tokio's
//! multi-thread workers park either in the I/O driver's `epoll_wait` or on a
//! condition variable (a futex), so the epoll wait alone cannot define their
//! busy periods; the scheduler's `park_internal` (entered to park, returned
//! from to run tasks again) can, for both flavours.
use std::{collections::HashSet, path::PathBuf};

use crate::os::{elf_symbols::ElfSymbols, lacking, limits, maps};

/// Demangled names (hash stripped) of the park functions, by preference:
/// the first found per scheduler flavour is used.
const TOKIO_PARKS: [&[&str]; 2] = [
    &[
        "tokio::runtime::scheduler::multi_thread::worker::Context::park_internal",
        "tokio::runtime::scheduler::multi_thread::worker::Context::park",
    ],
    &[
        "tokio::runtime::scheduler::current_thread::Context::park_internal",
        "tokio::runtime::scheduler::current_thread::Context::park",
    ],
];

/// A uprobe target: the binary (as seen from the agent) and the symbol.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ParkPoint {
    pub binary: PathBuf,
    pub symbol: String,
    pub demangled: String,
}

/// Executable file mappings of a process, as paths the agent can open.
fn mapped_binaries(pid: u32) -> Vec<PathBuf> {
    let Ok(maps) = maps::read(pid) else {
        return Vec::new();
    };
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for m in &maps {
        // The name it was mapped under: a file deleted since is looked
        // for there (and not found).
        let path = m.path_undeleted();
        if !m.is_exec() || !m.is_file() || !seen.insert(path.to_string()) {
            continue;
        }
        let via_root = PathBuf::from(format!("/proc/{pid}/root{path}"));
        out.push(if via_root.exists() {
            via_root
        } else {
            PathBuf::from(path)
        });
    }
    out
}

/// tokio park points in `pid`'s binaries (empty when it does not use tokio,
/// or its park functions were inlined away).
pub fn tokio_park_points(pid: u32) -> Vec<ParkPoint> {
    let mut points = Vec::new();
    for bin in mapped_binaries(pid) {
        if lacking::NO_TOKIO_PARKS.contains(&bin) {
            continue;
        }
        // Read on demand (headers and the symbol tables), never the whole
        // file: a libpython with DWARF is tens of MiB.
        // In the target's root, symlinks resolve inside that root, never to
        // a host file.
        let root = format!("/proc/{pid}/root");
        let opened = match bin.to_str().and_then(|b| b.strip_prefix(&root)) {
            Some(inside) => limits::open_in_root(pid, inside).and_then(limits::sized_elf),
            None => limits::open_elf(&bin),
        };
        let Ok(f) = opened else { continue };
        let Ok(elf) = ElfSymbols::open(&f) else {
            continue;
        };
        if limits::symbol_tables_too_large(elf.tables_size()) {
            continue;
        }
        let Ok(syms) = elf.find(&["tokio"], &|n| n.contains("tokio") && n.contains("park")) else {
            continue;
        };
        let mut found: Vec<Option<(usize, String, String)>> = vec![None; TOKIO_PARKS.len()];
        for sym in syms.into_iter().filter(|s| s.value != 0) {
            let demangled = format!("{:#}", rustc_demangle::demangle(&sym.name));
            for (flavour, prefs) in TOKIO_PARKS.iter().enumerate() {
                if let Some(rank) = prefs.iter().position(|p| *p == demangled)
                    && found[flavour].as_ref().is_none_or(|(r, _, _)| rank < *r)
                {
                    found[flavour] = Some((rank, sym.name.clone(), demangled.clone()));
                }
            }
        }
        if found.iter().all(Option::is_none) {
            lacking::NO_TOKIO_PARKS.insert(&bin);
        }
        for (_, symbol, demangled) in found.into_iter().flatten() {
            points.push(ParkPoint {
                binary: bin.clone(),
                symbol,
                demangled,
            });
        }
    }
    points
}
